//! Tests of the fake Kubernetes apiserver in `tools/support/fake_apiserver.rs`, driven with the real
//! kube-rs client (typed `Api<Lease>`/`Api<Node>`, `Api<DynamicObject>` for a custom group,
//! `kube::runtime::watcher`) and, for wire-level details, with raw HTTP/1.1.
//!
//! Every test starts its own server (ephemeral port) and temp dir; both go away on drop, also
//! when an assertion fails.

#[path = "../tools/support/fake_apiserver.rs"]
mod fake_apiserver;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fake_apiserver::{API_AUDIENCE, FakeApiServer, UserInfo};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, ObjectMeta, Patch, PatchParams, PostParams,
    Preconditions, WatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::{Client, Config, ResourceExt};
use serde_json::{Value, json};
use tokio_stream::StreamExt;

const TOKEN: &str = "admin-token";
const GROUP: &str = "nodeplane.io";
const WAIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A started server, a temp dir, and a kube client authenticated as `admin`.
struct Env {
    server: FakeApiServer,
    dir: PathBuf,
    client: Client,
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_dir() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fake-apiserver-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

async fn env() -> Env {
    let server = FakeApiServer::start();
    server.add_token(
        TOKEN,
        UserInfo { username: "admin".into(), groups: vec!["system:masters".into()], ..UserInfo::default() },
    );
    server.register(GROUP, "v1", "ipblocks", "IpBlock", false);
    let dir = temp_dir();
    let client = client_for(&server, &dir, TOKEN).await;
    Env { server, dir, client }
}

/// A client loaded from a kubeconfig file the server wrote, as the controller will load it.
async fn client_for(server: &FakeApiServer, dir: &std::path::Path, token: &str) -> Client {
    Client::try_from(config_for(server, dir, token).await).expect("kube client")
}

async fn config_for(server: &FakeApiServer, dir: &std::path::Path, token: &str) -> Config {
    let path = dir.join(format!("kubeconfig-{token}"));
    server.write_kubeconfig(&path, token);
    let kc = Kubeconfig::read_from(&path).expect("kube can read the kubeconfig");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("kube config");
    assert_eq!(config.default_namespace, "default");
    config
}

/// kube 5 clients retry 429/503/504 (15 times, exponential backoff): one without that.
async fn no_retry_client(e: &Env) -> Client {
    let mut config = config_for(&e.server, &e.dir, TOKEN).await;
    config.default_retry = false;
    Client::try_from(config).expect("kube client")
}

fn ipblocks() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: "v1".into(),
        api_version: format!("{GROUP}/v1"),
        kind: "IpBlock".into(),
        plural: "ipblocks".into(),
    }
}

fn ipblock(name: &str, cidr: &str) -> DynamicObject {
    DynamicObject::new(name, &ipblocks()).data(json!({"spec": {"cidr": cidr}}))
}

fn lease(name: &str, holder: &str) -> Lease {
    Lease {
        metadata: ObjectMeta { name: Some(name.into()), ..ObjectMeta::default() },
        spec: Some(LeaseSpec { holder_identity: Some(holder.into()), ..LeaseSpec::default() }),
    }
}

fn node(name: &str, labels: &[(&str, &str)]) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }
}

