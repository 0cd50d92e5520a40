//! A small, synchronous rtnetlink socket wrapper.
//!
//! Each [`Netlink`] is bound to the network namespace it was opened in (a netlink socket
//! belongs to the namespace of the thread that created it). It is driven from ordinary
//! blocking code; the agent runs it on blocking threads, never on async workers.

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkDeserializable,
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, AddressScope};
use netlink_packet_route::link::{
    InfoBridge, InfoBridgePort, InfoData, InfoKind, InfoPortData, InfoPortKind, InfoVeth, InfoVxlan, LinkAttribute,
    LinkExtentMask, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// A netlink failure: the kernel's errno (when it answered) and what we were doing.
#[derive(Debug, thiserror::Error)]
#[error("netlink {op}: {source}")]
pub struct NetlinkError {
    pub op: String,
    #[source]
    pub source: io::Error,
}

impl NetlinkError {
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
    pub fn is(&self, errno: i32) -> bool {
        self.errno() == Some(errno)
    }
}

pub type Result<T> = std::result::Result<T, NetlinkError>;

pub(crate) fn err(op: impl Into<String>, source: io::Error) -> NetlinkError {
    NetlinkError { op: op.into(), source }
}

/// Send `msg` on `socket` as request `seq` (with `flags` besides `NLM_F_REQUEST`) and
/// collect the answers to it until its ack or the end of its dump. An error answer is the
/// kernel's errno. `buf` receives the datagrams (64 KiB holds any the kernel sends).
/// Shared by rtnetlink ([`Netlink`]) and generic netlink ([`super::wireguard`]).
pub(crate) fn exchange<T>(socket: &Socket, buf: &mut [u8], seq: u32, msg: T, flags: u16, op: &str) -> Result<Vec<T>>
where
    T: NetlinkSerializable + NetlinkDeserializable + std::fmt::Debug,
{
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    header.sequence_number = seq;
    let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
    packet.finalize();
    let mut out = vec![0u8; packet.buffer_len()];
    packet.serialize(&mut out);
    socket.send(&out, 0).map_err(|e| err(op, e))?;
    let bad = |e: String| err(op, io::Error::new(io::ErrorKind::InvalidData, e));
    let mut answers = Vec::new();
    loop {
        let n = match socket.recv(&mut &mut buf[..], 0) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(err(op, e)),
        };
        let mut offset = 0;
        while offset < n {
            let msg = NetlinkMessage::<T>::deserialize(&buf[offset..n]).map_err(|e| bad(e.to_string()))?;
            let len = msg.header.length as usize;
            if len == 0 {
                return Err(bad("zero-length message".into()));
            }
            offset += (len + 3) & !3;
            if msg.header.sequence_number != seq {
                continue;
            }
            match msg.payload {
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(answers),
                        Some(code) => Err(err(op, io::Error::from_raw_os_error(-code.get()))),
                    };
                }
                NetlinkPayload::Done(_) => return Ok(answers),
                NetlinkPayload::InnerMessage(inner) => answers.push(inner),
                _ => {}
            }
        }
    }
}

/// What we need to know about a link.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub mac: Option<[u8; 6]>,
    pub mtu: Option<u32>,
    pub up: bool,
    pub master: Option<u32>,
    pub group: u32,
    pub kind: Option<String>,
    /// For a veth: the peer's ifindex (in whatever namespace the peer lives in).
    pub peer: Option<u32>,
    /// For a bridge: whether it snoops IGMP/MLD (`mcast_snooping`).
    pub mcast_snooping: Option<bool>,
}

/// An address assigned to an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addr {
    pub index: u32,
    pub ip: IpAddr,
    pub prefix: u8,
}

/// Parameters for creating a veth pair.
pub struct VethSpec<'a> {
    pub host_name: &'a str,
    pub host_mac: [u8; 6],
    pub peer_name: &'a str,
    pub peer_mac: [u8; 6],
    pub peer_netns: BorrowedFd<'a>,
    pub mtu: u32,
    pub master: Option<u32>,
}

/// One step of configuring an interface inside a pod namespace; a slice of them is applied
/// in order (addresses before the routes that need them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkStep {
    Up {
        index: u32,
    },
    Address {
        index: u32,
        ip: IpAddr,
        prefix: u8,
    },
    /// A default route of the address family of `gateway`, out of `oif`.
    DefaultRoute {
        gateway: IpAddr,
        oif: u32,
    },
}

pub struct Netlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

fn family_of(ip: &IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

/// `getsockopt(SO_NETNS_COOKIE)` of the socket `fd`: the cookie of its network namespace.
pub fn netns_cookie_of(fd: std::os::fd::RawFd) -> io::Result<u64> {
    const SO_NETNS_COOKIE: libc::c_int = 71;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into a properly sized u64.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, SO_NETNS_COOKIE, (&raw mut cookie).cast(), &mut len) };
    if rc == 0 { Ok(cookie) } else { Err(io::Error::last_os_error()) }
}

