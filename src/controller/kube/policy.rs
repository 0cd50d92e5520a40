//! NetworkPolicy in a cluster: the controller watches NetworkPolicies, Pods and Namespaces
//! (its RBAC: get/list/watch on each; the agents need none) and feeds the policy book.
//! Each watch relists on a 410 Gone or a broken connection: a complete list replaces what
//! the book held of that kind, so a deletion missed while the watch was down is not kept.
//! The book is marked complete once each kind has been listed: the agents' answers wait
//! for that (a controller just started knows no policy yet).

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;

use super::feed::{Feed, Listed, follow_kind, key_of};
use crate::controller::policy::PolicyBook;
use crate::controller::policy::model::ObjectError;

impl Feed<PolicyBook> for Namespace {
    const KIND: &'static str = "Namespace";
    fn set(book: &PolicyBook, n: &Self) -> Result<(), ObjectError> {
        book.change(|o| o.set_namespace(n).map(|_| ()))
    }
    fn remove(book: &PolicyBook, n: &Self) {
        book.change(|o| o.namespaces.remove(n.metadata.name.as_deref().unwrap_or_default()));
    }
    fn replace(book: &PolicyBook, all: &[Self]) {
        book.change(|o| {
            o.namespaces.clear();
            for n in all {
                let _ = o.set_namespace(n);
            }
        })
    }
}

impl Feed<PolicyBook> for Pod {
    const KIND: &'static str = "Pod";
    fn set(book: &PolicyBook, p: &Self) -> Result<(), ObjectError> {
        book.change(|o| o.set_pod(p).map(|_| ()))
    }
    fn remove(book: &PolicyBook, p: &Self) {
        book.change(|o| o.pods.remove(&key_of(&p.metadata)));
    }
    fn replace(book: &PolicyBook, all: &[Self]) {
        book.change(|o| {
            o.pods.clear();
            for p in all {
                let _ = o.set_pod(p);
            }
        })
    }
}

impl Feed<PolicyBook> for NetworkPolicy {
    const KIND: &'static str = "NetworkPolicy";
    fn set(book: &PolicyBook, p: &Self) -> Result<(), ObjectError> {
        book.change(|o| o.set_policy(p).map(|_| ()))
    }
    fn remove(book: &PolicyBook, p: &Self) {
        book.change(|o| o.policies.remove(&key_of(&p.metadata)));
    }
    fn replace(book: &PolicyBook, all: &[Self]) {
        book.change(|o| {
            o.policies.clear();
            for p in all {
                if let Err(e) = o.set_policy(p) {
                    tracing::warn!(error = %e, "ignoring a NetworkPolicy");
                }
            }
        })
    }
}

/// Follow the three kinds until `stop`. The book is complete once each has been listed.
pub async fn follow(client: kube::Client, book: Arc<PolicyBook>, stop: tokio::sync::watch::Receiver<bool>) {
    let b = book.clone();
    let listed = Listed::new(3, move || b.mark_complete());
    tokio::join!(
        follow_kind::<_, Namespace>(Api::all(client.clone()), book.clone(), listed.clone(), stop.clone()),
        follow_kind::<_, Pod>(Api::all(client.clone()), book.clone(), listed.clone(), stop.clone()),
        follow_kind::<_, NetworkPolicy>(Api::all(client), book, listed, stop),
    );
}