/// The (code, reason) of an API error; panics on success or another kind of error.
fn api_err<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> (u16, String, String) {
    match r {
        Err(kube::Error::Api(s)) => (s.code, s.reason.clone(), s.message.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn rv_num<K: kube::Resource>(o: &K) -> u64 {
    o.meta().resource_version.as_deref().expect("resourceVersion").parse().expect("decimal resourceVersion")
}

/// One raw HTTP/1.1 request (`Connection: close`); returns status, headers (lowercased
/// names) and the de-chunked body.
fn raw(
    server: &FakeApiServer,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(server.addr()).expect("connect");
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", server.addr());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).expect("read response");
    let resp = String::from_utf8(resp).expect("utf-8 response");
    let (head, rest) = resp.split_once("\r\n\r\n").expect("response head");
    let code: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut rest = rest;
        loop {
            let (size, after) = rest.split_once("\r\n").expect("chunk size");
            let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
            if size == 0 {
                break;
            }
            out.push_str(&after[..size]);
            rest = &after[size + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (code, head, body)
}

fn auth() -> (&'static str, String) {
    ("Authorization", format!("Bearer {TOKEN}"))
}

fn raw_auth(server: &FakeApiServer, method: &str, path: &str, ctype: Option<&str>, body: &str) -> (u16, Value) {
    let (k, v) = auth();
    let mut headers = vec![(k, v.as_str())];
    if let Some(c) = ctype {
        headers.push(("Content-Type", c));
    }
    let (code, _, body) = raw(server, method, path, &headers, body);
    (code, serde_json::from_str(&body).unwrap_or(Value::String(body)))
}

fn watch_lines(body: &str) -> Vec<Value> {
    body.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).expect("event JSON")).collect()
}

/// What a watcher consumer knows, built only from `watcher` events.
#[derive(Default)]
struct Mirror {
    objects: BTreeMap<String, DynamicObject>,
    relist: Option<BTreeMap<String, DynamicObject>>,
    lists: usize,
    errors: Vec<String>,
    expired: usize,
}

impl Mirror {
    fn apply(&mut self, ev: Result<watcher::Event<DynamicObject>, watcher::Error>) {
        match ev {
            Ok(watcher::Event::Init) => self.relist = Some(BTreeMap::new()),
            Ok(watcher::Event::InitApply(o)) => {
                self.relist.get_or_insert_default().insert(o.name_any(), o);
            }
            Ok(watcher::Event::InitDone) => {
                self.objects = self.relist.take().unwrap_or_default();
                self.lists += 1;
            }
            Ok(watcher::Event::Apply(o)) => {
                self.objects.insert(o.name_any(), o);
            }
            Ok(watcher::Event::Delete(o)) => {
                self.objects.remove(&o.name_any());
            }
            Err(e) => {
                if let watcher::Error::WatchError(s) = &e
                    && s.code == 410
                {
                    self.expired += 1;
                }
                self.errors.push(e.to_string());
            }
        }
    }

    fn cidrs(&self) -> BTreeMap<String, String> {
        self.objects
            .iter()
            .map(|(k, o)| (k.clone(), o.data["spec"]["cidr"].as_str().unwrap_or("").to_string()))
            .collect()
    }
}

/// Feeds watcher events into `mirror` until `done(mirror)` holds; panics after [`WAIT`].
async fn pump<S>(stream: &mut S, mirror: &mut Mirror, done: impl Fn(&Mirror) -> bool)
where
    S: tokio_stream::Stream<Item = Result<watcher::Event<DynamicObject>, watcher::Error>> + Unpin,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    while !done(mirror) {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(ev)) => mirror.apply(ev),
            Ok(None) => panic!("watcher stream ended"),
            Err(_) => panic!(
                "timed out; mirror has {:?} after {} lists, errors {:?}",
                mirror.cidrs(),
                mirror.lists,
                mirror.errors
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// CRUD
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn create_get_and_already_exists() {
    let e = env().await;
    let leases: Api<Lease> = Api::namespaced(e.client.clone(), "kube-system");

    let before: u64 = e.server.resource_version().parse().unwrap();
    let created = leases.create(&PostParams::default(), &lease("ctl", "a")).await.expect("create");
    assert_eq!(created.metadata.namespace.as_deref(), Some("kube-system"));
    assert!(created.metadata.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert!(created.metadata.creation_timestamp.is_some());
    assert_eq!(created.metadata.generation, Some(1));
    assert!(rv_num(&created) > before);
    assert_eq!(created.metadata.resource_version, Some(e.server.resource_version()));

    let got = leases.get("ctl").await.expect("get");
    assert_eq!(got, created);
    let raw_obj = e.server.get("coordination.k8s.io", "leases", Some("kube-system"), "ctl").expect("stored");
    assert_eq!(raw_obj["kind"], "Lease");
    assert_eq!(raw_obj["apiVersion"], "coordination.k8s.io/v1");

    let (code, reason, msg) = api_err(leases.create(&PostParams::default(), &lease("ctl", "b")).await);
    assert_eq!((code, reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(msg, "leases.coordination.k8s.io \"ctl\" already exists");

    let (code, reason, msg) = api_err(leases.get("nope").await);
    assert_eq!((code, reason.as_str()), (404, "NotFound"));
    assert_eq!(msg, "leases.coordination.k8s.io \"nope\" not found");
    assert!(leases.get_opt("nope").await.expect("get_opt").is_none());

    // Same name in another namespace is another object.
    let other: Api<Lease> = Api::namespaced(e.client.clone(), "default");
    other.create(&PostParams::default(), &lease("ctl", "c")).await.expect("create in default");

    // Cluster-scoped custom resource, with generateName.
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    let mut generated = ipblock("", "10.0.0.0/24");
    generated.metadata.name = None;
    generated.metadata.generate_name = Some("blk-".into());
    let generated = blocks.create(&PostParams::default(), &generated).await.expect("create with generateName");
    assert!(generated.name_any().starts_with("blk-") && generated.name_any().len() == 9, "{}", generated.name_any());
    assert_eq!(generated.metadata.namespace, None);

    // Invalid names are 422 Invalid.
    let (code, reason, _) = api_err(blocks.create(&PostParams::default(), &ipblock("Bad_Name", "x")).await);
    assert_eq!((code, reason.as_str()), (422, "Invalid"));
}

#[tokio::test]
async fn replace_with_stale_resource_version_conflicts() {
    let e = env().await;
    let leases: Api<Lease> = Api::namespaced(e.client.clone(), "default");
    let v1 = leases.create(&PostParams::default(), &lease("l", "a")).await.unwrap();

    let mut v2 = v1.clone();
    v2.spec.as_mut().unwrap().holder_identity = Some("b".into());
    let v2 = leases.replace("l", &PostParams::default(), &v2).await.expect("replace with current RV");
    assert!(rv_num(&v2) > rv_num(&v1));
    assert_eq!(v2.metadata.uid, v1.metadata.uid);
    assert_eq!(v2.metadata.creation_timestamp, v1.metadata.creation_timestamp);
    assert_eq!(v2.metadata.generation, Some(2), "a spec change bumps generation");

    let mut stale = v1.clone();
    stale.spec.as_mut().unwrap().holder_identity = Some("c".into());
    let (code, reason, msg) = api_err(leases.replace("l", &PostParams::default(), &stale).await);
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
    assert_eq!(
        msg,
        "Operation cannot be fulfilled on leases.coordination.k8s.io \"l\": the object has been modified; \
         please apply your changes to the latest version and try again"
    );
    assert_eq!(leases.get("l").await.unwrap(), v2, "a conflicting write changes nothing");

    // Built-in types take an unconditional update without resourceVersion.
    stale.metadata.resource_version = None;
    let v3 = leases.replace("l", &PostParams::default(), &stale).await.expect("unconditional update");
    assert_eq!(v3.spec.as_ref().unwrap().holder_identity.as_deref(), Some("c"));

    // A no-op update writes nothing: same resourceVersion.
    let same = leases.replace("l", &PostParams::default(), &leases.get("l").await.unwrap()).await.unwrap();
    assert_eq!(rv_num(&same), rv_num(&v3));

    // A label change does not bump generation.
    let mut labelled = same.clone();
    labelled.metadata.labels = Some(BTreeMap::from([("k".to_string(), "v".to_string())]));
    let labelled = leases.replace("l", &PostParams::default(), &labelled).await.unwrap();
    assert_eq!(labelled.metadata.generation, same.metadata.generation);
    assert!(rv_num(&labelled) > rv_num(&same));

    // Absent object: 404.
    let (code, reason, _) = api_err(leases.replace("absent", &PostParams::default(), &lease("absent", "x")).await);
    assert_eq!((code, reason.as_str()), (404, "NotFound"));

    // Custom resources need a resourceVersion on update, like CRDs on a real apiserver.
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    let b = blocks.create(&PostParams::default(), &ipblock("b1", "10.0.0.0/24")).await.unwrap();
    let (code, reason, _) = api_err(blocks.replace("b1", &PostParams::default(), &ipblock("b1", "10.0.1.0/24")).await);
    assert_eq!((code, reason.as_str()), (422, "Invalid"));
    let mut b2 = b.clone();
    b2.data["spec"]["cidr"] = json!("10.0.1.0/24");
    let b2 = blocks.replace("b1", &PostParams::default(), &b2).await.expect("replace with RV");
    let (code, reason, _) = api_err(blocks.replace("b1", &PostParams::default(), &b).await);
    assert_eq!((code, reason.as_str()), (409, "Conflict"));
    assert_eq!(blocks.get("b1").await.unwrap().data["spec"], b2.data["spec"]);
}

#[tokio::test]
async fn delete_and_not_found() {
    let e = env().await;
    let leases: Api<Lease> = Api::namespaced(e.client.clone(), "default");
    let l = leases.create(&PostParams::default(), &lease("l", "a")).await.unwrap();

    // Preconditions that do not match: 409, nothing deleted.
    let dp = DeleteParams {
        preconditions: Some(Preconditions { resource_version: Some("1".into()), uid: None }),
        ..DeleteParams::default()
    };
    let (code, reason, msg) = api_err(leases.delete("l", &dp).await);
    assert_eq!((code, reason.as_str()), (409, "Conflict"), "{msg}");
    let dp = DeleteParams {
        preconditions: Some(Preconditions { resource_version: None, uid: Some("other".into()) }),
        ..DeleteParams::default()
    };
    assert_eq!(api_err(leases.delete("l", &dp).await).0, 409);
    assert!(leases.get_opt("l").await.unwrap().is_some());

    // Matching preconditions: deleted; built-in types answer with a Success Status.
    let dp = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: l.metadata.resource_version.clone(),
            uid: l.metadata.uid.clone(),
        }),
        ..DeleteParams::default()
    };
    let status = leases.delete("l", &dp).await.expect("delete").right().expect("a Status");
    assert!(status.is_success());
    assert!(leases.get_opt("l").await.unwrap().is_none());
    assert!(e.server.get("coordination.k8s.io", "leases", Some("default"), "l").is_none());

    let (code, reason, _) = api_err(leases.delete("l", &DeleteParams::default()).await);
    assert_eq!((code, reason.as_str()), (404, "NotFound"));

    // Custom resources answer with the deleted object.
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    blocks.create(&PostParams::default(), &ipblock("b1", "10.0.0.0/24")).await.unwrap();
    let gone = blocks.delete("b1", &DeleteParams::default()).await.unwrap().left().expect("the object");
    assert_eq!(gone.name_any(), "b1");

    // deletecollection with a selector.
    let nodes: Api<Node> = Api::all(e.client.clone());
    for (n, role) in [("n1", "w"), ("n2", "w"), ("n3", "m")] {
        nodes.create(&PostParams::default(), &node(n, &[("role", role)])).await.unwrap();
    }
    nodes.delete_collection(&DeleteParams::default(), &ListParams::default().labels("role=w")).await.unwrap();
    let left: Vec<String> =
        nodes.list(&ListParams::default()).await.unwrap().items.iter().map(|n| n.name_any()).collect();
    assert_eq!(left, vec!["n3"]);
}

#[tokio::test]
async fn list_resource_version_and_selectors() {
    let e = env().await;
    let nodes: Api<Node> = Api::all(e.client.clone());
    nodes.create(&PostParams::default(), &node("n1", &[("role", "worker"), ("zone", "a")])).await.unwrap();
    nodes.create(&PostParams::default(), &node("n2", &[("role", "master")])).await.unwrap();
    nodes.create(&PostParams::default(), &node("n3", &[])).await.unwrap();
    // Writes to other resources move the one global resourceVersion too.
    e.server.put_object(GROUP, "ipblocks", None, json!({"metadata": {"name": "x"}}));

    let list = nodes.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.metadata.resource_version, Some(e.server.resource_version()));
    assert_eq!(list.items.len(), 3);

    let names = |sel: &'static str, fields: bool| {
        let nodes = nodes.clone();
        async move {
            let lp = if fields { ListParams::default().fields(sel) } else { ListParams::default().labels(sel) };
            nodes.list(&lp).await.unwrap().items.iter().map(|n| n.name_any()).collect::<Vec<_>>()
        }
    };
    assert_eq!(names("role=worker", false).await, ["n1"]);
    assert_eq!(names("role==worker,zone=a", false).await, ["n1"]);
    assert_eq!(names("role", false).await, ["n1", "n2"]);
    assert_eq!(names("!role", false).await, ["n3"]);
    assert_eq!(names("role!=worker", false).await, ["n2", "n3"]);
    assert_eq!(names("role in (worker, master)", false).await, ["n1", "n2"]);
    assert_eq!(names("role notin (worker)", false).await, ["n2", "n3"]);
    assert_eq!(names("metadata.name=n2", true).await, ["n2"]);
    assert_eq!(names("metadata.name!=n2", true).await, ["n1", "n3"]);

    let (code, reason, _) = api_err(nodes.list(&ListParams::default().fields("spec.unschedulable=true")).await);
    assert_eq!((code, reason.as_str()), (400, "BadRequest"));
    assert_eq!(api_err(nodes.list(&ListParams::default().labels("a b c")).await).0, 400);

    // Namespaced resources list across namespaces at the cluster path.
    let all: Api<Lease> = Api::all(e.client.clone());
    for ns in ["a", "b"] {
        Api::<Lease>::namespaced(e.client.clone(), ns).create(&PostParams::default(), &lease("l", ns)).await.unwrap();
    }
    assert_eq!(all.list(&ListParams::default()).await.unwrap().items.len(), 2);
    assert_eq!(
        Api::<Lease>::namespaced(e.client.clone(), "a").list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
}

#[tokio::test]
async fn patches_and_status_subresource() {
    let e = env().await;
    let nodes: Api<Node> = Api::all(e.client.clone());
    let n = nodes.create(&PostParams::default(), &node("n1", &[])).await.unwrap();

    let merged = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"a": "1"}}, "spec": {"podCIDR": "10.1.0.0/24"}})),
        )
        .await
        .expect("merge patch");
    assert_eq!(merged.labels().get("a").map(String::as_str), Some("1"));
    assert_eq!(merged.spec.as_ref().unwrap().pod_cidr.as_deref(), Some("10.1.0.0/24"));
    assert_eq!(merged.metadata.generation, Some(2));

    // null removes.
    let removed = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"a": null}}})))
        .await
        .unwrap();
    assert!(!removed.labels().contains_key("a"));

    // A merge patch carrying a stale resourceVersion is a conditional update.
    let (code, reason, _) = api_err(
        nodes
            .patch(
                "n1",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"resourceVersion": n.metadata.resource_version, "labels": {"b": "2"}}}),
                ),
            )
            .await,
    );
    assert_eq!((code, reason.as_str()), (409, "Conflict"));

    // JSON patch (RFC 6902), including a failing test op.
    let patched = nodes
        .patch(
            "n1",
            &PatchParams::default(),
            &Patch::Json::<()>(
                serde_json::from_value(json!([
                    {"op": "add", "path": "/metadata/labels/c", "value": "3"},
                    {"op": "replace", "path": "/spec/podCIDR", "value": "10.2.0.0/24"}
                ]))
                .unwrap(),
            ),
        )
        .await
        .expect("json patch");
    assert_eq!(patched.labels().get("c").map(String::as_str), Some("3"));
    assert_eq!(patched.spec.as_ref().unwrap().pod_cidr.as_deref(), Some("10.2.0.0/24"));
    let failing = Patch::Json::<()>(
        serde_json::from_value(json!([{"op": "test", "path": "/spec/podCIDR", "value": "x"}])).unwrap(),
    );
    assert_eq!(api_err(nodes.patch("n1", &PatchParams::default(), &failing).await).1, "Invalid");

    // A no-op patch writes nothing.
    let again = nodes
        .patch("n1", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"c": "3"}}})))
        .await
        .unwrap();
    assert_eq!(again.metadata.resource_version, patched.metadata.resource_version);

    // Strategic merge patch and server-side apply are not implemented: 415.
    let (code, reason, _) =
        api_err(nodes.patch("n1", &PatchParams::default(), &Patch::Strategic(json!({"spec": {}}))).await);
    assert_eq!((code, reason.as_str()), (415, "UnsupportedMediaType"));
    assert_eq!(api_err(nodes.patch("n1", &PatchParams::apply("t"), &Patch::Apply(json!({}))).await).0, 415);

    // Patching the status subresource changes only .status.
    let st = nodes
        .patch_status(
            "n1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}, "spec": {"podCIDR": "ignored"}})),
        )
        .await
        .expect("status patch");
    assert_eq!(st.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
    assert_eq!(st.spec.as_ref().unwrap().pod_cidr.as_deref(), Some("10.2.0.0/24"));
    assert!(e.server.calls().contains(&("patch".into(), "".into(), "nodes/status".into(), None)));

    let (code, reason, _) = api_err(nodes.patch("absent", &PatchParams::default(), &Patch::Merge(json!({}))).await);
    assert_eq!((code, reason.as_str()), (404, "NotFound"));
}

