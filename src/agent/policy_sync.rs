//! NetworkPolicy, the agent's half: follow the controller's compiled view for this node
//! (`WatchPolicy`: a snapshot, then changes) into the node's enforcement
//! (`crate::net::policy::Enforcer`), and tell the controller of every pod attached and
//! detached, so its address is in every peer set that selects it.
//!
//! A pod's ADD returns only once its own policy is in force: the datapath calls [`hook`]
//! before answering; the pod's veth gets its anti-spoofing entry, the controller learns the
//! pod (`PodStarted`, answering the revision that carries it), and when a policy isolates
//! the pod, the ADD waits until the stream has brought that revision into the kernel. A
//! controller that cannot be asked fails the ADD with "try again" (code 11): a pod is never
//! started open when a policy should hold it.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cluster::{authed, read_token};
use super::config::{Config, ControllerConfig};
use crate::net::datapath::{Datapath, PodEvent};
use crate::net::policy::Enforcer;
use crate::rpc::controller as pb;
use crate::rpc::controller::network_policies_client::NetworkPoliciesClient;

/// How long an ADD waits for the controller's answer and for its revision to be in force.
const ADD_WAIT: Duration = Duration::from_secs(5);

pub struct PolicyClient {
    cfg: Arc<Config>,
    cc: ControllerConfig,
    pub enforcer: Arc<Enforcer>,
    /// One connection for the calls of ADD and DEL (made on first use, dropped on failure).
    channel: tokio::sync::Mutex<Option<tonic::transport::Channel>>,
    handle: tokio::runtime::Handle,
    /// Whether the policy stream is connected (for status and readiness).
    pub connected: std::sync::atomic::AtomicBool,
    /// Why enforcement is off, when it is (bridge sysctls missing…).
    pub broken: Mutex<Option<String>>,
}

/// `namespace/name` of a lease's pod, when the runtime named both.
fn pod_key(pod: &str) -> Option<(&str, &str)> {
    pod.split_once('/').filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
}

impl PolicyClient {
    async fn client(&self) -> Result<NetworksClient, String> {
        let mut ch = self.channel.lock().await;
        if ch.is_none() {
            *ch = Some(
                crate::rpc::connect_with(&self.cc.address, self.cc.tls.as_ref())
                    .await
                    .map_err(|e| format!("connect: {e}"))?,
            );
        }
        Ok(NetworkPoliciesClient::new(ch.clone().expect("set above")))
    }

    async fn forget_channel(&self) {
        *self.channel.lock().await = None;
    }

    fn pod_address(ns: &str, name: &str, ips: &[IpAddr]) -> pb::PodAddress {
        pb::PodAddress {
            namespace: ns.to_string(),
            name: name.to_string(),
            ips: ips.iter().map(|i| i.to_string()).collect(),
        }
    }

    /// The datapath's hook (a blocking thread of the ADD or DEL).
    fn on_event(self: &Arc<Self>, ev: PodEvent<'_>) -> Result<(), String> {
        match ev {
            PodEvent::Started { pod, host_if, ips } => {
                let ips: Vec<IpAddr> = ips.iter().map(|n| n.ip()).collect();
                self.enforcer.attach(host_if, &ips)?;
                let Some((ns, name)) = pod_key(pod) else { return Ok(()) };
                let me = self.clone();
                let req = pb::PodStartedRequest {
                    node_name: self.cfg.node_name.clone(),
                    pod: Some(Self::pod_address(ns, name, &ips)),
                };
                let answer = self.handle.block_on(async move {
                    let token = read_token(&me.cc.token_file)?;
                    let call = async {
                        let mut c = me.client().await?;
                        c.pod_started(authed(req, &token)?)
                            .await
                            .map(|r| r.into_inner())
                            .map_err(|s| format!("PodStarted: {:?}: {}", s.code(), s.message()))
                    };
                    match tokio::time::timeout(ADD_WAIT, call).await {
                        Ok(Ok(a)) => Ok(a),
                        Ok(Err(e)) => {
                            me.forget_channel().await;
                            Err(e)
                        }
                        Err(_) => {
                            me.forget_channel().await;
                            Err(format!("the controller did not answer PodStarted within {ADD_WAIT:?}"))
                        }
                    }
                });
                let a = answer.map_err(|e| format!("cannot confirm the network policy of pod {pod}: {e}"))?;
                if a.isolated && !self.enforcer.wait_for(a.revision, ADD_WAIT) {
                    return Err(format!(
                        "the network policy of pod {pod} (revision {}) was not in force within {ADD_WAIT:?}; the policy stream: {}",
                        a.revision,
                        if self.connected.load(std::sync::atomic::Ordering::SeqCst) {
                            "connected"
                        } else {
                            "disconnected"
                        }
                    ));
                }
                Ok(())
            }
            PodEvent::Stopped { pod, host_if } => {
                self.enforcer.detach(host_if);
                let Some((ns, name)) = pod_key(pod) else { return Ok(()) };
                // Told in the background: DEL never waits for the controller (a missed one is
                // corrected by the full report when the stream reconnects).
                let me = self.clone();
                let req = pb::PodStoppedRequest {
                    node_name: self.cfg.node_name.clone(),
                    pod: Some(Self::pod_address(ns, name, &[])),
                };
                self.handle.spawn(async move {
                    let r = async {
                        let token = read_token(&me.cc.token_file)?;
                        let mut c = me.client().await?;
                        c.pod_stopped(authed(req, &token)?)
                            .await
                            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
                    };
                    if let Err(e) = tokio::time::timeout(Duration::from_secs(10), r)
                        .await
                        .unwrap_or_else(|_| Err("timed out".into()))
                    {
                        tracing::warn!(error = %e, "PodStopped");
                        me.forget_channel().await;
                    }
                });
                Ok(())
            }
        }
    }

