//! Controller configuration: pools, block sizes, data dir, listen address.

use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use serde::Deserialize;

use super::kube::lease::LeaseSettings;
use super::records::Pool;
use crate::rpc::{Listen, parse_listen};
use crate::util::Family;

pub use crate::util::ConfigError;

/// One cluster pool and the size of the blocks it is cut into.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolConfig {
    pub cidr: String,
    /// Prefix length of each node block (e.g. 24 for IPv4, 64 for IPv6).
    pub block_prefix: u8,
}

/// The cluster's encryption settings (docs/network.md, "Encryption").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Encryption {
    #[serde(default)]
    pub mode: crate::net::wireguard::Mode,
    #[serde(default = "default_wg_port")]
    pub port: u16,
    /// Each node makes a new key pair when its key is older than this; 0: only on demand.
    #[serde(default)]
    pub key_rotation_seconds: u64,
}

impl Default for Encryption {
    fn default() -> Self {
        Encryption { mode: Default::default(), port: default_wg_port(), key_rotation_seconds: 0 }
    }
}

fn default_wg_port() -> u16 {
    crate::net::wireguard::DEFAULT_PORT
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    pub data_dir: PathBuf,
    /// `unix:/path/to.sock` or `host:port`.
    pub listen: String,
    pub pools: Vec<PoolConfig>,
    /// Default 4242.
    pub vxlan_vni: Option<u32>,
    /// Default 4789.
    pub vxlan_port: Option<u16>,
    /// Encryption of pod traffic between nodes (WireGuard): `{"mode": "off"|"on"|"strict",
    /// "port": 51871, "keyRotationSeconds": 0}`. Default off.
    #[serde(default)]
    pub encryption: Encryption,
    /// File holding the token-signing secret; default `<dataDir>/secret` (made on first start).
    /// In Kubernetes mode the default is a Secret instead (`store.hmacSecretName`); a
    /// `secretFile` given there is used as it is (e.g. a mounted Secret).
    pub secret_file: Option<PathBuf>,
    /// Unix socket for CSI Identity + Controller (the provisioner and resizer sidecars);
    /// default `<dataDir>/csi.sock`.
    pub csi_socket: Option<PathBuf>,
    /// How long a node may keep a volume the controller does not know before reclaiming it
    /// (default 600).
    pub orphan_grace_seconds: Option<u64>,
    /// How long GetCapacity answers UNAVAILABLE rather than 0 for a node whose agent is away
    /// (since the controller started, or since the agent left; default 60).
    pub capacity_grace_seconds: Option<u64>,
    /// How long one CSI call waits for a node before answering DEADLINE_EXCEEDED (retried;
    /// default 60).
    pub volume_op_timeout_seconds: Option<u64>,
    /// `host:port` of the health endpoint (`/healthz`, `/readyz`); none by default.
    pub health_address: Option<String>,
    /// Where the state lives: `{"kind": "embedded"}` (default: a redb file in dataDir) or
    /// `{"kind": "kubernetes", ...}` (API objects, with leader election on a Lease).
    pub store: Option<StoreFile>,
    /// How agents prove who they are: `{"kind": "hmac"}` (default: tokens minted by
    /// `nodeplane-controller token`) or `{"kind": "tokenReview", ...}` (projected
    /// service-account tokens; HMAC tokens keep working, e.g. for the admin).
    pub agent_auth: Option<AgentAuthFile>,
    /// TLS for a TCP `listen` address (required there unless `insecure`).
    pub tls: Option<TlsFile>,
    /// Serve a TCP `listen` address in plaintext (a warning at every start): bearer tokens
    /// then cross the network readable by anyone on it.
    #[serde(default)]
    pub insecure: bool,
}

