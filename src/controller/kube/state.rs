//! The controller's state as Kubernetes objects (cluster-scoped custom resources of
//! `nodeplane.dev/v1alpha1`), behind the same [`Backend`] interface as the embedded store.
//!
//! - `NodeplaneNode` (name = node name): `spec.underlay`, `spec.vtepMac`, `spec.blocks` (in
//!   allocation order). The record.
//! - `IPBlock` (name derived from the CIDR): `spec.cidr`, `spec.node`. A lock: the API server
//!   refuses a second object of the same name (AlreadyExists), so no block can be held twice
//!   even if two controllers ever wrote at once.
//! - `NodeplaneVolume` (name derived from the volume id): the volume book's record.
//!
//! Writes carry the resourceVersion last seen (optimistic concurrency). A write that meets
//! `409 Conflict` re-reads the object and the leader Lease: if the Lease is still this
//! controller's, the other writer was not a controller (an operator's `kubectl label`, a GitOps
//! tool), so the write is merged (the other writer's labels, annotations and other metadata
//! kept, this controller's spec and own labels put) and retried; only when another holder wrote
//! the Lease is it a conflict that fences this controller. Without a Lease (a backend built
//! without one, in tests) a conflict cannot be attributed and always fences.
//!
//! Node names are never put into a label value as they are (a node name may have 253
//! characters, a label value 63): objects carry the label `nodeplane.dev/node-hash` (the
//! SHA-224 of the name, 56 hex digits: bounded and collision-resistant, for selectors) and the
//! full name in the annotation `nodeplane.dev/node` (and in `spec.node`). Every object name
//! and label is checked against Kubernetes' rules before it is written. Objects written with
//! the old label `nodeplane.dev/node` (the name itself) are read as before (nothing selects on
//! labels: every load lists all objects and reads the spec), and lose that label the next time
//! they are rewritten.
//!
//! Order of writes, so that a crash at any point leaves a state [`KubeBackend::load_nodes`]
//! repairs: a node's new blocks are locked *before* its record names them; a record is
//! rewritten (or deleted) *before* the locks of blocks it gave up are deleted. At load, a
//! lock no record names is deleted (a crash between lock and record), a record whose block
//! has no lock gets it back, and a block locked for another node than the record says is an
//! error (the controller refuses to start rather than hand out a block twice).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::core::{ApiResource, DynamicObject, ObjectMeta};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{block_resource, is_already_exists, is_not_found, node_resource, volume_resource};
use crate::controller::backend::{Backend, BackendError, Change};
use crate::controller::records::{NodeRecord, VolumeRecord};

use super::MANAGED_BY;
/// The label selecting a node's objects: [`node_hash`] of its name.
pub const NODE_HASH_LABEL: &str = "nodeplane.dev/node-hash";
/// The annotation with the node's full name.
pub const NODE_ANNOTATION: &str = "nodeplane.dev/node";
/// The label of earlier versions holding the node name itself (invalid for names over 63
/// characters): removed when an object is rewritten.
const LEGACY_NODE_LABEL: &str = "nodeplane.dev/node";
/// How often a write that keeps meeting other (non-controller) writers is merged and retried.
const MERGE_ATTEMPTS: usize = 5;
/// Bound on one backend call (several API requests).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// A lock no record names is released at load only when older than this: a younger one may
/// belong to a commit still in flight from a previous leader (its record written after we
/// listed the records). Far above any lease duration plus call timeout.
const STALE_LOCK_AGE: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NodeSpec {
    underlay: Vec<String>,
    #[serde(default)]
    vtep_mac: String,
    #[serde(default)]
    blocks: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    wireguard_key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockSpec {
    cidr: String,
    node: String,
}

/// The object name of a block's lock: `v4-`/`v6-` and the CIDR with `.`, `:` and `/` as `-`
/// (`10.8.1.0/24` → `v4-10-8-1-0-24`, `fd00:8::/64` → `v6-fd00-8---64`). Injective (the
/// canonical text is), and always a valid name, also for CIDRs whose text starts with `::`.
pub fn block_object_name(cidr: &str) -> String {
    let (family, canonical) = match cidr.parse::<ipnetwork::IpNetwork>() {
        Ok(n) => (if n.is_ipv4() { "v4" } else { "v6" }, n.to_string()),
        Err(_) => ("x", cidr.to_string()),
    };
    format!("{family}-{}", canonical.replace(['.', ':', '/'], "-"))
}

/// The object name of a volume's record: the id itself when it is a valid object name,
/// else `v-` and a hash of it.
pub fn volume_object_name(id: &str) -> String {
    if crate::controller::records::valid_node_name(id) {
        return id.to_string();
    }
    use sha2::Digest;
    format!("v-{}", hex::encode(&sha2::Sha256::digest(id.as_bytes())[..16]))
}

/// The value of [`NODE_HASH_LABEL`] for a node: SHA-224 of its name in hex (56 characters,
/// a valid label value for any name; `printf %s NAME | sha224sum`).
pub fn node_hash(node: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha224::digest(node.as_bytes()))
}

