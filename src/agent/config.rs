//! Agent configuration: a JSON file, every path derived from one root unless set.

use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use serde::Deserialize;

use crate::net::cni::result::Dns;

pub use crate::util::ConfigError;

/// Whether the agent serves Kubernetes Services (see [`FileConfig::services`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ServicesMode {
    #[default]
    Auto,
    On,
    Off,
}

/// Controller mode: blocks come from `nodeplane-controller`, routes to other nodes follow
/// its membership stream.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ControllerConfig {
    /// `unix:/path` or `host:port`; empty (or absent): env `NODEPLANE_CONTROLLER_ADDRESS`.
    #[serde(default)]
    pub address: String,
    /// File holding this node's credential (`nodeplane-controller token NODE`, or a
    /// projected service-account token). May be left out when `tls` gives a client
    /// certificate: the certificate is then the credential.
    #[serde(default)]
    pub token_file: PathBuf,
    /// TLS to a TCP address: the CA bundle the controller is verified against, optionally
    /// the name to verify and a client certificate. Required for TCP unless `insecure`.
    pub tls: Option<crate::rpc::tls::ClientFiles>,
    /// Talk plaintext to a TCP address (a warning at every start).
    #[serde(default)]
    pub insecure: bool,
    /// This node's underlay address(es); the first one is the VXLAN endpoint. Empty (or
    /// absent): env `NODE_IPS` (comma-separated; a DaemonSet sets it from `status.hostIP`).
    #[serde(default)]
    pub underlay_addresses: Vec<std::net::IpAddr>,
    /// How to reach other nodes' pods: "auto" (direct on a shared L2 segment, else VXLAN),
    /// "direct" or "vxlan".
    #[serde(default)]
    pub route_mode: crate::net::routes::RouteMode,
    /// Seconds between complete route audits: the kernel is read again and drift (a route
    /// removed by hand) repaired. Membership changes in between are applied as deltas.
    #[serde(default = "default_route_audit")]
    pub route_audit_seconds: u64,
}

fn default_route_audit() -> u64 {
    60
}

/// Check `csi.lvm`: LVM's names (`[A-Za-z0-9+_.-]`, not starting with `-`), a ratio ≥ 1.
fn lvm_config(l: &LvmFileConfig) -> Result<crate::storage::store::ThinPoolConfig, String> {
    for (field, name) in [("volumeGroup", &l.volume_group), ("thinPool", &l.thin_pool)] {
        let ok = !name.is_empty()
            && name.len() <= 64
            && !name.starts_with('-')
            && name != "."
            && name != ".."
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"+_.-".contains(&b));
        if !ok {
            return Err(format!("csi.lvm.{field} {name:?} is not an LVM name ([A-Za-z0-9+_.-], at most 64)"));
        }
    }
    let ratio = l.overprovision_ratio.unwrap_or(1.0);
    if !(ratio.is_finite() && ratio >= 1.0) {
        return Err(format!("csi.lvm.overprovisionRatio {ratio} must be at least 1"));
    }
    Ok(crate::storage::store::ThinPoolConfig {
        volume_group: l.volume_group.clone(),
        thin_pool: l.thin_pool.clone(),
        overprovision_ratio: ratio,
    })
}

/// The CSI node plugin (on unless `enabled: false`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CsiFileConfig {
    pub enabled: Option<bool>,
    /// Where volume images live (default `<stateDir>/volumes`).
    pub volume_dir: Option<PathBuf>,
    /// Bytes the node may hand out to volumes (default: half the filesystem holding the
    /// volume directory, measured at start).
    pub capacity_bytes: Option<u64>,
    /// Reported to kubelet as the node's volume limit (default 128).
    pub max_volumes: Option<i64>,
    /// Serve kubelet's registration socket ourselves (default true). False when the
    /// upstream node-driver-registrar sidecar registers the driver (it owns the socket).
    pub self_register: Option<bool>,
    /// The `lvm` backend: an LVM thin pool for volumes of classes with `backend: lvm`
    /// (absent: only the file backend).
    pub lvm: Option<LvmFileConfig>,
}

/// `csi.lvm`: the thin pool the `lvm` backend makes its volumes in. The operator makes
/// the volume group and the pool (docs/storage.md, "Preparing a volume group").
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LvmFileConfig {
    pub volume_group: String,
    pub thin_pool: String,
    /// Virtual sizes may add up to this many times the pool's data size (default 1: no
    /// overprovisioning).
    pub overprovision_ratio: Option<f64>,
}

/// Kubelet device plugins (on unless `enabled: false`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DevicePluginFileConfig {
    pub enabled: Option<bool>,
    /// The device file (default `<root>/etc/nodeplane/devices.json`), reloaded on change.
    pub config_file: Option<PathBuf>,
    /// Where CDI specs are written (default `<root>/var/run/cdi`).
    pub cdi_dir: Option<PathBuf>,
}

/// The DRA kubelet plugin `dra.nodeplane.dev` (off unless `enabled: true`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DraFileConfig {
    pub enabled: Option<bool>,
    /// Where `dra.sock` is served (default `<kubeletDir>/plugins/dra.nodeplane.dev`).
    pub plugin_dir: Option<PathBuf>,
    /// The device file (default: the device plugins' `configFile`).
    pub config_file: Option<PathBuf>,
    /// Where per-claim CDI specs are written (default: the device plugins' `cdiDir`).
    pub cdi_dir: Option<PathBuf>,
}

