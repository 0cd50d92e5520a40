//! Network namespace handles.
//!
//! `setns` changes the calling *thread*. The agent never calls it on a thread that runs
//! anything else: [`netlink_in`] spawns a short-lived OS thread, enters the namespace there,
//! opens a netlink socket (which stays bound to that namespace for its whole life) and exits.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

use crate::sys::netlink::Netlink;

const NSFS_MAGIC: i64 = 0x6e73_6673;

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

/// An open network namespace (a file descriptor on nsfs).
pub struct Netns {
    file: File,
    path: PathBuf,
}

impl Netns {
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = File::open(path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => NetnsError::NotFound(path.to_path_buf()),
            _ => NetnsError::Io { path: path.to_path_buf(), source: e },
        })?;
        Self::from_file(file, path)
    }

    /// A namespace opened by someone else (the shim, in the runtime's mount and PID
    /// namespaces) and handed over as a descriptor; `path` is what they opened, for messages
    /// only: it is never resolved here.
    pub fn from_fd(fd: std::os::fd::OwnedFd, path: &Path) -> Result<Self, NetnsError> {
        Self::from_file(File::from(fd), path)
    }

    fn from_file(file: File, path: &Path) -> Result<Self, NetnsError> {
        check_netns(&file, path)?;
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

const NS_GET_NSTYPE: libc::c_ulong = 0xb703; // _IO(0xb7, 0x3)

/// Is `file` (opened from `path`) a network namespace? nsfs, and of type `CLONE_NEWNET`.
pub fn check_netns(file: &File, path: &Path) -> Result<(), NetnsError> {
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and a properly sized out-struct.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    if rc != 0 {
        return Err(NetnsError::Io { path: path.to_path_buf(), source: io::Error::last_os_error() });
    }
    if st.f_type as i64 != NSFS_MAGIC {
        return Err(NetnsError::NotNetns(path.to_path_buf()));
    }
    // Confirm it is a *network* namespace, not another kind.
    // SAFETY: NS_GET_NSTYPE takes no argument and returns the CLONE_NEW* flag.
    let ty = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE) };
    if ty >= 0 && ty != libc::CLONE_NEWNET {
        return Err(NetnsError::NotNetns(path.to_path_buf()));
    }
    Ok(())
}

/// Open a netlink socket bound to the namespace `fd`, without ever changing the namespace
/// of a thread that does anything else.
pub fn netlink_in(fd: BorrowedFd<'_>, path: &Path) -> Result<Netlink, NetnsError> {
    let raw = fd.as_raw_fd();
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: raw is a valid namespace fd for the duration of this scope.
            if unsafe { libc::setns(raw, libc::CLONE_NEWNET) } != 0 {
                return Err(NetnsError::Setns {
                    path: path.to_path_buf(),
                    source: io::Error::last_os_error(),
                });
            }
            Ok(Netlink::open()?)
        })
        .join()
        .unwrap_or_else(|_| {
            Err(NetnsError::Io { path: path.to_path_buf(), source: io::Error::other("thread panicked") })
        })
    })
}

/// Write a sysctl of the *calling process's* network namespace (e.g. forwarding).
pub fn write_sysctl(key: &str, value: &str) -> io::Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}
