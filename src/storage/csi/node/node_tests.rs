//! The node service against [`FakeKernel`]: every branch of stage, publish, unpublish and
//! unstage, their rollbacks and the start-up recovery, without root. Each test asserts what
//! the kernel was left with (mounts, attached loop devices) and the records on disk, not just
//! the answer.

use super::records::StageRecord;
use super::*;
use crate::rpc::csi::volume_capability::access_mode::Mode;
use crate::storage::store::FsType;
use crate::sys::fake_volume::{Attached, DEVTMPFS, FakeKernel, LOOP_MAJOR};
use crate::sys::mount::MountOptions;
use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use nix::errno::Errno;
use std::os::unix::fs::MetadataExt;

const MIB: u64 = 1 << 20;

struct Env {
    _dir: crate::util::TestDir,
    fake: Arc<FakeKernel>,
    svc: NodeService,
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

fn mount_cap(fs: &str, flags: &[&str]) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
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

impl Env {
    fn new(tag: &str) -> Env {
        let dir = crate::util::TestDir::new(&format!("csi-node-{tag}"));
        std::fs::create_dir_all(dir.0.join("kubelet/pods")).unwrap();
        let fake = Arc::new(FakeKernel::new());
        let store = VolumeStore::open_with(&dir.0.join("volumes"), 1 << 30, fake.clone()).unwrap();
        let settings = NodeSettings {
            node_id: "n1".into(),
            kubelet_dir: dir.0.join("kubelet").canonicalize().unwrap(),
            record_dir: dir.0.join("state/csi"),
            max_volumes: 8,
        };
        let svc = NodeService::new(settings, Arc::new(store)).unwrap();
        Env { _dir: dir, fake, svc }
    }

    fn kubelet(&self) -> &Path {
        &self.svc.settings.kubelet_dir
    }

    /// Volume `id` of 64 MiB; returns its image path.
    fn volume(&self, id: &str, fs: FsType) -> PathBuf {
        self.svc.store.create(id, 64 * MIB, fs).unwrap().path
    }

    fn staging(&self, id: &str) -> PathBuf {
        self.kubelet().join(format!("plugins/kubernetes.io/csi/pv/{id}/globalmount"))
    }

    /// A filesystem publish target whose parent kubelet made (the target itself does not exist).
    fn target(&self, pod: &str, id: &str) -> PathBuf {
        let d = self.kubelet().join(format!("pods/{pod}/volumes/kubernetes.io~csi/{id}"));
        std::fs::create_dir_all(&d).unwrap();
        d.join("mount")
    }

    /// A block publish target whose parent kubelet made.
    fn block_target(&self, pod: &str, id: &str) -> PathBuf {
        let d = self.kubelet().join(format!("plugins/kubernetes.io/csi/volumeDevices/publish/{id}"));
        std::fs::create_dir_all(&d).unwrap();
        d.join(pod)
    }

    fn stage(&self, id: &str, staging: &Path, cap: csi::VolumeCapability) -> Result<()> {
        self.svc.stage(&csi::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: s(staging),
            volume_capability: Some(cap),
            ..Default::default()
        })
    }

    fn unstage(&self, id: &str, staging: &Path) -> Result<()> {
        self.svc.unstage(&csi::NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: s(staging) })
    }

    fn publish(
        &self,
        id: &str,
        target: &Path,
        staging: &Path,
        cap: csi::VolumeCapability,
        readonly: bool,
    ) -> Result<()> {
        self.svc.publish(&csi::NodePublishVolumeRequest {
            volume_id: id.into(),
            target_path: s(target),
            staging_target_path: s(staging),
            volume_capability: Some(cap),
            readonly,
            ..Default::default()
        })
    }

    fn unpublish(&self, id: &str, target: &Path) -> Result<()> {
        self.svc.unpublish(&csi::NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: s(target) })
    }

    fn stage_record(&self, id: &str) -> Option<StageRecord> {
        self.svc.load_stage(id).unwrap()
    }

    fn publish_record(&self, target: &Path) -> Option<PublishRecord> {
        self.svc.load_publish(target).unwrap()
    }

    fn attached(&self) -> Vec<Attached> {
        self.fake.attached()
    }

    /// Volume `id` left exactly as before a stage that failed: nothing mounted at `staging`,
    /// no loop device, no stage record.
    fn assert_rolled_back(&self, id: &str, staging: &Path, what: &str) {
        assert!(self.fake.mounts_at(staging).is_empty(), "{what}: mount left at the staging path");
        assert_eq!(self.attached(), vec![], "{what}: loop device left attached");
        assert_eq!(self.stage_record(id), None, "{what}: stage record left behind");
    }

    /// Volume `id` staged at `staging` as a filesystem: one mount of its loop device there,
    /// the record in state staged.
    fn assert_staged_fs(&self, id: &str, staging: &Path, img: &Path, fs: &str) {
        let att = self.attached();
        assert_eq!(att.len(), 1, "{att:?}");
        assert_eq!((att[0].backing.as_path(), att[0].read_only), (img, false));
        let at = self.fake.mounts_at(staging);
        assert_eq!(at.len(), 1, "{at:?}");
        assert_eq!((at[0].major, at[0].fs_type.as_str()), (LOOP_MAJOR, fs));
        assert_eq!(at[0].source, att[0].device.display().to_string());
        let r = self.stage_record(id).expect("stage record");
        assert_eq!((r.state, r.staging_path.as_path()), (StageState::Staged, staging));
    }
}

// ----- NodeStageVolume -----

#[test]
fn stage_makes_the_filesystem_once_mounts_it_and_records_it() {
    let e = Env::new("stage-ok");
    let img = e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.assert_staged_fs("v1", &staging, &img, "ext4");
    assert_eq!(e.fake.filesystem_of(&img), Some(("ext4".into(), 64 * MIB)));
    assert!(!e.fake.mounts_at(&staging)[0].read_only());
    assert_eq!(e.fake.count("mkfs"), 1);
    assert_eq!(e.fake.count("loop_attach"), 1);

    // kubelet repeats NodeStage: nothing changes.
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.stage("v1", &staging, mount_cap("", &[])).unwrap();
    e.assert_staged_fs("v1", &staging, &img, "ext4");
    assert_eq!((e.fake.count("mkfs"), e.fake.count("loop_attach"), e.fake.count("mount_device")), (1, 1, 1));

    // Unstaged and staged again: the filesystem made the first time is kept.
    e.unstage("v1", &staging).unwrap();
    assert_eq!(e.attached(), vec![]);
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.assert_staged_fs("v1", &staging, &img, "ext4");
    assert_eq!(e.fake.count("mkfs"), 1);
}

#[test]
fn stage_read_only_flag_mounts_read_only() {
    let e = Env::new("stage-ro");
    let img = e.volume("v1", FsType::Xfs);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("xfs", &["ro", "noatime"])).unwrap();
    e.assert_staged_fs("v1", &staging, &img, "xfs");
    assert!(e.fake.mounts_at(&staging)[0].read_only());
}

