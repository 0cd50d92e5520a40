//! Root-only: the agent as DRA kubelet plugin `dra.nodeplane.dev` in local mode (issue #19,
//! node half). Black box: the agent binary (`nodeplane-agent`, in a private network namespace
//! made by `unshare --net`) and the operator CLI (`nodeplane dra prepare|unprepare`), with
//! real device nodes (`mknod`, /dev/null's numbers) and a fake kubelet directory. This test
//! plays kubelet: it dials the registration socket (GetInfo, NotifyRegistrationStatus),
//! then the advertised endpoint (NodePrepareResources, NodeUnprepareResources,
//! NodeWatchResources).
//!
//! Sandbox: `/tmp/npd-<pid>-<test>` (short: socket paths), removed on drop; the agent is
//! killed by PID on drop (also when the test panics). Every path the agent uses (kubelet
//! dir, state dir, CDI dir, device file) is inside it. Needs root; FAILS (never skips)
//! without it.

use crate::cdi_validate;
#[path = "../tools/support/kubelet_dra.rs"]
mod kubelet_dra;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nodeplane::rpc::dra as pb;
use nodeplane::rpc::drahealth as hpb;
use nodeplane::rpc::pluginregistration as reg;
use serde_json::{Value, json};

const AGENT: &str = env!("CARGO_BIN_EXE_nodeplane-agent");
const CLI: &str = env!("CARGO_BIN_EXE_nodeplane");
const CONTROLLER: &str = env!("CARGO_BIN_EXE_nodeplane-controller");
const NODE: &str = "dra-node";
const DRIVER: &str = "dra.nodeplane.dev";
const STARTUP: Duration = Duration::from_secs(20);

fn require_root() {
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "tests/dra_root.rs needs root (mknod, network namespace). It does not skip."
    );
}

