"""Cluster mode: `nodeplane-controller` hands out node blocks; agents route pod traffic
between simulated nodes (direct routes, VXLAN, auto), survive the controller going away and
re-sync when they come back.

Every node is its own network namespace on a private underlay namespace (integration/
cluster.py); pods are namespaces behind their node. The assertions are about real kernel
state inside those namespaces: routes with protocol 78 (nodeplane's mark), the VXLAN device,
its FDB and neighbour entries, pod addresses, and ICMP between pods. Nothing here touches the
host's root namespace, and only processes this suite started are ever signalled.
"""

import ipaddress
import os
import json
import re
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import cluster
import harness

PROTO = "78"  # RTPROT_NODEPLANE (0x4e), as `ip -j route` prints an unnamed protocol
VXLAN_DEV = "np.vxlan"
VNI = 4242  # the controller's default
VXLAN_PORT = 4789
LATEST = "1.1.0"  # STATUS exists from CNI 1.1.0 on
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Two blocks per family: a node removed and replaced leaves no room for anyone else.
TWO_BLOCK_POOLS = [{"cidr": "10.244.0.0/23", "blockPrefix": 24},
                   {"cidr": "fd00:10:244::/63", "blockPrefix": 64}]
# A pool of exactly four blocks per family: the fifth node finds it exhausted.
SMALL_POOLS = [{"cidr": "10.244.0.0/22", "blockPrefix": 24},
               {"cidr": "fd00:10:244::/62", "blockPrefix": 64}]


# ----- fixtures -----


Cluster = cluster.Cluster


@pytest.fixture
def make_cluster():
    made = []

    def make(**kw):
        c = Cluster(**kw)  # cleans up after itself when it fails half-way
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


# ----- helpers -----


def wait_until(pred, timeout=5.0, interval=0.01, what="condition"):
    """Poll `pred` until truthy; returns (value, seconds waited). Fails after `timeout`."""
    t0 = time.monotonic()
    while True:
        value = pred()
        if value:
            return value, time.monotonic() - t0
        if time.monotonic() - t0 >= timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def clean_log(text):
    return ANSI.sub("", text)


def net(s):
    return ipaddress.ip_network(s, strict=False)


def gateway_of(block):
    """First host of a block: the address the owning node's bridge holds."""
    return str(net(block).network_address + 1)


def is_v6(block):
    return net(block).version == 6


def our_routes(node):
    """nodeplane's routes (protocol 78) in the node's main table, both families: dst -> route."""
    out = {}
    for fam in ("-4", "-6"):
        for r in node.ns.ip_json(fam, "route", "show", "table", "main"):
            if r.get("protocol") == PROTO:
                out[str(net(r["dst"]))] = r
    return out


def vxlan_link(node):
    links = node.ns.ip_json("-d", "link", "show")
    return next((l for l in links if l["ifname"] == VXLAN_DEV), None)


def vxlan_fdb(node):
    """Permanent unicast FDB entries of the VXLAN device: mac -> dst."""
    if vxlan_link(node) is None:
        return {}
    out = node.ns.exec(["bridge", "-j", "fdb", "show", "dev", VXLAN_DEV]).stdout
    return {e["mac"]: e.get("dst") for e in (json.loads(out) if out.strip() else [])
            if e.get("state") == "permanent" and e["mac"] != "00:00:00:00:00:00"}


def vxlan_neigh(node):
    """Permanent neighbour entries on the VXLAN device: ip -> lladdr."""
    if vxlan_link(node) is None:
        return {}
    out = {}
    for fam in ("-4", "-6"):
        for n in node.ns.ip_json(fam, "neigh", "show", "dev", VXLAN_DEV):
            if "PERMANENT" in n.get("state", []):
                out[n["dst"]] = n.get("lladdr")
    return out


def cluster_state(node):
    p = node.root / "var/lib/nodeplane/cluster.json"
    return json.loads(p.read_text()) if p.exists() else None


def status_conf(node):
    """A hand-built 1.1.0 conf for a node whose conflist may not exist yet."""
    return {"cniVersion": LATEST, "name": "nodeplane", "type": "nodeplane", "agentSocket": str(node.socket)}


def status(node, conf=None):
    """STATUS through the shim binary itself (the installed copy may not exist yet)."""
    return node.cni("STATUS", ifname="", conf=conf or status_conf(node), shim=harness.SHIM_BIN)


def underlay_of(rec, v6):
    return next((a for a in rec["underlay"] if ipaddress.ip_address(a).version == (6 if v6 else 4)), None)


def expected_routes(node, recs, kind_of):
    """What `node` should route: peer block -> (kind, peer name)."""
    want = {}
    for name, rec in recs.items():
        if name == node.ns.name:
            continue
        for b in rec["blocks"]:
            want[str(net(b))] = (kind_of(node, name, is_v6(b)), name)
    return want


