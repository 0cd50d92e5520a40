//! The `lvm` backend: volumes as thin logical volumes in an LVM thin pool the agent's config
//! names. The store directory keeps their metadata, as for file volumes; the pool keeps the
//! bytes.
//!
//! ```text
//! <vg>/np-<id>         volume <id> (active while the store runs)
//! <vg>/np-<id>+new     a create or clone in progress (renamed to np-<id> once the metadata is down)
//! <vg>/np-<id>+del     a delete in progress (its metadata goes next, then the LV)
//! <vg>/nps-<id>        snapshot <id> (a thin snapshot, inactive: LVM's activation skip)
//! <vg>/nps-<id>+new    a snapshot in progress
//! <vg>/nps-<id>+del    a snapshot delete in progress
//! ```
//!
//! `+` cannot appear in a volume id, so no id's names collide with another's. The order is
//! the file backend's: a create makes the LV under its temporary name, writes the metadata,
//! renames the LV; a delete renames the LV away, removes the metadata, then removes the LV;
//! an expansion writes the bigger size first, then extends the LV. [`VolumeStore::with_thin_pool`]
//! finishes or rolls back whatever a crash interrupted, and activates every volume. An LV
//! named like ours that nothing accounts for is an orphan ([`Orphan::LogicalVolume`]),
//! reported, never removed on the store's own judgement.
//!
//! A `+del` or `+new` LV whose `lvremove` failed (the device held open for a moment, say)
//! is a leftover: the delete still succeeds, as a file volume's does when its image cannot
//! be unlinked. The store keeps its name, reports it as an orphan, and removes it when the
//! agent asks ([`VolumeStore::remove_leftover_lvs`], every volume sync), when its id is used
//! again, or at the next start.
//!
//! Capacity: the pool's data size times the configured overprovisioning ratio, less the
//! virtual sizes of the volumes and snapshots in it. While the pool's data or metadata use is
//! at [`POOL_SHORT_PERCENT`] or more, the pool is short: nothing new is offered (available
//! is 0) and the agent reports it (readiness, metric, log).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::snapshots::Snapshot;
use super::{
    Backend, FsType, META_VERSION, Orphan, Result, Source, Volume, VolumeError, VolumeStore, io_err, remove_if_exists,
    snapshots::snapshot_dir, sync_dir, write_meta_unsynced_dir,
};
use crate::sys::loopdev::LoopBinding;
use crate::sys::lvm::{LvmError, PoolStatus, ThinLv, ThinPool};

/// Data or metadata use, in percent, from which a pool counts as running short.
pub const POOL_SHORT_PERCENT: f64 = 90.0;

/// The thin pool of the `lvm` backend, as the agent's config names it.
#[derive(Debug, Clone, PartialEq)]
pub struct ThinPoolConfig {
    pub volume_group: String,
    pub thin_pool: String,
    /// Virtual sizes may add up to this many times the pool's data size (≥ 1).
    pub overprovision_ratio: f64,
}

/// What the pool holds and offers.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolUsage {
    /// `vg/pool`.
    pub pool: String,
    /// The pool's data size.
    pub size_bytes: u64,
    /// `size_bytes` × the overprovisioning ratio.
    pub capacity_bytes: u64,
    /// Virtual sizes of the volumes and snapshots in it (and copies in progress).
    pub provisioned_bytes: u64,
    /// What a new volume may take: 0 while the pool is short.
    pub available_bytes: u64,
    pub data_percent: f64,
    pub metadata_percent: f64,
    /// Data or metadata use at [`POOL_SHORT_PERCENT`] or more.
    pub short: bool,
}

/// What a new volume or growth is weighed against. A pool's state is read before the
/// store's index lock is taken: `lvs` takes tens of milliseconds, and every other store call
/// waits on that lock.
pub(super) enum Room {
    File,
    Pool(PoolStatus),
}

pub(super) struct Lvm {
    pool: ThinPool,
    ratio: f64,
    /// The last usage read (for metrics, which must not run `lvs`).
    last: std::sync::Mutex<Option<PoolUsage>>,
    /// LVs the store failed to remove: see the module docs.
    leftovers: std::sync::Mutex<BTreeSet<String>>,
}

