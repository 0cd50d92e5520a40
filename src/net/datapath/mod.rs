//! The pod datapath: what ADD, DEL, CHECK, GC and STATUS do to the kernel and the leases.
//!
//! All functions here are blocking; the server calls them on the blocking pool. Namespace
//! switching only ever happens inside [`crate::sys::netns::netlink_in`].

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use ipnetwork::IpNetwork;

use super::reaper::{GRAVEYARD_GROUP, Reaper, is_graveyard_name};
use crate::net::cni::request::Request;
use crate::net::cni::result::{Dns, Interface, IpConfig, ResultModel, Route};
use crate::net::cni::{CniError, Code};
use crate::net::ipam::{Ipam, IpamError, Lease, LeaseState, Owner};
use crate::net::pending_del;
use crate::obs::doctor::{Finding, Repair};
use crate::obs::metrics::{Histograms, StepLabels, Steps, step_histogram};
use crate::rpc::node as api;
pub use crate::sys::net_kernel::NetKernel;
use crate::sys::net_kernel::{Links, PodNetns, Veth};
use crate::sys::netlink::{Addr, Link, LinkStep, NetlinkError, format_mac, random_mac};
use crate::sys::netns::NetnsError;
use crate::util::Family;

/// Host-side veth name of an attachment: "np" + 13 hex digits of a stable hash.
pub fn host_ifname(owner: &Owner) -> String {
    let h = crate::util::fnv1a(&[owner.container_id.as_bytes(), owner.ifname.as_bytes()]);
    format!("np{:013x}", h & 0xf_ffff_ffff_ffff)
}

pub fn is_host_ifname(name: &str) -> bool {
    name.len() == 15 && name.starts_with("np") && name[2..].bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A pod's host veth, live: named like one and not retired into the graveyard group (a
/// retired link keeps its name until the reaper deletes it or an ADD needs the name).
fn is_pod_veth(link: &Link) -> bool {
    is_host_ifname(&link.name) && link.group != GRAVEYARD_GROUP
}

/// A retired link, waiting for the reaper: in the graveyard group, or renamed into the
/// graveyard by an ADD that needed its name (or by an older agent).
fn is_graveyard(link: &Link) -> bool {
    link.group == GRAVEYARD_GROUP || is_graveyard_name(&link.name)
}

/// What can go wrong in the datapath. Mapped to CNI error codes in one place
/// (`From<NetError> for CniError`); the message is the same either way.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The kernel failed a step (netlink).
    #[error("{context}: {source}")]
    Kernel {
        context: String,
        #[source]
        source: NetlinkError,
    },
    /// CNI_NETNS names no network namespace.
    #[error("CNI_NETNS: {0}")]
    NoNetns(NetnsError),
    /// The request came without the descriptor of its pod namespace.
    #[error("{0}")]
    NoDescriptor(String),
    /// The pod's namespace exists but could not be entered or read.
    #[error("netns: {0}")]
    Netns(NetnsError),
    #[error(transparent)]
    Ipam(#[from] IpamError),
    /// The node's block of a family is full and no new one could be had.
    #[error("{0}")]
    NoBlock(String),
    /// An attachment or interface of that name exists already.
    #[error("{0}")]
    AlreadyExists(String),
    /// The pod's network policy could not be put in force (the controller unreachable…).
    #[error("network policy: {0}")]
    Policy(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// No attachment of that container and interface.
    #[error("{0}")]
    UnknownContainer(String),
    /// The attachment or the node's network is not as it must be, or a step could not be
    /// finished.
    #[error("{0}")]
    Broken(String),
    /// A file or sysctl could not be written.
    #[error("{0}")]
    Io(String),
    /// STATUS: the network cannot take an ADD now (`pods_affected`: and existing pods are
    /// hit too).
    #[error("{msg}")]
    NotAvailable { msg: String, pods_affected: bool },
}

impl From<NetError> for CniError {
    fn from(e: NetError) -> CniError {
        let code = match &e {
            NetError::Kernel { .. } | NetError::Netns(_) | NetError::Broken(_) => Code::Internal,
            NetError::NoNetns(_) => Code::InvalidEnv,
            NetError::NoDescriptor(_) | NetError::Policy(_) => Code::TryAgainLater,
            NetError::Ipam(IpamError::NoBlock(_) | IpamError::Exhausted { .. }) | NetError::NoBlock(_) => {
                Code::TryAgainLater
            }
            NetError::Ipam(IpamError::Io { .. }) | NetError::Io(_) => Code::Io,
            NetError::Ipam(IpamError::BadBlock(..)) => Code::Internal,
            NetError::AlreadyExists(_) => Code::AlreadyExists,
            NetError::UnknownContainer(_) => Code::UnknownContainer,
            NetError::NotAvailable { pods_affected: false, .. } => Code::NotAvailable,
            NetError::NotAvailable { pods_affected: true, .. } => Code::NotAvailablePodsAffected,
        };
        CniError::new(code, e.to_string())
    }
}

fn internal(context: &str, e: impl std::fmt::Display) -> NetError {
    NetError::Broken(format!("{context}: {e}"))
}

fn netlink_err(context: &str, e: NetlinkError) -> NetError {
    NetError::Kernel { context: context.to_string(), source: e }
}

/// What [`Datapath::create_veth`] made: the MAC addresses it gave both ends and the host
/// end's index (looked up by name once the pair exists).
struct Created {
    host_mac: [u8; 6],
    peer_mac: [u8; 6],
    host_index: u32,
}

#[derive(Debug, Clone, Copy)]
struct BridgeInfo {
    index: u32,
    mac: [u8; 6],
}

/// Serializes work on one attachment (ADD/DEL/CHECK of the same container+ifname).
#[derive(Default)]
struct KeyedLocks {
    map: Mutex<HashMap<Owner, Arc<Mutex<()>>>>,
}

impl KeyedLocks {
    fn run<T>(&self, key: &Owner, f: impl FnOnce() -> T) -> T {
        let lock = self.map.lock().unwrap().entry(key.clone()).or_default().clone();
        let out = {
            let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
            f()
        };
        let mut map = self.map.lock().unwrap();
        // Two references: the map's and ours. Nobody else waits: drop the entry.
        if Arc::strong_count(&lock) == 2 {
            map.remove(key);
        }
        out
    }

    /// [`KeyedLocks::run`], giving up (`None`) when the lock is not free within `wait`.
    fn run_within<T>(&self, key: &Owner, wait: std::time::Duration, f: impl FnOnce() -> T) -> Option<T> {
        let lock = self.map.lock().unwrap().entry(key.clone()).or_default().clone();
        let deadline = std::time::Instant::now() + wait;
        let out = loop {
            match lock.try_lock() {
                Ok(_guard) => break Some(f()),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    let _guard = p.into_inner();
                    break Some(f());
                }
                Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(std::sync::TryLockError::WouldBlock) => break None,
            }
        };
        let mut map = self.map.lock().unwrap();
        if Arc::strong_count(&lock) == 2 {
            map.remove(key);
        }
        out
    }
}

/// Asks the controller for one more block of a family; installed by the cluster client in
/// controller mode.
pub type BlockSource = Box<dyn Fn(Family) -> Result<(), String> + Send + Sync>;

/// The slice of the agent's configuration the datapath uses.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The node bridge every pod's host veth is a port of.
    pub bridge: String,
    /// MTU of pod interfaces when the network config names none, until
    /// [`Datapath::set_pod_mtu`] gives the one derived from the underlay.
    pub mtu: u32,
    /// DNS answered in results when the network config has none.
    pub dns: Dns,
    /// Masquerade traffic leaving the cluster ranges (nftables `table inet nodeplane`).
    pub masquerade: bool,
    /// Cluster ranges exempt from masquerade (empty: the node's own blocks).
    pub cluster_cidrs: Vec<IpNetwork>,
    /// Where the shim queues DELs while the agent is away (`<state>/pending-del`).
    pub pending_delete_dir: std::path::PathBuf,
}

