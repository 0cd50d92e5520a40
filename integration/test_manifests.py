"""The Kubernetes manifests in daemonset/: rendered with kustomize, validated offline against
the Kubernetes 1.33 API schemas (strict: unknown fields are errors), and checked for what a
schema cannot see: the shipped agent and controller configurations are loaded by the real
binaries (`check-config`), every path the agent uses is mounted from the host with the right
propagation, probes hit the address and paths the health servers serve, the controller's RBAC
equals the API calls its code makes (`nodeplane-controller api-calls`), selectors match
their pods, images are pinned to the Cargo version, and the CRD schemas accept the objects
the controller writes and reject malformed ones. The snapshot objects (daemonset/snapshots and
the examples), whose CRDs are the upstream external-snapshotter's and not in the Kubernetes
schemas, are validated against a strict schema of the snapshot.storage.k8s.io/v1 fields.

No API server is needed. Missing tools (kubectl, kubernetes-validate, the release binaries)
make these tests fail, never skip.
"""

import copy
import functools
import json
import math
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

import cluster
import harness

REPO = harness.REPO
DAEMONSET = REPO / "daemonset"
BASE = DAEMONSET / "base"
OVERLAY = DAEMONSET / "overlays" / "example"
REGISTRAR_OVERLAY = DAEMONSET / "overlays" / "node-driver-registrar"
SNAPSHOTS = DAEMONSET / "snapshots"
EXAMPLES = DAEMONSET / "examples"
AGENT_BIN = harness.AGENT_BIN
CONTROLLER_BIN = cluster.CONTROLLER_BIN

# The Kubernetes version the manifests are validated against (named in daemonset/README.md).
K8S_VERSION = "1.33.0"
NAMESPACE = "nodeplane-system"
# The VolumeSnapshot API: its CRDs come from the upstream external-snapshotter install.
SNAPSHOT_GROUP = "snapshot.storage.k8s.io"
DRIVER_NAME_RE = re.compile(r'pub const DRIVER_NAME: &str = "([^"]+)";')
SUN_PATH_MAX = 107  # bytes of a Unix socket path, without the NUL
# The environment the DaemonSet gives the agent, with sample values.
AGENT_ENV = {"NODE_NAME": "n1", "NODE_IPS": "192.0.2.1", "NODEPLANE_CONTROLLER_ADDRESS": "10.0.0.1:9650"}
CONTROLLER_ENV = {"POD_NAME": "nodeplane-controller-0", "POD_NAMESPACE": NAMESPACE}


# ----------------------------------------------------------------- helpers

def need_tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (scripts/install-deps installs it); the manifest tests cannot run")
    return path


def need_binary(path):
    if not path.exists():
        pytest.fail(f"{path} is missing: run `cargo build --release` first")
    return path


def cargo_version():
    return tomllib.loads((REPO / "Cargo.toml").read_text())["package"]["version"]


def driver_name():
    m = DRIVER_NAME_RE.search((REPO / "src/storage/csi/mod.rs").read_text())
    assert m, "src/storage/csi/mod.rs no longer defines DRIVER_NAME"
    return m.group(1)


def render(path):
    kubectl = need_tool("kubectl")
    res = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, f"kubectl kustomize {path} failed: {res.stderr}"
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    assert docs, f"kubectl kustomize {path} rendered nothing"
    return res.stdout, docs


def load_yaml_docs(path):
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def key(doc):
    return doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"]


def find(docs, kind, name, namespace=None):
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name
            and (namespace is None or d["metadata"].get("namespace") == namespace)]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def pod_spec(doc):
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def containers(doc):
    spec = pod_spec(doc)
    return spec.get("initContainers", []) + spec["containers"]


def container(doc, name):
    hits = [c for c in containers(doc) if c["name"] == name]
    assert len(hits) == 1, f"{doc['metadata']['name']}: expected one container {name}"
    return hits[0]


def api_group(doc):
    return doc["apiVersion"].rpartition("/")[0]


def is_snapshot_api(doc):
    return api_group(doc) == SNAPSHOT_GROUP


QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                  "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_quantity(q):
    """Bytes of a Kubernetes quantity such as 1Gi, 500M or 1073741824."""
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(q))
    assert m and m.group(2) in QUANTITY_UNITS, f"not a quantity this test understands: {q!r}"
    return int(m.group(1)) * QUANTITY_UNITS[m.group(2)]


def workloads(docs):
    return [d for d in docs if d["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Pod", "Job")]


def camel_to_snake(s):
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), s)


def get(d, dotted):
    """A value from a resolved configuration printed by `check-config`, by its camelCase path
    (snake_case keys are accepted as well)."""
    cur = d
    for part in dotted.split("."):
        assert isinstance(cur, dict), f"{dotted}: {part} is not inside an object"
        for k in (part, camel_to_snake(part)):
            if k in cur:
                cur = cur[k]
                break
        else:
            raise AssertionError(f"check-config output has no {dotted} (keys here: {sorted(cur)})")
    return cur


def split_host_port(addr):
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def parse_duration(s):
    total, rest = 0.0, s
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", s):
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
        rest = rest.replace(num + unit, "", 1)
    assert total > 0 and not rest, f"not a duration: {s!r}"
    return total


def arg_value(args, flag):
    vals = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(vals) == 1, f"expected one {flag}=… in {args}"
    return vals[0]


def resolve_port(c, port):
    if isinstance(port, int):
        return port
    hits = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert hits, f"container {c['name']} has no port named {port}"
    return hits[0]


def under(path, mount_path):
    path, mount_path = os.path.normpath(path), os.path.normpath(mount_path)
    return path == mount_path or path.startswith(mount_path.rstrip("/") + "/")


def covering_mount(doc, cont, path):
    """The volumeMount of `cont` that holds `path` (the deepest one), and its volume."""
    mounts = [m for m in cont.get("volumeMounts", []) if under(path, m["mountPath"])]
    assert mounts, f"{path} is not under any volumeMount of container {cont['name']}"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    vols = {v["name"]: v for v in pod_spec(doc).get("volumes", [])}
    return m, vols[m["name"]]


def run_check_config(binary, cfg_text, env_extra):
    need_binary(binary)
    with tempfile.TemporaryDirectory(prefix="np-manifests-") as d:
        p = Path(d) / "config.json"
        p.write_text(cfg_text)
        env = dict(os.environ, **env_extra)
        env.pop("NODEPLANE_LOG", None)
        res = subprocess.run([str(binary), "check-config", "--config", str(p)],
                             capture_output=True, text=True, env=env, timeout=60)
    return res


def check_config_json(binary, cfg_text, env_extra):
    res = run_check_config(binary, cfg_text, env_extra)
    assert res.returncode == 0, (
        f"`{binary.name} check-config` rejected the shipped configuration (exit {res.returncode}):\n"
        f"{res.stderr}\n{res.stdout}\n--- config ---\n{cfg_text}")
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(f"`{binary.name} check-config` did not print JSON ({e}):\n{res.stdout}")


def expand_rules(rules, namespaced):
    out = set()
    for r in rules:
        assert "nonResourceURLs" not in r, f"unexpected nonResourceURLs rule {r}"
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    out.add((g, res, v, namespaced))
    return out


# ----------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def base():
    return render(DAEMONSET)[1]


@pytest.fixture(scope="module")
def overlay():
    return render(OVERLAY)[1]


@pytest.fixture(scope="module")
def snapshots():
    return render(SNAPSHOTS)[1]


@pytest.fixture(scope="module")
def examples():
    docs = []
    for f in sorted(EXAMPLES.glob("*.yaml")):
        docs.extend(load_yaml_docs(f))
    assert docs, "daemonset/examples holds no manifests"
    return docs


def agent_json(docs):
    return find(docs, "ConfigMap", "nodeplane-agent-config", NAMESPACE)["data"]["agent.json"]


def controller_json(docs):
    return find(docs, "ConfigMap", "nodeplane-controller-config", NAMESPACE)["data"]["controller.json"]


@pytest.fixture(scope="module")
def agent_cfg(base):
    return json.loads(agent_json(base))


@pytest.fixture(scope="module")
def controller_cfg(base):
    return json.loads(controller_json(base))


@pytest.fixture(scope="module")
def agent_resolved(base):
    return check_config_json(AGENT_BIN, agent_json(base), AGENT_ENV)


@pytest.fixture(scope="module")
def ds(base):
    return find(base, "DaemonSet", "nodeplane-agent", NAMESPACE)


@pytest.fixture(scope="module")
def deploy(base):
    return find(base, "Deployment", "nodeplane-controller", NAMESPACE)


# ----------------------------------------------------------------- rendering and schemas

def test_render_top_level_is_the_base():
    top_text, top = render(DAEMONSET)
    base_text, base_docs = render(BASE)
    assert top_text == base_text, "daemonset/kustomization.yaml must render exactly daemonset/base"
    names = {key(d) for d in top}
    assert len(names) == len(top), "duplicate objects in the render"
    expected = {
        ("Namespace", None, NAMESPACE),
        ("ResourceQuota", NAMESPACE, "nodeplane-critical-pods"),
        ("CustomResourceDefinition", None, "nodeplanenodes.nodeplane.dev"),
        ("CustomResourceDefinition", None, "ipblocks.nodeplane.dev"),
        ("CustomResourceDefinition", None, "nodeplanevolumes.nodeplane.dev"),
        ("ServiceAccount", NAMESPACE, "nodeplane-agent"),
        ("ServiceAccount", NAMESPACE, "nodeplane-controller"),
        ("ClusterRole", None, "nodeplane-controller"),
        ("ClusterRoleBinding", None, "nodeplane-controller"),
        ("Role", NAMESPACE, "nodeplane-controller"),
        ("RoleBinding", NAMESPACE, "nodeplane-controller"),
        ("ClusterRole", None, "nodeplane-csi-provisioner"),
        ("ClusterRoleBinding", None, "nodeplane-csi-provisioner"),
        ("Role", NAMESPACE, "nodeplane-csi-provisioner"),
        ("RoleBinding", NAMESPACE, "nodeplane-csi-provisioner"),
        ("ClusterRole", None, "nodeplane-csi-resizer"),
        ("ClusterRoleBinding", None, "nodeplane-csi-resizer"),
        ("Role", NAMESPACE, "nodeplane-csi-resizer"),
        ("RoleBinding", NAMESPACE, "nodeplane-csi-resizer"),
        ("ClusterRole", None, "nodeplane-csi-snapshotter"),
        ("ClusterRoleBinding", None, "nodeplane-csi-snapshotter"),
        ("Role", NAMESPACE, "nodeplane-csi-snapshotter"),
        ("RoleBinding", NAMESPACE, "nodeplane-csi-snapshotter"),
        ("ConfigMap", NAMESPACE, "nodeplane-agent-config"),
        ("ConfigMap", NAMESPACE, "nodeplane-controller-config"),
        ("Service", NAMESPACE, "nodeplane-controller"),
        ("Deployment", NAMESPACE, "nodeplane-controller"),
        ("DaemonSet", NAMESPACE, "nodeplane-agent"),
        ("CSIDriver", None, "csi.nodeplane.dev"),
        ("StorageClass", None, "nodeplane-local"),
        ("StorageClass", None, "nodeplane-lvm"),
        ("StorageClass", None, "nodeplane-encrypted"),
    }
    assert names == expected, f"missing: {expected - names}; unexpected: {names - expected}"


