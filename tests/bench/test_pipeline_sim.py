"""The AFD pipeline simulator: pipeline math on hand-computed cases, calibration, policy replay."""

import json

import numpy as np
import pytest

from afore.bench.pipeline_sim import (Calibration, balanced_attention_ms, calibration_from_report, demand_digest, ffn_stage_ms,
                                      run_policy, simulate_pipeline, summarise)
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler.cost import default_report_path
from afore.scheduler.policies import POLICY_NAMES
from afore.traces.synthetic import SyntheticSpec, generate

POLICY_OPTIONS = {"eplb": {"window": 4, "period": 2}, "eplb-async": {"window": 4, "period": 2}}


def _calibration(intercept=0.2, beta=0.004, window=0.5) -> Calibration:
    cost = CostModel(beta_tile_ms=beta, bytes_per_expert=34603008, link_bandwidth_gbps=350.0, copy_latency_ms=0.02, window_ms=window)
    return Calibration("test", intercept, beta, cost, {})


# ---------------------------------------------------------------------------- pipeline math

def test_ffn_bound_two_microbatches_by_hand():
    # attention 1 ms, FFN 2 ms, L = 1, M = 2, two steps:
    # t0 (s0,b0): attn 0-1, ffn 1-3; t1 (s0,b1): attn 1-2, ffn 3-5
    # t2 (s1,b0): attn max(2, ffn_end t0 = 3) = 3-4, ffn max(4, 5) = 5-7; t3: attn max(4, 5) = 5-6, ffn 7-9
    tl = simulate_pipeline(1.0, np.full(4, 2.0), num_layers=1, num_microbatches=2)
    np.testing.assert_allclose(tl.attn_start, [0, 1, 3, 5])
    np.testing.assert_allclose(tl.attn_end, [1, 2, 4, 6])
    np.testing.assert_allclose(tl.ffn_start, [1, 3, 5, 7])
    np.testing.assert_allclose(tl.ffn_end, [3, 5, 7, 9])
    np.testing.assert_allclose(tl.step_end, [5, 9])
    np.testing.assert_allclose(tl.step_ms, [5, 4])  # steady state: M * ffn = 4 ms per step


