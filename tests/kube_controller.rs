//! The controller's Kubernetes mode against a real kube-apiserver (v1.36, from `K8S_BIN`)
//! and etcd (`tools/support/envtest.rs`: an API server of each test's own, the project's
//! CRDs and RBAC applied, the controller running as its ServiceAccount): state in custom
//! resources, block locks, optimistic concurrency, leader election on a Lease, Node deletions
//! (also across a 410 Gone relist), agent identity by TokenReview, and real controller
//! processes failing over. What the controller sent is read from the API server's audit log.

#[path = "../tools/support/api_hooks.rs"]
mod api_hooks;
#[path = "../tools/support/envtest.rs"]
mod envtest;
#[path = "../tools/support/fault_proxy.rs"]
mod fault_proxy;
use crate::https_get;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use api_hooks::{AdmissionHook, AuditHook, Verdict};
use envtest::{ApiServer, CONTROLLER_USER, NS, wait_until};
use nodeplane::controller::backend::Backend;
use nodeplane::controller::kube::lease::{Attempt, Elector, LeaseSettings};
use nodeplane::controller::kube::state::{KubeBackend, block_object_name};
use nodeplane::controller::kube::{API_CALLS, GROUP};
use nodeplane::controller::records::Pool;
use nodeplane::controller::records::{VolState, VolumeRecord};
use nodeplane::controller::store::Registry;
use nodeplane::util::Family;
use serde_json::json;

const AGENT_SA: &str = envtest::AGENT_USER;

/// A cluster of the test's own: a kube-apiserver on its own etcd prefix.
fn cluster() -> ApiServer {
    ApiServer::start()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The controller's client configuration: its ServiceAccount token, its User-Agent, through
/// the fault proxy.
async fn kube_config(k: &ApiServer) -> kube::Config {
    k.controller_config().await
}

fn backend(k: &ApiServer) -> Arc<KubeBackend> {
    let cfg = rt().block_on(kube_config(k));
    Arc::new(KubeBackend::new(cfg, None).unwrap())
}

fn pools() -> Vec<Pool> {
    vec![
        Pool { net: "10.8.0.0/22".parse().unwrap(), block_prefix: 24 },
        Pool { net: "fd00:8::/62".parse().unwrap(), block_prefix: 64 },
    ]
}

fn registry(k: &ApiServer) -> Registry {
    Registry::with_backend(backend(k), pools()).unwrap()
}

/// cidr -> node of every IPBlock object.
fn locks(k: &ApiServer) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = k
        .list(GROUP, "ipblocks")
        .iter()
        .map(|o| (o["spec"]["cidr"].as_str().unwrap().to_string(), o["spec"]["node"].as_str().unwrap().to_string()))
        .collect();
    v.sort();
    v
}

/// Every request the controller sent (as its ServiceAccount) carries its User-Agent, and
/// every write its field manager; returns how many writes there were.
fn assert_named_writes(k: &ApiServer) -> usize {
    let ua = format!("nodeplane-controller/{}", env!("CARGO_PKG_VERSION"));
    let mut writes = 0;
    for r in k.controller_requests() {
        assert_eq!(r.user_agent, ua, "{r:?}");
        if matches!(r.verb.as_str(), "create" | "update" | "patch") {
            assert_eq!(r.field_manager, "nodeplane-controller", "{r:?}");
            writes += 1;
        }
    }
    writes
}

/// Every request the controller made is one `API_CALLS` lists, and the RBAC of
/// `daemonset/base/rbac.yaml` allowed it (no 403).
fn assert_granted(k: &ApiServer) {
    let granted: BTreeSet<(String, String, String)> =
        API_CALLS.iter().map(|c| (c.verb.to_string(), c.group.to_string(), c.resource.to_string())).collect();
    for r in k.controller_requests() {
        assert!(
            granted.contains(&(r.verb.clone(), r.group.clone(), r.resource.clone())),
            "{} {}/{} is not in API_CALLS: {r:?}",
            r.verb,
            r.group,
            r.resource
        );
        assert_ne!(r.code, Some(403), "the RBAC refused {r:?}");
    }
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
    let k = cluster();
    let r = registry(&k);
    let a = r.register("node-a", &["192.0.2.1".into()], "02:00:00:00:00:0a").unwrap();
    let b = r.register("node-b", &["192.0.2.2".into()], "").unwrap();
    assert_eq!(a.blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    assert_eq!(b.blocks, vec!["10.8.1.0/24", "fd00:8:0:1::/64"]);
    let more = r.request_block("node-a", Family::V4).unwrap();
    assert_eq!(more.blocks.len(), 3);
    // The record, in allocation order, and one lock per block.
    let rec = k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(rec["spec"]["blocks"], json!(["10.8.0.0/24", "fd00:8::/64", "10.8.2.0/24"]));
    assert_eq!(rec["spec"]["vtepMac"], "02:00:00:00:00:0a");
    assert_eq!(locks(&k).len(), 5);
    assert!(k.get(GROUP, "ipblocks", None, "v6-fd00-8---64").is_some());
    drop(r);
    // A new controller (new backend, new registry) finds the same state.
    let r = registry(&k);
    assert_eq!(r.get("node-a").unwrap(), more);
    assert_eq!(r.get("node-b").unwrap(), b);
    // Removal frees the locks; the next node gets the freed blocks.
    r.remove("node-a").unwrap();
    assert!(k.get(GROUP, "nodeplanenodes", None, "node-a").is_none());
    assert_eq!(locks(&k), vec![("10.8.1.0/24".into(), "node-b".into()), ("fd00:8:0:1::/64".into(), "node-b".into())]);
    let c = r.register("node-c", &["192.0.2.3".into()], "").unwrap();
    assert_eq!(c.blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    // Named writes: the field manager in managedFields, the User-Agent on every request.
    assert!(assert_named_writes(&k) >= 8);
    let controller: BTreeSet<String> = ["nodeplane-controller".to_string()].into();
    assert_eq!(managers_of(&k.get(GROUP, "nodeplanenodes", None, "node-c").unwrap()), controller);
    assert_eq!(managers_of(&k.get(GROUP, "ipblocks", None, "v4-10-8-0-0-24").unwrap()), controller);
}

#[test]
fn load_repairs_interrupted_changes_and_refuses_a_block_held_twice() {
    let k = cluster();
    {
        let r = registry(&k);
        r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    }
    // A lock without a record: an old one (a crash between lock and record) is released at
    // load; a recent one may belong to a previous leader's change still in flight, so it is
    // kept and never handed out. A record whose lock vanished gets it back.
    // (The API server sets creationTimestamp itself: the old lock is backdated in etcd.)
    k.create(GROUP, "ipblocks", None, lock_object("10.8.3.0/24", "node-z"));
    k.backdate(&envtest::resource(GROUP, "ipblocks"), None, &block_object_name("10.8.3.0/24"), "2020-01-01T00:00:00Z");
    let stale = k.get(GROUP, "ipblocks", None, &block_object_name("10.8.3.0/24")).unwrap();
    assert_eq!(stale["metadata"]["creationTimestamp"], "2020-01-01T00:00:00Z");
    k.put(GROUP, "ipblocks", None, lock_object("10.8.1.0/24", "node-y"));
    k.delete(GROUP, "ipblocks", None, &block_object_name("fd00:8::/64"));
    let r = registry(&k);
    assert_eq!(r.get("node-a").unwrap().blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    assert_eq!(
        locks(&k),
        vec![
            ("10.8.0.0/24".into(), "node-a".into()),
            ("10.8.1.0/24".into(), "node-y".into()),
            ("fd00:8::/64".into(), "node-a".into())
        ]
    );
    let b = r.register("node-b", &["192.0.2.2".into()], "").unwrap();
    assert_eq!(b.blocks[0], "10.8.2.0/24", "the reserved block is skipped");
    drop(r);
    k.delete(GROUP, "ipblocks", None, &block_object_name("10.8.1.0/24"));
    // A block locked for another node than the record says: refuse to start.
    k.put(GROUP, "ipblocks", None, lock_object("10.8.0.0/24", "node-q"));
    let e = Registry::with_backend(backend(&k), pools()).err().expect("must refuse").to_string();
    assert!(e.contains("10.8.0.0/24") && e.contains("node-q"), "{e}");
}

#[test]
fn a_second_writer_is_detected_not_overwritten() {
    let k = cluster();
    let r = registry(&k);
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    // Someone else locks the block this registry would hand out next.
    k.put(GROUP, "ipblocks", None, lock_object("10.8.1.0/24", "intruder"));
    let e = r.register("node-b", &["192.0.2.2".into()], "").unwrap_err().to_string();
    assert!(e.contains("10.8.1.0/24") && e.contains("intruder"), "{e}");
    assert!(r.get("node-b").is_none(), "nothing recorded");
    assert_eq!(
        k.get(GROUP, "ipblocks", None, "v4-10-8-1-0-24").unwrap()["spec"]["node"],
        "intruder",
        "not overwritten"
    );
    assert!(
        k.get(GROUP, "ipblocks", None, &block_object_name("fd00:8:0:1::/64")).is_none(),
        "the v6 lock was not kept"
    );
    k.delete(GROUP, "ipblocks", None, "v4-10-8-1-0-24");
    // Someone else rewrites node-a's record: the next write of it fails with a conflict.
    let mut rec = k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    rec["spec"]["underlay"] = json!(["198.51.100.1"]);
    k.put(GROUP, "nodeplanenodes", None, rec);
    let e = r.request_block("node-a", Family::V4).unwrap_err().to_string();
    assert!(e.contains("another writer"), "{e}");
    assert_eq!(r.get("node-a").unwrap().blocks.len(), 2, "memory unchanged");
    assert_eq!(locks(&k).iter().filter(|(_, n)| n == "node-a").count(), 2, "the new lock was rolled back");
}

#[test]
fn a_failed_record_write_releases_the_new_locks() {
    let k = cluster();
    let r = registry(&k);
    // The record's create fails on the server: a webhook the API server cannot get an answer
    // from, under failurePolicy Fail, is its real 500 InternalError, and nothing is stored.
    let hook = AdmissionHook::start();
    k.register_admission_hook(&hook, &[("CREATE", GROUP, "nodeplanenodes")]);
    hook.arm("CREATE", "nodeplanenodes", Some(CONTROLLER_USER), Verdict::Fail);
    assert!(r.register("node-a", &["192.0.2.1".into()], "").is_err());
    assert!(hook.spent(), "the record's create reached the webhook");
    let failed = k.controller_requests().into_iter().filter(|q| q.verb == "create" && q.resource == "nodeplanenodes");
    assert_eq!(failed.map(|q| q.code).collect::<Vec<_>>(), [Some(500)], "one create, answered 500");
    assert!(locks(&k).is_empty(), "{:?}", locks(&k));
    assert!(r.get("node-a").is_none());
    // The retry succeeds with the same blocks.
    assert_eq!(r.register("node-a", &["192.0.2.1".into()], "").unwrap().blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
}

#[test]
fn volume_records_round_trip() {
    let k = cluster();
    let be = backend(&k);
    // The records' store is named by the uid of their CRD, read under the controller's RBAC.
    let crd =
        k.get("apiextensions.k8s.io", "customresourcedefinitions", None, "nodeplanevolumes.nodeplane.dev").unwrap();
    let uid = crd["metadata"]["uid"].as_str().unwrap();
    assert_eq!(be.volume_store_id().unwrap(), format!("crd-{uid}"));
    assert_granted(&k);
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
        backend: Default::default(),
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
    // The backend: `lvm` is recorded, `file` (the default) leaves the spec as before.
    let lvm = nodeplane::storage::store::Backend::Lvm;
    let snap = VolumeRecord { backend: lvm, ..snap };
    let restored = VolumeRecord { source_snapshot: "snap-1".into(), backend: lvm, ..v("pvc-2", VolState::Creating) };
    be.commit_volumes(&[("snap-1".into(), Some(snap.clone())), ("pvc-2".into(), Some(restored.clone()))]).unwrap();
    let obj = k.get(GROUP, "nodeplanevolumes", None, "snap-1").unwrap();
    assert_eq!((obj["spec"]["kind"].as_str(), obj["spec"]["sourceVolume"].as_str()), (Some("snapshot"), Some("pvc-1")));
    assert_eq!(obj["spec"]["backend"], "lvm");
    let obj = k.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert!(obj["spec"].get("kind").is_none(), "a plain volume's spec is as before: {obj}");
    assert!(obj["spec"].get("backend").is_none(), "a file volume's spec is as before: {obj}");
    let mut loaded = backend(&k).load_volumes().unwrap();
    loaded.sort_by(|a, b| a.id.cmp(&b.id));
    assert!(loaded.contains(&snap) && loaded.contains(&restored), "{loaded:?}");
    be.commit_volumes(&[("snap-1".into(), None), ("pvc-2".into(), None)]).unwrap();
    be.commit_volumes(&[("pvc-1".into(), Some(v("pvc-1", VolState::Ready)))]).unwrap();
    let obj = k.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert_eq!(obj["spec"]["state"], "ready");
    assert_eq!(obj["spec"]["sizeBytes"], 1u64 << 30);
    let be2 = backend(&k);
    let mut got = be2.load_volumes().unwrap();
    got.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(got, vec![v("Odd_Id", VolState::Creating), v("pvc-1", VolState::Ready)]);
    be2.commit_volumes(&[("Odd_Id".into(), None), ("pvc-1".into(), None)]).unwrap();
    assert!(k.list(GROUP, "nodeplanevolumes").is_empty());
    // A stale writer (the first backend) cannot resurrect or overwrite.
    assert!(be.commit_volumes(&[("pvc-1".into(), Some(v("pvc-1", VolState::Deleting)))]).is_err());
}

fn settings(identity: &str) -> LeaseSettings {
    LeaseSettings {
        namespace: NS.into(),
        lease_name: "nodeplane-controller".into(),
        identity: identity.into(),
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1500),
        retry_period: Duration::from_millis(200),
    }
}

#[test]
fn leader_election_on_a_lease() {
    let k = cluster();
    let hook = AdmissionHook::start();
    k.register_admission_hook(&hook, &[("UPDATE", "coordination.k8s.io", "leases")]);
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
        let mut a = Elector::new(client.clone(), settings("ctl-a"));
        let mut b = Elector::new(client.clone(), settings("ctl-b"));
        assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Leading);
        assert_eq!(b.try_acquire_or_renew().await.unwrap(), Attempt::HeldBy("ctl-a".into()));
        // A conflicting write (another writer got there first) is a lost race, not a win: the
        // Lease is written by another client while a's update waits in admission, so a's
        // update, made from what it read before, meets the server's real 409 Conflict.
        let admin = k.admin();
        let race = Box::new(move || renew_as_another_writer(&admin));
        hook.arm("UPDATE", "leases", Some(CONTROLLER_USER), Verdict::After(race));
        assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Raced);
        assert!(hook.spent(), "a's update went through the webhook");
        let conflicts =
            k.controller_requests().iter().filter(|q| q.resource == "leases" && q.code == Some(409)).count();
        assert_eq!(conflicts, 1);
        assert_eq!(a.try_acquire_or_renew().await.unwrap(), Attempt::Leading);
        // a stops renewing (crashed): b waits a full lease duration from when it last saw a
        // change, then takes over.
        let t = Instant::now();
        b.acquire(|_| {}).await;
        let waited = t.elapsed();
        assert!(waited >= Duration::from_millis(1500) && waited < Duration::from_secs(5), "{waited:?}");
        let lease = k.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
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
        // An API that cannot be reached makes the leader give up within the renew deadline,
        // and its fence closes no later than that.
        k.cut();
        let t = Instant::now();
        let lost = c.keep(std::future::pending()).await;
        assert!(lost.is_some() && t.elapsed() < Duration::from_secs(3), "{lost:?} {:?}", t.elapsed());
        assert!(c.fence().check().is_err());
        k.restore();
    });
    assert!(assert_named_writes(&k) >= 4);
    let lease = k.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
    assert_eq!(managers_of(&lease), ["nodeplane-controller".to_string()].into());
}

