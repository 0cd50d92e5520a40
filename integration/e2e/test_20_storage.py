"""A volume's whole life through the real sidecars: a PVC of `nodeplane-local-xfs`
(WaitForFirstConsumer) provisioned by the external-provisioner on the pod's node, mounted,
written and read; expanded by the external-resizer while the pod uses it; snapshotted by the
snapshot-controller and csi-snapshotter and restored into a new PVC whose file reads as
written; everything deleted leaves no volume, loop device or mount on the node.

Then capacity for the scheduler: the provisioner publishes a CSIStorageCapacity per worker and
class, equal to the free space the node's agent reports; with one worker nearly full, the
scheduler refuses it for a claim that does not fit and sends unconstrained claims' pods to the
other worker at the first attempt; the figures follow volumes as they come and go."""

import json
import time

import kube
from cluster import Fail, kubectl, wait_for

MARK = "written-before-the-snapshot"


# xfs (volumes of at least 300 MiB, its smallest filesystem): online growth of ext4 needs CAP_SYS_RESOURCE, which root lacks on the lane's host
# (daemonset/overlays/e2e/storageclass-xfs.yaml); ext4 volumes are used by test_50_rollout.
CLASS = "nodeplane-local-xfs"


def pvc(name, ns, size, source=None):
    spec = {"accessModes": ["ReadWriteOnce"], "storageClassName": CLASS,
            "resources": {"requests": {"storage": size}}}
    if source:
        spec["dataSource"] = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": source}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
            "spec": spec}


