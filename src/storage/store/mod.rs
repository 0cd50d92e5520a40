//! Node-local volume store: one sparse file per volume, attached through a loop device.
//!
//! Layout of the store directory (`VolumeStore::open`):
//!
//! ```text
//! <dir>/.lock             flock'd by the open store: one store per directory
//! <dir>/<id>.img          the volume's bytes (sparse; `File::set_len`)
//! <dir>/<id>.json         its metadata (id, sizeBytes, fsType, createdAt), written atomically
//! <dir>/.<id>.img.tmp     a create in progress (renamed to <id>.img once the metadata is down)
//! <dir>/.<id>.img.del     a delete in progress (finished at start)
//! <dir>/snapshots/         snapshots, and the copies volumes are made from (`snapshots`)
//! ```
//!
//! Every step is ordered so that a crash leaves something `open` can finish or roll back:
//! a create writes the image under its temporary name, then the metadata, then renames the
//! image; a delete renames the image away, removes the metadata, syncs the directory (the
//! volume is gone from here on), then frees the image off the caller's path. An image
//! without metadata is therefore never a half-done create: it is reported by
//! [`VolumeStore::orphans`], never removed behind the operator's back.
//!
//! Capacity is bounded by configuration: the sum of the volumes' (rounded) sizes never
//! exceeds `capacity_bytes`. Sizes are rounded up to whole MiB.
//!
//! Loop devices are bound without `LO_FLAGS_AUTOCLEAR`. Auto-clear unbinds a device at its
//! last close, and a volume must stay attached while nothing holds it open: between attach
//! and mount (mkfs runs there), for raw block volumes (published by bind-mounting the device
//! node, which does not open it), and across agent restarts. So an attachment lasts until
//! [`VolumeStore::detach`]; leaks are found by [`VolumeStore::orphans`] and by the caller
//! reconciling attachments against its staged volumes on start. Direct I/O is off (buffered
//! through the backing file's page cache, which works on every backing filesystem).
//!
//! Operations on one volume are serialised inside the store (a lock per volume id); operations
//! on different volumes run in parallel, except the short capacity bookkeeping of create and
//! expand.

use crate::storage::fs;
use crate::sys::loopdev;
use crate::sys::volume_kernel::{Kernel, VolumeKernel};

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

pub use fs::{FsError, FsType, InvalidFsType};

/// Sizes are whole MiB.
pub const SIZE_ALIGN: u64 = 1 << 20;
pub const MAX_ID_LEN: usize = 128;
const META_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("invalid volume id {id:?}: {reason}")]
    InvalidId { id: String, reason: &'static str },
    #[error("invalid size {size} for volume {id}: {reason}")]
    InvalidSize { id: String, size: u64, reason: &'static str },
    #[error(transparent)]
    InvalidFsType(#[from] InvalidFsType),
    #[error("volume {0} not found")]
    NotFound(String),
    #[error(
        "volume {id} already exists with size {existing_size} and fs {existing_fs:?}; requested size {requested_size}, fs {requested_fs:?}"
    )]
    AlreadyExists { id: String, existing_size: u64, existing_fs: FsType, requested_size: u64, requested_fs: FsType },
    #[error("volume {id}: {requested} bytes do not fit (available {available} of capacity {capacity})")]
    CapacityExceeded { id: String, requested: u64, available: u64, capacity: u64 },
    #[error("volume {id}: cannot shrink from {current} to {requested} bytes")]
    Shrink { id: String, current: u64, requested: u64 },
    #[error("volume {id} is busy: {reason}")]
    Busy { id: String, reason: String },
    #[error("volume {id}: backing file {path} is missing")]
    BackingFileMissing { id: String, path: PathBuf },
    #[error("volume store {dir} is in use by another store (lock {lock})")]
    Locked { dir: PathBuf, lock: PathBuf },
    #[error("volume store: {op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: io::Error },
    #[error("volume store: metadata {path}: {source}")]
    Metadata { path: PathBuf, source: serde_json::Error },
    #[error("snapshot {id} already exists, of volume {volume} (name {name:?})")]
    SnapshotExists { id: String, volume: String, name: String },
    #[error("volume {id}: {reason}")]
    Backend { id: String, reason: String },
    #[error("volume {id}: {source}")]
    Lvm { id: String, source: crate::sys::lvm::LvmError },
    #[error(transparent)]
    Fs(#[from] FsError),
}

pub type Result<T, E = VolumeError> = std::result::Result<T, E>;

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> VolumeError {
    let path = path.to_path_buf();
    move |source| VolumeError::Io { op, path, source }
}

/// Where a volume's bytes live: a sparse file on a loop device (the default), or a thin
/// logical volume in the LVM thin pool the agent's config names (`lvm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    File,
    Lvm,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::File => "file",
            Backend::Lvm => "lvm",
        }
    }
    pub fn is_file(&self) -> bool {
        *self == Backend::File
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A backend name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid volume backend {0:?} (want \"file\" or \"lvm\")")]
pub struct InvalidBackend(pub String);

