"""Robustness: the agent killed (-9) in the middle of an ADD/DEL storm, a crash mid-ADD rolled
back, simulated reboots, pod namespaces that vanish while the agent is down, every CNI error
code from real bad input, and results of every supported cniVersion checked against the spec
(JSON Schema) and against a real peer (the reference `tuning` plugin).

Every assertion is about real state: the lease files and the kernel (links in the node
namespace, interfaces/addresses in the pod namespaces, pings).
"""

import concurrent.futures as cf
import ipaddress
import json
import os
import queue
import random
import re
import subprocess
import threading
import time

import jsonschema

import harness

VERSIONS = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
HOST_VETH_RE = re.compile(r"^np[0-9a-f]{13}$")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
TUNING = harness.REF_CNI_DIR / "tuning"
MAX_CONFIG_BYTES = 1 << 20
LEASE_KEYS = {"containerId", "ifname", "state", "netns", "netnsInode", "netnsCookie", "hostIf", "hostIfindex", "ips", "pod"}


# ----- helpers -----

def log_since(node, offset=0):
    """The agent log from `offset` on, without colour codes."""
    return ANSI_RE.sub("", node.log()[offset:])


def start_agent(node, timeout=15):
    """Start the agent and wait for *this* start's "ready" line; returns the log offset where
    this start's output begins. (Node.wait_ready can be satisfied by an earlier start: the log
    is appended across restarts and a killed agent leaves its socket and conflist behind.)"""
    offset = len(node.log())
    node.start(wait=False)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if node.proc.poll() is not None:
            raise RuntimeError(f"agent exited {node.proc.returncode}: {log_since(node, offset)}")
        if re.search(r"nodeplane::agent: ready ", log_since(node, offset)):
            return offset
        time.sleep(0.02)
    raise RuntimeError(f"agent not ready: {log_since(node, offset)}")


def fnv1a(parts):
    h = 0xCBF29CE484222325
    for i, part in enumerate(parts):
        if i:
            h = ((h ^ 0xFF) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        for b in part:
            h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def host_ifname(cid, ifname="eth0"):
    """The agent's host-side veth name for an attachment (src/net/datapath/mod.rs host_ifname)."""
    return "np%013x" % (fnv1a([cid.encode(), ifname.encode()]) & 0xF_FFFF_FFFF_FFFF)


def make_pods(node, n, tag):
    with cf.ThreadPoolExecutor(8) as ex:
        pods = list(ex.map(lambda _: harness.Pod(node, tag), range(n)))
    node.pods.extend(pods)
    return pods


def drop_pods(node, pods):
    with cf.ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda p: p.ns.delete(), pods))
    gone = {id(p) for p in pods}
    node.pods[:] = [p for p in node.pods if id(p) not in gone]


def norm_ips(ips):
    return sorted(str(ipaddress.ip_interface(a)) for a in ips)


def result_ips(result):
    return norm_ips(i["address"] for i in result["ips"])


def gateways(result):
    return [i["gateway"] for i in result["ips"]]


def node_links(node):
    links = node.ns.links()
    veths = {n: l for n, l in links.items() if HOST_VETH_RE.match(n) and not harness.is_graveyard(n, l)}
    graves = sorted(n for n, l in links.items() if harness.is_graveyard(n, l))
    return links, veths, graves


def assert_consistent(node):
    """Leases and kernel agree: every lease is complete, its host veth exists, is up and on the
    bridge; no two leases share an address; no pod veth exists without a lease. Returns the
    leases by container id."""
    leases = node.leases()
    by_cid = {l["containerId"]: l for l in leases.values()}
    assert len(by_cid) == len(leases), f"several leases per container: {sorted(leases)}"
    links, veths, _ = node_links(node)
    for cid, l in by_cid.items():
        assert set(l) >= LEASE_KEYS - {"pod"}, l
        assert l["state"] == "ready", f"lease left in state {l['state']!r}: {l}"
        assert l["hostIf"] == host_ifname(cid, l["ifname"]), l
        h = links.get(l["hostIf"])
        assert h is not None, f"lease {cid} names host veth {l['hostIf']} which does not exist"
        assert h.get("master") == "np0", f"host veth {l['hostIf']} of {cid} is not on np0: {h.get('master')}"
        assert "UP" in h["flags"], f"host veth {l['hostIf']} of {cid} is down: {h['flags']}"
        assert h.get("linkinfo", {}).get("info_kind") == "veth", h
    all_ips = [str(ipaddress.ip_interface(a).ip) for l in by_cid.values() for a in l["ips"]]
    dup = sorted({a for a in all_ips if all_ips.count(a) > 1})
    assert not dup, f"addresses leased twice: {dup}"
    orphans = sorted(set(veths) - {l["hostIf"] for l in by_cid.values()})
    assert not orphans, f"pod veths without a lease: {orphans}"
    return by_cid


def assert_clean(node):
    """No lease, no pod veth, no graveyard link, no queued delete."""
    assert node.wait_no_graveyard(), f"graveyard links not reaped: {node_links(node)[2]}"
    assert node.leases() == {}, f"leases left: {sorted(node.leases())}"
    assert sorted(p.name for p in node.lease_dir.iterdir()) == [], "lease dir not empty"
    _, veths, graves = node_links(node)
    assert not veths and not graves, f"links left: {sorted(veths)} {graves}"
    pending = sorted(p.name for p in node.pending_dir.glob("del-*.json")) if node.pending_dir.exists() else []
    assert pending == [], f"queued deletes never drained: {pending}"


