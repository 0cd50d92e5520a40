"""Fault suite, network part (issue #8): a local cluster (one controller, simulated nodes, each
its own network namespace with its own agent; pods are namespaces attached through the real
shim) is hit by the faults a node agent meets in production, and afterwards the real state is
compared with what the runtime was told:

1. agent `kill -9` on different nodes at random points of a 200-pod ADD/DEL storm, the calls
   retried like a runtime does: no leaked address, veth or nftables rule; every survivor pings
   pods on the other nodes and its gateway;
2. a simulated node reboot (pod namespaces, runtime dir and the agent's kernel state gone, boot
   id changed): the agent frees every stale lease by itself, keeps its blocks, routes come back;
3. controller `kill -9` during registrations of new and re-registering agents, several rounds:
   no block held twice, every agent's blocks are the controller's record, routes and pings.

Every figure comes from real state: lease files, links in the node namespaces (`ip -j`), the
nftables ruleset, the controller's node list, the agents' persisted `cluster.json`, ICMP.
Each case reports through `harness.fault_report`. `NP_FAULT_SEED` fixes the random choices.
"""

import concurrent.futures as cf
import ipaddress
import json
import os
import random
import re
import shutil
import threading
import time

import harness
from harness import run
from test_cluster import (make_cluster, wait_routes, cluster_state, our_routes, assert_no_block_twice,  # noqa: F401
                          in_block, clean_log)
from test_robustness import host_ifname, HOST_VETH_RE, norm_ips, result_ips, start_agent, log_since

BRIDGE = "np0"
VXLAN_DEV = "np.vxlan"
PROTO = "78"
AGENT_WAIT = 10  # agentWaitSeconds in the storm's network config: ADDs wait for a restarting agent


def direct(*_):
    return "direct"  # every node of these clusters shares one dual-stack underlay segment


def seed_of():
    return int(os.environ.get("NP_FAULT_SEED", time.time_ns() % 2**32))


def nsrun(ns, args, check=True, **kw):
    """Run a command inside a namespace (nsenter is cheaper than `ip netns exec`)."""
    return run(["nsenter", f"--net={ns.path}", *args], check=check, **kw)


def ping(ns, ip, deadline=4):
    """One echo reply from `ip` within `deadline` seconds (re-sent every 0.2 s)."""
    r = nsrun(ns, ["ping", "-n", "-q", "-c", "1", "-i", "0.2", "-w", str(deadline), ip], check=False)
    return r.returncode == 0


def nft_ruleset(node):
    """The ruleset, table by table in name order (the order tables were made in is not part
    of the state), less the anti-spoofing set's elements (one per live pod address: see
    spoof_elements)."""
    out = nsrun(node.ns, ["nft", "list", "ruleset"]).stdout
    tables = ["table " + t for t in ("\n" + out).split("\ntable ") if t.strip()]
    tables = [re.sub(r"\n\s*elements = \{[^}]*\}", "", t) if t.startswith("table bridge nodeplane-antispoof ") else t
              for t in tables]
    return "\n".join(sorted(t.rstrip("\n") for t in tables)) + "\n"


def spoof_elements(node):
    """(address, host veth) pairs allowed by the anti-spoofing table."""
    got = json.loads(nsrun(node.ns, ["nft", "-j", "list", "table", "bridge", "nodeplane-antispoof"]).stdout)
    out = set()
    for o in got["nftables"]:
        for e in (o.get("set") or {}).get("elem", []):
            ip, ifname = e["concat"]
            out.add((ip, ifname))
    return out


def bridge_ports(node):
    """Names of the links enslaved to the node bridge."""
    return {n for n, l in node.ns.links().items() if l.get("master") == BRIDGE}


def pod_links(node):
    """(live host pod veths, graveyard links) in the node namespace."""
    links = node.ns.links()
    graves = {n for n, l in links.items() if harness.is_graveyard(n, l)}
    return {n for n in links if HOST_VETH_RE.match(n)} - graves, graves


def pending_dels(node):
    d = node.pending_dir
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def lease_files(node):
    """Every file in the lease dir (temp files included): name -> parsed JSON or None."""
    out = {}
    if node.lease_dir.exists():
        for p in node.lease_dir.iterdir():
            try:
                out[p.name] = json.loads(p.read_text())
            except ValueError:
                out[p.name] = None
    return out


