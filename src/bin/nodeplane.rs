//! `nodeplane`: the operator's command line. `nodeplane csi …` is a CSI client for any
//! CSI socket (the controller's Identity + Controller, an agent's Identity + Node): what
//! the sidecars and kubelet would send, one call per invocation, JSON on stdout. A failed
//! call prints `{"code": "...", "message": "..."}` on stdout and exits 2.
//!
//! `nodeplane dra prepare|unprepare` stands in for kubelet and the API server in local DRA
//! mode: it writes (removes) the claim file in the agent's claims directory and calls
//! NodePrepareResources (NodeUnprepareResources) on the DRA socket exactly as kubelet does,
//! printing the answer as JSON (exit 1 when the claim failed, 2 when the call did).
//!
//! `nodeplane status` and `nodeplane doctor [--repair]` ask a node's agent (its node API
//! socket) what the node is doing and which orphans it has; see `nodeplane::agent::status`.

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
    /// NetworkPolicy objects of a controller in local mode (in a cluster: kubectl).
    Policy {
        #[command(flatten)]
        at: ControllerAt,
        #[command(subcommand)]
        call: PolicyCall,
    },
    /// Services and EndpointSlices of a controller in local mode (in a cluster: kubectl).
    Service {
        #[command(flatten)]
        at: ControllerAt,
        #[command(subcommand)]
        call: PolicyCall,
    },
    /// Call a CSI endpoint.
    Csi {
        /// The CSI Unix socket.
        #[arg(long)]
        endpoint: PathBuf,
        #[command(subcommand)]
        call: Call,
    },
    /// Prepare or unprepare a DRA claim on this node's agent, as kubelet would (local mode).
    Dra {
        #[command(subcommand)]
        call: DraCall,
    },
    /// What the node's agent is doing: attachments and leases, blocks, volumes and mounts,
    /// devices and their health, the link to the controller.
    Status {
        #[command(flatten)]
        at: AgentSocket,
        /// Print the agent's JSON document instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Find orphans (veths without a lease, leases without a pod, mounts without a volume,
    /// loop devices without a file); with --repair, remove what can safely be removed.
    /// Exit status: 0 nothing (left) to repair, 1 findings remain, 2 the agent could not be asked.
    Doctor {
        #[command(flatten)]
        at: AgentSocket,
        #[arg(long)]
        repair: bool,
        #[arg(long)]
        json: bool,
    },
}

/// How to reach the controller as the admin (local mode's policy objects).
#[derive(clap::Args)]
struct ControllerAt {
    /// The controller's address: a Unix socket path or host:port (TLS unless --insecure).
    #[arg(long)]
    controller: String,
    /// A file holding the admin token (`nodeplane-controller token @admin`).
    #[arg(long)]
    token_file: PathBuf,
    /// The CA bundle to verify the controller's certificate with (TCP).
    #[arg(long)]
    ca_file: Option<PathBuf>,
    /// The name to verify the certificate against (default: the address's host).
    #[arg(long)]
    server_name: Option<String>,
}

#[derive(Subcommand)]
enum PolicyCall {
    /// Create or replace the objects in a JSON file ("-": stdin): one object, a List, or
    /// several documents (policy: Namespaces, Pods with their labels and container ports,
    /// NetworkPolicies; service: Services and EndpointSlices).
    Apply {
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
    },
    /// Delete the objects named in a JSON file (kind, namespace and name are read).
    Delete {
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
    },
    /// Every object applied, as a JSON List.
    List,
}

