//! NetworkPolicy on the node: the controller's compiled view (per pod, the groups of policies
//! that isolate it; per policy, what it allows; per peer selector, an address set) enforced
//! with nftables, and source-address checks on every pod's veth.
//!
//! One table, `inet nodeplane-policy`, on the forward hook: pod-to-pod traffic on the node's
//! bridge reaches it too (`bridge-nf-call-iptables`/`ip6tables` are turned on in the node's
//! namespace), routed traffic to and from other nodes and outside does anyway. Traffic to and
//! from the node itself never passes the forward hook: it is always allowed, as Kubernetes
//! requires. The table:
//!
//! ```text
//! chain egress  (forward, priority -2): established/related accept; IPv6 ND accept;
//!                                        ip saddr vmap @out4; ip6 saddr vmap @out6
//! chain ingress (forward, priority -1): the same on the destination: @in4, @in6
//! map in4/in6/out4/out6                  a local pod's address : jump g_<group>
//! chain g_<group>                        jump p_<policy> … for each policy of the group; drop
//! chain p_<policy>                       one rule per allowed peer × port: accept
//! set a_<set>4 / a_<set>6                the pods a selector matches (updated in place)
//! set n_<set>4 / n_<set>6                address . protocol . port of a named port
//! ```
//!
//! An `accept` in a policy chain ends that base chain only, so a packet between two isolated
//! pods of this node passes both the source's egress and the destination's ingress. A pod
//! no policy selects has no dispatch entry: default allow. Replies of allowed connections
//! are allowed by conntrack.
//!
//! Pods are keyed by address, so the addresses must be the pods' own: a second table,
//! `bridge nodeplane-antispoof`, drops IPv4/IPv6 from any pod veth (`np…`) whose source is
//! not that veth's pod's address (link-local and unspecified IPv6 excepted, for neighbour
//! discovery). Its entries are added before a pod's ADD returns and removed at its DEL.
//!
//! Every change is one `nft -f -` transaction: the controller's changes are applied as
//! changes (set elements added and removed in place, one chain flushed and refilled), a
//! snapshot replaces the table at once.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::rpc::controller as pb;

pub const TABLE: &str = "nodeplane-policy";
pub const SPOOF_TABLE: &str = "nodeplane-antispoof";

/// The sysctls that make bridged traffic pass the inet hooks (the node's namespace).
pub const BRIDGE_SYSCTLS: &[&str] = &["net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables"];

/// Why the controller's update was refused: it would not render safely, or its references
/// do not resolve (nft would refuse the whole transaction).
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// An id that is not 1-24 letters and digits (ids name nft sets and chains).
    #[error("id {0:?} is not 1-24 letters and digits")]
    BadId(String),
    /// A value of `owner` (an address, a CIDR, a protocol, a port range) that is not one.
    #[error("{owner}: {text:?} is not {expected}")]
    BadValue { owner: String, text: String, expected: &'static str },
    /// `owner` names a `what` the view does not hold.
    #[error("{owner} names {what} {id}, which the view lacks")]
    Dangling { owner: String, what: &'static str, id: String },
    #[error(transparent)]
    Nft(#[from] NftError),
}

/// An nft transaction that did not run or that nft refused.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("{step} nft: {source}")]
    Io { step: &'static str, source: std::io::Error },
    #[error("nft failed ({status}): {stderr}")]
    Refused { status: std::process::ExitStatus, stderr: String },
}

fn nft_io(step: &'static str) -> impl FnOnce(std::io::Error) -> NftError {
    move |source| NftError::Io { step, source }
}

/// The node's compiled policy as last applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct View {
    pub address_sets: BTreeMap<String, pb::AddressSet>,
    pub port_sets: BTreeMap<String, pb::PortSet>,
    pub policies: BTreeMap<String, pb::CompiledPolicy>,
    pub groups: BTreeMap<String, pb::PolicyGroup>,
    pub pods: BTreeMap<String, pb::LocalPod>,
}

fn v6(s: &str) -> bool {
    s.contains(':')
}

/// The nft name of a protocol (`None`: unspecified or unknown).
pub(crate) fn proto_name(p: i32) -> Option<&'static str> {
    match pb::Protocol::try_from(p).ok()? {
        pb::Protocol::Tcp => Some("tcp"),
        pb::Protocol::Udp => Some("udp"),
        pb::Protocol::Sctp => Some("sctp"),
        pb::Protocol::Unspecified => None,
    }
}

