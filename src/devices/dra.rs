//! The agent as the node's DRA kubelet plugin, driver `dra.nodeplane.dev`. The allocation of
//! a claim comes from a claim file (local mode) or, when there is none and the agent has a
//! controller, from the controller, which reads the ResourceClaim from the API (agents need
//! no API access). The controller also publishes the devices as the node's ResourceSlice
//! pool: the agent reports them (`agent::device_sync`).
//!
//! Sockets: the plugin serves `DRAPlugin` (v1) and `DRAResourceHealth` (v1alpha1) on
//! `<pluginDir>/dra.sock` (0600), and only then offers kubelet plugin registration on
//! `<kubelet>/plugins_registry/dra.nodeplane.dev-reg.sock` (type `DRAPlugin`, endpoint the
//! absolute `dra.sock` path, versions `v1.DRAPlugin`, `v1alpha1.DRAResourceHealth`). A
//! backstop looks every 250 ms and serves the registration socket again when it is gone or
//! replaced (a restarted kubelet wipes `plugins_registry/`). On shutdown the registration
//! socket goes first, then `dra.sock`.
//!
//! Devices: every resource of the device file with `"offer": "dra"`; each device node it
//! matches is one DRA device in the pool named after the node. Device name: `<resource>-<base
//! name of the node>`, lowercased, every character other than `a-z`, `0-9` replaced by `-`,
//! runs of `-` folded to one, `-` trimmed at both ends, cut at 63 characters (a DNS label);
//! a node whose name collides with another's after that is skipped with a warning. A node
//! also matched by a device plugin resource is never a DRA device (the device plugin keeps
//! it, with a warning): one device is never handed out by both allocators. A device that
//! was seen and disappeared stays listed, unhealthy, until its resource leaves the file.
//! Health is `inventory::check_health`, judged every 100 ms (a rescan of the device file's
//! DRA entries: a few directory reads and one open per device).
//!
//! Attributes of each device (ResourceSlice `attributes`, the driver's domain implied):
//! `resource` and `path` (strings), `driverVersion` (the agent's version), `numaNode` (int,
//! where sysfs knows it), `vendor` and `model` (strings: the device file entry's, else the
//! PCI vendor and device IDs from sysfs where the device has them); capacity `size` (bytes)
//! of a block device.
//!
//! Claim file (`<stateDir>/dra/claims/<uid>.json`, written by `nodeplane dra prepare` or
//! any tool standing in for the API server):
//!
//! ```json
//! {"namespace": "default", "name": "gpu-claim", "uid": "6f0c…",
//!  "results": [{"request": "gpu", "driver": "dra.nodeplane.dev", "pool": "<node>", "device": "gpu-card0"}]}
//! ```
//!
//! Results of another driver or another pool (node) are ignored. Prepare writes one CDI spec
//! per claim, `<cdiDir>/dra.nodeplane.dev-claim_<uid>.json`, kind `dra.nodeplane.dev/claim`,
//! one CDI device `<uid>-<device>` per allocated device (its node, its resource's env and
//! mounts), and the checkpoint `<stateDir>/dra/prepared/<uid>.json`: the claim's identity, the
//! answer's devices exactly as answered, and the CDI spec (so a restarted agent answers the
//! same and can put a lost spec back even when the claim file or the device has gone).
//! Prepare and unprepare calls are serialised (one lock).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::devices::config::{self, Offer, Resource};
use crate::devices::{SockId, cdi, inventory, sock_id, stop_task, stopped};
use crate::rpc::dra as pb;
use crate::rpc::drahealth as hpb;

