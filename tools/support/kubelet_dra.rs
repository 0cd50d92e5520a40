//! A kubelet emulator for DRA drivers (test code): what kubelet's plugin watcher and DRA
//! manager do with a `DRAPlugin` registration socket in `plugins_registry/`.
//!
//! * every 50 ms (kubelet uses fsnotify), each socket that is new or was replaced (new inode
//!   or change time) is registered: `GetInfo`; the type must be `DRAPlugin` (other types are
//!   left to their handlers: ignored here); the supported versions must name
//!   `v1.DRAPlugin` (kubelet 1.34 picks v1 when offered, else `v1beta1.DRAPlugin`, which
//!   this emulator does not speak); the endpoint must be an absolute path that answers; then
//!   `NotifyRegistrationStatus` with the outcome. A socket that vanishes deregisters the
//!   driver (its health stream ends);
//! * with `v1alpha1.DRAResourceHealth` listed, it opens `NodeWatchResources` after
//!   registering and keeps the last health of every device; a stream that fails or ends is
//!   opened again every 5 s, as kubelet does;
//! * prepare and unprepare dial the endpoint as kubelet's DRA manager does (grpc-go:
//!   `:authority` `localhost`) and send the claims of one pod in one call;
//! * [`DraKubelet::stop`] and a new [`DraKubelet::start`] are a kubelet restart: the new
//!   instance starts from nothing and registers the sockets it finds.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nodeplane::rpc::dra as pb;
use nodeplane::rpc::drahealth as hpb;
use nodeplane::rpc::pluginregistration as reg;

pub const DRA_V1: &str = "v1.DRAPlugin";
pub const HEALTH_V1ALPHA1: &str = "v1alpha1.DRAResourceHealth";

/// One registered DRA driver.
#[derive(Debug, Clone)]
pub struct Registration {
    pub name: String,
    pub endpoint: PathBuf,
    pub versions: Vec<String>,
    /// The registration socket it came from and that socket's (inode, ctime s, ctime ns).
    pub socket: PathBuf,
    pub socket_id: (u64, i64, i64),
    pub at: Instant,
    /// Which instance (start) of this kubelet registered it.
    pub instance: u64,
}

#[derive(Default)]
struct State {
    registered: BTreeMap<PathBuf, Registration>,
    registrations: u32,
    failures: Vec<String>,
    /// driver → device → (health, message)
    health: BTreeMap<String, BTreeMap<String, (i32, String)>>,
    health_messages: u32,
    health_streams: BTreeMap<PathBuf, tokio::task::JoinHandle<()>>,
    /// Sockets of other plugin types (another handler's), by identity: not asked again.
    ignored: BTreeMap<PathBuf, (u64, i64, i64)>,
}

pub struct DraKubelet {
    registry_dir: PathBuf,
    state: Arc<Mutex<State>>,
    watcher: Option<tokio::task::JoinHandle<()>>,
    instance: u64,
}

fn socket_id(md: &std::fs::Metadata) -> (u64, i64, i64) {
    (md.ino(), md.ctime(), md.ctime_nsec())
}

