//! The agent's Prometheus metrics (`GET /metrics` on `healthAddress`).
//!
//! Counted as the work happens: CNI requests from the shim (by command and result) and CSI
//! Node calls (kept by the node service). Read at scrape time from the state itself: IPAM
//! blocks and leases, the volume store and the CSI records, the device plugins' device
//! lists, the connection to the controller.

use std::sync::Arc;

use super::cluster::Link;
use crate::net::datapath::Datapath;
use crate::obs::metrics::{CounterVec, Encoder, HistogramVec, LATENCY_BUCKETS, Registry};

/// CNI request metrics, updated for every request the shim brings.
pub struct CniMetrics {
    operations: Arc<CounterVec>,
    durations: Arc<HistogramVec>,
}

impl CniMetrics {
    /// `command`: the CNI command (`ADD`, …, or `unknown` when it is not one); `code`: the
    /// CNI error code answered, `None` for success (labelled `ok`).
    pub fn observe(&self, command: &str, code: Option<u32>, seconds: f64) {
        let result = code.map(|c| c.to_string());
        let labels = [command, result.as_deref().unwrap_or("ok")];
        self.operations.inc(&labels);
        self.durations.observe(&labels, seconds);
    }
}

/// What the collectors read.
pub struct Sources {
    pub node: String,
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

/// The agent's registry and the handle the CNI server counts with.
pub fn build(src: Sources) -> (Arc<Registry>, Arc<CniMetrics>) {
    let registry = Registry::new();
    let cni = Arc::new(CniMetrics {
        operations: registry.counter(
            "nodeplane_cni_operations_total",
            "CNI requests answered, by command and result (ok, or the CNI error code).",
            &["command", "result"],
        ),
        durations: registry.histogram(
            "nodeplane_cni_operation_duration_seconds",
            "Time the agent took to answer a CNI request, by command and result.",
            &["command", "result"],
            LATENCY_BUCKETS,
        ),
    });
    registry.register_histogram(src.dp.steps.clone());
    if let Some(s) = &src.services {
        registry.register_histogram(s.sync_seconds.clone());
    }
    if let Some(svc) = &src.csi {
        registry.register_counter(svc.operations.clone());
        registry.register_histogram(svc.durations.clone());
    }
    let node = src.node.clone();
    registry.collector(move |enc| collect(&src, &node, enc));
    (registry, cni)
}

fn collect(src: &Sources, node: &str, enc: &mut Encoder) {
    enc.gauge_vec(
        "nodeplane_build_info",
        "The running agent: 1, labelled with its version and node.",
        &["version", "node"],
        [(vec![env!("CARGO_PKG_VERSION").to_string(), node.to_string()], 1.0)],
    );
    let usage = src.dp.ipam().block_usage();
    enc.gauge_vec(
        "nodeplane_ipam_block_addresses",
        "Pod addresses a block can hand out (network, gateway and IPv4 broadcast excluded).",
        &["block"],
        usage.iter().map(|(b, _)| (vec![b.net.to_string()], b.capacity() as f64)),
    );
    enc.gauge_vec(
        "nodeplane_ipam_block_allocated",
        "Pod addresses of a block held by leases (ADDs in progress included).",
        &["block"],
        usage.iter().map(|(b, used)| (vec![b.net.to_string()], *used as f64)),
    );
    enc.gauge(
        "nodeplane_ipam_leases",
        "Attachments (container, interface) holding addresses on this node.",
        src.dp.ipam().lease_count() as f64,
    );
    if let Some(svc) = &src.csi {
        let u = svc.store.usage();
        enc.gauge("nodeplane_csi_volumes", "Volumes in this node's volume store.", u.volumes as f64);
        enc.gauge(
            "nodeplane_csi_capacity_bytes",
            "Bytes this node offers for volumes (csi.capacityBytes).",
            u.capacity_bytes as f64,
        );
        enc.gauge(
            "nodeplane_csi_provisioned_bytes",
            "Sum of the sizes of the volumes in this node's store.",
            u.provisioned_bytes as f64,
        );
        let m = svc.mount_counts();
        enc.gauge("nodeplane_csi_staged", "Volumes staged on this node (NodeStageVolume done).", m.staged as f64);
        enc.gauge(
            "nodeplane_csi_staging",
            "Volume stages in progress, or interrupted and waiting for a retry or recovery.",
            m.staging as f64,
        );
        enc.gauge(
            "nodeplane_csi_published",
            "Target paths volumes are published at (NodePublishVolume done).",
            m.published as f64,
        );
    }
    if let Some(inv) = &src.devices {
        let health = inv.health();
        enc.gauge_vec(
            "nodeplane_device_plugin_devices",
            "Device IDs advertised to kubelet, by resource and health (a device shared N ways counts N times).",
            &["resource", "health"],
            health.iter().flat_map(|r| {
                [
                    (
                        vec![r.resource.clone(), crate::devices::deviceplugin::plugin::HEALTHY.to_string()],
                        r.healthy as f64,
                    ),
                    (
                        vec![r.resource.clone(), crate::devices::deviceplugin::plugin::UNHEALTHY.to_string()],
                        r.unhealthy as f64,
                    ),
                ]
            }),
        );
    }
    enc.gauge_vec(
        "nodeplane_kubelet_plugin_registered",
        "1 while kubelet has registered a plugin this agent serves (CSI driver, device plugin resource), else 0.",
        &["kind", "plugin"],
        src.kubelet.rows().into_iter().map(|(k, n, ok)| (vec![k.as_str().to_string(), n], if ok { 1.0 } else { 0.0 })),
    );
    if let Some(s) = &src.services {
        let (services, ports, endpoints) = s.proxy.counts();
        enc.gauge("nodeplane_services", "Services this node proxies.", services as f64);
        enc.gauge("nodeplane_service_ports", "Service ports this node proxies.", ports as f64);
        enc.gauge("nodeplane_service_endpoints", "Endpoints of the service ports this node proxies.", endpoints as f64);
        enc.gauge(
            "nodeplane_services_revision",
            "The revision of the controller's Services in force on this node (0 before the first).",
            s.standing.lock().unwrap().revision as f64,
        );
    }
    if let Some(link) = &src.link {
        enc.gauge(
            "nodeplane_controller_connected",
            "1 while the agent is registered with the controller and follows its membership stream, else 0.",
            if link.connected() { 1.0 } else { 0.0 },
        );
        enc.gauge_vec(
            "nodeplane_controller_last_message_timestamp_seconds",
            "Unix time of the last message from the controller (registration answer, block or membership update).",
            &[],
            link.last_message().map(|t| (Vec::new(), t)),
        );
    }
}
