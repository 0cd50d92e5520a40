//! A kubelet device-manager emulator (test code).
//!
//! Included from a test crate with
//! `#[path = "../tools/support/kubelet_devices.rs"] mod kubelet_emulator;`.
//!
//! It does what kubelet's device manager does with device plugins, over the real sockets:
//!
//! * when it starts it deletes every socket in `device-plugins/` (plugin sockets included,
//!   as kubelet's device manager does: a plugin must notice and serve its socket again),
//!   then serves `v1beta1.Registration` on `<kubelet_dir>/device-plugins/kubelet.sock`;
//! * `Register` is handled synchronously, before answering: the API version must be
//!   `v1beta1`, the resource name must be an extended resource name and the endpoint a
//!   socket base name; kubelet dials `<device-plugins>/<endpoint>`, asks
//!   `GetDevicePluginOptions`, opens `ListAndWatch` exactly once and consumes that stream in
//!   a spawned task; only then does it answer `Ok`. A failure answers `InvalidArgument`
//!   (bad request) or `FailedPrecondition` (the plugin cannot be reached or refuses a call).
//!   A second registration of the same resource replaces the first one (kubelet does that
//!   when a plugin restarts): the old stream is dropped. One connection per registration:
//!   each Register dials the plugin anew;
//! * registrations are counted per kubelet *instance* (one [`KubeletEmulator::start`] ..
//!   [`KubeletEmulator::stop`]). A Register that began in an earlier instance is refused
//!   (`Unavailable`), as a restart cuts its connection. **Duplicate rule**: a successful
//!   Register of resource R is a duplicate when R already registered successfully with the
//!   same instance and the plugin socket is still the same file as at that registration
//!   (same inode and change time: the plugin did not serve a new socket in between, so it had
//!   no reason to register again). [`KubeletEmulator::duplicates`] lists them (over all
//!   instances), [`KubeletEmulator::registrations_this_instance`] counts per resource;
//! * a per-resource Register delay ([`KubeletEmulator::set_register_delay`]) makes Register
//!   of that resource sleep before it does anything: a slow kubelet. A Register cancelled by
//!   its caller meanwhile is dropped with the connection (it registers nothing);
//! * it remembers, per resource name, the latest full device list, every list received,
//!   how many lists and registrations there were, the options and the endpoint;
//! * it calls the plugin of a resource like kubelet does at container creation
//!   (`Allocate`, `PreStartContainer`, `GetPreferredAllocation`);
//! * [`KubeletEmulator::stop`] and [`KubeletEmulator::start`] emulate a kubelet restart: the
//!   server goes away together with `kubelet.sock` and every `ListAndWatch` stream, and a new
//!   server binds a new `kubelet.sock`. What the emulator learned before stays visible
//!   (the registration counter keeps counting) so tests can see the plugin come back.
//!   [`KubeletEmulator::stop_leaving_stale_socket`] stops like a crashed kubelet instead:
//!   `kubelet.sock` stays, nothing listens on it (connect is refused) until the next start.
//!
//! Waiting: every change bumps a `tokio::sync::watch` counter; [`KubeletEmulator::wait_for`]
//! wakes up on it (and polls every 10 ms as a safety net), so tests never sleep blindly.
//!
//! The emulator needs a tokio runtime (multi-thread, as the root tests use).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nodeplane::rpc::deviceplugin as dp;
use nodeplane::rpc::deviceplugin::device_plugin_client::DevicePluginClient;
use nodeplane::rpc::deviceplugin::registration_server::{Registration, RegistrationServer};
use tokio::sync::{oneshot, watch};
use tokio::task::{AbortHandle, JoinHandle};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The only device plugin API version this kubelet speaks.
pub const API_VERSION: &str = "v1beta1";
/// Kubelet's registration socket, in the device-plugins directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// `Device.health` values of the API.
pub const HEALTHY: &str = "Healthy";
pub const UNHEALTHY: &str = "Unhealthy";

/// One device as a plugin listed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub id: String,
    /// Exactly what the plugin sent ("Healthy" / "Unhealthy" if it follows the API).
    pub health: String,
    /// NUMA node ids from `topology` (empty when the plugin sent none).
    pub numa: Vec<i64>,
}

