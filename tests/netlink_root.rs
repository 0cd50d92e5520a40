//! Root-only: how the kernel answers the agent's own rtnetlink requests
//! (`nodeplane::sys::netlink`), in private network namespaces named `npnl<pid>-…` (removed by a
//! guard, also when a test panics). Nothing touches the host's own network namespace.
//!
//! These tests need root and FAIL (never skip) without it.

use std::fs::File;
use std::process::Command;

use nix::sched::CloneFlags;
use nodeplane::sys::netlink::Netlink;

/// Network namespaces of a test's own, deleted when dropped (shared with
/// tests/wireguard_root.rs).
pub(crate) struct Namespaces(pub(crate) Vec<String>);

impl Namespaces {
    pub(crate) fn new(names: &[&str]) -> Self {
        assert_eq!(nix::unistd::geteuid().as_raw(), 0, "network namespaces need root; these tests do not skip");
        let ns = Namespaces(names.iter().map(|n| format!("npnl{}-{n}", std::process::id())).collect());
        for n in &ns.0 {
            let out = Command::new("ip").args(["netns", "add", n]).output().expect("ip");
            assert!(out.status.success(), "ip netns add {n}: {}", String::from_utf8_lossy(&out.stderr));
        }
        ns
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

/// `index_of` answers for the socket's own namespace, whatever namespace the calling thread
/// is in: the agent asks from the node's namespace about the pod's end through a socket
/// made in the pod's.
#[test]
fn index_of_answers_in_the_sockets_namespace() {
    let ns = Namespaces::new(&["ix"]);
    let name = ns.0[0].clone();
    // Four links (veth pairs: this kernel has no dummy links), so the one asked about is not
    // simply the first after lo.
    for (l, peer) in [("npix0", "npix1"), ("npix2", "npix3")] {
        let out = Command::new("ip")
            .args(["-n", &name, "link", "add", l, "type", "veth", "peer", "name", peer])
            .output()
            .expect("ip");
        assert!(out.status.success(), "ip link add {l}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let out = Command::new("ip").args(["-n", &name, "-o", "link", "show", "npix1"]).output().expect("ip");
    let text = String::from_utf8_lossy(&out.stdout);
    let want: u32 =
        text.split(':').next().and_then(|n| n.trim().parse().ok()).unwrap_or_else(|| panic!("ifindex in {text:?}"));
    let mut nl = std::thread::scope(|s| {
        s.spawn(|| {
            let fd = File::open(format!("/run/netns/{name}")).expect("netns");
            nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET).expect("setns");
            Netlink::open().expect("netlink")
        })
        .join()
        .expect("thread")
    });
    // This thread is in the test's own namespace, which has no link of that name.
    assert_eq!(nl.index_of("npix1").expect("index_of"), Some(want));
    assert_eq!(nl.index_of("lo").expect("index_of"), Some(1));
    assert_eq!(nl.index_of("npix9").expect("no such link"), None);
    let e = nl.index_of("a-name-longer-than-15").expect_err("too long for a link name");
    assert!(e.is(libc::EINVAL), "{e:?}");
}

/// The pod bridge as the agent makes it (`create_bridge`, then its MAC pinned with `set_mac`
/// as `Datapath::ensure_bridge` does, address, up) delivers frames for its own MAC: a pod
/// behind a port reaches the gateway address. On Debian's 5.10 a bridge given its own MAC
/// only after creation kept no VLAN-0 local FDB entry for it and the ping got no answer (found
/// by scripts/vm-test); the MAC given in the creating request installs that entry.
#[test]
fn a_created_bridge_delivers_frames_for_its_own_mac() {
    let ns = Namespaces::new(&["brn", "brp"]);
    let (node, pod) = (ns.0[0].clone(), ns.0[1].clone());
    std::thread::scope(|s| {
        s.spawn(|| {
            let fd = File::open(format!("/run/netns/{node}")).expect("netns");
            nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET).expect("setns");
            let mut nl = Netlink::open().expect("netlink");
            nl.create_bridge("npbr0", None).expect("create bridge");
            let br = nl.link_by_name("npbr0").expect("lookup").expect("the bridge");
            let mac = br.mac.expect("a bridge has a MAC");
            assert_eq!(mac[0] & 0x03, 0x02, "unicast, locally administered: {mac:02x?}");
            nl.set_mac(br.index, mac).expect("pin the MAC");
            nl.add_address(br.index, "10.78.0.1".parse().unwrap(), 24).expect("gateway address");
            nl.set_link(br.index, Some(true), None, None, None).expect("bridge up");
        })
        .join()
        .expect("thread")
    });
    let ip = |args: &[&str]| {
        let out = Command::new("ip").args(args).output().expect("ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    ip(&["-n", &node, "link", "add", "npbrv0", "type", "veth", "peer", "name", "eth0", "netns", &pod]);
    ip(&["-n", &node, "link", "set", "npbrv0", "master", "npbr0", "up"]);
    ip(&["-n", &pod, "addr", "add", "10.78.0.2/24", "dev", "eth0"]);
    ip(&["-n", &pod, "link", "set", "eth0", "up"]);
    let out = Command::new("ip")
        .args(["netns", "exec", &pod, "ping", "-c", "1", "-W", "5", "10.78.0.1"])
        .output()
        .expect("ping");
    let fdb = Command::new("bridge").args(["-n", &node, "fdb", "show", "br", "npbr0"]).output().expect("bridge");
    assert!(
        out.status.success(),
        "the pod reaches the bridge's address: {}\nfdb:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&fdb.stdout)
    );
}

/// The agent's start-up probe of kernel features (`nodeplane::sys::features`) against the
/// release it runs on: each feature is there from the mainline release docs/install.md names
/// (Debian's 5.10, 6.1 and 6.12 in the VM lane carry no backport of these). Probed in a
/// private network namespace (the nft check commits nothing, but never in the host's).
#[test]
fn kernel_feature_probe_agrees_with_the_release() {
    use nodeplane::sys::features::{Availability, Feature, probe};
    assert_eq!(nix::unistd::geteuid().as_raw(), 0, "tests/netlink_root.rs needs root; it does not skip");
    let report = std::thread::spawn(|| {
        nix::sched::unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        probe(&[
            Feature::NftInetNat,
            Feature::NetnsCookie,
            Feature::Openat2,
            Feature::LoopConfigure,
            Feature::StatxMountId,
            Feature::BridgeNetfilter,
            Feature::Wireguard,
        ])
    })
    .join()
    .unwrap();
    let release = report.release.clone();
    let mut parts = release.split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse::<u32>().ok());
    let version = (parts.next().unwrap(), parts.next().unwrap());
    let since = |f: Feature| match f {
        Feature::NftInetNat => (5, 2),
        Feature::NetnsCookie => (5, 14),
        Feature::Openat2 => (5, 6),
        Feature::LoopConfigure | Feature::StatxMountId => (5, 8),
        Feature::BridgeNetfilter | Feature::Wireguard => unreachable!("a module, not a release"),
    };
    for c in &report.checks {
        if c.feature == Feature::BridgeNetfilter {
            // br_netfilter makes its sysctls in every network namespace, this new one too.
            let loaded = std::path::Path::new("/proc/sys/net/bridge").exists();
            assert_eq!(c.availability == Availability::Available, loaded, "{release}: {c:?}");
            continue;
        }
        if c.feature == Feature::Wireguard {
            // The probe's request loads the module where the kernel has one (or it is built in).
            let present = std::path::Path::new("/sys/module/wireguard").exists();
            assert_eq!(c.availability == Availability::Available, present, "{release}: {c:?}");
            continue;
        }
        let want = version >= since(c.feature);
        match &c.availability {
            Availability::Available => assert!(want, "{release}: {:?} found before {:?}", c.feature, since(c.feature)),
            Availability::Missing(why) => assert!(!want, "{release}: {:?} missing: {why}", c.feature),
            Availability::Unknown(why) => panic!("{release}: {:?} could not be probed: {why}", c.feature),
        }
    }
    eprintln!("kernel {release}: {:?}", report.checks);
}
