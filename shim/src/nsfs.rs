//! Is an open file a network namespace? (The shim checks `CNI_NETNS` before passing it on;
//! the agent checks the descriptor it receives.)

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const NSFS_MAGIC: i64 = 0x6e73_6673;
const NS_GET_NSTYPE: libc::c_ulong = 0xb703; // _IO(0xb7, 0x3)

#[derive(Debug, thiserror::Error)]
pub enum NsfsError {
    #[error("network namespace {0} does not exist")]
    NotFound(PathBuf),
    #[error("{0} is not a network namespace")]
    NotNetns(PathBuf),
    #[error("network namespace {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Open `path` as a network namespace.
pub fn open_netns(path: &Path) -> Result<File, NsfsError> {
    let f = File::open(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => NsfsError::NotFound(path.to_path_buf()),
        _ => NsfsError::Io { path: path.to_path_buf(), source: e },
    })?;
    check_netns(&f, path)?;
    Ok(f)
}

/// Is `file` (opened from `path`) a network namespace? nsfs, and of type `CLONE_NEWNET`.
pub fn check_netns(file: &File, path: &Path) -> Result<(), NsfsError> {
    // SAFETY: statfs is plain data, for which all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and a properly sized out-struct.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    if rc != 0 {
        return Err(NsfsError::Io { path: path.to_path_buf(), source: io::Error::last_os_error() });
    }
    if st.f_type as i64 != NSFS_MAGIC {
        return Err(NsfsError::NotNetns(path.to_path_buf()));
    }
    // Confirm it is a *network* namespace, not another kind.
    // SAFETY: NS_GET_NSTYPE takes no argument and returns the CLONE_NEW* flag.
    let ty = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE) };
    if ty >= 0 && ty != libc::CLONE_NEWNET {
        return Err(NsfsError::NotNetns(path.to_path_buf()));
    }
    Ok(())
}