def routes_match(node, recs, kind_of):
    """Kernel routes of `node` are exactly the planned ones, each of the planned kind."""
    have = our_routes(node)
    want = expected_routes(node, recs, kind_of)
    if set(have) != set(want):
        return False
    for dst, (kind, peer) in want.items():
        dev = have[dst].get("dev")
        if (kind == "vxlan") != (dev == VXLAN_DEV):
            return False
    return True


def assert_routes(node, recs, kind_of):
    """Every peer block routed exactly as planned; nothing else carries protocol 78."""
    have = our_routes(node)
    want = expected_routes(node, recs, kind_of)
    me = node.ns.name
    assert set(have) == set(want), f"{me}: routes {sorted(have)} != peer blocks {sorted(want)}"
    fdb, neigh = vxlan_fdb(node), vxlan_neigh(node)
    tunnelled_peers = set()
    for dst, (kind, peer) in want.items():
        r, rec = have[dst], recs[peer]
        if kind == "direct":
            assert r.get("dev") == "ul0", f"{me}: {dst} should be direct over ul0: {r}"
            assert r.get("gateway") == underlay_of(rec, is_v6(dst)), f"{me}: {dst} via {r.get('gateway')}, want peer {peer} {rec['underlay']}"
            assert "onlink" not in r.get("flags", []), r
        else:
            gw = gateway_of(dst)
            assert r.get("dev") == VXLAN_DEV, f"{me}: {dst} should go over {VXLAN_DEV}: {r}"
            assert r.get("gateway") == gw, f"{me}: {dst} via {r.get('gateway')}, want block gateway {gw}"
            assert "onlink" in r.get("flags", []), f"{me}: VXLAN route {dst} is not onlink: {r}"
            assert neigh.get(gw) == rec["vtep"], f"{me}: neighbour {gw} -> {neigh.get(gw)}, want {peer}'s VTEP {rec['vtep']}"
            tunnelled_peers.add(peer)
    # One FDB entry per tunnelled peer (its VTEP MAC -> its IPv4 underlay address), no others.
    want_fdb = {recs[p]["vtep"]: underlay_of(recs[p], False) for p in tunnelled_peers}
    assert fdb == want_fdb, f"{me}: VXLAN FDB {fdb} != {want_fdb}"
    assert set(neigh) == {gateway_of(d) for d, (k, _) in want.items() if k == "vxlan"}, f"{me}: stray neighbours {neigh}"


def assert_vtep(node, recs):
    """The node's VXLAN device: VNI, local underlay, port, learning off, advertised MAC."""
    link = vxlan_link(node)
    assert link is not None, f"{node.ns.name}: no {VXLAN_DEV} device"
    info = link["linkinfo"]
    assert info["info_kind"] == "vxlan", link
    d = info["info_data"]
    assert d["id"] == VNI and d["port"] == VXLAN_PORT, d
    assert d["local"] == node.underlay, d
    assert d.get("learning") is False, f"learning should be off: {d}"
    assert "UP" in link["flags"], link
    assert link["address"] == recs[node.ns.name]["vtep"], f"device MAC {link['address']} != advertised {recs[node.ns.name]['vtep']}"


def wait_routes(nodes, controller, kind_of, timeout=5.0):
    """Wait until every node routes exactly the controller's peer blocks; returns the records."""
    recs = controller.nodes()

    def converged():
        return all(routes_match(n, recs, kind_of) for n in nodes)

    try:
        wait_until(converged, timeout, interval=0.02, what="routes to converge")
    except AssertionError:
        for n in nodes:
            assert_routes(n, recs, kind_of)  # the precise complaint
        raise
    return recs


def ping(src, ip, deadline=5):
    """One echo reply from `ip`, re-sending every 0.2 s for up to `deadline` seconds."""
    r = src.ns.exec(["ping", "-n", "-q", "-c", "1", "-i", "0.2", "-w", str(deadline), ip], check=False)
    return r.returncode == 0


def assert_mesh(pods, families=(4, 6), deadline=5):
    """Every pod pings every other pod, in every family, all pings in parallel."""
    jobs = []
    for a in pods:
        for b in pods:
            if a is b:
                continue
            for fam in families:
                jobs.append((a, b, b.ip4() if fam == 4 else b.ip6()))
    with ThreadPoolExecutor(max_workers=48) as ex:
        results = list(ex.map(lambda j: ping(j[0], j[2], deadline), jobs))
    failed = [f"{a.ns.name}@{a.node.ns.name} -> {ip} ({b.node.ns.name})"
              for (a, b, ip), ok in zip(jobs, results) if not ok]
    assert not failed, f"{len(failed)}/{len(jobs)} pings failed: " + "; ".join(failed)


