//! Root-only, device-mapper: LUKS2 encryption of volumes by the agent's CSI node plugin
//! (`volume_context["encryption"] = "luks2"`, the key in the node-stage secret), with a
//! real agent process, loop devices, dm-crypt mappings, filesystems and mounts.
//!
//! The VM lane runs these (scripts/vm-test: Debian's kernels have dm-crypt); this host's
//! kernel has no device-mapper, and scripts/test says so instead of running them. Without
//! device-mapper they FAIL, never skip.
//!
//! The sandbox is `tests/csi_root.rs`'s, cut down: an agent in a private network namespace
//! with its whole tree under `/tmp/npcrypt-<pid>-<test>`. Dropped (also on panic) it kills
//! that agent, unmounts everything under the sandbox, closes the dm-crypt mappings over
//! its loop devices, detaches those and removes the directory. Volume ids carry the
//! process id, so mapping names (`npc-<id>`, global in the kernel) never collide.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nodeplane::rpc::csi;
use nodeplane::rpc::csi::volume_capability::access_mode::Mode;
use nodeplane::rpc::csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use nodeplane::rpc::node as napi;
use tonic::Code;
use tonic::transport::Channel;

const AGENT: &str = env!("CARGO_BIN_EXE_nodeplane-agent");
const MIB: u64 = 1 << 20;
/// The test key: 64 hex digits, as the controller makes them.
const KEY: &str = "6b1f0c7e9a2d4c5b8e3f7a6d1c0b9e8f2a3d4c5b6e7f8091a2b3c4d5e6f70819";
const WRONG_KEY: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn require_root() {
    assert!(nix::unistd::geteuid().is_root(), "tests/crypt_root.rs needs root; it does not skip");
    let ok = Command::new("modprobe").arg("dm_crypt").status().is_ok_and(|s| s.success());
    assert!(ok, "no dm-crypt (device-mapper) in this kernel: run these tests in the VM lane (scripts/vm-test)");
    assert!(
        Command::new("cryptsetup").arg("--version").output().is_ok_and(|o| o.status.success()),
        "cryptsetup is not installed (Debian: cryptsetup)"
    );
}

/// A volume id unique to this process (mapping names are global).
fn vol_id(name: &str) -> String {
    format!("pvc-cr{}-{name}", std::process::id())
}

fn mapper(id: &str) -> PathBuf {
    PathBuf::from(format!("/dev/mapper/npc-{id}"))
}

// ----- sandbox, agent, cleanup (from tests/csi_root.rs) -----

/// (mount point, fs type, major:minor) of every mount.
fn mounts() -> Vec<(PathBuf, String, String)> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let f: Vec<&str> = pre.split(' ').collect();
            Some((PathBuf::from(f[4]), post.split(' ').next()?.to_string(), f[2].to_string()))
        })
        .collect()
}

fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    mounts().into_iter().map(|m| m.0).filter(|p| p.starts_with(dir)).collect()
}

fn mounted_at(p: &Path) -> Option<(String, String)> {
    mounts().into_iter().rev().find(|m| m.0 == p).map(|m| (m.1, m.2))
}

/// Loop devices whose backing file lies under `dir` (also deleted ones): their names.
fn loops_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = fs::read_to_string(e.path().join("loop/backing_file")) {
            let b = b.trim().trim_end_matches(" (deleted)");
            if Path::new(b).starts_with(dir) {
                out.push(name);
            }
        }
    }
    out
}

/// dm mappings (names) over the loop devices `loops`.
fn mappings_over(loops: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for e in fs::read_dir("/sys/block").unwrap().flatten() {
        let Ok(name) = fs::read_to_string(e.path().join("dm/name")) else { continue };
        let over = fs::read_dir(e.path().join("slaves"))
            .map(|d| d.flatten().any(|s| loops.contains(&s.file_name().to_string_lossy().into_owned())))
            .unwrap_or(false);
        if over {
            out.push(name.trim().to_string());
        }
    }
    out
}

fn cryptsetup(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new("cryptsetup");
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1");
    }
    cmd.args(args).output().unwrap()
}

