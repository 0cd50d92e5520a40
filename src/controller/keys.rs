//! Per-volume encryption keys: the LUKS2 passphrase of each volume of a class with
//! `encryption: luks2`. The controller makes one per volume (32 random bytes, as 64 hex
//! digits) when the volume is created and removes it once the volume is gone. It never
//! sends a key to a node itself: kubelet hands it to the node in NodeStageVolume's secrets,
//! from the Secret the StorageClass names (`csi.storage.k8s.io/node-stage-secret-name:
//! nodeplane-key-${pv.name}`), and the agent never writes it down.
//!
//! - Kubernetes mode: the Secret `nodeplane-key-<volume name>` in the controller's namespace,
//!   key `key`, labelled as the controller's.
//! - Local mode: the file `<dataDir>/keys/<volume id>.key` (0600), which whoever plays kubelet
//!   passes as `secrets["key"]`.
//!
//! A copy (a volume restored from a snapshot, or cloned) starts as its source's blocks,
//! which open with the source's key. Its record holds a fresh `key` and, as `sourceKey`,
//! the source's key (then, as `sourceKey2`, `sourceKey3`, ..., the source's own source
//! keys: a source that was itself a copy and never staged still opens only with those).
//! The node re-keys the copy at its first stage. A snapshot's record is a copy of its
//! volume's record as it was when the snapshot was taken: the snapshot's blocks open with
//! those keys, and it stays restorable after its volume and the volume's key are gone.
//! In local mode every entry is a file of its own: `<id>.<entry>` (`<id>.key`,
//! `<id>.sourceKey`, ...), each passed as `secrets["<entry>"]`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};

/// The StorageClass parameter that turns encryption on (`luks2`).
pub const ENCRYPTION_PARAMETER: &str = "encryption";
/// The volume context key that tells the node a volume is encrypted.
pub const ENCRYPTION_CONTEXT: &str = "encryption";
pub const LUKS2: &str = "luks2";
/// The key of the Secret's data (and of NodeStage's secrets) holding the passphrase.
pub const SECRET_KEY: &str = "key";
/// The entries holding a copy's source keys: `sourceKey`, then `sourceKey2`, ...
pub const SOURCE_KEY_PREFIX: &str = "sourceKey";
/// Secret names: this prefix and the volume (PV) or snapshot name.
pub const SECRET_PREFIX: &str = "nodeplane-key-";

/// A key record: its entries (`key`, and a copy's `sourceKey`, `sourceKey2`, ...) and
/// their values. Its `Debug` names the entries only.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyRecord(pub BTreeMap<String, String>);

impl std::fmt::Debug for KeyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyRecord({:?}, redacted)", self.0.keys().collect::<Vec<_>>())
    }
}

impl KeyRecord {
    /// A new volume's record: a fresh key.
    fn fresh() -> Self {
        KeyRecord([(SECRET_KEY.to_string(), new_key())].into())
    }

    /// The keys that open the blocks this record's volume or snapshot holds, in the order
    /// to try them: its `key`, then its source keys.
    fn chain(&self) -> Vec<String> {
        let first = self.0.get(SECRET_KEY).cloned();
        first.into_iter().chain((1..).map_while(|n| self.0.get(&source_entry(n)).cloned())).collect()
    }

    /// The record of a volume made from the blocks this record opens: a fresh `key`, and
    /// this record's keys as its source keys.
    pub fn for_copy(&self) -> Self {
        let mut r = Self::fresh();
        for (n, k) in self.chain().into_iter().enumerate() {
            r.0.insert(source_entry(n + 1), k);
        }
        r
    }
}

/// The name of the `n`th source key entry (from 1): `sourceKey`, `sourceKey2`, ...
pub fn source_entry(n: usize) -> String {
    if n == 1 { SOURCE_KEY_PREFIX.to_string() } else { format!("{SOURCE_KEY_PREFIX}{n}") }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("volume {name:?}: {SECRET_PREFIX}{name} is not a valid Secret name (a DNS subdomain)")]
    BadName { name: String },
    #[error("volume key {what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("volume key {what}: {source}")]
    Kube { what: String, source: kube::Error },
    /// A copy's source has no key record to take the source keys from.
    #[error("{what} has no key (Secret or key file); a copy of it cannot be opened")]
    SourceMissing { what: String },
}

/// Whether the parameters ask for encryption: `Ok(true)` for `luks2`, `Ok(false)` when
/// absent, `none` or empty; anything else is refused with the reason.
pub fn encryption_parameter(p: &std::collections::HashMap<String, String>) -> Result<bool, String> {
    match p.get(ENCRYPTION_PARAMETER).map(String::as_str) {
        None | Some("") | Some("none") => Ok(false),
        Some(LUKS2) => Ok(true),
        Some(other) => Err(format!("parameter {ENCRYPTION_PARAMETER:?}: {other:?} (want \"luks2\" or \"none\")")),
    }
}

