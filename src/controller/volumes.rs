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
//! Nodes learn their desired set through `WatchVolumes` (the complete set on every change)
//! and answer with `ReportVolumes`; callers waiting for an outcome are woken by each report.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tonic::Code;

use super::backend::{Backend, BackendError};
use super::records::{VolState, VolumeRecord};
use crate::rpc::controller as pb;
use crate::storage::fs::FsType;



/// What one node told the controller last.
#[derive(Debug, Default, Clone)]
pub struct NodeView {
    pub capacity_bytes: u64,
    /// What the node's store says is left (it also counts volumes the controller does not
    /// know: made on the node, orphans).
    pub available_bytes: u64,
    pub reported: bool,
    /// Open WatchVolumes streams of this node.
    pub connected: u32,
    pub volumes: HashMap<String, pb::VolumeState>,
    /// id -> (code, message, revision of the desired set the failing reconcile ran against)
    pub failures: HashMap<String, (i32, String, u64)>,
    pub orphans: Vec<String>,
    pub last_report: Option<Instant>,
}

struct BookState {
    vols: BTreeMap<String, VolumeRecord>,
    by_name: HashMap<String, String>,
    nodes: HashMap<String, NodeView>,
    /// Bumped on every change of any node's desired set.
    revision: u64,
}

pub struct VolumeBook {
    backend: Arc<dyn Backend>,
    st: Mutex<BookState>,
    /// Desired-set revision, for WatchVolumes.
    desired_tx: watch::Sender<u64>,
    /// Wakes waiters after every report or record change.
    events_tx: watch::Sender<u64>,
    pub orphan_grace: Duration,
}

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
    /// No connected node (within the requisite ones) has room for a new volume.
    #[error("no node can hold {size} bytes{within} (candidates: {candidates})")]
    NoRoom { size: u64, within: String, candidates: String },
    #[error("volume {0} does not exist")]
    NotFound(String),
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
    /// A wait ran out of time before the node finished.
    #[error("the node has not finished the operation yet; retry")]
    NotYet,
}