/// Another writer renews the controller's Lease (a new `spec.renewTime`, written over
/// whatever is stored).
fn renew_as_another_writer(admin: &envtest::Admin) {
    let mut lease = admin.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let secs = nodeplane::util::utc_rfc3339(now.as_secs() as i64);
    lease["spec"]["renewTime"] = json!(format!("{}.{:06}Z", secs.trim_end_matches('Z'), now.subsec_micros()));
    admin.put("coordination.k8s.io", "leases", Some(NS), lease);
}

fn node_object(name: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
}

#[test]
fn node_deletion_releases_blocks_also_across_a_relist() {
    let k = cluster();
    for n in ["node-a", "node-b", "node-c"] {
        k.create("", "nodes", None, node_object(n));
    }
    let reg = Arc::new(registry(&k));
    for (i, n) in ["node-a", "node-b", "node-c", "node-d"].iter().enumerate() {
        reg.register(n, &[format!("192.0.2.{}", i + 1)], "").unwrap();
    }
    let rt = rt();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let client = rt.block_on(async { kube::Client::try_from(kube_config(&k).await).unwrap() });
    let gate = nodeplane::controller::kube::nodes::NodeGate::new(client.clone());
    let task = rt.spawn(nodeplane::controller::kube::nodes::follow(client, reg.clone(), gate, stop));
    // node-d has no Node object at all: released by the first list.
    wait_until("node-d released", Duration::from_secs(10), || reg.get("node-d").is_none());
    // A Delete event.
    k.delete("", "nodes", None, "node-b");
    wait_until("node-b released", Duration::from_secs(10), || reg.get("node-b").is_none());
    assert!(!locks(&k).iter().any(|(_, n)| n == "node-b" || n == "node-d"));
    // A deletion the watch never sees: the API server is unreachable (a partition) while
    // node-c goes, and restarts meanwhile (a crash, or a fail-over to another replica); the
    // new one's watch cache begins after the deletion, so the watcher's resume gets 410 Gone,
    // it lists again, and finds node-c missing.
    let lists = || k.controller_requests().iter().filter(|q| q.verb == "list" && q.resource == "nodes").count();
    let before = lists();
    k.hold();
    k.delete("", "nodes", None, "node-c");
    k.restart();
    k.restore();
    wait_until("node-c released after the relist", Duration::from_secs(20), || reg.get("node-c").is_none());
    assert!(lists() > before, "released by a relist");
    assert!(reg.get("node-a").is_some(), "node-a still has its Node object");
    let _ = stop_tx.send(true);
    rt.block_on(task).unwrap();
    // What it called is exactly what the RBAC grants for this part.
    let used: BTreeSet<(String, String)> =
        k.controller_requests().into_iter().filter(|c| c.resource == "nodes").map(|c| (c.verb, c.resource)).collect();
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
    use nodeplane::controller::kube::review::TokenReviewer;
    let k = cluster();
    k.create("", "nodes", None, node_object("node-1"));
    // Tokens from the TokenRequest API, bound to a pod on node-1 (the API server's TokenReview
    // then names the node): the agent's, one for another audience, one of another account.
    let tok_n1 = k.agent_token("node-1");
    let agent_pod = k.pod_on(NS, "nodeplane-agent", "node-1");
    let tok_wrong_aud = k.token(NS, "nodeplane-agent", &["vault"], Some(&agent_pod));
    let other_pod = k.pod_on("default", "default", "node-1");
    let tok_other_sa = k.token("default", "default", &[envtest::AGENT_AUDIENCE], Some(&other_pod));
    let bearer = |t: &str| format!("Bearer {t}");
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
        let auth = Authority::new(b"0123456789abcdef0123456789abcdef".to_vec()).with_reviewer(TokenReviewer::new(
            client,
            "nodeplane",
            AGENT_SA,
        ));
        assert_eq!(auth.identify(&bearer(&tok_n1)).await.unwrap(), Identity::Node("node-1".into()));
        assert!(
            Identity::Node("node-1".into()).may_act_for("node-1")
                && !Identity::Node("node-1".into()).may_act_for("node-2")
        );
        assert_eq!(auth.identify(&bearer(&tok_wrong_aud)).await.unwrap_err().code(), tonic::Code::Unauthenticated);
        assert_eq!(auth.identify(&bearer(&tok_other_sa)).await.unwrap_err().code(), tonic::Code::PermissionDenied);
        assert_eq!(auth.identify("Bearer nonsense").await.unwrap_err().code(), tonic::Code::Unauthenticated);
        // HMAC tokens keep working beside it (the admin's).
        let admin = auth.mint("@admin");
        assert_eq!(auth.identify(&format!("Bearer {admin}")).await.unwrap(), Identity::Admin);
        // An API server that cannot be asked is UNAVAILABLE (retry), not a denial.
        k.cut();
        assert_eq!(auth.identify("Bearer tok-unseen").await.unwrap_err().code(), tonic::Code::Unavailable);
        k.restore();
        // Verdicts are cached: a revoked token keeps working until the cache entry expires,
        // which is bounded (60 s) — the API is asked once per token per minute, not per call.
        let reviews = || k.controller_requests().iter().filter(|c| c.resource == "tokenreviews").count();
        let before = reviews();
        assert!(before >= 4, "the API server was asked: {before}");
        auth.identify(&bearer(&tok_n1)).await.unwrap();
        assert_eq!(reviews(), before);
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
    nodeplane::rpc::connect_with(&format!("127.0.0.1:{grpc}"), Some(&files)).await.map_err(|e| e.to_string())
}