impl DeviceInfo {
    pub fn healthy(&self) -> bool {
        self.health == HEALTHY
    }
}

/// What kubelet knows about one resource (a snapshot; see [`KubeletEmulator::resource`]).
#[derive(Debug, Clone)]
pub struct Resource {
    /// Extended resource name, e.g. `nodeplane.dev/testdev`.
    pub name: String,
    /// `RegisterRequest.version` of the latest registration.
    pub version: String,
    /// `RegisterRequest.endpoint` of the latest registration (a socket base name).
    pub endpoint: String,
    /// The plugin's socket: `<device-plugins>/<endpoint>`.
    pub socket: PathBuf,
    /// `RegisterRequest.options` of the latest registration (`None`: the plugin sent none).
    pub options: Option<dp::DevicePluginOptions>,
    /// What `GetDevicePluginOptions` answered during the latest registration.
    pub served_options: dp::DevicePluginOptions,
    /// Successful registrations so far (kubelet restarts do not reset it).
    pub registrations: u32,
    /// When the latest registration was accepted.
    pub registered_at: Instant,
    /// The kubelet instance (see [`KubeletEmulator::instance`]) of the latest registration.
    pub instance: u64,
    /// Successful registrations with that instance, the latest included.
    pub registrations_in_instance: u32,
    /// `ListAndWatch` messages received, over all registrations.
    pub messages: u64,
    /// `ListAndWatch` messages received on the stream of the latest registration.
    pub messages_this_registration: u64,
    /// The latest full device list (kept across registrations until a new list arrives).
    pub devices: Vec<DeviceInfo>,
    /// When the latest list arrived.
    pub last_list_at: Option<Instant>,
    /// Every list received, with its arrival time and the registration (1-based) whose
    /// stream carried it.
    pub history: Vec<(Instant, u32, Vec<DeviceInfo>)>,
    /// The `ListAndWatch` stream of the latest registration is open.
    pub streaming: bool,
    /// Why that stream ended (set when `streaming` turns false).
    pub stream_end: Option<String>,
    /// Protocol problems seen in the lists (duplicate ids, health values outside the API,
    /// empty or over-long ids). Kubelet tolerates some of these; tests should not.
    pub protocol_errors: Vec<String>,
}

impl Resource {
    /// Devices listed (kubelet's node capacity for the resource).
    pub fn capacity(&self) -> usize {
        self.devices.len()
    }
    /// Healthy devices listed (kubelet's node allocatable for the resource).
    pub fn allocatable(&self) -> usize {
        self.devices.iter().filter(|d| d.healthy()).count()
    }
    /// Sorted ids of the latest list.
    pub fn ids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.devices.iter().map(|d| d.id.clone()).collect();
        v.sort();
        v
    }
    /// The health string of `id` in the latest list (`None`: not listed).
    pub fn health(&self, id: &str) -> Option<&str> {
        self.devices.iter().find(|d| d.id == id).map(|d| d.health.as_str())
    }
    /// The latest list has a device `id` with this health.
    pub fn has(&self, id: &str, health: &str) -> bool {
        self.health(id) == Some(health)
    }
}

/// Per-resource state plus the bookkeeping tests need not see.
struct Entry {
    public: Resource,
    /// Identifies the registration whose stream may update this entry.
    token: u64,
    /// The task consuming that stream.
    consumer: Option<AbortHandle>,
}

#[derive(Default)]
struct State {
    /// The server is up; registrations arriving on a straggling connection after `stop`
    /// are refused (a real kubelet restart cuts every connection).
    running: bool,
    entries: BTreeMap<String, Entry>,
    /// Refused registrations, with why.
    failures: Vec<String>,
    next_token: u64,
    /// The current (or latest) kubelet instance, 1-based; 0 before the first start.
    instance: u64,
    /// When the current instance started.
    instance_started_at: Option<Instant>,
    /// Successful registrations with the current instance, per resource.
    this_instance: BTreeMap<String, InstanceRegs>,
    /// Duplicate registrations (see the module comment), over all instances.
    duplicates: Vec<String>,
    /// Register of these resources sleeps this long first.
    register_delay: BTreeMap<String, Duration>,
    /// Register calls being handled now, per resource.
    pending: BTreeMap<String, u32>,
}

