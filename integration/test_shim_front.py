"""The shim's front: the usual request served before the C library starts (shim/front).

The shim binary starts at its front, which reads stdin and the environment, answers VERSION
or forwards the request to the agent on raw system calls, prints the answer and exits; glibc
never starts (its start-up costs about 0.6 ms on a VM, see scripts/build-shim). Anything
else it hands to the full shim, which does everything again from the start.

Asserted on the real binary, with strace: which path served each call (glibc's start-up
sets up thread-local storage with arch_prctl; the front never does), that the answers are
the ones the full shim gives, and what the front hands over when the agent was reached but
did not answer (no second request), did not answer properly, or went away (a second one).
"""

import json
import os
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import harness

LATEST = "1.1.0"


def traced(node, command, pod=None, conf=None, stdin=None, env=None):
    """Exec the installed shim under strace like a runtime: (rc, stdout, syscall trace)."""
    e = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CNI_COMMAND": command, "CNI_PATH": str(node.bin_dir)}
    if pod is not None:
        e.update({"CNI_CONTAINERID": pod.cid, "CNI_IFNAME": "eth0", "CNI_NETNS": pod.ns.path})
    e.update(env or {})
    if stdin is None:
        stdin = json.dumps(conf if conf is not None else node.netconf(LATEST))
    with tempfile.NamedTemporaryFile(prefix=harness.RUN_PREFIX + "strace-", dir="/tmp") as f:
        res = subprocess.run(
            ["strace", "-f", "-qq", "-o", f.name, str(node.bin_dir / "nodeplane")],
            input=stdin.encode(), env=e, capture_output=True, timeout=120)
        trace = Path(f.name).read_text()
    return res.returncode, res.stdout.decode(), trace


def served_by_front(trace):
    """The call never started the C library (nor the Rust runtime above it)."""
    return "arch_prctl(" not in trace and "brk(" not in trace and "sigaltstack(" not in trace