def test_examples_are_not_in_the_base(base, examples):
    rendered = {key(d) for d in base}
    for d in examples:
        assert key(d) not in rendered, f"example {key(d)} is part of the base"


def _validate_docs(docs, what):
    import kubernetes_validate
    for d in docs:
        if is_snapshot_api(d):
            _validate_snapshot_api(d, what)
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{what}: no Kubernetes {K8S_VERSION} schema for {key(d)}: {e.message}")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{what}: {key(d)} is invalid for Kubernetes {K8S_VERSION}: {path}: {e.message}")


NO_SCHEMA_RE = re.compile(r"^WARN .* Couldn't find schema for kind (\S+) with api version (\S+) ")


def _validate_cli(files, docs):
    """The kubernetes-validate command on `files` (holding `docs`): every document passes, but
    those of the snapshot API, which it has no schema for (validated by _validate_docs)."""
    cli = need_tool("kubernetes-validate")
    res = subprocess.run([cli, "--strict", "--kubernetes-version", K8S_VERSION, *map(str, files)],
                         capture_output=True, text=True)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"kubernetes-validate failed:\n{out}"
    lines = out.splitlines()
    unknown = [NO_SCHEMA_RE.match(l) for l in lines]
    unknown = sorted((m.group(2), m.group(1)) for m in unknown if m)
    expected_unknown = sorted((d["apiVersion"], d["kind"]) for d in docs if is_snapshot_api(d))
    assert unknown == expected_unknown, f"kinds without a schema: {unknown}, expected {expected_unknown}:\n{out}"
    bad = [l for l in lines if l.split(" ", 1)[0] in ("WARN", "ERROR", "FATAL") and not NO_SCHEMA_RE.match(l)]
    assert not bad, "kubernetes-validate:\n" + "\n".join(bad)
    passed = [l for l in lines if l.startswith("INFO") and " passed " in l]
    ndocs = len(docs) - len(expected_unknown)
    assert len(passed) == ndocs, f"{len(passed)} of {ndocs} documents passed:\n{out}"


@pytest.mark.parametrize("path", [DAEMONSET, OVERLAY, REGISTRAR_OVERLAY, SNAPSHOTS],
                         ids=["base", "overlay", "registrar-overlay", "snapshots"])
def test_kubernetes_validate_strict(path, tmp_path):
    need_tool("kubernetes-validate")
    text, docs = render(path)
    _validate_docs(docs, str(path.relative_to(REPO)))
    f = tmp_path / "rendered.yaml"
    f.write_text(text)
    _validate_cli([f], docs)


def test_kubernetes_validate_strict_examples(examples):
    need_tool("kubernetes-validate")
    _validate_docs(examples, "daemonset/examples")
    _validate_cli(sorted(EXAMPLES.glob("*.yaml")), examples)


def test_base_applies_without_snapshot_crds(base, overlay):
    """`kubectl apply -k daemonset/` must work on a cluster without the VolumeSnapshot CRDs:
    no object of the snapshot API in the base or the overlay (they live in daemonset/snapshots)."""
    for d in base + overlay:
        assert not is_snapshot_api(d), f"{key(d)} needs the VolumeSnapshot CRDs: it belongs in daemonset/snapshots"


def test_validator_is_strict():
    """The validator itself rejects an unknown field (strict mode is really on)."""
    import kubernetes_validate
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "dataa": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


# ----------------------------------------------------------------- canonical quantities
#
# `kubectl apply` reports "configured" when what it sends differs from what the server
# stored, and the server stores every resource.Quantity in its canonical form
# (k8s.io/apimachinery/pkg/api/resource, Quantity.CanonicalizeBytes): `10000` comes back as
# `10k`, `1000m` as `1`, `1024Mi` as `1Gi`. So every quantity in the manifests is written as
# the server would store it, as a string, and a second `kubectl apply -k daemonset/` changes
# nothing. Which fields are quantities comes from the Kubernetes schemas themselves.

QUANTITY_RE = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|[numkMGTPE]?)$")
DECIMAL_SI_SUFFIX = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
BINARY_SI_SUFFIX = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
QUANTITY_DEF = "io.k8s.apimachinery.pkg.api.resource.Quantity"


def canonical_quantity(q):
    """The form the API server stores quantity `q` in. The suffix decides the format
    (binary: Ki..Ei; decimal exponent: e<n>; decimal SI: n u m "" k M G T P E); values are
    rounded up (away from zero) to nano units; then, with no precision lost and no fractional
    digits, the exponent is as large as possible: a multiple of 3 for the decimal formats,
    of 1024 for the binary one. A binary value below 1024 in magnitude, or not a whole
    number, is written as decimal SI."""
    from fractions import Fraction
    m = QUANTITY_RE.match(q)
    assert m, f"{q!r} is not a Kubernetes quantity"
    sign, number, suffix = m.groups()
    value = Fraction(number)
    if suffix in BINARY_SI_SUFFIX[1:]:
        fmt, value = "BinarySI", value * 1024 ** BINARY_SI_SUFFIX.index(suffix)
    elif re.fullmatch(r"[eE][+-]?[0-9]+", suffix):
        fmt, value = "DecimalExponent", value * Fraction(10) ** int(suffix[1:])
    else:
        exp = {v: k for k, v in DECIMAL_SI_SUFFIX.items()}[suffix]
        fmt, value = "DecimalSI", value * Fraction(10) ** exp
    if value == 0:
        return "0"
    nanos = -((-value * 10**9).__floor__())  # rounded up to a whole number of nano units
    sign = "-" if sign == "-" else ""
    if fmt == "BinarySI":
        if nanos < 1024 * 10**9 or nanos % 10**9:
            fmt = "DecimalSI"
        else:
            mantissa, exp = nanos // 10**9, 0
            while mantissa % 1024 == 0 and exp < len(BINARY_SI_SUFFIX) - 1:
                mantissa, exp = mantissa // 1024, exp + 1
            return f"{sign}{mantissa}{BINARY_SI_SUFFIX[exp]}"
    mantissa, exp = nanos, -9
    while mantissa % 1000 == 0:
        mantissa, exp = mantissa // 1000, exp + 3
    if fmt == "DecimalSI" and exp in DECIMAL_SI_SUFFIX:
        return f"{sign}{mantissa}{DECIMAL_SI_SUFFIX[exp]}"
    return f"{sign}{mantissa}" + (f"e{exp}" if exp else "")


@functools.lru_cache(maxsize=1)
def _k8s_definitions():
    import kubernetes_validate
    path = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
            / f"v{K8S_VERSION}-local-strict" / "_definitions.json")
    return json.loads(path.read_text())["$defs"]


def _definition_of(doc):
    group, _, version = doc["apiVersion"].rpartition("/")
    for d in _k8s_definitions().values():
        for gvk in d.get("x-kubernetes-group-version-kind", []):
            if (gvk["group"], gvk["version"], gvk["kind"]) == (group, version, doc["kind"]):
                return d
    return None


def quantities(doc):
    """(path, value) of every field of `doc` whose schema is a resource.Quantity (none for
    kinds without a Kubernetes schema: custom resources are stored as written)."""
    defs = _k8s_definitions()
    out = []

    def walk(value, schema, path):
        while "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[1]
            if name == QUANTITY_DEF:
                out.append((path, value))
                return
            schema = defs[name]
        if isinstance(value, dict):
            props = schema.get("properties", {})
            extra = schema.get("additionalProperties")
            for k, v in value.items():
                if k in props:
                    walk(v, props[k], f"{path}.{k}")
                elif isinstance(extra, dict):
                    walk(v, extra, f"{path}.{k}")
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                walk(v, schema["items"], f"{path}[{i}]")

    schema = _definition_of(doc)
    if schema is not None:
        walk(doc, schema, "")
    return out


def non_canonical_quantities(docs):
    bad = []
    for d in docs:
        for path, q in quantities(d):
            if not isinstance(q, str):
                bad.append(f"{key(d)}{path}: {q!r} is not a string (the server stores {canonical_quantity(str(q))!r})")
            elif canonical_quantity(q) != q:
                bad.append(f"{key(d)}{path}: {q!r} is stored as {canonical_quantity(q)!r}")
    return bad


@pytest.mark.parametrize("q,stored", [
    ("10000", "10k"), ("10k", "10k"), ("1000m", "1"), ("1500m", "1500m"), ("1.5", "1500m"), ("0.5", "500m"),
    ("100m", "100m"), ("50m", "50m"), ("1", "1"), ("0", "0"), ("0.0", "0"), ("1000", "1k"), ("1000k", "1M"),
    ("1024Mi", "1Gi"), ("1536Mi", "1536Mi"), ("1.5Gi", "1536Mi"), ("64Mi", "64Mi"), ("1024Ki", "1Mi"),
    ("0.5Ki", "512"), ("1023", "1023"), ("1Ki", "1Ki"), ("1025", "1025"), ("2048", "2048"), ("1e3", "1e3"),
    ("1000e3", "1e6"), ("12e6", "12e6"), ("1E", "1E"), ("-1000m", "-1"), ("0.1m", "100u"), ("1n", "1n"),
    ("1000000u", "1"), ("+5", "5"), ("05", "5"),
])
def test_canonical_quantity_rule(q, stored):
    assert canonical_quantity(q) == stored


@pytest.mark.parametrize("which", ["base", "overlay", "snapshots", "examples"])
def test_quantities_are_canonical(which, request):
    """A second `kubectl apply` changes nothing: every quantity is the string the server stores."""
    docs = request.getfixturevalue(which)
    if which in ("base", "examples"):
        found = [q for d in docs for q in quantities(d)]
        assert len(found) >= 10, f"{which}: only {found} found (is the schema walk broken?)"
    assert not non_canonical_quantities(docs), "\n".join(non_canonical_quantities(docs))


def test_registrar_overlay_quantities_are_canonical():
    assert not non_canonical_quantities(render(REGISTRAR_OVERLAY)[1])


def test_quantity_check_finds_the_old_quota(base):
    """The check fails on what shipped before: the ResourceQuota's pods "10000" (stored as 10k)."""
    docs = copy.deepcopy(base)
    quota = find(docs, "ResourceQuota", "nodeplane-critical-pods", NAMESPACE)
    assert ("ResourceQuota", NAMESPACE, "nodeplane-critical-pods") == key(quota)
    assert (".spec.hard.pods", quota["spec"]["hard"]["pods"]) in quantities(quota)
    quota["spec"]["hard"]["pods"] = "10000"
    bad = non_canonical_quantities(docs)
    assert bad == [f"{key(quota)}.spec.hard.pods: '10000' is stored as '10k'"], bad
    # Every request and limit is seen too.
    ds_doc = find(docs, "DaemonSet", "nodeplane-agent", NAMESPACE)
    c = pod_spec(ds_doc)["containers"][0]
    c["resources"]["limits"]["memory"] = "1024Mi"
    c["resources"]["requests"]["cpu"] = 1
    bad = non_canonical_quantities(docs)
    assert len(bad) == 3 and any("1024Mi" in b and "'1Gi'" in b for b in bad) and any("not a string" in b for b in bad), bad


