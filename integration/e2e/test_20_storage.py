"""A volume's whole life through the real sidecars: a PVC of `nodeplane-local-xfs`
(WaitForFirstConsumer) provisioned by the external-provisioner on the pod's node, mounted,
written and read; expanded by the external-resizer while the pod uses it; snapshotted by the
snapshot-controller and csi-snapshotter and restored into a new PVC whose file reads as
written; everything deleted leaves no volume, loop device or mount on the node."""

import time

import kube
from cluster import wait_for

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
    from cluster import kubectl
    import json

    kubectl(["patch", "pvc", claim, "-n", ns, "--type", "merge", "-p",
             json.dumps({"spec": {"resources": {"requests": {"storage": size}}}})])
