//! What a block device (or image file) holds, read in-process: the signatures `blkid -p`
//! would find before anything is formatted over them, without spawning it.
//!
//! Two regions are read: the first [`HEAD`] bytes and the last [`TAIL`] bytes of the device
//! (fewer when it is smaller). Every signature probed lies in them:
//!
//! | signature | where |
//! |---|---|
//! | ext2/3/4 (and an ext journal device, `jbd`) | magic `0xEF53` at 1024 + 0x38 |
//! | xfs | `XFSB` at 0 |
//! | btrfs | `_BHRfS_M` at 64 KiB + 0x40 |
//! | swap, swsuspend | `SWAPSPACE2` / `SWAP-SPACE` (and the hibernation magics) at page size − 10, pages 4 KiB … 64 KiB |
//! | LUKS 1 and 2 | `LUKS\xba\xbe` at 0; LUKS2's second header `SKUL\xba\xbe` at 16 KiB … 1 MiB |
//! | LVM2 PV | `LABELONE` … `LVM2 001` in one of the first four sectors |
//! | md raid | magic `0xa92b4efc`: 0.90 at the last 64 KiB-aligned 64 KiB, 1.0 at end − 8 KiB (4 KiB-aligned), 1.1 at 0, 1.2 at 4 KiB |
//! | bcache | its 16-byte magic at 4 KiB + 24 |
//! | iso9660, udf | `CD001` / `BEA01`, `NSR02`, `NSR03`, `TEA01` at 32 KiB + 1 (+ 2 KiB steps) |
//! | squashfs | `hsqs` / `sqsh` at 0 |
//! | vfat, ntfs, exfat | the boot sector's OEM name / FAT type strings |
//! | ZFS | uberblock magic `0x00bab10c` in any of the four labels (0, 256 KiB, end − 512 KiB, end − 256 KiB) |
//! | GPT, dos (MBR) partition tables | `EFI PART` at 512 or 4096; a valid MBR partition entry with `55 aa` at 510 |
//!
//! Conservative beyond the list: a device with any non-zero byte in those regions that
//! matches none of them is reported as [`Probe::Unknown`], so nothing that holds data is
//! ever formatted. A volume image the agent made is a sparse file of zeros until its first
//! mkfs, so a blank answer costs two reads of zeros.

use std::fs::File;
use std::io::{self, Seek};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Bytes read from the start of the device.
pub const HEAD: u64 = 2 << 20;
/// Bytes read from the end of the device.
pub const TAIL: u64 = 1 << 20;

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// Zeros in every region read: safe to format.
    Blank,
    /// One signature, named as blkid names its `TYPE` (`ext4`, `xfs`, `swap`,
    /// `crypto_LUKS`, `LVM2_member`, `linux_raid_member`, …); a bare partition table is
    /// `partition-table:dos` or `partition-table:gpt`.
    Found(String),
    /// Several filesystem-like signatures at once (blkid's "ambivalent" result).
    Ambiguous(Vec<String>),
    /// Non-zero data matching no known signature; the offset of the first non-zero byte.
    Unknown { offset: u64 },
}

/// Probe the device or image at `path`.
pub fn probe(path: &Path) -> io::Result<Probe> {
    let f = File::open(path)?;
    let size = size_of(&f)?;
    probe_file(&f, size)
}

