//! What NetworkPolicy is computed from: Namespaces (their labels), Pods (labels and named
//! container ports) and NetworkPolicies, as Kubernetes objects (from the API, or applied as
//! JSON in local mode), and where each pod runs with which addresses (from the agents).

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::rpc::controller as pb;

/// The label the API server puts on every namespace (and that cannot be changed).
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

pub type Labels = BTreeMap<String, String>;

/// `namespace/name`.
pub type Key = (String, String);

pub fn key_text(k: &Key) -> String {
    format!("{}/{}", k.0, k.1)
}

/// Why objects were refused, or could not be kept (local mode). Objects of the Services
/// book are refused with the same.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("a {0} without metadata.name")]
    NoName(&'static str),
    /// An object the API server would have refused, and why.
    #[error("{kind} {key}: {reason}")]
    Invalid { kind: &'static str, key: String, reason: String },
    #[error("not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("no objects given")]
    NoObjects,
    #[error("a {kind}: {source}")]
    Decode { kind: String, source: serde_json::Error },
    #[error("kind {0:?} is not {1}")]
    Kind(String, &'static str),
    /// Kubernetes mode: `what` come from the API (`verb` them with kubectl).
    #[error("this controller reads {what} from the Kubernetes API: {verb} them with kubectl")]
    NotLocal { what: &'static str, verb: &'static str },
    #[error("{}: {source}", path.display())]
    File { path: std::path::PathBuf, source: std::io::Error },
    #[error("object store: {0}")]
    Store(#[from] redb::Error),
}

/// `protocol` of a NetworkPolicyPort, a ContainerPort, a Service or a slice port: TCP when
/// absent, as the API defaults it.
pub fn protocol(p: Option<&str>) -> Option<pb::Protocol> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(pb::Protocol::Tcp),
        "UDP" => Some(pb::Protocol::Udp),
        "SCTP" => Some(pb::Protocol::Sctp),
        _ => None,
    }
}

/// A container port with a name (the only ones a policy can name).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NamedPort {
    pub name: String,
    pub protocol: pb::Protocol,
    pub port: u16,
}

/// What policy needs of a Pod object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodInfo {
    pub labels: Labels,
    pub ports: Vec<NamedPort>,
}

impl PodInfo {
    pub fn of(pod: &Pod) -> Self {
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        let mut ports = Vec::new();
        let containers = pod.spec.iter().flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()));
        for c in containers {
            for p in c.ports.iter().flatten() {
                let (Some(name), Some(protocol), Ok(port)) =
                    (&p.name, protocol(p.protocol.as_deref()), u16::try_from(p.container_port))
                else {
                    continue;
                };
                if port != 0 {
                    ports.push(NamedPort { name: name.clone(), protocol, port });
                }
            }
        }
        ports.sort();
        ports.dedup();
        PodInfo { labels, ports }
    }
}

/// A pod attached by an agent: where, with which addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub node: String,
    pub ips: Vec<IpAddr>,
}

/// Everything policy is computed from.
#[derive(Debug, Clone, Default)]
pub struct Objects {
    /// Namespace labels, the automatic `kubernetes.io/metadata.name` included.
    pub namespaces: BTreeMap<String, Labels>,
    pub pods: BTreeMap<Key, PodInfo>,
    pub policies: BTreeMap<Key, NetworkPolicySpec>,
    /// Pods attached on the nodes (from the agents).
    pub attached: BTreeMap<Key, Attached>,
}

impl Objects {
    /// A namespace's labels; a namespace nobody described still has its name label.
    pub fn namespace_labels(&self, ns: &str) -> Labels {
        let mut l = self.namespaces.get(ns).cloned().unwrap_or_default();
        l.insert(NAMESPACE_NAME_LABEL.to_string(), ns.to_string());
        l
    }

    pub fn set_namespace(&mut self, ns: &Namespace) -> Result<String, ObjectError> {
        let name = ns.metadata.name.clone().ok_or(ObjectError::NoName("Namespace"))?;
        let mut labels = ns.metadata.labels.clone().unwrap_or_default();
        labels.insert(NAMESPACE_NAME_LABEL.to_string(), name.clone());
        self.namespaces.insert(name.clone(), labels);
        Ok(name)
    }

    pub fn set_pod(&mut self, pod: &Pod) -> Result<Key, ObjectError> {
        let key = object_key(&pod.metadata, "Pod")?;
        self.pods.insert(key.clone(), PodInfo::of(pod));
        Ok(key)
    }

