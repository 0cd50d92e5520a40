//! The mount table and the mount operations the CSI node service performs.
//!
//! Decisions read the kernel's truth, which survives an agent restart: `/proc/self/mountinfo`,
//! or for one path `statx` of it ([`top_mount`], which costs the same however many mounts the
//! node has); mounts are made with `mount(2)` directly, never through a shell or
//! `mount(8)`.

use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags};

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub id: u32,
    pub parent: u32,
    /// Device numbers of the mounted filesystem.
    pub major: u32,
    pub minor: u32,
    /// Path inside the filesystem that is mounted here (`/` for a whole filesystem).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`/`ro`, `nosuid`, …).
    pub options: Vec<String>,
    pub fs_type: String,
    pub source: String,
    /// Per-superblock options.
    pub super_options: Vec<String>,
}

impl MountEntry {
    pub fn read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }
}

/// `\040`-style octal escapes in mountinfo fields.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (b[i + 1] - b'0') as u32 * 64 + (b[i + 2] - b'0') as u32 * 8 + (b[i + 3] - b'0') as u32;
            if v <= 0xff {
                out.push(v as u8);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parse mountinfo text. Lines that do not parse are skipped (the kernel's format is fixed).
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    let (pre, post) = line.split_once(" - ")?;
    let f: Vec<&str> = pre.split(' ').collect();
    if f.len() < 6 {
        return None;
    }
    let (major, minor) = f[2].split_once(':')?;
    let mut p = post.splitn(3, ' ');
    let fs_type = p.next()?;
    let source = p.next()?;
    let super_options = p.next().unwrap_or("");
    Some(MountEntry {
        id: f[0].parse().ok()?,
        parent: f[1].parse().ok()?,
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
        root: PathBuf::from(unescape(f[3])),
        mount_point: PathBuf::from(unescape(f[4])),
        options: f[5].split(',').map(str::to_string).collect(),
        fs_type: unescape(fs_type),
        source: unescape(source),
        super_options: super_options.split(',').map(str::to_string).collect(),
    })
}

/// This process' mount table.
pub fn mount_table() -> io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The mounts stacked on `path` (bottom first), from `table`.
pub fn mounts_at<'a>(table: &'a [MountEntry], path: &Path) -> Vec<&'a MountEntry> {
    table.iter().filter(|m| m.mount_point == path).collect()
}

/// The topmost mount on `path`, without reading the mount table: `statx` tells whether the
/// path is the root of a mount (`STATX_ATTR_MOUNT_ROOT`), its mount id and its filesystem's
/// device numbers; `statfs` the filesystem type and whether the mount is read-only. `None` when
/// nothing is mounted there (or the path does not exist). The entry has no source, root or
/// parent (`source` is empty, `root` is `/`, `parent` 0). An error of kind `Unsupported`
/// when the kernel cannot tell mount roots (before 5.8): read the table then.
pub fn top_mount(path: &Path) -> io::Result<Option<MountEntry>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statx fills the zeroed struct it is given; the path is a valid C string.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let flags = libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT | libc::AT_STATX_DONT_SYNC;
    // SAFETY: as above.
    let rc = unsafe {
        libc::statx(libc::AT_FDCWD, c.as_ptr(), flags, libc::STATX_BASIC_STATS | libc::STATX_MNT_ID, &mut stx)
    };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => Ok(None),
            _ => Err(e),
        };
    }
    let root_flag = libc::STATX_ATTR_MOUNT_ROOT as u64;
    if stx.stx_attributes_mask & root_flag == 0 || stx.stx_mask & libc::STATX_MNT_ID == 0 {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "statx cannot tell mount roots on this kernel"));
    }
    if stx.stx_attributes & root_flag == 0 {
        return Ok(None);
    }
    // SAFETY: statfs fills the zeroed struct it is given.
    let mut sfs: libc::statfs64 = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and the struct above to fill.
    if unsafe { libc::statfs64(c.as_ptr(), &mut sfs) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let fs_type = match sfs.f_type as i64 {
        0xEF53 => "ext4".to_string(),
        0x5846_5342 => "xfs".to_string(),
        0x0102_1994 => "tmpfs".to_string(), // devtmpfs too
        0x9123_683E => "btrfs".to_string(),
        t => format!("fs-0x{t:x}"),
    };
    // statfs's f_flags holds the mount's flags (Linux 2.6.36 on; the libc crate names the
    // field in statfs64 only): glibc's statvfs would make this same statfs call again.
    let ro = (sfs.f_flags as libc::c_ulong) & libc::ST_RDONLY != 0;
    Ok(Some(MountEntry {
        id: stx.stx_mnt_id as u32,
        parent: 0,
        major: stx.stx_dev_major,
        minor: stx.stx_dev_minor,
        root: PathBuf::from("/"),
        mount_point: path.to_path_buf(),
        options: vec![if ro { "ro" } else { "rw" }.to_string()],
        fs_type,
        source: String::new(),
        super_options: Vec::new(),
    }))
}

