//! Files and sockets the way state must be written on a node: atomic replacement (with and
//! without fsync), the kernel's boot id, and Unix sockets for gRPC servers (0600, a stale
//! socket replaced, anything else refused).

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

/// Write `data` to `path` atomically without fsync: survives the writer's crash (the page
/// cache is the kernel's), not a power cut. Used for state that a reboot invalidates anyway.
pub fn atomic_write_nosync(path: &Path, data: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    // A failed write (a full disk) must not leave its partial temporary file behind.
    fs::write(&tmp, data).and_then(|()| fs::rename(&tmp, path)).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

/// The kernel's boot id (changes on every boot).
pub fn read_boot_id(path: &Path) -> io::Result<String> {
    Ok(fs::read_to_string(path)?.trim().to_string())
}

/// Bind a Unix socket for a gRPC server: parent directory created (0750), a stale socket
/// removed, the new one 0600 before anyone can be told about it.
pub fn bind_unix_socket(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    if let Some(dir) = path.parent() {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o750).create(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            std::fs::remove_file(path)?;
            tracing::info!(socket = %path.display(), "removed stale socket");
        }
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket; not removing it", path.display()),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = std::os::unix::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600))?;
    l.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(l)
}
