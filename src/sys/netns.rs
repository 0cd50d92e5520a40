//! Network namespace handles.
//!
//! `setns` changes the calling *thread*. [`netlink_in`] enters a pod's namespace only for the
//! one `socket` call that opens a netlink socket there (bound to that namespace for its whole
//! life) and returns to the process's namespace at once — or aborts the process.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use crate::sys::netlink::Netlink;

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespace {0} does not exist")]
    NotFound(PathBuf),
    #[error("{0} is not a network namespace")]
    NotNetns(PathBuf),
    #[error("network namespace {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("entering network namespace {path}: {source}")]
    Setns { path: PathBuf, source: io::Error },
    #[error(transparent)]
    Netlink(#[from] crate::sys::netlink::NetlinkError),
}

impl From<nodeplane_cni::nsfs::NsfsError> for NetnsError {
    fn from(e: nodeplane_cni::nsfs::NsfsError) -> Self {
        use nodeplane_cni::nsfs::NsfsError as E;
        match e {
            E::NotFound(p) => NetnsError::NotFound(p),
            E::NotNetns(p) => NetnsError::NotNetns(p),
            E::Io { path, source } => NetnsError::Io { path, source },
        }
    }
}

/// An open network namespace (a file descriptor on nsfs).
pub struct Netns {
    file: File,
    path: PathBuf,
}

impl Netns {
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = nodeplane_cni::nsfs::open_netns(path)?;
        Ok(Netns { file, path: path.to_path_buf() })
    }

    /// A namespace opened by someone else (the shim, in the runtime's mount and PID
    /// namespaces) and handed over as a descriptor; `path` is what they opened, for messages
    /// only: it is never resolved here.
    pub fn from_fd(fd: std::os::fd::OwnedFd, path: &Path) -> Result<Self, NetnsError> {
        let file = File::from(fd);
        nodeplane_cni::nsfs::check_netns(&file, path)?;
        Ok(Netns { file, path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Inode number: identifies the namespace.
    pub fn inode(&self) -> io::Result<u64> {
        use std::os::unix::fs::MetadataExt;
        Ok(self.file.metadata()?.ino())
    }

    /// Open a netlink socket inside this namespace (on a throwaway thread).
    pub fn netlink(&self) -> Result<Netlink, NetnsError> {
        netlink_in(self.as_fd(), &self.path)
    }
}

impl AsFd for Netns {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// Open a netlink socket bound to the namespace `fd` (it stays bound to that namespace for its
/// whole life), entering the namespace on the calling thread only for the `socket` call and
/// going straight back: no other code runs on the thread in between, and nothing here
/// awaits. A thread that could not go back would run the process's later work in a pod's
/// namespace: the process aborts instead (the DaemonSet restarts it; leases and mounts
/// survive). (A thread started per call, or a hand-over to an opener thread, costs more than
/// all the rest of the work.)
pub fn netlink_in(fd: BorrowedFd<'_>, path: &Path) -> Result<Netlink, NetnsError> {
    let home = home_netns().map_err(|e| NetnsError::Io { path: PathBuf::from("/proc/self/ns/net"), source: e })?;
    // SAFETY: a valid namespace fd, borrowed for the call.
    if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(NetnsError::Setns { path: path.to_path_buf(), source: io::Error::last_os_error() });
    }
    let opened = Netlink::open();
    // SAFETY: the process's own namespace fd, open for the life of the process.
    if unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let e = io::Error::last_os_error();
        tracing::error!(error = %e, "could not return to the agent's network namespace after opening a socket in {}; aborting", path.display());
        std::process::abort();
    }
    Ok(opened?)
}

/// The process's own network namespace, opened once (every thread of the agent lives in it).
fn home_netns() -> io::Result<&'static File> {
    static HOME: std::sync::OnceLock<File> = std::sync::OnceLock::new();
    if let Some(f) = HOME.get() {
        return Ok(f);
    }
    let f = File::open("/proc/self/ns/net")?;
    Ok(HOME.get_or_init(|| f))
}

/// Write a sysctl of the *calling process's* network namespace (e.g. forwarding).
pub fn write_sysctl(key: &str, value: &str) -> io::Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}
