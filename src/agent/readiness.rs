//! The agent's readiness conditions, judged from what is actually served, never from the
//! controller's reachability (the node serves from its persisted blocks):
//!
//! - `cni`: the node has a pod block and the conflist is installed (`Datapath::ready`, the
//!   file still in place), and the CNI socket this agent bound is still at its path.
//! - `csi` (when enabled): recovery is done (`NodeService::ready`, the moment `Probe` turns
//!   ready) and the CSI and kubelet registration sockets accept connections.
//! - `deviceplugins` (when enabled): the manager runs, the device file is usable (or absent:
//!   no resources) and every resource it offers as a device plugin has its socket served.
//! - `dra` (when enabled): the DRA plugin's `dra.sock` and its registration socket accept
//!   connections.
//! - `networkpolicy` (only when enforcement was off at start): NetworkPolicy is enforced
//!   (the bridge sysctls br_netfilter provides are set; tried again each tick).
//! - `storage-pool` (when `csi.lvm` names a thin pool): the pool's data and metadata use
//!   are below [`POOL_SHORT_PERCENT`]; checked every [`POOL_CHECK`]. A short pool fails the
//!   condition, is logged once as it turns short, and offers no capacity for new volumes;
//!   the volumes in it keep working.
//! - `kernel` (only when one is missing, set once at start by [`super::kernel`]): a kernel
//!   feature an enabled part cannot work without.
//! - for all three, kubelet's answer ([`crate::kubelet`]): a plugin kubelet refused fails the
//!   condition with kubelet's message; one not registered within the grace period fails it
//!   when `requireKubeletRegistration` is set (and is warned about either way).
//!
//! A socket counts as served once a connection to it succeeded; that is checked again only
//! when the socket file changes (a new inode), so a stale socket left by a crashed run
//! never counts and a steady state costs a `stat` per socket and tick.

use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::config::Config;
use crate::net::datapath::Datapath;
use crate::obs::health::{Condition, Health};

const TICK: Duration = Duration::from_millis(250);
/// How often the thin pool's use is read (`lvs` runs a process).
pub const POOL_CHECK: Duration = Duration::from_secs(10);

use crate::storage::store::POOL_SHORT_PERCENT;

/// The `storage-pool` condition and when the pool was last read.
struct Pool {
    svc: Arc<crate::storage::csi::NodeService>,
    cond: Condition,
    last: Option<std::time::Instant>,
    short: bool,
}

pub(crate) struct Readiness {
    cfg: Arc<Config>,
    dp: Arc<Datapath>,
    cni: Condition,
    /// The CNI socket's inode when the agent bound it.
    cni_inode: Option<u64>,
    csi: Option<(Arc<crate::storage::csi::NodeService>, Condition)>,
    devices: Option<Devices>,
    dra: Option<(crate::devices::dra::Settings, Condition)>,
    /// Socket path → the inode that accepted a connection.
    verified: HashMap<PathBuf, u64>,
    book: crate::kubelet::Registrations,
    /// NetworkPolicy that could not be enforced at start ([`Readiness::watch_policy`]).
    policy: Option<(Arc<super::policy_sync::PolicyClient>, Condition)>,
    /// Encryption between nodes ([`Readiness::watch_encryption`]); the condition exists once
    /// the controller asked for encryption.
    encryption: Option<(Arc<super::cluster::Link>, Health, Option<Condition>)>,
    pool: Option<Pool>,
}

struct Devices {
    settings: crate::devices::deviceplugin::Settings,
    cond: Condition,
    /// Set when the manager task ended (it only does on a start-up failure or at shutdown).
    ended: Arc<AtomicBool>,
}

