//! The device plane: the device file (`config`: classes, patterns, CDI), discovery and health
//! (`inventory`: matching device nodes, whether they work, NUMA), CDI specs (`cdi`), and the
//! kubelet device plugins serving them (`deviceplugin`: v1beta1 ListAndWatch, Allocate, the
//! manager's inotify loop), and the DRA kubelet plugin `dra.nodeplane.dev` (`dra`: prepare,
//! unprepare, health, over claim files in local mode). `inventory` and `cdi` know no kubelet
//! API: both allocators use them. It uses `sys`, `obs`, `rpc` and `kubelet`; never the agent or the other
//! planes.

pub mod cdi;
pub mod config;
pub mod deviceplugin;
pub mod dra;
pub mod inventory;
