//! NetworkPolicy in a cluster: the controller watches NetworkPolicies, Pods and Namespaces
//! (its RBAC: get/list/watch on each; the agents need none) and feeds the policy book.
//! Each watch relists on a 410 Gone or a broken connection: a complete list replaces what
//! the book held of that kind, so a deletion missed while the watch was down is not kept.
//! The book is marked complete once each kind has been listed: the agents' answers wait
//! for that (a controller just started knows no policy yet).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::serde::de::DeserializeOwned;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_stream::StreamExt;

use crate::controller::policy::PolicyBook;

/// What the book needs of each kind of object.
trait Feed: Clone + std::fmt::Debug + DeserializeOwned + kube::Resource<DynamicType = ()> + Send + Sync + 'static {
    const KIND: &'static str;
    fn set(book: &PolicyBook, o: &Self) -> Result<(), String>;
    fn remove(book: &PolicyBook, o: &Self);
    fn replace(book: &PolicyBook, all: &[Self]);
}

fn key_of(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> (String, String) {
    (m.namespace.clone().unwrap_or_default(), m.name.clone().unwrap_or_default())
}

impl Feed for Namespace {
    const KIND: &'static str = "Namespace";
    fn set(book: &PolicyBook, o: &Self) -> Result<(), String> {
        book.set_namespace(o)
    }
    fn remove(book: &PolicyBook, o: &Self) {
        book.remove_namespace(o.metadata.name.as_deref().unwrap_or_default())
    }
    fn replace(book: &PolicyBook, all: &[Self]) {
        book.replace_all(Some(all), None, None)
    }
}

impl Feed for Pod {
    const KIND: &'static str = "Pod";
    fn set(book: &PolicyBook, o: &Self) -> Result<(), String> {
        book.set_pod(o)
    }
    fn remove(book: &PolicyBook, o: &Self) {
        book.remove_pod(&key_of(&o.metadata))
    }
    fn replace(book: &PolicyBook, all: &[Self]) {
        book.replace_all(None, Some(all), None)
    }
}

impl Feed for NetworkPolicy {
    const KIND: &'static str = "NetworkPolicy";
    fn set(book: &PolicyBook, o: &Self) -> Result<(), String> {
        book.set_policy(o)
    }
    fn remove(book: &PolicyBook, o: &Self) {
        book.remove_policy(&key_of(&o.metadata))
    }
    fn replace(book: &PolicyBook, all: &[Self]) {
        book.replace_all(None, None, Some(all))
    }
}

/// Follow the three kinds until `stop`. The book is complete once each has been listed.
pub async fn follow(client: kube::Client, book: Arc<PolicyBook>, stop: tokio::sync::watch::Receiver<bool>) {
    let listed = Arc::new(AtomicUsize::new(0));
    tokio::join!(
        follow_kind::<Namespace>(Api::all(client.clone()), book.clone(), listed.clone(), stop.clone()),
        follow_kind::<Pod>(Api::all(client.clone()), book.clone(), listed.clone(), stop.clone()),
        follow_kind::<NetworkPolicy>(Api::all(client), book, listed, stop),
    );
}

/// The kinds [`follow`] lists.
const KINDS: usize = 3;

async fn follow_kind<K: Feed>(
    api: Api<K>,
    book: Arc<PolicyBook>,
    listed: Arc<AtomicUsize>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut first = true;
    // Pages of 500 on every (re)list (bookmarks are on by default).
    let config = watcher::Config::default().page_size(super::LIST_PAGE);
    let mut events = std::pin::pin!(watcher(api, config).default_backoff());
    let mut listing: Option<Vec<K>> = None;
    loop {
        let ev = tokio::select! {
            ev = events.next() => ev,
            _ = stop.wait_for(|s| *s) => return,
        };
        let b = book.clone();
        match ev {
            None => return,
            Some(Err(e)) => tracing::warn!(kind = K::KIND, error = %e, "watching (retrying with backoff)"),
            Some(Ok(watcher::Event::Init)) => listing = Some(Vec::new()),
            Some(Ok(watcher::Event::InitApply(o))) => {
                if let Some(l) = listing.as_mut() {
                    l.push(o);
                }
            }
            Some(Ok(watcher::Event::InitDone)) => {
                if let Some(all) = listing.take() {
                    let n = all.len();
                    let _ = tokio::task::spawn_blocking(move || K::replace(&b, &all)).await;
                    tracing::info!(kind = K::KIND, objects = n, "listed");
                    if std::mem::take(&mut first) && listed.fetch_add(1, Ordering::SeqCst) + 1 == KINDS {
                        book.mark_complete();
                    }
                }
            }
            Some(Ok(watcher::Event::Apply(o))) => {
                let r = tokio::task::spawn_blocking(move || K::set(&b, &o)).await;
                if let Ok(Err(e)) = r {
                    tracing::warn!(kind = K::KIND, error = %e, "ignoring an object");
                }
            }
            Some(Ok(watcher::Event::Delete(o))) => {
                let _ = tokio::task::spawn_blocking(move || K::remove(&b, &o)).await;
            }
        }
    }
}
