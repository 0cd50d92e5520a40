//! Snapshots in the store, and volumes made from a snapshot or another volume (clones).
//!
//! ```text
//! <dir>/snapshots/<id>.img         the snapshot's bytes (a reflink or sparse copy of the volume image)
//! <dir>/snapshots/<id>.json        its metadata, written only once the copy is complete and synced
//! <dir>/snapshots/.<id>.img.tmp    a copy in progress
//! <dir>/snapshots/.<id>.img.del    a delete in progress
//! ```
//!
//! The order makes a snapshot either complete or absent after any crash: the copy goes into
//! the temporary file and is fsync'd, then the metadata is written (atomically, fsync'd),
//! then the image renamed into place. `open` removes a temporary without metadata (a copy
//! that did not finish) and renames one with metadata (a complete copy whose rename was
//! lost). A volume made from a source follows the same order in the volume directory
//! (copy, sync, metadata, rename), which `open`'s rule for interrupted creates already
//! covers. Snapshots count against the store's capacity at the size of their source.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{
    Backend, Entry, FsType, META_VERSION, Result, Volume, VolumeError, VolumeStore, classify, io_err, meta_version,
    remove_if_exists, round_size, sync_dir, validate_id, write_meta_unsynced_dir,
};
use crate::sys::imagecopy::{self, CopyLimits, CopyStats};

/// One complete snapshot, as its metadata records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    #[serde(default = "meta_version")]
    pub version: u32,
    pub id: String,
    /// The volume it was taken of (which may be gone since).
    pub source_volume: String,
    /// The source volume's size when it was taken.
    pub size_bytes: u64,
    pub fs_type: FsType,
    pub created_at: u64,
    /// The CSI snapshot name ("" for one taken on the node directly).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// "reflink", "sparse-copy", or "thin-snapshot" (the `lvm` backend).
    pub method: String,
    pub bytes_copied: u64,
    /// The source volume's backend, which the snapshot shares.
    #[serde(default, skip_serializing_if = "Backend::is_file")]
    pub backend: Backend,
    /// As [`super::Volume::controller_store`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub controller_store: String,
    /// `<dir>/snapshots/<id>.img`, or the thin snapshot's device node (not stored).
    #[serde(skip)]
    pub path: PathBuf,
}

/// Where a new volume's contents come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Snapshot(String),
    Volume(String),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Snapshot(id) => write!(f, "snapshot {id}"),
            Source::Volume(id) => write!(f, "volume {id}"),
        }
    }
}

pub(super) fn snapshot_dir(dir: &Path) -> PathBuf {
    dir.join("snapshots")
}

/// Load the snapshots under `<dir>/snapshots` (created when missing), finishing or rolling
/// back what a crash interrupted.
pub(super) fn recover_snapshots(dir: &Path) -> Result<std::collections::BTreeMap<String, Snapshot>> {
    let sdir = snapshot_dir(dir);
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&sdir).map_err(io_err("creating", &sdir))?;
    let mut metas = Vec::new();
    let mut tmps = Vec::new();
    for entry in std::fs::read_dir(&sdir).map_err(io_err("reading", &sdir))? {
        let entry = entry.map_err(io_err("reading", &sdir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        match classify(name) {
            Entry::Meta(id) if validate_id(id).is_ok() => metas.push(id.to_string()),
            Entry::CreateTmp(id) if validate_id(id).is_ok() => tmps.push(id.to_string()),
            Entry::DeleteTmp(id) if validate_id(id).is_ok() => {
                tracing::info!(snapshot = id, "finishing an interrupted snapshot delete");
                remove_if_exists(&sdir.join(format!("{id}.json")))?;
                remove_if_exists(&entry.path())?;
                metas.retain(|m| m != id);
                tmps.retain(|m| m != id);
            }
            Entry::WriteTmp => {
                let _ = std::fs::remove_file(entry.path());
            }
            Entry::Image(_) => {}
            _ => tracing::warn!(dir = %sdir.display(), file = name, "ignoring an unexpected file among the snapshots"),
        }
    }
    let mut out = std::collections::BTreeMap::new();
    for id in metas {
        let meta = sdir.join(format!("{id}.json"));
        // A delete of this id in progress removed the metadata above; otherwise read it.
        let Ok(data) = std::fs::read(&meta) else { continue };
        let mut s: Snapshot = match serde_json::from_slice(&data) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(file = %meta.display(), error = %e, "unreadable snapshot metadata; ignoring it");
                continue;
            }
        };
        if s.id != id {
            tracing::error!(file = %meta.display(), claims = %s.id, "snapshot metadata names another snapshot; ignoring it");
            continue;
        }
        s.path = sdir.join(format!("{id}.img"));
        out.insert(id, s);
    }
    for id in tmps {
        let tmp = sdir.join(format!(".{id}.img.tmp"));
        match out.get(&id) {
            // The metadata is written only after the copy is complete and synced.
            Some(s) if s.path.symlink_metadata().is_err() => {
                tracing::info!(snapshot = %id, "finishing an interrupted snapshot (the copy was complete)");
                std::fs::rename(&tmp, &s.path).map_err(io_err("renaming into place", &tmp))?;
            }
            _ => {
                tracing::info!(snapshot = %id, "removing an unfinished snapshot copy");
                remove_if_exists(&tmp)?;
            }
        }
    }
    // Thin snapshots are checked against the pool (`lvm::recover`).
    out.retain(|id, s| {
        let there = s.backend == Backend::Lvm || s.path.exists();
        if !there {
            tracing::error!(snapshot = %id, path = %s.path.display(), "snapshot image is missing; not offering it");
        }
        there
    });
    sync_dir(&sdir)?;
    Ok(out)
}