/// One resource's registrations with one kubelet instance.
#[derive(Debug, Clone)]
struct InstanceRegs {
    count: u32,
    first_at: Instant,
    /// Identity of the plugin socket at the latest of them.
    socket: Option<SocketId>,
}

/// A socket file's identity: (device, inode, ctime s, ctime ns). A replacement socket can
/// get the old inode number back; the change time tells them apart.
type SocketId = (u64, u64, i64, i64);

fn socket_id(p: &Path) -> Option<SocketId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).ok().map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

struct Shared {
    device_dir: PathBuf,
    state: Mutex<State>,
    /// Bumped after every change (registration, list, stream end, failure).
    changed: watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock (a test assertion elsewhere) must not hide state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Kubelet's `Register`: validate, dial back, get options, open `ListAndWatch`.
    async fn register(self: &Arc<Self>, r: dp::RegisterRequest) -> Result<(), Status> {
        let (instance, delay) = {
            let st = self.lock();
            (st.instance, st.register_delay.get(&r.resource_name).copied())
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        if r.version != API_VERSION {
            return Err(Status::invalid_argument(format!(
                "unsupported device plugin API version {:?}; kubelet speaks {API_VERSION:?}",
                r.version
            )));
        }
        if !valid_extended_resource_name(&r.resource_name) {
            return Err(Status::invalid_argument(format!(
                "resource name {:?} is not an extended resource name (<domain>/<name>, not in kubernetes.io)",
                r.resource_name
            )));
        }
        if r.endpoint.is_empty() || r.endpoint.contains('/') || r.endpoint == KUBELET_SOCKET {
            return Err(Status::invalid_argument(format!(
                "endpoint {:?} must be the base name of a socket in {}",
                r.endpoint,
                self.device_dir.display()
            )));
        }
        let socket = self.device_dir.join(&r.endpoint);
        let channel = nodeplane::rpc::connect_unix(&socket)
            .await
            .map_err(|e| Status::failed_precondition(format!("dialing the plugin at {}: {e}", socket.display())))?;
        let mut client = DevicePluginClient::new(channel);
        let served_options = client
            .get_device_plugin_options(dp::Empty {})
            .await
            .map_err(|e| Status::failed_precondition(format!("GetDevicePluginOptions: {e}")))?
            .into_inner();
        let stream = client
            .list_and_watch(dp::Empty {})
            .await
            .map_err(|e| Status::failed_precondition(format!("ListAndWatch: {e}")))?
            .into_inner();

        // After the dial: the socket this registration talks to.
        let sock_id = socket_id(&socket);

        let mut st = self.lock();
        if !st.running {
            return Err(Status::unavailable("kubelet is shutting down"));
        }
        if st.instance != instance {
            return Err(Status::unavailable("kubelet restarted while this Register was in flight"));
        }
        let now_i = Instant::now();
        {
            let stm = &mut *st;
            match stm.this_instance.get_mut(&r.resource_name) {
                Some(prev) => {
                    if prev.socket.is_some() && prev.socket == sock_id {
                        stm.duplicates.push(format!(
                            "{} registered again with kubelet instance {instance} (registration #{} with it, {:?} after the first) on the same socket {} (inode {})",
                            r.resource_name,
                            prev.count + 1,
                            now_i.saturating_duration_since(prev.first_at),
                            socket.display(),
                            sock_id.map(|i| i.1).unwrap_or(0),
                        ));
                    }
                    prev.count += 1;
                    prev.socket = sock_id;
                }
                None => {
                    stm.this_instance
                        .insert(r.resource_name.clone(), InstanceRegs { count: 1, first_at: now_i, socket: sock_id });
                }
            }
        }
        st.next_token += 1;
        let token = st.next_token;
        let now = Instant::now();
        let entry = match st.entries.remove(&r.resource_name) {
            Some(mut old) => {
                // Replaced: the old stream goes away, what it taught stays until a new list.
                if let Some(c) = old.consumer.take() {
                    c.abort();
                }
                let p = &mut old.public;
                p.registrations += 1;
                p.messages_this_registration = 0;
                Entry { public: old.public, token, consumer: None }
            }
            None => Entry {
                public: Resource {
                    name: r.resource_name.clone(),
                    version: String::new(),
                    endpoint: String::new(),
                    socket: PathBuf::new(),
                    options: None,
                    served_options: dp::DevicePluginOptions::default(),
                    registrations: 1,
                    registered_at: now,
                    instance,
                    registrations_in_instance: 0,
                    messages: 0,
                    messages_this_registration: 0,
                    devices: Vec::new(),
                    last_list_at: None,
                    history: Vec::new(),
                    streaming: true,
                    stream_end: None,
                    protocol_errors: Vec::new(),
                },
                token,
                consumer: None,
            },
        };
        let mut entry = entry;
        let p = &mut entry.public;
        p.version = r.version.clone();
        p.endpoint = r.endpoint.clone();
        p.socket = socket;
        p.options = r.options;
        p.served_options = served_options;
        p.registered_at = now;
        p.instance = instance;
        p.registrations_in_instance = st.this_instance.get(&r.resource_name).map(|c| c.count).unwrap_or(0);
        p.streaming = true;
        p.stream_end = None;
        // The consumer may start on another worker right away; it takes the lock, so it
        // sees the entry only once it is in place (below, before the lock is released).
        let task = tokio::spawn(consume(self.clone(), r.resource_name.clone(), token, stream));
        entry.consumer = Some(task.abort_handle());
        st.entries.insert(r.resource_name, entry);
        drop(st);
        self.bump();
        Ok(())
    }
}

/// Reads one registration's `ListAndWatch` stream until it ends or is dropped.
async fn consume(
    shared: Arc<Shared>,
    resource: String,
    token: u64,
    mut stream: tonic::Streaming<dp::ListAndWatchResponse>,
) {
    let end = loop {
        match stream.message().await {
            Ok(Some(msg)) => {
                let devices: Vec<DeviceInfo> = msg
                    .devices
                    .into_iter()
                    .map(|d| DeviceInfo {
                        id: d.id,
                        health: d.health,
                        numa: d.topology.map(|t| t.nodes.into_iter().map(|n| n.id).collect()).unwrap_or_default(),
                    })
                    .collect();
                let problems = check_list(&devices);
                {
                    let mut st = shared.lock();
                    let Some(e) = st.entries.get_mut(&resource).filter(|e| e.token == token) else {
                        return; // replaced or forgotten meanwhile
                    };
                    let p = &mut e.public;
                    let now = Instant::now();
                    p.messages += 1;
                    p.messages_this_registration += 1;
                    p.history.push((now, p.registrations, devices.clone()));
                    p.devices = devices;
                    p.last_list_at = Some(now);
                    p.protocol_errors.extend(problems.into_iter().map(|m| format!("list #{}: {m}", p.messages)));
                }
                shared.bump();
            }
            Ok(None) => break "the plugin ended the stream".to_string(),
            Err(s) => break format!("the stream failed: {s}"),
        }
    };
    {
        let mut st = shared.lock();
        if let Some(e) = st.entries.get_mut(&resource).filter(|e| e.token == token) {
            e.public.streaming = false;
            e.public.stream_end = Some(end);
            e.consumer = None;
        }
    }
    shared.bump();
}

/// What kubelet (or its API validation) would object to in one list.
fn check_list(devices: &[DeviceInfo]) -> Vec<String> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for d in devices {
        if d.id.is_empty() || d.id.len() > 63 {
            out.push(format!("device id {:?} is empty or longer than 63 characters", d.id));
        }
        if !seen.insert(d.id.as_str()) {
            out.push(format!("device id {:?} listed twice", d.id));
        }
        if d.health != HEALTHY && d.health != UNHEALTHY {
            out.push(format!(
                "device {:?} has health {:?} (the API knows {HEALTHY:?} and {UNHEALTHY:?})",
                d.id, d.health
            ));
        }
    }
    out
}

