//! `nodeplane`: the operator's command line. `nodeplane csi …` is a CSI client for any
//! CSI socket (the controller's Identity + Controller, an agent's Identity + Node): what
//! the sidecars and kubelet would send, one call per invocation, JSON on stdout. A failed
//! call prints `{"code": "...", "message": "..."}` on stdout and exits 2.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use nodeplane::rpc::csi;
use nodeplane::rpc::csi::volume_capability::access_mode::Mode;
use nodeplane::rpc::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use serde_json::json;

#[derive(Parser)]
#[command(name = "nodeplane", version, about = "nodeplane operator tools")]
struct Args {
    #[command(subcommand)]
    cmd: Top,
}

#[derive(Subcommand)]
enum Top {
    /// Call a CSI endpoint.
    Csi {
        /// The CSI Unix socket.
        #[arg(long)]
        endpoint: PathBuf,
        #[command(subcommand)]
        call: Call,
    },
}

#[derive(Subcommand)]
enum Call {
    /// GetPluginInfo + GetPluginCapabilities + Probe.
    Identity,
    /// Controller: CreateVolume.
    CreateVolume {
        #[arg(long)]
        name: String,
        /// Required bytes (0: the plugin's default).
        #[arg(long, default_value_t = 0)]
        size: i64,
        #[arg(long, default_value_t = 0)]
        limit: i64,
        /// ext4, xfs, or "block".
        #[arg(long, default_value = "ext4")]
        fs: String,
        /// Requisite nodes (repeat).
        #[arg(long = "node")]
        nodes: Vec<String>,
        /// Preferred nodes, in order (repeat).
        #[arg(long = "prefer")]
        prefer: Vec<String>,
        #[arg(long, default_value = "SINGLE_NODE_WRITER")]
        mode: String,
        /// StorageClass parameters, KEY=VALUE (repeat), e.g. csi.storage.k8s.io/fstype=xfs.
        #[arg(long = "param")]
        params: Vec<String>,
    },
    /// Controller: DeleteVolume.
    DeleteVolume {
        #[arg(long)]
        id: String,
    },
    /// Controller: ControllerExpandVolume.
    ExpandVolume {
        #[arg(long)]
        id: String,
        #[arg(long)]
        size: i64,
    },
    /// Controller: ValidateVolumeCapabilities.
    Validate {
        #[arg(long)]
        id: String,
        #[arg(long, default_value = "")]
        fs: String,
        #[arg(long, default_value = "SINGLE_NODE_WRITER")]
        mode: String,
    },
    /// Controller: ControllerGetCapabilities.
    ControllerCaps,
    /// Controller: ListVolumes (one page).
    ListVolumes {
        #[arg(long, default_value_t = 0)]
        max: i32,
        #[arg(long, default_value = "")]
        token: String,
    },
    /// Controller: GetCapacity (of one node, or of all).
    Capacity {
        #[arg(long)]
        node: Option<String>,
    },
    /// Node: NodeGetInfo.
    NodeInfo,
    /// Node: NodeStageVolume.
    Stage {
        #[arg(long)]
        id: String,
        #[arg(long)]
        staging: String,
        /// ext4, xfs, "" (the volume's), or "block".
        #[arg(long, default_value = "")]
        fs: String,
        #[arg(long, default_value = "SINGLE_NODE_WRITER")]
        mode: String,
    },
    /// Node: NodeUnstageVolume.
    Unstage {
        #[arg(long)]
        id: String,
        #[arg(long)]
        staging: String,
    },
    /// Node: NodePublishVolume.
    Publish {
        #[arg(long)]
        id: String,
        #[arg(long)]
        staging: String,
        #[arg(long)]
        target: String,
        #[arg(long, default_value = "")]
        fs: String,
        #[arg(long)]
        readonly: bool,
        #[arg(long, default_value = "SINGLE_NODE_WRITER")]
        mode: String,
    },
    /// Node: NodeUnpublishVolume.
    Unpublish {
        #[arg(long)]
        id: String,
        #[arg(long)]
        target: String,
    },
    /// Node: NodeGetVolumeStats.
    Stats {
        #[arg(long)]
        id: String,
        #[arg(long)]
        path: String,
    },
    /// Node: NodeExpandVolume.
    NodeExpand {
        #[arg(long)]
        id: String,
        #[arg(long)]
        path: String,
        #[arg(long)]
        size: i64,
    },
}

