//! Root-only, device-mapper: the volume store's `lvm` backend against a real LVM thin pool
//! (a volume group on a loop device over a sparse file), real filesystems and mounts; and
//! the agent's CSI node plugin staging and publishing a thin volume.
//!
//! The VM lane runs these (scripts/vm-test: Debian's kernels have dm-thin); this host's
//! kernel has no device-mapper, and scripts/test says so instead of running them. Without
//! device-mapper they FAIL, never skip.
//!
//! Each test makes its own volume group `npt<pid><n>` and removes it (with the loop device
//! and the file) when it ends, also on panic.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::mount::{MntFlags, MsFlags};
use nodeplane::storage::fs as vfs;
use nodeplane::storage::store::{Backend, FsType, Orphan, Source, ThinPoolConfig, VolumeError, VolumeStore};

const MIB: u64 = 1 << 20;

/// Run an LVM (or other) tool, as the store does without udev; its stdout.
fn run(tool: &str, args: &[&str]) -> String {
    let mut cmd = Command::new(tool);
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1");
    }
    let out = cmd.env("LVM_SUPPRESS_FD_WARNINGS", "1").args(args).output().unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(out.status.success(), "{tool} {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn try_run(tool: &str, args: &[&str]) -> bool {
    let mut cmd = Command::new(tool);
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1");
    }
    cmd.env("LVM_SUPPRESS_FD_WARNINGS", "1").args(args).output().is_ok_and(|o| o.status.success())
}

/// A volume group on a loop device with one thin pool, and a sandbox directory for the
/// store and mount points. Dropped: everything unmounted, the VG, loop device and file gone.
/// Shared with tests/crypt_root.rs (an encrypted thin volume).
pub(crate) struct Pool {
    pub(crate) vg: String,
    dir: PathBuf,
    loop_dev: String,
}

