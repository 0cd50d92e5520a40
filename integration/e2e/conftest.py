"""The end-to-end checks run against the cluster `scripts/e2e up` made (its state file);
they never bring one up themselves and fail, never skip, when there is none."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster  # noqa: E402
import kube  # noqa: E402


def pytest_sessionstart(session):
    st = cluster.load_state()
    if not st.get("nodes"):
        pytest.exit(f"no cluster: {cluster.STATE} is missing; run `scripts/e2e up` first", returncode=2)


@pytest.fixture(scope="module")
def ns(request):
    """A namespace of the module's own, deleted (with everything in it) afterwards."""
    name = "e2e-" + Path(request.module.__file__).stem.split("_", 2)[-1].replace("_", "-")
    kube.namespace(name)
    yield name
    if os.environ.get("NODEPLANE_E2E_KEEP") != "1":  # kept for a look after a failure
        kube.delete("namespace", name, timeout=180)


@pytest.fixture(scope="session")
def workers():
    return [n["name"] for n in cluster.load_state()["nodes"]]
