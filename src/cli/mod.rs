//! The operator CLI's output (`src/bin/nodeplane.rs` parses the flags and makes the calls):
//! the agent's status and doctor reports as the JSON documents of `--json` (`document`) and
//! as the human summaries (`summary`); the JSON of the CSI volumes and snapshots that
//! `nodeplane csi` prints (`csi`).

pub mod csi;
pub mod document;
pub mod summary;

#[cfg(test)]
mod tests;