// ---------------------------------------------------------------------------------------------
// Watch
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn watcher_sees_add_modify_delete() {
    let e = env().await;
    e.server.put_object(GROUP, "ipblocks", None, json!({"metadata": {"name": "pre"}, "spec": {"cidr": "10.9.0.0/24"}}));
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    let mut stream = Box::pin(watcher(blocks.clone(), watcher::Config::default()));
    let mut m = Mirror::default();
    pump(&mut stream, &mut m, |m| m.lists == 1).await;
    assert_eq!(m.cidrs(), BTreeMap::from([("pre".to_string(), "10.9.0.0/24".to_string())]));

    blocks.create(&PostParams::default(), &ipblock("a", "10.0.0.0/24")).await.unwrap();
    pump(&mut stream, &mut m, |m| m.objects.contains_key("a")).await;

    blocks.patch("a", &PatchParams::default(), &Patch::Merge(json!({"spec": {"cidr": "10.0.1.0/24"}}))).await.unwrap();
    pump(&mut stream, &mut m, |m| m.cidrs().get("a").map(String::as_str) == Some("10.0.1.0/24")).await;

    blocks.delete("a", &DeleteParams::default()).await.unwrap();
    e.server.delete_object(GROUP, "ipblocks", None, "pre");
    pump(&mut stream, &mut m, |m| m.objects.is_empty()).await;
    assert_eq!(m.lists, 1, "no relist needed: {:?}", m.errors);
    assert!(m.errors.is_empty(), "{:?}", m.errors);
}

