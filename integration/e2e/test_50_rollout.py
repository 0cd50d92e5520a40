"""`kubectl rollout restart daemonset/nodeplane-agent` under traffic, then an agent killed
with SIGKILL: pods keep their network (replies lost within the budget), their addresses and
their mounts; no pod restarts; a pod created meanwhile gets its network; nothing leaks."""

import os
import signal
import time

import kube
from cluster import kubectl, log, wait_for
from install import daemonset_rolled_out

# Replies a 10 Hz ping across nodes may lose while agents restart: none. The datapath is
# kernel state that outlives the agent; a lost reply would be a real fault.
LOST_BUDGET = 0


def pvc(name, ns):
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "nodeplane-local",
                     "resources": {"requests": {"storage": "32Mi"}}}}


def pod_with_volume(name, ns, node, claim):
    p = kube.busybox_pod(name, ns, node=node)
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    p["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    return p


def snapshot(ns, names):
    """(uid, pod IPs, restart count) of each pod."""
    out = {}
    for n in names:
        p = kube.get("pod", n, ns)
        out[n] = (p["metadata"]["uid"], kube.pod_ips(p),
                  sum(c["restartCount"] for c in p["status"]["containerStatuses"]))
    return out


def start_traffic(ns, workers):
    a, b = kube.get("pod", f"peer-{workers[0]}", ns), kube.get("pod", f"peer-{workers[1]}", ns)
    return [kube.Pinger(f"peer-{workers[0]}", ns, ip) for ip in kube.pod_ips(b)] + \
           [kube.Pinger(f"peer-{workers[1]}", ns, ip) for ip in kube.pod_ips(a)]


def lost(pingers):
    total = 0
    for p in pingers:
        sent, unanswered = p.stop()
        assert sent > 0
        if unanswered:
            log(f"{p.tag} from {p.pod}: no reply to seq {unanswered} of {sent} sent")
        total += len(unanswered)
    return total


def assert_volume_writable(pod, ns, tag):
    assert "/data" in kube.exec_(pod, ns, ["cat", "/proc/mounts"]).stdout
    kube.exec_(pod, ns, ["sh", "-c", f"echo {tag} > /data/{tag} && sync"])
    assert kube.exec_(pod, ns, ["cat", f"/data/{tag}"]).stdout.strip() == tag


def setup(ns, workers):
    kube.apply(*(kube.busybox_pod(f"peer-{w}", ns, node=w) for w in workers), pvc("vol", ns),
               pod_with_volume("vol-user", ns, workers[0], "vol"))
    for n in [f"peer-{w}" for w in workers] + ["vol-user"]:
        kube.wait_running(n, ns, timeout=180)
    return [f"peer-{w}" for w in workers] + ["vol-user"]


def agent_ready_times(t0, workers, seen):
    """When each node's agent pod that started after t0 became Ready (seconds after t0)."""
    for p in kube.get("pods", ns="nodeplane-system")["items"]:
        if p["metadata"]["labels"].get("app.kubernetes.io/component") != "agent":
            continue
        node = p["spec"].get("nodeName")
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        if node in workers and ready and p["metadata"]["creationTimestamp"] >= t0[1] and node not in seen:
            seen[node] = round(time.monotonic() - t0[0], 1)
    return seen


def test_rolling_restart_of_the_agents_keeps_pods_whole(ns, workers):
    names = setup(ns, workers)
    before = snapshot(ns, names)
    pingers = start_traffic(ns, workers)
    time.sleep(1)
    t_api = kubectl(["get", "--raw", "/version"]) and time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = (time.monotonic(), t_api)
    kubectl(["-n", "nodeplane-system", "rollout", "restart", "daemonset/nodeplane-agent"])
    kube.apply(*(kube.busybox_pod(f"during-{w}", ns, node=w) for w in workers))
    seen = {}
    wait_for(lambda: agent_ready_times(t0, workers, seen) and daemonset_rolled_out("nodeplane-agent")
             and len(seen) == len(workers), 300, "the rolling restart to finish")
    total = round(time.monotonic() - t0[0], 1)
    time.sleep(1)
    missing = lost(pingers)
    kube.record("rollout", {"seconds": total, "agent_ready_after": seen, "lost_replies": missing})
    log(f"rollout restart: {total} s for {len(workers)} nodes, new agents ready at {seen}, {missing} replies lost")
    assert missing <= LOST_BUDGET, f"{missing} ping replies lost during the rolling restart"
    assert snapshot(ns, names) == before, "a pod restarted or changed its address"
    assert_volume_writable("vol-user", ns, "after-rollout")
    for w in workers:
        pod = kube.wait_running(f"during-{w}", ns, timeout=120)
        other = kube.get("pod", f"peer-{[x for x in workers if x != w][0]}", ns)
        for ip in kube.pod_ips(other):
            assert kube.ping(f"during-{w}", ns, ip), f"during-{w} cannot reach {ip}"
        assert len(kube.pod_ips(pod)) == 2


def test_agent_killed_keeps_pods_and_a_new_pod_starts_once_it_is_back(ns, workers):
    victim = workers[-1]
    node = kube.node_named(victim)
    names = [f"peer-{w}" for w in workers] + ["vol-user"]
    before = snapshot(ns, names)
    agent = kube.agent_pod(victim)
    restarts = agent["status"]["containerStatuses"][0]["restartCount"]
    pingers = start_traffic(ns, workers)
    time.sleep(1)
    os.kill(kube.container_pid(agent, "agent"), signal.SIGKILL)
    kube.apply(kube.busybox_pod("while-down", ns, node=victim))
    wait_for(lambda: kube.agent_pod(victim)["status"]["containerStatuses"][0]["restartCount"] > restarts, 60,
             "kubelet to restart the killed agent")
    kube.wait_running("while-down", ns, timeout=180)
    wait_for(lambda: daemonset_rolled_out("nodeplane-agent"), 120, "the agent to be ready again")
    time.sleep(1)
    missing = lost(pingers)
    kube.record("agent_sigkill_lost_replies", missing)
    assert missing <= LOST_BUDGET, f"{missing} ping replies lost while the agent was down"
    assert snapshot(ns, names) == before
    assert_volume_writable("vol-user", ns, "after-kill")
    new = kube.get("pod", "while-down", ns)
    assert len(kube.pod_ips(new)) == 2
    for ip in kube.pod_ips(kube.get("pod", f"peer-{workers[0]}", ns)):
        assert kube.ping("while-down", ns, ip)
    # Nothing leaked on the node: one lease and one veth per pod of the pod network there.
    pods = kube.pods_on(victim)
    wait_for(lambda: len(kube.lease_files(node)) == len(pods) == len(kube.pod_veths(node)), 30,
             f"leases, veths and pods on {victim} to agree")

