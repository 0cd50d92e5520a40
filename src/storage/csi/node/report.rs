//! What the node holds: the counts behind the agent's metrics, the start-up recovery, and
//! `nodeplane status` and `nodeplane doctor` (storage orphans and their repairs).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use super::mounts::LoopDev;
use super::records::{PublishRecord, StageState};
use super::{NodeService, Result, internal, io_internal};
use crate::obs::doctor::{Finding, Repair};
use crate::rpc::node as api;
use crate::sys::mount::{self, MountEntry};
use crate::sys::volume_kernel::VolumeKernel;
use crate::sys::{crypt, loopdev};

/// What the records say is staged and published (cheap: two small directories).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MountCounts {
    /// Volumes staged (`staged` records).
    pub staged: usize,
    /// Stages in progress or interrupted (`staging` records).
    pub staging: usize,
    /// Published target paths.
    pub published: usize,
}

impl NodeService {
    /// Staged and published volumes, from the records (which are written before the kernel
    /// state they describe and removed after it is undone).
    pub fn mount_counts(&self) -> MountCounts {
        let stages = self.stage_records();
        MountCounts {
            staged: stages.iter().filter(|r| r.state == StageState::Staged).count(),
            staging: stages.iter().filter(|r| r.state == StageState::Staging).count(),
            published: self.publish_records().len(),
        }
    }

    /// Rebuild from the records, the mount table and the loop table: roll back stages a
    /// crash interrupted before their mount, drop publish records whose target is gone,
    /// detach loop devices of volumes that no stage accounts for. Marks the service ready.
    pub fn recover(&self) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let table = self.table()?;
        let stages = self.stage_records();
        let mut staged_ids = HashSet::new();
        for r in &stages {
            let devices = self.volume_devices(&r.volume_id).unwrap_or_default();
            let mounted = mount::mounts_at(&table, &r.staging_path).iter().any(|m| self.is_volume_mount(m, &devices));
            if r.state == StageState::Staging && !mounted {
                let published = table.iter().any(|m| self.is_volume_mount(m, &devices));
                if !published && let Err(e) = self.lock(&r.volume_id) {
                    tracing::warn!(volume = %r.volume_id, error = %e, "rolling back an interrupted stage: closing its mapping failed; keeping its record for unstage or a retry");
                    staged_ids.insert(r.volume_id.clone());
                    continue;
                }
                if !published && let Err(e) = self.store.detach(&r.volume_id) {
                    // Keep the record: it is what lets NodeUnstage (or the retried stage)
                    // find and detach the device once whatever holds it lets go. Without
                    // it, unstage would answer "not staged here" and the device would leak.
                    tracing::warn!(volume = %r.volume_id, error = %e, "rolling back an interrupted stage: detach failed; keeping its record for unstage or a retry");
                    staged_ids.insert(r.volume_id.clone());
                    continue;
                }
                self.remove_record(&self.stage_record_path(&r.volume_id))?;
                tracing::info!(volume = %r.volume_id, staging = %r.staging_path.display(), "rolled back an interrupted stage");
                report.rolled_back_stages += 1;
                continue;
            }
            staged_ids.insert(r.volume_id.clone());
            report.staged += 1;
        }
        report.closed_mappings = self.close_stray_mappings(&table, &staged_ids);
        for r in self.publish_records() {
            let devices = self.volume_devices(&r.volume_id).unwrap_or_default();
            let mounted = mount::mounts_at(&table, &r.target_path).iter().any(|m| self.is_volume_mount(m, &devices));
            if !mounted && !r.target_path.exists() {
                self.remove_publish(&r.target_path)?;
                report.dropped_publish_records += 1;
            } else {
                // Mounted, or the target exists unmounted (interrupted publish or reboot):
                // kubelet's retry or unpublish settles it.
                report.published += 1;
            }
        }
        for v in self.store.list() {
            if staged_ids.contains(&v.id) {
                continue;
            }
            let devices = self.volume_devices(&v.id).unwrap_or_default();
            if devices.is_empty() || table.iter().any(|m| self.is_volume_mount(m, &devices)) {
                continue;
            }
            match self.store.detach(&v.id) {
                Ok(()) => {
                    tracing::info!(volume = %v.id, "detached a loop device no stage accounts for");
                    report.detached += 1;
                }
                Err(e) => tracing::warn!(volume = %v.id, error = %e, "could not detach an unaccounted loop device"),
            }
        }
        match self.store.orphans() {
            Ok(o) => {
                for orphan in &o {
                    tracing::warn!(?orphan, "volume store orphan");
                }
                report.orphans = o.len();
            }
            Err(e) => tracing::warn!(error = %e, "listing volume store orphans"),
        }
        self.ready.store(true, Ordering::SeqCst);
        Ok(report)
    }

    /// Close the mappings of this store's volumes that no stage accounts for, unless
    /// mounted or otherwise open (cryptsetup refuses to close a mapping in use); returns
    /// how many. Only this store's volumes: a mapping named `npc-*` on another device is
    /// someone else's (the doctor reports it).
    fn close_stray_mappings(&self, table: &[MountEntry], staged_ids: &HashSet<String>) -> usize {
        let mut closed = 0;
        for v in self.store.list().into_iter().filter(|v| !staged_ids.contains(&v.id)) {
            let m = match self.kernel.crypt_mapping(&crypt::mapping_name(&v.id)) {
                Ok(Some(m)) => m,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(volume = %v.id, error = %e, "looking for the volume's dm-crypt mapping");
                    continue;
                }
            };
            let ours = self
                .store
                .bindings(&v.id)
                .unwrap_or_default()
                .iter()
                .any(|b| self.kernel.dev_numbers(&b.device).is_ok_and(|n| n == m.backing_num));
            if !ours {
                tracing::warn!(volume = %v.id, mapping = %m.name, backing = %m.backing.display(), "a mapping named for the volume is open on another device; leaving it");
                continue;
            }
            let dev = [LoopDev { path: m.path.clone(), num: m.num, ro: false, mapping: true }];
            if let Some(at) = table.iter().find(|e| self.is_volume_mount(e, &dev)) {
                tracing::warn!(volume = %v.id, mapping = %m.name, mounted_at = %at.mount_point.display(), "the mapping of a volume no stage accounts for is mounted; leaving it");
                continue;
            }
            match self.kernel.crypt_close(&m.name) {
                Ok(()) => {
                    tracing::info!(volume = %v.id, mapping = %m.name, "closed a mapping no stage accounts for");
                    closed += 1;
                }
                Err(e) => {
                    tracing::warn!(volume = %v.id, mapping = %m.name, error = %e, "could not close a mapping no stage accounts for")
                }
            }
        }
        closed
    }
}