/// Major and minor numbers of a block device node.
pub fn dev_numbers(dev: &Path) -> io::Result<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(dev)?.rdev();
    Ok((nix::sys::stat::major(rdev) as u32, nix::sys::stat::minor(rdev) as u32))
}

/// When `path` (followed) is a block device node: its major and minor numbers.
pub fn block_node(path: &Path) -> Option<(u32, u32)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let md = std::fs::metadata(path).ok().filter(|m| m.file_type().is_block_device())?;
    Some((nix::sys::stat::major(md.rdev()) as u32, nix::sys::stat::minor(md.rdev()) as u32))
}

/// Mount points (anywhere) of the filesystem on device `major:minor`.
pub fn mount_points_of(table: &[MountEntry], major: u32, minor: u32) -> Vec<PathBuf> {
    table.iter().filter(|m| m.major == major && m.minor == minor).map(|m| m.mount_point.clone()).collect()
}

/// Mount flags a volume capability may carry, split into `mount(2)` flag bits and the
/// filesystem's data string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    pub flags: MsFlags,
    pub data: Vec<String>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions { flags: MsFlags::empty(), data: Vec::new() }
    }
}

impl MountOptions {
    pub fn data_string(&self) -> Option<String> {
        if self.data.is_empty() { None } else { Some(self.data.join(",")) }
    }
}

/// Parse a capability's `mount_flags`. Generic flags become `MS_*` bits; the rest is passed
/// to the filesystem, which rejects what it does not know (`EINVAL`, reported as an invalid
/// argument). Flags that would change what kind of mount this is (`bind`, `remount`, …) and
/// malformed entries are refused here.
pub fn parse_mount_flags(flags: &[String]) -> Result<MountOptions, String> {
    let mut o = MountOptions::default();
    for f in flags {
        if f.is_empty() || f.len() > 256 || f.contains(',') || f.contains('\0') || f.chars().any(char::is_whitespace) {
            return Err(format!("mount flag {f:?} is malformed (one option per entry, no commas or spaces)"));
        }
        let bit = match f.as_str() {
            "ro" => MsFlags::MS_RDONLY,
            "rw" | "defaults" | "async" | "suid" | "dev" | "exec" | "atime" | "diratime" | "nostrictatime"
            | "norelatime" | "nolazytime" => MsFlags::empty(),
            "noatime" => MsFlags::MS_NOATIME,
            "nodiratime" => MsFlags::MS_NODIRATIME,
            "relatime" => MsFlags::MS_RELATIME,
            "strictatime" => MsFlags::MS_STRICTATIME,
            "lazytime" => MsFlags::MS_LAZYTIME,
            "nodev" => MsFlags::MS_NODEV,
            "nosuid" => MsFlags::MS_NOSUID,
            "noexec" => MsFlags::MS_NOEXEC,
            "sync" => MsFlags::MS_SYNCHRONOUS,
            "dirsync" => MsFlags::MS_DIRSYNC,
            "bind" | "rbind" | "remount" | "move" | "shared" | "rshared" | "private" | "rprivate" | "slave"
            | "rslave" | "unbindable" | "runbindable" | "loop" | "user" | "users" | "owner" | "nofail" | "auto"
            | "noauto" | "_netdev" => {
                return Err(format!("mount flag {f:?} is not allowed for a volume"));
            }
            other if other.starts_with("x-") => return Err(format!("mount flag {f:?} is not allowed for a volume")),
            _ => {
                o.data.push(f.clone());
                continue;
            }
        };
        o.flags |= bit;
    }
    Ok(o)
}

/// A path opened without following any symbolic link and without leaving `root`
/// (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`), as an
/// `O_PATH` descriptor. Mounting onto `/proc/self/fd/N` of it acts on exactly the directory
/// or file that was checked: a component swapped for a symlink after [`validate_path`] makes
/// the open fail (ELOOP / EXDEV) instead of redirecting the mount elsewhere.
pub struct Beneath {
    fd: std::os::fd::OwnedFd,
}