impl View {
    /// This view with `u` applied (a snapshot replaces it). Refuses what it cannot render
    /// safely (ids, addresses and CIDRs are checked, never passed on as text unchecked).
    pub fn applied(&self, u: &pb::PolicyUpdate) -> Result<View, PolicyError> {
        let bad = |owner: String, text: &str, expected| PolicyError::BadValue { owner, text: text.into(), expected };
        let lacks = |owner: String, what, id: &str| PolicyError::Dangling { owner, what, id: id.into() };
        let mut v = if u.snapshot { View::default() } else { self.clone() };
        for s in &u.address_sets {
            check_id(&s.id)?;
            for c in &s.cidrs {
                c.parse::<ipnetwork::IpNetwork>().map_err(|_| bad(format!("address set {}", s.id), c, "a CIDR"))?;
            }
            v.address_sets.insert(s.id.clone(), s.clone());
        }
        for s in &u.port_sets {
            check_id(&s.id)?;
            for t in &s.targets {
                let owner = || format!("port set {}", s.id);
                t.ip.parse::<IpAddr>().map_err(|_| bad(owner(), &t.ip, "an address"))?;
                proto_name(t.protocol).ok_or_else(|| bad(owner(), &t.protocol.to_string(), "a protocol"))?;
            }
            v.port_sets.insert(s.id.clone(), s.clone());
        }
        for p in &u.policies {
            check_id(&p.id)?;
            let owner = || format!("policy {}", p.id);
            for r in &p.rules {
                for peer in &r.peers {
                    match &peer.peer {
                        Some(pb::peer_match::Peer::AddressSet(id)) => check_id(id)?,
                        Some(pb::peer_match::Peer::IpBlock(b)) => {
                            let c: ipnetwork::IpNetwork =
                                b.cidr.parse().map_err(|_| bad(owner(), &b.cidr, "a CIDR"))?;
                            for e in &b.except {
                                match e.parse::<ipnetwork::IpNetwork>() {
                                    Ok(e) if e.is_ipv4() == c.is_ipv4() => {}
                                    _ => return Err(bad(owner(), e, "a CIDR of the ipBlock's family")),
                                }
                            }
                        }
                        None => return Err(bad(owner(), "", "a peer (an address set or an ipBlock)")),
                    }
                }
                for port in &r.ports {
                    proto_name(port.protocol).ok_or_else(|| bad(owner(), &port.protocol.to_string(), "a protocol"))?;
                    if port.port > 65535 || port.end_port > 65535 || (port.end_port != 0 && port.end_port < port.port) {
                        return Err(bad(owner(), &format!("{}-{}", port.port, port.end_port), "a port range"));
                    }
                }
                for id in &r.port_sets {
                    check_id(id)?;
                }
            }
            v.policies.insert(p.id.clone(), p.clone());
        }
        for g in &u.groups {
            check_id(&g.id)?;
            for p in &g.policies {
                check_id(p)?;
            }
            v.groups.insert(g.id.clone(), g.clone());
        }
        for p in &u.pods {
            for ip in &p.ips {
                ip.parse::<IpAddr>().map_err(|_| bad(format!("pod {}", p.key), ip, "an address"))?;
            }
            for g in [&p.ingress_group, &p.egress_group] {
                if !g.is_empty() {
                    check_id(g)?;
                }
            }
            v.pods.insert(p.key.clone(), p.clone());
        }
        for id in &u.removed_address_sets {
            v.address_sets.remove(id);
        }
        for id in &u.removed_port_sets {
            v.port_sets.remove(id);
        }
        for id in &u.removed_policies {
            v.policies.remove(id);
        }
        for id in &u.removed_groups {
            v.groups.remove(id);
        }
        for k in &u.removed_pods {
            v.pods.remove(k);
        }
        // Every reference must resolve, or nft would refuse the whole transaction.
        for g in v.groups.values() {
            for p in &g.policies {
                if !v.policies.contains_key(p) {
                    return Err(lacks(format!("group {}", g.id), "policy", p));
                }
            }
        }
        for p in v.policies.values() {
            for r in &p.rules {
                for peer in &r.peers {
                    if let Some(pb::peer_match::Peer::AddressSet(id)) = &peer.peer
                        && !v.address_sets.contains_key(id)
                    {
                        return Err(lacks(format!("policy {}", p.id), "address set", id));
                    }
                }
                for id in &r.port_sets {
                    if !v.port_sets.contains_key(id) {
                        return Err(lacks(format!("policy {}", p.id), "port set", id));
                    }
                }
            }
        }
        for p in v.pods.values() {
            for g in [&p.ingress_group, &p.egress_group] {
                if !g.is_empty() && !v.groups.contains_key(g) {
                    return Err(lacks(format!("pod {}", p.key), "group", g));
                }
            }
        }
        Ok(v)
    }
}

