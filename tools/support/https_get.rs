//! One HTTP/1.1 GET, plain or over TLS (verified against a CA bundle and a name as a
//! scraper does, or unverified as kubelet's HTTPS prober does), the way probes and scrapers
//! read the controller's health endpoint. Blocking; for tests.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// How to speak to the endpoint.
pub enum Mode<'a> {
    /// Plain HTTP.
    Plain,
    /// TLS verified against a CA bundle and a name, offering these ALPN protocols.
    Verified { ca: &'a Path, name: &'a str, alpn: &'a [&'a [u8]] },
    /// TLS as kubelet's HTTPS prober does it: no ALPN, the certificate not verified
    /// (InsecureSkipVerify), the handshake signatures still checked.
    Probe,
}

/// The status and body of `GET path` on 127.0.0.1:`port`. Errors carry the TLS alert or
/// I/O failure as text.
pub fn get(port: u16, path: &str, mode: Mode) -> Result<(u16, String), String> {
    let sock = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    sock.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    let host = match mode {
        Mode::Verified { name, .. } => name,
        _ => "127.0.0.1",
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let mut raw = Vec::new();
    let provider = nodeplane::rpc::tls::provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let tls = match mode {
        Mode::Plain => None,
        Mode::Verified { ca, name, alpn } => {
            let pem = std::fs::read(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
            let roots = nodeplane::rpc::tls::roots_of(&pem, "CA bundle").map_err(|e| e.to_string())?;
            let mut cfg = builder.with_root_certificates(roots).with_no_client_auth();
            cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            Some((cfg, name))
        }
        Mode::Probe => {
            let cfg = builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
                .with_no_client_auth();
            Some((cfg, "127.0.0.1"))
        }
    };
    match tls {
        None => {
            let mut s = sock;
            s.write_all(request.as_bytes()).map_err(|e| format!("write: {e}"))?;
            let _ = s.read_to_end(&mut raw);
        }
        Some((cfg, name)) => {
            let server = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
            let conn = rustls::ClientConnection::new(Arc::new(cfg), server).map_err(|e| e.to_string())?;
            let mut s = rustls::StreamOwned::new(conn, sock);
            s.write_all(request.as_bytes()).map_err(|e| format!("TLS: {e}"))?;
            // A server that closes without close_notify ends in UnexpectedEof after the
            // response: what was read counts.
            if let Err(e) = s.read_to_end(&mut raw)
                && raw.is_empty()
            {
                return Err(format!("TLS: {e}"));
            }
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.get(..3))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no HTTP response (read {} bytes)", raw.len()))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

/// Accepts any certificate (kubelet's prober skips verification); handshake signatures are
/// still verified, so the peer must hold the key of the certificate it shows.
#[derive(Debug)]
struct Unverified(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