#[tokio::test]
async fn compaction_and_closed_watches_force_a_relist() {
    let e = env().await;
    for (n, c) in [("a", "10.0.0.0/24"), ("b", "10.0.1.0/24"), ("c", "10.0.2.0/24")] {
        e.server.put_object(GROUP, "ipblocks", None, json!({"metadata": {"name": n}, "spec": {"cidr": c}}));
    }
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    let mut stream = Box::pin(watcher(blocks.clone(), watcher::Config::default()));
    let mut m = Mirror::default();
    pump(&mut stream, &mut m, |m| m.lists == 1 && m.objects.len() == 3).await;
    blocks.create(&PostParams::default(), &ipblock("d", "10.0.3.0/24")).await.unwrap();
    pump(&mut stream, &mut m, |m| m.objects.len() == 4).await;

    // The apiserver "restarts": watches end, and while the watcher cannot reach it, "b" is
    // deleted, "c" changes, and the history it would resume from is compacted away.
    e.server.set_paused(true);
    e.server.close_watches();
    // Drive the watcher into its (held) re-watch.
    let _ = tokio::time::timeout(Duration::from_millis(500), async {
        while let Some(ev) = stream.next().await {
            m.apply(ev);
        }
    })
    .await;
    assert!(e.server.delete_object(GROUP, "ipblocks", None, "b"));
    e.server.put_object(GROUP, "ipblocks", None, json!({"metadata": {"name": "c"}, "spec": {"cidr": "10.0.9.0/24"}}));
    e.server.compact();
    e.server.set_paused(false);

    let want = BTreeMap::from([
        ("a".to_string(), "10.0.0.0/24".to_string()),
        ("c".to_string(), "10.0.9.0/24".to_string()),
        ("d".to_string(), "10.0.3.0/24".to_string()),
    ]);
    pump(&mut stream, &mut m, |m| m.lists >= 2 && m.cidrs() == want).await;
    assert_eq!(m.expired, 1, "resumed watch must end with 410 Expired: {:?}", m.errors);

    // And it keeps watching after the relist.
    blocks.create(&PostParams::default(), &ipblock("e", "10.0.4.0/24")).await.unwrap();
    pump(&mut stream, &mut m, |m| m.objects.contains_key("e")).await;

    let calls = e.server.calls();
    let count = |verb: &str| calls.iter().filter(|c| c.0 == verb && c.1 == GROUP && c.2 == "ipblocks").count();
    assert!(count("list") >= 2, "{calls:?}");
    assert!(count("watch") >= 3, "{calls:?}");
}

