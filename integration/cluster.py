"""A local cluster: one controller process and simulated nodes on a private underlay.

The underlay is its own network namespace holding a bridge per segment; every node namespace
is attached to one segment by a veth pair. Segments are joined by the underlay namespace
routing between them, so nodes on different segments are not on a shared L2 (VXLAN is then
needed). Everything lives in namespaces this code creates; the host's root namespace is not
touched. Underlay addresses come from 198.19.0.0/16 (RFC 2544 benchmarking range), used
only inside these namespaces; with `ipv6=True` a node also gets fd19:<seg>::<host>/64 on the
same link (ULA, likewise private to these namespaces).

The simulated underlay links skip IPv6 duplicate address detection (accept_dad=0 before they
come up, addresses nodad): a real node's underlay NIC has been up for long, and a freshly
made link whose link-local address is still tentative cannot send the neighbour
solicitations that forwarding needs, which would only add start-up noise to the tests.
"""

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import harness
from harness import run

CONTROLLER_BIN = harness.TARGET / "nodeplane-controller"


# Where a cluster's controller listens: an address on the underlay namespace's loopback,
# which every node reaches through its segment's router (RFC 2544 range, like the underlay).
CONTROLLER_IP = "198.18.0.1"
CONTROLLER_PORT = 9650


class Controller:
    """The controller process. By default on a Unix socket in the test's namespace; with
    `netns` (the underlay's), it runs in that namespace and serves TCP + TLS on
    CONTROLLER_IP, with a CA and serving certificate made by `certs init` (agents get
    `controller.tls.caFile`, admin commands run in that namespace with `--ca-file`)."""

    def __init__(self, root, pools=None, start=True, extra=None, netns=None, tls=True):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.netns = netns
        self.socket = self.root / "controller.sock"
        self.ca = None
        if netns and not tls:  # plaintext TCP (benchmarks compare it with TLS)
            self.address = f"{CONTROLLER_IP}:{CONTROLLER_PORT}"
        elif netns:
            tls = self.root / "tls"
            run([str(CONTROLLER_BIN), "certs", "init", "--dir", str(tls), "--san", CONTROLLER_IP])
            self.ca = tls / "ca.crt"
            self.address = f"{CONTROLLER_IP}:{CONTROLLER_PORT}"
        else:
            self.address = f"unix:{self.socket}"
        self.cfg = {
            "dataDir": str(self.root / "data"),
            "listen": self.address,
            "pools": pools or [{"cidr": "10.244.0.0/16", "blockPrefix": 24},
                               {"cidr": "fd00:10:244::/48", "blockPrefix": 64}],
        }
        if self.ca:
            self.cfg["tls"] = {"dir": str(self.root / "tls")}
        elif netns:
            self.cfg["insecure"] = True
        self.cfg.update(extra or {})
        self.csi_socket = self.root / "data/csi.sock"
        self.cfg_path = self.root / "controller.json"
        self.cfg_path.write_text(json.dumps(self.cfg))
        self.log_path = self.root / "controller.log"
        self.proc = None
        self.admin_token_file = self.root / "admin.token"
        if start:
            self.start()
        self.admin_token_file.write_text(self.token("@admin"))

    def start(self, timeout=15):
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.in_netns([str(CONTROLLER_BIN), "serve", "--config", str(self.cfg_path)]),
                                     stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.time() + timeout * harness.TIME_SCALE
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited {self.proc.returncode}: {self.log()}")
            listening = " ready (TLS)" if self.ca else " ready"
            if (self.netns or self.socket.exists()) and listening in self.log()[offset:]:
                return
            time.sleep(0.02)
        raise RuntimeError(f"controller not ready: {self.log()}")

    def log(self):
        return self.log_path.read_text() if self.log_path.exists() else ""

    def csi(self, *args, check=True):
        """Call the controller's CSI socket (Identity + Controller) with `nodeplane csi`."""
        return harness.csi_call(self.csi_socket, *args, check=check)

    def placeable(self, node):
        """Whether the controller can place a volume on `node` now: its capacity is known and
        not 0. (While an away node's capacity is unknown, GetCapacity answers UNAVAILABLE.)"""
        return self.csi("capacity", "--node", node, check=False).get("maximumVolumeSize", 0) > 0

    def volumes(self):
        """volume id -> entry, every page of ListVolumes."""
        out, token = {}, ""
        while True:
            page = self.csi("list-volumes", "--max", "100", "--token", token)
            for e in page["entries"]:
                out[e["volumeId"]] = e
            token = page["nextToken"]
            if not token:
                return out

    def stop(self, sig=signal.SIGTERM):
        harness.stop_process(self.proc, sig, timeout=20)
        self.proc = None

    def kill9(self):
        self.stop(signal.SIGKILL)

    def in_netns(self, argv):
        """`argv` run in the controller's namespace (nsenter execs it: the PID is the program's)."""
        return ["nsenter", f"--net=/var/run/netns/{self.netns}", *argv] if self.netns else argv

    def admin(self, *args, check=True):
        """An admin command (`list`, `remove-node`) against the controller, as an operator
        on the node network runs it."""
        tls = ["--ca-file", str(self.ca)] if self.ca else []
        return run(self.in_netns([str(CONTROLLER_BIN), *args, "--controller", self.address, *tls]), check=check)

    def agent_controller_cfg(self, token_file):
        """The `controller` section of an agent's configuration, without its underlay."""
        cfg = {"address": self.address, "tokenFile": str(token_file)}
        if self.ca:
            cfg["tls"] = {"caFile": str(self.ca)}
        elif self.netns:
            cfg["insecure"] = True
        return cfg

    def token(self, identity):
        return run([str(CONTROLLER_BIN), "token", "--config", str(self.cfg_path), identity]).stdout.strip()

    def nodes(self):
        """name -> {underlay, blocks, vtep} as the controller reports them (admin `list`)."""
        out = self.admin("list", "--token-file", str(self.admin_token_file)).stdout
        nodes = {}
        for line in out.splitlines()[1:]:
            name, underlay, blocks, vtep = line.split("\t")
            nodes[name] = {"underlay": underlay.split("=", 1)[1].split(","),
                           "blocks": [b for b in blocks.split("=", 1)[1].split(",") if b],
                           "vtep": vtep.split("=", 1)[1]}
        return nodes

    def remove_node(self, name):
        return self.admin("remove-node", "--token-file", str(self.admin_token_file), name).stdout


