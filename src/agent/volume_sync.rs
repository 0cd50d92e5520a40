//! Controller mode, volumes: follow the controller's desired volume set for this node
//! (`WatchVolumes`), converge the node-local store on it, and report what the store holds
//! (`ReportVolumes`) after every change and periodically.
//!
//! The stream brings the node's complete set first, then only what changed (deltas naming
//! the revision they apply to); the agent keeps the set across reconnects and resumes from
//! its revision, and a delta that does not apply to what it holds makes it ask for the
//! complete set again. Reconciles always work on the complete set ([`DesiredView`]). Volumes
//! the store holds but the set does not list are orphans: reported, and reclaimed once they
//! have been orphans for the controller's grace period (never while attached).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Code;

use super::cluster::{Backoff, open};
use super::config::{Config, ControllerConfig};
use crate::rpc::controller as pb;
use crate::rpc::controller::node_registry_client::NodeRegistryClient;
use crate::storage::csi::NodeService;
use crate::storage::csi::snapshot::Taken;
use crate::storage::store::{Backend, FsType, InvalidBackend, Source, VolumeError, VolumeStore};
use crate::sys::loopdev;

/// The node's desired set as the controller's stream built it up.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct DesiredView {
    /// A complete set has arrived (in this epoch).
    have: bool,
    epoch: u64,
    revision: u64,
    orphan_grace_seconds: u64,
    store_id: String,
    volumes: BTreeMap<String, pb::DesiredVolume>,
    snapshots: BTreeMap<String, pb::DesiredSnapshot>,
}

impl DesiredView {
    /// Take one message of the stream. A complete set (or any set from a controller that
    /// sends no epoch: an older one, whose every message is complete) replaces the view; a
    /// delta applies only to the view of its epoch at exactly its base revision. Otherwise
    /// the view is dropped and the error says why (the caller watches again from nothing).
    pub fn apply(&mut self, set: pb::VolumeSet) -> Result<(), String> {
        if set.complete || set.epoch == 0 {
            *self = DesiredView {
                have: true,
                epoch: set.epoch,
                revision: set.revision,
                orphan_grace_seconds: set.orphan_grace_seconds,
                store_id: set.store_id,
                volumes: set.volumes.into_iter().map(|v| (v.id.clone(), v)).collect(),
                snapshots: set.snapshots.into_iter().map(|s| (s.id.clone(), s)).collect(),
            };
            return Ok(());
        }
        if !self.have || set.epoch != self.epoch || set.base_revision != self.revision {
            let why = format!(
                "volume delta for revision {} of epoch {:x} does not apply to the set held (revision {} of epoch {:x}, complete: {})",
                set.base_revision, set.epoch, self.revision, self.epoch, self.have
            );
            *self = DesiredView::default();
            return Err(why);
        }
        for id in &set.removed {
            self.volumes.remove(id);
            self.snapshots.remove(id);
        }
        for v in set.volumes {
            self.volumes.insert(v.id.clone(), v);
        }
        for s in set.snapshots {
            self.snapshots.insert(s.id.clone(), s);
        }
        self.revision = set.revision;
        self.orphan_grace_seconds = set.orphan_grace_seconds;
        self.store_id = set.store_id;
        Ok(())
    }

    /// What to ask the controller for: (revision held, its epoch), or (0, 0) for everything.
    pub fn resume(&self) -> (u64, u64) {
        if self.have { (self.revision, self.epoch) } else { (0, 0) }
    }

    /// The complete set held.
    pub fn set(&self) -> pb::VolumeSet {
        pb::VolumeSet {
            volumes: self.volumes.values().cloned().collect(),
            snapshots: self.snapshots.values().cloned().collect(),
            revision: self.revision,
            orphan_grace_seconds: self.orphan_grace_seconds,
            complete: true,
            epoch: self.epoch,
            store_id: self.store_id.clone(),
            ..Default::default()
        }
    }
}