impl Lvm {
    /// The pool's usage, with `provisioned` bytes spent on it.
    pub(super) fn usage(&self, provisioned: u64) -> Result<PoolUsage, LvmError> {
        Ok(self.record(&self.pool.status()?, provisioned))
    }

    /// The usage of a pool in state `st` with `provisioned` bytes spent on it, kept as the
    /// last one read.
    pub(super) fn record(&self, st: &PoolStatus, provisioned: u64) -> PoolUsage {
        let u = self.usage_of(st, provisioned);
        *self.last.lock().unwrap() = Some(u.clone());
        u
    }

    fn usage_of(&self, st: &PoolStatus, provisioned: u64) -> PoolUsage {
        let capacity = (st.size_bytes as f64 * self.ratio) as u64;
        let short = st.data_percent >= POOL_SHORT_PERCENT || st.metadata_percent >= POOL_SHORT_PERCENT;
        PoolUsage {
            pool: self.pool.to_string(),
            size_bytes: st.size_bytes,
            capacity_bytes: capacity,
            provisioned_bytes: provisioned,
            available_bytes: if short { 0 } else { capacity.saturating_sub(provisioned) },
            data_percent: st.data_percent,
            metadata_percent: st.metadata_percent,
            short,
        }
    }
}

fn volume_lv(id: &str) -> String {
    format!("np-{id}")
}
fn creating_lv(id: &str) -> String {
    format!("np-{id}+new")
}
fn deleting_lv(id: &str) -> String {
    format!("np-{id}+del")
}
fn snapshot_lv(id: &str) -> String {
    format!("nps-{id}")
}
fn snapshot_creating_lv(id: &str) -> String {
    format!("nps-{id}+new")
}
fn snapshot_deleting_lv(id: &str) -> String {
    format!("nps-{id}+del")
}

/// What one of our LV names says: (snapshot?, id, suffix "" / "new" / "del").
fn parse_lv(name: &str) -> Option<(bool, &str, &str)> {
    let (snap, rest) = match name.strip_prefix("nps-") {
        Some(r) => (true, r),
        None => (false, name.strip_prefix("np-")?),
    };
    let (id, suffix) = rest.split_once('+').unwrap_or((rest, ""));
    (super::validate_id(id).is_ok() && matches!(suffix, "" | "new" | "del")).then_some((snap, id, suffix))
}

/// The store lock an LV named `name` is changed under (its volume's or its snapshot's).
fn lock_key(name: &str) -> Option<String> {
    parse_lv(name).map(|(snap, id, _)| if snap { format!("snapshot/{id}") } else { id.to_string() })
}

pub(super) fn lvm_err(id: &str, source: LvmError) -> VolumeError {
    match source {
        LvmError::InUse { lv, stderr } => VolumeError::Busy { id: id.to_string(), reason: format!("{lv}: {stderr}") },
        source => VolumeError::Lvm { id: id.to_string(), source },
    }
}

/// The binding [`VolumeStore::bindings`] reports for an active LV: the LV itself, read-write.
pub(super) fn lv_binding(device: &Path) -> LoopBinding {
    LoopBinding {
        device: device.to_path_buf(),
        number: u32::MAX,
        backing_file: device.to_path_buf(),
        deleted: false,
        read_only: false,
    }
}

impl VolumeStore {
    /// Give the store the `lvm` backend: the thin pool `cfg` names. Checks the pool is
    /// there, finishes or rolls back what a crash interrupted (see the module docs) and
    /// activates every volume of the pool.
    pub fn with_thin_pool(mut self, cfg: ThinPoolConfig) -> Result<Self> {
        let pool = ThinPool::new(&cfg.volume_group, &cfg.thin_pool);
        let id = format!("thin pool {pool}");
        if !(cfg.overprovision_ratio >= 1.0 && cfg.overprovision_ratio.is_finite()) {
            return Err(VolumeError::Backend {
                id,
                reason: format!("overprovisioning ratio {} (want a number ≥ 1)", cfg.overprovision_ratio),
            });
        }
        pool.status().map_err(|e| lvm_err(&id, e))?;
        self.lvm =
            Some(Lvm { pool, ratio: cfg.overprovision_ratio, last: Default::default(), leftovers: Default::default() });
        self.recover_lvs()?;
        let u = self.pool_usage()?.expect("just set");
        tracing::info!(pool = %u.pool, size = u.size_bytes, capacity = u.capacity_bytes, provisioned = u.provisioned_bytes, data_percent = u.data_percent, metadata_percent = u.metadata_percent, "lvm thin pool ready");
        Ok(self)
    }