/// Probe loop device `dev` whose backing file is `image`, reading through the device only
/// the parts of the probed regions where the image holds data (`SEEK_DATA`/`SEEK_HOLE`):
/// a hole of the file reads as zeros through the device, so a fresh sparse image costs no
/// read at all. Falls back to reading the regions whole when `image` is not the device's
/// file (inode and device compared with `LOOP_GET_STATUS64`), the binding has an offset, or
/// the filesystem cannot tell holes. Reads go through the device, so what the device's own
/// page cache holds is what is probed (dirty pages only exist while a writer holds the
/// device open; its last close writes them back to the file).
pub fn probe_loop(dev: &Path, image: &Path) -> io::Result<Probe> {
    use std::os::unix::fs::MetadataExt;
    let f = File::open(dev)?;
    let size = size_of(&f)?;
    let Ok(info) = super::loopdev::status(&f) else { return probe_file(&f, size) };
    let Ok(img) = File::open(image) else { return probe_file(&f, size) };
    let md = img.metadata()?;
    if (md.dev(), md.ino()) != (info.lo_device, info.lo_inode) || info.lo_offset != 0 {
        return probe_file(&f, size);
    }
    // Pages written through the device and not yet written back to the file (a writer that
    // still holds the device open) would be invisible to SEEK_DATA on the file: write them
    // back first. No device cache flush is asked for; with nothing dirty this is a no-op.
    write_back(&f)?;
    let head_len = size.min(HEAD);
    let tail_start = size.saturating_sub(TAIL).max(head_len);
    let head_data = data_ranges(&img, 0, head_len)?;
    let tail_data = data_ranges(&img, tail_start, size)?;
    if head_data.is_empty() && tail_data.is_empty() {
        return Ok(Probe::Blank); // holes only: zeros, which match no signature
    }
    let read = |start: u64, end: u64, ranges: Vec<(u64, u64)>| -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; (end - start) as usize];
        for (a, b) in ranges {
            let part = read_region(&f, a, b - a)?;
            buf[(a - start) as usize..(b - start) as usize].copy_from_slice(&part);
        }
        Ok(buf)
    };
    let r = Regions { size, head: read(0, head_len, head_data)?, tail_start, tail: read(tail_start, size, tail_data)? };
    Ok(classify(&r))
}

/// Whether `dev` is a loop device bound (at offset 0) to a file that holds no data at all —
/// every byte of it a hole, so the device reads as zeros throughout. Dirty pages of the
/// device are written back first. Any doubt (not a loop device, the file not found or not
/// the bound one, a filesystem that cannot tell holes) is `false`.
pub fn loop_image_is_all_holes(dev: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let check = || -> io::Result<bool> {
        let f = File::open(dev)?;
        let info = super::loopdev::status(&f)?;
        if info.lo_offset != 0 {
            return Ok(false);
        }
        write_back(&f)?;
        let number = super::loopdev::device_number(dev)?;
        let sysfs = format!("/sys/block/loop{number}/loop/backing_file");
        let (path, _) = super::loopdev::read_backing_file(Path::new(&sysfs)).ok_or(io::ErrorKind::NotFound)?;
        let img = File::open(path)?;
        let md = img.metadata()?;
        if (md.dev(), md.ino()) != (info.lo_device, info.lo_inode) {
            return Ok(false);
        }
        Ok(data_ranges(&img, 0, u64::MAX)?.is_empty())
    };
    check().unwrap_or(false)
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

/// The ranges of `[start, end)` where `f` holds data (the whole range when the filesystem
/// cannot say).
pub(crate) fn data_ranges(f: &File, start: u64, end: u64) -> io::Result<Vec<(u64, u64)>> {
    use super::imagecopy::seek;
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let data = match seek(f, at, libc::SEEK_DATA) {
            Ok(Some(d)) => d,
            Ok(None) => break, // no data from here to the end of the file
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(vec![(start, end)]),
            Err(e) => return Err(e),
        };
        if data >= end {
            break;
        }
        let hole = seek(f, data, libc::SEEK_HOLE)?.unwrap_or(end).min(end);
        out.push((data, hole));
        at = hole;
    }
    Ok(out)
}

/// A block device's end is its size, as BLKGETSIZE64 would say; an image's is its length.
fn size_of(mut f: &File) -> io::Result<u64> {
    f.seek(io::SeekFrom::End(0))
}

fn read_region(f: &File, offset: u64, len: u64) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len as usize];
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break, // past the end (a file shorter than its reported size): zeros
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(buf)
}

/// The device's bytes as far as the probe reads them: the head, and the tail when it does
/// not overlap the head.
struct Regions {
    size: u64,
    head: Vec<u8>,
    tail_start: u64,
    tail: Vec<u8>,
}

