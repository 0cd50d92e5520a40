//! `nodeplane.node.v1.NodeStatus` on the node API socket: what `nodeplane status` and
//! `nodeplane doctor` show. Everything is read from the agent's live state and the kernel at
//! the time of the call; the doctor judges each attachment and volume under the same lock
//! its CNI or CSI calls take.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::obs::doctor::{Finding, Repair};
use crate::rpc::node as api;

/// The `format` field of both reports (and of their JSON rendering); bumped when a field
/// changes meaning.
pub const FORMAT: u32 = 1;

#[derive(Clone)]
pub struct NodeStatus {
    /// The parts of the agent, as the metrics read them.
    pub src: super::metrics::Sources,
    pub health: crate::obs::health::Health,
    /// The kernel features probed at start-up.
    pub kernel: Arc<crate::sys::features::KernelReport>,
    pub started: std::time::SystemTime,
}

impl NodeStatus {
    fn status(&self) -> api::StatusReport {
        let cfg = &self.src.cfg;
        let controller = cfg.controller.as_ref().map(|c| {
            let link = self.src.link.as_ref();
            let last = link.and_then(|l| l.last_message());
            let persisted = super::cluster::load_state(cfg).ok();
            api::ControllerLink {
                address: c.address.clone(),
                connected: link.is_some_and(|l| l.connected()),
                last_message_unix: last,
                last_message_seconds_ago: last.map(|t| (crate::obs::metrics::unix_now() - t).max(0.0)),
                blocks: persisted.map(|s| api::BlockList { cidrs: s.blocks.iter().map(|b| b.to_string()).collect() }),
                encryption: link.map(|l| l.encryption().0).unwrap_or_default().to_string(),
                wireguard: link.and_then(|l| wireguard_status(&l.encryption())),
            }
        });
        let conditions = self
            .health
            .snapshot()
            .into_iter()
            .map(|(name, ready, detail)| api::Condition { name, ready, detail })
            .collect();
        api::StatusReport {
            format: FORMAT,
            node: cfg.node_name.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            started_unix: self.started.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            mode: if cfg.controller.is_some() { api::Mode::Controller } else { api::Mode::Standalone } as i32,
            conditions,
            network: Some(self.src.dp.report()),
            controller,
            storage: self.src.csi.as_ref().map(|c| c.report()),
            device_plugins: self.src.devices.as_ref().map(|d| d.report()),
            kubelet: Some(self.src.kubelet.report()),
            kernel: Some(super::kernel::status(&self.kernel)),
            services: self.src.services.as_ref().map(|s| s.report()),
        }
    }

    fn doctor(&self, repair: bool) -> api::DoctorReport {
        // One doctor at a time: two would judge (and repair) the same objects at once.
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
        let mut findings: Vec<Finding> = Vec::new();
        let mut errors: Vec<String> = Vec::new();
        match self.src.dp.doctor(repair) {
            Ok((f, skipped)) => {
                findings.extend(f);
                errors.extend(skipped.into_iter().map(|s| format!("network: {s}")));
            }
            Err(e) => errors.push(format!("network: {e}")),
        }
        if let Some(csi) = &self.src.csi {
            if !csi.ready() {
                errors.push("storage: CSI recovery has not finished; storage not checked".into());
            } else {
                match csi.doctor(repair) {
                    Ok((f, skipped)) => {
                        findings.extend(f);
                        errors.extend(skipped.into_iter().map(|s| format!("storage: {s}")));
                    }
                    Err(e) => errors.push(format!("storage: {}", e.msg)),
                }
            }
        }
        for f in &findings {
            match &f.repair {
                Some(Repair::Done(m)) => tracing::info!(kind = f.kind, subject = %f.subject, "doctor repaired: {m}"),
                Some(Repair::Failed(m)) => {
                    tracing::warn!(kind = f.kind, subject = %f.subject, "doctor repair failed: {m}")
                }
                _ => tracing::info!(kind = f.kind, subject = %f.subject, detail = %f.detail, "doctor found"),
            }
        }
        api::DoctorReport {
            format: FORMAT,
            node: self.src.cfg.node_name.clone(),
            repair,
            findings: findings.into_iter().map(finding).collect(),
            errors,
        }
    }
}

