//! What the running kernel offers of the features the agent depends on, found at start-up by
//! trying each one (a call whose answer tells), not by comparing version numbers:
//! distributions backport features, and a kernel may be built without one. The table in
//! docs/install.md ("Kernel requirements") lists them with the mainline release that
//! brought each and what the agent does without it.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// A kernel feature the agent uses where the kernel may lack it (5.10 is the stated minimum;
/// each of these is newer than some kernel still run, or needs a module nothing loads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// `masquerade` in a nat chain of an `inet` table (pod egress).
    NftInetNat,
    /// `getsockopt(SO_NETNS_COOKIE)` (a pod namespace's identity in its lease).
    NetnsCookie,
    /// `openat2(2)` with `RESOLVE_*` (CSI stage and publish on a checked path).
    Openat2,
    /// The `LOOP_CONFIGURE` ioctl (a volume's loop device bound in one step).
    LoopConfigure,
    /// `statx(STATX_MNT_ID)` (is a path a mount point).
    StatxMountId,
    /// `br_netfilter`'s per-namespace `net.bridge.bridge-nf-call-*` sysctls (NetworkPolicy
    /// between pods of one node).
    BridgeNetfilter,
    /// The `wireguard` generic netlink family (encryption between nodes, when the controller
    /// turns it on).
    Wireguard,
}

impl Feature {
    /// Its name in logs and status.
    pub fn name(self) -> &'static str {
        match self {
            Feature::NftInetNat => "nft-inet-nat",
            Feature::NetnsCookie => "so-netns-cookie",
            Feature::Openat2 => "openat2",
            Feature::LoopConfigure => "loop-configure",
            Feature::StatxMountId => "statx-mnt-id",
            Feature::BridgeNetfilter => "br-netfilter",
            Feature::Wireguard => "wireguard",
        }
    }

    /// What the agent does without it.
    pub fn without(self) -> &'static str {
        match self {
            Feature::NftInetNat => {
                "pod egress cannot be masqueraded: the node's network is not set up, ADD cannot succeed"
            }
            Feature::NetnsCookie => "leases carry cookie 0: a pod namespace is told apart by its nsfs inode alone",
            Feature::Openat2 => "CSI NodeStage and NodePublish fail (no fallback)",
            Feature::LoopConfigure => "loop devices are bound in two steps (LOOP_SET_FD, LOOP_SET_STATUS64)",
            Feature::StatxMountId => "mount points are found in /proc/self/mountinfo",
            Feature::BridgeNetfilter => {
                "traffic between pods of this node bypasses NetworkPolicy (load it: modprobe br_netfilter)"
            }
            Feature::Wireguard => {
                "no encryption between nodes: with encryption on, pod traffic to other nodes goes in clear; strict drops it"
            }
        }
    }

    /// Whether the part that uses it cannot work at all without it (then it fails readiness).
    pub fn required(self) -> bool {
        matches!(self, Feature::NftInetNat | Feature::Openat2 | Feature::BridgeNetfilter)
    }
}

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    Available,
    /// The kernel said no; how it said it.
    Missing(String),
    /// The probe could not tell (it failed for another reason); what happened.
    Unknown(String),
}

/// One probed feature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub feature: Feature,
    pub availability: Availability,
}

/// The kernel's release and the probed features.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelReport {
    pub release: String,
    pub checks: Vec<Check>,
}

/// Probe `features` in the calling thread's namespaces (the agent's: its network namespace
/// is the node's). Costs a few system calls each, and one `nft --check` run for
/// [`Feature::NftInetNat`]; commits nothing.
pub fn probe(features: &[Feature]) -> KernelReport {
    // uname(2)'s release, as the kernel also gives it here.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|e| format!("unknown (/proc/sys/kernel/osrelease: {e})"), |r| r.trim().to_string());
    let checks = features.iter().map(|&feature| Check { feature, availability: probe_one(feature) }).collect();
    KernelReport { release, checks }
}

fn probe_one(f: Feature) -> Availability {
    match f {
        Feature::NftInetNat => nft_inet_nat(),
        Feature::NetnsCookie => netns_cookie(),
        Feature::Openat2 => openat2(),
        Feature::LoopConfigure => loop_configure(),
        Feature::StatxMountId => statx_mount_id(),
        Feature::BridgeNetfilter => bridge_netfilter(Path::new("/proc/sys/net/bridge")),
        Feature::Wireguard => wireguard(),
    }
}

/// Resolve the `wireguard` generic netlink family. The kernel loads the module for the
/// request when it can (its `net-pf-16-proto-16-family-wireguard` alias); ENOENT: none.
fn wireguard() -> Availability {
    match crate::sys::wireguard::Wg::open() {
        Ok(_) => Availability::Available,
        Err(e) if e.errno() == Some(libc::ENOENT) => {
            Availability::Missing("no \"wireguard\" generic netlink family (module absent)".into())
        }
        Err(e) => Availability::Unknown(e.to_string()),
    }
}

