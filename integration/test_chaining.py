"""Chaining: nodeplane as the first plugin of a conflist followed by Debian's reference
portmap and bandwidth plugins (containernetworking-plugins, /usr/lib/cni), executed the way
libcni does it (see runtime.py); and nodeplane placed after another plugin.

Needs the Debian packages containernetworking-plugins and iptables (portmap 1.1.1 drives
iptables/ip6tables). All firewall and tc state lives in the simulated node's namespace.
"""

import ipaddress
import json
import os
import shutil
import subprocess
import textwrap

import pytest

import harness
from runtime import Runtime, PluginError

CHAINED = [
    {"type": "portmap", "capabilities": {"portMappings": True}},
    {"type": "bandwidth", "capabilities": {"bandwidth": True}},
]
HOST_PORT, CONTAINER_PORT = 18080, 8080
CAPS = {
    "portMappings": [{"hostPort": HOST_PORT, "containerPort": CONTAINER_PORT, "protocol": "tcp"}],
    # bits per second / bits, as kubelet passes them
    "bandwidth": {"ingressRate": 8_000_000, "ingressBurst": 1_000_000,
                  "egressRate": 8_000_000, "egressBurst": 1_000_000},
}
# The "outside client" link: a private range distinct from the harness pod blocks (10.1xx/fd00:).
CLIENT_NODE4, CLIENT_PEER4 = "198.18.0.1", "198.18.0.2"
CLIENT_NODE6, CLIENT_PEER6 = "fdc1:ca7e::1", "fdc1:ca7e::2"



@pytest.fixture(autouse=True)
def _required_tools():
    """Fail loudly (never skip) when a package this module needs is missing."""
    need = {"iptables-save": "iptables", "ip6tables-save": "iptables", "tc": "iproute2",
          str(harness.REF_CNI_DIR / "portmap"): "containernetworking-plugins",
          str(harness.REF_CNI_DIR / "bandwidth"): "containernetworking-plugins"}
    missing = sorted({pkg for tool, pkg in need.items() if shutil.which(tool) is None})
    if missing:
        pytest.fail("missing Debian packages for this test: " + ", ".join(missing) + " (apt-get install -y ...)")

@pytest.fixture
def chain_node(make_node):
    return make_node(tag="chn", chained=CHAINED)


def chain_runtime(node, pin_version=True, extra_bin=()):
    """A runtime for the node's installed conflist with both our bin dir and the reference
    plugins on CNI_PATH, plugins exec'd inside the node's namespace.

    pin_version: lower the list's cniVersion to the highest version every plugin in it
    supports (their VERSION answers). The agent writes cniVersion 1.1.0 unconditionally,
    which portmap/bandwidth 1.1.1 reject (see test_installed_conflist_runs_through_reference_plugins);
    pinning lets the remaining tests exercise the datapath regardless."""
    rt = Runtime(node.conflist_path, [*extra_bin, node.bin_dir, harness.REF_CNI_DIR], host_netns=node.ns.path)
    if pin_version:
        rt.conflist["cniVersion"] = rt.common_version()
    return rt


def new_pod(node, tag):
    pod = harness.Pod(node, tag)
    node.pods.append(pod)
    return pod


def nodeplane_part(node, result, offset=0):
    """Check that `result` carries nodeplane's interfaces at [offset, offset+3) and its ips
    pointing at the container interface; return (host veth name, our ips)."""
    ifs = result["interfaces"]
    bridge, host, cont = ifs[offset], ifs[offset + 1], ifs[offset + 2]
    assert bridge["name"] == "np0" and "sandbox" not in bridge, result
    assert host["name"].startswith("np") and len(host["name"]) == 15 and "sandbox" not in host, result
    assert cont["name"] == "eth0" and cont.get("sandbox"), result
    ours = [ip for ip in result["ips"] if ip.get("interface") == offset + 2]
    nets = [ipaddress.ip_network(node.v4), ipaddress.ip_network(node.v6)]
    addrs = sorted((ipaddress.ip_interface(ip["address"]) for ip in ours), key=lambda a: a.version)
    assert len(addrs) == 2 and [a.ip in n for a, n in zip(addrs, nets)] == [True, True], result
    return host["name"], [str(a.ip) for a in addrs]


