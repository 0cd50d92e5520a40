"""Test harness: simulated nodes and pods in private network namespaces.

Every namespace, directory and process made here belongs to this test run (names start with
RUN_PREFIX) and is removed on teardown, also when a test fails. Nothing touches the host's
root network namespace: agents run inside their node namespace via `nsenter --net`.
"""

import ipaddress
import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = Path(os.environ.get("NODEPLANE_TARGET", REPO / "target" / "release"))
AGENT_BIN = TARGET / "nodeplane-agent"
SHIM_BIN = TARGET / "nodeplane-cni"
CLI_BIN = TARGET / "nodeplane"
REF_CNI_DIR = Path(os.environ.get("REF_CNI_DIR", "/usr/lib/cni"))

RUN_PREFIX = f"npt{os.getpid()}-"

# How much slower this machine runs than the one the waits below were chosen on: the VM lane
# (scripts/vm-test) sets it under software emulation, where a process start costs 25-50x.
# Only waits for something that must happen are scaled (an agent ready, a probe answered), so
# a larger value makes a test slower, never more lenient about what it asserts.
TIME_SCALE = float(os.environ.get("NODEPLANE_TIME_SCALE", "1"))


def _kernel_has_netns_cookie():
    """SO_NETNS_COOKIE (Linux 5.14): without it the agent records cookie 0 in a lease and
    tells namespaces apart by nsfs inode number alone (docs/install.md, Kernel requirements)."""
    import errno
    import socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.getsockopt(socket.SOL_SOCKET, 71, 8)  # SO_NETNS_COOKIE
            return True
        except OSError as e:
            if e.errno == errno.ENOPROTOOPT:
                return False
            raise


NETNS_COOKIE = _kernel_has_netns_cookie()


def cookie_as_the_kernel_gives(cookie):
    """A lease's netnsCookie is what this kernel can give: non-zero with SO_NETNS_COOKIE, 0
    without (Debian's 5.10)."""
    return cookie != 0 if NETNS_COOKIE else cookie == 0

# The agent retires a pod's host veth (DEL, a failed ADD, GC) by taking it down (a disabled
# bridge port) and into this link group in one request; the link keeps its name until the
# reaper deletes it, or until an ADD that needs the name renames it to npz + 12 hex.
GRAVEYARD_GROUP = str(0x6E70)


def bridge_port_state(link):
    """The bridge port state of `link` (ip -j -d link): "forwarding", "disabled", ...; None
    when it is no bridge's port."""
    info = link.get("linkinfo", {})
    if info.get("info_slave_kind") != "bridge":
        return None
    return info.get("info_slave_data", {}).get("state")


def is_graveyard(name, link):
    """`link` (ip -j -d link) is a retired link waiting for the agent's reaper."""
    if link.get("group") == GRAVEYARD_GROUP:
        return True
    return len(name) == 15 and name.startswith("npz") and all(c in "0123456789abcdef" for c in name[3:])


_ns_counter = itertools.count(1)
_block_counter = itertools.count(1)


