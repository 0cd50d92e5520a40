//! The datapath over the recording fake kernel (`sys::fake_net`): ADD's rollback at every step,
//! DEL's idempotency over every partial state, every CHECK failure, STATUS, GC, reconcile and
//! the doctor, all without root.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};

use super::*;
use crate::net::cni::request::{Env, parse};
use crate::sys::fake_net::FakeNet;
use crate::util::TestDir;

const V4: &str = "10.88.3.0/24";
const V6: &str = "fd00:88:3::/64";

/// Fields drop in order: the datapath first, the directory last.
struct Node {
    dp: Datapath,
    fake: FakeNet,
    published: Arc<AtomicUsize>,
    dir: TestDir,
}

fn node(tag: &str) -> Node {
    let dir = TestDir::new(&format!("dp-{tag}"));
    let (ipam, problems) = Ipam::load(&dir.0.join("leases")).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let fake = FakeNet::new();
    let kernel: Arc<dyn NetKernel> = Arc::new(fake.clone());
    let reaper = Reaper::start(kernel.clone()).unwrap();
    let settings = Settings {
        bridge: "np0".into(),
        mtu: 1400,
        dns: Dns::default(),
        masquerade: false,
        cluster_cidrs: Vec::new(),
        pending_delete_dir: dir.0.join("pending-del"),
    };
    let published = Arc::new(AtomicUsize::new(0));
    let p = published.clone();
    let publish: Publish = Box::new(move || {
        p.fetch_add(1, Ordering::SeqCst);
        Ok(())
    });
    let dp = Datapath::new(settings, ipam, reaper, publish, kernel);
    dp.apply_network(&[V4.parse().unwrap(), V6.parse().unwrap()], None).unwrap();
    Node { dir, fake, dp, published }
}

impl Node {
    /// A pod namespace the fake knows, at a path under the test directory.
    fn netns(&self, name: &str) -> PathBuf {
        let p = self.dir.0.join("netns").join(name);
        self.fake.add_netns(&p);
        p
    }

    fn add(&self, id: &str, netns: &Path) -> Result<Value, CniError> {
        let ns = self.fake.open_netns(netns).map_err(|e| CniError::from(netns_err(e)))?;
        self.dp.add(&request("ADD", id, Some(netns), None), ns).map(|r| r.render("1.0.0")).map_err(CniError::from)
    }

    fn check(&self, id: &str, netns: &Path, prev: &Value) -> Result<(), CniError> {
        let ns = self.fake.open_netns(netns).map_err(|e| CniError::from(netns_err(e)))?;
        self.dp.check(&request("CHECK", id, Some(netns), Some(prev)), ns).map_err(CniError::from)
    }

    fn del(&self, id: &str, netns: Option<&Path>) -> Result<(), CniError> {
        self.dp.del(&request("DEL", id, netns, None)).map_err(CniError::from)
    }

    /// Host links of ours (pod veths and the graveyard), after the reaper caught up.
    fn our_host_links(&self) -> Vec<String> {
        self.dp.reaper.flush();
        self.fake
            .host_links()
            .into_iter()
            .filter(|l| is_host_ifname(&l.name) || is_graveyard(l))
            .map(|l| l.name)
            .collect()
    }

    /// Links in a pod namespace, after the reaper caught up (a retired veth's pod end goes
    /// when the reaper deletes its host end).
    fn pod_links(&self, netns: &Path) -> Vec<String> {
        self.dp.reaper.flush();
        self.fake.netns(netns).map(|n| n.links.into_iter().map(|l| l.name).collect()).unwrap_or_default()
    }

    /// Nothing of an attachment is left: no lease, no host veth, only `lo` in the pod.
    fn assert_clean(&self, netns: &Path) {
        assert_eq!(self.dp.ipam().leases(), Vec::<Lease>::new());
        assert_eq!(self.our_host_links(), Vec::<String>::new());
        if self.fake.netns(netns).is_some() {
            assert_eq!(self.pod_links(netns), vec!["lo".to_string()]);
        }
    }
}

