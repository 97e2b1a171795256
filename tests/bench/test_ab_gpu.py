"""`afore bench ab --engine gpu` on CPU: the real FFN node (launcher, scheduler, plan ring, FFN
worker processes, gloo connector) at tiny shapes, every policy on the same targets."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from afore.bench.ab_gpu import write_expert_checkpoint
from afore.cli import main
from afore.models.checkpoint import load_routed_experts, read_model_spec


def test_expert_checkpoint_reads_back(tmp_path):
    path = write_expert_checkpoint(tmp_path / "ck", hidden=16, intermediate=8, experts=4, top_k=2, layers=2, dtype="float32")
    spec = read_model_spec(path)
    assert (spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.top_k) == (16, 8, 4, 2)
    assert spec.moe_layer_indices == (0, 1)
    w = load_routed_experts(path, 1, torch.float32)
    assert w.w13.shape == (4, 16, 16) and w.w2.shape == (4, 16, 8)
    assert 0.01 < float(w.w13.std()) < 0.03
    before = (path / "experts-00000.safetensors").stat().st_mtime_ns
    write_expert_checkpoint(path, hidden=16, intermediate=8, experts=4, top_k=2, layers=2, dtype="float32")
    assert (path / "experts-00000.safetensors").stat().st_mtime_ns == before  # same arguments: reused


def _tiny_migration_report(path):
    rows = [{"model": "tiny", "experts": n, "bytes_per_expert": 3 * 64 * 32 * 4, "ms": 0.01 + 0.002 * n} for n in (1, 2, 4)]
    path.write_text(json.dumps({"device": "cpu (test)", "meta": {"date_utc": "2026-01-01T00:00:00Z"},
                                "kernels": {"beta_tile": {"tiny": {"tiles": [1, 2], "ms": [0.5, 0.6], "beta_tile_ms": 0.1,
                                                                   "intercept_ms": 0.4}}},
                                "copies": {"rows": rows}, "replay": {"median_window_ms": 1.0}}))


def test_bench_ab_gpu_engine_on_cpu_over_the_torch_connector(tmp_path):
    """--transport torch: the split roles' connector (gloo staged through the host on one device),
    every policy measured on the same targets."""
    cal = tmp_path / "migration.json"
    _tiny_migration_report(cal)
    argv = ["bench", "ab", "--engine", "gpu", "--device", "cpu", "--gpu-model", "tiny", "--layers", "2", "--steps", "2",
            "--warmup", "1", "--tokens", "8", "--microbatches", "2", "--policies", "static,afore", "--ffn-workers", "2",
            "--no-real", "--attention-ms", "1", "--calibration", str(cal), "--checkpoint-dir", str(tmp_path / "ck"),
            "--transport", "torch", "--out-dir", str(tmp_path / "out"), "--name", "abt"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out" / "abt.json").read_text())
    assert doc["transport"] == "torch" and "gloo staged through the host" in doc["layout"]
    for r in doc["policies"].values():
        assert r["measured"]["steps"] == 1 and r["measured"]["ffn_targets"] == 2 * 2 * 2
        assert r["measured"]["stage_means_ms"]["targets"] == 2 * 2  # the step after the warm-up, joined per target


def test_bench_ab_gpu_engine_on_cpu(tmp_path):
    """The whole GPU engine on CPU: the real FFN node (afore serve --role ffn --transport shm) driven
    by this process attached as the attention end of its shm segment, every process writing its
    stage trace, the simulator calibrated from those traces and compared per policy."""
    import dataclasses

    from afore.bench.ab_gpu import load_gpu_stage_calibration, simulate_policy_serial, simulation_inputs, workload_counts

    cal = tmp_path / "migration.json"
    _tiny_migration_report(cal)
    argv = ["bench", "ab", "--engine", "gpu", "--device", "cpu", "--gpu-model", "tiny", "--layers", "2", "--steps", "3",
            "--warmup", "1", "--tokens", "8", "--microbatches", "2", "--policies", "static,afore", "--ffn-workers", "2",
            "--no-real", "--attention-ms", "1", "--calibration", str(cal), "--checkpoint-dir", str(tmp_path / "ck"),
            "--out-dir", str(tmp_path / "out"), "--name", "abg"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "out" / "abg.json").read_text())
    assert doc["engine"] == "gpu" and doc["device"] == "cpu" and "sharing one device" in doc["layout"]
    assert doc["transport"] == "shm" and "shm transport" in doc["layout"] and "gloo" not in doc["layout"]
    assert doc["pipeline_mode"] == "serial" and doc["copy_rate_gbps"] == 50.0
    assert list(doc["policies"]) == ["static", "afore"]
    for name, r in doc["policies"].items():
        me = r["measured"]
        assert me["steps"] == 2 and me["step_ms_mean"] > 1.0 * 2  # two layer calls of >= 1 ms attention each
        assert me["ffn_targets"] == 3 * 2 * 2
        assert me["plans_used"] + me["primary_only_targets"] == me["ffn_targets"]  # on the scheduler's plan or primary-only
        # the traces of the driver, both FFN workers and the scheduler, joined per target (2 steps x 2 layers x 2 microbatches)
        assert me["stage_means_ms"]["targets"] == 2 * 2 * 2 and me["stage_means_ms"]["f2a_latency"] > 0
        for key in ("simulated", "simulated_traces", "simulated_static_traces"):
            assert r[key]["step_ms_mean"] > 0 and r["step_error" + key[len("simulated"):]] is not None
    assert doc["policies"]["static"]["measured"]["copies"] == 0
    trace = Path(doc["calibration"]["traces"]["path"])
    for who in ("0", "ffn0", "ffn1", "scheduler"):
        assert (trace.parent / f"{trace.name}.{who}.csv").is_file()

    # calibration b: the stage costs are the traces' (transport each way, vote, decode, scheduling), not the reports' 0s
    b, a = doc["calibration"]["traces"]["stages"], doc["calibration"]["reports"]["stages"]
    assert a["a2f_latency_ms"] == a["f2a_latency_ms"] == a["agreement_ms"] == 0.0  # the prior leaves them unmeasured
    means = {p: r["measured"]["stage_means_ms"] for p, r in doc["policies"].items()}
    for field, stage in (("a2f_latency_ms", "a2f_latency"), ("agreement_ms", "vote")):
        values = [m[stage] for m in means.values() if m[stage] is not None]
        assert b[field] > 0 and min(values) - 1e-9 <= b[field] <= max(values) + 1e-9  # the pooled mean of the policies'
    for p in doc["policies"]:
        assert b["schedule_ms"][p] == pytest.approx(means[p]["schedule"])  # each policy's own demand -> plan
    sources = json.loads((tmp_path / "out" / "abg_stages.json").read_text())["sources"]
    assert all("traces" in sources[k] for k in ("a2f_latency_ms", "f2a_latency_ms", "agreement_ms", "plan_decode_ms"))
    # a stage without samples is named, never a silent 0
    nm = doc["calibration"]["traces"]["not_measured"]
    assert all(isinstance(v, str) and v for v in nm.values())
    # the measured stages are on the simulated exchange's path: a serial layer call waits at least the
    # A2F latency, the vote and the F2A latency of its targets, one after the other
    for r in doc["policies"].values():
        floor = b["a2f_latency_ms"] + b["agreement_ms"] + b["f2a_latency_ms"]
        assert r["simulated_traces"]["exchange_ms_per_layer"] > floor > 0
    md = (tmp_path / "out" / "abg.md").read_text()
    assert "## Measured" in md and "| afore |" in md and "Calibration b" in md and "Not measured by the traces" in md
    assert np.isfinite(doc["policies"]["afore"]["measured"]["f2a_wait_ms_mean"])

    # the written calibration file is what a later run predicts with, and the step time follows its stages:
    # F2A latency + x ms -> every layer call of the serial data plane waits x ms longer
    stage_file = load_gpu_stage_calibration(tmp_path / "out" / "abg_stages.json", "tiny")
    assert stage_file["costs"].a2f_latency_ms == pytest.approx(b["a2f_latency_ms"])
    args = argparse.Namespace(calibration=str(cal), gpu_model="tiny", ffn_workers=2, redundant_slots=4, device="cpu",
                              seed=0, traces=None, no_real=True, microbatches=2, tokens=8)
    counts = workload_counts(args, 16, 4, 2, 3)
    calibration, traces, _, _ = simulation_inputs(args, counts, ["static", "afore"], 2)
    attention = np.full((3, 2), 1.0)

    def step(costs):
        return simulate_policy_serial(traces["static"], calibration, costs, stage_file["compute_offset_ms"], attention,
                                      counts.shape, "static", 1, 8)["step_ms_mean"]

    slower = dataclasses.replace(stage_file["costs"], f2a_latency_ms=stage_file["costs"].f2a_latency_ms + 3.0)
    assert step(slower) == pytest.approx(step(stage_file["costs"]) + 2 * 3.0)

    # --stage-calibration: a fourth column, predicted from the earlier run's file
    assert main(argv[:-2] + ["--name", "abg2", "--stage-calibration", str(tmp_path / "out" / "abg_stages.json")]) == 0
    doc2 = json.loads((tmp_path / "out" / "abg2.json").read_text())
    assert all(r["simulated_file"]["step_ms_mean"] > 0 for r in doc2["policies"].values())
    assert doc2["calibration"]["file"]["date_utc"] == doc["date_utc"]