#[tokio::test]
async fn raw_watch_semantics() {
    let e = env().await;
    let nodes: Api<Node> = Api::all(e.client.clone());
    let start = e.server.resource_version();

    // Selector transitions: entering the selector is ADDED, leaving it DELETED.
    let wp = WatchParams::default().labels("team=a").timeout(20);
    let mut w = Box::pin(nodes.watch(&wp, &start).await.expect("watch"));
    e.server.put_object("", "nodes", None, json!({"metadata": {"name": "n1", "labels": {"team": "a"}}}));
    e.server.put_object("", "nodes", None, json!({"metadata": {"name": "n2", "labels": {"team": "b"}}}));
    e.server.put_object("", "nodes", None, json!({"metadata": {"name": "n1", "labels": {"team": "b"}}}));
    e.server.put_object("", "nodes", None, json!({"metadata": {"name": "n2", "labels": {"team": "a"}}}));
    e.server.put_object(
        "",
        "nodes",
        None,
        json!({"metadata": {"name": "n2", "labels": {"team": "a"}}, "spec": {"podCIDR": "10.0.0.0/24"}}),
    );
    e.server.delete_object("", "nodes", None, "n2");
    let mut seen = Vec::new();
    let mut last_rv = 0;
    while seen.len() < 5 {
        let ev =
            tokio::time::timeout(WAIT, w.next()).await.expect("event in time").expect("stream open").expect("event");
        let (t, n) = match ev {
            WatchEvent::Added(n) => ("ADDED", n),
            WatchEvent::Modified(n) => ("MODIFIED", n),
            WatchEvent::Deleted(n) => ("DELETED", n),
            WatchEvent::Bookmark(_) => continue,
            WatchEvent::Error(s) => panic!("watch error {s:?}"),
        };
        assert!(rv_num(&n) > last_rv, "resourceVersions increase");
        last_rv = rv_num(&n);
        seen.push(format!("{t} {}", n.name_any()));
    }
    assert_eq!(seen, ["ADDED n1", "DELETED n1", "ADDED n2", "MODIFIED n2", "DELETED n2"]);
    drop(w);

    // Replay from an old resourceVersion: the same history again.
    let mut replay = Box::pin(nodes.watch(&WatchParams::default().timeout(5), &start).await.unwrap());
    let mut kinds = Vec::new();
    while kinds.len() < 6 {
        match tokio::time::timeout(WAIT, replay.next()).await.unwrap().unwrap().unwrap() {
            WatchEvent::Added(_) => kinds.push("A"),
            WatchEvent::Modified(_) => kinds.push("M"),
            WatchEvent::Deleted(_) => kinds.push("D"),
            WatchEvent::Bookmark(_) => {}
            WatchEvent::Error(s) => panic!("{s:?}"),
        }
    }
    assert_eq!(kinds, ["A", "A", "M", "M", "M", "D"]);
    drop(replay);

    // After compaction, resuming from before it: 200 and one ERROR event (410 Expired).
    e.server.compact();
    let (code, head, body) = raw(
        &e.server,
        "GET",
        &format!("/api/v1/nodes?watch=true&resourceVersion={start}"),
        &[("Authorization", &format!("Bearer {TOKEN}"))],
        "",
    );
    assert_eq!(code, 200);
    assert!(head.contains("transfer-encoding: chunked"), "{head}");
    let lines = watch_lines(&body);
    assert_eq!(lines.len(), 1, "{body}");
    assert_eq!(lines[0]["type"], "ERROR");
    assert_eq!(lines[0]["object"]["code"], 410);
    assert_eq!(lines[0]["object"]["reason"], "Expired");
    assert!(
        lines[0]["object"]["message"].as_str().unwrap().starts_with(&format!("too old resource version: {start} ("))
    );

    // resourceVersion=0: synthetic ADDED for what exists; timeoutSeconds ends the stream;
    // bookmarks (only when asked) carry the new resourceVersion.
    e.server.put_object("", "nodes", None, json!({"metadata": {"name": "n3"}}));
    let server = &e.server;
    let t0 = Instant::now();
    let (body, ()) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            raw(
                server,
                "GET",
                "/api/v1/nodes?watch=1&resourceVersion=0&timeoutSeconds=2&allowWatchBookmarks=true",
                &[("Authorization", &format!("Bearer {TOKEN}"))],
                "",
            )
            .2
        });
        std::thread::sleep(Duration::from_millis(300));
        server.put_object(GROUP, "ipblocks", None, json!({"metadata": {"name": "elsewhere"}}));
        (h.join().unwrap(), ())
    });
    let took = t0.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(6), "{took:?}");
    let lines = watch_lines(&body);
    let added: Vec<&str> = lines
        .iter()
        .filter(|l| l["type"] == "ADDED")
        .map(|l| l["object"]["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(added, ["n1", "n3"], "{body}");
    assert_eq!(lines[0]["object"]["kind"], "Node");
    assert_eq!(lines[0]["object"]["apiVersion"], "v1");
    let bookmark = lines.iter().find(|l| l["type"] == "BOOKMARK").expect("a bookmark");
    assert_eq!(bookmark["object"]["metadata"]["resourceVersion"], json!(e.server.resource_version()));
    assert_eq!(bookmark["object"]["kind"], "Node");

    let (_, _, body) = raw(
        &e.server,
        "GET",
        "/api/v1/nodes?watch=true&timeoutSeconds=1",
        &[("Authorization", &format!("Bearer {TOKEN}"))],
        "",
    );
    assert!(watch_lines(&body).iter().all(|l| l["type"] != "BOOKMARK"), "{body}");
}

// ---------------------------------------------------------------------------------------------
// Authentication
// ---------------------------------------------------------------------------------------------

async fn review(api: &Api<TokenReview>, token: &str, audiences: Option<Vec<&str>>) -> TokenReview {
    let tr = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.into()),
            audiences: audiences.map(|a| a.into_iter().map(String::from).collect()),
        },
        ..TokenReview::default()
    };
    api.create(&PostParams::default(), &tr).await.expect("token review")
}

#[tokio::test]
async fn token_review_with_audiences() {
    let e = env().await;
    e.server.add_token(
        "agent-token",
        UserInfo {
            username: "system:serviceaccount:nodeplane:agent".into(),
            uid: "uid-1".into(),
            groups: vec!["system:serviceaccounts".into(), "system:serviceaccounts:nodeplane".into()],
            extra: BTreeMap::from([("authentication.kubernetes.io/node-name".to_string(), vec!["n1".to_string()])]),
            audiences: vec!["nodeplane".into(), "vault".into()],
        },
    );
    let api: Api<TokenReview> = Api::all(e.client.clone());

    let r = review(&api, "agent-token", Some(vec!["other", "nodeplane"])).await;
    let st = r.status.expect("status");
    assert_eq!(st.authenticated, Some(true));
    assert_eq!(st.audiences, Some(vec!["nodeplane".to_string()]));
    assert_eq!(st.error, None);
    let u = st.user.expect("user");
    assert_eq!(u.username.as_deref(), Some("system:serviceaccount:nodeplane:agent"));
    assert_eq!(u.uid.as_deref(), Some("uid-1"));
    assert_eq!(u.groups.as_ref().map(Vec::len), Some(2));
    assert_eq!(u.extra.unwrap()["authentication.kubernetes.io/node-name"], vec!["n1".to_string()]);
    assert_eq!(r.spec.token.as_deref(), Some("agent-token"));

    // No common audience: not authenticated.
    let st = review(&api, "agent-token", Some(vec!["other"])).await.status.unwrap();
    assert_ne!(st.authenticated, Some(true));
    assert!(st.error.is_some_and(|e| e.contains("invalid")));
    // Without spec.audiences the apiserver's own audience is meant, which this token lacks.
    assert_ne!(review(&api, "agent-token", None).await.status.unwrap().authenticated, Some(true));

    // The admin token (no audiences): valid for the apiserver audience only.
    let st = review(&api, TOKEN, None).await.status.unwrap();
    assert_eq!(st.authenticated, Some(true));
    assert_eq!(st.audiences, Some(vec![API_AUDIENCE.to_string()]));
    assert_eq!(st.user.unwrap().username.as_deref(), Some("admin"));
    assert_ne!(review(&api, TOKEN, Some(vec!["nodeplane"])).await.status.unwrap().authenticated, Some(true));

    // Unknown token.
    let st = review(&api, "who-knows", Some(vec!["nodeplane"])).await.status.unwrap();
    assert_ne!(st.authenticated, Some(true));
    assert!(st.error.is_some());

    // An empty token is a bad request; tokenreviews can only be created.
    assert_eq!(api_err(api.create(&PostParams::default(), &TokenReview::default()).await).0, 400);
    assert_eq!(api_err(api.get("x").await).0, 405);

    // A token not valid for the apiserver audience cannot call the API.
    let agent = client_for(&e.server, &e.dir, "agent-token").await;
    let (code, reason, _) = api_err(Api::<Node>::all(agent).list(&ListParams::default()).await);
    assert_eq!((code, reason.as_str()), (401, "Unauthorized"));

    let calls = e.server.calls();
    assert!(
        calls.iter().any(
            |c| c == &("create".to_string(), "authentication.k8s.io".to_string(), "tokenreviews".to_string(), None)
        )
    );
}