/// `tls`: the serving certificate's files, or (Kubernetes mode) a Secret made on first start.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TlsFile {
    /// The directory of a mounted `kubernetes.io/tls` Secret: `tls.crt` and `tls.key` in it
    /// (the names cert-manager writes).
    pub dir: Option<PathBuf>,
    /// Or the two files by name.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// CA bundle for client certificates (mTLS: `CN=system:node:<node>` names the node);
    /// none: agents authenticate by token only.
    pub client_ca_file: Option<PathBuf>,
    /// How often the files are checked for a rotated pair (default 5 s).
    pub reload_seconds: Option<u64>,
    /// Kubernetes mode without cert-manager: the controller makes its own CA and serving
    /// certificate into a Secret on first start and publishes the CA in a ConfigMap.
    pub bootstrap: Option<BootstrapFile>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BootstrapFile {
    /// Default `nodeplane-controller-tls`.
    pub secret_name: Option<String>,
    /// Default `nodeplane-ca` (key `ca.crt`).
    pub ca_config_map_name: Option<String>,
    /// The serving certificate's DNS names; default the Service's
    /// (`nodeplane-controller`, `.<namespace>`, `.<namespace>.svc`, `.<namespace>.svc.cluster.local`).
    #[serde(default)]
    pub dns_names: Vec<String>,
}

