"""Fault suite, storage part (issue #8): volumes survive crashes and a full disk.

Three cases, each on a local cluster (a real controller and real agents in node namespaces,
CSI on), each reporting through `harness.fault_report`:

1. The controller is `kill -9`ed at random points while CreateVolume, DeleteVolume and
   ControllerExpandVolume run concurrently, every call retried with the same arguments until
   it succeeds (as external-provisioner and external-resizer do). Afterwards the controller's
   volumes and the nodes' backing files agree exactly, and every volume still stages.
2. The agent dies inside NodeStage / NodePublish / NodeExpand (and the unpublish / unstage
   that follow): at every `NODEPLANE_CRASH_AT` point of src/storage/csi/node/ (stage.rs, publish.rs) and by `kill -9` at
   random moments. kubelet's retry of the same call must reach a consistent end state. A
   second test interrupts a stage whose loop device is held by someone else while the agent
   recovers, then unstages (the pod went away): no loop device may stay attached.
3. The agent's state dir fills up (a 2 MiB tmpfs mounted on it, filled): CNI ADD and
   NodeStage fail with clear errors and leave nothing behind, the state written before stays
   intact, and everything works again once space returns.

Every check reads kernel state (/proc/self/mountinfo, /sys/block/loop*, file sizes, the
filesystem's own superblock, links in the node namespace) or the files the agent keeps.
"""

import json
import os
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import cluster
import harness
from harness import CsiError, run
from test_provisioning import MIB, prov  # noqa: F401 (the fixture: controller + nodes with CSI, closed after the test)




# ----- kernel state -----

def mount_entries(root):
    """Mounts at or below `root` from /proc/self/mountinfo: mount point -> fields."""
    root = str(root)
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, post = line.rstrip("\n").split(" - ", 1)
            p = pre.split(" ")
            mp = p[4].replace("\\040", " ")
            if mp == root or mp.startswith(root + "/"):
                fstype, source = post.split(" ")[:2]
                out[mp] = {"majmin": p[2], "root": p[3], "opts": p[5], "fstype": fstype, "source": source}
    return out


def loop_info(dev):
    """/dev/loopN -> (backing file, major:minor, read-only) from sysfs."""
    sys_dir = Path("/sys/block") / Path(dev).name
    backing = (sys_dir / "loop/backing_file").read_text().strip().removesuffix(" (deleted)")
    return backing, (sys_dir / "dev").read_text().strip(), (sys_dir / "ro").read_text().strip() == "1"


def loops_of(img):
    """Loop devices whose backing file is `img`: [(dev, majmin, ro)]."""
    out = []
    for dev in harness.loops_under(Path(img).parent):
        try:
            backing, majmin, ro = loop_info(dev)
        except OSError:
            continue
        if backing == str(img):
            out.append((dev, majmin, ro))
    return sorted(out)


def ext4_size(dev):
    """Bytes the ext4 filesystem on `dev` spans, from its superblock."""
    out = run(["dumpe2fs", "-h", str(dev)]).stdout
    count = int(re.search(r"^Block count:\s+(\d+)", out, re.M).group(1))
    size = int(re.search(r"^Block size:\s+(\d+)", out, re.M).group(1))
    return count * size


def xfs_size(mountpoint):
    """Bytes the xfs data section spans, from `xfs_info` of a mounted filesystem."""
    out = run(["xfs_info", str(mountpoint)]).stdout
    m = re.search(r"^data\s+=\s+bsize=(\d+)\s+blocks=(\d+)", out, re.M)
    return int(m.group(1)) * int(m.group(2))


def record_files(node):
    """Files in the agent's CSI record dirs (stage and publish), partial ones included."""
    out = []
    for d in ("stage", "publish"):
        p = node.root / "var/lib/nodeplane/csi" / d
        out += [f"{d}/{f}" for f in os.listdir(p)] if p.exists() else []
    return sorted(out)


def assert_in_use(node, vid, staging, targets, block=False, ro_targets=()):
    """Exactly the expected mounts under the kubelet dir, on the right loop device, and one
    read-write loop device for the volume (plus one read-only one for read-only block
    publications, per the README)."""
    img = str(node.volume_dir / f"{vid}.img")
    loops = loops_of(img)
    rw = [l for l in loops if not l[2]]
    ro = [l for l in loops if l[2]]
    assert len(rw) == 1, f"{vid}: read-write loop devices {rw} (all: {loops})"
    assert len(ro) == (1 if block and ro_targets else 0), f"{vid}: read-only loop devices {ro}"
    mounts = mount_entries(node.kubelet)
    want = set(map(str, targets)) | ({str(staging)} if not block else set())
    assert set(mounts) == want, f"{vid}: mounts {sorted(mounts)}, expected {sorted(want)}"
    for mp, m in mounts.items():
        if block:
            dev = ro[0] if mp in map(str, ro_targets) else rw[0]
            assert m["fstype"] == "devtmpfs" and m["root"] == "/" + Path(dev[0]).name, f"{mp}: {m}, expected {dev}"
        else:
            assert m["majmin"] == rw[0][1] and m["source"] == rw[0][0], f"{mp}: {m}, expected {rw[0]}"
        assert m["opts"].split(",")[0] == ("ro" if mp in map(str, ro_targets) else "rw"), f"{mp}: {m}"
    return rw[0][0]


