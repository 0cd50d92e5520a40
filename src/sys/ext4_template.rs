//! ext4 made from a template: `mkfs.ext4` run once per device size on a sparse file, its
//! metadata then written onto each new blank device of that size, with a fresh identity.
//!
//! A fresh ext4 on an all-holes device is a few hundred KiB of metadata at fixed offsets
//! (superblocks, group descriptors, bitmaps, the first inodes, the root and lost+found
//! directories, the journal superblock); everything else reads as zeros, which the device
//! already does. `mkfs.ext4` computes and writes exactly that in 7–9 ms here, most of it
//! spent starting the tool and computing the layout; writing the same bytes from a file made
//! by the very same `mkfs.ext4` costs a fraction. The template is made with
//! `metadata_csum_seed`: every metadata checksum is then seeded from a field of the
//! superblock instead of the UUID, so the copy gets its own UUID and directory hash seed by
//! patching the superblocks alone (each with its own checksum recomputed), as
//! `tune2fs -U` does on such a filesystem.
//!
//! Templates are keyed by the device size and by everything that shapes `mkfs.ext4`'s
//! output (its version, `/etc/mke2fs.conf`, the options), written atomically and fsync'd
//! before they are renamed into place (a template is never half there), and kept in a
//! small directory, least recently used first out. A device is formatted this way only when
//! it reads as zeros throughout (the caller checks); the primary superblock goes last, after
//! a flush of everything else, so a crash mid-way leaves no ext4 signature behind (the
//! device then holds data without a signature and is never mistaken for a filesystem; the
//! caller formats it again with `mkfs.ext4`).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

/// What `mkfs.ext4` is asked for, on a template and so on the devices formatted from it.
/// `assume_storage_prezeroed` (e2fsprogs 1.47): the device reads as zeros, so neither the
/// inode tables nor the journal are written out, and the block groups say their inode
/// tables are zeroed — which they are — so the kernel runs no background inode-table
/// zeroing (`ext4lazyinit`) after the first mount. An older mkfs.ext4 refuses the option:
/// no template is made and the device gets `mkfs.ext4`'s defaults instead.
pub const MKFS_OPTIONS: &[&str] =
    &["-F", "-q", "-E", "assume_storage_prezeroed=1,nodiscard", "-O", "metadata_csum_seed"];
/// Templates kept at most (least recently used are removed first).
pub const KEEP: usize = 16;

const SB_OFFSET: u64 = 1024;
const SB_LEN: usize = 1024;
const S_MAGIC: usize = 0x38;
const EXT4_MAGIC: u16 = 0xEF53;
const S_WTIME: usize = 0x30;
const S_LASTCHECK: usize = 0x40;
const S_FEATURE_INCOMPAT: usize = 0x60;
const S_FEATURE_RO_COMPAT: usize = 0x64;
const S_UUID: usize = 0x68;
const S_HASH_SEED: usize = 0xEC;
const S_MKFS_TIME: usize = 0x108;
const S_CHECKSUM: usize = 0x3FC;
const INCOMPAT_CSUM_SEED: u32 = 0x2000;
const RO_COMPAT_METADATA_CSUM: u32 = 0x400;

/// The templates of one node, in one directory.
pub struct Templates {
    dir: PathBuf,
    /// One lock per size: a template is built once, however many ask at the same time.
    building: Mutex<HashMap<u64, Arc<Mutex<()>>>>,
    /// The key of this machine's mkfs.ext4 (version, configuration, options); computed once.
    key: std::sync::OnceLock<Option<String>>,
}

impl Templates {
    pub fn new(dir: PathBuf) -> Self {
        Templates { dir, building: Mutex::default(), key: std::sync::OnceLock::new() }
    }

