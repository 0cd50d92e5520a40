//! The node agent, composed: start-up and reconciliation, the CNI socket server, and the
//! tasks of each plane it runs (cluster client, CSI, device plugins, node API, health).
//! It wires the planes together and owns the configuration; no plane imports it.

pub mod cluster;
pub mod config;
pub mod device_sync;
pub mod install;
mod kernel;
mod leftovers;
pub mod metrics;
pub mod policy_sync;
mod readiness;
pub mod service_sync;
pub mod status;
pub mod volume_sync;

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::net::cni::request::{self, Env};
use crate::net::cni::wire::{self, WireRequest};
use crate::net::cni::{Command, Reply, version_result};
use crate::net::datapath::Datapath;
use crate::net::reaper;
use crate::obs::metrics::StepLabels;
use config::Config;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error("{0}")]
    Setup(String),
}

fn io_ctx(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> AgentError {
    let context = context.into();
    move |source| AgentError::Io { context, source }
}

/// Exclusive lock on the state dir: two agents must never share leases.
fn lock_state_dir(dir: &Path, wait: Duration) -> Result<fs::File, AgentError> {
    fs::create_dir_all(dir).map_err(io_ctx(format!("creating {}", dir.display())))?;
    let path = dir.join("agent.lock");
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_ctx(format!("opening {}", path.display())))?;
    // The lock may be held for a moment by an agent on its way out: the one a rollout or a
    // restart replaces (kubelet starts the new container once the old one's process is gone,
    // but a child it was spawning shares the lock until that child execs). Wait a little, as
    // an operator would, before failing the start-up (and the container's restart back-off).
    let deadline = Instant::now() + wait;
    let mut waiting = false;
    loop {
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            if waiting {
                tracing::info!(lock = %path.display(), "state-dir lock acquired");
            }
            return Ok(f);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) || Instant::now() >= deadline {
            return Err(AgentError::Setup(format!("another agent holds {} ({err})", path.display())));
        }
        if !waiting {
            waiting = true;
            tracing::warn!(
                lock = %path.display(),
                "another agent holds the state-dir lock; waiting up to {} s for it to exit",
                wait.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How long a starting agent waits for the state-dir lock before giving up.
const STATE_LOCK_WAIT: Duration = Duration::from_secs(10);

/// Everything up to (not including) serving: returns the configuration, the datapath, the
/// bound listener and the state-directory lock.
#[allow(clippy::type_complexity)]
pub fn prepare(
    cfg: Config,
) -> Result<(Arc<Config>, Arc<Datapath>, std::os::unix::net::UnixListener, fs::File), AgentError> {
    let cfg = Arc::new(cfg);
    let lock = lock_state_dir(&cfg.state_dir, STATE_LOCK_WAIT)?;
    leftovers::remove(&leftovers::paths(&cfg));

    let boot_id = crate::sys::fs::read_boot_id(&cfg.boot_id_file).map_err(io_ctx("reading boot id"))?;
    let boot_file = cfg.state_dir.join("boot_id");
    let stored = fs::read_to_string(&boot_file).ok().map(|s| s.trim().to_string());
    let boot_changed = stored.as_deref().is_some_and(|s| s != boot_id);

    let (ipam, problems) =
        crate::net::ipam::Ipam::load(&cfg.lease_dir()).map_err(|e| AgentError::Setup(e.to_string()))?;
    for p in problems {
        tracing::warn!("{p}");
    }
    let kernel: Arc<dyn crate::net::datapath::NetKernel> = Arc::new(crate::sys::net_kernel::Kernel);
    let reaper = reaper::Reaper::start(kernel.clone()).map_err(io_ctx("starting reaper"))?;
    let publish_cfg = cfg.clone();
    let publish: crate::net::datapath::Publish = Box::new(move || {
        if install::install_shim(&publish_cfg).map_err(|e| format!("installing shim: {e}"))? {
            tracing::info!(dir = %publish_cfg.cni_bin_dir.display(), "installed shim");
        }
        install::write_conflist(&publish_cfg).map_err(|e| format!("writing conflist: {e}"))?;
        tracing::info!(conflist = %publish_cfg.conflist_path().display(), "conflist written");
        Ok(())
    });
    let dp = Arc::new(Datapath::new(cfg.net_settings(), ipam, reaper, publish, kernel));

    let report = dp.reconcile(boot_changed).map_err(|e| AgentError::Setup(format!("reconcile: {e}")))?;
    for f in &report.freed {
        tracing::info!(lease = %f, "freed stale lease");
    }
    tracing::info!(
        kept = report.kept,
        freed = report.freed.len(),
        reaped_links = report.reaped_links,
        boot_changed,
        "reconciled"
    );
    crate::sys::fs::atomic_write(&boot_file, boot_id.as_bytes(), 0o644).map_err(io_ctx("writing boot id"))?;

    let sock = &cfg.cni_socket;
    let listener = crate::sys::fs::bind_unix_listener(sock).map_err(io_ctx(format!("binding {}", sock.display())))?;

    dp.drain_pending();

    // Standalone: the configured blocks. Controller mode: the blocks last received (the
    // node keeps serving them while the controller is away); none yet means not ready.
    let (blocks, cluster) = match &cfg.controller {
        None => (cfg.pod_cidrs.clone(), cfg.cluster_cidrs.clone()),
        Some(_) => {
            let st = cluster::load_state(&cfg).map_err(|e| AgentError::Setup(format!("cluster state: {e}")))?;
            if st.strict {
                cluster::hold_strict(&st.cluster_cidrs).map_err(AgentError::Setup)?;
            }
            if cfg.mtu.is_none() && st.pod_mtu != 0 {
                dp.set_pod_mtu(st.pod_mtu);
            }
            (st.blocks, st.cluster_cidrs)
        }
    };
    dp.apply_network(&blocks, Some(&cluster)).map_err(|e| AgentError::Setup(e.to_string()))?;
    tracing::info!(node = %cfg.node_name, socket = %sock.display(), network_ready = dp.ready(), "ready");
    Ok((cfg, dp, listener, lock))
}

/// The CSI node service, when configured: opens the volume store (its directory lock keeps
/// two agents apart) and the record directory. Recovery runs when it is served.
pub fn prepare_csi(cfg: &Config) -> Result<Option<Arc<crate::storage::csi::NodeService>>, AgentError> {
    let Some(c) = &cfg.csi else { return Ok(None) };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(&cfg.kubelet_dir)
        .map_err(io_ctx(format!("creating {}", cfg.kubelet_dir.display())))?;
    let kubelet_dir =
        cfg.kubelet_dir.canonicalize().map_err(io_ctx(format!("resolving {}", cfg.kubelet_dir.display())))?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&c.volume_dir)
        .map_err(io_ctx(format!("creating {}", c.volume_dir.display())))?;
    let capacity = match c.capacity_bytes {
        Some(b) => b,
        None => {
            let st = nix::sys::statvfs::statvfs(&c.volume_dir)
                .map_err(|e| AgentError::Setup(format!("statfs {}: {e}", c.volume_dir.display())))?;
            let half = st.blocks() * st.fragment_size() / 2;
            tracing::info!(dir = %c.volume_dir.display(), capacity = half, "csi.capacityBytes not set: offering half the volume filesystem");
            half
        }
    };
    let mut store = crate::storage::store::VolumeStore::open(&c.volume_dir, capacity)
        .map_err(|e| AgentError::Setup(e.to_string()))?;
    if let Some(pool) = &c.lvm {
        store = store.with_thin_pool(pool.clone()).map_err(|e| AgentError::Setup(e.to_string()))?;
    } else if let Some(v) = store.list().into_iter().find(|v| v.backend == crate::storage::store::Backend::Lvm) {
        tracing::error!(volume = %v.id, "the store holds lvm volumes, but csi.lvm names no thin pool: they cannot be used");
    }
    let settings = crate::storage::csi::NodeSettings {
        node_id: cfg.node_name.clone(),
        kubelet_dir,
        record_dir: cfg.state_dir.join("csi"),
        max_volumes: c.max_volumes,
    };
    let svc = crate::storage::csi::NodeService::new(settings, Arc::new(store))
        .map_err(io_ctx("creating CSI record directories"))?;
    Ok(Some(Arc::new(svc)))
}

/// Answer one CNI invocation (blocking), with the CNI error code answered (`None`:
/// success). `netns`: the pod's network namespace as the shim opened it and passed it with
/// the request (ADD and CHECK need it; the runtime's path in `CNI_NETNS` is never resolved
/// here).
pub fn handle(dp: &Datapath, env: &Env, stdin: &[u8], netns: Option<std::os::fd::OwnedFd>) -> (Reply, Option<u32>) {
    let version = request::sniff_version(stdin);
    let command = match request::parse_command(env) {
        Ok(c) => c,
        Err(e) => return (Reply::error(&e, &version), Some(e.code as u32)),
    };
    if command == Command::Version {
        return (Reply::ok(&version_result(Some(&version))), None);
    }
    let req = match request::parse(env, stdin) {
        Ok(r) => r,
        Err(e) => return (Reply::error(&e, &version), Some(e.code as u32)),
    };
    let v = req.conf.cni_version.as_str();
    // Every event of this request carries the pod it is for (JSON logs: the "span" object).
    let span = tracing::info_span!(
        "cni",
        command = command.as_str(),
        container = %req.container_id,
        ifname = %req.ifname,
        pod_namespace = req.pod_namespace(),
        pod = req.pod_name(),
    );
    let _entered = span.enter();
    let pod_netns = || -> Result<Box<dyn crate::sys::net_kernel::PodNetns>, crate::net::datapath::NetError> {
        let path = req.netns.as_deref().expect("validated: ADD and CHECK have CNI_NETNS");
        let fd = netns.ok_or_else(|| {
            crate::net::datapath::NetError::NoDescriptor(format!(
                "the shim passed no descriptor of CNI_NETNS {} (a shim older than this agent, during an upgrade?); try again",
                path.display()
            ))
        })?;
        crate::sys::netns::Netns::from_fd(fd, path)
            .map(|n| Box::new(n) as Box<dyn crate::sys::net_kernel::PodNetns>)
            .map_err(crate::net::datapath::NetError::NoNetns)
    };
    let out = match command {
        Command::Add => pod_netns().and_then(|ns| dp.add(&req, ns)).map(|r| Reply::ok(&r.render(v))),
        Command::Del => dp.del(&req).map(|_| Reply::empty()),
        Command::Check => pod_netns().and_then(|ns| dp.check(&req, ns)).map(|_| Reply::empty()),
        Command::Gc => dp.gc(&req).map(|_| Reply::empty()),
        Command::Status => dp.status().map(|_| Reply::empty()),
        Command::Version => unreachable!("answered above"),
    };
    match out.map_err(crate::net::cni::CniError::from) {
        Ok(r) => (r, None),
        Err(e) => {
            tracing::warn!(command = command.as_str(), container = %req.container_id, ifname = %req.ifname, code = e.code as u32, error = %e.msg, "CNI request failed");
            (Reply::error(&e, v), Some(e.code as u32))
        }
    }
}

/// The first read of a request asks for this much: a whole request of a usual size (the
/// network configuration and environment: a few KiB).
const FIRST_READ: usize = 16 * 1024;

/// Read one request frame from the shim, with the descriptor it passed (`SCM_RIGHTS`), if
/// any. Blocking (the socket has a read timeout).
fn read_request(
    stream: &std::os::unix::net::UnixStream,
) -> std::io::Result<(WireRequest, Option<std::os::fd::OwnedFd>)> {
    use std::os::fd::AsFd;
    let mut fds = Vec::new();
    // Read until `buf` holds at least `want` bytes (more may come: the read asks for all of
    // `buf`'s room, so a request sent in one write is read in one call).
    let fill = |buf: &mut Vec<u8>, want: usize, fds: &mut Vec<std::os::fd::OwnedFd>| -> std::io::Result<()> {
        while buf.len() < want {
            let at = buf.len();
            buf.resize(buf.capacity().max(want), 0);
            let n = match crate::sys::fdpass::recv(stream.as_fd(), &mut buf[at..], fds) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "request read timed out"));
                }
                r => r.inspect_err(|_| buf.truncate(at))?,
            };
            buf.truncate(at + n);
            if n == 0 {
                return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the shim closed mid-request"));
            }
        }
        Ok(())
    };
    let mut buf = Vec::with_capacity(FIRST_READ);
    fill(&mut buf, 4, &mut fds)?;
    let len = wire::decode_len(buf[..4].try_into().expect("4 bytes"))?;
    buf.reserve_exact((4 + len).saturating_sub(buf.len()));
    fill(&mut buf, 4 + len, &mut fds)?;
    if buf.len() > 4 + len {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "bytes after the request"));
    }
    let body = &buf[4..];
    if fds.len() > 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} descriptors sent with one request", fds.len()),
        ));
    }
    let req: WireRequest =
        serde_json::from_slice(body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok((req, fds.pop()))
}