#[tokio::test]
async fn bad_token_is_unauthorized() {
    let e = env().await;
    let bad = client_for(&e.server, &e.dir, "not-a-token").await;
    let (code, reason, msg) = api_err(Api::<Node>::all(bad.clone()).list(&ListParams::default()).await);
    assert_eq!((code, reason.as_str(), msg.as_str()), (401, "Unauthorized", "Unauthorized"));
    assert_eq!(
        api_err(Api::<Lease>::namespaced(bad, "default").create(&PostParams::default(), &lease("l", "x")).await).0,
        401
    );
    assert!(e.server.calls().is_empty(), "unauthenticated requests are not recorded");

    let (code, _, body) = raw(&e.server, "GET", "/api/v1/nodes", &[], "");
    assert_eq!(code, 401);
    let status: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["reason"], "Unauthorized");

    // /version needs no token.
    let (code, _, body) = raw(&e.server, "GET", "/version", &[], "");
    assert_eq!(code, 200, "{body}");
    assert_eq!(e.client.apiserver_version().await.unwrap().major, "1");

    // Removing a token revokes it.
    e.server.remove_token(TOKEN);
    assert_eq!(api_err(Api::<Node>::all(e.client.clone()).list(&ListParams::default()).await).0, 401);
}

// ---------------------------------------------------------------------------------------------
// Fault injection and recording
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn fail_next_and_calls() {
    let e = env().await;
    let leases: Api<Lease> = Api::namespaced(e.client.clone(), "kube-system");
    let l = leases.create(&PostParams::default(), &lease("ctl", "a")).await.unwrap();

    e.server.fail_next("update", "leases", 500, 1);
    let mut next = l.clone();
    next.spec.as_mut().unwrap().holder_identity = Some("b".into());
    let (code, reason, _) = api_err(leases.replace("ctl", &PostParams::default(), &next).await);
    assert_eq!((code, reason.as_str()), (500, "InternalError"));
    assert_eq!(leases.get("ctl").await.unwrap(), l, "an injected failure has no effect");
    leases.replace("ctl", &PostParams::default(), &next).await.expect("only one failure was injected");

    e.server.fail_next("create", "ipblocks", 409, 2);
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    for _ in 0..2 {
        let (code, reason, _) = api_err(blocks.create(&PostParams::default(), &ipblock("b1", "10.0.0.0/24")).await);
        assert_eq!((code, reason.as_str()), (409, "Conflict"));
    }
    assert!(e.server.get(GROUP, "ipblocks", None, "b1").is_none());
    blocks.create(&PostParams::default(), &ipblock("b1", "10.0.0.0/24")).await.expect("third create works");

    // kube's default retry policy retries a 503 transparently; without it the error shows.
    e.server.fail_next("*", "nodes", 503, 1);
    Api::<Node>::all(e.client.clone()).list(&ListParams::default()).await.expect("retried past one 503");
    e.server.fail_next("list", "*", 503, 1);
    let (code, reason, _) = api_err(Api::<Node>::all(no_retry_client(&e).await).list(&ListParams::default()).await);
    assert_eq!((code, reason.as_str()), (503, "ServiceUnavailable"));

    let calls = e.server.calls();
    let ks = Some("kube-system".to_string());
    let c = |v: &str, g: &str, r: &str, ns: &Option<String>| (v.to_string(), g.to_string(), r.to_string(), ns.clone());
    assert_eq!(
        calls,
        vec![
            c("create", "coordination.k8s.io", "leases", &ks),
            c("update", "coordination.k8s.io", "leases", &ks),
            c("get", "coordination.k8s.io", "leases", &ks),
            c("update", "coordination.k8s.io", "leases", &ks),
            c("create", GROUP, "ipblocks", &None),
            c("create", GROUP, "ipblocks", &None),
            c("create", GROUP, "ipblocks", &None),
            c("list", "", "nodes", &None),
            c("list", "", "nodes", &None),
            c("list", "", "nodes", &None),
        ]
    );
    e.server.clear_calls();
    let _ = blocks.delete_collection(&DeleteParams::default(), &ListParams::default()).await.unwrap();
    let _ = Api::<Lease>::all(e.client.clone()).list(&ListParams::default()).await.unwrap();
    assert_eq!(
        e.server.calls(),
        vec![c("deletecollection", GROUP, "ipblocks", &None), c("list", "coordination.k8s.io", "leases", &None)]
    );
}

