"""kubelet registration: the `:authority` real clients send over Unix sockets, and what the
agent knows about kubelet's answers.

Why: kubelet's plugin watcher dials `<kubeletDir>/plugins_registry/csi.nodeplane.dev-reg.sock`
with grpc-go and no authority override, so the HTTP/2 `:authority` it sends is the socket
path, percent-encoded (`%2Fvar%2Flib%2Fkubelet%2F…`). The Rust h2 server under tonic answered
that with RST_STREAM PROTOCOL_ERROR, so kubelet never registered the CSI driver — while the
agent, serving every socket, looked healthy. The product now normalises `:authority` on every
Unix-socket gRPC server (src/rpc/authority.rs) and keeps a book of what kubelet answered each
plugin (src/kubelet/mod.rs), shown by `nodeplane status`, `/readyz` and `/metrics`.

What is tested here, against real processes:

* PyPI grpcio (>= 1.57; the test interpreter's) sends the socket path as `:authority` too
  (a local h2 server records it), so grpcio is a faithful kubelet stand-in;
* the CSI registration dialogue exactly as kubelet makes it (grpcio, `unix:` target, no
  options): GetInfo, the driver's GetPluginInfo and NodeGetInfo, NotifyRegistrationStatus;
  the agent's status (JSON and text), readiness and metric follow kubelet's verdict;
* every Unix-socket gRPC server of the agent and the controller, found from the processes'
  listening sockets, answers one request per authority form (absent, `localhost`, the raw
  path, grpc-go's and grpcio's percent-encoded forms) over a raw HTTP/2 connection (the
  `h2` package): a gRPC status, never a reset; unknown methods are routed by `:path`;
* device plugins dial kubelet in `devicePluginDir` (default `<root>/var/lib/kubelet/
  device-plugins`), not under `kubeletDir` — kubelet keeps its device plugin directory there
  whatever its `--root-dir` — with the kubelet emulator process (`tools/kubelet.rs`) as
  kubelet; and a wrong `devicePluginDir` shows as not registered (status, readiness with
  `requireKubeletRegistration`, a warning in the log).

Python packages: grpcio (>= 1.57) and h2 (hyper-h2), from PyPI, in the interpreter running
pytest. Missing ones fail the tests, never skip them.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import cluster
import harness
from harness import wait_until

try:
    import grpc
except ImportError:  # reported by the autouse fixture below: fail, never skip
    grpc = None
try:
    import h2.config
    import h2.connection
    import h2.events
except ImportError:
    h2 = None

KUBELET_BIN = harness.TARGET / "examples" / "kubelet"
DRIVER = "csi.nodeplane.dev"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EMPTY = b"\x00\x00\x00\x00\x00"  # one uncompressed gRPC message of length 0
REFUSAL = "driver csi.nodeplane.dev: versions [1.0.0] not supported (kubelet test)"
WARN_TEXT = "kubelet has not registered a plugin this agent serves"
METRIC = "nodeplane_kubelet_plugin_registered"


@pytest.fixture(autouse=True)
def _python_packages():
    """Fail loudly (never skip) when a package this module needs is missing or too old."""
    missing = []
    if grpc is None:
        missing.append("grpcio>=1.57 (PyPI)")
    elif tuple(int(x) for x in re.findall(r"\d+", grpc.__version__)[:2]) < (1, 57):
        missing.append(f"grpcio>=1.57 (PyPI; this is {grpc.__version__}, which does not send the path as :authority)")
    if h2 is None:
        missing.append("h2 (PyPI hyper-h2)")
    if missing:
        pytest.fail("missing for this test: " + ", ".join(missing))


# ---------------------------------------------------------------------------------------------
# Protobuf by hand (field numbers from proto/)
# ---------------------------------------------------------------------------------------------

def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def pb_field(num, value):
    """One field: bool/int as a varint, str/bytes length-delimited."""
    if isinstance(value, bool) or isinstance(value, int):
        return varint(num << 3) + varint(int(value))
    b = value.encode() if isinstance(value, str) else value
    return varint(num << 3 | 2) + varint(len(b)) + b


def pb_decode(data):
    """field number -> [values] (varints as ints, length-delimited as bytes)."""
    out, i = {}, 0

    def read_varint():
        nonlocal i
        shift = n = 0
        while True:
            b = data[i]
            i += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return n

    while i < len(data):
        key = read_varint()
        num, wt = key >> 3, key & 7
        if wt == 0:
            v = read_varint()
        elif wt == 2:
            ln = read_varint()
            v = data[i:i + ln]
            i += ln
        elif wt == 1:
            v = data[i:i + 8]
            i += 8
        elif wt == 5:
            v = data[i:i + 4]
            i += 4
        else:
            raise AssertionError(f"unexpected wire type {wt} in {data!r}")
        out.setdefault(num, []).append(v)
    return out


def pb_str(fields, num):
    v = fields.get(num)
    return v[0].decode() if v else ""


# ---------------------------------------------------------------------------------------------
# Clients: grpcio as kubelet dials, and raw HTTP/2
# ---------------------------------------------------------------------------------------------

def grpcio_call(sock, method, body=b"", timeout=5):
    """One unary call with grpcio dialing `unix:<sock>` with no options, as kubelet's
    plugin watcher does with grpc-go; raw bytes in and out. A gRPC error fails the test
    with its code (the old bug showed as INTERNAL / RST_STREAM here)."""
    ch = grpc.insecure_channel("unix:" + str(sock))
    try:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            return call(body, timeout=timeout)
        except grpc.RpcError as e:
            raise AssertionError(f"grpcio {method} on {sock}: {e.code()}: {e.details()}") from None
    finally:
        ch.close()


def notify(node, registered, error=""):
    """kubelet's verdict: NotifyRegistrationStatus(RegistrationStatus{1: plugin_registered, 2: error})."""
    body = pb_field(1, registered) + (pb_field(2, error) if error else b"")
    assert grpcio_call(reg_socket(node.kubelet), "/pluginregistration.Registration/NotifyRegistrationStatus", body) == b""


