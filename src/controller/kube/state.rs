//! The controller's state as Kubernetes objects (cluster-scoped custom resources of
//! `nodeplane.dev/v1alpha1`), behind the same [`Backend`] interface as the embedded store.
//!
//! - `NodeplaneNode` (name = node name): `spec.underlay`, `spec.vtepMac`, `spec.blocks` (in
//!   allocation order). The record.
//! - `IPBlock` (name derived from the CIDR): `spec.cidr`, `spec.node`. A lock: the API server
//!   refuses a second object of the same name (AlreadyExists), so no block can be held twice
//!   even if two controllers ever wrote at once.
//! - `NodeplaneVolume` (name derived from the volume id): the volume book's record.
//!
//! Writes carry the resourceVersion last seen (optimistic concurrency): a write that lost a
//! race with another writer fails with Conflict instead of overwriting it.
//!
//! Order of writes, so that a crash at any point leaves a state [`KubeBackend::load_nodes`]
//! repairs: a node's new blocks are locked *before* its record names them; a record is
//! rewritten (or deleted) *before* the locks of blocks it gave up are deleted. At load, a
//! lock no record names is deleted (a crash between lock and record), a record whose block
//! has no lock gets it back, and a block locked for another node than the record says is an
//! error (the controller refuses to start rather than hand out a block twice).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::core::{ApiResource, DynamicObject, ObjectMeta};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{block_resource, is_already_exists, is_not_found, node_resource, volume_resource};
use crate::controller::backend::{Backend, Change};
use crate::controller::store::NodeRecord;
use crate::controller::volumes::VolumeRecord;

const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "nodeplane-controller");
const NODE_LABEL: &str = "nodeplane.dev/node";
/// Bound on one backend call (several API requests).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NodeSpec {
    underlay: Vec<String>,
    #[serde(default)]
    vtep_mac: String,
    #[serde(default)]
    blocks: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct BlockSpec {
    cidr: String,
    node: String,
}

/// The object name of a block's lock: the CIDR with `.`, `:` and `/` as `-`
/// (`10.8.1.0/24` → `10-8-1-0-24`, `fd00:8::/64` → `fd00-8---64`). Injective: an IPv4 CIDR
/// has exactly five numeric parts and never `--`; a canonical IPv6 one has fewer than eight
/// groups only with `::`, i.e. `--`.
pub fn block_object_name(cidr: &str) -> String {
    let canonical = cidr.parse::<ipnetwork::IpNetwork>().map(|n| n.to_string()).unwrap_or_else(|_| cidr.to_string());
    canonical.replace(['.', ':', '/'], "-")
}

/// The object name of a volume's record: the id itself when it is a valid object name,
/// else `v-` and a hash of it.
pub fn volume_object_name(id: &str) -> String {
    if super::valid_object_name(id) {
        return id.to_string();
    }
    use sha2::Digest;
    format!("v-{}", hex::encode(&sha2::Sha256::digest(id.as_bytes())[..16]))
}

fn object(res: &ApiResource, name: &str, labels: &[(&str, &str)], spec: serde_json::Value, rv: Option<String>) -> DynamicObject {
    let mut o = DynamicObject::new(name, res);
    o.metadata = ObjectMeta {
        name: Some(name.to_string()),
        labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>()),
        resource_version: rv,
        ..Default::default()
    };
    o.data = json!({ "spec": spec });
    o
}

fn spec_of<T: serde::de::DeserializeOwned>(o: &DynamicObject) -> Result<T, String> {
    let name = o.metadata.name.as_deref().unwrap_or("?");
    let spec = o.data.get("spec").cloned().ok_or_else(|| format!("{name}: no spec"))?;
    serde_json::from_value(spec).map_err(|e| format!("{name}: bad spec: {e}"))
}

#[derive(Default)]
struct Known {
    /// node name -> (record, resourceVersion)
    nodes: HashMap<String, (NodeRecord, String)>,
    /// volume object name -> resourceVersion
    volumes: HashMap<String, String>,
}

pub struct KubeBackend {
    rt: RuntimeThread,
    nodes: Api<DynamicObject>,
    blocks: Api<DynamicObject>,
    volumes: Api<DynamicObject>,
    known: Mutex<Known>,
}

