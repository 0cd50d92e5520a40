//! Deferred, batched veth deletion.
//!
//! Deleting one veth costs the kernel an RCU grace period (16–20 ms here). DEL does not wait
//! for that: in one request it takes the host end down (the bridge disables the port: from
//! that instant the pod's old address is unreachable) and moves it into the graveyard link
//! group, then wakes this thread. The link keeps its name; an ADD that needs the name renames
//! it to a private graveyard name first. The thread waits until retirements stop coming for
//! a moment, then deletes the whole group with one request, so the kernel pays the grace
//! period once per batch instead of once per pod — and not in the middle of a burst of DELs,
//! whose own netlink requests would wait for the deletion's hold on the kernel's RTNL lock.
//! The graveyard is plain kernel state: after a crash the next start finds it again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender, channel, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::sys::net_kernel::{Links, NetKernel};

/// Graveyard names: "npz" + 12 hex digits.
pub const GRAVEYARD_PREFIX: &str = "npz";
/// Link group of retired links ("np" in ASCII).
pub const GRAVEYARD_GROUP: u32 = 0x6e70;
/// How long retirements must stop coming before the reaper deletes a batch...
const BATCH_IDLE: Duration = Duration::from_millis(20);
/// ...and the longest a retired link waits for that.
const BATCH_MAX: Duration = Duration::from_secs(1);

enum Msg {
    Reap,
    Flush(SyncSender<()>),
}

pub struct Reaper {
    tx: Sender<Msg>,
    counter: AtomicU64,
    _thread: JoinHandle<()>,
}

pub fn is_graveyard_name(name: &str) -> bool {
    name.len() == 15 && name.starts_with(GRAVEYARD_PREFIX) && name[3..].bytes().all(|b| b.is_ascii_hexdigit())
}

impl Reaper {
    /// Start the reaper thread; it deletes the graveyard of `kernel`'s own namespace.
    pub fn start(kernel: Arc<dyn NetKernel>) -> std::io::Result<Self> {
        let (tx, rx) = channel();
        let thread = std::thread::Builder::new().name("veth-reaper".into()).spawn(move || run(rx, kernel))?;
        let mut seed = [0u8; 8];
        crate::util::fill_random(&mut seed);
        Ok(Reaper { tx, counter: AtomicU64::new(u64::from_le_bytes(seed) & 0xffff_ffff_ffff), _thread: thread })
    }

    /// A fresh graveyard name.
    pub fn next_name(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff_ffff;
        format!("{GRAVEYARD_PREFIX}{n:012x}")
    }

    /// A link was moved into the graveyard group: delete it (with others) soon.
    pub fn reap(&self) {
        let _ = self.tx.send(Msg::Reap);
    }

    /// Delete the graveyard now and wait until it is done.
    pub fn flush(&self) {
        let (done_tx, done_rx) = sync_channel(1);
        if self.tx.send(Msg::Flush(done_tx)).is_ok() {
            let _ = done_rx.recv();
        }
    }
}

fn delete_graveyard(kernel: &dyn NetKernel, nl: &mut Option<Box<dyn Links>>) {
    if nl.is_none() {
        *nl = kernel.host().map_err(|e| tracing::error!(error = %e, "reaper netlink")).ok();
    }
    if let Some(n) = nl.as_mut()
        && let Err(e) = n.delete_group(GRAVEYARD_GROUP)
    {
        tracing::warn!(error = %e, "deleting graveyard veths");
        *nl = None;
    }
}

fn run(rx: Receiver<Msg>, kernel: Arc<dyn NetKernel>) {
    let mut nl = None;
    while let Ok(first) = rx.recv() {
        let mut waiters = Vec::new();
        let mut batch = 0u64;
        let mut msg = Some(first);
        let deadline = std::time::Instant::now() + BATCH_MAX;
        // Collect everything that arrives until the retirements pause (a flush ends it at once).
        loop {
            match msg.take() {
                Some(Msg::Reap) => batch += 1,
                Some(Msg::Flush(done)) => {
                    waiters.push(done);
                    break;
                }
                None => {}
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left.min(BATCH_IDLE)) {
                Ok(m) => msg = Some(m),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        // Everything queued so far is in the group already: one request deletes it all.
        delete_graveyard(&*kernel, &mut nl);
        tracing::debug!(batch, "reaped graveyard");
        for w in waiters {
            let _ = w.send(());
        }
    }
}
