//! Files and sockets the way state must be written on a node: atomic replacement (with and
//! without fsync), the kernel's boot id, and the Unix sockets every server listens on (CNI
//! and gRPC: made 0600, a stale socket replaced, anything else refused).

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

/// Bind a listening Unix socket at `path`, mode 0600, parent directory created (0750). A
/// stale socket is replaced; anything else at `path` is left alone and is an error.
///
/// The mode is set on the socket before `bind`, which makes its file with that mode: the
/// socket is never at `path` with another one, not even for a moment. (Bound under another
/// name and renamed into place, it would list under that name in `ss -xl` and
/// `/proc/net/unix`.)
pub fn bind_unix_listener(path: &Path) -> io::Result<std::os::unix::net::UnixListener> {
    use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
    if let Some(dir) = path.parent() {
        std::os::unix::fs::DirBuilderExt::mode(fs::DirBuilder::new().recursive(true), 0o750).create(dir)?;
    }
    match fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            fs::remove_file(path)?;
            tracing::info!(socket = %path.display(), "removed stale socket");
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket; not removing it", path.display()),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let fd = nix::sys::socket::socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    nix::sys::socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(path)?)?;
    nix::sys::socket::listen(&fd, Backlog::MAXCONN)?;
    Ok(std::os::unix::net::UnixListener::from(fd))
}

/// [`bind_unix_listener`] for a tokio server.
pub fn bind_unix_socket(path: &Path) -> io::Result<tokio::net::UnixListener> {
    let l = bind_unix_listener(path)?;
    l.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn a_socket_is_made_0600_in_a_0750_directory_and_replaces_only_a_socket() {
        let t = crate::util::TestDir::new("fs-bind");
        let d = &t.0;
        let path = d.join("run/x.sock");
        let stale = bind_unix_listener(&path).unwrap();
        assert_eq!((mode(&d.join("run")), mode(&path)), (0o750, 0o600));
        drop(stale);
        let _l = bind_unix_listener(&path).unwrap();
        std::os::unix::net::UnixStream::connect(&path).unwrap();

        let file = d.join("run/data");
        fs::write(&file, b"keep").unwrap();
        let e = bind_unix_listener(&file).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&file).unwrap(), b"keep");
    }

    /// A peer watching the path (kubelet's plugin watcher) never finds the socket there with
    /// another mode while sockets replace each other.
    #[test]
    fn a_watcher_never_sees_the_socket_with_another_mode() {
        let t = crate::util::TestDir::new("fs-watch");
        let path = t.0.join("x.sock");
        let (stop, seen) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
        let watcher = {
            let (path, stop, seen) = (path.clone(), stop.clone(), seen.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(m) = fs::symlink_metadata(&path)
                        && m.file_type().is_socket()
                    {
                        seen.lock().unwrap().push(m.permissions().mode() & 0o777);
                    }
                }
            })
        };
        for _ in 0..300 {
            drop(bind_unix_listener(&path).unwrap());
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        stop.store(true, Ordering::Relaxed);
        watcher.join().unwrap();
        let seen = seen.lock().unwrap();
        assert!(!seen.is_empty());
        let other: Vec<_> = seen.iter().filter(|m| **m != 0o600).collect();
        assert!(other.is_empty(), "{} of {} looks saw another mode, first {:o}", other.len(), seen.len(), other[0]);
    }
}