/// Where the agent's DRA socket and state directory are.
#[derive(clap::Args)]
struct DraAt {
    /// The DRA plugin socket (default: from --config, else
    /// /var/lib/kubelet/plugins/dra.nodeplane.dev/dra.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The agent's configuration file, to find its DRA socket and state directory.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The agent's state directory (default: from --config, else /var/lib/nodeplane).
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

impl DraAt {
    /// (socket, state directory)
    fn resolve(&self) -> Result<(PathBuf, PathBuf), String> {
        let cfg = match &self.config {
            Some(c) => Some(nodeplane::agent::config::Config::load(c).map_err(|e| format!("{}: {e}", c.display()))?),
            None => None,
        };
        let socket = match (&self.socket, &cfg) {
            (Some(s), _) => s.clone(),
            (None, Some(c)) => match &c.dra {
                Some(d) => d.socket(),
                None => c.kubelet_dir.join("plugins").join(nodeplane::devices::dra::DRIVER_NAME).join("dra.sock"),
            },
            (None, None) => PathBuf::from("/var/lib/kubelet/plugins/dra.nodeplane.dev/dra.sock"),
        };
        let state = match (&self.state_dir, &cfg) {
            (Some(s), _) => s.clone(),
            (None, Some(c)) => c.state_dir.clone(),
            (None, None) => PathBuf::from("/var/lib/nodeplane"),
        };
        Ok((socket, state))
    }
}

#[derive(Subcommand)]
enum DraCall {
    /// Write the claim file into the agent's claims directory, then NodePrepareResources.
    Prepare {
        /// A claim file: {"namespace", "name", "uid", "results": [{"request", "driver", "pool", "device"}]}.
        #[arg(long)]
        claim_file: PathBuf,
        #[command(flatten)]
        at: DraAt,
    },
    /// NodeUnprepareResources, then remove the claim file.
    Unprepare {
        #[arg(long)]
        uid: String,
        #[arg(long)]
        namespace: String,
        #[arg(long)]
        name: String,
        #[command(flatten)]
        at: DraAt,
    },
}

/// Run one `nodeplane dra` call: the JSON answer and whether every claim succeeded.
async fn dra_call(c: DraCall) -> Result<(serde_json::Value, bool), String> {
    use nodeplane::devices::dra;
    use nodeplane::rpc::dra as pb;
    let connect = |socket: PathBuf| async move {
        let ch = nodeplane::rpc::connect_unix(&socket)
            .await
            .map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
        Ok::<_, String>(pb::dra_plugin_client::DraPluginClient::new(ch))
    };
    match c {
        DraCall::Prepare { claim_file, at } => {
            let (socket, state) = at.resolve()?;
            let raw = std::fs::read(&claim_file).map_err(|e| format!("reading {}: {e}", claim_file.display()))?;
            let claim: dra::ClaimFile =
                serde_json::from_slice(&raw).map_err(|e| format!("{}: {e}", claim_file.display()))?;
            dra::check_uid(&claim.uid)?;
            let dir = dra::claim_dir(&state);
            let target = dir.join(format!("{}.json", claim.uid));
            let body = serde_json::to_vec_pretty(&claim).expect("claim serialises");
            std::fs::create_dir_all(&dir)
                .and_then(|_| nodeplane::sys::fs::atomic_write(&target, &body, 0o600))
                .map_err(|e| format!("writing {}: {e}", target.display()))?;
            let req = pb::NodePrepareResourcesRequest {
                claims: vec![pb::Claim {
                    namespace: claim.namespace.clone(),
                    uid: claim.uid.clone(),
                    name: claim.name.clone(),
                }],
            };
            let answer = connect(socket)
                .await?
                .node_prepare_resources(req)
                .await
                .map_err(|s| format!("NodePrepareResources: {:?}: {}", s.code(), s.message()))?;
            let claims = answer.into_inner().claims;
            let ok = claims.get(&claim.uid).is_some_and(|c| c.error.is_empty());
            let doc: serde_json::Map<String, serde_json::Value> = claims
                .into_iter()
                .map(|(uid, c)| {
                    let devices: Vec<serde_json::Value> = c
                        .devices
                        .iter()
                        .map(|d| json!({"requestNames": d.request_names, "poolName": d.pool_name, "deviceName": d.device_name, "cdiDeviceIds": d.cdi_device_ids}))
                        .collect();
                    (uid, json!({"devices": devices, "error": c.error}))
                })
                .collect();
            Ok((json!({ "claims": doc }), ok))
        }
        DraCall::Unprepare { uid, namespace, name, at } => {
            let (socket, state) = at.resolve()?;
            dra::check_uid(&uid)?;
            let req =
                pb::NodeUnprepareResourcesRequest { claims: vec![pb::Claim { namespace, uid: uid.clone(), name }] };
            let answer = connect(socket)
                .await?
                .node_unprepare_resources(req)
                .await
                .map_err(|s| format!("NodeUnprepareResources: {:?}: {}", s.code(), s.message()))?;
            let claims = answer.into_inner().claims;
            let ok = claims.get(&uid).is_some_and(|c| c.error.is_empty());
            if ok {
                let file = dra::claim_dir(&state).join(format!("{uid}.json"));
                match std::fs::remove_file(&file) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(format!("removing {}: {e}", file.display())),
                }
            }
            let doc: serde_json::Map<String, serde_json::Value> =
                claims.into_iter().map(|(uid, c)| (uid, json!({"error": c.error}))).collect();
            Ok((json!({ "claims": doc }), ok))
        }
    }
}