impl Pool {
    pub(crate) fn new(name: &str, pool_mib: u64) -> Pool {
        assert_eq!(nix::unistd::geteuid().as_raw(), 0, "tests/lvm_root.rs needs root; it does not skip");
        assert!(
            try_run("modprobe", &["dm_thin_pool"]),
            "no dm-thin (device-mapper) in this kernel: run these tests in the VM lane (scripts/vm-test)"
        );
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let vg = format!("npt{}x{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("lvm-root-{vg}-{name}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let img = dir.join("pv.img");
        fs::File::create(&img).unwrap().set_len((pool_mib + 64) * MIB).unwrap();
        let loop_dev = run("losetup", &["-f", "--show", img.to_str().unwrap()]).trim().to_string();
        let p = Pool { vg: vg.clone(), dir, loop_dev: loop_dev.clone() };
        run("pvcreate", &["-q", "-y", &loop_dev]);
        run("vgcreate", &["-q", &vg, &loop_dev]);
        run("lvcreate", &["-q", "-y", "-T", &format!("{vg}/pool"), "-L", &format!("{pool_mib}m")]);
        p
    }
    pub(crate) fn config(&self, ratio: f64) -> ThinPoolConfig {
        ThinPoolConfig { volume_group: self.vg.clone(), thin_pool: "pool".into(), overprovision_ratio: ratio }
    }
    fn store(&self, ratio: f64) -> VolumeStore {
        VolumeStore::open(&self.dir.join("store"), 1 << 30).unwrap().with_thin_pool(self.config(ratio)).unwrap()
    }
    fn mount_point(&self, name: &str) -> PathBuf {
        let p = self.dir.join("mnt").join(name);
        fs::create_dir_all(&p).unwrap();
        p
    }
    /// Names of the VG's LVs (hidden ones left out).
    pub(crate) fn lvs(&self) -> Vec<String> {
        run("lvs", &["--noheadings", "-o", "lv_name", &self.vg])
            .lines()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty() && !l.starts_with('['))
            .collect()
    }
    fn lv_size(&self, lv: &str) -> u64 {
        let out =
            run("lvs", &["--noheadings", "--units", "b", "--nosuffix", "-o", "lv_size", &format!("{}/{lv}", self.vg)]);
        out.trim().parse().unwrap()
    }
    /// The LVs of volumes and snapshots (`np-…`, `nps-…`, also half-made or half-deleted).
    pub(crate) fn volume_lvs(&self) -> Vec<String> {
        self.lvs().into_iter().filter(|l| l.starts_with("np")).collect()
    }
    /// Our LVs that are open (mounted, mapped or held by a process): `lv_attr`'s sixth
    /// character.
    pub(crate) fn open_lvs(&self) -> Vec<String> {
        run("lvs", &["--noheadings", "-o", "lv_name,lv_attr", &self.vg])
            .lines()
            .filter_map(|l| l.split_whitespace().collect::<Vec<_>>().try_into().ok())
            .filter(|[name, attr]: &[&str; 2]| name.starts_with("np") && attr.chars().nth(5) == Some('o'))
            .map(|[name, _]| name.to_string())
            .collect()
    }
    /// Loop devices bound over one of the VG's LVs (read-only publications), by sysfs.
    pub(crate) fn loops_over_lvs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir("/sys/block").unwrap().flatten() {
            let Ok(back) = fs::read_to_string(e.path().join("loop/backing_file")) else { continue };
            if self.is_our_lv(Path::new(back.trim().trim_end_matches(" (deleted)"))) {
                out.push(PathBuf::from("/dev").join(e.file_name()));
            }
        }
        out
    }
    /// Whether `dev` (as a loop device's backing file names it: `/dev/<vg>/…`,
    /// `/dev/mapper/<vg>-…` or `/dev/dm-N`) is one of the VG's LVs.
    pub(crate) fn is_our_lv(&self, dev: &Path) -> bool {
        let ours = |n: &str| n.starts_with(&format!("{}-", self.vg));
        let Some(node) = dev.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        else {
            return false;
        };
        // Without udev, /dev/mapper/<vg>-<lv> is the node itself.
        ours(&node) || fs::read_to_string(format!("/sys/block/{node}/dm/name")).is_ok_and(|n| ours(n.trim()))
    }
    /// Device-mapper mappings stacked over one of the VG's LVs (dm-crypt), by name; not
    /// LVM's own (the pool over its data and metadata, thin LVs over the pool).
    pub(crate) fn mappings_over_lvs(&self) -> Vec<String> {
        let dm_name = |p: &Path| fs::read_to_string(p.join("dm/name")).map(|n| n.trim().to_string());
        let mut out = Vec::new();
        for e in fs::read_dir("/sys/block").unwrap().flatten() {
            let Ok(name) = dm_name(&e.path()) else { continue };
            if name.starts_with(&format!("{}-", self.vg)) {
                continue;
            }
            let over_ours = fs::read_dir(e.path().join("slaves")).is_ok_and(|d| {
                d.flatten().any(|s| {
                    dm_name(&Path::new("/sys/block").join(s.file_name()))
                        .is_ok_and(|n| n.starts_with(&format!("{}-", self.vg)))
                })
            });
            if over_ours {
                out.push(name);
            }
        }
        out
    }
    fn data_percent(&self) -> f64 {
        run("lvs", &["--noheadings", "-o", "data_percent", &format!("{}/pool", self.vg)]).trim().parse().unwrap()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let mnt = self.dir.join("mnt");
        if let Ok(entries) = fs::read_dir(&mnt) {
            for e in entries.flatten() {
                let _ = nix::mount::umount2(&e.path(), MntFlags::MNT_DETACH);
            }
        }
        // Read-only loop devices a test bound over an LV go before the VG. Only those: the
        // PV's own loop device (its file's path names the VG too) must stay bound until
        // vgremove and pvremove have wiped its label, or the next test handed the same
        // loop device can find a stale one.
        for line in run("losetup", &["-l", "-n", "-O", "NAME,BACK-FILE"]).lines() {
            let mut f = line.split_whitespace();
            if let (Some(dev), Some(back)) = (f.next(), f.next())
                && back.starts_with("/dev/")
                && back.contains(&self.vg)
            {
                let _ = try_run("losetup", &["-d", dev]);
            }
        }
        // dm-crypt mappings a test left over the VG's LVs go first, or the LVs stay open.
        for e in fs::read_dir("/sys/block").unwrap().flatten() {
            let dm_name = |p: &Path| fs::read_to_string(p.join("dm/name")).map(|n| n.trim().to_string());
            let Ok(name) = dm_name(&e.path()) else { continue };
            let over_ours = fs::read_dir(e.path().join("slaves")).is_ok_and(|d| {
                d.flatten().any(|s| {
                    dm_name(&Path::new("/sys/block").join(s.file_name()))
                        .is_ok_and(|n| n.starts_with(&format!("{}-", self.vg)))
                })
            });
            if over_ours {
                let _ = try_run("cryptsetup", &["close", &name]);
            }
        }
        let _ = try_run("vgremove", &["-q", "-y", "-f", &self.vg]);
        let _ = try_run("pvremove", &["-q", "-y", &self.loop_dev]);
        let _ = try_run("losetup", &["-d", &self.loop_dev]);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn mount(dev: &Path, at: &Path, fs_type: &str) {
    let data = if fs_type == "xfs" { Some("nouuid") } else { None };
    nix::mount::mount(Some(dev), at, Some(fs_type), MsFlags::empty(), data)
        .unwrap_or_else(|e| panic!("mounting {} at {}: {e}", dev.display(), at.display()));
}

fn write_file(p: &Path, data: &[u8]) {
    let mut f = fs::File::create(p).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn thin_volumes_snapshots_clones_and_online_expansion() {
    // xfs needs 300 MiB at least; virtual sizes add up to more than the pool (ratio 2).
    let pool = Pool::new("life", 1024);
    let store = pool.store(2.0);
    let v = store.create_on(Backend::Lvm, "pvc-a", 320 * MIB, FsType::Xfs, "claim-a").unwrap();
    assert_eq!(v.backend, Backend::Lvm);
    assert!(pool.lvs().contains(&"np-pvc-a".to_string()), "{:?}", pool.lvs());
    assert_eq!(pool.lv_size("np-pvc-a"), 320 * MIB);
    // Idempotent; another backend for the same id is another volume.
    assert_eq!(store.create_on(Backend::Lvm, "pvc-a", 320 * MIB, FsType::Xfs, "claim-a").unwrap(), v);
    assert!(matches!(
        store.create_on(Backend::File, "pvc-a", 320 * MIB, FsType::Xfs, "claim-a"),
        Err(VolumeError::AlreadyExists { .. })
    ));

    let dev = store.attach("pvc-a").unwrap();
    assert_eq!(dev, Path::new("/dev").join(&pool.vg).join("np-pvc-a"));
    assert_eq!(store.attached_device("pvc-a").unwrap().as_deref(), Some(dev.as_path()));
    vfs::mkfs(&dev, FsType::Xfs).unwrap();
    let m = pool.mount_point("a");
    mount(&dev, &m, "xfs");
    write_file(&m.join("marker"), b"before the snapshot");

    // A snapshot of the mounted volume: thin, nothing copied, consistent without our freeze.
    let data_before = pool.data_percent();
    let s = store.create_snapshot("snap-1", "pvc-a", "snap-claim").unwrap();
    assert_eq!((s.method.as_str(), s.bytes_copied, s.backend), ("thin-snapshot", 0, Backend::Lvm));
    assert!(pool.lvs().contains(&"nps-snap-1".to_string()));
    assert!(pool.data_percent() - data_before < 1.0, "a thin snapshot allocates no data");
    write_file(&m.join("marker"), b"after the snapshot!");
    // Deleting a mounted volume is refused and loses nothing.
    assert!(matches!(store.delete("pvc-a"), Err(VolumeError::Busy { .. })));
    assert!(pool.lvs().contains(&"np-pvc-a".to_string()));

    // Online expansion: the LV grows, then the mounted xfs.
    let fs_size = |p: &Path| {
        let st = nix::sys::statvfs::statvfs(p).unwrap();
        st.blocks() * st.fragment_size()
    };
    let before = fs_size(&m);
    let grown = store.expand("pvc-a", 384 * MIB).unwrap();
    assert_eq!(grown.size_bytes, 384 * MIB);
    assert_eq!(pool.lv_size("np-pvc-a"), 384 * MIB);
    vfs::grow_fs(&m, FsType::Xfs).unwrap();
    assert!(fs_size(&m) >= before + 60 * MIB, "xfs grew online: {before} -> {}", fs_size(&m));

    // A restore from the snapshot, bigger than its source: the data as it was.
    let r = store.create_from("pvc-r", 352 * MIB, "claim-r", &Source::Snapshot("snap-1".into())).unwrap();
    assert_eq!((r.backend, r.size_bytes, r.fs_type), (Backend::Lvm, 352 * MIB, FsType::Xfs));
    assert_eq!(pool.lv_size("np-pvc-r"), 352 * MIB);
    let rdev = store.attach("pvc-r").unwrap();
    let rm = pool.mount_point("r");
    mount(&rdev, &rm, "xfs");
    assert_eq!(fs::read(rm.join("marker")).unwrap(), b"before the snapshot");
    // A clone of the mounted volume: its data now.
    let c = store.create_from("pvc-c", 384 * MIB, "claim-c", &Source::Volume("pvc-a".into())).unwrap();
    let cm = pool.mount_point("c");
    mount(&store.attach(&c.id).unwrap(), &cm, "xfs");
    assert_eq!(fs::read(cm.join("marker")).unwrap(), b"after the snapshot!");
    // Writes to a clone stay in the clone.
    write_file(&cm.join("marker"), b"the clone's own");
    assert_eq!(fs::read(m.join("marker")).unwrap(), b"after the snapshot!");

    // A read-only device for a read-only publication: a loop device over the LV.
    let ro = store.attach_read_only("pvc-a").unwrap();
    let b = store.bindings("pvc-a").unwrap();
    assert_eq!(b.len(), 2, "{b:?}");
    assert!(b.iter().any(|b| b.read_only && b.device == ro));
    store.detach_read_only("pvc-a").unwrap();
    assert_eq!(store.bindings("pvc-a").unwrap().len(), 1);

    // Deletes: after unmounting, the LVs and metadata go; the snapshot outlives its source.
    for (at, id) in [(&m, "pvc-a"), (&rm, "pvc-r"), (&cm, "pvc-c")] {
        crate::umount(at);
        store.delete(id).unwrap();
        store.delete(id).unwrap();
        assert!(!pool.lvs().contains(&format!("np-{id}")));
        assert!(!pool.dir.join("store").join(format!("{id}.json")).exists());
    }
    assert!(store.get_snapshot("snap-1").unwrap().is_some());
    store.delete_snapshot("snap-1").unwrap();
    assert!(!pool.lvs().iter().any(|l| l.starts_with("np")), "{:?}", pool.lvs());
    assert!(store.orphans().unwrap().is_empty());
}

#[test]
fn raw_block_and_ext4_volumes_keep_their_bytes_across_a_reopen() {
    let pool = Pool::new("reopen", 256);
    let dir = pool.dir.join("store");
    {
        let store = pool.store(1.0);
        let raw = store.create_on(Backend::Lvm, "raw", 16 * MIB, FsType::Raw, "").unwrap();
        let dev = store.attach(&raw.id).unwrap();
        let f = fs::OpenOptions::new().write(true).open(&dev).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"raw bytes", MIB).unwrap();
        f.sync_all().unwrap();
        let e = store.create_on(Backend::Lvm, "e4", 32 * MIB, FsType::Ext4, "").unwrap();
        vfs::mkfs(&store.attach(&e.id).unwrap(), FsType::Ext4).unwrap();
    }
    // Deactivated behind the store's back (a reboot): opening activates them again.
    run("lvchange", &["-q", "-an", &format!("{}/np-raw", pool.vg)]);
    let store = VolumeStore::open(&dir, 1 << 30).unwrap().with_thin_pool(pool.config(1.0)).unwrap();
    let dev = store.attached_device("raw").unwrap().expect("active again");
    let mut buf = [0u8; 9];
    std::os::unix::fs::FileExt::read_exact_at(&fs::File::open(&dev).unwrap(), &mut buf, MIB).unwrap();
    assert_eq!(&buf, b"raw bytes");
    let e4 = store.attach("e4").unwrap();
    assert_eq!(vfs::probe_type(&e4, None).unwrap().as_deref(), Some("ext4"));
    // Without a pool configured, lvm volumes are there but cannot be made anew.
    drop(store);
    let plain = VolumeStore::open(&dir, 1 << 30).unwrap();
    assert_eq!(plain.get("raw").unwrap().unwrap().backend, Backend::Lvm);
    assert!(matches!(plain.create_on(Backend::Lvm, "x", MIB, FsType::Raw, ""), Err(VolumeError::Backend { .. })));
}

#[test]
fn interrupted_creates_deletes_expansions_and_snapshots_are_finished_or_rolled_back() {
    let pool = Pool::new("crash", 256);
    let dir = pool.dir.join("store");
    let vg = pool.vg.clone();
    let lv = |n: &str| format!("{vg}/{n}");
    {
        let store = pool.store(1.0);
        store.create_on(Backend::Lvm, "kept", 16 * MIB, FsType::Raw, "").unwrap();
        store.create_on(Backend::Lvm, "going", 16 * MIB, FsType::Raw, "").unwrap();
        store.create_on(Backend::Lvm, "growing", 16 * MIB, FsType::Raw, "").unwrap();
        store.create_on(Backend::Lvm, "made", 16 * MIB, FsType::Raw, "").unwrap();
        store.create_on(Backend::Lvm, "reborn", 16 * MIB, FsType::Raw, "").unwrap();
        store.create_on(Backend::Lvm, "garbled", 16 * MIB, FsType::Raw, "").unwrap();
        store.create_snapshot("snap", "kept", "").unwrap();
        store.create_snapshot("snap-new", "kept", "").unwrap();
    }
    // A create killed after lvcreate, before its metadata: rolled back.
    run("lvcreate", &["-q", "-y", "-T", &lv("pool"), "-V", "16m", "-n", "np-half+new"]);
    // A create killed after its metadata, before the rename: finished.
    run("lvrename", &["-q", &vg, "np-made", "np-made+new"]);
    // A delete killed after the rename: finished (metadata and LV gone).
    run("lvrename", &["-q", &vg, "np-going", "np-going+del"]);
    // An expansion killed after its metadata: the LV grows at open.
    let meta = dir.join("growing.json");
    let mut m: serde_json::Value = serde_json::from_slice(&fs::read(&meta).unwrap()).unwrap();
    m["sizeBytes"] = (32 * MIB).into();
    fs::write(&meta, serde_json::to_vec(&m).unwrap()).unwrap();
    // A snapshot killed before its metadata (removed); one killed before its rename (kept).
    run("lvcreate", &["-q", "-y", "-s", "-ky", &lv("np-kept"), "-n", "nps-half+new"]);
    run("lvrename", &["-q", &vg, "nps-snap-new", "nps-snap-new+new"]);
    // A removal that failed before the id was made again: the `+del` goes, the volume stays.
    run("lvcreate", &["-q", "-y", "-T", &lv("pool"), "-V", "8m", "-n", "np-reborn+del"]);
    // Metadata that cannot be read: its LV is reported, and repair leaves it.
    fs::write(dir.join("garbled.json"), b"{not json").unwrap();
    // Not ours: an LV named otherwise, and an orphan named like ours.
    run("lvcreate", &["-q", "-y", "-T", &lv("pool"), "-V", "8m", "-n", "someone-else"]);
    run("lvcreate", &["-q", "-y", "-T", &lv("pool"), "-V", "8m", "-n", "np-orphan"]);

    let store = VolumeStore::open(&dir, 1 << 30).unwrap().with_thin_pool(pool.config(1.0)).unwrap();
    let mut lvs = pool.lvs();
    lvs.sort();
    assert_eq!(
        lvs,
        [
            "np-garbled",
            "np-growing",
            "np-kept",
            "np-made",
            "np-orphan",
            "np-reborn",
            "nps-snap",
            "nps-snap-new",
            "pool",
            "someone-else"
        ],
    );
    assert!(store.get("going").unwrap().is_none() && !dir.join("going.json").exists());
    assert!(store.get("reborn").unwrap().is_some() && dir.join("reborn.json").exists());
    assert!(store.get("half").unwrap().is_none());
    assert_eq!(pool.lv_size("np-growing"), 32 * MIB);
    assert!(store.attached_device("made").unwrap().is_some());
    assert!(store.get_snapshot("snap-new").unwrap().is_some());
    // The orphan is reported, never removed by opening; removed only when asked.
    let orphan = |name: &str| Orphan::LogicalVolume { name: name.into() };
    assert_eq!(store.orphans().unwrap(), [orphan("np-garbled"), orphan("np-orphan")]);
    assert!(store.remove_orphan_lv("someone-else").is_err(), "only a reported orphan is removed");
    assert!(store.remove_orphan_lv("np-kept").is_err());
    let e = store.remove_orphan_lv("np-garbled").unwrap_err().to_string();
    assert!(e.contains("garbled.json") && e.contains("unreadable"), "{e}");
    store.remove_orphan_lv("np-orphan").unwrap();
    assert_eq!(store.orphans().unwrap(), [orphan("np-garbled")]);
    assert!(pool.lvs().contains(&"np-garbled".to_string()));
    assert!(pool.lvs().contains(&"someone-else".to_string()));
}

#[test]
fn capacity_follows_the_pool_and_its_overprovisioning() {
    let pool = Pool::new("capacity", 64);
    let store = pool.store(2.0);
    let u = store.pool_usage().unwrap().unwrap();
    assert_eq!(u.size_bytes, 64 * MIB);
    assert_eq!((u.capacity_bytes, u.available_bytes, u.short), (128 * MIB, 128 * MIB, false));
    assert_eq!(store.capacity_of(Backend::Lvm).unwrap(), Some((128 * MIB, 128 * MIB)));
    // Virtual sizes beyond the pool's data size, up to the ratio.
    store.create_on(Backend::Lvm, "big", 100 * MIB, FsType::Raw, "").unwrap();
    let e = store.create_on(Backend::Lvm, "more", 40 * MIB, FsType::Raw, "").unwrap_err();
    assert!(matches!(e, VolumeError::CapacityExceeded { available, .. } if available == 28 * MIB), "{e}");
    assert!(store.get("more").unwrap().is_none() && !pool.lvs().contains(&"np-more+new".to_string()));
    // File volumes keep their own capacity.
    assert_eq!(store.capacity_of(Backend::File).unwrap(), Some((1 << 30, 1 << 30)));
    // Writing real data fills the pool: past the short mark nothing new is offered, and
    // the volume written keeps working.
    let dev = store.attach("big").unwrap();
    let f = fs::OpenOptions::new().write(true).open(&dev).unwrap();
    let chunk = vec![0x5au8; MIB as usize];
    for i in 0..60 {
        std::os::unix::fs::FileExt::write_all_at(&f, &chunk, i * MIB).unwrap();
    }
    f.sync_all().unwrap();
    let u = store.pool_usage().unwrap().unwrap();
    assert!(u.short && u.data_percent >= 90.0, "{u:?}");
    assert_eq!(u.available_bytes, 0);
    assert!(matches!(
        store.create_on(Backend::Lvm, "small", MIB, FsType::Raw, ""),
        Err(VolumeError::CapacityExceeded { .. })
    ));
    assert_eq!(store.last_pool_usage().unwrap().available_bytes, 0);
    drop(f);
    store.delete("big").unwrap();
    let u = store.pool_usage().unwrap().unwrap();
    assert!(!u.short && u.available_bytes == 128 * MIB, "{u:?}");
}

// ----- crashes: a child process killed at each crash point, then the store reopened -----

/// What the crash child does (run by [`crash_in_child`]; ignored when run directly).
#[test]
#[ignore = "run by crash_in_child with NP_LVM_CHILD set"]
fn crash_child() {
    let Ok(spec) = std::env::var("NP_LVM_CHILD") else { return };
    let [op, vg, dir]: [&str; 3] = spec.splitn(3, ':').collect::<Vec<_>>().try_into().unwrap();
    let cfg = ThinPoolConfig { volume_group: vg.into(), thin_pool: "pool".into(), overprovision_ratio: 4.0 };
    let store = VolumeStore::open(Path::new(dir), 1 << 30).unwrap().with_thin_pool(cfg).unwrap();
    match op {
        "create" => drop(store.create_on(Backend::Lvm, "new", 16 * MIB, FsType::Raw, "").unwrap()),
        "snapshot" => drop(store.create_snapshot("snap", "base", "").unwrap()),
        "clone" => drop(store.create_from("clone", 32 * MIB, "", &Source::Volume("base".into())).unwrap()),
        "expand" => drop(store.expand("base", 48 * MIB).unwrap()),
        "delete" => store.delete("base").unwrap(),
        "leftovers" => leftovers(store, vg, Path::new(dir)),
        other => panic!("unknown op {other}"),
    }
}

/// Run `op` in a child process that aborts at `point`; assert it did.
fn crash_in_child(pool: &Pool, op: &str, point: &str) {
    let dir = pool.dir.join("store");
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "lvm_root::crash_child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("NP_LVM_CHILD", format!("{op}:{}:{}", pool.vg, dir.display()))
        .env("NODEPLANE_CRASH_AT", point)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains(&format!("crashing at {point}")), "{op} at {point}: {stderr}");
}

