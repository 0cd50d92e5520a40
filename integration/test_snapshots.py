"""CSI snapshots and clones through the controller onto simulated nodes, with real loop
devices, mounts and filesystems.

A snapshot is taken by the node that holds the volume (through the controller's desired
state), as a reflink when the store's filesystem shares extents (an xfs made with
reflink=1 on a loop device here) or as a sparse copy (the ext4 under /tmp), with the
volume's filesystem frozen while it is mounted. Assertions are about bytes in images and
files in mounted volumes, fsck of copies taken under write traffic, and what is left in the
node's store after crashes at every step.
"""

import contextlib
import hashlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import harness
from harness import CsiError
from test_provisioning import MIB, code_of, prov  # noqa: F401 (prov is the clusters fixture)


def run(cmd, check=True, **kw):
    return subprocess.run([str(c) for c in cmd], check=check, capture_output=True, text=True, **kw)


@contextlib.contextmanager
def xfs_reflink_store(c, node):
    """Mount an xfs made with reflink=1 (on a loop device over a sparse file of the cluster's
    dir) at `node`'s volume directory; undone in order at the end: the node's volume loop
    devices, the mount, the loop device."""
    img = c.root / f"store-{node.ns.name}.xfs"
    with open(img, "wb") as f:
        f.truncate(4 << 30)
    dev = run(["losetup", "--find", "--show", img]).stdout.strip()
    try:
        run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", dev])
        node.volume_dir.mkdir(parents=True, exist_ok=True)
        run(["mount", dev, node.volume_dir])
        try:
            yield
        finally:
            node.stop()
            harness.release_storage_under(node.kubelet)
            for d in harness.loops_under(node.volume_dir):
                run(["losetup", "-d", d], check=False)
            run(["umount", node.volume_dir], check=False)
    finally:
        run(["losetup", "-d", dev], check=False)
        img.unlink(missing_ok=True)


def start_node(c, host, store):
    """A node whose store is `store` ("ext4-dir": a plain directory under /tmp, which is
    ext4 here; "xfs-reflink": an xfs with reflink on a loop device)."""
    n = harness_node(c, host)
    stack = contextlib.ExitStack()
    if store == "xfs-reflink":
        stack.enter_context(xfs_reflink_store(c, n))
    n.start()
    return n, stack


def harness_node(c, host, capacity=3 << 30):
    import cluster
    return cluster.Cluster.node(c, 1, host, start=False, csi={"capacityBytes": capacity})


def digest(path, length):
    """SHA-256 of the first `length` bytes of `path`."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = length
        while left:
            b = f.read(min(left, 8 << 20))
            if not b:
                break
            h.update(b)
            left -= len(b)
    return h.hexdigest()


def zeros_after(path, start):
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            b = f.read(8 << 20)
            if not b:
                return True
            if b.count(0) != len(b):
                return False


def snapshot_meta(node, sid):
    return json.loads((node.volume_dir / "snapshots" / f"{sid}.json").read_text())


def wait_ready(ctl, name, vol, timeout=30):
    """Call CreateSnapshot again until ready_to_use, as csi-snapshotter does."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = ctl.csi("create-snapshot", "--name", name, "--volume", vol)
            if last["readyToUse"]:
                return last
        except CsiError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"snapshot {name} not ready: {last}")


def mount_volume(node, vid, fs="ext4", pod="pod1"):
    staging, target = node.staging_path(vid), node.target_path(vid, pod)
    node.csi("stage", "--id", vid, "--staging", staging, "--fs", fs)
    node.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", fs)
    return target


def unmount_volume(node, vid, pod="pod1"):
    node.csi("unpublish", "--id", vid, "--target", node.target_path(vid, pod))
    node.csi("unstage", "--id", vid, "--staging", node.staging_path(vid))


