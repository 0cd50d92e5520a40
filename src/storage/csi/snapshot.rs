//! Snapshots and clones as the node takes them: the volume held (no stage, unstage, expand
//! or publish of it meanwhile), its filesystem frozen while its image is copied when it is
//! staged, thawed on every path out (and at start-up, after a crash that left it frozen).
//! The copies themselves are the store's (`storage::store::snapshots`).

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::storage::store::{Snapshot, Source, Volume, VolumeError};
use crate::sys::imagecopy;

use super::NodeService;

/// What a snapshot or clone attempt came to.
pub enum Taken<T> {
    Done(T),
    /// Another operation holds the volume: try again later.
    Busy,
}

impl NodeService {
    /// The staging mount point of volume `id` when its filesystem is mounted there right
    /// now (its loop device is what the mount point's filesystem lives on).
    fn mounted_staging(&self, id: &str) -> Result<Option<PathBuf>, VolumeError> {
        let Some(staging) = self.staged_filesystem_path(id) else { return Ok(None) };
        let Some(dev) = self.store.attached_device(id)? else { return Ok(None) };
        let Ok((maj, min)) = self.kernel().dev_numbers(&dev) else { return Ok(None) };
        match std::fs::metadata(&staging) {
            Ok(m) if nix::sys::stat::major(m.dev()) as u32 == maj && nix::sys::stat::minor(m.dev()) as u32 == min => {
                Ok(Some(staging))
            }
            _ => Ok(None),
        }
    }

    /// Run `copy` with volume `id` held and, when its filesystem is mounted, frozen.
    fn with_consistent<T>(&self, id: &str, copy: impl FnOnce() -> Result<T, VolumeError>) -> Result<Taken<T>, VolumeError> {
        let Ok(_g) = self.guard(id) else { return Ok(Taken::Busy) };
        let _frozen = match self.mounted_staging(id)? {
            Some(p) => {
                let f = imagecopy::freeze(&p).map_err(|e| VolumeError::Io { op: "freezing", path: p.clone(), source: e })?;
                tracing::info!(volume = id, mount = %p.display(), "filesystem frozen for a copy");
                Some(f)
            }
            None => None,
        };
        crate::util::crash_point("copy-while-frozen");
        copy().map(Taken::Done)
    }

    /// Take snapshot `id` of volume `source` (see [`crate::storage::store::VolumeStore::create_snapshot`]).
    pub fn take_snapshot(&self, id: &str, source: &str, name: &str) -> Result<Taken<Snapshot>, VolumeError> {
        if let Some(s) = self.store.get_snapshot(id)? {
            // Already complete: never touch (freeze) the source again.
            return self.store.create_snapshot(id, &s.source_volume, name).map(Taken::Done);
        }
        self.with_consistent(source, || self.store.create_snapshot(id, source, name))
    }

    /// Make volume `id` from `source`, grown to `size` (a clone freezes a mounted source).
    pub fn create_volume_from(&self, id: &str, size: u64, name: &str, source: &Source) -> Result<Taken<Volume>, VolumeError> {
        match source {
            Source::Snapshot(_) => self.store.create_from(id, size, name, source).map(Taken::Done),
            Source::Volume(v) => {
                if self.store.get(id)?.is_some() {
                    return self.store.create_from(id, size, name, source).map(Taken::Done);
                }
                self.with_consistent(v, || self.store.create_from(id, size, name, source))
            }
        }
    }

    /// Thaw every staged filesystem that a crash left frozen (a snapshot's copy was in
    /// progress). Returns how many were.
    pub fn thaw_staged(&self) -> usize {
        let mut n = 0;
        for v in self.store.list() {
            let Ok(Some(p)) = self.mounted_staging(&v.id) else { continue };
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