pub const DRIVER_NAME: &str = "dra.nodeplane.dev";
/// The CDI kind of every per-claim spec.
pub const CDI_KIND: &str = "dra.nodeplane.dev/claim";
/// What the registration advertises: the gRPC services of `dra.sock`, as kubelet names them.
pub const SUPPORTED_VERSIONS: &[&str] = &["v1.DRAPlugin", "v1alpha1.DRAResourceHealth"];
/// Told to kubelet with every health report: a device not reported again within this is Unknown.
pub const HEALTH_TIMEOUT_SECONDS: i64 = 30;
/// The health stream repeats the list at least this often (well inside the timeout).
const RESEND_EVERY: Duration = Duration::from_secs(10);
const SCAN_EVERY: Duration = Duration::from_millis(100);
const BACKSTOP: Duration = Duration::from_millis(250);
/// Claims one call may carry (kubelet batches the claims of one pod's sync).
pub const MAX_CLAIMS: usize = 256;
/// Allocation results one claim may hold (the API's limit).
pub const MAX_RESULTS: usize = 32;
/// The largest claim file read.
const MAX_CLAIM_FILE: u64 = 1 << 20;
/// How long a claim's allocation may take to come from the controller.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Where things are.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The pool name of every device.
    pub node_name: String,
    /// The device file.
    pub config_file: PathBuf,
    pub cdi_dir: PathBuf,
    /// `<kubelet>/plugins/dra.nodeplane.dev` (holds `dra.sock`).
    pub plugin_dir: PathBuf,
    /// `<kubelet>/plugins_registry`
    pub registry_dir: PathBuf,
    /// The agent's state directory (claims and checkpoints live under `dra/`).
    pub state_dir: PathBuf,
}

impl Settings {
    pub fn socket(&self) -> PathBuf {
        self.plugin_dir.join("dra.sock")
    }
    pub fn registration_socket(&self) -> PathBuf {
        registration_socket(&self.registry_dir)
    }
    fn cdi_spec(&self, uid: &str) -> PathBuf {
        self.cdi_dir.join(format!("{DRIVER_NAME}-claim_{uid}.json"))
    }
    fn checkpoint(&self, uid: &str) -> PathBuf {
        prepared_dir(&self.state_dir).join(format!("{uid}.json"))
    }
    fn claim_file(&self, uid: &str) -> PathBuf {
        claim_dir(&self.state_dir).join(format!("{uid}.json"))
    }
}

/// The registration socket in kubelet's `plugins_registry` directory.
pub fn registration_socket(registry_dir: &Path) -> PathBuf {
    registry_dir.join(format!("{DRIVER_NAME}-reg.sock"))
}

/// Where claim files are read, under the agent's state directory.
pub fn claim_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("dra").join("claims")
}

/// Where checkpoints of prepared claims are kept, under the agent's state directory.
pub fn prepared_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("dra").join("prepared")
}

/// A claim file (see the module comment).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimFile {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    #[serde(default)]
    pub results: Vec<AllocationResult>,
}

/// One `status.allocation.devices.results[]` entry of a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocationResult {
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
}

/// A claim UID names files: letters, digits and `-` only, starting and ending with a letter
/// or digit, at most 128 characters (Kubernetes UIDs are UUIDs).
pub fn check_uid(uid: &str) -> Result<(), String> {
    let b = uid.as_bytes();
    let ok = !b.is_empty()
        && b.len() <= 128
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-');
    if ok { Ok(()) } else { Err(format!("claim UID {uid:?} is not made of letters, digits and '-'")) }
}

/// The DRA device name of device node `base` of resource `resource` (see the module comment);
/// `None` when nothing is left.
pub fn device_name(resource: &str, base: &str) -> Option<String> {
    let mut out = String::new();
    for c in format!("{resource}-{base}").chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            out.push(c);
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    let mut s = out.trim_matches('-').to_string();
    s.truncate(63);
    let s = s.trim_end_matches('-').to_string();
    (!s.is_empty()).then_some(s)
}

/// One DRA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub resource: Arc<Resource>,
    pub path: PathBuf,
    pub healthy: bool,
    pub numa: Option<i64>,
    /// PCI vendor and device IDs from sysfs.
    pub pci: (Option<String>, Option<String>),
    /// Bytes, of a block device.
    pub size: Option<u64>,
}

/// One attribute value (resource.k8s.io/v1 `DeviceAttribute`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attr {
    Int(i64),
    Str(String),
    Version(String),
}

impl Device {
    fn probe(name: String, resource: Arc<Resource>, path: PathBuf) -> Device {
        let healthy = inventory::check_health(&path);
        let numa = inventory::numa_of(&path);
        let pci = inventory::pci_ids_of(&path);
        let size = inventory::block_size_of(&path);
        Device { name, resource, path, healthy, numa, pci, size }
    }

