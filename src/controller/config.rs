//! Controller configuration: pools, block sizes, data dir, listen address.

use std::path::{Path, PathBuf};

use ipnetwork::IpNetwork;
use serde::Deserialize;

pub use crate::util::ConfigError;

/// One cluster pool and the size of the blocks it is cut into.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolConfig {
    pub cidr: String,
    /// Prefix length of each node block (e.g. 24 for IPv4, 64 for IPv6).
    pub block_prefix: u8,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileConfig {
    pub data_dir: PathBuf,
    /// `unix:/path/to.sock` or `host:port`.
    pub listen: String,
    pub pools: Vec<PoolConfig>,
    #[serde(default = "default_vni")]
    pub vxlan_vni: u32,
    #[serde(default = "default_port")]
    pub vxlan_port: u16,
    /// File holding the token-signing secret; default `<dataDir>/secret` (made on first start).
    pub secret_file: Option<PathBuf>,
    /// Unix socket for CSI Identity + Controller (the provisioner and resizer sidecars);
    /// default `<dataDir>/csi.sock`.
    pub csi_socket: Option<PathBuf>,
    /// How long a node may keep a volume the controller does not know before reclaiming it.
    #[serde(default = "default_grace")]
    pub orphan_grace_seconds: u64,
    /// How long one CSI call waits for a node before answering DEADLINE_EXCEEDED (retried).
    #[serde(default = "default_op_timeout")]
    pub volume_op_timeout_seconds: u64,
}

fn default_grace() -> u64 {
    600
}
fn default_op_timeout() -> u64 {
    60
}

fn default_vni() -> u32 {
    4242
}
fn default_port() -> u16 {
    4789
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    pub net: IpNetwork,
    pub block_prefix: u8,
}

impl Pool {
    /// How many blocks the pool holds (saturating).
    pub fn block_count(&self) -> u128 {
        let bits = (self.block_prefix - self.net.prefix()) as u32;
        if bits >= 128 { u128::MAX } else { 1u128 << bits }
    }
    /// The n-th block of the pool.
    pub fn block(&self, n: u128) -> IpNetwork {
        let host_bits = if self.net.is_ipv4() { 32 } else { 128 } - self.block_prefix as u32;
        match self.net.network() {
            std::net::IpAddr::V4(a) => {
                let base = u32::from(a) as u128 + (n << host_bits);
                IpNetwork::new(std::net::Ipv4Addr::from(base as u32).into(), self.block_prefix).expect("valid prefix")
            }
            std::net::IpAddr::V6(a) => {
                let off = if host_bits >= 128 { 0 } else { n << host_bits };
                IpNetwork::new(std::net::Ipv6Addr::from(u128::from(a) + off).into(), self.block_prefix)
                    .expect("valid prefix")
            }
        }
    }
}

#[derive(Debug, Clone)]
pub enum Listen {
    Unix(PathBuf),
    Tcp(std::net::SocketAddr),
}

#[derive(Debug, Clone)]
pub struct Config {
    pub data_dir: PathBuf,
    pub listen: Listen,
    pub pools: Vec<Pool>,
    pub vxlan_vni: u32,
    pub vxlan_port: u16,
    pub secret_file: PathBuf,
    pub csi_socket: PathBuf,
    pub orphan_grace: std::time::Duration,
    pub volume_op_timeout: std::time::Duration,
}

pub fn parse_listen(s: &str) -> Result<Listen, String> {
    if let Some(path) = s.strip_prefix("unix:") {
        let p = PathBuf::from(path);
        if !p.is_absolute() {
            return Err(format!("listen {s:?}: the socket path must be absolute"));
        }
        return Ok(Listen::Unix(p));
    }
    s.parse().map(Listen::Tcp).map_err(|_| format!("listen {s:?} is neither unix:/path nor host:port"))
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::resolve(crate::util::load_json(path)?)
    }

    pub fn resolve(f: FileConfig) -> Result<Self, ConfigError> {
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
                return Err(bad(format!("pools[{i}].cidr {} has host bits set (network is {})", p.cidr, net.network())));
            }
            let (max, fam) = if net.is_ipv4() { (30, "IPv4") } else { (126, "IPv6") };
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
                if q.net.is_ipv4() == net.is_ipv4() && (q.net.contains(net.network()) || net.contains(q.net.network())) {
                    return Err(bad(format!("pools[{i}] {net} overlaps pools[{j}] {}", q.net)));
                }
            }
            pools.push(Pool { net, block_prefix: p.block_prefix });
        }
        if f.vxlan_vni == 0 || f.vxlan_vni > 0xff_ffff {
            return Err(bad(format!("vxlanVni {} is outside 1..=16777215 (a VXLAN id has 24 bits)", f.vxlan_vni)));
        }
        if f.vxlan_port == 0 {
            return Err(bad("vxlanPort must not be 0".into()));
        }
        let secret_file = f.secret_file.clone().unwrap_or_else(|| f.data_dir.join("secret"));
        let csi_socket = f.csi_socket.clone().unwrap_or_else(|| f.data_dir.join("csi.sock"));
        if !csi_socket.is_absolute() {
            return Err(bad(format!("csiSocket {} must be absolute", csi_socket.display())));
        }
        if f.volume_op_timeout_seconds == 0 {
            return Err(bad("volumeOpTimeoutSeconds must be positive".into()));
        }
        Ok(Config {
            data_dir: f.data_dir,
            listen,
            pools,
            vxlan_vni: f.vxlan_vni,
            vxlan_port: f.vxlan_port,
            secret_file,
            csi_socket,
            orphan_grace: std::time::Duration::from_secs(f.orphan_grace_seconds),
            volume_op_timeout: std::time::Duration::from_secs(f.volume_op_timeout_seconds),
        })
    }

    pub fn cluster_cidrs(&self) -> Vec<String> {
        self.pools.iter().map(|p| p.net.to_string()).collect()
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
    fn blocks_of_pools() {
        let p = Pool { net: "10.1.0.0/16".parse().unwrap(), block_prefix: 24 };
        assert_eq!(p.block_count(), 256);
        assert_eq!(p.block(3).to_string(), "10.1.3.0/24");
        let p = Pool { net: "fd00:1::/48".parse().unwrap(), block_prefix: 64 };
        assert_eq!(p.block(2).to_string(), "fd00:1:0:2::/64");
    }
}
