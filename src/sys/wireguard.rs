//! WireGuard devices over generic netlink (the kernel's `wireguard` family): read a
//! device's key, port and peers, and change them. Blocking, like [`super::netlink`]; the
//! socket belongs to the network namespace of the thread that opened it.
//!
//! The link itself (kind `wireguard`) is made with rtnetlink ([`super::netlink::Netlink`]).

use std::io;
use std::net::SocketAddr;

use ipnetwork::IpNetwork;
use netlink_packet_core::{Emitable, NLM_F_ACK, NLM_F_DUMP, NetlinkDeserializable, NetlinkSerializable};
use netlink_packet_generic::GenlMessage;
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_wireguard::{
    WireguardAddressFamily, WireguardAllowedIp, WireguardAllowedIpAttr, WireguardAttribute, WireguardCmd,
    WireguardMessage, WireguardPeer, WireguardPeerAttribute, WireguardPeerFlags,
};
use netlink_sys::{Socket, SocketAddr as NlAddr, protocols::NETLINK_GENERIC};

use super::netlink::{NetlinkError, err};

/// A Curve25519 key (private or public), 32 bytes.
pub type Key = [u8; 32];

/// Bytes of peers per SET_DEVICE message. An attribute's length is 16 bits, so the peers'
/// nest must stay under 64 KiB.
const PEER_BYTES: usize = 16 * 1024;

/// Allowed IPs per message of a peer that has more (about 28 bytes each).
const ALLOWED_PER_FRAGMENT: usize = 256;

/// A peer as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub public_key: Key,
    pub endpoint: Option<SocketAddr>,
    pub allowed: Vec<IpNetwork>,
    pub keepalive: u16,
    /// Seconds since the Unix epoch of the last completed handshake (0: none yet).
    pub last_handshake: i64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

/// A device as the kernel reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Device {
    pub public_key: Option<Key>,
    pub listen_port: u16,
    pub peers: Vec<Peer>,
}

/// One change to a device's peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerChange {
    Remove(Key),
    /// Add or update: the endpoint, the keepalive and the allowed IPs (replaced as a whole).
    Set {
        public_key: Key,
        endpoint: SocketAddr,
        allowed: Vec<IpNetwork>,
        keepalive: u16,
    },
}

pub struct Wg {
    socket: Socket,
    family: u16,
    seq: u32,
    buf: Vec<u8>,
}

impl Wg {
    /// Open a generic netlink socket and look up the `wireguard` family (the kernel loads
    /// the module if it can; ENOENT: this kernel has no WireGuard).
    pub fn open() -> Result<Self, NetlinkError> {
        let mut socket = Socket::new(NETLINK_GENERIC).map_err(|e| err("socket", e))?;
        socket.bind_auto().map_err(|e| err("bind", e))?;
        socket.connect(&NlAddr::new(0, 0)).map_err(|e| err("connect", e))?;
        let mut wg = Wg { socket, family: 0, seq: 0, buf: vec![0u8; 64 * 1024] };
        let ask = GenlCtrl { cmd: GenlCtrlCmd::GetFamily, nlas: vec![GenlCtrlAttrs::FamilyName("wireguard".into())] };
        let op = "resolving the wireguard netlink family";
        let answers = wg.exchange(GenlMessage::from_payload(ask), NLM_F_ACK, op)?;
        wg.family = answers
            .iter()
            .flat_map(|m: &GenlMessage<GenlCtrl>| m.payload.nlas.iter())
            .find_map(|a| if let GenlCtrlAttrs::FamilyId(id) = a { Some(*id) } else { None })
            .ok_or_else(|| err(op, io::Error::from_raw_os_error(libc::ENOENT)))?;
        Ok(wg)
    }

    /// Send one request and collect the answers until its ack or the end of its dump.
    fn exchange<T>(&mut self, msg: T, flags: u16, op: &str) -> Result<Vec<T>, NetlinkError>
    where
        T: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
    {
        self.seq = self.seq.wrapping_add(1);
        super::netlink::exchange(&self.socket, &mut self.buf, self.seq, msg, flags, op)
    }

    fn message(&self, cmd: WireguardCmd, attributes: Vec<WireguardAttribute>) -> GenlMessage<WireguardMessage> {
        let mut m = GenlMessage::from_payload(WireguardMessage { cmd, attributes });
        m.set_resolved_family_id(self.family);
        m
    }

