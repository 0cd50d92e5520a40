"""A small container-runtime emulator: executes a CNI conflist the way libcni does.

What it reproduces from libcni (containernetworking/cni, libcni/api.go):

* ADD runs every plugin in list order. Each plugin gets the plugin's own config object with
  `cniVersion` and `name` injected from the list, `prevResult` = the previous plugin's
  result (absent for the first), and `runtimeConfig` holding every capability arg the
  plugin declared in `capabilities` (portMappings, bandwidth, ...). The final result is
  cached, like libcni's result cache.
* CHECK runs in list order with `prevResult` = the cached result.
* DEL runs in reverse order with `prevResult` = the cached result (spec >= 0.4.0), and
  drops the cache entry afterwards.
* Plugins are found by `type` in CNI_PATH; each is exec'd with the runtime's environment
  plus CNI_COMMAND, CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME, CNI_ARGS, CNI_PATH.
* A plugin failing ends the operation: ADD fails (no rollback here: like libcni, the caller
  is expected to DEL), DEL stops at the first failure.

Plugins run inside `host_netns` (via nsenter), because portmap, bandwidth, and every other
plugin act on the namespace they are exec'd in, which for a real runtime is the node's.
"""

import json
import os
import subprocess
from pathlib import Path


class PluginError(RuntimeError):
    def __init__(self, plugin, command, returncode, stdout, stderr):
        self.plugin = plugin
        self.command = command
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        try:
            self.error = json.loads(stdout) if stdout.strip() else None
        except ValueError:
            self.error = None
        super().__init__(f"{command} {plugin} exited {returncode}: stdout={stdout.strip()!r} stderr={stderr.strip()!r}")


def version_ge(a, b):
    parse = lambda s: [int(p) if p.isdigit() else 0 for p in s.split(".")]  # noqa: E731
    return parse(a) >= parse(b)


