//! CSI Identity + Controller on the controller's CSI socket, as `external-provisioner` and
//! `external-resizer` call them. Volumes are node-local: CreateVolume places each on a node
//! (topology `topology.csi.nodeplane.dev/node`) and has that node's agent create it through
//! the volume stream (`VolumeBook`), answering once the node reported it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tonic::{Code, Request, Response, Status};

use super::keys::{self, KeyStore};
use super::records::{StoreBackend, VolState, VolumeRecord};
use super::volumes::{
    BookError, ContentSource, NodeView, Placement, VolumeBook, failure_since, held, held_snapshot, volume_id_for,
};
use crate::rpc::csi;
use crate::storage::csi::{TOPOLOGY_KEY, capability};
use crate::storage::fs::FsType;

/// Every error of this service is a `Status`; the volume book's errors get their code from
/// [`BookError::code`].
fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg)
}

/// Size of a volume when the request names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

pub struct ControllerService {
    pub book: Arc<VolumeBook>,
    /// How long one call waits for a node before answering DEADLINE_EXCEEDED.
    pub op_timeout: Duration,
    /// The encrypted volumes' keys.
    pub keys: Arc<KeyStore>,
}

/// Whether a volume record was made encrypted (its class's `encryption: luks2`).
fn is_encrypted(v: &VolumeRecord) -> bool {
    v.parameters.get(keys::ENCRYPTION_PARAMETER).map(String::as_str) == Some(keys::LUKS2)
}

/// A volume made from `src` (a snapshot or volume, `what`) is encrypted exactly when its
/// source is. An encrypted source's blocks are a LUKS2 container, which a class without
/// encryption would hand to the pod as it is. An unencrypted source's blocks hold a
/// filesystem in clear: the node never encrypts a device in place (it refuses a device
/// holding anything but LUKS2), and the clear blocks would stay readable where the copy
/// lives.
fn check_copy_encryption(what: &ContentSource, src: &VolumeRecord, encrypted: bool) -> Result<(), Status> {
    match (is_encrypted(src), encrypted) {
        (true, false) => Err(invalid(format!(
            "{what} is encrypted; a volume made from it needs a class with {}: {}",
            keys::ENCRYPTION_PARAMETER,
            keys::LUKS2
        ))),
        (false, true) => Err(invalid(format!(
            "{what} is not encrypted; a class with {}: {} cannot make a volume from it (its blocks hold data in \
             clear, and the node does not encrypt a device in place)",
            keys::ENCRYPTION_PARAMETER,
            keys::LUKS2
        ))),
        _ => Ok(()),
    }
}

/// A key store failure as UNAVAILABLE (the CO retries), or FAILED_PRECONDITION for a
/// copy whose source has no key.
fn key_error(e: keys::KeyError) -> Status {
    match e {
        keys::KeyError::SourceMissing { .. } => Status::failed_precondition(e.to_string()),
        e => Status::unavailable(e.to_string()),
    }
}

/// A deleted volume's or snapshot's key not removed: UNAVAILABLE, so the CO retries the
/// delete, which removes it ([`ControllerService::remove_left_key`]).
fn key_left(id: &str, e: keys::KeyError) -> Status {
    Status::unavailable(format!("{id} is deleted but its key is not removed yet: {e}; retry"))
}

/// What the volume capabilities of a request ask a volume to hold (the reading the node
/// shares, `storage::csi::capability`); every refusal is INVALID_ARGUMENT here.
fn check_capabilities(caps: &[csi::VolumeCapability], fs_param: Option<&str>) -> Result<FsType, Status> {
    capability::volume_kind(caps, fs_param).map_err(|e| invalid(e.to_string()))
}

/// The filesystem a StorageClass asks for (`csi.storage.k8s.io/fstype` or `fsType`).
fn fs_parameter(p: &std::collections::HashMap<String, String>) -> Option<&str> {
    p.get("csi.storage.k8s.io/fstype").or_else(|| p.get("fsType")).map(String::as_str)
}

/// The StorageClass parameter that picks the node store's backend.
pub const BACKEND_PARAMETER: &str = "backend";

/// The store backend a StorageClass asks for (`backend`: "file", the default, or "lvm");
/// any other value is INVALID_ARGUMENT.
fn backend_parameter(p: &std::collections::HashMap<String, String>) -> Result<StoreBackend, Status> {
    let Some(v) = p.get(BACKEND_PARAMETER) else { return Ok(StoreBackend::File) };
    v.parse().map_err(|e| invalid(format!("parameter {BACKEND_PARAMETER:?}: {e}")))
}

/// A volume made from `src` (the record of `what`) must be on its backend.
fn check_source_backend(what: &ContentSource, src: &VolumeRecord, backend: StoreBackend) -> Result<(), Status> {
    if src.backend == backend {
        return Ok(());
    }
    Err(invalid(format!(
        "{what} is on the {} backend; a volume made from it must be too (the request asks for {backend})",
        src.backend
    )))
}

/// The smallest filesystem `mkfs.xfs` (xfsprogs 6) makes: a smaller xfs volume could be
/// created but never staged.
pub const XFS_MIN_SIZE: u64 = 300 * MIB;

/// The smallest volume of `fs` the node can stage: [`XFS_MIN_SIZE`] for xfs, else 1 MiB,
/// and with encryption the LUKS2 header on top.
fn min_size(fs: FsType, encrypted: bool) -> u64 {
    let data = if fs == FsType::Xfs { XFS_MIN_SIZE } else { MIB };
    data + if encrypted { LUKS2_HEADER } else { 0 }
}

/// [`size_for`], raised to [`min_size`] when the range allows it (OUT_OF_RANGE when
/// `limit_bytes` forbids the minimum).
pub fn size_for_fs(range: Option<&csi::CapacityRange>, fs: FsType, encrypted: bool) -> Result<u64, Status> {
    let size = size_for(range)?;
    let min = min_size(fs, encrypted);
    if size >= min {
        return Ok(size);
    }
    let lim = range.map_or(0, |r| r.limit_bytes.max(0) as u64);
    if lim > 0 && lim < min {
        let why = if fs == FsType::Xfs { "mkfs.xfs refuses smaller" } else { "the LUKS2 header takes 2 MiB" };
        let kind = if encrypted { "encrypted volumes" } else { "volumes" };
        let fs = if fs == FsType::Raw { "block" } else { fs.as_str() };
        return Err(Status::out_of_range(format!(
            "{fs} {kind} need at least {min} bytes ({why}); limit_bytes is {lim}"
        )));
    }
    Ok(min)
}

/// What the agent's LUKS2 header takes of an encrypted volume (`src/sys/crypt.rs`).
pub const LUKS2_HEADER: u64 = 2 * MIB;

/// Turn a capacity range into a size: whole MiB, at least the required bytes, within the
/// limit (OUT_OF_RANGE when rounding cannot fit), DEFAULT_SIZE (capped by the limit) when
/// nothing is required.
pub fn size_for(range: Option<&csi::CapacityRange>) -> Result<u64, Status> {
    let (req, lim) = match range {
        Some(r) => (r.required_bytes, r.limit_bytes),
        None => (0, 0),
    };
    if req < 0 || lim < 0 {
        return Err(invalid("capacity_range must not be negative"));
    }
    let (req, lim) = (req as u64, lim as u64);
    if lim > 0 && req > lim {
        return Err(Status::out_of_range(format!("required_bytes {req} exceeds limit_bytes {lim}")));
    }
    let want = if req == 0 { if lim > 0 { lim.min(DEFAULT_SIZE) } else { DEFAULT_SIZE } } else { req };
    let size = want.div_ceil(MIB).saturating_mul(MIB);
    if lim > 0 && size > lim {
        // Round down instead when that still meets the requirement.
        let down = lim / MIB * MIB;
        if down >= req.max(1) && down > 0 {
            return Ok(down);
        }
        return Err(Status::out_of_range(format!("volumes are whole MiB: no size in [{req}, {lim}] bytes")));
    }
    Ok(size)
}

