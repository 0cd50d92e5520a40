"""Agent restarts, crashes and upgrades under traffic, and the explicit uninstall path.

Issue requirement: running pods, mounts and device assignments are untouched by an agent
restart or upgrade. The datapath (veths, bridge, routes, nftables), the mounts and the loop
devices are kernel state; the agent is not on the packet or I/O path, so a restart must cost
the pods nothing: no lost ping, no I/O error, no changed mount, no leaked or duplicated veth or
lease. The shim and the conflist stay installed across a restart (the node never turns
NotReady), are replaced atomically by a new version, and go away only through
`nodeplane-agent uninstall`, which refuses while an agent runs.

Everything runs in namespaces and directories this test makes (harness / cluster), as root.
"""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import cluster
import harness

MIB = 1 << 20
LATEST = "1.1.0"


# ----- helpers -----


wait_until = harness.wait_until


def agent_cli(*args, env=None, cwd=None, binary=None):
    """Run `nodeplane-agent ARGS` (an operator command, not the daemon)."""
    e = dict(os.environ)
    for k in ("NODE_NAME", "NODE_IPS", "NODEPLANE_CONTROLLER_ADDRESS"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([str(binary or harness.AGENT_BIN), *map(str, args)], capture_output=True, text=True,
                          timeout=60, env=e, cwd=cwd)


def start_agent(node, binary):
    """Like Node.start, with another agent binary (an upgrade)."""
    node.log_offset = node.log_path.stat().st_size if node.log_path.exists() else 0
    log = open(node.log_path, "a")
    node.proc = subprocess.Popen(
        ["nsenter", f"--net={node.ns.path}", str(binary), "--config", str(node.cfg_path)],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL,
    )
    node.wait_ready()


def check_conf(node, result):
    conf = node.netconf(LATEST)
    conf["prevResult"] = result
    return conf


def host_if_of(result):
    return result["interfaces"][1]["name"]


def mount_entries(paths, mountinfo="/proc/self/mountinfo"):
    """mount point -> (mount id, major:minor, root, fs type, source) for the given paths."""
    want = {str(p) for p in paths}
    out = {}
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            mp = fields[4].replace("\\040", " ")
            if mp in want:
                sep = fields.index("-")
                out[mp] = (fields[0], fields[2], fields[3], fields[sep + 1], fields[sep + 2])
    return out


class Pinger:
    """`ping -i 0.02` from a pod namespace for the whole window; counts replies by sequence."""

    def __init__(self, pod_ns, dst):
        self.dst = dst
        self.proc = subprocess.Popen(["ip", "netns", "exec", pod_ns.name, "ping", "-n", "-D", "-i", "0.02", "-W", "1", dst],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.t0 = time.monotonic()

    def stop(self):
        """SIGINT (ping prints its summary); returns (sent, received, lost, missing seqs)."""
        self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate(timeout=10)
        self.seconds = time.monotonic() - self.t0
        self.output = out
        seqs = [int(m) for m in re.findall(r"icmp_seq=(\d+) ", out)]
        m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
        assert m, f"no ping summary: {out[-2000:]}"
        sent, received = int(m.group(1)), int(m.group(2))
        # Every request must have been answered, except the very last one, which may still be
        # in flight when ping is stopped.
        missing = sorted(set(range(1, sent)) - set(seqs))
        self.figures = (sent, received, len(missing), missing[:20])
        return self.figures


class Writer(threading.Thread):
    """Appends numbered 4 KiB records to a file on the published volume (fsync every 16)."""

    REC = 4096

    def __init__(self, path):
        super().__init__(daemon=True)
        self.path = path
        self.halt = threading.Event()
        self.errors = []
        self.records = 0

    @classmethod
    def record(cls, i):
        head = f"rec {i:010d} ".encode()
        return head + bytes([i % 251]) * (cls.REC - len(head))

    def run(self):
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            self.errors.append(f"open: {e}")
            return
        try:
            while not self.halt.is_set():
                try:
                    os.write(fd, self.record(self.records))
                    self.records += 1
                    if self.records % 16 == 0:
                        os.fsync(fd)
                except OSError as e:
                    self.errors.append(f"record {self.records}: {e}")
                    return
                time.sleep(0.002)
            os.fsync(fd)
        finally:
            os.close(fd)

    def verify(self):
        data = Path(self.path).read_bytes()
        assert len(data) == self.records * self.REC, f"{len(data)} bytes on the volume, {self.records} records written"
        for i in range(self.records):
            assert data[i * self.REC:(i + 1) * self.REC] == self.record(i), f"record {i} reads back wrong"
        return len(data)


class FilePoller(threading.Thread):
    """Reads files in a tight loop and records every read that found one missing or not
    one of its allowed contents (a partial write)."""

    def __init__(self, checks):
        super().__init__(daemon=True)
        self.checks = checks  # path -> predicate(bytes) -> bool
        self.halt = threading.Event()
        self.polls = 0
        self.missing = []
        self.bad = []

    def run(self):
        while not self.halt.is_set():
            for path, ok in self.checks.items():
                try:
                    data = Path(path).read_bytes()
                except FileNotFoundError:
                    self.missing.append((time.monotonic(), str(path)))
                    continue
                if not ok(data):
                    self.bad.append((time.monotonic(), str(path), len(data)))
            self.polls += 1
            time.sleep(0.001)


def one_of(*contents):
    allowed = set(contents)
    return lambda data: data in allowed


def json_equal(obj):
    def ok(data):
        try:
            return json.loads(data) == obj
        except ValueError:
            return False
    return ok


# ----- uninstall and check-config, with the real binary -----


def test_uninstall_refused_while_running_then_removes_only_ours(node):
    shim = node.bin_dir / "nodeplane"
    conflist = node.conflist_path
    a, _ = node.add_pod("keep")
    b, _ = node.add_pod("keep")
    shim_bytes, conflist_bytes = shim.read_bytes(), conflist.read_bytes()
    assert shim_bytes == harness.SHIM_BIN.read_bytes()

    # While the agent runs: refused, nothing removed.
    r = agent_cli("uninstall", "--config", node.cfg_path)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "an agent is running" in r.stderr and "stop it first" in r.stderr, r.stderr
    assert shim.read_bytes() == shim_bytes and conflist.read_bytes() == conflist_bytes
    # Not even with --force.
    r = agent_cli("uninstall", "--config", node.cfg_path, "--force")
    assert r.returncode == 3 and "an agent is running" in r.stderr, r.stderr

    # SIGTERM leaves the shim and the conflist in place (a rollout must not make the node
    # NotReady); so does SIGKILL.
    node.stop()
    assert shim.read_bytes() == shim_bytes and conflist.read_bytes() == conflist_bytes
    node.start()
    node.kill9()
    assert shim.read_bytes() == shim_bytes and conflist.read_bytes() == conflist_bytes

    # Agent gone, but two pods still have their network: their DEL will need the shim, so
    # uninstall refuses (nothing removed) unless forced.
    r = agent_cli("uninstall", "--config", node.cfg_path)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert "2 pod(s) still have nodeplane networking" in r.stderr and "--force" in r.stderr, r.stderr
    assert shim.read_bytes() == shim_bytes and conflist.read_bytes() == conflist_bytes

    # Forced: removed, conflist first then shim, and said so.
    r = agent_cli("uninstall", "--config", node.cfg_path, "--force")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"conflist {conflist}: removed" in r.stdout and f"shim {shim}: removed" in r.stdout, r.stdout
    assert not conflist.exists() and not shim.exists()
    assert node.bin_dir.is_dir() and conflist.parent.is_dir()
    # Running pods keep their network (kernel state): they still reach each other.
    assert a.ns.ping(b.ip4()) and a.ns.ping(b.ip6()), "pods lost their network on uninstall"
    assert len(node.leases()) == 2, "uninstall does not touch leases"

    # Idempotent.
    r = agent_cli("uninstall", "--config", node.cfg_path, "--force")
    assert r.returncode == 0 and "already uninstalled" in r.stdout, (r.stdout, r.stderr)

    # Someone else's files at our paths: refused (exit 3, nothing removed) unless --force.
    foreign = {"cniVersion": "1.0.0", "name": "othernet", "plugins": [{"type": "bridge"}]}
    conflist.write_text(json.dumps(foreign))
    shim.write_bytes(shim_bytes)
    r = agent_cli("uninstall", "--config", node.cfg_path)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "not nodeplane's" in r.stderr and "--force" in r.stderr and str(conflist) in r.stderr, r.stderr
    assert conflist.exists() and shim.exists(), "a refusal removes nothing"
    conflist.write_bytes(conflist_bytes)
    shim.write_bytes(b"#!/bin/sh\nexit 0\n")
    r = agent_cli("uninstall", "--config", node.cfg_path)
    assert r.returncode == 3 and str(shim) in r.stderr, (r.stdout, r.stderr)
    assert conflist.exists() and shim.exists()
    r = agent_cli("uninstall", "--config", node.cfg_path, "--force")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "--force" in r.stdout and "not nodeplane's" in r.stdout, r.stdout
    assert not conflist.exists() and not shim.exists()

    # The agent installs again when it starts, and pods it knew are still its own.
    node.start()
    assert shim.read_bytes() == shim_bytes and json.loads(conflist.read_text()) == json.loads(conflist_bytes)
    rc, _, raw = node.cni("CHECK", a.cid, "eth0", a.ns.path, conf=check_conf(node, a.result))
    assert rc == 0, raw


@pytest.fixture
def short_dir():
    """A short /tmp directory (socket paths in a configuration must fit 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX, dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_check_config_prints_the_resolved_configuration(short_dir):
    tmp_path = short_dir
    root = tmp_path / "root"
    cfg = {"nodeName": "cc-node", "root": str(root), "podCidrs": ["10.77.0.0/24"], "stateDir": "rel/state",
           "shimSource": str(harness.SHIM_BIN), "devicePlugins": {"cdiDir": str(tmp_path / "cdi")}}
    path = tmp_path / "agent.json"
    path.write_text(json.dumps(cfg))
    r = agent_cli("check-config", "--config", path, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["nodeName"] == "cc-node"
    assert out["cniBinDir"] == str(root / "opt/cni/bin")
    assert out["shimPath"] == str(root / "opt/cni/bin/nodeplane")
    assert out["cniConfDir"] == str(root / "etc/cni/net.d")
    assert out["conflistPath"] == str(root / "etc/cni/net.d/10-nodeplane.conflist")
    assert out["cniSocket"] == str(root / "run/nodeplane/cni.sock")
    assert out["nodeSocket"] == str(root / "run/nodeplane/node.sock")
    assert out["stateDir"] == str(tmp_path / "rel/state"), "relative paths are resolved as serve resolves them"
    assert out["kubeletDir"] == str(root / "var/lib/kubelet")
    assert out["shimSource"] == str(harness.SHIM_BIN)
    assert "healthAddress" in out
    assert out["csi"]["enabled"] is True and out["csi"]["volumeDir"] == str(tmp_path / "rel/state/volumes")
    assert out["devicePlugins"] == {"enabled": True, "configFile": str(root / "etc/nodeplane/devices.json"),
                                    "pluginDir": str(root / "var/lib/kubelet/device-plugins"),
                                    "cdiDir": str(tmp_path / "cdi")}
    assert out["controller"] is None
    assert not root.exists(), "check-config creates nothing"

    # Controller mode, with the environment fallbacks serve uses.
    ctl_cfg = {"root": str(root), "shimSource": str(harness.SHIM_BIN), "csi": {"enabled": False},
               "controller": {"tokenFile": "/etc/np/token"}}
    path.write_text(json.dumps(ctl_cfg))
    r = agent_cli("check-config", "--config", path,
                  env={"NODE_NAME": "from-env", "NODE_IPS": "198.19.9.9,fd19:9::9",
                       "NODEPLANE_CONTROLLER_ADDRESS": "unix:/run/np/controller.sock"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["nodeName"] == "from-env"
    assert out["controller"]["address"] == "unix:/run/np/controller.sock"
    assert out["controller"]["tokenFile"] == "/etc/np/token"
    assert out["controller"]["underlayAddresses"] == ["198.19.9.9", "fd19:9::9"]
    assert out["csi"] == {"enabled": False}

    # Bad configurations: exit 2 with the reason.
    path.write_text(json.dumps(dict(cfg, mtu=10)))
    r = agent_cli("check-config", "--config", path)
    assert r.returncode == 2 and "mtu" in r.stderr and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    r = agent_cli("check-config", "--config", tmp_path / "missing.json")
    assert r.returncode == 2 and "missing.json" in r.stderr, r.stderr
    path.write_text(json.dumps(ctl_cfg))
    r = agent_cli("check-config", "--config", path)
    assert r.returncode == 2 and "NODE_NAME" in r.stderr, r.stderr
    # Serving keeps both spellings; a missing --config is a usage error.
    r = agent_cli()
    assert r.returncode == 2 and "--config" in r.stderr, r.stderr


# ----- pods added while the agent stops -----


def test_add_sent_as_the_agent_stops_waits_for_the_new_one(node):
    """A runtime may send ADD at any instant of a rollout, also in the few milliseconds while
    the old agent is shutting down (SIGTERM) or dying (SIGKILL). The shim must then wait for
    the new agent (agentWaitSeconds) like it does when the socket is gone, not fail."""
    results = []
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM, signal.SIGKILL):
        pod = harness.Pod(node, "stop")
        node.pods.append(pod)
        out = {}

        def add(pod=pod, out=out):
            out["r"] = node.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=node.netconf(agentWaitSeconds=10))

        node.proc.send_signal(sig)
        adder = threading.Thread(target=add)
        adder.start()
        node.proc.wait(timeout=30)
        node.start()
        adder.join(30)
        rc, res, raw = out["r"]
        results.append((sig.name, rc, raw.strip()[:200]))
        if rc == 0:
            pod.result = res
    failed = [r for r in results if r[1] != 0]
    assert failed == [], f"ADDs sent while the agent stopped failed instead of waiting: {failed}"
    assert len(node.leases()) == len(results)


# ----- the node bridge's MAC (the gateway every pod has cached) -----


def test_bridge_mac_is_stable_while_pods_come_and_go(node):
    """Every pod caches the gateway's MAC (the node bridge's). A Linux bridge without an
    assigned MAC takes the lowest MAC of its ports, so adding or deleting a pod can change it;
    pods then send to a MAC the bridge no longer answers and lose traffic until their
    neighbour entry is re-resolved. The bridge's MAC must stay fixed, and the results must
    report the real one."""
    pa, ra = node.add_pod("gwmac")
    gw4 = ra["ips"][0]["gateway"]
    bridge_mac = lambda: node.ns.ip_json("link", "show", "np0")[0]["address"]
    before = bridge_mac()
    wrong_in_results = []
    if ra["interfaces"][0]["mac"] != before:
        wrong_in_results.append((ra["interfaces"][0]["mac"], before))
    pinger = Pinger(pa.ns, gw4)
    try:
        seen, pods = {before}, []
        for i in range(8):
            p, r = node.add_pod("gwmac")
            pods.append(p)
            now = bridge_mac()
            seen.add(now)
            if r["interfaces"][0]["mac"] != now:
                wrong_in_results.append((r["interfaces"][0]["mac"], now))
            time.sleep(0.1)
        for p in pods[:4]:
            rc, _, raw = node.cni("DEL", p.cid, "eth0", p.ns.path, conf=node.netconf())
            assert rc == 0, raw
            seen.add(bridge_mac())
        time.sleep(0.3)
    finally:
        sent, received, lost, missing = pinger.stop()
    print(f"\n  bridge MACs seen: {len(seen)}; pod -> gateway pings: sent {sent}, lost {lost}; "
          f"results with a stale bridge MAC: {len(wrong_in_results)} of 9")
    problems = []
    if seen != {before}:
        problems.append(f"the bridge MAC changed as pods came and went: {before} -> {sorted(seen - {before})}")
    if lost:
        problems.append(f"pod -> gateway: {lost} of {sent} pings lost: {missing}")
    if wrong_in_results:
        problems.append(f"results report a bridge MAC that is not the bridge's (reported, actual): {wrong_in_results}")
    assert problems == [], "\n".join(problems)


# ----- restart, crash and upgrade under traffic -----


def make_devices(node, name="rolldev", count=2):
    """Device nodes (character devices with /dev/null's numbers) and a devices file serving
    them as nodeplane.dev/<name> with a CDI spec. Returns (cdi spec path, plugin socket)."""
    dev = node.root / "dev"
    dev.mkdir()
    for i in range(count):
        os.mknod(dev / f"{name}{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    conf = node.root / "etc/nodeplane/devices.json"
    conf.parent.mkdir(parents=True)
    conf.write_text(json.dumps({"resources": [{"name": name, "devices": [f"{dev}/{name}*"], "cdi": True}]}))
    return node.root / f"var/run/cdi/nodeplane.dev-{name}.json", node.kubelet / f"device-plugins/nodeplane-{name}.sock"


def test_restart_crash_and_upgrade_under_traffic():
    t_test = time.monotonic()
    c = cluster.Cluster()
    pingers, writer, poller = [], None, None
    try:
        a = c.node(1, 1, ipv6=True, start=False, csi={"capacityBytes": 512 * MIB})
        cdi_spec, dp_socket = make_devices(a)
        a.start()
        b = c.node(1, 2, ipv6=True)
        ctl = c.controller
        c.wait_connected([a], timeout=15)
        blocks_before = ctl.nodes()[a.ns.name]["blocks"]

        pa, _ = a.add_pod("pa")
        pb, _ = b.add_pod("pb")
        wait_until(lambda: pa.ns.ping(pb.ip4(), wait=1) and pb.ns.ping(pa.ip6(), wait=1), what="cross-node pings")

        # A volume on node A, staged and published through A's CSI socket.
        vid = ctl.csi("create-volume", "--name", "pvc-rollout", "--size", 256 * MIB, "--node", a.ns.name)["volumeId"]
        staging, target = a.staging_path(vid), a.target_path(vid)
        a.csi("stage", "--id", vid, "--staging", staging, "--fs", "ext4")
        a.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", "ext4")
        mounts_before = mount_entries([staging, target])
        assert set(mounts_before) == {str(staging), str(target)}, mounts_before
        loops_before = harness.loops_under(a.root)
        assert len(loops_before) == 1, loops_before

        # The device plugin: serving (socket) with its CDI spec written.
        wait_until(lambda: dp_socket.exists() and cdi_spec.exists(), what="device plugin socket and CDI spec")
        cdi_before = cdi_spec.read_bytes()
        assert [d["name"] for d in json.loads(cdi_before)["devices"]] == ["rolldev0", "rolldev1"], cdi_before

        # The upgrade: another copy of the agent binary next to a shim that differs.
        upgrade = a.root / "upgrade"
        upgrade.mkdir()
        new_agent = upgrade / "nodeplane-agent"
        shutil.copy2(harness.AGENT_BIN, new_agent)
        old_shim = harness.SHIM_BIN.read_bytes()
        new_shim = old_shim + b"\0nodeplane-upgrade"
        (upgrade / "nodeplane-cni").write_bytes(new_shim)
        os.chmod(upgrade / "nodeplane-cni", 0o755)
        installed_shim = a.bin_dir / "nodeplane"
        assert installed_shim.read_bytes() == old_shim
        conflist_obj = json.loads(a.conflist_path.read_text())

        # Traffic for the whole window: pings both ways across nodes (IPv4, IPv6), writes to
        # the volume, and a reader watching the installed files.
        pingers = [Pinger(pa.ns, pb.ip4()), Pinger(pb.ns, pa.ip6()), Pinger(pa.ns, pb.ip6())]
        writer = Writer(target / "rollout.log")
        writer.start()
        poller = FilePoller({installed_shim: one_of(old_shim, new_shim), a.conflist_path: json_equal(conflist_obj),
                             cdi_spec: one_of(cdi_before)})
        poller.start()
        time.sleep(0.5)

        bridge_mac = lambda: a.ns.ip_json("link", "show", "np0")[0]["address"]
        bridge_macs = [bridge_mac()]
        a_pods = [pa]
        figures = []
        events = [(time.time(), "traffic started")]
        for mode in ("restart", "crash", "upgrade"):
            binary = harness.AGENT_BIN
            if mode == "upgrade":
                binary = new_agent
                # The new image: the shim comes from next to the new agent binary.
                del a.cfg["shimSource"]
                a.cfg_path.write_text(json.dumps(a.cfg))
            old_pid = a.proc.pid
            t0 = time.monotonic()
            events.append((time.time(), f"{mode}: signal"))
            a.proc.send_signal(signal.SIGKILL if mode == "crash" else signal.SIGTERM)
            a.proc.wait(timeout=30)
            t_exit = time.monotonic()
            assert installed_shim.exists() and a.conflist_path.exists(), f"{mode}: the agent removed its install"

            # A pod created while the agent is away: the shim waits for the new agent.
            pod = harness.Pod(a, f"r{mode[:2]}")
            a.pods.append(pod)
            out = {}

            def add(pod=pod, out=out):
                t = time.monotonic()
                out["r"] = a.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=a.netconf(agentWaitSeconds=20))
                out["t"] = time.monotonic() - t

            adder = threading.Thread(target=add)
            adder.start()
            time.sleep(0.3)
            assert adder.is_alive(), f"{mode}: ADD did not wait for the agent: {out}"
            t_spawn = time.monotonic()
            start_agent(a, binary)
            t_ready = time.monotonic()
            events.append((time.time(), f"{mode}: new agent ready"))
            adder.join(30)
            rc, res, raw = out["r"]
            assert rc == 0, f"{mode}: ADD during the restart failed: {raw}"
            pod.result, pod.ifname = res, "eth0"
            a_pods.append(pod)
            figures.append((mode, t_exit - t0, t_ready - t_spawn, t_ready - t_exit, out["t"]))
            assert a.proc.pid != old_pid
            bridge_macs.append(bridge_mac())

            # CHECK passes for every pod of node A, old and new.
            for p in a_pods:
                rc, _, raw = a.cni("CHECK", p.cid, "eth0", p.ns.path, conf=check_conf(a, p.result))
                assert rc == 0, f"{mode}: CHECK {p.cid}: {raw}"
            # One lease and one host veth per pod: none leaked, none doubled.
            assert set(a.leases()) == {f"{p.cid}:eth0.json" for p in a_pods}, (mode, sorted(a.leases()))
            assert a.wait_no_graveyard()
            veths = set(a.pod_veths())
            assert veths == {host_if_of(p.result) for p in a_pods}, (mode, sorted(veths))
            assert {l["hostIf"] for l in a.leases().values()} == veths
            ips = [ip for p in a_pods for ip in p.ips()]
            assert len(ips) == len(set(ips)) == 2 * len(a_pods), ips
            # The new pod works across nodes at once.
            assert pod.ns.ping(pb.ip4()) and pod.ns.ping(pb.ip6()), f"{mode}: new pod cannot reach node B"
            # Mounts: same mounts, same devices, also in the new agent's mount namespace.
            assert mount_entries([staging, target]) == mounts_before, mode
            assert mount_entries([staging, target], f"/proc/{a.proc.pid}/mountinfo").keys() == mounts_before.keys()
            assert harness.loops_under(a.root) == loops_before, mode
            assert a.csi("stats", "--id", vid, "--path", target)["abnormal"] is False
            # The device plugin serves again with the same devices and CDI spec.
            wait_until(lambda: dp_socket.exists(), what=f"{mode}: device plugin socket back")
            assert cdi_spec.read_bytes() == cdi_before, mode
            # The controller kept node A's blocks.
            assert ctl.nodes()[a.ns.name]["blocks"] == blocks_before, mode
            time.sleep(0.3)

        # The upgrade installed the new shim (atomically: see the poller).
        assert installed_shim.read_bytes() == new_shim
        assert stat.S_IMODE(installed_shim.stat().st_mode) == 0o755
        leftovers = [p.name for p in a.bin_dir.iterdir() if p.name.startswith(".")]
        assert leftovers == [], leftovers

        time.sleep(0.3)
        ping_figures = [p.stop() for p in pingers]
        writer.halt.set()
        writer.join(10)
        poller.halt.set()
        poller.join(10)

        print()
        print(f"node A agent restarts ({a.ns.name}):")
        print(f"  {'mode':8} {'stop (s)':>9} {'start→ready (s)':>16} {'socket gap (s)':>15} {'ADD in gap (s)':>15}")
        for mode, stop_s, start_s, gap_s, add_s in figures:
            print(f"  {mode:8} {stop_s:9.3f} {start_s:16.3f} {gap_s:15.3f} {add_s:15.3f}")
        print("  (the gap includes a deliberate 0.3 s hold before starting the new agent, so the ADD must wait)")
        for p, (sent, received, lost, missing) in zip(pingers, ping_figures):
            print(f"  ping {p.dst:>24} for {p.seconds:5.1f} s: sent {sent}, received {received}, "
                  f"lost {lost} {missing if lost else ''}")
        written = writer.verify() if not writer.errors else 0
        print(f"  volume writer: {writer.records} records, {written} bytes written and read back, "
              f"I/O errors {len(writer.errors)}")
        print(f"  install poller: {poller.polls} polls of shim, conflist, CDI spec; missing {len(poller.missing)}, "
              f"partial {len(poller.bad)}")

        assert writer.errors == [], writer.errors
        assert poller.missing == [], poller.missing[:10]
        assert poller.bad == [], poller.bad[:10]
        assert poller.polls > 100, poller.polls
        for p, (sent, received, lost, missing) in zip(pingers, ping_figures):
            assert sent >= 100, (p.dst, sent)
            assert lost == 0, (f"ping {p.dst}: {lost} lost during agent restarts: {missing}\n"
                               f"node A bridge MAC after each round: {bridge_macs} (a change means a pod added in "
                               f"the window took over the bridge MAC: see test_bridge_mac_is_stable_while_pods_come_and_go)\n"
                               f"events: {events}\n{p.output[-3000:]}")
        a.csi("unpublish", "--id", vid, "--target", target)
        a.csi("unstage", "--id", vid, "--staging", staging)
        ctl.csi("delete-volume", "--id", vid)
        assert harness.mounts_under(a.root) == [] and harness.loops_under(a.root) == []
        elapsed = time.monotonic() - t_test
        print(f"  test wall time {elapsed:.1f} s")
    finally:
        for p in pingers:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        if writer:
            writer.halt.set()
            writer.join(10)
        if poller:
            poller.halt.set()
            poller.join(10)
        c.close()
