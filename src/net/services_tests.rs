//! The node's half of Services without the kernel: which endpoints a node picks, what a
//! port renders, and that a change writes only that port's entries (the recording runner
//! stands in for nft; tests/services_root.rs sends traffic through the real table).

use std::sync::{Arc, Mutex};

use super::*;

fn ep(ip: &str, node: &str, ready: bool, serving: bool, terminating: bool) -> pb::ServiceEndpoint {
    pb::ServiceEndpoint { ip: ip.into(), port: 8080, node: node.into(), ready, serving, terminating }
}

fn port(id: &str, ip: &str, eps: Vec<pb::ServiceEndpoint>) -> pb::ServicePort {
    pb::ServicePort {
        id: id.into(),
        protocol: pb::Protocol::Tcp as i32,
        port: 80,
        cluster_ips: vec![ip.into()],
        endpoints: eps,
        ..Default::default()
    }
}

fn recording() -> (Proxy, Arc<Mutex<Vec<String>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    let p = Proxy::with_runner(
        "n1",
        vec!["192.0.2.1".parse().unwrap()],
        Box::new(move |s: &str| {
            l.lock().unwrap().push(s.to_string());
            Ok(())
        }),
    );
    (p, log)
}

#[test]
fn ready_endpoints_first_then_serving_terminating_ones_per_set() {
    let eps = vec![
        ep("10.0.0.1", "n1", false, true, true),
        ep("10.0.0.2", "n2", true, true, false),
        ep("10.0.0.3", "n2", false, false, true),
    ];
    let ips = |v: Vec<Ep>| v.into_iter().map(|e| e.ip.to_string()).collect::<Vec<_>>();
    assert_eq!(ips(usable(&eps, Fam::V4, None)), vec!["10.0.0.2"]);
    // Locally none is ready: the serving, terminating one.
    assert_eq!(ips(usable(&eps, Fam::V4, Some("n1"))), vec!["10.0.0.1"]);
    assert!(usable(&eps, Fam::V6, None).is_empty());
}

#[test]
fn local_policies_and_empty_services() {
    let mut p = port("a/web/TCP/", "10.96.0.10", vec![ep("10.0.0.2", "n2", true, true, false)]);
    assert!(matches!(plan(&p, "n1").cluster_ips[0].1, Target::Dnat { masquerade: false, .. }));
    p.internal_local = true;
    assert_eq!(plan(&p, "n1").cluster_ips[0].1, Target::Drop, "ITP Local, no local endpoint: dropped");
    p.endpoints.clear();
    assert_eq!(plan(&p, "n1").cluster_ips[0].1, Target::Reject, "no endpoint at all: rejected");
    let mut e = port("a/lb/TCP/", "10.96.0.11", vec![ep("10.0.0.2", "n2", true, true, false)]);
    e.node_port = 30080;
    e.external_ips = vec!["203.0.113.5".into()];
    assert!(matches!(plan(&e, "n1").node_port[0].1, Target::Dnat { masquerade: true, .. }));
    e.external_local = true;
    let Target::Split { cluster, local } = &plan(&e, "n1").external_ips[0].1 else { panic!() };
    assert_eq!((cluster.len(), local.len()), (1, 0));
}