fn capability(fs: &str, mode: &str) -> Result<csi::VolumeCapability, String> {
    let m = Mode::from_str_name(mode).ok_or_else(|| format!("unknown access mode {mode:?}"))?;
    Ok(csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: m as i32 }),
        access_type: Some(if fs == "block" {
            AccessType::Block(BlockVolume {})
        } else {
            AccessType::Mount(MountVolume { fs_type: fs.to_string(), ..Default::default() })
        }),
    })
}

fn topology(node: &str) -> csi::Topology {
    csi::Topology { segments: [(nodeplane::csi::TOPOLOGY_KEY.to_string(), node.to_string())].into_iter().collect() }
}

fn volume_json(v: &csi::Volume) -> serde_json::Value {
    json!({
        "volumeId": v.volume_id,
        "capacityBytes": v.capacity_bytes,
        "volumeContext": v.volume_context,
        "nodes": v.accessible_topology.iter().filter_map(|t| t.segments.get(nodeplane::csi::TOPOLOGY_KEY)).collect::<Vec<_>>(),
    })
}

async fn call(endpoint: PathBuf, c: Call) -> Result<serde_json::Value, tonic::Status> {
    let ch = nodeplane::rpc::connect_unix(&endpoint)
        .await
        .map_err(|e| tonic::Status::unavailable(format!("connecting to {}: {e}", endpoint.display())))?;
    let mut ctl = csi::controller_client::ControllerClient::new(ch.clone());
    let mut node = csi::node_client::NodeClient::new(ch.clone());
    let mut id = csi::identity_client::IdentityClient::new(ch);
    let bad = |e: String| tonic::Status::invalid_argument(e);
    Ok(match c {
        Call::Identity => {
            let info = id.get_plugin_info(csi::GetPluginInfoRequest {}).await?.into_inner();
            let caps = id.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}).await?.into_inner();
            let probe = id.probe(csi::ProbeRequest {}).await?.into_inner();
            json!({"name": info.name, "vendorVersion": info.vendor_version, "capabilities": format!("{:?}", caps.capabilities), "ready": probe.ready})
        }
        Call::CreateVolume { name, size, limit, fs, nodes, prefer, mode, params } => {
            let cap = capability(if fs == "block" { "block" } else { &fs }, &mode).map_err(bad)?;
            let mut parameters = std::collections::HashMap::new();
            for p in params {
                let (k, v) = p.split_once('=').ok_or_else(|| bad(format!("--param {p:?} is not KEY=VALUE")))?;
                parameters.insert(k.to_string(), v.to_string());
            }
            let req = csi::CreateVolumeRequest {
                name,
                capacity_range: Some(csi::CapacityRange { required_bytes: size, limit_bytes: limit }),
                volume_capabilities: vec![cap],
                parameters,
                accessibility_requirements: (!nodes.is_empty() || !prefer.is_empty()).then(|| csi::TopologyRequirement {
                    requisite: nodes.iter().map(|n| topology(n)).collect(),
                    preferred: prefer.iter().map(|n| topology(n)).collect(),
                }),
                ..Default::default()
            };
            let v = ctl.create_volume(req).await?.into_inner().volume.unwrap_or_default();
            volume_json(&v)
        }
        Call::DeleteVolume { id } => {
            ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id, ..Default::default() }).await?;
            json!({})
        }
        Call::ExpandVolume { id, size } => {
            let r = ctl
                .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: id,
                    capacity_range: Some(csi::CapacityRange { required_bytes: size, limit_bytes: 0 }),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({"capacityBytes": r.capacity_bytes, "nodeExpansionRequired": r.node_expansion_required})
        }
        Call::Validate { id, fs, mode } => {
            let r = ctl
                .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                    volume_id: id,
                    volume_capabilities: vec![capability(&fs, &mode).map_err(bad)?],
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({"confirmed": r.confirmed.is_some(), "message": r.message})
        }
        Call::ControllerCaps => {
            let r = ctl.controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {}).await?.into_inner();
            let names: Vec<String> = r
                .capabilities
                .iter()
                .filter_map(|c| match &c.r#type {
                    Some(csi::controller_service_capability::Type::Rpc(r)) => {
                        csi::controller_service_capability::rpc::Type::try_from(r.r#type).ok().map(|t| t.as_str_name().to_string())
                    }
                    None => None,
                })
                .collect();
            json!({"capabilities": names})
        }
        Call::ListVolumes { max, token } => {
            let r = ctl.list_volumes(csi::ListVolumesRequest { max_entries: max, starting_token: token }).await?.into_inner();
            let entries: Vec<_> = r
                .entries
                .iter()
                .map(|e| {
                    let mut v = volume_json(e.volume.as_ref().unwrap_or(&csi::Volume::default()));
                    if let Some(c) = e.status.as_ref().and_then(|s| s.volume_condition.as_ref()) {
                        v["abnormal"] = json!(c.abnormal);
                        v["message"] = json!(c.message);
                    }
                    v
                })
                .collect();
            json!({"entries": entries, "nextToken": r.next_token})
        }
        Call::Capacity { node } => {
            let r = ctl
                .get_capacity(csi::GetCapacityRequest { accessible_topology: node.as_deref().map(topology), ..Default::default() })
                .await?
                .into_inner();
            json!({"availableCapacity": r.available_capacity, "maximumVolumeSize": r.maximum_volume_size, "minimumVolumeSize": r.minimum_volume_size})
        }
        Call::NodeInfo => {
            let r = node.node_get_info(csi::NodeGetInfoRequest {}).await?.into_inner();
            json!({"nodeId": r.node_id, "maxVolumesPerNode": r.max_volumes_per_node, "topology": r.accessible_topology.map(|t| t.segments)})
        }
        Call::Stage { id, staging, fs, mode } => {
            let req = csi::NodeStageVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
                volume_capability: Some(capability(&fs, &mode).map_err(bad)?),
                ..Default::default()
            };
            node.node_stage_volume(req).await?;
            json!({})
        }
        Call::Unstage { id, staging } => {
            node.node_unstage_volume(csi::NodeUnstageVolumeRequest { volume_id: id, staging_target_path: staging }).await?;
            json!({})
        }
        Call::Publish { id, staging, target, fs, readonly, mode } => {
            let req = csi::NodePublishVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
                target_path: target,
                volume_capability: Some(capability(&fs, &mode).map_err(bad)?),
                readonly,
                ..Default::default()
            };
            node.node_publish_volume(req).await?;
            json!({})
        }
        Call::Unpublish { id, target } => {
            node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest { volume_id: id, target_path: target }).await?;
            json!({})
        }
        Call::Stats { id, path } => {
            let r = node
                .node_get_volume_stats(csi::NodeGetVolumeStatsRequest { volume_id: id, volume_path: path, staging_target_path: String::new() })
                .await?
                .into_inner();
            let usage: Vec<_> = r
                .usage
                .iter()
                .map(|u| json!({"unit": csi::volume_usage::Unit::try_from(u.unit).map(|x| x.as_str_name()).unwrap_or("?"), "total": u.total, "used": u.used, "available": u.available}))
                .collect();
            json!({"usage": usage, "abnormal": r.volume_condition.as_ref().map(|c| c.abnormal), "message": r.volume_condition.map(|c| c.message)})
        }
        Call::NodeExpand { id, path, size } => {
            let r = node
                .node_expand_volume(csi::NodeExpandVolumeRequest {
                    volume_id: id,
                    volume_path: path,
                    capacity_range: Some(csi::CapacityRange { required_bytes: size, limit_bytes: 0 }),
                    ..Default::default()
                })
                .await?
                .into_inner();
            json!({"capacityBytes": r.capacity_bytes})
        }
    })
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let Top::Csi { endpoint, call: c } = args.cmd;
    match rt.block_on(call(endpoint, c)) {
        Ok(v) => println!("{v}"),
        Err(s) => {
            println!("{}", json!({"code": format!("{:?}", s.code()), "message": s.message()}));
            std::process::exit(2);
        }
    }
}