    /// The device's attributes (see the module comment).
    pub fn attributes(&self) -> BTreeMap<&'static str, Attr> {
        let mut a = BTreeMap::new();
        a.insert("resource", Attr::Str(self.resource.name.clone()));
        let path = self.path.to_string_lossy();
        if path.len() <= 64 {
            a.insert("path", Attr::Str(path.into_owned()));
        }
        a.insert("driverVersion", Attr::Version(env!("CARGO_PKG_VERSION").to_string()));
        if let Some(n) = self.numa {
            a.insert("numaNode", Attr::Int(n));
        }
        if let Some(v) = self.resource.vendor.clone().or_else(|| self.pci.0.clone()) {
            a.insert("vendor", Attr::Str(v));
        }
        if let Some(m) = self.resource.model.clone().or_else(|| self.pci.1.clone()) {
            a.insert("model", Attr::Str(m));
        }
        a
    }

    /// The device's capacities, as Kubernetes quantities.
    pub fn capacity(&self) -> BTreeMap<&'static str, String> {
        self.size.map(|b| ("size", b.to_string())).into_iter().collect()
    }
}

/// The DRA devices of the node, rescanned from the device file; `changed` counts changes.
pub struct Devices {
    list: Mutex<BTreeMap<String, Device>>,
    /// Unix seconds of the last health judgement.
    checked: Mutex<i64>,
    /// The device file has been looked at (read or not) at least once.
    scanned: std::sync::atomic::AtomicBool,
    changed: watch::Sender<u64>,
    /// Problems already logged (each once).
    warned: Mutex<HashSet<String>>,
}

impl Default for Devices {
    fn default() -> Self {
        Devices {
            list: Mutex::default(),
            checked: Mutex::new(0),
            scanned: Default::default(),
            changed: watch::channel(0).0,
            warned: Mutex::default(),
        }
    }
}

impl Devices {
    pub fn list(&self) -> Vec<Device> {
        self.list.lock().unwrap().values().cloned().collect()
    }

    /// Whether the device file has been looked at at least once (whatever it held).
    pub fn scanned(&self) -> bool {
        self.scanned.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn warn_once(&self, msg: String) {
        if self.warned.lock().unwrap().insert(msg.clone()) {
            tracing::warn!("{msg}");
        }
    }

    /// Read the device file, scan and judge every DRA device (blocking). A file that cannot
    /// be used keeps the current list.
    pub fn refresh(&self, config_file: &Path) {
        self.rescan(config_file);
        self.scanned.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn rescan(&self, config_file: &Path) {
        let resources = match config::load(config_file) {
            Ok((ok, _problems)) => ok,
            Err(config::LoadError::Parse(e)) => {
                self.warn_once(format!(
                    "DRA: device file {} unusable ({e}); keeping the current devices",
                    config_file.display()
                ));
                return;
            }
            Err(config::LoadError::Read(e)) => {
                self.warn_once(format!("DRA: reading {}: {e}; keeping the current devices", config_file.display()));
                return;
            }
        };
        let taken: HashSet<PathBuf> =
            resources.iter().filter(|r| r.offer == Offer::DevicePlugin).flat_map(inventory::scan).collect();
        let mut next: BTreeMap<String, Device> = BTreeMap::new();
        // Devices seen before keep what sysfs said about them; only their health is judged.
        let before = self.list.lock().unwrap().clone();
        let dra: Vec<Arc<Resource>> = resources.into_iter().filter(|r| r.offer == Offer::Dra).map(Arc::new).collect();
        for res in &dra {
            for path in inventory::scan(res) {
                if taken.contains(&path) {
                    self.warn_once(format!(
                        "DRA: {} of resource {:?} is also matched by a device plugin resource: the device plugin keeps it, DRA does not offer it",
                        path.display(),
                        res.name
                    ));
                    continue;
                }
                let base = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let Some(name) = device_name(&res.name, &base) else {
                    self.warn_once(format!("DRA: {} gives no device name; skipped", path.display()));
                    continue;
                };
                if let Some(other) = next.get(&name) {
                    self.warn_once(format!(
                        "DRA: {} and {} both become device {name:?}; {} skipped",
                        other.path.display(),
                        path.display(),
                        path.display()
                    ));
                    continue;
                }
                let d = match before.get(&name) {
                    Some(o) if o.path == path => {
                        Device { healthy: inventory::check_health(&path), resource: res.clone(), ..o.clone() }
                    }
                    _ => Device::probe(name.clone(), res.clone(), path),
                };
                next.insert(name, d);
            }
        }
        let mut list = self.list.lock().unwrap();
        // Seen before and gone now: still listed, unhealthy, while its resource is configured.
        for (name, old) in list.iter() {
            if next.contains_key(name) {
                continue;
            }
            if let Some(res) = dra.iter().find(|r| r.name == old.resource.name) {
                next.insert(name.clone(), Device { resource: res.clone(), healthy: false, ..old.clone() });
            }
        }
        *self.checked.lock().unwrap() = crate::util::unix_secs() as i64;
        if *list != next {
            *list = next;
            drop(list);
            self.changed.send_modify(|n| *n += 1);
        }
    }

    /// The health report of every device.
    fn report(&self, pool: &str) -> hpb::NodeWatchResourcesResponse {
        let checked = *self.checked.lock().unwrap();
        hpb::NodeWatchResourcesResponse {
            devices: self
                .list()
                .into_iter()
                .map(|d| hpb::DeviceHealth {
                    device: Some(hpb::DeviceIdentifier { pool_name: pool.to_string(), device_name: d.name.clone() }),
                    health: if d.healthy { hpb::HealthStatus::Healthy } else { hpb::HealthStatus::Unhealthy } as i32,
                    last_updated_time: checked,
                    health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                    message: if d.healthy {
                        String::new()
                    } else {
                        format!("{} is missing or cannot be opened", d.path.display())
                    },
                })
                .collect(),
        }
    }
}

/// One answered device, as checkpointed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
}

/// A prepared claim (see the module comment).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Checkpoint {
    namespace: String,
    name: String,
    uid: String,
    devices: Vec<PreparedDevice>,
    cdi_spec: serde_json::Value,
}

