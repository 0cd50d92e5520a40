//! Loop devices through their ioctls (`linux/loop.h`), without `losetup`.
//!
//! Only the handful of calls the volume store needs: find the devices that a file backs
//! (sysfs `backing_file`, confirmed by the backing inode and device from
//! `LOOP_GET_STATUS64`), bind a file to a free device (`LOOP_CTL_GET_FREE` +
//! `LOOP_CONFIGURE`, falling back to `LOOP_SET_FD` + `LOOP_SET_STATUS64` on kernels before
//! 5.8), unbind one (`LOOP_CLR_FD`), and tell one that its file grew (`LOOP_SET_CAPACITY`).
//!
//! Nothing here ever touches a loop device the caller did not name or that is not bound to
//! the caller's file.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Seek};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LOOP_SET_FD: libc::c_ulong = 0x4C00;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

pub const LO_FLAGS_READ_ONLY: u32 = 1;
pub const LO_FLAGS_AUTOCLEAR: u32 = 4;

const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;
const LOOP_MAJOR: u64 = 7;

/// `struct loop_info64`
#[repr(C)]
#[derive(Clone, Copy)]
pub struct LoopInfo64 {
    pub lo_device: u64,
    pub lo_inode: u64,
    pub lo_rdevice: u64,
    pub lo_offset: u64,
    pub lo_sizelimit: u64,
    pub lo_number: u32,
    pub lo_encrypt_type: u32,
    pub lo_encrypt_key_size: u32,
    pub lo_flags: u32,
    pub lo_file_name: [u8; LO_NAME_SIZE],
    pub lo_crypt_name: [u8; LO_NAME_SIZE],
    pub lo_encrypt_key: [u8; LO_KEY_SIZE],
    pub lo_init: [u64; 2],
}

impl Default for LoopInfo64 {
    fn default() -> Self {
        // SAFETY: a plain C struct of integers and byte arrays: all zero is valid.
        unsafe { std::mem::zeroed() }
    }
}

/// `struct loop_config`
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

fn errno_result(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc) }
}

/// Attach context (what was being done, on which path) to an I/O error, keeping its kind.
fn ctx(op: &str, path: &Path) -> impl FnOnce(io::Error) -> io::Error {
    let msg = format!("{op} {}", path.display());
    move |e| io::Error::new(e.kind(), format!("{msg}: {e}"))
}

/// A bound loop device as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopBinding {
    /// `/dev/loopN`
    pub device: PathBuf,
    pub number: u32,
    /// The backing file's path as the kernel prints it now (it follows renames), without
    /// the ` (deleted)` suffix.
    pub backing_file: PathBuf,
    /// The backing file has been unlinked.
    pub deleted: bool,
    /// Bound read-only (`LO_FLAGS_READ_ONLY`). Filled in by [`find_backed_by`] from the
    /// device's status; [`bound_devices`] (a plain sysfs walk) leaves it false.
    pub read_only: bool,
}

/// Every bound loop device (one sysfs walk; unbound devices have no `loop/` directory).
pub fn bound_devices() -> io::Result<Vec<LoopBinding>> {
    bound_devices_in(Path::new("/sys/block"))
}

fn bound_devices_in(sys_block: &Path) -> io::Result<Vec<LoopBinding>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(sys_block) {
        Ok(e) => e,
        Err(e) => return Err(ctx("reading", sys_block)(e)),
    };
    for entry in entries {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some(number) = name.to_str().and_then(|n| n.strip_prefix("loop")).and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // Absent while unbound; a device can also be torn down between the walk and the read.
        let Some((backing_file, deleted)) = read_backing_file(&entry.path().join("loop/backing_file")) else {
            continue;
        };
        if backing_file.as_os_str().is_empty() {
            continue;
        }
        let device = PathBuf::from(format!("/dev/loop{number}"));
        out.push(LoopBinding { device, number, backing_file, deleted, read_only: false });
    }
    out.sort_by_key(|b| b.number);
    Ok(out)
}

