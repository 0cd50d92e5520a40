//! Root-only: the agent as a CSI node plugin, driven over its real sockets by a kubelet
//! emulator, with real loop devices, filesystems and mounts.
//!
//! Each test runs its own agent (`nodeplane-agent` in a private network namespace made by
//! `unshare --net`, sharing this process' mount namespace so its mounts are visible in
//! `/proc/self/mountinfo` here) with its whole tree — kubelet dir, state, volume store —
//! in a sandbox directory `/tmp/npcsi-<pid>-<test>` (short: socket paths are limited). The sandbox guard, dropped also when
//! a test panics, kills that agent by PID, unmounts everything under the sandbox, detaches
//! every loop device bound to a file under it and removes it. Every test also asserts
//! itself that nothing leaked before it ends.
//!
//! Conformance: `conformance_*` tests check one MUST / error code of the Identity and Node
//! RPCs each (the CSI spec's error tables), from real bad requests.
//!
//! Every test about volume behaviour runs on both backends: the test here on `file`, its
//! namesake in [`lvm`] on `lvm` (the sandbox's agent given a thin pool, its volumes made
//! there; device-mapper: the VM lane only). The sandbox's accessors ([`Sandbox::backing`],
//! [`Sandbox::devices_of`], [`Sandbox::assert_clean`]) say the same thing for either.
//!
//! These tests need root and FAIL (never skip) without it.

#[path = "../tools/support/kubelet_registration.rs"]
mod kubelet;

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nodeplane::rpc::csi;
use nodeplane::rpc::csi::volume_capability::access_mode::Mode;
use nodeplane::rpc::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use nodeplane::rpc::node as napi;
use nodeplane::storage::store::Backend;
use tonic::Code;
use tonic::transport::Channel;

const AGENT: &str = env!("CARGO_BIN_EXE_nodeplane-agent");
const MIB: u64 = 1 << 20;

fn require_root() {
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "tests/csi_root.rs needs root (it runs the agent, binds loop devices and mounts). It does not skip."
    );
    assert!(Path::new("/dev/loop-control").exists(), "/dev/loop-control is missing (is the loop module loaded?)");
    for tool in ["unshare", "blkid", "mkfs.ext4", "mkfs.xfs", "xfs_growfs", "resize2fs", "e2fsck", "losetup"] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false)
            || ["/usr/sbin", "/sbin", "/usr/bin"].iter().any(|d| Path::new(d).join(tool).is_file());
        assert!(found, "required tool {tool:?} is not installed (Debian: util-linux, e2fsprogs, xfsprogs)");
    }
}

// ----- sandbox, agent, cleanup -----

/// Shared with tests/lvm_root.rs, which runs the agent with a thin pool.
pub(crate) struct Sandbox {
    pub(crate) dir: PathBuf,
    agent: Option<Child>,
    pub(crate) crash_at: Option<String>,
    /// The agent's RUST_LOG (tests/crypt_root.rs runs it at debug: the key must not show
    /// even there).
    pub(crate) log_level: &'static str,
    /// Where [`Clients::create`] makes volumes.
    backend: Backend,
    /// `lvm`: the agent's thin pool (dropped after the sandbox's own cleanup: it removes
    /// the VG).
    pool: Option<crate::lvm_root::Pool>,
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// (mount point, fs type, major:minor, root, options) of every mount.
fn mounts() -> Vec<(PathBuf, String, String, String, String)> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let f: Vec<&str> = pre.split(' ').collect();
            Some((
                PathBuf::from(unescape(f[4])),
                post.split(' ').next()?.to_string(),
                f[2].to_string(),
                unescape(f[3]),
                f[5].to_string(),
            ))
        })
        .collect()
}

pub(crate) fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    mounts().into_iter().map(|m| m.0).filter(|p| p.starts_with(dir)).collect()
}

pub(crate) fn mounted_at(p: &Path) -> Option<(String, String, String)> {
    mounts().into_iter().rev().find(|m| m.0 == p).map(|m| (m.1, m.2, m.4))
}

/// Loop devices whose backing file lies under `dir` (also deleted ones).
fn loops_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file")) {
            let b = b.trim().trim_end_matches(" (deleted)");
            if Path::new(b).starts_with(dir) {
                out.push(PathBuf::from(format!("/dev/{name}")));
            }
        }
    }
    out
}

/// Device-mapper mappings (names) over the loop devices `loops` (dm-crypt mappings of
/// encrypted volumes: tests/crypt_root.rs).
fn mappings_over(loops: &[PathBuf]) -> Vec<String> {
    let names: Vec<String> = loops.iter().filter_map(|l| l.file_name()).map(|n| n.to_string_lossy().into()).collect();
    let mut out = Vec::new();
    for e in fs::read_dir("/sys/block").unwrap().flatten() {
        let Ok(name) = fs::read_to_string(e.path().join("dm/name")) else { continue };
        let over = fs::read_dir(e.path().join("slaves"))
            .is_ok_and(|d| d.flatten().any(|s| names.contains(&s.file_name().to_string_lossy().into_owned())));
        if over {
            out.push(name.trim().to_string());
        }
    }
    out
}

