"""A real runtime: Debian's podman 4.3 (CNI backend, runc) runs busybox containers on the
`nodeplane` network of a simulated node.

Podman runs inside the node's network namespace (`nsenter --net`, not `ip netns exec`,
which remounts /sys and hides /sys/fs/cgroup from podman/runc), with private storage,
runroot, tmpdir, containers.conf and storage.conf under the node's temp root, and a
per-test cgroup parent. Podman execs our shim (VERSION, ADD, DEL) from the node namespace.

Needs the Debian packages podman, runc, busybox-static and iptables.
"""

import ipaddress
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import harness

BUSYBOX = "/bin/busybox"
LIBCNI_CACHE = Path("/var/lib/cni")
RUNC_DEFAULT_ROOT = Path("/run/runc")  # conmon's exit command (podman container cleanup) ignores --runtime-flag



@pytest.fixture(autouse=True)
def _required_tools():
    """Fail loudly (never skip) when a package this module needs is missing."""
    need = {"podman": "podman", "runc": "runc", "conmon": "conmon (podman)", BUSYBOX: "busybox-static",
          "iptables": "iptables"}
    missing = sorted({pkg for tool, pkg in need.items() if shutil.which(tool) is None})
    if missing:
        pytest.fail("missing Debian packages for this test: " + ", ".join(missing) + " (apt-get install -y ...)")


class Podman:
    """podman with all state private to one node; cleanup() removes every trace."""

    def __init__(self, node, conf_dir):
        self.node = node
        self.conf_dir = Path(conf_dir)
        self.base = node.root / "podman"
        self.rootfs = node.root / "rootfs"
        self.cgroup_parent = f"/{node.ns.name}-podman"
        self.cids = set()
        self.had_libcni_cache = LIBCNI_CACHE.exists()
        self.had_runc_root = RUNC_DEFAULT_ROOT.exists()
        for d in ("root", "runroot", "tmp", "runc"):
            (self.base / d).mkdir(parents=True, exist_ok=True)
        conf = self.base / "containers.conf"
        conf.write_text(
            "[containers]\n"
            'default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n'
            "[engine]\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n'
            f'tmp_dir = "{self.base / "tmp"}"\n'
            "[network]\n"
            'network_backend = "cni"\n'
            f'cni_plugin_dirs = ["{node.bin_dir}", "{harness.REF_CNI_DIR}"]\n'
            f'network_config_dir = "{self.conf_dir}"\n'
        )
        storage = self.base / "storage.conf"
        storage.write_text(
            "[storage]\n"
            'driver = "vfs"\n'
            f'graphroot = "{self.base / "root"}"\n'
            f'runroot = "{self.base / "runroot"}"\n'
        )
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(self.base),
            "CONTAINERS_CONF": str(conf),
            "CONTAINERS_STORAGE_CONF": str(storage),
        }
        self.argv = [
            "nsenter", f"--net={node.ns.path}", "podman",
            "--root", str(self.base / "root"), "--runroot", str(self.base / "runroot"),
            "--tmpdir", str(self.base / "tmp"), "--storage-driver", "vfs",
            "--runtime", "runc", "--runtime-flag", f"root={self.base / 'runc'}",
            "--cgroup-manager", "cgroupfs", "--events-backend", "file",
            "--network-config-dir", str(self.conf_dir),
        ]
        self.make_rootfs()

    def make_rootfs(self):
        """bin/busybox plus a relative symlink per applet."""
        bindir = self.rootfs / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(BUSYBOX, bindir / "busybox")
        applets = harness.run([BUSYBOX, "--list"]).stdout.split()
        for a in applets:
            if a != "busybox" and not (bindir / a).exists():
                os.symlink("busybox", bindir / a)
        for d in ("etc", "tmp", "proc", "sys", "dev"):
            (self.rootfs / d).mkdir(exist_ok=True)

    def __call__(self, *args, check=True, timeout=60):
        res = subprocess.run([*self.argv, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)} failed ({res.returncode}): {res.stderr.strip()} {res.stdout.strip()}")
        return res

    def run_detached(self, name, *command):
        """podman run -d on the nodeplane network; every option precedes --rootfs <dir>."""
        res = self("run", "-d", "--name", name, "--network", "nodeplane", "--cgroup-parent", self.cgroup_parent,
                   "--rootfs", str(self.rootfs), *command, check=False)
        cid = res.stdout.strip().splitlines()[-1] if res.returncode == 0 and res.stdout.strip() else None
        if cid:
            self.cids.add(cid)
        return res, cid

    def exec(self, name, *command, check=False):
        return self("exec", name, *command, check=check, timeout=30)

    # ----- teardown -----

    def remove_cgroups(self):
        """rmdir our cgroup parent and everything below it; returns the dirs that remain."""
        left = []
        for hier in Path("/sys/fs/cgroup").iterdir():
            top = hier / self.cgroup_parent.lstrip("/")
            if not top.is_dir():
                continue
            dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            for d in [*dirs, top]:
                try:
                    d.rmdir()
                except OSError:
                    left.append(d)
        return left

    def cleanup(self):
        leftovers = []  # (pid, expected name in cmdline)
        sandboxes = set()
        ps = self("ps", "-aq", "--no-trunc", check=False, timeout=30)
        for cid in set(ps.stdout.split()) | self.cids:
            self.cids.add(cid)
            out = self("inspect", "-f", "{{.State.Pid}} {{.State.ConmonPid}} {{.NetworkSettings.SandboxKey}}", cid,
                       check=False, timeout=30).stdout.split()
            if len(out) >= 2:
                leftovers += [(int(out[0]), "sleep"), (int(out[1]), "conmon")]
            if len(out) == 3 and out[2].startswith("/run/netns/"):
                sandboxes.add(out[2])
        self("rm", "-af", "-t", "0", check=False, timeout=60)
        # Processes podman started for us and failed to stop: by PID, after checking what they are.
        for pid, what in leftovers:
            try:
                if pid > 1 and what in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, 9)
            except (OSError, ValueError):
                pass
        for sb in sandboxes:
            if os.path.exists(sb):
                subprocess.run(["umount", "-l", sb], capture_output=True)
                try:
                    os.unlink(sb)
                except OSError:
                    pass
        # Anything still mounted under the private root (shm, overlay, bind mounts), deepest first.
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].encode().decode("unicode_escape")
                if mp.startswith(str(self.base) + "/") or mp.startswith(str(self.rootfs) + "/") or mp == str(self.rootfs):
                    mounts.append(mp)
        for mp in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        # Empty cgroups under our private parent, bottom-up, in every hierarchy. conmon may
        # take a moment to exit after `rm`, so retry for a few seconds.
        deadline = time.time() + 5
        while True:
            left = self.remove_cgroups()
            if not left or time.time() > deadline:
                break
            time.sleep(0.1)
        # libcni's result cache entries for our containers (a fixed host path in podman 4.3).
        results = LIBCNI_CACHE / "results"
        for cid in self.cids:
            for p in results.glob(f"*-{cid}-*") if results.is_dir() else []:
                p.unlink(missing_ok=True)
        if not self.had_libcni_cache:
            for d in (results, LIBCNI_CACHE):
                try:
                    d.rmdir()
                except OSError:
                    pass
        if not self.had_runc_root:
            try:
                RUNC_DEFAULT_ROOT.rmdir()
            except OSError:
                pass
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.rootfs, ignore_errors=True)