    pub fn set_policy(&mut self, p: &NetworkPolicy) -> Result<Key, ObjectError> {
        let key = object_key(&p.metadata, "NetworkPolicy")?;
        let spec = p.spec.clone().unwrap_or_default();
        validate_spec(&spec).map_err(|reason| ObjectError::Invalid {
            kind: "NetworkPolicy",
            key: key_text(&key),
            reason,
        })?;
        self.policies.insert(key.clone(), spec);
        Ok(key)
    }
}

pub fn object_key(
    m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    kind: &'static str,
) -> Result<Key, ObjectError> {
    let name = m.name.clone().ok_or(ObjectError::NoName(kind))?;
    let ns = m.namespace.clone().filter(|n| !n.is_empty()).unwrap_or_else(|| "default".to_string());
    Ok((ns, name))
}

/// What the API server's validation guarantees, checked again for objects applied locally:
/// Err says what is wrong.
fn validate_spec(spec: &NetworkPolicySpec) -> Result<(), String> {
    for t in spec.policy_types.iter().flatten() {
        if t != "Ingress" && t != "Egress" {
            return Err(format!("policyTypes entry {t:?} is neither Ingress nor Egress"));
        }
    }
    let rules = spec
        .ingress
        .iter()
        .flatten()
        .map(|r| (r.from.as_deref(), r.ports.as_deref()))
        .chain(spec.egress.iter().flatten().map(|r| (r.to.as_deref(), r.ports.as_deref())));
    for (peers, ports) in rules {
        for p in peers.into_iter().flatten() {
            match (&p.ip_block, p.pod_selector.is_some() || p.namespace_selector.is_some()) {
                (Some(_), true) => return Err("a peer with ipBlock has no selectors".into()),
                (None, false) => return Err("a peer needs podSelector, namespaceSelector or ipBlock".into()),
                (Some(b), false) => {
                    let cidr: ipnetwork::IpNetwork =
                        b.cidr.parse().map_err(|_| format!("ipBlock cidr {:?} is not a CIDR", b.cidr))?;
                    for e in b.except.iter().flatten() {
                        let ex: ipnetwork::IpNetwork =
                            e.parse().map_err(|_| format!("ipBlock except {e:?} is not a CIDR"))?;
                        if ex.is_ipv4() != cidr.is_ipv4() || !cidr.contains(ex.network()) || ex.prefix() < cidr.prefix()
                        {
                            return Err(format!("ipBlock except {e} is not inside {}", b.cidr));
                        }
                    }
                }
                (None, true) => {
                    for s in [&p.pod_selector, &p.namespace_selector].into_iter().flatten() {
                        validate_selector(s)?;
                    }
                }
            }
        }
        for port in ports.into_iter().flatten() {
            if protocol(port.protocol.as_deref()).is_none() {
                return Err(format!("protocol {:?} is not TCP, UDP or SCTP", port.protocol.as_deref().unwrap_or("")));
            }
            use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
            match (&port.port, port.end_port) {
                (Some(IntOrString::Int(n)), end) => {
                    if !(1..=65535).contains(n) {
                        return Err(format!("port {n} is out of range"));
                    }
                    if let Some(e) = end
                        && (e < *n || e > 65535)
                    {
                        return Err(format!("endPort {e} is below port {n} or out of range"));
                    }
                }
                (Some(IntOrString::String(name)), None) => {
                    if name.is_empty() || name.len() > 15 {
                        return Err(format!("named port {name:?} is not a port name"));
                    }
                }
                (Some(IntOrString::String(_)), Some(_)) => return Err("endPort needs a numeric port".into()),
                (None, Some(_)) => return Err("endPort needs a port".into()),
                (None, None) => {}
            }
        }
    }
    if let Some(s) = &spec.pod_selector {
        validate_selector(s)?;
    }
    Ok(())
}

fn validate_selector(s: &LabelSelector) -> Result<(), String> {
    for r in s.match_expressions.iter().flatten() {
        let values = r.values.as_deref().unwrap_or_default();
        match r.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => return Err(format!("{} on {:?} needs values", r.operator, r.key)),
            "Exists" | "DoesNotExist" if !values.is_empty() => {
                return Err(format!("{} on {:?} takes no values", r.operator, r.key));
            }
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => return Err(format!("selector operator {other:?} is unknown")),
        }
    }
    Ok(())
}