async fn register(grpc: u16, token: &str, node: &str) -> Result<Vec<String>, tonic::Status> {
    use nodeplane::rpc::controller as pb;
    let ch = channel(grpc).await.map_err(tonic::Status::unavailable)?;
    let mut c = pb::node_registry_client::NodeRegistryClient::new(ch);
    let mut req = tonic::Request::new(pb::RegisterRequest {
        node_name: node.into(),
        underlay_addresses: vec!["192.0.2.9".into()],
        vtep_mac: String::new(),
        wireguard_key: String::new(),
    });
    req.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    Ok(c.register(req).await?.into_inner().node.unwrap().pod_blocks)
}

#[test]
fn two_controller_processes_fail_over_without_losing_blocks() {
    let k = cluster();
    let dir = tempdir("kube-failover");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    k.create("", "nodes", None, node_object("node-1"));
    let agent_n1 = k.agent_token("node-1");
    let a = controller(&dir, &kubeconfig, "ctl-a");
    wait_until("ctl-a ready", Duration::from_secs(20), || http_get(a.health, "/readyz") == Some(200));
    let b = controller(&dir, &kubeconfig, "ctl-b");
    wait_until("ctl-b live", Duration::from_secs(20), || http_get(b.health, "/healthz") == Some(200));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(http_get(b.health, "/readyz"), Some(503), "the standby is not ready");
    let rt = rt();
    let blocks = rt.block_on(register(a.grpc, &agent_n1, "node-1")).unwrap();
    assert_eq!(blocks, vec!["10.8.0.0/24", "fd00:8::/64"]);
    // The agent's token speaks for node-1 only.
    assert_eq!(rt.block_on(register(a.grpc, &agent_n1, "node-2")).unwrap_err().code(), tonic::Code::PermissionDenied);
    // kill -9 the leader: the standby takes over after the lease expires and serves the same
    // blocks (nothing lost, nothing handed out twice).
    let t = Instant::now();
    drop(a);
    wait_until("ctl-b leads", Duration::from_secs(20), || http_get(b.health, "/readyz") == Some(200));
    let failover = t.elapsed();
    assert_eq!(rt.block_on(register(b.grpc, &agent_n1, "node-1")).unwrap(), blocks);
    eprintln!("failover after kill -9 of the leader: {failover:?}");
    // A clean stop releases the lease: a new candidate leads at once.
    let c = controller(&dir, &kubeconfig, "ctl-c");
    wait_until("ctl-c live", Duration::from_secs(20), || http_get(c.health, "/healthz") == Some(200));
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(b.proc.0.id() as i32), nix::sys::signal::Signal::SIGTERM);
    let t = Instant::now();
    wait_until("ctl-c leads", Duration::from_secs(20), || http_get(c.health, "/readyz") == Some(200));
    let handover = t.elapsed();
    eprintln!("handover after SIGTERM of the leader: {handover:?}");
    assert!(handover < Duration::from_secs(3), "{handover:?}");
    assert_eq!(rt.block_on(register(c.grpc, &agent_n1, "node-1")).unwrap(), blocks);
    drop(b);
    drop(c);
    // Every call the processes made is one the RBAC grants (API_CALLS), nothing more.
    assert_granted(&k);
    // The processes name themselves on every request and write.
    assert!(assert_named_writes(&k) > 0);
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
    let k = cluster();
    let r = registry(&k);
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    let mut rec = k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    rec["spec"]["underlay"] = json!(["198.51.100.1"]);
    k.put(GROUP, "nodeplanenodes", None, rec);
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
    let k = cluster();
    let r = registry(&k);
    let n63 = "n".repeat(63);
    let n64 = format!("{}.example", "m".repeat(56));
    let n253 = format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61));
    assert_eq!((n63.len(), n64.len(), n253.len()), (63, 64, 253));
    for name in ["x", n63.as_str(), n64.as_str(), n253.as_str()] {
        let rec =
            r.register(name, &["192.0.2.1".into()], "").unwrap_or_else(|e| panic!("{} characters: {e}", name.len()));
        assert_eq!(rec.blocks.len(), 2, "{name}");
        let obj = k.get(GROUP, "nodeplanenodes", None, name).expect("the record is named after the node");
        assert_eq!(obj["metadata"]["labels"][NODE_HASH_LABEL], node_hash(name));
        for b in &rec.blocks {
            let lock = k.get(GROUP, "ipblocks", None, &block_object_name(b)).unwrap();
            assert_eq!(lock["spec"]["node"], name);
            assert_eq!(lock["metadata"]["annotations"][NODE_ANNOTATION], name);
            let hash = lock["metadata"]["labels"][NODE_HASH_LABEL].as_str().unwrap();
            assert_eq!((hash, hash.len()), (node_hash(name).as_str(), 56));
        }
    }
    assert_eq!(node_hash("x"), "54a2f7f92a5f975d8096af77a126edda7da60c5aa872ef1b871701ae", "printf x | sha224sum");
    // Found again by a new controller; a selector on the hash finds a node's locks.
    let r = registry(&k);
    assert_eq!(r.get(&n253).unwrap().blocks.len(), 2);
    // Invalid names: refused at Register, naming the rule; nothing written.
    let before = k.list(GROUP, "nodeplanenodes").len();
    for bad in ["Bad_Name", "a..b", "-a", "a.", &"z".repeat(254), ""] {
        let e = r.register(bad, &["192.0.2.1".into()], "").unwrap_err();
        assert!(matches!(e, RegistryError::InvalidArgument(_)), "{bad:?}: {e:?}");
        let m = e.to_string();
        assert!(m.contains("RFC 1123 subdomain") && m.contains("253 characters"), "{m}");
        let status = tonic::Status::from(e);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
    }
    assert_eq!(k.list(GROUP, "nodeplanenodes").len(), before);
}

#[test]
fn objects_of_the_old_label_encoding_are_still_found_and_migrated() {
    use nodeplane::controller::kube::state::{NODE_HASH_LABEL, node_hash};
    let k = cluster();
    // As written by the previous version: the node name itself in the label nodeplane.dev/node.
    let legacy = json!({"nodeplane.dev/node": "node-a", "app.kubernetes.io/managed-by": "nodeplane-controller"});
    k.put(
        GROUP,
        "nodeplanenodes",
        None,
        json!({"apiVersion": format!("{GROUP}/v1alpha1"), "kind": "NodeplaneNode",
        "metadata": {"name": "node-a", "labels": {"app.kubernetes.io/managed-by": "nodeplane-controller"}},
        "spec": {"underlay": ["192.0.2.1"], "vtepMac": "", "blocks": ["10.8.0.0/24"]}}),
    );
    let mut lock = lock_object("10.8.0.0/24", "node-a");
    lock["metadata"]["labels"] = legacy.clone();
    k.put(GROUP, "ipblocks", None, lock);
    k.put(GROUP, "nodeplanevolumes", None, json!({"apiVersion": format!("{GROUP}/v1alpha1"), "kind": "NodeplaneVolume",
        "metadata": {"name": "pvc-1", "labels": legacy},
        "spec": {"id": "pvc-1", "name": "claim", "node": "node-a", "sizeBytes": 1024, "fsType": "ext4", "state": "ready", "createdAt": 1}}));
    let be = backend(&k);
    let r = Registry::with_backend(be.clone(), pools()).unwrap();
    assert_eq!(r.get("node-a").unwrap().blocks, vec!["10.8.0.0/24"], "the old objects are found");
    let vols = be.load_volumes().unwrap();
    assert_eq!(vols.len(), 1);
    // A rewrite moves an object to the new encoding.
    let mut v = vols[0].clone();
    v.size_bytes = 2048;
    be.commit_volumes(&[("pvc-1".into(), Some(v))]).unwrap();
    let obj = k.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert!(obj["metadata"]["labels"].get("nodeplane.dev/node").is_none(), "{obj}");
    assert_eq!(obj["metadata"]["labels"][NODE_HASH_LABEL], node_hash("node-a"));
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    let obj = k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(obj["metadata"]["labels"][NODE_HASH_LABEL], node_hash("node-a"));
}