#[test]
#[allow(clippy::type_complexity)] // a table of cases
fn stage_rolls_back_whichever_step_fails() {
    // (operation that fails, fs type, filesystem already in the image (type, size), code)
    let cases: &[(&str, FsType, Option<(&str, u64)>, Code)] = &[
        ("loop_attach", FsType::Ext4, None, Code::Internal),
        ("fs_probe", FsType::Ext4, None, Code::Internal),
        ("mkfs", FsType::Ext4, None, Code::Internal),
        ("device_size", FsType::Ext4, None, Code::Internal),
        ("fs_size", FsType::Ext4, Some(("ext4", 32 * MIB)), Code::Internal),
        // ext4 grown while unstaged is grown offline, before the mount.
        ("grow_fs", FsType::Ext4, Some(("ext4", 32 * MIB)), Code::Internal),
        ("mount_device", FsType::Ext4, None, Code::Internal),
        ("mount_device", FsType::Xfs, None, Code::Internal),
        // xfs is measured and grown through its mount: these fail after the mount was made.
        ("fs_size", FsType::Xfs, Some(("xfs", 32 * MIB)), Code::Internal),
        ("grow_fs", FsType::Xfs, Some(("xfs", 32 * MIB)), Code::Internal),
    ];
    for (i, &(op, fs, existing, code)) in cases.iter().enumerate() {
        let what = format!("{op} failing ({fs})");
        let e = Env::new(&format!("stage-rollback-{i}"));
        let img = e.volume("v1", fs);
        if let Some((t, size)) = existing {
            e.fake.put_filesystem(&img, t, size);
        }
        let staging = e.staging("v1");
        e.fake.fail(op, Errno::EIO);
        let err = e.stage("v1", &staging, mount_cap(fs.as_str(), &[])).unwrap_err();
        assert_eq!(e.fake.pending_faults(), 0, "{what}: the fault never fired");
        assert_eq!(err.code, code, "{what}: {err}");
        e.assert_rolled_back("v1", &staging, &what);

        // The retry finds nothing in its way.
        e.stage("v1", &staging, mount_cap(fs.as_str(), &[])).unwrap_or_else(|e| panic!("{what}: retry: {e}"));
        e.assert_staged_fs("v1", &staging, &img, fs.as_str());
        let (_, size) = e.fake.filesystem_of(&img).unwrap();
        assert_eq!(size, 64 * MIB, "{what}: the filesystem spans the device after the retry");
    }
}

#[test]
fn stage_failure_after_the_mount_unmounts_it() {
    let e = Env::new("stage-unmount");
    let img = e.volume("v1", FsType::Xfs);
    e.fake.put_filesystem(&img, "xfs", 32 * MIB);
    let staging = e.staging("v1");
    e.fake.fail("grow_fs", Errno::EIO);
    e.stage("v1", &staging, mount_cap("xfs", &[])).unwrap_err();
    let calls = e.fake.calls();
    let mount = calls.iter().position(|c| c.starts_with("mount_device ")).expect("mounted");
    let unmount = calls.iter().position(|c| *c == format!("unmount {}", staging.display())).expect("unmounted");
    let detach = calls.iter().position(|c| c.starts_with("loop_detach ")).expect("detached");
    assert!(mount < unmount && unmount < detach, "{calls:#?}");
    e.assert_rolled_back("v1", &staging, "xfs grow");
}

#[test]
fn stage_rollback_keeps_a_device_attached_before() {
    let e = Env::new("stage-attached-before");
    e.volume("v1", FsType::Ext4);
    let dev = e.svc.store.attach("v1").unwrap();
    let staging = e.staging("v1");
    e.fake.fail("mount_device", Errno::EIO);
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap_err();
    assert!(e.fake.mounts_at(&staging).is_empty());
    assert_eq!(e.attached().iter().map(|a| a.device.clone()).collect::<Vec<_>>(), vec![dev]);
    assert_eq!(e.stage_record("v1"), None);
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    assert_eq!(e.fake.count("loop_attach"), 1, "the device attached before is used");
}

#[test]
fn stage_mount_einval_is_invalid_argument() {
    let e = Env::new("stage-einval");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.fake.fail("mount_device", Errno::EINVAL);
    let err = e.stage("v1", &staging, mount_cap("ext4", &["bogus_option"])).unwrap_err();
    assert_eq!(err.code, Code::InvalidArgument, "{err}");
    assert!(err.msg.contains("bogus_option"), "{err}");
    e.assert_rolled_back("v1", &staging, "EINVAL");
}

#[test]
fn stage_refuses_a_device_holding_another_filesystem() {
    let e = Env::new("stage-foreign-fs");
    let img = e.volume("v1", FsType::Ext4);
    e.fake.put_filesystem(&img, "swap", 64 * MIB);
    let staging = e.staging("v1");
    let err = e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
    assert!(err.msg.contains("swap"), "{err}");
    assert_eq!(e.fake.count("mkfs"), 0, "never formatted");
    assert_eq!(e.fake.count("mount_device"), 0);
    assert_eq!(e.fake.filesystem_of(&img), Some(("swap".into(), 64 * MIB)));
    e.assert_rolled_back("v1", &staging, "foreign filesystem");
}

#[test]
fn stage_elsewhere_is_failed_precondition() {
    let e = Env::new("stage-elsewhere");
    let img = e.volume("v1", FsType::Ext4);
    let a = e.staging("v1");
    let b = e.kubelet().join("plugins/kubernetes.io/csi/pv/other/globalmount");
    e.stage("v1", &a, mount_cap("ext4", &[])).unwrap();
    let err = e.stage("v1", &b, mount_cap("ext4", &[])).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
    assert!(e.fake.mounts_at(&b).is_empty());
    e.assert_staged_fs("v1", &a, &img, "ext4");
}

#[test]
fn stage_same_path_other_capability_is_already_exists() {
    let e = Env::new("stage-other-cap");
    let img = e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let err = e.stage("v1", &staging, mount_cap("ext4", &["noatime"])).unwrap_err();
    assert_eq!(err.code, Code::AlreadyExists, "{err}");
    e.assert_staged_fs("v1", &staging, &img, "ext4");
    assert_eq!(e.fake.count("mount_device"), 1);
}

#[test]
fn stage_unknown_volume_is_not_found() {
    let e = Env::new("stage-unknown");
    e.fake.clear_calls();
    let err = e.stage("ghost", &e.staging("ghost"), mount_cap("ext4", &[])).unwrap_err();
    assert_eq!(err.code, Code::NotFound, "{err}");
    assert_eq!(e.fake.calls(), Vec::<String>::new());
    assert_eq!(e.stage_record("ghost"), None);
}