impl Regions {
    /// `len` bytes at absolute `offset`, when they lie wholly in a region read.
    fn at(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let end = offset.checked_add(len as u64)?;
        if end > self.size {
            return None;
        }
        if end <= self.head.len() as u64 {
            return Some(&self.head[offset as usize..end as usize]);
        }
        if offset >= self.tail_start && end <= self.tail_start + self.tail.len() as u64 {
            let o = (offset - self.tail_start) as usize;
            return Some(&self.tail[o..o + len]);
        }
        None
    }

    fn is(&self, offset: u64, magic: &[u8]) -> bool {
        self.at(offset, magic.len()) == Some(magic)
    }

    fn u16_le(&self, offset: u64) -> Option<u16> {
        self.at(offset, 2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32_le(&self, offset: u64) -> Option<u32> {
        self.at(offset, 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }

    fn first_nonzero(&self) -> Option<u64> {
        if let Some(i) = first_nonzero(&self.head) {
            return Some(i as u64);
        }
        first_nonzero(&self.tail).map(|i| self.tail_start + i as u64)
    }
}

/// The index of the first non-zero byte (whole 4 KiB blocks compared first).
fn first_nonzero(b: &[u8]) -> Option<usize> {
    const ZERO: [u8; 4096] = [0; 4096];
    let block = b.chunks(4096).position(|c| c != &ZERO[..c.len()])?;
    let start = block * 4096;
    b[start..].iter().position(|&x| x != 0).map(|i| start + i)
}

/// Probe an open device or image of `size` bytes.
pub fn probe_file(f: &File, size: u64) -> io::Result<Probe> {
    let head_len = size.min(HEAD);
    let tail_start = size.saturating_sub(TAIL).max(head_len);
    let r = Regions {
        size,
        head: read_region(f, 0, head_len)?,
        tail_start,
        tail: read_region(f, tail_start, size - tail_start)?,
    };
    Ok(classify(&r))
}

/// Probe bytes already in memory (the start of a device of exactly `bytes.len()` bytes).
pub fn probe_bytes(bytes: &[u8]) -> Probe {
    let size = bytes.len() as u64;
    let head_len = size.min(HEAD) as usize;
    let tail_start = (size.saturating_sub(TAIL) as usize).max(head_len);
    let r = Regions {
        size,
        head: bytes[..head_len].to_vec(),
        tail_start: tail_start as u64,
        tail: bytes[tail_start..].to_vec(),
    };
    classify(&r)
}

fn classify(r: &Regions) -> Probe {
    let mut found: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        if !found.iter().any(|f| f == t) {
            found.push(t.to_string());
        }
    };
    if let Some(t) = ext(r) {
        add(t);
    }
    if r.is(0, b"XFSB") {
        add("xfs");
    }
    if r.is(0x10040, b"_BHRfS_M") {
        add("btrfs");
    }
    if let Some(t) = swap(r) {
        add(t);
    }
    if r.is(0, b"LUKS\xba\xbe") || luks2_secondary(r) {
        add("crypto_LUKS");
    }
    if lvm2(r) {
        add("LVM2_member");
    }
    if mdraid(r) {
        add("linux_raid_member");
    }
    if r.is(4096 + 24, &BCACHE_MAGIC) {
        add("bcache");
    }
    if let Some(t) = optical(r) {
        add(t);
    }
    if r.is(0, b"hsqs") || r.is(0, b"sqsh") {
        add("squashfs");
    }
    if let Some(t) = dos_boot_sector_fs(r) {
        add(t);
    }
    if zfs(r) {
        add("zfs_member");
    }
    match found.len() {
        1 => return Probe::Found(found.pop().unwrap()),
        n if n > 1 => return Probe::Ambiguous(found),
        _ => {}
    }
    if r.is(512, b"EFI PART") || r.is(4096, b"EFI PART") {
        return Probe::Found("partition-table:gpt".into());
    }
    if mbr_partition_table(r) {
        return Probe::Found("partition-table:dos".into());
    }
    match r.first_nonzero() {
        Some(offset) => Probe::Unknown { offset },
        None => Probe::Blank,
    }
}

/// ext2/3/4 or an external ext journal, told apart by feature flags as blkid does.
fn ext(r: &Regions) -> Option<&'static str> {
    const SB: u64 = 1024;
    if r.u16_le(SB + 0x38)? != 0xEF53 {
        return None;
    }
    let compat = r.u32_le(SB + 0x5C)?;
    let incompat = r.u32_le(SB + 0x60)?;
    let ro_compat = r.u32_le(SB + 0x64)?;
    const COMPAT_HAS_JOURNAL: u32 = 0x4;
    const INCOMPAT_JOURNAL_DEV: u32 = 0x8;
    // What ext3 understands: FILETYPE, RECOVER, META_BG; SPARSE_SUPER, LARGE_FILE, BTREE_DIR.
    const EXT3_INCOMPAT: u32 = 0x2 | 0x4 | 0x10;
    const EXT3_RO_COMPAT: u32 = 0x1 | 0x2 | 0x4;
    Some(if incompat & INCOMPAT_JOURNAL_DEV != 0 {
        "jbd"
    } else if incompat & !EXT3_INCOMPAT != 0 || ro_compat & !EXT3_RO_COMPAT != 0 {
        "ext4"
    } else if compat & COMPAT_HAS_JOURNAL != 0 {
        "ext3"
    } else {
        "ext2"
    })
}

fn swap(r: &Regions) -> Option<&'static str> {
    for page in [4096u64, 8192, 16384, 32768, 65536] {
        let at = page - 10;
        if r.is(at, b"SWAPSPACE2") || r.is(at, b"SWAP-SPACE") {
            return Some("swap");
        }
        for m in [&b"S1SUSPEND"[..], b"S2SUSPEND", b"ULSUSPEND", b"LINHIB0001", b"\xed\xc3\x02\xe9\x98\x56\xe5\x0c"] {
            if r.is(at, m) {
                return Some("swsuspend");
            }
        }
    }
    None
}

