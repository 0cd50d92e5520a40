#!/usr/bin/env python3
"""The VM lane's test lists (scripts/vm-test): which tests run in the guest, and whether every
one of them ran and passed.

    lane.py select --suite BIN --set ci|full --out DIR [FILTER...]
        the set's tests whose id contains any FILTER (all of them without one), split between
        two guests that run at once: for each guest with a test, DIR/GUEST/cargo-tests (exact
        names in the suite binary) and DIR/GUEST/pytest-tests (pytest node ids). Fails when
        the selection is empty.
    lane.py check --dir DIR
        compares what the guest reported in DIR (cargo.log, pytest-results.jsonl) with the two
        lists: prints every failed, skipped, missing or unexpected test and the counts; exits
        1 unless every expected test ran and passed.

What runs is what depends on the kernel: rtnetlink, veth, bridges, routes, VXLAN, nftables
(the datapath, cross-node routes, NetworkPolicy), loop devices, mounts, ext4/xfs and reflink
(the volume store, CSI), device-mapper thin pools (the lvm backend), inotify and device nodes (device plugins, DRA). What does not
(the controller's gRPC and Kubernetes modes, manifests, the shim's parsing, metrics) stays on
the host lane (scripts/test).
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The suite binary's root modules (tests/suite.rs): every one talks to the kernel.
CARGO_FULL = [
    "netlink_root::", "routes_root::", "volume_root::", "csi_root::", "deviceplugin_root::",
    "deviceplugin_kubelet_root::", "deviceplugin_restart_root::", "dra_root::", "lvm_root::",
    "crypt_root::", "wireguard_root::",
]
# Not here: fuzz_inputs' root half (agent_requests_root, agent_oversized_grpc_requests_root).
# It asserts answer times fit for the host (Allocate of 100,000 IDs within 3 s) that software
# emulation misses by 2x on every kernel; the kernel calls it makes are csi_root's and
# deviceplugin_root's.
# Left out of the full set: two tests whose assertion is a latency bound of the host (every
# resource registered with a restarted kubelet within 1 s, over 40 and 100 rounds). Under
# TCG, with other guests or builds on the same cores, rounds miss it (5.10, 6.1 and 6.12
# all did on 2026-12-05, three guests at once on two cores). Their kernel surface (inotify
# on the plugin directory, Unix sockets) is the rest of deviceplugin_kubelet_root's, and
# the host lane runs them.
CARGO_FULL_EXCLUDE = [
    "deviceplugin_kubelet_root::device_plugin_dir_removal_recovers_every_resource_within_1s",
    "deviceplugin_kubelet_root::hundred_rounds_of_kubelet_restarts_dir_removal_and_stale_sockets",
]
# CI (6.1 on every change): the modules whose kernel surface changes between kernels: the
# agent's own rtnetlink requests, VXLAN and routes, loop devices (LOOP_CONFIGURE, resizing),
# mounts (openat2, move_mount), ext4/xfs and the CSI node plugin over them. The device plugins
# use inotify, Unix sockets and mknod'd nodes, unchanged since long before 5.10: --set full.
# LVM thin pools and dm-crypt (device-mapper): only here, the host's kernel has none.
# WireGuard's generic netlink family: only here too.
CARGO_CI = [
    "netlink_root::", "routes_root::", "volume_root::", "csi_root::", "lvm_root::", "crypt_root::",
    "wireguard_root::",
]
# volume_root's and csi_root's suites on the lvm backend (their `lvm::` modules, which
# scripts/test skips on the host): --set full runs all 24. CI runs csi_root's conformance
# specs on lvm; the others cost about 8 min under TCG (each makes its own volume group), and
# lvm_root and crypt_root already take the backend through its lifecycle in CI.
CARGO_CI_LVM = ["csi_root::lvm::conformance_"]

PYTEST_FULL = [
    "integration/test_datapath.py",          # veth, bridge, addresses, routes, masquerade
    "integration/test_lifecycle.py",         # DEL/CHECK/GC against kernel state, reaper
    "integration/test_netns_descriptor.py",  # namespaces passed by descriptor (setns, nsfs)
    "integration/test_chaining.py",          # portmap (iptables) and bandwidth (tc) after us
    "integration/test_cluster.py",           # direct routes and VXLAN between nodes
    "integration/test_provisioning.py",      # loop devices, mkfs, mounts, online expansion
    "integration/test_snapshots.py",         # reflink on xfs, FIFREEZE, sparse copies
    "integration/test_encryption.py",        # WireGuard between nodes (not in the host's kernel)
    # The namespace cookie (SO_NETNS_COOKIE) and rollbacks of half-done kernel work.
    "integration/test_robustness.py::test_same_inode_new_namespace_is_told_apart_by_cookie",
    "integration/test_robustness.py::test_crash_mid_add_is_rolled_back",
    "integration/test_robustness.py::test_crash_mid_del_is_completed",
    # NetworkPolicy on one node (pods on one bridge: br_netfilter, the bridge family), one
    # scenario per family of kernel objects the rules use; the others vary the controller's
    # compilation (selector semantics, unions, updates) over the same objects, and each
    # scenario costs 576 probes, a process each, twice (the baseline and the scenario).
    # Routing to the pods of other nodes (direct, VXLAN) is test_cluster's.
    *(f"integration/test_netpol.py::{t}[one-node]" for t in [
        "test_default_deny_ingress",                    # isolation: the ingress dispatch map
        "test_default_deny_egress",                     # isolation: the egress dispatch map
        "test_namespace_and_pod_selector_in_one_peer",  # peer address sets
        "test_ip_block_with_except",                    # interval sets with holes
        "test_named_ports",                             # addr . proto . port concatenations
        "test_sctp_rules_and_no_protocol_confusion",    # SCTP rules
        "test_rules_leave_with_the_pods_and_policies",  # nothing left in the kernel after deletes
    ]),
]
# Left out of the full set: tests whose subject is the controller, its gRPC or IPAM, not the
# kernel (the agents' kernel work in them is the kept tests'), and two whose assertion is a
# latency bound of the host (routes to a joining node, and a removed node's routes gone,
# within 1 s: 3.6 s and 6.2 s under TCG on 5.10; their kernel work is test_cluster's other
# tests' and routes_root's).
PYTEST_FULL_EXCLUDE = [
    "test_cluster.py::test_node_joins_later",
    "test_cluster.py::test_node_removed_routes_go_and_blocks_return",
    "test_cluster.py::test_controller_kill9_restart_keeps_blocks",
    "test_cluster.py::test_controller_down_nodes_keep_serving",
    "test_cluster.py::test_agent_with_bad_credentials_is_rejected",
    "test_cluster.py::test_rejected_agent_logs_the_grpc_code",
    "test_cluster.py::test_agents_reach_the_controller_only_over_verified_tls",
    "test_provisioning.py::test_topology_requisite_and_preferred",
    "test_provisioning.py::test_capacity_drops_and_frees",
    "test_provisioning.py::test_concurrent_creates_give_one_volume_per_name",
    "test_provisioning.py::test_controller_kill9_during_creates_and_deletes",
    "test_provisioning.py::test_offline_node_answers_unavailable",
    "test_provisioning.py::test_conformance_controller_rpcs",
    "test_snapshots.py::test_snapshot_rpcs_answer_every_error_and_are_idempotent",
]
# CI: one test per kernel feature family above, chosen among the cheap ones (TCG makes every
# process start 25-50x dearer; the netpol matrix starts hundreds per scenario). Pods on two
# nodes, over direct routes and over VXLAN: test_encryption's (test_cluster's three-node
# checks cost 135 s more and run in the full set).
PYTEST_CI = [
    "integration/test_datapath.py",
    "integration/test_netns_descriptor.py",
    # Isolation through the ingress dispatch map, port rules, SCTP (not in the host's kernel).
    "integration/test_netpol.py::test_sctp_rules_and_no_protocol_confusion[one-node]",
    "integration/test_lifecycle.py::test_del_removes_lease_veth_pod_interface_and_keeps_nft",
    "integration/test_provisioning.py::test_end_to_end_with_the_node_service",
    # FIFREEZE and reflink on xfs (the ext4 case, a sparse copy: the host's and the full set's).
    "integration/test_snapshots.py::test_snapshot_restore_and_clone_are_point_in_time_copies[xfs-reflink-xfs]",
    # WireGuard: only here (the host's kernel has none).
    "integration/test_encryption.py",
]

SETS = {"ci": (CARGO_CI, PYTEST_CI), "full": (CARGO_FULL, PYTEST_FULL)}

# The two guests scripts/vm-test runs at once (under TCG one host core each): the
# device-mapper tests (LVM thin pools, dm-crypt), about half of either set's time, and the rest.
DEVMAPPER = ("lvm_root::", "crypt_root::")


def devmapper(test):
    return test.startswith(DEVMAPPER) or "::lvm::" in test


def cargo_list(suite):
    """The suite's tests, less the #[ignore]d ones (helpers other tests run as children)."""
    def listed(*extra):
        out = subprocess.run([suite, "--list", *extra], capture_output=True, text=True, check=True).stdout
        return [l[: -len(": test")] for l in out.splitlines() if l.endswith(": test")]
    ignored = set(listed("--ignored"))
    return [t for t in listed() if t not in ignored]


