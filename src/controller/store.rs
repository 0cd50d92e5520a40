//! The node registry: which node holds which blocks, durable in a backend (the embedded redb
//! database, or the Kubernetes API in-cluster: `super::backend`).
//!
//! Every change is committed by the backend before anyone is told about it. Changes are
//! serialized by one mutex, and the in-memory index (block -> node) is rebuilt from the
//! records at start and checked: no block can be held by two nodes.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use ipnetwork::IpNetwork;
use tokio::sync::watch;

use super::backend::{Backend, BackendError};
use super::records::{NodeRecord, Pool, random_epoch, subdomain_error};
use crate::util::Family;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("node {0:?} is not registered")]
    NotFound(String),
    #[error("{0}")]
    InvalidArgument(String),
    /// The node may not register now (in a cluster: it has no Node object, or it is being
    /// deleted).
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("the {family} pools ({pools}) have no free block left")]
    Exhausted { family: Family, pools: String },
    #[error("store: {0}")]
    Storage(#[from] BackendError),
}

/// The owner recorded for a block the backend keeps out of use (not a valid node name).
const RESERVED: &str = "(reserved)";

/// A consistent view of the registry.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub nodes: Vec<NodeRecord>,
    pub revision: u64,
}

/// One committed change of the registry: the records written and the names removed.
#[derive(Debug, Clone, Default)]
pub struct Change {
    /// The revision the change made; it applies to the registry at `revision - 1`.
    pub revision: u64,
    pub upserts: Vec<NodeRecord>,
    pub removed: Vec<String>,
}

/// Where a membership stream starts (see [`Registry::follow`]).
pub enum Start {
    /// The complete registry.
    Snapshot(Arc<Snapshot>),
    /// The changes after the client's revision, in order (possibly none).
    Changes(Vec<Arc<Change>>),
}

/// How many changes the registry keeps for clients that reconnect, and how many a stream
/// may fall behind before it is sent a snapshot instead.
pub const HISTORY: usize = 4096;
const STREAM_BUFFER: usize = 1024;

struct State {
    nodes: BTreeMap<String, NodeRecord>,
    owner: HashMap<IpNetwork, String>,
    revision: u64,
    /// The last [`HISTORY`] changes, oldest first.
    history: std::collections::VecDeque<Arc<Change>>,
    /// The snapshot of this revision, once asked for (shared by every stream that starts
    /// with it: one copy, not one per agent).
    snapshot: Option<Arc<Snapshot>>,
}

impl State {
    fn snapshot(&mut self) -> Arc<Snapshot> {
        if let Some(s) = &self.snapshot {
            return s.clone();
        }
        let s = Arc::new(Snapshot { nodes: self.nodes.values().cloned().collect(), revision: self.revision });
        self.snapshot = Some(s.clone());
        s
    }
}

/// Says why a node may not register now (None: it may). Asked under the registry's lock, so
/// it must not block: it answers from what is already known.
pub type Admission = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Told the name of a node just removed, under the registry's lock: it must not wait on the
/// registry.
pub type Removal = Arc<dyn Fn(&str) + Send + Sync>;

pub struct Registry {
    backend: Arc<dyn Backend>,
    pools: Vec<Pool>,
    state: Mutex<State>,
    /// The revision, for those who re-read the registry after a change.
    tx: watch::Sender<u64>,
    /// Every change, for membership streams (a receiver that falls [`STREAM_BUFFER`] behind
    /// is told it lagged).
    changes: tokio::sync::broadcast::Sender<Arc<Change>>,
    /// This registry instance: revisions are comparable only within one epoch.
    epoch: u64,
    admission: Mutex<Option<Admission>>,
    removal: Mutex<Option<Removal>>,
}

fn valid_mac(mac: &str) -> bool {
    mac.is_empty() || (mac.len() == 17 && mac.split(':').all(|p| p.len() == 2 && u8::from_str_radix(p, 16).is_ok()))
}

