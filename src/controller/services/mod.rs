//! Kubernetes Services, the controller's half: Services and EndpointSlices (watched from the
//! API in Kubernetes mode, applied as JSON in local mode) compiled into service ports
//! ([`compile`]), kept with a revision, and streamed to every node as a snapshot, then
//! changes ([`server`]).
//!
//! A change recompiles only the Service it touches and records what differs: ports added
//! or changed, ids removed. The cost of a change is the size of that Service, whatever the
//! number of Services. The last [`HISTORY`] changes are kept (fewer when they hold more than
//! [`HISTORY_ENDPOINTS`] endpoints), so a node that reconnects gets what it missed rather
//! than everything.

pub mod compile;
pub mod server;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::controller::policy::model::ObjectError;
use crate::rpc::controller as pb;

/// `(namespace, name)`.
pub type Key = (String, String);

/// Changes kept for streams that fall behind or reconnect.
pub const HISTORY: usize = 4096;
/// Endpoints the kept changes may hold at most: a change holds every port it touched whole,
/// so the rolling update of a large Deployment would otherwise keep thousands of copies of
/// its Service (about 100 bytes an endpoint: 25 MiB).
pub const HISTORY_ENDPOINTS: usize = 1 << 18;

/// One change: the ports written and the ids removed, at `revision`.
#[derive(Debug, Default)]
pub struct Change {
    pub revision: u64,
    pub upserts: Vec<Arc<pb::ServicePort>>,
    pub removed: Vec<String>,
}

/// Where a stream starts.
pub enum Start {
    Snapshot { revision: u64, ports: Vec<Arc<pb::ServicePort>> },
    Changes(Vec<Arc<Change>>),
}

#[derive(Default)]
struct State {
    services: BTreeMap<Key, Service>,
    slices: BTreeMap<Key, EndpointSlice>,
    /// The slices of each Service (by the service-name label).
    slices_of: BTreeMap<Key, BTreeSet<Key>>,
    ports: BTreeMap<String, Arc<pb::ServicePort>>,
    ports_of: BTreeMap<Key, BTreeSet<String>>,
    revision: u64,
    history: VecDeque<Arc<Change>>,
    /// The endpoints `history` holds.
    history_endpoints: usize,
}

fn endpoints_of(c: &Change) -> usize {
    c.upserts.iter().map(|p| p.endpoints.len()).sum()
}

/// Local mode's applied objects: one redb table, key `Kind/namespace/name`, value the
/// object's JSON. A change writes only its objects (one transaction per apply), whatever
/// the number of objects held.
struct ObjectStore(redb::Database);

const OBJECTS: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("objects");

fn db(e: impl Into<redb::Error>) -> ObjectError {
    ObjectError::Store(e.into())
}

impl ObjectStore {
    fn open(path: &std::path::Path) -> Result<Self, ObjectError> {
        let file = |e| ObjectError::File { path: path.into(), source: std::io::Error::other(e) };
        let database = redb::Database::create(path).map_err(file)?;
        let tx = database.begin_write().map_err(db)?;
        tx.open_table(OBJECTS).map_err(db)?;
        tx.commit().map_err(db)?;
        Ok(ObjectStore(database))
    }

    /// Every object held: (kind, JSON).
    fn all(&self) -> Result<Vec<(String, serde_json::Value)>, ObjectError> {
        use redb::{ReadableDatabase, ReadableTable};
        let tx = self.0.begin_read().map_err(db)?;
        let t = tx.open_table(OBJECTS).map_err(db)?;
        let mut out = Vec::new();
        for row in t.iter().map_err(db)? {
            let (k, v) = row.map_err(db)?;
            let kind = k.value().split('/').next().unwrap_or_default().to_string();
            let decode = |source| ObjectError::Decode { kind: format!("stored {}", k.value()), source };
            out.push((kind, serde_json::from_slice(v.value()).map_err(decode)?));
        }
        Ok(out)
    }

    /// Write (`Some`) or delete (`None`) objects by key, in one transaction.
    fn commit(&self, changes: &[(String, Option<Vec<u8>>)]) -> Result<(), ObjectError> {
        let tx = self.0.begin_write().map_err(db)?;
        {
            let mut t = tx.open_table(OBJECTS).map_err(db)?;
            for (k, v) in changes {
                match v {
                    Some(v) => t.insert(k.as_str(), v.as_slice()).map(|_| ()),
                    None => t.remove(k.as_str()).map(|_| ()),
                }
                .map_err(db)?;
            }
        }
        tx.commit().map_err(db)
    }
}