/// Resolved CSI settings.
#[derive(Debug, Clone)]
pub struct CsiConfig {
    pub volume_dir: PathBuf,
    pub capacity_bytes: Option<u64>,
    pub max_volumes: i64,
    pub self_register: bool,
    pub lvm: Option<crate::storage::store::ThinPoolConfig>,
}

/// The file format. Paths left out derive from `root`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    /// Absent: env `NODE_NAME` (one ConfigMap for every node of a DaemonSet).
    pub node_name: Option<String>,
    /// Prefix for every default path ("/" in production; a temp dir per simulated node).
    pub root: Option<PathBuf>,
    /// Pod address blocks of this node (one IPv4 and/or one IPv6 block in standalone mode).
    #[serde(default)]
    pub pod_cidrs: Vec<IpNetwork>,
    /// Cluster-wide pod/service ranges: traffic to them is never masqueraded.
    #[serde(default)]
    pub cluster_cidrs: Vec<IpNetwork>,
    /// Pod interface MTU. Absent: derived from the underlay and what encapsulates pod
    /// traffic between nodes (docs/network.md, "Pod MTU"); 1500 without a controller.
    pub mtu: Option<u32>,
    #[serde(default = "default_bridge")]
    pub bridge: String,
    #[serde(default = "yes")]
    pub masquerade: bool,
    /// Enforce Kubernetes NetworkPolicy (controller mode only: the controller compiles it).
    #[serde(default = "yes")]
    pub network_policy: bool,
    /// Serve Kubernetes Services (controller mode only): `auto` (the default) unless
    /// kube-proxy programs the node, `on` even then, `off` never.
    #[serde(default)]
    pub services: ServicesMode,
    pub dns: Option<Dns>,
    /// Extra plugin entries appended to the conflist after nodeplane (portmap, bandwidth…).
    #[serde(default)]
    pub chained_plugins: Vec<serde_json::Value>,
    /// cniVersion of the written conflist. 1.0.0 by default: runtimes whose CNI library
    /// predates spec 1.1.0 (podman 4, containerd 1.x) cannot read 1.1.0 results; set
    /// "1.1.0" for runtimes that send STATUS and GC. Lowered automatically to what every
    /// chained plugin supports.
    pub cni_version: Option<String>,
    /// Where chained plugins are looked up to ask their supported versions
    /// (default: the CNI bin dir).
    #[serde(default)]
    pub plugin_dirs: Vec<PathBuf>,
    pub cni_socket: Option<PathBuf>,
    /// The agent's local node API (default `<root>/run/nodeplane/node.sock`).
    pub node_socket: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub cni_bin_dir: Option<PathBuf>,
    pub cni_conf_dir: Option<PathBuf>,
    /// Kubelet's root directory (default `<root>/var/lib/kubelet`): CSI and registration
    /// sockets live under it, and every staging and target path must lie inside it.
    pub kubelet_dir: Option<PathBuf>,
    /// kubelet's device plugin directory (default `<root>/var/lib/kubelet/device-plugins`).
    /// kubelet uses `/var/lib/kubelet/device-plugins/` whatever its `--root-dir`, while the
    /// CSI paths follow `--root-dir`: this does not derive from `kubeletDir`.
    pub device_plugin_dir: Option<PathBuf>,
    /// Fail readiness when kubelet has not registered a served plugin within
    /// `kubeletRegistrationGraceSeconds` (the DaemonSet sets this; default false: local
    /// clusters run without a kubelet). A plugin kubelet refused fails readiness either way.
    pub require_kubelet_registration: Option<bool>,
    /// How long kubelet may take to register a served plugin before a warning (default 30).
    pub kubelet_registration_grace_seconds: Option<f64>,
    pub csi: Option<CsiFileConfig>,
    pub device_plugins: Option<DevicePluginFileConfig>,
    pub dra: Option<DraFileConfig>,
    /// The shim binary to install; default: `nodeplane-cni` next to the agent binary.
    pub shim_source: Option<PathBuf>,
    /// Where the kernel boot id is read (tests point this elsewhere to simulate a reboot).
    pub boot_id_file: Option<PathBuf>,
    /// Get blocks from the controller instead of `podCidrs`.
    pub controller: Option<ControllerConfig>,
    /// `IP:port` of the HTTP health endpoint (`/healthz`, `/readyz`); "" turns it off.
    #[serde(default = "default_health_address")]
    pub health_address: String,
}

/// The pod MTU without a configured or derived one (no controller, or before it answered).
pub const DEFAULT_POD_MTU: u32 = 1500;

/// The conflist version written unless configured (see `FileConfig::cni_version`).
pub const DEFAULT_CNI_VERSION: &str = "1.0.0";

fn default_bridge() -> String {
    "np0".into()
}
fn yes() -> bool {
    true
}
/// Where the health endpoint listens unless configured (inside the node's network
/// namespace: probes use `host: 127.0.0.1`).
pub const DEFAULT_HEALTH_ADDRESS: &str = "127.0.0.1:9640";
fn default_health_address() -> String {
    DEFAULT_HEALTH_ADDRESS.into()
}