/// Labels or annotations, as key and value.
type Pairs = Vec<(String, String)>;

/// The labels and annotations this controller puts on an object about `node`.
fn node_meta(node: &str) -> (Pairs, Pairs) {
    let mut labels = vec![(MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string())];
    let mut annotations = Vec::new();
    if !node.is_empty() {
        labels.push((NODE_HASH_LABEL.to_string(), node_hash(node)));
        annotations.push((NODE_ANNOTATION.to_string(), node.to_string()));
    }
    (labels, annotations)
}

/// What this controller last saw of an object it wrote or read: the resourceVersion its next
/// write carries, and the metadata other clients put there (kept on rewrite).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Seen {
    rv: String,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

impl Seen {
    fn of(o: &DynamicObject) -> Seen {
        Seen {
            rv: o.metadata.resource_version.clone().unwrap_or_default(),
            labels: o.metadata.labels.clone().unwrap_or_default(),
            annotations: o.metadata.annotations.clone().unwrap_or_default(),
        }
    }
}

/// The object to write: `spec`, this controller's labels and annotations over those `seen`
/// (another client's are kept; the legacy node label is dropped), at `seen`'s
/// resourceVersion (a create without it). Checked against Kubernetes' rules first.
fn object(
    res: &ApiResource,
    name: &str,
    node: &str,
    spec: serde_json::Value,
    seen: Option<&Seen>,
) -> Result<DynamicObject, BackendError> {
    let (ours, our_annotations) = node_meta(node);
    let mut labels = seen.map(|s| s.labels.clone()).unwrap_or_default();
    labels.remove(LEGACY_NODE_LABEL);
    labels.extend(ours);
    let mut annotations = seen.map(|s| s.annotations.clone()).unwrap_or_default();
    annotations.extend(our_annotations);
    super::check_object(&res.kind, name, &labels).map_err(BackendError::Refused)?;
    let mut o = DynamicObject::new(name, res);
    o.metadata = ObjectMeta {
        name: Some(name.to_string()),
        labels: Some(labels),
        annotations: (!annotations.is_empty()).then_some(annotations),
        resource_version: seen.map(|s| s.rv.clone()),
        ..Default::default()
    };
    o.data = json!({ "spec": spec });
    Ok(o)
}

/// `ours` merged onto `current` (another writer's version): its metadata with our labels and
/// annotations over its own, our spec, at its resourceVersion.
fn merged(current: &DynamicObject, ours: &DynamicObject) -> DynamicObject {
    let mut o = current.clone();
    let mut labels = current.metadata.labels.clone().unwrap_or_default();
    labels.remove(LEGACY_NODE_LABEL);
    labels.extend(ours.metadata.labels.clone().unwrap_or_default());
    o.metadata.labels = Some(labels);
    let mut annotations = current.metadata.annotations.clone().unwrap_or_default();
    annotations.extend(ours.metadata.annotations.clone().unwrap_or_default());
    o.metadata.annotations = (!annotations.is_empty()).then_some(annotations);
    o.metadata.managed_fields = None;
    o.data["spec"] = ours.data["spec"].clone();
    o
}

