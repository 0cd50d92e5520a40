//! Agent identity in a cluster: the agent presents its projected service-account token
//! (audience `nodeplane`, bound to its pod) and the controller asks the API server about it
//! with a TokenReview. The token is accepted only if it is valid for that audience, belongs
//! to the agent's service account, and names the node its pod is bound to
//! (`authentication.kubernetes.io/node-name` in the user's extra, set by the API server for
//! pod-bound tokens since Kubernetes 1.30): that node is the caller's identity. A token
//! stolen from one node's agent therefore speaks only for that node.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::Api;
use sha2::Digest;

pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
const POSITIVE_TTL: Duration = Duration::from_secs(60);
const NEGATIVE_TTL: Duration = Duration::from_secs(5);
const CACHE_MAX: usize = 4096;
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    /// Not a valid token for this audience.
    #[error("{0}")]
    Unauthenticated(String),
    /// A valid token, but not an agent's.
    #[error("{0}")]
    Forbidden(String),
    /// The API server could not be asked; the caller may retry.
    #[error("{0}")]
    Unavailable(String),
}

/// How long a verdict is trusted: acceptances longer than refusals.
fn ttl(verdict: &Result<String, ReviewError>) -> Duration {
    if verdict.is_ok() { POSITIVE_TTL } else { NEGATIVE_TTL }
}

/// Verdicts by the token's SHA-256, with when they were given.
type Verdicts = HashMap<[u8; 32], (Instant, Result<String, ReviewError>)>;

pub struct TokenReviewer {
    api: Api<TokenReview>,
    audience: String,
    service_account: String,
    cache: Mutex<Verdicts>,
}

impl TokenReviewer {
    pub fn new(client: kube::Client, audience: &str, service_account: &str) -> Self {
        TokenReviewer {
            api: Api::all(client),
            audience: audience.into(),
            service_account: service_account.into(),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The node this token speaks for.
    pub async fn review(&self, token: &str) -> Result<String, ReviewError> {
        let key: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        if let Some((at, r)) = self.cache.lock().unwrap().get(&key)
            && at.elapsed() < ttl(r)
        {
            return r.clone();
        }
        let r = self.ask(token).await;
        if !matches!(r, Err(ReviewError::Unavailable(_))) {
            let mut c = self.cache.lock().unwrap();
            if c.len() >= CACHE_MAX {
                c.retain(|_, (at, r)| at.elapsed() < ttl(r));
                if c.len() >= CACHE_MAX {
                    c.clear();
                }
            }
            c.insert(key, (Instant::now(), r.clone()));
        }
        r
    }

    async fn ask(&self, token: &str) -> Result<String, ReviewError> {
        let tr = TokenReview {
            spec: TokenReviewSpec { token: Some(token.to_string()), audiences: Some(vec![self.audience.clone()]) },
            ..Default::default()
        };
        // Bounded: the client retries an overloaded API server, but an agent's call must not
        // hang on it.
        let answer = tokio::time::timeout(REVIEW_TIMEOUT, self.api.create(&super::post_params(), &tr))
            .await
            .map_err(|_| ReviewError::Unavailable(format!("TokenReview: no answer within {REVIEW_TIMEOUT:?}")))?
            .map_err(|e| ReviewError::Unavailable(format!("TokenReview: {e}")))?;
        judge(answer.status.unwrap_or_default(), &self.audience, &self.service_account)
    }
}

/// The verdict on a TokenReview's status.
pub fn judge(
    st: k8s_openapi::api::authentication::v1::TokenReviewStatus,
    audience: &str,
    service_account: &str,
) -> Result<String, ReviewError> {
    if st.authenticated != Some(true) {
        return Err(ReviewError::Unauthenticated(format!(
            "token not accepted by the API server{}",
            st.error.map(|e| format!(": {e}")).unwrap_or_default()
        )));
    }
    if !st.audiences.unwrap_or_default().iter().any(|a| a == audience) {
        return Err(ReviewError::Unauthenticated(format!("token is not meant for audience {audience:?}")));
    }
    let user = st.user.unwrap_or_default();
    let username = user.username.unwrap_or_default();
    if username != service_account {
        return Err(ReviewError::Forbidden(format!("{username:?} is not the agent's service account")));
    }
    let nodes = user.extra.unwrap_or_default().remove(NODE_NAME_EXTRA).unwrap_or_default();
    match nodes.as_slice() {
        [n] if crate::controller::records::valid_node_name(n) => Ok(n.clone()),
        [] => Err(ReviewError::Forbidden(format!(
            "the token names no node ({NODE_NAME_EXTRA}): use a projected token of the agent pod (Kubernetes 1.30 or newer)"
        ))),
        _ => {
            Err(ReviewError::Forbidden(format!("the token's {NODE_NAME_EXTRA} is not one valid node name: {nodes:?}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::authentication::v1::{TokenReviewStatus, UserInfo};

    fn status(auth: bool, aud: &[&str], user: &str, nodes: &[&str]) -> TokenReviewStatus {
        TokenReviewStatus {
            authenticated: Some(auth),
            audiences: Some(aud.iter().map(|s| s.to_string()).collect()),
            user: Some(UserInfo {
                username: Some(user.into()),
                extra: Some([(NODE_NAME_EXTRA.to_string(), nodes.iter().map(|s| s.to_string()).collect())].into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn verdicts() {
        let sa = "system:serviceaccount:nodeplane-system:nodeplane-agent";
        assert_eq!(judge(status(true, &["nodeplane"], sa, &["n1"]), "nodeplane", sa), Ok("n1".into()));
        assert!(matches!(
            judge(status(false, &["nodeplane"], sa, &["n1"]), "nodeplane", sa),
            Err(ReviewError::Unauthenticated(_))
        ));
        assert!(matches!(
            judge(status(true, &["other"], sa, &["n1"]), "nodeplane", sa),
            Err(ReviewError::Unauthenticated(_))
        ));
        assert!(matches!(
            judge(status(true, &["nodeplane"], "system:serviceaccount:default:default", &["n1"]), "nodeplane", sa),
            Err(ReviewError::Forbidden(_))
        ));
        assert!(matches!(
            judge(status(true, &["nodeplane"], sa, &[]), "nodeplane", sa),
            Err(ReviewError::Forbidden(_))
        ));
        assert!(matches!(
            judge(status(true, &["nodeplane"], sa, &["a", "b"]), "nodeplane", sa),
            Err(ReviewError::Forbidden(_))
        ));
        assert!(matches!(
            judge(status(true, &["nodeplane"], sa, &["Bad_Name"]), "nodeplane", sa),
            Err(ReviewError::Forbidden(_))
        ));
    }
}