fn topology_of(node: &str) -> csi::Topology {
    csi::Topology { segments: [(TOPOLOGY_KEY.to_string(), node.to_string())].into_iter().collect() }
}

/// The node a topology names, if it is one of ours (every segment must be known).
fn node_of(t: &csi::Topology) -> Option<String> {
    if t.segments.len() != 1 {
        return None;
    }
    t.segments.get(TOPOLOGY_KEY).cloned()
}

fn to_csi(v: &VolumeRecord) -> csi::Volume {
    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let mut ctx = std::collections::HashMap::new();
    ctx.insert("fsType".to_string(), v.fs_type.as_str().to_string());
    ctx.insert("node".to_string(), v.node.clone());
    if is_encrypted(v) {
        ctx.insert(keys::ENCRYPTION_CONTEXT.to_string(), keys::LUKS2.to_string());
    }
    let source = if !v.source_snapshot.is_empty() {
        Some(Type::Snapshot(SnapshotSource { snapshot_id: v.source_snapshot.clone() }))
    } else if !v.source_volume.is_empty() {
        Some(Type::Volume(VolumeSource { volume_id: v.source_volume.clone() }))
    } else {
        None
    };
    csi::Volume {
        capacity_bytes: v.size_bytes as i64,
        volume_id: v.id.clone(),
        volume_context: ctx,
        content_source: source.map(|t| csi::VolumeContentSource { r#type: Some(t) }),
        accessible_topology: vec![topology_of(&v.node)],
    }
}

fn content_source_of(c: &csi::VolumeContentSource) -> Result<ContentSource, Status> {
    use csi::volume_content_source::Type;
    match &c.r#type {
        Some(Type::Snapshot(s)) if !s.snapshot_id.is_empty() => Ok(ContentSource::Snapshot(s.snapshot_id.clone())),
        Some(Type::Volume(v)) if !v.volume_id.is_empty() => Ok(ContentSource::Volume(v.volume_id.clone())),
        Some(Type::Snapshot(_)) => Err(invalid("volume_content_source.snapshot.snapshot_id is required")),
        Some(Type::Volume(_)) => Err(invalid("volume_content_source.volume.volume_id is required")),
        None => Err(invalid("volume_content_source names neither a snapshot nor a volume")),
    }
}

/// Whether snapshot `v` is complete on its node.
fn snapshot_ready(v: &VolumeRecord, view: Option<&NodeView>) -> bool {
    v.state == VolState::Ready && held_snapshot(view, v).is_some()
}

/// A snapshot record as CSI shows it; `ready` when the node holds it complete.
fn snapshot_to_csi(v: &VolumeRecord, ready: bool) -> csi::Snapshot {
    csi::Snapshot {
        size_bytes: v.size_bytes as i64,
        snapshot_id: v.id.clone(),
        source_volume_id: v.source_volume.clone(),
        creation_time: Some(crate::rpc::Timestamp { seconds: v.created_at as i64, nanos: 0 }),
        ready_to_use: ready,
        group_snapshot_id: String::new(),
    }
}

fn unimplemented<T>(what: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!("{what} is not supported by csi.nodeplane.dev")))
}

