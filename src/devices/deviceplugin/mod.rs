//! The agent as kubelet device plugin for every device class the device file configures.
//!
//! Per resource: its own gRPC server on `<kubelet>/device-plugins/nodeplane-<name>.sock`
//! (0600), served before it registers with kubelet (`kubelet.sock` there). One event loop
//! watches, with inotify (no polling for events): the device file (reload), the directories
//! of every device pattern (hot-plug, removal → health), and the device-plugins directory
//! (kubelet restarted: `kubelet.sock` created again → register again; our own socket
//! removed → serve it again and register). Registration failures are retried with backoff
//! while kubelet is away. A slow timer (2 s) re-checks health for changes that make no
//! inotify event (a node that cannot be opened any more).

pub mod plugin;

use crate::devices::config;

use std::collections::{BTreeMap, HashSet};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use crate::rpc::deviceplugin as pb;
use crate::rpc::node as api;
use config::Resource;
use plugin::Plugin;

pub const KUBELET_SOCKET: &str = "kubelet.sock";
pub const API_VERSION: &str = "v1beta1";

/// Where things are.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The device file (missing: no resources until it appears).
    pub config_file: PathBuf,
    /// `<kubelet>/device-plugins`
    pub plugin_dir: PathBuf,
    /// CDI spec directory.
    pub cdi_dir: PathBuf,
}

struct Running {
    plugin: Arc<Plugin>,
    stop: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    /// Registered with the kubelet instance behind the current kubelet.sock.
    registered: bool,
    next_attempt: Instant,
    backoff: Duration,
}

pub struct Manager {
    s: Settings,
    plugins: BTreeMap<String, Running>,
    /// Last successfully loaded configuration.
    resources: Vec<Resource>,
    inventory: Inventory,
    /// What kubelet answered each plugin's registration.
    book: crate::kubelet::Registrations,
}

/// The plugins being served, shared read-only with the metrics collector (the manager
/// updates it whenever it starts or stops a plugin).
#[derive(Clone, Default)]
pub struct Inventory(Arc<std::sync::Mutex<Vec<Arc<Plugin>>>>);

/// One served resource's device IDs (as advertised to kubelet: a device shared N ways
/// counts N times) by health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceHealth {
    pub resource: String,
    pub healthy: usize,
    pub unhealthy: usize,
}

impl Inventory {
    pub fn health(&self) -> Vec<ResourceHealth> {
        let plugins = self.0.lock().unwrap().clone();
        plugins
            .iter()
            .map(|p| {
                let devices = p.devices();
                let healthy = devices.iter().filter(|d| d.health == plugin::HEALTHY).count();
                ResourceHealth { resource: p.res.resource_name(), healthy, unhealthy: devices.len() - healthy }
            })
            .collect()
    }

    /// Every served resource with its socket and its devices as advertised, for
    /// `nodeplane status`.
    pub fn report(&self) -> api::DevicePlugins {
        let plugins = self.0.lock().unwrap().clone();
        api::DevicePlugins {
            plugins: plugins
                .iter()
                .map(|p| api::DevicePlugin {
                    resource: p.res.resource_name(),
                    socket: p.res.socket_name(),
                    devices: p.devices().iter().map(|d| api::PluginDevice { id: d.id.clone(), healthy: d.health == plugin::HEALTHY }).collect(),
                })
                .collect(),
        }
    }

    fn set(&self, plugins: Vec<Arc<Plugin>>) {
        *self.0.lock().unwrap() = plugins;
    }
}

fn cdi_path(s: &Settings, r: &Resource) -> PathBuf {
    crate::devices::cdi::spec_path(&s.cdi_dir, r)
}

impl Manager {
    pub fn new(s: Settings) -> Self {
        Self::with_inventory(s, Inventory::default(), crate::kubelet::Registrations::default())
    }

    pub fn with_inventory(s: Settings, inventory: Inventory, book: crate::kubelet::Registrations) -> Self {
        Manager { s, plugins: BTreeMap::new(), resources: Vec::new(), inventory, book }
    }

    fn publish_inventory(&self) {
        self.inventory.set(self.plugins.values().map(|r| r.plugin.clone()).collect());
    }

    fn socket_path(&self, r: &Resource) -> PathBuf {
        self.s.plugin_dir.join(r.socket_name())
    }