/// A sysfs `loop/backing_file`: the path as the kernel prints it now, without the
/// ` (deleted)` suffix, and whether it had one. `None` when it cannot be read (unbound).
pub(crate) fn read_backing_file(sysfs: &Path) -> Option<(PathBuf, bool)> {
    let mut raw = fs::read(sysfs).ok()?;
    while raw.last() == Some(&b'\n') {
        raw.pop();
    }
    const DELETED: &[u8] = b" (deleted)";
    let deleted = raw.ends_with(DELETED);
    if deleted {
        raw.truncate(raw.len() - DELETED.len());
    }
    Some((PathBuf::from(OsString::from_vec(raw)), deleted))
}

/// Open `/dev/loopN`, creating the node from sysfs' major:minor when /dev lacks it (a /dev
/// that is not devtmpfs, as in some containers). Errors are the raw OS errors (callers tell
/// EBUSY, ENXIO and ENOENT apart); callers add the context.
fn open_device(number: u32, write: bool, excl: bool) -> io::Result<File> {
    let path = PathBuf::from(format!("/dev/loop{number}"));
    let mut opts = OpenOptions::new();
    opts.read(true).write(write);
    let mut flags = libc::O_CLOEXEC;
    if excl {
        flags |= libc::O_EXCL;
    }
    opts.custom_flags(flags);
    match opts.open(&path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            make_node(number, &path)?;
            opts.open(&path)
        }
        r => r,
    }
}

fn make_node(number: u32, path: &Path) -> io::Result<()> {
    let devno = fs::read_to_string(format!("/sys/block/loop{number}/dev"))
        .ok()
        .and_then(|s| {
            let (ma, mi) = s.trim().split_once(':')?;
            Some((ma.parse::<u64>().ok()?, mi.parse::<u64>().ok()?))
        })
        .unwrap_or((LOOP_MAJOR, number as u64));
    let dev = nix::sys::stat::makedev(devno.0, devno.1);
    match nix::sys::stat::mknod(
        path,
        nix::sys::stat::SFlag::S_IFBLK,
        nix::sys::stat::Mode::from_bits_truncate(0o660),
        dev,
    ) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => Ok(()),
        Err(e) => Err(io::Error::from(e)),
    }
}

/// `N` of `/dev/loopN`.
pub fn device_number(device: &Path) -> io::Result<u32> {
    device
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("loop"))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a loop device", device.display()))
        })
}

/// `LOOP_GET_STATUS64` on an open device.
pub fn status(dev: &File) -> io::Result<LoopInfo64> {
    let mut info = LoopInfo64::default();
    // SAFETY: the kernel fills a struct of exactly this layout.
    errno_result(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_GET_STATUS64 as _, &mut info as *mut LoopInfo64) })?;
    Ok(info)
}

/// Size of a block device in bytes: where its end is (what `BLKGETSIZE64` says).
pub fn device_size(device: &Path) -> io::Result<u64> {
    let mut f = File::open(device).map_err(ctx("opening", device))?;
    f.seek(io::SeekFrom::End(0)).map_err(ctx("seeking to the end of", device))
}

/// This process' view of which loop devices are bound to which file (`(st_dev, st_ino)` →
/// device numbers): seeded by one walk of every bound device, kept up to date by
/// [`attach`] and [`detach`], and walked again when a lookup finds nothing and the last
/// walk is older than [`RESCAN_AFTER`] (a binding another process made meanwhile). Every
/// device it names is confirmed with `LOOP_GET_STATUS64` before it is returned, so a stale
/// entry is dropped, never believed.
struct Known {
    walked: Option<Instant>,
    by_file: std::collections::BTreeMap<(u64, u64), std::collections::BTreeSet<u32>>,
}

static KNOWN: std::sync::Mutex<Known> =
    std::sync::Mutex::new(Known { walked: None, by_file: std::collections::BTreeMap::new() });