fn cleanup(dir: &Path) -> Vec<String> {
    let mut leftovers = Vec::new();
    let mut ms = mounts_under(dir);
    ms.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for m in ms {
        leftovers.push(format!("mount {}", m.display()));
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    let loops = loops_under(dir);
    for name in mappings_over(&loops) {
        leftovers.push(format!("mapping {name}"));
        let _ = cryptsetup(&["close", &name]);
    }
    for d in loops {
        leftovers.push(format!("loop {d}"));
        let _ = Command::new("losetup").arg("-d").arg(format!("/dev/{d}")).status();
    }
    let _ = fs::remove_dir_all(dir);
    leftovers
}

struct Sandbox {
    dir: PathBuf,
    agent: Option<Child>,
}

impl Sandbox {
    fn new(name: &str) -> Sandbox {
        Sandbox::with_csi(name, serde_json::json!({"capacityBytes": 4u64 << 30, "maxVolumes": 16}))
    }
    /// A sandbox whose agent has `csi` as its CSI configuration.
    fn with_csi(name: &str, csi: serde_json::Value) -> Sandbox {
        require_root();
        let dir = PathBuf::from("/tmp").join(format!("npcrypt-{}-{name}", std::process::id()));
        if dir.exists() {
            cleanup(&dir);
        }
        fs::create_dir_all(&dir).unwrap();
        let dir = dir.canonicalize().unwrap();
        let cfg = serde_json::json!({
            "nodeName": format!("crypt-{name}"),
            "root": dir.join("root"),
            "shimSource": crate::shim(),
            "csi": csi,
        });
        fs::write(dir.join("agent.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
        Sandbox { dir, agent: None }
    }
    fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
    fn kubelet(&self) -> PathBuf {
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
    fn image(&self, id: &str) -> PathBuf {
        self.root().join("var/lib/nodeplane/volumes").join(format!("{id}.img"))
    }
    fn stage_record(&self, id: &str) -> PathBuf {
        self.root().join("var/lib/nodeplane/csi/stage").join(format!("{id}.json"))
    }
    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }
    fn staging(&self, id: &str, block: bool) -> String {
        let p = if block {
            self.kubelet().join(format!("plugins/kubernetes.io/csi/volumeDevices/staging/{id}"))
        } else {
            self.kubelet().join(format!("plugins/kubernetes.io/csi/pv/{id}/globalmount"))
        };
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        p.to_string_lossy().into_owned()
    }
    fn target(&self, id: &str, pod: &str, block: bool) -> String {
        let p = if block {
            self.kubelet().join(format!("plugins/kubernetes.io/csi/volumeDevices/publish/{id}/{pod}"))
        } else {
            self.kubelet().join(format!("pods/{pod}/volumes/kubernetes.io~csi/{id}/mount"))
        };
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        p.to_string_lossy().into_owned()
    }

    /// Start the agent (debug logging: the key must not show even there) and wait until it
    /// is ready.
    async fn start(&mut self) -> Clients {
        assert!(self.agent.is_none(), "agent already running");
        let _ = fs::remove_file(self.reg_sock());
        let log = OpenOptions::new().create(true).append(true).open(self.dir.join("agent.log")).unwrap();
        let mut cmd = Command::new("unshare");
        cmd.arg("--net")
            .arg("--")
            .arg(AGENT)
            .arg("--config")
            .arg(self.dir.join("agent.json"))
            .env("RUST_LOG", "debug")
            .env_remove("NODEPLANE_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.agent = Some(cmd.spawn().expect("starting the agent"));
        let deadline = Instant::now() + Duration::from_secs(20).mul_f64(crate::time_scale());
        while !self.reg_sock().exists() {
            if let Some(st) = self.agent.as_mut().unwrap().try_wait().unwrap() {
                panic!("agent exited during start-up ({st}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "agent not ready in time:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Clients::connect(self).await
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Nothing of this sandbox is mounted, mapped or attached any more.
    fn assert_clean(&self) {
        let m = mounts_under(&self.dir);
        assert!(m.is_empty(), "leaked mounts: {m:?}");
        let l = loops_under(&self.dir);
        assert!(mappings_over(&l).is_empty(), "leaked mappings: {:?}", mappings_over(&l));
        assert!(l.is_empty(), "leaked loop devices: {l:?}");
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.kill9();
        let left = cleanup(&self.dir);
        if !left.is_empty() && !std::thread::panicking() {
            eprintln!("sandbox cleanup removed leftovers: {left:?}");
        }
    }
}

struct Clients {
    node: csi::node_client::NodeClient<Channel>,
    vols: napi::node_volumes_client::NodeVolumesClient<Channel>,
}

impl Clients {
    async fn connect(sb: &Sandbox) -> Clients {
        let ch = nodeplane::rpc::connect_unix(&sb.csi_sock()).await.expect("dialing csi.sock");
        let nch = nodeplane::rpc::connect_unix(&sb.node_sock()).await.expect("dialing node.sock");
        Clients {
            node: csi::node_client::NodeClient::new(ch),
            vols: napi::node_volumes_client::NodeVolumesClient::new(nch),
        }
    }
    async fn create(&mut self, id: &str, size: u64, fs: &str) {
        self.create_on(id, size, fs, "").await
    }
    async fn create_on(&mut self, id: &str, size: u64, fs: &str, backend: &str) {
        let req = napi::CreateVolumeRequest {
            id: id.into(),
            size_bytes: size,
            fs_type: fs.into(),
            backend: backend.into(),
            ..Default::default()
        };
        self.vols.create_volume(req).await.unwrap_or_else(|e| panic!("creating {id}: {e}"));
    }
    /// NodeStageVolume; `key`: `Some` stages with `encryption: luks2` and that key
    /// (`Some("")`: encrypted, without a key), `None` without encryption.
    async fn stage(
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
    async fn unstage(&mut self, id: &str, staging: &str) -> Result<(), tonic::Status> {
        let req = csi::NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging.into() };
        self.node.node_unstage_volume(req).await.map(|_| ())
    }
    async fn publish(
        &mut self,
        id: &str,
        staging: &str,
        target: &str,
        cap: csi::VolumeCapability,
    ) -> Result<(), tonic::Status> {
        let req = csi::NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.into(),
            target_path: target.into(),
            volume_capability: Some(cap),
            ..Default::default()
        };
        self.node.node_publish_volume(req).await.map(|_| ())
    }
    async fn unpublish(&mut self, id: &str, target: &str) -> Result<(), tonic::Status> {
        let req = csi::NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.into() };
        self.node.node_unpublish_volume(req).await.map(|_| ())
    }
    async fn stats(&mut self, id: &str, path: &str) -> csi::NodeGetVolumeStatsResponse {
        let req = csi::NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            staging_target_path: String::new(),
        };
        self.node.node_get_volume_stats(req).await.unwrap().into_inner()
    }
    async fn expand(&mut self, id: &str, path: &str, required: u64) -> Result<i64, tonic::Status> {
        let req = csi::NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: required as i64, limit_bytes: 0 }),
            ..Default::default()
        };
        self.node.node_expand_volume(req).await.map(|r| r.into_inner().capacity_bytes)
    }
}

fn mount_cap(fs: &str) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

fn block_cap() -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

#[track_caller]
fn assert_code<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, what: &str) -> String {
    match r {
        Err(s) if s.code() == code => s.message().to_string(),
        other => panic!("{what}: expected {code:?}, got {other:?}"),
    }
}

/// Whether the file (or block device) at `p` contains `needle` anywhere (read in chunks
/// that overlap).
fn file_contains(p: &Path, needle: &[u8]) -> bool {
    let f = fs::File::open(p).unwrap();
    let md = f.metadata().unwrap();
    let len =
        if md.file_type().is_block_device() { nodeplane::sys::loopdev::device_size(p).unwrap() } else { md.len() };
    let chunk = 4 * MIB;
    let mut buf = vec![0u8; (chunk as usize) + needle.len()];
    let mut off = 0;
    while off < len {
        let n = f.read_at(&mut buf, off).unwrap();
        if buf[..n].windows(needle.len()).any(|w| w == needle) {
            return true;
        }
        off += chunk;
    }
    false
}

/// The major:minor of a device node, as mountinfo prints it.
fn dev_of(p: &Path) -> String {
    let rdev = fs::metadata(p).unwrap().rdev();
    format!("{}:{}", nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev))
}

