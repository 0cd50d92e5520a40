//! Cross-node pod routes: how this node reaches the pod blocks of every other node.
//!
//! Every route this module installs lives in the main table and carries the route protocol
//! [`RTPROT_NODEPLANE`]; that mark is how [`Routes::sync`] and [`Routes::teardown`] find
//! their own routes again, and they never touch a route without it.
//!
//! Per peer and per address family a block is reached one of two ways:
//!
//! * **direct**: `<block> via <peer underlay address>`: the peer is on our L2 segment and
//!   forwards for its own pods;
//! * **VXLAN**: one device (default `np.vxlan`, learning off) for the whole node. Per peer a
//!   permanent FDB entry `<peer VTEP MAC> dst <peer underlay>`; per peer block a permanent
//!   neighbour entry `<block gateway> lladdr <peer VTEP MAC>` and the route
//!   `<block> via <block gateway> dev np.vxlan onlink`. The block gateway (first host of the
//!   block) is the address the peer's bridge holds, so the next hop is meaningful on both
//!   sides; nothing is resolved at run time (no ARP/ND over the tunnel, no flooding).
//!
//! [`RouteMode::Auto`] picks direct when the peer's underlay address of the block's family is
//! on a connected subnet of ours, VXLAN otherwise (also for a family the peer's underlay
//! does not carry, e.g. IPv6 pods over an IPv4-only underlay).
//!
//! The work happens in the network namespace of the thread that called [`Routes::new`]:
//! the netlink socket is opened there and stays bound to it, so later calls may come from
//! any thread. Nothing here calls `setns`.
//!
//! The decision logic ([`plan`], [`diff`]) is pure and unit-tested; [`Routes`] only gathers
//! kernel state, applies the operations and reports.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};

use crate::net::ipam::Block;
use crate::net::wireguard::{self, KeyPair, Mode as Encryption, Tunnel};
use crate::sys::netlink::{
    Addr, FdbEntry, NTF_SELF, NUD_PERMANENT, Neighbour, Netlink, NetlinkError, RTN_BLACKHOLE, RTN_UNICAST, RouteEntry,
    RouteSpec, VxlanSpec, format_mac,
};
use crate::util::Family;

/// Route protocol number marking every route nodeplane installs (`ip route show proto 78`).
pub const RTPROT_NODEPLANE: u8 = 0x4e;
/// Default name of the VXLAN device.
pub const DEFAULT_VXLAN_NAME: &str = "np.vxlan";
/// Default VXLAN UDP port (IANA).
pub const DEFAULT_VXLAN_PORT: u16 = 4789;
/// Encapsulation overhead over an IPv4 underlay: outer IPv4 20 + UDP 8 + VXLAN 8 + inner Ethernet 14.
pub const VXLAN_OVERHEAD_V4: u32 = 50;
/// Encapsulation overhead over an IPv6 underlay (outer IPv6 header is 40 bytes).
pub const VXLAN_OVERHEAD_V6: u32 = 70;

const RT_TABLE_MAIN: u32 = 254;
const MAX_VNI: u32 = (1 << 24) - 1;
const MIN_MTU: u32 = 576;
/// The metric the kernel gives a route added without one.
const fn default_metric(v6: bool) -> u32 {
    if v6 { 1024 } else { 0 }
}

// ----- configuration and inputs -----

/// How peers' pod blocks are reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteMode {
    /// Direct routes to peers on our L2 segment, VXLAN to the rest.
    #[default]
    Auto,
    /// Direct routes only (every peer must share our L2 segment).
    Direct,
    /// VXLAN to every peer.
    Vxlan,
}

impl fmt::Display for RouteMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RouteMode::Auto => "auto",
            RouteMode::Direct => "direct",
            RouteMode::Vxlan => "vxlan",
        })
    }
}

/// Another node, as the controller describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerNode {
    pub name: String,
    /// The node's own (underlay) addresses, at most one per family is used (the first).
    pub underlay: Vec<IpAddr>,
    /// Pod blocks the node holds.
    pub blocks: Vec<IpNetwork>,
    /// MAC of the node's VXLAN device; `None` when it runs none.
    #[serde(default)]
    pub vtep_mac: Option<[u8; 6]>,
    /// The node's WireGuard public key; `None` when it published none.
    #[serde(default)]
    pub wg_key: Option<[u8; 32]>,
}

impl PeerNode {
    /// The peer's first underlay address of a family.
    pub fn underlay_of(&self, v6: bool) -> Option<IpAddr> {
        self.underlay.iter().copied().find(|a| a.is_ipv6() == v6)
    }
}

fn default_vxlan_name() -> String {
    DEFAULT_VXLAN_NAME.to_string()
}
fn default_port() -> u16 {
    DEFAULT_VXLAN_PORT
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteConfig {
    #[serde(default)]
    pub mode: RouteMode,
    #[serde(default = "default_vxlan_name")]
    pub vxlan_name: String,
    pub vni: u32,
    #[serde(default = "default_port")]
    pub port: u16,
    /// This node's underlay address: the VXLAN source address; its family is the
    /// tunnel's family.
    pub local_underlay: IpAddr,
    /// MTU of the VXLAN device; default: the underlay link's MTU minus the overhead.
    #[serde(default)]
    pub mtu: Option<u32>,
    /// Encryption of pod traffic to peers (WireGuard, [`wireguard`]).
    #[serde(default)]
    pub encryption: Encryption,
    #[serde(default = "default_wg_port")]
    pub wg_port: u16,
    /// The cluster CIDRs: in strict mode, what is not routed through the tunnel is dropped.
    #[serde(default)]
    pub cluster_cidrs: Vec<IpNetwork>,
}

fn default_wg_port() -> u16 {
    wireguard::DEFAULT_PORT
}

impl RouteConfig {
    /// A configuration with the default device name, port and MTU, without encryption.
    pub fn new(mode: RouteMode, vni: u32, local_underlay: IpAddr) -> Self {
        RouteConfig {
            mode,
            vxlan_name: default_vxlan_name(),
            vni,
            port: DEFAULT_VXLAN_PORT,
            local_underlay,
            mtu: None,
            encryption: Encryption::Off,
            wg_port: wireguard::DEFAULT_PORT,
            cluster_cidrs: Vec::new(),
        }
    }

    pub fn validate(&self) -> Result<(), RoutesError> {
        let bad = |m: String| Err(RoutesError::Config(m));
        if self.vni == 0 || self.vni > MAX_VNI {
            return bad(format!("vni {} out of range 1..={MAX_VNI}", self.vni));
        }
        if self.port == 0 {
            return bad("vxlan port 0".into());
        }
        let n = &self.vxlan_name;
        if !crate::net::cni::request::valid_ifname(n) {
            return bad(format!("vxlan device name {n:?} is not a valid interface name"));
        }
        let l = self.local_underlay;
        if l.is_unspecified() || l.is_loopback() || l.is_multicast() {
            return bad(format!("local underlay address {l} cannot carry VXLAN"));
        }
        if let Some(mtu) = self.mtu
            && mtu < MIN_MTU
        {
            return bad(format!("mtu {mtu} below {MIN_MTU}"));
        }
        Ok(())
    }
}

/// MTU of a VXLAN device over an underlay link of `underlay_mtu`.
pub fn vxlan_mtu(underlay_mtu: u32, local: IpAddr) -> u32 {
    let overhead = if local.is_ipv6() { VXLAN_OVERHEAD_V6 } else { VXLAN_OVERHEAD_V4 };
    underlay_mtu.saturating_sub(overhead)
}

/// The MTU pods get over an underlay link of `underlay_mtu`: what is left after the largest
/// encapsulation their traffic to another node may take. Encryption on or strict: the
/// WireGuard device (a peer without a key, in mode on, takes VXLAN or a direct route, both
/// smaller). Otherwise VXLAN in modes vxlan and auto, nothing in direct mode.
pub fn pod_mtu(mode: RouteMode, encryption: Encryption, underlay_mtu: u32, local: IpAddr) -> u32 {
    match (encryption, mode) {
        (Encryption::On | Encryption::Strict, _) => wireguard::device_mtu(underlay_mtu, local),
        (Encryption::Off, RouteMode::Direct) => underlay_mtu,
        (Encryption::Off, RouteMode::Vxlan | RouteMode::Auto) => vxlan_mtu(underlay_mtu, local),
    }
}

/// A stable VTEP MAC for a node: locally administered, unicast, derived from its underlay
/// address, so a re-created device keeps the MAC its peers already have.
pub fn vtep_mac_for(local_underlay: IpAddr) -> [u8; 6] {
    let bytes: Vec<u8> = match local_underlay {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let h = crate::util::fnv1a(&[b"nodeplane-vtep", &bytes]).to_be_bytes();
    [0x02, h[0], h[1], h[2], h[3], h[4]]
}

/// Parse `aa:bb:cc:dd:ee:ff` (as the controller carries VTEP MACs). Empty string: `None`.
pub fn parse_mac(s: &str) -> Result<Option<[u8; 6]>, RoutesError> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(None);
    }
    let bytes: Option<Vec<u8>> =
        s.split(':').map(|p| if p.len() == 2 { u8::from_str_radix(p, 16).ok() } else { None }).collect();
    let mac = bytes.and_then(|b| <[u8; 6]>::try_from(b).ok());
    mac.map(Some).ok_or_else(|| RoutesError::Config(format!("bad MAC address {s:?}")))
}

// ----- errors and reports -----

#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error("route config: {0}")]
    Config(String),
    #[error("{context}: {source}")]
    Netlink {
        context: String,
        #[source]
        source: NetlinkError,
    },
    #[error("vxlan device {name}: {msg}")]
    Vtep { name: String, msg: String },
    #[error("wireguard: {0}")]
    Tunnel(String),
    #[error("route sync incomplete, {} change(s) failed: {}", .failures.len(), join_errors(.failures))]
    Incomplete { report: Box<SyncReport>, failures: Vec<RoutesError> },
    #[error("route teardown incomplete: {}", join_errors(.0))]
    Teardown(Vec<RoutesError>),
}

impl RoutesError {
    fn netlink(context: impl Into<String>) -> impl FnOnce(NetlinkError) -> RoutesError {
        let context = context.into();
        move |source| RoutesError::Netlink { context, source }
    }
}

fn join_errors(errors: &[RoutesError]) -> String {
    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteKind {
    Direct,
    Vxlan,
    /// Through the WireGuard device (encryption on, the peer has a key).
    Wireguard,
}

/// One planned route to one peer block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRoute {
    pub peer: String,
    pub block: IpNetwork,
    pub kind: RouteKind,
    /// Next hop: the peer's underlay address (direct) or the block's gateway (VXLAN).
    pub via: IpAddr,
    /// VXLAN only: the peer's VTEP MAC and its underlay address (the tunnel's remote end).
    pub vtep: Option<([u8; 6], IpAddr)>,
    /// The tunnel device (VXLAN or WireGuard); `None` for a direct route.
    pub oif: Option<u32>,
}

/// A peer block that gets no route, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unroutable {
    pub peer: String,
    pub block: IpNetwork,
    pub reason: String,
}

impl fmt::Display for Unroutable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer {} block {}: {}", self.peer, self.block, self.reason)
    }
}