impl Readiness {
    /// Register the conditions of the parts this agent runs (all "starting").
    pub(crate) fn new(
        health: &Health,
        cfg: Arc<Config>,
        dp: Arc<Datapath>,
        csi: Option<Arc<crate::storage::csi::NodeService>>,
        devices_ended: Option<Arc<AtomicBool>>,
        book: crate::kubelet::Registrations,
    ) -> Self {
        let cni = health.condition("cni");
        let pool = csi.as_ref().filter(|_| cfg.csi.as_ref().is_some_and(|c| c.lvm.is_some())).map(|svc| Pool {
            svc: svc.clone(),
            cond: health.condition("storage-pool"),
            last: None,
            short: false,
        });
        let csi = csi.map(|svc| (svc, health.condition("csi")));
        let devices = match (cfg.device_plugins.clone(), devices_ended) {
            (Some(settings), Some(ended)) => Some(Devices { settings, cond: health.condition("deviceplugins"), ended }),
            _ => None,
        };
        let dra = cfg.dra.clone().map(|s| (s, health.condition("dra")));
        let cni_inode = std::fs::symlink_metadata(&cfg.cni_socket).ok().map(|m| m.ino());
        Readiness {
            cfg,
            dp,
            cni,
            cni_inode,
            csi,
            devices,
            dra,
            verified: HashMap::new(),
            book,
            policy: None,
            encryption: None,
            pool,
        }
    }

    /// Judge NetworkPolicy enforcement from now on (`networkpolicy`): registered only when
    /// it is off at start (br_netfilter not loaded, …), so a sound node's conditions are
    /// as before; it turns ready once [`PolicyClient::enforcement`] holds (the module loaded
    /// later).
    ///
    /// [`PolicyClient::enforcement`]: super::policy_sync::PolicyClient::enforcement
    pub(crate) fn watch_policy(&mut self, health: &Health, client: Arc<super::policy_sync::PolicyClient>) {
        if let Err(why) = client.enforcement() {
            let cond = health.condition("networkpolicy");
            cond.set(false, why);
            self.policy = Some((client, cond));
        }
    }

    /// Judge encryption between nodes from now on (`encryption`): registered once the
    /// controller asks for it, so a node without encryption has the conditions it had.
    pub(crate) fn watch_encryption(&mut self, health: &Health, link: Arc<super::cluster::Link>) {
        self.encryption = Some((link, health.clone(), None));
    }