fn marker() -> Vec<u8> {
    format!("nodeplane-crypt-marker-{}-", std::process::id()).repeat(64).into_bytes()
}

fn write_synced(p: &Path, data: &[u8]) {
    use std::io::Write;
    let mut f = OpenOptions::new().create(true).write(true).truncate(true).open(p).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

/// (a) + (e): a file volume staged with LUKS2: the data is on the mapping and never in
/// the image in clear; the mapping goes with the unstage and comes back with the same key;
/// the key shows neither in the agent's log nor in any file under its root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_filesystem_round_trip_keeps_data_and_never_the_key() {
    let mut sb = Sandbox::new("fs");
    let mut c = sb.start().await;
    let id = vol_id("fs");
    c.create(&id, 64 * MIB, "ext4").await;
    let staging = sb.staging(&id, false);
    let target = sb.target(&id, "pod-a", false);
    c.stage(&id, &staging, mount_cap("ext4"), Some(KEY)).await.unwrap();
    // Staging again is idempotent; without encryption it is another request.
    c.stage(&id, &staging, mount_cap("ext4"), Some(KEY)).await.unwrap();
    assert_code(c.stage(&id, &staging, mount_cap("ext4"), None).await, Code::AlreadyExists, "restage unencrypted");
    assert!(mapper(&id).exists(), "the mapping exists while staged");
    let (fs_type, num) = mounted_at(Path::new(&staging)).expect("staged");
    assert_eq!((fs_type.as_str(), num), ("ext4", dev_of(&mapper(&id))), "the filesystem is on the mapping");
    let rec: serde_json::Value = serde_json::from_slice(&fs::read(sb.stage_record(&id)).unwrap()).unwrap();
    assert_eq!(rec["encrypted"], true, "{rec}");

    c.publish(&id, &staging, &target, mount_cap("ext4")).await.unwrap();
    let file = Path::new(&target).join("marker");
    write_synced(&file, &marker());
    let st = c.stats(&id, &target).await;
    assert!(!st.volume_condition.unwrap().abnormal, "stats see the mapping's mount as the volume's");
    assert!(!file_contains(&sb.image(&id), &marker()), "the marker is in the image in clear");

    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists(), "the mapping is gone after unstage");
    sb.assert_clean();
    assert!(!file_contains(&sb.image(&id), &marker()), "the marker is in the image in clear");
    assert!(file_contains(&sb.image(&id), b"LUKS\xba\xbe"), "the image holds a LUKS header");

    c.stage(&id, &staging, mount_cap("ext4"), Some(KEY)).await.unwrap();
    c.publish(&id, &staging, &target, mount_cap("ext4")).await.unwrap();
    assert_eq!(fs::read(&file).unwrap(), marker(), "the marker reads back");
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();

    // (e) The key: not in the log (debug level), not in any file under the agent's root.
    let log = sb.log();
    assert!(log.contains("volume unlocked"), "the log shows the unlock:\n{log}");
    assert!(!log.contains(KEY), "the key is in the agent's log");
    let mut files = vec![sb.root()];
    while let Some(p) = files.pop() {
        let md = fs::symlink_metadata(&p).unwrap();
        if md.is_dir() {
            files.extend(fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
        } else if md.is_file() {
            assert!(!file_contains(&p, KEY.as_bytes()), "the key is in {}", p.display());
        }
    }
}

