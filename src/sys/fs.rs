//! Files and sockets the way state must be written on a node: atomic replacement (with and
//! without fsync), the kernel's boot id, and Unix sockets for gRPC servers (0600, a stale
//! socket replaced, anything else refused).

use std::fs;
use std::io;
use std::path::Path;

pub use nodeplane_cni::fsutil::{atomic_replace, atomic_write};

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