def pytest_collect(args):
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args],
                       cwd=REPO, capture_output=True, text=True)
    ids = [l for l in p.stdout.splitlines() if "::" in l and not l.startswith(" ")]
    if p.returncode != 0:
        sys.exit(f"lane.py: pytest could not collect {args}:\n{p.stdout}{p.stderr}")
    return ids


def select(args):
    cargo_mods, pytest_args = SETS[args.set]
    cargo = [t for t in cargo_list(args.suite) if any(t.startswith(m) for m in cargo_mods)]
    # Each prefix must name something: a renamed module or test must not vanish silently.
    for m in cargo_mods:
        if not any(t.startswith(m) for t in cargo):
            sys.exit(f"lane.py: no test of the suite binary starts with {m!r}: update scripts/vm/lane.py")
    py = pytest_collect(pytest_args)
    py = [t for t in py if not any(x in t for x in PYTEST_FULL_EXCLUDE)]
    if args.set == "full":
        cargo = [t for t in cargo if t not in CARGO_FULL_EXCLUDE]
    else:
        cargo = [t for t in cargo if "::lvm::" not in t or any(t.startswith(k) for k in CARGO_CI_LVM)]
    for a in pytest_args:
        if not any(t == a or t.startswith(a + "::") or t.startswith(a + "[") for t in py):
            sys.exit(f"lane.py: pytest collected nothing for {a!r}: update scripts/vm/lane.py")
    if args.filters:
        cargo = [t for t in cargo if any(f in t for f in args.filters)]
        py = [t for t in py if any(f in t for f in args.filters)]
        if not cargo and not py:
            sys.exit(f"lane.py: no test of the {args.set} set matches {args.filters}")
    guests = {
        "devmapper": ([t for t in cargo if devmapper(t)], []),
        "other": ([t for t in cargo if not devmapper(t)], py),
    }
    for name, (c, p) in guests.items():
        if c or p:
            d = args.out / name
            d.mkdir(parents=True, exist_ok=True)
            (d / "cargo-tests").write_text("".join(t + "\n" for t in c))
            (d / "pytest-tests").write_text("".join(t + "\n" for t in p))
    print(f"{len(cargo)} cargo tests, {len(py)} pytest tests")


