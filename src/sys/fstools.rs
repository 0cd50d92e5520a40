//! Filesystem tools for volumes: probe (`blkid`), make (`mkfs.ext4`, `mkfs.xfs`) and grow
//! (`resize2fs`, `xfs_growfs`). Every tool runs with an argument vector, never a shell;
//! failures carry the tool, its arguments, exit status and stderr.
//!
//! Debian packages: `util-linux` (blkid), `e2fsprogs` (mkfs.ext4, e2fsck, resize2fs),
//! `xfsprogs` (mkfs.xfs, xfs_growfs).

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// A filesystem type no volume can have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid filesystem type {0:?} (want \"ext4\", \"xfs\" or \"\" for raw block)")]
pub struct InvalidFsType(pub String);

/// What a volume holds: a filesystem made on first stage, or raw block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FsType {
    #[serde(rename = "ext4")]
    Ext4,
    #[serde(rename = "xfs")]
    Xfs,
    #[serde(rename = "")]
    Raw,
}

impl FsType {
    pub fn as_str(self) -> &'static str {
        match self {
            FsType::Ext4 => "ext4",
            FsType::Xfs => "xfs",
            FsType::Raw => "",
        }
    }
    pub fn is_raw(self) -> bool {
        self == FsType::Raw
    }
}

impl std::str::FromStr for FsType {
    type Err = InvalidFsType;
    fn from_str(s: &str) -> Result<Self, InvalidFsType> {
        match s {
            "ext4" => Ok(FsType::Ext4),
            "xfs" => Ok(FsType::Xfs),
            "" => Ok(FsType::Raw),
            other => Err(InvalidFsType(other.to_string())),
        }
    }
}

impl std::fmt::Display for FsType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_raw() { "raw block" } else { self.as_str() })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("running {tool}: {source}")]
    Spawn { tool: String, source: std::io::Error },
    #[error("{tool} {args} failed ({status}): {stderr}")]
    Failed { tool: String, args: String, status: String, stderr: String },
    #[error("raw block volumes have no filesystem to {0}")]
    Raw(&'static str),
    #[error(
        "growing the mounted ext4 filesystem on {0} needs CAP_SYS_RESOURCE, which this process lacks \
         (the kernel refuses online ext4 resize without it); grow it unmounted or run with the capability"
    )]
    OnlineResizeNotPermitted(String),
    #[error("inspecting {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

fn run(tool: &str, args: &[&OsStr], ok_codes: &[i32]) -> Result<Output, FsError> {
    let start = Instant::now();
    let out = Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .map_err(|source| FsError::Spawn { tool: tool.to_string(), source })?;
    let code = out.status.code();
    let args_text = || args.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ");
    tracing::debug!(tool, args = %args_text(), ?code, elapsed_ms = start.elapsed().as_millis() as u64, "ran");
    if out.status.success() || code.is_some_and(|c| ok_codes.contains(&c)) {
        return Ok(out);
    }
    let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if stderr.is_empty() {
        stderr = String::from_utf8_lossy(&out.stdout).trim().to_string();
    }
    Err(FsError::Failed { tool: tool.to_string(), args: args_text(), status: out.status.to_string(), stderr })
}

