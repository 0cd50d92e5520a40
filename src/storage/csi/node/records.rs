//! The stage and publish records under `<state>/csi/`: what they hold, where they live, and
//! loading, saving, removing and listing them (the publish records are also kept in memory).

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{NodeService, Result, internal, io_internal};
use crate::storage::csi::capability::Capability;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum StageState {
    Staging,
    Staged,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct StageRecord {
    pub(super) volume_id: String,
    pub(super) staging_path: PathBuf,
    pub(super) capability: Capability,
    pub(super) state: StageState,
    /// Staged through a LUKS2 mapping (`npc-<id>`): unstage closes it, recovery and the
    /// doctor expect it. Absent in records written before encryption existed: false.
    #[serde(default)]
    pub(super) encrypted: bool,
}

impl StageRecord {
    /// Same request as `cap` for staging purposes (the mount group applies at publish).
    pub(super) fn same(&self, cap: &Capability) -> bool {
        let a = &self.capability;
        a.block == cap.block
            && a.mount_flags == cap.mount_flags
            && a.access_mode == cap.access_mode
            && (a.fs_type == cap.fs_type || a.fs_type.is_empty() || cap.fs_type.is_empty())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PublishRecord {
    pub(super) volume_id: String,
    pub(super) target_path: PathBuf,
    pub(super) staging_path: PathBuf,
    pub(super) capability: Capability,
    pub(super) read_only: bool,
    /// The agent created the target (and so removes it on unpublish).
    pub(super) created_target: bool,
}

impl NodeService {
    pub(super) fn stage_record_path(&self, id: &str) -> PathBuf {
        self.settings.record_dir.join("stage").join(format!("{id}.json"))
    }

    fn publish_record_path(&self, target: &Path) -> PathBuf {
        let h = crate::util::fnv1a(&[target.as_os_str().as_encoded_bytes()]);
        self.settings.record_dir.join("publish").join(format!("{h:016x}.json"))
    }

    fn load<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>> {
        match std::fs::read(path) {
            Ok(b) => match serde_json::from_slice(&b) {
                Ok(r) => Ok(Some(r)),
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e, "unreadable CSI record; ignoring it");
                    Ok(None)
                }
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(internal(format!("reading {}: {e}", path.display()))),
        }
    }

    /// Records are replaced atomically but not fsync'd: they describe mounts and loop
    /// devices, which a power loss takes away with them, while an agent crash keeps what
    /// the kernel already has (the page cache survives the process).
    pub(super) fn save<T: Serialize>(&self, path: &Path, rec: &T) -> Result<()> {
        let data = serde_json::to_vec_pretty(rec).map_err(|e| internal(e.to_string()))?;
        crate::sys::fs::atomic_write_nosync(path, &data).map_err(io_internal(format!("writing {}", path.display())))
    }

    /// Remove a record (gone already is fine).
    pub(super) fn remove_record(&self, path: &Path) -> Result<()> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(internal(format!("removing {}: {e}", path.display()))),
        }
    }

    pub(super) fn load_stage(&self, id: &str) -> Result<Option<StageRecord>> {
        Self::load(&self.stage_record_path(id))
    }

    pub(super) fn publishes_lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, PublishRecord>> {
        self.publishes.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn load_publish(&self, target: &Path) -> Result<Option<PublishRecord>> {
        Ok(self.publishes_lock().get(target).cloned())
    }

    /// Write a publish record (file first, then the in-memory view).
    pub(super) fn save_publish(&self, rec: &PublishRecord) -> Result<()> {
        self.save(&self.publish_record_path(&rec.target_path), rec)?;
        self.publishes_lock().insert(rec.target_path.clone(), rec.clone());
        Ok(())
    }

    /// Remove the publish record of `target` (file first, then the in-memory view).
    pub(super) fn remove_publish(&self, target: &Path) -> Result<()> {
        self.remove_record(&self.publish_record_path(target))?;
        self.publishes_lock().remove(target);
        Ok(())
    }

    pub(super) fn publish_records(&self) -> Vec<PublishRecord> {
        self.publishes_lock().values().cloned().collect()
    }

    /// Whether a publish record puts volume `id` at `raw` (compared as a path, nothing on
    /// disk looked at).
    pub(super) fn published_at(&self, id: &str, raw: &str) -> bool {
        self.publishes_lock().get(Path::new(raw)).is_some_and(|r| r.volume_id == id)
    }

    /// The publish records of volume `id`.
    pub(super) fn publishes_of(&self, id: &str) -> Vec<PublishRecord> {
        self.publishes_lock().values().filter(|r| r.volume_id == id).cloned().collect()
    }

    /// Every record in `dir` (unreadable ones logged and left out).
    pub(super) fn load_all<T: serde::de::DeserializeOwned>(dir: &Path) -> Vec<T> {
        let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.file_name().as_encoded_bytes().ends_with(b".json"))
            .filter_map(|e| Self::load(&e.path()).ok().flatten())
            .collect()
    }

    pub(super) fn stage_records(&self) -> Vec<StageRecord> {
        Self::load_all(&self.settings.record_dir.join("stage"))
    }
}