# ----------------------------------------------------------------- the snapshot API
#
# snapshot.storage.k8s.io/v1 as the upstream CRDs define the fields we write (the API types of
# kubernetes-csi/external-snapshotter client/apis/volumesnapshot/v1), strict like the
# Kubernetes schemas: unknown fields are errors; metadata is checked by kubernetes-validate's
# own ObjectMeta definition. Status is the snapshot-controller's and never in a manifest.

def _snapshot_api_schemas():
    meta = {"$ref": "/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    name = {"type": "string", "minLength": 1}

    def top(kind, required, props):
        return {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://kubernetes.io/api/{kind.lower()}/snapshot/v1",
            "type": "object",
            "additionalProperties": False,
            "required": ["apiVersion", "kind", "metadata", *required],
            "properties": {"apiVersion": {"const": f"{SNAPSHOT_GROUP}/v1"}, "kind": {"const": kind},
                           "metadata": meta, **props},
        }
    return {
        "VolumeSnapshotClass": top("VolumeSnapshotClass", ["driver", "deletionPolicy"], {
            "driver": name,
            "deletionPolicy": {"enum": ["Delete", "Retain"]},
            "parameters": {"type": "object", "additionalProperties": {"type": "string"}},
        }),
        "VolumeSnapshot": top("VolumeSnapshot", ["spec"], {
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["source"],
                "properties": {
                    # Exactly one of the two (the upstream CRD's oneOf).
                    "source": {"type": "object", "additionalProperties": False,
                               "minProperties": 1, "maxProperties": 1,
                               "properties": {"persistentVolumeClaimName": name,
                                              "volumeSnapshotContentName": name}},
                    "volumeSnapshotClassName": name,
                },
            },
        }),
    }


@functools.cache
def _snapshot_api_validators():
    """One validator per snapshot kind, resolving ObjectMeta in kubernetes-validate's strict
    definitions for K8S_VERSION."""
    import importlib.resources
    import referencing
    defs_file = (importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
                 / f"v{K8S_VERSION}-local-strict" / "_definitions.json")
    assert defs_file.is_file(), f"kubernetes-validate has no {K8S_VERSION} definitions at {defs_file}"
    defs = referencing.Resource.from_contents(json.loads(defs_file.read_text()))
    registry = referencing.Registry().with_resource(defs.id(), defs)
    return {kind: jsonschema.Draft202012Validator(schema, registry=registry)
            for kind, schema in _snapshot_api_schemas().items()}


def _validate_snapshot_api(doc, what=""):
    validators = _snapshot_api_validators()
    assert doc["apiVersion"] == f"{SNAPSHOT_GROUP}/v1" and doc["kind"] in validators, \
        f"{what}: {key(doc)}: not a snapshot.storage.k8s.io/v1 kind this test knows"
    errors = sorted(validators[doc["kind"]].iter_errors(doc), key=str)
    assert not errors, f"{what}: {key(doc)} is invalid for {SNAPSHOT_GROUP}/v1: " + "; ".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


GOOD_SNAPSHOT_OBJECTS = [
    {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass", "metadata": {"name": "c"},
     "driver": "d.example", "deletionPolicy": "Retain", "parameters": {"a": "b"}},
    {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s", "namespace": "n"},
     "spec": {"source": {"volumeSnapshotContentName": "content-1"}}},
]
BAD_SNAPSHOT_OBJECTS = [
    ("class without driver", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
                              "metadata": {"name": "c"}, "deletionPolicy": "Delete"}),
    ("unknown deletion policy", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
                                 "metadata": {"name": "c"}, "driver": "d", "deletionPolicy": "Recycle"}),
    ("unknown class field", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
                             "metadata": {"name": "c"}, "driver": "d", "deletionPolicy": "Delete", "provisioner": "d"}),
    ("non-string parameter", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
                              "metadata": {"name": "c"}, "driver": "d", "deletionPolicy": "Delete", "parameters": {"a": 1}}),
    ("unknown metadata field", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
                                "metadata": {"name": "c", "label": {}}, "driver": "d", "deletionPolicy": "Delete"}),
    ("two sources", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s"},
                     "spec": {"source": {"persistentVolumeClaimName": "a", "volumeSnapshotContentName": "b"}}}),
    ("no source", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s"},
                   "spec": {"source": {}}}),
    ("source as a string", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s"},
                            "spec": {"source": "pvc-a"}}),
    ("empty class name", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s"},
                          "spec": {"source": {"persistentVolumeClaimName": "a"}, "volumeSnapshotClassName": ""}}),
    ("class name misspelt", {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot", "metadata": {"name": "s"},
                             "spec": {"source": {"persistentVolumeClaimName": "a"}, "snapshotClassName": "c"}}),
    ("v1beta1", {"apiVersion": "snapshot.storage.k8s.io/v1beta1", "kind": "VolumeSnapshotClass",
                 "metadata": {"name": "c"}, "driver": "d", "deletionPolicy": "Delete"}),
]


@pytest.mark.parametrize("doc", GOOD_SNAPSHOT_OBJECTS, ids=lambda d: d["kind"])
def test_snapshot_api_schema_accepts(doc):
    _validate_snapshot_api(doc)


@pytest.mark.parametrize("what,doc", BAD_SNAPSHOT_OBJECTS, ids=[w for w, _ in BAD_SNAPSHOT_OBJECTS])
def test_snapshot_api_schema_rejects(what, doc):
    """The snapshot schema is strict: each of these is refused."""
    with pytest.raises(AssertionError):
        _validate_snapshot_api(doc)


# ----------------------------------------------------------------- labels, selectors, volumes

def test_labels(base, snapshots):
    version = cargo_version()
    for d in base + snapshots:
        labels = d["metadata"].get("labels", {})
        for k, v in (("app.kubernetes.io/name", "nodeplane"), ("app.kubernetes.io/part-of", "nodeplane"),
                     ("app.kubernetes.io/version", version)):
            assert labels.get(k) == v, f"{key(d)}: label {k}={labels.get(k)!r}, expected {v!r}"
    components = {
        ("DaemonSet", "nodeplane-agent"): "agent",
        ("ServiceAccount", "nodeplane-agent"): "agent",
        ("ConfigMap", "nodeplane-agent-config"): "agent",
        ("Deployment", "nodeplane-controller"): "controller",
        ("Service", "nodeplane-controller"): "controller",
        ("ServiceAccount", "nodeplane-controller"): "controller",
        ("ConfigMap", "nodeplane-controller-config"): "controller",
    }
    for (kind, name), comp in components.items():
        d = find(base, kind, name, NAMESPACE)
        assert d["metadata"]["labels"].get("app.kubernetes.io/component") == comp, key(d)
    for d in workloads(base):
        tl = d["spec"]["template"]["metadata"]["labels"]
        assert tl.get("app.kubernetes.io/version") == version, f"{key(d)}: pod template version label"
        assert tl.get("app.kubernetes.io/component") == d["metadata"]["labels"]["app.kubernetes.io/component"]


@pytest.mark.parametrize("which", ["base", "overlay"])
def test_selectors_match_pod_templates(which, request):
    docs = request.getfixturevalue(which)
    for d in workloads(docs):
        if d["kind"] == "Pod":
            continue
        sel = d["spec"]["selector"]
        assert set(sel) == {"matchLabels"}, f"{key(d)}: use matchLabels only"
        ml = sel["matchLabels"]
        tl = d["spec"]["template"]["metadata"]["labels"]
        assert ml and all(tl.get(k) == v for k, v in ml.items()), f"{key(d)}: selector {ml} does not match {tl}"
        assert "app.kubernetes.io/version" not in ml, f"{key(d)}: selectors are immutable: no version in them"
    # The selectors tell the two workloads apart.
    ds = find(docs, "DaemonSet", "nodeplane-agent", NAMESPACE)
    dep = find(docs, "Deployment", "nodeplane-controller", NAMESPACE)
    agent_labels = ds["spec"]["template"]["metadata"]["labels"]
    ctl_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert not all(agent_labels.get(k) == v for k, v in dep["spec"]["selector"]["matchLabels"].items())
    assert not all(ctl_labels.get(k) == v for k, v in ds["spec"]["selector"]["matchLabels"].items())
    # The Service selects the controller pods and nothing else.
    svc = find(docs, "Service", "nodeplane-controller", NAMESPACE)
    sel = svc["spec"]["selector"]
    assert all(ctl_labels.get(k) == v for k, v in sel.items()), f"Service selector {sel} misses the controller pods"
    assert not all(agent_labels.get(k) == v for k, v in sel.items()), "Service selector also matches the agents"
    # The anti-affinity term selects the controller's own pods.
    terms = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert len(terms) == 1 and terms[0]["topologyKey"] == "kubernetes.io/hostname"
    aml = terms[0]["labelSelector"]["matchLabels"]
    assert all(ctl_labels.get(k) == v for k, v in aml.items())


@pytest.mark.parametrize("which", ["base", "overlay", "examples"])
def test_volume_mounts_reference_volumes(which, request):
    docs = request.getfixturevalue(which)
    for d in workloads(docs):
        vols = [v["name"] for v in pod_spec(d).get("volumes", [])]
        assert len(vols) == len(set(vols)), f"{key(d)}: duplicate volume names"
        used = set()
        for c in containers(d):
            paths = [m["mountPath"] for m in c.get("volumeMounts", [])]
            assert len(paths) == len(set(paths)), f"{key(d)}/{c['name']}: duplicate mountPath"
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{key(d)}/{c['name']}: mount {m['name']} has no volume"
                used.add(m["name"])
        assert used == set(vols), f"{key(d)}: volumes never mounted: {set(vols) - used}"


# ----------------------------------------------------------------- images

@pytest.mark.parametrize("which", ["base", "overlay", "examples"])
def test_images_pinned(which, request):
    docs = request.getfixturevalue(which)
    version = cargo_version()
    ours = 0
    for d in workloads(docs):
        for c in containers(d):
            image = c["image"]
            name, _, digest = image.partition("@")
            last = name.rsplit("/", 1)[-1]
            assert ":" in last or digest, f"{key(d)}/{c['name']}: image {image} has no tag"
            tag = last.split(":", 1)[1] if ":" in last else ""
            assert tag != "latest", f"{key(d)}/{c['name']}: image {image} uses latest"
            assert c.get("imagePullPolicy") == "IfNotPresent", f"{key(d)}/{c['name']}: imagePullPolicy"
            repo = name.rsplit(":", 1)[0] if ":" in last else name
            if repo.rsplit("/", 1)[-1] == "nodeplane":
                ours += 1
                assert tag == version, f"{key(d)}/{c['name']}: {image}: the tag must be the Cargo version {version}"
            elif repo.startswith("registry.k8s.io/sig-storage/"):
                assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"{image}: pin a release version"
    if which != "examples":
        assert ours == 2, "the agent and the controller run the nodeplane image"


def test_image_is_localhost_nodeplane(ds, deploy):
    version = cargo_version()
    assert container(ds, "agent")["image"] == f"localhost/nodeplane:{version}"
    assert container(deploy, "controller")["image"] == f"localhost/nodeplane:{version}"


# ----------------------------------------------------------------- the agent

