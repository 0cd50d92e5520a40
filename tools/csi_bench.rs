//! CSI node benchmark (root): create + stage + publish of a 1 GiB ext4 volume through a
//! running agent (which probes signatures in-process and runs only mkfs.ext4), and
//! unpublish + unstage + delete, against the reference — the same steps
//! done with the standard tools a shell-based node plugin runs (`truncate`, `losetup`,
//! `blkid`, `mkfs.ext4`, `mount`, `mount --bind`; `umount`, `losetup -d`, `rm`) — measured in
//! the same run on the same disk.
//!
//! Everything (the agent's state and volume dirs, kubelet's dir, the reference's images and
//! mount points) lives on a journaled ext4 that the bench makes and loop-mounts: what a
//! node's `/var/lib` is, unlike this development VM's root filesystem (ext4 without a
//! journal, where every file creation walks the inodes freed in the last minutes).
//!
//! Run through `scripts/bench-csi`. Everything lives under a temp dir that is cleaned up.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use nodeplane::rpc::csi;
use nodeplane::rpc::node as napi;

use crate::{ext4_cap, pct, process_cpu_ms, run, verdict};

const GIB: u64 = 1 << 30;

/// Write back everything dirty, untimed.
fn settle() {
    nix::unistd::sync();
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The machine's CPU time so far (ms): busy (user, nice, system, irq, softirq) and stolen by
/// the host, from `/proc/stat`.
fn machine_cpu_ms() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> =
        stat.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    // SAFETY: sysconf takes and returns plain integers.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let at = |i: usize| f.get(i).copied().unwrap_or(0) as f64 * 1000.0 / tick;
    (at(0) + at(1) + at(2) + at(5) + at(6), at(7))
}

/// A journaled ext4 (mkfs.ext4's defaults) of `size` bytes on the sparse file `image`,
/// mounted at `at`; returns its loop device.
fn journaled_ext4(image: &Path, at: &Path, size: u64) -> String {
    std::fs::File::create(image).unwrap().set_len(size).unwrap();
    run("mkfs.ext4", &["-F", "-q", image.to_str().unwrap()]);
    let dev = run("losetup", &["--find", "--show", image.to_str().unwrap()]);
    run("mount", &["-t", "ext4", &dev, at.to_str().unwrap()]);
    dev
}

struct Reference {
    dir: PathBuf,
    /// The volume group of the `lvm` backend's pool (`None`: the file backend).
    vg: Option<String>,
}

impl Reference {
    fn up(&self, i: usize) -> (String, PathBuf, PathBuf, PathBuf) {
        let img = self.dir.join(format!("ref-{i}.img"));
        let staging = self.dir.join(format!("ref-stage-{i}"));
        let target = self.dir.join(format!("ref-target-{i}"));
        let dev = match &self.vg {
            // A thin LV, as a shell-based LVM plugin makes one.
            Some(vg) => {
                let pool = format!("{vg}/pool");
                run("lvcreate", &["-q", "-y", "-T", &pool, "-V", &format!("{GIB}b"), "-n", &format!("ref-{i}")]);
                format!("/dev/{vg}/ref-{i}")
            }
            None => {
                run("truncate", &["-s", &GIB.to_string(), img.to_str().unwrap()]);
                run("losetup", &["--find", "--show", img.to_str().unwrap()])
            }
        };
        let _ = run("blkid", &["-p", "-o", "value", "-s", "TYPE", &dev]);
        run("mkfs.ext4", &["-F", "-q", &dev]);
        std::fs::create_dir_all(&staging).unwrap();
        run("mount", &["-t", "ext4", &dev, staging.to_str().unwrap()]);
        std::fs::create_dir_all(&target).unwrap();
        run("mount", &["--bind", staging.to_str().unwrap(), target.to_str().unwrap()]);
        (dev, img, staging, target)
    }
    fn down(&self, (dev, img, staging, target): (String, PathBuf, PathBuf, PathBuf)) {
        run("umount", &[target.to_str().unwrap()]);
        std::fs::remove_dir(&target).unwrap();
        run("umount", &[staging.to_str().unwrap()]);
        match &self.vg {
            Some(_) => drop(run("lvremove", &["-q", "-y", &dev])),
            None => {
                run("losetup", &["-d", &dev]);
                std::fs::remove_file(&img).unwrap();
            }
        }
    }
}