#[test]
fn a_change_of_one_service_writes_only_its_elements_whatever_the_number_of_services() {
    let (proxy, log) = recording();
    let many: Vec<pb::ServicePort> = (0..2000)
        .map(|i| {
            port(
                &format!("a/s{i}/TCP/"),
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
                vec![ep(&format!("10.1.{}.{}", i / 250, i % 250 + 1), "n2", true, true, false)],
            )
        })
        .collect();
    proxy.apply(true, Some(&["10.0.0.0/8".into()]), many.clone(), vec![]).unwrap();
    assert!(log.lock().unwrap()[0].starts_with(&format!("table inet {TABLE}\ndelete table inet {TABLE}\n")));
    let mut changed = many[7].clone();
    changed.endpoints.push(ep("10.2.0.9", "n1", true, true, false));
    proxy.apply(false, None, vec![changed], vec![]).unwrap();
    let script = log.lock().unwrap().last().unwrap().clone();
    assert!(!script.contains("delete table"), "{script}");
    assert!(script.contains("add chain inet nodeplane-svc lb4_2"), "{script}");
    assert!(script.contains("delete element inet nodeplane-svc vip4 { 10.96.0.8 . tcp . 80 }"), "{script}");
    assert!(script.contains("add element inet nodeplane-svc vip4 { 10.96.0.8 . tcp . 80 : goto lb4_2 }"), "{script}");
    assert!(script.contains("10.96.0.8 . tcp . 80 . 1 : 10.2.0.9 . 8080"), "{script}");
    // The new endpoint is on this node: it may reach itself through the port (hairpin).
    assert!(script.contains("add element inet nodeplane-svc self4 { 10.2.0.9 . 10.2.0.9 }"), "{script}");
    assert!(script.len() < 1000, "{} bytes for one change", script.len());
    // Removal takes its elements; the shared chain stays.
    proxy.apply(false, None, vec![], vec!["a/s7/TCP/".into()]).unwrap();
    let script = log.lock().unwrap().last().unwrap().clone();
    assert!(script.contains("delete element inet nodeplane-svc vip4 { 10.96.0.8 . tcp . 80 }"), "{script}");
    assert!(script.contains("delete element inet nodeplane-svc clusterips4 { 10.96.0.8 }"), "{script}");
    assert!(!script.contains("add "), "{script}");
    assert_eq!(proxy.counts(), (1999, 1999, 1999));
    // A second port of one Service counts once as a Service, its endpoints twice.
    let mut second = many[8].clone();
    second.id = "a/s8/UDP/".into();
    second.protocol = pb::Protocol::Udp as i32;
    proxy.apply(false, None, vec![second], vec![]).unwrap();
    assert_eq!(proxy.counts(), (1999, 2000, 2000));
    // A snapshot replaces everything, counts included; the UDP port it drops has its
    // flows forgotten, as a removal would.
    let applied = proxy.apply(true, None, many[..3].to_vec(), vec![]).unwrap();
    assert_eq!(proxy.counts(), (3, 3, 3));
    let flows: Vec<String> = applied.stale_flows.iter().map(|f| f.join(" ")).collect();
    assert_eq!(flows, [format!("-p udp --orig-dst {} --orig-port-dst 80", many[8].cluster_ips[0])]);
}

#[test]
fn affinity_and_local_external_policy_get_chains_of_their_own_and_lose_them() {
    let (proxy, log) = recording();
    let mut p = port(
        "a/aff/TCP/",
        "10.96.0.20",
        vec![ep("10.0.0.1", "n1", true, true, false), ep("10.0.0.2", "n2", true, true, false)],
    );
    p.affinity_seconds = 60;
    p.node_port = 30000;
    p.external_local = true;
    proxy.apply(true, Some(&[]), vec![p.clone()], vec![]).unwrap();
    let snap = log.lock().unwrap()[0].clone();
    assert!(snap.contains("flags dynamic,timeout; timeout 60s;"), "{snap}");
    assert!(snap.contains("update @s"), "{snap}");
    assert!(snap.contains("saddr timeout 60s }"), "{snap}");
    // Another endpoint: the clients of the two there keep their sets; a new timeout is written.
    let mut more = p.clone();
    more.endpoints.push(ep("10.0.0.3", "n2", true, true, false));
    more.affinity_seconds = 90;
    proxy.apply(false, None, vec![more], vec![]).unwrap();
    let change = log.lock().unwrap().last().unwrap().clone();
    assert!(!change.contains("delete set"), "{change}");
    assert!(change.contains("saddr timeout 90s }"), "{change}");
    assert!(snap.contains("ip saddr @podnets4 goto s"), "{snap}");
    assert!(snap.contains("fib saddr type local meta mark set meta mark or 0x200000 goto s"), "{snap}");
    proxy.apply(false, None, vec![], vec![p.id.clone()]).unwrap();
    let gone = log.lock().unwrap().last().unwrap().clone();
    assert!(gone.contains("delete chain inet nodeplane-svc s"), "{gone}");
    assert!(gone.contains("delete set inet nodeplane-svc s"), "{gone}");
    // A chain is flushed before any chain is deleted (a dispatcher goes to endpoint chains).
    let first_delete = gone.find("delete chain").unwrap();
    assert!(gone[..first_delete].matches("flush chain").count() >= 4, "{gone}");
}