impl std::str::FromStr for Backend {
    type Err = InvalidBackend;
    fn from_str(s: &str) -> Result<Self, InvalidBackend> {
        match s {
            "" | "file" => Ok(Backend::File),
            "lvm" => Ok(Backend::Lvm),
            other => Err(InvalidBackend(other.to_string())),
        }
    }
}

/// One volume as its metadata file records it (plus where its image is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    #[serde(default = "meta_version")]
    pub version: u32,
    pub id: String,
    /// Bytes, a multiple of [`SIZE_ALIGN`].
    #[serde(rename = "sizeBytes")]
    pub size_bytes: u64,
    #[serde(rename = "fsType")]
    pub fs_type: FsType,
    /// Seconds since the Unix epoch.
    #[serde(rename = "createdAt")]
    pub created_at: u64,
    /// Who asked for it: the CSI volume name when the controller provisioned it ("" for a
    /// volume made on the node directly). The controller's create, delete and orphan
    /// reclaim act only on a volume whose name matches, so an id collision can never hand
    /// one claim's data to another or delete it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Where its bytes live (absent in the metadata: `file`).
    #[serde(default, skip_serializing_if = "Backend::is_file")]
    pub backend: Backend,
    /// The controller store that last listed it (`VolumeSet.store_id`; "" until one did).
    /// Orphan reclaim deletes only a volume of the store that no longer lists it: never
    /// one of a store that was lost and made again, which never knew it.
    #[serde(default, rename = "controllerStore", skip_serializing_if = "String::is_empty")]
    pub controller_store: String,
    /// `<dir>/<id>.img`, or the thin LV's device node `/dev/<vg>/np-<id>` (not stored;
    /// derived from the store directory or the pool).
    #[serde(skip)]
    pub path: PathBuf,
}

impl Volume {
    /// A new volume's metadata, created now.
    fn new(id: &str, size_bytes: u64, fs_type: FsType, name: &str, path: PathBuf) -> Self {
        Volume {
            version: META_VERSION,
            id: id.to_string(),
            size_bytes,
            fs_type,
            created_at: crate::util::unix_secs(),
            name: name.to_string(),
            backend: Backend::File,
            controller_store: String::new(),
            path,
        }
    }
}

fn meta_version() -> u32 {
    META_VERSION
}

/// What [`VolumeStore::usage`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Configured capacity.
    pub capacity_bytes: u64,
    /// Sum of the volumes' and snapshots' sizes.
    pub provisioned_bytes: u64,
    /// `capacity - provisioned` (zero when the configuration was lowered below what exists).
    pub available_bytes: u64,
    pub volumes: usize,
    /// Disk space the sparse images (volumes and snapshots) really use.
    pub allocated_bytes: u64,
    /// Free space on the filesystem under the store (sparse files can overcommit it).
    pub backing_fs_free_bytes: u64,
}

/// Something in the store directory or the loop table that no volume accounts for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Orphan {
    /// A loop device bound to a file in the store directory that belongs to no volume (its
    /// metadata is gone, or the file was deleted or replaced while attached).
    LoopDevice { device: PathBuf, backing_file: PathBuf, deleted: bool },
    /// An image file without metadata.
    BackingFile { path: PathBuf },
    /// Metadata whose image file is gone.
    MissingBackingFile { id: String, path: PathBuf },
    /// A logical volume in the thin pool named like ours (`np-…`, `nps-…`) that no volume
    /// or snapshot accounts for.
    LogicalVolume { name: String },
}

/// Check a volume id: 1..=128 characters of `[a-z0-9._-]`, not `.` or `..`. Such an id is
/// one plain path component: nothing can escape the store directory.
pub fn validate_id(id: &str) -> Result<()> {
    let bad = |reason| Err(VolumeError::InvalidId { id: id.chars().take(MAX_ID_LEN + 8).collect(), reason });
    if id.is_empty() {
        return bad("empty");
    }
    if id.len() > MAX_ID_LEN {
        return bad("longer than 128 characters");
    }
    if id == "." || id == ".." {
        return bad("not a file name");
    }
    if !id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')) {
        return bad("only a-z, 0-9, '-', '_' and '.' are allowed");
    }
    Ok(())
}

/// Round a requested size up to whole MiB.
pub fn round_size(id: &str, size: u64) -> Result<u64> {
    if size == 0 {
        return Err(VolumeError::InvalidSize { id: id.to_string(), size, reason: "zero" });
    }
    size.div_ceil(SIZE_ALIGN)
        .checked_mul(SIZE_ALIGN)
        .filter(|s| *s <= i64::MAX as u64)
        .ok_or(VolumeError::InvalidSize { id: id.to_string(), size, reason: "too large" })
}