/// Environment variables read when the file leaves a value out.
pub const ENV_NODE_NAME: &str = "NODE_NAME";
pub const ENV_NODE_IPS: &str = "NODE_IPS";
pub const ENV_CONTROLLER_ADDRESS: &str = "NODEPLANE_CONTROLLER_ADDRESS";

/// `fd00::a:9650` → `[fd00::a]:9650`: a DaemonSet composes the address from the Service's
/// `_SERVICE_HOST` and `_SERVICE_PORT` variables, which leave an IPv6 host unbracketed.
/// Anything else is returned as it is.
pub fn bracket_ipv6_host(addr: &str) -> String {
    if addr.parse::<std::net::SocketAddr>().is_ok() || addr.starts_with("unix:") {
        return addr.to_string();
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if host.parse::<std::net::Ipv6Addr>().is_ok() && port.parse::<u16>().is_ok() => {
            format!("[{host}]:{port}")
        }
        _ => addr.to_string(),
    }
}

/// Looks up an environment variable (an indirection so tests need not touch the process
/// environment). Empty values count as unset.
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn process_env(key: &str) -> Option<String> {
    std::env::var(key).ok()
}

/// Resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub node_name: String,
    pub pod_cidrs: Vec<IpNetwork>,
    pub cluster_cidrs: Vec<IpNetwork>,
    /// The configured pod MTU; `None`: derived (see [`FileConfig::mtu`]).
    pub mtu: Option<u32>,
    pub bridge: String,
    pub masquerade: bool,
    /// NetworkPolicy enforced (controller mode and `networkPolicy` not false).
    pub network_policy: bool,
    pub services: ServicesMode,
    pub dns: Dns,
    pub chained_plugins: Vec<serde_json::Value>,
    pub cni_version: String,
    pub plugin_dirs: Vec<PathBuf>,
    pub cni_socket: PathBuf,
    pub node_socket: PathBuf,
    pub state_dir: PathBuf,
    pub cni_bin_dir: PathBuf,
    pub cni_conf_dir: PathBuf,
    pub kubelet_dir: PathBuf,
    /// kubelet's device plugin directory (where `kubelet.sock` is).
    pub device_plugin_dir: PathBuf,
    pub require_kubelet_registration: bool,
    pub kubelet_registration_grace: std::time::Duration,
    /// `None`: the CSI node plugin is off.
    pub csi: Option<CsiConfig>,
    /// `None`: device plugins are off.
    pub device_plugins: Option<crate::devices::deviceplugin::Settings>,
    /// `None`: the DRA plugin is off.
    pub dra: Option<crate::devices::dra::Settings>,
    pub shim_source: PathBuf,
    pub boot_id_file: PathBuf,
    pub controller: Option<ControllerConfig>,
    /// `None`: no health endpoint.
    pub health_address: Option<std::net::SocketAddr>,
}

fn under(root: &Path, abs: &str) -> PathBuf {
    root.join(abs.trim_start_matches('/'))
}

