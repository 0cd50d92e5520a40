//! The controller's Prometheus metrics (`GET /metrics` on `healthAddress`).
//!
//! NodeRegistry calls are counted by method and gRPC code as they are answered; nodes,
//! pool blocks, volumes and volume streams are read from the registry and the volume book
//! at scrape time. Until the state is loaded (a Kubernetes-mode candidate waiting for the
//! lease) only leadership and the request counter are exposed.

use std::fmt;
use std::sync::{Arc, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::store::Registry as NodeRegistry;
use super::volumes::VolumeBook;
use crate::obs::health::Condition;
use crate::obs::metrics::{Counters, GrpcLabels, Registry, gauge, gauges};

/// The controller's registry, and the state its collector reads once it is loaded.
pub struct ControllerMetrics {
    pub registry: Arc<Registry>,
    /// NodeRegistry calls by method and code.
    pub requests: Counters<GrpcLabels>,
    state: Arc<OnceLock<(Arc<NodeRegistry>, Arc<VolumeBook>)>>,
}

impl ControllerMetrics {
    /// `leading`: the readiness condition that says whether this process leads.
    pub fn new(leading: Condition) -> Self {
        let registry = Registry::new();
        let requests = Counters::default();
        registry.register(
            "nodeplane_controller_requests",
            "NodeRegistry (agent API) calls answered, by method and gRPC status code.",
            requests.clone(),
        );
        let state = Arc::new(OnceLock::new());
        registry.register_collector(Gauges { leading, state: state.clone() });
        ControllerMetrics { registry, requests, state }
    }

    /// The state is loaded: expose it from now on.
    pub fn loaded(&self, registry: Arc<NodeRegistry>, book: Arc<VolumeBook>) {
        let _ = self.state.set((registry, book));
    }
}

/// What the gauges are read from at every scrape.
struct Gauges {
    leading: Condition,
    state: Arc<OnceLock<(Arc<NodeRegistry>, Arc<VolumeBook>)>>,
}

impl fmt::Debug for Gauges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gauges").field("loaded", &self.state.get().is_some()).finish_non_exhaustive()
    }
}

impl Collector for Gauges {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let enc = &mut enc;
        gauge(
            enc,
            "nodeplane_controller_leader",
            "1 while this controller leads (always, with the embedded store), else 0.",
            self.leading.is_ready() as u64,
        )?;
        let Some((registry, book)) = self.state.get() else { return Ok(()) };
        gauge(enc, "nodeplane_controller_nodes", "Nodes registered.", registry.snapshot().nodes.len())?;
        let pools = registry.pool_usage();
        gauges(
            enc,
            "nodeplane_controller_pool_blocks",
            "Node blocks a cluster pool holds.",
            pools.iter().map(|(p, _)| ([("pool", p.net.to_string())], p.block_count() as f64)),
        )?;
        gauges(
            enc,
            "nodeplane_controller_pool_blocks_allocated",
            "Node blocks of a cluster pool assigned to nodes.",
            pools.iter().map(|(p, used)| ([("pool", p.net.to_string())], *used as u64)),
        )?;
        let s = book.stats();
        gauges(
            enc,
            "nodeplane_controller_volumes",
            "Volumes recorded, by state (creating, ready, deleting).",
            [("creating", s.creating), ("ready", s.ready), ("deleting", s.deleting)]
                .map(|(state, n)| ([("state", state)], n)),
        )?;
        gauge(enc, "nodeplane_controller_snapshots", "Snapshots recorded (in any state).", s.snapshots)?;
        gauge(
            enc,
            "nodeplane_controller_volume_streams",
            "Open WatchVolumes streams: agents connected to converge volumes.",
            s.streams,
        )
    }
}
