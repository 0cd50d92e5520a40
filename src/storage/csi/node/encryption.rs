//! LUKS2 encryption of a volume on the node: what a NodeStageVolume asks for, unlocking the
//! volume's device into its dm-crypt mapping (`npc-<id>`), and locking it again.
//!
//! A stage whose `volume_context` says `encryption: luks2` takes its key from the
//! node-stage secret (`secrets["key"]`; its bytes are the passphrase). The attached device
//! then holds the LUKS2 container: a blank device gets one ([`crate::sys::crypt::format`]),
//! a device holding one is opened, a device holding anything else is refused. The
//! filesystem (or, for raw block, the pod's device) lives on the mapping. The key is held
//! only for the call and goes to cryptsetup through its stdin (or a pipe); it is never
//! logged or written anywhere.
//!
//! A copy (a restore of a snapshot, a clone) starts as the source's blocks: its container
//! opens with the source's key under the source's volume key. Its node-stage secret then
//! carries the source's key as `sourceKey` besides its own `key`, and its first stage
//! re-keys it ([`NodeService::rekey`]): `key` is added as a key slot, then the whole device
//! is re-encrypted to a new volume key that `key` alone opens. The source's key and volume
//! key open nothing of the copy afterwards. Every step can be interrupted (a crash, a
//! kubelet timeout) and the next stage picks up where it stopped.

use std::path::{Path, PathBuf};

use super::mounts::LoopDev;
use super::records::StageRecord;
use super::{CsiError, NodeService, Result, internal, invalid, precondition};
use crate::rpc::csi;
use crate::storage::store::{Backend, Volume};
use crate::sys::crypt::{self, CryptError, Key, Mapping};

/// The `volume_context` key that asks for encryption, and its one value.
pub(super) const ENCRYPTION_CONTEXT: &str = "encryption";
pub(super) const LUKS2: &str = "luks2";
/// The node-stage secret's entry holding the key.
pub(super) const KEY_SECRET: &str = "key";
/// The node-stage secret's entries holding the keys a copy's blocks may still open with:
/// `sourceKey` (the key of the copy's source), then `sourceKey2`, `sourceKey3`, ... (the
/// source's own sources, when the source was a copy never staged, so never re-keyed).
pub(super) const SOURCE_KEY_SECRET: &str = "sourceKey";

/// The keys of an encrypted stage.
pub(super) struct StageKeys {
    /// The volume's own key: the one its container opens with once staged.
    pub(super) key: Key,
    /// The keys of its sources, in the order to try them (empty for a volume made blank).
    pub(super) sources: Vec<Key>,
}

/// The source keys of a node-stage secret: `sourceKey`, then `sourceKey2`, `sourceKey3`,
/// ... while they are there (empty entries ignored).
fn source_keys(secrets: &std::collections::HashMap<String, String>) -> Vec<Key> {
    let names = std::iter::once(SOURCE_KEY_SECRET.to_string()).chain((2..).map(|n| format!("{SOURCE_KEY_SECRET}{n}")));
    names.map_while(|n| secrets.get(&n)).filter(|k| !k.is_empty()).map(|k| Key::new(k.as_bytes())).collect()
}