#[test]
fn stage_over_someone_elses_mount_is_already_exists() {
    let e = Env::new("stage-foreign-mount");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    std::fs::create_dir_all(&staging).unwrap();
    e.fake.add_mount(&staging, "tmpfs", "tmpfs", (0, 77));
    let err = e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap_err();
    assert_eq!(err.code, Code::AlreadyExists, "{err}");
    let at = e.fake.mounts_at(&staging);
    assert_eq!(at.len(), 1);
    assert_eq!(at[0].fs_type, "tmpfs", "the other mount is left alone");
    assert_eq!(e.attached(), vec![]);
    assert_eq!(e.stage_record("v1"), None);
}

#[test]
fn stage_block_attaches_without_a_filesystem_or_mount() {
    let e = Env::new("stage-block");
    let img = e.volume("b1", FsType::Raw);
    let staging = e.staging("b1");
    e.stage("b1", &staging, block_cap()).unwrap();
    e.stage("b1", &staging, block_cap()).unwrap();
    assert_eq!(e.attached(), vec![Attached { device: "/dev/loop0".into(), backing: img.clone(), read_only: false }]);
    assert!(e.fake.mounts().is_empty());
    assert_eq!((e.fake.count("mkfs"), e.fake.count("fs_probe"), e.fake.count("loop_attach")), (0, 0, 1));
    assert_eq!(e.fake.filesystem_of(&img), None);
    assert_eq!(e.stage_record("b1").unwrap().state, StageState::Staged);

    // A raw volume cannot be mounted as a filesystem.
    let err = e.stage("b1", &staging, mount_cap("", &[])).unwrap_err();
    assert_eq!(err.code, Code::InvalidArgument, "{err}");
}

#[test]
fn stage_block_attach_failure_leaves_nothing() {
    let e = Env::new("stage-block-fail");
    e.volume("b1", FsType::Raw);
    let staging = e.staging("b1");
    e.fake.fail("loop_attach", Errno::ENOSPC);
    assert_eq!(e.stage("b1", &staging, block_cap()).unwrap_err().code, Code::Internal);
    e.assert_rolled_back("b1", &staging, "block attach");
    e.stage("b1", &staging, block_cap()).unwrap();
    assert_eq!(e.attached().len(), 1);
}

// ----- NodePublishVolume -----

#[test]
fn publish_filesystem_read_write_and_read_only() {
    let e = Env::new("publish-fs");
    let img = e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let staged = e.fake.mounts_at(&staging)[0].clone();

    let t1 = e.target("pod1", "v1");
    e.publish("v1", &t1, &staging, mount_cap("ext4", &[]), false).unwrap();
    let m = e.fake.mounts_at(&t1);
    assert_eq!(m.len(), 1);
    assert_eq!((m[0].major, m[0].minor, m[0].root.as_path()), (staged.major, staged.minor, Path::new("/")));
    assert!(!m[0].read_only());
    assert!(t1.is_dir(), "the target was created");
    let r = e.publish_record(&t1).expect("publish record");
    assert!(r.created_target && !r.read_only);

    // Repeat: nothing changes.
    e.publish("v1", &t1, &staging, mount_cap("ext4", &[]), false).unwrap();
    assert_eq!(e.fake.mounts_at(&t1).len(), 1);
    assert_eq!(e.fake.count("bind_dir"), 1);

    // The same target read-only is another request: refused while published read-write.
    let err = e.publish("v1", &t1, &staging, mount_cap("ext4", &[]), true).unwrap_err();
    assert_eq!(err.code, Code::AlreadyExists, "{err}");

    let t2 = e.target("pod2", "v1");
    e.publish("v1", &t2, &staging, mount_cap("ext4", &["nosuid"]), true).unwrap();
    let m = e.fake.mounts_at(&t2);
    assert_eq!(m.len(), 1);
    assert!(m[0].read_only());
    assert_eq!((m[0].major, m[0].minor), (staged.major, staged.minor));
    assert!(e.publish_record(&t2).unwrap().read_only);
    e.publish("v1", &t2, &staging, mount_cap("ext4", &["nosuid"]), true).unwrap();
    assert_eq!(e.fake.mounts_at(&t2).len(), 1);
    e.assert_staged_fs("v1", &staging, &img, "ext4");
}

#[test]
fn publish_block_read_write_and_read_only() {
    let e = Env::new("publish-block");
    let img = e.volume("b1", FsType::Raw);
    let staging = e.staging("b1");
    e.stage("b1", &staging, block_cap()).unwrap();

    let t1 = e.block_target("pod1", "b1");
    e.publish("b1", &t1, &staging, block_cap(), false).unwrap();
    let m = e.fake.mounts_at(&t1);
    assert_eq!(m.len(), 1);
    assert_eq!(
        ((m[0].major, m[0].minor), m[0].fs_type.as_str(), m[0].root.as_path()),
        (DEVTMPFS, "devtmpfs", Path::new("/loop0"))
    );
    assert!(!m[0].read_only());
    assert_eq!(e.fake.block_node(&t1), Some((LOOP_MAJOR, 0)), "the target shows the device");
    assert!(t1.is_file(), "the target file was created");
    e.publish("b1", &t1, &staging, block_cap(), false).unwrap();
    assert_eq!(e.fake.count("bind_device"), 1);

    // Read-only: a read-only loop device of its own, bound read-only.
    let t2 = e.block_target("pod2", "b1");
    e.publish("b1", &t2, &staging, block_cap(), true).unwrap();
    let m = e.fake.mounts_at(&t2);
    assert_eq!(m.len(), 1);
    assert!(m[0].read_only());
    assert_eq!(m[0].root, Path::new("/loop1"));
    assert_eq!(
        e.attached(),
        vec![
            Attached { device: "/dev/loop0".into(), backing: img.clone(), read_only: false },
            Attached { device: "/dev/loop1".into(), backing: img.clone(), read_only: true },
        ]
    );
    e.publish("b1", &t2, &staging, block_cap(), true).unwrap();
    assert_eq!(e.fake.count("bind_device"), 2);

    // Unpublishing the last read-only publication releases the read-only device.
    e.unpublish("b1", &t2).unwrap();
    assert!(e.fake.mounts_at(&t2).is_empty());
    assert!(!t2.exists());
    assert_eq!(e.attached(), vec![Attached { device: "/dev/loop0".into(), backing: img, read_only: false }]);
    assert_eq!(e.fake.mounts_at(&t1).len(), 1, "the read-write publication stays");
}