impl Registry {
    pub fn with_backend(backend: Arc<dyn Backend>, pools: Vec<Pool>) -> Result<Self, RegistryError> {
        let (records, revision) = backend.load_nodes()?;
        let mut nodes = BTreeMap::new();
        let mut owner = HashMap::new();
        for rec in records {
            for b in &rec.blocks {
                let net: IpNetwork =
                    b.parse().map_err(|_| BackendError::Corrupt(format!("node {}: bad block {b}", rec.name)))?;
                if let Some(prev) = owner.insert(net, rec.name.clone()) {
                    return Err(BackendError::Corrupt(format!(
                        "block {net} is recorded for both {prev} and {}",
                        rec.name
                    ))
                    .into());
                }
            }
            nodes.insert(rec.name.clone(), rec);
        }
        for b in backend.reserved_blocks() {
            if let Ok(net) = b.parse::<IpNetwork>() {
                owner.entry(net).or_insert_with(|| RESERVED.to_string());
            }
        }
        let (tx, _) = watch::channel(revision);
        let (changes, _) = tokio::sync::broadcast::channel(STREAM_BUFFER);
        let state = State { nodes, owner, revision, history: Default::default(), snapshot: None };
        Ok(Registry {
            backend,
            pools,
            state: Mutex::new(state),
            tx,
            changes,
            epoch: random_epoch(),
            admission: Mutex::new(None),
            removal: Mutex::new(None),
        })
    }

    /// Every registration from now on asks `admission` first, under the registry's lock: a
    /// removal made after the admission learnt a node is gone cannot be undone by a
    /// registration that was already on its way.
    pub fn set_admission(&self, admission: Admission) {
        *self.admission.lock().unwrap() = Some(admission);
    }

    /// `removal` runs with the name of each node removed from now on, under the registry's
    /// lock: no registration comes between the removal and it.
    pub fn on_removal(&self, removal: Removal) {
        *self.removal.lock().unwrap() = Some(removal);
    }

