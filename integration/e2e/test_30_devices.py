"""Devices through both kubelet APIs: a pod asking for the device-plugin resource
`nodeplane.dev/tun` gets the device node, the env and the mount the agent's Allocate answers;
a ResourceClaim of the DeviceClass `nodeplane.dev` is allocated by the real kube-scheduler
from the ResourceSlices the controller published, and the pod sees its CDI device."""

import kube
from cluster import wait_for


def test_device_plugin_resource_gives_the_device_env_and_mount(ns, workers):
    for w in workers:
        wait_for(lambda: kube.get("node", w)["status"].get("allocatable", {}).get("nodeplane.dev/tun") == "4", 60,
                 f"{w} to offer nodeplane.dev/tun")
    pod = kube.busybox_pod("tun-user", ns, node=workers[0])
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nodeplane.dev/tun": "1"}}
    kube.apply(pod)
    kube.wait_running("tun-user", ns)
    assert kube.exec_("tun-user", ns, ["stat", "-c", "%F %t:%T", "/dev/net/tun"]).stdout.split()[-1] == "a:c8", \
        "the device node 10:200"
    env = kube.exec_("tun-user", ns, ["env"]).stdout
    assert "NODEPLANE_E2E_DEVICE=tun" in env
    assert "NODEPLANE_DEVICES_TUN=tun-" in env
    assert "ID=debian" in kube.exec_("tun-user", ns, ["cat", "/etc/node-os-release"]).stdout
    # A pod without the resource has no such device.
    kube.apply(kube.busybox_pod("no-tun", ns, node=workers[0]))
    kube.wait_running("no-tun", ns)
    assert kube.exec_("no-tun", ns, ["ls", "/dev/net/tun"], check=False).returncode != 0


def test_resource_claim_allocated_by_the_scheduler_reaches_the_pod_as_a_cdi_device(ns, workers):
    wait_for(lambda: {s["spec"].get("nodeName") for s in kube.get("resourceslices")["items"]
                      if s["spec"]["driver"] == "dra.nodeplane.dev"} >= set(workers), 60,
             "every node's ResourceSlice pool")
    kube.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "one-fuse", "namespace": ns},
                "spec": {"spec": {"devices": {"requests": [{"name": "fuse", "exactly": {
                    "deviceClassName": "nodeplane.dev",
                    "selectors": [{"cel": {"expression":
                                           'device.attributes["dra.nodeplane.dev"].resource == "fuse"'}}]}}]}}}})
    pod = kube.busybox_pod("fuse-user", ns, node=workers[-1])
    pod["spec"]["resourceClaims"] = [{"name": "fuse", "resourceClaimTemplateName": "one-fuse"}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "fuse"}]}
    kube.apply(pod)
    kube.wait_running("fuse-user", ns)
    claims = [c for c in kube.get("resourceclaims", ns=ns)["items"]
              if c["metadata"].get("annotations", {}).get("resource.kubernetes.io/pod-claim-name") == "fuse"]
    assert len(claims) == 1
    results = claims[0]["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["pool"]) for r in results] == [("dra.nodeplane.dev", workers[-1])]
    assert kube.exec_("fuse-user", ns, ["stat", "-c", "%F %t:%T", "/dev/fuse"]).stdout.split()[-1] == "a:e5", \
        "the device node 10:229"
