//! Capability drop at start: the agent keeps the capabilities in [`KEPT`] and nothing else.
//!
//! [`drop_to_kept`] runs once, after the configuration is loaded and before the agent does
//! any work or starts a thread (capability sets belong to a thread; threads started later
//! inherit them). It removes every other capability from
//!
//! - the bounding set (`PR_CAPBSET_DROP`), so no program the agent runs can get it back,
//! - the permitted and effective sets (`capset`), so the agent itself cannot use it,
//! - the inheritable set (emptied) and the ambient set (cleared),
//!
//! and sets `no_new_privs`, so a set-user-id or file-capability program it runs gains
//! nothing either. A tool the agent runs as root (`nft`, `mkfs.*`, `e2fsck`, `resize2fs`,
//! `xfs_growfs`, `blkid`, a chained plugin's VERSION probe) starts with exactly [`KEPT`].
//!
//! Not root, or already restricted (a container without some of [`KEPT`], or without
//! CAP_SETPCAP): what is not there cannot be dropped and is not an error. A kept capability
//! the process does not have is logged as a warning (the operations that need it will fail
//! with EPERM). Without CAP_SETPCAP the bounding set cannot shrink; `no_new_privs` then still
//! keeps every program the agent runs within the agent's own permitted set. Any other
//! failure of these system calls stops the agent: it never runs with more than it means to.

use std::io;

/// One capability: its number (`linux/capability.h`), name, and why the agent keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cap {
    pub number: u32,
    pub name: &'static str,
    pub reason: &'static str,
}

const fn cap(number: u32, name: &'static str, reason: &'static str) -> Cap {
    Cap { number, name, reason }
}

/// Everything the agent and the programs it runs need; every other capability is dropped.
pub const KEPT: &[Cap] = &[
    cap(0, "CAP_CHOWN", "volume_mount_group (fsGroup): chgrp of the volume root to the pod's group"),
    cap(
        2,
        "CAP_DAC_READ_SEARCH",
        "xfs_growfs opens the mount point, whose root a pod may have made unreadable to root",
    ),
    cap(3, "CAP_FOWNER", "volume_mount_group: chmod of a volume root that a pod has chowned to another user"),
    cap(4, "CAP_FSETID", "volume_mount_group: the set-gid bit on a root whose group is not the agent's"),
    cap(12, "CAP_NET_ADMIN", "links, addresses, routes, neighbours, VXLAN, sysctls and nftables (netlink, nft)"),
    cap(21, "CAP_SYS_ADMIN", "setns into pod namespaces; mount/umount for CSI; loop device setup; xfs_growfs"),
    cap(24, "CAP_SYS_RESOURCE", "online ext4 growth (resize2fs on a mounted volume: EXT4_IOC_RESIZE_FS)"),
    cap(27, "CAP_MKNOD", "creating /dev/loopN when the node's /dev lacks the device node (containers)"),
];

/// The kept set as a bit mask (the form `/proc/PID/status` shows).
pub fn kept_mask() -> u64 {
    KEPT.iter().fold(0, |m, c| m | (1u64 << c.number))
}

/// The kept capabilities' names, comma-separated (for logs).
pub fn kept_names() -> String {
    KEPT.iter().map(|c| c.name).collect::<Vec<_>>().join(",")
}

/// What [`drop_to_kept`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Capabilities removed from the bounding set.
    pub bounding: Vec<u32>,
    /// Capabilities that were in the bounding set and could not be removed (no CAP_SETPCAP).
    pub bounding_kept_without_setpcap: Vec<u32>,
    /// Kept capabilities the process did not have to begin with.
    pub missing: Vec<&'static str>,
    /// The permitted (= effective) set after the drop.
    pub permitted: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    #[error("dropping capabilities must happen before the agent starts threads ({0} running)")]
    Threads(usize),
    #[error("{what}: {source}")]
    Syscall { what: String, source: io::Error },
}

