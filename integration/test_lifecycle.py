"""Attachment lifecycle: DEL, CHECK, GC, STATUS, the agent being down, concurrency, conflicts.

Every assertion here is about real kernel state (links, addresses, routes, nft rules inside
the simulated node's and pods' namespaces) or the agent's lease store on disk.
"""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import harness

# STATUS and GC exist from spec 1.1.0 on; the installed conflist may say an older version
# (the agent lowers it for old runtimes), so those requests pin their own cniVersion.
LATEST = "1.1.0"


# ----- small local helpers -----


wait_until = harness.wait_until


def error_of(rc, parsed, raw):
    """The CNI error object on stdout of a failed invocation (asserts it is well-formed)."""
    assert rc != 0, f"expected failure, got rc 0: {raw!r}"
    assert isinstance(parsed, dict), f"error output is not a JSON object: {raw!r}"
    assert {"cniVersion", "code", "msg"} <= parsed.keys(), raw
    assert isinstance(parsed["code"], int) and isinstance(parsed["msg"], str), raw
    return parsed


def lease_key(cid, ifname="eth0"):
    return f"{cid}:{ifname}.json"


def host_if_of(result):
    return result["interfaces"][1]["name"]


def graveyard(node):
    return node.graveyard()


def live_veths(node):
    """Host veths named like ours (np + 13 hex), graveyard excluded."""
    return node.pod_veths()


def host_veths_empty(node):
    veths = node.host_veths()
    assert veths == {}, sorted(veths)
    return True


def nft_rules(node):
    out = node.ns.exec(["nft", "-j", "list", "table", "inet", "nodeplane"]).stdout
    return [o["rule"] for o in json.loads(out)["nftables"] if "rule" in o]


def check_conf(node, result, version=LATEST):
    conf = node.netconf(version)
    conf["prevResult"] = result
    return conf


def _status(node):
    return node.cni("STATUS", ifname="", conf=node.netconf(LATEST))


def del_pod(node, pod, **kw):
    return node.cni("DEL", pod.cid, pod.ifname, pod.ns.path, conf=node.netconf(), **kw)


def new_pod(node, tag):
    """A pod namespace, registered with the node for cleanup, not yet ADDed."""
    pod = harness.Pod(node, tag)
    node.pods.append(pod)
    return pod


def assert_del_ok(rc, parsed, raw):
    assert rc == 0, f"DEL failed: {raw!r}"
    assert raw.strip() == "", f"DEL printed something: {raw!r}"


def assert_fully_gone(node, pod, host_if):
    """Lease, host veth (and its graveyard twin) and the pod's interface are all gone."""
    assert lease_key(pod.cid, pod.ifname) not in node.leases()
    assert host_if not in node.pod_veths()
    assert node.wait_no_graveyard(), f"graveyard not reaped: {sorted(graveyard(node))}"
    assert host_if not in node.ns.links()
    assert pod.ifname not in pod.ns.links(), pod.ns.links().keys()


# ----- 1. DEL removes everything -----


def test_del_removes_lease_veth_pod_interface_and_keeps_nft(node):
    rules_before = nft_rules(node)
    assert len(rules_before) == 2, rules_before  # one masquerade rule per block family
    assert all(any("masquerade" in e for e in r["expr"]) for r in rules_before), rules_before

    pod, res = node.add_pod("del")
    host_if = host_if_of(res)
    assert lease_key(pod.cid) in node.leases()
    links = node.ns.links()
    assert host_if in links and links[host_if]["master"] == "np0"
    assert "eth0" in pod.ns.links()
    assert nft_rules(node) == rules_before, "ADD must not touch the firewall"
    # A second pod reaches the first over the bridge, both families, before the DEL...
    peer, peer_res = node.add_pod("del-peer")
    addrs = [ip["address"].split("/")[0] for ip in res["ips"]]
    assert len(addrs) == 2, res["ips"]
    for a in addrs:
        assert peer.ns.ping(a), f"{a} unreachable before DEL"

    assert_del_ok(*del_pod(node, pod))

    # Synchronously: the lease is gone, and the host end is retired: down, in the graveyard
    # group, a disabled bridge port (the reaper deletes it later). The pod's namespace still
    # exists (the runtime removes it after the DEL), yet its old addresses are unreachable.
    assert lease_key(pod.cid) not in node.leases()
    assert len([p for p in node.lease_dir.iterdir() if p.suffix == ".json"]) == 1, list(node.lease_dir.iterdir())
    links = node.ns.links()
    assert host_if not in node.pod_veths(), f"{host_if} still live right after DEL: {links.get(host_if)}"
    for name, l in node.graveyard().items():
        assert "UP" not in l["flags"], f"graveyard link {name} still up: {l}"
        assert harness.bridge_port_state(l) in (None, "disabled"), f"graveyard link {name} still forwards: {l}"
    forwarding = [n for n, l in links.items() if harness.bridge_port_state(l) not in (None, "disabled")]
    assert forwarding == [host_if_of(peer_res)], f"bridge ports still forwarding after DEL: {forwarding}"
    for a in addrs:
        assert not peer.ns.ping(a, wait=1), f"{a} still reachable right after DEL"
    assert_del_ok(*del_pod(node, peer))

    # The reaper deletes it in the background: then the pod end is gone as well.
    assert node.wait_no_graveyard(), f"graveyard not reaped: {sorted(graveyard(node))}"
    assert host_veths_empty(node)
    assert "eth0" not in pod.ns.links(), pod.ns.links().keys()
    assert nft_rules(node) == rules_before, "DEL must not touch the firewall"


