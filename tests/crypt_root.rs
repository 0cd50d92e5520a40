//! Root-only, device-mapper: LUKS2 encryption of volumes by the agent's CSI node plugin
//! (`volume_context["encryption"] = "luks2"`, the key in the node-stage secret), with a
//! real agent process, loop devices, dm-crypt mappings, filesystems and mounts.
//!
//! The VM lane runs these (scripts/vm-test: Debian's kernels have dm-crypt); this host's
//! kernel has no device-mapper, and scripts/test says so instead of running them. Without
//! device-mapper they FAIL, never skip.
//!
//! The sandbox is `tests/csi_root.rs`'s (an agent in a private network namespace with its
//! whole tree under `/tmp/npcsi-<pid>-crypt-<test>`; dropped, also on panic, it closes the
//! dm-crypt mappings over its loop devices too), with the agent logging at debug level.
//! Volume ids carry the process id, so mapping names (`npc-<id>`, global in the kernel)
//! never collide.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nodeplane::rpc::csi;
use nodeplane::rpc::node as napi;
use tonic::Code;

use nodeplane::storage::csi::snapshot::Taken;
use nodeplane::storage::csi::{NodeService, NodeSettings};
use nodeplane::storage::store::{Backend, FsType, Source, VolumeStore};

use crate::csi_root::{Sandbox, assert_code, cap_for, mounted_at, mounts_under};

const MIB: u64 = 1 << 20;
/// The test key: 64 hex digits, as the controller makes them.
const KEY: &str = "6b1f0c7e9a2d4c5b8e3f7a6d1c0b9e8f2a3d4c5b6e7f8091a2b3c4d5e6f70819";
const WRONG_KEY: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// A sandbox whose agent logs at debug level (the key must not show even there).
fn sandbox(name: &str) -> Sandbox {
    require_root();
    let mut sb = Sandbox::new(&format!("crypt-{name}"));
    sb.log_level = "debug";
    sb
}