/// Names in the store directory, by suffix (each suffix belongs to one kind only).
#[derive(Debug, PartialEq, Eq)]
enum Entry<'a> {
    Meta(&'a str),
    Image(&'a str),
    CreateTmp(&'a str),
    DeleteTmp(&'a str),
    WriteTmp,
    Lock,
    Other,
}

fn classify(name: &str) -> Entry<'_> {
    if name == ".lock" {
        return Entry::Lock;
    }
    if let Some(id) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".img.tmp")) {
        return Entry::CreateTmp(id);
    }
    if let Some(id) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".img.del")) {
        return Entry::DeleteTmp(id);
    }
    // sys::fs::atomic_write's temporary: ".<name>.tmp<pid>"
    if name.starts_with('.')
        && let Some(pos) = name.rfind(".tmp")
        && name[pos + 4..].bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && pos + 4 < name.len()
    {
        return Entry::WriteTmp;
    }
    if let Some(id) = name.strip_suffix(".json") {
        return Entry::Meta(id);
    }
    if let Some(id) = name.strip_suffix(".img") {
        return Entry::Image(id);
    }
    Entry::Other
}

struct Index {
    volumes: BTreeMap<String, Volume>,
    snapshots: BTreeMap<String, snapshots::Snapshot>,
    /// Held for copies in progress (snapshots, volumes made from a source), by backend.
    reserved: BTreeMap<Backend, u64>,
}

impl Index {
    /// Volumes, snapshots and copies in progress on `backend`: what its capacity is spent on.
    fn provisioned(&self, backend: Backend) -> u64 {
        self.volumes.values().filter(|v| v.backend == backend).map(|v| v.size_bytes).sum::<u64>()
            + self.snapshots.values().filter(|s| s.backend == backend).map(|s| s.size_bytes).sum::<u64>()
            + self.reserved.get(&backend).copied().unwrap_or(0)
    }
}

/// The store. Share it behind an `Arc`; every method takes `&self`.
pub struct VolumeStore {
    dir: PathBuf,
    capacity: u64,
    index: Mutex<Index>,
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Loop devices and `statvfs` go through it (the real kernel outside tests).
    kernel: Arc<dyn VolumeKernel>,
    /// The thin pool of the `lvm` backend, when one is configured.
    lvm: Option<lvm::Lvm>,
    _lock: File,
}

impl std::fmt::Debug for VolumeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeStore").field("dir", &self.dir).field("capacity", &self.capacity).finish()
    }
}

impl VolumeStore {
    /// Open (creating it, mode 0700) the store in `dir` with `capacity_bytes` to hand out.
    /// Takes the directory's lock, loads every volume's metadata and finishes or rolls back
    /// whatever a crash interrupted (see the module docs).
    pub fn open(dir: &Path, capacity_bytes: u64) -> Result<Self> {
        Self::open_with(dir, capacity_bytes, Arc::new(Kernel))
    }

    /// [`Self::open`] reaching loop devices and `statvfs` through `kernel` (a fake in tests).
    pub fn open_with(dir: &Path, capacity_bytes: u64, kernel: Arc<dyn VolumeKernel>) -> Result<Self> {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io_err("creating", dir))?;
        let dir = dir.canonicalize().map_err(io_err("resolving", dir))?;
        let lock_path = dir.join(".lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io_err("opening", &lock_path))?;
        // A store closed a moment ago can still be locked for a moment: a process another
        // thread was spawning holds a copy of the descriptor (close-on-exec) until its exec.
        // So a taken lock is tried again for LOCK_WAIT before it counts as another owner's.
        let since = std::time::Instant::now();
        loop {
            // SAFETY: flock on our own fd.
            if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io_err("locking", &lock_path)(e));
            }
            if since.elapsed() >= LOCK_WAIT {
                return Err(VolumeError::Locked { dir, lock: lock_path });
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let volumes = recover(&dir, &*kernel)?;
        let snapshots = snapshots::recover_snapshots(&dir)?;
        let store = VolumeStore {
            dir,
            capacity: capacity_bytes,
            index: Mutex::new(Index { volumes, snapshots, reserved: BTreeMap::new() }),
            locks: Mutex::new(HashMap::new()),
            kernel,
            lvm: None,
            _lock: lock,
        };
        let provisioned = store.index.lock().unwrap().provisioned(Backend::File);
        if provisioned > capacity_bytes {
            tracing::warn!(
                dir = %store.dir.display(),
                provisioned,
                capacity = capacity_bytes,
                "volumes exceed the configured capacity; no new volume or expansion fits until some are deleted"
            );
        }
        if let Ok(st) = store.kernel.statvfs(&store.dir) {
            let fs_size = st.blocks * st.fragment_size;
            if capacity_bytes > fs_size {
                tracing::warn!(
                    dir = %store.dir.display(),
                    capacity = capacity_bytes,
                    fs_size,
                    "configured volume capacity exceeds the backing filesystem; sparse images can run it full"
                );
            }
        }
        Ok(store)
    }