impl BookError {
    /// The gRPC code this error answers with (CSI and the agent API alike).
    pub fn code(&self) -> Code {
        match self {
            BookError::Store(_) | BookError::ShuttingDown => Code::Unavailable,
            BookError::IdTaken { .. } => Code::AlreadyExists,
            BookError::NoRoom { .. } => Code::ResourceExhausted,
            BookError::NotFound(_) | BookError::BeingDeleted(_) => Code::NotFound,
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

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
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
}

impl VolumeBook {
    pub fn open(backend: Arc<dyn Backend>, orphan_grace: Duration) -> Result<Self, BookError> {
        let mut vols = BTreeMap::new();
        let mut by_name = HashMap::new();
        for rec in backend.load_volumes()? {
            if let Some(prev) = by_name.insert(rec.name.clone(), rec.id.clone()) {
                let msg = format!("volume name {:?} recorded for both {prev} and {}", rec.name, rec.id);
                return Err(BackendError::Corrupt(msg).into());
            }
            vols.insert(rec.id.clone(), rec);
        }
        let (desired_tx, _) = watch::channel(0);
        let (events_tx, _) = watch::channel(0);
        Ok(VolumeBook {
            backend,
            st: Mutex::new(BookState { vols, by_name, nodes: HashMap::new(), revision: 1 }),
            desired_tx,
            events_tx,
            orphan_grace,
        })
    }

    fn commit(&self, st: &mut BookState, changes: Vec<(String, Option<VolumeRecord>)>) -> Result<(), BookError> {
        self.backend.commit_volumes(&changes)?;
        for (id, rec) in changes {
            if let Some(old) = st.vols.remove(&id) {
                st.by_name.remove(&old.name);
            }
            if let Some(r) = rec {
                st.by_name.insert(r.name.clone(), id.clone());
                st.vols.insert(id, r);
            }
        }
        st.revision += 1;
        self.desired_tx.send_replace(st.revision);
        self.events_tx.send_modify(|v| *v += 1);
        Ok(())
    }

    pub fn subscribe_desired(&self) -> watch::Receiver<u64> {
        self.desired_tx.subscribe()
    }

    /// The complete desired set of `node`.
    pub fn desired(&self, node: &str) -> pb::VolumeSet {
        let st = self.st.lock().unwrap();
        pb::VolumeSet {
            volumes: st
                .vols
                .values()
                .filter(|v| v.node == node)
                .map(|v| pb::DesiredVolume {
                    id: v.id.clone(),
                    size_bytes: v.size_bytes,
                    fs_type: v.fs_type.as_str().to_string(),
                    present: v.state != VolState::Deleting,
                    name: v.name.clone(),
                    creating: v.state == VolState::Creating,
                })
                .collect(),
            revision: st.revision,
            orphan_grace_seconds: self.orphan_grace.as_secs(),
        }
    }

    /// A node's volume stream opened; the guard marks it disconnected when dropped.
    pub fn connect(self: &Arc<Self>, node: &str) -> ConnectionGuard {
        self.st.lock().unwrap().nodes.entry(node.to_string()).or_default().connected += 1;
        self.events_tx.send_modify(|v| *v += 1);
        ConnectionGuard { book: self.clone(), node: node.to_string() }
    }

    /// Take a node's report: remember it, and move records along (Creating → Ready when the
    /// file is there, Deleting → gone when it is not).
    pub fn report(&self, r: pb::ReportVolumesRequest) -> Result<(), BookError> {
        let mut st = self.st.lock().unwrap();
        let view = st.nodes.entry(r.node_name.clone()).or_default();
        view.capacity_bytes = r.capacity_bytes;
        view.available_bytes = r.available_bytes;
        view.reported = true;
        view.volumes = r.volumes.iter().map(|v| (v.id.clone(), v.clone())).collect();
        for f in &r.failures {
            view.failures.insert(f.id.clone(), (f.code, f.message.clone(), r.revision));
        }
        // A failure not repeated in this report is resolved.
        view.failures.retain(|id, _| r.failures.iter().any(|f| &f.id == id));
        view.orphans = r.orphans.clone();
        view.last_report = Some(Instant::now());
        let mut changes = Vec::new();
        for v in st.vols.values().filter(|v| v.node == r.node_name) {
            let held = r.volumes.iter().find(|h| h.id == v.id && h.name == v.name);
            match (v.state, held) {
                (VolState::Creating, Some(h)) if h.size_bytes >= v.size_bytes => {
                    changes.push((v.id.clone(), Some(VolumeRecord { state: VolState::Ready, ..v.clone() })));
                }
                (VolState::Deleting, None) => changes.push((v.id.clone(), None)),
                _ => {}
            }
        }
        if changes.is_empty() {
            self.events_tx.send_modify(|v| *v += 1);
            return Ok(());
        }
        for (id, c) in &changes {
            match c {
                Some(_) => tracing::info!(volume = %id, node = %r.node_name, "volume ready"),
                None => tracing::info!(volume = %id, node = %r.node_name, "volume deleted"),
            }
        }
        self.commit(&mut st, changes)
    }

    pub fn get(&self, id: &str) -> Option<VolumeRecord> {
        self.st.lock().unwrap().vols.get(id).cloned()
    }

    pub fn by_name(&self, name: &str) -> Option<VolumeRecord> {
        let st = self.st.lock().unwrap();
        st.by_name.get(name).and_then(|id| st.vols.get(id)).cloned()
    }

    pub fn list(&self) -> Vec<VolumeRecord> {
        self.st.lock().unwrap().vols.values().cloned().collect()
    }

    /// Volumes per state (creating, ready, deleting) and open volume streams (metrics).
    pub fn stats(&self) -> BookStats {
        let st = self.st.lock().unwrap();
        let mut s = BookStats::default();
        for v in st.vols.values() {
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

    /// Free bytes of a node for new volumes: its reported capacity minus everything placed
    /// on it (including volumes still being created or deleted).
    fn free(st: &BookState, node: &str) -> u64 {
        let Some(view) = st.nodes.get(node) else { return 0 };
        let mine: Vec<&VolumeRecord> = st.vols.values().filter(|v| v.node == node).collect();
        let used: u64 = mine.iter().map(|v| v.size_bytes).sum();
        // Placed but not (fully) on the node yet: the node's own figure does not count it.
        let pending: u64 = mine
            .iter()
            .map(|v| v.size_bytes.saturating_sub(held(Some(view), v).map(|h| h.size_bytes).unwrap_or(0)))
            .sum();
        view.capacity_bytes.saturating_sub(used).min(view.available_bytes.saturating_sub(pending))
    }

    /// Nodes that can take volumes now: connected and reporting.
    fn live_nodes(st: &BookState) -> Vec<String> {
        let mut v: Vec<String> =
            st.nodes.iter().filter(|(_, n)| n.connected > 0 && n.reported).map(|(k, _)| k.clone()).collect();
        v.sort();
        v
    }

    /// Free capacity per live node, restricted to `nodes` when given.
    pub fn capacity(&self, nodes: Option<&[String]>) -> Vec<(String, u64)> {
        let st = self.st.lock().unwrap();
        Self::live_nodes(&st)
            .into_iter()
            .filter(|n| nodes.is_none_or(|only| only.contains(n)))
            .map(|n| {
                let f = Self::free(&st, &n);
                (n, f)
            })
            .collect()
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
    ) -> Result<(VolumeRecord, bool), BookError> {
        let mut st = self.st.lock().unwrap();
        if let Some(id) = st.by_name.get(name) {
            return Ok((st.vols[id].clone(), false));
        }
        let id = volume_id_for(name);
        if let Some(other) = st.vols.get(&id) {
            return Err(BookError::IdTaken { id, name: name.to_string(), other: other.name.clone() });
        }
        let live = Self::live_nodes(&st);
        let candidates: Vec<String> = if placement.requisite.is_empty() {
            live.clone()
        } else {
            live.iter().filter(|n| placement.requisite.contains(n)).cloned().collect()
        };
        let fits = |n: &String| Self::free(&st, n) >= size;
        let chosen = placement
            .preferred
            .iter()
            .find(|p| candidates.contains(p) && fits(p))
            .cloned()
            .or_else(|| {
                candidates.iter().filter(|n| fits(n)).max_by_key(|n| (Self::free(&st, n), std::cmp::Reverse((*n).clone()))).cloned()
            });
        let Some(node) = chosen else {
            let detail: Vec<String> = candidates.iter().map(|n| format!("{n}: {} free", Self::free(&st, n))).collect();
            return Err(BookError::NoRoom {
                size,
                within: if placement.requisite.is_empty() { String::new() } else { format!(" within {:?}", placement.requisite) },
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
            created_at: now_unix(),
            parameters,
        };
        self.commit(&mut st, vec![(id.clone(), Some(rec.clone()))])?;
        tracing::info!(volume = %id, name, node = %node, size, fs = fs_type.as_str(), "volume placed");
        Ok((rec, true))
    }

    /// Mark a volume for deletion (durably). `None`: no such volume.
    pub fn begin_delete(&self, id: &str) -> Result<Option<VolumeRecord>, BookError> {
        let mut st = self.st.lock().unwrap();
        let Some(v) = st.vols.get(id).cloned() else { return Ok(None) };
        if v.state != VolState::Deleting {
            let d = VolumeRecord { state: VolState::Deleting, ..v };
            self.commit(&mut st, vec![(id.to_string(), Some(d.clone()))])?;
            return Ok(Some(d));
        }
        Ok(Some(v))
    }

    /// Undo `begin_delete` when the node refused (the volume is in use).
    pub fn cancel_delete(&self, id: &str) -> Result<(), BookError> {
        let mut st = self.st.lock().unwrap();
        if let Some(v) = st.vols.get(id).cloned()
            && v.state == VolState::Deleting
        {
            // The node refused because the volume is in use: it holds it, so it is ready
            // (a volume it does not hold would have been deleted, not refused).
            let state = if held(st.nodes.get(&v.node), &v).is_some() { VolState::Ready } else { VolState::Creating };
            self.commit(&mut st, vec![(id.to_string(), Some(VolumeRecord { state, ..v }))])?;
        }
        Ok(())
    }

    /// Put a volume's desired size back after the node refused to grow it.
    pub fn revert_expand(&self, id: &str, size: u64) -> Result<(), BookError> {
        let mut st = self.st.lock().unwrap();
        if let Some(v) = st.vols.get(id).cloned()
            && v.size_bytes > size
        {
            self.commit(&mut st, vec![(id.to_string(), Some(VolumeRecord { size_bytes: size, ..v }))])?;
        }
        Ok(())
    }

    /// Raise a volume's desired size (durably), checking the node has room.
    pub fn begin_expand(&self, id: &str, size: u64) -> Result<VolumeRecord, BookError> {
        let mut st = self.st.lock().unwrap();
        let v = st.vols.get(id).cloned().ok_or_else(|| BookError::NotFound(id.to_string()))?;
        if v.state == VolState::Deleting {
            return Err(BookError::BeingDeleted(id.to_string()));
        }
        if size <= v.size_bytes {
            return Ok(v);
        }
        let free = Self::free(&st, &v.node);
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
        self.commit(&mut st, vec![(id.to_string(), Some(grown.clone()))])?;
        Ok(grown)
    }

    /// Drop a record whose creation failed on its node: it is deleted there (if anything
    /// was made) like any other.
    pub fn abandon(&self, id: &str) -> Result<(), BookError> {
        self.begin_delete(id).map(|_| ())
    }

    /// Wait until `check` decides, re-checking after every report or record change, or
    /// until `timeout` (DEADLINE_EXCEEDED: the CO retries the call, which resumes the wait).
    pub async fn wait<T, E: From<BookError>>(
        &self,
        timeout: Duration,
        mut check: impl FnMut(&VolumeBook, &HashMap<String, NodeView>, &BTreeMap<String, VolumeRecord>) -> Option<Result<T, E>>,
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

/// What [`VolumeBook::stats`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BookStats {
    pub creating: usize,
    pub ready: usize,
    pub deleting: usize,
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
        }
        self.book.events_tx.send_modify(|v| *v += 1);
    }
}

/// What `view` says its node holds for record `v` (same id and same claim name).
pub fn held<'a>(view: Option<&'a NodeView>, v: &VolumeRecord) -> Option<&'a pb::VolumeState> {
    view?.volumes.get(&v.id).filter(|h| h.name == v.name)
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

impl VolumeBook {
    /// The current desired-set revision (bumped by every committed change).
    pub fn revision(&self) -> u64 {
        self.st.lock().unwrap().revision
    }
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
            (BookError::Node { code: Code::FailedPrecondition, message: "in use".into() }, Code::FailedPrecondition, "node: in use"),
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

    #[test]
    fn placement_honours_requisite_preferred_and_free_space() {
        let (_t, b) = book("book-place");
        let _g1 = b.connect("n1");
        let _g2 = b.connect("n2");
        report(&b, "n1", 100, &[]);
        report(&b, "n2", 300, &[]);
        // Most free wins without preferences.
        let (v, new) = b.place("a", 50, FsType::Ext4, Default::default(), &Placement::default()).unwrap();
        assert!(new);
        assert_eq!(v.node, "n2");
        // Preferred order.
        let p = Placement { requisite: vec![], preferred: vec!["n1".into(), "n2".into()] };
        assert_eq!(b.place("b", 50, FsType::Ext4, Default::default(), &p).unwrap().0.node, "n1");
        // Preferred that does not fit falls through.
        assert_eq!(b.place("c", 80, FsType::Ext4, Default::default(), &p).unwrap().0.node, "n2");
        // Requisite restricts; impossible → RESOURCE_EXHAUSTED.
        let only1 = Placement { requisite: vec!["n1".into()], preferred: vec![] };
        assert_eq!(b.place("d", 60, FsType::Ext4, Default::default(), &only1).unwrap_err().code(), Code::ResourceExhausted);
        let ghost = Placement { requisite: vec!["n9".into()], preferred: vec![] };
        assert_eq!(b.place("e", 1, FsType::Ext4, Default::default(), &ghost).unwrap_err().code(), Code::ResourceExhausted);
        // Same name again: the existing record.
        let (again, new) = b.place("a", 50, FsType::Ext4, Default::default(), &Placement::default()).unwrap();
        assert!(!new);
        assert_eq!(again, v);
        // A disconnected node takes nothing.
        drop(_g1);
        assert_eq!(b.place("f", 1, FsType::Ext4, Default::default(), &only1).unwrap_err().code(), Code::ResourceExhausted);
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
            let (v, _) = b.place("a", 10, FsType::Xfs, Default::default(), &Placement::default()).unwrap();
            assert_eq!(v.state, VolState::Creating);
            assert!(b.desired("n1").volumes.iter().any(|d| d.id == "a" && d.present));
            report(&b, "n1", 100, &[("a", 10)]);
            assert_eq!(b.get("a").unwrap().state, VolState::Ready);
            b.place("b", 10, FsType::Xfs, Default::default(), &Placement::default()).unwrap();
            b.begin_delete("a").unwrap();
            assert!(b.desired("n1").volumes.iter().any(|d| d.id == "a" && !d.present));
        }
        let db = crate::controller::backend::RedbBackend::open(&path).unwrap();
        let b = Arc::new(VolumeBook::open(db, Duration::from_secs(60)).unwrap());
        assert_eq!(b.get("a").unwrap().state, VolState::Deleting);
        assert_eq!(b.get("b").unwrap().state, VolState::Creating);
        assert_eq!(b.stats(), BookStats { creating: 1, ready: 0, deleting: 1, streams: 0 });
        let _g = b.connect("n1");
        let _g2 = b.connect("n1");
        assert_eq!(b.stats().streams, 2);
        drop(_g2);
        report(&b, "n1", 100, &[("b", 10)]);
        assert!(b.get("a").is_none());
        assert_eq!(b.get("b").unwrap().state, VolState::Ready);
        assert_eq!(b.by_name("b").unwrap().id, "b");
        assert_eq!(b.stats(), BookStats { creating: 0, ready: 1, deleting: 0, streams: 1 });
    }
}
