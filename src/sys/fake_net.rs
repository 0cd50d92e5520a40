//! A recording fake of the network kernel seam ([`super::net_kernel`]) for unit tests without
//! root: namespaces, links, addresses and routes in memory, every call logged, and faults
//! injected by operation name. It follows the kernel where the datapath depends on it: a
//! veth's two ends die together, names are unique per namespace (`EEXIST`), an unknown
//! ifindex is `ENODEV`, a default route needs its gateway on a subnet of its (up) interface,
//! a namespace that is gone takes its links with it.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::net_kernel::{Links, NetKernel, PodNetns, Result, Veth};
use super::netlink::{Addr, Link, LinkStep, NetlinkError, RTN_UNICAST, RouteEntry};
use super::netns::NetnsError;

const HOST: u64 = 0;

#[derive(Debug, Default, Clone)]
pub struct FakeNs {
    pub links: Vec<Link>,
    pub addrs: Vec<Addr>,
    pub routes: Vec<RouteEntry>,
    pub cookie: u64,
    pub inode: u64,
}

struct Fault {
    op: String,
    skip: usize,
    errno: i32,
}

#[derive(Default)]
struct State {
    paths: BTreeMap<PathBuf, u64>,
    not_netns: BTreeSet<PathBuf>,
    ns: BTreeMap<u64, FakeNs>,
    next_ns: u64,
    next_index: u32,
    calls: Vec<String>,
    faults: Vec<Fault>,
    sysctls: BTreeMap<String, String>,
}

fn errno(op: &str, e: i32) -> NetlinkError {
    NetlinkError { op: op.to_string(), source: io::Error::from_raw_os_error(e) }
}

impl State {
    /// Record a call; fail it when a fault for `op` is due.
    fn enter(&mut self, ns: u64, op: &str, detail: String) -> Result<()> {
        self.calls.push(if ns == HOST { format!("host {op} {detail}") } else { format!("ns{ns} {op} {detail}") });
        if let Some(i) = self.faults.iter().position(|f| f.op == op) {
            if self.faults[i].skip == 0 {
                let f = self.faults.remove(i);
                return Err(errno(op, f.errno));
            }
            self.faults[i].skip -= 1;
        }
        Ok(())
    }

    /// The namespace at `path` (`None`: the agent's own).
    fn id_of(&self, path: Option<&Path>) -> u64 {
        path.map_or(HOST, |p| self.paths[p])
    }

    fn new_ns(&mut self) -> u64 {
        self.next_ns += 1;
        let id = self.next_ns;
        let lo = Link { index: 1, name: "lo".into(), ..Default::default() };
        self.ns
            .insert(id, FakeNs { links: vec![lo], cookie: 1000 + id, inode: 4_026_000_000 + id, ..Default::default() });
        id
    }

    fn space(&mut self, ns: u64, op: &str) -> Result<&mut FakeNs> {
        self.ns.get_mut(&ns).ok_or_else(|| errno(op, libc::EINVAL))
    }

    fn next_index(&mut self) -> u32 {
        self.next_index = self.next_index.max(1) + 1;
        self.next_index
    }

    /// Remove a link and, for a veth, its peer wherever it lives (with their addresses and
    /// routes).
    fn remove_link(&mut self, ns: u64, index: u32) {
        let Some(space) = self.ns.get_mut(&ns) else { return };
        let Some(pos) = space.links.iter().position(|l| l.index == index) else { return };
        let link = space.links.remove(pos);
        space.addrs.retain(|a| a.index != index);
        space.routes.retain(|r| r.oif != Some(index));
        for l in space.links.iter_mut().filter(|l| l.master == Some(index)) {
            l.master = None;
        }
        if let Some(peer) = link.peer {
            let owner = self
                .ns
                .iter()
                .find(|(_, s)| s.links.iter().any(|l| l.index == peer && l.peer == Some(index)))
                .map(|(id, _)| *id);
            if let Some(owner) = owner {
                self.remove_link(owner, peer);
            }
        }
    }
}

