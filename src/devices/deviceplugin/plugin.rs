//! One resource's device plugin: the devices it tracks (found and judged by
//! `devices::inventory`) and the `v1beta1.DevicePlugin` service kubelet calls on the
//! plugin's socket.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::devices::config::Resource;
use crate::devices::inventory::{Node, check_health, numa_of, scan};
use crate::rpc::deviceplugin as pb;

pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// At most this many containers in one GetPreferredAllocation or Allocate request (a pod
/// has a handful; the bound keeps one request's work proportional to the resource).
pub const MAX_CONTAINERS: usize = 256;

/// The state of one resource.
pub struct Plugin {
    pub res: Arc<Resource>,
    nodes: Mutex<BTreeMap<PathBuf, Node>>,
    /// Device nodes whose name cannot be a device ID or CDI device name (said once each).
    rejected: Mutex<HashSet<PathBuf>>,
    list_tx: watch::Sender<Vec<pb::Device>>,
    /// Asks the resource's task for a rescan (with its CDI spec) soon.
    pub rescan_wanted: tokio::sync::Notify,
}

/// An ID as it may appear in a log line or an error message: at most 64 bytes of it.
pub fn short(id: &str) -> String {
    const MAX: usize = 64;
    if id.len() <= MAX {
        return format!("{id:?}");
    }
    let mut end = MAX;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &id[..end], id.len())
}

/// A list of IDs for a log line: the first 8 (each shortened), then how many more.
pub fn summary(ids: &[String]) -> String {
    let mut out: Vec<String> = ids.iter().take(8).map(|i| short(i)).collect();
    if ids.len() > 8 {
        out.push(format!("and {} more", ids.len() - 8));
    }
    format!("[{}]", out.join(", "))
}

impl Plugin {
    /// A plugin with its devices scanned.
    pub fn new(res: Arc<Resource>) -> Arc<Self> {
        let p = Self::unscanned(res);
        p.rescan();
        p
    }

    /// A plugin that has not looked for its devices yet (its task scans them off the
    /// async runtime).
    pub fn unscanned(res: Arc<Resource>) -> Arc<Self> {
        let (list_tx, _) = watch::channel(Vec::new());
        Arc::new(Plugin {
            res,
            nodes: Mutex::new(BTreeMap::new()),
            rejected: Mutex::default(),
            list_tx,
            rescan_wanted: Default::default(),
        })
    }

    /// Re-read the device nodes and their health; publish the list when it changed.
    /// Returns whether it changed.
    pub fn rescan(&self) -> bool {
        self.rescan_then(|_| ())
    }

