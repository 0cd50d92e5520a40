//! Unit tests without root: ids, sizes, capacity, metadata and crash recovery. No loop
//! device is ever attached here (the root tests in `tests/volume_root.rs` do that).

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::*;

const MIB: u64 = 1 << 20;

struct TempDir(PathBuf);

impl VolumeStore {
    /// Where the image of volume `id` lives (whether or not it exists).
    pub fn image_path(&self, id: &str) -> Result<PathBuf> {
        validate_id(id)?;
        Ok(self.dir.join(format!("{id}.img")))
    }
}

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "np-volume-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn ids() {
    for ok in ["a", "pvc-1234", "vol_1.2", "a.b-c_d", "...", ".hidden", &"x".repeat(128)] {
        validate_id(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
    }
    for bad in ["", ".", "..", "../etc", "a/b", "/abs", "UPPER", "sp ace", "nul\0", "ü", "a\\b", &"x".repeat(129)] {
        assert!(matches!(validate_id(bad), Err(VolumeError::InvalidId { .. })), "{bad:?} accepted");
    }
}

#[test]
fn every_method_rejects_traversal() {
    let t = TempDir::new("ids");
    let s = VolumeStore::open(t.path(), 100 * MIB).unwrap();
    for id in ["..", "../x", "a/b", ""] {
        assert!(matches!(s.create(id, MIB, FsType::Ext4), Err(VolumeError::InvalidId { .. })));
        assert!(matches!(s.delete(id), Err(VolumeError::InvalidId { .. })));
        assert!(matches!(s.expand(id, MIB), Err(VolumeError::InvalidId { .. })));
        assert!(matches!(s.attach(id), Err(VolumeError::InvalidId { .. })));
        assert!(matches!(s.detach(id), Err(VolumeError::InvalidId { .. })));
        assert!(matches!(s.get(id), Err(VolumeError::InvalidId { .. })));
        assert!(matches!(s.image_path(id), Err(VolumeError::InvalidId { .. })));
        assert!(matches!(s.attached_device(id), Err(VolumeError::InvalidId { .. })));
    }
}

#[test]
fn sizes_round_up_to_mib() {
    assert_eq!(round_size("v", 1).unwrap(), MIB);
    assert_eq!(round_size("v", MIB).unwrap(), MIB);
    assert_eq!(round_size("v", MIB + 1).unwrap(), 2 * MIB);
    assert_eq!(round_size("v", 300 * MIB - 7).unwrap(), 300 * MIB);
    assert!(matches!(round_size("v", 0), Err(VolumeError::InvalidSize { .. })));
    assert!(matches!(round_size("v", u64::MAX), Err(VolumeError::InvalidSize { .. })));
    assert!(matches!(round_size("v", i64::MAX as u64 + 1), Err(VolumeError::InvalidSize { .. })));
}

#[test]
fn fs_types() {
    assert_eq!("ext4".parse::<FsType>().unwrap(), FsType::Ext4);
    assert_eq!("xfs".parse::<FsType>().unwrap(), FsType::Xfs);
    assert_eq!("".parse::<FsType>().unwrap(), FsType::Raw);
    assert!(matches!("btrfs".parse::<FsType>().map_err(VolumeError::from), Err(VolumeError::InvalidFsType(_))));
    assert_eq!(serde_json::to_string(&FsType::Raw).unwrap(), "\"\"");
    assert_eq!(serde_json::to_string(&FsType::Xfs).unwrap(), "\"xfs\"");
}

#[test]
fn names_classify_by_suffix() {
    assert_eq!(classify("v1.json"), Entry::Meta("v1"));
    assert_eq!(classify("v1.img"), Entry::Image("v1"));
    assert_eq!(classify(".v1.json"), Entry::Meta(".v1"));
    assert_eq!(classify(".v1.img.tmp"), Entry::CreateTmp("v1"));
    assert_eq!(classify("..v1.img.tmp"), Entry::CreateTmp(".v1"));
    assert_eq!(classify(".v1.img.del"), Entry::DeleteTmp("v1"));
    assert_eq!(classify(".v1.json.tmp4242"), Entry::WriteTmp);
    assert_eq!(classify(".v1.json.tmp4242.7"), Entry::WriteTmp, "atomic_write's name: pid and sequence");
    assert_eq!(classify(".a.tmp5.json"), Entry::Meta(".a.tmp5"));
    assert_eq!(classify(".lock"), Entry::Lock);
    assert_eq!(classify("README"), Entry::Other);
}

