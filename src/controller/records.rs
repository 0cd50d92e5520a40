//! The controller's records: what its backends store (nodes and their blocks, volumes) and
//! the pools blocks are cut from. Plain data, below the registry (`store`), the volume book
//! (`volumes`), the backends (`backend`, `kube`) and the configuration (`config`), which all
//! use it: none of them needs another to name a record. Also what their revisioned streams
//! share: epochs, and the last states a run of changes leaves.

use std::collections::BTreeMap;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};

/// The node store's backend (`file` or `lvm`), named apart from the controller's own
/// storage backends (`backend`).
pub use crate::storage::store::Backend as StoreBackend;

/// A new epoch for a registry or book instance (never 0): its revisions compare only with
/// those of the same epoch.
pub fn random_epoch() -> u64 {
    let mut seed = [0u8; 8];
    crate::util::fill_random(&mut seed);
    u64::from_le_bytes(seed).max(1)
}

/// The last state of everything `changes` (consecutive, in order: the records each wrote
/// and the names it removed) touch, each named once, in name order: the records written and
/// the names removed.
pub fn last_states<'a, T: 'a>(
    changes: impl IntoIterator<Item = (&'a [T], &'a [String])>,
    name: impl Fn(&'a T) -> &'a str,
) -> (Vec<&'a T>, Vec<String>) {
    let mut last = BTreeMap::new();
    for (upserts, removed) in changes {
        last.extend(upserts.iter().map(|r| (name(r), Some(r))));
        last.extend(removed.iter().map(|n| (n.as_str(), None)));
    }
    let (written, removed): (Vec<_>, Vec<_>) = last.into_iter().partition(|(_, r)| r.is_some());
    (written.into_iter().filter_map(|(_, r)| r).collect(), removed.into_iter().map(|(n, _)| n.to_string()).collect())
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    pub underlay: Vec<String>,
    #[serde(default)]
    pub vtep_mac: String,
    pub blocks: Vec<String>,
    /// The node's WireGuard public key, base64 ("": none).
    #[serde(default)]
    pub wireguard_key: String,
}

/// Kubernetes' rule for object names (and so for node names), as an error message names it.
pub const SUBDOMAIN_RULE: &str = "must be a lowercase RFC 1123 subdomain (the Kubernetes rule for object and node names): \
     at most 253 characters of lower case alphanumerics, '-' and '.', every '.'-separated part starting and ending with \
     an alphanumeric character (regex [a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)";

/// Why `name` is not a DNS-1123 subdomain (Kubernetes object names, node names), if it is not.
pub fn subdomain_error(name: &str) -> Option<String> {
    let part_ok = |p: &str| {
        let b = p.as_bytes();
        !b.is_empty()
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
    };
    if name.is_empty() {
        return Some(format!("is empty; it {SUBDOMAIN_RULE}"));
    }
    if name.len() > 253 {
        return Some(format!("has {} characters; it {SUBDOMAIN_RULE}", name.len()));
    }
    (!name.split('.').all(part_ok)).then(|| SUBDOMAIN_RULE.to_string())
}

/// Node names follow Kubernetes object names (DNS-1123 subdomain).
pub fn valid_node_name(name: &str) -> bool {
    subdomain_error(name).is_none()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VolState {
    Creating,
    Ready,
    Deleting,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRecord {
    pub id: String,
    pub name: String,
    pub node: String,
    /// Desired size (grows with ControllerExpandVolume).
    pub size_bytes: u64,
    /// Serialised as "ext4", "xfs" or "" (raw block), as before it was typed.
    pub fs_type: crate::storage::fs::FsType,
    pub state: VolState,
    pub created_at: u64,
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// A volume, or a snapshot of one (both live in the volume book and its backends).
    #[serde(default, skip_serializing_if = "RecordKind::is_volume")]
    pub kind: RecordKind,
    /// A snapshot: the volume it is of. A volume: the volume it was cloned from.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source_volume: String,
    /// A volume restored from this snapshot.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source_snapshot: String,
    /// The node's store backend it is on (a snapshot: its volume's). Records written
    /// before there was a choice load as `file`.
    #[serde(default, skip_serializing_if = "StoreBackend::is_file")]
    pub backend: StoreBackend,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecordKind {
    #[default]
    Volume,
    Snapshot,
}

impl RecordKind {
    pub fn is_volume(&self) -> bool {
        *self == RecordKind::Volume
    }
}