fn code_of(e: &VolumeError) -> Code {
    match e {
        // No room on this node: the controller's placement was wrong about it.
        VolumeError::CapacityExceeded { .. } => Code::ResourceExhausted,
        e => crate::storage::csi::node::volume_error_code(e),
    }
}

fn waiting(retries: &HashMap<String, Retry>, id: &str) -> Option<pb::VolumeFailure> {
    retries.get(id).filter(|r| Instant::now() < r.next).map(|r| r.failure.clone())
}

/// One copy (a snapshot, a volume from a source) with its backoff: `None` while it backs
/// off (the caller reports its last failure again, [`waiting`]); otherwise its outcome, a
/// held source counting as pending (retried at the next tick).
fn copy_attempt<T>(
    retries: &mut HashMap<String, Retry>,
    pending: &mut bool,
    id: &str,
    copy: impl FnOnce() -> Result<Taken<T>, VolumeError>,
) -> Option<Result<(), VolumeError>> {
    if waiting(retries, id).is_some() {
        return None;
    }
    match copy() {
        Ok(Taken::Done(_)) => {
            retries.remove(id);
            Some(Ok(()))
        }
        Ok(Taken::Busy) => {
            retries.remove(id);
            *pending = true;
            Some(Ok(()))
        }
        Err(e) => {
            let delay = retries.get(id).map_or(RETRY_FIRST, |r| (r.delay * 2).min(RETRY_MAX));
            retries.insert(id.to_string(), Retry { next: Instant::now() + delay, delay, failure: failure_of(id, &e) });
            Some(Err(e))
        }
    }
}

fn failure_of(id: &str, e: &VolumeError) -> pb::VolumeFailure {
    pb::VolumeFailure { id: id.to_string(), code: code_of(e) as i32, message: e.to_string() }
}

/// Why a desired volume could not be converged: the store's error, or a refusal before
/// the store was asked.
#[derive(Debug, thiserror::Error)]
enum SyncError {
    #[error(transparent)]
    Store(#[from] VolumeError),
    #[error("volume {id}: {source}")]
    InvalidBackend { id: String, source: InvalidBackend },
    #[error(
        "volume {id}: {what} is on the {source_backend} backend, the volume asks for {backend} (a volume made from a source is on the source's backend)"
    )]
    SourceBackend { id: String, what: String, source_backend: Backend, backend: Backend },
}

impl SyncError {
    /// The code reported to the controller (a refusal is the request's fault).
    fn code(&self) -> Code {
        match self {
            SyncError::Store(e) => code_of(e),
            SyncError::InvalidBackend { .. } | SyncError::SourceBackend { .. } => Code::InvalidArgument,
        }
    }

    fn failure(&self, id: &str) -> pb::VolumeFailure {
        pb::VolumeFailure { id: id.to_string(), code: self.code() as i32, message: self.to_string() }
    }
}

/// Converge the store on desired volume `d`, which must be present: create it (copying its
/// source, with backoff), grow it, or check what is held is it. `None`: a copy backs off
/// (the caller reports its last failure again).
fn converge_present(
    svc: &NodeService,
    d: &pb::DesiredVolume,
    retries: &mut HashMap<String, Retry>,
    pending: &mut bool,
) -> Option<Result<(), SyncError>> {
    let store = &svc.store;
    let fs = match d.fs_type.parse::<FsType>() {
        Ok(fs) => fs,
        Err(e) => return Some(Err(VolumeError::from(e).into())),
    };
    let backend = match d.backend.parse::<Backend>() {
        Ok(b) => b,
        Err(source) => return Some(Err(SyncError::InvalidBackend { id: d.id.clone(), source })),
    };
    let result = match store.get(&d.id) {
        Ok(None) if d.creating => return create_desired(svc, d, fs, backend, retries, pending),
        // Past creation and gone: report it (the controller shows the volume abnormal);
        // never re-create it empty under a claim that had data.
        Ok(None) => Err(VolumeError::NotFound(d.id.clone())),
        Ok(Some(v)) if v.name != d.name || v.fs_type != fs || v.backend != backend => Err(VolumeError::AlreadyExists {
            id: d.id.clone(),
            existing_size: v.size_bytes,
            existing_fs: v.fs_type,
            requested_size: d.size_bytes,
            requested_fs: fs,
        }),
        Ok(Some(v)) if v.size_bytes < d.size_bytes => store.expand(&d.id, d.size_bytes).map(|_| ()),
        Ok(Some(_)) => Ok(()),
        Err(e) => Err(e),
    };
    Some(result.map_err(SyncError::from))
}

