//! Node-local IPAM: hands out pod addresses from the node's blocks.
//!
//! Blocks are plugged in with [`Ipam::assign_block`] (from the static configuration, or as the
//! controller hands them out). Each attachment's lease is one small JSON file in the lease
//! directory. The in-memory index is authoritative while the agent runs (the agent holds an
//! exclusive lock on its state dir) and is rebuilt from the files on start. A lease is first
//! written as `adding` and flipped to `ready` only when the datapath work is complete, so a
//! crash mid-ADD is rolled back on the next start instead of leaking.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ipnetwork::IpNetwork;
use serde::{Deserialize, Serialize};

use crate::util::Family;

#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    /// No block of the family (`None`: no block at all).
    #[error("no {}pod address block is assigned to this node", .0.map(|f| format!("{f} ")).unwrap_or_default())]
    NoBlock(Option<Family>),
    #[error("the {family} pod address block(s) {blocks} are full")]
    Exhausted { family: Family, blocks: String },
    #[error("invalid block {0}: {1}")]
    BadBlock(IpNetwork, &'static str),
    #[error("lease store {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Who holds a lease: one interface of one container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Owner {
    #[serde(rename = "containerId")]
    pub container_id: String,
    pub ifname: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseState {
    Adding,
    Ready,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    #[serde(flatten)]
    pub owner: Owner,
    pub state: LeaseState,
    /// Netns path as given by the runtime, its inode (a quick filter: inode numbers can be
    /// reused after a namespace dies) and its cookie (never reused; set at commit).
    pub netns: String,
    #[serde(rename = "netnsInode")]
    pub netns_inode: u64,
    #[serde(rename = "netnsCookie", default)]
    pub netns_cookie: u64,
    #[serde(rename = "hostIf")]
    pub host_if: String,
    /// The host veth's ifindex (set at commit; 0 in leases from before it was recorded).
    /// Interface indexes of a namespace are not reused while it lives, so a link that has
    /// the name but another index is not this attachment's.
    #[serde(rename = "hostIfindex", default, skip_serializing_if = "is_zero")]
    pub host_ifindex: u32,
    /// Addresses with the block's prefix length.
    pub ips: Vec<IpNetwork>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pod: String,
}

/// An address block with its gateway (the first host address, held by the node bridge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub net: IpNetwork,
}

impl Block {
    pub fn new(net: IpNetwork) -> Result<Self, IpamError> {
        let net = IpNetwork::new(net.network(), net.prefix()).map_err(|_| IpamError::BadBlock(net, "bad prefix"))?;
        let max = if net.is_ipv4() { 30 } else { 126 };
        if net.prefix() > max {
            return Err(IpamError::BadBlock(net, "too small (need at least 4 addresses)"));
        }
        Ok(Block { net })
    }
    pub fn gateway(&self) -> IpAddr {
        self.nth(1)
    }
    /// Gateway with prefix, as assigned to the bridge.
    pub fn gateway_net(&self) -> IpNetwork {
        IpNetwork::new(self.gateway(), self.net.prefix()).expect("prefix from a valid network")
    }
    fn nth(&self, n: u128) -> IpAddr {
        match self.net.network() {
            IpAddr::V4(a) => IpAddr::V4(std::net::Ipv4Addr::from((u32::from(a) as u128 + n) as u32)),
            IpAddr::V6(a) => IpAddr::V6((u128::from(a) + n).into()),
        }
    }
    /// Offsets usable for pods: skip network, gateway and (IPv4) broadcast.
    fn host_range(&self) -> (u128, u128) {
        let bits = if self.net.is_ipv4() { 32 } else { 128 };
        let size = 1u128.checked_shl(bits - self.net.prefix() as u32).unwrap_or(u128::MAX);
        let last = if self.net.is_ipv4() { size - 2 } else { size - 1 };
        (2, last)
    }
    pub fn capacity(&self) -> u128 {
        let (first, last) = self.host_range();
        last - first + 1
    }
    pub fn family(&self) -> Family {
        Family::of(&self.net)
    }
}

