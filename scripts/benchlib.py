"""What the Python benchmarks (scripts/bench*) share: their failure kinds and figures, the
prerequisites check, and the run that reports a failure and removes everything it made, also
on a signal. Importing it puts integration/ (the test harness they drive) on the path."""

import json
import math
import os
import re
import shutil
import signal
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "integration"))
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Failure(Exception):
    """A functional failure (exit 1)."""


class Interrupted(BaseException):
    pass


def ms(x):
    return x * 1000.0


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def pctl(xs, q):
    """Nearest rank: the smallest value with a share `q` of the values at or below it."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def pct(xs, q):
    """The value at the rounded position q * (n - 1)."""
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def strip_ansi(s):
    return re.sub(r"\x1b\[[0-9;]*m", "", s)


def cannot_run(name, bins, tools, more=()):
    """Whether `name` cannot run (not root, a binary or a tool missing, `more`); prints why."""
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (creates network namespaces)")
    for b in bins:
        if not b.exists():
            problems.append(f"{b} is missing: run `cargo build --release` and scripts/build-shim first")
    problems += more
    for tool in tools:
        if shutil.which(tool) is None:
            problems.append(f"{tool} is not installed")
    if problems:
        print(f"{name}: cannot run:\n  " + "\n  ".join(problems), file=sys.stderr)
    return bool(problems)


def run(name, body, cleanup, json_out=False):
    """Runs `body()` (which returns the summary) with SIGINT, SIGTERM and SIGHUP raising
    Interrupted. Whatever happens, `cleanup(failed)` runs then (signals ignored), and whatever
    of ours a signal left half-made (names carry our PID: only ours) is removed. Exit status:
    1 with the failure printed, else 0 (the summary printed as JSON with `json_out`)."""
    import harness

    def on_signal(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    for s in SIGNALS:
        signal.signal(s, on_signal)
    failed = summary = None
    try:
        summary = body()
    except Failure as e:
        failed = str(e)
    except Interrupted as e:
        failed = f"interrupted by {e}"
    except Exception as e:  # noqa: BLE001 - report, clean up, exit 1
        traceback.print_exc()
        failed = f"{type(e).__name__}: {e}"
    finally:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        cleanup(failed)
        for ns in os.listdir("/var/run/netns") if os.path.isdir("/var/run/netns") else []:
            if ns.startswith(harness.RUN_PREFIX):
                harness.run(["ip", "netns", "delete", ns], check=False)
        for tmp in os.listdir("/tmp"):
            if tmp.startswith(harness.RUN_PREFIX):
                shutil.rmtree(Path("/tmp") / tmp, ignore_errors=True)
    if failed:
        print(f"{name}: FAILED: {failed}", file=sys.stderr)
        return 1
    if json_out:
        print(json.dumps(summary, indent=2))
    return 0