/// (b) A wrong key fails the stage with INVALID_ARGUMENT and leaves nothing; a missing key
/// and an unencrypted stage of an encrypted volume are refused; the data is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_is_refused_and_loses_nothing() {
    let mut sb = Sandbox::new("wrong");
    let mut c = sb.start().await;
    let id = vol_id("wrong");
    c.create(&id, 64 * MIB, "ext4").await;
    let staging = sb.staging(&id, false);
    c.stage(&id, &staging, mount_cap("ext4"), Some(KEY)).await.unwrap();
    write_synced(&Path::new(&staging).join("marker"), &marker());
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();

    let msg = assert_code(
        c.stage(&id, &staging, mount_cap("ext4"), Some(WRONG_KEY)).await,
        Code::InvalidArgument,
        "wrong key",
    );
    assert!(msg.contains(&format!("the key in the node-stage secret does not open volume {id}")), "{msg}");
    assert!(!mapper(&id).exists(), "a wrong key left a mapping");
    assert!(mounted_at(Path::new(&staging)).is_none(), "a wrong key left a mount");
    assert!(!sb.stage_record(&id).exists(), "a wrong key left a stage record");
    sb.assert_clean();

    let msg = assert_code(c.stage(&id, &staging, mount_cap("ext4"), Some("")).await, Code::InvalidArgument, "no key");
    assert!(msg.contains("\"key\""), "{msg}");
    let msg = assert_code(c.stage(&id, &staging, mount_cap("ext4"), None).await, Code::FailedPrecondition, "no luks2");
    assert!(msg.contains("crypto_LUKS"), "{msg}");
    sb.assert_clean();

    c.stage(&id, &staging, mount_cap("ext4"), Some(KEY)).await.unwrap();
    assert_eq!(fs::read(Path::new(&staging).join("marker")).unwrap(), marker(), "the data survived");
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();

    // A restart finds a mapping no stage accounts for (a crash after the unstage's
    // record went, say) and closes it.
    sb.kill9();
    let dev =
        String::from_utf8(Command::new("losetup").args(["-f", "--show"]).arg(sb.image(&id)).output().unwrap().stdout)
            .unwrap();
    let dev = dev.trim();
    let mut open = Command::new("cryptsetup");
    if !Path::new("/run/udev/control").exists() {
        open.env("DM_DISABLE_UDEV", "1");
    }
    let mut child =
        open.args(["open", "--key-file=-", dev, &format!("npc-{id}")]).stdin(Stdio::piped()).spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), KEY.as_bytes()).unwrap();
    assert!(child.wait().unwrap().success());
    assert!(mapper(&id).exists());
    let _c = sb.start().await;
    assert!(!mapper(&id).exists(), "start-up closes a mapping no stage accounts for:\n{}", sb.log());
    sb.assert_clean();
}

