//! The pod network plane: the CNI contract (`cni`: spec, versions, error codes, the
//! shim↔agent wire), the shim's logic (`shim`), the queue of DELs the shim could not deliver
//! (`pending_del`) — these three live in the shim's crate (shim/, `nodeplane_cni`) and are
//! re-exported here — per-node address blocks and leases (`ipam`), what ADD/DEL/CHECK/GC/STATUS
//! do to the kernel (`datapath`), veth teardown in the background (`reaper`), masquerade
//! (`masquerade`), cross-node routes (`routes`), NetworkPolicy enforcement (`policy`), Services
//! without kube-proxy (`services`). It uses `sys` below it; it never imports the
//! agent, storage or devices.

pub use nodeplane_cni::cni;
pub mod datapath;
pub mod ipam;
pub mod masquerade;
pub use nodeplane_cni::pending_del;
pub mod policy;
pub mod reaper;
pub mod routes;
pub mod services;
pub mod wireguard;
pub use nodeplane_cni::shim;
