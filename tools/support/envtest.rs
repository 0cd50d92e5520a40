//! A real Kubernetes control plane for tests, the envtest pattern: the real kube-apiserver
//! (from `K8S_BIN`) over the real etcd (from `PATH`), no kubelet, scheduler or
//! controller-manager.
//!
//! - **etcd** runs once per test binary, on loopback ports of its own, with its data in a
//!   temporary directory. It is started from a thread that lives as long as the process and
//!   dies with it (`PR_SET_PDEATHSIG`); at a normal exit it is killed by PID and its directory
//!   removed (`atexit`), and directories of earlier runs whose process is gone are swept.
//! - **Each test gets a kube-apiserver of its own**, on its own etcd prefix: the controller's
//!   state is cluster-scoped (NodeplaneNodes, IPBlocks, NodeplaneVolumes, Nodes,
//!   ResourceSlices, and every load lists all of them), so a namespace per test would not keep
//!   tests that run in parallel apart; an API server per prefix does, and starts in about a
//!   second. Every prefix begins as a copy of a template made once per binary by `kubectl
//!   apply` of the project's own `daemonset/base/{namespace,crds,rbac}.yaml`, so the
//!   controller's ServiceAccount has exactly the RBAC the manifests grant.
//! - What a test observes of the requests comes from the API server's **audit log** (level
//!   Metadata, blocking mode: an event is written before the request is served).
//! - The controller's clients reach the API server through a [`FaultProxy`] (loopback TCP):
//!   `cut()` is an unreachable API server, `hold()` a partition that new connections wait
//!   out. `restart()` kills the API server and starts it again on the same prefix: its watch
//!   cache starts over, so a watch resumed from before gets the real `410 Gone`.
//! - For the moments a test must act inside one request, the API server's own extension
//!   points, served by the test (`api_hooks.rs`): an admission webhook, an audit webhook.
//! - The test's own requests go straight to the API server as cluster-admin ([`Admin`]);
//!   tokens come from the TokenRequest API, so TokenReview is the API server's own.
//!
//! Everything blocks: a test may call it from inside its own tokio runtime, so the clients
//! and servers of this module run on a runtime of their own ([`block`]).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::ApiResource;
use serde_json::{Value, json};

use super::api_hooks::AdmissionHook;
use super::fault_proxy::FaultProxy;

/// The namespace of the controller in the manifests (`daemonset/base/rbac.yaml`).
pub const NS: &str = "nodeplane-system";
/// The controller's ServiceAccount, as the API server names it.
pub const CONTROLLER_USER: &str = "system:serviceaccount:nodeplane-system:nodeplane-controller";
/// The agents' ServiceAccount.
pub const AGENT_USER: &str = "system:serviceaccount:nodeplane-system:nodeplane-agent";
/// The audience of the agents' projected tokens.
pub const AGENT_AUDIENCE: &str = "nodeplane";
/// The field manager of the test's own writes (an operator's tool).
pub const ADMIN_MANAGER: &str = "envtest-admin";

// ---- the runtime of this module's clients and servers ------------------------------------------

static RT: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("envtest")
        .enable_all()
        .build()
        .expect("the envtest runtime")
});

/// Runs `f` on this module's runtime and waits for it: callable from anywhere, also from
/// inside another runtime (where `block_on` would panic).
pub fn block<F>(f: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::channel();
    RT.spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv().expect("an envtest task panicked")
}

/// Spawns futures on this module's runtime (the servers of the hooks).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    &RT
}

// ---- processes ----------------------------------------------------------------------------------

/// Spawns `cmd` so that it is killed when the spawning thread ends (`PR_SET_PDEATHSIG`): a
/// test's processes die with its thread, also when it panics or the binary is killed.
fn spawn_tied(cmd: &mut Command) -> std::io::Result<Child> {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl: then nobody would ever kill this one.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    cmd.spawn()
}

fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The last lines of a log, for a failure message.
fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Waits until `f` is true, failing with `what` after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ---- where the binaries come from ----------------------------------------------------------------

/// `K8S_BIN/kube-apiserver`. A missing binary fails the test (it never passes silently);
/// scripts/test leaves these tests out, loudly, when K8S_BIN does not hold it.
fn kube_apiserver() -> PathBuf {
    let dir = std::env::var_os("K8S_BIN").unwrap_or_else(|| {
        panic!(
            "K8S_BIN is not set: these tests run the controller against a real kube-apiserver; unpack \
             ../shared/k8s with its unpack.sh DIR and export K8S_BIN=DIR"
        )
    });
    let bin = Path::new(&dir).join("kube-apiserver");
    assert!(bin.is_file(), "{} is missing (K8S_BIN={})", bin.display(), Path::new(&dir).display());
    bin
}

/// A program on PATH (etcd, kubectl: scripts/install-deps installs them).
fn on_path(name: &str) -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|p| p.is_file()))
        .unwrap_or_else(|| panic!("{name} is not on PATH: run scripts/install-deps"))
}

// ---- the binary's directory ----------------------------------------------------------------------

const ROOT_TAG: &str = "np-envtest-";

