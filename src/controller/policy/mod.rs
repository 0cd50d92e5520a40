//! Kubernetes NetworkPolicy, the controller's half: the objects policy is computed from
//! (Namespaces, Pods, NetworkPolicies — watched from the API in Kubernetes mode, applied as
//! JSON in local mode), the pods the agents attached, and each node's compiled view
//! (`compile`), streamed to the node as a snapshot, then changes (`server`).
//!
//! Every change recompiles and compares each node's view with the one before: a node whose
//! view changed gets a new revision (the book's counter, strictly increasing), and its
//! streams send what differs from what they sent last. A slow stream therefore never holds
//! anyone up and never falls behind by more than one comparison.

pub mod compile;
pub mod model;
pub mod server;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;

use compile::NodeView;
use model::{Attached, Key, ObjectError, Objects};

/// A node's current view and the revision at which it last changed.
#[derive(Debug, Clone, Default)]
pub struct Versioned {
    pub revision: u64,
    pub view: Arc<NodeView>,
}

#[derive(Default)]
struct State {
    objects: Objects,
    views: BTreeMap<String, Versioned>,
    revision: u64,
}

/// The policy book: objects, attachments and every node's compiled view.
pub struct PolicyBook {
    state: Mutex<State>,
    changed: tokio::sync::watch::Sender<u64>,
    /// Whether the book holds every object: from the start in local mode; in Kubernetes mode
    /// once each kind has been listed from the API ([`PolicyBook::mark_complete`]). Before
    /// that, a pod a policy selects would look not isolated and a node's view would lack the
    /// policy, so the answers to agents wait for it.
    complete: tokio::sync::watch::Sender<bool>,
    /// Local mode: where applied objects are kept across restarts.
    file: Option<PathBuf>,
    /// Time of each recompilation (seconds), for the controller's metrics.
    pub compile_seconds: crate::obs::metrics::Histogram,
}

/// Objects applied in local mode, as stored.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Stored {
    namespaces: Vec<Namespace>,
    pods: Vec<Pod>,
    policies: Vec<NetworkPolicy>,
}

impl PolicyBook {
    /// `file`: local mode's store of applied objects (loaded now); `None` in Kubernetes mode.
    pub fn new(file: Option<PathBuf>) -> Result<Arc<Self>, ObjectError> {
        let (changed, _) = tokio::sync::watch::channel(0);
        let (complete, _) = tokio::sync::watch::channel(file.is_some());
        let book = PolicyBook {
            state: Mutex::new(State::default()),
            changed,
            complete,
            file,
            compile_seconds: crate::obs::metrics::step_histogram(),
        };
        if book.file.is_some() {
            let stored = book.stored("apply")?;
            let mut st = book.state.lock().unwrap();
            for n in &stored.namespaces {
                st.objects.set_namespace(n)?;
            }
            for p in &stored.pods {
                st.objects.set_pod(p)?;
            }
            for p in &stored.policies {
                st.objects.set_policy(p)?;
            }
        }
        Ok(Arc::new(book))
    }

    /// Kubernetes mode: every kind of object has been listed once.
    pub fn mark_complete(&self) {
        self.complete.send_replace(true);
    }

    /// Returns once the book holds every object (see `complete`).
    pub async fn until_complete(&self) {
        let _ = self.complete.subscribe().wait_for(|c| *c).await;
    }

    /// Wakes whenever some node's view changed.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The node's current view (an empty one, revision 0, for a node without any).
    pub fn view(&self, node: &str) -> Versioned {
        self.state.lock().unwrap().views.get(node).cloned().unwrap_or_default()
    }

    /// Change the objects (under the lock), then recompile and publish.
    pub(crate) fn change<T>(&self, f: impl FnOnce(&mut Objects) -> T) -> T {
        let mut st = self.state.lock().unwrap();
        let out = f(&mut st.objects);
        let started = std::time::Instant::now();
        let new = compile::compile(&st.objects);
        self.compile_seconds.observe(started.elapsed().as_secs_f64());
        let mut changed = false;
        let nodes: Vec<String> =
            st.views.keys().chain(new.keys()).cloned().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        let next = st.revision + 1;
        for node in nodes {
            let view = new.get(&node).cloned().unwrap_or_default();
            let same = st.views.get(&node).is_some_and(|v| *v.view == view);
            if !same {
                st.views.insert(node, Versioned { revision: next, view: Arc::new(view) });
                changed = true;
            }
        }
        if changed {
            st.revision = next;
            self.changed.send_replace(next);
        }
        out
    }