fn cleanup(dir: &Path) -> Vec<String> {
    let mut leftovers = Vec::new();
    let mut ms = mounts_under(dir);
    ms.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for m in ms {
        leftovers.push(format!("mount {}", m.display()));
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    for name in mappings_over(&loops_under(dir)) {
        leftovers.push(format!("mapping {name}"));
        let _ = Command::new("cryptsetup").env("DM_DISABLE_UDEV", "1").args(["close", &name]).status();
    }
    for d in loops_under(dir) {
        leftovers.push(format!("loop {}", d.display()));
        let _ = Command::new("losetup").arg("-d").arg(&d).status();
    }
    let _ = fs::remove_dir_all(dir);
    leftovers
}

impl Sandbox {
    pub(crate) fn new(name: &str) -> Sandbox {
        Self::with_csi(name, serde_json::json!({"capacityBytes": 4u64 << 30, "maxVolumes": 16}))
    }

    /// [`Self::new`] with its volumes on `backend`. `lvm`: a thin pool of the file
    /// backend's capacity (4 GiB, not overprovisioned) in the agent's config, and its own
    /// directory (both variants of a test may run at once).
    pub(crate) fn on(name: &str, backend: Backend) -> Sandbox {
        if backend == Backend::File {
            return Self::new(name);
        }
        let pool = crate::lvm_root::Pool::new("csi-root", 4096);
        let lvm = serde_json::json!({"volumeGroup": pool.vg, "thinPool": "pool", "overprovisionRatio": 1});
        let csi = serde_json::json!({"capacityBytes": 4u64 << 30, "maxVolumes": 16, "lvm": lvm});
        let mut sb = Self::with_csi(&format!("{name}-lvm"), csi);
        sb.backend = backend;
        sb.pool = Some(pool);
        sb
    }

    /// A sandbox whose agent config has `csi` as its `csi` section.
    pub(crate) fn with_csi(name: &str, csi: serde_json::Value) -> Sandbox {
        require_root();
        // Short: Unix socket paths (kubelet dir + plugins_registry/…-reg.sock) must fit
        // in 108 bytes, so not under the (arbitrarily deep) cargo target dir.
        let dir = PathBuf::from("/tmp").join(format!("npcsi-{}-{name}", std::process::id()));
        if dir.exists() {
            cleanup(&dir);
        }
        fs::create_dir_all(&dir).unwrap();
        let dir = dir.canonicalize().unwrap();
        let cfg = serde_json::json!({
            "nodeName": format!("csi-{name}"),
            "root": dir.join("root"),
            "shimSource": crate::shim(),
            "csi": csi,
        });
        fs::write(dir.join("agent.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
        Sandbox { dir, agent: None, crash_at: None, log_level: "info", backend: Backend::File, pool: None }
    }
    /// `lvm`: the thin pool the agent's config names.
    pub(crate) fn thin_pool(&self) -> Option<nodeplane::storage::store::ThinPoolConfig> {
        self.pool.as_ref().map(|p| p.config(1.0))
    }
    pub(crate) fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
    pub(crate) fn kubelet(&self) -> PathBuf {
        self.root().join("var/lib/kubelet")
    }
    fn csi_sock(&self) -> PathBuf {
        self.kubelet().join("plugins/csi.nodeplane.dev/csi.sock")
    }
    fn reg_sock(&self) -> PathBuf {
        self.kubelet().join("plugins_registry/csi.nodeplane.dev-reg.sock")
    }
    fn node_sock(&self) -> PathBuf {
        self.root().join("run/nodeplane/node.sock")
    }
    pub(crate) fn volume_dir(&self) -> PathBuf {
        self.root().join("var/lib/nodeplane/volumes")
    }
    /// A file volume's image.
    pub(crate) fn image(&self, id: &str) -> PathBuf {
        self.volume_dir().join(format!("{id}.img"))
    }
    /// Where volume `id`'s bytes are: its image, or its LV's device node (`/dev/<vg>/np-<id>`).
    pub(crate) fn backing(&self, id: &str) -> PathBuf {
        match &self.pool {
            None => self.image(id),
            Some(p) => PathBuf::from("/dev").join(&p.vg).join(format!("np-{id}")),
        }
    }
    /// Whether volume `id`'s bytes are still there: its image, or its LV.
    pub(crate) fn volume_exists(&self, id: &str) -> bool {
        match &self.pool {
            None => self.image(id).exists(),
            Some(p) => p.lvs().iter().any(|l| l == &format!("np-{id}") || l.starts_with(&format!("np-{id}+"))),
        }
    }
    /// Where a test moves volume `id`'s backing path to lose it (the same filesystem).
    fn aside(&self, id: &str) -> PathBuf {
        match &self.pool {
            None => self.dir.join("moved.img"),
            Some(_) => self.backing(id).with_file_name(format!("moved-{id}")),
        }
    }
    /// The devices volume `id` is reachable through, read-write first: the loop devices
    /// bound to its image; or its LV (active from its create on) and the read-only loop
    /// devices over it.
    fn devices_of(&self, id: &str) -> Vec<PathBuf> {
        let backing = self.backing(id);
        let mut out = Vec::new();
        if let Some(p) = &self.pool
            && p.lvs().contains(&format!("np-{id}"))
        {
            out.push(backing.clone());
        }
        let target = backing.canonicalize().ok();
        for e in fs::read_dir("/sys/block").unwrap().flatten() {
            let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file")) else { continue };
            let b = PathBuf::from(b.trim().trim_end_matches(" (deleted)"));
            if b == backing || (target.is_some() && b.canonicalize().ok() == target) {
                out.push(PathBuf::from("/dev").join(e.file_name()));
            }
        }
        out
    }
    /// Volume `id` is released by the node: no loop device bound to its image; or (`lvm`,
    /// whose LV stays active) its LV open by nobody and no loop device over it.
    fn released(&self, id: &str) -> bool {
        match &self.pool {
            None => self.devices_of(id).is_empty(),
            Some(p) => self.devices_of(id).len() <= 1 && !p.open_lvs().contains(&format!("np-{id}")),
        }
    }
    pub(crate) fn stage_record(&self, id: &str) -> PathBuf {
        self.root().join("var/lib/nodeplane/csi/stage").join(format!("{id}.json"))
    }
    pub(crate) fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }
    /// kubelet's staging path for a volume (kubelet creates its parent).
    pub(crate) fn staging(&self, id: &str, block: bool) -> String {
        let p = if block {
            self.kubelet().join(format!("plugins/kubernetes.io/csi/volumeDevices/staging/{id}"))
        } else {
            self.kubelet().join(format!("plugins/kubernetes.io/csi/pv/{id}/globalmount"))
        };
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        p.to_string_lossy().into_owned()
    }
    /// kubelet's target path for a volume in a pod (kubelet creates its parent; the plugin
    /// creates the target).
    pub(crate) fn target(&self, id: &str, pod: &str, block: bool) -> String {
        let p = if block {
            self.kubelet().join(format!("plugins/kubernetes.io/csi/volumeDevices/publish/{id}/{pod}"))
        } else {
            self.kubelet().join(format!("pods/{pod}/volumes/kubernetes.io~csi/{id}/mount"))
        };
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        p.to_string_lossy().into_owned()
    }

    /// Start the agent and wait until it is ready (registration socket served).
    pub(crate) async fn start(&mut self) -> Clients {
        assert!(self.agent.is_none(), "agent already running");
        let _ = fs::remove_file(self.reg_sock());
        let log = OpenOptions::new().create(true).append(true).open(self.dir.join("agent.log")).unwrap();
        let mut cmd = Command::new("unshare");
        cmd.arg("--net")
            .arg("--")
            .arg(AGENT)
            .arg("--config")
            .arg(self.dir.join("agent.json"))
            .env("RUST_LOG", self.log_level)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        match &self.crash_at {
            Some(p) => cmd.env("NODEPLANE_CRASH_AT", p),
            None => cmd.env_remove("NODEPLANE_CRASH_AT"),
        };
        // Right after a crash the state-dir lock may still be held for a moment (a child the
        // dead agent was spawning shares it until it execs): the agent waits for it itself.
        self.agent = Some(cmd.spawn().expect("starting the agent"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.reg_sock().exists() {
            if let Some(st) = self.agent.as_mut().unwrap().try_wait().unwrap() {
                panic!("agent exited during start-up ({st}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "agent not ready within 20 s:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Clients::connect(self).await
    }

    pub(crate) fn kill9(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Wait for the agent to die by itself (a crash point), up to `within`.
    pub(crate) fn wait_crashed(&mut self, within: Duration) {
        let mut c = self.agent.take().expect("agent running");
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                assert!(!st.success(), "agent exited cleanly, expected a crash");
                return;
            }
            assert!(Instant::now() < deadline, "agent did not crash within {within:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub(crate) async fn stop(&mut self) {
        if let Some(mut c) = self.agent.take() {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM)
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Some(st) = c.try_wait().unwrap() {
                    assert!(st.success(), "agent exited with {st}:\n{}", self.log());
                    break;
                }
                assert!(Instant::now() < deadline, "agent did not stop on SIGTERM");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }

    /// Nothing of this sandbox is mounted or attached any more; on `lvm` also no mapping or
    /// loop device over its LVs, and none of them open.
    pub(crate) fn assert_clean(&self) {
        let m = mounts_under(&self.dir);
        assert!(m.is_empty(), "leaked mounts: {m:?}");
        let l = loops_under(&self.dir);
        assert!(mappings_over(&l).is_empty(), "leaked mappings: {:?}", mappings_over(&l));
        assert!(l.is_empty(), "leaked loop devices: {l:?}");
        if let Some(p) = &self.pool {
            assert!(p.mappings_over_lvs().is_empty(), "leaked mappings over LVs: {:?}", p.mappings_over_lvs());
            assert!(p.loops_over_lvs().is_empty(), "leaked loop devices over LVs: {:?}", p.loops_over_lvs());
            assert!(p.open_lvs().is_empty(), "LVs left open: {:?}", p.open_lvs());
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.kill9();
        let mut left = cleanup(&self.dir);
        // `lvm`: every test deletes its volumes; nothing of ours may be left in the pool
        // (its own drop, next, removes the VG whatever is in it).
        if let Some(p) = &self.pool {
            left.extend(p.mappings_over_lvs().into_iter().map(|m| format!("mapping {m}")));
            left.extend(p.loops_over_lvs().into_iter().map(|l| format!("loop {}", l.display())));
            let lvs = p.volume_lvs();
            if !lvs.is_empty() && !std::thread::panicking() {
                panic!("LVs left in {}: {lvs:?}", p.vg);
            }
        }
        if !left.is_empty() && !std::thread::panicking() {
            eprintln!("sandbox cleanup removed leftovers: {left:?}");
        }
    }
}

/// `call`, on a copy of the client, until its answer is anything but an unmount's EBUSY
/// ([`crate::BUSY_RETRIES`]).
async fn retry_busy<F, Fut>(node: &csi::node_client::NodeClient<Channel>, call: F) -> Result<(), tonic::Status>
where
    F: Fn(csi::node_client::NodeClient<Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let mut attempt = 1;
    loop {
        let r = call(node.clone()).await;
        if !crate::busy_unmount(&r, attempt) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        attempt += 1;
    }
}

pub(crate) struct Clients {
    identity: csi::identity_client::IdentityClient<Channel>,
    pub(crate) node: csi::node_client::NodeClient<Channel>,
    pub(crate) vols: napi::node_volumes_client::NodeVolumesClient<Channel>,
    /// Where [`Self::create`] makes volumes: the sandbox's backend ("" for `file`).
    backend: &'static str,
}

impl Clients {
    /// Another handle on the same channels, for a spawned task.
    fn clone_for_task(&self) -> Clients {
        Clients {
            identity: self.identity.clone(),
            node: self.node.clone(),
            vols: self.vols.clone(),
            backend: self.backend,
        }
    }

    async fn connect(sb: &Sandbox) -> Clients {
        let ch = nodeplane::rpc::connect_unix(&sb.csi_sock()).await.expect("dialing csi.sock");
        let nch = nodeplane::rpc::connect_unix(&sb.node_sock()).await.expect("dialing node.sock");
        Clients {
            identity: csi::identity_client::IdentityClient::new(ch.clone()),
            node: csi::node_client::NodeClient::new(ch),
            vols: napi::node_volumes_client::NodeVolumesClient::new(nch),
            backend: if sb.backend == Backend::Lvm { "lvm" } else { "" },
        }
    }

    /// Create volume `id` on the sandbox's backend.
    pub(crate) async fn create(&mut self, id: &str, size: u64, fs: &str) -> napi::Volume {
        let backend = self.backend;
        self.create_on(id, size, fs, backend).await
    }
    pub(crate) async fn create_on(&mut self, id: &str, size: u64, fs: &str, backend: &str) -> napi::Volume {
        self.vols
            .create_volume(napi::CreateVolumeRequest {
                id: id.into(),
                size_bytes: size,
                fs_type: fs.into(),
                backend: backend.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("creating {id}: {e}"))
            .into_inner()
            .volume
            .unwrap()
    }
    pub(crate) async fn delete(&mut self, id: &str) -> Result<(), tonic::Status> {
        self.vols.delete_volume(napi::DeleteVolumeRequest { id: id.into() }).await.map(|_| ())
    }
    pub(crate) async fn stage(
        &mut self,
        id: &str,
        staging: &str,
        cap: csi::VolumeCapability,
    ) -> Result<(), tonic::Status> {
        self.stage_with(id, staging, cap, None).await
    }
    /// NodeStageVolume; `key`: `Some` stages with `encryption: luks2` and that key
    /// (`Some("")`: encrypted, without a key), `None` without encryption.
    pub(crate) async fn stage_with(
        &mut self,
        id: &str,
        staging: &str,
        cap: csi::VolumeCapability,
        key: Option<&str>,
    ) -> Result<(), tonic::Status> {
        let mut req = csi::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            volume_capability: Some(cap),
            ..Default::default()
        };
        if let Some(k) = key {
            req.volume_context.insert("encryption".into(), "luks2".into());
            if !k.is_empty() {
                req.secrets.insert("key".into(), k.into());
            }
        }
        self.node.node_stage_volume(req).await.map(|_| ())
    }
    /// NodeUnstageVolume, retried on an unmount's EBUSY ([`crate::BUSY_RETRIES`]).
    pub(crate) async fn unstage(&mut self, id: &str, staging: &str) -> Result<(), tonic::Status> {
        let req = csi::NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging.into() };
        retry_busy(&self.node, |mut n| {
            let req = req.clone();
            async move { n.node_unstage_volume(req).await.map(|_| ()) }
        })
        .await
    }
    pub(crate) async fn publish(
        &mut self,
        id: &str,
        staging: &str,
        target: &str,
        cap: csi::VolumeCapability,
        ro: bool,
    ) -> Result<(), tonic::Status> {
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.into(),
                target_path: target.into(),
                volume_capability: Some(cap),
                readonly: ro,
                ..Default::default()
            })
            .await
            .map(|_| ())
    }
    /// NodeUnpublishVolume, retried on an unmount's EBUSY ([`crate::BUSY_RETRIES`]).
    pub(crate) async fn unpublish(&mut self, id: &str, target: &str) -> Result<(), tonic::Status> {
        let req = csi::NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.into() };
        retry_busy(&self.node, |mut n| {
            let req = req.clone();
            async move { n.node_unpublish_volume(req).await.map(|_| ()) }
        })
        .await
    }
    pub(crate) async fn stats(
        &mut self,
        id: &str,
        path: &str,
    ) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
        self.node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: id.into(),
                volume_path: path.into(),
                staging_target_path: String::new(),
            })
            .await
            .map(|r| r.into_inner())
    }
    pub(crate) async fn expand(
        &mut self,
        id: &str,
        path: &str,
        required: u64,
        limit: u64,
    ) -> Result<i64, tonic::Status> {
        self.node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: id.into(),
                volume_path: path.into(),
                capacity_range: Some(csi::CapacityRange { required_bytes: required as i64, limit_bytes: limit as i64 }),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().capacity_bytes)
    }
}

fn mount_cap(fs: &str, mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

fn block_cap(mode: Mode) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub(crate) fn cap_for(fs: &str) -> csi::VolumeCapability {
    if fs.is_empty() { block_cap(Mode::SingleNodeWriter) } else { mount_cap(fs, Mode::SingleNodeWriter) }
}

#[track_caller]
pub(crate) fn assert_code<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, what: &str) -> String {
    match r {
        Err(s) if s.code() == code => s.message().to_string(),
        other => panic!("{what}: expected {code:?}, got {other:?}"),
    }
}

pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

// ----- full lifecycle -----

async fn lifecycle(backend: Backend, fs_type: &str, size: u64) {
    let name = if fs_type.is_empty() { "block" } else { fs_type };
    let mut sb = Sandbox::on(&format!("life-{name}"), backend);
    let mut c = sb.start().await;
    let block = fs_type.is_empty();
    let id = format!("pvc-life-{name}");
    let v = c.create(&id, size, fs_type).await;
    assert_eq!(v.size_bytes, size);
    assert!(sb.volume_exists(&id));
    let staging = sb.staging(&id, block);
    let t1 = sb.target(&id, "pod-a", block);
    let t2 = sb.target(&id, "pod-b", block);
    let cap = cap_for(fs_type);
    let data = pattern(256 * 1024, 7);

    for round in 0..2 {
        // stage, twice
        for _ in 0..2 {
            c.stage(&id, &staging, cap.clone()).await.unwrap();
        }
        let devices = sb.devices_of(&id);
        assert_eq!(devices.len(), 1, "the volume is attached to one device after stage: {devices:?}");
        if !block {
            let (fst, _, _) = mounted_at(Path::new(&staging)).expect("staging path is a mount");
            assert_eq!(fst, fs_type);
        }
        // publish rw, twice; then a second target read-only, twice
        for _ in 0..2 {
            c.publish(&id, &staging, &t1, cap.clone(), false).await.unwrap();
        }
        for _ in 0..2 {
            c.publish(&id, &staging, &t2, cap.clone(), true).await.unwrap();
        }
        assert!(mounted_at(Path::new(&t1)).is_some() && mounted_at(Path::new(&t2)).is_some());
        assert!(mounted_at(Path::new(&t2)).unwrap().2.split(',').any(|o| o == "ro"), "second target is read-only");
        // kubelet repeats NodeStage for every pod using the volume: still staged, nothing
        // disturbed.
        c.stage(&id, &staging, cap.clone()).await.unwrap();
        assert!(mounted_at(Path::new(&t1)).is_some() && mounted_at(Path::new(&t2)).is_some());
        // Incompatible republish of an existing target.
        assert_code(
            c.publish(&id, &staging, &t2, cap.clone(), false).await,
            Code::AlreadyExists,
            "rw republish of a ro target",
        );

        if round == 0 {
            // Write through the rw target.
            if block {
                let f = OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&t1).unwrap();
                let mut buf = AlignedBuf::new(data.len());
                buf.as_mut().copy_from_slice(&data);
                f.write_all_at(buf.as_ref(), MIB).unwrap();
                f.sync_all().unwrap();
            } else {
                let mut f = fs::File::create(Path::new(&t1).join("data.bin")).unwrap();
                f.write_all(&data).unwrap();
                f.sync_all().unwrap();
            }
        }
        // The read-only target sees the data; writes through it fail.
        if block {
            let got = read_direct(Path::new(&t2), MIB, data.len());
            assert_eq!(got, data, "data through the read-only device");
            let w = OpenOptions::new().write(true).open(&t2).and_then(|mut f| {
                f.seek(SeekFrom::Start(0))?;
                f.write_all(b"nope")?;
                f.sync_all()
            });
            assert!(w.is_err(), "writing through the read-only block target succeeded");
        } else {
            let got = fs::read(Path::new(&t2).join("data.bin")).unwrap();
            assert_eq!(got, data, "data through the read-only target (round {round})");
            let e = fs::File::create(Path::new(&t2).join("nope")).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "write through the ro target: {e}");
            // And through the rw target the data is there too.
            assert_eq!(fs::read(Path::new(&t1).join("data.bin")).unwrap(), data);
        }
        // Unstaging while published is refused.
        assert_code(c.unstage(&id, &staging).await, Code::FailedPrecondition, "unstage while published");
        // Deleting while staged is refused.
        assert_code(c.delete(&id).await, Code::FailedPrecondition, "delete while staged");
        // unpublish both, twice; the targets the plugin created are gone.
        for t in [&t1, &t2] {
            for _ in 0..2 {
                c.unpublish(&id, t).await.unwrap();
            }
            assert!(mounted_at(Path::new(t)).is_none());
            assert!(!Path::new(t).exists(), "{t} left behind by unpublish");
        }
        if !block && round == 0 {
            // The filesystem also mounted where no record says (a bind mount of the staging
            // dir made by hand): unstage refuses and names it, and the volume is staged as
            // before (the staging mount is put back after the detach found the device held).
            let by_hand = sb.dir.join(format!("by-hand-{name}"));
            fs::create_dir_all(&by_hand).unwrap();
            nix::mount::mount(
                Some(Path::new(&staging)),
                &by_hand,
                None::<&str>,
                nix::mount::MsFlags::MS_BIND,
                None::<&str>,
            )
            .unwrap();
            let msg =
                assert_code(c.unstage(&id, &staging).await, Code::FailedPrecondition, "unstage while mounted by hand");
            assert!(msg.contains(&by_hand.display().to_string()), "{msg}");
            assert!(mounted_at(Path::new(&staging)).is_some(), "the staging mount is back");
            assert_eq!(fs::read(Path::new(&staging).join("data.bin")).unwrap(), data);
            nix::mount::umount2(&by_hand, nix::mount::MntFlags::empty()).unwrap();
        }
        for _ in 0..2 {
            c.unstage(&id, &staging).await.unwrap();
        }
        assert!(mounted_at(Path::new(&staging)).is_none());
        assert!(sb.released(&id), "device still bound after unstage: {:?}", sb.devices_of(&id));
        sb.assert_clean();
    }
    for _ in 0..2 {
        c.delete(&id).await.unwrap();
    }
    assert!(!sb.volume_exists(&id), "backing file left after delete");
    assert!(!sb.volume_dir().join(format!("{id}.json")).exists());
    sb.stop().await;
    sb.assert_clean();
}

