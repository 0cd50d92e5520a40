//! DRA in Kubernetes mode: ResourceSlices written through the API (`resource.k8s.io/v1`,
//! Kubernetes 1.34 and later) and ResourceClaims read from it (see `controller::dra`).

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value;

use crate::controller::dra::{API_GROUP, SinkError, SliceSink};

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(API_GROUP, "v1", kind), plural)
}

fn to_value(o: DynamicObject) -> Result<Value, SinkError> {
    Ok(serde_json::to_value(o)?)
}

fn to_object(v: Value) -> Result<DynamicObject, SinkError> {
    Ok(serde_json::from_value(v)?)
}

fn api_error(e: kube::Error) -> SinkError {
    SinkError::Api(match super::api_status(&e) {
        Some(s) if s.code == 404 => {
            format!("{} (is resource.k8s.io/v1 served? It needs Kubernetes 1.34 or later)", s.message)
        }
        Some(s) => format!("{} ({})", s.message, s.code),
        None => e.to_string(),
    })
}

pub struct KubeSlices {
    api: Api<DynamicObject>,
    nodes: Api<Node>,
}

impl KubeSlices {
    pub fn new(client: kube::Client) -> KubeSlices {
        KubeSlices {
            api: Api::all_with(client.clone(), &resource("ResourceSlice", "resourceslices")),
            nodes: Api::all(client),
        }
    }

    /// The slice owned by its Node object (read now, never cached: a Node made again under
    /// the same name has another UID), so the API's garbage collector deletes it with the
    /// Node even while no controller runs. A Node that cannot be read leaves the slice
    /// without owner (the controller deletes it when the node leaves the registry).
    async fn owned(&self, mut o: DynamicObject) -> DynamicObject {
        let node = o.data.pointer("/spec/nodeName").and_then(Value::as_str).map(String::from);
        if let Some(node) = node
            && let Ok(Some(n)) = self.nodes.get_opt(&node).await
            && let Some(uid) = n.metadata.uid
        {
            o.metadata.owner_references = Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node,
                uid,
                ..Default::default()
            }]);
        }
        o
    }
}

#[tonic::async_trait]
impl SliceSink for KubeSlices {
    async fn list(&self) -> Result<Vec<Value>, SinkError> {
        let lp = ListParams::default().labels(&format!("{}={}", super::MANAGED_BY.0, super::MANAGED_BY.1));
        let (items, _) = super::list_all(&self.api, &lp).await.map_err(api_error)?;
        items.into_iter().map(to_value).collect()
    }
    async fn write(&self, obj: Value) -> Result<Value, SinkError> {
        let mut o = self.owned(to_object(obj)?).await;
        let name = o.metadata.name.clone().unwrap_or_default();
        if o.metadata.resource_version.is_none() {
            match self.api.create(&super::post_params(), &o).await {
                Ok(made) => return to_value(made),
                // A slice of this name the list did not show (its label removed, or written by
                // an older release): the name is this driver's and this node's, so take it over.
                Err(e) if super::is_already_exists(&e) => {
                    o.metadata.resource_version =
                        self.api.get(&name).await.map_err(api_error)?.metadata.resource_version;
                }
                Err(e) => return Err(api_error(e)),
            }
        }
        to_value(self.api.replace(&name, &super::post_params(), &o).await.map_err(api_error)?)
    }
    async fn delete(&self, name: &str) -> Result<(), SinkError> {
        match self.api.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(e) if super::is_not_found(&e) => Ok(()),
            Err(e) => Err(api_error(e)),
        }
    }
    fn describe(&self) -> String {
        "the Kubernetes API (resource.k8s.io/v1 resourceslices)".into()
    }
}

/// Reads ResourceClaims (Kubernetes mode).
pub struct KubeClaims {
    client: kube::Client,
    res: ApiResource,
}

impl KubeClaims {
    pub fn new(client: kube::Client) -> KubeClaims {
        KubeClaims { client, res: resource("ResourceClaim", "resourceclaims") }
    }

    /// The claim, `None` when it does not exist.
    pub async fn get(&self, namespace: &str, name: &str) -> Result<Option<Value>, SinkError> {
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), namespace, &self.res);
        match api.get_opt(name).await.map_err(api_error)? {
            Some(o) => Ok(Some(to_value(o)?)),
            None => Ok(None),
        }
    }
}
