//! nodeplane: one privileged per-node agent that is at once the node's CNI plugin, its CSI
//! node plugin and its kubelet device plugins; the thin CNI shim it is exec'd through; and
//! the cluster-side controller that owns cluster IPAM and volume placement.
//!
//! The tree is laid out by plane (see `ARCHITECTURE.md`). Imports only run downwards in
//! this list, and never in a cycle between rooms:
//!
//! - `agent`, `controller`: composition: configuration, start-up, serving, the cluster client.
//! - `cli`: the operator CLI's output: the agent's reports as JSON documents and summaries.
//! - `net` (pod network), `storage` (volumes), `devices` (device plugins): the planes. A plane
//!   never imports another plane.
//! - `kubelet`: kubelet's plugin registration, for any plane's plugin.
//! - `obs` (health, metrics, doctor findings), `rpc` (generated code, the gRPC front):
//!   shared by the planes.
//! - `sys`: kernel primitives without policy; `util`: small pure helpers.

pub mod agent;
pub mod cli;
pub mod controller;
pub mod devices;
pub mod kubelet;
pub mod net;
pub mod obs;
pub mod rpc;
pub mod storage;
pub mod sys;
pub mod util;