/// A page-aligned buffer for O_DIRECT I/O on loop devices (so the test reads the device,
/// not a page cache).
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}
impl AlignedBuf {
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: non-zero size, valid layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        AlignedBuf { ptr, len }
    }
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: allocated with len bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn as_ref(&self) -> &[u8] {
        // SAFETY: allocated with len bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}
impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: same layout as allocated.
        unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align(self.len, 4096).unwrap()) }
    }
}

fn read_direct(dev: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(dev).unwrap();
    let mut buf = AlignedBuf::new(len);
    f.read_exact_at(buf.as_mut(), offset).unwrap();
    buf.as_ref().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_ext4() {
    lifecycle(Backend::File, "ext4", 64 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_xfs() {
    lifecycle(Backend::File, "xfs", 512 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_raw_block() {
    lifecycle(Backend::File, "", 64 * MIB).await;
}

// ----- registration, identity, sockets -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_registers_the_driver_and_again_after_a_restart() {
    let mut sb = Sandbox::new("register");
    let mut c = sb.start().await;
    let mut kubelet = kubelet::KubeletEmulator::new(&sb.kubelet());
    assert_eq!(kubelet.sync().await, 1, "failures: {:?}", kubelet.failures);
    let r = kubelet.driver("csi.nodeplane.dev").expect("driver registered").clone();
    assert_eq!(r.endpoint, sb.csi_sock());
    assert!(r.versions.contains(&"1.0.0".to_string()));
    assert_eq!(r.node_id, "csi-register");
    assert_eq!(r.topology.get("topology.csi.nodeplane.dev/node").map(String::as_str), Some("csi-register"));
    assert_eq!(r.max_volumes, 16);
    // The plugin heard kubelet's verdict.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !sb.log().contains("kubelet registered the CSI plugin") {
        assert!(Instant::now() < deadline, "registration status not logged:\n{}", sb.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Probe says ready once serving.
    let p = c.identity.probe(csi::ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(p.ready, Some(true));

    // Agent restart: the registration socket is replaced; kubelet registers it again.
    sb.kill9();
    assert_eq!(kubelet.sync().await, 0);
    let _c = sb.start().await;
    assert_eq!(kubelet.sync().await, 1, "failures: {:?}", kubelet.failures);
    assert!(kubelet.driver("csi.nodeplane.dev").is_some());
    // A clean stop removes the registration socket (kubelet deregisters).
    sb.stop().await;
    assert!(!sb.reg_sock().exists() && !sb.csi_sock().exists() && !sb.node_sock().exists());
    kubelet.sync().await;
    assert!(kubelet.driver("csi.nodeplane.dev").is_none());
}

/// kubelet's plugin watcher (grpc-go) sends the registration socket's path, percent-encoded,
/// as `:authority`; grpcio sends it without the leading slash; other tools the raw path or
/// none. Every form registers, and every other socket of the agent answers each form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_socket_accepts_the_authorities_real_clients_send() {
    use nodeplane::rpc::authority::{connect_unix_with_authority, percent_encoded_path, valid_authority};
    let mut sb = Sandbox::new("authority");
    let _c = sb.start().await;
    let reg = sb.reg_sock();
    let forms = |p: &Path| -> Vec<(&'static str, Option<Vec<u8>>)> {
        let grpcio = percent_encoded_path(p.strip_prefix("/").unwrap());
        vec![
            ("grpc-go percent-encoded path", Some(percent_encoded_path(p))),
            ("grpcio percent-encoded path", Some(grpcio)),
            ("raw path", Some(p.as_os_str().as_encoded_bytes().to_vec())),
            ("localhost", Some(b"localhost".to_vec())),
            ("absent", None),
        ]
    };
    let md = fs::metadata(&reg).unwrap();
    let ino = (md.ino(), md.ctime(), md.ctime_nsec());
    for (what, auth) in forms(&reg) {
        // The forms that broke kubelet are ones the HTTP/2 server's own parser refuses.
        if what.contains("path") {
            assert!(!valid_authority(auth.as_deref().unwrap()), "{what} would not exercise the fix");
        }
        let r = kubelet::register_with(&reg, ino, auth.clone())
            .await
            .unwrap_or_else(|e| panic!("registration with {what}: {e}"));
        assert_eq!(r.endpoint, sb.csi_sock(), "{what}");
        assert_eq!(r.node_id, "csi-authority", "{what}");
    }
    for (what, auth) in forms(&sb.csi_sock()) {
        let ch = connect_unix_with_authority(&sb.csi_sock(), auth).await.unwrap();
        let info = csi::identity_client::IdentityClient::new(ch).get_plugin_info(csi::GetPluginInfoRequest {}).await;
        assert_eq!(info.unwrap_or_else(|e| panic!("csi.sock with {what}: {e}")).into_inner().name, "csi.nodeplane.dev");
    }
    for (what, auth) in forms(&sb.node_sock()) {
        let ch = connect_unix_with_authority(&sb.node_sock(), auth).await.unwrap();
        let st = napi::node_status_client::NodeStatusClient::new(ch).get_status(napi::GetStatusRequest {}).await;
        let doc =
            st.unwrap_or_else(|e| panic!("node.sock with {what}: {e}")).into_inner().status.expect("a status report");
        // The last registration (absent authority) is what kubelet's book holds now.
        let plugin = &doc.kubelet.as_ref().expect("kubelet section").plugins[0];
        assert_eq!(plugin.state(), napi::RegistrationState::Registered, "{what}: {doc:?}");
        assert_eq!(plugin.registrations, 5, "{what}: {doc:?}");
    }
    sb.stop().await;
}

/// kubelet tears a shared volume down in one pass: every pod's NodeUnpublish at once, and it
/// backs off 0.5, 1, 2 s… on ABORTED. Different targets of one volume are served
/// concurrently; publishes of one volume are serialised (waiting, not ABORTED).
async fn many_targets(backend: Backend, n: usize) {
    let mut sb = Sandbox::on(&format!("targets{n}"), backend);
    let mut c = sb.start().await;
    let id = format!("pvc-shared-{n}");
    c.create(&id, 256 * MIB, "ext4").await;
    let staging = sb.staging(&id, false);
    let cap = mount_cap("ext4", Mode::SingleNodeMultiWriter);
    c.stage(&id, &staging, cap.clone()).await.unwrap();
    let targets: Vec<String> = (0..n).map(|i| sb.target(&id, &format!("pod{i}"), false)).collect();
    // Publishing every pod at once (kubelet's mount pass): all succeed, none ABORTED.
    let mut calls = Vec::new();
    for t in &targets {
        let (mut node, id, staging, t, cap) = (c.node.clone(), id.clone(), staging.clone(), t.clone(), cap.clone());
        calls.push(tokio::spawn(async move {
            node.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
                target_path: t,
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
        }));
    }
    for h in calls {
        h.await.unwrap().expect("concurrent publish");
    }
    for t in &targets {
        assert!(mounted_at(Path::new(t)).is_some(), "{t} not mounted");
    }
    // Unpublish every pod at once, retrying like kubelet on ABORTED.
    let started = Instant::now();
    let aborted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut calls = Vec::new();
    for t in &targets {
        let (mut node, id, t, aborted) = (c.node.clone(), id.clone(), t.clone(), aborted.clone());
        calls.push(tokio::spawn(async move {
            let mut backoff = Duration::from_millis(500);
            loop {
                let r = node
                    .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                        volume_id: id.clone(),
                        target_path: t.clone(),
                    })
                    .await;
                match r {
                    Err(s) if s.code() == Code::Aborted => {
                        aborted.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(backoff).await;
                        backoff *= 2;
                    }
                    other => return other.map(|_| ()),
                }
            }
        }));
    }
    for h in calls {
        h.await.unwrap().expect("unpublish");
    }
    let took = started.elapsed();
    assert_eq!(aborted.load(Ordering::SeqCst), 0, "unpublishes answered ABORTED");
    eprintln!("{n} targets of one volume unpublished at once in {took:?}");
    assert!(took <= Duration::from_secs(1), "{n} unpublishes took {took:?}");
    for t in &targets {
        assert!(!Path::new(t).exists(), "{t} left behind");
    }
    assert_eq!(mounts_under(&sb.dir), vec![PathBuf::from(&staging)], "only the staging mount is left");
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();
    c.delete(&id).await.unwrap();
    sb.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_targets_of_one_volume_unpublish_concurrently() {
    many_targets(Backend::File, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_targets_of_one_volume_unpublish_concurrently() {
    many_targets(Backend::File, 20).await;
}

/// Per-target concurrency keeps the volume-wide rules: a stage racing a publish never leaves
/// a publication without its stage; SINGLE_NODE_SINGLE_WRITER admits one of two concurrent
/// publishes; concurrent read-only block unpublishes release the shared read-only device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_stage_publish_and_access_modes_stay_safe() {
    concurrent_stage_publish_and_access_modes_stay_safe_on(Backend::File).await;
}

async fn concurrent_stage_publish_and_access_modes_stay_safe_on(backend: Backend) {
    let mut sb = Sandbox::on("stagepub", backend);
    let mut c = sb.start().await;
    // A stage and a publish of the same volume at once, several times over.
    for round in 0..5 {
        let id = format!("pvc-sp{round}");
        c.create(&id, 256 * MIB, "ext4").await;
        let staging = sb.staging(&id, false);
        let target = sb.target(&id, "pod", false);
        let cap = mount_cap("ext4", Mode::SingleNodeWriter);
        let (mut a, mut b) = (c.clone_for_task(), c.clone_for_task());
        let (i1, s1, k1) = (id.clone(), staging.clone(), cap.clone());
        let stage = tokio::spawn(async move { a.stage(&i1, &s1, k1).await });
        tokio::time::sleep(Duration::from_millis(round as u64 * 3)).await;
        let (i2, s2, t2, k2) = (id.clone(), staging.clone(), target.clone(), cap.clone());
        let publish = tokio::spawn(async move { b.publish(&i2, &s2, &t2, k2, false).await });
        let (st, pb) = (stage.await.unwrap(), publish.await.unwrap());
        match (&st, &pb) {
            (Ok(()), Ok(())) => {}
            (_, Err(e)) if e.code() == Code::FailedPrecondition => {}
            (Err(e), _) if e.code() == Code::Aborted => {}
            other => panic!("round {round}: stage/publish {other:?}"),
        }
        if pb.is_ok() {
            assert!(
                mounted_at(Path::new(&staging)).is_some() && mounted_at(Path::new(&target)).is_some(),
                "round {round}"
            );
            c.unpublish(&id, &target).await.unwrap();
        }
        if st.is_err() {
            c.stage(&id, &staging, cap.clone()).await.unwrap();
        }
        c.unstage(&id, &staging).await.unwrap();
        sb.assert_clean();
        c.delete(&id).await.unwrap();
    }

    // SINGLE_NODE_SINGLE_WRITER: two publishes at once, one wins.
    let id = "pvc-single";
    c.create(id, 256 * MIB, "ext4").await;
    let staging = sb.staging(id, false);
    let single = mount_cap("ext4", Mode::SingleNodeSingleWriter);
    c.stage(id, &staging, single.clone()).await.unwrap();
    let mut calls = Vec::new();
    for pod in ["pa", "pb"] {
        let (mut cl, st, t, cap) = (c.clone_for_task(), staging.clone(), sb.target(id, pod, false), single.clone());
        calls.push(tokio::spawn(async move { (t.clone(), cl.publish(id, &st, &t, cap, false).await) }));
    }
    let mut won = Vec::new();
    for h in calls {
        match h.await.unwrap() {
            (t, Ok(())) => won.push(t),
            (_, Err(e)) => assert_eq!(e.code(), Code::FailedPrecondition, "{e}"),
        }
    }
    assert_eq!(won.len(), 1, "exactly one SINGLE_NODE_SINGLE_WRITER publish succeeds");
    c.unpublish(id, &won[0]).await.unwrap();
    c.unstage(id, &staging).await.unwrap();
    c.delete(id).await.unwrap();

    // Read-only block publications share one read-only loop device; unpublishing them all
    // at once releases it.
    let id = "pvc-roblk";
    c.create(id, 64 * MIB, "").await;
    let staging = sb.staging(id, true);
    let blk = block_cap(Mode::SingleNodeMultiWriter);
    c.stage(id, &staging, blk.clone()).await.unwrap();
    let targets: Vec<String> = (0..4).map(|i| sb.target(id, &format!("ro{i}"), true)).collect();
    for t in &targets {
        c.publish(id, &staging, t, blk.clone(), true).await.unwrap();
    }
    assert_eq!(sb.devices_of(id).len(), 2, "one read-write and one read-only device: {:?}", sb.devices_of(id));
    let mut calls = Vec::new();
    for t in &targets {
        let (mut cl, t) = (c.clone_for_task(), t.clone());
        calls.push(tokio::spawn(async move { cl.unpublish(id, &t).await }));
    }
    for h in calls {
        h.await.unwrap().expect("read-only block unpublish");
    }
    assert_eq!(sb.devices_of(id).len(), 1, "the read-only loop device is released: {:?}", sb.devices_of(id));
    c.unstage(id, &staging).await.unwrap();
    sb.assert_clean();
    c.delete(id).await.unwrap();
    sb.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_are_0600_and_refuse_unprivileged_users() {
    let mut sb = Sandbox::new("sockets");
    let _c = sb.start().await;
    for s in [sb.csi_sock(), sb.reg_sock(), sb.node_sock()] {
        let mode = fs::metadata(&s).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{} has mode {mode:o}", s.display());
        // Make the directories traversable for the test so only the socket's own mode
        // stands between an unprivileged user and the socket.
        let mut d = s.parent().unwrap().to_path_buf();
        while d.starts_with(&sb.dir) {
            let m = fs::metadata(&d).unwrap().permissions().mode();
            fs::set_permissions(&d, fs::Permissions::from_mode(m | 0o005)).unwrap();
            d.pop();
        }
        let mut d = sb.dir.clone();
        while d.pop() {
            let m = fs::metadata(&d).unwrap().permissions().mode();
            if m & 0o001 == 0 {
                fs::set_permissions(&d, fs::Permissions::from_mode(m | 0o001)).unwrap();
            }
        }
        let out = Command::new("python3")
            .arg("-c")
            .arg("import socket,sys\ns=socket.socket(socket.AF_UNIX)\ntry:\n s.connect(sys.argv[1]); print('connected')\nexcept PermissionError: print('denied')\nexcept Exception as e: print('other', e)")
            .arg(&s)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "denied", "{}: {:?}", s.display(), out);
    }
    sb.stop().await;
}

use std::os::unix::process::CommandExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_identity() {
    conformance_identity_on(Backend::File).await;
}

async fn conformance_identity_on(backend: Backend) {
    let mut sb = Sandbox::on("identity", backend);
    let mut c = sb.start().await;
    let info = c.identity.get_plugin_info(csi::GetPluginInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.name, "csi.nodeplane.dev");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    let caps = c.identity.get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}).await.unwrap().into_inner();
    use csi::plugin_capability::{Type, service, volume_expansion};
    let mut services = vec![];
    let mut expansion = vec![];
    for cap in caps.capabilities {
        match cap.r#type.unwrap() {
            Type::Service(s) => services.push(s.r#type),
            Type::VolumeExpansion(e) => expansion.push(e.r#type),
        }
    }
    services.sort();
    assert_eq!(
        services,
        vec![service::Type::ControllerService as i32, service::Type::VolumeAccessibilityConstraints as i32]
    );
    assert_eq!(expansion, vec![volume_expansion::Type::Online as i32]);
    assert_eq!(c.identity.probe(csi::ProbeRequest {}).await.unwrap().into_inner().ready, Some(true));

    let nc = c.node.node_get_capabilities(csi::NodeGetCapabilitiesRequest {}).await.unwrap().into_inner();
    use csi::node_service_capability::{Type as NT, rpc};
    let mut got: Vec<i32> = nc
        .capabilities
        .into_iter()
        .map(|c| match c.r#type.unwrap() {
            NT::Rpc(r) => r.r#type,
        })
        .collect();
    got.sort();
    let mut want = vec![
        rpc::Type::StageUnstageVolume as i32,
        rpc::Type::GetVolumeStats as i32,
        rpc::Type::ExpandVolume as i32,
        rpc::Type::VolumeCondition as i32,
        rpc::Type::SingleNodeMultiWriter as i32,
        rpc::Type::VolumeMountGroup as i32,
    ];
    want.sort();
    assert_eq!(got, want);
    sb.stop().await;
}

// ----- conformance: Node RPC error codes -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_node_errors() {
    conformance_node_errors_on(Backend::File).await;
}

async fn conformance_node_errors_on(backend: Backend) {
    let mut sb = Sandbox::on("errors", backend);
    let mut c = sb.start().await;
    let id = "pvc-err";
    c.create(id, 32 * MIB, "ext4").await;
    let staging = sb.staging(id, false);
    let target = sb.target(id, "pod-e", false);
    let cap = mount_cap("ext4", Mode::SingleNodeWriter);

    // NodeStageVolume: each required field.
    assert_code(c.stage("", &staging, cap.clone()).await, Code::InvalidArgument, "stage without volume_id");
    assert_code(c.stage(id, "", cap.clone()).await, Code::InvalidArgument, "stage without staging_target_path");
    let r = c
        .node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.clone(),
            volume_capability: None,
            ..Default::default()
        })
        .await;
    assert_code(r, Code::InvalidArgument, "stage without volume_capability");
    let no_mode = csi::VolumeCapability { access_mode: None, ..cap.clone() };
    assert_code(c.stage(id, &staging, no_mode).await, Code::InvalidArgument, "stage without access_mode");
    // Unknown volume: NOT_FOUND.
    assert_code(
        c.stage("pvc-nope", &sb.staging("pvc-nope", false), cap.clone()).await,
        Code::NotFound,
        "stage unknown",
    );
    // MULTI_NODE: exceeds capabilities.
    assert_code(
        c.stage(id, &staging, mount_cap("ext4", Mode::MultiNodeMultiWriter)).await,
        Code::FailedPrecondition,
        "stage MULTI_NODE",
    );
    // Filesystem type mismatch.
    assert_code(
        c.stage(id, &staging, mount_cap("xfs", Mode::SingleNodeWriter)).await,
        Code::InvalidArgument,
        "fs mismatch",
    );
    // Invalid ids and paths: traversal, outside the kubelet dir, through a symlink.
    // An id the store could never have made names no volume: NOT_FOUND.
    assert_code(c.stage("../../etc", &staging, cap.clone()).await, Code::NotFound, "traversal id");
    assert_code(c.stage(id, "/etc/np-stage", cap.clone()).await, Code::InvalidArgument, "path outside kubelet");
    assert_code(
        c.stage(id, &format!("{}/../../../../../etc", sb.kubelet().display()), cap.clone()).await,
        Code::InvalidArgument,
        "path with ..",
    );
    let evil = sb.kubelet().join("plugins/evil");
    std::os::unix::fs::symlink(&sb.dir, &evil).unwrap();
    assert_code(
        c.stage(id, &evil.join("globalmount").to_string_lossy(), cap.clone()).await,
        Code::InvalidArgument,
        "path through a symlink",
    );
    assert_code(
        c.stage(
            id,
            &staging,
            csi::VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume {
                    fs_type: "ext4".into(),
                    mount_flags: vec!["bind".into()],
                    volume_mount_group: String::new(),
                })),
                ..cap.clone()
            },
        )
        .await,
        Code::InvalidArgument,
        "forbidden mount flag",
    );
    // A mount flag the filesystem rejects: INVALID_ARGUMENT, and nothing left behind.
    assert_code(
        c.stage(
            id,
            &staging,
            csi::VolumeCapability {
                access_type: Some(AccessType::Mount(MountVolume {
                    fs_type: "ext4".into(),
                    mount_flags: vec!["no_such_option".into()],
                    volume_mount_group: String::new(),
                })),
                ..cap.clone()
            },
        )
        .await,
        Code::InvalidArgument,
        "mount flag the filesystem rejects",
    );
    sb.assert_clean();

    // NodePublishVolume: required fields and preconditions.
    assert_code(
        c.publish(id, &staging, &target, cap.clone(), false).await,
        Code::FailedPrecondition,
        "publish before stage",
    );
    c.stage(id, &staging, cap.clone()).await.unwrap();
    // Staged with another capability at the same path: ALREADY_EXISTS.
    let noatime = csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec!["noatime".into()],
            volume_mount_group: String::new(),
        })),
        ..cap.clone()
    };
    assert_code(c.stage(id, &staging, noatime).await, Code::AlreadyExists, "restage incompatible");
    // Staged elsewhere already.
    let other_staging = sb.kubelet().join("plugins/kubernetes.io/csi/pv/other/globalmount");
    fs::create_dir_all(other_staging.parent().unwrap()).unwrap();
    assert_code(
        c.stage(id, &other_staging.to_string_lossy(), cap.clone()).await,
        Code::FailedPrecondition,
        "stage at a second path",
    );
    assert_code(
        c.publish("", &staging, &target, cap.clone(), false).await,
        Code::InvalidArgument,
        "publish without id",
    );
    assert_code(c.publish(id, &staging, "", cap.clone(), false).await, Code::InvalidArgument, "publish without target");
    assert_code(
        c.publish(id, "", &target, cap.clone(), false).await,
        Code::FailedPrecondition,
        "publish without staging path",
    );
    let r = c
        .node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.clone(),
            target_path: target.clone(),
            volume_capability: None,
            ..Default::default()
        })
        .await;
    assert_code(r, Code::InvalidArgument, "publish without capability");
    assert_code(c.publish("pvc-nope", &staging, &target, cap.clone(), false).await, Code::NotFound, "publish unknown");
    assert_code(
        c.publish(id, &staging, "/tmp/np-escape", cap.clone(), false).await,
        Code::InvalidArgument,
        "target outside",
    );
    // SINGLE_NODE_SINGLE_WRITER: a second publication is refused.
    let single = mount_cap("ext4", Mode::SingleNodeSingleWriter);
    c.publish(id, &staging, &target, single.clone(), false).await.unwrap();
    let target2 = sb.target(id, "pod-f", false);
    assert_code(
        c.publish(id, &staging, &target2, single.clone(), false).await,
        Code::FailedPrecondition,
        "second single writer",
    );
    // Republish the same target with another capability or readonly: ALREADY_EXISTS.
    assert_code(c.publish(id, &staging, &target, single.clone(), true).await, Code::AlreadyExists, "republish ro");
    assert_code(
        c.publish(id, &staging, &target, cap.clone(), false).await,
        Code::AlreadyExists,
        "republish other mode",
    );
    // A target with someone else's mount on it.
    let foreign = sb.target(id, "pod-g", false);
    fs::create_dir_all(&foreign).unwrap();
    nix::mount::mount(Some("tmpfs"), Path::new(&foreign), Some("tmpfs"), nix::mount::MsFlags::empty(), None::<&str>)
        .unwrap();
    assert_code(
        c.publish(id, &staging, &foreign, cap.clone(), false).await,
        Code::AlreadyExists,
        "foreign mount at target",
    );
    // Unpublish of a target this volume is not published at: OK, and the foreign mount stays.
    c.unpublish(id, &foreign).await.unwrap();
    assert!(mounted_at(Path::new(&foreign)).is_some(), "unpublish removed a mount that was not the volume's");
    nix::mount::umount(Path::new(&foreign)).unwrap();

    // NodeGetVolumeStats.
    assert_code(c.stats("", &target).await, Code::InvalidArgument, "stats without id");
    assert_code(c.stats(id, "").await, Code::InvalidArgument, "stats without path");
    assert_code(c.stats("pvc-nope", &target).await, Code::NotFound, "stats unknown volume");
    assert_code(c.stats(id, &target2).await, Code::NotFound, "stats at a path the volume is not at");

    // NodeExpandVolume.
    assert_code(c.expand("", &target, 64 * MIB, 0).await, Code::InvalidArgument, "expand without id");
    assert_code(c.expand(id, "", 64 * MIB, 0).await, Code::InvalidArgument, "expand without path");
    assert_code(c.expand("pvc-nope", &target, 64 * MIB, 0).await, Code::NotFound, "expand unknown");
    assert_code(c.expand(id, &target, 64 * MIB, 48 * MIB).await, Code::OutOfRange, "required above limit");
    assert_code(c.expand(id, &target, 64 * MIB + 1, 64 * MIB + 100).await, Code::OutOfRange, "rounding exceeds limit");
    assert_code(c.expand(id, &target, 8u64 << 30, 0).await, Code::OutOfRange, "beyond the node's capacity");
    assert_code(c.expand(id, &target2, 64 * MIB, 0).await, Code::NotFound, "expand where not published");

    // Precedence (the spec's NOT_FOUND before argument checks), one rule each.
    let rel = target.trim_start_matches('/').to_string();
    for (what, p) in [("relative", rel.as_str()), ("outside", "/etc/np-x"), ("dotdot", "/a/../etc")] {
        assert_code(c.stage("pvc-nope", p, cap.clone()).await, Code::NotFound, &format!("stage unknown, {what} path"));
        assert_code(c.unstage("pvc-nope", p).await, Code::NotFound, &format!("unstage unknown, {what} path"));
        assert_code(
            c.publish("pvc-nope", &staging, p, cap.clone(), false).await,
            Code::NotFound,
            &format!("publish unknown, {what} path"),
        );
        assert_code(c.unpublish("pvc-nope", p).await, Code::NotFound, &format!("unpublish unknown, {what} path"));
        assert_code(c.stats("pvc-nope", p).await, Code::NotFound, &format!("stats unknown, {what} path"));
        assert_code(
            c.expand("pvc-nope", p, 64 * MIB, 0).await,
            Code::NotFound,
            &format!("expand unknown, {what} path"),
        );
        // A known volume: stats and expand say it is not there; the others refuse the path.
        assert_code(c.stats(id, p).await, Code::NotFound, &format!("stats known, {what} path"));
        assert_code(c.expand(id, p, 64 * MIB, 0).await, Code::NotFound, &format!("expand known, {what} path"));
        assert_code(c.unpublish(id, p).await, Code::InvalidArgument, &format!("unpublish known, {what} path"));
    }
    assert_code(c.stats("", &rel).await, Code::InvalidArgument, "stats without id, relative path");
    assert_code(c.expand("", &rel, 64 * MIB, 0).await, Code::InvalidArgument, "expand without id, relative path");
    assert_code(c.stats("pvc-nope", "").await, Code::InvalidArgument, "stats unknown volume without path");
    assert!(!Path::new(&rel).exists(), "a relative path was created");

    // NodeUnpublishVolume / NodeUnstageVolume.
    assert_code(c.unpublish("", &target).await, Code::InvalidArgument, "unpublish without id");
    assert_code(c.unpublish(id, "").await, Code::InvalidArgument, "unpublish without target");
    assert_code(c.unpublish("pvc-nope", &target2).await, Code::NotFound, "unpublish unknown");
    c.unpublish(id, &target).await.unwrap();
    assert_code(c.unstage("", &staging).await, Code::InvalidArgument, "unstage without id");
    assert_code(c.unstage(id, "").await, Code::InvalidArgument, "unstage without path");
    assert_code(c.unstage("pvc-nope", &sb.staging("pvc-nope", false)).await, Code::NotFound, "unstage unknown");
    c.unstage(id, &staging).await.unwrap();
    sb.assert_clean();
    c.delete(id).await.unwrap();
    sb.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_formats_a_device_that_holds_data() {
    never_formats_a_device_that_holds_data_on(Backend::File).await;
}