#[test]
fn create_is_idempotent_and_sparse() {
    let t = TempDir::new("create");
    let s = VolumeStore::open(t.path(), 1024 * MIB).unwrap();
    let v = s.create("pvc-a", 100 * MIB + 1, FsType::Ext4).unwrap();
    assert_eq!(v.size_bytes, 101 * MIB);
    assert_eq!(v.fs_type, FsType::Ext4);
    assert_eq!(v.path, s.dir().join("pvc-a.img"));
    let m = fs::metadata(&v.path).unwrap();
    assert_eq!(m.len(), 101 * MIB);
    assert!(m.blocks() * 512 < MIB, "image is not sparse: {} blocks", m.blocks());
    assert_eq!(m.permissions().mode() & 0o777, 0o600);
    let t2 = TempDir::new("fresh");
    let fresh = t2.path().join("a/store");
    VolumeStore::open(&fresh, MIB).unwrap();
    assert_eq!(fs::metadata(&fresh).unwrap().permissions().mode() & 0o777, 0o700);

    // Same request (the same rounded size): the same volume, nothing new written.
    let again = s.create("pvc-a", 101 * MIB, FsType::Ext4).unwrap();
    assert_eq!(again, v);
    // Different size or fs: AlreadyExists.
    assert!(matches!(s.create("pvc-a", 102 * MIB, FsType::Ext4), Err(VolumeError::AlreadyExists { .. })));
    assert!(matches!(s.create("pvc-a", 101 * MIB, FsType::Xfs), Err(VolumeError::AlreadyExists { .. })));
    assert!(matches!(s.create("pvc-a", 101 * MIB, FsType::Raw), Err(VolumeError::AlreadyExists { .. })));
    assert_eq!(s.list().len(), 1);
    assert!(matches!(s.create("pvc-b", 0, FsType::Raw), Err(VolumeError::InvalidSize { .. })));
    // No temporaries left behind.
    let mut names: Vec<String> =
        fs::read_dir(s.dir()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, [".lock", "pvc-a.img", "pvc-a.json", "snapshots"]);
}

#[test]
fn capacity_is_accounted() {
    let t = TempDir::new("cap");
    let s = VolumeStore::open(t.path(), 300 * MIB).unwrap();
    assert_eq!(s.available(), 300 * MIB);
    s.create("a", 100 * MIB, FsType::Ext4).unwrap();
    s.create("b", 150 * MIB, FsType::Raw).unwrap();
    assert_eq!(s.available(), 50 * MIB);
    match s.create("c", 51 * MIB, FsType::Xfs) {
        Err(VolumeError::CapacityExceeded { requested, available, capacity, .. }) => {
            assert_eq!((requested, available, capacity), (51 * MIB, 50 * MIB, 300 * MIB));
        }
        other => panic!("expected CapacityExceeded, got {other:?}"),
    }
    assert!(!s.dir().join("c.img").exists() && !s.dir().join("c.json").exists());
    // Exactly full is fine.
    s.create("c", 50 * MIB, FsType::Xfs).unwrap();
    assert_eq!(s.available(), 0);
    // Expansion is capacity-checked too; delete gives it back.
    assert!(matches!(s.expand("a", 101 * MIB), Err(VolumeError::CapacityExceeded { .. })));
    s.delete("c").unwrap();
    assert_eq!(s.expand("a", 140 * MIB).unwrap().size_bytes, 140 * MIB);
    assert_eq!(fs::metadata(s.dir().join("a.img")).unwrap().len(), 140 * MIB);
    assert_eq!(s.available(), 10 * MIB);
    let u = s.usage();
    assert_eq!(u.capacity_bytes, 300 * MIB);
    assert_eq!(u.provisioned_bytes, 290 * MIB);
    assert_eq!(u.available_bytes, 10 * MIB);
    assert_eq!(u.volumes, 2);
    assert!(u.allocated_bytes < 2 * MIB, "{u:?}");
    assert!(u.backing_fs_free_bytes > 0);
}