impl Netlink {
    /// Open an rtnetlink socket in the calling thread's current network namespace.
    pub fn open() -> Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE).map_err(|e| err("socket", e))?;
        socket.bind_auto().map_err(|e| err("bind", e))?;
        socket.connect(&SocketAddr::new(0, 0)).map_err(|e| err("connect", e))?;
        // Extended acks are only used for messages; failing to enable them is harmless.
        let _ = socket.set_ext_ack(true);
        Ok(Netlink { socket, seq: 0, buf: vec![0u8; 64 * 1024] })
    }

    /// The cookie of the network namespace this socket lives in: unique for the life of
    /// the kernel and never reused (unlike a namespace's inode number). 0 if unsupported.
    pub fn netns_cookie(&self) -> u64 {
        netns_cookie_of(self.socket.as_raw_fd()).unwrap_or(0)
    }

    /// The index of the link named `name` in this socket's namespace (`None`: no such link).
    pub fn index_of(&mut self, name: &str) -> Result<Option<u32>> {
        Ok(self.link_by_name(name)?.map(|l| l.index))
    }

    /// Send one request and collect its answers ([`exchange`]).
    fn exchange(&mut self, msg: RouteNetlinkMessage, flags: u16, op: &str) -> Result<Vec<RouteNetlinkMessage>> {
        self.seq = self.seq.wrapping_add(1);
        exchange(&self.socket, &mut self.buf, self.seq, msg, flags, op)
    }

    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16, op: &str) -> Result<()> {
        self.exchange(msg, flags | NLM_F_ACK, op).map(drop)
    }

    fn dump(&mut self, msg: RouteNetlinkMessage, op: &str) -> Result<Vec<RouteNetlinkMessage>> {
        self.exchange(msg, NLM_F_DUMP, op)
    }

    /// Apply `steps` in order, one request each; the first failure stops them.
    pub fn apply(&mut self, steps: &[LinkStep]) -> Result<()> {
        for step in steps {
            let (msg, flags, op) = match *step {
                LinkStep::Up { index } => {
                    let mut msg = LinkMessage::default();
                    msg.header.index = index;
                    msg.header.flags = LinkFlags::Up;
                    msg.header.change_mask = LinkFlags::Up;
                    (RouteNetlinkMessage::SetLink(msg), 0, format!("set link {index} up=true"))
                }
                LinkStep::Address { index, ip, prefix } => address_request(index, ip, prefix),
                LinkStep::DefaultRoute { gateway, oif } => {
                    let mut msg = RouteMessage::default();
                    msg.header = RouteHeader {
                        address_family: family_of(&gateway),
                        table: RouteHeader::RT_TABLE_MAIN,
                        protocol: RouteProtocol::Boot,
                        scope: RouteScope::Universe,
                        kind: RouteType::Unicast,
                        ..Default::default()
                    };
                    msg.attributes.push(RouteAttribute::Gateway(RouteAddress::from(gateway)));
                    msg.attributes.push(RouteAttribute::Oif(oif));
                    let op = format!("add default route via {gateway} dev {oif}");
                    (RouteNetlinkMessage::NewRoute(msg), NLM_F_CREATE | NLM_F_EXCL, op)
                }
            };
            self.request(msg, flags, &op)?;
        }
        Ok(())
    }

    // ----- links -----

    pub fn links(&mut self) -> Result<Vec<Link>> {
        let msgs = self.dump(RouteNetlinkMessage::GetLink(get_link(None)), "dump links")?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(parse_link(&l)),
                _ => None,
            })
            .collect())
    }

    /// The link named `name`, `None` when there is none. A name no link can have (empty,
    /// over 15 bytes, or with a NUL) is EINVAL.
    pub fn link_by_name(&mut self, name: &str) -> Result<Option<Link>> {
        Ok(self.link_message(name)?.as_ref().map(parse_link))
    }

    /// The kernel's message for the link named `name` ([`Self::link_by_name`]).
    fn link_message(&mut self, name: &str) -> Result<Option<LinkMessage>> {
        let op = format!("get link {name}");
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(err(op, io::Error::from_raw_os_error(libc::EINVAL)));
        }
        match self.exchange(RouteNetlinkMessage::GetLink(get_link(Some(name))), NLM_F_ACK, &op) {
            Ok(msgs) => Ok(msgs.into_iter().find_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(l),
                _ => None,
            })),
            Err(e) if e.is(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Create a veth pair: host end here (optionally enslaved to `master`), peer end moved
    /// into `peer_netns`, in one request. The host end is created up; the peer is not.
    pub fn create_veth(&mut self, spec: &VethSpec<'_>) -> Result<()> {
        // The peer cannot be created up: the kernel opens it before the pair is linked
        // (veth_open would fail with ENOTCONN). The caller brings it up in its namespace.
        let mut peer = LinkMessage::default();
        peer.attributes.push(LinkAttribute::IfName(spec.peer_name.to_string()));
        peer.attributes.push(LinkAttribute::Address(spec.peer_mac.to_vec()));
        peer.attributes.push(LinkAttribute::Mtu(spec.mtu));
        peer.attributes.push(LinkAttribute::NetNsFd(spec.peer_netns.as_raw_fd()));
        // One queue each way, on both ends. The kernel's default for a veth is one per
        // possible CPU, and every queue is a set of sysfs objects made and removed with the
        // device: on this 2-CPU machine the second queue pair costs 0.18 ms of a 0.58 ms
        // creation, on a 64-CPU node far more. The queues serve XDP on veths, which nothing
        // attaches here; without XDP a veth transmits on the caller's CPU whatever the count
        // (iperf3 between two pods: no difference beyond noise, 1 or 4 streams).
        peer.attributes.push(LinkAttribute::NumTxQueues(1));
        peer.attributes.push(LinkAttribute::NumRxQueues(1));

        let mut msg = LinkMessage::default();
        msg.header.flags = LinkFlags::Up;
        msg.header.change_mask = LinkFlags::Up;
        msg.attributes.push(LinkAttribute::IfName(spec.host_name.to_string()));
        msg.attributes.push(LinkAttribute::Address(spec.host_mac.to_vec()));
        msg.attributes.push(LinkAttribute::Mtu(spec.mtu));
        msg.attributes.push(LinkAttribute::NumTxQueues(1));
        msg.attributes.push(LinkAttribute::NumRxQueues(1));
        if let Some(master) = spec.master {
            msg.attributes.push(LinkAttribute::Controller(master));
        }
        msg.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
        ]));
        self.request(
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("create veth {} <-> {}", spec.host_name, spec.peer_name),
        )?;
        if spec.master.is_some() {
            self.set_hairpin(0, Some(spec.host_name))?;
        }
        Ok(())
    }

    /// Put a bridge port in hairpin mode (by index, or by name with index 0): the bridge may
    /// send a frame back out of the port it came in on. A pod that reaches itself through a
    /// Service needs it: its packet, translated to its own address, leaves the node towards
    /// the port it arrived from (as the CNI bridge plugin's `hairpinMode`). A pod sees none of
    /// its own broadcasts back for it: its addresses are added without duplicate detection.
    /// The kernel takes bridge port settings only on an existing port, so not in the request
    /// that creates it.
    pub fn set_hairpin(&mut self, index: u32, name: Option<&str>) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        if let Some(name) = name {
            msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        }
        msg.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::PortKind(InfoPortKind::Bridge),
            LinkInfo::PortData(InfoPortData::BridgePort(vec![InfoBridgePort::HairpinMode(true)])),
        ]));
        let what = name.map_or_else(|| index.to_string(), str::to_string);
        // RTM_NEWLINK without NLM_F_CREATE: RTM_SETLINK ignores IFLA_LINKINFO.
        self.request(RouteNetlinkMessage::NewLink(msg), 0, &format!("hairpin mode on bridge port {what}"))
    }

    /// Create a bridge, administratively down (the caller tunes it, then brings it up), with
    /// multicast snooping off (see [`Netlink::set_mcast_snooping`]) and its MAC address given
    /// (random, locally administered), which pins it from the start.
    ///
    /// Given at creation, not set afterwards: Debian's 5.10 kernel (not its 6.1 or 6.12), told
    /// a bridge's own current MAC before the bridge has a port, keeps only the
    /// `vlan 1` local FDB entry for it, so with VLAN filtering off frames for the bridge's MAC
    /// are flooded to the ports instead of delivered to it: pods reach each other but not
    /// their gateway. An address in the creating request installs both entries.
    pub fn create_bridge(&mut self, name: &str, mtu: Option<u32>) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        msg.attributes.push(LinkAttribute::Address(random_mac().to_vec()));
        if let Some(mtu) = mtu {
            msg.attributes.push(LinkAttribute::Mtu(mtu));
        }
        msg.attributes.push(bridge_snooping(false));
        self.request(RouteNetlinkMessage::NewLink(msg), NLM_F_CREATE | NLM_F_EXCL, &format!("create bridge {name}"))
    }

    /// Change a link: up/down, master (Some(0) detaches), new name, link group.
    pub fn set_link(
        &mut self,
        index: u32,
        up: Option<bool>,
        master: Option<u32>,
        rename: Option<&str>,
        group: Option<u32>,
    ) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        if let Some(group) = group {
            msg.attributes.push(LinkAttribute::Group(group));
        }
        if let Some(up) = up {
            msg.header.flags = if up { LinkFlags::Up } else { LinkFlags::empty() };
            msg.header.change_mask = LinkFlags::Up;
        }
        if let Some(master) = master {
            msg.attributes.push(LinkAttribute::Controller(master));
        }
        if let Some(name) = rename {
            msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        }
        self.request(RouteNetlinkMessage::SetLink(msg), 0, &format!("set link {index}"))?;
        match master {
            Some(m) if m != 0 => self.set_hairpin(index, None),
            _ => Ok(()),
        }
    }

    /// Take the link named `name` down and into link `group` (it stays on its master, as a
    /// disabled port), in one request that selects the link by its name (no lookup first: a
    /// lookup is a request of its own, queued on the kernel's RTNL lock like every other).
    /// `Ok(false)`: no such link.
    pub fn retire_named(&mut self, name: &str, group: u32) -> Result<bool> {
        let mut msg = LinkMessage::default();
        msg.header.change_mask = LinkFlags::Up;
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        msg.attributes.push(LinkAttribute::Group(group));
        match self.request(RouteNetlinkMessage::SetLink(msg), 0, &format!("retire link {name}")) {
            Ok(()) => Ok(true),
            Err(e) if e.is(libc::ENODEV) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Set a link's MAC address. On a bridge this also pins it: the kernel stops deriving the
    /// bridge's address from its ports (which changes it whenever ports come and go).
    pub fn set_mac(&mut self, index: u32, mac: [u8; 6]) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.attributes.push(LinkAttribute::Address(mac.to_vec()));
        self.request(RouteNetlinkMessage::SetLink(msg), 0, &format!("set address of link {index}"))
    }

    /// Turn a bridge's IGMP/MLD snooping on or off. The pod bridge runs with it off: with no
    /// multicast querier on the bridge (there is none) a snooping bridge floods multicast to
    /// every port anyway, while it still keeps per-port multicast state and timers, learns a
    /// group entry from every pod's MLD report, and parses every report: about 8 % of the
    /// kernel's work of adding a veth to the bridge (perf, kernel 6.18), for nothing.
    pub fn set_mcast_snooping(&mut self, index: u32, on: bool) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.attributes.push(bridge_snooping(on));
        self.request(RouteNetlinkMessage::NewLink(msg), 0, &format!("set mcast_snooping of link {index}"))
    }

    /// Delete every link of a group in one request: the kernel unregisters them together
    /// and pays its RCU grace period once for the whole batch. No member is not an error.
    pub fn delete_group(&mut self, group: u32) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::Group(group));
        match self.request(RouteNetlinkMessage::DelLink(msg), 0, &format!("delete link group {group}")) {
            Err(e) if e.is(libc::ENODEV) => Ok(()),
            other => other,
        }
    }

    pub fn delete_link(&mut self, index: u32) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        self.request(RouteNetlinkMessage::DelLink(msg), 0, &format!("delete link {index}"))
    }

    // ----- addresses -----

    /// Add an address. IPv6 addresses skip duplicate address detection (they come from
    /// the node's own IPAM, which already guarantees uniqueness) so they work at once.
    pub fn add_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()> {
        let (msg, flags, op) = address_request(index, ip, prefix);
        self.request(msg, flags, &op)
    }

    /// Remove an address; one already gone is not an error.
    pub fn delete_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()> {
        let (RouteNetlinkMessage::NewAddress(msg), _, _) = address_request(index, ip, prefix) else {
            unreachable!("address_request makes a NewAddress")
        };
        match self.request(RouteNetlinkMessage::DelAddress(msg), 0, &format!("delete address {ip}/{prefix}")) {
            Err(e) if e.is(libc::EADDRNOTAVAIL) => Ok(()),
            other => other,
        }
    }

    pub fn addresses(&mut self, index: Option<u32>) -> Result<Vec<Addr>> {
        let msgs = self.dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()), "dump addresses")?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) => {
                    let ip = a.attributes.iter().find_map(|x| match x {
                        AddressAttribute::Address(ip) => Some(*ip),
                        _ => None,
                    })?;
                    Some(Addr { index: a.header.index, ip, prefix: a.header.prefix_len })
                }
                _ => None,
            })
            .filter(|a| index.is_none_or(|i| a.index == i))
            .collect())
    }

    // ----- routes -----

    /// Routes of the main table, both families ([`Self::route_entries`]).
    pub fn routes(&mut self) -> Result<Vec<RouteEntry>> {
        let main = u32::from(RouteHeader::RT_TABLE_MAIN);
        Ok(self.route_entries()?.into_iter().filter(|e| e.table == main).collect())
    }
}