pub struct ServiceBook {
    state: Mutex<State>,
    changed: tokio::sync::watch::Sender<u64>,
    /// Whether the book holds every object: from the start in local mode; in Kubernetes mode
    /// once Services and EndpointSlices have both been listed. Before that a snapshot would
    /// tell the nodes to drop Services (or their endpoints) they must keep serving.
    complete: tokio::sync::watch::Sender<bool>,
    /// This book's instance: revisions compare only within one epoch.
    pub epoch: u64,
    /// The cluster's pod pools (sent with every snapshot).
    pub pod_cidrs: Vec<String>,
    /// Local mode: the applied objects.
    store: Option<ObjectStore>,
}

fn key_of(m: &ObjectMeta, kind: &'static str) -> Result<Key, ObjectError> {
    let name = m.name.clone().filter(|n| !n.is_empty()).ok_or(ObjectError::NoName(kind))?;
    Ok((m.namespace.clone().unwrap_or_else(|| "default".into()), name))
}

impl ServiceBook {
    /// `store`: local mode's database of applied objects (loaded now); `None` in Kubernetes
    /// mode.
    pub fn new(pod_cidrs: Vec<String>, store: Option<PathBuf>) -> Result<Arc<Self>, ObjectError> {
        let store = store.as_deref().map(ObjectStore::open).transpose()?;
        let book = ServiceBook {
            state: Mutex::new(State::default()),
            changed: tokio::sync::watch::channel(0).0,
            complete: tokio::sync::watch::channel(store.is_some()).0,
            epoch: crate::controller::records::random_epoch(),
            pod_cidrs,
            store,
        };
        if let Some(store) = &book.store {
            let (mut svcs, mut slices) = (Vec::new(), Vec::new());
            for (kind, v) in store.all()? {
                let decode = |source| ObjectError::Decode { kind: format!("stored {kind}"), source };
                match kind.as_str() {
                    "Service" => svcs.push(serde_json::from_value(v).map_err(decode)?),
                    _ => slices.push(serde_json::from_value(v).map_err(decode)?),
                }
            }
            book.replace_services(&svcs);
            book.replace_slices(&slices);
        }
        Ok(Arc::new(book))
    }

    /// Kubernetes mode: both kinds have been listed.
    pub fn mark_complete(&self) {
        self.complete.send_replace(true);
    }

    /// Returns once the book holds every object.
    pub async fn until_complete(&self) {
        let _ = self.complete.subscribe().wait_for(|c| *c).await;
    }