    fn tool_key(&self) -> Option<&str> {
        self.key
            .get_or_init(|| {
                // `mke2fs -V` prints the version on stderr and exits 0.
                let out = Command::new("mkfs.ext4").arg("-V").stdin(Stdio::null()).output().ok()?;
                let mut parts: Vec<&[u8]> = vec![&out.stderr, &out.stdout];
                let conf = std::fs::read("/etc/mke2fs.conf").unwrap_or_default();
                parts.push(&conf);
                let opts = MKFS_OPTIONS.join(" ");
                parts.push(opts.as_bytes());
                Some(format!("{:016x}", crate::util::fnv1a(&parts)))
            })
            .as_deref()
    }

    /// The template file for devices of `size` bytes (it may not exist yet).
    fn path_for(&self, size: u64) -> Option<PathBuf> {
        Some(self.dir.join(format!("ext4-{size}-{}.img", self.tool_key()?)))
    }

    /// Make sure the template for `size` exists; returns its path. Builds it when missing
    /// (one `mkfs.ext4` on a sparse file), at most once at a time per size.
    pub fn prepare(&self, size: u64) -> io::Result<PathBuf> {
        let path = self.path_for(size).ok_or_else(|| io::Error::other("mkfs.ext4 -V did not run"))?;
        if path.exists() {
            return Ok(path);
        }
        let lock = self.building.lock().unwrap().entry(size).or_default().clone();
        let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
        if path.exists() {
            return Ok(path);
        }
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self.dir.join(format!(".{}.tmp{}", path.file_name().unwrap().to_string_lossy(), std::process::id()));
        let built = (|| -> io::Result<()> {
            let f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
            f.set_len(size)?;
            drop(f);
            let out = Command::new("mkfs.ext4").args(MKFS_OPTIONS).arg(&tmp).stdin(Stdio::null()).output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "mkfs.ext4 {} {} failed ({}): {}",
                    MKFS_OPTIONS.join(" "),
                    tmp.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            let f = File::open(&tmp)?;
            check_primary(&f)?;
            f.sync_all()?;
            Ok(())
        })();
        if let Err(e) = built {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &path)?;
        File::open(&self.dir)?.sync_all()?;
        self.evict(&path);
        tracing::info!(size, template = %path.display(), "ext4 template made");
        Ok(path)
    }