fn check_id(id: &str) -> Result<(), PolicyError> {
    let ok = !id.is_empty() && id.len() <= 24 && id.bytes().all(|b| b.is_ascii_alphanumeric());
    if ok { Ok(()) } else { Err(PolicyError::BadId(id.into())) }
}

// ----- rendering -----

fn set_elements(cidrs: &[String], want_v6: bool) -> Vec<String> {
    cidrs.iter().filter(|c| v6(c) == want_v6).cloned().collect()
}

fn port_elements(targets: &[pb::PortTarget], want_v6: bool) -> Vec<String> {
    targets
        .iter()
        .filter(|t| v6(&t.ip) == want_v6)
        .filter_map(|t| Some(format!("{} . {} . {}", t.ip, proto_name(t.protocol)?, t.port)))
        .collect()
}

/// The rules of one compiled policy (its chain's body).
fn policy_rules(p: &pb::CompiledPolicy) -> Vec<String> {
    // Ingress matches the peer as the source; egress as the destination. Named ports are
    // the destination's, either way.
    let dir = if p.egress { "daddr" } else { "saddr" };
    let mut out = Vec::new();
    for r in &p.rules {
        // (family: None = both, Some(true) = IPv6, Some(false) = IPv4; expression)
        let mut peers: Vec<(Option<bool>, String)> = Vec::new();
        for peer in &r.peers {
            match &peer.peer {
                Some(pb::peer_match::Peer::AddressSet(id)) => {
                    peers.push((Some(false), format!("ip {dir} @a_{id}4")));
                    peers.push((Some(true), format!("ip6 {dir} @a_{id}6")));
                }
                Some(pb::peer_match::Peer::IpBlock(b)) => {
                    let is6 = v6(&b.cidr);
                    let fam = if is6 { "ip6" } else { "ip" };
                    let mut e = format!("{fam} {dir} {}", b.cidr);
                    if !b.except.is_empty() {
                        let _ = write!(e, " {fam} {dir} != {{ {} }}", b.except.join(", "));
                    }
                    peers.push((Some(is6), e));
                }
                None => {}
            }
        }
        if r.peers.is_empty() {
            peers.push((None, String::new()));
        }
        let mut ports: Vec<(Option<bool>, String)> = Vec::new();
        for port in &r.ports {
            let Some(proto) = proto_name(port.protocol) else { continue };
            let e = match (port.port, port.end_port) {
                (0, _) => format!("meta l4proto {proto}"),
                (p, e) if e > p => format!("meta l4proto {proto} th dport {p}-{e}"),
                (p, _) => format!("meta l4proto {proto} th dport {p}"),
            };
            ports.push((None, e));
        }
        for id in &r.port_sets {
            ports.push((Some(false), format!("ip daddr . meta l4proto . th dport @n_{id}4")));
            ports.push((Some(true), format!("ip6 daddr . meta l4proto . th dport @n_{id}6")));
        }
        if r.ports.is_empty() && r.port_sets.is_empty() {
            ports.push((None, String::new()));
        }
        for (pf, pe) in &peers {
            for (qf, qe) in &ports {
                if let (Some(a), Some(b)) = (pf, qf)
                    && a != b
                {
                    continue;
                }
                let rule = [pe.as_str(), qe.as_str(), "accept"]
                    .iter()
                    .filter(|s| !s.is_empty())
                    .copied()
                    .collect::<Vec<_>>()
                    .join(" ");
                out.push(rule);
            }
        }
    }
    out
}