/// Holds capacity for a volume or snapshot being copied; given back when dropped.
pub(super) struct Reservation<'a> {
    store: &'a VolumeStore,
    backend: Backend,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut idx = self.store.index.lock().unwrap();
        let r = idx.reserved.entry(self.backend).or_default();
        *r = r.saturating_sub(self.bytes);
    }
}

impl VolumeStore {
    pub(super) fn reserve(&self, id: &str, backend: Backend, bytes: u64) -> Result<Reservation<'_>> {
        let room = self.room(id, backend)?;
        let mut idx = self.index.lock().unwrap();
        self.check_fits(&idx, id, &room, bytes)?;
        *idx.reserved.entry(backend).or_default() += bytes;
        Ok(Reservation { store: self, backend, bytes })
    }

    pub fn get_snapshot(&self, id: &str) -> Result<Option<Snapshot>> {
        validate_id(id)?;
        Ok(self.index.lock().unwrap().snapshots.get(id).cloned())
    }

    /// Every complete snapshot, by id.
    pub fn list_snapshots(&self) -> Vec<Snapshot> {
        self.index.lock().unwrap().snapshots.values().cloned().collect()
    }

    /// Take snapshot `id` of volume `source`: a point-in-time copy of its image, complete
    /// before it is listed. Idempotent: the same id, source and name returns the existing
    /// snapshot; another source or name is [`VolumeError::SnapshotExists`]. For a source
    /// nothing writes to; see [`Self::create_snapshot_with`].
    pub fn create_snapshot(&self, id: &str, source: &str, name: &str) -> Result<Snapshot> {
        self.create_snapshot_with(id, source, name, || Ok(((), CopyLimits::default())))
    }

    /// [`Self::create_snapshot`], calling `prepare` once everything is checked and the
    /// capacity held, right before the copy: it makes the source consistent (freezes its
    /// filesystem) and says how the copy may be made; what it returns is held during the
    /// copy only.
    pub fn create_snapshot_with<G>(
        &self,
        id: &str,
        source: &str,
        name: &str,
        prepare: impl FnOnce() -> Result<(G, CopyLimits)>,
    ) -> Result<Snapshot> {
        validate_id(id)?;
        validate_id(source)?;
        let lock = self.volume_lock(&format!("snapshot/{id}"));
        let _g = lock.lock().unwrap();
        if let Some(s) = self.get_snapshot(id)? {
            if s.source_volume == source && s.name == name {
                return Ok(s);
            }
            return Err(VolumeError::SnapshotExists { id: id.to_string(), volume: s.source_volume, name: s.name });
        }
        let vlock = self.volume_lock(source);
        let _vg = vlock.lock().unwrap();
        let vol = self.get(source)?.ok_or_else(|| VolumeError::NotFound(source.to_string()))?;
        let _r = self.reserve(id, vol.backend, vol.size_bytes)?;
        if vol.backend == Backend::Lvm {
            // Device-mapper suspends the origin for the moment the snapshot takes, which
            // flushes and freezes a filesystem right on it. `prepare` freezes one on a
            // dm-crypt mapping above it, which that suspend does not reach.
            let (_held, _) = prepare()?;
            return self.snapshot_lv(id, &vol, name);
        }
        let sdir = snapshot_dir(&self.dir);
        let img = sdir.join(format!("{id}.img"));
        let tmp = sdir.join(format!(".{id}.img.tmp"));
        let meta_path = sdir.join(format!("{id}.json"));
        let result = (|| {
            let (held, limits) = prepare()?;
            let copied = copy_into(&vol.path, &tmp, vol.size_bytes, limits);
            drop(held);
            let stats = copied.map_err(|e| copy_error(id, &vol.path, e))?;
            crate::util::crash_point("snapshot-after-copy");
            let snap = Snapshot {
                version: META_VERSION,
                id: id.to_string(),
                source_volume: source.to_string(),
                size_bytes: vol.size_bytes,
                fs_type: vol.fs_type,
                created_at: crate::util::unix_secs(),
                name: name.to_string(),
                method: stats.method.as_str().to_string(),
                bytes_copied: stats.bytes_copied,
                backend: Backend::File,
                controller_store: String::new(),
                path: img.clone(),
            };
            write_json(&meta_path, &snap)?;
            crate::util::crash_point("snapshot-after-meta");
            std::fs::rename(&tmp, &img).map_err(io_err("renaming into place", &tmp))?;
            // Renamed: complete. A lost rename is finished by `open` (the metadata is down).
            if let Err(e) = sync_dir(&sdir) {
                tracing::warn!(snapshot = id, error = %e, "syncing the snapshot directory after the rename");
            }
            Ok(snap)
        })();
        match result {
            Ok(snap) => {
                self.index.lock().unwrap().snapshots.insert(id.to_string(), snap.clone());
                tracing::info!(snapshot = id, volume = source, size = snap.size_bytes, method = %snap.method, bytes_copied = snap.bytes_copied, "snapshot taken");
                Ok(snap)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                let _ = std::fs::remove_file(&meta_path);
                Err(e)
            }
        }
    }

    /// Record that controller store `store` lists snapshot `id` (see
    /// [`Snapshot::controller_store`]).
    pub fn set_snapshot_controller_store(&self, id: &str, store: &str) -> Result<()> {
        validate_id(id)?;
        let mut idx = self.index.lock().unwrap();
        let snap = idx.snapshots.get_mut(id).ok_or_else(|| VolumeError::NotFound(format!("snapshot {id}")))?;
        if snap.controller_store != store {
            let mut owned = snap.clone();
            owned.controller_store = store.to_string();
            write_json(&snapshot_dir(&self.dir).join(format!("{id}.json")), &owned)?;
            *snap = owned;
        }
        Ok(())
    }

    /// Delete snapshot `id`. Idempotent: an unknown id is success.
    pub fn delete_snapshot(&self, id: &str) -> Result<()> {
        validate_id(id)?;
        let lock = self.volume_lock(&format!("snapshot/{id}"));
        let _g = lock.lock().unwrap();
        if let Some(s) = self.get_snapshot(id)?
            && s.backend == Backend::Lvm
        {
            return self.delete_snapshot_lv(&s);
        }
        let sdir = snapshot_dir(&self.dir);
        let img = sdir.join(format!("{id}.img"));
        let del = sdir.join(format!(".{id}.img.del"));
        match std::fs::rename(&img, &del) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("renaming for delete", &img)(e)),
        }
        // Going: no longer offered, even if a step below fails (`open` finishes it).
        let was = self.index.lock().unwrap().snapshots.remove(id).is_some();
        remove_if_exists(&sdir.join(format!("{id}.json")))?;
        sync_dir(&sdir)?;
        remove_if_exists(&del)?;
        remove_if_exists(&sdir.join(format!(".{id}.img.tmp")))?;
        if was {
            tracing::info!(snapshot = id, "snapshot deleted");
        }
        Ok(())
    }

    /// Create volume `id` of `size_bytes` (rounded up to whole MiB) holding a copy of
    /// `source` (a snapshot, or another volume: a clone), grown to the size. The source's
    /// filesystem type is the volume's. Idempotent like [`Self::create_named`]. A volume
    /// source that is mounted must be made consistent by the caller (frozen).
    pub fn create_from(&self, id: &str, size_bytes: u64, name: &str, source: &Source) -> Result<Volume> {
        self.create_from_with(id, size_bytes, name, source, || Ok(((), CopyLimits::default())))
    }

    /// [`Self::create_from`], with `prepare` as for [`Self::create_snapshot_with`].
    pub fn create_from_with<G>(
        &self,
        id: &str,
        size_bytes: u64,
        name: &str,
        source: &Source,
        prepare: impl FnOnce() -> Result<(G, CopyLimits)>,
    ) -> Result<Volume> {
        validate_id(id)?;
        let size = round_size(id, size_bytes)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        let (src_path, src_size, fs_type, backend) = match source {
            Source::Snapshot(s) => {
                let s = self.get_snapshot(s)?.ok_or_else(|| VolumeError::NotFound(format!("snapshot {s}")))?;
                (s.path, s.size_bytes, s.fs_type, s.backend)
            }
            Source::Volume(v) => {
                if v == id {
                    return Err(VolumeError::InvalidId {
                        id: id.to_string(),
                        reason: "a volume cannot be its own source",
                    });
                }
                let v = self.get(v)?.ok_or_else(|| VolumeError::NotFound(v.clone()))?;
                (v.path, v.size_bytes, v.fs_type, v.backend)
            }
        };
        if let Some(v) = self.get(id)? {
            if v.size_bytes == size && v.fs_type == fs_type && v.name == name && v.backend == backend {
                return Ok(v);
            }
            return Err(VolumeError::AlreadyExists {
                id: id.to_string(),
                existing_size: v.size_bytes,
                existing_fs: v.fs_type,
                requested_size: size,
                requested_fs: fs_type,
            });
        }
        if size < src_size {
            return Err(VolumeError::Shrink { id: id.to_string(), current: src_size, requested: size });
        }
        let img = self.free_image_path(id)?;
        let _vlock;
        let _vg;
        if let Source::Volume(v) = source {
            _vlock = self.volume_lock(v);
            _vg = _vlock.lock().unwrap();
        }
        let _r = self.reserve(id, backend, size)?;
        if backend == Backend::Lvm {
            // A thin snapshot of the source, made writable: instant, sharing its blocks.
            // `prepare` as for a snapshot.
            let (_held, _) = prepare()?;
            return self.clone_lv(id, size, fs_type, name, source);
        }
        let tmp = self.dir.join(format!(".{id}.img.tmp"));
        let meta_path = self.meta_path(id);
        let vol = Volume::new(id, size, fs_type, name, img.clone());
        let result = (|| {
            let (held, limits) = prepare()?;
            let copied = copy_into(&src_path, &tmp, size, limits);
            drop(held);
            let stats = copied.map_err(|e| copy_error(id, &src_path, e))?;
            crate::util::crash_point("restore-after-copy");
            write_meta_unsynced_dir(&meta_path, &vol)?;
            sync_dir(&self.dir)?;
            std::fs::rename(&tmp, &img).map_err(io_err("renaming into place", &tmp))?;
            if let Err(e) = sync_dir(&self.dir) {
                tracing::warn!(volume = id, error = %e, "syncing the volume directory after the rename");
            }
            Ok(stats)
        })();
        match result {
            Ok(stats) => {
                self.index.lock().unwrap().volumes.insert(id.to_string(), vol.clone());
                tracing::info!(volume = id, size, fs = fs_type.as_str(), from = %source, method = stats.method.as_str(), bytes_copied = stats.bytes_copied, "volume created from a source");
                Ok(vol)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                let _ = std::fs::remove_file(&meta_path);
                Err(e)
            }
        }
    }
}

