//! The controller in a Kubernetes cluster: its state in API objects, leader election on a
//! `coordination.k8s.io` Lease, agent identity from projected service-account tokens
//! (TokenReview), and Node deletions releasing that node's blocks.
//!
//! Everything here talks to the API through kube-rs. [`API_CALLS`] lists every (group,
//! resource, verb) this module uses; the shipped RBAC must grant exactly these (a manifest
//! test compares them with `nodeplane-controller api-calls`).

pub mod ensure;
pub mod events;
pub mod feed;
pub mod lease;
pub mod nodes;
pub mod policy;
pub mod review;
pub mod secret;
pub mod services;
pub mod slices;
pub mod state;
pub mod tls;

use kube::core::{ApiResource, GroupVersionKind};
use serde::Serialize;

pub const GROUP: &str = "nodeplane.dev";
pub const VERSION: &str = "v1alpha1";

/// One Kubernetes API call the controller makes (an RBAC rule's unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ApiCall {
    pub group: &'static str,
    pub resource: &'static str,
    pub verb: &'static str,
    /// Namespaced resources are granted by a Role in the controller's namespace.
    pub namespaced: bool,
}

const fn call(group: &'static str, resource: &'static str, verb: &'static str, namespaced: bool) -> ApiCall {
    ApiCall { group, resource, verb, namespaced }
}

/// Every call the controller makes in Kubernetes mode, and no other.
pub const API_CALLS: &[ApiCall] = &[
    // state: the node records, the block locks and the volume records
    call(GROUP, "nodeplanenodes", "get", false),
    call(GROUP, "nodeplanenodes", "list", false),
    call(GROUP, "nodeplanenodes", "create", false),
    call(GROUP, "nodeplanenodes", "update", false),
    call(GROUP, "nodeplanenodes", "delete", false),
    call(GROUP, "ipblocks", "get", false),
    call(GROUP, "ipblocks", "list", false),
    call(GROUP, "ipblocks", "create", false),
    call(GROUP, "ipblocks", "delete", false),
    call(GROUP, "nodeplanevolumes", "get", false),
    call(GROUP, "nodeplanevolumes", "list", false),
    call(GROUP, "nodeplanevolumes", "create", false),
    call(GROUP, "nodeplanevolumes", "update", false),
    call(GROUP, "nodeplanevolumes", "delete", false),
    // the volume records' identity: the uid of their CRD (get limited to its name)
    call("apiextensions.k8s.io", "customresourcedefinitions", "get", false),
    // Node deletions release blocks
    call("", "nodes", "get", false),
    call("", "nodes", "list", false),
    call("", "nodes", "watch", false),
    // events on Nodes (a storage pool running short), in the `default` namespace as
    // kubelet's; a repeated event is patched
    call("events.k8s.io", "events", "create", false),
    call("events.k8s.io", "events", "patch", false),
    // agent identity
    call("authentication.k8s.io", "tokenreviews", "create", false),
    // the token-signing secret (get/update limited to its name; create cannot be), and the
    // encrypted volumes' keys (get, create, delete: one Secret per volume, names not known
    // ahead)
    call("", "secrets", "get", true),
    call("", "secrets", "create", true),
    call("", "secrets", "update", true),
    call("", "secrets", "delete", true),
    // tls.bootstrap: the CA bundle agents mount (get/update limited to its name)
    call("", "configmaps", "get", true),
    call("", "configmaps", "create", true),
    call("", "configmaps", "update", true),
    // DRA: the nodes' ResourceSlice pools, and the claims nodes prepare (any namespace)
    call("resource.k8s.io", "resourceslices", "list", false),
    call("resource.k8s.io", "resourceslices", "create", false),
    call("resource.k8s.io", "resourceslices", "update", false),
    call("resource.k8s.io", "resourceslices", "delete", false),
    call("resource.k8s.io", "resourceclaims", "get", false),
    // NetworkPolicy: the policies, the pods they select (labels, named ports) and the
    // namespaces (labels), watched cluster-wide
    call("networking.k8s.io", "networkpolicies", "list", false),
    call("networking.k8s.io", "networkpolicies", "watch", false),
    call("", "pods", "list", false),
    call("", "pods", "watch", false),
    call("", "namespaces", "list", false),
    call("", "namespaces", "watch", false),
    // Services: the Services and their EndpointSlices, watched cluster-wide
    call("", "services", "list", false),
    call("", "services", "watch", false),
    call("discovery.k8s.io", "endpointslices", "list", false),
    call("discovery.k8s.io", "endpointslices", "watch", false),
    // leader election
    call("coordination.k8s.io", "leases", "get", true),
    call("coordination.k8s.io", "leases", "create", true),
    call("coordination.k8s.io", "leases", "update", true),
];

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural)
}

