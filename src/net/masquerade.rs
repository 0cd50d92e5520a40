//! Egress masquerade with nftables: one table, replaced atomically as a whole.
//!
//! Rules are per block, not per pod, so ADD and DEL never touch the firewall. `nft` is run
//! with an argument vector and the ruleset on stdin (no shell).

use ipnetwork::IpNetwork;

use crate::net::policy::{NftError, nft};

pub const TABLE: &str = "nodeplane";

/// Build the ruleset: pods of `blocks` leaving for anywhere outside `cluster` are masqueraded.
pub fn ruleset(blocks: &[IpNetwork], cluster: &[IpNetwork]) -> String {
    let mut sets = String::new();
    let mut rules = String::new();
    for (fam, sel, ty, v4) in [("4", "ip", "ipv4_addr", true), ("6", "ip6", "ipv6_addr", false)] {
        let mine: Vec<String> = blocks.iter().filter(|b| b.is_ipv4() == v4).map(|b| b.to_string()).collect();
        if mine.is_empty() {
            continue;
        }
        let mut exempt: Vec<String> = cluster.iter().filter(|c| c.is_ipv4() == v4).map(|c| c.to_string()).collect();
        if exempt.is_empty() {
            exempt = mine.clone();
        }
        let block = format!("{{ {} }}", mine.join(", "));
        sets.push_str(&format!(
            "  set cluster{fam} {{ type {ty}; flags interval; auto-merge; elements = {{ {} }} }}\n",
            exempt.join(", ")
        ));
        rules.push_str(&format!(
            "    {sel} saddr {block} {sel} daddr != @cluster{fam} masquerade comment \"nodeplane pod egress\"\n"
        ));
    }
    format!(
        "table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n{sets}  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n{rules}  }}\n}}\n"
    )
}

/// Apply the ruleset in the calling process's network namespace.
pub fn apply(blocks: &[IpNetwork], cluster: &[IpNetwork]) -> Result<(), NftError> {
    nft(&ruleset(blocks, cluster))
}

#[cfg(test)]
mod tests {
    #[test]
    fn ruleset_per_family() {
        let blocks = ["10.7.1.0/24".parse().unwrap(), "fd00:7:1::/64".parse().unwrap()];
        let cluster = ["10.7.0.0/16".parse().unwrap()];
        let r = super::ruleset(&blocks, &cluster);
        assert!(r.contains("ip saddr { 10.7.1.0/24 } ip daddr != @cluster4 masquerade"));
        assert!(r.contains("elements = { 10.7.0.0/16 }"));
        // No IPv6 cluster range given: the block itself is exempt.
        assert!(r.contains("elements = { fd00:7:1::/64 }"));
        assert!(r.contains("ip6 saddr { fd00:7:1::/64 }"));
        let two = super::ruleset(&[blocks[0], "10.7.2.0/24".parse().unwrap()], &cluster);
        assert!(two.contains("ip saddr { 10.7.1.0/24, 10.7.2.0/24 }"), "{two}");
    }
}
