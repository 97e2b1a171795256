"""deploy/: the NetworkPolicy of every overlay admits only what docs/deploy.md says.

The store, the gloo/NCCL data plane and the demand receiver are unauthenticated (or token-only)
and trust their network: each deployment's pods, and no one else, may reach every port; the
admin port is also open to pods of the namespace, the API port (`http`) to anyone. Checked on the
rendered manifests, label selectors matched against the pod templates the way Kubernetes does.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())


@functools.cache
def rendered(overlay: str) -> tuple:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found on PATH: deploy/ overlays cannot be rendered (install kubectl >= 1.27)")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def pod_templates(docs) -> list[tuple[str, dict]]:
    """(deployment name, pod template) of every LeaderWorkerSet role."""
    out = []
    for d in docs:
        if d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if key in lwt:
                    out.append((d["metadata"]["name"], lwt[key]))
    return out


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked here, got {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def container_ports(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


def admitted(policy: dict, peer_labels: dict | None, port_name: str) -> bool:
    """Would ``policy`` admit a connection to ``port_name`` from a pod of this namespace with
    ``peer_labels`` (None: from outside the namespace)?"""
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports is not None and port_name not in {p["port"] for p in ports}:
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            assert set(peer) == {"podSelector"}, f"only podSelector peers are checked here, got {peer}"
            if peer_labels is not None and selects(peer["podSelector"], peer_labels):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_covered_and_only_the_api_is_open_to_all(overlay):
    docs = rendered(overlay)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    templates = pod_templates(docs)
    assert templates and policies
    for name, template in templates:
        labels = template["metadata"]["labels"]
        mine = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert len(mine) == 1, f"{overlay}: pods of {name} covered by {len(mine)} NetworkPolicies"
        policy = mine[0]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for port in container_ports(template):
            assert admitted(policy, labels, port), f"{overlay}: {name}'s own pods cannot reach port {port}"
            assert admitted(policy, None, port) == (port == "http"), f"{overlay}: port {port} open to anyone"
            assert admitted(policy, {"app": "something-else"}, port) == (port in ("http", "admin"))
        for port in ("store-or-data-plane-ephemeral",):  # ports not declared: the gloo/NCCL data plane
            assert admitted(policy, labels, port) and not admitted(policy, {"app": "x"}, port)


def test_an_ab_arm_does_not_admit_the_other_arms():
    docs = rendered("ab")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    templates = pod_templates(docs)
    assert len(templates) == 3 and len(policies) == 3
    for name, template in templates:
        policy = next(p for p in policies if selects(p["spec"]["podSelector"], template["metadata"]["labels"]))
        for other_name, other in templates:
            if other_name != name:
                assert not admitted(policy, other["metadata"]["labels"], "store-or-data-plane-ephemeral"), \
                    f"{other_name} reaches the internal ports of {name}"