fn request(command: &str, id: &str, netns: Option<&Path>, prev: Option<&Value>) -> Request {
    let mut env = Env::new();
    env.insert("CNI_COMMAND".into(), command.into());
    env.insert("CNI_CONTAINERID".into(), id.into());
    env.insert("CNI_IFNAME".into(), "eth0".into());
    env.insert("CNI_PATH".into(), "/opt/cni/bin".into());
    env.insert("CNI_ARGS".into(), "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-7".into());
    if let Some(n) = netns {
        env.insert("CNI_NETNS".into(), n.display().to_string());
    }
    let mut conf = json!({"cniVersion": "1.0.0", "name": "nodeplane", "type": "nodeplane"});
    if let Some(p) = prev {
        conf["prevResult"] = p.clone();
    }
    parse(&env, conf.to_string().as_bytes()).expect("valid request")
}

fn owner(id: &str) -> Owner {
    Owner { container_id: id.into(), ifname: "eth0".into() }
}

#[test]
fn add_plumbs_the_pod_and_del_removes_everything() {
    let n = node("add-del");
    assert_eq!(n.published.load(Ordering::SeqCst), 1, "published once the node has blocks");
    assert!(n.dp.ready());
    let bridge = n.fake.host_link("np0").expect("bridge made");
    assert!(bridge.up);
    let gws: Vec<String> =
        n.fake.host_addrs().iter().filter(|a| a.index == bridge.index).map(|a| a.ip.to_string()).collect();
    assert_eq!(gws.len(), 2, "one gateway per block: {gws:?}");
    assert_eq!(n.fake.sysctl("net.ipv4.ip_forward").as_deref(), Some("1"));
    assert_eq!(n.fake.sysctl("net.ipv6.conf.all.forwarding").as_deref(), Some("1"));

    let ns = n.netns("pod-a");
    let result = n.add("ctr-a", &ns).unwrap();
    let lease = n.dp.ipam().get(&owner("ctr-a")).expect("lease");
    assert_eq!(lease.state, LeaseState::Ready);
    assert_eq!(lease.ips.len(), 2);
    assert_eq!(lease.pod, "shop/cart-7");
    let host = n.fake.host_link(&lease.host_if).expect("host veth");
    assert!(host.up && host.master == Some(bridge.index));
    let pod = n.fake.netns(&ns).unwrap();
    let eth0 = pod.links.iter().find(|l| l.name == "eth0").expect("eth0 in the pod");
    assert!(eth0.up && eth0.peer == Some(host.index) && eth0.mtu == Some(1400));
    assert!(pod.links.iter().find(|l| l.name == "lo").unwrap().up, "lo up");
    for ip in &lease.ips {
        assert!(pod.addrs.iter().any(|a| a.index == eth0.index && a.ip == ip.ip() && a.prefix == ip.prefix()), "{ip}");
    }
    assert_eq!(pod.routes.len(), 2, "a default route per family");
    assert_eq!(result["ips"].as_array().unwrap().len(), 2);
    assert_eq!(result["interfaces"][2]["sandbox"], json!(ns.display().to_string()));
    // The result says what the kernel has.
    assert_eq!(result["interfaces"][2]["mac"], json!(format_mac(&eth0.mac.unwrap())));
    n.check("ctr-a", &ns, &result).expect("CHECK of a healthy attachment");

    n.del("ctr-a", Some(&ns)).unwrap();
    n.assert_clean(&ns);
    // And again: DEL is idempotent.
    n.del("ctr-a", Some(&ns)).unwrap();
    n.assert_clean(&ns);
    // The addresses are free again.
    n.add("ctr-b", &ns).unwrap();
    assert_eq!(n.dp.ipam().get(&owner("ctr-b")).unwrap().ips.len(), 2);
}

