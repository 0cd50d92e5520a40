//! One object the controller keeps in a given shape (the HMAC Secret, the bootstrap TLS
//! Secret, the CA ConfigMap): read it; create it when missing; bring it up to date when it
//! is there but not usable. Two controllers starting at once race on the create (`409
//! AlreadyExists`: the winner's object is re-read and used) or on the update (`409
//! Conflict` at the resourceVersion read: re-read and decide again), so all of them end
//! with the same object.

use kube::api::Api;

const ATTEMPTS: usize = 5;

/// What [`ensure`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The object was there and usable.
    Found,
    Created,
    Updated,
}

/// Read `name`; when missing create `fresh()`; when present, `fix(existing)` says whether it
/// must change (Some(the object to write), replaced at the resourceVersion read) or is
/// usable as it is (None). Returns the object as stored, and what was done.
pub async fn ensure<K, E: std::fmt::Display>(
    api: &Api<K>,
    what: &str,
    name: &str,
    fresh: impl Fn() -> Result<K, E>,
    fix: impl Fn(&K) -> Result<Option<K>, E>,
) -> Result<(K, Outcome), String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    for _ in 0..ATTEMPTS {
        match api.get_opt(name).await.map_err(|e| format!("reading {what}: {e}"))? {
            Some(existing) => {
                let Some(changed) = fix(&existing).map_err(|e| e.to_string())? else {
                    return Ok((existing, Outcome::Found));
                };
                match api.replace(name, &super::post_params(), &changed).await {
                    Ok(stored) => return Ok((stored, Outcome::Updated)),
                    Err(e) if super::is_conflict(&e) => continue,
                    Err(e) => return Err(format!("updating {what}: {e}")),
                }
            }
            None => match api.create(&super::post_params(), &fresh().map_err(|e| e.to_string())?).await {
                Ok(stored) => return Ok((stored, Outcome::Created)),
                // Another controller made it first: use (and judge) that one.
                Err(e) if super::is_already_exists(&e) => continue,
                Err(e) => return Err(format!("creating {what}: {e}")),
            },
        }
    }
    Err(format!("{what}: kept changing while it was read ({ATTEMPTS} attempts)"))
}
