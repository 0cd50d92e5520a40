//! The controller's Kubernetes mode against the in-process fake API server
//! (`tools/support/fake_apiserver.rs`): state in custom resources, block locks, optimistic
//! concurrency, leader election on a Lease, Node deletions (also across a 410 Gone relist),
//! agent identity by TokenReview, and two real controller processes failing over.

#[path = "../tools/support/fake_apiserver.rs"]
mod fake_apiserver;
#[path = "../tools/support/https_get.rs"]
mod https_get;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_apiserver::{FakeApiServer, UserInfo};
use kube::config::{KubeConfigOptions, Kubeconfig};
use nodeplane::controller::backend::Backend;
use nodeplane::controller::kube::lease::{Attempt, Elector, LeaseSettings};
use nodeplane::controller::kube::state::{KubeBackend, block_object_name};
use nodeplane::controller::kube::{API_CALLS, GROUP};
use nodeplane::controller::records::Pool;
use nodeplane::controller::records::{VolState, VolumeRecord};
use nodeplane::controller::store::Registry;
use nodeplane::util::Family;
use serde_json::json;

const CTL_TOKEN: &str = "controller-token";
const CTL_USER: &str = "system:serviceaccount:nodeplane-system:nodeplane-controller";
const AGENT_SA: &str = "system:serviceaccount:nodeplane-system:nodeplane-agent";
const NS: &str = "nodeplane-system";

fn fake() -> FakeApiServer {
    let f = FakeApiServer::start();
    f.add_token(CTL_TOKEN, UserInfo::new(CTL_USER));
    f.register(GROUP, "v1alpha1", "nodeplanenodes", "NodeplaneNode", false);
    f.register(GROUP, "v1alpha1", "ipblocks", "IPBlock", false);
    f.register(GROUP, "v1alpha1", "nodeplanevolumes", "NodeplaneVolume", false);
    f.register("", "v1", "secrets", "Secret", true);
    f.register("", "v1", "configmaps", "ConfigMap", true);
    f
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

async fn kube_config(f: &FakeApiServer) -> kube::Config {
    let kc = Kubeconfig::from_yaml(&f.kubeconfig_yaml(CTL_TOKEN)).unwrap();
    // As the controller builds its clients: with its User-Agent.
    nodeplane::controller::kube::named(
        kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap(),
    )
}

fn backend(f: &FakeApiServer) -> Arc<KubeBackend> {
    let cfg = rt().block_on(kube_config(f));
    Arc::new(KubeBackend::new(cfg, None).unwrap())
}

fn pools() -> Vec<Pool> {
    vec![
        Pool { net: "10.8.0.0/22".parse().unwrap(), block_prefix: 24 },
        Pool { net: "fd00:8::/62".parse().unwrap(), block_prefix: 64 },
    ]
}

fn registry(f: &FakeApiServer) -> Registry {
    Registry::with_backend(backend(f), pools()).unwrap()
}

/// cidr -> node of every IPBlock object.
fn locks(f: &FakeApiServer) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = f
        .list(GROUP, "ipblocks")
        .iter()
        .map(|o| (o["spec"]["cidr"].as_str().unwrap().to_string(), o["spec"]["node"].as_str().unwrap().to_string()))
        .collect();
    v.sort();
    v
}

/// Every request the controller sent carries its User-Agent, and every write its field
/// manager; returns how many writes there were.
fn assert_named_writes(f: &FakeApiServer) -> usize {
    let ua = format!("nodeplane-controller/{}", env!("CARGO_PKG_VERSION"));
    let mut writes = 0;
    // (Requests of the tests' stand-in for an operator's kubectl are not the controller's.)
    for r in f.requests().into_iter().filter(|r| !r.user_agent.starts_with("kubectl/")) {
        assert_eq!(r.user_agent, ua, "{r:?}");
        if matches!(r.verb.as_str(), "create" | "update" | "patch") {
            assert_eq!(r.field_manager, "nodeplane-controller", "{r:?}");
            writes += 1;
        }
    }
    writes
}

/// The field managers recorded in an object's managedFields.
fn managers_of(o: &serde_json::Value) -> BTreeSet<String> {
    o["metadata"]["managedFields"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["manager"].as_str().map(str::to_string))
        .collect()
}

fn lock_object(cidr: &str, node: &str) -> serde_json::Value {
    json!({"apiVersion": format!("{GROUP}/v1alpha1"), "kind": "IPBlock",
           "metadata": {"name": block_object_name(cidr)}, "spec": {"cidr": cidr, "node": node}})
}

#[test]
fn registry_state_lives_in_api_objects() {
    let f = fake();
    let r = registry(&f);
    let a = r.register("node-a", &["192.0.2.1".into()], "02:00:00:00:00:0a").unwrap();
    let b = r.register("node-b", &["192.0.2.2".into()], "").unwrap();
    assert_eq!(a.blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    assert_eq!(b.blocks, vec!["10.8.1.0/24", "fd00:8:0:1::/64"]);
    let more = r.request_block("node-a", Family::V4).unwrap();
    assert_eq!(more.blocks.len(), 3);
    // The record, in allocation order, and one lock per block.
    let rec = f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(rec["spec"]["blocks"], json!(["10.8.0.0/24", "fd00:8::/64", "10.8.2.0/24"]));
    assert_eq!(rec["spec"]["vtepMac"], "02:00:00:00:00:0a");
    assert_eq!(locks(&f).len(), 5);
    assert!(f.get(GROUP, "ipblocks", None, "v6-fd00-8---64").is_some());
    drop(r);
    // A new controller (new backend, new registry) finds the same state.
    let r = registry(&f);
    assert_eq!(r.get("node-a").unwrap(), more);
    assert_eq!(r.get("node-b").unwrap(), b);
    // Removal frees the locks; the next node gets the freed blocks.
    r.remove("node-a").unwrap();
    assert!(f.get(GROUP, "nodeplanenodes", None, "node-a").is_none());
    assert_eq!(locks(&f), vec![("10.8.1.0/24".into(), "node-b".into()), ("fd00:8:0:1::/64".into(), "node-b".into())]);
    let c = r.register("node-c", &["192.0.2.3".into()], "").unwrap();
    assert_eq!(c.blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    // Named writes: the field manager in managedFields, the User-Agent on every request.
    assert!(assert_named_writes(&f) >= 8);
    let controller: BTreeSet<String> = ["nodeplane-controller".to_string()].into();
    assert_eq!(managers_of(&f.get(GROUP, "nodeplanenodes", None, "node-c").unwrap()), controller);
    assert_eq!(managers_of(&f.get(GROUP, "ipblocks", None, "v4-10-8-0-0-24").unwrap()), controller);
}

#[test]
fn load_repairs_interrupted_changes_and_refuses_a_block_held_twice() {
    let f = fake();
    {
        let r = registry(&f);
        r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    }
    // A lock without a record: an old one (a crash between lock and record) is released at
    // load; a recent one may belong to a previous leader's change still in flight, so it is
    // kept and never handed out. A record whose lock vanished gets it back.
    let mut stale = lock_object("10.8.3.0/24", "node-z");
    stale["metadata"]["creationTimestamp"] = json!("2020-01-01T00:00:00Z");
    f.put_object(GROUP, "ipblocks", None, stale);
    f.put_object(GROUP, "ipblocks", None, lock_object("10.8.1.0/24", "node-y"));
    f.delete_object(GROUP, "ipblocks", None, &block_object_name("fd00:8::/64"));
    let r = registry(&f);
    assert_eq!(r.get("node-a").unwrap().blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    assert_eq!(
        locks(&f),
        vec![
            ("10.8.0.0/24".into(), "node-a".into()),
            ("10.8.1.0/24".into(), "node-y".into()),
            ("fd00:8::/64".into(), "node-a".into())
        ]
    );
    let b = r.register("node-b", &["192.0.2.2".into()], "").unwrap();
    assert_eq!(b.blocks[0], "10.8.2.0/24", "the reserved block is skipped");
    drop(r);
    f.delete_object(GROUP, "ipblocks", None, &block_object_name("10.8.1.0/24"));
    // A block locked for another node than the record says: refuse to start.
    f.put_object(GROUP, "ipblocks", None, lock_object("10.8.0.0/24", "node-q"));
    let e = Registry::with_backend(backend(&f), pools()).err().expect("must refuse").to_string();
    assert!(e.contains("10.8.0.0/24") && e.contains("node-q"), "{e}");
}

#[test]
fn a_second_writer_is_detected_not_overwritten() {
    let f = fake();
    let r = registry(&f);
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    // Someone else locks the block this registry would hand out next.
    f.put_object(GROUP, "ipblocks", None, lock_object("10.8.1.0/24", "intruder"));
    let e = r.register("node-b", &["192.0.2.2".into()], "").unwrap_err().to_string();
    assert!(e.contains("10.8.1.0/24") && e.contains("intruder"), "{e}");
    assert!(r.get("node-b").is_none(), "nothing recorded");
    assert_eq!(
        f.get(GROUP, "ipblocks", None, "v4-10-8-1-0-24").unwrap()["spec"]["node"],
        "intruder",
        "not overwritten"
    );
    assert!(
        f.get(GROUP, "ipblocks", None, &block_object_name("fd00:8:0:1::/64")).is_none(),
        "the v6 lock was not kept"
    );
    f.delete_object(GROUP, "ipblocks", None, "v4-10-8-1-0-24");
    // Someone else rewrites node-a's record: the next write of it fails with a conflict.
    let mut rec = f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    rec["spec"]["underlay"] = json!(["198.51.100.1"]);
    f.put_object(GROUP, "nodeplanenodes", None, rec);
    let e = r.request_block("node-a", Family::V4).unwrap_err().to_string();
    assert!(e.contains("another writer"), "{e}");
    assert_eq!(r.get("node-a").unwrap().blocks.len(), 2, "memory unchanged");
    assert_eq!(locks(&f).iter().filter(|(_, n)| n == "node-a").count(), 2, "the new lock was rolled back");
}

#[test]
fn a_failed_record_write_releases_the_new_locks() {
    let f = fake();
    let r = registry(&f);
    f.fail_next("create", "nodeplanenodes", 500, 1);
    assert!(r.register("node-a", &["192.0.2.1".into()], "").is_err());
    assert!(locks(&f).is_empty(), "{:?}", locks(&f));
    assert!(r.get("node-a").is_none());
    // The retry succeeds with the same blocks.
    assert_eq!(r.register("node-a", &["192.0.2.1".into()], "").unwrap().blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
}

#[test]
fn volume_records_round_trip() {
    let f = fake();
    let be = backend(&f);
    let v = |id: &str, state: VolState| VolumeRecord {
        id: id.into(),
        name: format!("claim-{id}"),
        node: "node-a".into(),
        size_bytes: 1 << 30,
        fs_type: nodeplane::storage::fs::FsType::Ext4,
        state,
        created_at: 1_700_000_000,
        parameters: [("csi.storage.k8s.io/fstype".to_string(), "ext4".to_string())].into(),
        kind: Default::default(),
        source_volume: String::new(),
        source_snapshot: String::new(),
    };
    be.commit_volumes(&[
        ("pvc-1".into(), Some(v("pvc-1", VolState::Creating))),
        ("Odd_Id".into(), Some(v("Odd_Id", VolState::Creating))),
    ])
    .unwrap();
    // A snapshot and a volume restored from it live in the same objects, told apart by kind.
    let snap = VolumeRecord {
        kind: nodeplane::controller::records::RecordKind::Snapshot,
        source_volume: "pvc-1".into(),
        ..v("snap-1", VolState::Ready)
    };
    let restored = VolumeRecord { source_snapshot: "snap-1".into(), ..v("pvc-2", VolState::Creating) };
    be.commit_volumes(&[("snap-1".into(), Some(snap.clone())), ("pvc-2".into(), Some(restored.clone()))]).unwrap();
    let obj = f.get(GROUP, "nodeplanevolumes", None, "snap-1").unwrap();
    assert_eq!((obj["spec"]["kind"].as_str(), obj["spec"]["sourceVolume"].as_str()), (Some("snapshot"), Some("pvc-1")));
    let obj = f.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert!(obj["spec"].get("kind").is_none(), "a plain volume's spec is as before: {obj}");
    let mut loaded = backend(&f).load_volumes().unwrap();
    loaded.sort_by(|a, b| a.id.cmp(&b.id));
    assert!(loaded.contains(&snap) && loaded.contains(&restored), "{loaded:?}");
    be.commit_volumes(&[("snap-1".into(), None), ("pvc-2".into(), None)]).unwrap();
    be.commit_volumes(&[("pvc-1".into(), Some(v("pvc-1", VolState::Ready)))]).unwrap();
    let obj = f.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert_eq!(obj["spec"]["state"], "ready");
    assert_eq!(obj["spec"]["sizeBytes"], 1u64 << 30);
    let be2 = backend(&f);
    let mut got = be2.load_volumes().unwrap();
    got.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(got, vec![v("Odd_Id", VolState::Creating), v("pvc-1", VolState::Ready)]);
    be2.commit_volumes(&[("Odd_Id".into(), None), ("pvc-1".into(), None)]).unwrap();
    assert!(f.list(GROUP, "nodeplanevolumes").is_empty());
    // A stale writer (the first backend) cannot resurrect or overwrite.
    assert!(be.commit_volumes(&[("pvc-1".into(), Some(v("pvc-1", VolState::Deleting)))]).is_err());
}

fn settings(identity: &str) -> LeaseSettings {
    LeaseSettings {
        namespace: NS.into(),
        name: "nodeplane-controller".into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1500),
        retry_period: Duration::from_millis(200),
    }
}

#[test]
fn leader_election_on_a_lease() {
    let f = fake();
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&f).await).unwrap();
        let mut a = Elector::new(client.clone(), settings("ctl-a"));
        let mut b = Elector::new(client.clone(), settings("ctl-b"));
        assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Leading);
        assert_eq!(b.try_acquire_or_renew().await.unwrap(), Attempt::HeldBy("ctl-a".into()));
        // A conflicting write (another candidate got there first) is a lost race, not a win.
        f.fail_next("update", "leases", 409, 1);
        assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Raced);
        assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Leading);
        // a stops renewing (crashed): b waits a full lease duration from when it last saw a
        // change, then takes over.
        let t = Instant::now();
        b.acquire(|_| {}).await;
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(1500) && waited < Duration::from_secs(5), "{waited:?}");
        let lease = f.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
        assert_eq!(lease["spec"]["holderIdentity"], "ctl-b");
        assert_eq!(lease["spec"]["leaseTransitions"], 1);
        // a comes back: it sees b holding it, and its own keep() reports the loss; its fence
        // refuses writes from then on, b's allows them.
        let lost = a.keep(std::future::pending()).await;
        assert!(lost.unwrap().contains("ctl-b"));
        assert!(a.fence().check().is_err());
        assert!(b.fence().check().is_ok());
        // b releases on shutdown: a new candidate takes over at once, no expiry wait.
        let keep_b = tokio::spawn(async move { b.keep(tokio::time::sleep(Duration::from_millis(300))).await });
        assert_eq!(keep_b.await.unwrap(), None);
        let mut c = Elector::new(client.clone(), settings("ctl-c"));
        let t = Instant::now();
        c.acquire(|_| {}).await;
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(c.fence().check().is_ok());
        // An API that stops answering makes the leader give up within the renew deadline, and
        // its fence closes no later than that.
        f.set_unavailable(true);
        let t = Instant::now();
        let lost = c.keep(std::future::pending()).await;
        assert!(lost.is_some() && t.elapsed() < Duration::from_secs(3), "{lost:?} {:?}", t.elapsed());
        assert!(c.fence().check().is_err());
        f.set_unavailable(false);
    });
    assert!(assert_named_writes(&f) >= 4);
    let lease = f.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
    assert_eq!(managers_of(&lease), ["nodeplane-controller".to_string()].into());
}