/// The fake kernel. Cheap to clone (shared state).
#[derive(Clone)]
pub struct FakeNet {
    st: Arc<Mutex<State>>,
}

impl Default for FakeNet {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeNet {
    pub fn new() -> Self {
        let mut st = State::default();
        let lo = Link { index: 1, name: "lo".into(), up: true, ..Default::default() };
        st.ns.insert(HOST, FakeNs { links: vec![lo], cookie: 1000, inode: 4_026_000_000, ..Default::default() });
        FakeNet { st: Arc::new(Mutex::new(st)) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new pod namespace reachable at `path`.
    pub fn add_netns(&self, path: &Path) {
        let mut st = self.lock();
        let id = st.new_ns();
        st.paths.insert(path.to_path_buf(), id);
    }

    /// `path` exists but is no network namespace.
    pub fn add_plain_file(&self, path: &Path) {
        self.lock().not_netns.insert(path.to_path_buf());
    }

    /// The namespace at `path` is destroyed (its veth ends die, and their host peers).
    pub fn remove_netns(&self, path: &Path) {
        let mut st = self.lock();
        if let Some(id) = st.paths.remove(path) {
            let indexes: Vec<u32> = st.ns[&id].links.iter().map(|l| l.index).filter(|&i| i != 1).collect();
            for i in indexes {
                st.remove_link(id, i);
            }
            st.ns.remove(&id);
        }
    }

    /// The namespace stays, but `path` no longer names it (as for an agent that does not see
    /// the runtime's mount namespace).
    pub fn remove_netns_path_only(&self, path: &Path) {
        self.lock().paths.remove(path);
    }

    /// `path` now holds another namespace (the old one gone).
    pub fn replace_netns(&self, path: &Path) {
        self.remove_netns(path);
        self.add_netns(path);
    }

    /// Fail the next call of `op` (a [`Links`] or [`NetKernel`] method name, `netns_links`
    /// for [`PodNetns::links`]) with `errno`.
    pub fn fail(&self, op: &str, errno: i32) {
        self.fail_after(op, 0, errno);
    }

    /// Fail the call of `op` after `skip` successful ones.
    pub fn fail_after(&self, op: &str, skip: usize, errno: i32) {
        self.lock().faults.push(Fault { op: op.to_string(), skip, errno });
    }

    /// Calls so far, oldest first (`host <op> <detail>` or `ns<N> <op> <detail>`).
    pub fn calls(&self) -> Vec<String> {
        self.lock().calls.clone()
    }

    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// Links of the agent's namespace.
    pub fn host_links(&self) -> Vec<Link> {
        self.lock().ns[&HOST].links.clone()
    }

    pub fn host_link(&self, name: &str) -> Option<Link> {
        self.host_links().into_iter().find(|l| l.name == name)
    }

    pub fn host_addrs(&self) -> Vec<Addr> {
        self.lock().ns[&HOST].addrs.clone()
    }

    /// The namespace at `path`, as it is now.
    pub fn netns(&self, path: &Path) -> Option<FakeNs> {
        let st = self.lock();
        st.paths.get(path).map(|id| st.ns[id].clone())
    }

    pub fn sysctl(&self, key: &str) -> Option<String> {
        self.lock().sysctls.get(key).cloned()
    }

    /// Change a link by hand (as another actor on the node would).
    pub fn edit_link(&self, path: Option<&Path>, name: &str, f: impl FnOnce(&mut Link)) {
        let mut st = self.lock();
        let id = st.id_of(path);
        let link = st.ns.get_mut(&id).unwrap().links.iter_mut().find(|l| l.name == name).expect("link exists");
        f(link);
    }

    /// Delete a link by hand (with its peer).
    pub fn delete_link(&self, path: Option<&Path>, name: &str) {
        let mut st = self.lock();
        let id = st.id_of(path);
        if let Some(index) = st.ns[&id].links.iter().find(|l| l.name == name).map(|l| l.index) {
            st.remove_link(id, index);
        }
    }

    /// Remove an address or route of a pod interface by hand.
    pub fn edit_netns(&self, path: &Path, f: impl FnOnce(&mut FakeNs)) {
        let mut st = self.lock();
        let id = st.paths[path];
        f(st.ns.get_mut(&id).unwrap());
    }
}

struct FakeLinks {
    st: Arc<Mutex<State>>,
    ns: u64,
}

impl FakeLinks {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn find(space: &FakeNs, index: u32, op: &str) -> Result<usize> {
    space.links.iter().position(|l| l.index == index).ok_or_else(|| errno(op, libc::ENODEV))
}

fn same_subnet(a: IpAddr, b: IpAddr, prefix: u8) -> bool {
    match (a, b) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            let m = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix as u32) };
            u32::from(a) & m == u32::from(b) & m
        }
        (IpAddr::V6(a), IpAddr::V6(b)) => {
            let m = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix as u32) };
            u128::from(a) & m == u128::from(b) & m
        }
        _ => false,
    }
}

