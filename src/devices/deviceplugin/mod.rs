//! The agent as kubelet device plugin for every device class the device file configures.
//!
//! One task per resource owns everything of that resource: its gRPC server on
//! `<kubelet>/device-plugins/nodeplane-<name>.sock` (0600, served before it registers), its
//! registration with kubelet (`kubelet.sock` there), its device scans and health, its CDI
//! spec. A slow or hung kubelet, or a slow call, delays only that resource. The manager only
//! routes events to the tasks: inotify on the device file (reload: start and stop tasks),
//! on every device pattern's directory (hot-plug, removal → a rescan of the resources
//! concerned) and on the device-plugins directory (a socket came or went → the tasks check).
//!
//! Registration: exactly one successful Register per resource per kubelet instance. A
//! kubelet instance is told by its `kubelet.sock` (device, inode and change time: a
//! restarted kubelet binds a new one); a re-served plugin socket is a new plugin instance
//! and registers again. Never a second attempt while one is in flight; failures retry with
//! backoff (10 ms doubling to 200 ms while `kubelet.sock` exists). Each task also checks its
//! own socket and `kubelet.sock` every 200 ms without any event, so a removed directory, a
//! replaced `kubelet.sock` or a stale socket is recovered even when inotify missed it.

pub mod plugin;

use crate::devices::{SockId, config, sock_id, stop_task, stopped};

use std::collections::{BTreeMap, HashSet};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use tokio::io::unix::AsyncFd;
use tokio::sync::{Notify, watch};

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

/// How often each resource checks its socket and `kubelet.sock` with no event.
const BACKSTOP: Duration = Duration::from_millis(200);
/// How often each resource re-judges its devices' health with no event (a node that
/// cannot be opened any more makes none).
const HEALTH_EVERY: Duration = Duration::from_secs(2);
/// A Register kubelet has not answered by then is abandoned and tried again.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(30);
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_millis(200);
/// A kubelet that answers and refuses is asked again at most this often (its log records
/// every Register).
const REFUSED_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A socket that cannot be bound (a file in the way, a full disk) is retried at most this often.
const SERVE_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// A running resource, as the manager holds it.
struct Handle {
    plugin: Arc<Plugin>,
    /// Asks the task to look at the sockets now (something changed in the device-plugins
    /// directory). A rescan is asked through `Plugin::rescan_wanted` (a pattern's directory
    /// changed, or Allocate found a device gone bad). Both coalesce: any number of requests
    /// before the task looks is one.
    check: Arc<Notify>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
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
                    devices: p
                        .devices()
                        .iter()
                        .map(|d| api::PluginDevice { id: d.id.clone(), healthy: d.health == plugin::HEALTHY })
                        .collect(),
                })
                .collect(),
        }
    }

    fn set(&self, plugins: Vec<Arc<Plugin>>) {
        *self.0.lock().unwrap() = plugins;
    }
}

fn cdi_path(s: &Settings, r: &Resource) -> PathBuf {
    crate::devices::cdi::spec_path(&s.cdi_dir, &r.name)
}

/// The resources served as device plugins: those offered through DRA only are not (the
/// DRA driver hands them out; see `config::Offer`). Readiness counts the same set.
pub fn offered_here(resources: Vec<Resource>) -> Vec<Resource> {
    resources.into_iter().filter(|r| r.offer == config::Offer::DevicePlugin).collect()
}

/// The manager: the configured resources and their tasks.
struct Manager {
    s: Settings,
    handles: BTreeMap<String, Handle>,
    /// Last successfully loaded configuration.
    resources: Vec<Resource>,
    inventory: Inventory,
    /// What kubelet answered each plugin's registration.
    book: crate::kubelet::Registrations,
}

impl Manager {
    fn publish_inventory(&self) {
        self.inventory.set(self.handles.values().map(|h| h.plugin.clone()).collect());
    }

