//! The gRPC face of the policy book (`nodeplane.controller.v1.NetworkPolicies`).

use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;

use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::PolicyBook;
use super::compile::is_empty;
use crate::rpc::controller as pb;
use crate::rpc::controller::network_policies_server::NetworkPolicies;

pub struct Service {
    pub book: Arc<PolicyBook>,
    /// Who may call (the same credentials as the registry's).
    pub registry: Arc<crate::controller::server::Service>,
}

/// The one mapping of the object books' errors (this service's and the Services service's)
/// to gRPC codes.
impl From<super::model::ObjectError> for Status {
    fn from(e: super::model::ObjectError) -> Status {
        use super::model::ObjectError::*;
        let m = e.to_string();
        match e {
            NotLocal { .. } => Status::failed_precondition(m),
            File { .. } | Store(_) => Status::internal(m),
            NoName(_) | Invalid { .. } | NotJson(_) | NoObjects | Decode { .. } | Kind(..) => {
                Status::invalid_argument(m)
            }
        }
    }
}

type PolicyStream = Pin<Box<dyn Stream<Item = Result<pb::PolicyUpdate, Status>> + Send>>;

/// How long PodStarted waits for a controller that has just started to have listed the
/// objects (the agent's ADD waits 5 s for the whole call).
const UNTIL_COMPLETE: std::time::Duration = std::time::Duration::from_secs(10);

impl Service {
    async fn admin(&self, req: &Request<impl Sized>) -> Result<(), Status> {
        self.registry.admin(req, "change or list policy objects").await
    }

    /// The pod's key and addresses, checked: a valid namespace/name, and addresses inside
    /// the node's own pod blocks (a node acts only on its own blocks).
    fn pod_of(&self, node: &str, p: Option<pb::PodAddress>) -> Result<((String, String), Vec<IpAddr>), Status> {
        let p = p.ok_or_else(|| Status::invalid_argument("pod is required"))?;
        if p.namespace.is_empty() || p.name.is_empty() || p.namespace.len() > 253 || p.name.len() > 253 {
            return Err(Status::invalid_argument("pod namespace and name are required (at most 253 characters)"));
        }
        let blocks: Vec<ipnetwork::IpNetwork> =
            self.registry.node_blocks(node).iter().filter_map(|b| b.parse().ok()).collect();
        let mut ips = Vec::new();
        for s in &p.ips {
            let ip: IpAddr =
                s.parse().map_err(|_| Status::invalid_argument(format!("pod address {s:?} is not an IP address")))?;
            if !blocks.iter().any(|b| b.contains(ip)) {
                return Err(Status::permission_denied(format!("{ip} is not in a pod block of node {node:?}")));
            }
            ips.push(ip);
        }
        Ok(((p.namespace, p.name), ips))
    }
}

#[tonic::async_trait]
impl NetworkPolicies for Service {
    type WatchPolicyStream = PolicyStream;

    async fn watch_policy(&self, req: Request<pb::WatchPolicyRequest>) -> Result<Response<PolicyStream>, Status> {
        let node = req.get_ref().node_name.clone();
        self.registry.authorize(&req, &node).await?;
        let book = self.book.clone();
        let mut stopping = self.registry.stopping.clone();
        let mut changed = book.subscribe();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            // No view before every object is known: an incomplete one would lift the
            // node's policies until the objects are listed.
            tokio::select! {
                _ = book.until_complete() => {}
                _ = stopping.wait_for(|s| *s) => return,
            }
            let mut sent = None::<Arc<super::compile::NodeView>>;
            loop {
                changed.borrow_and_update();
                let v = book.view(&node);
                let update = match &sent {
                    None => Some(v.view.snapshot(v.revision)),
                    Some(last) if !Arc::ptr_eq(last, &v.view) => {
                        Some(v.view.delta_from(last, v.revision)).filter(|u| !is_empty(u))
                    }
                    Some(_) => None,
                };
                if let Some(u) = update {
                    if tx.send(Ok(u)).await.is_err() {
                        return;
                    }
                    sent = Some(v.view.clone());
                }
                tokio::select! {
                    r = changed.changed() => if r.is_err() { return },
                    _ = stopping.wait_for(|s| *s) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn pod_started(
        &self,
        req: Request<pb::PodStartedRequest>,
    ) -> Result<Response<pb::PodStartedResponse>, Status> {
        let node = req.get_ref().node_name.clone();
        self.registry.authorize(&req, &node).await?;
        let (key, ips) = self.pod_of(&node, req.into_inner().pod)?;
        if tokio::time::timeout(UNTIL_COMPLETE, self.book.until_complete()).await.is_err() {
            return Err(Status::unavailable(
                "the controller has not yet listed the NetworkPolicies, Pods and Namespaces: retry",
            ));
        }
        let book = self.book.clone();
        let (revision, isolated) = crate::rpc::blocking(move || book.pod_started(&node, key, ips)).await?;
        Ok(Response::new(pb::PodStartedResponse { revision, isolated }))
    }

    async fn pod_stopped(
        &self,
        req: Request<pb::PodStoppedRequest>,
    ) -> Result<Response<pb::PodStoppedResponse>, Status> {
        let node = req.get_ref().node_name.clone();
        self.registry.authorize(&req, &node).await?;
        let p = req.into_inner().pod.ok_or_else(|| Status::invalid_argument("pod is required"))?;
        let book = self.book.clone();
        crate::rpc::blocking(move || book.pod_stopped(&node, &(p.namespace, p.name))).await?;
        Ok(Response::new(pb::PodStoppedResponse {}))
    }

    async fn report_pods(
        &self,
        req: Request<pb::ReportPodsRequest>,
    ) -> Result<Response<pb::ReportPodsResponse>, Status> {
        let node = req.get_ref().node_name.clone();
        self.registry.authorize(&req, &node).await?;
        let mut pods = Vec::new();
        for p in req.into_inner().pods {
            pods.push(self.pod_of(&node, Some(p))?);
        }
        let book = self.book.clone();
        crate::rpc::blocking(move || book.report_pods(&node, pods)).await?;
        Ok(Response::new(pb::ReportPodsResponse {}))
    }

    async fn apply_objects(
        &self,
        req: Request<pb::ApplyObjectsRequest>,
    ) -> Result<Response<pb::ApplyObjectsResponse>, Status> {
        self.admin(&req).await?;
        let book = self.book.clone();
        let json = req.into_inner().json;
        let applied = crate::rpc::blocking(move || book.apply_json(&json)).await??;
        Ok(Response::new(pb::ApplyObjectsResponse { applied, revision: 0 }))
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
