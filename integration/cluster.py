"""A local cluster: one controller process and simulated nodes on a private underlay.

The underlay is its own network namespace holding a bridge per segment; every node namespace
is attached to one segment by a veth pair. Segments are joined by the underlay namespace
routing between them, so nodes on different segments are not on a shared L2 (VXLAN is then
needed). Everything lives in namespaces this code creates; the host's root namespace is not
touched. Underlay addresses come from 198.19.0.0/16 (RFC 2544 benchmarking range), used
only inside these namespaces.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import harness
from harness import run

CONTROLLER_BIN = harness.TARGET / "nodeplane-controller"


class Controller:
    def __init__(self, root, pools=None, start=True):
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

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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


class Underlay:
    """The underlay namespace: one bridge per segment, routing between segments."""

    def __init__(self, ns_name=None):
        if ns_name:
            run(["ip", "netns", "add", ns_name])
            run(["ip", "-n", ns_name, "link", "set", "lo", "up"])
            self.ns = harness.Netns.__new__(harness.Netns)
            self.ns.name, self.ns.path = ns_name, f"/var/run/netns/{ns_name}"
        else:
            self.ns = harness.Netns("ul")
        self.ns.exec(["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        self.segments = {}
        self.count = 0

    def segment(self, seg):
        """Bridge ul<seg> with the router address 198.19.<seg>.254/24."""
        if seg not in self.segments:
            br = f"ulbr{seg}"
            run(["ip", "-n", self.ns.name, "link", "add", br, "type", "bridge"])
            run(["ip", "-n", self.ns.name, "addr", "add", f"198.19.{seg}.254/24", "dev", br])
            run(["ip", "-n", self.ns.name, "link", "set", br, "up"])
            self.segments[seg] = br
        return self.segments[seg]

    def attach(self, node_ns, seg, host):
        """Connect a node namespace to segment `seg` as 198.19.<seg>.<host>; returns the address."""
        br = self.segment(seg)
        self.count += 1
        outer = f"ulp{self.count}"
        run(["ip", "-n", self.ns.name, "link", "add", outer, "type", "veth", "peer", "name", "ul0", "netns", node_ns.name])
        run(["ip", "-n", self.ns.name, "link", "set", outer, "master", br, "up"])
        addr = f"198.19.{seg}.{host}"
        run(["ip", "-n", node_ns.name, "addr", "add", f"{addr}/24", "dev", "ul0"])
        run(["ip", "-n", node_ns.name, "link", "set", "ul0", "up"])
        run(["ip", "-n", node_ns.name, "route", "add", "default", "via", f"198.19.{seg}.254"])
        return addr

    def delete(self):
        self.ns.delete()


def cluster_node(controller, underlay, seg, host, mode="auto", tag="cn", start=True):
    """A simulated node in controller mode on the underlay."""
    node = harness.Node(tag=tag, start=False)
    addr = underlay.attach(node.ns, seg, host)
    token_file = node.root / "node.token"
    token_file.write_text(controller.token(node.ns.name))
    node.cfg["podCidrs"] = []
    node.cfg["controller"] = {"address": controller.address, "tokenFile": str(token_file),
                              "underlayAddresses": [addr], "routeMode": mode}
    node.cfg_path.write_text(json.dumps(node.cfg))
    node.underlay = addr
    if start:
        node.start()
    return node