pub fn node_resource() -> ApiResource {
    resource("NodeplaneNode", "nodeplanenodes")
}
pub fn block_resource() -> ApiResource {
    resource("IPBlock", "ipblocks")
}
pub fn volume_resource() -> ApiResource {
    resource("NodeplaneVolume", "nodeplanevolumes")
}

/// The CustomResourceDefinition of the volume records.
pub fn volume_crd_name() -> String {
    format!("nodeplanevolumes.{GROUP}")
}

pub fn crd_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("apiextensions.k8s.io", "v1", "CustomResourceDefinition");
    ApiResource::from_gvk_with_plural(&gvk, "customresourcedefinitions")
}

/// The field manager of every write (`?fieldManager=`): what `managedFields` and audit logs
/// name as the writer.
pub const FIELD_MANAGER: &str = "nodeplane-controller";

/// The label every object the controller makes carries.
pub(crate) const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "nodeplane-controller");

/// [`MANAGED_BY`] as an object's labels.
pub(crate) fn managed_labels() -> std::collections::BTreeMap<String, String> {
    [(MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string())].into()
}

/// The metadata of an object the controller makes in `namespace`: its name and [`MANAGED_BY`].
pub(crate) fn managed_meta(namespace: &str, name: &str) -> kube::api::ObjectMeta {
    kube::api::ObjectMeta {
        name: Some(name.into()),
        namespace: Some(namespace.into()),
        labels: Some(managed_labels()),
        ..Default::default()
    }
}

/// The User-Agent of every request: the binary and its version.
pub fn user_agent() -> String {
    format!("nodeplane-controller/{}", env!("CARGO_PKG_VERSION"))
}

/// Create/replace parameters naming the controller as the field manager.
pub fn post_params() -> kube::api::PostParams {
    kube::api::PostParams { field_manager: Some(FIELD_MANAGER.to_string()), ..Default::default() }
}

/// Makes every request of a client built from `cfg` carry the controller's User-Agent.
pub fn named(mut cfg: kube::Config) -> kube::Config {
    use hyper::header::{HeaderValue, USER_AGENT};
    cfg.headers.retain(|(k, _)| k != USER_AGENT);
    if let Ok(v) = HeaderValue::from_str(&user_agent()) {
        cfg.headers.push((USER_AGENT, v));
    }
    cfg
}

/// The client configuration from the environment (`KUBECONFIG` / `~/.kube/config`, else the
/// in-cluster service account), with the controller's User-Agent.
pub async fn config() -> Result<kube::Config, String> {
    kube::Config::infer().await.map(named).map_err(|e| format!("Kubernetes client configuration: {e}"))
}

/// A client from the environment (see [`config`]).
pub async fn client() -> Result<kube::Client, String> {
    kube::Client::try_from(config().await?).map_err(|e| format!("Kubernetes client: {e}"))
}

/// The API's verdict on a failed call, if it was one.
pub(crate) fn api_status(e: &kube::Error) -> Option<&kube::core::Status> {
    match e {
        kube::Error::Api(s) => Some(s),
        _ => None,
    }
}

