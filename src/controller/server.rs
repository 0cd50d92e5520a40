//! The gRPC face of the registry (`nodeplane.controller.v1.NodeRegistry`).

use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::auth::{Authority, Identity};
use super::config::Config;
use super::dra::DraError;
use super::records::{NodeRecord, last_states};
use super::store::{Change, Registry, RegistryError, Snapshot, Start};
use crate::net::wireguard::Mode;
use crate::obs::metrics::{Counters, GrpcLabels};
use crate::rpc::controller as pb;
use crate::rpc::controller::node_registry_server::NodeRegistry;
use crate::util::Family;

pub struct Service {
    pub registry: Arc<Registry>,
    pub volumes: Arc<super::volumes::VolumeBook>,
    pub authority: Arc<Authority>,
    pub cfg: Arc<Config>,
    /// Flipped to true on shutdown: ends every membership stream (agents reconnect).
    pub stopping: tokio::sync::watch::Receiver<bool>,
    /// Calls answered, by method and gRPC code (see `super::metrics`).
    pub requests: Counters<GrpcLabels>,
    /// In a cluster: registration follows the Node objects.
    pub node_gate: Option<Arc<super::kube::nodes::NodeGate>>,
    /// The DRA devices nodes report (published as ResourceSlices).
    pub devices: Arc<super::dra::DeviceBook>,
    /// Where claims are read (Kubernetes mode).
    pub claims: Option<Arc<super::kube::slices::KubeClaims>>,
    /// Events on Node objects (Kubernetes mode).
    pub node_events: Option<Arc<super::kube::events::NodeEvents>>,
}

impl From<RegistryError> for Status {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::NotFound(_) => Status::not_found(e.to_string()),
            RegistryError::InvalidArgument(_) => Status::invalid_argument(e.to_string()),
            RegistryError::FailedPrecondition(_) => Status::failed_precondition(e.to_string()),
            RegistryError::Exhausted { .. } => Status::resource_exhausted(e.to_string()),
            RegistryError::Storage(_) => Status::unavailable(e.to_string()),
        }
    }
}

pub fn to_pb(r: &NodeRecord) -> pb::Node {
    pb::Node {
        name: r.name.clone(),
        underlay_addresses: r.underlay.clone(),
        pod_blocks: r.blocks.clone(),
        vtep_mac: r.vtep_mac.clone(),
        wireguard_key: r.wireguard_key.clone(),
    }
}

/// Membership snapshots being built and queued at once (see `do_watch_nodes`).
static SNAPSHOTS_IN_FLIGHT: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(16);
/// Nodes per part of a snapshot sent to a client with deltas (about 20 KB).
const SNAPSHOT_PART: usize = 256;

fn node_list(s: &Snapshot, epoch: u64) -> pb::NodeList {
    pb::NodeList {
        nodes: s.nodes.iter().map(to_pb).collect(),
        revision: s.revision,
        snapshot: true,
        epoch,
        ..Default::default()
    }
}

/// One delta from the registry at `base` through `changes` (consecutive, in order): the
/// last state of every node touched, each named once.
fn delta(base: u64, changes: &[Arc<Change>], epoch: u64) -> pb::NodeList {
    let (written, removed) = last_states(changes.iter().map(|c| (&c.upserts[..], &c.removed[..])), |r| &r.name);
    pb::NodeList {
        nodes: written.into_iter().map(to_pb).collect(),
        removed,
        revision: changes.last().map_or(base, |c| c.revision),
        base_revision: base,
        epoch,
        ..Default::default()
    }
}

impl Service {
    /// Who calls: a verified client certificate (mTLS) names its node; else the bearer
    /// token does. With both, they must name the same node: a node certificate with
    /// another node's (or the admin's) token is refused, not upgraded.
    async fn identity<T>(&self, req: &Request<T>) -> Result<Identity, Status> {
        let from_cert = match req.peer_certs() {
            Some(certs) if !certs.is_empty() => {
                let node = crate::rpc::tls::node_of_certificate(&certs[0])
                    .map_err(|e| Status::unauthenticated(e.to_string()))?;
                if !crate::controller::records::valid_node_name(&node) {
                    return Err(Status::unauthenticated(format!(
                        "the client certificate names {node:?}, which is not a valid node name"
                    )));
                }
                Some(node)
            }
            _ => None,
        };
        let header = match req.metadata().get("authorization") {
            None => None,
            Some(v) => Some(v.to_str().map_err(|_| Status::unauthenticated("malformed authorization header"))?),
        };
        match (from_cert, header) {
            (Some(node), None) => Ok(Identity::Node(node)),
            (Some(node), Some(h)) => {
                let by_token = self.authority.identify(h).await?;
                if by_token != Identity::Node(node.clone()) {
                    return Err(Status::unauthenticated(format!(
                        "the client certificate names node {node:?} but the bearer token names {by_token:?}"
                    )));
                }
                Ok(by_token)
            }
            (None, Some(h)) => self.authority.identify(h).await,
            (None, None) => Err(Status::unauthenticated("missing authorization (Bearer token or client certificate)")),
        }
    }