def leaks(node):
    """Mounts and loop devices left under the node's dirs, and CSI records left."""
    return {"mounts": harness.mounts_under(node.kubelet), "loops": harness.loops_under(node.root),
            "records": record_files(node)}


NO_LEAKS = {"mounts": [], "loops": [], "records": []}


class Retrier:
    """Calls retried until they succeed with the same arguments, as the CSI sidecars and
    kubelet do; counts attempts and the error codes seen."""

    def __init__(self, deadline_s=60.0, pause=0.05):
        self.pause = pause
        self.lock = threading.Lock()
        self.calls = 0
        self.attempts = 0
        self.in_flight = 0
        self.codes = Counter()
        self.samples = {}  # code -> (call, first message)
        self.deadline_s = deadline_s

    def call(self, fn, what, pause=None):
        deadline = time.time() + self.deadline_s
        with self.lock:
            self.calls += 1
        while True:
            with self.lock:
                self.attempts += 1
                self.in_flight += 1
            try:
                return fn()
            except (CsiError, RuntimeError) as e:
                code = e.code if isinstance(e, CsiError) else "exit"
                with self.lock:
                    self.codes[code] += 1
                    self.samples.setdefault(code, (what, str(e)[:300]))
                if time.time() > deadline:
                    raise AssertionError(f"{what}: still failing after {self.deadline_s}s: {e}")
            finally:
                with self.lock:
                    self.in_flight -= 1
            time.sleep(self.pause if pause is None else pause)


# ----- case 1: controller kill -9 during creates, deletes and expansions -----