def pod_with(name, ns, claim, node):
    p = kube.busybox_pod(name, ns, node=node)
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    p["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]
    return p


def bound_pv(claim, ns):
    c = kube.get("pvc", claim, ns)
    return c["spec"].get("volumeName") if c["status"].get("phase") == "Bound" else None


def pv_node(pv):
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    return [v for t in terms for e in t["matchExpressions"] for v in e["values"]
            if e["key"] == "topology.csi.nodeplane.dev/node"]


def df_kib(pod, ns):
    out = kube.exec_(pod, ns, ["df", "-k", "/data"]).stdout.splitlines()[-1].split()
    return int(out[1])


def volume_mounts(node, handle):
    return [m for m in kube.node_mounts(node) if handle in m[0]]


def test_volume_provisioned_expanded_snapshotted_restored_and_deleted_cleanly(ns, workers):
    node = kube.node_named(workers[-1])
    kube.apply(pvc("data", ns, "320Mi"))
    time.sleep(2)
    assert kube.get("pvc", "data", ns)["status"]["phase"] == "Pending", "WaitForFirstConsumer binds with the pod"
    kube.apply(pod_with("writer", ns, "data", node["name"]))
    kube.wait_running("writer", ns, timeout=180)
    pv = kube.get("pv", bound_pv("data", ns))
    handle = pv["spec"]["csi"]["volumeHandle"]
    assert pv_node(pv) == [node["name"]], "provisioned on the pod's node"
    kube.exec_("writer", ns, ["sh", "-c", f"echo {MARK} > /data/mark && sync"])
    assert kube.exec_("writer", ns, ["cat", "/data/mark"]).stdout.strip() == MARK
    assert volume_mounts(node, handle), "the volume is mounted on its node"
    assert kube.loop_devices_of(node), "a loop device backs it"
    # The volume names the controller's store: the uid of the volume records' CRD, read by
    # the controller under its RBAC. Orphan reclaim trusts nothing else.
    crd_uid = kube.get("crd", "nodeplanevolumes.nodeplane.dev")["metadata"]["uid"]
    meta = lambda: json.loads(kube.on_node(node, ["cat", f"/var/lib/nodeplane/volumes/{handle}.json"]).stdout)
    wait_for(lambda: meta().get("controllerStore") == f"crd-{crd_uid}", 30, "the volume to name the CRD's uid")

    # Expansion while in use: the resizer grows the volume, kubelet the filesystem (online).
    before = df_kib("writer", ns)
    kubectl_patch_size("data", ns, "640Mi")
    wait_for(lambda: kube.get("pvc", "data", ns)["status"].get("capacity", {}).get("storage") == "640Mi", 180,
             "the PVC's capacity to reach 640Mi")
    wait_for(lambda: df_kib("writer", ns) > before + 200 * 1024, 120, "the filesystem to grow in the pod")
    assert kube.exec_("writer", ns, ["cat", "/data/mark"]).stdout.strip() == MARK

    # Snapshot, then a change the snapshot must not hold.
    kube.apply({"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
                "metadata": {"name": "snap", "namespace": ns},
                "spec": {"volumeSnapshotClassName": "nodeplane-local",
                         "source": {"persistentVolumeClaimName": "data"}}})
    wait_for(lambda: (kube.get("volumesnapshot", "snap", ns).get("status") or {}).get("readyToUse"), 180,
             "the VolumeSnapshot to be ready")
    kube.exec_("writer", ns, ["sh", "-c", "echo later > /data/after && sync"])

    kube.apply(pvc("restored", ns, "640Mi", source="snap"), pod_with("reader", ns, "restored", node["name"]))
    kube.wait_running("reader", ns, timeout=180)
    assert kube.exec_("reader", ns, ["cat", "/data/mark"]).stdout.strip() == MARK
    assert kube.exec_("reader", ns, ["ls", "/data/after"], check=False).returncode != 0, "the snapshot predates 'after'"
    restored = kube.get("pv", bound_pv("restored", ns))
    assert restored["spec"]["csi"]["volumeHandle"] != handle

    # Everything deleted: nothing left on the node.
    handles = [handle, restored["spec"]["csi"]["volumeHandle"]]
    for kind, name in (("pod", "writer"), ("pod", "reader"), ("volumesnapshot", "snap"), ("pvc", "restored"),
                       ("pvc", "data")):
        kube.delete(kind, name, ns, timeout=180)
    wait_for(lambda: not any(kube.get("pv", bound, check=False) for bound in (pv["metadata"]["name"],
                                                                          restored["metadata"]["name"])),
             180, "both PersistentVolumes to be deleted")
    wait_for(lambda: not kube.get("nodeplanevolumes")["items"], 120, "the controller to forget every volume")
    wait_for(lambda: not kube.loop_devices_of(node), 60, "the node's loop devices to be detached")
    for h in handles:
        assert not volume_mounts(node, h), f"{h} is still mounted on {node['name']}"
    # Volume images sit directly in the volume directory, named after the volume.
    images = kube.on_node(node, ["find", "/var/lib/nodeplane/volumes", "-maxdepth", "1", "-type", "f"]).stdout.split()
    assert not [i for i in images if any(h in i for h in handles) or i.endswith(".img")], images


def kubectl_patch_size(claim, ns, size):
    kubectl(["patch", "pvc", claim, "-n", ns, "--type", "merge", "-p",
             json.dumps({"spec": {"resources": {"requests": {"storage": size}}}})])


# ----- capacity for the scheduler (CSIStorageCapacity) -----

DRIVER = "csi.nodeplane.dev"
TOPOLOGY_KEY = "topology.csi.nodeplane.dev/node"
SYSTEM_NS = "nodeplane-system"
# The base's class (ext4): the smallest volumes, no filesystem minimum to round up to.
CAPACITY_CLASS = "nodeplane-local"
MIB = 1 << 20
# What the filler leaves free on the full node, and the size of each later claim: more than
# that, so the full node cannot take one.
LEFT = 256 * MIB
PROBE = 512 * MIB
PROBES = 3
# The lane's overlay gives each node 4 GiB (csi.capacityBytes); more would mean a filler far
# larger than the test needs (its journal is written for real).
MAX_FILL = 8 << 30
SUFFIX = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def quantity(q):
    """Bytes of a Kubernetes quantity as the API writes CSIStorageCapacity figures."""
    q = str(q)
    for s in sorted(SUFFIX, key=len, reverse=True):
        if q.endswith(s):
            return int(q[:-len(s)]) * SUFFIX[s]
    return int(q)


def selects(selector, labels):
    """Whether a LabelSelector selects a node with `labels` (as the scheduler matches it)."""
    if not selector:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        has, val = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and val in e.get("values", []), "NotIn": not has or val not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def driver_classes(backend="file"):
    """Our WaitForFirstConsumer classes on `backend` (their `backend` parameter; none: file):
    the ones the provisioner publishes capacity for."""
    return sorted(c["metadata"]["name"] for c in kube.get("storageclass")["items"]
                  if c["provisioner"] == DRIVER and c.get("volumeBindingMode") == "WaitForFirstConsumer"
                  and c.get("parameters", {}).get("backend", "file") == backend)


def published(workers, classes):
    """{(node, class): (capacity, maximumVolumeSize, object)} for each node and class with
    exactly one CSIStorageCapacity of the driver in nodeplane-system whose nodeTopology
    selects the node (none, or a passing duplicate, leaves the pair out)."""
    objs = kube.get("csistoragecapacities", ns=SYSTEM_NS)["items"]
    mine = [o for o in objs if o["metadata"].get("labels", {}).get("csi.storage.k8s.io/drivername") == DRIVER]
    out = {}
    for w in workers:
        labels = kube.get("node", w)["metadata"].get("labels", {})
        assert labels.get(TOPOLOGY_KEY) == w, f"{w} has no {TOPOLOGY_KEY} label: {labels}"
        for cls in classes:
            found = [o for o in mine if o["storageClassName"] == cls and selects(o.get("nodeTopology"), labels)]
            if len(found) == 1:
                o = found[0]
                out[(w, cls)] = (quantity(o.get("capacity", 0)),
                                 quantity(o["maximumVolumeSize"]) if "maximumVolumeSize" in o else None, o)
    return out


def agent_available(node_name):
    """The free volume space the node's agent reports (`nodeplane status --json`)."""
    agent = kube.agent_pod(node_name)
    r = kubectl(["exec", "-n", SYSTEM_NS, agent["metadata"]["name"], "-c", "agent", "--",
                 "nodeplane", "status", "--json"])
    return json.loads(r.stdout)["storage"]["availableBytes"]


def wait_published(workers, classes, want, what, timeout=120):
    """Wait until every (node, class) object shows `want(node)` bytes, both as capacity and
    as maximumVolumeSize (sizes here are whole MiB); the last figures seen on timeout."""
    seen = {}

    def ok():
        seen.clear()
        got = published(workers, classes)
        seen.update({k: v[:2] for k, v in got.items()})
        return all(got.get((w, c), (None, None))[:2] == (want(w), want(w)) for w in workers for c in classes) and got

    try:
        return wait_for(ok, timeout, what, every=2)
    except Fail:
        raise Fail(f"timed out after {timeout} s waiting for {what}; want "
                   f"{ {w: want(w) for w in workers} }, published (capacity, maximumVolumeSize): {seen}")


def claim(name, ns, size, cls=CAPACITY_CLASS):
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": cls,
                     "resources": {"requests": {"storage": f"{size // MIB}Mi"}}}}


