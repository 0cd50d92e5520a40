//! Container Device Interface specs: what a container needs to use a resource's devices
//! (device nodes, plus the resource's environment and mounts), as the runtime reads them
//! from the CDI directory. Shared by every kubelet API that hands out devices.

use std::path::{Path, PathBuf};

use crate::devices::config::Resource;
use crate::devices::inventory::Node;

/// The CDI version of the specs written.
pub const CDI_VERSION: &str = "0.6.0";

/// Where a resource's spec lives in the CDI directory.
pub fn spec_path(cdi_dir: &Path, r: &Resource) -> PathBuf {
    cdi_dir.join(format!("nodeplane.dev-{}.json", r.name))
}

/// The CDI spec of `res` (when `cdi` is on): one device per node, the container edits the
/// resource adds (env, mounts) at the top level.
pub fn spec<'a>(res: &Resource, nodes: impl IntoIterator<Item = &'a Node>) -> serde_json::Value {
    let devices: Vec<serde_json::Value> = nodes
        .into_iter()
        .map(|n| {
            serde_json::json!({
                "name": n.name,
                "containerEdits": {"deviceNodes": [{"path": n.path, "hostPath": n.path, "permissions": res.permissions}]},
            })
        })
        .collect();
    let env: Vec<String> = res.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mounts: Vec<serde_json::Value> = res
        .mounts
        .iter()
        .map(|m| {
            serde_json::json!({
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": if m.read_only { vec!["ro", "bind"] } else { vec!["rw", "bind"] },
            })
        })
        .collect();
    serde_json::json!({
        "cdiVersion": CDI_VERSION,
        "kind": res.resource_name(),
        "devices": devices,
        "containerEdits": {"env": env, "mounts": mounts},
    })
}