/// Kernel objects changed by one sync, of one kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub added: usize,
    pub replaced: usize,
    pub removed: usize,
}

impl Counts {
    pub fn total(&self) -> usize {
        self.added + self.replaced + self.removed
    }
}

/// What [`Routes::sync`] did and what it could not do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub routes: Counts,
    pub fdb: Counts,
    pub neigh: Counts,
    /// The routes that should now be in place (one per routable peer block).
    pub routed: Vec<PeerRoute>,
    /// Peer blocks that get no route.
    pub unroutable: Vec<Unroutable>,
    /// Our VTEP MAC (`None` in direct mode).
    pub vtep_mac: Option<[u8; 6]>,
}

impl SyncReport {
    /// Kernel objects added, replaced or removed (0: the kernel already matched).
    pub fn changes(&self) -> usize {
        self.routes.total() + self.fdb.total() + self.neigh.total()
    }
    pub fn count(&self, kind: RouteKind) -> usize {
        self.routed.iter().filter(|r| r.kind == kind).count()
    }
}

// ----- pure decision logic -----

/// What the decision logic needs to know about this node's kernel state.
#[derive(Debug, Clone, Default)]
pub struct LocalView {
    /// Connected subnets (our addresses with their prefixes), excluding the VXLAN device,
    /// loopback and link-local addresses.
    pub subnets: Vec<IpNetwork>,
    /// Every address assigned in this namespace.
    pub addrs: BTreeSet<IpAddr>,
    /// ifindex of our VXLAN device, when there is one (VXLAN routes need it).
    pub vxlan_index: Option<u32>,
    /// ifindex of our WireGuard device, when encryption is on and it exists.
    pub wg_index: Option<u32>,
    /// Main-table routes we did not install: destination -> protocol. A peer block with an
    /// exact match is left alone.
    pub foreign_routes: BTreeMap<IpNetwork, u8>,
}

impl LocalView {
    /// Build the view from the namespace's addresses and main-table routes.
    pub fn from_kernel(
        addrs: &[crate::sys::netlink::Addr],
        main_routes: &[RouteEntry],
        vxlan_index: Option<u32>,
    ) -> Self {
        let mut view = LocalView { vxlan_index, ..Default::default() };
        for a in addrs {
            view.addrs.insert(a.ip);
            if Some(a.index) == vxlan_index || a.ip.is_loopback() || is_link_local(a.ip) {
                continue;
            }
            let host = if a.ip.is_ipv4() { 32 } else { 128 };
            if a.prefix >= host {
                continue;
            }
            if let Ok(net) = IpNetwork::new(a.ip, a.prefix) {
                let net = normalize(net);
                if !view.subnets.contains(&net) {
                    view.subnets.push(net);
                }
            }
        }
        for r in main_routes.iter().filter(|r| r.protocol != RTPROT_NODEPLANE && r.table == RT_TABLE_MAIN) {
            if let Ok(net) = IpNetwork::new(r.dst, r.prefix) {
                view.foreign_routes.entry(normalize(net)).or_insert(r.protocol);
            }
        }
        view
    }

    /// Is `ip` on one of our connected subnets (same L2 segment), and not our own?
    pub fn on_link(&self, ip: IpAddr) -> bool {
        !self.addrs.contains(&ip) && self.subnets.iter().any(|n| n.contains(ip))
    }
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => a.is_link_local(),
        IpAddr::V6(a) => a.is_unicast_link_local(),
    }
}

/// The network address with the same prefix (10.244.1.7/24 -> 10.244.1.0/24).
pub fn normalize(net: IpNetwork) -> IpNetwork {
    IpNetwork::new(net.network(), net.prefix()).unwrap_or(net)
}

/// The kernel state the peers call for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// One route per routable peer block, keyed by the (normalized) block.
    pub routes: BTreeMap<IpNetwork, PeerRoute>,
    /// VXLAN FDB: peer VTEP MAC -> (peer underlay address, peer name).
    pub fdb: BTreeMap<[u8; 6], (IpAddr, String)>,
    /// Neighbours on the VXLAN device: next hop (block gateway) -> (VTEP MAC, peer name).
    pub neigh: BTreeMap<IpAddr, ([u8; 6], String)>,
    pub unroutable: Vec<Unroutable>,
}

/// Decide how every peer block is reached. Peers are taken in name order so that a block
/// or VTEP MAC claimed twice (a controller bug) resolves the same way every time.
pub fn plan(cfg: &RouteConfig, local: &LocalView, peers: &[PeerNode]) -> Plan {
    plan_of(cfg, local, peers.iter())
}

fn plan_of<'a>(cfg: &RouteConfig, local: &LocalView, peers: impl Iterator<Item = &'a PeerNode>) -> Plan {
    let mut out = Plan::default();
    plan_into(cfg, local, &mut out, peers);
    out
}

/// Plan `peers` into `out`, which may already hold other peers' entries (a block or VTEP
/// MAC they hold is not given to these: the next complete sync decides such a conflict by
/// name order, as [`plan`] does).
fn plan_into<'a>(cfg: &RouteConfig, local: &LocalView, out: &mut Plan, peers: impl Iterator<Item = &'a PeerNode>) {
    let mut sorted: Vec<&PeerNode> = peers.collect();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let tunnel_v6 = cfg.local_underlay.is_ipv6();
    let vxlan_mode = cfg.mode != RouteMode::Direct;
    for peer in sorted {
        if peer.underlay.iter().any(|a| *a == cfg.local_underlay || local.addrs.contains(a)) {
            tracing::debug!(peer = %peer.name, "peer has one of our underlay addresses: that is us, skipped");
            continue;
        }
        // Can this peer be reached over VXLAN? Err: why not.
        let tunnel: Result<([u8; 6], IpAddr), String> = if !vxlan_mode {
            Err("VXLAN is off (route mode direct)".into())
        } else if local.vxlan_index.is_none() {
            Err("our VXLAN device is missing".into())
        } else {
            match (peer.vtep_mac, peer.underlay_of(tunnel_v6)) {
                (_, None) => Err(format!(
                    "peer has no {} underlay address for the VXLAN tunnel (ours is {})",
                    Family::from_v6(tunnel_v6),
                    cfg.local_underlay
                )),
                (None, _) => Err("peer advertises no VTEP MAC".into()),
                (Some(mac), Some(remote)) => match out.fdb.get(&mac) {
                    Some((other_remote, other)) if *other_remote != remote || *other != peer.name => {
                        Err(format!("VTEP MAC {} is also claimed by peer {other}", format_mac(&mac)))
                    }
                    _ => Ok((mac, remote)),
                },
            }
        };
        for raw in &peer.blocks {
            let block = normalize(*raw);
            let v6 = block.is_ipv6();
            let mut skip = |reason: String| {
                out.unroutable.push(Unroutable { peer: peer.name.clone(), block, reason });
            };
            if let Some(r) = out.routes.get(&block) {
                skip(format!("block is also claimed by peer {}", r.peer));
                continue;
            }
            if let Some(proto) = local.foreign_routes.get(&block) {
                skip(format!("a route to {block} that we did not install exists (proto {proto}); left alone"));
                continue;
            }
            let gateway = match Block::new(block) {
                Ok(b) => b.gateway(),
                Err(e) => {
                    skip(format!("invalid block: {e}"));
                    continue;
                }
            };
            let direct_via = peer.underlay_of(v6);
            let encrypted = cfg.encryption != Encryption::Off && local.wg_index.is_some() && peer.wg_key.is_some();
            if cfg.encryption == Encryption::Strict && !encrypted {
                let why =
                    if local.wg_index.is_none() { "our WireGuard device is missing" } else { "its key is unknown" };
                skip(format!("encryption is strict and {why}: dropped"));
                continue;
            }
            let kind = match cfg.mode {
                _ if encrypted => RouteKind::Wireguard,
                RouteMode::Direct => match direct_via {
                    Some(_) => RouteKind::Direct,
                    None => {
                        skip(format!(
                            "route mode direct, but the peer has no {} underlay address",
                            Family::from_v6(v6)
                        ));
                        continue;
                    }
                },
                RouteMode::Vxlan => match &tunnel {
                    Ok(_) => RouteKind::Vxlan,
                    Err(why) => {
                        skip(why.clone());
                        continue;
                    }
                },
                RouteMode::Auto => match (direct_via, &tunnel) {
                    (Some(via), _) if local.on_link(via) => RouteKind::Direct,
                    (_, Ok(_)) => RouteKind::Vxlan,
                    (via, Err(why)) => {
                        let direct_why = match via {
                            Some(via) => format!("underlay {via} is not on a connected subnet"),
                            None => format!("no {} underlay address", Family::from_v6(v6)),
                        };
                        skip(format!("not direct ({direct_why}) and not VXLAN ({why})"));
                        continue;
                    }
                },
            };
            let route = match kind {
                RouteKind::Direct => PeerRoute {
                    peer: peer.name.clone(),
                    block,
                    kind,
                    via: direct_via.expect("checked above"),
                    vtep: None,
                    oif: None,
                },
                RouteKind::Vxlan => {
                    let (mac, remote) = *tunnel.as_ref().expect("checked above");
                    out.fdb.insert(mac, (remote, peer.name.clone()));
                    out.neigh.insert(gateway, (mac, peer.name.clone()));
                    PeerRoute {
                        peer: peer.name.clone(),
                        block,
                        kind,
                        via: gateway,
                        vtep: Some((mac, remote)),
                        oif: local.vxlan_index,
                    }
                }
                RouteKind::Wireguard => {
                    PeerRoute { peer: peer.name.clone(), block, kind, via: gateway, vtep: None, oif: local.wg_index }
                }
            };
            out.routes.insert(block, route);
        }
    }
}

/// The kernel objects this module owns, as found.
#[derive(Debug, Clone, Default)]
pub struct Current {
    /// Main-table routes with protocol [`RTPROT_NODEPLANE`].
    pub routes: Vec<RouteEntry>,
    /// Permanent `self` FDB entries on the VXLAN device.
    pub fdb: Vec<FdbEntry>,
    /// Permanent neighbour entries on the VXLAN device.
    pub neigh: Vec<Neighbour>,
}

impl Current {
    /// Keep only what belongs to us: our routes, and permanent entries on our VXLAN device.
    pub fn select(
        routes: Vec<RouteEntry>,
        fdb: Vec<FdbEntry>,
        neigh: Vec<Neighbour>,
        vxlan_index: Option<u32>,
    ) -> Self {
        let ours = |ifindex: u32| Some(ifindex) == vxlan_index;
        Current {
            routes: routes.into_iter().filter(|r| r.protocol == RTPROT_NODEPLANE && r.table == RT_TABLE_MAIN).collect(),
            fdb: fdb
                .into_iter()
                .filter(|f| ours(f.ifindex) && f.flags & NTF_SELF != 0 && f.state & NUD_PERMANENT != 0)
                .collect(),
            neigh: neigh.into_iter().filter(|n| ours(n.ifindex) && n.state & NUD_PERMANENT != 0).collect(),
        }
    }
}