    /// Read the device file; start, restart and stop plugins to match it. A file that
    /// cannot be used at all keeps the running set; bad entries are reported and skipped.
    fn reload(&mut self) {
        let wanted = match std::fs::read(&self.s.config_file) {
            Ok(b) => match config::parse(&b) {
                Ok((ok, problems)) => {
                    for p in &problems {
                        tracing::error!(file = %self.s.config_file.display(), "invalid device plugin entry, skipped: {p}");
                    }
                    ok
                }
                Err(e) => {
                    tracing::error!(file = %self.s.config_file.display(), error = %e, "device file unusable; keeping the current device plugins");
                    return;
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                tracing::error!(file = %self.s.config_file.display(), error = %e, "reading the device file; keeping the current device plugins");
                return;
            }
        };
        if wanted == self.resources && wanted.iter().all(|r| self.plugins.contains_key(&r.name)) {
            return;
        }
        // Stop what is gone or changed.
        let keep: Vec<String> = self
            .plugins
            .keys()
            .filter(|n| wanted.iter().any(|r| &r.name == *n && Some(r) == self.resources.iter().find(|o| &o.name == *n)))
            .cloned()
            .collect();
        let stale: Vec<String> = self.plugins.keys().filter(|n| !keep.contains(n)).cloned().collect();
        for name in stale {
            if let Some(r) = self.plugins.remove(&name) {
                let res = r.plugin.res.clone();
                self.stop_plugin(r);
                self.book.withdrawn(&res.resource_name());
                let _ = std::fs::remove_file(self.socket_path(&res));
                if !wanted.iter().any(|w| w.name == name && w.cdi) {
                    let _ = std::fs::remove_file(cdi_path(&self.s, &res));
                }
                tracing::info!(resource = %res.resource_name(), "device plugin stopped");
            }
        }
        self.resources = wanted.clone();
        for r in wanted {
            if !self.plugins.contains_key(&r.name) {
                self.start_plugin(Arc::new(r));
            }
        }
        self.publish_inventory();
    }

    fn stop_plugin(&self, r: Running) {
        let _ = r.stop.send(true);
        r.server.abort();
    }

    /// Serve a plugin's socket (before any registration).
    fn start_plugin(&mut self, res: Arc<Resource>) {
        let plugin = Plugin::new(res.clone());
        self.write_cdi(&plugin);
        let sock = self.socket_path(&res);
        let (stop, stop_rx) = watch::channel(false);
        let server = match serve(plugin.clone(), &sock, stop_rx) {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(resource = %res.resource_name(), socket = %sock.display(), error = %e, "cannot serve device plugin");
                return;
            }
        };
        tracing::info!(resource = %res.resource_name(), socket = %sock.display(), devices = plugin.devices().len(), "device plugin serving");
        self.book.served(crate::kubelet::Kind::DevicePlugin, &res.resource_name(), self.s.plugin_dir.join(KUBELET_SOCKET));
        self.plugins.insert(
            res.name.clone(),
            Running { plugin, stop, server, registered: false, next_attempt: Instant::now(), backoff: Duration::from_millis(100) },
        );
    }

    fn write_cdi(&self, p: &Plugin) {
        if !p.res.cdi {
            return;
        }
        let path = cdi_path(&self.s, &p.res);
        let body = serde_json::to_vec_pretty(&p.cdi_spec()).expect("CDI spec serialises");
        if let Err(e) = std::fs::create_dir_all(&self.s.cdi_dir).and_then(|_| crate::sys::fs::atomic_write(&path, &body, 0o644)) {
            tracing::error!(file = %path.display(), error = %e, "writing CDI spec");
        }
    }

