//! Root-only: the agent's device plugins, driven over their real sockets by a kubelet
//! device-manager emulator (`tools/support/kubelet_devices.rs`), with real device nodes.
//!
//! Each test runs its own agent (`nodeplane-agent` in a private network namespace made by
//! `unshare --net`) with its whole tree — kubelet dir, state, devices file, CDI dir, device
//! nodes — in a sandbox directory `/tmp/npdp-<pid>-<test>` (short: Unix socket paths are
//! limited to 108 bytes). The emulator is started before the agent (kubelet is there first)
//! except where a test says otherwise; registration with the emulator is the only readiness
//! signal the agent gives for device plugins. The sandbox guard, dropped also when a test
//! panics, kills that agent by PID and removes the sandbox.
//!
//! Device nodes are made with `mknod` (character devices with /dev/null's numbers, so
//! opening them works) in `<sandbox>/dev/`.
//!
//! These tests need root and FAIL (never skip) without it.

use crate::kubelet_emulator;

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kubelet_emulator::{HEALTHY, KubeletEmulator, Resource, UNHEALTHY};
use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nodeplane::rpc::deviceplugin as dp;
use serde_json::{Value, json};
use tonic::Code;

const AGENT: &str = env!("CARGO_BIN_EXE_nodeplane-agent");
/// The resource of the default entry ("testdev").
const RES: &str = "nodeplane.dev/testdev";
/// How long an agent may take from start to a first registration.
const STARTUP: Duration = Duration::from_secs(20);
/// A bound for changes the contract gives no time for (health flips, reloads).
const SLOW: Duration = Duration::from_secs(10);

fn require_root() {
    assert_eq!(
        nix::unistd::geteuid().as_raw(),
        0,
        "tests/deviceplugin_root.rs needs root (it runs the agent in a network namespace and makes device nodes). It does not skip."
    );
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("unshare").is_file()))
        .unwrap_or(false)
        || ["/usr/bin", "/bin", "/usr/sbin"].iter().any(|d| Path::new(d).join("unshare").is_file());
    assert!(found, "required tool \"unshare\" is not installed (Debian: util-linux)");
}

fn strs(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| s.to_string()).collect()
}

// ----- sandbox, agent, emulator -----

struct Sandbox {
    dir: PathBuf,
    agent: Option<Child>,
    kl: KubeletEmulator,
}