def kernel_ips(pod):
    """The pod's global addresses on eth0, read from its namespace (None: no eth0)."""
    if "eth0" not in pod.ns.links():
        return None
    return norm_ips(a for a in pod.ns.addrs("eth0") if not a.startswith("fe80:"))


def short(node):
    return node.ns.name.rsplit("-", 1)[-1]


def ping_jobs(jobs, workers=32):
    """jobs: (src ns, ip, label). Returns the labels that got no answer."""
    with cf.ThreadPoolExecutor(workers) as ex:
        oks = list(ex.map(lambda j: ping(j[0], j[1]), jobs))
    return [j[2] for j, ok in zip(jobs, oks) if not ok]


# ----- 1. agent kill -9 during a 200-pod ADD/DEL storm across 3 nodes -----


class Sandbox:
    """What the runtime knows about one pod slot: its sandboxes (each ADD attempt is a new
    sandbox: new netns, new container id, as kubelet does after a failed RunPodSandbox)."""

    def __init__(self, slot, node, want_del):
        self.slot, self.node, self.want_del = slot, node, want_del
        self.pod = None          # the sandbox whose ADD succeeded
        self.result = None
        self.deleted = False     # its DEL returned 0
        self.failed_adds = []    # (code, msg) of ADDs that failed
        self.abandoned = False   # the runtime gave up after a failed ADD
        self.del_failures = []   # rc of DELs that failed (each then retried)
        self.add_seconds = []


