//! A book fed from the API: one watch per kind of object, relisting on a 410 Gone or a broken
//! connection. A complete list replaces what the book held of that kind, so a deletion
//! missed while the watch was down is not kept.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use k8s_openapi::serde::de::DeserializeOwned;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_stream::StreamExt;

/// What a book `B` needs of one kind of object.
pub trait Feed<B>:
    Clone + std::fmt::Debug + DeserializeOwned + kube::Resource<DynamicType = ()> + Send + Sync + 'static
{
    const KIND: &'static str;
    fn set(book: &B, o: &Self) -> Result<(), crate::controller::policy::model::ObjectError>;
    fn remove(book: &B, o: &Self);
    fn replace(book: &B, all: &[Self]);
}

/// `(namespace, name)` of an object the API sent.
pub fn key_of(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> (String, String) {
    (m.namespace.clone().unwrap_or_default(), m.name.clone().unwrap_or_default())
}

/// Counts the kinds a book waits for: once each has been listed the first time, `done` runs
/// (the book then holds every object).
pub struct Listed {
    left: AtomicUsize,
    done: Box<dyn Fn() + Send + Sync>,
}

impl Listed {
    pub fn new(kinds: usize, done: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Listed { left: AtomicUsize::new(kinds), done: Box::new(done) })
    }

    fn one(&self) {
        if self.left.fetch_sub(1, Ordering::SeqCst) == 1 {
            (self.done)();
        }
    }
}

/// Follow one kind into `book` until `stop`; `listed` hears of its first complete list.
pub async fn follow_kind<B, K>(
    api: Api<K>,
    book: Arc<B>,
    listed: Arc<Listed>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    B: Send + Sync + 'static,
    K: Feed<B>,
{
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
                    if std::mem::take(&mut first) {
                        listed.one();
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
