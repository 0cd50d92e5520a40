//! The device plane: the device file (`config`: classes, patterns, CDI), discovery and health
//! (`inventory`: matching device nodes, whether they work, NUMA), CDI specs (`cdi`), and the
//! kubelet device plugins serving them (`deviceplugin`: v1beta1 ListAndWatch, Allocate, the
//! manager's inotify loop), and the DRA kubelet plugin `dra.nodeplane.dev` (`dra`: prepare,
//! unprepare, health, over claim files in local mode). `inventory` and `cdi` know no kubelet
//! API: both allocators use them. It uses `sys`, `obs`, `rpc` and `kubelet`; never the agent or the other
//! planes.

use std::path::Path;
use std::time::Duration;

use tokio::sync::watch;

pub mod cdi;
pub mod config;
pub mod deviceplugin;
pub mod dra;
pub mod inventory;

/// Which socket file is at a path: a restarted kubelet (or a re-served plugin) binds a new
/// one, with a new inode or at least a new change time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SockId {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_ns: i64,
}

fn sock_id(p: &Path) -> Option<SockId> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let m = std::fs::symlink_metadata(p).ok()?;
    m.file_type().is_socket().then(|| SockId { dev: m.dev(), ino: m.ino(), ctime: m.ctime(), ctime_ns: m.ctime_nsec() })
}

/// Until `rx` turns true (the guard `wait_for` returns is not held across awaits).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Tell a server task to stop through `stop` and give it `grace` to end; abort it then.
/// `false`: it had to be aborted.
async fn stop_task<T>(stop: &watch::Sender<bool>, mut task: tokio::task::JoinHandle<T>, grace: Duration) -> bool {
    let _ = stop.send(true);
    let ended = tokio::time::timeout(grace, &mut task).await.is_ok();
    if !ended {
        task.abort();
    }
    ended
}
