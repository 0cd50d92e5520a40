//! Kubernetes Services on the node, without kube-proxy: the controller's service ports
//! ([`pb::ServicePort`], each with its endpoints) programmed into one nftables table,
//! `inet nodeplane-svc`, as kube-proxy's nftables mode programs its own, with one change
//! of shape: the per-service chains of kube-proxy are, for the common case, map elements.
//!
//! ```text
//! chain services   (nat prerouting and output, dstnat): ClusterIP traffic from outside the
//!                  pod pools is marked for masquerade; ip daddr . proto . port vmap @vip;
//!                  ip daddr @nodeips proto . port vmap @np
//! map vip4/vip6    ClusterIP, externalIP, LB IP . proto . port : goto <how to pick>
//! map np4/np6      NodePort proto . port : goto <how to pick>
//! chain lb4_N      dnat to @ep4[daddr . proto . port . (random mod N)]   (one per N in use)
//! chain xc4_N      mark for masquerade, goto lb4_N (external traffic, policy Cluster)
//! map ep4/epx4     daddr . proto . port . index : endpoint address . port (all / local)
//! chain s<h>_…     per port only where kube-proxy's semantics need it: session affinity
//!                  (a dynamic set per endpoint), externalTrafficPolicy Local (pods and the
//!                  host short-circuit to every endpoint, the rest to local ones)
//! chain no-endpoints (filter input/forward, and output after DNAT): new connections to a key without endpoints:
//!                  @noep/@nonp (reject, or drop where a Local policy leaves none); other
//!                  ports of a ClusterIP: reject
//! chain nat-post   (nat postrouting): masquerade what was marked, and hairpin (a pod that
//!                  reached itself through its Service: @self holds each local endpoint's pair)
//! ```
//!
//! So a change of one Service is a handful of element updates and, only for affinity or
//! a Local external policy, that Service's own chains: its cost does not grow with the
//! number of Services. Which endpoints a node uses follows kube-proxy: ready endpoints,
//! else serving and terminating ones, chosen separately among all endpoints and among this
//! node's ([`usable`]). Every change is one `nft -f -` transaction.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Instant;

use crate::rpc::controller as pb;

pub const TABLE: &str = "nodeplane-svc";
/// The packet mark bit that asks the postrouting chain to masquerade (kube-proxy's is 0x4000;
/// ours is another, so the two never read each other's).
pub const MASQ_MARK: u32 = 0x0020_0000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fam {
    V4,
    V6,
}

impl Fam {
    pub fn of(ip: &IpAddr) -> Fam {
        if ip.is_ipv4() { Fam::V4 } else { Fam::V6 }
    }
    fn n(self) -> &'static str {
        match self {
            Fam::V4 => "4",
            Fam::V6 => "6",
        }
    }
    /// The nft payload keyword (`ip`, `ip6`).
    fn ip(self) -> &'static str {
        match self {
            Fam::V4 => "ip",
            Fam::V6 => "ip6",
        }
    }
    fn addr_type(self) -> &'static str {
        match self {
            Fam::V4 => "ipv4_addr",
            Fam::V6 => "ipv6_addr",
        }
    }
}

/// One endpoint as the node dials it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Ep {
    pub ip: IpAddr,
    pub port: u16,
}

/// kube-proxy's choice among `eps`: the ready ones, else those serving and terminating.
/// `node`: only the endpoints on that node.
pub fn usable(eps: &[pb::ServiceEndpoint], fam: Fam, node: Option<&str>) -> Vec<Ep> {
    let mine = |e: &&pb::ServiceEndpoint| node.is_none_or(|n| e.node == n);
    let parse = |e: &pb::ServiceEndpoint| {
        let ip: IpAddr = e.ip.parse().ok()?;
        let port = u16::try_from(e.port).ok().filter(|p| *p > 0)?;
        (Fam::of(&ip) == fam).then_some(Ep { ip, port })
    };
    let ready: Vec<Ep> = eps.iter().filter(mine).filter(|e| e.ready).filter_map(parse).collect();
    if !ready.is_empty() {
        return ready;
    }
    eps.iter().filter(mine).filter(|e| e.serving && e.terminating).filter_map(parse).collect()
}

/// How the node treats new connections to one key (an address or a NodePort).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// DNAT to one of `eps` (at random, or by client address with affinity); `masquerade`:
    /// external traffic of policy Cluster.
    Dnat { eps: Vec<Ep>, masquerade: bool },
    /// externalTrafficPolicy Local: pods of this node and the host itself to any of
    /// `cluster` (the host masqueraded), everyone else to one of `local`, dropped when there
    /// is none.
    Split { cluster: Vec<Ep>, local: Vec<Ep> },
    /// No endpoint at all: rejected (ICMP port unreachable), as kube-proxy does.
    Reject,
    /// A Local policy leaves no endpoint here: dropped.
    Drop,
}

/// What one service port asks of this node, family by family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// (address, key target) for ClusterIPs, and for external addresses.
    pub cluster_ips: Vec<(IpAddr, Target)>,
    pub external_ips: Vec<(IpAddr, Target)>,
    /// The NodePort's target per family (none without a NodePort).
    pub node_port: Vec<(Fam, Target)>,
    pub affinity_seconds: u32,
}

