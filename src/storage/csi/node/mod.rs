//! The CSI Node service's work: stage, publish, unpublish, unstage, stats and expansion of
//! node-local volumes, as blocking functions (the gRPC layer runs them on blocking threads).
//!
//! Truth is the kernel's, asked about this volume only, so a call costs the same however many
//! volumes the node has: the mount on each of the volume's own paths (`statx` of the path:
//! mount root, device), the loop devices bound to its image (confirmed with
//! `LOOP_GET_STATUS64`); the whole mount table is read only where a mount nothing records
//! could matter (beneath a foreign mount; once per unstage). Small records under `<state>/csi/` say what was asked (capability, paths, which
//! target the agent created), so an incompatible repeat is told apart from an idempotent
//! one, and a restart can finish or roll back what it interrupted:
//!
//! ```text
//! <state>/csi/stage/<volume-id>.json     one per staged volume ("staging" while in progress)
//! <state>/csi/publish/<hash>.json        one per published target path
//! ```
//!
//! A record is written before the kernel state it describes and removed after it is undone,
//! so a crash at any point leaves a record for everything that might exist.

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tonic::Code;

use super::capability::{self, Capability, CapabilityError};
use crate::rpc::csi;
use crate::rpc::csi::volume_capability::access_mode::Mode;
use crate::rpc::node as api;
use crate::storage::fs as vfs;
use crate::storage::store::{FsType, VolumeError, VolumeStore};
use crate::sys::loopdev;
use crate::sys::mount::{self, MountEntry, MountOptions};
use crate::sys::volume_kernel::{MountError, VolumeKernel};

/// A failed CSI call: the gRPC code the spec asks for and a message naming what was wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsiError {
    pub code: Code,
    pub msg: String,
}

impl std::fmt::Display for CsiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.code, self.msg)
    }
}

impl CsiError {
    pub fn new(code: Code, msg: impl Into<String>) -> Self {
        CsiError { code, msg: msg.into() }
    }
}

fn invalid(msg: impl Into<String>) -> CsiError {
    CsiError::new(Code::InvalidArgument, msg)
}
fn precondition(msg: impl Into<String>) -> CsiError {
    CsiError::new(Code::FailedPrecondition, msg)
}
fn internal(msg: impl Into<String>) -> CsiError {
    CsiError::new(Code::Internal, msg)
}
fn not_found(id: &str) -> CsiError {
    CsiError::new(Code::NotFound, format!("volume {id} does not exist on this node"))
}
/// A known volume asked about at a path where it is neither staged nor published.
fn not_at(id: &str, raw_path: &str) -> CsiError {
    let shown: String = raw_path.chars().take(4096).collect();
    CsiError::new(
        Code::NotFound,
        format!("volume {id} does not exist at {shown:?}: it is not staged or published there"),
    )
}

impl From<CsiError> for tonic::Status {
    fn from(e: CsiError) -> Self {
        tonic::Status::new(e.code, e.msg)
    }
}

/// The gRPC code of a volume store error in the CSI Node service.
pub fn volume_error_code(e: &VolumeError) -> Code {
    match e {
        VolumeError::InvalidId { .. } | VolumeError::InvalidSize { .. } | VolumeError::InvalidFsType(_) => {
            Code::InvalidArgument
        }
        VolumeError::NotFound(_) => Code::NotFound,
        VolumeError::AlreadyExists { .. } | VolumeError::SnapshotExists { .. } => Code::AlreadyExists,
        VolumeError::CapacityExceeded { .. } | VolumeError::Shrink { .. } => Code::OutOfRange,
        VolumeError::Busy { .. } | VolumeError::BackingFileMissing { .. } => Code::FailedPrecondition,
        VolumeError::Fs(crate::storage::store::FsError::OnlineResizeNotPermitted(_)) => Code::FailedPrecondition,
        VolumeError::Locked { .. } | VolumeError::Io { .. } | VolumeError::Metadata { .. } | VolumeError::Fs(_) => {
            Code::Internal
        }
    }
}

impl From<VolumeError> for CsiError {
    fn from(e: VolumeError) -> Self {
        CsiError::new(volume_error_code(&e), e.to_string())
    }
}

impl From<vfs::FsError> for CsiError {
    fn from(e: vfs::FsError) -> Self {
        VolumeError::Fs(e).into()
    }
}

type Result<T, E = CsiError> = std::result::Result<T, E>;

impl From<CapabilityError> for CsiError {
    /// The node's codes: a MULTI_NODE mode is FAILED_PRECONDITION ("exceeds the volume's
    /// capabilities"), everything else INVALID_ARGUMENT.
    fn from(e: CapabilityError) -> Self {
        let code =
            if matches!(e, CapabilityError::MultiNode(_)) { Code::FailedPrecondition } else { Code::InvalidArgument };
        CsiError::new(code, e.to_string())
    }
}

/// Parse and check a request's `volume_capability`: present, an access type, a single-node
/// access mode, a supported filesystem, well-formed mount flags and group
/// (`super::capability` is the reading the controller shares).
pub fn parse_capability(c: Option<&csi::VolumeCapability>) -> Result<Capability> {
    let c = c.ok_or_else(|| CsiError::from(CapabilityError::Missing("volume_capability".into())))?;
    let cap = capability::parse(c, "volume_capability")?;
    capability::check_mount_options(&cap)?;
    Ok(cap)
}