/// Another client (an operator's `kubectl label`: its User-Agent and field manager)
/// merge-patches labels onto an object.
fn label_as_other_client(k: &ApiServer, plural: &str, name: &str, key: &str, value: &str) {
    let rt = rt();
    rt.block_on(async {
        let mut cfg = k.admin_config().await;
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
    let k = cluster();
    let rt = rt();
    let client = rt.block_on(async { kube::Client::try_from(kube_config(&k).await).unwrap() });
    let mut el = Elector::new(client, settings("ctl-a"));
    let fence = el.fence();
    let mut renew = || assert_eq!(rt.block_on(el.try_acquire_or_renew()).unwrap(), Attempt::Leading);
    renew();
    let cfg = rt.block_on(kube_config(&k));
    let be = Arc::new(KubeBackend::new(cfg, Some(fence.clone())).unwrap());
    let r = Registry::with_backend(be.clone(), pools()).unwrap();
    r.register("node-a", &["192.0.2.1".into()], "").unwrap();
    // An operator labels the record and a block lock.
    label_as_other_client(&k, "nodeplanenodes", "node-a", "team", "net");
    label_as_other_client(&k, "ipblocks", "v4-10-8-0-0-24", "audit", "2026");
    renew();
    // The leader's next write meets 409 Conflict, re-reads, sees the Lease still its own, merges.
    let rec = r.request_block("node-a", Family::V4).expect("the leader keeps writing");
    assert_eq!(rec.blocks.len(), 3);
    assert!(fence.check().is_ok() && fence.lost().is_none(), "not fenced");
    let obj = k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(obj["metadata"]["labels"]["team"], "net", "the other client's label is kept: {obj}");
    assert_eq!(obj["spec"]["blocks"].as_array().unwrap().len(), 3);
    let managers = managers_of(&obj);
    assert!(managers.contains("kubectl-label") && managers.contains("nodeplane-controller"), "{managers:?}");
    // ... and the write after that too (no conflict left behind; it keeps the label).
    r.register("node-a", &["192.0.2.7".into()], "").unwrap();
    let obj = k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    assert_eq!(
        (obj["metadata"]["labels"]["team"].as_str(), obj["spec"]["underlay"][0].as_str()),
        (Some("net"), Some("192.0.2.7"))
    );
    // The labelled lock is untouched by the writes, and released normally with its node.
    let lock = k.get(GROUP, "ipblocks", None, "v4-10-8-0-0-24").unwrap();
    assert_eq!(lock["metadata"]["labels"]["audit"], "2026");
    assert_eq!(managers_of(&lock), ["kubectl-label".to_string(), "nodeplane-controller".to_string()].into());
    // A spec edited by hand is put back by the leader's next write (the leader owns the spec).
    let mut edited = k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap();
    edited["spec"]["underlay"] = json!(["198.51.100.1"]);
    k.put(GROUP, "nodeplanenodes", None, edited);
    renew();
    r.register("node-a", &["192.0.2.8".into()], "").unwrap();
    assert_eq!(k.get(GROUP, "nodeplanenodes", None, "node-a").unwrap()["spec"]["underlay"], json!(["192.0.2.8"]));
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
        backend: Default::default(),
    };
    be.commit_volumes(&[("pvc-1".into(), Some(vol.clone()))]).unwrap();
    label_as_other_client(&k, "nodeplanevolumes", "pvc-1", "backup", "yes");
    be.commit_volumes(&[("pvc-1".into(), Some(VolumeRecord { state: VolState::Ready, ..vol }))]).unwrap();
    let obj = k.get(GROUP, "nodeplanevolumes", None, "pvc-1").unwrap();
    assert_eq!(
        (obj["metadata"]["labels"]["backup"].as_str(), obj["spec"]["state"].as_str()),
        (Some("yes"), Some("ready"))
    );
    label_as_other_client(&k, "nodeplanevolumes", "pvc-1", "backup", "no");
    be.commit_volumes(&[("pvc-1".into(), None)]).unwrap();
    assert!(
        k.get(GROUP, "nodeplanevolumes", None, "pvc-1").is_none(),
        "a delete after another client's change goes through"
    );
    assert!(r.remove("node-a").is_ok());
    assert!(locks(&k).is_empty());
    assert!(fence.lost().is_none());
    assert!(assert_named_writes(&k) > 0);
    // Only another holder of the Lease fences: ctl-b takes the Lease, someone changes a record.
    r.register("node-b", &["192.0.2.2".into()], "").unwrap();
    let mut lease = k.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
    lease["spec"]["holderIdentity"] = json!("ctl-b");
    k.put("coordination.k8s.io", "leases", Some(NS), lease);
    label_as_other_client(&k, "nodeplanenodes", "node-b", "team", "x");
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
    let k = cluster();
    for n in ["node-a", "node-b"] {
        k.create("", "nodes", None, node_object(n));
    }
    let reg = Arc::new(registry(&k));
    let rt = rt();
    let client = rt.block_on(async { kube::Client::try_from(kube_config(&k).await).unwrap() });
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
    assert!(k.get(GROUP, "nodeplanenodes", None, "node-c").is_none());
    // node-b's Node is deleted while its agent runs: released, and its agent's next Register
    // is refused; so is one that got past the admission before the deletion was seen (the
    // registry asks the gate under its lock).
    k.delete("", "nodes", None, "node-b");
    wait_until("node-b released", Duration::from_secs(10), || reg.get("node-b").is_none());
    assert_eq!(register("node-b"), Err(tonic::Code::FailedPrecondition));
    match reg.register("node-b", &["192.0.2.2".into()], "") {
        Err(RegistryError::FailedPrecondition(m)) => assert!(m.contains("node-b") && m.contains("Node object"), "{m}"),
        other => panic!("want FAILED_PRECONDITION, got {other:?}"),
    }
    let ghosts = |k: &ApiServer| {
        k.get(GROUP, "nodeplanenodes", None, "node-b").is_some() || locks(k).iter().any(|(_, n)| n == "node-b")
    };
    assert!(!ghosts(&k), "no ghost NodeplaneNode or IPBlock");
    // Across relists (the watch breaks, the API server restarts: a fresh list), the agent
    // keeps retrying and keeps being refused; no ghost comes back.
    for round in 0..2 {
        let lists = || k.controller_requests().iter().filter(|c| c.verb == "list" && c.resource == "nodes").count();
        let before = lists();
        // (While the API server is unreachable, another Node appears and the API server
        // restarts: the watch's resourceVersion is then older than the new watch cache, so its
        // resume gets 410 Gone and the watcher lists again.)
        k.hold();
        k.create("", "nodes", None, node_object(&format!("node-z{round}")));
        k.restart();
        k.restore();
        wait_until("a relist", Duration::from_secs(20), || lists() > before);
        for _ in 0..3 {
            assert_eq!(register("node-b"), Err(tonic::Code::FailedPrecondition), "round {round}");
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(!ghosts(&k), "round {round}: no ghost NodeplaneNode or IPBlock");
        assert!(reg.get("node-b").is_none());
    }
    assert!(reg.get("node-a").is_some(), "node-a keeps its blocks");
    // A Node being deleted (deletionTimestamp set, finalizers pending) may not register either.
    let mut a = k.get("", "nodes", None, "node-a").unwrap();
    a["metadata"]["finalizers"] = json!(["envtest.nodeplane.dev/hold"]);
    k.put("", "nodes", None, a);
    assert!(k.delete("", "nodes", None, "node-a"));
    assert!(k.get("", "nodes", None, "node-a").unwrap()["metadata"]["deletionTimestamp"].is_string());
    wait_until("node-a seen being deleted", Duration::from_secs(10), || gate.refused("node-a").is_some());
    assert_eq!(register("node-a"), Err(tonic::Code::FailedPrecondition));
    // A Node object that comes back (same name, a new machine) registers again.
    k.create("", "nodes", None, node_object("node-b"));
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
    let k = cluster();
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
        let (a, b) = tokio::join!(
            load_or_create(client.clone(), NS, DEFAULT_NAME),
            load_or_create(client.clone(), NS, DEFAULT_NAME)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b);
        assert!(a.current.len() >= 32 && a.previous.is_none());
        assert_eq!(load_or_create(client.clone(), NS, DEFAULT_NAME).await.unwrap(), a, "read, not made again");
    });
    let creates = k.controller_requests().iter().filter(|r| r.resource == "secrets" && r.verb == "create").count();
    assert!((1..=2).contains(&creates), "{creates}");
    let s = k.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    assert_eq!(s["type"], "Opaque");
    assert_eq!(managers_of(&s), ["nodeplane-controller".to_string()].into());
    // Emptied by hand: a key is added (update), not a second Secret.
    let mut s = s;
    s["data"] = json!({});
    k.put("", "secrets", Some(NS), s);
    let keys = rt().block_on(async {
        load_or_create(kube::Client::try_from(kube_config(&k).await).unwrap(), NS, DEFAULT_NAME).await.unwrap()
    });
    assert!(keys.current.len() >= 32);
    assert!(
        k.controller_requests()
            .iter()
            .any(|r| r.resource == "secrets" && r.verb == "update" && r.field_manager == "nodeplane-controller")
    );
    // A key too short is an error, not silently replaced.
    let mut s = k.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    s["data"]["previous"] = json!("c2hvcnQ=");
    k.put("", "secrets", Some(NS), s);
    let e = rt().block_on(async {
        load_or_create(kube::Client::try_from(kube_config(&k).await).unwrap(), NS, DEFAULT_NAME).await.unwrap_err()
    });
    assert!(e.contains("previous") && e.contains("fewer than 32"), "{e}");
}

