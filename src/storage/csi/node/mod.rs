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
//!
//! By concern: the records (`records.rs`), the volume's loop devices and mounts
//! (`mounts.rs`), LUKS2 encryption (`encryption.rs`), stage, unstage, stats and expansion (`stage.rs`), publish and unpublish
//! (`publish.rs`), and recovery, status and doctor (`report.rs`); here the errors, the
//! settings, the service and its holds.

mod encryption;
mod mounts;
mod publish;
mod records;
mod report;
mod stage;

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tonic::Code;

use super::capability::{self, Capability, CapabilityError};
use crate::obs::metrics::{Counters, GrpcLabels, Histograms, latency_histogram};
use crate::rpc::csi;
use crate::storage::fs as vfs;
use crate::storage::store::{VolumeError, VolumeStore};
use crate::sys::mount;
use crate::sys::volume_kernel::VolumeKernel;
use records::{PublishRecord, StageState};
pub use report::{
    FILE_WITHOUT_VOLUME, LOOP_WITHOUT_FILE, LOOP_WITHOUT_USER, MAPPING_WITHOUT_STAGE, MOUNT_WITHOUT_VOLUME,
    MountCounts, RecoveryReport, VOLUME_WITHOUT_FILE,
};

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
        VolumeError::Backend { .. } => Code::FailedPrecondition,
        VolumeError::NotFound(_) => Code::NotFound,
        VolumeError::AlreadyExists { .. } | VolumeError::SnapshotExists { .. } => Code::AlreadyExists,
        VolumeError::CapacityExceeded { .. } | VolumeError::Shrink { .. } => Code::OutOfRange,
        VolumeError::Busy { .. } | VolumeError::BackingFileMissing { .. } => Code::FailedPrecondition,
        VolumeError::Fs(crate::storage::store::FsError::OnlineResizeNotPermitted(_)) => Code::FailedPrecondition,
        VolumeError::Locked { .. }
        | VolumeError::Io { .. }
        | VolumeError::Metadata { .. }
        | VolumeError::Fs(_)
        | VolumeError::Lvm { .. } => Code::Internal,
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
    pub operations: Counters<GrpcLabels>,
    pub durations: Histograms<MethodLabels>,
}

/// The label of a timed Node call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct MethodLabels {
    pub method: &'static str,
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
        let publishes = Self::load_all::<PublishRecord>(&settings.record_dir.join("publish"))
            .into_iter()
            .map(|r| (r.target_path.clone(), r))
            .collect();
        Ok(NodeService {
            settings,
            kernel: store.kernel().clone(),
            store,
            busy: Mutex::new(HashMap::new()),
            publishes: Mutex::new(publishes),
            released: Condvar::new(),
            ready: AtomicBool::new(false),
            operations: Counters::default(),
            durations: Histograms::new_with_constructor(latency_histogram),
        })
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

    pub fn info(&self) -> csi::NodeGetInfoResponse {
        csi::NodeGetInfoResponse {
            node_id: self.settings.node_id.clone(),
            max_volumes_per_node: self.settings.max_volumes,
            accessible_topology: Some(csi::Topology {
                segments: [(super::TOPOLOGY_KEY.to_string(), self.settings.node_id.clone())].into_iter().collect(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi::volume_capability::access_mode::Mode;
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
