"""Security (issue #8): the agent's capabilities, the Unix sockets' modes, no shell, per-node
authorisation at the controller, and request paths that cannot leave the kubelet directory.

Everything runs in this run's own namespaces and directories (harness / cluster). The
unprivileged client is `setpriv --reuid=65534 --regid=65534 --clear-groups` running Debian's
/usr/bin/python3 (the test's own interpreter may live under /root, which nobody can reach);
the gRPC client is the same interpreter with Debian's python3-grpcio, sending hand-encoded
protobuf (scripts/install-deps installs strace, libcap2-bin and python3-grpcio).
"""

import errno
import json
import os
import re
import signal
import socket
import stat
import subprocess
import tempfile
import shutil
import textwrap
import time
from pathlib import Path

import pytest

import cluster
import harness
from harness import CsiError, run, wait_until
from runtime import Runtime

MIB = 1 << 20
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

# The kept set, as src/sys/caps.rs (KEPT) and the README document it.
# No CAP_SYS_PTRACE: pod namespaces arrive as descriptors the shim opened (issue 20).
KEPT = {"CAP_CHOWN": 0, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_NET_ADMIN": 12,
        "CAP_SYS_ADMIN": 21, "CAP_SYS_RESOURCE": 24, "CAP_MKNOD": 27}