def test_agent_pod(base, ds, agent_cfg):
    spec = pod_spec(ds)
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    assert 20 <= spec["terminationGracePeriodSeconds"] <= 60
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    assert spec["serviceAccountName"] == "nodeplane-agent"
    assert spec["automountServiceAccountToken"] is False
    assert find(base, "ServiceAccount", "nodeplane-agent", NAMESPACE)["automountServiceAccountToken"] is False
    c = container(ds, "agent")
    assert c["securityContext"]["privileged"] is True
    assert c["command"] == ["/usr/local/bin/nodeplane-agent", "--config", "/etc/nodeplane/agent.json", "--log-format", "json"]
    # The --config file is the agent.json key of the agent ConfigMap.
    m, vol = covering_mount(ds, c, "/etc/nodeplane/agent.json")
    rel = os.path.relpath("/etc/nodeplane/agent.json", m["mountPath"])
    srcs = [s["configMap"] for s in vol["projected"]["sources"] if "configMap" in s]
    assert any(s["name"] == "nodeplane-agent-config" and {"key": "agent.json", "path": rel} in s["items"]
               and not s.get("optional") for s in srcs)
    # The configuration leaves node identity and the controller address to the environment.
    assert "nodeName" not in agent_cfg
    assert agent_cfg["controller"]["address"] == ""
    assert agent_cfg["controller"]["underlayAddresses"] == []
    assert agent_cfg["controller"]["routeMode"] == "auto"
    assert agent_cfg["csi"]["enabled"] is True and agent_cfg["devicePlugins"]["enabled"] is True
    assert "podCidrs" not in agent_cfg, "blocks come from the controller"