fn to_pb(d: &PreparedDevice) -> pb::Device {
    pb::Device {
        request_names: d.request_names.clone(),
        pool_name: d.pool_name.clone(),
        device_name: d.device_name.clone(),
        cdi_device_ids: d.cdi_device_ids.clone(),
    }
}

/// Where a claim's allocation comes from when it has no claim file: the controller. `Ok`
/// carries the claim's results (any driver, any pool: prepare keeps its own).
pub type ClaimLookup = Arc<
    dyn Fn(
            pb::Claim,
        )
            -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<AllocationResult>, String>> + Send>>
        + Send
        + Sync,
>;

/// Prepare and unprepare: the node half of the driver.
pub struct Claims {
    pub s: Settings,
    pub devices: Arc<Devices>,
}

/// The outcome of looking a claim up before preparing it.
pub enum Looked {
    /// No need (prepared before, or it has a claim file): prepare reads what it needs.
    Local,
    /// The controller's allocation results.
    Remote(Vec<AllocationResult>),
    /// The controller could not say.
    Failed(String),
}

impl Claims {
    fn write_json(path: &Path, v: &impl Serialize, mode: u32) -> Result<(), String> {
        let body = serde_json::to_vec_pretty(v).map_err(|e| e.to_string())?;
        let dir = path.parent().ok_or("no parent directory")?;
        std::fs::create_dir_all(dir)
            .and_then(|_| crate::sys::fs::atomic_write(path, &body, mode))
            .map_err(|e| format!("writing {}: {e}", path.display()))
    }

    /// Whether preparing `c` needs its allocation from elsewhere (no checkpoint and no
    /// claim file).
    fn needs_lookup(&self, c: &pb::Claim) -> bool {
        check_uid(&c.uid).is_ok() && !self.s.checkpoint(&c.uid).exists() && !self.s.claim_file(&c.uid).exists()
    }