fn group_rules(g: &pb::PolicyGroup) -> Vec<String> {
    let mut out: Vec<String> = g.policies.iter().map(|p| format!("jump p_{p}")).collect();
    out.push("drop".into());
    out
}

/// The dispatch map entries of a pod: (map, element).
fn dispatch(p: &pb::LocalPod) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for ip in &p.ips {
        let fam = if v6(ip) { "6" } else { "4" };
        if !p.ingress_group.is_empty() {
            out.push((format!("in{fam}"), format!("{ip} : jump g_{}", p.ingress_group)));
        }
        if !p.egress_group.is_empty() {
            out.push((format!("out{fam}"), format!("{ip} : jump g_{}", p.egress_group)));
        }
    }
    out
}

/// The whole table for `v`, replacing whatever the kernel holds (one transaction).
pub fn render_snapshot(v: &View) -> String {
    let mut s = format!("table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    for m in ["in4", "out4"] {
        let _ = writeln!(s, "  map {m} {{ type ipv4_addr : verdict; }}");
    }
    for m in ["in6", "out6"] {
        let _ = writeln!(s, "  map {m} {{ type ipv6_addr : verdict; }}");
    }
    for (name, prio, addr, maps) in
        [("egress", -2, "saddr", ("out4", "out6")), ("ingress", -1, "daddr", ("in4", "in6"))]
    {
        let _ = writeln!(
            s,
            "  chain {name} {{\n    type filter hook forward priority {prio}; policy accept;\n    ct state established,related accept\n    icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit, nd-router-advert, nd-redirect }} accept\n    ip {addr} vmap @{}\n    ip6 {addr} vmap @{}\n  }}",
            maps.0, maps.1
        );
    }
    s.push_str("}\n");
    // Sets, chains and elements as a change from nothing.
    s.push_str(&render_delta(&View::default(), v));
    s
}

