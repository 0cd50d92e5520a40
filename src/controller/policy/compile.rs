//! NetworkPolicy compiled for each node: which of its pods are isolated, by which policies,
//! and what those policies allow, with every selector resolved to the addresses of the pods
//! it matches.
//!
//! Pods isolated by the same policies (per direction) share a group; a policy's rules are
//! compiled once per direction and referenced by every group that holds it; a peer selector
//! becomes one address set, shared by every rule that uses the same selector. The state a
//! node holds therefore grows with its pods plus the policies, not their product: a pod is
//! one dispatch entry per direction, a policy one chain, a distinct selector one set.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::networking::v1::{NetworkPolicyPeer, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::model::{self, Key, Objects, key_text, matches};
use crate::rpc::controller as pb;

/// What one node is sent: every item the node's isolated pods need, by id.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeView {
    pub address_sets: BTreeMap<String, pb::AddressSet>,
    pub port_sets: BTreeMap<String, pb::PortSet>,
    pub policies: BTreeMap<String, pb::CompiledPolicy>,
    pub groups: BTreeMap<String, pb::PolicyGroup>,
    pub pods: BTreeMap<String, pb::LocalPod>,
}

impl NodeView {
    /// The changes that turn `old` into `self`, as one update (empty lists: nothing changed).
    pub fn delta_from(&self, old: &NodeView, revision: u64) -> pb::PolicyUpdate {
        fn diff<T: Clone + PartialEq>(new: &BTreeMap<String, T>, old: &BTreeMap<String, T>) -> (Vec<T>, Vec<String>) {
            let changed = new.iter().filter(|(k, v)| old.get(*k) != Some(v)).map(|(_, v)| v.clone()).collect();
            let removed = old.keys().filter(|k| !new.contains_key(*k)).cloned().collect();
            (changed, removed)
        }
        let (address_sets, removed_address_sets) = diff(&self.address_sets, &old.address_sets);
        let (port_sets, removed_port_sets) = diff(&self.port_sets, &old.port_sets);
        let (policies, removed_policies) = diff(&self.policies, &old.policies);
        let (groups, removed_groups) = diff(&self.groups, &old.groups);
        let (pods, removed_pods) = diff(&self.pods, &old.pods);
        pb::PolicyUpdate {
            revision,
            snapshot: false,
            address_sets,
            removed_address_sets,
            port_sets,
            removed_port_sets,
            policies,
            removed_policies,
            groups,
            removed_groups,
            pods,
            removed_pods,
        }
    }

    pub fn snapshot(&self, revision: u64) -> pb::PolicyUpdate {
        let mut u = self.delta_from(&NodeView::default(), revision);
        u.snapshot = true;
        u
    }

    /// Is the pod `key` isolated in either direction?
    pub fn isolates(&self, key: &str) -> bool {
        self.pods.get(key).is_some_and(|p| !p.ingress_group.is_empty() || !p.egress_group.is_empty())
    }
}

/// Does `u` change nothing (every list empty)?
pub fn is_empty(u: &pb::PolicyUpdate) -> bool {
    *u == pb::PolicyUpdate { revision: u.revision, snapshot: u.snapshot, ..Default::default() }
}

/// A short stable id of `parts` (nftables object names are built from it).
fn id_of(parts: &[&[u8]]) -> String {
    format!("{:012x}", crate::util::fnv1a(parts) & 0xffff_ffff_ffff)
}

fn policy_id(key: &Key, egress: bool) -> String {
    id_of(&[key.0.as_bytes(), key.1.as_bytes(), if egress { b"e" } else { b"i" }])
}

fn host_cidr(ip: &IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
}

/// The pods a selector peer matches, from the pods the agents attached.
fn peer_pods<'a>(o: &'a Objects, policy_ns: &str, peer: &NetworkPolicyPeer) -> Vec<(&'a Key, &'a model::Attached)> {
    let ns_labels: BTreeMap<&str, model::Labels> = match &peer.namespace_selector {
        Some(_) => o.attached.keys().map(|k| (k.0.as_str(), o.namespace_labels(&k.0))).collect(),
        None => BTreeMap::new(),
    };
    o.attached
        .iter()
        .filter(|(k, _)| match &peer.namespace_selector {
            Some(sel) => ns_labels.get(k.0.as_str()).is_some_and(|l| matches(sel, l)),
            None => k.0 == policy_ns,
        })
        .filter(|(k, _)| match &peer.pod_selector {
            Some(sel) => matches(sel, &o.pods.get(*k).map(|p| p.labels.clone()).unwrap_or_default()),
            None => true,
        })
        .collect()
}