/// (c) A raw block volume: the pod's device is the mapping; what it writes is not in the
/// image in clear and reads back after an unstage and a new stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_raw_block_round_trip() {
    let mut sb = Sandbox::new("block");
    let mut c = sb.start().await;
    let id = vol_id("block");
    c.create(&id, 32 * MIB, "").await;
    let staging = sb.staging(&id, true);
    let target = sb.target(&id, "pod-b", true);
    c.stage(&id, &staging, block_cap(), Some(KEY)).await.unwrap();
    assert!(mapper(&id).exists());
    c.publish(&id, &staging, &target, block_cap()).await.unwrap();
    assert_eq!(dev_of(Path::new(&target)), dev_of(&mapper(&id)), "the pod's device is the mapping");
    let size = nodeplane::sys::loopdev::device_size(Path::new(&target)).unwrap();
    assert_eq!(size, 30 * MIB, "32 MiB less the 2 MiB LUKS2 header");
    let dev = OpenOptions::new().read(true).write(true).open(&target).unwrap();
    dev.write_all_at(&marker(), 5 * MIB).unwrap();
    dev.sync_all().unwrap();
    drop(dev);
    assert!(!file_contains(&sb.image(&id), &marker()), "the marker is in the image in clear");
    let ro = csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.clone(),
        target_path: sb.target(&id, "pod-ro", true),
        volume_capability: Some(block_cap()),
        readonly: true,
        ..Default::default()
    };
    assert_code(c.node.node_publish_volume(ro).await, Code::FailedPrecondition, "read-only block");
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists());
    sb.assert_clean();

    c.stage(&id, &staging, block_cap(), Some(KEY)).await.unwrap();
    c.publish(&id, &staging, &target, block_cap()).await.unwrap();
    let mut buf = vec![0u8; marker().len()];
    fs::File::open(&target).unwrap().read_exact_at(&mut buf, 5 * MIB).unwrap();
    assert_eq!(buf, marker(), "the marker reads back through the mapping");
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();
}

/// (d) NodeExpandVolume of a staged encrypted xfs volume: the image, the mapping and the
/// filesystem grow, and statfs shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expansion_of_an_encrypted_volume_shows_in_statfs() {
    let mut sb = Sandbox::new("grow");
    let mut c = sb.start().await;
    let id = vol_id("grow");
    c.create(&id, 320 * MIB, "xfs").await;
    let staging = sb.staging(&id, false);
    let target = sb.target(&id, "pod-g", false);
    c.stage(&id, &staging, mount_cap("xfs"), Some(KEY)).await.unwrap();
    c.publish(&id, &staging, &target, mount_cap("xfs")).await.unwrap();
    write_synced(&Path::new(&target).join("marker"), &marker());
    let total = |p: &str| {
        let s = nix::sys::statvfs::statvfs(p).unwrap();
        s.blocks() * s.fragment_size()
    };
    let before = total(&target);
    assert_eq!(c.expand(&id, &target, 480 * MIB).await.unwrap(), 480 * MIB as i64);
    let after = total(&target);
    assert!(after >= before + 150 * MIB, "statfs did not grow: {before} -> {after}");
    let mapped = nodeplane::sys::loopdev::device_size(&mapper(&id)).unwrap();
    assert_eq!(mapped, 478 * MIB, "the mapping grew with its device");
    assert_eq!(fs::read(Path::new(&target).join("marker")).unwrap(), marker());
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();
}

