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
pub fn exchange(
    stream: &mut std::os::unix::net::UnixStream,
    frame: &[u8],
    netns: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<Reply> {
    use std::os::fd::AsFd;
    crate::fdpass::send(stream.as_fd(), frame, netns)?;
    let mut header = [0u8; 4];
    stream.read_exact(&mut header)?;
    let mut body = vec![0u8; decode_len(header)?];
    stream.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}