    /// Read the device file; start, restart and stop resource tasks to match it. A file
    /// that cannot be used at all keeps the running set; bad entries are reported and skipped.
    async fn reload(&mut self) {
        let wanted = match config::load(&self.s.config_file) {
            Ok((ok, problems)) => {
                for p in &problems {
                    tracing::error!(file = %self.s.config_file.display(), "invalid device plugin entry, skipped: {p}");
                }
                offered_here(ok)
            }
            Err(config::LoadError::Parse(e)) => {
                tracing::error!(file = %self.s.config_file.display(), error = %e, "device file unusable; keeping the current device plugins");
                return;
            }
            Err(config::LoadError::Read(e)) => {
                tracing::error!(file = %self.s.config_file.display(), error = %e, "reading the device file; keeping the current device plugins");
                return;
            }
        };
        if wanted == self.resources && wanted.iter().all(|r| self.handles.contains_key(&r.name)) {
            return;
        }
        // Stop what is gone or changed (and wait: a changed resource's new task binds the
        // same socket path).
        let stale: Vec<String> = self
            .handles
            .keys()
            .filter(|n| {
                !wanted.iter().any(|r| &r.name == *n && Some(r) == self.resources.iter().find(|o| &o.name == *n))
            })
            .cloned()
            .collect();
        let stopping: Vec<Handle> = stale.iter().filter_map(|n| self.handles.remove(n)).collect();
        let gone: Vec<Arc<Resource>> = stopping.iter().map(|h| h.plugin.res.clone()).collect();
        stop(stopping).await;
        for res in gone {
            self.book.withdrawn(&res.resource_name());
            if !wanted.iter().any(|w| w.name == res.name && w.cdi) {
                let _ = std::fs::remove_file(cdi_path(&self.s, &res));
            }
            tracing::info!(resource = %res.resource_name(), "device plugin stopped");
        }
        self.resources = wanted.clone();
        for r in wanted {
            if !self.handles.contains_key(&r.name) {
                let plugin = Plugin::unscanned(Arc::new(r));
                let check = Arc::new(Notify::new());
                let (stop, stop_rx) = watch::channel(false);
                let task =
                    Task { s: self.s.clone(), book: self.book.clone(), plugin: plugin.clone(), check: check.clone() };
                let task = tokio::spawn(task.run(stop_rx));
                self.handles.insert(plugin.res.name.clone(), Handle { plugin, check, stop, task });
            }
        }
        self.publish_inventory();
    }

    /// Ask every task to look at the sockets.
    fn check_all(&self) {
        for h in self.handles.values() {
            h.check.notify_one();
        }
    }