fn spec_of<T: serde::de::DeserializeOwned>(o: &DynamicObject) -> Result<T, BackendError> {
    let name = o.metadata.name.as_deref().unwrap_or("?");
    let spec = o.data.get("spec").cloned().ok_or_else(|| BackendError::Corrupt(format!("{name}: no spec")))?;
    serde_json::from_value(spec).map_err(|e| BackendError::Corrupt(format!("{name}: bad spec: {e}")))
}

#[derive(Default)]
struct Known {
    /// node name -> (record, what was seen of its object)
    nodes: HashMap<String, (NodeRecord, Seen)>,
    /// volume object name -> what was seen of it
    volumes: HashMap<String, Seen>,
}

/// Who may settle a conflict: the leader Lease this controller holds (see the module
/// documentation). Cheap to clone into a call.
#[derive(Clone)]
struct Leadership {
    leases: Api<k8s_openapi::api::coordination::v1::Lease>,
    lease: super::lease::LeaseSettings,
    fence: Arc<super::lease::Fence>,
}

impl Leadership {
    /// Ok if this controller still holds the Lease: then a conflict was another client's,
    /// not another controller's. A Lease held by someone else is a fencing conflict.
    async fn still_ours(this: &Option<Leadership>, what: &str, e: &kube::Error) -> Result<(), PutError> {
        let Some(l) = this else {
            return Err(PutError::Conflict(format!(
                "{what} was changed by another writer since this controller read it ({e}), and without a leader \
                 Lease that writer may be another controller. This controller stops serving; it re-reads the state \
                 when restarted"
            )));
        };
        l.fence.check().map_err(PutError::Refused)?;
        match l.leases.get_opt(&l.lease.lease_name).await {
            Ok(Some(lease)) => {
                let holder = lease.spec.and_then(|s| s.holder_identity).unwrap_or_default();
                if holder == l.lease.identity {
                    Ok(())
                } else {
                    Err(PutError::Conflict(format!(
                        "{what} was changed by another writer ({e}) and the leader Lease {}/{} is now held by {holder:?}: \
                         another controller leads. This controller stops serving",
                        l.lease.namespace, l.lease.lease_name
                    )))
                }
            }
            Ok(None) => Err(PutError::Refused(BackendError::Unavailable(format!(
                "{what} was changed by another writer ({e}) and the leader Lease {}/{} is missing: not writing until it \
                 is renewed",
                l.lease.namespace, l.lease.lease_name
            )))),
            Err(g) => Err(PutError::Refused(BackendError::Unavailable(format!(
                "{what} was changed by another writer ({e}); reading the leader Lease to tell who: {g}"
            )))),
        }
    }
}

pub struct KubeBackend {
    rt: RuntimeThread,
    fence: Option<Arc<super::lease::Fence>>,
    /// Blocks locked by no record, too young to release (see `load_nodes`).
    reserved: Mutex<Vec<String>>,
    nodes: Api<DynamicObject>,
    blocks: Api<DynamicObject>,
    volumes: Api<DynamicObject>,
    /// The CustomResourceDefinitions: the volume records' own is their store's identity.
    crds: Api<DynamicObject>,
    leadership: Option<Leadership>,
    known: Mutex<Known>,
}

/// A tokio runtime on its own thread: the backend interface is synchronous (the registry and
/// the book commit under their locks, from any thread), so calls are sent here and waited
/// for, and never nest one runtime inside another.
struct RuntimeThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl RuntimeThread {
    fn start() -> Result<Self, BackendError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("kube-state".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(BackendError::Io(e.to_string())));
                        return;
                    }
                };
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(|e| BackendError::Io(e.to_string()))?;
        let handle = rx.recv().map_err(|e| BackendError::Io(e.to_string()))??;
        Ok(RuntimeThread { handle, stop: Some(stop) })
    }

    fn run<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = Result<T, BackendError>> + Send + 'static,
    ) -> Result<T, BackendError> {
        self.run_within(Some(CALL_TIMEOUT), f)
    }

    /// `bound` None: the call bounds its own requests (the paged loads: each page bounded,
    /// the whole by the cluster's size).
    fn run_within<T: Send + 'static>(
        &self,
        bound: Option<Duration>,
        f: impl std::future::Future<Output = Result<T, BackendError>> + Send + 'static,
    ) -> Result<T, BackendError> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.handle.spawn(async move {
            let r = match bound {
                None => f.await,
                Some(b) => match tokio::time::timeout(b, f).await {
                    Ok(r) => r,
                    Err(_) => Err(BackendError::Unavailable(format!("the Kubernetes API did not answer within {b:?}"))),
                },
            };
            let _ = tx.send(r);
        });
        rx.recv().map_err(|_| BackendError::Unavailable("the Kubernetes state thread stopped".to_string()))?
    }
}