#[test]
fn an_admin_token_survives_a_controller_restart() {
    let k = cluster();
    let dir = tempdir("kube-hmac");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    k.put("", "nodes", None, node_object("node-1"));
    let a = controller(&dir, &kubeconfig, "ctl-a");
    wait_until("ctl-a ready", Duration::from_secs(20), || http_get(a.health, "/readyz") == Some(200));
    let secret = k.get("", "secrets", Some(NS), "nodeplane-controller-hmac").expect("the Secret was generated");
    assert!(secret["data"]["current"].as_str().is_some_and(|k| k.len() >= 44), "{secret}");
    let admin = mint(&dir, &kubeconfig, "ctl-a", "@admin");
    let node = mint(&dir, &kubeconfig, "ctl-a", "node-1");
    let rt = rt();
    assert_eq!(rt.block_on(admin_list(a.grpc, &admin)), Ok(0));
    assert_eq!(rt.block_on(register(a.grpc, &node, "node-1")).unwrap().len(), 2);
    // A new controller pod: nothing of the old one's data dir survives (an emptyDir).
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.proc.0.id() as i32), nix::sys::signal::Signal::SIGTERM);
    drop(a);
    std::fs::remove_dir_all(dir.join("ctl-a")).unwrap();
    assert!(!dir.join("secret").exists() && !dir.join("ctl-b").join("secret").exists());
    let b = controller(&dir, &kubeconfig, "ctl-b");
    wait_until("ctl-b ready", Duration::from_secs(20), || http_get(b.health, "/readyz") == Some(200));
    assert_eq!(rt.block_on(admin_list(b.grpc, &admin)), Ok(1), "the @admin token minted before the restart works");
    assert_eq!(rt.block_on(register(b.grpc, &node, "node-1")).unwrap().len(), 2);
    // Rollover: the old key becomes `previous`, a new `current` signs; old tokens still work.
    let mut s = k.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    let old_key = s["data"]["current"].clone();
    s["data"] = json!({"current": "bmV3LWtleS1uZXcta2V5LW5ldy1rZXktbmV3LWtleS0zMmJ5dGVz", "previous": old_key});
    k.put("", "secrets", Some(NS), s);
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(b.proc.0.id() as i32), nix::sys::signal::Signal::SIGTERM);
    drop(b);
    let c = controller(&dir, &kubeconfig, "ctl-c");
    wait_until("ctl-c ready", Duration::from_secs(20), || http_get(c.health, "/readyz") == Some(200));
    let admin2 = mint(&dir, &kubeconfig, "ctl-c", "@admin");
    assert_ne!(admin2, admin, "signed with the new key");
    assert_eq!(rt.block_on(admin_list(c.grpc, &admin)), Ok(1), "the previous key's token during the rollover");
    assert_eq!(rt.block_on(admin_list(c.grpc, &admin2)), Ok(1));
    // The rollover ends (previous removed): the old token is refused, the new one works.
    let mut s = k.get("", "secrets", Some(NS), "nodeplane-controller-hmac").unwrap();
    s["data"].as_object_mut().unwrap().remove("previous");
    k.put("", "secrets", Some(NS), s);
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.proc.0.id() as i32), nix::sys::signal::Signal::SIGTERM);
    drop(c);
    let d = controller(&dir, &kubeconfig, "ctl-d");
    wait_until("ctl-d ready", Duration::from_secs(20), || http_get(d.health, "/readyz") == Some(200));
    assert_eq!(rt.block_on(admin_list(d.grpc, &admin)), Err(tonic::Code::Unauthenticated));
    assert_eq!(rt.block_on(admin_list(d.grpc, &admin2)), Ok(1));
    drop(d);
    // What the processes called is in API_CALLS (the RBAC), the Secret's included.
    assert_granted(&k);
    assert!(assert_named_writes(&k) > 0);
}

#[test]
fn register_through_the_controller_checks_the_name_then_the_node_object() {
    let k = cluster();
    let dir = tempdir("kube-register-rules");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    let long = format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61));
    for n in ["node-1", long.as_str()] {
        k.put("", "nodes", None, node_object(n));
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
    assert!(k.get(GROUP, "nodeplanenodes", None, "node-2").is_none());
    assert!(!locks(&k).iter().any(|(_, n)| n == "node-2"));
    // The Node object appears: the same agent's next try registers.
    k.put("", "nodes", None, node_object("node-2"));
    wait_until("node-2 admitted", Duration::from_secs(10), || rt.block_on(register(a.grpc, &admin, "node-2")).is_ok());
    // Deleted while its agent runs: released, and refused from then on.
    k.delete("", "nodes", None, "node-2");
    // Its record and its block locks go in separate writes: wait for both.
    wait_until("node-2 released", Duration::from_secs(10), || {
        k.get(GROUP, "nodeplanenodes", None, "node-2").is_none() && !locks(&k).iter().any(|(_, n)| n == "node-2")
    });
    assert_eq!(rt.block_on(register(a.grpc, &admin, "node-2")).unwrap_err().code(), tonic::Code::FailedPrecondition);
    assert!(!locks(&k).iter().any(|(_, n)| n == "node-2"));
    drop(a);
}

#[test]
fn a_leader_whose_lease_was_freed_by_someone_else_stops() {
    let k = cluster();
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
        let mut a = Elector::new(client, settings("ctl-a"));
        a.acquire(|_| {}).await;
        // Someone (another holder's release, or a hand edit) empties the holder: a's next
        // renewal would take the free lease again, but another controller may have led in
        // between, so a stops instead of trusting what it knows.
        let mut lease = k.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
        lease["spec"]["holderIdentity"] = serde_json::Value::Null;
        k.put("coordination.k8s.io", "leases", Some(NS), lease);
        let lost = a.keep(std::future::pending()).await.expect("lost");
        assert!(lost.contains("released or taken over"), "{lost}");
        assert!(a.fence().check().is_err());
        // A label on the Lease by another client is not a loss (a renewal races, then renews).
        let mut b = Elector::new(kube::Client::try_from(kube_config(&k).await).unwrap(), settings("ctl-b"));
        b.acquire(|_| {}).await;
        let mut lease = k.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
        lease["metadata"]["labels"] = json!({"team": "net"});
        k.put("coordination.k8s.io", "leases", Some(NS), lease);
        let kept = b.keep(tokio::time::sleep(Duration::from_millis(1200))).await;
        assert_eq!(kept, None, "b kept leading until told to stop");
        let lease = k.get("coordination.k8s.io", "leases", Some(NS), "nodeplane-controller").unwrap();
        assert_eq!(lease["metadata"]["labels"]["team"], "net", "the label is kept by the renewals");
    });
}

// ---- TLS without cert-manager (tls.bootstrap) ----------------------------------------------

