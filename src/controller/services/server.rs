//! The gRPC face of the service book (`nodeplane.controller.v1.Services`).

use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::{Change, ServiceBook, Start};
use crate::controller::records::last_states;
use crate::rpc::controller as pb;
use crate::rpc::controller::services_server::Services;

/// Ports per part of a snapshot (a few hundred bytes each: well under gRPC's 4 MiB).
const SNAPSHOT_PART: usize = 1000;

pub struct Service {
    pub book: Arc<ServiceBook>,
    /// Who may call (the registry's credentials).
    pub registry: Arc<crate::controller::server::Service>,
}

type UpdateStream = Pin<Box<dyn Stream<Item = Result<pb::ServiceUpdate, Status>> + Send>>;

/// The parts of a snapshot at `revision`.
pub fn snapshot(book: &ServiceBook, revision: u64, ports: &[Arc<pb::ServicePort>]) -> Vec<pb::ServiceUpdate> {
    let chunks: Vec<&[Arc<pb::ServicePort>]> =
        if ports.is_empty() { vec![&[]] } else { ports.chunks(SNAPSHOT_PART).collect() };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| pb::ServiceUpdate {
            epoch: book.epoch,
            revision,
            snapshot: i == 0,
            more: i < last,
            ports: c.iter().map(|p| (**p).clone()).collect(),
            pod_cidrs: if i == 0 { book.pod_cidrs.clone() } else { Vec::new() },
            ..Default::default()
        })
        .collect()
}

/// One update from `base` through `changes` (consecutive): the last state of each port.
pub fn delta(book: &ServiceBook, base: u64, changes: &[Arc<Change>]) -> pb::ServiceUpdate {
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
            }
            let (mut epoch, mut sent) = (r.epoch, r.since_revision);
            loop {
                changed.borrow_and_update();
                let updates = match book.follow(epoch, sent) {
                    Start::Snapshot { revision, ports } => snapshot(&book, revision, &ports),
                    Start::Changes(c) if c.is_empty() => Vec::new(),
                    Start::Changes(c) => vec![delta(&book, sent, &c)],
                };
                for u in updates {
                    (epoch, sent) = (u.epoch, u.revision);
                    if tx.send(Ok(u)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = stopping.wait_for(|s| *s) => return,
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