def write_file(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def leftovers(node):
    """Temporary files in the node's store (a copy or delete that did not finish)."""
    out = [p.name for p in node.volume_dir.glob(".*.img.*")]
    return out + [p.name for p in (node.volume_dir / "snapshots").glob(".*")]


def tmp_reflinks():
    """Whether the filesystem under /tmp shares extents (then the plain store reflinks too)."""
    return run(["stat", "-f", "-c", "%T", "/tmp"]).stdout.strip() in ("xfs", "btrfs")


@pytest.mark.parametrize("store,fs", [("ext4-dir", "ext4"), ("xfs-reflink", "xfs")])
def test_snapshot_restore_and_clone_are_point_in_time_copies(prov, store, fs):
    """On the xfs store the volumes are xfs too: copies carry their source's filesystem UUID,
    so this also proves a restore and a clone mount next to their mounted source."""
    c = prov()
    n, stack = start_node(c, 61, store)
    with stack:
        c.wait_connected([n])
        ctl = c.controller
        vid = ctl.csi("create-volume", "--name", "pvc-src", "--size", 512 * MIB, "--fs", fs)["volumeId"]
        target = mount_volume(n, vid, fs)
        v1 = os.urandom(3 * MIB)
        write_file(target / "data", v1)
        write_file(target / "kept", b"before the snapshot")
        snap = wait_ready(ctl, "snap-1", vid)
        sid = snap["snapshotId"]
        assert (snap["sourceVolumeId"], snap["sizeBytes"]) == (vid, 512 * MIB)
        meta = snapshot_meta(n, sid)
        want = "reflink" if store == "xfs-reflink" or tmp_reflinks() else "sparse-copy"
        assert meta["method"] == want, meta
        if want == "sparse-copy":
            # Only the allocated ranges were copied: the data and the filesystem's metadata.
            assert 3 * MIB <= meta["bytesCopied"] < 128 * MIB, meta
        snap_img = n.volume_dir / "snapshots" / f"{sid}.img"
        snap_digest = digest(snap_img, 512 * MIB)
        # The source moves on.
        v2 = os.urandom(3 * MIB)
        write_file(target / "data", v2)
        write_file(target / "new", b"after the snapshot")

        # Restore into a bigger volume: the image is the snapshot's bytes, then zeros.
        r = ctl.csi("create-volume", "--name", "pvc-restored", "--size", 768 * MIB, "--fs", fs, "--from-snapshot", sid)
        rid = r["volumeId"]
        assert r["contentSource"] == {"snapshot": sid} and r["nodes"] == [n.ns.name] and r["capacityBytes"] == 768 * MIB
        rimg = n.volume_dir / f"{rid}.img"
        assert rimg.stat().st_size == 768 * MIB
        assert digest(rimg, 512 * MIB) == snap_digest
        assert zeros_after(rimg, 512 * MIB)
        rt = mount_volume(n, rid, fs, pod="pod2")
        assert (rt / "data").read_bytes() == v1 and (rt / "kept").read_bytes() == b"before the snapshot"
        assert not (rt / "new").exists()
        st = os.statvfs(rt)
        assert st.f_blocks * st.f_frsize > 700 * MIB, "the restored filesystem grew to the volume"
        assert (target / "data").read_bytes() == v2, "the source keeps its new data"

        # A clone of the published (mounted, written) source: its data as of now.
        cl = ctl.csi("create-volume", "--name", "pvc-clone", "--size", 512 * MIB, "--fs", fs, "--from-volume", vid)
        assert cl["contentSource"] == {"volume": vid}
        ct = mount_volume(n, cl["volumeId"], fs, pod="pod3")
        assert (ct / "data").read_bytes() == v2 and (ct / "new").read_bytes() == b"after the snapshot"
        write_file(ct / "data", b"the clone is its own")
        assert (target / "data").read_bytes() == v2

        # The snapshot outlives its source.
        unmount_volume(n, vid)
        ctl.csi("delete-volume", "--id", vid)
        assert vid not in n.volume_files()
        r2 = ctl.csi("create-volume", "--name", "pvc-restored-2", "--fs", fs, "--from-snapshot", sid)
        assert r2["capacityBytes"] == 512 * MIB, "no size asked: the snapshot's"
        rt2 = mount_volume(n, r2["volumeId"], fs, pod="pod4")
        assert (rt2 / "data").read_bytes() == v1

        for v, pod in ((rid, "pod2"), (cl["volumeId"], "pod3"), (r2["volumeId"], "pod4")):
            unmount_volume(n, v, pod=pod)
            ctl.csi("delete-volume", "--id", v)
        ctl.csi("delete-snapshot", "--id", sid)
        ctl.csi("delete-snapshot", "--id", sid)  # idempotent
        assert not snap_img.exists()
        assert ctl.csi("list-snapshots")["entries"] == []
        assert n.volume_files() == [] and leftovers(n) == []
        assert harness.mounts_under(n.kubelet) == []


def test_snapshots_under_write_traffic_are_consistent(prov):
    c = prov()
    n = c.node(62, capacity=3 << 30)
    c.wait_connected([n])
    ctl = c.controller
    vid = ctl.csi("create-volume", "--name", "pvc-busy", "--size", 512 * MIB, "--fs", "ext4")["volumeId"]
    target = mount_volume(n, vid)
    stop = threading.Event()
    written = [0]

    def writer():
        i = 0
        while not stop.is_set():
            p = target / f"f{i % 200}"
            with open(p, "wb") as f:
                f.write(os.urandom(64 * 1024))
                if i % 3 == 0:
                    os.fsync(f.fileno())
            if i % 50 == 0:
                (target / f"f{(i + 100) % 200}").unlink(missing_ok=True)
            i += 1
            written[0] = i

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        sids = []
        for k in range(3):
            time.sleep(0.3)
            sids.append(wait_ready(ctl, f"snap-busy-{k}", vid)["snapshotId"])
        assert t.is_alive(), "the writer survived the freezes"
        assert n.log().count("filesystem frozen for a copy") >= 3, "each snapshot of the mounted volume froze it"
        before = written[0]
        time.sleep(0.3)
        assert written[0] > before, "writes go on after the snapshots (the filesystem was thawed)"
    finally:
        stop.set()
        t.join(10)
    for sid in sids:
        img = n.volume_dir / "snapshots" / f"{sid}.img"
        res = run(["e2fsck", "-f", "-n", img], check=False)
        assert res.returncode == 0, f"snapshot {sid} taken under writes is not a clean filesystem: {res.stdout}{res.stderr}"
    unmount_volume(n, vid)
    for sid in sids:
        ctl.csi("delete-snapshot", "--id", sid)
    ctl.csi("delete-volume", "--id", vid)
    assert leftovers(n) == [] and list((n.volume_dir / "snapshots").iterdir()) == []


def test_snapshot_rpcs_answer_every_error_and_are_idempotent(prov):
    c = prov()
    n1, n2 = c.node(63), c.node(64)
    c.wait_connected([n1, n2])
    ctl = c.controller
    caps = ctl.csi("controller-caps")
    for cap in ("CREATE_DELETE_SNAPSHOT", "LIST_SNAPSHOTS", "CLONE_VOLUME", "GET_SNAPSHOT"):
        assert cap in json.dumps(caps), caps
    vid = ctl.csi("create-volume", "--name", "pvc-e", "--size", 64 * MIB, "--fs", "ext4", "--node", n1.ns.name)["volumeId"]
    other = ctl.csi("create-volume", "--name", "pvc-f", "--size", 64 * MIB, "--fs", "ext4", "--node", n1.ns.name)["volumeId"]
    free_before = ctl.csi("capacity", "--node", n1.ns.name)["availableCapacity"]
    # CreateSnapshot: required fields, unknown source, idempotency by name.
    assert code_of(lambda: ctl.csi("create-snapshot", "--name", "", "--volume", vid)) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("create-snapshot", "--name", "s", "--volume", "")) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("create-snapshot", "--name", "s", "--volume", "pvc-none")) == "NotFound"
    s1 = wait_ready(ctl, "snap-a", vid)
    again = ctl.csi("create-snapshot", "--name", "snap-a", "--volume", vid)
    assert again == s1, "same name and source: the same snapshot"
    assert code_of(lambda: ctl.csi("create-snapshot", "--name", "snap-a", "--volume", other)) == "AlreadyExists"
    assert ctl.csi("capacity", "--node", n1.ns.name)["availableCapacity"] == free_before - 64 * MIB, "snapshots count"
    s2 = wait_ready(ctl, "snap-b", other)
    # ListSnapshots: filters, paging, tokens.
    ids = sorted([s1["snapshotId"], s2["snapshotId"]])
    assert sorted(e["snapshotId"] for e in ctl.csi("list-snapshots")["entries"]) == ids
    assert [e["snapshotId"] for e in ctl.csi("list-snapshots", "--volume", vid)["entries"]] == [s1["snapshotId"]]
    assert [e["snapshotId"] for e in ctl.csi("list-snapshots", "--id", s2["snapshotId"])["entries"]] == [s2["snapshotId"]]
    assert ctl.csi("list-snapshots", "--id", "snap-none")["entries"] == []
    assert ctl.csi("list-snapshots", "--volume", "pvc-none")["entries"] == []
    p1 = ctl.csi("list-snapshots", "--max", "1")
    assert [e["snapshotId"] for e in p1["entries"]] == ids[:1] and p1["nextToken"]
    p2 = ctl.csi("list-snapshots", "--max", "1", "--token", p1["nextToken"])
    assert [e["snapshotId"] for e in p2["entries"]] == ids[1:] and p2["nextToken"] == ""
    assert code_of(lambda: ctl.csi("list-snapshots", "--token", "garbage")) == "Aborted"
    assert code_of(lambda: ctl.csi("list-snapshots", "--max=-1")) == "InvalidArgument"
    assert all(e["readyToUse"] for e in ctl.csi("list-snapshots")["entries"])
    # Snapshots are not volumes.
    assert set(ctl.volumes()) == {vid, other}
    assert code_of(lambda: ctl.csi("delete-volume", "--id", s1["snapshotId"])) == "OK"
    assert (n1.volume_dir / "snapshots" / f"{s1['snapshotId']}.img").exists(), "DeleteVolume of a snapshot id deletes nothing"
    # CreateVolume from a source: NOT_FOUND first, then topology, size, filesystem.
    mk = lambda *a: ctl.csi("create-volume", "--name", "pvc-x", "--size", 64 * MIB, *a)
    assert code_of(lambda: mk("--fs", "ext4", "--from-snapshot", "snap-none")) == "NotFound"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-x", "--size", 64 * MIB, "--limit", 32 * MIB, "--fs", "ext4",
                                   "--from-snapshot", "snap-none")) == "NotFound", "NOT_FOUND before argument checks"
    assert code_of(lambda: mk("--fs", "block", "--from-volume", "pvc-none")) == "NotFound", "NOT_FOUND before argument checks"
    assert code_of(lambda: mk("--fs", "ext4", "--from-volume", "pvc-none")) == "NotFound"
    e = None
    try:
        mk("--fs", "ext4", "--from-snapshot", s1["snapshotId"], "--node", n2.ns.name)
    except CsiError as err:
        e = err
    assert e is not None and e.code == "ResourceExhausted" and n1.ns.name in e.message, e
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-x", "--size", 32 * MIB, "--limit", 32 * MIB,
                                   "--fs", "ext4", "--from-snapshot", s1["snapshotId"])) == "OutOfRange"
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-x", "--size", 0, "--limit", 32 * MIB,
                                   "--fs", "ext4", "--from-snapshot", s1["snapshotId"])) == "OutOfRange", "a limit below the source"
    assert code_of(lambda: mk("--fs", "xfs", "--from-snapshot", s1["snapshotId"])) == "InvalidArgument"
    assert code_of(lambda: mk("--fs", "block", "--from-snapshot", s1["snapshotId"])) == "InvalidArgument"
    # Same name, other source: ALREADY_EXISTS; same request: the same volume.
    r = mk("--fs", "ext4", "--from-snapshot", s1["snapshotId"])
    assert mk("--fs", "ext4", "--from-snapshot", s1["snapshotId"]) == r
    assert code_of(lambda: mk("--fs", "ext4", "--from-snapshot", s2["snapshotId"])) == "AlreadyExists"
    assert code_of(lambda: mk("--fs", "ext4")) == "AlreadyExists"
    # Controller precedence: an unknown volume is NOT_FOUND before argument checks.
    assert code_of(lambda: ctl.csi("expand-volume", "--id", "pvc-none", "--size", "0")) == "NotFound"
    assert code_of(lambda: ctl.csi("expand-volume", "--id", "", "--size", "1")) == "InvalidArgument"
    assert code_of(lambda: ctl.csi("validate", "--id", "pvc-none", "--fs", "btrfs")) == "NotFound"
    # DeleteSnapshot: required id, unknown is success.
    assert code_of(lambda: ctl.csi("delete-snapshot", "--id", "")) == "InvalidArgument"
    assert ctl.csi("delete-snapshot", "--id", "snap-none") == {}
    for s in (s1, s2):
        ctl.csi("delete-snapshot", "--id", s["snapshotId"])
    for v in (vid, other, r["volumeId"]):
        ctl.csi("delete-volume", "--id", v)
    assert ctl.csi("capacity", "--node", n1.ns.name)["availableCapacity"] == free_before + 128 * MIB
    assert list((n1.volume_dir / "snapshots").iterdir()) == [] and n1.volume_files() == []


