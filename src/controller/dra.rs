//! DRA on the controller: the devices each node reports (`ReportDevices`), published as that
//! node's ResourceSlice pool, and the allocations of ResourceClaims served to nodes
//! (`GetClaim`), so that agents need no API access.
//!
//! Pool: one per node, named after the node, `spec.nodeName` the node, driver
//! `dra.nodeplane.dev`; the devices sorted by name, [`MAX_DEVICES_PER_SLICE`] per slice,
//! slices named `<node>-dra.nodeplane.dev-<i>` (a node name too long for that is cut and
//! given a hash). Every change of the pool's devices writes all its slices with the pool
//! generation one higher (the scheduler uses only the slices of the newest generation); an
//! unchanged report writes nothing. A device the node cannot open is not reported, so it
//! leaves the pool (device taints are alpha in v1 and not relied on). A node's slices are
//! deleted when it leaves the registry (in a cluster: when its Node object goes) and when it
//! reports no device; in a cluster each slice is also owned by its Node object, so the API's
//! garbage collector deletes it with the Node even while no controller runs. After a controller restart the published slices are kept until the
//! node reports again.
//!
//! Where the slices go: the Kubernetes API (`resource.k8s.io/v1`) in Kubernetes mode; in
//! local mode the same objects as JSON files in `<dataDir>/resourceslices/`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::watch;
use tonic::Status;

use super::store::Registry;
use crate::devices::dra::DRIVER_NAME;
use crate::rpc::controller as pb;

/// The API's limit of devices in one slice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// The most devices one node may report.
pub const MAX_DEVICES_PER_NODE: usize = 1024;
/// The API's limit of attributes and capacities of one device together.
pub const MAX_ATTRIBUTES: usize = 32;
/// Published slices are compared with the desired ones at least this often.
const RESYNC: Duration = Duration::from_secs(60);

pub const API_GROUP: &str = "resource.k8s.io";
pub const API_VERSION: &str = "resource.k8s.io/v1";

/// What each node reported last, and its epoch.
pub struct DeviceBook {
    reports: Mutex<BTreeMap<String, (Vec<pb::DraDevice>, u64)>>,
    /// A node came with a new epoch (its kubelet restarted and deleted its slices): the
    /// publisher checks the pools against the API before trusting what it wrote.
    verify: std::sync::atomic::AtomicBool,
    changed: watch::Sender<u64>,
}

impl Default for DeviceBook {
    fn default() -> Self {
        DeviceBook { reports: Mutex::default(), verify: Default::default(), changed: watch::channel(0).0 }
    }
}

/// A DNS-1123 label: a subdomain of one part, at most 63 characters.
fn dns_label(s: &str) -> bool {
    s.len() <= 63 && !s.contains('.') && super::records::subdomain_error(s).is_none()
}

/// A C identifier of at most 32 characters (an attribute or capacity name without domain).
fn c_identifier(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 32
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

/// A semantic version (semver 2.0.0): MAJOR.MINOR.PATCH, optional -pre-release and +build.
fn semver(s: &str) -> bool {
    let (core, rest) = s.split_at(s.find(['-', '+']).unwrap_or(s.len()));
    let nums: Vec<&str> = core.split('.').collect();
    let num_ok =
        |n: &&str| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) && (n.len() == 1 || !n.starts_with('0'));
    let ident_ok =
        |p: &str| p.split('.').all(|i| !i.is_empty() && i.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-'));
    let (pre, build) = match rest.strip_prefix('-') {
        Some(r) => r.split_once('+').map_or((Some(r), None), |(p, b)| (Some(p), Some(b))),
        None => (None, rest.strip_prefix('+')),
    };
    nums.len() == 3
        && nums.iter().all(num_ok)
        && pre.is_none_or(ident_ok)
        && build.is_none_or(ident_ok)
        && (rest.is_empty() || pre.is_some() || build.is_some())
}

/// An integer quantity in the API server's canonical form (`512000` → `512k`), so what is
/// written compares equal to what is read back.
fn canonical_quantity(q: &str) -> String {
    let Ok(mut n) = q.parse::<u64>() else { return q.to_string() };
    let mut exp = 0;
    while n != 0 && n % 1000 == 0 && exp < 6 {
        n /= 1000;
        exp += 1;
    }
    format!("{n}{}", ["", "k", "M", "G", "T", "P", "E"][exp])
}

/// A Kubernetes quantity: digits (a decimal point allowed), an optional suffix.
fn quantity(s: &str) -> bool {
    let (num, suffix) = s.split_at(s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len()));
    !num.is_empty()
        && num.chars().filter(|c| *c == '.').count() <= 1
        && ["", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "m"].contains(&suffix)
}