def in_block(ip, blocks):
    return any(ipaddress.ip_address(ip) in net(b) for b in blocks)


def assert_pods_in_blocks(pods, recs):
    for p in pods:
        blocks = recs[p.node.ns.name]["blocks"]
        for ip in p.ips():
            assert in_block(ip, blocks), f"pod {p.ns.name} got {ip}, outside its node's blocks {blocks}"


def assert_no_block_twice(recs):
    blocks = [(name, net(b)) for name, rec in recs.items() for b in rec["blocks"]]
    for i, (n1, b1) in enumerate(blocks):
        for n2, b2 in blocks[i + 1:]:
            assert not b1.overlaps(b2), f"block {b1} ({n1}) overlaps {b2} ({n2})"


def registered_since(controller, offset, name):
    return f"registered node={name} " in clean_log(controller.log()[offset:])


# ----- 1. 3 nodes x 3 pods, direct and VXLAN -----


def test_direct_mode_three_nodes_three_pods(make_cluster):
    """One L2 segment, dual-stack underlay, mode "direct": every peer block is routed via the
    peer's underlay address of its family (protocol 78), no tunnel entries; 9 pods all
    ping each other over IPv4 and IPv6."""
    c = make_cluster()
    nodes = [c.node(0, h, mode="direct", ipv6=True) for h in (1, 2, 3)]
    pods = [n.add_pod(f"p{i}")[0] for n in nodes for i in range(3)]
    recs = wait_routes(nodes, c.controller, lambda *_: "direct")
    assert len(recs) == 3
    assert_no_block_twice(recs)
    assert_pods_in_blocks(pods, recs)
    for n in nodes:
        assert_routes(n, recs, lambda *_: "direct")
        assert not vxlan_fdb(n) and not vxlan_neigh(n)
    assert_mesh(pods)


def test_vxlan_mode_three_nodes_three_pods(make_cluster):
    """Mode "vxlan" (IPv4 underlay): each node has np.vxlan (VNI, local address, learning
    off, the MAC it advertised), one permanent FDB entry per peer, a permanent neighbour per
    peer block gateway and `<block> via <gateway> dev np.vxlan onlink` routes; 9 pods all ping
    each other over IPv4 and IPv6."""
    c = make_cluster()
    nodes = [c.node(0, h, mode="vxlan") for h in (1, 2, 3)]
    pods = [n.add_pod(f"p{i}")[0] for n in nodes for i in range(3)]
    recs = wait_routes(nodes, c.controller, lambda *_: "vxlan")
    assert_no_block_twice(recs)
    assert_pods_in_blocks(pods, recs)
    for n in nodes:
        assert_vtep(n, recs)
        assert_routes(n, recs, lambda *_: "vxlan")
    assert_mesh(pods)


# ----- 2. auto mode across two segments -----


def test_auto_mode_two_segments(make_cluster):
    """Nodes A and B share segment 0, C is on segment 1 (routed underlay): A and B route each
    other's blocks directly (both families, dual-stack underlay), everything to or from C
    goes over VXLAN; all pods ping each other."""
    c = make_cluster()
    a, b = c.node(0, 1, ipv6=True), c.node(0, 2, ipv6=True)
    cc = c.node(1, 3, ipv6=True)
    seg = {a.ns.name: 0, b.ns.name: 0, cc.ns.name: 1}

    def kind(node, peer, v6):
        return "direct" if seg[node.ns.name] == seg[peer] else "vxlan"

    pods = [n.add_pod(f"p{i}")[0] for n in (a, b, cc) for i in range(2)]
    recs = wait_routes([a, b, cc], c.controller, kind)
    for n in (a, b, cc):
        assert_vtep(n, recs)
        assert_routes(n, recs, kind)
    # Spelled out: A -> B direct, A -> C tunnelled, C -> both tunnelled.
    ra, rc = our_routes(a), our_routes(cc)
    for blk in recs[b.ns.name]["blocks"]:
        assert ra[str(net(blk))]["dev"] == "ul0"
    for blk in recs[cc.ns.name]["blocks"]:
        assert ra[str(net(blk))]["dev"] == VXLAN_DEV
    assert all(r["dev"] == VXLAN_DEV for r in rc.values()) and len(rc) == 4
    assert_mesh(pods)