/// One shim connection, start to end, on a blocking thread: one request, one reply. No
/// hand-over between threads on the way (each costs a wake-up on the request's path).
fn serve_conn(dp: &Datapath, cni: &metrics::CniMetrics, stream: std::os::unix::net::UnixStream) -> std::io::Result<()> {
    use std::io::Write;
    let accepted = Instant::now();
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let (req, netns) = read_request(&stream)?;
    let started = Instant::now();
    let cmd = req.env.get("CNI_COMMAND").cloned().unwrap_or_default();
    // Only known commands become label values: the environment is the caller's input.
    let label = Command::parse(&cmd).map_or("unknown", |c| c.as_str());
    dp.steps.get_or_create(&StepLabels { command: label, step: "read" }).observe((started - accepted).as_secs_f64());
    let (reply, code) = handle(dp, &req.env, req.stdin.as_bytes(), netns);
    let elapsed = started.elapsed();
    cni.observe(label, code, elapsed.as_secs_f64());
    tracing::debug!(command = %cmd, exit = reply.exit_code, micros = elapsed.as_micros() as u64, "cni");
    let answering = Instant::now();
    // The shim reads exactly the frame; the connection is closed when `stream` drops, after
    // the answer is on its way.
    let r = (&stream).write_all(&wire::encode(&reply)?);
    dp.steps.get_or_create(&StepLabels { command: label, step: "reply" }).observe(answering.elapsed().as_secs_f64());
    r
}