fn luks2_secondary(r: &Regions) -> bool {
    [16u64, 32, 64, 128, 256, 512, 1024, 2048, 4096].iter().any(|k| r.is(k << 10, b"SKUL\xba\xbe"))
}

fn lvm2(r: &Regions) -> bool {
    (0..4u64).any(|s| r.is(s * 512, b"LABELONE") && r.is(s * 512 + 24, b"LVM2 001"))
}

const MD_MAGIC: u32 = 0xa92b_4efc;

fn mdraid(r: &Regions) -> bool {
    let magic_at = |o: u64| r.u32_le(o).is_some_and(|m| m == MD_MAGIC || m.swap_bytes() == MD_MAGIC);
    let sectors = r.size >> 9;
    // 0.90: the last 64 KiB-aligned 64 KiB block.
    let v090 = (sectors & !127).checked_sub(128).map(|s| s << 9);
    // 1.0: 8 KiB from the end, rounded down to 4 KiB.
    let v10 = sectors.checked_sub(16).map(|s| (s & !7) << 9);
    [v090, v10, Some(0), Some(4096)].into_iter().flatten().any(magic_at)
}

const BCACHE_MAGIC: [u8; 16] =
    [0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba, 0x6d, 0x81];

fn optical(r: &Regions) -> Option<&'static str> {
    // The volume recognition sequence starts at 32 KiB, one 2 KiB descriptor after another.
    let mut iso = false;
    for k in 0..16u64 {
        let at = 32768 + 2048 * k + 1;
        if r.is(at, b"CD001") {
            iso = true;
        }
        if [&b"BEA01"[..], b"NSR02", b"NSR03", b"TEA01"].iter().any(|m| r.is(at, m)) {
            return Some("udf");
        }
    }
    iso.then_some("iso9660")
}

/// A filesystem whose boot sector is at 0: FAT, NTFS or exFAT.
fn dos_boot_sector_fs(r: &Regions) -> Option<&'static str> {
    if r.is(3, b"NTFS    ") {
        return Some("ntfs");
    }
    if r.is(3, b"EXFAT   ") {
        return Some("exfat");
    }
    let fat_type = r.is(54, b"FAT12   ") || r.is(54, b"FAT16   ") || r.is(54, b"FAT     ") || r.is(82, b"FAT32   ");
    let oem = [&b"MSWIN"[..], b"MSDOS", b"mkdosfs", b"mkfs.fat", b"FRDOS"].iter().any(|m| r.is(3, m));
    // A FAT boot sector jumps over its BPB: EB xx 90 or E9 xx xx.
    let jump = r.at(0, 3).is_some_and(|b| (b[0] == 0xEB && b[2] == 0x90) || b[0] == 0xE9);
    (jump && (fat_type || oem)).then_some("vfat")
}