/// Whether `cap` fits volume `vol`: block access works on any volume (it is the device);
/// mount access needs a filesystem volume of the asked type.
fn check_fits(vol: &crate::storage::store::Volume, cap: &Capability) -> Result<()> {
    if cap.block {
        return Ok(());
    }
    if vol.fs_type.is_raw() {
        return Err(invalid(format!("volume {} is a raw block volume; it cannot be mounted as a filesystem", vol.id)));
    }
    if !cap.fs_type.is_empty() && cap.fs_type != vol.fs_type.as_str() {
        return Err(invalid(format!(
            "volume {} holds {}, the capability asks for {}",
            vol.id,
            vol.fs_type.as_str(),
            cap.fs_type
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StageState {
    Staging,
    Staged,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StageRecord {
    volume_id: String,
    staging_path: PathBuf,
    capability: Capability,
    state: StageState,
}

impl StageRecord {
    /// Same request as `cap` for staging purposes (the mount group applies at publish).
    fn same(&self, cap: &Capability) -> bool {
        let a = &self.capability;
        a.block == cap.block
            && a.mount_flags == cap.mount_flags
            && a.access_mode == cap.access_mode
            && (a.fs_type == cap.fs_type || a.fs_type.is_empty() || cap.fs_type.is_empty())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PublishRecord {
    volume_id: String,
    target_path: PathBuf,
    staging_path: PathBuf,
    capability: Capability,
    read_only: bool,
    /// The agent created the target (and so removes it on unpublish).
    created_target: bool,
}

/// A loop device bound to a volume.
struct LoopDev {
    path: PathBuf,
    /// major, minor
    num: (u32, u32),
    ro: bool,
}

/// Node service settings.
#[derive(Debug, Clone)]
pub struct NodeSettings {
    pub node_id: String,
    /// Canonical kubelet root: every staging and target path must lie inside it.
    pub kubelet_dir: PathBuf,
    /// `<state>/csi`
    pub record_dir: PathBuf,
    pub max_volumes: i64,
}

/// The node service's state. Share it behind an `Arc`.
pub struct NodeService {
    pub settings: NodeSettings,
    pub store: Arc<VolumeStore>,
    /// The store's kernel: mounts, device numbers and filesystem tools go through it too.
    kernel: Arc<dyn VolumeKernel>,
    busy: Mutex<HashMap<String, Holds>>,
    /// The publish records, by target path: loaded from `<state>/csi/publish/` at start and
    /// kept in step with every record the service writes or removes, so a call never lists
    /// the directory (the records are this process' own; nothing else writes them).
    publishes: Mutex<HashMap<PathBuf, PublishRecord>>,
    /// Signalled whenever a hold is released.
    released: Condvar,
    ready: AtomicBool,
    /// Node calls by method and gRPC code, and their latency (the agent exposes them).
    pub operations: Arc<crate::obs::metrics::CounterVec>,
    pub durations: Arc<crate::obs::metrics::HistogramVec>,
}

/// What the records say is staged and published (cheap: two small directories).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MountCounts {
    /// Volumes staged (`staged` records).
    pub staged: usize,
    /// Stages in progress or interrupted (`staging` records).
    pub staging: usize,
    /// Published target paths.
    pub published: usize,
}

/// How long a publish or unpublish waits for a stage, unstage or expand of its volume (or a
/// publish for another publish of it) before it answers ABORTED.
pub const TARGET_WAIT: Duration = Duration::from_secs(5);

/// What is in progress on one volume.
#[derive(Debug, Default)]
struct Holds {
    /// A stage, unstage, expand (or the doctor) has the whole volume.
    exclusive: bool,
    /// Targets with a publish or unpublish in progress.
    targets: HashSet<PathBuf>,
    /// A publish (or an unpublish releasing a shared device) is in its volume-wide section:
    /// access-mode checks, records and the read-only device are decided one at a time.
    publishing: bool,
}

impl Holds {
    fn idle(&self) -> bool {
        !self.exclusive && !self.publishing && self.targets.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Hold {
    Volume,
    Target(PathBuf),
    Publishing,
}

/// Holds a volume, or one target of it, for one operation (see [`NodeService::guard`] and
/// [`NodeService::target_guard`]); released on drop.
pub struct VolumeGuard<'a> {
    svc: &'a NodeService,
    id: String,
    hold: Hold,
}

impl Drop for VolumeGuard<'_> {
    fn drop(&mut self) {
        let mut busy = self.svc.busy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = busy.get_mut(&self.id) {
            match &self.hold {
                Hold::Volume => h.exclusive = false,
                Hold::Target(t) => {
                    h.targets.remove(t);
                }
                Hold::Publishing => h.publishing = false,
            }
            if h.idle() {
                busy.remove(&self.id);
            }
        }
        drop(busy);
        self.svc.released.notify_all();
    }
}

fn required<'a>(field: &str, v: &'a str) -> Result<&'a str> {
    if v.is_empty() { Err(invalid(format!("{field} is required"))) } else { Ok(v) }
}

fn io_internal(what: String) -> impl FnOnce(io::Error) -> CsiError {
    move |e| internal(format!("{what}: {e}"))
}

fn errno_internal(what: String) -> impl FnOnce(nix::errno::Errno) -> CsiError {
    move |e| internal(format!("{what}: {e}"))
}

impl NodeService {
    pub fn new(settings: NodeSettings, store: Arc<VolumeStore>) -> io::Result<Self> {
        for d in ["stage", "publish"] {
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(settings.record_dir.join(d))?;
        }
        let operations = crate::obs::metrics::CounterVec::new(
            "nodeplane_csi_operations_total",
            "CSI Node calls answered, by method and gRPC status code.",
            &["method", "code"],
        );
        let durations = crate::obs::metrics::HistogramVec::new(
            "nodeplane_csi_operation_duration_seconds",
            "Time to answer a CSI Node call that did volume work, by method.",
            &["method"],
            crate::obs::metrics::LATENCY_BUCKETS,
        );
        let publishes =
            Self::read_publish_records(&settings.record_dir).into_iter().map(|r| (r.target_path.clone(), r)).collect();
        Ok(NodeService {
            settings,
            kernel: store.kernel().clone(),
            store,
            busy: Mutex::new(HashMap::new()),
            publishes: Mutex::new(publishes),
            released: Condvar::new(),
            ready: AtomicBool::new(false),
            operations,
            durations,
        })
    }

    /// Staged and published volumes, from the records (which are written before the kernel
    /// state they describe and removed after it is undone).
    pub fn mount_counts(&self) -> MountCounts {
        let stages = self.stage_records();
        MountCounts {
            staged: stages.iter().filter(|r| r.state == StageState::Staged).count(),
            staging: stages.iter().filter(|r| r.state == StageState::Staging).count(),
            published: self.publish_records().len(),
        }
    }

    pub fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub(crate) fn kernel(&self) -> &Arc<dyn VolumeKernel> {
        &self.kernel
    }

    /// Where volume `id` is staged as a filesystem, by its record (the caller checks the
    /// kernel before acting on it).
    pub(crate) fn staged_filesystem_path(&self, id: &str) -> Option<PathBuf> {
        let r = self.load_stage(id).ok().flatten()?;
        (r.state == StageState::Staged && !r.capability.block).then_some(r.staging_path)
    }

    /// Hold the whole of volume `id` (stage, unstage, expand, the doctor), or ABORTED at once
    /// when any operation on it is in progress.
    pub fn guard(&self, id: &str) -> Result<VolumeGuard<'_>> {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let h = busy.entry(id.to_string()).or_default();
        if !h.idle() {
            return Err(CsiError::new(Code::Aborted, format!("an operation on volume {id} is already in progress")));
        }
        h.exclusive = true;
        Ok(VolumeGuard { svc: self, id: id.to_string(), hold: Hold::Volume })
    }

    /// Hold one target of volume `id` for a publish or unpublish. Targets of one volume are
    /// served concurrently (kubelet unpublishes every pod of a volume in one pass); the same
    /// target twice is ABORTED at once; a stage, unstage or expand of the volume in progress
    /// is waited for, at most `wait`, then ABORTED.
    pub fn target_guard(&self, id: &str, target: &Path, wait: Duration) -> Result<VolumeGuard<'_>> {
        let deadline = Instant::now() + wait;
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let h = busy.entry(id.to_string()).or_default();
            if h.targets.contains(target) {
                return Err(CsiError::new(
                    Code::Aborted,
                    format!("an operation on volume {id} at {} is already in progress", target.display()),
                ));
            }
            if !h.exclusive {
                h.targets.insert(target.to_path_buf());
                return Ok(VolumeGuard { svc: self, id: id.to_string(), hold: Hold::Target(target.to_path_buf()) });
            }
            busy = self.wait_released(busy, deadline).map_err(|()| {
                CsiError::new(
                    Code::Aborted,
                    format!(
                        "volume {id} is being staged, unstaged or expanded; still busy after {} ms",
                        wait.as_millis()
                    ),
                )
            })?;
        }
    }

    /// The volume-wide section of a publish (or of an unpublish that may release the
    /// volume's shared read-only device): one at a time per volume, waited for up to `wait`.
    /// Taken while holding a target of the volume, never a whole-volume guard.
    fn publishing_guard(&self, id: &str, wait: Duration) -> Result<VolumeGuard<'_>> {
        let deadline = Instant::now() + wait;
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let h = busy.entry(id.to_string()).or_default();
            if !h.publishing {
                h.publishing = true;
                return Ok(VolumeGuard { svc: self, id: id.to_string(), hold: Hold::Publishing });
            }
            busy = self.wait_released(busy, deadline).map_err(|()| {
                CsiError::new(
                    Code::Aborted,
                    format!("another publish of volume {id} is still in progress after {} ms", wait.as_millis()),
                )
            })?;
        }
    }

    fn wait_released<'g>(
        &self,
        busy: std::sync::MutexGuard<'g, HashMap<String, Holds>>,
        deadline: Instant,
    ) -> std::result::Result<std::sync::MutexGuard<'g, HashMap<String, Holds>>, ()> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(());
        }
        Ok(self.released.wait_timeout(busy, left).unwrap_or_else(|p| p.into_inner()).0)
    }

    /// A request's `volume_id`: required (INVALID_ARGUMENT when empty). An id the store
    /// could never have made (`validate_id` refuses it) names a volume that does not exist:
    /// NOT_FOUND, like any unknown id, and it is never used to build a path.
    fn volume_id<'a>(&self, v: &'a str) -> Result<&'a str> {
        let id = required("volume_id", v)?;
        if crate::storage::store::validate_id(id).is_err() {
            let shown: String = id.chars().take(140).collect();
            return Err(CsiError::new(
                Code::NotFound,
                format!("volume {shown:?} does not exist (not a valid volume id)"),
            ));
        }
        Ok(id)
    }

    /// NOT_FOUND unless volume `id` exists in the store. Checked before any path argument
    /// (the spec lists NOT_FOUND for "volume does not exist"), so an unknown volume with a
    /// bad path is NOT_FOUND; the path is never looked at.
    fn existing(&self, id: &str) -> Result<crate::storage::store::Volume> {
        self.store.get(id)?.ok_or_else(|| not_found(id))
    }

    /// Whether the agent has any record of volume `id`: a stage record, or a publish record
    /// naming it (a volume deleted from the store while something of it was left staged or
    /// published is still torn down).
    fn recorded(&self, id: &str) -> Result<bool> {
        Ok(self.load_stage(id)?.is_some() || self.publishes_lock().values().any(|r| r.volume_id == id))
    }

    /// NOT_FOUND for a teardown of a volume that neither exists nor has a record. A mount is
    /// only ever made after its record is written, so no record means nothing of ours.
    fn known_or_recorded(&self, id: &str) -> Result<bool> {
        let known = self.store.get(id)?.is_some();
        if !known && !self.recorded(id)? {
            return Err(not_found(id));
        }
        Ok(known)
    }

    fn path(&self, field: &str, v: &str) -> Result<PathBuf> {
        required(field, v)?;
        mount::validate_path(field, v, &self.settings.kubelet_dir).map_err(invalid)
    }

    // ----- records -----

    fn stage_record_path(&self, id: &str) -> PathBuf {
        self.settings.record_dir.join("stage").join(format!("{id}.json"))
    }

    fn publish_record_path(&self, target: &Path) -> PathBuf {
        let h = crate::util::fnv1a(&[target.as_os_str().as_encoded_bytes()]);
        self.settings.record_dir.join("publish").join(format!("{h:016x}.json"))
    }

    fn load<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>> {
        match std::fs::read(path) {
            Ok(b) => match serde_json::from_slice(&b) {
                Ok(r) => Ok(Some(r)),
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e, "unreadable CSI record; ignoring it");
                    Ok(None)
                }
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(internal(format!("reading {}: {e}", path.display()))),
        }
    }

    /// Records are replaced atomically but not fsync'd: they describe mounts and loop
    /// devices, which a power loss takes away with them, while an agent crash keeps what
    /// the kernel already has (the page cache survives the process).
    fn save<T: Serialize>(&self, path: &Path, rec: &T) -> Result<()> {
        let data = serde_json::to_vec_pretty(rec).map_err(|e| internal(e.to_string()))?;
        crate::sys::fs::atomic_write_nosync(path, &data).map_err(io_internal(format!("writing {}", path.display())))
    }

    /// Remove a record (gone already is fine).
    fn remove_record(&self, path: &Path) -> Result<()> {
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(internal(format!("removing {}: {e}", path.display()))),
        }
    }

    fn load_stage(&self, id: &str) -> Result<Option<StageRecord>> {
        Self::load(&self.stage_record_path(id))
    }

    fn publishes_lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, PublishRecord>> {
        self.publishes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn load_publish(&self, target: &Path) -> Result<Option<PublishRecord>> {
        Ok(self.publishes_lock().get(target).cloned())
    }

    /// Write a publish record (file first, then the in-memory view).
    fn save_publish(&self, rec: &PublishRecord) -> Result<()> {
        self.save(&self.publish_record_path(&rec.target_path), rec)?;
        self.publishes_lock().insert(rec.target_path.clone(), rec.clone());
        Ok(())
    }

    /// Remove the publish record of `target` (file first, then the in-memory view).
    fn remove_publish(&self, target: &Path) -> Result<()> {
        self.remove_record(&self.publish_record_path(target))?;
        self.publishes_lock().remove(target);
        Ok(())
    }

    fn publish_records(&self) -> Vec<PublishRecord> {
        self.publishes_lock().values().cloned().collect()
    }

    /// Whether a publish record puts volume `id` at `raw` (compared as a path, nothing on
    /// disk looked at).
    fn published_at(&self, id: &str, raw: &str) -> bool {
        self.publishes_lock().get(Path::new(raw)).is_some_and(|r| r.volume_id == id)
    }

    /// The publish records of volume `id`.
    fn publishes_of(&self, id: &str) -> Vec<PublishRecord> {
        self.publishes_lock().values().filter(|r| r.volume_id == id).cloned().collect()
    }

    fn read_publish_records(record_dir: &Path) -> Vec<PublishRecord> {
        let dir = record_dir.join("publish");
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.file_name().as_encoded_bytes().ends_with(b".json"))
            .filter_map(|e| Self::load::<PublishRecord>(&e.path()).ok().flatten())
            .collect()
    }

    fn stage_records(&self) -> Vec<StageRecord> {
        let dir = self.settings.record_dir.join("stage");
        let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
        entries
            .flatten()
            .filter(|e| e.file_name().as_encoded_bytes().ends_with(b".json"))
            .filter_map(|e| Self::load::<StageRecord>(&e.path()).ok().flatten())
            .collect()
    }

    // ----- kernel state -----

    fn table(&self) -> Result<Vec<MountEntry>> {
        self.kernel.mount_table().map_err(io_internal("reading /proc/self/mountinfo".into()))
    }

    /// Every loop device bound to volume `id` (read-write first).
    fn volume_devices(&self, id: &str) -> Result<Vec<LoopDev>> {
        let mut out = Vec::new();
        for b in self.store.bindings(id)? {
            if let Ok(num) = self.kernel.dev_numbers(&b.device) {
                out.push(LoopDev { path: b.device, num, ro: b.read_only });
            }
        }
        out.sort_by_key(|d| d.ro);
        Ok(out)
    }

    /// Whether `m` shows one of `devices` mounted (a filesystem on the device, or the device
    /// node bind-mounted from devtmpfs for block access).
    fn is_volume_mount(&self, m: &MountEntry, devices: &[LoopDev]) -> bool {
        if devices.iter().any(|d| (m.major, m.minor) == d.num) {
            return true;
        }
        // A block publication is the device node bind-mounted onto a file: mountinfo shows
        // the filesystem holding the node (devtmpfs, or a tmpfs /dev), so compare the node
        // itself.
        if matches!(m.fs_type.as_str(), "devtmpfs" | "tmpfs")
            && let Some(num) = self.kernel.block_node(&m.mount_point)
        {
            return devices.iter().any(|d| d.num == num);
        }
        false
    }

    /// The topmost mount on `path`, from `statx` of the path alone (the cost does not grow
    /// with the node's mounts).
    fn top_at(&self, path: &Path) -> Result<Option<MountEntry>> {
        self.kernel.top_mount(path).map_err(io_internal(format!("inspecting the mount at {}", path.display())))
    }

    /// Whether one of `devices` is mounted at `path`: the topmost mount, or — read from the
    /// mount table only when another mount sits on top — one beneath it.
    fn ours_at(&self, path: &Path, devices: &[LoopDev]) -> Result<bool> {
        match self.top_at(path)? {
            None => Ok(false),
            Some(m) if self.is_volume_mount(&m, devices) => Ok(true),
            Some(_) => Ok(mount::mounts_at(&self.table()?, path).iter().any(|m| self.is_volume_mount(m, devices))),
        }
    }

    /// Unmount this volume's mounts stacked on `path`, topmost first, stopping at the first
    /// mount that is not the volume's (someone else's mount is never taken away).
    fn unmount_ours(&self, id: &str, path: &Path) -> Result<usize> {
        self.unmount_of(id, path, &self.volume_devices(id)?)
    }

    /// [`Self::unmount_ours`] with the volume's devices as the caller found them (under the
    /// lock it holds), so a request looks its loop devices up once.
    fn unmount_of(&self, id: &str, path: &Path, devices: &[LoopDev]) -> Result<usize> {
        let mut n = 0;
        loop {
            match self.top_at(path)? {
                Some(m) if self.is_volume_mount(&m, devices) => {
                    self.kernel.unmount(path).map_err(errno_internal(format!("unmounting {}", path.display())))?;
                    n += 1;
                }
                Some(m) => {
                    tracing::warn!(volume = id, path = %path.display(), fs = %m.fs_type, source = %m.source, "leaving a mount that is not this volume's");
                    return Ok(n);
                }
                None => return Ok(n),
            }
            if n > 64 {
                return Err(internal(format!("{} still mounted after 64 unmounts", path.display())));
            }
        }
    }

    /// Mounts of the volume's devices that are neither at `staging` nor at a recorded
    /// staging path (read from the mount table).
    fn unrecorded_mounts(&self, staging: &Path, devices: &[LoopDev], rec: Option<&StageRecord>) -> Result<Vec<String>> {
        let table = if devices.is_empty() { Vec::new() } else { self.table()? };
        Ok(table
            .iter()
            .filter(|m| m.mount_point != staging && self.is_volume_mount(m, devices))
            .filter(|m| rec.is_none_or(|r| r.staging_path != m.mount_point))
            .map(|m| m.mount_point.display().to_string())
            .collect())
    }

    /// Mount the volume back at its staging path after an unstage that found it still in use
    /// (the filesystem is still mounted elsewhere, so this mounts that same filesystem).
    fn restage_after_refusal(&self, id: &str, staging: &Path, rec: &StageRecord, devices: &[LoopDev]) -> Result<()> {
        let dev =
            devices.iter().find(|d| !d.ro).ok_or_else(|| internal(format!("volume {id} has no read-write device")))?;
        let vol = self.store.get(id)?.ok_or_else(|| not_found(id))?;
        let mut opts = mount::parse_mount_flags(&rec.capability.mount_flags).map_err(invalid)?;
        if vol.fs_type == FsType::Xfs && !opts.data.iter().any(|d| d == "nouuid") {
            opts.data.push("nouuid".to_string());
        }
        self.kernel
            .mount_device(&dev.path, &self.settings.kubelet_dir, staging, vol.fs_type.as_str(), &opts)
            .map_err(|e| internal(format!("mounting {} at {}: {e:?}", dev.path.display(), staging.display())))
    }

    // ----- Node RPCs -----

    pub fn stage(&self, req: &csi::NodeStageVolumeRequest) -> Result<()> {
        // A required field that is missing stays INVALID_ARGUMENT, before NOT_FOUND (also
        // for an id no volume can have).
        required("volume_id", &req.volume_id)?;
        required("staging_target_path", &req.staging_target_path)?;
        if req.volume_capability.is_none() {
            return Err(invalid("volume_capability is required"));
        }
        let id = self.volume_id(&req.volume_id)?;
        self.existing(id)?;
        let staging = self.path("staging_target_path", &req.staging_target_path)?;
        let cap = parse_capability(req.volume_capability.as_ref())?;
        let opts = mount::parse_mount_flags(&cap.mount_flags).map_err(invalid)?;
        let _g = self.guard(id)?;
        let vol = self.store.get(id)?.ok_or_else(|| not_found(id))?;
        check_fits(&vol, &cap)?;
        let devices = self.volume_devices(id)?;
        let rec = self.load_stage(id)?;
        if let Some(r) = &rec {
            let mounted_there = self.ours_at(&r.staging_path, &devices)?;
            let staged_there =
                r.state == StageState::Staged && (mounted_there || (r.capability.block && !devices.is_empty()));
            if r.staging_path != staging && staged_there {
                return Err(precondition(format!(
                    "volume {id} is already staged at {}; unstage it there first",
                    r.staging_path.display()
                )));
            }
            if r.staging_path == staging && staged_there && !r.same(&cap) {
                return Err(CsiError::new(
                    Code::AlreadyExists,
                    format!("volume {id} is already staged at {} with a different capability", staging.display()),
                ));
            }
        }
        if let Some(top) = self.top_at(&staging)? {
            if !cap.block
                && self.is_volume_mount(&top, &devices)
                && top.read_only() == opts.flags.contains(nix::mount::MsFlags::MS_RDONLY)
            {
                // Already mounted here (a retry, possibly after a restart): finish the record.
                let mut r = rec.unwrap_or(StageRecord {
                    volume_id: id.to_string(),
                    staging_path: staging.clone(),
                    capability: cap.clone(),
                    state: StageState::Staged,
                });
                if r.state != StageState::Staged || r.staging_path != staging {
                    r.state = StageState::Staged;
                    r.staging_path = staging.clone();
                    self.save(&self.stage_record_path(id), &r)?;
                }
                return Ok(());
            }
            return Err(CsiError::new(
                Code::AlreadyExists,
                format!(
                    "{} already has a mount ({} {}) that is not this volume staged as asked",
                    staging.display(),
                    top.fs_type,
                    top.source
                ),
            ));
        }
        if cap.block
            && let Some(r) = &rec
            && r.state == StageState::Staged
            && r.staging_path == staging
            && r.same(&cap)
            && devices.iter().any(|d| !d.ro)
        {
            return Ok(()); // already staged (kubelet repeats NodeStage for every pod)
        }
        let rec_path = self.stage_record_path(id);
        self.save(
            &rec_path,
            &StageRecord {
                volume_id: id.to_string(),
                staging_path: staging.clone(),
                capability: cap.clone(),
                state: StageState::Staging,
            },
        )?;
        crate::util::crash_point("stage-after-record");
        let attached_before = devices.iter().any(|d| !d.ro);
        // The final record is part of the work: when it cannot be written (a full state disk,
        // where the first record went into a spare that already had room) the stage is rolled
        // back like any other failure, not left mounted under a "staging" record.
        let result = self.stage_work(&vol, &staging, &cap, &opts).and_then(|()| {
            self.save(
                &rec_path,
                &StageRecord {
                    volume_id: id.to_string(),
                    staging_path: staging.clone(),
                    capability: cap.clone(),
                    state: StageState::Staged,
                },
            )
        });
        if result.is_err() {
            // Roll back to where we started: nothing mounted, not attached (unless it was).
            if !cap.block {
                let _ = self.unmount_ours(id, &staging);
            }
            if !attached_before && let Err(d) = self.store.detach(id) {
                tracing::warn!(volume = id, error = %d, "rolling back a failed stage: detach failed");
            }
            // Back to the record as it was (a staged volume stays staged).
            let _ = match &rec {
                Some(r) if attached_before => self.save(&rec_path, r),
                _ => self.remove_record(&rec_path),
            };
        }
        result
    }

    fn stage_work(
        &self,
        vol: &crate::storage::store::Volume,
        staging: &Path,
        cap: &Capability,
        opts: &MountOptions,
    ) -> Result<()> {
        let id = vol.id.as_str();
        let dev = self.store.attach(id)?;
        crate::util::crash_point("stage-after-attach");
        if cap.block {
            return Ok(());
        }
        let fs = vol.fs_type;
        match self.kernel.fs_probe_loop(&dev, &vol.path)? {
            None => {
                tracing::info!(volume = id, device = %dev.display(), fs = fs.as_str(), "blank device: making a filesystem");
                self.kernel.mkfs(&dev, fs)?;
                crate::util::crash_point("stage-after-mkfs");
            }
            Some(t) if t == fs.as_str() => {}
            Some(other) => {
                return Err(precondition(format!(
                    "volume {id}: {} holds {other:?}, not {}; refusing to mount or format it",
                    dev.display(),
                    fs.as_str()
                )));
            }
        }
        let dev_size = self.kernel.device_size(&dev).map_err(io_internal(format!("sizing {}", dev.display())))?;
        // ext4 grown while unstaged: grow it now, offline (no CAP_SYS_RESOURCE needed).
        if fs == FsType::Ext4
            && let Some(fs_size) = self.kernel.fs_size(&dev, fs)?
            && fs_size.saturating_add(crate::storage::store::SIZE_ALIGN) <= dev_size
        {
            tracing::info!(volume = id, from = fs_size, to = dev_size, "growing ext4 before mounting");
            self.kernel.grow_fs(&dev, fs)?;
        }
        if !staging.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o750)
                .create(staging)
                .map_err(io_internal(format!("creating {}", staging.display())))?;
        }
        // A restore or clone of an xfs volume carries its source's filesystem UUID, and xfs
        // refuses to mount a second filesystem with a UUID already mounted: `nouuid`, as
        // snapshot-capable local drivers do (ext4 does not care).
        let nouuid;
        let opts = if fs == FsType::Xfs && !opts.data.iter().any(|d| d == "nouuid") {
            nouuid = MountOptions {
                flags: opts.flags,
                data: opts.data.iter().cloned().chain(["nouuid".to_string()]).collect(),
            };
            &nouuid
        } else {
            opts
        };
        self.kernel.mount_device(&dev, &self.settings.kubelet_dir, staging, fs.as_str(), opts).map_err(
            |e| match e {
                MountError::Source(e) | MountError::Target(e) => {
                    invalid(format!("staging_target_path {}: {e}", staging.display()))
                }
                MountError::Mount(e @ nix::errno::Errno::EINVAL) => invalid(format!(
                    "mounting {} ({}) at {} with flags {:?} failed: {e} (a mount flag the filesystem does not accept?)",
                    dev.display(),
                    fs.as_str(),
                    staging.display(),
                    cap.mount_flags
                )),
                MountError::Mount(e) => internal(format!("mounting {} at {}: {e}", dev.display(), staging.display())),
            },
        )?;
        crate::util::crash_point("stage-after-mount");
        if fs == FsType::Xfs
            && !opts.flags.contains(nix::mount::MsFlags::MS_RDONLY)
            && let Some(fs_size) = self.kernel.fs_size(&dev, fs)?
            && fs_size.saturating_add(crate::storage::store::SIZE_ALIGN) <= dev_size
        {
            tracing::info!(volume = id, from = fs_size, to = dev_size, "growing xfs after mounting");
            self.kernel.grow_fs(staging, fs)?;
        }
        tracing::info!(volume = id, device = %dev.display(), staging = %staging.display(), "volume staged");
        Ok(())
    }

    pub fn unstage(&self, req: &csi::NodeUnstageVolumeRequest) -> Result<()> {
        required("volume_id", &req.volume_id)?;
        required("staging_target_path", &req.staging_target_path)?;
        let id = self.volume_id(&req.volume_id)?;
        self.known_or_recorded(id)?;
        let staging = self.path("staging_target_path", &req.staging_target_path)?;
        let _g = self.guard(id)?;
        let known = self.store.get(id)?.is_some();
        let rec = self.load_stage(id)?;
        let devices = self.volume_devices(id)?;
        let ours_here = self.ours_at(&staging, &devices)?;
        let rec_here = rec.as_ref().is_some_and(|r| r.staging_path == staging);
        if !known && !rec_here && !ours_here {
            return Err(not_found(id));
        }
        if !rec_here && !ours_here {
            return Ok(()); // not staged here: nothing to do
        }
        // Still published somewhere? Unstaging under a running workload would pull the
        // volume away from it. The records name the publications the agent made (checked
        // at their own paths).
        let recorded: Vec<String> = self
            .publishes_of(id)
            .into_iter()
            .filter(|r| r.target_path != staging)
            .filter(|r| self.ours_at(&r.target_path, &devices).unwrap_or(true))
            .map(|r| r.target_path.display().to_string())
            .collect();
        if !recorded.is_empty() {
            return Err(precondition(format!(
                "volume {id} is still published at {}; unpublish it first",
                recorded.join(", ")
            )));
        }
        // A mount of the volume no record names (someone else's bind mount of it): for a
        // filesystem staged as recorded, the device itself tells, after the unmount below —
        // the filesystem holds its device exclusively while any mount of it is left, so
        // the detach is refused — and the mount table is read only then, to name the mounts
        // and put the staging mount back. Otherwise (raw block: a bind-mounted device node
        // does not hold the device; or no record) the table is read first, as the rule.
        let fs_as_recorded = rec.as_ref().filter(|r| r.staging_path == staging && !r.capability.block && ours_here);
        if fs_as_recorded.is_none() {
            let publications = self.unrecorded_mounts(&staging, &devices, rec.as_ref())?;
            if !publications.is_empty() {
                return Err(precondition(format!(
                    "volume {id} is still published at {}; unpublish it first",
                    publications.join(", ")
                )));
            }
        }
        let n = self.unmount_of(id, &staging, &devices)?;
        crate::util::crash_point("unstage-after-unmount");
        match self.store.detach(id) {
            Err(VolumeError::Busy { .. })
                if n > 0
                    && let Some(r) = fs_as_recorded
                    && let publications = self.unrecorded_mounts(&staging, &devices, rec.as_ref())?
                    && !publications.is_empty() =>
            {
                let restored = self.restage_after_refusal(id, &staging, r, &devices);
                return Err(precondition(format!(
                    "volume {id} is still published at {}; unpublish it first{}",
                    publications.join(", "),
                    match restored {
                        Ok(()) => String::new(),
                        Err(e) => format!(" (and mounting it back at {} failed: {e})", staging.display()),
                    }
                )));
            }
            Err(e @ VolumeError::Busy { .. }) => {
                return Err(precondition(format!("volume {id} unmounted but its device is still in use: {e}")));
            }
            r => r?,
        }
        self.remove_record(&self.stage_record_path(id))?;
        tracing::info!(volume = id, staging = %staging.display(), unmounted = n, "volume unstaged");
        Ok(())
    }

    pub fn publish(&self, req: &csi::NodePublishVolumeRequest) -> Result<()> {
        required("volume_id", &req.volume_id)?;
        required("target_path", &req.target_path)?;
        if req.volume_capability.is_none() {
            return Err(invalid("volume_capability is required"));
        }
        let id = self.volume_id(&req.volume_id)?;
        self.existing(id)?;
        let target = self.path("target_path", &req.target_path)?;
        let cap = parse_capability(req.volume_capability.as_ref())?;
        if req.staging_target_path.is_empty() {
            return Err(precondition(
                "staging_target_path is required: this plugin stages volumes (STAGE_UNSTAGE_VOLUME)",
            ));
        }
        let staging = self.path("staging_target_path", &req.staging_target_path)?;
        if target == staging || target.starts_with(&staging) || staging.starts_with(&target) {
            return Err(invalid("target_path and staging_target_path must not contain each other"));
        }
        let opts = mount::parse_mount_flags(&cap.mount_flags).map_err(invalid)?;
        let read_only = req.readonly || cap.mode() == Mode::SingleNodeReaderOnly;
        // Other targets of the volume are served meanwhile; a stage in progress is waited for.
        let _target = self.target_guard(id, &target, TARGET_WAIT)?;
        let _publishing = self.publishing_guard(id, TARGET_WAIT)?;
        let vol = self.store.get(id)?.ok_or_else(|| not_found(id))?;
        check_fits(&vol, &cap)?;
        let devices = self.volume_devices(id)?;
        let stage = self.load_stage(id)?;
        let staged_here = match &stage {
            Some(r) if r.staging_path == staging && r.state == StageState::Staged => {
                if r.capability.block != cap.block {
                    return Err(invalid(format!(
                        "volume {id} is staged for {} access, the publish asks for {}",
                        if r.capability.block { "block" } else { "mount" },
                        if cap.block { "block" } else { "mount" }
                    )));
                }
                if cap.block {
                    devices.iter().any(|d| !d.ro)
                } else {
                    self.top_at(&staging)?.is_some_and(|m| self.is_volume_mount(&m, &devices))
                }
            }
            _ => false,
        };
        if !staged_here {
            return Err(precondition(format!("volume {id} is not staged at {}", staging.display())));
        }
        let want = PublishRecord {
            volume_id: id.to_string(),
            target_path: target.clone(),
            staging_path: staging.clone(),
            capability: cap.clone(),
            read_only,
            created_target: false,
        };
        let existing = self.load_publish(&target)?;
        let top = self.top_at(&target)?;
        if let Some(r) = &existing {
            let same = r.volume_id == want.volume_id
                && r.staging_path == want.staging_path
                && r.capability == want.capability
                && r.read_only == want.read_only;
            let mounted = top.as_ref().is_some_and(|m| self.is_volume_mount(m, &devices));
            if mounted && same {
                return Ok(());
            }
            if mounted || r.volume_id != id {
                return Err(CsiError::new(
                    Code::AlreadyExists,
                    format!(
                        "{} is already published (volume {}, read_only {}) and incompatible with this request",
                        target.display(),
                        r.volume_id,
                        r.read_only
                    ),
                ));
            }
        } else if let Some(m) = top {
            return Err(CsiError::new(
                Code::AlreadyExists,
                format!(
                    "{} already has a mount ({} {}) that this plugin did not make",
                    target.display(),
                    m.fs_type,
                    m.source
                ),
            ));
        }
        // SINGLE_NODE_SINGLE_WRITER: one workload only.
        let others: Vec<PublishRecord> = self
            .publishes_of(id)
            .into_iter()
            .filter(|r| r.target_path != target)
            .filter(|r| self.top_at(&r.target_path).ok().flatten().is_some_and(|m| self.is_volume_mount(&m, &devices)))
            .collect();
        let single = |m: i32| Mode::try_from(m) == Ok(Mode::SingleNodeSingleWriter);
        if let Some(o) = others.iter().find(|o| single(cap.access_mode) || single(o.capability.access_mode)) {
            return Err(precondition(format!(
                "volume {id} is SINGLE_NODE_SINGLE_WRITER and already published at {}",
                o.target_path.display()
            )));
        }

        let created_target = !target.exists();
        let rec =
            PublishRecord { created_target: created_target || existing.is_some_and(|e| e.created_target), ..want };
        self.save_publish(&rec)?;
        crate::util::crash_point("publish-after-record");
        let result = (|| -> Result<()> {
            if cap.block {
                let dev = if read_only {
                    self.store.attach_read_only(id)?
                } else {
                    self.store
                        .attached_device(id)?
                        .ok_or_else(|| precondition(format!("volume {id} is not attached")))?
                };
                if created_target {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o600)
                        .open(&target)
                        .map_err(io_internal(format!("creating {}", target.display())))?;
                }
                self.kernel.bind_device(&dev, &self.settings.kubelet_dir, &target, read_only).map_err(|e| match e {
                    MountError::Source(e) | MountError::Target(e) => {
                        invalid(format!("target_path {}: {e}", target.display()))
                    }
                    MountError::Mount(e) => {
                        internal(format!("bind-mounting {} onto {}: {e}", dev.display(), target.display()))
                    }
                })?;
            } else {
                if !cap.mount_group.is_empty() {
                    apply_mount_group(&staging, &cap.mount_group)?;
                }
                if created_target {
                    std::fs::DirBuilder::new()
                        .mode(0o750)
                        .create(&target)
                        .map_err(io_internal(format!("creating {}", target.display())))?;
                }
                self.kernel.bind_dir(&self.settings.kubelet_dir, &staging, &target, read_only, opts.flags).map_err(
                    |e| match e {
                        MountError::Source(e) => invalid(format!("staging_target_path {}: {e}", staging.display())),
                        MountError::Target(e) => invalid(format!("target_path {}: {e}", target.display())),
                        MountError::Mount(e) => {
                            internal(format!("bind-mounting {} onto {}: {e}", staging.display(), target.display()))
                        }
                    },
                )?;
            }
            Ok(())
        })();
        if let Err(e) = result {
            let _ = self.unmount_ours(id, &target);
            if rec.created_target {
                let _ = remove_target(&target);
            }
            let _ = self.remove_publish(&target);
            if cap.block && read_only {
                let _ = self.release_read_only_device(id, &target);
            }
            return Err(e);
        }
        crate::util::crash_point("publish-after-mount");
        tracing::info!(volume = id, target = %target.display(), read_only, block = cap.block, "volume published");
        Ok(())
    }

    /// Detach the volume's read-only loop device when no other read-only block publication
    /// uses it.
    fn release_read_only_device(&self, id: &str, except: &Path) -> Result<()> {
        let still_used = self
            .publish_records()
            .iter()
            .any(|r| r.volume_id == id && r.capability.block && r.read_only && r.target_path != except);
        if !still_used {
            self.store.detach_read_only(id)?;
        }
        Ok(())
    }

    pub fn unpublish(&self, req: &csi::NodeUnpublishVolumeRequest) -> Result<()> {
        required("volume_id", &req.volume_id)?;
        required("target_path", &req.target_path)?;
        let id = self.volume_id(&req.volume_id)?;
        self.known_or_recorded(id)?;
        let target = self.path("target_path", &req.target_path)?;
        let _target = self.target_guard(id, &target, TARGET_WAIT)?;
        let known = self.store.get(id)?.is_some();
        let rec = self.load_publish(&target)?.filter(|r| r.volume_id == id);
        let devices = self.volume_devices(id)?;
        let ours = self.ours_at(&target, &devices)?;
        if !known && rec.is_none() && !ours {
            return Err(not_found(id));
        }
        if rec.is_none() && !ours {
            return Ok(()); // not published there
        }
        if ours || rec.is_some() {
            self.unmount_of(id, &target, &devices)?;
            crate::util::crash_point("unpublish-after-unmount");
        }
        if let Some(r) = &rec {
            if r.created_target {
                remove_target(&target)?;
            }
            if r.capability.block && r.read_only {
                // The shared read-only device: decided one publication at a time, after this
                // record is gone, so the last of two concurrent unpublishes releases it.
                let _publishing = self.publishing_guard(id, TARGET_WAIT)?;
                self.remove_publish(&target)?;
                if let Err(e) = self.release_read_only_device(id, &target) {
                    // Unpublished all the same; unstage detaches every device of the volume.
                    tracing::warn!(volume = id, error = %e.msg, "read-only loop device not released yet");
                }
            }
        }
        self.remove_publish(&target)?;
        tracing::info!(volume = id, target = %target.display(), "volume unpublished");
        Ok(())
    }

    pub fn stats(&self, req: &csi::NodeGetVolumeStatsRequest) -> Result<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        required("volume_id", &req.volume_id)?;
        required("volume_path", &req.volume_path)?;
        let id = self.volume_id(&req.volume_id)?;
        let vol = self.existing(id)?;
        // Where the volume is, from the agent's own records: any other path (a relative
        // one included) is NOT_FOUND, decided without touching the filesystem.
        let stage = self.load_stage(id)?.filter(|r| r.staging_path == Path::new(&req.volume_path));
        if stage.is_none() && !self.published_at(id, &req.volume_path) {
            return Err(not_at(id, &req.volume_path));
        }
        let path = self.path("volume_path", &req.volume_path)?;
        let devices = self.volume_devices(id)?;
        let here = self.top_at(&path)?.filter(|m| self.is_volume_mount(m, &devices));
        let block_staged_here = stage.as_ref().is_some_and(|r| r.capability.block && r.state == StageState::Staged);
        let mut problems = Vec::new();
        if !vol.path.exists() {
            problems.push(format!("backing file {} is missing", vol.path.display()));
        }
        let mut usage = Vec::new();
        let block_total =
            |dev: Option<&PathBuf>| dev.and_then(|d| self.kernel.device_size(d).ok()).unwrap_or(vol.size_bytes);
        match here {
            None if block_staged_here => {
                let rw = devices.iter().find(|d| !d.ro).map(|d| &d.path);
                if rw.is_none() {
                    problems.push(format!("volume {id} is staged but not attached to a loop device"));
                }
                usage.push(csi::VolumeUsage {
                    available: 0,
                    total: block_total(rw) as i64,
                    used: 0,
                    unit: Unit::Bytes as i32,
                });
            }
            None => problems.push(format!("{} is not mounted", path.display())),
            Some(_) if let Some(num) = self.kernel.block_node(&path) => {
                let dev = devices.iter().find(|d| d.num == num).map(|d| &d.path);
                usage.push(csi::VolumeUsage {
                    available: 0,
                    total: block_total(dev) as i64,
                    used: 0,
                    unit: Unit::Bytes as i32,
                });
            }
            Some(_) => {
                let st = self.kernel.statvfs(&path).map_err(errno_internal(format!("statfs {}", path.display())))?;
                let f = st.fragment_size;
                let total = st.blocks * f;
                let avail = st.blocks_available * f;
                let used = (st.blocks - st.blocks_free) * f;
                usage.push(csi::VolumeUsage {
                    available: avail as i64,
                    total: total as i64,
                    used: used as i64,
                    unit: Unit::Bytes as i32,
                });
                usage.push(csi::VolumeUsage {
                    available: st.files_available as i64,
                    total: st.files as i64,
                    used: (st.files - st.files_free) as i64,
                    unit: Unit::Inodes as i32,
                });
            }
        }
        let condition = if problems.is_empty() {
            csi::VolumeCondition { abnormal: false, message: "healthy".into() }
        } else {
            csi::VolumeCondition { abnormal: true, message: problems.join("; ") }
        };
        Ok(csi::NodeGetVolumeStatsResponse { usage, volume_condition: Some(condition) })
    }

    pub fn expand(&self, req: &csi::NodeExpandVolumeRequest) -> Result<csi::NodeExpandVolumeResponse> {
        required("volume_id", &req.volume_id)?;
        required("volume_path", &req.volume_path)?;
        let id = self.volume_id(&req.volume_id)?;
        self.existing(id)?;
        // As for stats: a path the records do not put the volume at is NOT_FOUND, without
        // touching the filesystem. A block volume staged here grows whatever path kubelet
        // names for it (the device is the volume), as long as that path is a valid one.
        let stage = self.load_stage(id)?;
        let at_record = stage.as_ref().is_some_and(|r| r.staging_path == Path::new(&req.volume_path))
            || self.published_at(id, &req.volume_path);
        let block_staged_rec = stage.as_ref().is_some_and(|r| r.capability.block && r.state == StageState::Staged);
        if !at_record && !block_staged_rec {
            return Err(not_at(id, &req.volume_path));
        }
        let path = self
            .path("volume_path", &req.volume_path)
            .map_err(|e| if at_record { e } else { not_at(id, &req.volume_path) })?;
        if !req.staging_target_path.is_empty() {
            self.path("staging_target_path", &req.staging_target_path)?;
        }
        let (required_bytes, limit) = match &req.capacity_range {
            Some(r) if r.required_bytes < 0 || r.limit_bytes < 0 => {
                return Err(invalid("capacity_range must not be negative"));
            }
            Some(r) if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes => {
                return Err(CsiError::new(
                    Code::OutOfRange,
                    format!("required_bytes {} exceeds limit_bytes {}", r.required_bytes, r.limit_bytes),
                ));
            }
            Some(r) => (r.required_bytes as u64, r.limit_bytes as u64),
            None => (0, 0),
        };
        let cap = match &req.volume_capability {
            Some(c) => Some(
                parse_capability(Some(c))
                    .map_err(|e| if e.code == Code::FailedPrecondition { invalid(e.msg) } else { e })?,
            ),
            None => None,
        };
        let _g = self.guard(id)?;
        let vol = self.store.get(id)?.ok_or_else(|| not_found(id))?;
        if let Some(c) = &cap {
            check_fits(&vol, c)?;
        }
        let devices = self.volume_devices(id)?;
        let at_path = self.top_at(&path)?.is_some_and(|m| self.is_volume_mount(&m, &devices));
        let block_staged = self.load_stage(id)?.is_some_and(|r| r.capability.block && r.state == StageState::Staged);
        if !at_path && !block_staged {
            return Err(precondition(format!("volume {id} is recorded at {} but not mounted there", path.display())));
        }
        let want = required_bytes.max(vol.size_bytes);
        let rounded = crate::storage::store::round_size(id, want)?;
        if limit > 0 && rounded > limit {
            return Err(CsiError::new(
                Code::OutOfRange,
                format!("volume sizes are whole MiB: {rounded} bytes would exceed limit_bytes {limit}"),
            ));
        }
        let vol = self.store.expand(id, rounded)?;
        crate::util::crash_point("expand-after-store");
        if !vol.fs_type.is_raw() && !block_staged {
            let dev =
                self.store.attached_device(id)?.ok_or_else(|| precondition(format!("volume {id} is not attached")))?;
            let dev_size = self.kernel.device_size(&dev).map_err(io_internal(format!("sizing {}", dev.display())))?;
            let fs_size = self.kernel.fs_size(&dev, vol.fs_type)?.unwrap_or(dev_size);
            if fs_size.saturating_add(crate::storage::store::SIZE_ALIGN) <= dev_size {
                match vol.fs_type {
                    FsType::Xfs => {
                        // xfs grows through a writable mount of it: the staging mount.
                        let rw = self
                            .table()?
                            .iter()
                            .find(|m| self.is_volume_mount(m, &devices) && !m.read_only())
                            .map(|m| m.mount_point.clone())
                            .ok_or_else(|| {
                                precondition(format!("volume {id} has no writable mount to grow xfs through"))
                            })?;
                        self.kernel.grow_fs(&rw, FsType::Xfs)?;
                    }
                    FsType::Ext4 => self.kernel.grow_fs(&dev, FsType::Ext4)?,
                    FsType::Raw => {}
                }
                tracing::info!(volume = id, from = fs_size, to = dev_size, "filesystem grown online");
            }
        }
        Ok(csi::NodeExpandVolumeResponse { capacity_bytes: vol.size_bytes as i64 })
    }

    pub fn info(&self) -> csi::NodeGetInfoResponse {
        csi::NodeGetInfoResponse {
            node_id: self.settings.node_id.clone(),
            max_volumes_per_node: self.settings.max_volumes,
            accessible_topology: Some(csi::Topology {
                segments: [(super::TOPOLOGY_KEY.to_string(), self.settings.node_id.clone())].into_iter().collect(),
            }),
        }
    }

    // ----- start-up -----

    /// Rebuild from the records, the mount table and the loop table: roll back stages a
    /// crash interrupted before their mount, drop publish records whose target is gone,
    /// detach loop devices of volumes that no stage accounts for. Marks the service ready.
    pub fn recover(&self) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let table = self.table()?;
        let stages = self.stage_records();
        let mut staged_ids = HashSet::new();
        for r in &stages {
            let devices = self.volume_devices(&r.volume_id).unwrap_or_default();
            let mounted = mount::mounts_at(&table, &r.staging_path).iter().any(|m| self.is_volume_mount(m, &devices));
            if r.state == StageState::Staging && !mounted {
                let published = table.iter().any(|m| self.is_volume_mount(m, &devices));
                if !published && let Err(e) = self.store.detach(&r.volume_id) {
                    // Keep the record: it is what lets NodeUnstage (or the retried stage)
                    // find and detach the device once whatever holds it lets go. Without
                    // it, unstage would answer "not staged here" and the device would leak.
                    tracing::warn!(volume = %r.volume_id, error = %e, "rolling back an interrupted stage: detach failed; keeping its record for unstage or a retry");
                    staged_ids.insert(r.volume_id.clone());
                    continue;
                }
                self.remove_record(&self.stage_record_path(&r.volume_id))?;
                tracing::info!(volume = %r.volume_id, staging = %r.staging_path.display(), "rolled back an interrupted stage");
                report.rolled_back_stages += 1;
                continue;
            }
            staged_ids.insert(r.volume_id.clone());
            report.staged += 1;
        }
        for r in self.publish_records() {
            let devices = self.volume_devices(&r.volume_id).unwrap_or_default();
            let mounted = mount::mounts_at(&table, &r.target_path).iter().any(|m| self.is_volume_mount(m, &devices));
            if mounted {
                report.published += 1;
            } else if !r.target_path.exists() {
                self.remove_publish(&r.target_path)?;
                report.dropped_publish_records += 1;
            } else {
                // The target exists unmounted (interrupted publish or reboot): kubelet's
                // retry or unpublish settles it.
                report.published += 1;
            }
        }
        for v in self.store.list() {
            if staged_ids.contains(&v.id) {
                continue;
            }
            let devices = self.volume_devices(&v.id).unwrap_or_default();
            if devices.is_empty() || table.iter().any(|m| self.is_volume_mount(m, &devices)) {
                continue;
            }
            match self.store.detach(&v.id) {
                Ok(()) => {
                    tracing::info!(volume = %v.id, "detached a loop device no stage accounts for");
                    report.detached += 1;
                }
                Err(e) => tracing::warn!(volume = %v.id, error = %e, "could not detach an unaccounted loop device"),
            }
        }
        match self.store.orphans() {
            Ok(o) => {
                for orphan in &o {
                    tracing::warn!(?orphan, "volume store orphan");
                }
                report.orphans = o.len();
            }
            Err(e) => tracing::warn!(error = %e, "listing volume store orphans"),
        }
        self.ready.store(true, Ordering::SeqCst);
        Ok(report)
    }
}

