//! The volume book: every volume the controller placed, durable in the controller's redb
//! database, and what each node last reported about its store.
//!
//! A volume's life is `Creating → Ready → (Deleting → gone)`. Every transition is committed
//! (fsync'd) before anyone is told: the record exists before a node is asked to create the
//! backing file, and it is removed only after the node reported the file gone. So a
//! controller `kill -9` at any point leaves a record for every file that may exist, and the
//! node converges on the recorded desired state when it reconnects: a retried CreateVolume
//! finds the same volume, a retried DeleteVolume finishes the delete.
//!
//! Nodes learn their desired set through `WatchVolumes` and answer with `ReportVolumes`;
//! callers waiting for an outcome are woken by each report. Each node's set has its own
//! revision (the book's revision at the node's last change) and a short log of the ids it
//! changed, so a change wakes only the streams of the nodes it touches, and an agent that
//! applies deltas gets the records changed since the revision it holds (or its complete set
//! when the log no longer reaches back that far, or the book is another epoch). Building a
//! set costs the node's records (an index by node), never a scan of the cluster's.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tonic::Code;

use super::backend::{Backend, BackendError};
use super::records::{RecordKind, StoreBackend, VolState, VolumeRecord};
use crate::rpc::controller as pb;
use crate::storage::fs::FsType;

/// What one node told the controller last.
#[derive(Debug, Default, Clone)]
pub struct NodeView {
    /// The file backend's capacity.
    pub capacity_bytes: u64,
    /// What the node's store says is left on the file backend (it also counts volumes the
    /// controller does not know: made on the node, orphans).
    pub available_bytes: u64,
    /// The other backends the node has (`lvm`), as it reported them; the file backend is
    /// always there, in the two fields above.
    pub backends: BTreeMap<StoreBackend, BackendRoom>,
    pub reported: bool,
    /// Open WatchVolumes streams of this node.
    pub connected: u32,
    pub volumes: HashMap<String, pb::VolumeState>,
    /// Complete snapshots the node holds.
    pub snapshots: HashMap<String, pb::SnapshotState>,
    /// id -> (code, message, revision of the desired set the failing reconcile ran against)
    pub failures: HashMap<String, (i32, String, u64)>,
    /// When the node's last stream closed.
    pub left: Option<Instant>,
}

/// What a node reported of one store backend.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BackendRoom {
    pub capacity_bytes: u64,
    pub available_bytes: u64,
    /// An lvm pool running short: nothing new goes there.
    pub short: bool,
}

impl NodeView {
    /// Connected and reporting: it can take volumes now.
    pub fn live(&self) -> bool {
        self.connected > 0 && self.reported
    }

    /// The node's (capacity, available) bytes on `backend`; `None` when it does not have
    /// it. A short pool has nothing available.
    pub fn room(&self, backend: StoreBackend) -> Option<(u64, u64)> {
        match backend {
            StoreBackend::File => Some((self.capacity_bytes, self.available_bytes)),
            b => self.backends.get(&b).map(|r| (r.capacity_bytes, if r.short { 0 } else { r.available_bytes })),
        }
    }
}

/// A node's pool turned short, or has room again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolChange {
    pub backend: StoreBackend,
    pub short: bool,
}

/// How a node's pools changed between two reports. A pool short in a node's first report
/// counts as turning short.
fn pool_changes(
    before: &BTreeMap<StoreBackend, BackendRoom>,
    after: &BTreeMap<StoreBackend, BackendRoom>,
) -> Vec<PoolChange> {
    after
        .iter()
        .filter_map(|(backend, room)| {
            let was_short = before.get(backend).is_some_and(|r| r.short);
            (room.short != was_short).then_some(PoolChange { backend: *backend, short: room.short })
        })
        .collect()
}

/// The backends of a report other than `file` (an unknown name is skipped: a newer node's).
fn reported_backends(r: &pb::ReportVolumesRequest) -> BTreeMap<StoreBackend, BackendRoom> {
    r.backends
        .iter()
        .filter_map(|b| {
            let backend = b.backend.parse::<StoreBackend>().ok().filter(|b| !b.is_file())?;
            Some((
                backend,
                BackendRoom { capacity_bytes: b.capacity_bytes, available_bytes: b.available_bytes, short: b.short },
            ))
        })
        .collect()
}

/// Changes kept per node for resuming a WatchVolumes stream; an agent further behind gets
/// its complete set (which costs only that node's records).
const NODE_LOG: usize = 128;

/// One node's desired-set history.
struct NodeLog {
    /// The book's revision at this node's last change (the book's first revision when none).
    rev: u64,
    /// Every change after this revision is in `log`; older ones were dropped.
    floor: u64,
    /// (revision, id of the volume or snapshot that changed), oldest first.
    log: VecDeque<(u64, String)>,
    /// Wakes this node's streams with `rev`.
    tx: watch::Sender<u64>,
}

impl NodeLog {
    fn new(base: u64) -> Self {
        NodeLog { rev: base, floor: base, log: VecDeque::new(), tx: watch::channel(base).0 }
    }
}

struct BookState {
    /// Volumes and snapshots, by id (one id space: a snapshot's id is never a volume's).
    vols: BTreeMap<String, VolumeRecord>,
    by_name: HashMap<(RecordKind, String), String>,
    /// Ids of the records placed on each node.
    by_node: HashMap<String, BTreeSet<String>>,
    nodes: HashMap<String, NodeView>,
    /// Bumped on every committed change.
    revision: u64,
    /// Per node: revision, change log and stream wake-ups (made on first use).
    logs: HashMap<String, NodeLog>,
}

impl BookState {
    fn records_on<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a VolumeRecord> + 'a {
        self.by_node.get(node).into_iter().flatten().filter_map(|id| self.vols.get(id))
    }

    fn log_of(&mut self, node: &str) -> &mut NodeLog {
        self.logs.entry(node.to_string()).or_insert_with(|| NodeLog::new(FIRST_REVISION))
    }

    fn node_revision(&self, node: &str) -> u64 {
        self.logs.get(node).map_or(FIRST_REVISION, |l| l.rev)
    }
}

/// The book's revision when it opens (it counts from here in each epoch).
const FIRST_REVISION: u64 = 1;

pub struct VolumeBook {
    backend: Arc<dyn Backend>,
    /// Held by a change from its decision to its end: changes come one at a time, each
    /// decided on the state it is applied to. `st` itself is never held while the backend
    /// commits, so readers (gRPC handlers, lease renewal's runtime) never wait on the API.
    writer: Mutex<()>,
    st: Mutex<BookState>,
    /// This book instance: revisions are comparable only within one epoch.
    epoch: u64,
    /// The backend's [`Backend::volume_store_id`] ("" when it may not be read): nodes
    /// reclaim only orphans of this store.
    store_id: String,
    /// Wakes waiters after every report or record change.
    events_tx: watch::Sender<u64>,
    pub orphan_grace: Duration,
    /// How long a node that is away (since the controller started, or since its stream
    /// closed) has an unknown capacity rather than none.
    pub capacity_grace: Duration,
    started: Instant,
}

/// [`VolumeBook::capacity_grace`] unless the configuration says otherwise.
pub const DEFAULT_CAPACITY_GRACE: Duration = Duration::from_secs(60);

/// Why the volume book refused or could not do something. [`BookError::code`] is the one
/// place that decides which gRPC code each answers with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BookError {
    /// The backend did not commit (or load): nothing changed.
    #[error("controller store: {0}")]
    Store(#[from] BackendError),
    /// The id derived from a new volume's name belongs to a volume of another name.
    #[error("volume id {id} (for name {name:?}) is taken by volume {other:?}")]
    IdTaken { id: String, name: String, other: String },
    /// No connected node (within the requisite ones) has room for a new volume on the
    /// backend it asks for.
    #[error("no node can hold {size} bytes on its {backend} backend{within} (candidates: {candidates})")]
    NoRoom { backend: StoreBackend, size: u64, within: String, candidates: String },
    #[error("volume {0} does not exist")]
    NotFound(String),
    #[error("snapshot {0} does not exist")]
    SnapshotNotFound(String),
    /// A content source that is not complete yet.
    #[error("{0} is not ready yet; retry")]
    SourceNotReady(String),
    /// A content source lives on one node only, which the request's topology excludes.
    #[error(
        "{what} lives on node {node}, which the requisite topology {requisite:?} excludes: a volume made from it can only be on that node"
    )]
    SourceOutside { what: String, node: String, requisite: Vec<String> },
    /// A volume is still being made from this one (or this snapshot).
    #[error("volume {copy} is still being made from {id}; retry when it is")]
    SourceInUse { id: String, copy: String },
    /// A volume made from a source is on the source's backend.
    #[error("{what} is on the {source_backend} backend; a volume made from it must be too, not on {backend}")]
    BackendMismatch { what: String, source_backend: StoreBackend, backend: StoreBackend },
    /// A volume made from a source is at least the source's size.
    #[error("{what} holds {source_size} bytes; the new volume may have at most {size}")]
    SourceTooLarge { what: String, source_size: u64, size: u64 },
    #[error("volume {0} is being deleted")]
    BeingDeleted(String),
    /// The volume's node has not the room to grow it by `needed` bytes.
    #[error("node {node} has {free} bytes free; growing {id} to {size} needs {needed}")]
    NoRoomToGrow { node: String, free: u64, id: String, size: u64, needed: u64 },
    /// The node reported a failure for the volume (its code, its message).
    #[error("node: {message}")]
    Node { code: Code, message: String },
    #[error("controller shutting down")]
    ShuttingDown,
    /// The node's agent is away, maybe only for a restart: its capacity is not known now.
    #[error("node {0} is not connected and may be back soon; its capacity is not known yet, retry")]
    CapacityUnknown(String),
    /// A wait ran out of time before the node finished.
    #[error("the node has not finished the operation yet; retry")]
    NotYet,
}