def test_add_again_right_after_del(node):
    """A retired host veth keeps its name until the reaper deletes it: an ADD of the same
    attachment right after its DEL (a runtime's retry in the same namespace; podman's restart,
    in a new one) still gets the name, a live port, and a network that works."""
    peer, _ = node.add_pod("again-peer")

    def assert_attached(pod, res):
        host_if = host_if_of(res)
        l = node.pod_veths().get(host_if)
        assert l is not None and "UP" in l["flags"], f"{host_if} not live: {node.host_veths()}"
        assert harness.bridge_port_state(l) == "forwarding", l
        for a in [ip["address"].split("/")[0] for ip in res["ips"]]:
            assert peer.ns.ping(a), f"{a} unreachable"
        return host_if

    pod, res = node.add_pod("again")
    host_if = assert_attached(pod, res)
    # Same namespace: the pod's old eth0 is still there (it goes with the retired host end).
    assert_del_ok(*del_pod(node, pod))
    rc, res2, raw = node.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=node.netconf())
    assert rc == 0, raw
    assert assert_attached(pod, res2) == host_if
    # A new namespace for the same container.
    assert_del_ok(*del_pod(node, pod))
    moved = new_pod(node, "again2")
    moved.cid = pod.cid
    rc, res3, raw = node.cni("ADD", moved.cid, "eth0", moved.ns.path, conf=node.netconf())
    assert rc == 0, raw
    assert assert_attached(moved, res3) == host_if
    assert set(node.pod_veths()) == {host_if, host_if_of(peer.result)}, node.host_veths()
    assert_del_ok(*del_pod(node, moved))
    assert_del_ok(*del_pod(node, peer))
    assert node.leases() == {}
    assert node.wait_no_graveyard(), f"graveyard not reaped: {sorted(graveyard(node))}"
    assert host_veths_empty(node)
    assert "eth0" not in pod.ns.links() and "eth0" not in moved.ns.links()


# ----- 2. DEL is idempotent and tolerant -----


def test_del_twice_empty_netns_and_deleted_netns(node):
    # Twice.
    a, ra = node.add_pod("twice")
    assert_del_ok(*del_pod(node, a))
    assert_del_ok(*del_pod(node, a))
    assert_fully_gone(node, a, host_if_of(ra))

    # CNI_NETNS present but empty.
    b, rb = node.add_pod("nonetns")
    assert lease_key(b.cid) in node.leases()
    assert_del_ok(*node.cni("DEL", b.cid, "eth0", conf=node.netconf(), env={"CNI_NETNS": ""}))
    assert_fully_gone(node, b, host_if_of(rb))

    # CNI_NETNS not set at all.
    b2, rb2 = node.add_pod("unsetns")
    assert_del_ok(*node.cni("DEL", b2.cid, "eth0", netns=None, conf=node.netconf()))
    assert_fully_gone(node, b2, host_if_of(rb2))

    # The pod's namespace was deleted before DEL.
    c, rc_ = node.add_pod("gonens")
    assert lease_key(c.cid) in node.leases()
    harness.run(["ip", "netns", "delete", c.ns.name])
    assert not os.path.exists(c.ns.path)
    assert_del_ok(*del_pod(node, c))
    assert lease_key(c.cid) not in node.leases()
    assert node.wait_no_graveyard()
    assert host_if_of(rc_) not in node.ns.links()
    assert node.leases() == {}
    assert node.host_veths() == {}