fn sys(what: impl Into<String>) -> impl FnOnce(io::Error) -> CapsError {
    let what = what.into();
    move |source| CapsError::Syscall { what, source }
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn capget() -> io::Result<[CapData; 2]> {
    let mut hdr = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: a version-3 header and the two data structs that version expects.
    if unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut CapHeader, data.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(data)
}

fn capset(effective: u64, permitted: u64, inheritable: u64) -> io::Result<()> {
    let mut hdr = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let half = |m: u64, i: usize| (m >> (32 * i)) as u32;
    let data: [CapData; 2] = std::array::from_fn(|i| CapData {
        effective: half(effective, i),
        permitted: half(permitted, i),
        inheritable: half(inheritable, i),
    });
    // SAFETY: a version-3 header and two data structs; pid 0 is the calling thread.
    if unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn prctl(option: libc::c_int, arg: libc::c_ulong, arg3: libc::c_ulong) -> io::Result<libc::c_int> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe { libc::prctl(option, arg, arg3, 0 as libc::c_ulong, 0 as libc::c_ulong) };
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// The highest capability number this kernel knows.
fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(40)
}

fn thread_count() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(1)
}

/// Drop every capability outside [`KEPT`] (see the module documentation).
pub fn drop_to_kept() -> Result<Dropped, CapsError> {
    let threads = thread_count();
    if threads != 1 {
        return Err(CapsError::Threads(threads));
    }
    let keep = kept_mask();
    let mut out = Dropped::default();
    // Bounding set first: PR_CAPBSET_DROP needs CAP_SETPCAP, which goes with the capset below.
    for n in 0..=last_cap().min(63) {
        if keep & (1 << n) != 0 {
            continue;
        }
        match prctl(libc::PR_CAPBSET_READ, n as libc::c_ulong, 0) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue, // unknown to this kernel
            Err(e) => return Err(sys(format!("PR_CAPBSET_READ {n}"))(e)),
        }
        match prctl(libc::PR_CAPBSET_DROP, n as libc::c_ulong, 0) {
            Ok(_) => out.bounding.push(n),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => out.bounding_kept_without_setpcap.push(n),
            Err(e) => return Err(sys(format!("PR_CAPBSET_DROP {n}"))(e)),
        }
    }
    let cur = capget().map_err(sys("capget"))?;
    let permitted = u64::from(cur[0].permitted) | (u64::from(cur[1].permitted) << 32);
    let new = permitted & keep;
    out.missing = KEPT.iter().filter(|c| permitted & (1 << c.number) == 0).map(|c| c.name).collect();
    capset(new, new, 0).map_err(sys("capset"))?;
    out.permitted = new;
    match prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {} // a kernel without ambient capabilities
        Err(e) => return Err(sys("PR_CAP_AMBIENT_CLEAR_ALL")(e)),
    }
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0).map_err(sys("PR_SET_NO_NEW_PRIVS"))?;
    Ok(out)
}

/// [`drop_to_kept`], logged: the kept set at info, anything the process could not do at warn.
pub fn drop_and_log() -> Result<(), CapsError> {
    let d = drop_to_kept()?;
    tracing::info!(
        kept = %kept_names(),
        permitted = format!("{:016x}", d.permitted),
        dropped_from_bounding_set = d.bounding.len(),
        "capabilities dropped to the kept set"
    );
    if !d.missing.is_empty() {
        tracing::warn!(missing = %d.missing.join(","), "the agent lacks kept capabilities: operations that need them will fail");
    }
    if !d.bounding_kept_without_setpcap.is_empty() {
        tracing::warn!(
            capabilities = ?d.bounding_kept_without_setpcap,
            "no CAP_SETPCAP: these stay in the bounding set; no_new_privs still keeps programs the agent runs within its own set"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_set_is_small_named_and_explained() {
        let mut numbers: Vec<u32> = KEPT.iter().map(|c| c.number).collect();
        numbers.sort();
        numbers.dedup();
        assert_eq!(numbers.len(), KEPT.len(), "a capability listed twice");
        for c in KEPT {
            assert!(c.name.starts_with("CAP_") && !c.reason.is_empty(), "{c:?}");
        }
        // CAP_SETPCAP (8), CAP_NET_RAW (13), CAP_SYS_MODULE (16), CAP_DAC_OVERRIDE (1) are dropped.
        for n in [1, 8, 13, 16] {
            assert_eq!(kept_mask() & (1 << n), 0, "capability {n} must not be kept");
        }
        assert_eq!(kept_mask(), 0x0920_101d);
    }
}