#[test]
fn expand_rules() {
    let t = TempDir::new("expand");
    let s = VolumeStore::open(t.path(), 1024 * MIB).unwrap();
    s.create("v", 64 * MIB, FsType::Ext4).unwrap();
    assert!(matches!(s.expand("v", 63 * MIB), Err(VolumeError::Shrink { .. })));
    // Same size (after rounding): idempotent no-op.
    assert_eq!(s.expand("v", 64 * MIB - 5).unwrap().size_bytes, 64 * MIB);
    assert_eq!(s.expand("v", 65 * MIB - 5).unwrap().size_bytes, 65 * MIB);
    assert_eq!(s.get("v").unwrap().unwrap().size_bytes, 65 * MIB);
    assert!(matches!(s.expand("nope", 65 * MIB), Err(VolumeError::NotFound(_))));
    // Metadata on disk follows.
    let on_disk: Volume = serde_json::from_slice(&fs::read(s.dir().join("v.json")).unwrap()).unwrap();
    assert_eq!(on_disk.size_bytes, 65 * MIB);
}

#[test]
fn delete_is_idempotent() {
    let t = TempDir::new("delete");
    let s = VolumeStore::open(t.path(), 1024 * MIB).unwrap();
    let meta_inode = |s: &VolumeStore, id: &str| fs::metadata(s.dir().join(format!("{id}.json"))).unwrap().ino();
    s.create("v", 64 * MIB, FsType::Raw).unwrap();
    s.delete("v").unwrap();
    s.delete("v").unwrap();
    s.delete("never-existed").unwrap();
    assert!(s.get("v").unwrap().is_none());
    assert!(!s.dir().join("v.img").exists() && !s.dir().join("v.json").exists());
    assert_eq!(s.available(), 1024 * MIB);
    // A new volume's metadata holds its own content alone.
    s.create("w", MIB, FsType::Raw).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&fs::read(s.dir().join("w.json")).unwrap()).unwrap();
    assert_eq!(json["id"], "w");
    assert_eq!(fs::metadata(s.dir().join("w.json")).unwrap().permissions().mode() & 0o777, 0o600);
    // Expanding replaces it whole.
    let old = meta_inode(&s, "w");
    s.expand("w", 2 * MIB).unwrap();
    assert_ne!(meta_inode(&s, "w"), old, "replaced whole, not written in place");
    drop(s);
    let s = VolumeStore::open(t.path(), 1024 * MIB).unwrap();
    assert_eq!(s.get("w").unwrap().unwrap().size_bytes, 2 * MIB, "w survives");
    assert_eq!(s.list().len(), 1);
    s.delete("w").unwrap();
    assert_eq!(s.available(), 1024 * MIB);
    // Unknown volumes: attach is NotFound, detach is success.
    assert!(matches!(s.attach("v"), Err(VolumeError::NotFound(_))));
    s.detach("v").unwrap();
    assert_eq!(s.attached_device("v").unwrap(), None);
}

#[test]
fn metadata_round_trips_across_reopen() {
    let t = TempDir::new("reopen");
    let before = {
        let s = VolumeStore::open(t.path(), 1024 * MIB).unwrap();
        s.create("e", 10 * MIB, FsType::Ext4).unwrap();
        s.create("x", 300 * MIB, FsType::Xfs).unwrap();
        s.create("r", 1, FsType::Raw).unwrap();
        s.expand("e", 20 * MIB).unwrap();
        s.list()
    };
    let json: serde_json::Value = serde_json::from_slice(&fs::read(t.path().join("r.json")).unwrap()).unwrap();
    assert_eq!(json["id"], "r");
    assert_eq!(json["sizeBytes"], MIB);
    assert_eq!(json["fsType"], "");
    assert_eq!(json["version"], 1);
    assert!(json["createdAt"].as_u64().unwrap() > 1_600_000_000);
    let s = VolumeStore::open(t.path(), 1024 * MIB).unwrap();
    assert_eq!(s.list(), before);
    assert_eq!(s.list().iter().map(|v| v.id.as_str()).collect::<Vec<_>>(), ["e", "r", "x"]);
    assert_eq!(s.available(), 1024 * MIB - 321 * MIB);
    assert!(s.orphans().unwrap().is_empty());
}