struct Plugin {
    /// Per-call times (ms) of the single runs, by step, for the breakdown.
    steps: std::collections::BTreeMap<&'static str, Vec<f64>>,
    record: bool,
    node: csi::node_client::NodeClient<tonic::transport::Channel>,
    vols: napi::node_volumes_client::NodeVolumesClient<tonic::transport::Channel>,
    kubelet: PathBuf,
    backend: &'static str,
}

impl Plugin {
    fn paths(&self, id: &str) -> (String, String) {
        let staging = self.kubelet.join(format!("plugins/kubernetes.io/csi/pv/{id}/globalmount"));
        let target = self.kubelet.join(format!("pods/bench/volumes/kubernetes.io~csi/{id}/mount"));
        std::fs::create_dir_all(staging.parent().unwrap()).unwrap();
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        (staging.to_string_lossy().into_owned(), target.to_string_lossy().into_owned())
    }
    async fn up(&mut self, id: &str) {
        self.up_sized(id, GIB).await
    }
    async fn up_sized(&mut self, id: &str, size: u64) {
        let (staging, target) = self.paths(id);
        let t = Instant::now();
        self.vols
            .create_volume(napi::CreateVolumeRequest {
                id: id.into(),
                size_bytes: size,
                fs_type: "ext4".into(),
                backend: self.backend.into(),
            })
            .await
            .unwrap();
        self.step("1 create", t);
        let t = Instant::now();
        self.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.clone(),
                volume_capability: Some(ext4_cap()),
                ..Default::default()
            })
            .await
            .unwrap();
        self.step("2 stage", t);
        let t = Instant::now();
        self.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging,
                target_path: target,
                volume_capability: Some(ext4_cap()),
                ..Default::default()
            })
            .await
            .unwrap();
        self.step("3 publish", t);
    }
    fn step(&mut self, name: &'static str, t: Instant) {
        if self.record {
            self.steps.entry(name).or_default().push(ms(t.elapsed()));
        }
    }
    async fn down(&mut self, id: &str) {
        let (staging, target) = self.paths(id);
        let t = Instant::now();
        self.node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target })
            .await
            .unwrap();
        self.step("4 unpublish", t);
        let t = Instant::now();
        self.node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging })
            .await
            .unwrap();
        self.step("5 unstage", t);
        let t = Instant::now();
        self.vols.delete_volume(napi::DeleteVolumeRequest { id: id.into() }).await.unwrap();
        self.step("6 delete", t);
    }
}

struct Figures {
    up_median: f64,
    down_median: f64,
    seq_up: f64,
    seq_down: f64,
}

fn print_row(name: &str, f: &Figures) {
    println!("{name:<22} {:>10.1} {:>10.1} {:>12.0} {:>12.0}", f.up_median, f.down_median, f.seq_up, f.seq_down);
}

