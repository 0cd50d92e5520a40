//! Encryption of pod traffic between nodes: one WireGuard device per node (`np.wg`), one
//! peer per other node that has published a key, allowed IPs = that node's pod blocks.
//!
//! - **Keys.** The node's X25519 private key is a 0600 file in the state directory, made on
//!   first start and replaced only by a rotation. It is never logged and never leaves the
//!   node; the public key goes to the controller at registration, and from there to the
//!   other nodes with the membership.
//! - **Routes.** [`super::routes`] sends a peer's blocks through this device (`<block> via
//!   <gateway> dev np.wg onlink`) when encryption is on and the peer has a key, in every
//!   route mode; the device takes the place of the direct route or the VXLAN tunnel.
//! - **Strict mode.** The cluster CIDRs get blackhole routes (route protocol
//!   [`RTPROT_STRICT`]): a peer block without an encrypted route matches nothing more
//!   specific and is dropped instead of leaving in clear.
//! - **Peers** carry a persistent keepalive: a peer added or re-keyed sends one at once, so
//!   its handshake does not wait for traffic, and a rotation costs one handshake.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};

use crate::sys::netlink::{Netlink, NetlinkError};
use crate::sys::wireguard::{Device, Key, Peer, PeerChange, Wg};

/// The device's name.
pub const DEVICE: &str = "np.wg";
/// The UDP port WireGuard listens on, cluster-wide (Cilium's choice: no clash with a
/// hand-made wg0 on 51820).
pub const DEFAULT_PORT: u16 = 51871;
/// Seconds between keepalives when a peer is otherwise quiet.
pub const KEEPALIVE_SECONDS: u16 = 25;
/// Encapsulation overhead over an IPv4 underlay: outer IPv4 20 + UDP 8 + WireGuard 32
/// (type, receiver index and counter 16, authentication tag 16).
pub const OVERHEAD_V4: u32 = 60;
/// Over an IPv6 underlay (outer header 40 bytes).
pub const OVERHEAD_V6: u32 = 80;
/// Route protocol of strict mode's blackhole routes (one above the peer routes' 0x4e).
pub const RTPROT_STRICT: u8 = 0x4f;

/// Whether pod traffic between nodes is encrypted (the controller's `encryption.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// No device, no keys exchanged; routes as without this module.
    #[default]
    Off,
    /// Encrypted to every peer with a key; in clear to a peer without one.
    On,
    /// Encrypted, or dropped.
    Strict,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Off => "off",
            Mode::On => "on",
            Mode::Strict => "strict",
        })
    }
}

// ----- keys -----

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("wireguard key file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "wireguard key file {} does not hold a base64 key of 32 bytes; it is left as it is (move it away to make a new key)",
        path.display()
    )]
    Corrupt { path: PathBuf },
    #[error(
        "wireguard key file {} has mode {mode:o}: others may have read the private key; remove the file to make a new key",
        path.display()
    )]
    Exposed { path: PathBuf, mode: u32 },
}

/// The node's key pair. Its `Debug` shows the public key only.
#[derive(Clone)]
pub struct KeyPair {
    private: Key,
    public: Key,
}

impl std::fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyPair {{ public: {} }}", encode_key(&self.public))
    }
}

impl KeyPair {
    pub fn from_private(private: Key) -> Self {
        let secret = x25519_dalek::StaticSecret::from(private);
        let public = x25519_dalek::PublicKey::from(&secret).to_bytes();
        KeyPair { private: secret.to_bytes(), public }
    }

    /// A new key pair from the kernel's random source.
    pub fn generate() -> Self {
        let mut k = [0u8; 32];
        crate::util::fill_random(&mut k);
        Self::from_private(k)
    }

    pub fn public(&self) -> &Key {
        &self.public
    }

    pub fn private(&self) -> &Key {
        &self.private
    }