    /// The device named `ifname`: its public key, port and peers.
    pub fn device(&mut self, ifname: &str) -> Result<Device, NetlinkError> {
        let ask = self.message(WireguardCmd::GetDevice, vec![WireguardAttribute::IfName(ifname.into())]);
        let answers = self.exchange(ask, NLM_F_DUMP, &format!("reading wireguard device {ifname}"))?;
        let mut dev = Device::default();
        // A device with many peers comes in several messages, each with some of them.
        for a in answers.into_iter().flat_map(|m| m.payload.attributes) {
            match a {
                WireguardAttribute::PublicKey(k) => dev.public_key = Some(k).filter(|k| *k != [0; 32]),
                WireguardAttribute::ListenPort(p) => dev.listen_port = p,
                WireguardAttribute::Peers(peers) => {
                    peers.iter().filter_map(parse_peer).for_each(|p| add_peer(&mut dev, p))
                }
                _ => {}
            }
        }
        Ok(dev)
    }

    /// Set the private key and port (when given) and apply `changes` to the peers, in
    /// messages of at most [`PEER_BYTES`] of peers.
    pub fn configure(
        &mut self,
        ifname: &str,
        private_key: Option<&Key>,
        port: Option<u16>,
        changes: &[PeerChange],
    ) -> Result<(), NetlinkError> {
        let op = format!("configuring wireguard device {ifname}");
        let mut device = vec![WireguardAttribute::IfName(ifname.into())];
        device.extend(private_key.map(|k| WireguardAttribute::PrivateKey(*k)));
        device.extend(port.map(WireguardAttribute::ListenPort));
        if changes.is_empty() {
            let msg = self.message(WireguardCmd::SetDevice, device);
            return self.exchange(msg, NLM_F_ACK, &op).map(drop);
        }
        for (i, peers) in batches(changes).into_iter().enumerate() {
            let mut attrs = if i == 0 { device.clone() } else { vec![WireguardAttribute::IfName(ifname.into())] };
            attrs.push(WireguardAttribute::Peers(peers));
            let msg = self.message(WireguardCmd::SetDevice, attrs);
            self.exchange(msg, NLM_F_ACK, &op)?;
        }
        Ok(())
    }
}

/// Add `peer` to `dev`. A peer whose allowed IPs do not fit in one message comes again at
/// the start of the next, with its key and the rest of them (`linux/wireguard.h`): those
/// are added to the peer before it.
fn add_peer(dev: &mut Device, peer: Peer) {
    match dev.peers.last_mut() {
        Some(last) if last.public_key == peer.public_key => last.allowed.extend(peer.allowed),
        _ => dev.peers.push(peer),
    }
}

/// `changes` as the peers of successive SET_DEVICE messages, at most [`PEER_BYTES`] each.
fn batches(changes: &[PeerChange]) -> Vec<Vec<WireguardPeer>> {
    let mut out: Vec<Vec<WireguardPeer>> = Vec::new();
    let mut size = PEER_BYTES;
    for peer in changes.iter().flat_map(peer_attrs) {
        let n = peer.buffer_len();
        if size + n > PEER_BYTES {
            out.push(Vec::new());
            size = 0;
        }
        size += n;
        out.last_mut().expect("pushed above").push(peer);
    }
    out
}

/// One change as peer entries: one, or for a peer with more than [`ALLOWED_PER_FRAGMENT`]
/// allowed IPs, one per fragment of them. The first replaces the peer's allowed IPs; the
/// others only add theirs (`linux/wireguard.h`).
fn peer_attrs(c: &PeerChange) -> Vec<WireguardPeer> {
    match c {
        PeerChange::Remove(k) => vec![WireguardPeer(vec![
            WireguardPeerAttribute::PublicKey(*k),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::RemoveMe),
        ])],
        PeerChange::Set { public_key, endpoint, allowed, keepalive } => {
            let ips = |chunk: &[IpNetwork]| WireguardPeerAttribute::AllowedIps(chunk.iter().map(allowed_ip).collect());
            let mut chunks = allowed.chunks(ALLOWED_PER_FRAGMENT);
            let mut out = vec![WireguardPeer(vec![
                WireguardPeerAttribute::PublicKey(*public_key),
                WireguardPeerAttribute::Flags(WireguardPeerFlags::ReplaceAllowedIps),
                WireguardPeerAttribute::Endpoint(*endpoint),
                WireguardPeerAttribute::PersistentKeepalive(*keepalive),
                ips(chunks.next().unwrap_or_default()),
            ])];
            out.extend(chunks.map(|c| WireguardPeer(vec![WireguardPeerAttribute::PublicKey(*public_key), ips(c)])));
            out
        }
    }
}