/// What the controller's DRA half refuses (a report, a GetClaim) or could not do. Mapped to
/// gRPC codes in one place (`From<DraError> for Status`).
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// A report this controller cannot publish, or a GetClaim field that is not valid: what
    /// is wrong, and why.
    #[error("{0}")]
    Invalid(String),
    #[error(
        "this controller has no Kubernetes API (local mode): give the claim to the agent as a claim file (nodeplane dra prepare)"
    )]
    NoApi,
    #[error("reading ResourceClaim {claim}: {source}")]
    Source { claim: String, source: SinkError },
    /// One answer to the node for every claim it may not see or that has nothing for it
    /// (missing, another UID, not allocated, allocated elsewhere), so that it learns
    /// nothing about claims not its own; `why` is for the controller's log.
    #[error("ResourceClaim {claim} ({uid}) has no allocation of {DRIVER_NAME} on node {node:?}")]
    NotServed { claim: String, uid: String, node: String, why: String },
}

impl From<DraError> for Status {
    fn from(e: DraError) -> Status {
        let m = e.to_string();
        match e {
            DraError::Invalid(_) => Status::invalid_argument(m),
            DraError::NoApi => Status::failed_precondition(m),
            DraError::Source { .. } => Status::unavailable(m),
            DraError::NotServed { .. } => Status::not_found(m),
        }
    }
}

/// Why the slices' sink (the API, or local mode's directory) or the claims' source failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("{}: {source}", path.display())]
    File { path: PathBuf, source: std::io::Error },
    /// What the API answered.
    #[error("{0}")]
    Api(String),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// Why a report cannot be published, if it cannot (INVALID_ARGUMENT).
pub fn check_report(r: &pb::ReportDevicesRequest) -> Result<(), DraError> {
    if r.driver != DRIVER_NAME {
        return Err(DraError::Invalid(format!("driver {:?} is not {DRIVER_NAME:?}", r.driver)));
    }
    if r.devices.len() > MAX_DEVICES_PER_NODE {
        return Err(DraError::Invalid(format!("{} devices, more than {MAX_DEVICES_PER_NODE}", r.devices.len())));
    }
    let mut seen = BTreeSet::new();
    for d in &r.devices {
        let bad = |problem: String| Err(DraError::Invalid(format!("device {:?}: {problem}", d.name)));
        if !dns_label(&d.name) {
            return bad("the name is not a DNS label".into());
        }
        if !seen.insert(&d.name) {
            return bad("listed twice".into());
        }
        if d.attributes.len() + d.capacity.len() > MAX_ATTRIBUTES {
            return bad(format!("more than {MAX_ATTRIBUTES} attributes and capacities"));
        }
        for (k, v) in &d.attributes {
            if !c_identifier(k) {
                return bad(format!("attribute name {k:?} is not a C identifier of at most 32 characters"));
            }
            match &v.value {
                None => return bad(format!("attribute {k:?} has no value")),
                Some(pb::device_attribute::Value::String(s) | pb::device_attribute::Value::Version(s))
                    if s.len() > 64 =>
                {
                    return bad(format!("attribute {k:?} is longer than 64 characters"));
                }
                Some(pb::device_attribute::Value::Version(v)) if !semver(v) => {
                    return bad(format!("attribute {k:?} = {v:?} is not a semantic version"));
                }
                Some(_) => {}
            }
        }
        for (k, v) in &d.capacity {
            if !c_identifier(k) {
                return bad(format!("capacity name {k:?} is not a C identifier of at most 32 characters"));
            }
            if !quantity(v) {
                return bad(format!("capacity {k:?} = {v:?} is not a quantity"));
            }
        }
    }
    Ok(())
}