fn node_object(name: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn node_deletion_releases_blocks_also_across_a_relist() {
    let f = fake();
    for n in ["node-a", "node-b", "node-c"] {
        f.put_object("", "nodes", None, node_object(n));
    }
    let reg = Arc::new(registry(&f));
    for (i, n) in ["node-a", "node-b", "node-c", "node-d"].iter().enumerate() {
        reg.register(n, &[format!("192.0.2.{}", i + 1)], "").unwrap();
    }
    let rt = rt();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let client = rt.block_on(async { kube::Client::try_from(kube_config(&f).await).unwrap() });
    let gate = nodeplane::controller::kube::nodes::NodeGate::new(client.clone());
    let task = rt.spawn(nodeplane::controller::kube::nodes::follow(client, reg.clone(), gate, stop));
    // node-d has no Node object at all: released by the first list.
    wait_until("node-d released", Duration::from_secs(10), || reg.get("node-d").is_none());
    // A Delete event.
    f.delete_object("", "nodes", None, "node-b");
    wait_until("node-b released", Duration::from_secs(10), || reg.get("node-b").is_none());
    assert!(!locks(&f).iter().any(|(_, n)| n == "node-b" || n == "node-d"));
    // A deletion the watch never sees: the API is unreachable, node-c goes, history is
    // compacted and the watch closed; the watcher's resume gets 410 Gone, relists, and
    // finds node-c missing.
    f.set_paused(true);
    f.delete_object("", "nodes", None, "node-c");
    f.compact();
    f.close_watches();
    f.set_paused(false);
    wait_until("node-c released after the relist", Duration::from_secs(20), || reg.get("node-c").is_none());
    assert!(reg.get("node-a").is_some(), "node-a still has its Node object");
    let _ = stop_tx.send(true);
    rt.block_on(task).unwrap();
    // What it called is exactly what the RBAC grants for this part.
    let used: BTreeSet<(String, String)> =
        f.calls().into_iter().filter(|c| c.2 == "nodes").map(|c| (c.0, c.2)).collect();
    // (get: a node missing from a relist is confirmed gone before it is released.)
    assert_eq!(
        used,
        [("get", "nodes"), ("list", "nodes"), ("watch", "nodes")]
            .into_iter()
            .map(|(v, r)| (v.to_string(), r.to_string()))
            .collect()
    );
}

#[test]
fn agents_are_identified_by_token_review() {
    use nodeplane::controller::auth::{Authority, Identity};
    use nodeplane::controller::kube::review::{NODE_NAME_EXTRA, TokenReviewer};
    let f = fake();
    let agent = |node: &str, aud: &str, user: &str| UserInfo {
        username: user.into(),
        uid: "u".into(),
        groups: vec!["system:serviceaccounts".into()],
        extra: [(NODE_NAME_EXTRA.to_string(), vec![node.to_string()])].into(),
        audiences: vec![aud.into()],
    };
    f.add_token("tok-n1", agent("node-1", "nodeplane", AGENT_SA));
    f.add_token("tok-wrong-aud", agent("node-1", "vault", AGENT_SA));
    f.add_token("tok-other-sa", agent("node-1", "nodeplane", "system:serviceaccount:default:default"));
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&f).await).unwrap();
        let auth = Authority::new(b"0123456789abcdef0123456789abcdef".to_vec()).with_reviewer(TokenReviewer::new(
            client,
            "nodeplane",
            AGENT_SA,
        ));
        assert_eq!(auth.identify("Bearer tok-n1").await.unwrap(), Identity::Node("node-1".into()));
        assert!(
            Identity::Node("node-1".into()).may_act_for("node-1")
                && !Identity::Node("node-1".into()).may_act_for("node-2")
        );
        assert_eq!(auth.identify("Bearer tok-wrong-aud").await.unwrap_err().code(), tonic::Code::Unauthenticated);
        assert_eq!(auth.identify("Bearer tok-other-sa").await.unwrap_err().code(), tonic::Code::PermissionDenied);
        assert_eq!(auth.identify("Bearer nonsense").await.unwrap_err().code(), tonic::Code::Unauthenticated);
        // HMAC tokens keep working beside it (the admin's).
        let admin = auth.mint("@admin");
        assert_eq!(auth.identify(&format!("Bearer {admin}")).await.unwrap(), Identity::Admin);
        // An API server that cannot be asked is UNAVAILABLE (retry), not a denial.
        f.set_unavailable(true);
        assert_eq!(auth.identify("Bearer tok-unseen").await.unwrap_err().code(), tonic::Code::Unavailable);
        f.set_unavailable(false);
        // Verdicts are cached: a revoked token keeps working until the cache entry expires,
        // which is bounded (60 s) — the API is asked once per token per minute, not per call.
        let before = f.calls().iter().filter(|c| c.2 == "tokenreviews").count();
        auth.identify("Bearer tok-n1").await.unwrap();
        assert_eq!(f.calls().iter().filter(|c| c.2 == "tokenreviews").count(), before);
    });
}

// ---- two real controller processes ----------------------------------------------------------

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The status of `GET path` on the controller's health port, probed as kubelet probes it
/// (HTTPS, certificate not verified: these controllers serve TLS).
fn http_get(port: u16, path: &str) -> Option<u16> {
    https_get::get(port, path, https_get::Mode::Probe).ok().map(|r| r.0)
}

struct Ctl {
    proc: Proc,
    health: u16,
    grpc: u16,
}

/// The CA each controller's gRPC port is verified against (the helpers below connect over
/// TLS, as agents do).
static CAS: std::sync::Mutex<BTreeMap<u16, (PathBuf, Option<String>)>> = std::sync::Mutex::new(BTreeMap::new());