def test_transfer_latency_by_hand():
    # as above with A2F/F2A latency 0.5: t0 a 0-1 f 1.5-3.5; t1 a 1-2 f max(2.5, 3.5) 3.5-5.5
    # t2 a max(2, 3.5 + 0.5) 4-5 f max(5.5, 5.5) 5.5-7.5; t3 a max(5, 5.5 + 0.5) 6-7 f max(7.5, 7.5) 7.5-9.5
    tl = simulate_pipeline(1.0, np.full(4, 2.0), num_layers=1, num_microbatches=2, transfer_ms=0.5)
    np.testing.assert_allclose(tl.attn_start, [0, 1, 4, 6])
    np.testing.assert_allclose(tl.ffn_start, [1.5, 3.5, 5.5, 7.5])
    np.testing.assert_allclose(tl.step_ms, [5.5, 4.0])
    np.testing.assert_allclose(tl.slack_ms, [0.5, 1.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="transfer_ms"):
        simulate_pipeline(1.0, np.full(4, 2.0), 1, 2, transfer_ms=-0.1)


def test_attention_bound_two_microbatches_by_hand():
    # attention 3 ms, FFN 1 ms: t0 a 0-3 f 3-4; t1 a 3-6 f 6-7; t2 a max(6, 4) 6-9 f 9-10; t3 a 9-12 f 12-13
    tl = simulate_pipeline(3.0, np.full(4, 1.0), num_layers=1, num_microbatches=2)
    np.testing.assert_allclose(tl.ffn_start, [3, 6, 9, 12])
    np.testing.assert_allclose(tl.step_ms, [7, 6])
    assert tl.ffn_busy_share == pytest.approx(4 / 13)


def test_two_layers_uneven_ffn_by_hand():
    # L = 2, M = 2, one step, attention 1, FFN [2, 1, 3, 1] (targets (l0,b0), (l0,b1), (l1,b0), (l1,b1)):
    # t0 a 0-1 f 1-3; t1 a 1-2 f 3-4; t2 needs f t0 (3): a 3-4, f max(4, 4) 4-7; t3 needs f t1 (4): a 4-5, f 7-8
    tl = simulate_pipeline(1.0, np.array([2.0, 1.0, 3.0, 1.0]), num_layers=2, num_microbatches=2)
    np.testing.assert_allclose(tl.attn_start, [0, 1, 3, 4])
    np.testing.assert_allclose(tl.ffn_end, [3, 4, 7, 8])
    np.testing.assert_allclose(tl.step_ms, [8])


def test_per_target_attention_times():
    tl = simulate_pipeline(np.array([1.0, 0.5, 1.0, 0.5]), np.full(4, 0.25), num_layers=1, num_microbatches=2)
    # t0 a 0-1 f 1-1.25; t1 a 1-1.5 f 1.5-1.75; t2 a 1.5-2.5 f 2.5-2.75; t3 a 2.5-3 f 3-3.25
    np.testing.assert_allclose(tl.ffn_end, [1.25, 1.75, 2.75, 3.25])


def test_slower_ffn_stage_lengthens_the_step_when_ffn_bound():
    base = simulate_pipeline(0.5, np.full(8, 1.0), num_layers=2, num_microbatches=2)
    slow = np.full(8, 1.0)
    slow[5] += 0.3
    late = simulate_pipeline(0.5, slow, num_layers=2, num_microbatches=2)
    np.testing.assert_allclose(late.step_ms - base.step_ms, [0.0, 0.3])


@pytest.mark.parametrize("kwargs, field", [
    ({"attention_ms": 1.0, "ffn_ms": np.ones(3), "num_layers": 1, "num_microbatches": 2}, "ffn_ms"),
    ({"attention_ms": 1.0, "ffn_ms": np.array([1.0, -1.0]), "num_layers": 1, "num_microbatches": 2}, "ffn_ms"),
    ({"attention_ms": 1.0, "ffn_ms": np.array([1.0, np.nan]), "num_layers": 1, "num_microbatches": 2}, "ffn_ms"),
    ({"attention_ms": np.ones(3), "ffn_ms": np.ones(4), "num_layers": 1, "num_microbatches": 2}, "attention_ms"),
    ({"attention_ms": -1.0, "ffn_ms": np.ones(4), "num_layers": 1, "num_microbatches": 2}, "attention_ms"),
    ({"attention_ms": 1.0, "ffn_ms": np.ones(4), "num_layers": 0, "num_microbatches": 2}, "num_layers"),
    ({"attention_ms": 1.0, "ffn_ms": np.ones(4), "num_layers": 1, "num_microbatches": 0}, "num_microbatches"),
    ({"attention_ms": 1.0, "ffn_ms": np.ones(0), "num_layers": 1, "num_microbatches": 1}, "ffn_ms"),
])
def test_bad_pipeline_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        simulate_pipeline(**kwargs)


def test_summarise_by_hand():
    tl = simulate_pipeline(1.0, np.full(4, 2.0), num_layers=1, num_microbatches=2)
    from afore.bench.pipeline_sim import PolicyTrace
    trace = PolicyTrace("x", np.array([4, 4, 6, 2]), np.array([2.0, 2.0, 3.0, 2.0]), np.array([0, 1, 2, 0]),
                        np.zeros(4), np.array([0.0, 0.0, 0.5, 0.0]), "d")
    s = summarise(trace, tl, np.full(4, 2.0), tokens_per_step=100, warmup_steps=1, num_layers=1, num_microbatches=2)
    assert s["steps"] == 1 and s["targets"] == 2
    assert s["step_ms_mean"] == pytest.approx(4.0) and s["throughput_tok_s"] == pytest.approx(100 / 4.0 * 1e3)
    assert s["max_mean_tile_load"] == pytest.approx((2.0 + 1.0) / 2)
    assert s["copies_per_target"] == pytest.approx(1.0) and s["exposed_ms_per_target"] == pytest.approx(0.25)
    assert s["zero_exposed_share"] == pytest.approx(0.5)
    # slack of t2, t3 = ffn_start - attn_end = 1 and 1; t2 has copies with copy_ms 0 -> not beyond its slack
    assert s["slack_ms_mean"] == pytest.approx(1.0) and s["copy_beyond_slack_share"] == 0.0
    with pytest.raises(ValueError, match="warmup_steps"):
        summarise(trace, tl, np.full(4, 2.0), 100, 2, 1, 2)


# ---------------------------------------------------------------------------- calibration

def test_calibration_fit_from_report(tmp_path):
    rows = [{"model": "M", "experts": n, "bytes_per_expert": 10_000_000, "ms": 0.03 + 0.05 * n} for n in (1, 2, 4, 8)]
    rows.append({"model": "other", "experts": 1, "bytes_per_expert": 1, "ms": 9.0})
    report = {"device": "GPU", "kernels": {"beta_tile": {"M": {"tiles": [10, 20], "ms": [0.3, 0.35], "beta_tile_ms": 0.005, "intercept_ms": 0.25}}},
              "copies": {"rows": rows}, "replay": {"median_window_ms": 1.5}}
    path = tmp_path / "migration.json"
    path.write_text(json.dumps(report))
    cal = calibration_from_report(path, "M")
    assert cal.intercept_ms == pytest.approx(0.25) and cal.beta_tile_ms == pytest.approx(0.005)
    assert cal.cost.copy_latency_ms == pytest.approx(0.03)
    assert cal.cost.link_bandwidth_gbps == pytest.approx(10_000_000 / 0.05 / 1e6)
    assert cal.cost.copy_ms == pytest.approx(0.08)
    assert cal.cost.window_ms == pytest.approx(1.5)
    assert calibration_from_report(path, "M", window_ms=0.25).cost.window_ms == pytest.approx(0.25)
    assert float(cal.ffn_compute_ms(100)) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="kernels.beta_tile"):
        calibration_from_report(path, "absent")
    with pytest.raises(ValueError, match="calibration"):
        calibration_from_report(tmp_path / "none.json", "M")
    report["copies"]["rows"] = rows[:1]
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError, match="copies.rows"):
        calibration_from_report(path, "M")