impl DeviceBook {
    /// Record a node's report (checked with [`check_report`] first).
    pub fn report(&self, node: &str, mut devices: Vec<pb::DraDevice>, epoch: u64) {
        devices.sort_by(|a, b| a.name.cmp(&b.name));
        let mut r = self.reports.lock().unwrap();
        let (same_devices, same_epoch) = r.get(node).map_or((false, false), |(d, e)| (*d == devices, *e == epoch));
        if same_devices && same_epoch {
            return;
        }
        if !same_epoch && r.contains_key(node) {
            self.verify.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        r.insert(node.to_string(), (devices, epoch));
        drop(r);
        self.changed.send_modify(|n| *n += 1);
    }

    pub fn reports(&self) -> BTreeMap<String, Vec<pb::DraDevice>> {
        self.reports.lock().unwrap().iter().map(|(k, (d, _))| (k.clone(), d.clone())).collect()
    }

    fn take_verify(&self) -> bool {
        self.verify.swap(false, std::sync::atomic::Ordering::SeqCst)
    }

    fn forget(&self, node: &str) {
        self.reports.lock().unwrap().remove(node);
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }
}

/// The name of slice `index` of `node`'s pool (a DNS subdomain of at most 253 characters).
pub fn slice_name(node: &str, index: usize) -> String {
    let suffix = format!("-{DRIVER_NAME}-{index}");
    if node.len() + suffix.len() <= 253 {
        return format!("{node}{suffix}");
    }
    let keep = 253 - suffix.len() - 17;
    let mut cut = node[..keep].trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).to_string();
    cut.push('-');
    cut.push_str(&format!("{:016x}", crate::util::fnv1a(&[node.as_bytes()])));
    format!("{cut}{suffix}")
}

fn device_json(d: &pb::DraDevice) -> Value {
    let mut o = serde_json::Map::new();
    o.insert("name".into(), json!(d.name));
    if !d.attributes.is_empty() {
        let attrs: serde_json::Map<String, Value> = d
            .attributes
            .iter()
            .filter_map(|(k, v)| {
                let v = match v.value.as_ref()? {
                    pb::device_attribute::Value::Int(i) => json!({ "int": i }),
                    pb::device_attribute::Value::Bool(b) => json!({ "bool": b }),
                    pb::device_attribute::Value::String(s) => json!({ "string": s }),
                    pb::device_attribute::Value::Version(s) => json!({ "version": s }),
                };
                Some((k.clone(), v))
            })
            .collect();
        o.insert("attributes".into(), Value::Object(attrs));
    }
    if !d.capacity.is_empty() {
        let caps: serde_json::Map<String, Value> =
            d.capacity.iter().map(|(k, v)| (k.clone(), json!({ "value": canonical_quantity(v) }))).collect();
        o.insert("capacity".into(), Value::Object(caps));
    }
    Value::Object(o)
}

/// The slices of `node`'s pool at `generation` (none for no device).
pub fn desired_slices(node: &str, devices: &[pb::DraDevice], generation: i64) -> Vec<Value> {
    let chunks: Vec<&[pb::DraDevice]> = devices.chunks(MAX_DEVICES_PER_SLICE).collect();
    let count = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            json!({
                "apiVersion": API_VERSION,
                "kind": "ResourceSlice",
                "metadata": {
                    "name": slice_name(node, i),
                    "labels": { super::kube::MANAGED_BY.0: super::kube::MANAGED_BY.1 },
                },
                "spec": {
                    "driver": DRIVER_NAME,
                    "nodeName": node,
                    "pool": { "name": node, "generation": generation, "resourceSliceCount": count },
                    "devices": chunk.iter().map(device_json).collect::<Vec<_>>(),
                },
            })
        })
        .collect()
}

/// Where slices are written.
#[tonic::async_trait]
pub trait SliceSink: Send + Sync + 'static {
    /// Every slice this controller may have written (its label), any driver.
    async fn list(&self) -> Result<Vec<Value>, SinkError>;
    /// Create, or replace when the object carries the `resourceVersion` it replaces.
    async fn write(&self, obj: Value) -> Result<Value, SinkError>;
    /// Delete; one already gone is fine.
    async fn delete(&self, name: &str) -> Result<(), SinkError>;
    fn describe(&self) -> String;
}