/// A tokio runtime on its own thread: the backend interface is synchronous (the registry and
/// the book commit under their locks, from any thread), so calls are sent here and waited
/// for, and never nest one runtime inside another.
struct RuntimeThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl RuntimeThread {
    fn start() -> Result<Self, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("kube-state".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(|e| e.to_string())?;
        let handle = rx.recv().map_err(|e| e.to_string())??;
        Ok(RuntimeThread { handle, stop: Some(stop) })
    }

    fn run<T: Send + 'static>(&self, f: impl std::future::Future<Output = Result<T, String>> + Send + 'static) -> Result<T, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.handle.spawn(async move {
            let r = match tokio::time::timeout(CALL_TIMEOUT, f).await {
                Ok(r) => r,
                Err(_) => Err(format!("the Kubernetes API did not answer within {CALL_TIMEOUT:?}")),
            };
            let _ = tx.send(r);
        });
        rx.recv().map_err(|_| "the Kubernetes state thread stopped".to_string())?
    }
}

impl Drop for RuntimeThread {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

fn err(what: impl std::fmt::Display) -> impl FnOnce(kube::Error) -> String {
    move |e| format!("{what}: {e}")
}

impl KubeBackend {
    /// A backend on a client built from this kube configuration (its own connection pool,
    /// on the backend's own runtime).
    pub fn new(config: kube::Config) -> Result<Self, String> {
        let rt = RuntimeThread::start()?;
        let client = rt.run(async move { kube::Client::try_from(config).map_err(|e| format!("Kubernetes client: {e}")) })?;
        Ok(KubeBackend {
            nodes: Api::all_with(client.clone(), &node_resource()),
            blocks: Api::all_with(client.clone(), &block_resource()),
            volumes: Api::all_with(client, &volume_resource()),
            rt,
            known: Mutex::new(Known::default()),
        })
    }

    async fn lock_block(blocks: &Api<DynamicObject>, cidr: &str, node: &str) -> Result<(), String> {
        let name = block_object_name(cidr);
        let spec = serde_json::to_value(BlockSpec { cidr: cidr.into(), node: node.into() }).map_err(|e| e.to_string())?;
        let obj = object(&block_resource(), &name, &[MANAGED_BY, (NODE_LABEL, node)], spec, None);
        match blocks.create(&PostParams::default(), &obj).await {
            Ok(_) => Ok(()),
            Err(e) if is_already_exists(&e) => {
                // Ours already (a retried commit)? Otherwise someone else holds it.
                let cur = blocks.get(&name).await.map_err(err(format!("reading block lock {name}")))?;
                let held: BlockSpec = spec_of(&cur)?;
                if held.node == node && held.cidr == cidr {
                    Ok(())
                } else {
                    Err(format!("block {cidr} is locked for node {:?} in the API (IPBlock {name})", held.node))
                }
            }
            Err(e) => Err(format!("locking block {cidr} (IPBlock {name}): {e}")),
        }
    }

    async fn unlock_block(blocks: &Api<DynamicObject>, cidr: &str) -> Result<(), String> {
        let name = block_object_name(cidr);
        match blocks.delete(&name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(format!("releasing block {cidr} (IPBlock {name}): {e}")),
        }
    }
}

/// Create, or replace at the resourceVersion last seen; the new resourceVersion.
async fn put(api: &Api<DynamicObject>, obj: DynamicObject, what: &str) -> Result<String, String> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let written = if obj.metadata.resource_version.is_some() {
        api.replace(&name, &PostParams::default(), &obj).await
    } else {
        api.create(&PostParams::default(), &obj).await
    };
    match written {
        Ok(o) => Ok(o.metadata.resource_version.unwrap_or_default()),
        Err(e) if super::is_conflict(&e) || is_already_exists(&e) => Err(format!(
            "{what} was changed by another writer since this controller read it ({e}); is a second controller writing? \
             This one stops writing; restart it to re-read the state"
        )),
        Err(e) => Err(format!("writing {what}: {e}")),
    }
}