/// `<domain>/<name>` outside `kubernetes.io` (kubelet's `IsExtendedResourceName`, roughly).
fn valid_extended_resource_name(name: &str) -> bool {
    let Some((domain, rest)) = name.split_once('/') else { return false };
    let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_';
    !domain.is_empty()
        && !rest.is_empty()
        && !rest.contains('/')
        && domain.chars().all(ok_char)
        && rest.chars().all(ok_char)
        && domain != "kubernetes.io"
        && !domain.ends_with(".kubernetes.io")
}

/// The gRPC face of the emulator.
struct Handler(Arc<Shared>);

#[tonic::async_trait]
impl Registration for Handler {
    async fn register(&self, request: Request<dp::RegisterRequest>) -> Result<Response<dp::Empty>, Status> {
        let r = request.into_inner();
        // Counted while handled, also when the caller gives up and the call is dropped.
        struct Pending(Arc<Shared>, String);
        impl Drop for Pending {
            fn drop(&mut self) {
                let mut st = self.0.lock();
                if let Some(n) = st.pending.get_mut(&self.1) {
                    *n = n.saturating_sub(1);
                }
                drop(st);
                self.0.bump();
            }
        }
        *self.0.lock().pending.entry(r.resource_name.clone()).or_default() += 1;
        self.0.bump();
        let _pending = Pending(self.0.clone(), r.resource_name.clone());
        let what = format!("{:?} (endpoint {:?}, version {:?})", r.resource_name, r.endpoint, r.version);
        match self.0.register(r).await {
            Ok(()) => Ok(Response::new(dp::Empty {})),
            Err(s) => {
                self.0.lock().failures.push(format!("{what}: {:?}: {}", s.code(), s.message()));
                self.0.bump();
                Err(s)
            }
        }
    }
}