    // ----- the agents -----

    /// A pod attached on `node`. Returns the node's revision that includes it, and whether
    /// a policy isolates it.
    pub fn pod_started(&self, node: &str, key: Key, ips: Vec<std::net::IpAddr>) -> (u64, bool) {
        let text = model::key_text(&key);
        self.change(|o| {
            o.attached.insert(key, Attached { node: node.to_string(), ips });
        });
        let v = self.view(node);
        (v.revision, v.view.isolates(&text))
    }

    pub fn pod_stopped(&self, node: &str, key: &Key) {
        self.change(|o| {
            if o.attached.get(key).is_some_and(|a| a.node == node) {
                o.attached.remove(key);
            }
        });
    }

    /// Everything `node` holds now: its other pods are forgotten.
    pub fn report_pods(&self, node: &str, pods: Vec<(Key, Vec<std::net::IpAddr>)>) {
        self.change(|o| {
            o.attached.retain(|_, a| a.node != node);
            for (k, ips) in pods {
                o.attached.insert(k, Attached { node: node.to_string(), ips });
            }
        });
    }

    /// A node left the registry: its pods go. Its blocks return to the pools, and a pod of
    /// another node may be given one of its addresses.
    pub fn forget_node(&self, node: &str) {
        self.change(|o| o.attached.retain(|_, a| a.node != node));
    }

    // ----- the objects (local mode; the Kubernetes watches change them in `kube::policy`) -----

    /// Local mode: apply objects given as JSON (one object, a `List`, or several documents).
    /// All are checked before any is applied. Returns "Kind namespace/name" of each.
    pub fn apply_json(&self, json: &str) -> Result<Vec<String>, ObjectError> {
        self.stage_json(json, true)
    }

    /// Local mode: delete the objects named (kind, namespace, name) in `json`.
    pub fn delete_json(&self, json: &str) -> Result<Vec<String>, ObjectError> {
        self.stage_json(json, false)
    }

    fn stage_json(&self, json: &str, apply: bool) -> Result<Vec<String>, ObjectError> {
        let mut stored = self.stored(if apply { "apply" } else { "delete" })?;
        let objects = parse_objects(json)?;
        let mut staged = self.state.lock().unwrap().objects.clone();
        let mut done = Vec::new();
        for obj in &objects {
            done.push(stage(&mut staged, &mut stored, obj, apply)?);
        }
        self.save(&stored)?;
        self.change(|o| {
            o.namespaces = staged.namespaces;
            o.pods = staged.pods;
            o.policies = staged.policies;
        });
        Ok(done)
    }

    /// Every applied object (local mode), as a JSON List (each object says its apiVersion
    /// and kind: k8s-openapi writes them).
    pub fn list_json(&self) -> Result<String, ObjectError> {
        let s = self.stored("list")?;
        let items: Vec<serde_json::Value> = (s.namespaces.iter().map(serde_json::to_value))
            .chain(s.pods.iter().map(serde_json::to_value))
            .chain(s.policies.iter().map(serde_json::to_value))
            .map(Result::unwrap_or_default)
            .collect();
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        Ok(serde_json::to_string_pretty(&list).expect("JSON values serialise"))
    }

    /// The objects applied (local mode; in Kubernetes mode an error says to `verb` with kubectl).
    fn stored(&self, verb: &'static str) -> Result<Stored, ObjectError> {
        let what = "NetworkPolicies, Pods and Namespaces";
        let f = self.file.as_ref().ok_or(ObjectError::NotLocal { what, verb })?;
        let file = |source| ObjectError::File { path: f.clone(), source };
        match std::fs::read(f) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| file(e.into())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Stored::default()),
            Err(e) => Err(file(e)),
        }
    }

    fn save(&self, s: &Stored) -> Result<(), ObjectError> {
        let f = self.file.as_ref().expect("stored() was read first");
        let body = serde_json::to_vec_pretty(s).expect("objects serialise");
        crate::sys::fs::atomic_write(f, &body, 0o600).map_err(|source| ObjectError::File { path: f.clone(), source })
    }
}