impl Config {
    /// Load the file; values it leaves out may come from the process environment.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_with_env(path, &process_env)
    }

    pub fn load_with_env(path: &Path, env: EnvLookup) -> Result<Self, ConfigError> {
        Self::resolve_with_env(crate::util::load_json(path)?, env)
    }

    pub fn resolve_with_env(mut f: FileConfig, env: EnvLookup) -> Result<Self, ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let env = |key: &str| env(key).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let node_name = match f.node_name.take() {
            Some(n) if n.is_empty() => return bad("nodeName must not be empty".into()),
            Some(n) => n,
            None => match env(ENV_NODE_NAME) {
                Some(n) => n,
                None => {
                    return bad(format!(
                        "nodeName is not set in the file and {ENV_NODE_NAME} is not set in the environment"
                    ));
                }
            },
        };
        let health_address = match f.health_address.trim() {
            "" => None,
            a => match crate::obs::health::parse_address(a) {
                Ok(sa) if sa.port() == 0 => {
                    return bad(format!("healthAddress {a:?} needs a fixed port (probes must know it)"));
                }
                // The agent drops CAP_NET_BIND_SERVICE at start (src/agent/caps.rs): say so
                // here rather than fail at bind.
                Ok(sa) if sa.port() < 1024 => {
                    return bad(format!(
                        "healthAddress {a:?}: the port must be 1024 or above (the agent keeps no CAP_NET_BIND_SERVICE)"
                    ));
                }
                Ok(sa) => Some(sa),
                Err(e) => return bad(format!("healthAddress: {e}; \"\" turns the endpoint off")),
            },
        };
        if !crate::net::cni::request::valid_ifname(&f.bridge) {
            return bad(format!("bridge {:?} is not a valid interface name", f.bridge));
        }
        if let Some(mtu) = f.mtu
            && !(68..=65535).contains(&mtu)
        {
            return bad(format!("mtu {mtu} is outside 68..65535"));
        }
        let v4 = f.pod_cidrs.iter().filter(|c| c.is_ipv4()).count();
        let v6 = f.pod_cidrs.len() - v4;
        if v4 > 1 || v6 > 1 {
            return bad("podCidrs takes at most one IPv4 and one IPv6 block".into());
        }
        for c in &f.pod_cidrs {
            crate::net::ipam::Block::new(*c).map_err(|e| ConfigError::Invalid(format!("podCidrs: {e}")))?;
        }
        if let Some(c) = &mut f.controller {
            if !f.pod_cidrs.is_empty() {
                return bad(
                    "podCidrs and controller are exclusive: in controller mode the blocks come from the controller"
                        .into(),
                );
            }
            if c.address.trim().is_empty() {
                c.address = match env(ENV_CONTROLLER_ADDRESS) {
                    Some(a) => bracket_ipv6_host(&a),
                    None => {
                        return bad(format!(
                            "controller.address is empty and {ENV_CONTROLLER_ADDRESS} is not set in the environment"
                        ));
                    }
                };
            }
            let tcp = matches!(
                crate::rpc::parse_listen(&c.address)
                    .map_err(|e| ConfigError::Invalid(format!("controller.address: {e}")))?,
                crate::rpc::Listen::Tcp(_)
            );
            match (&c.tls, c.insecure) {
                (None, false) if tcp => {
                    return bad(format!(
                        "controller.address {:?} is TCP: give controller.tls (caFile: the controller's CA bundle), or set controller.insecure: true to send the credential in plaintext",
                        c.address
                    ));
                }
                (Some(_), true) => {
                    return bad("controller.tls and controller.insecure: true contradict each other".into());
                }
                (Some(t), false) if !t.ca_file.is_absolute() => {
                    return bad(format!("controller.tls.caFile {} must be absolute", t.ca_file.display()));
                }
                (Some(t), false) if t.cert_file.is_some() != t.key_file.is_some() => {
                    return bad("controller.tls.certFile and keyFile go together".into());
                }
                _ => {}
            }
            let has_cert = c.tls.as_ref().is_some_and(|t| t.cert_file.is_some());
            if c.token_file.as_os_str().is_empty() && !has_cert {
                return bad("controller.tokenFile is required (or a client certificate in controller.tls)".into());
            }
            if c.underlay_addresses.is_empty() {
                let Some(list) = env(ENV_NODE_IPS) else {
                    return bad(format!(
                        "controller.underlayAddresses must name this node's address(es), or {ENV_NODE_IPS} must (comma-separated; a DaemonSet sets it from status.hostIP)"
                    ));
                };
                for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    match item.parse::<std::net::IpAddr>() {
                        Ok(ip) if !ip.is_unspecified() && !ip.is_multicast() => c.underlay_addresses.push(ip),
                        _ => {
                            return bad(format!("{ENV_NODE_IPS}: {item:?} is not a usable IP address (from {list:?})"));
                        }
                    }
                }
                if c.underlay_addresses.is_empty() {
                    return bad(format!("{ENV_NODE_IPS} ({list:?}) names no address"));
                }
            }
        }
        let dns = f.dns.unwrap_or_default();
        for ns in &dns.nameservers {
            if ns.parse::<std::net::IpAddr>().is_err() {
                return bad(format!("dns.nameservers: {ns:?} is not an IP address"));
            }
        }
        for (i, p) in f.chained_plugins.iter().enumerate() {
            let Some(t) = p.get("type").and_then(|t| t.as_str()) else {
                return bad(format!("chainedPlugins[{i}] needs a string \"type\""));
            };
            // The type names a binary in the plugin dirs (the agent runs it for VERSION, the
            // runtime for everything): a plain file name, never a path.
            if t.is_empty()
                || t == "."
                || t == ".."
                || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            {
                return bad(format!("chainedPlugins[{i}].type {t:?} is not a plugin name ([A-Za-z0-9._-], no path)"));
            }
        }
        let cni_version = f.cni_version.clone().unwrap_or_else(|| DEFAULT_CNI_VERSION.to_string());
        if !crate::net::cni::SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
            return bad(format!(
                "cniVersion {cni_version:?} is not one of {}",
                crate::net::cni::SUPPORTED_VERSIONS.join(", ")
            ));
        }
        let root = f.root.clone().unwrap_or_else(|| PathBuf::from("/"));
        if !root.is_absolute() {
            return bad(format!("root {} must be absolute", root.display()));
        }
        let cluster_cidrs = if f.cluster_cidrs.is_empty() {
            f.pod_cidrs.iter().map(|c| IpNetwork::new(c.network(), c.prefix()).unwrap()).collect()
        } else {
            f.cluster_cidrs.clone()
        };
        let shim_source = match f.shim_source {
            Some(p) => p,
            None => std::env::current_exe()
                .map_err(|e| ConfigError::Invalid(format!("cannot locate own binary: {e}")))?
                .with_file_name("nodeplane-cni"),
        };
        let state_dir = f.state_dir.clone().unwrap_or_else(|| under(&root, "/var/lib/nodeplane"));
        let kubelet_dir = f.kubelet_dir.clone().unwrap_or_else(|| under(&root, "/var/lib/kubelet"));
        if !kubelet_dir.is_absolute() {
            return bad(format!("kubeletDir {} must be absolute", kubelet_dir.display()));
        }
        let device_plugin_dir =
            f.device_plugin_dir.clone().unwrap_or_else(|| under(&root, "/var/lib/kubelet/device-plugins"));
        if !device_plugin_dir.is_absolute() {
            return bad(format!("devicePluginDir {} must be absolute", device_plugin_dir.display()));
        }
        let kubelet_registration_grace = match f.kubelet_registration_grace_seconds {
            None => crate::kubelet::DEFAULT_GRACE,
            Some(s) if s.is_finite() && s > 0.0 && s <= 86_400.0 => std::time::Duration::from_secs_f64(s),
            Some(s) => return bad(format!("kubeletRegistrationGraceSeconds {s} must be above 0 and at most 86400")),
        };
        let csi_file = f.csi.clone().unwrap_or_default();
        let csi = if csi_file.enabled.unwrap_or(true) {
            let max_volumes = csi_file.max_volumes.unwrap_or(128);
            if max_volumes < 1 {
                return bad(format!("csi.maxVolumes {max_volumes} must be at least 1"));
            }
            if csi_file.capacity_bytes == Some(0) {
                return bad("csi.capacityBytes must be positive (set csi.enabled false to turn volumes off)".into());
            }
            let lvm = match &csi_file.lvm {
                None => None,
                Some(l) => Some(lvm_config(l).map_err(ConfigError::Invalid)?),
            };
            Some(CsiConfig {
                volume_dir: csi_file.volume_dir.unwrap_or_else(|| state_dir.join("volumes")),
                capacity_bytes: csi_file.capacity_bytes,
                max_volumes,
                self_register: csi_file.self_register.unwrap_or(true),
                lvm,
            })
        } else {
            None
        };
        let dpf = f.device_plugins.clone().unwrap_or_default();
        let device_file = dpf.config_file.unwrap_or_else(|| under(&root, "/etc/nodeplane/devices.json"));
        let cdi_dir = dpf.cdi_dir.unwrap_or_else(|| under(&root, "/var/run/cdi"));
        let device_plugins = dpf.enabled.unwrap_or(true).then(|| crate::devices::deviceplugin::Settings {
            config_file: device_file.clone(),
            plugin_dir: device_plugin_dir.clone(),
            cdi_dir: cdi_dir.clone(),
        });
        let draf = f.dra.clone().unwrap_or_default();
        let dra = if draf.enabled.unwrap_or(false) {
            let plugin_dir = draf
                .plugin_dir
                .clone()
                .unwrap_or_else(|| kubelet_dir.join("plugins").join(crate::devices::dra::DRIVER_NAME));
            if !plugin_dir.is_absolute() {
                return bad(format!("dra.pluginDir {} must be absolute", plugin_dir.display()));
            }
            Some(crate::devices::dra::Settings {
                node_name: node_name.clone(),
                config_file: draf.config_file.clone().unwrap_or(device_file),
                cdi_dir: draf.cdi_dir.clone().unwrap_or(cdi_dir),
                plugin_dir,
                registry_dir: kubelet_dir.join("plugins_registry"),
                state_dir: state_dir.clone(),
            })
        } else {
            None
        };
        let cni_socket = f.cni_socket.unwrap_or_else(|| under(&root, crate::net::shim::DEFAULT_SOCKET));
        let node_socket = f.node_socket.unwrap_or_else(|| under(&root, "/run/nodeplane/node.sock"));
        // Unix socket paths must fit sun_path (108 bytes with the NUL).
        let mut sockets = vec![cni_socket.clone(), node_socket.clone()];
        if let Some(c) = &csi {
            sockets.push(crate::storage::csi::csi_socket(&kubelet_dir));
            if c.self_register {
                sockets.push(crate::storage::csi::registration_socket(&kubelet_dir));
            }
        }
        if let Some(d) = &dra {
            sockets.push(d.socket());
            sockets.push(d.registration_socket());
        }
        for s in sockets {
            if s.as_os_str().len() >= 108 {
                return bad(format!(
                    "socket path {} is {} bytes; Unix sockets allow at most 107 (shorten root or kubeletDir)",
                    s.display(),
                    s.as_os_str().len()
                ));
            }
        }
        Ok(Config {
            node_name,
            pod_cidrs: f.pod_cidrs,
            cluster_cidrs,
            mtu: f.mtu,
            bridge: f.bridge,
            masquerade: f.masquerade,
            network_policy: f.network_policy,
            services: f.services,
            dns,
            chained_plugins: f.chained_plugins,
            cni_version,
            plugin_dirs: if f.plugin_dirs.is_empty() {
                vec![f.cni_bin_dir.clone().unwrap_or_else(|| under(&root, "/opt/cni/bin"))]
            } else {
                f.plugin_dirs
            },
            cni_socket,
            node_socket,
            state_dir,
            kubelet_dir,
            device_plugin_dir,
            require_kubelet_registration: f.require_kubelet_registration.unwrap_or(false),
            kubelet_registration_grace,
            csi,
            device_plugins,
            dra,
            cni_bin_dir: f.cni_bin_dir.unwrap_or_else(|| under(&root, "/opt/cni/bin")),
            cni_conf_dir: f.cni_conf_dir.unwrap_or_else(|| under(&root, "/etc/cni/net.d")),
            shim_source,
            boot_id_file: f.boot_id_file.unwrap_or_else(|| PathBuf::from("/proc/sys/kernel/random/boot_id")),
            controller: f.controller,
            health_address,
        })
    }

    pub fn lease_dir(&self) -> PathBuf {
        self.state_dir.join("ipam")
    }
    /// What the pod datapath needs of this configuration.
    pub fn net_settings(&self) -> crate::net::datapath::Settings {
        crate::net::datapath::Settings {
            bridge: self.bridge.clone(),
            mtu: self.mtu.unwrap_or(DEFAULT_POD_MTU),
            dns: self.dns.clone(),
            masquerade: self.masquerade,
            cluster_cidrs: self.cluster_cidrs.clone(),
            pending_delete_dir: self.pending_delete_dir(),
        }
    }

    pub fn pending_delete_dir(&self) -> PathBuf {
        self.state_dir.join("pending-del")
    }
    /// Blocks and cluster ranges last received from the controller.
    pub fn cluster_state_path(&self) -> PathBuf {
        self.state_dir.join("cluster.json")
    }
    pub fn conflist_path(&self) -> PathBuf {
        self.cni_conf_dir.join("10-nodeplane.conflist")
    }
}