/// A controller serving TLS with a certificate from `certs init` in `dir/tls` (made once
/// per test dir, shared by its controllers as a mounted Secret would be).
fn controller(dir: &std::path::Path, kubeconfig: &std::path::Path, name: &str) -> Ctl {
    let tls = dir.join("tls");
    if !tls.join("tls.crt").exists() {
        let out = Command::new(env!("CARGO_BIN_EXE_nodeplane-controller"))
            .args(["certs", "init", "--san", "127.0.0.1", "--dir"])
            .arg(&tls)
            .output()
            .unwrap();
        assert!(out.status.success(), "certs init: {}", String::from_utf8_lossy(&out.stderr));
    }
    let ctl = controller_with(dir, kubeconfig, name, json!({"dir": tls}));
    CAS.lock().unwrap().insert(ctl.grpc, (tls.join("ca.crt"), None));
    ctl
}

fn controller_with(dir: &std::path::Path, kubeconfig: &std::path::Path, name: &str, tls: serde_json::Value) -> Ctl {
    let (health, grpc) = (free_port(), free_port());
    let data = dir.join(name);
    std::fs::create_dir_all(&data).unwrap();
    let cfg = json!({
        "dataDir": data, "listen": format!("127.0.0.1:{grpc}"), "healthAddress": format!("127.0.0.1:{health}"),
        "pools": [{"cidr": "10.8.0.0/22", "blockPrefix": 24}, {"cidr": "fd00:8::/62", "blockPrefix": 64}],
        "store": {"kind": "kubernetes", "namespace": NS, "leaseDurationSeconds": 3, "renewDeadlineSeconds": 2, "retryPeriodSeconds": 1},
        "agentAuth": {"kind": "tokenReview", "audience": "nodeplane", "serviceAccount": AGENT_SA},
        "tls": tls,
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_nodeplane-controller"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAME", name)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    Ctl { proc: Proc(child), health, grpc }
}

/// A TLS channel to the controller on `grpc`, verified as an agent verifies it.
async fn channel(grpc: u16) -> Result<tonic::transport::Channel, String> {
    let (ca_file, server_name) = CAS.lock().unwrap().get(&grpc).cloned().expect("a controller started by a helper");
    let files = nodeplane::rpc::tls::ClientFiles { ca_file, server_name, ..Default::default() };
    nodeplane::rpc::connect_with(&format!("127.0.0.1:{grpc}"), Some(&files)).await
}

async fn register(grpc: u16, token: &str, node: &str) -> Result<Vec<String>, tonic::Status> {
    use nodeplane::rpc::controller as pb;
    let ch = channel(grpc).await.map_err(tonic::Status::unavailable)?;
    let mut c = pb::node_registry_client::NodeRegistryClient::new(ch);
    let mut req = tonic::Request::new(pb::RegisterRequest {
        node_name: node.into(),
        underlay_addresses: vec!["192.0.2.9".into()],
        vtep_mac: String::new(),
    });
    req.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    Ok(c.register(req).await?.into_inner().node.unwrap().pod_blocks)
}

#[test]
fn two_controller_processes_fail_over_without_losing_blocks() {
    let f = fake();
    let dir = tempdir("kube-failover");
    let kubeconfig = dir.join("kubeconfig");
    f.write_kubeconfig(&kubeconfig, CTL_TOKEN);
    agent_token(&f, "agent-n1", "node-1");
    f.put_object("", "nodes", None, node_object("node-1"));
    let a = controller(&dir, &kubeconfig, "ctl-a");
    wait_until("ctl-a ready", Duration::from_secs(20), || http_get(a.health, "/readyz") == Some(200));
    let b = controller(&dir, &kubeconfig, "ctl-b");
    wait_until("ctl-b live", Duration::from_secs(20), || http_get(b.health, "/healthz") == Some(200));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(http_get(b.health, "/readyz"), Some(503), "the standby is not ready");
    let rt = rt();
    let blocks = rt.block_on(register(a.grpc, "agent-n1", "node-1")).unwrap();
    assert_eq!(blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    // The agent's token speaks for node-1 only.
    assert_eq!(rt.block_on(register(a.grpc, "agent-n1", "node-2")).unwrap_err().code(), tonic::Code::PermissionDenied);
    // kill -9 the leader: the standby takes over after the lease expires and serves the same
    // blocks (nothing lost, nothing handed out twice).
    let t = Instant::now();
    drop(a);
    wait_until("ctl-b leads", Duration::from_secs(20), || http_get(b.health, "/readyz") == Some(200));
    let failover = t.elapsed();
    assert_eq!(rt.block_on(register(b.grpc, "agent-n1", "node-1")).unwrap(), blocks);
    eprintln!("failover after kill -9 of the leader: {failover:?}");
    // A clean stop releases the lease: a new candidate leads at once.
    let c = controller(&dir, &kubeconfig, "ctl-c");
    wait_until("ctl-c live", Duration::from_secs(20), || http_get(c.health, "/healthz") == Some(200));
    unsafe { libc::kill(b.proc.0.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    wait_until("ctl-c leads", Duration::from_secs(20), || http_get(c.health, "/readyz") == Some(200));
    let handover = t.elapsed();
    eprintln!("handover after SIGTERM of the leader: {handover:?}");
    assert!(handover < Duration::from_secs(3), "{handover:?}");
    assert_eq!(rt.block_on(register(c.grpc, "agent-n1", "node-1")).unwrap(), blocks);
    drop(b);
    drop(c);
    // Every call the processes made is one the RBAC grants (API_CALLS), nothing more.
    let granted: BTreeSet<(String, String, String)> =
        API_CALLS.iter().map(|c| (c.verb.to_string(), c.group.to_string(), c.resource.to_string())).collect();
    for (verb, group, resource, _) in f.calls() {
        assert!(
            granted.contains(&(verb.clone(), group.clone(), resource.clone())),
            "{verb} {group}/{resource} is not in API_CALLS"
        );
    }
    // The processes name themselves on every request and write.
    assert!(assert_named_writes(&f) > 0);
}

/// A fresh directory, removed when dropped (also when the test fails).
struct TempDir(std::path::PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir(tag: &str) -> TempDir {
    let d = std::env::temp_dir().join(format!("np-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

#[test]
fn a_second_writer_is_a_typed_conflict() {
    use nodeplane::controller::backend::BackendError;
    use nodeplane::controller::store::RegistryError;
    let f = fake();
    let r = registry(&f);
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    let mut rec = f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    rec["spec"]["underlay"] = json!(["198.51.100.1"]);
    f.put_object(GROUP, "nodeplanenodes", None, rec);
    match r.request_block("node-a", Family::V4) {
        Err(RegistryError::Storage(BackendError::Conflict(m))) => assert!(m.contains("another writer"), "{m}"),
        other => panic!("want a conflict, got {other:?}"),
    }
}

// ---- issue 18: node names of any length, conflicts that are not another leader -------------

#[test]
fn node_names_of_any_valid_length_register_and_get_blocks() {
    use nodeplane::controller::kube::state::{NODE_ANNOTATION, NODE_HASH_LABEL, node_hash};
    use nodeplane::controller::store::RegistryError;
    let f = fake();
    let r = registry(&f);
    let n63 = "n".repeat(63);
    let n64 = format!("{}.example", "m".repeat(56));
    let n253 = format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61));
    assert_eq!((n63.len(), n64.len(), n253.len()), (63, 64, 253));
    for name in ["x", n63.as_str(), n64.as_str(), n253.as_str()] {
        let rec =
            r.register(name, &["192.0.2.1".into()], "").unwrap_or_else(|e| panic!("{} characters: {e}", name.len()));
        assert_eq!(rec.blocks.len(), 2, "{name}");
        let obj = f.get(GROUP, "nodeplanenodes", None, name).expect("the record is named after the node");
        assert_eq!(obj["metadata"]["labels"][NODE_HASH_LABEL], node_hash(name));
        for b in &rec.blocks {
            let lock = f.get(GROUP, "ipblocks", None, &block_object_name(b)).unwrap();
            assert_eq!(lock["spec"]["node"], name);
            assert_eq!(lock["metadata"]["annotations"][NODE_ANNOTATION], name);
            let hash = lock["metadata"]["labels"][NODE_HASH_LABEL].as_str().unwrap();
            assert_eq!((hash, hash.len()), (node_hash(name).as_str(), 56));
        }
    }
    assert_eq!(node_hash("x"), "54a2f7f92a5f975d8096af77a126edda7da60c5aa872ef1b871701ae", "printf x | sha224sum");
    // Found again by a new controller; a selector on the hash finds a node's locks.
    let r = registry(&f);
    assert_eq!(r.get(&n253).unwrap().blocks.len(), 2);
    // Invalid names: refused at Register, naming the rule; nothing written.
    let before = f.list(GROUP, "nodeplanenodes").len();
    for bad in ["Bad_Name", "a..b", "-a", "a.", &"z".repeat(254), ""] {
        let e = r.register(bad, &["192.0.2.1".into()], "").unwrap_err();
        assert!(matches!(e, RegistryError::InvalidArgument(_)), "{bad:?}: {e:?}");
        let m = e.to_string();
        assert!(m.contains("RFC 1123 subdomain") && m.contains("253 characters"), "{m}");
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
    }
    assert_eq!(f.list(GROUP, "nodeplanenodes").len(), before);
}

#[test]
fn objects_of_the_old_label_encoding_are_still_found_and_migrated() {
    use nodeplane::controller::kube::state::{NODE_HASH_LABEL, node_hash};
    let f = fake();
    // As written by the previous version: the node name itself in the label nodeplane.dev/node.
    let legacy = json!({"nodeplane.dev/node": "node-a", "app.kubernetes.io/managed-by": "nodeplane-controller"});
    f.put_object(
        GROUP,
        "nodeplanenodes",
        None,
        json!({"apiVersion": format!("{GROUP}/v1alpha1"), "kind": "NodeplaneNode",
        "metadata": {"name": "node-a", "labels": {"app.kubernetes.io/managed-by": "nodeplane-controller"}},
        "spec": {"underlay": ["192.0.2.1"], "vtepMac": "", "blocks": ["10.8.0.0/24"]}}),
    );
    let mut lock = lock_object("10.8.0.0/24", "node-a");
    lock["metadata"]["labels"] = legacy.clone();
    f.put_object(GROUP, "ipblocks", None, lock);
    f.put_object(GROUP, "nodeplanevolumes", None, json!({"apiVersion": format!("{GROUP}/v1alpha1"), "kind": "NodeplaneVolume",
        "metadata": {"name": "pvc-1", "labels": legacy},
        "spec": {"id": "pvc-1", "name": "claim", "node": "node-a", "sizeBytes": 1024, "fsType": "ext4", "state": "ready", "createdAt": 1}}));
    let be = backend(&f);
    let r = Registry::with_backend(be.clone(), pools()).unwrap();
    assert_eq!(r.get("node-a").unwrap().blocks, vec!["10.8.0.0/24"], "the old objects are found");
    let vols = be.load_volumes().unwrap();
    assert_eq!(vols.len(), 1);
    // A rewrite moves an object to the new encoding.
    let mut v = vols[0].clone();
    v.size_bytes = 2048;
    be.commit_volumes(&[("pvc-1".into(), Some(v))]).unwrap();
    let obj = f.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert!(obj["metadata"]["labels"].get("nodeplane.dev/node").is_none(), "{obj}");
    assert_eq!(obj["metadata"]["labels"][NODE_HASH_LABEL], node_hash("node-a"));
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    let obj = f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(obj["metadata"]["labels"][NODE_HASH_LABEL], node_hash("node-a"));
}

/// Another client (`kubectl label`'s field manager) merge-patches labels onto an object.
fn label_as_other_client(f: &FakeApiServer, plural: &str, name: &str, key: &str, value: &str) {
    let rt = rt();
    rt.block_on(async {
        let mut cfg = kube_config(f).await;
        cfg.headers = vec![(hyper::header::USER_AGENT, hyper::header::HeaderValue::from_static("kubectl/v1.36.0"))];
        let client = kube::Client::try_from(cfg).unwrap();
        let ar = match plural {
            "nodeplanenodes" => nodeplane::controller::kube::node_resource(),
            "ipblocks" => nodeplane::controller::kube::block_resource(),
            _ => nodeplane::controller::kube::volume_resource(),
        };
        let api: kube::Api<kube::api::DynamicObject> = kube::Api::all_with(client, &ar);
        let pp = kube::api::PatchParams { field_manager: Some("kubectl-label".into()), ..Default::default() };
        let p = json!({"metadata": {"labels": {key: value}}});
        api.patch(name, &pp, &kube::api::Patch::Merge(&p)).await.unwrap();
    });
}

#[test]
fn a_label_added_by_another_client_does_not_restart_the_leader() {
    use nodeplane::controller::backend::BackendError;
    use nodeplane::controller::store::RegistryError;
    let f = fake();
    let rt = rt();
    let client = rt.block_on(async { kube::Client::try_from(kube_config(&f).await).unwrap() });
    let mut el = Elector::new(client, settings("ctl-a"));
    let fence = el.fence();
    let mut renew = || assert_eq!(rt.block_on(el.try_acquire_or_renew()).unwrap(), Attempt::Leading);
    renew();
    let cfg = rt.block_on(kube_config(&f));
    let be = Arc::new(KubeBackend::new(cfg, Some(fence.clone())).unwrap());
    let r = Registry::with_backend(be.clone(), pools()).unwrap();
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    // An operator labels the record and a block lock.
    label_as_other_client(&f, "nodeplanenodes", "node-a", "team", "net");
    label_as_other_client(&f, "ipblocks", "v4-10-8-0-0-24", "audit", "2026");
    renew();
    // The leader's next write meets 409 Conflict, re-reads, sees the Lease still its own, merges.
    let rec = r.request_block("node-a", Family::V4).expect("the leader keeps writing");
    assert_eq!(rec.blocks.len(), 3);
    assert!(fence.check().is_ok() && fence.lost().is_none(), "not fenced");
    let obj = f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(obj["metadata"]["labels"]["team"], "net", "the other client's label is kept: {obj}");
    assert_eq!(obj["spec"]["blocks"].as_array().unwrap().len(), 3);
    let managers = managers_of(&obj);
    assert!(managers.contains("kubectl-label") && managers.contains("nodeplane-controller"), "{managers:?}");
    // ... and the write after that too (no conflict left behind; it keeps the label).
    r.register("node-a", &["192.0.2.7".into()], "").unwrap();
    let obj = f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(
        (obj["metadata"]["labels"]["team"].as_str(), obj["spec"]["underlay"][0].as_str()),
        (Some("net"), Some("192.0.2.7"))
    );
    // The labelled lock is untouched by the writes, and released normally with its node.
    let lock = f.get(GROUP, "ipblocks", None, "v4-10-8-0-0-24").unwrap();
    assert_eq!(lock["metadata"]["labels"]["audit"], "2026");
    assert_eq!(managers_of(&lock), ["kubectl-label".to_string(), "nodeplane-controller".to_string()].into());
    // A spec edited by hand is put back by the leader's next write (the leader owns the spec).
    let mut edited = f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    edited["spec"]["underlay"] = json!(["198.51.100.1"]);
    f.put_object(GROUP, "nodeplanenodes", None, edited);
    renew();
    r.register("node-a", &["192.0.2.8".into()], "").unwrap();
    assert_eq!(f.get(GROUP, "nodeplanenodes", None, "node-a").unwrap()["spec"]["underlay"], json!(["192.0.2.8"]));
    // Volumes too.
    let vol = VolumeRecord {
        id: "pvc-1".into(),
        name: "claim".into(),
        node: "node-a".into(),
        size_bytes: 1 << 20,
        fs_type: nodeplane::storage::fs::FsType::Ext4,
        state: VolState::Creating,
        created_at: 1,
        parameters: Default::default(),
        kind: Default::default(),
        source_volume: String::new(),
        source_snapshot: String::new(),
    };
    be.commit_volumes(&[("pvc-1".into(), Some(vol.clone()))]).unwrap();
    label_as_other_client(&f, "nodeplanevolumes", "pvc-1", "backup", "yes");
    be.commit_volumes(&[("pvc-1".into(), Some(VolumeRecord { state: VolState::Ready, ..vol }))]).unwrap();
    let obj = f.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert_eq!(
        (obj["metadata"]["labels"]["backup"].as_str(), obj["spec"]["state"].as_str()),
        (Some("yes"), Some("ready"))
    );
    label_as_other_client(&f, "nodeplanevolumes", "pvc-1", "backup", "no");
    be.commit_volumes(&[("pvc-1".into(), None)]).unwrap();
    assert!(
        f.get(GROUP, "nodeplanevolumes", None, "pvc-1").is_none(),
        "a delete after another client's change goes through"
    );
    assert!(r.remove("node-a").is_ok());
    assert!(locks(&f).is_empty());
    assert!(fence.lost().is_none());
    assert!(assert_named_writes(&f) > 0);
    // Only another holder of the Lease fences: ctl-b takes the Lease, someone changes a record.
    r.register("node-b", &["192.0.2.2".into()], "").unwrap();
    let mut lease = f.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
    lease["spec"]["holderIdentity"] = json!("ctl-b");
    f.put_object("coordination.k8s.io", "leases", Some(NS), lease);
    label_as_other_client(&f, "nodeplanenodes", "node-b", "team", "x");
    match r.request_block("node-b", Family::V4) {
        Err(RegistryError::Storage(BackendError::Conflict(m))) => assert!(m.contains("ctl-b"), "{m}"),
        other => panic!("want a fencing conflict, got {other:?}"),
    }
    assert!(fence.lost().is_some() && fence.check().is_err(), "fenced");
}

#[test]
fn a_deleted_nodes_agent_is_refused_and_its_blocks_stay_released() {
    use nodeplane::controller::kube::nodes::{AdmitError, NodeGate, follow};
    use nodeplane::controller::store::RegistryError;
    let f = fake();
    for n in ["node-a", "node-b"] {
        f.put_object("", "nodes", None, node_object(n));
    }
    let reg = Arc::new(registry(&f));
    let rt = rt();
    let client = rt.block_on(async { kube::Client::try_from(kube_config(&f).await).unwrap() });
    let gate = NodeGate::new(client.clone());
    let g = gate.clone();
    reg.set_admission(Arc::new(move |n: &str| g.refused(n)));
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let task = rt.spawn(follow(client, reg.clone(), gate.clone(), stop));
    // What the server does at Register: admit (FAILED_PRECONDITION when refused), then register.
    let register = |node: &str| -> Result<Vec<String>, tonic::Code> {
        match rt.block_on(gate.admit(node)) {
            Err(AdmitError::Refused(m)) => {
                assert!(m.contains(node), "{m}");
                return Err(tonic::Code::FailedPrecondition);
            }
            Err(AdmitError::Unavailable(m)) => panic!("{m}"),
            Ok(()) => {}
        }
        reg.register(node, &["192.0.2.1".into()], "").map(|r| r.blocks).map_err(|e| tonic::Status::from(e).code())
    };
    assert_eq!(register("node-a").unwrap().len(), 2);
    assert_eq!(register("node-b").unwrap().len(), 2);
    // No Node object at all: refused, nothing written.
    assert_eq!(register("node-c"), Err(tonic::Code::FailedPrecondition));
    assert!(f.get(GROUP, "nodeplanenodes", None, "node-c").is_none());
    // node-b's Node is deleted while its agent runs: released, and its agent's next Register
    // is refused; so is one that got past the admission before the deletion was seen (the
    // registry asks the gate under its lock).
    f.delete_object("", "nodes", None, "node-b");
    wait_until("node-b released", Duration::from_secs(10), || reg.get("node-b").is_none());
    assert_eq!(register("node-b"), Err(tonic::Code::FailedPrecondition));
    match reg.register("node-b", &["192.0.2.2".into()], "") {
        Err(RegistryError::FailedPrecondition(m)) => assert!(m.contains("node-b") && m.contains("Node object"), "{m}"),
        other => panic!("want FAILED_PRECONDITION, got {other:?}"),
    }
    let ghosts = |f: &FakeApiServer| {
        f.get(GROUP, "nodeplanenodes", None, "node-b").is_some() || locks(f).iter().any(|(_, n)| n == "node-b")
    };
    assert!(!ghosts(&f), "no ghost NodeplaneNode or IPBlock");
    // Across relists (the watch breaks, history is compacted: a fresh list), the agent keeps
    // retrying and keeps being refused; no ghost comes back.
    for round in 0..2 {
        let lists = || f.calls().iter().filter(|c| c.0 == "list" && c.2 == "nodes").count();
        let before = lists();
        // (While the watch is held, another Node appears: the watch's resourceVersion is then
        // older than the compaction, so its resume gets 410 Gone and the watcher lists again.)
        f.set_paused(true);
        f.put_object("", "nodes", None, node_object(&format!("node-z{round}")));
        f.compact();
        f.close_watches();
        f.set_paused(false);
        wait_until("a relist", Duration::from_secs(20), || lists() > before);
        for _ in 0..3 {
            assert_eq!(register("node-b"), Err(tonic::Code::FailedPrecondition), "round {round}");
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(!ghosts(&f), "round {round}: no ghost NodeplaneNode or IPBlock");
        assert!(reg.get("node-b").is_none());
    }
    assert!(reg.get("node-a").is_some(), "node-a keeps its blocks");
    // A Node being deleted (deletionTimestamp set, finalizers pending) may not register either.
    let mut a = f.get("", "nodes", None, "node-a").unwrap();
    a["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    f.put_object("", "nodes", None, a);
    wait_until("node-a seen being deleted", Duration::from_secs(10), || gate.refused("node-a").is_some());
    assert_eq!(register("node-a"), Err(tonic::Code::FailedPrecondition));
    // A Node object that comes back (same name, a new machine) registers again.
    f.put_object("", "nodes", None, node_object("node-b"));
    wait_until("node-b seen again", Duration::from_secs(10), || gate.refused("node-b").is_none());
    assert_eq!(register("node-b").unwrap().len(), 2);
    let _ = stop_tx.send(true);
    rt.block_on(task).unwrap();
}

// ---- the token-signing secret in a Secret --------------------------------------------------

async fn admin_list(grpc: u16, token: &str) -> Result<usize, tonic::Code> {
    use nodeplane::rpc::controller as pb;
    let ch = channel(grpc).await.map_err(|_| tonic::Code::Unavailable)?;
    let mut c = pb::node_registry_client::NodeRegistryClient::new(ch);
    let mut req = tonic::Request::new(pb::WatchNodesRequest { node_name: String::new(), ..Default::default() });
    req.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    let mut stream = c.watch_nodes(req).await.map_err(|s| s.code())?.into_inner();
    Ok(stream.message().await.map_err(|s| s.code())?.map(|l| l.nodes.len()).unwrap_or(0))
}

fn mint(dir: &std::path::Path, kubeconfig: &std::path::Path, name: &str, identity: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeplane-controller"))
        .args(["token", "--config"])
        .arg(dir.join(format!("{name}.json")))
        .arg(identity)
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAME", name)
        .output()
        .unwrap();
    assert!(out.status.success(), "token: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn two_controllers_starting_together_agree_on_the_token_secret() {
    use nodeplane::controller::kube::secret::{DEFAULT_NAME, load_or_create};
    let f = fake();
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&f).await).unwrap();
        let (a, b) = tokio::join!(
            load_or_create(client.clone(), NS, DEFAULT_NAME),
            load_or_create(client.clone(), NS, DEFAULT_NAME)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b);
        assert!(a.current.len() >= 32 && a.previous.is_none());
        assert_eq!(load_or_create(client.clone(), NS, DEFAULT_NAME).await.unwrap(), a, "read, not made again");
    });
    let creates = f.requests().iter().filter(|r| r.resource == "secrets" && r.verb == "create").count();
    assert!((1..=2).contains(&creates), "{creates}");
    let s = f.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    assert_eq!(s["type"], "Opaque");
    assert_eq!(managers_of(&s), ["nodeplane-controller".to_string()].into());
    // Emptied by hand: a key is added (update), not a second Secret.
    let mut s = s;
    s["data"] = json!({});
    f.put_object("", "secrets", Some(NS), s);
    let keys = rt().block_on(async {
        load_or_create(kube::Client::try_from(kube_config(&f).await).unwrap(), NS, DEFAULT_NAME).await.unwrap()
    });
    assert!(keys.current.len() >= 32);
    assert!(
        f.requests()
            .iter()
            .any(|r| r.resource == "secrets" && r.verb == "update" && r.field_manager == "nodeplane-controller")
    );
    // A key too short is an error, not silently replaced.
    let mut s = f.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    s["data"]["previous"] = json!("c2hvcnQ=");
    f.put_object("", "secrets", Some(NS), s);
    let e = rt().block_on(async {
        load_or_create(kube::Client::try_from(kube_config(&f).await).unwrap(), NS, DEFAULT_NAME).await.unwrap_err()
    });
    assert!(e.contains("previous") && e.contains("fewer than 32"), "{e}");
}

#[test]
fn an_admin_token_survives_a_controller_restart() {
    let f = fake();
    let dir = tempdir("kube-hmac");
    let kubeconfig = dir.join("kubeconfig");
    f.write_kubeconfig(&kubeconfig, CTL_TOKEN);
    f.put_object("", "nodes", None, node_object("node-1"));
    let a = controller(&dir, &kubeconfig, "ctl-a");
    wait_until("ctl-a ready", Duration::from_secs(20), || http_get(a.health, "/readyz") == Some(200));
    let secret = f.get("", "secrets", Some(NS), "nodeplane-controller-hmac").expect("the Secret was generated");
    assert!(secret["data"]["current"].as_str().is_some_and(|k| k.len() >= 44), "{secret}");
    let admin = mint(&dir, &kubeconfig, "ctl-a", "@admin");
    let node = mint(&dir, &kubeconfig, "ctl-a", "node-1");
    let rt = rt();
    assert_eq!(rt.block_on(admin_list(a.grpc, &admin)), Ok(0));
    assert_eq!(rt.block_on(register(a.grpc, &node, "node-1")).unwrap().len(), 2);
    // A new controller pod: nothing of the old one's data dir survives (an emptyDir).
    unsafe { libc::kill(a.proc.0.id() as i32, libc::SIGTERM) };
    drop(a);
    std::fs::remove_dir_all(dir.join("ctl-a")).unwrap();
    assert!(!dir.join("secret").exists() && !dir.join("ctl-b").join("secret").exists());
    let b = controller(&dir, &kubeconfig, "ctl-b");
    wait_until("ctl-b ready", Duration::from_secs(20), || http_get(b.health, "/readyz") == Some(200));
    assert_eq!(rt.block_on(admin_list(b.grpc, &admin)), Ok(1), "the @admin token minted before the restart works");
    assert_eq!(rt.block_on(register(b.grpc, &node, "node-1")).unwrap().len(), 2);
    // Rollover: the old key becomes `previous`, a new `current` signs; old tokens still work.
    let mut s = f.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    let old_key = s["data"]["current"].clone();
    s["data"] = json!({"current": "bmV3LWtleS1uZXcta2V5LW5ldy1rZXktbmV3LWtleS0zMmJ5dGVz", "previous": old_key});
    f.put_object("", "secrets", Some(NS), s);
    unsafe { libc::kill(b.proc.0.id() as i32, libc::SIGTERM) };
    drop(b);
    let c = controller(&dir, &kubeconfig, "ctl-c");
    wait_until("ctl-c ready", Duration::from_secs(20), || http_get(c.health, "/readyz") == Some(200));
    let admin2 = mint(&dir, &kubeconfig, "ctl-c", "@admin");
    assert_ne!(admin2, admin, "signed with the new key");
    assert_eq!(rt.block_on(admin_list(c.grpc, &admin)), Ok(1), "the previous key's token during the rollover");
    assert_eq!(rt.block_on(admin_list(c.grpc, &admin2)), Ok(1));
    // The rollover ends (previous removed): the old token is refused, the new one works.
    let mut s = f.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    s["data"].as_object_mut().unwrap().remove("previous");
    f.put_object("", "secrets", Some(NS), s);
    unsafe { libc::kill(c.proc.0.id() as i32, libc::SIGTERM) };
    drop(c);
    let d = controller(&dir, &kubeconfig, "ctl-d");
    wait_until("ctl-d ready", Duration::from_secs(20), || http_get(d.health, "/readyz") == Some(200));
    assert_eq!(rt.block_on(admin_list(d.grpc, &admin)), Err(tonic::Code::Unauthenticated));
    assert_eq!(rt.block_on(admin_list(d.grpc, &admin2)), Ok(1));
    drop(d);
    // What the processes called is in API_CALLS (the RBAC), the Secret's included.
    let granted: BTreeSet<(String, String, String)> =
        API_CALLS.iter().map(|c| (c.verb.to_string(), c.group.to_string(), c.resource.to_string())).collect();
    for (verb, group, resource, _) in f.calls() {
        assert!(
            granted.contains(&(verb.clone(), group.clone(), resource.clone())),
            "{verb} {group}/{resource} is not in API_CALLS"
        );
    }
    assert!(assert_named_writes(&f) > 0);
}

#[test]
fn register_through_the_controller_checks_the_name_then_the_node_object() {
    let f = fake();
    let dir = tempdir("kube-register-rules");
    let kubeconfig = dir.join("kubeconfig");
    f.write_kubeconfig(&kubeconfig, CTL_TOKEN);
    let long = format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61));
    for n in ["node-1", long.as_str()] {
        f.put_object("", "nodes", None, node_object(n));
    }
    let a = controller(&dir, &kubeconfig, "ctl-a");
    wait_until("ctl-a ready", Duration::from_secs(20), || http_get(a.health, "/readyz") == Some(200));
    let admin = mint(&dir, &kubeconfig, "ctl-a", "@admin");
    let rt = rt();
    // A 253-character name with its Node object registers and gets its blocks.
    assert_eq!(rt.block_on(register(a.grpc, &admin, &long)).unwrap().len(), 2);
    // Invalid names: INVALID_ARGUMENT naming the rule (also when no Node could have it).
    for bad in ["Bad_Name", "a..b", &"z".repeat(254)] {
        let e = rt.block_on(register(a.grpc, &admin, bad)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}: {e:?}");
        assert!(e.message().contains("RFC 1123 subdomain"), "{}", e.message());
    }
    // A valid name without a Node object: FAILED_PRECONDITION naming it; nothing written.
    let e = rt.block_on(register(a.grpc, &admin, "node-2")).unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("\"node-2\"") && e.message().contains("Node object"), "{}", e.message());
    assert!(f.get(GROUP, "nodeplanenodes", None, "node-2").is_none());
    assert!(!locks(&f).iter().any(|(_, n)| n == "node-2"));
    // The Node object appears: the same agent's next try registers.
    f.put_object("", "nodes", None, node_object("node-2"));
    wait_until("node-2 admitted", Duration::from_secs(10), || rt.block_on(register(a.grpc, &admin, "node-2")).is_ok());
    // Deleted while its agent runs: released, and refused from then on.
    f.delete_object("", "nodes", None, "node-2");
    wait_until("node-2 released", Duration::from_secs(10), || f.get(GROUP, "nodeplanenodes", None, "node-2").is_none());
    assert_eq!(rt.block_on(register(a.grpc, &admin, "node-2")).unwrap_err().code(), tonic::Code::FailedPrecondition);
    assert!(!locks(&f).iter().any(|(_, n)| n == "node-2"));
    drop(a);
}

#[test]
fn a_leader_whose_lease_was_freed_by_someone_else_stops() {
    let f = fake();
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&f).await).unwrap();
        let mut a = Elector::new(client, settings("ctl-a"));
        a.acquire(|_| {}).await;
        // Someone (another holder's release, or a hand edit) empties the holder: a's next
        // renewal would take the free lease again, but another controller may have led in
        // between, so a stops instead of trusting what it knows.
        let mut lease = f.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
        lease["spec"]["holderIdentity"] = serde_json::Value::Null;
        f.put_object("coordination.k8s.io", "leases", Some(NS), lease);
        let lost = a.keep(std::future::pending()).await.expect("lost");
        assert!(lost.contains("released or taken over"), "{lost}");
        assert!(a.fence().check().is_err());
        // A label on the Lease by another client is not a loss (a renewal races, then renews).
        let mut b = Elector::new(kube::Client::try_from(kube_config(&f).await).unwrap(), settings("ctl-b"));
        b.acquire(|_| {}).await;
        let mut lease = f.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
        lease["metadata"]["labels"] = json!({"team": "net"});
        f.put_object("coordination.k8s.io", "leases", Some(NS), lease);
        let kept = b.keep(tokio::time::sleep(Duration::from_millis(1200))).await;
        assert_eq!(kept, None, "b kept leading until told to stop");
        let lease = f.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
        assert_eq!(lease["metadata"]["labels"]["team"], "net", "the label is kept by the renewals");
    });
}