    /// Re-evaluate every `TICK` until dropped (the task is aborted at shutdown).
    pub(crate) async fn run(mut self) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.check().await;
        }
    }

    pub(crate) async fn check(&mut self) {
        self.book.warn_overdue();
        let cni = self.cni_state();
        set(&self.cni, cni);
        if let Some((svc, cond)) = self.csi.clone() {
            let st = self.csi_state(&svc).await;
            set(&cond, st);
        }
        if let Some(d) = self.devices.take() {
            let st = self.devices_state(&d).await;
            set(&d.cond, st);
            self.devices = Some(d);
        }
        if let Some((s, cond)) = self.dra.clone() {
            let st = self.dra_state(&s).await;
            set(&cond, st);
        }
        if let Some((client, cond)) = &self.policy {
            set(cond, client.enforcement());
        }
        if let Some(p) = &mut self.pool
            && p.last.is_none_or(|t| t.elapsed() >= POOL_CHECK)
        {
            p.last = Some(std::time::Instant::now());
            let svc = p.svc.clone();
            let st = tokio::task::spawn_blocking(move || pool_state(&svc)).await.unwrap_or_else(|e| Err(e.to_string()));
            let short = st.is_err();
            if short && !p.short {
                tracing::warn!(reason = %st.as_ref().unwrap_err(), "storage pool short: no capacity is offered for new volumes");
            } else if !short && p.short {
                tracing::info!("storage pool no longer short");
            }
            p.short = short;
            set(&p.cond, st);
        }
        if let Some((link, health, cond)) = &mut self.encryption {
            let on = link.encryption().0 != crate::net::wireguard::Mode::Off;
            if on && cond.is_none() {
                *cond = Some(health.condition("encryption"));
            }
            if let Some(c) = cond {
                set(c, link.encryption_state());
            }
        }
    }

    async fn dra_state(&mut self, s: &crate::devices::dra::Settings) -> Result<(), String> {
        for sock in [s.socket(), s.registration_socket()] {
            if !self.served(&sock).await {
                return Err(format!("DRA socket {} is not served yet", sock.display()));
            }
        }
        self.book.condition(crate::kubelet::Kind::Dra)
    }

    fn cni_state(&self) -> Result<(), String> {
        let cfg = &self.cfg;
        if !self.dp.ready() {
            return Err(match &cfg.controller {
                Some(_) => {
                    "no pod CIDR block yet: waiting for the controller to assign one (the conflist is written then)"
                        .into()
                }
                None => "no pod CIDR block: podCidrs is empty".into(),
            });
        }
        let conflist = cfg.conflist_path();
        if !conflist.is_file() {
            return Err(format!("conflist {} is missing", conflist.display()));
        }
        let sock = &cfg.cni_socket;
        match std::fs::symlink_metadata(sock) {
            Ok(m) if m.file_type().is_socket() && Some(m.ino()) == self.cni_inode => Ok(()),
            Ok(_) => Err(format!("CNI socket {} was replaced by something else", sock.display())),
            Err(e) => Err(format!("CNI socket {}: {e}", sock.display())),
        }
    }

    async fn csi_state(&mut self, svc: &crate::storage::csi::NodeService) -> Result<(), String> {
        let kubelet = &svc.settings.kubelet_dir;
        let csi_sock = crate::storage::csi::csi_socket(kubelet);
        if !self.served(&csi_sock).await {
            return Err(format!("CSI socket {} is not served yet", csi_sock.display()));
        }
        if !svc.ready() {
            return Err("recovering volume state (records, mount table, loop devices)".into());
        }
        if !self.cfg.csi.as_ref().is_some_and(|c| c.self_register) {
            return Ok(()); // node-driver-registrar registers the driver
        }
        let reg = crate::storage::csi::registration_socket(kubelet);
        if !self.served(&reg).await {
            return Err(format!("kubelet registration socket {} is not served yet", reg.display()));
        }
        self.book.condition(crate::kubelet::Kind::Csi)
    }

    async fn devices_state(&mut self, d: &Devices) -> Result<(), String> {
        if d.ended.load(Ordering::SeqCst) {
            return Err("the device plugin manager stopped (see the log)".into());
        }
        let file = &d.settings.config_file;
        let resources = match crate::devices::config::load(file) {
            Ok((resources, _)) => crate::devices::deviceplugin::offered_here(resources),
            Err(crate::devices::config::LoadError::Parse(e)) => {
                return Err(format!("device file {} unusable: {e}", file.display()));
            }
            Err(crate::devices::config::LoadError::Read(e)) => {
                return Err(format!("device file {}: {e}", file.display()));
            }
        };
        let mut waiting = Vec::new();
        for r in resources {
            let socket = r.socket_name();
            if !self.served(&d.settings.plugin_dir.join(&socket)).await {
                waiting.push(format!("{} ({socket})", r.resource_name()));
            }
        }
        if waiting.is_empty() {
            self.book.condition(crate::kubelet::Kind::DevicePlugin)
        } else {
            Err(format!("device plugin not served yet: {}", waiting.join(", ")))
        }
    }

    /// Is a server listening on the Unix socket at `path`? (see the module comment)
    async fn served(&mut self, path: &Path) -> bool {
        let Ok(m) = std::fs::symlink_metadata(path) else {
            self.verified.remove(path);
            return false;
        };
        if !m.file_type().is_socket() {
            return false;
        }
        if self.verified.get(path) == Some(&m.ino()) {
            return true;
        }
        let connected = tokio::time::timeout(Duration::from_secs(1), tokio::net::UnixStream::connect(path))
            .await
            .is_ok_and(|r| r.is_ok());
        if connected {
            self.verified.insert(path.to_path_buf(), m.ino());
        }
        connected
    }
}

fn set(cond: &Condition, state: Result<(), String>) {
    match state {
        Ok(()) => cond.set(true, "ok"),
        Err(detail) => cond.set(false, detail),
    }
}

/// The thin pool's state for the `storage-pool` condition.
fn pool_state(svc: &crate::storage::csi::NodeService) -> Result<(), String> {
    match svc.store.pool_usage() {
        Ok(Some(u)) if u.short => Err(format!(
            "thin pool {} is short: data {:.1}%, metadata {:.1}% used (at {POOL_SHORT_PERCENT}% no new volume is placed here; extend the pool)",
            u.pool, u.data_percent, u.metadata_percent
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}
