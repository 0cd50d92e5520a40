"""Kubernetes NetworkPolicy, enforced (issue 20): a conformance matrix in the manner of
upstream's netpol e2e tests.

Namespaces x, y, z with pods a, b, c each (labels `pod: <name>`, namespaces `ns: <name>` plus
the automatic `kubernetes.io/metadata.name`), every pod serving TCP and UDP on 80 and 81; for
each scenario every pod probes every other pod on both ports, both protocols and both
families (IPv4 and IPv6: 576 probes), and the whole truth table is asserted (probing again
for up to 10 s while it differs, as upstream does: enforcement is eventually consistent).
Self-probes are not scored (a pod reaching itself never leaves its namespace).

Each scenario runs on three topologies: one node (pod-to-pod on one bridge), two nodes on a
shared L2 (direct routes), two nodes on different segments (VXLAN); pods alternate between
the nodes. Policies, namespaces and pod labels are applied with `nodeplane policy apply` (the
controller in local mode), exactly as an operator would. SCTP: this kernel has no SCTP
sockets, so SCTP rules are checked in the generated ruleset, and TCP/UDP to a port only SCTP
allows is checked blocked.
"""

import json
import subprocess

import pytest

import cluster
import harness
import netpol
from netpol import policy

X_A = "x/a"
POOL4, POOL6 = "10.244.0.0/16", "fd00:10:244::/48"


@pytest.fixture(scope="module", params=["one-node", "direct", "vxlan"])
def model(request):
    c = cluster.Cluster()
    m = None
    try:
        # IPv6 underlay addresses too: direct IPv6 routes need an IPv6 next hop.
        if request.param == "one-node":
            nodes = [c.node(1, 1, ipv6=True)]
        elif request.param == "direct":
            nodes = [c.node(1, 1, mode="direct", ipv6=True), c.node(1, 2, mode="direct", ipv6=True)]
        else:
            nodes = [c.node(1, 1, mode="vxlan", ipv6=True), c.node(2, 1, mode="vxlan", ipv6=True)]
        m = netpol.Model(c, nodes)
        m.topology = request.param
        m.applied = []
        yield m
    finally:
        if m:
            m.close()
        c.close()


@pytest.fixture
def m(model):
    """The model as the scenario finds it: no policy, original labels and pods, everything
    reachable (checked)."""
    reset(model)
    model.expect(lambda s, d, proto, port: True, f"{model.topology}: baseline, no policy")
    yield model
    reset(model)


def reset(m):
    if m.applied:
        m.delete(*m.applied)
        m.applied = []
    for key in [k for k in m.pods if k.split("/")[1] not in netpol.PODS]:
        m.pods.pop(key).delete()
        m.delete({"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": key.split("/")[0], "name": key.split("/")[1]}})
    for p in m.pods.values():
        if p.labels != {"pod": p.name}:
            m.relabel(p.key, {"pod": p.name})
    m.apply(*[m.namespace(ns) for ns in netpol.NAMESPACES])


def apply(m, *policies):
    m.apply(*policies)
    m.applied += [p for p in policies if p not in m.applied]


def ns_sel(name):
    return {"matchLabels": {"kubernetes.io/metadata.name": name}}


def pod_sel(name, **more):
    return {"matchLabels": {"pod": name, **more}}


def both_families(ips_of):
    """ipBlock peers for a pod's IPv4 and IPv6 address."""
    return [{"ipBlock": {"cidr": f"{ips_of[4]}/32"}}, {"ipBlock": {"cidr": f"{ips_of[6]}/128"}}]


# ----- a, b: default deny -----

def test_default_deny_ingress(m):
    apply(m, policy("x", "deny-ingress", {"podSelector": {}, "policyTypes": ["Ingress"]}))
    m.expect(lambda s, d, pr, po: d.ns != "x", "default-deny-ingress in x")


def test_default_deny_all(m):
    apply(m, policy("x", "deny-all", {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}))
    m.expect(lambda s, d, pr, po: d.ns != "x" and s.ns != "x", "default-deny-all in x")