/// Create desired volume `d` on `backend`: empty, or as a copy of its source (which must be
/// on the same backend). `None` as for [`converge_present`].
fn create_desired(
    svc: &NodeService,
    d: &pb::DesiredVolume,
    fs: FsType,
    backend: Backend,
    retries: &mut HashMap<String, Retry>,
    pending: &mut bool,
) -> Option<Result<(), SyncError>> {
    let Some(src) = source_of(d) else {
        return Some(svc.store.create_on(backend, &d.id, d.size_bytes, fs, &d.name).map(|_| ()).map_err(Into::into));
    };
    if let Err(e) = check_source_backend(&svc.store, &d.id, &src, backend) {
        return Some(Err(e));
    }
    copy_attempt(retries, pending, &d.id, || svc.create_volume_from(&d.id, d.size_bytes, &d.name, &src))
        .map(|r| r.map_err(Into::into))
}

/// Refuse a volume `id` on `backend` made from `src` when the store holds the source on
/// another backend. A source the store does not hold passes: the copy reports it missing.
fn check_source_backend(store: &VolumeStore, id: &str, src: &Source, backend: Backend) -> Result<(), SyncError> {
    let held = match src {
        Source::Snapshot(s) => store.get_snapshot(s)?.map(|s| s.backend),
        Source::Volume(v) => store.get(v)?.map(|v| v.backend),
    };
    match held {
        Some(b) if b != backend => {
            Err(SyncError::SourceBackend { id: id.to_string(), what: src.to_string(), source_backend: b, backend })
        }
        _ => Ok(()),
    }
}

/// Every backend the store has and its room: `file` always, `lvm` with a thin pool (left
/// out, with a warning, while the pool cannot be read: nothing new is placed on it then).
fn backend_capacities(store: &VolumeStore) -> Vec<pb::BackendCapacity> {
    let file = pb::BackendCapacity {
        backend: Backend::File.as_str().to_string(),
        capacity_bytes: store.capacity(),
        available_bytes: store.available(),
        short: false,
    };
    // `capacity_of(Lvm)` is the pool's usage: read it once, with its `short`.
    let lvm = match store.pool_usage() {
        Ok(u) => u.map(|u| pb::BackendCapacity {
            backend: Backend::Lvm.as_str().to_string(),
            capacity_bytes: u.capacity_bytes,
            available_bytes: u.available_bytes,
            short: u.short,
        }),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the lvm thin pool's usage; not offering it");
            None
        }
    };
    std::iter::once(file).chain(lvm).collect()
}

/// The content source a desired volume names, if any.
fn source_of(d: &pb::DesiredVolume) -> Option<Source> {
    if !d.source_snapshot_id.is_empty() {
        Some(Source::Snapshot(d.source_snapshot_id.clone()))
    } else if !d.source_volume_id.is_empty() {
        Some(Source::Volume(d.source_volume_id.clone()))
    } else {
        None
    }
}

/// Whether an orphan may be reclaimed: the controller made it (it carries a CSI name), and
/// the store the set comes from listed it before. One made on the node directly, or known
/// only to a controller store that was lost since (whose successor never knew it, so its
/// PV may still be bound), is kept and reported.
fn reclaimable(name: &str, owner: &str, set: &pb::VolumeSet) -> bool {
    !name.is_empty() && !owner.is_empty() && owner == set.store_id
}

