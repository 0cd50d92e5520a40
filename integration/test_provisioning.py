"""Volume provisioning through the controller (CSI Controller) onto simulated nodes.

A real `nodeplane-controller` serves CSI Identity + Controller on its CSI socket; real agents
(one per node namespace, controller mode) follow its volume stream and create, grow and
delete backing files in their node-local stores; the node side is each agent's CSI Node
service with real loop devices and mounts. Calls go through the `nodeplane csi` client, as
the provisioner / resizer sidecars and kubelet would make them. Assertions are about files in
the nodes' volume directories, mounts, and what the controller answers.
"""

import json
import os
import threading
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import cluster
import harness
from harness import CsiError

MIB = 1 << 20


class ProvCluster(cluster.Cluster):
    """A cluster whose nodes serve volumes (one underlay segment)."""

    def __init__(self, controller_extra=None):
        extra = {"orphanGraceSeconds": 2, "volumeOpTimeoutSeconds": 20}
        extra.update(controller_extra or {})
        super().__init__(controller_extra=extra)

    def node(self, host, capacity=1024 * MIB):
        return super().node(1, host, csi={"capacityBytes": capacity})

    def files(self):
        """volume id -> node name, from the backing files on every node."""
        out = {}
        for n in self.nodes:
            for v in n.volume_files():
                assert v not in out, f"volume {v} has a backing file on two nodes"
                out[v] = n.ns.name
        return out