/// One kernel change. `new` tells an addition from a replacement (for the report).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    SetFdb {
        mac: [u8; 6],
        dst: IpAddr,
        peer: String,
        new: bool,
    },
    SetNeigh {
        ip: IpAddr,
        mac: [u8; 6],
        peer: String,
        new: bool,
    },
    /// Add or replace a route. `remove_first`: an old route of ours for the same block that
    /// has to go before the new one can be added (see [`diff`]).
    SetRoute {
        route: PeerRoute,
        spec: RouteSpec,
        new: bool,
        remove_first: Option<RouteEntry>,
    },
    DelRoute {
        entry: RouteEntry,
    },
    DelNeigh {
        ip: IpAddr,
    },
    DelFdb {
        mac: [u8; 6],
        dst: Option<IpAddr>,
    },
}

/// The route spec for a planned route.
pub fn route_spec(r: &PeerRoute) -> RouteSpec {
    RouteSpec {
        dst: r.block.network(),
        prefix: r.block.prefix(),
        gateway: r.via,
        oif: r.oif,
        onlink: r.kind != RouteKind::Direct,
        protocol: RTPROT_NODEPLANE,
    }
}

/// Does an installed route already do what the plan says?
fn route_matches(e: &RouteEntry, r: &PeerRoute, vxlan_index: Option<u32>) -> bool {
    if e.kind != RTN_UNICAST || e.gateway != Some(r.via) || e.priority != default_metric(e.v6) {
        return false;
    }
    match r.kind {
        RouteKind::Direct => !e.onlink && (e.oif.is_none() || e.oif != vxlan_index),
        RouteKind::Vxlan | RouteKind::Wireguard => e.onlink && r.oif.is_some() && e.oif == r.oif,
    }
}

/// The changes that turn `current` into `plan`, in a safe order: FDB and neighbour entries
/// before the routes that use them, stale routes before the entries they used.
pub fn diff(plan: &Plan, current: &Current, vxlan_index: Option<u32>) -> Vec<Op> {
    let mut sets_l2 = Vec::new();
    let mut sets_neigh = Vec::new();
    let mut sets_route = Vec::new();
    let mut dels_route = Vec::new();
    let mut dels_neigh = Vec::new();
    let mut dels_fdb = Vec::new();

    // FDB: MAC -> remotes present.
    let mut fdb_now: BTreeMap<[u8; 6], Vec<Option<IpAddr>>> = BTreeMap::new();
    for f in &current.fdb {
        fdb_now.entry(f.mac).or_default().push(f.dst);
    }
    for (mac, (dst, peer)) in &plan.fdb {
        let now = fdb_now.get(mac).map(Vec::as_slice).unwrap_or(&[]);
        if now == [Some(*dst)] {
            continue;
        }
        if now.contains(&Some(*dst)) {
            for other in now.iter().filter(|d| **d != Some(*dst)) {
                dels_fdb.push(Op::DelFdb { mac: *mac, dst: *other });
            }
            continue;
        }
        // Replace rewrites the entry's first remote; any further remotes go.
        sets_l2.push(Op::SetFdb { mac: *mac, dst: *dst, peer: peer.clone(), new: now.is_empty() });
        for other in now.iter().skip(1) {
            dels_fdb.push(Op::DelFdb { mac: *mac, dst: *other });
        }
    }
    for mac in fdb_now.keys().filter(|m| !plan.fdb.contains_key(*m)) {
        dels_fdb.push(Op::DelFdb { mac: *mac, dst: None });
    }

    // Neighbours: next hop -> MAC.
    let neigh_now: BTreeMap<IpAddr, Option<[u8; 6]>> = current.neigh.iter().map(|n| (n.ip, n.mac)).collect();
    for (ip, (mac, peer)) in &plan.neigh {
        match neigh_now.get(ip) {
            Some(Some(m)) if m == mac => {}
            other => sets_neigh.push(Op::SetNeigh { ip: *ip, mac: *mac, peer: peer.clone(), new: other.is_none() }),
        }
    }
    for ip in neigh_now.keys().filter(|ip| !plan.neigh.contains_key(*ip)) {
        dels_neigh.push(Op::DelNeigh { ip: *ip });
    }

    // Routes, grouped by destination.
    let mut routes_now: BTreeMap<IpNetwork, Vec<&RouteEntry>> = BTreeMap::new();
    for e in &current.routes {
        if let Ok(net) = IpNetwork::new(e.dst, e.prefix) {
            routes_now.entry(normalize(net)).or_default().push(e);
        }
    }
    for (block, want) in &plan.routes {
        let now = routes_now.remove(block).unwrap_or_default();
        match now.iter().position(|e| route_matches(e, want, vxlan_index)) {
            Some(keep) => {
                for (i, e) in now.iter().enumerate() {
                    if i != keep {
                        dels_route.push(Op::DelRoute { entry: (*e).clone() });
                    }
                }
            }
            None => {
                // NLM_F_REPLACE rewrites our route of the default metric in place (no gap);
                // ours with another metric are removed.
                let replaced = now.iter().position(|e| e.priority == default_metric(e.v6));
                // Except that IPv6 refuses an onlink route whose gateway is covered by a
                // route through another device ("Nexthop has invalid gateway or device
                // mismatch"), and the old route to the block covers the block's gateway:
                // when an IPv6 block moves onto the VXLAN device, the old route goes first.
                let remove_first = replaced
                    .filter(|&i| want.kind != RouteKind::Direct && want.block.is_ipv6() && now[i].oif != want.oif);
                sets_route.push(Op::SetRoute {
                    route: want.clone(),
                    spec: route_spec(want),
                    new: replaced.is_none(),
                    remove_first: remove_first.map(|i| now[i].clone()),
                });
                for (i, e) in now.iter().enumerate() {
                    if Some(i) != replaced {
                        dels_route.push(Op::DelRoute { entry: (*e).clone() });
                    }
                }
            }
        }
    }
    for stale in routes_now.into_values().flatten() {
        dels_route.push(Op::DelRoute { entry: stale.clone() });
    }

    let mut ops = sets_l2;
    ops.extend(sets_neigh);
    ops.extend(sets_route);
    ops.extend(dels_route);
    ops.extend(dels_neigh);
    ops.extend(dels_fdb);
    ops
}

impl Plan {
    /// The keys a peer's entries can have: its (normalized) blocks, their gateways, its MAC.
    fn keys_of(peer: &PeerNode) -> (Vec<IpNetwork>, Vec<IpAddr>) {
        let blocks: Vec<IpNetwork> = peer.blocks.iter().map(|b| normalize(*b)).collect();
        let gateways = blocks.iter().filter_map(|b| Block::new(*b).ok().map(|b| b.gateway())).collect();
        (blocks, gateways)
    }

    /// Take the entries of `peers` out of the plan (as a plan of their own), found by their
    /// keys: O(their entries), not O(plan).
    fn take_entries(&mut self, peers: &[&PeerNode]) -> Plan {
        let out = self.copy_entries(peers);
        for b in out.routes.keys() {
            self.routes.remove(b);
        }
        for g in out.neigh.keys() {
            self.neigh.remove(g);
        }
        for m in out.fdb.keys() {
            self.fdb.remove(m);
        }
        self.unroutable.retain(|u| !out.unroutable.contains(u));
        out
    }

    /// A copy of the entries of `peers`.
    fn copy_entries(&self, peers: &[&PeerNode]) -> Plan {
        let mut out = Plan::default();
        for p in peers {
            let (blocks, gateways) = Self::keys_of(p);
            for b in blocks {
                if let Some(r) = self.routes.get(&b).filter(|r| r.peer == p.name) {
                    out.routes.insert(b, r.clone());
                }
            }
            for g in gateways {
                if let Some(v) = self.neigh.get(&g).filter(|v| v.1 == p.name) {
                    out.neigh.insert(g, v.clone());
                }
            }
            if let Some(mac) = p.vtep_mac
                && let Some(v) = self.fdb.get(&mac).filter(|v| v.1 == p.name)
            {
                out.fdb.insert(mac, v.clone());
            }
        }
        out.unroutable = self.unroutable.iter().filter(|u| peers.iter().any(|p| p.name == u.peer)).cloned().collect();
        out
    }
}

/// The route entry a planned route was installed as (for removing it without a dump).
fn entry_of(r: &PeerRoute) -> RouteEntry {
    let v6 = r.block.is_ipv6();
    RouteEntry {
        v6,
        dst: r.block.network(),
        prefix: r.block.prefix(),
        gateway: Some(r.via),
        oif: r.oif,
        table: RT_TABLE_MAIN,
        protocol: RTPROT_NODEPLANE,
        priority: default_metric(v6),
        kind: RTN_UNICAST,
        onlink: r.kind != RouteKind::Direct,
    }
}

/// The changes from one applied plan to the next, without reading the kernel: what a
/// membership delta implies (a joining peer: its route, FDB entry and neighbour; a leaving
/// one: the same removed). In the order of [`diff`].
pub fn plan_diff(old: &Plan, new: &Plan) -> Vec<Op> {
    let mut ops = Vec::new();
    for (mac, (dst, peer)) in &new.fdb {
        match old.fdb.get(mac) {
            Some((d, _)) if d == dst => {}
            was => ops.push(Op::SetFdb { mac: *mac, dst: *dst, peer: peer.clone(), new: was.is_none() }),
        }
    }
    for (ip, (mac, peer)) in &new.neigh {
        match old.neigh.get(ip) {
            Some((m, _)) if m == mac => {}
            was => ops.push(Op::SetNeigh { ip: *ip, mac: *mac, peer: peer.clone(), new: was.is_none() }),
        }
    }
    for (block, want) in &new.routes {
        match old.routes.get(block) {
            // The kernel route is the same (its peer's tunnel end is the FDB entry's business).
            Some(was) if was.kind == want.kind && route_spec(was) == route_spec(want) => {}
            was => {
                let remove_first = was
                    .filter(|w| want.kind != RouteKind::Direct && block.is_ipv6() && w.oif != want.oif)
                    .map(entry_of);
                ops.push(Op::SetRoute {
                    route: want.clone(),
                    spec: route_spec(want),
                    new: was.is_none(),
                    remove_first,
                });
            }
        }
    }
    for (block, was) in &old.routes {
        if !new.routes.contains_key(block) {
            ops.push(Op::DelRoute { entry: entry_of(was) });
        }
    }
    for ip in old.neigh.keys().filter(|ip| !new.neigh.contains_key(*ip)) {
        ops.push(Op::DelNeigh { ip: *ip });
    }
    for (mac, (dst, _)) in &old.fdb {
        if !new.fdb.contains_key(mac) {
            ops.push(Op::DelFdb { mac: *mac, dst: Some(*dst) });
        }
    }
    ops
}

// ----- the kernel side -----

/// Programs cross-node routes in one network namespace (the one [`Routes::new`] ran in).
pub struct Routes {
    cfg: RouteConfig,
    nl: Netlink,
    /// ifindex and MAC of our VXLAN device, as last ensured.
    vtep: Option<(u32, [u8; 6])>,
    /// The peers, by name, as last given.
    peers: BTreeMap<String, PeerNode>,
    /// What the last complete sync found and made (local view, plan in force): deltas are
    /// applied against it. None: the next change is a complete sync.
    applied: Option<(LocalView, Plan)>,
    /// Encryption: the node's key pair (set before the first sync), the device once made
    /// and its ifindex, and why it could not be made.
    keys: Option<KeyPair>,
    tunnel: Option<(Tunnel, u32)>,
    tunnel_error: Option<String>,
    /// The gateways of this node's blocks: the WireGuard device holds them too (below).
    gateways: Vec<(IpAddr, u8)>,
}

