//! A recording fake of [`VolumeKernel`] for tests that must run without root.
//!
//! What it models, all in memory:
//!
//! - loop devices `/dev/loopN` (numbers `7:N`; the nodes exist only here), each bound to a
//!   backing file named by path and identified by the `(st_dev, st_ino)` of the real file
//!   the store created; the lowest unbound number is taken on attach, and the device size is
//!   the file's length at attach (and at `loop_set_capacity`);
//! - a mount table starting with one root filesystem (`/`, `253:1`, ext4): mounting a device
//!   pushes an entry with the device's numbers, a bind of a directory copies the numbers of
//!   the mount holding it, a bind of a device node shows devtmpfs (`0:6`, root `/loopN`)
//!   while the target reports the loop device's numbers as its block-node numbers; an
//!   unmount pops the topmost entry at exactly that path (EINVAL when there is none);
//! - filesystem contents per backing file: blank (probe `None`) until `mkfs`, which spans
//!   the device; `grow_fs` makes it span the device again;
//! - detach refused (`Busy`) while a filesystem of the device is mounted (a bind-mounted
//!   device node does not hold the device, as in the kernel).
//!
//! Paths handed to the mount calls are checked against the real directories the caller
//! created (beneath the root, existing, no symlink on the way), like `openat2` would.
//!
//! Every call is logged ([`FakeKernel::calls`]) as `"<op> <args…>"`. Faults are injected by
//! operation name (the trait method's name): [`FakeKernel::fail`] fails the next call of it,
//! [`FakeKernel::fail_after`] lets `n` calls pass and fails the one after; each fault fires
//! once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::mount::MsFlags;

use super::fstools::{FsError, FsType};
use super::loopdev::{AttachOptions, DetachError, LO_FLAGS_READ_ONLY, LoopBinding, LoopInfo64};
use super::mount::{MountEntry, MountOptions};
use super::volume_kernel::{FsStats, MountError, VolumeKernel};

/// Major number of the fake loop devices.
pub const LOOP_MAJOR: u32 = 7;
/// Device numbers of the fake devtmpfs a device node is bind-mounted from.
pub const DEVTMPFS: (u32, u32) = (0, 6);
/// Device numbers of the fake root filesystem.
pub const ROOT_FS: (u32, u32) = (253, 1);

#[derive(Debug, Clone)]
struct FakeLoop {
    backing: PathBuf,
    st_dev: u64,
    st_ino: u64,
    read_only: bool,
    size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Contents {
    fs_type: String,
    size: u64,
}

#[derive(Debug)]
struct Fault {
    op: String,
    pass: usize,
    errno: Errno,
}

#[derive(Debug)]
struct State {
    calls: Vec<String>,
    faults: Vec<Fault>,
    /// Bound devices by number.
    loops: BTreeMap<u32, FakeLoop>,
    /// Numbers whose `/dev/loopN` node exists (every number ever handed out).
    nodes: BTreeSet<u32>,
    table: Vec<MountEntry>,
    next_mount_id: u32,
    /// Filesystem contents by backing file `(st_dev, st_ino)`.
    contents: HashMap<(u64, u64), Contents>,
}

/// See the module docs.
#[derive(Debug)]
pub struct FakeKernel {
    state: Mutex<State>,
}

impl Default for FakeKernel {
    fn default() -> Self {
        Self::new()
    }
}

/// A device attached in the fake, as tests inspect it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub device: PathBuf,
    pub backing: PathBuf,
    pub read_only: bool,
}