#[derive(clap::Args)]
struct AgentSocket {
    /// The agent's node API socket (default /run/nodeplane/node.sock, or the `nodeSocket`
    /// of --config).
    #[arg(long, conflicts_with = "config")]
    socket: Option<PathBuf>,
    /// The agent's configuration file, to find its socket.
    #[arg(long)]
    config: Option<PathBuf>,
}

impl AgentSocket {
    fn path(&self) -> Result<PathBuf, String> {
        match (&self.socket, &self.config) {
            (Some(s), _) => Ok(s.clone()),
            (None, Some(c)) => nodeplane::agent::config::Config::load(c)
                .map(|c| c.node_socket)
                .map_err(|e| format!("{}: {e}", c.display())),
            (None, None) => Ok(PathBuf::from("/run/nodeplane/node.sock")),
        }
    }
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
        /// Content source: restore this snapshot.
        #[arg(long, conflicts_with = "from_volume")]
        from_snapshot: Option<String>,
        /// Content source: clone this volume.
        #[arg(long)]
        from_volume: Option<String>,
    },
    /// Controller: CreateSnapshot.
    CreateSnapshot {
        #[arg(long)]
        name: String,
        /// The source volume id.
        #[arg(long)]
        volume: String,
    },
    /// Controller: DeleteSnapshot.
    DeleteSnapshot {
        #[arg(long)]
        id: String,
    },
    /// Controller: ListSnapshots (one page), optionally filtered by snapshot or source volume.
    ListSnapshots {
        #[arg(long, default_value_t = 0)]
        max: i32,
        #[arg(long, default_value = "")]
        token: String,
        #[arg(long, default_value = "")]
        id: String,
        #[arg(long, default_value = "")]
        volume: String,
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
    csi::Topology {
        segments: [(nodeplane::storage::csi::TOPOLOGY_KEY.to_string(), node.to_string())].into_iter().collect(),
    }
}

fn volume_json(v: &csi::Volume) -> serde_json::Value {
    json!({
        "volumeId": v.volume_id,
        "capacityBytes": v.capacity_bytes,
        "volumeContext": v.volume_context,
        "nodes": v.accessible_topology.iter().filter_map(|t| t.segments.get(nodeplane::storage::csi::TOPOLOGY_KEY)).collect::<Vec<_>>(),
        "contentSource": v.content_source.as_ref().and_then(|c| c.r#type.as_ref()).map(|t| match t {
            csi::volume_content_source::Type::Snapshot(s) => json!({"snapshot": s.snapshot_id}),
            csi::volume_content_source::Type::Volume(v) => json!({"volume": v.volume_id}),
        }),
    })
}

