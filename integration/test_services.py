"""Services without kube-proxy, on two simulated nodes of a local cluster (direct routes).

The controller (local mode) gets Services and EndpointSlices from `nodeplane service apply`;
every agent programs them into its `inet nodeplane-svc` table. Backends are pod namespaces
attached through the real shim; each serves TCP and UDP on 8080 over IPv4 and IPv6 and
answers with its own name and the address it saw the client come from. Clients are other
pods, and the underlay namespace for traffic from outside the cluster. Each check asserts
what the traffic did: which backend answered, from which source address, or that nothing
answered (dropped) or the connection was refused (rejected).
"""

import collections
import json
import subprocess
import sys
import time

import pytest

import harness
from cluster import Cluster
from netpol import Pod as NetpolPod

# Every backend: TCP and UDP on 8080 (one dual-stack socket each), answering
# "<name> <client address>".
SERVER = r"""
import socket, sys, threading
name = sys.argv[1]
def tcp():
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", 8080)); s.listen(256)
    while True:
        c, a = s.accept()
        try:
            c.sendall(f"{name} {a[0].removeprefix('::ffff:')}".encode())
        except OSError:
            pass
        c.close()
def udp():
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", 8080))
    while True:
        d, a = s.recvfrom(512)
        s.sendto(f"{name} {a[0].removeprefix('::ffff:')}".encode(), a)
threading.Thread(target=tcp, daemon=True).start()
threading.Thread(target=udp, daemon=True).start()
print("serving", flush=True)
threading.Event().wait()
"""

# N requests to (ip, port, proto) in a row: one line each, "<name> <seen>", "refused",
# "timeout" or the error. A connect waits 2.5 s: a reject from the node can come back while
# connect(2) still holds the socket's lock, and the kernel then keeps the error soft
# (TcpExtLockDroppedIcmps) until the SYN is sent again after 1 s.
CLIENT = r"""
import socket, sys
ip, port, proto, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
for _ in range(n):
    try:
        if proto == "tcp":
            with socket.create_connection((ip, port), timeout=2.5) as s:
                s.settimeout(1)
                print(s.recv(200).decode())
        else:
            s = socket.socket(fam, socket.SOCK_DGRAM)
            s.settimeout(1)
            s.connect((ip, port))
            s.send(b"x")
            print(s.recv(200).decode())
            s.close()
    except ConnectionRefusedError:
        print("refused")
    except socket.timeout:
        print("timeout")
    except OSError as e:
        print(f"error {e.errno}")
"""

SVC4, SVC6 = "10.96.0.0/16", "fd00:96::/112"


class Backend(NetpolPod):
    def serve(self):
        self.server = subprocess.Popen(["nsenter", f"--net={self.netns.path}", sys.executable, "-c", SERVER, self.name],
                                       stdout=subprocess.PIPE, text=True)
        assert self.server.stdout.readline().strip() == "serving"


def ask(netns_path, ip, port, proto="tcp", n=1):
    r = subprocess.run(["nsenter", f"--net={netns_path}", sys.executable, "-c", CLIENT, ip, str(port), proto, str(n)],
                       capture_output=True, text=True, timeout=60 + 3 * n)
    return r.stdout.split("\n")[:n]


def names(answers):
    return collections.Counter(a.split()[0] for a in answers)