    /// The store directory (canonical).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The kernel the store reaches loop devices through (the node service shares it).
    pub fn kernel(&self) -> &Arc<dyn VolumeKernel> {
        &self.kernel
    }

    /// Bytes still available for new file volumes or expansion.
    pub fn available(&self) -> u64 {
        self.capacity.saturating_sub(self.index.lock().unwrap().provisioned(Backend::File))
    }

    /// The capacity of `backend` and what is still available on it: the configured capacity
    /// for `file`; for `lvm`, the pool's (see [`lvm::PoolUsage`]). `None`: no such backend
    /// here (no pool configured).
    pub fn capacity_of(&self, backend: Backend) -> Result<Option<(u64, u64)>> {
        match backend {
            Backend::File => Ok(Some((self.capacity, self.available()))),
            Backend::Lvm => match &self.lvm {
                None => Ok(None),
                Some(_) => self.pool_usage().map(|u| u.map(|u| (u.capacity_bytes, u.available_bytes))),
            },
        }
    }

    /// Check that `bytes` more fit on `backend`; the capacity error otherwise.
    fn check_fits(&self, idx: &Index, id: &str, room: &Room, bytes: u64) -> Result<()> {
        let (capacity, available) = match room {
            Room::File => (self.capacity, self.capacity.saturating_sub(idx.provisioned(Backend::File))),
            Room::Pool(st) => {
                let u = self.lvm(id)?.record(st, idx.provisioned(Backend::Lvm));
                (u.capacity_bytes, u.available_bytes)
            }
        };
        if bytes > available {
            return Err(VolumeError::CapacityExceeded { id: id.to_string(), requested: bytes, available, capacity });
        }
        Ok(())
    }

    /// Where a new volume `id`'s image goes: refused while an image nobody's metadata claims
    /// is there (possibly someone's data; not ours to reuse or overwrite; `orphans`
    /// reports it).
    fn free_image_path(&self, id: &str) -> Result<PathBuf> {
        let img = self.dir.join(format!("{id}.img"));
        if img.symlink_metadata().is_ok() {
            return Err(VolumeError::Busy {
                id: id.to_string(),
                reason: format!("{} exists without metadata (an orphan; delete it first)", img.display()),
            });
        }
        Ok(img)
    }

    fn meta_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn volume_lock(&self, id: &str) -> Arc<Mutex<()>> {
        self.locks.lock().unwrap().entry(id.to_string()).or_default().clone()
    }

    pub fn get(&self, id: &str) -> Result<Option<Volume>> {
        validate_id(id)?;
        Ok(self.index.lock().unwrap().volumes.get(id).cloned())
    }

    /// Every volume, ordered by id.
    pub fn list(&self) -> Vec<Volume> {
        self.index.lock().unwrap().volumes.values().cloned().collect()
    }