/// Where the controller keeps the volumes' keys.
pub enum KeyStore {
    /// Local mode: one file per volume in this directory.
    Dir(PathBuf),
    /// Kubernetes mode: one Secret per volume in this namespace.
    Secrets { client: kube::Client, namespace: String },
}

impl KeyStore {
    /// Make the key of volume `name` (id `id`) unless it has one. Idempotent.
    pub async fn ensure(&self, name: &str, id: &str) -> Result<(), KeyError> {
        self.ensure_with(name, id, KeyRecord::fresh()).await
    }

    /// Make record `record` for volume or snapshot `name` (id `id`) unless it has one:
    /// the record made first stays. Idempotent.
    pub async fn ensure_with(&self, name: &str, id: &str, record: KeyRecord) -> Result<(), KeyError> {
        match self {
            KeyStore::Dir(dir) => ensure_files(dir, id, &record),
            KeyStore::Secrets { client, namespace } => {
                ensure_secret(client, namespace, &secret_name(name)?, &record).await
            }
        }
    }

    /// The record of volume or snapshot `name` (id `id`); `None` when it has none.
    pub async fn read(&self, name: &str, id: &str) -> Result<Option<KeyRecord>, KeyError> {
        match self {
            KeyStore::Dir(dir) => read_files(dir, id),
            KeyStore::Secrets { client, namespace } => {
                let secret = secret_name(name)?;
                let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
                let got = api.get_opt(&secret).await;
                let got =
                    got.map_err(|source| KeyError::Kube { what: format!("Secret {namespace}/{secret}"), source })?;
                Ok(got.and_then(|s| s.data).map(|d| {
                    KeyRecord(d.into_iter().map(|(k, v)| (k, String::from_utf8_lossy(&v.0).into_owned())).collect())
                }))
            }
        }
    }

    /// Remove the key record of volume or snapshot `name` (id `id`). Idempotent.
    pub async fn remove(&self, name: &str, id: &str) -> Result<(), KeyError> {
        match self {
            KeyStore::Dir(dir) => remove_files(dir, id),
            KeyStore::Secrets { client, namespace } => {
                let secret = secret_name(name)?;
                let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
                match api.delete(&secret, &DeleteParams::default()).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                    Err(source) => Err(KeyError::Kube { what: format!("Secret {namespace}/{secret}"), source }),
                }
            }
        }
    }
}

/// `<dir>/<id>.<entry>`: where a local record keeps entry `entry`.
fn entry_file(dir: &Path, id: &str, entry: &str) -> PathBuf {
    dir.join(format!("{id}.{entry}"))
}

/// A local record: `<id>.key`, then the source keys while their files are there.
fn read_files(dir: &Path, id: &str) -> Result<Option<KeyRecord>, KeyError> {
    let read = |entry: &str| {
        let path = entry_file(dir, id, entry);
        match std::fs::read_to_string(&path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(KeyError::Io { what: path.display().to_string(), source }),
        }
    };
    let Some(key) = read(SECRET_KEY)? else { return Ok(None) };
    let mut record = KeyRecord([(SECRET_KEY.to_string(), key)].into());
    for n in 1.. {
        let Some(v) = read(&source_entry(n))? else { break };
        record.0.insert(source_entry(n), v);
    }
    Ok(Some(record))
}

/// Write a local record unless `<id>.key` is there: the source keys first, `<id>.key`
/// last, so a record whose `.key` file exists is whole.
fn ensure_files(dir: &Path, id: &str, record: &KeyRecord) -> Result<(), KeyError> {
    let io = |path: &Path| {
        let what = path.display().to_string();
        move |source| KeyError::Io { what, source }
    };
    let key_path = key_file(dir, id);
    if key_path.exists() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io(dir))?;
    for (entry, value) in record.0.iter().filter(|(e, _)| e.as_str() != SECRET_KEY) {
        let path = entry_file(dir, id, entry);
        crate::sys::fs::atomic_write(&path, value.as_bytes(), 0o600).map_err(io(&path))?;
    }
    let key = record.0.get(SECRET_KEY).expect("a key record has a key");
    crate::sys::fs::atomic_write(&key_path, key.as_bytes(), 0o600).map_err(io(&key_path))
}

/// Remove a local record: `<id>.key`, then the source keys up to the first missing one.
fn remove_files(dir: &Path, id: &str) -> Result<(), KeyError> {
    let entries = std::iter::once(SECRET_KEY.to_string()).chain((1..).map(source_entry));
    for (i, entry) in entries.enumerate() {
        match std::fs::remove_file(entry_file(dir, id, &entry)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && i > 0 => return Ok(()),
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(KeyError::Io { what: format!("of {id}"), source: e });
            }
            _ => {}
        }
    }
    Ok(())
}

/// `<dir>/<id>.key` (ids are plain file names: `storage::store::validate_id`).
pub fn key_file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.key"))
}