// ---- TLS without cert-manager (tls.bootstrap) ----------------------------------------------

#[test]
fn tls_bootstrap_makes_one_ca_that_agents_verify_across_restarts() {
    let f = fake();
    let dir = tempdir("kube-tls");
    let kubeconfig = dir.join("kubeconfig");
    f.write_kubeconfig(&kubeconfig, CTL_TOKEN);
    f.put_object("", "nodes", None, node_object("node-1"));
    let svc = format!("nodeplane-controller.{NS}.svc");
    let start = |name: &str| {
        let c = controller_with(&dir, &kubeconfig, name, json!({"bootstrap": {}}));
        wait_until(&format!("{name} ready"), Duration::from_secs(20), || http_get(c.health, "/readyz") == Some(200));
        c
    };
    let a = start("ctl-a");
    let secret = f.get("", "secrets", Some(NS), "nodeplane-controller-tls").expect("the TLS Secret was generated");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    for k in ["tls.crt", "tls.key", "ca.crt", "ca.key"] {
        assert!(secret["data"][k].as_str().is_some_and(|v| !v.is_empty()), "{k} missing: {secret}");
    }
    // The agents' CA bundle: the ConfigMap.
    let cm = f.get("", "configmaps", Some(NS), "nodeplane-ca").expect("the CA ConfigMap was published");
    let ca_pem = cm["data"]["ca.crt"].as_str().unwrap().to_string();
    let ca_file = dir.join("ca-from-configmap.crt");
    std::fs::write(&ca_file, &ca_pem).unwrap();
    // Verified against the Service's DNS name, as agents reach it.
    CAS.lock().unwrap().insert(a.grpc, (ca_file.clone(), Some(svc.clone())));
    let admin = mint(&dir, &kubeconfig, "ctl-a", "@admin");
    let rt = rt();
    assert_eq!(rt.block_on(admin_list(a.grpc, &admin)), Ok(0));
    // A name the certificate does not carry is refused.
    CAS.lock().unwrap().insert(a.grpc, (ca_file.clone(), Some("evil.example".into())));
    assert_eq!(rt.block_on(admin_list(a.grpc, &admin)), Err(tonic::Code::Unavailable));
    let served = std::fs::read(dir.join("ctl-a/tls/tls.crt")).unwrap();
    unsafe { libc::kill(a.proc.0.id() as i32, libc::SIGTERM) };
    drop(a);
    // A new pod with an empty data dir: the same CA and certificate, from the Secret.
    std::fs::remove_dir_all(dir.join("ctl-a")).unwrap();
    let b = start("ctl-b");
    assert_eq!(std::fs::read(dir.join("ctl-b/tls/tls.crt")).unwrap(), served, "the Secret's certificate is reused");
    CAS.lock().unwrap().insert(b.grpc, (ca_file, Some(svc)));
    assert_eq!(rt.block_on(admin_list(b.grpc, &admin)), Ok(0), "the CA bundle the agents mounted still verifies it");
    let creates = |plural: &str| f.requests().iter().filter(|r| r.resource == plural && r.verb == "create").count();
    assert_eq!(creates("configmaps"), 1);
    assert_eq!(f.get("", "configmaps", Some(NS), "nodeplane-ca").unwrap()["data"]["ca.crt"], ca_pem.as_str());
    assert!(
        f.requests()
            .iter()
            .filter(|r| r.resource == "secrets" && r.verb == "create")
            .all(|r| r.field_manager == "nodeplane-controller")
    );
}

