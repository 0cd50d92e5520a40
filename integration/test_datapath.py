"""Single-node datapath: pods reach each other and the gateway; masquerade is in place."""

import json
import shutil
import subprocess

import harness


def test_two_pods_ping_each_other_and_gateway(node):
    a, ra = node.add_pod("a")
    b, rb = node.add_pod("b")
    assert a.ip4() != b.ip4() and a.ip6() != b.ip6()
    gw4 = ra["ips"][0]["gateway"]
    gw6 = ra["ips"][1]["gateway"]
    # Kernel state in the pod: the addresses, MTU, lo up, default routes.
    links = a.ns.links()
    assert links["eth0"]["mtu"] == 1400
    assert "UP" in links["lo"]["flags"]
    assert f"{a.ip4()}/24" in a.ns.addrs("eth0") and f"{a.ip6()}/64" in a.ns.addrs("eth0")
    routes4 = a.ns.ip_json("-4", "route", "show", "default")
    routes6 = a.ns.ip_json("-6", "route", "show", "default")
    assert routes4[0]["gateway"] == gw4 and routes6[0]["gateway"] == gw6
    # Reachability, both families.
    assert a.ns.ping(b.ip4()), "IPv4 pod-to-pod"
    assert a.ns.ping(b.ip6()), "IPv6 pod-to-pod"
    assert b.ns.ping(gw4), "IPv4 pod-to-gateway"
    assert b.ns.ping(gw6), "IPv6 pod-to-gateway"
    # Host end is on the bridge.
    host_if = ra["interfaces"][1]["name"]
    host_link = node.ns.links()[host_if]
    assert host_link["master"] == "np0"
    # One queue each way on both ends (the kernel's default is one per possible CPU, each
    # a set of sysfs objects made at every ADD; only XDP uses them, and none is attached).
    for link in (links["eth0"], host_link):
        assert (link["num_tx_queues"], link["num_rx_queues"]) == (1, 1), link
    # The pod bridge does not snoop multicast: with no querier it floods anyway, and
    # snooping only costs per-port state and timers at every ADD (IPv6 neighbour discovery
    # between the pods above went through the flood).
    assert node.ns.links()["np0"]["linkinfo"]["info_data"]["mcast_snooping"] == 0
    # Masquerade rule for traffic leaving the cluster ranges.
    rules = node.ns.exec(["nft", "-j", "list", "table", "inet", "nodeplane"]).stdout
    text = node.ns.exec(["nft", "list", "table", "inet", "nodeplane"]).stdout
    assert "masquerade" in text and node.v4 in text and node.v6 in text, text
    assert json.loads(rules)


def test_conflist_version_defaults_to_1_0_0(node):
    """Runtimes with pre-1.1 CNI libraries (podman 4, containerd 1.x) must be able to read results."""
    conflist = json.loads(node.conflist_path.read_text())
    assert conflist["cniVersion"] == "1.0.0"
    pod, res = node.add_pod()
    assert res["cniVersion"] == "1.0.0"
    assert "mtu" not in res["interfaces"][2]


def test_installed_shim_runs_without_the_hosts_c_library(node, tmp_path):
    """The runtime execs the shim on the host, with the host's C library, not the one the
    agent's image was built with: the shim the agent installed must need none. Run in a root
    directory holding nothing but the shim (no loader, no libc), it still answers VERSION and
    reports a missing agent with the right CNI code, as a statically linked binary does; a
    dynamically linked one fails to exec there."""
    installed = node.bin_dir / "nodeplane"
    head = installed.read_bytes()
    assert head[:4] == b"\x7fELF"
    root = tmp_path / "bare-root"
    root.mkdir()
    (root / "nodeplane").write_bytes(head)
    (root / "nodeplane").chmod(0o755)
    conf = json.dumps({"cniVersion": "1.1.0", "name": "x", "type": "nodeplane",
                       "agentSocket": "/no-agent.sock", "agentWaitSeconds": 0})
    chroot = shutil.which("chroot")
    assert chroot, "chroot (coreutils) is missing"
    env = {"CNI_COMMAND": "VERSION"}
    res = subprocess.run([chroot, str(root), "/nodeplane"], input=conf.encode(), env=env, capture_output=True,
                         timeout=30)
    assert res.returncode == 0, (res.returncode, res.stderr)
    assert "1.0.0" in json.loads(res.stdout)["supportedVersions"]
    # STATUS goes to the agent socket, absent in the bare root: code 50, not a crash.
    env = {"CNI_COMMAND": "STATUS", "CNI_PATH": "/"}
    res = subprocess.run([chroot, str(root), "/nodeplane"], input=conf.encode(), env=env, capture_output=True,
                         timeout=30)
    assert res.returncode == 1 and json.loads(res.stdout)["code"] == 50, (res.stdout, res.stderr)


def test_a_bridge_that_snoops_multicast_is_turned_over_at_start(node):
    """A bridge made by an earlier version (snooping on, the kernel's default) is adopted and
    its snooping turned off at the next start; its pods keep working."""
    a, _ = node.add_pod("a")
    b, _ = node.add_pod("b")
    node.ns.exec(["ip", "link", "set", "np0", "type", "bridge", "mcast_snooping", "1"])
    assert node.ns.links()["np0"]["linkinfo"]["info_data"]["mcast_snooping"] == 1
    node.restart()
    assert node.ns.links()["np0"]["linkinfo"]["info_data"]["mcast_snooping"] == 0
    assert a.ns.ping(b.ip6()) and a.ns.ping(b.ip4())


def test_result_carries_dns_mtu_and_interfaces(node):
    pod, res = node.add_pod(version="1.1.0")
    assert res["cniVersion"] == "1.1.0"
    names = [i["name"] for i in res["interfaces"]]
    assert names[0] == "np0" and names[2] == "eth0"
    assert res["interfaces"][2]["sandbox"] == pod.ns.path
    assert res["interfaces"][2]["mtu"] == 1400
    assert res["dns"]["nameservers"] == ["10.96.0.10"]
    assert {r["dst"] for r in res["routes"]} == {"0.0.0.0/0", "::/0"}
    # MAC in the result is the real one in the pod.
    assert pod.ns.links()["eth0"]["address"] == res["interfaces"][2]["mac"]
