//! Point-in-time copies of volume images: a reflink (`FICLONE`) when the filesystem under
//! the images shares extents (xfs with reflink, btrfs), else a sparse copy that reads only
//! the allocated ranges (`SEEK_DATA`/`SEEK_HOLE`) and moves them in the kernel
//! (`copy_file_range`), so a 1 GiB image holding 100 MiB copies 100 MiB. And the filesystem
//! freeze (`FIFREEZE`/`FITHAW`) that makes a mounted filesystem's image consistent while it
//! is copied.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// How an image was copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// Extents shared with the source (no data moved).
    Reflink,
    /// The allocated ranges copied, holes kept.
    Sparse,
}

impl CopyMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            CopyMethod::Reflink => "reflink",
            CopyMethod::Sparse => "sparse-copy",
        }
    }
}

/// What [`copy_image`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    pub method: CopyMethod,
    /// Bytes of data moved (0 for a reflink).
    pub bytes_copied: u64,
}

// _IOW(0x94, 9, int)
const FICLONE: libc::c_ulong = 0x4004_9409;
// _IOWR('X', 119, int) and _IOWR('X', 120, int)
const FIFREEZE: libc::c_ulong = 0xC004_5877;
const FITHAW: libc::c_ulong = 0xC004_5878;

/// Whether `FICLONE` between files of this filesystem may work; `false` once it answered
/// that it cannot (then the sparse copy is the way).
fn reflink(src: &File, dst: &File) -> io::Result<bool> {
    // SAFETY: FICLONE takes the source descriptor as its argument; both fds are open.
    let r = unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE as _, src.as_raw_fd()) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // Not supported by this filesystem (or across filesystems): copy instead.
        Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EXDEV) | Some(libc::EINVAL) | Some(libc::ENOSYS) => {
            Ok(false)
        }
        _ => Err(e),
    }
}

/// `lseek`; `None` for ENXIO (no data, or hole, at or after `off`).
pub(crate) fn seek(f: &File, off: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    // SAFETY: lseek on our own descriptor.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off as libc::off_t, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    Ok(Some(r as u64))
}

/// How a copy may be made.
#[derive(Debug, Clone, Copy, Default)]
pub struct CopyLimits {
    /// Only a reflink will do (the source may be written meanwhile: only a reflink is a
    /// point-in-time copy then). Otherwise [`io::ErrorKind::Unsupported`].
    pub reflink_only: bool,
    /// Give up (`io::ErrorKind::TimedOut`) when the copy is not done by then (a frozen
    /// filesystem is not held longer).
    pub deadline: Option<std::time::Instant>,
}

/// `pread`/`pwrite` for one range, when `copy_file_range` cannot (across some mounts, old
/// kernels, some filesystems).
fn copy_range_rw(src: &File, dst: &File, mut off: u64, end: u64) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0;
    while off < end {
        let want = ((end - off) as usize).min(buf.len());
        let got = src.read_at(&mut buf[..want], off)?;
        if got == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source shrank while it was copied"));
        }
        dst.write_all_at(&buf[..got], off)?;
        off += got as u64;
        n += got as u64;
    }
    Ok(n)
}

/// Copy `len` bytes of `src`'s allocated ranges into the (empty) `dst`, keeping holes.
fn sparse_copy(src: &File, dst: &File, len: u64, deadline: Option<std::time::Instant>) -> io::Result<u64> {
    let mut copied = 0u64;
    let mut pos = 0u64;
    while pos < len {
        let Some(data) = seek(src, pos, libc::SEEK_DATA)? else { break };
        if data >= len {
            break;
        }
        let end = seek(src, data, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut off_in = data as libc::loff_t;
        let mut off_out = data as libc::loff_t;
        while (off_in as u64) < end {
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "the copy did not finish in time"));
            }
            // 64 MiB at a time, so the deadline is looked at often enough.
            let want = (end - off_in as u64).min(64 << 20) as usize;
            // SAFETY: both descriptors are open; the offsets are ours.
            let n =
                unsafe { libc::copy_file_range(src.as_raw_fd(), &mut off_in, dst.as_raw_fd(), &mut off_out, want, 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EXDEV) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) => {
                        copied += copy_range_rw(src, dst, off_in as u64, end)?;
                        break;
                    }
                    _ => return Err(e),
                }
            }
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "source shrank while it was copied"));
            }
            copied += n as u64;
        }
        pos = end;
    }
    Ok(copied)
}