/// Since when `key` (a `what`) has been an orphan. One that is `kept` is logged once, when
/// first seen.
fn orphaned_since(first: &mut HashMap<String, Instant>, key: &str, what: &str, kept: bool, store: &str) -> Instant {
    *first.entry(key.to_string()).or_insert_with(|| {
        if kept {
            tracing::warn!(orphan = %key, %store, "orphan {what} kept: not made under the controller's store");
        }
        Instant::now()
    })
}

/// Record that the set's store lists volume `d` ([`crate::storage::store::Volume::controller_store`]),
/// once the node holds it under the same name.
fn own_volume(store: &VolumeStore, d: &pb::DesiredVolume, owner: &str) -> Result<(), SyncError> {
    match store.get(&d.id)? {
        Some(v) if !owner.is_empty() && v.name == d.name && v.controller_store != owner => {
            Ok(store.set_controller_store(&d.id, owner)?)
        }
        _ => Ok(()),
    }
}

/// What the volume client remembers between passes.
#[derive(Default)]
struct SyncState {
    /// Since when each orphan (volume id, or `snapshot/<id>`) has been one.
    first_orphaned: HashMap<String, Instant>,
    /// Copies (snapshots, volumes from a source) that failed: not tried again before
    /// `next` (each attempt may freeze a filesystem and copy gigabytes), their failure
    /// reported meanwhile.
    retries: HashMap<String, Retry>,
}

struct Retry {
    next: Instant,
    delay: Duration,
    failure: pb::VolumeFailure,
}