/// How old the last walk of every loop device may be before a lookup that finds nothing
/// walks them again.
pub const RESCAN_AFTER: Duration = Duration::from_secs(2);

fn known() -> std::sync::MutexGuard<'static, Known> {
    KNOWN.lock().unwrap_or_else(|p| p.into_inner())
}

/// Walk every bound loop device and record which file each is bound to.
fn walk(k: &mut Known) -> io::Result<()> {
    let mut by_file: std::collections::BTreeMap<(u64, u64), std::collections::BTreeSet<u32>> = Default::default();
    for b in bound_devices()? {
        let Ok(dev) = open_device(b.number, false, false) else { continue };
        if let Ok(info) = status(&dev) {
            by_file.entry((info.lo_device, info.lo_inode)).or_default().insert(b.number);
        }
    }
    k.by_file = by_file;
    k.walked = Some(Instant::now());
    Ok(())
}

/// The binding of device `number` as sysfs shows it, when it is bound to `(st_dev, st_ino)`
/// (`LOOP_GET_STATUS64` confirms). `Ok(None)`: unbound or bound to another file.
fn confirm(number: u32, st_dev: u64, st_ino: u64) -> io::Result<Option<LoopBinding>> {
    let device = PathBuf::from(format!("/dev/loop{number}"));
    let dev = match open_device(number, false, false) {
        Ok(d) => d,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO) | Some(libc::ENOENT)) => return Ok(None),
        Err(e) => return Err(ctx("opening", &device)(e)),
    };
    let info = match status(&dev) {
        Ok(info) if info.lo_inode == st_ino && info.lo_device == st_dev => info,
        Ok(_) => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(None),
        Err(e) => return Err(ctx("LOOP_GET_STATUS64 on", &device)(e)),
    };
    let sysfs = format!("/sys/block/loop{number}/loop/backing_file");
    let Some((backing_file, deleted)) = read_backing_file(Path::new(&sysfs)) else { return Ok(None) };
    let read_only = info.lo_flags & LO_FLAGS_READ_ONLY != 0;
    Ok(Some(LoopBinding { device, number, backing_file, deleted, read_only }))
}

/// The loop devices bound to the file `(st_dev, st_ino)`, whose canonical path is `path`.
///
/// From this process' view of the loop devices (see [`Known`]): the cost is that of the
/// devices bound to this file, not of every loop device on the node. Each candidate is
/// confirmed with `LOOP_GET_STATUS64` (the kernel's backing inode and device must be this
/// file's, so a file replaced under the same name never matches). When none is found and
/// the last walk is older than [`RESCAN_AFTER`], every device is walked again first.
pub fn find_backed_by(path: &Path, st_dev: u64, st_ino: u64) -> io::Result<Vec<LoopBinding>> {
    let _ = path;
    let mut k = known();
    if k.walked.is_none() {
        walk(&mut k)?;
    }
    let mut found = confirm_all(&mut k, st_dev, st_ino)?;
    if found.is_empty() && k.walked.is_none_or(|t| t.elapsed() > RESCAN_AFTER) {
        walk(&mut k)?;
        found = confirm_all(&mut k, st_dev, st_ino)?;
    }
    Ok(found)
}

fn confirm_all(k: &mut Known, st_dev: u64, st_ino: u64) -> io::Result<Vec<LoopBinding>> {
    let numbers: Vec<u32> = k.by_file.get(&(st_dev, st_ino)).map(|s| s.iter().copied().collect()).unwrap_or_default();
    let mut found = Vec::new();
    for n in numbers {
        match confirm(n, st_dev, st_ino)? {
            Some(b) => found.push(b),
            None => forget_for(k, (st_dev, st_ino), n),
        }
    }
    Ok(found)
}