    pub fn usage(&self) -> Usage {
        let (provisioned, files, volumes) = {
            let idx = self.index.lock().unwrap();
            let files =
                idx.volumes.values().map(|v| v.path.clone()).chain(idx.snapshots.values().map(|s| s.path.clone()));
            (idx.provisioned(Backend::File), files.collect::<Vec<_>>(), idx.volumes.len())
        };
        let allocated = files
            .iter()
            .filter(|p| p.starts_with(&self.dir))
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.blocks() * 512)
            .sum();
        let backing_fs_free_bytes =
            self.kernel.statvfs(&self.dir).map(|s| s.blocks_available * s.fragment_size).unwrap_or(0);
        Usage {
            capacity_bytes: self.capacity,
            provisioned_bytes: provisioned,
            available_bytes: self.capacity.saturating_sub(provisioned),
            volumes,
            allocated_bytes: allocated,
            backing_fs_free_bytes,
        }
    }

    /// Create volume `id` of `size_bytes` (rounded up to whole MiB). Idempotent: the same id
    /// with the same rounded size and fs type returns the existing volume; with a different
    /// one it is [`VolumeError::AlreadyExists`].
    pub fn create(&self, id: &str, size_bytes: u64, fs_type: FsType) -> Result<Volume> {
        self.create_named(id, size_bytes, fs_type, "")
    }

    /// [`Self::create`] recording `name` (see [`Volume::name`]): an existing volume is the
    /// same one only when its name matches too.
    pub fn create_named(&self, id: &str, size_bytes: u64, fs_type: FsType, name: &str) -> Result<Volume> {
        self.create_on(Backend::File, id, size_bytes, fs_type, name)
    }

    /// [`Self::create_named`] on `backend`.
    pub fn create_on(
        &self,
        backend: Backend,
        id: &str,
        size_bytes: u64,
        fs_type: FsType,
        name: &str,
    ) -> Result<Volume> {
        validate_id(id)?;
        let size = round_size(id, size_bytes)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        let mut idx = self.index.lock().unwrap();
        if let Some(v) = idx.volumes.get(id) {
            if v.size_bytes == size && v.fs_type == fs_type && v.name == name && v.backend == backend {
                return Ok(v.clone());
            }
            return Err(VolumeError::AlreadyExists {
                id: id.to_string(),
                existing_size: v.size_bytes,
                existing_fs: v.fs_type,
                requested_size: size,
                requested_fs: fs_type,
            });
        }
        if backend == Backend::Lvm {
            drop(idx);
            return self.create_lv(id, size, fs_type, name);
        }
        self.check_fits(&idx, id, &Room::File, size)?;
        let img = self.free_image_path(id)?;
        let tmp = self.dir.join(format!(".{id}.img.tmp"));
        let meta_path = self.meta_path(id);
        let vol = Volume::new(id, size, fs_type, name, img.clone());
        let result = (|| {
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC)
                .open(&tmp)
                .map_err(io_err("creating", &tmp))?;
            f.set_len(size).map_err(io_err("sizing", &tmp))?;
            drop(f);
            // Two syncs: the metadata's content, then the directory (both names at once).
            // The image's size needs none: a crash that loses it is an interrupted
            // expansion to recovery, which sets the size the metadata gives. The metadata
            // is renamed first, so an image is never in place without it.
            write_meta_unsynced_dir(&meta_path, &vol)?;
            std::fs::rename(&tmp, &img).map_err(io_err("renaming into place", &tmp))?;
            sync_dir(&self.dir)
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            let _ = std::fs::remove_file(&meta_path);
            return Err(e);
        }
        idx.volumes.insert(id.to_string(), vol.clone());
        tracing::info!(volume = id, size, fs = fs_type.as_str(), "volume created");
        Ok(vol)
    }

    /// Record that controller store `store` lists volume `id` ([`Volume::controller_store`]).
    pub fn set_controller_store(&self, id: &str, store: &str) -> Result<()> {
        validate_id(id)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        let mut idx = self.index.lock().unwrap();
        let vol = idx.volumes.get_mut(id).ok_or_else(|| VolumeError::NotFound(id.to_string()))?;
        if vol.controller_store != store {
            let mut owned = vol.clone();
            owned.controller_store = store.to_string();
            write_meta_unsynced_dir(&self.meta_path(id), &owned)?;
            sync_dir(&self.dir)?;
            *vol = owned;
        }
        Ok(())
    }

    /// Delete volume `id`: image and metadata. Idempotent (an unknown id is success). An
    /// image without metadata under this id is removed too. Refused with
    /// [`VolumeError::Busy`] while a loop device is bound to the image.
    pub fn delete(&self, id: &str) -> Result<()> {
        validate_id(id)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        if let Some(v) = self.get(id)?
            && v.backend == Backend::Lvm
        {
            return self.delete_lv(&v);
        }
        let img = self.dir.join(format!("{id}.img"));
        let meta_path = self.meta_path(id);
        match loops_of(&*self.kernel, &img)? {
            Some((_, devices)) => {
                if !devices.is_empty() {
                    let names: Vec<String> = devices.iter().map(|d| d.device.display().to_string()).collect();
                    return Err(VolumeError::Busy {
                        id: id.to_string(),
                        reason: format!("attached to {}", names.join(", ")),
                    });
                }
                let del = self.dir.join(format!(".{id}.img.del"));
                std::fs::rename(&img, &del).map_err(io_err("renaming for delete", &img))?;
                remove_if_exists(&meta_path)?;
                sync_dir(&self.dir)?;
                // The volume is gone from here on: an image this cannot remove is removed
                // by the next start (`recover`), so the delete still succeeds.
                if let Err(e) = remove_if_exists(&del) {
                    tracing::warn!(volume = id, error = %e, "removing a deleted volume's image");
                }
            }
            None => remove_if_exists(&meta_path)?,
        }
        if self.index.lock().unwrap().volumes.remove(id).is_some() {
            tracing::info!(volume = id, "volume deleted");
        }
        Ok(())
    }

    /// Grow volume `id` to `new_size` (rounded up to whole MiB). Same size: nothing to do
    /// (but a grow a crash interrupted is finished). Smaller: [`VolumeError::Shrink`]. When
    /// the volume is attached, the loop device grows online (`LOOP_SET_CAPACITY`); the
    /// filesystem is the caller's ([`fs::grow_fs`]). Returns the volume as it now is.
    pub fn expand(&self, id: &str, new_size: u64) -> Result<Volume> {
        validate_id(id)?;
        let size = round_size(id, new_size)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        let vol = self.get(id)?.ok_or_else(|| VolumeError::NotFound(id.to_string()))?;
        if vol.backend == Backend::Lvm {
            return self.expand_lv(vol, size);
        }
        let img = vol.path;
        // Open the image before touching the metadata: a volume whose image is gone is not
        // grown on paper.
        let f = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&img)
            .map_err(|e| missing_or(id, &img, "opening", e))?;
        let vol = {
            let mut idx = self.index.lock().unwrap();
            let current = idx.volumes.get(id).ok_or_else(|| VolumeError::NotFound(id.to_string()))?.size_bytes;
            if size < current {
                return Err(VolumeError::Shrink { id: id.to_string(), current, requested: size });
            }
            if size > current {
                self.check_fits(&idx, id, &Room::File, size - current)?;
            }
            let vol = idx.volumes.get_mut(id).ok_or_else(|| VolumeError::NotFound(id.to_string()))?;
            if size > vol.size_bytes {
                // Metadata first: it reserves the capacity, and a crash before the file
                // grows is finished by the next expand or open.
                let mut grown = vol.clone();
                grown.size_bytes = size;
                write_meta_unsynced_dir(&self.meta_path(id), &grown)?;
                sync_dir(&self.dir)?;
                *vol = grown;
            }
            vol.clone()
        };
        let m = f.metadata().map_err(io_err("inspecting", &vol.path))?;
        if m.len() < vol.size_bytes {
            f.set_len(vol.size_bytes).map_err(io_err("growing", &vol.path))?;
            f.sync_all().map_err(io_err("syncing", &vol.path))?;
            tracing::info!(volume = id, size = vol.size_bytes, "volume image grown");
        }
        self.grow_loops(&vol, &m)?;
        Ok(vol)
    }

    /// Tell every loop device bound to `vol`'s image or LV (`m`, its metadata) that it grew.
    fn grow_loops(&self, vol: &Volume, m: &std::fs::Metadata) -> Result<()> {
        for b in self
            .kernel
            .loop_find_backed_by(&vol.path, m.dev(), m.ino())
            .map_err(io_err("finding loop devices of", &vol.path))?
        {
            let dev_size = self.kernel.device_size(&b.device).map_err(io_err("sizing", &b.device))?;
            if dev_size < vol.size_bytes {
                let now =
                    self.kernel.loop_set_capacity(&b.device).map_err(io_err("LOOP_SET_CAPACITY on", &b.device))?;
                tracing::info!(volume = %vol.id, device = %b.device.display(), size = now, "loop device grown online");
            }
        }
        Ok(())
    }

    /// The read-write loop device bound to volume `id`'s image, if any (without attaching).
    pub fn attached_device(&self, id: &str) -> Result<Option<PathBuf>> {
        Ok(self.bindings(id)?.into_iter().find(|b| !b.read_only).map(|b| b.device))
    }

    /// Every loop device bound to volume `id`'s image (read-write and read-only). For a
    /// volume on the `lvm` backend, its active LV counts as its read-write device, and a
    /// read-only loop device over the LV as a read-only one.
    pub fn bindings(&self, id: &str) -> Result<Vec<loopdev::LoopBinding>> {
        validate_id(id)?;
        let img = self.image_of(id);
        let Some((m, mut found)) = loops_of(&*self.kernel, &img)? else { return Ok(Vec::new()) };
        if m.file_type().is_block_device() {
            found.insert(0, lvm::lv_binding(&img));
        }
        Ok(found)
    }

    /// The image of volume `id`: its LV's device node on the `lvm` backend, else
    /// `<dir>/<id>.img` (whether or not the volume exists).
    fn image_of(&self, id: &str) -> PathBuf {
        match self.index.lock().unwrap().volumes.get(id) {
            Some(v) if v.backend == Backend::Lvm => v.path.clone(),
            _ => self.dir.join(format!("{id}.img")),
        }
    }

    /// Attach volume `id` read-write to a loop device and return it (`/dev/loopN`).
    /// Idempotent: when a read-write device is already bound to the image (same inode and
    /// filesystem), that one is returned. Bound buffered, without auto-clear (see the
    /// module docs).
    pub fn attach(&self, id: &str) -> Result<PathBuf> {
        self.attach_mode(id, false)
    }

    /// Attach volume `id` read-only (`LO_FLAGS_READ_ONLY`: every write through the device
    /// fails), alongside any read-write device; idempotent like [`Self::attach`]. Both
    /// devices read the same backing file through the same page cache.
    pub fn attach_read_only(&self, id: &str) -> Result<PathBuf> {
        self.attach_mode(id, true)
    }

    fn attach_mode(&self, id: &str, read_only: bool) -> Result<PathBuf> {
        validate_id(id)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        let vol = self.get(id)?.ok_or_else(|| VolumeError::NotFound(id.to_string()))?;
        if vol.backend == Backend::Lvm && !read_only {
            return self.activate_lv(&vol);
        }
        let f = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(&vol.path)
            .map_err(|e| missing_or(id, &vol.path, "opening", e))?;
        let m = f.metadata().map_err(io_err("inspecting", &vol.path))?;
        let found: Vec<_> = self
            .kernel
            .loop_find_backed_by(&vol.path, m.dev(), m.ino())
            .map_err(io_err("finding loop devices of", &vol.path))?
            .into_iter()
            .filter(|b| b.read_only == read_only)
            .collect();
        if let Some(first) = found.first() {
            if found.len() > 1 {
                let all: Vec<String> = found.iter().map(|b| b.device.display().to_string()).collect();
                tracing::warn!(volume = id, devices = %all.join(", "), read_only, "volume is bound to several loop devices");
            }
            return Ok(first.device.clone());
        }
        let dev = self
            .kernel
            .loop_attach(&f, &vol.path, loopdev::AttachOptions { read_only })
            .map_err(io_err("attaching", &vol.path))?;
        tracing::info!(volume = id, device = %dev.display(), read_only, "volume attached");
        Ok(dev)
    }

    /// Detach volume `id`'s read-only loop devices only (see [`Self::detach`]).
    pub fn detach_read_only(&self, id: &str) -> Result<()> {
        self.detach_where(id, |b| b.read_only)
    }

    /// Detach volume `id` from every loop device bound to its image. Idempotent: nothing
    /// attached, or no such volume, is success. A device that is mounted (or held open by
    /// someone else) is left alone: [`VolumeError::Busy`]. On the `lvm` backend the LV
    /// stays active, and the answer is the same: `Busy` while it is open.
    pub fn detach(&self, id: &str) -> Result<()> {
        self.detach_where(id, |_| true)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        match self.get(id)? {
            Some(v) if v.backend == Backend::Lvm => self.check_lv_released(&v),
            _ => Ok(()),
        }
    }

    fn detach_where(&self, id: &str, which: impl Fn(&loopdev::LoopBinding) -> bool) -> Result<()> {
        validate_id(id)?;
        let lock = self.volume_lock(id);
        let _g = lock.lock().unwrap();
        // A volume on the `lvm` backend stays active: only its read-only loop devices go.
        let img = self.image_of(id);
        let Some((m, found)) = loops_of(&*self.kernel, &img)? else { return Ok(()) };
        let mut busy = Vec::new();
        for b in found.into_iter().filter(|b| which(b)) {
            match self.kernel.loop_detach(&b.device, m.dev(), m.ino()) {
                Ok(()) => tracing::info!(volume = id, device = %b.device.display(), "volume detached"),
                Err(loopdev::DetachError::Busy(reason)) => busy.push(reason),
                Err(loopdev::DetachError::Io(e)) => return Err(io_err("detaching", &b.device)(e)),
            }
        }
        if !busy.is_empty() {
            return Err(VolumeError::Busy { id: id.to_string(), reason: busy.join("; ") });
        }
        Ok(())
    }

    /// What no volume accounts for: loop devices bound to files in the store directory that
    /// belong to no volume, images without metadata, metadata without an image.
    pub fn orphans(&self) -> Result<Vec<Orphan>> {
        let mut out = Vec::new();
        let volumes: BTreeMap<String, Volume> = self.index.lock().unwrap().volumes.clone();
        // Images on disk, by inode, to tell a live volume's binding from a stale one.
        let mut live = Vec::new();
        for v in volumes.values() {
            match std::fs::metadata(&v.path) {
                Ok(m) => live.push((m.dev(), m.ino())),
                Err(_) => out.push(Orphan::MissingBackingFile { id: v.id.clone(), path: v.path.clone() }),
            }
        }
        for b in self.kernel.loop_bound_devices().map_err(io_err("listing loop devices", Path::new("/sys/block")))? {
            if b.backing_file.parent() != Some(self.dir.as_path()) {
                continue;
            }
            let belongs =
                !b.deleted && std::fs::metadata(&b.backing_file).is_ok_and(|m| live.contains(&(m.dev(), m.ino())));
            if !belongs {
                out.push(Orphan::LoopDevice { device: b.device, backing_file: b.backing_file, deleted: b.deleted });
            }
        }
        let entries = std::fs::read_dir(&self.dir).map_err(io_err("reading", &self.dir))?;
        for entry in entries {
            let entry = entry.map_err(io_err("reading", &self.dir))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Entry::Image(id) = classify(name)
                && !volumes.contains_key(id)
            {
                out.push(Orphan::BackingFile { path: entry.path() });
            }
        }
        out.extend(self.orphan_lvs()?);
        Ok(out)
    }
}