impl Sandbox {
    fn new(name: &str) -> Sandbox {
        require_root();
        // Short: socket paths (<kubelet>/device-plugins/nodeplane-<name>.sock) must fit in
        // 108 bytes, so not under the (arbitrarily deep) cargo target dir.
        let dir = PathBuf::from("/tmp").join(format!("npdp-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let dir = dir.canonicalize().unwrap();
        for d in ["dev", "lib", "cdi"] {
            fs::create_dir_all(dir.join(d)).unwrap();
        }
        fs::write(dir.join("lib/libtestdev.so"), b"not really a library").unwrap();
        let cfg = json!({
            "nodeName": format!("dp-{name}"),
            "root": dir.join("root"),
            "shimSource": crate::shim(),
            "csi": {"enabled": false},
            "devicePlugins": {"configFile": dir.join("devices.json"), "cdiDir": dir.join("cdi")},
        });
        fs::write(dir.join("agent.json"), serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
        let kl = KubeletEmulator::new(&dir.join("root/var/lib/kubelet"));
        Sandbox { dir, agent: None, kl }
    }

    fn dp_dir(&self) -> PathBuf {
        self.dir.join("root/var/lib/kubelet/device-plugins")
    }
    /// The plugin socket of entry `name`.
    fn sock(&self, name: &str) -> PathBuf {
        self.dp_dir().join(format!("nodeplane-{name}.sock"))
    }
    /// The CDI spec of entry `name`.
    fn cdi_file(&self, name: &str) -> PathBuf {
        self.dir.join(format!("cdi/nodeplane.dev-{name}.json"))
    }
    /// A device node path in the sandbox.
    fn dev(&self, node: &str) -> PathBuf {
        self.dir.join("dev").join(node)
    }
    fn dev_str(&self, node: &str) -> String {
        self.dev(node).to_string_lossy().into_owned()
    }
    fn log(&self) -> String {
        fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    fn mknod(&self, node: &str) {
        mknod(&self.dev(node), SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 3))
            .unwrap_or_else(|e| panic!("mknod {}: {e}", self.dev(node).display()));
    }
    fn unlink(&self, node: &str) {
        fs::remove_file(self.dev(node)).unwrap_or_else(|e| panic!("unlink {}: {e}", self.dev(node).display()));
    }

    /// The default entry: `testdev`, every `<sandbox>/dev/testdev[0-9]*`, with mounts, env,
    /// CDI and PreStart.
    fn testdev(&self, share: u32) -> Value {
        json!({
            "name": "testdev",
            "devices": [format!("{}/dev/testdev[0-9]*", self.dir.display())],
            "share": share,
            "permissions": "rw",
            "mounts": [{"hostPath": self.dir.join("lib"), "containerPath": "/usr/lib/testdev", "readOnly": true}],
            "env": {"TESTDEV_MODE": "fast"},
            "cdi": true,
            "preStart": true,
        })
    }

    /// Write the devices file atomically (temp file + rename), as a config manager would.
    fn write_devices(&self, resources: Vec<Value>) {
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
            .arg(self.dir.join("agent.json"))
            .env("RUST_LOG", "info")
            .env_remove("NODEPLANE_CRASH_AT")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        self.agent = Some(cmd.spawn().expect("starting the agent"));
    }

    /// Panics (with the log) if the agent has exited.
    fn assert_alive(&mut self) {
        if let Some(c) = self.agent.as_mut()
            && let Some(st) = c.try_wait().unwrap()
        {
            panic!("the agent exited ({st}):\n{}\n{}", self.kl.describe(), self.log());
        }
    }

    /// Wait until `pred` holds for `resource`, up to `timeout`; panics with what kubelet
    /// knows and the agent log otherwise (or as soon as the agent dies).
    async fn wait(
        &mut self,
        resource: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&Resource) -> bool,
    ) -> Resource {
        let deadline = Instant::now() + timeout;
        loop {
            let slice = deadline.saturating_duration_since(Instant::now()).min(Duration::from_millis(200));
            match self.kl.wait_for(resource, slice, &pred).await {
                Ok(r) => return r,
                Err(state) => {
                    self.assert_alive();
                    if Instant::now() >= deadline {
                        panic!("{what}: not within {timeout:?}\n{state}\nagent log:\n{}", self.log());
                    }
                }
            }
        }
    }

    /// Wait for `resource`'s registration number `n` and its first list.
    async fn registered(&mut self, resource: &str, n: u32, timeout: Duration) -> Resource {
        self.wait(resource, timeout, &format!("registration #{n} of {resource} with its first list"), |r| {
            r.registrations >= n && r.messages_this_registration >= 1
        })
        .await
    }

    /// SIGTERM; the agent must exit cleanly.
    async fn stop(&mut self) {
        if let Some(mut c) = self.agent.take() {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM)
                .unwrap();
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
        }
        self.kl.stop().await;
    }

    /// Emulator-side sanity every test ends with: no refused registration, no protocol error.
    fn assert_kubelet_happy(&self) {
        assert!(
            self.kl.failures().is_empty(),
            "kubelet refused registrations:\n{}\n{}",
            self.kl.describe(),
            self.log()
        );
        for (name, r) in self.kl.resources() {
            assert!(r.protocol_errors.is_empty(), "{name}: protocol errors {:?}\n{}", r.protocol_errors, self.log());
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

// ----- checks -----

/// (container_path, host_path, permissions), sorted.
fn specs(c: &dp::ContainerAllocateResponse) -> Vec<(String, String, String)> {
    let mut v: Vec<_> =
        c.devices.iter().map(|d| (d.container_path.clone(), d.host_path.clone(), d.permissions.clone())).collect();
    v.sort();
    v
}

fn cdi_names(c: &dp::ContainerAllocateResponse) -> Vec<String> {
    let mut v: Vec<String> = c.cdi_devices.iter().map(|d| d.name.clone()).collect();
    v.sort();
    v
}

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// The CDI spec of `name`: parses, has a string cdiVersion, kind `nodeplane.dev/<name>`, and
/// exactly the devices `expected` (device name, host node path), each with its node as
/// `containerEdits.deviceNodes[0].path`. Returns the device names.
fn check_cdi(sb: &Sandbox, name: &str, expected: &[(&str, PathBuf)]) -> BTreeSet<String> {
    let path = sb.cdi_file(name);
    let text =
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading CDI spec {}: {e}\n{}", path.display(), sb.log()));
    let spec: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("CDI spec {} is not JSON ({e}):\n{text}", path.display()));
    assert!(spec["cdiVersion"].is_string(), "CDI spec {}: cdiVersion is not a string:\n{text}", path.display());
    assert_eq!(spec["kind"], json!(format!("nodeplane.dev/{name}")), "CDI spec {}: kind:\n{text}", path.display());
    let devices =
        spec["devices"].as_array().unwrap_or_else(|| panic!("CDI spec {}: no devices list:\n{text}", path.display()));
    let mut got = BTreeSet::new();
    for d in devices {
        let n = d["name"]
            .as_str()
            .unwrap_or_else(|| panic!("CDI spec {}: a device without a name:\n{text}", path.display()));
        let node = d["containerEdits"]["deviceNodes"][0]["path"].as_str().unwrap_or_else(|| {
            panic!("CDI spec {}: device {n:?} has no containerEdits.deviceNodes[0].path:\n{text}", path.display())
        });
        let want = expected.iter().find(|(e, _)| *e == n).unwrap_or_else(|| {
            panic!("CDI spec {}: unexpected device {n:?} (expected {expected:?}):\n{text}", path.display())
        });
        assert_eq!(Path::new(node), want.1, "CDI spec {}: device {n:?} node path:\n{text}", path.display());
        assert!(got.insert(n.to_string()), "CDI spec {}: device {n:?} twice:\n{text}", path.display());
    }
    let want: BTreeSet<String> = expected.iter().map(|(n, _)| n.to_string()).collect();
    assert_eq!(got, want, "CDI spec {}: device names:\n{text}", path.display());
    got
}

/// Every CDI name of an Allocate answer is `nodeplane.dev/<name>=<device>` with the device
/// in the spec file.
fn check_cdi_refs(sb: &Sandbox, name: &str, c: &dp::ContainerAllocateResponse) {
    let path = sb.cdi_file(name);
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading CDI spec {}: {e}", path.display()));
    let spec: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("CDI spec {} is not JSON ({e})", path.display()));
    let in_file: BTreeSet<&str> =
        spec["devices"].as_array().into_iter().flatten().filter_map(|d| d["name"].as_str()).collect();
    for d in &c.cdi_devices {
        let (kind, dev) = d.name.split_once('=').unwrap_or_else(|| panic!("CDI name {:?} has no '='", d.name));
        assert_eq!(kind, format!("nodeplane.dev/{name}"), "CDI name {:?}", d.name);
        assert!(
            in_file.contains(dev),
            "Allocate names CDI device {dev:?}, the spec {} has {in_file:?}",
            path.display()
        );
    }
}

/// The agent log has an error line naming entry `idx` (by index or by `name`).
fn log_reports(log: &str, idx: usize, name: &str) -> bool {
    // Precise forms only: "devices[0]" in an error about another entry must not count.
    let index_forms = [
        format!("resources[{idx}]"),
        format!("resource[{idx}]"),
        format!("entries[{idx}]"),
        format!("entry[{idx}]"),
        format!("index {idx}"),
        format!("index={idx}"),
        format!("index: {idx}"),
        format!("\"index\":{idx}"),
        format!("entry {idx}"),
        format!("entry={idx}"),
        format!("entry #{idx}"),
        format!("resource {idx}"),
        format!("resource={idx}"),
        format!("resources.{idx}"),
        format!("idx={idx}"),
        format!("resource #{idx}"),
    ];
    log.lines().any(|l| {
        let lower = l.to_lowercase();
        (lower.contains("error") || lower.contains("warn") || lower.contains("invalid"))
            && (l.contains(name) || index_forms.iter().any(|f| l.contains(f.as_str())))
    })
}

fn assert_socket_0600(p: &Path, log: &str) {
    let md = fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}\n{log}", p.display()));
    assert!(md.file_type().is_socket(), "{} is not a socket", p.display());
    assert_eq!(md.permissions().mode() & 0o7777, 0o600, "{} mode {:o}", p.display(), md.permissions().mode() & 0o7777);
}

fn ids_of(list: &[kubelet_emulator::DeviceInfo]) -> BTreeSet<String> {
    list.iter().map(|d| d.id.clone()).collect()
}

// ----- registration and listing -----

/// Registration request, options, socket and the first list; only matching device nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_and_lists_matching_device_nodes() {
    let mut sb = Sandbox::new("basic");
    sb.mknod("testdev0");
    sb.mknod("testdev1");
    sb.mknod("other0"); // a device node the glob does not match
    fs::write(sb.dev("testdev5"), b"a regular file").unwrap(); // matches, not a device node
    fs::create_dir(sb.dev("testdev6")).unwrap(); // matches, not a device node
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    let r = sb.registered(RES, 1, STARTUP).await;