@contextlib.contextmanager
def crashing_at(point):
    os.environ["NODEPLANE_CRASH_AT"] = point
    try:
        yield
    finally:
        os.environ.pop("NODEPLANE_CRASH_AT", None)


def wait_exit(node, timeout=20):
    deadline = time.time() + timeout
    while node.proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert node.proc.poll() is not None, "the agent did not reach its crash point"
    assert "crashing at" in node.log()


def writable_within(path, timeout):
    """Whether a write to `path` completes within `timeout` (a frozen filesystem blocks it)."""
    done = threading.Event()

    def w():
        write_file(path, b"thawed")
        done.set()

    threading.Thread(target=w, daemon=True).start()
    return done.wait(timeout)


@pytest.mark.parametrize("point", ["copy-while-frozen", "snapshot-after-copy", "snapshot-after-meta"])
def test_agent_crash_inside_a_snapshot_never_shows_it_half_made(prov, point):
    c = prov()
    n = c.node(65, capacity=2 << 30)
    c.wait_connected([n])
    ctl = c.controller
    vid = ctl.csi("create-volume", "--name", "pvc-c", "--size", 256 * MIB, "--fs", "ext4")["volumeId"]
    target = mount_volume(n, vid)
    write_file(target / "data", b"x" * MIB)
    n.stop()
    with crashing_at(point):
        n.start()
    c.wait_connected([n])
    # Not cut: an error, never a response (which would say it is cut).
    with pytest.raises(CsiError) as e:
        ctl.csi("create-snapshot", "--name", "snap-c", "--volume", vid)
    assert e.value.code in ("Unavailable", "DeadlineExceeded"), e.value
    wait_exit(n)
    # Never ready while the node has not finished it.
    entries = ctl.csi("list-snapshots")["entries"]
    assert len(entries) == 1 and not entries[0]["readyToUse"], entries
    if point == "copy-while-frozen":
        assert not writable_within(target / "blocked", 1), "the crash left the filesystem frozen (the freeze was real)"
    n.proc = None
    n.start()
    c.wait_connected([n])
    assert writable_within(target / "after", 10), "the filesystem stayed frozen after the restart"
    snap = wait_ready(ctl, "snap-c", vid)
    assert leftovers(n) == []
    assert len(list((n.volume_dir / "snapshots").glob("*.img"))) == 1
    r = ctl.csi("create-volume", "--name", "pvc-c2", "--fs", "ext4", "--from-snapshot", snap["snapshotId"])
    rt = mount_volume(n, r["volumeId"], pod="pod2")
    assert (rt / "data").read_bytes() == b"x" * MIB
    unmount_volume(n, r["volumeId"], pod="pod2")
    unmount_volume(n, vid)
    for v in (r["volumeId"], vid):
        ctl.csi("delete-volume", "--id", v)
    ctl.csi("delete-snapshot", "--id", snap["snapshotId"])
    assert leftovers(n) == [] and n.volume_files() == [] and list((n.volume_dir / "snapshots").iterdir()) == []