async fn never_formats_a_device_that_holds_data_on(backend: Backend) {
    let mut sb = Sandbox::on("noformat", backend);
    let mut c = sb.start().await;
    let id = "pvc-holds-xfs";
    c.create(id, 512 * MIB, "ext4").await;
    // Someone's xfs data is on the image already.
    let out = Command::new("mkfs.xfs").arg("-q").arg("-f").arg(sb.backing(id)).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let staging = sb.staging(id, false);
    let msg = assert_code(
        c.stage(id, &staging, mount_cap("", Mode::SingleNodeWriter)).await,
        Code::FailedPrecondition,
        "stage over xfs",
    );
    assert!(msg.contains("xfs"), "{msg}");
    let probe = Command::new("blkid").args(["-p", "-o", "value", "-s", "TYPE"]).arg(sb.backing(id)).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&probe.stdout).trim(), "xfs", "the data was touched");
    sb.assert_clean();
    c.delete(id).await.unwrap();
    sb.stop().await;
}

// ----- expansion, stats, condition -----

fn statfs_total(p: &str) -> u64 {
    let s = nix::sys::statvfs::statvfs(p).unwrap();
    s.blocks() * s.fragment_size()
}

fn usage_of(r: &csi::NodeGetVolumeStatsResponse, unit: csi::volume_usage::Unit) -> csi::VolumeUsage {
    r.usage.iter().find(|u| u.unit == unit as i32).cloned().unwrap_or_else(|| panic!("no {unit:?} usage in {r:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expansion_is_visible_in_df_and_stats() {
    expansion_is_visible_in_df_and_stats_on(Backend::File).await;
}

async fn expansion_is_visible_in_df_and_stats_on(backend: Backend) {
    use csi::volume_usage::Unit;
    let mut sb = Sandbox::on("expand", backend);
    let mut c = sb.start().await;

    // xfs grows online.
    let id = "pvc-grow-xfs";
    c.create(id, 512 * MIB, "xfs").await;
    let staging = sb.staging(id, false);
    let target = sb.target(id, "pod-x", false);
    let cap = mount_cap("xfs", Mode::SingleNodeWriter);
    c.stage(id, &staging, cap.clone()).await.unwrap();
    c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();
    fs::write(Path::new(&target).join("f"), pattern(3 * MIB as usize, 1)).unwrap();
    let before = statfs_total(&target);
    let st = c.stats(id, &target).await.unwrap();
    let bytes = usage_of(&st, Unit::Bytes);
    let sv = nix::sys::statvfs::statvfs(target.as_str()).unwrap();
    let within = |a: i64, b: u64| (a as f64 - b as f64).abs() <= b as f64 * 0.01;
    assert!(within(bytes.total, before), "stats total {} vs statfs {before}", bytes.total);
    assert!(within(bytes.available, sv.blocks_available() * sv.fragment_size()));
    let inodes = usage_of(&st, Unit::Inodes);
    assert!(within(inodes.total, sv.files()), "inodes {} vs {}", inodes.total, sv.files());
    assert!(!st.volume_condition.as_ref().unwrap().abnormal);
    for _ in 0..2 {
        let got = c.expand(id, &target, 768 * MIB, 0).await.unwrap();
        assert_eq!(got, 768 * MIB as i64);
    }
    let after = statfs_total(&target);
    assert!(after >= before + 200 * MIB, "df did not grow: {before} -> {after}");
    let st = c.stats(id, &target).await.unwrap();
    assert!(within(usage_of(&st, Unit::Bytes).total, after));
    assert_eq!(fs::read(Path::new(&target).join("f")).unwrap(), pattern(3 * MIB as usize, 1));
    c.unpublish(id, &target).await.unwrap();
    c.unstage(id, &staging).await.unwrap();

    // ext4: online needs CAP_SYS_RESOURCE; without it the call says so (FAILED_PRECONDITION,
    // "volume in use") and the filesystem grows at the next stage, offline.
    let id = "pvc-grow-ext4";
    c.create(id, 64 * MIB, "ext4").await;
    let staging = sb.staging(id, false);
    let target = sb.target(id, "pod-y", false);
    let cap = mount_cap("ext4", Mode::SingleNodeWriter);
    c.stage(id, &staging, cap.clone()).await.unwrap();
    c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();
    let before = statfs_total(&target);
    let online = nodeplane::storage::fs::has_cap_sys_resource();
    match c.expand(id, &target, 128 * MIB, 0).await {
        Ok(n) => {
            assert!(online, "online ext4 growth succeeded without CAP_SYS_RESOURCE?");
            assert_eq!(n, 128 * MIB as i64);
            assert!(statfs_total(&target) >= before + 50 * MIB);
        }
        Err(s) => {
            assert!(!online, "online ext4 growth failed with CAP_SYS_RESOURCE: {s}");
            assert_eq!(s.code(), Code::FailedPrecondition, "{s}");
            assert!(s.message().contains("CAP_SYS_RESOURCE"), "{s}");
            c.unpublish(id, &target).await.unwrap();
            c.unstage(id, &staging).await.unwrap();
            c.stage(id, &staging, cap.clone()).await.unwrap();
            c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();
            let after = statfs_total(&target);
            assert!(after >= before + 50 * MIB, "ext4 not grown at restage: {before} -> {after}");
        }
    }
    let st = c.stats(id, &target).await.unwrap();
    assert!(within(usage_of(&st, Unit::Bytes).total, statfs_total(&target)));
    c.unpublish(id, &target).await.unwrap();
    c.unstage(id, &staging).await.unwrap();

    // Raw block: the device grows online; the published device node shows it.
    let id = "pvc-grow-raw";
    c.create(id, 64 * MIB, "").await;
    let staging = sb.staging(id, true);
    let target = sb.target(id, "pod-z", true);
    let cap = block_cap(Mode::SingleNodeWriter);
    c.stage(id, &staging, cap.clone()).await.unwrap();
    c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();
    assert_eq!(nodeplane::sys::loopdev::device_size(Path::new(&target)).unwrap(), 64 * MIB);
    c.expand(id, &target, 96 * MIB, 0).await.unwrap();
    assert_eq!(nodeplane::sys::loopdev::device_size(Path::new(&target)).unwrap(), 96 * MIB);
    let st = c.stats(id, &target).await.unwrap();
    assert_eq!(usage_of(&st, Unit::Bytes).total, 96 * MIB as i64);
    c.unpublish(id, &target).await.unwrap();
    c.unstage(id, &staging).await.unwrap();
    sb.assert_clean();
    for id in ["pvc-grow-xfs", "pvc-grow-ext4", "pvc-grow-raw"] {
        c.delete(id).await.unwrap();
    }
    sb.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_condition_reports_a_lost_backing_file_or_mount() {
    volume_condition_reports_a_lost_backing_file_or_mount_on(Backend::File).await;
}

async fn volume_condition_reports_a_lost_backing_file_or_mount_on(backend: Backend) {
    let mut sb = Sandbox::on("condition", backend);
    let mut c = sb.start().await;
    let id = "pvc-cond";
    c.create(id, 32 * MIB, "ext4").await;
    let staging = sb.staging(id, false);
    let target = sb.target(id, "pod-c", false);
    let cap = mount_cap("ext4", Mode::SingleNodeWriter);
    c.stage(id, &staging, cap.clone()).await.unwrap();
    c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();
    let cond = |r: csi::NodeGetVolumeStatsResponse| r.volume_condition.unwrap();
    assert!(!cond(c.stats(id, &target).await.unwrap()).abnormal);
    // The backing file (the LV's node) vanishes (the loop device keeps the inode, the
    // mount its device; the data path works).
    let img = sb.backing(id);
    let moved = sb.aside(id);
    fs::rename(&img, &moved).unwrap();
    let cnd = cond(c.stats(id, &target).await.unwrap());
    assert!(cnd.abnormal && cnd.message.contains("backing file"), "{cnd:?}");
    fs::rename(&moved, &img).unwrap();
    assert!(!cond(c.stats(id, &target).await.unwrap()).abnormal);
    // The staging mount is pulled from under the plugin.
    nix::mount::umount2(Path::new(&staging), nix::mount::MntFlags::MNT_DETACH).unwrap();
    let cnd = cond(c.stats(id, &staging).await.unwrap());
    assert!(cnd.abnormal && cnd.message.contains("not mounted"), "{cnd:?}");
    c.unpublish(id, &target).await.unwrap();
    c.unstage(id, &staging).await.unwrap();
    sb.assert_clean();
    c.delete(id).await.unwrap();
    sb.stop().await;
}

// ----- concurrency -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_on_one_volume_get_aborted() {
    concurrent_calls_on_one_volume_get_aborted_on(Backend::File).await;
}

async fn concurrent_calls_on_one_volume_get_aborted_on(backend: Backend) {
    let mut sb = Sandbox::on("concurrent", backend);
    let c = sb.start().await;
    let id = "pvc-race";
    let mut c0 = c.clone_for_task();
    c0.create(id, 1 << 30, "ext4").await;
    let staging = sb.staging(id, false);
    let cap = mount_cap("ext4", Mode::SingleNodeWriter);
    let mut calls = Vec::new();
    for _ in 0..6 {
        let mut node = c.node.clone();
        let req = csi::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        };
        calls.push(tokio::spawn(async move { node.node_stage_volume(req).await.map(|_| ()) }));
    }
    let mut ok = 0;
    let mut aborted = 0;
    for h in calls {
        match h.await.unwrap() {
            Ok(()) => ok += 1,
            Err(s) if s.code() == Code::Aborted => aborted += 1,
            Err(s) => panic!("unexpected {s}"),
        }
    }
    assert!(ok >= 1 && aborted >= 1, "ok {ok}, aborted {aborted}");
    assert_eq!(mounts_under(&sb.dir).len(), 1, "exactly one staging mount");
    c0.unstage(id, &staging).await.unwrap();
    sb.assert_clean();
    c0.delete(id).await.unwrap();
    sb.stop().await;
}

// ----- restarts and crashes -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_restarts_between_stage_and_publish_and_under_io() {
    agent_restarts_between_stage_and_publish_and_under_io_on(Backend::File).await;
}