/// A thin pool (`pool`, of `mib` MiB) and a sandbox whose agent puts volumes there.
fn thin_sandbox(pool: &str, mib: u64, name: &str) -> (crate::lvm_root::Pool, Sandbox) {
    let pool = crate::lvm_root::Pool::new(pool, mib);
    let csi = serde_json::json!({
        "capacityBytes": 4u64 << 30,
        "maxVolumes": 16,
        "lvm": {"volumeGroup": pool.vg, "thinPool": "pool"},
    });
    let sb = Sandbox::with_csi(name, csi);
    (pool, sb)
}

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
    let mut sb = sandbox("fs");
    let mut c = sb.start().await;
    let id = vol_id("fs");
    c.create(&id, 64 * MIB, "ext4").await;
    let staging = sb.staging(&id, false);
    let target = sb.target(&id, "pod-a", false);
    c.stage_with(&id, &staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    // Staging again is idempotent; without encryption it is another request.
    c.stage_with(&id, &staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    assert_code(c.stage_with(&id, &staging, cap_for("ext4"), None).await, Code::AlreadyExists, "restage unencrypted");
    assert!(mapper(&id).exists(), "the mapping exists while staged");
    let (fs_type, num, _) = mounted_at(Path::new(&staging)).expect("staged");
    assert_eq!((fs_type.as_str(), num), ("ext4", dev_of(&mapper(&id))), "the filesystem is on the mapping");
    let rec: serde_json::Value = serde_json::from_slice(&fs::read(sb.stage_record(&id)).unwrap()).unwrap();
    assert_eq!(rec["encrypted"], true, "{rec}");

    c.publish(&id, &staging, &target, cap_for("ext4"), false).await.unwrap();
    let file = Path::new(&target).join("marker");
    write_synced(&file, &marker());
    let st = c.stats(&id, &target).await.unwrap();
    assert!(!st.volume_condition.unwrap().abnormal, "stats see the mapping's mount as the volume's");
    assert!(!file_contains(&sb.image(&id), &marker()), "the marker is in the image in clear");

    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists(), "the mapping is gone after unstage");
    sb.assert_clean();
    assert!(!file_contains(&sb.image(&id), &marker()), "the marker is in the image in clear");
    assert!(file_contains(&sb.image(&id), b"LUKS\xba\xbe"), "the image holds a LUKS header");

    c.stage_with(&id, &staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    c.publish(&id, &staging, &target, cap_for("ext4"), false).await.unwrap();
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
    let mut sb = sandbox("wrong");
    let mut c = sb.start().await;
    let id = vol_id("wrong");
    c.create(&id, 64 * MIB, "ext4").await;
    let staging = sb.staging(&id, false);
    c.stage_with(&id, &staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    write_synced(&Path::new(&staging).join("marker"), &marker());
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();

    let msg = assert_code(
        c.stage_with(&id, &staging, cap_for("ext4"), Some(WRONG_KEY)).await,
        Code::InvalidArgument,
        "wrong key",
    );
    assert!(msg.contains(&format!("the key in the node-stage secret does not open volume {id}")), "{msg}");
    assert!(!mapper(&id).exists(), "a wrong key left a mapping");
    assert!(mounted_at(Path::new(&staging)).is_none(), "a wrong key left a mount");
    assert!(!sb.stage_record(&id).exists(), "a wrong key left a stage record");
    sb.assert_clean();

    let msg =
        assert_code(c.stage_with(&id, &staging, cap_for("ext4"), Some("")).await, Code::InvalidArgument, "no key");
    assert!(msg.contains("\"key\""), "{msg}");
    let msg =
        assert_code(c.stage_with(&id, &staging, cap_for("ext4"), None).await, Code::FailedPrecondition, "no luks2");
    assert!(msg.contains("crypto_LUKS"), "{msg}");
    sb.assert_clean();

    c.stage_with(&id, &staging, cap_for("ext4"), Some(KEY)).await.unwrap();
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
    let mut sb = sandbox("block");
    let mut c = sb.start().await;
    let id = vol_id("block");
    c.create(&id, 32 * MIB, "").await;
    let staging = sb.staging(&id, true);
    let target = sb.target(&id, "pod-b", true);
    c.stage_with(&id, &staging, cap_for(""), Some(KEY)).await.unwrap();
    assert!(mapper(&id).exists());
    c.publish(&id, &staging, &target, cap_for(""), false).await.unwrap();
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
        volume_capability: Some(cap_for("")),
        readonly: true,
        ..Default::default()
    };
    assert_code(c.node.node_publish_volume(ro).await, Code::FailedPrecondition, "read-only block");
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists());
    sb.assert_clean();

    c.stage_with(&id, &staging, cap_for(""), Some(KEY)).await.unwrap();
    c.publish(&id, &staging, &target, cap_for(""), false).await.unwrap();
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
    let mut sb = sandbox("grow");
    let mut c = sb.start().await;
    let id = vol_id("grow");
    c.create(&id, 320 * MIB, "xfs").await;
    let staging = sb.staging(&id, false);
    let target = sb.target(&id, "pod-g", false);
    c.stage_with(&id, &staging, cap_for("xfs"), Some(KEY)).await.unwrap();
    c.publish(&id, &staging, &target, cap_for("xfs"), false).await.unwrap();
    write_synced(&Path::new(&target).join("marker"), &marker());
    let total = |p: &str| {
        let s = nix::sys::statvfs::statvfs(p).unwrap();
        s.blocks() * s.fragment_size()
    };
    let before = total(&target);
    assert_eq!(c.expand(&id, &target, 480 * MIB, 0).await.unwrap(), 480 * MIB as i64);
    let after = total(&target);
    assert!(after >= before + 150 * MIB, "statfs did not grow: {before} -> {after}");
    let mapped = nodeplane::sys::loopdev::device_size(&mapper(&id)).unwrap();
    assert_eq!(mapped, 478 * MIB, "the mapping grew with its device");
    assert_eq!(fs::read(Path::new(&target).join("marker")).unwrap(), marker());
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    sb.assert_clean();
}