/// The transaction that turns `old` into `new` in place.
pub fn render_delta(old: &View, new: &View) -> String {
    let t = format!("inet {TABLE}");
    let mut adds = String::new();
    let mut deletes = String::new();
    // Address and port sets: new ones made, changed ones updated element by element.
    for (id, set) in &new.address_sets {
        let before = old.address_sets.get(id);
        for (fam, is6, ty) in [("4", false, "ipv4_addr"), ("6", true, "ipv6_addr")] {
            let (had, has) = (before.map(|b| set_elements(&b.cidrs, is6)), set_elements(&set.cidrs, is6));
            set_delta(&mut adds, &format!("a_{id}{fam}"), &format!("type {ty}; flags interval;"), had, has);
        }
    }
    for (id, set) in &new.port_sets {
        let before = old.port_sets.get(id);
        for (fam, is6, ty) in [("4", false, "ipv4_addr"), ("6", true, "ipv6_addr")] {
            let (had, has) = (before.map(|b| port_elements(&b.targets, is6)), port_elements(&set.targets, is6));
            let decl = format!("type {ty} . inet_proto . inet_service;");
            set_delta(&mut adds, &format!("n_{id}{fam}"), &decl, had, has);
        }
    }
    // Chains: policies before the groups that jump to them. A new chain is made, a changed
    // one flushed and refilled (in the same transaction: never seen half-filled).
    let chain = |kind: &str, id: &str, rules: Vec<String>, existed: bool, out: &mut String| {
        if existed {
            let _ = writeln!(out, "flush chain {t} {kind}_{id}");
        } else {
            let _ = writeln!(out, "add chain {t} {kind}_{id}");
        }
        for r in rules {
            let _ = writeln!(out, "add rule {t} {kind}_{id} {r}");
        }
    };
    for (id, p) in &new.policies {
        match old.policies.get(id) {
            Some(o) if o == p => {}
            o => chain("p", id, policy_rules(p), o.is_some(), &mut adds),
        }
    }
    for (id, g) in &new.groups {
        match old.groups.get(id) {
            Some(o) if o == g => {}
            o => chain("g", id, group_rules(g), o.is_some(), &mut adds),
        }
    }
    // Pods: entries that went or changed out, new ones in.
    for (key, p) in &old.pods {
        let keep: BTreeSet<(String, String)> =
            new.pods.get(key).map(|n| dispatch(n).into_iter().collect()).unwrap_or_default();
        for (map, el) in dispatch(p) {
            if !keep.contains(&(map.clone(), el.clone())) {
                let ip = el.split(" : ").next().unwrap_or_default();
                let _ = writeln!(adds, "delete element {t} {map} {{ {ip} }}");
            }
        }
    }
    for (key, p) in &new.pods {
        let had: BTreeSet<(String, String)> =
            old.pods.get(key).map(|o| dispatch(o).into_iter().collect()).unwrap_or_default();
        for (map, el) in dispatch(p) {
            if !had.contains(&(map.clone(), el.clone())) {
                let _ = writeln!(adds, "add element {t} {map} {{ {el} }}");
            }
        }
    }
    // What nothing refers to any more goes last: groups, then policies, then sets.
    for id in old.groups.keys().filter(|id| !new.groups.contains_key(*id)) {
        let _ = writeln!(deletes, "delete chain {t} g_{id}");
    }
    for id in old.policies.keys().filter(|id| !new.policies.contains_key(*id)) {
        let _ = writeln!(deletes, "delete chain {t} p_{id}");
    }
    for id in old.address_sets.keys().filter(|id| !new.address_sets.contains_key(*id)) {
        let _ = writeln!(deletes, "delete set {t} a_{id}4\ndelete set {t} a_{id}6");
    }
    for id in old.port_sets.keys().filter(|id| !new.port_sets.contains_key(*id)) {
        let _ = writeln!(deletes, "delete set {t} n_{id}4\ndelete set {t} n_{id}6");
    }
    adds + &deletes
}

/// Set `name` made (with `decl`) when it did not exist (`had` is None), and its elements
/// brought from those it `had` to those it `has`, one by one.
fn set_delta(out: &mut String, name: &str, decl: &str, had: Option<Vec<String>>, has: Vec<String>) {
    let t = format!("inet {TABLE}");
    if had.is_none() {
        let _ = writeln!(out, "add set {t} {name} {{ {decl} }}");
    }
    let had: BTreeSet<String> = had.unwrap_or_default().into_iter().collect();
    let has: BTreeSet<String> = has.into_iter().collect();
    let gone: Vec<&str> = had.difference(&has).map(String::as_str).collect();
    let came: Vec<&str> = has.difference(&had).map(String::as_str).collect();
    if !gone.is_empty() {
        let _ = writeln!(out, "delete element {t} {name} {{ {} }}", gone.join(", "));
    }
    if !came.is_empty() {
        let _ = writeln!(out, "add element {t} {name} {{ {} }}", came.join(", "));
    }
}

/// The anti-spoofing table with these pods (host veth → addresses), replacing any other.
pub fn render_antispoof(pods: &BTreeMap<String, Vec<IpAddr>>) -> String {
    let mut s = format!(
        "table bridge {SPOOF_TABLE}\ndelete table bridge {SPOOF_TABLE}\ntable bridge {SPOOF_TABLE} {{\n  set src4 {{ type ipv4_addr . ifname; }}\n  set src6 {{ type ipv6_addr . ifname; }}\n  chain prerouting {{\n    type filter hook prerouting priority -300; policy accept;\n    iifname \"np*\" ether type ip ip saddr . iifname != @src4 drop\n    iifname \"np*\" ether type ip6 ip6 saddr != {{ ::, fe80::/10 }} ip6 saddr . iifname != @src6 drop\n  }}\n}}\n"
    );
    for (veth, ips) in pods {
        s.push_str(&antispoof_elements("add", veth, ips));
    }
    s
}