    /// Keep the [`KEEP`] most recently used templates (and this one).
    fn evict(&self, keep: &Path) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        let mut all: Vec<(std::time::SystemTime, PathBuf)> = rd
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("ext4-"))
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        all.sort_by(|a, b| b.0.cmp(&a.0));
        for (_, p) in all.into_iter().skip(KEEP) {
            if p != keep {
                let _ = std::fs::remove_file(p);
            }
        }
    }

    /// Format the block device `dev` (which must read as zeros throughout) with ext4 from the
    /// template of its size, building the template first when there is none.
    pub fn format(&self, dev: &Path) -> io::Result<()> {
        let out = OpenOptions::new().read(true).write(true).custom_flags(libc::O_EXCL).open(dev)?;
        let size = super::loopdev::device_size(dev)?;
        let path = self.prepare(size)?;
        let tpl = File::open(&path)?;
        if tpl.metadata()?.len() != size {
            return Err(io::Error::other(format!("template {} is not {size} bytes", path.display())));
        }
        check_primary(&tpl)?;
        let _ = tpl.set_modified(std::time::SystemTime::now());
        let identity = Identity::random();
        let mut primary = None;
        for (start, end) in super::probe::data_ranges(&tpl, 0, size)? {
            let mut buf = vec![0u8; (end - start) as usize];
            tpl.read_exact_at(&mut buf, start)?;
            identity.patch(&mut buf, start);
            // Everything but the block holding the primary superblock now; that block last.
            let (mut a, b) = (start, end);
            if a <= SB_OFFSET && SB_OFFSET < b {
                let block_end = (SB_OFFSET + SB_LEN as u64).min(b);
                primary = Some((SB_OFFSET, buf[(SB_OFFSET - a) as usize..(block_end - a) as usize].to_vec()));
                if a < SB_OFFSET {
                    out.write_all_at(&buf[..(SB_OFFSET - a) as usize], a)?;
                }
                let rest = (block_end - start) as usize;
                a = block_end;
                if a < b {
                    out.write_all_at(&buf[rest..], a)?;
                }
                continue;
            }
            out.write_all_at(&buf, a)?;
        }
        let (at, sb) = primary
            .ok_or_else(|| io::Error::other(format!("template {} has no primary superblock", path.display())))?;
        out.sync_data()?;
        crate::util::crash_point("mkfs-before-primary-superblock");
        out.write_all_at(&sb, at)?;
        out.sync_data()?;
        Ok(())
    }

    /// Is the loop device `dev` (bound to `image`) a copy of its size's template that was
    /// interrupted before its primary superblock was written? That is: the primary
    /// superblock's place reads as zeros, the image holds data only where the template does,
    /// and every KiB there either reads as zeros or equals the template's (superblocks
    /// compared without the fields a copy makes its own). Nothing else can look like that,
    /// so such a device holds no one's data and may be formatted again. No template for
    /// its size (or any doubt): `false`.
    pub fn is_interrupted_copy(&self, dev: &Path, image: &Path) -> io::Result<bool> {
        let d = File::open(dev)?;
        let size = super::loopdev::device_size(dev)?;
        let Some(path) = self.path_for(size).filter(|p| p.exists()) else { return Ok(false) };
        let tpl = File::open(&path)?;
        let img = File::open(image)?;
        let mut primary = vec![0u8; SB_LEN];
        d.read_exact_at(&mut primary, SB_OFFSET)?;
        if primary.iter().any(|&b| b != 0) {
            return Ok(false);
        }
        let ranges = super::probe::data_ranges(&tpl, 0, size)?;
        let inside = |a: u64, b: u64| ranges.iter().any(|&(s, e)| s <= a && b <= e);
        // The image's data, at page granularity (a hole is never smaller).
        for (a, b) in super::probe::data_ranges(&img, 0, size)? {
            if !inside(a - a % 4096, b.div_ceil(4096) * 4096) && !inside(a, b) {
                return Ok(false);
            }
        }
        for (start, end) in ranges {
            let mut want = vec![0u8; (end - start) as usize];
            let mut have = vec![0u8; want.len()];
            tpl.read_exact_at(&mut want, start)?;
            d.read_exact_at(&mut have, start)?;
            let mut at = 0usize;
            while at < want.len() {
                let n = (SB_LEN - ((start as usize + at) % SB_LEN)).min(want.len() - at);
                let (w, h) = (&mut want[at..at + n], &mut have[at..at + n]);
                if h.iter().all(|&b| b == 0) {
                    at += n;
                    continue;
                }
                if n == SB_LEN && is_superblock(w) {
                    mask_identity(w);
                    mask_identity(h);
                }
                if w != h {
                    return Ok(false);
                }
                at += n;
            }
        }
        Ok(true)
    }
}

/// Zero the fields a template copy makes its own, to compare superblocks without them.
fn mask_identity(sb: &mut [u8]) {
    for (at, len) in
        [(S_UUID, 16), (S_HASH_SEED, 16), (S_WTIME, 4), (S_LASTCHECK, 4), (S_MKFS_TIME, 4), (S_CHECKSUM, 4)]
    {
        sb[at..at + len].fill(0);
    }
}

/// What makes a filesystem made from a template its own.
struct Identity {
    uuid: [u8; 16],
    hash_seed: [u8; 16],
    now: u32,
}