/// An encrypted thin volume (the `lvm` backend): the container is on the LV, the marker
/// never on it in clear, a wrong key opens nothing, and the data reads back after an
/// unstage and a new stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_thin_volume_round_trip() {
    require_root();
    let (pool, mut sb) = thin_sandbox("crypt", 256, "crypt-thin");
    sb.log_level = "debug";
    let mut c = sb.start().await;
    let id = vol_id("thin");
    c.create_on(&id, 64 * MIB, "ext4", "lvm").await;
    let lv = PathBuf::from(format!("/dev/{}/np-{id}", pool.vg));
    let staging = sb.staging(&id, false);
    c.stage_with(&id, &staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    let (fs_type, num, _) = mounted_at(Path::new(&staging)).expect("staged");
    assert_eq!((fs_type.as_str(), num), ("ext4", dev_of(&mapper(&id))), "the filesystem is on the mapping");
    write_synced(&Path::new(&staging).join("marker"), &marker());
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists(), "the mapping is gone after unstage");
    assert!(file_contains(&lv, b"LUKS\xba\xbe"), "the LV holds a LUKS header");
    assert!(!file_contains(&lv, &marker()), "the marker is on the LV in clear");
    let r = c.stage_with(&id, &staging, cap_for("ext4"), Some(WRONG_KEY)).await;
    assert_code(r, Code::InvalidArgument, "wrong key");
    assert!(!mapper(&id).exists() && mounted_at(Path::new(&staging)).is_none());
    c.stage_with(&id, &staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    assert_eq!(fs::read(Path::new(&staging).join("marker")).unwrap(), marker());
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists());
    assert!(mounts_under(&sb.dir).is_empty());
    c.vols.delete_volume(napi::DeleteVolumeRequest { id: id.clone() }).await.unwrap();
}

/// Encrypted thin volumes after a reboot, as far as a volume sees one: the LV is active
/// again (the agent activates every LV at start) and the mapping is gone, the stage record
/// kept. A raw block volume's first stage drops the container's "fresh" label (the pod owns
/// what it holds); it is "not staged" until NodeStage opens the mapping again, and
/// then publishes the mapping, never the LV under it. A stage that fails after opening the
/// mapping (a mount option ext4 rejects) closes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_thin_volumes_reopen_after_a_reboot_and_close_on_a_failed_stage() {
    use nodeplane::rpc::csi::volume_capability::{AccessType, MountVolume};
    require_root();
    let (pool, mut sb) = thin_sandbox("crypt-boot", 256, "crypt-boot");
    let mut c = sb.start().await;
    let id = vol_id("boot");
    c.create_on(&id, 64 * MIB, "", "lvm").await;
    let lv = PathBuf::from(format!("/dev/{}/np-{id}", pool.vg));
    let staging = sb.staging(&id, true);
    let target = sb.target(&id, "pod-b", true);
    c.stage_with(&id, &staging, cap_for(""), Some(KEY)).await.unwrap();
    let dump = Command::new("cryptsetup").arg("luksDump").arg(&lv).output().unwrap();
    let dump = String::from_utf8_lossy(&dump.stdout);
    assert!(dump.contains("LUKS header") && !dump.contains("nodeplane-fresh"), "the pod owns it now: {dump}");
    c.publish(&id, &staging, &target, cap_for(""), false).await.unwrap();
    let dev = OpenOptions::new().read(true).write(true).open(&target).unwrap();
    dev.write_all_at(&marker(), 5 * MIB).unwrap();
    dev.sync_all().unwrap();
    drop(dev);
    c.unpublish(&id, &target).await.unwrap();
    let closed = Command::new("cryptsetup").args(["close", &format!("npc-{id}")]).status().unwrap();
    assert!(closed.success() && lv.exists() && !mapper(&id).exists());

    assert_code(c.publish(&id, &staging, &target, cap_for(""), false).await, Code::FailedPrecondition, "no mapping");
    c.stage_with(&id, &staging, cap_for(""), Some(KEY)).await.unwrap();
    assert!(mapper(&id).exists(), "the stage opened the mapping again");
    c.publish(&id, &staging, &target, cap_for(""), false).await.unwrap();
    assert_eq!(dev_of(Path::new(&target)), dev_of(&mapper(&id)), "the pod's device is the mapping");
    let mut buf = vec![0u8; marker().len()];
    fs::File::open(&target).unwrap().read_exact_at(&mut buf, 5 * MIB).unwrap();
    assert_eq!(buf, marker(), "the marker reads back through the mapping");
    c.unpublish(&id, &target).await.unwrap();
    c.unstage(&id, &staging).await.unwrap();
    assert!(!mapper(&id).exists());

    let fs_id = vol_id("badopt");
    c.create_on(&fs_id, 64 * MIB, "ext4", "lvm").await;
    let fs_staging = sb.staging(&fs_id, false);
    let mut cap = cap_for("ext4");
    cap.access_type = Some(AccessType::Mount(MountVolume {
        fs_type: "ext4".into(),
        mount_flags: vec!["no_such_option".into()],
        volume_mount_group: String::new(),
    }));
    let r = c.stage_with(&fs_id, &fs_staging, cap, Some(KEY)).await;
    assert_code(r, Code::InvalidArgument, "a mount option ext4 rejects");
    assert!(!mapper(&fs_id).exists(), "the failed stage left its mapping open");
    assert!(mounts_under(&sb.dir).is_empty());
    for v in [id, fs_id] {
        c.vols.delete_volume(napi::DeleteVolumeRequest { id: v }).await.unwrap();
    }
    assert!(pool.volume_lvs().is_empty(), "{:?}", pool.volume_lvs());
}

