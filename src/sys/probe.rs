//! What the agent reads itself around `blkid -p` ([`super::fstools::probe_type`]): whether a
//! loop device's image holds any data at all (a new volume's sparse image: blank without
//! spawning blkid), and, when blkid names no signature, whether the regions where the
//! signatures lie hold any data.

use std::fs::File;
use std::io::{self, Seek};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

/// Bytes read from the start of the device: every signature at the start of a device lies
/// in them (the deepest, LUKS2's second header, at up to 1 MiB).
pub const HEAD: u64 = 2 << 20;
/// Bytes read from the end of the device (md raid 0.90 and 1.0 superblocks, ZFS labels).
pub const TAIL: u64 = 1 << 20;

/// The offset of the first non-zero byte of `dev` in its first [`HEAD`] and last [`TAIL`]
/// bytes (all of it when it is smaller); `None` when they are all zeros.
pub fn first_nonzero(dev: &Path) -> io::Result<Option<u64>> {
    let mut f = File::open(dev)?;
    // A block device's end is its size, as BLKGETSIZE64 would say; an image's is its length.
    let size = f.seek(io::SeekFrom::End(0))?;
    let head_len = size.min(HEAD);
    let tail_start = size.saturating_sub(TAIL).max(head_len);
    for (start, end) in [(0, head_len), (tail_start, size)] {
        let mut buf = vec![0u8; (end - start) as usize];
        f.read_exact_at(&mut buf, start)?;
        if let Some(i) = buf.iter().position(|&b| b != 0) {
            return Ok(Some(start + i as u64));
        }
    }
    Ok(None)
}

/// Whether `dev` is a loop device bound (at offset 0) to `image` and that file holds no data
/// at all — every byte of it a hole, so the device reads as zeros throughout. Dirty pages of
/// the device are written back first. Any doubt (not a loop device, `image` not the bound
/// file, a filesystem that cannot tell holes) is `false`.
pub fn loop_image_holds_no_data(dev: &Path, image: &Path) -> bool {
    let check = || -> io::Result<bool> {
        let f = File::open(dev)?;
        let info = super::loopdev::status(&f)?;
        let img = File::open(image)?;
        let md = img.metadata()?;
        if info.lo_offset != 0 || (md.dev(), md.ino()) != (info.lo_device, info.lo_inode) {
            return Ok(false);
        }
        // Pages written through the device and not yet written back to the file (a writer
        // that still holds the device open) would be invisible to SEEK_DATA on the file:
        // write them back first. No device cache flush is asked for; with nothing dirty this
        // is a no-op.
        write_back(&f)?;
        // ENXIO (no data from 0 to the end) is `None`; a filesystem that cannot tell holes
        // (EINVAL) is an error, so `false`.
        Ok(super::imagecopy::seek(&img, 0, libc::SEEK_DATA)?.is_none())
    };
    check().unwrap_or(false)
}

/// [`loop_image_holds_no_data`] of the loop device `dev` and the file the kernel names as
/// bound to it.
pub fn loop_image_is_all_holes(dev: &Path) -> bool {
    let Ok(number) = super::loopdev::device_number(dev) else { return false };
    let sysfs = format!("/sys/block/loop{number}/loop/backing_file");
    super::loopdev::read_backing_file(Path::new(&sysfs)).is_some_and(|(img, _)| loop_image_holds_no_data(dev, &img))
}

/// Write back the dirty pages of the device `f` and wait for them (`sync_file_range`).
fn write_back(f: &File) -> io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: a syscall on a borrowed descriptor; no memory is passed.
    if unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The first non-zero byte of a sparse file of `size` bytes with `writes` in it.
    fn first_nonzero_with(size: u64, writes: &[(u64, &[u8])]) -> Option<u64> {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = crate::util::TestDir::new(&format!("probe-{n}"));
        let p = dir.0.join("img");
        let f = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&p).unwrap();
        f.set_len(size).unwrap();
        for (o, b) in writes {
            f.write_all_at(b, *o).unwrap();
        }
        first_nonzero(&p).unwrap()
    }

    #[test]
    fn blank_is_blank_at_any_size() {
        for size in [0, 512, 4096, MIB, 3 * MIB, 64 * MIB] {
            assert_eq!(first_nonzero_with(size, &[]), None, "{size}");
        }
    }

    #[test]
    fn any_data_in_the_probed_regions_is_found() {
        let size = 64 * MIB;
        assert_eq!(first_nonzero_with(size, &[(12345, b"x")]), Some(12345));
        assert_eq!(first_nonzero_with(size, &[(HEAD - 1, b"x")]), Some(HEAD - 1));
        assert_eq!(first_nonzero_with(size, &[(size - TAIL, b"x")]), Some(size - TAIL));
        assert_eq!(first_nonzero_with(size, &[(size - 1, b"x")]), Some(size - 1));
        // Beyond the regions: not read (documented).
        assert_eq!(first_nonzero_with(size, &[(HEAD + 4096, b"x")]), None);
        // Small devices: head and tail overlap, everything is read.
        assert_eq!(first_nonzero_with(HEAD + 10, &[(HEAD + 5, b"x")]), Some(HEAD + 5));
    }
}