    /// The pool's usage; `None` without a pool.
    pub fn pool_usage(&self) -> Result<Option<PoolUsage>> {
        let Some(lvm) = &self.lvm else { return Ok(None) };
        let provisioned = self.index.lock().unwrap().provisioned(Backend::Lvm);
        lvm.usage(provisioned).map(Some).map_err(|e| lvm_err(&lvm.pool.to_string(), e))
    }

    /// The pool's usage as last read (by [`Self::pool_usage`], a create or an expansion);
    /// reads nothing.
    pub fn last_pool_usage(&self) -> Option<PoolUsage> {
        self.lvm.as_ref().and_then(|l| l.last.lock().unwrap().clone())
    }

    pub(super) fn lvm(&self, id: &str) -> Result<&Lvm> {
        self.lvm.as_ref().ok_or_else(|| VolumeError::Backend {
            id: id.to_string(),
            reason: "the lvm backend is not configured on this node (csi.lvm in the agent's config)".to_string(),
        })
    }

    /// What a request on `backend` is weighed against ([`Room`]).
    pub(super) fn room(&self, id: &str, backend: Backend) -> Result<Room> {
        match backend {
            Backend::File => Ok(Room::File),
            Backend::Lvm => self.pool(id)?.status().map(Room::Pool).map_err(|e| lvm_err(id, e)),
        }
    }

    fn pool(&self, id: &str) -> Result<&ThinPool> {
        self.lvm(id).map(|l| &l.pool)
    }

    /// Create volume `id` as a thin LV (capacity checked by the reservation).
    pub(super) fn create_lv(&self, id: &str, size: u64, fs_type: FsType, name: &str) -> Result<Volume> {
        let pool = self.pool(id)?;
        let _r = self.reserve(id, Backend::Lvm, size)?;
        let tmp = creating_lv(id);
        self.clear_leftover(id, &tmp)?;
        pool.create(&tmp, size).map_err(|e| lvm_err(id, e))?;
        crate::util::crash_point("lvm-create-after-lvcreate");
        let vol = self.finish_lv(id, &tmp, Volume::new(id, size, fs_type, name, pool.device(&volume_lv(id))))?;
        tracing::info!(volume = id, size, fs = fs_type.as_str(), pool = %pool, "volume created");
        Ok(vol)
    }

    /// Volume `vol`'s LV is complete under the temporary name `tmp`: write its metadata,
    /// rename it into place, index it. On failure the LV and metadata go.
    fn finish_lv(&self, id: &str, tmp: &str, mut vol: Volume) -> Result<Volume> {
        let pool = self.pool(id)?;
        vol.backend = Backend::Lvm;
        let meta_path = self.meta_path(id);
        let result = write_meta_unsynced_dir(&meta_path, &vol).and_then(|()| sync_dir(&self.dir)).and_then(|()| {
            crate::util::crash_point("lvm-create-after-meta");
            pool.rename(tmp, &volume_lv(id)).map_err(|e| lvm_err(id, e))
        });
        if let Err(e) = result {
            let _ = remove_if_exists(&meta_path).and_then(|()| sync_dir(&self.dir));
            self.remove_or_keep(tmp);
            return Err(e);
        }
        self.index.lock().unwrap().volumes.insert(id.to_string(), vol.clone());
        Ok(vol)
    }

    /// Delete volume `vol`'s LV (the caller holds its lock). Refused while it is open.
    pub(super) fn delete_lv(&self, vol: &Volume) -> Result<()> {
        let id = vol.id.as_str();
        let pool = self.pool(id)?;
        match pool.get(&volume_lv(id)).map_err(|e| lvm_err(id, e))? {
            Some(lv) if lv.open => {
                return Err(VolumeError::Busy {
                    id: id.to_string(),
                    reason: format!("{} is open", vol.path.display()),
                });
            }
            Some(_) => {
                self.clear_leftover(id, &deleting_lv(id))?;
                pool.rename(&volume_lv(id), &deleting_lv(id)).map_err(|e| lvm_err(id, e))?;
            }
            None => {}
        }
        remove_if_exists(&self.meta_path(id))?;
        sync_dir(&self.dir)?;
        self.index.lock().unwrap().volumes.remove(id);
        crate::util::crash_point("lvm-delete-after-meta");
        self.remove_or_keep(&deleting_lv(id));
        tracing::info!(volume = id, "volume deleted");
        Ok(())
    }