/// Delete at the resourceVersion last seen; absent is success.
async fn remove(api: &Api<DynamicObject>, name: &str, rv: Option<String>, what: &str) -> Result<(), String> {
    let dp = DeleteParams { preconditions: rv.map(|rv| Preconditions { resource_version: Some(rv), uid: None }), ..Default::default() };
    match api.delete(name, &dp).await {
        Ok(_) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) if super::is_conflict(&e) => Err(format!("{what} was changed by another writer ({e})")),
        Err(e) => Err(format!("deleting {what}: {e}")),
    }
}

impl Backend for KubeBackend {
    fn load_nodes(&self) -> Result<(Vec<NodeRecord>, u64), String> {
        let (nodes, blocks) = (self.nodes.clone(), self.blocks.clone());
        let (records, revision) = self.rt.run(async move {
            let list = nodes.list(&ListParams::default()).await.map_err(err("listing nodeplanenodes"))?;
            let revision = list.metadata.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0u64);
            let mut records = Vec::new();
            for o in &list.items {
                let name = o.metadata.name.clone().unwrap_or_default();
                let spec: NodeSpec = spec_of(o)?;
                let rec = NodeRecord { name, underlay: spec.underlay, vtep_mac: spec.vtep_mac, blocks: spec.blocks };
                records.push((rec, o.metadata.resource_version.clone().unwrap_or_default()));
            }
            let locks = blocks.list(&ListParams::default()).await.map_err(err("listing ipblocks"))?;
            let mut held: HashMap<String, String> = HashMap::new();
            for o in &locks.items {
                let spec: BlockSpec = spec_of(o)?;
                let name = o.metadata.name.clone().unwrap_or_default();
                if name != block_object_name(&spec.cidr) {
                    return Err(format!("IPBlock {name} does not match its cidr {}", spec.cidr));
                }
                held.insert(spec.cidr, spec.node);
            }
            let mut named = HashSet::new();
            for (rec, _) in &records {
                for b in &rec.blocks {
                    named.insert(b.clone());
                    match held.get(b) {
                        Some(n) if n == &rec.name => {}
                        Some(n) => return Err(format!("block {b} is in node {}'s record but locked for node {n}", rec.name)),
                        None => {
                            tracing::warn!(block = %b, node = %rec.name, "block lock missing; restoring it");
                            KubeBackend::lock_block(&blocks, b, &rec.name).await?;
                        }
                    }
                }
            }
            for (cidr, node) in &held {
                if !named.contains(cidr) {
                    tracing::warn!(block = %cidr, node = %node, "block locked but in no node's record (an interrupted change); releasing it");
                    KubeBackend::unlock_block(&blocks, cidr).await?;
                }
            }
            Ok((records, revision))
        })?;
        let mut known = self.known.lock().unwrap();
        known.nodes = records.iter().map(|(r, rv)| (r.name.clone(), (r.clone(), rv.clone()))).collect();
        Ok((records.into_iter().map(|(r, _)| r).collect(), revision))
    }

    fn commit_nodes(&self, changes: &[Change<NodeRecord>], _revision: u64) -> Result<(), String> {
        // One commit at a time (the registry serializes them already).
        let mut known = self.known.lock().unwrap();
        for (name, rec) in changes {
            let old = known.nodes.get(name).cloned();
            let (nodes, blocks, name2, rec2) = (self.nodes.clone(), self.blocks.clone(), name.clone(), rec.clone());
            let new_rv = self.rt.run(async move {
                let old_blocks: Vec<String> = old.as_ref().map(|(r, _)| r.blocks.clone()).unwrap_or_default();
                let rv = old.map(|(_, rv)| rv);
                match rec2 {
                    Some(rec) => {
                        let added: Vec<&String> = rec.blocks.iter().filter(|b| !old_blocks.contains(b)).collect();
                        let mut locked = Vec::new();
                        let mut failed = None;
                        for b in &added {
                            match KubeBackend::lock_block(&blocks, b, &name2).await {
                                Ok(()) => locked.push(*b),
                                Err(e) => {
                                    failed = Some(e);
                                    break;
                                }
                            }
                        }
                        let written = match failed {
                            Some(e) => Err(e),
                            None => {
                                let spec = NodeSpec { underlay: rec.underlay.clone(), vtep_mac: rec.vtep_mac.clone(), blocks: rec.blocks.clone() };
                                let spec = serde_json::to_value(spec).map_err(|e| e.to_string())?;
                                put(&nodes, object(&node_resource(), &name2, &[MANAGED_BY], spec, rv), &format!("NodeplaneNode {name2}")).await
                            }
                        };
                        match written {
                            Ok(new_rv) => {
                                for b in old_blocks.iter().filter(|b| !rec.blocks.contains(b)) {
                                    // The record no longer names it: a lock left behind is
                                    // released at the next load.
                                    if let Err(e) = KubeBackend::unlock_block(&blocks, b).await {
                                        tracing::warn!(error = %e, "block lock left behind");
                                    }
                                }
                                Ok(Some(new_rv))
                            }
                            Err(e) => {
                                for b in locked {
                                    if let Err(u) = KubeBackend::unlock_block(&blocks, b).await {
                                        tracing::warn!(error = %u, "block lock left behind");
                                    }
                                }
                                Err(e)
                            }
                        }
                    }
                    None => {
                        remove(&nodes, &name2, rv, &format!("NodeplaneNode {name2}")).await?;
                        for b in &old_blocks {
                            if let Err(e) = KubeBackend::unlock_block(&blocks, b).await {
                                tracing::warn!(error = %e, "block lock left behind");
                            }
                        }
                        Ok(None)
                    }
                }
            })?;
            match (rec, new_rv) {
                (Some(r), Some(rv)) => {
                    known.nodes.insert(name.clone(), (r.clone(), rv));
                }
                _ => {
                    known.nodes.remove(name);
                }
            }
        }
        Ok(())
    }

    fn load_volumes(&self) -> Result<Vec<VolumeRecord>, String> {
        let volumes = self.volumes.clone();
        let items = self.rt.run(async move {
            let list = volumes.list(&ListParams::default()).await.map_err(err("listing nodeplanevolumes"))?;
            let mut out = Vec::new();
            for o in &list.items {
                let rec: VolumeRecord = spec_of(o)?;
                let name = o.metadata.name.clone().unwrap_or_default();
                if name != volume_object_name(&rec.id) {
                    return Err(format!("NodeplaneVolume {name} does not match its id {:?}", rec.id));
                }
                out.push((rec, name, o.metadata.resource_version.clone().unwrap_or_default()));
            }
            Ok(out)
        })?;
        let mut known = self.known.lock().unwrap();
        known.volumes = items.iter().map(|(_, n, rv)| (n.clone(), rv.clone())).collect();
        Ok(items.into_iter().map(|(r, _, _)| r).collect())
    }

    fn commit_volumes(&self, changes: &[Change<VolumeRecord>]) -> Result<(), String> {
        let mut known = self.known.lock().unwrap();
        for (id, rec) in changes {
            let name = volume_object_name(id);
            let rv = known.volumes.get(&name).cloned();
            let (volumes, name2, rec2) = (self.volumes.clone(), name.clone(), rec.clone());
            let new_rv = self.rt.run(async move {
                let what = format!("NodeplaneVolume {name2}");
                match rec2 {
                    Some(r) => {
                        let node = r.node.clone();
                        let spec = serde_json::to_value(&r).map_err(|e| e.to_string())?;
                        let obj = object(&volume_resource(), &name2, &[MANAGED_BY, (NODE_LABEL, &node)], spec, rv);
                        put(&volumes, obj, &what).await.map(Some)
                    }
                    None => remove(&volumes, &name2, rv, &what).await.map(|_| None),
                }
            })?;
            match new_rv {
                Some(rv) => known.volumes.insert(name, rv),
                None => known.volumes.remove(&name),
            };
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("Kubernetes API ({}/{} objects)", super::GROUP, super::VERSION)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names() {
        assert_eq!(block_object_name("10.8.1.0/24"), "10-8-1-0-24");
        assert_eq!(block_object_name("fd00:8::/64"), "fd00-8---64");
        assert_eq!(block_object_name("fd00:8:0:1::/64"), "fd00-8-0-1---64");
        for n in ["10-8-1-0-24", "fd00-8---64"] {
            assert!(super::super::valid_object_name(n), "{n}");
        }
        assert_eq!(volume_object_name("pvc-0a1b"), "pvc-0a1b");
        let odd = volume_object_name("Vol_1");
        assert!(odd.starts_with("v-") && super::super::valid_object_name(&odd), "{odd}");
    }
}
