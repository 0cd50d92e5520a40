//! Controller mode: register with `nodeplane-controller`, keep the node's blocks (persisted,
//! so the node keeps serving while the controller is away), and program routes to every
//! other node from the membership stream.
//!
//! Every message of the stream is the complete node list, so a reconnect re-syncs routes
//! completely: nothing missed while disconnected can leave a stale or missing route.

use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};
use tonic::Request;

use super::config::{Config, ControllerConfig};
use crate::net::datapath::Datapath;
use crate::rpc::controller as pb;
use crate::rpc::controller::node_registry_client::NodeRegistryClient;
use crate::util::Family;
use crate::net::routes::{PeerNode, RouteConfig, Routes};

/// What the agent remembers from the controller (`<state>/cluster.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterState {
    pub blocks: Vec<IpNetwork>,
    pub cluster_cidrs: Vec<IpNetwork>,
    #[serde(default)]
    pub vxlan_vni: u32,
    #[serde(default)]
    pub vxlan_port: u16,
}

pub fn load_state(cfg: &Config) -> std::io::Result<ClusterState> {
    match std::fs::read(cfg.cluster_state_path()) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(ClusterState::default()),
        Err(e) => Err(e),
    }
}

fn save_state(cfg: &Config, st: &ClusterState) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(st).map_err(std::io::Error::other)?;
    crate::sys::fs::atomic_write(&cfg.cluster_state_path(), &body, 0o644)
}

fn parse_nets(list: &[String], what: &str) -> Result<Vec<IpNetwork>, String> {
    list.iter().map(|s| s.parse().map_err(|_| format!("controller sent a bad {what} {s:?}"))).collect()
}

/// A gRPC failure with the code's name (PermissionDenied, Unauthenticated, …) for the log.
fn grpc_err(op: &str, s: &tonic::Status) -> String {
    format!("{op}: {:?}: {}", s.code(), s.message())
}

/// `msg` with the bearer token; an empty token (a client certificate is the credential)
/// adds none.
pub(crate) fn authed<T>(msg: T, token: &str) -> Result<Request<T>, String> {
    let mut req = Request::new(msg);
    if token.is_empty() {
        return Ok(req);
    }
    let value = format!("Bearer {token}").parse().map_err(|_| "token is not valid header text".to_string())?;
    req.metadata_mut().insert("authorization", value);
    Ok(req)
}

pub(crate) fn read_token(path: &Path) -> Result<String, String> {
    if path.as_os_str().is_empty() {
        return Ok(String::new());
    }
    std::fs::read_to_string(path)
        .map(|t| t.trim().to_string())
        .map_err(|e| format!("reading token {}: {e}", path.display()))
}

/// The peers of `me` in a node list.
pub fn peers_of(me: &str, nodes: &[pb::Node]) -> Vec<PeerNode> {
    nodes
        .iter()
        .filter(|n| n.name != me)
        .map(|n| PeerNode {
            name: n.name.clone(),
            underlay: n.underlay_addresses.iter().filter_map(|a| a.parse::<IpAddr>().ok()).collect(),
            blocks: n.pod_blocks.iter().filter_map(|b| b.parse().ok()).collect(),
            vtep_mac: crate::net::routes::parse_mac(&n.vtep_mac).ok().flatten(),
        })
        .collect()
}

/// The state of the connection to the controller, for metrics.
#[derive(Debug, Default)]
pub struct Link {
    /// Registered, and the membership stream is open.
    connected: AtomicBool,
    /// Unix time in milliseconds of the last message from the controller (0: never).
    last_message_ms: AtomicU64,
}

impl Link {
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::SeqCst)
    }

    /// Seconds since the Unix epoch of the last message received, if any.
    pub fn last_message(&self) -> Option<f64> {
        match self.last_message_ms.load(Ordering::SeqCst) {
            0 => None,
            ms => Some(ms as f64 / 1000.0),
        }
    }

    fn message(&self) {
        let ms = (crate::obs::metrics::unix_now() * 1000.0) as u64;
        self.last_message_ms.store(ms.max(1), Ordering::SeqCst);
    }
}

/// Connection-independent state of the cluster client.
struct Client {
    cfg: Arc<Config>,
    dp: Arc<Datapath>,
    link: Arc<Link>,
    cc: ControllerConfig,
    routes: Mutex<Option<Routes>>,
    vtep_mac: Mutex<String>,
    /// Serializes applying our own record (the stream and a block request can race).
    applying: tokio::sync::Mutex<()>,
}