def provisioning_failures(claim_name, ns):
    return [e.get("message", "") for e in kube.get("events", ns=ns)["items"]
            if e["involvedObject"].get("kind") == "PersistentVolumeClaim"
            and e["involvedObject"].get("name") == claim_name and e.get("reason") == "ProvisioningFailed"]


def unschedulable_for_storage(pod, ns):
    p = kube.get("pod", pod, ns)
    c = next((c for c in p["status"].get("conditions", []) if c["type"] == "PodScheduled"), {})
    return c.get("status") == "False" and "did not have enough free storage" in c.get("message", "") and c


def delete_all(ns, made):
    """Pods first (kubelet unmounts), then their claims; then wait for the volumes to go."""
    pvs = [bound_pv(n, ns) for kind, n in made if kind == "pvc" and kube.get("pvc", n, ns, check=False)]
    for kind in ("pod", "pvc"):
        for k, n in made:
            if k == kind:
                kube.delete(kind, n, ns, timeout=180)
    wait_for(lambda: not any(kube.get("pv", pv, check=False) for pv in pvs if pv), 180,
             "the capacity test's PersistentVolumes to be deleted", every=1)


def test_scheduler_places_a_claim_by_published_capacity(ns, workers):
    """One worker nearly full: a WaitForFirstConsumer claim's pod lands on the other, decided
    by the scheduler from CSIStorageCapacity (not by a failed CreateVolume and a retry)."""
    assert len(workers) == 2, workers
    full, other = workers
    classes = driver_classes()
    assert CAPACITY_CLASS in classes, classes
    made = []
    done = False
    try:
        # (a) One object per worker and class, holding what the node's agent reports as free.
        reported = {w: agent_available(w) for w in workers}
        start = wait_published(workers, classes, lambda w: reported[w],
                               "CSIStorageCapacity objects equal to the agents' free space")
        # The lvm class: these nodes have no thin pool (this kernel has no device-mapper), so
        # the controller answers its GetCapacity with 0 and the scheduler sends none there.
        lvm_classes = driver_classes("lvm")
        assert lvm_classes == ["nodeplane-lvm"], lvm_classes
        wait_published(workers, lvm_classes, lambda w: 0, "the lvm class's CSIStorageCapacity objects at 0")
        for (w, cls), (_, _, o) in start.items():
            assert o["nodeTopology"] == {"matchLabels": {TOPOLOGY_KEY: w}}, o["nodeTopology"]
            owners = [(r["kind"], r["name"]) for r in o["metadata"].get("ownerReferences", [])]
            assert owners == [("Deployment", "nodeplane-controller")], owners
        free = {w: start[(w, CAPACITY_CLASS)][0] for w in workers}
        assert free[full] <= MAX_FILL, f"{full} offers {free[full]} bytes: is csi.capacityBytes set in the overlay?"
        assert free[full] - LEFT >= PROBE and free[other] >= PROBES * PROBE, free

        # (b) Fill one worker until less than one probe's size is left.
        fill = free[full] - LEFT
        made += [("pvc", "filler"), ("pod", "filler")]
        kube.apply(claim("filler", ns, fill), pod_with("filler", ns, "filler", full))
        kube.wait_running("filler", ns, timeout=180)
        assert pv_node(kube.get("pv", bound_pv("filler", ns))) == [full]
        wait_published(workers, classes, lambda w: LEFT if w == full else free[w],
                       f"{full}'s CSIStorageCapacity to drop to {LEFT} bytes", timeout=90)
        assert agent_available(full) == LEFT

        # A claim whose pod must run on the full node: the scheduler refuses the node for want
        # of storage, so the provisioner is never asked (no ProvisioningFailed, no selected node).
        made += [("pvc", "pinned"), ("pod", "pinned")]
        kube.apply(claim("pinned", ns, PROBE), pod_with("pinned", ns, "pinned", full))
        cond = wait_for(lambda: unschedulable_for_storage("pinned", ns), 60,
                        f"the scheduler to refuse {full} for want of storage", every=1)
        pinned = kube.get("pvc", "pinned", ns)
        assert pinned["status"].get("phase") == "Pending", pinned["status"]
        assert "volume.kubernetes.io/selected-node" not in pinned["metadata"].get("annotations", {}), cond
        assert not provisioning_failures("pinned", ns)
        kube.delete("pod", "pinned", ns)
        kube.delete("pvc", "pinned", ns)

        # (c) Claims with no node constraint: the scheduler reads the full node's object, below
        # each claim's size, and sends every pod to the other worker at the first attempt.
        got = published(workers, [CAPACITY_CLASS])
        assert got[(full, CAPACITY_CLASS)][1] < PROBE and got[(full, CAPACITY_CLASS)][0] < PROBE, got
        assert got[(other, CAPACITY_CLASS)][1] >= PROBES * PROBE, got
        probes = [f"probe-{i}" for i in range(PROBES)]
        for p in probes:
            made += [("pvc", p), ("pod", p)]
        kube.apply(*[claim(p, ns, PROBE) for p in probes], *[pod_with(p, ns, p, None) for p in probes])
        for p in probes:
            pod = kube.wait_running(p, ns, timeout=180)
            assert pod["spec"]["nodeName"] == other, f"{p} ran on {pod['spec']['nodeName']}"
            c = kube.get("pvc", p, ns)
            assert c["metadata"]["annotations"].get("volume.kubernetes.io/selected-node") == other
            assert pv_node(kube.get("pv", c["spec"]["volumeName"])) == [other]
        for p in probes:
            assert not provisioning_failures(p, ns), f"{p}: {provisioning_failures(p, ns)}"

        # Volumes come: the other worker's objects drop by what the probes took ...
        wait_published(workers, classes, lambda w: LEFT if w == full else free[w] - PROBES * PROBE,
                       f"{other}'s CSIStorageCapacity to drop by {PROBES} probes", timeout=90)
        # ... and go: every figure returns to where it started.
        delete_all(ns, made)
        done = True
        wait_published(workers, classes, lambda w: free[w], "every CSIStorageCapacity to return to its start",
                       timeout=90)
    finally:
        if not done:
            try:
                delete_all(ns, made)
            except Exception as e:  # the test's own failure is the one to report
                print(f"cleanup after failure: {e}")