fn zfs(r: &Regions) -> bool {
    const LABEL: u64 = 256 << 10;
    const MAGIC: u64 = 0x00ba_b10c;
    let size = r.size & !(LABEL - 1);
    let labels = [Some(0), Some(LABEL), size.checked_sub(2 * LABEL), size.checked_sub(LABEL)];
    labels.into_iter().flatten().any(|l| {
        // The uberblock ring: the second half of the label, uberblocks of at least 1 KiB.
        (0..128u64).any(|k| {
            r.at(l + (128 << 10) + (k << 10), 8).is_some_and(|b| {
                let v = u64::from_le_bytes(b.try_into().unwrap());
                v == MAGIC || v.swap_bytes() == MAGIC
            })
        })
    })
}

/// A dos partition table: `55 aa` at 510, and partition entries that look like entries
/// (boot flag 0x00 or 0x80, at least one with a type).
fn mbr_partition_table(r: &Regions) -> bool {
    if !r.is(510, &[0x55, 0xAA]) {
        return false;
    }
    let Some(table) = r.at(446, 64) else { return false };
    let entries: Vec<&[u8]> = table.chunks(16).collect();
    entries.iter().all(|e| e[0] == 0 || e[0] == 0x80) && entries.iter().any(|e| e[4] != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A sparse file of `size` bytes with `writes` (offset, bytes) in it, probed.
    fn probe_with(size: u64, writes: &[(u64, &[u8])]) -> Probe {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = crate::util::TestDir::new(&format!("probe-{n}"));
        let p = dir.0.join("img");
        let f = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&p).unwrap();
        f.set_len(size).unwrap();
        for (o, b) in writes {
            f.write_all_at(b, *o).unwrap();
        }
        probe(&p).unwrap()
    }

    fn found(t: &str) -> Probe {
        Probe::Found(t.into())
    }

    fn ext_sb(compat: u32, incompat: u32, ro_compat: u32) -> Vec<u8> {
        let mut sb = vec![0u8; 1024];
        sb[0x38..0x3A].copy_from_slice(&0xEF53u16.to_le_bytes());
        sb[0x5C..0x60].copy_from_slice(&compat.to_le_bytes());
        sb[0x60..0x64].copy_from_slice(&incompat.to_le_bytes());
        sb[0x64..0x68].copy_from_slice(&ro_compat.to_le_bytes());
        sb
    }

    #[test]
    fn blank_is_blank_at_any_size() {
        for size in [0, 512, 4096, MIB, 3 * MIB, 64 * MIB] {
            assert_eq!(probe_with(size, &[]), Probe::Blank, "{size}");
        }
    }

    #[test]
    fn ext_family() {
        let size = 64 * MIB;
        assert_eq!(probe_with(size, &[(1024, &ext_sb(0, 0, 0))]), found("ext2"));
        assert_eq!(probe_with(size, &[(1024, &ext_sb(0x4, 0x2, 0x1))]), found("ext3"));
        // What mkfs.ext4 sets: extents, 64bit, flex_bg; metadata_csum…
        assert_eq!(probe_with(size, &[(1024, &ext_sb(0x3c, 0x2c2, 0x46b))]), found("ext4"));
        assert_eq!(probe_with(size, &[(1024, &ext_sb(0, 0x8, 0))]), found("jbd"));
    }

    #[test]
    fn superblock_filesystems() {
        let size = 64 * MIB;
        assert_eq!(probe_with(size, &[(0, b"XFSB\0\0\x10\0")]), found("xfs"));
        assert_eq!(probe_with(size, &[(0x10040, b"_BHRfS_M")]), found("btrfs"));
        assert_eq!(probe_with(size, &[(0, b"hsqs")]), found("squashfs"));
        assert_eq!(probe_with(size, &[(0, b"sqsh")]), found("squashfs"));
        assert_eq!(probe_with(size, &[(32769, b"CD001")]), found("iso9660"));
        assert_eq!(probe_with(size, &[(32769, b"BEA01"), (34817, b"NSR02")]), found("udf"));
    }

    #[test]
    fn swap_at_every_page_size() {
        for page in [4096u64, 8192, 16384, 32768, 65536] {
            for magic in [&b"SWAPSPACE2"[..], b"SWAP-SPACE"] {
                assert_eq!(probe_with(64 * MIB, &[(page - 10, magic)]), found("swap"), "{page}");
            }
            assert_eq!(probe_with(64 * MIB, &[(page - 10, b"S1SUSPEND")]), found("swsuspend"));
        }
    }

    #[test]
    fn luks_one_and_two() {
        let mut v1 = b"LUKS\xba\xbe\x00\x01".to_vec();
        v1.resize(64, 0);
        assert_eq!(probe_with(64 * MIB, &[(0, &v1)]), found("crypto_LUKS"));
        let v2 = b"LUKS\xba\xbe\x00\x02";
        assert_eq!(probe_with(64 * MIB, &[(0, v2), (16384, b"SKUL\xba\xbe\x00\x02")]), found("crypto_LUKS"));
        // The primary header wiped, the secondary left.
        assert_eq!(probe_with(64 * MIB, &[(16384, b"SKUL\xba\xbe\x00\x02")]), found("crypto_LUKS"));
    }

    #[test]
    fn lvm2_label_in_any_of_the_first_four_sectors() {
        for s in 0..4u64 {
            let mut label = b"LABELONE".to_vec();
            label.extend_from_slice(&s.to_le_bytes());
            label.extend_from_slice(&[0; 8]);
            label.extend_from_slice(b"LVM2 001");
            assert_eq!(probe_with(64 * MIB, &[(s * 512, &label)]), found("LVM2_member"), "sector {s}");
        }
    }

    #[test]
    fn mdraid_every_superblock_version() {
        let magic = MD_MAGIC.to_le_bytes();
        // A size that is not a multiple of 64 KiB, to check the rounding.
        let size = 64 * MIB + 3 * 4096 + 512;
        let sectors = size >> 9;
        let v090 = ((sectors & !127) - 128) << 9;
        let v10 = ((sectors - 16) & !7) << 9;
        for (what, at) in [("0.90", v090), ("1.0", v10), ("1.1", 0), ("1.2", 4096)] {
            assert_eq!(probe_with(size, &[(at, &magic)]), found("linux_raid_member"), "{what} at {at}");
        }
        // 0.90 big-endian.
        assert_eq!(probe_with(size, &[(v090, &MD_MAGIC.to_be_bytes())]), found("linux_raid_member"));
    }

    #[test]
    fn bcache() {
        assert_eq!(probe_with(64 * MIB, &[(4096 + 24, &BCACHE_MAGIC)]), found("bcache"));
    }

    #[test]
    fn dos_boot_sector_filesystems() {
        let mut fat32 = vec![0u8; 512];
        fat32[0..3].copy_from_slice(&[0xEB, 0x58, 0x90]);
        fat32[3..11].copy_from_slice(b"mkfs.fat");
        fat32[82..90].copy_from_slice(b"FAT32   ");
        fat32[510..512].copy_from_slice(&[0x55, 0xAA]);
        assert_eq!(probe_with(64 * MIB, &[(0, &fat32)]), found("vfat"));
        let mut fat16 = vec![0u8; 512];
        fat16[0..3].copy_from_slice(&[0xEB, 0x3C, 0x90]);
        fat16[54..62].copy_from_slice(b"FAT16   ");
        fat16[510..512].copy_from_slice(&[0x55, 0xAA]);
        assert_eq!(probe_with(64 * MIB, &[(0, &fat16)]), found("vfat"));
        assert_eq!(probe_with(64 * MIB, &[(0, b"\xEB\x52\x90NTFS    ")]), found("ntfs"));
        assert_eq!(probe_with(64 * MIB, &[(0, b"\xEB\x76\x90EXFAT   ")]), found("exfat"));
    }

    #[test]
    fn zfs_in_any_label() {
        let size = 64 * MIB + 100 * 1024;
        let aligned = size & !((256 << 10) - 1);
        let magic = 0x00bab10cu64.to_le_bytes();
        for l in [0, 256 << 10, aligned - (512 << 10), aligned - (256 << 10)] {
            assert_eq!(probe_with(size, &[(l + (128 << 10) + 5 * 1024, &magic)]), found("zfs_member"), "label at {l}");
        }
    }

    #[test]
    fn partition_tables() {
        let mut mbr = vec![0u8; 512];
        mbr[446 + 4] = 0x83;
        mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        mbr[510] = 0x55;
        mbr[511] = 0xAA;
        assert_eq!(probe_with(64 * MIB, &[(0, &mbr)]), found("partition-table:dos"));
        let mut pmbr = mbr.clone();
        pmbr[446 + 4] = 0xEE;
        assert_eq!(probe_with(64 * MIB, &[(0, &pmbr), (512, b"EFI PART")]), found("partition-table:gpt"));
        assert_eq!(probe_with(64 * MIB, &[(4096, b"EFI PART")]), found("partition-table:gpt"));
        // A filesystem made over an old partition table is the filesystem.
        assert_eq!(probe_with(64 * MIB, &[(0, &mbr), (1024, &ext_sb(0x3c, 0x2c2, 0x46b))]), found("ext4"));
    }

    #[test]
    fn two_filesystems_are_ambiguous() {
        let got = probe_with(64 * MIB, &[(0, b"XFSB"), (1024, &ext_sb(0, 0, 0))]);
        assert_eq!(got, Probe::Ambiguous(vec!["ext2".into(), "xfs".into()]));
    }

    #[test]
    fn any_other_data_in_the_probed_regions_is_unknown() {
        let size = 64 * MIB;
        assert_eq!(probe_with(size, &[(12345, b"x")]), Probe::Unknown { offset: 12345 });
        assert_eq!(probe_with(size, &[(HEAD - 1, b"x")]), Probe::Unknown { offset: HEAD - 1 });
        assert_eq!(probe_with(size, &[(size - TAIL, b"x")]), Probe::Unknown { offset: size - TAIL });
        assert_eq!(probe_with(size, &[(size - 1, b"x")]), Probe::Unknown { offset: size - 1 });
        // 55 aa without a partition entry is no table, but it is data.
        assert_eq!(probe_with(size, &[(510, &[0x55, 0xAA])]), Probe::Unknown { offset: 510 });
        // Beyond the regions: not read (documented).
        assert_eq!(probe_with(size, &[(HEAD + 4096, b"x")]), Probe::Blank);
        // Small devices: head and tail overlap, everything is read.
        assert_eq!(probe_with(HEAD + 10, &[(HEAD + 5, b"x")]), Probe::Unknown { offset: HEAD + 5 });
    }

    #[test]
    fn data_ranges_skip_holes() {
        let dir = crate::util::TestDir::new("probe-ranges");
        let p = dir.0.join("img");
        let f = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&p).unwrap();
        f.set_len(64 * MIB).unwrap();
        assert_eq!(data_ranges(&f, 0, 64 * MIB).unwrap(), vec![]);
        f.write_all_at(b"x", 5 * MIB + 7).unwrap();
        let r = data_ranges(&f, 0, 64 * MIB).unwrap();
        // Either the filesystem reports holes (one small range around the byte) or it
        // cannot (the whole range): both cover the byte.
        assert!(r.iter().any(|&(a, b)| a <= 5 * MIB + 7 && 5 * MIB + 7 < b), "{r:?}");
        assert!(data_ranges(&f, 0, MIB).unwrap().iter().all(|&(a, b)| a < b && b <= MIB));
    }

    #[test]
    fn in_memory_probe_matches() {
        let mut b = vec![0u8; 4 * MIB as usize];
        assert_eq!(probe_bytes(&b), Probe::Blank);
        b[0..4].copy_from_slice(b"XFSB");
        assert_eq!(probe_bytes(&b), found("xfs"));
    }
}