/// This binary's directory (etcd's data, the PKI, each test's API server): created once,
/// removed at exit. Directories of earlier binaries that are gone are removed first.
fn root() -> &'static Path {
    static ROOT: LazyLock<PathBuf> = LazyLock::new(|| {
        sweep_stale_roots();
        let d = std::env::temp_dir().join(format!("{ROOT_TAG}{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    });
    &ROOT
}

fn sweep_stale_roots() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(pid) = name.strip_prefix(ROOT_TAG).and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

// ---- etcd -----------------------------------------------------------------------------------------

/// An etcd server.
pub struct Etcd {
    pub client: EtcdClient,
    proc: Mutex<Option<Child>>,
    dir: PathBuf,
}

/// etcd's JSON gateway (`/v3/...`) on a loopback port.
#[derive(Debug, Clone, Copy)]
pub struct EtcdClient {
    port: u16,
}

/// What the `atexit` handler kills and removes.
static AT_EXIT: OnceLock<(libc::pid_t, PathBuf)> = OnceLock::new();

extern "C" fn clean_up_at_exit() {
    if let Some((pid, _)) = AT_EXIT.get() {
        // SAFETY: plain syscalls on a child of this process.
        unsafe {
            libc::kill(*pid, libc::SIGKILL);
            libc::waitpid(*pid, std::ptr::null_mut(), 0);
        }
    }
    let _ = std::fs::remove_dir_all(root());
}

/// The etcd every test of this binary shares (each on its own prefix).
pub fn shared_etcd() -> &'static Etcd {
    static ETCD: LazyLock<Etcd> = LazyLock::new(|| {
        // Spawned from a thread that lives as long as the process: PR_SET_PDEATHSIG fires when
        // the spawning *thread* ends, and a test's thread ends with the test.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("envtest-etcd".into())
            .spawn(move || {
                let _ = tx.send(Etcd::start(&root().join("etcd")));
                loop {
                    std::thread::park();
                }
            })
            .unwrap();
        let etcd = rx.recv().expect("etcd started");
        let pid = etcd.proc.lock().unwrap().as_ref().unwrap().id() as libc::pid_t;
        if AT_EXIT.set((pid, root().to_path_buf())).is_ok() {
            // SAFETY: registers a plain function.
            unsafe { libc::atexit(clean_up_at_exit) };
        }
        etcd
    });
    &ETCD
}

impl Etcd {
    /// Starts etcd with its data in `dir`, on two free loopback ports; waits until healthy.
    /// Killed when the calling thread ends or the value is dropped.
    pub fn start(dir: &Path) -> Etcd {
        let mut last = String::new();
        // A free port can be taken by someone else before etcd binds it: try again.
        for _ in 0..3 {
            let (client, peer) = (free_port(), free_port());
            let _ = std::fs::remove_dir_all(dir);
            std::fs::create_dir_all(dir).unwrap();
            let log = std::fs::File::create(dir.with_extension("log")).unwrap();
            let (c, p) = (format!("http://127.0.0.1:{client}"), format!("http://127.0.0.1:{peer}"));
            let child = spawn_tied(
                Command::new(on_path("etcd"))
                    .args(["--name", "envtest", "--data-dir"])
                    .arg(dir.join("data"))
                    .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
                    .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
                    .args(["--initial-cluster", &format!("envtest={p}")])
                    // Tests need no durability, and fsync is most of etcd's write latency.
                    .args(["--unsafe-no-fsync", "--log-level", "warn"])
                    .stdout(Stdio::null())
                    .stderr(log),
            )
            .expect("starting etcd");
            let etcd =
                Etcd { client: EtcdClient { port: client }, proc: Mutex::new(Some(child)), dir: dir.to_path_buf() };
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(20) && !etcd.exited() {
                if etcd.client.http("GET", "/health", None).is_ok_and(|v| v["health"] == "true") {
                    return etcd;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            last = tail(&dir.with_extension("log"), 20);
        }
        panic!("etcd did not start:\n{last}");
    }

    fn exited(&self) -> bool {
        self.proc.lock().unwrap().as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_some())
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client.port)
    }
}

impl EtcdClient {
    /// A call of the JSON gateway (`/v3/kv/range`, `/v3/kv/put`, ...).
    pub fn post(&self, path: &str, body: &Value) -> Value {
        self.http("POST", path, Some(body)).unwrap_or_else(|e| panic!("etcd {path}: {e}"))
    }

    /// One HTTP/1.0 exchange (no chunked encoding, the answer ends at EOF).
    fn http(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out);
        let (head, body) = text.split_once("\r\n\r\n").ok_or("no HTTP answer")?;
        if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
            return Err(format!("{}: {body}", head.lines().next().unwrap_or("")));
        }
        serde_json::from_str(body).map_err(|e| format!("{e}: {body}"))
    }

    /// Every (key, value) under `prefix`, values as stored (base64 in the gateway's JSON).
    fn range(&self, prefix: &str) -> Vec<(String, String)> {
        let r = self.post("/v3/kv/range", &json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))}));
        r["kvs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|kv| (unb64(kv["key"].as_str().unwrap()), kv["value"].as_str().unwrap_or("").to_string()))
            .collect()
    }

    /// Writes (key, base64 value) pairs, 100 to a transaction (etcd's default limit is 128).
    fn put_all(&self, kvs: &[(String, String)]) {
        for chunk in kvs.chunks(100) {
            let ops: Vec<Value> =
                chunk.iter().map(|(k, v)| json!({"request_put": {"key": b64(k), "value": v}})).collect();
            let r = self.post("/v3/kv/txn", &json!({"success": ops}));
            assert_eq!(r["succeeded"], true, "etcd txn: {r}");
        }
    }

    /// Puts a key (base64 value) and returns the revision it made.
    pub fn put(&self, key: &str, value_b64: &str) -> i64 {
        let r = self.post("/v3/kv/put", &json!({"key": b64(key), "value": value_b64}));
        r["header"]["revision"].as_str().and_then(|s| s.parse().ok()).expect("a revision")
    }

    /// Compacts the history up to `revision`: reads of older revisions get "compacted".
    pub fn compact(&self, revision: i64) {
        self.post("/v3/kv/compaction", &json!({"revision": revision.to_string(), "physical": true}));
    }

    /// Deletes every key under `prefix`. Never panics: it runs in `Drop`, also while a
    /// failed test unwinds (a second panic would abort the whole binary).
    fn delete_prefix(&self, prefix: &str) -> Result<Value, String> {
        let range = json!({"key": b64(prefix), "range_end": b64(&prefix_end(prefix))});
        self.http("POST", "/v3/kv/deleterange", Some(&range))
    }

    /// Copies every key under `from` to the same key under `to_prefix` of `to`.
    fn copy_prefix(&self, from: &str, to: &EtcdClient, to_prefix: &str) {
        let kvs: Vec<(String, String)> = self
            .range(&format!("{from}/"))
            .into_iter()
            .map(|(k, v)| (format!("{to_prefix}{}", &k[from.len()..]), v))
            .collect();
        assert!(!kvs.is_empty(), "the template under {from} is empty");
        to.put_all(&kvs);
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut c) = self.proc.lock().unwrap_or_else(|e| e.into_inner()).take() {
            kill(&mut c);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Base64 as the etcd gateway wants bytes (k8s-openapi's `ByteString` is base64 in JSON).
fn b64(s: &str) -> String {
    serde_json::to_value(k8s_openapi::ByteString(s.as_bytes().to_vec())).unwrap().as_str().unwrap().to_string()
}

fn unb64(s: &str) -> String {
    let b: k8s_openapi::ByteString = serde_json::from_value(json!(s)).expect("base64 from etcd");
    String::from_utf8(b.0).expect("an etcd key is text")
}

/// The first key after every key starting with `prefix` (etcd's range end).
fn prefix_end(prefix: &str) -> String {
    let mut b = prefix.as_bytes().to_vec();
    *b.last_mut().unwrap() += 1;
    String::from_utf8(b).unwrap()
}

// ---- certificates and keys (one set per binary) ---------------------------------------------------

/// The binary's PKI: a CA, the API servers' serving certificate (127.0.0.1), an admin client
/// certificate (`system:masters`), the service-account signing key, and the audit policy.
pub struct Pki {
    pub dir: PathBuf,
    pub ca_pem: String,
}

pub fn pki() -> &'static Pki {
    static PKI: LazyLock<Pki> = LazyLock::new(|| make_pki(&root().join("pki")));
    &PKI
}

fn make_pki(dir: &Path) -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    std::fs::create_dir_all(dir).unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::default();
    ca.distinguished_name.push(DnType::CommonName, "nodeplane-envtest-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let issue = |name: &str, mut params: CertificateParams| {
        let key = KeyPair::generate().unwrap();
        params.use_authority_key_identifier_extension = true;
        write(&format!("{name}.crt"), &params.signed_by(&key, &issuer).unwrap().pem());
        write(&format!("{name}.key"), &key.serialize_pem());
    };
    // The API servers and the test's webhook servers all listen on 127.0.0.1.
    let mut serving = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    serving.distinguished_name.push(DnType::CommonName, "127.0.0.1");
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    issue("serving", serving);
    let mut admin = CertificateParams::default();
    admin.distinguished_name.push(DnType::CommonName, "envtest-admin");
    admin.distinguished_name.push(DnType::OrganizationName, "system:masters");
    admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    issue("admin", admin);
    let sa = KeyPair::generate().unwrap();
    write("sa.key", &sa.serialize_pem());
    write("sa.pub", &sa.public_key_pem());
    write("ca.crt", &ca_pem);
    // The API server's own loopback requests are not the test's business; everything else is
    // recorded with its metadata (verb, resource, user, User-Agent, request URI).
    write(
        "audit-policy.json",
        &json!({"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["ResponseStarted"],
                "rules": [{"level": "None", "users": ["system:apiserver"]}, {"level": "Metadata"}]})
        .to_string(),
    );
    Pki { dir: dir.to_path_buf(), ca_pem }
}