#[test]
fn publish_rolls_back_a_failed_bind() {
    let e = Env::new("publish-rollback");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();

    // A target the plugin creates is removed again.
    let t1 = e.target("pod1", "v1");
    e.fake.fail("bind_dir", Errno::EIO);
    let err = e.publish("v1", &t1, &staging, mount_cap("ext4", &[]), false).unwrap_err();
    assert_eq!(err.code, Code::Internal, "{err}");
    assert!(e.fake.mounts_at(&t1).is_empty());
    assert!(!t1.exists(), "the target the plugin made is gone");
    assert_eq!(e.publish_record(&t1), None);

    // A target kubelet made stays, as it was.
    let t2 = e.target("pod2", "v1");
    std::fs::create_dir(&t2).unwrap();
    e.fake.fail("bind_dir", Errno::EIO);
    e.publish("v1", &t2, &staging, mount_cap("ext4", &[]), false).unwrap_err();
    assert!(e.fake.mounts_at(&t2).is_empty());
    assert!(t2.is_dir(), "kubelet's target is left");
    assert_eq!(e.publish_record(&t2), None);

    // Retries succeed; the staging mount was never touched.
    e.publish("v1", &t1, &staging, mount_cap("ext4", &[]), false).unwrap();
    e.publish("v1", &t2, &staging, mount_cap("ext4", &[]), false).unwrap();
    assert_eq!((e.fake.mounts_at(&t1).len(), e.fake.mounts_at(&t2).len(), e.fake.mounts_at(&staging).len()), (1, 1, 1));
    assert!(!e.publish_record(&t2).unwrap().created_target);
}

#[test]
fn publish_block_rolls_back_a_failed_bind() {
    let e = Env::new("publish-block-rollback");
    let img = e.volume("b1", FsType::Raw);
    let staging = e.staging("b1");
    e.stage("b1", &staging, block_cap()).unwrap();
    let t = e.block_target("pod1", "b1");
    for read_only in [false, true] {
        e.fake.fail("bind_device", Errno::EPERM);
        e.publish("b1", &t, &staging, block_cap(), read_only).unwrap_err();
        assert!(e.fake.mounts_at(&t).is_empty());
        assert!(!t.exists(), "read_only {read_only}: the target file is gone");
        assert_eq!(e.publish_record(&t), None);
        // The read-only device made for it is released; the staged one stays.
        assert_eq!(
            e.attached(),
            vec![Attached { device: "/dev/loop0".into(), backing: img.clone(), read_only: false }]
        );
    }
    e.publish("b1", &t, &staging, block_cap(), true).unwrap();
    assert_eq!(e.fake.mounts_at(&t).len(), 1);
}