def test_controller_kill9_during_creates_deletes_and_expansions(prov):
    t0 = time.time()
    rng = random.Random()
    c = prov(controller_extra={"orphanGraceSeconds": 1, "volumeOpTimeoutSeconds": 10})
    nodes = [c.node(41, capacity=4096 * MIB), c.node(42, capacity=4096 * MIB)]
    by_name = {n.ns.name: n for n in nodes}
    c.wait_connected(nodes)
    ctl = c.controller

    # Before the faults: volumes holding data (some to be expanded), and volumes to delete.
    keep, doomed, data = [], [], {}
    pre = Retrier(deadline_s=20)  # kubelet retries an unstage that finds the device still busy
    for i in range(6):
        n = nodes[i % 2]
        vid = ctl.csi("create-volume", "--name", f"pvc-fk-keep-{i}", "--size", 16 * MIB,
                      "--node", n.ns.name)["volumeId"]
        st, tg = n.staging_path(vid), n.target_path(vid)
        n.csi("stage", "--id", vid, "--staging", st)
        n.csi("publish", "--id", vid, "--staging", st, "--target", tg)
        data[vid] = os.urandom(256 * 1024)
        (tg / "data").write_bytes(data[vid])
        pre.call(lambda: n.csi("unpublish", "--id", vid, "--target", tg), f"unpublish {vid}")
        pre.call(lambda: n.csi("unstage", "--id", vid, "--staging", st), f"unstage {vid}")
        keep.append(vid)
    for i in range(8):
        doomed.append(ctl.csi("create-volume", "--name", f"pvc-fk-del-{i}", "--size", 4 * MIB)["volumeId"])
    assert set(c.files()) == set(keep) | set(doomed)

    new_names = [f"pvc-fk-new-{i:02d}" for i in range(16)]
    # (volume, bytes) per round; keep[0] is expanded twice.
    expansions = [[(keep[0], 40 * MIB)], [(keep[1], 40 * MIB)], [(keep[2], 48 * MIB)], [(keep[0], 56 * MIB)]]
    r = Retrier()
    answers = {}  # name -> every volume id a successful CreateVolume answered
    alock = threading.Lock()
    kills, in_flight_at_kill = 0, []

    def create(name):
        v = r.call(lambda: ctl.csi("create-volume", "--name", name, "--size", 4 * MIB), f"create {name}")
        with alock:
            answers.setdefault(name, []).append(v["volumeId"])

    def delete(vid):
        assert r.call(lambda: ctl.csi("delete-volume", "--id", vid), f"delete {vid}") == {}

    def expand(vid, size, pause=None):
        got = r.call(lambda: ctl.csi("expand-volume", "--id", vid, "--size", size), f"expand {vid}", pause)
        assert got["capacityBytes"] == size, got

    def kill_restart():
        nonlocal kills
        in_flight_at_kill.append(r.in_flight)
        ctl.kill9()
        kills += 1
        time.sleep(rng.uniform(0.0, 0.2))
        ctl.start()

    for rnd in range(4):
        ops = [(create, (n,)) for n in new_names[rnd * 4:(rnd + 1) * 4]]
        ops += [(delete, (v,)) for v in doomed[rnd * 2:(rnd + 1) * 2]]
        ops += [(expand, e) for e in expansions[rnd]]
        with ThreadPoolExecutor(max_workers=len(ops)) as ex:
            futures = [ex.submit(fn, *args) for fn, args in ops]
            time.sleep(rng.uniform(0.005, 0.05))
            kill_restart()
            if rnd % 2 == 1:  # a second kill while the retries resume on the new controller
                time.sleep(rng.uniform(0.0, 0.05))
                kill_restart()
            for f in futures:
                f.result()
    # Expansions sent the moment a restarted controller answers, while the agents reconnect
    # and report (as the resizer does, which keeps retrying).
    for rnd in range(5):
        in_flight_at_kill.append(r.in_flight)
        ctl.kill9()
        kills += 1
        ctl.start()
        batch = [(vid, 56 * MIB + (rnd + 1) * 8 * MIB) for vid in keep[3:6]]
        with ThreadPoolExecutor(max_workers=len(batch)) as ex:
            for f in [ex.submit(expand, vid, size, 0.005) for vid, size in batch]:
                f.result()
        expansions.append(batch)
    faults_done = time.time()

    # Every name maps to exactly one volume id, and asking again gives the same one.
    for name in new_names:
        answers[name].append(ctl.csi("create-volume", "--name", name, "--size", 4 * MIB)["volumeId"])
    double_ids = sorted(n for n, ids in answers.items() if len(set(ids)) != 1)
    assert double_ids == [], {n: answers[n] for n in double_ids}
    created = {n: ids[0] for n, ids in answers.items()}
    assert len(set(created.values())) == len(created), f"two names share a volume: {created}"
    for i, vid in enumerate(keep):  # expanded or not, the claim still finds its volume
        assert ctl.csi("create-volume", "--name", f"pvc-fk-keep-{i}", "--size", 16 * MIB)["volumeId"] == vid

    # The controller holds exactly the volumes not deleted; their files are where it says,
    # and nothing else is left on any node (orphans reclaimed after the grace period).
    want = set(keep) | set(created.values())
    vols = ctl.volumes()
    assert set(vols) == want, f"controller: extra {set(vols) - want}, missing {want - set(vols)}"
    placed = {vid: v["nodes"][0] for vid, v in vols.items()}
    orphans_seen = max(0, len(set(c.files()) - want))
    harness.wait_until(lambda: c.files() == placed, timeout=20, what="backing files == controller volumes")
    converged = time.time() - faults_done
    for n in nodes:
        # `snapshots/` is part of the store's layout (and holds nothing here).
        assert not os.listdir(n.volume_dir / "snapshots"), f"{n.ns.name}: snapshots left"
        left = sorted(f for f in os.listdir(n.volume_dir) if f not in (".lock", "snapshots"))
        expect = sorted(f"{v}{ext}" for v, nn in placed.items() if nn == n.ns.name for ext in (".img", ".json"))
        assert left == expect, f"{n.ns.name}: volume dir {left}, expected {expect}"
    orphans = len(set(c.files()) - want)
    for vid in doomed:
        assert ctl.csi("delete-volume", "--id", vid) == {}  # gone: deleting again is a no-op

    # Expanded volumes: the controller's capacity and the backing file's size.
    final_size = {vid: 16 * MIB for vid in keep} | {vid: 4 * MIB for vid in created.values()}
    for rnd in expansions:
        for vid, size in rnd:
            final_size[vid] = size
    for vid in want:
        img = by_name[placed[vid]].volume_dir / f"{vid}.img"
        assert vols[vid]["capacityBytes"] == final_size[vid], (vid, vols[vid])
        assert img.stat().st_size == final_size[vid], f"{vid}: file {img.stat().st_size}, expected {final_size[vid]}"

    # Every volume still stages and publishes on its node; data written before is there and
    # grown filesystems span the new size.
    node_retries, node_codes = 0, Counter()
    for vid in sorted(want):
        n = by_name[placed[vid]]
        st, tg = n.staging_path(vid), n.target_path(vid)
        nr = Retrier(deadline_s=20)
        nr.call(lambda: n.csi("stage", "--id", vid, "--staging", st), f"stage {vid}")
        nr.call(lambda: n.csi("publish", "--id", vid, "--staging", st, "--target", tg), f"publish {vid}")
        dev = assert_in_use(n, vid, st, [tg])
        assert ext4_size(dev) == final_size[vid], f"{vid}: ext4 spans {ext4_size(dev)}, volume {final_size[vid]}"
        if vid in data:
            assert (tg / "data").read_bytes() == data[vid], f"{vid}: data written before the faults changed"
        nr.call(lambda: n.csi("unpublish", "--id", vid, "--target", tg), f"unpublish {vid}")
        nr.call(lambda: n.csi("unstage", "--id", vid, "--staging", st), f"unstage {vid}")
        node_retries += nr.attempts - 4
        node_codes.update(nr.codes)
    for n in nodes:
        assert leaks(n) == NO_LEAKS, f"{n.ns.name}: {leaks(n)}"

    ops = len(new_names) + len(doomed) + sum(map(len, expansions))
    harness.fault_report(
        "controller kill -9 during CreateVolume/DeleteVolume/ControllerExpandVolume",
        f"{kills} kill -9 of the controller at random points of {ops} concurrent volume calls "
        f"({len(new_names)} creates, {len(doomed)} deletes, {sum(map(len, expansions))} expansions, 15 of them sent "
        f"as the restarted controller came up), each retried with the same arguments until it succeeded",
        f"every name one volume id, deleted volumes and their files gone, expanded files and filesystems "
        f"at the new size, all {len(want)} volumes stage and publish, data intact; "
        f"{orphans} orphaned files, {len(double_ids)} double ids",
        kills=kills, calls=ops, attempts=r.attempts, retries=r.attempts - ops,
        calls_in_flight_at_kills=in_flight_at_kill, error_codes=dict(r.codes), orphans=orphans,
        error_samples={k: v for k, v in r.samples.items() if k not in ("Unavailable", "Unknown", "exit")},
        orphans_before_convergence=orphans_seen, double_ids=len(double_ids),
        files_converged_s=round(converged, 2), volumes_checked=len(want), node_call_retries=node_retries,
        node_call_error_codes=dict(node_codes),
        seconds=round(time.time() - t0, 1))
    # A transient state (a node connected but not yet reporting, after the restart) must not be
    # answered with a code the sidecars treat as final: external-resizer marks OUT_OF_RANGE /
    # INVALID_ARGUMENT / NOT_FOUND as infeasible and stops retrying; the README promises
    # UNAVAILABLE while the owning node is not there.
    final = {code: r.samples[code] for code in r.codes if code in ("OutOfRange", "InvalidArgument", "NotFound",
                                                                    "AlreadyExists", "FailedPrecondition")}
    assert final == {}, f"retried calls were answered with final error codes during the restarts: {final}"


