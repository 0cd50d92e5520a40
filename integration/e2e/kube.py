"""What the checks do with the cluster: objects through kubectl, commands in pods, and looks
inside a node (its network and mount namespaces) for the kernel state a check asserts."""

import json
import re
import time
from pathlib import Path

import cluster
from cluster import Fail, kubectl, run, wait_for


def apply(*objects):
    """`kubectl apply` of objects given as dicts."""
    doc = {"apiVersion": "v1", "kind": "List", "items": list(objects)}
    kubectl(["apply", "-f", "-"], input=json.dumps(doc))


def get(kind, name=None, ns=None, check=True):
    args = ["get", kind] + ([name] if name else []) + (["-n", ns] if ns else []) + ["-o", "json"]
    r = kubectl(args, check=check)
    return json.loads(r.stdout) if r.returncode == 0 else None


def delete(kind, name, ns=None, wait=True, timeout=120):
    args = ["delete", kind, name, "--ignore-not-found", f"--wait={'true' if wait else 'false'}",
            f"--timeout={timeout}s"] + (["-n", ns] if ns else [])
    kubectl(args, timeout=timeout + 30)


def namespace(name):
    apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # Pods need the namespace's default ServiceAccount, made by the controller-manager.
    wait_for(lambda: get("serviceaccount", "default", name, check=False), 30, f"{name}'s default ServiceAccount")


def busybox_pod(name, ns, node=None, command=("sleep", "3600"), host_network=False, **spec):
    """A pod of the lane's busybox image, placed by the scheduler (on `node` through a node
    selector, not nodeName: the scheduler still decides)."""
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": cluster.BUSYBOX_IMAGE, "imagePullPolicy": "IfNotPresent",
                            "command": list(command)}],
            **spec,
        },
    }
    if node:
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    if host_network:
        pod["spec"]["hostNetwork"] = True
    return pod


def pod_running(name, ns):
    p = get("pod", name, ns, check=False)
    if not p:
        return None
    if p["status"].get("phase") == "Running" and all(c.get("ready") for c in p["status"].get("containerStatuses", [])):
        return p
    return None


def wait_running(name, ns, timeout=120):
    try:
        return wait_for(lambda: pod_running(name, ns), timeout, f"pod {ns}/{name} to run")
    except Fail:
        raise Fail(f"pod {ns}/{name} is not running after {timeout} s:\n{describe('pod', name, ns)}")


def describe(kind, name, ns):
    r = kubectl(["describe", kind, name, "-n", ns], check=False)
    return r.stdout[-4000:] + r.stderr[-1000:]


def pod_ips(pod):
    return [ip["ip"] for ip in pod["status"].get("podIPs", [])]


def exec_(name, ns, argv, check=True, timeout=60):
    """A command in the pod's container (through the API server and its node's kubelet)."""
    return kubectl(["exec", "-n", ns, name, "--", *argv], check=check, timeout=timeout)


def ping(src, ns, dst, count=1, wait=2):
    args = ["ping", "-c", str(count), "-W", str(wait)] + (["-6"] if ":" in dst else []) + [dst]
    return exec_(src, ns, args, check=False).returncode == 0


# ----- inside a node -----


def nodes():
    return cluster.load_state()["nodes"]


def node_named(name):
    return next(n for n in nodes() if n["name"] == name)


def on_node(node, argv, check=True, timeout=60):
    """A command in the node's network and mount namespaces: what the node's host sees."""
    return run(cluster.in_node(node, argv), check=check, timeout=timeout)


def node_mounts(node):
    """The node's mount table (its mount namespace's mountinfo): (mount point, source)."""
    text = Path(f"/proc/{node['holder']}/mountinfo").read_text()
    out = []
    for line in text.splitlines():
        f = line.split()
        sep = f.index("-")
        out.append((f[4], f[sep + 2]))
    return out


def loop_devices_of(node):
    """Loop devices backed by a file in the node's directory."""
    return cluster.loop_devices_backed_in(node["dir"])