    /// [`Plugin::rescan`], running `before_publish` after the nodes are updated and before a
    /// changed list reaches ListAndWatch: the CDI spec must name a device before kubelet
    /// can hand it out.
    pub fn rescan_then(&self, before_publish: impl FnOnce(&Self)) -> bool {
        let found = scan(&self.res);
        let mut nodes = self.nodes.lock().unwrap();
        for path in &found {
            if !nodes.contains_key(path) {
                let base = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                // Two patterns can match nodes of the same base name in different
                // directories: qualify the later one with its directory's name.
                let name = if nodes.values().any(|n| n.name == base) {
                    let parent = path
                        .parent()
                        .and_then(|p| p.file_name())
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                    format!("{parent}_{base}")
                } else {
                    base
                };
                // The name is the device ID kubelet sees, part of a comma-separated list in
                // the container's environment, and the CDI device name: one that breaks
                // any of those, or is taken already, is not offered (the others still are).
                let checked = crate::devices::cdi::check_device_name(&name).and_then(|()| {
                    if nodes.values().any(|n| n.name == name) {
                        Err(format!("device name {name:?} is taken by another device node"))
                    } else {
                        Ok(())
                    }
                });
                if let Err(why) = checked {
                    if self.rejected.lock().unwrap().insert(path.clone()) {
                        tracing::warn!(resource = %self.res.resource_name(), device = %path.display(), "device node not offered: {why}");
                    }
                    continue;
                }
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
        before_publish(self);
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
                    out.push(pb::Device {
                        id: format!("{}-{k}", n.name),
                        health: health.clone(),
                        topology: topology.clone(),
                    });
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
    #[cfg(test)]
    fn node_of(&self, id: &str) -> Option<Node> {
        let nodes = self.nodes.lock().unwrap();
        let by_name: HashMap<&str, &Node> = nodes.values().map(|n| (n.name.as_str(), n)).collect();
        self.lookup(&by_name, id).cloned()
    }

    /// [`Plugin::node_of`] over a name index.
    fn lookup<'a>(&self, by_name: &HashMap<&str, &'a Node>, id: &str) -> Option<&'a Node> {
        if self.res.share == 1 {
            return by_name.get(id).copied();
        }
        let (stem, k) = id.rsplit_once('-')?;
        let n: u32 = k.parse().ok()?;
        if n >= self.res.share || n.to_string() != k {
            return None;
        }
        by_name.get(stem).copied()
    }

    /// How many device IDs the resource advertises now.
    pub fn advertised(&self) -> usize {
        self.list_tx.borrow().len()
    }

    /// Check every ID: unknown → INVALID_ARGUMENT, unhealthy → FAILED_PRECONDITION. Returns
    /// the distinct device nodes, in first-seen order.
    fn resolve(&self, ids: &[String]) -> Result<Vec<Node>, Status> {
        let mut out: Vec<Node> = Vec::new();
        let nodes = self.nodes.lock().unwrap().clone();
        let by_name: HashMap<&str, &Node> = nodes.values().map(|n| (n.name.as_str(), n)).collect();
        for id in ids {
            let n = self.lookup(&by_name, id).cloned().ok_or_else(|| {
                Status::invalid_argument(format!(
                    "device {} is not a device of {}",
                    short(id),
                    self.res.resource_name()
                ))
            })?;
            if !check_health(&n.path) {
                return Err(Status::failed_precondition(format!(
                    "device {} ({}) of {} is unhealthy",
                    short(id),
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
                nodes
                    .iter()
                    .map(|n| pb::CdiDevice { name: format!("{}={}", self.res.resource_name(), n.name) })
                    .collect()
            } else {
                Vec::new()
            },
        })
    }

    /// A preferred allocation: `must` first, then devices on the NUMA node already most used
    /// (alignment) when the nodes report NUMA, else spread over physical devices (fewest
    /// already chosen from the same node first); healthy before unhealthy, IDs we do not
    /// know last, ties by ID. Each device node keeps its free IDs in order; a pick scans the
    /// device nodes: O(n log n + size × device nodes) in the n available IDs.
    pub fn preferred(&self, available: &[String], must: &[String], size: usize) -> Result<Vec<String>, Status> {
        self.preferred_by(available, must, size, None)
    }

    /// [`Plugin::preferred`], stopping with DEADLINE_EXCEEDED at `deadline`.
    pub fn preferred_by(
        &self,
        available: &[String],
        must: &[String],
        size: usize,
        deadline: Option<Instant>,
    ) -> Result<Vec<String>, Status> {
        if must.len() > size {
            return Err(Status::invalid_argument(format!(
                "{} devices must be included but only {size} asked for",
                must.len()
            )));
        }
        let avail: HashSet<&str> = available.iter().map(String::as_str).collect();
        if let Some(id) = must.iter().find(|id| !avail.contains(id.as_str())) {
            return Err(Status::invalid_argument(format!("must-include device {} is not available", short(id))));
        }
        if size > available.len() {
            return Err(Status::invalid_argument(format!("{size} devices asked for, {} available", available.len())));
        }
        let nodes = self.nodes.lock().unwrap().clone();
        let by_name: HashMap<&str, &Node> = nodes.values().map(|n| (n.name.as_str(), n)).collect();
        let index: HashMap<&std::path::Path, usize> =
            nodes.values().enumerate().map(|(i, n)| (n.path.as_path(), i)).collect();
        let node_list: Vec<&Node> = nodes.values().collect();
        let mut used = vec![0usize; node_list.len()];
        let mut on_numa: HashMap<i64, usize> = HashMap::new();
        let mut chosen: Vec<String> = must.to_vec();
        let must_set: HashSet<&str> = must.iter().map(String::as_str).collect();
        for id in &must_set {
            if let Some(n) = self.lookup(&by_name, id) {
                used[index[n.path.as_path()]] += 1;
                if let Some(numa) = n.numa {
                    *on_numa.entry(numa).or_default() += 1;
                }
            }
        }
        // Free IDs per node, largest first (so `pop` gives the smallest); unknown IDs apart.
        let mut free: Vec<Vec<&str>> = vec![Vec::new(); node_list.len()];
        let mut unknown: Vec<&str> = Vec::new();
        for id in avail.iter().filter(|id| !must_set.contains(*id)) {
            match self.lookup(&by_name, id) {
                Some(n) => free[index[n.path.as_path()]].push(id),
                None => unknown.push(id),
            }
        }
        for f in &mut free {
            f.sort_unstable_by(|a, b| b.cmp(a));
        }
        unknown.sort_unstable_by(|a, b| b.cmp(a));
        let mut steps = 0usize;
        while chosen.len() < size {
            steps += 1;
            if steps.is_multiple_of(256) && deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Status::deadline_exceeded(format!(
                    "preferred allocation of {size} from {} IDs did not finish in time",
                    avail.len()
                )));
            }
            // An ID belongs to one node, so the smallest free IDs make every key distinct.
            let best = (0..node_list.len())
                .filter_map(|i| {
                    let (n, first) = (node_list[i], *free[i].last()?);
                    let numa_pref = n.numa.and_then(|x| on_numa.get(&x).copied()).unwrap_or(0);
                    Some(((!n.healthy, Reverse(numa_pref), used[i], first), i))
                })
                .min_by_key(|&(key, _)| key)
                .map(|(_, i)| i);
            let id = match best {
                Some(i) => {
                    used[i] += 1;
                    if let Some(numa) = node_list[i].numa {
                        *on_numa.entry(numa).or_default() += 1;
                    }
                    free[i].pop()
                }
                None => unknown.pop(),
            };
            let Some(id) = id else { break };
            chosen.push(id.to_string());
        }
        Ok(chosen)
    }

    /// The CDI spec of this resource's devices now (`None`: no device, so no spec).
    pub fn cdi_spec(&self) -> Option<serde_json::Value> {
        let nodes = self.nodes.lock().unwrap();
        let edits = crate::devices::cdi::Edits {
            permissions: &self.res.permissions,
            env: &self.res.env,
            mounts: self
                .res
                .mounts
                .iter()
                .map(|m| (m.host_path.as_path(), m.container_path.as_path(), m.read_only))
                .collect(),
        };
        crate::devices::cdi::spec(
            &self.res.resource_name(),
            &edits,
            nodes.values().map(|n| (n.name.as_str(), n.path.as_path())),
        )
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
    async fn get_device_plugin_options(
        &self,
        _: Request<pb::Empty>,
    ) -> Result<Response<pb::DevicePluginOptions>, Status> {
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
        // kubelet sends no deadline; a client that does is answered (and the work stopped)
        // by it. The work runs on a blocking thread, bounded by what the resource offers.
        let deadline = crate::rpc::deadline_of(req.metadata()).map(|d| Instant::now() + d);
        let r = req.into_inner();
        self.bounded(r.container_requests.len(), r.container_requests.iter().map(|c| c.available_device_i_ds.len()))?;
        let plugin = self.plugin.clone();
        let out = crate::rpc::blocking(move || {
            let mut out = Vec::new();
            for c in r.container_requests {
                let size = usize::try_from(c.allocation_size)
                    .map_err(|_| Status::invalid_argument("allocation_size must not be negative"))?;
                let ids = plugin.preferred_by(&c.available_device_i_ds, &c.must_include_device_i_ds, size, deadline)?;
                out.push(pb::ContainerPreferredAllocationResponse { device_i_ds: ids });
            }
            Ok::<_, Status>(out)
        })
        .await??;
        Ok(Response::new(pb::PreferredAllocationResponse { container_responses: out }))
    }

    async fn allocate(&self, req: Request<pb::AllocateRequest>) -> Result<Response<pb::AllocateResponse>, Status> {
        let r = req.into_inner();
        if r.container_requests.len() > MAX_CONTAINERS {
            return Err(Status::invalid_argument(format!(
                "{} container requests (at most {MAX_CONTAINERS})",
                r.container_requests.len()
            )));
        }
        let plugin = self.plugin.clone();
        let out = crate::rpc::blocking(move || {
            let mut out = Vec::new();
            for c in r.container_requests {
                match plugin.allocate_one(&c.devices_ids) {
                    Ok(r) => {
                        tracing::info!(resource = %plugin.res.resource_name(), devices = %summary(&c.devices_ids), "allocated");
                        out.push(r)
                    }
                    Err(e) => {
                        tracing::warn!(resource = %plugin.res.resource_name(), ids = %summary(&c.devices_ids), error = %e.message(), "Allocate refused");
                        // A device that went bad: make sure kubelet's view is current
                        // (the task rescans, CDI spec first).
                        plugin.rescan_wanted.notify_one();
                        return Err(e);
                    }
                }
            }
            Ok(out)
        })
        .await??;
        Ok(Response::new(pb::AllocateResponse { container_responses: out }))
    }

    async fn pre_start_container(
        &self,
        req: Request<pb::PreStartContainerRequest>,
    ) -> Result<Response<pb::PreStartContainerResponse>, Status> {
        let ids = req.into_inner().devices_ids;
        let plugin = self.plugin.clone();
        crate::rpc::blocking(move || plugin.resolve(&ids)).await??;
        Ok(Response::new(pb::PreStartContainerResponse {}))
    }
}

impl Service {
    /// Refuse a GetPreferredAllocation larger than anything this resource could be asked
    /// for: more containers than a pod has, or more available IDs for one container than the
    /// resource advertises. (Allocate and PreStart are linear in their IDs; gRPC's 4 MiB
    /// message limit bounds them.)
    fn bounded(&self, containers: usize, ids: impl Iterator<Item = usize>) -> Result<(), Status> {
        if containers > MAX_CONTAINERS {
            return Err(Status::invalid_argument(format!(
                "{containers} container requests (at most {MAX_CONTAINERS})"
            )));
        }
        let cap = self.plugin.advertised();
        if let Some(n) = ids.into_iter().find(|n| *n > cap) {
            return Err(Status::invalid_argument(format!(
                "{n} device IDs in one container request; {} advertises {cap}",
                self.plugin.res.resource_name()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The greedy choice `preferred` makes, written the slow and obvious way: each pick is a
    /// scan of every candidate for the best (health, NUMA use, spread, ID).
    fn reference(p: &Plugin, available: &[String], must: &[String], size: usize) -> Vec<String> {
        let mut chosen: Vec<String> = must.to_vec();
        let mut candidates: Vec<&String> = available.iter().filter(|id| !must.contains(id)).collect();
        candidates.sort();
        candidates.dedup();
        while chosen.len() < size {
            let count = |f: &dyn Fn(&Node) -> bool| {
                let mut seen = HashSet::new();
                chosen.iter().filter(|c| seen.insert(c.as_str())).filter_map(|c| p.node_of(c)).filter(|n| f(n)).count()
            };
            let next = candidates.iter().filter(|id| !chosen.contains(id)).min_by_key(|id| {
                let n = p.node_of(id);
                let numa = n.as_ref().and_then(|n| n.numa).map(|x| count(&|o: &Node| o.numa == Some(x))).unwrap_or(0);
                let spread = n.as_ref().map(|n| count(&|o: &Node| o.path == n.path)).unwrap_or(usize::MAX);
                (!n.as_ref().is_some_and(|n| n.healthy), Reverse(numa), spread, id.to_string())
            });
            match next {
                Some(id) => chosen.push(id.to_string()),
                None => break,
            }
        }
        chosen
    }

    #[test]
    fn preferred_makes_the_reference_choice() {
        use proptest::prelude::*;
        let text = br#"{"resources": [{"name": "t", "devices": ["/nonexistent/t*"], "share": 3}]}"#;
        let (mut ok, _) = crate::devices::config::parse(text).unwrap();
        let res = Arc::new(ok.remove(0));
        // Nodes: (healthy, numa) for up to 6 devices; requests over their IDs plus strangers.
        let nodes = prop::collection::vec((any::<bool>(), prop::option::of(0i64..3)), 1..6);
        let case = nodes.prop_flat_map(|nodes| {
            let ids: Vec<String> = (0..nodes.len())
                .flat_map(|i| (0..3).map(move |k| format!("t{i}-{k}")))
                .chain(["x-0".to_string(), "t9-0".to_string()])
                .collect();
            let n = ids.len();
            (
                Just(nodes),
                prop::sample::subsequence(ids.clone(), 0..=n),
                prop::sample::subsequence(ids, 0..3),
                0usize..n + 2,
            )
        });
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config { cases: 2000, ..Default::default() });
        runner
            .run(&case, |(nodes, available, must, size)| {
                let p = Plugin::unscanned(res.clone());
                {
                    let mut m = p.nodes.lock().unwrap();
                    for (i, (healthy, numa)) in nodes.iter().enumerate() {
                        let path = PathBuf::from(format!("/nonexistent/t{i}"));
                        m.insert(path.clone(), Node { path, name: format!("t{i}"), healthy: *healthy, numa: *numa });
                    }
                }
                let must: Vec<String> = must.into_iter().filter(|m| available.contains(m)).collect();
                match p.preferred(&available, &must, size) {
                    Ok(got) => prop_assert_eq!(
                        got,
                        reference(&p, &available, &must, size),
                        "{:?} {:?} {:?} {}",
                        nodes,
                        available,
                        must,
                        size
                    ),
                    Err(e) => prop_assert!(must.len() > size || size > available.len(), "refused: {e:?}"),
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn ids_are_shortened_for_logs() {
        let long = "a".repeat(3 << 20);
        let s = short(&long);
        assert!(s.len() < 100 && s.contains("3145728 bytes"), "{s}");
        let many: Vec<String> = (0..1000).map(|i| format!("id-{i}")).collect();
        let s = summary(&many);
        assert!(s.contains("and 992 more") && s.len() < 200, "{s}");
        assert_eq!(summary(&["a".into()]), "[\"a\"]");
        // A multi-byte character at the cut is not split.
        let cut = short(&format!("a{}", "é".repeat(100)));
        assert!(cut.contains("201 bytes") && cut.starts_with("\"aé"), "{cut}");
    }
}
