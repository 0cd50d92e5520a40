"""Prometheus `/metrics` on the agent (its `healthAddress`, in the node's namespace) and on the
controller (`healthAddress`): every figure is checked against what the test did or against
the state it can see for itself (leases, blocks, volumes, mounts, device nodes).

The exposition is parsed with `prometheus_client` (PyPI `prometheus-client`, installed by
scripts/install-deps), so a format error fails the test; a few rules the parser forgives
(HELP and TYPE before the samples, no family twice) are checked on the raw text.
"""

import ipaddress
import json
import os
import socket
import functools
import time
import urllib.request

# A hard requirement: without the parser these tests must fail, never skip.
from prometheus_client.parser import text_string_to_metric_families

import cluster
import harness

MIB = 1 << 20
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


wait_for = functools.partial(harness.wait_until, timeout=20.0)


class Scrape:
    """One parsed exposition: sample lookup by name and exact labels."""

    def __init__(self, text):
        self.text = text
        self._check_layout(text)
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    @staticmethod
    def _check_layout(text):
        assert text.endswith("\n"), "the exposition ends with a line feed"
        typed, helped, sampled = set(), set(), []
        for line in text.splitlines():
            assert line.strip(), "no blank lines"
            if line.startswith("# HELP "):
                name = line.split(" ")[2]
                assert name not in helped, f"HELP twice for {name}"
                helped.add(name)
            elif line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ")
                assert name not in typed, f"TYPE twice for {name}"
                assert name in helped, f"TYPE before HELP for {name}"
                assert kind in ("counter", "gauge", "histogram"), line
                typed.add(name)
            else:
                assert not line.startswith("#"), line
                name = line.split("{")[0].split(" ")[0]
                family = next((f for f in (name, name.rsplit("_", 1)[0]) if f in typed), None)
                assert family, f"sample {name} without a TYPE line before it"
                sampled.append(family)
        # A family's samples are contiguous.
        seen = []
        for f in sampled:
            if not seen or seen[-1] != f:
                assert f not in seen, f"samples of {f} are not together"
                seen.append(f)

    def family(self, name):
        return self.families.get(name)

    def get(self, name, **labels):
        """The value of sample `name` with exactly `labels`, or None."""
        for s in self.samples:
            if s.name == name and s.labels == labels:
                return s.value
        return None

    def value(self, name, **labels):
        v = self.get(name, **labels)
        assert v is not None, f"no sample {name}{labels} in:\n{self.text}"
        return v

    def labelled(self, name):
        """[(labels, value)] of every sample called `name`."""
        return [(s.labels, s.value) for s in self.samples if s.name == name]


def agent_scrape(node):
    r = harness.health_request(node.ns, "/metrics")
    assert r is not None, "the agent's health endpoint does not answer"
    assert r["status"] == 200, r
    assert r["headers"]["content-type"] == CONTENT_TYPE, r["headers"]
    return Scrape(r["body"])


