//! Controller mode: register with `nodeplane-controller`, keep the node's blocks (persisted,
//! so the node keeps serving while the controller is away), and program routes to every
//! other node from the membership stream.
//!
//! The stream starts with a snapshot (or, on a reconnect, the changes since the revision
//! the agent holds) and then carries deltas, each naming the revision it applies to: a
//! delta is programmed as the few route, FDB and neighbour changes it implies, a snapshot
//! as a complete sync, and a gap (a delta for another revision) asks for a snapshot. A
//! periodic audit reads the kernel again and repairs drift.

use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};
use tonic::Request;
use tonic::transport::Channel;

use super::config::{Config, ControllerConfig};
use crate::net::datapath::Datapath;
use crate::net::routes::{PeerNode, RouteConfig, Routes};
use crate::net::wireguard::{self, KeyPair};
use crate::rpc::controller as pb;
use crate::rpc::controller::node_registry_client::NodeRegistryClient;
use crate::util::Family;

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
    /// The pod MTU derived at the last registration (0: none; the config names one).
    #[serde(default)]
    pub pod_mtu: u32,
    /// Encryption strict at the last registration: at start the cluster CIDRs are
    /// blackholed before pods are served ([`hold_strict`]).
    #[serde(default)]
    pub strict: bool,
}

