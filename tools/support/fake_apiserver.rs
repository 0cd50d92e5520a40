//! An in-process fake of the Kubernetes API server, for tests and for the `fake_apiserver`
//! example (test code).
//!
//! It is a plain HTTP/1.1 server on `127.0.0.1:<ephemeral>` that speaks the Kubernetes REST
//! API in JSON for a registered set of resources, so that a real kube-rs client (loaded from
//! the kubeconfig that [`FakeApiServer::write_kubeconfig`] writes) can be pointed at it. It
//! runs on its own OS thread with its own tokio runtime, so it can be used from sync and async
//! tests alike; dropping the [`FakeApiServer`] stops it.
//!
//! What it implements, following the Kubernetes API conventions:
//!
//! * paths `/api/v1/...` and `/apis/{group}/{version}/...`, cluster-scoped and namespaced,
//!   with the `status` subresource (`PUT`/`PATCH` there change only `.status`);
//! * bearer-token authentication (`401 Unauthorized` otherwise) and `TokenReview`;
//! * one global, decimal `resourceVersion` counter; create sets `uid`, `creationTimestamp`
//!   and `generation`; `generation` goes up when anything outside `metadata` and `status`
//!   changes; a no-op update or patch writes nothing (same resourceVersion, no watch event);
//! * optimistic concurrency: `PUT` with a stale `metadata.resourceVersion`, a merge patch
//!   carrying one, or `DeleteOptions.preconditions` that do not match give `409 Conflict`;
//! * `POST` of an existing name gives `409 AlreadyExists`; `generateName` is honoured;
//! * JSON merge patch and JSON patch (RFC 6902); other patch types get `415`;
//! * Kubernetes' rules for object names (DNS-1123 subdomain, at most 253 characters), label
//!   keys and values (qualified names; values at most 63 characters of
//!   `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`) and the total size of annotations (256 KiB),
//!   on create, update and patch: `422 Invalid` with the real server's messages and causes;
//! * `managedFields`: every create, update and patch records its field manager (the
//!   `fieldManager` parameter, else the User-Agent up to its first `/`, else `unknown`), the
//!   operation `Update`, the time and the fields it set (`FieldsV1`; lists are atomic), and
//!   takes the fields it changed away from the other managers, as the real server does for
//!   non-apply writes; [`FakeApiServer::requests`] also keeps each request's User-Agent and
//!   field manager;
//! * label selectors (`k=v`, `k==v`, `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)`) and
//!   field selectors on `metadata.name` / `metadata.namespace`, for list, watch and
//!   deletecollection;
//! * watches with replay from history, `410 Expired` as an `ERROR` event after
//!   [`FakeApiServer::compact`], `timeoutSeconds`, `allowWatchBookmarks` (a bookmark about
//!   once a second when the resourceVersion moved), `sendInitialEvents`, and the watch-cache
//!   rule that an object leaving (entering) a selector is seen as `DELETED` (`ADDED`). A
//!   watch from resourceVersion `""` or `"0"` starts with a synthetic `ADDED` for every
//!   existing object, as a real apiserver's does (kube's `watcher` never asks for that: it
//!   lists first and watches from the list's resourceVersion).
//!
//! Resources known from the start: `nodes`, `leases`, `tokenreviews`, DRA's
//! `resourceslices` (cluster-scoped) and `resourceclaims` (namespaced), and what NetworkPolicy
//! is computed from: `namespaces`, `pods`, `networkpolicies`; tests register more.
//!
//! Known differences from a real apiserver (all deliberate, to stay small):
//!
//! * list pages with `limit`/`continue` like the real server (every page from the snapshot
//!   of the first, `remainingItemCount`, 410 `Expired` for a token older than the last
//!   compaction) but ignores `resourceVersion`/`resourceVersionMatch` (always the latest
//!   state);
//! * a watch from a resourceVersion newer than the current one waits for it instead of
//!   failing with `ResourceVersionTooLarge`;
//! * no admission, RBAC, namespaces-must-exist check, finalizers, graceful deletion, owner
//!   references / garbage collection, server-side apply (`415`), strategic merge patch
//!   (`415`), `dryRun` (`400`), or schema validation beyond names and labels (names are
//!   checked as DNS-1123 subdomains for every resource, also where the real server wants a
//!   DNS label, e.g. namespaces);
//! * which types count as built in is guessed from the group (`""`, no dot, or `*.k8s.io`):
//!   built-in types allow unconditional `PUT` (no resourceVersion), answer `DELETE` with a
//!   `Status` and list items without `kind`/`apiVersion`; custom resources require a
//!   resourceVersion on `PUT` (`422`), answer `DELETE` with the object and list items with
//!   `kind`/`apiVersion` — as the real apiserver does for CRDs;
//! * `generation` is kept for every type (a real apiserver leaves it unset for e.g. Leases);
//! * main-resource writes replace `.status` too (a real apiserver ignores `.status` there
//!   for types with a status subresource);
//! * requests without an `Authorization` header get `401` (anonymous auth disabled);
//!   `/version`, `/healthz`, `/livez` and `/readyz` need no token.
//!
//! [`FakeApiServer::set_paused`] *holds* requests: every request waits before it is even
//! authenticated, open watch streams deliver nothing (and do not time out) until unpaused —
//! a network partition. A request held while paused is processed on unpause, even if its
//! client gave up waiting (as a request that reached the server before a partition would
//! be). [`FakeApiServer::set_unavailable`] instead answers `503 ServiceUnavailable` at once;
//! note that kube 5 clients retry 429/503/504 by default (15 times, exponential backoff from
//! 5 ms, i.e. minutes) unless `Config::default_retry` is false.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::{Bytes, Frame, Incoming, SizeHint};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, USER_AGENT};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, oneshot, watch};

/// The audience of the fake apiserver itself: a token whose [`UserInfo::audiences`] is empty
/// is valid for this audience only; a token must be valid for it to authenticate requests.
pub const API_AUDIENCE: &str = "https://kubernetes.default.svc.cluster.local";

/// Largest request body accepted (the real apiserver's limit is 3 MiB too).
const MAX_BODY: usize = 3 * 1024 * 1024;

/// How often a watch with `allowWatchBookmarks=true` may get a bookmark.
const BOOKMARK_EVERY: Duration = Duration::from_secs(1);

/// Who a bearer token authenticates as.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserInfo {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
    /// Audiences the token is valid for; empty means [`API_AUDIENCE`] only.
    pub audiences: Vec<String>,
}

impl UserInfo {
    /// A user with just a name, valid for the apiserver audience.
    pub fn new(username: &str) -> UserInfo {
        UserInfo { username: username.to_string(), ..UserInfo::default() }
    }

    fn token_audiences(&self) -> Vec<String> {
        if self.audiences.is_empty() { vec![API_AUDIENCE.to_string()] } else { self.audiences.clone() }
    }
}

/// One request as RBAC would see it: (verb, group, resource, namespace).
pub type Call = (String, String, String, Option<String>);

/// One authenticated request to a resource path, with who said they sent it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestRecord {
    pub verb: String,
    pub group: String,
    /// Plural, or `plural/sub` for a subresource.
    pub resource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
    /// The `User-Agent` header ("" if none).
    pub user_agent: String,
    /// The `fieldManager` query parameter ("" if none).
    pub field_manager: String,
    /// A list's `limit` and whether it carried a `continue` token (paging).
    pub limit: Option<String>,
    pub continued: bool,
}