def check_pod_kernel(pod, result):
    """The pod has exactly the result's addresses on eth0 and reaches its gateways.
    Returns a problem description or None."""
    want = result_ips(result)
    have = norm_ips(a for a in pod.ns.addrs("eth0") if not a.startswith("fe80:"))
    if have != want:
        return f"{pod.cid}: eth0 has {have}, result says {want}"
    for gw in gateways(result):
        if not pod.ns.ping(gw, count=1, wait=2):
            # One retry: the very first IPv6 packet can race neighbour discovery.
            if not pod.ns.ping(gw, count=2, wait=2):
                return f"{pod.cid}: cannot ping gateway {gw}"
    return None


def check_pods_kernel(pods_results):
    with cf.ThreadPoolExecutor(16) as ex:
        problems = [p for p in ex.map(lambda pr: check_pod_kernel(*pr), pods_results) if p]
    assert not problems, "\n".join(problems)


def cni_ok(node, cmd, pod, conf=None, **kw):
    rc, out, raw = node.cni(cmd, pod.cid, "eth0", pod.ns.path, conf=conf if conf is not None else node.netconf(), **kw)
    assert rc == 0, f"{cmd} {pod.cid} failed ({rc}): {raw}"
    return out


# ----- 1. kill -9 during an ADD/DEL storm -----

class Record:
    """What the runtime knows about one pod sandbox."""

    def __init__(self, pod, want_del):
        self.pod = pod
        self.want_del = want_del
        self.add = None          # "ok" | "failed" | "unknown"
        self.add_code = None
        self.result = None
        self.deleted = False     # a DEL returned 0
        self.del_rcs = []


