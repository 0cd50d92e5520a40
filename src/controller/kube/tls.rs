//! `tls.bootstrap`: a cluster without cert-manager. On first start the controller makes its
//! own CA and a serving certificate for the Service's DNS names into a Secret (type
//! `kubernetes.io/tls`: `tls.crt`, `tls.key`, plus `ca.crt` and `ca.key`), and publishes
//! the CA (`ca.crt`) in a ConfigMap the agents mount. Every start reads the Secret: the same
//! certificate for every controller replica, across restarts. A serving certificate with
//! less than 30 days left (or not naming every configured DNS name) is re-issued by the same
//! CA, so agents keep trusting it.
//!
//! Create races between two starting controllers end like the HMAC Secret's: `409
//! AlreadyExists` re-reads and uses the winner's.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::Api;

use super::ensure::Outcome;
use crate::controller::certs::{CA_CERT, CA_KEY, Ca, CertError, TLS_CERT, TLS_KEY};
use crate::controller::config::Bootstrap;
use crate::rpc::tls::ServerFiles;

const CA_DAYS: i64 = 3650;
const SERVING_DAYS: i64 = 365;
const RENEW_BEFORE_SECS: i64 = 30 * 86400;

fn text(data: &BTreeMap<String, ByteString>, k: &str) -> Option<String> {
    data.get(k).and_then(|v| String::from_utf8(v.0.clone()).ok()).filter(|s| !s.trim().is_empty())
}

/// Does the serving certificate still do: valid for 30 more days and naming every DNS name?
fn serving_ok(cert_pem: &str, dns_names: &[String]) -> bool {
    let Ok(certs) = crate::rpc::tls::certs_of(cert_pem.as_bytes(), "tls.crt") else { return false };
    let Ok((_, c)) = x509_parser::parse_x509_certificate(&certs[0]) else { return false };
    if c.validity().not_after.timestamp() < crate::util::unix_secs() as i64 + RENEW_BEFORE_SECS {
        return false;
    }
    let names: Vec<String> = match c.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|g| match g {
                x509_parser::extensions::GeneralName::DNSName(n) => Some(n.to_string()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    dns_names.iter().all(|n| names.contains(n))
}

/// The Secret's data with a usable serving pair: (data, changed?).
fn complete(
    data: BTreeMap<String, ByteString>,
    b: &Bootstrap,
) -> Result<(BTreeMap<String, ByteString>, bool), CertError> {
    if let (Some(c), Some(_), Some(_)) = (text(&data, TLS_CERT), text(&data, TLS_KEY), text(&data, CA_CERT))
        && serving_ok(&c, &b.dns_names)
    {
        return Ok((data, false));
    }
    let ca = match (text(&data, CA_CERT), text(&data, CA_KEY)) {
        (Some(c), Some(k)) => Ca::load(&c, &k)?,
        _ => Ca::generate("nodeplane CA", CA_DAYS)?,
    };
    let (cert, key) = ca.issue_server(&b.dns_names, SERVING_DAYS)?;
    let mut data = data;
    data.insert(CA_CERT.into(), ByteString(ca.cert_pem().as_bytes().to_vec()));
    data.insert(CA_KEY.into(), ByteString(ca.key_pem().into_bytes()));
    data.insert(TLS_CERT.into(), ByteString(cert.into_bytes()));
    data.insert(TLS_KEY.into(), ByteString(key.into_bytes()));
    Ok((data, true))
}

/// Make (or read) the Secret, write the serving pair to `files`, publish the CA.
pub async fn bootstrap(client: kube::Client, b: &Bootstrap, files: &ServerFiles) -> Result<(), CertError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &b.namespace);
    let what = format!("Secret {}/{}", b.namespace, b.secret_name);
    let fresh = || {
        Ok(Secret {
            metadata: super::managed_meta(&b.namespace, &b.secret_name),
            type_: Some("kubernetes.io/tls".into()),
            data: Some(complete(BTreeMap::new(), b)?.0),
            ..Default::default()
        })
    };
    let fix = |s: &Secret| -> Result<Option<Secret>, CertError> {
        let (d, changed) = complete(s.data.clone().unwrap_or_default(), b)?;
        Ok(changed.then(|| Secret { data: Some(d), ..s.clone() }))
    };
    let (s, outcome) =
        super::ensure::ensure(&secrets, &what, &b.secret_name, fresh, fix).await.map_err(CertError::Kube)?;
    match outcome {
        Outcome::Created => {
            tracing::info!(secret = %what, names = ?b.dns_names, "CA and serving certificate generated")
        }
        Outcome::Updated => tracing::info!(secret = %what, "serving certificate (re-)issued by the bootstrap CA"),
        Outcome::Found => {}
    }
    let data = s.data.unwrap_or_default();
    let get = |key| text(&data, key).ok_or_else(|| CertError::Missing { object: what.clone(), key });
    let (cert, key, ca) = (get(TLS_CERT)?, get(TLS_KEY)?, get(CA_CERT)?);
    crate::controller::certs::write_pair(&files.cert_file, &files.key_file, &cert, &key)?;
    publish_ca(client, b, &ca).await
}

/// The ConfigMap holding `ca.crt`, created or brought up to date.
async fn publish_ca(client: kube::Client, b: &Bootstrap, ca: &str) -> Result<(), CertError> {
    let maps: Api<ConfigMap> = Api::namespaced(client, &b.namespace);
    let what = format!("ConfigMap {}/{}", b.namespace, b.ca_config_map_name);
    let fresh = || {
        Ok(ConfigMap {
            metadata: super::managed_meta(&b.namespace, &b.ca_config_map_name),
            data: Some([(CA_CERT.to_string(), ca.to_string())].into()),
            ..Default::default()
        })
    };
    let fix = |m: &ConfigMap| -> Result<Option<ConfigMap>, CertError> {
        if m.data.as_ref().and_then(|d| d.get(CA_CERT)).map(String::as_str) == Some(ca) {
            return Ok(None);
        }
        let mut m = m.clone();
        m.data.get_or_insert_with(BTreeMap::new).insert(CA_CERT.into(), ca.to_string());
        Ok(Some(m))
    };
    match super::ensure::ensure(&maps, &what, &b.ca_config_map_name, fresh, fix).await.map_err(CertError::Kube)?.1 {
        Outcome::Created => tracing::info!(configmap = %what, "CA bundle published"),
        Outcome::Updated => tracing::info!(configmap = %what, "CA bundle updated"),
        Outcome::Found => {}
    }
    Ok(())
}
