//! The JSON of `nodeplane csi <call>` for the CSI messages more than one call answers with.

use serde_json::{Value, json};

use crate::rpc::csi;
use crate::storage::csi::TOPOLOGY_KEY;

/// A volume: its id, size and context, the nodes its topology names, and what it was made
/// from (`null` for an empty volume).
pub fn volume(v: &csi::Volume) -> Value {
    json!({
        "volumeId": v.volume_id,
        "capacityBytes": v.capacity_bytes,
        "volumeContext": v.volume_context,
        "nodes": v.accessible_topology.iter().filter_map(|t| t.segments.get(TOPOLOGY_KEY)).collect::<Vec<_>>(),
        "contentSource": v.content_source.as_ref().and_then(|c| c.r#type.as_ref()).map(|t| match t {
            csi::volume_content_source::Type::Snapshot(s) => json!({"snapshot": s.snapshot_id}),
            csi::volume_content_source::Type::Volume(v) => json!({"volume": v.volume_id}),
        }),
    })
}

/// A snapshot; `creationTime` is in Unix seconds.
pub fn snapshot(s: &csi::Snapshot) -> Value {
    json!({
        "snapshotId": s.snapshot_id,
        "sourceVolumeId": s.source_volume_id,
        "sizeBytes": s.size_bytes,
        "readyToUse": s.ready_to_use,
        "creationTime": s.creation_time.as_ref().map(|t| t.seconds),
    })
}