#[test]
fn two_ports_naming_one_key_keep_the_first_until_it_goes() {
    let (proxy, log) = recording();
    let mut a = port("a/x/TCP/", "10.96.0.30", vec![ep("10.0.0.1", "n1", true, true, false)]);
    let mut b = port(
        "b/y/TCP/",
        "10.96.0.31",
        vec![ep("10.0.0.2", "n1", true, true, false), ep("10.0.0.3", "n1", true, true, false)],
    );
    a.external_ips = vec!["203.0.113.9".into()];
    b.external_ips = vec!["203.0.113.9".into()];
    proxy.apply(true, Some(&[]), vec![a.clone(), b.clone()], vec![]).unwrap();
    assert!(log.lock().unwrap()[0].contains("203.0.113.9 . tcp . 80 : goto xclb4_1"));
    proxy.apply(false, None, vec![], vec![a.id.clone()]).unwrap();
    let s = log.lock().unwrap().last().unwrap().clone();
    assert!(s.contains("add element inet nodeplane-svc vip4 { 203.0.113.9 . tcp . 80 : goto xclb4_2 }"), "{s}");
}

#[test]
fn a_refused_change_writes_the_table_anew() {
    let calls = Arc::new(Mutex::new(0));
    let c = calls.clone();
    let proxy = Proxy::with_runner(
        "n1",
        vec![],
        Box::new(move |s: &str| {
            *c.lock().unwrap() += 1;
            if s.starts_with("table inet") {
                Ok(())
            } else {
                Err(crate::net::policy::NftError::Io { step: "running", source: std::io::Error::other("refused") })
            }
        }),
    );
    proxy.apply(true, Some(&[]), vec![port("a/b/TCP/", "10.96.0.1", vec![])], vec![]).unwrap();
    proxy.apply(false, None, vec![port("a/c/TCP/", "10.96.0.2", vec![])], vec![]).unwrap();
    assert_eq!(*calls.lock().unwrap(), 3, "snapshot, refused change, whole table");
    assert_eq!(proxy.counts().1, 2);
}