    /// For the object calls of the other services: only the admin may `what`.
    pub(crate) async fn admin<T>(&self, req: &Request<T>, what: &str) -> Result<(), Status> {
        match self.identity(req).await? {
            Identity::Admin => Ok(()),
            Identity::Node(n) => Err(Status::permission_denied(format!("node {n:?} may not {what}"))),
        }
    }

    /// The pod blocks the registry gave `node` (none: not registered).
    pub(crate) fn node_blocks(&self, node: &str) -> Vec<String> {
        self.registry.snapshot().nodes.iter().find(|n| n.name == node).map(|n| n.blocks.clone()).unwrap_or_default()
    }

    /// May the caller act for `node`? (also for the controller's other services)
    pub(crate) async fn authorize<T>(&self, req: &Request<T>, node: &str) -> Result<Identity, Status> {
        let who = self.identity(req).await?;
        if !who.may_act_for(node) {
            tracing::warn!(caller = ?who, node, "rejected: a node may act only for itself");
            return Err(Status::permission_denied(format!("this credential may not act for node {node:?}")));
        }
        Ok(who)
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Registry) -> Result<T, RegistryError> + Send + 'static,
    ) -> Result<T, Status> {
        let reg = self.registry.clone();
        Ok(crate::rpc::blocking(move || f(&reg)).await??)
    }
}

type NodeStream = Pin<Box<dyn Stream<Item = Result<pb::NodeList, Status>> + Send>>;
type VolumeStream = Pin<Box<dyn Stream<Item = Result<pb::VolumeSet, Status>> + Send>>;

impl Service {
    /// Answer one call, counted (for the streams: whether the stream was opened).
    async fn counted<T>(
        &self,
        method: &'static str,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let r = call.await;
        let code = r.as_ref().err().map_or(tonic::Code::Ok, |s| s.code());
        self.requests.get_or_create(&GrpcLabels::new(method, code)).inc();
        r
    }
}

/// The service: every method answers through [`Service::counted`].
#[tonic::async_trait]
impl NodeRegistry for Service {
    async fn register(&self, req: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        self.counted("Register", async move {
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            // A bad name is INVALID_ARGUMENT whatever the cluster holds (before the Node lookup).
            if let Some(why) = super::records::subdomain_error(&node) {
                return Err(Status::invalid_argument(format!("node name {node:?} {why}")));
            }
            if let Some(gate) = &self.node_gate {
                gate.admit(&node).await.map_err(|e| match e {
                    super::kube::nodes::AdmitError::Refused(m) => {
                        tracing::warn!(node = %node, reason = %m, "registration refused");
                        Status::failed_precondition(m)
                    }
                    super::kube::nodes::AdmitError::Unavailable(m) => Status::unavailable(m),
                })?;
            }
            let r = req.into_inner();
            let rec = self
                .blocking(move |reg| {
                    reg.register_node(&r.node_name, &r.underlay_addresses, &r.vtep_mac, &r.wireguard_key)
                })
                .await?;
            tracing::info!(node = %rec.name, blocks = ?rec.blocks, underlay = ?rec.underlay, "registered");
            Ok(Response::new(pb::RegisterResponse {
                node: Some(to_pb(&rec)),
                cluster_cidrs: self.cfg.cluster_cidrs(),
                vxlan_vni: self.cfg.vxlan_vni,
                vxlan_port: self.cfg.vxlan_port as u32,
                encryption: match self.cfg.encryption.mode {
                    Mode::Off => pb::Encryption::Off,
                    Mode::On => pb::Encryption::On,
                    Mode::Strict => pb::Encryption::Strict,
                } as i32,
                wireguard_port: self.cfg.encryption.port as u32,
                key_rotation_seconds: self.cfg.encryption.key_rotation_seconds,
            }))
        })
        .await
    }

    async fn request_block(
        &self,
        req: Request<pb::RequestBlockRequest>,
    ) -> Result<Response<pb::RequestBlockResponse>, Status> {
        self.counted("RequestBlock", async move {
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            let family = match pb::Family::try_from(req.get_ref().family) {
                Ok(pb::Family::Ipv4) => Family::V4,
                Ok(pb::Family::Ipv6) => Family::V6,
                _ => return Err(Status::invalid_argument("family must be FAMILY_IPV4 or FAMILY_IPV6")),
            };
            let rec = self.blocking(move |reg| reg.request_block(&node, family)).await?;
            tracing::info!(node = %rec.name, blocks = ?rec.blocks, "extra block");
            Ok(Response::new(pb::RequestBlockResponse { node: Some(to_pb(&rec)) }))
        })
        .await
    }