class Runtime:
    """Runs one conflist for a number of attachments (like one libcni CNIConfig)."""

    def __init__(self, conflist, cni_path, host_netns=None, env=None, timeout=60):
        if isinstance(conflist, (str, Path)):
            conflist = json.loads(Path(conflist).read_text())
        self.conflist = conflist
        self.cni_path = [str(p) for p in cni_path]
        self.host_netns = host_netns
        self.env = dict(env if env is not None else {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")})
        self.timeout = timeout
        self.cache = {}  # (container_id, ifname) -> final ADD result
        self.log = []  # (command, plugin type, stdin dict, returncode, stdout)

    @property
    def name(self):
        return self.conflist["name"]

    @property
    def version(self):
        return self.conflist["cniVersion"]

    # ----- plugin execution -----

    def find_plugin(self, ptype):
        for d in self.cni_path:
            p = Path(d) / ptype
            if p.is_file() and os.access(p, os.X_OK):
                return p
        raise FileNotFoundError(f"failed to find plugin {ptype!r} in path {self.cni_path}")

    def plugin_config(self, plugin, prev_result=None, capability_args=None):
        """libcni buildOneConfig + injectRuntimeConfig."""
        conf = dict(plugin)
        conf["cniVersion"] = self.version
        conf["name"] = self.name
        if prev_result is not None:
            conf["prevResult"] = prev_result
        caps = plugin.get("capabilities") or {}
        rt = {k: v for k, v in (capability_args or {}).items() if caps.get(k)}
        if rt:
            conf["runtimeConfig"] = rt
        return conf

    def exec_plugin(self, command, plugin, conf, container_id, netns, ifname, cni_args):
        path = self.find_plugin(plugin["type"])
        env = dict(self.env)
        env.update({
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id,
            "CNI_NETNS": netns or "",
            "CNI_IFNAME": ifname,
            "CNI_ARGS": cni_args,
            "CNI_PATH": os.pathsep.join(self.cni_path),
        })
        argv = [str(path)]
        if self.host_netns:
            argv = ["nsenter", f"--net={self.host_netns}", *argv]
        stdin = json.dumps(conf)
        res = subprocess.run(argv, input=stdin, env=env, capture_output=True, text=True, timeout=self.timeout)
        self.log.append((command, plugin["type"], conf, res.returncode, res.stdout))
        if res.returncode != 0:
            raise PluginError(plugin["type"], command, res.returncode, res.stdout, res.stderr)
        if command == "ADD":
            try:
                return json.loads(res.stdout)
            except ValueError:
                raise PluginError(plugin["type"], command, res.returncode, res.stdout,
                                  "ADD printed no valid JSON result: " + res.stderr) from None
        return None

    @staticmethod
    def k8s_args(pod_name, pod_namespace="default", extra=None):
        """CNI_ARGS the way kubelet/CRI runtimes set them."""
        parts = ["IgnoreUnknown=1", f"K8S_POD_NAMESPACE={pod_namespace}", f"K8S_POD_NAME={pod_name}"]
        parts += [f"{k}={v}" for k, v in (extra or {}).items()]
        return ";".join(parts)

    # ----- list operations -----

    def add(self, container_id, netns, ifname="eth0", pod_name="pod", pod_namespace="default",
            capability_args=None, cni_args=None):
        args = cni_args if cni_args is not None else self.k8s_args(pod_name, pod_namespace)
        prev = None
        for plugin in self.conflist["plugins"]:
            conf = self.plugin_config(plugin, prev, capability_args)
            prev = self.exec_plugin("ADD", plugin, conf, container_id, netns, ifname, args)
        self.cache[(container_id, ifname)] = {"result": prev, "capability_args": capability_args, "netns": netns}
        return prev

    def check(self, container_id, netns, ifname="eth0", pod_name="pod", pod_namespace="default", cni_args=None):
        args = cni_args if cni_args is not None else self.k8s_args(pod_name, pod_namespace)
        cached = self.cache.get((container_id, ifname))
        if cached is None:
            raise KeyError(f"no cached result for {container_id}/{ifname}")
        for plugin in self.conflist["plugins"]:
            conf = self.plugin_config(plugin, cached["result"], cached["capability_args"])
            self.exec_plugin("CHECK", plugin, conf, container_id, netns, ifname, args)

    def delete(self, container_id, netns, ifname="eth0", pod_name="pod", pod_namespace="default",
               capability_args=None, cni_args=None):
        args = cni_args if cni_args is not None else self.k8s_args(pod_name, pod_namespace)
        cached = self.cache.get((container_id, ifname))
        prev = cached["result"] if cached and version_ge(self.version, "0.4.0") else None
        if capability_args is None and cached:
            capability_args = cached["capability_args"]
        for plugin in reversed(self.conflist["plugins"]):
            conf = self.plugin_config(plugin, prev, capability_args)
            self.exec_plugin("DEL", plugin, conf, container_id, netns, ifname, args)
        self.cache.pop((container_id, ifname), None)

    def common_version(self):
        """The highest spec version, not above the list's, that every plugin in the list
        supports according to its VERSION answer (what a list's cniVersion must be)."""
        key = lambda v: [int(p) if p.isdigit() else 0 for p in v.split(".")]  # noqa: E731
        common = None
        for p in self.conflist["plugins"]:
            sup = set(self.version_of(p["type"])["supportedVersions"])
            common = sup if common is None else common & sup
        ok = [v for v in common or () if key(v) <= key(self.version)]
        if not ok:
            raise RuntimeError(f"the plugins of {self.name} share no spec version <= {self.version}")
        return max(ok, key=key)

    def version_of(self, ptype):
        """The VERSION answer of one plugin in the list (what runtimes use to check support)."""
        plugin = next(p for p in self.conflist["plugins"] if p["type"] == ptype)
        path = self.find_plugin(plugin["type"])
        env = dict(self.env, CNI_COMMAND="VERSION", CNI_PATH=os.pathsep.join(self.cni_path))
        res = subprocess.run([str(path)], input=json.dumps({"cniVersion": self.version}), env=env,
                             capture_output=True, text=True, timeout=self.timeout)
        return json.loads(res.stdout)
