//! Agent configuration: a JSON file, every path derived from one root unless set.

use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use serde::Deserialize;

use crate::cni::result::Dns;

pub use crate::util::ConfigError;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DnsConfig {
    #[serde(default)]
    pub nameservers: Vec<String>,
    pub domain: Option<String>,
    #[serde(default)]
    pub search: Vec<String>,
    #[serde(default)]
    pub options: Vec<String>,
}

/// Controller mode: blocks come from `nodeplane-controller`, routes to other nodes follow
/// its membership stream.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ControllerConfig {
    /// `unix:/path` or `host:port`.
    pub address: String,
    /// File holding this node's credential (`nodeplane-controller token NODE`).
    pub token_file: PathBuf,
    /// This node's underlay address(es); the first one is the VXLAN endpoint.
    pub underlay_addresses: Vec<std::net::IpAddr>,
    /// How to reach other nodes' pods: "auto" (direct on a shared L2 segment, else VXLAN),
    /// "direct" or "vxlan".
    #[serde(default)]
    pub route_mode: crate::routes::RouteMode,
}

/// The CSI node plugin (on unless `enabled: false`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CsiFileConfig {
    #[serde(default)]
    pub enabled: Option<bool>,
    /// Where volume images live (default `<stateDir>/volumes`).
    pub volume_dir: Option<PathBuf>,
    /// Bytes the node may hand out to volumes (default: half the filesystem holding the
    /// volume directory, measured at start).
    pub capacity_bytes: Option<u64>,
    /// Reported to kubelet as the node's volume limit (default 128).
    pub max_volumes: Option<i64>,
}

/// Kubelet device plugins (on unless `enabled: false`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DevicePluginFileConfig {
    #[serde(default)]
    pub enabled: Option<bool>,
    /// The device file (default `<root>/etc/nodeplane/devices.json`), reloaded on change.
    pub config_file: Option<PathBuf>,
    /// Where CDI specs are written (default `<root>/var/run/cdi`).
    pub cdi_dir: Option<PathBuf>,
}

/// Resolved CSI settings.
#[derive(Debug, Clone)]
pub struct CsiConfig {
    pub volume_dir: PathBuf,
    pub capacity_bytes: Option<u64>,
    pub max_volumes: i64,
}

/// The file format. Paths left out derive from `root`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    pub node_name: String,
    /// Prefix for every default path ("/" in production; a temp dir per simulated node).
    #[serde(default)]
    pub root: Option<PathBuf>,
    /// Pod address blocks of this node (one IPv4 and/or one IPv6 block in standalone mode).
    #[serde(default)]
    pub pod_cidrs: Vec<IpNetwork>,
    /// Cluster-wide pod/service ranges: traffic to them is never masqueraded.
    #[serde(default)]
    pub cluster_cidrs: Vec<IpNetwork>,
    #[serde(default = "default_mtu")]
    pub mtu: u32,
    #[serde(default = "default_bridge")]
    pub bridge: String,
    #[serde(default = "yes")]
    pub masquerade: bool,
    #[serde(default)]
    pub dns: Option<DnsConfig>,
    /// Extra plugin entries appended to the conflist after nodeplane (portmap, bandwidth…).
    #[serde(default)]
    pub chained_plugins: Vec<serde_json::Value>,
    /// cniVersion of the written conflist. 1.0.0 by default: runtimes whose CNI library
    /// predates spec 1.1.0 (podman 4, containerd 1.x) cannot read 1.1.0 results; set
    /// "1.1.0" for runtimes that send STATUS and GC. Lowered automatically to what every
    /// chained plugin supports.
    #[serde(default)]
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
    #[serde(default)]
    pub csi: Option<CsiFileConfig>,
    #[serde(default)]
    pub device_plugins: Option<DevicePluginFileConfig>,
    /// The shim binary to install; default: `nodeplane-cni` next to the agent binary.
    pub shim_source: Option<PathBuf>,
    /// Where the kernel boot id is read (tests point this elsewhere to simulate a reboot).
    pub boot_id_file: Option<PathBuf>,
    /// Get blocks from the controller instead of `podCidrs`.
    #[serde(default)]
    pub controller: Option<ControllerConfig>,
}

/// The conflist version written unless configured (see `FileConfig::cni_version`).
pub const DEFAULT_CNI_VERSION: &str = "1.0.0";

fn default_mtu() -> u32 {
    1500
}
fn default_bridge() -> String {
    "np0".into()
}
fn yes() -> bool {
    true
}

/// Resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub node_name: String,
    pub pod_cidrs: Vec<IpNetwork>,
    pub cluster_cidrs: Vec<IpNetwork>,
    pub mtu: u32,
    pub bridge: String,
    pub masquerade: bool,
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
    /// `None`: the CSI node plugin is off.
    pub csi: Option<CsiConfig>,
    /// `None`: device plugins are off.
    pub device_plugins: Option<crate::deviceplugin::Settings>,
    pub shim_source: PathBuf,
    pub boot_id_file: PathBuf,
    pub controller: Option<ControllerConfig>,
}

