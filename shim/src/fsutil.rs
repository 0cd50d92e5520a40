//! Atomic file replacement, shared by the shim (its queue of DELs) and the agent.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Write `data` to `path` atomically: a temp file in the same directory, fsync'd, renamed
/// over the target, directory fsync'd. A reader sees the old file or the new one, never part.
pub fn atomic_write(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    atomic_replace(path, data, mode)?;
    let dir = path.parent().ok_or_else(|| io::Error::other("path has no parent"))?;
    File::open(dir)?.sync_all()
}

/// [`atomic_write`] without the directory fsync: the content is durable before the name
/// points at it, the name itself only once the caller syncs the directory (several renames
/// in one directory then share one sync).
pub fn atomic_replace(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other("path has no parent"))?;
    let name = path.file_name().ok_or_else(|| io::Error::other("path has no file name"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    // Unique per call: two threads of one process may write the same file at once.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tmp_name.push(format!(".tmp{}.{seq}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = (|| {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        f.write_all(data)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}