/// The filesystem (or other signature: swap, LVM, LUKS, a partition table…) on `dev`, as
/// `blkid -p` (the device itself, no cache) names its `TYPE`; a bare partition table is
/// `partition-table:dos` or `partition-table:gpt`. `None` only when blkid finds nothing and
/// the regions where signatures lie are all zeros ([`super::probe::first_nonzero`]): data
/// matching no known signature is `unknown data …`, so nothing holding data is ever taken for
/// blank. An ambivalent result (several signatures at once) is blkid's failure, never a guess.
///
/// `image`: the file bound to the loop device `dev`, when it is one; a file holding no data
/// at all (a new volume's sparse image) is blank without spawning blkid or reading anything.
pub fn probe_type(dev: &Path, image: Option<&Path>) -> Result<Option<String>, FsError> {
    if image.is_some_and(|img| super::probe::loop_image_holds_no_data(dev, img)) {
        return Ok(None);
    }
    // Exit 2: nothing found.
    let out = run("blkid", &["-p".as_ref(), "-o".as_ref(), "export".as_ref(), dev.as_os_str()], &[2])?;
    let tags = String::from_utf8_lossy(&out.stdout);
    let tag = |key: &str| tags.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('=')).filter(|v| !v.is_empty());
    if let Some(t) = tag("TYPE") {
        return Ok(Some(t.to_string()));
    }
    if let Some(pt) = tag("PTTYPE") {
        return Ok(Some(format!("partition-table:{pt}")));
    }
    match super::probe::first_nonzero(dev).map_err(|source| FsError::Io { path: dev.display().to_string(), source })? {
        Some(offset) => Ok(Some(format!("unknown data (a non-zero byte at offset {offset}, no known signature)"))),
        None => Ok(None),
    }
}

/// Make a filesystem on `dev`. Forces (`-F` / `-f`): the caller checks [`probe_type`] first
/// and never calls this on a device that has data.
///
/// ext4 on a loop device whose image is all holes (a fresh sparse file: every byte reads as
/// zero) is made with `-E lazy_itable_init=1,lazy_journal_init=1`: the inode tables and the
/// journal are not written out as zeros (≈0.6 MiB written for 1 GiB instead of ≈33 MiB).
/// Skipping the journal's zeroing is safe only where no stale journal blocks can exist,
/// which an all-zero device guarantees; any other device gets the journal zeroed.
pub fn mkfs(dev: &Path, fs: FsType) -> Result<(), FsError> {
    let d = dev.as_os_str();
    match fs {
        FsType::Ext4 if super::probe::loop_image_is_all_holes(dev) => run(
            "mkfs.ext4",
            &["-F".as_ref(), "-q".as_ref(), "-E".as_ref(), "lazy_itable_init=1,lazy_journal_init=1".as_ref(), d],
            &[],
        ),
        FsType::Ext4 => run("mkfs.ext4", &["-F".as_ref(), "-q".as_ref(), d], &[]),
        FsType::Xfs => run("mkfs.xfs", &["-f".as_ref(), "-q".as_ref(), d], &[]),
        FsType::Raw => Err(FsError::Raw("make")),
    }
    .map(drop)
}

/// Grow the filesystem to fill its (already grown) device.
///
/// ext4: `dev_or_mountpoint` is the device. Mounted: `resize2fs <device>` grows it online,
/// which the kernel allows only with CAP_SYS_RESOURCE (checked first, so the caller gets
/// [`FsError::OnlineResizeNotPermitted`] rather than resize2fs' bare "Permission denied").
/// Not mounted: `e2fsck -f -p` (resize2fs requires a freshly checked filesystem), then
/// `resize2fs`.
///
/// xfs: `dev_or_mountpoint` is the mount point; xfs grows only while mounted (`xfs_growfs`).
pub fn grow_fs(dev_or_mountpoint: &Path, fs: FsType) -> Result<(), FsError> {
    let p = dev_or_mountpoint.as_os_str();
    match fs {
        FsType::Ext4 => {
            if !crate::sys::loopdev::is_block_device(dev_or_mountpoint) {
                return Err(FsError::Io {
                    path: dev_or_mountpoint.display().to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "ext4 grows through its block device",
                    ),
                });
            }
            if is_mounted(dev_or_mountpoint)? {
                if !has_cap_sys_resource() {
                    return Err(FsError::OnlineResizeNotPermitted(dev_or_mountpoint.display().to_string()));
                }
            } else {
                // 0: clean, 1: errors corrected. Anything else: not safe to resize.
                run("e2fsck", &["-f".as_ref(), "-p".as_ref(), p], &[1])?;
            }
            run("resize2fs", &[p], &[])
        }
        FsType::Xfs => run("xfs_growfs", &[p], &[]),
        FsType::Raw => Err(FsError::Raw("grow")),
    }
    .map(drop)
}

