//! Services in a cluster: the controller watches Services and EndpointSlices (its RBAC:
//! list/watch on each; the agents need none) and feeds the service book.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;

use super::feed::{Feed, Listed, follow_kind, key_of};
use crate::controller::policy::model::ObjectError;
use crate::controller::services::ServiceBook;

impl Feed<ServiceBook> for Service {
    const KIND: &'static str = "Service";
    fn set(book: &ServiceBook, o: &Self) -> Result<(), ObjectError> {
        book.set_service(o)
    }
    fn remove(book: &ServiceBook, o: &Self) {
        book.remove_service(&key_of(&o.metadata))
    }
    fn replace(book: &ServiceBook, all: &[Self]) {
        book.replace_services(all)
    }
}

impl Feed<ServiceBook> for EndpointSlice {
    const KIND: &'static str = "EndpointSlice";
    fn set(book: &ServiceBook, o: &Self) -> Result<(), ObjectError> {
        book.set_slice(o)
    }
    fn remove(book: &ServiceBook, o: &Self) {
        book.remove_slice(&key_of(&o.metadata))
    }
    fn replace(book: &ServiceBook, all: &[Self]) {
        book.replace_slices(all)
    }
}

/// Follow both kinds until `stop`. The book is complete once both have been listed.
pub async fn follow(client: kube::Client, book: Arc<ServiceBook>, stop: tokio::sync::watch::Receiver<bool>) {
    let b = book.clone();
    let listed = Listed::new(2, move || b.mark_complete());
    tokio::join!(
        follow_kind::<_, Service>(Api::all(client.clone()), book.clone(), listed.clone(), stop.clone()),
        follow_kind::<_, EndpointSlice>(Api::all(client), book, listed, stop),
    );
}