class Env:
    def __init__(self):
        self.cluster = Cluster()
        try:
            self.n1 = self.cluster.node(1, 1, mode="direct", ipv6=True)
            self.n2 = self.cluster.node(1, 2, mode="direct", ipv6=True)
            for n in (self.n1, self.n2):
                n.wait_ready()
            self.pods = {}
            for name, node in (("a1", self.n1), ("a2", self.n1), ("b1", self.n2), ("c1", self.n1), ("c2", self.n2)):
                p = Backend("svc", name, node)
                self.pods[name] = p  # before the ADD: close() removes its namespace whatever happens
                p.add()
                p.serve()
            self.ctl = self.cluster.controller
        except BaseException:
            self.close()
            raise

    def cli(self, *args, stdin=None):
        tls = ["--ca-file", str(self.ctl.ca)] if self.ctl.ca else []
        argv = self.ctl.in_netns([str(harness.CLI_BIN), "service", "--controller", self.ctl.address, "--token-file",
                                  str(self.ctl.admin_token_file), *tls, *args])
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def apply(self, *objects):
        return self.cli("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def delete(self, *objects):
        return self.cli("delete", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def node_of(self, pod):
        return self.n1.ns.name if self.pods[pod].node is self.n1 else self.n2.ns.name

    def slices(self, svc, pods, ready=None):
        """The Service's EndpointSlices (one per family) with these backends; `ready`: the
        pods that are ready (default: all)."""
        out = []
        for fam, typ in ((4, "IPv4"), (6, "IPv6")):
            eps = [{"addresses": [self.pods[p].ips[fam]], "nodeName": self.node_of(p),
                    "conditions": {"ready": ready is None or p in ready}} for p in pods]
            out.append({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                        "metadata": {"namespace": "svc", "name": f"{svc}-{fam}",
                                     "labels": {"kubernetes.io/service-name": svc}},
                        "addressType": typ, "endpoints": eps,
                        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                                  {"name": "dns", "port": 8080, "protocol": "UDP"}]})
        return out

    def close(self):
        try:
            for p in getattr(self, "pods", {}).values():
                p.delete()  # its server, its DEL, its namespace
        finally:
            self.cluster.close()


def service(name, ip4, ip6, **spec):
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "svc", "name": name},
            "spec": {"clusterIP": ip4, "clusterIPs": [ip4, ip6], "ipFamilies": ["IPv4", "IPv6"],
                     "ports": [{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP"},
                               {"name": "dns", "port": 53, "targetPort": "web", "protocol": "UDP"}],
                     **spec}}


@pytest.fixture(scope="module")
def env():
    e = Env()
    try:
        yield e
    finally:
        e.close()


def until(pred, what, timeout=10):
    return harness.wait_until(pred, timeout=timeout, what=what)


def test_cluster_ip_balances_over_every_backend_both_families_tcp_and_udp(env):
    env.apply(service("web", "10.96.0.10", "fd00:96::10"), *env.slices("web", ["a1", "a2", "b1"]))
    for client in ("c1", "c2"):
        path = env.pods[client].netns.path
        for ip in ("10.96.0.10", "fd00:96::10"):
            until(lambda: names(ask(path, ip, 80)).keys() <= {"a1", "a2", "b1"}, f"{client} to reach {ip}")
            tcp = names(ask(path, ip, 80, n=30))
            assert set(tcp) == {"a1", "a2", "b1"}, (client, ip, tcp)
            udp = names(ask(path, ip, 53, "udp", n=30))
            assert set(udp) == {"a1", "a2", "b1"}, (client, ip, udp)
    # The backend sees the pod's own address: no masquerade inside the cluster.
    seen = ask(env.pods["c2"].netns.path, "10.96.0.10", 80, n=10)
    assert all(a.split()[1] == env.pods["c2"].ips[4] for a in seen), seen


def test_another_port_of_a_cluster_ip_and_a_service_without_endpoints_are_rejected(env):
    env.apply(service("empty", "10.96.0.11", "fd00:96::11"))
    path = env.pods["c1"].netns.path
    until(lambda: ask(path, "10.96.0.11", 80) == ["refused"], "the empty Service to be rejected")
    assert ask(path, "fd00:96::11", 80) == ["refused"]
    assert ask(path, "10.96.0.10", 81) == ["refused"], "a port the ClusterIP does not serve"


def test_session_affinity_keeps_a_client_on_one_backend(env):
    env.apply(service("sticky", "10.96.0.12", "fd00:96::12", sessionAffinity="ClientIP",
                      sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}),
              *env.slices("sticky", ["a1", "a2", "b1"]))
    for client in ("c1", "c2"):
        path = env.pods[client].netns.path
        until(lambda: ask(path, "10.96.0.12", 80) != ["timeout"], "the sticky Service")
        for ip in ("10.96.0.12", "fd00:96::12"):
            got = names(ask(path, ip, 80, n=20))
            assert len(got) == 1, (client, ip, got)
    # An agent restart writes its table anew, and keeps the clients' sets: each client
    # stays with its backend (as with kube-proxy), where a new table would pick again.
    before = {(c, ip): names(ask(env.pods[c].netns.path, ip, 80)) for c in ("c1", "c2")
              for ip in ("10.96.0.12", "fd00:96::12")}
    for n in (env.n1, env.n2):
        handle = nat_handle(n)
        n.stop()
        n.start()
        until(lambda: nat_handle(n) not in (None, handle), "the table written anew")
    for (c, ip), got in before.items():
        assert names(ask(env.pods[c].netns.path, ip, 80, n=5)) == {k: 5 * v for k, v in got.items()}, (c, ip)