/// What [`NodeService::recover`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    pub staged: usize,
    pub published: usize,
    pub rolled_back_stages: usize,
    pub dropped_publish_records: usize,
    pub detached: usize,
    pub orphans: usize,
    /// `npc-*` mappings of volumes not staged, closed.
    pub closed_mappings: usize,
}

// ----- status and doctor (`nodeplane status`, `nodeplane doctor`) -----

/// Orphan kinds the CSI side reports.
pub const MOUNT_WITHOUT_VOLUME: &str = "mount-without-volume";
pub const LOOP_WITHOUT_FILE: &str = "loop-device-without-file";
pub const LOOP_WITHOUT_USER: &str = "loop-device-without-user";
pub const FILE_WITHOUT_VOLUME: &str = "backing-file-without-volume";
pub const VOLUME_WITHOUT_FILE: &str = "volume-without-backing-file";
pub const LV_WITHOUT_VOLUME: &str = "logical-volume-without-volume";
pub const MAPPING_WITHOUT_STAGE: &str = "crypt-mapping-without-stage";

/// A loop device bound to a file in the volume directory.
struct StoreLoop {
    binding: loopdev::LoopBinding,
    num: (u32, u32),
    /// The volume the file is the image of, when its metadata exists and it is that image.
    volume: Option<String>,
    /// The backing file's (device, inode) as the loop device reported them when listed.
    file: Option<(u64, u64)>,
}