impl BookError {
    /// The gRPC code this error answers with (CSI and the agent API alike).
    pub fn code(&self) -> Code {
        match self {
            BookError::Store(_) | BookError::ShuttingDown | BookError::CapacityUnknown(_) => Code::Unavailable,
            BookError::IdTaken { .. } => Code::AlreadyExists,
            BookError::NoRoom { .. } | BookError::SourceOutside { .. } => Code::ResourceExhausted,
            BookError::NotFound(_) | BookError::BeingDeleted(_) | BookError::SnapshotNotFound(_) => Code::NotFound,
            BookError::SourceNotReady(_) => Code::Unavailable,
            BookError::SourceInUse { .. } => Code::FailedPrecondition,
            BookError::BackendMismatch { .. } => Code::InvalidArgument,
            BookError::SourceTooLarge { .. } => Code::OutOfRange,
            BookError::NoRoomToGrow { .. } => Code::OutOfRange,
            BookError::Node { code, .. } => *code,
            BookError::NotYet => Code::DeadlineExceeded,
        }
    }
}

impl From<BookError> for tonic::Status {
    fn from(e: BookError) -> Self {
        tonic::Status::new(e.code(), e.to_string())
    }
}

/// The volume id for a CSI volume name: the name itself when it is a valid store id (the
/// usual `pvc-<uuid>`), else `v-` and 32 hex digits of its SHA-256. Deterministic, so a
/// retried CreateVolume after any crash asks the node for the same id.
pub fn volume_id_for(name: &str) -> String {
    if name.len() <= 100 && crate::storage::store::validate_id(name).is_ok() && !name.starts_with('.') {
        return name.to_string();
    }
    use sha2::Digest;
    let h = sha2::Sha256::digest(name.as_bytes());
    format!("v-{}", hex::encode(&h[..16]))
}

/// Where a new volume may go.
#[derive(Debug, Default, Clone)]
pub struct Placement {
    /// Candidate node sets from `requisite` (empty: any node).
    pub requisite: Vec<String>,
    /// Nodes from `preferred`, in order.
    pub preferred: Vec<String>,
    /// The store backend the volume goes on: only nodes that report it with room are
    /// candidates.
    pub backend: StoreBackend,
}

impl VolumeBook {
    pub fn open(backend: Arc<dyn Backend>, orphan_grace: Duration) -> Result<Self, BookError> {
        let mut vols = BTreeMap::new();
        let mut by_name = HashMap::new();
        let mut by_node: HashMap<String, BTreeSet<String>> = HashMap::new();
        for rec in backend.load_volumes()? {
            if let Some(prev) = by_name.insert((rec.kind, rec.name.clone()), rec.id.clone()) {
                let msg = format!("volume name {:?} recorded for both {prev} and {}", rec.name, rec.id);
                return Err(BackendError::Corrupt(msg).into());
            }
            by_node.entry(rec.node.clone()).or_default().insert(rec.id.clone());
            vols.insert(rec.id.clone(), rec);
        }
        let store_id = match backend.volume_store_id() {
            Ok(id) => id,
            // Not allowed to read it (an RBAC from before the identity): nodes keep orphans.
            Err(BackendError::Refused(e)) => {
                tracing::warn!(error = %e, "the volume store's identity cannot be read: nodes will reclaim no orphan");
                String::new()
            }
            Err(e) => return Err(e.into()),
        };
        tracing::info!(store = %store_id, "volume store");
        let (events_tx, _) = watch::channel(0);
        Ok(VolumeBook {
            store_id,
            backend,
            writer: Mutex::new(()),
            st: Mutex::new(BookState {
                vols,
                by_name,
                by_node,
                nodes: HashMap::new(),
                revision: FIRST_REVISION,
                logs: HashMap::new(),
            }),
            epoch: super::records::random_epoch(),
            events_tx,
            orphan_grace,
            capacity_grace: DEFAULT_CAPACITY_GRACE,
            started: Instant::now(),
        })
    }

    /// Begin a change: the writer lock, then the state to decide on.
    fn write(&self) -> (MutexGuard<'_, ()>, MutexGuard<'_, BookState>) {
        let w = self.writer.lock().unwrap();
        (w, self.st.lock().unwrap())
    }

    /// Commit `changes` (decided on `st` under `_w`, from [`Self::write`]) to the backend with
    /// the state unlocked, then apply them.
    fn commit(
        &self,
        _w: &MutexGuard<'_, ()>,
        st: MutexGuard<'_, BookState>,
        changes: Vec<(String, Option<VolumeRecord>)>,
    ) -> Result<(), BookError> {
        drop(st);
        self.backend.commit_volumes(&changes)?;
        let mut st = self.st.lock().unwrap();
        let rev = st.revision + 1;
        // (node, id) of every set that changed: the record's old node and its new one.
        let mut touched = BTreeSet::new();
        for (id, rec) in changes {
            if let Some(old) = st.vols.remove(&id) {
                st.by_name.remove(&(old.kind, old.name));
                if let Some(ids) = st.by_node.get_mut(&old.node) {
                    ids.remove(&id);
                    if ids.is_empty() {
                        st.by_node.remove(&old.node);
                    }
                }
                touched.insert((old.node, id.clone()));
            }
            if let Some(r) = rec {
                st.by_name.insert((r.kind, r.name.clone()), id.clone());
                st.by_node.entry(r.node.clone()).or_default().insert(id.clone());
                touched.insert((r.node.clone(), id.clone()));
                st.vols.insert(id, r);
            }
        }
        st.revision = rev;
        // Streams woken here read the sets only once this lock is released, so a node with
        // several changed ids is woken once with all of them logged.
        for (node, id) in touched {
            let log = st.log_of(&node);
            log.rev = rev;
            log.log.push_back((rev, id));
            while log.log.len() > NODE_LOG {
                if let Some((r, _)) = log.log.pop_front() {
                    log.floor = r;
                }
            }
            log.tx.send_replace(rev);
        }
        self.events_tx.send_modify(|v| *v += 1);
        Ok(())
    }

    /// This book instance (revisions of another epoch are not comparable).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Wakes with the node's revision whenever its desired set changes.
    pub fn subscribe_node(&self, node: &str) -> watch::Receiver<u64> {
        self.st.lock().unwrap().log_of(node).tx.subscribe()
    }

    /// The revision of `node`'s desired set now (a report made against this revision or a
    /// later one has seen every change committed before).
    pub fn revision_of(&self, node: &str) -> u64 {
        self.st.lock().unwrap().node_revision(node)
    }

    /// The complete desired set of `node`.
    pub fn desired(&self, node: &str) -> pb::VolumeSet {
        let st = self.st.lock().unwrap();
        self.complete_set(&st, node)
    }

    fn complete_set(&self, st: &BookState, node: &str) -> pb::VolumeSet {
        let mut set = pb::VolumeSet {
            revision: st.node_revision(node),
            orphan_grace_seconds: self.orphan_grace.as_secs(),
            complete: true,
            epoch: self.epoch,
            store_id: self.store_id.clone(),
            ..Default::default()
        };
        for v in st.records_on(node) {
            add_desired(&mut set, v);
        }
        set
    }

    /// What a client holding `node`'s set at revision `since` (of this epoch; `None`: no
    /// set) needs: the records changed since then and the ids removed, or the complete set
    /// when `since` is older than the node's log reaches or not one of its revisions. The
    /// bool is false when nothing changed since `since`.
    pub fn desired_since(&self, node: &str, since: Option<u64>) -> (pb::VolumeSet, bool) {
        let st = self.st.lock().unwrap();
        let (rev, floor) = st.logs.get(node).map_or((FIRST_REVISION, FIRST_REVISION), |l| (l.rev, l.floor));
        let Some(since) = since.filter(|s| (floor..=rev).contains(s)) else {
            return (self.complete_set(&st, node), true);
        };
        let mut set = pb::VolumeSet {
            revision: rev,
            orphan_grace_seconds: self.orphan_grace.as_secs(),
            base_revision: since,
            epoch: self.epoch,
            store_id: self.store_id.clone(),
            ..Default::default()
        };
        let Some(log) = st.logs.get(node) else { return (set, false) };
        let ids: BTreeSet<&String> = log.log.iter().filter(|(r, _)| *r > since).map(|(_, id)| id).collect();
        let changed = !ids.is_empty();
        for id in ids {
            match st.vols.get(id).filter(|v| v.node == node) {
                Some(v) => add_desired(&mut set, v),
                None => set.removed.push(id.clone()),
            }
        }
        (set, changed)
    }

    /// A node's volume stream opened; the guard marks it disconnected when dropped.
    pub fn connect(self: &Arc<Self>, node: &str) -> ConnectionGuard {
        self.st.lock().unwrap().nodes.entry(node.to_string()).or_default().connected += 1;
        self.events_tx.send_modify(|v| *v += 1);
        ConnectionGuard { book: self.clone(), node: node.to_string() }
    }