/// The fake apiserver; see the module documentation.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeApiServer {
    /// Binds `127.0.0.1:0` and starts serving on a new thread with the default resources
    /// registered: core `nodes`, `coordination.k8s.io/v1` `leases` and
    /// `authentication.k8s.io/v1` `tokenreviews` (create only).
    pub fn start() -> FakeApiServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("fake apiserver: bind 127.0.0.1:0");
        listener.set_nonblocking(true).expect("fake apiserver: set_nonblocking");
        let addr = listener.local_addr().expect("fake apiserver: local_addr");
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new()),
            paused: watch::channel(false).0,
            closing: watch::channel(0u64).0,
            unavailable: AtomicBool::new(false),
        });
        let (tx, rx) = oneshot::channel();
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fake-apiserver".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("fake-apiserver-rt")
                    .enable_all()
                    .build()
                    .expect("fake apiserver: tokio runtime");
                rt.block_on(serve(listener, thread_shared, rx));
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .expect("fake apiserver: spawn thread");
        let server = FakeApiServer { shared, addr, shutdown: Some(tx), thread: Some(thread) };
        server.register("", "v1", "nodes", "Node", false);
        server.register("coordination.k8s.io", "v1", "leases", "Lease", true);
        // DRA (resource.k8s.io/v1, Kubernetes 1.34+): the node pools the controller publishes and
        // the claims it reads for the nodes.
        server.register("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", false);
        server.register("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", true);
        // NetworkPolicy: what the controller compiles the nodes' policies from.
        server.register("", "v1", "namespaces", "Namespace", false);
        server.register("", "v1", "pods", "Pod", true);
        server.register("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", true);
        {
            let mut st = server.shared.lock();
            st.resources.insert(
                key("authentication.k8s.io", "tokenreviews"),
                ResourceDef {
                    group: "authentication.k8s.io".into(),
                    version: "v1".into(),
                    plural: "tokenreviews".into(),
                    kind: "TokenReview".into(),
                    namespaced: false,
                    token_review: true,
                },
            );
        }
        server
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Makes `bearer` authenticate as `user`, for requests (if the token is valid for
    /// [`API_AUDIENCE`]) and for TokenReview. Replaces an earlier identity of the token.
    pub fn add_token(&self, bearer: &str, user: UserInfo) {
        self.shared.lock().tokens.insert(bearer.to_string(), user);
    }

    /// Forgets a token: requests with it get 401, TokenReview says unauthenticated.
    pub fn remove_token(&self, bearer: &str) {
        self.shared.lock().tokens.remove(bearer);
    }

    /// Writes a kubeconfig (YAML) with one cluster/user/context (`fake`, namespace
    /// `default`) pointing at this server with `bearer` as the token.
    pub fn write_kubeconfig(&self, path: &Path, bearer: &str) {
        std::fs::write(path, self.kubeconfig_yaml(bearer)).expect("fake apiserver: write kubeconfig");
    }

    /// The text [`write_kubeconfig`](Self::write_kubeconfig) writes.
    pub fn kubeconfig_yaml(&self, bearer: &str) -> String {
        // JSON string literals are valid YAML double-quoted scalars.
        let q = |s: &str| serde_json::to_string(s).unwrap_or_default();
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user:\n    token: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\n",
            q(&self.url()),
            q(bearer)
        )
    }

    /// Serves `plural` of `group/version` (core group is `""`). Registering the same
    /// group/plural again replaces the definition (one version per resource) and keeps the
    /// stored objects.
    pub fn register(&self, group: &str, version: &str, plural: &str, kind: &str, namespaced: bool) {
        self.shared.lock().resources.insert(
            key(group, plural),
            ResourceDef {
                group: group.into(),
                version: version.into(),
                plural: plural.into(),
                kind: kind.into(),
                namespaced,
                token_review: false,
            },
        );
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> String {
        self.shared.lock().rv.to_string()
    }

    /// Forgets the watch history up to now: a watch from an older resourceVersion gets a
    /// `410 Expired` ERROR event. Open watches are not affected.
    /// The next `count` list requests that carry a continue token find it expired (410
    /// `Expired`), as when the server compacted between two pages.
    pub fn expire_continue(&self, count: usize) {
        self.shared.lock().expire_continues = count;
    }

    pub fn compact(&self) {
        let mut st = self.shared.lock();
        st.compacted = st.rv;
        // Continue tokens of older snapshots expire with them (410 on the next page).
        let rv = st.rv;
        st.pages.retain(|_, (at, _)| *at >= rv);
        st.history.clear();
    }

    /// Ends every open watch stream (cleanly, as at an apiserver restart).
    pub fn close_watches(&self) {
        let mut st = self.shared.lock();
        st.watchers.clear();
        self.shared.closing.send_modify(|g| *g += 1);
    }

    /// The next `count` requests with RBAC verb `verb` (`get`, `list`, `watch`, `create`,
    /// `update`, `patch`, `delete`, `deletecollection`) on `resource` (plural, or
    /// `plural/status`; `*` matches any verb or resource) fail with `code` and the matching
    /// reason (409 → `Conflict`, 500 → `InternalError`, ...) without taking effect.
    pub fn fail_next(&self, verb: &str, resource: &str, code: u16, count: usize) {
        self.shared.lock().failures.push(Failure {
            verb: verb.to_string(),
            resource: resource.to_string(),
            code,
            remaining: count,
        });
    }

    /// Every authenticated request to a resource path so far, as (verb, group, resource,
    /// namespace), in arrival order. Subresources appear as `plural/sub`.
    pub fn calls(&self) -> Vec<Call> {
        self.shared.lock().calls.clone()
    }

    /// Forgets the recorded [`calls`](Self::calls) and [`requests`](Self::requests).
    pub fn clear_calls(&self) {
        let mut st = self.shared.lock();
        st.calls.clear();
        st.requests.clear();
    }

    /// Every authenticated request to a resource path so far, in arrival order, with its
    /// User-Agent and field manager.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.lock().requests.clone()
    }

    /// The stored object, as a GET would return it.
    pub fn get(&self, group: &str, plural: &str, ns: Option<&str>, name: &str) -> Option<Value> {
        let st = self.shared.lock();
        st.objects.get(&key(group, plural))?.get(&(ns.unwrap_or("").to_string(), name.to_string())).cloned()
    }

    /// Every stored object of a resource (all namespaces), ordered by namespace and name.
    pub fn list(&self, group: &str, plural: &str) -> Vec<Value> {
        let st = self.shared.lock();
        st.objects.get(&key(group, plural)).map(|m| m.values().cloned().collect()).unwrap_or_default()
    }

    /// Creates or replaces an object as another client would, without any precondition:
    /// fills `kind`, `apiVersion` and the namespace, keeps `uid`/`creationTimestamp` of an
    /// existing object (a new object keeps a `creationTimestamp` it carries), bumps the resourceVersion and notifies watches. Returns the stored
    /// object. Panics if the resource is not registered or the object has no name.
    pub fn put_object(&self, group: &str, plural: &str, ns: Option<&str>, obj: Value) -> Value {
        let mut st = self.shared.lock();
        let Some(def) = st.resources.get(&key(group, plural)).cloned() else {
            drop(st);
            panic!("fake apiserver: put_object on unregistered resource {plural}.{group}");
        };
        let mut obj = if obj.is_object() { obj } else { json!({}) };
        obj["kind"] = json!(def.kind);
        obj["apiVersion"] = json!(def.api_version());
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        if name.is_empty() {
            drop(st);
            panic!("fake apiserver: put_object without metadata.name");
        }
        let ns = if def.namespaced { ns.unwrap_or("default").to_string() } else { String::new() };
        let meta = obj["metadata"].as_object_mut().expect("metadata is an object");
        if def.namespaced {
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
        let okey = (ns.clone(), name);
        let old = st.objects.get(&def.key()).and_then(|m| m.get(&okey)).cloned();
        match old {
            Some(old) => {
                for f in ["uid", "creationTimestamp"] {
                    obj["metadata"][f] = old["metadata"][f].clone();
                }
                let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
                let generation = if spec_of(&old) != spec_of(&obj) { generation + 1 } else { generation };
                obj["metadata"]["generation"] = json!(generation);
                st.commit(&def, okey, obj, Some(old), EvType::Modified)
            }
            None => {
                // A creationTimestamp given for a new object is kept (tests make "old" objects).
                let given = obj["metadata"]["creationTimestamp"].clone();
                st.init_meta(&mut obj);
                if given.is_string() {
                    obj["metadata"]["creationTimestamp"] = given;
                }
                st.commit(&def, okey, obj, None, EvType::Added)
            }
        }
    }

    /// Deletes an object as another client would; false if there was none.
    pub fn delete_object(&self, group: &str, plural: &str, ns: Option<&str>, name: &str) -> bool {
        let mut st = self.shared.lock();
        let Some(def) = st.resources.get(&key(group, plural)).cloned() else { return false };
        let ns = if def.namespaced { ns.unwrap_or("default").to_string() } else { String::new() };
        st.remove(&def, &(ns, name.to_string())).is_some()
    }

    /// `true`: hold every request (and open watch streams) until `false`; see the module
    /// documentation.
    pub fn set_paused(&self, paused: bool) {
        self.shared.paused.send_replace(paused);
    }

    /// `true`: answer every request with `503 ServiceUnavailable` until `false`.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.shared.unavailable.store(unavailable, Ordering::SeqCst);
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.shared.paused.send_replace(false);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------------------------

struct Shared {
    state: Mutex<State>,
    paused: watch::Sender<bool>,
    /// Bumped by `close_watches`.
    closing: watch::Sender<u64>,
    unavailable: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

type ResKey = (String, String);
type ObjKey = (String, String);

fn key(group: &str, plural: &str) -> ResKey {
    (group.to_string(), plural.to_string())
}

#[derive(Clone, Debug)]
struct ResourceDef {
    group: String,
    version: String,
    plural: String,
    kind: String,
    namespaced: bool,
    token_review: bool,
}

impl ResourceDef {
    fn key(&self) -> ResKey {
        key(&self.group, &self.plural)
    }

    fn api_version(&self) -> String {
        if self.group.is_empty() { self.version.clone() } else { format!("{}/{}", self.group, self.version) }
    }

    /// `leases.coordination.k8s.io`, `nodes`
    fn qualified(&self) -> String {
        if self.group.is_empty() { self.plural.clone() } else { format!("{}.{}", self.plural, self.group) }
    }

    /// Built-in types vs custom resources, guessed from the group (CRD groups must contain a
    /// dot and `*.k8s.io` is reserved).
    fn builtin(&self) -> bool {
        self.group.is_empty() || !self.group.contains('.') || self.group.ends_with(".k8s.io")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EvType {
    Added,
    Modified,
    Deleted,
}

impl EvType {
    fn as_str(self) -> &'static str {
        match self {
            EvType::Added => "ADDED",
            EvType::Modified => "MODIFIED",
            EvType::Deleted => "DELETED",
        }
    }
}

struct Ev {
    rv: u64,
    res: ResKey,
    typ: EvType,
    /// The object after the change (for DELETED: its last state with the deletion's RV).
    obj: Value,
    /// The object before a modification.
    old: Option<Value>,
}

struct Failure {
    verb: String,
    resource: String,
    code: u16,
    remaining: usize,
}

struct State {
    rv: u64,
    compacted: u64,
    resources: HashMap<ResKey, ResourceDef>,
    objects: HashMap<ResKey, BTreeMap<ObjKey, Value>>,
    history: Vec<Arc<Ev>>,
    watchers: Vec<mpsc::UnboundedSender<Arc<Ev>>>,
    tokens: HashMap<String, UserInfo>,
    calls: Vec<Call>,
    requests: Vec<RequestRecord>,
    failures: Vec<Failure>,
    rng: u64,
    /// Paged lists in progress: continue token -> (resourceVersion of the first page, the
    /// items not yet served). A real apiserver serves every page from the snapshot of the
    /// first one; so does this one.
    pages: HashMap<String, (u64, Vec<Value>)>,
    /// The next this many continued lists find their token expired (as after a compaction).
    expire_continues: usize,
}

impl State {
    fn new() -> State {
        let seed = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
            ^ (std::process::id() as u64) << 32;
        State {
            rv: 1,
            compacted: 0,
            pages: HashMap::new(),
            expire_continues: 0,
            resources: HashMap::new(),
            objects: HashMap::new(),
            history: Vec::new(),
            watchers: Vec::new(),
            tokens: HashMap::new(),
            calls: Vec::new(),
            requests: Vec::new(),
            failures: Vec::new(),
            rng: seed | 1,
        }
    }

    fn next_rand(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn new_uid(&mut self) -> String {
        let a = self.next_rand();
        let b = self.next_rand();
        format!(
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            0x8000 | (b >> 48) & 0x3fff,
            b & 0xffff_ffff_ffff
        )
    }

    fn generate_suffix(&mut self) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        (0..5).map(|_| ALPHABET[(self.next_rand() % ALPHABET.len() as u64) as usize] as char).collect()
    }

    /// Sets the fields a create sets: uid, creationTimestamp, generation.
    fn init_meta(&mut self, obj: &mut Value) {
        let uid = self.new_uid();
        let meta = &mut obj["metadata"];
        meta["uid"] = json!(uid);
        meta["creationTimestamp"] = json!(rfc3339_now());
        meta["generation"] = json!(1);
        if let Some(m) = meta.as_object_mut() {
            m.remove("deletionTimestamp");
            m.remove("deletionGracePeriodSeconds");
        }
    }

    /// Stores `obj` under a new resourceVersion and records/broadcasts the event.
    fn commit(&mut self, def: &ResourceDef, okey: ObjKey, mut obj: Value, old: Option<Value>, typ: EvType) -> Value {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.objects.entry(def.key()).or_default().insert(okey, obj.clone());
        self.publish(Ev { rv: self.rv, res: def.key(), typ, obj: obj.clone(), old });
        obj
    }

    /// Removes an object; returns it as it was (old resourceVersion).
    fn remove(&mut self, def: &ResourceDef, okey: &ObjKey) -> Option<Value> {
        let old = self.objects.get_mut(&def.key())?.remove(okey)?;
        self.rv += 1;
        let mut gone = old.clone();
        gone["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.publish(Ev { rv: self.rv, res: def.key(), typ: EvType::Deleted, obj: gone, old: None });
        Some(old)
    }

    fn publish(&mut self, ev: Ev) {
        let ev = Arc::new(ev);
        self.history.push(ev.clone());
        self.watchers.retain(|w| w.send(ev.clone()).is_ok());
    }

    fn take_failure(&mut self, verb: &str, resource: &str) -> Option<u16> {
        let f = self.failures.iter_mut().find(|f| {
            f.remaining > 0 && (f.verb == "*" || f.verb == verb) && (f.resource == "*" || f.resource == resource)
        })?;
        f.remaining -= 1;
        let code = f.code;
        self.failures.retain(|f| f.remaining > 0);
        Some(code)
    }
}

// ---------------------------------------------------------------------------------------------
// Errors (Kubernetes Status objects)
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct ApiError {
    code: u16,
    body: Value,
}

type ApiResult<T> = Result<T, ApiError>;

fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Gone",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "",
    }
}

fn status_failure(code: u16, reason: &str, message: &str, details: Option<Value>) -> Value {
    let mut s = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    });
    if let Some(d) = details {
        s["details"] = d;
    }
    s
}

