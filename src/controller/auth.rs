//! Credentials for the agent <-> controller API.
//!
//! A token is `np1.<identity>.<hex HMAC-SHA256(secret, identity)>`, where identity is a node
//! name or `@admin`. The controller holds the secret and mints tokens (`nodeplane-controller
//! token NODE`); it never stores per-node tokens, and verification is constant-time. A node
//! token authorises calls about that node only.
//!
//! In a cluster (`agentAuth: tokenReview`), an agent may instead present its pod's projected
//! service-account token: the API server vouches for it and names the node
//! (`super::kube::review`). HMAC tokens keep working beside it (the admin's, for one).

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const ADMIN: &str = "@admin";
const PREFIX: &str = "np1";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    Admin,
    Node(String),
}

impl Identity {
    /// May this caller act for `node`?
    pub fn may_act_for(&self, node: &str) -> bool {
        match self {
            Identity::Admin => true,
            Identity::Node(n) => n == node,
        }
    }
}

pub struct Authority {
    /// The signing key, then keys still accepted (the previous one, during a rollover).
    keys: Vec<Vec<u8>>,
    reviewer: Option<std::sync::Arc<super::kube::review::TokenReviewer>>,
}

impl Authority {
    pub fn new(secret: Vec<u8>) -> Self {
        Authority { keys: vec![secret], reviewer: None }
    }

    /// Signs with `current`; also accepts tokens signed with `previous` (a key rollover).
    pub fn with_keys(current: Vec<u8>, previous: Option<Vec<u8>>) -> Self {
        Authority { keys: std::iter::once(current).chain(previous).collect(), reviewer: None }
    }

    pub fn with_reviewer(mut self, reviewer: super::kube::review::TokenReviewer) -> Self {
        self.reviewer = Some(std::sync::Arc::new(reviewer));
        self
    }

    /// Who presents this `authorization` header value: an HMAC token, else (when configured)
    /// a service-account token the API server vouches for.
    pub async fn identify(&self, header: &str) -> Result<Identity, tonic::Status> {
        use super::kube::review::ReviewError;
        let token = header
            .strip_prefix("Bearer ")
            .map(str::trim)
            .ok_or_else(|| tonic::Status::unauthenticated("authorization is not a Bearer token"))?;
        if token.starts_with(PREFIX) || self.reviewer.is_none() {
            return self.verify(header).ok_or_else(|| tonic::Status::unauthenticated("invalid token"));
        }
        let reviewer = self.reviewer.as_ref().expect("checked above");
        match reviewer.review(token).await {
            Ok(node) => Ok(Identity::Node(node)),
            Err(ReviewError::Unauthenticated(m)) => Err(tonic::Status::unauthenticated(m)),
            Err(ReviewError::Forbidden(m)) => Err(tonic::Status::permission_denied(m)),
            Err(ReviewError::Unavailable(m)) => Err(tonic::Status::unavailable(m)),
        }
    }

    fn mac(key: &[u8], identity: &str) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
        mac.update(identity.as_bytes());
        mac
    }

    /// A token for `identity`, signed with the current key.
    pub fn mint(&self, identity: &str) -> String {
        format!("{PREFIX}.{identity}.{}", hex::encode(Self::mac(&self.keys[0], identity).finalize().into_bytes()))
    }

    /// Check an `authorization` header value ("Bearer <token>").
    pub fn verify(&self, header: &str) -> Option<Identity> {
        let token = header.strip_prefix("Bearer ")?.trim();
        let rest = token.strip_prefix(PREFIX)?.strip_prefix('.')?;
        let (identity, sig) = rest.rsplit_once('.')?;
        let sig = hex::decode(sig).ok()?;
        // Every key is tried (constant time each), so that timing says nothing about which.
        let valid = self.keys.iter().fold(false, |ok, k| Self::mac(k, identity).verify_slice(&sig).is_ok() | ok);
        if !valid {
            return None;
        }
        Some(if identity == ADMIN { Identity::Admin } else { Identity::Node(identity.to_string()) })
    }
}

/// Load the secret, creating a random one (0600) on first start.
pub fn load_or_create_secret(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    match std::fs::read(path) {
        Ok(s) if s.len() >= 32 => Ok(s),
        Ok(_) => Err(std::io::Error::other(format!("{} holds fewer than 32 bytes", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut secret = vec![0u8; 32];
            crate::util::fill_random(&mut secret);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            // Complete temp file, then hard_link: fails if another process got there first
            // (then use its secret), and nobody ever sees a half-written one.
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            crate::sys::fs::atomic_write(&tmp, &secret, 0o600)?;
            let linked = std::fs::hard_link(&tmp, path);
            let _ = std::fs::remove_file(&tmp);
            match linked {
                Ok(()) => Ok(secret),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => load_or_create_secret(path),
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mint_and_verify() {
        let a = Authority::new(b"0123456789abcdef0123456789abcdef".to_vec());
        let t = a.mint("node-1");
        assert_eq!(a.verify(&format!("Bearer {t}")), Some(Identity::Node("node-1".into())));
        assert_eq!(a.verify(&format!("Bearer {}", a.mint(ADMIN))), Some(Identity::Admin));
        // Another node's name with this node's signature is rejected.
        let forged = t.replace("node-1", "node-2");
        assert_eq!(a.verify(&format!("Bearer {forged}")), None);
        let other = Authority::new(b"another secret, 32 bytes long!!!".to_vec());
        assert_eq!(other.verify(&format!("Bearer {t}")), None);
        assert_eq!(a.verify(&t), None, "missing Bearer prefix");
        // A rollover: signed with the new key, the old one's tokens still accepted.
        let old_key = b"0123456789abcdef0123456789abcdef".to_vec();
        let new_key = b"fedcba9876543210fedcba9876543210".to_vec();
        let rolled = Authority::with_keys(new_key.clone(), Some(old_key));
        assert_eq!(rolled.verify(&format!("Bearer {t}")), Some(Identity::Node("node-1".into())));
        let fresh = rolled.mint("node-1");
        assert_ne!(fresh, t);
        assert_eq!(Authority::new(new_key).verify(&format!("Bearer {fresh}")), Some(Identity::Node("node-1".into())));
        assert_eq!(a.verify(&format!("Bearer {fresh}")), None, "the old key alone does not accept the new tokens");
        assert!(Identity::Node("a".into()).may_act_for("a"));
        assert!(!Identity::Node("a".into()).may_act_for("b"));
    }
}
