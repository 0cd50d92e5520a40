//! File descriptors passed over Unix stream sockets (`SCM_RIGHTS`).
//!
//! The sender attaches the descriptor to the first bytes it sends; the receiver collects
//! whatever descriptors arrive with the bytes it reads (received close-on-exec). A
//! descriptor the receiver does not take is closed when the returned `OwnedFd` drops.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, recvmsg, sendmsg};

/// At most this many descriptors are accepted with one read; more are closed and refused.
pub const MAX_FDS: usize = 4;

/// Send all of `data` on the stream socket `sock`, with `fd` (if any) attached to its first
/// bytes. Blocking.
pub fn send(sock: BorrowedFd<'_>, data: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut sent = 0;
    let raw = fd.map(|f| [f.as_raw_fd()]);
    while sent < data.len() {
        let iov = [IoSlice::new(&data[sent..])];
        let cmsgs: Vec<ControlMessage<'_>> = match (&raw, sent) {
            (Some(r), 0) => vec![ControlMessage::ScmRights(r)],
            _ => Vec::new(),
        };
        match sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "sendmsg sent nothing")),
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(io::Error::from(e)),
        }
    }
    Ok(())
}

/// One `recvmsg` on `sock` into `buf`; descriptors that came with the bytes are appended to
/// `fds`. Returns the bytes read (0: the peer closed). On a non-blocking socket with
/// nothing to read: `WouldBlock`. More than [`MAX_FDS`] descriptors in all: an error (every
/// one received is closed).
pub fn recv(sock: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let (n, got, truncated) = loop {
        match recvmsg::<UnixAddr>(sock.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut got = Vec::new();
                for c in msg.cmsgs().map_err(io::Error::from)? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        // SAFETY: the kernel just installed these descriptors in this
                        // process for us; nothing else owns them.
                        got.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
                    }
                }
                break (msg.bytes, got, msg.flags.contains(MsgFlags::MSG_CTRUNC));
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(io::Error::from(e)),
        }
    };
    fds.extend(got);
    if truncated || fds.len() > MAX_FDS {
        fds.clear();
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("more than {MAX_FDS} descriptors sent")));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_descriptor_travels_with_the_first_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/ns/net").unwrap();
        send(a.as_fd(), b"hello world", Some(file.as_fd())).unwrap();
        send(a.as_fd(), b"!", None).unwrap();
        drop(a);
        let mut fds = Vec::new();
        let mut all = Vec::new();
        let mut buf = [0u8; 4];
        loop {
            let n = recv(b.as_fd(), &mut buf, &mut fds).unwrap();
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        assert_eq!(all, b"hello world!");
        assert_eq!(fds.len(), 1);
        use std::os::unix::fs::MetadataExt;
        let sent = file.metadata().unwrap().ino();
        let got = std::fs::File::from(fds.pop().unwrap()).metadata().unwrap().ino();
        assert_eq!(sent, got, "the same namespace arrived");
    }
}