fn allowed_ip(net: &IpNetwork) -> WireguardAllowedIp {
    let family = if net.is_ipv4() { WireguardAddressFamily::Ipv4 } else { WireguardAddressFamily::Ipv6 };
    WireguardAllowedIp(vec![
        WireguardAllowedIpAttr::Family(family),
        WireguardAllowedIpAttr::IpAddr(net.network()),
        WireguardAllowedIpAttr::Cidr(net.prefix()),
    ])
}

fn parse_peer(p: &WireguardPeer) -> Option<Peer> {
    let mut peer = Peer {
        public_key: [0; 32],
        endpoint: None,
        allowed: Vec::new(),
        keepalive: 0,
        last_handshake: 0,
        rx_bytes: 0,
        tx_bytes: 0,
    };
    let mut keyed = false;
    for a in p.iter() {
        match a {
            WireguardPeerAttribute::PublicKey(k) => (peer.public_key, keyed) = (*k, true),
            WireguardPeerAttribute::Endpoint(e) => peer.endpoint = Some(*e),
            WireguardPeerAttribute::PersistentKeepalive(k) => peer.keepalive = *k,
            WireguardPeerAttribute::LastHandshake(t) => peer.last_handshake = t.seconds,
            WireguardPeerAttribute::RxBytes(b) => peer.rx_bytes = *b,
            WireguardPeerAttribute::TxBytes(b) => peer.tx_bytes = *b,
            WireguardPeerAttribute::AllowedIps(ips) => peer.allowed.extend(ips.iter().filter_map(parse_allowed)),
            _ => {}
        }
    }
    keyed.then_some(peer)
}

fn parse_allowed(a: &WireguardAllowedIp) -> Option<IpNetwork> {
    let ip = a.iter().find_map(|x| if let WireguardAllowedIpAttr::IpAddr(ip) = x { Some(*ip) } else { None })?;
    let cidr = a.iter().find_map(|x| if let WireguardAllowedIpAttr::Cidr(c) = x { Some(*c) } else { None })?;
    IpNetwork::new(ip, cidr).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_go_in_messages_under_the_attribute_limit() {
        let ip = |j: u32| IpNetwork::new(std::net::Ipv4Addr::from(0x0a00_0000 + j * 4).into(), 30).unwrap();
        let set = |k: u8, n: u32| PeerChange::Set {
            public_key: [k; 32],
            endpoint: "192.0.2.1:51871".parse().unwrap(),
            allowed: (0..n).map(ip).collect(),
            keepalive: 25,
        };
        let batches = batches(&[set(1, 3000), PeerChange::Remove([2; 32]), set(3, 2)]);
        assert!(batches.len() > 1 && batches.iter().all(|b| b.as_slice().buffer_len() <= PEER_BYTES));
        let entries: Vec<&WireguardPeer> = batches.iter().flatten().collect();
        // 3,000 allowed IPs in 12 fragments, then the removal and the small peer.
        assert_eq!(entries.len(), 14);
        let replaces = |p: &WireguardPeer| {
            p.iter()
                .any(|a| matches!(a, WireguardPeerAttribute::Flags(f) if *f == WireguardPeerFlags::ReplaceAllowedIps))
        };
        assert!(replaces(entries[0]) && !entries[1..12].iter().any(|p| replaces(p)) && replaces(entries[13]));
        assert!(entries[..12].iter().all(|p| p.contains(&WireguardPeerAttribute::PublicKey([1; 32]))));
        let allowed: usize = entries[..12]
            .iter()
            .flat_map(|p| p.iter())
            .map(|a| if let WireguardPeerAttribute::AllowedIps(v) = a { v.len() } else { 0 })
            .sum();
        assert_eq!(allowed, 3000);
    }
}
