"""One endpoint per pod: `afore serve`'s API port /metrics carries vLLM's families and afore's,
by the naming rules (afore.metrics.conventions) and clean under `promtool check metrics`; the
balance, migration and plan figures move when requests are served; every afore family the
Grafana dashboard queries is one this endpoint exports (docs/metrics.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from servers import PROMPTS, AforeServer, http, needs_vllm

from afore.metrics.conventions import check_exposition, family_names

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "components" / "monitoring" / "afore-dashboard.json"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        # a missing tool is a broken environment, not a reason to pass without the check
        pytest.fail("promtool not found on PATH: install Debian's prometheus package (apt-get install prometheus)")
    return path


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of every afore sample."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("afore_"):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(values: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    return sum(v for (n, lab), v in values.items() if n == name and labels.items() <= dict(lab).items())


def afore_only(text: str) -> str:
    """The lines of afore's families (HELP, TYPE and samples)."""
    keep = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else line
        if name.startswith("afore_"):
            keep.append(line)
    return "\n".join(keep) + "\n"


@pytest.fixture(scope="module")
def server(qwen3_model, log_dir):
    srv = AforeServer(qwen3_model, os.path.join(log_dir, "afore-metrics.log"), attn_workers=1, ffn_workers=2, policy="afore")
    yield srv
    srv.stop()


def scrape(srv) -> str:
    code, text = http("GET", srv.url + "/metrics", timeout=30)
    assert code == 200, text
    return text


def test_one_endpoint_carries_afore_figures_that_move(server):
    tool = promtool()
    before = samples(scrape(server))
    for prompt in PROMPTS:
        code, out = server.complete(prompt, max_tokens=16)
        assert code == 200, out
    time.sleep(1.5)  # the scheduler copies its segments' counters every 0.5 s
    text = scrape(server)
    after = samples(text)

    assert any(line.startswith("vllm:") for line in text.splitlines()), "vLLM's own families are gone"
    assert check_exposition(text) == []
    out = subprocess.run([tool, "check", "metrics"], input=afore_only(text), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr

    def moved(name: str, **labels: str) -> float:
        delta = total(after, name, **labels) - total(before, name, **labels)
        assert delta > 0, f"{name}{labels} did not move ({total(before, name, **labels)} -> {total(after, name, **labels)})"
        return delta

    # plans
    planned = moved("afore_scheduler_plans_total", policy="afore")
    moved("afore_scheduler_demand_to_plan_seconds_count", policy="afore")
    moved("afore_ring_reader_entries_total", policy="afore", outcome="copied")
    for w in ("0", "1"):
        moved("afore_ffn_targets_total", worker=w)
        moved("afore_ffn_plans_total", worker=w, outcome="used")
        # migration: one record per planned target on each worker
        moved("afore_ffn_lookahead_window_seconds_count", worker=w)
        moved("afore_ffn_target_copies_count", worker=w)
    # balance: every published plan and its primary-only placement, per layer
    plan_count = moved("afore_scheduler_tile_imbalance_count", policy="afore", placement="plan")
    assert plan_count <= planned
    moved("afore_scheduler_tile_imbalance_count", policy="afore", placement="primary_only")
    layers = {dict(lab)["layer"] for (n, lab) in after if n == "afore_scheduler_tile_imbalance_window"}
    assert layers, "no per-layer imbalance gauge"
    for layer in layers:
        got = total(after, "afore_scheduler_tile_imbalance_window", layer=layer, placement="plan")
        assert got >= 1.0, f"layer {layer}: max/mean tile load below 1 ({got})"
    assert total(after, "afore_scheduler_policy", policy="afore") == 1.0


def test_dashboard_queries_only_exported_families(server):
    text = scrape(server)
    exported = family_names(text)
    # a counter is exported as NAME_total, a histogram as NAME_bucket/_sum/_count
    suffixes = ("_total", "_bucket", "_sum", "_count")
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"\bafore_[a-z0-9_]+", target["expr"]):
                base = next((name[: -len(s)] for s in suffixes if name.endswith(s) and name[: -len(s)] in exported), name)
                queried.add(base)
    assert queried, "the dashboard queries no afore family"
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries families the endpoint does not export: {missing}"
