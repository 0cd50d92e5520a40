"""Services on the real cluster, with no kube-proxy: nodeplane's agents proxy them from what
the controller compiles of the API's Services and the EndpointSlices the real
kube-controller-manager makes from the pods. Written after Kubernetes' own [Conformance]
Service tests that a cluster without DNS or a load balancer can run: reachable by ClusterIP
and NodePort, TCP and UDP on one port, several ports, session affinity on and off, type
changes ClusterIP <-> NodePort, endpoints that follow pod readiness. And pods reach the API
server (`kubernetes.default`) and nodeplane's controller by their ClusterIPs.

Backends run `np-echo serve` (integration/e2e/echo.c), which answers with the pod's name and
the address it saw; clients run `np-echo ask` in their pods."""

import collections
import json

import pytest

import kube
from cluster import CONTROL, WORK, in_net, kubectl, run, wait_for


def ask(pod, ns, ip, port, proto="tcp", n=1):
    out = kube.exec_(pod, ns, ["np-echo", "ask", ip, str(port), proto, str(n)], timeout=60 + 3 * n).stdout
    return out.split("\n")[:n]


def names(answers):
    return collections.Counter(a.split()[0] for a in answers)


def backend(name, ns, node):
    p = kube.busybox_pod(name, ns, node=node, command=("sh", "-c", "touch /tmp/ready; exec np-echo serve 8080 8081"))
    p["metadata"]["labels"] = {"app": "echo"}
    c = p["spec"]["containers"][0]
    c["ports"] = [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                  {"name": "dns", "containerPort": 8080, "protocol": "UDP"},
                  {"name": "alt", "containerPort": 8081, "protocol": "TCP"}]
    c["readinessProbe"] = {"exec": {"command": ["test", "-f", "/tmp/ready"]}, "periodSeconds": 1,
                           "failureThreshold": 1}
    return p


def service(name, ns, **spec):
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"app": "echo"}, "ipFamilyPolicy": "RequireDualStack",
                     "ipFamilies": ["IPv4", "IPv6"],
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
                               {"name": "dns", "port": 80, "targetPort": "dns", "protocol": "UDP"},
                               {"name": "alt", "port": 81, "targetPort": "alt", "protocol": "TCP"}],
                     **spec}}


@pytest.fixture(scope="module")
def pods(ns, workers):
    backends = {"echo-1": workers[0], "echo-2": workers[0], "echo-3": workers[-1]}
    clients = {f"client-{w}": w for w in workers}
    kube.apply(*(backend(n, ns, w) for n, w in backends.items()),
               *(kube.busybox_pod(n, ns, node=w) for n, w in clients.items()))
    for n in list(backends) + list(clients):
        kube.wait_running(n, ns)
    return {"backends": backends, "clients": clients}


def cluster_ips(name, ns):
    return kube.get("service", name, ns)["spec"]["clusterIPs"]


def test_pods_reach_the_api_server_and_the_controller_by_cluster_ip(ns, pods):
    api = kube.get("service", "kubernetes", "default")["spec"]["clusterIP"]
    ctl = kube.get("service", "nodeplane-controller", "nodeplane-system")["spec"]["clusterIP"]
    for client in pods["clients"]:
        assert ask(client, ns, api, 443, "connect") == ["connected"], f"{client} to kubernetes.default"
        assert ask(client, ns, ctl, 9650, "connect") == ["connected"], f"{client} to the controller Service"


def test_cluster_ip_serves_tcp_and_udp_on_one_port_and_several_ports_on_both_families(ns, pods):
    kube.apply(service("echo", ns))
    want = set(pods["backends"])
    for ip in cluster_ips("echo", ns):
        for client in pods["clients"]:
            wait_for(lambda: set(names(ask(client, ns, ip, 80, n=20))) == want, 60, f"{client} to reach all via {ip}")
            assert set(names(ask(client, ns, ip, 80, "udp", n=20))) == want, (client, ip)
            assert set(names(ask(client, ns, ip, 81, n=20))) == want, (client, ip)