pub fn main() {
    let agent =
        std::env::args().nth(1).expect("usage: csi_bench <path to nodeplane-agent> [singles] [sequence] [rounds]");
    let singles: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(20);
    let seq: usize = std::env::args().nth(3).map(|s| s.parse().unwrap()).unwrap_or(50);
    let rounds: usize = std::env::args().nth(4).map(|s| s.parse().unwrap()).unwrap_or(3).max(1);
    let backend: &'static str = match std::env::args().nth(5).as_deref() {
        None | Some("file") => "file",
        Some("lvm") => "lvm",
        Some(other) => panic!("backend {other:?}: want file or lvm"),
    };
    assert_eq!(nix::unistd::geteuid().as_raw(), 0, "the CSI benchmark needs root");
    let dir = std::env::temp_dir().join(format!("np-bench-csi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = dir.canonicalize().unwrap();
    let fs_image = dir.with_extension("img");
    let fs_dev = journaled_ext4(&fs_image, &dir, (seq as u64 + 8) * GIB);
    // The lvm backend: a volume group on a loop device over a file of that ext4, with a thin
    // pool holding what mkfs writes (virtual sizes overprovisioned 8 times).
    let vg = (backend == "lvm").then(|| thin_pool(&dir, seq));
    let mut csi = serde_json::json!({"capacityBytes": (seq as u64 + 2) * GIB});
    if let Some((vg, _)) = &vg {
        csi["lvm"] = serde_json::json!({"volumeGroup": vg, "thinPool": "pool", "overprovisionRatio": 8});
        snapshot_figures(vg);
    }
    let cfg = serde_json::json!({
        "nodeName": "bench",
        "root": dir.join("root"),
        "shimSource": Path::new(&agent).with_file_name("nodeplane-cni"),
        "csi": csi,
    });
    std::fs::write(dir.join("agent.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let log = std::fs::File::create(dir.join("agent.log")).unwrap();
    let mut child: Child = Command::new("unshare")
        .args(["--net", "--", &agent, "--config"])
        .arg(dir.join("agent.json"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let agent_pid = child.id(); // unshare execs the agent: the same process
    let kubelet = dir.join("root/var/lib/kubelet");
    let reg = kubelet.join("plugins_registry/csi.nodeplane.dev-reg.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !reg.exists() {
        assert!(Instant::now() < deadline, "agent not ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async {
            let ch = nodeplane::rpc::connect_unix(&kubelet.join("plugins/csi.nodeplane.dev/csi.sock")).await.unwrap();
            let nch = nodeplane::rpc::connect_unix(&dir.join("root/run/nodeplane/node.sock")).await.unwrap();
            let mut p = Plugin {
                steps: Default::default(),
                record: false,
                node: csi::node_client::NodeClient::new(ch),
                vols: napi::node_volumes_client::NodeVolumesClient::new(nch),
                kubelet: kubelet.clone(),
                backend,
            };
            let r = Reference { dir: dir.join("ref"), vg: vg.as_ref().map(|(v, _)| v.clone()) };
            std::fs::create_dir_all(&r.dir).unwrap();
            // Warm-up (page cache for the tools and the agent).
            p.up("warm").await;
            p.down("warm").await;
            let w = r.up(9999);
            r.down(w);

            let (mut pu, mut pd, mut ru, mut rd) = (vec![], vec![], vec![], vec![]);
            // Per round: the sequences' totals (nodeplane up, down; reference up, down), each
            // against the same round's singles, and the sequence's per-call times by step.
            let mut seq_totals: Vec<[f64; 4]> = Vec::new();
            let (mut flat_ups, mut flat_downs) = (Vec::new(), Vec::new());
            let mut seq_rounds = Vec::new();
            let mut round_lines = Vec::new();
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            for round in 0..rounds {
                let (mut round_up, mut round_down) = (vec![], vec![]);
                let recorded_before: Vec<usize> = p.steps.values().map(|v| v.len()).collect();
                // Each timed block starts with nothing dirty in the page cache: the CLI's
                // mkfs.ext4 leaves tens of MiB per volume to write back, which would
                // otherwise land in whatever runs next.
                settle();
                // Singles back to back, as the sequence runs: work a call leaves behind (a
                // journal commit, a deferred unlink) lands on the next call in both, and the
                // only difference is how many volumes the node holds.
                p.record = true;
                let cpu0 = (process_cpu_ms(agent_pid), machine_cpu_ms());
                for i in 0..singles {
                    let id = format!("pvc-single-{round}-{i}");
                    let t = Instant::now();
                    p.up(&id).await;
                    round_up.push(ms(t.elapsed()));
                    let t = Instant::now();
                    p.down(&id).await;
                    round_down.push(ms(t.elapsed()));
                }
                let cpu1 = (process_cpu_ms(agent_pid), machine_cpu_ms());
                settle();
                for i in 0..singles {
                    let t = Instant::now();
                    let h = r.up(i);
                    ru.push(ms(t.elapsed()));
                    let t = Instant::now();
                    r.down(h);
                    rd.push(ms(t.elapsed()));
                }
                // The sequence's calls are timed too: the first tenth against the last tenth
                // shows whether a call's cost grows with the volumes on the node.
                // This round's singles, step by step (mean ms), for the round's line below.
                let round_singles: Vec<(&'static str, f64)> = p
                    .steps
                    .iter()
                    .enumerate()
                    .map(|(n, (k, v))| (*k, mean(&v[recorded_before.get(n).copied().unwrap_or(0)..])))
                    .collect();
                let singles_steps = std::mem::take(&mut p.steps);
                settle();
                let cpu2 = (process_cpu_ms(agent_pid), machine_cpu_ms());
                let t = Instant::now();
                for i in 0..seq {
                    p.up(&format!("pvc-seq-{round}-{i}")).await;
                }
                let p_seq_up = ms(t.elapsed());
                let t = Instant::now();
                for i in 0..seq {
                    p.down(&format!("pvc-seq-{round}-{i}")).await;
                }
                let p_seq_down = ms(t.elapsed());
                let cpu3 = (process_cpu_ms(agent_pid), machine_cpu_ms());
                seq_rounds.push(std::mem::replace(&mut p.steps, singles_steps));
                p.record = false;
                settle();
                let t = Instant::now();
                let hs: Vec<_> = (0..seq).map(|i| r.up(1000 + i)).collect();
                let r_seq_up = ms(t.elapsed());
                let t = Instant::now();
                for h in hs {
                    r.down(h);
                }
                let r_seq_down = ms(t.elapsed());
                seq_totals.push([p_seq_up, p_seq_down, r_seq_up, r_seq_down]);
                // A sequence's total against as many single calls of the same round: totals
                // against totals (the singles' mean, not their median, which would leave out
                // the hiccups a total of 50 calls always holds).
                flat_ups.push(p_seq_up / (seq as f64 * mean(&round_up)));
                flat_downs.push(p_seq_down / (seq as f64 * mean(&round_down)));
                // Where a round's sequence and singles differ: each step's mean per call.
                let in_seq = seq_rounds.last().expect("pushed above");
                let by_step: Vec<String> = round_singles
                    .iter()
                    .map(|(k, single)| format!("{} {single:.2}/{:.2}", &k[2..], in_seq.get(k).map(|v| mean(v)).unwrap_or(f64::NAN)))
                    .collect();
                // CPU per volume brought up and down: the agent's own (its threads, the
                // mounts and loop set-up it asks the kernel for) and the whole machine's
                // (writeback, loop workers, anything else running), and the host's steal.
                let per = |a: f64, b: f64, n: usize| (b - a) / n as f64;
                round_lines.push(format!(
                    "round {}: up {:.2}/{:.2}, down {:.2}/{:.2}; {}; CPU per volume up+down: agent {:.2}/{:.2}, machine {:.2}/{:.2}, stolen {:.2}/{:.2}",
                    round + 1,
                    mean(&round_up),
                    p_seq_up / seq as f64,
                    mean(&round_down),
                    p_seq_down / seq as f64,
                    by_step.join(", "),
                    per(cpu0.0, cpu1.0, singles),
                    per(cpu2.0, cpu3.0, seq),
                    per(cpu0.1 .0, cpu1.1 .0, singles),
                    per(cpu2.1 .0, cpu3.1 .0, seq),
                    per(cpu0.1 .1, cpu1.1 .1, singles),
                    per(cpu2.1 .1, cpu3.1 .1, seq),
                ));
                pu.extend(round_up);
                pd.extend(round_down);
            }
            let col = |k: usize| pct(&mut seq_totals.iter().map(|t| t[k]).collect::<Vec<_>>(), 0.5);
            let (p_seq_up, p_seq_down, r_seq_up, r_seq_down) = (col(0), col(1), col(2), col(3));
            let pf = Figures { up_median: pct(&mut pu.clone(), 0.5), down_median: pct(&mut pd.clone(), 0.5), seq_up: p_seq_up, seq_down: p_seq_down };
            let rf = Figures { up_median: pct(&mut ru, 0.5), down_median: pct(&mut rd, 0.5), seq_up: r_seq_up, seq_down: r_seq_down };
            println!(
                "CSI node, 1 GiB ext4 volumes on the {backend} backend, {rounds} rounds of {singles} single runs then {seq} in sequence: medians (ms)"
            );
            println!("{:<22} {:>10} {:>10} {:>12} {:>12}", "", "up (med)", "down (med)", format!("{seq} up"), format!("{seq} down"));
            print_row("nodeplane agent", &pf);
            print_row("reference (CLI tools)", &rf);
            println!(
                "ratio nodeplane/ref    {:>10.3} {:>10.3} {:>12.3} {:>12.3}",
                pf.up_median / rf.up_median,
                pf.down_median / rf.down_median,
                pf.seq_up / rf.seq_up,
                pf.seq_down / rf.seq_down
            );
            println!("up = create + stage (mkfs) + publish; down = unpublish + unstage + delete");
            let steps: Vec<String> =
                p.steps.iter_mut().map(|(k, v)| format!("{} {:.2}", &k[2..], pct(v, 0.5))).collect();
            println!("nodeplane per call (median ms): {}", steps.join(", "));
            let tenth = (seq / 10).max(1);
            let growth: Vec<String> = seq_rounds[0]
                .keys()
                .map(|k| {
                    // Every round's first and last tenth, pooled.
                    let (mut first, mut last) = (vec![], vec![]);
                    for steps in &seq_rounds {
                        let v = &steps[k];
                        first.extend_from_slice(&v[..tenth]);
                        last.extend_from_slice(&v[v.len() - tenth..]);
                    }
                    // Up: the first tenth met the fewest volumes; down: the last tenth did.
                    let (few, many) = if *k < "4" { (mean(&first), mean(&last)) } else { (mean(&last), mean(&first)) };
                    format!("{} {few:.2} -> {many:.2}", &k[2..])
                })
                .collect();
            println!(
                "in sequence, mean ms per call with the fewest vs the most volumes on the node (a tenth each): {}",
                growth.join(", ")
            );
            println!("per round, mean ms per call, single / in sequence:");
            for l in &round_lines {
                println!("  {l}");
            }
            // Issue 43's targets: up within 0.75x and down within half the CLI tools' time,
            // and a call in a sequence of `seq` volumes costing about what a single one does
            // (flat in the node's volumes).
            if backend == "lvm" {
                // Issue 43's targets are the file backend's; the lvm backend's figures are
                // reported against lvcreate/lvremove with no target.
                return;
            }
            let up = pf.up_median / rf.up_median;
            let down = pf.down_median / rf.down_median;
            let rounds_of = |v: &[f64]| v.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(" ");
            println!(
                "{seq} in sequence against {seq} x the same round's singles, by round: up {}, down {}",
                rounds_of(&flat_ups),
                rounds_of(&flat_downs)
            );
            // The verdict takes the median round: one round's total of 50 calls moves by
            // a tenth with the machine's noise (a writeback, another process), in either
            // direction; every round is printed above.
            let flat_up = pct(&mut flat_ups, 0.5);
            let flat_down = pct(&mut flat_downs, 0.5);
            println!("{}  up: {up:.3}x reference (target <= 0.75x)", verdict(up <= 0.75));
            println!("{}  down: {down:.3}x reference (target <= 0.5x)", verdict(down <= 0.5));
            println!("{}  {seq} up in sequence: {flat_up:.3}x {seq} singles, median round (target <= 1.15x)", verdict(flat_up <= 1.15));
            println!("{}  {seq} down in sequence: {flat_down:.3}x {seq} singles, median round (target <= 1.15x)", verdict(flat_down <= 1.15));
        })
    }));
    let _ = child.kill();
    let _ = child.wait();
    // Clean up whatever a failure left: mounts under the dir, loop devices of its files.
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut mps: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(|m| PathBuf::from(m.replace("\\040", " "))))
        .filter(|m| m.starts_with(&dir) && *m != dir)
        .collect();
    mps.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for m in mps {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    // The volume group before the loop devices: its PV is one of them.
    if let Some((vg, pv)) = &vg {
        let _ = Command::new("vgremove").args(["-q", "-y", "-f", vg]).status();
        let _ = Command::new("pvremove").args(["-q", "-y", pv]).status();
    }
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file"))
            && Path::new(b.trim().trim_end_matches(" (deleted)")).starts_with(&dir)
        {
            let _ = Command::new("losetup").arg("-d").arg(format!("/dev/{}", e.file_name().to_string_lossy())).status();
        }
    }
    let _ = Command::new("umount").arg(&dir).status();
    let _ = Command::new("losetup").args(["-d", &fs_dev]).status();
    let _ = std::fs::remove_file(&fs_image);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

/// A volume group `npbench<pid>` on a loop device over a sparse file in `dir`, with a thin
/// pool `pool` of 2 GiB plus 64 MiB per volume of a sequence. Returns (vg, loop device).
fn thin_pool(dir: &Path, seq: usize) -> (String, String) {
    let vg = format!("npbench{}", std::process::id());
    let pool_mib = 2048 + 64 * seq as u64;
    let pv = dir.join("pv.img");
    std::fs::File::create(&pv).unwrap().set_len((pool_mib + 256) << 20).unwrap();
    let dev = run("losetup", &["--find", "--show", pv.to_str().unwrap()]);
    run("pvcreate", &["-q", "-y", &dev]);
    run("vgcreate", &["-q", &vg, &dev]);
    run("lvcreate", &["-q", "-y", "-T", &format!("{vg}/pool"), "-L", &format!("{pool_mib}m")]);
    (vg, dev)
}

/// Snapshots of a 1 GiB thin volume holding 0, 256 and 768 MiB: the store's
/// (`VolumeStore::create_snapshot`, metadata included) against `lvcreate -s` on the same
/// volume in the same state. Thin snapshots copy nothing, so neither should grow with the
/// data. Runs before the agent starts, with a store of its own in the same pool.
fn snapshot_figures(vg: &str) {
    use nodeplane::storage::store::{Backend, FsType, ThinPoolConfig, VolumeStore};
    let dir = std::env::temp_dir().join(format!("np-bench-snap-{}", std::process::id()));
    let cfg = ThinPoolConfig { volume_group: vg.into(), thin_pool: "pool".into(), overprovision_ratio: 8.0 };
    let store = VolumeStore::open(&dir, GIB).unwrap().with_thin_pool(cfg).unwrap();
    store.create_on(Backend::Lvm, "snapsrc", GIB, FsType::Raw, "").unwrap();
    let dev = store.attach("snapsrc").unwrap();
    println!("thin snapshots of a 1 GiB volume, median of 5 (ms):");
    println!("{:<14} {:>12} {:>14} {:>8}", "data written", "nodeplane", "lvcreate -s", "ratio");
    let mut written = 0u64;
    for target in [0u64, 256, 768] {
        let f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
        let chunk = vec![0xa5u8; 1 << 20];
        while written < target {
            std::os::unix::fs::FileExt::write_all_at(&f, &chunk, written << 20).unwrap();
            written += 1;
        }
        f.sync_all().unwrap();
        settle();
        let (mut ours, mut cli) = (vec![], vec![]);
        for i in 0..5 {
            let t = Instant::now();
            store.create_snapshot(&format!("s{target}-{i}"), "snapsrc", "").unwrap();
            ours.push(ms(t.elapsed()));
            let t = Instant::now();
            run("lvcreate", &["-q", "-y", "-s", "-n", &format!("ref-s{target}-{i}"), &format!("{vg}/np-snapsrc")]);
            cli.push(ms(t.elapsed()));
        }
        for i in 0..5 {
            store.delete_snapshot(&format!("s{target}-{i}")).unwrap();
            run("lvremove", &["-q", "-y", &format!("{vg}/ref-s{target}-{i}")]);
        }
        let (o, c) = (pct(&mut ours, 0.5), pct(&mut cli, 0.5));
        println!("{:<14} {o:>12.1} {c:>14.1} {:>8.2}", format!("{target} MiB"), o / c);
    }
    store.delete("snapsrc").unwrap();
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
