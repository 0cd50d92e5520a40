"""NetworkPolicy test model: namespaces x, y, z with pods a, b, c each (as upstream's netpol
e2e suite), every pod serving TCP and UDP on ports 80 and 81 (and 53) on IPv4 and IPv6, and a
prober that checks every pod against every other one on each port, protocol and family.

Pods are real network namespaces attached through the real CNI shim with the runtime's
`K8S_POD_NAMESPACE`/`K8S_POD_NAME`; their labels, container ports and the policies come from
`nodeplane policy apply` (the controller in local mode). A probe is a TCP connect or a UDP
request answered by the server (no answer within the timeout: blocked).
"""

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

NAMESPACES = ["x", "y", "z"]
PODS = ["a", "b", "c"]
PORTS = [80, 81]
PROTOCOLS = ["tcp", "udp"]
FAMILIES = [4, 6]
# A probe that gets no answer within this is "blocked" (scaled on slow machines: a late answer
# must not read as a block; a blocked probe stays blocked however long it waits).
PROBE_TIMEOUT = 0.4 * harness.TIME_SCALE

# The server in every pod: TCP accept (then close) and UDP echo, on every port given, for IPv4
# and IPv6 (one dual-stack socket each).
SERVER = r"""
import socket, sys, threading
def tcp(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port)); s.listen(256)
    while True:
        c, _ = s.accept()
        try:
            c.sendall(b"ok")
        except OSError:
            pass
        c.close()
def udp(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    while True:
        d, a = s.recvfrom(512)
        s.sendto(d, a)
for p in map(int, sys.argv[1:]):
    threading.Thread(target=tcp, args=(p,), daemon=True).start()
    threading.Thread(target=udp, args=(p,), daemon=True).start()
print("serving", flush=True)
threading.Event().wait()
"""

# One source pod probing a list of targets at once: [[ip, port, proto], ...] -> [bool, ...].
PROBER = r"""
import concurrent.futures as cf, json, socket, sys
targets, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
def probe(t):
    ip, port, proto = t
    fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        if proto == "tcp":
            with socket.create_connection((ip, port), timeout=timeout) as s:
                # Connected: the rules let it through (a blocked port never gets here). The
                # server's answer can be late on a loaded machine: it gets longer.
                s.settimeout(timeout * 3)
                return s.recv(2) == b"ok"
        # UDP may lose a datagram: three pings over the timeout, any answer counts.
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout / 3)
            for _ in range(3):
                s.sendto(b"ping", (ip, port))
                try:
                    return s.recvfrom(16)[0] == b"ping"
                except socket.timeout:
                    pass
            return False
    except OSError:
        return False
with cf.ThreadPoolExecutor(len(targets) or 1) as ex:
    print(json.dumps(list(ex.map(probe, targets))))
"""


def container_ports():
    out = []
    for port in PORTS:
        for proto in ("TCP", "UDP", "SCTP"):
            out.append({"name": f"serve-{port}-{proto.lower()}", "containerPort": port, "protocol": proto})
    return out