/// The id of the address set of a selector peer (shared by every rule with the same one).
fn selector_set_id(policy_ns: &str, peer: &NetworkPolicyPeer) -> String {
    let scope = if peer.namespace_selector.is_some() { String::new() } else { policy_ns.to_string() };
    let ns = serde_json::to_string(&peer.namespace_selector).unwrap_or_default();
    let pod = serde_json::to_string(&peer.pod_selector).unwrap_or_default();
    id_of(&[scope.as_bytes(), b"|", ns.as_bytes(), b"|", pod.as_bytes()])
}

/// One direction of one policy compiled for one node. `local`: the node's pods the policy
/// selects (named ingress ports are resolved on them).
struct Compiler<'a> {
    o: &'a Objects,
    view: &'a mut NodeView,
    /// Address sets already computed (by id) in this pass, shared across nodes.
    sets: &'a mut BTreeMap<String, pb::AddressSet>,
}

impl Compiler<'_> {
    fn compile(&mut self, key: &Key, spec: &NetworkPolicySpec, egress: bool, local: &[&Key]) -> pb::CompiledPolicy {
        let id = policy_id(key, egress);
        let rules: Vec<_> = if egress {
            spec.egress.iter().flatten().map(|r| (r.to.as_ref(), r.ports.as_ref())).collect()
        } else {
            spec.ingress.iter().flatten().map(|r| (r.from.as_ref(), r.ports.as_ref())).collect()
        };
        let mut out = Vec::new();
        for (peers, ports) in rules {
            let peers = peers.filter(|p| !p.is_empty());
            let mut rule = pb::PolicyRule::default();
            for peer in peers.into_iter().flatten() {
                let m = match &peer.ip_block {
                    Some(b) => pb::peer_match::Peer::IpBlock(pb::IpBlockMatch {
                        cidr: b.cidr.clone(),
                        except: b.except.clone().unwrap_or_default(),
                    }),
                    None => pb::peer_match::Peer::AddressSet(self.selector_set(&key.0, peer)),
                };
                rule.peers.push(pb::PeerMatch { peer: Some(m) });
            }
            let mut named = Vec::new();
            for port in ports.into_iter().flatten() {
                let protocol = model::protocol(port.protocol.as_deref()).unwrap_or(pb::Protocol::Tcp);
                match &port.port {
                    Some(IntOrString::String(name)) => named.push((name.clone(), protocol)),
                    Some(IntOrString::Int(n)) => rule.ports.push(pb::PortMatch {
                        protocol: protocol as i32,
                        port: *n as u32,
                        end_port: port.end_port.unwrap_or(0).max(0) as u32,
                    }),
                    None => rule.ports.push(pb::PortMatch { protocol: protocol as i32, port: 0, end_port: 0 }),
                }
            }
            for (name, protocol) in named {
                // One set per content, shared by every rule that resolves the same name on the
                // same pods (so sets grow with the distinct selectors, not with the policies):
                // ingress, the pods the policy selects (its namespace and podSelector);
                // egress, the destinations the rule's peers allow.
                let owner = if egress {
                    match peers {
                        None => "*".to_string(),
                        Some(list) => list
                            .iter()
                            .map(|p| match &p.ip_block {
                                Some(b) => serde_json::to_string(b).unwrap_or_default(),
                                None => selector_set_id(&key.0, p),
                            })
                            .collect::<Vec<_>>()
                            .join(","),
                    }
                } else {
                    format!("{}|{}", key.0, serde_json::to_string(&spec.pod_selector).unwrap_or_default())
                };
                let direction: &[u8] = if egress { b"e" } else { b"i" };
                let proto = format!("{protocol:?}");
                let set_id = id_of(&[
                    b"port|",
                    direction,
                    b"|",
                    owner.as_bytes(),
                    b"|",
                    name.as_bytes(),
                    b"|",
                    proto.as_bytes(),
                ]);
                if !rule.port_sets.contains(&set_id) {
                    rule.port_sets.push(set_id.clone());
                }
                if self.view.port_sets.contains_key(&set_id) {
                    continue;
                }
                // Ingress: the name on the selected pod itself; egress: on the destination,
                // any pod the rule's peers allow (every pod when it names none).
                let holders: Vec<&Key> = if egress {
                    match peers {
                        None => self.o.attached.keys().collect(),
                        Some(list) => {
                            let mut keys = BTreeSet::new();
                            for peer in list {
                                match &peer.ip_block {
                                    None => keys.extend(peer_pods(self.o, &key.0, peer).into_iter().map(|(k, _)| k)),
                                    Some(b) => keys.extend(
                                        self.o
                                            .attached
                                            .iter()
                                            .filter(|(_, a)| a.ips.iter().any(|ip| in_block(ip, b)))
                                            .map(|(k, _)| k),
                                    ),
                                }
                            }
                            keys.into_iter().collect()
                        }
                    }
                } else {
                    local.to_vec()
                };
                let mut targets = Vec::new();
                for k in holders {
                    let (Some(info), Some(at)) = (self.o.pods.get(k), self.o.attached.get(k)) else { continue };
                    for p in info.ports.iter().filter(|p| p.name == name && p.protocol == protocol) {
                        for ip in &at.ips {
                            targets.push(pb::PortTarget {
                                ip: ip.to_string(),
                                protocol: protocol as i32,
                                port: p.port as u32,
                            });
                        }
                    }
                }
                targets.sort_by(|a, b| (&a.ip, a.protocol, a.port).cmp(&(&b.ip, b.protocol, b.port)));
                targets.dedup();
                self.view.port_sets.insert(set_id.clone(), pb::PortSet { id: set_id, targets });
            }
            out.push(rule);
        }
        pb::CompiledPolicy { id, name: key_text(key), egress, rules: out }
    }

    fn selector_set(&mut self, policy_ns: &str, peer: &NetworkPolicyPeer) -> String {
        let id = selector_set_id(policy_ns, peer);
        if !self.sets.contains_key(&id) {
            let mut cidrs: Vec<String> =
                peer_pods(self.o, policy_ns, peer).iter().flat_map(|(_, a)| a.ips.iter().map(host_cidr)).collect();
            cidrs.sort();
            cidrs.dedup();
            self.sets.insert(id.clone(), pb::AddressSet { id: id.clone(), cidrs });
        }
        self.view.address_sets.insert(id.clone(), self.sets[&id].clone());
        id
    }
}

