"""`afore bench ab --engine gpu` on CPU: the real FFN node (launcher, scheduler, plan ring, FFN
worker processes, gloo connector) at tiny shapes, every policy on the same targets."""

import json

import numpy as np
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


def test_bench_ab_gpu_engine_on_cpu(tmp_path):
    cal = tmp_path / "migration.json"
    _tiny_migration_report(cal)
    rc = main(["bench", "ab", "--engine", "gpu", "--device", "cpu", "--gpu-model", "tiny", "--layers", "2", "--steps", "3",
               "--warmup", "1", "--tokens", "8", "--microbatches", "2", "--policies", "static,afore", "--ffn-workers", "2",
               "--no-real", "--attention-ms", "1", "--calibration", str(cal), "--checkpoint-dir", str(tmp_path / "ck"),
               "--out-dir", str(tmp_path / "out"), "--name", "abg"])
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "abg.json").read_text())
    assert doc["engine"] == "gpu" and doc["device"] == "cpu" and "sharing one device" in doc["layout"]
    assert list(doc["policies"]) == ["static", "afore"]
    for name, r in doc["policies"].items():
        me = r["measured"]
        assert me["steps"] == 2 and me["step_ms_mean"] > 1.0 * 2  # two layer calls of >= 1 ms attention each
        assert me["ffn_targets"] == 3 * 2 * 2
        assert me["plans_used"] + me["primary_only_targets"] == me["ffn_targets"]  # on the scheduler's plan or primary-only
        assert r["simulated"]["step_ms_mean"] > 0 and r["step_error"] is not None
    assert doc["policies"]["static"]["measured"]["copies"] == 0
    md = (tmp_path / "out" / "abg.md").read_text()
    assert "measured" in md and "| afore |" in md and "Simulated side" in md
    assert np.isfinite(doc["policies"]["afore"]["measured"]["f2a_wait_ms_mean"])