#[test]
fn one_store_per_directory() {
    let t = TempDir::new("lock");
    let s = VolumeStore::open(t.path(), MIB).unwrap();
    assert!(matches!(VolumeStore::open(t.path(), MIB), Err(VolumeError::Locked { .. })));
    drop(s);
    VolumeStore::open(t.path(), MIB).unwrap();
}

#[test]
fn open_finishes_or_rolls_back_interrupted_work() {
    let t = TempDir::new("recover");
    let d = t.path();
    let meta = |id: &str, size: u64| {
        let v = Volume {
            version: 1,
            id: id.into(),
            size_bytes: size,
            fs_type: FsType::Ext4,
            created_at: 1,
            name: String::new(),
            backend: Default::default(),
            controller_store: String::new(),
            path: PathBuf::new(),
        };
        fs::write(d.join(format!("{id}.json")), serde_json::to_vec(&v).unwrap()).unwrap();
    };
    let sparse = |name: &str, size: u64| fs::File::create(d.join(name)).unwrap().set_len(size).unwrap();
    // Create interrupted before its metadata: rolled back.
    sparse(".c1.img.tmp", MIB);
    // Create interrupted after its metadata: finished.
    sparse(".c2.img.tmp", 2 * MIB);
    meta("c2", 2 * MIB);
    // Delete interrupted after the rename: finished.
    sparse(".d1.img.del", MIB);
    meta("d1", MIB);
    // Metadata write interrupted: removed.
    fs::write(d.join(".w.json.tmp999"), b"{").unwrap();
    // Expansion interrupted after the metadata: the image grows.
    sparse("g.img", MIB);
    meta("g", 4 * MIB);
    // Image without metadata, metadata without image: reported, left alone.
    sparse("lost.img", MIB);
    meta("gone", MIB);
    // Metadata that names another volume, unreadable metadata: ignored.
    meta("other", MIB);
    fs::rename(d.join("other.json"), d.join("liar.json")).unwrap();
    fs::write(d.join("bad.json"), b"not json").unwrap();

    let s = VolumeStore::open(d, 100 * MIB).unwrap();
    let ids: Vec<String> = s.list().into_iter().map(|v| v.id).collect();
    assert_eq!(ids, ["c2", "g", "gone"]);
    assert!(!d.join(".c1.img.tmp").exists());
    assert!(!d.join(".c2.img.tmp").exists());
    assert_eq!(fs::metadata(d.join("c2.img")).unwrap().len(), 2 * MIB);
    assert!(!d.join(".d1.img.del").exists() && !d.join("d1.json").exists());
    assert!(!d.join(".w.json.tmp999").exists());
    assert_eq!(fs::metadata(d.join("g.img")).unwrap().len(), 4 * MIB);
    let canon = d.canonicalize().unwrap();
    let mut orphans = s.orphans().unwrap();
    orphans.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(
        orphans,
        [
            Orphan::BackingFile { path: canon.join("lost.img") },
            Orphan::MissingBackingFile { id: "gone".into(), path: canon.join("gone.img") },
        ]
    );
    // An orphan image blocks a create of the same id (it may be someone's data)...
    assert!(matches!(s.create("lost", MIB, FsType::Ext4), Err(VolumeError::Busy { .. })));
    // ...until deleted explicitly.
    s.delete("lost").unwrap();
    s.create("lost", MIB, FsType::Ext4).unwrap();
    // A volume whose image is gone cannot be attached or grown, and can be deleted.
    assert!(matches!(s.attach("gone"), Err(VolumeError::BackingFileMissing { .. })));
    let avail = s.available();
    assert!(matches!(s.expand("gone", 2 * MIB), Err(VolumeError::BackingFileMissing { .. })));
    assert_eq!(s.available(), avail, "a failed expansion reserves nothing");
    assert_eq!(s.get("gone").unwrap().unwrap().size_bytes, MIB);
    s.delete("gone").unwrap();
    assert!(s.orphans().unwrap().is_empty());
}

