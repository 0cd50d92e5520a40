//! The volume plane: the node-local volume store (`store`: sparse images, loop
//! attachments, capacity), filesystems on them (`fs`: mkfs, probe, grow), the CSI
//! Identity and Node services (`csi`), and the agent's own volume API (`node_api`,
//! `nodeplane.node.v1.NodeVolumes`). It uses `sys`, `obs`, `rpc` and `kubelet`; it never
//! imports the agent, the network or devices.

pub mod csi;
pub mod fs;
pub mod node_api;
pub mod store;