#[test]
fn publish_of_an_unstaged_volume_is_failed_precondition() {
    let e = Env::new("publish-unstaged");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    let t = e.target("pod1", "v1");
    let err = e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
    assert!(e.fake.mounts().is_empty());
    assert!(!t.exists());
    assert_eq!(e.publish_record(&t), None);
    assert_eq!(e.fake.count("bind_dir"), 0);

    // Staged, then unstaged: not staged any more.
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.unstage("v1", &staging).unwrap();
    let err = e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
    assert!(e.fake.mounts().is_empty());

    // No staging path at all.
    let err = e
        .svc
        .publish(&csi::NodePublishVolumeRequest {
            volume_id: "v1".into(),
            target_path: s(&t),
            volume_capability: Some(mount_cap("ext4", &[])),
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
}

// ----- NodeUnpublishVolume -----

#[test]
fn unpublish_is_idempotent_and_leaves_other_mounts_alone() {
    let e = Env::new("unpublish");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let t1 = e.target("pod1", "v1");
    let t2 = e.target("pod2", "v1");
    e.publish("v1", &t1, &staging, mount_cap("ext4", &[]), false).unwrap();
    e.publish("v1", &t2, &staging, mount_cap("ext4", &[]), false).unwrap();
    // Someone else's mount at a third target of the same pod layout.
    let t3 = e.target("pod3", "v1");
    std::fs::create_dir(&t3).unwrap();
    e.fake.add_mount(&t3, "tmpfs", "tmpfs", (0, 77));

    e.unpublish("v1", &t1).unwrap();
    assert!(e.fake.mounts_at(&t1).is_empty());
    assert!(!t1.exists(), "the target the plugin made is removed");
    assert_eq!(e.publish_record(&t1), None);
    assert_eq!(e.fake.mounts_at(&t2).len(), 1, "the other publication stays");
    assert_eq!(e.fake.mounts_at(&staging).len(), 1, "the staging mount stays");

    // Twice, and on targets never published: OK, and nothing is unmounted.
    let unmounts = e.fake.count("unmount");
    e.unpublish("v1", &t1).unwrap();
    e.unpublish("v1", &e.target("pod4", "v1")).unwrap();
    e.unpublish("v1", &t3).unwrap();
    assert_eq!(e.fake.count("unmount"), unmounts);
    assert_eq!(e.fake.mounts_at(&t3).len(), 1, "someone else's mount is never taken away");
    assert!(t3.is_dir());
    assert_eq!(e.fake.mounts_at(&t2).len(), 1);

    e.unpublish("v1", &t2).unwrap();
    assert!(e.fake.mounts_at(&t2).is_empty());
    assert_eq!(e.fake.mounts().len(), 2, "staging and the foreign mount: {:?}", e.fake.mounts());

    // An unknown volume with nothing there.
    let err = e.unpublish("ghost", &e.target("pod5", "ghost")).unwrap_err();
    assert_eq!(err.code, Code::NotFound);
}

#[test]
fn unpublish_unmount_failure_keeps_the_record() {
    let e = Env::new("unpublish-fail");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let t = e.target("pod1", "v1");
    e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap();
    e.fake.fail("unmount", Errno::EBUSY);
    assert_eq!(e.unpublish("v1", &t).unwrap_err().code, Code::Internal);
    assert_eq!(e.fake.mounts_at(&t).len(), 1);
    assert!(e.publish_record(&t).is_some(), "the record stays while the mount does");
    e.unpublish("v1", &t).unwrap();
    assert!(e.fake.mounts_at(&t).is_empty());
    assert_eq!(e.publish_record(&t), None);
}

// ----- NodeUnstageVolume -----

#[test]
fn unstage_refuses_while_published_then_detaches() {
    let e = Env::new("unstage");
    let img = e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let t = e.target("pod1", "v1");
    e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap();

    let err = e.unstage("v1", &staging).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
    assert!(err.msg.contains(&s(&t)), "{err}");
    e.assert_staged_fs("v1", &staging, &img, "ext4");
    assert_eq!(e.fake.count("unmount"), 0);

    e.unpublish("v1", &t).unwrap();
    e.unstage("v1", &staging).unwrap();
    assert!(e.fake.mounts().is_empty());
    assert_eq!(e.attached(), vec![]);
    assert_eq!(e.stage_record("v1"), None);

    // Again: nothing to do.
    let calls = e.fake.count("loop_detach");
    e.unstage("v1", &staging).unwrap();
    assert_eq!(e.fake.count("loop_detach"), calls);
    assert_eq!(e.attached(), vec![]);
}

#[test]
fn records_follow_stage_and_publish() {
    let e = Env::new("records");
    let dir = e.svc.settings.record_dir.clone();
    for id in ["v1", "v2"] {
        e.volume(id, FsType::Ext4);
        let staging = e.staging(id);
        e.stage(id, &staging, mount_cap("ext4", &[])).unwrap();
        let t = e.target("pod1", id);
        e.publish(id, &t, &staging, mount_cap("ext4", &[]), false).unwrap();
        assert_eq!(e.stage_record(id).map(|r| r.state), Some(StageState::Staged));
        assert_eq!(e.publish_record(&t).map(|r| r.volume_id), Some(id.to_string()));
        e.unpublish(id, &t).unwrap();
        e.unstage(id, &staging).unwrap();
        assert_eq!((e.stage_record(id), e.publish_record(&t)), (None, None));
    }
    // An unreadable record is still no record.
    std::fs::write(dir.join("stage/v9.json"), b"{").unwrap();
    assert_eq!(e.stage_record("v9"), None);
}

#[test]
fn unstage_block_detaches() {
    let e = Env::new("unstage-block");
    e.volume("b1", FsType::Raw);
    let staging = e.staging("b1");
    e.stage("b1", &staging, block_cap()).unwrap();
    let t = e.block_target("pod1", "b1");
    e.publish("b1", &t, &staging, block_cap(), false).unwrap();
    assert_eq!(e.unstage("b1", &staging).unwrap_err().code, Code::FailedPrecondition);
    assert_eq!(e.attached().len(), 1);
    e.unpublish("b1", &t).unwrap();
    e.unstage("b1", &staging).unwrap();
    e.unstage("b1", &staging).unwrap();
    assert_eq!(e.attached(), vec![]);
    assert_eq!(e.stage_record("b1"), None);
}

#[test]
fn unstage_unknown_volume_is_not_found() {
    let e = Env::new("unstage-unknown");
    let err = e.unstage("ghost", &e.staging("ghost")).unwrap_err();
    assert_eq!(err.code, Code::NotFound, "{err}");
    assert!(e.fake.mounts().is_empty());
}

#[test]
fn unstage_with_the_device_busy_is_failed_precondition() {
    let e = Env::new("unstage-busy");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.fake.fail("loop_detach", Errno::EBUSY);
    let err = e.unstage("v1", &staging).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
    assert!(e.fake.mounts_at(&staging).is_empty(), "unmounted all the same");
    assert_eq!(e.attached().len(), 1, "still attached");
    assert!(e.stage_record("v1").is_some(), "the record stays, so a retry finds the device");
    e.unstage("v1", &staging).unwrap();
    assert_eq!(e.attached(), vec![]);
    assert_eq!(e.stage_record("v1"), None);
}

#[test]
fn unstage_with_the_filesystem_mounted_elsewhere_is_failed_precondition() {
    // The volume's filesystem mounted where no record says (by hand): that counts as a
    // publication, so unstage refuses, and leaves the volume staged as it was (the mount
    // table, read before anything is unmounted, names the other mount).
    let e = Env::new("unstage-mounted-elsewhere");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let dev = e.attached()[0].device.clone();
    let elsewhere = e.kubelet().join("by-hand");
    std::fs::create_dir(&elsewhere).unwrap();
    e.fake.mount_device(&dev, e.kubelet(), &elsewhere, "ext4", &MountOptions::default()).unwrap();
    let err = e.unstage("v1", &staging).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition, "{err}");
    assert_eq!(e.fake.mounts_at(&elsewhere).len(), 1);
    assert_eq!(e.fake.mounts_at(&staging).len(), 1);
    assert_eq!(e.attached().len(), 1);
    assert!(e.stage_record("v1").is_some());
}

// ----- the per-volume guard -----

#[test]
fn a_held_volume_answers_aborted() {
    let e = Env::new("aborted");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.volume("v3", FsType::Ext4);
    let staging3 = e.staging("v3");
    e.stage("v3", &staging3, mount_cap("ext4", &[])).unwrap();
    e.fake.clear_calls();
    {
        let _g = e.svc.guard("v1").unwrap();
        let _g3 = e.svc.guard("v3").unwrap();
        assert_eq!(e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap_err().code, Code::Aborted);
        assert_eq!(e.unstage("v1", &staging).unwrap_err().code, Code::Aborted);
        assert_eq!(e.expand("v3", &s(&staging3)).unwrap_err().code, Code::Aborted);
        // Where the records put nothing, the answer needs no hold: NOT_FOUND.
        assert_eq!(e.expand("v1", &s(&staging)).unwrap_err().code, Code::NotFound);
        assert_eq!(e.svc.guard("v1").err().map(|e| e.code), Some(Code::Aborted));
        // Another volume is not held.
        drop(e.svc.guard("v2").unwrap());
        assert_eq!(e.fake.calls(), Vec::<String>::new(), "nothing reached the kernel");
        assert_eq!(e.stage_record("v1"), None);
    }
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
}

#[test]
fn a_publish_waits_for_a_held_volume_then_answers_aborted() {
    let e = Env::new("aborted-publish");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let t = e.target("pod1", "v1");
    let g = e.svc.guard("v1").unwrap();
    let start = Instant::now();
    assert_eq!(e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap_err().code, Code::Aborted);
    assert!(start.elapsed() >= TARGET_WAIT);
    assert!(e.fake.mounts_at(&t).is_empty());
    assert_eq!(e.publish_record(&t), None);
    drop(g);
    e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap();
}

// ----- request validation -----

#[test]
fn bad_paths_and_fields_are_invalid_before_any_kernel_call() {
    let e = Env::new("invalid");
    e.volume("v1", FsType::Ext4);
    let k = s(e.kubelet());
    let staging = e.staging("v1");
    let t = e.target("pod1", "v1");
    e.fake.clear_calls();
    let bad_paths = [
        "relative/path".to_string(),
        format!("{k}/pods/../../etc"),
        format!("{k}/./pods/x"),
        "/etc/x".to_string(),
        k.clone(),
        format!("{k}-sibling/x"),
    ];
    for p in &bad_paths {
        let p = Path::new(p);
        assert_eq!(e.stage("v1", p, mount_cap("ext4", &[])).unwrap_err().code, Code::InvalidArgument, "stage {p:?}");
        assert_eq!(e.unstage("v1", p).unwrap_err().code, Code::InvalidArgument, "unstage {p:?}");
        assert_eq!(
            e.publish("v1", p, &staging, mount_cap("ext4", &[]), false).unwrap_err().code,
            Code::InvalidArgument,
            "publish target {p:?}"
        );
        assert_eq!(
            e.publish("v1", &t, p, mount_cap("ext4", &[]), false).unwrap_err().code,
            Code::InvalidArgument,
            "publish staging {p:?}"
        );
        assert_eq!(e.unpublish("v1", p).unwrap_err().code, Code::InvalidArgument, "unpublish {p:?}");
    }
    let empty = Path::new("");
    assert_eq!(e.stage("v1", empty, mount_cap("ext4", &[])).unwrap_err().code, Code::InvalidArgument);
    assert_eq!(e.unstage("v1", empty).unwrap_err().code, Code::InvalidArgument);
    assert_eq!(
        e.publish("v1", empty, &staging, mount_cap("ext4", &[]), false).unwrap_err().code,
        Code::InvalidArgument
    );
    assert_eq!(e.unpublish("v1", empty).unwrap_err().code, Code::InvalidArgument);
    assert_eq!(e.stage("", &staging, mount_cap("ext4", &[])).unwrap_err().code, Code::InvalidArgument);
    assert_eq!(e.unstage("", &staging).unwrap_err().code, Code::InvalidArgument);
    assert_eq!(e.unpublish("", &t).unwrap_err().code, Code::InvalidArgument);
    // No capability; a target inside the staging path.
    let no_cap =
        csi::NodeStageVolumeRequest { volume_id: "v1".into(), staging_target_path: s(&staging), ..Default::default() };
    assert_eq!(e.svc.stage(&no_cap).unwrap_err().code, Code::InvalidArgument);
    let inside = staging.join("x");
    assert_eq!(
        e.publish("v1", &inside, &staging, mount_cap("ext4", &[]), false).unwrap_err().code,
        Code::InvalidArgument
    );
    // A symlink on the way is refused, not followed.
    std::os::unix::fs::symlink("/etc", e.kubelet().join("pods/evil")).unwrap();
    let evil = e.kubelet().join("pods/evil/x");
    assert_eq!(e.stage("v1", &evil, mount_cap("ext4", &[])).unwrap_err().code, Code::InvalidArgument);

    assert_eq!(e.fake.calls(), Vec::<String>::new(), "nothing reached the kernel");
    assert!(e.fake.mounts().is_empty());
    assert_eq!(e.stage_record("v1"), None);
}

// ----- error precedence (the spec's NOT_FOUND before argument checks) -----

impl Env {
    fn stats(&self, id: &str, path: &str) -> Result<csi::NodeGetVolumeStatsResponse> {
        self.svc.stats(&csi::NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        })
    }

    fn expand(&self, id: &str, path: &str) -> Result<csi::NodeExpandVolumeResponse> {
        self.svc.expand(&csi::NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: (96 * MIB) as i64, limit_bytes: 0 }),
            ..Default::default()
        })
    }

    /// The code of each of the six Node RPCs for volume `id` with `path` in every path
    /// field (and a good capability and staging path elsewhere).
    fn codes(&self, id: &str, path: &str, good_staging: &Path) -> Vec<(&'static str, Code)> {
        let p = Path::new(path);
        let code = |r: std::result::Result<(), CsiError>| r.err().map_or(Code::Ok, |e| e.code);
        vec![
            ("stage", code(self.stage(id, p, mount_cap("ext4", &[])))),
            ("unstage", code(self.unstage(id, p))),
            ("publish", code(self.publish(id, p, good_staging, mount_cap("ext4", &[]), false))),
            ("unpublish", code(self.unpublish(id, p))),
            ("stats", code(self.stats(id, path).map(drop))),
            ("expand", code(self.expand(id, path).map(drop))),
        ]
    }
}