fn details(def: &ResourceDef, name: &str) -> Value {
    let mut d = Map::new();
    if !name.is_empty() {
        d.insert("name".into(), json!(name));
    }
    if !def.group.is_empty() {
        d.insert("group".into(), json!(def.group));
    }
    d.insert("kind".into(), json!(def.plural));
    Value::Object(d)
}

impl ApiError {
    fn new(code: u16, reason: &str, message: impl Into<String>, details: Option<Value>) -> ApiError {
        ApiError { code, body: status_failure(code, reason, &message.into(), details) }
    }
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(400, "BadRequest", message, None)
    }
    fn unauthorized() -> ApiError {
        ApiError::new(401, "Unauthorized", "Unauthorized", None)
    }
    fn no_route() -> ApiError {
        ApiError::new(404, "NotFound", "the server could not find the requested resource", None)
    }
    fn method_not_allowed() -> ApiError {
        ApiError::new(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", None)
    }
    fn unsupported_media(accepted: &str) -> ApiError {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!("the body of the request was in an unknown format - accepted media types include: {accepted}"),
            None,
        )
    }
    fn not_found(def: &ResourceDef, name: &str) -> ApiError {
        ApiError::new(404, "NotFound", format!("{} \"{name}\" not found", def.qualified()), Some(details(def, name)))
    }
    fn already_exists(def: &ResourceDef, name: &str) -> ApiError {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", def.qualified()),
            Some(details(def, name)),
        )
    }
    fn conflict(def: &ResourceDef, name: &str, why: &str) -> ApiError {
        ApiError::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {} \"{name}\": {why}", def.qualified()),
            Some(details(def, name)),
        )
    }
    fn modified(def: &ResourceDef, name: &str) -> ApiError {
        ApiError::conflict(
            def,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }
    fn invalid(def: &ResourceDef, name: &str, field: &str, detail: &str) -> ApiError {
        let mut d = details(def, name);
        d["kind"] = json!(def.kind);
        d["causes"] = json!([{ "reason": "FieldValueInvalid", "message": detail, "field": field }]);
        let what = if def.group.is_empty() { def.kind.clone() } else { format!("{}.{}", def.kind, def.group) };
        ApiError::new(422, "Invalid", format!("{what} \"{name}\" is invalid: {field}: {detail}"), Some(d))
    }
    /// `422 Invalid` with several (field, message) causes, worded like the real server's.
    fn invalid_causes(def: &ResourceDef, name: &str, causes: &[(String, String)]) -> ApiError {
        if let [(field, detail)] = causes {
            return ApiError::invalid(def, name, field, detail);
        }
        let mut d = details(def, name);
        d["kind"] = json!(def.kind);
        d["causes"] = Value::Array(
            causes.iter().map(|(f, m)| json!({"reason": "FieldValueInvalid", "message": m, "field": f})).collect(),
        );
        let what = if def.group.is_empty() { def.kind.clone() } else { format!("{}.{}", def.kind, def.group) };
        let all: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        ApiError::new(422, "Invalid", format!("{what} \"{name}\" is invalid: [{}]", all.join(", ")), Some(d))
    }
    fn injected(def: &ResourceDef, name: &str, verb: &str, code: u16) -> ApiError {
        match code {
            404 => ApiError::not_found(def, name),
            409 => ApiError::modified(def, name),
            _ => ApiError::new(
                code,
                reason_for(code),
                format!("injected failure for {verb} on {}", def.qualified()),
                Some(details(def, name)),
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP plumbing
// ---------------------------------------------------------------------------------------------

/// A response body: all at once, or streamed (watch).
enum RespBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

impl hyper::body::Body for RespBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            RespBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            RespBody::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, RespBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RespBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            RespBody::Full(None) => SizeHint::with_exact(0),
            RespBody::Stream(_) => SizeHint::default(),
        }
    }
}

fn json_response(code: u16, v: &Value) -> Response<RespBody> {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    let mut r = Response::new(RespBody::Full(Some(Bytes::from(body))));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn text_response(code: u16, text: &str) -> Response<RespBody> {
    let mut r = Response::new(RespBody::Full(Some(Bytes::from(text.to_string()))));
    *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

impl ApiError {
    fn into_response(self) -> Response<RespBody> {
        let mut r = json_response(self.code, &self.body);
        if self.code == 429 {
            r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
        }
        r
    }
}

async fn serve(listener: std::net::TcpListener, shared: Arc<Shared>, mut shutdown: oneshot::Receiver<()>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fake apiserver: cannot listen: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            acc = listener.accept() => match acc {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        let svc = service_fn(move |req| handle(shared.clone(), req));
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc)
                            .await;
                    });
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
        }
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<RespBody>, Infallible> {
    let mut paused = shared.paused.subscribe();
    let _ = paused.wait_for(|p| !*p).await;
    Ok(match route(&shared, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    })
}

fn pct_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: &str) -> HashMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (pct_decode(k), pct_decode(v)),
            None => (pct_decode(p), String::new()),
        })
        .collect()
}

fn query_bool(q: &HashMap<String, String>, k: &str) -> ApiResult<Option<bool>> {
    match q.get(k).map(String::as_str) {
        None => Ok(None),
        Some("true" | "1" | "True" | "TRUE" | "t" | "T" | "") => Ok(Some(true)),
        Some("false" | "0" | "False" | "FALSE" | "f" | "F") => Ok(Some(false)),
        Some(v) => Err(ApiError::bad_request(format!("invalid value for {k}: {v:?}"))),
    }
}

struct Req {
    method: Method,
    query: HashMap<String, String>,
    content_type: String,
    body: Incoming,
}

impl Req {
    async fn body(self) -> ApiResult<Bytes> {
        match Limited::new(self.body, MAX_BODY).collect().await {
            Ok(c) => Ok(c.to_bytes()),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                Err(ApiError::new(413, "RequestEntityTooLarge", "Request entity too large: limit is 3145728", None))
            }
            Err(e) => Err(ApiError::bad_request(format!("reading request body: {e}"))),
        }
    }

    /// The body as a JSON object, checking the content type.
    async fn json_body(self) -> ApiResult<Value> {
        let mime = self.content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        if mime != "application/json" {
            return Err(ApiError::unsupported_media("application/json"));
        }
        let body = self.body().await?;
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad_request(format!("error decoding request body: {e}")))?;
        if !v.is_object() {
            return Err(ApiError::bad_request("the request body is not a JSON object"));
        }
        Ok(v)
    }
}

