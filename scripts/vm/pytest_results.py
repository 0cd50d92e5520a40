"""pytest plugin of the VM lane (scripts/vm-test): every test phase's outcome, one JSON line
each (nodeid, when, outcome, duration in seconds; the end of
the report of a failure), appended to the file named by NODEPLANE_VM_RESULTS as it happens,
so a guest that hangs or dies still leaves the record of what ran before."""

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("NODEPLANE_VM_RESULTS")
    if not path:
        return
    rec = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "duration": round(report.duration, 2)}
    if report.failed:
        # The end of the failure's report, readable while the guest still runs.
        rec["error"] = report.longreprtext[-3000:]
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
