//! NetworkPolicy at scale, as one node holds it: the controller's compiler
//! (`nodeplane::controller::policy::compile`) over N pods on the node and P policies, its
//! view rendered by the agent's code (`nodeplane::net::policy`) and loaded into nftables in a
//! private network namespace; then the table's rule and set-element counts, and the time to
//! compile, to render, to load the whole table and to apply one change in place.
//!
//!     policy_bench <netns path> [pods,policies ...]     (default 100,10 1000,10 100,100 1000,100 1000,1000)
//!
//! The model: pods spread over 10 namespaces and 10 apps (labels `app`, `tier`); each policy
//! selects one app in one namespace and admits two peers: another app of the same namespace
//! (a podSelector) and a tier across namespaces (namespaceSelector + podSelector), on one
//! port and one named port. Run through `scripts/bench-policy`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::Instant;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use nodeplane::controller::policy::compile::compile;
use nodeplane::controller::policy::model::{Attached, Objects};
use nodeplane::net::policy::{View, render_delta, render_snapshot};

fn objects(pods: usize, policies: usize) -> Objects {
    let mut o = Objects::default();
    for n in 0..10 {
        o.set_namespace(
            &serde_json::from_value(
                serde_json::json!({"metadata": {"name": format!("ns{n}"), "labels": {"env": "bench"}}}),
            )
            .unwrap(),
        )
        .unwrap();
    }
    for i in 0..pods {
        let (ns, app, tier) = (format!("ns{}", i % 10), format!("app{}", (i / 10) % 10), format!("tier{}", i % 3));
        let name = format!("pod{i}");
        o.set_pod(
            &serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": ns, "name": name, "labels": {"app": app, "tier": tier}},
                "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]}
            }))
            .unwrap(),
        )
        .unwrap();
        let v4: IpAddr = format!("10.{}.{}.{}", 128 + i / 65536, (i / 256) % 256, i % 256).parse().unwrap();
        let v6: IpAddr = format!("fd00:b::{:x}", i + 1).parse().unwrap();
        o.attached.insert((ns, name), Attached { node: "bench".into(), ips: vec![v4, v6] });
    }
    for p in 0..policies {
        let ns = format!("ns{}", p % 10);
        let pol: NetworkPolicy = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": ns, "name": format!("policy{p}")},
            "spec": {
                "podSelector": {"matchLabels": {"app": format!("app{}", (p / 10) % 10)}},
                "ingress": [{
                    "from": [
                        {"podSelector": {"matchLabels": {"app": format!("app{}", (p / 10 + 1) % 10)}}},
                        {"namespaceSelector": {"matchLabels": {"env": "bench"}}, "podSelector": {"matchLabels": {"tier": format!("tier{}", p % 3)}}}
                    ],
                    "ports": [{"port": 1000 + p as i32}, {"port": "http"}]
                }]
            }
        }))
        .unwrap();
        o.set_policy(&pol).unwrap();
    }
    o
}

