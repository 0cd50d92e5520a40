//! The gRPC face of the service book (`nodeplane.controller.v1.Services`).

use std::pin::Pin;
use std::sync::Arc;

use prost::Message;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::{Change, ServiceBook, Start};
use crate::controller::records::last_states;
use crate::rpc::controller as pb;
use crate::rpc::controller::services_server::Services;

/// Ports per part of a snapshot (a few hundred bytes each: well under gRPC's 4 MiB).
const SNAPSHOT_PART: usize = 1000;

/// The largest delta sent as one message. A larger one (a client away through many changes)
/// goes as a snapshot in parts instead: agents read messages up to 256 MiB, and one they
/// cannot read would be asked for again forever.
const MAX_DELTA_BYTES: usize = 64 << 20;

pub struct Service {
    pub book: Arc<ServiceBook>,
    /// Who may call (the registry's credentials).
    pub registry: Arc<crate::controller::server::Service>,
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<pb::ServiceUpdate, Status>> + Send>>;

/// The parts of a snapshot at `revision`, each made as it is taken: a part holds copies of
/// its ports, and all parts at once would hold the whole table again for every agent that
/// asks (every agent asks at once after a controller restart).
fn snapshot<'a>(
    book: &'a ServiceBook,
    revision: u64,
    ports: &'a [Arc<pb::ServicePort>],
) -> impl Iterator<Item = pb::ServiceUpdate> + Send + 'a {
    let parts = ports.len().div_ceil(SNAPSHOT_PART).max(1);
    (0..parts).map(move |i| {
        let part = &ports[i * SNAPSHOT_PART..ports.len().min((i + 1) * SNAPSHOT_PART)];
        pb::ServiceUpdate {
            epoch: book.epoch,
            revision,
            snapshot: i == 0,
            more: i + 1 < parts,
            ports: part.iter().map(|p| (**p).clone()).collect(),
            pod_cidrs: if i == 0 { book.pod_cidrs.clone() } else { Vec::new() },
            ..Default::default()
        }
    })
}

/// One update from `base` through `changes` (consecutive): the last state of each port.
fn delta(book: &ServiceBook, base: u64, changes: &[Arc<Change>]) -> pb::ServiceUpdate {
    let (ports, removed) = last_states(changes.iter().map(|c| (&c.upserts[..], &c.removed[..])), |p| &p.id);
    pb::ServiceUpdate {
        epoch: book.epoch,
        revision: changes.last().map_or(base, |c| c.revision),
        base_revision: base,
        ports: ports.into_iter().map(|p| (**p).clone()).collect(),
        removed,
        ..Default::default()
    }
}

/// What a client at `since` of `epoch` gets next.
enum Next {
    Nothing,
    Delta(pb::ServiceUpdate),
    Snapshot { revision: u64, ports: Vec<Arc<pb::ServicePort>> },
}

fn next(book: &ServiceBook, epoch: u64, since: u64, max_delta: usize) -> Next {
    match book.follow(epoch, since) {
        Start::Snapshot { revision, ports } => Next::Snapshot { revision, ports },
        Start::Changes(c) if c.is_empty() => Next::Nothing,
        Start::Changes(c) => match delta(book, since, &c) {
            d if d.encoded_len() <= max_delta => Next::Delta(d),
            d => {
                tracing::info!(since, bytes = d.encoded_len(), "a delta too large for one message: a snapshot instead");
                let (revision, ports) = book.whole();
                Next::Snapshot { revision, ports }
            }
        },
    }
}

/// Send `updates` in order, keeping `at` (epoch, revision) at the last one sent; false when
/// the client is gone.
async fn send(
    tx: &tokio::sync::mpsc::Sender<Result<pb::ServiceUpdate, Status>>,
    updates: impl Iterator<Item = pb::ServiceUpdate>,
    at: &mut (u64, u64),
) -> bool {
    for u in updates {
        *at = (u.epoch, u.revision);
        if tx.send(Ok(u)).await.is_err() {
            return false;
        }
    }
    true
}

impl Service {
    async fn admin(&self, req: &Request<impl Sized>) -> Result<(), Status> {
        self.registry.admin(req, "change or list Services").await
    }
}

#[tonic::async_trait]
impl Services for Service {
    type WatchServicesStream = UpdateStream;

