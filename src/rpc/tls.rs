//! TLS for the agent API on TCP (rustls, ring provider).
//!
//! Server: the certificate and key come from files (the `tls.crt` / `tls.key` a mounted
//! Secret holds, as cert-manager writes them) and are re-read every few seconds; a changed
//! pair is used for the next handshakes while established connections (and their
//! WatchNodes streams) go on with the session they negotiated. A pair that does not load
//! (half-written, key not matching the certificate) is logged and the previous one kept.
//! With a client CA, a client certificate is verified against it and then names the node
//! (`CN=system:node:<name>`, kubelet's convention); without one, clients authenticate by
//! bearer token only.
//!
//! Client: the controller is verified against a CA bundle (a ConfigMap the agents mount)
//! and a name: `serverName`, else the host of the address (an IP address is checked against
//! the certificate's IP SANs). Optionally a client certificate.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The common name prefix of a node's client certificate (`system:node:<node>`).
pub const NODE_CN_PREFIX: &str = "system:node:";

pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// CA bundle client certificates are verified against (mTLS); none: tokens only.
    pub client_ca_file: Option<PathBuf>,
}

/// A client's TLS settings (agent config `controller.tls`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientFiles {
    /// CA bundle the controller's certificate must chain to.
    pub ca_file: PathBuf,
    /// The name to verify the certificate against; default: the address's host.
    pub server_name: Option<String>,
    /// A client certificate (and its key): then the certificate is this node's credential.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// Why certificates, keys or a TLS config could not be had. `what` names the file or
/// object (its path, or "tls.crt" of a Secret).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {what} {}: {source}", path.display())]
    Read { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{what}: not PEM certificates: {source}")]
    Pem { what: String, source: rustls::pki_types::pem::Error },
    #[error("{0}: holds no CERTIFICATE block")]
    NoCertificate(String),
    #[error("{what}: no usable private key: {source}")]
    Key { what: String, source: rustls::pki_types::pem::Error },
    #[error("{what}: not an X.509 certificate: {source}")]
    X509 { what: String, source: x509_parser::nom::Err<x509_parser::error::X509Error> },
    /// A certificate rustls refuses (as a CA, or with its key), or TLS settings it refuses.
    #[error("{what}: {source}")]
    Rustls { what: String, source: rustls::Error },
    #[error("client CA {}: {source}", path.display())]
    ClientCa { path: PathBuf, source: rustls::server::VerifierBuilderError },
    /// A client certificate that does not name a node (`system:node:<node>`).
    #[error("the client certificate names {0:?}, not {NODE_CN_PREFIX}<node>")]
    NotANode(Option<String>),
    #[error("tls.certFile and tls.keyFile go together")]
    HalfPair,
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.into(), source })
}

pub fn certs_of(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem { what: what.into(), source })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(what.into()));
    }
    Ok(certs)
}

fn key_of(pem: &[u8], what: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|source| TlsError::Key { what: what.into(), source })
}

fn rustls_err(what: impl Into<String>) -> impl FnOnce(rustls::Error) -> TlsError {
    move |source| TlsError::Rustls { what: what.into(), source }
}

/// A root store of every certificate of a PEM bundle (`what` names it in errors).
pub fn roots_of(pem: &[u8], what: &str) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs_of(pem, what)? {
        roots.add(c).map_err(rustls_err(format!("{what}: not a usable CA certificate")))?;
    }
    Ok(roots)
}

fn x509<'a>(der: &'a [u8], what: &str) -> Result<x509_parser::certificate::X509Certificate<'a>, TlsError> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, c)| c)
        .map_err(|source| TlsError::X509 { what: what.into(), source })
}

/// Seconds since the epoch until which the (leaf) certificate `what` is valid.
pub fn not_after(der: &[u8], what: &str) -> Result<i64, TlsError> {
    Ok(x509(der, what)?.validity().not_after.timestamp())
}

/// The node a client certificate names: its subject's common name `system:node:<name>`
/// (the caller checks that the name is a valid node name).
pub fn node_of_certificate(der: &[u8]) -> Result<String, TlsError> {
    let cert = x509(der, "client certificate")?;
    let cn = cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok());
    match cn.and_then(|cn| cn.strip_prefix(NODE_CN_PREFIX)) {
        Some(node) => Ok(node.to_string()),
        None => Err(TlsError::NotANode(cn.map(String::from))),
    }
}