def test_pod_mtu_derived_from_the_underlay_and_mode(make_cluster):
    """Without `mtu` in its config, the agent derives the pods' MTU when it registers: the
    underlay link's MTU less VXLAN's 50 bytes in vxlan mode, less nothing in direct mode.
    The figure is kept in cluster.json for the next start; the conflist names none."""
    c = make_cluster()
    overhead = {"vxlan": 50, "direct": 0}
    for host, mode in ((1, "vxlan"), (2, "direct")):
        n = c.node(0, host, mode=mode, start=False)
        n.cfg.pop("mtu", None)
        n.cfg_path.write_text(json.dumps(n.cfg))
        n.start()
        pod = n.add_pod("p")[0]
        want = n.ns.links()["ul0"]["mtu"] - overhead[mode]
        assert pod.ns.links()["eth0"]["mtu"] == want, mode
        assert cluster_state(n)["podMtu"] == want, mode
        assert "mtu" not in json.loads(n.conflist_path.read_text())["plugins"][0], mode


# ----- IPv6 right after a node comes up -----


def test_new_nodes_pods_answer_ipv6_at_once(make_cluster):
    """A pod whose ADD succeeded is reachable from other nodes at once, over IPv6 as over
    IPv4: one echo request sent right after ADD is answered within a second. (The receiving
    node forwards into its bridge only once it can solicit the pod's address, for which the
    bridge's link-local address must not still be tentative from duplicate address detection.)"""
    c = make_cluster()
    a, b = c.node(0, 1, mode="vxlan"), c.node(0, 2, mode="vxlan")
    wait_routes([a, b], c.controller, lambda *_: "vxlan")
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    single = ["ping", "-n", "-q", "-c", "1", "-W", "1"]
    v4 = pa.ns.exec(single + [pb.ip4()], check=False).returncode == 0
    v6 = pa.ns.exec(single + [pb.ip6()], check=False).returncode == 0
    bridge = b.ns.exec(["ip", "-6", "addr", "show", "dev", "np0", "scope", "link"]).stdout.strip()
    assert v4, "IPv4 echo to a fresh pod on another node got no answer within 1 s"
    assert v6, ("IPv6 echo to a fresh pod on another node got no answer within 1 s "
                f"(receiving node's bridge link-local: {bridge!r})")


# ----- 3. joining and leaving -----


def test_node_joins_later(make_cluster):
    """A third node joins a running 2-node cluster: both others route to its blocks within
    1 s of its agent starting (its blocks are not known before it registers, so the clock
    stops when both others hold routes via its IPv4 and IPv6 underlay addresses; the routes'
    destinations are then checked against the controller), and its pods reach theirs."""
    c = make_cluster()
    a, b = c.node(0, 1, ipv6=True), c.node(0, 2, ipv6=True)
    pods = [a.add_pod("p")[0], b.add_pod("p")[0]]
    wait_routes([a, b], c.controller, lambda *_: "direct")
    n3 = c.node(0, 3, ipv6=True, start=False)

    def both_route_to_n3():
        for n in (a, b):
            gws = {r.get("gateway") for r in our_routes(n).values()}
            if not {n3.underlay, n3.underlay6} <= gws:
                return False
        return True

    t0 = time.monotonic()
    n3.start(wait=False)
    wait_until(both_route_to_n3, timeout=5, interval=0.005, what="routes to the new node")
    took = time.monotonic() - t0
    print(f"route convergence after the new agent started: {took * 1000:.0f} ms")
    assert took <= 1.0, f"the others routed to the new node after {took:.3f}s (> 1 s)"
    n3.wait_ready()
    recs = wait_routes([a, b, n3], c.controller, lambda *_: "direct")
    for n in (a, b, n3):
        assert_routes(n, recs, lambda *_: "direct")
    pods.append(n3.add_pod("p")[0])
    assert_pods_in_blocks(pods, recs)
    assert_mesh(pods)