/// A GETLINK request (by name, or a dump) that asks the kernel to leave the link
/// statistics out of its answers: nothing here reads them, and they are about a quarter of
/// each answer (two blocks of counters).
fn get_link(name: Option<&str>) -> LinkMessage {
    let mut msg = LinkMessage::default();
    if let Some(name) = name {
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
    }
    msg.attributes.push(LinkAttribute::ExtMask(vec![LinkExtentMask::SkipStats]));
    msg
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// A bridge's link info with its multicast snooping set: made so, or changed.
fn bridge_snooping(on: bool) -> LinkAttribute {
    LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Bridge),
        LinkInfo::Data(InfoData::Bridge(vec![InfoBridge::MulticastSnooping(on)])),
    ])
}

fn parse_link(l: &LinkMessage) -> Link {
    let mut link = Link { index: l.header.index, up: l.header.flags.contains(LinkFlags::Up), ..Default::default() };
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Address(m) if m.len() == 6 => link.mac = mac6(m),
            LinkAttribute::Mtu(m) => link.mtu = Some(*m),
            LinkAttribute::Controller(m) => link.master = Some(*m),
            LinkAttribute::Group(g) => link.group = *g,
            LinkAttribute::Link(p) => link.peer = Some(*p),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    match i {
                        LinkInfo::Kind(k) => link.kind = Some(k.to_string()),
                        LinkInfo::Data(InfoData::Bridge(opts)) => {
                            for o in opts {
                                if let InfoBridge::MulticastSnooping(on) = o {
                                    link.mcast_snooping = Some(*on);
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    link
}

/// Format a MAC address the way CNI results and `ip link` show it.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// A random, locally administered, unicast MAC address.
pub fn random_mac() -> [u8; 6] {
    let mut mac = [0u8; 6];
    crate::util::fill_random(&mut mac);
    mac[0] = (mac[0] & 0xfe) | 0x02;
    mac
}

/// The request that adds an address ([`Netlink::add_address`]): (message, flags, what).
fn address_request(index: u32, ip: IpAddr, prefix: u8) -> (RouteNetlinkMessage, u16, String) {
    let mut msg = AddressMessage::default();
    msg.header.family = family_of(&ip);
    msg.header.prefix_len = prefix;
    msg.header.index = index;
    msg.header.scope = AddressScope::Universe;
    if let IpAddr::V4(v4) = ip {
        msg.attributes.push(AddressAttribute::Local(ip));
        msg.attributes.push(AddressAttribute::Address(ip));
        if prefix < 31 {
            let mask = u32::MAX.checked_shr(prefix as u32).unwrap_or(0);
            let bcast = std::net::Ipv4Addr::from(u32::from(v4) | mask);
            msg.attributes.push(AddressAttribute::Broadcast(bcast));
        }
    } else {
        msg.header.flags = AddressHeaderFlags::Nodad;
        msg.attributes.push(AddressAttribute::Address(ip));
        msg.attributes.push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    let op = format!("add address {ip}/{prefix} to link {index}");
    (RouteNetlinkMessage::NewAddress(msg), NLM_F_CREATE | NLM_F_EXCL, op)
}

// ----- cross-node routes (`crate::net::routes`): VXLAN devices, routes with a protocol,
// neighbours, FDB -----

/// `NUD_PERMANENT`: a neighbour or FDB entry that never expires.
pub const NUD_PERMANENT: u16 = 0x80;
/// `NTF_SELF`: an FDB entry of the device itself (not of a bridge it is a port of).
pub const NTF_SELF: u8 = 0x02;
/// `RTN_UNICAST`.
pub const RTN_UNICAST: u8 = 1;
/// `RTN_BLACKHOLE`.
pub const RTN_BLACKHOLE: u8 = 6;

/// Parameters for creating a VXLAN device.
#[derive(Debug, Clone)]
pub struct VxlanSpec<'a> {
    pub name: &'a str,
    pub vni: u32,
    /// Source address of the encapsulated packets (IPv4 or IPv6).
    pub local: IpAddr,
    /// UDP destination port.
    pub port: u16,
    pub mtu: Option<u32>,
    pub mac: Option<[u8; 6]>,
    /// Source-MAC learning (`nolearning` when false).
    pub learning: bool,
    /// Create the device up.
    pub up: bool,
}

/// A link together with its VXLAN parameters (all `None` when it is not a VXLAN device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanLink {
    pub link: Link,
    pub vni: Option<u32>,
    pub local: Option<IpAddr>,
    pub port: Option<u16>,
    pub learning: Option<bool>,
}

/// A route as the kernel dumps it: the fields needed to recognise and delete it exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteEntry {
    pub v6: bool,
    /// Destination network (`0.0.0.0`/`::` with prefix 0 for a default route).
    pub dst: IpAddr,
    pub prefix: u8,
    pub gateway: Option<IpAddr>,
    pub oif: Option<u32>,
    pub table: u32,
    /// `rtm_protocol`: who installed the route.
    pub protocol: u8,
    /// Metric (`RTA_PRIORITY`); 0 when absent.
    pub priority: u32,
    /// `rtm_type` (1 = unicast).
    pub kind: u8,
    pub onlink: bool,
}

/// A unicast route with a gateway, marked with a protocol number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSpec {
    pub dst: IpAddr,
    pub prefix: u8,
    pub gateway: IpAddr,
    /// Output device; `None` lets the kernel resolve it from the gateway.
    pub oif: Option<u32>,
    /// Trust the gateway to be reachable on `oif` without a covering connected route.
    pub onlink: bool,
    pub protocol: u8,
}

/// An IPv4 ARP / IPv6 ND neighbour entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neighbour {
    pub ifindex: u32,
    pub ip: IpAddr,
    pub mac: Option<[u8; 6]>,
    /// `NUD_*` bits.
    pub state: u16,
}

