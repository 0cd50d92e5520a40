//! The cluster-side controller, composed: node registry and pod block allocation, the
//! membership stream, the volume book and the CSI Controller service, on redb or on the
//! Kubernetes API (leader-elected).

pub mod auth;
pub mod backend;
pub mod certs;
pub mod config;
pub mod csi;
pub mod dra;
pub mod keys;
pub mod kube;
pub mod metrics;
pub mod policy;
pub mod records;
pub mod server;
pub mod services;
pub mod store;
pub mod volumes;

use std::sync::Arc;

use crate::rpc::Listen;
use config::Config;

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error(transparent)]
    Registry(#[from] store::RegistryError),
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("volume book: {0}")]
    Volumes(String),
    #[error("Kubernetes: {0}")]
    Kube(String),
    #[error("TLS: {0}")]
    Tls(#[from] crate::rpc::tls::TlsError),
    #[error("TLS: {0}")]
    Certs(#[from] certs::CertError),
    #[error("leadership lost: {0}")]
    LostLeadership(String),
    #[error("policy and service objects: {0}")]
    Objects(#[from] policy::model::ObjectError),
}

fn io_ctx(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ControllerError {
    let context = context.into();
    move |source| ControllerError::Io { context, source }
}

/// Wait for SIGTERM or SIGINT.
async fn termination() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// The token authority: its keys from the file, or (Kubernetes mode) from the Secret, made
/// once if missing.
pub async fn token_authority(
    cfg: &Config,
    client: Option<&::kube::Client>,
) -> Result<auth::Authority, ControllerError> {
    match &cfg.token_secret {
        config::TokenSecret::File(path) => {
            let secret =
                auth::load_or_create_secret(path).map_err(io_ctx(format!("token secret {}", path.display())))?;
            Ok(auth::Authority::new(secret))
        }
        config::TokenSecret::Kubernetes { namespace, name } => {
            let client = match client {
                Some(c) => c.clone(),
                None => kube::client().await.map_err(ControllerError::Kube)?,
            };
            let keys = kube::secret::load_or_create(client, namespace, name).await.map_err(ControllerError::Kube)?;
            tracing::info!(secret = %format!("{namespace}/{name}"), rollover = keys.previous.is_some(), "token signing keys loaded");
            Ok(auth::Authority::with_keys(keys.current, keys.previous))
        }
    }
}

/// Serve the agent API until SIGTERM/SIGINT (or, in Kubernetes mode, until leadership is
/// lost: then the error says so and the process exits non-zero for its Deployment to
/// restart it as a candidate).
pub async fn serve(cfg: Config) -> Result<(), ControllerError> {
    std::fs::create_dir_all(&cfg.data_dir).map_err(io_ctx(format!("creating {}", cfg.data_dir.display())))?;
    let (stop_tx, stopping) = tokio::sync::watch::channel(false);
    let health = crate::obs::health::Health::new();
    let leading = health.condition("leader");
    let serving = health.condition("serving");
    let metrics = metrics::ControllerMetrics::new(leading.clone());
    let health = {
        let r = metrics.registry.clone();
        health.with_metrics(Arc::new(move || r.render()))
    };
    // Bound first so a bad or taken address fails the start; served once the serving
    // certificate is loaded (the endpoint is TLS whenever the agent API is).
    let health_listener = match cfg.health_address {
        Some(addr) => Some(
            crate::obs::health::bind(&addr.to_string()).map_err(io_ctx(format!("binding health address {addr}")))?,
        ),
        None => None,
    };
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            termination().await;
            tracing::info!("shutting down");
            let _ = stop_tx.send(true);
        });
    }
    let client = if cfg.uses_kubernetes() { Some(kube::client().await.map_err(ControllerError::Kube)?) } else { None };
    let mut authority = token_authority(&cfg, client.as_ref()).await?;
    if let (config::AgentAuth::TokenReview { audience, service_account }, Some(c)) = (&cfg.agent_auth, &client) {
        authority = authority.with_reviewer(kube::review::TokenReviewer::new(c.clone(), audience, service_account));
        tracing::info!(audience = %audience, service_account = %service_account, "agents authenticate with projected service-account tokens (TokenReview)");
    }
    // The serving certificate (made first, in Kubernetes mode with tls.bootstrap): a
    // certificate that does not load stops the start here, before anything is served.
    let acceptor = match &cfg.tls {
        Some(t) => {
            if let (Some(b), Some(c)) = (&t.bootstrap, &client) {
                kube::tls::bootstrap(c.clone(), b, &t.files).await?;
            }
            Some(crate::rpc::tls::Acceptor::load(t.files.clone())?)
        }
        None => None,
    };
    if cfg.insecure {
        tracing::warn!(listen = ?cfg.listen, health = ?cfg.health_address, "insecure: true: the TCP listeners serve plaintext, so bearer tokens cross the network readable by anyone on it; configure tls");
    }
    // Every TLS listener follows the files (the agent API's and the health endpoint's).
    let reloader = acceptor.as_ref().zip(cfg.tls.as_ref()).map(|(a, t)| a.watch(t.reload, stopping.clone()));
    let health_task = health_listener.map(|l| {
        let mut s = stopping.clone();
        let tls = acceptor.clone().map(|a| -> crate::obs::health::TlsSource { Arc::new(move || a.http1_config()) });
        tokio::spawn(crate::obs::health::serve(l, health.clone(), tls, async move {
            let _ = s.wait_for(|v| *v).await;
        }))
    });
    // Leadership first (Kubernetes mode): nobody but the leader reads or writes the state.
    let mut elector = None;
    let backend: Arc<dyn backend::Backend> = match (&cfg.store, &client) {
        (config::Store::Kubernetes(k), Some(c)) => {
            let mut el = kube::lease::Elector::new(c.clone(), k.clone());
            leading.set(false, "waiting for the leader lease");
            tracing::info!(lease = %format!("{}/{}", k.namespace, k.lease_name), identity = %k.identity, "waiting to lead");
            let mut s = stopping.clone();
            tokio::select! {
                _ = el.acquire(|why| leading.set(false, format!("not the leader: lease {why}"))) => {}
                _ = s.wait_for(|v| *v) => return Ok(()),
            }
            leading.set(true, format!("holding lease {}/{}", k.namespace, k.lease_name));
            let fence = el.fence();
            elector = Some(el);
            let kcfg = kube::config().await.map_err(ControllerError::Kube)?;
            Arc::new(
                tokio::task::spawn_blocking(move || kube::state::KubeBackend::new(kcfg, Some(fence)))
                    .await
                    .map_err(|e| ControllerError::Kube(e.to_string()))?
                    .map_err(|e| ControllerError::Kube(e.to_string()))?,
            )
        }
        _ => {
            leading.set(true, "embedded store: a single controller");
            backend::RedbBackend::open(&cfg.data_dir.join("registry.redb"))
                .map_err(|e| ControllerError::Registry(store::RegistryError::Storage(e)))?
        }
    };
    // Renew the lease in the background; losing it stops everything at once.
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let (lost_tx, mut lost_rx) = tokio::sync::watch::channel(None::<String>);
    let keeper = elector.map(|mut el| {
        let stop_tx = stop_tx.clone();
        let leading = leading.clone();
        tokio::spawn(async move {
            if let Some(why) = el
                .keep(async {
                    let _ = release_rx.await;
                })
                .await
            {
                tracing::error!(reason = %why, "leadership lost: stopping");
                leading.set(false, format!("leadership lost: {why}"));
                let _ = lost_tx.send(Some(why));
                let _ = stop_tx.send(true);
            }
        })
    });
    let (registry, book) = {
        let (b, pools, grace, capacity_grace) =
            (backend.clone(), cfg.pools.clone(), cfg.orphan_grace, cfg.capacity_grace);
        tokio::task::spawn_blocking(move || -> Result<_, ControllerError> {
            let registry = store::Registry::with_backend(b.clone(), pools)?;
            let mut book = volumes::VolumeBook::open(b, grace).map_err(|e| ControllerError::Volumes(e.to_string()))?;
            book.capacity_grace = capacity_grace;
            Ok((Arc::new(registry), Arc::new(book)))
        })
        .await
        .map_err(|e| ControllerError::Volumes(e.to_string()))??
    };
    metrics.loaded(registry.clone(), book.clone());
    let snap = registry.snapshot();
    tracing::info!(store = %backend.describe(), nodes = snap.nodes.len(), volumes = book.list().len(), revision = snap.revision, pools = ?cfg.cluster_cidrs(), "state loaded");
    // In a cluster, registration follows the Node objects: a node without one (deleted while
    // its agent still runs) is refused, also between relists.
    let (follower, node_gate) = match (&cfg.store, &client) {
        (config::Store::Kubernetes(_), Some(c)) => {
            let gate = kube::nodes::NodeGate::new(c.clone());
            let g = gate.clone();
            registry.set_admission(Arc::new(move |name: &str| g.refused(name)));
            let task = tokio::spawn(kube::nodes::follow(c.clone(), registry.clone(), gate.clone(), stopping.clone()));
            (Some(task), Some(gate))
        }
        _ => (None, None),
    };
    // DRA: the nodes' devices as ResourceSlices (the API in a cluster, files locally).
    let devices = Arc::new(dra::DeviceBook::default());
    let (sink, claims): (Arc<dyn dra::SliceSink>, _) = match &client {
        Some(c) if cfg.uses_kubernetes() => (
            Arc::new(kube::slices::KubeSlices::new(c.clone())),
            Some(Arc::new(kube::slices::KubeClaims::new(c.clone()))),
        ),
        _ => (Arc::new(dra::DirSink::new(cfg.data_dir.join("resourceslices"))), None),
    };
    let publisher =
        tokio::spawn(dra::Publisher { book: devices.clone(), registry: registry.clone(), sink }.run(stopping.clone()));
    // NetworkPolicy: objects from the API in a cluster, applied with `nodeplane policy` here.
    let local_policy = !cfg.uses_kubernetes();
    let local_file = |name: &str| local_policy.then(|| cfg.data_dir.join(name));
    let policy_book = policy::PolicyBook::new(local_file("policy-objects.json"))?;
    let book_of_policy = policy_book.clone();
    registry.on_removal(Arc::new(move |node| book_of_policy.forget_node(node)));
    metrics.registry.register(
        "nodeplane_controller_policy_compile_seconds",
        "Time to recompile every node's NetworkPolicy view after a change.",
        policy_book.compile_seconds.clone(),
    );
    // Services: from the API in a cluster, applied with `nodeplane service` here.
    let service_book = services::ServiceBook::new(cfg.cluster_cidrs(), local_file("service-objects.redb"))?;
    // In a cluster both books follow the API.
    let book_follower = client.as_ref().filter(|_| !local_policy).map(|c| {
        let policy = kube::policy::follow(c.clone(), policy_book.clone(), stopping.clone());
        let services = kube::services::follow(c.clone(), service_book.clone(), stopping.clone());
        tokio::spawn(async move {
            tokio::join!(policy, services);
        })
    });
    let authority = Arc::new(authority);
    let cfg = Arc::new(cfg);
    let svc = server::Service {
        registry,
        volumes: book.clone(),
        authority,
        cfg: cfg.clone(),
        stopping: stopping.clone(),
        requests: metrics.requests.clone(),
        node_gate,
        devices,
        claims,
        node_events: client
            .as_ref()
            .map(|c| Arc::new(kube::events::NodeEvents::new(c.clone(), std::env::var("POD_NAME").ok()))),
    };
    let svc = Arc::new(svc);
    let policy_svc = policy::server::Service { book: policy_book.clone(), registry: svc.clone() };
    let services_svc = services::server::Service { book: service_book, registry: svc.clone() };
    let until_stopped = |mut s: tokio::sync::watch::Receiver<bool>| async move {
        let _ = s.wait_for(|v| *v).await;
    };
    // CSI Identity + Controller for the sidecars, on their own Unix socket (0600).
    let csi_listener = crate::sys::fs::bind_unix_socket(&cfg.csi_socket)
        .map_err(io_ctx(format!("binding {}", cfg.csi_socket.display())))?;
    let csi_server = tonic::transport::Server::builder()
        .layer(crate::rpc::response_layer())
        .add_service(crate::rpc::csi::identity_server::IdentityServer::new(crate::storage::csi::Identity {
            node: None,
        }))
        .add_service(crate::rpc::csi::controller_server::ControllerServer::new(csi::ControllerService {
            book: book.clone(),
            op_timeout: cfg.volume_op_timeout,
            keys: Arc::new(key_store(&cfg, client.as_ref())),
        }))
        .serve_with_incoming_shutdown(crate::rpc::authority::incoming(csi_listener), until_stopped(stopping.clone()));
    let csi_task = tokio::spawn(csi_server);
    tracing::info!(socket = %cfg.csi_socket.display(), "CSI Identity and Controller served");
    let router = tonic::transport::Server::builder()
        .layer(crate::rpc::response_layer())
        .add_service(crate::rpc::controller::node_registry_server::NodeRegistryServer::from_arc(svc))
        .add_service(crate::rpc::controller::network_policies_server::NetworkPoliciesServer::new(policy_svc))
        .add_service(crate::rpc::controller::services_server::ServicesServer::new(services_svc));
    let served = match &cfg.listen {
        Listen::Unix(path) => {
            let listener =
                crate::sys::fs::bind_unix_socket(path).map_err(io_ctx(format!("binding {}", path.display())))?;
            tracing::info!(socket = %path.display(), "ready");
            serving.set(true, format!("serving on {}", path.display()));
            let incoming = crate::rpc::authority::incoming(listener);
            let r = router.serve_with_incoming_shutdown(incoming, until_stopped(stopping.clone())).await;
            let _ = std::fs::remove_file(path);
            r
        }
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(io_ctx(format!("binding {addr}")))?;
            let local = listener.local_addr().map_err(io_ctx("local addr"))?;
            match (acceptor, &cfg.tls) {
                (Some(acceptor), Some(t)) => {
                    tracing::info!(
                        address = %local,
                        cert = %t.files.cert_file.display(),
                        client_certificates = t.files.client_ca_file.is_some(),
                        "ready (TLS)"
                    );
                    serving.set(true, format!("serving on {local} (TLS)"));
                    let incoming = crate::rpc::tls::incoming(listener, acceptor);
                    router.serve_with_incoming_shutdown(incoming, until_stopped(stopping.clone())).await
                }
                _ => {
                    tracing::info!(address = %local, "ready (plaintext: insecure)");
                    serving.set(true, format!("serving on {local} (plaintext, insecure)"));
                    // TCP_NODELAY as on the TLS path: without it small answers wait for the
                    // client's delayed ACK (40 ms stalls, seen in bench-cluster's p99).
                    use tokio_stream::StreamExt;
                    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|r| {
                        r.inspect(|s| {
                            let _ = s.set_nodelay(true);
                        })
                    });
                    router.serve_with_incoming_shutdown(incoming, until_stopped(stopping.clone())).await
                }
            }
        }
    };
    serving.set(false, "stopped");
    let _ = stop_tx.send(true);
    if let Some(r) = reloader {
        r.abort();
    }
    let _ = csi_task.await;
    let _ = publisher.await;
    let _ = std::fs::remove_file(&cfg.csi_socket);
    for f in [follower, book_follower].into_iter().flatten() {
        let _ = f.await;
    }
    // Nothing is served any more: only now may a successor take over.
    let _ = release_tx.send(());
    if let Some(k) = keeper {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), k).await;
    }
    if let Some(t) = health_task {
        let _ = t.await;
    }
    served?;
    if let Some(why) = lost_rx.borrow_and_update().clone() {
        return Err(ControllerError::LostLeadership(why));
    }
    Ok(())
}

/// Where the encrypted volumes' keys live: Secrets in Kubernetes mode, files in local mode.
fn key_store(cfg: &config::Config, client: Option<&::kube::Client>) -> keys::KeyStore {
    match (&cfg.store, client) {
        (config::Store::Kubernetes(k), Some(c)) => {
            keys::KeyStore::Secrets { client: c.clone(), namespace: k.namespace.clone() }
        }
        _ => keys::KeyStore::Dir(cfg.data_dir.join("keys")),
    }
}