impl NodeService {
    fn store_loops(&self) -> Result<Vec<StoreLoop>> {
        let bindings = self.kernel.loop_bound_devices().map_err(io_internal("listing loop devices".into()))?;
        let mut out = Vec::new();
        for b in bindings {
            if b.backing_file.parent() != Some(self.store.dir()) {
                continue;
            }
            let Ok(num) = self.kernel.dev_numbers(&b.device) else { continue };
            let volume = b
                .backing_file
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".img"))
                .filter(|id| !b.deleted && self.store.get(id).ok().flatten().is_some())
                .map(str::to_string);
            let file = self.kernel.loop_status(&b.device).ok().map(|i| (i.lo_device, i.lo_inode));
            out.push(StoreLoop { binding: b, num, volume, file });
        }
        Ok(out)
    }

    /// Where `l` is mounted: its filesystem (by device number), or its device node
    /// bind-mounted for raw block access.
    fn mounts_of(&self, table: &[MountEntry], l: &StoreLoop) -> Vec<PathBuf> {
        self.volume_mounts(table, l).into_iter().map(|m| m.mount_point.clone()).collect()
    }

    fn volume_mounts<'a>(&self, table: &'a [MountEntry], l: &StoreLoop) -> Vec<&'a MountEntry> {
        let dev = [LoopDev { path: l.binding.device.clone(), num: l.num, ro: l.binding.read_only, mapping: false }];
        table.iter().filter(|m| self.is_volume_mount(m, &dev)).collect()
    }

    /// A mount of a volume's device that no record accounts for. A bind mount of a directory
    /// inside the volume (kubelet's subPath mounts) belongs to its pod and is left out; a
    /// mount outside the kubelet dir is reported but never removed (an operator made it).
    fn orphan_mount(&self, m: &MountEntry, l: &StoreLoop, detail: String, repair: bool) -> Option<Finding> {
        if (m.major, m.minor) == l.num && m.root != Path::new("/") {
            return None;
        }
        let mut f = Finding::new(MOUNT_WITHOUT_VOLUME, m.mount_point.display().to_string(), detail);
        if repair {
            f.repair = Some(if m.mount_point.starts_with(&self.settings.kubelet_dir) {
                unmount_repair(&*self.kernel, &m.mount_point)
            } else {
                Repair::Skipped("outside the kubelet dir: not made by kubelet or nodeplane; unmount it by hand".into())
            });
        }
        Some(f)
    }

    /// Volumes, what is staged and published, and the loop devices and mounts behind them.
    pub fn report(&self) -> api::StorageStatus {
        let table = self.table().unwrap_or_default();
        let loops = self.store_loops().unwrap_or_default();
        let stages = self.stage_records();
        let publishes = self.publish_records();
        let mut volumes = Vec::new();
        for v in self.store.list() {
            let mine: Vec<&StoreLoop> = loops.iter().filter(|l| l.volume.as_deref() == Some(v.id.as_str())).collect();
            let stage = stages.iter().find(|r| r.volume_id == v.id);
            volumes.push(api::VolumeStatus {
                id: v.id.clone(),
                name: v.name.clone(),
                size_bytes: v.size_bytes,
                fs_type: v.fs_type.as_str().to_string(),
                backing_file: v.path.display().to_string(),
                backing_file_present: v.path.exists(),
                loop_devices: mine
                    .iter()
                    .map(|l| api::LoopDevice {
                        device: l.binding.device.display().to_string(),
                        mounted_at: self.mounts_of(&table, l).iter().map(|p| p.display().to_string()).collect(),
                    })
                    .collect(),
                staged: stage.map(|r| api::Stage {
                    path: r.staging_path.display().to_string(),
                    state: match r.state {
                        StageState::Staged => api::StageState::Staged,
                        StageState::Staging => api::StageState::Staging,
                    } as i32,
                    mounted: !mount::mounts_at(&table, &r.staging_path).is_empty(),
                }),
                published: publishes
                    .iter()
                    .filter(|p| p.volume_id == v.id)
                    .map(|p| api::Publish {
                        path: p.target_path.display().to_string(),
                        read_only: p.read_only,
                        mounted: !mount::mounts_at(&table, &p.target_path).is_empty(),
                    })
                    .collect(),
            });
        }
        let u = self.store.usage();
        api::StorageStatus {
            ready: self.ready(),
            volume_dir: self.store.dir().display().to_string(),
            capacity_bytes: u.capacity_bytes,
            provisioned_bytes: u.provisioned_bytes,
            available_bytes: u.available_bytes,
            volumes,
        }
    }

    /// Storage orphans (see the `NodeStatus.Doctor` comment in `proto/`). Repairs unmount
    /// mounts no record accounts for and detach loop devices nothing uses; backing files and
    /// metadata are never removed here (they may hold data): they are reported with what the
    /// operator can do.
    pub fn doctor(&self, repair: bool) -> Result<(Vec<Finding>, Vec<String>)> {
        let mut out = self.stray_mappings(repair)?;
        let mut skipped = Vec::new();
        let listed = self.store_loops()?;
        for l in listed.iter().filter(|l| l.volume.is_none()) {
            // Bound to a deleted file, or to a file that is no volume's image.
            let dev = l.binding.device.display().to_string();
            let why = if l.binding.deleted {
                "its backing file was deleted"
            } else {
                "its backing file belongs to no volume"
            };
            for m in self.volume_mounts(&self.table()?, l) {
                out.extend(self.orphan_mount(m, l, format!("{dev} is mounted here; {why}"), repair));
            }
            let mut f =
                Finding::new(LOOP_WITHOUT_FILE, dev, format!("bound to {} ({why})", l.binding.backing_file.display()));
            if repair {
                f.repair = Some(detach_repair(&*self.kernel, l));
            }
            out.push(f);
        }
        // A volume's devices: judged under the volume's guard, with its records, devices and
        // mounts read again under it, so a stage or publish in progress (or finished since
        // the listing) is never mistaken for an orphan.
        let ids: std::collections::BTreeSet<String> = listed.iter().filter_map(|l| l.volume.clone()).collect();
        for id in ids {
            let _g = match self.guard(&id) {
                Ok(g) => g,
                Err(e) => {
                    skipped.push(format!("volume {id}: {}; not checked", e.msg));
                    continue;
                }
            };
            let stage = self.load_stage(&id)?;
            let publishes: Vec<PublishRecord> = self.publishes_of(&id);
            let recorded = stage.is_some() || !publishes.is_empty();
            for l in self.store_loops()?.into_iter().filter(|l| l.volume.as_deref() == Some(id.as_str())) {
                let dev = l.binding.device.display().to_string();
                let table = self.table()?;
                for m in self.volume_mounts(&table, &l) {
                    let p = &m.mount_point;
                    // The device node bind-mounted (not its filesystem): kubelet maps a
                    // published block volume into each pod that way (volumeDevices/…), so
                    // it belongs to the volume while the volume has a record.
                    let device_node = (m.major, m.minor) != l.num;
                    let accounted = stage.as_ref().is_some_and(|r| &r.staging_path == p)
                        || publishes.iter().any(|r| &r.target_path == p)
                        || (device_node && recorded);
                    if !accounted {
                        let detail =
                            format!("{dev} of volume {id} is mounted here, but no stage or publish of the volume is");
                        out.extend(self.orphan_mount(m, &l, detail, repair));
                    }
                }
                if !recorded && self.volume_mounts(&self.table()?, &l).is_empty() {
                    let mut f = Finding::new(
                        LOOP_WITHOUT_USER,
                        dev,
                        format!("bound to volume {id}, which is neither staged nor published"),
                    );
                    if repair {
                        f.repair = Some(detach_repair(&*self.kernel, &l));
                    }
                    out.push(f);
                }
            }
        }
        for o in self.store.orphans().map_err(|e| internal(e.to_string()))? {
            let f = match o {
                crate::storage::store::Orphan::LoopDevice { .. } => continue, // judged above, with its mounts
                crate::storage::store::Orphan::BackingFile { path } => {
                    let mut f = Finding::new(
                        FILE_WITHOUT_VOLUME,
                        path.display().to_string(),
                        "an image file without volume metadata (an interrupted create, or metadata removed by hand)",
                    );
                    if repair {
                        f.repair = Some(Repair::Skipped("it may hold data: move it away or delete it by hand".into()));
                    }
                    f
                }
                crate::storage::store::Orphan::MissingBackingFile { id, path } => {
                    let mut f = Finding::new(VOLUME_WITHOUT_FILE, id, format!("its image {} is gone", path.display()));
                    if repair {
                        f.repair = Some(Repair::Skipped(
                            "the data is lost; the controller reports the volume abnormal: delete the claim".into(),
                        ));
                    }
                    f
                }
                crate::storage::store::Orphan::LogicalVolume { name } => {
                    let mut f = Finding::new(
                        LV_WITHOUT_VOLUME,
                        name.clone(),
                        "a logical volume in the thin pool named like the store's, without volume or snapshot metadata",
                    );
                    if repair {
                        f.repair = Some(match self.store.remove_orphan_lv(&name) {
                            Ok(()) => Repair::Done("removed".into()),
                            Err(e) => Repair::Failed(e.to_string()),
                        });
                    }
                    f
                }
            };
            out.push(f);
        }
        Ok((out, skipped))
    }
}