/// Name of an errno for messages (`ENOSYS`, …).
fn errno_name(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(n) => format!("{:?}", nix::errno::Errno::from_raw(n)),
        None => e.to_string(),
    }
}

/// A ruleset with an `inet` nat chain that masquerades, checked by the kernel (`nft --check`
/// sends the batch and has the kernel validate it, loading the modules it needs, then
/// aborts it).
fn nft_inet_nat() -> Availability {
    use std::io::Write;
    use std::process::{Command, Stdio};
    const RULES: &str = "table inet nodeplane-probe {\n  chain postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n    masquerade\n  }\n}\n";
    let run = || -> io::Result<std::process::Output> {
        let mut child = Command::new("nft")
            .args(["--check", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        child.stdin.take().expect("piped").write_all(RULES.as_bytes())?;
        child.wait_with_output()
    };
    match run() {
        Ok(out) if out.status.success() => Availability::Available,
        Ok(out) => Availability::Missing(format!(
            "nft --check of an inet nat chain with masquerade: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Availability::Unknown(format!("running nft: {e}")),
    }
}

fn netns_cookie() -> Availability {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    let sock = match socket(AddressFamily::Unix, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None) {
        Ok(s) => s,
        Err(e) => return Availability::Unknown(format!("socket: {}", io::Error::from(e))),
    };
    match super::netlink::netns_cookie_of(sock.as_raw_fd()) {
        Ok(_) => Availability::Available,
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
            Availability::Missing(format!("getsockopt(SO_NETNS_COOKIE): {}", errno_name(&e)))
        }
        Err(e) => Availability::Unknown(format!("getsockopt(SO_NETNS_COOKIE): {e}")),
    }
}

/// `openat2` of `/` beneath itself ([`super::mount::Beneath`]): ENOSYS from a kernel without
/// it (std's `Unsupported`).
fn openat2() -> Availability {
    match super::mount::Beneath::open(Path::new("/"), Path::new("/")) {
        Ok(_) => Availability::Available,
        Err(e) if e.kind() == io::ErrorKind::Unsupported => Availability::Missing("openat2: ENOSYS".into()),
        Err(e) => Availability::Unknown(e.to_string()),
    }
}

fn loop_configure() -> Availability {
    match super::loopdev::configure_supported() {
        Ok(true) => Availability::Available,
        Ok(false) => Availability::Missing("ioctl(LOOP_CONFIGURE) is not known to the loop driver".into()),
        Err(e) => Availability::Unknown(format!("probing LOOP_CONFIGURE: {e}")),
    }
}

/// [`super::mount::top_mount`] of `/`: statx with `STATX_MNT_ID` and the mount-root attribute
/// (both 5.8).
fn statx_mount_id() -> Availability {
    match super::mount::top_mount(Path::new("/")) {
        Ok(_) => Availability::Available,
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => Availability::Missing(format!("statx: {}", errno_name(&e))),
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {
            Availability::Missing("statx does not return STATX_MNT_ID".into())
        }
        Err(e) => Availability::Unknown(format!("statx /: {e}")),
    }
}

/// br_netfilter makes `/proc/sys/net/bridge` (per network namespace since 5.3); nothing
/// loads the module on demand, and the agent's image has no modprobe.
pub fn bridge_netfilter(dir: &Path) -> Availability {
    match std::fs::metadata(dir.join("bridge-nf-call-iptables")) {
        Ok(_) => Availability::Available,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Availability::Missing(format!(
            "no {} in the node's network namespace: the br_netfilter module is not loaded",
            dir.display()
        )),
        Err(e) => Availability::Unknown(format!("{}: {e}", dir.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bridge_netfilter_is_told_by_its_sysctl_directory() {
        let dir = std::env::temp_dir().join(format!("np-brnf-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        match bridge_netfilter(&dir) {
            Availability::Missing(m) => assert!(m.contains("br_netfilter module is not loaded"), "{m}"),
            other => panic!("{other:?}"),
        }
        std::fs::write(dir.join("bridge-nf-call-iptables"), "0").unwrap();
        assert_eq!(bridge_netfilter(&dir), Availability::Available);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The syscall probes agree with what this kernel is known to have (the host lane runs a
    /// kernel newer than 5.14; the VM lane's root tests check 5.10 against the table).
    #[test]
    fn syscall_probes_answer_on_this_kernel() {
        for f in [Feature::NetnsCookie, Feature::Openat2, Feature::StatxMountId] {
            let a = probe_one(f);
            assert!(!matches!(a, Availability::Unknown(_)), "{f:?}: {a:?}");
        }
    }
}