# ----- 3. Agent down: DEL is queued, everything else fails cleanly -----


def test_agent_down_queues_del_and_fails_others(node):
    pod, res = node.add_pod("down")
    host_if = host_if_of(res)
    other = new_pod(node, "downadd")
    node.stop()
    assert not node.socket.exists()

    rc, parsed, raw = del_pod(node, pod)
    assert_del_ok(rc, parsed, raw)
    pending = [p.name for p in node.pending_dir.glob("del-*.json")]
    assert len(pending) == 1, pending
    queued = json.loads((node.pending_dir / pending[0]).read_text())
    assert queued["env"]["CNI_CONTAINERID"] == pod.cid
    assert lease_key(pod.cid) in node.leases(), "the lease must survive until the agent runs the DEL"
    assert host_if in node.ns.links()

    # With agentWaitSeconds 1 the shim waits that long for the agent, then says "try again".
    t0 = time.monotonic()
    err = error_of(*node.cni("ADD", other.cid, "eth0", other.ns.path, conf=node.netconf(agentWaitSeconds=1)))
    assert 0.9 <= time.monotonic() - t0 < 3, "the wait is bounded by agentWaitSeconds"
    assert err["code"] == 11, err
    assert "not reachable" in err["msg"], err
    t0 = time.monotonic()
    err = error_of(*_status(node))
    assert err["code"] == 50, err
    assert time.monotonic() - t0 < 0.5, "STATUS answers at once"
    conf = check_conf(node, res)
    conf["agentWaitSeconds"] = 0
    err = error_of(*node.cni("CHECK", pod.cid, "eth0", pod.ns.path, conf=conf))
    assert err["code"] == 11, err
    # The failed ADD left nothing behind (it never reached the agent).
    assert "eth0" not in other.ns.links()
    assert len(list(node.pending_dir.glob("del-*.json"))) == 1

    node.start()
    wait_until(lambda: not list(node.pending_dir.glob("del-*.json")), what="pending delete drained")
    wait_until(lambda: lease_key(pod.cid) not in node.leases(), what="lease freed")
    # A retired link keeps its name until the reaper deletes it (at most about 1 s).
    assert node.wait_no_graveyard()
    assert host_if not in node.ns.links()
    assert node.host_veths() == {}
    assert "eth0" not in pod.ns.links()
    assert node.leases() == {}
    # And the agent works again.
    rc, out, raw = _status(node)
    assert rc == 0 and raw == "", raw


def test_del_queued_after_the_start_drain_is_applied_before_the_next_add(node):
    """A runtime DELs a container while the agent restarts, then ADDs the same container and
    interface again (podman restart does). When the shim's queue file lands just after the new
    agent's start-up drain, the ADD must apply that earlier DEL first: the periodic drain
    (every 5 s) must not detach the new attachment later, and the ADD must not be refused
    as "already attached"."""
    pod, res = node.add_pod("redo")
    old_ips = sorted(i["address"] for i in res["ips"])
    node.stop()
    rc, parsed, raw = del_pod(node, pod)
    assert_del_ok(rc, parsed, raw)
    [queued] = list(node.pending_dir.glob("del-*.json"))
    record = queued.read_bytes()
    queued.unlink()            # the file is written only after the next agent's start-up drain:
    node.start()
    queued.write_bytes(record)  # it lands now
    # The same container and interface again, in a new namespace (a restarted container).
    pod.ns.delete()
    pod.ns = harness.Netns("redo2")
    rc, new_res, raw = node.cni("ADD", pod.cid, "eth0", pod.ns.path)
    assert rc == 0, raw
    assert not queued.exists(), "the queued DEL was consumed by the ADD"
    lease = node.leases()[lease_key(pod.cid)]
    assert lease["netns"] == pod.ns.path and lease["state"] == "ready"
    assert sorted(lease["ips"]) == sorted(i["address"] for i in new_res["ips"])
    assert len(node.leases()) == 1, "the old attachment's addresses were freed, not kept beside the new ones"
    # Past the periodic drain: still attached and reachable.
    time.sleep(6)
    assert lease_key(pod.cid) in node.leases()
    assert "eth0" in pod.ns.links()
    assert pod.ns.ping(new_res["ips"][0]["gateway"])
    print(f"old {old_ips} -> new {sorted(lease['ips'])}")