# ----- case 2: the agent dies inside NodeStage / NodePublish / NodeExpand -----


def start_agent(node, crash_at=None):
    """(Re)start the node's agent, with NODEPLANE_CRASH_AT set for that process only.

    Right after a kill -9 the state-dir lock may still be held for a moment (a child the
    killed agent was spawning shares it until it execs): the agent waits for it itself."""
    node.stop()
    if crash_at:
        os.environ["NODEPLANE_CRASH_AT"] = crash_at
    try:
        node.start()
    finally:
        os.environ.pop("NODEPLANE_CRASH_AT", None)
    # As kubelet: the plugin is used once it has registered, i.e. serves CSI and has recovered.
    harness.wait_until(lambda: node.csi("identity", check=False).get("ready") is True, timeout=10,
                       what=f"{node.ns.name}: CSI Probe ready")


def crash_call(node, vol, step, what):
    """Make the call that reaches the agent's crash point, retried as kubelet does while it
    fails for another reason (ABORTED while the agent's volume sync holds the volume, ...)."""
    deadline = time.time() + 20
    while True:
        try:
            vol.once(step)
        except (CsiError, RuntimeError) as e:
            try:
                harness.wait_until(lambda: node.proc.poll() is not None, timeout=1, interval=0.01)
                return e
            except AssertionError:
                if time.time() > deadline:
                    raise AssertionError(f"{what}: the agent never crashed; the call answered {e}")
                continue
        pytest.fail(f"{what}: {step} succeeded: the crash point was not reached")