    /// Take a node's report: remember it, and move records along (Creating → Ready when the
    /// file is there, Deleting → gone when it is not). Returns how the node's pools changed.
    pub fn report(&self, r: pb::ReportVolumesRequest) -> Result<Vec<PoolChange>, BookError> {
        let (w, mut st) = self.write();
        let view = st.nodes.entry(r.node_name.clone()).or_default();
        view.capacity_bytes = r.capacity_bytes;
        view.available_bytes = r.available_bytes;
        let backends = reported_backends(&r);
        let pools = pool_changes(&view.backends, &backends);
        view.backends = backends;
        view.reported = true;
        view.volumes = r.volumes.iter().map(|v| (v.id.clone(), v.clone())).collect();
        view.snapshots = r.snapshots.iter().map(|v| (v.id.clone(), v.clone())).collect();
        for f in &r.failures {
            view.failures.insert(f.id.clone(), (f.code, f.message.clone(), r.revision));
        }
        // A failure not repeated in this report is resolved.
        view.failures.retain(|id, _| r.failures.iter().any(|f| &f.id == id));
        let mut changes = Vec::new();
        for v in st.records_on(&r.node_name) {
            let held = match v.kind {
                RecordKind::Volume => r.volumes.iter().find(|h| h.id == v.id && h.name == v.name).map(|h| h.size_bytes),
                RecordKind::Snapshot => {
                    let h = r
                        .snapshots
                        .iter()
                        .find(|h| h.id == v.id && h.name == v.name && h.source_volume_id == v.source_volume);
                    if let Some(h) = h
                        && v.state == VolState::Creating
                    {
                        // Complete on the node: ready, with the size and time the node cut it at.
                        let created_at = u64::try_from(h.created_at).unwrap_or(v.created_at);
                        let ready =
                            VolumeRecord { state: VolState::Ready, size_bytes: h.size_bytes, created_at, ..v.clone() };
                        changes.push((v.id.clone(), Some(ready)));
                        continue;
                    }
                    h.map(|h| h.size_bytes)
                }
            };
            match (v.state, held) {
                (VolState::Creating, Some(h)) if h >= v.size_bytes => {
                    changes.push((v.id.clone(), Some(VolumeRecord { state: VolState::Ready, ..v.clone() })));
                }
                (VolState::Deleting, None) => changes.push((v.id.clone(), None)),
                _ => {}
            }
        }
        if changes.is_empty() {
            self.events_tx.send_modify(|v| *v += 1);
            return Ok(pools);
        }
        for (id, c) in &changes {
            match c {
                Some(v) => tracing::info!(id = %id, kind = ?v.kind, node = %r.node_name, "ready"),
                None => tracing::info!(id = %id, node = %r.node_name, "deleted"),
            }
        }
        self.commit(&w, st, changes)?;
        Ok(pools)
    }

    /// The volume `id` (never a snapshot).
    pub fn get(&self, id: &str) -> Option<VolumeRecord> {
        self.get_kind(RecordKind::Volume, id)
    }

    /// Whether a record of either kind (volume or snapshot) has id `id`.
    pub fn holds(&self, id: &str) -> bool {
        self.st.lock().unwrap().vols.contains_key(id)
    }

    /// The snapshot `id`.
    pub fn get_snapshot(&self, id: &str) -> Option<VolumeRecord> {
        self.get_kind(RecordKind::Snapshot, id)
    }

    fn get_kind(&self, kind: RecordKind, id: &str) -> Option<VolumeRecord> {
        self.st.lock().unwrap().vols.get(id).filter(|v| v.kind == kind).cloned()
    }

    pub fn by_name(&self, name: &str) -> Option<VolumeRecord> {
        let st = self.st.lock().unwrap();
        st.by_name.get(&(RecordKind::Volume, name.to_string())).and_then(|id| st.vols.get(id)).cloned()
    }

    /// Every volume, by id.
    pub fn list(&self) -> Vec<VolumeRecord> {
        self.st.lock().unwrap().vols.values().filter(|v| v.kind == RecordKind::Volume).cloned().collect()
    }

    /// Every snapshot, by id.
    pub fn list_snapshots(&self) -> Vec<VolumeRecord> {
        self.st.lock().unwrap().vols.values().filter(|v| v.kind == RecordKind::Snapshot).cloned().collect()
    }

    /// Volumes per state (creating, ready, deleting) and open volume streams (metrics).
    pub fn stats(&self) -> BookStats {
        let st = self.st.lock().unwrap();
        let mut s = BookStats::default();
        for v in st.vols.values() {
            if v.kind == RecordKind::Snapshot {
                s.snapshots += 1;
                continue;
            }
            match v.state {
                VolState::Creating => s.creating += 1,
                VolState::Ready => s.ready += 1,
                VolState::Deleting => s.deleting += 1,
            }
        }
        s.streams = st.nodes.values().map(|n| n.connected as usize).sum();
        s
    }

    pub fn node_views(&self) -> HashMap<String, NodeView> {
        self.st.lock().unwrap().nodes.clone()
    }

    /// One node's view, when the node is known.
    pub fn node_view(&self, node: &str) -> Option<NodeView> {
        self.st.lock().unwrap().nodes.get(node).cloned()
    }

    /// Free bytes of a node's `backend` for new volumes: its reported capacity minus
    /// everything placed on that backend of the node (including volumes still being created
    /// or deleted, and snapshots). 0 when the node does not have the backend.
    fn free(st: &BookState, node: &str, backend: StoreBackend) -> u64 {
        let Some(view) = st.nodes.get(node) else { return 0 };
        let Some((capacity, available)) = view.room(backend) else { return 0 };
        let mine: Vec<&VolumeRecord> = st.records_on(node).filter(|v| v.backend == backend).collect();
        let used: u64 = mine.iter().map(|v| v.size_bytes).sum();
        // Placed but not (fully) on the node yet: the node's own figure does not count it.
        let pending: u64 = mine.iter().map(|v| v.size_bytes.saturating_sub(held_bytes(Some(view), v))).sum();
        capacity.saturating_sub(used).min(available.saturating_sub(pending))
    }

    /// Nodes that can take volumes now: connected and reporting.
    fn live_nodes(st: &BookState) -> Vec<String> {
        let mut v: Vec<String> = st.nodes.iter().filter(|(_, n)| n.live()).map(|(k, _)| k.clone()).collect();
        v.sort();
        v
    }

    /// Free capacity of `backend` per live node, restricted to `nodes` when given (0 on a
    /// node without the backend, or whose lvm pool is short). A node asked for that is away
    /// for less than `capacity_grace` is [`BookError::CapacityUnknown`]: the provisioner then
    /// keeps what it published and asks again, so a controller's restart does not show as 0.
    pub fn capacity(&self, nodes: Option<&[String]>, backend: StoreBackend) -> Result<Vec<(String, u64)>, BookError> {
        let st = self.st.lock().unwrap();
        if let Some(n) = nodes.unwrap_or_default().iter().find(|n| self.briefly_away(&st, n)) {
            return Err(BookError::CapacityUnknown(n.clone()));
        }
        Ok(Self::live_nodes(&st)
            .into_iter()
            .filter(|n| nodes.is_none_or(|only| only.contains(n)))
            .map(|n| {
                let f = Self::free(&st, &n, backend);
                (n, f)
            })
            .collect())
    }

    /// A volume still being made on a node away for longer than `capacity_grace`. It was
    /// never ready, so nothing can be on it: it may be placed again. One made from a source
    /// stays (only the source's node can make it).
    fn stranded(&self, st: &BookState, v: &VolumeRecord) -> bool {
        v.state == VolState::Creating
            && v.source_volume.is_empty()
            && v.source_snapshot.is_empty()
            && !st.nodes.get(&v.node).is_some_and(NodeView::live)
            && !self.briefly_away(st, &v.node)
    }

    /// Not live, and gone (or not seen since the controller started) for less than
    /// `capacity_grace`.
    fn briefly_away(&self, st: &BookState, node: &str) -> bool {
        let view = st.nodes.get(node);
        if view.is_some_and(NodeView::live) {
            return false;
        }
        view.and_then(|v| v.left).unwrap_or(self.started).elapsed() < self.capacity_grace
    }

