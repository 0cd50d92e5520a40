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
use nodeplane::cli::{self, document, summary};
use nodeplane::rpc::csi;
use nodeplane::rpc::csi::volume_capability::access_mode::Mode;
use nodeplane::rpc::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use nodeplane::rpc::node::node_status_client::NodeStatusClient;
use serde_json::json;

/// Why a `nodeplane` command failed (printed after `nodeplane: `, exit status 2).
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("{}: {source}", path.display())]
    Config { path: PathBuf, source: nodeplane::agent::config::ConfigError },
    #[error("{what} {}: {source}", path.display())]
    File { what: &'static str, path: PathBuf, source: std::io::Error },
    /// `to`: a socket or an address; `hint`: what to check.
    #[error("connecting to {to}: {source}{hint}")]
    Connect { to: String, source: Box<nodeplane::rpc::ConnectError>, hint: &'static str },
    #[error("{call}: {code:?}: {message}")]
    Call { call: &'static str, code: tonic::Code, message: String },
    #[error("the agent did not answer within {0:?}")]
    Timeout(std::time::Duration),
    #[error("the agent's answer is empty (an agent older than this CLI?)")]
    Empty,
    /// An argument or input that is not valid, and why.
    #[error("{0}")]
    Invalid(String),
}

impl CliError {
    /// Reading, writing or removing `path` failed.
    fn file<'a>(what: &'static str, path: &'a std::path::Path) -> impl FnOnce(std::io::Error) -> CliError + 'a {
        move |source| CliError::File { what, path: path.into(), source }
    }

    fn call(call: &'static str) -> impl FnOnce(tonic::Status) -> CliError {
        move |s| CliError::Call { call, code: s.code(), message: s.message().into() }
    }
}

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
    /// This node's WireGuard key (encryption on or strict).
    Wireguard {
        #[command(flatten)]
        at: AgentSocket,
        #[command(subcommand)]
        call: WireguardCall,
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

#[derive(Subcommand)]
enum WireguardCall {
    /// Make a new key pair now and publish it: peers re-handshake with the new key.
    Rotate,
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
    fn resolve(&self) -> Result<(PathBuf, PathBuf), CliError> {
        let cfg = self.config.as_deref().map(load_config).transpose()?;
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

fn load_config(path: &std::path::Path) -> Result<nodeplane::agent::config::Config, CliError> {
    nodeplane::agent::config::Config::load(path).map_err(|source| CliError::Config { path: path.into(), source })
}

/// A channel to the Unix socket `path` (`hint`: what to check when it fails).
async fn connect_unix(path: &std::path::Path, hint: &'static str) -> Result<tonic::transport::Channel, CliError> {
    let to = path.display().to_string();
    nodeplane::rpc::connect_unix(path).await.map_err(|e| CliError::Connect { to, source: Box::new(e.into()), hint })
}

/// Run one `nodeplane dra` call: the JSON answer and whether every claim succeeded.
async fn dra_call(c: DraCall) -> Result<(serde_json::Value, bool), CliError> {
    use nodeplane::devices::dra;
    use nodeplane::rpc::dra as pb;
    let connect = |socket: PathBuf| async move {
        Ok::<_, CliError>(pb::dra_plugin_client::DraPluginClient::new(connect_unix(&socket, "").await?))
    };
    match c {
        DraCall::Prepare { claim_file, at } => {
            let (socket, state) = at.resolve()?;
            let raw = std::fs::read(&claim_file).map_err(CliError::file("reading", &claim_file))?;
            let claim: dra::ClaimFile =
                serde_json::from_slice(&raw).map_err(|e| CliError::file("reading", &claim_file)(e.into()))?;
            dra::check_uid(&claim.uid).map_err(CliError::Invalid)?;
            let dir = dra::claim_dir(&state);
            let target = dir.join(format!("{}.json", claim.uid));
            let body = serde_json::to_vec_pretty(&claim).expect("claim serialises");
            std::fs::create_dir_all(&dir)
                .and_then(|_| nodeplane::sys::fs::atomic_write(&target, &body, 0o600))
                .map_err(CliError::file("writing", &target))?;
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
                .map_err(CliError::call("NodePrepareResources"))?;
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
            dra::check_uid(&uid).map_err(CliError::Invalid)?;
            let req =
                pb::NodeUnprepareResourcesRequest { claims: vec![pb::Claim { namespace, uid: uid.clone(), name }] };
            let answer = connect(socket)
                .await?
                .node_unprepare_resources(req)
                .await
                .map_err(CliError::call("NodeUnprepareResources"))?;
            let claims = answer.into_inner().claims;
            let ok = claims.get(&uid).is_some_and(|c| c.error.is_empty());
            if ok {
                let file = dra::claim_dir(&state).join(format!("{uid}.json"));
                match std::fs::remove_file(&file) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(CliError::file("removing", &file)(e));
                    }
                    _ => {}
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
    fn path(&self) -> Result<PathBuf, CliError> {
        match (&self.socket, &self.config) {
            (Some(s), _) => Ok(s.clone()),
            (None, Some(c)) => load_config(c).map(|c| c.node_socket),
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

fn capability(fs: &str, mode: &str) -> Result<csi::VolumeCapability, tonic::Status> {
    let m = Mode::from_str_name(mode)
        .ok_or_else(|| tonic::Status::invalid_argument(format!("unknown access mode {mode:?}")))?;
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

async fn call(endpoint: PathBuf, c: Call) -> Result<serde_json::Value, tonic::Status> {
    let ch = nodeplane::rpc::connect_unix(&endpoint)
        .await
        .map_err(|e| tonic::Status::unavailable(format!("connecting to {}: {e}", endpoint.display())))?;
    let mut ctl = csi::controller_client::ControllerClient::new(ch.clone());
    let mut node = csi::node_client::NodeClient::new(ch.clone());
    let mut id = csi::identity_client::IdentityClient::new(ch);
    Ok(match c {
        Call::Identity => {
            let info = id.get_plugin_info(csi::GetPluginInfoRequest {}).await?.into_inner();
            let caps = id.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}).await?.into_inner();
            let probe = id.probe(csi::ProbeRequest {}).await?.into_inner();
            json!({"name": info.name, "vendorVersion": info.vendor_version, "capabilities": format!("{:?}", caps.capabilities), "ready": probe.ready})
        }
        Call::CreateVolume { name, size, limit, fs, nodes, prefer, mode, params, from_snapshot, from_volume } => {
            let cap = capability(if fs == "block" { "block" } else { &fs }, &mode)?;
            let mut parameters = std::collections::HashMap::new();
            for p in params {
                let (k, v) = p
                    .split_once('=')
                    .ok_or_else(|| tonic::Status::invalid_argument(format!("--param {p:?} is not KEY=VALUE")))?;
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
            cli::csi::volume(&v)
        }
        Call::CreateSnapshot { name, volume } => {
            let r = ctl
                .create_snapshot(csi::CreateSnapshotRequest { name, source_volume_id: volume, ..Default::default() })
                .await?
                .into_inner();
            cli::csi::snapshot(&r.snapshot.unwrap_or_default())
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
                .map(|e| cli::csi::snapshot(e.snapshot.as_ref().unwrap_or(&csi::Snapshot::default())))
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
                    volume_capabilities: vec![capability(&fs, &mode)?],
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
                    let mut v = cli::csi::volume(e.volume.as_ref().unwrap_or(&csi::Volume::default()));
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
                volume_capability: Some(capability(&fs, &mode)?),
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
                volume_capability: Some(capability(&fs, &mode)?),
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

/// A client of the agent's node API socket.
async fn agent(socket: PathBuf) -> Result<NodeStatusClient<tonic::transport::Channel>, CliError> {
    Ok(NodeStatusClient::new(connect_unix(&socket, " (is the agent running?)").await?))
}

/// `nodeplane wireguard rotate`: the old and the new public key.
async fn rotate(socket: PathBuf) -> Result<String, CliError> {
    let r = agent(socket)
        .await?
        .rotate_wireguard_key(nodeplane::rpc::node::RotateWireguardKeyRequest {})
        .await
        .map_err(CliError::call("RotateWireguardKey"))?
        .into_inner();
    Ok(format!("wireguard key rotated: {} -> {}", r.old_public_key, r.public_key))
}

/// What the agent answered: its status or its doctor's report, rendered as the JSON
/// document `--json` prints and the human summary reads.
async fn node_status(socket: PathBuf, doctor: Option<bool>) -> Result<serde_json::Value, CliError> {
    let mut c = agent(socket).await?;
    let call = async {
        match doctor {
            None => c
                .get_status(nodeplane::rpc::node::GetStatusRequest {})
                .await
                .map_err(CliError::call("GetStatus"))?
                .into_inner()
                .status
                .map(|s| document::status(&s)),
            Some(repair) => c
                .doctor(nodeplane::rpc::node::DoctorRequest { repair })
                .await
                .map_err(CliError::call("Doctor"))?
                .into_inner()
                .report
                .map(|d| document::doctor(&d)),
        }
        .ok_or(CliError::Empty)
    };
    // The doctor waits up to 5 s for each attachment a CNI call holds; a hung agent must not
    // hang the operator's shell.
    let limit = std::time::Duration::from_secs(120);
    tokio::time::timeout(limit, call).await.map_err(|_| CliError::Timeout(limit))?
}

async fn policy_call(at: ControllerAt, call: PolicyCall, services: bool) -> Result<String, CliError> {
    use nodeplane::rpc::controller as pb;
    let read = |f: &PathBuf| -> Result<String, CliError> {
        let mut s = String::new();
        let r = if f.as_os_str() == "-" {
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map(|_| s)
        } else {
            std::fs::read_to_string(f)
        };
        r.map_err(CliError::file("reading", f))
    };
    let token = std::fs::read_to_string(&at.token_file).map_err(CliError::file("reading", &at.token_file))?;
    let bearer: tonic::metadata::MetadataValue<tonic::metadata::Ascii> = format!("Bearer {}", token.trim())
        .parse()
        .map_err(|_| CliError::Invalid(format!("the token in {} is not valid header text", at.token_file.display())))?;
    let tls = at.ca_file.clone().map(|ca_file| nodeplane::rpc::tls::ClientFiles {
        ca_file,
        cert_file: None,
        key_file: None,
        server_name: at.server_name.clone(),
    });
    let ch = nodeplane::rpc::connect_with(&at.controller, tls.as_ref()).await.map_err(|source| CliError::Connect {
        to: at.controller.clone(),
        source: Box::new(source),
        hint: "",
    })?;
    // The same three calls on either of the controller's object APIs.
    macro_rules! objects {
        ($method:ident, $name:literal, $msg:expr) => {{
            let mut req = tonic::Request::new($msg);
            req.metadata_mut().insert("authorization", bearer);
            let r = if services {
                pb::services_client::ServicesClient::new(ch).$method(req).await
            } else {
                pb::network_policies_client::NetworkPoliciesClient::new(ch).$method(req).await
            };
            r.map_err(CliError::call($name))?.into_inner()
        }};
    }
    let lines =
        |names: Vec<String>, what: &str| names.iter().map(|a| format!("{a} {what}")).collect::<Vec<_>>().join("\n");
    Ok(match call {
        PolicyCall::Apply { file } => {
            let r = objects!(apply_objects, "ApplyObjects", pb::ApplyObjectsRequest { json: read(&file)? });
            lines(r.applied, "applied")
        }
        PolicyCall::Delete { file } => {
            let r = objects!(delete_objects, "DeleteObjects", pb::DeleteObjectsRequest { json: read(&file)? });
            lines(r.deleted, "deleted")
        }
        PolicyCall::List => objects!(list_objects, "ListObjects", pb::ListObjectsRequest {}).json,
    })
}

/// Print `out` (exit status 0), or fail with the error.
fn finish(out: Result<String, CliError>) -> ! {
    match out {
        Ok(out) => {
            println!("{out}");
            std::process::exit(0);
        }
        Err(e) => fail(e),
    }
}

/// Print the error after `nodeplane: `, exit status 2.
fn fail(e: CliError) -> ! {
    eprintln!("nodeplane: {e}");
    std::process::exit(2);
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
            Err(e) => fail(e),
        },
        Top::Policy { at, call: c } => finish(rt.block_on(policy_call(at, c, false))),
        Top::Service { at, call: c } => finish(rt.block_on(policy_call(at, c, true))),
        Top::Wireguard { at, call: WireguardCall::Rotate } => finish(at.path().and_then(|p| rt.block_on(rotate(p)))),
        Top::Status { at, json } => (at, None, json),
        Top::Doctor { at, repair, json } => (at, Some(repair), json),
    };
    let doc = at.path().and_then(|p| rt.block_on(node_status(p, doctor))).unwrap_or_else(|e| fail(e));
    if as_json {
        println!("{}", serde_json::to_string_pretty(&doc).expect("JSON values serialise"));
    } else if doctor.is_some() {
        print!("{}", summary::doctor(&doc));
    } else {
        print!("{}", summary::status(&doc));
    }
    if doctor.is_some() {
        std::process::exit(document::doctor_exit_code(&doc));
    }
}