impl Drop for RuntimeThread {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// A failed API call as a backend error: refused when the API answered with a client error
/// (see [`definitely_refused`]), else unavailable (the API was not reached, timed out or
/// failed on its side).
fn api_error(e: &kube::Error, message: String) -> BackendError {
    if definitely_refused(e) { BackendError::Refused(message) } else { BackendError::Unavailable(message) }
}

fn err(what: impl std::fmt::Display) -> impl FnOnce(kube::Error) -> BackendError {
    move |e| {
        let message = format!("{what}: {e}");
        api_error(&e, message)
    }
}

impl KubeBackend {
    /// A backend on a client built from this kube configuration (its own connection pool,
    /// on the backend's own runtime).
    ///
    /// With a `fence`, every call is refused once this controller may have lost the leader
    /// lease, and a write that finds another writer's change trips the fence.
    pub fn new(config: kube::Config, fence: Option<Arc<super::lease::Fence>>) -> Result<Self, BackendError> {
        let rt = RuntimeThread::start()?;
        let config = super::named(config);
        let client = rt.run(async move {
            kube::Client::try_from(config).map_err(|e| BackendError::Unavailable(format!("Kubernetes client: {e}")))
        })?;
        let leadership = fence.as_ref().map(|f| {
            let lease = f.lease().clone();
            Leadership { leases: Api::namespaced(client.clone(), &lease.namespace), lease, fence: f.clone() }
        });
        Ok(KubeBackend {
            leadership,
            nodes: Api::all_with(client.clone(), &node_resource()),
            blocks: Api::all_with(client.clone(), &block_resource()),
            volumes: Api::all_with(client.clone(), &volume_resource()),
            crds: Api::all_with(client, &super::crd_resource()),
            rt,
            fence,
            reserved: Mutex::new(Vec::new()),
            known: Mutex::new(Known::default()),
        })
    }

    async fn lock_block(blocks: &Api<DynamicObject>, cidr: &str, node: &str) -> Result<(), PutError> {
        let name = block_object_name(cidr);
        let spec = serde_json::to_value(BlockSpec { cidr: cidr.into(), node: node.into() })
            .map_err(|e| PutError::Refused(BackendError::Corrupt(e.to_string())))?;
        let obj = object(&block_resource(), &name, node, spec, None).map_err(PutError::Refused)?;
        let e = match blocks.create(&super::post_params(), &obj).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        // Already there (a retried commit, or another holder), or the create's fate is
        // unknown: the lock object says which.
        match blocks.get_opt(&name).await {
            Ok(Some(cur)) => {
                let held: BlockSpec = spec_of(&cur).map_err(PutError::Refused)?;
                if held.node == node && held.cidr == cidr {
                    Ok(())
                } else {
                    Err(PutError::Refused(BackendError::Corrupt(format!(
                        "block {cidr} is locked for node {:?} in the API (IPBlock {name})",
                        held.node
                    ))))
                }
            }
            // No lock there (also after an unknown outcome: the create did not happen).
            Ok(None) => Err(PutError::Refused(api_error(&e, format!("locking block {cidr} (IPBlock {name}): {e}")))),
            Err(g) => {
                Err(PutError::Unknown(format!("locking block {cidr} (IPBlock {name}): {e}; reading it back: {g}")))
            }
        }
    }

    /// Release the locks of `cidrs`; a lock left behind (logged) is released at a later load.
    async fn unlock_blocks(blocks: &Api<DynamicObject>, cidrs: &[String]) {
        for cidr in cidrs {
            let name = block_object_name(cidr);
            match blocks.delete(&name, &DeleteParams::default()).await {
                Err(e) if !is_not_found(&e) => {
                    let e = api_error(&e, format!("releasing block {cidr} (IPBlock {name}): {e}"));
                    tracing::warn!(error = %e, "block lock left behind");
                }
                _ => {}
            }
        }
    }