/// A block the controller withdrew keeps its gateway on the bridge while a pod uses it, and
/// loses it with the last one (its connected route would hide the block's new owner).
#[test]
fn a_withdrawn_blocks_gateway_leaves_the_bridge_with_its_last_pod() {
    let n = node("withdrawn");
    let gateways = |n: &Node| -> Vec<String> {
        let bridge = n.fake.host_link("np0").unwrap();
        let mut v: Vec<_> = n
            .fake
            .host_addrs()
            .iter()
            .filter(|a| a.index == bridge.index)
            .map(|a| format!("{}/{}", a.ip, a.prefix))
            .collect();
        v.sort();
        v
    };
    let ns = n.netns("pod-a");
    n.add("ctr-a", &ns).unwrap();
    let (new4, new6) = ("10.88.9.0/24", "fd00:88:9::/64");
    n.dp.ipam().retain_blocks(&[new4.parse().unwrap(), new6.parse().unwrap()]);
    n.dp.apply_network(&[new4.parse().unwrap(), new6.parse().unwrap()], None).unwrap();
    assert_eq!(
        gateways(&n),
        ["10.88.3.1/24", "10.88.9.1/24", "fd00:88:3::1/64", "fd00:88:9::1/64"],
        "a pod uses the old"
    );
    n.del("ctr-a", Some(&ns)).unwrap();
    assert_eq!(gateways(&n), ["10.88.9.1/24", "fd00:88:9::1/64"]);
    // Without a pod in it, a withdrawn block's gateway goes at once.
    let (last4, last6) = ("10.88.10.0/24", "fd00:88:10::/64");
    n.dp.ipam().retain_blocks(&[last4.parse().unwrap(), last6.parse().unwrap()]);
    n.dp.apply_network(&[last4.parse().unwrap(), last6.parse().unwrap()], None).unwrap();
    assert_eq!(gateways(&n), ["10.88.10.1/24", "fd00:88:10::1/64"]);
}

/// Every kernel step of ADD, failed in turn: the ADD fails with the right code, and nothing
/// is left behind — no lease, no host veth, nothing in the pod — so the retry succeeds.
#[test]
fn add_rolls_back_when_any_step_fails() {
    let steps: &[(&str, usize, Code)] = &[
        ("open_netns", 0, Code::Internal),
        ("host", 0, Code::Internal),
        ("create_veth", 0, Code::Internal),
        ("netns_links", 0, Code::Internal),
        // The new pair's ends looked up by name: the host's, then the pod's.
        ("index_of", 0, Code::Internal),
        ("index_of", 1, Code::Internal),
        ("apply", 0, Code::Internal),
    ];
    for &(op, skip, code) in steps {
        let n = node(&format!("rollback-{op}"));
        let ns = n.netns("pod");
        n.fake.fail_after(op, skip, libc::EPERM);
        let err = n.add("ctr", &ns).expect_err(op);
        assert_eq!(err.code, code, "{op}: {err:?}");
        n.assert_clean(&ns);
        n.add("ctr", &ns).unwrap_or_else(|e| panic!("retry after {op} failed: {e:?}"));
        assert!(n.dp.ipam().get(&owner("ctr")).is_some());
    }
}

/// A route the kernel refuses half-way through the pod's batch: the half-configured veth goes
/// with the rollback too.
#[test]
fn add_rolls_back_a_half_applied_batch() {
    let n = node("half-batch");
    let ns = n.netns("pod");
    n.fake.fail_after("apply", 0, libc::ENETUNREACH);
    assert_eq!(n.add("ctr", &ns).unwrap_err().code, Code::Internal);
    n.assert_clean(&ns);
}

#[test]
fn add_errors_are_classified_and_leave_nothing() {
    let n = node("add-errors");
    let gone = n.dir.0.join("netns/never");
    let err = n.add("ctr", &gone).unwrap_err();
    assert_eq!(err.code, Code::InvalidEnv, "{err:?}");
    let plain = n.dir.0.join("netns/plain");
    n.fake.add_plain_file(&plain);
    let err = n.add("ctr", &plain).unwrap_err();
    assert_eq!(err.code, Code::InvalidEnv, "{err:?}");
    assert!(err.msg.contains("not a network namespace"), "{}", err.msg);
    n.assert_clean(&gone);

    let ns = n.netns("pod");
    n.add("ctr", &ns).unwrap();
    let before = n.dp.ipam().get(&owner("ctr")).unwrap();
    let err = n.add("ctr", &ns).unwrap_err();
    assert_eq!(err.code, Code::AlreadyExists);
    assert_eq!(n.dp.ipam().get(&owner("ctr")), Some(before), "the first attachment is untouched");
}