fn gone(e: &NetlinkError) -> bool {
    e.is(libc::ENOENT) || e.is(libc::ESRCH) || e.is(libc::ENODEV)
}

/// The answer to a deletion: already gone is success.
fn deleted(r: Result<(), NetlinkError>, context: impl FnOnce() -> String) -> Result<(), RoutesError> {
    match r {
        Err(e) if !gone(&e) => Err(RoutesError::Netlink { context: context(), source: e }),
        _ => Ok(()),
    }
}

impl Routes {
    /// Validate the configuration and open a netlink socket in the calling thread's
    /// network namespace.
    pub fn new(cfg: RouteConfig) -> Result<Self, RoutesError> {
        cfg.validate()?;
        let nl = Netlink::open().map_err(RoutesError::netlink("opening netlink socket"))?;
        Ok(Routes {
            cfg,
            nl,
            vtep: None,
            peers: BTreeMap::new(),
            applied: None,
            keys: None,
            tunnel: None,
            tunnel_error: None,
            gateways: Vec::new(),
        })
    }

    /// This node's pod blocks. Their gateways go on the WireGuard device as host addresses,
    /// so what leaves through it from the node itself or masqueraded (a NodePort client
    /// sent to a pod on another node) has a source inside our blocks: one the peers accept
    /// from us and route back through the tunnel.
    pub fn set_local_blocks(&mut self, blocks: &[IpNetwork]) -> Result<(), RoutesError> {
        self.gateways = blocks
            .iter()
            .filter_map(|b| Block::new(normalize(*b)).ok())
            .map(|b| (b.gateway(), if b.net.is_ipv4() { 32 } else { 128 }))
            .collect();
        match self.tunnel.as_ref().map(|(_, i)| *i) {
            Some(index) => self.sync_tunnel_addresses(index),
            None => Ok(()),
        }
    }

    /// Make the device's addresses the gateways of our blocks: those of a block we no
    /// longer hold go (it may be another node's now). An IPv6 link-local one stays.
    fn sync_tunnel_addresses(&mut self, index: u32) -> Result<(), RoutesError> {
        let have = self.nl.addresses(Some(index)).map_err(RoutesError::netlink("listing addresses"))?;
        let stale = |a: &&Addr| {
            let link_local = matches!(a.ip, IpAddr::V6(v6) if v6.is_unicast_link_local());
            !link_local && !self.gateways.contains(&(a.ip, a.prefix))
        };
        for a in have.iter().filter(stale) {
            self.nl.delete_address(index, a.ip, a.prefix).map_err(RoutesError::netlink(format!(
                "removing {}/{} from {}",
                a.ip,
                a.prefix,
                wireguard::DEVICE
            )))?;
        }
        for (ip, prefix) in self.gateways.clone() {
            if !have.iter().any(|a| a.ip == ip && a.prefix == prefix) {
                self.nl
                    .add_address(index, ip, prefix)
                    .map_err(RoutesError::netlink(format!("adding {ip}/{prefix} to {}", wireguard::DEVICE)))?;
            }
        }
        Ok(())
    }

    /// The node's WireGuard key pair. A new pair (a rotation) takes effect on the device at
    /// once; peers learn the public key from the controller.
    pub fn set_keys(&mut self, keys: KeyPair) -> Result<(), RoutesError> {
        if let Some((t, _)) = &mut self.tunnel
            && t.public_key() != keys.public()
        {
            t.rekey(keys.clone()).map_err(|e| RoutesError::Tunnel(e.to_string()))?;
            tracing::info!(public_key = %wireguard::encode_key(keys.public()), "wireguard key rotated");
        }
        self.keys = Some(keys);
        Ok(())
    }

    /// Encryption as the controller says (mode, port, cluster CIDRs): the next change is a
    /// complete sync when it differs.
    pub fn set_encryption(&mut self, mode: Encryption, port: u16, cluster_cidrs: Vec<IpNetwork>) {
        if (self.cfg.encryption, self.cfg.wg_port, &self.cfg.cluster_cidrs) != (mode, port, &cluster_cidrs) {
            if self.cfg.wg_port != port {
                self.tunnel = None;
            }
            self.cfg.encryption = mode;
            self.cfg.wg_port = port;
            self.cfg.cluster_cidrs = cluster_cidrs;
            self.applied = None;
        }
    }

    /// Why the WireGuard device could not be made, if it could not.
    pub fn tunnel_error(&self) -> Option<String> {
        self.tunnel_error.clone()
    }

    /// Make (or remove, encryption off) the WireGuard device; its ifindex. A device that
    /// cannot be made (no WireGuard in this kernel) is logged and leaves the index `None`:
    /// mode on then routes in clear, strict drops.
    fn ensure_tunnel(&mut self) -> Result<Option<u32>, RoutesError> {
        if self.cfg.encryption == Encryption::Off {
            self.tunnel = None;
            self.tunnel_error = None;
            if wireguard::remove_device(&mut self.nl).map_err(RoutesError::netlink("removing the wireguard device"))? {
                tracing::info!(device = wireguard::DEVICE, "encryption off: removed the wireguard device");
            }
            return Ok(None);
        }
        let (_, underlay_mtu) = self.underlay_link()?;
        let mtu = wireguard::device_mtu(underlay_mtu, self.cfg.local_underlay);
        let made = match (self.tunnel.take(), &self.keys) {
            (Some((t, _)), _) => Ok(t),
            (None, Some(k)) => Tunnel::new(k.clone(), self.cfg.wg_port),
            (None, None) => Err(wireguard::TunnelError::NoKey),
        };
        let ensured = made.and_then(|mut t| t.ensure(&mut self.nl, mtu).map(|i| (t, i)));
        match ensured {
            Ok((t, index)) => {
                self.tunnel = Some((t, index));
                self.tunnel_error = None;
                self.sync_tunnel_addresses(index)?;
                Ok(Some(index))
            }
            Err(e) => {
                tracing::error!(error = %e, mode = %self.cfg.encryption, "no wireguard device: peers without encryption are {}",
                    if self.cfg.encryption == Encryption::Strict { "unreachable" } else { "reached in clear" });
                self.tunnel_error = Some(e.to_string());
                Ok(None)
            }
        }
    }

    /// Give the device's peers the keys, addresses and blocks of the peers as last given.
    fn sync_tunnel_peers(&mut self) -> Result<(), RoutesError> {
        let Some((t, _)) = &mut self.tunnel else { return Ok(()) };
        let v6 = self.cfg.local_underlay.is_ipv6();
        let peers: Vec<wireguard::PeerInput> = self
            .peers
            .values()
            .filter_map(|p| {
                Some(wireguard::PeerInput {
                    name: &p.name,
                    key: p.wg_key?,
                    endpoint: p.underlay_of(v6).or_else(|| p.underlay.first().copied())?,
                    blocks: &p.blocks,
                })
            })
            .collect();
        t.sync(&peers).map_err(|e| RoutesError::Tunnel(e.to_string()))?;
        Ok(())
    }

    /// Strict mode: a blackhole route per cluster CIDR (protocol [`wireguard::RTPROT_STRICT`]),
    /// under every more specific route: a peer block without an encrypted route is dropped.
    /// Other modes: none.
    fn sync_strict(&mut self, main: &[RouteEntry]) -> Result<(), RoutesError> {
        let want: BTreeSet<IpNetwork> = match self.cfg.encryption {
            Encryption::Strict => self.cfg.cluster_cidrs.iter().map(|c| normalize(*c)).collect(),
            _ => BTreeSet::new(),
        };
        let mut have = BTreeSet::new();
        for r in main.iter().filter(|r| r.protocol == wireguard::RTPROT_STRICT) {
            let net = IpNetwork::new(r.dst, r.prefix).map(normalize).ok();
            if net.is_some_and(|n| want.contains(&n)) && r.kind == RTN_BLACKHOLE {
                have.insert(net.expect("checked"));
                continue;
            }
            self.nl
                .delete_route(r)
                .map_err(RoutesError::netlink(format!("removing {}/{} (strict mode)", r.dst, r.prefix)))?;
        }
        for c in want.difference(&have) {
            self.nl
                .replace_blackhole(c.network(), c.prefix(), wireguard::RTPROT_STRICT)
                .map_err(RoutesError::netlink(format!("blackhole {c} (encryption strict)")))?;
            tracing::info!(cidr = %c, "encryption strict: unencrypted traffic to the cluster CIDR is dropped");
        }
        Ok(())
    }

    /// The MTU pods get under `encryption` (see [`pod_mtu`]), from the underlay link's MTU.
    pub fn pod_mtu(&mut self, encryption: Encryption) -> Result<u32, RoutesError> {
        let (_, underlay_mtu) = self.underlay_link()?;
        Ok(pod_mtu(self.cfg.mode, encryption, underlay_mtu, self.cfg.local_underlay))
    }

    /// The interface holding the local underlay address: (ifindex, MTU).
    fn underlay_link(&mut self) -> Result<(u32, u32), RoutesError> {
        let local = self.cfg.local_underlay;
        let addrs = self.nl.addresses(None).map_err(RoutesError::netlink("listing addresses"))?;
        let Some(a) = addrs.iter().find(|a| a.ip == local) else {
            return Err(RoutesError::Config(format!(
                "local underlay address {local} is not assigned to any interface in this network namespace"
            )));
        };
        let links = self.nl.links().map_err(RoutesError::netlink("listing links"))?;
        let mtu = links.iter().find(|l| l.index == a.index).and_then(|l| l.mtu).unwrap_or(1500);
        Ok((a.index, mtu))
    }

