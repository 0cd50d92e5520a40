//! Snapshots and clones as the node takes them: the volume held (no stage, unstage, expand
//! or publish of it meanwhile), its filesystem frozen while its image is copied when it is
//! staged, thawed on every path out (and at start-up, after a crash that left it frozen).
//! The copies themselves are the store's (`storage::store::snapshots`).

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::storage::store::{Backend, FROZEN_COPY_LIMIT, Snapshot, Source, Volume, VolumeError};
use crate::sys::crypt;
use crate::sys::imagecopy::{self, CopyLimits};

use super::NodeService;

/// What a snapshot or clone attempt came to.
pub enum Taken<T> {
    Done(T),
    /// Another operation holds the volume: try again later.
    Busy,
}

impl NodeService {
    /// The staging mount point of volume `id` when its filesystem is mounted there right
    /// now, and whether that filesystem lives on the volume's dm-crypt mapping (else on its
    /// loop device or LV). Errors are errors: a copy is never taken unfrozen because a check
    /// could not be made.
    fn mounted_staging(&self, id: &str) -> Result<Option<(PathBuf, bool)>, VolumeError> {
        let Some(staging) = self.staged_filesystem_path(id) else { return Ok(None) };
        let mapping = self
            .kernel()
            .crypt_mapping(&crypt::mapping_name(id))
            .map_err(|e| VolumeError::Backend { id: id.to_string(), reason: e.to_string() })?;
        let (maj, min) = match &mapping {
            Some(m) => m.num,
            None => {
                let Some(dev) = self.store.attached_device(id)? else { return Ok(None) };
                self.kernel().dev_numbers(&dev).map_err(|e| VolumeError::Io {
                    op: "inspecting",
                    path: dev.clone(),
                    source: e,
                })?
            }
        };
        match std::fs::metadata(&staging) {
            Ok(m) if nix::sys::stat::major(m.dev()) as u32 == maj && nix::sys::stat::minor(m.dev()) as u32 == min => {
                Ok(Some((staging, mapping.is_some())))
            }
            Ok(_) => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(VolumeError::Io { op: "inspecting", path: staging, source: e }),
        }
    }

    /// How to copy volume `id` consistently, decided right before the copy: its filesystem
    /// frozen when it is mounted (and the copy bounded in time); a reflink only when it is
    /// attached otherwise (a raw block volume a pod may be writing); anything when idle.
    ///
    /// A filesystem right on a thin LV is not frozen here: the thin snapshot suspends the
    /// LV, which freezes it, and a freeze of ours first can make that suspend fail (older
    /// kernels refuse a second freeze). One on a dm-crypt mapping above the LV is frozen
    /// here, since the suspend of the LV below does not reach it.
    fn quiesce(&self, id: &str) -> Result<(Option<imagecopy::Frozen>, CopyLimits), VolumeError> {
        if let Some((p, on_mapping)) = self.mounted_staging(id)? {
            if !on_mapping && self.store.get(id)?.is_some_and(|v| v.backend == Backend::Lvm) {
                return Ok((None, CopyLimits::default()));
            }
            let f =
                imagecopy::freeze(&p).map_err(|e| VolumeError::Io { op: "freezing", path: p.clone(), source: e })?;
            tracing::info!(volume = id, mount = %p.display(), "filesystem frozen for a copy");
            crate::util::crash_point("copy-while-frozen");
            let deadline = Some(std::time::Instant::now() + FROZEN_COPY_LIMIT);
            return Ok((Some(f), CopyLimits { reflink_only: false, deadline }));
        }
        let attached = !self.store.bindings(id)?.is_empty();
        Ok((None, CopyLimits { reflink_only: attached, deadline: None }))
    }

    /// Take snapshot `id` of volume `source` (see [`crate::storage::store::VolumeStore::create_snapshot`]),
    /// holding the volume (no stage, unstage, expand or publish of it meanwhile).
    pub fn take_snapshot(&self, id: &str, source: &str, name: &str) -> Result<Taken<Snapshot>, VolumeError> {
        if self.store.get_snapshot(id)?.is_some() {
            // Already complete: never touch (freeze) the source again.
            return self.store.create_snapshot(id, source, name).map(Taken::Done);
        }
        let Ok(_g) = self.guard(source) else { return Ok(Taken::Busy) };
        self.store.create_snapshot_with(id, source, name, || self.quiesce(source)).map(Taken::Done)
    }

    /// Make volume `id` from `source`, grown to `size` (a clone is made like a snapshot).
    pub fn create_volume_from(
        &self,
        id: &str,
        size: u64,
        name: &str,
        source: &Source,
    ) -> Result<Taken<Volume>, VolumeError> {
        match source {
            Source::Snapshot(_) => self.store.create_from(id, size, name, source).map(Taken::Done),
            Source::Volume(v) => {
                if self.store.get(id)?.is_some() {
                    return self.store.create_from(id, size, name, source).map(Taken::Done);
                }
                let Ok(_g) = self.guard(v) else { return Ok(Taken::Busy) };
                self.store.create_from_with(id, size, name, source, || self.quiesce(v)).map(Taken::Done)
            }
        }
    }

    /// Thaw every staged filesystem that a crash left frozen (a snapshot's copy was in
    /// progress). Returns how many were.
    pub fn thaw_staged(&self) -> usize {
        let mut n = 0;
        for v in self.store.list() {
            let Ok(Some((p, _))) = self.mounted_staging(&v.id) else { continue };
            match imagecopy::thaw(&p) {
                Ok(true) => {
                    tracing::warn!(volume = %v.id, mount = %p.display(), "thawed a filesystem a crash left frozen");
                    n += 1;
                }
                Ok(false) => {}
                Err(e) => tracing::error!(volume = %v.id, mount = %p.display(), error = %e, "could not thaw"),
            }
        }
        n
    }
}