    assert_eq!(r.version, "v1beta1");
    assert_eq!(r.endpoint, "nodeplane-testdev.sock");
    assert_eq!(r.socket, sb.sock("testdev"));
    let want = dp::DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true };
    assert_eq!(r.options, Some(want), "RegisterRequest.options");
    assert_eq!(r.served_options, want, "GetDevicePluginOptions");
    assert_socket_0600(&sb.sock("testdev"), &sb.log());

    // The full list at once.
    let (_, _, first) = &r.history[0];
    assert_eq!(ids_of(first), BTreeSet::from(["testdev0".to_string(), "testdev1".to_string()]), "first list {first:?}");
    assert!(first.iter().all(|d| d.health == HEALTHY), "first list {first:?}");
    assert_eq!((r.capacity(), r.allocatable()), (2, 2));
    assert!(r.streaming, "the ListAndWatch stream ended: {:?}", r.stream_end);
    assert_eq!(r.registrations, 1);
    sb.assert_kubelet_happy();
    sb.stop().await;
}

/// Unlink → Unhealthy (still listed), mknod again → Healthy, a new node → listed within 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_device_nodes_and_new_nodes_appear_within_1s() {
    let mut sb = Sandbox::new("health");
    sb.mknod("testdev0");
    sb.mknod("testdev1");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;

    sb.unlink("testdev1");
    let r = sb.wait(RES, SLOW, "testdev1 Unhealthy after unlink", |r| r.has("testdev1", UNHEALTHY)).await;
    assert!(r.has("testdev0", HEALTHY), "{:?}", r.devices);
    assert_eq!(r.ids(), strs(&["testdev0", "testdev1"]), "an unlinked node stays listed");
    assert_eq!((r.capacity(), r.allocatable()), (2, 1));

    sb.mknod("testdev1");
    let r = sb.wait(RES, SLOW, "testdev1 Healthy after mknod", |r| r.has("testdev1", HEALTHY)).await;
    assert_eq!((r.capacity(), r.allocatable()), (2, 2));

    let t0 = Instant::now();
    sb.mknod("testdev7");
    let r = sb.wait(RES, SLOW, "new node testdev7 listed", |r| r.has("testdev7", HEALTHY)).await;
    let arrived = r
        .history
        .iter()
        .find(|(_, _, l)| l.iter().any(|d| d.id == "testdev7"))
        .map(|(t, _, _)| *t)
        .expect("a list with testdev7 (just waited for it)");
    let took = arrived.saturating_duration_since(t0);
    assert!(took <= Duration::from_secs(1), "testdev7 was listed {took:?} after mknod (limit 1 s)\n{}", sb.log());
    assert_eq!(r.ids(), strs(&["testdev0", "testdev1", "testdev7"]));

    // Every message was a full list: nothing known ever went missing from one.
    let mut known = BTreeSet::new();
    for (i, (_, _, list)) in r.history.iter().enumerate() {
        let ids = ids_of(list);
        assert!(known.is_subset(&ids), "list #{i} {ids:?} lacks some of {known:?} (ListAndWatch must send full lists)");
        known = ids;
    }
    assert!(r.history.len() >= 4, "one list per change expected, got {:?}", r.history);

    // The new device is usable, and its CDI device is in the spec.
    let a = sb.kl.allocate(RES, vec![strs(&["testdev7"])]).await.unwrap_or_else(|e| panic!("Allocate testdev7: {e}"));
    let c = &a.container_responses[0];
    assert_eq!(cdi_names(c), strs(&["nodeplane.dev/testdev=testdev7"]));
    check_cdi_refs(&sb, "testdev", c);
    sb.assert_kubelet_happy();
    sb.stop().await;
}

// ----- Allocate, PreStartContainer, GetPreferredAllocation -----