#[test]
fn tls_bootstrap_agrees_under_a_start_race_and_renews_with_the_same_ca() {
    use k8s_openapi::api::core::v1::Secret;
    use nodeplane::controller::certs::Ca;
    use nodeplane::controller::config::Bootstrap;
    use nodeplane::controller::kube::tls::bootstrap;
    use nodeplane::rpc::tls::{ServerFiles, certs_of, not_after};
    let f = fake();
    let dir = tempdir("kube-tls-race");
    let b = Bootstrap {
        namespace: NS.into(),
        secret_name: "nodeplane-controller-tls".into(),
        ca_config_map_name: "nodeplane-ca".into(),
        dns_names: vec![format!("nodeplane-controller.{NS}.svc")],
    };
    let files = |n: &str| ServerFiles {
        cert_file: dir.join(n).join("tls.crt"),
        key_file: dir.join(n).join("tls.key"),
        client_ca_file: None,
    };
    let read = |n: &str| std::fs::read_to_string(dir.join(n).join("tls.crt")).unwrap();
    let secret = || -> Secret {
        serde_json::from_value(f.get("", "secrets", Some(NS), "nodeplane-controller-tls").unwrap()).unwrap()
    };
    let text = |s: &Secret, k: &str| String::from_utf8(s.data.as_ref().unwrap()[k].0.clone()).unwrap();
    let days_left = |pem: &str| (not_after(&certs_of(pem.as_bytes(), "c").unwrap()[0]).unwrap() - now_secs()) / 86400;
    // Two controllers starting at the same moment.
    let run = |x: &str, y: &str| {
        let (fx, fy) = (files(x), files(y));
        rt().block_on(async {
            let client = kube::Client::try_from(kube_config(&f).await).unwrap();
            let (rx, ry) = tokio::join!(bootstrap(client.clone(), &b, &fx), bootstrap(client.clone(), &b, &fy));
            rx.unwrap();
            ry.unwrap();
        })
    };

    // Two controllers starting at once against no Secret: one CA, one pair, both serve it.
    run("a", "b");
    assert_eq!(read("a"), read("b"), "both controllers serve the same certificate");
    let s = secret();
    assert_eq!(text(&s, "tls.crt"), read("a"));
    let ca_pem = text(&s, "ca.crt");
    let cm = f.get("", "configmaps", Some(NS), "nodeplane-ca").unwrap();
    assert_eq!(cm["data"]["ca.crt"], ca_pem.as_str(), "the published CA is the Secret's");
    let creates = |plural: &str| f.requests().iter().filter(|r| r.resource == plural && r.verb == "create").count();
    assert!((1..=2).contains(&creates("secrets")), "a create each at most");
    assert!(days_left(&read("a")) > 300);

    // 10 days left (signed by the same CA): re-issued at the next start by that CA, so the
    // agents' CA bundle still verifies it; the ConfigMap is not rewritten.
    let ca = Ca::load(&ca_pem, &text(&s, "ca.key")).unwrap();
    let (near, near_key) = ca.issue_server(&b.dns_names, 10).unwrap();
    let mut s = s;
    let data = s.data.as_mut().unwrap();
    data.insert("tls.crt".into(), k8s_openapi::ByteString(near.clone().into_bytes()));
    data.insert("tls.key".into(), k8s_openapi::ByteString(near_key.into_bytes()));
    f.put_object("", "secrets", Some(NS), serde_json::to_value(&s).unwrap());
    let updates_before = f.requests().iter().filter(|r| r.resource == "configmaps" && r.verb == "update").count();
    run("c", "d");
    let renewed = read("c");
    assert_eq!(renewed, read("d"));
    assert_ne!(renewed, near, "a certificate with 10 days left is renewed");
    assert!(days_left(&renewed) > 300, "renewed for a year");
    let s = secret();
    assert_eq!(text(&s, "ca.crt"), ca_pem, "the CA stays");
    let acc = ServerFiles { cert_file: dir.join("c/tls.crt"), key_file: dir.join("c/tls.key"), client_ca_file: None };
    nodeplane::rpc::tls::Acceptor::load(acc).expect("the renewed pair loads (key matches)");
    let chain = webpki_chains(&ca_pem, &renewed, &b.dns_names[0]);
    assert!(chain.is_ok(), "the renewed certificate chains to the published CA: {chain:?}");
    assert_eq!(
        f.requests().iter().filter(|r| r.resource == "configmaps" && r.verb == "update").count(),
        updates_before
    );

    // A DNS name added to the configuration: re-issued naming it, same CA.
    let mut b2 = b.clone();
    b2.dns_names.push("controller.example".into());
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&f).await).unwrap();
        bootstrap(client, &b2, &files("e")).await.unwrap();
    });
    assert!(webpki_chains(&ca_pem, &read("e"), "controller.example").is_ok());
    assert_eq!(text(&secret(), "ca.crt"), ca_pem);
}

fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

/// Does `cert` (PEM) verify against CA `ca` (PEM) for `name`, as an agent verifies it?
fn webpki_chains(ca: &str, cert: &str, name: &str) -> Result<(), String> {
    use nodeplane::rpc::tls::{certs_of, provider, roots_of};
    let roots = roots_of(ca.as_bytes(), "ca")?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| e.to_string())?;
    let leaf = certs_of(cert.as_bytes(), "cert")?;
    let name = rustls::pki_types::ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    use rustls::client::danger::ServerCertVerifier;
    verifier
        .verify_server_cert(&leaf[0], &leaf[1..], &name, &[], rustls::pki_types::UnixTime::now())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

// ---- DRA: ResourceSlices from the nodes' reports, claims served to nodes --------------------

fn agent_token(f: &FakeApiServer, token: &str, node: &str) {
    f.add_token(
        token,
        UserInfo {
            username: AGENT_SA.into(),
            uid: format!("uid-{node}"),
            groups: vec![],
            extra: [(nodeplane::controller::kube::review::NODE_NAME_EXTRA.to_string(), vec![node.to_string()])].into(),
            audiences: vec!["nodeplane".into()],
        },
    );
}

fn dra_device(name: &str, numa: i64) -> nodeplane::rpc::controller::DraDevice {
    use nodeplane::rpc::controller as pb;
    pb::DraDevice {
        name: name.into(),
        attributes: [
            ("numaNode".to_string(), pb::DeviceAttribute { value: Some(pb::device_attribute::Value::Int(numa)) }),
            (
                "vendor".to_string(),
                pb::DeviceAttribute { value: Some(pb::device_attribute::Value::String("acme".into())) },
            ),
            (
                "driverVersion".to_string(),
                pb::DeviceAttribute { value: Some(pb::device_attribute::Value::Version("0.1.0".into())) },
            ),
        ]
        .into(),
        // Written in the API server's canonical form ("1024k"), so that what is read back
        // compares equal and an unchanged pool is never rewritten.
        capacity: [("size".to_string(), "1024000".to_string())].into(),
    }
}

async fn registry_client(
    grpc: u16,
) -> nodeplane::rpc::controller::node_registry_client::NodeRegistryClient<tonic::transport::Channel> {
    nodeplane::rpc::controller::node_registry_client::NodeRegistryClient::new(channel(grpc).await.unwrap())
}

fn bearer<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

async fn report(
    grpc: u16,
    token: &str,
    node: &str,
    devices: Vec<nodeplane::rpc::controller::DraDevice>,
) -> Result<(), tonic::Status> {
    report_epoch(grpc, token, node, devices, 1).await
}