/// The node's plan for `p` (kube-proxy's semantics; `node`: this node's name).
pub fn plan(p: &pb::ServicePort, node: &str) -> Plan {
    let mut out = Plan { affinity_seconds: p.affinity_seconds, ..Default::default() };
    let any = |fam| !usable(&p.endpoints, fam, None).is_empty();
    let internal = |fam| {
        let eps = usable(&p.endpoints, fam, p.internal_local.then_some(node));
        match (eps.is_empty(), any(fam)) {
            (false, _) => Target::Dnat { eps, masquerade: false },
            (true, true) => Target::Drop,
            (true, false) => Target::Reject,
        }
    };
    let external = |fam| {
        let all = usable(&p.endpoints, fam, None);
        if all.is_empty() {
            Target::Reject
        } else if p.external_local {
            Target::Split { cluster: all, local: usable(&p.endpoints, fam, Some(node)) }
        } else {
            Target::Dnat { eps: all, masquerade: true }
        }
    };
    for ip in p.cluster_ips.iter().filter_map(|s| s.parse::<IpAddr>().ok()) {
        out.cluster_ips.push((ip, internal(Fam::of(&ip))));
    }
    for ip in p.external_ips.iter().filter_map(|s| s.parse::<IpAddr>().ok()) {
        out.external_ips.push((ip, external(Fam::of(&ip))));
    }
    if p.node_port > 0 {
        let fams: BTreeSet<Fam> = p.cluster_ips.iter().filter_map(|s| s.parse().ok()).map(|i| Fam::of(&i)).collect();
        for fam in fams {
            out.node_port.push((fam, external(fam)));
        }
    }
    out
}

// ----- rendering -----

/// One map element: (map, key, value); a set element has the value "".
type Element = (String, String, String);

/// What one service port puts into the table.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rendered {
    /// The port's own chains, leaves first: (name, rules).
    pub chains: Vec<(String, Vec<String>)>,
    /// The port's own sets (session affinity): (name, declaration).
    pub sets: Vec<(String, String)>,
    pub elements: Vec<Element>,
    /// The shared chains it dispatches to (made once, kept).
    pub shared: BTreeSet<String>,
}

/// A key of the `vip` map, or of the `np` map (no address).
#[derive(Clone)]
struct Key {
    fam: Fam,
    addr: Option<IpAddr>,
    proto: &'static str,
    port: u32,
}

impl Key {
    fn text(&self) -> String {
        match self.addr {
            Some(a) => format!("{a} . {} . {}", self.proto, self.port),
            None => format!("{} . {}", self.proto, self.port),
        }
    }
    /// The map of its targets (`vip4`, `np6`, …), its no-endpoint map and the prefix of its
    /// endpoint maps and shared chains.
    fn map(&self) -> String {
        format!("{}{}", if self.addr.is_some() { "vip" } else { "np" }, self.fam.n())
    }
    fn noep(&self) -> String {
        format!("{}{}", if self.addr.is_some() { "noep" } else { "nonp" }, self.fam.n())
    }
    fn ep_map(&self, local: bool) -> String {
        format!("{}{}{}", if self.addr.is_some() { "ep" } else { "nep" }, if local { "x" } else { "" }, self.fam.n())
    }
    fn lb(&self, local: bool, n: usize) -> String {
        format!(
            "{}{}{}_{n}",
            if self.addr.is_some() { "lb" } else { "nlb" },
            if local { "x" } else { "" },
            self.fam.n()
        )
    }
}

fn masq_rule() -> String {
    format!("meta mark set meta mark or {MASQ_MARK:#x}")
}

/// The table entries of one service port on this node.
pub fn render(p: &pb::ServicePort, node: &str) -> Rendered {
    let plan = plan(p, node);
    let mut r = Rendered::default();
    let h = format!("{:012x}", crate::util::fnv1a(&[p.id.as_bytes()]) & 0xffff_ffff_ffff);
    let proto = crate::net::policy::proto_name(p.protocol).unwrap_or("tcp");
    let mut keys: Vec<(Key, Target, bool)> = Vec::new();
    // Hairpin: a pod of this node that is an endpoint may reach itself through the port.
    for ip in p.endpoints.iter().filter(|e| e.node == node).filter_map(|e| e.ip.parse::<IpAddr>().ok()) {
        r.elements.push((format!("self{}", Fam::of(&ip).n()), format!("{ip} . {ip}"), String::new()));
    }
    for (ip, t) in &plan.cluster_ips {
        r.elements.push((format!("clusterips{}", Fam::of(ip).n()), ip.to_string(), String::new()));
        keys.push((Key { fam: Fam::of(ip), addr: Some(*ip), proto, port: p.port }, t.clone(), false));
    }
    for (ip, t) in &plan.external_ips {
        keys.push((Key { fam: Fam::of(ip), addr: Some(*ip), proto, port: p.port }, t.clone(), true));
    }
    for (fam, t) in &plan.node_port {
        keys.push((Key { fam: *fam, addr: None, proto, port: p.node_port }, t.clone(), true));
    }
    let mut aff = Affinity { h: &h, proto, seconds: plan.affinity_seconds, made: BTreeSet::new() };
    for (key, target, external) in keys {
        render_key(&mut r, &mut aff, &key, &target, external);
    }
    r
}

/// The affinity chains of one port, each made once: one per list of endpoints it picks
/// among, and one set and chain per endpoint.
struct Affinity<'a> {
    h: &'a str,
    proto: &'static str,
    seconds: u32,
    made: BTreeSet<String>,
}

/// `ip:port` of an endpoint, as a DNAT target.
fn ep_text(ep: &Ep) -> String {
    match ep.ip {
        IpAddr::V4(a) => format!("{a}:{}", ep.port),
        IpAddr::V6(a) => format!("[{a}]:{}", ep.port),
    }
}

fn hash32(text: &str) -> u64 {
    crate::util::fnv1a(&[text.as_bytes()]) & 0xffff_ffff
}

