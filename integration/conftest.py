"""Fixtures for the root integration tests. These tests need root and the packages that
`scripts/test` installs; when either is missing they fail loudly, they never skip."""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# The real-cluster lane's checks run against a cluster `scripts/e2e up` made, by `scripts/e2e
# test`, not in this suite.
collect_ignore = ["e2e"]


def pytest_sessionstart(session):
    problems = []
    if os.geteuid() != 0:
        problems.append("integration tests must run as root (they create network namespaces)")
    for b in (harness.AGENT_BIN, harness.SHIM_BIN):
        if not b.exists():
            problems.append(f"{b} is missing: run `cargo build --release` and scripts/build-shim first")
    for tool in ("ip", "nsenter", "nft", "ping"):
        if shutil.which(tool) is None:
            problems.append(f"{tool} is not installed")
    if problems:
        pytest.exit("cannot run integration tests:\n  " + "\n  ".join(problems), returncode=2)
    harness.sweep_leftovers()


@pytest.fixture
def node():
    n = harness.Node()
    try:
        yield n
    finally:
        n.cleanup()


@pytest.fixture
def make_node():
    made = []

    def make(**kw):
        n = harness.Node(**kw)
        made.append(n)
        return n

    try:
        yield make
    finally:
        for n in made:
            n.cleanup()
