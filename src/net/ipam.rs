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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

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
        let size: u128 =
            if bits - self.net.prefix() as u32 >= 128 { u128::MAX } else { 1u128 << (bits - self.net.prefix() as u32) };
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
    written: WrittenLease,
}

/// A new lease's file ends in this many spaces (JSON allows whitespace after the value),
/// room for what its commit adds: the namespace's cookie (up to 20 digits where the
/// reservation has `0`: 19 more) and the host veth's index, which the reservation leaves
/// out (`,"hostIfindex":` and up to 10 digits: 25), while the state's name gets shorter
/// (`adding` to `ready`). The commit then overwrites the file in place with one write of
/// the same length, padded with spaces: no truncation, which on ext4 takes the inode
/// through the journal's orphan list and back (8 us against 2.5 us for the write alone
/// here).
const COMMIT_ROOM: usize = 48;

/// A new lease's file, written by [`LeaseWrite::run`].
#[derive(Debug)]
pub struct WrittenLease {
    file: fs::File,
    /// The file's length: the `adding` lease and its room (see [`COMMIT_ROOM`]).
    len: usize,
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
    spares: Arc<Spares>,
    /// Wakes the thread that refills `spares`; dropped with the Ipam, which ends it.
    refill: mpsc::Sender<()>,
}

/// How many empty lease files are kept made ahead of the ADDs that need them.
const SPARES: usize = 8;
/// How many a burst of DELs may leave (their own lease files) for the ADDs after.
const RECYCLED_MAX: usize = 128;

/// Empty files made ahead of time in a directory beside the lease directory (same
/// filesystem). Creating a file is the slowest step of a reservation (0.14 ms on this
/// machine's ext4, against 5 us to write into an open one and 21 us to rename): a
/// reservation writes its lease into a spare and renames it into place, and a thread makes
/// the next spare off the request path. The rename makes the lease appear whole: a crash
/// leaves either no lease or a complete one (and at worst a spare with content, emptied
/// at the next start).
struct Spares {
    dir: PathBuf,
    files: Mutex<Vec<(fs::File, PathBuf)>>,
    next: AtomicU64,
}

