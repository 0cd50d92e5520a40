//! Root-only: what the kernel answers to the agent's own rtnetlink requests
//! (`nodeplane::sys::netlink`), in private network namespaces named `npnl<pid>-…` (removed by a
//! guard, also when a test panics). Nothing touches the host's own network namespace.
//!
//! These tests need root and FAIL (never skip) without it.

use std::fs::File;
use std::os::fd::AsFd;
use std::process::Command;

use nix::sched::CloneFlags;
use nodeplane::sys::netlink::{Netlink, VethSpec};
use serde_json::Value;

struct Namespaces(Vec<String>);

impl Namespaces {
    fn new(names: &[&str]) -> Self {
        assert_eq!(unsafe { libc::geteuid() }, 0, "tests/netlink_root.rs needs root (network namespaces, veths); it does not skip");
        let ns = Namespaces(names.iter().map(|n| format!("npnl{}-{n}", std::process::id())).collect());
        for n in &ns.0 {
            let out = Command::new("ip").args(["netns", "add", n]).output().expect("ip");
            assert!(out.status.success(), "ip netns add {n}: {}", String::from_utf8_lossy(&out.stderr));
        }
        ns
    }

    fn links(&self, i: usize) -> Vec<Value> {
        let out = Command::new("ip").args(["-n", &self.0[i], "-j", "link", "show"]).output().expect("ip");
        assert!(out.status.success());
        serde_json::from_slice::<Vec<Value>>(&out.stdout).expect("ip -j")
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

/// Linux (major, minor) from uname.
fn kernel() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("kernel release");
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// A veth creation answers with both ends' ifindexes (the kernel's echo, Linux 6.3 and later),
/// which ADD uses instead of looking the peer up in the pod's namespace: they must be the
/// ifindexes the kernel gave the two ends.
#[test]
fn veth_creation_echoes_both_ends_ifindexes() {
    let ns = Namespaces::new(&["node", "pod"]);
    let node = ns.0[0].clone();
    let pod = File::open(format!("/run/netns/{}", ns.0[1])).expect("pod netns");
    let created = std::thread::scope(|s| {
        s.spawn(|| {
            let fd = File::open(format!("/run/netns/{node}")).expect("node netns");
            nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET).expect("setns");
            let mut nl = Netlink::open().expect("netlink");
            nl.create_veth(&VethSpec {
                host_name: "vnltest0",
                host_mac: [0x02, 0, 0, 0, 0, 1],
                peer_name: "eth0",
                peer_mac: [0x02, 0, 0, 0, 0, 2],
                peer_netns: pod.as_fd(),
                mtu: 1400,
                master: None,
            })
            .expect("create veth")
        })
        .join()
        .expect("thread")
    });
    let index_of = |links: Vec<Value>, name: &str| {
        links.iter().find(|l| l["ifname"] == name).and_then(|l| l["ifindex"].as_u64()).unwrap_or_else(|| panic!("{name} missing: {links:?}"))
            as u32
    };
    let host = index_of(ns.links(0), "vnltest0");
    let peer = index_of(ns.links(1), "eth0");
    match created {
        Some(c) => {
            assert_eq!((c.host_index, c.peer_index), (host, peer));
        }
        None => assert!(kernel() < (6, 3), "kernel {:?} echoes new links, but nothing was read from the answer", kernel()),
    }
}

/// A batch asks only its last request for an ack; a failure before it is still answered by
/// the kernel and returned (the first in request order), and the batch's read ends with the
/// last request's answer: nothing of it is left on the socket for the next request.
#[test]
fn batch_returns_the_first_failure_and_reads_every_answer() {
    use nodeplane::sys::netlink::Req;
    let ns = Namespaces::new(&["batch"]);
    let name = ns.0[0].clone();
    let (bad, good, after) = std::thread::scope(|s| {
        s.spawn(|| {
            let fd = File::open(format!("/run/netns/{name}")).expect("netns");
            nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET).expect("setns");
            let mut nl = Netlink::open().expect("netlink");
            let lo = 1;
            // The route's gateway is on no link: ENETUNREACH, in the middle of the batch.
            let bad = nl.batch(vec![
                Req::link_up(lo, true),
                Req::add_route(None, Some("10.77.0.1".parse().unwrap()), lo, false),
                Req::add_address(lo, "10.77.1.1".parse().unwrap(), 32),
                Req::add_address(lo, "10.77.1.1".parse().unwrap(), 32),
            ]);
            let good = nl.batch(vec![Req::add_address(lo, "10.77.2.1".parse().unwrap(), 32), Req::link_up(lo, true)]);
            // The socket answers the next request with that request's answer.
            let after = nl.links().expect("links");
            (bad, good, after)
        })
        .join()
        .expect("thread")
    });
    let e = bad.expect_err("a route to an unreachable gateway");
    assert!(e.is(libc::ENETUNREACH), "the first failure, the route's: {e:?}");
    good.expect("a batch that fails nowhere");
    assert!(after.iter().any(|l| l.name == "lo" && l.up), "{after:?}");
    // The kernel went on after the failure: the address after the route is there.
    let out = Command::new("ip").args(["-n", &ns.0[0], "-4", "addr", "show", "dev", "lo"]).output().expect("ip");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("10.77.1.1/32") && text.contains("10.77.2.1/32"), "{text}");
}
