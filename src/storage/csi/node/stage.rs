//! NodeStageVolume and NodeUnstageVolume, and the calls on the path of a staged or published
//! volume: NodeGetVolumeStats and NodeExpandVolume.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use tonic::Code;

use super::encryption::{StageKeys, crypt_error, requested_keys};
use super::records::{StageRecord, StageState};
use super::{
    CsiError, NodeService, Result, check_fits, errno_internal, internal, invalid, io_internal, not_at, not_found,
    parse_capability, precondition, required,
};
use crate::rpc::csi;
use crate::storage::csi::capability::Capability;
use crate::storage::store::{Backend, FsType, VolumeError};
use crate::sys::crypt::CryptError;
use crate::sys::mount::{self, MountOptions};
use crate::sys::volume_kernel::MountError;

impl NodeService {
    pub fn stage(&self, req: &csi::NodeStageVolumeRequest) -> Result<()> {
        // A required field that is missing stays INVALID_ARGUMENT, before NOT_FOUND (also
        // for an id no volume can have).
        required("volume_id", &req.volume_id)?;
        required("staging_target_path", &req.staging_target_path)?;
        if req.volume_capability.is_none() {
            return Err(invalid("volume_capability is required"));
        }
        let id = self.volume_id(&req.volume_id)?;
        self.existing(id)?;
        let staging = self.path("staging_target_path", &req.staging_target_path)?;
        let cap = parse_capability(req.volume_capability.as_ref())?;
        let opts = mount::parse_mount_flags(&cap.mount_flags).map_err(invalid)?;
        let key = requested_keys(req)?;
        let encrypted = key.is_some();
        let _g = self.guard(id)?;
        let vol = self.store.get(id)?.ok_or_else(|| not_found(id))?;
        check_fits(&vol, &cap)?;
        let devices = self.volume_devices(id)?;
        let rec = self.load_stage(id)?;
        if let Some(r) = &rec {
            let mounted_there = self.ours_at(&r.staging_path, &devices)?;
            let staged_there = r.state == StageState::Staged
                && (mounted_there || (r.capability.block && Self::block_staged(r, &devices)));
            if r.staging_path != staging && staged_there {
                return Err(precondition(format!(
                    "volume {id} is already staged at {}; unstage it there first",
                    r.staging_path.display()
                )));
            }
            if r.staging_path == staging && staged_there && !r.same(&cap) {
                return Err(CsiError::new(
                    Code::AlreadyExists,
                    format!("volume {id} is already staged at {} with a different capability", staging.display()),
                ));
            }
            if r.staging_path == staging && staged_there && r.encrypted != encrypted {
                return Err(CsiError::new(
                    Code::AlreadyExists,
                    format!(
                        "volume {id} is already staged at {} {} encryption",
                        staging.display(),
                        if r.encrypted { "with" } else { "without" }
                    ),
                ));
            }
        }
        if let Some(top) = self.top_at(&staging)? {
            if !cap.block
                && self.is_volume_mount(&top, &devices)
                && top.read_only() == opts.flags.contains(nix::mount::MsFlags::MS_RDONLY)
            {
                // Already mounted here (a retry, possibly after a restart): finish the record.
                let mut r = rec.unwrap_or(StageRecord {
                    volume_id: id.to_string(),
                    staging_path: staging.clone(),
                    capability: cap.clone(),
                    state: StageState::Staged,
                    encrypted,
                });
                if r.state != StageState::Staged || r.staging_path != staging {
                    r.state = StageState::Staged;
                    r.staging_path = staging.clone();
                    self.save(&self.stage_record_path(id), &r)?;
                }
                return Ok(());
            }
            return Err(CsiError::new(
                Code::AlreadyExists,
                format!(
                    "{} already has a mount ({} {}) that is not this volume staged as asked",
                    staging.display(),
                    top.fs_type,
                    top.source
                ),
            ));
        }
        if cap.block
            && let Some(r) = &rec
            && r.state == StageState::Staged
            && r.staging_path == staging
            && r.same(&cap)
            && Self::block_staged(r, &devices)
        {
            return Ok(()); // already staged (kubelet repeats NodeStage for every pod)
        }
        let rec_path = self.stage_record_path(id);
        let staging_rec = StageRecord {
            volume_id: id.to_string(),
            staging_path: staging.clone(),
            capability: cap.clone(),
            state: StageState::Staging,
            encrypted,
        };
        self.save(&rec_path, &staging_rec)?;
        crate::util::crash_point("stage-after-record");
        // An LV counts as attached while active, so a mapping this stage opens on it is
        // closed on failure by what `mapped_before` says, not `attached_before`.
        let attached_before = devices.iter().any(|d| !d.ro);
        let mapped_before = devices.iter().any(|d| d.mapping);
        // The final record is part of the work: when it cannot be written (a full state disk,
        // where the first record went into a spare that already had room) the stage is rolled
        // back like any other failure, not left mounted under a "staging" record.
        let result = self
            .stage_work(&vol, &staging, &cap, &opts, key.as_ref())
            .and_then(|()| self.save(&rec_path, &StageRecord { state: StageState::Staged, ..staging_rec }));
        if result.is_err() {
            // Roll back to where we started: nothing mounted, not attached (unless it was).
            if !cap.block {
                let _ = self.unmount_ours(id, &staging);
            }
            if !mapped_before && let Err(e) = self.lock(id) {
                tracing::warn!(volume = id, error = %e, "rolling back a failed stage: closing the mapping failed");
            }
            if !attached_before && let Err(d) = self.store.detach(id) {
                tracing::warn!(volume = id, error = %d, "rolling back a failed stage: detach failed");
            }
            // Back to the record as it was (a staged volume stays staged).
            let _ = match &rec {
                Some(r) if attached_before => self.save(&rec_path, r),
                _ => self.remove_record(&rec_path),
            };
        }
        result
    }

