//! WireGuard devices over generic netlink (the kernel's `wireguard` family): read a
//! device's key, port and peers, and change them. Blocking, like [`super::netlink`]; the
//! socket belongs to the network namespace of the thread that opened it.
//!
//! The link itself (kind `wireguard`) is made with rtnetlink ([`super::netlink::Netlink`]).

use std::io;
use std::net::SocketAddr;

use ipnetwork::IpNetwork;
use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NetlinkDeserializable, NetlinkSerializable};
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

/// Peers per SET_DEVICE message (each is about 150 bytes with a few allowed IPs).
const PEERS_PER_MESSAGE: usize = 64;

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
    /// messages of at most [`PEERS_PER_MESSAGE`] peers.
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
        for (i, chunk) in changes.chunks(PEERS_PER_MESSAGE).enumerate() {
            let mut attrs = if i == 0 { device.clone() } else { vec![WireguardAttribute::IfName(ifname.into())] };
            attrs.push(WireguardAttribute::Peers(chunk.iter().map(peer_attrs).collect()));
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

fn peer_attrs(c: &PeerChange) -> WireguardPeer {
    match c {
        PeerChange::Remove(k) => WireguardPeer(vec![
            WireguardPeerAttribute::PublicKey(*k),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::RemoveMe),
        ]),
        PeerChange::Set { public_key, endpoint, allowed, keepalive } => WireguardPeer(vec![
            WireguardPeerAttribute::PublicKey(*public_key),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::ReplaceAllowedIps),
            WireguardPeerAttribute::Endpoint(*endpoint),
            WireguardPeerAttribute::PersistentKeepalive(*keepalive),
            WireguardPeerAttribute::AllowedIps(allowed.iter().map(allowed_ip).collect()),
        ]),
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