struct Server {
    shutdown: oneshot::Sender<()>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

/// The emulator. Create it with [`KubeletEmulator::new`], then [`KubeletEmulator::start`].
pub struct KubeletEmulator {
    kubelet_dir: PathBuf,
    shared: Arc<Shared>,
    server: Option<Server>,
    /// `start` deletes every socket in the directory (kubelet does).
    wipe_sockets: bool,
}

impl KubeletEmulator {
    /// An emulator for the kubelet whose root directory is `kubelet_dir` (not started).
    pub fn new(kubelet_dir: &Path) -> Self {
        Self::with_device_dir(kubelet_dir, &kubelet_dir.join("device-plugins"))
    }

    /// The same with the device plugin directory elsewhere: a real kubelet uses
    /// `/var/lib/kubelet/device-plugins/` whatever its `--root-dir`.
    pub fn with_device_dir(kubelet_dir: &Path, device_dir: &Path) -> Self {
        let device_dir = device_dir.to_path_buf();
        let (changed, _) = watch::channel(0);
        KubeletEmulator {
            kubelet_dir: kubelet_dir.to_path_buf(),
            shared: Arc::new(Shared { device_dir, state: Mutex::new(State::default()), changed }),
            server: None,
            wipe_sockets: true,
        }
    }

    /// `<kubelet_dir>/device-plugins`.
    pub fn device_dir(&self) -> &Path {
        &self.shared.device_dir
    }

    /// `<kubelet_dir>/device-plugins/kubelet.sock`.
    pub fn socket(&self) -> PathBuf {
        self.shared.device_dir.join(KUBELET_SOCKET)
    }

    pub fn running(&self) -> bool {
        self.server.is_some()
    }

    /// A receiver that is marked changed after every change the emulator records
    /// (registration, list, stream end, refused registration): for a process that mirrors
    /// the state somewhere (`tools/kubelet.rs` writes it to a file).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changed.subscribe()
    }