impl DraKubelet {
    pub fn new(kubelet_dir: &Path) -> DraKubelet {
        DraKubelet {
            registry_dir: kubelet_dir.join("plugins_registry"),
            state: Arc::default(),
            watcher: None,
            instance: 0,
        }
    }

    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Start (or, after `stop`, restart) the plugin watcher: a new instance knowing nothing.
    pub fn start(&mut self) {
        assert!(self.watcher.is_none(), "kubelet emulator already running");
        self.instance += 1;
        *self.state.lock().unwrap() = State::default();
        let (dir, state, instance) = (self.registry_dir.clone(), self.state.clone(), self.instance);
        self.watcher = Some(tokio::spawn(async move {
            loop {
                sync(&dir, &state, instance).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }));
    }

    /// Stop: the watcher and every health stream end.
    pub fn stop(&mut self) {
        if let Some(w) = self.watcher.take() {
            w.abort();
        }
        let mut st = self.state.lock().unwrap();
        for (_, t) in std::mem::take(&mut st.health_streams) {
            t.abort();
        }
    }

    pub fn registration(&self, driver: &str) -> Option<Registration> {
        self.state.lock().unwrap().registered.values().find(|r| r.name == driver).cloned()
    }

    /// Every driver registered now.
    pub fn registrations_now(&self) -> Vec<Registration> {
        self.state.lock().unwrap().registered.values().cloned().collect()
    }

    pub fn registrations(&self) -> u32 {
        self.state.lock().unwrap().registrations
    }

    pub fn failures(&self) -> Vec<String> {
        self.state.lock().unwrap().failures.clone()
    }

    /// The last health kubelet heard of each device of `driver`.
    pub fn health(&self, driver: &str) -> BTreeMap<String, (i32, String)> {
        self.state.lock().unwrap().health.get(driver).cloned().unwrap_or_default()
    }

    pub fn health_messages(&self) -> u32 {
        self.state.lock().unwrap().health_messages
    }

    /// Wait until `driver` is registered by this instance.
    pub async fn wait_registered(&self, driver: &str, timeout: Duration) -> Result<Registration, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.registration(driver).filter(|r| r.instance == self.instance) {
                return Ok(r);
            }
            if Instant::now() >= deadline {
                return Err(format!("{driver} not registered within {timeout:?}; failures: {:?}", self.failures()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn client(
        &self,
        driver: &str,
    ) -> Result<pb::dra_plugin_client::DraPluginClient<tonic::transport::Channel>, String> {
        let r = self.registration(driver).ok_or_else(|| format!("{driver} is not registered"))?;
        let ch = nodeplane::rpc::connect_unix(&r.endpoint)
            .await
            .map_err(|e| format!("dialing {}: {e}", r.endpoint.display()))?;
        Ok(pb::dra_plugin_client::DraPluginClient::new(ch))
    }

    /// NodePrepareResources for one pod's claims (namespace, name, uid).
    pub async fn prepare(
        &self,
        driver: &str,
        claims: &[(&str, &str, &str)],
    ) -> Result<BTreeMap<String, pb::NodePrepareResourceResponse>, String> {
        let req = pb::NodePrepareResourcesRequest { claims: claims.iter().map(|c| claim(*c)).collect() };
        let r = self
            .client(driver)
            .await?
            .node_prepare_resources(req)
            .await
            .map_err(|s| format!("NodePrepareResources: {s}"))?;
        Ok(r.into_inner().claims.into_iter().collect())
    }

    pub async fn unprepare(
        &self,
        driver: &str,
        claims: &[(&str, &str, &str)],
    ) -> Result<BTreeMap<String, pb::NodeUnprepareResourceResponse>, String> {
        let req = pb::NodeUnprepareResourcesRequest { claims: claims.iter().map(|c| claim(*c)).collect() };
        let r = self
            .client(driver)
            .await?
            .node_unprepare_resources(req)
            .await
            .map_err(|s| format!("NodeUnprepareResources: {s}"))?;
        Ok(r.into_inner().claims.into_iter().collect())
    }
}

impl Drop for DraKubelet {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn claim((namespace, name, uid): (&str, &str, &str)) -> pb::Claim {
    pb::Claim { namespace: namespace.into(), name: name.into(), uid: uid.into() }
}

async fn sync(dir: &Path, state: &Arc<Mutex<State>>, instance: u64) {
    let mut seen: Vec<(PathBuf, (u64, i64, i64))> = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if let Ok(md) = e.metadata()
                && md.file_type().is_socket()
            {
                seen.push((e.path(), socket_id(&md)));
            }
        }
    }
    {
        let mut st = state.lock().unwrap();
        st.ignored.retain(|p, id| seen.iter().any(|(sp, sid)| sp == p && sid == id));
        let gone: Vec<PathBuf> = st
            .registered
            .iter()
            .filter(|(p, r)| !seen.iter().any(|(sp, id)| sp == *p && *id == r.socket_id))
            .map(|(p, _)| p.clone())
            .collect();
        for p in gone {
            if let Some(r) = st.registered.remove(&p) {
                st.health.remove(&r.name);
            }
            if let Some(t) = st.health_streams.remove(&p) {
                t.abort();
            }
        }
    }
    for (path, id) in seen {
        let known = {
            let st = state.lock().unwrap();
            st.registered.get(&path).is_some_and(|r| r.socket_id == id) || st.ignored.get(&path) == Some(&id)
        };
        let failed_before =
            state.lock().unwrap().failures.iter().any(|f| f.starts_with(&format!("{} {id:?}:", path.display())));
        if known || failed_before {
            continue;
        }
        match register(&path, id, instance).await {
            Ok(Some(r)) => {
                let mut st = state.lock().unwrap();
                st.registrations += 1;
                if r.versions.iter().any(|v| v == HEALTH_V1ALPHA1) {
                    let t = tokio::spawn(watch_health(r.name.clone(), r.endpoint.clone(), state.clone()));
                    st.health_streams.insert(path.clone(), t);
                }
                st.registered.insert(path, r);
            }
            Ok(None) => {
                state.lock().unwrap().ignored.insert(path, id);
            }
            Err(e) => state.lock().unwrap().failures.push(format!("{} {id:?}: {e}", path.display())),
        }
    }
}

/// One registration; `None` for a socket of another plugin type.
async fn register(socket: &Path, id: (u64, i64, i64), instance: u64) -> Result<Option<Registration>, String> {
    let authority = Some(nodeplane::rpc::authority::percent_encoded_path(socket));
    let ch = nodeplane::rpc::authority::connect_unix_with_authority(socket, authority)
        .await
        .map_err(|e| format!("dialing: {e}"))?;
    let mut rc = reg::registration_client::RegistrationClient::new(ch);
    let info = rc.get_info(reg::InfoRequest {}).await.map_err(|e| format!("GetInfo: {e}"))?.into_inner();
    if info.r#type != "DRAPlugin" {
        return Ok(None);
    }
    let outcome = async {
        if !info.supported_versions.iter().any(|v| v == DRA_V1) {
            return Err(format!("none of the versions {:?} is {DRA_V1}", info.supported_versions));
        }
        let endpoint = PathBuf::from(&info.endpoint);
        if !endpoint.is_absolute() {
            return Err(format!("endpoint {:?} is not an absolute path", info.endpoint));
        }
        nodeplane::rpc::connect_unix(&endpoint)
            .await
            .map_err(|e| format!("dialing endpoint {}: {e}", endpoint.display()))?;
        Ok(Registration {
            name: info.name.clone(),
            endpoint,
            versions: info.supported_versions.clone(),
            socket: socket.to_path_buf(),
            socket_id: id,
            at: Instant::now(),
            instance,
        })
    }
    .await;
    let status = match &outcome {
        Ok(_) => reg::RegistrationStatus { plugin_registered: true, error: String::new() },
        Err(e) => reg::RegistrationStatus { plugin_registered: false, error: e.clone() },
    };
    rc.notify_registration_status(status).await.map_err(|e| format!("NotifyRegistrationStatus: {e}"))?;
    outcome.map(Some)
}

async fn watch_health(driver: String, endpoint: PathBuf, state: Arc<Mutex<State>>) {
    loop {
        if let Ok(ch) = nodeplane::rpc::connect_unix(&endpoint).await {
            let mut c = hpb::dra_resource_health_client::DraResourceHealthClient::new(ch);
            if let Ok(r) = c.node_watch_resources(hpb::NodeWatchResourcesRequest {}).await {
                let mut stream = r.into_inner();
                while let Ok(Some(m)) = stream.message().await {
                    let mut st = state.lock().unwrap();
                    st.health_messages += 1;
                    let h = st.health.entry(driver.clone()).or_default();
                    for d in m.devices {
                        if let Some(id) = d.device {
                            h.insert(id.device_name, (d.health, d.message));
                        }
                    }
                }
            }
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}