async fn report_epoch(
    grpc: u16,
    token: &str,
    node: &str,
    devices: Vec<nodeplane::rpc::controller::DraDevice>,
    epoch: u64,
) -> Result<(), tonic::Status> {
    use nodeplane::rpc::controller as pb;
    let req = pb::ReportDevicesRequest { node_name: node.into(), driver: "dra.nodeplane.dev".into(), devices, epoch };
    registry_client(grpc).await.report_devices(bearer(req, token)).await.map(|_| ())
}

/// node → (generation, device names, slices) of the published pools.
fn pools_in(f: &FakeApiServer) -> BTreeMap<String, (i64, Vec<String>, usize)> {
    let mut out: BTreeMap<String, (i64, Vec<String>, usize)> = BTreeMap::new();
    for s in f.list("resource.k8s.io", "resourceslices") {
        let node = s["spec"]["nodeName"].as_str().unwrap().to_string();
        let e = out.entry(node).or_default();
        e.0 = s["spec"]["pool"]["generation"].as_i64().unwrap();
        e.1.extend(s["spec"]["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()));
        e.2 += 1;
    }
    out
}

#[test]
fn dra_slices_follow_the_nodes_reports_and_claims_are_served_to_their_node_only() {
    use nodeplane::rpc::controller as pb;
    // ResourceSlices and ResourceClaims are among the fake's built-in resources.
    let f = fake();
    let dir = tempdir("kube-dra");
    let kubeconfig = dir.join("kubeconfig");
    f.write_kubeconfig(&kubeconfig, CTL_TOKEN);
    agent_token(&f, "agent-n1", "node-1");
    agent_token(&f, "agent-n2", "node-2");
    f.put_object("", "nodes", None, node_object("node-1"));
    f.put_object("", "nodes", None, node_object("node-2"));
    let ctl = controller(&dir, &kubeconfig, "ctl");
    wait_until("controller ready", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    let rt = rt();
    // Before any report: no ResourceSlice call at all (a cluster without DRA sees none).
    std::thread::sleep(Duration::from_millis(300));
    assert!(!f.calls().iter().any(|c| c.2 == "resourceslices"), "{:?}", f.calls());
    rt.block_on(register(ctl.grpc, "agent-n1", "node-1")).unwrap();
    rt.block_on(register(ctl.grpc, "agent-n2", "node-2")).unwrap();
    rt.block_on(report(ctl.grpc, "agent-n1", "node-1", vec![dra_device("gpu-b", 1), dra_device("gpu-a", 0)])).unwrap();
    wait_until("node-1's pool", Duration::from_secs(5), || pools_in(&f).contains_key("node-1"));
    let slices = f.list("resource.k8s.io", "resourceslices");
    assert_eq!(slices.len(), 1);
    let s = &slices[0];
    assert_eq!(s["metadata"]["name"], "node-1-dra.nodeplane.dev-0");
    assert_eq!(s["metadata"]["labels"]["app.kubernetes.io/managed-by"], "nodeplane-controller");
    assert_eq!(s["spec"]["driver"], "dra.nodeplane.dev");
    assert_eq!(s["spec"]["nodeName"], "node-1");
    assert_eq!(s["spec"]["pool"], json!({"name": "node-1", "generation": 1, "resourceSliceCount": 1}));
    // Owned by the Node object: the API's garbage collector deletes it with the Node, also
    // while no controller runs.
    let node_uid = f.get("", "nodes", None, "node-1").unwrap()["metadata"]["uid"].clone();
    assert_eq!(
        s["metadata"]["ownerReferences"],
        json!([{"apiVersion": "v1", "kind": "Node", "name": "node-1", "uid": node_uid}])
    );
    assert_eq!(
        s["spec"]["devices"][0],
        json!({"name": "gpu-a", "attributes": {"numaNode": {"int": 0}, "vendor": {"string": "acme"}, "driverVersion": {"version": "0.1.0"}},
               "capacity": {"size": {"value": "1024k"}}})
    );
    assert_eq!(s["spec"]["devices"][1]["name"], "gpu-b");
    // The same report again, and a pass over every pool (another node's first report wakes
    // the publisher): node-1's slice is not written again.
    let rv = |f: &FakeApiServer, name: &str| {
        f.get("resource.k8s.io", "resourceslices", None, name).map(|s| s["metadata"]["resourceVersion"].clone())
    };
    let before = rv(&f, "node-1-dra.nodeplane.dev-0");
    rt.block_on(report(ctl.grpc, "agent-n1", "node-1", vec![dra_device("gpu-a", 0), dra_device("gpu-b", 1)])).unwrap();
    rt.block_on(report(ctl.grpc, "agent-n2", "node-2", vec![dra_device("fpga-0", 0)])).unwrap();
    wait_until("node-2's pool", Duration::from_secs(5), || pools_in(&f).contains_key("node-2"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rv(&f, "node-1-dra.nodeplane.dev-0"), before, "an unchanged pool was rewritten");
    // kubelet restarts and deletes its node's slices; the agent reports the same devices
    // under a new epoch (kubelet registered the plugin again): the pool is written again.
    assert!(f.delete_object("resource.k8s.io", "resourceslices", None, "node-2-dra.nodeplane.dev-0"));
    let t = Instant::now();
    rt.block_on(report_epoch(ctl.grpc, "agent-n2", "node-2", vec![dra_device("fpga-0", 0)], 2)).unwrap();
    wait_until("node-2's pool written again", Duration::from_secs(2), || pools_in(&f).contains_key("node-2"));
    eprintln!("new epoch -> wiped pool written again: {:?}", t.elapsed());
    assert_eq!(pools_in(&f)["node-2"].1, ["fpga-0"]);
    // A device plugged in: the pool's next generation lists it.
    let t = Instant::now();
    rt.block_on(report(
        ctl.grpc,
        "agent-n1",
        "node-1",
        vec![dra_device("gpu-a", 0), dra_device("gpu-b", 1), dra_device("gpu-c", 0)],
    ))
    .unwrap();
    wait_until("gpu-c published", Duration::from_secs(1), || pools_in(&f)["node-1"].1.contains(&"gpu-c".to_string()));
    eprintln!("report -> ResourceSlice updated: {:?}", t.elapsed());
    assert_eq!(pools_in(&f)["node-1"], (2, vec!["gpu-a".into(), "gpu-b".into(), "gpu-c".into()], 1));
    // One removed (unplugged or unhealthy: the agent leaves it out): it leaves the pool.
    rt.block_on(report(ctl.grpc, "agent-n1", "node-1", vec![dra_device("gpu-a", 0), dra_device("gpu-c", 0)])).unwrap();
    wait_until("gpu-b gone", Duration::from_secs(1), || !pools_in(&f)["node-1"].1.contains(&"gpu-b".to_string()));
    assert_eq!(pools_in(&f)["node-1"].0, 3);
    // A node speaks for itself only; a malformed report is refused and changes nothing.
    assert_eq!(
        rt.block_on(report(ctl.grpc, "agent-n1", "node-2", vec![dra_device("x", 0)])).unwrap_err().code(),
        tonic::Code::PermissionDenied
    );
    let e = rt.block_on(report(ctl.grpc, "agent-n1", "node-1", vec![dra_device("Bad_Name", 0)])).unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let mut bad_version = dra_device("gpu-a", 0);
    bad_version.attributes.insert(
        "driverVersion".into(),
        pb::DeviceAttribute { value: Some(pb::device_attribute::Value::Version("v1".into())) },
    );
    let e = rt.block_on(report(ctl.grpc, "agent-n1", "node-1", vec![bad_version])).unwrap_err();
    assert!(e.code() == tonic::Code::InvalidArgument && e.message().contains("semantic version"), "{e:?}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        pools_in(&f)["node-1"],
        (3, vec!["gpu-a".into(), "gpu-c".into()], 1),
        "a refused report changed the pool"
    );

    // Claims: a node gets its own results of this driver, nothing of another node.
    let claim = f.put_object(
        "resource.k8s.io",
        "resourceclaims",
        Some("team-a"),
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "gpus", "namespace": "team-a"},
               "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "nodeplane.dev", "count": 2}}]}},
               "status": {"allocation": {"devices": {"results": [
                   {"request": "gpu", "driver": "dra.nodeplane.dev", "pool": "node-1", "device": "gpu-a"},
                   {"request": "gpu", "driver": "dra.nodeplane.dev", "pool": "node-1", "device": "gpu-c"},
                   {"request": "gpu", "driver": "gpu.example.com", "pool": "node-1", "device": "other"}]}}}}),
    );
    let uid = claim["metadata"]["uid"].as_str().unwrap().to_string();
    let get = |token: &str, node: &str, name: &str, uid: &str| {
        let req = pb::GetClaimRequest {
            node_name: node.into(),
            namespace: "team-a".into(),
            name: name.into(),
            uid: uid.into(),
        };
        rt.block_on(async {
            registry_client(ctl.grpc).await.get_claim(bearer(req, token)).await.map(|r| r.into_inner().results)
        })
    };
    let got = get("agent-n1", "node-1", "gpus", &uid).unwrap();
    assert_eq!(
        got.iter().map(|r| (r.request.as_str(), r.device.as_str())).collect::<Vec<_>>(),
        [("gpu", "gpu-a"), ("gpu", "gpu-c")]
    );
    assert!(got.iter().all(|r| r.driver == "dra.nodeplane.dev" && r.pool == "node-1"));
    // Another node's claim, another UID, a missing claim: one answer (NOT_FOUND naming the
    // claim), so a node learns nothing about claims that are not its own.
    let other = get("agent-n2", "node-2", "gpus", &uid).unwrap_err();
    let wrong_uid = get("agent-n1", "node-1", "gpus", "another-uid").unwrap_err();
    let missing = get("agent-n1", "node-1", "missing", "u").unwrap_err();
    for e in [&other, &wrong_uid, &missing] {
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    }
    assert!(missing.message().contains("team-a/missing"), "{missing:?}");
    assert_eq!(
        other.message(),
        format!("ResourceClaim team-a/gpus ({uid}) has no allocation of dra.nodeplane.dev on node \"node-2\"")
    );
    assert_eq!(get("agent-n1", "node-2", "gpus", &uid).unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(get("agent-n1", "node-1", "Not/A/Name", "u").unwrap_err().code(), tonic::Code::InvalidArgument);

    // The Node object goes: its pool goes, the other node's stays.
    assert!(f.delete_object("", "nodes", None, "node-1"));
    wait_until("node-1's pool deleted", Duration::from_secs(10), || !pools_in(&f).contains_key("node-1"));
    assert!(pools_in(&f).contains_key("node-2"));
    // A restarted controller finds the published pool and does not rewrite it for the same
    // report; a changed one continues the generation from the API.
    let gen2 = pools_in(&f)["node-2"].0;
    let before = rv(&f, "node-2-dra.nodeplane.dev-0");
    drop(ctl);
    let ctl = controller(&dir, &kubeconfig, "ctl2");
    wait_until("controller ready again", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    rt.block_on(report_epoch(ctl.grpc, "agent-n2", "node-2", vec![dra_device("fpga-0", 0)], 2)).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rv(&f, "node-2-dra.nodeplane.dev-0"), before, "a restarted controller rewrote an unchanged pool");
    rt.block_on(report_epoch(
        ctl.grpc,
        "agent-n2",
        "node-2",
        vec![dra_device("fpga-0", 0), dra_device("fpga-1", 0)],
        2,
    ))
    .unwrap();
    wait_until("fpga-1 published", Duration::from_secs(5), || pools_in(&f)["node-2"].1.len() == 2);
    assert_eq!(pools_in(&f)["node-2"].0, gen2 + 1, "the generation continues from the published pool");
    drop(ctl);
    let granted: BTreeSet<(String, String, String)> =
        API_CALLS.iter().map(|c| (c.verb.to_string(), c.group.to_string(), c.resource.to_string())).collect();
    for (verb, group, resource, _) in f.calls() {
        assert!(
            granted.contains(&(verb.clone(), group.clone(), resource.clone())),
            "{verb} {group}/{resource} is not in API_CALLS"
        );
    }
}

// ---- NetworkPolicy: compiled from the API's objects, streamed to the node ------------------

#[test]
fn network_policy_follows_the_apis_policies_pods_and_namespaces() {
    use nodeplane::rpc::controller as pb;
    let f = fake();
    let dir = tempdir("kube-netpol");
    let kubeconfig = dir.join("kubeconfig");
    f.write_kubeconfig(&kubeconfig, CTL_TOKEN);
    agent_token(&f, "agent-n1", "node-1");
    f.put_object("", "nodes", None, node_object("node-1"));
    f.put_object("", "namespaces", None, json!({"metadata": {"name": "x", "labels": {"team": "a"}}}));
    f.put_object("", "namespaces", None, json!({"metadata": {"name": "y", "labels": {"team": "b"}}}));
    for (ns, pod) in [("x", "a"), ("y", "b")] {
        f.put_object(
            "",
            "pods",
            Some(ns),
            json!({"metadata": {"namespace": ns, "name": pod, "labels": {"pod": pod}},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080}]}]}}),
        );
    }
    f.put_object("networking.k8s.io", "networkpolicies", Some("x"), json!({"metadata": {"namespace": "x", "name": "from-team-b"},
        "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                 "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}], "ports": [{"port": "http"}]}]}}));
    let ctl = controller(&dir, &kubeconfig, "ctl");
    wait_until("controller ready", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    let rt = rt();
    let blocks = rt.block_on(register(ctl.grpc, "agent-n1", "node-1")).unwrap();
    let v4: ipnetwork::Ipv4Network = blocks.iter().find_map(|b| b.parse().ok()).unwrap();
    let ip = |i: u32| std::net::Ipv4Addr::from(u32::from(v4.network()) + i).to_string();
    rt.block_on(async {
        let ch = channel(ctl.grpc).await.unwrap();
        let mut c = pb::network_policies_client::NetworkPoliciesClient::new(ch);
        fn authed<M>(m: M) -> tonic::Request<M> {
            let mut r = tonic::Request::new(m);
            r.metadata_mut().insert("authorization", "Bearer agent-n1".parse().unwrap());
            r
        }
        let mut stream =
            c.watch_policy(authed(pb::WatchPolicyRequest { node_name: "node-1".into() })).await.unwrap().into_inner();
        let snap = stream.message().await.unwrap().unwrap();
        assert!(snap.snapshot && snap.pods.is_empty(), "{snap:?}");
        // The pods attached on node-1 (their labels come from the API).
        for (ns, pod, i) in [("x", "a", 2), ("y", "b", 3)] {
            let pa = pb::PodAddress { namespace: ns.into(), name: pod.into(), ips: vec![ip(i)] };
            let r = c
                .pod_started(authed(pb::PodStartedRequest { node_name: "node-1".into(), pod: Some(pa) }))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.isolated, ns == "x", "{ns}/{pod}: {r:?}");
        }
        // Someone else's addresses are refused: a node acts only on its own blocks.
        let foreign = pb::PodAddress { namespace: "x".into(), name: "z".into(), ips: vec!["192.0.2.1".into()] };
        let e = c
            .pod_started(authed(pb::PodStartedRequest { node_name: "node-1".into(), pod: Some(foreign) }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        // Local mode's object API is refused here: objects come from the API.
        let mut admin = tonic::Request::new(pb::ApplyObjectsRequest { json: "{}".into() });
        admin.metadata_mut().insert("authorization", "Bearer agent-n1".parse().unwrap());
        assert_eq!(c.apply_objects(admin).await.unwrap_err().code(), tonic::Code::PermissionDenied);
        // The stream's view: x/a isolated by x/from-team-b, which admits y's pods (y/b) on the
        // named port resolved on x/a.
        let mut view = nodeplane::net::policy::View::default();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let u = tokio::time::timeout(deadline - Instant::now(), stream.message())
                .await
                .expect("the view")
                .unwrap()
                .unwrap();
            view = view.applied(&u).unwrap();
            if view.pods.len() == 2
                && !view.policies.is_empty()
                && view.address_sets.values().any(|s| !s.cidrs.is_empty())
            {
                break;
            }
        }
        let xa = &view.pods["x/a"];
        assert!(!xa.ingress_group.is_empty() && xa.egress_group.is_empty(), "{xa:?}");
        let pol = view.policies.values().next().unwrap();
        assert_eq!(pol.name, "x/from-team-b");
        let set = view.address_sets.values().next().unwrap();
        assert_eq!(set.cidrs, vec![format!("{}/32", ip(3))], "team b = y/b");
        let ports = view.port_sets.values().next().unwrap();
        assert_eq!((ports.targets[0].ip.as_str(), ports.targets[0].port), (ip(2).as_str(), 8080));
        // The namespace's labels change in the API: y is no longer team b, the set empties.
        f.put_object("", "namespaces", None, json!({"metadata": {"name": "y", "labels": {"team": "c"}}}));
        loop {
            let u = tokio::time::timeout(Duration::from_secs(5), stream.message())
                .await
                .expect("a change")
                .unwrap()
                .unwrap();
            assert!(!u.snapshot);
            view = view.applied(&u).unwrap();
            if view.address_sets.values().all(|s| s.cidrs.is_empty()) {
                break;
            }
        }
        // The policy deleted in the API: x/a is no longer isolated, its group and policy go.
        assert!(f.delete_object("networking.k8s.io", "networkpolicies", Some("x"), "from-team-b"));
        loop {
            let u = tokio::time::timeout(Duration::from_secs(5), stream.message())
                .await
                .expect("a change")
                .unwrap()
                .unwrap();
            view = view.applied(&u).unwrap();
            if view.policies.is_empty() {
                break;
            }
        }
        assert!(view.groups.is_empty() && view.pods["x/a"].ingress_group.is_empty(), "{view:?}");
    });
    // Only list and watch, as the RBAC grants.
    let granted: BTreeSet<(String, String, String)> =
        API_CALLS.iter().map(|c| (c.verb.to_string(), c.group.to_string(), c.resource.to_string())).collect();
    for (verb, group, resource) in f.calls().into_iter().map(|c| (c.0, c.1, c.2)) {
        assert!(
            granted.contains(&(verb.clone(), group.clone(), resource.clone())),
            "{verb} {group}/{resource} is not in API_CALLS"
        );
    }
    for r in ["networkpolicies", "pods", "namespaces"] {
        assert!(f.calls().iter().any(|c| c.2 == r && c.0 == "watch"), "{r} is watched");
    }
}