#[test]
fn add_refuses_an_ifname_taken_in_the_pod() {
    let n = node("ifname-taken");
    let ns = n.netns("pod");
    n.fake.edit_netns(&ns, |s| {
        s.links.push(crate::sys::netlink::Link {
            index: 900,
            name: "eth0".into(),
            kind: Some("dummy".into()),
            ..Default::default()
        })
    });
    let err = n.add("ctr", &ns).unwrap_err();
    assert_eq!(err.code, Code::AlreadyExists, "{err:?}");
    assert_eq!(n.dp.ipam().leases(), Vec::<Lease>::new());
    assert_eq!(n.our_host_links(), Vec::<String>::new());
    assert_eq!(
        n.pod_links(&ns),
        vec!["lo".to_string(), "eth0".to_string()],
        "the pod's own eth0 is not ours to remove"
    );
}

#[test]
fn add_replaces_a_stale_host_veth_and_recreates_a_lost_bridge() {
    let n = node("stale");
    // A host end with this attachment's name that no lease holds (a crash between the
    // veth and the lease): the ADD removes it and goes on.
    let other = n.netns("other");
    n.add("ctr", &other).unwrap();
    let stale = n.dp.ipam().get(&owner("ctr")).unwrap().host_if;
    n.dp.ipam().release(&owner("ctr")).unwrap();
    assert!(n.fake.host_link(&stale).is_some());
    let ns = n.netns("pod");
    n.add("ctr", &ns).unwrap();
    assert_eq!(n.pod_links(&other), vec!["lo".to_string()], "the stale pair is gone");
    assert!(n.fake.netns(&ns).unwrap().links.iter().any(|l| l.name == "eth0"));

    // The bridge deleted behind the agent's back: the next ADD makes it again.
    n.fake.delete_link(None, "np0");
    let ns2 = n.netns("pod2");
    n.add("ctr2", &ns2).unwrap();
    let bridge = n.fake.host_link("np0").expect("bridge made again");
    let host = n.fake.host_link(&n.dp.ipam().get(&owner("ctr2")).unwrap().host_if).unwrap();
    assert_eq!(host.master, Some(bridge.index));
    assert_eq!(n.fake.host_addrs().iter().filter(|a| a.index == bridge.index).count(), 2, "gateways back");
}

#[test]
fn add_applies_a_queued_del_first() {
    let n = node("queued");
    let ns = n.netns("pod");
    let first = n.add("ctr", &ns).unwrap();
    let old_ips = n.dp.ipam().get(&owner("ctr")).unwrap().ips;
    // The shim queued a DEL for this attachment while the agent was away.
    let dir = &n.dir.0.join("pending-del");
    std::fs::create_dir_all(dir).unwrap();
    let wire = json!({"env": {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "ctr", "CNI_IFNAME": "eth0"}, "stdin": ""});
    let file = dir.join(crate::net::pending_del::file_name("ctr", "eth0"));
    std::fs::write(&file, wire.to_string()).unwrap();
    let ns2 = n.netns("pod-new");
    n.add("ctr", &ns2).expect("the queued DEL made room");
    assert_eq!(n.pod_links(&ns), vec!["lo".to_string()]);
    assert!(n.fake.netns(&ns2).unwrap().links.iter().any(|l| l.name == "eth0"));
    assert_eq!(n.dp.ipam().leases().len(), 1);
    assert_eq!(first["ips"].as_array().unwrap().len(), old_ips.len());
}