def test_default_deny_egress(m):
    apply(m, policy("x", "deny-egress", {"podSelector": {}, "policyTypes": ["Egress"]}))
    m.expect(lambda s, d, pr, po: s.ns != "x", "default-deny-egress in x")
    # The default policyTypes: a podSelector alone isolates ingress (not egress).
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "implicit", {"podSelector": pod_sel("b")}))
    m.expect(lambda s, d, pr, po: d.key != "x/b", "policyTypes omitted: Ingress only")


# ----- c, d, e: selectors -----

def test_allow_from_a_namespace(m):
    apply(m, policy("x", "from-y", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"namespaceSelector": ns_sel("y")}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.ns == "y", "x/a only from namespace y")


def test_bare_pod_selector_is_the_policys_namespace(m):
    apply(m, policy("x", "x-a-from-x-b", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"podSelector": pod_sel("b")}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.key == "x/b", "x/a only from x/b (not y/b, z/b)")


def test_namespace_and_pod_selector_in_one_peer(m):
    apply(m, policy("x", "y-a", {"podSelector": pod_sel("a"),
                                 "ingress": [{"from": [{"namespaceSelector": ns_sel("y"), "podSelector": pod_sel("a")}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.key == "y/a", "x/a only from y/a (AND)")


def test_namespace_or_pod_selector_as_two_peers(m):
    not_x = {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["x"]}]}
    apply(m, policy("x", "or", {"podSelector": pod_sel("a"),
                                "ingress": [{"from": [{"namespaceSelector": not_x}, {"podSelector": pod_sel("b")}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.ns != "x" or s.name == "b", "x/a from other namespaces or x/b (OR)")


def test_match_expressions(m):
    apply(m, policy("x", "in-b", {"podSelector": pod_sel("a"), "ingress": [{"from": [
        {"podSelector": {"matchExpressions": [{"key": "pod", "operator": "In", "values": ["b"]}]}}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.key == "x/b", "podSelector In [b]")
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "not-y", {"podSelector": pod_sel("a"), "policyTypes": ["Egress"], "egress": [{"to": [
        {"namespaceSelector": {"matchExpressions": [{"key": "ns", "operator": "NotIn", "values": ["y"]}]}}]}]}))
    m.expect(lambda s, d, pr, po: s.key != X_A or d.ns != "y", "egress from x/a to namespaces NotIn [y]")
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "exists", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {
        "matchExpressions": [{"key": "pod", "operator": "Exists"}, {"key": "pod2", "operator": "DoesNotExist"},
                             {"key": "pod", "operator": "NotIn", "values": ["c"]}]}}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.name != "c", "Exists / DoesNotExist / NotIn across namespaces")


# ----- f: ipBlock -----

def test_ip_block_with_except(m):
    yb, xb = m.pods["y/b"], m.pods["x/b"]
    apply(m, policy("x", "to-y-b", {"podSelector": pod_sel("a"), "policyTypes": ["Egress"], "egress": [{"to": both_families(yb.ips)}]}))
    m.expect(lambda s, d, pr, po: s.key != X_A or d.key == "y/b", "egress x/a to y/b's addresses only")
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "except-x-b", {"podSelector": pod_sel("a"), "policyTypes": ["Egress"], "egress": [{"to": [
        {"ipBlock": {"cidr": POOL4, "except": [f"{xb.ips[4]}/32"]}},
        {"ipBlock": {"cidr": POOL6, "except": [f"{xb.ips[6]}/128"]}}]}]}))
    m.expect(lambda s, d, pr, po: s.key != X_A or d.key != "x/b", "egress x/a to the pool except x/b")
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "from-y-b", {"podSelector": pod_sel("a"), "ingress": [{"from": both_families(yb.ips)}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.key == "y/b", "ingress x/a from y/b's addresses only")


# ----- g, h, i: ports -----

def test_named_ports(m):
    apply(m, policy("x", "named-81", {"podSelector": {}, "ingress": [{"ports": [{"port": "serve-81-tcp"}]}]}))
    m.expect(lambda s, d, pr, po: d.ns != "x" or (pr, po) == ("tcp", 81), "ingress to x on serve-81-tcp only")
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "egress-named", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [
        {"ports": [{"port": "serve-80-tcp"}, {"port": "serve-81-udp", "protocol": "UDP"}]}]}))
    m.expect(lambda s, d, pr, po: s.ns != "x" or (pr, po) in (("tcp", 80), ("udp", 81)),
             "egress from x to the destination's serve-80-tcp and serve-81-udp only")
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "named-from-y", {"podSelector": pod_sel("a"), "ingress": [
        {"from": [{"namespaceSelector": ns_sel("y")}], "ports": [{"port": "serve-80-tcp", "protocol": "TCP"}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or (s.ns == "y" and (pr, po) == ("tcp", 80)), "named port and a peer")


def test_port_ranges(m):
    apply(m, policy("x", "range", {"podSelector": pod_sel("a"), "ingress": [
        {"from": [{"namespaceSelector": ns_sel("y")}], "ports": [{"protocol": "TCP", "port": 80, "endPort": 81}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or (s.ns == "y" and pr == "tcp"), "TCP 80-81 from y")
    m.delete(*m.applied)
    m.applied = []
    apply(m, policy("x", "range2", {"podSelector": pod_sel("a"), "ingress": [
        {"from": [{"namespaceSelector": ns_sel("y")}], "ports": [{"protocol": "TCP", "port": 79, "endPort": 80}, {"protocol": "UDP"}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or (s.ns == "y" and ((pr, po) == ("tcp", 80) or pr == "udp")),
             "TCP 79-80 and every UDP port from y")


def test_egress_to_dns_only(m):
    apply(m, policy("x", "dns-only", {"podSelector": {}, "policyTypes": ["Egress"], "egress": [
        {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]}))
    m.expect(lambda s, d, pr, po: s.ns != "x", "egress from x: DNS only")
    # ... and DNS itself goes through, TCP and UDP, to a pod of another namespace and of x.
    m.expect(lambda s, d, pr, po: True, "DNS from everyone to everyone", ports=[53])


# ----- j: union of policies -----

def test_policies_are_a_union(m):
    apply(m, policy("x", "y-81", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"namespaceSelector": ns_sel("y")}], "ports": [{"port": 81}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or (s.ns == "y" and (pr, po) == ("tcp", 81)), "one policy: TCP 81 from y")
    apply(m, policy("x", "y-80", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"namespaceSelector": ns_sel("y")}], "ports": [{"port": 80}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A or (s.ns == "y" and pr == "tcp"), "two policies: TCP 80 and 81 from y")
    apply(m, policy("x", "allow-all", {"podSelector": {}, "ingress": [{}]}))
    m.expect(lambda s, d, pr, po: True, "an allow-all ingress policy joins: everything")


def test_egress_denied_on_the_client_side(m):
    apply(m,
          policy("x", "to-y-a", {"podSelector": pod_sel("a"), "policyTypes": ["Egress"],
                                 "egress": [{"to": [{"namespaceSelector": ns_sel("y"), "podSelector": pod_sel("a")}]}]}),
          policy("y", "a-from-x-a", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"namespaceSelector": ns_sel("x"), "podSelector": pod_sel("a")}]}]}),
          policy("y", "b-from-x-a", {"podSelector": pod_sel("b"), "ingress": [{"from": [{"namespaceSelector": ns_sel("x"), "podSelector": pod_sel("a")}]}]}))
    m.expect(lambda s, d, pr, po: (s.key != X_A or d.key == "y/a") and (d.key != "y/a" or s.key == X_A) and d.key != "y/b",
             "x/a may only reach y/a; y/a and y/b admit only x/a")


# ----- k, l, m: changes -----

def test_policy_updated_then_deleted(m):
    apply(m, policy("x", "p", {"podSelector": {}, "ingress": [{}]}))
    m.expect(lambda s, d, pr, po: True, "allow-all ingress in x")
    apply(m, policy("x", "p", {"podSelector": {}, "ingress": []}))
    m.expect(lambda s, d, pr, po: d.ns != "x", "updated to deny-all ingress")
    m.delete(*m.applied)
    m.applied = []
    m.expect(lambda s, d, pr, po: True, "deleted: everything allowed again")


def test_pod_labels_changed(m):
    apply(m, policy("x", "from-updated", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"podSelector": pod_sel("b", pod2="updated")}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A, "nobody has pod2=updated")
    m.relabel("x/b", {"pod": "b", "pod2": "updated"})
    m.expect(lambda s, d, pr, po: d.key != X_A or s.key == "x/b", "x/b relabelled: allowed")
    apply(m, policy("x", "isolated", {"podSelector": {"matchLabels": {"target": "isolated"}}, "policyTypes": ["Ingress"]}))
    m.relabel("x/c", {"pod": "c", "target": "isolated"})
    m.expect(lambda s, d, pr, po: (d.key != X_A or s.key == "x/b") and d.key != "x/c", "x/c relabelled: isolated")


def test_namespace_labels_and_new_pods(m):
    apply(m, policy("x", "from-ns2", {"podSelector": pod_sel("a"), "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns2": "updated"}}}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A, "no namespace has ns2=updated")
    m.apply(m.namespace("y", {"ns2": "updated"}))
    m.expect(lambda s, d, pr, po: d.key != X_A or s.ns == "y", "y labelled ns2=updated")
    # A new pod under the policy is isolated from its first packet: probed once, at once.
    d = m.add_pod("x", "d", labels={"pod": "a"})
    first = m.probe_all(ports=[80], protocols=["tcp"], families=[4])
    early = [k for k, ok in first.items() if k[1] == "x/d" and ok and not k[0].startswith("y/")]
    assert not early, f"the new pod x/d was reachable before its policy held: {early}"
    # A new peer in y is in the allowed set.
    m.add_pod("y", "d")
    m.expect(lambda s, d_, pr, po: d_.labels.get("pod") != "a" or d_.ns != "x" or s.ns == "y",
             "x/a and the new x/d (pod: a) from y only, the new y/d included")
    assert d.node.leases(), "the new pod is attached"


# ----- n: SCTP -----

def test_sctp_rules_and_no_protocol_confusion(m):
    apply(m, policy("x", "sctp-only", {"podSelector": pod_sel("a"), "ingress": [{"ports": [{"protocol": "SCTP", "port": 81}]}]}))
    m.expect(lambda s, d, pr, po: d.key != X_A, "SCTP 81 allowed: TCP and UDP to x/a blocked")
    node = m.pods[X_A].node
    rules = harness.run(["ip", "netns", "exec", node.ns.name, "nft", "list", "table", "inet", "nodeplane-policy"]).stdout
    assert "sctp dport 81 accept" in rules, rules


def test_rules_leave_with_the_pods_and_policies(m):
    """Every policy deleted: no group, policy chain, set or dispatch entry is left on any node."""
    apply(m, policy("x", "p", {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": ns_sel("y")}]}]}))
    m.expect(lambda s, d, pr, po: d.ns != "x" or s.ns == "y", "x from y")
    m.delete(*m.applied)
    m.applied = []
    m.expect(lambda s, d, pr, po: True, "deleted")
    for n in m.nodes:
        t = json.loads(harness.run(["ip", "netns", "exec", n.ns.name, "nft", "-j", "list", "table", "inet", "nodeplane-policy"]).stdout)
        chains = [o["chain"]["name"] for o in t["nftables"] if "chain" in o]
        sets = [o for o in t["nftables"] if "set" in o or "map" in o]
        assert sorted(chains) == ["egress", "ingress"], chains
        assert all(not (o.get("set") or o.get("map")).get("elem") for o in sets), sets