impl Affinity<'_> {
    /// The chain that picks among `eps` by client address (made on first use). It is named
    /// after the list, so two lists of one port (all endpoints, this node's) never share it.
    /// Each endpoint's set of clients and its chain are named after the endpoint, so a
    /// client stays with its endpoint while others come and go, as with kube-proxy.
    fn chain(&mut self, r: &mut Rendered, fam: Fam, eps: &[Ep]) -> String {
        let targets: Vec<String> = eps.iter().map(ep_text).collect();
        let name = format!("s{}_{:08x}{}", self.h, hash32(&targets.join(",")), fam.n());
        if !self.made.insert(name.clone()) {
            return name;
        }
        let mut dispatch = Vec::new();
        let mut arms = Vec::new();
        for (i, to) in targets.iter().enumerate() {
            let set = format!("s{}_{:08x}", self.h, hash32(to));
            if self.made.insert(set.clone()) {
                r.sets.push((
                    set.clone(),
                    format!("type {}; flags dynamic,timeout; timeout {}s;", fam.addr_type(), self.seconds),
                ));
                // The timeout is in the rule too: a changed timeout changes the rule, which
                // is written again (a set's declaration is not).
                r.chains.push((
                    format!("{set}e"),
                    vec![
                        format!("update @{set} {{ {} saddr timeout {}s }}", fam.ip(), self.seconds),
                        format!("meta l4proto {} dnat {} to {to}", self.proto, fam.ip()),
                    ],
                ));
            }
            dispatch.push(format!("{} saddr @{set} goto {set}e", fam.ip()));
            arms.push(format!("{i} : goto {set}e"));
        }
        dispatch.push(format!("numgen random mod {} vmap {{ {} }}", eps.len(), arms.join(", ")));
        r.chains.push((name.clone(), dispatch));
        name
    }

    fn masqueraded(&mut self, r: &mut Rendered, fam: Fam, eps: &[Ep]) -> String {
        let inner = self.chain(r, fam, eps);
        let name = format!("{inner}m");
        if self.made.insert(name.clone()) {
            r.chains.push((name.clone(), vec![format!("{} goto {inner}", masq_rule())]));
        }
        name
    }
}

/// The chain that picks one of `eps` for `key` (list `local` or all): a shared random one,
/// with the endpoints as elements of the key, or the port's affinity chain.
fn dispatch(r: &mut Rendered, aff: &mut Affinity, key: &Key, local: bool, eps: &[Ep]) -> String {
    if aff.seconds > 0 {
        return aff.chain(r, key.fam, eps);
    }
    let map = key.ep_map(local);
    for (i, ep) in eps.iter().enumerate() {
        r.elements.push((map.clone(), format!("{} . {i}", key.text()), format!("{} . {}", ep.ip, ep.port)));
    }
    let chain = key.lb(local, eps.len());
    r.shared.insert(chain.clone());
    chain
}

fn render_key(r: &mut Rendered, aff: &mut Affinity, key: &Key, target: &Target, external: bool) {
    let (map, k) = (key.map(), key.text());
    match target {
        Target::Reject => r.elements.push((key.noep(), k, "goto refuse".into())),
        Target::Drop => r.elements.push((key.noep(), k, "drop".into())),
        Target::Dnat { eps, masquerade } => {
            let to = if *masquerade && aff.seconds > 0 {
                aff.masqueraded(r, key.fam, eps)
            } else {
                let inner = dispatch(r, aff, key, false, eps);
                if *masquerade {
                    let name = format!("xc{inner}");
                    r.shared.insert(name.clone());
                    name
                } else {
                    inner
                }
            };
            r.elements.push((map, k, format!("goto {to}")));
        }
        Target::Split { cluster, local } => {
            debug_assert!(external);
            let name = format!("s{}_e{}{}", aff.h, key.fam.n(), if key.addr.is_some() { "v" } else { "n" });
            let all = dispatch(r, aff, key, false, cluster);
            let mut rules = vec![
                format!("{} saddr @podnets{} goto {all}", key.fam.ip(), key.fam.n()),
                format!("fib saddr type local {} goto {all}", masq_rule()),
            ];
            if local.is_empty() {
                r.elements.push((key.noep(), k.clone(), "drop".into()));
            } else {
                rules.push(format!("goto {}", dispatch(r, aff, key, true, local)));
            }
            if !r.chains.iter().any(|(n, _)| *n == name) {
                r.chains.push((name.clone(), rules));
            }
            r.elements.push((map, k, format!("goto {name}")));
        }
    }
}

/// The rules of a shared chain, from its name (`lb4_3`, `nlbx6_2`, `xclb4_3`, …).
fn shared_rules(name: &str) -> Vec<String> {
    if let Some(inner) = name.strip_prefix("xc") {
        return vec![format!("{} goto {inner}", masq_rule())];
    }
    let (head, n) = name.rsplit_once('_').expect("shared chains end in _N");
    let fam = if head.ends_with('6') { Fam::V6 } else { Fam::V4 };
    let node_port = head.starts_with('n');
    let map =
        format!("{}{}{}", if node_port { "nep" } else { "ep" }, if head.contains('x') { "x" } else { "" }, fam.n());
    let lookup = if node_port { String::new() } else { format!("{} daddr . ", fam.ip()) };
    vec![format!("dnat {} to {lookup}meta l4proto . th dport . numgen random mod {n} map @{map}", fam.ip())]
}

