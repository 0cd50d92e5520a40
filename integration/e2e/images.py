"""The images the lane imports into every node's containerd, made without a registry.

- nodeplane's own image: `scripts/build-image --output docker-archive:…`, the image an
  operator deploys;
- the CSI sidecars: each upstream binary from K8S_BIN wrapped into an image named and tagged
  exactly as `daemonset/base/controller.yaml` names it, its entry point the binary (as
  upstream's images are), so the manifests run unchanged;
- the pause image containerd starts every pod sandbox from (a static `pause` built from
  pause.c here), and a busybox image for the test pods (Debian's busybox-static, with the
  TCP and UDP test server and client `np-echo` built from echo.c here).

The small images are written directly as docker archives (manifest.json, a config, one
layer): the format `ctr images import` reads, with the name in the archive.
"""

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from cluster import BUSYBOX_IMAGE, PAUSE_IMAGE, REPO, SIDECARS, Fail, log, run

HERE = Path(__file__).resolve().parent


def layer(entries):
    """An uncompressed layer tar of `entries`: (path, kind, data, mode) with kind 'file',
    'dir' or 'symlink' (data: bytes, None, or the link target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for path, kind, data, mode in entries:
            info = tarfile.TarInfo(path)
            info.mtime = 0
            info.mode = mode
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            elif kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = data
                t.addfile(info)
            else:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def docker_archive(out, name, entries, entrypoint, env=()):
    """Write a one-layer docker archive of `entries` tagged `name`."""
    blob = layer(entries)
    diff_id = "sha256:" + hashlib.sha256(blob).hexdigest()
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin", *env]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "nodeplane e2e lane (integration/e2e/images.py)"}],
    }
    cfg = json.dumps(config, sort_keys=True).encode()
    cfg_name = hashlib.sha256(cfg).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cfg_name, "RepoTags": [name], "Layers": ["layer.tar"]}]).encode()
    tmp = Path(str(out) + ".tmp")
    with tarfile.open(tmp, "w") as t:
        for member, data in (("layer.tar", blob), (cfg_name, cfg), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(data))
    tmp.replace(out)
    return out


def base_dirs():
    return [(d, "dir", None, 0o755) for d in ("bin", "etc", "tmp", "dev", "proc", "sys", "run", "var")] + [
        ("tmp", "dir", None, 0o1777),
        ("etc/passwd", "file", b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n", 0o644),
        ("etc/group", "file", b"root:x:0:\nnogroup:x:65534:\n", 0o644),
    ]


def pause_image(out, work):
    binary = work / "pause"
    run(["gcc", "-static", "-Os", "-s", "-o", binary, HERE / "pause.c"])
    return docker_archive(out, PAUSE_IMAGE, [("pause", "file", binary.read_bytes(), 0o755)], ["/pause"])


def busybox_image(out, work):
    """Debian's busybox-static, and np-echo (echo.c): a TCP and UDP server and client."""
    bb = Path("/bin/busybox")
    echo = work / "np-echo"
    run(["gcc", "-static", "-O2", "-s", "-o", echo, HERE / "echo.c", "-lpthread"])
    applets = subprocess.run([bb, "--list"], capture_output=True, text=True, check=True).stdout.split()
    entries = base_dirs() + [("bin/busybox", "file", bb.read_bytes(), 0o755),
                             ("bin/np-echo", "file", echo.read_bytes(), 0o755)]
    entries += [(f"bin/{a}", "symlink", "busybox", 0o777) for a in applets if a != "busybox"]
    return docker_archive(out, BUSYBOX_IMAGE, entries, ["/bin/sh"])


def sidecar_image(out, name, kbin):
    data = (Path(kbin) / name).read_bytes()
    entries = base_dirs() + [(name, "file", data, 0o755)]
    return docker_archive(out, SIDECARS[name], entries, [f"/{name}"])


def nodeplane_image(out):
    """The product's image, built as an operator builds it (scripts/build-image)."""
    r = run([REPO / "scripts" / "build-image", "--no-cargo-build", "--output", f"docker-archive:{out}"],
            check=False, timeout=1800)
    if r.returncode != 0:
        raise Fail(f"scripts/build-image failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return out


def build_all(work, kbin):
    """Every archive the nodes import, newest binaries each time (a few seconds but the
    product's image, whose base is cached by scripts/build-image)."""
    d = Path(work) / "images"
    d.mkdir(parents=True, exist_ok=True)
    out = [pause_image(d / "pause.tar", d), busybox_image(d / "busybox.tar", d)]
    out += [sidecar_image(d / f"{n}.tar", n, kbin) for n in SIDECARS]
    log("building nodeplane's image (scripts/build-image)")
    out.append(nodeplane_image(d / "nodeplane.tar"))
    return out