def underlay6(seg, host):
    """The IPv6 underlay address of host `host` on segment `seg` (canonical text form)."""
    return str(ipaddress.IPv6Address(f"fd19:{seg:x}::{host:x}"))


def _no_dad(ns_name, dev):
    run(["ip", "netns", "exec", ns_name, "sysctl", "-qw", f"net.ipv6.conf.{dev}.accept_dad=0"])


class Underlay:
    """The underlay namespace: one bridge per segment, routing between segments (IPv4, and
    IPv6 for the nodes attached with `ipv6=True`)."""

    def __init__(self, ns_name=None):
        if ns_name:
            run(["ip", "netns", "add", ns_name])
            run(["ip", "-n", ns_name, "link", "set", "lo", "up"])
            self.ns = harness.Netns.__new__(harness.Netns)
            self.ns.name, self.ns.path = ns_name, f"/var/run/netns/{ns_name}"
        else:
            self.ns = harness.Netns("ul")
        self.ns.exec(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        self.ns.exec(["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"])
        self.segments = {}
        self.count = 0

    def segment(self, seg):
        """Bridge ul<seg> with the router addresses 198.19.<seg>.254/24 and fd19:<seg>::fe/64."""
        if seg not in self.segments:
            br = f"ulbr{seg}"
            # A fixed MAC: a bridge without one takes its lowest port's, so it changes as nodes
            # come and go, and a node's cached neighbour entry for the router then points at
            # a MAC nobody has (its traffic to the controller, behind the router, is lost).
            run(["ip", "-n", self.ns.name, "link", "add", br, "address", f"02:19:00:00:{seg:02x}:fe", "type", "bridge"])
            _no_dad(self.ns.name, br)
            run(["ip", "-n", self.ns.name, "addr", "add", f"198.19.{seg}.254/24", "dev", br])
            run(["ip", "-n", self.ns.name, "addr", "add", f"{underlay6(seg, 0xfe)}/64", "dev", br, "nodad"])
            run(["ip", "-n", self.ns.name, "link", "set", br, "up"])
            self.segments[seg] = br
        return self.segments[seg]

    def attach(self, node_ns, seg, host, ipv6=False):
        """Connect a node namespace to segment `seg` as 198.19.<seg>.<host>; returns that
        address. With `ipv6`, the node also gets fd19:<seg>::<host>/64 (`underlay6`) and an
        IPv6 default route through the underlay router."""
        br = self.segment(seg)
        self.count += 1
        outer = f"ulp{self.count}"
        run(["ip", "-n", self.ns.name, "link", "add", outer, "type", "veth", "peer", "name", "ul0", "netns", node_ns.name])
        _no_dad(self.ns.name, outer)
        _no_dad(node_ns.name, "ul0")
        run(["ip", "-n", self.ns.name, "link", "set", outer, "master", br, "up"])
        addr = f"198.19.{seg}.{host}"
        run(["ip", "-n", node_ns.name, "addr", "add", f"{addr}/24", "dev", "ul0"])
        if ipv6:
            run(["ip", "-n", node_ns.name, "addr", "add", f"{underlay6(seg, host)}/64", "dev", "ul0", "nodad"])
        run(["ip", "-n", node_ns.name, "link", "set", "ul0", "up"])
        run(["ip", "-n", node_ns.name, "route", "add", "default", "via", f"198.19.{seg}.254"])
        if ipv6:
            run(["ip", "-n", node_ns.name, "-6", "route", "add", "default", "via", underlay6(seg, 0xfe)])
        return addr

    def delete(self):
        self.ns.delete()


def cluster_node(controller, underlay, seg, host, mode="auto", tag="cn", start=True, ipv6=False, token=None,
                 on_create=None, csi=None):
    """A simulated node in controller mode on the underlay.

    `ipv6`: the node also gets an IPv6 underlay address, advertised after the IPv4 one (the
    IPv4 address stays the VXLAN endpoint). `token`: the credential to configure instead of
    the node's own (auth tests). `on_create(node)` is called as soon as the node's namespace
    and directory exist, so a caller can clean them up even if the rest fails."""
    node = harness.Node(tag=tag, start=False)
    if on_create:
        on_create(node)
    addr = underlay.attach(node.ns, seg, host, ipv6=ipv6)
    token_file = node.root / "node.token"
    token_file.write_text(controller.token(node.ns.name) if token is None else token)
    node.token_file = token_file
    addrs = [addr] + ([underlay6(seg, host)] if ipv6 else [])
    node.cfg["podCidrs"] = []
    if csi is not None:
        node.cfg["csi"] = csi
    node.cfg["controller"] = {**controller.agent_controller_cfg(token_file), "underlayAddresses": addrs, "routeMode": mode}
    node.cfg_path.write_text(json.dumps(node.cfg))
    node.underlay = addr
    node.underlay6 = underlay6(seg, host) if ipv6 else None
    if start:
        node.start()
    return node


class Cluster:
    """One controller, one underlay namespace and the nodes made through it."""

    def __init__(self, pools=None, controller_extra=None):
        self.root = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX, dir="/tmp"))
        self.nodes = []
        self.controller = None
        self.underlay = None
        try:
            self.underlay = Underlay()
            self.underlay.ns.exec(["ip", "addr", "add", f"{CONTROLLER_IP}/32", "dev", "lo"])
            self.controller = Controller(self.root / "controller", pools=pools, start=False, extra=controller_extra,
                                         netns=self.underlay.ns.name)
            self.controller.start()
        except BaseException:
            self.close()
            raise

    def node(self, seg, host, mode="auto", ipv6=False, start=True, token=None, csi=None):
        n = cluster_node(self.controller, self.underlay, seg, host, mode=mode, start=False,
                         ipv6=ipv6, token=token, on_create=self.nodes.append, csi=csi)
        if start:
            n.start()
        return n

    def wait_connected(self, nodes, timeout=10):
        """Until every node's capacity is known to the controller (it can place there)."""
        harness.wait_until(lambda: all(self.controller.placeable(n.ns.name) for n in nodes), timeout=timeout,
                           what="the nodes' volume capacity at the controller")

    def close(self):
        errors = []
        for n in self.nodes:
            try:
                n.cleanup()
            except Exception as e:  # keep cleaning up the rest
                errors.append(e)
        if self.controller:
            self.controller.stop()
        if self.underlay:
            self.underlay.delete()
        shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise errors[0]