/// DEL over every partial state an attachment can be in: it succeeds, leaves nothing, and
/// succeeds again.
#[test]
fn del_is_idempotent_over_every_partial_state() {
    type Setup = fn(&Node, &Path);
    let states: &[(&str, Setup)] = &[
        ("never added", |_, _| {}),
        ("fully added", |n, ns| {
            n.add("ctr", ns).unwrap();
        }),
        ("lease without host veth", |n, ns| {
            n.add("ctr", ns).unwrap();
            let host = n.dp.ipam().get(&owner("ctr")).unwrap().host_if;
            n.fake.delete_link(None, &host);
        }),
        ("host veth without lease", |n, ns| {
            n.add("ctr", ns).unwrap();
            n.dp.ipam().release(&owner("ctr")).unwrap();
        }),
        ("pod namespace gone", |n, ns| {
            n.add("ctr", ns).unwrap();
            n.fake.remove_netns(ns);
        }),
        ("ADD never completed", |n, ns| {
            let lease = Lease {
                owner: owner("ctr"),
                state: LeaseState::Adding,
                netns: ns.display().to_string(),
                netns_inode: 0,
                netns_cookie: 0,
                host_ifindex: 0,
                host_if: host_ifname(&owner("ctr")),
                ips: Vec::new(),
                pod: "shop/cart-7".into(),
            };
            let r = n.dp.ipam().reserve(lease).unwrap();
            drop(r);
        }),
        ("host end retired, not yet reaped", |n, ns| {
            n.add("ctr", ns).unwrap();
            let host = n.dp.ipam().get(&owner("ctr")).unwrap().host_if;
            let index = n.fake.host_link(&host).unwrap().index;
            let mut nl = n.fake.host().unwrap();
            nl.set_link(index, Some(false), Some(0), None, Some(GRAVEYARD_GROUP)).unwrap();
        }),
    ];
    for (what, setup) in states {
        let n = node(&format!("del-{}", what.replace(' ', "-").replace(',', "")));
        let ns = n.netns("pod");
        setup(&n, &ns);
        n.del("ctr", Some(&ns)).unwrap_or_else(|e| panic!("{what}: {e:?}"));
        n.assert_clean(&ns);
        n.del("ctr", Some(&ns)).unwrap_or_else(|e| panic!("{what}, again: {e:?}"));
        n.del("ctr", None).unwrap_or_else(|e| panic!("{what}, without CNI_NETNS: {e:?}"));
        n.assert_clean(&ns);
    }
}

#[test]
fn del_that_cannot_reach_the_kernel_keeps_the_lease_for_the_retry() {
    let n = node("del-retry");
    let ns = n.netns("pod");
    n.add("ctr", &ns).unwrap();
    n.fake.fail("host", libc::ENOBUFS);
    assert_eq!(n.del("ctr", Some(&ns)).unwrap_err().code, Code::Internal);
    assert!(n.dp.ipam().get(&owner("ctr")).is_some(), "not released while its veth may still be up");
    n.del("ctr", Some(&ns)).unwrap();
    n.assert_clean(&ns);
}

#[test]
fn del_of_nothing_changes_no_kernel_state() {
    let n = node("del-nothing");
    let before = format!("{:?}", n.fake.host().unwrap().links().unwrap());
    n.fake.clear_calls();
    n.del("ghost", None).unwrap();
    // DEL retires the link by its name in one request (no lookup first): with no such link
    // that request is all it sends, and it changes nothing.
    let changes: Vec<String> = n
        .fake
        .calls()
        .into_iter()
        .filter(|c| {
            !c.contains(" link_by_name ")
                && !c.contains(" links ")
                && !c.contains(" host ")
                && !c.contains(" delete_group ")
        })
        .collect();
    let ghost = host_ifname(&owner("ghost"));
    assert_eq!(changes, vec![format!("host retire_named {ghost} group={GRAVEYARD_GROUP}")]);
    assert_eq!(format!("{:?}", n.fake.host().unwrap().links().unwrap()), before);
}

/// DEL leaves the host end in the graveyard under its own name: an ADD of the same
/// attachment right away (in a new namespace: podman's restart) still gets that name, live.
#[test]
fn add_right_after_del_gets_the_name_back() {
    let n = node("readd");
    let (first, second) = (n.netns("first"), n.netns("second"));
    n.add("ctr", &first).unwrap();
    let host = host_ifname(&owner("ctr"));
    let old = n.fake.host_link(&host).unwrap();
    n.del("ctr", Some(&first)).unwrap();
    n.add("ctr", &second).unwrap();
    let new = n.fake.host_link(&host).expect("the name is live again");
    assert_ne!(new.index, old.index);
    assert!(new.up && new.group == 0, "{new:?}");
    assert_eq!(new.master, n.fake.host_link("np0").map(|b| b.index));
    // The old pair is gone once the reaper caught up; the new one is the only link of ours.
    assert_eq!(n.our_host_links(), vec![host]);
    assert_eq!(n.pod_links(&first), vec!["lo".to_string()]);
    n.del("ctr", Some(&second)).unwrap();
    n.assert_clean(&second);
}