/// One node's published pool.
#[derive(Debug, Default, Clone)]
struct Pool {
    generation: i64,
    /// name → (resourceVersion, spec)
    slices: BTreeMap<String, (String, Value)>,
}

fn name_of(v: &Value) -> Option<&str> {
    v.pointer("/metadata/name")?.as_str()
}

fn rv_of(v: &Value) -> String {
    v.pointer("/metadata/resourceVersion").and_then(Value::as_str).unwrap_or_default().to_string()
}

/// The published pools by node, from a list.
fn pools_of(list: Vec<Value>) -> BTreeMap<String, Pool> {
    let mut pools: BTreeMap<String, Pool> = BTreeMap::new();
    for s in list {
        if s.pointer("/spec/driver").and_then(Value::as_str) != Some(DRIVER_NAME) {
            continue;
        }
        let (Some(node), Some(name)) = (s.pointer("/spec/nodeName").and_then(Value::as_str), name_of(&s)) else {
            continue;
        };
        let p = pools.entry(node.to_string()).or_default();
        p.generation = p.generation.max(s.pointer("/spec/pool/generation").and_then(Value::as_i64).unwrap_or(0));
        p.slices.insert(name.to_string(), (rv_of(&s), s.get("spec").cloned().unwrap_or(Value::Null)));
    }
    pools
}

/// A slice the sink did not take: cached pools may be stale (relist).
#[derive(Debug, thiserror::Error)]
#[error("{step} ResourceSlice {name}: {source}")]
struct PublishError {
    step: &'static str,
    name: String,
    source: SinkError,
}

/// Publishes the book's reports through `sink` until `stopping`.
pub struct Publisher {
    pub book: Arc<DeviceBook>,
    pub registry: Arc<Registry>,
    pub sink: Arc<dyn SliceSink>,
}

impl Publisher {
    /// Make `node`'s pool what `devices` says. `Err`: the cache may be stale (relist).
    async fn sync_node(
        &self,
        pools: &mut BTreeMap<String, Pool>,
        node: &str,
        devices: &[pb::DraDevice],
    ) -> Result<(), PublishError> {
        let current = pools.get(node).cloned().unwrap_or_default();
        let same = desired_slices(node, devices, current.generation);
        let unchanged = same.len() == current.slices.len()
            && same.iter().all(|d| {
                current.slices.get(name_of(d).unwrap_or_default()).is_some_and(|(_, spec)| Some(spec) == d.get("spec"))
            });
        if unchanged {
            return Ok(());
        }
        let generation = current.generation + 1;
        let mut next = Pool { generation, slices: BTreeMap::new() };
        for mut obj in desired_slices(node, devices, generation) {
            let name = name_of(&obj).unwrap_or_default().to_string();
            if let Some((rv, _)) = current.slices.get(&name) {
                obj["metadata"]["resourceVersion"] = json!(rv);
            }
            let written = match self.sink.write(obj).await {
                Ok(w) => w,
                Err(source) => {
                    pools.remove(node);
                    return Err(PublishError { step: "writing", name, source });
                }
            };
            next.slices.insert(name, (rv_of(&written), written.get("spec").cloned().unwrap_or(Value::Null)));
        }
        for name in current.slices.keys().filter(|n| !next.slices.contains_key(*n)) {
            if let Err(source) = self.sink.delete(name).await {
                pools.remove(node);
                return Err(PublishError { step: "deleting", name: name.clone(), source });
            }
        }
        tracing::info!(
            node,
            devices = devices.len(),
            slices = next.slices.len(),
            generation,
            "ResourceSlice pool published"
        );
        if next.slices.is_empty() {
            pools.remove(node);
        } else {
            pools.insert(node.to_string(), next);
        }
        Ok(())
    }

    async fn delete_pool(&self, pools: &mut BTreeMap<String, Pool>, node: &str) -> Result<(), PublishError> {
        let Some(p) = pools.get(node).cloned() else { return Ok(()) };
        for name in p.slices.keys() {
            let gone = self.sink.delete(name).await;
            gone.map_err(|source| PublishError { step: "deleting", name: name.clone(), source })?;
        }
        pools.remove(node);
        tracing::info!(node, slices = p.slices.len(), "ResourceSlice pool deleted: the node is gone");
        Ok(())
    }

