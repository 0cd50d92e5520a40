"""Encryption of pod traffic between nodes (WireGuard): simulated nodes of one controller with
`encryption.mode` on or strict, checked on real kernel state and real packets.

- pods on two nodes ping (IPv4, IPv6) and stream TCP through `np.wg`, in direct and in VXLAN
  route mode; a capture on the underlay shows only WireGuard datagrams between the nodes,
  no marker the pods sent (the same capture on a pod's veth does show it), and no fragment;
- the pods' MTU is the device's: the largest unfragmented ping passes, one byte more does not;
- strict mode: a node whose key is withdrawn is unreachable, nothing leaves in clear;
- a rotation during a 10 ms ping and a TCP stream: no reset, the longest silence bounded;
- a removed node's peer is gone from the others;
- the device holds the gateways of the node's blocks only: a block the node lost (now another
  node's) leaves it.

This host's kernel has no WireGuard: the file runs in the VM lane (scripts/vm-test, on
Debian's 5.10, 6.1 and 6.12), and scripts/test leaves it out of the host lane, saying so.
"""

import json
import os
import re
import subprocess
import time
import warnings
from pathlib import Path

import pytest

import cluster
import harness

WG_DEV = "np.wg"
WG_PORT = 51871
MARKER = b"NODEPLANE-SECRET"  # 16 bytes: what `ping -p` can repeat in its payload
UNDERLAY_MTU = 1500
POD_MTU = UNDERLAY_MTU - 60  # IPv4 underlay: outer IPv4 20 + UDP 8 + WireGuard 32


@pytest.fixture(autouse=True)
def wireguard_kernel():
    if not Path("/sys/module/wireguard").exists() and subprocess.run(["modprobe", "wireguard"]).returncode != 0:
        pytest.fail("this kernel has no WireGuard: run this file in the VM lane "
                    "(scripts/vm-test -- test_encryption.py)")


@pytest.fixture
def make_cluster():
    made = []

    def make(mode="on", rotation=0, **kw):
        enc = {"mode": mode, "keyRotationSeconds": rotation}
        c = cluster.Cluster(controller_extra={"encryption": enc}, **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


def node(c, host, route_mode="direct", seg=0, ipv6=True):
    n = c.node(seg, host, mode=route_mode, ipv6=ipv6, start=False)
    n.cfg.pop("mtu", None)  # the agent derives the pods' MTU from the underlay and the mode
    n.cfg_path.write_text(json.dumps(n.cfg))
    n.start()
    return n


def wait_until(pred, timeout, what):
    deadline = time.time() + timeout * harness.TIME_SCALE
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wg_peers(n):
    """`wg show np.wg dump` in the node: public key -> (endpoint, allowed IPs, last handshake)."""
    r = n.ns.exec(["wg", "show", WG_DEV, "dump"], check=False)
    if r.returncode != 0:
        return {}
    lines = r.stdout.strip().splitlines()[1:]
    out = {}
    for line in lines:
        f = line.split("\t")
        out[f[0]] = (f[2], sorted(f[3].split(",")) if f[3] != "(none)" else [], int(f[4]))
    return out


def node_key(n, check=True):
    """The node's public key as its status says. Unchecked: "" while its node API is not up
    yet (an agent serves it once registered)."""
    _, doc = n.status("status", check=check)
    return (((doc or {}).get("controller") or {}).get("wireguard") or {}).get("publicKey") or ""


def wait_encrypted(nodes):
    """Every node holds every other node as a peer, with its blocks as allowed IPs, and
    routes the other nodes' blocks through np.wg."""
    def ready():
        keys = {n.ns.name: node_key(n, check=False) for n in nodes}
        if not all(keys.values()):
            return False
        for n in nodes:
            peers = wg_peers(n)
            for m in nodes:
                if m is n:
                    continue
                if keys[m.ns.name] not in peers:
                    return False
                routes = n.ns.ip_json("route", "show", "table", "main", "dev", WG_DEV) + \
                    n.ns.ip_json("-6", "route", "show", "table", "main", "dev", WG_DEV)
                if len(routes) < 2 * (len(nodes) - 1):
                    return False
        return keys
    return wait_until(ready, 20, "every node to hold every other as a wireguard peer")


def ping(src, ip, *extra, count=1):
    r = src.ns.exec(["ping", "-n", "-q", "-c", str(count), "-W", "2", *extra, ip], check=False)
    return r.returncode == 0


class Capture:
    """tcpdump in a namespace, writing a pcap file; stop() returns its bytes."""

    def __init__(self, ns, dev, path, expr=()):
        self.path = path
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns.name, "tcpdump", "-i", dev, "-n", "-U", "-s", "0",
                                      "-w", str(path), *expr], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # tcpdump says "listening on" once its socket is open.
        line = self.proc.stderr.readline().decode()
        assert "listening on" in line, line

    def stop(self):
        harness.stop_process(self.proc, timeout=10)
        return self.path.read_bytes()

    def summary(self, ns, expr=()):
        r = subprocess.run(["ip", "netns", "exec", ns.name, "tcpdump", "-n", "-r", str(self.path), *expr],
                           capture_output=True, text=True)
        return r.stdout.splitlines()