    /// Load the key file, or make it when there is none. A file that exists but is not a
    /// key, or that others can read, is an error and is left untouched.
    pub fn load_or_create(path: &Path) -> Result<Self, KeyError> {
        let io = |source| KeyError::Io { path: path.to_path_buf(), source };
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let mode = std::fs::metadata(path).map_err(io)?.permissions().mode() & 0o777;
                if mode & 0o077 != 0 {
                    return Err(KeyError::Exposed { path: path.to_path_buf(), mode });
                }
                let key = parse_key(text.trim()).ok_or_else(|| KeyError::Corrupt { path: path.to_path_buf() })?;
                Ok(Self::from_private(key))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let pair = Self::generate();
                pair.save(path)?;
                tracing::info!(public_key = %encode_key(&pair.public), "made this node's wireguard key");
                Ok(pair)
            }
            Err(e) => Err(io(e)),
        }
    }

    /// Write the private key to `path` (0600, atomically, synced).
    pub fn save(&self, path: &Path) -> Result<(), KeyError> {
        let body = format!("{}\n", encode_key(&self.private));
        crate::sys::fs::atomic_write(path, body.as_bytes(), 0o600)
            .map_err(|source| KeyError::Io { path: path.to_path_buf(), source })
    }
}

/// A key in WireGuard's text form (standard base64).
pub fn encode_key(k: &Key) -> String {
    base64::engine::general_purpose::STANDARD.encode(k)
}

/// A key from its text form; `None` unless it is base64 of exactly 32 bytes.
pub fn parse_key(s: &str) -> Option<Key> {
    base64::engine::general_purpose::STANDARD.decode(s).ok()?.try_into().ok()
}

// ----- peers: pure -----

/// What the device should hold for one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WantPeer {
    pub node: String,
    pub endpoint: SocketAddr,
    pub allowed: Vec<IpNetwork>,
}

/// Another node with a key, as the peer computation needs it.
#[derive(Debug, Clone, Copy)]
pub struct PeerInput<'a> {
    pub name: &'a str,
    pub key: Key,
    /// Its underlay address (of our underlay's family when it has one).
    pub endpoint: IpAddr,
    pub blocks: &'a [IpNetwork],
}

/// The peers the device should hold, by public key. Nodes are taken in name order, so a
/// key claimed twice (which the controller refuses) goes to the same node every time.
pub fn wanted(peers: &[PeerInput], port: u16) -> BTreeMap<Key, WantPeer> {
    let mut sorted = peers.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(b.name));
    let mut out = BTreeMap::new();
    for p in sorted {
        if let Some(first) = out.get(&p.key) {
            let first: &WantPeer = first;
            tracing::warn!(peer = %p.name, other = %first.node, "two nodes publish one wireguard key: ignored");
            continue;
        }
        let normalize = |n: &IpNetwork| IpNetwork::new(n.network(), n.prefix()).unwrap_or(*n);
        let mut allowed: Vec<IpNetwork> = p.blocks.iter().map(normalize).collect();
        allowed.sort();
        allowed.dedup();
        out.insert(p.key, WantPeer { node: p.name.to_string(), endpoint: SocketAddr::new(p.endpoint, port), allowed });
    }
    out
}

/// The changes that turn the device's `current` peers into `want`: removals first.
pub fn changes(current: &[Peer], want: &BTreeMap<Key, WantPeer>) -> Vec<PeerChange> {
    let now: BTreeMap<&Key, &Peer> = current.iter().map(|p| (&p.public_key, p)).collect();
    let mut out: Vec<PeerChange> = current
        .iter()
        .filter(|p| !want.contains_key(&p.public_key))
        .map(|p| PeerChange::Remove(p.public_key))
        .collect();
    for (key, w) in want {
        let same = now.get(key).is_some_and(|p| {
            let mut allowed = p.allowed.clone();
            allowed.sort();
            p.endpoint == Some(w.endpoint) && allowed == w.allowed && p.keepalive == KEEPALIVE_SECONDS
        });
        if !same {
            out.push(PeerChange::Set {
                public_key: *key,
                endpoint: w.endpoint,
                allowed: w.allowed.clone(),
                keepalive: KEEPALIVE_SECONDS,
            });
        }
    }
    out
}

/// MTU of the device over an underlay link of `underlay_mtu`.
pub fn device_mtu(underlay_mtu: u32, local: IpAddr) -> u32 {
    underlay_mtu.saturating_sub(if local.is_ipv6() { OVERHEAD_V6 } else { OVERHEAD_V4 })
}

// ----- the device -----

#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    #[error("{context}: {source}")]
    Netlink {
        context: String,
        #[source]
        source: NetlinkError,
    },
    #[error("a {kind} link named {DEVICE} exists; not ours, left alone")]
    NotOurs { kind: String },
    #[error("this node has no usable wireguard key (see the log at start)")]
    NoKey,
}

fn nl_err(context: impl Into<String>) -> impl FnOnce(NetlinkError) -> TunnelError {
    let context = context.into();
    move |source| TunnelError::Netlink { context, source }
}