/// The table without any service: sets, maps and base chains.
pub fn render_base(pod_cidrs: &[String], node_ips: &[IpAddr]) -> String {
    let mut s = format!("table inet {TABLE} {{\n");
    for fam in [Fam::V4, Fam::V6] {
        let (n, ip, t) = (fam.n(), fam.ip(), fam.addr_type());
        let _ = write!(
            s,
            "  set podnets{n} {{ type {t}; flags interval; }}\n  set nodeips{n} {{ type {t}; }}\n  set clusterips{n} {{ type {t}; }}\n  set self{n} {{ type {t} . {t}; }}\n  map vip{n} {{ typeof {ip} daddr . meta l4proto . th dport : verdict; }}\n  map noep{n} {{ typeof {ip} daddr . meta l4proto . th dport : verdict; }}\n  map np{n} {{ typeof meta l4proto . th dport : verdict; }}\n  map nonp{n} {{ typeof meta l4proto . th dport : verdict; }}\n"
        );
        for (name, lookup) in [("ep", format!("{ip} daddr . ")), ("nep", String::new())] {
            for x in ["", "x"] {
                let _ = writeln!(
                    s,
                    "  map {name}{x}{n} {{ typeof {lookup}meta l4proto . th dport . numgen random mod 1 : {ip} daddr . th dport; }}"
                );
            }
        }
    }
    let m = MASQ_MARK;
    let _ = write!(
        s,
        "  chain refuse {{\n    reject\n  }}\n  chain services {{\n    ip daddr @clusterips4 ip saddr != @podnets4 meta mark set meta mark or {m:#x}\n    ip6 daddr @clusterips6 ip6 saddr != @podnets6 meta mark set meta mark or {m:#x}\n    ip daddr . meta l4proto . th dport vmap @vip4\n    ip6 daddr . meta l4proto . th dport vmap @vip6\n    ip daddr @nodeips4 meta l4proto . th dport vmap @np4\n    ip6 daddr @nodeips6 meta l4proto . th dport vmap @np6\n  }}\n  chain nat-pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n    jump services\n  }}\n  chain nat-out {{\n    type nat hook output priority -100; policy accept;\n    jump services\n  }}\n  chain no-endpoints {{\n    ip daddr . meta l4proto . th dport vmap @noep4\n    ip6 daddr . meta l4proto . th dport vmap @noep6\n    ip daddr @nodeips4 meta l4proto . th dport vmap @nonp4\n    ip6 daddr @nodeips6 meta l4proto . th dport vmap @nonp6\n    ip daddr @clusterips4 goto refuse\n    ip6 daddr @clusterips6 goto refuse\n  }}\n  chain filter-in {{\n    type filter hook input priority filter; policy accept;\n    ct state new jump no-endpoints\n  }}\n  chain filter-fwd {{\n    type filter hook forward priority filter; policy accept;\n    ct state new jump no-endpoints\n  }}\n  chain filter-out {{\n    type filter hook output priority -90; policy accept;\n    ct state new jump no-endpoints\n  }}\n  chain nat-post {{\n    type nat hook postrouting priority srcnat; policy accept;\n    meta mark and {m:#x} == {m:#x} meta mark set meta mark and {:#x} masquerade fully-random\n    ct status dnat ip saddr . ip daddr @self4 masquerade fully-random\n    ct status dnat ip6 saddr . ip6 daddr @self6 masquerade fully-random\n  }}\n}}\n",
        !m
    );
    let cidrs: Vec<IpNet> = pod_cidrs.iter().filter_map(|c| c.parse().ok()).collect();
    for fam in [Fam::V4, Fam::V6] {
        let of = |ip: &IpAddr| Fam::of(ip) == fam;
        add_elements(
            &mut s,
            &format!("podnets{}", fam.n()),
            cidrs.iter().filter(|c| of(&c.ip())).map(|c| c.to_string()),
        );
        add_elements(&mut s, &format!("nodeips{}", fam.n()), node_ips.iter().filter(|i| of(i)).map(|i| i.to_string()));
    }
    s
}

type IpNet = ipnetwork::IpNetwork;

fn add_elements(s: &mut String, set: &str, items: impl Iterator<Item = String>) {
    let items: Vec<String> = items.collect();
    if !items.is_empty() {
        let _ = writeln!(s, "add element inet {TABLE} {set} {{ {} }}", items.join(", "));
    }
}

fn shared_chain(s: &mut String, name: &str) {
    let _ = writeln!(s, "add chain inet {TABLE} {name}");
    for rule in shared_rules(name) {
        let _ = writeln!(s, "add rule inet {TABLE} {name} {rule}");
    }
}

// ----- the table, kept in step with the controller's ports -----

/// Which owner's value each element has (two ports may name one key: externalIPs of two
/// Services; the first port's wins, as kube-proxy picks one). Owners are kept in a vector
/// sorted by id: almost every element has one, and a map per element would cost 0.5 KiB
/// of each of the 500,000 elements of 100,000 Services.
#[derive(Default)]
struct Elements(BTreeMap<(String, String), Vec<(String, String)>>);

impl Elements {
    /// The value in force: the first owner's (an element is kept only while it has one).
    fn value(&self, k: &(String, String)) -> Option<&String> {
        self.0.get(k).map(|o| &o[0].1)
    }

    /// Every element with the value in force, in key order.
    fn in_force(&self) -> impl Iterator<Item = (&(String, String), &String)> {
        self.0.iter().map(|(k, o)| (k, &o[0].1))
    }

    /// Port `id` gives element `k` the value `v` (instead of what it gave before).
    fn own(&mut self, k: (String, String), id: &str, v: &str) {
        let owners = self.0.entry(k).or_default();
        match owners.binary_search_by(|(o, _)| o.as_str().cmp(id)) {
            Ok(i) => owners[i].1 = v.to_string(),
            Err(i) => owners.insert(i, (id.to_string(), v.to_string())),
        }
    }