    /// Kubelet starts: delete every socket in the device plugin directory (kubelet's device
    /// manager does so: stale `kubelet.sock` and every plugin socket alike), bind a new
    /// `kubelet.sock` and serve `Registration`. A new kubelet instance begins (its
    /// registration counts start at 0). The socket exists when this returns.
    pub async fn start(&mut self) {
        assert!(self.server.is_none(), "kubelet emulator already running");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(self.device_dir())
            .unwrap_or_else(|e| panic!("creating {}: {e}", self.device_dir().display()));
        if self.wipe_sockets {
            self.remove_sockets();
        }
        let sock = self.socket();
        match std::fs::remove_file(&sock) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => panic!("removing stale {}: {e}", sock.display()),
        }
        let listener =
            tokio::net::UnixListener::bind(&sock).unwrap_or_else(|e| panic!("binding {}: {e}", sock.display()));
        {
            let mut st = self.shared.lock();
            st.running = true;
            st.instance += 1;
            st.instance_started_at = Some(Instant::now());
            st.this_instance.clear();
        }
        self.shared.bump();
        let (tx, rx) = oneshot::channel::<()>();
        let server = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Handler(self.shared.clone())))
            // kubelet's grpc-go server takes any `:authority`: so does this one.
            .serve_with_incoming_shutdown(nodeplane::rpc::authority::incoming(listener), async move {
                let _ = rx.await;
            });
        self.server = Some(Server { shutdown: tx, task: tokio::spawn(server) });
    }

    /// Delete every socket file in the device plugin directory (what kubelet does when it
    /// starts). Other files and directories stay.
    fn remove_sockets(&self) {
        use std::os::unix::fs::FileTypeExt;
        let Ok(entries) = std::fs::read_dir(self.device_dir()) else { return };
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_socket()) {
                match std::fs::remove_file(e.path()) {
                    Ok(()) => {}
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                    Err(err) => panic!("kubelet emulator: removing socket {}: {err}", e.path().display()),
                }
            }
        }
    }

    /// Whether [`KubeletEmulator::start`] deletes every socket in the directory (default:
    /// yes, like kubelet). `false` deletes only a stale `kubelet.sock`.
    pub fn set_wipe_sockets_on_start(&mut self, wipe: bool) {
        self.wipe_sockets = wipe;
    }

    /// Register of `resource` sleeps `delay` before doing anything (a slow kubelet);
    /// `Duration::ZERO` removes the delay.
    pub fn set_register_delay(&self, resource: &str, delay: Duration) {
        let mut st = self.shared.lock();
        if delay.is_zero() {
            st.register_delay.remove(resource);
        } else {
            st.register_delay.insert(resource.to_string(), delay);
        }
    }

    /// The current (or, when stopped, the latest) kubelet instance, 1-based (0: never
    /// started).
    pub fn instance(&self) -> u64 {
        self.shared.lock().instance
    }

    /// When the current (or latest) instance started.
    pub fn instance_started_at(&self) -> Option<Instant> {
        self.shared.lock().instance_started_at
    }

    /// Successful registrations of `resource` with the current (or latest) instance.
    pub fn registrations_this_instance(&self, resource: &str) -> u32 {
        self.shared.lock().this_instance.get(resource).map(|r| r.count).unwrap_or(0)
    }

    /// Register calls of `resource` being handled right now (e.g. sleeping in a
    /// [`KubeletEmulator::set_register_delay`]).
    pub fn pending_registrations(&self, resource: &str) -> u32 {
        self.shared.lock().pending.get(resource).copied().unwrap_or(0)
    }

    /// When `resource` first registered with the current (or latest) instance.
    pub fn first_registration_this_instance(&self, resource: &str) -> Option<Instant> {
        self.shared.lock().this_instance.get(resource).map(|r| r.first_at)
    }

    /// Every duplicate registration so far, over all instances (see the module comment for
    /// the rule), each described starting with the resource name.
    pub fn duplicates(&self) -> Vec<String> {
        self.shared.lock().duplicates.clone()
    }

    /// Stop like a kubelet that died without cleaning up: as [`KubeletEmulator::stop`], then
    /// a `kubelet.sock` is left behind with nothing listening on it (connecting is refused)
    /// until the next [`KubeletEmulator::start`] replaces it.
    pub async fn stop_leaving_stale_socket(&mut self) {
        self.stop().await;
        let sock = self.socket();
        let l = std::os::unix::net::UnixListener::bind(&sock)
            .unwrap_or_else(|e| panic!("binding a stale {}: {e}", sock.display()));
        // Dropping a listener closes it and leaves the file.
        drop(l);
    }

    /// Kubelet goes away: `kubelet.sock` is deleted, every `ListAndWatch` stream is dropped
    /// (the plugins see their streams cancelled) and the server stops. Returns once the
    /// server is down. What was learned stays readable; a no-op when not running.
    pub async fn stop(&mut self) {
        let Some(mut srv) = self.server.take() else { return };
        let _ = std::fs::remove_file(self.socket());
        {
            let mut st = self.shared.lock();
            st.running = false;
            for e in st.entries.values_mut() {
                if let Some(c) = e.consumer.take() {
                    c.abort();
                }
                // The entry's registration is over: a late message must not count.
                e.token = 0;
                if e.public.streaming {
                    e.public.streaming = false;
                    e.public.stream_end = Some("kubelet stopped".into());
                }
            }
        }
        self.shared.bump();
        let _ = srv.shutdown.send(());
        // Graceful: GOAWAY on idle connections closes them at once. A connection held open
        // past that is cut by aborting the server (and refused by `running` anyway).
        match tokio::time::timeout(Duration::from_secs(2), &mut srv.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => panic!("kubelet emulator server failed: {e}"),
            Ok(Err(e)) if e.is_cancelled() => {}
            Ok(Err(e)) => panic!("kubelet emulator server task panicked: {e}"),
            Err(_) => srv.task.abort(),
        }
    }

    /// A snapshot of what kubelet knows about `resource` (`None`: never registered).
    pub fn resource(&self, resource: &str) -> Option<Resource> {
        self.shared.lock().entries.get(resource).map(|e| e.public.clone())
    }

    /// Snapshots of every resource ever registered.
    pub fn resources(&self) -> BTreeMap<String, Resource> {
        self.shared.lock().entries.iter().map(|(k, e)| (k.clone(), e.public.clone())).collect()
    }

    /// Refused registrations so far, with why.
    pub fn failures(&self) -> Vec<String> {
        self.shared.lock().failures.clone()
    }

    /// Node capacity of `resource` (devices listed; 0 when unknown).
    pub fn capacity(&self, resource: &str) -> usize {
        self.resource(resource).map(|r| r.capacity()).unwrap_or(0)
    }

    /// Node allocatable of `resource` (healthy devices listed; 0 when unknown).
    pub fn allocatable(&self, resource: &str) -> usize {
        self.resource(resource).map(|r| r.allocatable()).unwrap_or(0)
    }

    /// Human-readable state, for failure messages.
    pub fn describe(&self) -> String {
        let st = self.shared.lock();
        let mut s = format!("kubelet emulator (running: {}, instance {}):\n", st.running, st.instance);
        for (name, e) in &st.entries {
            let p = &e.public;
            s += &format!(
                "  {name}: endpoint {:?}, registrations {}, lists {} ({} this registration), streaming {}{}, options {:?}, devices {:?}\n",
                p.endpoint,
                p.registrations,
                p.messages,
                p.messages_this_registration,
                p.streaming,
                p.stream_end.as_deref().map(|e| format!(" (ended: {e})")).unwrap_or_default(),
                p.options,
                p.devices.iter().map(|d| format!("{}={}", d.id, d.health)).collect::<Vec<_>>(),
            );
            for m in &p.protocol_errors {
                s += &format!("    protocol error: {m}\n");
            }
        }
        if st.entries.is_empty() {
            s += "  no resource registered\n";
        }
        for f in &st.failures {
            s += &format!("  refused registration: {f}\n");
        }
        s += &format!("  instance {}:", st.instance);
        for (name, r) in &st.this_instance {
            s += &format!(" {name}×{}", r.count);
        }
        s += "\n";
        for d in &st.duplicates {
            s += &format!("  DUPLICATE registration: {d}\n");
        }
        s
    }

    /// Wait until `pred` holds for `resource` (which must be registered), up to `timeout`.
    /// Returns the snapshot that satisfied it, or a description of the state at the deadline.
    pub async fn wait_for(
        &self,
        resource: &str,
        timeout: Duration,
        pred: impl Fn(&Resource) -> bool,
    ) -> Result<Resource, String> {
        self.wait_until(timeout, |all| all.get(resource).filter(|r| pred(r)).cloned())
            .await
            .map_err(|state| format!("condition on {resource:?} not met within {timeout:?}; {state}"))
    }

    /// Wait until `f` returns `Some` for the snapshot of every resource, up to `timeout`.
    pub async fn wait_until<T>(
        &self,
        timeout: Duration,
        f: impl Fn(&BTreeMap<String, Resource>) -> Option<T>,
    ) -> Result<T, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.shared.changed.subscribe();
        loop {
            rx.borrow_and_update();
            if let Some(v) = f(&self.resources()) {
                return Ok(v);
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(self.describe());
            }
            // Woken by a change, else re-check every 10 ms.
            let nap = (deadline - now).min(Duration::from_millis(10));
            let _ = tokio::time::timeout(nap, rx.changed()).await;
        }
    }

    /// A fresh client to the plugin serving `resource` (kubelet dials the endpoint it
    /// registered with).
    pub async fn client(&self, resource: &str) -> Result<DevicePluginClient<Channel>, Status> {
        let socket = self
            .resource(resource)
            .ok_or_else(|| Status::not_found(format!("kubelet emulator: {resource:?} is not registered")))?
            .socket;
        let ch = nodeplane::rpc::connect_unix(&socket)
            .await
            .map_err(|e| Status::unavailable(format!("kubelet emulator: dialing {}: {e}", socket.display())))?;
        Ok(DevicePluginClient::new(ch))
    }

    /// `Allocate` with one container request per element of `containers` (device ids).
    pub async fn allocate(&self, resource: &str, containers: Vec<Vec<String>>) -> Result<dp::AllocateResponse, Status> {
        let mut c = self.client(resource).await?;
        let req = dp::AllocateRequest {
            container_requests: containers
                .into_iter()
                .map(|ids| dp::ContainerAllocateRequest { devices_ids: ids })
                .collect(),
        };
        Ok(c.allocate(req).await?.into_inner())
    }

    /// `PreStartContainer` for one container's devices.
    pub async fn pre_start(&self, resource: &str, ids: Vec<String>) -> Result<(), Status> {
        let mut c = self.client(resource).await?;
        c.pre_start_container(dp::PreStartContainerRequest { devices_ids: ids }).await?;
        Ok(())
    }

    /// `GetPreferredAllocation` for one container: the device ids the plugin prefers.
    pub async fn preferred(
        &self,
        resource: &str,
        available: Vec<String>,
        must_include: Vec<String>,
        size: i32,
    ) -> Result<Vec<String>, Status> {
        let mut c = self.client(resource).await?;
        let req = dp::PreferredAllocationRequest {
            container_requests: vec![dp::ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: must_include,
                allocation_size: size,
            }],
        };
        let resp = c.get_preferred_allocation(req).await?.into_inner();
        let n = resp.container_responses.len();
        let first = resp.container_responses.into_iter().next();
        assert_eq!(n, 1, "GetPreferredAllocation answered {n} container responses to a request for 1 container");
        Ok(first.expect("GetPreferredAllocation: one container response (checked above)").device_i_ds)
    }
}

impl Drop for KubeletEmulator {
    /// Best effort without a runtime to await on: stop serving, drop every stream, remove
    /// `kubelet.sock`.
    fn drop(&mut self) {
        if let Some(srv) = self.server.take() {
            let _ = srv.shutdown.send(());
            srv.task.abort();
            let _ = std::fs::remove_file(self.socket());
        }
        let mut st = self.shared.lock();
        st.running = false;
        for e in st.entries.values_mut() {
            if let Some(c) = e.consumer.take() {
                c.abort();
            }
        }
    }
}