impl Links for FakeLinks {
    fn links(&mut self) -> Result<Vec<Link>> {
        let mut st = self.lock();
        st.enter(self.ns, "links", String::new())?;
        Ok(st.space(self.ns, "links")?.links.clone())
    }

    fn link_by_name(&mut self, name: &str) -> Result<Option<Link>> {
        let mut st = self.lock();
        st.enter(self.ns, "link_by_name", name.to_string())?;
        Ok(st.space(self.ns, "link_by_name")?.links.iter().find(|l| l.name == name).cloned())
    }

    fn index_of(&mut self, name: &str) -> Result<Option<u32>> {
        let mut st = self.lock();
        st.enter(self.ns, "index_of", name.to_string())?;
        Ok(st.space(self.ns, "index_of")?.links.iter().find(|l| l.name == name).map(|l| l.index))
    }

    fn create_bridge(&mut self, name: &str) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "create_bridge", name.to_string())?;
        let index = st.next_index();
        let space = st.space(self.ns, "create_bridge")?;
        if space.links.iter().any(|l| l.name == name) {
            return Err(errno("create_bridge", libc::EEXIST));
        }
        let mac = [0x02, 0xbb, 0, 0, (index >> 8) as u8, index as u8];
        space.links.push(Link {
            index,
            name: name.into(),
            mac: Some(mac),
            kind: Some("bridge".into()),
            mcast_snooping: Some(false),
            ..Default::default()
        });
        Ok(())
    }

    fn create_veth(&mut self, v: &Veth<'_>) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "create_veth", format!("{} {} {}", v.host_name, v.peer_name, v.peer.path().display()))?;
        let Some(&peer_ns) = st.paths.get(v.peer.path()) else {
            return Err(errno("create_veth", libc::EINVAL));
        };
        {
            let here = st.space(self.ns, "create_veth")?;
            if here.links.iter().any(|l| l.name == v.host_name) {
                return Err(errno("create_veth", libc::EEXIST));
            }
            if let Some(m) = v.master
                && !here.links.iter().any(|l| l.index == m && l.kind.as_deref() == Some("bridge"))
            {
                return Err(errno("create_veth", libc::ENODEV));
            }
        }
        if st.space(peer_ns, "create_veth")?.links.iter().any(|l| l.name == v.peer_name) {
            return Err(errno("create_veth", libc::EEXIST));
        }
        let (host_index, peer_index) = (st.next_index(), st.next_index());
        let veth = |index, name: &str, mac, up, master, peer| Link {
            index,
            name: name.to_string(),
            mac: Some(mac),
            mtu: Some(v.mtu),
            up,
            master,
            group: 0,
            kind: Some("veth".into()),
            peer: Some(peer),
            mcast_snooping: None,
        };
        let host = veth(host_index, v.host_name, v.host_mac, true, v.master, peer_index);
        let peer = veth(peer_index, v.peer_name, v.peer_mac, false, None, host_index);
        st.space(self.ns, "create_veth")?.links.push(host);
        st.space(peer_ns, "create_veth")?.links.push(peer);
        Ok(())
    }

    fn delete_link(&mut self, index: u32) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "delete_link", index.to_string())?;
        find(st.space(self.ns, "delete_link")?, index, "delete_link")?;
        st.remove_link(self.ns, index);
        Ok(())
    }

    fn delete_group(&mut self, group: u32) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "delete_group", group.to_string())?;
        let members: Vec<u32> =
            st.space(self.ns, "delete_group")?.links.iter().filter(|l| l.group == group).map(|l| l.index).collect();
        for i in members {
            st.remove_link(self.ns, i);
        }
        Ok(())
    }

    fn set_link(
        &mut self,
        index: u32,
        up: Option<bool>,
        master: Option<u32>,
        rename: Option<&str>,
        group: Option<u32>,
    ) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "set_link", format!("{index} up={up:?} master={master:?} name={rename:?} group={group:?}"))?;
        let space = st.space(self.ns, "set_link")?;
        let pos = find(space, index, "set_link")?;
        if let Some(m) = master
            && m != 0
            && !space.links.iter().any(|l| l.index == m)
        {
            return Err(errno("set_link", libc::ENODEV));
        }
        if let Some(n) = rename
            && space.links.iter().any(|l| l.name == n && l.index != index)
        {
            return Err(errno("set_link", libc::EEXIST));
        }
        let l = &mut space.links[pos];
        if let Some(up) = up {
            l.up = up;
        }
        if let Some(m) = master {
            l.master = (m != 0).then_some(m);
        }
        if let Some(n) = rename {
            l.name = n.to_string();
        }
        if let Some(g) = group {
            l.group = g;
        }
        Ok(())
    }

    fn retire_named(&mut self, name: &str, group: u32) -> Result<bool> {
        let mut st = self.lock();
        st.enter(self.ns, "retire_named", format!("{name} group={group}"))?;
        let space = st.space(self.ns, "retire_named")?;
        let Some(l) = space.links.iter_mut().find(|l| l.name == name) else { return Ok(false) };
        l.up = false;
        l.group = group;
        Ok(true)
    }

    fn set_mac(&mut self, index: u32, mac: [u8; 6]) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "set_mac", index.to_string())?;
        let space = st.space(self.ns, "set_mac")?;
        let pos = find(space, index, "set_mac")?;
        space.links[pos].mac = Some(mac);
        Ok(())
    }

    fn set_mcast_snooping(&mut self, index: u32, on: bool) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "set_mcast_snooping", format!("{index} {on}"))?;
        let space = st.space(self.ns, "set_mcast_snooping")?;
        let pos = find(space, index, "set_mcast_snooping")?;
        space.links[pos].mcast_snooping = Some(on);
        Ok(())
    }

    fn addresses(&mut self, index: Option<u32>) -> Result<Vec<Addr>> {
        let mut st = self.lock();
        st.enter(self.ns, "addresses", format!("{index:?}"))?;
        let space = st.space(self.ns, "addresses")?;
        Ok(space.addrs.iter().filter(|a| index.is_none_or(|i| a.index == i)).cloned().collect())
    }

    fn add_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "add_address", format!("{index} {ip}/{prefix}"))?;
        add_address(st.space(self.ns, "add_address")?, index, ip, prefix, "add_address")
    }

    fn delete_address(&mut self, index: u32, ip: IpAddr, prefix: u8) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "delete_address", format!("{index} {ip}/{prefix}"))?;
        st.space(self.ns, "delete_address")?.addrs.retain(|a| !(a.index == index && a.ip == ip && a.prefix == prefix));
        Ok(())
    }

    fn routes(&mut self) -> Result<Vec<RouteEntry>> {
        let mut st = self.lock();
        st.enter(self.ns, "routes", String::new())?;
        Ok(st.space(self.ns, "routes")?.routes.clone())
    }

    fn apply(&mut self, steps: &[LinkStep]) -> Result<()> {
        let mut st = self.lock();
        st.enter(self.ns, "apply", format!("{} steps", steps.len()))?;
        let space = st.space(self.ns, "apply")?;
        for s in steps {
            match *s {
                LinkStep::Up { index } => {
                    let pos = find(space, index, "apply: link up")?;
                    space.links[pos].up = true;
                }
                LinkStep::Address { index, ip, prefix } => add_address(space, index, ip, prefix, "apply: address")?,
                LinkStep::DefaultRoute { gateway, oif } => {
                    let pos = find(space, oif, "apply: route")?;
                    if !space.links[pos].up {
                        return Err(errno("apply: route", libc::ENETDOWN));
                    }
                    if !space.addrs.iter().any(|a| a.index == oif && same_subnet(a.ip, gateway, a.prefix)) {
                        return Err(errno("apply: route", libc::ENETUNREACH));
                    }
                    let v6 = gateway.is_ipv6();
                    if space.routes.iter().any(|x| x.v6 == v6 && x.prefix == 0) {
                        return Err(errno("apply: route", libc::EEXIST));
                    }
                    let dst = if v6 { Ipv6Addr::UNSPECIFIED.into() } else { Ipv4Addr::UNSPECIFIED.into() };
                    space.routes.push(RouteEntry {
                        v6,
                        dst,
                        prefix: 0,
                        gateway: Some(gateway),
                        oif: Some(oif),
                        table: 254,
                        protocol: 3,
                        priority: if v6 { 1024 } else { 0 },
                        kind: RTN_UNICAST,
                        onlink: false,
                    });
                }
            }
        }
        Ok(())
    }

    fn netns_cookie(&self) -> u64 {
        let st = self.lock();
        st.ns.get(&self.ns).map(|s| s.cookie).unwrap_or(0)
    }
}