    /// Create or adopt the VXLAN device (modes auto and vxlan) and return its MAC, the one
    /// to advertise to the other nodes. In direct mode a leftover device of ours is removed
    /// and the answer is `None`.
    ///
    /// An existing device is adopted when its VNI, local address, port and learning match
    /// (its MTU is corrected and it is brought up); otherwise it is re-created. A link of
    /// that name that is not a VXLAN device is an error and is left alone.
    pub fn ensure_vtep(&mut self) -> Result<Option<[u8; 6]>, RoutesError> {
        let name = self.cfg.vxlan_name.clone();
        let vtep_err = |msg: String| RoutesError::Vtep { name: name.clone(), msg };
        let existing = self.nl.vxlan_by_name(&name).map_err(RoutesError::netlink(format!("looking up {name}")))?;
        if let Some(dev) = &existing
            && dev.link.kind.as_deref() != Some("vxlan")
        {
            return Err(vtep_err(format!(
                "a {} link of that name exists; not ours, left alone",
                dev.link.kind.as_deref().unwrap_or("non-vxlan")
            )));
        }
        if self.cfg.mode == RouteMode::Direct {
            if let Some(dev) = existing {
                match self.nl.delete_link(dev.link.index) {
                    Ok(()) => tracing::info!(device = %name, "route mode direct: removed the VXLAN device"),
                    Err(e) if gone(&e) => {}
                    Err(e) => return Err(RoutesError::netlink(format!("deleting vxlan device {name}"))(e)),
                }
            }
            self.vtep = None;
            return Ok(None);
        }
        let (_, underlay_mtu) = self.underlay_link()?;
        let mtu = self.cfg.mtu.unwrap_or_else(|| vxlan_mtu(underlay_mtu, self.cfg.local_underlay));
        let cfg = &self.cfg;
        if let Some(dev) = existing {
            let fits = dev.vni == Some(cfg.vni)
                && dev.local == Some(cfg.local_underlay)
                && dev.port == Some(cfg.port)
                && dev.learning == Some(false);
            if fits {
                if dev.link.mtu != Some(mtu) {
                    self.nl
                        .set_mtu(dev.link.index, mtu)
                        .map_err(RoutesError::netlink(format!("setting MTU {mtu} on {name}")))?;
                }
                if !dev.link.up {
                    self.nl
                        .set_link(dev.link.index, Some(true), None, None, None)
                        .map_err(RoutesError::netlink(format!("bringing {name} up")))?;
                }
                let mac = dev.link.mac.ok_or_else(|| vtep_err("device has no MAC address".into()))?;
                self.vtep = Some((dev.link.index, mac));
                return Ok(Some(mac));
            }
            tracing::warn!(
                device = %name,
                vni = ?dev.vni, local = ?dev.local, port = ?dev.port, learning = ?dev.learning,
                "VXLAN device parameters differ from the configuration: re-creating it"
            );
            deleted(self.nl.delete_link(dev.link.index), || format!("deleting outdated vxlan device {name}"))?;
        }
        let spec = VxlanSpec {
            name: &name,
            vni: self.cfg.vni,
            local: self.cfg.local_underlay,
            port: self.cfg.port,
            mtu: Some(mtu),
            mac: Some(vtep_mac_for(self.cfg.local_underlay)),
            learning: false,
            up: true,
        };
        match self.nl.create_vxlan(&spec) {
            Ok(()) => tracing::info!(
                device = %name, vni = spec.vni, local = %spec.local, port = spec.port, mtu,
                "created VXLAN device"
            ),
            // Someone created it between our lookup and now: adopt (and check) theirs.
            Err(e) if e.is(libc::EEXIST) => return self.ensure_vtep_adopt_only(),
            Err(e) => return Err(RoutesError::netlink(format!("creating vxlan device {name}"))(e)),
        }
        let dev = self
            .nl
            .vxlan_by_name(&name)
            .map_err(RoutesError::netlink(format!("looking up {name}")))?
            .ok_or_else(|| vtep_err("vanished right after creation".into()))?;
        let mac = dev.link.mac.ok_or_else(|| vtep_err("device has no MAC address".into()))?;
        self.vtep = Some((dev.link.index, mac));
        Ok(Some(mac))
    }

    fn ensure_vtep_adopt_only(&mut self) -> Result<Option<[u8; 6]>, RoutesError> {
        let name = self.cfg.vxlan_name.clone();
        let dev = self.nl.vxlan_by_name(&name).map_err(RoutesError::netlink(format!("looking up {name}")))?;
        match dev {
            Some(d)
                if d.link.kind.as_deref() == Some("vxlan")
                    && d.vni == Some(self.cfg.vni)
                    && d.local == Some(self.cfg.local_underlay)
                    && d.port == Some(self.cfg.port) =>
            {
                let mac = d.link.mac.unwrap_or_default();
                self.vtep = Some((d.link.index, mac));
                Ok(Some(mac))
            }
            _ => Err(RoutesError::Vtep {
                name,
                msg: "created concurrently by someone else with other parameters".into(),
            }),
        }
    }

    /// Converge the kernel to exactly `peers`: add what is missing, replace what changed,
    /// remove routes, FDB and neighbour entries of peers that are gone. Idempotent: a second
    /// call with the same peers changes nothing (`report.changes() == 0`).
    ///
    /// Every change is attempted even when some fail; failures come back together in
    /// [`RoutesError::Incomplete`] with the report of what was done.
    pub fn sync(&mut self, peers: &[PeerNode]) -> Result<SyncReport, RoutesError> {
        self.peers = peers.iter().map(|p| (p.name.clone(), p.clone())).collect();
        self.resync()
    }

    /// The peers as last given.
    pub fn peers(&self) -> impl Iterator<Item = &PeerNode> {
        self.peers.values()
    }

    /// A membership delta: `changed` peers added or replaced, `removed` ones gone. Applied
    /// as the few kernel changes it implies, planned against the last complete sync (no
    /// kernel dump); without one, or when a change fails, a complete sync.
    pub fn update(&mut self, changed: Vec<PeerNode>, removed: &[String]) -> Result<SyncReport, RoutesError> {
        // The touched peers as they were (their entries in the plan in force) and are.
        let mut was = Vec::new();
        for name in removed {
            was.extend(self.peers.remove(name));
        }
        let changed_names: Vec<String> = changed.iter().map(|p| p.name.clone()).collect();
        for p in changed {
            was.extend(self.peers.insert(p.name.clone(), p));
        }
        let Some((local, mut plan)) = self.applied.take() else {
            return self.resync();
        };
        let vxlan_index = self.vtep.map(|(i, _)| i);
        // Take the touched peers' entries out of the plan in force, plan those peers again
        // into it, and change the kernel by the difference: O(peers) in memory, a few
        // kernel calls.
        let before = plan.take_entries(&was.iter().collect::<Vec<_>>());
        let again: Vec<&PeerNode> = changed_names.iter().filter_map(|n| self.peers.get(n)).collect();
        plan_into(&self.cfg, &local, &mut plan, again.iter().copied());
        let after = plan.copy_entries(&again);
        let ops = plan_diff(&before, &after);
        if let Err(e) = self.sync_tunnel_peers() {
            // The plan in force is taken: a complete sync, which also programs the routes.
            tracing::warn!(error = %e, "wireguard peers not updated; syncing completely");
            return self.resync();
        }
        let mut report = SyncReport {
            unroutable: after.unroutable.clone(),
            vtep_mac: self.vtep.map(|(_, m)| m),
            ..Default::default()
        };
        let mut failures = Vec::new();
        for op in &ops {
            if let Err(e) = self.apply(op, vxlan_index, &mut report) {
                failures.push(e);
            }
        }
        for u in &report.unroutable {
            tracing::warn!(peer = %u.peer, block = %u.block, reason = %u.reason, "peer block not routable");
        }
        if !failures.is_empty() {
            // The kernel is not what the plan says: look at it again.
            tracing::warn!(failures = failures.len(), "route delta incomplete; syncing completely");
            return self.resync();
        }
        report.routed = after.routes.into_values().collect();
        self.applied = Some((local, plan));
        Ok(report)
    }

    /// Converge the kernel to the peers as last given, reading it completely (the audit).
    pub fn resync(&mut self) -> Result<SyncReport, RoutesError> {
        self.applied = None;
        let vtep_mac = self.ensure_vtep()?;
        let vxlan_index = self.vtep.map(|(i, _)| i);
        let wg_index = self.ensure_tunnel()?;
        let addrs = self.nl.addresses(None).map_err(RoutesError::netlink("listing addresses"))?;
        let all = self.nl.route_entries().map_err(RoutesError::netlink("listing routes"))?;
        let main: Vec<RouteEntry> = all.into_iter().filter(|r| r.table == RT_TABLE_MAIN).collect();
        let (fdb, neigh) = if vxlan_index.is_some() {
            (
                self.nl.fdb_entries().map_err(RoutesError::netlink("listing FDB entries"))?,
                self.nl.neighbours().map_err(RoutesError::netlink("listing neighbours"))?,
            )
        } else {
            (Vec::new(), Vec::new())
        };
        self.sync_strict(&main)?;
        // A peer the device lacks drops what is routed to it: the routes are programmed
        // anyway, and the failure reported with theirs.
        let mut failures = Vec::new();
        if let Err(e) = self.sync_tunnel_peers() {
            tracing::warn!(error = %e, "wireguard peers not updated");
            failures.push(e);
        }
        let mut local = LocalView::from_kernel(&addrs, &main, vxlan_index);
        local.wg_index = wg_index;
        let plan = plan_of(&self.cfg, &local, self.peers.values());
        let current = Current::select(main, fdb, neigh, vxlan_index);
        let ops = diff(&plan, &current, vxlan_index);

        let mut report = SyncReport {
            routed: plan.routes.values().cloned().collect(),
            unroutable: plan.unroutable.clone(),
            vtep_mac,
            ..Default::default()
        };
        for op in ops {
            if let Err(e) = self.apply(&op, vxlan_index, &mut report) {
                tracing::warn!(error = %e, "route change failed");
                failures.push(e);
            }
        }
        for u in &report.unroutable {
            tracing::warn!(peer = %u.peer, block = %u.block, reason = %u.reason, "peer block not routable");
        }
        if report.changes() > 0 {
            tracing::info!(
                mode = %self.cfg.mode,
                direct = report.count(RouteKind::Direct),
                vxlan = report.count(RouteKind::Vxlan),
                wireguard = report.count(RouteKind::Wireguard),
                unroutable = report.unroutable.len(),
                routes = ?report.routes, fdb = ?report.fdb, neigh = ?report.neigh,
                "cross-node routes synced"
            );
        }
        if failures.is_empty() {
            self.applied = Some((local, plan));
            Ok(report)
        } else {
            Err(RoutesError::Incomplete { report: Box::new(report), failures })
        }
    }