impl ControllerService {
    /// Run a volume book change off the async workers (the backend commits synchronously).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&VolumeBook) -> Result<T, BookError> + Send + 'static,
    ) -> Result<T, Status> {
        let book = self.book.clone();
        Ok(crate::rpc::blocking(move || f(&book)).await??)
    }

    /// Wait until volume `id` is on its node at `size` or more (Ready), or the node failed it.
    async fn await_present(&self, id: &str, size: u64, since: u64) -> Result<VolumeRecord, Status> {
        self.await_held("volume", id, since, |view, v| held(view, v).is_some_and(|h| h.size_bytes >= size)).await
    }

    /// Wait until record `id` (a `what`: volume or snapshot) is Ready and its node holds it
    /// as `holds` says, or the node failed it.
    async fn await_held(
        &self,
        what: &str,
        id: &str,
        since: u64,
        holds: impl Fn(Option<&NodeView>, &VolumeRecord) -> bool,
    ) -> Result<VolumeRecord, Status> {
        self.book
            .wait(self.op_timeout, |_, nodes, vols| {
                let Some(v) = vols.get(id) else {
                    return Some(Err(Status::aborted(format!("{what} {id} was deleted meanwhile"))));
                };
                let view = nodes.get(&v.node);
                if let Some(f) = failure_since(view, id, since) {
                    return Some(Err(f.into()));
                }
                if v.state == VolState::Ready && holds(view, v) {
                    return Some(Ok(v.clone()));
                }
                if view.is_none_or(|n| n.connected == 0) {
                    return Some(Err(Status::unavailable(format!("node {} is not connected; retry", v.node))));
                }
                None
            })
            .await
    }

    async fn do_create_volume(&self, r: csi::CreateVolumeRequest) -> Result<csi::CreateVolumeResponse, Status> {
        if r.name.is_empty() {
            return Err(invalid("name is required"));
        }
        if r.name.len() > 128 {
            return Err(invalid("name is longer than 128 bytes"));
        }
        if r.volume_capabilities.is_empty() {
            return Err(invalid("volume_capabilities is required"));
        }
        // A source that does not exist is NOT_FOUND before the other argument checks.
        let source = r.volume_content_source.as_ref().map(content_source_of).transpose()?;
        // A retry of a volume made from a source that is gone since finds the volume.
        let existing = self.book.by_name(&r.name);
        let source_rec = match (&source, &existing) {
            (Some(s), None) => Some(self.book.source(s)?),
            (Some(s), Some(e)) => Some(self.book.source(s).unwrap_or_else(|_| e.clone())),
            (None, _) => None,
        };
        let mut fs = check_capabilities(&r.volume_capabilities, fs_parameter(&r.parameters))?;
        let backend = backend_parameter(&r.parameters)?;
        let encrypted = keys::encryption_parameter(&r.parameters).map_err(invalid)?;
        if let (Some(what), Some(src)) = (&source, &source_rec) {
            check_source_backend(what, src, backend)?;
            check_copy_encryption(what, src, encrypted)?;
        }
        if encrypted && matches!(*self.keys, KeyStore::Secrets { .. }) {
            keys::secret_name(&r.name).map_err(|e| invalid(e.to_string()))?;
        }
        if let Some(src) = &source_rec {
            // A copy holds the source's filesystem: unless the request names another one
            // (refused), the volume is of the source's type; block and filesystem volumes
            // do not convert into each other.
            let named = fs_parameter(&r.parameters).is_some()
                || r.volume_capabilities.iter().any(|c| matches!(&c.access_type, Some(csi::volume_capability::AccessType::Mount(m)) if !m.fs_type.is_empty()));
            if fs.is_raw() != src.fs_type.is_raw() || (named && fs != src.fs_type) {
                return Err(invalid(format!(
                    "{} holds {:?}; the request asks for {:?} (a volume made from it holds the same)",
                    source.as_ref().unwrap(),
                    src.fs_type.as_str(),
                    fs.as_str()
                )));
            }
            fs = src.fs_type;
        }
        let mut size = size_for_fs(r.capacity_range.as_ref(), fs, encrypted)?;
        if let Some(src) = &source_rec {
            let required = r.capacity_range.as_ref().map_or(0, |c| c.required_bytes.max(0) as u64);
            let limit = r.capacity_range.as_ref().map_or(0, |c| c.limit_bytes.max(0) as u64);
            // Nothing asked, or less than the source holds: the source's size.
            if required == 0 || size < src.size_bytes {
                if limit > 0 && limit < src.size_bytes {
                    return Err(Status::out_of_range(format!(
                        "{} holds {} bytes; limit_bytes {limit} is smaller",
                        source.as_ref().unwrap(),
                        src.size_bytes
                    )));
                }
                size = src.size_bytes;
            }
        }
        let mut placement = Placement { backend, ..Default::default() };
        if let Some(t) = &r.accessibility_requirements {
            for (i, top) in t.requisite.iter().enumerate() {
                // A requisite topology we do not know cannot be satisfied by any node.
                placement.requisite.push(node_of(top).unwrap_or_else(|| format!("\0unknown-{i}")));
            }
            placement.preferred = t.preferred.iter().filter_map(node_of).collect();
        }
        let params: BTreeMap<String, String> = r.parameters.clone().into_iter().collect();
        let (name, fs2, pl, src2, p) = (r.name.clone(), fs, placement.clone(), source.clone(), params.clone());
        let (rec, created) = self.blocking(move |book| book.place(&name, size, fs2, p, &pl, src2.as_ref())).await?;
        // Node failures count only from reconciles of a desired set that holds this call's
        // change (a report computed against an older set may still arrive after it).
        let since = self.book.revision_of(&rec.node);
        if !created {
            // Same name: compatible → the same volume; otherwise ALREADY_EXISTS.
            let range_ok = r.capacity_range.as_ref().is_none_or(|c| {
                rec.size_bytes >= c.required_bytes.max(0) as u64
                    && (c.limit_bytes <= 0 || rec.size_bytes <= c.limit_bytes as u64)
            });
            let topo_ok = placement.requisite.is_empty() || placement.requisite.contains(&rec.node);
            if rec.state == VolState::Deleting {
                return Err(Status::aborted(format!("volume {:?} is being deleted; retry", r.name)));
            }
            let params_ok = rec.parameters == params;
            let source_ok = match &source {
                None => rec.source_snapshot.is_empty() && rec.source_volume.is_empty(),
                Some(ContentSource::Snapshot(s)) => &rec.source_snapshot == s,
                Some(ContentSource::Volume(v)) => &rec.source_volume == v,
            };
            if !range_ok || rec.fs_type != fs || !topo_ok || !params_ok || !source_ok {
                return Err(Status::already_exists(format!(
                    "volume {:?} exists ({} bytes, fs {:?}, node {}, its own parameters and content source) and does not match this request",
                    r.name, rec.size_bytes, rec.fs_type, rec.node
                )));
            }
        }
        if encrypted {
            // Before the node makes the volume: a volume never exists without its key.
            self.ensure_volume_key(&rec, source_rec.as_ref()).await.map_err(key_error)?;
        }
        match self.await_present(&rec.id, rec.size_bytes, since).await {
            Ok(v) => Ok(csi::CreateVolumeResponse { volume: Some(to_csi(&v)) }),
            Err(e)
                if matches!(
                    e.code(),
                    Code::ResourceExhausted
                        | Code::InvalidArgument
                        | Code::AlreadyExists
                        | Code::NotFound
                        | Code::OutOfRange
                        | Code::FailedPrecondition
                ) =>
            {
                // The node refused for good (its store is full, the id is taken there by
                // another claim): the record goes (the node deletes only a file carrying
                // this claim's name), so a retry places the volume anew.
                tracing::warn!(volume = %rec.id, node = %rec.node, error = %e, "node failed to create the volume; abandoning it");
                self.abandon(&rec).await?;
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    async fn do_create_snapshot(&self, r: csi::CreateSnapshotRequest) -> Result<csi::CreateSnapshotResponse, Status> {
        if r.name.is_empty() {
            return Err(invalid("name is required"));
        }
        if r.name.len() > 128 {
            return Err(invalid("name is longer than 128 bytes"));
        }
        if r.source_volume_id.is_empty() {
            return Err(invalid("source_volume_id is required"));
        }
        let source = self.book.get(&r.source_volume_id).filter(is_encrypted);
        if source.is_some() && matches!(*self.keys, KeyStore::Secrets { .. }) {
            keys::secret_name(&r.name).map_err(|e| invalid(e.to_string()))?;
        }
        let mut params: BTreeMap<String, String> = r.parameters.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        // Whether the snapshot's blocks are encrypted: it says so as its volume does, and
        // only then (a class parameter of that name says nothing about them).
        params.remove(keys::ENCRYPTION_PARAMETER);
        if source.is_some() {
            params.insert(keys::ENCRYPTION_PARAMETER.to_string(), keys::LUKS2.to_string());
        }
        let (name, src) = (r.name.clone(), r.source_volume_id.clone());
        let (rec, _created) = self.blocking(move |book| book.place_snapshot(&name, &src, params)).await?;
        if rec.source_volume != r.source_volume_id {
            return Err(Status::already_exists(format!(
                "snapshot {:?} exists and is of volume {}, not {}",
                r.name, rec.source_volume, r.source_volume_id
            )));
        }
        if rec.state == VolState::Deleting {
            return Err(Status::aborted(format!("snapshot {:?} is being deleted; retry", r.name)));
        }
        if is_encrypted(&rec) {
            // Before the node takes it: an encrypted snapshot never exists without its keys.
            let src = source.as_ref().filter(|s| s.id == rec.source_volume);
            self.ensure_snapshot_key(&rec, src).await.map_err(key_error)?;
        }
        let since = self.book.revision_of(&rec.node);
        // Wait for the node to cut it. After op_timeout: DEADLINE_EXCEEDED, never a response,
        // which would tell the snapshotter that the snapshot is cut (it may then let the
        // application write again). Its next call resumes the wait.
        let out = self.await_held("snapshot", &rec.id, since, |view, v| held_snapshot(view, v).is_some()).await;
        match out {
            Ok(v) => Ok(csi::CreateSnapshotResponse { snapshot: Some(snapshot_to_csi(&v, true)) }),
            Err(e)
                if matches!(
                    e.code(),
                    Code::ResourceExhausted
                        | Code::NotFound
                        | Code::AlreadyExists
                        | Code::InvalidArgument
                        | Code::FailedPrecondition
                ) =>
            {
                // The node cannot take it (its store is full, the source is gone there, a
                // raw block volume in use on a store that cannot reflink): the record goes,
                // so a retry starts over.
                tracing::warn!(snapshot = %rec.id, node = %rec.node, error = %e, "node failed to take the snapshot; abandoning it");
                self.abandon(&rec).await?;
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    async fn do_delete_snapshot(&self, r: csi::DeleteSnapshotRequest) -> Result<csi::DeleteSnapshotResponse, Status> {
        if r.snapshot_id.is_empty() {
            return Err(invalid("snapshot_id is required"));
        }
        let v = self.book.get_snapshot(&r.snapshot_id);
        self.delete("snapshot", &r.snapshot_id, v).await?;
        Ok(csi::DeleteSnapshotResponse {})
    }

    /// Delete volume or snapshot `id` (a `what`), record `v` (none: only the key it may
    /// have left), once its node has deleted it; then its key. A volume its node refuses to
    /// delete because it is in use stays.
    async fn delete(&self, what: &str, id: &str, v: Option<VolumeRecord>) -> Result<(), Status> {
        let Some(v) = v else { return self.remove_left_key(id).await };
        let connected = self.book.node_view(&v.node).is_some_and(|n| n.connected > 0);
        if !connected {
            return Err(Status::unavailable(format!("node {} holding {what} {id} is not connected; retry", v.node)));
        }
        let did = id.to_string();
        self.blocking(move |book| book.begin_delete(&did)).await?;
        let since = self.book.revision_of(&v.node);
        match self.await_gone(id, &v.node, since).await {
            Err(e) if e.code() == Code::FailedPrecondition && v.kind.is_volume() => {
                let vid = id.to_string();
                self.blocking(move |book| book.cancel_delete(&vid)).await?;
                let why = format!("volume {id} is in use on node {}: {}", v.node, e.message());
                return Err(Status::failed_precondition(why));
            }
            gone => gone?,
        }
        if is_encrypted(&v) {
            self.keys.remove(&v.name, &v.id).await.map_err(|e| key_left(id, e))?;
        }
        Ok(())
    }

    /// Drop record `rec`, which its node refused for good, and its key record if it is
    /// encrypted: the provisioner never deletes what it never got, so nothing else would
    /// remove the key. A key that cannot be removed is logged; the node's refusal stays the
    /// answer.
    async fn abandon(&self, rec: &VolumeRecord) -> Result<(), Status> {
        let id = rec.id.clone();
        // Deleted on its node (if anything was made there) like any other.
        self.blocking(move |book| book.begin_delete(&id)).await?;
        if is_encrypted(rec)
            && let Err(e) = self.keys.remove(&rec.name, &rec.id).await
        {
            tracing::warn!(id = %rec.id, error = %e, "removing the key of an abandoned record");
        }
        Ok(())
    }

    /// Remove the key record a deleted volume or snapshot `id` may have left: its removal
    /// failed, or the controller stopped, after the record went. Only when no record of
    /// either kind holds `id`: a key record exists only while its record does (the record
    /// is made first). An encrypted volume's or snapshot's name is its id: a key Secret's
    /// name is a DNS subdomain, which [`volume_id_for`] keeps. An id that is no record's id
    /// (a path, a name it would hash) or that no Secret can be named after has no key.
    async fn remove_left_key(&self, id: &str) -> Result<(), Status> {
        if volume_id_for(id) != id || self.book.holds(id) {
            return Ok(());
        }
        match self.keys.remove(id, id).await {
            Ok(()) | Err(keys::KeyError::BadName { .. }) => Ok(()),
            Err(e) => Err(key_left(id, e)),
        }
    }

    /// Make the key record of new encrypted volume `rec` unless it has one: a fresh key,
    /// and for a copy the keys its source's blocks open with as its source keys
    /// ([`keys::KeyRecord::for_copy`]).
    async fn ensure_volume_key(&self, rec: &VolumeRecord, source: Option<&VolumeRecord>) -> Result<(), keys::KeyError> {
        if rec.source_snapshot.is_empty() && rec.source_volume.is_empty() {
            return self.keys.ensure(&rec.name, &rec.id).await;
        }
        if self.keys.read(&rec.name, &rec.id).await?.is_some() {
            return Ok(());
        }
        // A retry whose source is gone since finds the volume itself as its source.
        let Some(src) = source.filter(|s| s.id != rec.id) else {
            let what = if rec.source_snapshot.is_empty() { &rec.source_volume } else { &rec.source_snapshot };
            return Err(keys::KeyError::SourceMissing { what: format!("the source {what} of volume {}", rec.id) });
        };
        let src_keys = self.source_keys(src).await?;
        self.keys.ensure_with(&rec.name, &rec.id, src_keys.for_copy()).await
    }

    /// Make the key record of encrypted snapshot `rec` of volume `source` unless it has
    /// one: a copy of the volume's record (the keys the snapshot's blocks open with).
    async fn ensure_snapshot_key(
        &self,
        rec: &VolumeRecord,
        source: Option<&VolumeRecord>,
    ) -> Result<(), keys::KeyError> {
        if self.keys.read(&rec.name, &rec.id).await?.is_some() {
            return Ok(());
        }
        let Some(src) = source else {
            return Err(keys::KeyError::SourceMissing { what: format!("volume {}", rec.source_volume) });
        };
        let src_keys = self.source_keys(src).await?;
        self.keys.ensure_with(&rec.name, &rec.id, src_keys).await
    }

    /// The key record of a copy's source (a volume or snapshot).
    async fn source_keys(&self, src: &VolumeRecord) -> Result<keys::KeyRecord, keys::KeyError> {
        let what = || format!("{} {}", if src.kind.is_volume() { "volume" } else { "snapshot" }, src.id);
        self.keys.read(&src.name, &src.id).await?.ok_or_else(|| keys::KeyError::SourceMissing { what: what() })
    }

    /// Wait until record `id` (a volume or snapshot marked for deletion) is gone from its
    /// `node`, or the node failed the delete (in a reconcile of revision `since` or later).
    async fn await_gone(&self, id: &str, node: &str, since: u64) -> Result<(), Status> {
        self.book
            .wait(self.op_timeout, |_, nodes, vols| {
                if !vols.contains_key(id) {
                    return Some(Ok(()));
                }
                let view = nodes.get(node);
                if let Some(f) = failure_since(view, id, since) {
                    return Some(Err(f.into()));
                }
                if view.is_none_or(|n| n.connected == 0) {
                    return Some(Err(Status::unavailable(format!("node {node} went away; retry"))));
                }
                None
            })
            .await
    }

    async fn do_delete_volume(&self, r: csi::DeleteVolumeRequest) -> Result<csi::DeleteVolumeResponse, Status> {
        if r.volume_id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        let v = self.book.get(&r.volume_id);
        self.delete("volume", &r.volume_id, v).await?;
        Ok(csi::DeleteVolumeResponse {})
    }
}

#[tonic::async_trait]
impl csi::controller_server::Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        Ok(Response::new(self.do_create_volume(req.into_inner()).await?))
    }

    async fn delete_volume(
        &self,
        req: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        Ok(Response::new(self.do_delete_volume(req.into_inner()).await?))
    }

    async fn controller_expand_volume(
        &self,
        req: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        let range = r.capacity_range.as_ref().ok_or_else(|| invalid("capacity_range is required"))?;
        // An unknown volume is NOT_FOUND before the other argument checks.
        let v = self.book.get(&r.volume_id).ok_or_else(|| BookError::NotFound(r.volume_id.clone()))?;
        if range.required_bytes <= 0 && range.limit_bytes <= 0 {
            return Err(invalid("capacity_range needs required_bytes or limit_bytes"));
        }
        if let Some(c) = &r.volume_capability {
            let fs = check_capabilities(std::slice::from_ref(c), None)?;
            if fs.is_raw() != v.fs_type.is_raw() {
                return Err(invalid("volume_capability does not match the volume's access type"));
            }
        }
        let size = size_for(Some(range))?;
        // Connected is not enough: until the node's first report (after a controller restart,
        // for one) its free space reads 0, and the growth would be refused as OUT_OF_RANGE,
        // which the resizer takes as final.
        let view = self.book.node_view(&v.node);
        if !view.as_ref().is_some_and(|n| n.live()) {
            return Err(Status::unavailable(format!(
                "node {} holding volume {} is not connected (or has not reported yet); retry",
                v.node, v.id
            )));
        }
        // What a refused growth goes back to: the size the node holds. A retry after
        // DEADLINE_EXCEEDED finds the record at the new size already.
        let before = held(view.as_ref(), &v).map_or(v.size_bytes, |h| h.size_bytes.min(v.size_bytes));
        let vid = v.id.clone();
        let grown = self.blocking(move |book| book.begin_expand(&vid, size)).await?;
        let since = self.book.revision_of(&grown.node);
        let v = match self.await_present(&grown.id, grown.size_bytes, since).await {
            Ok(v) => v,
            Err(e) if !matches!(e.code(), Code::DeadlineExceeded | Code::Unavailable) => {
                // The node could not grow it (its store is full): the desired size goes
                // back, so the node stops trying and the space is not held.
                let vid = grown.id.clone();
                self.blocking(move |book| book.revert_expand(&vid, before)).await?;
                return Err(if e.code() == Code::ResourceExhausted || e.code() == Code::OutOfRange {
                    Status::out_of_range(e.message())
                } else {
                    e
                });
            }
            Err(e) => return Err(e),
        };
        Ok(Response::new(csi::ControllerExpandVolumeResponse {
            capacity_bytes: v.size_bytes as i64,
            // The filesystem grows on the node (NodeExpandVolume); a raw block volume's
            // loop device already grew online with its file, unless it is encrypted (its
            // dm-crypt mapping grows in NodeExpandVolume).
            node_expansion_required: !v.fs_type.is_raw() || is_encrypted(&v),
        }))
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(invalid("volume_id is required"));
        }
        if r.volume_capabilities.is_empty() {
            return Err(invalid("volume_capabilities is required"));
        }
        let v = self
            .book
            .get(&r.volume_id)
            .filter(|v| v.state != VolState::Deleting)
            .ok_or_else(|| BookError::NotFound(r.volume_id.clone()))?;
        for (i, c) in r.volume_capabilities.iter().enumerate() {
            if c.access_mode.is_none() || c.access_type.is_none() {
                return Err(invalid(format!("volume_capabilities[{i}] needs both access_mode and access_type")));
            }
        }
        let verdict = check_capabilities(&r.volume_capabilities, None).and_then(|fs| {
            let fits = if fs.is_raw() {
                true // block access works on any volume
            } else {
                !v.fs_type.is_raw()
                    && r.volume_capabilities.iter().all(|c| match &c.access_type {
                        Some(csi::volume_capability::AccessType::Mount(m)) => {
                            m.fs_type.is_empty() || m.fs_type == v.fs_type.as_str()
                        }
                        _ => true,
                    })
            };
            if fits { Ok(()) } else { Err(invalid(format!("volume holds {:?}", v.fs_type.as_str()))) }
        });
        Ok(Response::new(match verdict {
            Ok(()) => csi::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                    volume_context: r.volume_context,
                    volume_capabilities: r.volume_capabilities,
                    parameters: r.parameters,
                    mutable_parameters: r.mutable_parameters,
                }),
                message: String::new(),
            },
            Err(e) => csi::ValidateVolumeCapabilitiesResponse { confirmed: None, message: e.message().to_string() },
        }))
    }

    async fn list_volumes(
        &self,
        req: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        let r = req.into_inner();
        let views = self.book.node_views();
        let (page, next_token) = page_of(self.book.list(), r.max_entries, &r.starting_token)?;
        let entries = page
            .iter()
            .map(|v| {
                let condition = match held(views.get(&v.node), v) {
                    Some(h) if !h.backing_file_present => csi::VolumeCondition {
                        abnormal: true,
                        message: format!("backing file missing on node {}", v.node),
                    },
                    None if views.get(&v.node).is_some_and(|n| n.reported) && v.state == VolState::Ready => {
                        csi::VolumeCondition { abnormal: true, message: format!("node {} does not hold it", v.node) }
                    }
                    _ => csi::VolumeCondition { abnormal: false, message: String::new() },
                };
                csi::list_volumes_response::Entry {
                    volume: Some(to_csi(v)),
                    status: Some(csi::list_volumes_response::VolumeStatus {
                        published_node_ids: vec![],
                        volume_condition: Some(condition),
                    }),
                }
            })
            .collect();
        Ok(Response::new(csi::ListVolumesResponse { entries, next_token }))
    }

    async fn get_capacity(
        &self,
        req: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        let r = req.into_inner();
        let backend = backend_parameter(&r.parameters)?;
        if !r.volume_capabilities.is_empty()
            && check_capabilities(&r.volume_capabilities, fs_parameter(&r.parameters)).is_err()
        {
            // Capabilities no volume here can have (multi-node modes, other filesystems):
            // there is no capacity for them.
            return Ok(Response::new(csi::GetCapacityResponse {
                available_capacity: 0,
                maximum_volume_size: Some(0),
                minimum_volume_size: Some(MIB as i64),
            }));
        }
        let only: Option<Vec<String>> = r.accessible_topology.as_ref().map(|t| node_of(t).into_iter().collect());
        let caps = self.book.capacity(only.as_deref(), backend)?;
        let total: u64 = caps.iter().map(|c| c.1).sum();
        let max = caps.iter().map(|c| c.1).max().unwrap_or(0);
        Ok(Response::new(csi::GetCapacityResponse {
            available_capacity: total as i64,
            maximum_volume_size: Some((max / MIB * MIB) as i64),
            minimum_volume_size: Some(MIB as i64),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::{Rpc, Type, rpc};
        let caps = [
            rpc::Type::CreateDeleteVolume,
            rpc::Type::GetCapacity,
            rpc::Type::ExpandVolume,
            rpc::Type::ListVolumes,
            rpc::Type::VolumeCondition,
            rpc::Type::SingleNodeMultiWriter,
            rpc::Type::CreateDeleteSnapshot,
            rpc::Type::ListSnapshots,
            rpc::Type::CloneVolume,
            rpc::Type::GetSnapshot,
        ]
        .into_iter()
        .map(|t| csi::ControllerServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
        .collect();
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse { capabilities: caps }))
    }

    async fn controller_publish_volume(
        &self,
        _: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        unimplemented("ControllerPublishVolume (volumes are node-local, attachRequired is false)")
    }
    async fn controller_unpublish_volume(
        &self,
        _: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        unimplemented("ControllerUnpublishVolume")
    }
    async fn create_snapshot(
        &self,
        req: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        Ok(Response::new(self.do_create_snapshot(req.into_inner()).await?))
    }
    async fn delete_snapshot(
        &self,
        req: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        Ok(Response::new(self.do_delete_snapshot(req.into_inner()).await?))
    }
    async fn list_snapshots(
        &self,
        req: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        let r = req.into_inner();
        let views = self.book.node_views();
        // Filters: an unknown snapshot or source volume lists nothing (not an error).
        let all = self
            .book
            .list_snapshots()
            .into_iter()
            .filter(|v| r.snapshot_id.is_empty() || v.id == r.snapshot_id)
            .filter(|v| r.source_volume_id.is_empty() || v.source_volume == r.source_volume_id);
        let (page, next_token) = page_of(all, r.max_entries, &r.starting_token)?;
        let entries = page
            .iter()
            .map(|v| csi::list_snapshots_response::Entry {
                snapshot: Some(snapshot_to_csi(v, snapshot_ready(v, views.get(&v.node)))),
            })
            .collect();
        Ok(Response::new(csi::ListSnapshotsResponse { entries, next_token }))
    }
    async fn get_snapshot(
        &self,
        req: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        let r = req.into_inner();
        if r.snapshot_id.is_empty() {
            return Err(invalid("snapshot_id is required"));
        }
        let v = self
            .book
            .get_snapshot(&r.snapshot_id)
            .filter(|v| v.state != VolState::Deleting)
            .ok_or_else(|| BookError::SnapshotNotFound(r.snapshot_id.clone()))?;
        let ready = snapshot_ready(&v, self.book.node_view(&v.node).as_ref());
        Ok(Response::new(csi::GetSnapshotResponse { snapshot: Some(snapshot_to_csi(&v, ready)) }))
    }
    async fn controller_get_volume(
        &self,
        _: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        unimplemented("ControllerGetVolume")
    }
    async fn controller_modify_volume(
        &self,
        _: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        unimplemented("ControllerModifyVolume")
    }
}

/// One page of `records` (by id) that are not being deleted, after `starting_token`, at most
/// `max_entries` (0: all), and the token of the next page ("" when this is the last).
fn page_of(
    records: impl IntoIterator<Item = VolumeRecord>,
    max_entries: i32,
    starting_token: &str,
) -> Result<(Vec<VolumeRecord>, String), Status> {
    if max_entries < 0 {
        return Err(invalid("max_entries must not be negative"));
    }
    let after = if starting_token.is_empty() {
        None
    } else {
        Some(
            decode_token(starting_token)
                .ok_or_else(|| Status::aborted(format!("starting_token {starting_token:?} is not valid")))?,
        )
    };
    let mut all: Vec<VolumeRecord> = records
        .into_iter()
        .filter(|v| v.state != VolState::Deleting)
        .filter(|v| after.as_ref().is_none_or(|a| &v.id > a))
        .collect();
    let take = if max_entries == 0 { all.len() } else { max_entries as usize };
    let more = all.len() > take;
    all.truncate(take);
    let next_token = if more { all.last().map(|v| encode_token(&v.id)).unwrap_or_default() } else { String::new() };
    Ok((all, next_token))
}

/// Pagination tokens: `np1.` + hex of the last volume id returned.
fn encode_token(id: &str) -> String {
    format!("np1.{}", hex::encode(id))
}

fn decode_token(t: &str) -> Option<String> {
    let h = t.strip_prefix("np1.")?;
    let id = String::from_utf8(hex::decode(h).ok()?).ok()?;
    crate::storage::store::validate_id(&id).ok()?;
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_capacity_range() {
        let x = |req: i64, lim: i64| {
            size_for_fs(Some(&csi::CapacityRange { required_bytes: req, limit_bytes: lim }), FsType::Xfs, false)
        };
        assert_eq!(x(64 << 20, 0).unwrap(), XFS_MIN_SIZE, "small xfs volumes are raised to the minimum");
        assert_eq!(x(400 << 20, 0).unwrap(), 400 << 20);
        assert_eq!(x(0, 0).unwrap(), XFS_MIN_SIZE.max(DEFAULT_SIZE));
        assert_eq!(x(1 << 20, 64 << 20).unwrap_err().code(), Code::OutOfRange, "a limit below the minimum");
        // Encrypted: the filesystem is 2 MiB smaller, so the minimum is 2 MiB larger.
        let enc = |req: i64, lim: i64| {
            size_for_fs(Some(&csi::CapacityRange { required_bytes: req, limit_bytes: lim }), FsType::Xfs, true)
        };
        assert_eq!(enc(64 << 20, 0).unwrap(), XFS_MIN_SIZE + 2 * MIB);
        assert_eq!(enc(1 << 20, XFS_MIN_SIZE as i64).unwrap_err().code(), Code::OutOfRange);
        assert_eq!(
            size_for_fs(Some(&csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }), FsType::Ext4, false)
                .unwrap(),
            1 << 20
        );
        // An encrypted ext4 or raw volume holds the header and at least 1 MiB of data.
        for fs in [FsType::Ext4, FsType::Raw] {
            let r = |req: i64, lim: i64| {
                size_for_fs(Some(&csi::CapacityRange { required_bytes: req, limit_bytes: lim }), fs, true)
            };
            assert_eq!(r(1, 0).unwrap(), 3 * MIB);
            assert_eq!(r(8 << 20, 0).unwrap(), 8 * MIB);
            let e = r(1, 2 << 20).unwrap_err();
            assert_eq!(e.code(), Code::OutOfRange);
            assert!(e.message().contains("need at least 3145728 bytes (the LUKS2 header"), "{}", e.message());
        }
        let r = |req: i64, lim: i64| size_for(Some(&csi::CapacityRange { required_bytes: req, limit_bytes: lim }));
        assert_eq!(size_for(None).unwrap(), DEFAULT_SIZE);
        assert_eq!(r(1, 0).unwrap(), MIB);
        assert_eq!(r(MIB as i64 + 1, 0).unwrap(), 2 * MIB);
        assert_eq!(r(0, 10 * MIB as i64).unwrap(), 10 * MIB);
        assert_eq!(r(MIB as i64 + 1, 2 * MIB as i64).unwrap(), 2 * MIB);
        assert_eq!(r(5, 100).unwrap_err().code(), Code::OutOfRange);
        assert_eq!(r(200, 100).unwrap_err().code(), Code::OutOfRange);
        assert_eq!(r(-1, 0).unwrap_err().code(), Code::InvalidArgument);
    }

    fn params(kv: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_backend_parameter_is_file_lvm_or_refused() {
        assert_eq!(backend_parameter(&params(&[])).unwrap(), StoreBackend::File);
        assert_eq!(backend_parameter(&params(&[("backend", "file")])).unwrap(), StoreBackend::File);
        assert_eq!(backend_parameter(&params(&[("backend", "lvm")])).unwrap(), StoreBackend::Lvm);
        // Present but empty: the default, as the node reads it.
        assert_eq!(backend_parameter(&params(&[("backend", "")])).unwrap(), StoreBackend::File);
        for bad in ["zfs", "LVM", " lvm"] {
            let e = backend_parameter(&params(&[("backend", bad)])).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{bad}");
            assert!(e.message().starts_with("parameter \"backend\": invalid volume backend"), "{e}");
            assert!(e.message().contains("want \"file\" or \"lvm\""), "{e}");
        }
    }

    #[test]
    fn a_copy_must_ask_for_its_sources_backend() {
        let src = VolumeRecord {
            id: "a".into(),
            name: "a".into(),
            node: "n1".into(),
            size_bytes: MIB,
            fs_type: FsType::Ext4,
            state: VolState::Ready,
            created_at: 1,
            parameters: Default::default(),
            kind: Default::default(),
            source_volume: String::new(),
            source_snapshot: String::new(),
            backend: StoreBackend::Lvm,
        };
        let what = ContentSource::Snapshot("snap-1".into());
        check_source_backend(&what, &src, StoreBackend::Lvm).unwrap();
        let e = check_source_backend(&what, &src, StoreBackend::File).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert_eq!(
            e.message(),
            "snapshot snap-1 is on the lvm backend; a volume made from it must be too (the request asks for file)"
        );
    }

    /// A controller service over a fresh book with nodes n1 (file 100 MiB, no lvm), n2 (file
    /// 50 MiB, lvm 400 MiB with 300 available) and n3 (file 10 MiB, lvm pool short) connected
    /// and reported.
    fn service(tag: &str) -> (crate::util::TestDir, ControllerService, Vec<super::super::volumes::ConnectionGuard>) {
        let t = crate::util::TestDir::new(tag);
        let db = crate::controller::backend::RedbBackend::open(&t.0.join("db.redb")).unwrap();
        let book = Arc::new(VolumeBook::open(db, Duration::from_secs(60)).unwrap());
        let guards = ["n1", "n2", "n3"].iter().map(|n| book.connect(n)).collect();
        let nodes = [("n1", 100, None), ("n2", 50, Some((400, 300, false))), ("n3", 10, Some((400, 400, true)))];
        for (node, file, lvm) in nodes {
            let backends = lvm
                .map(|(capacity, available, short)| crate::rpc::controller::BackendCapacity {
                    backend: "lvm".into(),
                    capacity_bytes: capacity * MIB,
                    available_bytes: available * MIB,
                    short,
                })
                .into_iter()
                .collect();
            book.report(crate::rpc::controller::ReportVolumesRequest {
                node_name: node.into(),
                capacity_bytes: file * MIB,
                available_bytes: file * MIB,
                backends,
                ..Default::default()
            })
            .unwrap();
        }
        let keys = Arc::new(KeyStore::Dir(t.0.join("keys")));
        (t, ControllerService { book, op_timeout: Duration::from_millis(50), keys }, guards)
    }

    /// GetCapacity's available bytes, in MiB.
    async fn capacity(svc: &ControllerService, node: Option<&str>, p: &[(&str, &str)]) -> Result<i64, Status> {
        use csi::controller_server::Controller;
        let r = csi::GetCapacityRequest {
            parameters: params(p),
            accessible_topology: node.map(topology_of),
            ..Default::default()
        };
        svc.get_capacity(Request::new(r)).await.map(|r| r.into_inner().available_capacity / MIB as i64)
    }

    #[tokio::test]
    async fn get_capacity_answers_the_chosen_backend() {
        let (_t, svc, _g) = service("csi-capacity");
        assert_eq!(capacity(&svc, None, &[]).await.unwrap(), 160);
        assert_eq!(capacity(&svc, Some("n2"), &[("backend", "file")]).await.unwrap(), 50);
        assert_eq!(capacity(&svc, None, &[("backend", "lvm")]).await.unwrap(), 300);
        assert_eq!(capacity(&svc, Some("n2"), &[("backend", "lvm")]).await.unwrap(), 300);
        assert_eq!(capacity(&svc, Some("n1"), &[("backend", "lvm")]).await.unwrap(), 0, "no pool on n1");
        assert_eq!(capacity(&svc, Some("n3"), &[("backend", "lvm")]).await.unwrap(), 0, "n3's pool is short");
        let e = capacity(&svc, Some("n2"), &[("backend", "zfs")]).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("\"zfs\""), "{e:?}");
    }

    fn create_request(name: &str, p: &[(&str, &str)]) -> csi::CreateVolumeRequest {
        use csi::volume_capability::access_mode::Mode;
        use csi::volume_capability::{AccessMode, AccessType, MountVolume};
        csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 8 * MIB as i64, limit_bytes: 0 }),
            volume_capabilities: vec![csi::VolumeCapability {
                access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
                access_type: Some(AccessType::Mount(MountVolume::default())),
            }],
            parameters: params(p),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn create_volume_places_on_the_chosen_backend_and_checks_sources() {
        let (_t, svc, _g) = service("csi-create-backend");
        let e = svc.do_create_volume(create_request("pvc-zfs", &[("backend", "zfs")])).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(svc.book.by_name("pvc-zfs").is_none());
        // The node does not answer within op_timeout: the record stays, on n2's pool.
        let e = svc.do_create_volume(create_request("pvc-a", &[("backend", "lvm")])).await.unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
        let a = svc.book.by_name("pvc-a").unwrap();
        assert_eq!((a.node.as_str(), a.backend), ("n2", StoreBackend::Lvm));
        assert_eq!(svc.book.desired("n2").volumes[0].backend, "lvm");
        // n2 holds it now: a clone that asks for the file backend is refused, on lvm it is placed.
        svc.book
            .report(crate::rpc::controller::ReportVolumesRequest {
                node_name: "n2".into(),
                capacity_bytes: 50 * MIB,
                available_bytes: 50 * MIB,
                volumes: vec![crate::rpc::controller::VolumeState {
                    id: a.id.clone(),
                    size_bytes: a.size_bytes,
                    name: a.name.clone(),
                    backing_file_present: true,
                    backend: "lvm".into(),
                    ..Default::default()
                }],
                backends: vec![crate::rpc::controller::BackendCapacity {
                    backend: "lvm".into(),
                    capacity_bytes: 400 * MIB,
                    available_bytes: 300 * MIB - a.size_bytes,
                    short: false,
                }],
                ..Default::default()
            })
            .unwrap();
        let clone_of = |name: &str, p: &[(&str, &str)]| csi::CreateVolumeRequest {
            volume_content_source: Some(csi::VolumeContentSource {
                r#type: Some(csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
                    volume_id: a.id.clone(),
                })),
            }),
            ..create_request(name, p)
        };
        let e = svc.do_create_volume(clone_of("pvc-b", &[])).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("volume pvc-a is on the lvm backend"), "{e}");
        assert!(svc.book.by_name("pvc-b").is_none());
        let e = svc.do_create_volume(clone_of("pvc-c", &[("backend", "lvm")])).await.unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "placed, waiting for the node: {e}");
        let c = svc.book.by_name("pvc-c").unwrap();
        assert_eq!((c.node.as_str(), c.backend, c.source_volume.as_str()), ("n2", StoreBackend::Lvm, "pvc-a"));
    }

    #[tokio::test]
    async fn an_encrypted_volume_gets_its_key_first_and_copies_get_theirs() {
        let (t, svc, _g) = service("csi-encrypted");
        let e = svc.do_create_volume(create_request("pvc-x", &[("encryption", "aes")])).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(svc.book.by_name("pvc-x").is_none());
        // The node does not answer: the record and its key are there before it is asked.
        let e = svc.do_create_volume(create_request("pvc-e", &[("encryption", "luks2")])).await.unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
        let rec = svc.book.by_name("pvc-e").unwrap();
        let key = std::fs::read_to_string(keys::key_file(&t.0.join("keys"), &rec.id)).unwrap();
        assert_eq!(key.len(), 64);
        assert_eq!(to_csi(&rec).volume_context.get("encryption").map(String::as_str), Some("luks2"));
        let plain = svc.book.by_name("pvc-e").map(|mut r| {
            r.parameters.clear();
            r
        });
        assert!(!to_csi(&plain.unwrap()).volume_context.contains_key("encryption"));
        // A retry keeps the key.
        let _ = svc.do_create_volume(create_request("pvc-e", &[("encryption", "luks2")])).await;
        assert_eq!(std::fs::read_to_string(keys::key_file(&t.0.join("keys"), &rec.id)).unwrap(), key);
        // Copies (once n1 holds it: a source still being made is UNAVAILABLE first). An
        // unencrypted volume beside it, for the refusals.
        let _ = svc.do_create_volume(create_request("pvc-p", &[])).await;
        let plain = svc.book.by_name("pvc-p").unwrap();
        let state = |r: &VolumeRecord| crate::rpc::controller::VolumeState {
            id: r.id.clone(),
            size_bytes: r.size_bytes,
            name: r.name.clone(),
            fs_type: "ext4".into(),
            backing_file_present: true,
            ..Default::default()
        };
        let mut nodes = vec![rec.node.clone(), plain.node.clone()];
        nodes.dedup();
        for node in nodes {
            let held: Vec<_> = [&rec, &plain].into_iter().filter(|v| v.node == node).collect();
            svc.book
                .report(crate::rpc::controller::ReportVolumesRequest {
                    node_name: node.clone(),
                    capacity_bytes: 100 * MIB,
                    available_bytes: 100 * MIB - held.iter().map(|v| v.size_bytes).sum::<u64>(),
                    volumes: held.into_iter().map(state).collect(),
                    ..Default::default()
                })
                .unwrap();
        }
        let dir = t.0.join("keys");
        let read = |id: &str, entry: &str| std::fs::read_to_string(dir.join(format!("{id}.{entry}"))).ok();
        // A snapshot: encrypted, its record a copy of the volume's, made before the node
        // takes it. The node does not answer: not cut, so an error, never a response.
        let e = svc
            .do_create_snapshot(csi::CreateSnapshotRequest {
                name: "snap-e".into(),
                source_volume_id: rec.id.clone(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
        let srec = svc.book.get_snapshot(&super::super::volumes::volume_id_for("snap-e")).unwrap();
        assert!(is_encrypted(&srec), "the snapshot of an encrypted volume is encrypted");
        assert_eq!(read(&srec.id, "key").as_deref(), Some(key.as_str()), "the snapshot keeps the volume's key");
        assert_eq!(read(&srec.id, "sourceKey"), None);
        // A clone: the class must be encrypted; its record has a fresh key and the
        // source's as sourceKey.
        let clone_of = |src: &str, name: &str, p: &[(&str, &str)]| csi::CreateVolumeRequest {
            volume_content_source: Some(csi::VolumeContentSource {
                r#type: Some(csi::volume_content_source::Type::Volume(csi::volume_content_source::VolumeSource {
                    volume_id: src.to_string(),
                })),
            }),
            ..create_request(name, p)
        };
        let e = svc.do_create_volume(clone_of(&rec.id, "pvc-c", &[])).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains("is encrypted; a volume made from it needs a class with encryption"), "{e}");
        assert!(svc.book.by_name("pvc-c").is_none());
        let e = svc.do_create_volume(clone_of(&rec.id, "pvc-c", &[("encryption", "luks2")])).await.unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "placed, waiting for the node: {e}");
        let crec = svc.book.by_name("pvc-c").unwrap();
        let ckey = read(&crec.id, "key").unwrap();
        assert_eq!(ckey.len(), 64);
        assert_ne!(ckey, key, "the clone has a key of its own");
        assert_eq!(read(&crec.id, "sourceKey").as_deref(), Some(key.as_str()));
        assert_eq!(read(&crec.id, "sourceKey2"), None);
        // A retry keeps it.
        let _ = svc.do_create_volume(clone_of(&rec.id, "pvc-c", &[("encryption", "luks2")])).await;
        assert_eq!(read(&crec.id, "key").as_deref(), Some(ckey.as_str()));
        // An encrypted class cannot copy an unencrypted volume.
        let e = svc.do_create_volume(clone_of(&plain.id, "pvc-d", &[("encryption", "luks2")])).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains("is not encrypted; a class with encryption: luks2 cannot"), "{e}");
        assert!(svc.book.by_name("pvc-d").is_none());
        assert_eq!(read(&super::super::volumes::volume_id_for("pvc-d"), "key"), None);
    }

    #[tokio::test]
    async fn a_refused_growth_goes_back_to_the_size_the_node_holds_also_on_a_retry() {
        use crate::rpc::controller as pb;
        use csi::controller_server::Controller;
        let (_t, svc, _g) = service("csi-expand-revert");
        let _ = svc.do_create_volume(create_request("pvc-g", &[])).await;
        let rec = svc.book.by_name("pvc-g").unwrap();
        let report = |failures: Vec<pb::VolumeFailure>| pb::ReportVolumesRequest {
            node_name: rec.node.clone(),
            capacity_bytes: 100 * MIB,
            available_bytes: 100 * MIB - rec.size_bytes,
            volumes: vec![pb::VolumeState {
                id: rec.id.clone(),
                size_bytes: rec.size_bytes,
                name: rec.name.clone(),
                fs_type: "ext4".into(),
                backing_file_present: true,
                ..Default::default()
            }],
            failures,
            revision: svc.book.revision_of(&rec.node),
            ..Default::default()
        };
        svc.book.report(report(vec![])).unwrap();
        let grow = || {
            Request::new(csi::ControllerExpandVolumeRequest {
                volume_id: rec.id.clone(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: (rec.size_bytes + 8 * MIB) as i64,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
        };
        // The node does not answer in time; the record holds the new size.
        assert_eq!(svc.controller_expand_volume(grow()).await.unwrap_err().code(), Code::DeadlineExceeded);
        assert_eq!(svc.book.get(&rec.id).unwrap().size_bytes, rec.size_bytes + 8 * MIB);
        // Then it cannot grow it: the retry learns so and puts back the size the node holds.
        let refused =
            pb::VolumeFailure { id: rec.id.clone(), code: Code::ResourceExhausted as i32, message: "full".into() };
        svc.book.report(report(vec![refused])).unwrap();
        assert_eq!(svc.controller_expand_volume(grow()).await.unwrap_err().code(), Code::OutOfRange);
        assert_eq!(svc.book.get(&rec.id).unwrap().size_bytes, rec.size_bytes);
    }

    /// A volume its node refuses for good is abandoned (deleted there like any other), and
    /// its key record goes at once: nothing would ever remove it later.
    #[tokio::test]
    async fn an_abandoned_encrypted_volume_leaves_no_key() {
        let (t, mut svc, _g) = service("csi-abandon-key");
        svc.op_timeout = Duration::from_secs(30);
        let refuse = async {
            let (rec, key) = loop {
                let placed = svc.book.by_name("pvc-e").map(|r| (keys::key_file(&t.0.join("keys"), &r.id), r));
                if let Some((key, rec)) = placed.filter(|(key, _)| key.exists()) {
                    break (rec, key);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            let failure = crate::rpc::controller::VolumeFailure {
                id: rec.id.clone(),
                code: Code::ResourceExhausted as i32,
                message: "the store is full".into(),
            };
            svc.book
                .report(crate::rpc::controller::ReportVolumesRequest {
                    node_name: rec.node.clone(),
                    capacity_bytes: 100 * MIB,
                    available_bytes: 100 * MIB,
                    failures: vec![failure],
                    revision: svc.book.revision_of(&rec.node),
                    ..Default::default()
                })
                .unwrap();
            key
        };
        let (out, key) =
            tokio::join!(svc.do_create_volume(create_request("pvc-e", &[("encryption", "luks2")])), refuse);
        assert_eq!(out.unwrap_err().code(), Code::ResourceExhausted);
        let state = svc.book.by_name("pvc-e").map(|r| r.state);
        assert_eq!(state, Some(VolState::Deleting), "abandoned: deleted on the node like any other");
        assert!(!key.exists(), "the abandoned volume's key is left at {}", key.display());
    }

    /// A key left behind (its removal failed, or the controller stopped, after its record
    /// went) goes with the retried delete; a key whose id a record holds stays, and an id
    /// that is no record's id reaches no file.
    #[tokio::test]
    async fn a_retried_delete_removes_a_key_left_behind() {
        let (t, svc, _g) = service("csi-left-key");
        let dir = t.0.join("keys");
        std::fs::create_dir_all(&dir).unwrap();
        let file = |id: &str, entry: &str| dir.join(format!("{id}.{entry}"));
        for id in ["pvc-gone", "snap-gone"] {
            for entry in ["key", "sourceKey"] {
                std::fs::write(file(id, entry), "k").unwrap();
            }
        }
        let delete_volume = |id: &str| csi::DeleteVolumeRequest { volume_id: id.into(), ..Default::default() };
        let delete_snapshot = |id: &str| csi::DeleteSnapshotRequest { snapshot_id: id.into(), ..Default::default() };
        svc.do_delete_volume(delete_volume("pvc-gone")).await.unwrap();
        svc.do_delete_snapshot(delete_snapshot("snap-gone")).await.unwrap();
        for id in ["pvc-gone", "snap-gone"] {
            assert!(!file(id, "key").exists() && !file(id, "sourceKey").exists(), "{id}'s key is left");
        }
        // A volume being made (the node does not answer) holds its id: a delete of a
        // snapshot of that id leaves its key.
        let e = svc.do_create_volume(create_request("pvc-live", &[("encryption", "luks2")])).await.unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded);
        let live = svc.book.by_name("pvc-live").unwrap();
        svc.do_delete_snapshot(delete_snapshot(&live.id)).await.unwrap();
        assert!(keys::key_file(&dir, &live.id).exists(), "a live volume's key was removed");
        // A path is no record's id.
        let outside = t.0.join("outside.key");
        std::fs::write(&outside, "k").unwrap();
        svc.do_delete_volume(delete_volume("../outside")).await.unwrap();
        assert!(outside.exists(), "a delete of id ../outside removed {}", outside.display());
    }

    #[test]
    fn tokens_round_trip_and_reject_garbage() {
        assert_eq!(decode_token(&encode_token("pvc-1")).as_deref(), Some("pvc-1"));
        for bad in ["", "x", "np1.zz", "np1.2e2e2f", "np2.70"] {
            assert!(decode_token(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn capabilities_choose_the_filesystem() {
        use csi::volume_capability::access_mode::Mode;
        use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
        let mount = |fs: &str, m: Mode| csi::VolumeCapability {
            access_mode: Some(AccessMode { mode: m as i32 }),
            access_type: Some(AccessType::Mount(MountVolume { fs_type: fs.into(), ..Default::default() })),
        };
        let block = csi::VolumeCapability {
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
            access_type: Some(AccessType::Block(BlockVolume {})),
        };
        assert_eq!(check_capabilities(&[mount("", Mode::SingleNodeWriter)], None).unwrap(), FsType::Ext4);
        assert_eq!(check_capabilities(&[mount("", Mode::SingleNodeWriter)], Some("xfs")).unwrap(), FsType::Xfs);
        assert_eq!(check_capabilities(std::slice::from_ref(&block), None).unwrap(), FsType::Raw);
        assert!(check_capabilities(&[], None).is_err());
        assert!(check_capabilities(&[mount("", Mode::MultiNodeMultiWriter)], None).is_err());
        assert!(check_capabilities(&[mount("xfs", Mode::SingleNodeWriter)], Some("ext4")).is_err());
        assert!(check_capabilities(&[mount("", Mode::SingleNodeWriter), block], None).is_err());
        assert!(check_capabilities(&[mount("btrfs", Mode::SingleNodeWriter)], None).is_err());
    }
}