async fn agent_restarts_between_stage_and_publish_and_under_io_on(backend: Backend) {
    let mut sb = Sandbox::on("restart", backend);
    let mut c = sb.start().await;
    let id = "pvc-restart";
    c.create(id, 64 * MIB, "ext4").await;
    let staging = sb.staging(id, false);
    let target = sb.target(id, "pod-r", false);
    let cap = mount_cap("ext4", Mode::SingleNodeWriter);
    c.stage(id, &staging, cap.clone()).await.unwrap();
    sb.kill9();
    let mut c = sb.start().await;
    c.stage(id, &staging, cap.clone()).await.unwrap();
    assert_eq!(mounts_under(&sb.dir).len(), 1);
    c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();

    // Writes keep flowing while the agent dies and comes back.
    let stop = Arc::new(AtomicBool::new(false));
    let file = Path::new(&target).join("log");
    let writer = {
        let stop = stop.clone();
        let file = file.clone();
        std::thread::spawn(move || -> Result<u64, String> {
            let mut f = fs::File::create(&file).map_err(|e| e.to_string())?;
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                f.write_all(&n.to_le_bytes()).map_err(|e| format!("write {n}: {e}"))?;
                f.sync_data().map_err(|e| format!("sync {n}: {e}"))?;
                n += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok(n)
        })
    };
    // Long enough for the writer's 50 writes at this machine's speed (fsync through the loop
    // device is slow under the VM lane's emulation: 46 writes in the unscaled spans).
    let beat = Duration::from_millis(200).mul_f64(crate::time_scale());
    tokio::time::sleep(beat).await;
    sb.kill9();
    tokio::time::sleep(beat).await;
    let mut c = sb.start().await;
    tokio::time::sleep(beat).await;
    stop.store(true, Ordering::Relaxed);
    let n = writer.join().unwrap().expect("writes failed across the agent restart");
    assert!(n > 50, "only {n} writes");
    let mut buf = Vec::new();
    fs::File::open(&file).unwrap().read_to_end(&mut buf).unwrap();
    assert_eq!(buf.len() as u64, n * 8);
    for (i, ch) in buf.chunks(8).enumerate() {
        assert_eq!(u64::from_le_bytes(ch.try_into().unwrap()), i as u64);
    }
    // Same publish again after the restart: idempotent.
    c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();
    c.unpublish(id, &target).await.unwrap();
    c.unstage(id, &staging).await.unwrap();
    sb.assert_clean();
    c.delete(id).await.unwrap();
    sb.stop().await;
    sb.assert_clean();
}