#[test]
fn lowered_capacity_leaves_nothing_available() {
    let t = TempDir::new("lowered");
    {
        let s = VolumeStore::open(t.path(), 100 * MIB).unwrap();
        s.create("a", 80 * MIB, FsType::Ext4).unwrap();
    }
    let s = VolumeStore::open(t.path(), 50 * MIB).unwrap();
    assert_eq!(s.available(), 0);
    assert_eq!(s.usage().provisioned_bytes, 80 * MIB);
    assert!(matches!(s.create("b", MIB, FsType::Ext4), Err(VolumeError::CapacityExceeded { .. })));
    // Existing volumes stay usable and idempotent creates still answer.
    assert_eq!(s.create("a", 80 * MIB, FsType::Ext4).unwrap().size_bytes, 80 * MIB);
}

#[test]
fn concurrent_creates_respect_capacity() {
    let t = TempDir::new("race");
    let s = std::sync::Arc::new(VolumeStore::open(t.path(), 10 * MIB).unwrap());
    let results: Vec<bool> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..16)
            .map(|i| {
                let s = s.clone();
                sc.spawn(move || s.create(&format!("v{i}"), MIB, FsType::Raw).is_ok())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results.iter().filter(|ok| **ok).count(), 10);
    assert_eq!(s.available(), 0);
    assert_eq!(s.list().len(), 10);
}

#[test]
fn names_make_claims_distinct() {
    let t = TempDir::new("names");
    let s = VolumeStore::open(t.path(), 100 * MIB).unwrap();
    let v = s.create_named("pvc-a", MIB, FsType::Ext4, "claim-a").unwrap();
    assert_eq!(v.name, "claim-a");
    assert_eq!(s.create_named("pvc-a", MIB, FsType::Ext4, "claim-a").unwrap(), v);
    assert!(matches!(s.create_named("pvc-a", MIB, FsType::Ext4, "claim-b"), Err(VolumeError::AlreadyExists { .. })));
    assert!(matches!(s.create("pvc-a", MIB, FsType::Ext4), Err(VolumeError::AlreadyExists { .. })));
    drop(s);
    let s = VolumeStore::open(t.path(), 100 * MIB).unwrap();
    assert_eq!(s.get("pvc-a").unwrap().unwrap().name, "claim-a");
}

fn write_at(p: &Path, off: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    fs::OpenOptions::new().write(true).open(p).unwrap().write_all_at(data, off).unwrap();
}

fn read_at(p: &Path, off: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut b = vec![0u8; len];
    fs::File::open(p).unwrap().read_exact_at(&mut b, off).unwrap();
    b
}