def container_addrs(pm, name):
    """(IPv4 address, global IPv6 address) of eth0 in the container, from busybox `ip`."""
    out = pm.exec(name, "ip", "addr", "show", "dev", "eth0", check=True).stdout
    v4 = re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", out)
    v6 = re.findall(r"inet6 ([0-9a-f:]+/\d+) scope global", out)
    return v4, v6, out


def lease_of(node, cid):
    return [v for v in node.leases().values() if v["containerId"] == cid]


def pinned_conf_dir(node, version):
    """A copy of the installed conflist with another cniVersion, in its own directory."""
    d = node.root / f"net.d-{version}"
    d.mkdir()
    conf = json.loads(node.conflist_path.read_text())
    conf["cniVersion"] = version
    (d / node.conflist_path.name).write_text(json.dumps(conf, indent=2))
    return d


@pytest.mark.parametrize("conflist", ["as-installed", "cniVersion-1.0.0"])
def test_podman_containers_on_nodeplane_network(make_node, conflist):
    """as-installed: the node's own conf dir, exactly what the agent wrote.
    cniVersion-1.0.0: the same conflist with cniVersion lowered to 1.0.0, the newest version
    podman 4.3's libcni understands, so the datapath is exercised regardless."""
    node = make_node(tag="pdm")
    conf_dir = node.conflist_path.parent if conflist == "as-installed" else pinned_conf_dir(node, "1.0.0")
    pm = Podman(node, conf_dir)
    try:
        nets = pm("network", "ls", "--format", "{{.Name}}").stdout.split()
        assert "nodeplane" in nets, nets
        started = {}
        for name in ("c1", "c2"):
            res, cid = pm.run_detached(name, "sleep", "300")
            if res.returncode != 0:
                pytest.fail(
                    f"podman run {name} --network nodeplane failed ({res.returncode}) with the "
                    f"{conflist} conflist (cniVersion {json.loads((conf_dir / node.conflist_path.name).read_text())['cniVersion']}):\n"
                    f"{res.stderr.strip()}\n"
                    f"after the failure: leases={list(node.leases())} host veths={sorted(node.host_veths())}")
            started[name] = cid

        block4, block6 = ipaddress.ip_network(node.v4), ipaddress.ip_network(node.v6)
        gw4, gw6 = str(block4.network_address + 1), str(block6.network_address + 1)
        addrs = {}
        for name, cid in started.items():
            v4, v6, raw = container_addrs(pm, name)
            assert len(v4) == 1 and ipaddress.ip_interface(v4[0]).ip in block4, raw
            assert len(v6) == 1 and ipaddress.ip_interface(v6[0]).ip in block6, raw
            leases = lease_of(node, cid)
            assert len(leases) == 1, node.leases()
            assert sorted(leases[0]["ips"]) == sorted([v4[0], v6[0]]), (leases, raw)
            assert leases[0]["state"] == "ready"
            assert leases[0]["hostIf"] in node.host_veths()
            addrs[name] = (str(ipaddress.ip_interface(v4[0]).ip), str(ipaddress.ip_interface(v6[0]).ip))
        assert addrs["c1"] != addrs["c2"]
        routes = pm.exec("c1", "ip", "route", "show", check=True).stdout
        assert f"default via {gw4}" in routes, routes

        for target in (gw4, addrs["c2"][0], gw6, addrs["c2"][1]):
            ping = pm.exec("c1", "ping", "-c", "1", "-W", "3", target)
            assert ping.returncode == 0, f"c1 -> {target}: {ping.stdout} {ping.stderr}"

        rm = pm("rm", "-f", "-t", "0", "c1", "c2", check=False)
        assert rm.returncode == 0, rm.stderr
        for cid in started.values():
            assert not lease_of(node, cid), node.leases()
        assert node.leases() == {}
        assert node.wait_no_graveyard()
        assert node.host_veths() == {}, sorted(node.host_veths())
        # The agent handled the DELs itself (none queued as pending).
        assert not node.pending_dir.exists() or not list(node.pending_dir.iterdir())
    finally:
        pm.cleanup()