/// Serve the CNI socket until `stop`, each connection start to end on a blocking thread (50
/// ADDs at once are served at once). At `stop` (the socket file is gone by then), what is
/// queued already is accepted and served too; returns when every connection is served.
async fn serve_cni(
    listener: tokio::net::UnixListener,
    mut stop: tokio::sync::watch::Receiver<bool>,
    serve: impl Fn(std::os::unix::net::UnixStream) + Clone + Send + Sync + 'static,
) {
    let mut conns = tokio::task::JoinSet::new();
    let spawn = |conns: &mut tokio::task::JoinSet<()>, stream: std::io::Result<std::os::unix::net::UnixStream>| {
        let serve = serve.clone();
        match stream.and_then(|s| s.set_nonblocking(false).map(|()| s)) {
            Ok(stream) => drop(conns.spawn_blocking(move || serve(stream))),
            Err(e) => tracing::warn!(error = %e, "accepting a CNI connection"),
        }
    };
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => spawn(&mut conns, stream.into_std()),
                Err(e) => {
                    // EMFILE, ENOMEM: the connection stays queued; try again shortly.
                    tracing::warn!(error = %e, "accepting a CNI connection");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = stop.changed() => break,
        }
    }
    // What is queued already, without waiting for more: a non-blocking accept answers
    // WouldBlock once the queue is empty.
    match listener.into_std() {
        Ok(listener) => loop {
            match listener.accept() {
                Ok((stream, _)) => spawn(&mut conns, Ok(stream)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => break tracing::warn!(error = %e, "accepting a queued CNI connection"),
            }
        },
        Err(e) => tracing::warn!(error = %e, "accepting the queued CNI connections"),
    }
    while conns.join_next().await.is_some() {}
}