    /// Port `id` no longer gives element `k` a value.
    fn disown(&mut self, k: &(String, String), id: &str) {
        if let Some(owners) = self.0.get_mut(k) {
            owners.retain(|(o, _)| o != id);
            if owners.is_empty() {
                self.0.remove(k);
            }
        }
    }
}

#[derive(Default)]
struct State {
    ports: BTreeMap<String, pb::ServicePort>,
    /// Ports per Service and endpoints in all: kept as ports come and go, so that reading
    /// them (every metrics scrape) costs nothing with 100,000 Services.
    services: BTreeMap<String, usize>,
    endpoints: usize,
    elements: Elements,
    shared: BTreeSet<String>,
    pod_cidrs: Vec<String>,
    /// Whether a snapshot is in the kernel (until then every change writes the table anew).
    synced: bool,
}

impl State {
    /// Put `port` in force under `id` (None: remove it), keeping the counts.
    fn set_port(&mut self, id: String, port: Option<pb::ServicePort>) {
        let service = id.rsplitn(3, '/').last().unwrap_or(&id).to_string();
        if let Some(old) = self.ports.remove(&id) {
            self.endpoints -= old.endpoints.len();
            if let Some(n) = self.services.get_mut(&service) {
                *n -= 1;
                if *n == 0 {
                    self.services.remove(&service);
                }
            }
        }
        if let Some(p) = port {
            self.endpoints += p.endpoints.len();
            *self.services.entry(service).or_default() += 1;
            self.ports.insert(id, p);
        }
    }
}

/// The node's Services: the ports applied and the table that serves them.
pub struct Proxy {
    node: String,
    node_ips: Vec<IpAddr>,
    st: Mutex<State>,
    /// Runs a transaction (nft; replaced in unit tests).
    run: crate::net::policy::Runner,
    /// Lists our table without elements ([`list_table`]; replaced in unit tests).
    list: Lister,
}

/// Lists the table's objects: `nft -t list table` output, `None` when there is no table or
/// it cannot be read.
pub type Lister = Box<dyn Fn() -> Option<String> + Send + Sync>;

/// What one apply did, for metrics and status.
#[derive(Debug, Default, Clone)]
pub struct Applied {
    pub seconds: f64,
    pub whole_table: bool,
    /// The UDP flows the update left pointing the wrong way ([`stale_udp_flows`]), for
    /// [`forget_flows`].
    pub stale_flows: Vec<Vec<String>>,
}

impl Proxy {
    pub fn new(node: &str, node_ips: Vec<IpAddr>) -> Self {
        Self::with_runner(node, node_ips, Box::new(crate::net::policy::nft)).with_lister(Box::new(list_table))
    }

    /// A proxy whose transactions go to `run`, and which sees no table left by anyone.
    pub fn with_runner(node: &str, node_ips: Vec<IpAddr>, run: crate::net::policy::Runner) -> Self {
        Proxy { node: node.to_string(), node_ips, st: Mutex::default(), run, list: Box::new(|| None) }
    }

    pub fn with_lister(self, list: Lister) -> Self {
        Proxy { list, ..self }
    }

    /// The ports in force, by id.
    pub fn ports(&self) -> BTreeMap<String, pb::ServicePort> {
        self.st.lock().unwrap().ports.clone()
    }

    /// (services, ports, endpoints) programmed.
    pub fn counts(&self) -> (usize, usize, usize) {
        let st = self.st.lock().unwrap();
        (st.services.len(), st.ports.len(), st.endpoints)
    }

    /// A snapshot (`replace`) or changes from the controller, in force when this returns.
    pub fn apply(
        &self,
        replace: bool,
        pod_cidrs: Option<&[String]>,
        ports: Vec<pb::ServicePort>,
        removed: Vec<String>,
    ) -> Result<Applied, crate::net::policy::NftError> {
        let started = Instant::now();
        let mut st = self.st.lock().unwrap();
        if let Some(c) = pod_cidrs {
            st.pod_cidrs = c.to_vec();
        }
        let whole = replace || !st.synced;
        // The touched ports as they will be (None: removed). A change never copies the
        // ports it does not touch: its cost must not grow with the number of Services.
        let mut updates: BTreeMap<String, Option<pb::ServicePort>> = removed.into_iter().map(|id| (id, None)).collect();
        for p in ports {
            updates.insert(p.id.clone(), Some(p));
        }
        let large = whole || updates.len() >= 256;
        let mut stale: Vec<Vec<String>> =
            updates.iter().flat_map(|(id, p)| stale_udp_flows(st.ports.get(id), p.as_ref())).collect();
        if replace {
            // A port the snapshot no longer has is removed by it.
            let gone = st.ports.iter().filter(|(id, _)| !updates.contains_key(*id));
            stale.extend(gone.flat_map(|(_, p)| stale_udp_flows(Some(p), None)));
            // Gone before the new table is made, so two tables' ports are never held at
            // once. A failed write leaves the agent unsynced, and it asks for a snapshot.
            st.ports.clear();
            st.services.clear();
            st.endpoints = 0;
        }
        let mut result = Ok(());
        if !whole {
            let script = self.changes(&mut st, &updates);
            result = (self.run)(&script);
            if let Err(e) = &result {
                tracing::warn!(error = %e, "service change refused; writing the table anew");
            }
        }
        if whole || result.is_err() {
            // The ports as they will be, by id, borrowed: a copy would double the agent's
            // memory for the time of the write. The bookkeeping is made anew.
            st.elements = Elements::default();
            let kept = st.ports.iter().filter(|(id, _)| !updates.contains_key(*id));
            let mut next: Vec<(&String, &pb::ServicePort)> =
                kept.chain(updates.iter().filter_map(|(id, p)| Some(id).zip(p.as_ref()))).collect();
            next.sort_unstable_by_key(|(id, _)| *id);
            let listing = (self.list)();
            let (script, elements, shared) = self.whole(&st, &next, listing.as_deref());
            if let Err(e) = (self.run)(&script) {
                // Whatever the kernel holds now, the next change writes the whole table.
                st.synced = false;
                return Err(e);
            }
            (st.elements, st.shared) = (elements, shared);
        }
        for (id, p) in updates {
            st.set_port(id, p);
        }
        st.synced = true;
        drop(st);
        if large {
            release_free_memory();
        }
        Ok(Applied { seconds: started.elapsed().as_secs_f64(), whole_table: whole, stale_flows: stale })
    }