impl NodeService {
    /// Doctor: the `npc-*` mappings no stage record accounts for. Listed before the records
    /// are read, so a stage in progress (its record is written before its mapping is opened)
    /// is never one; an unstage that closes its mapping meanwhile leaves nothing to repair.
    /// Repair closes the mapping unless it is mounted or open.
    fn stray_mappings(&self, repair: bool) -> Result<Vec<Finding>> {
        let mappings = self.kernel.crypt_mappings().map_err(|e| internal(format!("listing dm-crypt mappings: {e}")))?;
        let staged: HashSet<String> = self.stage_records().iter().map(|r| crypt::mapping_name(&r.volume_id)).collect();
        let table = if mappings.is_empty() { Vec::new() } else { self.table()? };
        let mut out = Vec::new();
        for m in mappings.into_iter().filter(|m| !staged.contains(&m.name)) {
            let dev = [LoopDev { path: m.path.clone(), num: m.num, ro: false, mapping: true }];
            let mounted: Vec<String> = table
                .iter()
                .filter(|e| self.is_volume_mount(e, &dev))
                .map(|e| e.mount_point.display().to_string())
                .collect();
            let detail = format!(
                "dm-crypt mapping of {} without a stage record{}",
                m.backing.display(),
                if mounted.is_empty() { String::new() } else { format!("; mounted at {}", mounted.join(", ")) }
            );
            let mut f = Finding::new(MAPPING_WITHOUT_STAGE, m.name.clone(), detail);
            if repair {
                f.repair = Some(if !mounted.is_empty() {
                    Repair::Skipped("mounted: unmount it first".into())
                } else {
                    match self.kernel.crypt_close(&m.name) {
                        Ok(()) => Repair::Done("closed".into()),
                        Err(e) => Repair::Failed(e.to_string()),
                    }
                });
            }
            out.push(f);
        }
        Ok(out)
    }
}

fn unmount_repair(kernel: &dyn VolumeKernel, path: &Path) -> Repair {
    match kernel.unmount(path) {
        Ok(()) => Repair::Done("unmounted".into()),
        Err(e) => Repair::Failed(format!("unmounting: {e}")),
    }
}

/// Detach a loop device if it is still bound to the file it was bound to when listed (a
/// device number freed and reused meanwhile is left alone).
fn detach_repair(kernel: &dyn VolumeKernel, l: &StoreLoop) -> Repair {
    let Some((st_dev, st_ino)) = l.file else {
        return Repair::Failed("its backing file's identity could not be read when it was listed".into());
    };
    match kernel.loop_detach(&l.binding.device, st_dev, st_ino) {
        Ok(()) => Repair::Done("detached".into()),
        Err(loopdev::DetachError::Busy(m)) => Repair::Failed(format!("busy: {m}")),
        Err(loopdev::DetachError::Io(e)) => Repair::Failed(e.to_string()),
    }
}