    type WatchNodesStream = NodeStream;

    async fn watch_nodes(&self, req: Request<pb::WatchNodesRequest>) -> Result<Response<NodeStream>, Status> {
        self.counted("WatchNodes", async move {
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            let r = req.into_inner();
            let mut stopping = self.stopping.clone();
            let (tx, out) = tokio::sync::mpsc::channel(4);
            let registry = self.registry.clone();
            if !r.deltas {
                // A client without deltas: the full list now and after every change
                // (intermediate states coalesce: each message is complete).
                let mut rx = registry.subscribe();
                tokio::spawn(async move {
                    loop {
                        rx.borrow_and_update();
                        let snap = registry.snapshot();
                        let list = node_list(&snap, registry.epoch());
                        if tx.send(Ok(list)).await.is_err() {
                            return;
                        }
                        tokio::select! {
                            changed = rx.changed() => if changed.is_err() { return },
                            _ = stopping.wait_for(|s| *s) => return,
                            _ = tx.closed() => return,
                        }
                    }
                });
                return Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out)) as NodeStream));
            }
            tokio::spawn(async move {
                let epoch = registry.epoch();
                let mut at = if r.epoch == epoch { r.since_revision } else { 0 };
                'resume: loop {
                    let (start, mut rx) = registry.follow(epoch, at);
                    let sent = match start {
                        Start::Snapshot(snap) => {
                            // Snapshots are O(nodes) each: a few at a time, so a reconnect storm
                            // of every agent does not hold one copy per agent at once.
                            let Ok(_permit) = SNAPSHOTS_IN_FLIGHT.acquire().await else { return };
                            at = snap.revision;
                            // In parts: a long-lived stream keeps an encoding buffer as large as
                            // its largest message.
                            let parts = snap.nodes.len().div_ceil(SNAPSHOT_PART).max(1);
                            let mut sent = Ok(());
                            for i in 0..parts {
                                let nodes = snap.nodes.iter().skip(i * SNAPSHOT_PART).take(SNAPSHOT_PART);
                                let part = pb::NodeList {
                                    nodes: nodes.map(to_pb).collect(),
                                    revision: snap.revision,
                                    snapshot: true,
                                    epoch,
                                    more: i + 1 < parts,
                                    ..Default::default()
                                };
                                sent = tx.send(Ok(part)).await;
                                if sent.is_err() {
                                    break;
                                }
                            }
                            sent
                        }
                        Start::Changes(changes) => {
                            let d = delta(at, &changes, epoch);
                            at = d.revision;
                            tx.send(Ok(d)).await
                        }
                    };
                    if sent.is_err() {
                        return;
                    }
                    loop {
                        let next = tokio::select! {
                            c = rx.recv() => c,
                            _ = stopping.wait_for(|s| *s) => return,
                            _ = tx.closed() => return,
                        };
                        let mut changes = match next {
                            Ok(c) => vec![c],
                            // Fallen behind the buffer: start again from where the client is
                            // (the history, or a snapshot).
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue 'resume,
                            Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                        };
                        // Whatever else is already waiting goes in the same message.
                        while changes.len() < 256 {
                            match rx.try_recv() {
                                Ok(c) => changes.push(c),
                                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => continue 'resume,
                                Err(_) => break,
                            }
                        }
                        changes.retain(|c| c.revision > at);
                        if changes.is_empty() {
                            continue;
                        }
                        let d = delta(at, &changes, epoch);
                        at = d.revision;
                        if tx.send(Ok(d)).await.is_err() {
                            return;
                        }
                    }
                }
            });
            Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out)) as NodeStream))
        })
        .await
    }

    async fn remove_node(
        &self,
        req: Request<pb::RemoveNodeRequest>,
    ) -> Result<Response<pb::RemoveNodeResponse>, Status> {
        self.counted("RemoveNode", async move {
            // The admin removes any node; a node may release only itself.
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            let released = self.blocking(move |reg| reg.remove(&node)).await?;
            tracing::info!(blocks = ?released, "node removed");
            Ok(Response::new(pb::RemoveNodeResponse { released_blocks: released }))
        })
        .await
    }

    type WatchVolumesStream = VolumeStream;

    async fn watch_volumes(&self, req: Request<pb::WatchVolumesRequest>) -> Result<Response<VolumeStream>, Status> {
        self.counted("WatchVolumes", async move {
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            let r = req.into_inner();
            let book = self.volumes.clone();
            // Woken only by changes of this node's set.
            let mut rx = book.subscribe_node(&node);
            let mut stopping = self.stopping.clone();
            let (tx, out) = tokio::sync::mpsc::channel(4);
            // The revision the client holds: a resume within this epoch gets what changed since.
            let mut held = (r.deltas && r.epoch == book.epoch() && r.since_revision > 0).then_some(r.since_revision);
            tracing::info!(node = %node, deltas = r.deltas, resume = ?held, "volume stream opened");
            tokio::spawn(async move {
                // The node counts as connected (a placement target) while this stream lives.
                let _guard = book.connect(&node);
                let mut first = true;
                loop {
                    rx.borrow_and_update();
                    let next = if r.deltas {
                        // A slow client is never queued for: it gets what changed since the
                        // last message it took, however many changes that covers.
                        let (set, changed) = book.desired_since(&node, held);
                        held = Some(set.revision);
                        // The first message always goes (possibly an empty delta: "in sync").
                        (changed || first).then_some(set)
                    } else {
                        Some(book.desired(&node))
                    };
                    first = false;
                    if let Some(set) = next
                        && tx.send(Ok(set)).await.is_err()
                    {
                        break;
                    }
                    tokio::select! {
                        changed = rx.changed() => if changed.is_err() { break },
                        _ = stopping.wait_for(|s| *s) => break,
                        _ = tx.closed() => break,
                    }
                }
                tracing::info!(node = %node, "volume stream closed");
            });
            Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out)) as VolumeStream))
        })
        .await
    }

    async fn report_volumes(
        &self,
        req: Request<pb::ReportVolumesRequest>,
    ) -> Result<Response<pb::ReportVolumesResponse>, Status> {
        self.counted("ReportVolumes", async move {
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            let r = req.into_inner();
            for f in &r.failures {
                let (volume, code, error) = (&f.id, f.code, &f.message);
                tracing::warn!(node = %node, %volume, code, %error, "node could not converge a volume");
            }
            if !r.orphans.is_empty() {
                tracing::warn!(node = %node, orphans = ?r.orphans, "node holds volumes the controller does not know");
            }
            let book = self.volumes.clone();
            let pools = crate::rpc::blocking(move || book.report(r)).await??;
            for change in pools {
                self.pool_changed(&node, change);
            }
            Ok(Response::new(pb::ReportVolumesResponse {}))
        })
        .await
    }

    async fn report_devices(
        &self,
        req: Request<pb::ReportDevicesRequest>,
    ) -> Result<Response<pb::ReportDevicesResponse>, Status> {
        self.counted("ReportDevices", async move {
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            let r = req.into_inner();
            super::dra::check_report(&r)?;
            self.devices.report(&node, r.devices, r.epoch);
            Ok(Response::new(pb::ReportDevicesResponse {}))
        })
        .await
    }

    async fn get_claim(&self, req: Request<pb::GetClaimRequest>) -> Result<Response<pb::GetClaimResponse>, Status> {
        self.counted("GetClaim", async move {
            let node = req.get_ref().node_name.clone();
            self.authorize(&req, &node).await?;
            let r = req.into_inner();
            super::dra::check_claim_request(&r)?;
            let source = self.claims.as_ref().ok_or(DraError::NoApi)?;
            let claim = source
                .get(&r.namespace, &r.name)
                .await
                .map_err(|source| DraError::Source { claim: format!("{}/{}", r.namespace, r.name), source })?;
            let results = super::dra::claim_results(claim.as_ref(), &r).inspect_err(|e| {
                if let DraError::NotServed { claim, uid, why, .. } = e {
                    tracing::info!(node = %node, %claim, %uid, reason = %why, "claim not served to the node");
                }
            })?;
            Ok(Response::new(pb::GetClaimResponse { results }))
        })
        .await
    }
}

impl Service {
    /// Log a node's pool change and, in a cluster, post it as an event on the Node.
    fn pool_changed(&self, node: &str, change: super::volumes::PoolChange) {
        let backend = change.backend.as_str();
        match change.short {
            true => tracing::warn!(node = %node, backend, "storage pool short: no new volumes placed there"),
            false => tracing::info!(node = %node, backend, "storage pool has room again"),
        }
        let Some(events) = self.node_events.clone() else { return };
        let node = node.to_string();
        tokio::spawn(async move {
            if let Err(e) = events.pool(&node, change).await {
                tracing::warn!(node = %node, error = %e, "posting the pool event failed");
            }
        });
    }
}