def storm_round(node, rng, kill_after, n_pods=100, workers=8):
    pods = make_pods(node, n_pods, "s")
    conf = node.netconf()
    want_del = set(rng.sample([p.cid for p in pods], n_pods // 2))
    recs = {p.cid: Record(p, p.cid in want_del) for p in pods}
    work = queue.Queue()
    for p in pods:
        work.put(p)
    done = [0]
    lock = threading.Lock()

    def tick():
        with lock:
            done[0] += 1

    def worker():
        while True:
            try:
                p = work.get_nowait()
            except queue.Empty:
                return
            r = recs[p.cid]
            try:
                rc, out, _ = node.cni("ADD", p.cid, "eth0", p.ns.path, conf=conf, timeout=30)
                if rc == 0:
                    r.add, r.result = "ok", out
                else:
                    r.add, r.add_code = "failed", (out or {}).get("code")
            except subprocess.TimeoutExpired:
                r.add = "unknown"
            tick()
            if r.add == "ok" and r.want_del:
                time.sleep(rng.random() * 0.003)
                rc, _, _ = node.cni("DEL", p.cid, "eth0", p.ns.path, conf=conf, timeout=30)
                r.del_rcs.append(rc)
                r.deleted = rc == 0
                tick()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while done[0] < kill_after and any(t.is_alive() for t in threads) and time.time() < deadline:
        time.sleep(0.0005)
    time.sleep(rng.random() * 0.004)  # land somewhere inside the in-flight operations
    node.kill9()
    killed_at = done[0]
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "storm workers hung"
    return pods, recs, killed_at


def test_kill9_during_add_del_storm(node):
    seed = int(os.environ.get("NP_STORM_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    # Different kill points: mid-storm (as specified), early, late.
    kill_ranges = [(30, 60), (3, 25), (70, 140)]
    started = time.time()
    for rnd, (lo, hi) in enumerate(kill_ranges):
        if rnd >= 2 and time.time() - started > 35:
            break
        kill_after = rng.randint(lo, hi)
        ctx = f"[seed={seed} round={rnd} kill_after={kill_after}]"
        pods, recs, killed_at = storm_round(node, rng, kill_after)
        ctx += f" [killed after {killed_at} ops]"
        if rnd == 1:
            # A second crash while the restarted agent reconciles / drains queued DELs.
            node.start(wait=False)
            time.sleep(rng.random() * 0.02)
            node.kill9()
        offset = start_agent(node)

        # Anything a runtime was told must hold after the restart.
        by_cid = assert_consistent(node)
        for cid, r in recs.items():
            if r.add == "ok" and not r.deleted:
                assert cid in by_cid, f"{ctx} ADD of {cid} succeeded but its lease is gone after restart"
                assert norm_ips(by_cid[cid]["ips"]) == result_ips(r.result), f"{ctx} {cid}: lease differs from the ADD result"
            if r.deleted:
                assert cid not in by_cid, f"{ctx} DEL of {cid} returned 0 (maybe queued) but its lease survived the restart"
        assert "reconciled" in log_since(node, offset)

        # Now act like a runtime: DEL every ADD that failed or whose outcome is unknown, retry
        # failed DELs, then retry the failed ADDs (and their DELs) now that the agent is back.
        def settle(r):
            conf = node.netconf()
            if r.add != "ok":
                rc, _, raw = node.cni("DEL", r.pod.cid, "eth0", r.pod.ns.path, conf=conf)
                assert rc == 0, f"{ctx} cleanup DEL of {r.pod.cid} failed: {raw}"
                rc, out, raw = node.cni("ADD", r.pod.cid, "eth0", r.pod.ns.path, conf=conf)
                assert rc == 0, f"{ctx} retried ADD of {r.pod.cid} failed: {raw}"
                r.add, r.result, r.deleted = "ok", out, False
            if r.want_del and not r.deleted:
                rc, _, raw = node.cni("DEL", r.pod.cid, "eth0", r.pod.ns.path, conf=conf)
                assert rc == 0, f"{ctx} DEL of {r.pod.cid} failed: {raw}"
                r.deleted = True

        failed_adds = sorted({(r.add, r.add_code) for r in recs.values() if r.add != "ok"}, key=str)
        print(f"{ctx}: ADD ok={sum(r.add == 'ok' for r in recs.values())} "
              f"failed={sum(r.add == 'failed' for r in recs.values())} "
              f"unknown={sum(r.add == 'unknown' for r in recs.values())}; "
              f"DEL ok={sum(r.deleted for r in recs.values())}; leases after restart={len(by_cid)}; "
              f"queued DELs drained={log_since(node, offset).count('drained pending delete')}; "
              f"{log_since(node, offset).split('reconciled', 1)[1].splitlines()[0].strip()}")
        bad_dels = sorted(cid for cid, r in recs.items() if any(rc != 0 for rc in r.del_rcs))
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(settle, recs.values()))

        survivors = {cid: r for cid, r in recs.items() if r.add == "ok" and not r.deleted}
        by_cid = assert_consistent(node)
        assert set(by_cid) == set(survivors), (
            f"{ctx} leases != pods added and not deleted: extra={sorted(set(by_cid) - set(survivors))} "
            f"missing={sorted(set(survivors) - set(by_cid))}")
        for cid, r in survivors.items():
            assert norm_ips(by_cid[cid]["ips"]) == result_ips(r.result), f"{ctx} {cid}: lease differs from its ADD result"
        assert node.wait_no_graveyard(), f"{ctx} graveyard links left: {node_links(node)[2]}"
        check_pods_kernel([(r.pod, r.result) for r in survivors.values()])

        def check(r):
            rc, _, raw = node.cni("CHECK", r.pod.cid, "eth0", r.pod.ns.path, conf=node.netconf(prevResult=r.result))
            return None if rc == 0 else f"{r.pod.cid}: {raw}"
        with cf.ThreadPoolExecutor(8) as ex:
            bad = [x for x in ex.map(check, survivors.values()) if x]
        assert not bad, f"{ctx} CHECK fails for surviving pods:\n" + "\n".join(bad)
        # Before the kill every ADD must have worked; after it the shim says "try again later".
        assert all(code == 11 for kind, code in failed_adds if kind == "failed"), f"{ctx} ADD failures: {failed_adds}"
        assert ("unknown", None) not in failed_adds, f"{ctx} some ADDs never returned"
        assert not bad_dels, f"{ctx} DELs that failed during the storm (DEL must always succeed): {bad_dels}"

        # Tear everything down: nothing may be left.
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda r: cni_ok(node, "DEL", r.pod), survivors.values()))
        assert_clean(node)
        drop_pods(node, pods)


# ----- 2. crash mid-ADD is rolled back -----

def test_crash_mid_add_is_rolled_back(node):
    # A real ADD shows the lease format; DEL it so its address is free again.
    p0, r0 = node.add_pod("p")
    template = json.loads((node.lease_dir / f"{p0.cid}:eth0.json").read_text())
    assert set(template) == LEASE_KEYS, template
    assert template["state"] == "ready" and template["hostIf"] == host_ifname(p0.cid) == r0["interfaces"][1]["name"]
    cni_ok(node, "DEL", p0)
    assert node.leases() == {}

    node.kill9()
    # The state an agent killed in the middle of plumbing leaves behind: a lease still marked
    # "adding", the veth pair created (host end on the bridge, pod end with an address), and
    # a half-written lease temp file.
    q = harness.Pod(node, "q")
    node.pods.append(q)
    lease = dict(template, containerId=q.cid, state="adding", netns=q.ns.path,
                 netnsInode=os.stat(q.ns.path).st_ino, hostIf=host_ifname(q.cid), pod="default/q")
    (node.lease_dir / f"{q.cid}:eth0.json").write_text(json.dumps(lease))
    (node.lease_dir / f"{q.cid}:eth1.json.tmp").write_text('{"containerId":')
    hif = lease["hostIf"]
    harness.run(["ip", "-n", node.ns.name, "link", "add", hif, "type", "veth", "peer", "name", "eth0", "netns", q.ns.name])
    harness.run(["ip", "-n", node.ns.name, "link", "set", hif, "master", "np0", "up"])
    v4 = next(a for a in template["ips"] if ":" not in a)
    harness.run(["ip", "-n", q.ns.name, "addr", "add", v4, "dev", "eth0"])
    assert "eth0" in q.ns.links()

    offset = start_agent(node)
    log = log_since(node, offset)
    assert node.leases() == {}, f"the 'adding' lease survived the restart: {node.leases()}"
    assert sorted(p.name for p in node.lease_dir.iterdir()) == [], "lease dir not empty (partial file kept?)"
    assert "ADD never completed" in log and q.cid in log, log
    assert node.wait_no_graveyard()
    links, veths, _ = node_links(node)
    assert hif not in links and not veths, f"half-made veth survived: {sorted(veths)}"
    assert "eth0" not in q.ns.links(), "pod end of the half-made veth survived"

    # The runtime saw the ADD fail: it DELs, then retries. The address is handed out again.
    cni_ok(node, "DEL", q)
    res = cni_ok(node, "ADD", q)
    assert result_ips(res) == norm_ips(template["ips"]), f"rolled-back address not reused: {res['ips']}"
    by_cid = assert_consistent(node)
    assert set(by_cid) == {q.cid}
    check_pods_kernel([(q, res)])
    cni_ok(node, "CHECK", q, conf=node.netconf(prevResult=res))
    cni_ok(node, "DEL", q)
    assert_clean(node)


def test_crash_mid_del_is_completed(node):
    (d1, r1), (d2, r2), (keep, rk) = node.add_pod("d"), node.add_pod("d"), node.add_pod("keep")
    d3, r3 = node.add_pod("d")
    node.kill9()
    # d1: an older agent died after taking the host veth down and off the bridge, before
    # renaming it; the runtime's DEL failed on the broken connection, so the shim queued it.
    h1 = host_ifname(d1.cid)
    harness.run(["ip", "-n", node.ns.name, "link", "set", h1, "down", "nomaster"])
    rc, _, raw = node.cni("DEL", d1.cid, "eth0", d1.ns.path, conf=node.netconf())
    assert rc == 0, raw
    assert len(list(node.pending_dir.glob("del-*.json"))) == 1
    # d2: the agent died after renaming the host veth into the graveyard, before releasing
    # the lease (and nothing was queued).
    h2 = host_ifname(d2.cid)
    grave = "npz%012x" % random.getrandbits(48)
    harness.run(["ip", "-n", node.ns.name, "link", "set", h2, "down", "nomaster"])
    harness.run(["ip", "-n", node.ns.name, "link", "set", h2, "name", grave])
    # d3: the agent died after retiring the host veth (down and into the graveyard group in
    # one request; it keeps its name), before releasing the lease.
    h3 = host_ifname(d3.cid)
    harness.run(["ip", "-n", node.ns.name, "link", "set", h3, "down", "group", harness.GRAVEYARD_GROUP])

    offset = start_agent(node)
    log = log_since(node, offset)
    by_cid = assert_consistent(node)
    assert set(by_cid) == {keep.cid}, f"expected only {keep.cid}, have {sorted(by_cid)}"
    assert "drained pending delete" in log and d1.cid in log, log
    assert "its host veth went with it" in log and d2.cid in log, log
    assert "the host veth was retired" in log and d3.cid in log, log
    assert node.wait_no_graveyard(), f"graveyard not reaped: {node_links(node)[2]}"
    links = node.ns.links()
    assert h1 not in links and h2 not in links and grave not in links and h3 not in links
    assert "eth0" not in d1.ns.links() and "eth0" not in d2.ns.links() and "eth0" not in d3.ns.links()
    assert list(node.pending_dir.glob("del-*.json")) == []
    check_pods_kernel([(keep, rk)])
    # The runtime repeats its DELs (idempotent), the untouched pod is still fine, then goes.
    for p in (d1, d2, d3):
        cni_ok(node, "DEL", p)
    cni_ok(node, "CHECK", keep, conf=node.netconf(prevResult=rk))
    cni_ok(node, "DEL", keep)
    assert_clean(node)


# ----- 3. simulated reboot -----

def test_reboot_frees_all_leases(node):
    pods = [node.add_pod(f"r{i}")[0] for i in range(3)]
    assert len(node.leases()) == 3
    node.kill9()
    for p in pods:
        p.ns.delete()
    node.boot_id_file.write_text("boot-2\n")
    offset = start_agent(node)
    log = log_since(node, offset)
    assert sorted(p.name for p in node.lease_dir.iterdir()) == [], f"lease dir not empty: {node.leases()}"
    assert node.wait_no_graveyard()
    assert not node_links(node)[1], f"pod veths left: {sorted(node_links(node)[1])}"
    assert log.count("freed stale lease") == 3 and "node rebooted" in log, log
    for p in pods:
        assert p.cid in log, f"log does not mention freed {p.cid}"
    assert (node.root / "var/lib/nodeplane/boot_id").read_text().strip() == "boot-2"
    # The node works afterwards.
    pod, res = node.add_pod("after")
    check_pods_kernel([(pod, res)])
    cni_ok(node, "DEL", pod)
    assert_clean(node)


def test_reboot_with_namespaces_kept_frees_leases_then_restart_keeps(node):
    added = [node.add_pod(f"k{i}") for i in range(3)]
    node.kill9()
    node.boot_id_file.write_text("boot-2\n")   # boot id wins over namespaces that still exist
    offset = start_agent(node)
    log = log_since(node, offset)
    assert node.leases() == {}, f"leases survived a reboot: {sorted(node.leases())}"
    assert sorted(p.name for p in node.lease_dir.iterdir()) == []
    assert log.count("freed stale lease") == 3 and "node rebooted" in log, log
    assert node.wait_no_graveyard()
    assert not node_links(node)[1], f"pod veths left after reboot: {sorted(node_links(node)[1])}"
    for p, _ in added:
        assert "eth0" not in p.ns.links(), f"{p.cid}: pod interface left after reboot"

    # The runtime re-creates the pods: same ids, same namespaces.
    readded = [(p, cni_ok(node, "ADD", p)) for p, _ in added]
    check_pods_kernel(readded)
    # A plain crash/restart (same boot) keeps everything.
    node.kill9()
    offset = start_agent(node)
    log = log_since(node, offset)
    by_cid = assert_consistent(node)
    assert set(by_cid) == {p.cid for p, _ in readded}
    assert "freed stale lease" not in log and "kept=3" in log, log
    check_pods_kernel(readded)
    for p, _ in readded:
        cni_ok(node, "DEL", p)
    assert_clean(node)


# ----- 4. pod netns gone while the agent was down (no reboot) -----

def test_netns_gone_without_reboot(node):
    (a, ra), (b, rb), (c, rc_) = node.add_pod("ga"), node.add_pod("gb"), node.add_pod("gc")
    node.kill9()
    a.ns.delete()
    # c: its namespace is deleted and a new one made at the same path, where (to rule out
    # every other clue) a veth of the old name appears again: only the inode tells them apart.
    # nsfs inode numbers are recycled, so insist on a new one (see the report on recycling).
    old_ino = os.stat(c.ns.path).st_ino
    c.ns.delete()
    deadline = time.time() + 10
    while host_ifname(c.cid) in node.ns.links() and time.time() < deadline:
        time.sleep(0.02)
    for _ in range(20):
        harness.run(["ip", "netns", "add", c.ns.name])
        if os.stat(c.ns.path).st_ino != old_ino:
            break
        c.ns.delete()
    assert os.stat(c.ns.path).st_ino != old_ino, "could not get a namespace with a new inode"
    harness.run(["ip", "-n", node.ns.name, "link", "add", host_ifname(c.cid), "type", "veth", "peer", "name", "eth0", "netns", c.ns.name])
    harness.run(["ip", "-n", node.ns.name, "link", "set", host_ifname(c.cid), "master", "np0", "up"])

    offset = start_agent(node)
    log = log_since(node, offset)
    by_cid = assert_consistent(node)
    assert set(by_cid) == {b.cid}, f"expected only {b.cid} kept, have {sorted(by_cid)}"
    assert log.count("pod network namespace is gone") == 2, log
    assert a.cid in log and c.cid in log
    assert node.wait_no_graveyard()
    assert "eth0" not in c.ns.links(), "stale veth in the re-created namespace survived"
    check_pods_kernel([(b, rb)])
    # The runtime cleans up the vanished pods (DEL is idempotent; a's netns path is gone),
    # then the last one.
    for p in (a, c, b):
        rc, _, raw = node.cni("DEL", p.cid, "eth0", p.ns.path, conf=node.netconf())
        assert rc == 0, raw
    assert_clean(node)


def test_same_inode_new_namespace_is_told_apart_by_cookie(node):
    """nsfs inode numbers are reused once a namespace dies, so the lease also records the
    namespace cookie (never reused). CHECK compares the namespace the shim passes (by
    descriptor) with both: a namespace with the recorded inode but another cookie is not the
    attachment's. Simulated exactly by changing the recorded cookie. On a kernel without
    SO_NETNS_COOKIE (before 5.14) the recorded cookie is 0 and only the inode is compared; the
    changed cookie (1) still differs from the namespace's (0) and is refused alike."""
    (a, ra), (b, rb) = node.add_pod("ka"), node.add_pod("kb")
    leases = node.leases()
    for lease in leases.values():
        assert harness.cookie_as_the_kernel_gives(lease["netnsCookie"]), lease
        assert lease["netnsInode"] == os.stat(lease["netns"]).st_ino
        assert lease["hostIfindex"] != 0, lease
    if harness.NETNS_COOKIE:
        assert len({l["netnsCookie"] for l in leases.values()}) == 2
    node.kill9()
    path = node.lease_dir / f"{a.cid}:eth0.json"
    lease = json.loads(path.read_text())
    lease["netnsCookie"] += 1
    path.write_text(json.dumps(lease))
    start_agent(node)
    # The restart judges leases by their host veth (the runtime's netns path is never
    # resolved by the agent): both are kept.
    assert set(assert_consistent(node)) == {a.cid, b.cid}
    rc, err, raw = node.cni("CHECK", a.cid, "eth0", a.ns.path, conf=dict(node.netconf(), prevResult=ra))
    assert rc != 0 and "is not the one" in err["msg"], raw
    rc, _, raw = node.cni("CHECK", b.cid, "eth0", b.ns.path, conf=dict(node.netconf(), prevResult=rb))
    assert rc == 0, raw
    check_pods_kernel([(b, rb)])
    for p in (a, b):
        rc, _, raw = node.cni("DEL", p.cid, "eth0", p.ns.path, conf=node.netconf())
        assert rc == 0, raw
    assert_clean(node)


# ----- 5. every error code from real bad input -----

ERROR_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["cniVersion", "code", "msg"],
    "additionalProperties": False,
    "properties": {
        "cniVersion": {"enum": VERSIONS},
        "code": {"type": "integer", "minimum": 1},
        "msg": {"type": "string", "minLength": 1},
        "details": {"type": "string"},
    },
}


