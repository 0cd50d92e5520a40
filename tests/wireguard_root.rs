//! Root-only, WireGuard: how the kernel answers the agent's generic netlink requests
//! (`nodeplane::sys::wireguard`), in a private network namespace (netlink_root's guard: removed
//! also when a test panics). Nothing touches the host's own network namespace.
//!
//! The VM lane runs these (scripts/vm-test: Debian's kernels have WireGuard); this host's
//! kernel has none, and scripts/test says so instead of running them. Without WireGuard
//! they FAIL, never skip.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;

use ipnetwork::IpNetwork;
use nix::sched::CloneFlags;
use nodeplane::net::wireguard::{KeyPair, PeerInput, changes, wanted};
use nodeplane::sys::wireguard::Wg;

/// A device given 41 peers, one of them with 3,000 allowed IPs (about 84 KB: more than a
/// netlink attribute's 16-bit length can say, so the agent sends it in fragments), reads
/// back whole: the kernel splits that peer across dump messages (32 KB at most), and the
/// agent joins it again. 41 peers, each with all of its allowed IPs: the agent's next sync
/// has nothing to change.
#[test]
fn a_peer_split_across_dump_messages_reads_back_whole() {
    let ns = crate::netlink_root::Namespaces::new(&["wg-split"]);
    let name = &ns.0[0];
    let out = Command::new("ip").args(["-n", name, "link", "add", "npwg0", "type", "wireguard"]).output().expect("ip");
    assert!(
        out.status.success(),
        "no WireGuard in this kernel (run this in the VM lane, scripts/vm-test): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let big: Vec<IpNetwork> =
        (0..3000u32).map(|j| IpNetwork::new(IpAddr::V4(Ipv4Addr::from(0x0a80_0000 + j * 64)), 26).unwrap()).collect();
    let small: Vec<Vec<IpNetwork>> = (0..40u16)
        .map(|i| {
            vec![
                IpNetwork::new(IpAddr::V4(Ipv4Addr::new(10, i as u8, 0, 0)), 24).unwrap(),
                IpNetwork::new(IpAddr::V6(Ipv6Addr::new(0xfd00, i, 0, 0, 0, 0, 0, 0)), 64).unwrap(),
            ]
        })
        .collect();
    let names: Vec<String> = (0..=40).map(|i| format!("node-{i:02}")).collect();
    let keys: Vec<KeyPair> = (0..=40).map(|_| KeyPair::generate()).collect();
    let peers: Vec<PeerInput> = (0..=40)
        .map(|i| PeerInput {
            name: &names[i],
            key: *keys[i].public(),
            endpoint: IpAddr::V4(Ipv4Addr::new(192, 0, 2, i as u8 + 1)),
            blocks: if i == 0 { &big } else { &small[i - 1] },
        })
        .collect();
    let want = wanted(&peers, 51871);
    let dev = std::thread::scope(|s| {
        s.spawn(|| {
            let fd = File::open(format!("/run/netns/{name}")).expect("netns");
            nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET).expect("setns");
            let mut wg = Wg::open().expect("the wireguard netlink family");
            wg.configure("npwg0", None, None, &changes(&[], &want)).expect("configure");
            wg.device("npwg0").expect("read back")
        })
        .join()
        .expect("thread")
    });
    assert_eq!(dev.peers.len(), 41, "one entry per peer");
    let first = dev.peers.iter().find(|p| p.public_key == *keys[0].public()).expect("the big peer");
    let mut allowed = first.allowed.clone();
    allowed.sort();
    assert_eq!(allowed, big);
    assert_eq!(changes(&dev.peers, &want), [], "the kernel holds what was asked");
}
