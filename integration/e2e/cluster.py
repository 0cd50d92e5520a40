"""A real Kubernetes cluster on one machine, without Docker: bring-up and teardown.

The control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the
snapshot-controller) runs in one network namespace; every worker node is a network namespace
of its own with a private mount namespace, in which its containerd and kubelet run. All of
them sit on a private underlay: a bridge in a namespace of its own. Inside a worker's mount
namespace the node's own directories are bind-mounted over the standard paths
(`/var/lib/kubelet`, `/run`, `/etc/cni/net.d`, `/opt/cni/bin`, `/var/lib/nodeplane`,
`/var/log/pods`), so the manifests of `daemonset/` run unchanged and two kubelets never see
each other's state. Nothing is done in the host's root network namespace.

Every process is started here, recorded with its PID in the state file, and stopped by that
PID (after checking that it still runs the command recorded).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("NODEPLANE_E2E_DIR", "/var/tmp/nodeplane-e2e"))
STATE = WORK / "state.json"

# The lane's underlay plan (the test overlay in daemonset/overlays/e2e names the same
# addresses: the control plane's, and the first worker's, where the controller runs).
PREFIX = "npe2e"
UNDERLAY = f"{PREFIX}-ul"
CONTROL = f"{PREFIX}-cp"
NET4, NET6 = "198.18.100", "fd18:100::"
GATEWAY4, GATEWAY6 = f"{NET4}.1", f"{NET6}1"
CP4, CP6 = f"{NET4}.2", f"{NET6}2"
SERVICE_CIDRS = "10.96.0.0/16,fd00:10:96::/112"
SERVICE_IP = "10.96.0.1"
APISERVER_PORT = 6443

# Images the lane makes (the sidecars carry exactly the names the manifests use).
PAUSE_IMAGE = "localhost/nodeplane-e2e/pause:1"
BUSYBOX_IMAGE = "localhost/nodeplane-e2e/busybox:1"
SIDECARS = {
    "csi-provisioner": "registry.k8s.io/sig-storage/csi-provisioner:v5.3.0",
    "csi-resizer": "registry.k8s.io/sig-storage/csi-resizer:v1.14.0",
    "csi-snapshotter": "registry.k8s.io/sig-storage/csi-snapshotter:v8.3.0",
}

# Paths bind-mounted from the node's directory over the standard ones, in its mount namespace.
NODE_BINDS = {
    "run": "/run",
    "kubelet": "/var/lib/kubelet",
    "nodeplane": "/var/lib/nodeplane",
    "cni-conf": "/etc/cni/net.d",
    "cni-bin": "/opt/cni/bin",
    "log-pods": "/var/log/pods",
    "log-containers": "/var/log/containers",
}


class Fail(Exception):
    """A step of the lane that did not work: the message says which and why."""


def log(msg):
    print(f"e2e: {msg}", file=sys.stderr, flush=True)


def run(args, check=True, **kw):
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    r = subprocess.run([str(a) for a in args], **kw)
    if check and r.returncode != 0:
        raise Fail(f"{' '.join(map(str, args))} failed ({r.returncode}): {(r.stderr or r.stdout or '').strip()[-2000:]}")
    return r


def wait_for(pred, timeout, what, every=0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise Fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


# ----- where the binaries come from -----


def k8s_bin():
    """The directory of the unpacked Kubernetes binaries (K8S_BIN; see ../shared/k8s)."""
    d = os.environ.get("K8S_BIN")
    if not d:
        raise Fail("K8S_BIN is not set: unpack ../shared/k8s with its unpack.sh DIR and export K8S_BIN=DIR")
    d = Path(d)
    for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "snapshot-controller",
              *SIDECARS):
        if not os.access(d / b, os.X_OK):
            raise Fail(f"{d / b} is missing or not executable (K8S_BIN={d})")
    return d


def tool(name):
    """etcd and kubectl (PyPI), containerd 1.7 (Debian trixie, scripts/install-deps)."""
    if name in ("containerd", "ctr", "containerd-shim-runc-v2"):
        p = containerd_dir() / name
        if os.access(p, os.X_OK):
            return str(p)
        raise Fail(f"{p} is missing: run scripts/install-deps (it fetches containerd 1.7 from Debian trixie)")
    p = shutil.which(name)
    if not p:
        raise Fail(f"{name} is not installed: run scripts/install-deps")
    return p


def containerd_dir():
    return Path(os.environ.get("NODEPLANE_CONTAINERD_DIR", "/var/cache/nodeplane-e2e/containerd/usr/bin"))


# ----- state -----


def load_state():
    if STATE.exists():
        return json.loads(STATE.read_text())
    return {}


def save_state(st):
    WORK.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(st, indent=1))
    tmp.replace(STATE)


def spawn(st, key, args, logfile, env=None):
    """Start a long-running process in a session of its own; record it under `key`."""
    f = open(logfile, "ab")
    p = subprocess.Popen([str(a) for a in args], stdout=f, stderr=f, stdin=subprocess.DEVNULL,
                         start_new_session=True, env=env)
    st.setdefault("procs", {})[key] = {"pid": p.pid, "start": start_time(p.pid), "cmd": [str(a) for a in args],
                                       "log": str(logfile)}
    save_state(st)
    return p.pid


def start_time(pid):
    """The process's start time in clock ticks since boot: with the PID, it names one process
    (a PID reused by another process has another start time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def ours(proc):
    """Is the recorded process still running (the same PID and start time)?"""
    return proc.get("start") is not None and start_time(proc["pid"]) == proc["start"]


def stop(procs, grace=10):
    """SIGTERM the recorded processes (each with its session) at once; SIGKILL whatever still
    runs after `grace` seconds."""
    live = [p for p in procs if ours(p)]
    for p in live:
        try:
            os.killpg(p["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(ours(p) for p in live):
        time.sleep(0.1)
    for p in live:
        if ours(p):
            try:
                os.killpg(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def running(st, key):
    """True while the recorded process runs; a Fail naming its log's end once it has exited."""
    proc = st["procs"][key]
    if ours(proc) and proc_state(proc["pid"]) != "Z":
        return True
    tail = Path(proc["log"]).read_text(errors="replace")[-3000:] if Path(proc["log"]).exists() else ""
    raise Fail(f"{key} exited; the end of {proc['log']}:\n{tail}")


def proc_state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def ns_path(ns):
    return f"/var/run/netns/{ns}"


def in_net(ns, args):
    return ["nsenter", f"--net={ns_path(ns)}", "--", *args]


# ----- certificates and kubeconfigs -----


def openssl_cert(pki, name, subject, ca=True, sans=(), usage="clientAuth"):
    """A P-256 key and a certificate signed by the lane's CA (or the CA itself)."""
    key, crt = pki / f"{name}.key", pki / f"{name}.crt"
    if crt.exists():
        return
    args = ["openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", key, "-out", crt, "-days", "30", "-subj", subject]
    if ca:
        args += ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
    else:
        args += ["-CA", pki / "ca.crt", "-CAkey", pki / "ca.key", "-addext", "basicConstraints=critical,CA:FALSE",
                 "-addext", "keyUsage=critical,digitalSignature,keyEncipherment", "-addext",
                 f"extendedKeyUsage={usage}"]
        if sans:
            args += ["-addext", "subjectAltName=" + ",".join(sans)]
    run(args)
    key.chmod(0o600)


def make_pki(pki, nodes):
    pki.mkdir(parents=True, exist_ok=True)
    openssl_cert(pki, "ca", "/CN=nodeplane-e2e-ca")
    openssl_cert(pki, "apiserver", "/CN=kube-apiserver", ca=False, usage="serverAuth",
                 sans=[f"IP:{CP4}", f"IP:{CP6}", f"IP:{SERVICE_IP}", "IP:127.0.0.1", "DNS:kubernetes",
                       "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                       "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost"])
    openssl_cert(pki, "admin", "/O=system:masters/CN=nodeplane-e2e-admin", ca=False)
    openssl_cert(pki, "apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", ca=False)
    openssl_cert(pki, "controller-manager", "/CN=system:kube-controller-manager", ca=False)
    openssl_cert(pki, "scheduler", "/CN=system:kube-scheduler", ca=False)
    for n in nodes:
        openssl_cert(pki, n["name"], f"/O=system:nodes/CN=system:node:{n['name']}", ca=False)
    if not (pki / "sa.key").exists():
        run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", pki / "sa.key"])
        run(["openssl", "pkey", "-in", pki / "sa.key", "-pubout", "-out", pki / "sa.pub"])


def kubeconfig(path, pki, user, server):
    """A kubeconfig (JSON is YAML) for the client certificate `user`."""
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {"client-certificate": str(pki / f"{user}.crt"),
                                          "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
    }
    path.write_text(json.dumps(cfg, indent=1))
    path.chmod(0o600)
    return path


def server_url():
    return f"https://{CP4}:{APISERVER_PORT}"


def admin_kubeconfig():
    return WORK / "admin.kubeconfig"


# ----- the underlay -----


def make_underlay(st):
    run(["ip", "netns", "add", UNDERLAY])
    st["netns"].append(UNDERLAY)
    save_state(st)
    run(["ip", "-n", UNDERLAY, "link", "set", "lo", "up"])
    run(["ip", "-n", UNDERLAY, "link", "add", "br0", "type", "bridge"])
    run(["ip", "netns", "exec", UNDERLAY, "sysctl", "-qw", "net.ipv6.conf.br0.accept_dad=0"])
    run(["ip", "-n", UNDERLAY, "addr", "add", f"{GATEWAY4}/24", "dev", "br0"])
    run(["ip", "-n", UNDERLAY, "addr", "add", f"{GATEWAY6}/64", "dev", "br0", "nodad"])
    run(["ip", "-n", UNDERLAY, "link", "set", "br0", "up"])


def attach(st, ns, port, ip4, ip6):
    """A namespace on the underlay: a veth `ul0` with one address per family, default routes
    through the underlay's bridge address (as a node has a default route)."""
    run(["ip", "netns", "add", ns])
    st["netns"].append(ns)
    save_state(st)
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", UNDERLAY, "link", "add", port, "type", "veth", "peer", "name", "ul0", "netns", ns])
    run(["ip", "-n", UNDERLAY, "link", "set", port, "master", "br0", "up"])
    run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.ul0.accept_dad=0"])
    run(["ip", "-n", ns, "addr", "add", f"{ip4}/24", "dev", "ul0"])
    run(["ip", "-n", ns, "addr", "add", f"{ip6}/64", "dev", "ul0", "nodad"])
    run(["ip", "-n", ns, "link", "set", "ul0", "up"])
    run(["ip", "-n", ns, "route", "add", "default", "via", GATEWAY4])
    run(["ip", "-n", ns, "-6", "route", "add", "default", "via", GATEWAY6])


# ----- the control plane -----


def start_control_plane(st, kbin):
    d = WORK / "control"
    d.mkdir(parents=True, exist_ok=True)
    pki = WORK / "pki"
    attach(st, CONTROL, "ulcp", CP4, CP6)
    spawn(st, "etcd", in_net(CONTROL, [tool("etcd"), "--name", "e2e", "--data-dir", d / "etcd",
                                       "--listen-client-urls", "http://127.0.0.1:2379",
                                       "--advertise-client-urls", "http://127.0.0.1:2379",
                                       "--listen-peer-urls", "http://127.0.0.1:2380",
                                       "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                                       "--initial-cluster", "e2e=http://127.0.0.1:2380"]),
          d / "etcd.log")
    spawn(st, "kube-apiserver", in_net(CONTROL, [
        kbin / "kube-apiserver", "--etcd-servers", "http://127.0.0.1:2379",
        "--bind-address", "::", "--advertise-address", CP4, "--secure-port", APISERVER_PORT,
        "--tls-cert-file", pki / "apiserver.crt", "--tls-private-key-file", pki / "apiserver.key",
        "--client-ca-file", pki / "ca.crt",
        "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file", pki / "sa.pub", "--service-account-signing-key-file", pki / "sa.key",
        "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
        "--allow-privileged=true", "--service-cluster-ip-range", SERVICE_CIDRS,
        "--kubelet-client-certificate", pki / "apiserver-kubelet-client.crt",
        "--kubelet-client-key", pki / "apiserver-kubelet-client.key",
        "--kubelet-preferred-address-types", "InternalIP", "--cert-dir", d / "apiserver-certs",
        "--profiling=false", "--v=1"]), d / "kube-apiserver.log")
    admin = kubeconfig(admin_kubeconfig(), pki, "admin", server_url())
    wait_for(lambda: running(st, "kube-apiserver") and kubectl(["get", "--raw", "/readyz"], check=False).returncode == 0,
             90, "kube-apiserver to be ready")
    cm = kubeconfig(d / "controller-manager.kubeconfig", pki, "controller-manager", server_url())
    spawn(st, "kube-controller-manager", in_net(CONTROL, [
        kbin / "kube-controller-manager", "--kubeconfig", cm, "--authentication-kubeconfig", cm,
        "--authorization-kubeconfig", cm, "--service-account-private-key-file", pki / "sa.key",
        "--root-ca-file", pki / "ca.crt", "--use-service-account-credentials", "--leader-elect=false",
        "--bind-address", "127.0.0.1", "--service-cluster-ip-range", SERVICE_CIDRS,
        "--profiling=false", "--v=1"]), d / "kube-controller-manager.log")
    sch = kubeconfig(d / "scheduler.kubeconfig", pki, "scheduler", server_url())
    spawn(st, "kube-scheduler", in_net(CONTROL, [
        kbin / "kube-scheduler", "--kubeconfig", sch, "--authentication-kubeconfig", sch,
        "--authorization-kubeconfig", sch, "--leader-elect=false", "--bind-address", "127.0.0.1",
        "--profiling=false", "--v=1"]), d / "kube-scheduler.log")
    # The VolumeSnapshot CRDs and the snapshot-controller, as a cluster's add-on installs them
    # (upstream external-snapshotter v8.3.0, the release of the manifests' csi-snapshotter).
    kubectl(["apply", "--server-side", "-k", Path(os.environ.get("NODEPLANE_K8S_SHARED", REPO.parent / "shared/k8s"))
             / "snapshot-crds"])
    spawn(st, "snapshot-controller", in_net(CONTROL, [
        kbin / "snapshot-controller", "--kubeconfig", admin, "--leader-election=false", "--v=2"]),
        d / "snapshot-controller.log")


def kubectl(args, check=True, input=None, timeout=120):
    """kubectl as the cluster's admin, from the control plane's namespace (the API server
    listens on the underlay only)."""
    return run(in_net(CONTROL, [tool("kubectl"), "--kubeconfig", admin_kubeconfig(), *args]), check=check,
               input=input, timeout=timeout)


# ----- worker nodes -----


def node_plan(count):
    return [{"name": f"e2e-w{i}", "ns": f"{PREFIX}-w{i}", "ip4": f"{NET4}.{10 + i}", "ip6": f"{NET6}{10 + i:x}",
             "dir": str(WORK / f"w{i}")} for i in range(1, count + 1)]


def in_node(node, args):
    """`args` inside the node: its network namespace and its mount namespace."""
    holder = node["holder"]
    return ["nsenter", f"--net={ns_path(node['ns'])}", f"--mount=/proc/{holder}/ns/mnt", "--", *args]


def make_mount_namespace(st, node):
    """A process holding the node's private mount namespace; the node's directories are
    bind-mounted over the standard paths there. Propagation inside it is shared (kubelet and
    the agent's Bidirectional mounts need that); nothing propagates to the host."""
    nd = Path(node["dir"])
    for sub in NODE_BINDS:
        (nd / sub).mkdir(parents=True, exist_ok=True)
    (nd / "run" / "netns").mkdir(exist_ok=True)
    node["holder"] = spawn(st, f"{node['name']}/holder", in_net(node["ns"], [
        "unshare", "--mount", "--propagation", "private", "--", "sleep", "infinity"]), nd / "holder.log")
    save_state(st)
    wait_for(lambda: os.readlink(f"/proc/{node['holder']}/ns/mnt") != os.readlink("/proc/self/ns/mnt"), 5,
             f"{node['name']}'s mount namespace")
    # Its identity (mnt:[inode]): down finds every process left in it by this.
    node["mntns"] = os.readlink(f"/proc/{node['holder']}/ns/mnt")
    save_state(st)
    enter = ["nsenter", f"--mount=/proc/{node['holder']}/ns/mnt", "--"]
    run(enter + ["mount", "--make-rshared", "/"])
    for sub, target in NODE_BINDS.items():
        # The standard path may not exist on this host (no kubelet installed): the mount
        # point is made on the host once, empty, and left for the next run.
        Path(target).mkdir(parents=True, exist_ok=True)
        run(enter + ["mount", "--bind", nd / sub, target])
        # Its own peer group: mounts below it propagate to the node's containers only.
        run(enter + ["mount", "--make-private", target])
        run(enter + ["mount", "--make-shared", target])


def containerd_config(node):
    nd = Path(node["dir"])
    return f"""version = 2
root = "{nd / 'containerd'}"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_cdi = true
  # Root here lacks CAP_SYS_RESOURCE and cannot lower an oom_score_adj (kubelet asks -998
  # for every pod sandbox): capped at containerd's own, as for rootless containerd.
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["/var/run/cdi", "/etc/cdi"]
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{shutil.which('runc') or '/usr/sbin/runc'}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
"""


def kubelet_config(node):
    pki = WORK / "pki"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # This machine's cgroups are v1 (hybrid).
        "failCgroupV1": False, "failSwapOn": False, "cgroupDriver": "cgroupfs",
        # Each kubelet's pods under a cgroup root of its own.
        "cgroupRoot": f"/{PREFIX}-{node['name']}",
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "authentication": {"x509": {"clientCAFile": str(pki / "ca.crt")}, "webhook": {"enabled": False},
                           "anonymous": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "address": node["ip4"], "healthzBindAddress": "127.0.0.1", "readOnlyPort": 0,
        "resolvConf": "/etc/resolv.conf",
        # A shared test host: no eviction for its disk or memory, which other work uses.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False, "syncFrequency": "10s", "fileCheckFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s", "nodeStatusReportFrequency": "10s",
        "rotateCertificates": False, "serverTLSBootstrap": False, "protectKernelDefaults": False,
    }


def start_node(st, node, kbin, images):
    nd = Path(node["dir"])
    attach(st, node["ns"], f"ul{node['name'][-2:]}", node["ip4"], node["ip6"])
    make_mount_namespace(st, node)
    # What a node's OS provides: the loopback CNI plugin (containerd needs it for every pod).
    shutil.copy2("/usr/lib/cni/loopback", nd / "cni-bin" / "loopback")
    (nd / "containerd.toml").write_text(containerd_config(node))
    env = dict(os.environ, PATH=f"{containerd_dir()}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    spawn(st, f"{node['name']}/containerd", in_node(node, [tool("containerd"), "--config", nd / "containerd.toml"]),
          nd / "containerd.log", env=env)
    sock = nd / "run" / "containerd" / "containerd.sock"
    wait_for(lambda: running(st, f"{node['name']}/containerd") and sock.exists(), 30, f"{node['name']}'s containerd socket")
    for archive in images:
        run([tool("ctr"), "--address", sock, "-n", "k8s.io", "images", "import", "--no-unpack=false", archive],
            timeout=600)
    make_cgroups(kubelet_config(node)["cgroupRoot"])
    (nd / "kubelet.json").write_text(json.dumps(kubelet_config(node), indent=1))
    kc = kubeconfig(nd / "kubelet.kubeconfig", WORK / "pki", node["name"], server_url())
    spawn(st, f"{node['name']}/kubelet", in_node(node, [
        kbin / "kubelet", "--config", nd / "kubelet.json", "--kubeconfig", kc,
        "--hostname-override", node["name"], "--node-ip", f"{node['ip4']},{node['ip6']}", "--v=1"]),
        nd / "kubelet.log")


# ----- up and down -----


def up(nodes=2, images=()):
    if STATE.exists():
        raise Fail(f"{STATE} exists: a cluster is up (or was not taken down); run `scripts/e2e down` first")
    kbin = k8s_bin()
    WORK.mkdir(parents=True, exist_ok=True)
    plan = node_plan(nodes)
    st = {"netns": [], "procs": {}, "nodes": plan}
    save_state(st)
    t0 = time.monotonic()
    make_pki(WORK / "pki", plan)
    make_underlay(st)
    start_control_plane(st, kbin)
    log(f"control plane ready after {time.monotonic() - t0:.1f} s")
    for node in plan:
        start_node(st, node, kbin, images)
    save_state(st)
    wait_for(lambda: len(registered_nodes()) == len(plan), 120, "every kubelet to register its Node")
    log(f"{len(plan)} nodes registered after {time.monotonic() - t0:.1f} s")
    return st


def registered_nodes():
    r = kubectl(["get", "nodes", "-o", "json"], check=False)
    if r.returncode != 0:
        return []
    return [n["metadata"]["name"] for n in json.loads(r.stdout)["items"]]


def down():
    """Stop everything recorded, kubelets first, then undo the namespaces and directories.
    Idempotent; runs as far as it can and reports what it could not undo."""
    st = load_state()
    problems = []
    procs = st.get("procs", {})
    # Kubelets first (nothing restarts a container then), then everything in the nodes, then
    # the control plane, etcd last.
    stop([p for k, p in procs.items() if k.endswith("/kubelet")])
    for node in st.get("nodes", []):
        problems += release_node(node)
    stop([p for k, p in procs.items() if "/" not in k and k != "etcd"])
    stop([p for k, p in procs.items() if k == "etcd"])
    for ns in reversed(st.get("netns", [])):
        if Path(ns_path(ns)).exists():
            r = run(["ip", "netns", "delete", ns], check=False)
            if r.returncode != 0:
                problems.append(f"netns {ns}: {r.stderr.strip()}")
    if not problems and WORK.exists():
        shutil.rmtree(WORK, ignore_errors=True)
    for p in problems:
        log(f"down: {p}")
    return problems


def release_node(node):
    """Whatever outlives the node's recorded processes: the containers (runc's processes are
    not children of the runtime once their shims have detached), the shims, the kubelet's
    cgroups and loop devices backed by files in the node's directory. Containers are found by
    the kubelet's cgroup root, shims by the node's mount namespace: both are this node's."""
    problems = []
    nd = Path(node["dir"])
    root = kubelet_config(node)["cgroupRoot"]

    def kill_rest():
        pids = cgroup_pids(root) | mount_ns_pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not pids

    try:
        wait_for(kill_rest, 20, f"{node['name']}'s processes to exit")
    except Fail as e:
        problems.append(str(e))
    problems += remove_cgroups(root)
    for dev in loop_devices_backed_in(nd):
        rr = run(["losetup", "-d", dev["name"]], check=False)
        if rr.returncode != 0:
            problems.append(f"loop device {dev['name']} ({dev.get('back-file')}): {rr.stderr.strip()}")
    return problems


def loop_devices_backed_in(directory):
    """Loop devices whose backing file lies under `directory`, told by the file's device and
    inode: the path the kernel shows is the attacher's, inside a node's mount namespace."""
    files = {}
    for f in Path(directory).rglob("*"):
        try:
            s = f.lstat()
        except OSError:
            continue
        if f.is_file() and not f.is_symlink():
            files[(os.major(s.st_dev), os.minor(s.st_dev), s.st_ino)] = f
    r = run(["losetup", "-J", "-l", "--output", "NAME,BACK-FILE,BACK-INO,BACK-MAJ:MIN"], check=False)
    if r.returncode != 0 or not r.stdout.strip():
        return []
    out = []
    for dev in json.loads(r.stdout).get("loopdevices", []):
        major, minor = (int(x) for x in str(dev.get("back-maj:min") or "0:0").split(":"))
        if (major, minor, int(dev.get("back-ino") or 0)) in files:
            out.append(dev)
    return out


CGROUP = Path("/sys/fs/cgroup")


def cgroup_dirs(root):
    """The kubelet's cgroup root in every hierarchy (v1 controllers and the unified one)."""
    return [h / root.lstrip("/") for h in CGROUP.iterdir() if (h / root.lstrip("/")).is_dir()]


def make_cgroups(root):
    """The kubelet's cgroup root, made in every hierarchy before it starts (it checks them).
    A v1 cpuset cgroup takes no task until it has CPUs and memory nodes: its parent's."""
    for h in CGROUP.iterdir():
        if not h.is_dir() or h.is_symlink():
            continue
        d = h / root.lstrip("/")
        d.mkdir(exist_ok=True)
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (h / f).exists():
                (d / f).write_text((h / f).read_text())


def cgroup_pids(root):
    pids = set()
    for top in cgroup_dirs(root):
        for procs in top.rglob("cgroup.procs"):
            try:
                pids |= {int(x) for x in procs.read_text().split()}
            except OSError:
                pass
    return pids


def remove_cgroups(root):
    problems = []
    for top in cgroup_dirs(root):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
            try:
                d.rmdir()
            except OSError as e:
                problems.append(f"cgroup {d}: {e}")
    return problems


def mount_ns_pids(node):
    """Processes in the node's mount namespace (its holder, containerd, kubelet, the shims)."""
    want = node.get("mntns")
    if not want:
        return set()
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if os.readlink(proc / "ns" / "mnt") == want:
                    pids.add(int(proc.name))
            except OSError:
                pass
    return pids