# ----- an outside client of the node, and a server in the pod -----

def attach_client(node):
    """A separate namespace linked to the node namespace by a veth pair; the client has only
    the link's connected routes (no route to the pod blocks)."""
    client = harness.Netns("cli")
    harness.run(["ip", "-n", node.ns.name, "link", "add", "tcl0", "type", "veth", "peer", "name", "eth0",
                 "netns", client.name])
    for ns, a4, a6, dev in ((node.ns.name, CLIENT_NODE4, CLIENT_NODE6, "tcl0"),
                            (client.name, CLIENT_PEER4, CLIENT_PEER6, "eth0")):
        harness.run(["ip", "-n", ns, "addr", "add", f"{a4}/24", "dev", dev])
        harness.run(["ip", "-n", ns, "addr", "add", f"{a6}/64", "dev", dev, "nodad"])
        harness.run(["ip", "-n", ns, "link", "set", dev, "up"])
    return client


SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::", int(sys.argv[1])))
    s.listen(8)
    print("listening", flush=True)
    while True:
        c, peer = s.accept()
        data = c.recv(256)
        c.sendall(b"pod got " + data + b" from " + peer[0].encode())
        c.close()
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    c.sendall(sys.argv[3].encode())
    c.shutdown(socket.SHUT_WR)
    out = b""
    while True:
        b = c.recv(256)
        if not b:
            break
        out += b
    print(out.decode())
""")


def start_server(pod, port):
    """A TCP server in the pod namespace; returns the Popen (kill it by its PID)."""
    proc = subprocess.Popen(["nsenter", f"--net={pod.ns.path}", "python3", "-c", SERVER, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening" not in line:
        proc.kill()
        raise RuntimeError(f"pod server did not start: {line} {proc.stderr.read()}")
    return proc


def stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def client_send(client, host, port, token):
    return client.exec(["python3", "-c", CLIENT, host, str(port), token], check=False, timeout=20)


def iptables_dump(node):
    return node.ns.exec(["iptables-save"]).stdout + node.ns.exec(["ip6tables-save"]).stdout


# ----- tests -----

def test_installed_conflist_runs_through_reference_plugins(chain_node):
    """The conflist exactly as the agent installs it must be executable by a runtime whose
    chained plugins are Debian's reference plugins (supportedVersions up to 1.0.0)."""
    node = chain_node
    rt = chain_runtime(node, pin_version=False)
    assert [p["type"] for p in rt.conflist["plugins"]] == ["nodeplane", "portmap", "bandwidth"]
    pod = new_pod(node, "inst")
    try:
        res = rt.add(pod.cid, pod.ns.path, pod_name="inst", capability_args=CAPS)
    except PluginError as e:
        versions = {p["type"]: rt.version_of(p["type"])["supportedVersions"] for p in rt.conflist["plugins"]}
        # A runtime answers a failed ADD with a DEL through the same list.
        try:
            rt.delete(pod.cid, pod.ns.path, pod_name="inst")
            del_outcome = "succeeded"
        except PluginError as d:
            del_outcome = f"failed too: {d}"
        pytest.fail(f"ADD through the installed conflist (cniVersion {rt.version}) failed: {e}\n"
                    f"supportedVersions per plugin: {versions}\n"
                    f"the runtime's DEL after the failed ADD {del_outcome}; leases left: {list(node.leases())}")
    nodeplane_part(node, res)
    rt.delete(pod.cid, pod.ns.path, pod_name="inst")