impl Client {
    /// Apply our own node record: new blocks go to IPAM, the bridge, nft and the conflist.
    async fn apply_self(&self, node: &pb::Node, resp: Option<&pb::RegisterResponse>) -> Result<(), String> {
        let _one_at_a_time = self.applying.lock().await;
        let blocks = parse_nets(&node.pod_blocks, "block")?;
        // Blocks the controller no longer lists for us (it gave them away after a removal)
        // must never be allocated from again; pods already using them keep their addresses.
        for gone in self.dp.ipam().retain_blocks(&blocks) {
            tracing::warn!(block = %gone.net, "block withdrawn by the controller: no new addresses from it");
        }
        let mut st = load_state(&self.cfg).map_err(|e| e.to_string())?;
        if let Some(r) = resp {
            st.cluster_cidrs = parse_nets(&r.cluster_cidrs, "cluster CIDR")?;
            st.vxlan_vni = r.vxlan_vni;
            st.vxlan_port = r.vxlan_port as u16;
        }
        let known: Vec<IpNetwork> = self.dp.ipam().blocks().iter().map(|b| b.net).collect();
        let changed = st.blocks != blocks || resp.is_some();
        if blocks.iter().all(|b| known.contains(b)) && !changed && self.dp.ready() {
            return Ok(());
        }
        st.blocks = blocks.clone();
        save_state(&self.cfg, &st).map_err(|e| format!("saving cluster state: {e}"))?;
        let dp = self.dp.clone();
        let cluster = st.cluster_cidrs.clone();
        tokio::task::spawn_blocking(move || dp.apply_network(&blocks, Some(&cluster)))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())
    }

    /// Make sure the route programmer exists (needs the VXLAN parameters from the controller).
    async fn ensure_routes(self: &Arc<Self>, vni: u32, port: u16) -> Result<(), String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut routes = me.routes.lock().unwrap();
            if routes.is_none() {
                let cfg = RouteConfig {
                    mode: me.cc.route_mode,
                    vxlan_name: "np.vxlan".into(),
                    vni,
                    port,
                    local_underlay: me.cc.underlay_addresses[0],
                    mtu: None,
                };
                let mut r = Routes::new(cfg).map_err(|e| e.to_string())?;
                let mac = r.ensure_vtep().map_err(|e| e.to_string())?;
                *me.vtep_mac.lock().unwrap() = mac.map(|m| crate::sys::netlink::format_mac(&m)).unwrap_or_default();
                *routes = Some(r);
            }
            Ok(())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    async fn sync_routes(self: &Arc<Self>, nodes: Vec<pb::Node>) -> Result<(), String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let peers = peers_of(&me.cfg.node_name, &nodes);
            let mut routes = me.routes.lock().unwrap();
            let r = routes.as_mut().ok_or("route programmer not initialised")?;
            let report = r.sync(&peers).map_err(|e| e.to_string())?;
            tracing::debug!(peers = peers.len(), ?report, "routes synced");
            Ok(())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// One connection: register, then follow the membership stream until it breaks.
    async fn session(self: &Arc<Self>, connected: &mut bool) -> Result<(), String> {
        let token = read_token(&self.cc.token_file)?;
        let channel = crate::rpc::connect_with(&self.cc.address, self.cc.tls.as_ref()).await.map_err(|e| format!("connect: {e}"))?;
        let mut client = NodeRegistryClient::new(channel);
        let underlay: Vec<String> = self.cc.underlay_addresses.iter().map(|a| a.to_string()).collect();
        let me = self.cfg.node_name.clone();
        let register = |mac: String| pb::RegisterRequest {
            node_name: me.clone(),
            underlay_addresses: underlay.clone(),
            vtep_mac: mac,
        };
        // With the VXLAN parameters remembered from an earlier registration, the device can
        // exist before the first Register, which then advertises its MAC at once.
        let remembered = load_state(&self.cfg).map_err(|e| e.to_string())?;
        if remembered.vxlan_vni != 0 {
            self.ensure_routes(remembered.vxlan_vni, remembered.vxlan_port).await?;
        }
        let sent_mac = self.vtep_mac.lock().unwrap().clone();
        let mut resp = client
            .register(authed(register(sent_mac.clone()), &token)?)
            .await
            .map_err(|s| grpc_err("register", &s))?
            .into_inner();
        self.link.message();
        self.ensure_routes(resp.vxlan_vni, resp.vxlan_port as u16).await?;
        let mac = self.vtep_mac.lock().unwrap().clone();
        if mac != sent_mac {
            // Now that the VXLAN device exists, advertise its MAC.
            resp = client
                .register(authed(register(mac), &token)?)
                .await
                .map_err(|s| grpc_err("register", &s))?
                .into_inner();
            self.link.message();
        }
        let node = resp.node.clone().ok_or("register: no node in the answer")?;
        self.apply_self(&node, Some(&resp)).await?;
        *connected = true;
        tracing::info!(blocks = ?node.pod_blocks, "registered with the controller");

        let mut stream = client
            .watch_nodes(authed(pb::WatchNodesRequest { node_name: me.clone() }, &token)?)
            .await
            .map_err(|s| grpc_err("watch", &s))?
            .into_inner();
        self.link.connected.store(true, Ordering::SeqCst);
        loop {
            let list = match stream.message().await {
                Ok(Some(l)) => {
                    self.link.message();
                    l
                }
                Ok(None) => return Err("controller closed the membership stream".into()),
                Err(s) => return Err(grpc_err("watch", &s)),
            };
            self.sync_routes(list.nodes.clone()).await?;
            match list.nodes.iter().find(|n| n.name == me) {
                Some(own) => self.apply_self(own, None).await?,
                None => {
                    // Removed from the cluster: its blocks may already belong to another node.
                    for gone in self.dp.ipam().retain_blocks(&[]) {
                        tracing::warn!(block = %gone.net, "node removed by the controller: block withdrawn");
                    }
                    return Err("this node was removed from the cluster; registering again".into());
                }
            }
        }
    }
}

