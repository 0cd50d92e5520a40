//! One resource's device plugin: the devices it tracks (found and judged by
//! `devices::inventory`) and the `v1beta1.DevicePlugin` service kubelet calls on the
//! plugin's socket.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::devices::config::Resource;
use crate::devices::inventory::{Node, check_health, numa_of, scan};
use crate::rpc::deviceplugin as pb;

pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// The state of one resource.
pub struct Plugin {
    pub res: Arc<Resource>,
    nodes: Mutex<BTreeMap<PathBuf, Node>>,
    list_tx: watch::Sender<Vec<pb::Device>>,
}

impl Plugin {
    pub fn new(res: Arc<Resource>) -> Arc<Self> {
        let (list_tx, _) = watch::channel(Vec::new());
        let p = Arc::new(Plugin { res, nodes: Mutex::new(BTreeMap::new()), list_tx });
        p.rescan();
        p
    }

    /// Re-read the device nodes and their health; publish the list when it changed.
    /// Returns whether it changed.
    pub fn rescan(&self) -> bool {
        let found = scan(&self.res);
        let mut nodes = self.nodes.lock().unwrap();
        for path in &found {
            if !nodes.contains_key(path) {
                let base = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                // Two patterns can match nodes of the same base name in different
                // directories: qualify the later one with its directory's name.
                let name = if nodes.values().any(|n| n.name == base) {
                    let parent = path.parent().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    format!("{parent}_{base}")
                } else {
                    base
                };
                nodes.insert(path.clone(), Node { path: path.clone(), name, healthy: false, numa: numa_of(path) });
            }
        }
        for n in nodes.values_mut() {
            let h = check_health(&n.path);
            if h != n.healthy {
                tracing::info!(resource = %self.res.resource_name(), device = %n.path.display(), healthy = h, "device health changed");
                n.healthy = h;
            }
        }
        let list = self.list_locked(&nodes);
        drop(nodes);
        let changed = *self.list_tx.borrow() != list;
        if changed {
            self.list_tx.send_replace(list);
        }
        changed
    }

