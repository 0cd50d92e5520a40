//! Node deletion releases the node's blocks: the controller follows the cluster's Node
//! objects and removes a registered node once its Node object is gone.
//!
//! Deletions are seen two ways, because a watch can miss them (while it is down, or when the
//! API server answers 410 Gone and the watcher starts over with a fresh list): a Delete
//! event, and the end of every (re)list, where each registered node that the complete list
//! does not contain, and that a fresh read confirms is gone, is removed.
//!
//! Registration follows the Node objects too ([`NodeGate`]): an agent whose Node was deleted
//! keeps running until its pod is evicted, and would otherwise register again at once and
//! bring back the records and blocks of a node that does not exist. Register is refused
//! (FAILED_PRECONDITION) for a node without a Node object or with one being deleted; the
//! agent keeps retrying with backoff and serving its pods from its persisted blocks.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_stream::StreamExt;

use crate::controller::store::Registry;

/// Why a registration was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdmitError {
    /// No Node object, or one being deleted.
    Refused(String),
    /// The API could not be asked.
    Unavailable(String),
}

#[derive(Default)]
struct GateState {
    /// Nodes seen present and not being deleted.
    present: HashSet<String>,
    /// Nodes seen deleted, missing or being deleted (since this process started).
    gone: HashSet<String>,
}

/// What the controller knows of the cluster's Node objects, for admitting registrations:
/// kept up to date by [`follow`]; a node it knows nothing about is read from the API.
pub struct NodeGate {
    api: Api<Node>,
    st: Mutex<GateState>,
}

fn gone_message(name: &str) -> String {
    format!(
        "node {name:?} has no Node object in the cluster (deleted?): a node registers only while its Node object \
         exists; this agent keeps its pods on their persisted blocks and retries"
    )
}

fn deleting_message(name: &str) -> String {
    format!("node {name:?}'s Node object is being deleted: the node may not register")
}

impl NodeGate {
    pub fn new(client: kube::Client) -> Arc<Self> {
        Arc::new(NodeGate { api: Api::all(client), st: Mutex::new(GateState::default()) })
    }

    fn seen(&self, n: &Node) {
        let Some(name) = n.metadata.name.clone() else { return };
        let mut st = self.st.lock().unwrap();
        if n.metadata.deletion_timestamp.is_some() {
            st.present.remove(&name);
            st.gone.insert(name);
        } else {
            st.gone.remove(&name);
            st.present.insert(name);
        }
    }

    fn gone(&self, name: &str) {
        let mut st = self.st.lock().unwrap();
        st.present.remove(name);
        st.gone.insert(name.to_string());
    }

    /// After a complete list: a node not in it is not known present any more (the next
    /// registration reads it from the API).
    fn listed(&self, present: &HashSet<String>) {
        self.st.lock().unwrap().present.retain(|n| present.contains(n));
    }

    /// Why `name` may not register, from what is known (never blocks): only a node known to
    /// be gone or being deleted is refused here.
    pub fn refused(&self, name: &str) -> Option<String> {
        self.st.lock().unwrap().gone.contains(name).then(|| gone_message(name))
    }

    /// May `name` register? From what is known, else from a read of its Node object.
    pub async fn admit(&self, name: &str) -> Result<(), AdmitError> {
        {
            let st = self.st.lock().unwrap();
            if st.present.contains(name) {
                return Ok(());
            }
        }
        match self.api.get_opt(name).await {
            Ok(Some(n)) => {
                self.seen(&n);
                if n.metadata.deletion_timestamp.is_some() {
                    Err(AdmitError::Refused(deleting_message(name)))
                } else {
                    Ok(())
                }
            }
            Ok(None) => {
                self.gone(name);
                Err(AdmitError::Refused(gone_message(name)))
            }
            Err(e) => Err(AdmitError::Unavailable(format!("reading Node {name:?} to admit its registration: {e}"))),
        }
    }
}

async fn release(registry: &Arc<Registry>, name: String, why: &'static str) {
    if registry.get(&name).is_none() {
        return;
    }
    let reg = registry.clone();
    let n = name.clone();
    match tokio::task::spawn_blocking(move || reg.remove(&n)).await {
        Ok(Ok(blocks)) => {
            tracing::info!(node = %name, released = ?blocks, why, "Node object gone: node removed, blocks released")
        }
        Ok(Err(e)) => tracing::warn!(node = %name, error = %e, "could not remove a deleted node"),
        Err(e) => tracing::warn!(node = %name, error = %e, "node removal task failed"),
    }
}

/// Follow Node objects until `stop` turns true.
pub async fn follow(
    client: kube::Client,
    registry: Arc<Registry>,
    gate: Arc<NodeGate>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let api: Api<Node> = Api::all(client);
    // Listed in pages, then watched with bookmarks (a relist after a 410 resumes from the last one).
    let config = watcher::Config::default().page_size(super::LIST_PAGE);
    let mut events = std::pin::pin!(watcher(api.clone(), config).default_backoff());
    let mut listed: Option<HashSet<String>> = None;
    loop {
        let ev = tokio::select! {
            ev = events.next() => ev,
            _ = stop.wait_for(|s| *s) => return,
        };
        match ev {
            None => return,
            Some(Err(e)) => tracing::warn!(error = %e, "watching Node objects (retrying with backoff)"),
            Some(Ok(watcher::Event::Init)) => listed = Some(HashSet::new()),
            Some(Ok(watcher::Event::InitApply(n))) => {
                gate.seen(&n);
                if let (Some(l), Some(name)) = (listed.as_mut(), n.metadata.name) {
                    l.insert(name);
                }
            }
            Some(Ok(watcher::Event::InitDone)) => {
                let Some(present) = listed.take() else { continue };
                gate.listed(&present);
                if present.is_empty() {
                    // A cluster without a single Node object is far likelier a broken
                    // permission or API than real: never sweep the registry on it.
                    tracing::warn!("the Node list is empty; not removing any registered node");
                    continue;
                }
                for rec in registry.snapshot().nodes.iter() {
                    if present.contains(&rec.name) {
                        continue;
                    }
                    // The list may predate this node's registration (a long relist): only
                    // a Node the API says is gone now is released.
                    match api.get_opt(&rec.name).await {
                        Ok(None) => {
                            gate.gone(&rec.name);
                            release(&registry, rec.name.clone(), "absent from the Node list").await
                        }
                        Ok(Some(_)) => {}
                        Err(e) => {
                            tracing::warn!(node = %rec.name, error = %e, "could not confirm a Node is gone; keeping it")
                        }
                    }
                }
            }
            Some(Ok(watcher::Event::Apply(n))) => gate.seen(&n),
            Some(Ok(watcher::Event::Delete(n))) => {
                if let Some(name) = n.metadata.name {
                    // Gone first, then released: a registration admitted before cannot commit
                    // after the release (the registry asks the gate under its lock).
                    gate.gone(&name);
                    release(&registry, name, "Node deleted").await;
                }
            }
        }
    }
}
