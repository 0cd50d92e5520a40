//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics:
//!
//! - a candidate takes the lease when it is free (no holder) or when the holder has not
//!   renewed it for `leaseDurationSeconds` *as observed by the candidate's own clock* (the
//!   time the candidate last saw the record change, never the holder's timestamps: clocks
//!   of different machines are not compared);
//! - every write carries the resourceVersion read, so two candidates cannot both win: the
//!   second gets Conflict;
//! - the leader renews every `retry_period`; when it could not renew for `renew_deadline`
//!   (shorter than the lease duration) or sees another holder, it has lost and must stop
//!   acting as leader at once (the controller exits; its Deployment restarts it);
//! - on a clean shutdown the leader releases the lease (empty holder), so a successor takes
//!   over without waiting for expiry.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta};

use crate::controller::backend::BackendError;

/// The Lease, this candidate's name in it and the election's timings (`store` in the
/// configuration).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSettings {
    pub namespace: String,
    pub lease_name: String,
    /// This candidate (the pod name).
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

/// What one attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// This candidate holds the lease (acquired or renewed).
    Leading,
    /// Someone else holds it and it has not expired.
    HeldBy(String),
    /// Lost a race (Conflict / AlreadyExists): try again after the retry period.
    Raced,
}

/// What the leader may rely on: it holds the lease until `renew_deadline` after the start of
/// its last successful renewal (a candidate waits the longer `leaseDuration` from when it
/// last saw a change). The state backend checks this before every API call, and trips it
/// when it finds another writer's change.
pub struct Fence {
    state: std::sync::Mutex<(Option<Instant>, Option<String>)>,
    /// The Lease it stands for: a writer that meets a conflict reads it to tell another
    /// controller (a new holder) from any other client.
    lease: LeaseSettings,
}

impl Fence {
    pub fn lease(&self) -> &LeaseSettings {
        &self.lease
    }

    /// A renewal that started at `at` succeeded.
    pub fn renewed(&self, at: Instant) {
        let mut st = self.state.lock().unwrap();
        if st.0.is_none_or(|t| at > t) {
            st.0 = Some(at);
        }
    }

    /// Leadership is gone for good (this process must stop).
    pub fn lose(&self, why: &str) {
        let mut st = self.state.lock().unwrap();
        if st.1.is_none() {
            tracing::error!(reason = why, "leadership fence tripped");
            st.1 = Some(why.to_string());
        }
    }

    pub fn lost(&self) -> Option<String> {
        self.state.lock().unwrap().1.clone()
    }

    pub fn check(&self) -> Result<(), BackendError> {
        let st = self.state.lock().unwrap();
        if let Some(why) = &st.1 {
            return Err(BackendError::NotLeader(format!("not the leader any more ({why}): refusing to write")));
        }
        match st.0 {
            Some(t) if t.elapsed() < self.lease.renew_deadline => Ok(()),
            Some(_) => Err(BackendError::NotLeader(format!(
                "the leader lease was not renewed within {:?}: refusing to write",
                self.lease.renew_deadline
            ))),
            None => Err(BackendError::NotLeader("not the leader: refusing to write".into())),
        }
    }
}

pub struct Elector {
    api: Api<Lease>,
    s: LeaseSettings,
    fence: std::sync::Arc<Fence>,
    /// (holder, renewTime, leaseDurationSeconds, resourceVersion) last seen, and when it was
    /// first seen like that.
    observed: Option<(String, Option<String>, i32, String, Instant)>,
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

impl Elector {
    pub fn new(client: kube::Client, s: LeaseSettings) -> Self {
        let fence = std::sync::Arc::new(Fence { state: Default::default(), lease: s.clone() });
        Elector { api: Api::namespaced(client, &s.namespace), s, fence, observed: None }
    }

    /// The fence this elector keeps up to date.
    pub fn fence(&self) -> std::sync::Arc<Fence> {
        self.fence.clone()
    }

    fn spec(&self, prev: Option<&LeaseSpec>) -> LeaseSpec {
        let t = now();
        let ours = prev.and_then(|p| p.holder_identity.as_deref()) == Some(self.s.identity.as_str());
        let transitions = prev.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(self.s.identity.clone()),
            lease_duration_seconds: Some(self.s.lease_duration.as_secs().max(1) as i32),
            acquire_time: if ours { prev.and_then(|p| p.acquire_time.clone()) } else { Some(t.clone()) },
            renew_time: Some(t),
            lease_transitions: Some(if ours || prev.is_none() { transitions } else { transitions + 1 }),
            ..Default::default()
        }
    }

    /// One try to acquire or renew.
    pub async fn try_acquire_or_renew(&mut self) -> Result<Attempt, kube::Error> {
        self.try_renew().await.map(|(a, _)| a)
    }

    /// One try; also whether the lease was already ours when read (a renewal, not an
    /// acquisition).
    async fn try_renew(&mut self) -> Result<(Attempt, bool), kube::Error> {
        let started = Instant::now();
        let mut was_ours = false;
        let r = self.attempt(&mut was_ours).await;
        if matches!(r, Ok(Attempt::Leading)) {
            self.fence.renewed(started);
        }
        r.map(|a| (a, was_ours))
    }

