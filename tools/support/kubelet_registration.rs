//! A kubelet emulator for plugin registration (test code).
//!
//! It does what kubelet's plugin watcher and CSI plugin handler do with a socket that
//! appears in `plugins_registry/`: dial it, `GetInfo`, check the plugin type and that one of
//! the supported versions is one kubelet speaks, dial the advertised endpoint, ask the CSI
//! driver for `NodeGetInfo` (kubelet records the node id and topology from it), then report
//! the outcome with `NotifyRegistrationStatus`. A socket that disappears deregisters the
//! plugin; a socket that is replaced is registered again (kubelet hears the new socket's
//! create event; here a new inode or change time tells it, since a replacement socket can
//! get the old one's inode number back).
//!
//! It dials the registration socket as kubelet does (grpc-go, no authority override): the
//! HTTP/2 `:authority` is the socket path, percent-encoded — see [`watcher_authority`].

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use nodeplane::rpc::csi;
use nodeplane::rpc::pluginregistration as reg;

/// What kubelet learned about one registered CSI driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub name: String,
    pub endpoint: PathBuf,
    pub versions: Vec<String>,
    pub node_id: String,
    pub topology: BTreeMap<String, String>,
    pub max_volumes: i64,
    /// Identity of the registration socket this came from: (inode, ctime s, ctime ns).
    pub socket_inode: (u64, i64, i64),
}

pub struct KubeletEmulator {
    pub registry_dir: PathBuf,
    pub registered: BTreeMap<PathBuf, Registered>,
    /// Registration attempts that failed, with why (kubelet reports these to the plugin).
    pub failures: Vec<String>,
    /// Sockets of another kubelet handler (`DRAPlugin`: `kubelet_dra.rs`), by identity: left
    /// alone, not reported to.
    pub others: BTreeMap<PathBuf, (u64, i64, i64)>,
}

/// The error of a socket that belongs to another handler.
const OTHER_HANDLER: &str = "DRAPlugin: another handler's plugin";

const KUBELET_CSI_VERSIONS: &[&str] = &["1.0.0"];

impl KubeletEmulator {
    pub fn new(kubelet_dir: &Path) -> Self {
        KubeletEmulator {
            registry_dir: kubelet_dir.join("plugins_registry"),
            registered: BTreeMap::new(),
            failures: Vec::new(),
            others: BTreeMap::new(),
        }
    }

    /// One pass of the plugin watcher: register new or replaced sockets, forget vanished
    /// ones. Returns how many were (re-)registered in this pass.
    pub async fn sync(&mut self) -> usize {
        let mut seen = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.registry_dir) {
            for e in entries.flatten() {
                let Ok(md) = e.metadata() else { continue };
                if md.file_type().is_socket() {
                    seen.push((e.path(), (md.ino(), md.ctime(), md.ctime_nsec())));
                }
            }
        }
        self.registered.retain(|p, r| seen.iter().any(|(sp, ino)| sp == p && *ino == r.socket_inode));
        self.others.retain(|p, id| seen.iter().any(|(sp, sid)| sp == p && sid == id));
        let mut n = 0;
        for (path, ino) in seen {
            if self.registered.contains_key(&path) || self.others.get(&path) == Some(&ino) {
                continue;
            }
            match register(&path, ino).await {
                Ok(r) => {
                    self.registered.insert(path, r);
                    n += 1;
                }
                Err(e) if e == OTHER_HANDLER => {
                    self.others.insert(path, ino);
                }
                Err(e) => self.failures.push(format!("{}: {e}", path.display())),
            }
        }
        n
    }

    pub fn driver(&self, name: &str) -> Option<&Registered> {
        self.registered.values().find(|r| r.name == name)
    }
}

/// The `:authority` kubelet's plugin watcher sends on a registration socket: grpc-go dials
/// `unix:///path` with no authority override, so it is the path, percent-encoded. Override
/// with `NODEPLANE_KUBELET_AUTHORITY` = `raw` (the path as it is), `localhost`, `absent`.
pub fn watcher_authority(socket: &Path) -> Option<Vec<u8>> {
    match std::env::var("NODEPLANE_KUBELET_AUTHORITY").as_deref() {
        Ok("raw") => Some(socket.as_os_str().as_encoded_bytes().to_vec()),
        Ok("localhost") => Some(b"localhost".to_vec()),
        Ok("absent") => None,
        _ => Some(nodeplane::rpc::authority::percent_encoded_path(socket)),
    }
}

async fn register(socket: &Path, ino: (u64, i64, i64)) -> Result<Registered, String> {
    register_with(socket, ino, watcher_authority(socket)).await
}

/// One registration, dialing the registration socket with this `:authority`.
pub async fn register_with(
    socket: &Path,
    ino: (u64, i64, i64),
    authority: Option<Vec<u8>>,
) -> Result<Registered, String> {
    let ch = nodeplane::rpc::authority::connect_unix_with_authority(socket, authority)
        .await
        .map_err(|e| format!("dialing: {e}"))?;
    let mut rc = reg::registration_client::RegistrationClient::new(ch);
    let info = rc.get_info(reg::InfoRequest {}).await.map_err(|e| format!("GetInfo: {e}"))?.into_inner();
    if info.r#type == "DRAPlugin" {
        return Err(OTHER_HANDLER.into());
    }
    let outcome = async {
        if info.r#type != "CSIPlugin" {
            return Err(format!("plugin type {:?} is not CSIPlugin", info.r#type));
        }
        if !info.supported_versions.iter().any(|v| KUBELET_CSI_VERSIONS.contains(&v.as_str())) {
            return Err(format!("no supported version in {:?}", info.supported_versions));
        }
        let endpoint = PathBuf::from(&info.endpoint);
        let ch = nodeplane::rpc::connect_unix(&endpoint).await.map_err(|e| format!("dialing endpoint: {e}"))?;
        let mut id = csi::identity_client::IdentityClient::new(ch.clone());
        let pi = id.get_plugin_info(csi::GetPluginInfoRequest {}).await.map_err(|e| format!("GetPluginInfo: {e}"))?;
        if pi.get_ref().name != info.name {
            return Err(format!("endpoint serves {:?}, registration says {:?}", pi.get_ref().name, info.name));
        }
        let mut node = csi::node_client::NodeClient::new(ch);
        let ni =
            node.node_get_info(csi::NodeGetInfoRequest {}).await.map_err(|e| format!("NodeGetInfo: {e}"))?.into_inner();
        if ni.node_id.is_empty() {
            return Err("NodeGetInfo returned an empty node id".into());
        }
        Ok(Registered {
            name: info.name.clone(),
            endpoint,
            versions: info.supported_versions.clone(),
            node_id: ni.node_id,
            topology: ni.accessible_topology.map(|t| t.segments.into_iter().collect()).unwrap_or_default(),
            max_volumes: ni.max_volumes_per_node,
            socket_inode: ino,
        })
    }
    .await;
    let status = match &outcome {
        Ok(_) => reg::RegistrationStatus { plugin_registered: true, error: String::new() },
        Err(e) => reg::RegistrationStatus { plugin_registered: false, error: e.clone() },
    };
    rc.notify_registration_status(status).await.map_err(|e| format!("NotifyRegistrationStatus: {e}"))?;
    outcome
}