    /// Grow volume `vol` to `size` (the caller holds its lock): the metadata first, then the
    /// LV. Read-only loop devices over it grow with it.
    pub(super) fn expand_lv(&self, vol: Volume, size: u64) -> Result<Volume> {
        let id = vol.id.clone();
        let pool = self.pool(&id)?;
        if size < vol.size_bytes {
            return Err(VolumeError::Shrink { id, current: vol.size_bytes, requested: size });
        }
        let lv = pool.get(&volume_lv(&id)).map_err(|e| lvm_err(&id, e))?;
        let Some(lv) = lv else { return Err(VolumeError::BackingFileMissing { id, path: vol.path }) };
        let mut grown = vol.clone();
        if size > vol.size_bytes {
            let room = self.room(&id, Backend::Lvm)?;
            let idx = self.index.lock().unwrap();
            self.check_fits(&idx, &id, &room, size - vol.size_bytes)?;
            grown.size_bytes = size;
            write_meta_unsynced_dir(&self.meta_path(&id), &grown)?;
            sync_dir(&self.dir)?;
            drop(idx);
            self.index.lock().unwrap().volumes.insert(id.clone(), grown.clone());
            crate::util::crash_point("lvm-expand-after-meta");
        }
        if lv.size_bytes < grown.size_bytes {
            pool.extend(&lv.name, grown.size_bytes).map_err(|e| lvm_err(&id, e))?;
            tracing::info!(volume = %id, size = grown.size_bytes, "volume LV grown");
        }
        // The read-only loop devices over the LV.
        if let Ok(m) = std::fs::metadata(&grown.path) {
            self.grow_loops(&grown, &m)?;
        }
        Ok(grown)
    }

    /// [`VolumeError::Busy`] while volume `vol`'s LV is open: mounted, or held by another
    /// process (the caller holds its lock). The LV stays active either way; this is the
    /// refusal a file volume's detach gives, which unstage relies on to find a mount of the
    /// volume that no record names. Without a pool configured: nothing to check.
    pub(super) fn check_lv_released(&self, vol: &Volume) -> Result<()> {
        let id = vol.id.as_str();
        let Ok(pool) = self.pool(id) else { return Ok(()) };
        match pool.get(&volume_lv(id)).map_err(|e| lvm_err(id, e))? {
            Some(lv) if lv.open => {
                let table =
                    crate::sys::mount::mount_table().map_err(io_err("reading the mount table of", &vol.path))?;
                let mounted = crate::sys::mount::dev_numbers(&vol.path)
                    .is_ok_and(|(major, minor)| !crate::sys::mount::mount_points_of(&table, major, minor).is_empty());
                let how = if mounted { "is mounted" } else { "is open by another process" };
                Err(VolumeError::Busy { id: id.to_string(), reason: format!("{} {how}", vol.path.display()) })
            }
            _ => Ok(()),
        }
    }

    /// Volume `vol`'s device, activating its LV when it is not (the caller holds its lock).
    pub(super) fn activate_lv(&self, vol: &Volume) -> Result<PathBuf> {
        let id = vol.id.as_str();
        if !vol.path.exists() {
            self.pool(id)?.activate(&volume_lv(id)).map_err(|e| lvm_err(id, e))?;
            tracing::info!(volume = id, device = %vol.path.display(), "volume LV activated");
        }
        Ok(vol.path.clone())
    }