fn all(code: Code) -> Vec<(&'static str, Code)> {
    ["stage", "unstage", "publish", "unpublish", "stats", "expand"].into_iter().map(|m| (m, code)).collect()
}

#[test]
fn unknown_volume_with_a_relative_path_is_not_found_for_every_rpc() {
    let e = Env::new("prec-unknown-rel");
    let staging = e.staging("ghost");
    e.fake.clear_calls();
    assert_eq!(e.codes("ghost", "relative/path", &staging), all(Code::NotFound));
    assert_eq!(e.fake.calls(), Vec::<String>::new(), "nothing reached the kernel");
    assert!(!e.kubelet().join("relative").exists() && !Path::new("relative").exists());
}

#[test]
fn unknown_volume_with_a_path_outside_or_with_dotdot_is_not_found_for_every_rpc() {
    let e = Env::new("prec-unknown-out");
    let k = s(e.kubelet());
    let staging = e.staging("ghost");
    e.fake.clear_calls();
    for p in ["/etc/x".to_string(), format!("{k}/pods/../../etc"), k.clone(), format!("{k}-sibling/x")] {
        assert_eq!(e.codes("ghost", &p, &staging), all(Code::NotFound), "{p}");
    }
    // Other arguments are not looked at either (a bad capability, a bad staging path), but a
    // required field that is missing is INVALID_ARGUMENT first.
    let no_cap = csi::NodeStageVolumeRequest {
        volume_id: "ghost".into(),
        staging_target_path: "x".into(),
        ..Default::default()
    };
    assert_eq!(e.svc.stage(&no_cap).unwrap_err().code, Code::InvalidArgument);
    let t = e.target("pod1", "ghost");
    assert_eq!(
        e.publish("ghost", &t, Path::new("rel"), mount_cap("vfat", &[]), false).unwrap_err().code,
        Code::NotFound
    );
    assert_eq!(e.fake.calls(), Vec::<String>::new(), "nothing reached the kernel");
    assert!(e.fake.mounts().is_empty());
}

#[test]
fn malformed_volume_id_is_not_found_and_an_empty_one_invalid() {
    let e = Env::new("prec-ids");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    let t = e.target("pod1", "v1");
    e.fake.clear_calls();
    let long = "a".repeat(300);
    for id in ["UPPER", "a/b", "..", ".", "../../etc", long.as_str()] {
        assert_eq!(e.codes(id, &s(&t), &staging), all(Code::NotFound), "{id:?}");
    }
    assert_eq!(e.codes("", &s(&t), &staging), all(Code::InvalidArgument), "empty volume_id");
    assert_eq!(e.codes("", "relative", &staging), all(Code::InvalidArgument), "empty volume_id, relative path");
    assert_eq!(e.fake.calls(), Vec::<String>::new(), "nothing reached the kernel");
}

#[test]
fn missing_path_is_invalid_even_for_an_unknown_volume() {
    let e = Env::new("prec-empty-path");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.fake.clear_calls();
    assert_eq!(e.codes("ghost", "", &staging), all(Code::InvalidArgument));
    assert_eq!(e.codes("v1", "", &staging), all(Code::InvalidArgument));
    assert_eq!(e.codes("UPPER", "", &staging), all(Code::InvalidArgument), "a missing field before an impossible id");
    assert_eq!(e.fake.calls(), Vec::<String>::new());
}

#[test]
fn known_volume_with_a_bad_path_is_invalid_for_stage_publish_and_teardown() {
    let e = Env::new("prec-known-bad");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.fake.clear_calls();
    for p in ["relative/path", "/etc/x"] {
        let got: Vec<_> =
            e.codes("v1", p, &staging).into_iter().filter(|(m, _)| !matches!(*m, "stats" | "expand")).collect();
        let want: Vec<_> =
            all(Code::InvalidArgument).into_iter().filter(|(m, _)| !matches!(*m, "stats" | "expand")).collect();
        assert_eq!(got, want, "{p}");
    }
    assert_eq!(e.fake.calls(), Vec::<String>::new());
}