fn identity(path: &Path) -> io::Result<(u64, u64)> {
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

fn loop_number(dev: &Path) -> Option<u32> {
    dev.to_str()?.strip_prefix("/dev/loop")?.parse().ok()
}

fn os(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

fn tool_failed(tool: &str, arg: &Path, why: &str) -> FsError {
    FsError::Failed {
        tool: tool.to_string(),
        args: arg.display().to_string(),
        status: "exit status: 1".into(),
        stderr: why.to_string(),
    }
}

/// What `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` would say about `path` under `root`.
fn check_beneath(root: &Path, path: &Path) -> io::Result<()> {
    let rel = path.strip_prefix(root).map_err(|_| os(Errno::EXDEV))?;
    let mut cur = root.to_path_buf();
    for c in rel.components() {
        match c {
            std::path::Component::Normal(n) => cur.push(n),
            _ => return Err(os(Errno::EXDEV)),
        }
        if std::fs::symlink_metadata(&cur)?.file_type().is_symlink() {
            return Err(os(Errno::ELOOP));
        }
    }
    Ok(())
}

fn rw_option(read_only: bool) -> Vec<String> {
    vec![if read_only { "ro" } else { "rw" }.to_string(), "relatime".to_string()]
}

impl FakeKernel {
    pub fn new() -> Self {
        let root = MountEntry {
            id: 1,
            parent: 0,
            major: ROOT_FS.0,
            minor: ROOT_FS.1,
            root: "/".into(),
            mount_point: "/".into(),
            options: rw_option(false),
            fs_type: "ext4".into(),
            source: "/dev/vda1".into(),
            super_options: vec!["rw".into()],
        };
        FakeKernel {
            state: Mutex::new(State {
                calls: Vec::new(),
                faults: Vec::new(),
                loops: BTreeMap::new(),
                nodes: BTreeSet::new(),
                table: vec![root],
                next_mount_id: 2,
                contents: HashMap::new(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Log the call; the injected errno when a fault fires for it.
    fn enter(&self, op: &str, args: &[&dyn std::fmt::Display]) -> Result<std::sync::MutexGuard<'_, State>, Errno> {
        let mut st = self.state();
        let mut line = op.to_string();
        for a in args {
            line.push(' ');
            line.push_str(&a.to_string());
        }
        st.calls.push(line);
        if let Some(i) = st.faults.iter().position(|f| f.op == op) {
            if st.faults[i].pass == 0 {
                let f = st.faults.remove(i);
                return Err(f.errno);
            }
            st.faults[i].pass -= 1;
        }
        Ok(st)
    }

    // ----- test controls -----

    /// Every call so far, in order, as `"<op> <args…>"`.
    pub fn calls(&self) -> Vec<String> {
        self.state().calls.clone()
    }

    /// How many calls of `op` were made.
    pub fn count(&self, op: &str) -> usize {
        self.state().calls.iter().filter(|c| c.split(' ').next() == Some(op)).count()
    }

    pub fn clear_calls(&self) {
        self.state().calls.clear();
    }

    /// Fail the next call of `op` with `errno`.
    pub fn fail(&self, op: &str, errno: Errno) {
        self.fail_after(op, 0, errno);
    }

    /// Let `n` calls of `op` succeed, then fail the next one with `errno`.
    pub fn fail_after(&self, op: &str, n: usize, errno: Errno) {
        self.state().faults.push(Fault { op: op.to_string(), pass: n, errno });
    }

    /// Faults injected that have not fired yet.
    pub fn pending_faults(&self) -> usize {
        self.state().faults.len()
    }

    /// The mount table without the root filesystem.
    pub fn mounts(&self) -> Vec<MountEntry> {
        self.state().table[1..].to_vec()
    }

    /// The mounts stacked on `path`, bottom first.
    pub fn mounts_at(&self, path: &Path) -> Vec<MountEntry> {
        self.state().table.iter().filter(|m| m.mount_point == path).cloned().collect()
    }

    /// Bound loop devices, by number.
    pub fn attached(&self) -> Vec<Attached> {
        self.state()
            .loops
            .iter()
            .map(|(n, l)| Attached {
                device: PathBuf::from(format!("/dev/loop{n}")),
                backing: l.backing.clone(),
                read_only: l.read_only,
            })
            .collect()
    }

    /// Put a filesystem (or any other signature, e.g. `swap`) of `size` bytes in the file
    /// `backing`, as if written there before.
    pub fn put_filesystem(&self, backing: &Path, fs_type: &str, size: u64) {
        let id = identity(backing).expect("stat of the backing file");
        self.state().contents.insert(id, Contents { fs_type: fs_type.to_string(), size });
    }

    /// The filesystem type and size in the file `backing`, if any.
    pub fn filesystem_of(&self, backing: &Path) -> Option<(String, u64)> {
        let id = identity(backing).ok()?;
        self.state().contents.get(&id).map(|c| (c.fs_type.clone(), c.size))
    }

    /// A mount someone else made at `path` (not a volume's).
    pub fn add_mount(&self, path: &Path, fs_type: &str, source: &str, num: (u32, u32)) {
        let mut st = self.state();
        let id = st.next_mount_id;
        st.next_mount_id += 1;
        st.table.push(MountEntry {
            id,
            parent: 1,
            major: num.0,
            minor: num.1,
            root: "/".into(),
            mount_point: path.to_path_buf(),
            options: rw_option(false),
            fs_type: fs_type.to_string(),
            source: source.to_string(),
            super_options: vec!["rw".into()],
        });
    }
}

impl State {
    fn bound(&self, dev: &Path) -> Option<(u32, &FakeLoop)> {
        let n = loop_number(dev)?;
        self.loops.get(&n).map(|l| (n, l))
    }

    /// The mount holding `path` (longest mount point that is a prefix; topmost of those).
    fn holding(&self, path: &Path) -> &MountEntry {
        self.table
            .iter()
            .enumerate()
            .filter(|(_, m)| path.starts_with(&m.mount_point))
            .max_by_key(|(i, m)| (m.mount_point.components().count(), *i))
            .map(|(_, m)| m)
            .expect("the root filesystem holds every path")
    }

    fn push(&mut self, mut m: MountEntry) {
        m.id = self.next_mount_id;
        self.next_mount_id += 1;
        m.parent = self.holding(&m.mount_point).id;
        self.table.push(m);
    }

    /// The contents of the filesystem behind `dev` (a bound loop device).
    fn contents_of(&self, dev: &Path) -> Option<(u64, u64)> {
        self.bound(dev).map(|(_, l)| (l.st_dev, l.st_ino))
    }
}

impl VolumeKernel for FakeKernel {
    fn mount_table(&self) -> io::Result<Vec<MountEntry>> {
        let st = self.enter("mount_table", &[]).map_err(os)?;
        Ok(st.table.clone())
    }

    fn top_mount(&self, path: &Path) -> io::Result<Option<MountEntry>> {
        let st = self.enter("top_mount", &[&path.display()]).map_err(os)?;
        Ok(st.table.iter().rev().find(|m| m.mount_point == path).cloned())
    }

    fn dev_numbers(&self, dev: &Path) -> io::Result<(u32, u32)> {
        let st = self.enter("dev_numbers", &[&dev.display()]).map_err(os)?;
        match loop_number(dev) {
            Some(n) if st.nodes.contains(&n) => Ok((LOOP_MAJOR, n)),
            _ => Err(os(Errno::ENOENT)),
        }
    }

    fn block_node(&self, path: &Path) -> Option<(u32, u32)> {
        let st = self.enter("block_node", &[&path.display()]).ok()?;
        if let Some(n) = loop_number(path) {
            return st.nodes.contains(&n).then_some((LOOP_MAJOR, n));
        }
        // A device node bind-mounted onto the path: what a lookup of it sees.
        let top = st.table.iter().rev().find(|m| m.mount_point == path)?;
        if (top.major, top.minor) != DEVTMPFS {
            return None;
        }
        let n: u32 = top.root.to_str()?.strip_prefix("/loop")?.parse().ok()?;
        Some((LOOP_MAJOR, n))
    }

    fn mount_device(
        &self,
        dev: &Path,
        root: &Path,
        target: &Path,
        fs_type: &str,
        opts: &MountOptions,
    ) -> Result<(), MountError> {
        let mut st =
            self.enter("mount_device", &[&dev.display(), &target.display(), &fs_type]).map_err(MountError::Mount)?;
        check_beneath(root, target).map_err(MountError::Target)?;
        let (n, l) = st.bound(dev).ok_or(MountError::Mount(Errno::ENOENT))?;
        let read_only = opts.flags.contains(MsFlags::MS_RDONLY);
        if l.read_only && !read_only {
            return Err(MountError::Mount(Errno::EACCES));
        }
        match st.contents.get(&(l.st_dev, l.st_ino)) {
            Some(c) if c.fs_type == fs_type => {}
            _ => return Err(MountError::Mount(Errno::EINVAL)),
        }
        let mut super_options = vec!["rw".to_string()];
        super_options.extend(opts.data.iter().cloned());
        st.push(MountEntry {
            id: 0,
            parent: 0,
            major: LOOP_MAJOR,
            minor: n,
            root: "/".into(),
            mount_point: target.to_path_buf(),
            options: rw_option(read_only),
            fs_type: fs_type.to_string(),
            source: dev.display().to_string(),
            super_options,
        });
        Ok(())
    }

    fn bind_device(&self, dev: &Path, root: &Path, target: &Path, read_only: bool) -> Result<(), MountError> {
        let mut st =
            self.enter("bind_device", &[&dev.display(), &target.display(), &read_only]).map_err(MountError::Mount)?;
        check_beneath(root, target).map_err(MountError::Target)?;
        let n = loop_number(dev).filter(|n| st.nodes.contains(n)).ok_or(MountError::Mount(Errno::ENOENT))?;
        st.push(MountEntry {
            id: 0,
            parent: 0,
            major: DEVTMPFS.0,
            minor: DEVTMPFS.1,
            root: format!("/loop{n}").into(),
            mount_point: target.to_path_buf(),
            options: rw_option(read_only),
            fs_type: "devtmpfs".into(),
            source: "udev".into(),
            super_options: vec!["rw".into()],
        });
        Ok(())
    }

    fn bind_dir(
        &self,
        root: &Path,
        source: &Path,
        target: &Path,
        read_only: bool,
        flags: MsFlags,
    ) -> Result<(), MountError> {
        let mut st =
            self.enter("bind_dir", &[&source.display(), &target.display(), &read_only]).map_err(MountError::Mount)?;
        check_beneath(root, source).map_err(MountError::Source)?;
        check_beneath(root, target).map_err(MountError::Target)?;
        let from = st.holding(source).clone();
        let rel = source.strip_prefix(&from.mount_point).unwrap_or(Path::new(""));
        let inner = if rel.as_os_str().is_empty() { from.root.clone() } else { from.root.join(rel) };
        st.push(MountEntry {
            root: inner,
            mount_point: target.to_path_buf(),
            options: rw_option(read_only || flags.contains(MsFlags::MS_RDONLY)),
            ..from
        });
        Ok(())
    }

    fn unmount(&self, path: &Path) -> nix::Result<()> {
        let mut st = self.enter("unmount", &[&path.display()])?;
        let i = st.table.iter().rposition(|m| m.mount_point == path).filter(|&i| i > 0).ok_or(Errno::EINVAL)?;
        st.table.remove(i);
        Ok(())
    }

    fn statvfs(&self, path: &Path) -> nix::Result<FsStats> {
        let st = self.enter("statvfs", &[&path.display()])?;
        let m = st.holding(path);
        let size = if m.major == LOOP_MAJOR {
            st.loops.get(&m.minor).and_then(|l| st.contents.get(&(l.st_dev, l.st_ino))).map(|c| c.size).unwrap_or(0)
        } else {
            1 << 40
        };
        let blocks = size / 4096;
        Ok(FsStats {
            fragment_size: 4096,
            blocks,
            blocks_free: blocks - blocks / 10,
            blocks_available: blocks - blocks / 5,
            files: 65536,
            files_free: 65000,
            files_available: 65000,
        })
    }

    fn loop_attach(&self, backing: &File, name: &Path, opts: AttachOptions) -> io::Result<PathBuf> {
        let mut st = self.enter("loop_attach", &[&name.display(), &opts.read_only]).map_err(os)?;
        let m = backing.metadata()?;
        let n = (0..).find(|n| !st.loops.contains_key(n)).expect("a free number");
        st.loops.insert(
            n,
            FakeLoop {
                backing: name.to_path_buf(),
                st_dev: m.dev(),
                st_ino: m.ino(),
                read_only: opts.read_only,
                size: m.len(),
            },
        );
        st.nodes.insert(n);
        Ok(PathBuf::from(format!("/dev/loop{n}")))
    }

    fn loop_detach(&self, dev: &Path, st_dev: u64, st_ino: u64) -> Result<(), DetachError> {
        let mut st = self.enter("loop_detach", &[&dev.display()]).map_err(|e| match e {
            Errno::EBUSY => DetachError::Busy(format!("{} is mounted or held exclusively", dev.display())),
            e => DetachError::Io(os(e)),
        })?;
        let Some((n, l)) = st.bound(dev) else { return Ok(()) };
        if (l.st_dev, l.st_ino) != (st_dev, st_ino) {
            return Ok(());
        }
        if st.table.iter().any(|m| (m.major, m.minor) == (LOOP_MAJOR, n)) {
            return Err(DetachError::Busy(format!("{} is mounted or held exclusively", dev.display())));
        }
        st.loops.remove(&n);
        Ok(())
    }

    fn loop_find_backed_by(&self, path: &Path, st_dev: u64, st_ino: u64) -> io::Result<Vec<LoopBinding>> {
        let st = self.enter("loop_find_backed_by", &[&path.display()]).map_err(os)?;
        Ok(st
            .loops
            .iter()
            .filter(|(_, l)| (l.st_dev, l.st_ino) == (st_dev, st_ino))
            .map(|(n, l)| LoopBinding {
                device: PathBuf::from(format!("/dev/loop{n}")),
                number: *n,
                backing_file: l.backing.clone(),
                deleted: false,
                read_only: l.read_only,
            })
            .collect())
    }

    fn loop_bound_devices(&self) -> io::Result<Vec<LoopBinding>> {
        let st = self.enter("loop_bound_devices", &[]).map_err(os)?;
        Ok(st
            .loops
            .iter()
            .map(|(n, l)| LoopBinding {
                device: PathBuf::from(format!("/dev/loop{n}")),
                number: *n,
                backing_file: l.backing.clone(),
                // The file as the kernel prints it: " (deleted)" once its inode is unlinked.
                deleted: identity(&l.backing).ok() != Some((l.st_dev, l.st_ino)),
                read_only: false,
            })
            .collect())
    }

    fn device_size(&self, dev: &Path) -> io::Result<u64> {
        let st = self.enter("device_size", &[&dev.display()]).map_err(os)?;
        match st.bound(dev) {
            Some((_, l)) => Ok(l.size),
            None if loop_number(dev).is_some_and(|n| st.nodes.contains(&n)) => Ok(0),
            None => Err(os(Errno::ENOENT)),
        }
    }

    fn loop_set_capacity(&self, dev: &Path) -> io::Result<u64> {
        let mut st = self.enter("loop_set_capacity", &[&dev.display()]).map_err(os)?;
        let n = st.bound(dev).map(|(n, _)| n).ok_or_else(|| os(Errno::ENXIO))?;
        let l = st.loops.get_mut(&n).expect("bound");
        l.size = std::fs::metadata(&l.backing)?.len();
        Ok(l.size)
    }

    fn loop_status(&self, dev: &Path) -> io::Result<LoopInfo64> {
        let st = self.enter("loop_status", &[&dev.display()]).map_err(os)?;
        let (n, l) = st.bound(dev).ok_or_else(|| os(Errno::ENXIO))?;
        Ok(LoopInfo64 {
            lo_device: l.st_dev,
            lo_inode: l.st_ino,
            lo_number: n,
            lo_flags: if l.read_only { LO_FLAGS_READ_ONLY } else { 0 },
            ..Default::default()
        })
    }

    fn fs_probe(&self, dev: &Path) -> Result<Option<String>, FsError> {
        let st = self.enter("fs_probe", &[&dev.display()]).map_err(|e| tool_failed("blkid", dev, e.desc()))?;
        let id = st.contents_of(dev).ok_or_else(|| tool_failed("blkid", dev, "no such device"))?;
        Ok(st.contents.get(&id).map(|c| c.fs_type.clone()))
    }

    fn mkfs(&self, dev: &Path, fs: FsType) -> Result<(), FsError> {
        let tool = format!("mkfs.{}", fs.as_str());
        let mut st =
            self.enter("mkfs", &[&dev.display(), &fs.as_str()]).map_err(|e| tool_failed(&tool, dev, e.desc()))?;
        if fs.is_raw() {
            return Err(FsError::Raw("make"));
        }
        let (_, l) = st.bound(dev).ok_or_else(|| tool_failed(&tool, dev, "no such device"))?;
        if l.read_only {
            return Err(tool_failed(&tool, dev, "read-only device"));
        }
        let (id, size) = ((l.st_dev, l.st_ino), l.size);
        st.contents.insert(id, Contents { fs_type: fs.as_str().to_string(), size });
        Ok(())
    }

    fn fs_size(&self, dev: &Path, fs: FsType) -> Result<Option<u64>, FsError> {
        let st = self
            .enter("fs_size", &[&dev.display(), &fs.as_str()])
            .map_err(|e| FsError::Io { path: dev.display().to_string(), source: os(e) })?;
        if fs.is_raw() {
            return Err(FsError::Raw("measure"));
        }
        let id = st
            .contents_of(dev)
            .ok_or_else(|| FsError::Io { path: dev.display().to_string(), source: os(Errno::ENOENT) })?;
        Ok(st.contents.get(&id).filter(|c| c.fs_type == fs.as_str()).map(|c| c.size))
    }

    fn grow_fs(&self, dev_or_mountpoint: &Path, fs: FsType) -> Result<(), FsError> {
        let p = dev_or_mountpoint;
        let tool = if fs == FsType::Xfs { "xfs_growfs" } else { "resize2fs" };
        let mut st =
            self.enter("grow_fs", &[&p.display(), &fs.as_str()]).map_err(|e| tool_failed(tool, p, e.desc()))?;
        let n = match fs {
            FsType::Raw => return Err(FsError::Raw("grow")),
            FsType::Ext4 => st.bound(p).map(|(n, _)| n).ok_or_else(|| FsError::Io {
                path: p.display().to_string(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "ext4 grows through its block device"),
            })?,
            FsType::Xfs => match st.table.iter().rev().find(|m| m.mount_point == p) {
                Some(m) if m.major == LOOP_MAJOR && !m.read_only() => m.minor,
                _ => return Err(tool_failed(tool, p, "is not a mounted XFS filesystem")),
            },
        };
        let l = st.loops.get(&n).ok_or_else(|| tool_failed(tool, p, "no such device"))?;
        let (id, size) = ((l.st_dev, l.st_ino), l.size);
        match st.contents.get_mut(&id) {
            Some(c) if c.fs_type == fs.as_str() => c.size = size,
            _ => return Err(tool_failed(tool, p, "bad magic number in superblock")),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(dir: &Path, name: &str, size: u64) -> (PathBuf, File) {
        let p = dir.join(name);
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
        f.set_len(size).unwrap();
        (p, f)
    }

    #[test]
    fn loop_devices_mounts_and_faults() {
        let t = crate::util::TestDir::new("fake-volume-kernel");
        let root = t.0.canonicalize().unwrap();
        let (img, f) = image(&root, "a.img", 8 << 20);
        let m = f.metadata().unwrap();
        let k = FakeKernel::new();

        let dev = k.loop_attach(&f, &img, AttachOptions::default()).unwrap();
        assert_eq!(dev, Path::new("/dev/loop0"));
        assert_eq!(k.dev_numbers(&dev).unwrap(), (LOOP_MAJOR, 0));
        assert_eq!(k.device_size(&dev).unwrap(), 8 << 20);
        assert_eq!(k.loop_find_backed_by(&img, m.dev(), m.ino()).unwrap().len(), 1);
        assert_eq!(k.fs_probe(&dev).unwrap(), None);
        k.mkfs(&dev, FsType::Ext4).unwrap();
        assert_eq!(k.fs_probe(&dev).unwrap().as_deref(), Some("ext4"));

        // Mounting needs the target to exist beneath the root, without symlinks.
        let mnt = root.join("mnt");
        assert!(matches!(
            k.mount_device(&dev, &root, &mnt, "ext4", &MountOptions::default()),
            Err(MountError::Target(_))
        ));
        std::fs::create_dir(&mnt).unwrap();
        assert!(matches!(
            k.mount_device(&dev, &root, &mnt, "xfs", &MountOptions::default()),
            Err(MountError::Mount(Errno::EINVAL))
        ));
        k.mount_device(&dev, &root, &mnt, "ext4", &MountOptions::default()).unwrap();
        let bind = root.join("bind");
        std::fs::create_dir(&bind).unwrap();
        k.bind_dir(&root, &mnt, &bind, true, MsFlags::empty()).unwrap();
        let at = k.mounts_at(&bind);
        assert_eq!((at[0].major, at[0].minor, at[0].read_only()), (LOOP_MAJOR, 0, true));

        // Busy while a filesystem of it is mounted.
        assert!(matches!(k.loop_detach(&dev, m.dev(), m.ino()), Err(DetachError::Busy(_))));
        k.unmount(&bind).unwrap();
        k.unmount(&mnt).unwrap();
        assert_eq!(k.unmount(&mnt), Err(Errno::EINVAL));
        assert!(k.mounts().is_empty());

        // A device node bound onto a file shows devtmpfs, and the device through the file.
        let node = root.join("node");
        std::fs::write(&node, b"").unwrap();
        k.bind_device(&dev, &root, &node, false).unwrap();
        assert_eq!((k.mounts_at(&node)[0].major, k.mounts_at(&node)[0].minor), DEVTMPFS);
        assert_eq!(k.block_node(&node), Some((LOOP_MAJOR, 0)));
        k.unmount(&node).unwrap();
        assert_eq!(k.block_node(&node), None);

        // Faults fire once, after the calls they let pass.
        k.fail_after("device_size", 1, Errno::EIO);
        assert!(k.device_size(&dev).is_ok());
        assert_eq!(k.device_size(&dev).unwrap_err().raw_os_error(), Some(libc::EIO));
        assert!(k.device_size(&dev).is_ok());
        k.fail("loop_detach", Errno::EBUSY);
        assert!(matches!(k.loop_detach(&dev, m.dev(), m.ino()), Err(DetachError::Busy(_))));
        k.loop_detach(&dev, m.dev(), m.ino()).unwrap();
        assert!(k.attached().is_empty());
        assert_eq!(k.filesystem_of(&img), Some(("ext4".into(), 8 << 20)), "the filesystem stays in the file");
        assert_eq!(k.count("loop_detach"), 3);
        assert_eq!(k.calls()[0], format!("loop_attach {} false", img.display()));
    }
}