#[test]
fn udp_flows_to_a_gone_endpoint_port_or_a_port_that_had_none_are_forgotten() {
    let mut old = port(
        "a/dns/UDP/",
        "10.96.0.53",
        vec![ep("10.0.0.1", "n1", true, true, false), ep("10.0.0.2", "n1", true, true, false)],
    );
    old.protocol = pb::Protocol::Udp as i32;
    let mut new = old.clone();
    new.endpoints.pop();
    let gone = stale_udp_flows(Some(&old), Some(&new));
    assert_eq!(gone.len(), 1);
    assert_eq!(
        gone[0].join(" "),
        "-p udp --orig-dst 10.96.0.53 --orig-port-dst 80 --reply-src 10.0.0.2 --reply-port-src 8080"
    );
    let mut empty = old.clone();
    empty.endpoints.clear();
    assert_eq!(
        stale_udp_flows(Some(&empty), Some(&old))[0].join(" "),
        "-p udp --orig-dst 10.96.0.53 --orig-port-dst 80"
    );
    assert_eq!(stale_udp_flows(Some(&old), None).len(), 1);
    let tcp = port("a/web/TCP/", "10.96.0.80", vec![]);
    assert!(stale_udp_flows(Some(&tcp), None).is_empty());
    // Through the NodePort too; and a ClusterIP the port no longer has loses all its flows.
    old.node_port = 30053;
    new.node_port = 30053;
    let gone: Vec<String> = stale_udp_flows(Some(&old), Some(&new)).iter().map(|f| f.join(" ")).collect();
    assert!(
        gone.contains(&"-p udp --orig-port-dst 30053 --reply-src 10.0.0.2 --reply-port-src 8080".to_string()),
        "{gone:?}"
    );
    let mut moved = old.clone();
    moved.cluster_ips = vec!["10.96.0.54".into()];
    let gone: Vec<String> = stale_udp_flows(Some(&old), Some(&moved)).iter().map(|f| f.join(" ")).collect();
    assert_eq!(gone, ["-p udp --orig-dst 10.96.0.53 --orig-port-dst 80"], "the NodePort and endpoints stay");
    // IPv6: conntrack is told the family, and an entry point forgets only flows to
    // endpoints of its own family.
    let mut dual = old.clone();
    dual.cluster_ips = vec!["10.96.0.53".into(), "fd00:96::53".into()];
    dual.endpoints.push(ep("fd00:244::2", "n1", true, true, false));
    let mut fewer = dual.clone();
    fewer.endpoints.retain(|e| e.ip != "fd00:244::2");
    let gone: Vec<String> = stale_udp_flows(Some(&dual), Some(&fewer)).iter().map(|f| f.join(" ")).collect();
    assert_eq!(
        gone,
        [
            "-p udp -f ipv6 --orig-dst fd00:96::53 --orig-port-dst 80 --reply-src fd00:244::2 --reply-port-src 8080",
            "-p udp -f ipv6 --orig-port-dst 30053 --reply-src fd00:244::2 --reply-port-src 8080",
        ]
    );
    // A NodePort that had no endpoint: its flows of both families.
    let mut none = dual.clone();
    none.endpoints.clear();
    let gone: Vec<String> = stale_udp_flows(Some(&none), Some(&dual)).iter().map(|f| f.join(" ")).collect();
    assert!(gone.contains(&"-p udp --orig-port-dst 30053".to_string()), "{gone:?}");
    assert!(gone.contains(&"-p udp -f ipv6 --orig-port-dst 30053".to_string()), "{gone:?}");
}

#[test]
fn a_whole_write_keeps_the_affinity_sets_its_ports_still_have() {
    let (proxy, log) = recording();
    let mut sticky = port("a/sticky/TCP/", "10.96.0.12", vec![ep("10.0.0.2", "n2", true, true, false)]);
    sticky.affinity_seconds = 60;
    let set = render(&sticky, "n1").sets[0].0.clone();
    // What an earlier agent left: the port's set (with its clients), a set of a port gone
    // since, a map and a chain whose rule names the map.
    let listing = format!(
        "table inet {TABLE} {{\n\tset {set} {{\n\t\ttype ipv4_addr\n\t\tflags dynamic,timeout\n\t}}\n\n\tset s1_00000000 {{\n\t\ttype ipv4_addr\n\t}}\n\n\tmap vip4 {{\n\t\ttypeof ip daddr : verdict\n\t}}\n\n\tchain services {{\n\t\tip daddr . meta l4proto . th dport vmap @vip4\n\t}}\n}}\n"
    );
    assert_eq!(
        table_objects(&listing),
        vec![("set", set.as_str()), ("set", "s1_00000000"), ("map", "vip4"), ("chain", "services")]
    );
    let proxy = proxy.with_lister(Box::new(move || Some(listing.clone())));
    proxy.apply(true, Some(&["10.0.0.0/8".into()]), vec![sticky], vec![]).unwrap();
    let script = log.lock().unwrap()[0].clone();
    let t = TABLE;
    let emptied = format!(
        "add table inet {t}\nflush table inet {t}\ndelete map inet {t} vip4\ndelete set inet {t} s1_00000000\ndelete chain inet {t} services\ntable inet {t} {{\n"
    );
    assert!(script.starts_with(&emptied), "{script}");
    assert!(!script.contains(&format!(" set inet {t} {set} ")), "the set is kept as it is: {script}");
    assert!(script.contains(&format!("update @{set} ")), "{script}");
    // Without a table (or a listing): deleted and made anew, as before.
    let (proxy, log) = recording();
    proxy.apply(true, None, vec![port("a/web/TCP/", "10.96.0.10", vec![])], vec![]).unwrap();
    assert!(log.lock().unwrap()[0].starts_with(&format!("table inet {t}\ndelete table inet {t}\n")));
}