def percent_encoded(s):
    """Every byte outside RFC 3986's unreserved set as %XX (what grpc-go and grpcio do)."""
    keep = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"
    return "".join(chr(b) if b in keep else f"%{b:02X}" for b in s.encode())


def authority_forms(path):
    """name -> the :authority to send (None: no :authority header at all)."""
    path = str(path)
    return {
        "absent": None,
        "localhost": "localhost",
        "raw path": path,
        # grpc-go (kubelet) for unix:///path: the whole path, percent-encoded.
        "grpc-go": percent_encoded(path),
        # grpcio >= 1.57 for unix:/path: the path without its leading slash, percent-encoded
        # (test_grpcio_sends_the_socket_path_as_authority checks this against grpcio itself).
        "grpcio": percent_encoded(path.lstrip("/")),
    }


class H2Result:
    def __init__(self, method):
        self.method = method
        self.headers = {}
        self.trailers = {}
        self.data = b""
        self.reset = None      # the RST_STREAM error code, if the stream was reset
        self.ended = False

    @property
    def grpc_status(self):
        """grpc-status from the trailers, or from the headers of a trailers-only answer."""
        v = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if v is None else int(v)

    @property
    def grpc_message(self):
        return self.trailers.get("grpc-message", self.headers.get("grpc-message"))

    def __repr__(self):
        return (f"<{self.method}: reset={self.reset} ended={self.ended} headers={self.headers} "
                f"trailers={self.trailers} data={self.data[:40]!r}>")


def h2_unary_calls(sock, methods, authority, timeout=5.0):
    """Unary gRPC requests with an empty message, one after the other on ONE raw HTTP/2
    connection to Unix socket `sock`, each with exactly `authority` as `:authority` (None: no
    `:authority` at all). Later requests reuse the HPACK dynamic table the first one filled.
    Returns an H2Result per method; a connection the server closes or terminates fails."""
    cfg = h2.config.H2Configuration(client_side=True, validate_outbound_headers=False,
                                    normalize_outbound_headers=False, validate_inbound_headers=False)
    conn = h2.connection.H2Connection(config=cfg)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    results = []
    try:
        s.connect(str(sock))
        conn.initiate_connection()
        s.sendall(conn.data_to_send())
        for method in methods:
            r = H2Result(method)
            results.append(r)
            sid = conn.get_next_available_stream_id()
            hdrs = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode())]
            if authority is not None:
                hdrs.append((b":authority", authority.encode()))
            hdrs += [(b"content-type", b"application/grpc"), (b"te", b"trailers")]
            conn.send_headers(sid, hdrs)
            conn.send_data(sid, EMPTY, end_stream=True)
            s.sendall(conn.data_to_send())
            deadline = time.time() + timeout
            while not r.ended and r.reset is None:
                if time.time() > deadline:
                    raise AssertionError(f"{sock}: no answer to {method} (:authority {authority!r}) within {timeout}s: {r}")
                data = s.recv(65536)
                if not data:
                    raise AssertionError(f"{sock}: the server closed the connection during {method} "
                                         f"(:authority {authority!r}): {r}")
                for ev in conn.receive_data(data):
                    if getattr(ev, "stream_id", sid) not in (sid, 0):
                        continue
                    if isinstance(ev, h2.events.ResponseReceived):
                        r.headers = {k.decode(): v.decode() for k, v in ev.headers}
                    elif isinstance(ev, h2.events.TrailersReceived):
                        r.trailers = {k.decode(): v.decode() for k, v in ev.headers}
                    elif isinstance(ev, h2.events.DataReceived):
                        r.data += ev.data
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    elif isinstance(ev, h2.events.StreamEnded):
                        r.ended = True
                    elif isinstance(ev, h2.events.StreamReset):
                        r.reset = ev.error_code
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        raise AssertionError(f"{sock}: GOAWAY ({ev.error_code}) during {method} "
                                             f"(:authority {authority!r}): {ev.additional_data!r}")
                out = conn.data_to_send()
                if out:
                    s.sendall(out)
        conn.close_connection()
        s.sendall(conn.data_to_send())
    finally:
        s.close()
    return results


