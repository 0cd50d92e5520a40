"""`nodeplane status` and `nodeplane doctor` against real agents, and the agent's JSON logs.

Status is compared with what the test can see for itself: lease files, links in the node
namespace, the mount table, the loop table, device nodes, the controller's records. The
doctor is given one real orphan of each kind (a host veth nobody leased, a lease whose pod
namespace was deleted, a second mount of a volume's device, a loop device whose file was
deleted) next to a healthy pod and a published volume; it must name exactly those, repair
exactly those, and leave the healthy ones working.
"""

import functools
import json
import os
import subprocess

import cluster
import harness

MIB = 1 << 20
wait_for = functools.partial(harness.wait_until, timeout=20.0)




def loops_of(path):
    """Loop devices whose backing file is `path` (deleted or not)."""
    return [d for d in harness.loops_under(path.parent)
            if open(f"/sys/block/{d[5:]}/loop/backing_file").read().strip().removesuffix(" (deleted)") == str(path)]


def mount_points():
    with open("/proc/self/mountinfo") as f:
        return {line.split(" ")[4].replace("\\040", " ") for line in f}


def provision(c, node, name, size=64 * MIB):
    """A volume on `node` through the controller, staged and published there: (id, staging, target)."""
    c.wait_connected([node])
    vid = c.controller.csi("create-volume", "--name", name, "--size", size, "--node", node.ns.name)["volumeId"]
    wait_for(lambda: vid in node.volume_files(), what=f"volume {vid} on {node.ns.name}")
    staging, target = node.staging_path(vid), node.target_path(vid)
    node.csi("stage", "--id", vid, "--staging", staging, "--fs", "ext4")
    node.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", "ext4")
    return vid, staging, target


def test_status_matches_the_node():
    c = cluster.Cluster()
    try:
        n = c.node(1, 1, start=False, csi={"capacityBytes": 512 * MIB})
        dev = harness.make_devices(n, "stdev", 2)
        n.start()
        resource = "nodeplane.dev/stdev"
        wait_for(lambda: n.status("status")[1]["devicePlugins"], what="device plugins in the status")
        pods = [n.add_pod(f"st{i}")[0] for i in range(2)]
        vid, staging, target = provision(c, n, "pvc-status")

        # The conditions are the readiness endpoint's (re-evaluated every 250 ms).
        conditions = lambda: {x["name"]: x["ready"] for x in n.status("status")[1]["conditions"]}
        wait_for(lambda: conditions() == {"cni": True, "csi": True, "deviceplugins": True}, what="all conditions ready")
        rc, st = n.status("status")
        assert rc == 0
        assert st["format"] == 1 and st["node"] == n.ns.name and st["mode"] == "controller"

        # The kernel features probed at start-up: this kernel, each feature the node's parts
        # use (the datapath's, CSI's), every one answered by the probe.
        kernel = st["kernel"]
        assert kernel["release"] == os.uname().release, kernel
        features = {f["name"]: f for f in kernel["features"]}
        assert {"nft-inet-nat", "so-netns-cookie", "openat2", "loop-configure", "statx-mnt-id"} <= set(features), kernel
        assert all(f["state"] in ("available", "missing") for f in features.values()), kernel
        for name in ("nft-inet-nat", "openat2"):  # required: a node without them is not ready
            assert features[name]["required"] and features[name]["state"] == "available", features[name]

        # Network: attachments are exactly the lease files, and the kernel agrees with each.
        net = st["network"]
        leases = {(l["containerId"], l["ifname"]): l for l in n.leases().values()}
        assert {(a["containerId"], a["ifname"]) for a in net["attachments"]} == set(leases) == {(p.cid, "eth0") for p in pods}
        links = n.ns.links()
        for a in net["attachments"]:
            lease = leases[(a["containerId"], a["ifname"])]
            assert sorted(a["ips"]) == sorted(lease["ips"]) and a["hostIf"] == lease["hostIf"] in links
            assert a["netnsPresent"] and a["hostIfPresent"] and a["hostIfOnBridge"] and a["state"] == "ready", a
        assert net["bridge"]["present"] and net["bridge"]["up"] and net["bridge"]["name"] in links
        mine = c.controller.nodes()[n.ns.name]["blocks"]
        assert {b["cidr"] for b in net["blocks"]} == set(mine)
        assert sum(b["allocated"] for b in net["blocks"]) == 2 * len(pods)
        assert net["unleasedHostVeths"] == []

        # Controller link.
        ctl = st["controller"]
        assert ctl["connected"] is True and 0 <= ctl["lastMessageSecondsAgo"] < 60 and set(ctl["blocks"]) == set(mine)

        # Storage: the volume, its loop device, where it is mounted.
        sto = st["storage"]
        assert [v["id"] for v in sto["volumes"]] == [vid] == n.volume_files()
        v = sto["volumes"][0]
        assert v["name"] == "pvc-status" and v["sizeBytes"] == 64 * MIB and v["fsType"] == "ext4" and v["backingFilePresent"]
        img = n.volume_dir / f"{vid}.img"
        assert [l["device"] for l in v["loopDevices"]] == loops_of(img)
        assert set(v["loopDevices"][0]["mountedAt"]) == {str(staging), str(target)}
        assert {str(staging), str(target)} <= mount_points()
        assert v["staged"] == {"path": str(staging), "state": "staged", "mounted": True}
        assert v["published"] == [{"path": str(target), "readOnly": False, "mounted": True}]

        # Devices, and a device node that goes away turns Unhealthy.
        assert st["devicePlugins"] == [{"resource": resource, "socket": "nodeplane-stdev.sock", "devices": [
            {"id": "stdev0", "health": "Healthy"}, {"id": "stdev1", "health": "Healthy"}]}]
        (dev / "stdev1").unlink()
        wait_for(lambda: {d["id"]: d["health"] for d in n.status("status")[1]["devicePlugins"][0]["devices"]}
                 == {"stdev0": "Healthy", "stdev1": "Unhealthy"}, what="stdev1 unhealthy in the status")

        # The human summary names the same things.
        text = harness.run([str(harness.CLI_BIN), "status", "--config", str(n.cfg_path)]).stdout
        print(text)
        for p in pods:
            assert p.cid[:12] in text and p.ip4() in text
        for needle in (n.ns.name, vid, str(target), resource, "stdev1 Unhealthy", "connected", *mine):
            assert needle in text, f"{needle!r} not in the summary"

        # The controller goes away: the agent says so.
        c.controller.stop()
        wait_for(lambda: n.status("status")[1]["controller"]["connected"] is False, what="controller disconnected")
        assert "NOT CONNECTED" in harness.run([str(harness.CLI_BIN), "status", "--socket", str(n.node_socket)]).stdout
    finally:
        c.close()