    /// Prepare one claim, its allocation from the claim file or as `looked` says (blocking).
    pub fn prepare_with(&self, c: &pb::Claim, looked: Looked) -> Result<Vec<PreparedDevice>, String> {
        let who = format!("claim {}/{} ({})", c.namespace, c.name, c.uid);
        check_uid(&c.uid).map_err(|e| format!("{who}: {e}"))?;
        let cp_path = self.s.checkpoint(&c.uid);
        let spec_path = self.s.cdi_spec(&c.uid);
        if let Ok(raw) = std::fs::read(&cp_path) {
            let cp: Checkpoint = serde_json::from_slice(&raw)
                .map_err(|e| format!("{who}: checkpoint {} unreadable: {e}", cp_path.display()))?;
            if cp.uid != c.uid || cp.namespace != c.namespace || cp.name != c.name {
                return Err(format!(
                    "{who}: prepared before as {}/{} ({}); unprepare it first",
                    cp.namespace, cp.name, cp.uid
                ));
            }
            if !spec_path.exists() {
                Self::write_json(&spec_path, &cp.cdi_spec, 0o644).map_err(|e| format!("{who}: {e}"))?;
                tracing::info!(claim = %c.uid, file = %spec_path.display(), "CDI spec of a prepared claim was missing; written again");
            }
            return Ok(cp.devices);
        }
        let results = match looked {
            Looked::Remote(results) => results,
            Looked::Failed(e) => return Err(format!("{who} is unknown: no claim file, and the controller: {e}")),
            Looked::Local => self.claim_file(c, &who)?,
        };
        self.prepare_results(c, &who, &results, &cp_path, &spec_path)
    }