/// Issue 21: a registry of 5,000 nodes (records and block locks) loads from the API in pages
/// (`limit` 500 and `continue`, every page from the snapshot of the first, as the fake serves
/// them), not in one answer, and nothing is lost between pages; the stream then serves it.
#[test]
fn a_5000_node_registry_loads_in_pages() {
    const N: usize = 5000;
    let f = fake();
    for i in 0..N {
        let name = format!("node-{i:05}");
        let v4 = format!("10.{}.{}.0/24", i / 256, i % 256);
        f.put_object(GROUP, "nodeplanenodes", None, json!({"apiVersion": format!("{GROUP}/v1alpha1"), "kind": "NodeplaneNode",
            "metadata": {"name": name}, "spec": {"underlay": [format!("198.18.{}.{}", i / 250, 1 + i % 250)], "vtepMac": "", "blocks": [v4]}}));
        f.put_object(GROUP, "ipblocks", None, lock_object(&v4, &name));
    }
    let pools = vec![Pool { net: "10.0.0.0/8".parse().unwrap(), block_prefix: 24 }];
    let r = Registry::with_backend(backend(&f), pools).unwrap();
    assert_eq!(r.node_count(), N);
    assert_eq!(r.get("node-04999").unwrap().blocks, vec!["10.19.135.0/24"]);
    // The next free block is after all of them: every lock was read.
    let more = r.register("node-new", &["198.18.100.1".into()], "").unwrap();
    assert_eq!(more.blocks, vec![format!("10.{}.{}.0/24", N / 256, N % 256)]);
    let lists: Vec<_> = f.requests().into_iter().filter(|q| q.verb == "list").collect();
    for res in ["nodeplanenodes", "ipblocks"] {
        let pages: Vec<_> = lists.iter().filter(|q| q.resource == res).collect();
        assert_eq!(pages.len(), N / 500, "{res}: {} pages", pages.len());
        assert!(pages.iter().all(|q| q.limit.as_deref() == Some("500")), "{res}: {pages:?}");
        assert_eq!(pages.iter().filter(|q| q.continued).count(), N / 500 - 1, "{res}");
    }
    // The membership stream starts with all of them (one shared snapshot).
    match r.follow(0, 0).0 {
        nodeplane::controller::store::Start::Snapshot(s) => assert_eq!(s.nodes.len(), N + 1),
        _ => panic!("a new client gets a snapshot"),
    }
}

/// A continue token the API server let expire between two pages (410 Expired, as after a
/// compaction) starts the list again from a fresh snapshot: nothing half-listed is used.
#[test]
fn an_expired_continue_token_restarts_the_list() {
    let f = fake();
    for i in 0..1200 {
        let v4 = format!("10.{}.{}.0/24", i / 256, i % 256);
        f.put_object(GROUP, "ipblocks", None, lock_object(&v4, &format!("node-{i:05}")));
        f.put_object(GROUP, "nodeplanenodes", None, json!({"apiVersion": format!("{GROUP}/v1alpha1"), "kind": "NodeplaneNode",
            "metadata": {"name": format!("node-{i:05}")}, "spec": {"underlay": ["198.18.0.1"], "vtepMac": "", "blocks": [v4]}}));
    }
    // The second page's token has expired, twice: the third list goes through.
    f.expire_continue(2);
    let pools = vec![Pool { net: "10.0.0.0/8".parse().unwrap(), block_prefix: 24 }];
    let r = Registry::with_backend(backend(&f), pools).unwrap();
    assert_eq!(r.node_count(), 1200);
    let starts =
        f.requests().into_iter().filter(|q| q.verb == "list" && q.resource == "nodeplanenodes" && !q.continued).count();
    assert_eq!(starts, 3, "the list started again after each expired token");
}