/// A volume group with a thin pool on a loop device over a sparse file, for the `lvm`
/// backend; removed (with the loop device and file) when dropped. Made before the sandbox,
/// so dropped after it (the agent killed, the mounts gone).
struct ThinPool {
    vg: String,
    img: PathBuf,
    loop_dev: String,
}

fn lvm(args: &[&str]) -> bool {
    let mut cmd = Command::new(args[0]);
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1");
    }
    cmd.env("LVM_SUPPRESS_FD_WARNINGS", "1").args(&args[1..]).status().is_ok_and(|s| s.success())
}

impl ThinPool {
    fn new() -> ThinPool {
        require_root();
        assert!(lvm(&["modprobe", "dm_thin_pool"]), "no dm-thin in this kernel");
        let vg = format!("npcr{}", std::process::id());
        let img = PathBuf::from("/tmp").join(format!("npcrypt-{vg}.img"));
        fs::File::create(&img).unwrap().set_len(320 * MIB).unwrap();
        let out = Command::new("losetup").args(["-f", "--show"]).arg(&img).output().unwrap();
        let loop_dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
        let p = ThinPool { vg: vg.clone(), img, loop_dev: loop_dev.clone() };
        assert!(lvm(&["pvcreate", "-q", "-y", &loop_dev]));
        assert!(lvm(&["vgcreate", "-q", &vg, &loop_dev]));
        assert!(lvm(&["lvcreate", "-q", "-y", "-T", &format!("{vg}/pool"), "-L", "256m"]));
        p
    }
}

impl Drop for ThinPool {
    fn drop(&mut self) {
        let _ = cryptsetup(&["close", &format!("npc-{}", vol_id("thin"))]);
        let _ = lvm(&["vgremove", "-q", "-y", "-f", &self.vg]);
        let _ = lvm(&["pvremove", "-q", "-y", &self.loop_dev]);
        let _ = lvm(&["losetup", "-d", &self.loop_dev]);
        let _ = fs::remove_file(&self.img);
    }
}

/// An encrypted thin volume (the `lvm` backend): the container is on the LV, the marker
/// never on it in clear, a wrong key opens nothing, and the data reads back after an
/// unstage and a new stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_thin_volume_round_trip() {
    let pool = ThinPool::new();
    let csi = serde_json::json!({
        "capacityBytes": 4u64 << 30,
        "maxVolumes": 16,
        "lvm": {"volumeGroup": pool.vg, "thinPool": "pool"},
    });
    let mut sb = Sandbox::with_csi("thin", csi);
    let mut c = sb.start().await;
    let id = vol_id("thin");
    c.create_on(&id, 64 * MIB, "ext4", "lvm").await;
    let lv = PathBuf::from(format!("/dev/{}/np-{id}", pool.vg));
    let staging = sb.staging(&id, false);
    c.stage(&id, &staging, mount_cap("ext4"), Some(KEY)).await.unwrap();
    let (fs_type, num) = mounted_at(Path::new(&staging)).expect("staged");
    assert_eq!((fs_type.as_str(), num), ("ext4", dev_of(&mapper(&id))), "the filesystem is on the mapping");
    write_synced(&Path::new(&staging).join("marker"), &marker());
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists(), "the mapping is gone after unstage");
    assert!(file_contains(&lv, b"LUKS\xba\xbe"), "the LV holds a LUKS header");
    assert!(!file_contains(&lv, &marker()), "the marker is on the LV in clear");
    let r = c.stage(&id, &staging, mount_cap("ext4"), Some(WRONG_KEY)).await;
    assert_code(r, Code::InvalidArgument, "wrong key");
    assert!(!mapper(&id).exists() && mounted_at(Path::new(&staging)).is_none());
    c.stage(&id, &staging, mount_cap("ext4"), Some(KEY)).await.unwrap();
    assert_eq!(fs::read(Path::new(&staging).join("marker")).unwrap(), marker());
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists());
    assert!(mounts_under(&sb.dir).is_empty());
    c.vols.delete_volume(napi::DeleteVolumeRequest { id: id.clone() }).await.unwrap();
}
