//! The agent as the node's CSI plugin: Identity and Node over
//! `<kubelet>/plugins/csi.nodeplane.dev/csi.sock`, and kubelet plugin registration over
//! `<kubelet>/plugins_registry/csi.nodeplane.dev-reg.sock` (no registrar sidecar).
//!
//! Start-up order: the CSI socket is served first with `Probe` answering not-ready and Node
//! calls answering UNAVAILABLE; the node service rebuilds its view (records, mount table,
//! loop table); then it turns ready; only then does the registration socket appear, so
//! kubelet never finds a plugin it cannot use.

pub mod capability;
pub mod node;
pub mod snapshot;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::obs::metrics::GrpcLabels;
use crate::rpc::csi;
use node::MethodLabels;
pub use node::{CsiError, NodeService, NodeSettings};

pub const DRIVER_NAME: &str = "csi.nodeplane.dev";
pub const TOPOLOGY_KEY: &str = "topology.csi.nodeplane.dev/node";
/// CSI spec versions this plugin speaks, as kubelet's registration expects them.
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// Where the sockets live under a kubelet root.
pub fn csi_socket(kubelet_dir: &Path) -> PathBuf {
    kubelet_dir.join("plugins").join(DRIVER_NAME).join("csi.sock")
}
pub fn registration_socket(kubelet_dir: &Path) -> PathBuf {
    kubelet_dir.join("plugins_registry").join(format!("{DRIVER_NAME}-reg.sock"))
}

pub(crate) fn ready_or_unavailable(svc: &NodeService) -> Result<(), Status> {
    if svc.ready() { Ok(()) } else { Err(Status::unavailable("the node plugin is still initialising")) }
}

/// Run one blocking node operation off the async workers, logging and counting its outcome.
async fn blocking<T, F>(svc: &Arc<NodeService>, op: &'static str, volume: String, f: F) -> Result<Response<T>, Status>
where
    T: Send + 'static,
    F: FnOnce(&NodeService) -> Result<T, CsiError> + Send + 'static,
{
    let out = run_blocking(svc, op, volume, f).await;
    let code = match &out {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    };
    svc.operations.get_or_create(&GrpcLabels::new(op, code)).inc();
    out
}

async fn run_blocking<T, F>(
    svc: &Arc<NodeService>,
    op: &'static str,
    volume: String,
    f: F,
) -> Result<Response<T>, Status>
where
    T: Send + 'static,
    F: FnOnce(&NodeService) -> Result<T, CsiError> + Send + 'static,
{
    ready_or_unavailable(svc)?;
    let svc2 = svc.clone();
    let started = std::time::Instant::now();
    // Every event of the operation carries the volume (JSON logs: the "span" object).
    let span = tracing::info_span!("csi", op, volume = %volume);
    let out = tokio::task::spawn_blocking(move || span.in_scope(|| f(&svc2)))
        .await
        .map_err(|e| Status::internal(format!("{op} panicked: {e}")))?;
    svc.durations.get_or_create(&MethodLabels { method: op }).observe(started.elapsed().as_secs_f64());
    let micros = started.elapsed().as_micros() as u64;
    match out {
        Ok(v) => {
            tracing::debug!(op, volume = %volume, micros, "csi ok");
            Ok(Response::new(v))
        }
        Err(e) => {
            tracing::warn!(op, volume = %volume, code = ?e.code, error = %e.msg, micros, "csi request failed");
            Err(e.into())
        }
    }
}

/// Identity service (same answers on every node; the controller serves the same plugin).
#[derive(Clone)]
pub struct Identity {
    /// Readiness source; `None` when always ready (the controller's copy).
    pub node: Option<Arc<NodeService>>,
}

#[tonic::async_trait]
impl csi::identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }
    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
        let svc =
            |t: service::Type| csi::PluginCapability { r#type: Some(Type::Service(Service { r#type: t as i32 })) };
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: vec![
                svc(service::Type::ControllerService),
                svc(service::Type::VolumeAccessibilityConstraints),
                csi::PluginCapability {
                    r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                        r#type: volume_expansion::Type::Online as i32,
                    })),
                },
            ],
        }))
    }
    async fn probe(&self, _: Request<csi::ProbeRequest>) -> Result<Response<csi::ProbeResponse>, Status> {
        let ready = self.node.as_ref().is_none_or(|n| n.ready());
        Ok(Response::new(csi::ProbeResponse { ready: Some(ready) }))
    }
}

