//! NodePublishVolume and NodeUnpublishVolume: the staged filesystem (or the volume's device)
//! bind-mounted onto a pod's target path, and the volume's mount group.

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use tonic::Code;

use super::records::{PublishRecord, StageState};
use super::{
    CsiError, NodeService, Result, TARGET_WAIT, check_fits, errno_internal, internal, invalid, io_internal, not_found,
    parse_capability, precondition, required,
};
use crate::rpc::csi;
use crate::rpc::csi::volume_capability::access_mode::Mode;
use crate::sys::mount;
use crate::sys::volume_kernel::MountError;

impl NodeService {
    pub fn publish(&self, req: &csi::NodePublishVolumeRequest) -> Result<()> {
        required("volume_id", &req.volume_id)?;
        required("target_path", &req.target_path)?;
        if req.volume_capability.is_none() {
            return Err(invalid("volume_capability is required"));
        }
        let id = self.volume_id(&req.volume_id)?;
        self.existing(id)?;
        let target = self.path("target_path", &req.target_path)?;
        let cap = parse_capability(req.volume_capability.as_ref())?;
        if req.staging_target_path.is_empty() {
            return Err(precondition(
                "staging_target_path is required: this plugin stages volumes (STAGE_UNSTAGE_VOLUME)",
            ));
        }
        let staging = self.path("staging_target_path", &req.staging_target_path)?;
        if target == staging || target.starts_with(&staging) || staging.starts_with(&target) {
            return Err(invalid("target_path and staging_target_path must not contain each other"));
        }
        let opts = mount::parse_mount_flags(&cap.mount_flags).map_err(invalid)?;
        let read_only = req.readonly || cap.mode() == Mode::SingleNodeReaderOnly;
        // Other targets of the volume are served meanwhile; a stage in progress is waited for.
        let _target = self.target_guard(id, &target, TARGET_WAIT)?;
        let _publishing = self.publishing_guard(id, TARGET_WAIT)?;
        let vol = self.store.get(id)?.ok_or_else(|| not_found(id))?;
        check_fits(&vol, &cap)?;
        let devices = self.volume_devices(id)?;
        let stage = self.load_stage(id)?;
        let staged_here = match &stage {
            Some(r) if r.staging_path == staging && r.state == StageState::Staged => {
                if r.capability.block != cap.block {
                    return Err(invalid(format!(
                        "volume {id} is staged for {} access, the publish asks for {}",
                        if r.capability.block { "block" } else { "mount" },
                        if cap.block { "block" } else { "mount" }
                    )));
                }
                if cap.block {
                    Self::block_staged(r, &devices)
                } else {
                    self.top_at(&staging)?.is_some_and(|m| self.is_volume_mount(&m, &devices))
                }
            }
            _ => false,
        };
        if !staged_here {
            return Err(precondition(format!("volume {id} is not staged at {}", staging.display())));
        }
        if cap.block && read_only && stage.as_ref().is_some_and(|r| r.encrypted) {
            // A read-only publication gets a read-only device of its own (a read-only bind
            // mount of a device node does not stop writes); for an encrypted volume that
            // would be a second mapping, which needs the key publish is not given.
            return Err(precondition(format!(
                "volume {id} is encrypted: read-only raw block publication of it is not supported"
            )));
        }
        let want = PublishRecord {
            volume_id: id.to_string(),
            target_path: target.clone(),
            staging_path: staging.clone(),
            capability: cap.clone(),
            read_only,
            created_target: false,
        };
        let existing = self.load_publish(&target)?;
        let top = self.top_at(&target)?;
        if let Some(r) = &existing {
            let same = r.volume_id == want.volume_id
                && r.staging_path == want.staging_path
                && r.capability == want.capability
                && r.read_only == want.read_only;
            let mounted = top.as_ref().is_some_and(|m| self.is_volume_mount(m, &devices));
            if mounted && same {
                return Ok(());
            }
            if mounted || r.volume_id != id {
                return Err(CsiError::new(
                    Code::AlreadyExists,
                    format!(
                        "{} is already published (volume {}, read_only {}) and incompatible with this request",
                        target.display(),
                        r.volume_id,
                        r.read_only
                    ),
                ));
            }
        } else if let Some(m) = top {
            return Err(CsiError::new(
                Code::AlreadyExists,
                format!(
                    "{} already has a mount ({} {}) that this plugin did not make",
                    target.display(),
                    m.fs_type,
                    m.source
                ),
            ));
        }
        // SINGLE_NODE_SINGLE_WRITER: one workload only.
        let others: Vec<PublishRecord> = self
            .publishes_of(id)
            .into_iter()
            .filter(|r| r.target_path != target)
            .filter(|r| self.top_at(&r.target_path).ok().flatten().is_some_and(|m| self.is_volume_mount(&m, &devices)))
            .collect();
        let single = |m: i32| Mode::try_from(m) == Ok(Mode::SingleNodeSingleWriter);
        if let Some(o) = others.iter().find(|o| single(cap.access_mode) || single(o.capability.access_mode)) {
            return Err(precondition(format!(
                "volume {id} is SINGLE_NODE_SINGLE_WRITER and already published at {}",
                o.target_path.display()
            )));
        }

        let created_target = !target.exists();
        let rec =
            PublishRecord { created_target: created_target || existing.is_some_and(|e| e.created_target), ..want };
        self.save_publish(&rec)?;
        crate::util::crash_point("publish-after-record");
        let result = (|| -> Result<()> {
            if cap.block {
                let dev = if read_only {
                    self.store.attach_read_only(id)?
                } else {
                    self.top_device(id)?.ok_or_else(|| precondition(format!("volume {id} is not attached")))?
                };
                if created_target {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&target)
                        .map_err(io_internal(format!("creating {}", target.display())))?;
                }
                self.kernel.bind_device(&dev, &self.settings.kubelet_dir, &target, read_only).map_err(|e| match e {
                    MountError::Source(e) | MountError::Target(e) => {
                        invalid(format!("target_path {}: {e}", target.display()))
                    }
                    MountError::Mount(e) => {
                        internal(format!("bind-mounting {} onto {}: {e}", dev.display(), target.display()))
                    }
                })?;
            } else {
                if !cap.mount_group.is_empty() {
                    apply_mount_group(&staging, &cap.mount_group)?;
                }
                if created_target {
                    std::fs::DirBuilder::new()
                        .mode(0o750)
                        .create(&target)
                        .map_err(io_internal(format!("creating {}", target.display())))?;
                }
                self.kernel.bind_dir(&self.settings.kubelet_dir, &staging, &target, read_only, opts.flags).map_err(
                    |e| match e {
                        MountError::Source(e) => invalid(format!("staging_target_path {}: {e}", staging.display())),
                        MountError::Target(e) => invalid(format!("target_path {}: {e}", target.display())),
                        MountError::Mount(e) => {
                            internal(format!("bind-mounting {} onto {}: {e}", staging.display(), target.display()))
                        }
                    },
                )?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            let _ = self.unmount_ours(id, &target);
            if rec.created_target {
                let _ = remove_target(&target);
            }
            let _ = self.remove_publish(&target);
            if cap.block && read_only {
                let _ = self.release_read_only_device(id, &target);
            }
            return Err(e);
        }
        crate::util::crash_point("publish-after-mount");
        tracing::info!(volume = id, target = %target.display(), read_only, block = cap.block, "volume published");
        Ok(())
    }

    /// Detach the volume's read-only loop device when no other read-only block publication
    /// uses it.
    fn release_read_only_device(&self, id: &str, except: &Path) -> Result<()> {
        let still_used = self
            .publish_records()
            .iter()
            .any(|r| r.volume_id == id && r.capability.block && r.read_only && r.target_path != except);
        if !still_used {
            self.store.detach_read_only(id)?;
        }
        Ok(())
    }

    pub fn unpublish(&self, req: &csi::NodeUnpublishVolumeRequest) -> Result<()> {
        required("volume_id", &req.volume_id)?;
        required("target_path", &req.target_path)?;
        let id = self.volume_id(&req.volume_id)?;
        self.known_or_recorded(id)?;
        let target = self.path("target_path", &req.target_path)?;
        let _target = self.target_guard(id, &target, TARGET_WAIT)?;
        let known = self.store.get(id)?.is_some();
        let rec = self.load_publish(&target)?.filter(|r| r.volume_id == id);
        let devices = self.volume_devices(id)?;
        let ours = self.ours_at(&target, &devices)?;
        if !known && rec.is_none() && !ours {
            return Err(not_found(id));
        }
        if rec.is_none() && !ours {
            return Ok(()); // not published there
        }
        if ours || rec.is_some() {
            self.unmount_of(id, &target, &devices)?;
            crate::util::crash_point("unpublish-after-unmount");
        }
        if let Some(r) = &rec {
            if r.created_target {
                remove_target(&target)?;
            }
            if r.capability.block && r.read_only {
                // The shared read-only device: decided one publication at a time, after this
                // record is gone, so the last of two concurrent unpublishes releases it.
                let _publishing = self.publishing_guard(id, TARGET_WAIT)?;
                self.remove_publish(&target)?;
                if let Err(e) = self.release_read_only_device(id, &target) {
                    // Unpublished all the same; unstage detaches every device of the volume.
                    tracing::warn!(volume = id, error = %e.msg, "read-only loop device not released yet");
                }
            }
        }
        self.remove_publish(&target)?;
        tracing::info!(volume = id, target = %target.display(), "volume unpublished");
        Ok(())
    }
}

/// `volume_mount_group`: the volume's root becomes group-owned by the gid, group
/// read/write/search, set-gid so new files inherit the group.
fn apply_mount_group(root: &Path, gid: &str) -> Result<()> {
    let gid: u32 = gid.parse().map_err(|_| invalid(format!("volume_mount_group {gid:?} is not a numeric group id")))?;
    let md = std::fs::metadata(root).map_err(io_internal(format!("inspecting {}", root.display())))?;
    if md.gid() != gid {
        nix::unistd::chown(root, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(errno_internal(format!("chown {}", root.display())))?;
    }
    let mode = md.permissions().mode() & 0o7777;
    let want = mode | 0o2070;
    if mode != want {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(want))
            .map_err(io_internal(format!("chmod {}", root.display())))?;
    }
    Ok(())
}

/// Remove a target the plugin created: an empty directory, or the file a block volume was
/// bound onto. Already gone is fine.
fn remove_target(target: &Path) -> Result<()> {
    let r = match std::fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => std::fs::remove_dir(target),
        Ok(_) => std::fs::remove_file(target),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
    };
    r.map_err(io_internal(format!("removing {}", target.display())))
}