/// The size in bytes the filesystem on `dev` spans, from its superblock (ext4: block count
/// × block size; xfs: data blocks × block size). Compared with the device size, it tells
/// whether a grown device still needs its filesystem grown. `None` when `dev` does not hold
/// a filesystem of that type.
pub fn fs_size_bytes(dev: &Path, fs: FsType) -> Result<Option<u64>, FsError> {
    use std::os::unix::fs::FileExt;
    let io = |source| FsError::Io { path: dev.display().to_string(), source };
    let f = std::fs::File::open(dev).map_err(io)?;
    match fs {
        FsType::Ext4 => {
            let mut sb = [0u8; 1024];
            f.read_exact_at(&mut sb, 1024).map_err(io)?;
            let u32_at = |o: usize| u32::from_le_bytes(sb[o..o + 4].try_into().unwrap());
            if u16::from_le_bytes([sb[0x38], sb[0x39]]) != 0xEF53 {
                return Ok(None);
            }
            let log = u32_at(0x18);
            if log > 6 {
                return Ok(None);
            }
            let mut blocks = u32_at(0x04) as u64;
            if u32_at(0x60) & 0x80 != 0 {
                blocks |= (u32_at(0x150) as u64) << 32;
            }
            Ok(blocks.checked_mul(1024u64 << log))
        }
        FsType::Xfs => {
            let mut sb = [0u8; 16];
            f.read_exact_at(&mut sb, 0).map_err(io)?;
            if &sb[0..4] != b"XFSB" {
                return Ok(None);
            }
            let bsize = u32::from_be_bytes(sb[4..8].try_into().unwrap()) as u64;
            let dblocks = u64::from_be_bytes(sb[8..16].try_into().unwrap());
            Ok(dblocks.checked_mul(bsize))
        }
        FsType::Raw => Err(FsError::Raw("measure")),
    }
}

/// Whether the block device `dev` is mounted anywhere in this mount namespace (by its
/// major:minor in `/proc/self/mountinfo`, so any name for the device counts).
pub fn is_mounted(dev: &Path) -> Result<bool, FsError> {
    let (major, minor) =
        super::mount::dev_numbers(dev).map_err(|source| FsError::Io { path: dev.display().to_string(), source })?;
    let table =
        super::mount::mount_table().map_err(|source| FsError::Io { path: "/proc/self/mountinfo".into(), source })?;
    Ok(!super::mount::mount_points_of(&table, major, minor).is_empty())
}

/// Whether this process has CAP_SYS_RESOURCE in its effective set (online ext4 resize needs
/// it in the initial user namespace; a container's root often lacks it).
pub fn has_cap_sys_resource() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_carry_tool_args_and_stderr() {
        // `ls` on a missing path: a real tool, a real non-zero exit, no root needed.
        let e = run("ls", &["/nonexistent/nodeplane-volume-test".as_ref()], &[]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("ls /nonexistent/nodeplane-volume-test failed"), "{msg}");
        assert!(msg.contains("No such file"), "{msg}");
        let e = run("nodeplane-no-such-tool", &[], &[]).unwrap_err();
        assert!(matches!(e, FsError::Spawn { .. }), "{e}");
        // Accepted non-zero codes are not failures.
        run("ls", &["/nonexistent/nodeplane-volume-test".as_ref()], &[2]).unwrap();
    }

    #[test]
    fn raw_has_no_filesystem() {
        assert!(matches!(mkfs(Path::new("/dev/null"), FsType::Raw), Err(FsError::Raw(_))));
        assert!(matches!(grow_fs(Path::new("/dev/null"), FsType::Raw), Err(FsError::Raw(_))));
    }
}