class NodeVolume:
    """One volume walked through kubelet's calls on one node, tracking what must be true in
    the kernel after each of them."""

    def __init__(self, c, node, name, fs, size, expand_to=None, ro_block=False):
        self.c, self.node, self.fs = c, node, fs
        self.vid = c.controller.csi("create-volume", "--name", name, "--size", size, "--fs", fs,
                                    "--node", node.ns.name)["volumeId"]
        self.size, self.expand_to = size, expand_to
        self.block = fs == "block"
        self.staging = node.staging_path(self.vid)
        self.rw = node.target_path(self.vid, "pod-rw")
        self.ro = node.target_path(self.vid, "pod-ro") if ro_block else None
        self.img = node.volume_dir / f"{self.vid}.img"
        self.data = os.urandom(128 * 1024)
        self.written = False
        self.staged = False
        self.published = []
        fs_arg = ["--fs", "block"] if self.block else []
        v, st = self.vid, self.staging
        steps = [("stage", ("stage", "--id", v, "--staging", st, *fs_arg)),
                 ("publish", ("publish", "--id", v, "--staging", st, "--target", self.rw, *fs_arg)),
                 ("write", None)]
        if self.ro:
            steps.append(("publish-ro", ("publish", "--id", v, "--staging", st, "--target", self.ro, *fs_arg,
                                         "--readonly")))
        if expand_to:
            steps.append(("expand", ("node-expand", "--id", v, "--path", self.rw, "--size", expand_to)))
        if self.ro:
            steps.append(("unpublish-ro", ("unpublish", "--id", v, "--target", self.ro)))
        steps += [("unpublish", ("unpublish", "--id", v, "--target", self.rw)),
                  ("unstage", ("unstage", "--id", v, "--staging", st))]
        self.steps = steps

    def before(self, step, retrier):
        """What the cluster does before kubelet's call: the resizer's ControllerExpandVolume."""
        if step == "expand":
            ctl = self.c.controller
            got = retrier.call(lambda: ctl.csi("expand-volume", "--id", self.vid, "--size", self.expand_to),
                               f"expand-volume {self.vid}")
            assert got["capacityBytes"] == self.expand_to, got

    def once(self, step):
        """Make the call for `step` once (raises CsiError/RuntimeError when it fails)."""
        args = dict(self.steps)[step]
        if args is None:
            if self.block:
                with open(self.rw, "r+b") as f:
                    f.write(self.data)
                    os.fsync(f.fileno())
            else:
                (self.rw / "data").write_bytes(self.data)
        else:
            self.node.csi(*args)
        self.done(step)

    def done(self, step):
        if step == "stage":
            self.staged = True
        elif step == "publish":
            self.published.append(self.rw)
        elif step == "publish-ro":
            self.published.append(self.ro)
        elif step == "write":
            self.written = True
        elif step == "expand":
            self.size = self.expand_to
        elif step == "unpublish-ro":
            self.published.remove(self.ro)
        elif step == "unpublish":
            self.published.remove(self.rw)
        elif step == "unstage":
            self.staged = False

    def read(self, target):
        if self.block:
            with open(target, "rb") as f:
                return f.read(len(self.data))
        return (target / "data").read_bytes()

    def check(self, what):
        """The kernel state matches the calls made so far."""
        n = self.node
        for t in (self.rw, self.ro):
            if t is not None and t not in self.published:
                assert not t.exists(), f"{what}: target {t} left after unpublish"
        if not self.staged:
            assert loops_of(self.img) == [], f"{what}: loop devices left: {loops_of(self.img)}"
            assert leaks(n) == NO_LEAKS, f"{what}: {leaks(n)}"
            return
        ro_targets = [self.ro] if self.ro in self.published else []
        dev = assert_in_use(n, self.vid, self.staging, self.published, block=self.block, ro_targets=ro_targets)
        if self.written:
            for t in self.published:
                assert self.read(t) == self.data, f"{what}: data written before is not there through {t}"
        if self.size == self.expand_to:
            assert self.img.stat().st_size == self.size, f"{what}: backing file {self.img.stat().st_size}"
            sectors = int((Path("/sys/block") / Path(dev).name / "size").read_text())
            assert sectors * 512 == self.size, f"{what}: {dev} is {sectors * 512} bytes, volume {self.size}"
            spans = xfs_size(self.staging)
            assert spans == self.size, f"{what}: xfs spans {spans}, volume {self.size}"