/// Device `number` is bound to nothing the view names any more (it was just bound anew).
fn forget(k: &mut Known, number: u32) {
    k.by_file.retain(|_, set| {
        set.remove(&number);
        !set.is_empty()
    });
}

/// Device `number` is no longer bound to the file `key`. Only that pair is dropped: by the
/// time the caller found out, another thread may have bound the same (lowest free) number to
/// another file and recorded it, and that entry is true.
fn forget_for(k: &mut Known, key: (u64, u64), number: u32) {
    if let Some(set) = k.by_file.get_mut(&key) {
        set.remove(&number);
        if set.is_empty() {
            k.by_file.remove(&key);
        }
    }
}

/// How a file is bound to a device (never with auto-clear: see the store's module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct AttachOptions {
    pub read_only: bool,
}

/// The loop driver's control device, `/dev/loop-control`.
const CONTROL: &str = "/dev/loop-control";

fn open_control() -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(CONTROL)
        .map_err(ctx("opening", Path::new(CONTROL)))
}

/// The number of a free loop device (`LOOP_CTL_GET_FREE`: the kernel adds one if none is).
fn free_device(ctl: &File) -> io::Result<u32> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
    let n = errno_result(unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) })
        .map_err(ctx("LOOP_CTL_GET_FREE on", Path::new(CONTROL)))?;
    Ok(n as u32)
}

/// Bind `backing` (open read-write, or read-only for a read-only binding) to a free loop
/// device and return `/dev/loopN`. Races with other attachers (another process taking the
/// same free device between `LOOP_CTL_GET_FREE` and `LOOP_CONFIGURE`) are retried.
pub fn attach(backing: &File, name: &Path, opts: AttachOptions) -> io::Result<PathBuf> {
    let ctl = open_control()?;
    let mut info = LoopInfo64 { lo_flags: if opts.read_only { LO_FLAGS_READ_ONLY } else { 0 }, ..Default::default() };
    let bytes = name.as_os_str().as_encoded_bytes();
    let n = bytes.len().min(LO_NAME_SIZE - 1);
    info.lo_file_name[..n].copy_from_slice(&bytes[..n]);

    let deadline = Instant::now() + Duration::from_secs(10);
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let number = free_device(&ctl)?;
        let result = open_device(number, !opts.read_only, false).and_then(|dev| configure(&dev, backing, &info));
        match result {
            Ok(()) => {
                tracing::debug!(device = number, file = %name.display(), attempt, "loop device bound");
                if let Ok(md) = backing.metadata() {
                    let mut k = known();
                    forget(&mut k, number);
                    k.by_file.entry((md.dev(), md.ino())).or_default().insert(number);
                }
                return Ok(PathBuf::from(format!("/dev/loop{number}")));
            }
            // EBUSY: someone bound it first. ENXIO/ENOENT: it was removed meanwhile.
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::ENXIO) | Some(libc::ENOENT))
                    && Instant::now() < deadline =>
            {
                tracing::debug!(device = number, attempt, error = %e, "loop device taken meanwhile, retrying");
                std::thread::sleep(Duration::from_millis((attempt as u64).min(20)));
            }
            Err(e) => {
                return Err(io::Error::new(e.kind(), format!("binding /dev/loop{number} to {}: {e}", name.display())));
            }
        }
    }
}

/// Whether the loop driver knows `LOOP_CONFIGURE` (Linux 5.8): the ioctl with a bad file
/// descriptor on a free device answers EBADF where it exists and EINVAL or ENOTTY where it
/// does not; nothing is bound either way. Finds (or has the kernel add) a free device.
pub fn configure_supported() -> io::Result<bool> {
    let ctl = open_control()?;
    let number = free_device(&ctl)?;
    let dev =
        open_device(number, false, false).map_err(|e| ctx("opening", Path::new(&format!("/dev/loop{number}")))(e))?;
    let cfg = LoopConfig { fd: u32::MAX, block_size: 0, info: LoopInfo64::default(), reserved: [0; 8] };
    // SAFETY: LOOP_CONFIGURE reads one loop_config; its fd (-1) is refused before any change.
    match errno_result(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg as *const LoopConfig) }) {
        Err(e) if e.raw_os_error() == Some(libc::EBADF) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOTTY)) => Ok(false),
        Err(e) => {
            Err(io::Error::new(e.kind(), format!("LOOP_CONFIGURE with a bad descriptor on /dev/loop{number}: {e}")))
        }
        Ok(_) => Err(io::Error::other(format!("LOOP_CONFIGURE with a bad descriptor succeeded on /dev/loop{number}"))),
    }
}

