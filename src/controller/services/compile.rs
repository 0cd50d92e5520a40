//! One Service and its EndpointSlices, compiled into the ports every node proxies.
//!
//! What kube-proxy reads, read the same way: headless and ExternalName Services and those
//! another proxy claims (`service.kubernetes.io/service-proxy-name`) are not proxied; an
//! EndpointSlice belongs to the Service its `kubernetes.io/service-name` label names; a
//! slice port serves the Service port of the same name and protocol (the name a named
//! `targetPort` was resolved under); an endpoint's first address is its address, `ready`
//! and `serving` default to true and `terminating` to false; of two endpoints with the same
//! address the one not terminating wins. Which endpoints a node then uses is the node's
//! choice ([`crate::net::services`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::controller::policy::model::protocol;
use crate::rpc::controller as pb;

pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
pub const PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";
/// kube-apiserver's default for `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_SECONDS: u32 = 10800;

fn protocol_name(p: pb::Protocol) -> &'static str {
    match p {
        pb::Protocol::Udp => "UDP",
        pb::Protocol::Sctp => "SCTP",
        _ => "TCP",
    }
}

/// The id of a service port: `namespace/name/protocol/port-name`.
pub fn port_id(ns: &str, name: &str, proto: pb::Protocol, port_name: &str) -> String {
    format!("{ns}/{name}/{}/{port_name}", protocol_name(proto))
}

/// Whether this proxy serves the Service at all.
pub fn proxied(svc: &Service) -> bool {
    let Some(spec) = &svc.spec else { return false };
    let claimed = svc.metadata.labels.as_ref().is_some_and(|l| l.contains_key(PROXY_NAME_LABEL));
    let headless = spec.cluster_ip.as_deref() == Some("None");
    !claimed && !headless && spec.type_.as_deref() != Some("ExternalName")
}

/// The ports of `svc`, with the endpoints of `slices` (the slices of this Service).
pub fn compile(svc: &Service, slices: &[&EndpointSlice]) -> Vec<pb::ServicePort> {
    if !proxied(svc) {
        return Vec::new();
    }
    let spec = svc.spec.as_ref().expect("proxied() checked it");
    let ns = svc.metadata.namespace.as_deref().unwrap_or("default");
    let name = svc.metadata.name.as_deref().unwrap_or_default();
    let cluster_ips = cluster_ips(spec);
    let external_ips = external_ips(svc);
    let node_ports = matches!(spec.type_.as_deref(), Some("NodePort") | Some("LoadBalancer"));
    let affinity = affinity_seconds(spec);
    let mut out = Vec::new();
    for p in spec.ports.iter().flatten() {
        let Some(proto) = protocol(p.protocol.as_deref()) else { continue };
        let Some(port) = port_number(p.port) else { continue };
        let port_name = p.name.clone().unwrap_or_default();
        out.push(pb::ServicePort {
            id: port_id(ns, name, proto, &port_name),
            protocol: proto as i32,
            port,
            cluster_ips: cluster_ips.clone(),
            external_ips: external_ips.clone(),
            node_port: if node_ports { p.node_port.and_then(port_number).unwrap_or(0) } else { 0 },
            external_local: spec.external_traffic_policy.as_deref() == Some("Local"),
            internal_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
            affinity_seconds: affinity,
            endpoints: endpoints(slices, &port_name, proto),
        });
    }
    out
}

/// A port number as the API allows it: 1 to 65535.
fn port_number(n: i32) -> Option<u32> {
    u16::try_from(n).ok().filter(|p| *p > 0).map(u32::from)
}

/// Why the API server would refuse the ports of `svc` or `slice`, if it would: local mode
/// refuses such objects (the API server does in Kubernetes mode), and [`compile`] skips
/// such a port, so no node is ever sent one that nftables cannot take.
pub fn invalid_ports(svc: Option<&Service>, slice: Option<&EndpointSlice>) -> Option<String> {
    let svc_ports = svc.and_then(|s| s.spec.as_ref()).and_then(|s| s.ports.as_ref());
    for p in svc_ports.into_iter().flatten() {
        if port_number(p.port).is_none() {
            return Some(format!("port {} is not in 1-65535", p.port));
        }
        if let Some(n) = p.node_port.filter(|n| *n != 0 && port_number(*n).is_none()) {
            return Some(format!("nodePort {n} is not in 1-65535"));
        }
    }
    let slice_ports = slice.and_then(|s| s.ports.as_ref());
    let bad = slice_ports.into_iter().flatten().filter_map(|p| p.port).find(|n| port_number(*n).is_none());
    bad.map(|n| format!("port {n} is not in 1-65535"))
}