fn missing_or(id: &str, path: &Path, op: &'static str, e: io::Error) -> VolumeError {
    if e.kind() == io::ErrorKind::NotFound {
        VolumeError::BackingFileMissing { id: id.to_string(), path: path.to_path_buf() }
    } else {
        io_err(op, path)(e)
    }
}

/// How long [`VolumeStore::open_with`] retries a store lock that is taken.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// Write a volume's metadata: its content fsync'd, renamed into place; the caller syncs the
/// directory (several renames then share one sync).
fn write_meta_unsynced_dir(path: &Path, vol: &Volume) -> Result<()> {
    let mut data =
        serde_json::to_vec_pretty(vol).map_err(|source| VolumeError::Metadata { path: path.to_path_buf(), source })?;
    data.push(b'\n');
    crate::sys::fs::atomic_replace(path, &data, 0o600).map_err(io_err("writing", path))
}

fn read_meta(path: &Path) -> Result<Volume> {
    let data = std::fs::read(path).map_err(io_err("reading", path))?;
    serde_json::from_slice(&data).map_err(|source| VolumeError::Metadata { path: path.to_path_buf(), source })
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("removing", path)(e)),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("syncing", dir))
}

/// The file at `path` (its metadata) and the loop devices bound to it (by inode); `None`
/// when there is no such file.
fn loops_of(kernel: &dyn VolumeKernel, path: &Path) -> Result<Option<(std::fs::Metadata, Vec<loopdev::LoopBinding>)>> {
    let m = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("inspecting", path)(e)),
    };
    let found = kernel.loop_find_backed_by(path, m.dev(), m.ino()).map_err(io_err("finding loop devices of", path))?;
    Ok(Some((m, found)))
}