    /// Ask the tasks with a pattern in `dir` to rescan.
    fn rescan(&self, dir: &Path) {
        for h in self.handles.values().filter(|h| h.plugin.res.patterns.iter().any(|p| p.dir == dir)) {
            h.plugin.rescan_wanted.notify_one();
        }
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

/// Stop resource tasks (all at once) and wait for them: each stops its server and removes
/// its socket. One that does not end within 5 s is aborted, so it cannot serve (or remove)
/// a path its successor has bound.
async fn stop(handles: Vec<Handle>) {
    for h in &handles {
        let _ = h.stop.send(true);
    }
    for h in handles {
        if !stop_task(&h.stop, h.task, Duration::from_secs(5)).await {
            tracing::warn!(resource = %h.plugin.res.resource_name(), "device plugin task did not stop within 5 s; aborted");
        }
    }
}

/// A served plugin socket.
struct Served {
    id: SockId,
    stop: watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

/// The CDI spec file of a resource, as last written (or found) by its task.
struct CdiFile {
    path: PathBuf,
    last: Option<Vec<u8>>,
}

impl CdiFile {
    /// Write the spec when its content changed (validated first; an unchanged spec is not
    /// rewritten, also not after a restart of the plugin or the agent); remove the file
    /// when there is no device (a CDI file must list one).
    fn sync(&mut self, cdi_dir: &Path, p: &Plugin) {
        let Some(spec) = p.cdi_spec() else {
            if self.last.take().is_some() || self.path.exists() {
                let _ = std::fs::remove_file(&self.path);
            }
            return;
        };
        if let Err(e) = crate::devices::cdi::validate(&spec) {
            tracing::error!(file = %self.path.display(), "CDI spec not written: {e}");
            return;
        }
        let body = serde_json::to_vec_pretty(&spec).expect("CDI spec serialises");
        if self.last.is_none() || !self.path.exists() {
            // First look, or the file went behind our back: what is there now.
            self.last = std::fs::read(&self.path).ok();
        }
        if self.last.as_deref() == Some(body.as_slice()) {
            return;
        }
        match std::fs::create_dir_all(cdi_dir).and_then(|_| crate::sys::fs::atomic_write(&self.path, &body, 0o644)) {
            Ok(()) => self.last = Some(body),
            Err(e) => tracing::error!(file = %self.path.display(), error = %e, "writing CDI spec"),
        }
    }
}

/// One resource's task: see the module comment.
struct Task {
    s: Settings,
    book: crate::kubelet::Registrations,
    plugin: Arc<Plugin>,
    check: Arc<Notify>,
}

/// A registration in flight; it yields the `kubelet.sock` seen once connected (the instance
/// it reached).
type Attempt = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Option<SockId>, RegisterError>> + Send>>;

impl Task {
    /// Rescan the devices and bring the CDI spec up to date, on a blocking thread.
    async fn refresh(&self, cdi: &mut Option<CdiFile>) {
        let plugin = self.plugin.clone();
        let dir = self.s.cdi_dir.clone();
        let mut file = cdi.take();
        let back = tokio::task::spawn_blocking(move || {
            plugin.rescan_then(|p| {
                if let Some(f) = file.as_mut() {
                    f.sync(&dir, p);
                }
            });
            file
        })
        .await;
        *cdi = back.unwrap_or_else(|e| {
            tracing::error!(resource = %self.plugin.res.resource_name(), error = %e, "device rescan failed");
            self.plugin.res.cdi.then(|| CdiFile { path: cdi_path(&self.s, &self.plugin.res), last: None })
        });
    }

    async fn run(self, mut stop: watch::Receiver<bool>) {
        let res = self.plugin.res.clone();
        let name = res.resource_name();
        let sock = self.s.plugin_dir.join(res.socket_name());
        let kubelet = self.s.plugin_dir.join(KUBELET_SOCKET);
        let mut cdi = res.cdi.then(|| CdiFile { path: cdi_path(&self.s, &res), last: None });
        self.refresh(&mut cdi).await;
        let mut served: Option<Served> = None;
        let mut serve_error: Option<String> = None;
        // The kubelet instance this plugin instance is registered with.
        let mut registered: Option<SockId> = None;
        let mut attempt: Option<Attempt> = None;
        let mut next_attempt = Instant::now();
        let mut backoff = BACKOFF_MIN;
        let mut serve_at = Instant::now();
        let mut serve_backoff = BACKOFF_MIN;
        let mut said_absent = false;
        let mut last_health = Instant::now();
        loop {
            // The kubelet instance behind kubelet.sock, read before our own socket: a kubelet
            // deletes the plugin sockets before it serves a new kubelet.sock, so a new
            // instance seen here implies that the check of our socket below sees the
            // deletion too. Read the other way round, a restart between the two reads had us
            // register a socket that was gone (kubelet refused it: its dial failed).
            let instance = sock_id(&kubelet);
            // Our socket: served, and the one we bound (removed or replaced → serve again:
            // a new plugin instance, which registers again).
            let ours = sock_id(&sock);
            if served.as_ref().is_some_and(|s| Some(s.id) != ours) {
                let old = served.take().expect("checked");
                let _ = old.stop.send(true);
                old.server.abort();
                tracing::warn!(resource = %name, socket = %sock.display(), "device plugin socket removed or replaced; serving it again");
                registered = None;
                // An attempt in flight was for the old socket: kubelet could not use it.
                attempt = None;
                self.book.waiting(&name);
            }
            if served.is_none() && Instant::now() >= serve_at {
                match serve(self.plugin.clone(), &sock) {
                    Ok(s) => {
                        tracing::info!(resource = %name, socket = %sock.display(), devices = self.plugin.advertised(), "device plugin serving");
                        self.book.served(crate::kubelet::Kind::DevicePlugin, &name, kubelet.clone());
                        served = Some(s);
                        serve_error = None;
                        serve_backoff = BACKOFF_MIN;
                        said_absent = false;
                        next_attempt = Instant::now();
                        backoff = BACKOFF_MIN;
                    }
                    Err(e) => {
                        let e = e.to_string();
                        if serve_error.as_ref() != Some(&e) {
                            tracing::error!(resource = %name, socket = %sock.display(), error = %e, "cannot serve device plugin; retrying");
                            serve_error = Some(e);
                        }
                        serve_at = Instant::now() + serve_backoff;
                        serve_backoff = (serve_backoff * 2).min(SERVE_BACKOFF_MAX);
                    }
                }
            }
            // kubelet: registered with the instance behind kubelet.sock now?
            if registered.is_some() && registered != instance {
                tracing::info!(resource = %name, "kubelet.sock replaced (kubelet restarted): registering again");
                registered = None;
                self.book.waiting(&name);
                next_attempt = Instant::now();
                backoff = BACKOFF_MIN;
            }
            // An attempt in flight is never dropped for a new kubelet.sock: it may have
            // reached the new kubelet, which would then see a second Register. It ends when
            // the kubelet it reached answers or goes; its outcome says which one it was.
            if served.is_some() && registered.is_none() && attempt.is_none() {
                match instance {
                    None if !said_absent => {
                        self.book.unreachable(
                            &name,
                            format!(
                                "{} does not exist (kubelet not running, or it uses another device plugin directory)",
                                kubelet.display()
                            ),
                        );
                        said_absent = true;
                    }
                    Some(_) if Instant::now() >= next_attempt => {
                        said_absent = false;
                        let (k, r) = (kubelet.clone(), res.clone());
                        attempt = Some(Box::pin(async move {
                            match tokio::time::timeout(REGISTER_TIMEOUT, register(&k, &r)).await {
                                Ok(r) => r,
                                Err(_) => Err(RegisterError::Unreachable(format!(
                                    "Register not answered within {} s",
                                    REGISTER_TIMEOUT.as_secs()
                                ))),
                            }
                        }));
                    }
                    _ => {}
                }
            }
            let mut wake_at = Instant::now() + BACKSTOP;
            if served.is_none() {
                wake_at = wake_at.min(serve_at);
            } else if registered.is_none() && attempt.is_none() && instance.is_some() {
                wake_at = wake_at.min(next_attempt);
            }
            tokio::select! {
                _ = stopped(&mut stop) => break,
                _ = self.check.notified() => {}
                _ = self.plugin.rescan_wanted.notified() => self.refresh(&mut cdi).await,
                outcome = async { attempt.as_mut().expect("branch enabled only with an attempt").as_mut().await }, if attempt.is_some() => {
                    attempt = None;
                    match outcome {
                        Ok(Some(id)) if sock_id(&kubelet) == Some(id) => {
                            registered = Some(id);
                            backoff = BACKOFF_MIN;
                            tracing::info!(resource = %name, "device plugin registered with kubelet");
                            self.book.registered(&name);
                        }
                        // Registered with a kubelet that has gone since: the new one next.
                        Ok(_) => next_attempt = Instant::now(),
                        Err(err) => {
                            match &err {
                                RegisterError::Refused(m) => {
                                    // Said once per refusal, not on every retry.
                                    if self.book.state(&name) != Some(crate::kubelet::State::Refused(m.clone())) {
                                        tracing::warn!(resource = %name, error = %m, "kubelet refused the device plugin registration; retrying");
                                    }
                                    self.book.refused(&name, m.clone());
                                }
                                RegisterError::Unreachable(m) => self.book.unreachable(&name, m.clone()),
                            }
                            tracing::debug!(resource = %name, error = %err, backoff_ms = backoff.as_millis() as u64, "registration failed; retrying");
                            next_attempt = Instant::now() + backoff;
                            let max = if matches!(err, RegisterError::Refused(_)) { REFUSED_BACKOFF_MAX } else { BACKOFF_MAX };
                            backoff = (backoff * 2).min(max);
                        }
                    }
                }
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake_at)) => {
                    if last_health.elapsed() >= HEALTH_EVERY {
                        self.refresh(&mut cdi).await;
                        last_health = Instant::now();
                    }
                }
            }
        }
        if let Some(s) = served.take() {
            stop_task(&s.stop, s.server, Duration::from_secs(2)).await;
            // Only the socket this task bound: a successor may have bound the path already.
            if sock_id(&sock) == Some(s.id) {
                let _ = std::fs::remove_file(&sock);
            }
        }
    }
}

/// Bind and serve one plugin socket.
fn serve(plugin: Arc<Plugin>, sock: &Path) -> std::io::Result<Served> {
    let listener = crate::sys::fs::bind_unix_socket(sock)?;
    let id =
        sock_id(sock).ok_or_else(|| std::io::Error::other(format!("{} vanished right after bind", sock.display())))?;
    let (stop, stop_rx) = watch::channel(false);
    let svc = plugin::Service { plugin, stop: stop_rx.clone() };
    let mut stop2 = stop_rx;
    let server = tokio::spawn(async move {
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
    });
    Ok(Served { id, stop, server })
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

async fn register(kubelet: &Path, res: &Resource) -> Result<Option<SockId>, RegisterError> {
    let ch = crate::rpc::connect_unix(kubelet)
        .await
        .map_err(|e| RegisterError::Unreachable(format!("connecting to kubelet at {}: {e}", kubelet.display())))?;
    // The instance this connection reached (a socket replaced between a look and the
    // connect is the new one).
    let reached = sock_id(kubelet);
    pb::registration_client::RegistrationClient::new(ch)
        .register(pb::RegisterRequest {
            version: API_VERSION.into(),
            endpoint: res.socket_name(),
            resource_name: res.resource_name(),
            options: Some(pb::DevicePluginOptions {
                pre_start_required: res.pre_start,
                get_preferred_allocation_available: true,
            }),
        })
        .await
        .map(|_| reached)
        .map_err(|s| {
            let msg = format!("Register: {:?}: {}", s.code(), s.message());
            // A transport failure is kubelet not being there; any answer from it is a refusal.
            if s.code() == tonic::Code::Unavailable
                || s.code() == tonic::Code::Unknown && s.message().contains("transport")
            {
                RegisterError::Unreachable(msg)
            } else {
                RegisterError::Refused(msg)
            }
        })
}

/// Run the device plugins until `shutdown` turns true; then stop them and remove their
/// sockets. Keeps `inventory` up to date with the plugins served and `book` with what
/// kubelet answered their registrations.
pub async fn run_with(
    s: Settings,
    mut shutdown: watch::Receiver<bool>,
    inventory: Inventory,
    book: crate::kubelet::Registrations,
) {
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
    let afd =
        match unsafe { AsyncFd::register_with_interest(inotify.as_fd().as_raw_fd(), tokio::io::Interest::READABLE) } {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, "device plugins disabled: inotify fd");
                return;
            }
        };
    let mut m = Manager { s: s.clone(), handles: BTreeMap::new(), resources: Vec::new(), inventory, book };
    m.reload().await;
    let mut watched: BTreeMap<PathBuf, nix::sys::inotify::WatchDescriptor> = BTreeMap::new();
    let flags = AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_ATTRIB;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Keep the watch set in step with the configuration (directories can appear later).
        for d in m.watch_dirs() {
            if !watched.contains_key(&d)
                && let Ok(wd) = inotify.add_watch(&d, flags)
            {
                // Anything that happened before the watch existed.
                if d == s.plugin_dir {
                    m.check_all();
                }
                m.rescan(&d);
                watched.insert(d, wd);
            }
        }
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            ready = afd.readable() => {
                let mut guard = match ready { Ok(g) => g, Err(_) => break };
                // Read until the queue is empty: the descriptor is edge-triggered, and one
                // read returns at most a buffer's worth of events.
                let mut events = Vec::new();
                loop {
                    match inotify.read_events() {
                        Ok(ev) if !ev.is_empty() => events.extend(ev),
                        Ok(_) | Err(nix::errno::Errno::EAGAIN) => break,
                        Err(e) => { tracing::warn!(error = %e, "inotify read"); break }
                    }
                }
                guard.clear_ready();
                if events.is_empty() {
                    continue;
                }
                let mut reload = false;
                let mut sockets = false;
                let mut dirs = HashSet::new();
                for ev in events {
                    if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                        // The directory went (a removed device-plugins/): the tasks notice
                        // their sockets gone; the watch comes back with the directory.
                        if watched.get(&s.plugin_dir) == Some(&ev.wd) {
                            sockets = true;
                        }
                        watched.retain(|_, wd| *wd != ev.wd);
                        continue;
                    }
                    let Some(dir) = watched.iter().find(|(_, wd)| **wd == ev.wd).map(|(d, _)| d.clone()) else { continue };
                    // Any change in the device file's directory: the file itself, or a
                    // Kubernetes ConfigMap volume swapping its `..data` symlink (the file's
                    // own path never changes then). A reload that finds the same devices
                    // changes nothing.
                    if Some(dir.as_path()) == s.config_file.parent() {
                        reload = true;
                    }
                    if dir == s.plugin_dir {
                        sockets = true;
                    }
                    dirs.insert(dir);
                }
                if reload {
                    m.reload().await;
                }
                if sockets {
                    m.check_all();
                }
                for d in dirs {
                    m.rescan(&d);
                }
            }
            // Re-adds the watches of directories that appear later (see the top of the loop).
            _ = tick.tick() => {}
        }
    }
    m.inventory.set(Vec::new());
    stop(std::mem::take(&mut m.handles).into_values().collect()).await;
    tracing::info!("device plugins stopped");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dra_resources_are_no_device_plugins() {
        let text = br#"{"resources": [
            {"name": "plain", "devices": ["/dev/p*"]},
            {"name": "claimed", "devices": ["/dev/c*"], "offer": "dra"},
            {"name": "counted", "devices": ["/dev/k*"], "offer": "devicePlugin"}
        ]}"#;
        let (ok, problems) = config::parse(text).unwrap();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(ok.len(), 3);
        let names: Vec<String> = offered_here(ok).into_iter().map(|r| r.name).collect();
        assert_eq!(names, vec!["plain".to_string(), "counted".to_string()]);
    }
}
