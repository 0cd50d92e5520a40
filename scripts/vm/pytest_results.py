"""pytest plugin of the VM lane (scripts/vm-test): every test phase's outcome, one JSON line
each (nodeid, when, outcome, duration in seconds), appended to the file named by NODEPLANE_VM_RESULTS as it happens,
so a guest that hangs or dies still leaves the record of what ran before."""

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("NODEPLANE_VM_RESULTS")
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "duration": round(report.duration, 2)}) + "\n")