impl Pki {
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

// ---- the API server process ----------------------------------------------------------------------

/// How a test's API server is set up.
#[derive(Default)]
pub struct Options {
    /// An etcd of its own instead of the binary's (for a test that compacts etcd: that would
    /// reach into every other test's history).
    pub own_etcd: bool,
    /// `--watch-cache=false`: reads go to etcd (what a compaction between two pages of a list
    /// then affects at once; the watch cache learns of compactions only every 15 s).
    pub no_watch_cache: bool,
    /// An audit webhook (`--audit-webhook-config-file`, blocking) at this URL, besides the log.
    pub audit_webhook: Option<String>,
    /// Objects written to storage before the API server starts, as it stores them (a large
    /// state in a second, where creating it through the API would take minutes).
    pub seed: Vec<(ApiResource, Value)>,
}

fn apiserver_args(etcd: &str, prefix: &str, port: u16, dir: &Path, o: &Options) -> Vec<String> {
    let p = |n: &str| pki().file(n).display().to_string();
    let mut a: Vec<String> = [
        "--etcd-servers",
        etcd,
        "--etcd-prefix",
        prefix,
        "--bind-address",
        "127.0.0.1",
        "--secure-port",
        &port.to_string(),
        "--tls-cert-file",
        &p("serving.crt"),
        "--tls-private-key-file",
        &p("serving.key"),
        "--client-ca-file",
        &p("ca.crt"),
        "--service-account-issuer",
        "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file",
        &p("sa.pub"),
        "--service-account-signing-key-file",
        &p("sa.key"),
        "--authorization-mode",
        "Node,RBAC",
        "--service-cluster-ip-range",
        "10.96.0.0/16",
        "--cert-dir",
        &dir.join("certs").display().to_string(),
        "--audit-policy-file",
        &p("audit-policy.json"),
        "--audit-log-path",
        &dir.join("audit.log").display().to_string(),
        "--audit-log-mode",
        "blocking",
        // No compactor: etcd is shared by every test's API server, and one compacting would
        // expire the others' continue tokens and watch positions at random.
        "--etcd-compaction-interval",
        "0",
        "--profiling=false",
        "--v=1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if o.no_watch_cache {
        a.push("--watch-cache=false".into());
    }
    if let Some(url) = &o.audit_webhook {
        let cfg = dir.join("audit-webhook.kubeconfig");
        let kc = json!({"apiVersion": "v1", "kind": "Config", "current-context": "hook",
            "clusters": [{"name": "hook", "cluster": {"server": url}}],
            "users": [{"name": "hook", "user": {}}],
            "contexts": [{"name": "hook", "context": {"cluster": "hook", "user": "hook"}}]});
        std::fs::write(&cfg, kc.to_string()).unwrap();
        a.extend(["--audit-webhook-config-file".into(), cfg.display().to_string()]);
        a.extend(["--audit-webhook-mode".into(), "blocking".into()]);
    }
    a
}

/// A kubeconfig (JSON is YAML) for `server`: the admin's client certificate, or a token.
fn kubeconfig_text(server: &str, token: Option<&str>) -> String {
    let user = match token {
        Some(t) => json!({"token": t}),
        None => json!({"client-certificate": pki().file("admin.crt"), "client-key": pki().file("admin.key")}),
    };
    json!({"apiVersion": "v1", "kind": "Config", "current-context": "envtest",
        "clusters": [{"name": "envtest", "cluster": {"server": server, "certificate-authority": pki().file("ca.crt")}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "envtest", "context": {"cluster": "envtest", "user": "user"}}]})
    .to_string()
}

/// A client configuration from [`kubeconfig_text`].
pub async fn config_of(kubeconfig: &str) -> kube::Config {
    let kc = Kubeconfig::from_yaml(kubeconfig).expect("a kubeconfig");
    kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("a client configuration")
}

fn admin_client(port: u16) -> kube::Client {
    let text = kubeconfig_text(&format!("https://127.0.0.1:{port}"), None);
    block(async move { kube::Client::try_from(config_of(&text).await).expect("the admin client") })
}

/// The custom resources of `daemonset/base/crds.yaml`.
fn our_resources() -> Vec<ApiResource> {
    use nodeplane::controller::kube::{block_resource, node_resource, volume_resource};
    vec![node_resource(), block_resource(), volume_resource()]
}

/// A running kube-apiserver process: its port, arguments (to start it again), the process,
/// and an admin client straight to it.
struct Launched {
    port: u16,
    args: Vec<String>,
    proc: Mutex<Option<Child>>,
    admin: kube::Client,
}

/// Starts a kube-apiserver on a free port and waits until it is ready (and, with `crds`,
/// serves our custom resources). A port someone else took meanwhile means another try.
fn launch(etcd: &str, prefix: &str, dir: &Path, o: &Options, crds: bool) -> Launched {
    let log = dir.join("kube-apiserver.log");
    let mut why = String::new();
    for _ in 0..3 {
        let port = free_port();
        let args = apiserver_args(etcd, prefix, port, dir, o);
        let proc = Mutex::new(Some(spawn_apiserver(&args, &log)));
        let admin = admin_client(port);
        match wait_ready(&admin, &proc, crds) {
            Ok(()) => return Launched { port, args, proc, admin },
            Err(Unready::Exited(e)) => why = e,
            Err(Unready::Timeout(e)) => {
                kill(proc.lock().unwrap().as_mut().unwrap());
                panic!("{e}\n{}", tail(&log, 30));
            }
        }
    }
    panic!("kube-apiserver did not start: {why}\n{}", tail(&log, 30));
}

/// Why an API server did not become ready.
#[derive(Debug)]
enum Unready {
    Exited(String),
    Timeout(String),
}

impl std::fmt::Display for Unready {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Unready::Exited(m) | Unready::Timeout(m) => f.write_str(m),
        }
    }
}