def test_agent_environment(base, ds):
    c = container(ds, "agent")
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NODE_IPS"]["valueFrom"]["fieldRef"]["fieldPath"] in ("status.hostIPs", "status.hostIP")
    # Kubernetes expands $(VAR) from the service links of Services in the pod's namespace.
    svc = find(base, "Service", "nodeplane-controller", NAMESPACE)
    assert svc["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert pod_spec(ds).get("enableServiceLinks", True) is True
    prefix = svc["metadata"]["name"].upper().replace("-", "_")
    grpc = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    assert len(grpc) == 1
    expected = f"$({prefix}_SERVICE_HOST):$({prefix}_SERVICE_PORT_{grpc[0]['name'].upper()})"
    assert env["NODEPLANE_CONTROLLER_ADDRESS"]["value"] == expected
    # Referenced variables that are not service links must be defined before use.
    names = [e["name"] for e in c["env"]]
    for i, e in enumerate(c["env"]):
        for ref in re.findall(r"\$\(([A-Z0-9_]+)\)", e.get("value", "")):
            assert ref.startswith(prefix + "_SERVICE_") or ref in names[:i], f"{e['name']} uses undefined $({ref})"


def test_agent_config_loads(agent_resolved):
    """The shipped agent.json, with the DaemonSet's environment, through the agent's parser."""
    assert get(agent_resolved, "nodeName") == AGENT_ENV["NODE_NAME"]
    assert get(agent_resolved, "controller.address") == AGENT_ENV["NODEPLANE_CONTROLLER_ADDRESS"]
    assert get(agent_resolved, "controller.underlayAddresses") == [AGENT_ENV["NODE_IPS"]]
    assert get(agent_resolved, "healthAddress") == "127.0.0.1:9640"


def test_agent_config_dual_stack_node_ips(base):
    """status.hostIPs on a dual-stack node: both addresses, comma-separated, primary first."""
    env = dict(AGENT_ENV, NODE_IPS="192.0.2.1,2001:db8::1")
    r = check_config_json(AGENT_BIN, agent_json(base), env)
    assert get(r, "controller.underlayAddresses") == ["192.0.2.1", "2001:db8::1"]


def test_agent_config_without_environment_fails(base):
    """Without NODE_NAME the agent does not start with a made-up identity."""
    env = {k: v for k, v in AGENT_ENV.items() if k != "NODE_NAME"}
    saved = os.environ.pop("NODE_NAME", None)
    try:
        res = run_check_config(AGENT_BIN, agent_json(base), env)
    finally:
        if saved is not None:
            os.environ["NODE_NAME"] = saved
    assert res.returncode == 2, f"check-config accepted a configuration without a node name:\n{res.stdout}"
    assert "NODE_NAME" in res.stderr, f"the error does not name NODE_NAME: {res.stderr}"


def test_agent_paths_are_mounted(ds, agent_resolved, controller_cfg):
    """Every path the agent uses is in a mount, at the same path as on the host (the shim and
    the kubelet on the host use the paths the agent writes)."""
    c = container(ds, "agent")
    on_host = ["cniBinDir", "shimPath", "cniConfDir", "conflistPath", "cniSocket", "nodeSocket", "stateDir",
               "pendingDeleteDir", "csi.volumeDir", "devicePlugins.cdiDir"]
    for k in on_host:
        p = get(agent_resolved, k)
        assert os.path.isabs(p), f"{k} {p} is not absolute"
        m, vol = covering_mount(ds, c, p)
        assert "hostPath" in vol, f"{k} {p} is in volume {vol['name']}, not a host path"
    # The kubelet directory: its own mount, propagating both ways (CSI staging and publish
    # mounts must reach the host; device plugin and registration sockets live there).
    kubelet = get(agent_resolved, "kubeletDir")
    m, vol = covering_mount(ds, c, kubelet)
    assert os.path.normpath(m["mountPath"]) == os.path.normpath(kubelet)
    assert vol["hostPath"]["path"] == kubelet and vol["hostPath"]["type"] == "Directory"
    assert m.get("mountPropagation") == "Bidirectional"
    for k in ("csi.socket", "csi.registrationSocket", "devicePlugins.pluginDir"):
        assert covering_mount(ds, c, get(agent_resolved, k))[0] is m, k
    # No network namespace directory: the shim passes the pod's namespace as a descriptor
    # (the agent never resolves the runtime's CNI_NETNS path), so none is mounted.
    assert not any(os.path.normpath(m["mountPath"]) in ("/var/run/netns", "/run/netns") for m in c["volumeMounts"])
    # /dev from the host: loop devices made later, device plugin nodes, hot-plug.
    m, vol = covering_mount(ds, c, "/dev/loop-control")
    assert m["mountPath"] == "/dev" and vol["hostPath"]["path"] == "/dev"
    # Every host path is mounted at the same path inside.
    for v in pod_spec(ds)["volumes"]:
        if "hostPath" in v:
            mounts = [m for m in c["volumeMounts"] if m["name"] == v["name"]]
            assert mounts and all(m["mountPath"] == v["hostPath"]["path"] for m in mounts), v
            assert v["hostPath"]["type"] in ("Directory", "DirectoryOrCreate"), v
    # The device file comes from the optional ConfigMap nodeplane-devices.
    cfile = get(agent_resolved, "devicePlugins.configFile")
    m, vol = covering_mount(ds, c, cfile)
    rel = os.path.relpath(cfile, m["mountPath"])
    srcs = [s["configMap"] for s in vol["projected"]["sources"] if "configMap" in s]
    dev = [s for s in srcs if s["name"] == "nodeplane-devices"]
    assert len(dev) == 1 and dev[0]["optional"] is True and {"key": "devices.json", "path": rel} in dev[0]["items"]
    # The token file is the projected service account token for the controller's audience.
    tfile = get(agent_resolved, "controller.tokenFile")
    m, vol = covering_mount(ds, c, tfile)
    rel = os.path.relpath(tfile, m["mountPath"])
    toks = [s["serviceAccountToken"] for s in vol["projected"]["sources"] if "serviceAccountToken" in s]
    assert len(toks) == 1 and toks[0]["path"] == rel
    assert toks[0]["audience"] == controller_cfg["agentAuth"]["audience"]
    assert 600 <= toks[0]["expirationSeconds"] <= 86400
    # The shim comes from the image, next to the agent binary (/usr/local/bin there).
    shim = get(agent_resolved, "shimSource")
    assert Path(shim) == AGENT_BIN.parent / "nodeplane-cni", f"shimSource {shim} is not the default"
    assert Path(c["command"][0]).parent == Path("/usr/local/bin")


def test_agent_socket_paths_fit(agent_resolved):
    name = driver_name()
    plugin_dir = get(agent_resolved, "devicePlugins.pluginDir")
    csi_sock, reg_sock = get(agent_resolved, "csi.socket"), get(agent_resolved, "csi.registrationSocket")
    assert f"/{name}/" in csi_sock and os.path.basename(reg_sock) == f"{name}-reg.sock"
    sockets = [get(agent_resolved, "cniSocket"), get(agent_resolved, "nodeSocket"), csi_sock, reg_sock,
               f"{plugin_dir}/kubelet.sock",
               # the longest device plugin socket: nodeplane-<40-character name>.sock
               f"{plugin_dir}/nodeplane-{'x' * 40}.sock"]
    for s in sockets:
        assert len(s.encode()) <= SUN_PATH_MAX, f"socket path {s} is {len(s.encode())} bytes"


def test_agent_probes(ds, agent_cfg, agent_resolved):
    c = container(ds, "agent")
    host, port = split_host_port(get(agent_resolved, "healthAddress"))
    assert (host, port) == split_host_port(agent_cfg["healthAddress"])
    expected = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in expected.items():
        g = c[probe]["httpGet"]
        assert g["path"] == path, probe
        assert resolve_port(c, g["port"]) == port, probe
        # Host network: the kubelet probes from the host, where the loopback is the agent's.
        assert g.get("host") == host, f"{probe} must name the health address host {host}"
        assert g.get("scheme", "HTTP") == "HTTP"
    sp = c["startupProbe"]
    assert sp.get("failureThreshold", 3) * sp.get("periodSeconds", 10) >= 300, "startup after a reboot needs minutes"


# ----------------------------------------------------------------- the controller

def test_controller_config_loads(base, controller_cfg):
    r = check_config_json(CONTROLLER_BIN, controller_json(base), CONTROLLER_ENV)
    assert get(r, "csiSocket") == controller_cfg["csiSocket"]
    assert len(controller_cfg["csiSocket"].encode()) <= SUN_PATH_MAX


def test_controller_deployment(base, deploy, controller_cfg):
    spec = pod_spec(deploy)
    # One replica, replaced by stopping the old one first: only the leader is ever ready, so a
    # standby would keep the Deployment short of ready replicas and a surge rollout could
    # never finish.
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert spec["serviceAccountName"] == "nodeplane-controller"
    tol = spec["tolerations"]
    for k in ("node-role.kubernetes.io/control-plane", "node.kubernetes.io/not-ready"):
        assert any(t.get("key") == k and t.get("operator") == "Exists" and t.get("effect") == "NoSchedule" for t in tol), k
    c = container(deploy, "controller")
    assert c["command"] == ["/usr/local/bin/nodeplane-controller", "serve", "--config",
                            "/etc/nodeplane/controller.json", "--log-format", "json"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    # --config is the ConfigMap's controller.json.
    m, vol = covering_mount(deploy, c, "/etc/nodeplane/controller.json")
    assert vol["configMap"]["name"] == "nodeplane-controller-config"
    # The data dir is scratch (the state is in the API).
    m, vol = covering_mount(deploy, c, controller_cfg["dataDir"])
    assert "emptyDir" in vol
    # Listen port = container port "grpc" = the Service's target.
    _, lport = split_host_port(controller_cfg["listen"])
    assert resolve_port(c, "grpc") == lport
    svc = find(base, "Service", "nodeplane-controller", NAMESPACE)
    assert svc["spec"]["type"] == "ClusterIP"
    (sp,) = svc["spec"]["ports"]
    assert sp["name"] == "grpc" and sp["port"] == lport and resolve_port(c, sp["targetPort"]) == lport
    # The Lease and the state live where the RBAC allows.
    assert controller_cfg["store"]["kind"] == "kubernetes"
    assert controller_cfg["store"]["namespace"] == deploy["metadata"]["namespace"] == NAMESPACE
    # Agents are authenticated by TokenReview as the agent's service account.
    sa = find(base, "ServiceAccount", "nodeplane-agent", NAMESPACE)
    auth = controller_cfg["agentAuth"]
    assert auth["kind"] == "tokenReview"
    assert auth["serviceAccount"] == f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    tok = [s["serviceAccountToken"] for v in pod_spec(find(base, "DaemonSet", "nodeplane-agent", NAMESPACE))["volumes"]
           if "projected" in v for s in v["projected"]["sources"] if "serviceAccountToken" in s]
    assert [t["audience"] for t in tok] == [auth["audience"]]


def test_controller_probes(deploy, controller_cfg):
    c = container(deploy, "controller")
    host, port = split_host_port(controller_cfg["healthAddress"])
    # The kubelet probes the pod IP (the node's address): the server must listen on all.
    assert host in ("0.0.0.0", "::"), f"healthAddress {controller_cfg['healthAddress']} is not reachable from the kubelet"
    assert resolve_port(c, "health") == port
    # The health port is a TCP listener: TLS whenever the controller has tls, and the probes
    # must then speak HTTPS (HTTP would get no answer and the pod would be restarted).
    scheme = "HTTPS" if "tls" in controller_cfg else "HTTP"
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        g = c[probe]["httpGet"]
        assert g["path"] == path and resolve_port(c, g["port"]) == port and "host" not in g, probe
        assert g.get("scheme", "HTTP") == scheme, f"{probe} scheme {g.get('scheme', 'HTTP')}, the controller serves {scheme}"


# The sidecars, in order, and the arguments each must have. Each has a ClusterRole and a Role
# named nodeplane-<sidecar> (test_rbac_bindings).
SIDECAR_ARGS = {
    "csi-provisioner": {"--leader-election", "--feature-gates=Topology=true", "--strict-topology",
                        "--immediate-topology=false", "--extra-create-metadata", "--enable-capacity"},
    "csi-resizer": {"--leader-election"},
    "csi-snapshotter": {"--leader-election", "--extra-create-metadata"},
}


def test_csi_sidecars(deploy, controller_cfg):
    sock = controller_cfg["csiSocket"]
    ctl = container(deploy, "controller")
    ctl_mount, vol = covering_mount(deploy, ctl, sock)
    assert "emptyDir" in vol
    timeout_limit = controller_cfg.get("volumeOpTimeoutSeconds", 60)
    assert [c["name"] for c in containers(deploy)] == ["controller", *SIDECAR_ARGS]
    for name, must in SIDECAR_ARGS.items():
        c = container(deploy, name)
        args = c["args"]
        assert must <= set(args), f"{name}: missing {must - set(args)}"
        assert arg_value(args, "--csi-address") == sock
        m, v = covering_mount(deploy, c, sock)
        assert v["name"] == vol["name"] and m["mountPath"] == ctl_mount["mountPath"], f"{name} sees another socket"
        assert parse_duration(arg_value(args, "--timeout")) > timeout_limit, \
            f"{name}: --timeout must exceed the controller's volumeOpTimeoutSeconds ({timeout_limit})"
        assert c["image"].startswith(f"registry.k8s.io/sig-storage/{name}:v")
        # Leader election on a Lease in the pod's namespace, where its Role is.
        assert not any(a.startswith("--leader-election-namespace") for a in args), \
            f"{name}: the Lease must be in the pod's namespace ({NAMESPACE}), where the sidecar's Role grants it"
        # Locked down like the controller container; bounded memory.
        assert c["securityContext"] == ctl["securityContext"], f"{name}: securityContext"
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"], name
        assert not c.get("ports"), f"{name}: nothing but its socket"
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c.get("env", [])}
        assert env == SIDECAR_ENV.get(name, {}), f"{name}: env {env}"
    # Capacity tracking: the CSIStorageCapacity objects go to the pod's namespace (NAMESPACE,
    # where the provisioner's Role grants them) and are owned by the pod's controller two
    # levels up: pod -> ReplicaSet -> Deployment (the Role reads pods and ReplicaSets).
    assert deploy["kind"] == "Deployment"
    assert arg_value(container(deploy, "csi-provisioner")["args"], "--capacity-ownerref-level") == "2"


# The downward-API environment each sidecar needs (the others have none).
SIDECAR_ENV = {"csi-provisioner": {"NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}}



# ----------------------------------------------------------------- health servers (live)

def _http_status(url, netns=None):
    """The status `url` answers; https:// as kubelet's prober (certificate not verified).
    None when the server closes the connection without an HTTP answer (plain HTTP to a TLS
    port). A refused connection is retried for a few seconds (the server may start just after
    the process reports ready); an HTTP answer of any status is final."""
    code = ("import http.client, ssl, sys, time, urllib.request, urllib.error\n"
            "ctx = ssl._create_unverified_context()\n"
            "deadline = time.time() + 10\n"
            "while True:\n"
            "    try:\n"
            "        print(urllib.request.urlopen(sys.argv[1], timeout=5, context=ctx).status); break\n"
            "    except urllib.error.HTTPError as e:\n"
            "        print(e.code); break\n"
            "    except (http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine):\n"
            "        print('none'); break\n"
            "    except OSError:\n"
            "        if time.time() > deadline: raise\n"
            "        time.sleep(0.1)\n")
    args = ["python3", "-c", code, url]
    if netns:
        args = ["nsenter", f"--net={netns}", *args]
    res = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"GET {url}: {res.stderr}"
    out = res.stdout.strip()
    return None if out == "none" else int(out)


def _wait_status(url, netns=None, want=200, timeout=15):
    """The status `url` answers once it answers `want` (readiness is judged on a short tick
    after start-up), or the last one seen."""
    deadline = time.time() + timeout
    while True:
        got = _http_status(url, netns)
        if got == want or time.time() > deadline:
            return got
        time.sleep(0.25)


def test_agent_health_server_serves_probe_paths(ds, agent_cfg):
    """A real agent (standalone, in its own network namespace) answers the probes' paths on
    the shipped healthAddress."""
    need_binary(AGENT_BIN)
    addr = agent_cfg["healthAddress"]
    host, port = split_host_port(addr)
    node = harness.Node(tag="health", extra={"healthAddress": addr})
    try:
        base_url = f"http://{host}:{port}"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            path = container(ds, "agent")[probe]["httpGet"]["path"]
            assert _wait_status(base_url + path, node.ns.path) == 200, f"agent {probe} {path}"
        assert _http_status(base_url + "/no-such-path", node.ns.path) == 404
    finally:
        node.cleanup()


def test_controller_health_server_serves_probe_paths(deploy, controller_cfg, tmp_path):
    """A real controller (local mode, with a certificate as the shipped config has one)
    answers the probes' paths on its healthAddress port, by the probes' scheme, the way
    kubelet probes (HTTPS unverified); plain HTTP gets no answer."""
    need_binary(CONTROLLER_BIN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tls = tmp_path / "tls"
    subprocess.run([str(CONTROLLER_BIN), "certs", "init", "--dir", str(tls), "--san", "127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    ctl = cluster.Controller(tmp_path / "ctl", extra={"healthAddress": f"127.0.0.1:{port}", "tls": {"dir": str(tls)}})
    try:
        c = container(deploy, "controller")
        for probe in ("livenessProbe", "readinessProbe"):
            g = c[probe]["httpGet"]
            url = f"{g.get('scheme', 'HTTP').lower()}://127.0.0.1:{port}{g['path']}"
            assert _wait_status(url) == 200, f"controller {probe} {url}"
        assert _http_status(f"https://127.0.0.1:{port}/no-such-path") == 404
        assert _http_status(f"http://127.0.0.1:{port}/healthz") is None, "plain HTTP must get no answer"
    finally:
        ctl.stop()


# ----------------------------------------------------------------- RBAC

def _api_calls():
    need_binary(CONTROLLER_BIN)
    res = subprocess.run([str(CONTROLLER_BIN), "api-calls"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"nodeplane-controller api-calls failed ({res.returncode}): {res.stderr}"
    text = res.stdout.strip()
    try:
        items = json.loads(text)
        if isinstance(items, dict):
            items = [items]
    except json.JSONDecodeError:
        items = [json.loads(l) for l in text.splitlines() if l.strip()]
    assert items, "nodeplane-controller api-calls printed nothing"
    calls = set()
    for i in items:
        group = "" if i["group"] in ("core", "v1") else i["group"]
        calls.add((group, i["resource"], i["verb"], bool(i["namespaced"])))
    return calls


def test_controller_rbac_equals_api_calls(base, controller_cfg):
    calls = _api_calls()
    cr = find(base, "ClusterRole", "nodeplane-controller")
    role = find(base, "Role", "nodeplane-controller", NAMESPACE)
    granted = expand_rules(cr["rules"], False) | expand_rules(role["rules"], True)
    assert granted == calls, (f"RBAC grants calls the controller never makes: {sorted(granted - calls)}; "
                              f"the controller makes calls RBAC does not grant: {sorted(calls - granted)}")
    # Our own resources: the call's scope is the CRD's scope.
    crds = {(d["spec"]["group"], d["spec"]["names"]["plural"]): d["spec"]["scope"]
            for d in of_kind(base, "CustomResourceDefinition")}
    for g, res, _, namespaced in calls:
        if g == "nodeplane.dev":
            assert (g, res) in crds, f"the controller uses {res}.{g}, which no CRD defines"
            assert namespaced == (crds[(g, res)] == "Namespaced")
    # The volume records' CRD is read for its uid (their store's identity), and no other.
    crd_rules = [r for r in cr["rules"] if "customresourcedefinitions" in r["resources"]]
    assert crd_rules == [{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                          "resourceNames": ["nodeplanevolumes.nodeplane.dev"], "verbs": ["get"]}]
    # Reads and updates are limited to the controller's own Lease, Secrets (the token keys:
    # store.hmacSecretName, default nodeplane-controller-hmac; the bootstrap TLS pair:
    # tls.bootstrap.secretName) and CA ConfigMap; create cannot be limited by name.
    bootstrap = controller_cfg["tls"]["bootstrap"]
    own = {"leases": [controller_cfg["store"]["leaseName"]],
           "secrets": [controller_cfg["store"].get("hmacSecretName", "nodeplane-controller-hmac"),
                       bootstrap.get("secretName", "nodeplane-controller-tls")],
           "configmaps": [bootstrap.get("caConfigMapName", "nodeplane-ca")]}
    # The one exception: the encrypted volumes' keys, one Secret per volume (src/controller/
    # keys.rs), read and deleted by names not known ahead.
    volume_keys = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "delete"]}
    assert volume_keys in role["rules"]
    for r in role["rules"]:
        if set(r["verbs"]) - {"create"} and r != volume_keys:
            (res,) = r["resources"]
            assert r.get("resourceNames") == own[res], f"rule {r} should be limited to {own[res]}"


EXPECTED_SIDECAR_RULES = {
    # external-provisioner v5 rbac.yaml, less secrets, volumeattachments (no
    # ControllerPublish) and VolumeAttributesClass. Capacity tracking: EXPECTED_SIDECAR_ROLES.
    "nodeplane-csi-provisioner": {
        ("", "persistentvolumes"): {"get", "list", "watch", "create", "patch", "delete"},
        ("", "persistentvolumeclaims"): {"get", "list", "watch", "update"},
        ("storage.k8s.io", "storageclasses"): {"get", "list", "watch"},
        ("", "events"): {"list", "watch", "create", "update", "patch"},
        # Restoring a PVC from a VolumeSnapshot.
        (SNAPSHOT_GROUP, "volumesnapshots"): {"get", "list"},
        (SNAPSHOT_GROUP, "volumesnapshotcontents"): {"get", "list"},
        ("storage.k8s.io", "csinodes"): {"get", "list", "watch"},
        ("", "nodes"): {"get", "list", "watch"},
    },
    # external-resizer v1.14 rbac.yaml, less VolumeAttributesClass.
    "nodeplane-csi-resizer": {
        ("", "persistentvolumes"): {"get", "list", "watch", "patch"},
        ("", "persistentvolumeclaims"): {"get", "list", "watch"},
        ("", "pods"): {"get", "list", "watch"},
        ("", "persistentvolumeclaims/status"): {"patch"},
        ("", "events"): {"list", "watch", "create", "update", "patch"},
    },
    # external-snapshotter v8 rbac-csi-snapshotter.yaml, less secrets and what only volume
    # group snapshots need (groupsnapshot.storage.k8s.io, `create` on volumesnapshotcontents).
    "nodeplane-csi-snapshotter": {
        ("", "events"): {"list", "watch", "create", "update", "patch"},
        (SNAPSHOT_GROUP, "volumesnapshotclasses"): {"get", "list", "watch"},
        (SNAPSHOT_GROUP, "volumesnapshotcontents"): {"get", "list", "watch", "update", "patch"},
        (SNAPSHOT_GROUP, "volumesnapshotcontents/status"): {"update", "patch"},
    },
}
LEADER_ELECTION = {("coordination.k8s.io", "leases"): {"get", "watch", "list", "delete", "update", "create"}}
# Each sidecar's Role in the namespace: its leader election, and for the provisioner the
# capacity tracking rules of upstream's Role.
EXPECTED_SIDECAR_ROLES = {
    "nodeplane-csi-provisioner": {
        **LEADER_ELECTION,
        ("storage.k8s.io", "csistoragecapacities"): {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("", "pods"): {"get"},
        ("apps", "replicasets"): {"get"},
    },
}


def _rules_map(rules):
    out = {}
    for g, res, v, _ in expand_rules(rules, False):
        out.setdefault((g, res), set()).add(v)
    return out


def test_rbac_bindings(base, deploy):
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in base if d["kind"] in ("Role", "ClusterRole")}
    grants = {}
    for b in base:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], ns, ref["name"]) in roles, f"{key(b)} refers to a role not in the manifests"
        for s in b["subjects"]:
            assert s["kind"] == "ServiceAccount", f"{key(b)}: bind service accounts only"
            grants.setdefault((s["namespace"], s["name"]), set()).add((ref["kind"], ref["name"]))
    assert (NAMESPACE, "nodeplane-agent") not in grants, "the agent must have no Kubernetes API access"
    assert set(grants) == {(NAMESPACE, "nodeplane-controller")}
    # The controller's own roles and one pair per sidecar, named after it, all for the
    # service account the Deployment runs as.
    sa = (deploy["metadata"]["namespace"], pod_spec(deploy)["serviceAccountName"])
    assert sa == (NAMESPACE, "nodeplane-controller")
    assert set(EXPECTED_SIDECAR_RULES) == {f"nodeplane-{n}" for n in SIDECAR_ARGS}
    assert grants[sa] == {
        (k, n) for k in ("ClusterRole", "Role") for n in ("nodeplane-controller", *EXPECTED_SIDECAR_RULES)}
    for (kind, ns, name), r in roles.items():
        for rule in r["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{kind} {name}: wildcard in {field}"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), f"{kind} {name}: {rule}"
            if "secrets" in rule["resources"]:
                # Only the controller's token keys, TLS pair and volume keys: Secrets in its
                # own namespace; update only on its own two by name.
                assert (kind, ns, name) == ("Role", NAMESPACE, "nodeplane-controller"), f"{kind} {name} grants secrets"
                assert rule["resources"] == ["secrets"] and (
                    rule.get("resourceNames") == ["nodeplane-controller-hmac", "nodeplane-controller-tls"]
                    or rule["verbs"] in (["create"], ["get", "delete"])), rule
            if name != "nodeplane-controller":
                assert "nodeplane.dev" not in rule["apiGroups"], f"{kind} {name} touches nodeplane.dev"
    for name, expected in EXPECTED_SIDECAR_RULES.items():
        assert _rules_map(roles[("ClusterRole", None, name)]["rules"]) == expected, name
        assert _rules_map(roles[("Role", NAMESPACE, name)]["rules"]) == EXPECTED_SIDECAR_ROLES.get(name, LEADER_ELECTION), name


# ----------------------------------------------------------------- namespace, CSI objects

def test_namespace_and_quota(base):
    ns = find(base, "Namespace", NAMESPACE)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    used = {pod_spec(d)["priorityClassName"] for d in workloads(base)}
    assert used == {"system-node-critical", "system-cluster-critical"}
    (q,) = of_kind(base, "ResourceQuota")
    assert q["metadata"]["namespace"] == NAMESPACE
    (expr,) = q["spec"]["scopeSelector"]["matchExpressions"]
    assert expr["scopeName"] == "PriorityClass" and expr["operator"] == "In"
    assert used <= set(expr["values"])
    assert parse_quantity(q["spec"]["hard"]["pods"]) >= 5002, "room for an agent on every node (5000) and two controllers"
    for d in base:
        if d["kind"] not in ("Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                             "CSIDriver", "StorageClass"):
            assert d["metadata"].get("namespace") == NAMESPACE, f"{key(d)} outside {NAMESPACE}"


def test_csi_driver_and_storage_class(base):
    name = driver_name()
    drv = find(base, "CSIDriver", name)
    assert drv["spec"] == {"attachRequired": False, "podInfoOnMount": True, "fsGroupPolicy": "File",
                           "volumeLifecycleModes": ["Persistent"], "storageCapacity": True,
                           "requiresRepublish": False}
    sc = find(base, "StorageClass", "nodeplane-local")
    assert sc["provisioner"] == name
    assert sc["volumeBindingMode"] == "WaitForFirstConsumer"
    assert sc["allowVolumeExpansion"] is True and sc["reclaimPolicy"] == "Delete"
    assert sc["parameters"] == {"csi.storage.k8s.io/fstype": "ext4"}
    assert sc["metadata"].get("annotations", {}).get("storageclass.kubernetes.io/is-default-class", "false") == "false"
    # One class per backend: the lvm one differs only in its backend parameter.
    lvm = find(base, "StorageClass", "nodeplane-lvm")
    assert lvm["parameters"] == {"csi.storage.k8s.io/fstype": "ext4", "backend": "lvm"}
    assert {k: v for k, v in lvm.items() if k not in ("metadata", "parameters")} == \
        {k: v for k, v in sc.items() if k not in ("metadata", "parameters")}
    # The encrypted class: kubelet hands the node the Secret the controller makes for each
    # volume (src/controller/keys.rs: nodeplane-key-<volume name>, in the controller's namespace).
    enc = find(base, "StorageClass", "nodeplane-encrypted")
    assert enc["parameters"] == {
        "csi.storage.k8s.io/fstype": "ext4", "encryption": "luks2",
        "csi.storage.k8s.io/node-stage-secret-name": "nodeplane-key-${pv.name}",
        "csi.storage.k8s.io/node-stage-secret-namespace": NAMESPACE}
    assert {k: v for k, v in enc.items() if k not in ("metadata", "parameters")} == \
        {k: v for k, v in sc.items() if k not in ("metadata", "parameters")}
    assert name in (REPO / "README.md").read_text()


# ----------------------------------------------------------------- CRDs

CRD_EXPECT = {
    "NodeplaneNode": ("nodeplanenodes", ["npnode"], ["Underlay"]),
    "IPBlock": ("ipblocks", [], ["CIDR", "Node"]),
    "NodeplaneVolume": ("nodeplanevolumes", ["npvol"], ["Node", "Size", "State", "Kind"]),
}


def _crd(base, kind):
    (d,) = [d for d in of_kind(base, "CustomResourceDefinition") if d["spec"]["names"]["kind"] == kind]
    return d


def _schema(base, kind):
    (v,) = _crd(base, kind)["spec"]["versions"]
    return v["schema"]["openAPIV3Schema"]


def _walk(schema, path="$"):
    yield path, schema
    for k, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{k}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def _schema_at(schema, json_path):
    cur = schema
    for part in json_path.lstrip(".").split("."):
        cur = cur["properties"][part]
    return cur


def test_crds(base):
    crds = of_kind(base, "CustomResourceDefinition")
    assert {d["spec"]["names"]["kind"] for d in crds} == set(CRD_EXPECT)
    for kind, (plural, short, columns) in CRD_EXPECT.items():
        d = _crd(base, kind)
        s = d["spec"]
        assert d["metadata"]["name"] == f"{plural}.nodeplane.dev"
        assert s["group"] == "nodeplane.dev" and s["scope"] == "Cluster"
        assert s["names"]["plural"] == plural and s["names"].get("shortNames", []) == short
        (v,) = s["versions"]
        assert v["name"] == "v1alpha1" and v["served"] is True and v["storage"] is True
        schema = v["schema"]["openAPIV3Schema"]
        # Structural, and unknown fields are pruned (never preserved).
        for path, node in _walk(schema):
            assert "type" in node, f"{kind} {path}: structural schemas need a type everywhere"
            assert not any(k.startswith("x-kubernetes-preserve") for k in node), f"{kind} {path} preserves unknown fields"
            ap = node.get("additionalProperties")
            assert ap is None or (isinstance(ap, dict) and "properties" not in node), f"{kind} {path}: additionalProperties"
        assert schema["required"] == ["spec"]
        names = [c["name"] for c in v["additionalPrinterColumns"] if c["name"] != "Age"]
        assert names == columns
        for c in v["additionalPrinterColumns"]:
            if c["jsonPath"].startswith(".metadata."):
                continue
            target = _schema_at(schema, c["jsonPath"])
            if c["type"] == "integer":
                assert target["type"] == "integer", c
    vol = _schema(base, "NodeplaneVolume")["properties"]["spec"]
    assert set(vol["required"]) == {"id", "name", "node", "sizeBytes", "fsType", "state", "createdAt"}
    assert vol["properties"]["state"]["enum"] == ["creating", "ready", "deleting"]
    assert vol["properties"]["sizeBytes"] == {"type": "integer", "format": "int64", "minimum": 0}
    assert vol["properties"]["createdAt"]["format"] == "int64"
    assert vol["properties"]["parameters"]["additionalProperties"] == {"type": "string"}
    # Snapshots share the record: what it is, and where its data came from. Optional (records
    # written before snapshots existed have none of them), strings, described.
    assert vol["properties"]["kind"]["enum"] == ["volume", "snapshot"]
    assert vol["properties"]["backend"]["enum"] == ["file", "lvm"]
    for f in ("kind", "sourceVolume", "sourceSnapshot", "backend"):
        assert vol["properties"][f]["type"] == "string", f
        assert len(vol["properties"][f].get("description", "")) > 20, f"{f} needs a description"
        assert f not in vol["required"], f"{f} must stay optional"
    node = _schema(base, "NodeplaneNode")["properties"]["spec"]
    assert node["required"] == ["underlay"] and node["properties"]["underlay"]["minItems"] == 1
    blk = _schema(base, "IPBlock")["properties"]["spec"]
    assert set(blk["required"]) == {"cidr", "node"}


def _strict_validator(base, kind):
    """The CRD schema as the API server applies it to a create with strict field validation:
    the declared fields only, plus the object envelope."""
    def strict(s):
        s = copy.deepcopy(s)
        if s.get("type") == "object" and "properties" in s:
            s.setdefault("additionalProperties", False)
            s["properties"] = {k: strict(v) for k, v in s["properties"].items()}
        if isinstance(s.get("items"), dict):
            s["items"] = strict(s["items"])
        return s
    schema = strict(_schema(base, kind))
    schema["properties"].update({
        "apiVersion": {"const": "nodeplane.dev/v1alpha1"},
        "kind": {"const": kind},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
    })
    schema["required"] = sorted(set(schema["required"]) | {"apiVersion", "kind", "metadata"})
    return jsonschema.Draft7Validator(schema)


# What the controller writes (one of each), as test fixtures: not shipped in the base.
EXAMPLE_CRS = yaml.safe_load_all("""
apiVersion: nodeplane.dev/v1alpha1
kind: NodeplaneNode
metadata: {name: worker-1}
spec:
  underlay: ["192.0.2.11", "2001:db8::11"]
  vtepMac: "0a:58:c0:00:02:0b"
  blocks: ["10.244.1.0/24", "fd00:10:244:0:1::/80"]
---
apiVersion: nodeplane.dev/v1alpha1
kind: IPBlock
metadata: {name: v4-10-244-1-0-24}
spec: {cidr: 10.244.1.0/24, node: worker-1}
---
apiVersion: nodeplane.dev/v1alpha1
kind: NodeplaneVolume
metadata: {name: pvc-0b6c4bd4-4a47-4d4f-9d55-3c7e8d2f0a11}
spec:
  id: pvc-0b6c4bd4-4a47-4d4f-9d55-3c7e8d2f0a11
  name: pvc-0b6c4bd4-4a47-4d4f-9d55-3c7e8d2f0a11
  node: worker-1
  sizeBytes: 1073741824
  fsType: ext4
  state: ready
  createdAt: 1767225600
  parameters: {fsType: ext4}
""")
EXAMPLE_CRS = {d["kind"]: d for d in EXAMPLE_CRS}

# Records with the snapshot fields: a snapshot, a volume restored from it, a clone (no kind).
SNAPSHOT_CRS = list(yaml.safe_load_all("""
apiVersion: nodeplane.dev/v1alpha1
kind: NodeplaneVolume
metadata: {name: snap-7f9c2b1e4d6a4c3b8e5f0a1b2c3d4e5f}
spec:
  id: snap-7f9c2b1e4d6a4c3b8e5f0a1b2c3d4e5f
  name: snapshot-7f9c2b1e-4d6a-4c3b-8e5f-0a1b2c3d4e5f
  node: worker-1
  sizeBytes: 1073741824
  fsType: ext4
  state: creating
  createdAt: 1767225700
  kind: snapshot
  sourceVolume: pvc-0b6c4bd4-4a47-4d4f-9d55-3c7e8d2f0a11
  parameters: {csi.storage.k8s.io/volumesnapshot/name: nodeplane-example-snapshot}
---
apiVersion: nodeplane.dev/v1alpha1
kind: NodeplaneVolume
metadata: {name: pvc-5d1e0c77-2f4b-4a9e-b1c3-6e8f9a0b1c2d}
spec:
  id: pvc-5d1e0c77-2f4b-4a9e-b1c3-6e8f9a0b1c2d
  name: pvc-5d1e0c77-2f4b-4a9e-b1c3-6e8f9a0b1c2d
  node: worker-1
  sizeBytes: 2147483648
  fsType: ext4
  state: ready
  createdAt: 1767225800
  kind: volume
  sourceSnapshot: snap-7f9c2b1e4d6a4c3b8e5f0a1b2c3d4e5f
---
apiVersion: nodeplane.dev/v1alpha1
kind: NodeplaneVolume
metadata: {name: pvc-9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d}
spec:
  id: pvc-9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d
  name: pvc-9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d
  node: worker-1
  sizeBytes: 1073741824
  fsType: xfs
  state: deleting
  createdAt: 1767225900
  sourceVolume: pvc-0b6c4bd4-4a47-4d4f-9d55-3c7e8d2f0a11
"""))


def _broken(kind, mutate):
    d = copy.deepcopy(EXAMPLE_CRS[kind])
    mutate(d["spec"])
    return d


INVALID_CRS = [
    ("bad state enum", "NodeplaneVolume", lambda s: s.update(state="mounted"), "state"),
    ("volume without node", "NodeplaneVolume", lambda s: s.pop("node"), "node"),
    ("negative size", "NodeplaneVolume", lambda s: s.update(sizeBytes=-1), "sizeBytes"),
    ("size as a string", "NodeplaneVolume", lambda s: s.update(sizeBytes="1Gi"), "sizeBytes"),
    ("non-string parameter", "NodeplaneVolume", lambda s: s["parameters"].update(replicas=3), "parameters"),
    ("unknown volume field", "NodeplaneVolume", lambda s: s.update(owner="x"), "owner"),
    ("bad kind enum", "NodeplaneVolume", lambda s: s.update(kind="clone"), "kind"),
    ("kind capitalised", "NodeplaneVolume", lambda s: s.update(kind="Snapshot"), "kind"),
    ("source volume not a string", "NodeplaneVolume", lambda s: s.update(sourceVolume=["pvc-a"]), "sourceVolume"),
    ("source snapshot not a string", "NodeplaneVolume", lambda s: s.update(sourceSnapshot=7), "sourceSnapshot"),
    ("source snapshot misspelt", "NodeplaneVolume", lambda s: s.update(snapshotSource="snap-1"), "snapshotSource"),
    ("block without node", "IPBlock", lambda s: s.pop("node"), "node"),
    ("block without cidr", "IPBlock", lambda s: s.pop("cidr"), "cidr"),
    ("node without underlay", "NodeplaneNode", lambda s: s.update(underlay=[]), "underlay"),
    ("underlay not a list", "NodeplaneNode", lambda s: s.update(underlay="192.0.2.1"), "underlay"),
]


@pytest.mark.parametrize("kind", sorted(EXAMPLE_CRS))
def test_example_custom_resources_validate(base, kind):
    errors = sorted(_strict_validator(base, kind).iter_errors(EXAMPLE_CRS[kind]), key=str)
    assert not errors, f"{kind}: " + "; ".join(e.message for e in errors)


@pytest.mark.parametrize("doc", SNAPSHOT_CRS, ids=[d["spec"].get("kind", "no-kind") + "-" + d["spec"]["state"] for d in SNAPSHOT_CRS])
def test_snapshot_records_validate(base, doc):
    """A snapshot, a volume restored from one and a clone (with no kind: a volume) fit the
    NodeplaneVolume schema, so the API server keeps their new fields."""
    errors = sorted(_strict_validator(base, "NodeplaneVolume").iter_errors(doc), key=str)
    assert not errors, "; ".join(e.message for e in errors)


@pytest.mark.parametrize("what,kind,mutate,field", INVALID_CRS, ids=[c[0] for c in INVALID_CRS])
def test_invalid_custom_resources_rejected(base, what, kind, mutate, field):
    errors = list(_strict_validator(base, kind).iter_errors(_broken(kind, mutate)))
    assert errors, f"{what}: accepted"
    assert any(field in (list(e.absolute_path) + [e.message]) or field in e.message for e in errors), \
        f"{what}: rejected for another reason: {[e.message for e in errors]}"


# ----------------------------------------------------------------- examples and overlay

def test_examples(base, examples, ds):
    sc = find(base, "StorageClass", "nodeplane-local")
    pvcs = of_kind(examples, "PersistentVolumeClaim")
    assert pvcs and all(p["spec"]["storageClassName"] == sc["metadata"]["name"] for p in pvcs)
    claims = {p["metadata"]["name"] for p in pvcs}
    for pod in of_kind(examples, "Pod"):
        for v in pod["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
    # The device file example is what the DaemonSet mounts.
    cm = find(examples, "ConfigMap", "nodeplane-devices")
    src = [s["configMap"] for v in pod_spec(ds)["volumes"] if "projected" in v
           for s in v["projected"]["sources"] if s.get("configMap", {}).get("name") == "nodeplane-devices"]
    assert len(src) == 1 and cm["metadata"]["namespace"] == ds["metadata"]["namespace"]
    devices = json.loads(cm["data"][src[0]["items"][0]["key"]])
    names = set()
    for r in devices["resources"]:
        assert re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", r["name"]), r["name"]
        assert all(p.startswith("/dev/") for p in r["devices"])
        names.add(r["name"])
    requested = set()
    for pod in of_kind(examples, "Pod"):
        for c in pod["spec"]["containers"]:
            for res in c.get("resources", {}).get("limits", {}):
                if res.startswith("nodeplane.dev/"):
                    requested.add(res.split("/", 1)[1])
    assert requested and requested <= names, f"example pods request {requested}, the device file offers {names}"


def test_snapshot_class(snapshots):
    """daemonset/snapshots: the VolumeSnapshotClass of our driver, and nothing else (it is applied
    on its own, after the upstream CRDs)."""
    assert [key(d) for d in snapshots] == [("VolumeSnapshotClass", None, "nodeplane-local")]
    (vsc,) = snapshots
    assert vsc["apiVersion"] == f"{SNAPSHOT_GROUP}/v1"
    assert vsc["driver"] == driver_name()
    assert vsc["deletionPolicy"] == "Delete"
    assert not vsc.get("parameters"), "the driver takes no snapshot parameters (and no secrets)"
    assert vsc["metadata"].get("annotations", {}).get("snapshot.storage.kubernetes.io/is-default-class", "false") == "false"
    text = (DAEMONSET / "README.md").read_text()
    assert "kubectl apply -k daemonset/snapshots/" in text, "daemonset/README.md must say how to apply daemonset/snapshots"


def _claim_bytes(pvc):
    return parse_quantity(pvc["spec"]["resources"]["requests"]["storage"])


def test_snapshot_restore_clone_examples(base, snapshots, examples):
    """The VolumeSnapshot names an example claim and our class; the restored claim names that
    snapshot, the clone an example claim, each in its namespace and class, at least the source's
    size; the pod using them runs next to the pod using the source (node-local data)."""
    (vsc,) = snapshots
    sc = find(base, "StorageClass", "nodeplane-local")
    claims = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in of_kind(examples, "PersistentVolumeClaim")}
    snaps = of_kind(examples, "VolumeSnapshot")
    assert snaps, "daemonset/examples has no VolumeSnapshot"
    snap_source = {}
    for vs in snaps:
        ns = vs["metadata"]["namespace"]
        assert vs["spec"]["volumeSnapshotClassName"] == vsc["metadata"]["name"]
        src = claims.get((ns, vs["spec"]["source"]["persistentVolumeClaimName"]))
        assert src is not None, f"{key(vs)}: its source claim is not an example in {ns}"
        assert not src["spec"].get("dataSource"), f"{key(vs)}: snapshot a plain example claim"
        snap_source[(ns, vs["metadata"]["name"])] = src
    # The claim each example claim's data comes from, followed to a claim without a source.
    origin = {}
    kinds = set()
    for (ns, name), pvc in claims.items():
        ds = pvc["spec"].get("dataSource")
        assert "dataSourceRef" not in pvc["spec"], f"{name}: use dataSource (dataSourceRef is for populators)"
        if not ds:
            continue
        if ds["kind"] == "VolumeSnapshot":
            assert ds.get("apiGroup") == SNAPSHOT_GROUP, f"{name}: dataSource apiGroup"
            src = snap_source.get((ns, ds["name"]))
            assert src is not None, f"{name}: restores {ds['name']}, which is not an example VolumeSnapshot in {ns}"
        else:
            assert ds["kind"] == "PersistentVolumeClaim" and ds.get("apiGroup", "") == "", f"{name}: dataSource {ds}"
            src = claims.get((ns, ds["name"]))
            assert src is not None, f"{name}: clones {ds['name']}, which is not an example claim in {ns}"
            # A clone is of the same class.
            assert src["spec"]["storageClassName"] == pvc["spec"]["storageClassName"], name
        kinds.add(ds["kind"])
        assert pvc["spec"]["storageClassName"] == sc["metadata"]["name"]
        assert pvc["spec"].get("volumeMode", "Filesystem") == src["spec"].get("volumeMode", "Filesystem"), name
        assert _claim_bytes(pvc) >= _claim_bytes(src), f"{name}: smaller than its source {src['metadata']['name']}"
        origin[(ns, name)] = (ns, src["metadata"]["name"])
    assert kinds == {"VolumeSnapshot", "PersistentVolumeClaim"}, f"examples restore and clone: {kinds}"
    # A pod using a restored or cloned claim must land on the node holding the source's data:
    # required pod affinity (per node) to a pod that uses the source claim.
    pods = of_kind(examples, "Pod")

    def uses(pod):
        return {(pod["metadata"]["namespace"], v["persistentVolumeClaim"]["claimName"])
                for v in pod["spec"].get("volumes", []) if "persistentVolumeClaim" in v}
    for pod in pods:
        derived = uses(pod) & set(origin)
        if not derived:
            continue
        terms = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert len(terms) == 1 and terms[0]["topologyKey"] == "kubernetes.io/hostname", pod["metadata"]["name"]
        ml = terms[0]["labelSelector"]["matchLabels"]
        peers = [p for p in pods if p is not pod and p["metadata"]["namespace"] == pod["metadata"]["namespace"]
                 and all(p["metadata"].get("labels", {}).get(k) == v for k, v in ml.items())]
        assert len(peers) == 1, f"{pod['metadata']['name']}: its affinity selects {len(peers)} example pods"
        for claim in derived:
            assert origin[claim] in uses(peers[0]), \
                f"{pod['metadata']['name']}: {claim[1]} comes from {origin[claim][1]}, which its peer pod does not use"


def test_overlay(base, overlay):
    version = cargo_version()
    assert {key(d) for d in base} == {key(d) for d in overlay}
    for name, kind in (("nodeplane-agent", "DaemonSet"), ("nodeplane-controller", "Deployment")):
        d = find(overlay, kind, name, NAMESPACE)
        c = [c for c in containers(d) if "nodeplane" in c["image"].rsplit("/", 1)[-1]]
        assert [x["image"] for x in c] == [f"registry.example.com/platform/nodeplane:{version}"], name
    b_sidecars = [c["image"] for c in containers(find(base, "Deployment", "nodeplane-controller", NAMESPACE))[1:]]
    o_sidecars = [c["image"] for c in containers(find(overlay, "Deployment", "nodeplane-controller", NAMESPACE))[1:]]
    assert b_sidecars == o_sidecars
    # Other pools, a valid controller configuration otherwise the same.
    bc, oc = json.loads(controller_json(base)), json.loads(controller_json(overlay))
    assert bc["pools"] != oc["pools"]
    assert {k: v for k, v in bc.items() if k != "pools"} == {k: v for k, v in oc.items() if k != "pools"}
    check_config_json(CONTROLLER_BIN, controller_json(overlay), CONTROLLER_ENV)
    assert agent_json(overlay) == agent_json(base)
    # Placement added, nothing of the base's lost.
    bds, ods = (pod_spec(find(x, "DaemonSet", "nodeplane-agent", NAMESPACE)) for x in (base, overlay))
    assert ods["nodeSelector"] == dict(bds["nodeSelector"], **{"kubernetes.io/arch": "amd64"})
    assert ods["tolerations"] == bds["tolerations"]
    bdp, odp = (pod_spec(find(x, "Deployment", "nodeplane-controller", NAMESPACE)) for x in (base, overlay))
    assert odp["nodeSelector"] == dict(bdp["nodeSelector"], **{"node-role.kubernetes.io/control-plane": ""})
    assert odp["tolerations"][:len(bdp["tolerations"])] == bdp["tolerations"]
    assert odp["tolerations"][len(bdp["tolerations"]):] == [
        {"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}]


def test_node_driver_registrar_overlay(base, agent_resolved):
    """The fallback for operators who prefer the standard: the upstream registrar sidecar
    registers the driver, the agent serves no registration socket; nothing else changes."""
    docs = render(REGISTRAR_OVERLAY)[1]
    assert {key(d) for d in base} == {key(d) for d in docs}
    ds = find(docs, "DaemonSet", "nodeplane-agent", NAMESPACE)
    cs = {c["name"]: c for c in containers(ds)}
    assert sorted(cs) == ["agent", "node-driver-registrar"]
    assert cs["agent"] == container(find(base, "DaemonSet", "nodeplane-agent", NAMESPACE), "agent")
    # `kubectl logs` and `exec` still go to the agent.
    assert ds["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == "agent"
    reg = cs["node-driver-registrar"]
    image = reg["image"]
    assert image.startswith("registry.k8s.io/sig-storage/csi-node-driver-registrar:v"), image
    assert image in (DAEMONSET / "README.md").read_text(), f"daemonset/README.md does not name {image}"
    args = dict(a[2:].split("=", 1) for a in reg["args"])
    # The registrar tells kubelet the host path of the agent's CSI socket.
    assert args["kubelet-registration-path"] == get(agent_resolved, "csi.socket")
    mounts = {m["mountPath"]: m["name"] for m in reg["volumeMounts"]}
    vols = {v["name"]: v for v in pod_spec(ds)["volumes"]}
    csi_dir = vols[mounts[os.path.dirname(args["csi-address"])]]["hostPath"]["path"]
    assert os.path.join(csi_dir, os.path.basename(args["csi-address"])) == get(agent_resolved, "csi.socket")
    assert vols[mounts["/registration"]]["hostPath"]["path"] == os.path.dirname(get(agent_resolved, "csi.registrationSocket"))
    assert args["http-endpoint"].startswith("127.0.0.1:")
    assert reg["livenessProbe"]["httpGet"]["port"] == int(args["http-endpoint"].rsplit(":", 1)[1])
    # The agent's configuration: the base's, with self-registration off.
    b, o = json.loads(agent_json(base)), json.loads(agent_json(docs))
    assert o["csi"].pop("selfRegister") is False
    assert o == b
    resolved = check_config_json(AGENT_BIN, agent_json(docs), AGENT_ENV)
    assert get(resolved, "csi.selfRegister") is False and get(agent_resolved, "csi.selfRegister") is True


def test_agent_kubelet_paths(agent_resolved):
    """kubelet's device plugin directory does not follow its --root-dir: the agent names both,
    and the base expects kubelet to register what it serves."""
    assert get(agent_resolved, "kubeletDir") == "/var/lib/kubelet"
    assert get(agent_resolved, "devicePluginDir") == "/var/lib/kubelet/device-plugins"
    assert get(agent_resolved, "devicePlugins.pluginDir") == get(agent_resolved, "devicePluginDir")
    assert get(agent_resolved, "requireKubeletRegistration") is True


# ----------------------------------------------------------------- docs and the kind script

def test_readme_names_the_validated_version():
    text = (DAEMONSET / "README.md").read_text()
    major_minor = ".".join(K8S_VERSION.split(".")[:2])
    assert f"Kubernetes {major_minor}" in text
    deploy = find(render(DAEMONSET)[1], "Deployment", "nodeplane-controller", NAMESPACE)
    for c in containers(deploy)[1:]:
        assert c["image"] in text, f"daemonset/README.md does not name {c['image']}"


DRA = DAEMONSET / "dra"
# resource.k8s.io/v1 (DRA GA) exists from Kubernetes 1.34.
DRA_K8S_VERSION = "1.34.0"
DRA_DRIVER = "dra.nodeplane.dev"


def _dra_docs():
    text, docs = render(DRA)
    return text, docs + load_yaml_docs(DRA / "example-claim-pod.yaml")


def test_dra_manifests_validate_strict_against_1_34(tmp_path):
    import kubernetes_validate
    need_tool("kubernetes-validate")
    _, docs = _dra_docs()
    for d in docs:
        try:
            kubernetes_validate.validate(d, DRA_K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"daemonset/dra: {key(d)} is invalid for Kubernetes {DRA_K8S_VERSION}: {path}: {e.message}")
    # And they are not for 1.33 (no resource.k8s.io/v1 there): why they are not in the base.
    dc = find(docs, "DeviceClass", "nodeplane.dev")
    with pytest.raises((kubernetes_validate.SchemaNotFoundError, kubernetes_validate.ValidationError)):
        kubernetes_validate.validate(dc, K8S_VERSION, strict=True)


def test_dra_device_class_selects_the_driver_and_the_example_uses_it(base):
    _, docs = _dra_docs()
    dc = find(docs, "DeviceClass", "nodeplane.dev")
    (sel,) = dc["spec"]["selectors"]
    assert sel["cel"]["expression"] == f'device.driver == "{DRA_DRIVER}"'
    # The agents' registration and the controller's slices name the same driver.
    assert DRA_DRIVER in (REPO / "src/devices/dra.rs").read_text()
    rct = find(docs, "ResourceClaimTemplate", "one-acc", "default")
    (req,) = rct["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"]["deviceClassName"] == dc["metadata"]["name"]
    pod = find(docs, "Pod", "dra-example", "default")
    (rc,) = pod["spec"]["resourceClaims"]
    assert rc["resourceClaimTemplateName"] == rct["metadata"]["name"]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": rc["name"]}]
    # No DRA object in the base (a cluster before 1.34 must still apply it).
    assert not [key(d) for d in base if d.get("apiVersion", "").startswith("resource.k8s.io/")]
    # Only the controller may write ResourceSlices: no other role of the base grants it.
    for d in base:
        if d["kind"] in ("ClusterRole", "Role") and d["metadata"]["name"] != "nodeplane-controller":
            for r in d.get("rules", []):
                assert "resource.k8s.io" not in r.get("apiGroups", []), f"{key(d)} grants {r}"