    /// A write's outcome as the backend answers it; a conflict trips the fence.
    fn settle<T>(&self, outcome: Result<T, PutError>) -> Result<T, BackendError> {
        if let (Err(PutError::Conflict(_)), Some(f)) = (&outcome, &self.fence) {
            f.lose("another writer changed the controller's objects");
        }
        outcome.map_err(BackendError::from)
    }

    fn check_fence(&self) -> Result<(), BackendError> {
        self.fence.as_ref().map_or(Ok(()), |f| f.check())
    }
}

/// Why a write did not happen.
#[derive(Debug, Clone)]
enum PutError {
    /// Refused (by the API, or because what is there forbids it): nothing was written.
    Refused(BackendError),
    /// Another writer changed the object since it was read.
    Conflict(String),
    /// Unknown: it may or may not have been written.
    Unknown(String),
}

impl std::fmt::Display for PutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PutError::Refused(e) => e.fmt(f),
            PutError::Conflict(m) | PutError::Unknown(m) => f.write_str(m),
        }
    }
}

impl From<PutError> for BackendError {
    fn from(e: PutError) -> Self {
        match e {
            PutError::Refused(e) => e,
            PutError::Conflict(m) => BackendError::Conflict(m),
            PutError::Unknown(m) => BackendError::Unavailable(m),
        }
    }
}

/// The API answered with a client error: the request was not applied. (A timeout, a server
/// error or a broken connection says nothing about whether it was.)
fn definitely_refused(e: &kube::Error) -> bool {
    super::api_status(e).is_some_and(|s| (400..500).contains(&s.code) && s.code != 408)
}

/// Create, or replace at the resourceVersion last seen; what the object is now. A write
/// refused for a stale resourceVersion, or whose fate is unknown, is settled by reading the
/// object back: if it already holds exactly this spec, it is written (by this controller,
/// just now or by an earlier attempt whose answer was lost). Another client's change (the
/// Lease still ours) is merged and the write retried; see the module documentation.
async fn put(
    api: &Api<DynamicObject>,
    mut obj: DynamicObject,
    what: &str,
    leader: &Option<Leadership>,
) -> Result<Seen, PutError> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    for _ in 0..MERGE_ATTEMPTS {
        let written = if obj.metadata.resource_version.is_some() {
            api.replace(&name, &super::post_params(), &obj).await
        } else {
            api.create(&super::post_params(), &obj).await
        };
        let e = match written {
            Ok(o) => return Ok(Seen::of(&o)),
            Err(e) => e,
        };
        let conflict = super::is_conflict(&e) || is_already_exists(&e);
        if definitely_refused(&e) && !conflict {
            return Err(PutError::Refused(BackendError::Refused(format!("writing {what}: {e}"))));
        }
        let current = match api.get_opt(&name).await {
            Ok(Some(cur)) if cur.data.get("spec") == obj.data.get("spec") => return Ok(Seen::of(&cur)),
            Ok(cur) if conflict => cur,
            Ok(_) => {
                return Err(PutError::Refused(api_error(&e, format!("writing {what}: {e} (read back: not written)"))));
            }
            Err(g) => return Err(PutError::Unknown(format!("writing {what}: {e}; reading it back: {g}"))),
        };
        Leadership::still_ours(leader, what, &e).await?;
        obj = match current {
            Some(cur) => {
                tracing::info!(object = %what, "another client changed the object (the leader Lease is still ours): merging and retrying");
                merged(&cur, &obj)
            }
            // Deleted meanwhile by another client: create it again.
            None => {
                obj.metadata.resource_version = None;
                obj
            }
        };
    }
    Err(PutError::Refused(BackendError::Unavailable(format!(
        "writing {what}: it kept being changed by other clients ({MERGE_ATTEMPTS} attempts); retry later"
    ))))
}