/// Waits until the API server answers `/readyz` (and with `crds`, serves our custom
/// resources: their storage comes up just after readiness).
fn wait_ready(client: &kube::Client, child: &Mutex<Option<Child>>, crds: bool) -> Result<(), Unready> {
    let t = Instant::now();
    loop {
        if let Some(status) = child.lock().unwrap().as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            return Err(Unready::Exited(format!("kube-apiserver exited ({status})")));
        }
        let c = client.clone();
        let up = block(async move {
            let req = hyper::http::Request::get("/readyz").body(Vec::new()).unwrap();
            if c.request_text(req).await.is_err() {
                return false;
            }
            for ar in our_resources().iter().filter(|_| crds) {
                let api: Api<DynamicObject> = Api::all_with(c.clone(), ar);
                if api.list(&kube::api::ListParams::default().limit(1)).await.is_err() {
                    return false;
                }
            }
            true
        });
        if up {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(60) {
            return Err(Unready::Timeout("kube-apiserver not ready after 60 s".into()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn spawn_apiserver(args: &[String], log: &Path) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    spawn_tied(Command::new(kube_apiserver()).args(args).stdout(Stdio::null()).stderr(log)).expect("kube-apiserver")
}

// ---- the template every test's prefix starts from ------------------------------------------------

/// The etcd prefix holding a cluster with the project's namespace, CRDs and RBAC applied by
/// `kubectl apply` (the manifests as an operator applies them), and the `default`
/// ServiceAccounts the controller-manager would make. Made once per binary.
fn template() -> &'static str {
    static TEMPLATE: LazyLock<String> = LazyLock::new(make_template);
    &TEMPLATE
}

fn make_template() -> String {
    let prefix = "/template".to_string();
    let dir = root().join("template");
    std::fs::create_dir_all(&dir).unwrap();
    // (The custom resources do not exist yet: readiness only.)
    let Launched { port, proc, admin, .. } = launch(&shared_etcd().url(), &prefix, &dir, &Options::default(), false);
    let kubeconfig = dir.join("admin.kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_text(&format!("https://127.0.0.1:{port}"), None)).unwrap();
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset/base");
    let kubectl = |args: &[&str]| {
        let out = Command::new(on_path("kubectl"))
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--cache-dir")
            .arg(dir.join("kubectl-cache"))
            .args(args)
            .output()
            .expect("kubectl");
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let files: Vec<String> =
        ["namespace.yaml", "crds.yaml", "rbac.yaml"].iter().map(|f| base.join(f).display().to_string()).collect();
    kubectl(&["apply", "--server-side", "-f", &files[0], "-f", &files[1], "-f", &files[2]]);
    kubectl(&["wait", "--for", "condition=Established", "--timeout", "60s", "crd", "--all"]);
    for ns in ["default", NS] {
        kubectl(&["create", "serviceaccount", "default", "--namespace", ns]);
    }
    // The copies must serve the custom resources at once.
    wait_ready(&admin, &proc, true).unwrap_or_else(|e| panic!("{e}\n{}", tail(&dir.join("kube-apiserver.log"), 30)));
    kill(proc.lock().unwrap().as_mut().unwrap());
    prefix
}

// ---- a test's API server ---------------------------------------------------------------------------

enum EtcdOf {
    Shared,
    Own(Etcd),
}

/// A kube-apiserver of the calling test's own (see the module documentation).
pub struct ApiServer {
    dir: PathBuf,
    etcd: EtcdOf,
    prefix: String,
    port: u16,
    args: Vec<String>,
    proc: Mutex<Option<Child>>,
    admin: Admin,
    proxy: FaultProxy,
    audit: Mutex<AuditLog>,
    controller_token: String,
}

static STARTED: AtomicUsize = AtomicUsize::new(0);

impl ApiServer {
    /// A new API server on a copy of the template (see [`template`]).
    pub fn start() -> ApiServer {
        ApiServer::start_with(Options::default())
    }

    pub fn start_with(o: Options) -> ApiServer {
        let n = STARTED.fetch_add(1, Ordering::SeqCst);
        let test = std::thread::current().name().unwrap_or("test").rsplit("::").next().unwrap_or("").to_string();
        let dir = root().join(format!("t{n}-{}", &test[..test.len().min(40)]));
        std::fs::create_dir_all(&dir).unwrap();
        let etcd = if o.own_etcd { EtcdOf::Own(Etcd::start(&dir.join("etcd"))) } else { EtcdOf::Shared };
        let prefix = format!("/t{n}");
        let e = match &etcd {
            EtcdOf::Shared => shared_etcd(),
            EtcdOf::Own(e) => e,
        };
        shared_etcd().client.copy_prefix(template(), &e.client, &prefix);
        let seeds: Vec<(String, String)> = o.seed.iter().map(|(ar, obj)| seed_entry(&prefix, ar, obj)).collect();
        e.client.put_all(&seeds);
        let Launched { port, args, proc, admin } = launch(&e.url(), &prefix, &dir, &o, true);
        let admin = Admin { client: admin };
        let proxy = FaultProxy::start(port);
        let audit = Mutex::new(AuditLog::new(dir.join("audit.log")));
        let mut s =
            ApiServer { dir, etcd, prefix, port, args, proc, admin, proxy, audit, controller_token: String::new() };
        s.controller_token = s.token(NS, "nodeplane-controller", &[], None);
        s
    }

    /// The gateway of this API server's etcd.
    pub fn etcd(&self) -> EtcdClient {
        match &self.etcd {
            EtcdOf::Shared => shared_etcd().client,
            EtcdOf::Own(e) => e.client,
        }
    }

    /// Its etcd prefix (`--etcd-prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The address the controller's clients use: through the [`FaultProxy`].
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.proxy.port())
    }

    /// The API server itself (the test's own, faultless way in).
    pub fn direct_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    // ---- faults ----

    /// The API server becomes unreachable: open connections are closed, new ones refused.
    pub fn cut(&self) {
        self.proxy.cut();
    }

    /// The API server cannot be reached, and clients' new connections wait (a partition):
    /// open connections are closed, new ones are forwarded at `restore()`.
    pub fn hold(&self) {
        self.proxy.hold();
    }

    /// Reachable again.
    pub fn restore(&self) {
        self.proxy.restore();
    }

    /// Kills the API server and starts it again on the same storage and port (a crash and
    /// restart, or a fail-over to another replica): its watch cache starts over, so a watch
    /// resumed from a resourceVersion older than the restart gets `410 Gone`.
    pub fn restart(&self) {
        let log = self.dir.join("kube-apiserver.log");
        let mut proc = self.proc.lock().unwrap();
        if let Some(c) = proc.as_mut() {
            kill(c);
        }
        *proc = Some(spawn_apiserver(&self.args, &log));
        drop(proc);
        // (Same port: the proxy forwards to it. Should another process take it meanwhile, the
        // test fails here, naming why.)
        wait_ready(&self.admin.client, &self.proc, true).unwrap_or_else(|e| panic!("{e}\n{}", tail(&log, 30)));
    }

    /// Rewrites a stored object's `metadata.creationTimestamp` in etcd (the API server sets
    /// it at create and never takes one from a client): an object made long ago.
    pub fn backdate(&self, ar: &ApiResource, ns: Option<&str>, name: &str, timestamp: &str) {
        let key = storage_key(&self.prefix, ar, ns, name);
        let kvs = self.etcd().range(&key);
        let (_, value) = kvs.iter().find(|(k, _)| *k == key).unwrap_or_else(|| panic!("{key} is not in etcd"));
        let mut obj: Value = serde_json::from_str(&unb64(value)).unwrap();
        obj["metadata"]["creationTimestamp"] = json!(timestamp);
        self.etcd().put(&key, &b64(&obj.to_string()));
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.proc.lock().unwrap_or_else(|e| e.into_inner()).take() {
            kill(&mut c);
        }
        if std::thread::panicking() {
            eprintln!(
                "--- {} (last lines) ---\n{}",
                self.dir.display(),
                tail(&self.dir.join("kube-apiserver.log"), 15)
            );
        }
        if let EtcdOf::Shared = self.etcd {
            // (Other tests go on with the same etcd: keep it small.)
            let _ = shared_etcd().client.delete_prefix(&format!("{}/", self.prefix));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Where the API server stores an object: `<prefix>/<group>/<plural>/[<ns>/]<name>`, core
/// resources without the group.
fn storage_key(prefix: &str, ar: &ApiResource, ns: Option<&str>, name: &str) -> String {
    let group = if ar.group.is_empty() { String::new() } else { format!("/{}", ar.group) };
    let ns = ns.map(|n| format!("/{n}")).unwrap_or_default();
    format!("{prefix}{group}/{}{ns}/{name}", ar.plural)
}

/// A custom resource as the API server stores it (JSON with the server-set metadata).
fn seed_entry(prefix: &str, ar: &ApiResource, obj: &Value) -> (String, String) {
    let mut o = obj.clone();
    o["apiVersion"] = json!(ar.api_version);
    o["kind"] = json!(ar.kind);
    let mut id = [0u8; 16];
    nodeplane::util::fill_random(&mut id);
    let h = hex::encode(id);
    o["metadata"]["uid"] = json!(format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..]));
    o["metadata"]["generation"] = json!(1);
    let now = nodeplane::util::utc_rfc3339(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64,
    );
    o["metadata"]["creationTimestamp"] = json!(now);
    let name = o["metadata"]["name"].as_str().expect("a seeded object has a name").to_string();
    let ns = o["metadata"]["namespace"].as_str().map(str::to_string);
    (storage_key(prefix, ar, ns.as_deref(), &name), b64(&o.to_string()))
}

// ---- the test's own requests (as an operator with cluster-admin) -----------------------------------

/// The API resource of `plural` in `group` (the resources these tests touch).
pub fn resource(group: &str, plural: &str) -> ApiResource {
    use nodeplane::controller::kube::GROUP;
    let (version, kind) = match (group, plural) {
        ("", "nodes") => ("v1", "Node"),
        ("", "namespaces") => ("v1", "Namespace"),
        ("", "pods") => ("v1", "Pod"),
        ("", "secrets") => ("v1", "Secret"),
        ("", "configmaps") => ("v1", "ConfigMap"),
        ("", "serviceaccounts") => ("v1", "ServiceAccount"),
        ("coordination.k8s.io", "leases") => ("v1", "Lease"),
        ("events.k8s.io", "events") => ("v1", "Event"),
        ("networking.k8s.io", "networkpolicies") => ("v1", "NetworkPolicy"),
        ("resource.k8s.io", "resourceslices") => ("v1", "ResourceSlice"),
        ("resource.k8s.io", "resourceclaims") => ("v1", "ResourceClaim"),
        ("admissionregistration.k8s.io", "validatingwebhookconfigurations") => ("v1", "ValidatingWebhookConfiguration"),
        ("apiextensions.k8s.io", "customresourcedefinitions") => ("v1", "CustomResourceDefinition"),
        (GROUP, "nodeplanenodes") => ("v1alpha1", "NodeplaneNode"),
        (GROUP, "ipblocks") => ("v1alpha1", "IPBlock"),
        (GROUP, "nodeplanevolumes") => ("v1alpha1", "NodeplaneVolume"),
        _ => panic!("envtest::resource does not know {group}/{plural}"),
    };
    let api_version = if group.is_empty() { version.to_string() } else { format!("{group}/{version}") };
    ApiResource { group: group.into(), version: version.into(), api_version, kind: kind.into(), plural: plural.into() }
}

fn api(client: &kube::Client, ar: &ApiResource, ns: Option<&str>) -> Api<DynamicObject> {
    match ns {
        Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
        None => Api::all_with(client.clone(), ar),
    }
}

fn admin_params() -> PostParams {
    PostParams { field_manager: Some(ADMIN_MANAGER.into()), ..Default::default() }
}

fn to_object(ar: &ApiResource, mut obj: Value) -> DynamicObject {
    obj["apiVersion"] = json!(ar.api_version);
    obj["kind"] = json!(ar.kind);
    serde_json::from_value(obj).expect("an object")
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

/// The test's own client: cluster-admin (`system:masters`), straight to the API server,
/// writing as the field manager [`ADMIN_MANAGER`].
#[derive(Clone)]
pub struct Admin {
    client: kube::Client,
}

impl std::ops::Deref for ApiServer {
    type Target = Admin;
    fn deref(&self) -> &Admin {
        &self.admin
    }
}

impl Admin {
    /// The stored object, as a GET returns it.
    pub fn get(&self, group: &str, plural: &str, ns: Option<&str>, name: &str) -> Option<Value> {
        let api = api(&self.client, &resource(group, plural), ns);
        let name = name.to_string();
        block(async move { api.get_opt(&name).await })
            .unwrap_or_else(|e| panic!("get {plural}: {e}"))
            .map(|o| serde_json::to_value(o).unwrap())
    }

    /// Every object of a resource (all namespaces).
    pub fn list(&self, group: &str, plural: &str) -> Vec<Value> {
        let api = api(&self.client, &resource(group, plural), None);
        block(async move { api.list(&Default::default()).await })
            .unwrap_or_else(|e| panic!("list {plural}: {e}"))
            .items
            .into_iter()
            .map(|o| serde_json::to_value(o).unwrap())
            .collect()
    }

    /// Creates an object; returns it as stored.
    pub fn create(&self, group: &str, plural: &str, ns: Option<&str>, obj: Value) -> Value {
        let ar = resource(group, plural);
        let api = api(&self.client, &ar, ns);
        let o = to_object(&ar, obj);
        serde_json::to_value(
            block(async move { api.create(&admin_params(), &o).await })
                .unwrap_or_else(|e| panic!("create {plural}: {e}")),
        )
        .unwrap()
    }

    /// Creates or replaces an object as another client that insists on its version (over
    /// whatever is stored, as `kubectl replace --force` would). Returns it as stored.
    pub fn put(&self, group: &str, plural: &str, ns: Option<&str>, obj: Value) -> Value {
        let ar = resource(group, plural);
        let api = api(&self.client, &ar, ns);
        let mut o = to_object(&ar, obj);
        let name = o.metadata.name.clone().expect("a name");
        let stored = block(async move {
            loop {
                let current = api.get_opt(&name).await?;
                let r = match current {
                    None => {
                        o.metadata.resource_version = None;
                        api.create(&admin_params(), &o).await
                    }
                    Some(c) => {
                        o.metadata.resource_version = c.metadata.resource_version;
                        o.metadata.managed_fields = None;
                        api.replace(&name, &admin_params(), &o).await
                    }
                };
                match r {
                    // Someone wrote in between (or created it first): take their version as
                    // the base and write ours over it again.
                    Err(e) if is_status(&e, 409) => continue,
                    r => return r,
                }
            }
        });
        serde_json::to_value(stored.unwrap_or_else(|e| panic!("put {plural}: {e}"))).unwrap()
    }

    /// Replaces the status of an object (its `status` subresource).
    pub fn put_status(&self, group: &str, plural: &str, ns: Option<&str>, obj: Value) -> Value {
        let ar = resource(group, plural);
        let api = api(&self.client, &ar, ns);
        let o = to_object(&ar, obj);
        let name = o.metadata.name.clone().expect("a name");
        serde_json::to_value(
            block(async move { api.replace_status(&name, &admin_params(), &o).await })
                .unwrap_or_else(|e| panic!("status of {plural}: {e}")),
        )
        .unwrap()
    }

    /// Deletes an object; false if there was none.
    pub fn delete(&self, group: &str, plural: &str, ns: Option<&str>, name: &str) -> bool {
        let api = api(&self.client, &resource(group, plural), ns);
        let name = name.to_string();
        match block(async move { api.delete(&name, &DeleteParams::default()).await }) {
            Ok(_) => true,
            Err(e) if is_status(&e, 404) => false,
            Err(e) => panic!("delete {plural}: {e}"),
        }
    }

    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// A namespace with labels, and its `default` ServiceAccount (which the controller-manager
    /// would make; pods need it).
    pub fn namespace(&self, name: &str, labels: Value) {
        self.create("", "namespaces", None, json!({"metadata": {"name": name, "labels": labels}}));
        self.create("", "serviceaccounts", Some(name), json!({"metadata": {"name": "default", "namespace": name}}));
    }
}

// ---- credentials ---------------------------------------------------------------------------------------

impl ApiServer {
    /// A token of ServiceAccount `ns/sa` from the TokenRequest API, valid for `audiences`
    /// (none: the API server's own), bound to pod `ns/pod` when given (then a TokenReview
    /// names the pod's node).
    pub fn token(&self, ns: &str, sa: &str, audiences: &[&str], pod: Option<&str>) -> String {
        use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
        use k8s_openapi::api::core::v1::ServiceAccount;
        let api: Api<ServiceAccount> = Api::namespaced(self.admin.client.clone(), ns);
        let bound = pod.map(|p| {
            let uid = self.get("", "pods", Some(ns), p).expect("the pod to bind to")["metadata"]["uid"].clone();
            BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(p.into()),
                uid: uid.as_str().map(str::to_string),
            }
        });
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: audiences.iter().map(|a| a.to_string()).collect(),
                bound_object_ref: bound,
                expiration_seconds: Some(3600),
            },
            ..Default::default()
        };
        let sa = sa.to_string();
        let r = block(async move { api.create_token_request(&sa, &PostParams::default(), &req).await })
            .unwrap_or_else(|e| panic!("TokenRequest: {e}"));
        r.status.expect("a token").token
    }

    /// A pod of ServiceAccount `ns/sa` bound to `node` (never run: there is no kubelet),
    /// made once; its name.
    pub fn pod_on(&self, ns: &str, sa: &str, node: &str) -> String {
        use nodeplane::controller::kube::state::node_hash;
        let name = format!("{sa}-{}", &node_hash(node)[..16]);
        if self.get("", "pods", Some(ns), &name).is_none() {
            self.create(
                "",
                "pods",
                Some(ns),
                json!({"metadata": {"name": name, "namespace": ns},
                       "spec": {"nodeName": node, "serviceAccountName": sa, "automountServiceAccountToken": false,
                                "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}),
            );
        }
        name
    }

    /// An agent's projected token for `node` (audience `nodeplane`, bound to an agent pod on
    /// that node, as the DaemonSet's projected volume gives it). The Node object should exist.
    pub fn agent_token(&self, node: &str) -> String {
        let pod = self.pod_on(NS, "nodeplane-agent", node);
        self.token(NS, "nodeplane-agent", &[AGENT_AUDIENCE], Some(&pod))
    }

    /// The controller's ServiceAccount token (what its pod mounts).
    pub fn controller_token(&self) -> &str {
        &self.controller_token
    }

    /// A kubeconfig for the controller: its ServiceAccount token, through the proxy.
    pub fn controller_kubeconfig(&self) -> String {
        kubeconfig_text(&self.url(), Some(&self.controller_token))
    }

    pub fn write_controller_kubeconfig(&self, path: &Path) {
        std::fs::write(path, self.controller_kubeconfig()).unwrap();
    }

    /// The controller's client configuration (through the proxy, its token), with its
    /// User-Agent as the controller sets it.
    pub async fn controller_config(&self) -> kube::Config {
        nodeplane::controller::kube::named(config_of(&self.controller_kubeconfig()).await)
    }

    /// The admin's configuration (its client certificate, straight to the API server).
    pub async fn admin_config(&self) -> kube::Config {
        config_of(&kubeconfig_text(&self.direct_url(), None)).await
    }

    /// A clonable handle on the admin's client (for a hook's action).
    pub fn admin(&self) -> Admin {
        self.admin.clone()
    }
}

// ---- the admission hook in force ---------------------------------------------------------------

impl ApiServer {
    /// Registers `hook` as a validating webhook for `rules` (operation, group, plural) and
    /// waits until the API server calls it (a dry-run ConfigMap create, which the hook also
    /// sees, shows the configuration is in force).
    pub fn register_admission_hook(&self, hook: &AdmissionHook, rules: &[(&str, &str, &str)]) {
        let mut rs: Vec<Value> = rules
            .iter()
            .map(|(op, g, p)| json!({"apiGroups": [g], "apiVersions": ["*"], "operations": [op], "resources": [p]}))
            .collect();
        rs.push(
            json!({"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["configmaps"]}),
        );
        let hook_cfg = json!({"metadata": {"name": "envtest-hook"},
            "webhooks": [{"name": "hook.envtest.nodeplane.dev", "rules": rs,
                "clientConfig": {"url": hook.url(), "caBundle": b64(&pki().ca_pem)},
                "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 10}]});
        self.create("admissionregistration.k8s.io", "validatingwebhookconfigurations", None, hook_cfg);
        let cms = api(&self.admin.client, &resource("", "configmaps"), Some("default"));
        wait_until("the admission hook in force", Duration::from_secs(30), || {
            let probe = to_object(&resource("", "configmaps"), json!({"metadata": {"name": "envtest-hook-probe"}}));
            let cms = cms.clone();
            let pp = PostParams { dry_run: true, ..Default::default() };
            let _ = block(async move { cms.create(&pp, &probe).await });
            hook.saw("envtest-hook-probe")
        });
    }
}

// ---- the audit log -------------------------------------------------------------------------------------

/// One request as the audit log recorded it.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub verb: String,
    pub group: String,
    /// Plural, or `plural/sub` for a subresource; empty for a non-resource URL.
    pub resource: String,
    pub namespace: String,
    pub user: String,
    pub user_agent: String,
    pub uri: String,
    /// The `fieldManager` query parameter ("" if none).
    pub field_manager: String,
    /// A list's `limit`, and whether it carried a `continue` token.
    pub limit: Option<String>,
    pub continued: bool,
    /// The response's status code, once the request completed.
    pub code: Option<u16>,
}

/// The audit log read as it grows: one [`Request`] per audit ID.
struct AuditLog {
    path: PathBuf,
    offset: u64,
    requests: Vec<Request>,
    by_id: BTreeMap<String, usize>,
}

impl AuditLog {
    fn new(path: PathBuf) -> AuditLog {
        AuditLog { path, offset: 0, requests: Vec::new(), by_id: BTreeMap::new() }
    }

    fn read(&mut self) {
        use std::io::Seek;
        let Ok(mut f) = std::fs::File::open(&self.path) else { return };
        f.seek(std::io::SeekFrom::Start(self.offset)).unwrap();
        let mut text = String::new();
        f.read_to_string(&mut text).unwrap();
        // Only whole lines: the last one may be being written.
        let Some(end) = text.rfind('\n') else { return };
        self.offset += end as u64 + 1;
        for line in text[..end].lines() {
            let ev: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("audit log: {e}: {line}"));
            self.add(&ev);
        }
    }

    fn add(&mut self, ev: &Value) {
        let id = ev["auditID"].as_str().unwrap_or("").to_string();
        let code = ev["responseStatus"]["code"].as_u64().map(|c| c as u16);
        if let Some(&i) = self.by_id.get(&id) {
            if code.is_some() {
                self.requests[i].code = code;
            }
            return;
        }
        let s = |v: &Value| v.as_str().unwrap_or("").to_string();
        let o = &ev["objectRef"];
        let mut resource = s(&o["resource"]);
        if let Some(sub) = o["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        let uri = s(&ev["requestURI"]);
        let query = |k: &str| query_param(&uri, k);
        self.by_id.insert(id, self.requests.len());
        self.requests.push(Request {
            verb: s(&ev["verb"]),
            group: s(&o["apiGroup"]),
            resource,
            namespace: s(&o["namespace"]),
            user: s(&ev["user"]["username"]),
            user_agent: s(&ev["userAgent"]),
            field_manager: query("fieldManager").unwrap_or_default(),
            limit: query("limit"),
            continued: query("continue").is_some_and(|c| !c.is_empty()),
            code,
            uri,
        });
    }
}

/// The value of `key` in a request URI's query, percent-decoded.
fn query_param(uri: &str, key: &str) -> Option<String> {
    let q = uri.split_once('?')?.1;
    q.split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == key).map(|(_, v)| percent_decode(v))
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match (b[i], b.get(i + 1..i + 3)) {
            (b'%', Some(h)) if u8::from_str_radix(std::str::from_utf8(h).unwrap_or("zz"), 16).is_ok() => {
                out.push(u8::from_str_radix(std::str::from_utf8(h).unwrap(), 16).unwrap());
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl ApiServer {
    /// Every request the audit log recorded so far (the API server's own loopback requests
    /// excepted), in arrival order.
    pub fn requests(&self) -> Vec<Request> {
        let mut a = self.audit.lock().unwrap();
        a.read();
        a.requests.clone()
    }

    /// The requests of one user.
    pub fn requests_of(&self, user: &str) -> Vec<Request> {
        self.requests().into_iter().filter(|r| r.user == user).collect()
    }

    /// The controller's requests (its ServiceAccount).
    pub fn controller_requests(&self) -> Vec<Request> {
        self.requests_of(CONTROLLER_USER)
    }
}