def test_error_codes_from_bad_input(node):
    pod = harness.Pod(node, "e")
    node.pods.append(pod)
    conf = node.netconf("1.1.0")  # STATUS and GC exist from 1.1.0 on (the conflist may say less)
    big = dict(conf, padding="x" * MAX_CONFIG_BYTES)
    regular_file = node.root / "not-a-netns"
    regular_file.write_text("")
    missing = str(node.root / "no-such-netns")
    prev = {"cniVersion": "1.1.0", "interfaces": [{"name": "eth0", "sandbox": pod.ns.path}],
            "ips": [{"address": "10.255.255.9/24", "interface": 0}]}
    ns = pod.ns.path
    cid = pod.cid
    cases = [
        # (label, code, words the msg must contain, cni() kwargs)
        ("malformed JSON", 6, ["network configuration"], dict(command="ADD", container_id=cid, netns=ns, stdin='{"cniVersion": "1.1.0",')),
        ("config is a list", 6, ["network configuration", "object"], dict(command="ADD", container_id=cid, netns=ns, stdin="[1, 2]")),
        ("config is a string", 6, ["network configuration", "object"], dict(command="ADD", container_id=cid, netns=ns, stdin='"nodeplane"')),
        ("stdin > 1 MiB", 6, ["network configuration", str(MAX_CONFIG_BYTES)], dict(command="ADD", container_id=cid, netns=ns, stdin=json.dumps(big))),
        ("mtu too small", 7, ["mtu"], dict(command="ADD", container_id=cid, netns=ns, conf=dict(conf, mtu=10))),
        ("mtu not a number", 7, ["mtu"], dict(command="ADD", container_id=cid, netns=ns, conf=dict(conf, mtu="1500"))),
        ("wrong type", 7, ["type"], dict(command="ADD", container_id=cid, netns=ns, conf=dict(conf, type="bridge"))),
        ("missing name", 7, ["name"], dict(command="ADD", container_id=cid, netns=ns, conf={k: v for k, v in conf.items() if k != "name"})),
        ("missing cniVersion", 7, ["cniVersion"], dict(command="ADD", container_id=cid, netns=ns, conf={k: v for k, v in conf.items() if k != "cniVersion"})),
        ("bad mtu, 0.4.0", 7, ["mtu"], dict(command="ADD", container_id=cid, netns=ns, conf=dict(conf, cniVersion="0.4.0", mtu=70000))),
        ("GC without valid-attachments", 7, ["valid-attachments"], dict(command="GC", ifname="", conf=conf)),
        ("CHECK without prevResult", 7, ["prevResult"], dict(command="CHECK", container_id=cid, netns=ns, conf=conf)),
        ("cniVersion 9.9.9", 1, ["cniVersion", "9.9.9"], dict(command="ADD", container_id=cid, netns=ns, conf=dict(conf, cniVersion="9.9.9"))),
        ("cniVersion 0.2.0", 1, ["cniVersion", "0.2.0"], dict(command="ADD", container_id=cid, netns=ns, conf=dict(conf, cniVersion="0.2.0"))),
        ("CHECK with 0.3.1", 1, ["CHECK", "0.3.1"], dict(command="CHECK", container_id=cid, netns=ns, conf=dict(conf, cniVersion="0.3.1", prevResult=prev))),
        ("GC with 1.0.0", 1, ["GC", "1.0.0"], dict(command="GC", ifname="", conf=dict(conf, cniVersion="1.0.0", **{"cni.dev/valid-attachments": []}))),
        ("STATUS with 1.0.0", 1, ["STATUS", "1.0.0"], dict(command="STATUS", ifname="", conf=dict(conf, cniVersion="1.0.0"))),
        ("no CNI_COMMAND", 4, ["CNI_COMMAND"], dict(command="ADD", container_id=cid, netns=ns, conf=conf, env={"CNI_COMMAND": None})),
        ("unknown CNI_COMMAND", 4, ["CNI_COMMAND", "FROB"], dict(command="FROB", container_id=cid, netns=ns, conf=conf)),
        ("no CNI_CONTAINERID", 4, ["CNI_CONTAINERID"], dict(command="ADD", netns=ns, conf=conf)),
        ("bad CNI_CONTAINERID", 4, ["CNI_CONTAINERID"], dict(command="ADD", container_id="-bad/id", netns=ns, conf=conf)),
        ("no CNI_IFNAME", 4, ["CNI_IFNAME"], dict(command="ADD", container_id=cid, ifname="", netns=ns, conf=conf)),
        ("no CNI_IFNAME on DEL", 4, ["CNI_IFNAME"], dict(command="DEL", container_id=cid, ifname="", netns=ns, conf=conf)),
        ("no CNI_NETNS on ADD", 4, ["CNI_NETNS"], dict(command="ADD", container_id=cid, conf=conf)),
        ("CNI_IFNAME with /", 4, ["CNI_IFNAME"], dict(command="ADD", container_id=cid, ifname="eth/0", netns=ns, conf=conf)),
        ("CNI_IFNAME of 16 bytes", 4, ["CNI_IFNAME"], dict(command="ADD", container_id=cid, ifname="a" * 16, netns=ns, conf=conf)),
        ("CNI_IFNAME '.'", 4, ["CNI_IFNAME"], dict(command="ADD", container_id=cid, ifname=".", netns=ns, conf=conf)),
        ("CNI_NETNS relative", 4, ["CNI_NETNS"], dict(command="ADD", container_id=cid, netns="var/run/netns/x", conf=conf)),
        ("CNI_NETNS regular file", 4, ["CNI_NETNS", str(regular_file)], dict(command="ADD", container_id=cid, netns=str(regular_file), conf=conf)),
        ("CNI_NETNS directory", 4, ["CNI_NETNS"], dict(command="ADD", container_id=cid, netns=str(node.root), conf=conf)),
        ("CNI_NETNS other ns type", 4, ["CNI_NETNS"], dict(command="ADD", container_id=cid, netns="/proc/self/ns/uts", conf=conf)),
        ("CNI_NETNS nonexistent", 4, ["CNI_NETNS", missing], dict(command="ADD", container_id=cid, netns=missing, conf=conf)),
        ("CNI_ARGS malformed", 4, ["CNI_ARGS"], dict(command="ADD", container_id=cid, netns=ns, conf=conf, env={"CNI_ARGS": "K8S_POD_NAME"})),
        ("CHECK unknown container", 3, [cid], dict(command="CHECK", container_id=cid, netns=ns, conf=dict(conf, prevResult=prev))),
    ]
    problems = []

    def run_case(label, code, words, kw, version=None):
        rc, out, raw = node.cni(**kw)
        where = f"{label}: rc={rc} stdout={raw.strip()[:300]!r}"
        if rc == 0:
            return problems.append(f"{where}: succeeded")
        try:
            jsonschema.validate(out, ERROR_SCHEMA)
        except jsonschema.ValidationError as e:
            return problems.append(f"{where}: not a CNI error object: {e.message}")
        if out["code"] != code:
            problems.append(f"{where}: code {out['code']}, want {code}")
        for w in words:
            if w.lower() not in out["msg"].lower():
                problems.append(f"{where}: msg does not name {w!r}")
        if version and out["cniVersion"] != version:
            problems.append(f"{where}: error cniVersion {out['cniVersion']}, config said {version}")

    for label, code, words, kw in cases:
        v = (kw.get("conf") or {}).get("cniVersion")
        run_case(label, code, words, kw, v if v in VERSIONS else None)

    # A config of exactly the limit is still accepted (boundary of the 1 MiB rule).
    at_limit = json.dumps(conf)
    at_limit = at_limit[:-1] + " " * (MAX_CONFIG_BYTES - len(at_limit)) + "}"
    assert len(at_limit.encode()) == MAX_CONFIG_BYTES
    rc, res, raw = node.cni("ADD", cid, "eth0", ns, stdin=at_limit)
    if rc != 0:
        problems.append(f"config of exactly {MAX_CONFIG_BYTES} bytes refused: {raw[:300]}")
    else:
        # A second ADD of the same attachment is refused (100) and leaves the first intact.
        # The msg names the attachment and its address (as an address, not a Rust Debug dump).
        run_case("ADD twice", 100, [cid, res["ips"][0]["address"]], dict(command="ADD", container_id=cid, netns=ns, conf=conf))
        if set(assert_consistent(node)) != {cid}:
            problems.append("second ADD disturbed the first attachment")
        rc, _, raw = node.cni("DEL", cid, "eth0", ns, stdin=at_limit)
        if rc != 0:
            problems.append(f"DEL with a config at the limit failed: {raw[:300]}")

    # Agent down: ADD/CHECK/GC say "try again later", STATUS "not available"; DEL is queued.
    node.kill9()
    down = [
        ("agent down: ADD", 11, ["not reachable"], dict(command="ADD", container_id=cid, netns=ns, conf=conf)),
        ("agent down: CHECK", 11, ["not reachable"], dict(command="CHECK", container_id=cid, netns=ns, conf=dict(conf, prevResult=prev))),
        ("agent down: GC", 11, ["not reachable"], dict(command="GC", ifname="", conf=dict(conf, **{"cni.dev/valid-attachments": []}))),
        ("agent down: STATUS", 50, ["not reachable"], dict(command="STATUS", ifname="", conf=conf)),
    ]
    for label, code, words, kw in down:
        run_case(label, code, words, kw, conf["cniVersion"])
    rc, _, raw = node.cni("DEL", cid, "eth0", ns, conf=conf)
    if rc != 0:
        problems.append(f"agent down: DEL not queued: {raw}")
    if not list(node.pending_dir.glob("del-*.json")):
        problems.append("agent down: DEL returned 0 but nothing was queued")
    start_agent(node)

    # Bad input leaks nothing (and the queued DEL was drained).
    try:
        assert_clean(node)
        assert "eth0" not in pod.ns.links(), "pod interface left"
    except AssertionError as e:
        problems.append(f"leak after bad input: {e}")
    assert not problems, "\n".join(problems)