/// Delete at the resourceVersion last seen; absent is success. Another client's change (the
/// Lease still ours) does not stop it: the delete is retried at the new resourceVersion.
async fn remove(
    api: &Api<DynamicObject>,
    name: &str,
    rv: Option<String>,
    what: &str,
    leader: &Option<Leadership>,
) -> Result<(), PutError> {
    let mut rv = rv;
    for _ in 0..MERGE_ATTEMPTS {
        let dp = DeleteParams {
            preconditions: rv.clone().map(|rv| Preconditions { resource_version: Some(rv), uid: None }),
            ..Default::default()
        };
        let e = match api.delete(name, &dp).await {
            Ok(_) => return Ok(()),
            Err(e) if is_not_found(&e) => return Ok(()),
            Err(e) => e,
        };
        if super::is_conflict(&e) {
            Leadership::still_ours(leader, what, &e).await?;
            match api.get_opt(name).await {
                Ok(None) => return Ok(()),
                Ok(Some(cur)) => {
                    rv = cur.metadata.resource_version.clone();
                    continue;
                }
                Err(g) => {
                    return Err(PutError::Refused(api_error(
                        &e,
                        format!("deleting {what}: {e}; reading it back: {g}"),
                    )));
                }
            }
        }
        if definitely_refused(&e) {
            return Err(PutError::Refused(BackendError::Refused(format!("deleting {what}: {e}"))));
        }
        return match api.get_opt(name).await {
            Ok(None) => Ok(()),
            Ok(Some(_)) => {
                Err(PutError::Refused(api_error(&e, format!("deleting {what}: {e} (read back: still there)"))))
            }
            Err(g) => Err(PutError::Unknown(format!("deleting {what}: {e}; reading it back: {g}"))),
        };
    }
    Err(PutError::Refused(BackendError::Unavailable(format!(
        "deleting {what}: it kept being changed by other clients ({MERGE_ATTEMPTS} attempts); retry later"
    ))))
}

