//! A small, synchronous rtnetlink socket wrapper.
//!
//! Each [`Netlink`] is bound to the network namespace it was opened in (a netlink socket
//! belongs to the namespace of the thread that created it). It is driven from ordinary
//! blocking code; the agent runs it on blocking threads, never on async workers.

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, AddressScope,
};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
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

fn err(op: impl Into<String>, source: io::Error) -> NetlinkError {
    NetlinkError { op: op.into(), source }
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
}

/// An address assigned to an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addr {
    pub index: u32,
    pub ip: IpAddr,
    pub prefix: u8,
}

/// A route in the main table (only the parts we program and verify).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: Option<(IpAddr, u8)>,
    pub gateway: Option<IpAddr>,
    pub oif: Option<u32>,
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

    pub fn raw_fd(&self) -> i32 {
        self.socket.as_raw_fd()
    }

    /// The cookie of the network namespace this socket lives in: unique for the life of
    /// the kernel and never reused (unlike a namespace's inode number). 0 if unsupported.
    pub fn netns_cookie(&self) -> u64 {
        const SO_NETNS_COOKIE: libc::c_int = 71;
        let mut cookie: u64 = 0;
        let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
        // SAFETY: getsockopt into a properly sized u64 on a socket we own.
        let rc = unsafe {
            libc::getsockopt(
                self.socket.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_NETNS_COOKIE,
                (&mut cookie as *mut u64).cast(),
                &mut len,
            )
        };
        if rc == 0 { cookie } else { 0 }
    }

    fn send(&mut self, msg: RouteNetlinkMessage, flags: u16, op: &str) -> Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        packet.finalize();
        let mut out = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut out);
        self.socket.send(&out, 0).map_err(|e| err(op, e))?;
        Ok(self.seq)
    }

    /// Receive messages for `seq` until an ACK/NACK or DONE; collects inner messages.
    fn recv_until_done(&mut self, seq: u32, op: &str) -> Result<Vec<RouteNetlinkMessage>> {
        let mut out = Vec::new();
        loop {
            let n = loop {
                match self.socket.recv(&mut &mut self.buf[..], 0) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(err(op, e)),
                }
            };
            let mut offset = 0;
            while offset < n {
                let bytes = &self.buf[offset..n];
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(bytes).map_err(|e| {
                    err(op, io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
                })?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(err(op, io::Error::new(io::ErrorKind::InvalidData, "zero-length message")));
                }
                offset += (len + 3) & !3;
                if msg.header.sequence_number != seq {
                    continue;
                }
                match msg.payload {
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(out),
                            Some(code) => Err(err(op, io::Error::from_raw_os_error(-code.get()))),
                        };
                    }
                    NetlinkPayload::Done(_) => return Ok(out),
                    NetlinkPayload::InnerMessage(inner) => out.push(inner),
                    _ => {}
                }
            }
        }
    }

    /// Send several requests in one write and collect every ack; the first failure (in
    /// request order) is returned. Saves a round trip per request on hot paths.
    pub fn batch(&mut self, reqs: Vec<Req>) -> Result<()> {
        let mut out = Vec::new();
        let mut seqs = Vec::with_capacity(reqs.len());
        for r in &reqs {
            self.seq = self.seq.wrapping_add(1);
            let mut header = NetlinkHeader::default();
            header.flags = NLM_F_REQUEST | NLM_F_ACK | r.flags;
            header.sequence_number = self.seq;
            let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(r.msg.clone()));
            packet.finalize();
            let start = out.len();
            out.resize(start + packet.buffer_len(), 0);
            packet.serialize(&mut out[start..]);
            seqs.push(self.seq);
        }
        if reqs.is_empty() {
            return Ok(());
        }
        self.socket.send(&out, 0).map_err(|e| err(&reqs[0].op, e))?;
        let mut first_err: Option<(usize, NetlinkError)> = None;
        let mut acked = 0;
        while acked < seqs.len() {
            let n = loop {
                match self.socket.recv(&mut &mut self.buf[..], 0) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(err(&reqs[0].op, e)),
                }
            };
            let mut offset = 0;
            while offset < n {
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[offset..n]).map_err(|e| {
                    err(&reqs[0].op, io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
                })?;
                let len = msg.header.length as usize;
                if len == 0 {
                    return Err(err(&reqs[0].op, io::Error::new(io::ErrorKind::InvalidData, "zero-length message")));
                }
                offset += (len + 3) & !3;
                let Some(i) = seqs.iter().position(|s| *s == msg.header.sequence_number) else { continue };
                if let NetlinkPayload::Error(e) = msg.payload {
                    acked += 1;
                    if let Some(code) = e.code {
                        let failure = err(&reqs[i].op, io::Error::from_raw_os_error(-code.get()));
                        if first_err.as_ref().is_none_or(|(j, _)| i < *j) {
                            first_err = Some((i, failure));
                        }
                    }
                }
            }
        }
        match first_err {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16, op: &str) -> Result<()> {
        let seq = self.send(msg, flags | NLM_F_ACK, op)?;
        self.recv_until_done(seq, op).map(|_| ())
    }

    fn dump(&mut self, msg: RouteNetlinkMessage, op: &str) -> Result<Vec<RouteNetlinkMessage>> {
        let seq = self.send(msg, NLM_F_DUMP, op)?;
        self.recv_until_done(seq, op)
    }

    // ----- links -----

    pub fn links(&mut self) -> Result<Vec<Link>> {
        let msgs = self.dump(RouteNetlinkMessage::GetLink(LinkMessage::default()), "dump links")?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(parse_link(&l)),
                _ => None,
            })
            .collect())
    }

    pub fn link_by_name(&mut self, name: &str) -> Result<Option<Link>> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        let seq = self.send(RouteNetlinkMessage::GetLink(msg), NLM_F_ACK, "get link")?;
        match self.recv_until_done(seq, &format!("get link {name}")) {
            Ok(msgs) => Ok(msgs.iter().find_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(parse_link(l)),
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

        let mut msg = LinkMessage::default();
        msg.header.flags = LinkFlags::Up;
        msg.header.change_mask = LinkFlags::Up;
        msg.attributes.push(LinkAttribute::IfName(spec.host_name.to_string()));
        msg.attributes.push(LinkAttribute::Address(spec.host_mac.to_vec()));
        msg.attributes.push(LinkAttribute::Mtu(spec.mtu));
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
        )
    }

    pub fn create_bridge(&mut self, name: &str, mtu: Option<u32>) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.flags = LinkFlags::Up;
        msg.header.change_mask = LinkFlags::Up;
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        if let Some(mtu) = mtu {
            msg.attributes.push(LinkAttribute::Mtu(mtu));
        }
        msg.attributes.push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Bridge)]));
        self.request(
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_CREATE | NLM_F_EXCL,
            &format!("create bridge {name}"),
        )
    }

    /// Change a link: up/down, master (Some(0) detaches), new name.
    pub fn set_link(
        &mut self,
        index: u32,
        up: Option<bool>,
        master: Option<u32>,
        rename: Option<&str>,
    ) -> Result<()> {
        self.set_link_group(index, up, master, rename, None)
    }

    /// [`Netlink::set_link`] that can also move the link into a link group.
    pub fn set_link_group(
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
        self.request(RouteNetlinkMessage::SetLink(msg), 0, &format!("set link {index}"))
    }

    /// Move a link into a link group (used to batch deletions).
    pub fn set_group(&mut self, index: u32, group: u32) -> Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.attributes.push(LinkAttribute::Group(group));
        self.request(RouteNetlinkMessage::SetLink(msg), 0, &format!("set group of link {index}"))
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
        let r = Req::add_address(index, ip, prefix);
        self.request(r.msg, r.flags, &r.op)
    }

    pub fn addresses(&mut self, index: Option<u32>) -> Result<Vec<Addr>> {
        let msgs =
            self.dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()), "dump addresses")?;
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

    /// Add a route in the main table: `dst` (None = default) via `gateway` out of `oif`.
    pub fn add_route(&mut self, dst: Option<(IpAddr, u8)>, gateway: Option<IpAddr>, oif: u32, v6: bool) -> Result<()> {
        let r = Req::add_route(dst, gateway, oif, v6);
        self.request(r.msg, r.flags, &r.op)
    }

    /// Routes of the main table for one family.
    pub fn routes(&mut self, v6: bool) -> Result<Vec<Route>> {
        let mut req = RouteMessage::default();
        req.header.address_family = if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet };
        let msgs = self.dump(RouteNetlinkMessage::GetRoute(req), "dump routes")?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewRoute(r) if r.header.table == RouteHeader::RT_TABLE_MAIN => {
                    let mut route = Route { dst: None, gateway: None, oif: None };
                    for a in &r.attributes {
                        match a {
                            RouteAttribute::Destination(d) => {
                                route.dst = route_ip(d).map(|ip| (ip, r.header.destination_prefix_length))
                            }
                            RouteAttribute::Gateway(g) => route.gateway = route_ip(g),
                            RouteAttribute::Oif(i) => route.oif = Some(*i),
                            _ => {}
                        }
                    }
                    Some(route)
                }
                _ => None,
            })
            .collect())
    }
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn parse_link(l: &LinkMessage) -> Link {
    let mut link = Link {
        index: l.header.index,
        up: l.header.flags.contains(LinkFlags::Up),
        ..Default::default()
    };
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Address(m) if m.len() == 6 => {
                let mut mac = [0u8; 6];
                mac.copy_from_slice(m);
                link.mac = Some(mac);
            }
            LinkAttribute::Mtu(m) => link.mtu = Some(*m),
            LinkAttribute::Controller(m) => link.master = Some(*m),
            LinkAttribute::Group(g) => link.group = *g,
            LinkAttribute::Link(p) => link.peer = Some(*p),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        link.kind = Some(k.to_string());
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

/// One request, built ahead of sending (for [`Netlink::batch`]).
#[derive(Debug, Clone)]
pub struct Req {
    msg: RouteNetlinkMessage,
    flags: u16,
    op: String,
}

impl Req {
    /// Set a link up or down.
    pub fn link_up(index: u32, up: bool) -> Self {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.header.flags = if up { LinkFlags::Up } else { LinkFlags::empty() };
        msg.header.change_mask = LinkFlags::Up;
        Req { msg: RouteNetlinkMessage::SetLink(msg), flags: 0, op: format!("set link {index} up={up}") }
    }

    /// Add an address. IPv6 addresses skip duplicate address detection (they come from
    /// the node's own IPAM, which already guarantees uniqueness) so they work at once.
    pub fn add_address(index: u32, ip: IpAddr, prefix: u8) -> Self {
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
        Req {
            msg: RouteNetlinkMessage::NewAddress(msg),
            flags: NLM_F_CREATE | NLM_F_EXCL,
            op: format!("add address {ip}/{prefix} to link {index}"),
        }
    }

    /// Add a route in the main table: `dst` (None = default) via `gateway` out of `oif`.
    pub fn add_route(dst: Option<(IpAddr, u8)>, gateway: Option<IpAddr>, oif: u32, v6: bool) -> Self {
        let mut msg = RouteMessage::default();
        msg.header = RouteHeader {
            address_family: if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet },
            destination_prefix_length: dst.map(|d| d.1).unwrap_or(0),
            table: RouteHeader::RT_TABLE_MAIN,
            protocol: RouteProtocol::Boot,
            scope: if gateway.is_some() { RouteScope::Universe } else { RouteScope::Link },
            kind: RouteType::Unicast,
            ..Default::default()
        };
        if let Some((ip, _)) = dst {
            msg.attributes.push(RouteAttribute::Destination(RouteAddress::from(ip)));
        }
        if let Some(gw) = gateway {
            msg.attributes.push(RouteAttribute::Gateway(RouteAddress::from(gw)));
        }
        msg.attributes.push(RouteAttribute::Oif(oif));
        Req {
            msg: RouteNetlinkMessage::NewRoute(msg),
            flags: NLM_F_CREATE | NLM_F_EXCL,
            op: format!("add route {dst:?} via {gateway:?} dev {oif}"),
        }
    }
}