/// Allocate per container: device specs, the entry's mounts and env, the ids env, CDI names
/// that the CDI spec file defines; preferred allocation honours size and must_include.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_returns_specs_mounts_envs_and_cdi_devices() {
    let mut sb = Sandbox::new("alloc");
    sb.mknod("testdev0");
    sb.mknod("testdev1");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;

    // The CDI spec: one device per node.
    check_cdi(&sb, "testdev", &[("testdev0", sb.dev("testdev0")), ("testdev1", sb.dev("testdev1"))]);

    let a = sb
        .kl
        .allocate(RES, vec![strs(&["testdev1"]), strs(&["testdev1", "testdev0"])])
        .await
        .unwrap_or_else(|e| panic!("Allocate: {e}\n{}", sb.log()));
    assert_eq!(a.container_responses.len(), 2, "one response per container request: {a:?}");
    let (d0, d1) = (sb.dev_str("testdev0"), sb.dev_str("testdev1"));
    let mounts = vec![dp::Mount {
        container_path: "/usr/lib/testdev".into(),
        host_path: sb.dir.join("lib").to_string_lossy().into_owned(),
        read_only: true,
    }];

    let c = &a.container_responses[0];
    assert_eq!(specs(c), vec![(d1.clone(), d1.clone(), "rw".to_string())], "container 0 devices");
    assert_eq!(c.mounts, mounts, "container 0 mounts");
    assert_eq!(c.envs, env(&[("TESTDEV_MODE", "fast"), ("NODEPLANE_DEVICES_TESTDEV", "testdev1")]), "container 0 envs");
    assert_eq!(cdi_names(c), strs(&["nodeplane.dev/testdev=testdev1"]), "container 0 CDI devices");
    assert!(c.annotations.is_empty(), "container 0 annotations {:?}", c.annotations);
    check_cdi_refs(&sb, "testdev", c);

    let c = &a.container_responses[1];
    assert_eq!(
        specs(c),
        vec![(d0.clone(), d0.clone(), "rw".to_string()), (d1.clone(), d1.clone(), "rw".to_string())],
        "container 1 devices"
    );
    assert_eq!(c.mounts, mounts, "container 1 mounts");
    assert_eq!(
        c.envs,
        env(&[("TESTDEV_MODE", "fast"), ("NODEPLANE_DEVICES_TESTDEV", "testdev1,testdev0")]),
        "container 1 envs (ids joined in request order)"
    );
    assert_eq!(cdi_names(c), strs(&["nodeplane.dev/testdev=testdev0", "nodeplane.dev/testdev=testdev1"]));
    assert!(c.annotations.is_empty(), "container 1 annotations {:?}", c.annotations);
    check_cdi_refs(&sb, "testdev", c);

    // PreStartContainer on healthy devices.
    sb.kl.pre_start(RES, strs(&["testdev0", "testdev1"])).await.unwrap_or_else(|e| panic!("PreStartContainer: {e}"));

    // GetPreferredAllocation (no sharing).
    let all = strs(&["testdev0", "testdev1"]);
    for (must, size) in [(vec![], 1), (strs(&["testdev1"]), 1), (strs(&["testdev0"]), 2), (vec![], 2)] {
        let got = sb
            .kl
            .preferred(RES, all.clone(), must.clone(), size)
            .await
            .unwrap_or_else(|e| panic!("GetPreferredAllocation must {must:?} size {size}: {e}"));
        assert_eq!(got.len(), size as usize, "must {must:?} size {size}: got {got:?}");
        assert_eq!(got.iter().collect::<BTreeSet<_>>().len(), got.len(), "duplicates in {got:?}");
        assert!(got.iter().all(|id| all.contains(id)), "{got:?} not all from {all:?}");
        assert!(must.iter().all(|id| got.contains(id)), "{got:?} lacks some of must_include {must:?}");
    }
    sb.assert_kubelet_happy();
    sb.stop().await;
}

/// Unknown ids → InvalidArgument, Unhealthy ids → FailedPrecondition, naming the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_and_pre_start_reject_unknown_and_unhealthy_ids() {
    let mut sb = Sandbox::new("reject");
    sb.mknod("testdev0");
    sb.mknod("testdev1");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;

    for req in [vec![strs(&["nope9"])], vec![strs(&["testdev0"]), strs(&["testdev1", "nope9"])]] {
        let e = sb.kl.allocate(RES, req.clone()).await.expect_err(&format!("Allocate {req:?} must fail"));
        assert_eq!(e.code(), Code::InvalidArgument, "Allocate {req:?}: {e}");
        assert!(e.message().contains("nope9"), "Allocate {req:?}: the message does not name the id: {e}");
    }
    let e = sb.kl.pre_start(RES, strs(&["testdev0", "nope9"])).await.expect_err("PreStartContainer of an unknown id");
    assert_eq!(e.code(), Code::InvalidArgument, "PreStartContainer unknown: {e}");
    sb.kl.pre_start(RES, strs(&["testdev0"])).await.unwrap_or_else(|e| panic!("PreStartContainer testdev0: {e}"));

    sb.unlink("testdev1");
    sb.wait(RES, SLOW, "testdev1 Unhealthy after unlink", |r| r.has("testdev1", UNHEALTHY)).await;
    let e = sb.kl.allocate(RES, vec![strs(&["testdev1"])]).await.expect_err("Allocate of an Unhealthy device");
    assert_eq!(e.code(), Code::FailedPrecondition, "Allocate Unhealthy: {e}");
    assert!(e.message().contains("testdev1"), "the message does not name the id: {e}");
    // The healthy one still allocates.
    sb.kl.allocate(RES, vec![strs(&["testdev0"])]).await.unwrap_or_else(|e| panic!("Allocate testdev0: {e}"));
    sb.assert_kubelet_happy();
    sb.stop().await;
}