/// Ask the controller for one more block of a family, from a blocking thread (ADD path).
fn request_block(handle: &tokio::runtime::Handle, client: &Arc<Client>, family: Family) -> Result<(), String> {
    let c = client.clone();
    handle.block_on(async move {
        let token = read_token(&c.cc.token_file)?;
        let channel = crate::rpc::connect_with(&c.cc.address, c.cc.tls.as_ref()).await.map_err(|e| format!("connect: {e}"))?;
        let family = match family {
            Family::V4 => pb::Family::Ipv4,
            Family::V6 => pb::Family::Ipv6,
        };
        let msg = pb::RequestBlockRequest { node_name: c.cfg.node_name.clone(), family: family as i32 };
        let resp = NodeRegistryClient::new(channel)
            .request_block(authed(msg, &token)?)
            .await
            .map_err(|s| grpc_err("request block", &s))?
            .into_inner();
        c.link.message();
        let node = resp.node.ok_or("no node in the answer")?;
        c.apply_self(&node, None).await
    })
}

/// Run the cluster client forever (reconnecting with backoff), keeping `link` up to date.
pub async fn run(cfg: Arc<Config>, dp: Arc<Datapath>, link: Arc<Link>) {
    let Some(cc) = cfg.controller.clone() else { return };
    if cc.insecure {
        tracing::warn!(address = %cc.address, "controller.insecure: true: this node's credential goes to the controller in plaintext; configure controller.tls");
    } else if cc.tls.is_some() {
        tracing::info!(address = %cc.address, client_certificate = cc.tls.as_ref().is_some_and(|t| t.cert_file.is_some()), "controller reached over TLS");
    }
    let client = Arc::new(Client {
        cfg,
        dp: dp.clone(),
        link: link.clone(),
        cc,
        routes: Mutex::new(None),
        vtep_mac: Mutex::new(String::new()),
        applying: tokio::sync::Mutex::new(()),
    });
    let handle = tokio::runtime::Handle::current();
    let c = client.clone();
    dp.set_block_source(Box::new(move |family| request_block(&handle, &c, family)));
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut connected = false;
        let ended = client.session(&mut connected).await;
        link.connected.store(false, Ordering::SeqCst);
        if let Err(e) = ended {
            tracing::warn!(error = %e, "controller session ended");
        }
        if connected {
            backoff = Duration::from_millis(100);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