# ----- 6. results of every version: JSON Schema from the spec, and a real peer -----

SEMVER = r"^\d+\.\d+\.\d+$"
STR = {"type": "string"}
STR_LIST = {"type": "array", "items": STR}
UINT = {"type": "integer", "minimum": 0}


def result_schema(version):
    """Result of a (main, interface-creating) plugin's ADD, per the CNI spec of `version`.

    0.3.0-0.4.0: ips[].version ("4"/"6") is required. 1.0.0 removed it. 1.1.0 added
    interfaces[].mtu/socketPath/pciID and routes[].mtu/advmss/priority/table/scope.
    The spec lists every key of these objects, so unknown keys are refused."""
    legacy = version in ("0.3.0", "0.3.1", "0.4.0")
    v110 = version == "1.1.0"
    iface = {"name": STR, "mac": STR, "sandbox": STR}
    route = {"dst": STR, "gw": STR}
    ip = {"address": STR, "gateway": STR, "interface": UINT}
    ip_required = ["address"]
    if legacy:
        ip["version"] = {"enum": ["4", "6"]}
        ip_required.append("version")
    if v110:
        iface.update(mtu=UINT, socketPath=STR, pciID=STR)
        route.update(mtu=UINT, advmss=UINT, priority=UINT, table=UINT, scope=UINT)
    obj = lambda props, required: {"type": "object", "properties": props, "required": required, "additionalProperties": False}  # noqa: E731
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **obj({
            "cniVersion": {"const": version},
            "interfaces": {"type": "array", "items": obj(iface, ["name"])},
            "ips": {"type": "array", "items": obj(ip, ip_required)},
            "routes": {"type": "array", "items": obj(route, ["dst"])},
            "dns": obj({"nameservers": STR_LIST, "domain": STR, "search": STR_LIST, "options": STR_LIST}, []),
        }, ["cniVersion", "interfaces", "ips"]),
    }