/// share 3 over two nodes: 6 ids `<node>-<k>`, per-node specs and CDI names, health per
/// node, preferred allocation spreads over physical devices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_devices_list_k_suffixed_ids_and_preferred_spreads() {
    let mut sb = Sandbox::new("shared");
    sb.mknod("testdev0");
    sb.mknod("testdev1");
    let mut entry = sb.testdev(3);
    entry["permissions"] = json!("rwm");
    sb.write_devices(vec![entry]);
    sb.kl.start().await;
    sb.start_agent();
    let r = sb.registered(RES, 1, STARTUP).await;
    let six = strs(&["testdev0-0", "testdev0-1", "testdev0-2", "testdev1-0", "testdev1-1", "testdev1-2"]);
    assert_eq!(r.ids(), six);
    assert!(r.devices.iter().all(|d| d.health == HEALTHY), "{:?}", r.devices);
    assert_eq!((r.capacity(), r.allocatable()), (6, 6));
    // CDI devices are the physical ones.
    check_cdi(&sb, "testdev", &[("testdev0", sb.dev("testdev0")), ("testdev1", sb.dev("testdev1"))]);

    let (d0, d1) = (sb.dev_str("testdev0"), sb.dev_str("testdev1"));
    let a = sb
        .kl
        .allocate(RES, vec![strs(&["testdev0-0", "testdev0-2"]), strs(&["testdev1-1", "testdev0-1"])])
        .await
        .unwrap_or_else(|e| panic!("Allocate: {e}\n{}", sb.log()));
    assert_eq!(a.container_responses.len(), 2);
    let c = &a.container_responses[0];
    assert_eq!(specs(c), vec![(d0.clone(), d0.clone(), "rwm".to_string())], "one spec per distinct node");
    assert_eq!(c.envs, env(&[("TESTDEV_MODE", "fast"), ("NODEPLANE_DEVICES_TESTDEV", "testdev0-0,testdev0-2")]));
    assert_eq!(cdi_names(c), strs(&["nodeplane.dev/testdev=testdev0"]));
    check_cdi_refs(&sb, "testdev", c);
    let c = &a.container_responses[1];
    assert_eq!(
        specs(c),
        vec![(d0.clone(), d0.clone(), "rwm".to_string()), (d1.clone(), d1.clone(), "rwm".to_string())]
    );
    assert_eq!(c.envs, env(&[("TESTDEV_MODE", "fast"), ("NODEPLANE_DEVICES_TESTDEV", "testdev1-1,testdev0-1")]));
    assert_eq!(cdi_names(c), strs(&["nodeplane.dev/testdev=testdev0", "nodeplane.dev/testdev=testdev1"]));
    check_cdi_refs(&sb, "testdev", c);

    // 2 out of {a-0,a-1,b-0,b-1}: one of each physical device.
    let avail = strs(&["testdev0-0", "testdev0-1", "testdev1-0", "testdev1-1"]);
    let got =
        sb.kl.preferred(RES, avail.clone(), vec![], 2).await.unwrap_or_else(|e| panic!("GetPreferredAllocation: {e}"));
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.iter().all(|id| avail.contains(id)), "{got:?} not all from {avail:?}");
    let nodes: BTreeSet<&str> = got.iter().map(|id| id.rsplit_once('-').map(|(n, _)| n).unwrap_or(id)).collect();
    assert_eq!(
        nodes,
        BTreeSet::from(["testdev0", "testdev1"]),
        "preferred {got:?} does not spread over the physical devices"
    );
    for (must, size) in [(strs(&["testdev1-2"]), 3), (strs(&["testdev0-0", "testdev0-1"]), 4), (vec![], 6)] {
        let got = sb
            .kl
            .preferred(RES, six.clone(), must.clone(), size)
            .await
            .unwrap_or_else(|e| panic!("GetPreferredAllocation must {must:?} size {size}: {e}"));
        assert_eq!(got.len(), size as usize, "must {must:?} size {size}: {got:?}");
        assert_eq!(got.iter().collect::<BTreeSet<_>>().len(), got.len(), "duplicates in {got:?}");
        assert!(got.iter().all(|id| six.contains(id)), "{got:?} not all from available");
        assert!(must.iter().all(|id| got.contains(id)), "{got:?} lacks some of must_include {must:?}");
    }

    // Health is per node: all of testdev1's shares go Unhealthy together.
    sb.unlink("testdev1");
    let r = sb
        .wait(RES, SLOW, "testdev1-* Unhealthy after unlink", |r| {
            (0..3).all(|k| r.has(&format!("testdev1-{k}"), UNHEALTHY))
        })
        .await;
    assert!((0..3).all(|k| r.has(&format!("testdev0-{k}"), HEALTHY)), "{:?}", r.devices);
    assert_eq!((r.capacity(), r.allocatable()), (6, 3));
    sb.assert_kubelet_happy();
    sb.stop().await;
}

/// A resource on the real /dev/null (a glob without wildcards), shared twice, no CDI, no
/// PreStart, default permissions, a name with '-'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_dev_null_shared_without_cdi() {
    let mut sb = Sandbox::new("devnull");
    sb.write_devices(vec![json!({
        "name": "null-dev",
        "devices": ["/dev/null"],
        "share": 2,
        "mounts": [],
        "env": {},
        "cdi": false,
        "preStart": false,
    })]);
    sb.kl.start().await;
    sb.start_agent();
    let res = "nodeplane.dev/null-dev";
    let r = sb.registered(res, 1, STARTUP).await;
    assert_eq!(r.endpoint, "nodeplane-null-dev.sock");
    let want = dp::DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true };
    assert_eq!(r.options, Some(want), "RegisterRequest.options");
    assert_eq!(r.served_options, want, "GetDevicePluginOptions");
    assert_eq!(r.ids(), strs(&["null-0", "null-1"]));
    assert_eq!((r.capacity(), r.allocatable()), (2, 2));

    let a = sb
        .kl
        .allocate(res, vec![strs(&["null-0"]), strs(&["null-1", "null-0"])])
        .await
        .unwrap_or_else(|e| panic!("Allocate: {e}\n{}", sb.log()));
    assert_eq!(a.container_responses.len(), 2);
    let null = ("/dev/null".to_string(), "/dev/null".to_string(), "rw".to_string());
    for (c, ids) in a.container_responses.iter().zip(["null-0", "null-1,null-0"]) {
        assert_eq!(specs(c), vec![null.clone()], "devices for {ids}");
        assert!(c.mounts.is_empty(), "mounts {:?}", c.mounts);
        assert_eq!(c.envs, env(&[("NODEPLANE_DEVICES_NULL_DEV", ids)]));
        assert!(c.cdi_devices.is_empty(), "cdi is off: {:?}", c.cdi_devices);
        assert!(c.annotations.is_empty(), "annotations {:?}", c.annotations);
    }
    assert!(!sb.cdi_file("null-dev").exists(), "cdi is off, yet {} exists", sb.cdi_file("null-dev").display());
    let got = sb
        .kl
        .preferred(res, strs(&["null-0", "null-1"]), strs(&["null-1"]), 1)
        .await
        .unwrap_or_else(|e| panic!("GetPreferredAllocation: {e}"));
    assert_eq!(got, strs(&["null-1"]));
    sb.assert_kubelet_happy();
    sb.stop().await;
}

