//! Device plugin benchmark (root), run by `scripts/bench-deviceplugin`: a real agent serving
//! one resource over test device nodes (mknod'd with /dev/null's numbers in a temp dir);
//! Allocate latency over its socket (median, p99 of N calls), and hot-plug latency: a new
//! matching device node made with mknod until a ListAndWatch stream delivers the list
//! holding it (inotify-driven; each of M rounds). No kubelet is needed: a plugin serves its
//! socket before it registers.
//!
//!     deviceplugin_bench <nodeplane-agent> [allocations] [hotplugs]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nodeplane::rpc::deviceplugin as dp;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn mkdev(p: &Path) {
    mknod(p, SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 3)).expect("mknod");
}

fn main() {
    let agent = std::env::args().nth(1).expect("usage: deviceplugin_bench <nodeplane-agent> [allocations] [hotplugs]");
    let n_alloc: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(1000);
    let n_hot: usize = std::env::args().nth(3).map(|s| s.parse().unwrap()).unwrap_or(20);
    assert_eq!(unsafe { libc::geteuid() }, 0, "needs root (mknod)");
    let dir = PathBuf::from(format!("/tmp/npdpb-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("dev")).unwrap();
    for i in 0..8 {
        mkdev(&dir.join(format!("dev/benchdev{i}")));
    }
    let devices = serde_json::json!({"resources": [{"name": "bench", "devices": [format!("{}/dev/benchdev*", dir.display())],
        "cdi": true, "env": {"BENCH": "1"}}]});
    std::fs::write(dir.join("devices.json"), devices.to_string()).unwrap();
    let cfg = serde_json::json!({"nodeName": "dpbench", "root": dir.join("root"),
        "shimSource": Path::new(&agent).with_file_name("nodeplane-cni"), "csi": {"enabled": false},
        "devicePlugins": {"configFile": dir.join("devices.json"), "cdiDir": dir.join("cdi")}});
    std::fs::write(dir.join("agent.json"), cfg.to_string()).unwrap();
    let log = std::fs::File::create(dir.join("agent.log")).unwrap();
    let mut child = Command::new("unshare")
        .args(["--net", "--", &agent, "--config"])
        .arg(dir.join("agent.json"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let sock = dir.join("root/var/lib/kubelet/device-plugins/nodeplane-bench.sock");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(20);
            while !sock.exists() {
                assert!(Instant::now() < deadline, "plugin socket did not appear");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let ch = nodeplane::rpc::connect_unix(&sock).await.unwrap();
            let mut c = dp::device_plugin_client::DevicePluginClient::new(ch);
            // Warm-up.
            for _ in 0..50 {
                let req = dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec!["benchdev0".into()] }] };
                c.allocate(req).await.unwrap();
            }
            let mut lat = Vec::with_capacity(n_alloc);
            for i in 0..n_alloc {
                let id = format!("benchdev{}", i % 8);
                let req = dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: vec![id] }] };
                let t = Instant::now();
                c.allocate(req).await.unwrap();
                lat.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            let (p50, p99) = (pct(&mut lat.clone(), 0.5), pct(&mut lat, 0.99));
            let mut stream = c.list_and_watch(dp::Empty {}).await.unwrap().into_inner();
            let first = stream.message().await.unwrap().unwrap();
            assert_eq!(first.devices.len(), 8);
            let mut hot = Vec::new();
            for i in 0..n_hot {
                let id = format!("hotdev{i}");
                let t = Instant::now();
                mkdev(&dir.join(format!("dev/benchdev-{id}")));
                loop {
                    let m = tokio::time::timeout(Duration::from_secs(5), stream.message()).await.expect("no update within 5 s").unwrap().unwrap();
                    if m.devices.iter().any(|d| d.id == format!("benchdev-{id}")) {
                        break;
                    }
                }
                hot.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            let (h50, hmax) = (pct(&mut hot.clone(), 0.5), pct(&mut hot, 1.0));
            println!("device plugin (one resource, 8 device nodes, CDI on), over the plugin's socket");
            println!("Allocate, {n_alloc} calls one after another: median {p50:.3} ms, p99 {p99:.3} ms");
            println!("hot-plug (mknod) to ListAndWatch update, {n_hot} rounds: median {h50:.2} ms, max {hmax:.2} ms");
            println!("{}  Allocate p99: {p99:.3} ms (target <= 1 ms)", if p99 <= 1.0 { "PASS" } else { "FAIL" });
            println!("{}  hot-plug max: {hmax:.2} ms (target <= 1000 ms)", if hmax <= 1000.0 { "PASS" } else { "FAIL" });
        })
    }));
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