    /// The registry now (a copy: O(nodes)).
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.state.lock().unwrap().snapshot()
    }

    /// The revision, changed after every commit.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }

    /// Start following the registry from a client's revision `since` (0: none): the changes
    /// after it when they are all still held, else a snapshot; and the receiver of every
    /// later change. Both are taken under the registry's lock, so nothing falls between them.
    pub fn follow(&self, epoch: u64, since: u64) -> (Start, tokio::sync::broadcast::Receiver<Arc<Change>>) {
        let mut st = self.state.lock().unwrap();
        let rx = self.changes.subscribe();
        let held = epoch == self.epoch
            && since > 0
            && (since == st.revision
                || (since < st.revision && st.history.front().is_some_and(|c| c.revision <= since + 1)));
        let start = if held {
            Start::Changes(st.history.iter().filter(|c| c.revision > since).cloned().collect())
        } else {
            Start::Snapshot(st.snapshot())
        };
        (start, rx)
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn node_count(&self) -> usize {
        self.state.lock().unwrap().nodes.len()
    }

    pub fn get(&self, name: &str) -> Option<NodeRecord> {
        self.state.lock().unwrap().nodes.get(name).cloned()
    }

    /// Every pool with how many of its blocks are assigned to nodes (metrics).
    pub fn pool_usage(&self) -> Vec<(Pool, u128)> {
        let st = self.state.lock().unwrap();
        let held: Vec<IpNetwork> =
            st.nodes.values().flat_map(|n| n.blocks.iter().filter_map(|b| b.parse::<IpNetwork>().ok())).collect();
        self.pools
            .iter()
            .map(|p| {
                let used = held.iter().filter(|b| p.net.contains(b.network()) && b.prefix() >= p.net.prefix()).count();
                (*p, used as u128)
            })
            .collect()
    }

    /// Commit `records` (Some = upsert, None = delete) and publish the new snapshot.
    fn commit(&self, st: &mut State, changes: Vec<(String, Option<NodeRecord>)>) -> Result<(), RegistryError> {
        let revision = st.revision + 1;
        self.backend.commit_nodes(&changes, revision)?;
        // Durable: now update memory and tell watchers.
        let mut change = Change { revision, ..Default::default() };
        for (name, rec) in changes {
            match &rec {
                Some(r) => change.upserts.push(r.clone()),
                None => change.removed.push(name.clone()),
            }
            if let Some(old) = st.nodes.remove(&name) {
                for b in old.blocks.iter().filter_map(|b| b.parse::<IpNetwork>().ok()) {
                    st.owner.remove(&b);
                }
            }
            if let Some(r) = rec {
                for b in r.blocks.iter().filter_map(|b| b.parse::<IpNetwork>().ok()) {
                    st.owner.insert(b, name.clone());
                }
                st.nodes.insert(name, r);
            }
        }
        st.revision = revision;
        st.snapshot = None;
        let change = Arc::new(change);
        if st.history.len() == HISTORY {
            st.history.pop_front();
        }
        st.history.push_back(change.clone());
        // Sent under the lock: a stream started by `follow` sees every change after its start.
        let _ = self.changes.send(change);
        self.tx.send_replace(revision);
        Ok(())
    }

    /// First free block of a family, pools in configuration order.
    fn free_block(&self, st: &State, family: Family) -> Result<IpNetwork, RegistryError> {
        let pools: Vec<&Pool> = self.pools.iter().filter(|p| Family::of(&p.net) == family).collect();
        for pool in &pools {
            let used = st.owner.keys().filter(|b| pool.net.contains(b.network())).count() as u128;
            if used >= pool.block_count() {
                continue;
            }
            // At most used + 1 probes find a free one.
            for n in 0..=used {
                let block = pool.block(n);
                if !st.owner.contains_key(&block) {
                    return Ok(block);
                }
            }
        }
        Err(RegistryError::Exhausted {
            family,
            pools: pools.iter().map(|p| p.net.to_string()).collect::<Vec<_>>().join(", "),
        })
    }

    /// The families the pools serve, IPv4 first.
    fn families(&self) -> Vec<Family> {
        let mut f: Vec<Family> = self.pools.iter().map(|p| Family::of(&p.net)).collect();
        f.sort();
        f.dedup();
        f
    }

    /// [`Registry::register_node`] without a WireGuard key.
    pub fn register(&self, name: &str, underlay: &[String], vtep_mac: &str) -> Result<NodeRecord, RegistryError> {
        self.register_node(name, underlay, vtep_mac, "")
    }

    /// Register or re-register: the same node keeps its blocks; a family it has no block of
    /// gets one. Underlay addresses, VTEP MAC and WireGuard key are updated; a key another
    /// node holds is refused (a node publishes only its own).
    pub fn register_node(
        &self,
        name: &str,
        underlay: &[String],
        vtep_mac: &str,
        wireguard_key: &str,
    ) -> Result<NodeRecord, RegistryError> {
        if let Some(why) = subdomain_error(name) {
            return Err(RegistryError::InvalidArgument(format!("node name {name:?} {why}")));
        }
        if underlay.is_empty() {
            return Err(RegistryError::InvalidArgument("underlay_addresses must not be empty".into()));
        }
        for a in underlay {
            a.parse::<IpAddr>()
                .map_err(|_| RegistryError::InvalidArgument(format!("underlay address {a:?} is not an IP")))?;
        }
        if !valid_mac(vtep_mac) {
            return Err(RegistryError::InvalidArgument(format!("vtep_mac {vtep_mac:?} is not a MAC address")));
        }
        if !wireguard_key.is_empty() && crate::net::wireguard::parse_key(wireguard_key).is_none() {
            return Err(RegistryError::InvalidArgument(format!(
                "wireguard_key {wireguard_key:?} is not a base64 key of 32 bytes"
            )));
        }
        let mut st = self.state.lock().unwrap();
        if let Some(other) =
            st.nodes.values().find(|n| !wireguard_key.is_empty() && n.wireguard_key == wireguard_key && n.name != name)
        {
            return Err(RegistryError::InvalidArgument(format!(
                "wireguard_key is node {}'s; a node publishes only its own key",
                other.name
            )));
        }
        let admission = self.admission.lock().unwrap().clone();
        if let Some(why) = admission.and_then(|a| a(name)) {
            return Err(RegistryError::FailedPrecondition(why));
        }
        let mut rec = st.nodes.get(name).cloned().unwrap_or_else(|| NodeRecord {
            name: name.to_string(),
            underlay: Vec::new(),
            vtep_mac: String::new(),
            blocks: Vec::new(),
            wireguard_key: String::new(),
        });
        let before = rec.clone();
        rec.underlay = underlay.to_vec();
        rec.vtep_mac = vtep_mac.to_string();
        rec.wireguard_key = wireguard_key.to_string();
        let mut taken = Vec::new();
        for family in self.families() {
            let has = rec.blocks.iter().any(|b| b.parse::<IpNetwork>().is_ok_and(|n| Family::of(&n) == family));
            if !has {
                let block = match self.free_block(&st, family) {
                    Ok(b) => b,
                    Err(e) => {
                        for b in taken {
                            st.owner.remove(&b);
                        }
                        return Err(e);
                    }
                };
                // Hold it in the index while we look for the next family's block.
                st.owner.insert(block, name.to_string());
                taken.push(block);
                rec.blocks.push(block.to_string());
            }
        }
        if rec == before {
            return Ok(rec);
        }
        let result = self.commit(&mut st, vec![(name.to_string(), Some(rec.clone()))]);
        if result.is_err() {
            for b in taken {
                st.owner.remove(&b);
            }
        }
        result.map(|_| rec)
    }

    /// One more block of a family for a registered node whose blocks are full.
    pub fn request_block(&self, name: &str, family: Family) -> Result<NodeRecord, RegistryError> {
        let mut st = self.state.lock().unwrap();
        let mut rec = st.nodes.get(name).cloned().ok_or_else(|| RegistryError::NotFound(name.to_string()))?;
        let block = self.free_block(&st, family)?;
        rec.blocks.push(block.to_string());
        self.commit(&mut st, vec![(name.to_string(), Some(rec.clone()))])?;
        Ok(rec)
    }

    /// Remove a node; its blocks return to the pools.
    pub fn remove(&self, name: &str) -> Result<Vec<String>, RegistryError> {
        let mut st = self.state.lock().unwrap();
        let rec = st.nodes.get(name).cloned().ok_or_else(|| RegistryError::NotFound(name.to_string()))?;
        self.commit(&mut st, vec![(name.to_string(), None)])?;
        if let Some(removal) = self.removal.lock().unwrap().clone() {
            removal(name);
        }
        Ok(rec.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::backend::RedbBackend;

    fn pools() -> Vec<Pool> {
        vec![
            Pool { net: "10.8.0.0/22".parse().unwrap(), block_prefix: 24 },
            Pool { net: "fd00:8::/62".parse().unwrap(), block_prefix: 64 },
        ]
    }

    #[test]
    fn register_is_idempotent_and_durable() {
        let dir = crate::util::TestDir::new("reg-idem");
        let path = dir.0.join("registry.redb");
        let r = Registry::with_backend(RedbBackend::open(&path).unwrap(), pools()).unwrap();
        let a = r.register("node-a", &["192.0.2.1".into()], "").unwrap();
        assert_eq!(a.blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
        let again = r.register("node-a", &["192.0.2.1".into()], "").unwrap();
        assert_eq!(again.blocks, a.blocks);
        let b = r.register("node-b", &["192.0.2.2".into()], "02:00:00:00:00:01").unwrap();
        assert_eq!(b.blocks, vec!["10.8.1.0/24", "fd00:8:0:1::/64"]);
        let rev = r.snapshot().revision;
        drop(r);
        let r = Registry::with_backend(RedbBackend::open(&path).unwrap(), pools()).unwrap();
        assert_eq!(r.snapshot().revision, rev);
        assert_eq!(r.get("node-b").unwrap(), b);
        // Removal frees the blocks for the next node.
        assert_eq!(r.remove("node-a").unwrap(), a.blocks);
        let c = r.register("node-c", &["192.0.2.3".into()], "").unwrap();
        assert_eq!(c.blocks, a.blocks);
    }

    #[test]
    fn exhaustion_and_extra_blocks() {
        let dir = crate::util::TestDir::new("reg-exh");
        let r = Registry::with_backend(RedbBackend::open(&dir.0.join("registry.redb")).unwrap(), pools()).unwrap();
        for i in 0..4 {
            r.register(&format!("n{i}"), &["192.0.2.1".into()], "").unwrap();
        }
        let e = r.register("n4", &["192.0.2.1".into()], "").unwrap_err();
        assert!(matches!(e, RegistryError::Exhausted { family: Family::V4, .. }), "{e}");
        assert!(r.get("n4").is_none(), "a failed registration records nothing");
        r.remove("n3").unwrap();
        let more = r.request_block("n0", Family::V4).unwrap();
        assert_eq!(more.blocks.len(), 3);
        let usage: Vec<(String, u128, u128)> =
            r.pool_usage().iter().map(|(p, used)| (p.net.to_string(), p.block_count(), *used)).collect();
        assert_eq!(usage, vec![("10.8.0.0/22".into(), 4, 4), ("fd00:8::/62".into(), 4, 3)]);
        assert!(matches!(r.request_block("n0", Family::V4), Err(RegistryError::Exhausted { .. })));
        assert!(matches!(r.request_block("ghost", Family::V4), Err(RegistryError::NotFound(_))));
    }

    #[test]
    fn validates_input() {
        let dir = crate::util::TestDir::new("reg-val");
        let r = Registry::with_backend(RedbBackend::open(&dir.0.join("registry.redb")).unwrap(), pools()).unwrap();
        assert!(matches!(r.register("Bad_Name", &["192.0.2.1".into()], ""), Err(RegistryError::InvalidArgument(_))));
        assert!(matches!(r.register("ok", &["nope".into()], ""), Err(RegistryError::InvalidArgument(_))));
        assert!(matches!(r.register("ok", &[], ""), Err(RegistryError::InvalidArgument(_))));
        assert!(matches!(r.register("ok", &["192.0.2.1".into()], "zz"), Err(RegistryError::InvalidArgument(_))));
    }
}