fn snapshot_json(s: &csi::Snapshot) -> serde_json::Value {
    json!({
        "snapshotId": s.snapshot_id,
        "sourceVolumeId": s.source_volume_id,
        "sizeBytes": s.size_bytes,
        "readyToUse": s.ready_to_use,
        "creationTime": s.creation_time.as_ref().map(|t| t.seconds),
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
        Call::CreateVolume { name, size, limit, fs, nodes, prefer, mode, params, from_snapshot, from_volume } => {
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
                accessibility_requirements: (!nodes.is_empty() || !prefer.is_empty()).then(|| {
                    csi::TopologyRequirement {
                        requisite: nodes.iter().map(|n| topology(n)).collect(),
                        preferred: prefer.iter().map(|n| topology(n)).collect(),
                    }
                }),
                volume_content_source: {
                    use csi::volume_content_source::{SnapshotSource, Type, VolumeSource};
                    match (from_snapshot, from_volume) {
                        (Some(snapshot_id), _) => Some(csi::VolumeContentSource {
                            r#type: Some(Type::Snapshot(SnapshotSource { snapshot_id })),
                        }),
                        (None, Some(volume_id)) => {
                            Some(csi::VolumeContentSource { r#type: Some(Type::Volume(VolumeSource { volume_id })) })
                        }
                        (None, None) => None,
                    }
                },
                ..Default::default()
            };
            let v = ctl.create_volume(req).await?.into_inner().volume.unwrap_or_default();
            volume_json(&v)
        }
        Call::CreateSnapshot { name, volume } => {
            let r = ctl
                .create_snapshot(csi::CreateSnapshotRequest { name, source_volume_id: volume, ..Default::default() })
                .await?
                .into_inner();
            snapshot_json(&r.snapshot.unwrap_or_default())
        }
        Call::DeleteSnapshot { id } => {
            ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: id, ..Default::default() }).await?;
            json!({})
        }
        Call::ListSnapshots { max, token, id, volume } => {
            let r = ctl
                .list_snapshots(csi::ListSnapshotsRequest {
                    max_entries: max,
                    starting_token: token,
                    snapshot_id: id,
                    source_volume_id: volume,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let entries: Vec<_> = r
                .entries
                .iter()
                .map(|e| snapshot_json(e.snapshot.as_ref().unwrap_or(&csi::Snapshot::default())))
                .collect();
            json!({"entries": entries, "nextToken": r.next_token})
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
                        csi::controller_service_capability::rpc::Type::try_from(r.r#type)
                            .ok()
                            .map(|t| t.as_str_name().to_string())
                    }
                    None => None,
                })
                .collect();
            json!({"capabilities": names})
        }
        Call::ListVolumes { max, token } => {
            let r = ctl
                .list_volumes(csi::ListVolumesRequest { max_entries: max, starting_token: token })
                .await?
                .into_inner();
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
                .get_capacity(csi::GetCapacityRequest {
                    accessible_topology: node.as_deref().map(topology),
                    ..Default::default()
                })
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
            node.node_unstage_volume(csi::NodeUnstageVolumeRequest { volume_id: id, staging_target_path: staging })
                .await?;
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
                .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                    volume_id: id,
                    volume_path: path,
                    staging_target_path: String::new(),
                })
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

/// What the agent answered: its status or its doctor's report, rendered as the JSON
/// document `--json` prints and the human summary reads.
async fn node_status(socket: PathBuf, doctor: Option<bool>) -> Result<serde_json::Value, String> {
    let ch = nodeplane::rpc::connect_unix(&socket)
        .await
        .map_err(|e| format!("connecting to {}: {e} (is the agent running?)", socket.display()))?;
    let mut c = nodeplane::rpc::node::node_status_client::NodeStatusClient::new(ch);
    let missing = || "the agent's answer is empty (an agent older than this CLI?)".to_string();
    let call = async {
        match doctor {
            None => c
                .get_status(nodeplane::rpc::node::GetStatusRequest {})
                .await
                .map(|r| r.into_inner().status.map(|s| document::status(&s)).ok_or_else(missing)),
            Some(repair) => c
                .doctor(nodeplane::rpc::node::DoctorRequest { repair })
                .await
                .map(|r| r.into_inner().report.map(|d| document::doctor(&d)).ok_or_else(missing)),
        }
    };
    // The doctor waits up to 5 s for each attachment a CNI call holds; a hung agent must not
    // hang the operator's shell.
    tokio::time::timeout(std::time::Duration::from_secs(120), call)
        .await
        .map_err(|_| "the agent did not answer within 120 s".to_string())?
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))?
}

/// The JSON documents of `nodeplane status --json` and `nodeplane doctor --json`, from the
/// agent's typed reports (`nodeplane.node.v1`). Their shape is documented in
/// docs/operations.md and carries the report's `format` number; absent sections are `null`.
mod document {
    use nodeplane::rpc::node as api;
    use serde_json::{Value, json};

    pub fn status(r: &api::StatusReport) -> Value {
        json!({
            "format": r.format,
            "node": r.node,
            "version": r.version,
            "pid": r.pid,
            "startedUnix": r.started_unix,
            "mode": match r.mode() {
                api::Mode::Controller => "controller",
                api::Mode::Standalone => "standalone",
                api::Mode::Unspecified => "unknown",
            },
            "conditions": r.conditions.iter().map(|c| json!({"name": c.name, "ready": c.ready, "detail": c.detail})).collect::<Vec<_>>(),
            "network": r.network.as_ref().map(network),
            "controller": r.controller.as_ref().map(|c| json!({
                "address": c.address,
                "connected": c.connected,
                "lastMessageUnix": c.last_message_unix,
                "lastMessageSecondsAgo": c.last_message_seconds_ago,
                "blocks": c.blocks.as_ref().map(|b| b.cidrs.clone()),
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
                    "state": match f.state() {
                        api::KernelFeatureState::Available => "available",
                        api::KernelFeatureState::Missing => "missing",
                        api::KernelFeatureState::Unknown | api::KernelFeatureState::Unspecified => "unknown",
                    },
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
                "state": match a.state() {
                    api::LeaseState::Adding => "adding",
                    api::LeaseState::Ready => "ready",
                    api::LeaseState::Unspecified => "unknown",
                },
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
                    "state": match st.state() {
                        api::StageState::Staged => "staged",
                        api::StageState::Staging => "staging",
                        api::StageState::Unspecified => "unknown",
                    },
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
                "kind": match p.kind() {
                    api::PluginKind::Csi => "csi",
                    api::PluginKind::DevicePlugin => "deviceplugin",
                    api::PluginKind::Dra => "dra",
                    api::PluginKind::Unspecified => "unknown",
                },
                "socket": p.socket,
                "state": match p.state() {
                    api::RegistrationState::Waiting => "waiting",
                    api::RegistrationState::Registered => "registered",
                    api::RegistrationState::Refused => "refused",
                    api::RegistrationState::Unreachable => "unreachable",
                    api::RegistrationState::Unspecified => "unknown",
                },
                "error": p.error,
                "sinceUnix": p.since_unix,
                "registeredUnix": p.registered_unix,
                "registrations": p.registrations,
                "overdue": p.overdue,
            })).collect::<Vec<_>>(),
        })
    }