/// Node service (gRPC face of [`NodeService`]).
#[derive(Clone)]
pub struct Node(pub Arc<NodeService>);

#[tonic::async_trait]
impl csi::node_server::Node for Node {
    async fn node_stage_volume(
        &self,
        r: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let r = r.into_inner();
        blocking(&self.0, "NodeStageVolume", r.volume_id.clone(), move |s| {
            s.stage(&r).map(|()| csi::NodeStageVolumeResponse {})
        })
        .await
    }
    async fn node_unstage_volume(
        &self,
        r: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let r = r.into_inner();
        blocking(&self.0, "NodeUnstageVolume", r.volume_id.clone(), move |s| {
            s.unstage(&r).map(|()| csi::NodeUnstageVolumeResponse {})
        })
        .await
    }
    async fn node_publish_volume(
        &self,
        r: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let r = r.into_inner();
        blocking(&self.0, "NodePublishVolume", r.volume_id.clone(), move |s| {
            s.publish(&r).map(|()| csi::NodePublishVolumeResponse {})
        })
        .await
    }
    async fn node_unpublish_volume(
        &self,
        r: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let r = r.into_inner();
        blocking(&self.0, "NodeUnpublishVolume", r.volume_id.clone(), move |s| {
            s.unpublish(&r).map(|()| csi::NodeUnpublishVolumeResponse {})
        })
        .await
    }
    async fn node_get_volume_stats(
        &self,
        r: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let r = r.into_inner();
        blocking(&self.0, "NodeGetVolumeStats", r.volume_id.clone(), move |s| s.stats(&r)).await
    }
    async fn node_expand_volume(
        &self,
        r: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let r = r.into_inner();
        blocking(&self.0, "NodeExpandVolume", r.volume_id.clone(), move |s| s.expand(&r)).await
    }
    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc};
        let caps = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::ExpandVolume,
            rpc::Type::VolumeCondition,
            rpc::Type::SingleNodeMultiWriter,
            rpc::Type::VolumeMountGroup,
        ]
        .into_iter()
        .map(|t| csi::NodeServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
        .collect();
        Ok(Response::new(csi::NodeGetCapabilitiesResponse { capabilities: caps }))
    }
    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(self.0.info()))
    }
}