/// The server config from the files' contents (no ALPN protocols set).
fn server_config(
    files: &ServerFiles,
    cert: &[u8],
    key: &[u8],
    ca: Option<&[u8]>,
) -> Result<rustls::ServerConfig, TlsError> {
    let cert_file = files.cert_file.display().to_string();
    let certs = certs_of(cert, &cert_file)?;
    let key = key_of(key, &files.key_file.display().to_string())?;
    if not_after(&certs[0], &cert_file)? < crate::util::unix_secs() as i64 {
        tracing::error!(cert = %cert_file, "the serving certificate has expired: agents will refuse it until it is renewed");
    }
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(rustls_err("TLS versions"))?;
    let builder = match (ca, &files.client_ca_file) {
        (Some(ca), Some(path)) => {
            let roots = roots_of(ca, &path.display().to_string())?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|source| TlsError::ClientCa { path: path.clone(), source })?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    builder.with_single_cert(certs, key).map_err(rustls_err(format!("{cert_file} with {}", files.key_file.display())))
}

/// The configs made from one reading of the files: gRPC (ALPN `h2`) and the health
/// endpoint (ALPN `http/1.1`; a client that offers no ALPN, as kubelet's prober, gets it too).
struct Configs {
    digest: [u8; 32],
    grpc: Arc<rustls::ServerConfig>,
    http1: Arc<rustls::ServerConfig>,
}

/// The server side: the current configs, replaced when the files change.
pub struct Acceptor {
    files: ServerFiles,
    current: RwLock<Configs>,
}

impl Acceptor {
    /// Load the files (an error if they do not make a usable config).
    pub fn load(files: ServerFiles) -> Result<Arc<Acceptor>, TlsError> {
        let configs = Self::read(&files)?;
        Ok(Arc::new(Acceptor { files, current: RwLock::new(configs) }))
    }

    fn read(files: &ServerFiles) -> Result<Configs, TlsError> {
        let cert = read(&files.cert_file, "certificate")?;
        let key = read(&files.key_file, "key")?;
        let ca = files.client_ca_file.as_deref().map(|p| read(p, "client CA")).transpose()?;
        let mut h = Sha256::new();
        for part in [&cert[..], &key[..], ca.as_deref().unwrap_or_default()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        let digest: [u8; 32] = h.finalize().into();
        let mut grpc = server_config(files, &cert, &key, ca.as_deref())?;
        let mut http1 = grpc.clone();
        grpc.alpn_protocols = vec![b"h2".to_vec()];
        http1.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Configs { digest, grpc: Arc::new(grpc), http1: Arc::new(http1) })
    }

    /// The config for gRPC (HTTP/2).
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        self.current.read().expect("TLS config lock").grpc.clone()
    }

    /// The config for the health endpoint (HTTP/1.1), same certificate.
    pub fn http1_config(&self) -> Arc<rustls::ServerConfig> {
        self.current.read().expect("TLS config lock").http1.clone()
    }

    /// Re-read the files: Ok(true) if a changed pair is now in use.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let configs = Self::read(&self.files)?;
        let mut cur = self.current.write().expect("TLS config lock");
        if cur.digest == configs.digest {
            return Ok(false);
        }
        *cur = configs;
        Ok(true)
    }

    /// Re-read the files every `every` until `stopping`.
    pub fn watch(
        self: &Arc<Self>,
        every: Duration,
        mut stopping: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut failing = false;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stopping.wait_for(|s| *s) => return,
                }
                let m = me.clone();
                match tokio::task::spawn_blocking(move || m.reload()).await {
                    Ok(Ok(true)) => {
                        failing = false;
                        tracing::info!(cert = %me.files.cert_file.display(), "serving certificate reloaded: new connections use it");
                    }
                    Ok(Ok(false)) => failing = false,
                    Ok(Err(e)) => {
                        // Once per failure, not every few seconds while a rotation is half done.
                        if !failing {
                            tracing::warn!(error = %e, "the certificate files changed but do not load: still serving the previous pair");
                        }
                        failing = true;
                    }
                    Err(_) => {}
                }
            }
        })
    }
}

