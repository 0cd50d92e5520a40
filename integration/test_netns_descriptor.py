"""The pod's network namespace travels as a descriptor (issue 20).

The shim opens CNI_NETNS in the runtime's mount and PID namespaces and passes the open
descriptor to the agent with the request (SCM_RIGHTS); the agent never resolves the runtime's
path. Two runtimes the agent could not serve by path:

* the pod namespace is bind-mounted only in the runtime's own mount namespace (a private
  tmpfs the agent cannot see), as when the DaemonSet pod does not receive the runtime's
  netns mounts;
* CNI_NETNS is /proc/<pid>/ns/net of a process in a PID namespace the agent does not share,
  with the agent in a PID namespace of its own (as in a DaemonSet pod): there the same number
  names one of the agent's own threads, whose namespace is the node's.

ADD, CHECK and DEL all succeed; the interface is in the pod's namespace (and nowhere else),
traffic flows, and DEL leaves no lease, veth or address behind.
"""

import json
import os
import subprocess
import sys

import harness

# Runs inside the runtime's namespaces: makes the pod namespace, execs the shim for ADD,
# CHECK and DEL like a runtime, and reports what it saw inside the pod namespace. Data comes
# through argv (a JSON document), never through the program text.
RUNTIME = r"""
import json, os, subprocess, sys, time
job = json.loads(sys.argv[1])

def shim(command, netns, conf):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CNI_COMMAND": command,
           "CNI_CONTAINERID": job["cid"], "CNI_IFNAME": "eth0", "CNI_NETNS": netns,
           "CNI_PATH": job["cni_path"], "CNI_ARGS": "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p"}
    r = subprocess.run([job["shim"]], input=json.dumps(conf).encode(), env=env, capture_output=True, timeout=60)
    return r.returncode, r.stdout.decode()

def inside(netns, *args):
    r = subprocess.run(["nsenter", "--net=" + netns, *args], capture_output=True, text=True)
    return r.returncode, r.stdout

out = {}
if job["mode"] == "private-mount":
    d = job["private_dir"]
    subprocess.run(["mount", "-t", "tmpfs", "none", d], check=True)
    netns = os.path.join(d, "pod")
    open(netns, "w").close()
    subprocess.run(["unshare", "--net=" + netns, "true"], check=True)
    subprocess.run(["ip", "-n", "lo"], capture_output=True)
else:
    # A process in this (new) PID namespace holding a new network namespace.
    holder = subprocess.Popen(["unshare", "--net", "sleep", "600"])
    time.sleep(0.3)
    child = subprocess.run(["pgrep", "-P", str(holder.pid)], capture_output=True, text=True).stdout.split()
    pid = int(child[0]) if child else holder.pid
    netns = f"/proc/{pid}/ns/net"
    out["pid"] = pid
out["netns"] = netns
out["add"] = shim("ADD", netns, job["conf"])
if out["add"][0] == 0:
    prev = json.loads(out["add"][1])
    conf = dict(job["conf"], prevResult=prev)
    out["check"] = shim("CHECK", netns, conf)
    out["addrs"] = inside(netns, "ip", "-j", "addr", "show", "dev", "eth0")
    gw = next(ip["gateway"] for ip in prev["ips"] if ":" not in ip["address"])
    out["ping_gateway"] = inside(netns, "ping", "-c", "1", "-W", "2", gw)[0]
    out["ready_file"] = job["ready_file"]
    # Whole or not at all: the test reads the file as soon as it exists.
    open(job["ready_file"] + ".tmp", "w").write(json.dumps(prev))
    os.rename(job["ready_file"] + ".tmp", job["ready_file"])
    # The test pings the pod from the node while it exists.
    deadline = time.time() + 30
    while not os.path.exists(job["go_file"]) and time.time() < deadline:
        time.sleep(0.02)
    out["del"] = shim("DEL", netns, dict(job["conf"], prevResult=prev))
    # DEL detaches at once; the agent's reaper deletes the pair in the background.
    deadline = time.time() + 20
    while time.time() < deadline:
        out["addrs_after_del"] = inside(netns, "ip", "-j", "link", "show")
        if '"eth0"' not in out["addrs_after_del"][1]:
            break
        time.sleep(0.05)
print(json.dumps(out))
"""