def run(args, check=True, **kw):
    """Run a command (argument vector, never a shell string)."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    res = subprocess.run(args, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{args} failed ({res.returncode}): {res.stderr.strip()} {res.stdout.strip()}")
    return res


def stop_process(proc, sig=signal.SIGTERM, timeout=30):
    """Signal a child we started (by its PID) and reap it; SIGKILL if it does not exit."""
    if proc and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def new_blocks():
    """A fresh pair of test pod blocks (private ranges, used only inside test namespaces)."""
    n = next(_block_counter) + (os.getpid() % 50) * 4
    # Canonical text (fd00:65::/64, not fd00:65:0::/64): what the agent and controller print.
    v4, v6 = f"10.{100 + n // 250}.{n % 250}.0/24", f"fd00:{100 + n // 250:x}:{n % 250:x}::/64"
    return str(ipaddress.ip_network(v4)), str(ipaddress.ip_network(v6))


class Netns:
    def __init__(self, tag):
        self.name = f"{RUN_PREFIX}{tag}{next(_ns_counter)}"
        run(["ip", "netns", "add", self.name])
        run(["ip", "-n", self.name, "link", "set", "lo", "up"])
        self.path = f"/var/run/netns/{self.name}"

    def exec(self, args, check=True, **kw):
        return run(["ip", "netns", "exec", self.name, *args], check=check, **kw)

    def ip_json(self, *args):
        out = run(["ip", "-j", "-n", self.name, *args]).stdout
        return json.loads(out) if out.strip() else []

    def links(self):
        return {l["ifname"]: l for l in self.ip_json("-d", "link", "show")}

    def addrs(self, dev):
        return [f'{a["local"]}/{a["prefixlen"]}' for l in self.ip_json("addr", "show", "dev", dev) for a in l["addr_info"]]

    def ping(self, ip, count=1, wait=2):
        return self.exec(["ping", "-c", str(count), "-W", str(wait), "-i", "0.2", ip], check=False).returncode == 0

    def delete(self):
        run(["ip", "netns", "delete", self.name], check=False)


class Node:
    """One simulated node: its own netns, root dir, agent, CNI dirs and socket."""

    def __init__(self, tag="node", chained=None, extra=None, start=True):
        self.ns = Netns(tag)
        self.root = Path(tempfile.mkdtemp(prefix=RUN_PREFIX, dir="/tmp"))
        self.v4, self.v6 = new_blocks()
        self.boot_id_file = self.root / "boot_id"
        self.boot_id_file.write_text("boot-1\n")
        cfg = {
            "nodeName": self.ns.name,
            "root": str(self.root),
            "podCidrs": [self.v4, self.v6],
            "mtu": 1400,
            "dns": {"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]},
            "shimSource": str(SHIM_BIN),
            "bootIdFile": str(self.boot_id_file),
            "pluginDirs": [str(self.root / "opt/cni/bin"), str(REF_CNI_DIR)],
        }
        if chained:
            cfg["chainedPlugins"] = chained
        cfg.update(extra or {})
        self.cfg = cfg
        self.cfg_path = self.root / "agent.json"
        self.cfg_path.write_text(json.dumps(cfg))
        self.socket = self.root / "run/nodeplane/cni.sock"
        self.conflist_path = self.root / "etc/cni/net.d/10-nodeplane.conflist"
        self.bin_dir = self.root / "opt/cni/bin"
        self.lease_dir = self.root / "var/lib/nodeplane/ipam"
        self.pending_dir = self.root / "var/lib/nodeplane/pending-del"
        self.log_path = self.root / "agent.log"
        self.proc = None
        self.pods = []
        self.agent_args = []  # extra command-line arguments for the agent (e.g. --log-format json)
        # Run the agent in a PID (and mount) namespace of its own, as in a DaemonSet pod:
        # PIDs the runtime names are not its PIDs.
        self.own_pid_namespace = False
        if start:
            self.start()

    # ----- agent lifecycle -----

    def start(self, wait=True):
        # Readiness is judged from this run's part of the log only (the log is appended to
        # across restarts, and a killed agent leaves its socket and conflist behind).
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "a")
        pid_ns = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"] if self.own_pid_namespace else []
        self.proc = subprocess.Popen(
            ["nsenter", f"--net={self.ns.path}", *pid_ns, str(AGENT_BIN), "--config", str(self.cfg_path), *self.agent_args],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL,
        )
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout=15):
        deadline = time.time() + timeout * TIME_SCALE
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited {self.proc.returncode}: {self.log()}")
            if self.socket.exists() and self.conflist_path.exists() and self.ready_in_log():
                return
            time.sleep(0.02)
        raise RuntimeError(f"agent not ready: {self.log()}")

    def ready_in_log(self):
        """The current run logged its ready line."""
        import re
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log()[getattr(self, "log_offset", 0):])
        return (re.search(r"nodeplane::agent: ready ", text) is not None
                or re.search(r'"fields":\{"message":"ready"[^\n]*"target":"nodeplane::agent"', text) is not None)

    def log(self):
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, sig=signal.SIGTERM):
        if self.own_pid_namespace and self.proc and self.proc.poll() is None:
            # Signal the agent itself (unshare, its parent here, only waits for it).
            try:
                kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            except OSError:
                kids = []
            for k in kids:
                try:
                    os.kill(int(k), sig)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        stop_process(self.proc, sig)
        self.proc = None

    def kill9(self):
        self.stop(signal.SIGKILL)

    def restart(self):
        self.stop()
        self.start()

    # ----- CNI -----

    def netconf(self, version=None, plugin_index=0, **overrides):
        """The nodeplane entry of the installed conflist as a single plugin config."""
        conflist = json.loads(self.conflist_path.read_text())
        conf = dict(conflist["plugins"][plugin_index])
        conf["cniVersion"] = version or conflist["cniVersion"]
        conf["name"] = conflist["name"]
        # Tests that stop or kill the agent want the shim's answer at once; the shim's
        # default wait for a restarting agent (10 s) is tested on its own
        # (test_lifecycle.py::test_add_waits_for_a_restarting_agent passes agentWaitSeconds).
        if plugin_index == 0:
            conf["agentWaitSeconds"] = 0
        conf.update(overrides)
        return conf

    def cni(self, command, container_id="", ifname="eth0", netns=None, conf=None, stdin=None,
            env=None, shim=None, timeout=120):
        """Exec the installed shim like a runtime. Returns (returncode, parsed stdout or None, raw)."""
        e = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CNI_COMMAND": command,
             "CNI_PATH": str(self.bin_dir)}
        if container_id:
            e["CNI_CONTAINERID"] = container_id
        if ifname:
            e["CNI_IFNAME"] = ifname
        if netns:
            e["CNI_NETNS"] = netns
        if env is not None:
            e.update(env)
            e = {k: v for k, v in e.items() if v is not None}
        if stdin is None:
            stdin = json.dumps(conf if conf is not None else self.netconf())
        res = subprocess.run([str(shim or self.bin_dir / "nodeplane")], input=stdin.encode() if isinstance(stdin, str) else stdin,
                             env=e, capture_output=True, timeout=timeout)
        out = res.stdout.decode(errors="replace")
        try:
            parsed = json.loads(out) if out.strip() else None
        except ValueError:
            parsed = None
        return res.returncode, parsed, out

    def add_pod(self, tag="pod", ifname="eth0", version=None):
        """Create a pod namespace and ADD it. Returns (Pod, result)."""
        pod = Pod(self, tag)
        rc, res, raw = self.cni("ADD", pod.cid, ifname, pod.ns.path, conf=self.netconf(version))
        if rc != 0:
            pod.ns.delete()
            raise RuntimeError(f"ADD failed: {raw} / stderr")
        pod.result = res
        pod.ifname = ifname
        self.pods.append(pod)
        return pod, res

    # ----- state inspection -----

    def leases(self):
        if not self.lease_dir.exists():
            return {}
        return {p.name: json.loads(p.read_text()) for p in self.lease_dir.iterdir() if p.suffix == ".json"}

    def host_veths(self):
        """Host-side links named like ours: pod veths (np + 13 hex), live or retired, and
        graveyard links renamed out of an ADD's way (npz + 12 hex)."""
        return {n: l for n, l in self.ns.links().items() if n.startswith("np") and len(n) == 15}

    def pod_veths(self):
        """Live host-side pod veths: named like ours and not retired into the graveyard."""
        return {n: l for n, l in self.host_veths().items() if not is_graveyard(n, l)}

    def graveyard(self):
        """Retired links the agent's reaper has yet to delete."""
        return {n: l for n, l in self.ns.links().items() if is_graveyard(n, l)}

    def wait_no_graveyard(self, timeout=20):
        deadline = time.time() + timeout * TIME_SCALE
        while time.time() < deadline:
            if not self.graveyard():
                return True
            time.sleep(0.05)
        return False

    def cleanup(self):
        self.stop()
        for p in self.pods:
            p.ns.delete()
        self.ns.delete()
        release_storage_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    # ----- CSI -----

    @property
    def kubelet(self):
        return self.root / "var/lib/kubelet"

    @property
    def csi_socket(self):
        return self.kubelet / "plugins/csi.nodeplane.dev/csi.sock"

    @property
    def node_socket(self):
        return self.root / "run/nodeplane/node.sock"

    def status(self, *args, check=True):
        """`nodeplane status|doctor --socket <node.sock> --json …` for this node: (exit code, JSON)."""
        cmd, *rest = args
        res = run([str(CLI_BIN), cmd, "--socket", str(self.node_socket), "--json", *rest], check=False)
        if check and res.returncode not in (0, 1):
            raise AssertionError(f"nodeplane {' '.join(args)}: exit {res.returncode}: {res.stderr}")
        return res.returncode, (json.loads(res.stdout) if res.stdout.strip() else None)

    @property
    def volume_dir(self):
        return self.root / "var/lib/nodeplane/volumes"

    def csi(self, *args, check=True):
        """Call this node's CSI socket with the `nodeplane csi` client; the JSON answer."""
        return csi_call(self.csi_socket, *args, check=check)

    def staging_path(self, vol):
        p = self.kubelet / f"plugins/kubernetes.io/csi/pv/{vol}/globalmount"
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def target_path(self, vol, pod="pod1"):
        p = self.kubelet / f"pods/{pod}/volumes/kubernetes.io~csi/{vol}/mount"
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def volume_files(self):
        """Volume ids with a backing file in this node's store."""
        d = self.volume_dir
        return sorted(p.name[:-4] for p in d.glob("*.img")) if d.exists() else []