// ----- kubelet and socket lifecycle -----

/// Kubelet restarts (twice): the plugin registers again within 1 s of the new kubelet.sock
/// and sends the full list again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_restart_reregisters_within_1s() {
    let mut sb = Sandbox::new("klrestart");
    sb.mknod("testdev0");
    sb.mknod("testdev1");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;

    for n in 2..=3u32 {
        sb.kl.stop().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        sb.assert_alive();
        assert_eq!(sb.kl.resource(RES).map(|r| r.registrations), Some(n - 1), "registered while kubelet was down");
        let t0 = Instant::now();
        sb.kl.start().await;
        let r = sb.registered(RES, n, Duration::from_secs(5)).await;
        let took = r.registered_at.saturating_duration_since(t0);
        assert!(
            took <= Duration::from_secs(1),
            "re-registration #{n} took {took:?} after kubelet came back (limit 1 s)\n{}",
            sb.log()
        );
        let first = r
            .history
            .iter()
            .find(|(_, reg, _)| *reg == n)
            .map(|(_, _, l)| l.clone())
            .expect("a list on the new stream (just waited for it)");
        assert_eq!(
            ids_of(&first),
            BTreeSet::from(["testdev0".to_string(), "testdev1".to_string()]),
            "full list after restart #{n}"
        );
        assert!(r.streaming, "stream ended: {:?}", r.stream_end);
    }
    sb.kl.allocate(RES, vec![strs(&["testdev0"])]).await.unwrap_or_else(|e| panic!("Allocate after restarts: {e}"));
    sb.assert_kubelet_happy();
    sb.stop().await;
}

/// Kubelet appears 1.5 s after the agent: the plugin kept retrying and registers within
/// ~1.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_retries_until_kubelet_appears() {
    let mut sb = Sandbox::new("late");
    sb.mknod("testdev0");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.start_agent();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sb.assert_alive();
    let t0 = Instant::now();
    sb.kl.start().await;
    let r = sb.registered(RES, 1, Duration::from_secs(10)).await;
    let took = r.registered_at.saturating_duration_since(t0);
    assert!(
        took <= Duration::from_millis(1500),
        "registered {took:?} after kubelet appeared (limit ~1.5 s)\n{}",
        sb.log()
    );
    assert_eq!(r.ids(), strs(&["testdev0"]));
    sb.assert_kubelet_happy();
    sb.stop().await;
}

/// The plugin's socket is deleted: the agent serves a new one and registers again within 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_plugin_socket_is_recreated_and_reregistered() {
    let mut sb = Sandbox::new("sockgone");
    sb.mknod("testdev0");
    sb.mknod("testdev1");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;

    let t0 = Instant::now();
    fs::remove_file(sb.sock("testdev")).unwrap();
    let r = sb.registered(RES, 2, Duration::from_secs(5)).await;
    let took = r.registered_at.saturating_duration_since(t0);
    assert!(
        took <= Duration::from_secs(1),
        "re-registered {took:?} after the socket was deleted (limit 1 s)\n{}",
        sb.log()
    );
    assert_socket_0600(&sb.sock("testdev"), &sb.log());
    assert_eq!(r.ids(), strs(&["testdev0", "testdev1"]));
    // Served on the new socket.
    sb.kl.allocate(RES, vec![strs(&["testdev1"])]).await.unwrap_or_else(|e| panic!("Allocate on the new socket: {e}"));
    sb.assert_kubelet_happy();
    sb.stop().await;
}

// ----- the devices file -----

/// One valid entry among two invalid ones: the valid one registers, each invalid one is
/// logged as an error (by index or name) and registers nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_entries_are_logged_and_skipped() {
    let mut sb = Sandbox::new("invalid");
    sb.mknod("testdev0");
    let mut bad_name = sb.testdev(1);
    bad_name["name"] = json!("Bad Name!");
    let mut relative = sb.testdev(1);
    relative["name"] = json!("relglob");
    relative["devices"] = json!(["dev/x*"]);
    sb.write_devices(vec![bad_name, sb.testdev(1), relative]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;
    // Give the invalid ones every chance to (wrongly) show up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    sb.assert_alive();
    let names: Vec<String> = sb.kl.resources().into_keys().collect();
    assert_eq!(names, strs(&[RES]), "only the valid entry may register\n{}", sb.log());
    let log = sb.log();
    assert!(log_reports(&log, 0, "Bad Name!"), "no error naming entry 0 (\"Bad Name!\") in the agent log:\n{log}");
    assert!(
        log_reports(&log, 2, "relglob"),
        "no error naming entry 2 (\"relglob\", relative glob) in the agent log:\n{log}"
    );
    sb.assert_kubelet_happy();
    sb.stop().await;
}

