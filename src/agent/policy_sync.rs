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

use super::cluster::{Backoff, Conn, LinkError, open};
use super::config::Config;
use crate::net::datapath::{Datapath, PodEvent};
use crate::net::policy::{Enforcer, NftError, PolicyError};
use crate::rpc::controller as pb;
use crate::rpc::controller::network_policies_client::NetworkPoliciesClient;

/// How long an ADD waits for the controller's answer and for its revision to be in force.
const ADD_WAIT: Duration = Duration::from_secs(5);

/// Why a pod's policy could not be put in force, or the policy stream ended.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Nft(#[from] NftError),
    #[error(transparent)]
    View(#[from] PolicyError),
    #[error("cannot confirm the network policy of pod {pod}: {source}")]
    Unconfirmed { pod: String, source: LinkError },
    #[error(
        "the network policy of pod {pod} (revision {revision}) was not in force within {ADD_WAIT:?}; the policy stream: {stream}"
    )]
    NotInForce { pod: String, revision: u64, stream: &'static str },
    #[error("applying the view: {0}")]
    Task(#[from] tokio::task::JoinError),
}

pub struct PolicyClient {
    cfg: Arc<Config>,
    pub enforcer: Arc<Enforcer>,
    /// The connection for the calls of ADD and DEL.
    conn: Conn,
    handle: tokio::runtime::Handle,
    /// Whether the policy stream is connected (for status and readiness).
    pub connected: std::sync::atomic::AtomicBool,
    /// Why enforcement is off, when it is (see [`PolicyClient::enforcement`]).
    pub broken: Mutex<Broken>,
}

/// Where the bridge sysctls of the agent's (the node's) network namespace are.
const BRIDGE_SYSCTL_DIR: &str = "/proc/sys/net/bridge";

/// What keeps NetworkPolicy from being enforced on this node.
#[derive(Debug, Default)]
pub struct Broken {
    /// The bridge sysctls could not be set (br_netfilter not loaded, typically): tried again
    /// by [`Broken::recheck`].
    pub sysctls: Option<String>,
    /// The anti-spoofing table could not be made at start.
    pub table: Option<String>,
}

impl Broken {
    /// Set the bridge sysctls in `dir` again when they were missing; `Err` names every
    /// problem left.
    fn recheck(&mut self, dir: &std::path::Path) -> Result<(), String> {
        if self.sysctls.is_some() {
            match bridge_sysctls(dir) {
                Ok(()) => {
                    tracing::info!(
                        "bridge sysctls set: traffic between pods of this node goes through the policy table"
                    );
                    self.sysctls = None;
                }
                Err(e) => self.sysctls = Some(e),
            }
        }
        let problems: Vec<&str> = [self.sysctls.as_deref(), self.table.as_deref()].into_iter().flatten().collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(format!("NetworkPolicy is not enforced: {}", problems.join("; ")))
        }
    }
}