async fn route(shared: &Arc<Shared>, req: Request<Incoming>) -> ApiResult<Response<RespBody>> {
    if shared.unavailable.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            503,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
            None,
        ));
    }
    let segs: Vec<String> = req.uri().path().split('/').filter(|s| !s.is_empty()).map(pct_decode).collect();
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    match segs.as_slice() {
        ["version"] if req.method() == Method::GET => {
            return Ok(json_response(
                200,
                &json!({
                    "major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "gitCommit": "",
                    "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24",
                    "compiler": "gc", "platform": "linux/amd64"
                }),
            ));
        }
        ["healthz" | "livez" | "readyz"] => return Ok(text_response(200, "ok")),
        _ => {}
    }

    let token = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer ")))
        .map(|t| t.trim().to_string());
    {
        let st = shared.lock();
        let ok = token
            .as_ref()
            .and_then(|t| st.tokens.get(t))
            .is_some_and(|u| u.token_audiences().iter().any(|a| a == API_AUDIENCE));
        if !ok {
            return Err(ApiError::unauthorized());
        }
    }

    let is_get = req.method() == Method::GET;
    match segs.as_slice() {
        ["api"] if is_get => {
            return Ok(json_response(
                200,
                &json!({"kind": "APIVersions", "versions": ["v1"],
                        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]}),
            ));
        }
        ["apis"] if is_get => return Ok(json_response(200, &discovery_groups(&shared.lock()))),
        ["apis", g] if is_get => {
            let groups = discovery_groups(&shared.lock());
            let found = groups["groups"].as_array().and_then(|a| a.iter().find(|x| x["name"] == *g)).cloned();
            return match found {
                Some(mut grp) => {
                    grp["kind"] = json!("APIGroup");
                    grp["apiVersion"] = json!("v1");
                    Ok(json_response(200, &grp))
                }
                None => Err(ApiError::no_route()),
            };
        }
        ["api", "v1"] if is_get => return Ok(json_response(200, &discovery_resources(&shared.lock(), "", "v1"))),
        ["apis", g, v] if is_get => {
            let list = discovery_resources(&shared.lock(), g, v);
            if list["resources"].as_array().is_none_or(|a| a.is_empty()) {
                return Err(ApiError::no_route());
            }
            return Ok(json_response(200, &list));
        }
        _ => {}
    }

    let (group, version, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] if !rest.is_empty() => ("", "v1", rest),
        ["apis", g, v, rest @ ..] if !rest.is_empty() => (*g, *v, rest),
        _ => return Err(ApiError::no_route()),
    };
    let (ns, plural, name, sub): (Option<&str>, &str, Option<&str>, Option<&str>) = match rest {
        ["namespaces"] => (None, "namespaces", None, None),
        ["namespaces", n] => (None, "namespaces", Some(n), None),
        ["namespaces", n, s @ ("status" | "finalize")] => (None, "namespaces", Some(n), Some(s)),
        ["namespaces", ns, p] => (Some(ns), p, None, None),
        ["namespaces", ns, p, n] => (Some(ns), p, Some(n), None),
        ["namespaces", ns, p, n, s] => (Some(ns), p, Some(n), Some(s)),
        [p] => (None, p, None, None),
        [p, n] => (None, p, Some(n), None),
        [p, n, s] => (None, p, Some(n), Some(s)),
        _ => return Err(ApiError::no_route()),
    };

    let query = parse_query(req.uri().query().unwrap_or(""));
    let method = req.method().clone();
    let watching = method == Method::GET && name.is_none() && query_bool(&query, "watch")?.unwrap_or(false);
    let verb = match (&method, name.is_some()) {
        (&Method::GET, true) => "get",
        (&Method::GET, false) if watching => "watch",
        (&Method::GET, false) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, true) => "delete",
        (&Method::DELETE, false) => "deletecollection",
        _ => return Err(ApiError::method_not_allowed()),
    };
    let resource = match sub {
        Some(s) => format!("{plural}/{s}"),
        None => plural.to_string(),
    };

    let content_type = req.headers().get(CONTENT_TYPE).and_then(|h| h.to_str().ok()).unwrap_or("").to_string();
    let user_agent = req.headers().get(USER_AGENT).and_then(|h| h.to_str().ok()).unwrap_or("").to_string();
    let field_manager = query.get("fieldManager").cloned().unwrap_or_default();
    // The manager a write is recorded under, as the real server picks it.
    let manager = if !field_manager.is_empty() {
        field_manager.clone()
    } else {
        match user_agent.split('/').next().unwrap_or("") {
            "" => "unknown".to_string(),
            m => m.chars().take(128).collect(),
        }
    };
    let r = Req { method, query, content_type, body: req.into_body() };

    let (def, injected) = {
        let mut st = shared.lock();
        st.calls.push((verb.to_string(), group.to_string(), resource.clone(), ns.map(str::to_string)));
        st.requests.push(RequestRecord {
            verb: verb.to_string(),
            group: group.to_string(),
            resource: resource.clone(),
            namespace: ns.map(str::to_string),
            name: name.map(str::to_string),
            user_agent: user_agent.clone(),
            field_manager: field_manager.clone(),
            limit: r.query.get("limit").cloned(),
            continued: r.query.get("continue").is_some_and(|c| !c.is_empty()),
        });
        let def = st.resources.get(&key(group, plural)).cloned();
        let def = match def {
            Some(d) if d.version == version => d,
            _ => return Err(ApiError::no_route()),
        };
        let scoped_ok = if def.namespaced {
            ns.is_some() || (name.is_none() && matches!(verb, "list" | "watch"))
        } else {
            ns.is_none()
        };
        if !scoped_ok || sub.is_some_and(|s| s != "status") {
            return Err(ApiError::no_route());
        }
        let injected = st.take_failure(verb, &resource);
        (def, injected)
    };
    if let Some(code) = injected {
        return Err(ApiError::injected(&def, name.unwrap_or(""), verb, code));
    }

    if def.token_review {
        return match verb {
            "create" if name.is_none() => token_review(shared, r).await,
            _ => Err(ApiError::method_not_allowed()),
        };
    }

    let ns = ns.unwrap_or("");
    let status_sub = sub.is_some();
    match (verb, name) {
        ("get", Some(n)) => {
            let st = shared.lock();
            match st.objects.get(&def.key()).and_then(|m| m.get(&(ns.to_string(), n.to_string()))) {
                Some(o) => Ok(json_response(200, o)),
                None => Err(ApiError::not_found(&def, n)),
            }
        }
        ("list", None) => list(shared, &def, ns, &r.query),
        ("watch", None) => start_watch(shared, &def, ns, &r.query),
        ("create", None) if !status_sub => {
            reject_dry_run(&r.query)?;
            let body = r.json_body().await?;
            let obj = create(&mut shared.lock(), &def, ns, body, &manager)?;
            Ok(json_response(201, &obj))
        }
        ("update", Some(n)) => {
            reject_dry_run(&r.query)?;
            let body = r.json_body().await?;
            let obj = update(&mut shared.lock(), &def, ns, n, body, status_sub, &manager)?;
            Ok(json_response(200, &obj))
        }
        ("patch", Some(n)) => {
            reject_dry_run(&r.query)?;
            let obj = patch(shared, &def, ns, n, r, status_sub, &manager).await?;
            Ok(json_response(200, &obj))
        }
        ("delete", Some(n)) if !status_sub => {
            reject_dry_run(&r.query)?;
            let body = r.body().await?;
            let opts = parse_delete_options(&body)?;
            let resp = delete(&mut shared.lock(), &def, ns, n, &opts)?;
            Ok(json_response(200, &resp))
        }
        ("deletecollection", None) => {
            reject_dry_run(&r.query)?;
            let sel = Selector::from_query(&r.query)?;
            let mut st = shared.lock();
            let keys: Vec<ObjKey> = st
                .objects
                .get(&def.key())
                .map(|m| m.iter().filter(|((ons, _), o)| ons == ns && sel.matches(o)).map(|(k, _)| k.clone()).collect())
                .unwrap_or_default();
            let mut items = Vec::new();
            for k in keys {
                if let Some(o) = st.remove(&def, &k) {
                    items.push(list_item(&def, o));
                }
            }
            let rv = st.rv.to_string();
            Ok(json_response(
                200,
                &json!({"kind": format!("{}List", def.kind), "apiVersion": def.api_version(),
                        "metadata": {"resourceVersion": rv}, "items": items}),
            ))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn reject_dry_run(q: &HashMap<String, String>) -> ApiResult<()> {
    match q.get("dryRun") {
        Some(v) if !v.is_empty() => Err(ApiError::bad_request("dryRun is not supported by the fake apiserver")),
        _ => Ok(()),
    }
}

fn discovery_groups(st: &State) -> Value {
    let mut groups: BTreeMap<&str, &str> = BTreeMap::new();
    for d in st.resources.values() {
        if !d.group.is_empty() {
            groups.insert(&d.group, &d.version);
        }
    }
    let groups: Vec<Value> = groups
        .into_iter()
        .map(|(g, v)| {
            let gv = json!({"groupVersion": format!("{g}/{v}"), "version": v});
            json!({"name": g, "versions": [gv.clone()], "preferredVersion": gv})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn discovery_resources(st: &State, group: &str, version: &str) -> Value {
    let mut defs: Vec<&ResourceDef> =
        st.resources.values().filter(|d| d.group == group && d.version == version).collect();
    defs.sort_by(|a, b| a.plural.cmp(&b.plural));
    let mut resources = Vec::new();
    for d in defs {
        let verbs: Vec<&str> = if d.token_review {
            vec!["create"]
        } else {
            vec!["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        };
        resources.push(json!({"name": d.plural, "singularName": d.kind.to_ascii_lowercase(),
            "namespaced": d.namespaced, "kind": d.kind, "verbs": verbs}));
        if !d.token_review {
            resources.push(json!({"name": format!("{}/status", d.plural), "singularName": "",
                "namespaced": d.namespaced, "kind": d.kind, "verbs": ["get", "patch", "update"]}));
        }
    }
    let gv = if group.is_empty() { version.to_string() } else { format!("{group}/{version}") };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
}

// ---------------------------------------------------------------------------------------------
// Object operations
// ---------------------------------------------------------------------------------------------

/// Everything but `metadata` and `status`: a change here bumps `generation`.
fn spec_of(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    o
}

fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

const SUBDOMAIN_RULE: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const LABEL_VALUE_RULE: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";
const NAME_PART_RULE: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
/// The real server's limit on all annotations of an object together (keys and values).
const ANNOTATIONS_MAX: usize = 256 * 1024;

/// Why `s` is not a DNS-1123 subdomain (Kubernetes' object names), in the real server's words.
fn subdomain_error(s: &str) -> Option<String> {
    if s.len() > 253 {
        return Some("must be no more than 253 characters".into());
    }
    (!is_dns_subdomain(s)).then(|| SUBDOMAIN_RULE.to_string())
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn is_label_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

/// Why `k` is not a qualified name (label and annotation keys).
fn label_key_errors(k: &str) -> Vec<String> {
    let (prefix, name) = match k.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    let mut errs = Vec::new();
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else {
        if name.len() > 63 {
            errs.push("name part must be no more than 63 characters".to_string());
        }
        if !is_label_name(name) {
            errs.push(NAME_PART_RULE.to_string());
        }
    }
    if let Some(p) = prefix {
        if p.is_empty() {
            errs.push("prefix part must be non-empty".to_string());
        } else if let Some(e) = subdomain_error(p) {
            errs.push(format!("prefix part {e}"));
        }
    }
    errs
}

/// Why `v` is not a label value.
fn label_value_errors(v: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if v.len() > 63 {
        errs.push("must be no more than 63 characters".to_string());
    }
    if !v.is_empty() && !is_label_name(v) {
        errs.push(LABEL_VALUE_RULE.to_string());
    }
    errs
}

/// Labels and annotations of an object to be stored, as the real server's ObjectMeta
/// validation checks them: `422 Invalid` with one cause per problem.
fn validate_metadata(def: &ResourceDef, name: &str, obj: &Value) -> ApiResult<()> {
    let mut causes: Vec<(String, String)> = Vec::new();
    let meta = &obj["metadata"];
    match &meta["labels"] {
        Value::Null => {}
        Value::Object(labels) => {
            for (k, v) in labels {
                for e in label_key_errors(k) {
                    causes.push(("metadata.labels".into(), format!("Invalid value: {}: {e}", json!(k))));
                }
                match v.as_str() {
                    Some(v) => {
                        for e in label_value_errors(v) {
                            causes.push(("metadata.labels".into(), format!("Invalid value: {}: {e}", json!(v))));
                        }
                    }
                    None => return Err(ApiError::bad_request(format!("label {k:?}: the value must be a string"))),
                }
            }
        }
        _ => return Err(ApiError::bad_request("metadata.labels must be an object")),
    }
    match &meta["annotations"] {
        Value::Null => {}
        Value::Object(anns) => {
            let mut total = 0;
            for (k, v) in anns {
                for e in label_key_errors(k) {
                    causes.push(("metadata.annotations".into(), format!("Invalid value: {}: {e}", json!(k))));
                }
                total += k.len() + v.as_str().map_or(0, str::len);
            }
            if total > ANNOTATIONS_MAX {
                causes.push((
                    "metadata.annotations".into(),
                    format!("Too long: must have at most {ANNOTATIONS_MAX} bytes"),
                ));
            }
        }
        _ => return Err(ApiError::bad_request("metadata.annotations must be an object")),
    }
    if causes.is_empty() { Ok(()) } else { Err(ApiError::invalid_causes(def, name, &causes)) }
}

// ---------------------------------------------------------------------------------------------
// managedFields (non-apply writes)
// ---------------------------------------------------------------------------------------------

type FieldPath = Vec<String>;

/// The fields a manager can own: every leaf (a scalar, a list — atomic — or an empty object),
/// outside the metadata the server sets; in metadata only labels, annotations, finalizers and
/// ownerReferences.
fn owned_leaves(obj: &Value) -> BTreeMap<FieldPath, Value> {
    fn walk(v: &Value, path: &mut FieldPath, out: &mut BTreeMap<FieldPath, Value>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, c) in m {
                    path.push(k.clone());
                    walk(c, path, out);
                    path.pop();
                }
            }
            _ => {
                out.insert(path.clone(), v.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    let Some(m) = obj.as_object() else { return out };
    for (k, v) in m {
        match k.as_str() {
            "kind" | "apiVersion" => {}
            "metadata" => {
                for mk in ["labels", "annotations", "finalizers", "ownerReferences"] {
                    if let Some(mv) = v.get(mk).filter(|x| !x.is_null()) {
                        let mut path = vec!["metadata".to_string(), mk.to_string()];
                        walk(mv, &mut path, &mut out);
                    }
                }
            }
            _ => {
                let mut path = vec![k.clone()];
                walk(v, &mut path, &mut out);
            }
        }
    }
    out
}

fn fields_v1(paths: &BTreeSet<FieldPath>) -> Value {
    let mut root = json!({});
    for p in paths {
        let mut cur = &mut root;
        for seg in p {
            cur = cur
                .as_object_mut()
                .expect("fieldsV1 nodes are objects")
                .entry(format!("f:{seg}"))
                .or_insert_with(|| json!({}));
        }
    }
    root
}

fn paths_of(fields: &Value) -> BTreeSet<FieldPath> {
    fn walk(v: &Value, path: &mut FieldPath, out: &mut BTreeSet<FieldPath>) {
        let children: Vec<(&String, &Value)> =
            v.as_object().map(|m| m.iter().filter(|(k, _)| k.starts_with("f:")).collect()).unwrap_or_default();
        if children.is_empty() {
            if !path.is_empty() {
                out.insert(path.clone());
            }
            return;
        }
        for (k, c) in children {
            path.push(k[2..].to_string());
            walk(c, path, out);
            path.pop();
        }
    }
    let mut out = BTreeSet::new();
    walk(fields, &mut Vec::new(), &mut out);
    out
}

/// The `metadata.managedFields` of an object, if it has a non-empty list (a request that
/// carries one replaces the stored one, as on the real server).
fn request_managed_fields(obj: &Value) -> Option<Vec<Value>> {
    obj["metadata"]["managedFields"].as_array().filter(|a| !a.is_empty()).cloned()
}

fn without_managed_fields(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o["metadata"].as_object_mut() {
        m.remove("managedFields");
    }
    o
}

/// `entries` after `manager` wrote `new` over `old` (None: created): it owns what it set or
/// changed, the others lose that; fields that are gone are nobody's.
fn record_write(
    entries: Vec<Value>,
    old: Option<&Value>,
    new: &Value,
    manager: &str,
    api_version: &str,
    subresource: Option<&str>,
) -> Vec<Value> {
    let before = old.map(owned_leaves).unwrap_or_default();
    let after = owned_leaves(new);
    let changed: BTreeSet<FieldPath> =
        after.iter().filter(|(p, v)| before.get(*p) != Some(*v)).map(|(p, _)| p.clone()).collect();
    let live: BTreeSet<&FieldPath> = after.keys().collect();
    let is_mine = |e: &Value| {
        e["manager"] == json!(manager) && e["operation"] == json!("Update") && e["subresource"].as_str() == subresource
    };
    let mut out = Vec::new();
    let mut mine: BTreeSet<FieldPath> = BTreeSet::new();
    let mut position = None;
    for e in entries {
        let owned: BTreeSet<FieldPath> =
            paths_of(&e["fieldsV1"]).into_iter().filter(|p| live.contains(p) && !changed.contains(p)).collect();
        if is_mine(&e) {
            mine = owned;
            position = Some(out.len());
            continue;
        }
        if owned.is_empty() {
            continue;
        }
        let mut e = e;
        e["fieldsV1"] = fields_v1(&owned);
        out.push(e);
    }
    mine.extend(changed);
    let mut entry = json!({
        "manager": manager, "operation": "Update", "apiVersion": api_version, "time": rfc3339_now(),
        "fieldsType": "FieldsV1", "fieldsV1": fields_v1(&mine),
    });
    if let Some(s) = subresource {
        entry["subresource"] = json!(s);
    }
    match position {
        Some(i) => out.insert(i, entry),
        None => out.push(entry),
    }
    out
}

/// Checks `kind`/`apiVersion` of a request body against the endpoint.
fn check_types(def: &ResourceDef, body: &Value) -> ApiResult<()> {
    let kind = body["kind"].as_str().unwrap_or("");
    let api_version = body["apiVersion"].as_str().unwrap_or("");
    if kind.is_empty() {
        return Err(ApiError::bad_request(format!("Object 'Kind' is missing in '{body}'")));
    }
    if api_version.is_empty() {
        return Err(ApiError::bad_request(format!("Object 'apiVersion' is missing in '{body}'")));
    }
    if kind != def.kind || api_version != def.api_version() {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({api_version}) does not match the expected API version ({}) or kind ({kind}) does not match {}",
            def.api_version(),
            def.kind
        )));
    }
    Ok(())
}

/// Sets/validates `metadata.namespace` against the path.
fn fix_namespace(def: &ResourceDef, ns: &str, obj: &mut Value) -> ApiResult<()> {
    let meta = obj["metadata"].as_object_mut().ok_or_else(|| ApiError::bad_request("metadata must be an object"))?;
    if def.namespaced {
        match meta.get("namespace").and_then(Value::as_str) {
            Some(n) if !n.is_empty() && n != ns => {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            _ => {
                meta.insert("namespace".into(), json!(ns));
            }
        }
    } else {
        meta.remove("namespace");
    }
    Ok(())
}

fn create(st: &mut State, def: &ResourceDef, ns: &str, mut obj: Value, manager: &str) -> ApiResult<Value> {
    check_types(def, &obj)?;
    if obj.get("metadata").is_none_or(Value::is_null) {
        obj["metadata"] = json!({});
    }
    fix_namespace(def, ns, &mut obj)?;
    let mut name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
    if name.is_empty() {
        let prefix = obj["metadata"]["generateName"].as_str().unwrap_or("").to_string();
        if prefix.is_empty() {
            return Err(ApiError::invalid(
                def,
                "",
                "metadata.name",
                "Required value: name or generateName is required",
            ));
        }
        name = format!("{prefix}{}", st.generate_suffix());
        obj["metadata"]["name"] = json!(name);
    }
    if let Some(why) = subdomain_error(&name) {
        return Err(ApiError::invalid(def, &name, "metadata.name", &format!("Invalid value: {}: {why}", json!(name))));
    }
    validate_metadata(def, &name, &obj)?;
    if obj["metadata"]["resourceVersion"].as_str().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::new(
            500,
            "InternalError",
            "Internal error occurred: resourceVersion should not be set on objects to be created",
            None,
        ));
    }
    let okey = (ns.to_string(), name.clone());
    if st.objects.get(&def.key()).is_some_and(|m| m.contains_key(&okey)) {
        return Err(ApiError::already_exists(def, &name));
    }
    st.init_meta(&mut obj);
    let base = request_managed_fields(&obj).unwrap_or_default();
    obj["metadata"]["managedFields"] = json!(record_write(base, None, &obj, manager, &def.api_version(), None));
    Ok(st.commit(def, okey, obj, None, EvType::Added))
}

/// The common part of PUT and PATCH: checks `new` against the stored `old` and stores it.
/// `require_rv`: a PUT of a custom resource must carry a resourceVersion.
#[allow(clippy::too_many_arguments)]
fn finish_update(
    st: &mut State,
    def: &ResourceDef,
    ns: &str,
    name: &str,
    old: Value,
    mut new: Value,
    status_sub: bool,
    require_rv: bool,
    manager: &str,
) -> ApiResult<Value> {
    if !new["metadata"].is_object() {
        if new.get("metadata").is_none_or(Value::is_null) {
            new["metadata"] = json!({});
        } else {
            return Err(ApiError::bad_request("metadata must be an object"));
        }
    }
    let body_name = new["metadata"]["name"].as_str().unwrap_or("");
    if body_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    fix_namespace(def, ns, &mut new)?;
    if !status_sub {
        validate_metadata(def, name, &new)?;
    }
    let given_fields = request_managed_fields(&new);
    let old_uid = old["metadata"]["uid"].as_str().unwrap_or("").to_string();
    if let Some(uid) = new["metadata"]["uid"].as_str().filter(|u| !u.is_empty())
        && uid != old_uid
    {
        return Err(ApiError::conflict(
            def,
            name,
            &format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {old_uid}"),
        ));
    }
    let old_rv = old["metadata"]["resourceVersion"].as_str().unwrap_or("").to_string();
    match new["metadata"]["resourceVersion"].as_str().filter(|r| !r.is_empty()) {
        Some(rv) if rv != old_rv => return Err(ApiError::modified(def, name)),
        Some(_) => {}
        None if require_rv && !def.builtin() => {
            return Err(ApiError::invalid(
                def,
                name,
                "metadata.resourceVersion",
                "Invalid value: 0x0: must be specified for an update",
            ));
        }
        None => {}
    }

    let mut result = if status_sub {
        let mut r = old.clone();
        match new.get("status") {
            Some(s) if !s.is_null() => r["status"] = s.clone(),
            _ => {
                if let Some(m) = r.as_object_mut() {
                    m.remove("status");
                }
            }
        }
        r
    } else {
        new
    };
    result["kind"] = json!(def.kind);
    result["apiVersion"] = json!(def.api_version());
    for f in ["uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"] {
        match old["metadata"].get(f) {
            Some(v) => result["metadata"][f] = v.clone(),
            None => {
                if let Some(m) = result["metadata"].as_object_mut() {
                    m.remove(f);
                }
            }
        }
    }
    let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
    let generation = if spec_of(&old) != spec_of(&result) { generation + 1 } else { generation };
    result["metadata"]["generation"] = json!(generation);
    result["metadata"]["resourceVersion"] = json!(old_rv);
    if without_managed_fields(&result) == without_managed_fields(&old) {
        // A no-op write: nothing is stored, the resourceVersion stays, no watch event.
        return Ok(old);
    }
    let base = given_fields.or_else(|| request_managed_fields(&old)).unwrap_or_default();
    let sub = status_sub.then_some("status");
    result["metadata"]["managedFields"] =
        json!(record_write(base, Some(&old), &result, manager, &def.api_version(), sub));
    let okey = (ns.to_string(), name.to_string());
    Ok(st.commit(def, okey, result, Some(old), EvType::Modified))
}

fn update(
    st: &mut State,
    def: &ResourceDef,
    ns: &str,
    name: &str,
    body: Value,
    status_sub: bool,
    manager: &str,
) -> ApiResult<Value> {
    check_types(def, &body)?;
    let body_name = body["metadata"]["name"].as_str().unwrap_or("");
    if body_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    let old = st
        .objects
        .get(&def.key())
        .and_then(|m| m.get(&(ns.to_string(), name.to_string())))
        .cloned()
        .ok_or_else(|| ApiError::not_found(def, name))?;
    finish_update(st, def, ns, name, old, body, status_sub, true, manager)
}

async fn patch(
    shared: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    name: &str,
    r: Req,
    status_sub: bool,
    manager: &str,
) -> ApiResult<Value> {
    let mime = r.content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let merge = match mime.as_str() {
        "application/merge-patch+json" => true,
        "application/json-patch+json" => false,
        _ => return Err(ApiError::unsupported_media("application/json-patch+json, application/merge-patch+json")),
    };
    let body = r.body().await?;
    let p: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
    let mut st = shared.lock();
    let old = st
        .objects
        .get(&def.key())
        .and_then(|m| m.get(&(ns.to_string(), name.to_string())))
        .cloned()
        .ok_or_else(|| ApiError::not_found(def, name))?;
    let mut new = old.clone();
    if merge {
        if !p.is_object() {
            return Err(ApiError::bad_request("a merge patch must be a JSON object"));
        }
        merge_patch(&mut new, &p);
    } else {
        json_patch(&mut new, &p).map_err(|e| {
            ApiError::new(
                422,
                "Invalid",
                format!("the server rejected our request due to an error in our request: {e}"),
                None,
            )
        })?;
    }
    if !new.is_object() {
        return Err(ApiError::bad_request("the patched object is not a JSON object"));
    }
    let kind_ok = new["kind"] == json!(def.kind) && new["apiVersion"] == json!(def.api_version());
    if !kind_ok {
        return Err(ApiError::bad_request("a patch may not change kind or apiVersion"));
    }
    finish_update(&mut st, def, ns, name, old, new, status_sub, false, manager)
}

#[derive(Default)]
struct DeleteOpts {
    uid: Option<String>,
    rv: Option<String>,
}

fn parse_delete_options(body: &[u8]) -> ApiResult<DeleteOpts> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(DeleteOpts::default());
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("error decoding DeleteOptions: {e}")))?;
    let pre = &v["preconditions"];
    Ok(DeleteOpts {
        uid: pre["uid"].as_str().map(str::to_string),
        rv: pre["resourceVersion"].as_str().map(str::to_string),
    })
}

fn delete(st: &mut State, def: &ResourceDef, ns: &str, name: &str, opts: &DeleteOpts) -> ApiResult<Value> {
    let okey = (ns.to_string(), name.to_string());
    let old =
        st.objects.get(&def.key()).and_then(|m| m.get(&okey)).cloned().ok_or_else(|| ApiError::not_found(def, name))?;
    let old_uid = old["metadata"]["uid"].as_str().unwrap_or("");
    let old_rv = old["metadata"]["resourceVersion"].as_str().unwrap_or("");
    if let Some(uid) = &opts.uid
        && uid != old_uid
    {
        return Err(ApiError::conflict(
            def,
            name,
            &format!("Precondition failed: UID in precondition: {uid}, UID in object meta: {old_uid}"),
        ));
    }
    if let Some(rv) = &opts.rv
        && rv != old_rv
    {
        return Err(ApiError::conflict(
            def,
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {old_rv}"
            ),
        ));
    }
    let old = st.remove(def, &okey).ok_or_else(|| ApiError::not_found(def, name))?;
    if def.builtin() {
        let mut d = details(def, name);
        d["uid"] = old["metadata"]["uid"].clone();
        Ok(json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": d}))
    } else {
        Ok(old)
    }
}

/// How an object appears in a list: built-in types without kind/apiVersion, like the
/// real apiserver's typed lists; custom resources with them.
fn list_item(def: &ResourceDef, mut o: Value) -> Value {
    if def.builtin()
        && let Some(m) = o.as_object_mut()
    {
        m.remove("kind");
        m.remove("apiVersion");
    }
    o
}

fn list(
    shared: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    q: &HashMap<String, String>,
) -> ApiResult<Response<RespBody>> {
    let sel = Selector::from_query(q)?;
    let limit: usize = match q.get("limit").map(|l| l.parse::<i64>()) {
        None => 0,
        Some(Ok(l)) if l >= 0 => l as usize,
        Some(_) => return Err(ApiError::new(400, "BadRequest", "limit must be a non-negative integer", None)),
    };
    let mut st = shared.lock();
    let (rv, mut items) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => match st.pages.remove(token) {
            Some(_) if st.expire_continues > 0 => {
                st.expire_continues -= 1;
                return Err(ApiError::new(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    None,
                ));
            }
            Some(page) => page,
            None => {
                return Err(ApiError::new(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    None,
                ));
            }
        },
        None => {
            let items = st
                .objects
                .get(&def.key())
                .map(|m| {
                    m.iter()
                        .filter(|((ons, _), o)| (ns.is_empty() || ons == ns) && sel.matches(o))
                        .map(|(_, o)| list_item(def, o.clone()))
                        .collect()
                })
                .unwrap_or_default();
            (st.rv, items)
        }
    };
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if limit > 0 && items.len() > limit {
        let rest = items.split_off(limit);
        st.rng = st.rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let token = format!("np-{rv}-{:016x}", st.rng);
        metadata["continue"] = json!(token);
        metadata["remainingItemCount"] = json!(rest.len());
        st.pages.insert(token, (rv, rest));
    }
    Ok(json_response(
        200,
        &json!({"kind": format!("{}List", def.kind), "apiVersion": def.api_version(),
                "metadata": metadata, "items": items}),
    ))
}

// ---------------------------------------------------------------------------------------------
// Patches
// ---------------------------------------------------------------------------------------------

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            if let Value::Object(t) = target {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

fn pointer_tokens(p: &str) -> Result<Vec<String>, String> {
    if p.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = p.strip_prefix('/') else { return Err(format!("invalid JSON pointer {p:?}")) };
    Ok(rest.split('/').map(|t| t.replace("~1", "/").replace("~0", "~")).collect())
}

fn parent_mut<'a>(doc: &'a mut Value, toks: &[String]) -> Result<&'a mut Value, String> {
    let mut cur = doc;
    for t in toks {
        cur = match cur {
            Value::Object(m) => m.get_mut(t).ok_or_else(|| format!("path segment {t:?} not found"))?,
            Value::Array(a) => {
                let i: usize = t.parse().map_err(|_| format!("invalid array index {t:?}"))?;
                a.get_mut(i).ok_or_else(|| format!("array index {i} out of range"))?
            }
            _ => return Err(format!("cannot descend into a scalar at {t:?}")),
        };
    }
    Ok(cur)
}