/// The agent crashes (abort, like kill -9) at a point inside a call; kubelet retries the
/// call after the restart; the end state is right and nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_inside_calls_then_retry_is_consistent() {
    crash_inside_calls_then_retry_is_consistent_on(Backend::File).await;
}

async fn crash_inside_calls_then_retry_is_consistent_on(backend: Backend) {
    let mut sb = Sandbox::on("crash", backend);
    let cap = mount_cap("ext4", Mode::SingleNodeWriter);
    let points = [
        "stage-after-record",
        "stage-after-attach",
        "stage-after-mkfs",
        "stage-after-mount",
        "publish-after-record",
        "publish-after-mount",
        "unpublish-after-unmount",
        "unstage-after-unmount",
        "expand-after-store",
    ];
    for (round, point) in points.iter().enumerate() {
        // A fresh (blank) volume per round, so every point is reached.
        let id = format!("pvc-crash-{round}");
        let id = id.as_str();
        let staging = sb.staging(id, false);
        let target = sb.target(id, "pod-k", false);
        sb.crash_at = Some(point.to_string());
        let mut c = sb.start().await;
        c.create(id, 64 * MIB, "ext4").await;
        let phase = point.split('-').next().unwrap();
        let mut wrote = false;
        // Walk the lifecycle up to the call that crashes.
        let crashed = async {
            c.stage(id, &staging, cap.clone()).await?;
            c.publish(id, &staging, &target, cap.clone(), false).await?;
            fs::write(Path::new(&target).join("before"), point.as_bytes()).unwrap();
            wrote = true;
            if phase == "expand" {
                c.expand(id, &target, 80 * MIB, 0).await?;
            }
            c.unpublish(id, &target).await?;
            c.unstage(id, &staging).await
        }
        .await;
        assert!(crashed.is_err(), "{point}: no call failed");
        sb.wait_crashed(Duration::from_secs(10));
        assert!(
            sb.log().contains(&format!("NODEPLANE_CRASH_AT: crashing at {point}\n")),
            "{point}: the agent did not crash there:\n{}",
            sb.log()
        );
        sb.crash_at = None;
        let mut c = sb.start().await;
        // kubelet retries the interrupted call; then the lifecycle goes on.
        c.stage(id, &staging, cap.clone()).await.unwrap_or_else(|e| panic!("{point}: restage: {e}"));
        c.publish(id, &staging, &target, cap.clone(), false).await.unwrap_or_else(|e| panic!("{point}: publish: {e}"));
        if phase == "expand" {
            let got = c.expand(id, &target, 80 * MIB, 0).await;
            // ext4 online growth needs CAP_SYS_RESOURCE (see expansion test); the store
            // side finished either way.
            match got {
                Ok(n) => assert_eq!(n, 80 * MIB as i64),
                Err(e) => assert_eq!(e.code(), Code::FailedPrecondition, "{point}: {e}"),
            }
        }
        if wrote {
            assert_eq!(fs::read(Path::new(&target).join("before")).unwrap(), point.as_bytes(), "{point}: data lost");
        }
        c.unpublish(id, &target).await.unwrap_or_else(|e| panic!("{point}: unpublish: {e}"));
        c.unstage(id, &staging).await.unwrap_or_else(|e| panic!("{point}: unstage: {e}"));
        assert!(!Path::new(&target).exists(), "{point}: target left behind");
        sb.assert_clean();
        c.delete(id).await.unwrap_or_else(|e| panic!("{point}: delete: {e}"));
        sb.stop().await;
        let stage_records = fs::read_dir(sb.root().join("var/lib/nodeplane/csi/stage")).unwrap().count();
        let publish_records = fs::read_dir(sb.root().join("var/lib/nodeplane/csi/publish")).unwrap().count();
        assert_eq!((stage_records, publish_records), (0, 0), "{point}: records left behind");
        assert!(!sb.volume_exists(id), "{point}: backing file left after delete");
    }
    sb.assert_clean();
}