    fn apply(&mut self, op: &Op, vxlan_index: Option<u32>, report: &mut SyncReport) -> Result<(), RoutesError> {
        let dev = &self.cfg.vxlan_name;
        let count = |c: &mut Counts, new: bool| if new { c.added += 1 } else { c.replaced += 1 };
        match op {
            Op::SetFdb { mac, dst, peer, new } => {
                let index = vxlan_index.expect("FDB entries are planned only with a VXLAN device");
                self.nl.replace_fdb(index, *mac, *dst).map_err(RoutesError::netlink(format!(
                    "peer {peer}: FDB entry {} dst {dst} on {dev}",
                    format_mac(mac)
                )))?;
                tracing::debug!(%peer, mac = %format_mac(mac), %dst, "fdb set");
                count(&mut report.fdb, *new);
            }
            Op::SetNeigh { ip, mac, peer, new } => {
                let index = vxlan_index.expect("neighbours are planned only with a VXLAN device");
                self.nl.replace_neighbour(index, *ip, *mac, Some(RTPROT_NODEPLANE)).map_err(RoutesError::netlink(
                    format!("peer {peer}: neighbour {ip} lladdr {} on {dev}", format_mac(mac)),
                ))?;
                tracing::debug!(%peer, %ip, mac = %format_mac(mac), "neighbour set");
                count(&mut report.neigh, *new);
            }
            Op::SetRoute { route, spec, new, remove_first } => {
                if let Some(old) = remove_first {
                    deleted(self.nl.delete_route(old), || {
                        format!(
                            "peer {}: removing the old route to block {} via {:?}",
                            route.peer, route.block, old.gateway
                        )
                    })?;
                }
                self.nl.replace_route(spec).map_err(RoutesError::netlink(format!(
                    "peer {}: {} route to block {} via {}{}",
                    route.peer,
                    match route.kind {
                        RouteKind::Direct => "direct",
                        RouteKind::Vxlan => "vxlan",
                        RouteKind::Wireguard => "wireguard",
                    },
                    route.block,
                    route.via,
                    match route.kind {
                        RouteKind::Direct => String::new(),
                        RouteKind::Vxlan => format!(" dev {dev} onlink"),
                        RouteKind::Wireguard => format!(" dev {} onlink", wireguard::DEVICE),
                    }
                )))?;
                tracing::info!(peer = %route.peer, block = %route.block, kind = ?route.kind, via = %route.via, new, "route set");
                count(&mut report.routes, *new);
            }
            Op::DelRoute { entry } => {
                deleted(self.nl.delete_route(entry), || {
                    format!("removing stale route {}/{} via {:?}", entry.dst, entry.prefix, entry.gateway)
                })?;
                tracing::info!(dst = %entry.dst, prefix = entry.prefix, via = ?entry.gateway, "stale route removed");
                report.routes.removed += 1;
            }
            Op::DelNeigh { ip } => {
                let index = vxlan_index.expect("neighbours are found only on a VXLAN device");
                deleted(self.nl.delete_neighbour(index, *ip), || format!("removing stale neighbour {ip} on {dev}"))?;
                tracing::debug!(%ip, "stale neighbour removed");
                report.neigh.removed += 1;
            }
            Op::DelFdb { mac, dst } => {
                let index = vxlan_index.expect("FDB entries are found only on a VXLAN device");
                deleted(self.nl.delete_fdb(index, *mac, *dst), || {
                    format!("removing stale FDB entry {} on {dev}", format_mac(mac))
                })?;
                tracing::debug!(mac = %format_mac(mac), dst = ?dst, "stale fdb entry removed");
                report.fdb.removed += 1;
            }
        }
        Ok(())
    }