/// Add or delete one pod's anti-spoofing entries.
pub fn antispoof_elements(verb: &str, veth: &str, ips: &[IpAddr]) -> String {
    let mut s = String::new();
    for ip in ips {
        let set = if ip.is_ipv6() { "src6" } else { "src4" };
        let _ = writeln!(s, "{verb} element bridge {SPOOF_TABLE} {set} {{ {ip} . \"{veth}\" }}");
    }
    s
}

/// Run one nft transaction (the ruleset on stdin; no shell).
pub fn nft(script: &str) -> Result<(), NftError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(nft_io("running"))?;
    child.stdin.take().expect("piped").write_all(script.as_bytes()).map_err(nft_io("writing to"))?;
    let out = child.wait_with_output().map_err(nft_io("waiting for"))?;
    if !out.status.success() {
        return Err(NftError::Refused {
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().into(),
        });
    }
    Ok(())
}

/// Runs an nftables transaction (`nft`; replaced in unit tests).
pub type Runner = Box<dyn Fn(&str) -> Result<(), NftError> + Send + Sync>;

/// The node's enforcement: the view applied so far (and its revision), the pods' veths for
/// anti-spoofing; ADDs wait here until the controller's revision for their pod is in force.
pub struct Enforcer {
    st: Mutex<EnforcerState>,
    applied_cv: Condvar,
    /// Runs a transaction (nft; replaced in unit tests).
    run: Runner,
}

#[derive(Default)]
struct EnforcerState {
    view: View,
    revision: u64,
    /// A snapshot was applied since the start (until then the kernel may hold an older
    /// agent's table, which stays in force meanwhile).
    synced: bool,
    veths: BTreeMap<String, Vec<IpAddr>>,
}

impl Enforcer {
    pub fn new() -> Self {
        Self::with_runner(Box::new(nft))
    }

    pub fn with_runner(run: Runner) -> Self {
        Enforcer { st: Mutex::default(), applied_cv: Condvar::new(), run }
    }

    /// Start: the anti-spoofing table for the pods the node has (from its leases). A policy
    /// table left by an earlier agent stays in force until the controller's snapshot
    /// replaces it (pods keep their isolation across a restart); without one, an empty one
    /// is made now, so the table is there from the start.
    pub fn start(&self, veths: BTreeMap<String, Vec<IpAddr>>) -> Result<(), NftError> {
        let mut st = self.st.lock().unwrap();
        (self.run)(&render_antispoof(&veths))?;
        st.veths = veths;
        let present = Command::new("nft")
            .args(["list", "table", "inet", TABLE])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(nft_io("running"))?
            .success();
        if !present {
            (self.run)(&render_snapshot(&View::default()))?;
        }
        Ok(())
    }

    /// Apply one update from the controller (blocking: one nft transaction).
    pub fn apply(&self, u: &pb::PolicyUpdate) -> Result<(), PolicyError> {
        let mut st = self.st.lock().unwrap();
        let new = st.view.applied(u)?;
        let script = if u.snapshot || !st.synced { render_snapshot(&new) } else { render_delta(&st.view, &new) };
        if !script.is_empty() {
            (self.run)(&script).or_else(|e| {
                // A delta the kernel refused (its table changed under us?): the whole view.
                tracing::warn!(error = %e, "policy change refused; replacing the table");
                (self.run)(&render_snapshot(&new))
            })?;
        }
        st.view = new;
        st.revision = st.revision.max(u.revision);
        if u.snapshot {
            st.synced = true;
            st.revision = u.revision;
        }
        self.applied_cv.notify_all();
        Ok(())
    }