def test_node_removed_routes_go_and_blocks_return(make_cluster):
    """Four nodes fill a 4-block pool; a fifth cannot register (STATUS 50, a clear error).
    Removing a node (agent stopped, then `remove-node`) takes its routes, FDB and neighbour
    entries off every other node within 1 s, and its blocks go to the waiting fifth node,
    which becomes ready and is routed to."""
    c = make_cluster(pools=SMALL_POOLS)
    nodes = [c.node(0, h) for h in (1, 2, 3, 4)]  # auto, IPv4 underlay: v4 direct, v6 VXLAN

    def kind(node, peer, v6):
        return "vxlan" if v6 else "direct"

    recs = wait_routes(nodes, c.controller, kind)
    assert_no_block_twice(recs)
    a, b, victim, d = nodes
    pods = [a.add_pod("p")[0], victim.add_pod("p")[0]]
    assert_mesh(pods)

    # The pool is full: a fifth node gets no block and says so.
    late = c.node(0, 5, start=False)
    late.start(wait=False)
    wait_until(lambda: late.socket.exists() and late.ready_in_log(), what="the fifth agent to listen")
    wait_until(lambda: "no free block" in clean_log(late.log()), what="the exhaustion error in the agent log")
    rc, parsed, raw = status(late)
    assert rc != 0 and parsed and parsed["code"] == 50, f"STATUS of a node without block: {raw}"
    assert late.ns.name not in c.controller.nodes()
    assert not late.conflist_path.exists()

    # Remove a node: its agent first, then the controller's record.
    gone = recs[victim.ns.name]
    others = [a, b, d]

    def traces(n):
        """What of the removed node is left in `n`'s kernel. The waiting fifth node may take
        over the same blocks at any moment, so traces are told apart by next hop and VTEP MAC."""
        left = [dst for dst, r in our_routes(n).items() if r.get("gateway") == gone["underlay"][0]]
        left += [f"fdb {mac}" for mac in vxlan_fdb(n) if mac == gone["vtep"]]
        left += [f"neigh {ip}" for ip, mac in vxlan_neigh(n).items() if mac == gone["vtep"]]
        return left

    def all_gone():
        return not any(traces(n) for n in others)

    for n in others:
        assert len(traces(n)) == 3, f"{n.ns.name} should route to {victim.ns.name}: {traces(n)}"
    victim.stop()
    c.controller.remove_node(victim.ns.name)
    t0 = time.monotonic()
    wait_until(all_gone, timeout=5, interval=0.005, what="the removed node's routes to disappear")
    took = time.monotonic() - t0
    print(f"routes of the removed node gone everywhere after {took * 1000:.0f} ms")
    assert took <= 1.0, f"the removed node's routes lingered {took:.3f}s (> 1 s)"
    assert victim.ns.name not in c.controller.nodes()

    # Its blocks return to the pool: the waiting node gets exactly them.
    wait_until(lambda: late.conflist_path.exists(), timeout=6, what="the fifth node to get blocks")
    recs = c.controller.nodes()
    assert sorted(recs[late.ns.name]["blocks"]) == sorted(gone["blocks"]), (recs[late.ns.name], gone)
    assert_no_block_twice(recs)
    rc, _, raw = status(late)
    assert rc == 0, f"STATUS after getting blocks: {raw}"
    live = [a, b, d, late]
    recs = wait_routes(live, c.controller, kind)
    for n in live:
        assert_routes(n, recs, kind)
    pods = [pods[0], late.add_pod("p")[0]]
    assert_pods_in_blocks(pods, recs)
    assert_mesh(pods)


def test_removed_node_with_running_agent_stops_using_released_blocks(make_cluster):
    """A node removed while its agent still runs (`remove-node` on a live node) loses its
    blocks: once the controller hands them to another node, the removed node must not
    allocate pod addresses from them any more (ADD fails, or uses a block the controller
    now assigns to it); otherwise two nodes give out the same pod addresses."""
    c = make_cluster(pools=TWO_BLOCK_POOLS)
    a, b = c.node(0, 1), c.node(0, 2)
    released = c.controller.nodes()[b.ns.name]["blocks"]
    # b's agent keeps running, but is held (SIGSTOP) until d has taken the released blocks:
    # otherwise b's own re-registration (100 ms after it sees the removal) can win the only
    # free block and d never starts. While held, b still has its blocks and its stream.
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        c.controller.remove_node(b.ns.name)
        d = c.node(0, 3)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    recs = c.controller.nodes()
    assert sorted(recs[d.ns.name]["blocks"]) == sorted(released), "precondition: d took b's released blocks"
    pd = d.add_pod("p")[0]
    # b sees the new membership (it was queued on its stream while it was held).
    wait_until(lambda: "node removed by the controller" in b.log(), timeout=10, what=f"{b.ns.name} to see its removal")

    pod = harness.Pod(b, "late")
    b.pods.append(pod)
    rc, res, raw = b.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=b.netconf())
    if rc == 0:
        ips = [i["address"].split("/")[0] for i in res["ips"]]
        mine = c.controller.nodes().get(b.ns.name, {"blocks": []})["blocks"]
        dup = [ip for ip in ips if in_block(ip, recs[d.ns.name]["blocks"])]
        assert not dup, (f"removed node {b.ns.name} allocated {dup} from blocks the controller gave to "
                         f"{d.ns.name} (whose pod has {pd.ips()}); controller now assigns it {mine}")
        assert all(in_block(ip, mine) for ip in ips), f"{ips} outside {b.ns.name}'s blocks {mine}"