    /// Register every plugin not registered yet whose retry time has come.
    async fn register_due(&mut self) {
        let kubelet = self.s.plugin_dir.join(KUBELET_SOCKET);
        let now = Instant::now();
        let due: Vec<String> = self.plugins.iter().filter(|(_, r)| !r.registered && r.next_attempt <= now).map(|(k, _)| k.clone()).collect();
        for name in due {
            let res = self.plugins[&name].plugin.res.clone();
            let outcome = match tokio::time::timeout(Duration::from_secs(3), register(&kubelet, &res)).await {
                Ok(r) => r,
                Err(_) => Err(RegisterError::Unreachable("Register timed out after 3 s".to_string())),
            };
            let r = self.plugins.get_mut(&name).expect("still running");
            match outcome {
                Ok(()) => {
                    r.registered = true;
                    r.backoff = Duration::from_millis(100);
                    tracing::info!(resource = %res.resource_name(), "device plugin registered with kubelet");
                    self.book.registered(&res.resource_name());
                }
                Err(err) => {
                    match &err {
                        RegisterError::Refused(m) => {
                            // Said once per refusal, not on every retry.
                            if self.book.state(&res.resource_name()) != Some(crate::kubelet::State::Refused(m.clone())) {
                                tracing::warn!(resource = %res.resource_name(), error = %m, "kubelet refused the device plugin registration; retrying");
                            }
                            self.book.refused(&res.resource_name(), m.clone());
                        }
                        RegisterError::Unreachable(m) => self.book.unreachable(&res.resource_name(), m.clone()),
                    }
                    let msg = err.to_string();
                    tracing::debug!(resource = %res.resource_name(), error = %msg, backoff_ms = r.backoff.as_millis() as u64, "registration failed; retrying");
                    r.next_attempt = Instant::now() + r.backoff;
                    r.backoff = (r.backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }

    fn rescan(&mut self, only_dir: Option<&Path>) {
        let mut changed = Vec::new();
        for (name, r) in &self.plugins {
            if only_dir.is_some_and(|d| !r.plugin.res.patterns.iter().any(|p| p.dir == d)) {
                continue;
            }
            if r.plugin.rescan() {
                changed.push(name.clone());
            }
        }
        for name in changed {
            let p = self.plugins[&name].plugin.clone();
            self.write_cdi(&p);
        }
    }

    /// Our socket for `file_name` vanished: serve it again and register again.
    fn socket_removed(&mut self, file_name: &str) {
        let Some(name) = self.plugins.iter().find(|(_, r)| r.plugin.res.socket_name() == file_name).map(|(k, _)| k.clone()) else {
            return;
        };
        if self.socket_path(&self.plugins[&name].plugin.res).exists() {
            return;
        }
        let r = self.plugins.remove(&name).expect("present");
        let res = r.plugin.res.clone();
        self.stop_plugin(r);
        tracing::warn!(resource = %res.resource_name(), "device plugin socket removed; serving it again");
        self.start_plugin(res);
        self.publish_inventory();
    }

    fn kubelet_restarted(&mut self) {
        tracing::info!("kubelet.sock (re)created: registering every device plugin again");
        self.book.kubelet_restarted(crate::kubelet::Kind::DevicePlugin);
        for r in self.plugins.values_mut() {
            r.registered = false;
            r.next_attempt = Instant::now();
            // kubelet creates its socket (bind) a moment before it accepts (listen): a
            // refused first attempt is retried after 10 ms, not after the 100 ms used while
            // kubelet is absent.
            r.backoff = Duration::from_millis(10);
        }
    }

    /// When the next registration retry is due, if any plugin waits for one.
    fn next_attempt(&self) -> Option<Instant> {
        self.plugins.values().filter(|r| !r.registered).map(|r| r.next_attempt).min()
    }

    /// Directories to watch: the device file's, the plugin dir, every pattern's.
    fn watch_dirs(&self) -> Vec<PathBuf> {
        let mut d: Vec<PathBuf> = vec![self.s.plugin_dir.clone()];
        if let Some(p) = self.s.config_file.parent() {
            d.push(p.to_path_buf());
        }
        for r in &self.resources {
            for p in &r.patterns {
                d.push(p.dir.clone());
            }
        }
        d.sort();
        d.dedup();
        d
    }
}

/// Bind and serve one plugin's socket.
fn serve(plugin: Arc<Plugin>, sock: &Path, stop: watch::Receiver<bool>) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = crate::sys::fs::bind_unix_socket(sock)?;
    let svc = plugin::Service { plugin, stop: stop.clone() };
    let mut stop2 = stop;
    Ok(tokio::spawn(async move {
        let r = tonic::transport::Server::builder()
            .layer(crate::rpc::response_layer())
            .add_service(pb::device_plugin_server::DevicePluginServer::new(svc))
            .serve_with_incoming_shutdown(crate::rpc::authority::incoming(listener), async move {
                let _ = stop2.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "device plugin server ended");
        }
    }))
}

/// Why a registration did not happen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum RegisterError {
    /// kubelet is not there (no socket, nothing listening, no answer in time).
    #[error("{0}")]
    Unreachable(String),
    /// kubelet answered Register with an error.
    #[error("{0}")]
    Refused(String),
}

async fn register(kubelet: &Path, res: &Resource) -> Result<(), RegisterError> {
    if !kubelet.exists() {
        return Err(RegisterError::Unreachable(format!("{} does not exist (kubelet not running, or it uses another device plugin directory)", kubelet.display())));
    }
    let ch = crate::rpc::connect_unix(kubelet).await.map_err(|e| RegisterError::Unreachable(format!("connecting to kubelet at {}: {e}", kubelet.display())))?;
    pb::registration_client::RegistrationClient::new(ch)
        .register(pb::RegisterRequest {
            version: API_VERSION.into(),
            endpoint: res.socket_name(),
            resource_name: res.resource_name(),
            options: Some(pb::DevicePluginOptions { pre_start_required: res.pre_start, get_preferred_allocation_available: true }),
        })
        .await
        .map(|_| ())
        .map_err(|s| {
            let msg = format!("Register: {:?}: {}", s.code(), s.message());
            // A transport failure is kubelet not being there; any answer from it is a refusal.
            if s.code() == tonic::Code::Unavailable || s.code() == tonic::Code::Unknown && s.message().contains("transport") {
                RegisterError::Unreachable(msg)
            } else {
                RegisterError::Refused(msg)
            }
        })
}

/// Run the device plugins until `shutdown` turns true; then stop them and remove their
/// sockets.
pub async fn run(s: Settings, shutdown: watch::Receiver<bool>) {
    run_with(s, shutdown, Inventory::default(), crate::kubelet::Registrations::default()).await
}

/// [`run`], keeping `inventory` up to date with the plugins served and `book` with what
/// kubelet answered their registrations.
pub async fn run_with(s: Settings, mut shutdown: watch::Receiver<bool>, inventory: Inventory, book: crate::kubelet::Registrations) {
    if let Err(e) = std::fs::create_dir_all(&s.plugin_dir) {
        tracing::error!(dir = %s.plugin_dir.display(), error = %e, "device plugins disabled: cannot create the plugin dir");
        return;
    }
    let inotify = match Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) {
        Ok(i) => i,
        Err(e) => {
            tracing::error!(error = %e, "device plugins disabled: inotify");
            return;
        }
    };
    // SAFETY: `inotify` owns the descriptor and outlives `afd` (declared after it, so
    // dropped first); the raw fd stays the same open inotify instance meanwhile.
    let afd = match unsafe { AsyncFd::register_with_interest(inotify.as_fd().as_raw_fd(), tokio::io::Interest::READABLE) } {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(error = %e, "device plugins disabled: inotify fd");
            return;
        }
    };
    let mut m = Manager::with_inventory(s.clone(), inventory, book);
    m.reload();
    let mut watched: BTreeMap<PathBuf, nix::sys::inotify::WatchDescriptor> = BTreeMap::new();
    let flags = AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_ATTRIB;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_health = Instant::now();
    loop {
        // Keep the watch set in step with the configuration (directories can appear later).
        for d in m.watch_dirs() {
            if !watched.contains_key(&d)
                && let Ok(wd) = inotify.add_watch(&d, flags)
            {
                watched.insert(d, wd);
                // Anything that happened before the watch existed.
                m.rescan(None);
            }
        }
        m.register_due().await;
        let retry = m.next_attempt();
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            // A registration retry wakes the loop at its time, not at the next tick.
            _ = async {
                match retry {
                    Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                    None => std::future::pending().await,
                }
            } => {}
            ready = afd.readable() => {
                let mut guard = match ready { Ok(g) => g, Err(_) => break };
                let events = match inotify.read_events() {
                    Ok(ev) => ev,
                    Err(nix::errno::Errno::EAGAIN) => { guard.clear_ready(); continue }
                    Err(e) => { tracing::warn!(error = %e, "inotify read"); guard.clear_ready(); continue }
                };
                guard.clear_ready();
                let mut reload = false;
                let mut kubelet = false;
                let mut removed_sockets = HashSet::new();
                let mut dirs = HashSet::new();
                for ev in events {
                    if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                        watched.retain(|_, wd| *wd != ev.wd);
                        continue;
                    }
                    let Some(dir) = watched.iter().find(|(_, wd)| **wd == ev.wd).map(|(d, _)| d.clone()) else { continue };
                    let name = ev.name.as_ref().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    // Any change in the device file's directory: the file itself, or a
                    // Kubernetes ConfigMap volume swapping its `..data` symlink (the file's
                    // own path never changes then). A reload that finds the same devices
                    // changes nothing.
                    if Some(dir.as_path()) == s.config_file.parent() {
                        reload = true;
                    }
                    if dir == s.plugin_dir {
                        if name == KUBELET_SOCKET && ev.mask.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
                            kubelet = true;
                        }
                        if ev.mask.intersects(AddWatchFlags::IN_DELETE | AddWatchFlags::IN_MOVED_FROM) {
                            removed_sockets.insert(name.clone());
                        }
                    }
                    dirs.insert(dir);
                }
                if reload {
                    m.reload();
                }
                for name in removed_sockets {
                    m.socket_removed(&name);
                }
                if kubelet {
                    m.kubelet_restarted();
                }
                for d in dirs {
                    m.rescan(Some(&d));
                }
            }
            _ = tick.tick() => {
                if last_health.elapsed() >= Duration::from_secs(2) {
                    m.rescan(None);
                    last_health = Instant::now();
                }
            }
        }
    }
    m.inventory.set(Vec::new());
    for (_, r) in std::mem::take(&mut m.plugins) {
        let res = r.plugin.res.clone();
        let _ = r.stop.send(true);
        let _ = r.server.await;
        let _ = std::fs::remove_file(m.socket_path(&res));
    }
    tracing::info!("device plugins stopped");
}