    /// Snapshot `id` of volume `vol` as a thin snapshot (capacity reserved by the caller).
    pub(super) fn snapshot_lv(&self, id: &str, vol: &Volume, name: &str) -> Result<Snapshot> {
        let pool = self.pool(id)?;
        let tmp = snapshot_creating_lv(id);
        self.clear_leftover(id, &tmp)?;
        pool.snapshot(&volume_lv(&vol.id), &tmp, false).map_err(|e| lvm_err(id, e))?;
        crate::util::crash_point("lvm-snapshot-after-lvcreate");
        let sdir = snapshot_dir(&self.dir);
        let meta_path = sdir.join(format!("{id}.json"));
        let snap = Snapshot {
            version: META_VERSION,
            id: id.to_string(),
            source_volume: vol.id.clone(),
            size_bytes: vol.size_bytes,
            fs_type: vol.fs_type,
            created_at: crate::util::unix_secs(),
            name: name.to_string(),
            method: "thin-snapshot".to_string(),
            bytes_copied: 0,
            backend: Backend::Lvm,
            controller_store: String::new(),
            path: pool.device(&snapshot_lv(id)),
        };
        let result = super::snapshots::write_json(&meta_path, &snap).and_then(|()| {
            crate::util::crash_point("lvm-snapshot-after-meta");
            pool.rename(&tmp, &snapshot_lv(id)).map_err(|e| lvm_err(id, e))
        });
        if let Err(e) = result {
            let _ = remove_if_exists(&meta_path).and_then(|()| sync_dir(&sdir));
            self.remove_or_keep(&tmp);
            return Err(e);
        }
        self.index.lock().unwrap().snapshots.insert(id.to_string(), snap.clone());
        tracing::info!(snapshot = id, volume = %vol.id, size = snap.size_bytes, pool = %pool, "thin snapshot taken");
        Ok(snap)
    }

    /// Delete thin snapshot `s` (the caller holds its lock).
    pub(super) fn delete_snapshot_lv(&self, s: &Snapshot) -> Result<()> {
        let id = s.id.as_str();
        let pool = self.pool(id)?;
        if pool.get(&snapshot_lv(id)).map_err(|e| lvm_err(id, e))?.is_some() {
            self.clear_leftover(id, &snapshot_deleting_lv(id))?;
            pool.rename(&snapshot_lv(id), &snapshot_deleting_lv(id)).map_err(|e| lvm_err(id, e))?;
        }
        self.index.lock().unwrap().snapshots.remove(id);
        let sdir = snapshot_dir(&self.dir);
        remove_if_exists(&sdir.join(format!("{id}.json")))?;
        sync_dir(&sdir)?;
        self.remove_or_keep(&snapshot_deleting_lv(id));
        tracing::info!(snapshot = id, "snapshot deleted");
        Ok(())
    }

    /// Volume `id` as a writable thin snapshot of `source`, grown to `size` (capacity
    /// reserved and the volume locked by the caller).
    pub(super) fn clone_lv(&self, id: &str, size: u64, fs_type: FsType, name: &str, source: &Source) -> Result<Volume> {
        let pool = self.pool(id)?;
        let origin = match source {
            Source::Snapshot(s) => snapshot_lv(s),
            Source::Volume(v) => volume_lv(v),
        };
        let tmp = creating_lv(id);
        self.clear_leftover(id, &tmp)?;
        pool.snapshot(&origin, &tmp, true).map_err(|e| lvm_err(id, e))?;
        let grown = pool.get(&tmp).map_err(|e| lvm_err(id, e))?.is_some_and(|lv| lv.size_bytes >= size);
        if !grown && let Err(e) = pool.extend(&tmp, size) {
            self.remove_or_keep(&tmp);
            return Err(lvm_err(id, e));
        }
        crate::util::crash_point("lvm-clone-after-lvcreate");
        let vol = self.finish_lv(id, &tmp, Volume::new(id, size, fs_type, name, pool.device(&volume_lv(id))))?;
        tracing::info!(volume = id, size, from = %source, pool = %pool, "volume created from a thin snapshot");
        Ok(vol)
    }

    /// LVs named like ours that no volume or snapshot accounts for (none without a pool).
    pub(super) fn orphan_lvs(&self) -> Result<Vec<Orphan>> {
        let Some(lvm) = &self.lvm else { return Ok(Vec::new()) };
        let lvs = lvm.pool.list().map_err(|e| lvm_err(&lvm.pool.to_string(), e))?;
        let leftovers = lvm.leftovers.lock().unwrap().clone();
        let idx = self.index.lock().unwrap();
        Ok(lvs
            .into_iter()
            .filter(|lv| match parse_lv(&lv.name) {
                Some((false, id, "")) => idx.volumes.get(id).is_none_or(|v| v.backend != Backend::Lvm),
                Some((true, id, "")) => idx.snapshots.get(id).is_none_or(|s| s.backend != Backend::Lvm),
                // In progress: a create, snapshot or delete holds it (or `open` finishes it),
                // unless its removal failed.
                Some(_) => leftovers.contains(&lv.name),
                None => false,
            })
            .map(|lv| Orphan::LogicalVolume { name: lv.name })
            .collect())
    }