/// Send bridged traffic through the `inet` policy table: `bridge-nf-call-iptables` and
/// `-ip6tables` set to 1 in `dir` (`/proc/sys/net/bridge`). They exist only while the
/// br_netfilter module is loaded, which nothing does on demand and the agent's image cannot
/// (no modprobe): the error says what the node's admin has to do.
fn bridge_sysctls(dir: &std::path::Path) -> Result<(), String> {
    use crate::sys::features::{Availability, bridge_netfilter};
    match bridge_netfilter(dir) {
        Availability::Available => {}
        Availability::Missing(why) | Availability::Unknown(why) => {
            return Err(format!(
                "{why}: traffic between pods of this node bypasses NetworkPolicy; load it on the node \
                 (modprobe br_netfilter, and list it in /etc/modules-load.d/)"
            ));
        }
    }
    for key in crate::net::policy::BRIDGE_SYSCTLS {
        let name = key.rsplit('.').next().unwrap_or(key);
        let path = dir.join(name);
        std::fs::write(&path, "1").map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// `namespace/name` of a lease's pod, when the runtime named both.
fn pod_key(pod: &str) -> Option<(&str, &str)> {
    pod.split_once('/').filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
}

impl PolicyClient {
    /// Whether NetworkPolicy is enforced on this node (the `networkpolicy` readiness
    /// condition). Bridge sysctls that could not be set are tried again, so a node whose
    /// admin loads br_netfilter after the agent started is enforced without a restart.
    pub fn enforcement(&self) -> Result<(), String> {
        self.broken.lock().unwrap_or_else(|p| p.into_inner()).recheck(std::path::Path::new(BRIDGE_SYSCTL_DIR))
    }

    fn pod_address(ns: &str, name: &str, ips: &[IpAddr]) -> pb::PodAddress {
        pb::PodAddress {
            namespace: ns.to_string(),
            name: name.to_string(),
            ips: ips.iter().map(|i| i.to_string()).collect(),
        }
    }

    /// The datapath's hook (a blocking thread of the ADD or DEL).
    fn on_event(self: &Arc<Self>, ev: PodEvent<'_>) -> Result<(), SyncError> {
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
                    let call = async {
                        let (token, ch) = me.conn.get().await?;
                        NetworkPoliciesClient::new(ch)
                            .pod_started(token.authed(req))
                            .await
                            .map(|r| r.into_inner())
                            .map_err(LinkError::call("PodStarted"))
                    };
                    let r = tokio::time::timeout(ADD_WAIT, call)
                        .await
                        .unwrap_or_else(|_| Err(LinkError::Timeout("PodStarted", ADD_WAIT)));
                    if r.is_err() {
                        me.conn.reset().await;
                    }
                    r
                });
                let a = answer.map_err(|source| SyncError::Unconfirmed { pod: pod.to_string(), source })?;
                if a.isolated && !self.enforcer.wait_for(a.revision, ADD_WAIT) {
                    let connected = self.connected.load(std::sync::atomic::Ordering::SeqCst);
                    let stream = if connected { "connected" } else { "disconnected" };
                    return Err(SyncError::NotInForce { pod: pod.to_string(), revision: a.revision, stream });
                }
                Ok(())
            }
            PodEvent::Stopped { pod, host_if, .. } => {
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
                        let (token, ch) = me.conn.get().await?;
                        NetworkPoliciesClient::new(ch)
                            .pod_stopped(token.authed(req))
                            .await
                            .map_err(LinkError::call("PodStopped"))
                    };
                    let after = Duration::from_secs(10);
                    if let Err(e) = tokio::time::timeout(after, r)
                        .await
                        .unwrap_or_else(|_| Err(LinkError::Timeout("PodStopped", after)))
                    {
                        tracing::warn!(error = %e, "PodStopped");
                        me.conn.reset().await;
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
    async fn session(self: &Arc<Self>, dp: &Arc<Datapath>) -> Result<(), SyncError> {
        let (token, channel) = open(&self.conn.cc).await?;
        let mut client = NetworkPoliciesClient::new(channel);
        let me = self.cfg.node_name.clone();
        let mut stream = client
            .watch_policy(token.authed(pb::WatchPolicyRequest { node_name: me.clone() }))
            .await
            .map_err(LinkError::call("WatchPolicy"))?
            .into_inner();
        client
            .report_pods(token.authed(pb::ReportPodsRequest { node_name: me, pods: Self::local_pods(dp) }))
            .await
            .map_err(LinkError::call("ReportPods"))?;
        self.connected.store(true, std::sync::atomic::Ordering::SeqCst);
        loop {
            let u = match stream.message().await {
                Ok(Some(u)) => u,
                Ok(None) => return Err(LinkError::Closed("policy").into()),
                Err(s) => return Err(LinkError::call("WatchPolicy")(s).into()),
            };
            let enforcer = self.enforcer.clone();
            let (rev, snap) = (u.revision, u.snapshot);
            tokio::task::spawn_blocking(move || enforcer.apply(&u)).await??;
            tracing::debug!(revision = rev, snapshot = snap, "policy applied");
        }
    }
}

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
        enforcer: Arc::new(Enforcer::new()),
        conn: Conn::new(cc),
        handle: tokio::runtime::Handle::current(),
        connected: Default::default(),
        broken: Mutex::new(Broken::default()),
    });
    // Not set yet: `recheck` below sets them (or says why it cannot).
    let mut broken = Broken { sysctls: Some("not set yet".into()), table: None };
    let veths =
        dp.ipam().leases().into_iter().map(|l| (l.host_if.clone(), l.ips.iter().map(|n| n.ip()).collect())).collect();
    if let Err(e) = client.enforcer.start(veths) {
        broken.table = Some(format!("anti-spoofing table: {e}"));
    }
    if let Err(why) = broken.recheck(std::path::Path::new(BRIDGE_SYSCTL_DIR)) {
        tracing::error!(problems = %why, "NetworkPolicy cannot be enforced on this node");
    }
    *client.broken.lock().unwrap() = broken;
    let c = client.clone();
    dp.set_pod_hook(Box::new(move |ev| c.on_event(ev).map_err(Into::into)));
    Some(client)
}

/// Follow the controller's policy stream forever (reconnecting with backoff).
pub async fn run(client: Arc<PolicyClient>, dp: Arc<Datapath>) {
    let mut backoff = Backoff::new();
    loop {
        let started = std::time::Instant::now();
        let r = client.session(&dp).await;
        client.connected.store(false, std::sync::atomic::Ordering::SeqCst);
        if let Err(e) = r {
            tracing::warn!(error = %e, "policy stream ended");
        }
        backoff.pause(started.elapsed() > Duration::from_secs(10)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without br_netfilter (no sysctl directory) the reason names the module and what to do;
    /// once the module is loaded, the next check sets the sysctls and clears it; a table
    /// problem stays.
    #[test]
    fn missing_bridge_sysctls_are_reported_then_set_when_they_appear() {
        let root = std::env::temp_dir().join(format!("np-policy-sysctls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = root.join("bridge");
        std::fs::create_dir_all(&root).unwrap();
        let mut b = Broken { sysctls: Some("not set yet".into()), table: None };
        let e = b.recheck(&dir).unwrap_err();
        assert!(e.contains("br_netfilter module is not loaded"), "{e}");
        assert!(e.contains("modprobe br_netfilter"), "{e}");
        assert!(e.contains("bypasses NetworkPolicy"), "{e}");
        // The module is loaded meanwhile: its sysctls appear (as 0).
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables"] {
            std::fs::write(dir.join(f), "0").unwrap();
        }
        b.recheck(&dir).unwrap();
        for f in ["bridge-nf-call-iptables", "bridge-nf-call-ip6tables"] {
            assert_eq!(std::fs::read_to_string(dir.join(f)).unwrap(), "1", "{f}");
        }
        assert_eq!(b.sysctls, None);
        b.table = Some("anti-spoofing table: nft failed".into());
        assert_eq!(b.recheck(&dir).unwrap_err(), "NetworkPolicy is not enforced: anti-spoofing table: nft failed");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