def test_agent_crash_inside_a_restore_and_controller_kill9_leave_no_orphan(prov):
    c = prov()
    n = c.node(66, capacity=2 << 30)
    c.wait_connected([n])
    ctl = c.controller
    vid = ctl.csi("create-volume", "--name", "pvc-r", "--size", 128 * MIB, "--fs", "ext4")["volumeId"]
    target = mount_volume(n, vid)
    write_file(target / "data", b"restore me")
    unmount_volume(n, vid)
    sid = wait_ready(ctl, "snap-r", vid)["snapshotId"]
    n.stop()
    with crashing_at("restore-after-copy"):
        n.start()
    c.wait_connected([n])
    assert code_of(lambda: ctl.csi("create-volume", "--name", "pvc-r2", "--fs", "ext4", "--from-snapshot", sid)) in (
        "Unavailable", "DeadlineExceeded")
    wait_exit(n)
    n.proc = None
    n.start()
    c.wait_connected([n])
    # Retried like the provisioner does.
    deadline = time.time() + 30
    while True:
        try:
            r = ctl.csi("create-volume", "--name", "pvc-r2", "--fs", "ext4", "--from-snapshot", sid)
            break
        except CsiError as e:
            assert time.time() < deadline, e
            time.sleep(0.2)
    assert leftovers(n) == []
    # The controller killed while a snapshot is asked for: the record it committed is
    # finished after the restart, and a retry finds the same snapshot.
    t = threading.Thread(target=lambda: code_of(lambda: ctl.csi("create-snapshot", "--name", "snap-k", "--volume", vid)))
    t.start()
    time.sleep(0.05)
    ctl.kill9()
    t.join(30)
    ctl.start()
    c.wait_connected([n], timeout=20)
    sk = wait_ready(ctl, "snap-k", vid)
    assert sorted(e["snapshotId"] for e in ctl.csi("list-snapshots")["entries"]) == sorted([sid, sk["snapshotId"]])
    rt = mount_volume(n, r["volumeId"], pod="pod2")
    assert (rt / "data").read_bytes() == b"restore me"
    unmount_volume(n, r["volumeId"], pod="pod2")
    for s in (sid, sk["snapshotId"]):
        ctl.csi("delete-snapshot", "--id", s)
    for v in (vid, r["volumeId"]):
        ctl.csi("delete-volume", "--id", v)
    # Nothing left once the grace period (2 s here) has passed.
    time.sleep(3)
    assert leftovers(n) == [] and n.volume_files() == [] and list((n.volume_dir / "snapshots").iterdir()) == []