    /// Wait until the view of `revision` (or later) is in force, at most `wait`.
    pub fn wait_for(&self, revision: u64, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let mut st = self.st.lock().unwrap();
        while !(st.synced && st.revision >= revision) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self.applied_cv.wait_timeout(st, left).unwrap().0;
        }
        true
    }

    /// A pod's veth and addresses: allowed from then on.
    pub fn attach(&self, veth: &str, ips: &[IpAddr]) -> Result<(), NftError> {
        let mut st = self.st.lock().unwrap();
        (self.run)(&antispoof_elements("add", veth, ips))?;
        st.veths.insert(veth.to_string(), ips.to_vec());
        Ok(())
    }

    /// A pod's veth went (best effort: the veth is gone anyway).
    pub fn detach(&self, veth: &str) {
        let mut st = self.st.lock().unwrap();
        if let Some(ips) = st.veths.remove(veth)
            && let Err(e) = (self.run)(&antispoof_elements("delete", veth, &ips))
        {
            tracing::warn!(veth, error = %e, "removing anti-spoofing entries");
        }
    }

    /// The applied revision and whether a snapshot has been applied.
    pub fn revision(&self) -> (u64, bool) {
        let st = self.st.lock().unwrap();
        (st.revision, st.synced)
    }

    /// (policies, groups, address sets, isolated local pods) in force.
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let st = self.st.lock().unwrap();
        let v = &st.view;
        let isolated = v.pods.values().filter(|p| !p.ingress_group.is_empty() || !p.egress_group.is_empty()).count();
        (v.policies.len(), v.groups.len(), v.address_sets.len(), isolated)
    }
}