/// The node's WireGuard device, in the network namespace [`Tunnel::new`] ran in.
pub struct Tunnel {
    wg: Wg,
    keys: KeyPair,
    port: u16,
}

impl Tunnel {
    /// Open the generic netlink socket (fails on a kernel without WireGuard).
    pub fn new(keys: KeyPair, port: u16) -> Result<Self, TunnelError> {
        let wg = Wg::open().map_err(nl_err("wireguard"))?;
        Ok(Tunnel { wg, keys, port })
    }

    pub fn public_key(&self) -> &Key {
        self.keys.public()
    }

    /// Create or adopt the device with our key, port and `mtu`, up; its ifindex.
    pub fn ensure(&mut self, nl: &mut Netlink, mtu: u32) -> Result<u32, TunnelError> {
        let index = match nl.vxlan_by_name(DEVICE).map_err(nl_err(format!("looking up {DEVICE}")))? {
            Some(l) if l.link.kind.as_deref() != Some("wireguard") => {
                return Err(TunnelError::NotOurs { kind: l.link.kind.unwrap_or_default() });
            }
            Some(l) => {
                if l.link.mtu != Some(mtu) {
                    nl.set_mtu(l.link.index, mtu).map_err(nl_err(format!("setting MTU {mtu} on {DEVICE}")))?;
                }
                if !l.link.up {
                    nl.set_link(l.link.index, Some(true), None, None, None)
                        .map_err(nl_err(format!("bringing {DEVICE} up")))?;
                }
                l.link.index
            }
            None => {
                nl.create_wireguard(DEVICE, mtu).map_err(nl_err(format!("creating {DEVICE}")))?;
                tracing::info!(device = DEVICE, mtu, port = self.port, "created the wireguard device");
                nl.index_of(DEVICE)
                    .map_err(nl_err(format!("looking up {DEVICE}")))?
                    .ok_or_else(|| nl_err(format!("{DEVICE} vanished"))(enodev()))?
            }
        };
        let dev = self.device()?;
        if dev.public_key != Some(*self.keys.public()) || dev.listen_port != self.port {
            self.wg
                .configure(DEVICE, Some(self.keys.private()), Some(self.port), &[])
                .map_err(nl_err(format!("setting the key and port of {DEVICE}")))?;
        }
        Ok(index)
    }

    /// Take a new key pair: the device uses it at once (its sessions re-handshake).
    pub fn rekey(&mut self, keys: KeyPair) -> Result<(), TunnelError> {
        self.wg.configure(DEVICE, Some(keys.private()), None, &[]).map_err(nl_err(format!("re-keying {DEVICE}")))?;
        self.keys = keys;
        Ok(())
    }

    /// The device as the kernel has it.
    pub fn device(&mut self) -> Result<Device, TunnelError> {
        self.wg.device(DEVICE).map_err(nl_err(format!("reading {DEVICE}")))
    }

    /// Make the device's peers exactly those of `peers` that have a key; the number of
    /// changes.
    pub fn sync(&mut self, peers: &[PeerInput]) -> Result<usize, TunnelError> {
        let want = wanted(peers, self.port);
        let now = self.device()?;
        let todo = changes(&now.peers, &want);
        if !todo.is_empty() {
            self.wg.configure(DEVICE, None, None, &todo).map_err(nl_err(format!("setting peers of {DEVICE}")))?;
            tracing::info!(peers = want.len(), changes = todo.len(), "wireguard peers set");
        }
        Ok(todo.len())
    }
}

fn enodev() -> NetlinkError {
    NetlinkError { op: "index".into(), source: std::io::Error::from_raw_os_error(libc::ENODEV) }
}

/// The node's device as the kernel has it now (status and metrics read it at each call).
pub fn read_device() -> Result<Device, NetlinkError> {
    Wg::open()?.device(DEVICE)
}