def test_add_waits_for_a_restarting_agent(node):
    """Rollout safety: while the agent restarts, ADD waits (bounded) for its socket instead of
    failing at once, and succeeds when the new agent is up."""
    node.stop()
    pod = new_pod(node, "rollout")
    out = {}

    def add():
        out["r"] = node.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=node.netconf(agentWaitSeconds=10))

    t = threading.Thread(target=add)
    t0 = time.monotonic()
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), "ADD did not wait for the agent"
    node.start()
    t.join(15)
    rc, res, raw = out["r"]
    assert rc == 0, raw
    assert time.monotonic() - t0 < 10
    pod.result = res
    pod.ifname = "eth0"
    assert "eth0" in pod.ns.links()
    assert lease_key(pod.cid) in node.leases()


# ----- 4. CHECK -----


def _check(node, pod, res):
    return node.cni("CHECK", pod.cid, "eth0", pod.ns.path, conf=check_conf(node, res))


def test_check_passes_on_fresh_pod(node):
    pod, res = node.add_pod("chk")
    rc, parsed, raw = _check(node, pod, res)
    assert rc == 0, raw
    assert raw.strip() == ""
    # Also with the oldest version that has CHECK.
    rc, _, raw = node.cni("CHECK", pod.cid, "eth0", pod.ns.path, conf=check_conf(node, res, "0.4.0"))
    assert rc == 0, raw


def test_check_detects_missing_ipv4_address(node):
    pod, res = node.add_pod("chk4")
    assert _check(node, pod, res)[0] == 0
    pod.ns.exec(["ip", "addr", "del", f"{pod.ip4()}/24", "dev", "eth0"])
    assert f"{pod.ip4()}/24" not in pod.ns.addrs("eth0")
    err = error_of(*_check(node, pod, res))
    assert pod.ip4() in err["msg"], err


def test_check_detects_missing_default_route(node):
    pod, res = node.add_pod("chkrt")
    assert _check(node, pod, res)[0] == 0
    pod.ns.exec(["ip", "-4", "route", "del", "default"])
    assert pod.ns.ip_json("-4", "route", "show", "default") == []
    err = error_of(*_check(node, pod, res))
    assert "default route" in err["msg"], err


def test_check_detects_missing_host_veth(node):
    pod, res = node.add_pod("chkveth")
    host_if = host_if_of(res)
    assert _check(node, pod, res)[0] == 0
    node.ns.exec(["ip", "link", "del", host_if])
    assert host_if not in node.ns.links()
    err = error_of(*_check(node, pod, res))
    # Deleting one end of a veth deletes both: the pod's eth0 is gone too, and CHECK looks
    # at the pod side first. Either way the message must name a missing interface.
    assert host_if in err["msg"] or "interface eth0" in err["msg"], err
    assert "missing" in err["msg"] or "not found" in err["msg"], err


def test_check_detects_missing_ipv6_address(node):
    pod, res = node.add_pod("chk6")
    assert _check(node, pod, res)[0] == 0
    pod.ns.exec(["ip", "-6", "addr", "del", f"{pod.ip6()}/64", "dev", "eth0"])
    assert f"{pod.ip6()}/64" not in pod.ns.addrs("eth0")
    err = error_of(*_check(node, pod, res))
    assert pod.ip6() in err["msg"], err


def test_check_unknown_container(node):
    pod, res = node.add_pod("chkunk")
    err = error_of(*node.cni("CHECK", pod.cid + "-nope", "eth0", pod.ns.path, conf=check_conf(node, res)))
    assert err["code"] == 3, err


# ----- 5. GC -----


def _gc(node, key, keep):
    conf = node.netconf(LATEST)
    conf[key] = [{"containerID": p.cid, "ifname": "eth0"} for p in keep]
    return node.cni("GC", ifname="", conf=conf)