impl Default for Enforcer {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update() -> pb::PolicyUpdate {
        pb::PolicyUpdate {
            revision: 3,
            snapshot: true,
            address_sets: vec![pb::AddressSet {
                id: "s1".into(),
                cidrs: vec!["10.0.0.2/32".into(), "fd00::2/128".into()],
            }],
            port_sets: vec![pb::PortSet {
                id: "n1".into(),
                targets: vec![pb::PortTarget { ip: "10.0.0.1".into(), protocol: pb::Protocol::Tcp as i32, port: 8080 }],
            }],
            policies: vec![pb::CompiledPolicy {
                id: "p1".into(),
                name: "x/p".into(),
                egress: false,
                rules: vec![
                    pb::PolicyRule {
                        peers: vec![pb::PeerMatch { peer: Some(pb::peer_match::Peer::AddressSet("s1".into())) }],
                        ports: vec![
                            pb::PortMatch { protocol: pb::Protocol::Tcp as i32, port: 80, end_port: 81 },
                            pb::PortMatch { protocol: pb::Protocol::Sctp as i32, port: 80, end_port: 0 },
                        ],
                        port_sets: vec!["n1".into()],
                    },
                    pb::PolicyRule {
                        peers: vec![pb::PeerMatch {
                            peer: Some(pb::peer_match::Peer::IpBlock(pb::IpBlockMatch {
                                cidr: "10.0.0.0/8".into(),
                                except: vec!["10.1.0.0/16".into()],
                            })),
                        }],
                        ports: vec![],
                        port_sets: vec![],
                    },
                ],
            }],
            groups: vec![pb::PolicyGroup { id: "g1".into(), egress: false, policies: vec!["p1".into()] }],
            pods: vec![pb::LocalPod {
                key: "x/a".into(),
                ips: vec!["10.0.0.1".into(), "fd00::1".into()],
                ingress_group: "g1".into(),
                egress_group: String::new(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn rules_cover_peers_times_ports_per_family() {
        let v = View::default().applied(&update()).unwrap();
        let r = policy_rules(&v.policies["p1"]);
        assert!(r.contains(&"ip saddr @a_s14 meta l4proto tcp th dport 80-81 accept".to_string()), "{r:#?}");
        assert!(r.contains(&"ip6 saddr @a_s16 meta l4proto sctp th dport 80 accept".to_string()), "{r:#?}");
        assert!(r.contains(&"ip saddr @a_s14 ip daddr . meta l4proto . th dport @n_n14 accept".to_string()), "{r:#?}");
        assert!(
            !r.iter().any(|x| x.contains("ip saddr @a_s14") && x.contains("ip6 daddr")),
            "no mixed families: {r:#?}"
        );
        assert!(r.contains(&"ip saddr 10.0.0.0/8 ip saddr != { 10.1.0.0/16 } accept".to_string()), "{r:#?}");
        let s = render_snapshot(&v);
        assert!(s.contains("add element inet nodeplane-policy in4 { 10.0.0.1 : jump g_g1 }"), "{s}");
        assert!(s.contains("add element inet nodeplane-policy in6 { fd00::1 : jump g_g1 }"), "{s}");
        assert!(!s.contains("add element inet nodeplane-policy out4"), "not isolated for egress: {s}");
    }

    #[test]
    fn deltas_touch_only_what_changed() {
        let v1 = View::default().applied(&update()).unwrap();
        // One more pod in the peer set: one element added, nothing else.
        let u = pb::PolicyUpdate {
            revision: 4,
            address_sets: vec![pb::AddressSet {
                id: "s1".into(),
                cidrs: vec!["10.0.0.2/32".into(), "10.0.0.3/32".into(), "fd00::2/128".into()],
            }],
            ..Default::default()
        };
        let v2 = v1.applied(&u).unwrap();
        assert_eq!(render_delta(&v1, &v2), "add element inet nodeplane-policy a_s14 { 10.0.0.3/32 }\n");
        // The pod leaves its group, the group and policy go: entries out first, chains after.
        let u = pb::PolicyUpdate {
            revision: 5,
            removed_pods: vec!["x/a".into()],
            removed_groups: vec!["g1".into()],
            removed_policies: vec!["p1".into()],
            removed_address_sets: vec!["s1".into()],
            removed_port_sets: vec!["n1".into()],
            ..Default::default()
        };
        let v3 = v2.applied(&u).unwrap();
        let d = render_delta(&v2, &v3);
        let pos = |s: &str| d.find(s).unwrap_or_else(|| panic!("{s} not in {d}"));
        assert!(
            pos("delete element inet nodeplane-policy in4 { 10.0.0.1 }")
                < pos("delete chain inet nodeplane-policy g_g1")
        );
        assert!(pos("delete chain inet nodeplane-policy g_g1") < pos("delete chain inet nodeplane-policy p_p1"));
        assert!(pos("delete chain inet nodeplane-policy p_p1") < pos("delete set inet nodeplane-policy a_s14"));
    }

    #[test]
    fn bad_updates_are_refused() {
        let mut u = update();
        u.groups[0].policies = vec!["nope".into()];
        assert!(View::default().applied(&u).is_err(), "a group naming a missing policy");
        let mut u = update();
        u.address_sets[0].cidrs.push("10.0.0.1; flush ruleset".into());
        assert!(View::default().applied(&u).is_err(), "text that is no CIDR never reaches nft");
        let mut u = update();
        u.pods[0].ingress_group = "g1 }".into();
        assert!(View::default().applied(&u).is_err());
    }

    #[test]
    fn enforcer_waits_for_revisions_and_falls_back_to_a_snapshot() {
        let runs = std::sync::Arc::new(Mutex::new(Vec::<String>::new()));
        let r = runs.clone();
        let fail_next = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = fail_next.clone();
        let e = Enforcer::with_runner(Box::new(move |s: &str| {
            r.lock().unwrap().push(s.to_string());
            if !f.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return Ok(());
            }
            Err(NftError::Io { step: "running", source: std::io::Error::other("refused") })
        }));
        assert!(!e.wait_for(1, Duration::from_millis(10)), "nothing applied yet");
        e.apply(&update()).unwrap();
        assert!(e.wait_for(3, Duration::ZERO));
        fail_next.store(true, std::sync::atomic::Ordering::SeqCst);
        e.apply(&pb::PolicyUpdate { revision: 4, removed_pods: vec!["x/a".into()], ..Default::default() }).unwrap();
        let runs = runs.lock().unwrap();
        assert!(
            runs[runs.len() - 1].starts_with("table inet nodeplane-policy\ndelete table"),
            "the fallback is a whole table"
        );
        assert_eq!(e.revision(), (4, true));
    }
}