VERSION_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["cniVersion", "supportedVersions"],
    "additionalProperties": False,
    "properties": {
        "cniVersion": {"type": "string", "pattern": SEMVER},
        "supportedVersions": {"type": "array", "items": {"type": "string", "pattern": SEMVER}, "uniqueItems": True},
    },
}


def semantic_problems(res, version, pod):
    """What JSON Schema cannot say: addresses parse and agree with their family, indexes point
    at the container interface, MACs are MACs."""
    out = []
    legacy = version in ("0.3.0", "0.3.1", "0.4.0")
    ifs = res["interfaces"]
    for i, itf in enumerate(ifs):
        if not re.fullmatch(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}", itf.get("mac", "")):
            out.append(f"interfaces[{i}].mac {itf.get('mac')!r} (veths have MACs: required)")
    sandboxed = [i for i, itf in enumerate(ifs) if itf.get("sandbox")]
    if [ifs[i]["name"] for i in sandboxed] != ["eth0"] or ifs[sandboxed[0]]["sandbox"] != pod.ns.path:
        out.append(f"sandbox interfaces {[(ifs[i]['name'], ifs[i]['sandbox']) for i in sandboxed]}")
    families = set()
    for i, ip in enumerate(res["ips"]):
        addr = ipaddress.ip_interface(ip["address"])
        families.add(addr.version)
        if "gateway" in ip and ipaddress.ip_address(ip["gateway"]).version != addr.version:
            out.append(f"ips[{i}].gateway family")
        if legacy and ip["version"] != str(addr.version):
            out.append(f"ips[{i}].version {ip['version']} for {addr}")
        if ip.get("interface") not in sandboxed:
            out.append(f"ips[{i}].interface {ip.get('interface')} is not the container interface")
    if families != {4, 6}:
        out.append(f"address families {families}")
    for i, r in enumerate(res.get("routes", [])):
        dst = ipaddress.ip_network(r["dst"])
        if "gw" in r and ipaddress.ip_address(r["gw"]).version != dst.version:
            out.append(f"routes[{i}] mixes families")
    for ns in res.get("dns", {}).get("nameservers", []):
        ipaddress.ip_address(ns)
    return out


