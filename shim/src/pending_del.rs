//! The pending-DEL queue: a DEL the shim could not deliver (no agent listening) is written
//! here, one file per attachment, and answered success, so pod deletion never blocks on the
//! agent. The agent drains the queue at start and every few seconds, and an ADD of the same
//! attachment applies its queued DEL first (the agent's `Datapath::add`). The file
//! name is a hash of the attachment; its content (the wire request) decides what it is.

use std::io;
use std::path::{Path, PathBuf};

use crate::cni::request::{self, Request};
use crate::cni::wire::WireRequest;

/// Where the shim queues when the network configuration names no `pendingDeleteDir`.
pub const DEFAULT_DIR: &str = "/var/lib/nodeplane/pending-del";

/// File name of the queued DEL of one attachment (same attachment, same file).
pub fn file_name(container_id: &str, ifname: &str) -> String {
    format!("del-{:016x}.json", crate::fnv1a(&[container_id.as_bytes(), ifname.as_bytes()]))
}

/// Durably queue a DEL for the agent.
pub fn queue(dir: &Path, req: &Request, wire: &WireRequest) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(file_name(&req.container_id, &req.ifname));
    let body = serde_json::to_vec(wire).map_err(io::Error::other)?;
    crate::fsutil::atomic_write(&path, &body, 0o600)?;
    Ok(path)
}

/// Whether `path` holds a DEL queued for this attachment.
pub fn is_del_of(path: &Path, container_id: &str, ifname: &str) -> bool {
    let Ok(bytes) = std::fs::read(path) else { return false };
    let Ok(w) = serde_json::from_slice::<WireRequest>(&bytes) else { return false };
    let get = |k: &str| w.env.get(k).map(String::as_str);
    get("CNI_COMMAND") == Some("DEL")
        && get("CNI_CONTAINERID") == Some(container_id)
        && get("CNI_IFNAME") == Some(ifname)
}

/// One file of the queue.
pub enum Entry {
    /// A valid DEL request.
    Del { path: PathBuf, req: Box<Request> },
    /// Unreadable, not a request, or not a DEL: to be discarded.
    Invalid { path: PathBuf, name: String },
}

/// The queue's files, parsed (files that are not queue entries are ignored).
pub fn entries(dir: &Path) -> Vec<Entry> {
    let Ok(read) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out = Vec::new();
    for entry in read.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("del-") && name.ends_with(".json")) {
            continue;
        }
        let parsed = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<WireRequest>(&b).ok())
            .and_then(|w| request::parse(&w.env, w.stdin.as_bytes()).ok());
        out.push(match parsed {
            Some(req) if req.command == crate::cni::Command::Del => Entry::Del { path, req: Box::new(req) },
            _ => Entry::Invalid { path, name },
        });
    }
    out
}