/// Resolved `tls`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    pub files: crate::rpc::tls::ServerFiles,
    pub reload: std::time::Duration,
    pub bootstrap: Option<Bootstrap>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub namespace: String,
    pub secret_name: String,
    pub ca_config_map_name: String,
    pub dns_names: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StoreFile {
    pub kind: String,
    /// Namespace of the Lease (default: env POD_NAMESPACE).
    pub namespace: Option<String>,
    /// Default `nodeplane-controller`.
    pub lease_name: Option<String>,
    /// This candidate's name (default: env POD_NAME, else the host name).
    pub identity: Option<String>,
    pub lease_duration_seconds: Option<u64>,
    pub renew_deadline_seconds: Option<u64>,
    pub retry_period_seconds: Option<u64>,
    /// The Secret (in `namespace`) holding the token-signing keys; default
    /// `nodeplane-controller-hmac`, generated on first start.
    pub hmac_secret_name: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentAuthFile {
    pub kind: String,
    /// Audience the projected token must carry (default `nodeplane`).
    pub audience: Option<String>,
    /// The agent's service account user, `system:serviceaccount:<namespace>:<name>`.
    pub service_account: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    Embedded,
    Kubernetes(LeaseSettings),
}

/// Where the token-signing (HMAC) keys live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSecret {
    /// A file (local mode, or given explicitly): made on first start.
    File(PathBuf),
    /// A Secret with keys `current` and `previous` (Kubernetes mode): made on first start.
    Kubernetes { namespace: String, name: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentAuth {
    Hmac,
    TokenReview { audience: String, service_account: String },
}

#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub listen: Listen,
    pub pools: Vec<Pool>,
    pub vxlan_vni: u32,
    pub vxlan_port: u16,
    pub encryption: Encryption,
    pub secret_file: PathBuf,
    pub token_secret: TokenSecret,
    pub csi_socket: PathBuf,
    pub orphan_grace: std::time::Duration,
    pub capacity_grace: std::time::Duration,
    pub volume_op_timeout: std::time::Duration,
    pub health_address: Option<std::net::SocketAddr>,
    pub store: Store,
    pub agent_auth: AgentAuth,
    /// TLS on the TCP listener; None on a Unix socket, or TCP with `insecure`.
    pub tls: Option<Tls>,
    pub insecure: bool,
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::resolve(crate::util::load_json(path)?)
    }

    pub fn resolve(f: FileConfig) -> Result<Self, ConfigError> {
        Self::resolve_with_env(f, &|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// Resolve with `env` standing in for the process environment (POD_NAME, POD_NAMESPACE).
    pub fn resolve_with_env(f: FileConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let bad = |m: String| ConfigError::Invalid(m);
        let listen = parse_listen(&f.listen).map_err(bad)?;
        if f.pools.is_empty() {
            return Err(bad("pools: at least one pool is required".into()));
        }
        let mut pools: Vec<Pool> = Vec::new();
        for (i, p) in f.pools.iter().enumerate() {
            let net: IpNetwork =
                p.cidr.parse().map_err(|_| bad(format!("pools[{i}].cidr {:?} is not a CIDR", p.cidr)))?;
            if net.network() != net.ip() {
                return Err(bad(format!(
                    "pools[{i}].cidr {} has host bits set (network is {})",
                    p.cidr,
                    net.network()
                )));
            }
            let fam = Family::of(&net);
            let max = match fam {
                Family::V4 => 30,
                Family::V6 => 126,
            };
            if p.block_prefix < net.prefix() {
                return Err(bad(format!(
                    "pools[{i}]: block size /{} does not fit in pool {net} (a block cannot be larger than its pool)",
                    p.block_prefix
                )));
            }
            if p.block_prefix > max {
                return Err(bad(format!(
                    "pools[{i}]: block size /{} is too small for {fam} pods (at most /{max})",
                    p.block_prefix
                )));
            }
            for (j, q) in pools.iter().enumerate() {
                if Family::of(&q.net) == fam && (q.net.contains(net.network()) || net.contains(q.net.network())) {
                    return Err(bad(format!("pools[{i}] {net} overlaps pools[{j}] {}", q.net)));
                }
            }
            pools.push(Pool { net, block_prefix: p.block_prefix });
        }
        let (vxlan_vni, vxlan_port) = (f.vxlan_vni.unwrap_or(4242), f.vxlan_port.unwrap_or(4789));
        if vxlan_vni == 0 || vxlan_vni > 0xff_ffff {
            return Err(bad(format!("vxlanVni {vxlan_vni} is outside 1..=16777215 (a VXLAN id has 24 bits)")));
        }
        if f.encryption.port == 0 {
            return Err(bad("encryption.port must not be 0".into()));
        }
        if vxlan_port == 0 {
            return Err(bad("vxlanPort must not be 0".into()));
        }
        let secret_file = f.secret_file.clone().unwrap_or_else(|| f.data_dir.join("secret"));
        let csi_socket = f.csi_socket.clone().unwrap_or_else(|| f.data_dir.join("csi.sock"));
        if !csi_socket.is_absolute() {
            return Err(bad(format!("csiSocket {} must be absolute", csi_socket.display())));
        }
        let volume_op_timeout = f.volume_op_timeout_seconds.unwrap_or(60);
        if volume_op_timeout == 0 {
            return Err(bad("volumeOpTimeoutSeconds must be positive".into()));
        }
        let health_address = match f.health_address.as_deref() {
            None | Some("") => None,
            Some(a) => Some(a.parse().map_err(|_| bad(format!("healthAddress {a:?} is not host:port")))?),
        };
        let store = resolve_store(f.store.as_ref(), env).map_err(bad)?;
        let token_secret = match (&store, &f.secret_file) {
            (Store::Kubernetes(k), None) => {
                let name = f
                    .store
                    .as_ref()
                    .and_then(|s| s.hmac_secret_name.clone())
                    .unwrap_or_else(|| super::kube::secret::DEFAULT_NAME.to_string());
                if let Some(why) = super::records::subdomain_error(&name) {
                    return Err(bad(format!("store.hmacSecretName {name:?} {why}")));
                }
                TokenSecret::Kubernetes { namespace: k.namespace.clone(), name }
            }
            _ => TokenSecret::File(secret_file.clone()),
        };
        let agent_auth = match &f.agent_auth {
            None => AgentAuth::Hmac,
            Some(a) if a.kind == "hmac" => AgentAuth::Hmac,
            Some(a) if a.kind == "tokenReview" => {
                let service_account = a.service_account.clone().ok_or_else(|| {
                    bad("agentAuth.serviceAccount is required (system:serviceaccount:<namespace>:<name>)".into())
                })?;
                if service_account.split(':').count() != 4 || !service_account.starts_with("system:serviceaccount:") {
                    return Err(bad(format!(
                        "agentAuth.serviceAccount {service_account:?} is not system:serviceaccount:<namespace>:<name>"
                    )));
                }
                AgentAuth::TokenReview {
                    audience: a.audience.clone().unwrap_or_else(|| "nodeplane".into()),
                    service_account,
                }
            }
            Some(a) => return Err(bad(format!("agentAuth.kind {:?} is neither \"hmac\" nor \"tokenReview\"", a.kind))),
        };
        let tls = resolve_tls(&f, &listen, health_address, &store).map_err(bad)?;
        Ok(Config {
            tls,
            insecure: f.insecure,
            health_address,
            store,
            agent_auth,
            data_dir: f.data_dir,
            listen,
            pools,
            vxlan_vni,
            vxlan_port,
            encryption: f.encryption,
            secret_file,
            token_secret,
            csi_socket,
            orphan_grace: std::time::Duration::from_secs(f.orphan_grace_seconds.unwrap_or(600)),
            capacity_grace: f
                .capacity_grace_seconds
                .map_or(super::volumes::DEFAULT_CAPACITY_GRACE, std::time::Duration::from_secs),
            volume_op_timeout: std::time::Duration::from_secs(volume_op_timeout),
        })
    }

    pub fn cluster_cidrs(&self) -> Vec<String> {
        self.pools.iter().map(|p| p.net.to_string()).collect()
    }

    /// Does this configuration talk to the Kubernetes API?
    pub fn uses_kubernetes(&self) -> bool {
        matches!(self.store, Store::Kubernetes(_)) || matches!(self.agent_auth, AgentAuth::TokenReview { .. })
    }

    /// The resolved configuration, for `nodeplane-controller check-config`.
    pub fn to_json(&self) -> serde_json::Value {
        let listen = match &self.listen {
            Listen::Unix(p) => format!("unix:{}", p.display()),
            Listen::Tcp(a) => a.to_string(),
        };
        let store = match &self.store {
            Store::Embedded => serde_json::json!({"kind": "embedded", "path": self.data_dir.join("registry.redb")}),
            Store::Kubernetes(k) => serde_json::json!({
                "kind": "kubernetes", "namespace": k.namespace, "leaseName": k.lease_name, "identity": k.identity,
                "leaseDurationSeconds": k.lease_duration.as_secs(), "renewDeadlineSeconds": k.renew_deadline.as_secs(),
                "retryPeriodSeconds": k.retry_period.as_secs(),
            }),
        };
        let agent_auth = match &self.agent_auth {
            AgentAuth::Hmac => serde_json::json!({"kind": "hmac"}),
            AgentAuth::TokenReview { audience, service_account } => {
                serde_json::json!({"kind": "tokenReview", "audience": audience, "serviceAccount": service_account})
            }
        };
        let token_secret = match &self.token_secret {
            TokenSecret::File(p) => serde_json::json!({"kind": "file", "path": p}),
            TokenSecret::Kubernetes { namespace, name } => {
                serde_json::json!({"kind": "secret", "namespace": namespace, "name": name})
            }
        };
        serde_json::json!({
            "dataDir": self.data_dir, "listen": listen, "csiSocket": self.csi_socket, "secretFile": self.secret_file,
            "tokenSecret": token_secret,
            "healthAddress": self.health_address.map(|a| a.to_string()),
            "pools": self.pools.iter().map(|p| serde_json::json!({"cidr": p.net.to_string(), "blockPrefix": p.block_prefix})).collect::<Vec<_>>(),
            "vxlanVni": self.vxlan_vni, "vxlanPort": self.vxlan_port,
            "orphanGraceSeconds": self.orphan_grace.as_secs(), "capacityGraceSeconds": self.capacity_grace.as_secs(),
            "volumeOpTimeoutSeconds": self.volume_op_timeout.as_secs(),
            "store": store, "agentAuth": agent_auth,
            "tls": self.tls.as_ref().map(|t| serde_json::json!({
                "certFile": t.files.cert_file, "keyFile": t.files.key_file, "clientCaFile": t.files.client_ca_file,
                "reloadSeconds": t.reload.as_secs(),
                "bootstrap": t.bootstrap.as_ref().map(|b| serde_json::json!({
                    "secretName": b.secret_name, "caConfigMapName": b.ca_config_map_name, "dnsNames": b.dns_names,
                })),
            })),
            "insecure": self.insecure,
        })
    }
}

/// `tls` covers every TCP listener: a TCP `listen` and the health endpoint.
fn resolve_tls(
    f: &FileConfig,
    listen: &Listen,
    health: Option<std::net::SocketAddr>,
    store: &Store,
) -> Result<Option<Tls>, String> {
    let mut tcp = Vec::new();
    if matches!(listen, Listen::Tcp(_)) {
        tcp.push(format!("listen {:?}", f.listen));
    }
    if let Some(h) = health {
        tcp.push(format!("healthAddress \"{h}\""));
    }
    let Some(t) = &f.tls else {
        if !tcp.is_empty() && !f.insecure {
            return Err(format!(
                "{} is TCP: give tls (a certificate: tls.dir, or tls.certFile and tls.keyFile; in Kubernetes mode also tls.bootstrap), or set insecure: true to serve plaintext",
                tcp.join(" and ")
            ));
        }
        return Ok(None);
    };
    if tcp.is_empty() {
        return Err(format!("tls applies to TCP listeners, and {:?} is a Unix socket with no healthAddress", f.listen));
    }
    if f.insecure {
        return Err("tls and insecure: true contradict each other".into());
    }
    let bootstrap = match (&t.bootstrap, store) {
        (None, _) => None,
        (Some(b), Store::Kubernetes(k)) => {
            let ns = &k.namespace;
            let secret_name = b.secret_name.clone().unwrap_or_else(|| "nodeplane-controller-tls".into());
            let ca_config_map_name = b.ca_config_map_name.clone().unwrap_or_else(|| "nodeplane-ca".into());
            for (what, n) in [("secretName", &secret_name), ("caConfigMapName", &ca_config_map_name)] {
                if let Some(why) = super::records::subdomain_error(n) {
                    return Err(format!("tls.bootstrap.{what} {n:?} {why}"));
                }
            }
            let svc = "nodeplane-controller";
            let dns_names = if b.dns_names.is_empty() {
                vec![
                    svc.to_string(),
                    format!("{svc}.{ns}"),
                    format!("{svc}.{ns}.svc"),
                    format!("{svc}.{ns}.svc.cluster.local"),
                ]
            } else {
                b.dns_names.clone()
            };
            Some(Bootstrap { namespace: ns.clone(), secret_name, ca_config_map_name, dns_names })
        }
        (Some(_), Store::Embedded) => {
            return Err("tls.bootstrap needs store kind kubernetes (locally, make the files with `nodeplane-controller certs init`)".into());
        }
    };
    let (cert_file, key_file) = match (&t.dir, &t.cert_file, &t.key_file, &bootstrap) {
        (Some(d), None, None, None) => (d.join(super::certs::TLS_CERT), d.join(super::certs::TLS_KEY)),
        (None, Some(c), Some(k), None) => (c.clone(), k.clone()),
        (None, None, None, Some(_)) => {
            let d = f.data_dir.join("tls");
            (d.join(super::certs::TLS_CERT), d.join(super::certs::TLS_KEY))
        }
        (_, _, _, Some(_)) => {
            return Err("tls.bootstrap writes its own files: give no tls.dir, certFile or keyFile with it".into());
        }
        (Some(_), _, _, None) => return Err("tls: give either dir or certFile and keyFile".into()),
        _ => return Err("tls: give dir (holding tls.crt and tls.key), or both certFile and keyFile".into()),
    };
    let reload = std::time::Duration::from_secs(t.reload_seconds.unwrap_or(5));
    if reload.is_zero() {
        return Err("tls.reloadSeconds must be positive".into());
    }
    Ok(Some(Tls {
        files: crate::rpc::tls::ServerFiles { cert_file, key_file, client_ca_file: t.client_ca_file.clone() },
        reload,
        bootstrap,
    }))
}

fn resolve_store(f: Option<&StoreFile>, env: &dyn Fn(&str) -> Option<String>) -> Result<Store, String> {
    let Some(f) = f else { return Ok(Store::Embedded) };
    match f.kind.as_str() {
        "embedded" => Ok(Store::Embedded),
        "kubernetes" => {
            let namespace = f
                .namespace
                .clone()
                .or_else(|| env("POD_NAMESPACE"))
                .ok_or("store.namespace is required (or env POD_NAMESPACE)")?;
            let identity = match f.identity.clone().or_else(|| env("POD_NAME")) {
                Some(i) => i,
                None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map_err(|e| format!("store.identity: no POD_NAME and no host name: {e}"))?
                    .trim()
                    .to_string(),
            };
            let lease_name = f.lease_name.clone().unwrap_or_else(|| "nodeplane-controller".into());
            for (what, v) in [("namespace", &namespace), ("leaseName", &lease_name)] {
                if !super::records::valid_node_name(v) {
                    return Err(format!("store.{what} {v:?} is not a valid Kubernetes name"));
                }
            }
            if identity.is_empty() {
                return Err("store.identity must not be empty".into());
            }
            let secs = std::time::Duration::from_secs;
            let lease_duration = secs(f.lease_duration_seconds.unwrap_or(15));
            let renew_deadline = secs(f.renew_deadline_seconds.unwrap_or(10));
            let retry_period = secs(f.retry_period_seconds.unwrap_or(2));
            if retry_period.is_zero() || retry_period >= renew_deadline || renew_deadline >= lease_duration {
                return Err(format!(
                    "store: need 0 < retryPeriodSeconds ({}) < renewDeadlineSeconds ({}) < leaseDurationSeconds ({}): \
                     a leader must notice it could not renew before anyone else may take over",
                    retry_period.as_secs(),
                    renew_deadline.as_secs(),
                    lease_duration.as_secs()
                ));
            }
            Ok(Store::Kubernetes(LeaseSettings {
                namespace,
                lease_name,
                identity,
                lease_duration,
                renew_deadline,
                retry_period,
            }))
        }
        other => Err(format!("store.kind {other:?} is neither \"embedded\" nor \"kubernetes\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pools: &str) -> Result<Config, ConfigError> {
        let f: FileConfig =
            serde_json::from_str(&format!(r#"{{"dataDir":"/tmp/x","listen":"unix:/tmp/x.sock","pools":{pools}}}"#))
                .unwrap();
        Config::resolve(f)
    }

    #[test]
    fn validates_pools() {
        assert!(cfg(r#"[{"cidr":"10.0.0.0/16","blockPrefix":24},{"cidr":"fd00::/48","blockPrefix":64}]"#).is_ok());
        let e = cfg(r#"[{"cidr":"10.0.0.0/16","blockPrefix":8}]"#).unwrap_err().to_string();
        assert!(e.contains("does not fit"), "{e}");
        let e = cfg(r#"[{"cidr":"10.0.0.0/16","blockPrefix":31}]"#).unwrap_err().to_string();
        assert!(e.contains("too small"), "{e}");
        let e = cfg(r#"[{"cidr":"10.0.0.0/16","blockPrefix":24},{"cidr":"10.0.128.0/17","blockPrefix":24}]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlaps"), "{e}");
        let e = cfg(r#"[{"cidr":"10.0.0.300/16","blockPrefix":24}]"#).unwrap_err().to_string();
        assert!(e.contains("not a CIDR"), "{e}");
        let e = cfg(r#"[{"cidr":"10.0.0.1/16","blockPrefix":24}]"#).unwrap_err().to_string();
        assert!(e.contains("host bits"), "{e}");
        assert!(cfg("[]").is_err());
    }

    #[test]
    fn store_and_auth() {
        let f = |extra: &str| -> FileConfig {
            serde_json::from_str(&format!(
                r#"{{"dataDir":"/tmp/x","listen":"0.0.0.0:9650","insecure":true,"pools":[{{"cidr":"10.0.0.0/16","blockPrefix":24}}]{extra}}}"#
            ))
            .unwrap()
        };
        let env = |k: &str| match k {
            "POD_NAME" => Some("ctl-0".to_string()),
            "POD_NAMESPACE" => Some("nodeplane-system".to_string()),
            _ => None,
        };
        let c = Config::resolve_with_env(f(""), &env).unwrap();
        assert_eq!(c.store, Store::Embedded);
        assert_eq!(c.agent_auth, AgentAuth::Hmac);
        assert!(c.health_address.is_none() && !c.uses_kubernetes());
        let c = Config::resolve_with_env(
            f(r#","healthAddress":"0.0.0.0:9641","store":{"kind":"kubernetes"},"agentAuth":{"kind":"tokenReview","serviceAccount":"system:serviceaccount:nodeplane-system:nodeplane-agent"}"#),
            &env,
        )
        .unwrap();
        let Store::Kubernetes(k) = &c.store else { panic!() };
        assert_eq!(
            (k.namespace.as_str(), k.identity.as_str(), k.lease_name.as_str()),
            ("nodeplane-system", "ctl-0", "nodeplane-controller")
        );
        assert_eq!(c.health_address.unwrap().port(), 9641);
        assert!(c.uses_kubernetes());
        assert_eq!(c.to_json()["agentAuth"]["audience"], "nodeplane");
        // Kubernetes mode keeps the token keys in a Secret, never in the data dir.
        assert_eq!(
            c.token_secret,
            TokenSecret::Kubernetes { namespace: "nodeplane-system".into(), name: "nodeplane-controller-hmac".into() }
        );
        let c = Config::resolve_with_env(
            f(r#","store":{"kind":"kubernetes","hmacSecretName":"hmac-2"},"secretFile":"/run/s/key""#),
            &env,
        )
        .unwrap();
        assert_eq!(c.token_secret, TokenSecret::File("/run/s/key".into()), "an explicit file wins");
        let e = Config::resolve_with_env(f(r#","store":{"kind":"kubernetes","hmacSecretName":"Bad_Name"}"#), &env)
            .unwrap_err();
        assert!(e.to_string().contains("hmacSecretName"), "{e}");
        assert_eq!(
            Config::resolve_with_env(f(""), &env).unwrap().token_secret,
            TokenSecret::File("/tmp/x/secret".into())
        );
        let err = |extra: &str, env: &dyn Fn(&str) -> Option<String>| {
            Config::resolve_with_env(f(extra), env).unwrap_err().to_string()
        };
        assert!(err(r#","store":{"kind":"kubernetes"}"#, &|_| None).contains("POD_NAMESPACE"));
        assert!(err(r#","store":{"kind":"etcd"}"#, &env).contains("store.kind"));
        assert!(err(r#","store":{"kind":"kubernetes","renewDeadlineSeconds":20}"#, &env).contains("renewDeadline"));
        assert!(err(r#","agentAuth":{"kind":"tokenReview"}"#, &env).contains("serviceAccount"));
        assert!(
            err(r#","agentAuth":{"kind":"tokenReview","serviceAccount":"bob"}"#, &env)
                .contains("system:serviceaccount")
        );
        assert!(err(r#","healthAddress":"nowhere""#, &env).contains("healthAddress"));
    }

    #[test]
    fn tcp_needs_tls_or_insecure() {
        let f = |listen: &str, extra: &str| -> FileConfig {
            serde_json::from_str(&format!(
                r#"{{"dataDir":"/tmp/x","listen":"{listen}","pools":[{{"cidr":"10.0.0.0/16","blockPrefix":24}}]{extra}}}"#
            ))
            .unwrap()
        };
        let env = |k: &str| (k == "POD_NAMESPACE").then(|| "ns".to_string());
        let err = |l: &str, x: &str| Config::resolve_with_env(f(l, x), &env).unwrap_err().to_string();
        assert!(err("127.0.0.1:9650", "").contains("insecure: true"));
        let c = Config::resolve_with_env(f("127.0.0.1:9650", r#","insecure":true"#), &env).unwrap();
        assert!(c.insecure && c.tls.is_none());
        let c = Config::resolve_with_env(f("127.0.0.1:9650", r#","tls":{"dir":"/etc/np/tls"}"#), &env).unwrap();
        let t = c.tls.unwrap();
        assert_eq!(t.files.cert_file, PathBuf::from("/etc/np/tls/tls.crt"));
        assert_eq!(t.files.key_file, PathBuf::from("/etc/np/tls/tls.key"));
        assert!(err("unix:/tmp/x.sock", r#","tls":{"dir":"/d"}"#).contains("Unix socket"));
        // The health endpoint is a TCP listener too: TLS, or plaintext only with insecure.
        let h = r#","healthAddress":"127.0.0.1:9641""#;
        let e = err("unix:/tmp/x.sock", h);
        assert!(e.contains("healthAddress \"127.0.0.1:9641\" is TCP") && e.contains("insecure: true"), "{e}");
        let e = err("127.0.0.1:9650", h);
        assert!(e.contains("listen \"127.0.0.1:9650\" and healthAddress"), "{e}");
        assert!(
            Config::resolve_with_env(f("unix:/tmp/x.sock", &format!(r#"{h},"tls":{{"dir":"/d"}}"#)), &env)
                .unwrap()
                .tls
                .is_some()
        );
        assert!(
            Config::resolve_with_env(f("unix:/tmp/x.sock", &format!(r#"{h},"insecure":true"#)), &env)
                .unwrap()
                .tls
                .is_none()
        );
        assert!(
            Config::resolve_with_env(f("unix:/tmp/x.sock", ""), &env).unwrap().tls.is_none(),
            "Unix sockets alone need neither"
        );
        assert!(err("127.0.0.1:1", r#","tls":{"certFile":"/c"}"#).contains("both certFile and keyFile"));
        assert!(err("127.0.0.1:1", r#","tls":{"bootstrap":{}}"#).contains("kubernetes"));
        assert!(err("127.0.0.1:1", r#","tls":{"dir":"/d"},"insecure":true"#).contains("contradict"));
        let k = r#","store":{"kind":"kubernetes"},"tls":{"bootstrap":{}}"#;
        let b = Config::resolve_with_env(f("0.0.0.0:9650", k), &env).unwrap().tls.unwrap();
        assert_eq!(b.files.cert_file, PathBuf::from("/tmp/x/tls/tls.crt"));
        let bs = b.bootstrap.unwrap();
        assert_eq!(bs.secret_name, "nodeplane-controller-tls");
        assert!(bs.dns_names.contains(&"nodeplane-controller.ns.svc".to_string()));
    }

    #[test]
    fn blocks_of_pools() {
        let p = Pool { net: "10.1.0.0/16".parse().unwrap(), block_prefix: 24 };
        assert_eq!(p.block_count(), 256);
        assert_eq!(p.block(3).to_string(), "10.1.3.0/24");
        let p = Pool { net: "fd00:1::/48".parse().unwrap(), block_prefix: 64 };
        assert_eq!(p.block(2).to_string(), "fd00:1:0:2::/64");
    }
}