# ---------------------------------------------------------------------------------------------
# The agent's view
# ---------------------------------------------------------------------------------------------

def reg_socket(kubelet_dir):
    return Path(kubelet_dir) / f"plugins_registry/{DRIVER}-reg.sock"


def csi_socket(kubelet_dir):
    return Path(kubelet_dir) / f"plugins/{DRIVER}/csi.sock"


def kubelet_book(node):
    """`nodeplane status --json`'s kubelet section; None while the node API does not answer
    (it is bound just after the agent logs ready)."""
    rc, st = node.status("status", check=False)
    assert rc in (0, 2), f"nodeplane status --json: exit {rc}"
    return st["kubelet"] if st else None


def kubelet_plugins(node):
    """name -> entry of the kubelet section's plugins ({} while the node API does not answer)."""
    book = kubelet_book(node)
    return {p["name"]: p for p in book["plugins"]} if book else {}


def status_text(node):
    res = harness.run([str(harness.CLI_BIN), "status", "--socket", str(node.node_socket)], check=False)
    assert res.returncode == 0, f"nodeplane status: exit {res.returncode}: {res.stderr}"
    return res.stdout


def kubelet_line(text, kind, name):
    """The `kubelet:` section's line for one plugin."""
    lines = text.splitlines()
    assert "kubelet:" in lines, f"no kubelet: section in the status text:\n{text}"
    section = lines[lines.index("kubelet:") + 1:]
    prefix = f"    {kind} {name}: "
    found = [l for l in section if l.startswith(prefix)]
    assert len(found) == 1, f"no single {prefix.strip()!r} line in the kubelet: section:\n{text}"
    return found[0][len(prefix):]


def ready_code(node):
    """/readyz's HTTP status; None while the health endpoint does not answer (yet)."""
    r = harness.health_request(node.ns, "/readyz")
    return None if r is None else r["status"]


def failing_lines(node):
    """condition -> detail of every failing condition on /readyz ({} when 200, None while the
    health endpoint does not answer)."""
    r = harness.health_request(node.ns, "/readyz")
    if r is None:
        return None
    if r["status"] == 200:
        return {}
    assert r["status"] == 503, r
    out = {}
    for line in r["body"].splitlines():
        name, _, detail = line.partition(": ")
        out[name] = detail
    return out


def metric(node, kind, plugin):
    """Value of nodeplane_kubelet_plugin_registered{kind, plugin}, or None when absent."""
    r = harness.health_request(node.ns, "/metrics")
    assert r is not None and r["status"] == 200, r
    prefix = f'{METRIC}{{kind="{kind}",plugin="{plugin}"}} '
    vals = [line[len(prefix):] for line in r["body"].splitlines() if line.startswith(prefix)]
    assert len(vals) <= 1, vals
    return float(vals[0]) if vals else None


def utc(t):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(t)))