class Pod:
    def __init__(self, node, tag="pod"):
        self.node = node
        self.ns = Netns(tag)
        self.cid = f"{self.ns.name}-{os.urandom(6).hex()}"
        self.result = None
        self.ifname = "eth0"

    def ips(self):
        return [i["address"].split("/")[0] for i in self.result["ips"]]

    def ip4(self):
        return next(ip for ip in self.ips() if ":" not in ip)

    def ip6(self):
        return next(ip for ip in self.ips() if ":" in ip)


class CsiError(Exception):
    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def csi_call(socket, *args, check=True):
    """`nodeplane csi --endpoint SOCKET ARGS...`: the JSON answer, or CsiError(code)."""
    p = subprocess.run([str(CLI_BIN), "csi", "--endpoint", str(socket), *map(str, args)],
                       capture_output=True, text=True)
    out = json.loads(p.stdout) if p.stdout.strip() else {}
    if p.returncode == 2:
        if check:
            raise CsiError(out.get("code"), out.get("message"))
        return out
    if p.returncode != 0:
        raise RuntimeError(f"nodeplane csi {args}: exit {p.returncode}: {p.stderr}")
    return out


def mounts_under(root):
    root = str(root)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split(" ")[4].replace("\\040", " ")
            if mp == root or mp.startswith(root + "/"):
                out.append(mp)
    return out