/// A bridge-family forwarding database entry (for a VXLAN device: MAC -> remote VTEP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FdbEntry {
    pub ifindex: u32,
    pub mac: [u8; 6],
    /// Remote VTEP address (VXLAN entries).
    pub dst: Option<IpAddr>,
    pub state: u16,
    pub flags: u8,
}

fn mac6(bytes: &[u8]) -> Option<[u8; 6]> {
    <[u8; 6]>::try_from(bytes).ok()
}

fn neighbour_ip(a: &NeighbourAddress) -> Option<IpAddr> {
    match a {
        NeighbourAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        NeighbourAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        // Bridge-family entries carry the address undecoded.
        NeighbourAddress::Other(b) => match b.len() {
            4 => Some(IpAddr::V4(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(&b[..]).ok()?))),
            16 => Some(IpAddr::V6(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(&b[..]).ok()?))),
            _ => None,
        },
        _ => None,
    }
}

fn parse_route_entry(r: &RouteMessage) -> Option<RouteEntry> {
    let v6 = match r.header.address_family {
        AddressFamily::Inet => false,
        AddressFamily::Inet6 => true,
        _ => return None,
    };
    let mut e = RouteEntry {
        v6,
        dst: if v6 { IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED) } else { IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED) },
        prefix: r.header.destination_prefix_length,
        gateway: None,
        oif: None,
        table: r.header.table as u32,
        protocol: u8::from(r.header.protocol),
        priority: 0,
        kind: u8::from(r.header.kind),
        onlink: r.header.flags.contains(RouteFlags::Onlink),
    };
    for a in &r.attributes {
        match a {
            RouteAttribute::Destination(d) => {
                if let Some(ip) = route_ip(d) {
                    e.dst = ip;
                }
            }
            RouteAttribute::Gateway(g) => e.gateway = route_ip(g),
            RouteAttribute::Oif(i) => e.oif = Some(*i),
            RouteAttribute::Table(t) => e.table = *t,
            RouteAttribute::Priority(p) => e.priority = *p,
            _ => {}
        }
    }
    Some(e)
}