fn ptr_add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
    let toks = pointer_tokens(path)?;
    let Some((last, parents)) = toks.split_last() else {
        *doc = value;
        return Ok(());
    };
    match parent_mut(doc, parents)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
        }
        Value::Array(a) => {
            if last == "-" {
                a.push(value);
            } else {
                let i: usize = last.parse().map_err(|_| format!("invalid array index {last:?}"))?;
                if i > a.len() {
                    return Err(format!("array index {i} out of range"));
                }
                a.insert(i, value);
            }
        }
        _ => return Err(format!("cannot add to a scalar at {path:?}")),
    }
    Ok(())
}

fn ptr_remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let toks = pointer_tokens(path)?;
    let Some((last, parents)) = toks.split_last() else { return Err("cannot remove the whole document".into()) };
    match parent_mut(doc, parents)? {
        Value::Object(m) => m.remove(last).ok_or_else(|| format!("{path:?} not found")),
        Value::Array(a) => {
            let i: usize = last.parse().map_err(|_| format!("invalid array index {last:?}"))?;
            if i >= a.len() {
                return Err(format!("array index {i} out of range"));
            }
            Ok(a.remove(i))
        }
        _ => Err(format!("cannot remove from a scalar at {path:?}")),
    }
}

fn ptr_get(doc: &Value, path: &str) -> Result<Value, String> {
    doc.pointer(path).cloned().ok_or_else(|| format!("{path:?} not found"))
}