fn configure(dev: &File, backing: &File, info: &LoopInfo64) -> io::Result<()> {
    let cfg = LoopConfig { fd: backing.as_raw_fd() as u32, block_size: 0, info: *info, reserved: [0; 8] };
    // SAFETY: LOOP_CONFIGURE reads one loop_config.
    match errno_result(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg as *const LoopConfig) }) {
        Ok(_) => Ok(()),
        // Kernels before 5.8: the two-step way. A crash between the steps leaves a bound
        // device without our flags, which the next attach finds and reuses.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOTTY)) => {
            // SAFETY: LOOP_SET_FD takes the backing fd by value.
            errno_result(unsafe {
                libc::ioctl(dev.as_raw_fd(), LOOP_SET_FD as _, backing.as_raw_fd() as libc::c_ulong)
            })?;
            // SAFETY: LOOP_SET_STATUS64 reads one loop_info64.
            let set = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_SET_STATUS64 as _, info as *const LoopInfo64) };
            if let Err(e) = errno_result(set) {
                // SAFETY: no argument.
                unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD as _, 0) };
                return Err(e);
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Why a detach did not happen.
#[derive(Debug)]
pub enum DetachError {
    /// The device is mounted or otherwise held (open O_EXCL refused, or another opener kept
    /// it bound after `LOOP_CLR_FD`); it is left bound exactly as it was.
    Busy(String),
    Io(io::Error),
}

/// Unbind `device` if it is still bound to the file `(st_dev, st_ino)`. Already unbound, or
/// bound to another file by now: nothing to do.
///
/// The device is opened with `O_EXCL`, which a mounted filesystem refuses, so a mounted
/// device is never detached; a claim on one that is not mounted is waited out for up to
/// [`CLAIM_WAIT`]. Newer kernels (and older ones when the device has other
/// openers) only mark the device for auto-clear on `LOOP_CLR_FD` and unbind it at last
/// close; when some other opener keeps it bound past a short wait, the mark is taken off
/// again and `Busy` is returned, so a detach either happens or changes nothing.
pub fn detach(device: &Path, st_dev: u64, st_ino: u64) -> Result<(), DetachError> {
    let number = device_number(device).map_err(DetachError::Io)?;
    // Bound to the file `(st_dev, st_ino)`, by the status of the open device `f`.
    let bound_to_file = |f: &File| match status(f) {
        Ok(info) => Ok(info.lo_inode == st_ino && info.lo_device == st_dev),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(false),
        Err(e) => Err(DetachError::Io(ctx("LOOP_GET_STATUS64 on", device)(e))),
    };
    let still_ours = || -> Result<bool, DetachError> {
        match open_device(number, false, false) {
            Ok(f) => bound_to_file(&f),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO) | Some(libc::ENOENT)) => Ok(false),
            Err(e) => Err(DetachError::Io(ctx("opening", device)(e))),
        }
    };
    if !still_ours()? {
        return Ok(());
    }
    let Some(dev) = open_exclusive(number, device, CLAIM_WAIT)? else { return Ok(()) };
    // Re-check on the exclusive fd: the device may have been cleared and rebound meanwhile.
    if !bound_to_file(&dev)? {
        return Ok(());
    }
    // SAFETY: LOOP_CLR_FD takes no argument.
    match errno_result(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD as _, 0) }) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(()),
        Err(e) => return Err(DetachError::Io(ctx("LOOP_CLR_FD on", device)(e))),
    }
    drop(dev); // last close of ours: the kernel unbinds here if nobody else holds it
    // Another opener (udev probing the device after its change event, typically) delays
    // the unbind until it closes: poll finely at first, then back off.
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut pause = Duration::from_micros(250);
    loop {
        let bound = fs::metadata(format!("/sys/block/loop{number}/loop/backing_file")).is_ok();
        if !bound || !still_ours()? {
            tracing::debug!(device = %device.display(), "loop device unbound");
            forget_for(&mut known(), (st_dev, st_ino), number);
            return Ok(());
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
    // Someone else still has it open: take the auto-clear mark off so it stays bound as it
    // was instead of vanishing under its user later.
    let restore = (|| -> io::Result<()> {
        let f = open_device(number, false, false)?;
        let mut info = status(&f)?;
        if info.lo_inode == st_ino && info.lo_device == st_dev && info.lo_flags & LO_FLAGS_AUTOCLEAR != 0 {
            info.lo_flags &= !LO_FLAGS_AUTOCLEAR;
            // SAFETY: LOOP_SET_STATUS64 reads one loop_info64.
            errno_result(unsafe { libc::ioctl(f.as_raw_fd(), LOOP_SET_STATUS64 as _, &info as *const LoopInfo64) })?;
        }
        Ok(())
    })();
    match restore {
        Ok(()) => Err(DetachError::Busy(format!("{} is open by another process", device.display()))),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO) | Some(libc::ENOENT)) => Ok(()),
        Err(e) => Err(DetachError::Busy(format!(
            "{} is open by another process; it will be detached when that closes it ({e})",
            device.display()
        ))),
    }
}