def test_node_back_after_removal_reaches_the_node_with_its_old_blocks(make_cluster):
    """A node removed while down, then started again, gets new blocks; the node that took its
    old ones is routed to from it. Its bridge must no longer hold the old blocks' gateways
    (no pod uses them): their connected routes would send that node's pods' traffic onto
    the bridge, and the peer routes were refused beside them."""
    c = make_cluster()
    a, b = c.node(0, 1), c.node(0, 2)
    old = c.controller.nodes()[b.ns.name]["blocks"]
    b.stop()
    c.controller.remove_node(b.ns.name)
    d = c.node(0, 3)
    assert sorted(c.controller.nodes()[d.ns.name]["blocks"]) == sorted(old), "precondition: d took b's blocks"
    b.start()
    wait_until(lambda: c.controller.nodes().get(b.ns.name, {}).get("blocks"), what=f"{b.ns.name} to register again")
    recs = wait_routes([a, b, d], c.controller, lambda n, p, v6: "vxlan" if v6 else "direct")
    assert not set(recs[b.ns.name]["blocks"]) & set(old), recs[b.ns.name]
    pods = [n.add_pod("p")[0] for n in (a, b, d)]
    assert_pods_in_blocks(pods, recs)
    assert_mesh(pods)


# ----- 4. controller kill -9 -----


def test_controller_kill9_restart_keeps_blocks(make_cluster):
    """kill -9 the controller under three running agents and restart it: every node
    re-registers with the very same blocks, no block is held twice, the agents' local
    copies agree, and pods keep pinging throughout."""
    c = make_cluster()
    nodes = [c.node(0, h, ipv6=True) for h in (1, 2, 3)]
    pods = [n.add_pod("p")[0] for n in nodes]
    before = wait_routes(nodes, c.controller, lambda *_: "direct")
    assert_mesh(pods)

    c.controller.kill9()
    assert_mesh(pods)  # the data path does not need the controller

    offset = len(c.controller.log())
    c.controller.start()
    wait_until(lambda: all(registered_since(c.controller, offset, n.ns.name) for n in nodes),
               timeout=6, what="every agent to re-register")
    after = c.controller.nodes()
    assert {k: sorted(v["blocks"]) for k, v in after.items()} == {k: sorted(v["blocks"]) for k, v in before.items()}
    assert_no_block_twice(after)
    for n in nodes:
        assert sorted(cluster_state(n)["blocks"]) == sorted(after[n.ns.name]["blocks"])
        assert_routes(n, after, lambda *_: "direct")
    pods += [n.add_pod("q")[0] for n in nodes]
    assert_pods_in_blocks(pods, after)
    assert_mesh(pods)


# ----- 5. controller down -----


def test_controller_down_nodes_keep_serving(make_cluster):
    """With the controller stopped: existing pods keep talking across nodes; ADD on a node
    with a block still works; an agent restarted meanwhile serves its persisted blocks
    (STATUS 0, ADD); a brand-new node answers STATUS 50 until the controller is back, then
    registers, becomes ready and is routed to."""
    c = make_cluster()
    a, b = c.node(0, 1, ipv6=True), c.node(0, 2, ipv6=True)
    pa, pb = a.add_pod("p")[0], b.add_pod("p")[0]
    recs = wait_routes([a, b], c.controller, lambda *_: "direct")
    c.controller.stop()

    # Existing pods.
    assert_mesh([pa, pb])
    # A new pod on a node with a block.
    pa2 = a.add_pod("q")[0]
    assert_pods_in_blocks([pa2], recs)
    rc, _, raw = a.cni("STATUS", ifname="", conf=a.netconf(version=LATEST))
    assert rc == 0, f"STATUS with the controller down: {raw}"

    # An agent restarted while the controller is down serves its persisted blocks.
    b.restart()
    rc, _, raw = b.cni("STATUS", ifname="", conf=b.netconf(version=LATEST))
    assert rc == 0, f"STATUS after restart without controller: {raw}"
    assert sorted(cluster_state(b)["blocks"]) == sorted(recs[b.ns.name]["blocks"])
    pb2 = b.add_pod("q")[0]
    assert_pods_in_blocks([pb2], recs)
    assert_routes(b, recs, lambda *_: "direct")  # the kernel kept them across the restart
    assert_mesh([pa, pa2, pb, pb2])

    # A brand-new node has no block to serve from.
    n3 = c.node(0, 3, ipv6=True, start=False)
    n3.start(wait=False)
    wait_until(lambda: n3.socket.exists() and n3.ready_in_log(), what="the new agent to listen")
    rc, parsed, raw = status(n3)
    assert rc != 0 and parsed and parsed["code"] == 50, f"STATUS of a node without block: {raw}"
    assert "not reachable" not in parsed["msg"], f"the agent itself should answer: {raw}"
    assert not n3.conflist_path.exists()

    # The controller comes back: the new node registers and becomes ready.
    c.controller.start()
    wait_until(lambda: n3.conflist_path.exists() and n3.ready_in_log(), timeout=6,
               what="the new node to register once the controller is back")
    rc, _, raw = status(n3)
    assert rc == 0, f"STATUS after registering: {raw}"
    recs = wait_routes([a, b, n3], c.controller, lambda *_: "direct")
    assert {k: v["blocks"] for k, v in recs.items() if k != n3.ns.name} == \
        {k: v["blocks"] for k, v in c.controller.nodes().items() if k != n3.ns.name}
    p3 = n3.add_pod("p")[0]
    assert_pods_in_blocks([pa, pb2, p3], recs)
    assert_mesh([pa, pb2, p3])