impl Spares {
    fn make(&self) -> io::Result<()> {
        loop {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let path = self.dir.join(format!("{n}"));
            match fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => {
                    self.files.lock().unwrap().push((file, path));
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Take the file at `path` (a lease's, on the pool's filesystem) in as a spare: its name
    /// is gone when this returns, as with `remove_file` (`NotFound` when there was none);
    /// it is kept while the pool has room (its content until it is written again), so a DEL frees no inode and the next
    /// ADD allocates none (see [`crate::sys::spares`] for why that matters).
    fn recycle(&self, path: &Path) -> io::Result<()> {
        if self.files.lock().unwrap().len() >= RECYCLED_MAX {
            return fs::remove_file(path);
        }
        let spare = self.dir.join(self.next.fetch_add(1, Ordering::Relaxed).to_string());
        match fs::rename(path, &spare) {
            Ok(()) => {
                // Not emptied here: a file truncated to 0 is flushed by ext4 when it is next
                // closed (its auto_da_alloc), which would land in the ADD that commits into
                // it; the write that reuses it cuts it to its new length instead.
                match fs::OpenOptions::new().write(true).open(&spare) {
                    Ok(file) => self.files.lock().unwrap().push((file, spare)),
                    // The lease is gone either way; a spare that cannot be opened is not kept.
                    Err(_) => {
                        let _ = fs::remove_file(&spare);
                    }
                }
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => fs::remove_file(path),
            Err(e) => Err(e),
        }
    }

    fn fill(&self) {
        while self.files.lock().unwrap().len() < SPARES {
            if let Err(e) = self.make() {
                // Only a speed-up: reservations create their files themselves meanwhile.
                tracing::debug!(error = %e, dir = %self.dir.display(), "making a spare lease file");
                return;
            }
        }
    }
}

/// A reserved lease's file, to be written: see [`Ipam::reserve_begin`]. It holds what it
/// needs (no borrow of the [`Ipam`]), so another thread can write it.
pub struct LeaseWrite {
    spares: Arc<Spares>,
    refill: mpsc::Sender<()>,
    path: PathBuf,
    body: Vec<u8>,
}

impl LeaseWrite {
    /// Write a new lease's file: into a spare renamed into place when one is ready, else a
    /// file created here.
    pub fn run(self) -> io::Result<WrittenLease> {
        let len = self.body.len();
        self.write().map(|file| WrittenLease { file, len })
    }

    fn write(self) -> io::Result<fs::File> {
        let (path, body) = (&self.path, &self.body[..]);
        let spare = self.spares.files.lock().unwrap().pop();
        if let Some((file, spare_path)) = spare {
            // A recycled spare still holds its last lease: cut to this one's length.
            let cut = |f: &fs::File| match f.metadata() {
                Ok(m) if m.len() > body.len() as u64 => f.set_len(body.len() as u64),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            match file.write_all_at(body, 0).and_then(|_| cut(&file)).and_then(|_| fs::rename(&spare_path, path)) {
                Ok(()) => {
                    let _ = self.refill.send(());
                    return Ok(file);
                }
                Err(e) => {
                    // Emptied and kept (a full disk: the same spare serves the next try),
                    // or dropped when even that fails; then the slow path says why.
                    if file.set_len(0).is_ok() && spare_path.exists() {
                        self.spares.files.lock().unwrap().push((file, spare_path));
                    } else {
                        let _ = fs::remove_file(&spare_path);
                    }
                    if e.raw_os_error() != Some(libc::EXDEV) {
                        return Err(e);
                    }
                }
            }
        }
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .and_then(|mut f| f.write_all(body).map(|_| f))
    }
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
        let spares = Arc::new(Self::load_spares(dir));
        let (refill, wake) = mpsc::channel::<()>();
        let filler = Arc::clone(&spares);
        std::thread::Builder::new()
            .name("ipam-spares".into())
            .spawn(move || {
                // Only when a CPU has nothing else to do: woken by a reservation, a thread of
                // normal priority would preempt the ADD that woke it on a busy 2-CPU node
                // (a file creation, 0.14 ms, inside the ADD it was meant to spare).
                let idle = libc::sched_param { sched_priority: 0 };
                if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &idle) } != 0 {
                    tracing::debug!(error = %io::Error::last_os_error(), "spare lease files: SCHED_IDLE");
                }
                filler.fill();
                while wake.recv().is_ok() {
                    filler.fill();
                }
            })
            .map_err(io_err)?;
        let ipam = Ipam {
            dir: dir.to_path_buf(),
            inner: Mutex::new(Inner { blocks: Vec::new(), used, leases, cursor: HashMap::new() }),
            spares,
            refill,
        };
        Ok((ipam, problems))
    }

    /// The spares left by the last run (emptied: content there is a reservation a crash
    /// interrupted before its rename, so it never was a lease), or a new spare directory.
    fn load_spares(dir: &Path) -> Spares {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "ipam".into());
        let spare_dir = dir.with_file_name(format!("{name}.spare"));
        let mut files = Vec::new();
        let mut next = 0;
        if fs::create_dir_all(&spare_dir).is_ok()
            && let Ok(entries) = fs::read_dir(&spare_dir)
        {
            for e in entries.flatten() {
                let path = e.path();
                let n = e.file_name().to_str().and_then(|n| n.parse::<u64>().ok());
                let file = fs::OpenOptions::new().write(true).open(&path);
                match (n, file) {
                    (Some(n), Ok(f)) if f.set_len(0).is_ok() => {
                        next = next.max(n + 1);
                        files.push((f, path));
                    }
                    _ => {
                        let _ = fs::remove_file(&path);
                    }
                }
            }
        }
        Spares { dir: spare_dir, files: Mutex::new(files), next: AtomicU64::new(next) }
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
        let inner = self.inner.lock().unwrap();
        let mut out: Vec<(Family, u128)> = Vec::new();
        for b in &inner.blocks {
            let used = inner.used.iter().filter(|ip| b.net.contains(**ip)).count() as u128;
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
    pub fn reserve(&self, lease: Lease) -> Result<Reservation, IpamError> {
        let (lease, write) = self.reserve_begin(lease)?;
        let written = write.run();
        self.reserve_finish(lease, written)
    }

    /// [`Ipam::reserve`] in three parts: the addresses are taken here (in memory), the
    /// returned [`LeaseWrite`] persists the lease on any thread, and
    /// [`Ipam::reserve_finish`] is given its outcome, which it must be given in every case
    /// (a failed write gives the addresses back).
    pub fn reserve_begin(&self, mut lease: Lease) -> Result<(Lease, LeaseWrite), IpamError> {
        {
            let mut inner = self.inner.lock().unwrap();
            let families: Vec<Family> = {
                let mut f: Vec<Family> = inner.blocks.iter().map(|b| b.family()).collect();
                f.sort();
                f.dedup();
                f
            };
            if families.is_empty() {
                return Err(IpamError::NoBlock(None));
            }
            let mut ips = Vec::new();
            for family in families {
                match Self::pick(&mut inner, family) {
                    Ok(ip) => ips.push(ip),
                    Err(e) => {
                        for ip in &ips {
                            inner.used.remove(&ip.ip());
                        }
                        return Err(e);
                    }
                }
            }
            lease.ips = ips;
            lease.state = LeaseState::Adding;
            inner.leases.insert(lease.owner.clone(), lease.clone());
        }
        let write = LeaseWrite {
            spares: self.spares.clone(),
            refill: self.refill.clone(),
            path: lease_file(&self.dir, &lease.owner),
            body: {
                let mut body = serde_json::to_vec(&lease).expect("lease serializes");
                body.resize(body.len() + COMMIT_ROOM, b' ');
                body
            },
        };
        Ok((lease, write))
    }

    /// The end of a reservation begun with [`Ipam::reserve_begin`]: `written` is what its
    /// [`LeaseWrite::run`] returned.
    pub fn reserve_finish(&self, lease: Lease, written: io::Result<WrittenLease>) -> Result<Reservation, IpamError> {
        match written {
            Ok(written) => Ok(Reservation { lease, written }),
            Err(source) => {
                let path = lease_file(&self.dir, &lease.owner);
                self.forget(&lease.owner);
                let _ = fs::remove_file(&path);
                Err(IpamError::Io { path, source })
            }
        }
    }

    /// Mark a lease complete (its datapath work is done in the namespace `netns_cookie`).
    /// The file is rewritten in place with one write: a crash before it leaves `adding`
    /// (rolled back at start), one after it leaves `ready`. No new file is created, which
    /// matters: creating files is the slowest step of an ADD on some filesystems.
    pub fn commit(&self, reservation: Reservation, netns_cookie: u64, host_ifindex: u32) -> Result<Lease, IpamError> {
        let Reservation { lease, written: WrittenLease { file, len } } = reservation;
        let lease = {
            let mut inner = self.inner.lock().unwrap();
            let Some(l) = inner.leases.get_mut(&lease.owner) else { return Ok(lease) };
            l.state = LeaseState::Ready;
            l.netns_cookie = netns_cookie;
            l.host_ifindex = host_ifindex;
            l.clone()
        };
        let mut body = serde_json::to_vec(&lease).expect("lease serializes");
        let path = lease_file(&self.dir, &lease.owner);
        let written = if body.len() <= len {
            // The usual case: the same length, in one write.
            body.resize(len, b' ');
            file.write_all_at(&body, 0)
        } else {
            file.write_all_at(&body, 0).and_then(|_| file.set_len(body.len() as u64))
        };
        written.map_err(|source| IpamError::Io { path, source })?;
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
        match self.spares.recycle(&path) {
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

    fn inodes(dir: &Path) -> HashSet<u64> {
        use std::os::unix::fs::MetadataExt;
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().metadata().unwrap().ino()).collect()
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn leases_are_written_into_spares_made_ahead() {
        let guard = crate::util::TestDir::new("ipam-spares");
        let dir = guard.0.join("leases");
        let spare_dir = guard.0.join("leases.spare");
        let (ipam, _) = Ipam::load(&dir).unwrap();
        ipam.assign_block("10.1.4.0/24".parse().unwrap()).unwrap();
        wait_for("the spares", || inodes(&spare_dir).len() == SPARES);
        let spares = inodes(&spare_dir);
        let r = ipam.reserve(lease("a")).unwrap();
        let path = lease_file(&dir, &r.lease.owner);
        // The lease is one of the spares, renamed, and whole.
        let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&path).unwrap());
        assert!(spares.contains(&ino), "the lease file was created, not taken from the spares");
        assert_eq!(serde_json::from_slice::<Lease>(&fs::read(&path).unwrap()).unwrap(), r.lease);
        let committed = ipam.commit(r, 5, 6).unwrap();
        assert_eq!(serde_json::from_slice::<Lease>(&fs::read(&path).unwrap()).unwrap(), committed);
        // Made again off the request path; never one the lease took.
        wait_for("the refill", || inodes(&spare_dir).len() == SPARES);
        assert!(!inodes(&spare_dir).contains(&ino));
        // A spare with content (a crash between its write and its rename) is no lease and
        // is emptied at the next start; a stray file there is removed.
        let some = fs::read_dir(&spare_dir).unwrap().next().unwrap().unwrap().path();
        fs::write(&some, serde_json::to_vec(&lease("ghost")).unwrap()).unwrap();
        fs::write(spare_dir.join("stray"), b"x").unwrap();
        drop(ipam);
        let (ipam, problems) = Ipam::load(&dir).unwrap();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(fs::metadata(&some).unwrap().len(), 0);
        assert!(!spare_dir.join("stray").exists());
        assert_eq!(ipam.leases(), vec![committed]);
    }

    #[test]
    fn a_released_lease_file_is_the_next_one() {
        let guard = crate::util::TestDir::new("ipam-recycle");
        let dir = guard.0.join("leases");
        let (ipam, _) = Ipam::load(&dir).unwrap();
        ipam.assign_block("10.1.5.0/24".parse().unwrap()).unwrap();
        let mut long = lease("a-container-with-a-long-id");
        long.pod = "ns/a-pod-with-a-long-name-and-more".into();
        let r = ipam.reserve(long).unwrap();
        let path = lease_file(&dir, &r.lease.owner);
        let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&path).unwrap());
        let owner = r.lease.owner.clone();
        ipam.commit(r, 5, 6).unwrap();
        // The spares are made again first (so none is made after the release's).
        let spare_dir = guard.0.join("leases.spare");
        wait_for("the refill", || inodes(&spare_dir).len() == SPARES);
        ipam.release(&owner).unwrap();
        assert!(!path.exists());
        assert_eq!(inodes(&spare_dir).len(), SPARES + 1, "kept as a spare, not unlinked");
        // The next lease is written into the released file (the most recent spare), cut to
        // its own length: it parses whole, nothing of the longer lease after it.
        let r = ipam.reserve(lease("b")).unwrap();
        let path = lease_file(&dir, &r.lease.owner);
        assert_eq!(std::os::unix::fs::MetadataExt::ino(&fs::metadata(&path).unwrap()), ino);
        assert_eq!(serde_json::from_slice::<Lease>(&fs::read(&path).unwrap()).unwrap(), r.lease);
        let committed = ipam.commit(r, 7, 8).unwrap();
        assert_eq!(serde_json::from_slice::<Lease>(&fs::read(&path).unwrap()).unwrap(), committed);
        drop(ipam);
        let (ipam, problems) = Ipam::load(&dir).unwrap();
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(ipam.leases(), vec![committed]);
    }

    /// A commit rewrites the lease in place at the file's own length, with the largest
    /// cookie and index there are; a body longer than the room (not made by reserve) still
    /// leaves exactly the committed lease.
    #[test]
    fn commit_overwrites_in_place_at_the_same_length() {
        let guard = crate::util::TestDir::new("ipam-commit-room");
        let dir = guard.0.join("leases");
        let (ipam, _) = Ipam::load(&dir).unwrap();
        ipam.assign_block("10.1.5.0/24".parse().unwrap()).unwrap();
        ipam.assign_block("fd00:5::/64".parse().unwrap()).unwrap();
        let r = ipam.reserve(lease("a")).unwrap();
        let path = lease_file(&dir, &r.lease.owner);
        let reserved_len = fs::metadata(&path).unwrap().len();
        let committed = ipam.commit(r, u64::MAX, u32::MAX).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), reserved_len, "rewritten at the reservation's length");
        assert_eq!(serde_json::from_slice::<Lease>(&fs::read(&path).unwrap()).unwrap(), committed);

        let r = ipam.reserve(lease("b")).unwrap();
        let path = lease_file(&dir, &r.lease.owner);
        let short = Reservation { written: WrittenLease { len: 10, ..r.written }, ..r };
        let committed_b = ipam.commit(short, 7, 8).unwrap();
        let body = fs::read(&path).unwrap();
        assert_eq!(body, serde_json::to_vec(&committed_b).unwrap(), "written whole and cut at its end");
        // Both load as they were committed.
        drop(ipam);
        let (ipam, problems) = Ipam::load(&dir).unwrap();
        assert!(problems.is_empty(), "{problems:?}");
        let mut loaded = ipam.leases();
        loaded.sort_by(|x, y| x.owner.container_id.cmp(&y.owner.container_id));
        assert_eq!(loaded, vec![committed, committed_b]);
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