/// What [`NodeService::recover`] found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoveryReport {
    pub staged: usize,
    pub published: usize,
    pub rolled_back_stages: usize,
    pub dropped_publish_records: usize,
    pub detached: usize,
    pub orphans: usize,
}

/// `volume_mount_group`: the volume's root becomes group-owned by the gid, group
/// read/write/search, set-gid so new files inherit the group.
fn apply_mount_group(root: &Path, gid: &str) -> Result<()> {
    let gid: u32 = gid.parse().map_err(|_| invalid(format!("volume_mount_group {gid:?} is not a numeric group id")))?;
    let md = std::fs::metadata(root).map_err(io_internal(format!("inspecting {}", root.display())))?;
    if md.gid() != gid {
        nix::unistd::chown(root, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(errno_internal(format!("chown {}", root.display())))?;
    }
    let mode = md.permissions().mode() & 0o7777;
    let want = mode | 0o2070;
    if mode != want {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(want))
            .map_err(io_internal(format!("chmod {}", root.display())))?;
    }
    Ok(())
}

/// Remove a target the plugin created: an empty directory, or the file a block volume was
/// bound onto. Already gone is fine.
fn remove_target(target: &Path) -> Result<()> {
    let r = match std::fs::symlink_metadata(target) {
        Ok(m) if m.is_dir() => std::fs::remove_dir(target),
        Ok(_) => std::fs::remove_file(target),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
    };
    r.map_err(io_internal(format!("removing {}", target.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};

    fn cap(mode: Mode, t: AccessType) -> csi::VolumeCapability {
        csi::VolumeCapability { access_mode: Some(AccessMode { mode: mode as i32 }), access_type: Some(t) }
    }
    fn mnt(fs: &str) -> AccessType {
        AccessType::Mount(MountVolume { fs_type: fs.into(), mount_flags: vec![], volume_mount_group: String::new() })
    }

    #[test]
    fn capabilities_map_to_spec_codes() {
        assert_eq!(parse_capability(None).unwrap_err().code, Code::InvalidArgument);
        let no_mode = csi::VolumeCapability { access_mode: None, access_type: Some(mnt("")) };
        assert_eq!(parse_capability(Some(&no_mode)).unwrap_err().code, Code::InvalidArgument);
        let no_type = csi::VolumeCapability { access_mode: Some(AccessMode { mode: 1 }), access_type: None };
        assert_eq!(parse_capability(Some(&no_type)).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(parse_capability(Some(&cap(Mode::Unknown, mnt("")))).unwrap_err().code, Code::InvalidArgument);
        let bogus = csi::VolumeCapability { access_mode: Some(AccessMode { mode: 99 }), access_type: Some(mnt("")) };
        assert_eq!(parse_capability(Some(&bogus)).unwrap_err().code, Code::InvalidArgument);
        for m in [Mode::MultiNodeReaderOnly, Mode::MultiNodeSingleWriter, Mode::MultiNodeMultiWriter] {
            assert_eq!(parse_capability(Some(&cap(m, mnt("")))).unwrap_err().code, Code::FailedPrecondition);
        }
        assert_eq!(
            parse_capability(Some(&cap(Mode::SingleNodeWriter, mnt("vfat")))).unwrap_err().code,
            Code::InvalidArgument
        );
        let c = parse_capability(Some(&cap(Mode::SingleNodeMultiWriter, AccessType::Block(BlockVolume {})))).unwrap();
        assert!(c.block);
        let bad_group = csi::VolumeCapability {
            access_mode: Some(AccessMode { mode: 1 }),
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: "ext4".into(),
                mount_flags: vec![],
                volume_mount_group: "staff".into(),
            })),
        };
        assert_eq!(parse_capability(Some(&bad_group)).unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn volume_errors_map_to_codes() {
        let c = |e: VolumeError| CsiError::from(e).code;
        assert_eq!(c(VolumeError::NotFound("x".into())), Code::NotFound);
        assert_eq!(c(VolumeError::InvalidId { id: "..".into(), reason: "x" }), Code::InvalidArgument);
        assert_eq!(
            c(VolumeError::CapacityExceeded { id: "x".into(), requested: 2, available: 1, capacity: 1 }),
            Code::OutOfRange
        );
        assert_eq!(c(VolumeError::Busy { id: "x".into(), reason: "y".into() }), Code::FailedPrecondition);
        assert_eq!(c(VolumeError::Fs(vfs::FsError::OnlineResizeNotPermitted("d".into()))), Code::FailedPrecondition);
    }
}

#[cfg(test)]
mod node_tests;

// ----- status and doctor (`nodeplane status`, `nodeplane doctor`) -----

use crate::obs::doctor::{Finding, Repair};

/// Orphan kinds the CSI side reports.
pub const MOUNT_WITHOUT_VOLUME: &str = "mount-without-volume";
pub const LOOP_WITHOUT_FILE: &str = "loop-device-without-file";
pub const LOOP_WITHOUT_USER: &str = "loop-device-without-user";
pub const FILE_WITHOUT_VOLUME: &str = "backing-file-without-volume";
pub const VOLUME_WITHOUT_FILE: &str = "volume-without-backing-file";

/// A loop device bound to a file in the volume directory.
struct StoreLoop {
    binding: loopdev::LoopBinding,
    num: (u32, u32),
    /// The volume the file is the image of, when its metadata exists and it is that image.
    volume: Option<String>,
    /// The backing file's (device, inode) as the loop device reported them when listed.
    file: Option<(u64, u64)>,
}

impl NodeService {
    fn store_loops(&self) -> Result<Vec<StoreLoop>> {
        let bindings = self.kernel.loop_bound_devices().map_err(io_internal("listing loop devices".into()))?;
        let mut out = Vec::new();
        for b in bindings {
            if b.backing_file.parent() != Some(self.store.dir()) {
                continue;
            }
            let Ok(num) = self.kernel.dev_numbers(&b.device) else { continue };
            let volume = b
                .backing_file
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".img"))
                .filter(|id| !b.deleted && self.store.get(id).ok().flatten().is_some())
                .map(str::to_string);
            let file = self.kernel.loop_status(&b.device).ok().map(|i| (i.lo_device, i.lo_inode));
            out.push(StoreLoop { binding: b, num, volume, file });
        }
        Ok(out)
    }

    /// Where `l` is mounted: its filesystem (by device number), or its device node
    /// bind-mounted for raw block access.
    fn mounts_of(&self, table: &[MountEntry], l: &StoreLoop) -> Vec<PathBuf> {
        self.volume_mounts(table, l).into_iter().map(|m| m.mount_point.clone()).collect()
    }

    fn volume_mounts<'a>(&self, table: &'a [MountEntry], l: &StoreLoop) -> Vec<&'a MountEntry> {
        let dev = [LoopDev { path: l.binding.device.clone(), num: l.num, ro: l.binding.read_only }];
        table.iter().filter(|m| self.is_volume_mount(m, &dev)).collect()
    }

    /// A mount of a volume's device that no record accounts for. A bind mount of a directory
    /// inside the volume (kubelet's subPath mounts) belongs to its pod and is left out; a
    /// mount outside the kubelet dir is reported but never removed (an operator made it).
    fn orphan_mount(&self, m: &MountEntry, l: &StoreLoop, detail: String, repair: bool) -> Option<Finding> {
        if (m.major, m.minor) == l.num && m.root != Path::new("/") {
            return None;
        }
        let mut f = Finding::new(MOUNT_WITHOUT_VOLUME, m.mount_point.display().to_string(), detail);
        if repair {
            f.repair = Some(if m.mount_point.starts_with(&self.settings.kubelet_dir) {
                unmount_repair(&*self.kernel, &m.mount_point)
            } else {
                Repair::Skipped("outside the kubelet dir: not made by kubelet or nodeplane; unmount it by hand".into())
            });
        }
        Some(f)
    }

    /// Volumes, what is staged and published, and the loop devices and mounts behind them.
    pub fn report(&self) -> api::StorageStatus {
        let table = self.table().unwrap_or_default();
        let loops = self.store_loops().unwrap_or_default();
        let stages = self.stage_records();
        let publishes = self.publish_records();
        let mut volumes = Vec::new();
        for v in self.store.list() {
            let mine: Vec<&StoreLoop> = loops.iter().filter(|l| l.volume.as_deref() == Some(v.id.as_str())).collect();
            let stage = stages.iter().find(|r| r.volume_id == v.id);
            volumes.push(api::VolumeStatus {
                id: v.id.clone(),
                name: v.name.clone(),
                size_bytes: v.size_bytes,
                fs_type: v.fs_type.as_str().to_string(),
                backing_file: v.path.display().to_string(),
                backing_file_present: v.path.exists(),
                loop_devices: mine
                    .iter()
                    .map(|l| api::LoopDevice {
                        device: l.binding.device.display().to_string(),
                        mounted_at: self.mounts_of(&table, l).iter().map(|p| p.display().to_string()).collect(),
                    })
                    .collect(),
                staged: stage.map(|r| api::Stage {
                    path: r.staging_path.display().to_string(),
                    state: match r.state {
                        StageState::Staged => api::StageState::Staged,
                        StageState::Staging => api::StageState::Staging,
                    } as i32,
                    mounted: !mount::mounts_at(&table, &r.staging_path).is_empty(),
                }),
                published: publishes
                    .iter()
                    .filter(|p| p.volume_id == v.id)
                    .map(|p| api::Publish {
                        path: p.target_path.display().to_string(),
                        read_only: p.read_only,
                        mounted: !mount::mounts_at(&table, &p.target_path).is_empty(),
                    })
                    .collect(),
            });
        }
        let u = self.store.usage();
        api::StorageStatus {
            ready: self.ready(),
            volume_dir: self.store.dir().display().to_string(),
            capacity_bytes: u.capacity_bytes,
            provisioned_bytes: u.provisioned_bytes,
            available_bytes: u.available_bytes,
            volumes,
        }
    }

    /// Storage orphans (see the `NodeStatus.Doctor` comment in `proto/`). Repairs unmount
    /// mounts no record accounts for and detach loop devices nothing uses; backing files and
    /// metadata are never removed here (they may hold data): they are reported with what the
    /// operator can do.
    pub fn doctor(&self, repair: bool) -> Result<(Vec<Finding>, Vec<String>)> {
        let mut out = Vec::new();
        let mut skipped = Vec::new();
        let listed = self.store_loops()?;
        for l in listed.iter().filter(|l| l.volume.is_none()) {
            // Bound to a deleted file, or to a file that is no volume's image.
            let dev = l.binding.device.display().to_string();
            let why = if l.binding.deleted {
                "its backing file was deleted"
            } else {
                "its backing file belongs to no volume"
            };
            for m in self.volume_mounts(&self.table()?, l) {
                out.extend(self.orphan_mount(m, l, format!("{dev} is mounted here; {why}"), repair));
            }
            let mut f =
                Finding::new(LOOP_WITHOUT_FILE, dev, format!("bound to {} ({why})", l.binding.backing_file.display()));
            if repair {
                f.repair = Some(detach_repair(&*self.kernel, l));
            }
            out.push(f);
        }
        // A volume's devices: judged under the volume's guard, with its records, devices and
        // mounts read again under it, so a stage or publish in progress (or finished since
        // the listing) is never mistaken for an orphan.
        let ids: std::collections::BTreeSet<String> = listed.iter().filter_map(|l| l.volume.clone()).collect();
        for id in ids {
            let _g = match self.guard(&id) {
                Ok(g) => g,
                Err(e) => {
                    skipped.push(format!("volume {id}: {}; not checked", e.msg));
                    continue;
                }
            };
            let stage = self.load_stage(&id)?;
            let publishes: Vec<PublishRecord> = self.publishes_of(&id);
            let recorded = stage.is_some() || !publishes.is_empty();
            for l in self.store_loops()?.into_iter().filter(|l| l.volume.as_deref() == Some(id.as_str())) {
                let dev = l.binding.device.display().to_string();
                let table = self.table()?;
                for m in self.volume_mounts(&table, &l) {
                    let p = &m.mount_point;
                    // The device node bind-mounted (not its filesystem): kubelet maps a
                    // published block volume into each pod that way (volumeDevices/…), so
                    // it belongs to the volume while the volume has a record.
                    let device_node = (m.major, m.minor) != l.num;
                    let accounted = stage.as_ref().is_some_and(|r| &r.staging_path == p)
                        || publishes.iter().any(|r| &r.target_path == p)
                        || (device_node && recorded);
                    if !accounted {
                        let detail =
                            format!("{dev} of volume {id} is mounted here, but no stage or publish of the volume is");
                        out.extend(self.orphan_mount(m, &l, detail, repair));
                    }
                }
                if !recorded && self.volume_mounts(&self.table()?, &l).is_empty() {
                    let mut f = Finding::new(
                        LOOP_WITHOUT_USER,
                        dev,
                        format!("bound to volume {id}, which is neither staged nor published"),
                    );
                    if repair {
                        f.repair = Some(detach_repair(&*self.kernel, &l));
                    }
                    out.push(f);
                }
            }
        }
        for o in self.store.orphans().map_err(|e| internal(e.to_string()))? {
            let f = match o {
                crate::storage::store::Orphan::LoopDevice { .. } => continue, // judged above, with its mounts
                crate::storage::store::Orphan::BackingFile { path } => {
                    let mut f = Finding::new(
                        FILE_WITHOUT_VOLUME,
                        path.display().to_string(),
                        "an image file without volume metadata (an interrupted create, or metadata removed by hand)",
                    );
                    if repair {
                        f.repair = Some(Repair::Skipped("it may hold data: move it away or delete it by hand".into()));
                    }
                    f
                }
                crate::storage::store::Orphan::MissingBackingFile { id, path } => {
                    let mut f = Finding::new(VOLUME_WITHOUT_FILE, id, format!("its image {} is gone", path.display()));
                    if repair {
                        f.repair = Some(Repair::Skipped(
                            "the data is lost; the controller reports the volume abnormal: delete the claim".into(),
                        ));
                    }
                    f
                }
            };
            out.push(f);
        }
        Ok((out, skipped))
    }
}

fn unmount_repair(kernel: &dyn VolumeKernel, path: &Path) -> Repair {
    match kernel.unmount(path) {
        Ok(()) => Repair::Done("unmounted".into()),
        Err(e) => Repair::Failed(format!("unmounting: {e}")),
    }
}

/// Detach a loop device if it is still bound to the file it was bound to when listed (a
/// device number freed and reused meanwhile is left alone).
fn detach_repair(kernel: &dyn VolumeKernel, l: &StoreLoop) -> Repair {
    let Some((st_dev, st_ino)) = l.file else {
        return Repair::Failed("its backing file's identity could not be read when it was listed".into());
    };
    match kernel.loop_detach(&l.binding.device, st_dev, st_ino) {
        Ok(()) => Repair::Done("detached".into()),
        Err(loopdev::DetachError::Busy(m)) => Repair::Failed(format!("busy: {m}")),
        Err(loopdev::DetachError::Io(e)) => Repair::Failed(e.to_string()),
    }
}