/// TLS connections accepted on `listener`, each handshake in its own task (bounded to 10 s)
/// so that a slow or silent client holds up nobody. A client that does not speak TLS (or
/// refuses our certificate) is dropped and logged.
pub fn incoming(
    listener: tokio::net::TcpListener,
    acceptor: Arc<Acceptor>,
) -> tokio_stream::wrappers::ReceiverStream<
    Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(128);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: do not spin.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let tls = tokio_rustls::TlsAcceptor::from(acceptor.config());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(Duration::from_secs(10), tls.accept(stream)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(s)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "TLS handshake failed: connection refused (plaintext clients are not served)")
                    }
                    Err(_) => tracing::warn!(%peer, "TLS handshake not completed within 10 s: connection dropped"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// An error and its sources, one line (tonic's transport errors say little at the top).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

/// A channel to `addr` over TLS as `tls` says.
pub async fn connect(
    addr: std::net::SocketAddr,
    tls: &ClientFiles,
) -> Result<tonic::transport::Channel, super::ConnectError> {
    let ca = read(&tls.ca_file, "CA bundle")?;
    certs_of(&ca, &tls.ca_file.display().to_string())?;
    let name = tls.server_name.clone().unwrap_or_else(|| addr.ip().to_string());
    let mut cfg = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name(name);
    match (&tls.cert_file, &tls.key_file) {
        (Some(c), Some(k)) => {
            cfg = cfg
                .identity(tonic::transport::Identity::from_pem(read(c, "client certificate")?, read(k, "client key")?));
        }
        (None, None) => {}
        _ => return Err(TlsError::HalfPair.into()),
    }
    let endpoint = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))?.tls_config(cfg)?;
    Ok(endpoint.connect_timeout(Duration::from_secs(3)).connect().await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_from_certificates() {
        let ca = crate::controller::certs::Ca::generate("test CA", 1).unwrap();
        let (cert, _) = ca.issue_client("system:node:node-a", 1).unwrap();
        let der = certs_of(cert.as_bytes(), "c").unwrap();
        assert_eq!(node_of_certificate(&der[0]).unwrap(), "node-a");
        let (cert, _) = ca.issue_client("admin", 1).unwrap();
        let der = certs_of(cert.as_bytes(), "c").unwrap();
        assert!(node_of_certificate(&der[0]).unwrap_err().to_string().contains("not system:node:<node>"));
        assert!(certs_of(b"nothing", "x").unwrap_err().to_string().contains("no CERTIFICATE"));
    }

    #[test]
    fn reload_swaps_only_on_a_changed_usable_pair() {
        let dir = std::env::temp_dir().join(format!("np-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ca = crate::controller::certs::Ca::generate("test CA", 1).unwrap();
        let write = |sans: &[&str]| {
            let (c, k) = ca.issue_server(&sans.iter().map(|s| s.to_string()).collect::<Vec<_>>(), 1).unwrap();
            std::fs::write(dir.join("tls.crt"), c).unwrap();
            std::fs::write(dir.join("tls.key"), k).unwrap();
        };
        write(&["a.example"]);
        let files = ServerFiles { cert_file: dir.join("tls.crt"), key_file: dir.join("tls.key"), client_ca_file: None };
        let acc = Acceptor::load(files).unwrap();
        let first = acc.config();
        assert!(!acc.reload().unwrap(), "unchanged files keep the config");
        assert!(Arc::ptr_eq(&first, &acc.config()));
        write(&["b.example"]);
        assert!(acc.reload().unwrap());
        assert!(!Arc::ptr_eq(&first, &acc.config()));
        // A key that does not match the certificate: refused, the previous pair stays.
        let second = acc.config();
        let (_, other_key) = ca.issue_server(&["c.example".into()], 1).unwrap();
        std::fs::write(dir.join("tls.key"), other_key).unwrap();
        assert!(acc.reload().is_err());
        assert!(Arc::ptr_eq(&second, &acc.config()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
