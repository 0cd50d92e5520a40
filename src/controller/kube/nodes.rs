//! Node deletion releases the node's blocks: the controller follows the cluster's Node
//! objects and removes a registered node once its Node object is gone.
//!
//! Deletions are seen two ways, because a watch can miss them (while it is down, or when the
//! API server answers 410 Gone and the watcher starts over with a fresh list): a Delete
//! event, and the end of every (re)list, where each registered node that the complete list
//! does not contain, and that a fresh read confirms is gone, is removed.

use std::collections::HashSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_stream::StreamExt;

use crate::controller::store::Registry;

async fn release(registry: &Arc<Registry>, name: String, why: &'static str) {
    if registry.get(&name).is_none() {
        return;
    }
    let reg = registry.clone();
    let n = name.clone();
    match tokio::task::spawn_blocking(move || reg.remove(&n)).await {
        Ok(Ok(blocks)) => tracing::info!(node = %name, released = ?blocks, why, "Node object gone: node removed, blocks released"),
        Ok(Err(e)) => tracing::warn!(node = %name, error = %e, "could not remove a deleted node"),
        Err(e) => tracing::warn!(node = %name, error = %e, "node removal task failed"),
    }
}

/// Follow Node objects until `stop` turns true.
pub async fn follow(client: kube::Client, registry: Arc<Registry>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let api: Api<Node> = Api::all(client);
    let mut events = std::pin::pin!(watcher(api.clone(), watcher::Config::default()).default_backoff());
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
                if let (Some(l), Some(name)) = (listed.as_mut(), n.metadata.name) {
                    l.insert(name);
                }
            }
            Some(Ok(watcher::Event::InitDone)) => {
                let Some(present) = listed.take() else { continue };
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
                        Ok(None) => release(&registry, rec.name.clone(), "absent from the Node list").await,
                        Ok(Some(_)) => {}
                        Err(e) => tracing::warn!(node = %rec.name, error = %e, "could not confirm a Node is gone; keeping it"),
                    }
                }
            }
            Some(Ok(watcher::Event::Apply(_))) => {}
            Some(Ok(watcher::Event::Delete(n))) => {
                if let Some(name) = n.metadata.name {
                    release(&registry, name, "Node deleted").await;
                }
            }
        }
    }
}