    /// The results of `c`'s claim file.
    fn claim_file(&self, c: &pb::Claim, who: &str) -> Result<Vec<AllocationResult>, String> {
        let file = self.s.claim_file(&c.uid);
        let raw = match std::fs::metadata(&file).and_then(|m| {
            if m.len() > MAX_CLAIM_FILE {
                Err(std::io::Error::other(format!("{} bytes, more than {MAX_CLAIM_FILE}", m.len())))
            } else {
                std::fs::read(&file)
            }
        }) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(format!("{who} is unknown: no claim file {}", file.display()));
            }
            Err(e) => return Err(format!("{who}: reading {}: {e}", file.display())),
        };
        let claim: ClaimFile =
            serde_json::from_slice(&raw).map_err(|e| format!("{who}: claim file {} invalid: {e}", file.display()))?;
        if claim.uid != c.uid || claim.namespace != c.namespace || claim.name != c.name {
            return Err(format!(
                "{who} is unknown: claim file {} is for {}/{} ({})",
                file.display(),
                claim.namespace,
                claim.name,
                claim.uid
            ));
        }
        Ok(claim.results)
    }

    fn prepare_results(
        &self,
        c: &pb::Claim,
        who: &str,
        results: &[AllocationResult],
        cp_path: &Path,
        spec_path: &Path,
    ) -> Result<Vec<PreparedDevice>, String> {
        if results.len() > MAX_RESULTS {
            return Err(format!("{who}: {} allocation results, more than {MAX_RESULTS}", results.len()));
        }
        let pool = &self.s.node_name;
        // Device → request names, in the claim's order.
        let mut wanted: Vec<(String, Vec<String>)> = Vec::new();
        for r in results.iter().filter(|r| r.driver == DRIVER_NAME && &r.pool == pool) {
            match wanted.iter_mut().find(|(d, _)| *d == r.device) {
                Some((_, reqs)) => {
                    if !reqs.contains(&r.request) {
                        reqs.push(r.request.clone());
                    }
                }
                None => wanted.push((r.device.clone(), vec![r.request.clone()])),
            }
        }
        if wanted.is_empty() {
            return Err(format!("{who} allocates no device of {DRIVER_NAME} in pool {pool:?}"));
        }
        self.devices.refresh(&self.s.config_file);
        let known: BTreeMap<String, Device> = self.devices.list().into_iter().map(|d| (d.name.clone(), d)).collect();
        let mut chosen: Vec<(String, &Device, Vec<String>)> = Vec::new();
        for (name, reqs) in &wanted {
            let d = known.get(name).ok_or_else(|| format!("{who}: device {name:?} does not exist in pool {pool:?}"))?;
            if !d.healthy {
                return Err(format!(
                    "{who}: device {name:?} is unhealthy ({} is missing or cannot be opened)",
                    d.path.display()
                ));
            }
            let cdi_name = format!("{}-{name}", c.uid);
            cdi::check_device_name(&cdi_name).map_err(|e| format!("{who}: {e}"))?;
            chosen.push((cdi_name, d, reqs.clone()));
        }
        let mounts: Vec<Vec<(&Path, &Path, bool)>> = chosen
            .iter()
            .map(|(_, d, _)| {
                d.resource
                    .mounts
                    .iter()
                    .map(|m| (m.host_path.as_path(), m.container_path.as_path(), m.read_only))
                    .collect()
            })
            .collect();
        let edits: Vec<cdi::Edits<'_>> = chosen
            .iter()
            .zip(mounts)
            .map(|((_, d, _), mounts)| cdi::Edits {
                permissions: &d.resource.permissions,
                env: &d.resource.env,
                mounts,
            })
            .collect();
        let spec = cdi::spec_per_device(
            CDI_KIND,
            chosen.iter().zip(&edits).map(|((n, d, _), e)| (n.as_str(), d.path.as_path(), e)),
        )
        .ok_or_else(|| format!("{who}: no device"))?;
        cdi::validate(&spec).map_err(|e| format!("{who}: CDI spec not written: {e}"))?;
        let devices: Vec<PreparedDevice> = chosen
            .iter()
            .map(|(cdi_name, d, reqs)| PreparedDevice {
                request_names: reqs.clone(),
                pool_name: pool.clone(),
                device_name: d.name.clone(),
                cdi_device_ids: vec![format!("{CDI_KIND}={cdi_name}")],
            })
            .collect();
        Self::write_json(spec_path, &spec, 0o644).map_err(|e| format!("{who}: {e}"))?;
        let cp = Checkpoint {
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            uid: c.uid.clone(),
            devices: devices.clone(),
            cdi_spec: spec,
        };
        if let Err(e) = Self::write_json(cp_path, &cp, 0o600) {
            let _ = std::fs::remove_file(spec_path);
            return Err(format!("{who}: {e}"));
        }
        tracing::info!(claim = %c.uid, namespace = %c.namespace, name = %c.name, devices = devices.len(), "DRA claim prepared");
        Ok(devices)
    }

    /// Unprepare one claim: its CDI spec, then its checkpoint. A claim never prepared (or
    /// unprepared already) is done (blocking).
    pub fn unprepare(&self, c: &pb::Claim) -> Result<(), String> {
        if check_uid(&c.uid).is_err() {
            // Nothing can have been prepared under a UID that names no file.
            return Ok(());
        }
        for p in [self.s.cdi_spec(&c.uid), self.s.checkpoint(&c.uid)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(format!("claim {}/{} ({}): removing {}: {e}", c.namespace, c.name, c.uid, p.display()));
                }
            }
        }
        tracing::info!(claim = %c.uid, namespace = %c.namespace, name = %c.name, "DRA claim unprepared");
        Ok(())
    }
}

/// A call carries at most [`MAX_CLAIMS`] claims (INVALID_ARGUMENT before any work).
fn check_batch(claims: &[pb::Claim]) -> Result<(), Status> {
    if claims.len() > MAX_CLAIMS {
        return Err(Status::invalid_argument(format!("{} claims in one call, more than {MAX_CLAIMS}", claims.len())));
    }
    Ok(())
}

/// The gRPC face: both services of `dra.sock`.
#[derive(Clone)]
struct Service {
    claims: Arc<Claims>,
    /// Serialises prepare and unprepare.
    lock: Arc<tokio::sync::Mutex<()>>,
    stop: watch::Receiver<bool>,
    lookup: Option<ClaimLookup>,
}

impl Service {
    async fn each<T: Send + 'static>(
        &self,
        claims: Vec<pb::Claim>,
        f: fn(&Claims, &pb::Claim) -> T,
    ) -> Result<Vec<(String, T)>, Status> {
        check_batch(&claims)?;
        let _serial = self.lock.lock().await;
        let c = self.claims.clone();
        crate::rpc::blocking(move || claims.iter().map(|claim| (claim.uid.clone(), f(&c, claim))).collect()).await
    }
}