/// Objects per page of a list: a cluster of thousands of nodes is read in pages, never in
/// one answer the API server has to build (and hold) at once.
pub const LIST_PAGE: u32 = 500;
/// Bound on one page of a list (the whole list is bounded by its page count, not by one
/// fixed figure).
pub const PAGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Every object of a list, read in pages of [`LIST_PAGE`] (`limit`/`continue`), and the
/// resourceVersion of the snapshot they all come from. A continue token the server let
/// expire (410 between pages) starts the list again, at most three times.
pub(crate) async fn list_all<K>(
    api: &kube::Api<K>,
    lp: &kube::api::ListParams,
) -> Result<(Vec<K>, Option<String>), kube::Error>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut attempt = 0;
    'again: loop {
        attempt += 1;
        let mut items = Vec::new();
        let mut version = None;
        let mut token: Option<String> = None;
        loop {
            let mut page = lp.clone().limit(LIST_PAGE);
            if let Some(t) = &token {
                page = page.continue_token(t);
            }
            let list = match tokio::time::timeout(PAGE_TIMEOUT, api.list(&page)).await {
                Ok(Ok(l)) => l,
                Ok(Err(e)) if token.is_some() && attempt < 3 && api_status(&e).is_some_and(|s| s.code == 410) => {
                    continue 'again;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(kube::Error::Service(
                        format!("a page of the list did not come within {PAGE_TIMEOUT:?}").into(),
                    ));
                }
            };
            if version.is_none() {
                version = list.metadata.resource_version.clone();
            }
            items.extend(list.items);
            match list.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(next) => token = Some(next),
                None => return Ok((items, version)),
            }
        }
    }
}

pub(crate) fn is_not_found(e: &kube::Error) -> bool {
    api_status(e).is_some_and(|s| s.is_not_found())
}
pub(crate) fn is_already_exists(e: &kube::Error) -> bool {
    api_status(e).is_some_and(|s| s.is_already_exists())
}
pub(crate) fn is_conflict(e: &kube::Error) -> bool {
    api_status(e).is_some_and(|s| s.is_conflict() && !s.is_already_exists())
}

/// Kubernetes' rule for label values, as an error message names it.
pub const LABEL_VALUE_RULE: &str = "a label value must be at most 63 characters, empty or alphanumerics, '-', '_' and '.' \
     starting and ending with an alphanumeric character (regex (([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?)";

fn label_name_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
}

/// Why `v` is not a valid label value, if it is not.
pub fn label_value_error(v: &str) -> Option<String> {
    (!v.is_empty() && !label_name_ok(v)).then(|| format!("label value {v:?} is invalid: {LABEL_VALUE_RULE}"))
}

/// Why `k` is not a valid label key (`[prefix/]name`: a DNS-1123 subdomain and a name of at
/// most 63 characters), if it is not.
pub fn label_key_error(k: &str) -> Option<String> {
    let (prefix, name) = k.split_once('/').map_or((None, k), |(p, n)| (Some(p), n));
    if let Some(why) = prefix.and_then(crate::controller::records::subdomain_error) {
        return Some(format!("label key {k:?}: the prefix {why}"));
    }
    (!label_name_ok(name)).then(|| {
        format!("label key {k:?}: the name must be 1 to 63 alphanumerics, '-', '_' and '.', starting and ending with an alphanumeric character")
    })
}

/// Checks an object's name and labels against Kubernetes' rules before it is written, so that
/// a bad one is a clear error here rather than the API server's refusal of the write.
pub fn check_object<'a>(
    kind: &str,
    name: &str,
    labels: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Result<(), String> {
    if let Some(why) = crate::controller::records::subdomain_error(name) {
        return Err(format!("{kind} name {name:?} {why}"));
    }
    for (k, v) in labels {
        if let Some(why) = label_key_error(k).or_else(|| label_value_error(v)) {
            return Err(format!("{kind} {name}: {why}"));
        }
    }
    Ok(())
}