def test_agent_kill9_during_200_pod_storm(make_cluster):
    """8 agent kill -9 (every node, two killed again mid-restart) during a 200-pod ADD/DEL storm;
    afterwards leases, bridge ports, pod links and nftables match exactly the surviving pods,
    no address is held twice, every survivor passes CHECK and pings its gateways and a pod on
    each other node in both families."""
    t_case = time.monotonic()
    seed = seed_of()
    rng = random.Random(seed)
    ctx = f"[seed={seed}]"
    c = make_cluster()
    nodes = [c.node(0, h, ipv6=True) for h in (1, 2, 3)]
    wait_routes(nodes, c.controller, direct, timeout=10)
    # Two nodes' network config lets ADDs wait for a restarting agent (the default behaviour);
    # the third says agentWaitSeconds 0, so there the kills make ADDs fail (code 11) and the
    # runtime's retry path (DEL, then a new sandbox) is exercised too.
    confs = {n.ns.name: n.netconf(agentWaitSeconds=AGENT_WAIT if i < 2 else 0) for i, n in enumerate(nodes)}
    nft_before = {n.ns.name: nft_ruleset(n) for n in nodes}
    for n in nodes:
        assert "table inet nodeplane" in nft_before[n.ns.name], f"{ctx} no masquerade table on {n.ns.name}"
        assert bridge_ports(n) == set() and pod_links(n) == (set(), set()), f"{ctx} {n.ns.name} not clean at start"

    n_pods = 200
    slots = [Sandbox(i, nodes[i % 3], False) for i in range(n_pods)]
    for i in rng.sample(range(n_pods), n_pods // 2):
        slots[i].want_del = True
    pods_lock = threading.Lock()
    progress = {"ops": 0}                       # CNI calls returned (ADD and DEL)
    in_flight = {n.ns.name: 0 for n in nodes}   # CNI calls running, per node

    def cni(rec, cmd, pod):
        name = rec.node.ns.name
        with pods_lock:
            in_flight[name] += 1
        try:
            return rec.node.cni(cmd, pod.cid, "eth0", pod.ns.path, conf=confs[name], timeout=60)
        finally:
            with pods_lock:
                in_flight[name] -= 1
                progress["ops"] += 1

    def new_pod(node):
        pod = harness.Pod(node, "s")
        with pods_lock:
            node.pods.append(pod)
        return pod

    def del_until_ok(rec, pod):
        """A runtime retries DEL until it succeeds (here: every 0.1 s, for 60 s at most)."""
        deadline = time.monotonic() + 60
        while True:
            rc, _, raw = cni(rec, "DEL", pod)
            if rc == 0:
                return
            rec.del_failures.append((rc, raw.strip()[:200]))
            assert time.monotonic() < deadline, f"{ctx} DEL of {pod.cid} never succeeded: {raw}"
            time.sleep(0.1)

    def sandbox(rec):
        r = random.Random(seed * 1000 + rec.slot)
        time.sleep(max(0.0, t_storm + arrival[rec.slot] - time.monotonic()))
        for _attempt in range(4):
            pod = new_pod(rec.node)
            t0 = time.monotonic()
            rc, out, raw = cni(rec, "ADD", pod)
            rec.add_seconds.append(time.monotonic() - t0)
            if rc == 0:
                rec.pod, rec.result, pod.result = pod, out, out
                break
            rec.failed_adds.append(((out or {}).get("code"), raw.strip()[:300]))
            # The runtime tears the failed sandbox down, then maybe tries a new one.
            del_until_ok(rec, pod)
            pod.ns.delete()
            if r.random() < 0.3:
                rec.abandoned = True
                return
        else:
            rec.abandoned = True
            return
        if rec.want_del:
            time.sleep(r.random() * 0.05)
            del_until_ok(rec, rec.pod)
            rec.deleted = True
            rec.pod.ns.delete()

    # Pods arrive in 10 bursts (a scale-up: 20 pods within 0.1 s), one every ~0.6 s at a random
    # offset; a DEL follows its ADD within 50 ms.
    spacing = 0.6
    bursts = [i * spacing + rng.uniform(0, 0.25) for i in range(n_pods // 20)]
    arrival = sorted(b + rng.uniform(0, 0.1) for b in bursts for _ in range(20))
    # The kill plan: 8 kills, in 8 different bursts (never the last, so the storm is still on),
    # at a random instant while the chosen node serves a CNI call; each kill on another node
    # than the one before, every node at least once; two of them are killed again while
    # restarting (reconcile, draining queued DELs). A kill and restart takes < `spacing`.
    order = rng.sample(range(3), 3)
    while len(order) < 8:
        order.append(rng.choice([i for i in range(3) if i != order[-1]]))
    kill_times = [bursts[i] + rng.uniform(0, 0.1) for i in sorted(rng.sample(range(len(bursts) - 1), len(order)))]
    doubles = set(rng.sample(range(len(order)), 2))
    kills = []
    storm_done = threading.Event()
    killer_error = []

    def killer(t_start):
        try:
            for k, (idx, at) in enumerate(zip(order, kill_times)):
                time.sleep(max(0.0, t_start + at - time.monotonic()))
                if storm_done.is_set():
                    return
                n = nodes[idx]
                # Kill while that node serves a CNI call (waiting up to 1 s for one), at a
                # random instant inside it.
                until = time.monotonic() + 1.0
                while in_flight[n.ns.name] == 0 and time.monotonic() < until:
                    time.sleep(0.0005)
                time.sleep(rng.random() * 0.004)
                t_kill = time.monotonic() - t_start
                busy = in_flight[n.ns.name]
                n.kill9()
                ops = progress["ops"]
                down = rng.uniform(0.05, 0.3)
                time.sleep(down)
                again = None
                if k in doubles:
                    # Killed again in the middle of its start-up (reconcile, queued DELs).
                    n.start(wait=False)
                    again = rng.random() * 0.03
                    time.sleep(again)
                    n.kill9()
                t_up = time.monotonic()
                n.start()
                kills.append({"node": short(n), "t": round(t_kill, 3), "calls_done": ops, "calls_in_flight": busy,
                              "down_s": round(down, 3),
                              "killed_again_after_s": None if again is None else round(again, 3),
                              "restart_to_ready_s": round(time.monotonic() - t_up, 3)})
        except BaseException as e:  # reported by the main thread
            killer_error.append(e)

    t_storm = time.monotonic() + 0.2  # the pods' arrival times count from here
    kt = threading.Thread(target=killer, args=(t_storm,), daemon=True)
    kt.start()
    with cf.ThreadPoolExecutor(12) as ex:
        futures = [ex.submit(sandbox, s) for s in slots]
        errors = [f.exception() for f in futures if f.exception() is not None]
    storm_done.set()
    kt.join(60)
    storm_s = time.monotonic() - t_storm
    assert not kt.is_alive(), f"{ctx} killer thread hung"
    assert not killer_error, f"{ctx} killing/restarting an agent failed: {killer_error[0]!r}"
    assert not errors, f"{ctx} {len(errors)} sandboxes failed: {errors[0]!r}"
    assert len(kills) == len(order), f"{ctx} only {len(kills)} of {len(order)} kills landed inside the storm: {kills}"
    for n in nodes:
        assert n.proc is not None and n.proc.poll() is None, f"{ctx} agent of {n.ns.name} is not running"

    # --- what is left: leases, links, nftables, against what the runtime was told ---
    # Problems are collected (and counted in the report) before anything is asserted.
    survivors = [s for s in slots if s.pod is not None and not s.deleted]
    by_node = {n.ns.name: {s.pod.cid: s for s in survivors if s.node is n} for n in nodes}
    leaks = {}      # what is left that should not be: leases, links, nft changes, double addresses
    problems = []   # every disagreement, leaks included, for the assertion message

    try:  # the agent drains its queue every 5 s
        harness.wait_until(lambda: all(not pending_dels(n) for n in nodes), timeout=12, what="queued DELs drained")
    except AssertionError:
        pass
    for n in nodes:
        left = pending_dels(n)
        leaks[f"{short(n)}_queued_dels_left"] = len(left)
        if left:
            problems.append(f"{n.ns.name}: queued DELs never drained: {left}")

    all_ips = []
    for n in nodes:
        name = n.ns.name
        want = by_node[name]
        files = lease_files(n)
        want_files = {f"{cid}:eth0.json" for cid in want}
        extra, missing = sorted(set(files) - want_files), sorted(want_files - set(files))
        leaks[f"{short(n)}_leases_extra"] = len(extra)
        if extra:
            problems.append(f"{name}: leaked leases (no surviving pod): {extra}")
        if missing:
            problems.append(f"{name}: surviving pods without a lease: {missing}")
        blocks = c.controller.nodes()[name]["blocks"]
        for cid, s in want.items():
            lease = files.get(f"{cid}:eth0.json")
            if not lease or lease["state"] != "ready":
                problems.append(f"{name}: lease of {cid} is {lease}")
                continue
            if not norm_ips(lease["ips"]) == result_ips(s.result) == kernel_ips(s.pod):
                problems.append(f"{cid}: lease {lease['ips']} / ADD result / pod eth0 {kernel_ips(s.pod)} disagree")
            for a in lease["ips"]:
                ip = str(ipaddress.ip_interface(a).ip)
                if not in_block(ip, blocks):
                    problems.append(f"{cid} holds {ip}, outside {name}'s blocks {blocks}")
                all_ips.append(ip)

        n.wait_no_graveyard(timeout=20)
        ports = bridge_ports(n)
        veths, graves = pod_links(n)
        want_veths = {host_ifname(cid) for cid in want}
        leaks[f"{short(n)}_links_extra"] = len((ports | veths) - want_veths) + len(graves)
        if ports != want_veths:
            problems.append(f"{name}: bridge ports != survivors' host veths: extra={sorted(ports - want_veths)} "
                            f"missing={sorted(want_veths - ports)}")
        if veths != want_veths or graves:
            problems.append(f"{name}: stray pod links {sorted(veths - want_veths)}, graveyard {sorted(graves)}")

        spoof = spoof_elements(n)
        want_spoof = {(str(ipaddress.ip_interface(a).ip), host_ifname(cid)) for cid in want
                      for a in (files.get(f"{cid}:eth0.json") or {}).get("ips", [])}
        leaks[f"{short(n)}_spoof_extra"] = len(spoof - want_spoof)
        if spoof != want_spoof:
            problems.append(f"{name}: anti-spoofing entries != survivors' addresses: extra={sorted(spoof - want_spoof)} "
                            f"missing={sorted(want_spoof - spoof)}")
        after = nft_ruleset(n)
        leaks[f"{short(n)}_nft_changed"] = int(after != nft_before[name])
        if after != nft_before[name]:
            problems.append(f"{name}: nftables changed by the storm:\n{nft_before[name]}\n---\n{after}")
    dup = sorted({ip for ip in all_ips if all_ips.count(ip) > 1})
    leaks["addresses_twice"] = len(dup)
    if dup:
        problems.append(f"addresses held by two pods: {dup}")

    # --- reachability: gateway, and one survivor on each other node, both families ---
    jobs = []
    prng = random.Random(seed + 1)
    for s in survivors:
        for gw in (i["gateway"] for i in s.result["ips"]):
            jobs.append((s.pod.ns, gw, f"{s.pod.cid} -> gateway {gw}"))
        for other in nodes:
            if other is s.node:
                continue
            peers = list(by_node[other.ns.name].values())
            if not peers:
                continue
            t = prng.choice(peers)
            for ip in t.pod.ips():
                jobs.append((s.pod.ns, ip, f"{s.pod.cid}@{short(s.node)} -> {ip} ({t.pod.cid}@{short(other)})"))
    failed = ping_jobs(jobs)

    # CHECK (with the ADD's result as prevResult) confirms every survivor's attachment in full.
    def check(s):
        conf = dict(confs[s.node.ns.name], prevResult=s.result)
        rc, _, raw = s.node.cni("CHECK", s.pod.cid, "eth0", s.pod.ns.path, conf=conf)
        return None if rc == 0 else f"{s.pod.cid}: {raw.strip()[:200]}"
    with cf.ThreadPoolExecutor(8) as ex:
        bad_checks = [x for x in ex.map(check, survivors) if x]

    failed_adds = [f for s in slots for f in s.failed_adds]
    figures = {
        "seed": seed,
        "pods_added": sum(1 for s in slots if s.pod is not None),
        "pods_deleted": sum(s.deleted for s in slots),
        "sandboxes_abandoned": sum(s.abandoned for s in slots),
        "survivors": len(survivors),
        "kills": kills,
        "kills_with_calls_in_flight": sum(k["calls_in_flight"] > 0 for k in kills),
        "adds_failed_then_retried": len(failed_adds),
        "add_failure_codes": sorted({str(code) for code, _ in failed_adds}),
        "dels_failed_then_retried": sum(len(s.del_failures) for s in slots),
        "queued_dels_drained": sum(log_since(n).count("drained pending delete") for n in nodes),
        "half_done_adds_rolled_back": sum(log_since(n).count("ADD never completed") for n in nodes),
        "add_max_s": round(max(x for s in slots for x in s.add_seconds), 3),
        "leaks": sum(leaks.values()),
        "pings_ok": len(jobs) - len(failed),
        "pings_total": len(jobs),
        "checks_failed": len(bad_checks),
        "storm_s": round(storm_s, 2),
        "duration_s": round(time.monotonic() - t_case, 2),
    }
    harness.fault_report(
        "agent-kill9-storm",
        f"{n_pods}-pod ADD/DEL storm over 3 nodes; {len(kills)} agent kill -9 on "
        f"{sorted({k['node'] for k in kills})} at random points (two killed again during restart)",
        f"{figures['leaks']} leaked leases/veths/nft changes/duplicate addresses; "
        f"{figures['pings_ok']}/{figures['pings_total']} pings answered",
        **figures)
    for msg in sorted({m.split(" is not reachable: ")[-1] for _, m in failed_adds})[:5]:
        print(f"  failed ADD (retried): {msg}")
    dfail = [f for s in slots for f in s.del_failures]
    assert not problems, f"{ctx} {len(problems)} problems after the storm:\n" + "\n".join(problems[:30])
    for n in nodes:
        assert by_node[n.ns.name], f"{ctx} no surviving pod on {n.ns.name} to ping"
    assert not failed, f"{ctx} {len(failed)}/{len(jobs)} pings failed: " + "; ".join(failed[:20])
    assert not bad_checks, f"{ctx} CHECK fails for {len(bad_checks)} survivors: " + "; ".join(bad_checks[:10])
    # DEL must always succeed: with the agent unreachable the shim queues it.
    assert not dfail, f"{ctx} {len(dfail)} DELs failed during the storm (retried): {dfail[:5]}"

    # Tear down (through the agents, so nothing is left for the fixtures to find either).
    with cf.ThreadPoolExecutor(12) as ex:
        list(ex.map(lambda s: del_until_ok(s, s.pod), survivors))
    for n in nodes:
        assert n.wait_no_graveyard(), f"{ctx} {n.ns.name}: graveyard not reaped after teardown"
        assert lease_files(n) == {} and bridge_ports(n) == set(), f"{ctx} {n.ns.name}: left after teardown"
    print(f"case 1 duration: {time.monotonic() - t_case:.1f} s")


# ----- 2. simulated node reboot in a cluster -----


def test_node_reboot_in_cluster(make_cluster):
    """A node "reboots" (see the steps below); its agent frees every stale lease by itself,
    leaves no host-side link, keeps its blocks, gets its routes back, and new pods there ping
    pods on the other nodes."""
    t_case = time.monotonic()
    c = make_cluster()
    a, b, d = (c.node(0, h, ipv6=True) for h in (1, 2, 3))
    nodes = [a, b, d]
    recs = wait_routes(nodes, c.controller, direct, timeout=10)
    peers = [a.add_pod("p")[0], d.add_pod("p")[0]]
    old = [b.add_pod(f"old{i}")[0] for i in range(4)]
    blocks_before = sorted(recs[b.ns.name]["blocks"])
    assert sorted(map(str, cluster_state(b)["blocks"])) == blocks_before
    assert len(lease_files(b)) == len(old)
    nft_before = nft_ruleset(b)

    # --- the reboot ---
    b.kill9()
    for p in old:
        p.ns.delete()                                   # every pod namespace is gone
    shutil.rmtree(b.root / "run", ignore_errors=True)   # /run is a tmpfs
    b.boot_id_file.write_text("boot-2\n")
    # Kernel state the agent made in its namespace does not survive a reboot either.
    links = b.ns.links()
    for dev in (BRIDGE, VXLAN_DEV):
        if dev in links:
            run(["ip", "-n", b.ns.name, "link", "del", dev])
    for fam in ("-4", "-6"):
        run(["ip", "-n", b.ns.name, fam, "route", "flush", "proto", PROTO])
    for table in (("inet", "nodeplane"), ("inet", "nodeplane-policy"), ("inet", "nodeplane-svc"),
                  ("bridge", "nodeplane-antispoof")):
        nsrun(b.ns, ["nft", "delete", "table", *table])
    for key in ("net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0"):
        nsrun(b.ns, ["sysctl", "-qw", key])
    # Only what the OS' own network config brings back at boot is left: the underlay link.
    assert set(b.ns.links()) == {"lo", "ul0"}, f"simulated reboot left links: {sorted(b.ns.links())}"
    assert our_routes(b) == {}
    assert "nodeplane" not in nft_ruleset(b)
    assert len(lease_files(b)) == len(old)  # the stale leases are on disk, for the agent to find

    # --- the agent starts on the "rebooted" node ---
    t0 = time.monotonic()
    offset = start_agent(b)
    ready_s = time.monotonic() - t0
    log = log_since(b, offset)
    freed = log.count("freed stale lease")
    files = lease_files(b)
    assert files == {}, f"stale leases survived the reboot: {sorted(files)}"
    assert freed == len(old) and "node rebooted" in log, f"freed {freed} of {len(old)}:\n{log}"
    for p in old:
        assert p.cid in log, f"log does not name the freed lease of {p.cid}"
    assert b.wait_no_graveyard(), f"graveyard links left: {pod_links(b)[1]}"
    host_left = sum(map(len, pod_links(b))) + len(bridge_ports(b))
    assert host_left == 0, f"host-side leftovers: {pod_links(b)} {bridge_ports(b)}"
    assert BRIDGE in b.ns.links(), "the agent did not re-create the bridge"
    # The tables are made as the agent starts serving (the policy table once its enforcer
    # starts, just before the first CNI request is read): give it a moment.
    deadline = time.monotonic() + 5
    while nft_ruleset(b) != nft_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert nft_ruleset(b) == nft_before, "nftables tables not restored as they were"
    assert spoof_elements(b) == set(), f"anti-spoofing entries of freed pods: {spoof_elements(b)}"

    # Same blocks from the controller, and routes to (and from) every other node again.
    recs_after = wait_routes(nodes, c.controller, direct, timeout=10)
    routes_s = time.monotonic() - t0
    assert sorted(recs_after[b.ns.name]["blocks"]) == blocks_before, f"blocks changed: {recs_after[b.ns.name]}"
    assert sorted(map(str, cluster_state(b)["blocks"])) == blocks_before
    assert_no_block_twice(recs_after)

    # New pods on the rebooted node reach pods on both other nodes, both families, both ways.
    new = [b.add_pod(f"new{i}")[0] for i in range(2)]
    assert set(lease_files(b)) == {f"{p.cid}:eth0.json" for p in new}, "lease dir holds more than the new pods"

    def cross_ok():
        jobs = [(p.ns, ip, f"{p.cid} -> {ip}") for p in new for q in peers for ip in q.ips()]
        return not ping_jobs(jobs)
    harness.wait_until(cross_ok, timeout=15, interval=0.1, what="new pods to reach the other nodes")
    ping_s = time.monotonic() - t0
    back = [(q.ns, ip, f"{q.cid}@{short(q.node)} -> {ip}") for q in peers for p in new for ip in p.ips()]
    gws = [(p.ns, i["gateway"], f"{p.cid} -> gateway") for p in new for i in p.result["ips"]]
    failed = ping_jobs(back + gws)
    figures = {"stale_leases": len(old), "freed_leases": freed, "leases_left": len(files),
               "host_links_left": host_left, "blocks_kept": int(blocks_before == sorted(
                   recs_after[b.ns.name]["blocks"])), "start_to_ready_s": round(ready_s, 3),
               "start_to_routes_s": round(routes_s, 3), "start_to_cross_node_ping_s": round(ping_s, 3),
               "pings_ok": len(back + gws) - len(failed), "pings_total": len(back + gws),
               "duration_s": round(time.monotonic() - t_case, 2)}
    harness.fault_report(
        "node-reboot",
        f"kill -9 of one node's agent; its {len(old)} pod namespaces, <root>/run, bridge, routes, nft table and "
        "forwarding removed; boot id changed",
        f"{freed}/{len(old)} stale leases freed, {figures['leases_left']} left, "
        f"{figures['host_links_left']} host links left, same blocks; cross-node ping after {ping_s:.2f} s",
        **figures)
    assert not failed, f"pings failed: {failed}"
    print(f"case 2 duration: {time.monotonic() - t_case:.1f} s")


# ----- 3. controller kill -9 during registrations -----


def readyz(node):
    r = harness.health_request(node.ns, "/readyz")
    return r is not None and r["status"] == 200


def registered_now(node):
    """This run of the agent has completed a registration (its log says so)."""
    return "registered with the controller" in clean_log(node.log()[node.log_offset:])


def test_controller_kill9_during_registrations(make_cluster):
    """The controller is killed 1-3 times per round while agents register (new) or re-register
    (restarted); afterwards no block is held twice, every agent's cluster.json is its record,
    routes are complete and pods on all nodes ping each other."""
    t_case = time.monotonic()
    seed = seed_of()
    rng = random.Random(seed)
    ctx = f"[seed={seed}]"
    c = make_cluster()
    ctl = c.controller
    nodes = []
    kills = []
    # Round r: `new` brand-new nodes start together with every existing agent restarting
    # (kill -9 or SIGTERM: it registers again); the controller is killed 1-2 times meanwhile.
    plan = [3, 2, 1, 0, 0]
    host = iter(range(1, 20))
    for rnd, new in enumerate(plan):
        fresh = [c.node(0, next(host), ipv6=True, start=False) for _ in range(new)]
        old = list(nodes)
        for n in old:
            n.kill9() if rng.random() < 0.5 else n.stop()
        nodes += fresh
        t0 = time.monotonic()
        for n in nodes:
            n.start(wait=False)
        for k in range(rng.choice((1, 2, 3))):
            time.sleep(rng.uniform(0.0, 0.15))
            t_kill = time.monotonic() - t0
            ctl.kill9()
            pending = sum(not registered_now(n) for n in nodes)
            down = rng.uniform(0.0, 0.3)
            time.sleep(down)
            ctl.start()
            kills.append({"round": rnd, "t": round(t_kill, 3), "down_s": round(down, 3),
                          "agents_not_yet_registered": pending})
        for n in nodes:
            n.wait_ready(timeout=25)
        harness.wait_until(lambda: set(ctl.nodes()) == {n.ns.name for n in nodes}, timeout=15,
                           what=f"{ctx} round {rnd}: every node registered")

    # --- checks ---
    recs = wait_routes(nodes, ctl, direct, timeout=15)
    assert set(recs) == {n.ns.name for n in nodes}, f"{ctx} controller knows {sorted(recs)}"
    dups = 0
    blocks = [(name, ipaddress.ip_network(b)) for name, r in recs.items() for b in r["blocks"]]
    for i, (n1, b1) in enumerate(blocks):
        dups += sum(1 for n2, b2 in blocks[i + 1:] if b1.overlaps(b2))
    assert_no_block_twice(recs)
    for n in nodes:
        rb = recs[n.ns.name]["blocks"]
        assert sorted(ipaddress.ip_network(b).version for b in rb) == [4, 6], f"{ctx} {n.ns.name} holds {rb}"
        st = cluster_state(n)
        assert st and sorted(map(str, st["blocks"])) == sorted(rb), (
            f"{ctx} {n.ns.name}: cluster.json {st and st['blocks']} != controller's record {rb}")
        assert recs[n.ns.name]["underlay"][0] == n.underlay
    harness.wait_until(lambda: all(readyz(n) for n in nodes), timeout=10, what=f"{ctx} every agent /readyz 200")
    # Every agent answered: its persisted blocks are the ones it serves (the bridge holds each
    # block's gateway).
    for n in nodes:
        have = set(n.ns.addrs(BRIDGE))
        for b in recs[n.ns.name]["blocks"]:
            net = ipaddress.ip_network(b)
            gw = f"{net.network_address + 1}/{net.prefixlen}"
            assert gw in have, f"{ctx} {n.ns.name}: bridge lacks {gw} of its block {b}: {sorted(have)}"

    # The records are durable: one more kill -9 and restart changes none of them.
    ctl.kill9()
    ctl.start()
    assert ctl.nodes() == recs, f"{ctx} the controller's records changed across a kill -9 at rest"

    # Pods on two different nodes (here: one on every node) ping each other, both families.
    with cf.ThreadPoolExecutor(6) as ex:
        pods = list(ex.map(lambda n: n.add_pod("m")[0], nodes))
    for p in pods:
        for ip in p.ips():
            assert in_block(ip, recs[p.node.ns.name]["blocks"]), f"{ctx} {p.cid} got {ip} outside its blocks"
    jobs = [(p.ns, ip, f"{short(p.node)} -> {ip}@{short(q.node)}") for p in pods for q in pods if q is not p
            for ip in q.ips()]
    failed = ping_jobs(jobs)

    sessions_ended = sum(clean_log(n.log()).count("controller session ended") for n in nodes)
    registered = clean_log(ctl.log()).count("registered node=")
    figures = {"seed": seed, "rounds": len(plan), "nodes": len(nodes), "controller_kills": kills,
               "agent_sessions_retried": sessions_ended,
               "kills_with_registrations_in_flight": sum(k["agents_not_yet_registered"] > 0 for k in kills),
               "registrations_served": registered,
               "duplicate_blocks": dups, "pings_ok": len(jobs) - len(failed), "pings_total": len(jobs),
               "duration_s": round(time.monotonic() - t_case, 2)}
    harness.fault_report(
        "controller-kill9-registrations",
        f"{len(kills)} controller kill -9 in {len(plan)} rounds while {sum(plan)} new agents registered and the "
        "existing ones restarted and re-registered",
        f"{dups} blocks held twice; every agent's cluster.json == controller record; routes complete; "
        f"{len(jobs) - len(failed)}/{len(jobs)} pings answered",
        **figures)
    assert not failed, f"{ctx} {len(failed)}/{len(jobs)} pings failed: {failed}"
    print(f"case 3 duration: {time.monotonic() - t_case:.1f} s")
