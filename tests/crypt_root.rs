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

use nodeplane::rpc::csi;
use nodeplane::rpc::node as napi;
use tonic::Code;

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
    let pool = crate::lvm_root::Pool::new("crypt", 256);
    let csi = serde_json::json!({
        "capacityBytes": 4u64 << 30,
        "maxVolumes": 16,
        "lvm": {"volumeGroup": pool.vg, "thinPool": "pool"},
    });
    let mut sb = Sandbox::with_csi("crypt-thin", csi);
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