@pytest.fixture
def prov():
    made = []

    def make(**kw):
        c = ProvCluster(**kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


wait_until = functools.partial(harness.wait_until, timeout=10.0)


def code_of(fn):
    try:
        fn()
    except CsiError as e:
        return e.code
    return "OK"


def test_topology_requisite_and_preferred(prov):
    c = prov()
    n1, n2, n3 = c.node(11), c.node(12), c.node(13)
    c.wait_connected([n1, n2, n3])
    ctl = c.controller
    v = ctl.csi("create-volume", "--name", "pvc-on-n2", "--size", 64 * MIB, "--node", n2.ns.name)
    assert v["nodes"] == [n2.ns.name]
    assert v["capacityBytes"] == 64 * MIB
    assert n2.volume_files() == [v["volumeId"]]
    v = ctl.csi("create-volume", "--name", "pvc-pref", "--size", 64 * MIB, "--prefer", n3.ns.name, "--prefer", n1.ns.name)
    assert v["nodes"] == [n3.ns.name] and v["volumeId"] in n3.volume_files()
    # Requisite among two, preferring one of them.
    v = ctl.csi("create-volume", "--name", "pvc-req2", "--size", 64 * MIB, "--node", n1.ns.name, "--node", n2.ns.name,
                "--prefer", n1.ns.name)
    assert v["nodes"] == [n1.ns.name]
    # A requisite no node satisfies.
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-nowhere", "--size", MIB, "--node", "no-such-node")) \
        == "ResourceExhausted"
    assert "pvc-nowhere" not in c.files()
    # The node service sees the controller's volume: same topology key.
    info = n2.csi("node-info")
    assert info["topology"] == {"topology.csi.nodeplane.dev/node": n2.ns.name}


def test_capacity_drops_and_frees(prov):
    c = prov()
    n1, n2 = c.node(21, capacity=400 * MIB), c.node(22, capacity=400 * MIB)
    c.wait_connected([n1, n2])
    ctl = c.controller
    cap = lambda n: ctl.csi("capacity", "--node", n.ns.name)["availableCapacity"]
    assert cap(n1) == 400 * MIB and cap(n2) == 400 * MIB
    assert ctl.csi("capacity")["availableCapacity"] == 800 * MIB
    a = ctl.csi("create-volume", "--name", "pvc-a", "--size", 300 * MIB, "--node", n1.ns.name)
    assert cap(n1) == 100 * MIB
    # Without topology, the node with the most free capacity.
    b = ctl.csi("create-volume", "--name", "pvc-b", "--size", 200 * MIB)
    assert b["nodes"] == [n2.ns.name]
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-c", "--size", 150 * MIB, "--node", n1.ns.name)) \
        == "ResourceExhausted"
    # Too big for any node.
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-huge", "--size", 500 * MIB)) == "ResourceExhausted"
    ctl.csi("delete-volume", "--id", a["volumeId"])
    assert a["volumeId"] not in n1.volume_files()
    assert cap(n1) == 400 * MIB
    ctl.csi("create-volume", "--name", "pvc-c", "--size", 150 * MIB, "--node", n1.ns.name)


def test_concurrent_creates_give_one_volume_per_name(prov):
    c = prov()
    nodes = [c.node(31), c.node(32), c.node(33)]
    c.wait_connected(nodes)
    ctl = c.controller
    names = [f"pvc-conc-{i:02d}" for i in range(50)]
    calls = names + names  # every name twice, all at once
    with ThreadPoolExecutor(max_workers=16) as ex:
        results = list(ex.map(lambda n: (n, ctl.csi("create-volume", "--name", n, "--size", 8 * MIB)), calls))
    by_name = {}
    for name, v in results:
        by_name.setdefault(name, set()).add((v["volumeId"], tuple(v["nodes"])))
    assert all(len(s) == 1 for s in by_name.values()), by_name
    ids = {next(iter(s))[0] for s in by_name.values()}
    assert len(ids) == 50
    files = c.files()
    assert set(files) == ids, "backing files and volumes differ"
    for name, s in by_name.items():
        vid, vnodes = next(iter(s))
        assert files[vid] == vnodes[0]
    assert set(ctl.volumes()) == ids


def test_controller_kill9_during_creates_and_deletes(prov):
    c = prov()
    nodes = [c.node(41), c.node(42)]
    c.wait_connected(nodes)
    ctl = c.controller
    names = [f"pvc-crash-{i:02d}" for i in range(30)]
    answered = {}

    def try_create(n):
        try:
            answered[n] = ctl.csi("create-volume", "--name", n, "--size", 4 * MIB)["volumeId"]
        except (CsiError, RuntimeError):
            pass

    for round_ in range(2):
        threads = [threading.Thread(target=try_create, args=(n,)) for n in names]
        for t in threads:
            t.start()
        time.sleep(0.05 + 0.05 * round_)
        ctl.kill9()
        for t in threads:
            t.join()
        ctl.start()
        c.wait_connected(nodes)
    # Retried creates: every name gets its volume, and the same one it got before.
    for n in names:
        vid = ctl.csi("create-volume", "--name", n, "--size", 4 * MIB)["volumeId"]
        assert answered.get(n, vid) == vid, f"{n}: {answered.get(n)} then {vid}"
        answered[n] = vid
    assert set(c.files()) == set(answered.values())
    # Deletes with a kill -9 in the middle.
    doomed = names[:15]

    def try_delete(n):
        try:
            ctl.csi("delete-volume", "--id", answered[n])
        except (CsiError, RuntimeError):
            pass

    threads = [threading.Thread(target=try_delete, args=(n,)) for n in doomed]
    for t in threads:
        t.start()
    time.sleep(0.05)
    ctl.kill9()
    for t in threads:
        t.join()
    ctl.start()
    c.wait_connected(nodes)
    for n in doomed:
        ctl.csi("delete-volume", "--id", answered[n])
    kept = {answered[n] for n in names[15:]}
    assert set(ctl.volumes()) == kept
    assert set(c.files()) == kept, "controller state and backing files disagree"


def test_end_to_end_with_the_node_service(prov):
    c = prov()
    n1, n2 = c.node(51), c.node(52)
    c.wait_connected([n1, n2])
    ctl = c.controller
    for fs in ("xfs", "ext4"):
        v = ctl.csi("create-volume", "--name", f"pvc-e2e-{fs}", "--size", 512 * MIB, "--fs", fs, "--node", n1.ns.name)
        vid = v["volumeId"]
        assert v["volumeContext"]["fsType"] == fs
        staging, target = n1.staging_path(vid), n1.target_path(vid)
        n1.csi("stage", "--id", vid, "--staging", staging, "--fs", fs)
        n1.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", fs)
        (target / "hello").write_text("through the controller")
        before = os.statvfs(target)
        r = ctl.csi("expand-volume", "--id", vid, "--size", 768 * MIB)
        assert r == {"capacityBytes": 768 * MIB, "nodeExpansionRequired": True}
        assert (n1.volume_dir / f"{vid}.img").stat().st_size == 768 * MIB
        try:
            n1.csi("node-expand", "--id", vid, "--path", target, "--size", 768 * MIB)
            online = True
        except CsiError as e:
            # ext4 online growth needs CAP_SYS_RESOURCE (absent here): said so, and the
            # filesystem grows at the next stage.
            assert fs == "ext4" and e.code == "FailedPrecondition" and "CAP_SYS_RESOURCE" in e.message, e
            online = False
        if not online:
            n1.csi("unpublish", "--id", vid, "--target", target)
            n1.csi("unstage", "--id", vid, "--staging", staging)
            n1.csi("stage", "--id", vid, "--staging", staging, "--fs", fs)
            n1.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", fs)
        after = os.statvfs(target)
        grown = (after.f_blocks * after.f_frsize) - (before.f_blocks * before.f_frsize)
        assert grown >= 200 * MIB, f"{fs}: df grew by only {grown} bytes"
        assert (target / "hello").read_text() == "through the controller"
        stats = n1.csi("stats", "--id", vid, "--path", target)
        assert stats["abnormal"] is False
        # Delete while staged: refused, nothing lost.
        assert code_of(lambda: ctl.csi("delete-volume", "--id", vid)) == "FailedPrecondition"
        assert vid in n1.volume_files()
        n1.csi("unpublish", "--id", vid, "--target", target)
        n1.csi("unstage", "--id", vid, "--staging", staging)
        ctl.csi("delete-volume", "--id", vid)
        assert vid not in n1.volume_files()
        assert harness.mounts_under(n1.root) == [] and harness.loops_under(n1.root) == []


def test_offline_node_answers_unavailable(prov):
    c = prov(controller_extra={"capacityGraceSeconds": 600})
    n1 = c.node(61)
    c.wait_connected([n1])
    ctl = c.controller
    vid = ctl.csi("create-volume", "--name", "pvc-off", "--size", 16 * MIB)["volumeId"]
    n1.stop()
    wait_until(lambda: ctl.csi("capacity")["availableCapacity"] == 0, what="node gone from capacity")
    # Within the grace its own capacity is unknown, not 0: the provisioner keeps what it
    # published. So is a node not seen since the controller started.
    assert code_of(lambda: ctl.csi("capacity", "--node", n1.ns.name)) == "Unavailable"
    assert code_of(lambda: ctl.csi("capacity", "--node", "no-such-node")) == "Unavailable"
    assert code_of(lambda: ctl.csi("delete-volume", "--id", vid)) == "Unavailable"
    assert code_of(lambda: ctl.csi("expand-volume", "--id", vid, "--size", 32 * MIB)) == "Unavailable"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-new", "--size", MIB)) == "ResourceExhausted"
    assert vid in n1.volume_files(), "no false success: the file is still there"
    n1.start()
    c.wait_connected([n1])
    ctl.csi("delete-volume", "--id", vid)
    assert vid not in n1.volume_files()


def test_orphans_are_reclaimed_only_under_the_store_that_made_them(prov):
    c = prov()
    n1 = c.node(71)
    c.wait_connected([n1])
    ctl = c.controller
    meta = lambda vid: json.loads((n1.volume_dir / f"{vid}.json").read_text())
    kept = ctl.csi("create-volume", "--name", "pvc-kept", "--size", 4 * MIB)["volumeId"]
    wait_until(lambda: meta(kept).get("controllerStore", "").startswith("redb-"), what="the volume names its store")
    store = meta(kept)["controllerStore"]
    n1.stop()
    n1.volume_dir.mkdir(parents=True, exist_ok=True)

    def plant(vid, **extra):
        (n1.volume_dir / f"{vid}.json").write_text(json.dumps(
            {"version": 1, "id": vid, "sizeBytes": 4 * MIB, "fsType": "ext4", "createdAt": 0, **extra}))
        with open(n1.volume_dir / f"{vid}.img", "wb") as f:
            f.truncate(4 * MIB)

    # Listed once by this controller's store, which no longer lists it: reclaimed.
    plant("pvc-orphan", name="pvc-orphan", controllerStore=store)
    # Listed by another store (one that was lost), from a node older than stores, or made
    # on the node directly: reported, never reclaimed.
    plant("pvc-foreign", name="pvc-foreign", controllerStore="redb-00000000000000ff")
    plant("pvc-unowned", name="pvc-unowned")
    plant("local-scratch")
    n1.start()
    wait_until(lambda: "pvc-orphan" in ctl.log() and "does not know" in ctl.log(), what="orphan reported")
    wait_until(lambda: "pvc-orphan" not in n1.volume_files(), timeout=15, what="orphan reclaimed after the grace period")
    time.sleep(1.5)  # a few reconcile passes past the others' grace too
    assert {"pvc-foreign", "pvc-unowned", "local-scratch", kept} <= set(n1.volume_files())
    for vid in ("pvc-foreign", "pvc-unowned", "local-scratch"):
        assert vid in ctl.log()
    assert "orphan volume kept" in n1.log()

    # The controller's database lost: its new store never knew `kept`, whose claim may
    # still be bound. The volume is reported and stays past the grace period.
    ctl.stop()
    (ctl.root / "data/registry.redb").unlink()
    since = len(ctl.log())
    ctl.start()
    reported = lambda: [l for l in ctl.log()[since:].splitlines() if "does not know" in l and kept in l]
    wait_until(reported, timeout=20, what="the lost store's volume reported")
    time.sleep(3 * 2 + 1.5)  # three grace periods and a few passes
    assert kept in n1.volume_files(), "a volume of a lost store was reclaimed"
    assert meta(kept)["controllerStore"] == store

    # A ready volume that vanished completely (file and metadata) is not re-created empty.
    gone = ctl.csi("create-volume", "--name", "pvc-gone", "--size", 4 * MIB)["volumeId"]
    n1.stop()
    (n1.volume_dir / f"{gone}.img").unlink()
    (n1.volume_dir / f"{gone}.json").unlink()
    n1.start()
    wait_until(lambda: ctl.volumes()[gone].get("abnormal"), timeout=15, what="vanished volume reported")
    time.sleep(1.5)  # a few reconcile passes
    assert gone not in n1.volume_files(), "a vanished volume was re-created empty"
    # A volume whose backing file vanished is reported abnormal.
    vid = ctl.csi("create-volume", "--name", "pvc-lost", "--size", 4 * MIB)["volumeId"]
    (n1.volume_dir / f"{vid}.img").unlink()
    wait_until(lambda: ctl.volumes()[vid].get("abnormal"), timeout=15, what="lost file reported")
    assert "backing file" in ctl.volumes()[vid]["message"]


def test_conformance_controller_rpcs(prov):
    c = prov(controller_extra={"capacityGraceSeconds": 0})
    n1 = c.node(81, capacity=512 * MIB)
    c.wait_connected([n1])
    ctl = c.controller
    ident = ctl.csi("identity")
    assert ident["name"] == "csi.nodeplane.dev" and ident["ready"] is True
    caps = set(ctl.csi("controller-caps")["capabilities"])
    assert {"CREATE_DELETE_VOLUME", "GET_CAPACITY", "EXPAND_VOLUME", "LIST_VOLUMES", "SINGLE_NODE_MULTI_WRITER"} <= caps
    # CreateVolume
    assert code_of(lambda: ctl.csi("create-volume", "--name", "", "--size", MIB)) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "x", "--mode", "MULTI_NODE_MULTI_WRITER")) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "x", "--mode", "UNKNOWN")) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "x", "--fs", "btrfs")) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "x", "--size", 10 * MIB, "--limit", 5 * MIB)) == "OutOfRange"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "x", "--size", MIB + 1, "--limit", MIB + 2)) == "OutOfRange"
    v = ctl.csi("create-volume", "--name", "pvc-conf", "--size", 10 * MIB)
    assert v["capacityBytes"] == 10 * MIB
    assert ctl.csi("create-volume", "--name", "pvc-conf", "--size", 10 * MIB) == v  # idempotent
    assert ctl.csi("create-volume", "--name", "pvc-conf", "--size", 9 * MIB) == v  # compatible: 10 MiB >= 9
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-conf", "--size", 20 * MIB)) == "AlreadyExists"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-conf", "--size", 10 * MIB, "--fs", "xfs")) == "AlreadyExists"
    # The StorageClass parameter selects the filesystem (the capability leaves it open).
    x = ctl.csi("create-volume", "--name", "pvc-param", "--size", 4 * MIB, "--fs", "",
                "--param", "csi.storage.k8s.io/fstype=xfs")
    assert x["volumeContext"]["fsType"] == "xfs"
    assert x["capacityBytes"] == 300 * MIB, "xfs is raised to mkfs.xfs's minimum"
    meta = json.loads((n1.volume_dir / f"{x['volumeId']}.json").read_text())
    assert meta["fsType"] == "xfs"
    ctl.csi("delete-volume", "--id", x["volumeId"])
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-param2", "--fs", "ext4",
                                   "--param", "csi.storage.k8s.io/fstype=xfs")) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-xfs-small", "--size", MIB, "--limit", 200 * MIB,
                                   "--fs", "xfs")) == "OutOfRange"
    blk = ctl.csi("create-volume", "--name", "pvc-blk", "--size", 8 * MIB, "--fs", "block")
    assert blk["volumeContext"]["fsType"] == ""
    # ValidateVolumeCapabilities
    assert ctl.csi("validate", "--id", v["volumeId"], "--fs", "ext4")["confirmed"] is True
    assert ctl.csi("validate", "--id", v["volumeId"], "--fs", "xfs")["confirmed"] is False
    assert ctl.csi("validate", "--id", v["volumeId"], "--mode", "MULTI_NODE_READER_ONLY")["confirmed"] is False
    assert code_of(lambda: ctl.csi("validate", "--id", "pvc-none")) == "NotFound"
    assert code_of(lambda: ctl.csi("validate", "--id", "")) == "InvalidArgument"
    # ListVolumes: pagination covers everything once; a bad token is ABORTED.
    for i in range(5):
        ctl.csi("create-volume", "--name", f"pvc-page-{i}", "--size", MIB)
    seen, token, pages = [], "", 0
    while True:
        page = ctl.csi("list-volumes", "--max", 2, "--token", token)
        assert len(page["entries"]) <= 2
        seen += [e["volumeId"] for e in page["entries"]]
        pages += 1
        token = page["nextToken"]
        if not token:
            break
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 7 and pages == 4
    assert code_of(lambda: ctl.csi("list-volumes", "--token", "garbage")) == "Aborted"
    # GetCapacity
    assert ctl.csi("capacity", "--node", n1.ns.name)["availableCapacity"] == 512 * MIB - 10 * MIB - 8 * MIB - 5 * MIB
    assert ctl.csi("capacity", "--node", "no-such-node")["availableCapacity"] == 0
    # ControllerExpandVolume
    assert code_of(lambda: ctl.csi("expand-volume", "--id", "", "--size", MIB)) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("expand-volume", "--id", "pvc-none", "--size", MIB)) == "NotFound"
    assert code_of(lambda: ctl.csi("expand-volume", "--id", v["volumeId"], "--size", 0)) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("expand-volume", "--id", v["volumeId"], "--size", 1 << 40)) == "OutOfRange"
    r = ctl.csi("expand-volume", "--id", v["volumeId"], "--size", 5 * MIB)  # smaller: nothing to do
    assert r["capacityBytes"] == 10 * MIB
    r = ctl.csi("expand-volume", "--id", blk["volumeId"], "--size", 16 * MIB)
    assert r == {"capacityBytes": 16 * MIB, "nodeExpansionRequired": False}
    # DeleteVolume
    assert code_of(lambda: ctl.csi("delete-volume", "--id", "")) == "InvalidArgument"
    ctl.csi("delete-volume", "--id", "pvc-none")  # unknown: OK
    ctl.csi("delete-volume", "--id", v["volumeId"])
    ctl.csi("delete-volume", "--id", v["volumeId"])  # again: OK
    assert v["volumeId"] not in n1.volume_files()