    async fn watch_services(&self, req: Request<pb::WatchServicesRequest>) -> Result<Response<UpdateStream>, Status> {
        let r = req.get_ref().clone();
        self.registry.authorize(&req, &r.node_name).await?;
        let book = self.book.clone();
        let mut stopping = self.registry.stopping.clone();
        let mut changed = book.subscribe();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            // Nothing before every object is known: a partial snapshot would take Services
            // (or their endpoints) away from the nodes until the lists are complete.
            tokio::select! {
                _ = book.until_complete() => {}
                _ = stopping.wait_for(|s| *s) => return,
                _ = tx.closed() => return,
            }
            let mut at = (r.epoch, r.since_revision);
            loop {
                changed.borrow_and_update();
                let (epoch, since) = at;
                let sent_all = match next(&book, epoch, since, MAX_DELTA_BYTES) {
                    Next::Nothing => true,
                    Next::Delta(d) => send(&tx, std::iter::once(d), &mut at).await,
                    Next::Snapshot { revision, ports } => send(&tx, snapshot(&book, revision, &ports), &mut at).await,
                };
                if !sent_all {
                    return;
                }
                // A client gone is noticed here too, not only at the next change's send.
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = stopping.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn apply_objects(
        &self,
        req: Request<pb::ApplyObjectsRequest>,
    ) -> Result<Response<pb::ApplyObjectsResponse>, Status> {
        self.admin(&req).await?;
        let book = self.book.clone();
        let json = req.into_inner().json;
        let applied = crate::rpc::blocking(move || book.apply_json(&json)).await??;
        Ok(Response::new(pb::ApplyObjectsResponse { applied, revision: self.book.revision() }))
    }

    async fn delete_objects(
        &self,
        req: Request<pb::DeleteObjectsRequest>,
    ) -> Result<Response<pb::DeleteObjectsResponse>, Status> {
        self.admin(&req).await?;
        let book = self.book.clone();
        let json = req.into_inner().json;
        let deleted = crate::rpc::blocking(move || book.delete_json(&json)).await??;
        Ok(Response::new(pb::DeleteObjectsResponse { deleted }))
    }

    async fn list_objects(
        &self,
        req: Request<pb::ListObjectsRequest>,
    ) -> Result<Response<pb::ListObjectsResponse>, Status> {
        self.admin(&req).await?;
        let json = self.book.list_json()?;
        Ok(Response::new(pb::ListObjectsResponse { json }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_comes_in_parts_of_a_thousand_ports_and_an_empty_one_in_one() {
        let book = ServiceBook::new(vec!["10.244.0.0/16".into()], None).unwrap();
        let ports: Vec<_> =
            (0..2500).map(|i| Arc::new(pb::ServicePort { id: format!("p{i}"), ..Default::default() })).collect();
        let parts: Vec<_> = snapshot(&book, 7, &ports).collect();
        let shape: Vec<_> = parts.iter().map(|u| (u.snapshot, u.more, u.ports.len(), u.pod_cidrs.len())).collect();
        assert_eq!(shape, [(true, true, 1000, 1), (false, true, 1000, 0), (false, false, 500, 0)]);
        assert!(parts.iter().all(|u| u.revision == 7 && u.epoch == book.epoch));
        assert_eq!(parts[2].ports[499].id, "p2499");
        let empty: Vec<_> = snapshot(&book, 8, &[]).map(|u| (u.snapshot, u.more, u.ports.len())).collect();
        assert_eq!(empty, [(true, false, 0)]);
    }

    #[test]
    fn a_delta_too_large_for_one_message_goes_as_a_snapshot() {
        let book = ServiceBook::new(vec!["10.244.0.0/16".into()], None).unwrap();
        let svc = |name: &str, ip: &str| -> k8s_openapi::api::core::v1::Service {
            serde_json::from_value(serde_json::json!({"metadata": {"namespace": "a", "name": name},
                "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80}]}}))
            .unwrap()
        };
        book.set_service(&svc("web", "10.96.0.10")).unwrap();
        let since = book.revision();
        book.set_service(&svc("db", "10.96.0.11")).unwrap();
        let Next::Delta(d) = next(&book, book.epoch, since, MAX_DELTA_BYTES) else {
            panic!("one small change: a delta")
        };
        assert_eq!((d.base_revision, d.revision, d.ports.len()), (since, book.revision(), 1));
        let Next::Snapshot { revision, ports } = next(&book, book.epoch, since, d.encoded_len() - 1) else {
            panic!("a delta over the limit: a snapshot")
        };
        assert_eq!((revision, ports.len()), (book.revision(), 2));
        assert!(matches!(next(&book, book.epoch, book.revision(), 1), Next::Nothing));
    }
}