/// The copy's own key (the controller makes a fresh one per volume).
const COPY_KEY: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

/// NodeStageVolume of an encrypted volume with its own `key` and the `sourceKey` its
/// copy's node-stage secret carries.
async fn stage_copy(
    c: &mut crate::csi_root::Clients,
    id: &str,
    staging: &str,
    key: &str,
    source_key: &str,
) -> Result<(), tonic::Status> {
    let mut req = csi::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.into(),
        volume_capability: Some(cap_for("ext4")),
        ..Default::default()
    };
    req.volume_context.insert("encryption".into(), "luks2".into());
    req.secrets.insert("key".into(), key.into());
    req.secrets.insert("sourceKey".into(), source_key.into());
    c.node.node_stage_volume(req).await.map(|_| ())
}

/// What the store's snapshot, restore and clone make of a volume: its blocks, byte for
/// byte, on a volume of its own (the file backend's reflink or copy of the image; the
/// lvm backend's thin snapshot). `from` and `to` are images or block devices.
fn copy_blocks(from: &Path, to: &Path) {
    let mut src = fs::File::open(from).unwrap();
    let mut dst = OpenOptions::new().write(true).open(to).unwrap();
    std::io::copy(&mut src, &mut dst).unwrap();
    dst.sync_all().unwrap();
}

/// The volume key of open mapping `name`, from its device-mapper table
/// (`0 <len> crypt <cipher> <key> <iv_offset> <dev> <offset>`).
fn volume_key_of(name: &str) -> String {
    let out = Command::new("dmsetup").args(["table", "--showkeys", name]).output().unwrap();
    assert!(out.status.success(), "dmsetup table {name}: {}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    let key = table.split_whitespace().nth(4).expect("a crypt table").to_string();
    assert!(key.len() >= 64 && key.bytes().all(|b| b.is_ascii_hexdigit()), "not a key in the table of {name}");
    key
}

/// Whether `key` opens a key slot of the LUKS container on `dev` (an image or a device).
fn opens(dev: &Path, key: &str) -> bool {
    let mut child = Command::new("cryptsetup")
        .args(["open", "--test-passphrase", "--key-file=-"])
        .arg(dev)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), key.as_bytes()).unwrap();
    let st = child.wait().unwrap();
    assert!(matches!(st.code(), Some(0) | Some(2)), "cryptsetup --test-passphrase: {st}");
    st.success()
}