def test_chain_add_keeps_result_and_hostport_is_reachable(chain_node):
    node = chain_node
    rt = chain_runtime(node)
    pod = new_pod(node, "web")
    res = rt.add(pod.cid, pod.ns.path, pod_name="web", capability_args=CAPS)
    pod.result = res
    assert [c for c, *_ in rt.log] == ["ADD"] * 3
    # Each plugin after nodeplane saw nodeplane's result as prevResult, with the runtimeConfig
    # of its capability.
    add_confs = {t: conf for c, t, conf, *_ in rt.log}
    assert "prevResult" not in add_confs["nodeplane"]
    assert add_confs["portmap"]["runtimeConfig"] == {"portMappings": CAPS["portMappings"]}
    nodeplane_part(node, add_confs["portmap"]["prevResult"])
    # The final result still has our interfaces and addresses (bandwidth appends its ifb).
    host_if, ips = nodeplane_part(node, res)
    assert ips == [pod.ip4(), pod.ip6()]
    lease = next(iter(node.leases().values()))
    assert sorted(lease["ips"]) == sorted(ip["address"] for ip in res["ips"] if ip.get("interface") == 2)
    assert lease["pod"] == "default/web"
    assert host_if in node.host_veths()
    # portmap's DNAT rules point at our pod addresses, per family.
    rules = iptables_dump(node)
    assert f"--to-destination {pod.ip4()}:{CONTAINER_PORT}" in rules, rules
    assert f"--to-destination [{pod.ip6()}]:{CONTAINER_PORT}" in rules, rules

    client = attach_client(node)
    server = start_server(pod, CONTAINER_PORT)
    try:
        # No route to the pod block on the client: only the hostPort DNAT can get it there.
        assert client.exec(["ip", "-4", "route", "get", pod.ip4()], check=False).returncode != 0
        out = client_send(client, CLIENT_NODE4, HOST_PORT, "hello-v4")
        assert out.returncode == 0, f"IPv4 hostPort {CLIENT_NODE4}:{HOST_PORT}: {out.stderr} {out.stdout}"
        assert out.stdout.strip() == f"pod got hello-v4 from ::ffff:{CLIENT_PEER4}", out.stdout
        out = client_send(client, CLIENT_NODE6, HOST_PORT, "hello-v6")
        assert out.returncode == 0, f"IPv6 hostPort [{CLIENT_NODE6}]:{HOST_PORT}: {out.stderr} {out.stdout}"
        assert out.stdout.strip() == f"pod got hello-v6 from {CLIENT_PEER6}", out.stdout
    finally:
        stop(server)
        client.delete()


def test_chain_bandwidth_shapes_host_veth(chain_node):
    node = chain_node
    rt = chain_runtime(node)
    pod = new_pod(node, "bw")
    res = rt.add(pod.cid, pod.ns.path, pod_name="bw", capability_args=CAPS)
    host_if, _ = nodeplane_part(node, res)
    qdiscs = harness.run(["tc", "-n", node.ns.name, "qdisc", "show", "dev", host_if]).stdout
    # ingressRate: tbf on the host veth (traffic towards the pod); egressRate: ingress qdisc
    # on the host veth redirecting to an ifb that carries the second tbf.
    assert "qdisc tbf" in qdiscs and "rate 8Mbit" in qdiscs, qdiscs
    assert "qdisc ingress" in qdiscs, qdiscs
    ifbs = [i["name"] for i in res["interfaces"] if i["name"].startswith("bwp")]
    assert len(ifbs) == 1, res
    ifb_q = harness.run(["tc", "-n", node.ns.name, "qdisc", "show", "dev", ifbs[0]]).stdout
    assert "qdisc tbf" in ifb_q and "rate 8Mbit" in ifb_q, ifb_q
    filters = harness.run(["tc", "-n", node.ns.name, "filter", "show", "dev", host_if, "ingress"]).stdout
    assert ifbs[0] in filters, filters


def test_chain_check_passes_after_add(make_node):
    """CHECK in list order with the cached final result (which carries bandwidth's ifb after
    our interfaces). portmap is left out of this list: its 1.1.1 CHECK is broken for
    dual-stack pods (checkPorts builds the rules for one address family and checks them in
    both the iptables and ip6tables nat tables, "could not check ipv6 dnat")."""
    node = make_node(tag="chk", chained=[{"type": "bandwidth", "capabilities": {"bandwidth": True}}])
    rt = chain_runtime(node)
    pod = new_pod(node, "chk")
    rt.add(pod.cid, pod.ns.path, pod_name="chk", capability_args=CAPS)
    try:
        rt.check(pod.cid, pod.ns.path, pod_name="chk")
    except PluginError as e:
        pytest.fail(f"CHECK through the chain failed: {e}")
    assert [t for c, t, *_ in rt.log if c == "CHECK"] == ["nodeplane", "bandwidth"]