#[test]
fn snapshots_are_point_in_time_copies_and_count_against_capacity() {
    let t = TempDir::new("snap");
    let s = VolumeStore::open(t.path(), 300 * MIB).unwrap();
    let v = s.create_named("pvc-a", 100 * MIB, FsType::Ext4, "claim-a").unwrap();
    write_at(&v.path, 5 * MIB, b"before");
    let snap = s.create_snapshot("snap-1", "pvc-a", "snapshot-1").unwrap();
    assert_eq!((snap.size_bytes, snap.fs_type, snap.source_volume.as_str()), (100 * MIB, FsType::Ext4, "pvc-a"));
    assert!(snap.method == "reflink" || snap.method == "sparse-copy", "{}", snap.method);
    if snap.method == "sparse-copy" {
        assert!(snap.bytes_copied < 2 * MIB, "only the data is copied: {}", snap.bytes_copied);
    }
    // The source changes afterwards; the snapshot does not.
    write_at(&v.path, 5 * MIB, b"after!");
    assert_eq!(read_at(&snap.path, 5 * MIB, 6), b"before");
    // Idempotent by id, source and name; another source or name is refused.
    assert_eq!(s.create_snapshot("snap-1", "pvc-a", "snapshot-1").unwrap(), snap);
    assert!(matches!(s.create_snapshot("snap-1", "pvc-a", "other"), Err(VolumeError::SnapshotExists { .. })));
    s.create_named("pvc-b", 10 * MIB, FsType::Xfs, "claim-b").unwrap();
    assert!(matches!(s.create_snapshot("snap-1", "pvc-b", "snapshot-1"), Err(VolumeError::SnapshotExists { .. })));
    assert!(matches!(s.create_snapshot("snap-2", "pvc-none", "x"), Err(VolumeError::NotFound(_))));
    // Capacity: 100 (a) + 10 (b) + 100 (snapshot) of 300.
    assert_eq!(s.available(), 90 * MIB);
    assert!(matches!(s.create_snapshot("snap-3", "pvc-a", "snapshot-3"), Err(VolumeError::CapacityExceeded { .. })));
    assert!(
        s.dir().join("snapshots").read_dir().unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with('.')),
        "no temporaries left"
    );
    // The snapshot outlives its volume, and restores into a bigger one.
    s.delete("pvc-a").unwrap();
    assert!(matches!(
        s.create_from("pvc-c", 50 * MIB, "claim-c", &Source::Snapshot("snap-1".into())),
        Err(VolumeError::Shrink { .. })
    ));
    let r = s.create_from("pvc-c", 150 * MIB, "claim-c", &Source::Snapshot("snap-1".into())).unwrap();
    assert_eq!((r.size_bytes, r.fs_type), (150 * MIB, FsType::Ext4));
    assert_eq!(fs::metadata(&r.path).unwrap().len(), 150 * MIB);
    assert_eq!(read_at(&r.path, 5 * MIB, 6), b"before");
    assert_eq!(
        s.create_from("pvc-c", 150 * MIB, "claim-c", &Source::Snapshot("snap-1".into())).unwrap(),
        r,
        "idempotent"
    );
    // A clone of a volume.
    write_at(&r.path, 7 * MIB, b"clone me");
    let c = s.create_from("pvc-d", 10 * MIB, "claim-d", &Source::Volume("pvc-b".into())).unwrap();
    assert_eq!(c.fs_type, FsType::Xfs);
    assert!(matches!(
        s.create_from("pvc-e", 200 * MIB, "claim-e", &Source::Volume("pvc-c".into())),
        Err(VolumeError::CapacityExceeded { .. })
    ));
    assert!(matches!(
        s.create_from("pvc-e", 10 * MIB, "e", &Source::Snapshot("nope".into())),
        Err(VolumeError::NotFound(_))
    ));
    // Everything survives a reopen.
    drop(s);
    let s = VolumeStore::open(t.path(), 300 * MIB).unwrap();
    assert_eq!(s.list_snapshots().len(), 1);
    assert_eq!(s.get_snapshot("snap-1").unwrap().unwrap().name, "snapshot-1");
    s.delete_snapshot("snap-1").unwrap();
    s.delete_snapshot("snap-1").unwrap();
    assert!(s.get_snapshot("snap-1").unwrap().is_none());
    assert!(!t.path().join("snapshots/snap-1.img").exists() && !t.path().join("snapshots/snap-1.json").exists());
}

#[test]
fn interrupted_snapshots_are_complete_or_absent() {
    let t = TempDir::new("snap-crash");
    {
        let s = VolumeStore::open(t.path(), 300 * MIB).unwrap();
        s.create_named("pvc-a", 10 * MIB, FsType::Ext4, "a").unwrap();
        s.create_snapshot("done", "pvc-a", "done").unwrap();
    }
    let sd = t.path().join("snapshots");
    // A copy that never finished (no metadata), one whose rename was lost (metadata
    // written: the copy was complete), and a delete that stopped half-way.
    fs::write(sd.join(".half.img.tmp"), b"partial").unwrap();
    fs::rename(sd.join("done.img"), sd.join(".done.img.tmp")).unwrap();
    fs::copy(sd.join("done.json"), sd.join("gone.json")).unwrap();
    let meta = fs::read_to_string(sd.join("gone.json")).unwrap().replace("\"done\"", "\"gone\"");
    fs::write(sd.join("gone.json"), meta).unwrap();
    fs::write(sd.join(".gone.img.del"), b"x").unwrap();
    let s = VolumeStore::open(t.path(), 300 * MIB).unwrap();
    let ids: Vec<String> = s.list_snapshots().into_iter().map(|x| x.id).collect();
    assert_eq!(ids, ["done"]);
    let mut names: Vec<String> =
        fs::read_dir(&sd).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["done.img", "done.json"]);
    assert_eq!(s.available(), 280 * MIB);
}