def test_committed_report_calibrates_glm_air():
    path = default_report_path()
    if not path.is_file():
        pytest.fail(f"the committed migration report is missing: {path}")
    cal = calibration_from_report(path, "GLM-4.5-Air")
    assert cal.cost.bytes_per_expert == 3 * 4096 * 1408 * 2
    assert 0 < cal.beta_tile_ms < 0.1 and 0 < cal.intercept_ms < 5
    assert 0.01 < cal.cost.copy_ms < 1.0 and cal.cost.window_ms > 0


def test_balanced_attention_is_the_even_ffn_stage():
    shape = ClusterShape(num_experts=16, num_workers=4, m_tile=16, top_k=2)
    cal = _calibration(intercept=0.2, beta=0.01)
    # 100 tokens * 2 = 200 pairs / (4 workers * 16) = 3.125 -> 4 tiles per worker
    assert balanced_attention_ms(cal, shape, 100) == pytest.approx(0.2 + 0.04)


# ---------------------------------------------------------------------------- policies in the pipeline

def _skewed_counts(steps=4, layers=2, mbs=2, tokens=256, seed=0):
    spec = SyntheticSpec(workload="chat", num_experts=32, num_layers=layers, top_k=4, tokens=tokens, steps=steps,
                         microbatches=mbs, skew_first=1.5, skew_last=2.0, seed=seed)
    return generate(spec).counts.astype(np.int64)


def _shape(layers=2):
    return ClusterShape(num_experts=32, num_workers=4, num_layers=layers, redundant_slots=2, m_tile=16, top_k=4)


