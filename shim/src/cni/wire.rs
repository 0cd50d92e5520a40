//! Shim <-> agent framing on the CNI socket: one request, one reply per connection.
//! Each frame is a 4-byte big-endian length followed by that many bytes of JSON.

use std::io::{self, Read};

use serde::{Deserialize, Serialize};

use super::Reply;
use super::request::Env;

/// Upper bound for one frame (a config is at most 1 MiB; leave room for the envelope).
pub const MAX_FRAME: usize = 4 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireRequest {
    pub env: Env,
    pub stdin: String,
}

pub fn encode<T: Serialize>(value: &T) -> io::Result<Vec<u8>> {
    let body = serde_json::to_vec(value).map_err(io::Error::other)?;
    if body.len() > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "frame too large"));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

pub fn decode_len(header: [u8; 4]) -> io::Result<usize> {
    let len = u32::from_be_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes exceeds limit")));
    }
    Ok(len)
}

/// Blocking exchange used by the shim: send `frame` (an [`encode`]d request; the shim encodes
/// before it connects, so the agent's thread, woken by the connection, finds the request
/// there) and read the reply. `netns`: the pod's network namespace, opened by the shim and
/// passed with the request (`SCM_RIGHTS`), so the agent never resolves the runtime's path in
/// its own mount and PID namespaces.
pub fn exchange(stream: &mut std::os::unix::net::UnixStream, frame: &[u8], netns: Option<std::os::fd::BorrowedFd<'_>>) -> io::Result<Reply> {
    use std::os::fd::AsFd;
    crate::fdpass::send(stream.as_fd(), frame, netns)?;
    wait_readable(stream)?;
    let mut header = [0u8; 4];
    stream.read_exact(&mut header)?;
    let mut body = vec![0u8; decode_len(header)?];
    stream.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Wait until the answer (or the connection's end) can be read, up to the stream's read
/// timeout (then `WouldBlock`, as a read would fail).
///
/// poll(2), not a blocking read: when the agent reads the request, the kernel frees the
/// request's memory on this socket's account and wakes whoever waits on the socket for
/// room to write, and a reader blocked in read(2) waits on the same queue, unfiltered. That
/// woke this process while the agent was starting its work, and the wake-up, marked as
/// synchronous, ran it on the agent's CPU (seen in `perf sched` traces of ADD). A poll for
/// input is woken only for input, the end or an error.
fn wait_readable(stream: &std::os::unix::net::UnixStream) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let deadline = stream.read_timeout()?.map(|d| std::time::Instant::now() + d);
    loop {
        let wait = match deadline {
            None => -1,
            Some(end) => {
                let left = end.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(io::Error::from_raw_os_error(libc::EAGAIN));
                }
                // Whole milliseconds, rounded up: never back before the deadline.
                left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            }
        };
        let mut pfd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll(2) on one pollfd we own, for the socket `stream` keeps open.
        match unsafe { libc::poll(&mut pfd, 1, wait) } {
            n if n > 0 => return Ok(()),
            // Timed out: the deadline above decides (a poll may end a little early).
            0 => {}
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::time::{Duration, Instant};

    #[test]
    fn waiting_for_the_answer_honours_the_read_timeout() {
        let (a, _b) = UnixStream::pair().unwrap();
        a.set_read_timeout(Some(Duration::from_millis(80))).unwrap();
        let t = Instant::now();
        let e = wait_readable(&a).expect_err("nothing was sent");
        assert!(t.elapsed() >= Duration::from_millis(80), "{:?}", t.elapsed());
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "as a timed-out read: {e}");
    }

    #[test]
    fn waiting_for_the_answer_ends_with_data_or_the_end() {
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        b.write_all(b"x").unwrap();
        wait_readable(&a).expect("data");
        let (c, d) = UnixStream::pair().unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        drop(d);
        let t = Instant::now();
        wait_readable(&c).expect("the end is readable");
        assert!(t.elapsed() < Duration::from_secs(1));
        // A reply framed and sent by the agent's side comes through exchange.
        let (mut e, f) = UnixStream::pair().unwrap();
        e.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let agent = std::thread::spawn(move || {
            let mut f = f;
            let mut got = [0u8; 3];
            std::io::Read::read_exact(&mut f, &mut got).unwrap();
            let reply = Reply { exit_code: 0, stdout: "{}".into() };
            f.write_all(&encode(&reply).unwrap()).unwrap();
            got
        });
        let r = exchange(&mut e, b"req", None).expect("exchange");
        assert_eq!((r.exit_code, r.stdout.as_str()), (0, "{}"));
        assert_eq!(&agent.join().unwrap(), b"req");
    }
}