/// Remove the device if it exists (encryption turned off).
pub fn remove_device(nl: &mut Netlink) -> Result<bool, NetlinkError> {
    match nl.index_of(DEVICE)? {
        Some(i) => nl.delete_link(i).map(|()| true),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &'static str, ul: &str, blocks: &[&str], key: u8) -> PeerInput<'static> {
        let blocks: Vec<IpNetwork> = blocks.iter().map(|b| b.parse().unwrap()).collect();
        PeerInput { name, key: [key; 32], endpoint: ul.parse().unwrap(), blocks: Vec::leak(blocks) }
    }

    fn tmp() -> PathBuf {
        let d = std::env::temp_dir().join(format!("np-wgkey-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn key_file_is_made_once_private_and_kept() {
        let d = tmp();
        let path = d.join("wireguard.key");
        let a = KeyPair::load_or_create(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let b = KeyPair::load_or_create(&path).unwrap();
        assert_eq!(a.public(), b.public(), "a second start keeps the key");
        assert_ne!(a.public(), a.private());
        assert!(!format!("{a:?}").contains(&encode_key(a.private())), "Debug never shows the private key");
        // The public key is the X25519 base-point multiple (RFC 7748 section 6.1's vector).
        let alice = KeyPair::from_private(
            hex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a").try_into().unwrap(),
        );
        assert_eq!(alice.public().to_vec(), hex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn a_bad_or_exposed_key_file_is_an_error_and_left_alone() {
        let d = tmp();
        let path = d.join("wireguard.key");
        std::fs::write(&path, "not a key\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = KeyPair::load_or_create(&path).unwrap_err();
        assert!(matches!(e, KeyError::Corrupt { .. }), "{e}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "not a key\n", "never overwritten");
        let short = base64::engine::general_purpose::STANDARD.encode([1u8; 31]);
        std::fs::write(&path, &short).unwrap();
        assert!(matches!(KeyPair::load_or_create(&path), Err(KeyError::Corrupt { .. })));
        KeyPair::generate().save(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = KeyPair::load_or_create(&path).unwrap_err();
        assert!(matches!(e, KeyError::Exposed { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("644"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn keys_round_trip_as_text() {
        let k = KeyPair::generate();
        assert_eq!(parse_key(&encode_key(k.public())), Some(*k.public()));
        assert_eq!(encode_key(k.public()).len(), 44);
        assert_eq!(parse_key("AAAA"), None);
        assert_eq!(parse_key("not base64!"), None);
    }

    #[test]
    fn wanted_peers_come_from_keyed_nodes() {
        let a = peer("a", "192.0.2.1", &["10.244.1.0/24", "fd00::/64"], 1);
        let b = peer("b", "192.0.2.2", &["10.244.2.7/24"], 2);
        let c = peer("c", "192.0.2.3", &["10.244.3.0/24"], 1);
        let w = wanted(&[c, b, a], 51871);
        assert_eq!(w.len(), 2, "c claims a's key and loses by name order");
        assert_eq!(w[&[2; 32]].allowed, ["10.244.2.0/24".parse().unwrap()], "blocks normalized");
        let got = &w[&[1; 32]];
        assert_eq!(got.node, "a");
        assert_eq!(got.endpoint, "192.0.2.1:51871".parse().unwrap());
        assert_eq!(got.allowed, ["10.244.1.0/24".parse().unwrap(), "fd00::/64".parse().unwrap()]);
    }

    #[test]
    fn changes_remove_stale_peers_and_set_new_or_changed_ones() {
        let a = peer("a", "192.0.2.1", &["10.244.1.0/24"], 1);
        let b = peer("b", "192.0.2.2", &["10.244.2.0/24"], 2);
        let want = wanted(&[a, b], 51871);
        let kernel = |key: u8, ep: &str, allowed: &[&str]| Peer {
            public_key: [key; 32],
            endpoint: Some(ep.parse().unwrap()),
            allowed: allowed.iter().map(|n| n.parse().unwrap()).collect(),
            keepalive: KEEPALIVE_SECONDS,
            last_handshake: 0,
            rx_bytes: 0,
            tx_bytes: 0,
        };
        // The kernel matches: nothing to do.
        let same = [kernel(1, "192.0.2.1:51871", &["10.244.1.0/24"]), kernel(2, "192.0.2.2:51871", &["10.244.2.0/24"])];
        assert!(changes(&same, &want).is_empty());
        // A rotated key (9 -> 2), a moved endpoint, a stale peer.
        let now = [kernel(1, "192.0.2.9:51871", &["10.244.1.0/24"]), kernel(9, "192.0.2.2:51871", &["10.244.2.0/24"])];
        let c = changes(&now, &want);
        assert_eq!(c[0], PeerChange::Remove([9; 32]), "removals come first");
        let set: Vec<Key> = c[1..]
            .iter()
            .map(|x| match x {
                PeerChange::Set { public_key, .. } => *public_key,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(set, [[1; 32], [2; 32]]);
    }
}