/// A failed copy, as the caller can act on it: the store's filesystem full → capacity; a copy
/// that could not be made consistent or in time → busy (retry when the volume is idle).
fn copy_error(id: &str, src: &Path, e: io::Error) -> VolumeError {
    match (e.raw_os_error(), e.kind()) {
        (Some(libc::ENOSPC) | Some(libc::EDQUOT), _) => {
            VolumeError::CapacityExceeded { id: id.to_string(), requested: 0, available: 0, capacity: 0 }
        }
        (_, io::ErrorKind::NotFound) => VolumeError::BackingFileMissing { id: id.to_string(), path: src.to_path_buf() },
        (_, io::ErrorKind::Unsupported) => VolumeError::Busy {
            id: id.to_string(),
            reason: "the source is in use unfrozen (a raw block volume, or a filesystem that could not be frozen) and the \
                     store's filesystem cannot reflink: a consistent copy needs it unpublished, or a store on xfs with reflink"
                .to_string(),
        },
        (_, io::ErrorKind::TimedOut) => VolumeError::Busy {
            id: id.to_string(),
            reason: format!(
                "copying {} did not finish within the {} s a filesystem is kept frozen; use a store on a filesystem that can reflink for volumes this large",
                src.display(),
                FROZEN_COPY_LIMIT.as_secs()
            ),
        },
        _ => VolumeError::Io { op: "copying", path: src.to_path_buf(), source: e },
    }
}

/// The longest a copy runs while its source's filesystem is frozen (under kubelet's default
/// 30 s termination grace, so a killed agent has thawed before a SIGKILL can come).
pub const FROZEN_COPY_LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Copy the image `src` into the new file `dst` (0600), sized `len`, and sync it.
fn copy_into(src: &Path, dst: &Path, len: u64, limits: CopyLimits) -> io::Result<CopyStats> {
    let s = OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(src)?;
    let d = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(dst)?;
    let stats = imagecopy::copy_image(&s, &d, len, limits)?;
    d.sync_all()?;
    Ok(stats)
}

pub(super) fn write_json(path: &Path, snap: &Snapshot) -> Result<()> {
    let mut data =
        serde_json::to_vec_pretty(snap).map_err(|source| VolumeError::Metadata { path: path.to_path_buf(), source })?;
    data.push(b'\n');
    crate::sys::fs::atomic_write(path, &data, 0o600).map_err(io_err("writing", path))
}

impl Snapshot {
    /// Disk space the image really uses (shared extents of a reflink count in full).
    pub fn allocated_bytes(&self) -> u64 {
        std::fs::metadata(&self.path).map(|m| m.blocks() * 512).unwrap_or(0)
    }
}