#[test]
fn crash_points_in_create_snapshot_clone_expand_and_delete() {
    let pool = Pool::new("crashpoints", 512);
    let dir = pool.dir.join("store");
    let reopen = || VolumeStore::open(&dir, 1 << 30).unwrap().with_thin_pool(pool.config(4.0)).unwrap();
    {
        let store = reopen();
        let base = store.create_on(Backend::Lvm, "base", 32 * MIB, FsType::Raw, "").unwrap();
        let f = fs::OpenOptions::new().write(true).open(store.attach(&base.id).unwrap()).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"base data", 0).unwrap();
        f.sync_all().unwrap();
    }
    let ours = |pool: &Pool| -> Vec<String> {
        let mut v: Vec<String> = pool.lvs().into_iter().filter(|l| l.starts_with("np")).collect();
        v.sort();
        v
    };
    // Before the metadata: rolled back, as if never asked.
    crash_in_child(&pool, "create", "lvm-create-after-lvcreate");
    assert!(reopen().get("new").unwrap().is_none());
    crash_in_child(&pool, "snapshot", "lvm-snapshot-after-lvcreate");
    assert!(reopen().get_snapshot("snap").unwrap().is_none());
    crash_in_child(&pool, "clone", "lvm-clone-after-lvcreate");
    assert!(reopen().get("clone").unwrap().is_none());
    assert_eq!(ours(&pool), ["np-base"]);
    // After the metadata: finished.
    crash_in_child(&pool, "create", "lvm-create-after-meta");
    assert_eq!(reopen().get("new").unwrap().unwrap().size_bytes, 16 * MIB);
    crash_in_child(&pool, "snapshot", "lvm-snapshot-after-meta");
    assert!(reopen().get_snapshot("snap").unwrap().is_some());
    crash_in_child(&pool, "clone", "lvm-create-after-meta");
    {
        let store = reopen();
        let mut buf = [0u8; 9];
        let dev = store.attach("clone").unwrap();
        std::os::unix::fs::FileExt::read_exact_at(&fs::File::open(dev).unwrap(), &mut buf, 0).unwrap();
        assert_eq!(&buf, b"base data", "the clone holds its source's data");
    }
    crash_in_child(&pool, "expand", "lvm-expand-after-meta");
    assert_eq!(reopen().get("base").unwrap().unwrap().size_bytes, 48 * MIB);
    assert_eq!(pool.lv_size("np-base"), 48 * MIB);
    crash_in_child(&pool, "delete", "lvm-delete-after-meta");
    assert!(reopen().get("base").unwrap().is_none());
    assert_eq!(ours(&pool), ["np-clone", "np-new", "nps-snap"]);
    assert!(reopen().orphans().unwrap().is_empty());
}