    /// One pass over every node.
    async fn sync(&self, pools: &mut BTreeMap<String, Pool>) -> Result<(), PublishError> {
        let members: BTreeSet<String> = self.registry.snapshot().nodes.iter().map(|n| n.name.clone()).collect();
        let reports = self.book.reports();
        let mut first_error = None;
        for node in pools.keys().filter(|n| !members.contains(*n)).cloned().collect::<Vec<_>>() {
            self.book.forget(&node);
            if let Err(e) = self.delete_pool(pools, &node).await {
                first_error.get_or_insert(e);
            }
        }
        for (node, devices) in reports.iter().filter(|(n, _)| members.contains(*n)) {
            if let Err(e) = self.sync_node(pools, node, devices).await {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    pub async fn run(self, mut stopping: watch::Receiver<bool>) {
        let mut reg = self.registry.subscribe();
        let mut book = self.book.subscribe();
        let mut pools: Option<BTreeMap<String, Pool>> = None;
        let mut last_error: Option<String> = None;
        let mut backoff = Duration::from_millis(200);
        // One deadline for the periodic check against the sink, kept across wake-ups (a busy
        // cluster wakes the publisher often; the check must still come).
        let mut resync_at = tokio::time::Instant::now() + RESYNC;
        loop {
            reg.borrow_and_update();
            book.borrow_and_update();
            if self.book.take_verify() || tokio::time::Instant::now() >= resync_at {
                pools = None;
                resync_at = tokio::time::Instant::now() + RESYNC;
            }
            // Nothing to do until some node has reported (a cluster without DRA, or before
            // 1.34, never sees a ResourceSlice call).
            let active = pools.as_ref().is_some_and(|p| !p.is_empty()) || !self.book.reports().is_empty();
            let mut failed = false;
            if active {
                if pools.is_none() {
                    match self.sink.list().await {
                        Ok(l) => pools = Some(pools_of(l)),
                        Err(e) => {
                            failed = true;
                            let e = e.to_string();
                            if last_error.as_ref() != Some(&e) {
                                tracing::warn!(sink = %self.sink.describe(), error = %e, "cannot list ResourceSlices; retrying");
                                last_error = Some(e);
                            }
                        }
                    }
                }
                if let Some(p) = pools.as_mut() {
                    match self.sync(p).await {
                        Ok(()) => {
                            if last_error.take().is_some() {
                                tracing::info!(sink = %self.sink.describe(), "ResourceSlices published again");
                            }
                            backoff = Duration::from_millis(200);
                        }
                        Err(e) => {
                            failed = true;
                            // Relist: another writer, or a write whose outcome is unknown.
                            pools = None;
                            let e = e.to_string();
                            if last_error.as_ref() != Some(&e) {
                                tracing::warn!(sink = %self.sink.describe(), error = %e, "ResourceSlice publication failed; retrying");
                                last_error = Some(e);
                            }
                        }
                    }
                }
            }
            if failed {
                // Back off whatever changes meanwhile (the next pass sees them all).
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopping.wait_for(|v| *v) => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(30));
                continue;
            }
            tokio::select! {
                _ = reg.changed() => {}
                _ = book.changed() => {}
                _ = tokio::time::sleep_until(resync_at) => {}
                _ = stopping.wait_for(|v| *v) => return,
            }
        }
    }
}

fn file(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> SinkError + '_ {
    move |source| SinkError::File { path: path.into(), source }
}

/// Local mode: slices as JSON files in a directory.
pub struct DirSink {
    pub dir: PathBuf,
    counter: std::sync::atomic::AtomicU64,
}

impl DirSink {
    pub fn new(dir: PathBuf) -> DirSink {
        DirSink { dir, counter: std::sync::atomic::AtomicU64::new(1) }
    }
}

#[tonic::async_trait]
impl SliceSink for DirSink {
    async fn list(&self) -> Result<Vec<Value>, SinkError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(file(&self.dir)(e)),
        };
        let mut out = Vec::new();
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            match std::fs::read(&p)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Value>(&b).map_err(|e| e.to_string()))
            {
                Ok(v) => out.push(v),
                Err(e) => tracing::warn!(file = %p.display(), error = %e, "unreadable ResourceSlice file; ignored"),
            }
        }
        Ok(out)
    }
    async fn write(&self, mut obj: Value) -> Result<Value, SinkError> {
        let path = self.dir.join(format!("{}.json", name_of(&obj).expect("slices are named")));
        let rv = self.counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        std::fs::create_dir_all(&self.dir).map_err(file(&self.dir))?;
        let body = serde_json::to_vec_pretty(&obj)?;
        crate::sys::fs::atomic_write(&path, &body, 0o644).map_err(file(&path))?;
        Ok(obj)
    }
    async fn delete(&self, name: &str) -> Result<(), SinkError> {
        let path = self.dir.join(format!("{name}.json"));
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(file(&path)(e)),
            _ => Ok(()),
        }
    }
    fn describe(&self) -> String {
        format!("directory {}", self.dir.display())
    }
}

