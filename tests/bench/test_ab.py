"""`afore bench ab` end to end on a tiny configuration, and its argument checks."""

import json

import matplotlib
import pytest

from afore.cli import main

matplotlib.use("Agg")


def test_bench_ab_tiny(tmp_path):
    rc = main(["bench", "ab", "--eps", "4,8", "--steps", "4", "--warmup", "1", "--layers", "2", "--tokens", "64",
               "--policies", "afore,harmoeny,afore-no-overlap", "--out-dir", str(tmp_path), "--name", "ab-test"])
    assert rc == 0
    doc = json.loads((tmp_path / "ab-test.json").read_text())
    assert doc["config"]["policies"] == ["static", "afore", "harmoeny", "afore-no-overlap"]  # static added as the reference
    assert doc["calibration"]["model"] == "GLM-4.5-Air" and doc["calibration"]["beta_tile_ms"] > 0
    assert doc["config"]["chains"] is True
    assert [e["ep"] for e in doc["per_ep"]] == [4, 8]
    names = [w["name"] for w in doc["workloads"]]
    assert any(n.startswith("synthetic-shift") for n in names) and "synthetic-chat" in names
    for ep in doc["per_ep"]:
        assert len(ep["workloads"]) == len(names)
        for r in ep["workloads"]:
            assert r["same_demand"]
            for name, p in r["policies"].items():
                assert p["steps"] == 3 and len(r["step_ms"][name]) == 4
                assert p["step_ms_p95"] >= p["step_ms_p50"] > 0 and p["throughput_tok_s"] > 0
                assert 0.0 <= p["zero_exposed_share"] <= 1.0
            assert r["policies"]["static"]["copies_per_target"] == 0
            assert r["policies"]["afore"]["max_mean_tile_load"] <= r["policies"]["static"]["max_mean_tile_load"]
        assert ep["summary"]["static"]["throughput_vs_static"] == 0.0
    md = (tmp_path / "ab-test.md").read_text()
    assert "Reading the numbers" in md and "| afore |" in md and "Command:" in md
    assert (tmp_path / "ab-test.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, field", [
    (["--eps", "0"], "eps"),
    (["--eps", "a,b"], "eps"),
    (["--policies", "static,nope"], "policies"),
    (["--steps", "4", "--warmup", "4"], "warmup"),
    (["--tokens", "0"], "tokens"),
    (["--attention-ms", "-1"], "attention_ms"),
    (["--window-ms", "nan"], "window_ms"),
    (["--transfer-ms", "-0.5"], "transfer_ms"),
    (["--redundant-slots", "-1"], "redundant_slots"),
    (["--calibration", "/nonexistent/migration.json"], "calibration"),
])
def test_bench_ab_bad_arguments(argv, field, capsys, tmp_path):
    assert main(["bench", "ab", "--out-dir", str(tmp_path), *argv]) == 2
    assert field in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_ab_trace_shorter_than_steps(tmp_path, capsys):
    folder = tmp_path / "harmoeny"
    folder.mkdir()
    rows = [",dataset,iteration,layer_idx," + ",".join(str(e) for e in range(128))]
    rows += [f"{i},tiny,{it},{layer}," + ",".join("1" for _ in range(128)) for i, (it, layer) in
             enumerate((it, layer) for it in range(2) for layer in range(6))]
    (folder / "expert_freq_switch128_datasets.csv").write_text("\n".join(rows) + "\n")
    argv = ["bench", "ab", "--traces", str(folder), "--eps", "8", "--layers", "1", "--tokens", "16", "--warmup", "0",
            "--policies", "static,afore", "--no-chains", "--out-dir", str(tmp_path / "out")]
    assert main(argv + ["--steps", "3"]) == 2
    assert "steps" in capsys.readouterr().err
    assert main(argv + ["--steps", "2"]) == 0
    doc = json.loads((tmp_path / "out" / "ab.json").read_text())
    assert "harmoeny-tiny" in [w["name"] for w in doc["workloads"]] and doc["config"]["chains"] is False
