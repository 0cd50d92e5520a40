//! nodeplane: one privileged per-node agent that is the node's CNI plugin (and, in later
//! milestones, its CSI node plugin and device plugins), plus the thin CNI shim.
//!
//! Module map: `cni` (the CNI contract), `shim` (the exec'd binary's logic), `agent`
//! (start-up, datapath, socket server), `ipam` (leases), `netlink` and `netns` (kernel).

pub mod agent;
pub mod cni;
pub mod controller;
pub mod csi;
pub mod deviceplugin;
pub mod ipam;
pub mod kubelet;
pub mod netlink;
pub mod netns;
pub mod obs;
pub mod routes;
pub mod rpc;
pub mod shim;
pub mod util;
pub mod volume;