def test_chain_del_in_reverse_cleans_everything(chain_node):
    node = chain_node
    rt = chain_runtime(node)
    pod = new_pod(node, "gone")
    keep = new_pod(node, "keep")
    res = rt.add(pod.cid, pod.ns.path, pod_name="gone", capability_args=CAPS)
    rt.add(keep.cid, keep.ns.path, pod_name="keep",
           capability_args={"portMappings": [{"hostPort": HOST_PORT + 1, "containerPort": CONTAINER_PORT,
                                              "protocol": "tcp"}]})
    host_if, _ = nodeplane_part(node, res)
    ifb = next(i["name"] for i in res["interfaces"] if i["name"].startswith("bwp"))
    before = iptables_dump(node)
    assert pod.cid in before and keep.cid in before, before
    # container id -> its per-pod DNAT chain, from the jump rule that carries the id
    dn_chains = {}
    for line in before.splitlines():
        for cid in (pod.cid, keep.cid):
            if f'id: \\"{cid}\\"' in line and "-j CNI-DN-" in line:
                dn_chains[cid] = line.split("-j ")[-1].strip()
    assert set(dn_chains) == {pod.cid, keep.cid}, before

    n_before = len(rt.log)
    rt.delete(pod.cid, pod.ns.path, pod_name="gone")
    dels = rt.log[n_before:]
    assert [t for c, t, *_ in dels] == ["bandwidth", "portmap", "nodeplane"]
    # Every DEL got the cached final result as prevResult.
    assert all(conf.get("prevResult") == res for _, _, conf, *_ in dels)

    after = iptables_dump(node)
    assert pod.cid not in after, after
    assert keep.cid in after, "the other pod's hostPort rules must stay\n" + after
    own = [line for line in after.splitlines() if str(HOST_PORT) in line.split() or f"{HOST_PORT}," in line]
    assert not own, f"rules for hostPort {HOST_PORT} survive the DEL: {own}"
    assert dn_chains[pod.cid] not in after and dn_chains[keep.cid] in after, after
    assert not [k for k, v in node.leases().items() if v["containerId"] == pod.cid]
    assert node.wait_no_graveyard()
    links = node.ns.links()
    assert host_if not in links and ifb not in links, sorted(links)
    assert len(node.leases()) == 1
    # A repeated DEL (runtimes retry; the result cache is gone, so no prevResult) succeeds too.
    rt.delete(pod.cid, pod.ns.path, pod_name="gone")
    assert "prevResult" not in rt.log[-1][2]


FAKE_PREV = textwrap.dedent("""\
    #!/usr/bin/env python3
    # A stand-in for a plugin that runs before nodeplane and reports its own interfaces.
    import json, os, sys
    conf = json.load(sys.stdin)
    cmd = os.environ["CNI_COMMAND"]
    if cmd == "VERSION":
        print(json.dumps({"cniVersion": conf.get("cniVersion", "1.0.0"),
                          "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]}))
    elif cmd == "ADD":
        print(json.dumps({
            "cniVersion": conf["cniVersion"],
            "interfaces": [
                {"name": "fakehost0", "mac": "02:00:00:00:00:0a"},
                {"name": "net1", "mac": "02:00:00:00:00:0b", "sandbox": os.environ["CNI_NETNS"]},
            ],
            "ips": [{"address": "192.0.2.10/24", "gateway": "192.0.2.1", "interface": 1}],
            "routes": [{"dst": "192.0.2.0/24"}],
            "dns": {"nameservers": ["192.0.2.53"]},
        }))
""")


def prev_result(sandbox, version):
    return {
        "cniVersion": version,
        "interfaces": [
            {"name": "fakehost0", "mac": "02:00:00:00:00:0a"},
            {"name": "net1", "mac": "02:00:00:00:00:0b", "sandbox": sandbox},
        ],
        "ips": [{"address": "192.0.2.10/24", "gateway": "192.0.2.1", "interface": 1}],
        "routes": [{"dst": "192.0.2.0/24"}],
        "dns": {"nameservers": ["192.0.2.53"]},
    }