def listening_unix_sockets(pid):
    """Paths of the Unix sockets process `pid` listens on: its socket fds matched against its
    network namespace's /proc/net/unix (the approach of test_security.py)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    paths = set()
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[6] in inodes and int(f[3], 16) & 0x10000 and f[7].startswith("/"):
            paths.add(f[7])
    return paths


# ---------------------------------------------------------------------------------------------
# The kubelet emulator process
# ---------------------------------------------------------------------------------------------

def require_kubelet_bin():
    if not KUBELET_BIN.exists():
        pytest.fail(f"{KUBELET_BIN} is missing: `cargo test --release` builds it, or run "
                    "`cargo build --release --example kubelet`")


def start_kubelet(node, kubelet_dir, device_plugin_dir):
    """The emulator as kubelet with `--root-dir` `kubelet_dir` and its device plugin directory
    elsewhere; returns (process, state file), once its state file says it serves."""
    require_kubelet_bin()
    state = node.root / "kubelet-state.json"
    log = open(node.root / "kubelet.log", "a")
    proc = subprocess.Popen(
        [str(KUBELET_BIN), "--kubelet-dir", str(kubelet_dir), "--device-plugin-dir", str(device_plugin_dir),
         "--state", str(state)],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    log.close()

    def ready():
        if proc.poll() is not None:
            log = (node.root / "kubelet.log").read_text()
            stale = " (an emulator built before --device-plugin-dir: rebuild it, `cargo build --release " \
                    "--example kubelet`)" if "--device-plugin-dir" in log else ""
            raise AssertionError(f"kubelet emulator exited {proc.returncode}{stale}: {log}")
        s = read_state(state)
        return s if s and s.get("pid") == proc.pid and s.get("running") else None
    try:
        wait_until(ready, timeout=10, what="the kubelet emulator serving")
    except BaseException:
        harness.stop_process(proc, timeout=10)
        raise
    return proc, state


def read_state(path):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def check_config(node):
    """`nodeplane-agent check-config` of the node's configuration (the resolved JSON)."""
    r = subprocess.run([str(harness.AGENT_BIN), "check-config", "--config", str(node.cfg_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"check-config: exit {r.returncode}: {r.stderr}"
    return json.loads(r.stdout)


def split_kubelet_node(device_plugin_dir=None, extra=None):
    """A node (not started) whose kubeletDir is `<root>/srv/kubelet` (kubelet's --root-dir
    moved), with device resource `kdev` (2 device nodes)."""
    node = harness.Node(tag="kreg", start=False)
    try:
        node.cfg["kubeletDir"] = str(node.root / "srv/kubelet")
        if device_plugin_dir is not None:
            node.cfg["devicePluginDir"] = str(device_plugin_dir(node))
        node.cfg.update(extra or {})
        node.cfg_path.write_text(json.dumps(node.cfg))
        harness.make_devices(node, "kdev", 2)
    except BaseException:
        node.cleanup()
        raise
    return node


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def test_grpcio_sends_the_socket_path_as_authority():
    """grpcio dialing `unix:<path>` sends the path (no leading slash, percent-encoded) as
    :authority — not a host[:port] authority, which is all the Rust h2 server accepted. So the
    grpcio calls below dial the agent in the form that broke kubelet's registration."""
    d = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX + "h2-", dir="/tmp"))
    path = d / "plugins_registry" / "csi.x_y~z-reg.sock"
    path.parent.mkdir()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.settimeout(10)  # accept() gives up rather than hang the test when grpcio never connects
    got, errors = [], []

    def serve():
        try:
            c, _ = srv.accept()
        except OSError as e:
            errors.append(e)
            return
        c.settimeout(10)
        conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=False, validate_inbound_headers=False))
        conn.initiate_connection()
        try:
            c.sendall(conn.data_to_send())
            done = False
            while not done:
                data = c.recv(65536)
                if not data:
                    break
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        got.append([(k.decode(), v.decode()) for k, v in ev.headers])
                    elif isinstance(ev, h2.events.StreamEnded):
                        conn.send_headers(ev.stream_id, [(":status", "200"), ("content-type", "application/grpc"),
                                                         ("grpc-status", "12"), ("grpc-message", "recorded")],
                                          end_stream=True)
                        done = True
                c.sendall(conn.data_to_send())
        except Exception as e:  # reported by the test
            errors.append(e)
        finally:
            c.close()

    t = None
    try:
        srv.bind(str(path))
        srv.listen(4)
        t = threading.Thread(target=serve, daemon=True)
        t.start()
        ch = grpc.insecure_channel("unix:" + str(path))
        try:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary("/pluginregistration.Registration/GetInfo", request_serializer=None,
                               response_deserializer=None)(b"", timeout=10)
        finally:
            ch.close()
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNIMPLEMENTED, "recorded"), \
            "the local h2 server's answer did not come back through grpcio"
        t.join(10)
        assert not errors, errors
        assert len(got) == 1, got
        authority = [v for k, v in got[0] if k == ":authority"]
        print(f"\ngrpcio {grpc.__version__} dialing unix:{path} sent :authority {authority}")
        assert len(authority) == 1, f"grpcio sent no single :authority: {got[0]}"
        authority = authority[0]
        assert "%2F" in authority, f"grpcio sent {authority!r}: not the percent-encoded path this suite relies on"
        assert not re.fullmatch(r"[A-Za-z0-9.\-]+(:[0-9]+)?", authority), \
            f"{authority!r} is a valid host[:port] authority: grpcio does not exercise the bug here"
        # The emulation used for the raw HTTP/2 forms below is exactly what grpcio sends.
        assert authority == authority_forms(path)["grpcio"], (authority, authority_forms(path)["grpcio"])
        assert dict(got[0])[":path"] == "/pluginregistration.Registration/GetInfo"
    finally:
        srv.close()
        if t is not None:
            t.join(10)
        shutil.rmtree(d, ignore_errors=True)