    /// Remove orphan LV `name` (`doctor --repair`): only one [`Self::orphan_lvs`] reports,
    /// and not while it is open. Its id's lock is held: a create of that id is not racing.
    pub fn remove_orphan_lv(&self, name: &str) -> Result<()> {
        let not_orphan = || VolumeError::Busy { id: name.to_string(), reason: "not an orphan LV".to_string() };
        let lock = self.volume_lock(&lock_key(name).ok_or_else(not_orphan)?);
        let _g = lock.lock().unwrap();
        if !self.orphan_lvs()?.contains(&Orphan::LogicalVolume { name: name.to_string() }) {
            return Err(not_orphan());
        }
        if let Some(meta) = self.metadata_of_lv(name).filter(|m| m.exists()) {
            let reason = format!("its metadata {} is there but unreadable: move it away first", meta.display());
            return Err(VolumeError::Busy { id: name.to_string(), reason });
        }
        let lvm = self.lvm(name)?;
        lvm.pool.remove(name).map_err(|e| lvm_err(name, e))?;
        lvm.leftovers.lock().unwrap().remove(name);
        tracing::warn!(lv = name, pool = %lvm.pool, "removed an orphan LV");
        Ok(())
    }

    /// Where the metadata of the volume or snapshot LV `name` is kept.
    fn metadata_of_lv(&self, name: &str) -> Option<PathBuf> {
        let (snap, id, _) = parse_lv(name)?;
        Some(if snap { snapshot_dir(&self.dir).join(format!("{id}.json")) } else { self.meta_path(id) })
    }

    /// Remove LV `name`; when that fails, keep it as a leftover (see the module docs).
    fn remove_or_keep(&self, name: &str) {
        let Some(lvm) = &self.lvm else { return };
        if let Err(e) = lvm.pool.remove(name) {
            tracing::warn!(lv = name, pool = %lvm.pool, error = %e, "could not remove the LV; kept to remove later");
            lvm.leftovers.lock().unwrap().insert(name.to_string());
        }
    }

    /// Remove leftover `name` before its id uses the name again (the caller holds the lock).
    fn clear_leftover(&self, id: &str, name: &str) -> Result<()> {
        let lvm = self.lvm(id)?;
        if lvm.leftovers.lock().unwrap().contains(name) {
            lvm.pool.remove(name).map_err(|e| lvm_err(id, e))?;
            lvm.leftovers.lock().unwrap().remove(name);
            tracing::info!(lv = name, pool = %lvm.pool, "removed a leftover LV");
        }
        Ok(())
    }

    /// Try again to remove the LVs a failed `lvremove` left (those whose id is not busy).
    pub fn remove_leftover_lvs(&self) {
        let Some(lvm) = &self.lvm else { return };
        let names: Vec<String> = lvm.leftovers.lock().unwrap().iter().cloned().collect();
        for name in names {
            let lock = self.volume_lock(&lock_key(&name).expect("our own name"));
            let Ok(_g) = lock.try_lock() else { continue };
            let _ = self.clear_leftover(&name, &name);
        }
    }

