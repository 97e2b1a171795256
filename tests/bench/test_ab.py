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
                # judged over the targets that ran with copies; none: no share at all
                if p["targets_with_copies"]:
                    assert 0.0 <= p["zero_exposed_share"] <= 1.0
                else:
                    assert p["zero_exposed_share"] is None
                assert p["exposed_ms_per_target_with_copies"] >= p["exposed_ms_per_target"] >= 0.0
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


def test_bench_ab_modes_and_honest_exposure(tmp_path):
    argv = ["bench", "ab", "--eps", "8", "--steps", "4", "--warmup", "1", "--layers", "2", "--tokens", "64", "--no-real",
            "--policies", "afore,harmoeny", "--out-dir", str(tmp_path)]
    docs = {}
    for mode in ("serial", "pingpong"):
        assert main(argv + ["--mode", mode, "--name", mode]) == 0
        docs[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
        assert docs[mode]["config"]["mode"] == mode
        assert f"{mode} mode" in (tmp_path / f"{mode}.md").read_text()
    for mode, other in (("serial", "pingpong"), ("pingpong", "serial")):
        for r in docs[mode]["per_ep"][0]["workloads"]:
            for name, p in r["policies"].items():
                # each report carries the other mode's throughput of the same plans, which the other report measured
                twin = next(w for w in docs[other]["per_ep"][0]["workloads"] if w["workload"] == r["workload"])
                assert p[f"throughput_tok_s_{other}"] == pytest.approx(twin["policies"][name]["throughput_tok_s"])
            # HarMoEny's copies block its targets: exposed on every target that has copies, whatever its own claim
            h = r["policies"]["harmoeny"]
            if h["targets_with_copies"]:
                assert h["zero_exposed_share"] == 0.0 and h["exposed_ms_per_target_with_copies"] > 0
    cal = docs["serial"]["calibration"]
    assert cal["source"]["report_date_utc"] and cal["stages"]["8"]["costs"]["plan_decode_ms"] > 0
    assert "transport_h200.json" in cal["stages"]["8"]["sources"]["plan_decode_ms"]