/// Adding a resource to the file registers it without a restart; removing it takes its
/// socket and CDI spec away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_adds_and_removes_resources() {
    let mut sb = Sandbox::new("reload");
    sb.mknod("testdev0");
    sb.mknod("other0");
    sb.mknod("other1");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;
    let pid = sb.agent.as_ref().unwrap().id();
    assert!(sb.kl.resource("nodeplane.dev/other").is_none());

    let other = json!({
        "name": "other",
        "devices": [format!("{}/dev/other[0-9]*", sb.dir.display())],
        "share": 1,
        "permissions": "r",
        "mounts": [],
        "env": {},
        "cdi": true,
        "preStart": false,
    });
    sb.write_devices(vec![sb.testdev(1), other]);
    let r = sb.registered("nodeplane.dev/other", 1, SLOW).await;
    sb.assert_alive();
    assert_eq!(sb.agent.as_ref().unwrap().id(), pid);
    assert_eq!(r.endpoint, "nodeplane-other.sock");
    assert_eq!(r.ids(), strs(&["other0", "other1"]));
    assert_socket_0600(&sb.sock("other"), &sb.log());
    check_cdi(&sb, "other", &[("other0", sb.dev("other0")), ("other1", sb.dev("other1"))]);
    let a = sb
        .kl
        .allocate("nodeplane.dev/other", vec![strs(&["other1"])])
        .await
        .unwrap_or_else(|e| panic!("Allocate other1: {e}"));
    let o1 = sb.dev_str("other1");
    assert_eq!(specs(&a.container_responses[0]), vec![(o1.clone(), o1, "r".to_string())]);
    assert_eq!(a.container_responses[0].envs, env(&[("NODEPLANE_DEVICES_OTHER", "other1")]));

    sb.write_devices(vec![sb.testdev(1)]);
    let deadline = Instant::now() + SLOW;
    while sb.sock("other").exists() || sb.cdi_file("other").exists() {
        sb.assert_alive();
        assert!(
            Instant::now() < deadline,
            "after removing \"other\": socket exists {}, CDI spec exists {} (after {SLOW:?})\n{}",
            sb.sock("other").exists(),
            sb.cdi_file("other").exists(),
            sb.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // testdev is untouched.
    assert!(sb.sock("testdev").exists(), "testdev's socket went away on reload");
    assert!(sb.cdi_file("testdev").exists(), "testdev's CDI spec went away on reload");
    sb.kl
        .allocate(RES, vec![strs(&["testdev0"])])
        .await
        .unwrap_or_else(|e| panic!("Allocate testdev0 after reload: {e}"));
    sb.assert_kubelet_happy();
    sb.stop().await;
}

// ----- the emulator itself -----

/// A minimal in-process device plugin, to check the kubelet emulator without the agent.
mod fake {
    use std::pin::Pin;

    use nodeplane::rpc::deviceplugin as dp;
    use nodeplane::rpc::deviceplugin::device_plugin_server::DevicePlugin;
    use tokio::sync::watch;
    use tokio_stream::{Stream, StreamExt};
    use tonic::{Request, Response, Status};

    pub struct Plugin {
        pub devices: watch::Receiver<Vec<dp::Device>>,
    }

    pub fn device(id: &str, health: &str) -> dp::Device {
        dp::Device { id: id.into(), health: health.into(), topology: None }
    }

    #[tonic::async_trait]
    impl DevicePlugin for Plugin {
        async fn get_device_plugin_options(
            &self,
            _: Request<dp::Empty>,
        ) -> Result<Response<dp::DevicePluginOptions>, Status> {
            Ok(Response::new(dp::DevicePluginOptions {
                pre_start_required: true,
                get_preferred_allocation_available: true,
            }))
        }
        type ListAndWatchStream = Pin<Box<dyn Stream<Item = Result<dp::ListAndWatchResponse, Status>> + Send>>;
        async fn list_and_watch(&self, _: Request<dp::Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
            let s = tokio_stream::wrappers::WatchStream::new(self.devices.clone())
                .map(|devices| Ok(dp::ListAndWatchResponse { devices }));
            Ok(Response::new(Box::pin(s)))
        }
        async fn get_preferred_allocation(
            &self,
            r: Request<dp::PreferredAllocationRequest>,
        ) -> Result<Response<dp::PreferredAllocationResponse>, Status> {
            let container_responses = r
                .into_inner()
                .container_requests
                .into_iter()
                .map(|c| dp::ContainerPreferredAllocationResponse {
                    device_i_ds: c.available_device_i_ds.into_iter().take(c.allocation_size as usize).collect(),
                })
                .collect();
            Ok(Response::new(dp::PreferredAllocationResponse { container_responses }))
        }
        async fn allocate(&self, r: Request<dp::AllocateRequest>) -> Result<Response<dp::AllocateResponse>, Status> {
            let container_responses = r
                .into_inner()
                .container_requests
                .into_iter()
                .map(|c| dp::ContainerAllocateResponse {
                    envs: [("IDS".to_string(), c.devices_ids.join(","))].into_iter().collect(),
                    ..Default::default()
                })
                .collect();
            Ok(Response::new(dp::AllocateResponse { container_responses }))
        }
        async fn pre_start_container(
            &self,
            r: Request<dp::PreStartContainerRequest>,
        ) -> Result<Response<dp::PreStartContainerResponse>, Status> {
            if r.get_ref().devices_ids.iter().any(|id| id == "bad") {
                return Err(Status::invalid_argument("bad"));
            }
            Ok(Response::new(dp::PreStartContainerResponse {}))
        }
    }
}

/// The emulator validates and records registrations, follows lists, replaces a
/// re-registration, drops streams on stop and takes registrations again after start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_emulator_self_check() {
    use nodeplane::rpc::deviceplugin::device_plugin_server::DevicePluginServer;
    use nodeplane::rpc::deviceplugin::registration_client::RegistrationClient;

    let dir = PathBuf::from("/tmp").join(format!("npdp-{}-emu", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
    let _rm = Rm(dir.clone());
    let mut kl = KubeletEmulator::new(&dir.join("kubelet"));
    kl.start().await;
    assert!(kl.socket().exists());

    let (tx, rx) = tokio::sync::watch::channel(vec![fake::device("a", HEALTHY), fake::device("b", HEALTHY)]);
    let sock = kl.device_dir().join("fake.sock");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(fake::Plugin { devices: rx }))
            .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), async {
                let _ = stop_rx.await;
            }),
    );
    let req = |version: &str| dp::RegisterRequest {
        version: version.into(),
        endpoint: "fake.sock".into(),
        resource_name: "example.com/fake".into(),
        options: Some(dp::DevicePluginOptions { pre_start_required: true, get_preferred_allocation_available: true }),
    };
    let register = |r: dp::RegisterRequest, path: PathBuf| async move {
        let ch = nodeplane::rpc::connect_unix(&path).await.map_err(|e| Status::unavailable(e.to_string()))?;
        RegistrationClient::new(ch).register(r).await.map(|_| ())
    };
    use tonic::Status;

    let e = register(req("v1alpha"), kl.socket()).await.expect_err("wrong version");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let mut bad = req("v1beta1");
    bad.endpoint = "missing.sock".into();
    let e = register(bad, kl.socket()).await.expect_err("no such endpoint");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert_eq!(kl.failures().len(), 2, "{:?}", kl.failures());
    assert!(kl.resources().is_empty());

    register(req("v1beta1"), kl.socket()).await.unwrap();
    let r = kl.wait_for("example.com/fake", Duration::from_secs(2), |r| r.messages >= 1).await.unwrap();
    assert_eq!((r.registrations, r.capacity(), r.allocatable(), r.endpoint.as_str()), (1, 2, 2, "fake.sock"));
    assert_eq!(r.served_options, r.options.unwrap());
    tx.send(vec![fake::device("a", HEALTHY), fake::device("b", UNHEALTHY)]).unwrap();
    let r = kl.wait_for("example.com/fake", Duration::from_secs(2), |r| r.has("b", UNHEALTHY)).await.unwrap();
    assert_eq!((r.messages, r.capacity(), r.allocatable()), (2, 2, 1));
    assert!(r.protocol_errors.is_empty(), "{:?}", r.protocol_errors);

    let a = kl.allocate("example.com/fake", vec![strs(&["a", "b"]), strs(&["a"])]).await.unwrap();
    assert_eq!(a.container_responses[0].envs["IDS"], "a,b");
    assert_eq!(a.container_responses[1].envs["IDS"], "a");
    assert_eq!(kl.preferred("example.com/fake", strs(&["a", "b"]), vec![], 1).await.unwrap(), strs(&["a"]));
    kl.pre_start("example.com/fake", strs(&["a"])).await.unwrap();
    assert_eq!(kl.pre_start("example.com/fake", strs(&["bad"])).await.unwrap_err().code(), Code::InvalidArgument);

    // Re-registration replaces the first one and gets the full list again.
    register(req("v1beta1"), kl.socket()).await.unwrap();
    let r = kl
        .wait_for("example.com/fake", Duration::from_secs(2), |r| {
            r.registrations == 2 && r.messages_this_registration == 1
        })
        .await
        .unwrap();
    assert_eq!(r.messages, 3);
    assert!(r.streaming);

    // A health value outside the API is flagged.
    tx.send(vec![fake::device("a", "Fine")]).unwrap();
    let r = kl.wait_for("example.com/fake", Duration::from_secs(2), |r| r.messages == 4).await.unwrap();
    assert_eq!(r.protocol_errors.len(), 1, "{:?}", r.protocol_errors);

    // Kubelet restart.
    kl.stop().await;
    assert!(!kl.socket().exists());
    let r = kl.resource("example.com/fake").unwrap();
    assert!(!r.streaming && r.stream_end.as_deref() == Some("kubelet stopped"), "{r:?}");
    tx.send(vec![fake::device("a", HEALTHY)]).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(kl.resource("example.com/fake").unwrap().messages, 4, "a dropped stream must not count");
    assert!(register(req("v1beta1"), kl.socket()).await.is_err(), "registered with a stopped kubelet");
    kl.start().await;
    // Kubelet deletes every socket in the directory when it starts: the plugin serves anew.
    assert!(!sock.exists(), "the kubelet emulator kept the plugin socket at start");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let server2 = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(fake::Plugin { devices: tx.subscribe() }))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    register(req("v1beta1"), kl.socket()).await.unwrap();
    let r = kl
        .wait_for("example.com/fake", Duration::from_secs(2), |r| {
            r.registrations == 3 && r.messages_this_registration == 1
        })
        .await
        .unwrap();
    assert_eq!(r.devices, vec![kubelet_emulator::DeviceInfo { id: "a".into(), health: HEALTHY.into(), numa: vec![] }]);
    let e = kl.wait_for("example.com/fake", Duration::from_millis(50), |r| r.registrations == 9).await.unwrap_err();
    assert!(e.contains("example.com/fake"), "{e}");

    kl.stop().await;
    server2.abort();
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(2), server).await;
}