def test_kubelet_style_registration_with_grpcio(node):
    """The registration dialogue as kubelet makes it, with grpcio dialing `unix:<path>` (the
    path as :authority): every call answered; kubelet's OK shows in status, text and metric."""
    reg = reg_socket(node.kubelet)
    wait_until(lambda: DRIVER in kubelet_plugins(node), timeout=20, what=f"{DRIVER} in the status' kubelet.plugins")

    # Before kubelet said anything: waiting (no kubelet runs here), and that is not a readiness
    # failure (requireKubeletRegistration is off by default).
    book = kubelet_book(node)
    assert book["required"] is False and book["graceSeconds"] == 30, book
    assert [p["name"] for p in book["plugins"]] == [DRIVER], "only the CSI driver (no devices configured)"
    p = book["plugins"][0]
    assert (p["kind"], p["socket"], p["state"], p["error"], p["registeredUnix"], p["registrations"]) == \
        ("csi", str(reg), "waiting", None, None, 0), p
    assert p["overdue"] is False, p
    assert kubelet_line(status_text(node), "csi", DRIVER).startswith("NOT REGISTERED with kubelet (waiting) since ")
    wait_until(lambda: ready_code(node) == 200, timeout=20, what="/readyz 200 while kubelet has not answered")
    assert metric(node, "csi", DRIVER) == 0

    # GetInfo: PluginInfo {1 type, 2 name, 3 endpoint, 4 supported_versions}.
    info = pb_decode(grpcio_call(reg, "/pluginregistration.Registration/GetInfo"))
    assert pb_str(info, 1) == "CSIPlugin", info
    assert pb_str(info, 2) == DRIVER, info
    assert pb_str(info, 3) == str(node.csi_socket), info
    versions = [v.decode() for v in info.get(4, [])]
    assert "1.0.0" in versions, versions

    # The endpoint, dialed the same way: GetPluginInfo {1 name}, NodeGetInfo {1 node_id}.
    endpoint = pb_str(info, 3)
    assert pb_str(pb_decode(grpcio_call(endpoint, "/csi.v1.Identity/GetPluginInfo")), 1) == DRIVER
    assert pb_str(pb_decode(grpcio_call(endpoint, "/csi.v1.Node/NodeGetInfo")), 1) == node.ns.name

    # Nothing has changed on the agent's side by being asked.
    assert kubelet_plugins(node)[DRIVER]["state"] == "waiting"

    before = time.time()
    notify(node, True)
    p = wait_until(lambda: (lambda e: e if e and e["state"] == "registered" else None)(kubelet_plugins(node).get(DRIVER)),
                   timeout=10, what=f"{DRIVER} registered in the status")
    assert p["error"] is None and p["registrations"] == 1 and p["overdue"] is False, p
    assert before - 1 <= p["registeredUnix"] <= time.time() + 1, (before, p)
    assert time.time() - 60 <= p["registeredUnix"], p
    line = kubelet_line(status_text(node), "csi", DRIVER)
    assert line == f"registered with kubelet at {utc(p['registeredUnix'])}", line
    assert metric(node, "csi", DRIVER) == 1
    assert ready_code(node) == 200
    print(f"\nGetInfo: {info}\nstatus: {p}\ntext: {line}")