def loops_under(root):
    root = str(root)
    out = []
    for e in Path("/sys/block").iterdir():
        if not e.name.startswith("loop"):
            continue
        try:
            b = (e / "loop/backing_file").read_text().strip().removesuffix(" (deleted)")
        except OSError:
            continue
        if b.startswith(root + "/"):
            out.append(f"/dev/{e.name}")
    return out


def release_storage_under(root):
    """Unmount everything under `root` (deepest first) and detach loop devices of files under it."""
    for mp in sorted(mounts_under(root), key=lambda m: -m.count("/")):
        run(["umount", "-l", mp], check=False)
    for dev in loops_under(root):
        run(["losetup", "-d", dev], check=False)


def sweep_leftovers():
    """Remove namespaces and dirs left by an earlier, killed run of this suite (same prefix family)."""
    for name in os.listdir("/var/run/netns") if os.path.isdir("/var/run/netns") else []:
        if name.startswith("npt") and "-" in name and name.split("-")[0][3:].isdigit():
            pid = int(name.split("-")[0][3:])
            if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
                run(["ip", "netns", "delete", name], check=False)


def make_devices(node, name, count, share=None):
    """`count` character device nodes `<root>/dev/<name>N` (1:3, like /dev/null) and a device
    file naming them as resource `name` (shared `share` ways when given); returns the dir."""
    dev = node.root / "dev"
    dev.mkdir(exist_ok=True)
    for i in range(count):
        os.mknod(dev / f"{name}{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    resource = {"name": name, "devices": [f"{dev}/{name}*"]}
    if share is not None:
        resource["share"] = share
    conf = node.root / "etc/nodeplane/devices.json"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(json.dumps({"resources": [resource]}))
    return dev


# ----- health endpoint (appended for test_health.py) -----

HEALTH_PORT = 9640  # the agent's default healthAddress is 127.0.0.1:9640, in the node's namespace

_HTTP_CLIENT = r"""
import http.client, json, ssl, sys
path, port, method, host, ca = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
try:
    if ca:
        # Verified against the CA and the host (an IP address: its IP SAN), as a scraper does.
        c = http.client.HTTPSConnection(host, port, timeout=5, context=ssl.create_default_context(cafile=ca))
    else:
        c = http.client.HTTPConnection(host, port, timeout=5)
    c.request(method, path)
    r = c.getresponse()
    print(json.dumps({"status": r.status, "body": r.read().decode(), "headers": {k.lower(): v for k, v in r.getheaders()}}))
except ConnectionRefusedError:
    print(json.dumps({"refused": True}))
"""


def health_request(ns, path, port=HEALTH_PORT, method="GET", host="127.0.0.1", ca=None):
    """One HTTP request to `host`:`port` inside network namespace `ns` (a Netns); HTTPS
    verified against CA bundle `ca` when given.

    Returns {"status", "body", "headers"}, or None when nothing listens there (connection
    refused). Any other failure (reset, timeout, a certificate that does not verify) raises."""
    out = run(["nsenter", f"--net={ns.path}", "python3", "-c", _HTTP_CLIENT, path, str(port), method, host, str(ca or "")],
              timeout=30).stdout
    reply = json.loads(out)
    return None if reply.get("refused") else reply


def wait_until(pred, timeout=15.0, interval=0.05, what="condition"):
    """Poll `pred` until it returns a truthy value (returned); fail naming `what` and the last
    value after `timeout` seconds."""
    deadline = time.time() + timeout * TIME_SCALE
    while True:
        value = pred()
        if value:
            return value
        if time.time() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(interval)


# The fault suite (test_faults_*.py) reports every case the same way: what it injected and what
# it found afterwards, printed (pytest -s shows it) and, when NODEPLANE_FAULT_REPORT names a file,
# appended to it as one JSON object per line, so the README's Reliability table can be measured
# rather than written by hand.
FAULT_REPORT = os.environ.get("NODEPLANE_FAULT_REPORT")


def fault_report(case, injected, found, **figures):
    """Record one fault case: `injected` and `found` are short human sentences; `figures` are
    the measured numbers behind them (leaked addresses, lost pings, seconds to recover, …)."""
    print(f"\nFAULT {case}: injected: {injected}")
    print(f"FAULT {case}: found: {found}")
    if figures:
        print(f"FAULT {case}: figures: {json.dumps(figures, sort_keys=True)}")
    if FAULT_REPORT:
        with open(FAULT_REPORT, "a") as f:
            f.write(json.dumps({"case": case, "injected": injected, "found": found, "figures": figures},
                               sort_keys=True) + "\n")