def test_agent_dies_inside_node_calls_and_kubelet_retries(prov):
    t0 = time.time()
    rng = random.Random()
    c = prov()
    n1, n2 = c.node(51, capacity=16384 * MIB), c.node(52, capacity=16384 * MIB)
    c.wait_connected([n1, n2])
    kub = Retrier(deadline_s=30)
    seq = iter(range(1000))
    found = {"points": [], "kills": 0, "kills_interrupting_call": 0, "delays_ms": [], "retried_calls": 0,
             "retry_attempts": 0}

    def volume(node, kind, ro_block=False, expand=False):
        fs = {"ext4": "ext4", "xfs": "xfs", "block": "block"}[kind]
        size = {"ext4": 64 * MIB, "xfs": 512 * MIB, "block": 32 * MIB}[kind]
        return NodeVolume(c, node, f"pvc-fa-{next(seq):03d}", fs, size,
                          expand_to=640 * MIB if expand else None, ro_block=ro_block)

    durations = {}  # step -> seconds its calls took when nothing interfered (client start included)

    def walk(vol, steps, what):
        for step, _ in steps:
            vol.before(step, kub)
            attempts, began = kub.attempts, time.time()
            kub.call(lambda: vol.once(step), f"{what}: {step}")
            if kub.attempts == attempts + 1:
                durations.setdefault(step, []).append(time.time() - began)
            vol.check(f"{what}: after {step}")

    def finish(vol, step, what):
        """kubelet retries the interrupted call until it succeeds, then goes on to the end."""
        before, began = kub.attempts, time.time()
        kub.call(lambda: vol.once(step), f"{what}: retried {step}")
        if kub.attempts == before + 1:
            durations.setdefault(step, []).append(time.time() - began)
        found["retried_calls"] += 1
        found["retry_attempts"] += kub.attempts - before
        vol.check(f"{what}: after the retried {step}")
        rest = vol.steps[[s for s, _ in vol.steps].index(step) + 1:]
        walk(vol, rest, what)
        assert not vol.staged and not vol.published
        kub.call(lambda: c.controller.csi("delete-volume", "--id", vol.vid), f"{what}: delete")
        assert not vol.img.exists(), f"{what}: backing file left after DeleteVolume"

    # (a) A real crash (abort) at every crash point of src/storage/csi/node/ (stage.rs, publish.rs), inside the call
    # named.
    rounds = [("stage-after-record", "stage", "ext4"), ("stage-after-attach", "stage", "xfs"),
              ("stage-after-mkfs", "stage", "ext4"),
              ("stage-after-mount", "stage", "xfs"),
              ("publish-after-record", "publish", "ext4"), ("publish-after-mount", "publish", "xfs"),
              ("expand-after-store", "expand", "xfs"),
              ("unpublish-after-unmount", "unpublish", "ext4"), ("unstage-after-unmount", "unstage", "xfs"),
              ("stage-after-attach", "stage", "block"), ("publish-after-record", "publish-ro", "block"),
              ("publish-after-mount", "publish-ro", "block"), ("unpublish-after-unmount", "unpublish-ro", "block"),
              ("unstage-after-unmount", "unstage", "block")]
    for point, step, kind in rounds:
        what = f"{point} in {step} ({kind})"
        vol = volume(n1, kind, ro_block=kind == "block", expand=step == "expand")
        names = [s for s, _ in vol.steps]
        walk(vol, vol.steps[:names.index(step)], what)
        vol.before(step, kub)
        start_agent(n1, crash_at=point)
        crash_call(n1, vol, step, what)
        assert f"NODEPLANE_CRASH_AT: crashing at {point}\n" in n1.log()[n1.log_offset:], f"{what}: did not crash there"
        start_agent(n1)
        finish(vol, step, what)
        found["points"].append(f"{point}/{kind}")

    # (b) kill -9 at a random moment while the call is in flight: somewhere within the time
    # that call took when nothing interfered (measured above).
    for step in ("stage", "publish", "expand"):
        typical = sorted(durations[step])[len(durations[step]) // 2]
        for _ in range(4):
            what = f"kill -9 during {step}"
            vol = volume(n2, "xfs", expand=step == "expand")
            names = [s for s, _ in vol.steps]
            walk(vol, vol.steps[:names.index(step)], what)
            vol.before(step, kub)
            outcome = {}

            def call():
                try:
                    vol.once(step)
                    outcome["ok"] = True
                except (CsiError, RuntimeError) as e:
                    outcome["error"] = e

            t = threading.Thread(target=call)
            delay = rng.uniform(0.001, typical)
            t.start()
            time.sleep(delay)
            n2.kill9()
            t.join(timeout=60)
            assert not t.is_alive(), f"{what}: the call hung after the agent died"
            found["kills"] += 1
            found["delays_ms"].append(round(delay * 1000, 1))
            start_agent(n2)
            if "ok" in outcome:
                vol.check(f"{what}: answered before the kill")
                rest = vol.steps[names.index(step) + 1:]
                walk(vol, rest, what)
                kub.call(lambda: c.controller.csi("delete-volume", "--id", vol.vid), f"{what}: delete")
                assert not vol.img.exists(), f"{what}: backing file left after DeleteVolume"
            else:
                found["kills_interrupting_call"] += 1
                finish(vol, step, what)

    left = {n.ns.name: leaks(n) for n in (n1, n2)}
    assert all(v == NO_LEAKS for v in left.values()), left
    harness.fault_report(
        "agent crash inside NodeStage/NodePublish/NodeExpand, kubelet retries",
        f"agent abort at {len(found['points'])} crash points (NODEPLANE_CRASH_AT, every point in src/storage/csi/node/, "
        f"ext4, xfs and raw block with a read-only block publication) and {found['kills']} kill -9 at random "
        f"moments of stage/publish/expand ({found['kills_interrupting_call']} while the call was in flight); "
        f"each interrupted call retried after the restart until it succeeded",
        "after every retry exactly the expected mounts on the volume's loop device, one read-write loop device "
        "per volume (+1 read-only for read-only block), data intact, xfs/loop/file at the expanded size; "
        "after unpublish + unstage no mount, loop device, record or target left",
        points=found["points"], kills=found["kills"], kills_interrupting_call=found["kills_interrupting_call"],
        kill_delays_ms=found["delays_ms"], interrupted_calls_retried=found["retried_calls"],
        attempts_to_succeed=found["retry_attempts"], node_calls=kub.calls,
        failed_attempts=kub.attempts - kub.calls, failed_attempt_codes=dict(kub.codes),
        leaks=sum(len(x) for v in left.values() for x in v.values()),
        seconds=round(time.time() - t0, 1))


def test_interrupted_stage_rolled_back_while_device_busy_leaves_no_loop(prov):
    """Case 2, one step further: the agent dies inside NodeStage after attaching the loop
    device, and while it restarts something else still holds that device exclusively -- what
    the killed agent's own mkfs does when it outlives the agent (seen here with kill -9 during
    mkfs of a 16-64 GiB volume). The pod is then deleted, so kubelet calls NodeUnstage instead
    of retrying the stage. Expected: NodeUnstage leaves no loop device and DeleteVolume works."""
    t0 = time.time()
    c = prov()
    n = c.node(71, capacity=4096 * MIB)
    c.wait_connected([n])
    kub = Retrier(deadline_s=20)
    vol = NodeVolume(c, n, "pvc-fb-busy", "ext4", 64 * MIB)
    start_agent(n, crash_at="stage-after-attach")
    crash_call(n, vol, "stage", "stage-after-attach")
    [(dev, _, _)] = loops_of(vol.img)
    holder = os.open(dev, os.O_RDONLY | os.O_EXCL)  # an exclusive opener, as mkfs is
    try:
        start_agent(n)
        recovery_log = [l for l in n.log()[n.log_offset:].splitlines() if vol.vid in l and "stage" in l]
    finally:
        os.close(holder)
    kub.call(lambda: n.csi("unstage", "--id", vol.vid, "--staging", vol.staging), "unstage")
    left = loops_of(vol.img)
    deadline, delete_error = time.time() + 5, None
    while time.time() < deadline:
        try:
            c.controller.csi("delete-volume", "--id", vol.vid)
            delete_error = None
            break
        except CsiError as e:
            delete_error = f"{e.code}: {e.message}"
            time.sleep(0.2)
    harness.fault_report(
        "agent crash mid-NodeStage, device busy during recovery, then NodeUnstage",
        "agent abort at stage-after-attach; an exclusive opener held the loop device while the agent restarted "
        "and recovered; then NodeUnstage (the pod was deleted) and DeleteVolume",
        f"loop devices left after NodeUnstage: {[d for d, _, _ in left]}; DeleteVolume: {delete_error or 'OK'}",
        leaked_loops=len(left), delete_error=delete_error, recovery_log=[l[-200:] for l in recovery_log],
        seconds=round(time.time() - t0, 1))
    assert left == [], (f"NodeUnstage answered OK but left {left} attached to {vol.img}; recovery said: "
                        f"{recovery_log}")
    assert delete_error is None, f"DeleteVolume still refused 5 s later: {delete_error}"


# ----- case 3: the agent's state dir is full -----

def state_files(state):
    """Every file under the state dir (the filler excepted): relative path -> bytes."""
    out = {}
    for p in Path(state).rglob("*"):
        if p.is_file() and p.name != "filler":
            out[str(p.relative_to(state))] = p.read_bytes()
    return out


def ipam_allocated(node):
    """nodeplane_ipam_block_allocated per block, from the agent's /metrics."""
    body = harness.health_request(node.ns, "/metrics")["body"]
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^nodeplane_ipam_block_allocated\{block="([^"]+)"\} (\S+)$', body, re.M)}


