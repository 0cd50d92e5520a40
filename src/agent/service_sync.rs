//! Services, the agent's half: follow the controller's service ports (`WatchServices`: a
//! snapshot, then changes) into the node's table ([`crate::net::services::Proxy`]).
//!
//! The agent reaches the controller by its configured address, never through a ClusterIP,
//! so the Services it programs never stand between it and its controller. With
//! `services: auto` (the default) a node where kube-proxy programs Services is left to it:
//! the agent says so in status and logs and programs nothing (checked again every 30 s).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cluster::{Backoff, open};
use super::config::{Config, ControllerConfig, ServicesMode};
use crate::net::services::Proxy;
use crate::obs::metrics::Histogram;
use crate::rpc::controller as pb;
use crate::rpc::controller::services_client::ServicesClient;

/// kube-proxy's `sync_proxy_rules_duration_seconds` buckets: 1 ms doubling to 16 s.
pub const SYNC_BUCKETS: &[f64] =
    &[0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096, 8.192, 16.384];

/// Where the node's Services stand (for status and readiness).
#[derive(Debug, Clone, Default)]
pub struct Standing {
    /// Why nothing is programmed (kube-proxy found, or a failure), when nothing is.
    pub idle: Option<String>,
    pub epoch: u64,
    pub revision: u64,
    /// The stream delivers and the table holds its snapshot.
    pub synced: bool,
}

pub struct ServiceClient {
    cfg: Arc<Config>,
    cc: ControllerConfig,
    pub proxy: Arc<Proxy>,
    pub connected: AtomicBool,
    pub standing: Mutex<Standing>,
    /// Time to program one update (the snapshot or one change), whole table or not.
    pub sync_seconds: Histogram,
}

/// Set up Services on this node (controller mode, `services` not `off`): the proxy with the
/// node's addresses.
pub fn install(cfg: &Arc<Config>) -> Option<Arc<ServiceClient>> {
    let cc = cfg.controller.clone()?;
    if cfg.services == ServicesMode::Off {
        tracing::info!("services: off: Services are not served on this node");
        remove_left_table(cfg);
        return None;
    }
    // A reply between two pods on the node's bridge must pass conntrack to be translated
    // back from an endpoint to the ClusterIP (as for NetworkPolicy).
    for key in crate::net::policy::BRIDGE_SYSCTLS {
        if let Err(e) = crate::sys::netns::write_sysctl(key, "1") {
            tracing::error!(sysctl = key, error = %e, "Services between pods of this node need it (is br_netfilter loaded?)");
        }
    }
    let proxy = Arc::new(Proxy::new(&cfg.node_name, cc.underlay_addresses.clone()));
    Some(Arc::new(ServiceClient {
        cfg: cfg.clone(),
        cc,
        proxy,
        connected: AtomicBool::new(false),
        standing: Mutex::default(),
        sync_seconds: Histogram::new(SYNC_BUCKETS.iter().copied()),
    }))
}

/// A node handed back to kube-proxy (`services: off`) may hold the table an earlier run
/// programmed: its DNAT would run beside kube-proxy's, to endpoints no one follows.
fn remove_left_table(cfg: &Config) {
    if !crate::net::services::table_present() {
        return;
    }
    match Proxy::new(&cfg.node_name, Vec::new()).remove() {
        Ok(()) => tracing::warn!("removed the Services table an earlier run left (services: off)"),
        Err(e) => tracing::error!(error = %e, "removing the Services table an earlier run left"),
    }
}

/// The largest Services message the agent reads (see `session`).
const MAX_MESSAGE: usize = 256 << 20;

/// A snapshot being received in parts.
#[derive(Default)]
struct Parts {
    ports: Vec<pb::ServicePort>,
    pod_cidrs: Vec<String>,
    revision: u64,
    epoch: u64,
}

impl ServiceClient {
    /// What `nodeplane status` shows of the node's Services.
    pub fn report(&self) -> crate::rpc::node::ServicesStatus {
        let s = self.standing.lock().unwrap().clone();
        let node = self.cfg.node_name.as_str();
        let ports = self.proxy.ports().into_values().map(|p| {
            let count = |local: bool| {
                [crate::net::services::Fam::V4, crate::net::services::Fam::V6]
                    .into_iter()
                    .map(|f| crate::net::services::usable(&p.endpoints, f, local.then_some(node)).len() as u32)
                    .sum()
            };
            crate::rpc::node::ServiceEntry {
                usable: count(false),
                local: count(true),
                endpoints: p.endpoints.len() as u32,
                id: p.id,
                port: p.port,
                cluster_ips: p.cluster_ips,
                external_ips: p.external_ips,
                node_port: p.node_port,
            }
        });
        crate::rpc::node::ServicesStatus {
            idle: s.idle.unwrap_or_default(),
            revision: s.revision,
            synced: s.synced,
            stream_connected: self.connected.load(Ordering::SeqCst),
            ports: ports.collect(),
        }
    }

    /// Whether kube-proxy is in charge here and we must stay out (`auto` only).
    fn left_to_kube_proxy(&self) -> Option<String> {
        if self.cfg.services != ServicesMode::Auto {
            return None;
        }
        crate::net::services::kube_proxy_present().map(|found| {
            format!("kube-proxy programs this node ({found}): Services are left to it (services: on overrides)")
        })
    }