def tcp_transfer(src, dst_pod, ip, size=4 << 20, port=5201):
    """`size` bytes from `src` to `dst_pod` over TCP; the receiver's byte count."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", dst_pod.ns.name, "python3", "-c",
         "import socket,sys\n"
         f"s=socket.socket(socket.AF_INET6 if ':' in '{ip}' else socket.AF_INET)\n"
         "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
         f"s.bind(('{ip}',{port}));s.listen(1);print('up',flush=True)\n"
         "c,_=s.accept();n=0\n"
         "while True:\n b=c.recv(65536)\n if not b: break\n n+=len(b)\n"
         "print(n,flush=True)"],
        stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "up"
    src.ns.exec(["python3", "-c",
                 "import socket\n"
                 f"c=socket.create_connection(('{ip}',{port}),timeout=30)\n"
                 f"c.sendall(b'{MARKER.decode()}'*({size}//{len(MARKER)}));c.close()"])
    got = int(server.stdout.readline().strip())
    server.wait(timeout=30)
    return got


@pytest.mark.parametrize("route_mode", ["direct", "vxlan"])
def test_pod_traffic_between_nodes_is_encrypted(make_cluster, tmp_path, route_mode):
    c = make_cluster("on")
    a, b = node(c, 1, route_mode, ipv6=route_mode == "direct"), node(c, 2, route_mode, ipv6=route_mode == "direct")
    keys = wait_encrypted([a, b])
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    # The device and the pods: the MTU of the arithmetic; the device's port, peer and blocks.
    link = a.ns.ip_json("-d", "link", "show", WG_DEV)[0]
    assert link["mtu"] == POD_MTU, link
    for p in (pa, pb):
        eth0 = p.ns.links()["eth0"]
        assert eth0["mtu"] == POD_MTU, eth0
    peers = wg_peers(a)
    endpoint, allowed, _ = peers[keys[b.ns.name]]
    assert endpoint == f"{b.underlay}:{WG_PORT}", peers
    routes = a.ns.ip_json("route", "show", "table", "main", "proto", "78")
    assert routes and all(r["dev"] == WG_DEV for r in routes), routes
    if route_mode == "vxlan":
        fdb = a.ns.exec(["bridge", "fdb", "show", "dev", "np.vxlan"]).stdout
        assert " dst " not in fdb, f"the tunnel is not used for a peer with a key: {fdb}"

    under = Capture(a.ns, "ul0", tmp_path / "underlay.pcap", ["not", "host", cluster.CONTROLLER_IP])
    host_if = next(i["name"] for i in pa.result["interfaces"] if not i.get("sandbox"))
    clear = Capture(a.ns, host_if, tmp_path / "veth.pcap")
    hexmark = MARKER.hex()
    families = [pb.ip4()] + ([pb.ip6()] if route_mode == "direct" else [])
    for ip in families:
        assert ping(pa, ip, "-p", hexmark, count=3), f"{ip}: no echo reply through the tunnel"
    # The largest unfragmented IPv4 ping fits; one byte more does not leave the pod.
    assert ping(pa, pb.ip4(), "-M", "do", "-s", str(POD_MTU - 28), "-p", hexmark)
    assert not ping(pa, pb.ip4(), "-M", "do", "-s", str(POD_MTU - 27))
    assert tcp_transfer(pa, pb, pb.ip4()) == (4 << 20) // len(MARKER) * len(MARKER)
    seen_under, seen_clear = under.stop(), clear.stop()
    assert MARKER in seen_clear, "the pod's own veth shows the marker (the capture works)"
    assert MARKER not in seen_under, "the marker crossed the underlay in clear"
    # Neighbour discovery and MLD between the nodes' underlay addresses are the underlay's own.
    lines = under.summary(a.ns, ["(ip or ip6) and not (icmp6 and ip6[40] >= 130 and ip6[40] <= 143)"])
    assert lines, "nothing crossed the underlay"
    not_wg = [l for l in lines if f".{WG_PORT}:" not in l and f".{WG_PORT} >" not in l]
    assert not not_wg, f"non-WireGuard traffic between the nodes: {not_wg[:5]}"
    frags = under.summary(a.ns, ["ip[6:2] & 0x3fff != 0"])
    assert not frags, f"outer packets were fragmented (MTU arithmetic): {frags[:3]}"


def test_strict_mode_drops_traffic_to_a_node_without_a_key(make_cluster, tmp_path):
    c = make_cluster("strict")
    a, b = node(c, 1), node(c, 2)
    keys = wait_encrypted([a, b])
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    assert ping(pa, pb.ip4()) and ping(pa, pb.ip6())
    # b's key is withdrawn: its key file becomes unusable, it registers without one.
    b.stop()
    keyfile = b.root / "var/lib/nodeplane/wireguard.key"
    keyfile.write_text("withdrawn\n")
    b.start()
    wait_until(lambda: keys[b.ns.name] not in wg_peers(a), 20, "a to drop b's peer")
    blackholes = a.ns.exec(["ip", "route", "show", "type", "blackhole", "proto", "79"]).stdout
    assert "10.244.0.0/16" in blackholes, blackholes
    under = Capture(a.ns, "ul0", tmp_path / "underlay.pcap", ["not", "host", cluster.CONTROLLER_IP])
    assert not ping(pa, pb.ip4(), "-p", MARKER.hex())
    assert not ping(pa, pb.ip6(), "-p", MARKER.hex())
    seen = under.stop()
    assert MARKER not in seen, "strict mode let pod traffic out in clear"
    assert not [l for l in under.summary(a.ns, ["icmp", "or", "icmp6"]) if pb.ip4() in l or pb.ip6() in l]
    _, doc = a.status("status")
    assert doc["controller"]["encryption"] == "strict", doc["controller"]


def test_strict_mode_holds_from_the_start_after_a_reboot_with_the_controller_away(make_cluster, tmp_path):
    """A strict node that comes back from a reboot while the controller is away serves its
    pods from the blocks it saved; their traffic to other nodes is dropped, never sent in
    clear by the node's default route."""
    c = make_cluster("strict")
    a, b = node(c, 1, ipv6=False), node(c, 2, ipv6=False)
    wait_encrypted([a, b])
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    assert ping(pa, pb.ip4())
    # a's reboot, as its kernel state goes: the wireguard device (and the routes through it)
    # and the strict blackholes are gone. The controller is away.
    a.stop()
    c.controller.stop()
    a.ns.exec(["ip", "link", "del", WG_DEV])
    a.ns.exec(["ip", "route", "flush", "proto", "79"])
    # A node's default route, over the underlay: what has no better route leaves there.
    a.ns.exec(["ip", "route", "replace", "default", "via", b.underlay])
    a.start()
    blackholes = a.ns.exec(["ip", "route", "show", "type", "blackhole", "proto", "79"]).stdout
    assert "10.244.0.0/16" in blackholes, blackholes
    under = Capture(a.ns, "ul0", tmp_path / "underlay.pcap", ["not", "host", cluster.CONTROLLER_IP])
    assert not ping(pa, pb.ip4(), "-p", MARKER.hex())
    assert MARKER not in under.stop(), "pod traffic left in clear before the controller came back"