const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// Converge the store on `set`; returns the report to send. Volumes another operation holds
/// right now are skipped (retried at the next tick); `pending` says whether any were.
fn reconcile(
    svc: &NodeService,
    set: &pb::VolumeSet,
    state: &mut SyncState,
    node: &str,
) -> (pb::ReportVolumesRequest, bool) {
    let first_orphaned = &mut state.first_orphaned;
    let retries = &mut state.retries;
    let store = &svc.store;
    store.remove_leftover_lvs();
    let mut failures = Vec::new();
    let mut pending = false;
    for d in &set.volumes {
        let Ok(_guard) = svc.guard(&d.id) else {
            pending = true;
            continue;
        };
        let result = if d.present {
            match converge_present(svc, d, retries, &mut pending) {
                Some(r) => r.and_then(|()| own_volume(store, d, &set.store_id)),
                None => {
                    failures.extend(waiting(retries, &d.id));
                    continue;
                }
            }
        } else {
            match store.get(&d.id) {
                // Someone else's volume under this id: not ours to delete.
                Ok(Some(v)) if v.name != d.name => Ok(()),
                Ok(Some(_)) => store.delete(&d.id),
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            }
            .map_err(SyncError::from)
        };
        if let Err(e) = result {
            tracing::warn!(volume = %d.id, present = d.present, error = %e, "could not converge volume");
            failures.push(e.failure(&d.id));
        }
    }
    for d in &set.snapshots {
        let result = if d.present {
            match store.get_snapshot(&d.id) {
                Ok(None) if d.creating => match copy_attempt(retries, &mut pending, &d.id, || {
                    svc.take_snapshot(&d.id, &d.source_volume_id, &d.name)
                }) {
                    Some(r) => r,
                    None => {
                        failures.extend(waiting(retries, &d.id));
                        continue;
                    }
                },
                // Past creation and gone: reported missing, never re-taken from newer data.
                Ok(None) => Err(VolumeError::NotFound(format!("snapshot {}", d.id))),
                Ok(Some(s)) if s.name != d.name || s.source_volume != d.source_volume_id => {
                    Err(VolumeError::SnapshotExists { id: d.id.clone(), volume: s.source_volume, name: s.name })
                }
                Ok(Some(_)) if set.store_id.is_empty() => Ok(()),
                Ok(Some(_)) => store.set_snapshot_controller_store(&d.id, &set.store_id),
                Err(e) => Err(e),
            }
        } else {
            match store.get_snapshot(&d.id) {
                Ok(Some(s)) if s.name != d.name => Ok(()),
                Ok(Some(_)) => store.delete_snapshot(&d.id),
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            }
        };
        if let Err(e) = result {
            tracing::warn!(snapshot = %d.id, present = d.present, error = %e, "could not converge snapshot");
            failures.push(failure_of(&d.id, &e));
        }
    }
    // Backoffs of copies no longer asked for are dropped.
    retries.retain(|id, _| set.snapshots.iter().any(|d| &d.id == id) || set.volumes.iter().any(|d| &d.id == id));
    // Orphans: held, not listed.
    let grace = Duration::from_secs(set.orphan_grace_seconds);
    let listed: std::collections::HashSet<&str> = set.volumes.iter().map(|d| d.id.as_str()).collect();
    let bound = loopdev::bound_devices().unwrap_or_default();
    let attached = |path: &std::path::Path| bound.iter().any(|b| b.backing_file == path);
    let mut orphans = Vec::new();
    let held = store.list();
    let held_snaps = store.list_snapshots();
    first_orphaned.retain(|key, _| match key.strip_prefix("snapshot/") {
        Some(id) => held_snaps.iter().any(|s| s.id == id) && !set.snapshots.iter().any(|d| d.id == id),
        None => held.iter().any(|v| &v.id == key) && !listed.contains(key.as_str()),
    });
    for v in &held {
        if listed.contains(v.id.as_str()) {
            continue;
        }
        let keep = !reclaimable(&v.name, &v.controller_store, set);
        let since = orphaned_since(first_orphaned, &v.id, "volume", keep, &v.controller_store);
        if !keep
            && since.elapsed() >= grace
            && !attached(&v.path)
            && let Ok(_g) = svc.guard(&v.id)
        {
            match store.delete(&v.id) {
                Ok(()) => {
                    tracing::warn!(volume = %v.id, grace_s = grace.as_secs(), "reclaimed an orphan volume the controller does not know");
                    first_orphaned.remove(&v.id);
                    continue;
                }
                Err(e) => tracing::warn!(volume = %v.id, error = %e, "could not reclaim orphan volume"),
            }
        }
        orphans.push(v.id.clone());
    }
    // Snapshots the set does not list: kept for the grace period, then reclaimed (as
    // volumes).
    let listed_snaps: std::collections::HashSet<&str> = set.snapshots.iter().map(|d| d.id.as_str()).collect();
    for s in store.list_snapshots() {
        if listed_snaps.contains(s.id.as_str()) {
            continue;
        }
        let key = format!("snapshot/{}", s.id);
        let keep = !reclaimable(&s.name, &s.controller_store, set);
        let since = orphaned_since(first_orphaned, &key, "snapshot", keep, &s.controller_store);
        if !keep && since.elapsed() >= grace {
            match store.delete_snapshot(&s.id) {
                Ok(()) => {
                    tracing::warn!(snapshot = %s.id, grace_s = grace.as_secs(), "reclaimed an orphan snapshot the controller does not know");
                    first_orphaned.remove(&key);
                    continue;
                }
                Err(e) => tracing::warn!(snapshot = %s.id, error = %e, "could not reclaim orphan snapshot"),
            }
        }
        orphans.push(format!("snapshot/{}", s.id));
    }
    let volumes = store
        .list()
        .into_iter()
        .map(|v| pb::VolumeState {
            id: v.id.clone(),
            size_bytes: v.size_bytes,
            fs_type: v.fs_type.as_str().to_string(),
            backing_file_present: v.path.exists(),
            attached: attached(&v.path),
            name: v.name.clone(),
            backend: v.backend.as_str().to_string(),
        })
        .collect();
    (
        pb::ReportVolumesRequest {
            node_name: node.to_string(),
            capacity_bytes: store.capacity(),
            available_bytes: store.available(),
            volumes,
            failures,
            orphans,
            revision: set.revision,
            snapshots: store
                .list_snapshots()
                .into_iter()
                .map(|s| pb::SnapshotState {
                    id: s.id,
                    source_volume_id: s.source_volume,
                    size_bytes: s.size_bytes,
                    name: s.name,
                    created_at: s.created_at as i64,
                    fs_type: s.fs_type.as_str().to_string(),
                    method: s.method,
                    bytes_copied: s.bytes_copied,
                })
                .collect(),
            backends: backend_capacities(store),
        },
        pending,
    )
}