def test_balanced_workload_static_equals_afore():
    shape, cal = _shape(), _calibration()
    counts = np.full((3, 2, 2, 32), 64, np.int64)  # every expert 4 full tiles: nothing to rebalance
    params = SchedulerParams(copy_budget=4)
    out = {}
    for name in ("static", "afore"):
        trace = run_policy(name, shape, params, cal.cost, counts)
        ffn = ffn_stage_ms(trace, cal)
        out[name] = (trace, ffn, simulate_pipeline(0.3, ffn, 2, 2))
    assert out["afore"][0].copies.sum() == 0
    np.testing.assert_array_equal(out["static"][0].max_tile_load, out["afore"][0].max_tile_load)
    np.testing.assert_allclose(out["static"][1], out["afore"][1])
    np.testing.assert_allclose(out["static"][2].step_ms, out["afore"][2].step_ms)
    np.testing.assert_allclose(out["static"][1], cal.intercept_ms + cal.beta_tile_ms * 32)  # 8 experts x 4 tiles per worker


def test_skewed_workload_afore_has_shorter_ffn_and_steps_than_static():
    shape, cal = _shape(), _calibration(window=5.0)
    counts = _skewed_counts()
    params = SchedulerParams(copy_budget=4)
    runs = {}
    for name in ("static", "afore"):
        trace = run_policy(name, shape, params, cal.cost, counts)
        ffn = ffn_stage_ms(trace, cal)
        runs[name] = (trace, ffn, simulate_pipeline(balanced_attention_ms(cal, shape, 256), ffn, 2, 2))
    assert runs["afore"][1].mean() < runs["static"][1].mean()
    assert np.all(runs["afore"][0].max_tile_load <= runs["static"][0].max_tile_load)
    assert runs["afore"][2].step_ms.sum() < runs["static"][2].step_ms.sum()
    assert runs["afore"][0].copies.sum() > 0 and np.all(runs["afore"][0].exposed_ms == 0)  # window hides the copies


def test_no_overlap_ablation_pays_its_copies_in_the_ffn_stage():
    shape, cal = _shape(), _calibration(window=5.0)
    counts = _skewed_counts()
    params = SchedulerParams(copy_budget=4)
    full = run_policy("afore", shape, params, cal.cost, counts)
    blocking = run_policy("afore-no-overlap", shape, params, cal.cost, counts)
    np.testing.assert_array_equal(full.max_tile_load, blocking.max_tile_load)
    np.testing.assert_allclose(blocking.exposed_ms, blocking.copy_ms)
    assert blocking.exposed_ms.sum() > 0
    np.testing.assert_allclose(ffn_stage_ms(blocking, cal) - ffn_stage_ms(full, cal), blocking.copy_ms)


def test_every_policy_sees_identical_demand():
    shape, cal = _shape(), _calibration()
    counts = _skewed_counts(steps=3)
    before = counts.copy()
    expected = demand_digest(counts.reshape(-1, 32))
    digests = {name: run_policy(name, shape, SchedulerParams(copy_budget=4), cal.cost, counts, POLICY_OPTIONS.get(name)).demand_digest
               for name in POLICY_NAMES}
    assert set(digests.values()) == {expected}
    np.testing.assert_array_equal(counts, before)
    other = counts.copy()
    other[0, 0, 0, 0] += 1
    assert demand_digest(other.reshape(-1, 32)) != expected


def test_run_policy_rejects_bad_input():
    shape, cal = _shape(), _calibration()
    with pytest.raises(ValueError, match="counts"):
        run_policy("static", shape, SchedulerParams(), cal.cost, np.zeros((2, 3, 2, 32), np.int64))
    with pytest.raises(ValueError, match="policy"):
        run_policy("nope", shape, SchedulerParams(), cal.cost, np.zeros((2, 2, 2, 32), np.int64))
    with pytest.raises(ValueError, match="demand"):
        run_policy("static", shape, SchedulerParams(), cal.cost, -np.ones((1, 2, 1, 32), np.int64))
    with pytest.raises(ValueError, match="beta_tile_ms"):
        Calibration("x", 0.1, -1.0, cal.cost, {})