def _gc_round(node, key, tag):
    pods = [node.add_pod(f"{tag}{i}") for i in range(3)]
    (keep, rkeep), *drop = pods
    rc, _, raw = _gc(node, key, [keep])
    assert rc == 0 and raw.strip() == "", raw
    leases = node.leases()
    assert lease_key(keep.cid) in leases
    for p, r in drop:
        assert lease_key(p.cid) not in leases, f"{key}: lease of {p.cid} survived GC"
        assert host_if_of(r) not in node.pod_veths(), f"{key}: host veth of {p.cid} survived GC"
    assert node.wait_no_graveyard()
    for p, r in drop:
        assert host_if_of(r) not in node.ns.links()
        assert "eth0" not in p.ns.links()
    assert set(live_veths(node)) == {host_if_of(rkeep)}
    assert keep.ns.ping(rkeep["ips"][0]["gateway"]), f"{key}: kept pod lost IPv4"
    assert keep.ns.ping(rkeep["ips"][1]["gateway"]), f"{key}: kept pod lost IPv6"
    return keep, rkeep


def test_gc_valid_attachments(node):
    keep, rkeep = _gc_round(node, "cni.dev/valid-attachments", "gca")
    assert len(node.leases()) == 1
    assert_del_ok(*del_pod(node, keep))


def test_gc_legacy_attachments_key(node):
    _gc_round(node, "cni.dev/attachments", "gcl")
    assert len(node.leases()) == 1


def test_gc_removes_unleased_host_veth(node):
    keep, rkeep = node.add_pod("gckeep")
    stray = "np0123456789abc"
    peer = "strayp" + os.urandom(3).hex()
    node.ns.exec(["ip", "link", "add", stray, "type", "veth", "peer", "name", peer])
    assert stray in node.ns.links() and peer in node.ns.links()
    rc, _, raw = _gc(node, "cni.dev/valid-attachments", [keep])
    assert rc == 0, raw
    assert stray not in node.pod_veths()
    assert node.wait_no_graveyard()
    assert stray not in node.ns.links() and peer not in node.ns.links()
    assert set(live_veths(node)) == {host_if_of(rkeep)}
    assert list(node.leases()) == [lease_key(keep.cid)]


# ----- 6. Concurrency -----


def test_fifty_parallel_adds_and_dels(node):
    n = 50

    def add(i):
        pod = new_pod(node, f"par{i}-")
        rc, res, raw = node.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=node.netconf())
        pod.result = res
        return pod, rc, raw

    with ThreadPoolExecutor(max_workers=n) as ex:
        added = list(ex.map(add, range(n)))
    failed = [(p.cid, raw) for p, rc, raw in added if rc != 0]
    assert not failed, failed[:3]
    pods = [p for p, _, _ in added]
    v4 = {p.ip4() for p in pods}
    v6 = {p.ip6() for p in pods}
    assert len(v4) == n and len(v6) == n
    assert len(node.leases()) == n
    assert len(live_veths(node)) == n
    assert {l["master"] for l in live_veths(node).values()} == {"np0"}
    for p in pods:
        addrs = p.ns.addrs("eth0")
        assert f"{p.ip4()}/24" in addrs and f"{p.ip6()}/64" in addrs, (p.cid, addrs)

    target = pods[0]

    def ping(p):
        return p.cid, p.ns.ping(target.ip4(), wait=3), p.ns.ping(target.ip6(), wait=3)

    with ThreadPoolExecutor(max_workers=n) as ex:
        pings = list(ex.map(ping, pods[1:]))
    bad = [(cid, ok4, ok6) for cid, ok4, ok6 in pings if not (ok4 and ok6)]
    assert not bad, bad

    def delete(p):
        return del_pod(node, p)

    with ThreadPoolExecutor(max_workers=n) as ex:
        dels = list(ex.map(delete, pods))
    for rc, _, raw in dels:
        assert_del_ok(rc, None, raw)
    assert node.leases() == {}
    assert node.wait_no_graveyard()
    assert node.host_veths() == {}
    assert not [p.cid for p in pods if "eth0" in p.ns.links()]


# ----- 7. STATUS -----


