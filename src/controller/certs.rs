//! Certificates without cert-manager: a CA of our own and the certificates it signs (the
//! controller's serving certificate, optionally node client certificates), for
//! `nodeplane-controller certs`, the local cluster, and the first start in a cluster
//! (`tls.bootstrap`, see `kube::tls`).
//!
//! Keys are ECDSA P-256. A serving certificate names its DNS names and IP addresses as
//! SANs; a node's client certificate names `CN=system:node:<node>` (kubelet's convention,
//! `rpc::tls::node_of_certificate`).

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};

pub const CA_CERT: &str = "ca.crt";
pub const CA_KEY: &str = "ca.key";
pub const TLS_CERT: &str = "tls.crt";
pub const TLS_KEY: &str = "tls.key";

/// A CA that can sign.
pub struct Ca {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// What failed making, reading or writing certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{what}: {source}")]
    Rcgen { what: &'static str, source: rcgen::Error },
    #[error("a serving certificate needs at least one DNS name or IP address")]
    NoNames,
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: std::path::PathBuf, source: std::io::Error },
    /// The Kubernetes object holding them (bootstrap): unreadable, unwritable, or without `key`.
    #[error("{0}")]
    Kube(String),
    #[error("{object}: no {key}")]
    Missing { object: String, key: &'static str },
}

fn err(what: &'static str) -> impl Fn(rcgen::Error) -> CertError {
    move |source| CertError::Rcgen { what, source }
}

fn io_err<'a>(what: &'static str, path: &'a std::path::Path) -> impl FnOnce(std::io::Error) -> CertError + 'a {
    move |source| CertError::Io { what, path: path.into(), source }
}

/// Validity from a minute ago (clock skew) for `days` days; `days` < 0 makes a certificate
/// that has already expired (for tests of what refuses it).
fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    if days >= 0 {
        params.not_before = now - time::Duration::minutes(1);
        params.not_after = now + time::Duration::days(days);
    } else {
        params.not_before = now + time::Duration::days(days - 1);
        params.not_after = now + time::Duration::days(days);
    }
}

fn serial(params: &mut CertificateParams) {
    let mut s = [0u8; 16];
    crate::util::fill_random(&mut s);
    s[0] &= 0x7f;
    params.serial_number = Some(rcgen::SerialNumber::from_slice(&s));
}

impl Ca {
    /// A new self-signed CA named `name` plus a random suffix (two CAs never share a
    /// subject, so a certificate of one is "unknown issuer" to the other), valid `days`.
    pub fn generate(name: &str, days: i64) -> Result<Ca, CertError> {
        let key = KeyPair::generate().map_err(err("generating the CA key"))?;
        let mut params = CertificateParams::default();
        let mut id = [0u8; 4];
        crate::util::fill_random(&mut id);
        params.distinguished_name.push(DnType::CommonName, format!("{name} {}", hex::encode(id)));
        params.distinguished_name.push(DnType::OrganizationName, "nodeplane");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        validity(&mut params, days);
        serial(&mut params);
        let cert = params.self_signed(&key).map_err(err("signing the CA certificate"))?;
        Ok(Ca { cert_pem: cert.pem(), issuer: Issuer::new(params, key) })
    }