def test_kubelet_refusal_shows_in_status_and_readiness(node):
    """kubelet's NotifyRegistrationStatus(false, E): the csi condition fails with E, the
    status says refused with E, the metric is 0; kubelet's OK afterwards makes it ready."""
    wait_until(lambda: ready_code(node) == 200, timeout=20, what="/readyz 200 before kubelet's verdict")
    notify(node, False, REFUSAL)
    want = f"kubelet refused {DRIVER}: {REFUSAL}"
    lines = wait_until(lambda: (lambda f: f if f and f.get("csi") == want else None)(failing_lines(node)),
                       timeout=10, what=f"/readyz 503 with csi: {want}")
    assert set(lines) == {"csi"}, f"only csi fails: {lines}"
    assert f"csi: {want}" in harness.health_request(node.ns, "/readyz")["body"].splitlines()
    p = kubelet_plugins(node)[DRIVER]
    assert (p["state"], p["error"], p["registeredUnix"], p["registrations"]) == ("refused", REFUSAL, None, 0), p
    line = kubelet_line(status_text(node), "csi", DRIVER)
    assert line.startswith(f"NOT REGISTERED with kubelet (refused: {REFUSAL}) since "), line
    assert line.endswith(utc(p["sinceUnix"])), (line, p)
    assert metric(node, "csi", DRIVER) == 0

    # A refusal without a reason still says something.
    notify(node, False, "")
    wait_until(lambda: (failing_lines(node) or {}).get("csi") == f"kubelet refused {DRIVER}: kubelet gave no reason",
               timeout=10, what="the csi condition for a refusal without a reason")
    assert kubelet_plugins(node)[DRIVER]["error"] == "kubelet gave no reason"

    # kubelet registers the plugin after all: ready again.
    notify(node, True)
    wait_until(lambda: ready_code(node) == 200, timeout=10, what="/readyz 200 after kubelet's OK")
    p = kubelet_plugins(node)[DRIVER]
    assert (p["state"], p["error"], p["registrations"]) == ("registered", None, 1), p
    assert metric(node, "csi", DRIVER) == 1


def test_every_unix_socket_accepts_each_authority_form():
    """Every Unix-socket gRPC server of the agent and the controller (found from the
    processes' listening sockets) answers a unary call with each :authority form: a gRPC
    status, never RST_STREAM; an unknown method is UNIMPLEMENTED (routing is by :path)."""
    croot = Path(tempfile.mkdtemp(prefix=harness.RUN_PREFIX + "ctl-", dir="/tmp"))
    ctl = node = None
    try:
        ctl = cluster.Controller(croot)
        node = harness.Node(tag="auth", start=False)
        harness.make_devices(node, "authdev", 1)
        node.start()
        dp_socket = node.kubelet / "device-plugins/nodeplane-authdev.sock"
        agent_expected = {node.socket, node.node_socket, node.csi_socket, reg_socket(node.kubelet), dp_socket}
        agent = wait_until(lambda: (lambda s: s if {str(p) for p in agent_expected} <= s else None)(
            listening_unix_sockets(node.proc.pid)), timeout=20, what="the agent's Unix sockets")
        controller = listening_unix_sockets(ctl.proc.pid)

        # socket -> (a method of its service, the gRPC status that method answers an empty request).
        tested = {
            reg_socket(node.kubelet): ("/pluginregistration.Registration/GetInfo", 0),
            node.csi_socket: ("/csi.v1.Identity/GetPluginInfo", 0),
            node.node_socket: ("/nodeplane.node.v1.NodeStatus/GetStatus", 0),
            dp_socket: ("/v1beta1.DevicePlugin/GetDevicePluginOptions", 0),
            ctl.csi_socket: ("/csi.v1.Identity/GetPluginInfo", 0),
            # The controller's API checks the caller first: no Bearer token is UNAUTHENTICATED
            # (16, "missing authorization"), the service's own answer to this request.
            ctl.socket: ("/nodeplane.controller.v1.NodeRegistry/Register", 16),
        }
        # The CNI socket is not gRPC (the shim's own framing): not an HTTP/2 server at all.
        not_grpc = {str(node.socket)}
        listening = agent | controller
        assert listening - not_grpc == {str(p) for p in tested}, (
            "the Unix sockets the agent and the controller listen on are not exactly the ones tested "
            f"here (a new socket needs a line in `tested`): listening {sorted(listening)}, tested {sorted(map(str, tested))}")

        failures = []
        for sock, (method, code) in tested.items():
            for form, authority in authority_forms(sock).items():
                try:
                    answers = h2_unary_calls(sock, [method, "/nope.Nope/Nope", method], authority)
                except Exception as e:  # a closed connection, GOAWAY, a protocol error: collected
                    failures.append(f"{sock} [{form}]: {type(e).__name__}: {e}")
                    continue
                for r, want in zip(answers, (code, 12, code)):
                    if r.reset is not None or r.grpc_status != want or r.headers.get(":status") != "200":
                        failures.append(f"{sock} [{form} {authority!r}] {r.method}: want grpc-status {want}, got {r}")
                if code == 16 and "authorization" not in (answers[0].grpc_message or ""):
                    failures.append(f"{sock} [{form}]: UNAUTHENTICATED without saying why: {answers[0]}")
        print(f"\n{len(tested)} sockets x {len(authority_forms('/x'))} authority forms x 3 requests:\n  "
              + "\n  ".join(f"{s}: {m} -> {c}" for s, (m, c) in tested.items()))
        assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)

        # The agent's answers are real ones: GetInfo names the driver whatever the authority.
        r = h2_unary_calls(reg_socket(node.kubelet), ["/pluginregistration.Registration/GetInfo"],
                           authority_forms(reg_socket(node.kubelet))["grpc-go"])[0]
        assert r.data[:1] == b"\x00" and pb_str(pb_decode(r.data[5:]), 2) == DRIVER, r
        assert node.proc.poll() is None and ctl.proc.poll() is None, "a server exited"
    finally:
        if node:
            node.cleanup()
        if ctl:
            ctl.stop()
        shutil.rmtree(croot, ignore_errors=True)