#[tonic::async_trait]
impl pb::dra_plugin_server::DraPlugin for Service {
    async fn node_prepare_resources(
        &self,
        r: Request<pb::NodePrepareResourcesRequest>,
    ) -> Result<Response<pb::NodePrepareResourcesResponse>, Status> {
        let claims = r.into_inner().claims;
        check_batch(&claims)?;
        // Allocations not known here come from the controller: looked up before the lock
        // (a slow controller holds up no other call), all at once, under one deadline well
        // inside kubelet's call timeout. A claim prepared before, or with a claim file,
        // needs none.
        let mut looked: Vec<Looked> = claims.iter().map(|_| Looked::Local).collect();
        if let Some(lookup) = &self.lookup {
            let mut set = tokio::task::JoinSet::new();
            for (i, c) in claims.iter().enumerate() {
                if self.claims.needs_lookup(c) {
                    let fut = lookup(c.clone());
                    set.spawn(async move { (i, tokio::time::timeout(LOOKUP_TIMEOUT, fut).await) });
                }
            }
            while let Some(done) = set.join_next().await {
                if let Ok((i, r)) = done {
                    looked[i] = match r {
                        Ok(Ok(results)) => Looked::Remote(results),
                        Ok(Err(e)) => Looked::Failed(e),
                        Err(_) => Looked::Failed(format!("no answer within {LOOKUP_TIMEOUT:?}")),
                    };
                }
            }
        }
        let _serial = self.lock.lock().await;
        let cl = self.claims.clone();
        let out: Vec<(String, Result<Vec<PreparedDevice>, String>)> = crate::rpc::blocking(move || {
            claims.iter().zip(looked).map(|(c, l)| (c.uid.clone(), cl.prepare_with(c, l))).collect()
        })
        .await?;
        let claims = out
            .into_iter()
            .map(|(uid, res)| {
                let answer = match res {
                    Ok(devices) => pb::NodePrepareResourceResponse {
                        devices: devices.iter().map(to_pb).collect(),
                        error: String::new(),
                    },
                    Err(e) => {
                        tracing::warn!(claim = %uid, error = %e, "DRA claim not prepared");
                        pb::NodePrepareResourceResponse { devices: Vec::new(), error: e }
                    }
                };
                (uid, answer)
            })
            .collect();
        Ok(Response::new(pb::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        r: Request<pb::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<pb::NodeUnprepareResourcesResponse>, Status> {
        let out = self.each(r.into_inner().claims, Claims::unprepare).await?;
        let claims = out
            .into_iter()
            .map(|(uid, res)| (uid, pb::NodeUnprepareResourceResponse { error: res.err().unwrap_or_default() }))
            .collect();
        Ok(Response::new(pb::NodeUnprepareResourcesResponse { claims }))
    }
}

type HealthStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<hpb::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl hpb::dra_resource_health_server::DraResourceHealth for Service {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<hpb::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let devices = self.claims.devices.clone();
        let pool = self.claims.s.node_name.clone();
        let mut changed = devices.subscribe();
        let mut stop = self.stop.clone();
        tokio::spawn(async move {
            loop {
                changed.borrow_and_update();
                if tx.send(Ok(devices.report(&pool))).await.is_err() {
                    return;
                }
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = tokio::time::sleep(RESEND_EVERY) => {}
                    _ = tx.closed() => return,
                    _ = stopped(&mut stop) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// A served registration socket.
struct Offered {
    id: Option<SockId>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

fn offer(s: &Settings, book: &crate::kubelet::Registrations) -> Result<Offered, String> {
    let path = s.registration_socket();
    let registration = crate::kubelet::registration::Registration {
        info: crate::kubelet::registration::PluginInfo {
            kind: crate::kubelet::Kind::Dra,
            plugin_type: "DRAPlugin",
            name: DRIVER_NAME.into(),
            endpoint: s.socket(),
            versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        },
        book: book.clone(),
    };
    let (stop, mut rx) = watch::channel(false);
    let task = crate::kubelet::registration::serve(&path, registration, async move {
        let _ = rx.wait_for(|v| *v).await;
    })?;
    Ok(Offered { id: sock_id(&path), stop, task })
}

async fn withdraw(o: Offered) {
    stop_task(&o.stop, o.task, Duration::from_secs(2)).await;
}

/// Serve the DRA plugin until `shutdown` turns true; then remove its sockets (registration
/// first). The plugin directory must be absolute (kubelet dials the endpoint as given).
pub async fn run(
    s: Settings,
    mut shutdown: watch::Receiver<bool>,
    book: crate::kubelet::Registrations,
    devices: Arc<Devices>,
    lookup: Option<ClaimLookup>,
) {
    let sock = s.socket();
    let listener = match crate::sys::fs::bind_unix_socket(&sock) {
        Ok(l) => l,
        Err(e) => {
            // Never scanned, so nothing is reported to the controller either: no pool of
            // devices nobody can prepare.
            tracing::error!(socket = %sock.display(), error = %e, "DRA plugin disabled: cannot bind its socket");
            return;
        }
    };
    {
        let (d, f) = (devices.clone(), s.config_file.clone());
        let _ = tokio::task::spawn_blocking(move || d.refresh(&f)).await;
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let svc = Service {
        claims: Arc::new(Claims { s: s.clone(), devices: devices.clone() }),
        lock: Arc::default(),
        stop: stop_rx.clone(),
        lookup,
    };
    let mut server_stop = stop_rx;
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(crate::rpc::response_layer())
            .add_service(pb::dra_plugin_server::DraPluginServer::new(svc.clone()))
            .add_service(hpb::dra_resource_health_server::DraResourceHealthServer::new(svc))
            .serve_with_incoming_shutdown(crate::rpc::authority::incoming(listener), async move {
                let _ = server_stop.wait_for(|v| *v).await;
            }),
    );
    tracing::info!(socket = %sock.display(), devices = devices.list().len(), "DRA plugin serving");
    let reg_path = s.registration_socket();
    let mut offered: Option<Offered> = None;
    let mut last_error: Option<String> = None;
    let mut tick = tokio::time::interval(BACKSTOP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut scan = tokio::time::interval(SCAN_EVERY);
    scan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // The registration socket: offered, and still the one we bound.
        if offered.as_ref().is_some_and(|o| o.id.is_none() || sock_id(&reg_path) != o.id) {
            tracing::info!(socket = %reg_path.display(), "DRA registration socket removed or replaced (kubelet restarted?); offering it again");
            withdraw(offered.take().expect("checked")).await;
        }
        if offered.is_none() {
            match offer(&s, &book) {
                Ok(o) => {
                    offered = Some(o);
                    last_error = None;
                }
                Err(e) => {
                    if last_error.as_ref() != Some(&e) {
                        tracing::error!(socket = %reg_path.display(), error = %e, "cannot offer DRA registration; retrying");
                        last_error = Some(e);
                    }
                }
            }
        }
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            _ = tick.tick() => {}
            _ = scan.tick() => {
                let (d, f) = (devices.clone(), s.config_file.clone());
                let _ = tokio::task::spawn_blocking(move || d.refresh(&f)).await;
            }
        }
    }
    if let Some(o) = offered.take() {
        if sock_id(&reg_path) == o.id {
            let _ = std::fs::remove_file(&reg_path);
        }
        book.withdrawn(DRIVER_NAME);
        withdraw(o).await;
    }
    stop_task(&stop_tx, server, Duration::from_secs(5)).await;
    let _ = std::fs::remove_file(&sock);
    tracing::info!("DRA plugin stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_are_dns_labels() {
        assert_eq!(device_name("gpu", "card0").as_deref(), Some("gpu-card0"));
        assert_eq!(device_name("gpu", "Card_0.x").as_deref(), Some("gpu-card-0-x"));
        assert_eq!(device_name("a", "--b--").as_deref(), Some("a-b"));
        let long = device_name("r", &"x".repeat(100)).unwrap();
        assert_eq!(long.len(), 63);
        assert!(check_uid("6f0c2a1e-0b6b-4d2c-9c1e-7e3a7d3b9f00").is_ok());
        assert!(check_uid("../x").is_err());
        assert!(check_uid("").is_err());
    }
}