    fn stage_work(
        &self,
        vol: &crate::storage::store::Volume,
        staging: &Path,
        cap: &Capability,
        opts: &MountOptions,
        key: Option<&StageKeys>,
    ) -> Result<()> {
        let id = vol.id.as_str();
        let raw = self.store.attach(id)?;
        crate::util::crash_point("stage-after-attach");
        // Encrypted: everything below works on the mapping. A fresh container's mapping
        // reads as noise (the decryption of whatever the device held), never as data.
        let (dev, fresh) = match key {
            Some(k) => {
                let u = self.unlock(vol, &raw, k)?;
                (u.path, u.fresh)
            }
            None => (raw.clone(), false),
        };
        if cap.block {
            // The pod owns the contents from now on: a later filesystem stage must probe
            // them, not take the container for blank.
            if fresh {
                self.kernel.crypt_mark_formatted(&raw).map_err(|e| crypt_error(id, e))?;
            }
            return Ok(());
        }
        let fs = vol.fs_type;
        let probed = match (key, vol.backend) {
            (Some(_), _) if fresh => None,
            (Some(_), _) | (None, Backend::Lvm) => self.kernel.fs_probe(&dev)?,
            (None, Backend::File) => self.kernel.fs_probe_loop(&dev, &vol.path)?,
        };
        match probed {
            None => {
                tracing::info!(volume = id, device = %dev.display(), fs = fs.as_str(), "blank device: making a filesystem");
                self.kernel.mkfs(&dev, fs)?;
                crate::util::crash_point("stage-after-mkfs");
                if fresh {
                    self.kernel.crypt_mark_formatted(&raw).map_err(|e| crypt_error(id, e))?;
                }
            }
            Some(t) if t == fs.as_str() => {}
            Some(other) => {
                return Err(precondition(format!(
                    "volume {id}: {} holds {other:?}, not {}; refusing to mount or format it",
                    dev.display(),
                    fs.as_str()
                )));
            }
        }
        let dev_size = self.kernel.device_size(&dev).map_err(io_internal(format!("sizing {}", dev.display())))?;
        // ext4 grown while unstaged: grow it now, offline (no CAP_SYS_RESOURCE needed).
        if fs == FsType::Ext4
            && let Some(fs_size) = self.kernel.fs_size(&dev, fs)?
            && fs_size.saturating_add(crate::storage::store::SIZE_ALIGN) <= dev_size
        {
            tracing::info!(volume = id, from = fs_size, to = dev_size, "growing ext4 before mounting");
            self.kernel.grow_fs(&dev, fs)?;
        }
        if !staging.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o750)
                .create(staging)
                .map_err(io_internal(format!("creating {}", staging.display())))?;
        }
        // A restore or clone of an xfs volume carries its source's filesystem UUID, and xfs
        // refuses to mount a second filesystem with a UUID already mounted: `nouuid`, as
        // snapshot-capable local drivers do (ext4 does not care).
        let nouuid;
        let opts = if fs == FsType::Xfs && !opts.data.iter().any(|d| d == "nouuid") {
            nouuid = MountOptions {
                flags: opts.flags,
                data: opts.data.iter().cloned().chain(["nouuid".to_string()]).collect(),
            };
            &nouuid
        } else {
            opts
        };
        self.kernel.mount_device(&dev, &self.settings.kubelet_dir, staging, fs.as_str(), opts).map_err(
            |e| match e {
                MountError::Source(e) | MountError::Target(e) => {
                    invalid(format!("staging_target_path {}: {e}", staging.display()))
                }
                MountError::Mount(e @ nix::errno::Errno::EINVAL) => invalid(format!(
                    "mounting {} ({}) at {} with flags {:?} failed: {e} (a mount flag the filesystem does not accept?)",
                    dev.display(),
                    fs.as_str(),
                    staging.display(),
                    cap.mount_flags
                )),
                MountError::Mount(e) => internal(format!("mounting {} at {}: {e}", dev.display(), staging.display())),
            },
        )?;
        crate::util::crash_point("stage-after-mount");
        if fs == FsType::Xfs
            && !opts.flags.contains(nix::mount::MsFlags::MS_RDONLY)
            && let Some(fs_size) = self.kernel.fs_size(&dev, fs)?
            && fs_size.saturating_add(crate::storage::store::SIZE_ALIGN) <= dev_size
        {
            tracing::info!(volume = id, from = fs_size, to = dev_size, "growing xfs after mounting");
            self.kernel.grow_fs(staging, fs)?;
        }
        tracing::info!(volume = id, device = %dev.display(), staging = %staging.display(), "volume staged");
        Ok(())
    }

    pub fn unstage(&self, req: &csi::NodeUnstageVolumeRequest) -> Result<()> {
        required("volume_id", &req.volume_id)?;
        required("staging_target_path", &req.staging_target_path)?;
        let id = self.volume_id(&req.volume_id)?;
        self.known_or_recorded(id)?;
        let staging = self.path("staging_target_path", &req.staging_target_path)?;
        let _g = self.guard(id)?;
        let known = self.store.get(id)?.is_some();
        let rec = self.load_stage(id)?;
        let devices = self.volume_devices(id)?;
        let ours_here = self.ours_at(&staging, &devices)?;
        let rec_here = rec.as_ref().is_some_and(|r| r.staging_path == staging);
        if !known && !rec_here && !ours_here {
            return Err(not_found(id));
        }
        if !rec_here && !ours_here {
            return Ok(()); // not staged here: nothing to do
        }
        // Still published somewhere? Unstaging under a running workload would pull the
        // volume away from it. The records name the publications the agent made (checked
        // at their own paths).
        let recorded: Vec<String> = self
            .publishes_of(id)
            .into_iter()
            .filter(|r| r.target_path != staging)
            .filter(|r| self.ours_at(&r.target_path, &devices).unwrap_or(true))
            .map(|r| r.target_path.display().to_string())
            .collect();
        if !recorded.is_empty() {
            return Err(precondition(format!(
                "volume {id} is still published at {}; unpublish it first",
                recorded.join(", ")
            )));
        }
        // A mount of the volume no record names (someone else's bind mount of it), read from
        // the mount table before anything is unmounted.
        let publications = self.unrecorded_mounts(&staging, &devices, rec.as_ref())?;
        if !publications.is_empty() {
            return Err(precondition(format!(
                "volume {id} is still published at {}; unpublish it first",
                publications.join(", ")
            )));
        }
        let n = self.unmount_of(id, &staging, &devices)?;
        crate::util::crash_point("unstage-after-unmount");
        let released = match self.lock(id) {
            Ok(()) => self.store.detach(id),
            Err(CryptError::InUse { stderr, .. }) => Err(VolumeError::Busy { id: id.to_string(), reason: stderr }),
            Err(e) => return Err(crypt_error(id, e)),
        };
        match released {
            Err(e @ VolumeError::Busy { .. }) => {
                return Err(precondition(format!("volume {id} unmounted but its device is still in use: {e}")));
            }
            r => r?,
        }
        self.remove_record(&self.stage_record_path(id))?;
        tracing::info!(volume = id, staging = %staging.display(), unmounted = n, "volume unstaged");
        Ok(())
    }
    pub fn stats(&self, req: &csi::NodeGetVolumeStatsRequest) -> Result<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        required("volume_id", &req.volume_id)?;
        required("volume_path", &req.volume_path)?;
        let id = self.volume_id(&req.volume_id)?;
        let vol = self.existing(id)?;
        // Where the volume is, from the agent's own records: any other path (a relative
        // one included) is NOT_FOUND, decided without touching the filesystem.
        let stage = self.load_stage(id)?.filter(|r| r.staging_path == Path::new(&req.volume_path));
        if stage.is_none() && !self.published_at(id, &req.volume_path) {
            return Err(not_at(id, &req.volume_path));
        }
        let path = self.path("volume_path", &req.volume_path)?;
        let devices = self.volume_devices(id)?;
        let here = self.top_at(&path)?.filter(|m| self.is_volume_mount(m, &devices));
        let block_staged_here = stage.as_ref().is_some_and(|r| r.capability.block && r.state == StageState::Staged);
        let mut problems = Vec::new();
        if !vol.path.exists() {
            problems.push(format!("backing file {} is missing", vol.path.display()));
        }
        let mut usage = Vec::new();
        let block_total =
            |dev: Option<&PathBuf>| dev.and_then(|d| self.kernel.device_size(d).ok()).unwrap_or(vol.size_bytes);
        match here {
            None if block_staged_here => {
                let rw = devices.iter().find(|d| !d.ro).map(|d| &d.path);
                if rw.is_none() {
                    problems.push(format!("volume {id} is staged but not attached to a loop device"));
                }
                usage.push(csi::VolumeUsage {
                    available: 0,
                    total: block_total(rw) as i64,
                    used: 0,
                    unit: Unit::Bytes as i32,
                });
            }
            None => problems.push(format!("{} is not mounted", path.display())),
            Some(_) if let Some(num) = self.kernel.block_node(&path) => {
                let dev = devices.iter().find(|d| d.num == num).map(|d| &d.path);
                usage.push(csi::VolumeUsage {
                    available: 0,
                    total: block_total(dev) as i64,
                    used: 0,
                    unit: Unit::Bytes as i32,
                });
            }
            Some(_) => {
                let st = self.kernel.statvfs(&path).map_err(errno_internal(format!("statfs {}", path.display())))?;
                let f = st.fragment_size;
                let total = st.blocks * f;
                let avail = st.blocks_available * f;
                let used = (st.blocks - st.blocks_free) * f;
                usage.push(csi::VolumeUsage {
                    available: avail as i64,
                    total: total as i64,
                    used: used as i64,
                    unit: Unit::Bytes as i32,
                });
                usage.push(csi::VolumeUsage {
                    available: st.files_available as i64,
                    total: st.files as i64,
                    used: (st.files - st.files_free) as i64,
                    unit: Unit::Inodes as i32,
                });
            }
        }
        let condition = if problems.is_empty() {
            csi::VolumeCondition { abnormal: false, message: "healthy".into() }
        } else {
            csi::VolumeCondition { abnormal: true, message: problems.join("; ") }
        };
        Ok(csi::NodeGetVolumeStatsResponse { usage, volume_condition: Some(condition) })
    }

    pub fn expand(&self, req: &csi::NodeExpandVolumeRequest) -> Result<csi::NodeExpandVolumeResponse> {
        required("volume_id", &req.volume_id)?;
        required("volume_path", &req.volume_path)?;
        let id = self.volume_id(&req.volume_id)?;
        self.existing(id)?;
        // As for stats: a path the records do not put the volume at is NOT_FOUND, without
        // touching the filesystem. A block volume staged here grows whatever path kubelet
        // names for it (the device is the volume), as long as that path is a valid one.
        let stage = self.load_stage(id)?;
        let at_record = stage.as_ref().is_some_and(|r| r.staging_path == Path::new(&req.volume_path))
            || self.published_at(id, &req.volume_path);
        let block_staged_rec = stage.as_ref().is_some_and(|r| r.capability.block && r.state == StageState::Staged);
        if !at_record && !block_staged_rec {
            return Err(not_at(id, &req.volume_path));
        }
        let path = self
            .path("volume_path", &req.volume_path)
            .map_err(|e| if at_record { e } else { not_at(id, &req.volume_path) })?;
        if !req.staging_target_path.is_empty() {
            self.path("staging_target_path", &req.staging_target_path)?;
        }
        let (required_bytes, limit) = match &req.capacity_range {
            Some(r) if r.required_bytes < 0 || r.limit_bytes < 0 => {
                return Err(invalid("capacity_range must not be negative"));
            }
            Some(r) if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes => {
                return Err(CsiError::new(
                    Code::OutOfRange,
                    format!("required_bytes {} exceeds limit_bytes {}", r.required_bytes, r.limit_bytes),
                ));
            }
            Some(r) => (r.required_bytes as u64, r.limit_bytes as u64),
            None => (0, 0),
        };
        let cap = match &req.volume_capability {
            Some(c) => Some(
                parse_capability(Some(c))
                    .map_err(|e| if e.code == Code::FailedPrecondition { invalid(e.msg) } else { e })?,
            ),
            None => None,
        };
        let _g = self.guard(id)?;
        let vol = self.store.get(id)?.ok_or_else(|| not_found(id))?;
        if let Some(c) = &cap {
            check_fits(&vol, c)?;
        }
        let devices = self.volume_devices(id)?;
        let at_path = self.top_at(&path)?.is_some_and(|m| self.is_volume_mount(&m, &devices));
        let block_staged = self.load_stage(id)?.is_some_and(|r| r.capability.block && r.state == StageState::Staged);
        if !at_path && !block_staged {
            return Err(precondition(format!("volume {id} is recorded at {} but not mounted there", path.display())));
        }
        let want = required_bytes.max(vol.size_bytes);
        let rounded = crate::storage::store::round_size(id, want)?;
        if limit > 0 && rounded > limit {
            return Err(CsiError::new(
                Code::OutOfRange,
                format!("volume sizes are whole MiB: {rounded} bytes would exceed limit_bytes {limit}"),
            ));
        }
        let vol = self.store.expand(id, rounded)?;
        crate::util::crash_point("expand-after-store");
        self.resize_mapping(id)?;
        if !vol.fs_type.is_raw() && !block_staged {
            let dev = self.top_device(id)?.ok_or_else(|| precondition(format!("volume {id} is not attached")))?;
            let dev_size = self.kernel.device_size(&dev).map_err(io_internal(format!("sizing {}", dev.display())))?;
            let fs_size = self.kernel.fs_size(&dev, vol.fs_type)?.unwrap_or(dev_size);
            if fs_size.saturating_add(crate::storage::store::SIZE_ALIGN) <= dev_size {
                match vol.fs_type {
                    FsType::Xfs => {
                        // xfs grows through a writable mount of it: the staging mount.
                        let rw = self
                            .table()?
                            .iter()
                            .find(|m| self.is_volume_mount(m, &devices) && !m.read_only())
                            .map(|m| m.mount_point.clone())
                            .ok_or_else(|| {
                                precondition(format!("volume {id} has no writable mount to grow xfs through"))
                            })?;
                        self.kernel.grow_fs(&rw, FsType::Xfs)?;
                    }
                    FsType::Ext4 => self.kernel.grow_fs(&dev, FsType::Ext4)?,
                    FsType::Raw => {}
                }
                tracing::info!(volume = id, from = fs_size, to = dev_size, "filesystem grown online");
            }
        }
        Ok(csi::NodeExpandVolumeResponse { capacity_bytes: vol.size_bytes as i64 })
    }
}