# ----- 6. agent-side authentication -----


def _rejected_agents(c, owner):
    """Agents configured with bad credentials: another node's token, a forged one (this
    node's name, another node's signature) and garbage. Returns {case: node}."""
    other = c.controller.token(owner.ns.name)
    imp = c.node(0, 11, token=other, start=False)
    forged_sig = other.rsplit(".", 1)[1]
    forged = c.node(0, 12, start=False)
    forged.token_file.write_text(f"np1.{forged.ns.name}.{forged_sig}")
    garbage = c.node(0, 13, token="garbage", start=False)
    cases = {"impersonator": imp, "forged": forged, "garbage": garbage}
    for n in cases.values():
        n.start(wait=False)
    for name, n in cases.items():
        wait_until(lambda: "controller session ended" in clean_log(n.log()), timeout=5,
                   what=f"the {name} agent's registration to be refused")
    return cases


def test_agent_with_bad_credentials_is_rejected(make_cluster):
    """Another node's token, a forged token and garbage: none registers, none becomes ready
    (STATUS 50, no conflist), the victim's record is untouched; a node's token cannot
    remove another node."""
    c = make_cluster()
    a, b = c.node(0, 1), c.node(0, 2)
    before = c.controller.nodes()
    cases = _rejected_agents(c, a)
    time.sleep(0.3)  # a few retries' worth
    recs = c.controller.nodes()
    assert recs == before, f"registry changed: {recs} vs {before}"
    for name, n in cases.items():
        assert n.ns.name not in recs, name
        assert not n.conflist_path.exists(), f"{name} agent became ready"
        rc, parsed, raw = status(n)
        assert rc != 0 and parsed and parsed["code"] == 50, f"{name}: STATUS {raw}"
        assert cluster_state(n) in (None, {}) or not cluster_state(n).get("blocks"), f"{name}: {cluster_state(n)}"
    assert 'may not act for node' in clean_log(cases["impersonator"].log())
    for name in ("forged", "garbage"):
        assert "invalid token" in clean_log(cases[name].log()), name
    # No routes towards the rejected agents anywhere.
    for n in (a, b):
        gws = {r.get("gateway") for r in our_routes(n).values()}
        assert not gws & {x.underlay for x in cases.values()}

    # A node credential may not remove another node.
    tok = a.root / "a.token"
    tok.write_text(c.controller.token(a.ns.name))
    res = c.controller.admin("remove-node", "--token-file", str(tok), b.ns.name, check=False)
    assert res.returncode != 0, f"node {a.ns.name} removed node {b.ns.name}: {res.stdout}"
    assert b.ns.name in c.controller.nodes()


def test_rejected_agent_logs_the_grpc_code(make_cluster):
    """The agent's log names the gRPC status of a refused registration, as operators grep
    for it: PERMISSION_DENIED for another node's token, UNAUTHENTICATED for a bad token."""
    c = make_cluster()
    a = c.node(0, 1)
    cases = _rejected_agents(c, a)
    code = {"impersonator": r"PERMISSION_DENIED|PermissionDenied",
            "forged": r"UNAUTHENTICATED|Unauthenticated",
            "garbage": r"UNAUTHENTICATED|Unauthenticated"}
    wrong = {}
    for name, n in cases.items():
        lines = [l for l in clean_log(n.log()).splitlines() if "controller session ended" in l]
        if not re.search(code[name], lines[0]):
            wrong[name] = lines[0]
    assert not wrong, "agent log lacks the gRPC code name: " + json.dumps(wrong, indent=1)


