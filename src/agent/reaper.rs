//! Deferred veth deletion.
//!
//! Deleting a veth costs the kernel an RCU grace period (16–20 ms here). DEL does not wait
//! for that: it takes the host end down, detaches it from the bridge (from that instant the
//! pod's old address is unreachable), renames it to a private graveyard name (so the
//! attachment's own name is free for a new ADD) and hands it to this thread, which deletes
//! graveyard links one after another. Graveyard links are plain kernel state, so after a
//! crash the next agent start finds and queues them again.

use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use crate::netlink::Netlink;

/// Graveyard names: "npz" + 12 hex digits.
pub const GRAVEYARD_PREFIX: &str = "npz";

enum Msg {
    Reap(String),
    Flush(SyncSender<()>),
}

pub struct Reaper {
    tx: Sender<Msg>,
    counter: AtomicU64,
    pending: std::sync::Arc<AtomicU64>,
    _thread: JoinHandle<()>,
}

pub fn is_graveyard_name(name: &str) -> bool {
    name.len() == 15 && name.starts_with(GRAVEYARD_PREFIX) && name[3..].bytes().all(|b| b.is_ascii_hexdigit())
}

impl Reaper {
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = channel();
        let pending = std::sync::Arc::new(AtomicU64::new(0));
        let p = pending.clone();
        let thread = std::thread::Builder::new().name("veth-reaper".into()).spawn(move || run(rx, p))?;
        let mut seed = [0u8; 8];
        crate::util::fill_random(&mut seed);
        Ok(Reaper {
            tx,
            counter: AtomicU64::new(u64::from_le_bytes(seed) & 0xffff_ffff_ffff),
            pending,
            _thread: thread,
        })
    }

    /// A fresh graveyard name.
    pub fn next_name(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff_ffff;
        format!("{GRAVEYARD_PREFIX}{n:012x}")
    }

    /// Queue a (down, detached, renamed) link for deletion.
    pub fn reap(&self, name: String) {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let _ = self.tx.send(Msg::Reap(name));
    }

    /// Wait until everything queued so far is deleted.
    pub fn flush(&self) {
        let (done_tx, done_rx) = sync_channel(1);
        if self.tx.send(Msg::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }

    pub fn pending(&self) -> u64 {
        self.pending.load(Ordering::Relaxed)
    }
}

fn run(rx: Receiver<Msg>, pending: std::sync::Arc<AtomicU64>) {
    let mut nl = None;
    while let Ok(msg) = rx.recv() {
        match msg {
            Msg::Flush(done) => {
                let _ = done.send(());
            }
            Msg::Reap(name) => {
                if nl.is_none() {
                    nl = Netlink::open().map_err(|e| tracing::error!(error = %e, "reaper netlink")).ok();
                }
                if let Some(nl) = nl.as_mut() {
                    match nl.link_by_name(&name) {
                        Ok(Some(link)) => {
                            if let Err(e) = nl.delete_link(link.index) {
                                if !e.is(libc::ENODEV) {
                                    tracing::warn!(link = %name, error = %e, "deleting graveyard veth");
                                }
                            }
                        }
                        Ok(None) => {}
                        Err(e) => tracing::warn!(link = %name, error = %e, "looking up graveyard veth"),
                    }
                }
                pending.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}