def nat_handle(n):
    """The handle of the rule in the Services table's prerouting chain: a new one each time
    the table is written anew."""
    r = n.ns.exec(["nft", "-a", "list", "chain", "inet", "nodeplane-svc", "nat-pre"], check=False)
    found = [l.split("# handle ")[1].strip() for l in r.stdout.splitlines() if "jump services" in l]
    return found[0] if r.returncode == 0 and found else None


def test_endpoints_follow_readiness_and_terminating_ones_serve_only_when_none_is_ready(env):
    env.apply(service("ready", "10.96.0.13", "fd00:96::13"), *env.slices("ready", ["a1", "a2", "b1"], ready={"b1"}))
    path = env.pods["c1"].netns.path
    until(lambda: set(names(ask(path, "10.96.0.13", 80, n=10))) == {"b1"}, "only the ready backend")
    env.apply(*env.slices("ready", ["a1", "a2", "b1"], ready={"a1", "a2"}))
    until(lambda: set(names(ask(path, "10.96.0.13", 80, n=20))) == {"a1", "a2"}, "the new ready set")


def test_hairpin_a_pod_reaches_itself_through_its_service(env):
    env.apply(service("self", "10.96.0.14", "fd00:96::14"), *env.slices("self", ["a1"]))
    path = env.pods["a1"].netns.path
    for ip in ("10.96.0.14", "fd00:96::14"):
        until(lambda: ask(path, ip, 80)[0].startswith("a1 "), f"a1 to reach itself through {ip}")