/// How long [`detach`] waits for an exclusive claim on a device that is not mounted to go.
/// In the VM lane Debian's 6.12 once refused the exclusive open of a loop device right after
/// `umount(2)` of its ext4 had returned (docs/tests.md); whoever held that claim, a
/// short-lived claim on an unmounted device must not fail kubelet's NodeUnstage. A claim
/// held longer (another tool's exclusive open) is still `Busy`.
pub const CLAIM_WAIT: Duration = Duration::from_secs(2);

/// Open `/dev/loop<number>` with `O_EXCL`. `None`: the device is gone. A mounted device (in
/// this mount namespace) is `Busy` at once; one that is claimed but not mounted is tried
/// again, backing off, until `wait` has passed.
fn open_exclusive(number: u32, device: &Path, wait: Duration) -> Result<Option<File>, DetachError> {
    let deadline = Instant::now() + wait;
    let mut pause = Duration::from_millis(1);
    let mut tries = 0u32;
    loop {
        tries += 1;
        match open_device(number, false, true) {
            Ok(f) => {
                if tries > 1 {
                    tracing::info!(device = %device.display(), tries, "exclusive claim released; detaching");
                }
                return Ok(Some(f));
            }
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                if mounted(number).map_err(DetachError::Io)? {
                    return Err(DetachError::Busy(format!("{} is mounted", device.display())));
                }
                if Instant::now() >= deadline {
                    return Err(DetachError::Busy(format!(
                        "{} is held exclusively by another opener (not mounted; waited {} ms)",
                        device.display(),
                        wait.as_millis()
                    )));
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENXIO) | Some(libc::ENOENT)) => return Ok(None),
            Err(e) => return Err(DetachError::Io(ctx("opening", device)(e))),
        }
    }
}

