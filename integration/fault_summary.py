"""Print the fault suite's records (NODEPLANE_FAULT_REPORT, one JSON object per line, written by
harness.fault_report) as a table: what each case injected, what it found, its figures."""

import json
import sys


def main(path):
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        print(f"no fault records in {path}")
        return 0
    print(f"\n== fault suite: {len(lines)} cases ({path})")
    for line in lines:
        r = json.loads(line)
        print(f"\n-- {r['case']}\n   injected: {r['injected']}\n   found:    {r['found']}")
        if r.get("figures"):
            print(f"   figures:  {json.dumps(r['figures'], sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