    /// Record a new volume `name` of `size` on a node chosen by `placement`, or return the
    /// existing record of that name (the caller checks compatibility). `Ok((record, true))`
    /// when it was created now.
    pub fn place(
        &self,
        name: &str,
        size: u64,
        fs_type: FsType,
        parameters: BTreeMap<String, String>,
        placement: &Placement,
        source: Option<&ContentSource>,
    ) -> Result<(VolumeRecord, bool), BookError> {
        let (w, st) = self.write();
        if let Some(id) = st.by_name.get(&(RecordKind::Volume, name.to_string())) {
            let v = &st.vols[id];
            let same = v.size_bytes == size && v.fs_type == fs_type && v.parameters == parameters;
            if !(same && source.is_none() && self.stranded(&st, v)) {
                return Ok((v.clone(), false));
            }
            tracing::warn!(volume = %id, node = %v.node, "placing the volume again: its node went away before making it");
        }
        let id = volume_id_for(name);
        if let Some(other) = st.vols.get(&id).filter(|o| o.name != name || o.kind != RecordKind::Volume) {
            return Err(BookError::IdTaken { id, name: name.to_string(), other: other.name.clone() });
        }
        let live = Self::live_nodes(&st);
        let mut candidates: Vec<String> = if placement.requisite.is_empty() {
            live.clone()
        } else {
            live.iter().filter(|n| placement.requisite.contains(n)).cloned().collect()
        };
        let (mut source_snapshot, mut source_volume) = (String::new(), String::new());
        if let Some(src) = source {
            // Made by copying on the source's node: that node or none.
            let s = Self::source_record(&st, src)?;
            if s.backend != placement.backend {
                return Err(BookError::BackendMismatch {
                    what: src.to_string(),
                    source_backend: s.backend,
                    backend: placement.backend,
                });
            }
            if size < s.size_bytes {
                return Err(BookError::SourceTooLarge { what: src.to_string(), source_size: s.size_bytes, size });
            }
            if !placement.requisite.is_empty() && !placement.requisite.contains(&s.node) {
                return Err(BookError::SourceOutside {
                    what: src.to_string(),
                    node: s.node.clone(),
                    requisite: placement.requisite.iter().filter(|r| !r.starts_with('\0')).cloned().collect(),
                });
            }
            if !live.contains(&s.node) {
                return Err(BookError::Store(BackendError::Unavailable(format!(
                    "node {} holding {src} is not connected",
                    s.node
                ))));
            }
            candidates = vec![s.node.clone()];
            match src {
                ContentSource::Snapshot(i) => source_snapshot = i.clone(),
                ContentSource::Volume(i) => source_volume = i.clone(),
            }
        }
        let backend = placement.backend;
        let free = |n: &String| Self::free(&st, n, backend);
        let fits = |n: &String| free(n) >= size;
        let chosen = placement.preferred.iter().find(|p| candidates.contains(p) && fits(p)).cloned().or_else(|| {
            candidates.iter().filter(|n| fits(n)).max_by_key(|n| (free(n), std::cmp::Reverse((*n).clone()))).cloned()
        });
        let Some(node) = chosen else {
            let detail: Vec<String> = candidates.iter().map(|n| no_room_detail(&st, n, backend)).collect();
            return Err(BookError::NoRoom {
                backend,
                size,
                within: if placement.requisite.is_empty() {
                    String::new()
                } else {
                    format!(" within {:?}", placement.requisite)
                },
                candidates: if detail.is_empty() { "none connected".to_string() } else { detail.join(", ") },
            });
        };
        let rec = VolumeRecord {
            id: id.clone(),
            name: name.to_string(),
            node: node.clone(),
            size_bytes: size,
            fs_type,
            state: VolState::Creating,
            created_at: crate::util::unix_secs(),
            parameters,
            kind: RecordKind::Volume,
            source_volume,
            source_snapshot,
            backend,
        };
        self.commit(&w, st, vec![(id.clone(), Some(rec.clone()))])?;
        tracing::info!(volume = %id, name, node = %node, size, fs = fs_type.as_str(), %backend, source = ?source, "volume placed");
        Ok((rec, true))
    }

    /// The record a content source names: complete (Ready) and not going.
    fn source_record<'a>(st: &'a BookState, src: &ContentSource) -> Result<&'a VolumeRecord, BookError> {
        let (kind, id, missing): (RecordKind, &str, fn(String) -> BookError) = match src {
            ContentSource::Snapshot(i) => (RecordKind::Snapshot, i, BookError::SnapshotNotFound),
            ContentSource::Volume(i) => (RecordKind::Volume, i, BookError::NotFound),
        };
        let s = st
            .vols
            .get(id)
            .filter(|v| v.kind == kind && v.state != VolState::Deleting)
            .ok_or_else(|| missing(id.to_string()))?;
        if s.state != VolState::Ready {
            return Err(BookError::SourceNotReady(src.to_string()));
        }
        Ok(s)
    }

    /// The size, filesystem and node of a content source (checked again by `place`).
    pub fn source(&self, src: &ContentSource) -> Result<VolumeRecord, BookError> {
        let st = self.st.lock().unwrap();
        Self::source_record(&st, src).cloned()
    }

    /// Record snapshot `name` of volume `source` on the volume's node, or return the existing
    /// snapshot of that name (the caller checks it is of the same source). `Ok((record,
    /// true))` when it was recorded now.
    pub fn place_snapshot(
        &self,
        name: &str,
        source: &str,
        parameters: BTreeMap<String, String>,
    ) -> Result<(VolumeRecord, bool), BookError> {
        let (w, st) = self.write();
        if let Some(id) = st.by_name.get(&(RecordKind::Snapshot, name.to_string())) {
            return Ok((st.vols[id].clone(), false));
        }
        let v = Self::source_record(&st, &ContentSource::Volume(source.to_string()))?.clone();
        let id = volume_id_for(name);
        if let Some(other) = st.vols.get(&id) {
            return Err(BookError::IdTaken { id, name: name.to_string(), other: other.name.clone() });
        }
        if !Self::live_nodes(&st).contains(&v.node) {
            return Err(BookError::Store(BackendError::Unavailable(format!(
                "node {} holding volume {source} is not connected",
                v.node
            ))));
        }
        let free = Self::free(&st, &v.node, v.backend);
        if free < v.size_bytes {
            return Err(BookError::NoRoom {
                backend: v.backend,
                size: v.size_bytes,
                within: format!(" on node {} (a snapshot is taken where its volume is)", v.node),
                candidates: format!("{}: {free} free", v.node),
            });
        }
        let rec = VolumeRecord {
            id: id.clone(),
            name: name.to_string(),
            node: v.node.clone(),
            size_bytes: v.size_bytes,
            fs_type: v.fs_type,
            state: VolState::Creating,
            created_at: crate::util::unix_secs(),
            parameters,
            kind: RecordKind::Snapshot,
            source_volume: source.to_string(),
            source_snapshot: String::new(),
            backend: v.backend,
        };
        self.commit(&w, st, vec![(id.clone(), Some(rec.clone()))])?;
        tracing::info!(snapshot = %id, name, volume = source, node = %v.node, size = v.size_bytes, "snapshot placed");
        Ok((rec, true))
    }

    /// Mark a volume or snapshot for deletion (durably). `None`: no such record. Refused
    /// while a volume is still being made from it.
    pub fn begin_delete(&self, id: &str) -> Result<Option<VolumeRecord>, BookError> {
        let (w, st) = self.write();
        let Some(v) = st.vols.get(id).cloned() else { return Ok(None) };
        if let Some(copy) = st.vols.values().find(|c| {
            c.kind == RecordKind::Volume
                && c.state == VolState::Creating
                && c.id != id
                && (c.source_snapshot == id || c.source_volume == id)
        }) {
            return Err(BookError::SourceInUse { id: id.to_string(), copy: copy.id.clone() });
        }
        if v.state != VolState::Deleting {
            let d = VolumeRecord { state: VolState::Deleting, ..v };
            self.commit(&w, st, vec![(id.to_string(), Some(d.clone()))])?;
            return Ok(Some(d));
        }
        Ok(Some(v))
    }

    /// Undo `begin_delete` when the node refused (the volume is in use).
    pub fn cancel_delete(&self, id: &str) -> Result<(), BookError> {
        let (w, st) = self.write();
        if let Some(v) = st.vols.get(id).cloned()
            && v.state == VolState::Deleting
        {
            // The node refused because the volume is in use: it holds it, so it is ready
            // (a volume it does not hold would have been deleted, not refused).
            let state = if held(st.nodes.get(&v.node), &v).is_some() { VolState::Ready } else { VolState::Creating };
            self.commit(&w, st, vec![(id.to_string(), Some(VolumeRecord { state, ..v }))])?;
        }
        Ok(())
    }

    /// Put a volume's desired size back after the node refused to grow it.
    pub fn revert_expand(&self, id: &str, size: u64) -> Result<(), BookError> {
        let (w, st) = self.write();
        if let Some(v) = st.vols.get(id).cloned()
            && v.size_bytes > size
        {
            self.commit(&w, st, vec![(id.to_string(), Some(VolumeRecord { size_bytes: size, ..v }))])?;
        }
        Ok(())
    }

    /// Raise a volume's desired size (durably), checking the node has room.
    pub fn begin_expand(&self, id: &str, size: u64) -> Result<VolumeRecord, BookError> {
        let (w, st) = self.write();
        let v = st.vols.get(id).cloned().ok_or_else(|| BookError::NotFound(id.to_string()))?;
        if v.state == VolState::Deleting {
            return Err(BookError::BeingDeleted(id.to_string()));
        }
        if size <= v.size_bytes {
            return Ok(v);
        }
        let free = Self::free(&st, &v.node, v.backend);
        if size - v.size_bytes > free {
            return Err(BookError::NoRoomToGrow {
                node: v.node.clone(),
                free,
                id: id.to_string(),
                size,
                needed: size - v.size_bytes,
            });
        }
        let grown = VolumeRecord { size_bytes: size, ..v };
        self.commit(&w, st, vec![(id.to_string(), Some(grown.clone()))])?;
        Ok(grown)
    }

    /// Wait until `check` decides, re-checking after every report or record change, or
    /// until `timeout` (DEADLINE_EXCEEDED: the CO retries the call, which resumes the wait).
    pub async fn wait<T, E: From<BookError>>(
        &self,
        timeout: Duration,
        mut check: impl FnMut(
            &VolumeBook,
            &HashMap<String, NodeView>,
            &BTreeMap<String, VolumeRecord>,
        ) -> Option<Result<T, E>>,
    ) -> Result<T, E> {
        let mut rx = self.events_tx.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            {
                let st = self.st.lock().unwrap();
                if let Some(r) = check(self, &st.nodes, &st.vols) {
                    return r;
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return Err(BookError::ShuttingDown.into()) },
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(BookError::NotYet.into());
                }
            }
        }
    }
}