def run_runtime(node, tmp_path, mode, wrap):
    conf = node.netconf()
    job = {"mode": mode, "cid": f"desc-{mode}-{os.urandom(4).hex()}", "shim": str(node.bin_dir / "nodeplane"),
           "cni_path": str(node.bin_dir), "conf": conf, "private_dir": str(tmp_path / "private"),
           "ready_file": str(tmp_path / "ready.json"), "go_file": str(tmp_path / "go")}
    (tmp_path / "private").mkdir()
    proc = subprocess.Popen([*wrap, sys.executable, "-c", RUNTIME, json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    harness.wait_until(lambda: (tmp_path / "ready.json").exists() or proc.poll() is not None, timeout=30,
                       what="the runtime's ADD")
    seen = {}
    if (tmp_path / "ready.json").exists():
        prev = json.loads((tmp_path / "ready.json").read_text())
        ip4 = next(i["address"].split("/")[0] for i in prev["ips"] if ":" not in i["address"])
        seen["lease_while_up"] = node.leases()
        seen["ping_pod_from_node"] = node.ns.ping(ip4)
        seen["node_has_eth0"] = "eth0" in node.ns.links()
        (tmp_path / "go").write_text("")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"runtime emulator failed: {err}"
    return json.loads(out), seen


def assert_served(node, out, seen):
    assert out["add"][0] == 0, f"ADD: {out['add'][1]}"
    assert out["check"][0] == 0, f"CHECK: {out['check'][1]}"
    addrs = json.loads(out["addrs"][1])
    assert out["addrs"][0] == 0 and addrs, "eth0 is in the pod namespace"
    assert out["ping_gateway"] == 0, "the pod reaches its gateway"
    assert seen["ping_pod_from_node"], "the node reaches the pod"
    assert not seen["node_has_eth0"], "nothing was made in the node's own namespace"
    [lease] = seen["lease_while_up"].values()
    assert lease["netns"] == out["netns"], "the lease records the runtime's path (for display only)"
    assert lease["netnsInode"] != 0 and harness.cookie_as_the_kernel_gives(lease["netnsCookie"]), lease
    assert out["del"][0] == 0, f"DEL: {out['del'][1]}"
    links = [l["ifname"] for l in json.loads(out["addrs_after_del"][1])]
    assert links == ["lo"], f"after DEL (and the reaper) the pod namespace holds only lo: {links}"
    assert node.leases() == {}, "no lease left"
    assert node.wait_no_graveyard(), "the host veth is gone"
    assert not [n for n in node.host_veths()], node.host_veths()


def test_netns_only_in_the_runtimes_mount_namespace(node, tmp_path):
    out, seen = run_runtime(node, tmp_path, "private-mount", ["unshare", "--mount", "--propagation", "private"])
    # The agent cannot see the path at all.
    assert not os.path.exists(out["netns"]), "the pod namespace's path exists only in the runtime's mount namespace"
    assert_served(node, out, seen)


def test_proc_pid_netns_of_a_pid_namespace_the_agent_does_not_share(make_node, tmp_path):
    node = make_node(start=False)
    node.own_pid_namespace = True
    node.start()
    out, seen = run_runtime(node, tmp_path, "pid", ["unshare", "--pid", "--fork", "--mount-proc"])
    assert out["netns"].startswith("/proc/") and out["pid"] < 100, out["netns"]
    assert_served(node, out, seen)


def test_a_shim_that_passes_no_descriptor_is_told_to_try_again(node):
    # What an older shim (or any client that only sends the frame) gets: code 11, nothing made.
    import socket
    import struct
    pod = harness.Pod(node, "nodesc")
    try:
        env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": pod.cid, "CNI_IFNAME": "eth0", "CNI_NETNS": pod.ns.path,
               "CNI_PATH": str(node.bin_dir)}
        body = json.dumps({"env": env, "stdin": json.dumps(node.netconf())}).encode()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(node.socket))
        s.sendall(struct.pack(">I", len(body)) + body)
        n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
        reply = json.loads(s.recv(n, socket.MSG_WAITALL))
        s.close()
        err = json.loads(reply["stdout"])
        assert err["code"] == 11 and "descriptor" in err["msg"], err
        assert node.leases() == {} and not node.host_veths()
        assert "eth0" not in pod.ns.links()
    finally:
        pod.ns.delete()