def test_device_plugins_follow_device_plugin_dir_not_kubelet_dir():
    """kubelet with `--root-dir <root>/srv/kubelet` keeps kubelet.sock in
    `<root>/var/lib/kubelet/device-plugins`: with kubeletDir moved and devicePluginDir left at
    its default, both the CSI driver and the device plugin get registered."""
    node = split_kubelet_node()
    kproc = None
    try:
        kdir = node.root / "srv/kubelet"
        dpdir = node.root / "var/lib/kubelet/device-plugins"
        resource = "nodeplane.dev/kdev"

        cc = check_config(node)
        assert cc["kubeletDir"] == str(kdir), cc["kubeletDir"]
        assert cc["devicePluginDir"] == str(dpdir) == cc["devicePlugins"]["pluginDir"], cc
        assert cc["csi"]["registrationSocket"] == str(reg_socket(kdir)), cc["csi"]
        assert (cc["requireKubeletRegistration"], cc["kubeletRegistrationGraceSeconds"]) == (False, 30), cc

        kproc, state = start_kubelet(node, kdir, dpdir)
        node.start()

        def registered():
            s = read_state(state)
            if not s:
                return None
            res = s["resources"].get(resource)
            drv = s["csi"]["drivers"].get(DRIVER)
            return s if res and res["streaming"] and len(res["devices"]) == 2 and drv else None
        s = wait_until(registered, timeout=20, what=f"{resource} streaming and {DRIVER} registered with the kubelet emulator")
        drv = s["csi"]["drivers"][DRIVER]
        assert drv["endpoint"] == str(csi_socket(kdir)) and drv["node_id"] == node.ns.name, drv
        assert not s["csi"]["failures"] and not s["registration_failures"], s
        assert s["kubelet_socket"] == str(dpdir / "kubelet.sock"), s["kubelet_socket"]
        res = s["resources"][resource]
        assert (res["endpoint"], res["socket"]) == ("nodeplane-kdev.sock", str(dpdir / "nodeplane-kdev.sock")), res
        assert {d["id"]: d["health"] for d in res["devices"]} == {"kdev0": "Healthy", "kdev1": "Healthy"}, res

        plugins = wait_until(lambda: (lambda p: p if {e["state"] for e in p.values()} == {"registered"} and len(p) == 2
                                      else None)(kubelet_plugins(node)),
                             timeout=10, what="both plugins registered in the agent's status")
        assert plugins[DRIVER]["kind"] == "csi" and plugins[DRIVER]["socket"] == str(reg_socket(kdir)), plugins
        dp = plugins[resource]
        assert dp["kind"] == "deviceplugin" and dp["socket"] == str(dpdir / "kubelet.sock"), dp
        assert dp["error"] is None and dp["registrations"] >= 1, dp
        # The agent counted every registration kubelet received, no more.
        assert dp["registrations"] == read_state(state)["resources"][resource]["registrations"], (dp, read_state(state))
        assert (dpdir / "nodeplane-kdev.sock").is_socket()
        assert not (kdir / "device-plugins").exists(), "nothing device-plugin related under kubeletDir"
        text = status_text(node)
        assert kubelet_line(text, "deviceplugin", resource).startswith("registered with kubelet at "), text
        assert metric(node, "deviceplugin", resource) == 1 and metric(node, "csi", DRIVER) == 1
        wait_until(lambda: ready_code(node) == 200, timeout=10, what="/readyz 200")
    finally:
        if kproc is not None:
            harness.stop_process(kproc, timeout=10)
        node.cleanup()


