"""The install as an operator sees it: before nodeplane every node was NotReady because the
runtime had no network configuration; after `kubectl apply -k` the controller leads, one
agent runs on every worker, each wrote its CNI configuration, and only then are the nodes
Ready."""

import json

import cluster
import kube


def test_nodes_were_not_ready_until_the_agents_wrote_the_cni_configuration(workers):
    before = cluster.load_state()["before_install"]
    assert sorted(before) == sorted(workers)
    for name, cond in before.items():
        assert cond["status"] == "False", (name, cond)
        assert "cni" in cond["message"].lower() or "network" in cond["message"].lower(), (name, cond)
    for w in workers:
        node = kube.node_named(w)
        conflist = kube.on_node(node, ["cat", "/etc/cni/net.d/10-nodeplane.conflist"]).stdout
        assert json.loads(conflist)["name"] == "nodeplane"
        assert kube.on_node(node, ["test", "-x", "/opt/cni/bin/nodeplane"], check=False).returncode == 0
        status = kube.get("node", w)["status"]
        assert any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])


def test_one_agent_per_worker_and_the_controller_leads(workers):
    agents = [p for p in kube.get("pods", ns="nodeplane-system")["items"]
              if p["metadata"]["labels"].get("app.kubernetes.io/component") == "agent"]
    assert sorted(p["spec"]["nodeName"] for p in agents) == sorted(workers)
    lease = kube.get("lease", "nodeplane-controller", "nodeplane-system")
    holder = lease["spec"]["holderIdentity"]
    controllers = [p["metadata"]["name"] for p in kube.get("pods", ns="nodeplane-system")["items"]
                   if p["metadata"]["labels"].get("app.kubernetes.io/component") == "controller"]
    assert any(c in holder for c in controllers), (holder, controllers)
    registered = {n["metadata"]["name"] for n in kube.get("nodeplanenodes")["items"]}
    assert registered == set(workers)