LIBTEST = re.compile(r"^test (\S+) \.\.\. (ok|FAILED|ignored)")


def cargo_results(d):
    """{name: "passed"|"failed"|"skipped"} from libtest's output."""
    got = {}
    log = d / "cargo.log"
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            m = LIBTEST.match(line)
            if m:
                got[m[1]] = {"ok": "passed", "FAILED": "failed", "ignored": "skipped"}[m[2]]
    return got


def pytest_results(d):
    """{node id: outcome} from the guest's pytest plugin (scripts/vm/pytest_results.py): a test
    fails when any phase (setup, call, teardown) failed; passes when its call passed."""
    got = {}
    f = d / "pytest-results.jsonl"
    if f.exists():
        for line in f.read_text().splitlines():
            r = json.loads(line)
            old = got.get(r["nodeid"])
            if r["outcome"] == "failed" or old == "failed":
                got[r["nodeid"]] = "failed"
            elif r["outcome"] == "skipped":
                got[r["nodeid"]] = "skipped"
            elif r["when"] == "call":
                got[r["nodeid"]] = "passed"
    return got


def compare(kind, expected, got, rc):
    """Print what is wrong for one runner; the counts (passed, bad)."""
    bad = []
    for t in expected:
        o = got.get(t)
        if o != "passed":
            bad.append(f"{kind} {o or 'did not run'}: {t}")
    for t in sorted(set(got) - set(expected)):
        bad.append(f"{kind} ran but was not asked for: {t}")
    passed = sum(1 for t in expected if got.get(t) == "passed")
    if expected and rc is None:
        bad.append(f"{kind}: the runner never finished (no exit status)")
    elif expected and rc != 0 and not bad:
        bad.append(f"{kind}: the runner exited {rc} although every test passed")
    for b in bad:
        print("  " + b)
    return passed, len(bad)


def read_rc(path):
    return int(path.read_text()) if path.exists() else None


def check(args):
    d = args.dir
    want_cargo = (d / "cargo-tests").read_text().split("\n")[:-1]
    want_py = (d / "pytest-tests").read_text().split("\n")[:-1]
    cp, cb = compare("cargo", want_cargo, cargo_results(d), read_rc(d / "cargo.rc"))
    pp, pb = compare("pytest", want_py, pytest_results(d), read_rc(d / "pytest.rc"))
    stage = (d / "stage").read_text().strip() if (d / "stage").exists() else "none"
    if stage != "done":
        print(f"  the guest stopped at step {stage!r}, not 'done'")
    total = len(want_cargo) + len(want_py)
    failed = total - cp - pp
    (d / "summary").write_text(f"{cp + pp} {failed} {total}\n")
    print(f"  cargo {cp}/{len(want_cargo)} passed, pytest {pp}/{len(want_py)} passed")
    return 0 if cb == 0 and pb == 0 and stage == "done" else 1


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select")
    s.add_argument("--suite", required=True)
    s.add_argument("--set", choices=sorted(SETS), required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("filters", nargs="*")
    c = sub.add_parser("check")
    c.add_argument("--dir", type=Path, required=True)
    args = p.parse_args()
    sys.exit(select(args) if args.cmd == "select" else check(args))


if __name__ == "__main__":
    main()