/// What the datapath tells of pods coming and going (NetworkPolicy: the controller learns
/// the pod's addresses, the node's enforcement its veth).
pub enum PodEvent<'a> {
    /// Attached (before the ADD returns; an error undoes the ADD).
    Started { pod: &'a str, host_if: &'a str, ips: &'a [IpNetwork] },
    /// Detached (errors are logged: the pod is gone either way).
    Stopped { pod: &'a str, host_if: &'a str },
}

/// Called with every [`PodEvent`]; installed by the agent when policy is enforced.
pub type PodHook = Box<dyn Fn(PodEvent<'_>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + Send + Sync>;

/// Publishes the node's network to the runtime, once it has a block: the agent installs the
/// shim and writes the conflist here. Called until it succeeds once.
pub type Publish = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

pub struct Datapath {
    settings: Settings,
    ipam: Ipam,
    reaper: Reaper,
    publish: Publish,
    kernel: Arc<dyn NetKernel>,
    bridge: Mutex<Option<BridgeInfo>>,
    locks: KeyedLocks,
    /// Cluster ranges exempt from masquerade (configuration, or the controller's pools).
    cluster_cidrs: Mutex<Vec<IpNetwork>>,
    /// The conflist is written once the node has a block (it is then ready for ADD).
    conflist_written: std::sync::atomic::AtomicBool,
    block_source: std::sync::OnceLock<BlockSource>,
    pod_hook: std::sync::OnceLock<PodHook>,
    /// The MTU a new pod gets when the network config names none.
    pod_mtu: std::sync::atomic::AtomicU32,
    /// Where the time of ADD and CHECK goes, step by step (the agent exports it).
    pub steps: Histograms<StepLabels>,
}

/// What a startup reconcile did (logged by the agent, used by tests through the logs).
#[derive(Debug, Default)]
pub struct ReconcileReport {
    pub kept: usize,
    pub freed: Vec<String>,
    pub reaped_links: usize,
}

impl Datapath {
    pub fn new(settings: Settings, ipam: Ipam, reaper: Reaper, publish: Publish, kernel: Arc<dyn NetKernel>) -> Self {
        let cluster = settings.cluster_cidrs.clone();
        let pod_mtu = settings.mtu.into();
        Datapath {
            settings,
            ipam,
            reaper,
            publish,
            kernel,
            bridge: Mutex::new(None),
            locks: KeyedLocks::default(),
            cluster_cidrs: Mutex::new(cluster),
            conflist_written: Default::default(),
            block_source: Default::default(),
            pod_hook: Default::default(),
            pod_mtu,
            steps: Histograms::new_with_constructor(step_histogram),
        }
    }

    /// The MTU new pods get from now on (pods already running keep theirs).
    pub fn set_pod_mtu(&self, mtu: u32) {
        let old = self.pod_mtu.swap(mtu, std::sync::atomic::Ordering::SeqCst);
        if old != mtu {
            tracing::info!(mtu, old, "pod MTU set; pods started before keep theirs");
        }
    }

    /// The MTU a new pod gets when the network config names none.
    pub fn pod_mtu(&self) -> u32 {
        self.pod_mtu.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The node's blocks and leases.
    pub fn ipam(&self) -> &Ipam {
        &self.ipam
    }

    /// Install the controller client's block requester (controller mode).
    pub fn set_block_source(&self, source: BlockSource) {
        let _ = self.block_source.set(source);
    }

    /// Install the pod hook (NetworkPolicy enforcement).
    pub fn set_pod_hook(&self, hook: PodHook) {
        let _ = self.pod_hook.set(hook);
    }

    /// Is the node ready for ADD (has a block, conflist written)?
    pub fn ready(&self) -> bool {
        self.conflist_written.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Bring the node's network in line with its blocks: assign new blocks to IPAM, gateway
    /// addresses on the bridge, masquerade rules, and — once there is a block — the shim and
    /// the conflist (atomically). Called at start and whenever the controller adds blocks.
    pub fn apply_network(&self, blocks: &[IpNetwork], cluster: Option<&[IpNetwork]>) -> Result<(), NetError> {
        let setup = NetError::Broken;
        for b in blocks {
            self.ipam.assign_block(*b).map_err(|e| setup(e.to_string()))?;
        }
        if let Some(c) = cluster {
            *self.cluster_cidrs.lock().unwrap() = c.to_vec();
        }
        self.ensure_bridge()?;
        let all: Vec<IpNetwork> = self.ipam.blocks().iter().map(|b| b.net).collect();
        if all.is_empty() {
            return Ok(());
        }
        if self.settings.masquerade {
            let cluster = self.cluster_cidrs.lock().unwrap().clone();
            let cluster = if cluster.is_empty() { all.clone() } else { cluster };
            super::masquerade::apply(&all, &cluster).map_err(|e| setup(format!("masquerade rules: {e}")))?;
        }
        if !self.ready() {
            (self.publish)().map_err(setup)?;
            self.conflist_written.store(true, std::sync::atomic::Ordering::SeqCst);
            tracing::info!(blocks = %fmt_ips(&all), "network ready");
        }
        Ok(())
    }

    // ----- node setup -----

    /// Remove from the bridge (`index`, holding `have`) the gateway of every block the
    /// controller withdrew once no lease lies in it: its connected route would keep this
    /// node from the block's new owner. An IPv6 link-local address stays.
    fn drop_withdrawn_gateways(&self, nl: &mut dyn Links, index: u32, have: &[Addr]) -> Result<(), NetError> {
        let blocks = self.ipam.blocks();
        let leases = self.ipam.leases();
        for a in have.iter().filter(|a| a.index == index) {
            let Ok(net) = IpNetwork::new(a.ip, a.prefix) else { continue };
            let link_local = matches!(a.ip, IpAddr::V6(v6) if v6.is_unicast_link_local());
            let current = blocks.iter().any(|b| b.gateway_net() == net);
            let used = leases.iter().flat_map(|l| &l.ips).any(|ip| net.contains(ip.ip()));
            if link_local || current || used {
                continue;
            }
            nl.delete_address(index, a.ip, a.prefix).map_err(|e| netlink_err(&format!("removing gateway {net}"), e))?;
            tracing::info!(gateway = %net, "withdrawn block's gateway removed from the bridge: no pod uses it");
        }
        Ok(())
    }

    /// After a lease of a withdrawn block is released: its gateway may go now.
    fn after_withdrawn_lease(&self, lease: &Lease) -> Result<(), NetError> {
        if lease.ips.iter().all(|ip| self.ipam.block_of(ip.ip()).is_some()) {
            return Ok(());
        }
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        let Some(index) = nl.index_of(&self.settings.bridge).map_err(|e| netlink_err("bridge lookup", e))? else {
            return Ok(());
        };
        let have = nl.addresses(Some(index)).map_err(|e| netlink_err("bridge addresses", e))?;
        self.drop_withdrawn_gateways(&mut *nl, index, &have)
    }

    /// Create (or adopt) the node bridge with one gateway address per block, and turn on
    /// forwarding in the agent's own network namespace.
    pub fn ensure_bridge(&self) -> Result<(), NetError> {
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        let name = &self.settings.bridge;
        let link = match nl.link_by_name(name).map_err(|e| netlink_err("bridge lookup", e))? {
            Some(l) => l,
            None => {
                match nl.create_bridge(name) {
                    Ok(()) => {}
                    Err(e) if e.is(libc::EEXIST) => {}
                    Err(e) => return Err(netlink_err(&format!("creating bridge {name}"), e)),
                }
                nl.link_by_name(name)
                    .map_err(|e| netlink_err("bridge lookup", e))?
                    .ok_or_else(|| internal("bridge", format!("{name} vanished after creation")))?
            }
        };
        if link.kind.as_deref() != Some("bridge") {
            return Err(internal("bridge", format!("{name} exists but is a {:?}, not a bridge", link.kind)));
        }
        // Pin the bridge's MAC (to the one it has, so adopting a bridge changes nothing): left
        // to the kernel, a bridge takes the lowest MAC of its ports, so adding or deleting a
        // pod would change the gateway MAC every other pod has cached, and their traffic
        // would stall until their neighbour entries expire.
        if let Some(mac) = link.mac {
            nl.set_mac(link.index, mac).map_err(|e| netlink_err(&format!("pinning the MAC of {name}"), e))?;
        }
        // A bridge this agent made has snooping off from the start; one adopted from an
        // earlier version (or made by someone else) is turned over once.
        if link.mcast_snooping != Some(false) {
            nl.set_mcast_snooping(link.index, false)
                .map_err(|e| netlink_err(&format!("turning off multicast snooping on {name}"), e))?;
            tracing::info!(bridge = %name, "multicast snooping turned off (no querier on the pod bridge: it only cost work)");
        }
        if !link.up {
            // The bridge routes IPv6 for pods of other nodes: its link-local address must be
            // usable at once, not tentative for a second or two of duplicate detection (which
            // only starts at link up, so this goes first).
            let key = format!("net.ipv6.conf.{name}.accept_dad");
            if let Err(e) = self.kernel.write_sysctl(&key, "0") {
                tracing::warn!(error = %e, "could not turn off DAD on the bridge");
            }
            nl.set_link(link.index, Some(true), None, None, None).map_err(|e| netlink_err("bridge up", e))?;
        }
        let have = nl.addresses(Some(link.index)).map_err(|e| netlink_err("bridge addresses", e))?;
        for block in self.ipam.blocks() {
            let gw = block.gateway_net();
            if !have.iter().any(|a| a.ip == gw.ip() && a.prefix == gw.prefix()) {
                match nl.add_address(link.index, gw.ip(), gw.prefix()) {
                    Ok(()) => {}
                    Err(e) if e.is(libc::EEXIST) => {}
                    Err(e) => return Err(netlink_err(&format!("gateway {gw} on {name}"), e)),
                }
            }
        }
        self.drop_withdrawn_gateways(&mut *nl, link.index, &have)?;
        // Pods attached before the bridge was lost (or replaced) are put back on it. Each
        // under its attachment's lock, re-checked, so a concurrent DEL is never undone.
        // Leases still being added are left to their own ADD.
        let ports: HashMap<String, Link> =
            nl.links().map_err(|e| netlink_err("listing links", e))?.into_iter().map(|l| (l.name.clone(), l)).collect();
        for lease in self.ipam.leases().into_iter().filter(|l| l.state == LeaseState::Ready) {
            let Some(port) = ports.get(&lease.host_if) else { continue };
            // A retired link (its DEL stopped short of the lease: reconcile frees it) stays
            // down for the reaper.
            if (port.master == Some(link.index) && port.up) || !is_pod_veth(port) {
                continue;
            }
            self.locks.run(&lease.owner, || -> Result<(), NetError> {
                if self.ipam.get(&lease.owner).is_none() {
                    return Ok(());
                }
                let Some(port) = nl.link_by_name(&lease.host_if).map_err(|e| netlink_err("lookup", e))? else {
                    return Ok(());
                };
                if !is_pod_veth(&port) {
                    return Ok(());
                }
                nl.set_link(port.index, Some(true), Some(link.index), None, None)
                    .map_err(|e| netlink_err(&format!("re-attaching {} to {name}", port.name), e))?;
                tracing::warn!(host_if = %port.name, bridge = %name, "re-attached pod veth to the bridge");
                Ok(())
            })?;
        }
        for key in ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"] {
            self.kernel.write_sysctl(key, "1").map_err(|e| NetError::Io(e.to_string()))?;
        }
        let mac = link.mac.unwrap_or_default();
        *self.bridge.lock().unwrap() = Some(BridgeInfo { index: link.index, mac });
        Ok(())
    }

    fn bridge(&self) -> Result<BridgeInfo, NetError> {
        if let Some(b) = *self.bridge.lock().unwrap() {
            return Ok(b);
        }
        self.ensure_bridge()?;
        Ok(self.bridge.lock().unwrap().expect("set by ensure_bridge"))
    }

    /// Bring leases and kernel state back in line after a start (crash, upgrade, reboot).
    pub fn reconcile(&self, boot_changed: bool) -> Result<ReconcileReport, NetError> {
        let mut report = ReconcileReport::default();
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        let links = nl.links().map_err(|e| netlink_err("listing links", e))?;
        let by_name: HashMap<&str, &Link> = links.iter().map(|l| (l.name.as_str(), l)).collect();
        let mut keep_links = HashSet::new();
        for lease in self.ipam.leases() {
            let why = if boot_changed {
                Some("node rebooted")
            } else if lease.state != LeaseState::Ready {
                Some("ADD never completed")
            } else {
                // The pair dies with the pod's namespace: no host veth, no pod network. (The
                // namespace's path is the runtime's, in its own mount and PID namespaces:
                // never resolved here.)
                veth_gone(&lease, by_name.get(lease.host_if.as_str()).copied())
            };
            match why {
                None => {
                    keep_links.insert(lease.host_if.clone());
                    report.kept += 1;
                }
                Some(reason) => {
                    self.ipam.release(&lease.owner).map_err(NetError::Ipam)?;
                    report.freed.push(format!(
                        "{}/{} {}: {reason}",
                        lease.owner.container_id,
                        lease.owner.ifname,
                        fmt_ips(&lease.ips)
                    ));
                }
            }
        }
        for link in &links {
            if link.group == GRAVEYARD_GROUP {
                self.reaper.reap();
                report.reaped_links += 1;
            } else if is_graveyard_name(&link.name) || (is_pod_veth(link) && !keep_links.contains(&link.name)) {
                self.retire_link(&mut *nl, link)?;
                report.reaped_links += 1;
            }
        }
        Ok(report)
    }

    /// Retire a host veth: down and into the graveyard group in one synchronous request.
    /// Down is enough to cut the pod off: the bridge disables the port (and forgets the MAC
    /// addresses it learnt there), and the pod's end loses its carrier. Leaving the bridge
    /// would cost the request a second RCU grace period under the RTNL lock, which every DEL
    /// in a burst waits for; the reaper's deletion detaches it anyway. The link keeps its name
    /// until the reaper deletes it (in batches): an ADD that needs the name first renames it
    /// out of the way ([`Datapath::clear_name`]).
    fn retire_link(&self, nl: &mut dyn Links, link: &Link) -> Result<(), NetError> {
        match nl.set_link(link.index, Some(false), None, None, Some(GRAVEYARD_GROUP)) {
            Ok(()) => {}
            Err(e) if e.is(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(netlink_err(&format!("retiring {}", link.name), e)),
        }
        self.reaper.reap();
        Ok(())
    }

    /// The host veth name `host_if` is taken by `stale`, a link no lease holds (the caller
    /// checked under the attachment lock): a retired link is renamed to a graveyard name (it
    /// is down, so the kernel allows it; the reaper deletes it with the rest), anything else
    /// is deleted now.
    fn clear_name(&self, nl: &mut dyn Links, stale: &Link) -> Result<(), NetError> {
        if stale.group != GRAVEYARD_GROUP {
            return match nl.delete_link(stale.index) {
                Err(e) if !e.is(libc::ENODEV) => Err(netlink_err("removing stale veth", e)),
                _ => Ok(()),
            };
        }
        for _ in 0..8 {
            match nl.set_link(stale.index, None, None, Some(&self.reaper.next_name()), None) {
                Ok(()) => return Ok(()),
                Err(e) if e.is(libc::EEXIST) => continue,
                Err(e) if e.is(libc::ENODEV) => return Ok(()),
                Err(e) => return Err(netlink_err(&format!("renaming {}", stale.name), e)),
            }
        }
        Err(internal("veth", format!("no free graveyard name for {}", stale.name)))
    }

    // ----- CNI commands -----

    /// ADD in the pod namespace `netns`: opened by the shim in the runtime's namespaces and
    /// handed over as a descriptor (`req.netns`, the runtime's path, is only recorded).
    pub fn add(&self, req: &Request, netns: Box<dyn PodNetns>) -> Result<ResultModel, NetError> {
        let owner = Owner { container_id: req.container_id.clone(), ifname: req.ifname.clone() };
        self.locks.run(&owner, || self.add_locked(req, &owner, &*netns))
    }

    fn add_locked(&self, req: &Request, owner: &Owner, netns: &dyn PodNetns) -> Result<ResultModel, NetError> {
        let mut steps = Steps::start(&self.steps, "ADD");
        // A DEL the shim queued while no agent answered came before this ADD (the runtime
        // waited for the DEL's answer before sending it): apply it now, or the periodic drain
        // would detach the new attachment later (a queue written just after a restarting
        // agent's start-up drain would otherwise only be drained after this ADD).
        let pending = self.pending_path(owner);
        if pending_del::is_del_of(&pending, &owner.container_id, &owner.ifname) {
            tracing::info!(container = %owner.container_id, ifname = %owner.ifname, "applying the DEL queued for this attachment before its ADD");
            self.del_locked(owner)?;
        }
        if let Some(existing) = self.ipam.get(owner) {
            return Err(NetError::AlreadyExists(format!(
                "container {} already has interface {} attached ({}); DEL it first",
                owner.container_id,
                owner.ifname,
                fmt_ips(&existing.ips)
            )));
        }
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        steps.mark("prepare");
        let netns_path = req.netns.as_deref().expect("validated: ADD has CNI_NETNS");
        let host_if = host_ifname(owner);
        let lease_template = Lease {
            owner: owner.clone(),
            state: LeaseState::Adding,
            netns: netns_path.display().to_string(),
            netns_inode: netns.inode().unwrap_or(0),
            netns_cookie: 0,
            host_ifindex: 0,
            host_if: host_if.clone(),
            ips: Vec::new(),
            pod: format!("{}/{}", req.pod_namespace(), req.pod_name()),
        };
        let reservation = match self.ipam.reserve(lease_template.clone()) {
            Err(IpamError::Exhausted { family, .. }) if self.block_source.get().is_some() => {
                let source = self.block_source.get().expect("checked");
                source(family).map_err(|e| NetError::NoBlock(format!("{family} block full and no new block: {e}")))?;
                self.ipam.reserve(lease_template)
            }
            other => other,
        }
        .map_err(NetError::Ipam)?;
        steps.mark("reserve");
        let lease = reservation.lease.clone();
        let mtu = req.conf.mtu.unwrap_or_else(|| self.pod_mtu());
        let configured = self.create_veth(&mut *nl, netns, req, &host_if, mtu).and_then(|created| {
            steps.mark("veth");
            let pod_nl = netns.links().map_err(netns_err)?;
            steps.mark("netns-socket");
            self.configure(pod_nl, netns, req, &host_if, &lease, mtu, created)
        });
        match configured {
            Ok((result, cookie, host_ifindex)) => {
                steps.mark("configure");
                self.ipam.commit(reservation, cookie, host_ifindex).map_err(NetError::Ipam).inspect_err(|_| {
                    self.undo_add(&mut *nl, owner, &host_if);
                })?;
                steps.mark("commit");
                if let Some(hook) = self.pod_hook.get() {
                    let ev = PodEvent::Started { pod: &lease.pod, host_if: &host_if, ips: &lease.ips };
                    if let Err(e) = hook(ev) {
                        self.undo_add(&mut *nl, owner, &host_if);
                        let _ = hook(PodEvent::Stopped { pod: &lease.pod, host_if: &host_if });
                        return Err(NetError::Policy(e));
                    }
                    steps.mark("policy");
                }
                tracing::info!(
                    container = %owner.container_id, ifname = %owner.ifname, pod = %lease.pod,
                    ips = %fmt_ips(&lease.ips), host_if = %host_if, "attached"
                );
                Ok(match &req.conf.prev_result {
                    Some(prev) => prev.clone().chain(result),
                    None => result,
                })
            }
            Err(e) => {
                self.undo_add(&mut *nl, owner, &host_if);
                Err(e)
            }
        }
    }

    fn undo_add(&self, nl: &mut dyn Links, owner: &Owner, host_if: &str) {
        self.undo_link(nl, host_if);
        if let Err(e) = self.ipam.release(owner) {
            tracing::warn!(error = %e, "rolling back lease");
        }
    }

    fn undo_link(&self, nl: &mut dyn Links, host_if: &str) {
        if let Ok(Some(link)) = nl.link_by_name(host_if)
            && let Err(e) = self.retire_link(nl, &link)
        {
            tracing::warn!(error = %e, host_if, "rolling back veth");
        }
    }

    /// Create the veth pair, the host end on the bridge and the peer in `netns`; returns
    /// the two ends' MAC addresses and the host end's index.
    fn create_veth(
        &self,
        nl: &mut dyn Links,
        netns: &dyn PodNetns,
        req: &Request,
        host_if: &str,
        mtu: u32,
    ) -> Result<Created, NetError> {
        let bridge = self.bridge()?;
        let host_mac = random_mac();
        let peer_mac = random_mac();
        let mut spec = Veth {
            host_name: host_if,
            host_mac,
            peer_name: &req.ifname,
            peer_mac,
            peer: netns,
            mtu,
            master: Some(bridge.index),
        };
        let mut pod_nl = None;
        let mut attempt = 0;
        loop {
            attempt += 1;
            match nl.create_veth(&spec) {
                Ok(()) => {
                    let host_index = nl
                        .index_of(host_if)
                        .map_err(|e| netlink_err("lookup", e))?
                        .ok_or_else(|| internal("veth", format!("{host_if} missing after its creation")))?;
                    return Ok(Created { host_mac, peer_mac, host_index });
                }
                Err(e) if e.is(libc::EEXIST) && attempt <= 2 => {
                    // Either a stale host end (no lease holds it: we checked under the
                    // attachment lock) or the name is taken inside the pod.
                    if let Some(stale) = nl.link_by_name(host_if).map_err(|e| netlink_err("lookup", e))? {
                        self.clear_name(nl, &stale)?;
                        continue;
                    }
                    let pnl = pod_nl.get_or_insert(netns.links().map_err(netns_err)?);
                    if pnl.link_by_name(&req.ifname).map_err(|e| netlink_err("lookup", e))?.is_some() {
                        // Maybe the old end of a veth we just retired: let the reaper finish.
                        self.reaper.flush();
                        if pnl.link_by_name(&req.ifname).map_err(|e| netlink_err("lookup", e))?.is_some() {
                            return Err(NetError::AlreadyExists(format!(
                                "interface {} already exists in network namespace {}",
                                req.ifname,
                                netns.path().display()
                            )));
                        }
                    }
                }
                Err(e) if (e.is(libc::ENODEV) || e.is(libc::EINVAL)) && attempt <= 2 => {
                    // The bridge went away under us: recreate it once.
                    *self.bridge.lock().unwrap() = None;
                    spec.master = Some(self.bridge()?.index);
                }
                Err(e) => return Err(netlink_err(&format!("creating veth for {}", req.ifname), e)),
            }
        }
    }

    /// Configure the pod's end of a new veth pair through `pod_nl` (a socket in its
    /// namespace); returns this plugin's own result, the pod namespace's cookie and the
    /// host veth's ifindex.
    #[allow(clippy::too_many_arguments)]
    fn configure(
        &self,
        mut pod_nl: Box<dyn Links>,
        netns: &dyn PodNetns,
        req: &Request,
        host_if: &str,
        lease: &Lease,
        mtu: u32,
        Created { host_mac, peer_mac, host_index }: Created,
    ) -> Result<(ResultModel, u64, u32), NetError> {
        let peer = pod_nl
            .index_of(&req.ifname)
            .map_err(|e| netlink_err("lookup", e))?
            .ok_or_else(|| internal("veth", format!("{} missing in pod after creation", req.ifname)))?;
        // One batch: lo up (always ifindex 1 in a namespace), the interface up, then its
        // addresses and default routes. Addresses precede the routes that need them.
        let mut reqs = vec![LinkStep::Up { index: 1 }, LinkStep::Up { index: peer }];
        let mut ips = Vec::new();
        let mut routes = Vec::new();
        for ip in &lease.ips {
            reqs.push(LinkStep::Address { index: peer, ip: ip.ip(), prefix: ip.prefix() });
        }
        for ip in &lease.ips {
            let block = self.ipam.block_of(ip.ip()).ok_or_else(|| internal("ipam", format!("{ip} has no block")))?;
            let gw = block.gateway();
            reqs.push(LinkStep::DefaultRoute { gateway: gw, oif: peer });
            ips.push(IpConfig { address: *ip, gateway: Some(gw), interface: Some(2) });
            let any = if ip.is_ipv4() { "0.0.0.0/0" } else { "::/0" };
            routes.push(Route { dst: any.parse().expect("literal"), gw: Some(gw) });
        }
        pod_nl
            .apply(&reqs)
            .map_err(|e| netlink_err(&format!("configuring {} in {}", req.ifname, netns.path().display()), e))?;
        let conf_dns = req.conf.dns.clone().unwrap_or_default();
        let result = ResultModel {
            interfaces: vec![
                Interface {
                    name: self.settings.bridge.clone(),
                    mac: format_mac(&self.bridge()?.mac),
                    mtu: None,
                    sandbox: None,
                },
                Interface { name: host_if.to_string(), mac: format_mac(&host_mac), mtu: Some(mtu), sandbox: None },
                Interface {
                    name: req.ifname.clone(),
                    mac: format_mac(&peer_mac),
                    mtu: Some(mtu),
                    sandbox: Some(netns.path().display().to_string()),
                },
            ],
            ips,
            routes,
            dns: if conf_dns.is_empty() { self.settings.dns.clone() } else { conf_dns },
        };
        Ok((result, pod_nl.netns_cookie(), host_index))
    }

    pub fn del(&self, req: &Request) -> Result<(), NetError> {
        let owner = Owner { container_id: req.container_id.clone(), ifname: req.ifname.clone() };
        self.locks.run(&owner, || self.del_locked(&owner))
    }

    fn del_locked(&self, owner: &Owner) -> Result<(), NetError> {
        let mut steps = Steps::start(&self.steps, "DEL");
        let host_if = self.ipam.get(owner).map(|l| l.host_if).unwrap_or_else(|| host_ifname(owner));
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        // Retire first: once this returns, the host end is down (a disabled bridge port) and the
        // old address unreachable. One request, selecting the link by its name: no lookup of
        // its own on the kernel's RTNL lock.
        let retired =
            nl.retire_named(&host_if, GRAVEYARD_GROUP).map_err(|e| netlink_err(&format!("retiring {host_if}"), e))?;
        if retired {
            self.reaper.reap();
        }
        steps.mark("retire");
        let released = self.ipam.release(owner).map_err(NetError::Ipam)?;
        let pending = self.pending_path(owner);
        let _ = std::fs::remove_file(pending);
        steps.mark("release");
        if let Some(l) = released {
            if let Err(e) = self.after_withdrawn_lease(&l) {
                tracing::warn!(error = %e, "removing a withdrawn block's gateway");
            }
            if let Some(hook) = self.pod_hook.get() {
                if let Err(e) = hook(PodEvent::Stopped { pod: &l.pod, host_if: &l.host_if }) {
                    tracing::warn!(pod = %l.pod, error = %e, "policy: pod stopped");
                }
                steps.mark("policy");
            }
            tracing::info!(container = %owner.container_id, ifname = %owner.ifname, pod = %l.pod, ips = %fmt_ips(&l.ips), "detached");
        }
        Ok(())
    }

    /// CHECK in the pod namespace `netns` (a descriptor from the shim, as for ADD), which
    /// must be the namespace the attachment was made in.
    pub fn check(&self, req: &Request, netns: Box<dyn PodNetns>) -> Result<(), NetError> {
        let owner = Owner { container_id: req.container_id.clone(), ifname: req.ifname.clone() };
        self.locks.run(&owner, || self.check_locked(req, &owner, netns))
    }

    fn check_locked(&self, req: &Request, owner: &Owner, netns: Box<dyn PodNetns>) -> Result<(), NetError> {
        let mut steps = Steps::start(&self.steps, "CHECK");
        let fail = |m: String| Err(NetError::Broken(m));
        let Some(lease) = self.ipam.get(owner) else {
            return Err(NetError::UnknownContainer(format!(
                "no attachment for container {} interface {}",
                owner.container_id, owner.ifname
            )));
        };
        if lease.state != LeaseState::Ready {
            return fail(format!("attachment {}/{} is still being set up", owner.container_id, owner.ifname));
        }
        let prev = req.conf.prev_result.as_ref().expect("validated: CHECK has prevResult");
        let netns_path = req.netns.as_deref().expect("validated: CHECK has CNI_NETNS");
        let Some(idx) = prev.interfaces.iter().position(|i| i.name == req.ifname && i.sandbox.is_some()) else {
            return fail(format!("prevResult has no container interface {}", req.ifname));
        };
        let expected_ips: Vec<IpNetwork> =
            prev.ips.iter().filter(|ip| ip.interface == Some(idx)).map(|ip| ip.address).collect();
        for ip in &lease.ips {
            if !expected_ips.contains(ip) {
                return fail(format!("lease address {ip} is not in prevResult for {}", req.ifname));
            }
        }
        for ip in &expected_ips {
            if !lease.ips.contains(ip) {
                return fail(format!(
                    "prevResult address {ip} is not leased to {}/{}",
                    owner.container_id, owner.ifname
                ));
            }
        }
        steps.mark("lease");
        let mut pod_nl = netns.links().map_err(netns_err)?;
        steps.mark("netns-socket");
        let ns = netns_path.display();
        // The namespace handed over must be the attachment's own: same inode, same cookie
        // (an inode number can be reused by a later namespace; a cookie never is).
        let (inode, cookie) = (netns.inode().unwrap_or(0), pod_nl.netns_cookie());
        if (lease.netns_inode != 0 && inode != lease.netns_inode)
            || (lease.netns_cookie != 0 && cookie != lease.netns_cookie)
        {
            return fail(format!(
                "network namespace {ns} is not the one {}/{} was attached in (inode {inode}, cookie {cookie}; attached in inode {}, cookie {})",
                owner.container_id, owner.ifname, lease.netns_inode, lease.netns_cookie
            ));
        }
        let Some(peer) = pod_nl.link_by_name(&req.ifname).map_err(|e| netlink_err("lookup", e))? else {
            return fail(format!("interface {} not found in network namespace {ns}", req.ifname));
        };
        if peer.kind.as_deref() != Some("veth") {
            return fail(format!("interface {} in {ns} is a {:?}, not a veth", req.ifname, peer.kind));
        }
        if !peer.up {
            return fail(format!("interface {} in {ns} is down", req.ifname));
        }
        let want_mac = &prev.interfaces[idx].mac;
        if !want_mac.is_empty() && peer.mac.map(|m| format_mac(&m)).as_deref() != Some(want_mac.as_str()) {
            return fail(format!(
                "interface {} in {ns} has MAC {:?}, prevResult says {want_mac}",
                req.ifname,
                peer.mac.map(|m| format_mac(&m))
            ));
        }
        let addrs = pod_nl.addresses(Some(peer.index)).map_err(|e| netlink_err("addresses", e))?;
        for ip in &lease.ips {
            if !addrs.iter().any(|a| a.ip == ip.ip() && a.prefix == ip.prefix()) {
                return fail(format!("address {ip} is missing from {} in {ns}", req.ifname));
            }
        }
        let routes = pod_nl.routes().map_err(|e| netlink_err("routes", e))?;
        for ip in &lease.ips {
            let gw = self.ipam.block_of(ip.ip()).map(|b| b.gateway());
            let ok = routes
                .iter()
                .any(|r| r.v6 == ip.is_ipv6() && r.prefix == 0 && r.gateway == gw && r.oif == Some(peer.index));
            if !ok {
                return fail(format!(
                    "default route via {} on {} is missing in {ns}",
                    gw.map(|g| g.to_string()).unwrap_or_default(),
                    req.ifname
                ));
            }
        }
        steps.mark("pod-state");
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        let Some(host) = nl.link_by_name(&lease.host_if).map_err(|e| netlink_err("lookup", e))? else {
            return fail(format!("host veth {} is missing", lease.host_if));
        };
        let Some(bridge) = nl.index_of(&self.settings.bridge).map_err(|e| netlink_err("lookup", e))? else {
            return fail(format!("bridge {} is missing", self.settings.bridge));
        };
        if host.master != Some(bridge) {
            return fail(format!("host veth {} is not attached to bridge {}", lease.host_if, self.settings.bridge));
        }
        if !host.up {
            return fail(format!("host veth {} is down", lease.host_if));
        }
        if peer.peer != Some(host.index) {
            return fail(format!("interface {} in {ns} is not the peer of host veth {}", req.ifname, lease.host_if));
        }
        steps.mark("host-state");
        Ok(())
    }

    pub fn gc(&self, req: &Request) -> Result<(), NetError> {
        let valid: HashSet<Owner> = req
            .conf
            .valid_attachments
            .iter()
            .flatten()
            .map(|a| Owner { container_id: a.container_id.clone(), ifname: a.ifname.clone() })
            .collect();
        let mut errors = Vec::new();
        let mut freed = 0;
        for lease in self.ipam.leases() {
            // An attachment still being added is in no runtime's list yet; it either
            // completes or is rolled back by its own ADD.
            if valid.contains(&lease.owner) || lease.state == LeaseState::Adding {
                continue;
            }
            match self.locks.run(&lease.owner, || self.del_locked(&lease.owner)) {
                Ok(()) => freed += 1,
                Err(e) => errors.push(e.to_string()),
            }
        }
        // Host-side leftovers that no lease explains.
        let held: HashSet<String> = self.ipam.leases().into_iter().map(|l| l.host_if).collect();
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        let links = nl.links().map_err(|e| netlink_err("listing links", e))?;
        for link in links.iter().filter(|l| is_pod_veth(l) && !held.contains(&l.name)) {
            if let Err(e) = self.retire_link(&mut *nl, link) {
                errors.push(e.to_string());
            }
        }
        tracing::info!(freed, valid = valid.len(), "gc");
        if errors.is_empty() {
            Ok(())
        } else {
            Err(NetError::Broken(format!("GC left work undone: {}", errors.join("; "))))
        }
    }

    pub fn status(&self) -> Result<(), NetError> {
        let held: HashSet<String> = self.ipam.leases().into_iter().map(|l| l.host_if).collect();
        let leases = held.len();
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        let bridge = nl.link_by_name(&self.settings.bridge).map_err(|e| netlink_err("lookup", e))?;
        let bridge_ok = bridge.as_ref().is_some_and(|b| b.up);
        if !bridge_ok {
            return Err(NetError::NotAvailable {
                msg: format!("bridge {} is missing or down ({leases} pods attached)", self.settings.bridge),
                pods_affected: leases > 0,
            });
        }
        let bridge_index = bridge.map(|b| b.index);
        let detached = nl
            .links()
            .map_err(|e| netlink_err("listing links", e))?
            .into_iter()
            .filter(|l| held.contains(&l.name) && (l.master != bridge_index || !l.up))
            .count();
        if detached > 0 {
            return Err(NetError::NotAvailable {
                msg: format!("{detached} pod veth(s) are not attached to bridge {}", self.settings.bridge),
                pods_affected: true,
            });
        }
        let free = self.ipam.free_by_family();
        if free.is_empty() {
            return Err(NetError::NotAvailable {
                msg: "no pod address block is assigned to this node".into(),
                pods_affected: false,
            });
        }
        if let Some((family, _)) = free.iter().find(|(_, n)| *n == 0) {
            return Err(NetError::NotAvailable {
                msg: format!("the {family} pod address block is full"),
                pods_affected: false,
            });
        }
        Ok(())
    }
}

fn fmt_ips(ips: &[IpNetwork]) -> String {
    ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>().join(", ")
}

fn netns_err(e: NetnsError) -> NetError {
    match e {
        NetnsError::NotFound(_) | NetnsError::NotNetns(_) => NetError::NoNetns(e),
        other => NetError::Netns(other),
    }
}

/// Orphan kinds (the `kind` of a [`Finding`]).
pub const VETH_WITHOUT_LEASE: &str = "veth-without-lease";
pub const LEASE_WITHOUT_POD: &str = "lease-without-pod";

impl Datapath {
    /// The attachments as the leases and the kernel show them, for `nodeplane status`.
    pub fn report(&self) -> api::NetworkStatus {
        let links = self.kernel.host().and_then(|mut nl| nl.links()).unwrap_or_default();
        let by_name: HashMap<&str, &Link> = links.iter().map(|l| (l.name.as_str(), l)).collect();
        let bridge = by_name.get(self.settings.bridge.as_str()).copied();
        let usage = self.ipam.block_usage();
        let leases = self.ipam.leases();
        let attachments = leases
            .iter()
            .map(|l| {
                let veth = by_name.get(l.host_if.as_str()).copied();
                api::Attachment {
                    container_id: l.owner.container_id.clone(),
                    ifname: l.owner.ifname.clone(),
                    pod: pod_label_of(&l.pod),
                    state: match l.state {
                        LeaseState::Adding => api::LeaseState::Adding,
                        LeaseState::Ready => api::LeaseState::Ready,
                    } as i32,
                    ips: l.ips.iter().map(|ip| ip.to_string()).collect(),
                    netns: l.netns.clone(),
                    // The pair lives and dies with the pod's namespace.
                    netns_present: l.state != LeaseState::Ready || veth_gone(l, veth).is_none(),
                    host_if: l.host_if.clone(),
                    host_if_present: veth.is_some(),
                    host_if_on_bridge: veth
                        .is_some_and(|v| v.up && bridge.is_some() && v.master == bridge.map(|b| b.index)),
                }
            })
            .collect();
        let held: HashSet<&str> = leases.iter().map(|l| l.host_if.as_str()).collect();
        api::NetworkStatus {
            ready: self.ready(),
            bridge: Some(api::Bridge {
                name: self.settings.bridge.clone(),
                present: bridge.is_some(),
                up: bridge.is_some_and(|b| b.up),
                mac: bridge.and_then(|b| b.mac).map(|m| format_mac(&m)),
            }),
            blocks: usage
                .iter()
                .map(|(b, used)| api::Block {
                    cidr: b.net.to_string(),
                    gateway: b.gateway().to_string(),
                    addresses: b.capacity().to_string(),
                    allocated: u64::try_from(*used).unwrap_or(u64::MAX),
                })
                .collect(),
            attachments,
            unleased_host_veths: links
                .iter()
                .filter(|l| is_pod_veth(l) && !held.contains(l.name.as_str()))
                .map(|l| l.name.clone())
                .collect(),
            graveyard_links: links.iter().filter(|l| is_graveyard(l)).count() as u64,
        }
    }

    /// Network orphans: host veths no lease holds, leases whose pod namespace is gone (or
    /// whose ADD never finished), leases whose host veth is gone. Each lease is judged under
    /// its attachment's lock, so an ADD or DEL in progress is waited for, never reported.
    /// With `repair`, the first two kinds are removed (a lease by the DEL path: veth retired,
    /// addresses freed); a lease whose pod is alive but whose veth is gone is only reported:
    /// the runtime's CHECK fails for it and the pod is recreated, which frees it properly.
    pub fn doctor(&self, repair: bool) -> Result<(Vec<Finding>, Vec<String>), NetError> {
        let mut out = Vec::new();
        let mut skipped = Vec::new();
        for lease in self.ipam.leases() {
            let owner = lease.owner.clone();
            let subject = format!("{}/{}", owner.container_id, owner.ifname);
            let judged = self.locks.run_within(&owner, DOCTOR_LOCK_WAIT, || {
                // Re-read under the lock: the attachment may have gone or changed meanwhile.
                let lease = self.ipam.get(&owner)?;
                let detail = |why: &str| {
                    format!("{why}; pod {:?}, addresses {}, netns {}", lease.pod, fmt_ips(&lease.ips), lease.netns)
                };
                let mut f = if lease.state != LeaseState::Ready {
                    Finding::new(LEASE_WITHOUT_POD, subject.clone(), detail("its ADD never completed"))
                } else {
                    // Judged by the host veth: the pair lives and dies with the pod's
                    // namespace, whose path (the runtime's) is never resolved here.
                    match self.kernel.host().and_then(|mut nl| nl.link_by_name(&lease.host_if)) {
                        Ok(link) => match veth_gone(&lease, link.as_ref()) {
                            None => return None,
                            Some(why) => Finding::new(LEASE_WITHOUT_POD, subject.clone(), detail(why)),
                        },
                        // Could not tell: never a reason to take a pod's network away.
                        Err(e) => return Some(Err(format!("{subject}: could not look up {}: {e}", lease.host_if))),
                    }
                };
                if repair {
                    f.repair = Some(match self.del_locked(&owner) {
                        Ok(()) => {
                            Repair::Done(format!("released {} and retired {}", fmt_ips(&lease.ips), lease.host_if))
                        }
                        Err(e) => Repair::Failed(e.to_string()),
                    });
                }
                Some(Ok(f))
            });
            match judged {
                None => skipped.push(format!("{subject}: a CNI call held it for {DOCTOR_LOCK_WAIT:?}; not checked")),
                Some(None) => {}
                Some(Some(Ok(f))) => out.push(f),
                Some(Some(Err(e))) => skipped.push(e),
            }
        }
        // Host veths that no lease explains, judged after the leases (a repaired lease's veth
        // is in the graveyard by now, not here).
        let mut nl = self.kernel.host().map_err(|e| netlink_err("netlink", e))?;
        let links = nl.links().map_err(|e| netlink_err("listing links", e))?;
        let held: HashSet<String> = self.ipam.leases().into_iter().map(|l| l.host_if).collect();
        for link in links.iter().filter(|l| is_pod_veth(l)) {
            // Leases are reserved before their veth is made: a veth an ADD made after the
            // snapshot above has a lease by now, so look again before judging it.
            let held = held.contains(&link.name) || self.ipam.leases().iter().any(|l| l.host_if == link.name);
            // A failed ADD removes its veth and then its lease: still there now means orphaned.
            let still_there =
                matches!(nl.link_by_name(&link.name), Ok(Some(l)) if l.index == link.index && is_pod_veth(&l));
            if held || !still_there {
                continue;
            }
            let mut f = Finding::new(
                VETH_WITHOUT_LEASE,
                link.name.clone(),
                format!("host-side veth (ifindex {}) that no lease holds", link.index),
            );
            if repair {
                f.repair = Some(match self.retire_link(&mut *nl, link) {
                    Ok(()) => Repair::Done("detached and deleted".into()),
                    Err(e) => Repair::Failed(e.to_string()),
                });
            }
            out.push(f);
        }
        Ok((out, skipped))
    }

    /// Where the shim queues a DEL of `owner`.
    fn pending_path(&self, owner: &Owner) -> std::path::PathBuf {
        self.settings.pending_delete_dir.join(pending_del::file_name(&owner.container_id, &owner.ifname))
    }

    /// Run the DELs the shim queued while the agent was unreachable.
    pub fn drain_pending(&self) {
        for entry in pending_del::entries(&self.settings.pending_delete_dir) {
            match entry {
                // Decided under the attachment's lock: an ADD of the same attachment may have
                // applied (and removed) this DEL since the file was read.
                pending_del::Entry::Del { path, req } => match self.del_queued(&path, &req) {
                    Ok(true) => {
                        tracing::info!(container = %req.container_id, ifname = %req.ifname, "drained pending delete")
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(file = %path.display(), error = %e, "pending delete failed; will retry"),
                },
                pending_del::Entry::Invalid { path, name } => {
                    tracing::error!(file = %name, "discarding invalid pending-delete record");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }

    /// Run a DEL the shim queued (`path`), unless an ADD of the same attachment already
    /// applied it: decided under the attachment's lock. `Ok(false)`: nothing was left to do.
    pub fn del_queued(&self, path: &Path, req: &Request) -> Result<bool, NetError> {
        let owner = Owner { container_id: req.container_id.clone(), ifname: req.ifname.clone() };
        self.locks.run(&owner, || {
            if !pending_del::is_del_of(path, &owner.container_id, &owner.ifname) {
                return Ok(false);
            }
            self.del_locked(&owner)?;
            let _ = std::fs::remove_file(path);
            Ok(true)
        })
    }
}

/// How long the doctor waits for a CNI call on an attachment before skipping it.
const DOCTOR_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Why the lease's host veth says its pod network is gone (`None`: it is there). The pair
/// lives and dies with the pod's namespace; a link of the same name with another ifindex is
/// someone else's.
fn veth_gone(lease: &Lease, link: Option<&Link>) -> Option<&'static str> {
    match link {
        None => Some("pod network namespace is gone (its host veth went with it)"),
        Some(l) if lease.host_ifindex != 0 && l.index != lease.host_ifindex => {
            Some("pod network namespace is gone (its host veth's name is another link's now)")
        }
        Some(l) if l.group == GRAVEYARD_GROUP => Some("its DEL had begun (the host veth was retired)"),
        Some(_) => None,
    }
}

/// How an attachment names its pod: `namespace/name` (kubelet), the name alone when the
/// runtime sends no namespace (podman), empty when it sends neither.
pub fn pod_label(namespace: &str, name: &str) -> String {
    match (namespace.is_empty(), name.is_empty()) {
        (true, true) => String::new(),
        (true, false) => name.to_string(),
        _ => format!("{namespace}/{name}"),
    }
}

/// [`pod_label`] of the `namespace/name` a lease stores (`/`, or `/name`, when the runtime
/// sent no namespace or no pod arguments at all).
fn pod_label_of(stored: &str) -> String {
    match stored.split_once('/') {
        Some((ns, name)) => pod_label(ns, name),
        None => stored.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::{pod_label, pod_label_of};

    #[test]
    fn pod_labels() {
        assert_eq!(pod_label("shop", "cart-7"), "shop/cart-7");
        assert_eq!(pod_label("", "pa"), "pa");
        assert_eq!(pod_label("", ""), "");
        // As leases store them.
        assert_eq!(pod_label_of("/"), "");
        assert_eq!(pod_label_of("/pa"), "pa");
        assert_eq!(pod_label_of("shop/cart-7"), "shop/cart-7");
        assert_eq!(pod_label_of(""), "");
    }
}

#[cfg(test)]
mod fake_kernel_tests;
