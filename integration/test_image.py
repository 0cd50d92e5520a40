"""The container image (Containerfile, scripts/build-image).

Builds the image with scripts/build-image (the first run on a machine debootstraps the base
from deb.debian.org: a minute or two; later runs reuse the cached base and take seconds), then
checks it with podman, every container on `--network none`:

- the three programs an operator runs report the Cargo version; the tags and labels are right;
- every tool the agent executes is there, runs, and does the agent's job on a sparse file
  (mkfs.ext4, blkid, e2fsck, resize2fs, mkfs.xfs), with the agent's own argument vectors;
- the agent started from the image, with no shimSource, installs the shim it carries into a
  host directory mounted as the CNI bin dir, writes the conflist, programs its nftables table
  (in the container's own network namespace) and stops cleanly on SIGTERM.

Needs root and podman: without them it fails, it never skips.
"""

import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "scripts" / "build-image"
IMAGE_REPO = "localhost/nodeplane"
VERSION = tomllib.loads((REPO / "Cargo.toml").read_text())["package"]["version"]
IMAGE = f"{IMAGE_REPO}:{VERSION}"
# The shim sits next to the agent: the agent's default shimSource (src/agent/config.rs).
SHIM_IN_IMAGE = "/usr/local/bin/nodeplane-cni"
# Lowered ulimits: podman's defaults for root need CAP_SYS_RESOURCE, which root lacks here.
RUN = ["podman", "run", "--rm", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]

# A cold build (debootstrap) takes minutes; the suite's default per-test timeout is 300 s.
pytestmark = pytest.mark.timeout(1800)


def sh(args, check=True, timeout=120, **kw):
    p = subprocess.run(args, capture_output=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, args))}: exit {p.returncode}\n"
            f"stdout: {p.stdout.decode(errors='replace')[-3000:]}\nstderr: {p.stderr.decode(errors='replace')[-3000:]}"
        )
    return p


def in_image(*args, volumes=(), check=True):
    """Run `args` in the image; returns the CompletedProcess (text)."""
    vol = [x for v in volumes for x in ("--volume", v)]
    p = sh([*RUN, *vol, IMAGE, *args], check=check)
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(), p.stderr.decode())


@pytest.fixture(scope="module")
def image():
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: the image tests need it (scripts/install-deps installs it)")
    if os.geteuid() != 0:
        pytest.fail("the image tests need root (debootstrap, podman's system storage)")
    start = time.monotonic()
    p = subprocess.run([str(BUILD)], cwd=REPO, capture_output=True, text=True, timeout=1700)
    took = time.monotonic() - start
    if p.returncode != 0:
        pytest.fail(f"scripts/build-image failed (exit {p.returncode}) after {took:.0f}s:\n{p.stderr[-4000:]}\n{p.stdout[-2000:]}")
    print(f"scripts/build-image: {took:.1f}s\n{p.stdout}")
    return json.loads(sh(["podman", "image", "inspect", IMAGE]).stdout)[0]


@pytest.mark.parametrize("program", ["nodeplane-agent", "nodeplane-controller", "nodeplane"])
def test_programs_report_the_cargo_version(image, program):
    out = in_image(program, "--version")
    assert out.stdout.strip() == f"{program} {VERSION}", out


def test_tags_and_labels(image):
    head = sh(["git", "rev-parse", "HEAD"], cwd=REPO).stdout.decode().strip()
    short = sh(["git", "rev-parse", "--short", "HEAD"], cwd=REPO).stdout.decode().strip()
    tags = set(image["RepoTags"])
    assert IMAGE in tags
    # The commit tag: <short sha>, or <short sha>-dirty when built from a tree with changes.
    sha_tags = {f"{IMAGE_REPO}:{short}", f"{IMAGE_REPO}:{short}-dirty"} & tags
    assert sha_tags, f"no {IMAGE_REPO}:{short}[-dirty] tag among {sorted(tags)}"
    for t in sha_tags:
        assert sh(["podman", "image", "inspect", "--format", "{{.Id}}", t]).stdout.decode().strip() == image["Id"]
    labels = image["Labels"]
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.revision"] == head
    assert "org.opencontainers.image.source" in labels
    assert labels["org.opencontainers.image.base.name"].startswith("localhost/nodeplane-base:bookworm-")
    # No entrypoint: the manifests name the program with `command:`.
    assert not image["Config"].get("Entrypoint")
    assert image["Config"]["Cmd"] == ["/usr/local/bin/nodeplane-agent", "--help"]
    # The binaries are staged on their own: no source tree, no target/ in the image.
    assert in_image("ls", "/usr/local/bin").stdout.split() == sorted(
        ["nodeplane", "nodeplane-agent", "nodeplane-cni", "nodeplane-controller"]
    )


def test_shim_is_where_the_agent_looks_for_it(image):
    out = in_image("stat", "-c", "%a %F", SHIM_IN_IMAGE)
    assert out.stdout.strip() == "755 regular file"
    # It is the shim: answers VERSION by itself (no agent needed for that command).
    p = sh([*RUN, "--env", "CNI_COMMAND=VERSION", "-i", IMAGE, SHIM_IN_IMAGE], input=b'{"cniVersion":"1.0.0"}')
    assert "1.1.0" in json.loads(p.stdout)["supportedVersions"]


# (tool and arguments, what its output starts with): the version of every tool the agent runs.
TOOLS = [
    (["mkfs.ext4", "-V"], "mke2fs 1.47"),
    (["e2fsck", "-V"], "e2fsck 1.47"),
    (["mkfs.xfs", "-V"], "mkfs.xfs version 6."),
    (["xfs_growfs", "-V"], "xfs_growfs version 6."),
    (["blkid", "-V"], "blkid from util-linux"),
    (["nft", "--version"], "nftables v1."),
    (["conntrack", "--version"], "conntrack v1."),
]