impl Config {
    /// The resolved configuration as JSON, every path absolute, exactly as `serve` would use
    /// it (`nodeplane-agent check-config`).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let nets = |v: &[IpNetwork]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        json!({
            "nodeName": self.node_name,
            "podCidrs": nets(&self.pod_cidrs),
            "clusterCidrs": nets(&self.cluster_cidrs),
            "mtu": self.mtu,
            "bridge": self.bridge,
            "masquerade": self.masquerade,
            "networkPolicy": self.network_policy,
            "services": self.services,
            "dns": {"nameservers": self.dns.nameservers, "domain": self.dns.domain, "search": self.dns.search, "options": self.dns.options},
            "chainedPlugins": self.chained_plugins,
            "cniVersion": self.cni_version,
            "pluginDirs": self.plugin_dirs.iter().map(|p| abs(p)).collect::<Vec<_>>(),
            "cniBinDir": abs(&self.cni_bin_dir),
            "shimPath": abs(&self.cni_bin_dir.join(crate::net::cni::PLUGIN_TYPE)),
            "shimSource": abs(&self.shim_source),
            "cniConfDir": abs(&self.cni_conf_dir),
            "conflistPath": abs(&self.conflist_path()),
            "cniSocket": abs(&self.cni_socket),
            "nodeSocket": abs(&self.node_socket),
            "stateDir": abs(&self.state_dir),
            "pendingDeleteDir": abs(&self.pending_delete_dir()),
            "kubeletDir": abs(&self.kubelet_dir),
            "devicePluginDir": abs(&self.device_plugin_dir),
            "requireKubeletRegistration": self.require_kubelet_registration,
            "kubeletRegistrationGraceSeconds": self.kubelet_registration_grace.as_secs_f64(),
            "bootIdFile": abs(&self.boot_id_file),
            "healthAddress": self.health_address.map(|a| a.to_string()),
            "csi": match &self.csi {
                Some(c) => json!({
                    "enabled": true,
                    "volumeDir": abs(&c.volume_dir),
                    "capacityBytes": c.capacity_bytes,
                    "maxVolumes": c.max_volumes,
                    "selfRegister": c.self_register,
                    "lvm": c.lvm.as_ref().map(|l| json!({
                        "volumeGroup": l.volume_group,
                        "thinPool": l.thin_pool,
                        "overprovisionRatio": l.overprovision_ratio,
                    })),
                    "socket": abs(&crate::storage::csi::csi_socket(&self.kubelet_dir)),
                    "registrationSocket": abs(&crate::storage::csi::registration_socket(&self.kubelet_dir)),
                }),
                None => json!({"enabled": false}),
            },
            "devicePlugins": match &self.device_plugins {
                Some(d) => json!({
                    "enabled": true,
                    "configFile": abs(&d.config_file),
                    "pluginDir": abs(&d.plugin_dir),
                    "cdiDir": abs(&d.cdi_dir),
                }),
                None => json!({"enabled": false}),
            },
            "dra": match &self.dra {
                Some(d) => json!({
                    "enabled": true,
                    "driver": crate::devices::dra::DRIVER_NAME,
                    "pluginDir": abs(&d.plugin_dir),
                    "socket": abs(&d.socket()),
                    "registrationSocket": abs(&d.registration_socket()),
                    "configFile": abs(&d.config_file),
                    "cdiDir": abs(&d.cdi_dir),
                    "claimDir": abs(&crate::devices::dra::claim_dir(&d.state_dir)),
                    "preparedDir": abs(&crate::devices::dra::prepared_dir(&d.state_dir)),
                }),
                None => json!({"enabled": false}),
            },
            "controller": self.controller.as_ref().map(|c| json!({
                "address": c.address,
                "tokenFile": abs(&c.token_file),
                "underlayAddresses": c.underlay_addresses,
                "routeMode": c.route_mode,
            })),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        parse_env(s, &[])
    }

    /// Resolve with a fake environment (never the process's).
    fn parse_env(s: &str, vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env = |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        Config::resolve_with_env(serde_json::from_str(s).map_err(|e| ConfigError::Invalid(e.to_string()))?, &env)
    }

    fn err(r: Result<Config, ConfigError>) -> String {
        r.expect_err("should be rejected").to_string()
    }

    #[test]
    fn paths_derive_from_root() {
        let c = parse(r#"{"nodeName":"n1","root":"/tmp/n1","podCidrs":["10.5.0.0/24"],"shimSource":"/x"}"#).unwrap();
        assert_eq!(c.cni_socket, PathBuf::from("/tmp/n1/run/nodeplane/cni.sock"));
        assert_eq!(c.conflist_path(), PathBuf::from("/tmp/n1/etc/cni/net.d/10-nodeplane.conflist"));
        assert_eq!(c.cluster_cidrs, vec!["10.5.0.0/24".parse::<IpNetwork>().unwrap()]);
    }

    #[test]
    fn rejects_bad_values() {
        assert!(parse(r#"{"nodeName":"n","podCidrs":["10.0.0.0/24","10.1.0.0/24"],"shimSource":"/x"}"#).is_err());
        assert!(parse(r#"{"nodeName":"n","mtu":10,"shimSource":"/x"}"#).is_err());
        assert!(parse(r#"{"nodeName":"n","bridge":"way-too-long-bridge","shimSource":"/x"}"#).is_err());
        assert!(parse(r#"{"nodeName":"n","unknownKey":1}"#).is_err());
        assert!(parse(r#"{"nodeName":"n","chainedPlugins":[{"x":1}],"shimSource":"/x"}"#).is_err());
        for t in ["../../bin/x", "/usr/bin/x", "..", "", "a b"] {
            let cfg = format!(r#"{{"nodeName":"n","chainedPlugins":[{{"type":{t:?}}}],"shimSource":"/x"}}"#);
            assert!(parse(&cfg).is_err(), "chained plugin type {t:?} must be refused");
        }
        assert!(parse(r#"{"nodeName":"n","chainedPlugins":[{"type":"portmap"}],"shimSource":"/x"}"#).is_ok());
        let deep = format!(r#"{{"nodeName":"n","root":"/{}","shimSource":"/x"}}"#, "d".repeat(60));
        let e = parse(&deep).unwrap_err().to_string();
        assert!(e.contains("Unix sockets allow at most 107"), "{e}");
        let no_csi =
            format!(r#"{{"nodeName":"n","root":"/{}","shimSource":"/x","csi":{{"enabled":false}}}}"#, "d".repeat(60));
        assert!(parse(&no_csi).is_ok());
    }

    #[test]
    fn health_address() {
        let c = parse(r#"{"nodeName":"n","shimSource":"/x"}"#).unwrap();
        assert_eq!(c.health_address, Some("127.0.0.1:9640".parse().unwrap()));
        let c = parse(r#"{"nodeName":"n","shimSource":"/x","healthAddress":""}"#).unwrap();
        assert_eq!(c.health_address, None, "empty turns the endpoint off");
        let c = parse(r#"{"nodeName":"n","shimSource":"/x","healthAddress":"[::]:8080"}"#).unwrap();
        assert_eq!(c.health_address, Some("[::]:8080".parse().unwrap()));
        for bad in ["9640", "localhost:9640", "127.0.0.1", "127.0.0.1:0", "1.2.3.4:70000", "127.0.0.1:80", "[::1]:1023"]
        {
            let e = err(parse(&format!(r#"{{"nodeName":"n","shimSource":"/x","healthAddress":"{bad}"}}"#)));
            assert!(e.contains("healthAddress"), "{bad}: {e}");
        }
    }

    #[test]
    fn node_name_from_env() {
        let base = r#"{"shimSource":"/x"}"#;
        assert_eq!(parse_env(base, &[("NODE_NAME", "worker-7")]).unwrap().node_name, "worker-7");
        let e = err(parse_env(base, &[]));
        assert!(e.contains("nodeName") && e.contains("NODE_NAME"), "{e}");
        assert!(parse_env(base, &[("NODE_NAME", "  ")]).is_err(), "blank counts as unset");
        // The file wins over the environment.
        let c = parse_env(r#"{"nodeName":"from-file","shimSource":"/x"}"#, &[("NODE_NAME", "from-env")]).unwrap();
        assert_eq!(c.node_name, "from-file");
        // An explicitly empty name is a mistake, not a request for the fallback.
        assert!(parse_env(r#"{"nodeName":"","shimSource":"/x"}"#, &[("NODE_NAME", "x")]).is_err());
    }

    #[test]
    fn tcp_to_the_controller_needs_tls_or_insecure() {
        let env = [("NODE_NAME", "w1"), ("NODE_IPS", "192.0.2.7")];
        let cfg = |c: &str| format!(r#"{{"shimSource":"/x","controller":{{"address":"10.0.0.1:9650"{c}}}}}"#);
        let err = |c: &str| parse_env(&cfg(c), &env).unwrap_err().to_string();
        assert!(err(r#","tokenFile":"/t""#).contains("controller.insecure: true"));
        assert!(err(r#","tokenFile":"/t","insecure":true,"tls":{"caFile":"/c"}"#).contains("contradict"));
        assert!(err(r#","tokenFile":"/t","tls":{"caFile":"c.crt"}"#).contains("absolute"));
        assert!(err(r#","tls":{"caFile":"/c"}"#).contains("tokenFile is required"));
        assert!(err(r#","tls":{"caFile":"/c","certFile":"/a"}"#).contains("go together"));
        let c = parse_env(&cfg(r#","tls":{"caFile":"/c","certFile":"/a","keyFile":"/b"}"#), &env).unwrap();
        assert!(c.controller.unwrap().token_file.as_os_str().is_empty(), "a client certificate is the credential");
        assert!(parse_env(&cfg(r#","tokenFile":"/t","insecure":true"#), &env).unwrap().controller.unwrap().insecure);
        let unix = r#"{"shimSource":"/x","controller":{"address":"unix:/run/c.sock","tokenFile":"/t"}}"#;
        assert!(parse_env(unix, &env).is_ok(), "a Unix socket needs no TLS");
    }

    #[test]
    fn controller_values_from_env() {
        let shared = r#"{"shimSource":"/x","controller":{"address":"","tokenFile":"/t","tls":{"caFile":"/ca.crt"}}}"#;
        let env = [
            ("NODE_NAME", "w1"),
            ("NODE_IPS", "192.0.2.7, 2001:db8::7"),
            ("NODEPLANE_CONTROLLER_ADDRESS", "10.0.0.1:9650"),
        ];
        let c = parse_env(shared, &env).unwrap();
        assert_eq!(c.node_name, "w1");
        let cc = c.controller.unwrap();
        assert_eq!(cc.address, "10.0.0.1:9650");
        let ips: Vec<std::net::IpAddr> = vec!["192.0.2.7".parse().unwrap(), "2001:db8::7".parse().unwrap()];
        assert_eq!(cc.underlay_addresses, ips);
        // Absent keys behave like empty ones.
        let absent = r#"{"shimSource":"/x","controller":{"tokenFile":"/t","insecure":true}}"#;
        let cc = parse_env(absent, &env).unwrap().controller.unwrap();
        assert_eq!((cc.address.as_str(), cc.underlay_addresses), ("10.0.0.1:9650", ips));

        // File values win.
        let full = r#"{"nodeName":"n","shimSource":"/x","controller":{"address":"unix:/c.sock","tokenFile":"/t","underlayAddresses":["198.51.100.1"]}}"#;
        let cc = parse_env(full, &env).unwrap().controller.unwrap();
        assert_eq!(cc.address, "unix:/c.sock");
        assert_eq!(cc.underlay_addresses, vec!["198.51.100.1".parse::<std::net::IpAddr>().unwrap()]);

        // Neither: clear errors naming both the key and the variable.
        assert_eq!(bracket_ipv6_host("fd00::a:9650"), "[fd00::a]:9650");
        assert_eq!(bracket_ipv6_host("[fd00::a]:9650"), "[fd00::a]:9650");
        assert_eq!(bracket_ipv6_host("10.0.0.1:9650"), "10.0.0.1:9650");
        assert_eq!(bracket_ipv6_host("unix:/run/c.sock"), "unix:/run/c.sock");
        let e = err(parse_env(shared, &[("NODE_NAME", "w1"), ("NODEPLANE_CONTROLLER_ADDRESS", "10.0.0.1:9650")]));
        assert!(e.contains("underlayAddresses") && e.contains("NODE_IPS"), "{e}");
        let e = err(parse_env(shared, &[("NODE_NAME", "w1"), ("NODE_IPS", "192.0.2.7")]));
        assert!(e.contains("controller.address") && e.contains("NODEPLANE_CONTROLLER_ADDRESS"), "{e}");
        // Bad values from the environment are named.
        for ips in ["192.0.2.7,nonsense", "0.0.0.0", " , "] {
            let vars = [("NODE_NAME", "w1"), ("NODE_IPS", ips), ("NODEPLANE_CONTROLLER_ADDRESS", "10.0.0.1:9650")];
            let e = err(parse_env(shared, &vars));
            assert!(e.contains("NODE_IPS"), "{ips}: {e}");
        }
        let vars = [("NODE_NAME", "w1"), ("NODE_IPS", "192.0.2.7"), ("NODEPLANE_CONTROLLER_ADDRESS", "not an address")];
        let e = err(parse_env(shared, &vars));
        assert!(e.contains("controller.address"), "{e}");
        // Standalone mode reads no controller variables.
        assert!(parse_env(r#"{"nodeName":"n","shimSource":"/x"}"#, &[]).unwrap().controller.is_none());
    }

    #[test]
    fn load_with_env_reads_the_file() {
        let t = crate::util::TestDir::new("agent-config-env");
        let path = t.0.join("agent.json");
        std::fs::write(&path, r#"{"shimSource":"/x","healthAddress":"127.0.0.1:19640"}"#).unwrap();
        let c = Config::load_with_env(&path, &|k| (k == "NODE_NAME").then(|| "from-env".to_string())).unwrap();
        assert_eq!(c.node_name, "from-env");
        assert_eq!(c.health_address, Some("127.0.0.1:19640".parse().unwrap()));
        assert!(Config::load_with_env(&path, &|_| None).is_err());
    }
}