impl Beneath {
    pub fn open(root: &Path, path: &Path) -> io::Result<Beneath> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::OpenOptionsExt;
        let rel = path.strip_prefix(root).map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not inside {}", path.display(), root.display()))
        })?;
        let root_fd = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(root)?;
        let rel = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
        let c = std::ffi::CString::new(rel.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
        // SAFETY: open_how is plain data; zeroed then filled.
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
        how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
        // SAFETY: valid dirfd, NUL-terminated path, a correctly sized open_how.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root_fd.as_raw_fd(),
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("opening {} beneath {}: {e}", path.display(), root.display()),
            ));
        }
        // SAFETY: the kernel just returned this descriptor to us.
        Ok(Beneath { fd: unsafe { OwnedFd::from_raw_fd(fd as i32) } })
    }

    /// `/proc/self/fd/N`: hand it to mount(2) as source or target.
    pub fn proc_path(&self) -> PathBuf {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }
}

/// Mount the filesystem on `dev` at `target` (a [`Beneath::proc_path`] or a plain path).
pub fn mount_device(dev: &Path, target: &Path, fs_type: &str, opts: &MountOptions) -> nix::Result<()> {
    let data = opts.data_string();
    nix::mount::mount(Some(dev), target, Some(fs_type), opts.flags, data.as_deref())
}

/// Bind-mount `source` onto `target`; then, when `read_only` or per-mount flags are asked
/// for, remount the bind with them (a bind mount takes its flags only on remount). A
/// failed remount undoes the bind, so the target is never left writable by mistake.
/// `source_at` / `target_at` are what mount(2) gets (e.g. [`Beneath::proc_path`]s);
/// `target` is the plain path, used for the remount and undo (which must see the new mount).
pub fn bind_mount(
    source_at: &Path,
    target_at: &Path,
    target: &Path,
    read_only: bool,
    flags: MsFlags,
) -> nix::Result<()> {
    nix::mount::mount(Some(source_at), target_at, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    let per_mount = MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV
        | MsFlags::MS_NOEXEC
        | MsFlags::MS_NOATIME
        | MsFlags::MS_NODIRATIME
        | MsFlags::MS_RELATIME
        | MsFlags::MS_STRICTATIME;
    let mut f = flags & per_mount;
    if read_only {
        f |= MsFlags::MS_RDONLY;
    }
    if !f.is_empty()
        && let Err(e) = nix::mount::mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | f,
            None::<&str>,
        )
    {
        let _ = nix::mount::umount2(target, MntFlags::UMOUNT_NOFOLLOW);
        return Err(e);
    }
    Ok(())
}

/// Check a path from a request: absolute, normalised (no `.`/`..`, no empty or repeated
/// separators beyond what `Path` collapses), at most 4096 bytes, strictly inside `root`,
/// and with no symbolic link on the way from `root` to it (each existing component is
/// inspected with `lstat`; `target` itself must not be a symlink either). `root` must be
/// canonical. Returns the path as given.
pub fn validate_path(field: &str, raw: &str, root: &Path) -> Result<PathBuf, String> {
    if raw.len() > 4096 {
        return Err(format!("{field} is longer than 4096 bytes"));
    }
    if raw.contains('\0') {
        return Err(format!("{field} contains a NUL byte"));
    }
    let p = Path::new(raw);
    if !p.is_absolute() {
        return Err(format!("{field} {raw:?} is not absolute"));
    }
    if raw.split('/').any(|seg| seg == "." || seg == "..") {
        return Err(format!("{field} {raw:?} contains '.' or '..'"));
    }
    // NAME_MAX: checked for every component here, also below a directory that does not exist
    // yet (the kernel would refuse it later, half-way through creating the path).
    if raw.split('/').any(|seg| seg.len() > 255) {
        return Err(format!("{field} {raw:?} has a component longer than 255 bytes"));
    }
    let clean: PathBuf = p.components().collect();
    let Ok(rel) = clean.strip_prefix(root) else {
        return Err(format!("{field} {raw:?} is outside {}", root.display()));
    };
    if rel.as_os_str().is_empty() {
        return Err(format!("{field} {raw:?} is the kubelet directory itself"));
    }
    let mut cur = root.to_path_buf();
    for c in rel.components() {
        cur.push(c);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(format!("{field} {raw:?}: {} is a symbolic link", cur.display()));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => break,
            Err(e) => return Err(format!("{field} {raw:?}: inspecting {}: {e}", cur.display())),
        }
    }
    Ok(clean)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,errors=remount-ro