    fn list_locked(&self, nodes: &BTreeMap<PathBuf, Node>) -> Vec<pb::Device> {
        let mut out = Vec::new();
        for n in nodes.values() {
            let topology = n.numa.map(|id| pb::TopologyInfo { nodes: vec![pb::NumaNode { id }] });
            let health = if n.healthy { HEALTHY } else { UNHEALTHY }.to_string();
            if self.res.share == 1 {
                out.push(pb::Device { id: n.name.clone(), health, topology });
            } else {
                for k in 0..self.res.share {
                    out.push(pb::Device { id: format!("{}-{k}", n.name), health: health.clone(), topology: topology.clone() });
                }
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    pub fn devices(&self) -> Vec<pb::Device> {
        self.list_tx.borrow().clone()
    }

    /// The node behind a device ID, if the ID is one of ours.
    fn node_of(&self, id: &str) -> Option<Node> {
        let nodes = self.nodes.lock().unwrap();
        if self.res.share == 1 {
            return nodes.values().find(|n| n.name == id).cloned();
        }
        let (stem, k) = id.rsplit_once('-')?;
        let k: u32 = k.parse().ok()?;
        if k >= self.res.share || k.to_string() != id.rsplit_once('-')?.1 {
            return None;
        }
        nodes.values().find(|n| n.name == stem).cloned()
    }

    /// Check every ID: unknown → INVALID_ARGUMENT, unhealthy → FAILED_PRECONDITION. Returns
    /// the distinct device nodes, in first-seen order.
    fn resolve(&self, ids: &[String]) -> Result<Vec<Node>, Status> {
        let mut out: Vec<Node> = Vec::new();
        for id in ids {
            let n = self.node_of(id).ok_or_else(|| {
                Status::invalid_argument(format!("device {id:?} is not a device of {}", self.res.resource_name()))
            })?;
            if !check_health(&n.path) {
                return Err(Status::failed_precondition(format!(
                    "device {id:?} ({}) of {} is unhealthy",
                    n.path.display(),
                    self.res.resource_name()
                )));
            }
            if !out.iter().any(|o| o.path == n.path) {
                out.push(n);
            }
        }
        Ok(out)
    }

    pub fn allocate_one(&self, ids: &[String]) -> Result<pb::ContainerAllocateResponse, Status> {
        let nodes = self.resolve(ids)?;
        let mut envs: std::collections::HashMap<String, String> =
            self.res.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        envs.insert(self.res.ids_env(), ids.join(","));
        Ok(pb::ContainerAllocateResponse {
            envs,
            mounts: self
                .res
                .mounts
                .iter()
                .map(|m| pb::Mount {
                    container_path: m.container_path.to_string_lossy().into_owned(),
                    host_path: m.host_path.to_string_lossy().into_owned(),
                    read_only: m.read_only,
                })
                .collect(),
            devices: nodes
                .iter()
                .map(|n| pb::DeviceSpec {
                    container_path: n.path.to_string_lossy().into_owned(),
                    host_path: n.path.to_string_lossy().into_owned(),
                    permissions: self.res.permissions.clone(),
                })
                .collect(),
            annotations: Default::default(),
            cdi_devices: if self.res.cdi {
                nodes.iter().map(|n| pb::CdiDevice { name: format!("{}={}", self.res.resource_name(), n.name) }).collect()
            } else {
                Vec::new()
            },
        })
    }

    /// A preferred allocation: `must` first, then devices on the NUMA node already most used
    /// (alignment) when the nodes report NUMA, else spread over physical devices (fewest
    /// already chosen from the same node first).
    pub fn preferred(&self, available: &[String], must: &[String], size: usize) -> Result<Vec<String>, Status> {
        if must.len() > size {
            return Err(Status::invalid_argument(format!("{} devices must be included but only {size} asked for", must.len())));
        }
        for id in must {
            if !available.contains(id) {
                return Err(Status::invalid_argument(format!("must-include device {id:?} is not available")));
            }
        }
        if size > available.len() {
            return Err(Status::invalid_argument(format!("{size} devices asked for, {} available", available.len())));
        }
        let mut chosen: Vec<String> = must.to_vec();
        let info: BTreeMap<String, Node> = available.iter().filter_map(|id| self.node_of(id).map(|n| (id.clone(), n))).collect();
        // Counts of what is chosen so far, per device node and per NUMA node, kept up to
        // date as devices are picked: each pick is one pass over the candidates (a device
        // shared 1000 ways lists 1000 IDs; recounting per candidate made 2000 IDs take minutes).
        let mut taken: HashSet<&str> = HashSet::new();
        let mut on_path: HashMap<&Path, usize> = HashMap::new();
        let mut on_numa: HashMap<i64, usize> = HashMap::new();
        fn pick<'a>(
            info: &'a BTreeMap<String, Node>,
            id: &str,
            taken: &mut HashSet<&'a str>,
            on_path: &mut HashMap<&'a Path, usize>,
            on_numa: &mut HashMap<i64, usize>,
        ) {
            if let Some((key, n)) = info.get_key_value(id) {
                taken.insert(key.as_str());
                *on_path.entry(n.path.as_path()).or_default() += 1;
                if let Some(numa) = n.numa {
                    *on_numa.entry(numa).or_default() += 1;
                }
            }
        }
        for id in must {
            pick(&info, id, &mut taken, &mut on_path, &mut on_numa);
        }
        let mut candidates: Vec<&String> = available.iter().filter(|id| !must.contains(id)).collect();
        candidates.sort();
        candidates.dedup();
        while chosen.len() < size {
            let next = candidates
                .iter()
                .filter(|id| !taken.contains(id.as_str()))
                .min_by_key(|id| {
                    let n = info.get(id.as_str());
                    let numa_pref = n.and_then(|n| n.numa).and_then(|numa| on_numa.get(&numa).copied()).unwrap_or(0);
                    let spread = n.map(|n| on_path.get(n.path.as_path()).copied().unwrap_or(0)).unwrap_or(usize::MAX);
                    let healthy = n.is_some_and(|n| n.healthy);
                    (!healthy, std::cmp::Reverse(numa_pref), spread, id.as_str())
                })
                .map(|id| id.as_str());
            match next {
                Some(id) => {
                    // An ID with no node (gone since the list) cannot be counted: mark it taken directly.
                    if info.contains_key(id) {
                        pick(&info, id, &mut taken, &mut on_path, &mut on_numa);
                    } else {
                        taken.insert(id);
                    }
                    chosen.push(id.to_string());
                }
                None => break,
            }
        }
        Ok(chosen)
    }

    /// The CDI spec of this resource's devices now.
    pub fn cdi_spec(&self) -> serde_json::Value {
        let nodes = self.nodes.lock().unwrap();
        crate::devices::cdi::spec(&self.res, nodes.values())
    }

    pub fn subscribe(&self) -> watch::Receiver<Vec<pb::Device>> {
        self.list_tx.subscribe()
    }
}

/// The gRPC face of a [`Plugin`]. `stop` ends its ListAndWatch streams.
#[derive(Clone)]
pub struct Service {
    pub plugin: Arc<Plugin>,
    pub stop: watch::Receiver<bool>,
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<pb::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::device_plugin_server::DevicePlugin for Service {
    async fn get_device_plugin_options(&self, _: Request<pb::Empty>) -> Result<Response<pb::DevicePluginOptions>, Status> {
        Ok(Response::new(pb::DevicePluginOptions {
            pre_start_required: self.plugin.res.pre_start,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(&self, _: Request<pb::Empty>) -> Result<Response<DeviceStream>, Status> {
        let mut rx = self.plugin.subscribe();
        let mut stop = self.stop.clone();
        let (tx, out) = tokio::sync::mpsc::channel(4);
        let name = self.plugin.res.resource_name();
        tokio::spawn(async move {
            loop {
                let list = rx.borrow_and_update().clone();
                if tx.send(Ok(pb::ListAndWatchResponse { devices: list })).await.is_err() {
                    break;
                }
                tokio::select! {
                    r = rx.changed() => if r.is_err() { break },
                    _ = stop.wait_for(|s| *s) => break,
                    _ = tx.closed() => break,
                }
            }
            tracing::debug!(resource = %name, "ListAndWatch stream ended");
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out))))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<pb::PreferredAllocationRequest>,
    ) -> Result<Response<pb::PreferredAllocationResponse>, Status> {
        let mut out = Vec::new();
        for c in req.into_inner().container_requests {
            let size = usize::try_from(c.allocation_size).map_err(|_| Status::invalid_argument("allocation_size must not be negative"))?;
            let ids = self.plugin.preferred(&c.available_device_i_ds, &c.must_include_device_i_ds, size)?;
            out.push(pb::ContainerPreferredAllocationResponse { device_i_ds: ids });
        }
        Ok(Response::new(pb::PreferredAllocationResponse { container_responses: out }))
    }

    async fn allocate(&self, req: Request<pb::AllocateRequest>) -> Result<Response<pb::AllocateResponse>, Status> {
        let mut out = Vec::new();
        for c in req.into_inner().container_requests {
            match self.plugin.allocate_one(&c.devices_ids) {
                Ok(r) => {
                    tracing::info!(resource = %self.plugin.res.resource_name(), devices = ?c.devices_ids, "allocated");
                    out.push(r)
                }
                Err(e) => {
                    tracing::warn!(resource = %self.plugin.res.resource_name(), ids = ?c.devices_ids, error = %e.message(), "Allocate refused");
                    // A device that went bad: make sure kubelet's view is current.
                    self.plugin.rescan();
                    return Err(e);
                }
            }
        }
        Ok(Response::new(pb::AllocateResponse { container_responses: out }))
    }

    async fn pre_start_container(
        &self,
        req: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        self.plugin.resolve(&req.into_inner().devices_ids)?;
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}
