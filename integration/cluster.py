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


class Controller:
    def __init__(self, root, pools=None, start=True, extra=None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket = self.root / "controller.sock"
        self.address = f"unix:{self.socket}"
        self.cfg = {
            "dataDir": str(self.root / "data"),
            "listen": self.address,
            "pools": pools or [{"cidr": "10.244.0.0/16", "blockPrefix": 24},
                               {"cidr": "fd00:10:244::/48", "blockPrefix": 64}],
        }
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
        self.proc = subprocess.Popen([str(CONTROLLER_BIN), "serve", "--config", str(self.cfg_path)],
                                     stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited {self.proc.returncode}: {self.log()}")
            if self.socket.exists() and " ready" in self.log()[offset:]:
                return
            time.sleep(0.02)
        raise RuntimeError(f"controller not ready: {self.log()}")

    def log(self):
        return self.log_path.read_text() if self.log_path.exists() else ""

    def csi(self, *args, check=True):
        """Call the controller's CSI socket (Identity + Controller) with `nodeplane csi`."""
        return harness.csi_call(self.csi_socket, *args, check=check)

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

    def token(self, identity):
        return run([str(CONTROLLER_BIN), "token", "--config", str(self.cfg_path), identity]).stdout.strip()

    def nodes(self):
        """name -> {underlay, blocks, vtep} as the controller reports them (admin `list`)."""
        out = run([str(CONTROLLER_BIN), "list", "--controller", self.address,
                   "--token-file", str(self.admin_token_file)]).stdout
        nodes = {}
        for line in out.splitlines()[1:]:
            name, underlay, blocks, vtep = line.split("\t")
            nodes[name] = {"underlay": underlay.split("=", 1)[1].split(","),
                           "blocks": [b for b in blocks.split("=", 1)[1].split(",") if b],
                           "vtep": vtep.split("=", 1)[1]}
        return nodes

    def remove_node(self, name):
        return run([str(CONTROLLER_BIN), "remove-node", "--controller", self.address,
                    "--token-file", str(self.admin_token_file), name]).stdout


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
            run(["ip", "-n", self.ns.name, "link", "add", br, "type", "bridge"])
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
    node.cfg["controller"] = {"address": controller.address, "tokenFile": str(token_file),
                              "underlayAddresses": addrs, "routeMode": mode}
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
            self.controller = Controller(self.root / "controller", pools=pools, start=False, extra=controller_extra)
            self.controller.start()
            self.underlay = Underlay()
        except BaseException:
            self.close()
            raise

    def node(self, seg, host, mode="auto", ipv6=False, start=True, token=None, csi=None):
        n = cluster_node(self.controller, self.underlay, seg, host, mode=mode, start=False,
                         ipv6=ipv6, token=token, on_create=self.nodes.append, csi=csi)
        if start:
            n.start()
        return n

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