KEPT_MASK = sum(1 << n for n in KEPT.values())
SHELLS = {"sh", "bash", "dash", "ash", "zsh", "ksh", "mksh", "csh", "tcsh", "fish", "busybox"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(autouse=True)
def _required_tools():
    """Fail loudly (never skip) when a package this module needs is missing."""
    missing = [t for t in ("strace", "setpriv", "capsh") if shutil.which(t) is None]
    if not os.path.exists(SYSTEM_PYTHON):
        missing.append(SYSTEM_PYTHON)
    elif subprocess.run([SYSTEM_PYTHON, "-c", "import grpc"], capture_output=True).returncode != 0:
        missing.append("python3-grpcio")
    if missing:
        pytest.fail("missing for this test (scripts/install-deps): " + ", ".join(missing))


def clean(text):
    return ANSI.sub("", text)


def proc_status(pid):
    """The capability lines (as ints), NoNewPrivs and Uid of /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            out[k] = int(v.strip(), 16)
        elif k == "NoNewPrivs":
            out[k] = int(v.strip())
        elif k == "Uid":
            out[k] = int(v.split()[0])
    return out


def decode(mask):
    return run(["capsh", f"--decode={mask:x}"]).stdout.strip().split("=", 1)[1]


def own_bounding_set():
    return proc_status(os.getpid())["CapBnd"]


# ---------------------------------------------------------------------------------------------
# Capabilities
# ---------------------------------------------------------------------------------------------

PROBE = """#!/usr/bin/python3
# A chained "plugin" the agent asks for its versions (CNI VERSION) at start: it records the
# capability sets it was started with.
import json, sys
lines = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
rec = {k: lines[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Uid")}
with open(%r, "a") as f:
    f.write(json.dumps(rec) + "\\n")
sys.stdin.read()
print(json.dumps({"cniVersion": "1.0.0", "supportedVersions": ["0.4.0", "1.0.0", "1.1.0"]}))
"""


def test_documented_kept_set_is_the_one_in_the_code():
    src = (harness.REPO / "src/sys/caps.rs").read_text()
    table = src.split("pub const KEPT", 1)[1].split("];", 1)[0]
    in_code = {name: int(n) for n, name in re.findall(r'cap\(\s*(\d+),\s*"(CAP_[A-Z_]+)"', table)}
    assert in_code == KEPT, f"caps.rs keeps {in_code}, this test (and the docs) say {KEPT}"


def test_agent_and_what_it_runs_hold_exactly_the_kept_capabilities():
    """/proc/PID/status of every agent thread: effective = permitted = bounding = the kept
    set (as far as this machine grants it), inheritable and ambient empty, no_new_privs.
    A program the agent execs as root (a chained plugin's VERSION probe) starts with no more."""
    node = harness.Node(tag="cap", start=False)
    try:
        record = node.root / "probe.jsonl"
        node.bin_dir.mkdir(parents=True, exist_ok=True)
        probe = node.bin_dir / "capprobe"
        probe.write_text(PROBE % str(record))
        probe.chmod(0o755)
        node.cfg["chainedPlugins"] = [{"type": "capprobe"}]
        node.cfg_path.write_text(json.dumps(node.cfg))
        node.start()
        pid = node.proc.pid
        assert os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath(harness.AGENT_BIN), "not the agent's PID"

        granted = own_bounding_set()  # what this machine lets root have at all
        want = KEPT_MASK & granted
        missing = {n for n, b in KEPT.items() if not granted & (1 << b)}
        print(f"\nkept set {KEPT_MASK:016x} = {decode(KEPT_MASK)}; this machine grants root {granted:016x}; "
              f"missing here: {sorted(missing) or 'none'}")
        threads = sorted(os.listdir(f"/proc/{pid}/task"))
        assert len(threads) > 1, "the agent should be serving with several threads"
        for tid in threads:
            st = proc_status(f"{pid}/task/{tid}")
            got = {k: st[k] for k in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb")}
            assert got == {"CapEff": want, "CapPrm": want, "CapBnd": want, "CapInh": 0, "CapAmb": 0}, \
                f"thread {tid}: " + ", ".join(f"{k}={v:016x} ({decode(v) if v else '-'})" for k, v in got.items())
            assert st["NoNewPrivs"] == 1, f"thread {tid}: no_new_privs not set"
        print(f"agent {pid}: CapEff=CapPrm=CapBnd={want:016x}, CapInh=CapAmb=0, NoNewPrivs=1 on {len(threads)} threads")

        log = clean(node.log())
        line = next(l for l in log.splitlines() if "capabilities dropped to the kept set" in l)
        assert all(n in line for n in KEPT), line
        warned = [l for l in log.splitlines() if "lacks kept capabilities" in l]
        if missing:
            assert len(warned) == 1 and all(n in warned[0] for n in missing), warned
        else:
            assert not warned, warned

        # The exec'd child: as root, with at most the kept set in every set.
        recs = [json.loads(l) for l in wait_until(lambda: record.exists() and record.read_text().splitlines(),
                                                 what="the probe's VERSION run")]
        for rec in recs:
            caps = {k: int(rec[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
            print(f"child (VERSION probe): {rec}")
            assert int(rec["Uid"].split()[0]) == 0, rec
            assert caps["CapBnd"] == want, f"child bounding set {caps['CapBnd']:016x} ({decode(caps['CapBnd'])})"
            for k in ("CapPrm", "CapEff", "CapInh", "CapAmb"):
                assert caps[k] & ~want == 0, f"child {k} {caps[k]:016x} has more than the kept set: {decode(caps[k] & ~want)}"
            assert rec["NoNewPrivs"] == "1", rec
    finally:
        node.cleanup()


def test_pod_netns_by_proc_path_of_another_user_needs_no_ptrace_in_the_agent(node):
    """CNI_NETNS may be /proc/PID/ns/net (cri-dockerd passes it) of a pod process running as
    another user: opening it is a ptrace access check. The shim opens it (exec'd by the
    runtime, with the runtime's privileges) and passes the descriptor, so the agent, which
    holds no CAP_SYS_PTRACE, serves it all the same."""
    assert "CAP_SYS_PTRACE" not in KEPT, "the agent keeps no CAP_SYS_PTRACE"
    pod = harness.Pod(node, "ptr")
    node.pods.append(pod)
    sleeper = subprocess.Popen(["nsenter", f"--net={pod.ns.path}", *NOBODY, "sleep", "60"])
    try:
        path = f"/proc/{sleeper.pid}/ns/net"
        wait_until(lambda: proc_status(sleeper.pid).get("Uid") == 65534 and
                   os.stat(path).st_ino == os.stat(pod.ns.path).st_ino, what="the pod process as nobody in the pod netns")
        rc, res, raw = node.cni("ADD", pod.cid, "eth0", path)
        assert rc == 0, f"ADD with {path} (a nobody process) failed: {raw}\n{clean(node.log())[-2000:]}"
        assert "eth0" in pod.ns.links()
        rc, _, raw = node.cni("DEL", pod.cid, "eth0", path)
        assert rc == 0, raw
        wait_until(lambda: "eth0" not in pod.ns.links(), what="the pod's eth0 gone after DEL")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_kept_file_capabilities_serve_a_volume_root_a_pod_has_taken():
    """A pod running as root in its container may chown its volume's root to another user and
    close it (0700). The next publish with a volume_mount_group (fsGroup) must still give the
    root that group with g+rwx and set-gid (CAP_CHOWN, CAP_FOWNER, CAP_FSETID), and xfs must
    still grow online (xfs_growfs opens the mount point: CAP_DAC_READ_SEARCH)."""
    c = cluster.Cluster()
    try:
        node = c.node(1, 1, csi={"capacityBytes": 1024 * MIB})
        ctl = c.controller
        c.wait_connected([node], timeout=20)
        for fs, size in (("ext4", 64 * MIB), ("xfs", 320 * MIB)):
            vid = ctl.csi("create-volume", "--name", f"pvc-own-{fs}", "--size", size, "--fs", fs,
                          "--node", node.ns.name)["volumeId"]
            staging = node.staging_path(vid)
            node.csi("stage", "--id", vid, "--staging", staging, "--fs", fs)
            os.chown(staging, 1000, 1000)
            staging.chmod(0o700)
            target = node.target_path(vid, pod="pod-fsgroup")
            # NodePublishVolume with volume_mount_group "4242" (not expressible with the CLI).
            cap = [[2, [[1, fs], [3, "4242"]]], [3, [[1, 1]]]]  # mount{fs_type, volume_mount_group}, SINGLE_NODE_WRITER
            r = grpc_call(ctl, "", "/csi.v1.Node/NodePublishVolume",
                          [[1, vid], [3, str(staging)], [4, str(target)], [5, cap]], socket_path=node.csi_socket)
            assert r["code"] == "OK", f"{fs}: publish with volume_mount_group over a pod-owned root: {r}"
            st = os.stat(target)
            assert (st.st_uid, st.st_gid) == (1000, 4242), f"{fs}: owner {st.st_uid}:{st.st_gid}"
            assert stat.S_IMODE(st.st_mode) == 0o2770, f"{fs}: mode {stat.S_IMODE(st.st_mode):o}"
            if fs == "xfs":
                before = os.statvfs(target)
                ctl.csi("expand-volume", "--id", vid, "--size", size + 64 * MIB)
                node.csi("node-expand", "--id", vid, "--path", target, "--size", size + 64 * MIB)
                after = os.statvfs(target)
                assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize, "xfs did not grow"
            node.csi("unpublish", "--id", vid, "--target", target)
            node.csi("unstage", "--id", vid, "--staging", staging)
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# Unix sockets
# ---------------------------------------------------------------------------------------------

def listening_unix_sockets(pid):
    """Paths of the Unix sockets process `pid` listens on (its fds x its netns' /proc/net/unix)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    paths = set()
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes and int(f[3], 16) & 0x10000 and f[7].startswith("/"):
            paths.add(f[7])
    return paths


CONNECT = textwrap.dedent("""
    import json, os, socket, sys
    out = {"uid": os.getuid(), "groups": os.getgroups(),
           "capeff": [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]}
    for p in sys.argv[1:]:
        r = {}
        try:
            os.stat(p)
            r["stat"] = 0
        except OSError as e:
            r["stat"] = e.errno
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(p)
            r["connect"] = 0
        except OSError as e:
            r["connect"] = e.errno
        finally:
            s.close()
        out[p] = r
    print(json.dumps(out))
""")


def connect_as(prefix, paths):
    return json.loads(run([*prefix, SYSTEM_PYTHON, "-c", CONNECT, *paths]).stdout)


def test_every_socket_is_0600_root_and_refuses_an_unprivileged_user():
    c = cluster.Cluster()
    opened = []  # (dir, original mode)
    try:
        node = c.node(1, 1, start=False, csi={"capacityBytes": 256 * MIB})
        harness.make_devices(node, "secdev", 1)
        node.start()
        kubelet = node.kubelet
        expect_agent = {str(node.socket), str(node.csi_socket), str(node.root / "run/nodeplane/node.sock")}
        found = wait_until(lambda: (lambda s: s if expect_agent <= s and
                                    any("/device-plugins/" in p for p in s) and
                                    any("/plugins_registry/" in p for p in s) else None)(listening_unix_sockets(node.proc.pid)),
                           timeout=20, what="the agent's CNI, CSI, node, registration and device plugin sockets")
        ctl = listening_unix_sockets(c.controller.proc.pid)
        # The agent API is TCP + TLS (on the underlay): the CSI socket is its only Unix socket.
        assert ctl == {str(c.controller.csi_socket)}, ctl
        sockets = sorted(found | ctl)
        print("\nsockets checked:\n  " + "\n  ".join(sockets))

        for p in sockets:
            st = os.lstat(p)
            assert stat.S_ISSOCK(st.st_mode), p
            assert stat.S_IMODE(st.st_mode) == 0o600, f"{p}: mode {stat.S_IMODE(st.st_mode):o}"
            assert (st.st_uid, st.st_gid) == (0, 0), f"{p}: owner {st.st_uid}:{st.st_gid}"
            d = os.stat(os.path.dirname(p))
            assert d.st_uid == 0, f"{os.path.dirname(p)}: owner {d.st_uid}"
            assert not d.st_mode & stat.S_IWOTH, f"{os.path.dirname(p)}: writable by others ({stat.S_IMODE(d.st_mode):o})"
            assert not (d.st_mode & stat.S_IWGRP and d.st_gid != 0), f"{os.path.dirname(p)}: group-writable"

        # Let nobody walk the directories (search only), so the socket's own mode is what is
        # tested: the client must be able to stat each socket and still be refused.
        dirs = {a for p in sockets for a in Path(p).parents}
        for d in sorted(dirs, key=lambda x: len(x.parts)):
            mode = stat.S_IMODE(d.stat().st_mode)
            if not mode & stat.S_IXOTH:
                opened.append((d, mode))
                d.chmod(mode | stat.S_IXOTH)

        nobody = connect_as(NOBODY, sockets)
        assert nobody["uid"] == 65534 and nobody["groups"] == [] and int(nobody["capeff"], 16) == 0, nobody
        for p in sockets:
            assert nobody[p]["stat"] == 0, f"{p}: nobody cannot even reach it ({errno.errorcode.get(nobody[p]['stat'])})"
            assert nobody[p]["connect"] == errno.EACCES, \
                f"{p}: unprivileged connect gave {errno.errorcode.get(nobody[p]['connect'], 'success')}, not EACCES"
        root = connect_as([], sockets)
        assert all(root[p] == {"stat": 0, "connect": 0} for p in sockets), root
        print(f"nobody: EACCES on all {len(sockets)} sockets; root: connected to all")
    finally:
        for d, mode in reversed(opened):
            try:
                d.chmod(mode)
            except OSError:
                pass
        c.close()


# ---------------------------------------------------------------------------------------------
# No shell
# ---------------------------------------------------------------------------------------------

def strace_prefix(out):
    return ["strace", "-f", "-qq", "--seccomp-bpf", "-s", "512", "-e", "trace=execve,execveat", "-o", str(out)]


def start_straced_controller(ctl, out, timeout=15):
    log = open(ctl.log_path, "a")
    ctl.proc = subprocess.Popen([*strace_prefix(out), str(cluster.CONTROLLER_BIN), "serve", "--config", str(ctl.cfg_path)],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    wait_until(lambda: ctl.socket.exists() and " ready" in ctl.log(), timeout=timeout, what="the straced controller")


def start_straced_agent(node, out):
    node.log_offset = node.log_path.stat().st_size if node.log_path.exists() else 0
    log = open(node.log_path, "a")
    node.proc = subprocess.Popen([*strace_prefix(out), "nsenter", f"--net={node.ns.path}", str(harness.AGENT_BIN),
                                  "--config", str(node.cfg_path)], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    node.wait_ready(timeout=30)


def traced_child(strace_proc, exe):
    """PID of the traced program (strace's child once it has exec'd `exe`)."""
    def find():
        for t in os.listdir(f"/proc/{strace_proc.pid}/task"):
            for pid in Path(f"/proc/{strace_proc.pid}/task/{t}/children").read_text().split():
                try:
                    if os.path.realpath(f"/proc/{pid}/exe") == os.path.realpath(exe):
                        return int(pid)
                except OSError:
                    pass
        return None
    return wait_until(find, what=f"the traced {exe}")


def stop_traced(strace_proc, exe):
    """SIGTERM the traced program itself (by PID); strace ends with it."""
    if strace_proc is None or strace_proc.poll() is not None:
        return
    os.kill(traced_child(strace_proc, exe), signal.SIGTERM)
    try:
        strace_proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        strace_proc.kill()
        strace_proc.wait()


EXEC = re.compile(r'^(\d+)\s+(?:execve|execveat)\((?:[^,]+, )?"([^"]*)", \[(.*?)\](?:, .*)?$')


def execs(trace):
    """[(program, argv, succeeded)] from an `strace -f -e trace=execve` output file."""
    out, pending = [], {}
    for line in Path(trace).read_text().splitlines():
        m = re.match(r"^(\d+)\s+<\.\.\. execve(?:at)? resumed>.*= (-?\d+)", line)
        if m and m.group(1) in pending:
            prog, argv = pending.pop(m.group(1))
            out.append((prog, argv, m.group(2) == "0"))
            continue
        m = EXEC.match(line.replace(" <unfinished ...>", ""))
        if not m:
            continue
        pid, prog, args = m.groups()
        argv = re.findall(r'"((?:[^"\\]|\\.)*)"', args)
        if line.endswith("<unfinished ...>"):
            pending[pid] = (prog, argv)
        else:
            out.append((prog, argv, bool(re.search(r"\) = 0$", line))))
    return out


def test_no_shell_is_ever_executed():
    """The controller and an agent run under `strace -f -e trace=execve` through CNI
    ADD/CHECK/DEL with a chained plugin, CSI stage/publish/stats/expand/unpublish/unstage of an
    ext4 and an xfs volume, and device plugin discovery: no shell is exec'd, no `-c`, and every
    program that ran is an ELF binary (a script would run its interpreter inside the same execve)."""
    root = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX, dir="/tmp"))
    ctl_trace, agent_trace = root / "controller.strace", root / "agent.strace"
    ctl, ul, node, pods = None, None, None, []
    try:
        ctl = cluster.Controller(root / "controller", start=False)
        start_straced_controller(ctl, ctl_trace)
        ul = cluster.Underlay()
        node = cluster.cluster_node(ctl, ul, 1, 1, start=False, tag="sh", csi={"capacityBytes": 1024 * MIB})
        node.cfg["chainedPlugins"] = [{"type": "bandwidth", "capabilities": {"bandwidth": True}}]
        node.cfg_path.write_text(json.dumps(node.cfg))
        harness.make_devices(node, "shdev", 2)
        started = time.time()
        start_straced_agent(node, agent_trace)

        # CNI through the chain (the runtime, i.e. this test, runs bandwidth; the agent asks it
        # its versions at start).
        rt = Runtime(node.conflist_path, [node.bin_dir, harness.REF_CNI_DIR], host_netns=node.ns.path)
        rt.conflist["cniVersion"] = rt.common_version()
        pod = harness.Pod(node, "shp")
        pods.append(pod)
        caps = {"bandwidth": {"ingressRate": 8_000_000, "ingressBurst": 1_000_000,
                              "egressRate": 8_000_000, "egressBurst": 1_000_000}}
        rt.add(pod.cid, pod.ns.path, pod_name="shp", capability_args=caps)
        rt.check(pod.cid, pod.ns.path, pod_name="shp")
        rt.delete(pod.cid, pod.ns.path, pod_name="shp", capability_args=caps)

        # CSI: both filesystems through stage, publish, stats, expansion and back.
        wait_until(lambda: ctl.placeable(node.ns.name), timeout=20, what="the node's capacity at the controller")
        for fs, size in (("ext4", 64 * MIB), ("xfs", 320 * MIB)):  # mkfs.xfs wants 300 MB at least
            vid = ctl.csi("create-volume", "--name", f"pvc-sh-{fs}", "--size", size, "--fs", fs,
                          "--node", node.ns.name)["volumeId"]
            staging, target = node.staging_path(vid), node.target_path(vid)
            node.csi("stage", "--id", vid, "--staging", staging, "--fs", fs)
            node.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", fs)
            node.csi("stats", "--id", vid, "--path", target)
            ctl.csi("expand-volume", "--id", vid, "--size", size + 64 * MIB)
            try:
                node.csi("node-expand", "--id", vid, "--path", target, "--size", size + 64 * MIB)
            except CsiError as e:  # ext4 online growth without CAP_SYS_RESOURCE on this machine
                assert fs == "ext4" and "CAP_SYS_RESOURCE" in e.message, e
            node.csi("unpublish", "--id", vid, "--target", target)
            node.csi("unstage", "--id", vid, "--staging", staging)
            if fs == "ext4":  # offline growth at the next stage: e2fsck + resize2fs
                node.csi("stage", "--id", vid, "--staging", staging, "--fs", fs)
                node.csi("unstage", "--id", vid, "--staging", staging)
            ctl.csi("delete-volume", "--id", vid)
        wait_until(lambda: not node.volume_files(), timeout=20, what="volumes deleted on the node")
        # Device plugins: both devices found (and served) by the agent.
        wait_until(lambda: len([p for p in listening_unix_sockets(traced_child(node.proc, harness.AGENT_BIN))
                                if "/device-plugins/" in p]) >= 1, what="a device plugin socket")
        elapsed = time.time() - started

        stop_traced(node.proc, harness.AGENT_BIN)
        node.proc = None
        stop_traced(ctl.proc, cluster.CONTROLLER_BIN)
        ctl.proc = None

        report = {}
        for who, trace in (("controller", ctl_trace), ("agent", agent_trace)):
            calls = execs(trace)
            assert calls, f"{who}: strace recorded no execve at all ({trace})"
            ran = [(p, a) for p, a, ok in calls if ok]
            bad = [(p, a) for p, a, _ in calls if os.path.basename(p) in SHELLS or
                   (a and os.path.basename(a[0]) in SHELLS) or "-c" in a[1:]]
            assert not bad, f"{who} exec'd a shell: {bad}"
            for p, _ in ran:
                with open(p, "rb") as f:
                    assert f.read(4) == b"\x7fELF", f"{who} ran {p}, which is not an ELF binary (a script?)"
            progs = {}
            for p, _ in ran:
                progs[p] = progs.get(p, 0) + 1
            report[who] = progs
        print(f"\nprograms exec'd (path: times), {elapsed:.1f}s of work:")
        for who, progs in report.items():
            print(f"  {who}:")
            for p, n in sorted(progs.items()):
                print(f"    {p}: {n}")
        agent_progs = {os.path.basename(p) for p in report["agent"]}
        for tool in ("nodeplane-agent", "nft", "bandwidth", "mkfs.ext4", "mkfs.xfs", "xfs_growfs", "e2fsck", "resize2fs"):
            assert tool in agent_progs, f"the traced work should have run {tool}: {sorted(agent_progs)}"
    finally:
        if node:
            if node.proc is not None:
                stop_traced(node.proc, harness.AGENT_BIN)
                node.proc = None
            for p in pods:
                p.ns.delete()
            node.cleanup()
        if ctl:
            if ctl.proc is not None:
                stop_traced(ctl.proc, cluster.CONTROLLER_BIN)
                ctl.proc = None
        if ul:
            ul.delete()
        shutil.rmtree(root, ignore_errors=True)


def test_source_runs_no_shell():
    """Every place in src/ that starts a program, and what it may start: no shell, no `-c`.
    A new Command::new site fails this test until it is reviewed and listed here."""
    src = harness.REPO / "src"
    sites = {}
    for f in src.rglob("*.rs"):
        text = f.read_text()
        for m in re.finditer(r"Command::new\(\s*([^)]*?)\s*\)", text):
            sites.setdefault(str(f.relative_to(src)), []).append(m.group(1))
        named = re.findall(r'"(?:/usr)?(?:/s?bin/)?(' + "|".join(SHELLS) + r')"', text)
        assert not named, f"{f}: a string naming a shell: {named}"
        assert '"-c"' not in text, f'{f}: a "-c" argument'
    assert sites == {"agent/install.rs": ["&bin"], "sys/fstools.rs": ["tool"],
                     "net/policy.rs": ['"nft"', '"nft"'], "sys/features.rs": ['"nft"'],
                     "net/services.rs": ['"conntrack"', '"nft"', '"nft"', '"nft"'], "sys/lvm.rs": ["tool"],
                     "sys/crypt.rs": ['"cryptsetup"', '"cryptsetup"']}, sites
    tools = re.findall(r'\brun\(\s*"([^"]+)"', (src / "sys/fstools.rs").read_text())
    assert tools and not {os.path.basename(t) for t in tools} & SHELLS, tools
    lvm_tools = re.findall(r'\blvm\(\s*"([^"]+)"', (src / "sys/lvm.rs").read_text())
    assert set(lvm_tools) == {"lvs", "lvcreate", "lvrename", "lvextend", "lvchange", "lvremove"}, lvm_tools
    print(f"\nCommand::new sites: {sites}; sys/fstools.rs tools: {sorted(set(tools))}")


# ---------------------------------------------------------------------------------------------
# Impersonation at the controller
# ---------------------------------------------------------------------------------------------

GRPC = textwrap.dedent("""
    import grpc, json, sys
    a = json.loads(sys.argv[1])
    def varint(n):
        out = b""
        while True:
            b, n = n & 0x7f, n >> 7
            out += bytes([b | (0x80 if n else 0)])
            if not n:
                return out
    def field(num, v):
        if isinstance(v, list):  # a nested message: [[num, value], ...]
            b = b"".join(field(n, x) for n, x in v)
            return varint(num << 3 | 2) + varint(len(b)) + b
        if isinstance(v, str):
            b = v.encode()
            return varint(num << 3 | 2) + varint(len(b)) + b
        return varint(num << 3) + varint(v)
    body = b"".join(field(n, v) for n, v in a["fields"])
    if a.get("ca"):  # TCP + TLS, verified against the controller's CA
        ch = grpc.secure_channel(a["address"], grpc.ssl_channel_credentials(open(a["ca"], "rb").read()))
    else:
        ch = grpc.insecure_channel("unix:" + a["socket"])
    md = [("authorization", "Bearer " + a["token"])] if a["token"] else []
    method = a["method"] if a["method"].startswith("/") else "/nodeplane.controller.v1.NodeRegistry/" + a["method"]
    same = lambda b: b
    try:
        if a["stream"]:
            it = ch.unary_stream(method, request_serializer=same, response_deserializer=same)(body, metadata=md, timeout=10)
            first = next(it)
            it.cancel()
        else:
            first = ch.unary_unary(method, request_serializer=same, response_deserializer=same)(body, metadata=md, timeout=10)
        print(json.dumps({"code": "OK", "bytes": len(first)}))
    except grpc.RpcError as e:
        print(json.dumps({"code": e.code().name, "details": e.details()}))
""")


def grpc_call(ctl, token, method, fields, stream=False, socket_path=None):
    """One call with Python's grpc: to `socket_path`, else to the controller as it serves
    (its Unix socket, or TCP + TLS from inside its namespace)."""
    tls = ctl.ca is not None and socket_path is None
    arg = json.dumps({"socket": str(socket_path or ctl.socket), "token": token, "method": method, "fields": fields,
                      "stream": stream, "address": ctl.address if tls else None, "ca": str(ctl.ca) if tls else None})
    argv = [SYSTEM_PYTHON, "-c", GRPC, arg]
    return json.loads(run(ctl.in_netns(argv) if tls else argv, timeout=30).stdout)


def test_a_node_credential_cannot_act_for_another_node():
    c = cluster.Cluster()
    try:
        csi = {"capacityBytes": 256 * MIB}
        a, b = c.node(0, 1, csi=csi), c.node(0, 2, csi=csi)
        ctl = c.controller
        c.wait_connected([a, b], timeout=20)
        before = ctl.nodes()
        b_capacity = ctl.csi("capacity", "--node", b.ns.name)
        token_a = ctl.token(a.ns.name)

        # An agent that calls itself I but carries A's credential.
        imp = c.node(0, 3, token=token_a, start=False, csi=csi)
        imp.start(wait=False)
        wait_until(lambda: "controller session ended" in clean(imp.log()), timeout=10,
                   what="the impersonator's registration to be refused")
        ended = [l for l in clean(imp.log()).splitlines() if "controller session ended" in l]
        assert re.search(r"PERMISSION_DENIED|PermissionDenied", ended[0]), ended[0]
        nodes = ctl.nodes()
        assert imp.ns.name not in nodes, nodes
        assert nodes == before, f"registry changed: {nodes} vs {before}"
        st = imp.root / "var/lib/nodeplane/cluster.json"
        assert not st.exists() or not json.loads(st.read_text()).get("blocks"), st.read_text()
        assert not imp.conflist_path.exists(), "the impersonator became ready"
        imp.stop()

        # A's credential against B, RPC by RPC: refused, and nothing changed.
        calls = {
            "RemoveNode": ([[1, b.ns.name]], False),
            "RequestBlock": ([[1, b.ns.name], [2, 1]], False),
            "WatchNodes": ([[1, b.ns.name]], True),
            "WatchVolumes": ([[1, b.ns.name]], True),
            "ReportVolumes": ([[1, b.ns.name], [2, 1 * MIB], [3, 1 * MIB]], False),
        }
        for method, (fields, stream) in calls.items():
            r = grpc_call(ctl, token_a, method, fields, stream)
            assert r["code"] == "PERMISSION_DENIED", f"A's token on {method} for B: {r}"
        assert ctl.nodes() == before
        assert ctl.csi("capacity", "--node", b.ns.name) == b_capacity, "B's reported capacity changed"
        # The same calls for A itself go through (so the refusals above are about identity).
        assert grpc_call(ctl, token_a, "WatchVolumes", [[1, a.ns.name]], True)["code"] == "OK"
        assert grpc_call(ctl, token_a, "WatchNodes", [[1, a.ns.name]], True)["code"] == "OK"
        assert grpc_call(ctl, token_a, "ReportVolumes", [[1, a.ns.name], [2, 256 * MIB], [3, 256 * MIB]])["code"] == "OK"
        assert grpc_call(ctl, "garbage", "WatchVolumes", [[1, a.ns.name]], True)["code"] == "UNAUTHENTICATED"
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# Request paths
# ---------------------------------------------------------------------------------------------

def mount_snapshot(roots, devs):
    """Mount points under `roots` (or equal), and every mount of a device in `devs` (major:minor)."""
    out = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split(" ")
            majmin, mp = parts[2], parts[4].replace("\\040", " ")
            if majmin in devs or any(mp == r or mp.startswith(r.rstrip("/") + "/") for r in roots):
                out.add((mp, majmin))
    return out


def tree(d):
    return sorted(str(p.relative_to(d)) + ("/" if p.is_dir() and not p.is_symlink() else "") for p in Path(d).rglob("*"))


def test_request_paths_cannot_leave_the_kubelet_dir():
    c = cluster.Cluster()
    outside = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX + "out-", dir="/tmp"))
    try:
        node = c.node(1, 1, csi={"capacityBytes": 512 * MIB})
        ctl = c.controller
        c.wait_connected([node], timeout=20)
        va = ctl.csi("create-volume", "--name", "pvc-pa", "--size", 32 * MIB, "--node", node.ns.name)["volumeId"]
        vb = ctl.csi("create-volume", "--name", "pvc-pb", "--size", 32 * MIB, "--fs", "xfs",
                     "--node", node.ns.name)["volumeId"]
        staging, target = node.staging_path(va), node.target_path(va)
        node.csi("stage", "--id", va, "--staging", staging, "--fs", "ext4")
        node.csi("publish", "--id", va, "--staging", staging, "--target", target, "--fs", "ext4")
        k = node.kubelet
        (outside / "leaf").mkdir()
        (outside / "x").mkdir()
        (k / "pods").mkdir(exist_ok=True)
        os.symlink(outside, k / "pods/evil-dir")                  # a symlinked directory on the way
        os.symlink(outside / "leaf", k / "pods/evil-leaf")        # the path itself a symlink
        os.symlink(outside, k / "plugins/kubernetes.io/csi/pv/evil-pv")
        (k.parent / "kubelet-evil/pods").mkdir(parents=True)     # same string prefix, another dir
        rel_outside = str(outside).lstrip("/")
        bad = {
            "dotdot out": f"{k}/pods/../../../../../../../../{rel_outside}/x",
            "dotdot in": f"{k}/pods/p1/../p2/mount",
            "dot": f"{k}/./pods/p3/mount",
            "symlinked dir": f"{k}/pods/evil-dir/x",
            "symlinked dir, new leaf": f"{k}/pods/evil-dir/new/mount",
            "symlinked staging dir": f"{k}/plugins/kubernetes.io/csi/pv/evil-pv/globalmount",
            "symlink leaf": f"{k}/pods/evil-leaf",
            "/etc": "/etc",
            "/etc/x": "/etc/npt-sec-x",
            "/tmp/x": "/tmp/x",
            "outside dir": str(outside / "x"),
            "prefix twin": f"{k}-evil/pods/x",
            "relative": str(target.relative_to("/")),
            "kubelet dir": str(k),
            "root": "/",
        }
        calls = {
            "stage": lambda p: ("stage", "--id", vb, "--staging", p, "--fs", "xfs"),
            "publish target": lambda p: ("publish", "--id", va, "--staging", staging, "--target", p, "--fs", "ext4"),
            "publish staging": lambda p: ("publish", "--id", va, "--staging", p, "--target",
                                          node.target_path(va, pod="pod2"), "--fs", "ext4"),
            "stats": lambda p: ("stats", "--id", va, "--path", p),
            "expand": lambda p: ("node-expand", "--id", va, "--path", p, "--size", 32 * MIB),
            "unpublish": lambda p: ("unpublish", "--id", va, "--target", p),
            "unstage": lambda p: ("unstage", "--id", va, "--staging", p),
        }
        devs = {f"{os.major(os.stat(d).st_rdev)}:{os.minor(os.stat(d).st_rdev)}" for d in harness.loops_under(node.root)}
        roots = [str(node.root), str(outside), "/etc", str(k) + "-evil"]
        mounts_before, loops_before = mount_snapshot(roots, devs), harness.loops_under(node.root)
        outside_before, etc_before = tree(outside), sorted(os.listdir("/etc"))
        assert (str(target), ) in {(m,) for m, _ in mounts_before}, "the control volume is published"
        wrong = {}
        started = time.time()
        for what, p in bad.items():
            for call, args in calls.items():
                r = node.csi(*args(p), check=False)
                # stats and expand name a known volume at a path it is not at: the spec's
                # NOT_FOUND ("volume does not exist on the specified volume_path").
                want = "NotFound" if call in ("stats", "expand") else "InvalidArgument"
                if r.get("code") != want:
                    wrong[f"{call} / {what} ({p}): want {want}"] = r
        elapsed = time.time() - started
        assert not wrong, "not refused as expected:\n" + json.dumps(wrong, indent=1)
        assert mount_snapshot(roots, devs) == mounts_before, "mounts changed"
        assert harness.loops_under(node.root) == loops_before, "loop devices changed"
        assert tree(outside) == outside_before, f"the outside dir changed: {tree(outside)}"
        assert sorted(os.listdir("/etc")) == etc_before
        # The good paths still work: the refusals were about the paths.
        assert node.csi("stats", "--id", va, "--path", target).get("usage"), "stats at the real target"
        print(f"\n{len(bad) * len(calls)} calls ({len(bad)} paths x {len(calls)} RPCs): all refused (INVALID_ARGUMENT, NOT_FOUND for stats/expand), "
              f"no mount, loop device or file appeared ({elapsed:.1f}s)")
        node.csi("unpublish", "--id", va, "--target", target)
        node.csi("unstage", "--id", va, "--staging", staging)
    finally:
        c.close()
        shutil.rmtree(outside, ignore_errors=True)