/// RFC 6902 JSON patch.
fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), String> {
    let ops = patch.as_array().ok_or("a JSON patch must be an array")?;
    for op in ops {
        let path = op["path"].as_str().ok_or("operation without a path")?;
        match op["op"].as_str().unwrap_or("") {
            "add" => ptr_add(doc, path, op.get("value").cloned().ok_or("add without a value")?)?,
            "remove" => {
                ptr_remove(doc, path)?;
            }
            "replace" => {
                ptr_remove(doc, path)?;
                ptr_add(doc, path, op.get("value").cloned().ok_or("replace without a value")?)?;
            }
            "move" => {
                let from = op["from"].as_str().ok_or("move without from")?;
                let v = ptr_remove(doc, from)?;
                ptr_add(doc, path, v)?;
            }
            "copy" => {
                let from = op["from"].as_str().ok_or("copy without from")?;
                let v = ptr_get(doc, from)?;
                ptr_add(doc, path, v)?;
            }
            "test" => {
                let want = op.get("value").ok_or("test without a value")?;
                if &ptr_get(doc, path)? != want {
                    return Err(format!("testing value {path} failed"));
                }
            }
            other => return Err(format!("unsupported JSON patch operation {other:?}")),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Selectors
// ---------------------------------------------------------------------------------------------

enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

enum FieldReq {
    Eq(&'static str, String),
    Ne(&'static str, String),
}

#[derive(Default)]
struct Selector {
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

fn valid_label_key(k: &str) -> bool {
    !k.is_empty() && k.len() <= 317 && k.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_./".contains(&c))
}

fn valid_label_value(v: &str) -> bool {
    v.len() <= 63 && v.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
}

fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, String> {
    let mut reqs = Vec::new();
    for term in split_top_level(s).into_iter().map(str::trim).filter(|t| !t.is_empty()) {
        let bad = || format!("unable to parse requirement: {term:?}");
        let req = if let Some(k) = term.strip_prefix('!') {
            LabelReq::NotExists(k.trim().to_string())
        } else if let Some((left, right)) = term.split_once('(') {
            let mut words = left.split_whitespace();
            let (Some(k), Some(op), None) = (words.next(), words.next(), words.next()) else { return Err(bad()) };
            let inner = right.strip_suffix(')').ok_or_else(bad)?;
            let vals: Vec<String> = inner.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect();
            if vals.iter().any(|v| !valid_label_value(v)) {
                return Err(bad());
            }
            match op {
                "in" => LabelReq::In(k.to_string(), vals),
                "notin" => LabelReq::NotIn(k.to_string(), vals),
                _ => return Err(bad()),
            }
        } else if let Some((k, v)) = term.split_once("!=") {
            LabelReq::Ne(k.trim().to_string(), v.trim().to_string())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            LabelReq::Eq(k.trim().to_string(), v.trim().to_string())
        } else if term.contains(['<', '>']) {
            return Err(format!("the fake apiserver does not support numeric label selectors: {term:?}"));
        } else {
            LabelReq::Exists(term.to_string())
        };
        let (k, v) = match &req {
            LabelReq::Eq(k, v) | LabelReq::Ne(k, v) => (k, Some(v)),
            LabelReq::Exists(k) | LabelReq::NotExists(k) | LabelReq::In(k, _) | LabelReq::NotIn(k, _) => (k, None),
        };
        if !valid_label_key(k) || v.is_some_and(|v| !valid_label_value(v)) {
            return Err(bad());
        }
        reqs.push(req);
    }
    Ok(reqs)
}

fn parse_field_selector(s: &str) -> Result<Vec<FieldReq>, String> {
    let mut reqs = Vec::new();
    for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (field, value, eq) = if let Some((f, v)) = term.split_once("!=") {
            (f, v, false)
        } else if let Some((f, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            (f, v, true)
        } else {
            return Err(format!("invalid selector: '{term}'; can't understand '{term}'"));
        };
        let field: &'static str = match field.trim() {
            "metadata.name" => "name",
            "metadata.namespace" => "namespace",
            other => return Err(format!("field label not supported: {other}")),
        };
        let value = value.trim().to_string();
        reqs.push(if eq { FieldReq::Eq(field, value) } else { FieldReq::Ne(field, value) });
    }
    Ok(reqs)
}

impl Selector {
    fn from_query(q: &HashMap<String, String>) -> ApiResult<Selector> {
        let labels = parse_label_selector(q.get("labelSelector").map(String::as_str).unwrap_or(""))
            .map_err(ApiError::bad_request)?;
        let fields = parse_field_selector(q.get("fieldSelector").map(String::as_str).unwrap_or(""))
            .map_err(ApiError::bad_request)?;
        Ok(Selector { labels, fields })
    }

    fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        let label = |k: &str| labels.get(k).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
            LabelReq::Ne(k, v) => label(k) != Some(v.as_str()),
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
            LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
        });
        let field = |f: &str| obj["metadata"][f].as_str().unwrap_or("").to_string();
        labels_ok
            && self.fields.iter().all(|r| match r {
                FieldReq::Eq(f, v) => field(f) == *v,
                FieldReq::Ne(f, v) => field(f) != *v,
            })
    }
}

// ---------------------------------------------------------------------------------------------
// Watch
// ---------------------------------------------------------------------------------------------

struct WatchFilter {
    def: ResourceDef,
    ns: String,
    sel: Selector,
}

impl WatchFilter {
    fn wants(&self, obj: &Value) -> bool {
        (self.ns.is_empty() || obj["metadata"]["namespace"].as_str() == Some(self.ns.as_str())) && self.sel.matches(obj)
    }

    /// The event this watch sees for `ev`, if any: like the watch cache, an object that
    /// starts (stops) matching the selector is ADDED (DELETED).
    fn render(&self, ev: &Ev) -> Option<Bytes> {
        if ev.res != self.def.key() {
            return None;
        }
        let (typ, obj) = match ev.typ {
            EvType::Added | EvType::Deleted => (ev.typ, self.wants(&ev.obj).then(|| ev.obj.clone())?),
            EvType::Modified => {
                let was = ev.old.as_ref().is_some_and(|o| self.wants(o));
                match (was, self.wants(&ev.obj)) {
                    (true, true) => (EvType::Modified, ev.obj.clone()),
                    (false, true) => (EvType::Added, ev.obj.clone()),
                    (true, false) => {
                        let mut o = ev.old.clone().unwrap_or_default();
                        o["metadata"]["resourceVersion"] = json!(ev.rv.to_string());
                        (EvType::Deleted, o)
                    }
                    (false, false) => return None,
                }
            }
        };
        Some(event_line(typ.as_str(), &obj))
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Bytes {
        let mut meta = json!({"resourceVersion": rv.to_string()});
        if initial_end {
            meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
        }
        event_line("BOOKMARK", &json!({"kind": self.def.kind, "apiVersion": self.def.api_version(), "metadata": meta}))
    }
}

fn event_line(typ: &str, obj: &Value) -> Bytes {
    let mut v = serde_json::to_vec(&json!({"type": typ, "object": obj})).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

fn watch_response(rx: mpsc::Receiver<Bytes>) -> Response<RespBody> {
    let mut r = Response::new(RespBody::Stream(rx));
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn start_watch(
    shared: &Arc<Shared>,
    def: &ResourceDef,
    ns: &str,
    q: &HashMap<String, String>,
) -> ApiResult<Response<RespBody>> {
    let sel = Selector::from_query(q)?;
    let bookmarks = query_bool(q, "allowWatchBookmarks")?.unwrap_or(false);
    let send_initial = query_bool(q, "sendInitialEvents")?;
    let timeout = match q.get("timeoutSeconds").filter(|s| !s.is_empty()) {
        Some(s) => Some(Duration::from_secs(
            s.parse::<u64>().map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds {s:?}")))?,
        )),
        None => None,
    };
    let rv_param = q.get("resourceVersion").cloned().unwrap_or_default();
    let from: Option<u64> = match rv_param.as_str() {
        "" | "0" => None,
        s => Some(s.parse().map_err(|_| ApiError::bad_request(format!("invalid resource version: {s:?}")))?),
    };
    if send_initial == Some(true) && !bookmarks {
        return Err(ApiError::invalid(
            def,
            "",
            "allowWatchBookmarks",
            "Required value: sendInitialEvents requires setting allowWatchBookmarks to true",
        ));
    }
    let filter = WatchFilter { def: def.clone(), ns: ns.to_string(), sel };
    let (out_tx, out_rx) = mpsc::channel::<Bytes>(256);

    let mut st = shared.lock();
    if let Some(from) = from
        && from < st.compacted
    {
        let status =
            status_failure(410, "Expired", &format!("too old resource version: {from} ({})", st.compacted), None);
        let _ = out_tx.try_send(event_line("ERROR", &status));
        return Ok(watch_response(out_rx));
    }
    let mut initial: Vec<Bytes> = Vec::new();
    let synthetic = send_initial.unwrap_or(from.is_none());
    if synthetic {
        // "Get state and start at most recent": ADDED for everything there is now.
        if let Some(m) = st.objects.get(&def.key()) {
            initial.extend(m.values().filter(|o| filter.wants(o)).map(|o| event_line("ADDED", o)));
        }
        if send_initial == Some(true) {
            initial.push(filter.bookmark(st.rv, true));
        }
    } else if let Some(from) = from {
        initial.extend(st.history.iter().filter(|e| e.rv > from).filter_map(|e| filter.render(e)));
    }
    let (ev_tx, ev_rx) = mpsc::unbounded_channel();
    st.watchers.push(ev_tx);
    let close_rx = shared.closing.subscribe();
    drop(st);

    // What the client knows; a bookmark is due once the resourceVersion moves past it.
    let known_rv = from.unwrap_or(0);
    tokio::spawn(run_watch(shared.clone(), filter, ev_rx, close_rx, out_tx, initial, bookmarks, timeout, known_rv));
    Ok(watch_response(out_rx))
}

#[allow(clippy::too_many_arguments)]
async fn run_watch(
    shared: Arc<Shared>,
    filter: WatchFilter,
    mut events: mpsc::UnboundedReceiver<Arc<Ev>>,
    mut close_rx: watch::Receiver<u64>,
    out: mpsc::Sender<Bytes>,
    initial: Vec<Bytes>,
    bookmarks: bool,
    timeout: Option<Duration>,
    mut reported_rv: u64,
) {
    for line in initial {
        if out.send(line).await.is_err() {
            return;
        }
    }
    let mut paused_rx = shared.paused.subscribe();
    let deadline = tokio::time::Instant::now() + timeout.unwrap_or(Duration::from_secs(10 * 365 * 86400));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + BOOKMARK_EVERY, BOOKMARK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let paused = *paused_rx.borrow_and_update();
        tokio::select! {
            biased;
            _ = close_rx.changed() => break,
            _ = out.closed() => break,
            r = paused_rx.changed() => if r.is_err() { break },
            _ = tokio::time::sleep_until(deadline), if !paused => break,
            ev = events.recv(), if !paused => match ev {
                None => break,
                Some(ev) => {
                    if let Some(line) = filter.render(&ev) {
                        reported_rv = reported_rv.max(ev.rv);
                        if out.send(line).await.is_err() {
                            break;
                        }
                    }
                }
            },
            _ = tick.tick(), if !paused && bookmarks => {
                // Everything up to the current resourceVersion is in `events` once we hold
                // the lock (events are published under it), so drain those first.
                let (rv, pending, closed) = {
                    let st = shared.lock();
                    let mut pending = Vec::new();
                    let closed = loop {
                        match events.try_recv() {
                            Ok(e) => pending.push(e),
                            Err(mpsc::error::TryRecvError::Empty) => break false,
                            Err(mpsc::error::TryRecvError::Disconnected) => break true,
                        }
                    };
                    (st.rv, pending, closed)
                };
                let mut failed = false;
                for e in pending {
                    if let Some(line) = filter.render(&e) {
                        reported_rv = reported_rv.max(e.rv);
                        if out.send(line).await.is_err() {
                            failed = true;
                            break;
                        }
                    }
                }
                if failed || closed {
                    break;
                }
                if rv > reported_rv {
                    reported_rv = rv;
                    if out.send(filter.bookmark(rv, false)).await.is_err() {
                        break;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// TokenReview
// ---------------------------------------------------------------------------------------------

async fn token_review(shared: &Arc<Shared>, r: Req) -> ApiResult<Response<RespBody>> {
    let def = ResourceDef {
        group: "authentication.k8s.io".into(),
        version: "v1".into(),
        plural: "tokenreviews".into(),
        kind: "TokenReview".into(),
        namespaced: false,
        token_review: true,
    };
    let mut body = r.json_body().await?;
    check_types(&def, &body)?;
    let token = body["spec"]["token"].as_str().unwrap_or("").to_string();
    if token.is_empty() {
        return Err(ApiError::bad_request("token is required for TokenReview in authentication"));
    }
    let requested: Vec<String> = match &body["spec"]["audiences"] {
        Value::Null => Vec::new(),
        Value::Array(a) => a.iter().filter_map(Value::as_str).map(str::to_string).collect(),
        _ => return Err(ApiError::bad_request("spec.audiences must be a list of strings")),
    };
    let user = shared.lock().tokens.get(&token).cloned();
    let status = match user {
        None => json!({"user": {}, "error": "[invalid bearer token, token lookup failed]"}),
        Some(u) => {
            let target = if requested.is_empty() { vec![API_AUDIENCE.to_string()] } else { requested.clone() };
            let valid_for: BTreeSet<String> = u.token_audiences().into_iter().collect();
            let common: Vec<String> = target.iter().filter(|a| valid_for.contains(*a)).cloned().collect();
            if common.is_empty() {
                json!({"user": {}, "error": format!(
                    "[invalid bearer token, token audiences {:?} is invalid for the target audiences {:?}]",
                    u.token_audiences(), target)})
            } else {
                let mut user = Map::new();
                user.insert("username".into(), json!(u.username));
                if !u.uid.is_empty() {
                    user.insert("uid".into(), json!(u.uid));
                }
                if !u.groups.is_empty() {
                    user.insert("groups".into(), json!(u.groups));
                }
                if !u.extra.is_empty() {
                    user.insert("extra".into(), json!(u.extra));
                }
                json!({"authenticated": true, "user": user, "audiences": common})
            }
        }
    };
    if !body["metadata"].is_object() {
        body["metadata"] = json!({});
    }
    body["metadata"]["creationTimestamp"] = Value::Null;
    body["status"] = status;
    Ok(json_response(201, &body))
}

// ---------------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------------

/// Now as RFC 3339 in UTC with second precision, as Kubernetes writes timestamps.
fn rfc3339_now() -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    nodeplane::util::utc_rfc3339(secs as i64)
}