/// The Secret holding volume `name`'s key: what `nodeplane-key-${pv.name}` resolves to.
pub fn secret_name(name: &str) -> Result<String, KeyError> {
    let s = format!("{SECRET_PREFIX}{name}");
    match super::records::subdomain_error(&s) {
        None => Ok(s),
        Some(_) => Err(KeyError::BadName { name: name.to_string() }),
    }
}

/// 32 random bytes as 64 hex digits.
fn new_key() -> String {
    let mut k = [0u8; 32];
    crate::util::fill_random(&mut k);
    hex::encode(k)
}

async fn ensure_secret(client: &kube::Client, namespace: &str, name: &str, record: &KeyRecord) -> Result<(), KeyError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let what = || format!("Secret {namespace}/{name}");
    match api.get_opt(name).await {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => {}
        Err(source) => return Err(KeyError::Kube { what: what(), source }),
    }
    let secret = Secret {
        metadata: super::kube::managed_meta(namespace, name),
        type_: Some("Opaque".into()),
        data: Some(record.0.iter().map(|(k, v)| (k.clone(), ByteString(v.clone().into_bytes()))).collect()),
        ..Default::default()
    };
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(()),
        // Another call made it meanwhile: that one is the key.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(source) => Err(KeyError::Kube { what: what(), source }),
    }
}

use std::os::unix::fs::DirBuilderExt;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parameter_is_luks2_none_or_refused() {
        let p = |v: &str| [(ENCRYPTION_PARAMETER.to_string(), v.to_string())].into_iter().collect();
        assert!(encryption_parameter(&p("luks2")).unwrap());
        assert!(!encryption_parameter(&p("none")).unwrap());
        assert!(!encryption_parameter(&p("")).unwrap());
        assert!(!encryption_parameter(&Default::default()).unwrap());
        assert!(encryption_parameter(&p("LUKS2")).unwrap_err().contains("want \"luks2\""));
    }

    #[test]
    fn secret_names_are_dns_subdomains() {
        assert_eq!(secret_name("pvc-1234").unwrap(), "nodeplane-key-pvc-1234");
        for bad in ["Pvc", "a_b", "x-", "a..b", &"a".repeat(250)] {
            assert!(secret_name(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_local_key_is_made_once_kept_private_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let t = crate::util::TestDir::new("keys");
        let store = KeyStore::Dir(t.0.join("keys"));
        store.ensure("pvc-a", "pvc-a").await.unwrap();
        let path = key_file(&t.0.join("keys"), "pvc-a");
        let key = std::fs::read_to_string(&path).unwrap();
        assert_eq!(key.len(), 64);
        assert!(key.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        store.ensure("pvc-a", "pvc-a").await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), key, "ensure keeps the key it made");
        store.ensure("pvc-b", "pvc-b").await.unwrap();
        assert_ne!(std::fs::read_to_string(key_file(&t.0.join("keys"), "pvc-b")).unwrap(), key);
        store.remove("pvc-a", "pvc-a").await.unwrap();
        store.remove("pvc-a", "pvc-a").await.unwrap();
        assert!(!path.exists());
    }

    /// A copy's record: a fresh key, the source's keys after it as source keys; local
    /// records keep one file per entry, read back whole and removed whole.
    #[tokio::test]
    async fn a_copy_record_carries_its_sources_keys() {
        let dir = crate::util::TestDir::new("keys-copy");
        let store = KeyStore::Dir(dir.0.join("keys"));
        store.ensure("pvc-a", "pvc-a").await.unwrap();
        let a = store.read("pvc-a", "pvc-a").await.unwrap().unwrap();
        assert_eq!(a.0.keys().collect::<Vec<_>>(), ["key"]);
        let b = a.for_copy();
        assert_ne!(b.0["key"], a.0["key"]);
        assert_eq!(b.0["sourceKey"], a.0["key"]);
        let c = b.for_copy();
        assert_eq!((&c.0["sourceKey"], &c.0["sourceKey2"]), (&b.0["key"], &a.0["key"]));
        assert_eq!(c.0.len(), 3);
        assert!(!format!("{c:?}").contains(&a.0["key"]), "Debug shows no key");
        store.ensure_with("pvc-c", "pvc-c", c.clone()).await.unwrap();
        assert_eq!(store.read("pvc-c", "pvc-c").await.unwrap(), Some(c.clone()));
        store.ensure_with("pvc-c", "pvc-c", b.clone()).await.unwrap();
        assert_eq!(store.read("pvc-c", "pvc-c").await.unwrap(), Some(c), "the record made first stays");
        assert!(dir.0.join("keys/pvc-c.sourceKey2").exists());
        store.remove("pvc-c", "pvc-c").await.unwrap();
        store.remove("pvc-c", "pvc-c").await.unwrap();
        assert_eq!(store.read("pvc-c", "pvc-c").await.unwrap(), None);
        let left: Vec<_> = std::fs::read_dir(dir.0.join("keys")).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left, ["pvc-a.key"]);
    }
}