def test_misconfigured_device_plugin_dir_shows_not_registered():
    """devicePluginDir under the moved kubeletDir, where kubelet has no kubelet.sock: the
    device plugin is unreachable in status, fails readiness after the grace (registration
    required), is warned about once; the CSI driver registers and its condition holds."""
    grace = 1
    node = split_kubelet_node(
        device_plugin_dir=lambda n: n.root / "srv/kubelet/device-plugins",
        extra={"requireKubeletRegistration": True, "kubeletRegistrationGraceSeconds": grace})
    kproc = None
    try:
        kdir = node.root / "srv/kubelet"
        wrong = kdir / "device-plugins"
        resource = "nodeplane.dev/kdev"
        cc = check_config(node)
        assert (cc["kubeletDir"], cc["devicePluginDir"], cc["devicePlugins"]["pluginDir"]) == (str(kdir), str(wrong), str(wrong)), cc
        assert (cc["requireKubeletRegistration"], cc["kubeletRegistrationGraceSeconds"]) == (True, grace), cc
        kproc, state = start_kubelet(node, kdir, node.root / "var/lib/kubelet/device-plugins")
        node.start()

        p = wait_until(lambda: (lambda e: e if e and e["state"] == "unreachable" and e["overdue"] else None)(
            kubelet_plugins(node).get(resource)), timeout=15, what=f"{resource} unreachable and overdue in the status")
        assert p["kind"] == "deviceplugin" and p["socket"] == str(wrong / "kubelet.sock"), p
        assert "does not exist" in p["error"] and str(wrong / "kubelet.sock") in p["error"], p
        assert p["registeredUnix"] is None and p["registrations"] == 0, p
        book = kubelet_book(node)
        assert book["required"] is True and book["graceSeconds"] == grace, book

        # The CSI driver: kubelet's plugin watcher found it under its --root-dir.
        wait_until(lambda: kubelet_plugins(node).get(DRIVER, {}).get("state") == "registered", timeout=10,
                   what=f"{DRIVER} registered")
        drv = read_state(state)["csi"]["drivers"][DRIVER]
        assert drv["registration_socket"] == str(reg_socket(kdir)) and drv["endpoint"] == str(csi_socket(kdir)), drv
        assert read_state(state)["resources"] == {}, "nothing registered with the emulator's device manager"

        def only_devices_fail():
            f = failing_lines(node)
            return f if f and "deviceplugins" in f and "csi" not in f else None
        lines = wait_until(only_devices_fail, timeout=10, what="/readyz 503 for deviceplugins only")
        detail = lines["deviceplugins"]
        assert detail.startswith(f"kubelet has not registered {resource} within {grace} s (unreachable: "), detail
        assert "does not exist" in detail, detail
        assert set(lines) == {"deviceplugins"}, lines

        text = status_text(node)
        line = kubelet_line(text, "deviceplugin", resource)
        assert line.startswith("NOT REGISTERED with kubelet (unreachable: ") and "does not exist" in line, line
        assert line.endswith(", overdue"), line
        assert kubelet_line(text, "csi", DRIVER).startswith("registered with kubelet at "), text
        assert metric(node, "deviceplugin", resource) == 0 and metric(node, "csi", DRIVER) == 1

        def warnings():
            return [l for l in ANSI.sub("", node.log()).splitlines()
                    if WARN_TEXT in l and resource in l]
        warned = wait_until(warnings, timeout=10, what="the agent's warning about the unregistered device plugin")
        assert "WARN" in warned[0], warned
        time.sleep(1.5)  # several readiness rounds (250 ms) and registration retries later
        assert len(warnings()) == 1, f"warned more than once: {warnings()}"
        assert node.proc.poll() is None
    finally:
        if kproc is not None:
            harness.stop_process(kproc, timeout=10)
        node.cleanup()