/// The bridge's repair re-attaches every leased host veth, but not one that was retired (a
/// DEL that stopped before it freed the lease): that one stays down for the reaper.
#[test]
fn bridge_repair_leaves_retired_links_down() {
    let n = node("repair-retired");
    let (live_ns, dead_ns) = (n.netns("live"), n.netns("dead"));
    n.add("live", &live_ns).unwrap();
    n.add("dead", &dead_ns).unwrap();
    let (live, dead) = (host_ifname(&owner("live")), host_ifname(&owner("dead")));
    n.fake.edit_link(None, &live, |l| l.master = None);
    n.fake.edit_link(None, &dead, |l| {
        l.up = false;
        l.group = GRAVEYARD_GROUP;
    });
    n.dp.ensure_bridge().unwrap();
    let bridge = n.fake.host_link("np0").unwrap().index;
    let l = n.fake.host_link(&live).unwrap();
    assert!(l.up && l.master == Some(bridge), "{l:?}");
    let d = n.fake.host_link(&dead).unwrap();
    assert!(!d.up && d.group == GRAVEYARD_GROUP, "{d:?}");
}

/// Every way CHECK can find an attachment broken, one at a time, each with its message.
#[test]
fn check_reports_each_broken_part() {
    type Break = fn(&Node, &Path, &mut Value);
    let cases: &[(&str, Code, &str, Break)] = &[
        ("no attachment", Code::UnknownContainer, "no attachment for container", |n, _, _| {
            n.dp.ipam().release(&owner("ctr")).unwrap();
        }),
        ("interface not in prevResult", Code::Internal, "prevResult has no container interface", |_, _, prev| {
            prev["interfaces"][2]["name"] = json!("net1");
        }),
        ("lease address not in prevResult", Code::Internal, "is not in prevResult", |_, _, prev| {
            prev["ips"].as_array_mut().unwrap().pop();
        }),
        ("prevResult address not leased", Code::Internal, "is not leased to", |_, _, prev| {
            prev["ips"].as_array_mut().unwrap().push(json!({"address": "10.88.3.250/24", "interface": 2}));
        }),
        ("namespace gone", Code::InvalidEnv, "does not exist", |n, ns, _| {
            n.fake.remove_netns(ns);
        }),
        ("another namespace at the path", Code::Internal, "is not the one", |n, ns, _| {
            n.fake.replace_netns(ns);
        }),
        ("interface gone", Code::Internal, "not found in network namespace", |n, ns, _| {
            n.fake.edit_netns(ns, |s| s.links.retain(|l| l.name != "eth0"));
        }),
        ("not a veth", Code::Internal, "not a veth", |n, ns, _| {
            n.fake.edit_link(Some(ns), "eth0", |l| l.kind = Some("dummy".into()));
        }),
        ("interface down", Code::Internal, "is down", |n, ns, _| {
            n.fake.edit_link(Some(ns), "eth0", |l| l.up = false);
        }),
        ("MAC changed", Code::Internal, "has MAC", |n, ns, _| {
            n.fake.edit_link(Some(ns), "eth0", |l| l.mac = Some([2, 0, 0, 0, 0, 9]));
        }),
        ("address missing", Code::Internal, "is missing from eth0", |n, ns, _| {
            n.fake.edit_netns(ns, |s| {
                s.addrs.pop();
            });
        }),
        ("default route missing", Code::Internal, "default route via", |n, ns, _| {
            n.fake.edit_netns(ns, |s| s.routes.clear());
        }),
        ("host veth missing", Code::Internal, "host veth", |n, _, _| {
            let host = n.dp.ipam().get(&owner("ctr")).unwrap().host_if;
            n.fake.edit_link(None, &host, |l| l.name = "renamed0".into());
        }),
        ("bridge missing", Code::Internal, "bridge np0 is missing", |n, _, _| {
            n.fake.edit_link(None, "np0", |l| l.name = "np-old".into());
        }),
        ("host veth off the bridge", Code::Internal, "is not attached to bridge", |n, _, _| {
            let host = n.dp.ipam().get(&owner("ctr")).unwrap().host_if;
            n.fake.edit_link(None, &host, |l| l.master = None);
        }),
        ("host veth down", Code::Internal, "is down", |n, _, _| {
            let host = n.dp.ipam().get(&owner("ctr")).unwrap().host_if;
            n.fake.edit_link(None, &host, |l| l.up = false);
        }),
        ("not the peer", Code::Internal, "is not the peer of host veth", |n, ns, _| {
            n.fake.edit_link(Some(ns), "eth0", |l| l.peer = Some(4242));
        }),
    ];
    for (what, code, text, breaks) in cases {
        let n = node(&format!("check-{}", what.replace(' ', "-")));
        let ns = n.netns("pod");
        let mut prev = n.add("ctr", &ns).unwrap();
        n.check("ctr", &ns, &prev).unwrap_or_else(|e| panic!("{what}: healthy first: {e:?}"));
        breaks(&n, &ns, &mut prev);
        let err = n.check("ctr", &ns, &prev).expect_err(what);
        assert_eq!(err.code, *code, "{what}: {err:?}");
        assert!(err.msg.contains(text), "{what}: {:?} does not say {text:?}", err.msg);
    }
}