    pub fn doctor(d: &api::DoctorReport) -> Value {
        json!({
            "format": d.format,
            "node": d.node,
            "repair": d.repair,
            "findings": d.findings.iter().map(|f| {
                let mut v = json!({"kind": f.kind, "subject": f.subject, "detail": f.detail});
                if let Some(r) = &f.repair {
                    let result = match r.result() {
                        api::RepairResult::Done => "done",
                        api::RepairResult::Failed => "failed",
                        api::RepairResult::Skipped => "skipped",
                        api::RepairResult::Unspecified => "unknown",
                    };
                    v["repair"] = json!({"result": result, "message": r.message});
                }
                v
            }).collect::<Vec<_>>(),
            "errors": d.errors,
        })
    }
}

/// Which of the controller's object APIs a call goes to.
enum Objects {
    Policy(nodeplane::rpc::controller::network_policies_client::NetworkPoliciesClient<tonic::transport::Channel>),
    Services(nodeplane::rpc::controller::services_client::ServicesClient<tonic::transport::Channel>),
}

async fn policy_call(at: ControllerAt, call: PolicyCall, services: bool) -> Result<String, String> {
    use nodeplane::rpc::controller as pb;
    let read = |f: &PathBuf| -> Result<String, String> {
        if f.as_os_str() == "-" {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| format!("stdin: {e}"))?;
            Ok(s)
        } else {
            std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))
        }
    };
    let token = std::fs::read_to_string(&at.token_file).map_err(|e| format!("{}: {e}", at.token_file.display()))?;
    let bearer: tonic::metadata::MetadataValue<tonic::metadata::Ascii> =
        format!("Bearer {}", token.trim()).parse().map_err(|_| "the token is not valid header text".to_string())?;
    let tls = at.ca_file.clone().map(|ca_file| nodeplane::rpc::tls::ClientFiles {
        ca_file,
        cert_file: None,
        key_file: None,
        server_name: at.server_name.clone(),
    });
    let ch = nodeplane::rpc::connect_with(&at.controller, tls.as_ref())
        .await
        .map_err(|e| format!("connecting to {}: {e}", at.controller))?;
    let mut c = if services {
        Objects::Services(pb::services_client::ServicesClient::new(ch))
    } else {
        Objects::Policy(pb::network_policies_client::NetworkPoliciesClient::new(ch))
    };
    fn with<T>(m: T, bearer: &tonic::metadata::MetadataValue<tonic::metadata::Ascii>) -> tonic::Request<T> {
        let mut r = tonic::Request::new(m);
        r.metadata_mut().insert("authorization", bearer.clone());
        r
    }
    let status = |s: tonic::Status| format!("{:?}: {}", s.code(), s.message());
    match call {
        PolicyCall::Apply { file } => {
            let req = with(pb::ApplyObjectsRequest { json: read(&file)? }, &bearer);
            let r = match &mut c {
                Objects::Policy(c) => c.apply_objects(req).await,
                Objects::Services(c) => c.apply_objects(req).await,
            };
            Ok(r.map_err(status)?
                .into_inner()
                .applied
                .iter()
                .map(|a| format!("{a} applied"))
                .collect::<Vec<_>>()
                .join("\n"))
        }
        PolicyCall::Delete { file } => {
            let req = with(pb::DeleteObjectsRequest { json: read(&file)? }, &bearer);
            let r = match &mut c {
                Objects::Policy(c) => c.delete_objects(req).await,
                Objects::Services(c) => c.delete_objects(req).await,
            };
            Ok(r.map_err(status)?
                .into_inner()
                .deleted
                .iter()
                .map(|a| format!("{a} deleted"))
                .collect::<Vec<_>>()
                .join("\n"))
        }
        PolicyCall::List => {
            let req = with(pb::ListObjectsRequest {}, &bearer);
            let r = match &mut c {
                Objects::Policy(c) => c.list_objects(req).await,
                Objects::Services(c) => c.list_objects(req).await,
            };
            Ok(r.map_err(status)?.into_inner().json)
        }
    }
}

