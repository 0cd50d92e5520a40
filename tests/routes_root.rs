//! Root-only: cross-node pod routes (`nodeplane::net::routes`) against the real kernel.
//!
//! Each test builds a private topology out of network namespaces (all named
//! `nprt<pid>-<topology>-…`, all removed by a guard even when the test panics): an underlay
//! namespace with a bridge, three node namespaces joined to it by veths, and behind each
//! node's `np0` bridge one pod namespace. `Routes` runs inside the node namespaces, each time
//! on a fresh OS thread that enters the namespace and then exits. Pods ping each other with
//! `ip netns exec <pod> ping`. Nothing touches the host's own network namespace.
//!
//! These tests need root and FAIL (never skip) without it.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::IpAddr;
use std::process::Command;

use ipnetwork::IpNetwork;
use nix::sched::CloneFlags;
use nodeplane::net::routes::{
    PeerNode, RTPROT_NODEPLANE, RouteConfig, RouteKind, RouteMode, Routes, RoutesError, SyncReport,
};
use serde_json::Value;

const VNI: u32 = 42;
const PROTO: &str = "78";

fn require_root() {
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "tests/routes_root.rs needs root (it creates network namespaces, veths, bridges and VXLAN \
         devices). Run it as root; it does not skip."
    );
    for tool in ["ip", "ping", "bridge", "sysctl"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false);
        assert!(found, "required tool {tool:?} is not on PATH");
    }
    assert_eq!(RTPROT_NODEPLANE.to_string(), PROTO);
}

// ----- running commands -----

fn run(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("spawn {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn succeeds(args: &[&str]) -> bool {
    Command::new(args[0]).args(&args[1..]).output().map(|o| o.status.success()).unwrap_or(false)
}

fn json(args: &[&str]) -> Vec<Value> {
    let out = run(args);
    if out.trim().is_empty() {
        return Vec::new();
    }
    match serde_json::from_str::<Value>(&out).unwrap_or_else(|e| panic!("{args:?}: bad JSON ({e}): {out}")) {
        Value::Array(a) => a,
        other => panic!("{args:?}: expected a JSON array, got {other}"),
    }
}

/// Run `f` on a new OS thread that has entered network namespace `ns`. The thread exits
/// when `f` returns: a thread that called setns is never reused.
fn in_ns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            let fd = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET).unwrap_or_else(|e| panic!("setns {path}: {e}"));
            f()
        });
        match h.join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

// ----- topology -----

#[derive(Debug, Clone)]
struct Node {
    name: String,
    ns: String,
    pod: String,
    u4: IpAddr,
    u6: IpAddr,
    b4: IpNetwork,
    b6: IpNetwork,
    gw4: IpAddr,
    gw6: IpAddr,
    pod4: IpAddr,
    pod6: IpAddr,
}

/// Owns the namespaces it created and removes them on drop (also during a panic).
struct Topo {
    prefix: String,
    namespaces: Vec<String>,
    nodes: Vec<Node>,
}

impl Drop for Topo {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

impl Topo {
    fn ns(&mut self, short: &str) -> String {
        let name = format!("{}-{short}", self.prefix);
        // A leftover of an earlier run with the same pid would make `add` fail.
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run(&["ip", "netns", "add", &name]);
        self.namespaces.push(name.clone());
        run(&["ip", "-n", &name, "link", "set", "lo", "up"]);
        // No IPv6 duplicate address detection in these private namespaces: interfaces are
        // usable at once instead of after a second of tentative link-local addresses.
        run(&[
            "ip",
            "netns",
            "exec",
            &name,
            "sysctl",
            "-q",
            "-w",
            "net.ipv6.conf.default.accept_dad=0",
            "net.ipv6.conf.all.accept_dad=0",
        ]);
        name
    }

    fn forwarding(ns: &str) {
        run(&[
            "ip",
            "netns",
            "exec",
            ns,
            "sysctl",
            "-q",
            "-w",
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
        ]);
    }