/// A volume mount group makes the volume's root group-owned and group-writable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_mount_group_and_mount_flags_apply() {
    volume_mount_group_and_mount_flags_apply_on(Backend::File).await;
}

async fn volume_mount_group_and_mount_flags_apply_on(backend: Backend) {
    let mut sb = Sandbox::on("group", backend);
    let mut c = sb.start().await;
    let id = "pvc-group";
    c.create(id, 32 * MIB, "ext4").await;
    let staging = sb.staging(id, false);
    let target = sb.target(id, "pod-g", false);
    let cap = csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: Mode::SingleNodeMultiWriter as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec!["noatime".into(), "nosuid".into()],
            volume_mount_group: "4321".into(),
        })),
    };
    c.stage(id, &staging, cap.clone()).await.unwrap();
    c.publish(id, &staging, &target, cap.clone(), false).await.unwrap();
    let md = fs::metadata(&target).unwrap();
    assert_eq!(md.gid(), 4321);
    assert_eq!(md.mode() & 0o2070, 0o2070, "mode {:o}", md.mode());
    let (_, _, opts) = mounted_at(Path::new(&target)).unwrap();
    assert!(opts.contains("noatime") && opts.contains("nosuid"), "{opts}");
    let (_, _, sopts) = mounted_at(Path::new(&staging)).unwrap();
    assert!(sopts.contains("noatime"), "{sopts}");
    c.unpublish(id, &target).await.unwrap();
    c.unstage(id, &staging).await.unwrap();
    sb.assert_clean();
    c.delete(id).await.unwrap();
    sb.stop().await;
}