def test_full_state_disk_fails_cleanly_and_recovers(prov):
    t0 = time.time()
    c = prov()
    other = c.node(62)
    # The node under test keeps its state dir on a 2 MiB tmpfs; its volumes live elsewhere
    # (csi.volumeDir), so only the agent's own state runs out of space.
    n = cluster.Cluster.node(c, 1, 61, start=False, csi={"capacityBytes": 1024 * MIB})
    vol_dir = n.root / "volumes"
    n.cfg["csi"]["volumeDir"] = str(vol_dir)
    n.cfg_path.write_text(json.dumps(n.cfg))
    state = n.root / "var/lib/nodeplane"
    state.mkdir(parents=True)
    run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "npt-state", str(state)])
    filler = state / "filler"
    try:
        n.start()
        c.wait_connected([n, other])
        ctl = c.controller
        kub = Retrier(deadline_s=20)
        pods = [n.add_pod("fpa")[0]]
        vols = {}
        for name in ("pvc-fd-a", "pvc-fd-b"):
            vid = ctl.csi("create-volume", "--name", name, "--size", 16 * MIB, "--node", n.ns.name)["volumeId"]
            vols[vid] = (n.staging_path(vid), n.target_path(vid))
        a, b = sorted(vols)
        n.csi("stage", "--id", a, "--staging", vols[a][0])
        n.csi("publish", "--id", a, "--staging", vols[a][0], "--target", vols[a][1])
        data = os.urandom(64 * 1024)
        (vols[a][1] / "data").write_bytes(data)
        before = state_files(state)
        leases_before, veths_before = n.leases(), set(n.host_veths())
        allocated_before = ipam_allocated(n)
        mounts_before = mount_entries(n.kubelet)
        loops_before = harness.loops_under(vol_dir)
        assert len(leases_before) == 1 and len(veths_before) == 1 and len(loops_before) == 1
        assert len(allocated_before) == 2 and set(allocated_before.values()) == {1}, allocated_before
        assert any(k.startswith("csi/stage/") for k in before) and any(k.startswith("ipam/") for k in before)

        with open(filler, "wb") as f:
            with pytest.raises(OSError) as full:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        assert full.value.errno == 28 and os.statvfs(state).f_bavail == 0

        # CNI ADD: a clear CNI error, and nothing left of the attempt.
        pod = harness.Pod(n, "fpb")
        n.pods.append(pod)  # its namespace is removed with the node
        rc, err, raw = n.cni("ADD", pod.cid, "eth0", pod.ns.path)
        assert rc != 0 and err is not None, raw
        # Spec: 5 = I/O failure, 11 = try again later; either fits a full disk, as long as the
        # message says what happened.
        assert err["code"] in (5, 11) and "No space left on device" in err["msg"], err
        assert n.leases() == leases_before, "a lease was left by the failed ADD"
        assert set(n.host_veths()) == veths_before, "a host veth was left by the failed ADD"
        assert set(pod.ns.links()) == {"lo"}, f"the pod namespace kept {set(pod.ns.links())}"
        assert ipam_allocated(n) == allocated_before, "the failed ADD kept its addresses"
        # CSI: NodeStage of another volume and NodePublish at a second target fail clearly and
        # leave no mount, loop device or target.
        with pytest.raises(CsiError) as stage_err:
            n.csi("stage", "--id", b, "--staging", vols[b][0])
        assert "No space left on device" in stage_err.value.message, stage_err.value
        second = n.target_path(a, "pod2")
        with pytest.raises(CsiError) as publish_err:
            n.csi("publish", "--id", a, "--staging", vols[a][0], "--target", second)
        assert "No space left on device" in publish_err.value.message, publish_err.value
        assert mount_entries(n.kubelet) == mounts_before, "a mount was left by the failed calls"
        assert harness.loops_under(vol_dir) == loops_before, "a loop device was left by the failed calls"
        assert not second.exists(), "the failed publish left its target"
        # Existing pods keep working; what was written before is intact, byte for byte.
        rc, _, raw = n.cni("CHECK", pods[0].cid, "eth0", pods[0].ns.path, conf=n.netconf(prevResult=pods[0].result))
        assert rc == 0, raw
        assert (vols[a][1] / "data").read_bytes() == data
        now = state_files(state)
        changed = sorted(k for k in before if now.get(k) != before[k])
        assert changed == [], f"state files changed while the disk was full: {changed}"
        for k, v in now.items():
            if k.endswith(".json"):
                json.loads(v)  # none truncated
        partial = sorted(set(now) - set(before))

        # Space returns: the same ADD and stage succeed without an agent restart.
        filler.unlink()
        rc, res, raw = n.cni("ADD", pod.cid, "eth0", pod.ns.path)
        assert rc == 0, raw
        pod.result = res
        pods.append(pod)
        kub.call(lambda: n.csi("stage", "--id", b, "--staging", vols[b][0]), f"stage {b}")
        kub.call(lambda: n.csi("publish", "--id", b, "--staging", vols[b][0], "--target", vols[b][1]), f"publish {b}")
        (vols[b][1] / "data").write_bytes(data)

        # After a restart the state matches: leases == pods, one veth each, both volumes in place.
        n.restart()
        leases = n.leases()
        assert sorted(leases) == sorted(f"{p.cid}:eth0.json" for p in pods), leases
        assert all(l["state"] == "ready" for l in leases.values()), leases
        assert sorted({ip for l in leases.values() for ip in l["ips"]}) == \
            sorted(i["address"] for p in pods for i in p.result["ips"])
        assert len(n.host_veths()) == len(pods)
        for p in pods:
            rc, _, raw = n.cni("CHECK", p.cid, "eth0", p.ns.path, conf=n.netconf(prevResult=p.result))
            assert rc == 0, raw
        allocated = ipam_allocated(n)
        assert set(allocated) == set(allocated_before) and set(allocated.values()) == {2}, allocated
        mounts = mount_entries(n.kubelet)
        assert set(mounts) == {str(p) for v in vols.values() for p in v}, sorted(mounts)
        for vid, (st, tg) in vols.items():
            [(dev, majmin, _)] = loops_of(vol_dir / f"{vid}.img")
            assert mounts[str(st)]["majmin"] == mounts[str(tg)]["majmin"] == majmin
            assert (tg / "data").read_bytes() == data
        for vid, (st, tg) in vols.items():
            kub.call(lambda: n.csi("unpublish", "--id", vid, "--target", tg), f"unpublish {vid}")
            kub.call(lambda: n.csi("unstage", "--id", vid, "--staging", st), f"unstage {vid}")
        for p in pods:
            rc, _, raw = n.cni("DEL", p.cid, "eth0", p.ns.path)
            assert rc == 0, raw
        assert n.leases() == {}
        assert harness.mounts_under(n.kubelet) == [] and harness.loops_under(n.root) == []
        partial_at_end = sorted(k for k in state_files(state) if k.endswith(".tmp"))

        harness.fault_report(
            "full state disk",
            "the agent's state dir (a 2 MiB tmpfs) filled to 0 bytes free; CNI ADD, NodeStage and NodePublish "
            "while full; filler removed; agent restarted",
            f"ADD failed with CNI code {err['code']} ({err['msg']!r}), NodeStage {stage_err.value.code}, "
            f"NodePublish {publish_err.value.code}, both saying no space; no lease, veth, address, mount or loop "
            f"device left; state written before byte-identical; after space returned the same ADD and stage "
            f"succeeded without a restart, and after a restart leases == pods",
            cni_code=err["code"], cni_msg=err["msg"], stage_code=stage_err.value.code,
            stage_msg=stage_err.value.message, publish_code=publish_err.value.code,
            leaked_leases=0, leaked_veths=0, leaked_mounts=0, leaked_loops=0, changed_state_files=len(changed),
            partial_files_left=partial, partial_files_at_end=partial_at_end,
            retries_after_space_returned=kub.attempts - kub.calls,
            seconds=round(time.time() - t0, 1))
        assert partial == [], f"the failed calls left partial files in the state dir: {partial}"
    finally:
        n.stop()
        harness.release_storage_under(n.kubelet)
        if str(state) in mount_entries(state):
            run(["umount", "-l", str(state)], check=False)
