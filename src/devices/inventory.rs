//! Device discovery, below any kubelet API (v1beta1 device plugins today, DRA next): which
//! device nodes match a resource's patterns, whether each works, and its NUMA node.

use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::devices::config::{Resource, glob_match};

/// One device node the resource found (it stays known, unhealthy, after it disappears).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub path: PathBuf,
    /// The device's ID (share 1) or ID stem (share > 1): the node's base name.
    pub name: String,
    pub healthy: bool,
    pub numa: Option<i64>,
}

/// The device nodes matching a resource's patterns now (character or block devices).
pub fn scan(res: &Resource) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for p in &res.patterns {
        let Ok(entries) = std::fs::read_dir(&p.dir) else { continue };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if !glob_match(&p.glob, name).unwrap_or(false) {
                continue;
            }
            let path = p.dir.join(name);
            if std::fs::metadata(&path).is_ok_and(|m| m.file_type().is_char_device() || m.file_type().is_block_device())
            {
                out.push(path);
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Healthy: the node exists, is a device node, and opens (read-only, non-blocking). A busy
/// exclusive device (EBUSY) exists and works: healthy.
pub fn check_health(path: &Path) -> bool {
    let Ok(m) = std::fs::metadata(path) else { return false };
    if !(m.file_type().is_char_device() || m.file_type().is_block_device()) {
        return false;
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)
    {
        Ok(_) => true,
        Err(e) => e.raw_os_error() == Some(libc::EBUSY),
    }
}

/// `/sys/dev/{char,block}/M:m/<rel>` of a device node, read and trimmed.
fn sysfs_read(path: &Path, rel: &str) -> Option<String> {
    let m = std::fs::metadata(path).ok()?;
    let kind = if m.file_type().is_block_device() { "block" } else { "char" };
    let rdev = m.rdev();
    let p = format!("/sys/dev/{kind}/{}:{}/{rel}", nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    Some(std::fs::read_to_string(p).ok()?.trim().to_string())
}

/// The NUMA node of a device from sysfs (`/sys/dev/{char,block}/M:m/device/numa_node`).
pub fn numa_of(path: &Path) -> Option<i64> {
    let n: i64 = sysfs_read(path, "device/numa_node")?.parse().ok()?;
    (n >= 0).then_some(n)
}

/// The PCI vendor and device IDs of a device from sysfs (`device/vendor`, `device/device`,
/// e.g. "0x10de"), where it has them.
pub fn pci_ids_of(path: &Path) -> (Option<String>, Option<String>) {
    let id = |rel| sysfs_read(path, rel).filter(|v| v.len() <= 16 && v.starts_with("0x"));
    (id("device/vendor"), id("device/device"))
}

/// The size in bytes of a block device (sysfs `size`, in 512-byte sectors).
pub fn block_size_of(path: &Path) -> Option<u64> {
    let m = std::fs::metadata(path).ok()?;
    if !m.file_type().is_block_device() {
        return None;
    }
    sysfs_read(path, "size")?.parse::<u64>().ok()?.checked_mul(512)
}