    /// Three nodes. `remote`: node 3 sits on its own underlay subnet behind a router
    /// namespace instead of on the shared segment.
    fn build(tag: &str, remote: bool) -> Topo {
        let mut t =
            Topo { prefix: format!("nprt{}-{tag}", std::process::id()), namespaces: Vec::new(), nodes: Vec::new() };
        let u = t.ns("u");
        run(&["ip", "-n", &u, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0"]);
        run(&["ip", "-n", &u, "link", "set", "br0", "up"]);
        let router = if remote {
            let r = t.ns("r");
            run(&["ip", "-n", &u, "link", "add", "vr", "type", "veth", "peer", "name", "eth0", "netns", &r]);
            run(&["ip", "-n", &u, "link", "set", "vr", "master", "br0", "up"]);
            run(&["ip", "-n", &r, "link", "set", "eth0", "up"]);
            run(&["ip", "-n", &r, "addr", "add", "192.0.2.254/24", "dev", "eth0"]);
            run(&["ip", "-n", &r, "addr", "add", "2001:db8:a::fe/64", "dev", "eth0", "nodad"]);
            Self::forwarding(&r);
            Some(r)
        } else {
            None
        };
        for i in 1..=3u8 {
            let n = t.ns(&format!("n{i}"));
            let p = t.ns(&format!("p{i}"));
            let far = remote && i == 3;
            let (u4, u6) = if far {
                let r = router.as_deref().unwrap();
                run(&["ip", "-n", r, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns", &n]);
                run(&["ip", "-n", r, "link", "set", "eth1", "up"]);
                run(&["ip", "-n", r, "addr", "add", "198.51.100.254/24", "dev", "eth1"]);
                run(&["ip", "-n", r, "addr", "add", "2001:db8:b::fe/64", "dev", "eth1", "nodad"]);
                (ip("198.51.100.3"), ip("2001:db8:b::3"))
            } else {
                let v = format!("v{i}");
                run(&["ip", "-n", &u, "link", "add", &v, "type", "veth", "peer", "name", "eth0", "netns", &n]);
                run(&["ip", "-n", &u, "link", "set", &v, "master", "br0", "up"]);
                (ip(&format!("192.0.2.1{i}")), ip(&format!("2001:db8:a::1{i}")))
            };
            run(&["ip", "-n", &n, "link", "set", "eth0", "up"]);
            let pfx = |a: IpAddr| format!("{a}/{}", if a.is_ipv4() { 24 } else { 64 });
            run(&["ip", "-n", &n, "addr", "add", &pfx(u4), "dev", "eth0"]);
            run(&["ip", "-n", &n, "addr", "add", &pfx(u6), "dev", "eth0", "nodad"]);
            if far {
                run(&["ip", "-n", &n, "route", "add", "default", "via", "198.51.100.254"]);
                run(&["ip", "-n", &n, "-6", "route", "add", "default", "via", "2001:db8:b::fe"]);
            } else if remote {
                run(&["ip", "-n", &n, "route", "add", "198.51.100.0/24", "via", "192.0.2.254"]);
                run(&["ip", "-n", &n, "-6", "route", "add", "2001:db8:b::/64", "via", "2001:db8:a::fe"]);
            }
            // The node's pod bridge with its blocks' gateways, and one pod behind it.
            let (gw4, gw6) = (ip(&format!("10.244.{i}.1")), ip(&format!("fd00:{i}::1")));
            let (pod4, pod6) = (ip(&format!("10.244.{i}.2")), ip(&format!("fd00:{i}::2")));
            run(&["ip", "-n", &n, "link", "add", "np0", "type", "bridge", "mcast_snooping", "0"]);
            run(&["ip", "-n", &n, "link", "set", "np0", "up"]);
            run(&["ip", "-n", &n, "addr", "add", &pfx(gw4), "dev", "np0"]);
            run(&["ip", "-n", &n, "addr", "add", &pfx(gw6), "dev", "np0", "nodad"]);
            run(&["ip", "-n", &n, "link", "add", "vp", "type", "veth", "peer", "name", "eth0", "netns", &p]);
            run(&["ip", "-n", &n, "link", "set", "vp", "master", "np0", "up"]);
            run(&["ip", "-n", &p, "link", "set", "eth0", "up"]);
            run(&["ip", "-n", &p, "addr", "add", &pfx(pod4), "dev", "eth0"]);
            run(&["ip", "-n", &p, "addr", "add", &pfx(pod6), "dev", "eth0", "nodad"]);
            run(&["ip", "-n", &p, "route", "add", "default", "via", &gw4.to_string()]);
            run(&["ip", "-n", &p, "-6", "route", "add", "default", "via", &gw6.to_string()]);
            Self::forwarding(&n);
            t.nodes.push(Node {
                name: format!("n{i}"),
                ns: n,
                pod: p,
                u4,
                u6,
                b4: format!("10.244.{i}.0/24").parse().unwrap(),
                b6: format!("fd00:{i}::/64").parse().unwrap(),
                gw4,
                gw6,
                pod4,
                pod6,
            });
        }
        t
    }

    fn node(&self, i: usize) -> &Node {
        &self.nodes[i]
    }
}

// ----- driving Routes inside a node -----

fn cfg(mode: RouteMode, local: IpAddr) -> RouteConfig {
    RouteConfig::new(mode, VNI, local)
}

/// Create/adopt each node's VTEP (fresh `Routes` inside each node) and return the MACs.
fn vteps(t: &Topo, mode: RouteMode, v6_underlay: bool) -> Vec<Option<[u8; 6]>> {
    t.nodes
        .iter()
        .map(|n| {
            let local = if v6_underlay { n.u6 } else { n.u4 };
            in_ns(&n.ns, || Routes::new(cfg(mode, local))?.ensure_vtep())
                .unwrap_or_else(|e| panic!("{}: ensure_vtep: {e}", n.name))
        })
        .collect()
}

fn peer(n: &Node, mac: Option<[u8; 6]>, v4_underlay_only: bool) -> PeerNode {
    PeerNode {
        name: n.name.clone(),
        underlay: if v4_underlay_only { vec![n.u4] } else { vec![n.u4, n.u6] },
        blocks: vec![n.b4, n.b6],
        vtep_mac: mac,
        wg_key: None,
    }
}

fn sync(n: &Node, cfg: RouteConfig, peers: &[PeerNode]) -> Result<SyncReport, RoutesError> {
    in_ns(&n.ns, || Routes::new(cfg)?.sync(peers))
}

fn sync_ok(n: &Node, cfg: RouteConfig, peers: &[PeerNode]) -> SyncReport {
    sync(n, cfg, peers).unwrap_or_else(|e| panic!("{}: sync: {e}", n.name))
}

fn teardown(n: &Node, mode: RouteMode, local: IpAddr) {
    in_ns(&n.ns, || Routes::new(cfg(mode, local))?.teardown()).unwrap_or_else(|e| panic!("{}: teardown: {e}", n.name));
}

// ----- looking at kernel state -----

#[derive(Debug, Clone, PartialEq, Eq)]
struct KRoute {
    via: Option<String>,
    dev: String,
    onlink: bool,
}

/// Main-table routes with our protocol, both families: destination -> route.
fn own_routes(ns: &str) -> BTreeMap<String, KRoute> {
    let mut out = BTreeMap::new();
    for fam in ["-4", "-6"] {
        for r in json(&["ip", "-n", ns, "-j", fam, "route", "show", "table", "main", "proto", PROTO]) {
            let dst = r["dst"].as_str().unwrap().to_string();
            let flags: Vec<&str> =
                r["flags"].as_array().map(|a| a.iter().filter_map(|f| f.as_str()).collect()).unwrap_or_default();
            let k = KRoute {
                via: r["gateway"].as_str().map(str::to_string),
                dev: r["dev"].as_str().unwrap_or_default().to_string(),
                onlink: flags.contains(&"onlink"),
            };
            assert!(out.insert(dst.clone(), k).is_none(), "{ns}: two routes of ours to {dst}");
        }
    }
    out
}

fn all_routes(ns: &str) -> Vec<Value> {
    let mut v = json(&["ip", "-n", ns, "-j", "-4", "route", "show", "table", "main"]);
    v.extend(json(&["ip", "-n", ns, "-j", "-6", "route", "show", "table", "main"]));
    v
}

fn block_key(b: &IpNetwork) -> String {
    b.to_string()
}

fn expect_direct(via: IpAddr) -> KRoute {
    KRoute { via: Some(via.to_string()), dev: "eth0".into(), onlink: false }
}

fn expect_vxlan(gw: IpAddr) -> KRoute {
    KRoute { via: Some(gw.to_string()), dev: "np.vxlan".into(), onlink: true }
}

/// Permanent neighbour entries on np.vxlan: ip -> lladdr.
fn vxlan_neigh(ns: &str) -> BTreeMap<String, String> {
    json(&["ip", "-n", ns, "-j", "neigh", "show", "dev", "np.vxlan", "nud", "permanent"])
        .iter()
        .map(|n| (n["dst"].as_str().unwrap().to_string(), n["lladdr"].as_str().unwrap_or_default().to_string()))
        .collect()
}

/// FDB entries on np.vxlan: mac -> dst.
fn vxlan_fdb(ns: &str) -> BTreeMap<String, String> {
    json(&["ip", "netns", "exec", ns, "bridge", "-j", "fdb", "show", "dev", "np.vxlan"])
        .iter()
        .map(|f| (f["mac"].as_str().unwrap().to_string(), f["dst"].as_str().unwrap_or_default().to_string()))
        .collect()
}

fn vxlan_link(ns: &str) -> Option<Value> {
    if !succeeds(&["ip", "-n", ns, "link", "show", "np.vxlan"]) {
        return None;
    }
    json(&["ip", "-n", ns, "-j", "-d", "link", "show", "np.vxlan"]).into_iter().next()
}

/// Packets sent and received by np.vxlan so far.
fn vxlan_packets(ns: &str) -> (u64, u64) {
    let l = json(&["ip", "-n", ns, "-j", "-s", "link", "show", "np.vxlan"]).into_iter().next().expect("np.vxlan");
    let get =
        |dir: &str| l["stats64"][dir]["packets"].as_u64().unwrap_or_else(|| panic!("{ns}: no {dir} counter: {l}"));
    (get("tx"), get("rx"))
}

/// Run `pings` and assert that they went through the VXLAN device of each node in `nodes`.
fn through_vxlan(t: &Topo, nodes: &[usize], pings: impl FnOnce()) {
    let before: Vec<(u64, u64)> = nodes.iter().map(|&i| vxlan_packets(&t.node(i).ns)).collect();
    pings();
    for (&i, (tx0, rx0)) in nodes.iter().zip(before) {
        let (tx, rx) = vxlan_packets(&t.node(i).ns);
        assert!(
            tx > tx0 && rx > rx0,
            "{}: no traffic through np.vxlan (tx {tx0}->{tx}, rx {rx0}->{rx})",
            t.node(i).name
        );
    }
}

fn mac_str(m: [u8; 6]) -> String {
    nodeplane::sys::netlink::format_mac(&m)
}

// ----- reachability -----

fn ping(from: &str, to: IpAddr, wait: &str) -> bool {
    succeeds(&["ip", "netns", "exec", from, "ping", "-n", "-q", "-c1", "-W", wait, &to.to_string()])
}

/// Ping every ordered pair of pods over both families, in parallel; `expect(i, j, v6)` says
/// whether pod i must reach pod j over that family (true) or must not (false).
fn check_pings(t: &Topo, what: &str, expect: impl Fn(usize, usize, bool) -> bool + Sync) {
    let mut failures = Vec::new();
    std::thread::scope(|s| {
        let mut hs = Vec::new();
        for i in 0..t.nodes.len() {
            for j in 0..t.nodes.len() {
                if i == j {
                    continue;
                }
                for v6 in [false, true] {
                    let want = expect(i, j, v6);
                    let (from, to) = (t.node(i), t.node(j));
                    let dst = if v6 { to.pod6 } else { to.pod4 };
                    hs.push(s.spawn(move || {
                        // A reachable pod gets a second chance (first-packet neighbour
                        // resolution); an unreachable one must fail at once.
                        let got = if want {
                            ping(&from.pod, dst, "2") || ping(&from.pod, dst, "2")
                        } else {
                            ping(&from.pod, dst, "1")
                        };
                        (got == want).then_some(()).ok_or(format!(
                            "{} -> {} ({dst}): {}",
                            from.pod,
                            to.name,
                            if want { "unreachable, expected reachable" } else { "reachable, expected unreachable" }
                        ))
                    }));
                }
            }
        }
        for h in hs {
            if let Err(e) = h.join().unwrap() {
                failures.push(e);
            }
        }
    });
    assert!(failures.is_empty(), "{what}: {} ping check(s) failed:\n  {}", failures.len(), failures.join("\n  "));
    eprintln!("[{what}] ping matrix ok");
}

fn assert_clean(n: &Node) {
    let left = own_routes(&n.ns);
    assert!(left.is_empty(), "{}: routes with proto {PROTO} left after teardown: {left:?}", n.name);
    assert!(vxlan_link(&n.ns).is_none(), "{}: np.vxlan still exists after teardown", n.name);
    // Connected routes are untouched.
    let all = all_routes(&n.ns);
    for dst in [block_key(&n.b4), block_key(&n.b6)] {
        assert!(all.iter().any(|r| r["dst"] == dst.as_str()), "{}: connected route {dst} vanished", n.name);
    }
}

// ----- the tests -----

/// All three nodes on one L2 segment: direct, VXLAN over IPv4 and over IPv6, peer removal,
/// idempotency, teardown, and a peer whose underlay carries only IPv4.
#[test]
fn routes_shared_segment() {
    require_root();
    let t = Topo::build("a", false);
    let n = |i: usize| t.node(i);
    let all = |i: usize, j: usize, _v6: bool| i != j;

    // A route we did not install, to a block a (fake) peer claims, and an unrelated one.
    run(&["ip", "-n", &n(0).ns, "route", "add", "203.0.113.0/24", "via", "192.0.2.12", "proto", "static"]);
    run(&["ip", "-n", &n(0).ns, "route", "add", "198.18.0.0/15", "via", "192.0.2.13"]);
    let ghost = PeerNode {
        name: "ghost".into(),
        underlay: vec![ip("192.0.2.99")],
        blocks: vec!["203.0.113.0/24".parse().unwrap()],
        vtep_mac: None,
        wg_key: None,
    };

    // ---- 1. direct mode; every node gets the full list, itself included ----
    let mut peers: Vec<PeerNode> = t.nodes.iter().map(|x| peer(x, None, false)).collect();
    peers.push(ghost.clone());
    for (i, node) in t.nodes.iter().enumerate() {
        let (first, second) = in_ns(&node.ns, || {
            let mut r = Routes::new(cfg(RouteMode::Direct, node.u4))?;
            assert_eq!(r.ensure_vtep()?, None, "direct mode has no VTEP");
            let first = r.sync(&peers)?;
            let second = r.sync(&peers)?;
            Ok::<_, RoutesError>((first, second))
        })
        .unwrap_or_else(|e| panic!("{}: direct sync: {e}", node.name));
        let ghost_routed = i != 0;
        assert_eq!(first.routes.added, 4 + ghost_routed as usize, "{}: {first:?}", node.name);
        assert_eq!(second.changes(), 0, "{}: second sync with the same peers changed things: {second:?}", node.name);
        assert_eq!(first.count(RouteKind::Direct), 4 + ghost_routed as usize);
        assert!(first.routed.iter().all(|r| r.peer != node.name), "{}: routed to itself", node.name);
        if i == 0 {
            assert_eq!(first.unroutable.len(), 1, "{first:?}");
            assert!(first.unroutable[0].reason.contains("did not install"), "{}", first.unroutable[0]);
        } else {
            assert!(first.unroutable.is_empty(), "{}: {:?}", node.name, first.unroutable);
        }
        let mut want = BTreeMap::new();
        for (j, other) in t.nodes.iter().enumerate() {
            if j != i {
                want.insert(block_key(&other.b4), expect_direct(other.u4));
                want.insert(block_key(&other.b6), expect_direct(other.u6));
            }
        }
        if ghost_routed {
            want.insert("203.0.113.0/24".into(), expect_direct(ip("192.0.2.99")));
        }
        assert_eq!(own_routes(&node.ns), want, "{}: direct routes", node.name);
        assert!(vxlan_link(&node.ns).is_none(), "{}: direct mode created a VXLAN device", node.name);
    }
    let foreign = all_routes(&n(0).ns);
    assert!(
        foreign
            .iter()
            .any(|r| r["dst"] == "203.0.113.0/24" && r["protocol"] == "static" && r["gateway"] == "192.0.2.12"),
        "n1: the foreign route to the ghost block was touched: {foreign:?}"
    );
    check_pings(&t, "direct", all);

    // ---- 2. switch to VXLAN over IPv4 in place (no teardown in between) ----
    let macs = vteps(&t, RouteMode::Vxlan, false);
    for (node, mac) in t.nodes.iter().zip(&macs) {
        let mac = mac.unwrap_or_else(|| panic!("{}: no VTEP MAC", node.name));
        let link = vxlan_link(&node.ns).unwrap_or_else(|| panic!("{}: no np.vxlan", node.name));
        assert_eq!(link["address"], mac_str(mac).as_str(), "{}: advertised MAC is the device's", node.name);
        assert_eq!(link["mtu"], 1450, "{}: MTU = underlay 1500 - 50", node.name);
        let info = &link["linkinfo"]["info_data"];
        assert_eq!(info["id"], VNI);
        assert_eq!(info["local"], node.u4.to_string().as_str());
        assert_eq!(info["port"], 4789);
        assert_eq!(info["learning"], false);
        assert!(link["flags"].as_array().unwrap().iter().any(|f| f == "UP"), "{}: np.vxlan is down", node.name);
    }
    assert_eq!(vteps(&t, RouteMode::Vxlan, false), macs, "ensure_vtep adopts the device and keeps its MAC");
    let peers_vx: Vec<PeerNode> = t.nodes.iter().zip(&macs).map(|(x, m)| peer(x, *m, false)).collect();
    for (i, node) in t.nodes.iter().enumerate() {
        let others: Vec<PeerNode> = peers_vx.iter().filter(|p| p.name != node.name).cloned().collect();
        let rep = sync_ok(node, cfg(RouteMode::Vxlan, node.u4), &others);
        assert_eq!(rep.routes.replaced, 4, "{}: direct routes replaced in place: {rep:?}", node.name);
        assert_eq!(rep.routes.added, 0, "{}: {rep:?}", node.name);
        assert_eq!(rep.routes.removed, (i != 0) as usize, "{}: ghost route removed: {rep:?}", node.name);
        assert_eq!((rep.fdb.added, rep.neigh.added), (2, 4), "{}: {rep:?}", node.name);
        assert_eq!(rep.count(RouteKind::Vxlan), 4);
        let mut want = BTreeMap::new();
        let mut want_neigh = BTreeMap::new();
        let mut want_fdb = BTreeMap::new();
        for (j, other) in t.nodes.iter().enumerate() {
            if j != i {
                want.insert(block_key(&other.b4), expect_vxlan(other.gw4));
                want.insert(block_key(&other.b6), expect_vxlan(other.gw6));
                want_neigh.insert(other.gw4.to_string(), mac_str(macs[j].unwrap()));
                want_neigh.insert(other.gw6.to_string(), mac_str(macs[j].unwrap()));
                want_fdb.insert(mac_str(macs[j].unwrap()), other.u4.to_string());
            }
        }
        assert_eq!(own_routes(&node.ns), want, "{}: vxlan routes", node.name);
        assert_eq!(vxlan_neigh(&node.ns), want_neigh, "{}: vxlan neighbours", node.name);
        assert_eq!(vxlan_fdb(&node.ns), want_fdb, "{}: vxlan fdb", node.name);
    }
    through_vxlan(&t, &[0, 1, 2], || check_pings(&t, "vxlan over ipv4", all));

    // ---- 3. node 3 leaves the cluster ----
    let without3 = |me: &Node| -> Vec<PeerNode> {
        peers_vx.iter().filter(|p| p.name != me.name && p.name != "n3").cloned().collect()
    };
    for node in &t.nodes[..2] {
        let rep = sync_ok(node, cfg(RouteMode::Vxlan, node.u4), &without3(node));
        assert_eq!((rep.routes.removed, rep.neigh.removed, rep.fdb.removed), (2, 2, 1), "{}: {rep:?}", node.name);
        assert_eq!(
            rep.routes.added + rep.routes.replaced + rep.fdb.added + rep.neigh.added,
            0,
            "{}: {rep:?}",
            node.name
        );
        let routes = own_routes(&node.ns);
        assert!(
            !routes.contains_key(&block_key(&n(2).b4)) && !routes.contains_key(&block_key(&n(2).b6)),
            "{}: {routes:?}",
            node.name
        );
        assert_eq!(routes.len(), 2, "{}: {routes:?}", node.name);
        let neigh = vxlan_neigh(&node.ns);
        assert!(
            !neigh.contains_key(&n(2).gw4.to_string()) && !neigh.contains_key(&n(2).gw6.to_string()),
            "{}: {neigh:?}",
            node.name
        );
        assert_eq!(neigh.len(), 2);
        let fdb = vxlan_fdb(&node.ns);
        assert!(!fdb.contains_key(&mac_str(macs[2].unwrap())), "{}: {fdb:?}", node.name);
        assert_eq!(fdb.len(), 1);
    }
    let rep = sync_ok(n(2), cfg(RouteMode::Vxlan, n(2).u4), &[]);
    assert_eq!((rep.routes.removed, rep.neigh.removed, rep.fdb.removed), (4, 4, 2), "n3: {rep:?}");
    assert!(own_routes(&n(2).ns).is_empty() && vxlan_neigh(&n(2).ns).is_empty() && vxlan_fdb(&n(2).ns).is_empty());
    check_pings(&t, "n3 removed", |i, j, _| i != j && i != 2 && j != 2);
    // The same lists again, from fresh instances (as after an agent restart): nothing to do.
    for node in &t.nodes {
        let peers = if node.name == "n3" { Vec::new() } else { without3(node) };
        let rep = sync_ok(node, cfg(RouteMode::Vxlan, node.u4), &peers);
        assert_eq!(rep.changes(), 0, "{}: repeated sync changed things: {rep:?}", node.name);
    }

    // ---- 4. teardown (twice: idempotent) ----
    for node in &t.nodes {
        teardown(node, RouteMode::Vxlan, node.u4);
        teardown(node, RouteMode::Vxlan, node.u4);
        assert_clean(node);
    }
    let left = all_routes(&n(0).ns);
    assert!(
        left.iter().any(|r| r["dst"] == "203.0.113.0/24" && r["protocol"] == "static"),
        "n1: foreign route removed: {left:?}"
    );
    assert!(left.iter().any(|r| r["dst"] == "198.18.0.0/15"), "n1: foreign route removed: {left:?}");
    check_pings(&t, "after teardown", |_, _, _| false);

    // ---- 5. VXLAN over the IPv6 underlay ----
    let macs6 = vteps(&t, RouteMode::Vxlan, true);
    let peers6: Vec<PeerNode> = t.nodes.iter().zip(&macs6).map(|(x, m)| peer(x, *m, false)).collect();
    for node in &t.nodes {
        let link = vxlan_link(&node.ns).unwrap();
        assert_eq!(link["mtu"], 1430, "{}: MTU = underlay 1500 - 70", node.name);
        assert_eq!(link["linkinfo"]["info_data"]["local6"], node.u6.to_string().as_str());
        let rep = sync_ok(node, cfg(RouteMode::Vxlan, node.u6), &peers6);
        assert_eq!(rep.routes.added, 4, "{}: {rep:?}", node.name);
        let fdb = vxlan_fdb(&node.ns);
        assert_eq!(fdb.len(), 2);
        assert!(
            fdb.values().all(|d| d.parse::<IpAddr>().unwrap().is_ipv6()),
            "{}: fdb dst not IPv6: {fdb:?}",
            node.name
        );
    }
    through_vxlan(&t, &[0, 1, 2], || check_pings(&t, "vxlan over ipv6", all));
    for node in &t.nodes {
        teardown(node, RouteMode::Vxlan, node.u6);
        assert_clean(node);
    }

    // ---- 6. peers advertise only IPv4 underlay addresses ----
    // Forced direct: IPv6 blocks are unroutable (and reported); IPv4 works.
    let peers_v4: Vec<PeerNode> = t.nodes.iter().map(|x| peer(x, None, true)).collect();
    for node in &t.nodes {
        let others: Vec<PeerNode> = peers_v4.iter().filter(|p| p.name != node.name).cloned().collect();
        let rep = sync_ok(node, cfg(RouteMode::Direct, node.u4), &others);
        assert_eq!(rep.count(RouteKind::Direct), 2, "{}: {rep:?}", node.name);
        assert_eq!(rep.unroutable.len(), 2, "{}: {rep:?}", node.name);
        assert!(
            rep.unroutable.iter().all(|u| u.block.is_ipv6() && u.reason.contains("no IPv6 underlay")),
            "{}: {:?}",
            node.name,
            rep.unroutable
        );
    }
    check_pings(&t, "direct, ipv4 underlay only: ipv4 reachable, ipv6 not", |i, j, v6| i != j && !v6);
    // Auto: IPv4 direct, IPv6 falls back to VXLAN (over the IPv4 underlay).
    let macs = vteps(&t, RouteMode::Auto, false);
    let peers_v4: Vec<PeerNode> = t.nodes.iter().zip(&macs).map(|(x, m)| peer(x, *m, true)).collect();
    for (i, node) in t.nodes.iter().enumerate() {
        let others: Vec<PeerNode> = peers_v4.iter().filter(|p| p.name != node.name).cloned().collect();
        let rep = sync_ok(node, cfg(RouteMode::Auto, node.u4), &others);
        assert!(rep.unroutable.is_empty(), "{}: {:?}", node.name, rep.unroutable);
        assert_eq!((rep.count(RouteKind::Direct), rep.count(RouteKind::Vxlan)), (2, 2), "{}: {rep:?}", node.name);
        let mut want = BTreeMap::new();
        for (j, other) in t.nodes.iter().enumerate() {
            if j != i {
                want.insert(block_key(&other.b4), expect_direct(other.u4));
                want.insert(block_key(&other.b6), expect_vxlan(other.gw6));
            }
        }
        assert_eq!(own_routes(&node.ns), want, "{}: auto with an IPv4-only underlay", node.name);
    }
    through_vxlan(&t, &[0, 1, 2], || check_pings(&t, "auto, ipv4 underlay only", all));
    // The peers now advertise their IPv6 underlay too: IPv6 moves from VXLAN to direct in
    // place, and the tunnel's FDB and neighbour entries go.
    let peers_full: Vec<PeerNode> = t.nodes.iter().zip(&macs).map(|(x, m)| peer(x, *m, false)).collect();
    for (i, node) in t.nodes.iter().enumerate() {
        let others: Vec<PeerNode> = peers_full.iter().filter(|p| p.name != node.name).cloned().collect();
        let rep = sync_ok(node, cfg(RouteMode::Auto, node.u4), &others);
        assert_eq!(
            rep.routes,
            nodeplane::net::routes::Counts { added: 0, replaced: 2, removed: 0 },
            "{}: {rep:?}",
            node.name
        );
        assert_eq!((rep.neigh.removed, rep.fdb.removed), (2, 2), "{}: {rep:?}", node.name);
        let mut want = BTreeMap::new();
        for (j, other) in t.nodes.iter().enumerate() {
            if j != i {
                want.insert(block_key(&other.b4), expect_direct(other.u4));
                want.insert(block_key(&other.b6), expect_direct(other.u6));
            }
        }
        assert_eq!(own_routes(&node.ns), want, "{}: auto, all direct", node.name);
        assert!(
            vxlan_neigh(&node.ns).is_empty() && vxlan_fdb(&node.ns).is_empty(),
            "{}: tunnel entries left",
            node.name
        );
        assert!(vxlan_link(&node.ns).is_some(), "{}: auto mode keeps its VTEP", node.name);
    }
    check_pings(&t, "auto, all direct", all);
    for node in &t.nodes {
        teardown(node, RouteMode::Auto, node.u4);
        assert_clean(node);
    }
}

/// Node 3 on another underlay subnet behind a router: auto mode routes n1<->n2 directly and
/// everything to and from n3 over VXLAN; forced direct mode cannot reach n3 and says so.
#[test]
fn routes_auto_across_a_router() {
    require_root();
    let t = Topo::build("b", true);
    let n = |i: usize| t.node(i);
    // The underlay itself works across the router (test precondition, not the module).
    assert!(
        ping(&n(0).ns, n(2).u4, "2") && ping(&n(0).ns, n(2).u6, "2"),
        "underlay n1 -> n3 through the router is broken"
    );
    check_pings(&t, "auto, before sync", |_, _, _| false);

    let macs = vteps(&t, RouteMode::Auto, false);
    let peers: Vec<PeerNode> = t.nodes.iter().zip(&macs).map(|(x, m)| peer(x, *m, false)).collect();
    let expect = |i: usize, j: usize| -> (KRoute, KRoute) {
        let other = n(j);
        if i != 2 && j != 2 {
            (expect_direct(other.u4), expect_direct(other.u6))
        } else {
            (expect_vxlan(other.gw4), expect_vxlan(other.gw6))
        }
    };
    for (i, node) in t.nodes.iter().enumerate() {
        let others: Vec<PeerNode> = peers.iter().filter(|p| p.name != node.name).cloned().collect();
        let rep = sync_ok(node, cfg(RouteMode::Auto, node.u4), &others);
        assert!(rep.unroutable.is_empty(), "{}: {:?}", node.name, rep.unroutable);
        let mut want = BTreeMap::new();
        let mut want_fdb = BTreeMap::new();
        for (j, other) in t.nodes.iter().enumerate() {
            if j == i {
                continue;
            }
            let (r4, r6) = expect(i, j);
            if r4.dev == "np.vxlan" {
                want_fdb.insert(mac_str(macs[j].unwrap()), other.u4.to_string());
            }
            want.insert(block_key(&other.b4), r4);
            want.insert(block_key(&other.b6), r6);
        }
        assert_eq!(own_routes(&node.ns), want, "{}: auto route kinds", node.name);
        assert_eq!(vxlan_fdb(&node.ns), want_fdb, "{}: fdb has exactly the tunnelled peers", node.name);
        let direct = if i == 2 { 0 } else { 2 };
        assert_eq!(
            (rep.count(RouteKind::Direct), rep.count(RouteKind::Vxlan)),
            (direct, 4 - direct),
            "{}: {rep:?}",
            node.name
        );
        let again = sync_ok(node, cfg(RouteMode::Auto, node.u4), &others);
        assert_eq!(again.changes(), 0, "{}: {again:?}", node.name);
    }
    through_vxlan(&t, &[0, 1, 2], || check_pings(&t, "auto across a router", |i, j, _| i != j));

    // Forced direct on n1: n3's underlay is not on-link, the kernel refuses the gateway, and
    // the error names the peer and the block; n2 is still programmed.
    let others: Vec<PeerNode> = peers.iter().filter(|p| p.name != "n1").cloned().collect();
    match sync(n(0), cfg(RouteMode::Direct, n(0).u4), &others) {
        Err(RoutesError::Incomplete { report, failures }) => {
            let text = failures.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n");
            assert_eq!(failures.len(), 2, "{text}");
            assert!(
                text.contains("peer n3") && text.contains("10.244.3.0/24") && text.contains("fd00:3::/64"),
                "{text}"
            );
            assert_eq!(report.routes.replaced, 0, "n2's direct routes were already right: {report:?}");
        }
        other => panic!("forced direct to a peer behind a router: expected Incomplete, got {other:?}"),
    }
    assert!(vxlan_link(&n(0).ns).is_none(), "direct mode removes our VXLAN device");
    let routes = own_routes(&n(0).ns);
    assert_eq!(routes.get(&block_key(&n(1).b4)), Some(&expect_direct(n(1).u4)), "{routes:?}");
    assert!(ping(&n(0).pod, n(1).pod4, "2"), "n1 pod -> n2 pod after the partial direct sync");

    for node in &t.nodes {
        teardown(node, RouteMode::Auto, node.u4);
        assert_clean(node);
    }
}
