//! The agent's Prometheus metrics (`GET /metrics` on `healthAddress`).
//!
//! Counted as the work happens: CNI requests from the shim (by command and result) and CSI
//! Node calls (kept by the node service). Read at scrape time from the state itself: IPAM
//! blocks and leases, the volume store and the CSI records, the device plugins' device
//! lists, the connection to the controller.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};

use super::cluster::Link;
use crate::devices::deviceplugin::plugin::{HEALTHY, UNHEALTHY};
use crate::net::datapath::Datapath;
use crate::obs::metrics::{Counters, Histograms, Registry, gauge, gauges, latency_histogram};

/// The labels of a CNI request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CniLabels {
    command: &'static str,
    /// `ok`, or the CNI error code answered.
    result: String,
}

/// CNI request metrics, updated for every request the shim brings.
pub struct CniMetrics {
    operations: Counters<CniLabels>,
    durations: Histograms<CniLabels>,
}

impl CniMetrics {
    /// `command`: the CNI command (`ADD`, …, or `unknown` when it is not one); `code`: the
    /// CNI error code answered, `None` for success (labelled `ok`).
    pub fn observe(&self, command: &'static str, code: Option<u32>, seconds: f64) {
        let labels = CniLabels { command, result: code.map_or_else(|| "ok".into(), |c| c.to_string()) };
        self.operations.get_or_create(&labels).inc();
        self.durations.get_or_create(&labels).observe(seconds);
    }
}

/// What the collectors read (and the node API's status).
#[derive(Clone)]
pub struct Sources {
    pub cfg: Arc<super::config::Config>,
    pub dp: Arc<Datapath>,
    pub csi: Option<Arc<crate::storage::csi::NodeService>>,
    /// Set when device plugins are configured.
    pub devices: Option<crate::devices::deviceplugin::Inventory>,
    /// Set in controller mode.
    pub link: Option<Arc<Link>>,
    /// What kubelet answered each plugin's registration.
    pub kubelet: crate::kubelet::Registrations,
    /// Set when the node serves Services.
    pub services: Option<Arc<super::service_sync::ServiceClient>>,
}

impl fmt::Debug for Sources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sources").field("node", &self.cfg.node_name).finish_non_exhaustive()
    }
}

/// The agent's registry and the handle the CNI server counts with.
pub fn build(src: Sources) -> (Arc<Registry>, Arc<CniMetrics>) {
    let registry = Registry::new();
    let cni = Arc::new(CniMetrics {
        operations: Counters::default(),
        durations: Histograms::new_with_constructor(latency_histogram),
    });
    registry.register(
        "nodeplane_cni_operations",
        "CNI requests answered, by command and result (ok, or the CNI error code).",
        cni.operations.clone(),
    );
    registry.register(
        "nodeplane_cni_operation_duration_seconds",
        "Time the agent took to answer a CNI request, by command and result.",
        cni.durations.clone(),
    );
    registry.register(
        "nodeplane_cni_step_duration_seconds",
        "Time of each step of a CNI request inside the agent, by command and step.",
        src.dp.steps.clone(),
    );
    if let Some(s) = &src.services {
        registry.register(
            "nodeplane_services_sync_duration_seconds",
            "Time to program one Services update from the controller (a snapshot or one change), \
             as kube-proxy's sync_proxy_rules_duration_seconds.",
            s.sync_seconds.clone(),
        );
    }
    if let Some(svc) = &src.csi {
        registry.register(
            "nodeplane_csi_operations",
            "CSI Node calls answered, by method and gRPC status code.",
            svc.operations.clone(),
        );
        registry.register(
            "nodeplane_csi_operation_duration_seconds",
            "Time to answer a CSI Node call that did volume work, by method.",
            svc.durations.clone(),
        );
    }
    registry.register_collector(src);
    (registry, cni)
}

