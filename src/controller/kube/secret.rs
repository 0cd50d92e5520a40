//! The controller's token-signing (HMAC) secret in a Kubernetes Secret, so that it outlives
//! every controller pod: an `@admin` token minted today still works after a restart or a
//! reschedule (an emptyDir would lose it, silently invalidating every token).
//!
//! The Secret (default `nodeplane-controller-hmac` in the controller's namespace) holds
//! `current` (at least 32 bytes: tokens are signed with it) and, during a rollover,
//! `previous` (tokens signed with it are still accepted). Missing, it is generated once:
//! create, and on `409 AlreadyExists` (another controller starting at the same time won)
//! read the winner's, so every controller agrees. A Secret without a usable `current` gets
//! one (update at the resourceVersion read; a conflict re-reads).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

use super::ensure::Outcome;

pub const DEFAULT_NAME: &str = "nodeplane-controller-hmac";
pub const CURRENT: &str = "current";
pub const PREVIOUS: &str = "previous";
const MIN_LEN: usize = 32;

/// The keys a controller signs with (`current`) and also verifies with (`previous`).
#[derive(Clone, PartialEq, Eq)]
pub struct Keys {
    pub current: Vec<u8>,
    pub previous: Option<Vec<u8>>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys { .. }")
    }
}

fn random_key() -> Vec<u8> {
    let mut k = vec![0u8; MIN_LEN];
    crate::util::fill_random(&mut k);
    k
}

/// The keys of a Secret: Ok(None) if it has no `current` yet; an error if a key is too short.
fn keys_of(s: &Secret, what: &str) -> Result<Option<Keys>, String> {
    let data = s.data.clone().unwrap_or_default();
    let get = |k: &str| -> Result<Option<Vec<u8>>, String> {
        match data.get(k) {
            None => Ok(None),
            Some(v) if v.0.len() >= MIN_LEN => Ok(Some(v.0.clone())),
            Some(v) => Err(format!("{what}: key {k:?} holds {} bytes, fewer than {MIN_LEN}", v.0.len())),
        }
    };
    let previous = get(PREVIOUS)?;
    Ok(get(CURRENT)?.map(|current| Keys { current, previous }))
}

/// Read the Secret `namespace/name`, creating it (or its `current` key) once if missing.
pub async fn load_or_create(client: kube::Client, namespace: &str, name: &str) -> Result<Keys, String> {
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let what = format!("Secret {namespace}/{name}");
    let fresh = || {
        Ok(Secret {
            metadata: super::managed_meta(namespace, name),
            type_: Some("Opaque".into()),
            data: Some([(CURRENT.to_string(), ByteString(random_key()))].into()),
            ..Default::default()
        })
    };
    // There, but without a signing key (made empty by hand): add one.
    let fix = |s: &Secret| -> Result<Option<Secret>, String> {
        if keys_of(s, &what)?.is_some() {
            return Ok(None);
        }
        let mut s = s.clone();
        s.data.get_or_insert_with(BTreeMap::new).insert(CURRENT.into(), ByteString(random_key()));
        Ok(Some(s))
    };
    let (s, outcome) = super::ensure::ensure(&api, &what, name, fresh, fix).await?;
    match outcome {
        Outcome::Created => tracing::info!(secret = %what, "token signing secret generated"),
        Outcome::Updated => tracing::info!(secret = %what, "token signing key generated (the Secret had none)"),
        Outcome::Found => {}
    }
    keys_of(&s, &what)?.ok_or_else(|| format!("{what}: written without a key"))
}
