//! DRA benchmark (root), run by `scripts/bench-dra`. A real agent (in its own network
//! namespace, `unshare --net`) with DRA on, over test device nodes (mknod'd with /dev/null's
//! numbers in a temp dir), reporting to a real local-mode controller on a Unix socket (which
//! writes the node's ResourceSlice pool as files):
//!
//! 1. NodePrepareResources latency over `dra.sock` for a claim of 1 and of 8 devices (median,
//!    p99 of N calls each; every call prepares a new claim: its claim file is written before
//!    the clock starts, as kubelet has the claim before it calls; each is unprepared after,
//!    outside the clock), and the unprepare latency;
//! 2. inventory change → ResourceSlice updated: a device node made with mknod until the
//!    controller's slice lists it, and removed until the slice no longer does (M rounds each;
//!    the agent scans every 100 ms, reports at once, the controller writes at once; each
//!    round starts at another phase of that scan).
//!
//! Targets (issue 19's test bound for 2: 1 s) are printed with PASS or MISS; a miss does not
//! fail the run.
//!
//!     dra_bench <nodeplane-agent> <nodeplane-controller> [prepares] [hotplugs]

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nodeplane::rpc::dra as pb;
use serde_json::{Value, json};

use crate::{mkdev, pct, verdict};

const NODE: &str = "bench-node";
const DRIVER: &str = "dra.nodeplane.dev";
const SLICE_UPDATE_MAX_MS: f64 = 1000.0;

