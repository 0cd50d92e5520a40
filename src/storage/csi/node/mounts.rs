//! The kernel's side of one volume: its devices (loop devices, and the dm-crypt mapping of
//! an encrypted one), whether a mount is one of them, the mount on a path, and unmounting
//! the volume's mounts (never someone else's).

use std::path::{Path, PathBuf};

use super::records::StageRecord;
use super::{NodeService, Result, errno_internal, internal, io_internal};
use crate::sys::mount::{self, MountEntry};

/// A device of a volume: a loop device bound to its image, or its open dm-crypt mapping.
pub(super) struct LoopDev {
    pub(super) path: PathBuf,
    /// major, minor
    pub(super) num: (u32, u32),
    pub(super) ro: bool,
    /// The volume's open dm-crypt mapping (not a loop device or LV).
    pub(super) mapping: bool,
}

impl NodeService {
    pub(super) fn table(&self) -> Result<Vec<MountEntry>> {
        self.kernel.mount_table().map_err(io_internal("reading /proc/self/mountinfo".into()))
    }

    /// Every device of volume `id`: its open dm-crypt mapping first (the device an encrypted
    /// volume is used through), then the loop devices bound to it (read-write first).
    pub(super) fn volume_devices(&self, id: &str) -> Result<Vec<LoopDev>> {
        let mut out = Vec::new();
        if let Some(m) = self.mapping_of(id)? {
            out.push(LoopDev { path: m.path, num: m.num, ro: false, mapping: true });
        }
        for b in self.store.bindings(id)? {
            if let Ok(num) = self.kernel.dev_numbers(&b.device) {
                out.push(LoopDev { path: b.device, num, ro: b.read_only, mapping: false });
            }
        }
        out.sort_by_key(|d| d.ro); // stable: the mapping stays first
        Ok(out)
    }

    /// Whether `m` shows one of `devices` mounted (a filesystem on the device, or the device
    /// node bind-mounted from devtmpfs for block access).
    pub(super) fn is_volume_mount(&self, m: &MountEntry, devices: &[LoopDev]) -> bool {
        if devices.iter().any(|d| (m.major, m.minor) == d.num) {
            return true;
        }
        // A block publication is the device node bind-mounted onto a file: mountinfo shows
        // the filesystem holding the node (devtmpfs, or a tmpfs /dev), so compare the node
        // itself.
        if matches!(m.fs_type.as_str(), "devtmpfs" | "tmpfs")
            && let Some(num) = self.kernel.block_node(&m.mount_point)
        {
            return devices.iter().any(|d| d.num == num);
        }
        false
    }

    /// The topmost mount on `path`, from `statx` of the path alone (the cost does not grow
    /// with the node's mounts).
    pub(super) fn top_at(&self, path: &Path) -> Result<Option<MountEntry>> {
        self.kernel.top_mount(path).map_err(io_internal(format!("inspecting the mount at {}", path.display())))
    }

    /// Whether one of `devices` is mounted at `path`: the topmost mount, or — read from the
    /// mount table only when another mount sits on top — one beneath it.
    pub(super) fn ours_at(&self, path: &Path, devices: &[LoopDev]) -> Result<bool> {
        match self.top_at(path)? {
            None => Ok(false),
            Some(m) if self.is_volume_mount(&m, devices) => Ok(true),
            Some(_) => Ok(mount::mounts_at(&self.table()?, path).iter().any(|m| self.is_volume_mount(m, devices))),
        }
    }

    /// Unmount this volume's mounts stacked on `path`, topmost first, stopping at the first
    /// mount that is not the volume's (someone else's mount is never taken away).
    pub(super) fn unmount_ours(&self, id: &str, path: &Path) -> Result<usize> {
        self.unmount_of(id, path, &self.volume_devices(id)?)
    }

    /// [`Self::unmount_ours`] with the volume's devices as the caller found them (under the
    /// lock it holds), so a request looks its loop devices up once.
    pub(super) fn unmount_of(&self, id: &str, path: &Path, devices: &[LoopDev]) -> Result<usize> {
        let mut n = 0;
        loop {
            match self.top_at(path)? {
                Some(m) if self.is_volume_mount(&m, devices) => {
                    self.kernel.unmount(path).map_err(errno_internal(format!("unmounting {}", path.display())))?;
                    n += 1;
                }
                Some(m) => {
                    tracing::warn!(volume = id, path = %path.display(), fs = %m.fs_type, source = %m.source, "leaving a mount that is not this volume's");
                    return Ok(n);
                }
                None => return Ok(n),
            }
            if n > 64 {
                return Err(internal(format!("{} still mounted after 64 unmounts", path.display())));
            }
        }
    }

    /// Mounts of the volume's devices that are neither at `staging` nor at a recorded
    /// staging path (read from the mount table).
    pub(super) fn unrecorded_mounts(
        &self,
        staging: &Path,
        devices: &[LoopDev],
        rec: Option<&StageRecord>,
    ) -> Result<Vec<String>> {
        let table = if devices.is_empty() { Vec::new() } else { self.table()? };
        Ok(table
            .iter()
            .filter(|m| m.mount_point != staging && self.is_volume_mount(m, devices))
            .filter(|m| rec.is_none_or(|r| r.staging_path != m.mount_point))
            .map(|m| m.mount_point.display().to_string())
            .collect())
    }
}