@pytest.mark.parametrize("tool,expect", TOOLS, ids=[t[0][0] for t in TOOLS])
def test_agent_tools_run(image, tool, expect):
    out = in_image(*tool)
    text = (out.stdout + out.stderr).strip()
    assert text.startswith(expect), text


def ext4_size(path):
    """Bytes the ext4 filesystem in `path` spans, from its superblock (at byte 1024)."""
    with open(path, "rb") as f:
        f.seek(1024)
        sb = f.read(1024)
    assert struct.unpack_from("<H", sb, 0x38)[0] == 0xEF53, "no ext4 superblock"
    blocks_lo, log_block = struct.unpack_from("<I", sb, 4)[0], struct.unpack_from("<I", sb, 24)[0]
    blocks_hi = struct.unpack_from("<I", sb, 0x150)[0]
    return ((blocks_hi << 32) | blocks_lo) * (1024 << log_block)


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="np-image-test-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_filesystem_tools_do_the_agents_work(image, workdir):
    """The argument vectors of src/sys/fstools.rs, on sparse files (no loop device needed)."""
    vol = [f"{workdir}:/vol"]
    ext4, xfs = workdir / "ext4.img", workdir / "xfs.img"
    with open(ext4, "wb") as f:
        f.truncate(64 << 20)
    with open(xfs, "wb") as f:
        f.truncate(320 << 20)  # mkfs.xfs 6.x wants at least 300 MiB

    blkid = ["blkid", "-p", "-o", "value", "-s", "TYPE"]
    assert in_image(*blkid, "/vol/ext4.img", volumes=vol, check=False).returncode == 2  # blank: nothing found

    in_image("mkfs.ext4", "-F", "-q", "/vol/ext4.img", volumes=vol)
    assert in_image(*blkid, "/vol/ext4.img", volumes=vol).stdout.strip() == "ext4"
    assert ext4_size(ext4) == 64 << 20
    with open(ext4, "r+b") as f:
        f.truncate(128 << 20)
    fsck = in_image("e2fsck", "-f", "-p", "/vol/ext4.img", volumes=vol, check=False)
    assert fsck.returncode in (0, 1), fsck
    in_image("resize2fs", "/vol/ext4.img", volumes=vol)
    assert ext4_size(ext4) == 128 << 20

    in_image("mkfs.xfs", "-f", "-q", "/vol/xfs.img", volumes=vol)
    assert in_image(*blkid, "/vol/xfs.img", volumes=vol).stdout.strip() == "xfs"


def test_agent_from_the_image_installs_the_shim(image, workdir):
    """The agent, as the DaemonSet runs it: host CNI dirs mounted, shimSource left to its default."""
    for d in ("cfg", "opt-cni-bin", "etc-cni-net.d"):
        (workdir / d).mkdir()
    block = "10.244.250.0/24"
    (workdir / "cfg" / "agent.json").write_text(
        json.dumps({"nodeName": "image-test", "podCidrs": [block], "csi": {"enabled": False}})
    )
    name = f"nodeplane-image-test-{os.getpid()}"
    conflist = workdir / "etc-cni-net.d" / "10-nodeplane.conflist"
    shim = workdir / "opt-cni-bin" / "nodeplane"
    try:
        sh([
            "podman", "run", "--detach", "--name", name, "--network", "none",
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
            # The agent makes its bridge, forwarding sysctls and nftables table: all in the
            # container's own network namespace (never the host's).
            "--cap-add", "NET_ADMIN", "--security-opt", "unmask=/proc/sys",
            "--volume", f"{workdir / 'cfg'}:/etc/nodeplane:ro",
            "--volume", f"{workdir / 'opt-cni-bin'}:/opt/cni/bin",
            "--volume", f"{workdir / 'etc-cni-net.d'}:/etc/cni/net.d",
            IMAGE, "nodeplane-agent", "--config", "/etc/nodeplane/agent.json",
        ])
        deadline = time.monotonic() + 30
        while not conflist.exists():
            state = sh(["podman", "inspect", "--format", "{{.State.Status}}", name]).stdout.decode().strip()
            logs = lambda: sh(["podman", "logs", name], check=False).stderr.decode()  # noqa: E731
            assert state == "running", f"agent container {state}:\n{logs()}"
            assert time.monotonic() < deadline, f"agent wrote no conflist in 30 s:\n{logs()}"
            time.sleep(0.1)

        carried = sh(["podman", "exec", name, "cat", SHIM_IN_IMAGE]).stdout
        assert shim.read_bytes() == carried
        assert os.stat(shim).st_mode & 0o777 == 0o755
        # The installed shim runs on the host (same glibc as the image).
        v = sh([str(shim)], input=b'{"cniVersion":"1.0.0"}', env={"CNI_COMMAND": "VERSION"})
        assert "1.1.0" in json.loads(v.stdout)["supportedVersions"]
        assert json.loads(conflist.read_text())["plugins"][0]["type"] == "nodeplane"

        rules = sh(["podman", "exec", name, "nft", "list", "table", "inet", "nodeplane"]).stdout.decode()
        assert f"ip saddr {block}" in rules and "masquerade" in rules, rules

        sh(["podman", "stop", "--time", "10", name])
        assert sh(["podman", "inspect", "--format", "{{.State.ExitCode}}", name]).stdout.decode().strip() == "0"
    finally:
        sh(["podman", "rm", "--force", "--time", "0", name], check=False)
