"""deploy/components/monitoring: every overlay renders with it, its PodMonitor scrapes each afore
pod exactly once, on the port whose /metrics `afore serve` serves for that pod's role, and the
Grafana dashboard it ships parses and queries documented families only. The endpoint's actual
families are checked against the dashboard in tests/serve/test_serve_metrics.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from test_deploy import DEPLOY, OVERLAYS, REPO, kubectl, of_kind, pod_labels, pod_options, pod_template, pods, serve_container  # noqa: E402

COMPONENT = DEPLOY / "components" / "monitoring"
DASHBOARD = COMPONENT / "afore-dashboard.json"
METRICS_DOC = REPO / "docs" / "metrics.md"
METRICS_PORT_LABEL = "afore.dev/metrics-port"


def render_with_monitoring(overlay: str, tmp_path: Path) -> list[dict]:
    """``overlay`` with the monitoring component, as a user adds it (a kustomization that
    includes both; kustomize wants relative paths)."""
    root = tmp_path / f"with-monitoring-{overlay}"
    root.mkdir()
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    (root / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel(DEPLOY / "overlays" / overlay)], "components": [rel(COMPONENT)]}))
    out = subprocess.run([kubectl(), "kustomize", str(root)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {overlay} + components/monitoring failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def selects(monitor: dict, labels: dict[str, str]) -> bool:
    return monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def kept_endpoints(monitor: dict, labels: dict[str, str]) -> list[dict]:
    """The endpoints whose relabelings keep a pod with ``labels`` (keep rules on pod labels only)."""
    out = []
    for ep in monitor["spec"]["podMetricsEndpoints"]:
        keep = True
        for rule in ep.get("relabelings", []):
            assert rule["action"] == "keep", rule
            (source,) = rule["sourceLabels"]
            name = source.removeprefix("__meta_kubernetes_pod_label_")
            value = next((v for k, v in labels.items() if re.sub(r"[^a-zA-Z0-9_]", "_", k) == name), "")
            keep &= re.fullmatch(rule["regex"], value) is not None
        if keep:
            out.append(ep)
    return out


def metrics_port_of(opts) -> int:
    """The port `afore serve` serves the pod's /metrics on: vLLM's API port, or on the FFN node
    (no vLLM) the admin port (afore.serve.launcher.Launcher.metrics_exposition)."""
    return opts.admin if opts.role == "ffn" else opts.port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_podmonitor_scrapes_each_pod_once_on_its_metrics_port(overlay, tmp_path):
    docs = render_with_monitoring(overlay, tmp_path)
    monitors = of_kind(docs, "PodMonitor")
    assert len(monitors) == 1 and monitors[0]["apiVersion"] == "monitoring.coreos.com/v1"
    monitor = monitors[0]
    for lws, index in pods(docs):
        where = f"{overlay}: {lws['metadata']['name']}/{index}"
        labels = pod_labels(lws, index)
        assert selects(monitor, labels), f"{where}: the PodMonitor does not select the pod"
        kept = kept_endpoints(monitor, labels)
        assert len(kept) == 1, f"{where}: {len(kept)} scrape endpoints keep the pod, expected one"
        ep = kept[0]
        assert ep["path"] == "/metrics"
        ports = {p["name"]: p["containerPort"] for p in serve_container(lws, index).get("ports", [])}
        assert ep["port"] in ports, f"{where}: the pod has no port named {ep['port']}"
        opts = pod_options(lws, docs, index)
        assert ports[ep["port"]] == metrics_port_of(opts), \
            f"{where}: scrapes {ep['port']}={ports[ep['port']]}, afore serve --role {opts.role} serves /metrics on {metrics_port_of(opts)}"
        notes = pod_template(lws, index)["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true" and notes.get("prometheus.io/path") == "/metrics"
        assert int(notes["prometheus.io/port"]) == metrics_port_of(opts), f"{where}: prometheus.io/port"


def test_podmonitor_check_rejects_a_pod_without_the_label():
    monitor = yaml.safe_load((COMPONENT / "podmonitor.yaml").read_text())
    assert kept_endpoints(monitor, {"app.kubernetes.io/name": "afore"}) == []
    assert [e["port"] for e in kept_endpoints(monitor, {METRICS_PORT_LABEL: "admin"})] == ["admin"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dashboard_configmap_renders_with_the_overlay(overlay, tmp_path):
    docs = render_with_monitoring(overlay, tmp_path)
    maps = [m for m in of_kind(docs, "ConfigMap") if m["metadata"]["name"] == "afore-grafana-dashboard"]
    assert len(maps) == 1
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"  # Grafana's sidecar loads it
    assert json.loads(maps[0]["data"]["afore-dashboard.json"]) == json.loads(DASHBOARD.read_text())


def dashboard_families(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bafore_[a-z0-9_]+", target["expr"]):
                names.add(re.sub(r"_(total|bucket|sum|count)$", "", name))
    return names


def test_dashboard_parses_and_queries_documented_families():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "inter-token latency", "imbalance", "migration", "plans"):
        assert topic in titles, f"no panel on {topic}"
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    documented = set(re.findall(r"`(afore_[a-z0-9_]+)", METRICS_DOC.read_text()))
    documented = {re.sub(r"_total$", "", n) for n in documented}
    missing = sorted(dashboard_families(dashboard) - documented)
    assert not missing, f"dashboard families not in docs/metrics.md: {missing}"
    assert {"afore_scheduler_tile_imbalance_window", "afore_ffn_copies", "afore_ffn_plans"} <= dashboard_families(dashboard)