def test_session_affinity_on_then_off(ns, pods):
    kube.apply(service("sticky", ns, sessionAffinity="ClientIP"))
    client = next(iter(pods["clients"]))
    ip = cluster_ips("sticky", ns)[0]
    wait_for(lambda: ask(client, ns, ip, 80)[0].split()[0] in pods["backends"], 60, "the sticky Service")
    assert len(names(ask(client, ns, ip, 80, n=20))) == 1, "ClientIP: one backend for one client"
    kubectl(["patch", "service", "sticky", "-n", ns, "--type", "merge", "-p",
             json.dumps({"spec": {"sessionAffinity": "None"}})])
    wait_for(lambda: len(names(ask(client, ns, ip, 80, n=20))) > 1, 60, "None: the client spread over backends")


def node_ip(name):
    n = kube.get("node", name)
    return next(a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP" and ":" not in a["address"])


def from_outside(ip, port, proto="tcp"):
    """A request from the control plane's namespace: a host on the nodes' network, outside
    the pod network."""
    r = run(in_net(CONTROL, [WORK / "images" / "np-echo", "ask", ip, str(port), proto, "1"]), check=False)
    return r.stdout.strip()


def test_type_changes_cluster_ip_to_node_port_and_back(ns, pods, workers):
    kube.apply(service("typed", ns))
    kubectl(["patch", "service", "typed", "-n", ns, "--type", "merge", "-p", json.dumps({"spec": {"type": "NodePort"}})])
    svc = kube.get("service", "typed", ns)
    port = next(p["nodePort"] for p in svc["spec"]["ports"] if p["name"] == "http")
    for w in workers:
        wait_for(lambda: from_outside(node_ip(w), port).split()[0] in pods["backends"], 60,
                 f"NodePort {port} on {w} from outside the cluster")
        for client in pods["clients"]:
            assert ask(client, ns, node_ip(w), port)[0].split()[0] in pods["backends"]
    kubectl(["patch", "service", "typed", "-n", ns, "--type", "json", "-p",
             json.dumps([{"op": "replace", "path": "/spec/type", "value": "ClusterIP"},
                         {"op": "remove", "path": "/spec/ports/0/nodePort"},
                         {"op": "remove", "path": "/spec/ports/1/nodePort"},
                         {"op": "remove", "path": "/spec/ports/2/nodePort"}])])
    wait_for(lambda: from_outside(node_ip(workers[0]), port) in ("refused", "timeout"), 60, "the NodePort to close")
    assert ask(next(iter(pods["clients"])), ns, cluster_ips("typed", ns)[0], 80)[0].split()[0] in pods["backends"]


def test_endpoints_follow_pod_readiness(ns, pods):
    kube.apply(service("ready", ns))
    client = next(iter(pods["clients"]))
    ip = cluster_ips("ready", ns)[0]
    wait_for(lambda: set(names(ask(client, ns, ip, 80, n=20))) == set(pods["backends"]), 60, "every backend")
    kube.exec_("echo-1", ns, ["rm", "/tmp/ready"])
    wait_for(lambda: set(names(ask(client, ns, ip, 80, n=20))) == {"echo-2", "echo-3"}, 60,
             "the unready backend to leave the Service")
    kube.exec_("echo-1", ns, ["touch", "/tmp/ready"])
    wait_for(lambda: set(names(ask(client, ns, ip, 80, n=20))) == set(pods["backends"]), 60,
             "the backend to come back once ready")


def test_a_service_without_endpoints_is_rejected(ns, pods):
    svc = service("nobody", ns)
    svc["spec"]["selector"] = {"app": "nobody"}
    kube.apply(svc)
    client = next(iter(pods["clients"]))
    for ip in cluster_ips("nobody", ns):
        wait_for(lambda: ask(client, ns, ip, 80) == ["refused"], 60, f"{ip} without endpoints to be rejected")
