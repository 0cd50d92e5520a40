//! Snapshot benchmark (root: loop device and xfs mount for the reflink store): a 1 GiB volume
//! holding 100 MiB of data, snapshotted by the volume store (`create_snapshot`, what the agent
//! runs for CreateSnapshot) into a store on ext4 (sparse copy) and into one on an xfs made with
//! `reflink=1` (reflink), against `cp` of the same image in the same run (`cp --sparse=always`
//! + sync, `cp --reflink=always` + sync). Prints medians, bytes copied and ratios.
//!
//!     snapshot_bench [RUNS]      (default 9)

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use nodeplane::storage::store::{FsType, VolumeStore};

use crate::{pct, run};

const MIB: u64 = 1 << 20;

/// Fill 100 MiB of `img` (1 GiB) with data, in 1 MiB pieces spread over the image.
fn fill(img: &Path) {
    let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
    let mut piece = vec![0u8; MIB as usize];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..100u64 {
        for b in piece.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        f.write_all_at(&piece, i * 10 * MIB).unwrap();
    }
    f.sync_all().unwrap();
}

struct Figures {
    ours_ms: f64,
    cp_ms: f64,
    method: String,
    bytes_copied: u64,
}

fn bench(dir: &Path, runs: usize, cp_flag: &str) -> Figures {
    let store = VolumeStore::open(&dir.join("store"), 64 << 30).unwrap();
    let v = store.create_named("pvc-bench", 1 << 30, FsType::Ext4, "bench").unwrap();
    fill(&v.path);
    let (mut ours, mut cp) = (Vec::new(), Vec::new());
    let (mut method, mut bytes) = (String::new(), 0);
    for i in 0..runs {
        let id = format!("snap-{i}");
        let t = Instant::now();
        let s = store.create_snapshot(&id, "pvc-bench", "bench").unwrap();
        ours.push(t.elapsed().as_secs_f64() * 1e3);
        method = s.method.clone();
        bytes = s.bytes_copied;
        store.delete_snapshot(&id).unwrap();
        let dst = dir.join(format!("cp-{i}.img"));
        let t = Instant::now();
        run("cp", &[cp_flag, v.path.to_str().unwrap(), dst.to_str().unwrap()]);
        run("sync", &["-f", dst.to_str().unwrap()]);
        cp.push(t.elapsed().as_secs_f64() * 1e3);
        std::fs::remove_file(&dst).unwrap();
    }
    store.delete("pvc-bench").unwrap();
    Figures { ours_ms: pct(&mut ours, 0.5), cp_ms: pct(&mut cp, 0.5), method, bytes_copied: bytes }
}

struct Cleanup {
    dir: PathBuf,
    mount: Option<PathBuf>,
    loopdev: Option<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(m) = &self.mount {
            let _ = Command::new("umount").arg(m).status();
        }
        if let Some(l) = &self.loopdev {
            let _ = Command::new("losetup").args(["-d", l]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn main() {
    let runs: usize = std::env::args().nth(1).map(|a| a.parse().expect("RUNS")).unwrap_or(9);
    let base = std::env::temp_dir().join(format!("np-snapbench-{}", std::process::id()));
    std::fs::create_dir_all(&base).unwrap();
    let mut guard = Cleanup { dir: base.clone(), mount: None, loopdev: None };
    let fs_under = run("stat", &["-f", "-c", "%T", base.to_str().unwrap()]);

    let plain = base.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let sparse = bench(&plain, runs, "--sparse=always");

    let img = base.join("xfs.img");
    std::fs::File::create(&img).unwrap().set_len(8 << 30).unwrap();
    let dev = run("losetup", &["--find", "--show", img.to_str().unwrap()]);
    guard.loopdev = Some(dev.clone());
    run("mkfs.xfs", &["-q", "-f", "-m", "reflink=1", &dev]);
    let mnt = base.join("xfs");
    std::fs::create_dir_all(&mnt).unwrap();
    run("mount", &[&dev, mnt.to_str().unwrap()]);
    guard.mount = Some(mnt.clone());
    let reflink = bench(&mnt, runs, "--reflink=always");

    println!("snapshot of a 1 GiB volume holding 100 MiB, median of {runs} (same run, against cp):");
    for (what, f) in
        [(format!("store on {fs_under} (/tmp)"), &sparse), ("store on xfs reflink=1".to_string(), &reflink)]
    {
        println!(
            "  {what:<28} {:<11} {:>8.2} ms  bytes copied {:>10}  | cp {:>8.2} ms  ratio {:.2}x",
            f.method,
            f.ours_ms,
            f.bytes_copied,
            f.cp_ms,
            f.ours_ms / f.cp_ms
        );
    }
    drop(guard);
}