/// Strict encryption before the route programmer's first sync: the blackhole per cluster
/// CIDR it keeps, so pod traffic to another node never leaves in clear meanwhile (after a
/// reboot, or while the controller is away). Idempotent.
pub fn hold_strict(cidrs: &[IpNetwork]) -> Result<(), String> {
    let mut nl = crate::sys::netlink::Netlink::open().map_err(|e| e.to_string())?;
    for c in cidrs {
        nl.replace_blackhole(c.network(), c.prefix(), wireguard::RTPROT_STRICT)
            .map_err(|e| format!("blackhole {c} (encryption strict): {e}"))?;
    }
    Ok(())
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

/// Why a call to the controller (or its stream) failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("reading token {}: {source}", path.display())]
    Token { path: std::path::PathBuf, source: std::io::Error },
    #[error("connect: {0}")]
    Connect(#[from] crate::rpc::ConnectError),
    #[error("{call}: {:?}: {}", .status.code(), .status.message())]
    Call { call: &'static str, status: tonic::Status },
    #[error("the controller did not answer {0} within {1:?}")]
    Timeout(&'static str, Duration),
    #[error("the controller closed the {0} stream")]
    Closed(&'static str),
}

impl LinkError {
    pub fn call(call: &'static str) -> impl FnOnce(tonic::Status) -> LinkError {
        move |status| LinkError::Call { call, status }
    }
}

/// The bearer token the calls carry; none when a client certificate is the credential.
#[derive(Clone)]
pub(crate) struct Token(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Token {
    /// `msg` with the token.
    pub(crate) fn authed<T>(&self, msg: T) -> Request<T> {
        let mut req = Request::new(msg);
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        req
    }
}

/// The pause before the next session with the controller: 100 ms, doubled after each
/// session up to 2 s, and 100 ms again after one the caller counts as having worked.
pub(crate) struct Backoff(Duration);

impl Backoff {
    pub(crate) fn new() -> Self {
        Backoff(Duration::from_millis(100))
    }

    /// Sleep after a session ended; `worked`: it counts as a working one.
    pub(crate) async fn pause(&mut self, worked: bool) {
        if worked {
            *self = Self::new();
        }
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(Duration::from_secs(2));
    }
}

/// The token in `path` (none for an empty path).
pub(crate) fn read_token(path: &Path) -> Result<Token, LinkError> {
    if path.as_os_str().is_empty() {
        return Ok(Token(None));
    }
    let bad = |source| LinkError::Token { path: path.into(), source };
    let t = std::fs::read_to_string(path).map_err(bad)?;
    let v = format!("Bearer {}", t.trim())
        .parse()
        .map_err(|_| bad(std::io::Error::new(std::io::ErrorKind::InvalidData, "not valid header text")))?;
    Ok(Token(Some(v)))
}

/// The token and a new channel to the controller (a stream's session).
pub(crate) async fn open(cc: &ControllerConfig) -> Result<(Token, Channel), LinkError> {
    let token = read_token(&cc.token_file)?;
    Ok((token, crate::rpc::connect_with(&cc.address, cc.tls.as_ref()).await?))
}

/// One channel to the controller for single calls: made on first use, and again after
/// [`Conn::reset`] (a failed call).
pub(crate) struct Conn {
    pub(crate) cc: ControllerConfig,
    channel: tokio::sync::Mutex<Option<Channel>>,
}

impl Conn {
    pub(crate) fn new(cc: ControllerConfig) -> Self {
        Conn { cc, channel: tokio::sync::Mutex::new(None) }
    }

    /// The token and the channel.
    pub(crate) async fn get(&self) -> Result<(Token, Channel), LinkError> {
        let token = read_token(&self.cc.token_file)?;
        let mut ch = self.channel.lock().await;
        if ch.is_none() {
            *ch = Some(crate::rpc::connect_with(&self.cc.address, self.cc.tls.as_ref()).await?);
        }
        Ok((token, ch.clone().expect("set above")))
    }

    pub(crate) async fn reset(&self) {
        *self.channel.lock().await = None;
    }
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
            wg_key: wireguard::parse_key(&n.wireguard_key),
        })
        .collect()
}

/// The encryption mode in a registration's answer.
fn encryption_mode(resp: &pb::RegisterResponse) -> wireguard::Mode {
    match pb::Encryption::try_from(resp.encryption) {
        Ok(pb::Encryption::On) => wireguard::Mode::On,
        Ok(pb::Encryption::Strict) => wireguard::Mode::Strict,
        _ => wireguard::Mode::Off,
    }
}

/// The state of the connection to the controller, for metrics.
#[derive(Debug, Default)]
pub struct Link {
    /// Registered, and the membership stream is open.
    connected: AtomicBool,
    /// Unix time in milliseconds of the last message from the controller (0: never).
    last_message_ms: AtomicU64,
    /// Asks the session for a new WireGuard key pair (`nodeplane wireguard rotate`).
    pub rotate: tokio::sync::Notify,
    /// The encryption mode the controller gave and the public key this node published.
    encryption: Mutex<(wireguard::Mode, String)>,
    /// Why the WireGuard device could not be made, as the last routes programming found.
    tunnel_error: Mutex<Option<String>>,
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

    /// The encryption mode and this node's published WireGuard key ("" before the first
    /// registration).
    pub fn encryption(&self) -> (wireguard::Mode, String) {
        self.encryption.lock().unwrap().clone()
    }

    /// Whether encryption works as the controller asks: `Ok` when it is off, or when this
    /// node published a key and has its device.
    pub fn encryption_state(&self) -> Result<(), String> {
        let (mode, key) = self.encryption();
        if mode == wireguard::Mode::Off {
            return Ok(());
        }
        if let Some(e) = self.tunnel_error.lock().unwrap().clone() {
            return Err(format!("encryption {mode}: no wireguard device: {e}"));
        }
        if key.is_empty() {
            return Err(format!("encryption {mode}: this node has no usable key (<state>/wireguard.key; see the log)"));
        }
        Ok(())
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
    /// The membership as last received (kept across reconnects: a reconnect asks for the
    /// changes since its revision).
    members: Mutex<Members>,
    /// This node's WireGuard key pair (`None`: the key file could not be read).
    keys: Mutex<Option<KeyPair>>,
}

/// The cluster's membership as the stream delivered it.
#[derive(Debug, Default)]
pub struct Members {
    pub epoch: u64,
    pub revision: u64,
    pub nodes: std::collections::BTreeMap<String, pb::Node>,
    /// The parts of a snapshot received so far (it replaces the view with its last part).
    pending: Option<Vec<pb::Node>>,
}

/// What one message of the membership stream means for the routes.
#[derive(Debug, PartialEq)]
pub enum Applied {
    /// The view was replaced: sync completely.
    Snapshot,
    /// Peers added or changed, and names removed.
    Delta { changed: Vec<pb::Node>, removed: Vec<String> },
    /// A part of a snapshot, more to come: nothing to do yet.
    Partial,
}

impl Members {
    /// Apply one message. Err: a delta that does not follow the view (another epoch or
    /// revision): the view is cleared, and the stream must be asked for a snapshot.
    pub fn apply(&mut self, m: pb::NodeList) -> Result<Applied, String> {
        // Epoch 0: a controller older than deltas, whose every message is the complete list.
        if m.snapshot || m.epoch == 0 {
            let mut nodes = self.pending.take().unwrap_or_default();
            nodes.extend(m.nodes);
            if m.more {
                self.pending = Some(nodes);
                return Ok(Applied::Partial);
            }
            self.nodes = nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
            self.epoch = m.epoch;
            self.revision = m.revision;
            return Ok(Applied::Snapshot);
        }
        if self.pending.is_some() {
            *self = Members::default();
            return Err("a delta in the middle of a snapshot".into());
        }
        if m.epoch != self.epoch || m.base_revision != self.revision || self.revision == 0 {
            let why = format!(
                "membership delta {}..{} (epoch {:x}) does not follow revision {} (epoch {:x})",
                m.base_revision, m.revision, m.epoch, self.revision, self.epoch
            );
            *self = Members::default();
            return Err(why);
        }
        for name in &m.removed {
            self.nodes.remove(name);
        }
        for n in &m.nodes {
            self.nodes.insert(n.name.clone(), n.clone());
        }
        self.revision = m.revision;
        Ok(Applied::Delta { changed: m.nodes, removed: m.removed })
    }
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
            st.pod_mtu = if self.cfg.mtu.is_none() { self.dp.pod_mtu() } else { 0 };
            st.strict = encryption_mode(r) == wireguard::Mode::Strict;
            if st.strict {
                hold_strict(&st.cluster_cidrs)?;
            }
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
        let mine = blocks.clone();
        tokio::task::spawn_blocking(move || dp.apply_network(&blocks, Some(&cluster)))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        match self.routes.lock().unwrap().as_mut() {
            Some(r) => r.set_local_blocks(&mine).map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    fn key_path(&self) -> std::path::PathBuf {
        self.cfg.state_dir.join("wireguard.key")
    }

    /// This node's key pair, made on first start. A key file that cannot be used is logged
    /// and the node publishes no key (encryption then cannot reach it; strict drops).
    fn load_keys(&self) -> Option<KeyPair> {
        let mut keys = self.keys.lock().unwrap();
        if keys.is_none() {
            match KeyPair::load_or_create(&self.key_path()) {
                Ok(k) => *keys = Some(k),
                Err(e) => tracing::error!(error = %e, "no wireguard key: this node publishes none"),
            }
        }
        keys.clone()
    }

    /// How old the key file is.
    fn key_age(&self) -> Option<Duration> {
        std::fs::metadata(self.key_path()).ok()?.modified().ok()?.elapsed().ok()
    }

    /// Hand the controller's encryption settings and our keys to the route programmer.
    fn set_encryption(
        &self,
        resp: &pb::RegisterResponse,
        keys: Option<KeyPair>,
        published: &str,
    ) -> Result<(), String> {
        let mode = encryption_mode(resp);
        let cidrs = parse_nets(&resp.cluster_cidrs, "cluster CIDR")?;
        let mut routes = self.routes.lock().unwrap();
        let r = routes.as_mut().ok_or("route programmer not initialised")?;
        r.set_encryption(mode, resp.wireguard_port as u16, cidrs);
        if let Some(k) = keys {
            r.set_keys(k).map_err(|e| e.to_string())?;
        }
        *self.link.encryption.lock().unwrap() = (mode, published.to_string());
        Ok(())
    }

    /// Derive the pod MTU from the underlay and the encryption mode the controller gave,
    /// unless the config names one. New pods get it from now on.
    fn derive_pod_mtu(&self, resp: &pb::RegisterResponse) -> Result<(), String> {
        if self.cfg.mtu.is_some() {
            return Ok(());
        }
        let mut routes = self.routes.lock().unwrap();
        let r = routes.as_mut().ok_or("route programmer not initialised")?;
        let mtu = r.pod_mtu(encryption_mode(resp)).map_err(|e| e.to_string())?;
        self.dp.set_pod_mtu(mtu);
        Ok(())
    }

    /// A new key pair: saved, put on the device, and published by registering again (the
    /// other nodes learn it from the membership stream).
    async fn rotate(
        &self,
        client: &mut NodeRegistryClient<tonic::transport::Channel>,
        token: &Token,
        register: &impl Fn(String) -> pb::RegisterRequest,
    ) -> Result<(), String> {
        let new = KeyPair::generate();
        new.save(&self.key_path()).map_err(|e| e.to_string())?;
        {
            let mut routes = self.routes.lock().unwrap();
            if let Some(r) = routes.as_mut() {
                r.set_keys(new.clone()).map_err(|e| e.to_string())?;
            }
        }
        let public = wireguard::encode_key(new.public());
        *self.keys.lock().unwrap() = Some(new);
        self.publish_key(client, token, register, &public, "register (new wireguard key)").await?;
        tracing::info!(public_key = %public, "wireguard key rotated and published");
        Ok(())
    }

    /// Register again with `key` ("": none) as this node's WireGuard key; the other nodes
    /// learn it from the membership stream. Once registered, it is the key published.
    async fn publish_key(
        &self,
        client: &mut NodeRegistryClient<tonic::transport::Channel>,
        token: &Token,
        register: &impl Fn(String) -> pb::RegisterRequest,
        key: &str,
        what: &str,
    ) -> Result<(), String> {
        let mut req = register(self.vtep_mac.lock().unwrap().clone());
        req.wireguard_key = key.to_string();
        client.register(token.authed(req)).await.map_err(|s| grpc_err(what, &s))?;
        self.link.message();
        self.link.encryption.lock().unwrap().1 = key.to_string();
        Ok(())
    }

    /// Publish our key only while our WireGuard device works: peers send what they route to
    /// a node with a key through their tunnels, so a node without a device would get none
    /// of it. Without our key, mode on reaches this node in clear (strict: not at all).
    async fn publish_key_as_tunnel_allows(
        &self,
        client: &mut NodeRegistryClient<tonic::transport::Channel>,
        token: &Token,
        register: &impl Fn(String) -> pb::RegisterRequest,
    ) -> Result<(), String> {
        let (mode, published) = self.link.encryption();
        let works = self.link.tunnel_error.lock().unwrap().is_none();
        let key = match self.keys.lock().unwrap().as_ref() {
            Some(k) if works => wireguard::encode_key(k.public()),
            _ => String::new(),
        };
        if mode == wireguard::Mode::Off || key == published {
            return Ok(());
        }
        self.publish_key(client, token, register, &key, "register (wireguard key)").await?;
        if key.is_empty() {
            tracing::warn!(%mode, "no wireguard device: this node withdrew its key from its peers");
        } else {
            tracing::info!(public_key = %key, "wireguard device up: key published");
        }
        Ok(())
    }

    /// Make sure the route programmer exists (needs the VXLAN parameters from the controller).
    async fn ensure_routes(self: &Arc<Self>, vni: u32, port: u16) -> Result<(), String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut routes = me.routes.lock().unwrap();
            if routes.is_none() {
                let cfg = RouteConfig { port, ..RouteConfig::new(me.cc.route_mode, vni, me.cc.underlay_addresses[0]) };
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

    /// Program routes for one message of the stream (a complete sync for a snapshot or the
    /// audit, the implied changes for a delta).
    async fn program_routes(self: &Arc<Self>, what: Option<Applied>) -> Result<(), String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut routes = me.routes.lock().unwrap();
            let r = routes.as_mut().ok_or("route programmer not initialised")?;
            let t = std::time::Instant::now();
            let kind = match &what {
                Some(Applied::Delta { .. }) => "delta",
                Some(Applied::Snapshot | Applied::Partial) => "snapshot",
                None => "audit",
            };
            let report = match what {
                Some(Applied::Delta { changed, removed }) => {
                    let changed: Vec<pb::Node> = changed.into_iter().filter(|n| n.name != me.cfg.node_name).collect();
                    r.update(peers_of(&me.cfg.node_name, &changed), &removed)
                }
                Some(Applied::Snapshot | Applied::Partial) => {
                    let nodes: Vec<pb::Node> = me.members.lock().unwrap().nodes.values().cloned().collect();
                    r.sync(&peers_of(&me.cfg.node_name, &nodes))
                }
                None => r.resync(),
            }
            .map_err(|e| e.to_string())?;
            *me.link.tunnel_error.lock().unwrap() = r.tunnel_error();
            let took_us = t.elapsed().as_micros() as u64;
            if kind == "audit" && report.changes() == 0 {
                tracing::debug!(kind, peers = r.peers().count(), took_us, "routes audited: no drift");
            } else {
                tracing::info!(
                    kind,
                    peers = r.peers().count(),
                    changes = report.changes(),
                    took_us,
                    "routes programmed"
                );
            }
            Ok(())
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// One connection: register, then follow the membership stream until it breaks.
    async fn session(self: &Arc<Self>, connected: &mut bool) -> Result<(), String> {
        let (token, channel) = open(&self.cc).await.map_err(|e| e.to_string())?;
        let mut client = NodeRegistryClient::new(channel);
        let underlay: Vec<String> = self.cc.underlay_addresses.iter().map(|a| a.to_string()).collect();
        let me = self.cfg.node_name.clone();
        let keys = self.load_keys();
        let wg_key = keys.as_ref().map(|k| wireguard::encode_key(k.public())).unwrap_or_default();
        let register = |mac: String| pb::RegisterRequest {
            node_name: me.clone(),
            underlay_addresses: underlay.clone(),
            vtep_mac: mac,
            wireguard_key: wg_key.clone(),
        };
        // With the VXLAN parameters remembered from an earlier registration, the device can
        // exist before the first Register, which then advertises its MAC at once.
        let remembered = load_state(&self.cfg).map_err(|e| e.to_string())?;
        if remembered.vxlan_vni != 0 {
            self.ensure_routes(remembered.vxlan_vni, remembered.vxlan_port).await?;
        }
        let sent_mac = self.vtep_mac.lock().unwrap().clone();
        let mut resp = client
            .register(token.authed(register(sent_mac.clone())))
            .await
            .map_err(|s| grpc_err("register", &s))?
            .into_inner();
        self.link.message();
        self.ensure_routes(resp.vxlan_vni, resp.vxlan_port as u16).await?;
        let mac = self.vtep_mac.lock().unwrap().clone();
        if mac != sent_mac {
            // Now that the VXLAN device exists, advertise its MAC.
            resp =
                client.register(token.authed(register(mac))).await.map_err(|s| grpc_err("register", &s))?.into_inner();
            self.link.message();
        }
        let node = resp.node.clone().ok_or("register: no node in the answer")?;
        self.derive_pod_mtu(&resp)?;
        self.apply_self(&node, Some(&resp)).await?;
        self.set_encryption(&resp, keys.clone(), &wg_key)?;
        let rotation = Duration::from_secs(resp.key_rotation_seconds);
        let mut rotation_check = tokio::time::interval(Duration::from_secs(resp.key_rotation_seconds.clamp(1, 60)));
        rotation_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        *connected = true;
        tracing::info!(blocks = ?node.pod_blocks, "registered with the controller");

        let audit_every = Duration::from_secs(self.cc.route_audit_seconds.max(1));
        let mut audit = tokio::time::interval_at(tokio::time::Instant::now() + audit_every, audit_every);
        audit.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        'watch: loop {
            let (epoch, since) = {
                let m = self.members.lock().unwrap();
                (m.epoch, m.revision)
            };
            let req = pb::WatchNodesRequest { node_name: me.clone(), deltas: true, since_revision: since, epoch };
            let mut stream =
                client.watch_nodes(token.authed(req)).await.map_err(|s| grpc_err("watch", &s))?.into_inner();
            self.link.connected.store(true, Ordering::SeqCst);
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    _ = self.link.rotate.notified() => {
                        self.rotate(&mut client, &token, &register).await?;
                        continue;
                    }
                    _ = rotation_check.tick(), if !rotation.is_zero() => {
                        if self.key_age().is_some_and(|age| age >= rotation) {
                            self.rotate(&mut client, &token, &register).await?;
                        }
                        continue;
                    }
                    _ = audit.tick() => {
                        if self.members.lock().unwrap().revision != 0 {
                            self.program_routes(None).await?;
                            self.publish_key_as_tunnel_allows(&mut client, &token, &register).await?;
                        }
                        continue;
                    }
                };
                let list = match msg {
                    Ok(Some(l)) => {
                        self.link.message();
                        l
                    }
                    Ok(None) => return Err("controller closed the membership stream".into()),
                    Err(s) => return Err(grpc_err("watch", &s)),
                };
                let applied = self.members.lock().unwrap().apply(list);
                let applied = match applied {
                    Ok(a) => a,
                    Err(why) => {
                        tracing::warn!(%why, "asking the controller for a snapshot");
                        continue 'watch;
                    }
                };
                let own = match &applied {
                    Applied::Partial => continue,
                    Applied::Snapshot => self.members.lock().unwrap().nodes.get(&me).cloned().ok_or(()),
                    Applied::Delta { changed, removed } => match changed.iter().find(|n| n.name == me) {
                        Some(n) => Ok(n.clone()),
                        None if removed.contains(&me) => Err(()),
                        None => Ok(pb::Node::default()),
                    },
                };
                if matches!(&applied, Applied::Delta { changed, removed } if changed.is_empty() && removed.is_empty()) {
                    continue;
                }
                self.program_routes(Some(applied)).await?;
                self.publish_key_as_tunnel_allows(&mut client, &token, &register).await?;
                match own {
                    Ok(n) if n.name.is_empty() => {}
                    Ok(n) => self.apply_self(&n, None).await?,
                    Err(()) => {
                        // Removed from the cluster: its blocks may already belong to another node.
                        for gone in self.dp.ipam().retain_blocks(&[]) {
                            tracing::warn!(block = %gone.net, "node removed by the controller: block withdrawn");
                        }
                        *self.members.lock().unwrap() = Members::default();
                        return Err("this node was removed from the cluster; registering again".into());
                    }
                }
            }
        }
    }
}

/// Ask the controller for one more block of a family, from a blocking thread (ADD path).
fn request_block(handle: &tokio::runtime::Handle, client: &Arc<Client>, family: Family) -> Result<(), String> {
    let c = client.clone();
    handle.block_on(async move {
        let (token, channel) = open(&c.cc).await.map_err(|e| e.to_string())?;
        let family = match family {
            Family::V4 => pb::Family::Ipv4,
            Family::V6 => pb::Family::Ipv6,
        };
        let msg = pb::RequestBlockRequest { node_name: c.cfg.node_name.clone(), family: family as i32 };
        let resp = NodeRegistryClient::new(channel)
            .request_block(token.authed(msg))
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
        members: Mutex::new(Members::default()),
        keys: Mutex::new(None),
    });
    let handle = tokio::runtime::Handle::current();
    let c = client.clone();
    dp.set_block_source(Box::new(move |family| request_block(&handle, &c, family)));
    let mut backoff = Backoff::new();
    loop {
        let mut connected = false;
        let ended = client.session(&mut connected).await;
        link.connected.store(false, Ordering::SeqCst);
        if let Err(e) = ended {
            tracing::warn!(error = %e, "controller session ended");
        }
        backoff.pause(connected).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encryption_state_needs_a_key_and_a_device_once_on() {
        let link = Link::default();
        assert_eq!(link.encryption_state(), Ok(()), "off: nothing to judge");
        *link.encryption.lock().unwrap() = (wireguard::Mode::Strict, String::new());
        assert!(link.encryption_state().unwrap_err().contains("no usable key"));
        *link.encryption.lock().unwrap() = (wireguard::Mode::On, "a2V5".into());
        assert_eq!(link.encryption_state(), Ok(()));
        *link.tunnel_error.lock().unwrap() = Some("creating np.wg: Operation not supported".into());
        let e = link.encryption_state().unwrap_err();
        assert!(e.starts_with("encryption on: no wireguard device: creating np.wg"), "{e}");
    }

    fn node(name: &str, ul: &str) -> pb::Node {
        pb::Node { name: name.into(), underlay_addresses: vec![ul.into()], ..Default::default() }
    }

    #[test]
    fn members_follow_snapshots_and_deltas_and_refuse_gaps() {
        let mut m = Members::default();
        // A delta before any snapshot is a gap.
        let d = pb::NodeList { epoch: 7, base_revision: 0, revision: 1, ..Default::default() };
        assert!(m.apply(d).is_err());
        let snap = pb::NodeList {
            snapshot: true,
            epoch: 7,
            revision: 5,
            nodes: vec![node("a", "192.0.2.1"), node("b", "192.0.2.2")],
            ..Default::default()
        };
        assert_eq!(m.apply(snap.clone()).unwrap(), Applied::Snapshot);
        let d = pb::NodeList {
            epoch: 7,
            base_revision: 5,
            revision: 7,
            nodes: vec![node("c", "192.0.2.3"), node("a", "192.0.2.9")],
            removed: vec!["b".into()],
            ..Default::default()
        };
        assert!(matches!(m.apply(d.clone()).unwrap(), Applied::Delta { .. }));
        assert_eq!(m.nodes.keys().collect::<Vec<_>>(), ["a", "c"]);
        assert_eq!(m.nodes["a"].underlay_addresses, ["192.0.2.9"]);
        assert_eq!(m.revision, 7);
        // The same delta again (a repeat), one from another revision or another epoch: the
        // view is cleared and a snapshot must be asked for.
        assert!(m.apply(d.clone()).is_err());
        assert_eq!((m.revision, m.nodes.len()), (0, 0));
        m.apply(snap.clone()).unwrap();
        let other_epoch = pb::NodeList { epoch: 8, base_revision: 5, revision: 6, ..Default::default() };
        assert!(m.apply(other_epoch).is_err());
        m.apply(snap.clone()).unwrap();
        // A snapshot in parts replaces the view at its last part.
        let part = |names: &[&str], more: bool| pb::NodeList {
            snapshot: true,
            epoch: 9,
            revision: 20,
            more,
            nodes: names.iter().map(|n| node(n, "192.0.2.1")).collect(),
            ..Default::default()
        };
        assert_eq!(m.apply(part(&["p", "q"], true)).unwrap(), Applied::Partial);
        assert_eq!(m.nodes.keys().collect::<Vec<_>>(), ["a", "b"], "unchanged until the last part");
        assert_eq!(m.apply(part(&["r"], false)).unwrap(), Applied::Snapshot);
        assert_eq!(m.nodes.keys().collect::<Vec<_>>(), ["p", "q", "r"]);
        assert_eq!((m.epoch, m.revision), (9, 20));
        // A controller older than deltas (epoch 0): every message is the complete list.
        let old = pb::NodeList { revision: 3, nodes: vec![node("z", "192.0.2.26")], ..Default::default() };
        assert_eq!(m.apply(old).unwrap(), Applied::Snapshot);
        assert_eq!(m.nodes.keys().collect::<Vec<_>>(), ["z"]);
    }
}