async fn session(
    cfg: &Config,
    cc: &ControllerConfig,
    svc: &Arc<NodeService>,
    first_orphaned: &mut SyncState,
    view: &mut DesiredView,
    connected: &mut bool,
) -> Result<(), String> {
    let (token, channel) = open(cc).await.map_err(|e| e.to_string())?;
    let mut client = NodeRegistryClient::new(channel);
    let node = cfg.node_name.clone();
    let (since_revision, epoch) = view.resume();
    let req = pb::WatchVolumesRequest { node_name: node.clone(), deltas: true, since_revision, epoch };
    let mut stream = client
        .watch_volumes(token.authed(req))
        .await
        .map_err(|s| format!("watch volumes: {:?}: {}", s.code(), s.message()))?
        .into_inner();
    *connected = true;
    let mut last: Option<pb::VolumeSet> = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut since_report = Instant::now();
    let mut pending = false;
    loop {
        let periodic = tokio::select! {
            m = stream.message() => {
                match m {
                    // A view that cannot take the message is dropped: watch again from nothing.
                    Ok(Some(set)) => {
                        view.apply(set)?;
                        last = Some(view.set());
                    }
                    Ok(None) => return Err("controller closed the volume stream".into()),
                    Err(s) => return Err(format!("volume stream: {:?}: {}", s.code(), s.message())),
                }
                false
            }
            _ = tick.tick() => true,
        };
        let Some(set) = last.clone() else { continue };
        // Periodic passes: retry skipped volumes at once, orphans and capacity every few s.
        let grace_half =
            Duration::from_secs(set.orphan_grace_seconds / 2).clamp(Duration::from_secs(1), Duration::from_secs(5));
        if periodic && !pending && since_report.elapsed() < grace_half {
            continue;
        }
        let s = svc.clone();
        let mut fo = std::mem::take(first_orphaned);
        let n = node.clone();
        let (report, p, fo) = tokio::task::spawn_blocking(move || {
            let (r, p) = reconcile(&s, &set, &mut fo, &n);
            (r, p, fo)
        })
        .await
        .map_err(|e| e.to_string())?;
        *first_orphaned = fo;
        pending = p;
        client
            .report_volumes(token.authed(report))
            .await
            .map_err(|s| format!("report volumes: {:?}: {}", s.code(), s.message()))?;
        since_report = Instant::now();
    }
}

