"""`afore bench scheduler` on a tiny subset, and the shared report writer."""

import json

import matplotlib
import pytest

from afore.bench.report import markdown_table, write_report
from afore.cli import main

matplotlib.use("Agg")


def test_write_report(tmp_path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    paths = write_report("demo", {"x": [1, 2]}, "# Demo\n\n" + markdown_table(["a", "b"], [[1, 2.345678]]), fig, out_dir=tmp_path)
    doc = json.loads(paths["json"].read_text())
    assert doc["x"] == [1, 2] and "command" in doc["meta"]
    md = paths["md"].read_text()
    assert "| a | b |" in md and "2.346" in md and "Command:" in md
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="name"):
        write_report("../x", {}, "", out_dir=tmp_path)


def test_bench_scheduler_tiny(tmp_path):
    rc = main(["bench", "scheduler", "--quick", "--eps", "4", "--targets-per-workload", "3", "--out-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "scheduler-quick.json").read_text())
    (ep,) = doc["per_ep"]
    assert ep["ep"] == 4 and ep["targets"] == len(doc["targets"]) >= 3
    assert ep["core_matches_reference"] == ep["targets"]
    for t in doc["targets"]:
        assert t["optimum"] is None or t["greedy"] >= t["optimum"] >= t["lower_bound"]
        assert t["core_ns"] > 0 and t["reference_ns"] > 0
    assert set(ep["policies"]) >= {"static", "afore", "eplb", "harmoeny", "lina", "libra"}
    assert ep["policies"]["afore"]["max_mean_tile_load"] <= ep["policies"]["static"]["max_mean_tile_load"]
    assert (tmp_path / "scheduler-quick.png").exists() and "Quality" in (tmp_path / "scheduler-quick.md").read_text()
    # Ejection chains on by default; the paper's rule alone is planned on the same inputs.
    assert doc["config"]["chains"] and "Beyond the paper" in (tmp_path / "scheduler-quick.md").read_text()
    for t in doc["targets"]:
        assert t["optimum"] is None or t["greedy_paper"] >= t["optimum"]
    assert ep["optimal_paper"] == sum(1 for t in doc["targets"] if t["greedy_paper"] == t["optimum"])


def test_bench_scheduler_without_chains_plans_the_paper_algorithm(tmp_path):
    rc = main(["bench", "scheduler", "--quick", "--eps", "8", "--targets-per-workload", "3", "--no-policies",
               "--no-chains", "--out-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "scheduler-quick.json").read_text())
    assert doc["config"]["chains"] is False
    assert all(t["greedy"] == t["greedy_paper"] for t in doc["targets"])
    assert "Ejection chains off" in (tmp_path / "scheduler-quick.md").read_text()


def test_bench_scheduler_bad_arguments(capsys):
    assert main(["bench", "scheduler", "--eps", "0"]) == 2
    assert "eps" in capsys.readouterr().err


def test_holdout_retries_unproven_targets_with_the_longer_limit(monkeypatch):
    """``--holdout-retry-limit S``: a hold-out target the MILP left at the time limit is certified
    again with S seconds (and marked retried); proven ones are not certified twice; 0 = no retry."""
    from afore.bench import scheduler as bench
    from afore.config import CostModel
    from afore.scheduler.optimal import Certificate

    calls = []

    def fake_certify(shape, demand, table, protected, params, time_limit_s, incumbent=None):
        calls.append(time_limit_s)
        first = len(calls) % 2 == 1
        return Certificate(optimum=None if first else 7, lower_bound=6, upper_bound=7,
                           status="time-limit" if first else "optimal", method="milp", solve_s=time_limit_s)

    monkeypatch.setattr(bench, "certify", fake_certify)
    config = {"holdout": 2, "seed": 0, "time_limit_s": 2.0, "repeats": 1, "holdout_retry_limit_s": 30.0}
    rows = bench.bench_holdout("cold", config, CostModel())
    assert calls == [2.0, 30.0, 2.0, 30.0]
    assert all(r["retried"] and r["status"] == "optimal" and r["optimum"] == 7 for r in rows)
    calls.clear()
    rows = bench.bench_holdout("cold", {**config, "holdout_retry_limit_s": 0.0}, CostModel())
    assert calls == [2.0, 2.0] and not any(r["retried"] for r in rows)