    /// Wakes at every new revision.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub fn revision(&self) -> u64 {
        self.state.lock().unwrap().revision
    }

    /// The changes after `revision` of `epoch`, when they are all still kept; else a snapshot.
    pub fn follow(&self, epoch: u64, revision: u64) -> Start {
        let st = self.state.lock().unwrap();
        let oldest = st.history.front().map_or(st.revision + 1, |c| c.revision);
        if epoch == self.epoch && revision > 0 && revision <= st.revision && revision + 1 >= oldest {
            let changes = st.history.iter().filter(|c| c.revision > revision).cloned().collect();
            return Start::Changes(changes);
        }
        drop(st);
        let (revision, ports) = self.whole();
        Start::Snapshot { revision, ports }
    }

    /// Every port, at the revision it stands at.
    pub fn whole(&self) -> (u64, Vec<Arc<pb::ServicePort>>) {
        let st = self.state.lock().unwrap();
        (st.revision, st.ports.values().cloned().collect())
    }

    pub fn set_service(&self, svc: &Service) -> Result<(), ObjectError> {
        let key = key_of(&svc.metadata, "Service")?;
        let mut st = self.state.lock().unwrap();
        st.services.insert(key.clone(), svc.clone());
        self.recompile(&mut st, [key]);
        Ok(())
    }

    pub fn remove_service(&self, key: &Key) {
        let mut st = self.state.lock().unwrap();
        if st.services.remove(key).is_some() {
            self.recompile(&mut st, [key.clone()]);
        }
    }

    pub fn set_slice(&self, slice: &EndpointSlice) -> Result<(), ObjectError> {
        let key = key_of(&slice.metadata, "EndpointSlice")?;
        let mut st = self.state.lock().unwrap();
        let before = st.slices.get(&key).and_then(compile::owner);
        let after = compile::owner(slice);
        if let Some(b) = &before {
            unlink(&mut st.slices_of, b, &key);
        }
        if let Some(a) = &after {
            st.slices_of.entry(a.clone()).or_default().insert(key.clone());
        }
        st.slices.insert(key, slice.clone());
        self.recompile(&mut st, before.into_iter().chain(after));
        Ok(())
    }

    pub fn remove_slice(&self, key: &Key) {
        let mut st = self.state.lock().unwrap();
        let Some(old) = st.slices.remove(key) else { return };
        if let Some(owner) = compile::owner(&old) {
            unlink(&mut st.slices_of, &owner, key);
            self.recompile(&mut st, [owner]);
        }
    }

    /// Every Service at once (a relist): those not listed are gone.
    pub fn replace_services(&self, all: &[Service]) {
        let mut st = self.state.lock().unwrap();
        let new: BTreeMap<Key, Service> =
            all.iter().filter_map(|s| key_of(&s.metadata, "Service").ok().map(|k| (k, s.clone()))).collect();
        let touched: BTreeSet<Key> = st.services.keys().chain(new.keys()).cloned().collect();
        st.services = new;
        self.recompile(&mut st, touched);
    }

    /// Every EndpointSlice at once (a relist).
    pub fn replace_slices(&self, all: &[EndpointSlice]) {
        let mut st = self.state.lock().unwrap();
        let new: BTreeMap<Key, EndpointSlice> =
            all.iter().filter_map(|s| key_of(&s.metadata, "EndpointSlice").ok().map(|k| (k, s.clone()))).collect();
        let mut touched: BTreeSet<Key> = st.slices_of.keys().cloned().collect();
        st.slices_of.clear();
        for (k, s) in &new {
            if let Some(owner) = compile::owner(s) {
                touched.insert(owner.clone());
                st.slices_of.entry(owner).or_default().insert(k.clone());
            }
        }
        st.slices = new;
        self.recompile(&mut st, touched);
    }

    /// Recompile the Services `keys` and record what changed as one new revision.
    fn recompile(&self, st: &mut State, keys: impl IntoIterator<Item = Key>) {
        let mut change = Change::default();
        for key in keys {
            let ports = match st.services.get(&key) {
                None => Vec::new(),
                Some(svc) => {
                    let slices: Vec<&EndpointSlice> =
                        st.slices_of.get(&key).into_iter().flatten().filter_map(|k| st.slices.get(k)).collect();
                    compile::compile(svc, &slices)
                }
            };
            let new_ids: BTreeSet<String> = ports.iter().map(|p| p.id.clone()).collect();
            for old in st.ports_of.remove(&key).unwrap_or_default() {
                if !new_ids.contains(&old) {
                    st.ports.remove(&old);
                    change.removed.push(old);
                }
            }
            for p in ports {
                if st.ports.get(&p.id).is_none_or(|old| **old != p) {
                    let p = Arc::new(p);
                    st.ports.insert(p.id.clone(), p.clone());
                    change.upserts.push(p);
                }
            }
            if !new_ids.is_empty() {
                st.ports_of.insert(key, new_ids);
            }
        }
        if change.upserts.is_empty() && change.removed.is_empty() {
            return;
        }
        st.revision += 1;
        change.revision = st.revision;
        st.history_endpoints += endpoints_of(&change);
        st.history.push_back(Arc::new(change));
        while st.history.len() > HISTORY || (st.history.len() > 1 && st.history_endpoints > HISTORY_ENDPOINTS) {
            let oldest = st.history.pop_front().expect("not empty");
            st.history_endpoints -= endpoints_of(&oldest);
        }
        self.changed.send_replace(st.revision);
    }

    // ----- local mode -----

    /// Apply Services and EndpointSlices given as JSON; answers "Kind namespace/name" each.
    pub fn apply_json(&self, json: &str) -> Result<Vec<String>, ObjectError> {
        self.stage_json(json, true)
    }

    /// Delete the objects named (kind, namespace, name) in `json`.
    pub fn delete_json(&self, json: &str) -> Result<Vec<String>, ObjectError> {
        self.stage_json(json, false)
    }

    fn stage_json(&self, json: &str, apply: bool) -> Result<Vec<String>, ObjectError> {
        let verb = if apply { "apply" } else { "delete" };
        let store = self.store.as_ref().ok_or(ObjectError::NotLocal { what: "Services and EndpointSlices", verb })?;
        let objects = crate::controller::policy::parse_objects(json)?;
        let (mut svcs, mut slices, mut writes, mut done) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for o in &objects {
            let kind = o.get("kind").and_then(|k| k.as_str()).unwrap_or("");
            let decode = |source| ObjectError::Decode { kind: kind.into(), source };
            let (meta, kind, bad_ports) = match kind {
                "Service" => {
                    let s: Service = serde_json::from_value(o.clone()).map_err(decode)?;
                    let why = compile::invalid_ports(Some(&s), None);
                    let m = s.metadata.clone();
                    svcs.push(s);
                    (m, "Service", why)
                }
                "EndpointSlice" => {
                    let s: EndpointSlice = serde_json::from_value(o.clone()).map_err(decode)?;
                    let why = compile::invalid_ports(None, Some(&s));
                    let m = s.metadata.clone();
                    slices.push(s);
                    (m, "EndpointSlice", why)
                }
                other => return Err(ObjectError::Kind(other.into(), "Service or EndpointSlice (applied here)")),
            };
            let (ns, name) = key_of(&meta, kind)?;
            // Applied with a port the API server would refuse: INVALID_ARGUMENT.
            if let Some(reason) = bad_ports.filter(|_| apply) {
                return Err(ObjectError::Invalid { kind, key: format!("{ns}/{name}"), reason });
            }
            let bytes = serde_json::to_vec(o).expect("JSON values serialise");
            writes.push((format!("{kind}/{ns}/{name}"), apply.then_some(bytes)));
            done.push(format!("{kind} {ns}/{name}"));
        }
        store.commit(&writes)?;
        for s in &svcs {
            if apply { self.set_service(s)? } else { self.remove_service(&key_of(&s.metadata, "Service")?) }
        }
        for s in &slices {
            if apply { self.set_slice(s)? } else { self.remove_slice(&key_of(&s.metadata, "EndpointSlice")?) }
        }
        Ok(done)
    }

    /// Every applied object, as a JSON List.
    pub fn list_json(&self) -> Result<String, ObjectError> {
        let store =
            self.store.as_ref().ok_or(ObjectError::NotLocal { what: "Services and EndpointSlices", verb: "list" })?;
        let items: Vec<serde_json::Value> = store.all()?.into_iter().map(|(_, v)| v).collect();
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        Ok(serde_json::to_string_pretty(&list).expect("JSON values serialise"))
    }
}