def test_status_bridge_loss_and_recovery(node):
    rc, _, raw = _status(node)
    assert rc == 0 and raw == "", raw

    # No pods, bridge gone: 50.
    node.ns.exec(["ip", "link", "del", "np0"])
    assert "np0" not in node.ns.links()
    err = error_of(*_status(node))
    assert err["code"] == 50, err
    assert "np0" in err["msg"], err

    # ADD brings the bridge back.
    a, ra = node.add_pod("st1")
    assert "np0" in node.ns.links()
    assert node.ns.links()[host_if_of(ra)]["master"] == "np0"
    assert a.ns.ping(ra["ips"][0]["gateway"])
    rc, _, raw = _status(node)
    assert rc == 0, raw

    # A pod attached, bridge gone: 51.
    node.ns.exec(["ip", "link", "del", "np0"])
    err = error_of(*_status(node))
    assert err["code"] == 51, err

    # A new ADD recreates the bridge and works end to end.
    b, rb = node.add_pod("st2")
    links = node.ns.links()
    assert links["np0"]["linkinfo"]["info_kind"] == "bridge"
    assert links[host_if_of(rb)]["master"] == "np0"
    assert b.ns.ping(rb["ips"][0]["gateway"]), "IPv4 gateway after bridge recreation"
    assert b.ns.ping(rb["ips"][1]["gateway"]), "IPv6 gateway after bridge recreation"
    rc, _, raw = _status(node)
    assert rc == 0, raw


# ----- 8. Interface name conflict in the pod -----


def test_add_with_existing_ifname_fails_without_leaks(node):
    pod = new_pod(node, "dup")
    # A dummy if the kernel has the module, else one end of a veth pair inside the pod.
    if pod.ns.exec(["ip", "link", "add", "eth0", "type", "dummy"], check=False).returncode != 0:
        pod.ns.exec(["ip", "link", "add", "eth0", "type", "veth", "peer", "name", "eth0peer"])
    kind = pod.ns.links()["eth0"]["linkinfo"]["info_kind"]
    assert kind in ("dummy", "veth")
    rc, parsed, raw = node.cni("ADD", pod.cid, "eth0", pod.ns.path, conf=node.netconf())
    err = error_of(rc, parsed, raw)
    assert err["code"] == 100, err
    assert "eth0" in err["msg"], err
    assert node.leases() == {}
    assert node.wait_no_graveyard()
    assert node.host_veths() == {}
    # The pod's own interface was left alone.
    assert pod.ns.links()["eth0"]["linkinfo"]["info_kind"] == kind
    # A DEL for the failed attachment is harmless and does not remove the pod's interface.
    assert_del_ok(*node.cni("DEL", pod.cid, "eth0", pod.ns.path, conf=node.netconf()))
    assert "eth0" in pod.ns.links()


# ----- Follow-ups found while writing the above -----


def test_agent_killed_del_is_queued_and_drained(node):
    """Like the SIGTERM case, but the agent dies hard and leaves its socket file behind."""
    pod, res = node.add_pod("kill9")
    host_if = host_if_of(res)
    node.kill9()
    assert node.socket.exists(), "a SIGKILLed agent cannot remove its socket"
    assert_del_ok(*del_pod(node, pod))
    assert len(list(node.pending_dir.glob("del-*.json"))) == 1
    assert lease_key(pod.cid) in node.leases()
    node.start()
    wait_until(lambda: not list(node.pending_dir.glob("del-*.json")), what="pending delete drained")
    wait_until(lambda: lease_key(pod.cid) not in node.leases(), what="lease freed")
    # A retired link keeps its name until the reaper deletes it (at most about 1 s).
    assert node.wait_no_graveyard()
    assert host_if not in node.ns.links()
    assert node.host_veths() == {}


def test_bridge_recreation_reattaches_existing_pods(node):
    """When the bridge is lost and the agent re-creates it, pods attached before must get
    their network back (STATUS said 51, "pods affected"; after recovery it says 0)."""
    a, ra = node.add_pod("old")
    host_a = host_if_of(ra)
    node.ns.exec(["ip", "link", "del", "np0"])
    assert error_of(*_status(node))["code"] == 51
    b, rb = node.add_pod("new")  # re-creates the bridge
    assert b.ns.ping(rb["ips"][0]["gateway"])
    rc, _, raw = _status(node)
    assert rc == 0, raw
    # The node reports healthy, so the pod that was there before must be connected again.
    wait_until(lambda: node.ns.links()[host_a].get("master") == "np0", timeout=5,
               what=f"{host_a} (pod attached before the bridge was lost) back on np0")
    assert a.ns.ping(ra["ips"][0]["gateway"]), "IPv4 of the earlier pod after bridge recreation"
    assert a.ns.ping(ra["ips"][1]["gateway"]), "IPv6 of the earlier pod after bridge recreation"
    rc, _, raw = node.cni("CHECK", a.cid, "eth0", a.ns.path, conf=check_conf(node, ra))
    assert rc == 0, raw