    /// One stream: apply what comes until it ends, or until kube-proxy shows up.
    async fn session(&self) -> Result<(), String> {
        let (token, channel) = open(&self.cc).await.map_err(|e| e.to_string())?;
        let (epoch, since) = {
            let s = self.standing.lock().unwrap();
            if s.synced { (s.epoch, s.revision) } else { (0, 0) }
        };
        let req = pb::WatchServicesRequest { node_name: self.cfg.node_name.clone(), since_revision: since, epoch };
        // A snapshot part holds 1,000 ports and a delta every change missed, each with its
        // endpoints: more than tonic's default limit of 4 MiB in a large cluster.
        let mut stream = ServicesClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .watch_services(token.authed(req))
            .await
            .map_err(|s| format!("WatchServices: {:?}: {}", s.code(), s.message()))?
            .into_inner();
        self.connected.store(true, Ordering::SeqCst);
        let mut parts: Option<Parts> = None;
        let mut check = tokio::time::interval(Duration::from_secs(30));
        check.tick().await;
        loop {
            let u = tokio::select! {
                m = stream.message() => match m {
                    Ok(Some(u)) => u,
                    Ok(None) => return Err("the controller closed the Services stream".into()),
                    Err(s) => {
                        if s.code() == tonic::Code::OutOfRange {
                            // Over MAX_MESSAGE (a delta from an older controller): a
                            // snapshot, which comes in parts, instead of the same delta.
                            self.standing.lock().unwrap().synced = false;
                        }
                        return Err(format!("WatchServices: {:?}: {}", s.code(), s.message()));
                    }
                },
                _ = check.tick() => {
                    if let Some(why) = self.left_to_kube_proxy() {
                        return Err(why);
                    }
                    continue;
                }
            };
            if u.snapshot {
                parts = Some(Parts {
                    pod_cidrs: u.pod_cidrs.clone(),
                    revision: u.revision,
                    epoch: u.epoch,
                    ..Default::default()
                });
            }
            if let Some(p) = parts.as_mut() {
                p.ports.extend(u.ports);
                if u.more {
                    continue;
                }
                let p = parts.take().expect("set above");
                self.program(true, Some(p.pod_cidrs), p.ports, Vec::new(), p.epoch, p.revision).await?;
                continue;
            }
            let s = self.standing.lock().unwrap().clone();
            if u.epoch != s.epoch || u.base_revision != s.revision {
                self.standing.lock().unwrap().synced = false;
                return Err(format!(
                    "a change for revision {} of epoch {} while holding {} of {}: asking again",
                    u.base_revision, u.epoch, s.revision, s.epoch
                ));
            }
            self.program(false, None, u.ports, u.removed, u.epoch, u.revision).await?;
        }
    }

    async fn program(
        &self,
        replace: bool,
        pod_cidrs: Option<Vec<String>>,
        ports: Vec<pb::ServicePort>,
        removed: Vec<String>,
        epoch: u64,
        revision: u64,
    ) -> Result<(), String> {
        let proxy = self.proxy.clone();
        let applied = tokio::task::spawn_blocking(move || {
            let applied = proxy.apply(replace, pod_cidrs.as_deref(), ports, removed)?;
            applied.stale_flows.iter().for_each(|f| crate::net::services::forget_flows(f));
            Ok::<_, crate::net::policy::NftError>(applied)
        })
        .await
        .map_err(|e| e.to_string())?;
        let applied = match applied {
            Ok(a) => a,
            Err(e) => {
                let mut s = self.standing.lock().unwrap();
                (s.synced, s.idle) = (false, Some(format!("programming the table: {e}")));
                return Err(e.to_string());
            }
        };
        self.sync_seconds.observe(applied.seconds);
        let mut s = self.standing.lock().unwrap();
        *s = Standing { idle: None, epoch, revision, synced: true };
        tracing::debug!(revision, whole = applied.whole_table, seconds = applied.seconds, "services programmed");
        Ok(())
    }
}

/// Follow the controller's Services forever (reconnecting with backoff).
pub async fn run(client: Arc<ServiceClient>) {
    let mut backoff = Backoff::new();
    loop {
        if let Some(why) = client.left_to_kube_proxy() {
            let first = client.standing.lock().unwrap().idle.as_deref() != Some(why.as_str());
            if first {
                tracing::warn!(reason = %why, "Services not served");
                if let Err(e) = client.proxy.remove() {
                    tracing::warn!(error = %e, "removing the Services table");
                }
            }
            *client.standing.lock().unwrap() = Standing { idle: Some(why), ..Standing::default() };
            tokio::time::sleep(Duration::from_secs(30)).await;
            continue;
        }
        let started = std::time::Instant::now();
        let r = client.session().await;
        client.connected.store(false, Ordering::SeqCst);
        if let Err(e) = r {
            tracing::warn!(error = %e, "Services stream ended");
        }
        backoff.pause(started.elapsed() > Duration::from_secs(10)).await;
    }
}