@pytest.mark.parametrize("store", ["ext4-dir", "xfs-reflink"])
def test_raw_block_volume_in_use_is_copied_only_by_reflink(prov, store):
    """A published raw block volume cannot be frozen: only a reflink (atomic against the
    image) is a point-in-time copy of it; elsewhere the snapshot is refused until it is
    unpublished, and nothing is left behind."""
    c = prov()
    n, stack = start_node(c, 67, store)
    with stack:
        c.wait_connected([n])
        ctl = c.controller
        vid = ctl.csi("create-volume", "--name", "pvc-blk", "--size", 64 * MIB, "--fs", "block")["volumeId"]
        staging, target = n.staging_path(vid), n.target_path(vid)
        n.csi("stage", "--id", vid, "--staging", staging, "--fs", "block")
        target.parent.mkdir(parents=True, exist_ok=True)
        n.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", "block")
        with open(target, "r+b") as f:
            f.write(b"raw bytes")
            f.flush()
            os.fsync(f.fileno())
        reflinks = store == "xfs-reflink" or tmp_reflinks()
        if reflinks:
            sid = wait_ready(ctl, "snap-blk", vid)["snapshotId"]
            assert snapshot_meta(n, sid)["method"] == "reflink"
            with open(n.volume_dir / "snapshots" / f"{sid}.img", "rb") as f:
                assert f.read(9) == b"raw bytes"
        else:
            e = None
            try:
                ctl.csi("create-snapshot", "--name", "snap-blk", "--volume", vid)
            except CsiError as err:
                e = err
            assert e is not None and e.code == "FailedPrecondition" and "reflink" in e.message, e
            assert ctl.csi("list-snapshots")["entries"] == [], "the refused snapshot's record is gone"
            n.csi("unpublish", "--id", vid, "--target", target)
            n.csi("unstage", "--id", vid, "--staging", staging)
            sid = wait_ready(ctl, "snap-blk", vid)["snapshotId"]
            n.csi("stage", "--id", vid, "--staging", staging, "--fs", "block")
            n.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", "block")
        n.csi("unpublish", "--id", vid, "--target", target)
        n.csi("unstage", "--id", vid, "--staging", staging)
        ctl.csi("delete-snapshot", "--id", sid)
        ctl.csi("delete-volume", "--id", vid)
        assert leftovers(n) == [] and n.volume_files() == []