/// The objects in a JSON text: one object, a List, or several documents one after another.
pub(crate) fn parse_objects(json: &str) -> Result<Vec<serde_json::Value>, ObjectError> {
    let mut out = Vec::new();
    for doc in serde_json::Deserializer::from_str(json).into_iter::<serde_json::Value>() {
        let v = doc.map_err(ObjectError::NotJson)?;
        match v.get("kind").and_then(|k| k.as_str()) {
            Some("List") => out.extend(v.get("items").and_then(|i| i.as_array()).cloned().unwrap_or_default()),
            _ => out.push(v),
        }
    }
    if out.is_empty() {
        return Err(ObjectError::NoObjects);
    }
    Ok(out)
}

/// Apply (or delete) one object in `o` and in `stored`.
fn stage(o: &mut Objects, stored: &mut Stored, obj: &serde_json::Value, apply: bool) -> Result<String, ObjectError> {
    let kind = obj.get("kind").and_then(|k| k.as_str()).unwrap_or("");
    let bad = |source| ObjectError::Decode { kind: kind.into(), source };
    match kind {
        "Namespace" => {
            let n: Namespace = serde_json::from_value(obj.clone()).map_err(bad)?;
            let name = n.metadata.name.clone().ok_or(ObjectError::NoName("Namespace"))?;
            stored.namespaces.retain(|x| x.metadata.name.as_deref() != Some(&name));
            if apply {
                o.set_namespace(&n)?;
                stored.namespaces.push(n);
            } else {
                o.namespaces.remove(&name);
            }
            Ok(format!("Namespace {name}"))
        }
        "Pod" => {
            let p: Pod = serde_json::from_value(obj.clone()).map_err(bad)?;
            let key = model::object_key(&p.metadata, "Pod")?;
            stored.pods.retain(|x| model::object_key(&x.metadata, "Pod").ok().as_ref() != Some(&key));
            if apply {
                o.set_pod(&p)?;
                stored.pods.push(p);
            } else {
                o.pods.remove(&key);
            }
            Ok(format!("Pod {}", model::key_text(&key)))
        }
        "NetworkPolicy" => {
            let p: NetworkPolicy = serde_json::from_value(obj.clone()).map_err(bad)?;
            let key = model::object_key(&p.metadata, "NetworkPolicy")?;
            stored.policies.retain(|x| model::object_key(&x.metadata, "NetworkPolicy").ok().as_ref() != Some(&key));
            if apply {
                o.set_policy(&p)?;
                stored.policies.push(p);
            } else {
                o.policies.remove(&key);
            }
            Ok(format!("NetworkPolicy {}", model::key_text(&key)))
        }
        other => Err(ObjectError::Kind(other.into(), "Namespace, Pod or NetworkPolicy")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_objects_say_their_api_version_and_kind() {
        let dir = crate::util::TestDir::new("policy-list-json");
        let book = PolicyBook::new(Some(dir.0.join("objects.json"))).unwrap();
        let json = r#"{"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "web"}},
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": "web", "name": "a"}},
            {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": {"namespace": "web", "name": "deny"}, "spec": {"podSelector": {}}}
        ]}"#;
        assert_eq!(book.apply_json(json).unwrap(), ["Namespace web", "Pod web/a", "NetworkPolicy web/deny"]);
        let list: serde_json::Value = serde_json::from_str(&book.list_json().unwrap()).unwrap();
        assert_eq!((list["apiVersion"].as_str(), list["kind"].as_str()), (Some("v1"), Some("List")));
        let items: Vec<(&str, &str)> = list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| (i["apiVersion"].as_str().unwrap(), i["kind"].as_str().unwrap()))
            .collect();
        assert_eq!(items, [("v1", "Namespace"), ("v1", "Pod"), ("networking.k8s.io/v1", "NetworkPolicy")]);
    }
}