/// The allocation results of `claim` (None: it does not exist) for the node `r` comes from,
/// in its pool of this driver; else [`DraError::NotServed`] (saying why, for the log).
pub fn claim_results(claim: Option<&Value>, r: &pb::GetClaimRequest) -> Result<Vec<pb::ClaimResult>, DraError> {
    let not_served = |why: String| DraError::NotServed {
        claim: format!("{}/{}", r.namespace, r.name),
        uid: r.uid.clone(),
        node: r.node_name.clone(),
        why,
    };
    let claim = claim.ok_or_else(|| not_served("the claim does not exist".into()))?;
    let have = claim.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or_default();
    if have != r.uid {
        return Err(not_served(format!("the claim has UID {have:?} (deleted and made again?)")));
    }
    let Some(results) = claim.pointer("/status/allocation/devices/results").and_then(Value::as_array) else {
        return Err(not_served("the claim is not allocated".into()));
    };
    let field = |r: &Value, k: &str| r.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    let mine: Vec<pb::ClaimResult> = results
        .iter()
        .filter(|x| field(x, "driver") == DRIVER_NAME && field(x, "pool") == r.node_name)
        .map(|r| pb::ClaimResult {
            request: field(r, "request"),
            driver: field(r, "driver"),
            pool: field(r, "pool"),
            device: field(r, "device"),
        })
        .collect();
    if mine.is_empty() {
        return Err(not_served(format!("the claim allocates no device of {DRIVER_NAME} on this node")));
    }
    Ok(mine)
}