fn under(root: &Path, abs: &str) -> PathBuf {
    root.join(abs.trim_start_matches('/'))
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::resolve(crate::util::load_json(path)?)
    }

    pub fn resolve(f: FileConfig) -> Result<Self, ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if f.node_name.is_empty() {
            return bad("nodeName must not be empty".into());
        }
        if !crate::cni::request::valid_ifname(&f.bridge) {
            return bad(format!("bridge {:?} is not a valid interface name", f.bridge));
        }
        if !(68..=65535).contains(&f.mtu) {
            return bad(format!("mtu {} is outside 68..65535", f.mtu));
        }
        let v4 = f.pod_cidrs.iter().filter(|c| c.is_ipv4()).count();
        let v6 = f.pod_cidrs.len() - v4;
        if v4 > 1 || v6 > 1 {
            return bad("podCidrs takes at most one IPv4 and one IPv6 block".into());
        }
        for c in &f.pod_cidrs {
            crate::ipam::Block::new(*c).map_err(|e| ConfigError::Invalid(format!("podCidrs: {e}")))?;
        }
        if let Some(c) = &f.controller {
            if !f.pod_cidrs.is_empty() {
                return bad("podCidrs and controller are exclusive: in controller mode the blocks come from the controller".into());
            }
            crate::controller::config::parse_listen(&c.address).map_err(|e| ConfigError::Invalid(format!("controller.address: {e}")))?;
            if c.underlay_addresses.is_empty() {
                return bad("controller.underlayAddresses must name this node's address(es)".into());
            }
        }
        for ns in f.dns.iter().flat_map(|d| &d.nameservers) {
            if ns.parse::<std::net::IpAddr>().is_err() {
                return bad(format!("dns.nameservers: {ns:?} is not an IP address"));
            }
        }
        for (i, p) in f.chained_plugins.iter().enumerate() {
            if p.get("type").and_then(|t| t.as_str()).is_none() {
                return bad(format!("chainedPlugins[{i}] needs a string \"type\""));
            }
        }
        let cni_version = f.cni_version.clone().unwrap_or_else(|| DEFAULT_CNI_VERSION.to_string());
        if !crate::cni::SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
            return bad(format!(
                "cniVersion {cni_version:?} is not one of {}",
                crate::cni::SUPPORTED_VERSIONS.join(", ")
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
        let csi_file = f.csi.clone().unwrap_or_default();
        let csi = if csi_file.enabled.unwrap_or(true) {
            let max_volumes = csi_file.max_volumes.unwrap_or(128);
            if max_volumes < 1 {
                return bad(format!("csi.maxVolumes {max_volumes} must be at least 1"));
            }
            if csi_file.capacity_bytes == Some(0) {
                return bad("csi.capacityBytes must be positive (set csi.enabled false to turn volumes off)".into());
            }
            Some(CsiConfig {
                volume_dir: csi_file.volume_dir.unwrap_or_else(|| state_dir.join("volumes")),
                capacity_bytes: csi_file.capacity_bytes,
                max_volumes,
            })
        } else {
            None
        };
        let dpf = f.device_plugins.clone().unwrap_or_default();
        let device_plugins = dpf.enabled.unwrap_or(true).then(|| crate::deviceplugin::Settings {
            config_file: dpf.config_file.clone().unwrap_or_else(|| under(&root, "/etc/nodeplane/devices.json")),
            plugin_dir: kubelet_dir.join("device-plugins"),
            cdi_dir: dpf.cdi_dir.clone().unwrap_or_else(|| under(&root, "/var/run/cdi")),
        });
        let dns = f
            .dns
            .map(|d| Dns { nameservers: d.nameservers, domain: d.domain, search: d.search, options: d.options })
            .unwrap_or_default();
        // Unix socket paths must fit sun_path (108 bytes with the NUL).
        let mut sockets = vec![
            f.cni_socket.clone().unwrap_or_else(|| under(&root, "/run/nodeplane/cni.sock")),
            f.node_socket.clone().unwrap_or_else(|| under(&root, "/run/nodeplane/node.sock")),
        ];
        if csi.is_some() {
            sockets.push(crate::csi::csi_socket(&kubelet_dir));
            sockets.push(crate::csi::registration_socket(&kubelet_dir));
        }
        for s in sockets {
            if s.as_os_str().len() >= 108 {
                return bad(format!("socket path {} is {} bytes; Unix sockets allow at most 107 (shorten root or kubeletDir)", s.display(), s.as_os_str().len()));
            }
        }
        Ok(Config {
            node_name: f.node_name,
            pod_cidrs: f.pod_cidrs,
            cluster_cidrs,
            mtu: f.mtu,
            bridge: f.bridge,
            masquerade: f.masquerade,
            dns,
            chained_plugins: f.chained_plugins,
            cni_version,
            plugin_dirs: if f.plugin_dirs.is_empty() {
                vec![f.cni_bin_dir.clone().unwrap_or_else(|| under(&root, "/opt/cni/bin"))]
            } else {
                f.plugin_dirs
            },
            cni_socket: f.cni_socket.unwrap_or_else(|| under(&root, "/run/nodeplane/cni.sock")),
            node_socket: f.node_socket.unwrap_or_else(|| under(&root, "/run/nodeplane/node.sock")),
            state_dir,
            kubelet_dir,
            csi,
            device_plugins,
            cni_bin_dir: f.cni_bin_dir.unwrap_or_else(|| under(&root, "/opt/cni/bin")),
            cni_conf_dir: f.cni_conf_dir.unwrap_or_else(|| under(&root, "/etc/cni/net.d")),
            shim_source,
            boot_id_file: f.boot_id_file.unwrap_or_else(|| PathBuf::from("/proc/sys/kernel/random/boot_id")),
            controller: f.controller,
        })
    }

    pub fn lease_dir(&self) -> PathBuf {
        self.state_dir.join("ipam")
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::resolve(serde_json::from_str(s).map_err(|e| ConfigError::Invalid(e.to_string()))?)
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
        let deep = format!(r#"{{"nodeName":"n","root":"/{}","shimSource":"/x"}}"#, "d".repeat(60));
        let e = parse(&deep).unwrap_err().to_string();
        assert!(e.contains("Unix sockets allow at most 107"), "{e}");
        let no_csi = format!(r#"{{"nodeName":"n","root":"/{}","shimSource":"/x","csi":{{"enabled":false}}}}"#, "d".repeat(60));
        assert!(parse(&no_csi).is_ok());
    }
}