def test_front_serves_add_check_del_without_the_c_library(node):
    pod = harness.Pod(node, "front")
    node.pods.append(pod)
    rc, out, trace = traced(node, "ADD", pod)
    assert rc == 0, out
    assert served_by_front(trace), trace
    # The namespace travelled as a descriptor with the request.
    assert "SCM_RIGHTS" in trace, trace
    res = json.loads(out)
    assert res["cniVersion"] == LATEST and len(res["ips"]) == 2, res
    assert "eth0" in pod.ns.links(), "the interface is in the pod's namespace"

    conf = node.netconf(LATEST)
    conf["prevResult"] = res
    rc, out, trace = traced(node, "CHECK", pod, conf=conf)
    assert (rc, out) == (0, ""), out
    assert served_by_front(trace), trace

    # CHECK of a broken attachment: the agent's error, printed by the front as it came.
    pod.ns.exec(["ip", "-4", "addr", "flush", "dev", "eth0"])
    rc, out, trace = traced(node, "CHECK", pod, conf=conf)
    assert rc == 1 and served_by_front(trace), trace
    err = json.loads(out)
    assert err["cniVersion"] == LATEST and "missing" in err["msg"], err

    rc, out, trace = traced(node, "DEL", pod, conf=conf)
    assert (rc, out) == (0, ""), out
    assert served_by_front(trace), trace
    assert node.leases() == {}
    assert node.wait_no_graveyard(), "the retired veth pair is reaped"
    assert "eth0" not in pod.ns.links()

    rc, out, trace = traced(node, "VERSION", stdin='{"cniVersion":"0.4.0"}')
    assert rc == 0 and served_by_front(trace), trace
    assert json.loads(out) == {"cniVersion": "0.4.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]}


def test_front_and_full_shim_answer_alike(node):
    """The same invalid request, once through the front (the agent validates it) and once
    handed to the full shim (an escaped key the front does not read: it validates it
    itself): the same answer."""
    pod = harness.Pod(node, "alike")
    node.pods.append(pod)
    bad = node.netconf(LATEST)
    del bad["name"]
    via_agent = traced(node, "ADD", pod, stdin=json.dumps(bad))
    handed = traced(node, "ADD", pod, stdin=json.dumps(bad)[:-1] + ', "\\u0078": 1}')
    assert served_by_front(via_agent[2]) and not served_by_front(handed[2])
    assert via_agent[:2] == handed[:2], (via_agent[:2], handed[:2])
    assert via_agent[0] == 1 and json.loads(via_agent[1])["code"] == 7, via_agent[1]
    # A configuration the front cannot scan: the full shim's decoding error.
    rc, out, trace = traced(node, "ADD", pod, stdin='{"cniVersion": "1.0.0",')
    assert rc == 1 and not served_by_front(trace)
    assert json.loads(out)["code"] == 6, out
    # VERSION of an unreadable configuration: the latest version, from the full shim.
    rc, out, trace = traced(node, "VERSION", stdin="{")
    assert rc == 0 and not served_by_front(trace)
    assert json.loads(out)["cniVersion"] == LATEST
    # An escaped agentSocket is the full shim's to decode; the request still reaches the agent.
    conf = node.netconf(LATEST)
    conf["agentSocket"] = str(node.socket).replace("/", "\\/")
    rc, out, trace = traced(node, "ADD", pod, stdin=json.dumps(conf).replace("\\\\/", "\\/"))
    assert rc == 0 and not served_by_front(trace), out
    assert "eth0" in pod.ns.links()
    conf = node.netconf(LATEST)
    conf["prevResult"] = json.loads(out)
    rc, out, trace = traced(node, "DEL", pod, conf=conf)
    assert (rc, out) == (0, "") and served_by_front(trace), out
    assert node.leases() == {}


def test_front_hands_over_when_no_agent_listens(node):
    """No agent: the front's connect fails, the full shim answers as it always has (ADD: try
    again later; DEL: queued) and a pod namespace that does not open is the full shim's
    error too."""
    pod = harness.Pod(node, "noagent")
    node.pods.append(pod)
    node.stop()
    rc, out, trace = traced(node, "ADD", pod)
    assert rc == 1 and not served_by_front(trace)
    err = json.loads(out)
    assert err["code"] == 11 and "not reachable" in err["msg"], err
    rc, out, trace = traced(node, "DEL", pod)
    assert (rc, out) == (0, "") and not served_by_front(trace), out
    queued = list(node.pending_dir.glob("del-*.json"))
    assert len(queued) == 1, queued
    assert json.loads(queued[0].read_text())["env"]["CNI_CONTAINERID"] == pod.cid
    rc, out, trace = traced(node, "ADD", env={"CNI_CONTAINERID": pod.cid, "CNI_IFNAME": "eth0",
                                              "CNI_NETNS": "/nonexistent/netns"})
    assert rc == 1 and not served_by_front(trace)
    err = json.loads(out)
    assert err["code"] == 4 and "does not exist" in err["msg"], err


class FakeAgent:
    """A listener on a socket of our own that misbehaves after reading a request."""

    def __init__(self, path, behaviour):
        self.path, self.behaviour = path, behaviour
        self.requests = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        held = []
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(5)
            data = b""
            try:
                while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError:
                pass
            self.requests.append(json.loads(data[4:]) if len(data) > 4 else None)
            if self.behaviour == "silent":
                held.append(conn)  # never answers
            elif self.behaviour in ("garbage", "unusual"):
                # "unusual": a valid answer the front does not read itself (an exponent).
                body = b"not json" if self.behaviour == "garbage" else b'{"exit_code":0,"stdout":"","x":1e5}'
                conn.sendall(struct.pack(">I", len(body)) + body)
                conn.close()
            else:  # "hangup"
                conn.close()
        for c in held:
            c.close()

    def close(self):
        self.stop = True
        self.thread.join(timeout=5)
        self.sock.close()


def test_front_hands_over_what_happened_to_the_request(node, tmp_path):
    """The agent was reached and the front could not finish: the full shim goes on as it
    would after its own first attempt. Silent until the timeout (STATUS: 10 s): answered
    as an unreachable agent, not asked again. An answer the front does not read: decoded
    by the full shim (garbage is an error, a valid one is the answer). The connection
    closed before an answer: STATUS is not asked again (it never waits), ADD is, until its
    agentWaitSeconds are over."""
    sock = tmp_path / "fake.sock"
    pod = harness.Pod(node, "fake")
    node.pods.append(pod)
    for command, behaviour, wait in (
        ("STATUS", "silent", 0),
        ("STATUS", "garbage", 0),
        ("STATUS", "unusual", 0),
        ("STATUS", "hangup", 0),
        ("ADD", "hangup", 1),
    ):
        fake = FakeAgent(sock, behaviour)
        try:
            conf = node.netconf(LATEST)
            conf["agentSocket"] = str(sock)
            conf["agentWaitSeconds"] = wait
            t0 = time.monotonic()
            rc, out, trace = traced(node, command, pod if command == "ADD" else None, conf=conf)
            took = time.monotonic() - t0
        finally:
            fake.close()
            sock.unlink()
        case = (command, behaviour, out, len(fake.requests))
        assert not served_by_front(trace), case
        assert all(r and r["env"]["CNI_COMMAND"] == command for r in fake.requests), fake.requests
        if behaviour == "unusual":
            assert (rc, out, len(fake.requests)) == (0, "", 1), case
            continue
        assert rc == 1, case
        err = json.loads(out)
        assert err["code"] == (11 if command == "ADD" else 50) and "not reachable" in err["msg"], case
        if behaviour == "silent":
            assert "Resource temporarily unavailable" in err["msg"] and len(fake.requests) == 1, case
            assert 9.5 < took < 15, took
        elif behaviour == "garbage":
            assert "at line 1 column" in err["msg"] and len(fake.requests) == 1, case
        elif command == "STATUS":
            assert "failed to fill whole buffer" in err["msg"] and len(fake.requests) == 1, case
        else:
            # Asked again every 50 ms while the second lasts.
            assert "failed to fill whole buffer" in err["msg"] and len(fake.requests) >= 3, case
            assert 0.9 < took < 4, took