struct Sandbox {
    dir: PathBuf,
    agent: Option<Child>,
    controller: Option<Child>,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for mut c in [self.agent.take(), self.controller.take()].into_iter().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Sandbox {
    fn new(tag: &str) -> Sandbox {
        require_root();
        let dir = PathBuf::from("/tmp").join(format!("npd-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for d in ["dev", "cdi", "lib"] {
            fs::create_dir_all(dir.join(d)).unwrap();
        }
        let dir = dir.canonicalize().unwrap();
        let cfg = json!({
            "nodeName": NODE,
            "root": dir.join("root"),
            "shimSource": crate::shim(),
            "csi": {"enabled": false},
            "devicePlugins": {"configFile": dir.join("devices.json"), "cdiDir": dir.join("cdi")},
            "dra": {"enabled": true},
        });
        fs::write(dir.join("agent.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
        Sandbox { dir, agent: None, controller: None }
    }

    /// A local-mode controller on a Unix socket in the sandbox, and the agent configured to
    /// use it (with this node's token).
    fn start_controller(&mut self) {
        let ctl = self.dir.join("ctl");
        fs::create_dir_all(&ctl).unwrap();
        let cfg = json!({
            "dataDir": ctl.join("data"),
            "listen": format!("unix:{}", ctl.join("controller.sock").display()),
            "pools": [{"cidr": "10.99.0.0/16", "blockPrefix": 24}],
        });
        fs::write(ctl.join("controller.json"), cfg.to_string()).unwrap();
        let out = Command::new(CONTROLLER)
            .args(["token", "--config"])
            .arg(ctl.join("controller.json"))
            .arg(NODE)
            .output()
            .unwrap();
        assert!(out.status.success(), "token: {}", String::from_utf8_lossy(&out.stderr));
        fs::write(ctl.join("node.token"), &out.stdout).unwrap();
        let log = fs::File::create(ctl.join("controller.log")).unwrap();
        let child = Command::new(CONTROLLER)
            .args(["serve", "--config"])
            .arg(ctl.join("controller.json"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.controller = Some(child);
        let deadline = Instant::now() + STARTUP;
        while !fs::symlink_metadata(ctl.join("controller.sock")).is_ok_and(|m| m.file_type().is_socket()) {
            assert!(
                Instant::now() < deadline,
                "controller not serving:\n{}",
                fs::read_to_string(ctl.join("controller.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut agent: Value = serde_json::from_slice(&fs::read(self.config()).unwrap()).unwrap();
        agent["controller"] = json!({
            "address": format!("unix:{}", ctl.join("controller.sock").display()),
            "tokenFile": ctl.join("node.token"),
            "underlayAddresses": ["192.0.2.10"],
        });
        fs::write(self.config(), serde_json::to_vec_pretty(&agent).unwrap()).unwrap();
    }

    fn controller_config(&self) -> PathBuf {
        self.dir.join("ctl/controller.json")
    }

    /// The controller's published slices (local mode: files), by name.
    fn slices(&self) -> BTreeMap<String, Value> {
        let dir = self.dir.join("ctl/data/resourceslices");
        let mut out = BTreeMap::new();
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            if let Ok(v) = serde_json::from_slice::<Value>(&fs::read(e.path()).unwrap_or_default()) {
                out.insert(v["metadata"]["name"].as_str().unwrap_or_default().to_string(), v);
            }
        }
        out
    }

    /// The device names of this node's pool.
    fn pool_devices(&self) -> Vec<String> {
        self.slices()
            .values()
            .filter(|s| s["spec"]["nodeName"] == NODE)
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .map(|d| d["name"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    fn config(&self) -> PathBuf {
        self.dir.join("agent.json")
    }
    fn kubelet(&self) -> PathBuf {
        self.dir.join("root/var/lib/kubelet")
    }
    fn state(&self) -> PathBuf {
        self.dir.join("root/var/lib/nodeplane")
    }
    fn dra_sock(&self) -> PathBuf {
        self.kubelet().join("plugins/dra.nodeplane.dev/dra.sock")
    }
    fn reg_sock(&self) -> PathBuf {
        self.kubelet().join("plugins_registry/dra.nodeplane.dev-reg.sock")
    }
    fn cdi_spec(&self, uid: &str) -> PathBuf {
        self.dir.join(format!("cdi/dra.nodeplane.dev-claim_{uid}.json"))
    }
    fn checkpoint(&self, uid: &str) -> PathBuf {
        self.state().join(format!("dra/prepared/{uid}.json"))
    }
    fn claim_file(&self, uid: &str) -> PathBuf {
        self.state().join(format!("dra/claims/{uid}.json"))
    }
    fn write_claim(&self, claim: &Value) {
        let uid = claim["uid"].as_str().unwrap();
        fs::create_dir_all(self.state().join("dra/claims")).unwrap();
        fs::write(self.claim_file(uid), claim.to_string()).unwrap();
    }
    fn dev(&self, node: &str) -> PathBuf {
        self.dir.join("dev").join(node)
    }
    fn log(&self) -> String {
        let log = fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(80)..].join("\n")
    }

    fn mknod(&self, node: &str) {
        mknod(&self.dev(node), SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 3))
            .unwrap_or_else(|e| panic!("mknod {}: {e}", self.dev(node).display()));
    }

    fn write_devices(&self, resources: Value) {
        let tmp = self.dir.join(".devices.json.tmp");
        fs::write(&tmp, serde_json::to_vec_pretty(&json!({ "resources": resources })).unwrap()).unwrap();
        fs::rename(&tmp, self.dir.join("devices.json")).unwrap();
    }

    fn start_agent(&mut self) {
        assert!(self.agent.is_none(), "agent already running");
        let log = OpenOptions::new().create(true).append(true).open(self.dir.join("agent.log")).unwrap();
        let mut cmd = Command::new("unshare");
        cmd.arg("--net")
            .arg("--")
            .arg(AGENT)
            .arg("--config")
            .arg(self.config())
            .env("RUST_LOG", "info")
            .env_remove("NODEPLANE_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
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
        self.agent = Some(cmd.spawn().expect("starting the agent"));
    }

    /// SIGTERM; the agent must exit cleanly and leave no DRA socket behind.
    async fn stop_agent(&mut self) {
        let mut c = self.agent.take().expect("agent running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = c.try_wait().unwrap() {
                assert!(st.success(), "agent exited with {st}:\n{}", self.log());
                break;
            }
            if Instant::now() >= deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!("agent did not stop on SIGTERM within 20 s:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!self.reg_sock().exists(), "registration socket left behind");
        assert!(!self.dra_sock().exists(), "dra.sock left behind");
    }

    /// Wait until `path` is a socket; the agent must stay alive meanwhile.
    async fn wait_socket(&mut self, path: &Path, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                return;
            }
            if let Some(c) = self.agent.as_mut()
                && let Some(st) = c.try_wait().unwrap()
            {
                panic!("the agent exited ({st}):\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "{} not served within {timeout:?}:\n{}", path.display(), self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Start the agent and wait for the registration socket (dra.sock must be there first).
    async fn start_and_wait(&mut self) {
        self.start_agent();
        let reg = self.reg_sock();
        self.wait_socket(&reg, STARTUP).await;
        assert!(
            fs::symlink_metadata(self.dra_sock()).is_ok_and(|m| m.file_type().is_socket()),
            "registration socket appeared before dra.sock"
        );
    }

    async fn client(&self) -> pb::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
        pb::dra_plugin_client::DraPluginClient::new(nodeplane::rpc::connect_unix(&self.dra_sock()).await.unwrap())
    }

    async fn prepare(&self, claims: &[(&str, &str, &str)]) -> BTreeMap<String, pb::NodePrepareResourceResponse> {
        let req = pb::NodePrepareResourcesRequest { claims: claims.iter().map(|c| claim(*c)).collect() };
        self.client().await.node_prepare_resources(req).await.unwrap().into_inner().claims.into_iter().collect()
    }

    async fn unprepare(&self, claims: &[(&str, &str, &str)]) -> BTreeMap<String, pb::NodeUnprepareResourceResponse> {
        let req = pb::NodeUnprepareResourcesRequest { claims: claims.iter().map(|c| claim(*c)).collect() };
        self.client().await.node_unprepare_resources(req).await.unwrap().into_inner().claims.into_iter().collect()
    }

    /// `nodeplane dra <args> --config <agent.json>`: (exit code, stdout JSON).
    fn cli(&self, args: &[&str]) -> (i32, Value) {
        let out = Command::new(CLI).arg("dra").args(args).arg("--config").arg(self.config()).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let doc = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!("nodeplane dra {args:?}: not JSON ({e}): {stdout}\nstderr: {}", String::from_utf8_lossy(&out.stderr))
        });
        (out.status.code().unwrap_or(-1), doc)
    }
}

/// (namespace, name, uid)
fn claim((namespace, name, uid): (&str, &str, &str)) -> pb::Claim {
    pb::Claim { namespace: namespace.into(), uid: uid.into(), name: name.into() }
}

fn result(request: &str, driver: &str, pool: &str, device: &str) -> Value {
    json!({"request": request, "driver": driver, "pool": pool, "device": device})
}

fn device(requests: &[&str], name: &str, uid: &str) -> pb::Device {
    pb::Device {
        request_names: requests.iter().map(|r| r.to_string()).collect(),
        pool_name: NODE.into(),
        device_name: name.into(),
        cdi_device_ids: vec![format!("dra.nodeplane.dev/claim={uid}-{name}")],
    }
}

fn ok_devices(r: &BTreeMap<String, pb::NodePrepareResourceResponse>, uid: &str) -> Vec<pb::Device> {
    let c = r.get(uid).unwrap_or_else(|| panic!("no entry for claim {uid}: {r:?}"));
    assert_eq!(c.error, "", "claim {uid} failed");
    c.devices.clone()
}

async fn registration_info(sock: &Path) -> reg::PluginInfo {
    let ch = nodeplane::rpc::connect_unix(sock).await.unwrap();
    let mut c = reg::registration_client::RegistrationClient::new(ch);
    let info = c.get_info(reg::InfoRequest {}).await.unwrap().into_inner();
    c.notify_registration_status(reg::RegistrationStatus { plugin_registered: true, error: String::new() })
        .await
        .unwrap();
    info
}

const A: &str = "11111111-aaaa-4bbb-8ccc-000000000001";
const B: &str = "22222222-aaaa-4bbb-8ccc-000000000002";
const U: &str = "33333333-aaaa-4bbb-8ccc-000000000003";

/// Registration (exact), the socket order and mode, prepare of a two-device claim (CDI spec
/// content, IDs), idempotence, a batch with an unknown claim, re-registration after the
/// registration socket is wiped, a restart answered from the checkpoint (claim file and CDI
/// spec gone), unprepare (twice), and the CLI for both calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_restart_unprepare() {
    let mut sb = Sandbox::new("life");
    for n in ["gpu0", "gpu1", "gpu2"] {
        sb.mknod(n);
    }
    sb.write_devices(json!([{
        "name": "gpu",
        "devices": [format!("{}/dev/gpu*", sb.dir.display())],
        "offer": "dra",
        "env": {"GPU_TEST": "1"},
        "mounts": [{"hostPath": sb.dir.join("lib"), "containerPath": "/opt/gpu", "readOnly": true}],
    }]));
    sb.start_and_wait().await;
    let mode = fs::metadata(sb.dra_sock()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "dra.sock mode");

    let info = registration_info(&sb.reg_sock()).await;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(info.endpoint, sb.dra_sock().to_str().unwrap());
    assert_eq!(info.supported_versions, vec!["v1.DRAPlugin".to_string(), "v1alpha1.DRAResourceHealth".to_string()]);

    // Claim A through the CLI: two devices here, one of another driver, one of another node.
    let claim_a = json!({"namespace": "default", "name": "a", "uid": A, "results": [
        result("gpus", DRIVER, NODE, "gpu-gpu0"),
        result("gpus", DRIVER, NODE, "gpu-gpu1"),
        result("gpus", "other.example.com", NODE, "x"),
        result("gpus", DRIVER, "another-node", "gpu-gpu2"),
    ]});
    let file_a = sb.dir.join("claim-a.json");
    fs::write(&file_a, claim_a.to_string()).unwrap();
    let (code, doc) = sb.cli(&["prepare", "--claim-file", file_a.to_str().unwrap()]);
    assert_eq!(code, 0, "{doc}");
    let expected_a = json!({"devices": [
        {"requestNames": ["gpus"], "poolName": NODE, "deviceName": "gpu-gpu0", "cdiDeviceIds": [format!("dra.nodeplane.dev/claim={A}-gpu-gpu0")]},
        {"requestNames": ["gpus"], "poolName": NODE, "deviceName": "gpu-gpu1", "cdiDeviceIds": [format!("dra.nodeplane.dev/claim={A}-gpu-gpu1")]},
    ], "error": ""});
    assert_eq!(doc, json!({"claims": {A: expected_a}}));
    assert!(sb.claim_file(A).exists(), "the CLI writes the claim file");

    // The CDI spec: valid, exactly those two device nodes with the resource's edits.
    let text = fs::read_to_string(sb.cdi_spec(A)).expect("CDI spec of claim A");
    cdi_validate::validate(&text).unwrap_or_else(|e| panic!("CDI spec invalid: {e}\n{text}"));
    let spec: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(spec["kind"], "dra.nodeplane.dev/claim");
    let devs = spec["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 2, "{spec}");
    for (d, node) in devs.iter().zip(["gpu0", "gpu1"]) {
        assert_eq!(d["name"], format!("{A}-gpu-{node}"));
        let nodes = d["containerEdits"]["deviceNodes"].as_array().unwrap();
        assert_eq!(nodes.len(), 1);
        assert_eq!(nodes[0]["path"], sb.dev(node).to_str().unwrap());
        assert_eq!(d["containerEdits"]["env"], json!(["GPU_TEST=1"]));
        assert_eq!(d["containerEdits"]["mounts"][0]["containerPath"], "/opt/gpu");
    }
    let want_a = vec![device(&["gpus"], "gpu-gpu0", A), device(&["gpus"], "gpu-gpu1", A)];

    // A batch as kubelet sends it: A again (same answer), an unknown claim, and B.
    let claim_b = json!({"namespace": "ns2", "name": "b", "uid": B, "results": [
        result("one", DRIVER, NODE, "gpu-gpu2"), result("two", DRIVER, NODE, "gpu-gpu2"),
    ]});
    sb.write_claim(&claim_b);
    let r = sb.prepare(&[("default", "a", A), ("default", "ghost", U), ("ns2", "b", B)]).await;
    assert_eq!(r.len(), 3, "{r:?}");
    assert_eq!(ok_devices(&r, A), want_a);
    assert_eq!(ok_devices(&r, B), vec![device(&["one", "two"], "gpu-gpu2", B)]);
    let ghost = &r[U];
    assert!(
        ghost.error.contains("default/ghost") && ghost.error.contains(U),
        "error names the claim: {:?}",
        ghost.error
    );
    assert!(ghost.devices.is_empty());
    assert!(!sb.cdi_spec(U).exists() && !sb.checkpoint(U).exists());
    assert!(sb.cdi_spec(B).exists() && sb.checkpoint(B).exists());

    // kubelet restart wipes plugins_registry: the registration socket comes back.
    fs::remove_file(sb.reg_sock()).unwrap();
    let reg = sb.reg_sock();
    sb.wait_socket(&reg, Duration::from_secs(2)).await;
    assert_eq!(registration_info(&sb.reg_sock()).await.endpoint, sb.dra_sock().to_str().unwrap());

    // Agent restart, with A's claim file and CDI spec gone: the checkpoint answers.
    sb.stop_agent().await;
    fs::remove_file(sb.claim_file(A)).unwrap();
    fs::remove_file(sb.cdi_spec(A)).unwrap();
    sb.start_and_wait().await;
    let r = sb.prepare(&[("default", "a", A)]).await;
    assert_eq!(ok_devices(&r, A), want_a);
    assert_eq!(fs::read_to_string(sb.cdi_spec(A)).expect("CDI spec written again"), text);

    // Unprepare A through the CLI, then again: success both times; spec and checkpoint gone.
    sb.write_claim(&claim_a);
    for _ in 0..2 {
        let (code, doc) = sb.cli(&["unprepare", "--uid", A, "--namespace", "default", "--name", "a"]);
        assert_eq!(code, 0, "{doc}");
        assert_eq!(doc, json!({"claims": {A: {"error": ""}}}));
    }
    assert!(!sb.cdi_spec(A).exists() && !sb.checkpoint(A).exists() && !sb.claim_file(A).exists());
    // B and the never-prepared claim in one call, twice: every entry, all empty errors.
    for _ in 0..2 {
        let r = sb.unprepare(&[("ns2", "b", B), ("default", "ghost", U), ("default", "a", A)]).await;
        assert_eq!(r.keys().cloned().collect::<Vec<_>>(), vec![A.to_string(), B.to_string(), U.to_string()]);
        assert!(r.values().all(|e| e.error.is_empty()), "{r:?}");
    }
    assert!(!sb.cdi_spec(B).exists() && !sb.checkpoint(B).exists());
    sb.stop_agent().await;
}

/// Health: NodeWatchResources lists every DRA device healthy at once, reports a removed
/// device node unhealthy within a few seconds, and prepare refuses it. Offer: a resource
/// offered through DRA gets no device plugin socket; a device node also matched by a
/// device plugin resource is not a DRA device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_offer() {
    let mut sb = Sandbox::new("health");
    for n in ["dp0", "acc0", "acc1"] {
        sb.mknod(n);
    }
    let dev = sb.dir.join("dev");
    sb.write_devices(json!([
        {"name": "plain", "devices": [format!("{}/dp*", dev.display())]},
        {"name": "acc", "devices": [format!("{}/acc*", dev.display())], "offer": "dra"},
        {"name": "shared", "devices": [format!("{}/dp*", dev.display())], "offer": "dra"},
    ]));
    sb.start_and_wait().await;
    let dp_dir = sb.kubelet().join("device-plugins");
    let plain = dp_dir.join("nodeplane-plain.sock");
    sb.wait_socket(&plain, STARTUP).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    for name in ["acc", "shared"] {
        assert!(
            !dp_dir.join(format!("nodeplane-{name}.sock")).exists(),
            "resource {name} offered through DRA is served as a device plugin"
        );
    }

    let ch = nodeplane::rpc::connect_unix(&sb.dra_sock()).await.unwrap();
    let mut health = hpb::dra_resource_health_client::DraResourceHealthClient::new(ch);
    let mut stream = health.node_watch_resources(hpb::NodeWatchResourcesRequest {}).await.unwrap().into_inner();
    let states = |m: &hpb::NodeWatchResourcesResponse| -> BTreeMap<String, i32> {
        m.devices.iter().map(|d| (d.device.as_ref().unwrap().device_name.clone(), d.health)).collect()
    };
    let first = tokio::time::timeout(Duration::from_secs(2), stream.message())
        .await
        .expect("first list at once")
        .unwrap()
        .unwrap();
    let healthy = hpb::HealthStatus::Healthy as i32;
    let unhealthy = hpb::HealthStatus::Unhealthy as i32;
    assert_eq!(states(&first), BTreeMap::from([("acc-acc0".to_string(), healthy), ("acc-acc1".to_string(), healthy)]));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    for d in &first.devices {
        assert_eq!(d.device.as_ref().unwrap().pool_name, NODE);
        assert_eq!(d.health_check_timeout_seconds, 30);
        assert!((d.last_updated_time - now).abs() <= 60, "last_updated_time {} vs now {now}", d.last_updated_time);
    }

    fs::remove_file(sb.dev("acc1")).unwrap();
    let started = Instant::now();
    loop {
        let left = Duration::from_secs(5).saturating_sub(started.elapsed());
        let m = tokio::time::timeout(left, stream.message())
            .await
            .unwrap_or_else(|_| panic!("acc-acc1 not reported unhealthy within 5 s:\n{}", sb.log()))
            .unwrap()
            .expect("stream open");
        let s = states(&m);
        if s.get("acc-acc1") == Some(&unhealthy) {
            assert_eq!(s.get("acc-acc0"), Some(&healthy));
            break;
        }
    }

    // Readiness: every device plugin resource is served (the DRA ones are not waited for),
    // and the DRA sockets answer.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = Command::new(CLI).args(["status", "--json", "--config"]).arg(sb.config()).output().unwrap();
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let ready = |name: &str| {
            doc["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["name"] == name)
                .map(|c| (c["ready"].as_bool(), c["detail"].clone()))
        };
        let (dp, dra) = (ready("deviceplugins"), ready("dra"));
        if dp.as_ref().is_some_and(|c| c.0 == Some(true)) && dra.as_ref().is_some_and(|c| c.0 == Some(true)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "conditions deviceplugins {dp:?}, dra {dra:?} not ready within 5 s:\n{}",
            sb.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let uid = "44444444-aaaa-4bbb-8ccc-000000000004";
    let gone = "55555555-aaaa-4bbb-8ccc-000000000005";
    sb.write_claim(
        &json!({"namespace": "n", "name": "sick", "uid": uid, "results": [result("r", DRIVER, NODE, "acc-acc1")]}),
    );
    sb.write_claim(
        &json!({"namespace": "n", "name": "nope", "uid": gone, "results": [result("r", DRIVER, NODE, "shared-dp0")]}),
    );
    let r = sb.prepare(&[("n", "sick", uid), ("n", "nope", gone)]).await;
    assert!(r[uid].error.contains("unhealthy") && r[uid].error.contains("acc-acc1"), "{:?}", r[uid].error);
    assert!(r[gone].error.contains("does not exist") && r[gone].error.contains("shared-dp0"), "{:?}", r[gone].error);
    assert!(!sb.cdi_spec(uid).exists() && !sb.cdi_spec(gone).exists());
    drop(stream);
    sb.stop_agent().await;
}

/// The kubelet emulator's DRA side: registration (versions read, endpoint dialed), prepare
/// and unprepare through it, health heard on its NodeWatchResources stream; a kubelet
/// restart (a new instance that knows nothing) re-registers within 1 s, also when the
/// restart wiped the registration socket; a removed device node reaches the new kubelet as
/// unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_emulator_registers_prepares_hears_health_and_re_registers_after_restart() {
    let mut sb = Sandbox::new("kubelet");
    for n in ["acc0", "acc1"] {
        sb.mknod(n);
    }
    sb.write_devices(json!([{"name": "acc", "devices": [format!("{}/dev/acc*", sb.dir.display())], "offer": "dra"}]));
    sb.start_and_wait().await;
    let mut kubelet = kubelet_dra::DraKubelet::new(&sb.kubelet());
    kubelet.start();
    let r = kubelet.wait_registered(DRIVER, Duration::from_secs(2)).await.unwrap();
    assert_eq!(r.versions, [kubelet_dra::DRA_V1, kubelet_dra::HEALTH_V1ALPHA1]);
    assert_eq!(r.endpoint, sb.dra_sock());
    let healthy = hpb::HealthStatus::Healthy as i32;
    let unhealthy = hpb::HealthStatus::Unhealthy as i32;
    let deadline = Instant::now() + Duration::from_secs(3);
    while kubelet.health(DRIVER).values().filter(|h| h.0 == healthy).count() != 2 {
        assert!(Instant::now() < deadline, "kubelet heard {:?}", kubelet.health(DRIVER));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sb.write_claim(
        &json!({"namespace": "ns", "name": "c", "uid": A, "results": [result("r", DRIVER, NODE, "acc-acc0")]}),
    );
    let got = kubelet.prepare(DRIVER, &[("ns", "c", A)]).await.unwrap();
    assert_eq!(ok_devices(&got, A), vec![device(&["r"], "acc-acc0", A)]);
    cdi_validate::validate(&fs::read_to_string(sb.cdi_spec(A)).unwrap()).unwrap();

    // Restart without touching the socket, then a restart that wipes plugins_registry.
    for wipe in [false, true] {
        kubelet.stop();
        if wipe {
            fs::remove_file(sb.reg_sock()).unwrap();
        }
        let t = Instant::now();
        kubelet.start();
        let r = kubelet
            .wait_registered(DRIVER, Duration::from_secs(1))
            .await
            .unwrap_or_else(|e| panic!("wipe={wipe}: {e}\n{}", sb.log()));
        eprintln!("kubelet restart (wipe={wipe}) -> registered again in {:?}", r.at - t);
        assert!(kubelet.failures().is_empty(), "{:?}", kubelet.failures());
    }
    // The restarted kubelet prepares again (same answer) and hears health.
    let again = kubelet.prepare(DRIVER, &[("ns", "c", A)]).await.unwrap();
    assert_eq!(ok_devices(&again, A), ok_devices(&got, A));
    fs::remove_file(sb.dev("acc1")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while kubelet.health(DRIVER).get("acc-acc1").map(|h| h.0) != Some(unhealthy) {
        assert!(Instant::now() < deadline, "kubelet heard {:?}:\n{}", kubelet.health(DRIVER), sb.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(kubelet.health(DRIVER).get("acc-acc0").map(|h| h.0), Some(healthy));
    for _ in 0..2 {
        let u = kubelet.unprepare(DRIVER, &[("ns", "c", A)]).await.unwrap();
        assert_eq!(u[A].error, "");
    }
    assert!(!sb.cdi_spec(A).exists() && !sb.checkpoint(A).exists());
    kubelet.stop();
    sb.stop_agent().await;
}

/// Controller mode: the agent reports its DRA devices and the controller publishes them as
/// the node's ResourceSlice pool (local mode: files in its data dir) with the attributes;
/// a device node plugged in reaches the pool within 1 s, one removed leaves it; an unknown
/// claim (no claim file) is asked of the controller, whose answer the error carries; the
/// node's removal deletes its pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_reach_the_controllers_slices_and_follow_hot_plug() {
    let mut sb = Sandbox::new("slices");
    for n in ["acc0", "acc1"] {
        sb.mknod(n);
    }
    sb.write_devices(json!([{"name": "acc", "devices": [format!("{}/dev/acc*", sb.dir.display())], "offer": "dra", "vendor": "acme", "model": "a1"}]));
    sb.start_controller();
    sb.start_and_wait().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while sb.pool_devices() != ["acc-acc0", "acc-acc1"] {
        assert!(
            Instant::now() < deadline,
            "pool {:?} not published:\n{}\ncontroller:\n{}",
            sb.pool_devices(),
            sb.log(),
            fs::read_to_string(sb.dir.join("ctl/controller.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let slices = sb.slices();
    assert_eq!(slices.len(), 1, "{slices:?}");
    let s = &slices[&format!("{NODE}-dra.nodeplane.dev-0")];
    assert_eq!(s["apiVersion"], "resource.k8s.io/v1");
    assert_eq!(s["kind"], "ResourceSlice");
    assert_eq!(s["spec"]["driver"], DRIVER);
    assert_eq!(s["spec"]["pool"]["name"], NODE);
    assert_eq!(s["spec"]["pool"]["resourceSliceCount"], 1);
    let gen1 = s["spec"]["pool"]["generation"].as_i64().unwrap();
    let attrs = &s["spec"]["devices"][0]["attributes"];
    assert_eq!(attrs["resource"], json!({"string": "acc"}));
    assert_eq!(attrs["path"], json!({"string": sb.dev("acc0").to_str().unwrap()}));
    assert_eq!(attrs["vendor"], json!({"string": "acme"}));
    assert_eq!(attrs["model"], json!({"string": "a1"}));
    assert_eq!(attrs["driverVersion"], json!({"version": env!("CARGO_PKG_VERSION")}));

    // Hot-plug: in the pool within 1 s.
    let t = Instant::now();
    sb.mknod("acc2");
    while !sb.pool_devices().contains(&"acc-acc2".to_string()) {
        assert!(t.elapsed() < Duration::from_secs(1), "acc-acc2 not in the pool within 1 s: {:?}", sb.pool_devices());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!("device node created -> ResourceSlice updated: {:?}", t.elapsed());
    let s = &sb.slices()[&format!("{NODE}-dra.nodeplane.dev-0")];
    assert!(s["spec"]["pool"]["generation"].as_i64().unwrap() > gen1);
    // Removed: it leaves the pool (the health stream says unhealthy; the scheduler must not
    // pick it).
    fs::remove_file(sb.dev("acc1")).unwrap();
    let t = Instant::now();
    while sb.pool_devices().contains(&"acc-acc1".to_string()) {
        assert!(t.elapsed() < Duration::from_secs(1), "acc-acc1 still in the pool after 1 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(sb.pool_devices(), ["acc-acc0", "acc-acc2"]);

    // No claim file: the controller is asked; in local mode it has no claims, and says so.
    let r = sb.prepare(&[("ns", "remote", U)]).await;
    let e = &r[U].error;
    assert!(e.contains("ns/remote") && e.contains("controller") && e.contains("local mode"), "{e}");
    assert!(!sb.cdi_spec(U).exists());

    // The node leaves the cluster: its pool goes.
    sb.stop_agent().await;
    let admin = sb.dir.join("ctl/admin.token");
    let out = Command::new(CONTROLLER)
        .args(["token", "--config"])
        .arg(sb.controller_config())
        .arg("@admin")
        .output()
        .unwrap();
    fs::write(&admin, &out.stdout).unwrap();
    let out = Command::new(CONTROLLER)
        .args(["remove-node", "--controller"])
        .arg(format!("unix:{}", sb.dir.join("ctl/controller.sock").display()))
        .arg("--token-file")
        .arg(&admin)
        .arg(NODE)
        .output()
        .unwrap();
    assert!(out.status.success(), "remove-node: {}", String::from_utf8_lossy(&out.stderr));
    let t = Instant::now();
    while !sb.slices().is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "slices left after the node was removed: {:?}",
            sb.slices().keys()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