/// A reserved lease whose datapath work is under way; [`Ipam::commit`] completes it.
#[derive(Debug)]
pub struct Reservation {
    pub lease: Lease,
    /// The lease's file, open: the commit rewrites it in place.
    file: fs::File,
}

struct Inner {
    blocks: Vec<Block>,
    used: HashSet<IpAddr>,
    leases: HashMap<Owner, Lease>,
    /// Next offset to try, per block (round robin delays address reuse).
    cursor: HashMap<IpNetwork, u128>,
}

pub struct Ipam {
    dir: PathBuf,
    inner: Mutex<Inner>,
}

fn lease_file(dir: &Path, owner: &Owner) -> PathBuf {
    // Container ids cannot contain ':' and interface names cannot either: unambiguous.
    dir.join(format!("{}:{}.json", owner.container_id, owner.ifname))
}

impl Ipam {
    /// Open the lease directory and load every lease in it. Unreadable or half-written
    /// files (a crash between create and rename leaves only a `.tmp`) are removed.
    pub fn load(dir: &Path) -> Result<(Self, Vec<String>), IpamError> {
        let io_err = |source| IpamError::Io { path: dir.to_path_buf(), source };
        fs::create_dir_all(dir).map_err(io_err)?;
        let mut leases = HashMap::new();
        let mut used = HashSet::new();
        let mut problems = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err)? {
            let entry = entry.map_err(io_err)?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.ends_with(".json") {
                problems.push(format!("removed partial lease file {name}"));
                let _ = fs::remove_file(&path);
                continue;
            }
            let lease: Option<Lease> = fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok());
            match lease {
                Some(l) if l.ips.iter().all(|ip| !used.contains(&ip.ip())) => {
                    used.extend(l.ips.iter().map(|ip| ip.ip()));
                    leases.insert(l.owner.clone(), l);
                }
                Some(l) => {
                    problems.push(format!("lease {name} claims an address already leased: {:?}", l.ips));
                    let _ = fs::remove_file(&path);
                }
                None => {
                    problems.push(format!("removed unreadable lease file {name}"));
                    let _ = fs::remove_file(&path);
                }
            }
        }
        let ipam = Ipam {
            dir: dir.to_path_buf(),
            inner: Mutex::new(Inner { blocks: Vec::new(), used, leases, cursor: HashMap::new() }),
        };
        Ok((ipam, problems))
    }

    /// Plug in a block (from configuration or from the controller).
    pub fn assign_block(&self, net: IpNetwork) -> Result<Block, IpamError> {
        let block = Block::new(net)?;
        let mut inner = self.inner.lock().unwrap();
        if !inner.blocks.contains(&block) {
            inner.blocks.push(block);
        }
        Ok(block)
    }

    /// Stop allocating from every block not in `keep` (leases in them stay until released).
    /// Returns the blocks withdrawn.
    pub fn retain_blocks(&self, keep: &[IpNetwork]) -> Vec<Block> {
        let mut inner = self.inner.lock().unwrap();
        let (kept, gone): (Vec<Block>, Vec<Block>) = inner
            .blocks
            .iter()
            .partition(|b| keep.iter().any(|k| k.network() == b.net.network() && k.prefix() == b.net.prefix()));
        inner.blocks = kept;
        gone
    }

    pub fn blocks(&self) -> Vec<Block> {
        self.inner.lock().unwrap().blocks.clone()
    }

    /// The block an address belongs to.
    pub fn block_of(&self, ip: IpAddr) -> Option<Block> {
        self.inner.lock().unwrap().blocks.iter().find(|b| b.net.contains(ip)).copied()
    }

    pub fn get(&self, owner: &Owner) -> Option<Lease> {
        self.inner.lock().unwrap().leases.get(owner).cloned()
    }

    pub fn leases(&self) -> Vec<Lease> {
        let mut v: Vec<Lease> = self.inner.lock().unwrap().leases.values().cloned().collect();
        v.sort_by(|a, b| a.owner.cmp(&b.owner));
        v
    }

    /// Every block with the number of its addresses that are leased or reserved (metrics).
    pub fn block_usage(&self) -> Vec<(Block, u128)> {
        let inner = self.inner.lock().unwrap();
        inner.blocks.iter().map(|b| (*b, inner.used.iter().filter(|ip| b.net.contains(**ip)).count() as u128)).collect()
    }

    /// How many leases (attachments) exist, `adding` ones included.
    pub fn lease_count(&self) -> usize {
        self.inner.lock().unwrap().leases.len()
    }

    /// Families that still have a free address (for STATUS).
    pub fn free_by_family(&self) -> Vec<(Family, u128)> {
        let mut out: Vec<(Family, u128)> = Vec::new();
        for (b, used) in self.block_usage() {
            let free = b.capacity().saturating_sub(used);
            match out.iter_mut().find(|(f, _)| *f == b.family()) {
                Some((_, n)) => *n = n.saturating_add(free),
                None => out.push((b.family(), free)),
            }
        }
        out
    }

    fn pick(inner: &mut Inner, family: Family) -> Result<IpNetwork, IpamError> {
        let blocks: Vec<Block> = inner.blocks.iter().filter(|b| b.family() == family).copied().collect();
        if blocks.is_empty() {
            return Err(IpamError::NoBlock(Some(family)));
        }
        for b in &blocks {
            let (first, last) = b.host_range();
            let used_here = inner.used.iter().filter(|ip| b.net.contains(**ip)).count() as u128;
            if used_here >= b.capacity() {
                continue;
            }
            let start = inner.cursor.get(&b.net).copied().filter(|c| *c >= first && *c <= last).unwrap_or(first);
            let mut off = start;
            // At most used_here + 1 probes find a free address.
            for _ in 0..=used_here {
                let ip = b.nth(off);
                off = if off >= last { first } else { off + 1 };
                if !inner.used.contains(&ip) {
                    inner.cursor.insert(b.net, off);
                    inner.used.insert(ip);
                    return Ok(IpNetwork::new(ip, b.net.prefix()).expect("valid prefix"));
                }
            }
        }
        Err(IpamError::Exhausted {
            family,
            blocks: blocks.iter().map(|b| b.net.to_string()).collect::<Vec<_>>().join(", "),
        })
    }

    /// Reserve one address per family that has a block, and persist the lease as `adding`.
    pub fn reserve(&self, mut lease: Lease) -> Result<Reservation, IpamError> {
        {
            let mut inner = self.inner.lock().unwrap();
            lease.ips = Self::take_addresses(&mut inner)?;
            lease.state = LeaseState::Adding;
            inner.leases.insert(lease.owner.clone(), lease.clone());
        }
        let path = lease_file(&self.dir, &lease.owner);
        // Not synced: a lease describes a veth in a pod namespace, and a reboot takes both
        // away (the boot id frees every lease at start). An agent crash keeps the page cache.
        let written = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .and_then(|mut f| f.write_all(&serde_json::to_vec(&lease).expect("lease serializes")).map(|_| f));
        match written {
            Ok(file) => Ok(Reservation { lease, file }),
            Err(source) => {
                self.forget(&lease.owner);
                let _ = fs::remove_file(&path);
                Err(IpamError::Io { path, source })
            }
        }
    }

    /// One free address per family that has a block, marked used (all or none).
    fn take_addresses(inner: &mut Inner) -> Result<Vec<IpNetwork>, IpamError> {
        let mut families: Vec<Family> = inner.blocks.iter().map(|b| b.family()).collect();
        families.sort();
        families.dedup();
        if families.is_empty() {
            return Err(IpamError::NoBlock(None));
        }
        let mut ips = Vec::new();
        for family in families {
            match Self::pick(inner, family) {
                Ok(ip) => ips.push(ip),
                Err(e) => {
                    for ip in &ips {
                        inner.used.remove(&ip.ip());
                    }
                    return Err(e);
                }
            }
        }
        Ok(ips)
    }

    /// Mark a lease complete (its datapath work is done in the namespace `netns_cookie`).
    /// The file is rewritten in place: a crash before it leaves `adding` (rolled back at
    /// start), one after it leaves `ready`.
    pub fn commit(&self, reservation: Reservation, netns_cookie: u64, host_ifindex: u32) -> Result<Lease, IpamError> {
        let Reservation { lease, file } = reservation;
        let lease = {
            let mut inner = self.inner.lock().unwrap();
            let Some(l) = inner.leases.get_mut(&lease.owner) else { return Ok(lease) };
            l.state = LeaseState::Ready;
            l.netns_cookie = netns_cookie;
            l.host_ifindex = host_ifindex;
            l.clone()
        };
        let body = serde_json::to_vec(&lease).expect("lease serializes");
        let path = lease_file(&self.dir, &lease.owner);
        file.write_all_at(&body, 0)
            .and_then(|_| file.set_len(body.len() as u64))
            .map_err(|source| IpamError::Io { path, source })?;
        Ok(lease)
    }

    fn forget(&self, owner: &Owner) -> Option<Lease> {
        let mut inner = self.inner.lock().unwrap();
        let lease = inner.leases.remove(owner)?;
        for ip in &lease.ips {
            inner.used.remove(&ip.ip());
        }
        Some(lease)
    }

    /// Release an attachment's addresses. The file goes first: if the agent dies between
    /// the two steps the address is simply free on the next start.
    pub fn release(&self, owner: &Owner) -> Result<Option<Lease>, IpamError> {
        let path = lease_file(&self.dir, owner);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(IpamError::Io { path, source }),
        }
        Ok(self.forget(owner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(cid: &str) -> Lease {
        Lease {
            owner: Owner { container_id: cid.into(), ifname: "eth0".into() },
            state: LeaseState::Adding,
            netns: "/x".into(),
            netns_inode: 1,
            netns_cookie: 0,
            host_ifindex: 0,
            host_if: "npx".into(),
            ips: vec![],
            pod: String::new(),
        }
    }

    #[test]
    fn allocates_distinct_and_skips_reserved() {
        let guard = crate::util::TestDir::new("ipam-distinct");
        let dir = guard.0.join("leases");
        let (ipam, _) = Ipam::load(&dir).unwrap();
        ipam.assign_block("10.1.2.0/29".parse().unwrap()).unwrap();
        ipam.assign_block("fd00:1::/125".parse().unwrap()).unwrap();
        let mut seen = HashSet::new();
        // /29 has 8 addresses: network, gateway, broadcast reserved -> 5 for pods.
        for i in 0..5 {
            let l = ipam.reserve(lease(&format!("c{i}"))).unwrap().lease;
            assert_eq!(l.ips.len(), 2);
            assert!(l.ips[0].is_ipv4() && l.ips[1].is_ipv6());
            for ip in &l.ips {
                assert!(seen.insert(ip.ip()), "duplicate {ip}");
                assert_ne!(ip.ip(), "10.1.2.0".parse::<IpAddr>().unwrap());
                assert_ne!(ip.ip(), "10.1.2.1".parse::<IpAddr>().unwrap());
                assert_ne!(ip.ip(), "10.1.2.7".parse::<IpAddr>().unwrap());
            }
        }
        let e = ipam.reserve(lease("c9")).unwrap_err();
        assert!(matches!(e, IpamError::Exhausted { family: Family::V4, .. }), "{e}");
        let usage: Vec<(String, u128, u128)> =
            ipam.block_usage().iter().map(|(b, used)| (b.net.to_string(), b.capacity(), *used)).collect();
        assert_eq!(usage, vec![("10.1.2.0/29".into(), 5, 5), ("fd00:1::/125".into(), 6, 5)]);
        assert_eq!(ipam.lease_count(), 5);
        // The failed reservation must not hold its IPv6 address.
        assert_eq!(ipam.leases().len(), 5);
        ipam.release(&lease("c0").owner).unwrap();
        assert!(ipam.reserve(lease("c9")).is_ok());
        // A withdrawn block hands out nothing more; its leases stay.
        let gone = ipam.retain_blocks(&["fd00:1::/125".parse().unwrap()]);
        assert_eq!(gone.len(), 1);
        assert_eq!(ipam.blocks().len(), 1);
        assert!(ipam.retain_blocks(&[]).len() == 1);
        assert!(matches!(ipam.reserve(lease("c10")), Err(IpamError::NoBlock(_))));
        assert_eq!(ipam.leases().len(), 5);
    }

    #[test]
    fn survives_reload() {
        let guard = crate::util::TestDir::new("ipam-reload");
        let dir = guard.0.join("leases");
        let (ipam, _) = Ipam::load(&dir).unwrap();
        ipam.assign_block("10.1.3.0/24".parse().unwrap()).unwrap();
        let a = ipam.commit(ipam.reserve(lease("a")).unwrap(), 7, 9).unwrap();
        let b = ipam.reserve(lease("b")).unwrap().lease;
        fs::write(dir.join("half-created.json"), b"").unwrap();
        fs::write(dir.join("junk.json.tmp"), b"{").unwrap();
        drop(ipam);
        let (ipam, problems) = Ipam::load(&dir).unwrap();
        assert_eq!(problems.len(), 2, "{problems:?}");
        ipam.assign_block("10.1.3.0/24".parse().unwrap()).unwrap();
        assert_eq!(ipam.get(&a.owner).unwrap().state, LeaseState::Ready);
        assert_eq!(ipam.get(&a.owner).unwrap().netns_cookie, 7);
        assert_eq!(ipam.get(&b.owner).unwrap().state, LeaseState::Adding);
        let c = ipam.reserve(lease("c")).unwrap().lease;
        assert!(c.ips[0].ip() != a.ips[0].ip() && c.ips[0].ip() != b.ips[0].ip());
        ipam.release(&a.owner).unwrap();
        assert!(!lease_file(&dir, &a.owner).exists());
    }

    /// The commit's rewrite in place leaves exactly the committed lease, also with the
    /// longest cookie and index there are.
    #[test]
    fn a_commit_rewrites_the_lease_whole() {
        let guard = crate::util::TestDir::new("ipam-commit");
        let dir = guard.0.join("leases");
        let (ipam, _) = Ipam::load(&dir).unwrap();
        ipam.assign_block("10.1.5.0/24".parse().unwrap()).unwrap();
        ipam.assign_block("fd00:5::/64".parse().unwrap()).unwrap();
        let r = ipam.reserve(lease("a")).unwrap();
        let path = lease_file(&dir, &r.lease.owner);
        let committed = ipam.commit(r, u64::MAX, u32::MAX).unwrap();
        assert_eq!(fs::read(&path).unwrap(), serde_json::to_vec(&committed).unwrap());
        drop(ipam);
        let (ipam, problems) = Ipam::load(&dir).unwrap();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(ipam.leases(), vec![committed]);
    }

    #[test]
    fn rejects_tiny_blocks() {
        assert!(Block::new("10.0.0.0/31".parse().unwrap()).is_err());
        assert!(Block::new("fd00::/127".parse().unwrap()).is_err());
        let b = Block::new("10.0.0.7/24".parse().unwrap()).unwrap();
        assert_eq!(b.net.to_string(), "10.0.0.0/24");
        assert_eq!(b.gateway().to_string(), "10.0.0.1");
    }
}
