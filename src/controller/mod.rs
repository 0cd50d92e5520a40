//! The cluster-side controller: node registry, pod block allocation, membership stream.

pub mod auth;
pub mod config;
pub mod csi;
pub mod server;
pub mod store;
pub mod volumes;

use std::sync::Arc;

use config::{Config, Listen};

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
}

fn io_ctx(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ControllerError {
    let context = context.into();
    move |source| ControllerError::Io { context, source }
}

/// Open the registry and the signing secret (everything but the network).
pub fn open(cfg: &Config) -> Result<(Arc<store::Registry>, Arc<auth::Authority>), ControllerError> {
    std::fs::create_dir_all(&cfg.data_dir).map_err(io_ctx(format!("creating {}", cfg.data_dir.display())))?;
    let secret = auth::load_or_create_secret(&cfg.secret_file).map_err(io_ctx("token secret"))?;
    let registry = store::Registry::open(&cfg.data_dir.join("registry.redb"), cfg.pools.clone())?;
    Ok((Arc::new(registry), Arc::new(auth::Authority::new(secret))))
}

/// Serve the agent API until SIGTERM/SIGINT.
pub async fn serve(cfg: Config) -> Result<(), ControllerError> {
    let (registry, authority) = open(&cfg)?;
    let snap = registry.snapshot();
    tracing::info!(nodes = snap.nodes.len(), revision = snap.revision, pools = ?cfg.cluster_cidrs(), "registry loaded");
    let book = Arc::new(volumes::VolumeBook::open(registry.database(), cfg.orphan_grace).map_err(|e| ControllerError::Volumes(e.message().to_string()))?);
    tracing::info!(volumes = book.list().len(), "volume book loaded");
    let cfg = Arc::new(cfg);
    let (stop_tx, stopping) = tokio::sync::watch::channel(false);
    let svc = server::Service { registry, volumes: book.clone(), authority, cfg: cfg.clone(), stopping: stopping.clone() };
    // CSI Identity + Controller for the sidecars, on their own Unix socket (0600).
    let csi_listener = crate::util::bind_unix_socket(&cfg.csi_socket).map_err(io_ctx(format!("binding {}", cfg.csi_socket.display())))?;
    let csi_server = tonic::transport::Server::builder()
        .add_service(crate::rpc::csi::identity_server::IdentityServer::new(crate::csi::Identity { node: None }))
        .add_service(crate::rpc::csi::controller_server::ControllerServer::new(csi::ControllerService {
            book: book.clone(),
            op_timeout: cfg.volume_op_timeout,
        }))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(csi_listener), {
            let mut s = stopping.clone();
            async move {
                let _ = s.wait_for(|v| *v).await;
            }
        });
    let csi_task = tokio::spawn(csi_server);
    tracing::info!(socket = %cfg.csi_socket.display(), "CSI Identity and Controller served");
    let router = tonic::transport::Server::builder()
        .add_service(crate::rpc::controller::node_registry_server::NodeRegistryServer::new(svc));
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutting down");
        // End the (endless) membership streams so the graceful shutdown can complete.
        let _ = stop_tx.send(true);
    };
    match &cfg.listen {
        Listen::Unix(path) => {
            let listener = crate::util::bind_unix_socket(path).map_err(io_ctx(format!("binding {}", path.display())))?;
            tracing::info!(socket = %path.display(), "ready");
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            router.serve_with_incoming_shutdown(incoming, shutdown).await?;
            let _ = std::fs::remove_file(path);
        }
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr).await.map_err(io_ctx(format!("binding {addr}")))?;
            tracing::info!(address = %listener.local_addr().map_err(io_ctx("local addr"))?, "ready");
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            router.serve_with_incoming_shutdown(incoming, shutdown).await?;
        }
    }
    let _ = csi_task.await;
    let _ = std::fs::remove_file(&cfg.csi_socket);
    Ok(())
}

/// A client channel to a controller at `unix:/path` or `host:port`.
pub async fn connect(address: &str) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    match config::parse_listen(address) {
        Ok(Listen::Unix(path)) => crate::rpc::connect_unix(&path).await,
        _ => {
            tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
                .connect_timeout(std::time::Duration::from_secs(3))
                .connect()
                .await
        }
    }
}