def test_doctor_finds_and_repairs_exactly_the_orphans():
    c = cluster.Cluster()
    extra_mount = None
    stray_loop = None
    kubelet_maps = []
    try:
        n = c.node(1, 1, csi={"capacityBytes": 512 * MIB})
        healthy, _ = n.add_pod("dok")
        doomed, _ = n.add_pod("dol")
        vid, staging, target = provision(c, n, "pvc-doctor")
        (target / "data").write_text("still here\n")
        # A raw-block volume in use the way kubelet maps one: staged, published to a file, and
        # kubelet's own bind mount of that device node for the pod (volumeDevices/<pv>/dev/<pod>).
        bid = c.controller.csi("create-volume", "--name", "pvc-doctor-blk", "--size", 16 * MIB, "--fs", "block",
                               "--node", n.ns.name)["volumeId"]
        wait_for(lambda: bid in n.volume_files(), what=f"volume {bid}")
        bstaging = n.staging_path(bid)
        btarget = n.kubelet / f"plugins/kubernetes.io/csi/volumeDevices/publish/{bid}/poduid1"
        btarget.parent.mkdir(parents=True)
        n.csi("stage", "--id", bid, "--staging", bstaging, "--fs", "block")
        n.csi("publish", "--id", bid, "--staging", bstaging, "--target", btarget, "--fs", "block")
        podmap = n.kubelet / f"plugins/kubernetes.io/csi/volumeDevices/{bid}/dev/poduid1"
        podmap.parent.mkdir(parents=True)
        podmap.touch()
        harness.run(["mount", "--bind", str(btarget), str(podmap)])
        kubelet_maps.append(podmap)

        rc, doc = n.status("doctor")
        assert rc == 0 and doc["findings"] == [] and doc["errors"] == [], doc

        # 1. A host veth nobody leased (named like ours).
        stray_veth = "np0123456789abc"
        n.ns.exec(["ip", "link", "add", stray_veth, "type", "veth", "peer", "name", "npt-doc-peer"])
        # 2. A lease whose pod namespace is gone (deleted behind the runtime's back).
        doomed.ns.delete()
        n.pods.remove(doomed)
        doomed_lease = next(name for name, l in n.leases().items() if l["containerId"] == doomed.cid)
        # 3. A second mount of the volume's device that no stage or publish accounts for.
        dev = loops_of(n.volume_dir / f"{vid}.img")[0]
        extra_mount = n.kubelet / "stray-mount"
        extra_mount.mkdir()
        harness.run(["mount", dev, str(extra_mount)])
        # 4. A loop device whose backing file (in the volume dir, no volume's) was deleted.
        stray_img = n.volume_dir / "stray.img"
        with open(stray_img, "wb") as f:
            f.truncate(4 * MIB)
        stray_loop = harness.run(["losetup", "--find", "--show", str(stray_img)]).stdout.strip()
        stray_img.unlink()

        rc, doc = n.status("doctor")
        print(json.dumps(doc, indent=1))
        assert rc == 1, "findings exit 1"
        found = sorted((f["kind"], f["subject"]) for f in doc["findings"])
        assert found == sorted([
            ("veth-without-lease", stray_veth),
            ("lease-without-pod", f"{doomed.cid}/eth0"),
            ("mount-without-volume", str(extra_mount)),
            ("loop-device-without-file", stray_loop),
        ]), found
        assert all("repair" not in f for f in doc["findings"]), "nothing repaired without --repair"
        # Nothing was touched by looking.
        assert stray_veth in n.ns.links() and doomed_lease in n.leases()
        assert str(extra_mount) in mount_points() and os.path.exists(f"/sys/block/{stray_loop[5:]}/loop/backing_file")

        # The human report, and its exit status.
        res = harness.run([str(harness.CLI_BIN), "doctor", "--socket", str(n.node_socket)], check=False)
        assert res.returncode == 1 and "lease-without-pod" in res.stdout and "--repair" in res.stdout, res.stdout

        rc, doc = n.status("doctor", "--repair")
        print(json.dumps(doc, indent=1))
        assert rc == 0, "everything found was repaired"
        assert len(doc["findings"]) == 4 and all(f["repair"]["result"] == "done" for f in doc["findings"]), doc
        # The kernel and the state agree.
        wait_for(lambda: stray_veth not in n.ns.links() and not n.graveyard(),
                 what="the stray veth deleted")
        assert doomed_lease not in n.leases()
        assert {l["containerId"] for l in n.leases().values()} == {healthy.cid}
        assert str(extra_mount) not in mount_points()
        extra_mount = None
        assert not os.path.exists(f"/sys/block/{stray_loop[5:]}/loop/backing_file"), "stray loop device detached"
        stray_loop = None

        # The healthy pod and the published volumes were left alone.
        assert healthy.ns.ping(healthy.result["ips"][0]["gateway"]), "the healthy pod still reaches its gateway"
        assert {str(staging), str(target), str(btarget), str(podmap)} <= mount_points()
        assert (target / "data").read_text() == "still here\n"
        st = n.status("status")[1]
        assert st["storage"]["volumes"][0]["published"][0]["mounted"] is True
        assert [a["containerId"] for a in st["network"]["attachments"]] == [healthy.cid]

        rc, doc = n.status("doctor")
        assert rc == 0 and doc["findings"] == [], doc

        harness.fault_report(
            "doctor-orphans",
            "a veth without a lease, a lease whose pod netns was deleted, a stray mount of a volume's "
            "loop device under the kubelet dir, a loop device whose backing file was deleted",
            "doctor named exactly those 4; --repair removed all 4; the healthy pod and published volume untouched",
            orphans=len(found), repaired=4, left=0,
        )
    finally:
        for m in kubelet_maps:
            harness.run(["umount", str(m)], check=False)
        if extra_mount is not None:
            harness.run(["umount", str(extra_mount)], check=False)
        if stray_loop is not None:
            harness.run(["losetup", "-d", stray_loop], check=False)
        c.close()


