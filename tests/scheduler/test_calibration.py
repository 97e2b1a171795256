"""Calibration files (afore.scheduler.calibration) and `afore calibrate`."""

import json
import logging

import numpy as np
import pytest

from afore.config import CostModel
from afore.scheduler.calibrate_cli import add_arguments, run
from afore.scheduler.calibration import (Calibration, ExpertShape, calibration_path, device_slug,
                                         from_migration_report, measure_local, read_calibration,
                                         resolve_cost_model, write_calibration)
from afore.scheduler.cost import default_report_path, load_cost_model

QWEN3_30B = ExpertShape(hidden_size=2048, intermediate_size=768, dtype="bfloat16", m_tile=16)


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AFORE_CALIBRATION_DIR", str(tmp_path / "cal"))
    return tmp_path / "cal"


def test_expert_shape_bytes_slug_and_validation():
    assert QWEN3_30B.bytes_per_expert == 3 * 2048 * 768 * 2
    assert QWEN3_30B.slug == "h2048-i768-bfloat16-m16"
    with pytest.raises(ValueError, match="hidden_size"):
        ExpertShape(0, 768)
    with pytest.raises(ValueError, match="dtype"):
        ExpertShape(2048, 768, "int3")
    assert device_slug("NVIDIA H200") == "nvidia-h200"


def test_the_committed_h200_report_becomes_the_calibration_of_its_shape(calibration_dir):
    cal = from_migration_report(default_report_path(), QWEN3_30B)
    assert cal.device == "NVIDIA H200" and cal.cost == load_cost_model(default_report_path())
    assert cal.cost != CostModel()  # measured, not the defaults
    path = write_calibration(cal)
    assert path == calibration_dir / "nvidia-h200-h2048-i768-bfloat16-m16.json"
    assert read_calibration(path) == cal


def test_a_report_of_another_expert_shape_is_refused():
    with pytest.raises(ValueError, match="bytes_per_expert"):
        from_migration_report(default_report_path(), ExpertShape(4096, 1536, "bfloat16"))


def test_resolve_explicit_then_lookup_then_defaults_and_says_which(calibration_dir, caplog):
    cal = from_migration_report(default_report_path(), QWEN3_30B)
    caplog.set_level(logging.INFO, logger="afore.scheduler.calibration")
    cost, source = resolve_cost_model(None, "NVIDIA H200", QWEN3_30B)
    assert cost == CostModel() and source == "defaults"
    assert "defaults" in caplog.text and "afore calibrate" in caplog.text
    path = write_calibration(cal)
    assert resolve_cost_model(None, "NVIDIA H200", QWEN3_30B) == (cal.cost, str(path))
    other = write_calibration(Calibration("cpu", QWEN3_30B, CostModel(window_ms=3.0), "measured"),
                              calibration_dir / "mine.json")
    assert resolve_cost_model(str(other), "NVIDIA H200", QWEN3_30B)[0].window_ms == 3.0
    assert str(other) in caplog.text


@pytest.mark.parametrize("content,message", [
    ("not json", "calibration"), (json.dumps({"device": "cpu"}), "expert"),
    (json.dumps({"device": "cpu", "expert": {"hidden_size": 8, "intermediate_size": 8}, "source": "x",
                 "cost": {"beta_tile_ms": -1}}), "beta_tile_ms"),
])
def test_malformed_calibration_files_name_the_field(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_calibration(path)
    with pytest.raises(ValueError, match="existing file"):
        read_calibration(tmp_path / "missing.json")


def test_measure_local_gives_finite_positive_costs_for_the_shape():
    shape = ExpertShape(64, 32, "float32", m_tile=8)
    cal = measure_local(shape, "cpu", repeats=3)
    c = cal.cost
    assert cal.device == "cpu" and cal.source == "measured"
    assert c.bytes_per_expert == shape.bytes_per_expert
    assert np.isfinite([c.beta_tile_ms, c.link_bandwidth_gbps, c.copy_latency_ms]).all()
    assert c.beta_tile_ms > 0 and c.link_bandwidth_gbps > 0 and c.copy_latency_ms >= 0
    assert measure_local(shape, "cpu", repeats=1, window_ms=2.5).cost.window_ms == 2.5


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


def test_afore_calibrate_writes_the_lookup_file_and_refuses_bad_input(calibration_dir, capsys):
    assert _cli(["--from-report", str(default_report_path()), "--hidden", "2048", "--intermediate", "768"]) == 0
    assert calibration_path("NVIDIA H200", QWEN3_30B).is_file()
    assert _cli(["--show", str(calibration_path("NVIDIA H200", QWEN3_30B))]) == 0
    assert "NVIDIA H200" in capsys.readouterr().out
    assert _cli(["--from-report", str(default_report_path()), "--hidden", "2048", "--intermediate", "1536"]) == 2
    assert "bytes_per_expert" in capsys.readouterr().err
    assert _cli(["--measure"]) == 2
    assert "hidden" in capsys.readouterr().err


def test_afore_scheduler_and_afore_serve_find_the_calibration_of_their_shape(calibration_dir):
    import argparse

    from afore.scheduler.calibration import serving_cost_model
    from afore.scheduler.service_cli import add_arguments as scheduler_arguments, config_from_args

    parser = argparse.ArgumentParser()
    scheduler_arguments(parser)
    shape = "E=128,F=8,L=4,R=2,M=16,K=8"
    assert config_from_args(parser.parse_args(["--shape", shape])).cost == CostModel()  # nothing to look up
    cal = Calibration("cpu", QWEN3_30B, CostModel(beta_tile_ms=0.02, window_ms=0.7), "measured")
    write_calibration(cal)
    got = config_from_args(parser.parse_args(["--shape", shape, "--expert", "2048,768,bfloat16", "--device", "cpu"]))
    assert got.cost == cal.cost
    with pytest.raises(ValueError, match="expert"):
        config_from_args(parser.parse_args(["--shape", shape, "--expert", "2048"]))
    assert serving_cost_model("", "cpu", 2048, 768, "bfloat16", 16) == cal.cost
    assert serving_cost_model("", "cpu", 2048, 1536, "bfloat16", 16) == CostModel()  # another shape: defaults