#[test]
fn check_of_an_unfinished_add_says_so() {
    let n = node("check-adding");
    let ns = n.netns("pod");
    let prev = n.add("ctr", &ns).unwrap();
    let mut lease = n.dp.ipam().get(&owner("ctr")).unwrap();
    n.dp.ipam().release(&owner("ctr")).unwrap();
    lease.state = LeaseState::Adding;
    lease.ips.clear();
    let _r = n.dp.ipam().reserve(lease).unwrap();
    let err = n.check("ctr", &ns, &prev).unwrap_err();
    assert_eq!(err.code, Code::Internal);
    assert!(err.msg.contains("still being set up"), "{}", err.msg);
}

#[test]
fn status_tells_what_is_unavailable() {
    let n = node("status");
    n.dp.status().unwrap();
    n.fake.edit_link(None, "np0", |l| l.up = false);
    assert_eq!(CniError::from(n.dp.status().unwrap_err()).code, Code::NotAvailable, "no pods yet");
    n.fake.edit_link(None, "np0", |l| l.up = true);
    let ns = n.netns("pod");
    n.add("ctr", &ns).unwrap();
    n.fake.edit_link(None, "np0", |l| l.up = false);
    assert_eq!(CniError::from(n.dp.status().unwrap_err()).code, Code::NotAvailablePodsAffected);
    n.fake.edit_link(None, "np0", |l| l.up = true);
    let host = n.dp.ipam().get(&owner("ctr")).unwrap().host_if;
    n.fake.edit_link(None, &host, |l| l.master = None);
    let err = CniError::from(n.dp.status().unwrap_err());
    assert_eq!(err.code, Code::NotAvailablePodsAffected);
    assert!(err.msg.contains("1 pod veth(s)"), "{}", err.msg);
}