/// The tests above about volumes on the `lvm` backend: the same bodies and assertions, the
/// agent given a thin pool (lvm_root's [`Pool`](crate::lvm_root::Pool)) and its volumes
/// made there. Device-mapper: the VM lane runs them; scripts/test skips them on the host.
///
/// File-only, about no volume at all:
/// - `kubelet_registers_the_driver_and_again_after_a_restart`: plugin registration.
/// - `every_socket_accepts_the_authorities_real_clients_send`: gRPC authorities.
/// - `sockets_are_0600_and_refuse_unprivileged_users`: socket modes.
mod lvm {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle_ext4() {
        lifecycle(Backend::Lvm, "ext4", 64 * MIB).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle_xfs() {
        lifecycle(Backend::Lvm, "xfs", 512 * MIB).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lifecycle_raw_block() {
        lifecycle(Backend::Lvm, "", 64 * MIB).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn six_targets_of_one_volume_unpublish_concurrently() {
        many_targets(Backend::Lvm, 6).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn twenty_targets_of_one_volume_unpublish_concurrently() {
        many_targets(Backend::Lvm, 20).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_stage_publish_and_access_modes_stay_safe() {
        concurrent_stage_publish_and_access_modes_stay_safe_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_identity() {
        conformance_identity_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn conformance_node_errors() {
        conformance_node_errors_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn never_formats_a_device_that_holds_data() {
        never_formats_a_device_that_holds_data_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expansion_is_visible_in_df_and_stats() {
        expansion_is_visible_in_df_and_stats_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn volume_condition_reports_a_lost_backing_file_or_mount() {
        volume_condition_reports_a_lost_backing_file_or_mount_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_calls_on_one_volume_get_aborted() {
        concurrent_calls_on_one_volume_get_aborted_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn agent_restarts_between_stage_and_publish_and_under_io() {
        agent_restarts_between_stage_and_publish_and_under_io_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn crash_inside_calls_then_retry_is_consistent() {
        crash_inside_calls_then_retry_is_consistent_on(Backend::Lvm).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn volume_mount_group_and_mount_flags_apply() {
        volume_mount_group_and_mount_flags_apply_on(Backend::Lvm).await;
    }
}