/// `nodeplane policy|service …`: print the answer, or the error with exit status 2.
fn objects(rt: &tokio::runtime::Runtime, at: ControllerAt, call: PolicyCall, services: bool) -> ! {
    match rt.block_on(policy_call(at, call, services)) {
        Ok(out) => {
            println!("{out}");
            std::process::exit(0);
        }
        Err(e) => {
            eprintln!("nodeplane: {e}");
            std::process::exit(2);
        }
    }
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let (at, doctor, as_json) = match args.cmd {
        Top::Csi { endpoint, call: c } => match rt.block_on(call(endpoint, c)) {
            Ok(v) => {
                println!("{v}");
                return;
            }
            Err(s) => {
                println!("{}", json!({"code": format!("{:?}", s.code()), "message": s.message()}));
                std::process::exit(2);
            }
        },
        Top::Dra { call: c } => match rt.block_on(dra_call(c)) {
            Ok((doc, ok)) => {
                println!("{}", serde_json::to_string_pretty(&doc).expect("JSON values serialise"));
                std::process::exit(if ok { 0 } else { 1 });
            }
            Err(e) => {
                eprintln!("nodeplane: {e}");
                std::process::exit(2);
            }
        },
        Top::Policy { at, call: c } => objects(&rt, at, c, false),
        Top::Service { at, call: c } => objects(&rt, at, c, true),
        Top::Status { at, json } => (at, None, json),
        Top::Doctor { at, repair, json } => (at, Some(repair), json),
    };
    let doc = match at.path().and_then(|p| rt.block_on(node_status(p, doctor))) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("nodeplane: {e}");
            std::process::exit(2);
        }
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&doc).expect("JSON values serialise"));
    } else if doctor.is_some() {
        print!("{}", report::doctor(&doc));
    } else {
        print!("{}", report::status(&doc));
    }
    if doctor.is_some() {
        let unresolved = doc["findings"]
            .as_array()
            .map(|f| f.iter().filter(|f| f["repair"]["result"] != "done").count())
            .unwrap_or(0);
        let errors = doc["errors"].as_array().map(|e| e.len()).unwrap_or(0);
        std::process::exit(if unresolved + errors > 0 { 1 } else { 0 });
    }
}

/// The human summaries of the agent's documents (the JSON is the complete answer).
mod report {
    use serde_json::Value;
    use std::fmt::Write;

    fn s(v: &Value) -> String {
        match v {
            Value::String(s) => s.clone(),
            Value::Null => "-".into(),
            v => v.to_string(),
        }
    }

    fn list(v: &Value) -> String {
        match v.as_array() {
            Some(a) if !a.is_empty() => a.iter().map(s).collect::<Vec<_>>().join(", "),
            _ => "-".into(),
        }
    }

    fn mib(v: &Value) -> String {
        format!("{} MiB", v.as_u64().unwrap_or(0) >> 20)
    }