/// Does `sel` match `labels`? An empty selector matches everything; every matchLabels pair
/// and every expression must hold (label selector semantics).
pub fn matches(sel: &LabelSelector, labels: &Labels) -> bool {
    for (k, v) in sel.match_labels.iter().flatten() {
        if labels.get(k) != Some(v) {
            return false;
        }
    }
    for r in sel.match_expressions.iter().flatten() {
        let values = r.values.as_deref().unwrap_or_default();
        let have = labels.get(&r.key);
        let ok = match r.operator.as_str() {
            "In" => have.is_some_and(|v| values.contains(v)),
            "NotIn" => have.is_none_or(|v| !values.contains(v)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    true
}

/// The directions a policy isolates: `policyTypes`, or by default Ingress, plus Egress when
/// it has egress rules.
pub fn directions(spec: &NetworkPolicySpec) -> (bool, bool) {
    match &spec.policy_types {
        Some(t) if !t.is_empty() => (t.iter().any(|x| x == "Ingress"), t.iter().any(|x| x == "Egress")),
        _ => (true, spec.egress.is_some()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: if values.is_empty() { None } else { Some(values.iter().map(|s| s.to_string()).collect()) },
        }
    }

    #[test]
    fn protocols_print_and_sort_as_before() {
        // Port-set ids hash `{protocol:?}`, and a pod's named ports sort by protocol: the
        // generated enum must print and order TCP, UDP and SCTP as the names below.
        let parsed = [None, Some("TCP"), Some("UDP"), Some("SCTP")].map(|p| protocol(p).unwrap());
        assert_eq!(parsed.map(|p| format!("{p:?}")), ["Tcp", "Tcp", "Udp", "Sctp"]);
        assert!(parsed[1] < parsed[2] && parsed[2] < parsed[3]);
        assert_eq!(protocol(Some("ICMP")), None);
        assert_eq!(protocol(Some("tcp")), None);
    }

    #[test]
    fn selectors_follow_label_selector_semantics() {
        let l = labels(&[("pod", "a"), ("tier", "web")]);
        assert!(matches(&LabelSelector::default(), &l), "empty selects all");
        let by = |ml: &[(&str, &str)], ex: Vec<LabelSelectorRequirement>| LabelSelector {
            match_labels: if ml.is_empty() { None } else { Some(labels(ml)) },
            match_expressions: if ex.is_empty() { None } else { Some(ex) },
        };
        assert!(matches(&by(&[("pod", "a")], vec![]), &l));
        assert!(!matches(&by(&[("pod", "b")], vec![]), &l));
        assert!(matches(&by(&[], vec![expr("pod", "In", &["a", "b"])]), &l));
        assert!(!matches(&by(&[], vec![expr("pod", "NotIn", &["a"])]), &l));
        assert!(matches(&by(&[], vec![expr("missing", "NotIn", &["a"])]), &l), "NotIn holds for an absent key");
        assert!(matches(&by(&[], vec![expr("tier", "Exists", &[])]), &l));
        assert!(matches(&by(&[], vec![expr("x", "DoesNotExist", &[])]), &l));
        assert!(!matches(&by(&[("pod", "a")], vec![expr("tier", "DoesNotExist", &[])]), &l), "all must hold");
    }

    #[test]
    fn default_policy_types() {
        let mut s = NetworkPolicySpec::default();
        assert_eq!(directions(&s), (true, false));
        s.egress = Some(vec![]);
        assert_eq!(directions(&s), (true, true), "an egress section adds Egress");
        s.policy_types = Some(vec!["Egress".into()]);
        assert_eq!(directions(&s), (false, true));
    }

    #[test]
    fn invalid_specs_are_refused() {
        let bad: serde_json::Value = serde_json::json!([
            {"policyTypes": ["Sideways"]},
            {"ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["11.0.0.0/16"]}}]}]},
            {"ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}]},
            {"ingress": [{"ports": [{"port": "http", "endPort": 90}]}]},
            {"ingress": [{"ports": [{"port": 90, "endPort": 80}]}]},
            {"egress": [{"ports": [{"protocol": "ICMP"}]}]},
            {"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}},
        ]);
        for b in bad.as_array().unwrap() {
            let spec: NetworkPolicySpec = serde_json::from_value(b.clone()).unwrap();
            assert!(validate_spec(&spec).is_err(), "{b}");
        }
        let good: NetworkPolicySpec = serde_json::from_value(serde_json::json!({
            "podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
            "ports": [{"port": 80, "endPort": 90}, {"port": "serve-80-tcp"}, {"protocol": "SCTP"}]}]
        }))
        .unwrap();
        validate_spec(&good).unwrap();
    }
}
