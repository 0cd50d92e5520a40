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

fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("reading {what} {}: {e}", path.display()))
}

pub fn certs_of(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{what}: holds no CERTIFICATE block"));
    }
    Ok(certs)
}

fn key_of(pem: &[u8], what: &str) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| format!("{what}: no usable private key: {e}"))
}

/// A root store of every certificate of a PEM bundle (`what` names it in errors).
pub fn roots_of(pem: &[u8], what: &str) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs_of(pem, what)? {
        roots.add(c).map_err(|e| format!("{what}: not a usable CA certificate: {e}"))?;
    }
    Ok(roots)
}

/// Seconds since the epoch until which the (leaf) certificate is valid.
pub fn not_after(der: &[u8]) -> Result<i64, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    Ok(cert.validity().not_after.timestamp())
}

/// The node a client certificate names: its subject's common name `system:node:<name>`
/// (the caller checks that the name is a valid node name).
pub fn node_of_certificate(der: &[u8]) -> Result<String, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| format!("client certificate: {e}"))?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or("the client certificate's subject has no common name")?;
    let node = cn
        .strip_prefix(NODE_CN_PREFIX)
        .ok_or_else(|| format!("the client certificate names {cn:?}, not {NODE_CN_PREFIX}<node>"))?;
    Ok(node.to_string())
}

fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// The server config from the files' contents (no ALPN protocols set).
fn server_config(
    files: &ServerFiles,
    cert: &[u8],
    key: &[u8],
    ca: Option<&[u8]>,
) -> Result<rustls::ServerConfig, String> {
    let certs = certs_of(cert, &files.cert_file.display().to_string())?;
    let key = key_of(key, &files.key_file.display().to_string())?;
    match not_after(&certs[0]) {
        Ok(t) if t < now() => tracing::error!(
            cert = %files.cert_file.display(),
            "the serving certificate has expired: agents will refuse it until it is renewed"
        ),
        Ok(_) => {}
        Err(e) => return Err(format!("{}: {e}", files.cert_file.display())),
    }
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS versions: {e}"))?;
    let builder = match (ca, &files.client_ca_file) {
        (Some(ca), Some(path)) => {
            let roots = roots_of(ca, &path.display().to_string())?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| format!("client CA {}: {e}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("{} with {}: {e}", files.cert_file.display(), files.key_file.display()))
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
    pub fn load(files: ServerFiles) -> Result<Arc<Acceptor>, String> {
        let configs = Self::read(&files)?;
        Ok(Arc::new(Acceptor { files, current: RwLock::new(configs) }))
    }

    fn read(files: &ServerFiles) -> Result<Configs, String> {
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

    pub fn files(&self) -> &ServerFiles {
        &self.files
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
    pub fn reload(&self) -> Result<bool, String> {
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
pub async fn connect(addr: std::net::SocketAddr, tls: &ClientFiles) -> Result<tonic::transport::Channel, String> {
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
        _ => return Err("tls.certFile and tls.keyFile go together".into()),
    }
    tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .map_err(|e| chain(&e))?
        .tls_config(cfg)
        .map_err(|e| chain(&e))?
        .connect_timeout(Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| chain(&e))
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
        assert!(node_of_certificate(&der[0]).unwrap_err().contains("not system:node:<node>"));
        assert!(certs_of(b"nothing", "x").unwrap_err().contains("no CERTIFICATE"));
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