def test_node_port_from_outside_is_masqueraded_and_local_policy_keeps_the_source(env):
    ul = env.cluster.underlay.ns.path
    env.apply(service("np", "10.96.0.15", "fd00:96::15", type="NodePort",
                      ports=[{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP", "nodePort": 30080}]),
              *env.slices("np", ["b1"]))
    env.apply(service("npl", "10.96.0.16", "fd00:96::16", type="NodePort", externalTrafficPolicy="Local",
                      ports=[{"name": "http", "port": 80, "targetPort": "web", "protocol": "TCP", "nodePort": 30081}]),
              *env.slices("npl", ["b1"]))
    client4 = "198.19.1.254"  # the underlay router's address on segment 1 (cluster.Underlay)
    # Policy Cluster: node 1 forwards to b1 on node 2, from its own address.
    until(lambda: ask(ul, env.n1.underlay, 30080)[0].startswith("b1 "), "the NodePort on node 1")
    seen = ask(ul, env.n1.underlay, 30080)[0].split()[1]
    assert seen != client4, "policy Cluster masquerades"
    # Policy Local: node 2 has the endpoint and keeps the client's address; node 1 has none
    # and drops (no answer, not refused).
    until(lambda: ask(ul, env.n2.underlay, 30081)[0].startswith("b1 "), "the Local NodePort on node 2")
    assert ask(ul, env.n2.underlay, 30081)[0].split()[1] == client4
    assert ask(ul, env.n1.underlay, 30081) == ["timeout"]
    # IPv6 NodePorts on the nodes' IPv6 addresses.
    until(lambda: ask(ul, env.n2.underlay6, 30081)[0].startswith("b1 "), "the Local NodePort over IPv6")
    # A pod on node 1 reaches the Local NodePort anyway (pods short-circuit to every endpoint).
    assert ask(env.pods["c1"].netns.path, env.n1.underlay, 30081)[0].startswith("b1 ")


def test_internal_traffic_policy_local_serves_only_the_nodes_own_endpoints(env):
    env.apply(service("itp", "10.96.0.17", "fd00:96::17", internalTrafficPolicy="Local"), *env.slices("itp", ["b1"]))
    until(lambda: ask(env.pods["c2"].netns.path, "10.96.0.17", 80)[0].startswith("b1 "), "node 2's local endpoint")
    assert ask(env.pods["c1"].netns.path, "10.96.0.17", 80) == ["timeout"], "node 1 has none: dropped"


def test_external_ips_reach_the_service_from_outside(env):
    ul = env.cluster.underlay.ns
    env.apply(service("ext", "10.96.0.18", "fd00:96::18", externalIPs=["192.0.2.50"]), *env.slices("ext", ["a1", "b1"]))
    ul.exec(["ip", "route", "replace", "192.0.2.50/32", "via", env.n1.underlay])
    until(lambda: names(ask(ul.path, "192.0.2.50", 80, n=10)).keys() <= {"a1", "b1"}, "the external IP")


def test_a_deleted_service_is_gone_and_the_table_has_only_what_is_applied(env):
    env.delete(service("self", "10.96.0.14", "fd00:96::14"))
    path = env.pods["c1"].netns.path
    until(lambda: ask(path, "10.96.0.14", 80) == ["timeout"], "the deleted ClusterIP to lead nowhere")
    for n in (env.n1, env.n2):
        table = n.ns.exec(["nft", "list", "map", "inet", "nodeplane-svc", "vip4"]).stdout
        assert "10.96.0.14" not in table and "10.96.0.10 . tcp . 80" in table, table


def has_table(n):
    return n.ns.exec(["nft", "list", "table", "inet", "nodeplane-svc"], check=False).returncode == 0


def restarted_with(n, change, undo, gone_because, says):
    """Restart node `n` after `change()`: its Services table must go, its log say `says`;
    then restart it after `undo()`: the table must come back."""
    assert has_table(n)
    n.stop()
    change()
    try:
        n.start()
        until(lambda: not has_table(n), f"the table gone with {gone_because}")
        assert says in n.log()[n.log_offset:]
    finally:
        n.stop()
        undo()
        n.start()
    until(lambda: has_table(n), "the table back")


def test_services_off_removes_the_table_an_earlier_run_left(env):
    """A node handed back to kube-proxy (`services: off`): the agent removes the table it
    programmed before, whose DNAT would otherwise run beside kube-proxy's."""
    n = env.n2

    def services(mode):
        n.cfg.pop("services", None)
        if mode:
            n.cfg["services"] = mode
        n.cfg_path.write_text(json.dumps(n.cfg))

    restarted_with(n, lambda: services("off"), lambda: services(None), "services: off",
                   "removed the Services table an earlier run left")


@pytest.mark.parametrize("found", ["nft table", "ipvs device", "iptables-legacy chain", "ip6tables-legacy chain"])
def test_auto_leaves_a_node_to_kube_proxy_and_takes_it_back(env, found):
    """`services: auto` (the default): an agent that finds kube-proxy programming its node
    (its nftables table, its iptables chain through the legacy backend, which nft does not
    see, or its IPVS mode's device) removes its own table at start and programs nothing;
    once kube-proxy is gone it programs the node again."""
    n = env.n2
    if found == "nft table":
        mark = (["nft", "add", "table", "ip", "kube-proxy"], ["nft", "delete", "table", "ip", "kube-proxy"])
        says = "nftables table ip kube-proxy"
    elif found.endswith("tables-legacy chain"):
        tool = found.split()[0]
        mark = ([tool, "-t", "nat", "-N", "KUBE-SERVICES"], [tool, "-t", "nat", "-X", "KUBE-SERVICES"])
        says = f"iptables-legacy chain KUBE-SERVICES ({'ip6' if tool.startswith('ip6') else 'ip'} nat)"
    else:
        # kube-proxy makes a dummy link; this host's kernel has none, and the name is what counts.
        mark = (["ip", "link", "add", "kube-ipvs0", "type", "bridge"], ["ip", "link", "del", "kube-ipvs0"])
        says = "kube-proxy's IPVS device kube-ipvs0"
    restarted_with(n, lambda: n.ns.exec(mark[0]), lambda: n.ns.exec(mark[1]), f"kube-proxy's {found} there",
                   f"kube-proxy programs this node ({says})")