def shape(res):
    """Version-independent content of a result, for comparing ours with a peer's rendering."""
    return {
        "interfaces": [(i["name"], i.get("mac", "").lower(), i.get("sandbox", "")) for i in res.get("interfaces", [])],
        "ips": [(str(ipaddress.ip_interface(i["address"])), i.get("gateway"), i.get("interface")) for i in res.get("ips", [])],
        "routes": [(str(ipaddress.ip_network(r["dst"])), r.get("gw")) for r in res.get("routes", [])],
        "dns": {k: v for k, v in (res.get("dns") or {}).items() if v},
    }


def run_tuning(cmd, pod, conf):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CNI_COMMAND": cmd, "CNI_CONTAINERID": pod.cid,
           "CNI_NETNS": pod.ns.path, "CNI_IFNAME": "eth0", "CNI_PATH": str(harness.REF_CNI_DIR),
           "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web"}
    r = subprocess.run([str(TUNING)], input=json.dumps(conf).encode(), env=env, capture_output=True, timeout=30)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


def test_results_match_spec_schema_and_reference_peer(node):
    for v in VERSIONS:
        jsonschema.Draft202012Validator.check_schema(result_schema(v))
    jsonschema.Draft202012Validator.check_schema(VERSION_SCHEMA)

    # VERSION, with and without a requested version.
    for stdin, want in (("", None), ('{"cniVersion": "0.4.0"}', "0.4.0"), ('{"cniVersion": "1.1.0"}', "1.1.0")):
        rc, out, raw = node.cni("VERSION", ifname="", stdin=stdin)
        assert rc == 0, raw
        jsonschema.validate(out, VERSION_SCHEMA)
        assert set(VERSIONS) <= set(out["supportedVersions"]), out
        assert out["cniVersion"] in VERSIONS and (want is None or out["cniVersion"] == want), out

    ver = subprocess.run([str(TUNING)], env={"CNI_COMMAND": "VERSION"}, input=b"", capture_output=True, timeout=30)
    peer_versions = set(json.loads(ver.stdout)["supportedVersions"])
    peer_checked = []
    problems = []
    added = []
    for v in VERSIONS:
        pod, res = node.add_pod(f"v{v.replace('.', '')}-", version=v)
        added.append(pod)
        try:
            jsonschema.validate(res, result_schema(v))
        except jsonschema.ValidationError as e:
            problems.append(f"{v}: result does not match the {v} schema: {e.message} at {list(e.absolute_path)}")
        problems += [f"{v}: {p}" for p in semantic_problems(res, v, pod)]
        # Our own CHECK accepts our own result (CHECK exists from 0.4.0 on).
        if v not in ("0.3.0", "0.3.1"):
            rc, _, raw = node.cni("CHECK", pod.cid, "eth0", pod.ns.path, conf=node.netconf(v, prevResult=res))
            if rc != 0:
                problems.append(f"{v}: our CHECK rejects our own result: {raw}")

        if v not in peer_versions:
            continue
        # The reference tuning plugin, chained after us: it must parse our result (prevResult),
        # act in the pod namespace, and pass the result on unchanged.
        peer_checked.append(v)
        tconf = {"cniVersion": v, "name": node.netconf()["name"], "type": "tuning",
                 "sysctl": {"net.ipv4.conf.eth0.arp_notify": "1"}, "prevResult": res}
        rc, out, err = run_tuning("ADD", pod, tconf)
        if rc != 0:
            problems.append(f"{v}: tuning ADD rejects our result: {out} {err}")
            continue
        chained = json.loads(out)
        if shape(chained) != shape(res):
            problems.append(f"{v}: tuning's re-rendering of our result differs:\n ours   {shape(res)}\n tuning {shape(chained)}")
        try:
            jsonschema.validate(chained, result_schema(v))  # the schema accepts the reference's own output
        except jsonschema.ValidationError as e:
            problems.append(f"{v}: reference output fails our {v} schema (schema bug?): {e.message}")
        val = pod.ns.exec(["cat", "/proc/sys/net/ipv4/conf/eth0/arp_notify"]).stdout.strip()
        if val != "1":
            problems.append(f"{v}: tuning did not act in the pod namespace (arp_notify={val})")
        if v not in ("0.3.0", "0.3.1"):
            rc, out, err = run_tuning("CHECK", pod, dict(tconf, prevResult=chained))
            if rc != 0:
                problems.append(f"{v}: tuning CHECK rejects the chained result: {out} {err}")
            # ... and our CHECK accepts the chain's final result as rendered by the peer.
            rc, _, raw = node.cni("CHECK", pod.cid, "eth0", pod.ns.path, conf=node.netconf(v, prevResult=chained))
            if rc != 0:
                problems.append(f"{v}: our CHECK rejects the chain result rendered by tuning: {raw}")

    print(f"reference tuning supports {sorted(peer_versions)}; checked {peer_checked} against it")
    assert {"0.3.0", "0.3.1", "0.4.0", "1.0.0"} <= set(peer_checked), peer_checked
    assert not problems, "\n".join(problems)
    for pod in added:
        cni_ok(node, "DEL", pod)
    assert_clean(node)