fn cluster_ips(spec: &k8s_openapi::api::core::v1::ServiceSpec) -> Vec<String> {
    let mut ips: Vec<String> = spec.cluster_ips.clone().unwrap_or_default();
    if ips.is_empty() {
        ips.extend(spec.cluster_ip.clone());
    }
    ips.retain(|ip| ip.parse::<std::net::IpAddr>().is_ok());
    ips
}

/// `spec.externalIPs` and the load balancer's ingress addresses in VIP mode (an ingress of
/// `ipMode: Proxy` is the load balancer's to forward, as kube-proxy leaves it).
fn external_ips(svc: &Service) -> Vec<String> {
    let mut ips: Vec<String> = svc.spec.as_ref().and_then(|s| s.external_ips.clone()).unwrap_or_default();
    let ingress = svc.status.as_ref().and_then(|s| s.load_balancer.as_ref()).and_then(|lb| lb.ingress.as_ref());
    for i in ingress.into_iter().flatten() {
        if i.ip_mode.as_deref().is_none_or(|m| m == "VIP") {
            ips.extend(i.ip.clone());
        }
    }
    ips.retain(|ip| ip.parse::<std::net::IpAddr>().is_ok());
    ips.sort();
    ips.dedup();
    ips
}

fn affinity_seconds(spec: &k8s_openapi::api::core::v1::ServiceSpec) -> u32 {
    if spec.session_affinity.as_deref() != Some("ClientIP") {
        return 0;
    }
    let t = spec.session_affinity_config.as_ref().and_then(|c| c.client_ip.as_ref()).and_then(|c| c.timeout_seconds);
    t.and_then(|t| u32::try_from(t).ok()).filter(|t| *t > 0).unwrap_or(DEFAULT_AFFINITY_SECONDS)
}

/// The endpoints serving the port named `port_name` (and `proto`), one per address.
fn endpoints(slices: &[&EndpointSlice], port_name: &str, proto: pb::Protocol) -> Vec<pb::ServiceEndpoint> {
    let mut by_ip: BTreeMap<String, pb::ServiceEndpoint> = BTreeMap::new();
    for s in slices {
        if s.address_type != "IPv4" && s.address_type != "IPv6" {
            continue;
        }
        let port = s.ports.iter().flatten().find(|p| {
            p.name.as_deref().unwrap_or_default() == port_name && protocol(p.protocol.as_deref()) == Some(proto)
        });
        let Some(port) = port.and_then(|p| p.port).and_then(port_number) else {
            continue;
        };
        for e in &s.endpoints {
            let Some(ip) = e.addresses.first().filter(|a| a.parse::<std::net::IpAddr>().is_ok()) else { continue };
            let c = e.conditions.clone().unwrap_or_default();
            let ep = pb::ServiceEndpoint {
                ip: ip.clone(),
                port,
                node: e.node_name.clone().unwrap_or_default(),
                ready: c.ready.unwrap_or(true),
                serving: c.serving.unwrap_or(true),
                terminating: c.terminating.unwrap_or(false),
            };
            match by_ip.get(ip) {
                Some(old) if !old.terminating && ep.terminating => {}
                _ => {
                    by_ip.insert(ip.clone(), ep);
                }
            }
        }
    }
    by_ip.into_values().collect()
}

