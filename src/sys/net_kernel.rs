//! The kernel seam of the pod network: what the datapath asks of the kernel, as small traits,
//! with the real implementation over rtnetlink and network namespace handles.
//! `sys::fake_net` records the same calls against an in-memory model, so the datapath's rollback
//! and idempotency can be tested without root.
//!
//! - [`NetKernel`]: the node's side: a link socket in the agent's own namespace, opening a
//!   pod's namespace by path, sysctls of the agent's namespace.
//! - [`Links`]: one rtnetlink socket, bound to one namespace for its whole life.
//! - [`PodNetns`]: an open pod namespace (its identity, and a link socket inside it).

use std::io;
use std::net::IpAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use super::netlink::{Addr, Link, LinkStep, Netlink, NetlinkError, RouteEntry, VethSpec};
use super::netns::{Netns, NetnsError};

pub type Result<T> = std::result::Result<T, NetlinkError>;

/// A veth pair to create: the host end in the namespace of the [`Links`] asked, the peer
/// moved into `peer`.
pub struct Veth<'a> {
    pub host_name: &'a str,
    pub host_mac: [u8; 6],
    pub peer_name: &'a str,
    pub peer_mac: [u8; 6],
    pub peer: &'a dyn PodNetns,
    pub mtu: u32,
    pub master: Option<u32>,
}

/// One rtnetlink socket, bound to one network namespace.
pub trait Links: Send {
    fn links(&mut self) -> Result<Vec<Link>>;
    fn link_by_name(&mut self, name: &str) -> Result<Option<Link>>;
    /// Only the index of the link named `name`.
    fn index_of(&mut self, name: &str) -> Result<Option<u32>>;
    /// A bridge, administratively down.
    fn create_bridge(&mut self, name: &str) -> Result<()>;
    /// The host end is created up (enslaved to `master`), the peer down in its namespace.
    fn create_veth(&mut self, veth: &Veth<'_>) -> Result<()>;
    fn delete_link(&mut self, index: u32) -> Result<()>;
    /// Every link of `group` in one request; no member is not an error.
    fn delete_group(&mut self, group: u32) -> Result<()>;
    /// Up/down, master (`Some(0)` detaches), a new name and a link group, in one request.
    fn set_link(
        &mut self,
        index: u32,
        up: Option<bool>,
        master: Option<u32>,
        rename: Option<&str>,
        group: Option<u32>,
    ) -> Result<()>;
    /// The link named `name` down and into `group`, selected by name in the same
    /// request; `Ok(false)` when there is no such link.
    fn retire_named(&mut self, name: &str, group: u32) -> Result<bool>;
    fn set_mac(&mut self, index: u32, mac: [u8; 6]) -> Result<()>;
    fn set_mcast_snooping(&mut self, index: u32, on: bool) -> Result<()>;
    fn addresses(&mut self, index: Option<u32>) -> Result<Vec<Addr>>;
    fn add_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()>;
    /// Remove an address; one already gone is not an error.
    fn delete_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()>;
    /// Main-table routes of both families.
    fn routes(&mut self) -> Result<Vec<RouteEntry>>;
    /// Apply `steps` in order, stopping at the first failure.
    fn apply(&mut self, steps: &[LinkStep]) -> Result<()>;
    /// The namespace's cookie (never reused, unlike its inode); 0 when unknown.
    fn netns_cookie(&self) -> u64;
}

/// An open pod network namespace.
pub trait PodNetns: Send + Sync {
    fn path(&self) -> &Path;
    /// Inode number of the namespace (identifies it while it lives; may be reused).
    fn inode(&self) -> io::Result<u64>;
    /// A link socket inside the namespace (the calling thread enters it for the `socket`
    /// call only: [`super::netns::netlink_in`]).
    fn links(&self) -> std::result::Result<Box<dyn Links>, NetnsError>;
    /// The namespace descriptor, for moving a link into it (`None` for fakes).
    fn fd(&self) -> Option<BorrowedFd<'_>>;
}

/// What the pod network asks of the node's kernel.
pub trait NetKernel: Send + Sync {
    /// A link socket in the agent's own network namespace.
    fn host(&self) -> Result<Box<dyn Links>>;
    /// Open a pod namespace by path (`NotFound`, `NotNetns` when it is none).
    fn open_netns(&self, path: &Path) -> std::result::Result<Box<dyn PodNetns>, NetnsError>;
    /// Write a sysctl of the agent's own network namespace.
    fn write_sysctl(&self, key: &str, value: &str) -> io::Result<()>;
}

/// The real kernel.
#[derive(Debug, Default, Clone, Copy)]
pub struct Kernel;

impl NetKernel for Kernel {
    fn host(&self) -> Result<Box<dyn Links>> {
        Ok(Box::new(Netlink::open()?))
    }
    fn open_netns(&self, path: &Path) -> std::result::Result<Box<dyn PodNetns>, NetnsError> {
        Ok(Box::new(Netns::open(path)?))
    }
    fn write_sysctl(&self, key: &str, value: &str) -> io::Result<()> {
        super::netns::write_sysctl(key, value)
    }
}

impl PodNetns for Netns {
    fn path(&self) -> &Path {
        Netns::path(self)
    }
    fn inode(&self) -> io::Result<u64> {
        Netns::inode(self)
    }
    fn links(&self) -> std::result::Result<Box<dyn Links>, NetnsError> {
        Ok(Box::new(self.netlink()?))
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.as_fd())
    }
}

