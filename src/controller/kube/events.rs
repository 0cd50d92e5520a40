//! Events on Node objects, for what an operator should see in `kubectl describe node`:
//! a node's storage pool running short, and having room again.
//!
//! Agents hold no API credentials, so the controller posts these from the nodes' reports.
//! Events of a cluster-scoped object live in the `default` namespace, as kubelet's do.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use crate::controller::volumes::PoolChange;
use crate::storage::store::POOL_SHORT_PERCENT;

/// Posts events about nodes.
pub struct NodeEvents {
    recorder: Recorder,
}

impl NodeEvents {
    /// `instance`: this controller's pod name, when known.
    pub fn new(client: kube::Client, instance: Option<String>) -> NodeEvents {
        let reporter = Reporter { controller: "nodeplane-controller".into(), instance };
        NodeEvents { recorder: Recorder::new(client, reporter) }
    }

    /// Post a pool's change on its node.
    pub async fn pool(&self, node: &str, change: PoolChange) -> Result<(), kube::Error> {
        self.recorder.publish(&pool_event(change), &node_ref(node)).await
    }
}

fn pool_event(change: PoolChange) -> Event {
    let backend = change.backend.as_str();
    let (type_, reason, note) = if change.short {
        let note = format!(
            "The {backend} pool is at least {POOL_SHORT_PERCENT}% full (data or metadata). No new volume is \
             placed on it; the volumes in it keep working."
        );
        (EventType::Warning, "StoragePoolShort", note)
    } else {
        (EventType::Normal, "StoragePoolRecovered", format!("The {backend} pool has room again."))
    };
    Event { type_, reason: reason.into(), note: Some(note), action: "PlaceVolumes".into(), secondary: None }
}

/// A Node, named as kubelet names it in its events (its name as the UID), which
/// `kubectl describe node` looks for.
fn node_ref(node: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.into()),
        uid: Some(node.into()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::records::StoreBackend;

    #[test]
    fn short_is_a_warning_and_recovery_is_normal() {
        let short = pool_event(PoolChange { backend: StoreBackend::Lvm, short: true });
        assert_eq!((short.type_, short.reason.as_str()), (EventType::Warning, "StoragePoolShort"));
        assert!(short.note.unwrap().contains("lvm pool is at least 90% full"));
        let back = pool_event(PoolChange { backend: StoreBackend::Lvm, short: false });
        assert_eq!((back.type_, back.reason.as_str()), (EventType::Normal, "StoragePoolRecovered"));
        let r = node_ref("n1");
        assert_eq!((r.kind.as_deref(), r.name.as_deref(), r.namespace), (Some("Node"), Some("n1"), None));
    }
}
