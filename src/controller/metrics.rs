//! The controller's Prometheus metrics (`GET /metrics` on `healthAddress`).
//!
//! NodeRegistry calls are counted by method and gRPC code as they are answered; nodes,
//! pool blocks, volumes and volume streams are read from the registry and the volume book
//! at scrape time. Until the state is loaded (a Kubernetes-mode candidate waiting for the
//! lease) only leadership and the request counter are exposed.

use std::sync::{Arc, OnceLock};

use super::store::Registry as NodeRegistry;
use super::volumes::VolumeBook;
use crate::obs::health::Condition;
use crate::obs::metrics::{CounterVec, Encoder, Registry};

/// The controller's registry, and the state its collector reads once it is loaded.
pub struct ControllerMetrics {
    pub registry: Arc<Registry>,
    /// NodeRegistry calls by method and code.
    pub requests: Arc<CounterVec>,
    state: Arc<OnceLock<(Arc<NodeRegistry>, Arc<VolumeBook>)>>,
}

impl ControllerMetrics {
    /// `leading`: the readiness condition that says whether this process leads.
    pub fn new(leading: Condition) -> Self {
        let registry = Registry::new();
        let requests = registry.counter(
            "nodeplane_controller_requests_total",
            "NodeRegistry (agent API) calls answered, by method and gRPC status code.",
            &["method", "code"],
        );
        let state: Arc<OnceLock<(Arc<NodeRegistry>, Arc<VolumeBook>)>> = Arc::new(OnceLock::new());
        let s = state.clone();
        registry.collector(move |enc| collect(&leading, s.get(), enc));
        ControllerMetrics { registry, requests, state }
    }

    /// The state is loaded: expose it from now on.
    pub fn loaded(&self, registry: Arc<NodeRegistry>, book: Arc<VolumeBook>) {
        let _ = self.state.set((registry, book));
    }
}

fn collect(leading: &Condition, state: Option<&(Arc<NodeRegistry>, Arc<VolumeBook>)>, enc: &mut Encoder) {
    enc.gauge(
        "nodeplane_controller_leader",
        "1 while this controller leads (always, with the embedded store), else 0.",
        if leading.is_ready() { 1.0 } else { 0.0 },
    );
    let Some((registry, book)) = state else { return };
    enc.gauge("nodeplane_controller_nodes", "Nodes registered.", registry.snapshot().nodes.len() as f64);
    let pools = registry.pool_usage();
    enc.gauge_vec(
        "nodeplane_controller_pool_blocks",
        "Node blocks a cluster pool holds.",
        &["pool"],
        pools.iter().map(|(p, _)| (vec![p.net.to_string()], p.block_count() as f64)),
    );
    enc.gauge_vec(
        "nodeplane_controller_pool_blocks_allocated",
        "Node blocks of a cluster pool assigned to nodes.",
        &["pool"],
        pools.iter().map(|(p, used)| (vec![p.net.to_string()], *used as f64)),
    );
    let s = book.stats();
    enc.gauge_vec(
        "nodeplane_controller_volumes",
        "Volumes recorded, by state (creating, ready, deleting).",
        &["state"],
        [("creating", s.creating), ("ready", s.ready), ("deleting", s.deleting)]
            .map(|(state, n)| (vec![state.to_string()], n as f64)),
    );
    enc.gauge("nodeplane_controller_snapshots", "Snapshots recorded (in any state).", s.snapshots as f64);
    enc.gauge(
        "nodeplane_controller_volume_streams",
        "Open WatchVolumes streams: agents connected to converge volumes.",
        s.streams as f64,
    );
}
