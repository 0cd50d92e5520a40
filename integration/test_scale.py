"""Issue 21, scale: a real agent among 1,000 simulated peers, following the controller's
membership stream as deltas.

The peers are registered by `tools/scale_load.rs` (real gRPC Register calls, each with its
own token and VTEP MAC, underlay addresses in 198.18.0.0/15 that are only ever stored). The
real agent runs in VXLAN mode in a node namespace of a cluster (controller over TLS on the
underlay), with a 2 s route audit. Asserted from the kernel (`ip -j route`, `bridge fdb`,
`ip neigh` in the node namespace): its routes are exactly the peers' blocks; one peer leaving
removes exactly its routes, FDB entry and neighbours, nothing else; a joining peer is routed
within 1 s; a route deleted by hand comes back within the audit interval, and a stale one
added by hand under our protocol goes.
"""

import json
import re
import time

import cluster
import harness
from harness import run
from test_cluster import PROTO, VXLAN_DEV, net, our_routes

SCALE_BIN = harness.TARGET / "examples" / "benches"  # run as `benches scale_load ...`
POOLS = [{"cidr": "10.0.0.0/8", "blockPrefix": 24}, {"cidr": "fd00:10::/32", "blockPrefix": 64}]
PEERS = 1000
AUDIT_S = 2


def register(c, n, prefix, offset=0):
    argv = [str(SCALE_BIN), "scale_load", "--controller", c.controller.address, "--config", str(c.controller.cfg_path),
            "--nodes", str(n), "--prefix", prefix, "--register-only", "--ca-file", str(c.controller.ca),
            "--index-offset", str(offset)]
    out = run(c.controller.in_netns(argv), timeout=300).stdout
    got = json.loads(out)
    assert got["nodes"] == n and not got["failures"], got


def expected(c, me):
    """Destination CIDRs the node must route: every other node's blocks."""
    return {str(net(b)) for name, n in c.controller.nodes().items() if name != me for b in n["blocks"]}


def fdb(node):
    out = run(["bridge", "-j", "-n", node.ns.name, "fdb", "show", "dev", VXLAN_DEV]).stdout
    return {e["mac"]: e.get("dst") for e in (json.loads(out) if out.strip() else [])
            if "permanent" in e.get("state", "permanent") and e["mac"] != "00:00:00:00:00:00"}


def neigh(node):
    return {e["dst"] for fam in ("-4", "-6") for e in node.ns.ip_json(fam, "neigh", "show", "dev", VXLAN_DEV)
            if "PERMANENT" in e.get("state", [])}


def wait(what, cond, timeout):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got is True:
            return time.monotonic()
        assert time.monotonic() < deadline, f"{what}: {got}"
        time.sleep(0.05)


def test_real_agent_among_1000_simulated_peers():
    c = cluster.Cluster(pools=POOLS)
    try:
        register(c, PEERS, "peer")
        node = c.node(1, 1, mode="vxlan", start=False)
        node.cfg["controller"]["routeAuditSeconds"] = AUDIT_S
        node.cfg_path.write_text(json.dumps(node.cfg))
        node.start()
        me = node.ns.name
        want = expected(c, me)
        assert len(want) == 2 * PEERS
        wait("routes to every peer block", lambda: set(our_routes(node)) == want or len(our_routes(node)), 60)
        routes = our_routes(node)
        assert all(r.get("dev") == VXLAN_DEV and "onlink" in r.get("flags", []) for r in routes.values()), \
            [r for r in routes.values() if r.get("dev") != VXLAN_DEV][:3]
        assert len(fdb(node)) == PEERS
        assert len(neigh(node)) == 2 * PEERS

        # One peer leaves: exactly its routes, FDB entry and neighbours go.
        gone = c.controller.nodes()["peer-00500"]
        before_routes, before_fdb, before_neigh = our_routes(node), fdb(node), neigh(node)
        c.controller.remove_node("peer-00500")
        gone_dsts = {str(net(b)) for b in gone["blocks"]}
        wait("the leaving peer's routes removed", lambda: set(our_routes(node)) == want - gone_dsts or
             sorted(set(our_routes(node)) ^ (want - gone_dsts))[:4], 5)
        after = our_routes(node)
        assert {k: v for k, v in before_routes.items() if k not in gone_dsts} == after, "other routes changed"
        assert set(before_fdb) - set(fdb(node)) == {gone["vtep"]}
        assert len(before_neigh - neigh(node)) == 2 and len(neigh(node)) == 2 * (PEERS - 1)
        want -= gone_dsts

        # A peer joins: routed within 1 s of its registration.
        t0 = time.monotonic()
        register(c, 1, "joiner", offset=PEERS + 1)
        want = expected(c, me)
        t = wait("the joining peer routed", lambda: set(our_routes(node)) == want or len(our_routes(node)), 5)
        assert t - t0 < 1.0 + 0.5, f"join routed after {t - t0:.2f} s"

        # Drift: a route deleted by hand and a stale route of ours added by hand are repaired
        # by the audit.
        victim = sorted(want)[7]
        r = our_routes(node)[victim]
        fam = "-6" if ":" in victim else "-4"
        run(["ip", "-n", me, fam, "route", "del", victim])
        assert victim not in our_routes(node)
        run(["ip", "-n", me, "route", "add", "192.0.2.0/24", "dev", VXLAN_DEV, "proto", PROTO])
        t0 = time.monotonic()
        t = wait("the audit repairs the routes", lambda: set(our_routes(node)) == want or
                 sorted(set(our_routes(node)) ^ want)[:4], AUDIT_S + 3)
        assert t - t0 <= AUDIT_S + 1.0, f"repaired after {t - t0:.2f} s"
        assert our_routes(node)[victim].get("gateway") == r.get("gateway")
        # Two repairs: the route put back, the stale one removed.
        assert re.search(r'routes programmed kind="?audit"? peers=\d+ changes=2 ', node.log()), node.log()[-2000:]
    finally:
        c.close()
