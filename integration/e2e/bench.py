"""Figures from the real cluster (`scripts/e2e bench`; a benchmark, not a test):

- pod create → Running and Ready, with its network: 30 pods one after another, median and
  p99, against the same 30 pods with `hostNetwork: true` (no CNI) in the same run;
- PVC create → pod Running with the volume mounted (WaitForFirstConsumer: provisioning, stage
  and publish on the pod's node), 5 in a row;
- the rolling restart of the agents: seconds per node and ping replies lost (measured by the
  checks in test_50_rollout.py, printed from their record).

Times are taken on this side with a monotonic clock: from just before the `kubectl apply` to
the moment a watch reports the pod Ready.
"""

import json
import statistics
import subprocess
import threading
import time

import cluster
import kube
from cluster import tool

NS = "e2e-bench"


class ReadyWatch:
    """A `kubectl get pods --watch` of the namespace: when each pod was first seen Ready."""

    def __init__(self, ns):
        self.ready = {}
        self.proc = subprocess.Popen(
            cluster.in_net(cluster.CONTROL, [tool("kubectl"), "--kubeconfig", str(cluster.admin_kubeconfig()), "get",
                                            "pods", "-n", ns, "--watch", "-o", "json"]),
            stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        buf = ""
        depth = 0
        for line in self.proc.stdout:
            buf += line
            depth += line.count("{") - line.count("}")
            if depth == 0 and buf.strip():
                pod = json.loads(buf)
                buf = ""
                ready = any(c["type"] == "Ready" and c["status"] == "True"
                            for c in pod["status"].get("conditions", []))
                if ready and kube.pod_ips(pod) and pod["metadata"]["name"] not in self.ready:
                    self.ready[pod["metadata"]["name"]] = time.monotonic()

    def wait(self, name, timeout=120):
        return cluster.wait_for(lambda: self.ready.get(name), timeout, f"{name} to be Ready", every=0.02)

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def pods_one_after_another(watch, prefix, count, workers, host_network):
    took = []
    for i in range(count):
        name = f"{prefix}-{i}"
        t0 = time.monotonic()
        kube.apply(kube.busybox_pod(name, NS, node=workers[i % len(workers)], host_network=host_network))
        took.append(watch.wait(name) - t0)
    return took


def volumes_one_after_another(watch, count, workers):
    took = []
    for i in range(count):
        name = f"vol-{i}"
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": NS},
                 "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "nodeplane-local",
                          "resources": {"requests": {"storage": "64Mi"}}}}
        pod = kube.busybox_pod(name, NS, node=workers[i % len(workers)])
        pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "d", "mountPath": "/data"}]
        pod["spec"]["volumes"] = [{"name": "d", "persistentVolumeClaim": {"claimName": name}}]
        t0 = time.monotonic()
        kube.apply(claim, pod)
        took.append(watch.wait(name, timeout=300) - t0)
    return took


def row(label, values):
    ms = [v * 1000 for v in values]
    return f"{label:<44} {statistics.median(ms):8.0f} {pct(ms, 99):8.0f} {len(ms):4d}"


def main():
    workers = [n["name"] for n in cluster.load_state()["nodes"]]
    kube.namespace(NS)
    watch = ReadyWatch(NS)
    try:
        host = pods_one_after_another(watch, "host", 30, workers, True)
        net = pods_one_after_another(watch, "net", 30, workers, False)
        vols = volumes_one_after_another(watch, 5, workers)
    finally:
        watch.stop()
        kube.delete("namespace", NS, timeout=300)
    print(f"{'figure (ms)':<44} {'median':>8} {'p99':>8} {'n':>4}")
    print(row("pod create -> Ready, hostNetwork", host))
    print(row("pod create -> Ready, pod network (nodeplane)", net))
    print(f"{'  ratio pod network / hostNetwork (median)':<44} {statistics.median(net) / statistics.median(host):8.2f}")
    print(row("PVC + pod create -> Ready, volume mounted", vols))
    figures = cluster.WORK / "figures.json"
    if figures.exists():
        f = json.loads(figures.read_text())
        r = f.get("rollout")
        if r:
            print(f"rolling restart of {len(r['agent_ready_after'])} agents: {r['seconds']} s "
                  f"({r['seconds'] / len(r['agent_ready_after']):.1f} s per node), {r['lost_replies']} ping replies lost")
        if "agent_sigkill_lost_replies" in f:
            print(f"agent killed (SIGKILL): {f['agent_sigkill_lost_replies']} ping replies lost")
    else:
        print("rolling restart: run `scripts/e2e test` first (its checks measure it)")
    return 0