fn unlink(index: &mut BTreeMap<Key, BTreeSet<Key>>, owner: &Key, slice: &Key) {
    if let Some(set) = index.get_mut(owner) {
        set.remove(slice);
        if set.is_empty() {
            index.remove(owner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn book() -> Arc<ServiceBook> {
        ServiceBook::new(vec!["10.244.0.0/16".into()], None).unwrap()
    }

    fn svc(name: &str, ip: &str) -> Service {
        serde_json::from_value(json!({"metadata": {"namespace": "a", "name": name},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}}))
        .unwrap()
    }

    fn slice(name: &str, svc: &str, ips: &[&str]) -> EndpointSlice {
        let eps: Vec<_> = ips.iter().map(|ip| json!({"addresses": [ip]})).collect();
        serde_json::from_value(json!({"metadata": {"namespace": "a", "name": name,
            "labels": {"kubernetes.io/service-name": svc}}, "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}], "endpoints": eps}))
        .unwrap()
    }

    fn snapshot(b: &ServiceBook) -> BTreeMap<String, pb::ServicePort> {
        match b.follow(0, 0) {
            Start::Snapshot { ports, .. } => ports.into_iter().map(|p| (p.id.clone(), (*p).clone())).collect(),
            Start::Changes(_) => unreachable!("epoch 0 is never the book's"),
        }
    }

    #[test]
    fn each_change_records_only_what_it_changed_and_resumes_from_a_revision() {
        let b = book();
        b.set_service(&svc("web", "10.96.0.10")).unwrap();
        b.set_service(&svc("db", "10.96.0.11")).unwrap();
        let r = b.revision();
        b.set_slice(&slice("web-1", "web", &["10.244.0.5"])).unwrap();
        b.set_slice(&slice("web-1", "web", &["10.244.0.5"])).unwrap(); // the same: no revision
        b.remove_service(&("a".into(), "db".into()));
        assert_eq!(b.revision(), r + 2);
        let Start::Changes(changes) = b.follow(b.epoch, r) else { panic!("a resume") };
        assert_eq!(changes.len(), 2);
        assert_eq!(changes[0].upserts.len(), 1);
        assert_eq!(changes[0].upserts[0].endpoints[0].ip, "10.244.0.5");
        assert_eq!(changes[1].removed, vec!["a/db/TCP/http".to_string()]);
        assert!(matches!(b.follow(b.epoch + 1, r), Start::Snapshot { .. }), "another epoch: a snapshot");
        assert!(matches!(b.follow(b.epoch, b.revision() + 5), Start::Snapshot { .. }), "a revision never had");
        assert_eq!(snapshot(&b).len(), 1);
    }

    #[test]
    fn a_relist_drops_what_it_does_not_list_and_keeps_the_rest_unchanged() {
        let b = book();
        b.replace_services(&[svc("web", "10.96.0.10"), svc("db", "10.96.0.11")]);
        b.replace_slices(&[slice("web-1", "web", &["10.244.0.5"]), slice("db-1", "db", &["10.244.0.6"])]);
        let r = b.revision();
        b.replace_slices(&[slice("web-1", "web", &["10.244.0.5"])]);
        let Start::Changes(c) = b.follow(b.epoch, r) else { panic!() };
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].upserts.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(), vec!["a/db/TCP/http"]);
        assert!(snapshot(&b)["a/db/TCP/http"].endpoints.is_empty());
    }

    #[test]
    fn local_mode_refuses_a_port_the_api_would_and_keeps_nothing() {
        let dir = crate::util::TestDir::new("svc-ports");
        let b = ServiceBook::new(vec!["10.244.0.0/16".into()], Some(dir.0.join("objects.redb"))).unwrap();
        let bad = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "a", "name": "web"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.0.10", "ports": [{"port": 80, "nodePort": 70000}]}});
        let err = b.apply_json(&bad.to_string()).unwrap_err();
        assert!(matches!(err, ObjectError::Invalid { .. }), "{err:?}");
        assert_eq!(err.to_string(), "Service a/web: nodePort 70000 is not in 1-65535");
        assert!(snapshot(&b).is_empty(), "nothing reaches the nodes");
        assert!(!b.list_json().unwrap().contains("web"), "nothing is stored");
        b.delete_json(&bad.to_string()).unwrap();
    }

    #[test]
    fn history_is_bounded_and_an_old_revision_gets_a_snapshot() {
        let b = book();
        for i in 0..(HISTORY + 10) {
            b.set_service(&svc("web", &format!("10.96.{}.{}", i / 250, i % 250 + 1))).unwrap();
        }
        assert!(matches!(b.follow(b.epoch, 1), Start::Snapshot { .. }));
        assert!(matches!(b.follow(b.epoch, b.revision() - 10), Start::Changes(c) if c.len() == 10));
    }

    #[test]
    fn history_holds_a_bounded_number_of_endpoints() {
        let b = book();
        b.set_service(&svc("web", "10.96.0.10")).unwrap();
        let ips: Vec<String> = (0..10_000).map(|i| format!("10.244.{}.{}", i / 250, i % 250 + 1)).collect();
        let refs: Vec<&str> = ips.iter().map(String::as_str).collect();
        let first = b.revision();
        let rounds = HISTORY_ENDPOINTS / 10_000 + 2;
        for r in 0..rounds {
            // A rolling update: the Service's one slice changes, whole, every time.
            b.set_slice(&slice("web-1", "web", &refs[..10_000 - r])).unwrap();
        }
        let Start::Changes(kept) = b.follow(b.epoch, b.revision() - 3) else { panic!("recent: changes") };
        assert_eq!(kept.len(), 3);
        assert!(matches!(b.follow(b.epoch, first), Start::Snapshot { .. }), "the oldest went for their size");
        let held: usize = b.state.lock().unwrap().history.iter().map(|c| endpoints_of(c)).sum();
        assert!(held <= HISTORY_ENDPOINTS, "{held}");
    }
}