fn in_block(ip: &IpAddr, b: &k8s_openapi::api::networking::v1::IPBlock) -> bool {
    let inside = |c: &str| c.parse::<ipnetwork::IpNetwork>().is_ok_and(|n| n.contains(*ip));
    inside(&b.cidr) && !b.except.iter().flatten().any(|e| inside(e))
}

/// Every node's view (nodes with attached pods; a node without any gets an empty one from
/// the caller).
pub fn compile(o: &Objects) -> BTreeMap<String, NodeView> {
    // Which attached pods each policy selects, per direction.
    let mut isolating: BTreeMap<&Key, (Vec<&Key>, Vec<&Key>)> = BTreeMap::new();
    for (pk, spec) in &o.policies {
        let (ing, eg) = model::directions(spec);
        let selector = spec.pod_selector.clone().unwrap_or_default();
        for (k, _) in o.attached.iter().filter(|(k, _)| k.0 == pk.0) {
            let labels = o.pods.get(k).map(|p| p.labels.clone()).unwrap_or_default();
            if matches(&selector, &labels) {
                let e = isolating.entry(k).or_default();
                if ing {
                    e.0.push(pk);
                }
                if eg {
                    e.1.push(pk);
                }
            }
        }
    }
    let mut views: BTreeMap<String, NodeView> = BTreeMap::new();
    let mut sets = BTreeMap::new();
    // Per node: the policies its pods need, per direction, and the local pods they select.
    let mut needed: BTreeMap<&str, BTreeMap<(&Key, bool), Vec<&Key>>> = BTreeMap::new();
    for (k, at) in &o.attached {
        let view = views.entry(at.node.clone()).or_default();
        let (ing, eg) = isolating.get(k).cloned().unwrap_or_default();
        let group = |pols: &[&Key], egress: bool| -> Option<pb::PolicyGroup> {
            if pols.is_empty() {
                return None;
            }
            let ids: Vec<String> = pols.iter().map(|p| policy_id(p, egress)).collect();
            let joined = ids.join(",");
            Some(pb::PolicyGroup {
                id: id_of(&[if egress { b"e" } else { b"i" }, joined.as_bytes()]),
                egress,
                policies: ids,
            })
        };
        let gi = group(&ing, false);
        let ge = group(&eg, true);
        let mut ips: Vec<String> = at.ips.iter().map(|i| i.to_string()).collect();
        ips.sort();
        view.pods.insert(
            key_text(k),
            pb::LocalPod {
                key: key_text(k),
                ips,
                ingress_group: gi.as_ref().map(|g| g.id.clone()).unwrap_or_default(),
                egress_group: ge.as_ref().map(|g| g.id.clone()).unwrap_or_default(),
            },
        );
        for g in [gi, ge].into_iter().flatten() {
            view.groups.insert(g.id.clone(), g);
        }
        let n = needed.entry(at.node.as_str()).or_default();
        for p in ing {
            n.entry((p, false)).or_default().push(k);
        }
        for p in eg {
            n.entry((p, true)).or_default().push(k);
        }
    }
    for (node, pols) in needed {
        let view = views.get_mut(node).expect("made above");
        for ((pk, egress), local) in pols {
            let spec = &o.policies[pk];
            let compiled = Compiler { o, view, sets: &mut sets }.compile(pk, spec, egress, &local);
            view.policies.insert(compiled.id.clone(), compiled);
        }
    }
    views
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::networking::v1::NetworkPolicy;

    fn objects() -> Objects {
        let mut o = Objects::default();
        for (ns, nslabels) in [("x", serde_json::json!({"team": "a"})), ("y", serde_json::json!({"team": "b"}))] {
            o.set_namespace(
                &serde_json::from_value(serde_json::json!({"metadata": {"name": ns, "labels": nslabels}})).unwrap(),
            )
            .unwrap();
        }
        for (i, (ns, pod)) in [("x", "a"), ("x", "b"), ("y", "a"), ("y", "b")].into_iter().enumerate() {
            o.set_pod(
                &serde_json::from_value(serde_json::json!({
                    "metadata": {"namespace": ns, "name": pod, "labels": {"pod": pod}},
                    "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8080 + i}]}]}
                }))
                .unwrap(),
            )
            .unwrap();
            o.attached.insert(
                (ns.into(), pod.into()),
                model::Attached {
                    node: if i % 2 == 0 { "n1".into() } else { "n2".into() },
                    ips: vec![format!("10.0.0.{}", i + 1).parse().unwrap()],
                },
            );
        }
        o
    }

    fn apply(o: &mut Objects, ns: &str, name: &str, spec: serde_json::Value) {
        let p: NetworkPolicy =
            serde_json::from_value(serde_json::json!({"metadata": {"namespace": ns, "name": name}, "spec": spec}))
                .unwrap();
        o.set_policy(&p).unwrap();
    }

    #[test]
    fn isolation_groups_rules_and_sets() {
        let mut o = objects();
        apply(
            &mut o,
            "x",
            "allow-from-b",
            serde_json::json!({
                "podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": "b"}}}], "ports": [{"port": 80}, {"port": "http"}]}]
            }),
        );
        let v = compile(&o);
        let n1 = &v["n1"];
        // x/a is on n1 (index 0) and isolated for ingress only.
        let xa = &n1.pods["x/a"];
        assert!(!xa.ingress_group.is_empty() && xa.egress_group.is_empty(), "{xa:?}");
        assert!(n1.pods["y/a"].ingress_group.is_empty(), "a policy selects in its own namespace only");
        let group = &n1.groups[&xa.ingress_group];
        let [pid] = group.policies.as_slice() else { panic!("{group:?}") };
        let pol = &n1.policies[pid];
        assert_eq!(pol.name, "x/allow-from-b");
        let [rule] = pol.rules.as_slice() else { panic!() };
        // The peer `pod: b` in the policy's namespace: x/b only (10.0.0.2), not y/b.
        let Some(pb::peer_match::Peer::AddressSet(set)) = &rule.peers[0].peer else { panic!() };
        assert_eq!(n1.address_sets[set].cidrs, vec!["10.0.0.2/32"]);
        assert_eq!(rule.ports[0].port, 80);
        // The named port resolved on the selected pod itself (x/a: 8080).
        let ps = &n1.port_sets[&rule.port_sets[0]];
        assert_eq!(
            ps.targets,
            vec![pb::PortTarget { ip: "10.0.0.1".into(), protocol: pb::Protocol::Tcp as i32, port: 8080 }]
        );
        // n2 isolates nobody: it gets its pods and nothing else.
        assert!(v["n2"].policies.is_empty() && v["n2"].groups.is_empty() && v["n2"].address_sets.is_empty());
    }

    #[test]
    fn namespace_selectors_egress_named_ports_and_deltas() {
        let mut o = objects();
        apply(
            &mut o,
            "x",
            "egress",
            serde_json::json!({
                "podSelector": {},
                "policyTypes": ["Egress"],
                "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}], "ports": [{"port": "http"}]}]
            }),
        );
        let before = compile(&o);
        let n2 = &before["n2"];
        let xb = &n2.pods["x/b"];
        assert!(xb.ingress_group.is_empty() && !xb.egress_group.is_empty());
        let pol = n2.policies.values().next().unwrap();
        let ps = &n2.port_sets[&pol.rules[0].port_sets[0]];
        // Egress named port: resolved on the destinations the rule allows (namespace y).
        let ips: Vec<&str> = ps.targets.iter().map(|t| t.ip.as_str()).collect();
        assert_eq!(ips, vec!["10.0.0.3", "10.0.0.4"]);
        // A pod label change moves x/b out of nothing (podSelector {}) but a new pod in y
        // joins the set: a delta carries only that.
        o.attached.insert(
            ("y".into(), "c".into()),
            model::Attached { node: "n1".into(), ips: vec!["10.0.0.9".parse().unwrap()] },
        );
        let after = compile(&o);
        let d = after["n2"].delta_from(&before["n2"], 2);
        assert!(d.policies.is_empty() && d.groups.is_empty() && d.pods.is_empty(), "{d:?}");
        assert_eq!(d.address_sets.len(), 1, "the namespace set grew: {d:?}");
        assert!(d.address_sets[0].cidrs.contains(&"10.0.0.9/32".to_string()));
        assert!(is_empty(&after["n2"].delta_from(&after["n2"], 3)));
    }

    #[test]
    fn state_grows_with_pods_plus_policies() {
        // 10 policies all selecting every pod of x: one group, 10 policies, one set per
        // distinct selector, one pod entry per pod.
        let mut o = objects();
        for i in 0..10 {
            apply(
                &mut o,
                "x",
                &format!("p{i}"),
                serde_json::json!({
                    "podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}}], "ports": [{"port": 1000 + i}]}]
                }),
            );
        }
        let v = compile(&o);
        let n1 = &v["n1"];
        assert_eq!(n1.groups.len(), 1);
        assert_eq!(n1.policies.len(), 10);
        assert_eq!(n1.address_sets.len(), 1, "one distinct selector, one set");
        // Named ports too: 10 policies resolving `http` on the same pods share one port set
        // (ingress: the same namespace and podSelector; egress: the same peers), one per
        // direction and distinct selection; another name or selection gets its own.
        let mut o = objects();
        for i in 0..10 {
            apply(
                &mut o,
                "x",
                &format!("n{i}"),
                serde_json::json!({
                    "podSelector": {},
                    "policyTypes": ["Ingress", "Egress"],
                    "ingress": [{"from": [{"podSelector": {"matchLabels": {"pod": format!("p{i}")}}}], "ports": [{"port": "http"}, {"port": "http"}]}],
                    "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}], "ports": [{"port": "http"}]}]
                }),
            );
        }
        apply(
            &mut o,
            "x",
            "other",
            serde_json::json!({
                "podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"ports": [{"port": "http"}]}]
            }),
        );
        let n1 = &compile(&o)["n1"];
        assert_eq!(n1.port_sets.len(), 3, "{:?}", n1.port_sets.keys());
        let ingress: BTreeSet<&String> = n1
            .policies
            .values()
            .filter(|p| !p.egress && p.name.starts_with("x/n"))
            .flat_map(|p| &p.rules[0].port_sets)
            .collect();
        let [shared] = ingress.into_iter().collect::<Vec<_>>()[..] else { panic!("one shared ingress set") };
        assert!(
            n1.policies.values().all(|p| p.rules.iter().all(|r| r.port_sets.len() <= 1)),
            "a name listed twice is one set"
        );
        assert_eq!(n1.port_sets[shared].targets.len(), 1, "x/a on n1, 8080");
        let egress: BTreeSet<&String> =
            n1.policies.values().filter(|p| p.egress).flat_map(|p| &p.rules[0].port_sets).collect();
        assert_eq!(egress.len(), 1);
        // y's pods: y/a (8082) and y/b (8083), wherever they run.
        assert_eq!(n1.port_sets[*egress.first().unwrap()].targets.len(), 2);
    }
}