    /// Remove the table (Services turned off, or left to kube-proxy).
    pub fn remove(&self) -> Result<(), crate::net::policy::NftError> {
        let mut st = self.st.lock().unwrap();
        (self.run)(&format!("table inet {TABLE}\ndelete table inet {TABLE}\n"))?;
        *st = State::default();
        Ok(())
    }

    /// The whole table for `ports` (sorted by id), and the element bookkeeping it makes.
    /// The table `listing` shows is emptied object by object, but for the session affinity
    /// sets the ports still have: their clients stay with their endpoints across an agent
    /// restart, as with kube-proxy. Without a listing the table is deleted and made anew.
    fn whole(
        &self,
        st: &State,
        ports: &[(&String, &pb::ServicePort)],
        listing: Option<&str>,
    ) -> (String, Elements, BTreeSet<String>) {
        // Each port is rendered twice, once for its elements and once for its chains:
        // keeping 100,000 renderings between the two would add a third to the agent's peak
        // memory, and rendering is cheap.
        let objects = listing.map(table_objects).unwrap_or_default();
        let listed_sets: BTreeSet<&str> = objects.iter().filter(|(k, _)| *k == "set").map(|(_, n)| *n).collect();
        let mut elements = Elements::default();
        let mut shared = BTreeSet::new();
        let mut kept: BTreeSet<String> = BTreeSet::new();
        for (id, p) in ports {
            let r = render(p, &self.node);
            for (m, k, v) in r.elements {
                elements.own((m, k), id, &v);
            }
            shared.extend(r.shared);
            kept.extend(r.sets.into_iter().map(|(n, _)| n).filter(|n| listed_sets.contains(n.as_str())));
        }
        let mut s = match listing {
            None => format!("table inet {TABLE}\ndelete table inet {TABLE}\n"),
            // Rules first (flush), then what they named: maps (whose verdicts name chains),
            // sets, chains.
            Some(_) => format!("add table inet {TABLE}\nflush table inet {TABLE}\n"),
        };
        for kind in ["map", "set", "chain"] {
            for (_, name) in objects.iter().filter(|(k, n)| *k == kind && !(kind == "set" && kept.contains(*n))) {
                let _ = writeln!(s, "delete {kind} inet {TABLE} {name}");
            }
        }
        s.push_str(&render_base(&st.pod_cidrs, &self.node_ips));
        for name in shared_order(&shared) {
            shared_chain(&mut s, &name);
        }
        for (_, p) in ports {
            let r = render(p, &self.node);
            let old: Vec<&String> = r.sets.iter().map(|(n, _)| n).filter(|n| kept.contains(*n)).collect();
            write_sets_and_chains(&mut s, &r, &old, &BTreeMap::new());
        }
        write_elements(&mut s, &elements);
        (s, elements, shared)
    }