    /// Rows as aligned columns.
    fn table(out: &mut String, head: &[&str], rows: Vec<Vec<String>>) {
        let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
        for r in &rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.len());
            }
        }
        let line = |cells: Vec<String>| {
            let mut l = String::from("   ");
            for (i, c) in cells.iter().enumerate() {
                let _ = write!(l, " {:<width$}", c, width = w[i]);
            }
            l.trim_end().to_string() + "\n"
        };
        out.push_str(&line(head.iter().map(|h| h.to_string()).collect()));
        for r in rows {
            out.push_str(&line(r));
        }
    }

    pub fn status(d: &Value) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "node {} ({} mode), agent {} pid {}",
            s(&d["node"]),
            s(&d["mode"]),
            s(&d["version"]),
            s(&d["pid"])
        );
        let conds: Vec<String> = d["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let state =
                    if c["ready"] == true { "ready".to_string() } else { format!("NOT READY ({})", s(&c["detail"])) };
                format!("{} {state}", s(&c["name"]))
            })
            .collect();
        let _ = writeln!(o, "conditions: {}", if conds.is_empty() { "-".into() } else { conds.join("; ") });
        let k = &d["kernel"];
        if k.is_object() {
            let lacking: Vec<String> = k["features"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|f| f["state"] != "available")
                .map(|f| format!("{} {} ({})", s(&f["name"]), s(&f["state"]).to_uppercase(), s(&f["detail"])))
                .collect();
            let all = k["features"].as_array().map_or(0, |a| a.len());
            let _ = writeln!(
                o,
                "kernel: {}, {} of {all} features probed available{}",
                s(&k["release"]),
                all - lacking.len(),
                if lacking.is_empty() { String::new() } else { format!("; {}", lacking.join("; ")) }
            );
        }
        let c = &d["controller"];
        if c.is_object() {
            let last =
                c["lastMessageSecondsAgo"].as_f64().map(|t| format!("{t:.1}s ago")).unwrap_or_else(|| "never".into());
            let _ = writeln!(
                o,
                "controller: {} {}, last message {last}; blocks {}",
                s(&c["address"]),
                if c["connected"] == true { "connected" } else { "NOT CONNECTED" },
                list(&c["blocks"])
            );
        }
        let n = &d["network"];
        let b = &n["bridge"];
        let _ = writeln!(
            o,
            "network: bridge {} {}{}",
            s(&b["name"]),
            if b["up"] == true {
                "up"
            } else if b["present"] == true {
                "DOWN"
            } else {
                "MISSING"
            },
            if n["ready"] == true { "" } else { ", not ready for ADD (no block yet)" }
        );
        for blk in n["blocks"].as_array().into_iter().flatten() {
            // An IPv6 /64 has 2^64 - 2 addresses: its use is the count of leases.
            let size: Option<u128> = blk["addresses"].as_str().and_then(|a| a.parse().ok());
            let of = match size {
                Some(n) if n < 1 << 32 => format!(" of {n}"),
                _ => String::new(),
            };
            let _ = writeln!(
                o,
                "    block {} gateway {}: {}{of} addresses leased",
                s(&blk["cidr"]),
                s(&blk["gateway"]),
                s(&blk["allocated"])
            );
        }
        let rows: Vec<Vec<String>> = n["attachments"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|a| {
                let mut problems = Vec::new();
                if a["state"] != "ready" {
                    problems.push("ADD in progress");
                }
                if a["netnsPresent"] == false {
                    problems.push("netns gone");
                }
                if a["hostIfPresent"] == false {
                    problems.push("veth gone");
                } else if a["hostIfOnBridge"] == false {
                    problems.push("veth off bridge");
                }
                // Runtimes' 64-hex ids are told apart by their first 12 characters; shorter
                // ids are shown whole.
                let cid = s(&a["containerId"]);
                let cid: String = if cid.chars().count() > 24 { cid.chars().take(12).collect() } else { cid };
                vec![
                    format!("{cid}/{}", s(&a["ifname"])),
                    if a["pod"] == "" { "-".into() } else { s(&a["pod"]) },
                    list(&a["ips"]),
                    s(&a["hostIf"]),
                    if problems.is_empty() { "ok".into() } else { problems.join(", ") },
                ]
            })
            .collect();
        let _ = writeln!(o, "  {} attachments", rows.len());
        if !rows.is_empty() {
            table(&mut o, &["ATTACHMENT", "POD", "ADDRESSES", "HOST VETH", "STATE"], rows);
        }
        let stray = list(&n["unleasedHostVeths"]);
        if stray != "-" {
            let _ = writeln!(o, "  host veths without a lease: {stray} (nodeplane doctor)");
        }
        let st = &d["storage"];
        if st.is_object() {
            let vols = st["volumes"].as_array().cloned().unwrap_or_default();
            let _ = writeln!(
                o,
                "storage: {} volumes, {} of {} provisioned, {} available{}",
                vols.len(),
                mib(&st["provisionedBytes"]),
                mib(&st["capacityBytes"]),
                mib(&st["availableBytes"]),
                if st["ready"] == true { "" } else { " (recovery running)" }
            );
            let rows: Vec<Vec<String>> = vols
                .iter()
                .map(|v| {
                    let loops: Vec<String> =
                        v["loopDevices"].as_array().into_iter().flatten().map(|l| s(&l["device"])).collect();
                    let staged = match &v["staged"] {
                        Value::Null => "-".to_string(),
                        x => format!("{}{}", s(&x["state"]), if x["mounted"] == true { "" } else { " (not mounted)" }),
                    };
                    let published = v["published"].as_array().map(|p| p.len()).unwrap_or(0);
                    vec![
                        s(&v["id"]),
                        mib(&v["sizeBytes"]),
                        if v["fsType"] == "" { "block".into() } else { s(&v["fsType"]) },
                        if v["backingFilePresent"] == true { "present".into() } else { "MISSING".into() },
                        if loops.is_empty() { "-".into() } else { loops.join(",") },
                        staged,
                        published.to_string(),
                    ]
                })
                .collect();
            if !rows.is_empty() {
                table(&mut o, &["VOLUME", "SIZE", "FS", "FILE", "LOOP", "STAGED", "PUBLISHED"], rows);
            }
            for v in &vols {
                for p in v["published"].as_array().into_iter().flatten() {
                    let _ = writeln!(
                        o,
                        "    {} published at {}{}{}",
                        s(&v["id"]),
                        s(&p["path"]),
                        if p["readOnly"] == true { " (read-only)" } else { "" },
                        if p["mounted"] == true { "" } else { " (NOT MOUNTED)" }
                    );
                }
            }
        }
        if let Some(res) = d["devicePlugins"].as_array() {
            let _ = writeln!(o, "device plugins: {} resources", res.len());
            for r in res {
                let devs: Vec<String> = r["devices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|x| format!("{} {}", s(&x["id"]), s(&x["health"])))
                    .collect();
                let _ = writeln!(
                    o,
                    "    {}: {}",
                    s(&r["resource"]),
                    if devs.is_empty() { "no devices".into() } else { devs.join(", ") }
                );
            }
        }
        if d["services"].is_object() {
            let v = &d["services"];
            let ports = v["ports"].as_array().cloned().unwrap_or_default();
            let state = match v["idle"].as_str() {
                Some(why) => format!("NOT SERVED: {why}"),
                None if v["synced"] == true => format!("revision {}", v["revision"]),
                None => "waiting for the controller".into(),
            };
            let _ = writeln!(o, "services: {} ports, {state}", ports.len());
            for p in &ports {
                let ips: Vec<String> = [&p["clusterIPs"], &p["externalIPs"]]
                    .iter()
                    .flat_map(|a| a.as_array().cloned().unwrap_or_default())
                    .map(|ip| s(&ip))
                    .collect();
                let node_port =
                    p["nodePort"].as_u64().filter(|n| *n > 0).map(|n| format!(" nodePort {n}")).unwrap_or_default();
                let _ = writeln!(
                    o,
                    "    {} {} port {}{node_port}: {} endpoints ({} usable, {} here)",
                    s(&p["id"]),
                    ips.join(","),
                    p["port"],
                    p["endpoints"],
                    p["usable"],
                    p["local"]
                );
            }
        }
        let plugins = d["kubelet"]["plugins"].as_array().cloned().unwrap_or_default();
        if !plugins.is_empty() {
            let _ = writeln!(o, "kubelet:");
            for p in &plugins {
                let what = match p["state"].as_str() {
                    Some("registered") => format!("registered with kubelet at {}", utc(&p["registeredUnix"])),
                    Some(st) => format!(
                        "NOT REGISTERED with kubelet ({st}{}) since {}{}",
                        p["error"].as_str().map(|e| format!(": {e}")).unwrap_or_default(),
                        utc(&p["sinceUnix"]),
                        if p["overdue"] == true { ", overdue" } else { "" }
                    ),
                    None => "unknown".into(),
                };
                let _ = writeln!(o, "    {} {}: {what}", s(&p["kind"]), s(&p["name"]));
            }
        }
        o
    }

    /// A Unix time (seconds) as `YYYY-MM-DDTHH:MM:SSZ`.
    fn utc(v: &Value) -> String {
        match v.as_f64().filter(|t| t.is_finite() && *t >= 0.0) {
            Some(t) => nodeplane::util::utc_rfc3339(t as i64),
            None => "-".into(),
        }
    }

    pub fn doctor(d: &Value) -> String {
        let mut o = String::new();
        let findings = d["findings"].as_array().cloned().unwrap_or_default();
        let _ = writeln!(
            o,
            "node {}: {} findings{}",
            s(&d["node"]),
            findings.len(),
            if d["repair"] == true { " (repair asked for)" } else { "" }
        );
        for f in &findings {
            let _ = writeln!(o, "  {} {}: {}", s(&f["kind"]), s(&f["subject"]), s(&f["detail"]));
            if f["repair"].is_object() {
                let _ = writeln!(o, "      repair {}: {}", s(&f["repair"]["result"]), s(&f["repair"]["message"]));
            }
        }
        for e in d["errors"].as_array().into_iter().flatten() {
            let _ = writeln!(o, "  error: {}", s(e));
        }
        if !findings.is_empty() && d["repair"] != true {
            let _ = writeln!(o, "run `nodeplane doctor --repair` to remove what can be removed safely");
        }
        o
    }
}