/// The passphrase key slots of the container on `dev`, from `luksDump`.
fn key_slots(dev: &Path) -> usize {
    let out = Command::new("cryptsetup").arg("luksDump").arg(dev).output().unwrap();
    let dump = String::from_utf8(out.stdout).unwrap();
    let slots = dump.split("Keyslots:").nth(1).unwrap_or("").split("Tokens:").next().unwrap();
    slots.lines().filter(|l| l.starts_with("  ") && l.contains(": luks2")).count()
}

/// An encrypted volume's blocks copied to another volume (a restore or a clone): the
/// copy's first stage, with its own key and the source's as `sourceKey`, re-keys it. It
/// reads the source's data; its volume key is not the source's; the source's key no
/// longer opens it while the source still opens with it; only one key slot is left. A
/// crash at each re-key step, then kubelet's retry, ends the same way; a wrong
/// `sourceKey` is INVALID_ARGUMENT and leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_an_encrypted_volume_gets_its_own_key() {
    let mut sb = sandbox("copy");
    let mut c = sb.start().await;
    let src = vol_id("csrc");
    c.create(&src, 64 * MIB, "ext4").await;
    let src_staging = sb.staging(&src, false);
    c.stage_with(&src, &src_staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    write_synced(&Path::new(&src_staging).join("marker"), &marker());
    c.unstage(&src, &src_staging).await.unwrap();

    let copy = vol_id("copy");
    c.create(&copy, 64 * MIB, "ext4").await;
    copy_blocks(&sb.image(&src), &sb.image(&copy));
    assert!(opens(&sb.image(&copy), KEY) && !opens(&sb.image(&copy), COPY_KEY), "the copy starts as the source");
    let staging = sb.staging(&copy, false);
    let started = std::time::Instant::now();
    stage_copy(&mut c, &copy, &staging, COPY_KEY, KEY).await.unwrap();
    let secs = started.elapsed().as_secs_f64();
    eprintln!("re-key stage of a 64 MiB file volume: {secs:.1} s ({:.1} MB/s)", 64.0 * 1.048576 / secs);
    assert_eq!(fs::read(Path::new(&staging).join("marker")).unwrap(), marker(), "the copy reads the source's data");
    c.stage_with(&src, &src_staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    let (copy_vk, src_vk) = (volume_key_of(&format!("npc-{copy}")), volume_key_of(&format!("npc-{src}")));
    assert!(copy_vk != src_vk, "the copy's volume key is the source's");
    // A retried stage with the same secret is idempotent.
    stage_copy(&mut c, &copy, &staging, COPY_KEY, KEY).await.unwrap();
    c.unstage(&src, &src_staging).await.unwrap();
    c.unstage(&copy, &staging).await.unwrap();
    sb.assert_clean();
    assert!(!opens(&sb.image(&copy), KEY), "the source's key still opens the copy");
    assert!(opens(&sb.image(&copy), COPY_KEY));
    assert_eq!(key_slots(&sb.image(&copy)), 1, "a key slot besides the copy's own is left");
    assert!(opens(&sb.image(&src), KEY), "the source no longer opens with its key");
    assert!(!file_contains(&sb.image(&copy), &marker()), "the marker is in the copy's image in clear");
    // Its own key alone stages it from now on.
    c.stage_with(&copy, &staging, cap_for("ext4"), Some(COPY_KEY)).await.unwrap();
    assert_eq!(fs::read(Path::new(&staging).join("marker")).unwrap(), marker());
    c.unstage(&copy, &staging).await.unwrap();

    // A wrong sourceKey: INVALID_ARGUMENT, nothing open, mounted or recorded, nothing changed.
    let bad = vol_id("cbad");
    c.create(&bad, 64 * MIB, "ext4").await;
    copy_blocks(&sb.image(&src), &sb.image(&bad));
    let bad_staging = sb.staging(&bad, false);
    let msg =
        assert_code(stage_copy(&mut c, &bad, &bad_staging, COPY_KEY, WRONG_KEY).await, Code::InvalidArgument, "bad");
    assert!(msg.contains("sourceKey"), "{msg}");
    assert!(
        !mapper(&bad).exists() && mounted_at(Path::new(&bad_staging)).is_none(),
        "a wrong sourceKey left a mapping"
    );
    assert!(!sb.stage_record(&bad).exists(), "a wrong sourceKey left a stage record");
    sb.assert_clean();
    assert!(opens(&sb.image(&bad), KEY) && key_slots(&sb.image(&bad)) == 1, "a failed re-key changed the copy");

    // A crash at each step of the re-key; the retried stage finishes it.
    sb.stop().await;
    let points = ["crypt-rekey-after-addkey", "crypt-rekey-after-init", "crypt-rekey-after-reencrypt"];
    for (round, point) in points.into_iter().enumerate() {
        let id = vol_id(&format!("crash{round}"));
        sb.crash_at = Some(point.to_string());
        let mut c = sb.start().await;
        c.create(&id, 64 * MIB, "ext4").await;
        copy_blocks(&sb.image(&src), &sb.image(&id));
        let st = sb.staging(&id, false);
        assert!(stage_copy(&mut c, &id, &st, COPY_KEY, KEY).await.is_err(), "{point}: the stage did not fail");
        sb.wait_crashed(Duration::from_secs(60));
        assert!(sb.log().contains(&format!("NODEPLANE_CRASH_AT: crashing at {point}\n")), "{point}:\n{}", sb.log());
        sb.crash_at = None;
        let mut c = sb.start().await;
        stage_copy(&mut c, &id, &st, COPY_KEY, KEY).await.unwrap_or_else(|e| panic!("{point}: retry: {e}"));
        assert_eq!(fs::read(Path::new(&st).join("marker")).unwrap(), marker(), "{point}: data");
        c.unstage(&id, &st).await.unwrap();
        assert!(!opens(&sb.image(&id), KEY), "{point}: the source's key still opens the copy");
        assert_eq!(key_slots(&sb.image(&id)), 1, "{point}: key slots left");
        sb.assert_clean();
        sb.stop().await;
    }
}

/// The same on the lvm backend (a thin LV made of the source LV's blocks), with a
/// 256 MiB volume: the re-key writes all of it (the thin LV ends fully allocated). Prints
/// the re-encryption's rate for docs/storage.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thin_copy_of_an_encrypted_volume_gets_its_own_key() {
    require_root();
    let (pool, mut sb) = thin_sandbox("crcopy", 1024, "crypt-thincopy");
    sb.log_level = "debug";
    let mut c = sb.start().await;
    let (src, copy) = (vol_id("tsrc"), vol_id("tcopy"));
    let size = 256 * MIB;
    c.create_on(&src, size, "ext4", "lvm").await;
    c.create_on(&copy, size, "ext4", "lvm").await;
    let lv = |id: &str| PathBuf::from(format!("/dev/{}/np-{id}", pool.vg));
    let (src_staging, staging) = (sb.staging(&src, false), sb.staging(&copy, false));
    c.stage_with(&src, &src_staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    write_synced(&Path::new(&src_staging).join("marker"), &marker());
    c.unstage(&src, &src_staging).await.unwrap();
    copy_blocks(&lv(&src), &lv(&copy));
    let started = std::time::Instant::now();
    stage_copy(&mut c, &copy, &staging, COPY_KEY, KEY).await.unwrap();
    let secs = started.elapsed().as_secs_f64();
    eprintln!("re-key stage of a 256 MiB thin volume: {secs:.1} s ({:.1} MB/s)", 256.0 * 1.048576 / secs);
    assert_eq!(fs::read(Path::new(&staging).join("marker")).unwrap(), marker());
    c.stage_with(&src, &src_staging, cap_for("ext4"), Some(KEY)).await.unwrap();
    assert!(volume_key_of(&format!("npc-{copy}")) != volume_key_of(&format!("npc-{src}")), "same volume key");
    c.unstage(&src, &src_staging).await.unwrap();
    c.unstage(&copy, &staging).await.unwrap();
    assert!(!opens(&lv(&copy), KEY) && opens(&lv(&copy), COPY_KEY) && opens(&lv(&src), KEY));
    assert_eq!(key_slots(&lv(&copy)), 1);
    assert!(!mapper(&copy).exists() && mounts_under(&sb.dir).is_empty());
    for id in [&src, &copy] {
        c.vols.delete_volume(napi::DeleteVolumeRequest { id: id.clone() }).await.unwrap();
    }
}

/// A NodeStageVolumeRequest of encrypted volume `id` with `key` (and a copy's `sourceKey`).
fn encrypted_stage(id: &str, staging: &Path, key: &str, source_key: Option<&str>) -> csi::NodeStageVolumeRequest {
    let mut req = csi::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap_for("ext4")),
        ..Default::default()
    };
    req.volume_context.insert("encryption".into(), "luks2".into());
    req.secrets.insert("key".into(), key.into());
    if let Some(k) = source_key {
        req.secrets.insert("sourceKey".into(), k.into());
    }
    req
}

