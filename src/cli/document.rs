//! The JSON documents of `nodeplane status --json` and `nodeplane doctor --json`, from the
//! agent's typed reports (`nodeplane.node.v1`). Their shape is documented in
//! docs/operations.md and carries the report's `format` number; absent sections are `null`.

use crate::rpc::node as api;
use serde_json::{Value, json};

/// A proto enum value's name in the documents: its name after the enum's `prefix`, lower
/// case, without `_` (`PLUGIN_KIND_DEVICE_PLUGIN` → `deviceplugin`); UNSPECIFIED is `unknown`.
fn name(value: &str, prefix: &str) -> String {
    match value.strip_prefix(prefix).unwrap_or(value) {
        "UNSPECIFIED" => "unknown".into(),
        v => v.replace('_', "").to_lowercase(),
    }
}

/// `nodeplane status --json`: the agent's status report as its JSON document.
pub fn status(r: &api::StatusReport) -> Value {
    json!({
        "format": r.format,
        "node": r.node,
        "version": r.version,
        "pid": r.pid,
        "startedUnix": r.started_unix,
        "mode": name(r.mode().as_str_name(), "MODE_"),
        "conditions": r.conditions.iter().map(|c| json!({"name": c.name, "ready": c.ready, "detail": c.detail})).collect::<Vec<_>>(),
        "network": r.network.as_ref().map(network),
        "controller": r.controller.as_ref().map(|c| json!({
            "address": c.address,
            "connected": c.connected,
            "lastMessageUnix": c.last_message_unix,
            "lastMessageSecondsAgo": c.last_message_seconds_ago,
            "blocks": c.blocks.as_ref().map(|b| b.cidrs.clone()),
            "encryption": c.encryption,
            "wireguard": c.wireguard.as_ref().map(|w| json!({
                "publicKey": w.public_key,
                "listenPort": w.listen_port,
                "error": w.error,
                "peers": w.peers.iter().map(|p| json!({
                    "publicKey": p.public_key,
                    "endpoint": p.endpoint,
                    "allowedIps": p.allowed_ips,
                    "lastHandshakeUnix": p.last_handshake_unix,
                    "rxBytes": p.rx_bytes,
                    "txBytes": p.tx_bytes,
                })).collect::<Vec<_>>(),
            })),
        })),
        "storage": r.storage.as_ref().map(storage),
        "devicePlugins": r.device_plugins.as_ref().map(|d| d.plugins.iter().map(|p| json!({
            "resource": p.resource,
            "socket": p.socket,
            "devices": p.devices.iter().map(|d| json!({
                "id": d.id,
                "health": if d.healthy { "Healthy" } else { "Unhealthy" },
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>()),
        "kubelet": r.kubelet.as_ref().map(kubelet),
        "kernel": r.kernel.as_ref().map(|k| json!({
            "release": k.release,
            "features": k.features.iter().map(|f| json!({
                "name": f.name,
                "state": name(f.state().as_str_name(), "KERNEL_FEATURE_STATE_"),
                "required": f.required,
                "detail": f.detail,
            })).collect::<Vec<_>>(),
        })),
        "services": r.services.as_ref().map(|v| json!({
            "idle": (!v.idle.is_empty()).then_some(&v.idle),
            "revision": v.revision,
            "synced": v.synced,
            "streamConnected": v.stream_connected,
            "ports": v.ports.iter().map(|p| json!({
                "id": p.id, "port": p.port, "clusterIPs": p.cluster_ips, "externalIPs": p.external_ips,
                "nodePort": p.node_port, "endpoints": p.endpoints, "usable": p.usable, "local": p.local,
            })).collect::<Vec<_>>(),
        })),
    })
}

fn network(n: &api::NetworkStatus) -> Value {
    json!({
        "ready": n.ready,
        "bridge": n.bridge.as_ref().map(|b| json!({"name": b.name, "present": b.present, "up": b.up, "mac": b.mac})),
        "blocks": n.blocks.iter().map(|b| json!({
            "cidr": b.cidr,
            "gateway": b.gateway,
            "addresses": b.addresses,
            "allocated": b.allocated,
        })).collect::<Vec<_>>(),
        "attachments": n.attachments.iter().map(|a| json!({
            "containerId": a.container_id,
            "ifname": a.ifname,
            "pod": a.pod,
            "state": name(a.state().as_str_name(), "LEASE_STATE_"),
            "ips": a.ips,
            "netns": a.netns,
            "netnsPresent": a.netns_present,
            "hostIf": a.host_if,
            "hostIfPresent": a.host_if_present,
            "hostIfOnBridge": a.host_if_on_bridge,
        })).collect::<Vec<_>>(),
        "unleasedHostVeths": n.unleased_host_veths,
        "graveyardLinks": n.graveyard_links,
    })
}

fn storage(s: &api::StorageStatus) -> Value {
    json!({
        "ready": s.ready,
        "volumeDir": s.volume_dir,
        "capacityBytes": s.capacity_bytes,
        "provisionedBytes": s.provisioned_bytes,
        "availableBytes": s.available_bytes,
        "volumes": s.volumes.iter().map(|v| json!({
            "id": v.id,
            "name": v.name,
            "sizeBytes": v.size_bytes,
            "fsType": v.fs_type,
            "backingFile": v.backing_file,
            "backingFilePresent": v.backing_file_present,
            "loopDevices": v.loop_devices.iter().map(|l| json!({"device": l.device, "mountedAt": l.mounted_at})).collect::<Vec<_>>(),
            "staged": v.staged.as_ref().map(|st| json!({
                "path": st.path,
                "state": name(st.state().as_str_name(), "STAGE_STATE_"),
                "mounted": st.mounted,
            })),
            "published": v.published.iter().map(|p| json!({"path": p.path, "readOnly": p.read_only, "mounted": p.mounted})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

fn kubelet(k: &api::KubeletStatus) -> Value {
    json!({
        "graceSeconds": k.grace_seconds,
        "required": k.required,
        "plugins": k.plugins.iter().map(|p| json!({
            "name": p.name,
            "kind": name(p.kind().as_str_name(), "PLUGIN_KIND_"),
            "socket": p.socket,
            "state": name(p.state().as_str_name(), "REGISTRATION_STATE_"),
            "error": p.error,
            "sinceUnix": p.since_unix,
            "registeredUnix": p.registered_unix,
            "registrations": p.registrations,
            "overdue": p.overdue,
        })).collect::<Vec<_>>(),
    })
}

/// `nodeplane doctor --json`: the doctor's report as its JSON document.
pub fn doctor(d: &api::DoctorReport) -> Value {
    json!({
        "format": d.format,
        "node": d.node,
        "repair": d.repair,
        "findings": d.findings.iter().map(|f| {
            let mut v = json!({"kind": f.kind, "subject": f.subject, "detail": f.detail});
            if let Some(r) = &f.repair {
                let result = name(r.result().as_str_name(), "REPAIR_RESULT_");
                v["repair"] = json!({"result": result, "message": r.message});
            }
            v
        }).collect::<Vec<_>>(),
        "errors": d.errors,
    })
}

/// The exit status of `nodeplane doctor` from its document: 0 when every finding was
/// repaired and no check failed, 1 when findings or errors remain.
pub fn doctor_exit_code(d: &Value) -> i32 {
    let unresolved =
        d["findings"].as_array().map(|f| f.iter().filter(|f| f["repair"]["result"] != "done").count()).unwrap_or(0);
    let errors = d["errors"].as_array().map(|e| e.len()).unwrap_or(0);
    if unresolved + errors > 0 { 1 } else { 0 }
}