    /// Remove everything this module programmed: every main-table route with our protocol
    /// and the VXLAN device (with it its FDB and neighbour entries). Already gone is
    /// success; every step is attempted and all failures are reported together.
    pub fn teardown(&mut self) -> Result<(), RoutesError> {
        self.applied = None;
        let mut failures = Vec::new();
        let mut removed = 0;
        match self.nl.route_entries() {
            Ok(all) => {
                let ours = |r: &&RouteEntry| {
                    r.table == RT_TABLE_MAIN && [RTPROT_NODEPLANE, wireguard::RTPROT_STRICT].contains(&r.protocol)
                };
                for r in all.iter().filter(ours) {
                    match self.nl.delete_route(r) {
                        Ok(()) => removed += 1,
                        Err(e) if gone(&e) => {}
                        Err(e) => failures.push(RoutesError::netlink(format!(
                            "teardown: removing route {}/{} via {:?}",
                            r.dst, r.prefix, r.gateway
                        ))(e)),
                    }
                }
            }
            Err(e) => failures.push(RoutesError::netlink("teardown: listing routes")(e)),
        }
        let name = self.cfg.vxlan_name.clone();
        match self.nl.vxlan_by_name(&name) {
            Ok(Some(dev)) if dev.link.kind.as_deref() == Some("vxlan") => match self.nl.delete_link(dev.link.index) {
                Ok(()) => tracing::info!(device = %name, "removed VXLAN device"),
                Err(e) if gone(&e) => {}
                Err(e) => failures.push(RoutesError::netlink(format!("teardown: deleting vxlan device {name}"))(e)),
            },
            Ok(Some(other)) => {
                tracing::warn!(device = %name, kind = ?other.link.kind, "not a VXLAN device: not ours, left alone")
            }
            Ok(None) => {}
            Err(e) => failures.push(RoutesError::netlink(format!("teardown: looking up {name}"))(e)),
        }
        self.vtep = None;
        self.tunnel = None;
        match wireguard::remove_device(&mut self.nl) {
            Ok(true) => tracing::info!(device = wireguard::DEVICE, "removed the wireguard device"),
            Ok(false) => {}
            Err(e) => failures.push(RoutesError::netlink("teardown: deleting the wireguard device")(e)),
        }
        tracing::info!(routes = removed, "cross-node routes torn down");
        if failures.is_empty() { Ok(()) } else { Err(RoutesError::Teardown(failures)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::netlink::Addr;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn net(s: &str) -> IpNetwork {
        s.parse().unwrap()
    }
    const MAC2: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
    const MAC3: [u8; 6] = [0x02, 0, 0, 0, 0, 3];
    const VX: u32 = 42;

    fn peer(name: &str, underlay: &[&str], blocks: &[&str], mac: Option<[u8; 6]>) -> PeerNode {
        PeerNode {
            name: name.into(),
            underlay: underlay.iter().map(|s| ip(s)).collect(),
            blocks: blocks.iter().map(|s| net(s)).collect(),
            vtep_mac: mac,
            wg_key: None,
        }
    }

    /// Encryption: a peer with a key goes through the WireGuard device in every route mode;
    /// without one it keeps its route (on) or gets none (strict).
    #[test]
    fn encryption_routes_keyed_peers_through_the_tunnel() {
        const WG: u32 = 77;
        let mut l = local();
        l.wg_index = Some(WG);
        let mut ps = peers();
        ps[0].wg_key = Some([2; 32]);
        for mode in [RouteMode::Direct, RouteMode::Vxlan, RouteMode::Auto] {
            let mut c = cfg(mode);
            c.encryption = Encryption::On;
            let p = plan(&c, &l, &ps);
            let n2: Vec<&PeerRoute> = p.routes.values().filter(|r| r.peer == "n2").collect();
            assert_eq!(n2.len(), 2, "{mode}");
            assert!(n2.iter().all(|r| r.kind == RouteKind::Wireguard && r.oif == Some(WG)), "{mode}: {n2:?}");
            assert_eq!(route_spec(n2[0]).gateway, ip("10.244.2.1"));
            assert!(route_spec(n2[0]).onlink);
            assert!(p.fdb.values().all(|(_, peer)| peer != "n2"), "no tunnel entry for a peer with a key");
            assert!(p.routes.values().any(|r| r.peer == "n3" && r.kind != RouteKind::Wireguard), "{mode}: n3 in clear");
            c.encryption = Encryption::Strict;
            let p = plan(&c, &l, &ps);
            assert!(p.routes.values().all(|r| r.peer == "n2"), "strict: nothing for the keyless n3");
            assert_eq!(p.unroutable.iter().filter(|u| u.peer == "n3").count(), 2);
            assert!(p.unroutable[0].reason.contains("its key is unknown"), "{:?}", p.unroutable);
        }
        // Strict without a device: nothing routed at all.
        l.wg_index = None;
        let mut c = cfg(RouteMode::Auto);
        c.encryption = Encryption::Strict;
        let p = plan(&c, &l, &ps);
        assert!(p.routes.is_empty() && p.unroutable.len() == 4);
        assert!(p.unroutable[0].reason.contains("device is missing"));
    }

    /// Node 1: underlay 192.0.2.11/24 + 2001:db8:a::11/64 on eth0 (index 2), pods on np0 (3).
    fn local() -> LocalView {
        let addrs = vec![
            Addr { index: 1, ip: ip("127.0.0.1"), prefix: 8 },
            Addr { index: 1, ip: ip("::1"), prefix: 128 },
            Addr { index: 2, ip: ip("192.0.2.11"), prefix: 24 },
            Addr { index: 2, ip: ip("2001:db8:a::11"), prefix: 64 },
            Addr { index: 2, ip: ip("fe80::1"), prefix: 64 },
            Addr { index: 3, ip: ip("10.244.1.1"), prefix: 24 },
            Addr { index: 3, ip: ip("fd00:1::1"), prefix: 64 },
            Addr { index: 9, ip: ip("fe80::9"), prefix: 64 },
        ];
        let routes = vec![
            kernel_route("10.244.1.0", 24, None, 2, 3),
            kernel_route("192.0.2.0", 24, None, 2, 2),
            kernel_route("fd00:1::", 64, None, 2, 3),
        ];
        LocalView::from_kernel(&addrs, &routes, Some(9))
    }

    fn kernel_route(dst: &str, prefix: u8, gw: Option<&str>, proto: u8, oif: u32) -> RouteEntry {
        let d = ip(dst);
        RouteEntry {
            v6: d.is_ipv6(),
            dst: d,
            prefix,
            gateway: gw.map(ip),
            oif: Some(oif),
            table: 254,
            protocol: proto,
            priority: default_metric(d.is_ipv6()),
            kind: RTN_UNICAST,
            onlink: false,
        }
    }

    fn cfg(mode: RouteMode) -> RouteConfig {
        RouteConfig::new(mode, VX, ip("192.0.2.11"))
    }

    fn peers() -> Vec<PeerNode> {
        vec![
            peer("n2", &["192.0.2.12", "2001:db8:a::12"], &["10.244.2.0/24", "fd00:2::/64"], Some(MAC2)),
            // n3 is on another subnet, reached through a router.
            peer("n3", &["198.51.100.3", "2001:db8:b::3"], &["10.244.3.0/24", "fd00:3::/64"], Some(MAC3)),
        ]
    }

    fn kinds(p: &Plan) -> Vec<(String, RouteKind, IpAddr)> {
        p.routes.values().map(|r| (r.block.to_string(), r.kind, r.via)).collect()
    }

    /// A delta planned against the last plan is exactly what a complete diff against the
    /// kernel state that plan made would do: a leaving peer's routes, neighbours and FDB
    /// entry go, a moved peer's FDB entry is replaced, the others are left alone.
    #[test]
    fn plan_diff_is_the_few_changes_a_delta_implies() {
        let cfg = cfg(RouteMode::Vxlan);
        let old = plan(&cfg, &local(), &peers());
        let empty = plan_diff(&Plan::default(), &old);
        assert_eq!(empty.len(), 2 + 4 + 4, "2 FDB entries, 4 neighbours, 4 routes: {empty:?}");
        assert!(plan_diff(&old, &old).is_empty());
        // n3 leaves.
        let new = plan(&cfg, &local(), &peers()[..1]);
        let ops = plan_diff(&old, &new);
        let dels_route: Vec<_> = ops
            .iter()
            .filter_map(|o| {
                if let Op::DelRoute { entry } = o {
                    Some((entry.dst, entry.prefix, entry.oif, entry.onlink))
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(dels_route, vec![(ip("10.244.3.0"), 24, Some(9), true), (ip("fd00:3::"), 64, Some(9), true)]);
        assert_eq!(ops.iter().filter(|o| matches!(o, Op::DelNeigh { .. })).count(), 2);
        assert_eq!(
            ops.iter()
                .filter(|o| matches!(o, Op::DelFdb { mac, dst } if *mac == MAC3 && *dst == Some(ip("198.51.100.3"))))
                .count(),
            1
        );
        assert_eq!(ops.len(), 5, "{ops:?}");
        // n2 moves to another underlay address: one FDB entry replaced, nothing else.
        let mut moved = peers();
        moved[0].underlay[0] = ip("192.0.2.99");
        let ops = plan_diff(&old, &plan(&cfg, &local(), &moved));
        assert!(matches!(ops.as_slice(), [Op::SetFdb { mac, new: false, .. }] if *mac == MAC2), "{ops:?}");
        // The removal of a route made by the plan, as the kernel reports that route, is the
        // entry plan_diff deletes (so deleting it by its own fields finds it).
        let r = &old.routes[&net("10.244.2.0/24")];
        let installed = route_spec(r);
        let e = entry_of(r);
        assert_eq!(
            (e.dst, e.prefix, e.gateway, e.oif, e.onlink),
            (installed.dst, installed.prefix, Some(installed.gateway), installed.oif, installed.onlink)
        );
    }

    #[test]
    fn mode_parses_from_config_strings() {
        for (s, m) in [("auto", RouteMode::Auto), ("direct", RouteMode::Direct), ("vxlan", RouteMode::Vxlan)] {
            assert_eq!(serde_json::from_str::<RouteMode>(&format!("\"{s}\"")).unwrap(), m);
            assert_eq!(m.to_string(), s);
        }
        assert!(serde_json::from_str::<RouteMode>("\"bgp\"").is_err());
    }

    #[test]
    fn config_defaults_and_validation() {
        let c: RouteConfig = serde_json::from_str(r#"{"mode":"vxlan","vni":7,"local_underlay":"192.0.2.1"}"#).unwrap();
        assert_eq!(c.vxlan_name, "np.vxlan");
        assert_eq!(c.port, 4789);
        assert_eq!(c.mtu, None);
        assert!(c.validate().is_ok());
        let c2: RouteConfig = serde_json::from_str(r#"{"vni":7,"local_underlay":"2001:db8::1"}"#).unwrap();
        assert_eq!(c2.mode, RouteMode::Auto);
        for bad in [
            RouteConfig { vni: 0, ..c.clone() },
            RouteConfig { vni: 1 << 24, ..c.clone() },
            RouteConfig { vxlan_name: "much-too-long-name".into(), ..c.clone() },
            RouteConfig { vxlan_name: String::new(), ..c.clone() },
            RouteConfig { local_underlay: ip("0.0.0.0"), ..c.clone() },
            RouteConfig { mtu: Some(100), ..c.clone() },
        ] {
            assert!(matches!(bad.validate(), Err(RoutesError::Config(_))), "{bad:?} accepted");
        }
    }

    #[test]
    fn mtu_and_mac_helpers() {
        assert_eq!(vxlan_mtu(1500, ip("192.0.2.1")), 1450);
        assert_eq!(vxlan_mtu(1500, ip("2001:db8::1")), 1430);
        assert_eq!(vxlan_mtu(9000, ip("192.0.2.1")), 8950);
        let a = vtep_mac_for(ip("192.0.2.11"));
        assert_eq!(a, vtep_mac_for(ip("192.0.2.11")), "stable");
        assert_ne!(a, vtep_mac_for(ip("192.0.2.12")));
        assert_eq!(a[0] & 0x03, 0x02, "locally administered unicast");
        assert_eq!(parse_mac("02:00:00:00:00:0a").unwrap(), Some([2, 0, 0, 0, 0, 10]));
        assert_eq!(parse_mac("").unwrap(), None);
        assert!(parse_mac("02:00:00:00:00").is_err());
        assert!(parse_mac("02:00:00:00:00:zz").is_err());
    }

    #[test]
    fn pod_mtu_takes_the_largest_encapsulation() {
        let (v4, v6) = (ip("192.0.2.1"), ip("2001:db8::1"));
        assert_eq!(pod_mtu(RouteMode::Direct, Encryption::Off, 1500, v4), 1500);
        assert_eq!(pod_mtu(RouteMode::Vxlan, Encryption::Off, 1500, v4), 1450);
        assert_eq!(pod_mtu(RouteMode::Auto, Encryption::Off, 1500, v6), 1430);
        for mode in [RouteMode::Direct, RouteMode::Vxlan, RouteMode::Auto] {
            assert_eq!(pod_mtu(mode, Encryption::On, 1500, v4), 1440, "{mode:?}");
            assert_eq!(pod_mtu(mode, Encryption::Strict, 1500, v6), 1420, "{mode:?}");
        }
        assert_eq!(pod_mtu(RouteMode::Vxlan, Encryption::On, 9000, v4), 8940);
    }

    #[test]
    fn on_link_uses_connected_prefixes() {
        let l = local();
        assert!(l.on_link(ip("192.0.2.12")));
        assert!(l.on_link(ip("2001:db8:a::12")));
        assert!(!l.on_link(ip("198.51.100.3")), "behind a router");
        assert!(!l.on_link(ip("2001:db8:b::3")));
        assert!(!l.on_link(ip("192.0.2.11")), "our own address is not a peer");
        assert!(!l.on_link(ip("fe80::2")), "link-local prefixes are not underlay subnets");
        assert!(!l.on_link(ip("127.0.0.2")));
        // Host-prefix addresses say nothing about neighbours.
        let v = LocalView::from_kernel(&[Addr { index: 2, ip: ip("192.0.2.11"), prefix: 32 }], &[], None);
        assert!(!v.on_link(ip("192.0.2.12")));
        // Subnet of a non-network address is normalized.
        let v = LocalView::from_kernel(&[Addr { index: 2, ip: ip("10.1.2.3"), prefix: 16 }], &[], None);
        assert_eq!(v.subnets, vec![net("10.1.0.0/16")]);
        assert!(v.on_link(ip("10.1.200.1")));
    }

    #[test]
    fn direct_mode_routes_via_underlay_and_reports_missing_family() {
        let mut ps = peers();
        ps.push(peer("n4", &["192.0.2.14"], &["10.244.4.0/24", "fd00:4::/64"], Some([2, 0, 0, 0, 0, 4])));
        let p = plan(&cfg(RouteMode::Direct), &local(), &ps);
        assert_eq!(
            kinds(&p),
            vec![
                ("10.244.2.0/24".into(), RouteKind::Direct, ip("192.0.2.12")),
                ("10.244.3.0/24".into(), RouteKind::Direct, ip("198.51.100.3")),
                ("10.244.4.0/24".into(), RouteKind::Direct, ip("192.0.2.14")),
                ("fd00:2::/64".into(), RouteKind::Direct, ip("2001:db8:a::12")),
                ("fd00:3::/64".into(), RouteKind::Direct, ip("2001:db8:b::3")),
            ]
        );
        assert!(p.fdb.is_empty() && p.neigh.is_empty());
        assert_eq!(p.unroutable.len(), 1);
        assert_eq!(p.unroutable[0].peer, "n4");
        assert_eq!(p.unroutable[0].block, net("fd00:4::/64"));
        assert!(p.unroutable[0].reason.contains("no IPv6 underlay"), "{}", p.unroutable[0]);
    }

    #[test]
    fn vxlan_mode_uses_block_gateways_fdb_and_neighbours() {
        let p = plan(&cfg(RouteMode::Vxlan), &local(), &peers());
        assert_eq!(
            kinds(&p),
            vec![
                ("10.244.2.0/24".into(), RouteKind::Vxlan, ip("10.244.2.1")),
                ("10.244.3.0/24".into(), RouteKind::Vxlan, ip("10.244.3.1")),
                ("fd00:2::/64".into(), RouteKind::Vxlan, ip("fd00:2::1")),
                ("fd00:3::/64".into(), RouteKind::Vxlan, ip("fd00:3::1")),
            ]
        );
        assert_eq!(p.fdb.get(&MAC2), Some(&(ip("192.0.2.12"), "n2".to_string())));
        assert_eq!(p.fdb.get(&MAC3), Some(&(ip("198.51.100.3"), "n3".to_string())));
        assert_eq!(p.neigh.len(), 4);
        assert_eq!(p.neigh.get(&ip("fd00:3::1")), Some(&(MAC3, "n3".to_string())));
        assert!(p.unroutable.is_empty());
        let spec = route_spec(&p.routes[&net("fd00:2::/64")]);
        assert_eq!(
            spec,
            RouteSpec {
                dst: ip("fd00:2::"),
                prefix: 64,
                gateway: ip("fd00:2::1"),
                oif: Some(9),
                onlink: true,
                protocol: RTPROT_NODEPLANE
            }
        );
    }

    #[test]
    fn vxlan_needs_mac_and_tunnel_family() {
        let ps = vec![
            peer("n2", &["192.0.2.12"], &["10.244.2.0/24"], None),
            peer("n5", &["2001:db8:a::15"], &["10.244.5.0/24"], Some([2, 0, 0, 0, 0, 5])),
        ];
        let p = plan(&cfg(RouteMode::Vxlan), &local(), &ps);
        assert!(p.routes.is_empty());
        assert!(p.unroutable[0].reason.contains("no VTEP MAC"), "{}", p.unroutable[0]);
        assert!(
            p.unroutable[1].reason.contains("no IPv4 underlay address for the VXLAN tunnel"),
            "{}",
            p.unroutable[1]
        );
        // Without our own device nothing goes over VXLAN.
        let mut l = local();
        l.vxlan_index = None;
        let p = plan(&cfg(RouteMode::Vxlan), &l, &peers());
        assert!(p.routes.is_empty());
        assert!(p.unroutable.iter().all(|u| u.reason.contains("VXLAN device is missing")));
    }

    #[test]
    fn auto_mode_direct_on_link_vxlan_elsewhere() {
        let p = plan(&cfg(RouteMode::Auto), &local(), &peers());
        assert_eq!(
            kinds(&p),
            vec![
                ("10.244.2.0/24".into(), RouteKind::Direct, ip("192.0.2.12")),
                ("10.244.3.0/24".into(), RouteKind::Vxlan, ip("10.244.3.1")),
                ("fd00:2::/64".into(), RouteKind::Direct, ip("2001:db8:a::12")),
                ("fd00:3::/64".into(), RouteKind::Vxlan, ip("fd00:3::1")),
            ]
        );
        // Only the tunnelled peer gets FDB and neighbour entries.
        assert_eq!(p.fdb.keys().collect::<Vec<_>>(), vec![&MAC3]);
        assert_eq!(p.neigh.keys().copied().collect::<Vec<_>>(), vec![ip("10.244.3.1"), ip("fd00:3::1")]);
    }

    #[test]
    fn auto_mode_falls_back_to_vxlan_for_a_family_the_underlay_lacks() {
        let ps = vec![peer("n2", &["192.0.2.12"], &["10.244.2.0/24", "fd00:2::/64"], Some(MAC2))];
        let p = plan(&cfg(RouteMode::Auto), &local(), &ps);
        assert_eq!(
            kinds(&p),
            vec![
                ("10.244.2.0/24".into(), RouteKind::Direct, ip("192.0.2.12")),
                ("fd00:2::/64".into(), RouteKind::Vxlan, ip("fd00:2::1")),
            ]
        );
        assert!(p.unroutable.is_empty());
        // ... and reports it when VXLAN is impossible too.
        let ps = vec![peer("n2", &["192.0.2.12"], &["fd00:2::/64"], None)];
        let p = plan(&cfg(RouteMode::Auto), &local(), &ps);
        assert!(p.routes.is_empty());
        let why = &p.unroutable[0].reason;
        assert!(why.contains("no IPv6 underlay address") && why.contains("no VTEP MAC"), "{why}");
        // Not on-link and no MAC.
        let ps = vec![peer("n3", &["198.51.100.3"], &["10.244.3.0/24"], None)];
        let p = plan(&cfg(RouteMode::Auto), &local(), &ps);
        assert!(p.unroutable[0].reason.contains("198.51.100.3 is not on a connected subnet"), "{}", p.unroutable[0]);
    }

    #[test]
    fn ourselves_duplicates_and_foreign_routes_are_skipped() {
        let ps = vec![
            // Ourselves, as the controller may list us.
            peer("n1", &["192.0.2.11"], &["10.244.1.0/24"], Some([2, 0, 0, 0, 0, 1])),
            peer("zz", &["192.0.2.99"], &["10.244.2.0/24"], Some([2, 0, 0, 0, 0, 0x99])),
            peer("n2", &["192.0.2.12"], &["10.244.2.7/24"], Some(MAC2)),
            // Claims our own block: the kernel's connected route is not ours.
            peer("bad", &["192.0.2.50"], &["10.244.1.0/24"], None),
            // Two tunnelled peers with the same VTEP MAC: the second cannot be told apart.
            peer("n8", &["198.51.100.8"], &["10.244.8.0/24"], Some([2, 0, 0, 0, 0, 0x88])),
            peer("n9", &["198.51.100.9"], &["10.244.9.0/24"], Some([2, 0, 0, 0, 0, 0x88])),
        ];
        let p = plan(&cfg(RouteMode::Auto), &local(), &ps);
        assert_eq!(
            kinds(&p),
            vec![
                ("10.244.2.0/24".into(), RouteKind::Direct, ip("192.0.2.12")),
                ("10.244.8.0/24".into(), RouteKind::Vxlan, ip("10.244.8.1")),
            ]
        );
        assert_eq!(p.routes[&net("10.244.2.0/24")].peer, "n2", "name order decides, not list order");
        let why: BTreeMap<&str, &str> = p.unroutable.iter().map(|u| (u.peer.as_str(), u.reason.as_str())).collect();
        assert_eq!(why.len(), 3, "{why:?}");
        assert!(why["zz"].contains("also claimed by peer n2"));
        assert!(why["bad"].contains("did not install"));
        assert!(why["n9"].contains("also claimed by peer n8"), "{}", why["n9"]);
    }

    fn own(dst: &str, prefix: u8, gw: &str, oif: u32, onlink: bool) -> RouteEntry {
        RouteEntry { onlink, ..kernel_route(dst, prefix, Some(gw), RTPROT_NODEPLANE, oif) }
    }
    fn fdb(mac: [u8; 6], dst: &str) -> FdbEntry {
        FdbEntry { ifindex: 9, mac, dst: Some(ip(dst)), state: NUD_PERMANENT, flags: NTF_SELF }
    }
    fn neigh(addr: &str, mac: [u8; 6]) -> Neighbour {
        Neighbour { ifindex: 9, ip: ip(addr), mac: Some(mac), state: NUD_PERMANENT }
    }

    /// What the kernel would hold after applying `plan` (oif of direct routes: eth0 = 2).
    fn applied(p: &Plan) -> Current {
        Current {
            routes: p
                .routes
                .values()
                .map(|r| match r.kind {
                    RouteKind::Direct => {
                        own(&r.block.network().to_string(), r.block.prefix(), &r.via.to_string(), 2, false)
                    }
                    RouteKind::Vxlan | RouteKind::Wireguard => {
                        own(&r.block.network().to_string(), r.block.prefix(), &r.via.to_string(), r.oif.unwrap(), true)
                    }
                })
                .collect(),
            fdb: p.fdb.iter().map(|(m, (d, _))| fdb(*m, &d.to_string())).collect(),
            neigh: p.neigh.iter().map(|(i, (m, _))| neigh(&i.to_string(), *m)).collect(),
        }
    }

    fn summary(ops: &[Op]) -> Vec<String> {
        ops.iter()
            .map(|o| match o {
                Op::SetFdb { mac, dst, new, .. } => {
                    format!("{} fdb {} {dst}", if *new { "add" } else { "replace" }, mac[5])
                }
                Op::SetNeigh { ip, new, .. } => format!("{} neigh {ip}", if *new { "add" } else { "replace" }),
                Op::SetRoute { route, new, remove_first, .. } => format!(
                    "{}{} route {} {:?} via {}",
                    if remove_first.is_some() { "delete+" } else { "" },
                    if *new { "add" } else { "replace" },
                    route.block,
                    route.kind,
                    route.via
                ),
                Op::DelRoute { entry } => format!("del route {}/{} via {:?}", entry.dst, entry.prefix, entry.gateway),
                Op::DelNeigh { ip } => format!("del neigh {ip}"),
                Op::DelFdb { mac, dst } => format!("del fdb {} {dst:?}", mac[5]),
            })
            .collect()
    }

    #[test]
    fn diff_from_nothing_adds_everything_in_dependency_order() {
        let p = plan(&cfg(RouteMode::Auto), &local(), &peers());
        let ops = diff(&p, &Current::default(), Some(9));
        assert_eq!(
            summary(&ops),
            vec![
                "add fdb 3 198.51.100.3",
                "add neigh 10.244.3.1",
                "add neigh fd00:3::1",
                "add route 10.244.2.0/24 Direct via 192.0.2.12",
                "add route 10.244.3.0/24 Vxlan via 10.244.3.1",
                "add route fd00:2::/64 Direct via 2001:db8:a::12",
                "add route fd00:3::/64 Vxlan via fd00:3::1",
            ]
        );
    }

    #[test]
    fn diff_of_applied_state_is_empty() {
        for mode in [RouteMode::Auto, RouteMode::Direct, RouteMode::Vxlan] {
            let p = plan(&cfg(mode), &local(), &peers());
            assert!(diff(&p, &applied(&p), Some(9)).is_empty(), "{mode}");
        }
    }

    #[test]
    fn diff_removes_a_gone_peer_and_nothing_else() {
        let before = plan(&cfg(RouteMode::Vxlan), &local(), &peers());
        let after = plan(&cfg(RouteMode::Vxlan), &local(), &peers()[..1]);
        let ops = diff(&after, &applied(&before), Some(9));
        assert_eq!(
            summary(&ops),
            vec![
                "del route 10.244.3.0/24 via Some(10.244.3.1)",
                "del route fd00:3::/64 via Some(fd00:3::1)",
                "del neigh 10.244.3.1",
                "del neigh fd00:3::1",
                "del fdb 3 None",
            ]
        );
    }

    #[test]
    fn diff_replaces_changed_routes_in_place() {
        // Direct -> VXLAN: routes replaced (not deleted and re-added), L2 entries added first.
        let before = plan(&cfg(RouteMode::Direct), &local(), &peers()[..1]);
        let after = plan(&cfg(RouteMode::Vxlan), &local(), &peers()[..1]);
        let ops = diff(&after, &applied(&before), Some(9));
        assert_eq!(
            summary(&ops),
            vec![
                "add fdb 2 192.0.2.12",
                "add neigh 10.244.2.1",
                "add neigh fd00:2::1",
                "replace route 10.244.2.0/24 Vxlan via 10.244.2.1",
                "delete+replace route fd00:2::/64 Vxlan via fd00:2::1",
            ]
        );
        // VXLAN -> direct needs no removal first, in either family.
        let ops = diff(&before, &applied(&after), Some(9));
        assert_eq!(
            summary(&ops),
            vec![
                "replace route 10.244.2.0/24 Direct via 192.0.2.12",
                "replace route fd00:2::/64 Direct via 2001:db8:a::12",
                "del neigh 10.244.2.1",
                "del neigh fd00:2::1",
                "del fdb 2 None",
            ]
        );
        // A peer moved (new underlay) and re-created its VTEP (new MAC).
        let mut moved = peers();
        moved[1].underlay = vec![ip("198.51.100.33")];
        moved[1].vtep_mac = Some([2, 0, 0, 0, 0, 0x33]);
        let before = plan(&cfg(RouteMode::Vxlan), &local(), &peers());
        let after = plan(&cfg(RouteMode::Vxlan), &local(), &moved);
        let ops = diff(&after, &applied(&before), Some(9));
        assert_eq!(
            summary(&ops),
            vec!["add fdb 51 198.51.100.33", "replace neigh 10.244.3.1", "replace neigh fd00:3::1", "del fdb 3 None"]
        );
        // Same MAC, new underlay: the FDB entry is replaced.
        let mut moved = peers();
        moved[1].underlay = vec![ip("198.51.100.33")];
        let after = plan(&cfg(RouteMode::Vxlan), &local(), &moved);
        assert_eq!(summary(&diff(&after, &applied(&before), Some(9))), vec!["replace fdb 3 198.51.100.33"]);
    }

    #[test]
    fn diff_handles_recreated_device_and_odd_leftovers() {
        let p = plan(&cfg(RouteMode::Vxlan), &local(), &peers()[..1]);
        // Device re-created with a new ifindex: the kernel dropped its routes and entries.
        let mut cur = applied(&p);
        cur.fdb.clear();
        cur.neigh.clear();
        cur.routes.clear();
        assert_eq!(diff(&p, &cur, Some(10)).len(), 5);
        // A route of ours that points at an old device index is replaced.
        let cur = applied(&p);
        let mut l10 = local();
        l10.vxlan_index = Some(10);
        let ops = diff(&plan(&cfg(RouteMode::Vxlan), &l10, &peers()[..1]), &cur, Some(10));
        assert_eq!(
            summary(&ops),
            vec![
                "replace route 10.244.2.0/24 Vxlan via 10.244.2.1",
                "delete+replace route fd00:2::/64 Vxlan via fd00:2::1"
            ]
        );
        // A duplicate of ours with another metric goes; the matching one stays.
        let mut cur = applied(&p);
        let mut dup = cur.routes[0].clone();
        dup.priority = 77;
        cur.routes.push(dup);
        assert_eq!(summary(&diff(&p, &cur, Some(9))), vec!["del route 10.244.2.0/24 via Some(10.244.2.1)"]);
        // A second remote for a MAC goes; the wanted one stays.
        let mut cur = applied(&p);
        cur.fdb.push(fdb(MAC2, "192.0.2.200"));
        assert_eq!(summary(&diff(&p, &cur, Some(9))), vec!["del fdb 2 Some(192.0.2.200)"]);
        // A non-permanent neighbour or a neighbour on another device is not ours.
        let sel = Current::select(
            vec![kernel_route("10.9.0.0", 16, Some("192.0.2.1"), 4, 2)],
            vec![FdbEntry { ifindex: 3, mac: MAC3, dst: None, state: NUD_PERMANENT, flags: NTF_SELF }],
            vec![
                Neighbour { state: 0x02, ..neigh("10.244.2.1", MAC2) },
                Neighbour { ifindex: 2, ..neigh("192.0.2.12", MAC2) },
            ],
            Some(9),
        );
        assert!(sel.routes.is_empty() && sel.fdb.is_empty() && sel.neigh.is_empty());
    }
}