impl Backend for KubeBackend {
    fn load_nodes(&self) -> Result<(Vec<NodeRecord>, u64), BackendError> {
        self.check_fence()?;
        let (nodes, blocks) = (self.nodes.clone(), self.blocks.clone());
        let (records, revision, reserved) = self.rt.run_within(None, async move {
            let (items, version) = super::list_all(&nodes, &ListParams::default()).await.map_err(err("listing nodeplanenodes"))?;
            let revision = version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0u64);
            let mut records = Vec::new();
            for o in &items {
                let name = o.metadata.name.clone().unwrap_or_default();
                let spec: NodeSpec = spec_of(o)?;
                let rec = NodeRecord {
                    name,
                    underlay: spec.underlay,
                    vtep_mac: spec.vtep_mac,
                    blocks: spec.blocks,
                    wireguard_key: spec.wireguard_key,
                };
                records.push((rec, Seen::of(o)));
            }
            // Locks are listed after the records: a lock written meanwhile is younger than
            // STALE_LOCK_AGE and only reserved below, never released.
            let (locks, _) = super::list_all(&blocks, &ListParams::default()).await.map_err(err("listing ipblocks"))?;
            let mut held: HashMap<String, (String, Option<k8s_openapi::jiff::Timestamp>, Option<String>)> = HashMap::new();
            for o in &locks {
                let spec: BlockSpec = spec_of(o)?;
                let name = o.metadata.name.clone().unwrap_or_default();
                if name != block_object_name(&spec.cidr) {
                    return Err(BackendError::Corrupt(format!("IPBlock {name} does not match its cidr {}", spec.cidr)));
                }
                held.insert(spec.cidr, (spec.node, o.metadata.creation_timestamp.as_ref().map(|t| t.0), o.metadata.uid.clone()));
            }
            let mut named = HashSet::new();
            for (rec, _) in &records {
                for b in &rec.blocks {
                    named.insert(b.clone());
                    match held.get(b) {
                        Some((n, _, _)) if n == &rec.name => {}
                        Some((n, _, _)) => {
                            return Err(BackendError::Corrupt(format!(
                                "block {b} is in node {}'s record but locked for node {n}",
                                rec.name
                            )));
                        }
                        None => {
                            tracing::warn!(block = %b, node = %rec.name, "block lock missing; restoring it");
                            KubeBackend::lock_block(&blocks, b, &rec.name).await?;
                        }
                    }
                }
            }
            let now = k8s_openapi::jiff::Timestamp::now();
            let mut reserved = Vec::new();
            for (cidr, (node, created, uid)) in &held {
                if named.contains(cidr) {
                    continue;
                }
                let age = created.map(|c| now.duration_since(c).unsigned_abs()).unwrap_or_default();
                if age < STALE_LOCK_AGE {
                    tracing::warn!(block = %cidr, node = %node, ?age, "block locked but in no node's record, and recent: kept reserved (it may belong to a change still in flight)");
                    reserved.push(cidr.clone());
                    continue;
                }
                tracing::warn!(block = %cidr, node = %node, "block locked but in no node's record (an interrupted change); releasing it");
                let name = block_object_name(cidr);
                let dp = DeleteParams { preconditions: Some(Preconditions { uid: uid.clone(), resource_version: None }), ..Default::default() };
                match blocks.delete(&name, &dp).await {
                    Ok(_) => {}
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(api_error(&e, format!("releasing stale block lock {name}: {e}"))),
                }
            }
            Ok((records, revision, reserved))
        })?;
        *self.reserved.lock().unwrap() = reserved;
        let mut known = self.known.lock().unwrap();
        known.nodes = records.iter().map(|(r, rv)| (r.name.clone(), (r.clone(), rv.clone()))).collect();
        Ok((records.into_iter().map(|(r, _)| r).collect(), revision))
    }

    fn reserved_blocks(&self) -> Vec<String> {
        self.reserved.lock().unwrap().clone()
    }

    fn commit_nodes(&self, changes: &[Change<NodeRecord>], _revision: u64) -> Result<(), BackendError> {
        // One commit at a time (the registry serializes them already).
        let mut known = self.known.lock().unwrap();
        for (name, rec) in changes {
            self.check_fence()?;
            let old = known.nodes.get(name).cloned();
            let (nodes, blocks, name2, rec2) = (self.nodes.clone(), self.blocks.clone(), name.clone(), rec.clone());
            let leader = self.leadership.clone();
            let outcome: Result<Option<Seen>, PutError> = self.rt.run(async move {
                let old_blocks: Vec<String> = old.as_ref().map(|(r, _)| r.blocks.clone()).unwrap_or_default();
                let seen = old.map(|(_, seen)| seen);
                let what = format!("NodeplaneNode {name2}");
                let Some(rec) = rec2 else {
                    let removed = remove(&nodes, &name2, seen.map(|s| s.rv), &what, &leader).await;
                    if removed.is_ok() {
                        KubeBackend::unlock_blocks(&blocks, &old_blocks).await;
                    }
                    return Ok(removed.map(|()| None));
                };
                // Lock the new blocks before the record names them.
                let mut locked = Vec::new();
                let written = async {
                    for b in rec.blocks.iter().filter(|b| !old_blocks.contains(b)) {
                        KubeBackend::lock_block(&blocks, b, &name2).await?;
                        locked.push(b.clone());
                    }
                    let spec = NodeSpec {
                        underlay: rec.underlay.clone(),
                        vtep_mac: rec.vtep_mac.clone(),
                        blocks: rec.blocks.clone(),
                        wireguard_key: rec.wireguard_key.clone(),
                    };
                    let spec = serde_json::to_value(spec).map_err(|e| BackendError::Corrupt(e.to_string()));
                    let obj = spec.and_then(|spec| object(&node_resource(), &name2, &name2, spec, seen.as_ref()));
                    put(&nodes, obj.map_err(PutError::Refused)?, &what, &leader).await
                }
                .await;
                match &written {
                    // The record no longer names them: a lock left behind is released at a
                    // later load.
                    Ok(_) => {
                        let given_up: Vec<String> =
                            old_blocks.iter().filter(|b| !rec.blocks.contains(b)).cloned().collect();
                        KubeBackend::unlock_blocks(&blocks, &given_up).await;
                    }
                    // Nothing written: give the new locks back. Unknown: keep them (a later
                    // load releases them if no record names them).
                    Err(PutError::Refused(_) | PutError::Conflict(_)) => {
                        KubeBackend::unlock_blocks(&blocks, &locked).await
                    }
                    Err(PutError::Unknown(_)) => {}
                }
                Ok(written.map(Some))
            })?;
            let new_rv = self.settle(outcome)?;
            match (rec, new_rv) {
                (Some(r), Some(rv)) => {
                    known.nodes.insert(name.clone(), (r.clone(), rv));
                }
                _ => {
                    known.nodes.remove(name);
                }
            }
        }
        Ok(())
    }

    fn load_volumes(&self) -> Result<Vec<VolumeRecord>, BackendError> {
        self.check_fence()?;
        let volumes = self.volumes.clone();
        let items = self.rt.run_within(None, async move {
            let (list, _) =
                super::list_all(&volumes, &ListParams::default()).await.map_err(err("listing nodeplanevolumes"))?;
            let mut out = Vec::new();
            for o in &list {
                let rec: VolumeRecord = spec_of(o)?;
                let name = o.metadata.name.clone().unwrap_or_default();
                if name != volume_object_name(&rec.id) {
                    return Err(BackendError::Corrupt(format!(
                        "NodeplaneVolume {name} does not match its id {:?}",
                        rec.id
                    )));
                }
                out.push((rec, name, Seen::of(o)));
            }
            Ok(out)
        })?;
        let mut known = self.known.lock().unwrap();
        known.volumes = items.iter().map(|(_, n, seen)| (n.clone(), seen.clone())).collect();
        Ok(items.into_iter().map(|(r, _, _)| r).collect())
    }

    /// The uid of the NodeplaneVolume CRD: deleting the CRD deletes every record, and the
    /// CRD made again has another uid.
    fn volume_store_id(&self) -> Result<String, BackendError> {
        let (crds, name) = (self.crds.clone(), super::volume_crd_name());
        self.rt.run(async move {
            let crd = crds.get(&name).await.map_err(err(format!("reading CustomResourceDefinition {name}")))?;
            let uid = crd.metadata.uid.unwrap_or_default();
            if uid.is_empty() {
                return Err(BackendError::Corrupt(format!("CustomResourceDefinition {name} has no uid")));
            }
            Ok(format!("crd-{uid}"))
        })
    }

    fn commit_volumes(&self, changes: &[Change<VolumeRecord>]) -> Result<(), BackendError> {
        let mut known = self.known.lock().unwrap();
        for (id, rec) in changes {
            self.check_fence()?;
            let name = volume_object_name(id);
            let seen = known.volumes.get(&name).cloned();
            let (volumes, name2, rec2) = (self.volumes.clone(), name.clone(), rec.clone());
            let leader = self.leadership.clone();
            let outcome: Result<Option<Seen>, PutError> = self.rt.run(async move {
                let what = format!("NodeplaneVolume {name2}");
                Ok(match rec2 {
                    Some(r) => {
                        let spec = serde_json::to_value(&r).map_err(|e| BackendError::Corrupt(e.to_string()))?;
                        match object(&volume_resource(), &name2, &r.node, spec, seen.as_ref()) {
                            Ok(obj) => put(&volumes, obj, &what, &leader).await.map(Some),
                            Err(e) => Err(PutError::Refused(e)),
                        }
                    }
                    None => remove(&volumes, &name2, seen.map(|s| s.rv), &what, &leader).await.map(|_| None),
                })
            })?;
            let new_rv = self.settle(outcome)?;
            match new_rv {
                Some(rv) => known.volumes.insert(name, rv),
                None => known.volumes.remove(&name),
            };
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("Kubernetes API ({}/{} objects)", super::GROUP, super::VERSION)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names() {
        assert_eq!(block_object_name("10.8.1.0/24"), "v4-10-8-1-0-24");
        assert_eq!(block_object_name("fd00:8::/64"), "v6-fd00-8---64");
        assert_eq!(block_object_name("fd00:8:0:1::/64"), "v6-fd00-8-0-1---64");
        assert_eq!(block_object_name("::/64"), "v6----64");
        for n in ["v4-10-8-1-0-24", "v6-fd00-8---64", "v6----64"] {
            assert!(crate::controller::records::valid_node_name(n), "{n}");
        }
        assert_eq!(volume_object_name("pvc-0a1b"), "pvc-0a1b");
        let odd = volume_object_name("Vol_1");
        assert!(odd.starts_with("v-") && crate::controller::records::valid_node_name(&odd), "{odd}");
    }
}
