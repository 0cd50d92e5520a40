//! The pod network plane: the CNI contract (`cni`: spec, versions, error codes, the
//! shim↔agent wire), the shim's logic (`shim`), the queue of DELs the shim could not deliver
//! (`pending_del`), per-node address blocks and leases (`ipam`), what ADD/DEL/CHECK/GC/STATUS
//! do to the kernel (`datapath`), veth teardown in the background (`reaper`), masquerade
//! (`masquerade`), cross-node routes (`routes`), NetworkPolicy enforcement (`policy`). It uses `sys` below it; it never imports the
//! agent, storage or devices.

pub mod cni;
pub mod datapath;
pub mod ipam;
pub mod masquerade;
pub mod pending_del;
pub mod policy;
pub mod reaper;
pub mod routes;
pub mod shim;
