"""Pods on every worker get an address of each family from nodeplane and reach each other
across nodes over IPv4 and IPv6, through the real runtime and kubelet."""

import itertools

import kube


def test_pods_on_every_node_get_dual_stack_addresses_and_reach_each_other(ns, workers):
    names = {w: f"net-{w}" for w in workers}
    kube.apply(*(kube.busybox_pod(p, ns, node=w) for w, p in names.items()))
    pods = {w: kube.wait_running(p, ns) for w, p in names.items()}
    for w, pod in pods.items():
        assert pod["spec"]["nodeName"] == w
        ips = kube.pod_ips(pod)
        assert len(ips) == 2 and sum(":" in ip for ip in ips) == 1, f"{pod['metadata']['name']}: {ips}"
    for a, b in itertools.permutations(workers, 2):
        for ip in kube.pod_ips(pods[b]):
            assert kube.ping(names[a], ns, ip, count=2), f"{names[a]} on {a} cannot reach {ip} on {b}"


def test_pod_addresses_are_in_the_nodes_blocks(ns, workers):
    """Each pod's addresses lie in a block the controller gave its node (IPBlock objects)."""
    import ipaddress

    blocks = {}
    for b in kube.get("ipblocks")["items"]:
        blocks.setdefault(b["spec"]["node"], []).append(ipaddress.ip_network(b["spec"]["cidr"]))
    for w in workers:
        pod = kube.wait_running(f"net-{w}", ns)
        for ip in kube.pod_ips(pod):
            assert any(ipaddress.ip_address(ip) in net for net in blocks.get(w, [])), (w, ip, blocks)