/// Run the volume client forever (reconnecting with backoff), once the node service is ready.
pub async fn run(cfg: Arc<Config>, svc: Arc<NodeService>) {
    let Some(cc) = cfg.controller.clone() else { return };
    while !svc.ready() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut first_orphaned = SyncState::default();
    let mut view = DesiredView::default();
    let mut backoff = Backoff::new();
    loop {
        let mut connected = false;
        if let Err(e) = session(&cfg, &cc, &svc, &mut first_orphaned, &mut view, &mut connected).await {
            tracing::warn!(error = %e, "controller volume session ended");
        }
        backoff.pause(connected).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(id: &str, size: u64) -> pb::DesiredVolume {
        pb::DesiredVolume { id: id.into(), size_bytes: size, present: true, name: id.into(), ..Default::default() }
    }

    /// A node service over a store of 1 GiB on the fake kernel, without an lvm pool.
    fn node(tag: &str) -> (crate::util::TestDir, NodeService) {
        let dir = crate::util::TestDir::new(&format!("volume-sync-{tag}"));
        let fake = Arc::new(crate::sys::fake_volume::FakeKernel::new());
        let store = VolumeStore::open_with(&dir.0.join("volumes"), 1 << 30, fake).unwrap();
        let settings = crate::storage::csi::node::NodeSettings {
            node_id: "n1".into(),
            kubelet_dir: dir.0.join("kubelet"),
            record_dir: dir.0.join("state/csi"),
            max_volumes: 8,
        };
        let svc = NodeService::new(settings, Arc::new(store)).unwrap();
        (dir, svc)
    }

    fn creating(id: &str, backend: &str) -> pb::DesiredVolume {
        pb::DesiredVolume { creating: true, fs_type: "ext4".into(), backend: backend.into(), ..vol(id, 1 << 20) }
    }

    fn failure<'a>(r: &'a pb::ReportVolumesRequest, id: &str) -> Option<&'a pb::VolumeFailure> {
        r.failures.iter().find(|f| f.id == id)
    }

    #[test]
    fn volumes_are_made_on_the_backend_the_controller_names() {
        let (_d, svc) = node("backend");
        let set = pb::VolumeSet {
            volumes: vec![
                creating("plain", ""),
                creating("file", "file"),
                creating("bad", "zfs"),
                creating("thin", "lvm"),
                pb::DesiredVolume { source_volume_id: "file".into(), ..creating("copy", "lvm") },
            ],
            revision: 3,
            ..Default::default()
        };
        let (r, _) = reconcile(&svc, &set, &mut SyncState::default(), "n1");
        let held: Vec<(String, Backend)> = svc.store.list().into_iter().map(|v| (v.id, v.backend)).collect();
        assert_eq!(held, vec![("file".to_string(), Backend::File), ("plain".to_string(), Backend::File)]);
        // An unknown backend: refused before the store is asked.
        let bad = failure(&r, "bad").unwrap();
        assert_eq!(bad.code, Code::InvalidArgument as i32);
        assert!(bad.message.contains("invalid volume backend \"zfs\""), "{}", bad.message);
        // lvm without a pool on this node: the store says so.
        let thin = failure(&r, "thin").unwrap();
        assert_eq!(thin.code, Code::FailedPrecondition as i32);
        assert!(thin.message.contains("lvm backend is not configured"), "{}", thin.message);
        // A copy asking for another backend than its source's: refused, nothing copied.
        let copy = failure(&r, "copy").unwrap();
        assert_eq!(copy.code, Code::InvalidArgument as i32);
        assert!(
            copy.message.contains("volume file is on the file backend, the volume asks for lvm"),
            "{}",
            copy.message
        );
        // The report: each volume's backend, and the backends the node has (file only).
        assert!(r.volumes.iter().all(|v| v.backend == "file"), "{:?}", r.volumes);
        assert_eq!(
            r.backends,
            vec![pb::BackendCapacity {
                backend: "file".into(),
                capacity_bytes: 1 << 30,
                available_bytes: (1 << 30) - (2 << 20),
                short: false,
            }]
        );
        assert_eq!((r.capacity_bytes, r.available_bytes), (1 << 30, (1 << 30) - (2 << 20)));
        // A held volume the controller now places on another backend is not it.
        let moved = pb::VolumeSet { volumes: vec![creating("file", "lvm")], ..set };
        let (r, _) = reconcile(&svc, &moved, &mut SyncState::default(), "n1");
        assert_eq!(failure(&r, "file").unwrap().code, Code::AlreadyExists as i32);
    }

    #[test]
    fn orphans_go_only_when_the_store_that_listed_them_drops_them() {
        let (_d, svc) = node("owner");
        let mut state = SyncState::default();
        let set = |store: &str, volumes: Vec<pb::DesiredVolume>, snapshots: Vec<pb::DesiredSnapshot>| pb::VolumeSet {
            volumes,
            snapshots,
            store_id: store.into(),
            ..Default::default()
        };
        let snap = pb::DesiredSnapshot {
            id: "s".into(),
            source_volume_id: "a".into(),
            name: "snap".into(),
            present: true,
            creating: true,
        };
        let owner = |id: &str| svc.store.get(id).unwrap().map(|v| v.controller_store);
        let snap_owner = || svc.store.get_snapshot("s").unwrap().map(|s| s.controller_store);
        let s1 = set("s1", vec![creating("a", ""), creating("b", "")], vec![snap.clone()]);
        for _ in 0..2 {
            let (r, _) = reconcile(&svc, &s1, &mut state, "n1");
            assert!(r.failures.is_empty(), "{:?}", r.failures);
        }
        assert_eq!((owner("a"), owner("b"), snap_owner()), (Some("s1".into()), Some("s1".into()), Some("s1".into())));
        // An older controller (no store) lists them: their store stays.
        let old = pb::VolumeSet { store_id: String::new(), ..s1.clone() };
        reconcile(&svc, &old, &mut state, "n1");
        assert_eq!(owner("a"), Some("s1".into()));
        // The controller's store made again (s2) lists nothing: all kept past the grace (0 s).
        for _ in 0..2 {
            let (r, _) = reconcile(&svc, &set("s2", vec![], vec![]), &mut state, "n1");
            assert_eq!(r.orphans, vec!["a", "b", "snapshot/s"]);
        }
        // s2 lists `a` and the snapshot, which become its own; s2 drops them: reclaimed.
        reconcile(&svc, &set("s2", vec![creating("a", "")], vec![snap]), &mut state, "n1");
        assert_eq!((owner("a"), snap_owner()), (Some("s2".into()), Some("s2".into())));
        let (r, _) = reconcile(&svc, &set("s2", vec![], vec![]), &mut state, "n1");
        assert_eq!((owner("a"), snap_owner()), (None, None));
        assert_eq!(r.orphans, vec!["b"]);
        // A set without a store reclaims nothing.
        let (r, _) = reconcile(&svc, &set("", vec![], vec![]), &mut state, "n1");
        assert_eq!((r.orphans, owner("b")), (vec!["b".to_string()], Some("s1".into())));
        // The store that made `b` (s1) is back and no longer lists it: reclaimed.
        let (r, _) = reconcile(&svc, &set("s1", vec![], vec![]), &mut state, "n1");
        assert_eq!((r.orphans, owner("b")), (Vec::<String>::new(), None));
    }

    fn ids(v: &DesiredView) -> Vec<(String, u64)> {
        v.set().volumes.into_iter().map(|d| (d.id, d.size_bytes)).collect()
    }

    #[test]
    fn the_view_takes_complete_sets_and_deltas_in_order_only() {
        let mut v = DesiredView::default();
        assert_eq!(v.resume(), (0, 0));
        // A delta without a complete set first is refused.
        let delta =
            pb::VolumeSet { volumes: vec![vol("c", 1)], revision: 9, base_revision: 7, epoch: 5, ..Default::default() };
        assert!(v.apply(delta.clone()).is_err());
        let full = pb::VolumeSet {
            volumes: vec![vol("a", 1), vol("b", 2)],
            revision: 7,
            epoch: 5,
            complete: true,
            ..Default::default()
        };
        v.apply(full).unwrap();
        assert_eq!(v.resume(), (7, 5));
        let delta = pb::VolumeSet { removed: vec!["a".into()], volumes: vec![vol("b", 3), vol("c", 1)], ..delta };
        v.apply(delta.clone()).unwrap();
        assert_eq!(ids(&v), vec![("b".to_string(), 3), ("c".to_string(), 1)]);
        assert_eq!(v.resume(), (9, 5));
        // The same delta again (a repeat) or one of another epoch: dropped, start over.
        let mut again = v.clone();
        assert!(again.apply(delta.clone()).unwrap_err().contains("does not apply"));
        assert_eq!((again.resume(), ids(&again)), ((0, 0), vec![]));
        let other = pb::VolumeSet { epoch: 6, base_revision: 9, revision: 10, ..Default::default() };
        assert!(v.clone().apply(other).is_err());
        // An older controller (no epoch): every message is complete.
        let old = pb::VolumeSet { volumes: vec![vol("z", 4)], revision: 3, ..Default::default() };
        v.apply(old).unwrap();
        assert_eq!(ids(&v), vec![("z".to_string(), 4)]);
        assert_eq!(v.resume(), (3, 0));
    }
}