/// The Service a slice belongs to (`namespace`, `name`).
pub fn owner(slice: &EndpointSlice) -> Option<(String, String)> {
    let ns = slice.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?.clone();
    Some((ns, name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(v: serde_json::Value) -> Service {
        serde_json::from_value(v).unwrap()
    }

    fn slice(v: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn named_ports_take_the_slice_port_of_the_same_name_and_protocol() {
        let s = svc(json!({"metadata": {"namespace": "a", "name": "web"}, "spec": {
            "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::a"],
            "ports": [{"name": "http", "port": 80, "targetPort": "web"},
                      {"name": "dns", "port": 53, "protocol": "UDP"}]}}));
        let sl = slice(json!({"metadata": {"namespace": "a", "name": "web-1",
                                           "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 5353, "protocol": "UDP"},
                      {"name": "http", "port": 9999, "protocol": "UDP"}],
            "endpoints": [{"addresses": ["10.244.0.5"], "nodeName": "n1"},
                          {"addresses": ["10.244.1.5"], "nodeName": "n2",
                           "conditions": {"ready": false, "serving": true, "terminating": true}}]}));
        let ports = compile(&s, &[&sl]);
        assert_eq!(ports.len(), 2);
        let http = &ports[0];
        assert_eq!(http.id, "a/web/TCP/http");
        assert_eq!(http.cluster_ips, vec!["10.96.0.10", "fd00::a"]);
        assert_eq!(
            http.endpoints.iter().map(|e| (e.ip.as_str(), e.port)).collect::<Vec<_>>(),
            vec![("10.244.0.5", 8080), ("10.244.1.5", 8080)]
        );
        assert!(http.endpoints[0].ready && !http.endpoints[0].terminating);
        assert!(!http.endpoints[1].ready && http.endpoints[1].serving && http.endpoints[1].terminating);
        assert_eq!(ports[1].id, "a/web/UDP/dns");
        assert_eq!(ports[1].endpoints[0].port, 5353);
    }

    #[test]
    fn ports_out_of_range_are_refused_and_never_compiled() {
        let s = svc(json!({"metadata": {"namespace": "a", "name": "web"}, "spec": {
            "type": "NodePort", "clusterIP": "10.96.0.10",
            "ports": [{"name": "a", "port": 70000}, {"name": "b", "port": 80, "nodePort": 70000},
                      {"name": "c", "port": 81, "nodePort": 30081}]}}));
        let sl = slice(json!({"metadata": {"namespace": "a", "name": "web-1",
                                           "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4", "ports": [{"name": "c", "port": 65536}],
            "endpoints": [{"addresses": ["10.244.0.5"]}]}));
        assert_eq!(invalid_ports(Some(&s), None).as_deref(), Some("port 70000 is not in 1-65535"));
        assert_eq!(invalid_ports(None, Some(&sl)).as_deref(), Some("port 65536 is not in 1-65535"));
        let ports = compile(&s, &[&sl]);
        let got: Vec<_> = ports.iter().map(|p| (p.port, p.node_port, p.endpoints.len())).collect();
        assert_eq!(got, vec![(80, 0, 0), (81, 30081, 0)], "no port, nodePort or endpoint port out of range");
        let mut ok = s.clone();
        ok.spec.as_mut().unwrap().ports.as_mut().unwrap().drain(..2);
        assert_eq!(invalid_ports(Some(&ok), None), None);
    }

    #[test]
    fn headless_external_name_and_claimed_services_are_not_proxied() {
        for spec in [
            json!({"clusterIP": "None", "ports": [{"port": 80}]}),
            json!({"type": "ExternalName", "externalName": "x.example", "ports": [{"port": 80}]}),
        ] {
            assert!(compile(&svc(json!({"metadata": {"name": "x"}, "spec": spec})), &[]).is_empty());
        }
        let claimed = svc(json!({"metadata": {"name": "x", "labels": {PROXY_NAME_LABEL: "other"}},
                                 "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}}));
        assert!(compile(&claimed, &[]).is_empty());
    }

    #[test]
    fn node_ports_external_addresses_policies_and_affinity() {
        let s = svc(json!({"metadata": {"namespace": "a", "name": "lb"}, "spec": {
            "type": "LoadBalancer", "clusterIP": "10.96.0.20", "externalIPs": ["192.0.2.7"],
            "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local", "sessionAffinity": "ClientIP",
            "ports": [{"port": 443, "nodePort": 30443}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.1"}, {"ip": "203.0.113.2", "ipMode": "Proxy"},
                                                    {"hostname": "lb.example"}]}}}));
        let p = &compile(&s, &[])[0];
        assert_eq!(p.node_port, 30443);
        assert_eq!(p.external_ips, vec!["192.0.2.7", "203.0.113.1"]);
        assert!(p.external_local && p.internal_local);
        assert_eq!(p.affinity_seconds, DEFAULT_AFFINITY_SECONDS);
        assert!(p.endpoints.is_empty());
        // A ClusterIP Service has no node port even when one is written.
        let c = svc(json!({"metadata": {"name": "c"}, "spec": {"clusterIP": "10.96.0.21",
            "ports": [{"port": 80, "nodePort": 30080}], "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}}}}));
        let p = &compile(&c, &[])[0];
        assert_eq!((p.node_port, p.affinity_seconds), (0, 30));
    }

    #[test]
    fn of_two_endpoints_with_one_address_the_one_not_terminating_wins() {
        let s = svc(json!({"metadata": {"name": "d"}, "spec": {"clusterIP": "10.96.0.30", "ports": [{"port": 80}]}}));
        let mk = |name: &str, terminating: bool| {
            slice(json!({"metadata": {"name": name,
            "labels": {"kubernetes.io/service-name": "d"}}, "addressType": "IPv4", "ports": [{"port": 80}],
            "endpoints": [{"addresses": ["10.244.0.9"], "conditions": {"terminating": terminating}}]}))
        };
        let (a, b) = (mk("d-1", false), mk("d-2", true));
        for order in [[&a, &b], [&b, &a]] {
            let p = &compile(&s, &order)[0];
            assert_eq!(p.endpoints.len(), 1);
            assert!(!p.endpoints[0].terminating);
        }
    }
}

/// Services and EndpointSlices through the controller's compilation and a node's plan,
/// against a reference model of kube-proxy's semantics written from the objects directly.
#[cfg(test)]
mod model {
    use std::collections::BTreeSet;

    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::compile;
    use crate::net::services::{Fam, Target, plan};

    const NODES: [&str; 3] = ["n1", "n2", "n3"];

    #[derive(Debug, Clone, PartialEq)]
    enum Outcome {
        To(BTreeSet<(String, u32)>, bool),
        Reject,
        Drop,
    }

    #[derive(Debug, Clone, Copy)]
    enum Src {
        Pod,
        Host,
        Outside,
    }

    fn cond() -> impl Strategy<Value = Option<bool>> {
        prop_oneof![Just(None), Just(Some(true)), Just(Some(false))]
    }

    fn endpoint(fam6: bool) -> impl Strategy<Value = Value> {
        (0u8..12, prop::option::of(0usize..3), cond(), cond(), cond()).prop_map(move |(i, node, r, s, t)| {
            let ip = if fam6 { format!("fd00::{}", i + 1) } else { format!("10.1.0.{}", i + 1) };
            let mut c = serde_json::Map::new();
            for (k, v) in [("ready", r), ("serving", s), ("terminating", t)] {
                if let Some(v) = v {
                    c.insert(k.into(), v.into());
                }
            }
            let mut e = json!({"addresses": [ip], "conditions": c});
            if let Some(n) = node {
                e["nodeName"] = NODES[n].into();
            }
            e
        })
    }

    fn slice(i: usize) -> impl Strategy<Value = Value> {
        any::<bool>().prop_flat_map(move |fam6| {
            (prop::collection::vec(endpoint(fam6), 0..5), 1u16..4).prop_map(move |(eps, port)| {
                json!({"metadata": {"namespace": "a", "name": format!("s-{i}"),
                                    "labels": {"kubernetes.io/service-name": "svc"}},
                       "addressType": if fam6 { "IPv6" } else { "IPv4" },
                       "ports": [{"name": "p", "port": 8000 + port, "protocol": "TCP"}], "endpoints": eps})
            })
        })
    }

    fn service() -> impl Strategy<Value = Value> {
        (0usize..3, any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(ty, dual, etp, itp, ext)| {
            let ty = ["ClusterIP", "NodePort", "LoadBalancer"][ty];
            let ips = if dual { json!(["10.96.0.10", "fd00:96::a"]) } else { json!(["10.96.0.10"]) };
            json!({"metadata": {"namespace": "a", "name": "svc"}, "spec": {
                "type": ty, "clusterIP": "10.96.0.10", "clusterIPs": ips,
                "externalTrafficPolicy": if etp { "Local" } else { "Cluster" },
                "internalTrafficPolicy": if itp { "Local" } else { "Cluster" },
                "externalIPs": if ext { json!(["192.0.2.10"]) } else { json!([]) },
                "ports": [{"name": "p", "port": 80, "protocol": "TCP", "nodePort": 30080}]}})
        })
    }

    /// kube-proxy, from the objects: the endpoints of port "p" (first address; ready and
    /// serving default true, terminating false; one per address, not terminating first).
    fn reference(svc: &Value, slices: &[Value], node: &str, fam: Fam, dest: &str, src: Src) -> Option<Outcome> {
        let mut by_ip: std::collections::BTreeMap<String, (u32, String, bool, bool, bool)> = Default::default();
        for s in slices {
            let want = if fam == Fam::V6 { "IPv6" } else { "IPv4" };
            if s["addressType"] != want {
                continue;
            }
            let port = s["ports"][0]["port"].as_u64().unwrap() as u32;
            for e in s["endpoints"].as_array().unwrap() {
                let ip = e["addresses"][0].as_str().unwrap().to_string();
                let c = &e["conditions"];
                let ready = c["ready"].as_bool().unwrap_or(true);
                let serving = c["serving"].as_bool().unwrap_or(true);
                let term = c["terminating"].as_bool().unwrap_or(false);
                let n = e["nodeName"].as_str().unwrap_or("").to_string();
                if by_ip.get(&ip).is_some_and(|o| !o.4 && term) {
                    continue;
                }
                by_ip.insert(ip, (port, n, ready, serving, term));
            }
        }
        let usable = |local: bool| -> BTreeSet<(String, u32)> {
            let set: Vec<_> = by_ip.iter().filter(|(_, e)| !local || e.1 == node).collect();
            let ready: BTreeSet<_> = set.iter().filter(|(_, e)| e.2).map(|(ip, e)| ((*ip).clone(), e.0)).collect();
            if !ready.is_empty() {
                return ready;
            }
            set.iter().filter(|(_, e)| e.3 && e.4).map(|(ip, e)| ((*ip).clone(), e.0)).collect()
        };
        let spec = &svc["spec"];
        let all = usable(false);
        let pod = matches!(src, Src::Pod);
        if dest == "cluster" {
            if all.is_empty() {
                return Some(Outcome::Reject);
            }
            let eps = if spec["internalTrafficPolicy"] == "Local" { usable(true) } else { all };
            return Some(if eps.is_empty() { Outcome::Drop } else { Outcome::To(eps, !pod) });
        }
        if dest == "nodeport" && spec["type"] == "ClusterIP" {
            return None;
        }
        if all.is_empty() {
            return Some(Outcome::Reject);
        }
        if spec["externalTrafficPolicy"] != "Local" {
            return Some(Outcome::To(all, true));
        }
        Some(match src {
            Src::Pod => Outcome::To(all, false),
            Src::Host => Outcome::To(all, true),
            Src::Outside => {
                let local = usable(true);
                if local.is_empty() { Outcome::Drop } else { Outcome::To(local, false) }
            }
        })
    }

    /// What the node's table does with the target, for a connection from `src`.
    fn interpret(t: &Target, cluster_path: bool, src: Src) -> Outcome {
        let set = |eps: &[crate::net::services::Ep]| eps.iter().map(|e| (e.ip.to_string(), e.port as u32)).collect();
        let pod = matches!(src, Src::Pod);
        match t {
            Target::Reject => Outcome::Reject,
            Target::Drop => Outcome::Drop,
            // ClusterIP: masqueraded when the source is outside the pod pools.
            Target::Dnat { eps, masquerade } => Outcome::To(set(eps), *masquerade || (cluster_path && !pod)),
            Target::Split { cluster, local } => match src {
                Src::Pod => Outcome::To(set(cluster), false),
                Src::Host => Outcome::To(set(cluster), true),
                Src::Outside if local.is_empty() => Outcome::Drop,
                Src::Outside => Outcome::To(set(local), false),
            },
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn every_node_proxies_as_kube_proxy_would(svc in service(), slices in prop::collection::vec(0usize..1, 0..3)
            .prop_flat_map(|v| v.into_iter().enumerate().map(|(i, _)| slice(i)).collect::<Vec<_>>())) {
            let s: k8s_openapi::api::core::v1::Service = serde_json::from_value(svc.clone()).unwrap();
            let sl: Vec<k8s_openapi::api::discovery::v1::EndpointSlice> =
                slices.iter().map(|v| serde_json::from_value(v.clone()).unwrap()).collect();
            let refs: Vec<_> = sl.iter().collect();
            let ports = compile(&s, &refs);
            prop_assert_eq!(ports.len(), 1);
            for node in NODES {
                let p = plan(&ports[0], node);
                for src in [Src::Pod, Src::Host, Src::Outside] {
                    for (ip, t) in &p.cluster_ips {
                        let fam = Fam::of(ip);
                        prop_assert_eq!(Some(interpret(t, true, src)), reference(&svc, &slices, node, fam, "cluster", src),
                            "{} {} {:?} {:?}", node, ip, src, t);
                    }
                    for (ip, t) in &p.external_ips {
                        prop_assert_eq!(Some(interpret(t, false, src)),
                            reference(&svc, &slices, node, Fam::of(ip), "external", src));
                    }
                    for fam in [Fam::V4, Fam::V6] {
                        let got = p.node_port.iter().find(|(f, _)| *f == fam).map(|(_, t)| interpret(t, false, src));
                        let has_fam = p.cluster_ips.iter().any(|(ip, _)| Fam::of(ip) == fam);
                        let want = if has_fam { reference(&svc, &slices, node, fam, "nodeport", src) } else { None };
                        prop_assert_eq!(got, want, "nodeport {:?} {:?}", fam, src);
                    }
                }
            }
        }
    }
}