/// Serve CSI Identity + Node, recover, then offer the registration socket to kubelet
/// (recording in `book` what kubelet answers; `None`: a registrar sidecar registers the
/// driver); until `shutdown` resolves. Sockets are removed on the way out (registration first).
pub async fn serve(
    svc: Arc<NodeService>,
    book: Option<crate::kubelet::Registrations>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let kubelet = svc.settings.kubelet_dir.clone();
    let csi_path = csi_socket(&kubelet);
    let reg_path = registration_socket(&kubelet);
    let csi_listener =
        crate::sys::fs::bind_unix_socket(&csi_path).map_err(|e| format!("binding {}: {e}", csi_path.display()))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let csi_server = tonic::transport::Server::builder()
        .layer(crate::rpc::response_layer())
        .add_service(csi::identity_server::IdentityServer::new(Identity { node: Some(svc.clone()) }))
        .add_service(csi::node_server::NodeServer::new(Node(svc.clone())))
        .serve_with_incoming_shutdown(crate::rpc::authority::incoming(csi_listener), stopped(stop_rx.clone()));
    let csi_task = tokio::spawn(csi_server);
    tracing::info!(socket = %csi_path.display(), "CSI Identity and Node served (not ready yet)");

    let s = svc.clone();
    let report = tokio::task::spawn_blocking(move || {
        // A crash during a snapshot's copy leaves its volume's filesystem frozen: thaw first.
        s.thaw_staged();
        s.recover()
    })
    .await
    .map_err(|e| e.to_string())?;
    match report {
        Ok(r) => tracing::info!(
            staged = r.staged,
            published = r.published,
            rolled_back = r.rolled_back_stages,
            dropped_publish_records = r.dropped_publish_records,
            detached = r.detached,
            orphans = r.orphans,
            closed_mappings = r.closed_mappings,
            "CSI node recovered; ready"
        ),
        Err(e) => return Err(format!("CSI node recovery: {e}")),
    }

    let reg_task = match &book {
        Some(book) => {
            let registration = crate::kubelet::registration::Registration {
                info: crate::kubelet::registration::PluginInfo {
                    kind: crate::kubelet::Kind::Csi,
                    plugin_type: "CSIPlugin",
                    name: DRIVER_NAME.into(),
                    endpoint: csi_path.clone(),
                    versions: SUPPORTED_VERSIONS.iter().map(|s| s.to_string()).collect(),
                },
                book: book.clone(),
            };
            Some(crate::kubelet::registration::serve(&reg_path, registration, stopped(stop_rx))?)
        }
        None => {
            // node-driver-registrar owns the registration socket and hears kubelet's answer.
            tracing::info!("CSI registration left to the node-driver-registrar sidecar (csi.selfRegister false)");
            None
        }
    };

    shutdown.await;
    if let Some(book) = &book {
        let _ = std::fs::remove_file(&reg_path);
        book.withdrawn(DRIVER_NAME);
    }
    let _ = stop_tx.send(true);
    if let Some(t) = reg_task {
        let _ = t.await;
    }
    let _ = csi_task.await;
    let _ = std::fs::remove_file(&csi_path);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use csi::identity_server::Identity as _;
    use csi::node_server::Node as _;

    #[tokio::test]
    async fn not_ready_until_recovered() {
        let t = crate::util::TestDir::new("csi-ready");
        let store = crate::storage::store::VolumeStore::open(&t.0.join("volumes"), 1 << 30).unwrap();
        std::fs::create_dir_all(t.0.join("kubelet")).unwrap();
        let settings = NodeSettings {
            node_id: "n1".into(),
            kubelet_dir: t.0.join("kubelet").canonicalize().unwrap(),
            record_dir: t.0.join("csi"),
            max_volumes: 8,
        };
        let svc = Arc::new(NodeService::new(settings, Arc::new(store)).unwrap());
        let id = Identity { node: Some(svc.clone()) };
        let node = Node(svc.clone());
        assert_eq!(id.probe(Request::new(csi::ProbeRequest {})).await.unwrap().into_inner().ready, Some(false));
        let r = node
            .node_unstage_volume(Request::new(csi::NodeUnstageVolumeRequest {
                volume_id: "v".into(),
                staging_target_path: "/x".into(),
            }))
            .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::Unavailable);
        svc.recover().unwrap();
        assert_eq!(id.probe(Request::new(csi::ProbeRequest {})).await.unwrap().into_inner().ready, Some(true));
        // Ready: the same call is now judged on its merits (unknown volume).
        let r = node
            .node_unstage_volume(Request::new(csi::NodeUnstageVolumeRequest {
                volume_id: "v".into(),
                staging_target_path: svc.settings.kubelet_dir.join("p").to_string_lossy().into_owned(),
            }))
            .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::NotFound);
        // Both calls counted, under the method and the code answered; only the call that ran
        // is timed.
        let registry = crate::obs::metrics::Registry::new();
        registry.register("ops", "", svc.operations.clone());
        registry.register("seconds", "", svc.durations.clone());
        let text = registry.render();
        for sample in [
            "ops_total{method=\"NodeUnstageVolume\",code=\"Unavailable\"} 1\n",
            "ops_total{method=\"NodeUnstageVolume\",code=\"NotFound\"} 1\n",
            "seconds_count{method=\"NodeUnstageVolume\"} 1\n",
        ] {
            assert!(text.contains(sample), "{sample} in {text}");
        }
        assert_eq!(text.matches("ops_total{").count(), 2, "{text}");
        assert_eq!(svc.mount_counts(), node::MountCounts::default());
    }
}