#[test]
fn tls_bootstrap_makes_one_ca_that_agents_verify_across_restarts() {
    let k = cluster();
    let dir = tempdir("kube-tls");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    k.put("", "nodes", None, node_object("node-1"));
    let svc = format!("nodeplane-controller.{NS}.svc");
    let start = |name: &str| {
        let c = controller_with(&dir, &kubeconfig, name, json!({"bootstrap": {}}));
        wait_until(&format!("{name} ready"), Duration::from_secs(20), || http_get(c.health, "/readyz") == Some(200));
        c
    };
    let a = start("ctl-a");
    let secret = k.get("", "secrets", Some(NS), "nodeplane-controller-tls").expect("the TLS Secret was generated");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    for k in ["tls.crt", "tls.key", "ca.crt", "ca.key"] {
        assert!(secret["data"][k].as_str().is_some_and(|v| !v.is_empty()), "{k} missing: {secret}");
    }
    // The agents' CA bundle: the ConfigMap.
    let cm = k.get("", "configmaps", Some(NS), "nodeplane-ca").expect("the CA ConfigMap was published");
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
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.proc.0.id() as i32), nix::sys::signal::Signal::SIGTERM);
    drop(a);
    // A new pod with an empty data dir: the same CA and certificate, from the Secret.
    std::fs::remove_dir_all(dir.join("ctl-a")).unwrap();
    let b = start("ctl-b");
    assert_eq!(std::fs::read(dir.join("ctl-b/tls/tls.crt")).unwrap(), served, "the Secret's certificate is reused");
    CAS.lock().unwrap().insert(b.grpc, (ca_file, Some(svc)));
    assert_eq!(rt.block_on(admin_list(b.grpc, &admin)), Ok(0), "the CA bundle the agents mounted still verifies it");
    let creates =
        |plural: &str| k.controller_requests().iter().filter(|r| r.resource == plural && r.verb == "create").count();
    assert_eq!(creates("configmaps"), 1);
    assert_eq!(k.get("", "configmaps", Some(NS), "nodeplane-ca").unwrap()["data"]["ca.crt"], ca_pem.as_str());
    assert!(
        k.controller_requests()
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
    let k = cluster();
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
        serde_json::from_value(k.get("", "secrets", Some(NS), "nodeplane-controller-tls").unwrap()).unwrap()
    };
    let text = |s: &Secret, k: &str| String::from_utf8(s.data.as_ref().unwrap()[k].0.clone()).unwrap();
    let days_left =
        |pem: &str| (not_after(&certs_of(pem.as_bytes(), "c").unwrap()[0], "c").unwrap() - now_secs()) / 86400;
    // Two controllers starting at the same moment.
    let run = |x: &str, y: &str| {
        let (fx, fy) = (files(x), files(y));
        rt().block_on(async {
            let client = kube::Client::try_from(kube_config(&k).await).unwrap();
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
    let cm = k.get("", "configmaps", Some(NS), "nodeplane-ca").unwrap();
    assert_eq!(cm["data"]["ca.crt"], ca_pem.as_str(), "the published CA is the Secret's");
    let creates =
        |plural: &str| k.controller_requests().iter().filter(|r| r.resource == plural && r.verb == "create").count();
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
    k.put("", "secrets", Some(NS), serde_json::to_value(&s).unwrap());
    let updates_before =
        k.controller_requests().iter().filter(|r| r.resource == "configmaps" && r.verb == "update").count();
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
        k.controller_requests().iter().filter(|r| r.resource == "configmaps" && r.verb == "update").count(),
        updates_before
    );

    // A DNS name added to the configuration: re-issued naming it, same CA.
    let mut b2 = b.clone();
    b2.dns_names.push("controller.example".into());
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
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
    let roots = roots_of(ca.as_bytes(), "ca").map_err(|e| e.to_string())?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| e.to_string())?;
    let leaf = certs_of(cert.as_bytes(), "cert").map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    use rustls::client::danger::ServerCertVerifier;
    verifier
        .verify_server_cert(&leaf[0], &leaf[1..], &name, &[], rustls::pki_types::UnixTime::now())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

// ---- DRA: ResourceSlices from the nodes' reports, claims served to nodes --------------------

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
fn pools_in(k: &ApiServer) -> BTreeMap<String, (i64, Vec<String>, usize)> {
    let mut out: BTreeMap<String, (i64, Vec<String>, usize)> = BTreeMap::new();
    for s in k.list("resource.k8s.io", "resourceslices") {
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
    let k = cluster();
    let dir = tempdir("kube-dra");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    k.create("", "nodes", None, node_object("node-1"));
    k.create("", "nodes", None, node_object("node-2"));
    let (agent_n1, agent_n2) = (k.agent_token("node-1"), k.agent_token("node-2"));
    let ctl = controller(&dir, &kubeconfig, "ctl");
    wait_until("controller ready", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    let rt = rt();
    // Before any report: no ResourceSlice call at all (a cluster without DRA sees none).
    std::thread::sleep(Duration::from_millis(300));
    let calls = k.controller_requests();
    assert!(!calls.iter().any(|c| c.resource == "resourceslices"), "{calls:?}");
    rt.block_on(register(ctl.grpc, &agent_n1, "node-1")).unwrap();
    rt.block_on(register(ctl.grpc, &agent_n2, "node-2")).unwrap();
    rt.block_on(report(ctl.grpc, &agent_n1, "node-1", vec![dra_device("gpu-b", 1), dra_device("gpu-a", 0)])).unwrap();
    wait_until("node-1's pool", Duration::from_secs(5), || pools_in(&k).contains_key("node-1"));
    let slices = k.list("resource.k8s.io", "resourceslices");
    assert_eq!(slices.len(), 1);
    let s = &slices[0];
    assert_eq!(s["metadata"]["name"], "node-1-dra.nodeplane.dev-0");
    assert_eq!(s["metadata"]["labels"]["app.kubernetes.io/managed-by"], "nodeplane-controller");
    assert_eq!(s["spec"]["driver"], "dra.nodeplane.dev");
    assert_eq!(s["spec"]["nodeName"], "node-1");
    assert_eq!(s["spec"]["pool"], json!({"name": "node-1", "generation": 1, "resourceSliceCount": 1}));
    // Owned by the Node object: the API's garbage collector deletes it with the Node, also
    // while no controller runs.
    let node_uid = k.get("", "nodes", None, "node-1").unwrap()["metadata"]["uid"].clone();
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
    let rv = |k: &ApiServer, name: &str| {
        k.get("resource.k8s.io", "resourceslices", None, name).map(|s| s["metadata"]["resourceVersion"].clone())
    };
    let before = rv(&k, "node-1-dra.nodeplane.dev-0");
    rt.block_on(report(ctl.grpc, &agent_n1, "node-1", vec![dra_device("gpu-a", 0), dra_device("gpu-b", 1)])).unwrap();
    rt.block_on(report(ctl.grpc, &agent_n2, "node-2", vec![dra_device("fpga-0", 0)])).unwrap();
    wait_until("node-2's pool", Duration::from_secs(5), || pools_in(&k).contains_key("node-2"));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rv(&k, "node-1-dra.nodeplane.dev-0"), before, "an unchanged pool was rewritten");
    // kubelet restarts and deletes its node's slices; the agent reports the same devices
    // under a new epoch (kubelet registered the plugin again): the pool is written again.
    assert!(k.delete("resource.k8s.io", "resourceslices", None, "node-2-dra.nodeplane.dev-0"));
    let t = Instant::now();
    rt.block_on(report_epoch(ctl.grpc, &agent_n2, "node-2", vec![dra_device("fpga-0", 0)], 2)).unwrap();
    wait_until("node-2's pool written again", Duration::from_secs(2), || pools_in(&k).contains_key("node-2"));
    eprintln!("new epoch -> wiped pool written again: {:?}", t.elapsed());
    assert_eq!(pools_in(&k)["node-2"].1, ["fpga-0"]);
    // A device plugged in: the pool's next generation lists it.
    let t = Instant::now();
    rt.block_on(report(
        ctl.grpc,
        &agent_n1,
        "node-1",
        vec![dra_device("gpu-a", 0), dra_device("gpu-b", 1), dra_device("gpu-c", 0)],
    ))
    .unwrap();
    wait_until("gpu-c published", Duration::from_secs(1), || pools_in(&k)["node-1"].1.contains(&"gpu-c".to_string()));
    eprintln!("report -> ResourceSlice updated: {:?}", t.elapsed());
    assert_eq!(pools_in(&k)["node-1"], (2, vec!["gpu-a".into(), "gpu-b".into(), "gpu-c".into()], 1));
    // One removed (unplugged or unhealthy: the agent leaves it out): it leaves the pool.
    rt.block_on(report(ctl.grpc, &agent_n1, "node-1", vec![dra_device("gpu-a", 0), dra_device("gpu-c", 0)])).unwrap();
    wait_until("gpu-b gone", Duration::from_secs(1), || !pools_in(&k)["node-1"].1.contains(&"gpu-b".to_string()));
    assert_eq!(pools_in(&k)["node-1"].0, 3);
    // A node speaks for itself only; a malformed report is refused and changes nothing.
    assert_eq!(
        rt.block_on(report(ctl.grpc, &agent_n1, "node-2", vec![dra_device("x", 0)])).unwrap_err().code(),
        tonic::Code::PermissionDenied
    );
    let e = rt.block_on(report(ctl.grpc, &agent_n1, "node-1", vec![dra_device("Bad_Name", 0)])).unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let mut bad_version = dra_device("gpu-a", 0);
    bad_version.attributes.insert(
        "driverVersion".into(),
        pb::DeviceAttribute { value: Some(pb::device_attribute::Value::Version("v1".into())) },
    );
    let e = rt.block_on(report(ctl.grpc, &agent_n1, "node-1", vec![bad_version])).unwrap_err();
    assert!(e.code() == tonic::Code::InvalidArgument && e.message().contains("semantic version"), "{e:?}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        pools_in(&k)["node-1"],
        (3, vec!["gpu-a".into(), "gpu-c".into()], 1),
        "a refused report changed the pool"
    );

    // Claims: a node gets its own results of this driver, nothing of another node.
    // (The scheduler allocates a claim; here the test writes the allocation into its status.)
    k.namespace("team-a", json!({}));
    let mut claim = k.create(
        "resource.k8s.io",
        "resourceclaims",
        Some("team-a"),
        json!({"metadata": {"name": "gpus", "namespace": "team-a"},
               "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "nodeplane.dev", "count": 2}}]}}}),
    );
    claim["status"] = json!({"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": "dra.nodeplane.dev", "pool": "node-1", "device": "gpu-a"},
        {"request": "gpu", "driver": "dra.nodeplane.dev", "pool": "node-1", "device": "gpu-c"},
        {"request": "gpu", "driver": "gpu.example.com", "pool": "node-1", "device": "other"}]}}});
    let claim = k.put_status("resource.k8s.io", "resourceclaims", Some("team-a"), claim);
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
    let got = get(&agent_n1, "node-1", "gpus", &uid).unwrap();
    assert_eq!(
        got.iter().map(|r| (r.request.as_str(), r.device.as_str())).collect::<Vec<_>>(),
        [("gpu", "gpu-a"), ("gpu", "gpu-c")]
    );
    assert!(got.iter().all(|r| r.driver == "dra.nodeplane.dev" && r.pool == "node-1"));
    // Another node's claim, another UID, a missing claim: one answer (NOT_FOUND naming the
    // claim), so a node learns nothing about claims that are not its own.
    let other = get(&agent_n2, "node-2", "gpus", &uid).unwrap_err();
    let wrong_uid = get(&agent_n1, "node-1", "gpus", "another-uid").unwrap_err();
    let missing = get(&agent_n1, "node-1", "missing", "u").unwrap_err();
    for e in [&other, &wrong_uid, &missing] {
        assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    }
    assert!(missing.message().contains("team-a/missing"), "{missing:?}");
    assert_eq!(
        other.message(),
        format!("ResourceClaim team-a/gpus ({uid}) has no allocation of dra.nodeplane.dev on node \"node-2\"")
    );
    assert_eq!(get(&agent_n1, "node-2", "gpus", &uid).unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(get(&agent_n1, "node-1", "Not/A/Name", "u").unwrap_err().code(), tonic::Code::InvalidArgument);

    // The Node object goes: its pool goes, the other node's stays.
    assert!(k.delete("", "nodes", None, "node-1"));
    wait_until("node-1's pool deleted", Duration::from_secs(10), || !pools_in(&k).contains_key("node-1"));
    assert!(pools_in(&k).contains_key("node-2"));
    // A restarted controller finds the published pool and does not rewrite it for the same
    // report; a changed one continues the generation from the API.
    let gen2 = pools_in(&k)["node-2"].0;
    let before = rv(&k, "node-2-dra.nodeplane.dev-0");
    drop(ctl);
    let ctl = controller(&dir, &kubeconfig, "ctl2");
    wait_until("controller ready again", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    rt.block_on(report_epoch(ctl.grpc, &agent_n2, "node-2", vec![dra_device("fpga-0", 0)], 2)).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rv(&k, "node-2-dra.nodeplane.dev-0"), before, "a restarted controller rewrote an unchanged pool");
    rt.block_on(report_epoch(ctl.grpc, &agent_n2, "node-2", vec![dra_device("fpga-0", 0), dra_device("fpga-1", 0)], 2))
        .unwrap();
    wait_until("fpga-1 published", Duration::from_secs(5), || pools_in(&k)["node-2"].1.len() == 2);
    assert_eq!(pools_in(&k)["node-2"].0, gen2 + 1, "the generation continues from the published pool");
    drop(ctl);
    assert_granted(&k);
}

// ---- NetworkPolicy: compiled from the API's objects, streamed to the node ------------------

#[test]
fn network_policy_follows_the_apis_policies_pods_and_namespaces() {
    use nodeplane::rpc::controller as pb;
    let k = cluster();
    let dir = tempdir("kube-netpol");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    k.create("", "nodes", None, node_object("node-1"));
    let agent_n1 = k.agent_token("node-1");
    k.namespace("x", json!({"team": "a"}));
    k.namespace("y", json!({"team": "b"}));
    for (ns, pod) in [("x", "a"), ("y", "b")] {
        k.create(
            "",
            "pods",
            Some(ns),
            json!({"metadata": {"namespace": ns, "name": pod, "labels": {"pod": pod}},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                                     "ports": [{"name": "http", "containerPort": 8080}]}]}}),
        );
    }
    k.create("networking.k8s.io", "networkpolicies", Some("x"), json!({"metadata": {"namespace": "x", "name": "from-team-b"},
        "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                 "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}], "ports": [{"port": "http"}]}]}}));
    let ctl = controller(&dir, &kubeconfig, "ctl");
    wait_until("controller ready", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    let rt = rt();
    let blocks = rt.block_on(register(ctl.grpc, &agent_n1, "node-1")).unwrap();
    let v4: ipnetwork::Ipv4Network = blocks.iter().find_map(|b| b.parse().ok()).unwrap();
    let ip = |i: u32| std::net::Ipv4Addr::from(u32::from(v4.network()) + i).to_string();
    rt.block_on(async {
        let ch = channel(ctl.grpc).await.unwrap();
        let mut c = pb::network_policies_client::NetworkPoliciesClient::new(ch);
        let mut stream = c
            .watch_policy(bearer(pb::WatchPolicyRequest { node_name: "node-1".into() }, &agent_n1))
            .await
            .unwrap()
            .into_inner();
        let snap = stream.message().await.unwrap().unwrap();
        assert!(snap.snapshot && snap.pods.is_empty(), "{snap:?}");
        // The pods attached on node-1 (their labels come from the API).
        for (ns, pod, i) in [("x", "a", 2), ("y", "b", 3)] {
            let pa = pb::PodAddress { namespace: ns.into(), name: pod.into(), ips: vec![ip(i)] };
            let r = c
                .pod_started(bearer(pb::PodStartedRequest { node_name: "node-1".into(), pod: Some(pa) }, &agent_n1))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.isolated, ns == "x", "{ns}/{pod}: {r:?}");
        }
        // Someone else's addresses are refused: a node acts only on its own blocks.
        let foreign = pb::PodAddress { namespace: "x".into(), name: "z".into(), ips: vec!["192.0.2.1".into()] };
        let e = c
            .pod_started(bearer(pb::PodStartedRequest { node_name: "node-1".into(), pod: Some(foreign) }, &agent_n1))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        // Local mode's object API is refused here: objects come from the API.
        let mut admin = tonic::Request::new(pb::ApplyObjectsRequest { json: "{}".into() });
        admin.metadata_mut().insert("authorization", format!("Bearer {agent_n1}").parse().unwrap());
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
        let mut y = k.get("", "namespaces", None, "y").unwrap();
        y["metadata"]["labels"]["team"] = json!("c");
        k.put("", "namespaces", None, y);
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
        assert!(k.delete("networking.k8s.io", "networkpolicies", Some("x"), "from-team-b"));
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
    assert_granted(&k);
    for r in ["networkpolicies", "pods", "namespaces"] {
        assert!(k.controller_requests().iter().any(|c| c.resource == r && c.verb == "watch"), "{r} is watched");
    }
}

/// Found in review: a node removed from the registry (its Node object deleted) kept its
/// pods in every policy view. Its blocks return to the pools, so a pod on a new node could be
/// given one of those addresses and be admitted as the gone pod. Here y/b, on node-2, is the
/// only pod a policy on node-1 admits; node-2's Node is deleted, and node-1's set empties
/// although y/b's Pod object is still in the API.
#[test]
fn a_removed_nodes_pods_leave_every_policy_view() {
    use nodeplane::rpc::controller as pb;
    let k = cluster();
    let dir = tempdir("kube-netpol-gone");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    for n in ["node-1", "node-2"] {
        k.create("", "nodes", None, node_object(n));
    }
    k.namespace("x", json!({"team": "a"}));
    k.namespace("y", json!({"team": "b"}));
    for (ns, pod) in [("x", "a"), ("y", "b")] {
        k.create(
            "",
            "pods",
            Some(ns),
            json!({"metadata": {"namespace": ns, "name": pod, "labels": {"pod": pod}},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}),
        );
    }
    k.create(
        "networking.k8s.io",
        "networkpolicies",
        Some("x"),
        json!({"metadata": {"namespace": "x", "name": "from-team-b"},
        "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                 "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}]}]}}),
    );
    let ctl = controller(&dir, &kubeconfig, "ctl");
    wait_until("controller ready", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    let rt = rt();
    rt.block_on(async {
        let mut c = pb::network_policies_client::NetworkPoliciesClient::new(channel(ctl.grpc).await.unwrap());
        let mut addresses = BTreeMap::new();
        for (node, ns, pod) in [("node-1", "x", "a"), ("node-2", "y", "b")] {
            let token = k.agent_token(node);
            let blocks = register(ctl.grpc, &token, node).await.unwrap();
            let v4: ipnetwork::Ipv4Network = blocks.iter().find_map(|b| b.parse().ok()).unwrap();
            let ip = std::net::Ipv4Addr::from(u32::from(v4.network()) + 2).to_string();
            let pa = pb::PodAddress { namespace: ns.into(), name: pod.into(), ips: vec![ip.clone()] };
            c.pod_started(bearer(pb::PodStartedRequest { node_name: node.into(), pod: Some(pa) }, &token))
                .await
                .unwrap();
            addresses.insert(node, ip);
        }
        let watch = bearer(pb::WatchPolicyRequest { node_name: "node-1".into() }, &k.agent_token("node-1"));
        let mut stream = c.watch_policy(watch).await.unwrap().into_inner();
        let mut view = nodeplane::net::policy::View::default();
        let admitted = |view: &nodeplane::net::policy::View| -> Vec<String> {
            view.address_sets.values().flat_map(|s| s.cidrs.clone()).collect()
        };
        let want = vec![format!("{}/32", addresses["node-2"])];
        while admitted(&view) != want {
            let u = tokio::time::timeout(Duration::from_secs(5), stream.message()).await.expect("y/b admitted");
            view = view.applied(&u.unwrap().unwrap()).unwrap();
        }
        assert!(k.delete("", "nodes", None, "node-2"));
        while !admitted(&view).is_empty() {
            let u = tokio::time::timeout(Duration::from_secs(10), stream.message()).await.expect("y/b gone");
            view = view.applied(&u.unwrap().unwrap()).unwrap();
        }
        assert!(!view.pods["x/a"].ingress_group.is_empty(), "x/a stays isolated: {view:?}");
    });
    assert!(k.get("", "pods", Some("y"), "b").is_some(), "the Pod object stays; only the node went");
}

