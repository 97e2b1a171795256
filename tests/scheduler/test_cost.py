"""Cost model loading (afore.scheduler.cost): from a migration report, else the defaults."""

from __future__ import annotations

import json

import pytest

from afore.config import CostModel
from afore.scheduler import cost as cost_module
from afore.scheduler.cost import load_cost_model

MEASURED = {"beta_tile_ms": 0.0052, "bytes_per_expert": 25165824, "link_bandwidth_gbps": 280.5,
            "copy_latency_ms": 0.015, "window_ms": 0.42}


def write(tmp_path, report) -> str:
    path = tmp_path / "migration.json"
    path.write_text(report if isinstance(report, str) else json.dumps(report))
    return str(path)


def test_reads_the_measured_figures(tmp_path):
    path = write(tmp_path, {"command": "afore bench migration", "cost_model": dict(MEASURED, source="h200")})
    model = load_cost_model(path)
    assert model == CostModel(**MEASURED)
    assert model.copy_ms == pytest.approx(0.015 + 25165824 / 280.5e9 * 1e3)


def test_missing_keys_keep_their_defaults(tmp_path):
    model = load_cost_model(write(tmp_path, {"cost_model": {"beta_tile_ms": 0.01}}))
    assert model.beta_tile_ms == 0.01
    assert model.window_ms == CostModel().window_ms
    assert load_cost_model(write(tmp_path, {"results": []})) == CostModel()


def test_falls_back_to_defaults_without_a_committed_report(tmp_path, monkeypatch):
    monkeypatch.setattr(cost_module, "default_report_path", lambda: tmp_path / "absent.json")
    assert load_cost_model() == CostModel()
    monkeypatch.setattr(cost_module, "default_report_path", lambda: tmp_path / "migration.json")
    write(tmp_path, {"cost_model": MEASURED})
    assert load_cost_model() == CostModel(**MEASURED)


def test_default_report_path_is_the_committed_bench_result():
    path = cost_module.default_report_path()
    assert path.parts[-3:] == ("bench", "results", "migration.json")
    assert (path.parents[2] / "afore" / "scheduler" / "cost.py").is_file()


@pytest.mark.parametrize("report,message", [
    ({"cost_model": {"beta_tile_ms": "fast"}}, "cost_model.beta_tile_ms: expected a finite number"),
    ({"cost_model": {"window_ms": True}}, "cost_model.window_ms: expected a finite number"),
    ({"cost_model": {"bytes_per_expert": 1.5}}, "cost_model.bytes_per_expert: expected an integer"),
    ({"cost_model": {"link_bandwidth_gbps": 0}}, "cost_model.link_bandwidth_gbps: expected > 0"),
    ({"cost_model": {"copy_latency_ms": -1}}, "cost_model.copy_latency_ms: expected a finite value >= 0"),
    ({"cost_model": [1, 2]}, "cost_model: expected an object"),
    ([1, 2], "cost model report: expected a JSON object"),
    ("{not json", "cost model report: expected JSON"),
])
def test_bad_reports_raise_value_error_naming_the_field(tmp_path, report, message):
    with pytest.raises(ValueError, match=message):
        load_cost_model(write(tmp_path, report))


def test_an_explicit_missing_path_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="cost model report: expected an existing file"):
        load_cost_model(tmp_path / "nope.json")