    /// The transaction that brings the table from `st` to `updates` (the ports touched, as
    /// they will be); updates `st`'s element bookkeeping to match.
    fn changes(&self, st: &mut State, updates: &BTreeMap<String, Option<pb::ServicePort>>) -> String {
        let mut s = String::new();
        let mut keys: BTreeSet<(String, String)> = BTreeSet::new();
        let mut gone_chains: Vec<String> = Vec::new();
        let mut gone_sets: Vec<String> = Vec::new();
        let mut before: BTreeMap<(String, String), Option<String>> = BTreeMap::new();
        let mut news: Vec<Rendered> = Vec::new();
        let mut olds: Vec<Rendered> = Vec::new();
        for (id, next) in updates {
            // What a port had in force is rendered again from it: rendering is a pure
            // function of the port and the node, and keeping every port's rendering would
            // double the agent's memory.
            let old = st.ports.get(id).map(|p| render(p, &self.node)).unwrap_or_default();
            let new = next.as_ref().map(|p| render(p, &self.node)).unwrap_or_default();
            for (m, k, _) in old.elements.iter().chain(new.elements.iter()) {
                let key = (m.clone(), k.clone());
                before.entry(key.clone()).or_insert_with(|| st.elements.value(&key).cloned());
                keys.insert(key);
            }
            for (m, k, _) in &old.elements {
                st.elements.disown(&(m.clone(), k.clone()), id);
            }
            for (m, k, v) in &new.elements {
                st.elements.own((m.clone(), k.clone()), id, v);
            }
            let new_chains: BTreeSet<&String> = new.chains.iter().map(|(n, _)| n).collect();
            gone_chains.extend(old.chains.iter().rev().map(|(n, _)| n).filter(|n| !new_chains.contains(n)).cloned());
            let new_sets: BTreeSet<&String> = new.sets.iter().map(|(n, _)| n).collect();
            gone_sets.extend(old.sets.iter().map(|(n, _)| n).filter(|n| !new_sets.contains(n)).cloned());
            news.push(new);
            olds.push(old);
        }
        let wanted: BTreeSet<String> = news.iter().flat_map(|r| r.shared.iter().cloned()).collect();
        for name in shared_order(&wanted) {
            if st.shared.insert(name.clone()) {
                shared_chain(&mut s, &name);
            }
        }
        for (new, old) in news.iter().zip(&olds) {
            let old_chains: BTreeMap<&String, &Vec<String>> = old.chains.iter().map(|(n, r)| (n, r)).collect();
            let old_sets: Vec<&String> = old.sets.iter().map(|(n, _)| n).collect();
            write_sets_and_chains(&mut s, new, &old_sets, &old_chains);
        }
        // Elements: removed or changed first, then added or changed.
        let mut dels: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let mut adds: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for key in &keys {
            let (was, now) = (before.get(key).cloned().flatten(), st.elements.value(key).cloned());
            if was == now {
                continue;
            }
            if was.is_some() {
                dels.entry(&key.0).or_default().push(key.1.clone());
            }
            if let Some(v) = now {
                adds.entry(&key.0).or_default().push(if v.is_empty() {
                    key.1.clone()
                } else {
                    format!("{} : {v}", key.1)
                });
            }
        }
        for (m, items) in dels {
            let _ = writeln!(s, "delete element inet {TABLE} {m} {{ {} }}", items.join(", "));
        }
        for (m, items) in adds {
            let _ = writeln!(s, "add element inet {TABLE} {m} {{ {} }}", items.join(", "));
        }
        for c in &gone_chains {
            let _ = writeln!(s, "flush chain inet {TABLE} {c}");
        }
        for c in &gone_chains {
            let _ = writeln!(s, "delete chain inet {TABLE} {c}");
        }
        for set in &gone_sets {
            let _ = writeln!(s, "delete set inet {TABLE} {set}");
        }
        s
    }
}