impl Identity {
    fn random() -> Self {
        let mut uuid = [0u8; 16];
        crate::util::fill_random(&mut uuid);
        uuid[6] = (uuid[6] & 0x0f) | 0x40; // version 4
        uuid[8] = (uuid[8] & 0x3f) | 0x80; // RFC 4122 variant
        let mut hash_seed = [0u8; 16];
        crate::util::fill_random(&mut hash_seed);
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as u32).unwrap_or(0);
        Identity { uuid, hash_seed, now }
    }

    /// Patch every ext4 superblock (the primary and its backups) found in `buf`, which holds
    /// the bytes at `offset` of the device: they are at 1 KiB boundaries and carry their own
    /// checksum, which must verify before anything is touched.
    fn patch(&self, buf: &mut [u8], offset: u64) {
        let mut at = (SB_LEN as u64 - offset % SB_LEN as u64) % SB_LEN as u64;
        while at as usize + SB_LEN <= buf.len() {
            let sb = &mut buf[at as usize..at as usize + SB_LEN];
            if is_superblock(sb) {
                sb[S_UUID..S_UUID + 16].copy_from_slice(&self.uuid);
                sb[S_HASH_SEED..S_HASH_SEED + 16].copy_from_slice(&self.hash_seed);
                for field in [S_WTIME, S_LASTCHECK, S_MKFS_TIME] {
                    sb[field..field + 4].copy_from_slice(&self.now.to_le_bytes());
                }
                let sum = ext4_checksum(&sb[..S_CHECKSUM]);
                sb[S_CHECKSUM..].copy_from_slice(&sum.to_le_bytes());
            }
            at += SB_LEN as u64;
        }
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// An ext4 superblock with metadata checksums seeded apart from the UUID, its checksum right.
fn is_superblock(sb: &[u8]) -> bool {
    sb.len() == SB_LEN
        && u16::from_le_bytes([sb[S_MAGIC], sb[S_MAGIC + 1]]) == EXT4_MAGIC
        && le32(sb, S_FEATURE_RO_COMPAT) & RO_COMPAT_METADATA_CSUM != 0
        && le32(sb, S_FEATURE_INCOMPAT) & INCOMPAT_CSUM_SEED != 0
        && ext4_checksum(&sb[..S_CHECKSUM]) == le32(sb, S_CHECKSUM)
}

fn check_primary(f: &File) -> io::Result<()> {
    let mut sb = vec![0u8; SB_LEN];
    f.read_exact_at(&mut sb, SB_OFFSET)?;
    if is_superblock(&sb) {
        Ok(())
    } else {
        Err(io::Error::other("not an ext4 template with metadata_csum_seed (primary superblock)"))
    }
}

/// The checksum ext4 keeps in a superblock: CRC32C (Castagnoli) from an all-ones start,
/// without the final inversion (the kernel's `crc32c(~0, ...)`).
pub fn ext4_checksum(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
            }
            *e = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The standard CRC-32C of "123456789" is 0xE3069283; ext4 keeps it un-inverted.
        assert_eq!(!ext4_checksum(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn patch_touches_only_valid_superblocks_and_keeps_their_checksum_right() {
        let mut sb = vec![0u8; SB_LEN];
        sb[S_MAGIC..S_MAGIC + 2].copy_from_slice(&EXT4_MAGIC.to_le_bytes());
        sb[S_FEATURE_RO_COMPAT..S_FEATURE_RO_COMPAT + 4].copy_from_slice(&RO_COMPAT_METADATA_CSUM.to_le_bytes());
        sb[S_FEATURE_INCOMPAT..S_FEATURE_INCOMPAT + 4].copy_from_slice(&INCOMPAT_CSUM_SEED.to_le_bytes());
        let sum = ext4_checksum(&sb[..S_CHECKSUM]);
        sb[S_CHECKSUM..].copy_from_slice(&sum.to_le_bytes());
        assert!(is_superblock(&sb));
        // A buffer starting 512 bytes before a superblock, with a look-alike whose
        // checksum is wrong right after it.
        let mut buf = vec![0u8; 512];
        buf.extend_from_slice(&sb);
        let mut fake = sb.clone();
        fake[S_CHECKSUM] ^= 1;
        buf.extend_from_slice(&fake);
        let id = Identity::random();
        id.patch(&mut buf, 512);
        let patched = &buf[512..512 + SB_LEN];
        assert!(is_superblock(patched), "checksum recomputed");
        assert_eq!(&patched[S_UUID..S_UUID + 16], &id.uuid);
        assert_eq!(patched[S_UUID + 6] >> 4, 4, "a version 4 UUID");
        assert_eq!(&buf[512 + SB_LEN..], &fake[..], "a block whose checksum does not verify is left alone");
    }
}