    async fn attempt(&mut self, was_ours: &mut bool) -> Result<Attempt, kube::Error> {
        let current = match self.api.get_opt(&self.s.lease_name).await? {
            None => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.s.lease_name.clone()),
                        namespace: Some(self.s.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(self.spec(None)),
                };
                return match self.api.create(&super::post_params(), &lease).await {
                    Ok(_) => Ok(Attempt::Leading),
                    Err(e) if super::is_already_exists(&e) => Ok(Attempt::Raced),
                    Err(e) => Err(e),
                };
            }
            Some(l) => l,
        };
        let spec = current.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let duration = spec.lease_duration_seconds.unwrap_or(self.s.lease_duration.as_secs() as i32).max(1);
        let key = (
            holder.clone(),
            spec.renew_time.as_ref().map(|t| t.0.to_string()),
            duration,
            current.metadata.resource_version.clone().unwrap_or_default(),
        );
        let seen_at = match &self.observed {
            Some((h, r, d, rv, at)) if (h, r, d, rv) == (&key.0, &key.1, &key.2, &key.3) => *at,
            _ => {
                let at = Instant::now();
                self.observed = Some((key.0, key.1, key.2, key.3, at));
                at
            }
        };
        let ours = holder == self.s.identity;
        *was_ours = ours;
        if !holder.is_empty() && !ours && seen_at.elapsed() < Duration::from_secs(duration as u64) {
            return Ok(Attempt::HeldBy(holder));
        }
        let mut next = current.clone();
        next.spec = Some(self.spec(Some(&spec)));
        match self.api.replace(&self.s.lease_name, &super::post_params(), &next).await {
            Ok(l) => {
                let s = l.spec.clone().unwrap_or_default();
                self.observed = Some((
                    s.holder_identity.unwrap_or_default(),
                    s.renew_time.map(|t| t.0.to_string()),
                    s.lease_duration_seconds.unwrap_or(duration),
                    l.metadata.resource_version.unwrap_or_default(),
                    Instant::now(),
                ));
                if !ours {
                    tracing::info!(lease = %self.s.lease_name, previous = %holder, "leader lease acquired");
                }
                Ok(Attempt::Leading)
            }
            Err(e) if super::is_conflict(&e) => Ok(Attempt::Raced),
            Err(e) => Err(e),
        }
    }

    /// Wait until this candidate leads. `waiting` is told who holds the lease meanwhile.
    pub async fn acquire(&mut self, mut waiting: impl FnMut(&str)) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(Attempt::Leading) => return,
                Ok(Attempt::HeldBy(h)) => waiting(&format!("held by {h}")),
                Ok(Attempt::Raced) => waiting("lost a race for the lease"),
                Err(e) => {
                    tracing::warn!(error = %e, lease = %self.s.lease_name, "leader election: API error");
                    waiting(&format!("API error: {e}"));
                }
            }
            tokio::time::sleep(jitter(self.s.retry_period)).await;
        }
    }

    /// Renew until leadership is lost (returns why), or until `stop` resolves (then release
    /// the lease and return None).
    pub async fn keep(&mut self, stop: impl std::future::Future<Output = ()>) -> Option<String> {
        let mut last_renew = Instant::now();
        let fence = self.fence.clone();
        let lost = move |why: String| {
            fence.lose(&why);
            Some(why)
        };
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => {
                    self.release().await;
                    return None;
                }
                _ = tokio::time::sleep(self.s.retry_period) => {}
            }
            if let Some(why) = self.fence.lost() {
                return Some(why);
            }
            // Measured from the start of the attempt: a slow answer must not stretch the time
            // this leader believes it holds the lease.
            let started = Instant::now();
            let attempt = tokio::time::timeout(self.s.renew_deadline, self.try_renew()).await;
            match attempt {
                Ok(Ok((Attempt::Leading, true))) => last_renew = started,
                // The lease was free (released or emptied by someone else) and this renewal
                // took it again: another holder may have led meanwhile, so what this process
                // knows may be stale.
                Ok(Ok((Attempt::Leading, false))) => {
                    return lost("the lease was released or taken over by someone else meanwhile".to_string());
                }
                Ok(Ok((Attempt::HeldBy(h), _))) => return lost(format!("the lease is now held by {h}")),
                Ok(Ok((Attempt::Raced, _))) => {
                    tracing::warn!(lease = %self.s.lease_name, "lease renewal raced with another writer")
                }
                Ok(Err(e)) => tracing::warn!(error = %e, lease = %self.s.lease_name, "lease renewal failed"),
                Err(_) => tracing::warn!(lease = %self.s.lease_name, "lease renewal timed out"),
            }
            if last_renew.elapsed() >= self.s.renew_deadline {
                return lost(format!("could not renew the lease for {:?}", self.s.renew_deadline));
            }
        }
    }

    /// Give the lease up (empty holder) if we still hold it, so a successor need not wait.
    pub async fn release(&mut self) {
        let Ok(Some(mut l)) = self.api.get_opt(&self.s.lease_name).await else { return };
        let Some(spec) = l.spec.as_mut() else { return };
        if spec.holder_identity.as_deref() != Some(self.s.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(now());
        match self.api.replace(&self.s.lease_name, &super::post_params(), &l).await {
            Ok(_) => tracing::info!(lease = %self.s.lease_name, "leader lease released"),
            Err(e) => tracing::warn!(error = %e, lease = %self.s.lease_name, "could not release the leader lease"),
        }
    }
}

/// The retry period plus up to 20% (candidates do not all ask at once).
fn jitter(d: Duration) -> Duration {
    let mut b = [0u8; 1];
    crate::util::fill_random(&mut b);
    d + d.mul_f64(b[0] as f64 / 255.0 * 0.2)
}