/// Give the heap's free pages back to the kernel. After a large update glibc keeps what the
/// update freed (at 100,000 Services, hundreds of MiB) for later use, and until then it
/// counts against the agent's memory limit.
fn release_free_memory() {
    // SAFETY: malloc_trim only releases pages of the allocator's own free chunks, under the
    // allocator's locks, as any malloc call takes them.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `add element` lines for every element, 4,096 to a line, in the bookkeeping's order.
fn write_elements(s: &mut String, elements: &Elements) {
    let mut line: Option<(&str, usize)> = None; // the map of the line being written, its items
    for ((m, k), v) in elements.in_force() {
        let n = match line {
            Some((open, n)) if open == m && n < 4096 => {
                s.push_str(", ");
                n
            }
            open => {
                if open.is_some() {
                    s.push_str(" }\n");
                }
                let _ = write!(s, "add element inet {TABLE} {m} {{ ");
                0
            }
        };
        line = Some((m, n + 1));
        s.push_str(k);
        if !v.is_empty() {
            s.push_str(" : ");
            s.push_str(v);
        }
    }
    if line.is_some() {
        s.push_str(" }\n");
    }
}

/// Shared chains in an order that makes each before the chains that go to it (`xclb4_2`
/// goes to `lb4_2`).
fn shared_order(names: &BTreeSet<String>) -> Vec<String> {
    let mut all: BTreeSet<String> = names.clone();
    for n in names {
        if let Some(inner) = n.strip_prefix("xc") {
            all.insert(inner.to_string());
        }
    }
    let (wrappers, plain): (Vec<String>, Vec<String>) = all.into_iter().partition(|n| n.starts_with("xc"));
    plain.into_iter().chain(wrappers).collect()
}

/// The port's sets and chains: new ones added, changed ones flushed and filled again,
/// unchanged ones left (`old_*`: what the port had).
fn write_sets_and_chains(
    s: &mut String,
    r: &Rendered,
    old_sets: &[&String],
    old_chains: &BTreeMap<&String, &Vec<String>>,
) {
    for (name, decl) in &r.sets {
        if !old_sets.contains(&name) {
            let _ = writeln!(s, "add set inet {TABLE} {name} {{ {decl} }}");
        }
    }
    for (name, _) in &r.chains {
        if !old_chains.contains_key(name) {
            let _ = writeln!(s, "add chain inet {TABLE} {name}");
        }
    }
    for (name, rules) in &r.chains {
        match old_chains.get(name) {
            Some(old) if *old == rules => continue,
            Some(_) => {
                let _ = writeln!(s, "flush chain inet {TABLE} {name}");
            }
            None => {}
        }
        for rule in rules {
            let _ = writeln!(s, "add rule inet {TABLE} {name} {rule}");
        }
    }
}

/// The UDP flows a change leaves pointing the wrong way (UDP has no end, so conntrack keeps
/// sending a flow where it was first sent): as kube-proxy, `conntrack -D` argument lists for
/// the flows to an address or port that went away, to an endpoint that went away, and to a
/// port that had no endpoint (its flows were never translated) and now has one; for the
/// ClusterIPs and external IPs, and for the NodePort.
pub fn stale_udp_flows(old: Option<&pb::ServicePort>, new: Option<&pb::ServicePort>) -> Vec<Vec<String>> {
    let Some(old) = old.filter(|p| p.protocol == pb::Protocol::Udp as i32) else { return Vec::new() };
    // conntrack matches IPv4 unless told otherwise: an IPv6 flow list says `-f ipv6`.
    let udp = |dst: Option<&str>, port: u32, v6: bool| {
        let mut f = vec!["-p".to_string(), "udp".into()];
        if v6 {
            f.extend(["-f".into(), "ipv6".into()]);
        }
        if let Some(dst) = dst {
            f.extend(["--orig-dst".into(), dst.to_string()]);
        }
        f.extend(["--orig-port-dst".into(), port.to_string()]);
        f
    };
    let is_v6 = |ip: &str| ip.contains(':');
    // (address, port, IPv6, still there): a NodePort is an entry point of each family.
    let mut entries: Vec<(Option<&str>, u32, bool, bool)> = old
        .cluster_ips
        .iter()
        .chain(&old.external_ips)
        .map(|v| (Some(v.as_str()), old.port, is_v6(v), false))
        .collect();
    if old.node_port > 0 {
        entries.extend([(None, old.node_port, false, false), (None, old.node_port, true, false)]);
    }
    if let Some(new) = new {
        let kept: BTreeSet<(Option<&str>, u32)> = new
            .cluster_ips
            .iter()
            .chain(&new.external_ips)
            .map(|v| (Some(v.as_str()), new.port))
            .chain((new.node_port > 0).then_some((None, new.node_port)))
            .collect();
        for e in &mut entries {
            e.3 = kept.contains(&(e.0, e.1));
        }
    }
    let eps = |p: &pb::ServicePort| -> BTreeSet<(String, u32)> {
        p.endpoints.iter().filter(|e| e.ready || (e.serving && e.terminating)).map(|e| (e.ip.clone(), e.port)).collect()
    };
    let before = eps(old);
    let after = new.map(eps).unwrap_or_default();
    let mut out = Vec::new();
    for (dst, port, v6, kept) in entries {
        if !kept || (before.is_empty() && !after.is_empty()) {
            out.push(udp(dst, port, v6));
            continue;
        }
        // An entry point translates only to endpoints of its own family.
        for (ip, ep_port) in before.difference(&after).filter(|(ip, _)| is_v6(ip) == v6) {
            let mut f = udp(dst, port, v6);
            f.extend(["--reply-src".into(), ip.clone(), "--reply-port-src".into(), ep_port.to_string()]);
            out.push(f);
        }
    }
    out
}

/// Delete conntrack entries (`conntrack -D ARGS`); none to delete is fine.
pub fn forget_flows(args: &[String]) {
    match std::process::Command::new("conntrack").arg("-D").args(args).output() {
        Ok(o) if o.status.success() || o.status.code() == Some(1) => {}
        Ok(o) => tracing::warn!(args = ?args, error = %String::from_utf8_lossy(&o.stderr).trim(), "conntrack -D"),
        Err(e) => tracing::warn!(error = %e, "running conntrack (stale UDP flows stay until they time out)"),
    }
}

/// Our table without the sets' and maps' contents (`nft -t list table`), `None` when there
/// is none (or nft cannot be run).
fn list_table() -> Option<String> {
    let out = std::process::Command::new("nft").args(["-t", "list", "table", "inet", TABLE]).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The (kind, name) of every set, map and chain a table listing shows: the lines
/// `<kind> <name> {`.
pub fn table_objects(listing: &str) -> Vec<(&str, &str)> {
    listing.lines().filter_map(object_line).collect()
}

fn object_line(line: &str) -> Option<(&str, &str)> {
    let w: Vec<&str> = line.split_whitespace().collect();
    match w[..] {
        [kind @ ("set" | "map" | "chain"), name, "{"] => Some((kind, name)),
        _ => None,
    }
}

/// Whether this node holds our table (`nft list tables`; read only).
pub fn table_present() -> bool {
    nft_tables().is_some_and(|t| t.contains(&format!("table inet {TABLE}")))
}

/// The node's nftables tables (`nft list tables`: "table <family> <name>" each); `None`
/// when nft cannot be run.
fn nft_tables() -> Option<Vec<String>> {
    let out = std::process::Command::new("nft").args(["list", "tables"]).output().ok()?;
    Some(String::from_utf8_lossy(&out.stdout).lines().map(|l| l.trim().to_string()).collect())
}

/// Whether kube-proxy (or another proxy of its family) programs this node: its nftables
/// tables, its iptables chains (through iptables-nft or iptables-legacy), or its IPVS mode's
/// device. Returns what was found.
pub fn kube_proxy_present() -> Option<String> {
    // /proc/net follows the reader's network namespace (sysfs would show the mounter's).
    let devices = std::fs::read_to_string("/proc/net/dev").unwrap_or_default();
    if devices.lines().any(|l| l.trim_start().starts_with("kube-ipvs0:")) {
        return Some("kube-proxy's IPVS device kube-ipvs0".into());
    }
    for (v6, fam) in [(false, "ip"), (true, "ip6")] {
        if crate::sys::xtables::legacy_chain_exists(v6, "nat", "KUBE-SERVICES") {
            return Some(format!("iptables-legacy chain KUBE-SERVICES ({fam} nat)"));
        }
    }
    let tables = nft_tables()?;
    for t in ["ip kube-proxy", "ip6 kube-proxy"] {
        if tables.contains(&format!("table {t}")) {
            return Some(format!("nftables table {t}"));
        }
    }
    for fam in ["ip", "ip6"] {
        if tables.contains(&format!("table {fam} nat")) {
            let ok = std::process::Command::new("nft")
                .args(["list", "chain", fam, "nat", "KUBE-SERVICES"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return Some(format!("iptables chain KUBE-SERVICES ({fam} nat)"));
            }
        }
    }
    None
}

#[cfg(test)]
#[path = "services_tests.rs"]
mod tests;