/// Where a new volume's contents come from (CSI `VolumeContentSource`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentSource {
    Snapshot(String),
    Volume(String),
}

impl std::fmt::Display for ContentSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ContentSource::Snapshot(id) => write!(f, "snapshot {id}"),
            ContentSource::Volume(id) => write!(f, "volume {id}"),
        }
    }
}

/// What [`VolumeBook::stats`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BookStats {
    pub creating: usize,
    pub ready: usize,
    pub deleting: usize,
    /// Snapshots, in any state.
    pub snapshots: usize,
    /// Open `WatchVolumes` streams (one per connected agent, normally).
    pub streams: usize,
}

/// Marks a node's volume stream closed when dropped.
pub struct ConnectionGuard {
    book: Arc<VolumeBook>,
    node: String,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        if let Some(n) = self.book.st.lock().unwrap().nodes.get_mut(&self.node) {
            n.connected = n.connected.saturating_sub(1);
            if n.connected == 0 {
                n.left = Some(Instant::now());
            }
        }
        self.book.events_tx.send_modify(|v| *v += 1);
    }
}

/// Record `v` as its node's desired set lists it.
fn add_desired(set: &mut pb::VolumeSet, v: &VolumeRecord) {
    match v.kind {
        RecordKind::Volume => set.volumes.push(pb::DesiredVolume {
            id: v.id.clone(),
            size_bytes: v.size_bytes,
            fs_type: v.fs_type.as_str().to_string(),
            present: v.state != VolState::Deleting,
            name: v.name.clone(),
            creating: v.state == VolState::Creating,
            source_snapshot_id: v.source_snapshot.clone(),
            source_volume_id: v.source_volume.clone(),
            backend: v.backend.as_str().to_string(),
        }),
        RecordKind::Snapshot => set.snapshots.push(pb::DesiredSnapshot {
            id: v.id.clone(),
            source_volume_id: v.source_volume.clone(),
            present: v.state != VolState::Deleting,
            name: v.name.clone(),
            creating: v.state == VolState::Creating,
        }),
    }
}

/// How one candidate node falls short, for [`BookError::NoRoom`].
fn no_room_detail(st: &BookState, node: &str, backend: StoreBackend) -> String {
    let view = st.nodes.get(node);
    match view.and_then(|v| v.backends.get(&backend)) {
        _ if view.is_some_and(|v| v.room(backend).is_none()) => format!("{node}: no {backend} backend"),
        Some(r) if r.short => format!("{node}: its {backend} pool is short"),
        _ => format!("{node}: {} free", VolumeBook::free(st, node, backend)),
    }
}

/// What `view` says its node holds for volume record `v` (same id and same claim name).
pub fn held<'a>(view: Option<&'a NodeView>, v: &VolumeRecord) -> Option<&'a pb::VolumeState> {
    view?.volumes.get(&v.id).filter(|h| h.name == v.name && v.kind == RecordKind::Volume)
}

/// The complete snapshot `view` says its node holds for snapshot record `v`.
pub fn held_snapshot<'a>(view: Option<&'a NodeView>, v: &VolumeRecord) -> Option<&'a pb::SnapshotState> {
    view?
        .snapshots
        .get(&v.id)
        .filter(|h| h.name == v.name && h.source_volume_id == v.source_volume && v.kind == RecordKind::Snapshot)
}

/// Bytes of record `v` the node already holds (and so counts in its own available figure).
fn held_bytes(view: Option<&NodeView>, v: &VolumeRecord) -> u64 {
    match v.kind {
        RecordKind::Volume => held(view, v).map(|h| h.size_bytes).unwrap_or(0),
        RecordKind::Snapshot => held_snapshot(view, v).map(|h| h.size_bytes).unwrap_or(0),
    }
}