class Pod:
    def __init__(self, ns, name, node):
        self.ns, self.name, self.node = ns, name, node
        self.netns = harness.Netns(f"p{ns}{name}")
        self.cid = f"{self.netns.name}-{os.urandom(4).hex()}"
        self.labels = {"pod": name}
        self.ips = {}
        self.result = None
        self.server = None

    @property
    def key(self):
        return f"{self.ns}/{self.name}"

    def obj(self):
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"namespace": self.ns, "name": self.name, "labels": dict(self.labels)},
                "spec": {"containers": [{"name": "serve", "ports": container_ports()}]}}

    def cni(self, command):
        env = {"CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={self.ns};K8S_POD_NAME={self.name};"
                           f"K8S_POD_INFRA_CONTAINER_ID={self.cid}"}
        conf = self.node.netconf()
        if command != "ADD" and self.result:
            conf["prevResult"] = self.result
        return self.node.cni(command, self.cid, "eth0", self.netns.path, conf=conf, env=env)

    def add(self):
        rc, res, raw = self.cni("ADD")
        if rc != 0:
            raise RuntimeError(f"ADD {self.key} on {self.node.ns.name}: {raw}")
        self.result = res
        for i in res["ips"]:
            ip = i["address"].split("/")[0]
            self.ips[6 if ":" in ip else 4] = ip
        return res

    def serve(self, ports=(53, 80, 81)):
        self.server = subprocess.Popen(["nsenter", f"--net={self.netns.path}", sys.executable, "-c", SERVER,
                                        *map(str, ports)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.server.stdout.readline().strip() == "serving"

    def delete(self):
        if self.server:
            harness.stop_process(self.server)
        if self.result is not None:
            self.cni("DEL")
        self.netns.delete()


class Model:
    """The pods of namespaces x, y, z over the given nodes (round robin), and the policy CLI."""

    def __init__(self, cluster, nodes, names=None):
        self.cluster, self.nodes = cluster, nodes
        self.ctl = cluster.controller
        self.pods = {}
        self.tmp = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX + "np-", dir="/tmp"))
        i = 0
        for ns in NAMESPACES:
            for name in (names or PODS):
                self.pods[f"{ns}/{name}"] = Pod(ns, name, nodes[i % len(nodes)])
                i += 1
        self.apply(*[self.namespace(ns) for ns in NAMESPACES], *[p.obj() for p in self.pods.values()])
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda p: p.add(), self.pods.values()))
        for p in self.pods.values():
            p.serve()

    @staticmethod
    def namespace(ns, extra=None):
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"ns": ns, **(extra or {})}}}

    def policy_cli(self, *args, stdin=None):
        tls = ["--ca-file", str(self.ctl.ca)] if self.ctl.ca else []
        argv = self.ctl.in_netns([str(harness.CLI_BIN), "policy", "--controller", self.ctl.address, "--token-file",
                                  str(self.ctl.admin_token_file), *tls, *args])
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nodeplane policy {args}: {r.stderr.strip()}")
        return r.stdout

    def apply(self, *objects):
        return self.policy_cli("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def delete(self, *objects):
        return self.policy_cli("delete", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))

    def add_pod(self, ns, name, labels=None, node=None):
        p = Pod(ns, name, node or self.nodes[len(self.pods) % len(self.nodes)])
        if labels:
            p.labels = labels
        self.apply(p.obj())
        p.add()
        p.serve()
        self.pods[p.key] = p
        return p

    def relabel(self, key, labels):
        p = self.pods[key]
        p.labels = labels
        self.apply(p.obj())

    def probe_all(self, ports=PORTS, protocols=PROTOCOLS, families=FAMILIES):
        """(src, dst, proto, port, family) -> reached, for every ordered pair of pods."""
        jobs = {}
        for src in self.pods.values():
            targets = []
            for dst in self.pods.values():
                if dst is src:
                    continue
                for fam in families:
                    for proto in protocols:
                        for port in ports:
                            targets.append((dst.key, proto, port, fam, [dst.ips[fam], port, proto]))
            jobs[src.key] = (src, targets)

        def run(item):
            src, targets = item
            out = subprocess.run(["nsenter", f"--net={src.netns.path}", sys.executable, "-c", PROBER,
                                  json.dumps([t[4] for t in targets]), str(PROBE_TIMEOUT)],
                                 capture_output=True, text=True, timeout=60 * harness.TIME_SCALE)
            got = json.loads(out.stdout)
            return {(src.key, t[0], t[1], t[2], t[3]): ok for t, ok in zip(targets, got)}

        result = {}
        with cf.ThreadPoolExecutor(len(jobs)) as ex:
            for part in ex.map(run, jobs.values()):
                result.update(part)
        return result

    def expect(self, allowed, what, timeout=10.0, ports=PORTS, protocols=PROTOCOLS, families=FAMILIES):
        """Probe until the matrix equals `allowed(src_pod, dst_pod, proto, port)` (policy is
        eventually consistent; upstream retries for 10 s too), else fail with the table."""
        deadline = time.time() + timeout * harness.TIME_SCALE
        while True:
            got = self.probe_all(ports, protocols, families)
            wrong = []
            for (s, d, proto, port, fam), ok in got.items():
                want = allowed(self.pods[s], self.pods[d], proto, port)
                if want != ok:
                    wrong.append(f"{s} -> {d} {proto}/{port} IPv{fam}: {'reached' if ok else 'blocked'}, "
                                 f"expected {'reached' if want else 'blocked'}")
            if not wrong:
                return len(got)
            if time.time() > deadline:
                raise AssertionError(f"{what}: {len(wrong)} of {len(got)} probes wrong:\n  " + "\n  ".join(sorted(wrong)[:40]))
            time.sleep(0.2)

    def close(self):
        for p in self.pods.values():
            try:
                p.delete()
            except Exception:  # noqa: BLE001 - keep cleaning up
                pass
        import shutil
        shutil.rmtree(self.tmp, ignore_errors=True)


def policy(ns, name, spec):
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": ns, "name": name}, "spec": spec}