def test_status_without_an_agent_fails_clearly(tmp_path):
    res = harness.run([str(harness.CLI_BIN), "status", "--socket", str(tmp_path / "node.sock")], check=False)
    assert res.returncode == 2 and "is the agent running?" in res.stderr, res
    res = harness.run([str(harness.CLI_BIN), "doctor", "--socket", str(tmp_path / "node.sock")], check=False)
    assert res.returncode == 2, res


def json_lines(node):
    out = []
    for line in node.log()[node.log_offset:].splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_json_logs_carry_pod_volume_and_device_fields():
    c = cluster.Cluster()
    try:
        n = c.node(1, 1, start=False, csi={"capacityBytes": 512 * MIB})
        dev = harness.make_devices(n, "jsdev", 1)
        n.agent_args = ["--log-format", "json"]
        n.start()
        pod = harness.Pod(n, "jsp")
        conf = n.netconf()
        rc, res, raw = n.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=conf,
                             env={"CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-7"})
        n.pods.append(pod)
        assert rc == 0, raw
        vid, _, _ = provision(c, n, "pvc-json")
        (dev / "jsdev0").unlink()
        wait_for(lambda: any(l["fields"].get("message") == "device health changed" for l in json_lines(n)),
                 what="a device health event")

        lines = json_lines(n)
        assert lines and all({"timestamp", "level", "fields", "target"} <= set(l) for l in lines)
        attached = [l for l in lines if l["fields"].get("message") == "attached"]
        assert len(attached) == 1, attached
        span = attached[0]["span"]
        assert span["name"] == "cni" and span["command"] == "ADD" and span["container"] == pod.cid
        assert span["pod_namespace"] == "shop" and span["pod"] == "cart-7" and span["ifname"] == "eth0"
        assert attached[0]["fields"]["pod"] == "shop/cart-7"
        # Every CSI event of the stage carries the volume.
        staged = [l for l in lines if l.get("span", {}).get("op") == "NodeStageVolume"]
        assert staged and all(l["span"]["volume"] == vid for l in staged), staged
        health = next(l for l in lines if l["fields"].get("message") == "device health changed")
        assert health["fields"]["resource"] == "nodeplane.dev/jsdev" and health["fields"]["device"].endswith("jsdev0")
    finally:
        c.close()