/// The keys a NodeStageVolume request stages its volume with: `None` for a volume without
/// encryption; INVALID_ARGUMENT for an unknown `encryption` value or a missing or empty key.
pub(super) fn requested_keys(req: &csi::NodeStageVolumeRequest) -> Result<Option<StageKeys>> {
    match req.volume_context.get(ENCRYPTION_CONTEXT).map(String::as_str) {
        None | Some("") => Ok(None),
        Some(LUKS2) => match req.secrets.get(KEY_SECRET) {
            Some(k) if !k.is_empty() => {
                Ok(Some(StageKeys { key: Key::new(k.as_bytes()), sources: source_keys(&req.secrets) }))
            }
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
        CryptError::WrongKey { .. } => invalid(format!(
            "the key in the node-stage secret does not open volume {id} (nor does any {SOURCE_KEY_SECRET} entry)"
        )),
        CryptError::InUse { .. } => precondition(format!("volume {id}: {e}")),
        e => internal(format!("volume {id}: {e}")),
    }
}

impl NodeService {
    /// The open mapping of volume `id`, if any (one `stat` and a few sysfs reads).
    pub(super) fn mapping_of(&self, id: &str) -> Result<Option<Mapping>> {
        self.kernel.crypt_mapping(&crypt::mapping_name(id)).map_err(|e| crypt_error(id, e))
    }

    /// Whether a volume staged for raw block access as `rec` says still has, among its
    /// `devices` (from `volume_devices`), the device a publication binds: its open mapping
    /// when encrypted, else its read-write loop device or LV. After a reboot an encrypted
    /// volume's LV is active again but its mapping is not; that LV holds the LUKS
    /// container, never what the pod wrote.
    pub(super) fn block_staged(rec: &StageRecord, devices: &[LoopDev]) -> bool {
        if rec.encrypted {
            return devices.iter().any(|d| d.mapping);
        }
        devices.iter().any(|d| !d.ro)
    }

    /// The device volume `id` is used through: its mapping when open, else its read-write
    /// loop device (or LV) when attached.
    pub(super) fn top_device(&self, id: &str) -> Result<Option<PathBuf>> {
        if let Some(m) = self.mapping_of(id)? {
            return Ok(Some(m.path));
        }
        Ok(self.store.attached_device(id)?)
    }

    /// Unlock volume `vol` on its attached device `raw` with `keys`: a blank device gets a
    /// fresh LUKS2 container, a container is opened, anything else is FAILED_PRECONDITION
    /// (never formatted). A copy's container (its keys name sources) is re-keyed first if
    /// need be ([`Self::rekey`]); a volume made blank never needs it, so its stage runs
    /// only the open and the fresh-label check. An open mapping of that device is kept after
    /// the key is checked (a retried stage). A wrong key is INVALID_ARGUMENT and opens
    /// nothing.
    pub(super) fn unlock(&self, vol: &Volume, raw: &Path, keys: &StageKeys) -> Result<Unlocked> {
        let key = &keys.key;
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
            if self.kernel.crypt_key_slot(raw, key).map_err(err)?.is_none() {
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
            Some("crypto_LUKS") => {
                if !keys.sources.is_empty() {
                    self.rekey(id, raw, keys)?;
                }
                false
            }
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

    /// Make the (closed) container on `raw` one that `keys.key` alone opens, under a volume
    /// key of its own. Each state a crash or timeout can leave is finished from:
    ///
    /// - `key` opens it, one key slot, no reencryption pending: nothing to do (a copy's
    ///   every stage after its first);
    /// - `key` opens it and a reencryption is pending: resume it to its end;
    /// - `key` opens it and other key slots remain: start the reencryption, then run it;
    /// - `key` does not open it but a source key does: add `key` (authorised by that source
    ///   key), then as above;
    /// - nothing opens it: [`CryptError::WrongKey`] (INVALID_ARGUMENT), nothing changed.
    ///
    /// The reencryption reads and rewrites the whole device (a thin LV ends fully
    /// allocated), so a copy's first stage takes time in proportion to its size.
    pub(super) fn rekey(&self, id: &str, raw: &Path, keys: &StageKeys) -> Result<()> {
        let err = |e| crypt_error(id, e);
        let wrong_key = || err(CryptError::WrongKey { device: raw.display().to_string() });
        let key = &keys.key;
        let slot = match self.kernel.crypt_key_slot(raw, key).map_err(err)? {
            Some(slot) => slot,
            None => {
                let source = self.opening_source(id, raw, keys)?.ok_or_else(wrong_key)?;
                tracing::info!(volume = id, device = %raw.display(), "a copy: adding its own key before re-keying");
                self.kernel.crypt_add_key(raw, source, key).map_err(err)?;
                crate::util::crash_point("crypt-rekey-after-addkey");
                self.kernel.crypt_key_slot(raw, key).map_err(err)?.ok_or_else(wrong_key)?
            }
        };
        let header = self.kernel.crypt_header(raw).map_err(err)?;
        if !header.reencrypting && header.key_slots <= 1 {
            return Ok(());
        }
        if !header.reencrypting {
            self.kernel.crypt_reencrypt_init(raw, key, slot).map_err(err)?;
            crate::util::crash_point("crypt-rekey-after-init");
        }
        tracing::info!(volume = id, device = %raw.display(), "re-encrypting a copy to a volume key of its own");
        let start = std::time::Instant::now();
        self.kernel.crypt_reencrypt_resume(raw, key).map_err(err)?;
        crate::util::crash_point("crypt-rekey-after-reencrypt");
        let ms = start.elapsed().as_millis() as u64;
        tracing::info!(volume = id, device = %raw.display(), elapsed_ms = ms, "copy re-keyed");
        Ok(())
    }

    /// The first source key that opens the container on `raw`, if any.
    fn opening_source<'k>(&self, id: &str, raw: &Path, keys: &'k StageKeys) -> Result<Option<&'k Key>> {
        for k in &keys.sources {
            if self.kernel.crypt_key_slot(raw, k).map_err(|e| crypt_error(id, e))?.is_some() {
                return Ok(Some(k));
            }
        }
        Ok(None)
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