97 22 7:3 / /var/lib/kubelet/plugins/kubernetes.io/csi/pv/a\\040b/globalmount rw,noatime shared:50 - xfs /dev/loop3 rw,attr2,inode64
98 22 7:3 / /var/lib/kubelet/pods/p1/volumes/v ro,relatime shared:51 master:50 - xfs /dev/loop3 rw
99 22 0:5 /loop3 /var/lib/kubelet/pods/p2/dev ro,nosuid - devtmpfs udev rw,size=100k
";

    #[test]
    fn parses_mountinfo() {
        let t = parse_mountinfo(SAMPLE);
        assert_eq!(t.len(), 4);
        assert_eq!(t[1].mount_point, Path::new("/var/lib/kubelet/plugins/kubernetes.io/csi/pv/a b/globalmount"));
        assert_eq!((t[1].major, t[1].minor), (7, 3));
        assert_eq!(t[1].fs_type, "xfs");
        assert!(!t[1].read_only());
        assert!(t[2].read_only());
        assert_eq!(t[3].root, Path::new("/loop3"));
        assert_eq!(t[3].source, "udev");
        assert_eq!(mount_points_of(&t, 7, 3).len(), 2);
        assert_eq!(mounts_at(&t, Path::new("/var/lib/kubelet/pods/p1/volumes/v")).len(), 1);
        assert!(parse_mountinfo("garbage line\n").is_empty());
    }

    #[test]
    fn mount_flags_split_and_refuse() {
        let o = parse_mount_flags(&["noatime".into(), "ro".into(), "discard".into(), "data=ordered".into()]).unwrap();
        assert_eq!(o.flags, MsFlags::MS_NOATIME | MsFlags::MS_RDONLY);
        assert_eq!(o.data_string().as_deref(), Some("discard,data=ordered"));
        for bad in ["bind", "remount", "a,b", "", "x-systemd.foo", "has space"] {
            assert!(parse_mount_flags(&[bad.to_string()]).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn paths_stay_inside_the_root() {
        let root = std::env::temp_dir().join(format!("np-csi-paths-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("pods/p1")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("pods/evil")).unwrap();
        let r = root.to_str().unwrap();
        assert!(validate_path("target_path", &format!("{r}/pods/p1/vol"), &root).is_ok());
        assert!(validate_path("target_path", &format!("{r}/pods/p1/new/deeper"), &root).is_ok());
        for bad in [
            format!("{r}/pods/../../etc"),
            format!("{r}/pods/./p1"),
            "/etc/passwd".to_string(),
            "relative/path".to_string(),
            format!("{r}/pods/evil/x"),
            format!("{r}/pods/evil"),
            r.to_string(),
            format!("{r}-sibling/x"),
            format!("{r}/a\0b"),
            format!("{r}/{}", "x".repeat(5000)),
            format!("{r}/missing/{}/x", "y".repeat(256)),
        ] {
            assert!(validate_path("target_path", &bad, &root).is_err(), "{bad:?} accepted");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn beneath_refuses_symlinks_and_escapes() {
        let root = std::env::temp_dir().join(format!("np-csi-beneath-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("pods/p1/vol")).unwrap();
        std::os::unix::fs::symlink(root.join("pods/p1"), root.join("pods/link")).unwrap();
        let root = root.canonicalize().unwrap();
        let b = Beneath::open(&root, &root.join("pods/p1/vol")).unwrap();
        assert_eq!(std::fs::read_link(b.proc_path()).unwrap(), root.join("pods/p1/vol"));
        // A symlink anywhere on the way: refused, not followed.
        assert!(Beneath::open(&root, &root.join("pods/link/vol")).is_err());
        assert!(Beneath::open(&root, &root.join("pods/link")).is_err());
        // Not inside the root at all.
        assert!(Beneath::open(&root, Path::new("/etc")).is_err());
        assert!(Beneath::open(&root, &root.join("pods/../../etc")).is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape("a\\040b\\011c\\134d"), "a b\tc\\d");
        assert_eq!(unescape("tail\\04"), "tail\\04");
    }
}