#[tokio::test]
async fn paused_holds_requests_and_unavailable_answers_503() {
    let e = env().await;
    let leases: Api<Lease> = Api::namespaced(e.client.clone(), "default");
    e.server.set_paused(true);
    let held = tokio::spawn({
        let leases = leases.clone();
        async move { leases.create(&PostParams::default(), &lease("l", "a")).await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!held.is_finished(), "a request must be held while paused");
    assert!(e.server.get("coordination.k8s.io", "leases", Some("default"), "l").is_none());
    e.server.set_paused(false);
    let created = tokio::time::timeout(WAIT, held).await.expect("released").unwrap().expect("create after unpause");
    assert_eq!(created.name_any(), "l");

    e.server.set_unavailable(true);
    let leases: Api<Lease> = Api::namespaced(no_retry_client(&e).await, "default");
    let (code, reason, _) = api_err(leases.get("l").await);
    assert_eq!((code, reason.as_str()), (503, "ServiceUnavailable"));
    e.server.set_unavailable(false);
    leases.get("l").await.expect("available again");
}

// ---------------------------------------------------------------------------------------------
// Robustness at the HTTP level
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn bad_requests_get_status_errors() {
    let e = env().await;
    let s = &e.server;
    let status = |v: &Value, code: u16, reason: &str| {
        assert_eq!(v["kind"], "Status", "{v}");
        assert_eq!(v["code"], code, "{v}");
        assert_eq!(v["reason"], reason, "{v}");
    };
    let json = Some("application/json");

    let (code, v) = raw_auth(s, "GET", "/apis/nope.io/v1/things", None, "");
    assert_eq!(code, 404);
    status(&v, 404, "NotFound");
    let (code, _) = raw_auth(s, "GET", "/apis/coordination.k8s.io/v2/namespaces/default/leases", None, "");
    assert_eq!(code, 404, "wrong version");
    let (code, _) = raw_auth(s, "GET", "/api/v1/namespaces/default/nodes", None, "");
    assert_eq!(code, 404, "cluster-scoped resource under a namespace");
    let (code, _) = raw_auth(s, "GET", "/apis/coordination.k8s.io/v1/leases/x", None, "");
    assert_eq!(code, 404, "namespaced resource by name without a namespace");
    let (code, _) = raw_auth(s, "GET", "/nonsense/path", None, "");
    assert_eq!(code, 404);

    let (code, v) = raw_auth(s, "POST", "/api/v1/nodes", json, "{not json");
    assert_eq!(code, 400);
    status(&v, 400, "BadRequest");
    let (code, v) = raw_auth(s, "POST", "/api/v1/nodes", json, "[1,2]");
    assert_eq!(code, 400, "{v}");
    let (code, v) = raw_auth(s, "POST", "/api/v1/nodes", json, r#"{"metadata":{"name":"n"}}"#);
    assert_eq!(code, 400, "kind missing: {v}");
    let (code, v) =
        raw_auth(s, "POST", "/api/v1/nodes", json, r#"{"kind":"Lease","apiVersion":"v1","metadata":{"name":"n"}}"#);
    assert_eq!(code, 400, "wrong kind: {v}");
    let (code, v) = raw_auth(s, "POST", "/api/v1/nodes", Some("text/plain"), r#"{"kind":"Node","apiVersion":"v1"}"#);
    assert_eq!(code, 415);
    status(&v, 415, "UnsupportedMediaType");
    let (code, v) = raw_auth(s, "POST", "/api/v1/nodes", json, r#"{"kind":"Node","apiVersion":"v1","metadata":{}}"#);
    assert_eq!(code, 422, "no name: {v}");
    let (code, v) = raw_auth(
        s,
        "POST",
        "/api/v1/nodes",
        json,
        r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"n","resourceVersion":"5"}}"#,
    );
    assert_eq!(code, 500, "resourceVersion on create: {v}");
    let (code, v) = raw_auth(
        s,
        "POST",
        "/apis/coordination.k8s.io/v1/namespaces/a/leases",
        json,
        r#"{"kind":"Lease","apiVersion":"coordination.k8s.io/v1","metadata":{"name":"l","namespace":"b"}}"#,
    );
    assert_eq!(code, 400, "namespace mismatch: {v}");
    let (code, v) =
        raw_auth(s, "POST", "/api/v1/nodes", json, r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"n"}}"#);
    assert_eq!(code, 201, "{v}");
    let (code, v) =
        raw_auth(s, "PUT", "/api/v1/nodes/m", json, r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"n"}}"#);
    assert_eq!(code, 400, "name mismatch: {v}");
    let (code, _) = raw_auth(s, "PUT", "/api/v1/nodes", json, "{}");
    assert_eq!(code, 405);
    let (code, _) = raw_auth(s, "POST", "/api/v1/nodes/n", json, "{}");
    assert_eq!(code, 405);
    let (code, _) = raw_auth(s, "OPTIONS", "/api/v1/nodes", None, "");
    assert_eq!(code, 405);
    let (code, _) = raw_auth(s, "DELETE", "/api/v1/nodes/n", json, "{oops");
    assert_eq!(code, 400);
    let (code, _) = raw_auth(s, "GET", "/api/v1/nodes?watch=maybe", None, "");
    assert_eq!(code, 400);
    let (code, _) = raw_auth(s, "GET", "/api/v1/nodes?watch=true&resourceVersion=abc", None, "");
    assert_eq!(code, 400);
    let (code, _) = raw_auth(s, "GET", "/api/v1/nodes?labelSelector=a%20in%20(b", None, "");
    assert_eq!(code, 400);
    let (code, _) = raw_auth(
        s,
        "POST",
        "/api/v1/nodes?dryRun=All",
        json,
        r#"{"kind":"Node","apiVersion":"v1","metadata":{"name":"d"}}"#,
    );
    assert_eq!(code, 400, "dryRun is refused rather than applied");

    // Discovery, minimal.
    let (code, v) = raw_auth(s, "GET", "/apis", None, "");
    assert_eq!(code, 200);
    assert!(v["groups"].as_array().unwrap().iter().any(|g| g["name"] == GROUP));
    let (code, v) = raw_auth(s, "GET", "/apis/coordination.k8s.io/v1", None, "");
    assert_eq!(code, 200);
    assert!(v["resources"].as_array().unwrap().iter().any(|r| r["name"] == "leases" && r["namespaced"] == true));
    let (code, v) = raw_auth(s, "GET", "/api/v1", None, "");
    assert_eq!(code, 200);
    assert!(v["resources"].as_array().unwrap().iter().any(|r| r["name"] == "nodes"));

    // Still serving normally after all that.
    let names: BTreeSet<String> = Api::<Node>::all(e.client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|n| n.name_any())
        .collect();
    assert_eq!(names, BTreeSet::from(["n".to_string()]));
}

#[tokio::test]
async fn names_and_labels_follow_kubernetes_rules() {
    let e = env().await;
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    let pp = PostParams::default();
    let labelled = |name: &str, k: &str, v: &str| {
        let mut o = ipblock(name, "10.0.0.0/24");
        o.metadata.labels = Some([(k.to_string(), v.to_string())].into());
        o
    };
    // Names: a DNS-1123 subdomain of at most 253 characters.
    let long = format!("{}.{}.{}.{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61));
    assert_eq!(long.len(), 253);
    blocks.create(&pp, &ipblock(&long, "x")).await.expect("a 253-character name");
    let (code, reason, msg) = api_err(blocks.create(&pp, &ipblock(&format!("{long}e"), "x")).await);
    assert_eq!((code, reason.as_str()), (422, "Invalid"));
    assert!(
        msg.contains("metadata.name: Invalid value: ") && msg.contains("must be no more than 253 characters"),
        "{msg}"
    );
    for bad in ["Bad_Name", "a..b", "-a", "a-", "a.-b"] {
        let (code, _, msg) = api_err(blocks.create(&pp, &ipblock(bad, "x")).await);
        assert_eq!(code, 422, "{bad}");
        assert!(msg.contains("a lowercase RFC 1123 subdomain must consist of"), "{bad}: {msg}");
    }
    // Label values: at most 63 characters, alphanumeric at both ends.
    blocks.create(&pp, &labelled("l63", "nodeplane.io/node", &"n".repeat(63))).await.expect("63-character label value");
    blocks.create(&pp, &labelled("lempty", "nodeplane.io/node", "")).await.expect("empty label value");
    let raw_status = |v: &str| {
        let body = json!({"apiVersion": format!("{GROUP}/v1"), "kind": "IpBlock",
                          "metadata": {"name": "l64", "labels": {"nodeplane.io/node": v}}, "spec": {}});
        raw_auth(&e.server, "POST", &format!("/apis/{GROUP}/v1/ipblocks"), Some("application/json"), &body.to_string())
    };
    let (code, status) = raw_status(&"n".repeat(64));
    assert_eq!(code, 422);
    assert_eq!(status["kind"], "Status");
    assert_eq!(status["reason"], "Invalid");
    assert_eq!(
        status["message"],
        format!(
            "IpBlock.{GROUP} \"l64\" is invalid: metadata.labels: Invalid value: \"{}\": must be no more than 63 characters",
            "n".repeat(64)
        )
    );
    assert_eq!(status["details"]["causes"][0]["field"], "metadata.labels");
    assert_eq!(status["details"]["causes"][0]["reason"], "FieldValueInvalid");
    assert_eq!(status["details"]["kind"], "IpBlock");
    let (code, status) = raw_status("-bad-");
    assert_eq!(code, 422);
    assert!(
        status["message"].as_str().unwrap().contains("a valid label must be an empty string or consist of"),
        "{status}"
    );
    // Label keys are qualified names.
    let (code, _, msg) = api_err(blocks.create(&pp, &labelled("k1", "Bad Key/x", "v")).await);
    assert_eq!(code, 422);
    assert!(msg.contains("prefix part a lowercase RFC 1123 subdomain"), "{msg}");
    let (code, _, msg) = api_err(blocks.create(&pp, &labelled("k2", &format!("x/{}", "k".repeat(64)), "v")).await);
    assert_eq!(code, 422);
    assert!(msg.contains("name part must be no more than 63 characters"), "{msg}");
    // Also on update and patch.
    let mut o = blocks.get("l63").await.unwrap();
    o.metadata.labels = Some([("nodeplane.io/node".to_string(), "x".repeat(70))].into());
    assert_eq!(api_err(blocks.replace("l63", &pp, &o).await).0, 422);
    let p = json!({"metadata": {"labels": {"nodeplane.io/node": "y".repeat(70)}}});
    assert_eq!(api_err(blocks.patch("l63", &PatchParams::default(), &Patch::Merge(&p)).await).0, 422);
    // Annotations: at most 256 KiB together.
    let mut big = ipblock("big", "x");
    big.metadata.annotations = Some([("a".to_string(), "x".repeat(256 * 1024))].into());
    let (code, _, msg) = api_err(blocks.create(&pp, &big).await);
    assert_eq!(code, 422);
    assert!(msg.contains("metadata.annotations: Too long: must have at most 262144 bytes"), "{msg}");
}

/// The managers of an object and the top-level-ish fields each owns ("spec.cidr", "metadata.labels.x").
fn managers(o: &DynamicObject) -> BTreeMap<String, BTreeSet<String>> {
    fn walk(v: &Value, path: &mut Vec<String>, out: &mut BTreeSet<String>) {
        let kids: Vec<_> =
            v.as_object().map(|m| m.iter().filter(|(k, _)| k.starts_with("f:")).collect()).unwrap_or_default();
        if kids.is_empty() {
            out.insert(path.join("."));
        }
        for (k, c) in kids {
            path.push(k[2..].to_string());
            walk(c, path, out);
            path.pop();
        }
    }
    let mut out = BTreeMap::new();
    for e in o.metadata.managed_fields.clone().unwrap_or_default() {
        assert_eq!(e.operation.as_deref(), Some("Update"));
        assert_eq!(e.fields_type.as_deref(), Some("FieldsV1"));
        assert!(e.time.is_some());
        let mut set = BTreeSet::new();
        walk(&e.fields_v1.map(|f| f.0).unwrap_or_default(), &mut Vec::new(), &mut set);
        out.insert(e.manager.unwrap_or_default(), set);
    }
    out
}

#[tokio::test]
async fn writes_are_recorded_under_their_field_manager() {
    let e = env().await;
    let blocks: Api<DynamicObject> = Api::all_with(e.client.clone(), &ipblocks());
    let by = |m: &str| PostParams { field_manager: Some(m.into()), ..PostParams::default() };
    let set = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<BTreeSet<String>>();
    let created = blocks.create(&by("alice"), &ipblock("b1", "10.0.0.0/24")).await.unwrap();
    assert_eq!(managers(&created), [("alice".to_string(), set(&["spec.cidr"]))].into());
    // Another client labels it (kubectl label's manager): both are recorded.
    let p = json!({"metadata": {"labels": {"team": "net"}}});
    let pp = PatchParams { field_manager: Some("kubectl-label".into()), ..PatchParams::default() };
    let labelled = blocks.patch("b1", &pp, &Patch::Merge(&p)).await.unwrap();
    assert_eq!(
        managers(&labelled),
        [("alice".to_string(), set(&["spec.cidr"])), ("kubectl-label".to_string(), set(&["metadata.labels.team"]))]
            .into()
    );
    // bob changes the cidr: alice owned only that, so she is gone; a no-op write changes nothing.
    let mut o = labelled.clone();
    o.data["spec"]["cidr"] = json!("10.0.1.0/24");
    let replaced = blocks.replace("b1", &by("bob"), &o).await.unwrap();
    assert_eq!(
        managers(&replaced),
        [("bob".to_string(), set(&["spec.cidr"])), ("kubectl-label".to_string(), set(&["metadata.labels.team"]))]
            .into()
    );
    let again = blocks.replace("b1", &by("carol"), &replaced).await.unwrap();
    assert_eq!(again.metadata.resource_version, replaced.metadata.resource_version, "no-op");
    assert_eq!(managers(&again), managers(&replaced));
    // No field manager: the User-Agent's product (kube-rs sends none: "unknown").
    let anon = blocks.create(&PostParams::default(), &ipblock("b2", "x")).await.unwrap();
    assert_eq!(managers(&anon).keys().cloned().collect::<Vec<_>>(), vec!["unknown".to_string()]);
    let mut cfg = config_for(&e.server, &e.dir, TOKEN).await;
    cfg.headers.push((hyper::header::USER_AGENT, hyper::header::HeaderValue::from_static("tool/1.2 (linux)")));
    let tool: Api<DynamicObject> = Api::all_with(Client::try_from(cfg).unwrap(), &ipblocks());
    let t = tool.create(&PostParams::default(), &ipblock("b3", "x")).await.unwrap();
    assert_eq!(managers(&t).keys().cloned().collect::<Vec<_>>(), vec!["tool".to_string()]);
    // The requests keep both.
    let reqs = e.server.requests();
    let r = reqs.iter().find(|r| r.verb == "create" && r.name.is_none() && r.user_agent.starts_with("tool/")).unwrap();
    assert_eq!((r.resource.as_str(), r.field_manager.as_str()), ("ipblocks", ""));
    assert!(
        reqs.iter().any(|r| r.verb == "patch" && r.name.as_deref() == Some("b1") && r.field_manager == "kubectl-label")
    );
}