/// Whether `/dev/loop<number>` is mounted in this mount namespace (`/proc/self/mountinfo`,
/// by the device number sysfs gives).
fn mounted(number: u32) -> io::Result<bool> {
    let sys = format!("/sys/block/loop{number}/dev");
    let devno = match fs::read_to_string(&sys) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io::Error::new(e.kind(), format!("{sys}: {e}"))),
    };
    let info = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| io::Error::new(e.kind(), format!("/proc/self/mountinfo: {e}")))?;
    Ok(info.lines().any(|l| l.split(' ').nth(2) == Some(devno.as_str())))
}

/// Tell `device` that its backing file changed size (`LOOP_SET_CAPACITY`); returns the new
/// device size. Works while the device is mounted.
pub fn set_capacity(device: &Path) -> io::Result<u64> {
    let number = device_number(device)?;
    let f = open_device(number, false, false).map_err(ctx("opening", device))?;
    // SAFETY: LOOP_SET_CAPACITY takes no argument.
    errno_result(unsafe { libc::ioctl(f.as_raw_fd(), LOOP_SET_CAPACITY as _, 0) })
        .map_err(ctx("LOOP_SET_CAPACITY on", device))?;
    device_size(device)
}

/// Whether `path` is a block device node.
pub fn is_block_device(path: &Path) -> bool {
    fs::metadata(path).map(|m| m.file_type().is_block_device()).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Thread A detaches loop1 (file X); before it updates the view, thread B binds file Y,
    /// which the kernel gives the same lowest free number, and records it. A's update must
    /// not drop B's true entry (it did: a lookup of Y then found nothing for up to
    /// RESCAN_AFTER while the kernel had Y on loop1). Same for a lookup of X that finds
    /// loop1 no longer X's.
    #[test]
    fn a_stale_binding_is_dropped_for_its_own_file_only() {
        let (x, y) = ((1, 100), (1, 200));
        let mut k = Known { walked: None, by_file: Default::default() };
        k.by_file.entry(x).or_default().insert(1);
        // B's attach of Y on loop1: any other file's claim on 1 is stale, Y's is recorded.
        forget(&mut k, 1);
        k.by_file.entry(y).or_default().insert(1);
        // A's detach of X finishes.
        forget_for(&mut k, x, 1);
        assert_eq!(k.by_file.get(&y).map(|s| s.iter().copied().collect::<Vec<_>>()), Some(vec![1]));
        assert!(!k.by_file.contains_key(&x));
        // A lookup of X that finds 1 bound elsewhere drops only X's claim.
        k.by_file.entry(x).or_default().insert(1);
        forget_for(&mut k, x, 1);
        assert_eq!(k.by_file.get(&y).map(|s| s.len()), Some(1));
        assert!(!k.by_file.contains_key(&x));
    }

    #[test]
    fn sysfs_walk_parses_backing_files() {
        let dir = std::env::temp_dir().join(format!("np-loopsys-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for (n, content) in [(3, Some("/var/lib/x/a.img\n")), (11, Some("/v/b.img (deleted)\n")), (4, None)] {
            let d = dir.join(format!("loop{n}"));
            fs::create_dir_all(&d).unwrap();
            if let Some(c) = content {
                fs::create_dir_all(d.join("loop")).unwrap();
                fs::write(d.join("loop/backing_file"), c).unwrap();
            }
        }
        fs::create_dir_all(dir.join("vda")).unwrap();
        let got = bound_devices_in(&dir).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            got,
            vec![
                LoopBinding {
                    device: "/dev/loop3".into(),
                    number: 3,
                    backing_file: "/var/lib/x/a.img".into(),
                    deleted: false,
                    read_only: false,
                },
                LoopBinding {
                    device: "/dev/loop11".into(),
                    number: 11,
                    backing_file: "/v/b.img".into(),
                    deleted: true,
                    read_only: false,
                },
            ]
        );
    }

    #[test]
    fn device_numbers() {
        assert_eq!(device_number(Path::new("/dev/loop12")).unwrap(), 12);
        assert!(device_number(Path::new("/dev/sda")).is_err());
        assert!(device_number(Path::new("/dev/loop-control")).is_err());
    }
}