/// Serve the CNI socket until SIGTERM/SIGINT, then finish in-flight requests.
///
/// The health endpoint (`healthAddress`) is bound first, so a bad or taken address fails
/// the start, and it answers from then on: during CSI recovery and until shutdown is done
/// (readiness turns false as soon as the shutdown begins).
pub async fn serve(
    cfg: Arc<Config>,
    dp: Arc<Datapath>,
    listener: std::os::unix::net::UnixListener,
    csi: Option<Arc<crate::storage::csi::NodeService>>,
) -> Result<(), AgentError> {
    let link = cfg.controller.as_ref().map(|_| Arc::new(cluster::Link::default()));
    let inventory = cfg.device_plugins.as_ref().map(|_| crate::devices::deviceplugin::Inventory::default());
    // What kubelet answered each plugin's registration (CSI, device plugins).
    let book = crate::kubelet::Registrations::new(cfg.kubelet_registration_grace, cfg.require_kubelet_registration);
    // Services (controller mode): the hairpin hook is in place before the first ADD is read.
    let services = service_sync::install(&cfg);
    let sources = metrics::Sources {
        cfg: cfg.clone(),
        dp: dp.clone(),
        csi: csi.clone(),
        devices: inventory.clone(),
        link: link.clone(),
        kubelet: book.clone(),
        services: services.clone(),
    };
    let (registry, cni_metrics) = metrics::build(sources.clone());
    let health = crate::obs::health::Health::new().with_metrics(Arc::new(move || registry.render()));
    // The conditions exist before the endpoint answers: it never says ready too early.
    let devices_ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ended = cfg.device_plugins.as_ref().map(|_| devices_ended.clone());
    let mut readiness = readiness::Readiness::new(&health, cfg.clone(), dp.clone(), csi.clone(), ended, book.clone());
    // What the kernel offers of what this agent uses: logged, in status, in readiness.
    let kernel = Arc::new(kernel::check(&cfg, &health).await);
    let (health_stop, health_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let health_task = match cfg.health_address {
        None => None,
        Some(addr) => {
            let l = match crate::obs::health::bind(&addr.to_string()) {
                Ok(l) => l,
                Err(e) => {
                    let _ = fs::remove_file(&cfg.cni_socket);
                    return Err(AgentError::Setup(format!("healthAddress {addr}: {e}")));
                }
            };
            Some(tokio::spawn(crate::obs::health::serve(l, health.clone(), None, async move {
                let _ = health_stop_rx.await;
            })))
        }
    };
    let node_listener = match crate::sys::fs::bind_unix_socket(&cfg.node_socket) {
        Ok(l) => l,
        Err(e) => {
            let _ = fs::remove_file(&cfg.cni_socket);
            return Err(AgentError::Setup(format!("binding {}: {e}", cfg.node_socket.display())));
        }
    };
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(io_ctx("signal"))?;
    let mut int =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(io_ctx("signal"))?;
    let mut drain_tick = tokio::time::interval(Duration::from_secs(5));
    drain_tick.tick().await;
    if let Some(l) = &link {
        readiness.watch_encryption(&health, l.clone());
    }
    let cluster_client = tokio::spawn(cluster::run(cfg.clone(), dp.clone(), link.clone().unwrap_or_default()));
    // NetworkPolicy (controller mode): the hook is in place before the first ADD is read.
    let policy = policy_sync::install(&cfg, &dp);
    if let Some(p) = &policy {
        readiness.watch_policy(&health, p.clone());
    }
    let policy_task = policy.clone().map(|p| tokio::spawn(policy_sync::run(p, dp.clone())));
    let services_task = services.clone().map(|s| tokio::spawn(service_sync::run(s)));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let volume_client = csi.clone().map(|svc| tokio::spawn(volume_sync::run(cfg.clone(), svc)));
    let device_plugins = cfg.device_plugins.clone().map(|s| {
        let (rx, ended, inv, book) =
            (stop_rx.clone(), devices_ended.clone(), inventory.clone().unwrap_or_default(), book.clone());
        tokio::spawn(async move {
            crate::devices::deviceplugin::run_with(s, rx, inv, book).await;
            ended.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    });
    let dra = cfg.dra.clone().map(|s| {
        // One inventory for kubelet (dra.sock) and the controller (the ResourceSlices).
        let devices = Arc::new(crate::devices::dra::Devices::default());
        let reporter = tokio::spawn(device_sync::run(cfg.clone(), devices.clone(), book.clone()));
        let plugin = tokio::spawn(crate::devices::dra::run(
            s,
            stop_rx.clone(),
            book.clone(),
            devices,
            device_sync::claim_lookup(&cfg),
        ));
        (plugin, reporter)
    });
    let readiness_task = tokio::spawn(readiness.run());
    let node_api =
        status::NodeStatus { src: sources, health: health.clone(), kernel, started: std::time::SystemTime::now() };
    let node_api_task = {
        let mut rx = stop_rx.clone();
        tokio::spawn(status::serve_node_api(node_api, node_listener, async move {
            let _ = rx.wait_for(|v| *v).await;
        }))
    };
    let mut csi_task = csi.map(|svc| {
        let mut rx = stop_rx.clone();
        let book = cfg.csi.as_ref().is_some_and(|c| c.self_register).then(|| book.clone());
        tokio::spawn(crate::storage::csi::serve(svc, book, async move {
            let _ = rx.wait_for(|v| *v).await;
        }))
    });
    // The CNI socket is served from here on: the policy hook is in place (above).
    let (cni_stop, cni_stopping) = tokio::sync::watch::channel(false);
    let cni_task = {
        listener.set_nonblocking(true).map_err(io_ctx("serving the CNI socket"))?;
        let listener = tokio::net::UnixListener::from_std(listener).map_err(io_ctx("serving the CNI socket"))?;
        let (dp, cni) = (dp.clone(), cni_metrics.clone());
        tokio::spawn(serve_cni(listener, cni_stopping, move |stream| {
            if let Err(e) = serve_conn(&dp, &cni, stream) {
                tracing::warn!(error = %e, "CNI connection");
            }
        }))
    };
    loop {
        tokio::select! {
            _ = drain_tick.tick() => {
                let dp = dp.clone();
                let _ = tokio::task::spawn_blocking(move || dp.drain_pending()).await;
            }
            _ = term.recv() => break,
            _ = int.recv() => break,
            Some(r) = async { match &mut csi_task { Some(t) if !t.is_finished() => Some(t.await), _ => None } } => {
                // The CSI server only ends early on a start-up failure: fail the agent
                // (the DaemonSet restarts it) rather than run without volumes.
                let msg = match r {
                    Ok(Ok(())) => "CSI server ended unexpectedly".to_string(),
                    Ok(Err(e)) => e,
                    Err(e) => e.to_string(),
                };
                let _ = fs::remove_file(&cfg.cni_socket);
                readiness_task.abort();
                return Err(AgentError::Setup(msg));
            }
        }
    }
    // New shims must find no socket (they wait for the next agent) rather than queue on a
    // listener nobody will accept from; what is queued already is served.
    let _ = fs::remove_file(&cfg.cni_socket);
    let _ = cni_stop.send(true);
    // Not ready from here on; liveness keeps answering until the end.
    readiness_task.abort();
    let _ = readiness_task.await;
    for (name, _, _) in health.snapshot() {
        health.condition(&name).set(false, "the agent is shutting down");
    }
    if let Some(v) = volume_client {
        v.abort();
    }
    let _ = stop_tx.send(true);
    if let Some(t) = device_plugins {
        let _ = t.await;
    }
    if let Some((plugin, reporter)) = dra {
        reporter.abort();
        let _ = plugin.await;
    }
    if let Some(t) = csi_task {
        let _ = t.await;
    }
    // A doctor in progress is not worth holding the shutdown for long.
    match tokio::time::timeout(Duration::from_secs(5), node_api_task).await {
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "node API"),
        Ok(Err(e)) => tracing::warn!(error = %e, "node API task"),
        Ok(Ok(Ok(()))) => {}
        Err(_) => tracing::warn!("node API calls still running after 5 s; not waiting for them"),
    }
    tracing::info!("shutting down: no new requests; finishing in-flight ones");
    cluster_client.abort();
    if let Some(t) = policy_task {
        t.abort();
    }
    // The Services table stays: pods keep reaching Services while the agent restarts.
    if let Some(t) = services_task {
        t.abort();
    }
    if tokio::time::timeout(Duration::from_secs(30), cni_task).await.is_err() {
        tracing::warn!("in-flight requests did not finish within 30s");
    }
    let _ = health_stop.send(());
    if let Some(t) = health_task {
        match t.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "health endpoint"),
            Err(e) => tracing::warn!(error = %e, "health endpoint task"),
            Ok(Ok(())) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod cni_socket_tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Condvar, Mutex};

    type Gate = Arc<(Mutex<bool>, Condvar)>;

    /// `serve_cni` on a socket of its own, every connection held at `gate` (closed), then
    /// answered with the byte it sent.
    struct Served {
        _dir: crate::util::TestDir,
        path: std::path::PathBuf,
        rt: tokio::runtime::Runtime,
        stop: tokio::sync::watch::Sender<bool>,
        task: Option<tokio::task::JoinHandle<()>>,
        gate: Gate,
        inside: Arc<AtomicUsize>,
        most: Arc<AtomicUsize>,
        served: Arc<AtomicUsize>,
    }

    fn serve(tag: &str) -> Served {
        let dir = crate::util::TestDir::new(tag);
        let path = dir.0.join("s.sock");
        let l = UnixListener::bind(&path).unwrap();
        l.set_nonblocking(true).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let gate: Gate = Arc::new((Mutex::new(false), Condvar::new()));
        let [inside, most, served] = [(); 3].map(|_| Arc::new(AtomicUsize::new(0)));
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let (g, i, m, sv) = (gate.clone(), inside.clone(), most.clone(), served.clone());
        let handler = move |mut s: UnixStream| {
            m.fetch_max(i.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            let mut open = g.0.lock().unwrap();
            while !*open {
                open = g.1.wait(open).unwrap();
            }
            drop(open);
            i.fetch_sub(1, Ordering::SeqCst);
            let mut b = [0u8; 1];
            if s.read_exact(&mut b).is_ok() {
                let _ = s.write_all(&b);
            }
            sv.fetch_add(1, Ordering::SeqCst);
        };
        let l = {
            let _rt = rt.enter();
            tokio::net::UnixListener::from_std(l).unwrap()
        };
        let task = rt.spawn(serve_cni(l, stopping, handler));
        Served { _dir: dir, path, rt, stop, task: Some(task), gate, inside, most, served }
    }

    /// A failing test ends rather than hangs: the runtime's drop waits for the handlers.
    impl Drop for Served {
        fn drop(&mut self) {
            self.open();
        }
    }

    impl Served {
        fn connect(&self, n: u8) -> UnixStream {
            let mut c = UnixStream::connect(&self.path).unwrap();
            c.write_all(&[n]).unwrap();
            c
        }
        fn open(&self) {
            *self.gate.0.lock().unwrap() = true;
            self.gate.1.notify_all();
        }
        /// Whether `serve_cni` returned within `limit`.
        fn ended_within(&mut self, limit: Duration) -> bool {
            let task = self.task.take().unwrap();
            let waited = self.rt.block_on(async { tokio::time::timeout(limit, task).await });
            waited.is_ok()
        }
    }

    #[test]
    fn many_connections_at_once_are_served_at_once() {
        let mut s = serve("cni-burst");
        let clients: Vec<_> = (0..20u8).map(|n| (n, s.connect(n))).collect();
        // All 20 are inside the handler together: none waits for another to finish.
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.inside.load(Ordering::SeqCst) < 20 {
            assert!(Instant::now() < deadline, "only {} served at once", s.inside.load(Ordering::SeqCst));
            std::thread::sleep(Duration::from_millis(5));
        }
        s.open();
        for (n, mut c) in clients {
            let mut b = [0u8; 1];
            c.read_exact(&mut b).unwrap();
            assert_eq!(b[0], n);
        }
        assert_eq!(s.most.load(Ordering::SeqCst), 20);
        s.stop.send(true).unwrap();
        assert!(s.ended_within(Duration::from_secs(5)));
    }

    #[test]
    fn stopping_serves_what_is_queued_and_then_ends() {
        let mut s = serve("cni-stop");
        let mut clients: Vec<_> = (0..5u8).map(|n| s.connect(n)).collect();
        s.stop.send(true).unwrap();
        // Not done while requests are held inside the handler.
        std::thread::sleep(Duration::from_millis(100));
        assert!(!s.task.as_ref().unwrap().is_finished());
        s.open();
        assert!(s.ended_within(Duration::from_secs(10)), "still serving after stop");
        assert_eq!(s.served.load(Ordering::SeqCst), 5);
        for (n, c) in clients.iter_mut().enumerate() {
            let mut b = [0u8; 1];
            c.read_exact(&mut b).unwrap();
            assert_eq!(b[0] as usize, n);
        }
    }
}

#[cfg(test)]
mod lock_tests {
    use super::*;

    fn hold(dir: &Path) -> fs::File {
        let f = fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join("agent.lock")).unwrap();
        // SAFETY: flock on a descriptor we own.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        f
    }

    #[test]
    fn a_lock_released_within_the_wait_is_taken() {
        let dir = crate::util::TestDir::new("lock-released");
        let held = hold(&dir.0);
        let t = Instant::now();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        let lock = lock_state_dir(&dir.0, Duration::from_secs(5)).expect("taken once released");
        assert!(t.elapsed() >= Duration::from_millis(150), "it waited for the holder");
        releaser.join().unwrap();
        // Now this process holds it: another open of the file cannot take it.
        let other = fs::OpenOptions::new().write(true).open(dir.0.join("agent.lock")).unwrap();
        // SAFETY: as above.
        assert_ne!(unsafe { libc::flock(other.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        drop(lock);
    }

    #[test]
    fn a_lock_still_held_after_the_wait_fails_the_start() {
        let dir = crate::util::TestDir::new("lock-held");
        let _held = hold(&dir.0);
        let t = Instant::now();
        let err = lock_state_dir(&dir.0, Duration::from_millis(300)).expect_err("still held");
        assert!(t.elapsed() >= Duration::from_millis(300));
        assert!(err.to_string().contains("another agent holds"), "{err}");
    }
}