// ----- a failed lvremove: the LV kept, reported, removed later -----

/// `lvremove`, `lvrename` and `lvchange` wrappers in `tools` that fail as LVM does for an
/// LV in use while `tools/fail-<tool>` exists, and run the real tool otherwise.
fn failing_tools(tools: &Path) {
    fs::create_dir_all(tools).unwrap();
    for tool in ["lvremove", "lvrename", "lvchange"] {
        let real = run("sh", &["-c", &format!("command -v {tool}")]).trim().to_string();
        let marker = tools.join(format!("fail-{tool}"));
        let script = format!(
            "#!/bin/sh\nif [ -e {m} ]; then echo '  Logical volume contains a filesystem in use.' >&2; exit 5; fi\nexec {real} \"$@\"\n",
            m = marker.display()
        );
        let path = tools.join(tool);
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
}

/// What the child of the test below does, its LVM tools those of [`failing_tools`].
fn leftovers(store: VolumeStore, vg: &str, dir: &Path) {
    let tools = dir.parent().unwrap().join("tools");
    let fail = |tool: &str| fs::write(tools.join(format!("fail-{tool}")), "").unwrap();
    let heal = |tool: &str| fs::remove_file(tools.join(format!("fail-{tool}"))).unwrap();
    let lv = |name: &str| Orphan::LogicalVolume { name: name.into() };
    store.create_on(Backend::Lvm, "gone", 16 * MIB, FsType::Raw, "").unwrap();
    store.create_snapshot("snap", "gone", "").unwrap();
    fail("lvremove");
    // The deletes succeed; the LVs they could not remove are reported.
    store.delete_snapshot("snap").unwrap();
    store.delete("gone").unwrap();
    assert!(store.get("gone").unwrap().is_none() && store.get_snapshot("snap").unwrap().is_none());
    assert_eq!(store.orphans().unwrap(), [lv("np-gone+del"), lv("nps-snap+del")]);
    // A create whose rename and rollback both fail leaves its `+new` LV, reported too.
    fail("lvrename");
    assert!(store.create_on(Backend::Lvm, "again", 16 * MIB, FsType::Raw, "").is_err());
    assert!(store.get("again").unwrap().is_none());
    assert_eq!(store.orphans().unwrap(), [lv("np-again+new"), lv("np-gone+del"), lv("nps-snap+del")]);
    // Still failing: kept.
    store.remove_leftover_lvs();
    assert_eq!(store.orphans().unwrap().len(), 3);
    heal("lvremove");
    heal("lvrename");
    // The create's retry removes its own leftover first; the sweep takes the rest.
    store.create_on(Backend::Lvm, "again", 16 * MIB, FsType::Raw, "").unwrap();
    assert_eq!(store.orphans().unwrap(), [lv("np-gone+del"), lv("nps-snap+del")]);
    store.remove_leftover_lvs();
    assert!(store.orphans().unwrap().is_empty());

    // A volume whose LV cannot be activated at start fails alone; the store opens, and the
    // volume attaches once the LV can be activated again.
    store.create_on(Backend::Lvm, "stuck", 16 * MIB, FsType::Raw, "").unwrap();
    drop(store);
    run("lvchange", &["-q", "-an", &format!("{vg}/np-stuck")]);
    fail("lvchange");
    let cfg = ThinPoolConfig { volume_group: vg.into(), thin_pool: "pool".into(), overprovision_ratio: 4.0 };
    let reopened = VolumeStore::open(dir, 1 << 30).unwrap().with_thin_pool(cfg).unwrap();
    assert!(reopened.attach("stuck").is_err());
    heal("lvchange");
    assert!(reopened.attach("stuck").unwrap().exists());
    reopened.delete("stuck").unwrap();
}

#[test]
fn an_lv_whose_removal_fails_is_kept_reported_and_removed_later() {
    let pool = Pool::new("leftovers", 256);
    let tools = pool.dir.join("tools");
    failing_tools(&tools);
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "lvm_root::crash_child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("NP_LVM_CHILD", format!("leftovers:{}:{}", pool.vg, pool.dir.join("store").display()))
        .env("PATH", format!("{}:{}", tools.display(), std::env::var("PATH").unwrap()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(pool.volume_lvs(), ["np-again"]);
}

// ----- the agent: CSI stage and publish of thin volumes, and its crash points -----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_stages_publishes_expands_and_recovers_thin_volumes() {
    use crate::csi_root::{Sandbox, assert_code, cap_for, mounted_at};
    let pool = Pool::new("agent", 1024);
    let lvm = serde_json::json!({"volumeGroup": pool.vg, "thinPool": "pool", "overprovisionRatio": 2});
    let mut sb = Sandbox::with_csi("lvm", serde_json::json!({"capacityBytes": 1u64 << 30, "lvm": lvm}));
    let mut c = sb.start().await;
    let id = "pvc-thin";
    let v = c.create_on(id, 320 * MIB, "xfs", "lvm").await;
    assert_eq!(v.backend, "lvm");
    assert!(pool.lvs().contains(&format!("np-{id}")));
    let staging = sb.staging(id, false);
    let (t1, t2) = (sb.target(id, "pod-a", false), sb.target(id, "pod-b", false));
    c.stage(id, &staging, cap_for("xfs")).await.unwrap();
    assert_eq!(mounted_at(Path::new(&staging)).expect("staged").0, "xfs");
    c.publish(id, &staging, &t1, cap_for("xfs"), false).await.unwrap();
    c.publish(id, &staging, &t2, cap_for("xfs"), true).await.unwrap();
    write_file(&Path::new(&t1).join("data"), b"thin and mounted");
    assert_eq!(fs::read(Path::new(&t2).join("data")).unwrap(), b"thin and mounted");
    assert_code(c.delete(id).await, tonic::Code::FailedPrecondition, "delete while staged");
    // Online expansion through the CO's calls: the node API grows the LV, NodeExpand the xfs.
    let fs_size = || {
        let st = nix::sys::statvfs::statvfs(Path::new(&t1)).unwrap();
        st.blocks() * st.fragment_size()
    };
    let before = fs_size();
    c.vols
        .expand_volume(nodeplane::rpc::node::ExpandVolumeRequest { id: id.into(), size_bytes: 400 * MIB })
        .await
        .unwrap();
    c.expand(id, &t1, 400 * MIB, 0).await.unwrap();
    assert!(fs_size() >= before + 76 * MIB, "xfs grew online: {before} -> {}", fs_size());
    let stats = c.stats(id, &t1).await.unwrap();
    assert!(stats.volume_condition.as_ref().is_none_or(|c| !c.abnormal), "{stats:?}");
    // The agent killed and restarted: the volume stays staged and published.
    sb.kill9();
    let mut c = sb.start().await;
    assert_eq!(fs::read(Path::new(&t1).join("data")).unwrap(), b"thin and mounted");
    for t in [&t1, &t2] {
        c.unpublish(id, t).await.unwrap();
    }
    c.unstage(id, &staging).await.unwrap();
    assert!(mounted_at(Path::new(&staging)).is_none());
    c.delete(id).await.unwrap();
    assert!(!pool.lvs().iter().any(|l| l.starts_with("np-")), "{:?}", pool.lvs());

    // A stage killed right after mkfs: the retry finds the filesystem and mounts it.
    c.create_on("pvc-crash", 16 * MIB, "ext4", "lvm").await;
    let staging = sb.staging("pvc-crash", false);
    sb.stop().await;
    sb.crash_at = Some("stage-after-mkfs".into());
    let mut c = sb.start().await;
    let _ = c.stage("pvc-crash", &staging, cap_for("ext4")).await;
    sb.wait_crashed(std::time::Duration::from_secs(30));
    sb.crash_at = None;
    let mut c = sb.start().await;
    c.stage("pvc-crash", &staging, cap_for("ext4")).await.unwrap();
    assert_eq!(mounted_at(Path::new(&staging)).expect("staged").0, "ext4");
    c.unstage("pvc-crash", &staging).await.unwrap();
    // A create killed between lvcreate and its metadata: rolled back at the next start.
    sb.stop().await;
    sb.crash_at = Some("lvm-create-after-lvcreate".into());
    let mut c2 = sb.start().await;
    let r = c2
        .vols
        .create_volume(nodeplane::rpc::node::CreateVolumeRequest {
            id: "pvc-half".into(),
            size_bytes: 16 * MIB,
            fs_type: "ext4".into(),
            backend: "lvm".into(),
        })
        .await;
    assert!(r.is_err());
    sb.wait_crashed(std::time::Duration::from_secs(30));
    sb.crash_at = None;
    let mut c = sb.start().await;
    assert!(!pool.lvs().iter().any(|l| l.contains("pvc-half")), "{:?}", pool.lvs());
    c.delete("pvc-crash").await.unwrap();
    sb.stop().await;
    sb.assert_clean();
}
