//! `nodeplane.node.v1.NodeVolumes`: the node-local volume store over the agent's local
//! socket. Operations on a volume share the CSI node service's per-volume guard, so a
//! delete never races a stage of the same volume (the second one gets ABORTED).

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::csi::node::{CsiError, NodeService};
use crate::rpc::node as api;
use crate::storage::store::{Backend, FsType, VolumeError};

#[derive(Clone)]
pub struct NodeVolumes(pub Arc<NodeService>);

fn to_api(svc: &NodeService, v: &crate::storage::store::Volume) -> api::Volume {
    api::Volume {
        id: v.id.clone(),
        size_bytes: v.size_bytes,
        fs_type: v.fs_type.as_str().to_string(),
        created_at: v.created_at,
        devices: svc
            .store
            .bindings(&v.id)
            .unwrap_or_default()
            .into_iter()
            .map(|b| b.device.display().to_string())
            .collect(),
        backing_file_present: v.path.exists(),
        backend: v.backend.as_str().to_string(),
    }
}

fn status(e: VolumeError) -> Status {
    match e {
        // No room for a new volume: RESOURCE_EXHAUSTED (CSI's NodeExpandVolume maps the same
        // error to OUT_OF_RANGE, as its spec asks).
        VolumeError::CapacityExceeded { .. } => Status::resource_exhausted(e.to_string()),
        e => CsiError::from(e).into(),
    }
}

async fn run<T: Send + 'static>(
    svc: &Arc<NodeService>,
    id: Option<String>,
    f: impl FnOnce(&NodeService) -> Result<T, Status> + Send + 'static,
) -> Result<Response<T>, Status> {
    super::csi::ready_or_unavailable(svc)?;
    let svc = svc.clone();
    crate::rpc::blocking(move || {
        let _g = match &id {
            Some(id) => Some(svc.guard(id).map_err(Status::from)?),
            None => None,
        };
        f(&svc)
    })
    .await?
    .map(Response::new)
}

#[tonic::async_trait]
impl api::node_volumes_server::NodeVolumes for NodeVolumes {
    async fn create_volume(
        &self,
        r: Request<api::CreateVolumeRequest>,
    ) -> Result<Response<api::CreateVolumeResponse>, Status> {
        let r = r.into_inner();
        let fs: FsType = r
            .fs_type
            .parse()
            .map_err(|e: crate::storage::fs::InvalidFsType| Status::invalid_argument(e.to_string()))?;
        let backend: Backend = r
            .backend
            .parse()
            .map_err(|e: crate::storage::store::InvalidBackend| Status::invalid_argument(e.to_string()))?;
        run(&self.0, Some(r.id.clone()), move |s| {
            let v = s.store.create_on(backend, &r.id, r.size_bytes, fs, "").map_err(status)?;
            Ok(api::CreateVolumeResponse { volume: Some(to_api(s, &v)) })
        })
        .await
    }
    async fn delete_volume(
        &self,
        r: Request<api::DeleteVolumeRequest>,
    ) -> Result<Response<api::DeleteVolumeResponse>, Status> {
        let r = r.into_inner();
        run(&self.0, Some(r.id.clone()), move |s| {
            s.store.delete(&r.id).map_err(status)?;
            Ok(api::DeleteVolumeResponse {})
        })
        .await
    }
    async fn expand_volume(
        &self,
        r: Request<api::ExpandVolumeRequest>,
    ) -> Result<Response<api::ExpandVolumeResponse>, Status> {
        let r = r.into_inner();
        run(&self.0, Some(r.id.clone()), move |s| {
            let v = s.store.expand(&r.id, r.size_bytes).map_err(status)?;
            Ok(api::ExpandVolumeResponse { volume: Some(to_api(s, &v)) })
        })
        .await
    }
    async fn list_volumes(
        &self,
        _: Request<api::ListVolumesRequest>,
    ) -> Result<Response<api::ListVolumesResponse>, Status> {
        run(&self.0, None, |s| {
            Ok(api::ListVolumesResponse { volumes: s.store.list().iter().map(|v| to_api(s, v)).collect() })
        })
        .await
    }
    async fn get_capacity(
        &self,
        _: Request<api::GetCapacityRequest>,
    ) -> Result<Response<api::GetCapacityResponse>, Status> {
        run(&self.0, None, |s| {
            let u = s.store.usage();
            Ok(api::GetCapacityResponse {
                capacity_bytes: u.capacity_bytes,
                provisioned_bytes: u.provisioned_bytes,
                available_bytes: u.available_bytes,
                volumes: u.volumes as u64,
                allocated_bytes: u.allocated_bytes,
                backing_fs_free_bytes: u.backing_fs_free_bytes,
            })
        })
        .await
    }
}