/// The gauges, read from the state at every scrape.
impl Collector for Sources {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let enc = &mut enc;
        gauges(
            enc,
            "nodeplane_build_info",
            "The running agent: 1, labelled with its version and node.",
            [([("version", env!("CARGO_PKG_VERSION")), ("node", self.cfg.node_name.as_str())], 1)],
        )?;
        let usage = self.dp.ipam().block_usage();
        gauges(
            enc,
            "nodeplane_ipam_block_addresses",
            "Pod addresses a block can hand out (network, gateway and IPv4 broadcast excluded).",
            usage.iter().map(|(b, _)| ([("block", b.net.to_string())], b.capacity() as f64)),
        )?;
        gauges(
            enc,
            "nodeplane_ipam_block_allocated",
            "Pod addresses of a block held by leases (ADDs in progress included).",
            usage.iter().map(|(b, used)| ([("block", b.net.to_string())], *used as u64)),
        )?;
        gauge(
            enc,
            "nodeplane_ipam_leases",
            "Attachments (container, interface) holding addresses on this node.",
            self.dp.ipam().lease_count(),
        )?;
        if let Some(svc) = &self.csi {
            let u = svc.store.usage();
            gauge(enc, "nodeplane_csi_volumes", "Volumes in this node's volume store.", u.volumes)?;
            gauge(
                enc,
                "nodeplane_csi_capacity_bytes",
                "Bytes this node offers for volumes (csi.capacityBytes).",
                u.capacity_bytes,
            )?;
            gauge(
                enc,
                "nodeplane_csi_provisioned_bytes",
                "Sum of the sizes of the volumes in this node's store.",
                u.provisioned_bytes,
            )?;
            if let Some(p) = svc.store.last_pool_usage() {
                let pool = || [("pool", p.pool.clone())];
                gauges(
                    enc,
                    "nodeplane_csi_pool_size_bytes",
                    "Data size of the lvm backend's thin pool.",
                    [(pool(), p.size_bytes)],
                )?;
                gauges(
                    enc,
                    "nodeplane_csi_pool_provisioned_bytes",
                    "Sum of the virtual sizes of the volumes and snapshots in the thin pool.",
                    [(pool(), p.provisioned_bytes)],
                )?;
                gauges(
                    enc,
                    "nodeplane_csi_pool_data_used_ratio",
                    "Share of the thin pool's data space in use (0 to 1).",
                    [(pool(), p.data_percent / 100.0)],
                )?;
                gauges(
                    enc,
                    "nodeplane_csi_pool_metadata_used_ratio",
                    "Share of the thin pool's metadata space in use (0 to 1).",
                    [(pool(), p.metadata_percent / 100.0)],
                )?;
                gauges(
                    enc,
                    "nodeplane_csi_pool_short",
                    "1 while the thin pool's data or metadata use is at the short mark (no new volumes are placed).",
                    [(pool(), u64::from(p.short))],
                )?;
            }
            let m = svc.mount_counts();
            gauge(enc, "nodeplane_csi_staged", "Volumes staged on this node (NodeStageVolume done).", m.staged)?;
            gauge(
                enc,
                "nodeplane_csi_staging",
                "Volume stages in progress, or interrupted and waiting for a retry or recovery.",
                m.staging,
            )?;
            gauge(
                enc,
                "nodeplane_csi_published",
                "Target paths volumes are published at (NodePublishVolume done).",
                m.published,
            )?;
        }
        if let Some(inv) = &self.devices {
            let health = inv.health();
            gauges(
                enc,
                "nodeplane_device_plugin_devices",
                "Device IDs advertised to kubelet, by resource and health (a device shared N ways counts N times).",
                health.iter().flat_map(|r| {
                    let resource = r.resource.as_str();
                    [
                        ([("resource", resource), ("health", HEALTHY)], r.healthy),
                        ([("resource", resource), ("health", UNHEALTHY)], r.unhealthy),
                    ]
                }),
            )?;
        }
        gauges(
            enc,
            "nodeplane_kubelet_plugin_registered",
            "1 while kubelet has registered a plugin this agent serves (CSI driver, device plugin resource), else 0.",
            self.kubelet.rows().iter().map(|(k, n, ok)| ([("kind", k.as_str()), ("plugin", n.as_str())], *ok as u64)),
        )?;
        if let Some(s) = &self.services {
            let (services, ports, endpoints) = s.proxy.counts();
            gauge(enc, "nodeplane_services", "Services this node proxies.", services)?;
            gauge(enc, "nodeplane_service_ports", "Service ports this node proxies.", ports)?;
            gauge(enc, "nodeplane_service_endpoints", "Endpoints of the service ports this node proxies.", endpoints)?;
            gauge(
                enc,
                "nodeplane_services_revision",
                "The revision of the controller's Services in force on this node (0 before the first).",
                s.standing.lock().unwrap().revision,
            )?;
        }
        if let Some(link) = &self.link {
            gauge(
                enc,
                "nodeplane_controller_connected",
                "1 while the agent is registered with the controller and follows its membership stream, else 0.",
                link.connected() as u64,
            )?;
            if let Some(t) = link.last_message() {
                gauge(
                    enc,
                    "nodeplane_controller_last_message_timestamp_seconds",
                    "Unix time of the last message from the controller (registration answer, block or membership update).",
                    t,
                )?;
            }
            wireguard(enc, link)?;
        }
        Ok(())
    }
}

/// The WireGuard device's peers, read from the kernel at the scrape (encryption on or strict).
fn wireguard(enc: &mut DescriptorEncoder, link: &Link) -> fmt::Result {
    use crate::net::wireguard::{Mode, read_device};
    if link.encryption().0 == Mode::Off {
        return Ok(());
    }
    let Ok(dev) = read_device() else {
        return gauge(enc, "nodeplane_wireguard_peers", "Peers of this node's WireGuard device.", 0u64);
    };
    gauge(enc, "nodeplane_wireguard_peers", "Peers of this node's WireGuard device.", dev.peers.len() as u64)?;
    let by_peer = |f: fn(&crate::sys::wireguard::Peer) -> f64| {
        dev.peers.iter().map(move |p| ([("endpoint", p.endpoint.map(|e| e.to_string()).unwrap_or_default())], f(p)))
    };
    gauges(
        enc,
        "nodeplane_wireguard_peer_last_handshake_timestamp_seconds",
        "Unix time of the last completed handshake with a peer (0: none yet), by the peer's endpoint.",
        by_peer(|p| p.last_handshake as f64),
    )?;
    gauges(
        enc,
        "nodeplane_wireguard_peer_received_bytes",
        "Bytes received from a peer since its entry was made (a key change starts it again).",
        by_peer(|p| p.rx_bytes as f64),
    )?;
    gauges(
        enc,
        "nodeplane_wireguard_peer_sent_bytes",
        "Bytes sent to a peer since its entry was made (a key change starts it again).",
        by_peer(|p| p.tx_bytes as f64),
    )
}