    /// Every pod of the node now, for `ReportPods`.
    fn local_pods(dp: &Datapath) -> Vec<pb::PodAddress> {
        dp.ipam()
            .leases()
            .into_iter()
            .filter_map(|l| {
                let (ns, name) = pod_key(&l.pod)?;
                let ips: Vec<IpAddr> = l.ips.iter().map(|n| n.ip()).collect();
                Some(Self::pod_address(ns, name, &ips))
            })
            .collect()
    }

    /// One stream: report the node's pods, then apply the view as it comes.
    async fn session(self: &Arc<Self>, dp: &Arc<Datapath>) -> Result<(), String> {
        let token = read_token(&self.cc.token_file)?;
        let channel = crate::rpc::connect_with(&self.cc.address, self.cc.tls.as_ref())
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let mut client = NetworkPoliciesClient::new(channel);
        let me = self.cfg.node_name.clone();
        let mut stream = client
            .watch_policy(authed(pb::WatchPolicyRequest { node_name: me.clone() }, &token)?)
            .await
            .map_err(|s| format!("WatchPolicy: {:?}: {}", s.code(), s.message()))?
            .into_inner();
        client
            .report_pods(authed(pb::ReportPodsRequest { node_name: me, pods: Self::local_pods(dp) }, &token)?)
            .await
            .map_err(|s| format!("ReportPods: {:?}: {}", s.code(), s.message()))?;
        self.connected.store(true, std::sync::atomic::Ordering::SeqCst);
        loop {
            let u = match stream.message().await {
                Ok(Some(u)) => u,
                Ok(None) => return Err("the controller closed the policy stream".into()),
                Err(s) => return Err(format!("WatchPolicy: {:?}: {}", s.code(), s.message())),
            };
            let enforcer = self.enforcer.clone();
            let (rev, snap) = (u.revision, u.snapshot);
            tokio::task::spawn_blocking(move || enforcer.apply(&u)).await.map_err(|e| e.to_string())??;
            tracing::debug!(revision = rev, snapshot = snap, "policy applied");
        }
    }
}

type NetworksClient = NetworkPoliciesClient<tonic::transport::Channel>;

/// Set up enforcement on this node (controller mode with `networkPolicy`): the bridge
/// sysctls, the anti-spoofing table from the node's leases, the datapath hook. Returns the
/// client whose [`run`] follows the controller.
pub fn install(cfg: &Arc<Config>, dp: &Arc<Datapath>) -> Option<Arc<PolicyClient>> {
    let cc = cfg.controller.clone()?;
    if !cfg.network_policy {
        tracing::info!("networkPolicy: false: NetworkPolicy is not enforced on this node");
        return None;
    }
    let client = Arc::new(PolicyClient {
        cfg: cfg.clone(),
        cc,
        enforcer: Arc::new(Enforcer::new()),
        channel: tokio::sync::Mutex::new(None),
        handle: tokio::runtime::Handle::current(),
        connected: Default::default(),
        broken: Mutex::new(None),
    });
    let mut problems = Vec::new();
    for key in crate::net::policy::BRIDGE_SYSCTLS {
        if let Err(e) = crate::sys::netns::write_sysctl(key, "1") {
            problems.push(format!("{key}: {e} (is br_netfilter loaded?)"));
        }
    }
    let veths =
        dp.ipam().leases().into_iter().map(|l| (l.host_if.clone(), l.ips.iter().map(|n| n.ip()).collect())).collect();
    if let Err(e) = client.enforcer.start(veths) {
        problems.push(format!("anti-spoofing table: {e}"));
    }
    if !problems.is_empty() {
        let why = problems.join("; ");
        tracing::error!(problems = %why, "NetworkPolicy cannot be enforced on this node");
        *client.broken.lock().unwrap() = Some(why);
    }
    let c = client.clone();
    dp.set_pod_hook(Box::new(move |ev| c.on_event(ev)));
    Some(client)
}

/// Follow the controller's policy stream forever (reconnecting with backoff).
pub async fn run(client: Arc<PolicyClient>, dp: Arc<Datapath>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let started = std::time::Instant::now();
        let r = client.session(&dp).await;
        client.connected.store(false, std::sync::atomic::Ordering::SeqCst);
        if let Err(e) = r {
            tracing::warn!(error = %e, "policy stream ended");
        }
        if started.elapsed() > Duration::from_secs(10) {
            backoff = Duration::from_millis(100);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