    /// A CA from its certificate and key (PEM).
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Ca, CertError> {
        let key = KeyPair::from_pem(key_pem).map_err(err("the CA key"))?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(err("the CA certificate"))?;
        Ok(Ca { cert_pem: cert_pem.to_string(), issuer })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    fn issue(&self, mut params: CertificateParams, days: i64) -> Result<(String, String), CertError> {
        let key = KeyPair::generate().map_err(err("generating a key"))?;
        validity(&mut params, days);
        serial(&mut params);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let cert = params.signed_by(&key, &self.issuer).map_err(err("signing"))?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A serving certificate for `sans` (DNS names and IP addresses): (cert PEM, key PEM).
    pub fn issue_server(&self, sans: &[String], days: i64) -> Result<(String, String), CertError> {
        if sans.is_empty() {
            return Err(CertError::NoNames);
        }
        let mut params = CertificateParams::new(sans.to_vec()).map_err(err("the subject alternative names"))?;
        params.distinguished_name.push(DnType::CommonName, sans[0].as_str());
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(params, days)
    }

    /// A client certificate with common name `cn`: (cert PEM, key PEM).
    pub fn issue_client(&self, cn: &str, days: i64) -> Result<(String, String), CertError> {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.distinguished_name.push(DnType::OrganizationName, "system:nodes");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params, days)
    }
}

/// Write a PEM file atomically (keys 0600, certificates 0644).
fn write_pem(path: &std::path::Path, pem: &str, secret: bool) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    crate::sys::fs::atomic_write(path, pem.as_bytes(), if secret { 0o600 } else { 0o644 })
}

/// A certificate and its key, written key first (so a reader that sees the new certificate
/// finds its key).
pub fn write_pair(
    cert_file: &std::path::Path,
    key_file: &std::path::Path,
    cert: &str,
    key: &str,
) -> Result<(), CertError> {
    write_pem(key_file, key, true).map_err(io_err("writing", key_file))?;
    write_pem(cert_file, cert, false).map_err(io_err("writing", cert_file))
}

/// The CA in `dir` (`ca.crt`, `ca.key`): Ok(None) if neither file is there.
pub fn ca_of_dir(dir: &std::path::Path) -> Result<Option<Ca>, CertError> {
    let (c, k) = (dir.join(CA_CERT), dir.join(CA_KEY));
    match (std::fs::read_to_string(&c), std::fs::read_to_string(&k)) {
        (Ok(c), Ok(k)) => Ca::load(&c, &k).map(Some),
        (Err(e), _) | (_, Err(e)) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(io_err("reading the CA in", dir)(e))
        }
        _ => Ok(None),
    }
}

/// The CA in `dir`, made if missing.
pub fn ca_in(dir: &std::path::Path, days: i64) -> Result<Ca, CertError> {
    if let Some(ca) = ca_of_dir(dir)? {
        return Ok(ca);
    }
    let ca = Ca::generate("nodeplane CA", days)?;
    write_pair(&dir.join(CA_CERT), &dir.join(CA_KEY), ca.cert_pem(), &ca.key_pem())?;
    Ok(ca)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loaded_ca_signs_what_the_original_verifies() {
        use rustls::client::danger::ServerCertVerifier;
        let ca = Ca::generate("t", 2).unwrap();
        let again = Ca::load(ca.cert_pem(), &ca.key_pem()).unwrap();
        let (cert, _) = again.issue_server(&["x.example".into(), "127.0.0.1".into()], 1).unwrap();
        let roots = std::sync::Arc::new(crate::rpc::tls::roots_of(ca.cert_pem().as_bytes(), "ca").unwrap());
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, crate::rpc::tls::provider())
            .build()
            .unwrap();
        let leaf = crate::rpc::tls::certs_of(cert.as_bytes(), "leaf").unwrap().remove(0);
        let now = rustls::pki_types::UnixTime::now();
        for name in ["x.example", "127.0.0.1"] {
            let sn = rustls::pki_types::ServerName::try_from(name).unwrap();
            verifier.verify_server_cert(&leaf, &[], &sn, &[], now).unwrap();
        }
        let wrong = rustls::pki_types::ServerName::try_from("y.example").unwrap();
        assert!(verifier.verify_server_cert(&leaf, &[], &wrong, &[], now).is_err());
        let (expired, _) = ca.issue_server(&["x.example".into()], -1).unwrap();
        let leaf = crate::rpc::tls::certs_of(expired.as_bytes(), "leaf").unwrap().remove(0);
        let sn = rustls::pki_types::ServerName::try_from("x.example").unwrap();
        let e = verifier.verify_server_cert(&leaf, &[], &sn, &[], now).unwrap_err();
        assert!(e.to_string().to_lowercase().contains("expired"), "{e}");
    }
}