def test_agents_reach_the_controller_only_over_verified_tls(make_cluster):
    """The cluster helper's controller serves TCP + TLS on the underlay. An agent given a CA
    that did not sign the controller's certificate, and one configured for plaintext, never
    register (and say why in their logs); the correctly configured node beside them does."""
    c = make_cluster()
    good = c.node(0, 1)
    assert good.ns.name in c.controller.nodes()
    other_ca = c.root / "other-ca"
    harness.run([str(cluster.CONTROLLER_BIN), "certs", "init", "--dir", str(other_ca), "--san", cluster.CONTROLLER_IP])
    wrong_ca = c.node(0, 2, start=False)
    wrong_ca.cfg["controller"]["tls"]["caFile"] = str(other_ca / "ca.crt")
    plain = c.node(0, 3, start=False)
    del plain.cfg["controller"]["tls"]
    plain.cfg["controller"]["insecure"] = True
    for n in (wrong_ca, plain):
        n.cfg_path.write_text(json.dumps(n.cfg))
        n.start(wait=False)
    wait_until(lambda: "UnknownIssuer" in clean_log(wrong_ca.log()) or "unknown issuer" in clean_log(wrong_ca.log()),
               timeout=15, what="the agent with the wrong CA to log the refused certificate")
    wait_until(lambda: "insecure: true" in clean_log(plain.log()) and "controller session ended" in clean_log(plain.log()),
               timeout=15, what="the plaintext agent to warn and fail its session")
    wait_until(lambda: "TLS handshake failed" in c.controller.log(), timeout=15,
               what="the controller to log the plaintext client")
    names = set(c.controller.nodes())
    assert good.ns.name in names and wrong_ca.ns.name not in names and plain.ns.name not in names, names
    for n in (wrong_ca, plain):
        assert not n.conflist_path.exists(), f"{n.ns.name} has no block, so no CNI config"


# ----- 7. re-sync after reconnect -----


def test_agent_resyncs_routes_after_reconnect(make_cluster):
    """Node A's agent is down while node B is removed: A's kernel still holds B's routes, FDB
    and neighbour entries (nothing could tell it). When A's agent comes back, its first
    full sync removes every trace of B and keeps C."""
    c = make_cluster()
    a, b, cc = c.node(0, 1), c.node(0, 2), c.node(0, 3)  # auto, IPv4 underlay: v6 tunnelled

    def kind(node, peer, v6):
        return "vxlan" if v6 else "direct"

    recs = wait_routes([a, b, cc], c.controller, kind)
    gone = recs[b.ns.name]
    a.stop()
    b.stop()
    c.controller.remove_node(b.ns.name)
    # C follows at once; A cannot.
    after = c.controller.nodes()
    wait_until(lambda: routes_match(cc, after, kind), timeout=2, what="C to drop B's routes")
    time.sleep(0.2)
    stale = our_routes(a)
    assert all(str(net(blk)) in stale for blk in gone["blocks"]), f"A should still hold B's routes while down: {stale}"
    assert gone["vtep"] in vxlan_fdb(a)

    a.start()
    wait_until(lambda: routes_match(a, after, kind), timeout=3, what="A to re-sync after reconnect")
    assert_routes(a, after, kind)
    assert gone["vtep"] not in vxlan_fdb(a)
    assert not any(gateway_of(blk) in vxlan_neigh(a) for blk in gone["blocks"])
    pods = [a.add_pod("p")[0], cc.add_pod("p")[0]]
    assert_mesh(pods)


def test_full_block_gets_another_from_the_controller(make_cluster):
    """/29 blocks hold 5 pods each: the 6th ADD finds the IPv4 block full, the agent asks
    the controller for another block (RequestBlock) and the pod gets an address from it;
    the bridge gets the new gateway; the other node routes to the new block too."""
    c = make_cluster(pools=[{"cidr": "10.244.0.0/26", "blockPrefix": 29},
                            {"cidr": "fd00:10:244::/48", "blockPrefix": 64}])
    a, b = c.node(0, 1), c.node(0, 2)
    first = set(c.controller.nodes()[a.ns.name]["blocks"])
    pods = [a.add_pod("fill")[0] for _ in range(5)]
    assert all(in_block(p.ip4(), [x for x in first if ":" not in x]) for p in pods)
    extra, _ = a.add_pod("more")
    blocks = c.controller.nodes()[a.ns.name]["blocks"]
    v4 = [x for x in blocks if ":" not in x]
    assert len(v4) == 2, blocks
    new_block = next(x for x in v4 if x not in first)
    assert in_block(extra.ip4(), [new_block]), (extra.ip4(), new_block)
    assert json.loads((a.root / "var/lib/nodeplane/cluster.json").read_text())["blocks"].count(new_block) == 1
    gw = str(next(net(new_block).hosts()))
    assert f"{gw}/29" in a.ns.addrs("np0")
    # The other node learns the new block and its pods reach the new pod.
    wait_until(lambda: new_block in our_routes(b), what=f"route to {new_block} on node b")
    pb, _ = b.add_pod("peer")
    assert ping(pb, extra.ip4()) and ping(extra, pb.ip4())
    assert ping(pb, extra.ip6())