fn add_address(space: &mut FakeNs, index: u32, ip: IpAddr, prefix: u8, op: &str) -> Result<()> {
    find(space, index, op)?;
    if space.addrs.iter().any(|a| a.index == index && a.ip == ip) {
        return Err(errno(op, libc::EEXIST));
    }
    space.addrs.push(Addr { index, ip, prefix });
    Ok(())
}

struct FakePodNetns {
    st: Arc<Mutex<State>>,
    ns: u64,
    path: PathBuf,
    inode: u64,
}

impl PodNetns for FakePodNetns {
    fn path(&self) -> &Path {
        &self.path
    }
    fn inode(&self) -> io::Result<u64> {
        Ok(self.inode)
    }
    fn links(&self) -> std::result::Result<Box<dyn Links>, NetnsError> {
        let mut st = self.st.lock().unwrap_or_else(|p| p.into_inner());
        st.enter(self.ns, "netns_links", self.path.display().to_string()).map_err(NetnsError::Netlink)?;
        if !st.ns.contains_key(&self.ns) {
            return Err(NetnsError::Setns {
                path: self.path.clone(),
                source: io::Error::from_raw_os_error(libc::EINVAL),
            });
        }
        Ok(Box::new(FakeLinks { st: self.st.clone(), ns: self.ns }))
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

impl NetKernel for FakeNet {
    fn host(&self) -> Result<Box<dyn Links>> {
        self.lock().enter(HOST, "host", String::new())?;
        Ok(Box::new(FakeLinks { st: self.st.clone(), ns: HOST }))
    }

    fn open_netns(&self, path: &Path) -> std::result::Result<Box<dyn PodNetns>, NetnsError> {
        let mut st = self.lock();
        st.enter(HOST, "open_netns", path.display().to_string())
            .map_err(|e| NetnsError::Io { path: path.into(), source: e.source })?;
        if st.not_netns.contains(path) {
            return Err(NetnsError::NotNetns(path.to_path_buf()));
        }
        let Some(&id) = st.paths.get(path) else {
            return Err(NetnsError::NotFound(path.to_path_buf()));
        };
        let inode = st.ns[&id].inode;
        Ok(Box::new(FakePodNetns { st: self.st.clone(), ns: id, path: path.to_path_buf(), inode }))
    }

    fn write_sysctl(&self, key: &str, value: &str) -> io::Result<()> {
        let mut st = self.lock();
        st.enter(HOST, "write_sysctl", format!("{key}={value}")).map_err(|e| e.source)?;
        st.sysctls.insert(key.to_string(), value.to_string());
        Ok(())
    }
}