impl Netlink {
    /// Create a VXLAN device (`ip link add NAME type vxlan id VNI local IP dstport PORT
    /// [nolearning]`). Fails with EEXIST when the name is taken.
    pub fn create_vxlan(&mut self, spec: &VxlanSpec<'_>) -> Result<()> {
        let mut data = vec![InfoVxlan::Id(spec.vni)];
        match spec.local {
            IpAddr::V4(v4) => data.push(InfoVxlan::Local(v4)),
            IpAddr::V6(v6) => data.push(InfoVxlan::Local6(v6)),
        }
        data.push(InfoVxlan::Port(spec.port));
        data.push(InfoVxlan::Learning(spec.learning));
        let mut msg = LinkMessage::default();
        if spec.up {
            msg.header.flags = LinkFlags::Up;
            msg.header.change_mask = LinkFlags::Up;
        }
        msg.attributes.push(LinkAttribute::IfName(spec.name.to_string()));
        if let Some(mac) = spec.mac {
            msg.attributes.push(LinkAttribute::Address(mac.to_vec()));
        }
        if let Some(mtu) = spec.mtu {
            msg.attributes.push(LinkAttribute::Mtu(mtu));
        }
        msg.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Vxlan),
            LinkInfo::Data(InfoData::Vxlan(data)),
        ]));
        self.request(
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("create vxlan {} id {} local {} dstport {}", spec.name, spec.vni, spec.local, spec.port),
        )
    }

    /// Create a WireGuard device, up, with an MTU (`ip link add NAME mtu MTU type
    /// wireguard`). Its key, port and peers are set over generic netlink
    /// ([`super::wireguard`]). Fails with EEXIST when the name is taken.
    pub fn create_wireguard(&mut self, name: &str, mtu: u32) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.flags = LinkFlags::Up;
        msg.header.change_mask = LinkFlags::Up;
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        msg.attributes.push(LinkAttribute::Mtu(mtu));
        msg.attributes.push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Wireguard)]));
        self.request(RouteNetlinkMessage::NewLink(msg), NLM_F_CREATE | NLM_F_EXCL, &format!("create wireguard {name}"))
    }

    /// Look a link up by name, with its VXLAN parameters when it is a VXLAN device.
    pub fn vxlan_by_name(&mut self, name: &str) -> Result<Option<VxlanLink>> {
        let Some(l) = self.link_message(name)? else { return Ok(None) };
        let mut out = VxlanLink { link: parse_link(&l), vni: None, local: None, port: None, learning: None };
        for a in &l.attributes {
            let LinkAttribute::LinkInfo(infos) = a else { continue };
            for i in infos {
                let LinkInfo::Data(InfoData::Vxlan(data)) = i else { continue };
                for d in data {
                    match d {
                        InfoVxlan::Id(v) => out.vni = Some(*v),
                        InfoVxlan::Local(v4) => out.local = Some(IpAddr::V4(*v4)),
                        InfoVxlan::Local6(v6) => out.local = Some(IpAddr::V6(*v6)),
                        InfoVxlan::Port(p) => out.port = Some(*p),
                        InfoVxlan::Learning(b) => out.learning = Some(*b),
                        _ => {}
                    }
                }
            }
        }
        Ok(Some(out))
    }

    /// Set a link's MTU.
    pub fn set_mtu(&mut self, index: u32, mtu: u32) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.attributes.push(LinkAttribute::Mtu(mtu));
        self.request(RouteNetlinkMessage::SetLink(msg), 0, &format!("set mtu {mtu} on link {index}"))
    }

    /// Every route of both families, all tables, with protocol, metric, type and flags, in
    /// one dump (`AF_UNSPEC`: the kernel walks every family's routes for it).
    pub fn route_entries(&mut self) -> Result<Vec<RouteEntry>> {
        let msgs = self.dump(RouteNetlinkMessage::GetRoute(RouteMessage::default()), "dump routes")?;
        Ok(msgs
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewRoute(r) => parse_route_entry(r),
                _ => None,
            })
            .collect())
    }

    /// Add or replace (same destination and metric) a unicast route in the main table.
    pub fn replace_route(&mut self, spec: &RouteSpec) -> Result<()> {
        let mut msg = RouteMessage::default();
        msg.header = RouteHeader {
            address_family: family_of(&spec.dst),
            destination_prefix_length: spec.prefix,
            table: RouteHeader::RT_TABLE_MAIN,
            protocol: RouteProtocol::from(spec.protocol),
            scope: RouteScope::Universe,
            kind: RouteType::Unicast,
            flags: if spec.onlink { RouteFlags::Onlink } else { RouteFlags::empty() },
            ..Default::default()
        };
        msg.attributes.push(RouteAttribute::Destination(RouteAddress::from(spec.dst)));
        msg.attributes.push(RouteAttribute::Gateway(RouteAddress::from(spec.gateway)));
        if let Some(oif) = spec.oif {
            msg.attributes.push(RouteAttribute::Oif(oif));
        }
        let op = format!(
            "replace route {}/{} via {}{}{} proto {}",
            spec.dst,
            spec.prefix,
            spec.gateway,
            spec.oif.map(|i| format!(" dev {i}")).unwrap_or_default(),
            if spec.onlink { " onlink" } else { "" },
            spec.protocol
        );
        self.request(RouteNetlinkMessage::NewRoute(msg), NLM_F_CREATE | NLM_F_REPLACE, &op)
    }

    /// Add or replace a blackhole route in the main table (`ip route replace blackhole
    /// DST/PREFIX proto PROTOCOL`): what matches it is dropped.
    pub fn replace_blackhole(&mut self, dst: IpAddr, prefix: u8, protocol: u8) -> Result<()> {
        let mut msg = RouteMessage::default();
        msg.header = RouteHeader {
            address_family: family_of(&dst),
            destination_prefix_length: prefix,
            table: RouteHeader::RT_TABLE_MAIN,
            protocol: RouteProtocol::from(protocol),
            scope: RouteScope::Universe,
            kind: RouteType::BlackHole,
            ..Default::default()
        };
        msg.attributes.push(RouteAttribute::Destination(RouteAddress::from(dst)));
        let op = format!("replace route blackhole {dst}/{prefix} proto {protocol}");
        self.request(RouteNetlinkMessage::NewRoute(msg), NLM_F_CREATE | NLM_F_REPLACE, &op)
    }

    /// Delete exactly this route (destination, table, protocol, metric, gateway, device):
    /// a route that differs in any of them is left alone.
    pub fn delete_route(&mut self, r: &RouteEntry) -> Result<()> {
        let mut msg = RouteMessage::default();
        msg.header = RouteHeader {
            address_family: if r.v6 { AddressFamily::Inet6 } else { AddressFamily::Inet },
            destination_prefix_length: r.prefix,
            table: if r.table < 256 { r.table as u8 } else { 252 },
            protocol: RouteProtocol::from(r.protocol),
            scope: RouteScope::NoWhere,
            kind: RouteType::Unspec,
            ..Default::default()
        };
        if r.table >= 256 {
            msg.attributes.push(RouteAttribute::Table(r.table));
        }
        if r.prefix > 0 {
            msg.attributes.push(RouteAttribute::Destination(RouteAddress::from(r.dst)));
        }
        if let Some(gw) = r.gateway {
            msg.attributes.push(RouteAttribute::Gateway(RouteAddress::from(gw)));
        }
        if let Some(oif) = r.oif {
            msg.attributes.push(RouteAttribute::Oif(oif));
        }
        if r.priority != 0 {
            msg.attributes.push(RouteAttribute::Priority(r.priority));
        }
        let op = format!(
            "delete route {}/{} via {:?} dev {:?} proto {} metric {}",
            r.dst, r.prefix, r.gateway, r.oif, r.protocol, r.priority
        );
        self.request(RouteNetlinkMessage::DelRoute(msg), 0, &op)
    }

    /// IPv4 (ARP) and IPv6 (ND) neighbour entries of every device.
    pub fn neighbours(&mut self) -> Result<Vec<Neighbour>> {
        let msgs = self.dump(RouteNetlinkMessage::GetNeighbour(NeighbourMessage::default()), "dump neighbours")?;
        Ok(msgs
            .iter()
            .filter_map(|m| {
                let RouteNetlinkMessage::NewNeighbour(n) = m else { return None };
                if !matches!(n.header.family, AddressFamily::Inet | AddressFamily::Inet6) {
                    return None;
                }
                let (mut ip, mut mac) = (None, None);
                for a in &n.attributes {
                    match a {
                        NeighbourAttribute::Destination(d) => ip = neighbour_ip(d).or(ip),
                        NeighbourAttribute::LinkLayerAddress(l) => mac = mac6(l),
                        _ => {}
                    }
                }
                Some(Neighbour { ifindex: n.header.ifindex, ip: ip?, mac, state: u16::from(n.header.state) })
            })
            .collect())
    }

    /// Add or replace a permanent neighbour entry `ip lladdr mac` on `ifindex`.
    pub fn replace_neighbour(&mut self, ifindex: u32, ip: IpAddr, mac: [u8; 6], protocol: Option<u8>) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = family_of(&ip);
        msg.header.ifindex = ifindex;
        msg.header.state = NeighbourState::Permanent;
        msg.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::from(ip)));
        msg.attributes.push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        if let Some(p) = protocol {
            msg.attributes.push(NeighbourAttribute::Protocol(RouteProtocol::from(p)));
        }
        self.request(
            RouteNetlinkMessage::NewNeighbour(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
            &format!("replace neighbour {ip} lladdr {} dev {ifindex}", format_mac(&mac)),
        )
    }

    /// Delete the neighbour entry for `ip` on `ifindex`.
    pub fn delete_neighbour(&mut self, ifindex: u32, ip: IpAddr) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = family_of(&ip);
        msg.header.ifindex = ifindex;
        msg.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::from(ip)));
        self.request(RouteNetlinkMessage::DelNeighbour(msg), 0, &format!("delete neighbour {ip} dev {ifindex}"))
    }

    /// The bridge-family forwarding database of every device (bridges, their ports, VXLAN).
    pub fn fdb_entries(&mut self) -> Result<Vec<FdbEntry>> {
        let mut req = NeighbourMessage::default();
        req.header.family = AddressFamily::Bridge;
        let msgs = self.dump(RouteNetlinkMessage::GetNeighbour(req), "dump fdb")?;
        Ok(msgs
            .iter()
            .filter_map(|m| {
                let RouteNetlinkMessage::NewNeighbour(n) = m else { return None };
                if n.header.family != AddressFamily::Bridge {
                    return None;
                }
                let mut mac = None;
                let mut dst = None;
                for a in &n.attributes {
                    match a {
                        NeighbourAttribute::LinkLayerAddress(l) => mac = mac6(l),
                        NeighbourAttribute::Destination(d) => dst = neighbour_ip(d),
                        _ => {}
                    }
                }
                Some(FdbEntry {
                    ifindex: n.header.ifindex,
                    mac: mac?,
                    dst,
                    state: u16::from(n.header.state),
                    flags: n.header.flags.bits(),
                })
            })
            .collect())
    }

    /// Add or replace the device's own (`self`) permanent FDB entry `mac dst <remote>`;
    /// for a VXLAN device: send frames for `mac` to the VTEP at `dst`.
    pub fn replace_fdb(&mut self, ifindex: u32, mac: [u8; 6], dst: IpAddr) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Bridge;
        msg.header.ifindex = ifindex;
        msg.header.state = NeighbourState::Permanent;
        msg.header.flags = NeighbourFlags::Own;
        msg.attributes.push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        msg.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::from(dst)));
        self.request(
            RouteNetlinkMessage::NewNeighbour(msg),
            NLM_F_CREATE | NLM_F_REPLACE,
            &format!("replace fdb {} dst {dst} dev {ifindex}", format_mac(&mac)),
        )
    }

    /// Delete the device's own FDB entry for `mac` (only the remote `dst` when given).
    pub fn delete_fdb(&mut self, ifindex: u32, mac: [u8; 6], dst: Option<IpAddr>) -> Result<()> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Bridge;
        msg.header.ifindex = ifindex;
        msg.header.flags = NeighbourFlags::Own;
        msg.attributes.push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        if let Some(dst) = dst {
            msg.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::from(dst)));
        }
        self.request(
            RouteNetlinkMessage::DelNeighbour(msg),
            0,
            &format!(
                "delete fdb {}{} dev {ifindex}",
                format_mac(&mac),
                dst.map(|d| format!(" dst {d}")).unwrap_or_default()
            ),
        )
    }
}