def http_scrape(port, ns=None, host="127.0.0.1", ca=None):
    """/metrics on `host`:`port`, here or inside namespace `ns` (a cluster's controller
    runs in the underlay namespace, and its health endpoint is HTTPS: verified against `ca`)."""
    if ns is not None:
        r = harness.health_request(ns, "/metrics", port=port, host=host, ca=ca)
        assert r is not None and r["status"] == 200, r
        assert r["headers"]["content-type"] == CONTENT_TYPE, r["headers"]
        return Scrape(r["body"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["content-type"] == CONTENT_TYPE, r.headers
        return Scrape(r.read().decode())


def ops(s, command, result):
    return s.get("nodeplane_cni_operations_total", command=command, result=result) or 0


def hist(s, name, **labels):
    """(cumulative buckets [(le, count)], count, sum) of one histogram child, checked for
    consistency: buckets non-decreasing, +Inf equal to count."""
    buckets = sorted(((float(l["le"]), v) for l, v in s.labelled(f"{name}_bucket")
                      if {k: v for k, v in l.items() if k != "le"} == labels), key=lambda b: b[0])
    count = s.get(f"{name}_count", **labels)
    total = s.get(f"{name}_sum", **labels)
    if count is None:
        assert not buckets, f"{name}{labels}: buckets without a count"
        return [], 0, 0.0
    assert buckets and buckets[-1][0] == float("inf"), f"{name}{labels}: no +Inf bucket"
    assert buckets[-1][1] == count, f"{name}{labels}: +Inf bucket {buckets[-1][1]} != count {count}"
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"{name}{labels}: buckets not cumulative {buckets}"
    return buckets, count, total




def usable(cidr):
    """Pod addresses of a block: all but network and gateway, and the IPv4 broadcast (as the
    float the exposition carries: an IPv6 /64 exceeds a float's exact integers)."""
    net = ipaddress.ip_network(cidr)
    return float(net.num_addresses - (3 if net.version == 4 else 2))


def test_agent_metrics_follow_cni_ipam_csi_and_devices():
    node = harness.Node(tag="met", start=False)
    pods = []
    try:
        dev = harness.make_devices(node, "metdev", count=2, share=2)
        node.start()
        resource = "nodeplane.dev/metdev"
        wait_for(lambda: agent_scrape(node).get("nodeplane_device_plugin_devices", resource=resource, health="Healthy") == 4,
                 what="4 healthy device IDs (2 devices shared 2 ways)")
        before = agent_scrape(node)
        # The gauges are there from the start; counters and histograms with their first sample
        # (checked below, once the work is done).
        for name in ["nodeplane_ipam_block_addresses", "nodeplane_ipam_block_allocated", "nodeplane_ipam_leases",
                     "nodeplane_csi_volumes", "nodeplane_csi_staged", "nodeplane_csi_published",
                     "nodeplane_device_plugin_devices", "nodeplane_build_info"]:
            f = before.family(name)
            assert f is not None and f.type == "gauge", f"{name}: {f}"
        # Standalone: no controller, so no controller metrics.
        assert before.family("nodeplane_controller_connected") is None

        # The work: 3 ADDs, 2 CHECKs, 1 DEL that succeed; an ADD and a CHECK that fail.
        for i in range(3):
            pods.append(node.add_pod(f"mp{i}")[0])
        for p in pods[:2]:
            conf = node.netconf()
            conf["prevResult"] = p.result
            rc, _, raw = node.cni("CHECK", p.cid, "eth0", p.ns.path, conf=conf)
            assert rc == 0, raw
        gone = pods.pop()
        rc, _, raw = node.cni("DEL", gone.cid, "eth0", gone.ns.path)
        assert rc == 0, raw
        gone.ns.delete()
        # A failed ADD the agent answers (a missing netns is refused by the shim itself, which
        # opens it: the agent never sees that one): the same attachment ADDed again.
        rc, err, raw = node.cni("ADD", pods[0].cid, "eth0", pods[0].ns.path)
        assert rc != 0 and err and err.get("code"), raw
        add_code = str(err["code"])
        conf = node.netconf()
        conf["prevResult"] = pods[0].result
        rc, err, raw = node.cni("CHECK", "metrics-unknown-container", "eth0", pods[0].ns.path, conf=conf)
        assert rc != 0 and err and err.get("code"), raw
        check_code = str(err["code"])

        after = agent_scrape(node)
        expected = {("ADD", "ok"): 3, ("CHECK", "ok"): 2, ("DEL", "ok"): 1, ("ADD", add_code): 1, ("CHECK", check_code): 1}
        name = "nodeplane_cni_operation_duration_seconds"
        for (command, result), n in expected.items():
            moved = ops(after, command, result) - ops(before, command, result)
            assert moved == n, f"{command}/{result}: counter moved by {moved}, expected {n}"
            _, c0, s0 = hist(before, name, command=command, result=result)
            buckets, c1, s1 = hist(after, name, command=command, result=result)
            assert c1 - c0 == n, f"{command}/{result}: histogram count moved by {c1 - c0}, expected {n}"
            assert s1 > s0, f"{command}/{result}: the durations add up to more than nothing"
            assert s1 - s0 < 60 * n, f"{command}/{result}: durations implausibly long ({s1 - s0} s)"
            assert [b for b, _ in buckets[:-1]] == [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
        # Nothing else was counted.
        total = lambda s: sum(v for _, v in s.labelled("nodeplane_cni_operations_total"))
        assert total(after) - total(before) == sum(expected.values()), after.labelled("nodeplane_cni_operations_total")

        # IPAM: two pods left, one address of each family each; the blocks are the configured ones.
        assert len(node.leases()) == 2
        assert after.value("nodeplane_ipam_leases") == 2
        blocks = {l["block"] for l, _ in after.labelled("nodeplane_ipam_block_addresses")}
        assert blocks == {node.v4, node.v6}, blocks
        for b in (node.v4, node.v6):
            assert after.value("nodeplane_ipam_block_addresses", block=b) == usable(b), b
            assert after.value("nodeplane_ipam_block_allocated", block=b) == 2, b

        # CSI: no volumes here; one call that fails is counted with its code.
        assert after.value("nodeplane_csi_volumes") == 0
        assert after.value("nodeplane_csi_staged") == 0 and after.value("nodeplane_csi_published") == 0
        nf = lambda s: s.get("nodeplane_csi_operations_total", method="NodeUnstageVolume", code="NotFound") or 0
        with_err = node.csi("unstage", "--id", "no-such-volume", "--staging", node.staging_path("no-such-volume"), check=False)
        assert with_err.get("code") == "NotFound", with_err
        last = agent_scrape(node)
        assert nf(last) - nf(after) == 1
        for name, kind in [("nodeplane_cni_operations", "counter"), ("nodeplane_cni_operation_duration_seconds", "histogram"),
                           ("nodeplane_cni_step_duration_seconds", "histogram"), ("nodeplane_csi_operations", "counter"),
                           ("nodeplane_csi_operation_duration_seconds", "histogram")]:
            f = last.family(name)
            assert f is not None and f.type == kind, f"{name}: {f}"

        # Devices: one device node disappears; its two IDs turn unhealthy.
        (dev / "metdev1").unlink()
        wait_for(lambda: agent_scrape(node).get("nodeplane_device_plugin_devices", resource=resource, health="Unhealthy") == 2,
                 what="2 unhealthy device IDs after a device node is removed")
        assert agent_scrape(node).value("nodeplane_device_plugin_devices", resource=resource, health="Healthy") == 2
    finally:
        for p in pods:
            p.ns.delete()
        node.cleanup()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_controller_and_agent_metrics_in_a_cluster():
    port = free_port()
    c = cluster.Cluster(controller_extra={"healthAddress": f"{cluster.CONTROLLER_IP}:{port}", "orphanGraceSeconds": 2})
    scrape = lambda: http_scrape(port, c.underlay.ns, host=cluster.CONTROLLER_IP, ca=c.controller.ca)
    pods = []
    try:
        started = time.time()
        ctl = c.controller
        n1 = c.node(1, 1, csi={"capacityBytes": 512 * MIB})
        n2 = c.node(1, 2, csi={"capacityBytes": 512 * MIB})
        c.wait_connected([n1, n2], timeout=20)

        s = scrape()
        assert s.value("nodeplane_controller_leader") == 1
        nodes = ctl.nodes()
        assert s.value("nodeplane_controller_nodes") == len(nodes) == 2
        pools = {"10.244.0.0/16": 2 ** 8, "fd00:10:244::/48": 2 ** 16}
        for pool, size in pools.items():
            assert s.value("nodeplane_controller_pool_blocks", pool=pool) == size
            held = sum(1 for n in nodes.values() for b in n["blocks"] if (":" in b) == (":" in pool))
            assert held == 2 or ":" in pool, nodes
            assert s.value("nodeplane_controller_pool_blocks_allocated", pool=pool) == held, pool
        assert s.value("nodeplane_controller_volume_streams") == 2
        for state in ("creating", "ready", "deleting"):
            assert s.value("nodeplane_controller_volumes", state=state) == 0
        for method in ("Register", "WatchNodes", "WatchVolumes", "ReportVolumes"):
            assert s.value("nodeplane_controller_requests_total", method=method, code="OK") >= 2, method

        # A node credential used for another node: refused, and counted as such.
        bad = c.root / "n1.token"
        bad.write_text(n1.token_file.read_text())
        res = ctl.admin("remove-node", "--token-file", str(bad), n2.ns.name, check=False)
        assert res.returncode != 0
        s2 = scrape()
        assert s2.value("nodeplane_controller_requests_total", method="RemoveNode", code="PermissionDenied") == 1
        assert s2.value("nodeplane_controller_nodes") == 2

        # A volume on n1, staged and published there.
        vid = ctl.csi("create-volume", "--name", "pvc-metrics", "--size", 64 * MIB, "--node", n1.ns.name)["volumeId"]
        staging, target = n1.staging_path(vid), n1.target_path(vid)
        n1.csi("stage", "--id", vid, "--staging", staging, "--fs", "ext4")
        n1.csi("publish", "--id", vid, "--staging", staging, "--target", target, "--fs", "ext4")
        wait_for(lambda: scrape().get("nodeplane_controller_volumes", state="ready") == 1, what="volume ready")
        s = scrape()
        assert s.value("nodeplane_controller_volumes", state="ready") == len(ctl.volumes()) == 1
        assert s.value("nodeplane_controller_volumes", state="creating") == 0

        a = agent_scrape(n1)
        assert a.value("nodeplane_csi_volumes") == len(n1.volume_files()) == 1
        assert a.value("nodeplane_csi_staged") == 1 and a.value("nodeplane_csi_published") == 1
        assert a.value("nodeplane_csi_provisioned_bytes") == 64 * MIB
        assert a.value("nodeplane_csi_capacity_bytes") == 512 * MIB
        for method in ("NodeStageVolume", "NodePublishVolume"):
            assert a.value("nodeplane_csi_operations_total", method=method, code="OK") == 1
            _, count, _ = hist(a, "nodeplane_csi_operation_duration_seconds", method=method)
            assert count == 1
        assert agent_scrape(n2).value("nodeplane_csi_volumes") == 0

        # Controller connectivity, and the blocks the controller assigned.
        assert a.value("nodeplane_controller_connected") == 1
        last = a.value("nodeplane_controller_last_message_timestamp_seconds")
        assert started - 1 <= last <= time.time() + 1, (started, last)
        mine = nodes[n1.ns.name]["blocks"]
        assert {l["block"] for l, _ in a.labelled("nodeplane_ipam_block_addresses")} == set(mine)
        pod, _ = n1.add_pod("mpc")
        pods.append(pod)
        a = agent_scrape(n1)
        for b in mine:
            assert a.value("nodeplane_ipam_block_addresses", block=b) == usable(b)
            assert a.value("nodeplane_ipam_block_allocated", block=b) == 1

        # Unpublish and unstage: the mount gauges follow.
        n1.csi("unpublish", "--id", vid, "--target", target)
        n1.csi("unstage", "--id", vid, "--staging", staging)
        a = agent_scrape(n1)
        assert a.value("nodeplane_csi_staged") == 0 and a.value("nodeplane_csi_published") == 0
        ctl.csi("delete-volume", "--id", vid)
        wait_for(lambda: scrape().value("nodeplane_controller_volumes", state="ready") == 0, what="volume gone")
        assert agent_scrape(n1).value("nodeplane_csi_volumes") == 0

        # A node removed: nodes and allocated blocks drop at once.
        n2.stop()
        ctl.remove_node(n2.ns.name)
        s = scrape()
        assert s.value("nodeplane_controller_nodes") == 1
        left = ctl.nodes()[n1.ns.name]["blocks"]
        for pool in pools:
            held = sum(1 for b in left if (":" in b) == (":" in pool))
            assert s.value("nodeplane_controller_pool_blocks_allocated", pool=pool) == held, pool
        wait_for(lambda: scrape().value("nodeplane_controller_volume_streams") == 1, what="one volume stream")

        # The controller goes away: the agent says so.
        ctl.stop()
        wait_for(lambda: agent_scrape(n1).value("nodeplane_controller_connected") == 0, what="controller_connected 0")
        # The removal of n2 was a membership update: a later message than before.
        assert agent_scrape(n1).value("nodeplane_controller_last_message_timestamp_seconds") > last
    finally:
        for p in pods:
            p.ns.delete()
        c.close()