/// Copy the first `len` bytes of the image `src` into the new, empty file `dst` and size it
/// to `len`: a reflink when the filesystem can, else a sparse copy. The caller syncs `dst`.
/// (On one filesystem that can reflink, the kernel's `copy_file_range` shares extents too,
/// so the two methods differ by the filesystem under the store, not by a choice here.)
pub fn copy_image(src: &File, dst: &File, len: u64, limits: CopyLimits) -> io::Result<CopyStats> {
    let src_len = src.metadata()?.len();
    // A reflink clones the whole file; a bigger copy is grown afterwards.
    if src_len <= len && reflink(src, dst)? {
        dst.set_len(len)?;
        return Ok(CopyStats { method: CopyMethod::Reflink, bytes_copied: 0 });
    }
    if limits.reflink_only {
        return Err(io::Error::new(io::ErrorKind::Unsupported, "the filesystem under the store cannot reflink"));
    }
    dst.set_len(0)?;
    let copied = sparse_copy(src, dst, len.min(src_len), limits.deadline)?;
    dst.set_len(len)?;
    Ok(CopyStats { method: CopyMethod::Sparse, bytes_copied: copied })
}

/// A frozen filesystem, thawed when dropped (also on every error path of the copy).
pub struct Frozen {
    dir: File,
    path: std::path::PathBuf,
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let Err(e) = thaw_fd(&self.dir) {
            tracing::error!(mount = %self.path.display(), error = %e, "could not thaw a frozen filesystem");
        }
    }
}

fn thaw_fd(dir: &File) -> io::Result<()> {
    // SAFETY: FITHAW on our own descriptor; the argument is ignored.
    if unsafe { libc::ioctl(dir.as_raw_fd(), FITHAW as _, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Freeze the filesystem mounted at `mount_point` (`FIFREEZE`: dirty data and the journal
/// written out, new writes blocked) until the returned guard is dropped.
pub fn freeze(mount_point: &Path) -> io::Result<Frozen> {
    let dir = File::open(mount_point)?;
    // SAFETY: FIFREEZE on our own descriptor; the argument is ignored.
    if unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE as _, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Frozen { dir, path: mount_point.to_path_buf() })
}

/// Thaw `mount_point` if it is frozen (after a crash while a snapshot held it). `Ok(false)`
/// when it was not frozen.
pub fn thaw(mount_point: &Path) -> io::Result<bool> {
    let dir = File::open(mount_point)?;
    match thaw_fd(&dir) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn sparse_copy_keeps_holes_and_data() {
        let t = crate::util::TestDir::new("imagecopy");
        let src_p = t.0.join("src.img");
        let src = File::options().read(true).write(true).create(true).truncate(true).open(&src_p).unwrap();
        src.set_len(64 << 20).unwrap();
        src.write_all_at(b"head", 0).unwrap();
        src.write_all_at(&vec![7u8; 1 << 20], 20 << 20).unwrap();
        src.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        let dst = File::options().read(true).write(true).create(true).truncate(true).open(t.0.join("dst.img")).unwrap();
        let st = copy_image(&src, &dst, 80 << 20, CopyLimits::default()).unwrap();
        if st.method == CopyMethod::Sparse {
            // A copy of the data only (holes are not read).
            assert!(st.bytes_copied >= (1 << 20) + 8 && st.bytes_copied < 8 << 20, "{st:?}");
        }
        assert_eq!(dst.metadata().unwrap().len(), 80 << 20);
        let mut b = [0u8; 4];
        dst.read_exact_at(&mut b, 0).unwrap();
        assert_eq!(&b, b"head");
        dst.read_exact_at(&mut b, (64 << 20) - 4).unwrap();
        assert_eq!(&b, b"tail");
        let mut mid = vec![0u8; 1 << 20];
        dst.read_exact_at(&mut mid, 20 << 20).unwrap();
        assert!(mid.iter().all(|&x| x == 7));
        use std::os::unix::fs::MetadataExt;
        assert!(dst.metadata().unwrap().blocks() * 512 < 8 << 20, "holes stay holes");
        // Ranges copied by pread/pwrite when copy_file_range cannot.
        let dst2 =
            File::options().read(true).write(true).create(true).truncate(true).open(t.0.join("dst2.img")).unwrap();
        dst2.set_len(64 << 20).unwrap();
        assert_eq!(copy_range_rw(&src, &dst2, 20 << 20, 21 << 20).unwrap(), 1 << 20);
        dst2.read_exact_at(&mut mid, 20 << 20).unwrap();
        assert!(mid.iter().all(|&x| x == 7));
        // A deadline already past stops a copy that has data to move.
        let dst3 =
            File::options().read(true).write(true).create(true).truncate(true).open(t.0.join("dst3.img")).unwrap();
        let past = Some(std::time::Instant::now());
        assert_eq!(sparse_copy(&src, &dst3, 64 << 20, past).unwrap_err().kind(), io::ErrorKind::TimedOut);
    }
}