#[test]
fn known_volume_at_a_relative_path_is_not_found_for_stats_and_expand() {
    let e = Env::new("prec-known-rel");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    let t = e.target("pod1", "v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap();
    e.fake.clear_calls();
    let rel = s(&t).trim_start_matches('/').to_string();
    for p in [rel.as_str(), "relative/path", "mount"] {
        assert_eq!(e.stats("v1", p).unwrap_err().code, Code::NotFound, "stats {p}");
        assert_eq!(e.expand("v1", p).unwrap_err().code, Code::NotFound, "expand {p}");
    }
    assert_eq!(e.fake.calls(), Vec::<String>::new(), "decided from the records, no kernel call");
}

#[test]
fn known_volume_where_it_is_not_published_is_not_found_for_stats_and_expand() {
    let e = Env::new("prec-known-elsewhere");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    let t = e.target("pod1", "v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap();
    let k = s(e.kubelet());
    // Another volume's target, an existing directory nothing is mounted at, a symlink that
    // leads out, `..`, outside: none of them is looked at.
    std::os::unix::fs::symlink("/etc", e.kubelet().join("pods/evil")).unwrap();
    let other = e.target("pod2", "v1");
    e.fake.clear_calls();
    for p in [s(&other), format!("{k}/pods"), format!("{k}/pods/evil/x"), format!("{k}/pods/../../etc"), "/etc".into()]
    {
        assert_eq!(e.stats("v1", &p).unwrap_err().code, Code::NotFound, "stats {p}");
        assert_eq!(e.expand("v1", &p).unwrap_err().code, Code::NotFound, "expand {p}");
    }
    assert_eq!(e.fake.calls(), Vec::<String>::new(), "decided from the records, no kernel call");
    assert!(!other.exists(), "the unpublished target was not created");
    // The recorded paths still answer.
    assert!(e.stats("v1", &s(&t)).is_ok());
    assert!(e.stats("v1", &s(&staging)).is_ok());
}

#[test]
fn unknown_volume_with_a_record_left_is_still_torn_down() {
    // A volume whose metadata is gone while it was published: the records make it known to
    // the teardown, which still unmounts and detaches.
    let e = Env::new("prec-recorded");
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    let t = e.target("pod1", "v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap();
    assert!(e.svc.recorded("v1").unwrap());
    // Another volume's records do not make a ghost known.
    assert_eq!(e.unpublish("ghost", &t).unwrap_err().code, Code::NotFound);
    assert_eq!(e.fake.mounts_at(&t).len(), 1, "the other volume's mount stays");
}

// ----- cost per call -----

#[test]
fn the_node_path_reads_the_mount_table_only_at_unstage_and_walks_no_loop_device() {
    // Stage, publish, unpublish and unstage decide from the volume's own paths (statx of
    // each) and its own loop devices: the mount table is read once per unstage (a mount no
    // record names). Nothing walks every loop device.
    let e = Env::new("flat");
    for i in 0..5 {
        let id = format!("other{i}");
        e.volume(&id, FsType::Ext4);
        e.stage(&id, &e.staging(&id), mount_cap("ext4", &[])).unwrap();
    }
    e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    let t = e.target("pod1", "v1");
    let counts = |e: &Env| (e.fake.count("mount_table"), e.fake.count("loop_bound_devices"));
    e.fake.clear_calls();
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    e.publish("v1", &t, &staging, mount_cap("ext4", &[]), false).unwrap();
    e.unpublish("v1", &t).unwrap();
    assert_eq!(counts(&e), (0, 0), "stage, publish, unpublish: {:?}", e.fake.calls());
    e.unstage("v1", &staging).unwrap();
    assert_eq!(counts(&e), (1, 0), "unstage: {:?}", e.fake.calls());
    assert!(e.fake.mounts_at(&staging).is_empty());
}

// ----- start-up -----

#[test]
fn recover_rolls_back_an_interrupted_stage() {
    let e = Env::new("recover");
    e.volume("v1", FsType::Ext4);
    e.volume("v2", FsType::Ext4);
    e.volume("v3", FsType::Ext4);
    // v1: crashed after its record and attach, before the mount.
    let s1 = e.staging("v1");
    e.svc.store.attach("v1").unwrap();
    let rec = |id: &str, path: &Path, state| StageRecord {
        encrypted: false,
        volume_id: id.into(),
        staging_path: path.to_path_buf(),
        capability: parse_capability(Some(&mount_cap("ext4", &[]))).unwrap(),
        state,
    };
    e.svc.save(&e.svc.stage_record_path("v1"), &rec("v1", &s1, StageState::Staging)).unwrap();
    // v2: crashed after the mount, before the record said staged: kept.
    let s2 = e.staging("v2");
    e.stage("v2", &s2, mount_cap("ext4", &[])).unwrap();
    e.svc.save(&e.svc.stage_record_path("v2"), &rec("v2", &s2, StageState::Staging)).unwrap();
    // v3: attached with no record at all: detached.
    e.svc.store.attach("v3").unwrap();
    assert_eq!(e.attached().len(), 3);
    assert!(!e.svc.ready());

    let report = e.svc.recover().unwrap();
    assert_eq!((report.rolled_back_stages, report.staged, report.detached), (1, 1, 1), "{report:?}");
    assert!(e.svc.ready());
    assert_eq!(e.stage_record("v1"), None);
    assert!(e.stage_record("v2").is_some());
    let left: Vec<PathBuf> = e.attached().into_iter().map(|a| a.backing).collect();
    assert_eq!(left, vec![e.svc.store.image_path("v2").unwrap()]);
    assert_eq!(e.fake.mounts_at(&s2).len(), 1);

    // The retried stage of v1 then succeeds from scratch.
    e.stage("v1", &s1, mount_cap("ext4", &[])).unwrap();
    assert_eq!(e.fake.mounts_at(&s1).len(), 1);
}

#[test]
fn recover_keeps_the_record_when_the_detach_fails() {
    let e = Env::new("recover-busy");
    e.volume("v1", FsType::Ext4);
    let s1 = e.staging("v1");
    e.svc.store.attach("v1").unwrap();
    let r = StageRecord {
        encrypted: false,
        volume_id: "v1".into(),
        staging_path: s1.clone(),
        capability: parse_capability(Some(&mount_cap("ext4", &[]))).unwrap(),
        state: StageState::Staging,
    };
    e.svc.save(&e.svc.stage_record_path("v1"), &r).unwrap();
    e.fake.fail("loop_detach", Errno::EBUSY);
    let report = e.svc.recover().unwrap();
    assert_eq!(report.rolled_back_stages, 0);
    assert_eq!(e.stage_record("v1"), Some(r));
    assert_eq!(e.attached().len(), 1);
    // Unstage finds it through the record and detaches.
    e.unstage("v1", &s1).unwrap();
    assert_eq!(e.attached(), vec![]);
}

// ----- stats and expansion through the fake -----

#[test]
fn stats_and_expand_of_a_staged_volume() {
    let e = Env::new("stats-expand");
    let img = e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    let st = e
        .svc
        .stats(&csi::NodeGetVolumeStatsRequest {
            volume_id: "v1".into(),
            volume_path: s(&staging),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(st.usage[0].total, (64 * MIB) as i64);
    assert!(!st.volume_condition.unwrap().abnormal);

    let r = e
        .svc
        .expand(&csi::NodeExpandVolumeRequest {
            volume_id: "v1".into(),
            volume_path: s(&staging),
            capacity_range: Some(csi::CapacityRange { required_bytes: (96 * MIB) as i64, limit_bytes: 0 }),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(r.capacity_bytes, (96 * MIB) as i64);
    assert_eq!(e.fake.device_size(Path::new("/dev/loop0")).unwrap(), 96 * MIB, "loop device grown online");
    assert_eq!(e.fake.filesystem_of(&img), Some(("ext4".into(), 96 * MIB)), "filesystem grown online");
}

// ----- doctor -----

#[test]
fn doctor_repairs_what_no_record_accounts_for_and_leaves_the_rest() {
    use crate::obs::doctor::Repair;
    let e = Env::new("doctor");
    // A healthy volume: staged and published.
    e.volume("ok", FsType::Ext4);
    let s_ok = e.staging("ok");
    e.stage("ok", &s_ok, mount_cap("ext4", &[])).unwrap();
    let t = e.target("pod1", "ok");
    e.publish("ok", &t, &s_ok, mount_cap("ext4", &[]), false).unwrap();
    // A leaked one: attached and mounted where no record says.
    e.volume("leak", FsType::Ext4);
    let dev = e.svc.store.attach("leak").unwrap();
    e.fake.mkfs(&dev, FsType::Ext4).unwrap();
    let stray = e.kubelet().join("stray");
    std::fs::create_dir(&stray).unwrap();
    e.fake.mount_device(&dev, e.kubelet(), &stray, "ext4", &MountOptions::default()).unwrap();

    let (found, skipped) = e.svc.doctor(false).unwrap();
    assert!(skipped.is_empty(), "{skipped:?}");
    let kinds: Vec<(&str, String)> = found.iter().map(|f| (f.kind, f.subject.clone())).collect();
    assert_eq!(kinds, vec![(MOUNT_WITHOUT_VOLUME, s(&stray))], "{found:#?}");
    assert!(found[0].repair.is_none());
    assert_eq!(e.fake.mounts_at(&stray).len(), 1, "a report changes nothing");

    let (found, _) = e.svc.doctor(true).unwrap();
    let kinds: Vec<&str> = found.iter().map(|f| f.kind).collect();
    assert_eq!(kinds, vec![MOUNT_WITHOUT_VOLUME, LOOP_WITHOUT_USER], "{found:#?}");
    assert!(found.iter().all(|f| matches!(f.repair, Some(Repair::Done(_)))), "{found:#?}");
    assert!(e.fake.mounts_at(&stray).is_empty());
    let left: Vec<PathBuf> = e.attached().into_iter().map(|a| a.backing).collect();
    assert_eq!(left, vec![e.svc.store.image_path("ok").unwrap()], "only the healthy volume's device stays");
    assert_eq!((e.fake.mounts_at(&s_ok).len(), e.fake.mounts_at(&t).len()), (1, 1));
    assert_eq!(e.svc.doctor(true).unwrap().0.len(), 0);
}

#[test]
fn staging_and_target_directories_are_made_and_removed() {
    let e = Env::new("dirs");
    e.volume("v", FsType::Ext4);
    // kubelet makes the staging path's parent (it holds vol_data.json there).
    let staging = e.staging("v");
    std::fs::create_dir_all(staging.parent().unwrap()).unwrap();
    e.stage("v", &staging, mount_cap("ext4", &[])).unwrap();
    assert!(staging.is_dir());
    let target = e.target("p", "v");
    e.publish("v", &target, &staging, mount_cap("ext4", &[]), false).unwrap();
    assert!(target.is_dir());
    assert!(e.publish_record(&target).unwrap().created_target);
    assert!(e.fake.mounts().iter().any(|mt| mt.mount_point == target));
    // Removed when unpublished: a directory the plugin made is the plugin's to remove.
    e.unpublish("v", &target).unwrap();
    assert!(!target.exists());
    // Without a parent (a staging path kubelet did not prepare), made with its parents.
    e.volume("w", FsType::Ext4);
    let staging = e.staging("w");
    e.stage("w", &staging, mount_cap("ext4", &[])).unwrap();
    assert!(staging.is_dir());
    // A publish target that exists is never replaced.
    let t2 = e.target("p2", "w");
    std::fs::create_dir(&t2).unwrap();
    let before = std::fs::metadata(&t2).unwrap().ino();
    e.publish("w", &t2, &staging, mount_cap("ext4", &[]), false).unwrap();
    assert_eq!(std::fs::metadata(&t2).unwrap().ino(), before);
    assert!(!e.publish_record(&t2).unwrap().created_target);
}

fn encrypted_stage(e: &Env, id: &str, staging: &Path, encryption: &str, key: Option<&str>) -> Result<()> {
    let mut req = csi::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: s(staging),
        volume_capability: Some(mount_cap("ext4", &[])),
        ..Default::default()
    };
    req.volume_context.insert("encryption".into(), encryption.into());
    if let Some(k) = key {
        req.secrets.insert("key".into(), k.into());
    }
    e.svc.stage(&req)
}

#[test]
fn encrypted_stage_needs_a_key_and_rolls_back_when_it_cannot_unlock() {
    let e = Env::new("encrypted");
    let img = e.volume("v1", FsType::Ext4);
    let staging = e.staging("v1");
    for key in [None, Some("")] {
        let err = encrypted_stage(&e, "v1", &staging, "luks2", key).unwrap_err();
        assert_eq!(err.code, Code::InvalidArgument, "{err}");
        assert!(err.msg.contains("node-stage secret has no \"key\""), "{err}");
    }
    let err = encrypted_stage(&e, "v1", &staging, "luks1", Some("k")).unwrap_err();
    assert_eq!(err.code, Code::InvalidArgument, "{err}");
    assert!(e.fake.attached().is_empty() && e.stage_record("v1").is_none(), "argument errors touch nothing");
    // The fake kernel has no dm-crypt: the unlock fails after the attach, and the stage is
    // rolled back (the real kernel's paths run in tests/crypt_root.rs).
    let err = encrypted_stage(&e, "v1", &staging, "luks2", Some("k")).unwrap_err();
    assert_eq!(err.code, Code::Internal, "{err}");
    assert!(!err.msg.contains("\"k\""), "{err}");
    e.assert_rolled_back("v1", &staging, "encrypted stage without dm-crypt");
    assert_eq!(e.fake.filesystem_of(&img), None, "nothing was formatted");
    // An unencrypted stage is unaffected, and its record says so.
    e.stage("v1", &staging, mount_cap("ext4", &[])).unwrap();
    assert!(!e.stage_record("v1").unwrap().encrypted);
}