def test_a_node_without_a_device_withdraws_its_key_and_is_reached_in_clear(make_cluster):
    """Mode on: a node whose wireguard device cannot be made (a link of another kind holds
    its name) publishes no key, so its peers reach it in clear rather than through a tunnel
    no one answers."""
    c = make_cluster("on")
    a = node(c, 1, ipv6=False)
    b = c.node(0, 2, mode="direct", ipv6=False, start=False)
    b.cfg.pop("mtu", None)
    b.cfg_path.write_text(json.dumps(b.cfg))
    b.ns.exec(["ip", "link", "add", WG_DEV, "type", "bridge"])
    b.start()
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    wait_until(lambda: ping(pa, pb.ip4()), 20, "a's pod to reach b's pod")
    assert node_key(b) == "" and not wg_peers(a), (node_key(b), wg_peers(a))
    assert "withdrew its key" in b.log()


def test_rotation_keeps_tcp_and_ping_going(make_cluster):
    c = make_cluster("on")
    a, b = node(c, 1), node(c, 2)
    keys = wait_encrypted([a, b])
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    assert ping(pa, pb.ip4())
    # A TCP stream through the rotation: a line every 10 ms, echoed back.
    server = subprocess.Popen(
        ["ip", "netns", "exec", pb.ns.name, "python3", "-c",
         "import socket\n"
         f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{pb.ip4()}',5202))\n"
         "s.listen(1);print('up',flush=True);c,_=s.accept()\n"
         "while True:\n b=c.recv(4096)\n if not b: break\n c.sendall(b)\n"],
        stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "up"
    client = subprocess.Popen(
        ["ip", "netns", "exec", pa.ns.name, "python3", "-c",
         "import socket,time\n"
         f"c=socket.create_connection(('{pb.ip4()}',5202),timeout=20)\n"
         "for i in range(600):\n c.sendall(b'x'*64);n=0\n while n<64: n+=len(c.recv(64-n))\n time.sleep(0.01)\n"
         "c.close();print('done',flush=True)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pinger = subprocess.Popen(["ip", "netns", "exec", pa.ns.name, "ping", "-n", "-D", "-i", "0.01", "-w", "8",
                               pb.ip4()], stdout=subprocess.PIPE, text=True)
    time.sleep(2)
    out = subprocess.run([str(harness.CLI_BIN), "wireguard", "--socket", str(a.node_socket), "rotate"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    new_key = node_key(a)
    assert new_key != keys[a.ns.name] and new_key in out.stdout
    wait_until(lambda: new_key in wg_peers(b), 10, "b to learn a's new key")
    assert keys[a.ns.name] not in wg_peers(b), "a's old key is gone from b"
    replies, _ = pinger.communicate(timeout=30)
    stamps = [float(m) for m in re.findall(r"^\[(\d+\.\d+)\]", replies, re.M)]
    assert len(stamps) > 100, replies[-500:]
    gap = max(b2 - b1 for b1, b2 in zip(stamps, stamps[1:]))
    # The figure, in pytest's warnings summary (shown with -q, in the VM lane's pytest.log too).
    warnings.warn(f"figure: rotation: longest time without an echo reply {gap * 1000:.0f} ms "
                  f"over {len(stamps)} replies of a 10 ms ping")
    cout, cerr = client.communicate(timeout=60)
    server.wait(timeout=10)
    assert cout.strip() == "done", f"the TCP stream broke during the rotation: {cerr[-500:]}"
    assert gap <= 1.0 * harness.TIME_SCALE, f"{gap:.2f} s without an echo reply during the rotation"
    # The new key is on disk, private, and the peers handshook with it.
    keyfile = a.root / "var/lib/nodeplane/wireguard.key"
    assert oct(keyfile.stat().st_mode & 0o777) == "0o600"
    assert wg_peers(b)[new_key][2] > 0


def test_scheduled_rotation_and_readiness(make_cluster):
    """keyRotationSeconds: each node makes a new key once its key is that old, and its peer
    learns it; pods keep talking. The `encryption` readiness condition holds throughout."""
    c = make_cluster("on", rotation=4)
    a, b = node(c, 1), node(c, 2)
    keys = wait_encrypted([a, b])
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    conditions = lambda n: {x["name"]: x for x in n.status("status")[1]["conditions"]}
    wait_until(lambda: conditions(a).get("encryption", {}).get("ready"), 10, "the encryption condition")
    seen = [keys[a.ns.name]]
    for _ in range(2):
        new = wait_until(lambda: node_key(a) not in seen and node_key(a), 20, "a's key to rotate on schedule")
        seen.append(new)
        wait_until(lambda: new in wg_peers(b), 10, "b to learn a's new key")
        assert ping(pa, pb.ip4(), count=3), "no echo reply after a scheduled rotation"
    assert conditions(a)["encryption"]["ready"], conditions(a)
    assert node_key(b) != keys[b.ns.name], "b rotates on the same schedule"


def test_removed_node_peer_is_gone_everywhere(make_cluster):
    c = make_cluster("on")
    nodes = [node(c, h) for h in (1, 2, 3)]
    keys = wait_encrypted(nodes)
    gone = nodes[2]
    gone.stop()
    c.controller.remove_node(gone.ns.name)
    for n in nodes[:2]:
        wait_until(lambda: keys[gone.ns.name] not in wg_peers(n), 10, f"{n.ns.name} to drop the removed node's peer")
        assert len(wg_peers(n)) == 1
    # A node cannot publish another node's key: the controller refuses it.
    fake = c.node(0, 9, mode="direct", start=False)
    keyfile = fake.root / "var/lib/nodeplane/wireguard.key"
    keyfile.parent.mkdir(parents=True, exist_ok=True)
    keyfile.write_text((nodes[0].root / "var/lib/nodeplane/wireguard.key").read_text())
    os.chmod(keyfile, 0o600)
    fake.start(wait=False)
    wait_until(lambda: "a node publishes only its own key" in fake.log(), 20, "the controller to refuse a copied key")


def wg_addresses(n):
    """The addresses on the node's np.wg."""
    return {a["local"] for i in n.ns.ip_json("addr", "show", "dev", WG_DEV) for a in i.get("addr_info", [])}


def test_a_block_the_node_lost_leaves_its_device(make_cluster):
    c = make_cluster("on")
    a, b = node(c, 1), node(c, 2)
    wait_encrypted([a, b])
    old = wait_until(lambda: wg_addresses(b), 10, "b's gateways on its device")
    b.stop()
    c.controller.remove_node(b.ns.name)
    # A new node takes the blocks b held; b, back, gets others.
    d = node(c, 3)
    wait_until(lambda: old <= wg_addresses(d), 20, "the new node to hold b's old gateways")
    b.start()
    wait_encrypted([a, b, d])
    new = wait_until(lambda: wg_addresses(b) - old, 20, "b's new gateways on its device")
    wait_until(lambda: not (wg_addresses(b) & old), 10, "b's old gateways to leave its device")
    assert wg_addresses(b) == new, (wg_addresses(b), new)