/// Load the metadata in `dir` and finish or roll back interrupted creates and deletes.
fn recover(dir: &Path, kernel: &dyn VolumeKernel) -> Result<BTreeMap<String, Volume>> {
    let mut metas = Vec::new();
    let mut create_tmps = Vec::new();
    let mut delete_tmps = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err("reading", dir))? {
        let entry = entry.map_err(io_err("reading", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            tracing::warn!(dir = %dir.display(), name = ?name, "ignoring a file with a non-UTF-8 name");
            continue;
        };
        match classify(name) {
            Entry::Meta(id) if validate_id(id).is_ok() => metas.push(id.to_string()),
            Entry::CreateTmp(id) if validate_id(id).is_ok() => create_tmps.push(id.to_string()),
            Entry::DeleteTmp(id) if validate_id(id).is_ok() => delete_tmps.push(id.to_string()),
            Entry::WriteTmp => {
                tracing::info!(file = name, "removing an interrupted metadata write");
                let _ = std::fs::remove_file(entry.path());
            }
            Entry::Image(_) | Entry::Lock => {}
            _ if name == "snapshots" => {}
            _ => tracing::warn!(dir = %dir.display(), file = name, "ignoring an unexpected file in the volume store"),
        }
    }
    // Interrupted deletes: the image was renamed away, so the volume is going. Finish it
    // (unless the renamed image is still attached: then it stays, reported as an orphan).
    for id in &delete_tmps {
        let del = dir.join(format!(".{id}.img.del"));
        if loops_of(kernel, &del)?.is_some_and(|(_, found)| !found.is_empty()) {
            tracing::warn!(volume = %id, file = %del.display(), "interrupted delete left an attached image; leaving it");
            continue;
        }
        tracing::info!(volume = %id, "finishing an interrupted delete");
        remove_if_exists(&dir.join(format!("{id}.json")))?;
        remove_if_exists(&del)?;
        metas.retain(|m| m != id);
    }
    let mut volumes = BTreeMap::new();
    for id in metas {
        let path = dir.join(format!("{id}.json"));
        let mut vol = match read_meta(&path) {
            Ok(v) if v.id == id => v,
            Ok(v) => {
                tracing::error!(file = %path.display(), claims = %v.id, "metadata names another volume; ignoring it");
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "unreadable volume metadata; ignoring it");
                continue;
            }
        };
        vol.path = dir.join(format!("{id}.img"));
        volumes.insert(id, vol);
    }
    // Interrupted creates: metadata down → finish (rename); no metadata → roll back.
    for id in &create_tmps {
        let tmp = dir.join(format!(".{id}.img.tmp"));
        match volumes.get(id) {
            Some(v) if v.path.symlink_metadata().is_err() => {
                tracing::info!(volume = %id, "finishing an interrupted create");
                std::fs::rename(&tmp, &v.path).map_err(io_err("renaming into place", &tmp))?;
            }
            _ => {
                tracing::info!(volume = %id, "rolling back an interrupted create");
                remove_if_exists(&tmp)?;
            }
        }
    }
    // Interrupted expansions: metadata says bigger than the file. Sparse: growing is free.
    for v in volumes.values() {
        if let Ok(m) = std::fs::metadata(&v.path)
            && m.len() < v.size_bytes
        {
            tracing::info!(volume = %v.id, from = m.len(), to = v.size_bytes, "finishing an interrupted expansion");
            let f = OpenOptions::new().write(true).open(&v.path).map_err(io_err("opening", &v.path))?;
            f.set_len(v.size_bytes).map_err(io_err("growing", &v.path))?;
        }
    }
    sync_dir(dir)?;
    Ok(volumes)
}

mod lvm;
use lvm::Room;
pub use lvm::{POOL_SHORT_PERCENT, PoolUsage, ThinPoolConfig};
mod snapshots;
pub use snapshots::{FROZEN_COPY_LIMIT, Snapshot, Source};

#[cfg(test)]
mod tests;