#[test]
fn gc_frees_what_the_runtime_does_not_list() {
    let n = node("gc");
    let (a, b) = (n.netns("a"), n.netns("b"));
    n.add("keep", &a).unwrap();
    n.add("drop", &b).unwrap();
    let mut conf = json!({"cniVersion": "1.1.0", "name": "nodeplane", "type": "nodeplane",
        "cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "eth0"}]});
    let mut env = Env::new();
    env.insert("CNI_COMMAND".into(), "GC".into());
    env.insert("CNI_PATH".into(), "/opt/cni/bin".into());
    let req = parse(&env, conf.to_string().as_bytes()).unwrap();
    n.dp.gc(&req).unwrap();
    assert!(n.dp.ipam().get(&owner("keep")).is_some());
    assert!(n.dp.ipam().get(&owner("drop")).is_none());
    assert_eq!(n.pod_links(&b), vec!["lo".to_string()]);
    assert!(n.fake.netns(&a).unwrap().links.iter().any(|l| l.name == "eth0"));
    conf["cni.dev/valid-attachments"] = json!([]);
    n.dp.gc(&parse(&env, conf.to_string().as_bytes()).unwrap()).unwrap();
    n.assert_clean(&a);
}

#[test]
fn reconcile_frees_what_a_restart_cannot_keep() {
    let n = node("reconcile");
    let (a, b, c) = (n.netns("a"), n.netns("b"), n.netns("c"));
    n.add("alive", &a).unwrap();
    n.add("ns-gone", &b).unwrap();
    n.add("ns-replaced", &c).unwrap();
    n.fake.remove_netns(&b);
    n.fake.replace_netns(&c);
    let report = n.dp.reconcile(false).unwrap();
    assert_eq!(report.kept, 1, "{report:?}");
    assert_eq!(report.freed.len(), 2, "{report:?}");
    assert!(n.dp.ipam().get(&owner("alive")).is_some());
    assert_eq!(n.dp.ipam().leases().len(), 1);
    // After a reboot nothing survives.
    let report = n.dp.reconcile(true).unwrap();
    assert_eq!((report.kept, report.freed.len()), (0, 1));
    n.assert_clean(&a);
}

#[test]
fn doctor_finds_and_repairs_orphans_but_never_a_live_pod() {
    // A lease is judged by its host veth (the pair lives and dies with the pod's namespace,
    // whose path is the runtime's and never resolved by the agent).
    let n = node("doctor");
    let (a, b, c) = (n.netns("a"), n.netns("b"), n.netns("c"));
    n.add("alive", &a).unwrap();
    n.add("pod-gone", &b).unwrap();
    n.add("veth-gone", &c).unwrap();
    n.fake.remove_netns(&b);
    let veth_gone = n.dp.ipam().get(&owner("veth-gone")).unwrap().host_if;
    n.fake.delete_link(None, &veth_gone);
    // A namespace path the agent cannot see (the runtime's, elsewhere) means nothing.
    n.fake.remove_netns_path_only(&a);
    let (found, skipped) = n.dp.doctor(false).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let mut kinds: Vec<(&str, String)> = found.iter().map(|f| (f.kind, f.subject.clone())).collect();
    kinds.sort();
    assert_eq!(
        kinds,
        vec![(LEASE_WITHOUT_POD, "pod-gone/eth0".to_string()), (LEASE_WITHOUT_POD, "veth-gone/eth0".to_string())]
    );
    let (found, _) = n.dp.doctor(true).unwrap();
    assert_eq!(found.len(), 2);
    assert!(n.dp.ipam().get(&owner("pod-gone")).is_none(), "repaired");
    assert!(n.dp.ipam().get(&owner("veth-gone")).is_none(), "repaired");
    assert!(n.dp.ipam().get(&owner("alive")).is_some(), "a live pod keeps its addresses");
    // And a restart keeps it too.
    assert_eq!(n.dp.reconcile(false).unwrap().kept, 1);
    assert!(n.dp.ipam().get(&owner("alive")).is_some());
}

/// The one table from datapath errors to CNI codes.
#[test]
fn net_errors_map_to_cni_codes() {
    let kernel = || NetlinkError { op: "x".into(), source: std::io::Error::from_raw_os_error(libc::EPERM) };
    let cases: Vec<(NetError, Code)> = vec![
        (NetError::Kernel { context: "creating veth".into(), source: kernel() }, Code::Internal),
        (NetError::NoNetns(NetnsError::NotFound("/x".into())), Code::InvalidEnv),
        (
            NetError::Netns(NetnsError::Io { path: "/x".into(), source: std::io::Error::other("EMFILE") }),
            Code::Internal,
        ),
        (NetError::Ipam(IpamError::NoBlock(None)), Code::TryAgainLater),
        (NetError::Ipam(IpamError::Exhausted { family: Family::V6, blocks: V6.into() }), Code::TryAgainLater),
        (NetError::Ipam(IpamError::Io { path: "/x".into(), source: std::io::Error::other("ENOSPC") }), Code::Io),
        (NetError::NoBlock("IPv4 block full and no new block".into()), Code::TryAgainLater),
        (NetError::AlreadyExists("eth0".into()), Code::AlreadyExists),
        (NetError::UnknownContainer("ctr".into()), Code::UnknownContainer),
        (NetError::Broken("down".into()), Code::Internal),
        (NetError::Io("sysctl".into()), Code::Io),
        (NetError::NotAvailable { msg: "full".into(), pods_affected: false }, Code::NotAvailable),
        (NetError::NotAvailable { msg: "bridge".into(), pods_affected: true }, Code::NotAvailablePodsAffected),
    ];
    for (e, code) in cases {
        let text = e.to_string();
        let c = CniError::from(e);
        assert_eq!((c.code, c.msg.as_str()), (code, text.as_str()));
    }
    assert_eq!(IpamError::NoBlock(None).to_string(), "no pod address block is assigned to this node");
    assert_eq!(IpamError::NoBlock(Some(Family::V4)).to_string(), "no IPv4 pod address block is assigned to this node");
}