/// A node that exists but cannot be opened (a character device number no driver serves:
/// open fails with ENXIO) is listed Unhealthy, and Allocate refuses it; replaced by a
/// working node it turns Healthy again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unopenable_node_is_unhealthy() {
    let mut sb = Sandbox::new("noopen");
    sb.mknod("testdev0");
    // 240-254 are the "local/experimental" character majors: no driver behind them here.
    nix::sys::stat::mknod(
        &sb.dev("testdev1"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(240, 77),
    )
    .unwrap();
    assert!(fs::File::open(sb.dev("testdev1")).is_err(), "major 240 opened: pick another unserved number");
    sb.write_devices(vec![sb.testdev(1)]);
    sb.kl.start().await;
    sb.start_agent();
    sb.registered(RES, 1, STARTUP).await;
    let r = sb
        .wait(RES, SLOW, "testdev1 listed Unhealthy", |r| r.has("testdev1", UNHEALTHY) && r.has("testdev0", HEALTHY))
        .await;
    assert_eq!((r.capacity(), r.allocatable()), (2, 1));
    let e = sb.kl.allocate(RES, vec![strs(&["testdev1"])]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    sb.unlink("testdev1");
    sb.mknod("testdev1");
    sb.wait(RES, SLOW, "testdev1 Healthy once it opens", |r| r.has("testdev1", HEALTHY)).await;
    sb.assert_kubelet_happy();
    sb.stop().await;
}