def agent_pod(node_name):
    pods = get("pods", ns="nodeplane-system")["items"]
    for p in pods:
        if p["metadata"]["labels"].get("app.kubernetes.io/component") == "agent" and p["spec"].get("nodeName") == node_name:
            return p
    return None


def elapsed(t0):
    return round(time.monotonic() - t0, 2)


class Pinger:
    """A ping running in a pod in the background (its own log in the pod's /tmp), stopped
    with SIGINT so busybox prints its statistics: how many replies were lost meanwhile."""

    def __init__(self, pod, ns, dst, interval="0.1"):
        import ipaddress

        ipaddress.ip_address(dst)  # only an address ever reaches the shell line below
        self.pod, self.ns, self.tag = pod, ns, f"ping-{dst.replace(':', '_').replace('.', '_')}"
        fam = "-6 " if ":" in dst else ""
        exec_(pod, ns, ["sh", "-c", f"ping {fam}-i {interval} {dst} > /tmp/{self.tag}.log 2>&1 & "
                                    f"echo $! > /tmp/{self.tag}.pid"])

    def stop(self):
        """(transmitted, the sequence numbers never answered). The last one sent is not
        counted: SIGINT can stop the ping while its reply is still on the way."""
        exec_(self.pod, self.ns, ["sh", "-c", f"kill -INT $(cat /tmp/{self.tag}.pid)"])
        wait_for(lambda: "packets received" in self.log(), 10, f"{self.tag}'s statistics")
        out = self.log()
        sent = int(next(x for x in out.splitlines() if "packets transmitted" in x).split()[0])
        answered = {int(n) for n in re.findall(r"\bseq=(\d+)", out)}
        return sent, [n for n in range(sent - 1) if n not in answered]

    def log(self):
        return exec_(self.pod, self.ns, ["cat", f"/tmp/{self.tag}.log"], check=False).stdout


def container_pid(pod, container):
    """The host PID of a pod's container, from its node's containerd (`ctr tasks ls`)."""
    node = node_named(pod["spec"]["nodeName"])
    cid = next(s["containerID"] for s in pod["status"]["containerStatuses"] if s["name"] == container)
    cid = cid.split("://", 1)[1]
    sock = Path(node["dir"]) / "run" / "containerd" / "containerd.sock"
    out = run([cluster.tool("ctr"), "--address", sock, "-n", "k8s.io", "tasks", "ls"]).stdout
    for line in out.splitlines()[1:]:
        f = line.split()
        if f and f[0] == cid:
            return int(f[1])
    raise Fail(f"container {cid} of {pod['metadata']['name']} is not running on {node['name']}")


def lease_files(node):
    """The node's IPAM leases: one file `<container id>:<ifname>.json` per attachment."""
    d = Path(node["dir"]) / "nodeplane" / "ipam"
    return sorted(p.name for p in d.glob("*.json"))


def pod_veths(node):
    """The node's host-side pod veths in service (not the retired ones awaiting the reaper)."""
    r = on_node(node, ["ip", "-j", "-d", "link", "show", "type", "veth"])
    return [link["ifname"] for link in json.loads(r.stdout or "[]") if link.get("group") != "0x6e70"
            and link.get("ifname") != "ul0"]


def pods_on(node_name, host_network=False):
    items = json.loads(kubectl(["get", "pods", "-A", "-o", "json"]).stdout)
    return [p for p in items["items"] if p["spec"].get("nodeName") == node_name
            and bool(p["spec"].get("hostNetwork")) == host_network and p["status"].get("phase") == "Running"]


def record(key, value):
    """A figure for the lane's report (WORK/figures.json; scripts/e2e prints it)."""
    path = cluster.WORK / "figures.json"
    figures = json.loads(path.read_text()) if path.exists() else {}
    figures[key] = value
    path.write_text(json.dumps(figures, indent=1))