/// Found against the real API server: a controller that has just started (or taken over)
/// answered PodStarted, and sent agents their first policy view, before it had read the
/// NetworkPolicies, Pods and Namespaces from the API: "not isolated" for a pod a policy
/// selects (its ADD would not wait for the policy), and a view without the policy (the agent
/// would lift it). Here the controller's first list of NetworkPolicies is held by the API
/// server (the test's audit webhook) while an agent reports its pod, watches, and starts it.
#[test]
fn policy_answers_wait_until_the_objects_are_listed() {
    use nodeplane::rpc::controller as pb;
    let hook = AuditHook::start();
    let k = ApiServer::start_with(envtest::Options { audit_webhook: Some(hook.url()), ..Default::default() });
    let dir = tempdir("kube-netpol-sync");
    let kubeconfig = dir.join("kubeconfig");
    k.write_controller_kubeconfig(&kubeconfig);
    k.create("", "nodes", None, node_object("node-1"));
    let agent_n1 = k.agent_token("node-1");
    k.namespace("x", json!({}));
    k.create(
        "",
        "pods",
        Some("x"),
        json!({"metadata": {"namespace": "x", "name": "a", "labels": {"pod": "a"}},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}),
    );
    k.create(
        "networking.k8s.io",
        "networkpolicies",
        Some("x"),
        json!({"metadata": {"namespace": "x", "name": "deny"},
        "spec": {"podSelector": {"matchLabels": {"pod": "a"}}, "policyTypes": ["Ingress"]}}),
    );
    let (release, held) = std::sync::mpsc::channel::<()>();
    let first_policy_list = |ev: &serde_json::Value| {
        ev["stage"] == "RequestReceived"
            && ev["verb"] == "list"
            && ev["objectRef"]["resource"] == "networkpolicies"
            && ev["user"]["username"] == CONTROLLER_USER
    };
    hook.arm(
        first_policy_list,
        Box::new(move || {
            let _ = held.recv_timeout(Duration::from_secs(30));
        }),
    );
    let ctl = controller(&dir, &kubeconfig, "ctl");
    wait_until("controller ready", Duration::from_secs(20), || http_get(ctl.health, "/readyz") == Some(200));
    wait_until("its NetworkPolicy list held", Duration::from_secs(20), || hook.spent());
    let rt = rt();
    let blocks = rt.block_on(register(ctl.grpc, &agent_n1, "node-1")).unwrap();
    let v4: ipnetwork::Ipv4Network = blocks.iter().find_map(|b| b.parse().ok()).unwrap();
    let xa = pb::PodAddress {
        namespace: "x".into(),
        name: "a".into(),
        ips: vec![std::net::Ipv4Addr::from(u32::from(v4.network()) + 2).to_string()],
    };
    rt.block_on(async {
        let mut c = pb::network_policies_client::NetworkPoliciesClient::new(channel(ctl.grpc).await.unwrap());
        // An agent reconnecting to a new controller: its pods, then its stream.
        let pods = pb::ReportPodsRequest { node_name: "node-1".into(), pods: vec![xa.clone()] };
        c.report_pods(bearer(pods, &agent_n1)).await.unwrap();
        let watch = bearer(pb::WatchPolicyRequest { node_name: "node-1".into() }, &agent_n1);
        let mut stream = c.watch_policy(watch).await.unwrap().into_inner();
        let started = bearer(pb::PodStartedRequest { node_name: "node-1".into(), pod: Some(xa) }, &agent_n1);
        let mut c2 = c.clone();
        let answer = tokio::spawn(async move { c2.pod_started(started).await });
        // While the list is held: no view, no answer.
        let first = tokio::time::timeout(Duration::from_millis(1500), stream.message()).await;
        assert!(first.is_err(), "a view before the policies were listed: {first:?}");
        assert!(!answer.is_finished(), "PodStarted answered before the policies were listed");
        release.send(()).unwrap();
        let isolated = answer.await.unwrap().unwrap().into_inner().isolated;
        assert!(isolated, "x/a is selected by x/deny");
        let snap = tokio::time::timeout(Duration::from_secs(10), stream.message()).await.unwrap().unwrap().unwrap();
        let view = nodeplane::net::policy::View::default().applied(&snap).unwrap();
        assert!(!view.pods["x/a"].ingress_group.is_empty(), "the first view isolates x/a: {view:?}");
    });
}