/// Checks a GetClaim request's names (INVALID_ARGUMENT).
pub fn check_claim_request(r: &pb::GetClaimRequest) -> Result<(), DraError> {
    let bad = |field: &str, value: &str, problem: &str| Err(DraError::Invalid(format!("{field} {value:?} {problem}")));
    if !dns_label(&r.namespace) {
        return bad("namespace", &r.namespace, "is not a DNS label");
    }
    if let Some(why) = super::records::subdomain_error(&r.name) {
        return bad("claim name", &r.name, &why);
    }
    if r.uid.is_empty() || r.uid.len() > 128 {
        return bad("claim uid", &r.uid, "is not 1 to 128 characters");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str) -> pb::DraDevice {
        pb::DraDevice {
            name: name.into(),
            attributes: [(
                "numaNode".to_string(),
                pb::DeviceAttribute { value: Some(pb::device_attribute::Value::Int(0)) },
            )]
            .into(),
            capacity: [("size".to_string(), "1Gi".to_string())].into(),
        }
    }

    #[test]
    fn slices_split_at_128_and_carry_the_pool() {
        let devices: Vec<_> = (0..300).map(|i| dev(&format!("d-{i:03}"))).collect();
        let s = desired_slices("node-a", &devices, 7);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0]["metadata"]["name"], "node-a-dra.nodeplane.dev-0");
        assert_eq!(s[2]["spec"]["devices"].as_array().unwrap().len(), 300 - 256);
        for x in &s {
            assert_eq!(x["spec"]["pool"], json!({"name": "node-a", "generation": 7, "resourceSliceCount": 3}));
            assert_eq!(x["spec"]["nodeName"], "node-a");
            assert_eq!(x["spec"]["driver"], DRIVER_NAME);
        }
        assert_eq!(
            s[0]["spec"]["devices"][0],
            json!({"name": "d-000", "attributes": {"numaNode": {"int": 0}}, "capacity": {"size": {"value": "1Gi"}}})
        );
        assert!(desired_slices("n", &[], 1).is_empty());
    }

    #[test]
    fn long_node_names_give_valid_distinct_slice_names() {
        let a = format!("{}a", "x".repeat(240));
        let b = format!("{}b", "x".repeat(240));
        let (na, nb) = (slice_name(&a, 0), slice_name(&b, 0));
        assert!(na.len() <= 253 && nb.len() <= 253);
        assert_ne!(na, nb);
        assert!(super::super::records::subdomain_error(&na).is_none(), "{na}");
    }

    #[test]
    fn quantities_are_canonical_and_versions_semver() {
        assert_eq!(canonical_quantity("512000"), "512k");
        assert_eq!(canonical_quantity("1073741824"), "1073741824");
        assert_eq!(canonical_quantity("1000000000"), "1G");
        assert_eq!(canonical_quantity("0"), "0");
        assert_eq!(canonical_quantity("16Gi"), "16Gi");
        for ok in ["0.1.0", "1.34.2", "1.0.0-rc.1", "1.0.0+build.5", "1.0.0-alpha+001"] {
            assert!(semver(ok), "{ok}");
        }
        for bad in ["1.0", "01.0.0", "1.0.0-", "v1.0.0", "1.0.0+", "1..0", ""] {
            assert!(!semver(bad), "{bad}");
        }
    }

    #[test]
    fn reports_are_checked() {
        let ok = pb::ReportDevicesRequest {
            node_name: "n".into(),
            driver: DRIVER_NAME.into(),
            devices: vec![dev("a"), dev("b")],
            epoch: 1,
        };
        assert!(check_report(&ok).is_ok());
        let mut bad = ok.clone();
        bad.driver = "other.dev".into();
        let text = |r: &pb::ReportDevicesRequest| check_report(r).unwrap_err().to_string();
        assert!(text(&bad).contains("driver"));
        let mut bad = ok.clone();
        bad.devices.push(dev("a"));
        assert!(text(&bad).contains("twice"));
        let mut bad = ok.clone();
        bad.devices[0].name = "Not_A_Label".into();
        assert!(check_report(&bad).is_err());
        let mut bad = ok.clone();
        bad.devices[0].capacity.insert("size".into(), "lots".into());
        assert!(text(&bad).contains("quantity"));
        let mut bad = ok;
        bad.devices[0]
            .attributes
            .insert("9bad".into(), pb::DeviceAttribute { value: Some(pb::device_attribute::Value::Bool(true)) });
        assert!(text(&bad).contains("C identifier"));
    }

    #[test]
    fn claim_results_are_the_nodes_own() {
        let claim = json!({"metadata": {"uid": "u1"}, "status": {"allocation": {"devices": {"results": [
            {"request": "r", "driver": DRIVER_NAME, "pool": "n1", "device": "gpu-a"},
            {"request": "r", "driver": DRIVER_NAME, "pool": "n2", "device": "gpu-b"},
            {"request": "r", "driver": "other.dev", "pool": "n1", "device": "x"}]}}}});
        let why = |claim: Option<&Value>, uid: &str, node: &str| {
            let r = pb::GetClaimRequest { node_name: node.into(), uid: uid.into(), ..Default::default() };
            match claim_results(claim, &r) {
                Err(DraError::NotServed { why, .. }) => why,
                other => panic!("{other:?}"),
            }
        };
        let r = pb::GetClaimRequest { node_name: "n1".into(), uid: "u1".into(), ..Default::default() };
        let r = claim_results(Some(&claim), &r).unwrap();
        assert_eq!(r.iter().map(|r| r.device.as_str()).collect::<Vec<_>>(), ["gpu-a"]);
        assert!(why(Some(&claim), "u2", "n1").contains("UID"));
        assert!(why(Some(&claim), "u1", "n3").contains("no device"));
        let pending = json!({"metadata": {"uid": "u1"}, "status": {}});
        assert!(why(Some(&pending), "u1", "n1").contains("not allocated"));
        assert!(why(None, "u1", "n1").contains("does not exist"));
    }
}