def check_after_prev(node, res, sandbox):
    """nodeplane's result appended to a two-interface prevResult."""
    assert res["interfaces"][:2] == prev_result(sandbox, "x")["interfaces"], res
    prev_ips = [ip for ip in res["ips"] if ip["address"] == "192.0.2.10/24"]
    assert prev_ips == [{"address": "192.0.2.10/24", "gateway": "192.0.2.1", "interface": 1}], res
    assert {"dst": "192.0.2.0/24"} in res["routes"], res
    host_if, ips = nodeplane_part(node, res, offset=2)
    assert len(res["interfaces"]) >= 5 and len(res["ips"]) == 3, res
    # Every one of our addresses points at our eth0 (index 4), none at the previous ones.
    for ip in res["ips"]:
        if ip["address"] != "192.0.2.10/24":
            assert ip["interface"] == 4, res
    return host_if, ips


def test_nodeplane_after_synthetic_prev_result(chain_node):
    node = chain_node
    pod = new_pod(node, "prv")
    conf = node.netconf()
    conf["prevResult"] = prev_result(pod.ns.path, conf["cniVersion"])
    env = {"CNI_ARGS": Runtime.k8s_args("prv")}
    rc, res, raw = node.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=conf, env=env)
    assert rc == 0, raw
    host_if, ips = check_after_prev(node, res, pod.ns.path)
    assert f"{ips[0]}/24" in pod.ns.addrs("eth0")
    # CHECK with the chained result as prevResult passes (it finds eth0 at index 4).
    conf["prevResult"] = res
    rc, _, raw = node.cni("CHECK", pod.cid, "eth0", pod.ns.path, conf=conf, env=env)
    assert rc == 0, raw
    rc, _, raw = node.cni("DEL", pod.cid, "eth0", pod.ns.path, conf=conf, env=env)
    assert rc == 0, raw
    assert node.leases() == {}
    assert node.wait_no_graveyard() and host_if not in node.ns.links()


def test_nodeplane_after_another_plugin_in_chain(chain_node):
    """[fakeprev, nodeplane, portmap, bandwidth]: portmap must find our eth0 addresses in the
    re-indexed result (it skips ips whose interface is not CNI_IFNAME in the sandbox)."""
    node = chain_node
    fakebin = node.root / "fakebin"
    fakebin.mkdir()
    (fakebin / "fakeprev").write_text(FAKE_PREV)
    os.chmod(fakebin / "fakeprev", 0o755)
    rt = chain_runtime(node, pin_version=False, extra_bin=[fakebin])
    rt.conflist["plugins"].insert(0, {"type": "fakeprev"})
    rt.conflist["cniVersion"] = rt.common_version()
    pod = new_pod(node, "aft")
    res = rt.add(pod.cid, pod.ns.path, pod_name="aft", capability_args=CAPS)
    nodeplane_conf = next(conf for c, t, conf, *_ in rt.log if t == "nodeplane")
    assert nodeplane_conf["prevResult"]["interfaces"][1]["name"] == "net1"
    host_if, ips = check_after_prev(node, res, pod.ns.path)
    rules = iptables_dump(node)
    assert f"--to-destination {ips[0]}:{CONTAINER_PORT}" in rules, rules
    assert "192.0.2.10" not in rules, rules
    rt.delete(pod.cid, pod.ns.path, pod_name="aft")
    assert node.leases() == {}
    assert node.wait_no_graveyard() and host_if not in node.ns.links()
    assert pod.cid not in iptables_dump(node)


def test_conflist_version_lowered_to_what_chained_plugins_support(make_node):
    """Configured for 1.1.0, but Debian's portmap/bandwidth stop at 1.0.0: the agent asks
    them (CNI VERSION) and writes the highest version every plugin supports."""
    node = make_node(tag="neg", chained=CHAINED, extra={"cniVersion": "1.1.0"})
    conflist = json.loads(node.conflist_path.read_text())
    res = subprocess.run([str(harness.REF_CNI_DIR / "portmap")], input='{"cniVersion":"0.4.0"}',
                         env={"CNI_COMMAND": "VERSION"}, capture_output=True, text=True, check=True)
    assert "1.1.0" not in json.loads(res.stdout)["supportedVersions"]
    assert conflist["cniVersion"] == "1.0.0"
    assert "lowering" in node.log()
    # Without chained plugins the configured 1.1.0 is kept.
    plain = make_node(tag="neg", extra={"cniVersion": "1.1.0"})
    assert json.loads(plain.conflist_path.read_text())["cniVersion"] == "1.1.0"