struct Procs(Vec<Child>, PathBuf);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn wait(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn is_socket(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

/// Device names in the node's pool.
fn pool(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(v) = serde_json::from_slice::<Value>(&std::fs::read(e.path()).unwrap_or_default()) else { continue };
        if v["spec"]["nodeName"] == NODE {
            out.extend(
                v["spec"]["devices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|d| d["name"].as_str().map(String::from)),
            );
        }
    }
    out.sort();
    out
}

fn spawn(cmd: &mut Command, log: &Path) -> Child {
    let f = std::fs::File::create(log).unwrap();
    // SAFETY: the hook runs in the child between fork and exec and calls only prctl, which
    // is async-signal-safe.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.env("RUST_LOG", "warn").stdin(Stdio::null()).stdout(Stdio::null()).stderr(f).spawn().expect("spawn")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
pub async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: dra_bench <nodeplane-agent> <nodeplane-controller> [prepares] [hotplugs]");
        std::process::exit(2);
    }
    let (agent, controller) = (&args[1], &args[2]);
    let prepares: usize = args.get(3).map_or(200, |a| a.parse().expect("prepares"));
    let hotplugs: usize = args.get(4).map_or(20, |a| a.parse().expect("hotplugs"));
    let dir = PathBuf::from(format!("/tmp/npdb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for d in ["dev", "cdi", "ctl"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    let mut procs = Procs(Vec::new(), dir.clone());
    for i in 0..8 {
        mkdev(&dir.join(format!("dev/acc{i}")));
    }
    std::fs::write(
        dir.join("devices.json"),
        json!({"resources": [{"name": "acc", "devices": [format!("{}/dev/acc*", dir.display())], "offer": "dra"}]})
            .to_string(),
    )
    .unwrap();
    let ctl = dir.join("ctl");
    let sock = ctl.join("controller.sock");
    std::fs::write(
        ctl.join("controller.json"),
        json!({"dataDir": ctl.join("data"), "listen": format!("unix:{}", sock.display()), "pools": [{"cidr": "10.99.0.0/16", "blockPrefix": 24}]})
            .to_string(),
    )
    .unwrap();
    let out = Command::new(controller)
        .args(["token", "--config"])
        .arg(ctl.join("controller.json"))
        .arg(NODE)
        .output()
        .unwrap();
    assert!(out.status.success(), "token: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(ctl.join("node.token"), &out.stdout).unwrap();
    procs.0.push(spawn(
        Command::new(controller).args(["serve", "--config"]).arg(ctl.join("controller.json")),
        &ctl.join("controller.log"),
    ));
    wait("the controller's socket", Duration::from_secs(20), || is_socket(&sock));
    std::fs::write(
        dir.join("agent.json"),
        json!({
            "nodeName": NODE, "root": dir.join("root"), "csi": {"enabled": false},
            "devicePlugins": {"configFile": dir.join("devices.json"), "cdiDir": dir.join("cdi")},
            "dra": {"enabled": true},
            "controller": {"address": format!("unix:{}", sock.display()), "tokenFile": ctl.join("node.token"), "underlayAddresses": ["192.0.2.10"]},
        })
        .to_string(),
    )
    .unwrap();
    procs.0.push(spawn(
        Command::new("unshare").arg("--net").arg("--").arg(agent).arg("--config").arg(dir.join("agent.json")),
        &dir.join("agent.log"),
    ));
    let dra_sock = dir.join("root/var/lib/kubelet/plugins/dra.nodeplane.dev/dra.sock");
    wait("dra.sock", Duration::from_secs(20), || is_socket(&dra_sock));
    let slices = ctl.join("data/resourceslices");
    wait("the node's pool of 8 devices", Duration::from_secs(20), || pool(&slices).len() == 8);

    // 1. prepare latency
    let claims_dir = dir.join("root/var/lib/nodeplane/dra/claims");
    std::fs::create_dir_all(&claims_dir).unwrap();
    let ch = nodeplane::rpc::connect_unix(&dra_sock).await.unwrap();
    let mut client = pb::dra_plugin_client::DraPluginClient::new(ch);
    println!("DRA NodePrepareResources over dra.sock, {prepares} claims each (claim file written beforehand):");
    for size in [1usize, 8] {
        let (mut prep, mut unprep) = (Vec::with_capacity(prepares), Vec::with_capacity(prepares));
        for i in 0..prepares {
            let uid = format!("bench-{size}-{i:04}");
            let results: Vec<Value> = (0..size)
                .map(|d| json!({"request": "acc", "driver": DRIVER, "pool": NODE, "device": format!("acc-acc{d}")}))
                .collect();
            std::fs::write(
                claims_dir.join(format!("{uid}.json")),
                json!({"namespace": "bench", "name": uid, "uid": uid, "results": results}).to_string(),
            )
            .unwrap();
            let claim = pb::Claim { namespace: "bench".into(), name: uid.clone(), uid: uid.clone() };
            let t = Instant::now();
            let r = client
                .node_prepare_resources(pb::NodePrepareResourcesRequest { claims: vec![claim.clone()] })
                .await
                .unwrap()
                .into_inner();
            prep.push(t.elapsed().as_secs_f64() * 1e3);
            let answer = &r.claims[&uid];
            assert!(answer.error.is_empty() && answer.devices.len() == size, "{answer:?}");
            let t = Instant::now();
            let r = client
                .node_unprepare_resources(pb::NodeUnprepareResourcesRequest { claims: vec![claim] })
                .await
                .unwrap()
                .into_inner();
            unprep.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(r.claims[&uid].error.is_empty());
            let _ = std::fs::remove_file(claims_dir.join(format!("{uid}.json")));
        }
        println!(
            "  claim of {size} device(s): prepare median {:.3} ms, p99 {:.3} ms; unprepare median {:.3} ms, p99 {:.3} ms",
            pct(&mut prep, 0.5),
            pct(&mut prep, 0.99),
            pct(&mut unprep, 0.5),
            pct(&mut unprep, 0.99)
        );
    }

    // 2. inventory change -> ResourceSlice updated
    let (mut add, mut del) = (Vec::new(), Vec::new());
    for r in 0..hotplugs {
        let node = dir.join(format!("dev/acch{r}"));
        let name = format!("acc-acch{r}");
        // Out of phase with the agent's 100 ms scan, as a real hot-plug is.
        std::thread::sleep(Duration::from_millis(((r * 37) % 100) as u64));
        let t = Instant::now();
        mkdev(&node);
        wait("the new device in the pool", Duration::from_secs(10), || pool(&slices).contains(&name));
        add.push(t.elapsed().as_secs_f64() * 1e3);
        std::thread::sleep(Duration::from_millis(((r * 53) % 100) as u64));
        let t = Instant::now();
        std::fs::remove_file(&node).unwrap();
        wait("the removed device out of the pool", Duration::from_secs(10), || !pool(&slices).contains(&name));
        del.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let add_max = add.iter().cloned().fold(0.0, f64::max);
    let del_max = del.iter().cloned().fold(0.0, f64::max);
    println!("Inventory change -> the controller's ResourceSlice updated, {hotplugs} rounds:");
    println!(
        "  device node added:   median {:.1} ms, p99 {:.1} ms, max {add_max:.1} ms (target max {SLICE_UPDATE_MAX_MS} ms: {})",
        pct(&mut add, 0.5),
        pct(&mut add, 0.99),
        verdict(add_max <= SLICE_UPDATE_MAX_MS)
    );
    println!(
        "  device node removed: median {:.1} ms, p99 {:.1} ms, max {del_max:.1} ms (target max {SLICE_UPDATE_MAX_MS} ms: {})",
        pct(&mut del, 0.5),
        pct(&mut del, 0.99),
        verdict(del_max <= SLICE_UPDATE_MAX_MS)
    );
    drop(procs);
}