impl Links for Netlink {
    fn links(&mut self) -> Result<Vec<Link>> {
        Netlink::links(self)
    }
    fn link_by_name(&mut self, name: &str) -> Result<Option<Link>> {
        Netlink::link_by_name(self, name)
    }
    fn index_of(&mut self, name: &str) -> Result<Option<u32>> {
        Netlink::index_of(self, name)
    }
    fn create_bridge(&mut self, name: &str) -> Result<()> {
        Netlink::create_bridge(self, name, None)
    }
    fn create_veth(&mut self, v: &Veth<'_>) -> Result<()> {
        let Some(peer_netns) = v.peer.fd() else {
            return Err(NetlinkError {
                op: format!("create veth {}: {} has no namespace descriptor", v.host_name, v.peer.path().display()),
                source: io::Error::from_raw_os_error(libc::EBADF),
            });
        };
        Netlink::create_veth(
            self,
            &VethSpec {
                host_name: v.host_name,
                host_mac: v.host_mac,
                peer_name: v.peer_name,
                peer_mac: v.peer_mac,
                peer_netns,
                mtu: v.mtu,
                master: v.master,
            },
        )
    }
    fn delete_link(&mut self, index: u32) -> Result<()> {
        Netlink::delete_link(self, index)
    }
    fn delete_group(&mut self, group: u32) -> Result<()> {
        Netlink::delete_group(self, group)
    }
    fn set_link(
        &mut self,
        index: u32,
        up: Option<bool>,
        master: Option<u32>,
        rename: Option<&str>,
        group: Option<u32>,
    ) -> Result<()> {
        Netlink::set_link(self, index, up, master, rename, group)
    }
    fn retire_named(&mut self, name: &str, group: u32) -> Result<bool> {
        Netlink::retire_named(self, name, group)
    }
    fn set_mac(&mut self, index: u32, mac: [u8; 6]) -> Result<()> {
        Netlink::set_mac(self, index, mac)
    }
    fn set_mcast_snooping(&mut self, index: u32, on: bool) -> Result<()> {
        Netlink::set_mcast_snooping(self, index, on)
    }
    fn addresses(&mut self, index: Option<u32>) -> Result<Vec<Addr>> {
        Netlink::addresses(self, index)
    }
    fn add_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()> {
        Netlink::add_address(self, index, ip, prefix)
    }
    fn delete_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()> {
        Netlink::delete_address(self, index, ip, prefix)
    }
    fn routes(&mut self) -> Result<Vec<RouteEntry>> {
        Netlink::routes(self)
    }
    fn apply(&mut self, steps: &[LinkStep]) -> Result<()> {
        Netlink::apply(self, steps)
    }
    fn netns_cookie(&self) -> u64 {
        Netlink::netns_cookie(self)
    }
}
