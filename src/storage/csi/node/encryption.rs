//! LUKS2 encryption of a volume on the node: what a NodeStageVolume asks for, unlocking the
//! volume's device into its dm-crypt mapping (`npc-<id>`), and locking it again.
//!
//! A stage whose `volume_context` says `encryption: luks2` takes its key from the
//! node-stage secret (`secrets["key"]`; its bytes are the passphrase). The attached device
//! then holds the LUKS2 container: a blank device gets one ([`crate::sys::crypt::format`]),
//! a device holding one is opened, a device holding anything else is refused. The
//! filesystem (or, for raw block, the pod's device) lives on the mapping. The key is held
//! only for the call and goes to cryptsetup through its stdin; it is never logged or
//! written anywhere.

use std::path::{Path, PathBuf};

use super::{CsiError, NodeService, Result, internal, invalid, precondition};
use crate::rpc::csi;
use crate::storage::store::{Backend, Volume};
use crate::sys::crypt::{self, CryptError, Key, Mapping};

/// The `volume_context` key that asks for encryption, and its one value.
pub(super) const ENCRYPTION_CONTEXT: &str = "encryption";
pub(super) const LUKS2: &str = "luks2";
/// The node-stage secret's entry holding the key.
pub(super) const KEY_SECRET: &str = "key";

/// The key a NodeStageVolume request stages its volume with: `None` for a volume without
/// encryption; INVALID_ARGUMENT for an unknown `encryption` value or a missing or empty key.
pub(super) fn requested_key(req: &csi::NodeStageVolumeRequest) -> Result<Option<Key>> {
    match req.volume_context.get(ENCRYPTION_CONTEXT).map(String::as_str) {
        None | Some("") => Ok(None),
        Some(LUKS2) => match req.secrets.get(KEY_SECRET) {
            Some(k) if !k.is_empty() => Ok(Some(Key::new(k.as_bytes()))),
            _ => Err(invalid(format!(
                "volume {} is encrypted (volume_context {ENCRYPTION_CONTEXT}: {LUKS2}) but the node-stage secret \
                 has no {KEY_SECRET:?} entry (check the StorageClass' csi.storage.k8s.io/node-stage-secret-* \
                 parameters)",
                req.volume_id
            ))),
        },
        Some(other) => {
            Err(invalid(format!("volume_context {ENCRYPTION_CONTEXT}: {other:?} is not supported (only {LUKS2:?})")))
        }
    }
}

/// A volume's device unlocked: the mapping, and whether it has never held a filesystem.
pub(super) struct Unlocked {
    pub(super) path: PathBuf,
    pub(super) fresh: bool,
}

/// A cryptsetup failure as the CSI code it calls for.
pub(super) fn crypt_error(id: &str, e: CryptError) -> CsiError {
    match e {
        CryptError::WrongKey { .. } => invalid(format!("the key in the node-stage secret does not open volume {id}")),
        CryptError::InUse { .. } => precondition(format!("volume {id}: {e}")),
        e => internal(format!("volume {id}: {e}")),
    }
}

impl NodeService {
    /// The open mapping of volume `id`, if any (one `stat` and a few sysfs reads).
    pub(super) fn mapping_of(&self, id: &str) -> Result<Option<Mapping>> {
        self.kernel.crypt_mapping(&crypt::mapping_name(id)).map_err(|e| crypt_error(id, e))
    }

    /// The device volume `id` is used through: its mapping when open, else its read-write
    /// loop device (or LV) when attached.
    pub(super) fn top_device(&self, id: &str) -> Result<Option<PathBuf>> {
        if let Some(m) = self.mapping_of(id)? {
            return Ok(Some(m.path));
        }
        Ok(self.store.attached_device(id)?)
    }

    /// Unlock volume `vol` on its attached device `raw` with `key`: a blank device gets a
    /// fresh LUKS2 container, a container is opened, anything else is FAILED_PRECONDITION
    /// (never formatted). An open mapping of that device is kept after the key is checked
    /// (a retried stage). A wrong key is INVALID_ARGUMENT and opens nothing.
    pub(super) fn unlock(&self, vol: &Volume, raw: &Path, key: &Key) -> Result<Unlocked> {
        let id = vol.id.as_str();
        let name = crypt::mapping_name(id);
        let raw_num = self.kernel.dev_numbers(raw).map_err(|e| internal(format!("{}: {e}", raw.display())))?;
        let err = |e| crypt_error(id, e);
        if let Some(m) = self.mapping_of(id)? {
            if m.backing_num != raw_num {
                return Err(precondition(format!(
                    "volume {id}: mapping {name} is open on {}, not on the volume's device {}; close it by hand",
                    m.backing.display(),
                    raw.display()
                )));
            }
            if !self.kernel.crypt_key_opens(raw, key).map_err(err)? {
                return Err(crypt_error(id, CryptError::WrongKey { device: raw.display().to_string() }));
            }
            return Ok(Unlocked { path: m.path, fresh: self.kernel.crypt_is_fresh(raw).map_err(err)? });
        }
        let probed = match vol.backend {
            Backend::File => self.kernel.fs_probe_loop(raw, &vol.path)?,
            Backend::Lvm => self.kernel.fs_probe(raw)?,
        };
        let formatted = match probed.as_deref() {
            None => {
                tracing::info!(volume = id, device = %raw.display(), "blank device: making a LUKS2 container");
                self.kernel.crypt_format(raw, key).map_err(err)?;
                crate::util::crash_point("stage-after-luks-format");
                true
            }
            Some("crypto_LUKS") => false,
            Some(other) => {
                return Err(precondition(format!(
                    "volume {id}: {} holds {other:?}, not a LUKS2 container; refusing to format it",
                    raw.display()
                )));
            }
        };
        let path = self.kernel.crypt_open(raw, &name, key).map_err(err)?;
        let fresh = formatted || self.kernel.crypt_is_fresh(raw).map_err(err)?;
        tracing::info!(volume = id, device = %raw.display(), mapping = %path.display(), fresh, "volume unlocked");
        Ok(Unlocked { path, fresh })
    }

    /// Close the mapping of volume `id` if it is open ([`CryptError::InUse`] while something
    /// holds it).
    pub(super) fn lock(&self, id: &str) -> std::result::Result<(), CryptError> {
        let name = crypt::mapping_name(id);
        if self.kernel.crypt_mapping(&name)?.is_some() {
            self.kernel.crypt_close(&name)?;
            tracing::info!(volume = id, mapping = name, "volume locked");
        }
        Ok(())
    }

    /// Grow the open mapping of volume `id` to its (grown) device; nothing when none is open.
    pub(super) fn resize_mapping(&self, id: &str) -> Result<()> {
        if let Some(m) = self.mapping_of(id)? {
            self.kernel.crypt_resize(&m.name).map_err(|e| crypt_error(id, e))?;
        }
        Ok(())
    }
}
