"""nodeplane installed on the lane's cluster as an operator installs it: one `kubectl apply -k`
of the test overlay, then the rollout watched until every node is Ready."""

import json
import time

from cluster import REPO, Fail, kubectl, log, save_state, wait_for

NS = "nodeplane-system"
OVERLAY = REPO / "daemonset" / "overlays" / "e2e"


def get(kind, name=None, ns=None):
    args = ["get", kind] + ([name] if name else []) + (["-n", ns] if ns else []) + ["-o", "json"]
    r = kubectl(args, check=False)
    if r.returncode != 0:
        return None
    return json.loads(r.stdout)


def node_ready(node):
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def ready_nodes():
    nodes = get("nodes") or {"items": []}
    return [n["metadata"]["name"] for n in nodes["items"] if node_ready(n)]


def daemonset_rolled_out(name, ns=NS):
    ds = get("daemonset", name, ns)
    if not ds:
        return False
    s = ds["status"]
    want = s.get("desiredNumberScheduled", 0)
    return (want > 0 and s.get("observedGeneration") == ds["metadata"]["generation"]
            and s.get("updatedNumberScheduled") == want and s.get("numberReady") == want
            and s.get("numberAvailable") == want)


def deployment_available(name, ns=NS):
    d = get("deployment", name, ns)
    if not d:
        return False
    s = d["status"]
    return (s.get("observedGeneration") == d["metadata"]["generation"] and s.get("readyReplicas") == d["spec"]["replicas"]
            and s.get("updatedReplicas") == d["spec"]["replicas"])


def ready_condition(node):
    c = next((c for c in node["status"].get("conditions", []) if c["type"] == "Ready"), {})
    return {"status": c.get("status"), "reason": c.get("reason"), "message": c.get("message", "")[:300]}


def install(st):
    # Before nodeplane: every node registered and NotReady (no CNI configuration yet); the
    # check in test_00_install.py reads what was seen here.
    st["before_install"] = {n["metadata"]["name"]: ready_condition(n) for n in get("nodes")["items"]}
    t0 = time.monotonic()
    kubectl(["apply", "-k", OVERLAY])
    nodes = [n["name"] for n in st["nodes"]]
    wait_for(lambda: deployment_available("nodeplane-controller"), 180, "the controller to lead and serve")
    log(f"controller ready after {time.monotonic() - t0:.1f} s")
    wait_for(lambda: daemonset_rolled_out("nodeplane-agent"), 180, "the agent DaemonSet to roll out")
    wait_for(lambda: sorted(ready_nodes()) == sorted(nodes), 120, "every node to be Ready")
    log(f"nodeplane installed: {len(nodes)} nodes Ready after {time.monotonic() - t0:.1f} s")
    st["installed_seconds"] = round(time.monotonic() - t0, 1)
    save_state(st)


def diagnostics():
    """What an operator would look at first, when a step fails."""
    for args in (["get", "nodes", "-o", "wide"], ["get", "pods", "-A", "-o", "wide"],
                 ["-n", NS, "describe", "pods"], ["get", "events", "-A", "--sort-by=.lastTimestamp"]):
        r = kubectl(args, check=False)
        print(f"--- kubectl {' '.join(args)}\n{r.stdout}{r.stderr}")


__all__ = ["install", "get", "ready_nodes", "daemonset_rolled_out", "deployment_available", "Fail"]