/// The WireGuard device as the kernel has it (encryption on or strict).
fn wireguard_status((mode, key): &(crate::net::wireguard::Mode, String)) -> Option<api::Wireguard> {
    if *mode == crate::net::wireguard::Mode::Off {
        return None;
    }
    let mut out = api::Wireguard { public_key: key.clone(), ..Default::default() };
    match crate::net::wireguard::read_device() {
        Ok(dev) => {
            out.listen_port = dev.listen_port as u32;
            out.peers = dev
                .peers
                .iter()
                .map(|p| api::WireguardPeer {
                    public_key: crate::net::wireguard::encode_key(&p.public_key),
                    endpoint: p.endpoint.map(|e| e.to_string()).unwrap_or_default(),
                    allowed_ips: p.allowed.iter().map(|a| a.to_string()).collect(),
                    last_handshake_unix: p.last_handshake,
                    rx_bytes: p.rx_bytes,
                    tx_bytes: p.tx_bytes,
                })
                .collect();
        }
        Err(e) => out.error = e.to_string(),
    }
    Some(out)
}

fn finding(f: Finding) -> api::Finding {
    let repair = f.repair.map(|r| {
        let (result, message) = match r {
            Repair::Done(m) => (api::RepairResult::Done, m),
            Repair::Failed(m) => (api::RepairResult::Failed, m),
            Repair::Skipped(m) => (api::RepairResult::Skipped, m),
        };
        api::Repair { result: result as i32, message }
    });
    api::Finding { kind: f.kind.to_string(), subject: f.subject, detail: f.detail, repair }
}

#[tonic::async_trait]
impl api::node_status_server::NodeStatus for NodeStatus {
    async fn get_status(&self, _: Request<api::GetStatusRequest>) -> Result<Response<api::GetStatusResponse>, Status> {
        let me = self.clone();
        let status = crate::rpc::blocking(move || me.status()).await?;
        Ok(Response::new(api::GetStatusResponse { status: Some(status) }))
    }

    async fn doctor(&self, r: Request<api::DoctorRequest>) -> Result<Response<api::DoctorResponse>, Status> {
        let repair = r.into_inner().repair;
        let me = self.clone();
        let report = crate::rpc::blocking(move || me.doctor(repair)).await?;
        Ok(Response::new(api::DoctorResponse { report: Some(report) }))
    }

    async fn rotate_wireguard_key(
        &self,
        _: Request<api::RotateWireguardKeyRequest>,
    ) -> Result<Response<api::RotateWireguardKeyResponse>, Status> {
        let link =
            self.src.link.as_ref().ok_or_else(|| Status::failed_precondition("standalone mode: no encryption"))?;
        let (mode, old) = link.encryption();
        if mode == crate::net::wireguard::Mode::Off || old.is_empty() || !link.connected() {
            return Err(Status::failed_precondition(format!(
                "encryption is {mode} and the node is {}registered with the controller",
                if link.connected() { "" } else { "not " }
            )));
        }
        link.rotate.notify_one();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while link.encryption().1 == old {
            if tokio::time::Instant::now() >= deadline {
                return Err(Status::deadline_exceeded("the new key did not reach the controller within 10 s"));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Ok(Response::new(api::RotateWireguardKeyResponse { old_public_key: old, public_key: link.encryption().1 }))
    }
}

/// Serve the node API socket until `shutdown`: `NodeStatus` always, `NodeVolumes` when the
/// CSI node plugin is on (it answers UNAVAILABLE until CSI recovery is done).
pub async fn serve_node_api(
    status: NodeStatus,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let path = status.src.cfg.node_socket.clone();
    let volumes = status
        .src
        .csi
        .clone()
        .map(|svc| api::node_volumes_server::NodeVolumesServer::new(crate::storage::node_api::NodeVolumes(svc)));
    let server = tonic::transport::Server::builder()
        .layer(crate::rpc::response_layer())
        .add_service(api::node_status_server::NodeStatusServer::new(status))
        .add_optional_service(volumes)
        .serve_with_incoming_shutdown(crate::rpc::authority::incoming(listener), shutdown);
    tracing::info!(socket = %path.display(), "node API served");
    let r = server.await.map_err(|e| e.to_string());
    let _ = std::fs::remove_file(&path);
    r
}