/// `n` nodes' records and block locks (`node-00000`, `10.0.0.0/24`, ...), as the API server
/// stores them: seeded into etcd before it starts (creating 2n objects through the API
/// would take minutes).
fn seeded_nodes(n: usize, underlay: impl Fn(usize) -> String) -> Vec<(kube::core::ApiResource, serde_json::Value)> {
    let mut out = Vec::with_capacity(2 * n);
    for i in 0..n {
        let name = format!("node-{i:05}");
        let v4 = format!("10.{}.{}.0/24", i / 256, i % 256);
        out.push((
            envtest::resource(GROUP, "nodeplanenodes"),
            json!({"metadata": {"name": name}, "spec": {"underlay": [underlay(i)], "vtepMac": "", "blocks": [v4]}}),
        ));
        out.push((envtest::resource(GROUP, "ipblocks"), lock_object(&v4, &name)));
    }
    out
}

/// Issue 21: a registry of 5,000 nodes (records and block locks) loads from the API in pages
/// (`limit` 500 and `continue`, every page from the snapshot of the first), not in one
/// answer, and nothing is lost between pages; the stream then serves it.
#[test]
fn a_5000_node_registry_loads_in_pages() {
    const N: usize = 5000;
    let seed = seeded_nodes(N, |i| format!("198.18.{}.{}", i / 250, 1 + i % 250));
    let k = ApiServer::start_with(envtest::Options { seed, ..Default::default() });
    assert_eq!(
        k.get(GROUP, "nodeplanenodes", None, "node-04999").unwrap()["spec"]["blocks"],
        json!(["10.19.135.0/24"])
    );
    let pools = vec![Pool { net: "10.0.0.0/8".parse().unwrap(), block_prefix: 24 }];
    let r = Registry::with_backend(backend(&k), pools).unwrap();
    assert_eq!(r.node_count(), N);
    assert_eq!(r.get("node-04999").unwrap().blocks, vec!["10.19.135.0/24"]);
    // The next free block is after all of them: every lock was read.
    let more = r.register("node-new", &["198.18.100.1".into()], "").unwrap();
    assert_eq!(more.blocks, vec![format!("10.{}.{}.0/24", N / 256, N % 256)]);
    let lists: Vec<_> = k.controller_requests().into_iter().filter(|q| q.verb == "list").collect();
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

/// A continue token the API server let expire between two pages (410 Expired after a
/// compaction) starts the list again from a fresh snapshot: nothing half-listed is used.
///
/// The API server reads from etcd here (no watch cache: the cache learns of a compaction
/// only every 15 s and would serve the old snapshot meanwhile), and the test's audit
/// webhook, which the API server calls before it serves each request, compacts etcd past the
/// list's snapshot just before the second page is read: twice. etcd is the test's own, so
/// the compaction reaches no other test.
#[test]
fn an_expired_continue_token_restarts_the_list() {
    let hook = AuditHook::start();
    let k = ApiServer::start_with(envtest::Options {
        own_etcd: true,
        no_watch_cache: true,
        audit_webhook: Some(hook.url()),
        seed: seeded_nodes(1200, |_| "198.18.0.1".into()),
    });
    for _ in 0..2 {
        let (etcd, bump) = (k.etcd(), format!("{}-bump", k.prefix()));
        let second_page = |ev: &serde_json::Value| {
            ev["stage"] == "RequestReceived"
                && ev["verb"] == "list"
                && ev["objectRef"]["resource"] == "nodeplanenodes"
                && ev["user"]["username"] == CONTROLLER_USER
                && ev["requestURI"].as_str().is_some_and(|u| u.contains("continue="))
        };
        hook.arm(second_page, Box::new(move || etcd.compact(etcd.put(&bump, ""))));
    }
    let pools = vec![Pool { net: "10.0.0.0/8".parse().unwrap(), block_prefix: 24 }];
    let r = Registry::with_backend(backend(&k), pools).unwrap();
    assert_eq!(r.node_count(), 1200);
    assert!(hook.spent(), "both compactions happened");
    let lists: Vec<_> =
        k.controller_requests().into_iter().filter(|q| q.verb == "list" && q.resource == "nodeplanenodes").collect();
    let expired = lists.iter().filter(|q| q.continued && q.code == Some(410)).count();
    assert_eq!(expired, 2, "the API server's own 410s: {lists:?}");
    let starts = lists.iter().filter(|q| !q.continued).count();
    assert_eq!(starts, 3, "the list started again after each expired token");
}

#[test]
fn volume_keys_are_secrets_the_controller_makes_once_and_removes() {
    use nodeplane::controller::keys::KeyStore;
    let k = cluster();
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
        let keys = KeyStore::Secrets { client, namespace: NS.into() };
        keys.ensure("pvc-enc-1", "pvc-enc-1").await.unwrap();
        keys.ensure("pvc-enc-1", "pvc-enc-1").await.unwrap();
        keys.ensure("pvc-enc-2", "pvc-enc-2").await.unwrap();
    });
    let key_of = |name: &str| {
        let s = k.get("", "secrets", Some(NS), &format!("nodeplane-key-{name}")).unwrap();
        assert_eq!(s["type"], "Opaque");
        assert_eq!(managers_of(&s), ["nodeplane-controller".to_string()].into());
        let b64 = s["data"]["key"].as_str().unwrap().to_string();
        assert_eq!(b64.len(), 88, "64 hex digits, base64-encoded: {b64}");
        b64
    };
    assert_ne!(key_of("pvc-enc-1"), key_of("pvc-enc-2"), "a key of its own per volume");
    let creates = k.controller_requests().iter().filter(|r| r.resource == "secrets" && r.verb == "create").count();
    assert_eq!(creates, 2, "made once each, then read");
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
        let keys = KeyStore::Secrets { client, namespace: NS.into() };
        keys.remove("pvc-enc-1", "pvc-enc-1").await.unwrap();
        keys.remove("pvc-enc-1", "pvc-enc-1").await.unwrap();
    });
    assert!(k.get("", "secrets", Some(NS), "nodeplane-key-pvc-enc-1").is_none());
    assert!(k.get("", "secrets", Some(NS), "nodeplane-key-pvc-enc-2").is_some());
    assert_granted(&k);
}

#[test]
fn a_short_pool_is_an_event_on_its_node() {
    use nodeplane::controller::kube::events::NodeEvents;
    use nodeplane::controller::records::StoreBackend;
    use nodeplane::controller::volumes::PoolChange;
    let k = cluster();
    let node = "pool-node-1";
    rt().block_on(async {
        let client = kube::Client::try_from(kube_config(&k).await).unwrap();
        let events = NodeEvents::new(client, Some("controller-0".into()));
        let short = PoolChange { backend: StoreBackend::Lvm, short: true };
        events.pool(node, short).await.unwrap();
        events.pool(node, short).await.unwrap();
        events.pool(node, PoolChange { short: false, ..short }).await.unwrap();
    });
    let of_node: Vec<serde_json::Value> =
        k.list("events.k8s.io", "events").into_iter().filter(|e| e["regarding"]["name"] == node).collect();
    let by_reason = |reason: &str| of_node.iter().find(|e| e["reason"] == reason).cloned();
    let short = by_reason("StoragePoolShort").expect("the short event");
    assert_eq!(short["metadata"]["namespace"], "default", "a Node's events are in default, as kubelet's");
    assert_eq!(short["type"], "Warning");
    assert_eq!(short["regarding"]["kind"], "Node");
    assert_eq!(short["reportingController"], "nodeplane-controller");
    assert!(short["note"].as_str().unwrap().contains("lvm pool is at least 90% full"), "{short}");
    assert_eq!(short["series"]["count"], 2, "the repeat is counted on the same event: {short}");
    assert_eq!(by_reason("StoragePoolRecovered").expect("the recovery event")["type"], "Normal");
    assert_eq!(of_node.len(), 2, "{of_node:?}");
    assert_granted(&k);
}