/// A node failure for `id` from a reconcile against desired-set revision `since` or later,
/// with the node's code.
pub fn failure_since(view: Option<&NodeView>, id: &str, since: u64) -> Option<BookError> {
    let (code, msg, rev) = view?.failures.get(id)?;
    if *rev < since {
        return None;
    }
    Some(BookError::Node { code: Code::from_i32(*code), message: msg.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn book_errors_answer_with_one_code_each_and_keep_their_text() {
        let store = BookError::from(BackendError::Unavailable("the Kubernetes API did not answer within 30s".into()));
        let cases = [
            (store, Code::Unavailable, "controller store: the Kubernetes API did not answer within 30s"),
            (BookError::NotFound("pvc-1".into()), Code::NotFound, "volume pvc-1 does not exist"),
            (BookError::BeingDeleted("pvc-1".into()), Code::NotFound, "volume pvc-1 is being deleted"),
            (
                BookError::Node { code: Code::FailedPrecondition, message: "in use".into() },
                Code::FailedPrecondition,
                "node: in use",
            ),
            (BookError::NotYet, Code::DeadlineExceeded, "the node has not finished the operation yet; retry"),
            (BookError::ShuttingDown, Code::Unavailable, "controller shutting down"),
        ];
        for (e, code, text) in cases {
            assert_eq!(e.code(), code, "{e}");
            let s = tonic::Status::from(e);
            assert_eq!((s.code(), s.message()), (code, text));
        }
    }

    #[test]
    fn ids_are_deterministic_and_valid() {
        assert_eq!(volume_id_for("pvc-0a1b2c"), "pvc-0a1b2c");
        let weird = volume_id_for("My Volume/1");
        assert!(weird.starts_with("v-") && weird.len() == 34, "{weird}");
        assert_eq!(weird, volume_id_for("My Volume/1"));
        assert_ne!(weird, volume_id_for("My Volume/2"));
        crate::storage::store::validate_id(&weird).unwrap();
        assert!(volume_id_for(&"x".repeat(120)).starts_with("v-"));
    }

    fn book(tag: &str) -> (crate::util::TestDir, Arc<VolumeBook>) {
        let t = crate::util::TestDir::new(tag);
        let db = crate::controller::backend::RedbBackend::open(&t.0.join("db.redb")).unwrap();
        (t, Arc::new(VolumeBook::open(db, Duration::from_secs(60)).unwrap()))
    }

    fn report(b: &VolumeBook, node: &str, cap: u64, vols: &[(&str, u64)]) {
        b.report(pb::ReportVolumesRequest {
            node_name: node.into(),
            capacity_bytes: cap,
            available_bytes: cap - vols.iter().map(|v| v.1).sum::<u64>(),
            volumes: vols
                .iter()
                .map(|(id, s)| pb::VolumeState {
                    id: id.to_string(),
                    size_bytes: *s,
                    backing_file_present: true,
                    name: id.to_string(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
        .unwrap();
    }

    /// A backend whose volume commits wait until the test lets each go.
    struct Gated {
        inner: Arc<crate::controller::backend::RedbBackend>,
        entered: Mutex<std::sync::mpsc::Sender<()>>,
        go: Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl Backend for Gated {
        fn load_nodes(&self) -> Result<(Vec<super::super::records::NodeRecord>, u64), BackendError> {
            self.inner.load_nodes()
        }
        fn commit_nodes(
            &self,
            changes: &[super::super::backend::Change<super::super::records::NodeRecord>],
            revision: u64,
        ) -> Result<(), BackendError> {
            self.inner.commit_nodes(changes, revision)
        }
        fn load_volumes(&self) -> Result<Vec<VolumeRecord>, BackendError> {
            self.inner.load_volumes()
        }
        fn commit_volumes(&self, changes: &[super::super::backend::Change<VolumeRecord>]) -> Result<(), BackendError> {
            self.entered.lock().unwrap().send(()).unwrap();
            self.go.lock().unwrap().recv().unwrap();
            self.inner.commit_volumes(changes)
        }
        fn volume_store_id(&self) -> Result<String, BackendError> {
            self.inner.volume_store_id()
        }
        fn describe(&self) -> String {
            "gated".into()
        }
    }

    #[test]
    fn readers_do_not_wait_for_a_slow_commit_and_writers_do() {
        let t = crate::util::TestDir::new("book-gated");
        let (entered_tx, entered) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel();
        let inner = crate::controller::backend::RedbBackend::open(&t.0.join("db.redb")).unwrap();
        let gated = Gated { inner, entered: Mutex::new(entered_tx), go: Mutex::new(go_rx) };
        let b = Arc::new(VolumeBook::open(Arc::new(gated), Duration::from_secs(60)).unwrap());
        let _g = b.connect("n1");
        report(&b, "n1", 100, &[]);
        let place = |name: &'static str| {
            let b = b.clone();
            std::thread::spawn(move || b.place(name, 10, FsType::Ext4, Default::default(), &Placement::default(), None))
        };
        let first = place("a");
        entered.recv().unwrap();
        // The API is slow: readers answer at once, from the state before the change.
        assert!(b.by_name("a").is_none());
        assert!(b.desired("n1").volumes.is_empty());
        // A second change waits for the first to end, then decides on its outcome.
        let second = place("a");
        std::thread::sleep(Duration::from_millis(50));
        assert!(entered.try_recv().is_err(), "a second commit began during the first");
        go.send(()).unwrap();
        let (rec, created) = first.join().unwrap().unwrap();
        assert!(created);
        assert_eq!(second.join().unwrap().unwrap(), (rec.clone(), false));
        assert_eq!(b.desired("n1").volumes.len(), 1);
        assert_eq!(b.by_name("a").map(|r| r.id), Some(rec.id));
    }

    #[test]
    fn a_volume_whose_node_went_away_before_making_it_is_placed_again() {
        let t = crate::util::TestDir::new("book-stranded");
        let db = crate::controller::backend::RedbBackend::open(&t.0.join("db.redb")).unwrap();
        let mut book = VolumeBook::open(db, Duration::from_secs(60)).unwrap();
        book.capacity_grace = Duration::ZERO;
        let b = Arc::new(book);
        let g1 = b.connect("n1");
        let _g2 = b.connect("n2");
        report(&b, "n1", 100, &[]);
        report(&b, "n2", 50, &[]);
        let place = |size: u64| b.place("a", size, FsType::Ext4, Default::default(), &Placement::default(), None);
        let (v, _) = place(10).unwrap();
        assert_eq!(v.node, "n1");
        assert_eq!(place(10).unwrap(), (v.clone(), false), "its node is there: the same record");
        drop(g1);
        // Another request under the name is not this volume's retry: the caller refuses it.
        assert_eq!(place(20).unwrap(), (v.clone(), false));
        let (moved, created) = place(10).unwrap();
        assert!(created);
        assert_eq!((moved.id.as_str(), moved.node.as_str()), (v.id.as_str(), "n2"));
        assert!(b.desired("n1").volumes.is_empty(), "n1's set no longer lists it");
        assert_eq!(b.desired("n2").volumes[0].id, v.id);
        // A volume its node made (ready) stays with it, away or not.
        report(&b, "n2", 50, &[(v.id.as_str(), 10)]);
        drop(_g2);
        let (kept, created) = place(10).unwrap();
        assert_eq!((kept.node.as_str(), kept.state, created), ("n2", VolState::Ready, false));
    }

    #[test]
    fn placement_honours_requisite_preferred_and_free_space() {
        let (_t, b) = book("book-place");
        let _g1 = b.connect("n1");
        let _g2 = b.connect("n2");
        report(&b, "n1", 100, &[]);
        report(&b, "n2", 300, &[]);
        // Most free wins without preferences.
        let (v, new) = b.place("a", 50, FsType::Ext4, Default::default(), &Placement::default(), None).unwrap();
        assert!(new);
        assert_eq!(v.node, "n2");
        // Preferred order.
        let p = Placement { requisite: vec![], preferred: vec!["n1".into(), "n2".into()], ..Default::default() };
        assert_eq!(b.place("b", 50, FsType::Ext4, Default::default(), &p, None).unwrap().0.node, "n1");
        // Preferred that does not fit falls through.
        assert_eq!(b.place("c", 80, FsType::Ext4, Default::default(), &p, None).unwrap().0.node, "n2");
        // Requisite restricts; impossible → RESOURCE_EXHAUSTED.
        let only1 = Placement { requisite: vec!["n1".into()], preferred: vec![], ..Default::default() };
        assert_eq!(
            b.place("d", 60, FsType::Ext4, Default::default(), &only1, None).unwrap_err().code(),
            Code::ResourceExhausted
        );
        let ghost = Placement { requisite: vec!["n9".into()], preferred: vec![], ..Default::default() };
        assert_eq!(
            b.place("e", 1, FsType::Ext4, Default::default(), &ghost, None).unwrap_err().code(),
            Code::ResourceExhausted
        );
        // Same name again: the existing record.
        let (again, new) = b.place("a", 50, FsType::Ext4, Default::default(), &Placement::default(), None).unwrap();
        assert!(!new);
        assert_eq!(again, v);
        // A disconnected node takes nothing.
        drop(_g1);
        assert_eq!(
            b.place("f", 1, FsType::Ext4, Default::default(), &only1, None).unwrap_err().code(),
            Code::ResourceExhausted
        );
    }

    #[test]
    fn an_away_node_has_unknown_capacity_for_the_grace_then_none() {
        let t = crate::util::TestDir::new("book-capacity");
        let db = crate::controller::backend::RedbBackend::open(&t.0.join("db.redb")).unwrap();
        let mut b = VolumeBook::open(db, Duration::from_secs(60)).unwrap();
        b.capacity_grace = Duration::from_millis(300);
        let b = Arc::new(b);
        let [n1, n9] = ["n1", "n9"].map(|n| vec![n.to_string()]);
        let unknown = |only: &[String]| match b.capacity(Some(only), StoreBackend::File) {
            Err(e @ BookError::CapacityUnknown(_)) => e.code() == Code::Unavailable,
            other => panic!("{other:?}"),
        };
        // Just started: a node not seen yet may still come.
        assert!(unknown(&n9));
        let g = b.connect("n1");
        report(&b, "n1", 100, &[]);
        assert_eq!(b.capacity(Some(&n1), StoreBackend::File).unwrap(), [("n1".to_string(), 100)]);
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(b.capacity(Some(&n9), StoreBackend::File).unwrap(), [], "the grace after the start is over");
        // Its agent leaves: unknown for the grace, then none. The sum counts live nodes only.
        drop(g);
        assert!(unknown(&n1));
        assert_eq!(b.capacity(None, StoreBackend::File).unwrap(), []);
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(b.capacity(Some(&n1), StoreBackend::File).unwrap(), []);
    }

    #[test]
    fn reports_move_records_and_survive_reopen() {
        let t = crate::util::TestDir::new("book-reopen");
        let path = t.0.join("db.redb");
        {
            let db = crate::controller::backend::RedbBackend::open(&path).unwrap();
            let b = Arc::new(VolumeBook::open(db, Duration::from_secs(60)).unwrap());
            let _g = b.connect("n1");
            report(&b, "n1", 100, &[]);
            let (v, _) = b.place("a", 10, FsType::Xfs, Default::default(), &Placement::default(), None).unwrap();
            assert_eq!(v.state, VolState::Creating);
            assert!(b.desired("n1").volumes.iter().any(|d| d.id == "a" && d.present));
            report(&b, "n1", 100, &[("a", 10)]);
            assert_eq!(b.get("a").unwrap().state, VolState::Ready);
            b.place("b", 10, FsType::Xfs, Default::default(), &Placement::default(), None).unwrap();
            b.begin_delete("a").unwrap();
            assert!(b.desired("n1").volumes.iter().any(|d| d.id == "a" && !d.present));
        }
        let db = crate::controller::backend::RedbBackend::open(&path).unwrap();
        let b = Arc::new(VolumeBook::open(db, Duration::from_secs(60)).unwrap());
        assert_eq!(b.get("a").unwrap().state, VolState::Deleting);
        assert_eq!(b.get("b").unwrap().state, VolState::Creating);
        assert_eq!(b.stats(), BookStats { creating: 1, ready: 0, deleting: 1, snapshots: 0, streams: 0 });
        let _g = b.connect("n1");
        let _g2 = b.connect("n1");
        assert_eq!(b.stats().streams, 2);
        drop(_g2);
        report(&b, "n1", 100, &[("b", 10)]);
        assert!(b.get("a").is_none());
        assert_eq!(b.get("b").unwrap().state, VolState::Ready);
        assert_eq!(b.by_name("b").unwrap().id, "b");
        assert_eq!(b.stats(), BookStats { creating: 0, ready: 1, deleting: 0, snapshots: 0, streams: 1 });
    }

    #[test]
    fn snapshots_and_sources_are_placed_on_the_source_node() {
        let (_t, b) = book("book-snap");
        let _g1 = b.connect("n1");
        let _g2 = b.connect("n2");
        report(&b, "n1", 100, &[]);
        report(&b, "n2", 300, &[]);
        let (v, _) = b.place("a", 40, FsType::Ext4, Default::default(), &Placement::default(), None).unwrap();
        assert_eq!(v.node, "n2");
        // Not ready yet: neither a snapshot nor a clone can be made of it.
        assert_eq!(b.place_snapshot("s1", "a", Default::default()).unwrap_err().code(), Code::Unavailable);
        report(&b, "n2", 300, &[("a", 40)]);
        assert_eq!(b.place_snapshot("s1", "nope", Default::default()).unwrap_err().code(), Code::NotFound);
        let (s1, new) = b.place_snapshot("s1", "a", Default::default()).unwrap();
        assert!(new);
        assert_eq!(
            (s1.node.as_str(), s1.size_bytes, s1.kind, s1.state),
            ("n2", 40, RecordKind::Snapshot, VolState::Creating)
        );
        assert!(!b.place_snapshot("s1", "a", Default::default()).unwrap().1, "same name: the same record");
        // The snapshot is in n2's desired set, not among its volumes; volumes list without it.
        let d = b.desired("n2");
        assert_eq!(d.snapshots.len(), 1);
        assert!(d.volumes.iter().all(|v| v.id != s1.id));
        assert!(b.list().iter().all(|v| v.kind == RecordKind::Volume) && b.get(&s1.id).is_none());
        // Its size counts against the node before and after the node holds it.
        assert_eq!(b.capacity(Some(&["n2".into()]), StoreBackend::File).unwrap()[0].1, 300 - 80);
        let snap = ContentSource::Snapshot(s1.id.clone());
        assert_eq!(
            b.place("r", 40, FsType::Ext4, Default::default(), &Placement::default(), Some(&snap)).unwrap_err().code(),
            Code::Unavailable,
            "a snapshot not complete yet is no source"
        );
        b.report(pb::ReportVolumesRequest {
            node_name: "n2".into(),
            capacity_bytes: 300,
            available_bytes: 220,
            volumes: vec![pb::VolumeState {
                id: "a".into(),
                size_bytes: 40,
                name: "a".into(),
                backing_file_present: true,
                ..Default::default()
            }],
            snapshots: vec![pb::SnapshotState {
                id: s1.id.clone(),
                source_volume_id: "a".into(),
                size_bytes: 40,
                name: "s1".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .unwrap();
        assert_eq!(b.get_snapshot(&s1.id).unwrap().state, VolState::Ready);
        assert_eq!(b.capacity(Some(&["n2".into()]), StoreBackend::File).unwrap()[0].1, 220);
        // A volume from it goes to n2 whatever the preferences; a requisite without n2 cannot be met.
        let pref1 = Placement { requisite: vec![], preferred: vec!["n1".into()], ..Default::default() };
        let (r, _) = b.place("r", 50, FsType::Ext4, Default::default(), &pref1, Some(&snap)).unwrap();
        assert_eq!((r.node.as_str(), r.source_snapshot.as_str()), ("n2", s1.id.as_str()));
        assert_eq!(b.desired("n2").volumes.iter().find(|d| d.id == r.id).unwrap().source_snapshot_id, s1.id);
        // Neither the snapshot nor a volume being cloned can go while a copy is made from it.
        assert_eq!(b.begin_delete(&s1.id).unwrap_err().code(), Code::FailedPrecondition);
        let only1 = Placement { requisite: vec!["n1".into()], preferred: vec![], ..Default::default() };
        let e = b.place("r2", 50, FsType::Ext4, Default::default(), &only1, Some(&snap)).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        assert!(e.to_string().contains("lives on node n2"), "{e}");
        assert_eq!(
            b.place("r3", 10, FsType::Ext4, Default::default(), &pref1, Some(&snap)).unwrap_err().code(),
            Code::OutOfRange
        );
        let gone = ContentSource::Snapshot("nope".into());
        assert_eq!(
            b.place("r4", 50, FsType::Ext4, Default::default(), &pref1, Some(&gone)).unwrap_err().code(),
            Code::NotFound
        );
        let clone = ContentSource::Volume("a".into());
        assert_eq!(
            b.place("c", 40, FsType::Ext4, Default::default(), &pref1, Some(&clone)).unwrap().0.source_volume,
            "a"
        );
        assert_eq!(b.begin_delete("a").unwrap_err().code(), Code::FailedPrecondition);
        b.begin_delete(&r.id).unwrap();
        b.begin_delete("c").unwrap();
        // Snapshot and volume names are separate: a volume named like a snapshot is a new record
        // only if its id is free.
        assert_eq!(
            b.place("s1", 1, FsType::Ext4, Default::default(), &pref1, None).unwrap_err().code(),
            Code::AlreadyExists
        );
        // Deleting the snapshot: it leaves the desired set once the node no longer reports it.
        b.begin_delete(&s1.id).unwrap();
        assert!(!b.desired("n2").snapshots[0].present);
        report(&b, "n2", 300, &[("a", 40)]);
        assert!(b.get_snapshot(&s1.id).is_none());
    }

    /// A report of a node with a file backend of `file` bytes (nothing held there) and,
    /// when given, an lvm pool of (capacity, available, short) holding `lvm_vols`. Returns
    /// how the node's pools changed.
    fn report_lvm(
        b: &VolumeBook,
        node: &str,
        file: u64,
        pool: Option<(u64, u64, bool)>,
        lvm_vols: &[(&str, u64)],
    ) -> Vec<PoolChange> {
        let backends = pool
            .map(|(capacity_bytes, available_bytes, short)| pb::BackendCapacity {
                backend: "lvm".into(),
                capacity_bytes,
                available_bytes,
                short,
            })
            .into_iter()
            .collect();
        b.report(pb::ReportVolumesRequest {
            node_name: node.into(),
            capacity_bytes: file,
            available_bytes: file,
            volumes: lvm_vols
                .iter()
                .map(|(id, s)| pb::VolumeState {
                    id: id.to_string(),
                    size_bytes: *s,
                    backing_file_present: true,
                    name: id.to_string(),
                    backend: "lvm".into(),
                    ..Default::default()
                })
                .collect(),
            backends,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn a_pool_turning_short_and_back_is_reported_once_each_way() {
        let (_t, b) = book("book-lvm-short");
        let short = PoolChange { backend: StoreBackend::Lvm, short: true };
        let room = PoolChange { backend: StoreBackend::Lvm, short: false };
        assert_eq!(report_lvm(&b, "n1", 10, Some((100, 100, false)), &[]), vec![]);
        assert_eq!(report_lvm(&b, "n1", 10, Some((100, 5, true)), &[]), vec![short]);
        assert_eq!(report_lvm(&b, "n1", 10, Some((100, 5, true)), &[]), vec![], "still short");
        assert_eq!(report_lvm(&b, "n1", 10, Some((100, 50, false)), &[]), vec![room]);
        assert_eq!(report_lvm(&b, "n1", 10, None, &[]), vec![], "a pool gone is not short");
        // Short in a node's first report (a restarted controller learns it that way).
        assert_eq!(report_lvm(&b, "n2", 10, Some((100, 5, true)), &[]), vec![short]);
    }

    fn on(backend: StoreBackend) -> Placement {
        Placement { backend, ..Default::default() }
    }

    #[test]
    fn lvm_placement_skips_nodes_without_lvm_or_without_room_in_it() {
        let (_t, b) = book("book-lvm-place");
        let guards: Vec<_> = ["n1", "n2", "n3"].iter().map(|n| b.connect(n)).collect();
        report_lvm(&b, "n1", 1000, None, &[]);
        report_lvm(&b, "n2", 10, Some((100, 100, false)), &[]);
        report_lvm(&b, "n3", 10, Some((500, 500, true)), &[]);
        let lvm = on(StoreBackend::Lvm);
        // Only n2 has an lvm pool with room: n1 has none, n3's is short.
        let (a, _) = b.place("a", 50, FsType::Ext4, Default::default(), &lvm, None).unwrap();
        assert_eq!((a.node.as_str(), a.backend), ("n2", StoreBackend::Lvm));
        let d = b.desired("n2").volumes.into_iter().find(|d| d.id == "a").unwrap();
        assert_eq!(d.backend, "lvm");
        // A is pending on n2's pool: 50 left there, whatever n2's own figure says yet.
        assert_eq!(
            b.capacity(None, StoreBackend::Lvm).unwrap(),
            vec![("n1".into(), 0), ("n2".into(), 50), ("n3".into(), 0)]
        );
        let e = b.place("b", 60, FsType::Ext4, Default::default(), &lvm, None).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        let msg = e.to_string();
        for want in ["on its lvm backend", "n1: no lvm backend", "n2: 50 free", "n3: its lvm pool is short"] {
            assert!(msg.contains(want), "{want:?} not in {msg}");
        }
        // Preferred nodes without lvm are passed over.
        let pref = Placement { preferred: vec!["n1".into(), "n3".into()], ..on(StoreBackend::Lvm) };
        assert_eq!(b.place("c", 20, FsType::Ext4, Default::default(), &pref, None).unwrap().0.node, "n2");
        // Held now: counted once, by n2's figure.
        report_lvm(&b, "n2", 10, Some((100, 30, false)), &[("a", 50), ("c", 20)]);
        assert_eq!(b.capacity(Some(&["n2".into()]), StoreBackend::Lvm).unwrap(), vec![("n2".into(), 30)]);
        // The file backend is accounted apart: lvm volumes take nothing of it.
        assert_eq!(b.capacity(Some(&["n2".into()]), StoreBackend::File).unwrap(), vec![("n2".into(), 10)]);
        let (f, _) = b.place("f", 900, FsType::Ext4, Default::default(), &Placement::default(), None).unwrap();
        assert_eq!((f.node.as_str(), f.backend), ("n1", StoreBackend::File));
        assert_eq!(b.desired("n1").volumes[0].backend, "file");
        assert_eq!(b.capacity(Some(&["n2".into()]), StoreBackend::Lvm).unwrap(), vec![("n2".into(), 30)]);
        // A pool that runs short takes nothing more; a node that stops listing lvm has none.
        report_lvm(&b, "n2", 10, Some((100, 30, true)), &[("a", 50), ("c", 20)]);
        assert_eq!(b.capacity(Some(&["n2".into()]), StoreBackend::Lvm).unwrap(), vec![("n2".into(), 0)]);
        report_lvm(&b, "n2", 10, None, &[]);
        assert_eq!(
            b.place("g", 1, FsType::Ext4, Default::default(), &lvm, None).unwrap_err().code(),
            Code::ResourceExhausted
        );
        drop(guards);
    }

    #[test]
    fn copies_stay_on_their_sources_backend() {
        let (_t, b) = book("book-lvm-source");
        let _g = b.connect("n1");
        report_lvm(&b, "n1", 1000, Some((1000, 1000, false)), &[]);
        let (a, _) = b.place("a", 40, FsType::Ext4, Default::default(), &on(StoreBackend::Lvm), None).unwrap();
        report_lvm(&b, "n1", 1000, Some((1000, 960, false)), &[("a", 40)]);
        // A snapshot is on its volume's backend, and takes room there.
        let (s, _) = b.place_snapshot("s", &a.id, Default::default()).unwrap();
        assert_eq!(s.backend, StoreBackend::Lvm);
        assert_eq!(b.capacity(None, StoreBackend::Lvm).unwrap()[0].1, 1000 - 80);
        assert_eq!(b.capacity(None, StoreBackend::File).unwrap()[0].1, 1000);
        b.report(pb::ReportVolumesRequest {
            node_name: "n1".into(),
            capacity_bytes: 1000,
            available_bytes: 1000,
            volumes: vec![pb::VolumeState {
                id: "a".into(),
                size_bytes: 40,
                name: "a".into(),
                backend: "lvm".into(),
                ..Default::default()
            }],
            snapshots: vec![pb::SnapshotState {
                id: s.id.clone(),
                source_volume_id: "a".into(),
                size_bytes: 40,
                name: "s".into(),
                ..Default::default()
            }],
            backends: vec![pb::BackendCapacity {
                backend: "lvm".into(),
                capacity_bytes: 1000,
                available_bytes: 920,
                short: false,
            }],
            ..Default::default()
        })
        .unwrap();
        let snap = ContentSource::Snapshot(s.id.clone());
        let clone = ContentSource::Volume("a".into());
        for src in [&snap, &clone] {
            let e = b.place("x", 40, FsType::Ext4, Default::default(), &Placement::default(), Some(src)).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e}");
            assert!(
                e.to_string().contains("is on the lvm backend; a volume made from it must be too, not on file"),
                "{e}"
            );
        }
        assert!(b.by_name("x").is_none(), "nothing recorded");
        let (r, _) = b.place("r", 40, FsType::Ext4, Default::default(), &on(StoreBackend::Lvm), Some(&snap)).unwrap();
        assert_eq!((r.backend, r.source_snapshot.as_str()), (StoreBackend::Lvm, s.id.as_str()));
    }

    #[test]
    fn records_keep_their_backend_and_old_ones_load_as_file() {
        let old = r#"{"id":"a","name":"a","node":"n1","sizeBytes":1,"fsType":"ext4","state":"ready","createdAt":1}"#;
        let rec: VolumeRecord = serde_json::from_str(old).unwrap();
        assert_eq!(rec.backend, StoreBackend::File);
        assert!(!serde_json::to_string(&rec).unwrap().contains("backend"), "a file record is written as before");
        let lvm = VolumeRecord { backend: StoreBackend::Lvm, ..rec };
        let text = serde_json::to_string(&lvm).unwrap();
        assert!(text.contains(r#""backend":"lvm""#), "{text}");
        assert_eq!(serde_json::from_str::<VolumeRecord>(&text).unwrap(), lvm);
    }

    /// Follows one node's set the way the agent does (deltas on a view it keeps).
    struct Follower {
        node: String,
        view: crate::agent::volume_sync::DesiredView,
        rx: watch::Receiver<u64>,
        completes: usize,
    }

    impl Follower {
        fn take(&mut self, b: &VolumeBook, first: bool) {
            let (since, epoch) = self.view.resume();
            let held = (since > 0 && epoch == b.epoch()).then_some(since);
            let (set, changed) = b.desired_since(&self.node, held);
            assert!(changed || first || !self.rx.has_changed().unwrap(), "{}: woken without a change", self.node);
            self.rx.borrow_and_update();
            if changed || first {
                self.completes += set.complete as usize;
                self.view.apply(set).unwrap();
            }
        }

        fn sets_equal(&self, b: &VolumeBook) {
            let want = b.desired(&self.node);
            let got = self.view.set();
            assert_eq!(
                (&got.volumes, &got.snapshots, got.revision),
                (&want.volumes, &want.snapshots, want.revision),
                "{}",
                self.node
            );
        }
    }

    #[test]
    fn desired_deltas_follow_each_node_through_random_changes_and_resumes() {
        let (_t, b) = book("book-deltas");
        let nodes = ["n1", "n2", "n3"];
        let _guards: Vec<_> = nodes.iter().map(|n| b.connect(n)).collect();
        for n in nodes {
            report(&b, n, 1 << 40, &[]);
        }
        let mut fs: Vec<Follower> = nodes
            .iter()
            .map(|n| Follower { node: n.to_string(), view: Default::default(), rx: b.subscribe_node(n), completes: 0 })
            .collect();
        for f in &mut fs {
            f.take(&b, true);
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut names = 0;
        for step in 0..600 {
            let ids: Vec<VolumeRecord> = b.list();
            match rnd(6) {
                0 | 1 => {
                    names += 1;
                    let p = Placement {
                        requisite: vec![],
                        preferred: vec![nodes[rnd(3) as usize].to_string()],
                        ..Default::default()
                    };
                    b.place(&format!("v{names}"), 1 + rnd(100), FsType::Ext4, Default::default(), &p, None).unwrap();
                }
                2 if !ids.is_empty() => {
                    // The node reports what it was asked for: creations done, deletions gone.
                    let v = &ids[rnd(ids.len() as u64) as usize];
                    let held: Vec<(String, u64)> = b
                        .desired(&v.node)
                        .volumes
                        .iter()
                        .filter(|d| d.present && rnd(4) > 0)
                        .map(|d| (d.id.clone(), d.size_bytes))
                        .collect();
                    let held: Vec<(&str, u64)> = held.iter().map(|(i, s)| (i.as_str(), *s)).collect();
                    report(&b, &v.node, 1 << 40, &held);
                }
                3 if !ids.is_empty() => {
                    let v = &ids[rnd(ids.len() as u64) as usize];
                    let _ = b.begin_delete(&v.id);
                }
                4 if !ids.is_empty() => {
                    let v = &ids[rnd(ids.len() as u64) as usize];
                    let _ = b.begin_expand(&v.id, v.size_bytes + 1);
                }
                _ => {
                    // A disconnect: the follower keeps its view and resumes later, or (now
                    // and then) loses it and starts from nothing.
                    let f = &mut fs[rnd(3) as usize];
                    if rnd(4) == 0 {
                        f.view = Default::default();
                    }
                    f.take(&b, true);
                    continue;
                }
            }
            // Followers take what woke them, not always at once (some fall behind).
            for f in &mut fs {
                if f.rx.has_changed().unwrap() && rnd(3) > 0 {
                    f.take(&b, false);
                }
            }
            if step % 50 == 0 {
                for f in &mut fs {
                    f.take(&b, false);
                    f.sets_equal(&b);
                }
            }
        }
        for f in &mut fs {
            f.take(&b, false);
            f.sets_equal(&b);
        }
        assert!(b.list().len() > 20, "the run made volumes");
        let completes: usize = fs.iter().map(|f| f.completes).sum();
        assert!(completes < 60, "followers resumed with deltas, not complete sets ({completes})");
        // A change of n1 wakes n1 only, and its delta names just that volume.
        let p = Placement { requisite: vec!["n1".into()], preferred: vec![], ..Default::default() };
        let (v, _) = b.place("only-n1", 1, FsType::Ext4, Default::default(), &p, None).unwrap();
        assert!(
            fs[0].rx.has_changed().unwrap() && !fs[1].rx.has_changed().unwrap() && !fs[2].rx.has_changed().unwrap()
        );
        let (since, _) = fs[0].view.resume();
        let (d, changed) = b.desired_since("n1", Some(since));
        assert!(changed && !d.complete && d.base_revision == since);
        assert_eq!(d.volumes.iter().map(|v| v.id.as_str()).collect::<Vec<_>>(), vec![v.id.as_str()]);
        assert!(d.removed.is_empty() && d.snapshots.is_empty());
        assert_eq!(b.revision_of("n1"), d.revision);
        assert!(b.revision_of("n2") < d.revision);
        // Too far behind (the log holds NODE_LOG changes) or a revision the node never had:
        // the complete set.
        for i in 0..NODE_LOG + 1 {
            b.begin_expand(&v.id, 2 + i as u64).unwrap();
        }
        assert!(b.desired_since("n1", Some(since)).0.complete);
        assert!(b.desired_since("n1", Some(b.revision_of("n1") + 1)).0.complete);
        assert!(b.desired_since("n1", None).0.complete);
        let (_, changed) = b.desired_since("n1", Some(b.revision_of("n1")));
        assert!(!changed);
        // A view refuses a delta it cannot take and starts over.
        let mut stale = fs[1].view.clone();
        let (d1, _) = b.desired_since("n1", Some(b.revision_of("n1") - 1));
        assert!(stale.apply(d1).is_err());
        assert_eq!(stale.resume(), (0, 0));
    }
}