fn nft(netns: &str, args: &[&str], stdin: Option<&str>) -> String {
    let mut child = Command::new("nsenter")
        .arg(format!("--net={netns}"))
        .arg("nft")
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nft");
    if let Some(s) = stdin {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "nft {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn counts(netns: &str) -> (usize, usize, usize, usize) {
    let doc: serde_json::Value =
        serde_json::from_str(&nft(netns, &["-j", "list", "table", "inet", "nodeplane-policy"], None)).unwrap();
    let (mut rules, mut elements, mut chains, mut sets) = (0, 0, 0, 0);
    for o in doc["nftables"].as_array().unwrap() {
        if o.get("rule").is_some() {
            rules += 1;
        }
        if o.get("chain").is_some() {
            chains += 1;
        }
        for k in ["set", "map"] {
            if let Some(s) = o.get(k) {
                sets += 1;
                elements += s.get("elem").and_then(|e| e.as_array()).map_or(0, |e| e.len());
            }
        }
    }
    (rules, elements, chains, sets)
}

fn view_of(o: &Objects) -> (View, f64) {
    let t = Instant::now();
    let views = compile(o);
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let node = views.get("bench").cloned().unwrap_or_default();
    let u = node.snapshot(1);
    (View::default().applied(&u).unwrap(), ms)
}

pub fn main() {
    let mut args = std::env::args().skip(1);
    let netns = args.next().expect("usage: policy_bench <netns path> [pods,policies ...]");
    let mut shapes: Vec<(usize, usize)> = args
        .map(|a| a.split_once(',').map(|(x, y)| (x.parse().unwrap(), y.parse().unwrap())).expect("pods,policies"))
        .collect();
    if shapes.is_empty() {
        shapes = vec![(100, 10), (1000, 10), (100, 100), (1000, 100), (1000, 1000)];
    }
    println!(
        "NetworkPolicy state of one node (model: 10 namespaces x 10 apps x 3 tiers; each policy: 2 peers, 2 ports)"
    );
    println!(
        "{:>6} {:>9} {:>7} {:>9} {:>7} {:>6} {:>11} {:>10} {:>9} {:>10}",
        "pods", "policies", "rules", "elements", "chains", "sets", "compile ms", "render ms", "load ms", "change ms"
    );
    let mut rows = BTreeMap::new();
    for (pods, policies) in shapes {
        let o = objects(pods, policies);
        let (view, compile_ms) = view_of(&o);
        let t = Instant::now();
        let script = render_snapshot(&view);
        let render_ms = t.elapsed().as_secs_f64() * 1000.0;
        let t = Instant::now();
        nft(&netns, &["-f", "-"], Some(&script));
        let load_ms = t.elapsed().as_secs_f64() * 1000.0;
        let (rules, elements, chains, sets) = counts(&netns);
        // One change in place: a pod of app1 relabelled app2 (its group moves, two selector
        // sets change) — compiled, diffed and applied as a delta.
        let mut o2 = o.clone();
        let key = o2.pods.keys().find(|k| o2.pods[*k].labels.get("app").map(String::as_str) == Some("app1")).cloned();
        if let Some(k) = key {
            o2.pods.get_mut(&k).unwrap().labels.insert("app".into(), "app2".into());
        }
        let (view2, _) = view_of(&o2);
        let delta = render_delta(&view, &view2);
        let t = Instant::now();
        nft(&netns, &["-f", "-"], Some(&delta));
        let change_ms = t.elapsed().as_secs_f64() * 1000.0;
        println!(
            "{pods:>6} {policies:>9} {rules:>7} {elements:>9} {chains:>7} {sets:>6} {compile_ms:>11.1} {render_ms:>10.1} {load_ms:>9.1} {change_ms:>10.1}"
        );
        rows.insert((pods, policies), (rules, elements));
    }
    // Growth: each figure from 100 to 1,000 pods (at 100 policies) and from 100 to 1,000
    // policies (at 1,000 pods). Grown with pods + policies, each factor stays near 10 or
    // below; their product would be x10 in both directions and x100 from corner to corner.
    if let (Some(a), Some(b), Some(c)) = (rows.get(&(100, 100)), rows.get(&(1000, 100)), rows.get(&(1000, 1000))) {
        for (what, f) in
            [("rules", (|r: &(usize, usize)| r.0) as fn(&(usize, usize)) -> usize), ("set elements", |r| r.1)]
        {
            let x = |n: usize, d: usize| n as f64 / d.max(1) as f64;
            println!(
                "{what}: x{:.2} from 100 to 1000 pods, x{:.2} from 100 to 1000 policies, x{:.2} from (100 pods, 100 policies) to (1000, 1000) (a product: x100)",
                x(f(b), f(a)),
                x(f(c), f(b)),
                x(f(c), f(a))
            );
        }
    }
    nft(&netns, &["delete", "table", "inet", "nodeplane-policy"], None);
}
