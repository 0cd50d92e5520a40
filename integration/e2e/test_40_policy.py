"""NetworkPolicy as the API says, enforced on both nodes: before any policy every pod reaches
the web servers; a default-deny ingress policy plus one admitting `role: client` on TCP 80
lets only the clients in, from either node, over IPv4 and IPv6; deleting the policies lifts
it again."""

import itertools

import kube
from cluster import kubectl, wait_for

WEB = ["httpd", "-f", "-p", "80", "-h", "/www"]


def web_pod(name, ns, node):
    p = kube.busybox_pod(name, ns, node=node,
                         command=("sh", "-c", "mkdir -p /www && echo ok > /www/index.html && exec " + " ".join(WEB)))
    p["metadata"]["labels"]["role"] = "web"
    return p


def client_pod(name, ns, node, role):
    p = kube.busybox_pod(name, ns, node=node)
    if role:
        p["metadata"]["labels"]["role"] = role
    return p


def reaches(src, ns, ip):
    """An HTTP request by hand (busybox's static wget cannot resolve even a literal address)."""
    r = kubectl(["exec", "-i", "-n", ns, src, "--", "nc", "-w", "2", ip, "80"], check=False,
                input="GET / HTTP/1.0\r\n\r\n")
    return r.returncode == 0 and r.stdout.rstrip().endswith("\nok")


def matrix(ns, clients, webs):
    """{(client, web ip): reached?} for every client and every address of every web pod."""
    return {(c, ip): reaches(c, ns, ip) for c, w in itertools.product(clients, webs)
            for ip in kube.pod_ips(kube.get("pod", w, ns))}


def test_network_policy_denies_and_admits_on_both_nodes(ns, workers):
    webs = [f"web-{w}" for w in workers]
    clients = [f"client-{w}" for w in workers]
    others = [f"other-{w}" for w in workers]
    kube.apply(*(web_pod(f"web-{w}", ns, w) for w in workers),
               *(client_pod(f"client-{w}", ns, w, "client") for w in workers),
               *(client_pod(f"other-{w}", ns, w, None) for w in workers))
    for p in webs + clients + others:
        kube.wait_running(p, ns)
    before = matrix(ns, clients + others, webs)
    assert all(before.values()), [k for k, v in before.items() if not v]

    kube.apply(
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "deny", "namespace": ns},
         "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}},
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
         "metadata": {"name": "clients-to-web", "namespace": ns},
         "spec": {"podSelector": {"matchLabels": {"role": "web"}}, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                               "ports": [{"protocol": "TCP", "port": 80}]}]}})
    wait_for(lambda: not any(reaches(o, ns, ip) for o in others for w in webs
                             for ip in kube.pod_ips(kube.get("pod", w, ns))), 30, "the policy to take effect")
    during = matrix(ns, clients + others, webs)
    assert all(v for (c, _), v in during.items() if c in clients), during
    assert not any(v for (c, _), v in during.items() if c in others), during

    kubectl(["delete", "networkpolicy", "clients-to-web", "-n", ns])
    wait_for(lambda: not any(matrix(ns, clients, webs).values()), 30, "default deny to block the clients too")
    kubectl(["delete", "networkpolicy", "deny", "-n", ns])
    wait_for(lambda: all(matrix(ns, clients + others, webs).values()), 30, "every pod to be admitted again")
