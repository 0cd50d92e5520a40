"""The agent's health endpoint (`healthAddress`, default 127.0.0.1:9640 in the node's network
namespace): liveness from start to shutdown, readiness that follows the node's block, the
conflist, CSI recovery and the device plugins, never the controller's reachability; the port
closed once the agent has stopped.

Requests are made from inside the simulated node's namespace (`harness.health_request`).
"""

import shutil
import signal
import subprocess
import tempfile
import functools
import time
from pathlib import Path

import cluster
import harness


wait_for = functools.partial(harness.wait_until, timeout=20.0)


def get(node, path, **kw):
    return harness.health_request(node.ns, path, **kw)


def status(node, path):
    r = get(node, path)
    return None if r is None else r["status"]


def verbose_lines(node):
    r = get(node, "/readyz?verbose")
    return r["status"], r["body"].splitlines()


def assert_alive(node):
    assert node.proc is not None and node.proc.poll() is None, f"agent exited: {node.log()}"


def stop_and_assert_port_closed(node):
    """SIGTERM the agent, wait for it, and check nothing listens on the health port any more."""
    proc = node.proc
    node.stop(signal.SIGTERM)
    assert proc.returncode == 0, f"agent exit status {proc.returncode}: {node.log()}"
    assert get(node, "/healthz") is None, "health port still open after the agent stopped"


def test_standalone_endpoints_and_shutdown(node):
    """A standalone node (podCidrs configured): ready once started; each endpoint's contract."""
    r = get(node, "/healthz")
    assert (r["status"], r["body"]) == (200, "ok\n")
    assert r["headers"]["content-type"].startswith("text/plain")
    # CSI recovery and the device plugin manager may still be finishing right after start.
    wait_for(lambda: status(node, "/readyz") == 200, what="/readyz 200")
    r = get(node, "/readyz")
    assert r["body"] == "ok\n"
    code, lines = verbose_lines(node)
    assert code == 200
    assert lines == ["[+]cni ok", "[+]csi ok", "[+]deviceplugins ok", "readyz check passed"], lines

    r = get(node, "/metrics")  # the content is tested in test_metrics.py
    assert r["status"] == 200 and r["headers"]["content-type"].startswith("text/plain; version=0.0.4"), r
    assert get(node, "/")["status"] == 404
    r = get(node, "/readyz", method="POST")
    assert r["status"] == 405 and "GET" in r["headers"]["allow"], r
    r = get(node, "/healthz", method="HEAD")
    assert (r["status"], r["body"]) == (200, "")

    # Readiness is judged from the node's state: without the conflist no runtime can use
    # nodeplane, so the node is not ready (liveness is unaffected).
    saved = node.conflist_path.read_bytes()
    node.conflist_path.unlink()
    wait_for(lambda: status(node, "/readyz") == 503, what="/readyz 503 after the conflist is removed")
    r = get(node, "/readyz")
    assert r["body"] == f"cni: conflist {node.conflist_path} is missing\n", r["body"]
    assert status(node, "/healthz") == 200
    node.conflist_path.write_bytes(saved)
    wait_for(lambda: status(node, "/readyz") == 200, what="/readyz 200 once the conflist is back")

    stop_and_assert_port_closed(node)
    assert "health endpoint stopped" in node.log()


def test_controller_mode_ready_follows_the_block_not_the_controller():
    """Controller mode with the controller down: alive but not ready (no block); ready once the
    controller assigns a block; still ready when the controller goes away; ready again after
    a restart from the persisted block alone; the port closed after each stop."""
    root = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX, dir="/tmp"))
    ctl = underlay = node = None
    try:
        ctl = cluster.Controller(root / "controller", start=False)
        underlay = cluster.Underlay()
        node = cluster.cluster_node(ctl, underlay, seg=1, host=11, start=False)
        node.start(wait=False)

        # Liveness answers during start, before the node has any block.
        r = wait_for(lambda: get(node, "/healthz"), what="the health endpoint to answer")
        assert (r["status"], r["body"]) == (200, "ok\n")
        r = get(node, "/readyz")
        assert r["status"] == 503, r
        assert "cni: no pod CIDR block yet" in r["body"], r["body"]
        # CSI recovery and the device plugins finish without the controller; cni waits.
        wait_for(
            lambda: verbose_lines(node)[1][1:] == ["[+]csi ok", "[+]deviceplugins ok", "readyz check failed"],
            what="csi and deviceplugins ready while cni is not",
        )
        code, lines = verbose_lines(node)
        assert code == 503 and lines[0].startswith("[-]cni failed: no pod CIDR block yet"), lines
        # Still not ready a while later: nothing changes without a block.
        time.sleep(1.0)
        assert status(node, "/readyz") == 503
        assert not node.conflist_path.exists()
        assert_alive(node)

        # The controller comes up: the node registers, gets its blocks, writes the conflist.
        ctl.start()
        wait_for(lambda: status(node, "/readyz") == 200, what="/readyz 200 once the controller assigned a block")
        assert node.conflist_path.exists()
        assert get(node, "/readyz")["body"] == "ok\n"
        assert ctl.nodes()[node.ns.name]["blocks"], "the controller lists the node's blocks"

        # The controller goes away: the node keeps serving its blocks and stays ready.
        ctl.stop()
        for _ in range(10):
            assert status(node, "/readyz") == 200, "readiness must not depend on the controller"
            time.sleep(0.2)

        stop_and_assert_port_closed(node)

        # Restart with the controller still down: ready from the persisted block alone.
        node.start(wait=False)
        wait_for(lambda: status(node, "/healthz") == 200, what="liveness after the restart")
        wait_for(lambda: status(node, "/readyz") == 200, what="/readyz 200 from the persisted block")
        stop_and_assert_port_closed(node)
    finally:
        if node:
            node.cleanup()
        if ctl:
            ctl.stop()
        if underlay:
            underlay.delete()
        shutil.rmtree(root, ignore_errors=True)


def test_health_address_setting(make_node):
    """`healthAddress` moves the endpoint; the empty string turns it off."""
    moved = make_node(extra={"healthAddress": "127.0.0.1:19641"})
    assert get(moved, "/healthz") is None
    wait_for(lambda: get(moved, "/readyz", port=19641)["status"] == 200, what="/readyz on the configured port")
    off = make_node(extra={"healthAddress": ""})
    assert_alive(off)
    assert get(off, "/healthz") is None, "healthAddress \"\" must not listen"


def test_bad_or_taken_health_address_fails_the_start(make_node):
    bad = make_node(extra={"healthAddress": "localhost:9640"}, start=False)
    bad.start(wait=False)
    bad.proc.wait(timeout=30)
    assert bad.proc.returncode != 0
    assert "healthAddress" in bad.log(), bad.log()

    taken = make_node(start=False)
    # Something else already listens on the port inside the node's namespace.
    holder = subprocess.Popen(
        ["nsenter", f"--net={taken.ns.path}", "python3", "-c",
         "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 9640)); s.listen(); "
         "print('listening', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "listening"
        taken.start(wait=False)
        taken.proc.wait(timeout=30)
        assert taken.proc.returncode != 0
        log = taken.log()
        assert "healthAddress 127.0.0.1:9640" in log, log
        assert not taken.socket.exists(), "the CNI socket is removed when the start fails"
    finally:
        harness.stop_process(holder)