fn unstage_request(id: &str, staging: &Path) -> csi::NodeUnstageVolumeRequest {
    csi::NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging.display().to_string() }
}

/// A snapshot and a clone of a staged encrypted volume, taken by the node service as the
/// agent's volume sync calls it (here in this process, over the sandbox's directories),
/// freeze the filesystem on the volume's mapping: both hold a file written just before
/// and never synced. Without that freeze the file backend, on a store without reflink
/// (the VM lane's ext4), refuses to copy a volume in use; on the lvm backend, the thin
/// snapshot's suspend of the LV does not reach the filesystem on the mapping above it.
#[test]
fn copies_of_a_staged_encrypted_volume_are_taken_frozen() {
    require_root();
    for backend in [Backend::File, Backend::Lvm] {
        let sb = Sandbox::on("crypt-frozen", backend);
        let mut store = VolumeStore::open(&sb.volume_dir(), 4 << 30).unwrap();
        if let Some(pool) = sb.thin_pool() {
            store = store.with_thin_pool(pool).unwrap();
        }
        fs::create_dir_all(sb.kubelet()).unwrap();
        let settings = NodeSettings {
            node_id: "crypt-frozen".into(),
            kubelet_dir: sb.kubelet().canonicalize().unwrap(),
            record_dir: sb.root().join("state/csi"),
            max_volumes: 16,
        };
        let svc = NodeService::new(settings, std::sync::Arc::new(store)).unwrap();
        svc.recover().unwrap();

        let id = vol_id(&format!("frz-{backend:?}").to_lowercase());
        svc.store.create_on(backend, &id, 64 * MIB, FsType::Ext4, "").unwrap();
        let staging = PathBuf::from(sb.staging(&id, false));
        svc.stage(&encrypted_stage(&id, &staging, KEY, None)).unwrap();
        // Into the page cache only: the copies hold it only if the filesystem was frozen.
        fs::write(staging.join("marker"), marker()).unwrap();
        let snap = format!("{id}-s");
        let Taken::Done(_) = svc.take_snapshot(&snap, &id, "").unwrap() else { panic!("{backend:?}: snapshot busy") };
        let clone = format!("{id}-c");
        let Taken::Done(_) = svc.create_volume_from(&clone, 64 * MIB, "", &Source::Volume(id.clone())).unwrap() else {
            panic!("{backend:?}: clone busy")
        };
        svc.unstage(&unstage_request(&id, &staging)).unwrap();
        let restored = format!("{id}-r");
        svc.store.create_from(&restored, 64 * MIB, "", &Source::Snapshot(snap.clone())).unwrap();

        for copy in [&clone, &restored] {
            let st = PathBuf::from(sb.staging(copy, false));
            svc.stage(&encrypted_stage(copy, &st, COPY_KEY, Some(KEY))).unwrap();
            let read = fs::read(st.join("marker")).unwrap_or_default();
            assert!(read == marker(), "{backend:?}: {copy} lacks the data written before the copy");
            svc.unstage(&unstage_request(copy, &st)).unwrap();
        }
        for v in [&clone, &restored, &id] {
            svc.store.delete(v).unwrap();
        }
        svc.store.delete_snapshot(&snap).unwrap();
        sb.assert_clean();
    }
}
