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
/// Secret names: this prefix and the volume (PV) name.
pub const SECRET_PREFIX: &str = "nodeplane-key-";

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("volume {name:?}: {SECRET_PREFIX}{name} is not a valid Secret name (a DNS subdomain)")]
    BadName { name: String },
    #[error("volume key {what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("volume key {what}: {source}")]
    Kube { what: String, source: kube::Error },
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
        match self {
            KeyStore::Dir(dir) => ensure_file(&key_file(dir, id)),
            KeyStore::Secrets { client, namespace } => ensure_secret(client, namespace, &secret_name(name)?).await,
        }
    }

    /// Remove the key of volume `name` (id `id`). Idempotent.
    pub async fn remove(&self, name: &str, id: &str) -> Result<(), KeyError> {
        match self {
            KeyStore::Dir(dir) => match std::fs::remove_file(key_file(dir, id)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(KeyError::Io { what: format!("of volume {id}"), source: e })
                }
                _ => Ok(()),
            },
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

/// `<dir>/<id>.key` (ids are plain file names: `storage::store::validate_id`).
pub fn key_file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.key"))
}

/// The Secret holding volume `name`'s key: what `nodeplane-key-${pv.name}` resolves to.
pub fn secret_name(name: &str) -> Result<String, KeyError> {
    let s = format!("{SECRET_PREFIX}{name}");
    let ok = s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if ok { Ok(s) } else { Err(KeyError::BadName { name: name.to_string() }) }
}

/// 32 random bytes as 64 hex digits.
fn new_key() -> String {
    let mut k = [0u8; 32];
    crate::util::fill_random(&mut k);
    hex::encode(k)
}

fn ensure_file(path: &Path) -> Result<(), KeyError> {
    let io = |source| KeyError::Io { what: path.display().to_string(), source };
    if path.exists() {
        return Ok(());
    }
    let dir = path.parent().expect("a key file has a directory");
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io)?;
    crate::sys::fs::atomic_write(path, new_key().as_bytes(), 0o600).map_err(io)
}

async fn ensure_secret(client: &kube::Client, namespace: &str, name: &str) -> Result<(), KeyError> {
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
        data: Some([(SECRET_KEY.to_string(), ByteString(new_key().into_bytes()))].into()),
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
}