    /// Finish or roll back what a crash interrupted in the pool; activate every volume.
    fn recover_lvs(&mut self) -> Result<()> {
        let pool = self.lvm.as_ref().expect("set by the caller").pool.clone();
        let perr = |e| lvm_err(&pool.to_string(), e);
        let lvs = pool.list().map_err(perr)?;
        let sdir = snapshot_dir(&self.dir);
        let mut idx = self.index.lock().unwrap();
        for lv in &lvs {
            let Some((snap, id, suffix)) = parse_lv(&lv.name) else { continue };
            match (snap, suffix) {
                // The name's own LV there too: the `+del` is a failed removal from before the
                // id was created again, not this volume's delete.
                (false, "del") if lvs.iter().any(|l| l.name == volume_lv(id)) => self.remove_or_keep(&lv.name),
                (true, "del") if lvs.iter().any(|l| l.name == snapshot_lv(id)) => self.remove_or_keep(&lv.name),
                (false, "del") => {
                    tracing::info!(volume = id, "finishing an interrupted delete");
                    remove_if_exists(&self.dir.join(format!("{id}.json")))?;
                    idx.volumes.remove(id);
                    self.remove_or_keep(&lv.name);
                }
                (true, "del") => {
                    tracing::info!(snapshot = id, "finishing an interrupted snapshot delete");
                    remove_if_exists(&sdir.join(format!("{id}.json")))?;
                    idx.snapshots.remove(id);
                    self.remove_or_keep(&lv.name);
                }
                (false, "new") => {
                    let known = idx.volumes.get(id).is_some_and(|v| v.backend == Backend::Lvm);
                    if known && !lvs.iter().any(|l| l.name == volume_lv(id)) {
                        tracing::info!(volume = id, "finishing an interrupted create");
                        pool.rename(&lv.name, &volume_lv(id)).map_err(perr)?;
                    } else {
                        tracing::info!(volume = id, "rolling back an interrupted create");
                        self.remove_or_keep(&lv.name);
                    }
                }
                (true, "new") => {
                    let known = idx.snapshots.get(id).is_some_and(|s| s.backend == Backend::Lvm);
                    if known && !lvs.iter().any(|l| l.name == snapshot_lv(id)) {
                        tracing::info!(snapshot = id, "finishing an interrupted snapshot");
                        pool.rename(&lv.name, &snapshot_lv(id)).map_err(perr)?;
                    } else {
                        tracing::info!(snapshot = id, "removing an unfinished snapshot");
                        self.remove_or_keep(&lv.name);
                    }
                }
                _ => {}
            }
        }
        sync_dir(&self.dir)?;
        sync_dir(&sdir)?;
        let lvs = pool.list().map_err(perr)?;
        let find = |name: &str| lvs.iter().find(|l| l.name == name);
        for v in idx.volumes.values_mut().filter(|v| v.backend == Backend::Lvm) {
            v.path = pool.device(&volume_lv(&v.id));
            let Some(lv) = find(&volume_lv(&v.id)) else {
                tracing::error!(volume = %v.id, pool = %pool, "the volume's LV is missing");
                continue;
            };
            // One volume that cannot be finished or activated fails its own stage, not the
            // agent: the node's network and its other volumes are served.
            if let Err(e) = recover_volume_lv(&pool, v, lv) {
                tracing::error!(volume = %v.id, pool = %pool, error = %e, "could not recover the volume's LV");
            }
        }
        idx.snapshots.retain(|id, s| {
            if s.backend != Backend::Lvm {
                return true;
            }
            s.path = pool.device(&snapshot_lv(id));
            let there = find(&snapshot_lv(id)).is_some();
            if !there {
                tracing::error!(snapshot = %id, pool = %pool, "the snapshot's LV is missing; not offering it");
            }
            there
        });
        Ok(())
    }
}

/// Activate volume `v`'s LV and finish an interrupted expansion.
fn recover_volume_lv(pool: &ThinPool, v: &Volume, lv: &ThinLv) -> Result<()> {
    let err = |e| lvm_err(&v.id, e);
    if lv.size_bytes < v.size_bytes {
        tracing::info!(volume = %v.id, from = lv.size_bytes, to = v.size_bytes, "finishing an interrupted expansion");
        pool.extend(&lv.name, v.size_bytes).map_err(err)?;
    }
    if !lv.active {
        pool.activate(&lv.name).map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lv_names_parse_back_and_never_collide() {
        assert_eq!(parse_lv(&volume_lv("pvc-1")), Some((false, "pvc-1", "")));
        assert_eq!(parse_lv(&creating_lv("a.new")), Some((false, "a.new", "new")));
        assert_eq!(parse_lv(&deleting_lv("x")), Some((false, "x", "del")));
        assert_eq!(parse_lv(&snapshot_lv("s")), Some((true, "s", "")));
        assert_eq!(parse_lv(&snapshot_creating_lv("s")), Some((true, "s", "new")));
        assert_eq!(parse_lv(&snapshot_deleting_lv("s")), Some((true, "s", "del")));
        // A volume whose id ends like a temporary name is still a volume.
        assert_ne!(volume_lv("a.new"), creating_lv("a"));
        assert_eq!(parse_lv("pool"), None);
        assert_eq!(parse_lv("np-UPPER"), None);
        assert_eq!(parse_lv("np-a+old"), None);
    }
}
