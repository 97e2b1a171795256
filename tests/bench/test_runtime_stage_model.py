"""The runtime stage model (pipeline_sim.simulate_runtime): serial and ping-pong data planes on
hand-computed cases, plan waits and misses, read-ahead, paced and synchronous copies, and the
stage calibration file of `afore bench ab --engine cpu-runtime`."""

import json

import numpy as np
import pytest

from afore.bench.ab_gpu import ids_for_demand
from afore.bench.ab_runtime import CALIBRATION_KIND, decode_steps, load_stage_calibration, parse_metrics, metric_sum
from afore.bench.pipeline_sim import StageCosts, simulate_pipeline, simulate_runtime

HAND = StageCosts(demand_emit_ms=0.1, a2f_post_ms=0.2, a2f_latency_ms=0.5, f2a_latency_ms=0.5, f2a_read_ms=0.1,
                  plan_decode_ms=0.05, agreement_ms=0.05)


def test_serial_one_layer_by_hand():
    # attention 1.0; mb0: demand 1.1, posted 1.3, at the FFN 1.8; mb1: posted 1.6, at the FFN 2.1 (after mb0's read-ahead)
    tl = simulate_runtime("serial", np.array([[1.0]]), np.array([2.0, 2.0]), 1, 2, HAND, schedule_ms=0.0)
    assert tl.posted == pytest.approx([1.3, 1.6])
    assert tl.ffn_start == pytest.approx([1.8, 3.9])          # mb1 waits for the FFN workers to finish mb0
    assert tl.ffn_end == pytest.approx([3.9, 6.0])            # + decode + vote + compute
    assert tl.step_ms == pytest.approx([6.6])                 # replies at 4.4 and 6.5, each read in 0.1
    assert tl.exchange_ms == pytest.approx([5.6])
    assert not tl.missed.any() and tl.plan_wait == pytest.approx([0.0, 0.0])


def test_serial_layers_wait_for_every_reply():
    one = simulate_runtime("serial", np.array([[1.0]]), np.full(2, 2.0), 1, 2, HAND, 0.0)
    two = simulate_runtime("serial", np.array([[1.0, 1.0]]), np.full(4, 2.0), 2, 2, HAND, 0.0)
    assert two.step_ms[0] == pytest.approx(2 * one.step_ms[0])  # nothing of layer 1 overlaps layer 0
    assert two.call_enter[1] == pytest.approx(one.step_ms[0] + 1.0)


def test_pingpong_with_free_stages_is_the_two_stage_pipeline():
    rng = np.random.default_rng(0)
    for _ in range(5):
        attn, ffn = rng.uniform(0.2, 2.0, 24), rng.uniform(0.2, 2.0, 24)
        ref = simulate_pipeline(attn, ffn, num_layers=3, num_microbatches=2)
        tl = simulate_runtime("pingpong", attn, ffn, 3, 2, StageCosts(), 0.0)
        assert tl.step_ms == pytest.approx(ref.step_ms)


def test_pingpong_is_faster_than_serial_when_the_stages_balance():
    costs = StageCosts(plan_decode_ms=0.01)
    serial = simulate_runtime("serial", np.full((4, 2), 2.0), np.full(16, 1.0), 2, 2, costs, 0.0)
    pingpong = simulate_runtime("pingpong", np.full(16, 1.0), np.full(16, 1.0), 2, 2, costs, 0.0)
    assert pingpong.step_ms[1:].mean() < serial.step_ms[1:].mean()


def test_late_plan_is_waited_for_then_missed():
    compute, primary = np.full(2, 2.0), np.full(2, 3.0)
    wait = simulate_runtime("serial", np.array([[1.0]]), compute, 1, 2, HAND, schedule_ms=1.0, primary_compute_ms=primary)
    # mb0's plan is published at 1.1 + 1.0 = 2.1, 0.3 ms after its tokens arrived
    assert wait.plan_wait[0] == pytest.approx(0.3) and not wait.missed.any()
    late = simulate_runtime("serial", np.array([[1.0]]), compute, 1, 2, HAND, schedule_ms=50.0, primary_compute_ms=primary)
    assert late.missed.all() and late.plan_wait == pytest.approx([HAND.plan_timeout_ms] * 2)
    assert late.ffn_end[0] - late.ffn_start[0] == pytest.approx(HAND.plan_timeout_ms + HAND.agreement_ms + 3.0)


def _copy_case(**kw):
    costs = StageCosts(plan_decode_ms=0.05, agreement_ms=0.05, copy_link_gbps=1.0, **kw)
    # both microbatches at the FFN at 1.0; one copy of 1 MB for mb1 (1 ms at 1 GB/s)
    return simulate_runtime("serial", np.array([[1.0]]), np.full(2, 2.0), 1, 2, costs, 0.0,
                            copies=np.array([0, 1]), bytes_per_expert=1e6)


def test_read_ahead_overlaps_the_next_copy_with_compute():
    tl = _copy_case()
    # mb0 decodes and votes (1.1), reads mb1's plan ahead (1.15) and submits its copy (ends 2.15), computes to 3.15
    assert tl.exposed == pytest.approx([0.0, 0.0])
    assert tl.window[1] == pytest.approx(3.2 - 1.15)
    assert tl.ffn_end == pytest.approx([3.15, 5.2])


def test_synchronous_copies_sit_on_the_worker_thread():
    tl = _copy_case(copies_synchronous=True)
    assert tl.ffn_end == pytest.approx([4.15, 6.2])  # the copy runs inside mb0's stage (read-ahead)
    assert tl.exposed == pytest.approx([0.0, 0.0])


def test_pacing_stretches_a_copy_until_it_is_exposed():
    tl = _copy_case(copy_cap_gbps=0.25)  # no window measured yet: paced at the cap, 4 ms
    assert tl.copy_ms[1] == pytest.approx(4.0)
    assert tl.exposed[1] == pytest.approx(1.15 + 4.0 - 3.2)
    costs = StageCosts(copy_link_gbps=1.0, copy_cap_gbps=0.25)
    assert costs.copy_ms(1e6, 1, deadline_ms=2.0) == pytest.approx(2.0)   # the deadline raises the rate
    assert costs.copy_ms(1e6, 1, deadline_ms=0.5) == pytest.approx(1.0)   # above the link: full rate


def test_blocking_policy_pays_its_copies():
    costs = StageCosts(copy_link_gbps=1.0)
    tl = simulate_runtime("serial", np.array([[1.0]]), np.full(2, 2.0), 1, 2, costs, 0.0, copies=np.array([0, 2]),
                          bytes_per_expert=1e6, blocking=np.array([False, True]))
    assert tl.exposed == pytest.approx([0.0, 2.0])


@pytest.mark.parametrize("kwargs, field", [
    (dict(mode="chain"), "mode"),
    (dict(attention_ms=np.ones((2, 1))), "attention_ms"),
    (dict(compute_ms=np.ones(3)), "compute_ms"),
    (dict(copies=np.ones(3, int)), "copies"),
])
def test_bad_runtime_arguments(kwargs, field):
    args = dict(mode="serial", attention_ms=np.ones((1, 1)), compute_ms=np.ones(2), num_layers=1, num_microbatches=2,
                costs=StageCosts(), schedule_ms=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        simulate_runtime(**args)


def test_stage_costs_reject_bad_values():
    with pytest.raises(ValueError, match="agreement_ms"):
        StageCosts(agreement_ms=-1.0)
    with pytest.raises(ValueError, match="deadline_share"):
        StageCosts(deadline_share=0.0)
    with pytest.raises(ValueError, match="schedule_ms"):
        StageCosts(schedule_ms={"afore": float("nan")})
    with pytest.raises(ValueError, match="eplb"):
        StageCosts(schedule_ms={"afore": 0.1}).schedule_for("eplb")


def test_stage_calibration_file(tmp_path):
    path = tmp_path / "stages.json"
    doc = {"kind": CALIBRATION_KIND, "meta": {"date_utc": "2026-01-01T00:00:00Z"}, "ffn_compute": {"intercept_ms": 1.0},
           "stages": {"plan_decode_ms": 0.02, "schedule_ms": {"static": 0.1}}}
    path.write_text(json.dumps(doc))
    costs, back = load_stage_calibration(path)
    assert costs.plan_decode_ms == 0.02 and costs.schedule_for("static") == 0.1 and back["meta"] == doc["meta"]
    doc["stages"]["bogus_ms"] = 1.0
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="bogus_ms"):
        load_stage_calibration(path)
    with pytest.raises(ValueError, match="calibration"):
        load_stage_calibration(tmp_path / "none.json")
    path.write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match="kind"):
        load_stage_calibration(path)


def test_decode_steps_from_a_stage_trace():
    # two layers, two microbatches, steps 5, 6, 7 (7 only closes step 6); times in ms -> ns
    rows, t = [], 0.0
    for step in (5, 6, 7):
        for layer in range(2):
            prev_exit = t
            enter = t + 1.0 + layer                       # attention compute 1 ms (layer 0), 2 ms (layer 1)
            clock = enter
            stamps = []
            for mb in range(2):
                demand, sent = clock + 0.1, clock + 0.3
                clock = sent
                stamps.append((demand, sent))
            for mb in range(2):
                start, done = clock, clock + 2.0
                clock = done
                demand, sent = stamps[mb]
                rows.append([step, layer, mb, 2, prev_exit, enter, demand, sent, start, done, 100, 200])
            t = clock
    data = np.array([[int(round(v * 1e6)) if i >= 4 and i < 10 else v for i, v in enumerate(r)] for r in rows], np.int64)
    out = decode_steps(data, (0, 10**12), 2, 2)
    assert out["steps"].tolist() == [5, 6]
    assert out["attention_ms"] == pytest.approx(np.array([[1.0, 2.0], [1.0, 2.0]]))
    per_layer = 0.6 + 4.0
    assert out["exchange_ms"] == pytest.approx(np.full((2, 2), per_layer))
    assert out["step_ms"] == pytest.approx([3.0 + 2 * per_layer] * 2)
    assert out["a2f_post_ms"] == pytest.approx(np.full((2, 2, 2), 0.2))
    assert out["f2a_wait_ms"] == pytest.approx(np.full((2, 2, 2), 2.0))


def test_metric_sums_over_labels():
    text = ('# HELP x\nafore_ffn_stage_seconds_sum{worker="0"} 1.5\nafore_ffn_stage_seconds_sum{worker="1"} 2.5\n'
            'afore_ffn_plans_total{outcome="used",worker="0"} 7\nafore_ffn_stage_seconds_bucket{le="1",worker="0"} 3\n')
    samples = parse_metrics(text)
    assert metric_sum(samples, "afore_ffn_stage_seconds_sum") == 4.0
    assert metric_sum(samples, "afore_ffn_stage_seconds_sum", worker="1") == 2.5
    assert metric_sum(samples, "afore_ffn_plans_total", outcome="used") == 7
    assert not any("_bucket" in k for k in samples)


def test_ids_for_demand_reproduce_the_trace_counts():
    rng = np.random.default_rng(1)
    tokens, k, e = 32, 4, 16
    for _ in range(20):
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)])
        demand = np.bincount(ids.ravel(), minlength=e)
        out = ids_for_demand(demand, tokens, k)
        assert out.shape == (tokens, k)
        assert np.array_equal(np.bincount(out.ravel(), minlength=e), demand)
        assert all(len(set(row)) == k for row in out.tolist())
    with pytest.raises(ValueError, match="pairs"):
        ids_for_demand(np.ones(e, int), tokens, k)


def test_vote_after_compute_keeps_the_stage_and_moves_the_read_ahead_earlier():
    import dataclasses

    after = dataclasses.replace(HAND, vote_after_compute=True)
    a = simulate_runtime("serial", np.array([[1.0]]), np.array([2.0, 2.0]), 1, 2, after, schedule_ms=0.0)
    assert a.ffn_end == pytest.approx([3.9, 6.0]) and a.step_ms == pytest.approx([6.6])  # no read-ahead: same times
    # both microbatches at the FFN at 1.0 with one copy for mb1: read ahead right after mb0's decode (1.05 + 0.05)
    costs = StageCosts(plan_decode_ms=0.05, agreement_ms=0.05, copy_link_gbps=1.0, vote_after_compute=True)
    tl = simulate_runtime("serial", np.array([[1.0]]), np.full(2, 2.0), 1, 2, costs, 0.0, copies=np.array([0, 1]),
                          bytes_per_expert=1e6)
    assert tl.window[1] == pytest.approx(3.15 - 1.1)  # mb1 commits right after being taken up at 3.15
    assert tl.ffn_end == pytest.approx([3.15, 5.2])


def test_pingpong_step_barrier_drains_the_pipeline_between_steps():
    """With the barrier a step's first microbatch starts only after the previous step's last
    replies (the runtime samples the whole batch first): slower than the free-running pipeline,
    still faster than serial when the stages balance, and by hand for free stages."""
    costs = StageCosts(plan_decode_ms=0.0, agreement_ms=0.0, ffn_fixed_ms=0.0, f2a_read_ms=0.0, a2f_latency_ms=0.0,
                       f2a_latency_ms=0.0, demand_emit_ms=0.0, a2f_post_ms=0.0)
    L, M, S = 2, 2, 4
    attn, ffn = np.full(S * L * M, 1.0), np.full(S * L * M, 1.0)
    free = simulate_runtime("pingpong", attn, ffn, L, M, costs, 0.0)
    barrier = simulate_runtime("pingpong", attn, ffn, L, M, costs, 0.0, step_barrier=True)
    serial = simulate_runtime("serial", np.full((S, L), 2.0), ffn, L, M, costs, 0.0)
    # a step with the barrier: attention a0 [0,1], a1 [1,2], f0 [1,2], f1 [2,3], a0' [2,3], f0' [3,4],
    # a1' [3,4], f1' [4,5]: 5 ms; the next starts at 5
    assert barrier.step_ms[0] == pytest.approx(5.0) and barrier.step_ms[1:] == pytest.approx(np.full(S - 1, 5.0))
    assert free.step_ms[1:].mean() < barrier.step_ms[1:].mean() < serial.step_ms[1:].mean()


def test_decode_steps_and_the_pingpong_model_from_a_pingpong_trace():
    """A ping-pong trace (as RemoteRoutedExperts.pingpong_forward records it: each microbatch's
    compute since its own previous call, microbatch 1's first since it got the baton): the
    per-target attention comes out as recorded, and the ping-pong stage model with free
    transport and the measured FFN time reproduces the measured step."""
    from afore.bench.ab_runtime import simulate_steps

    L, M, attn, ffn = 2, 2, 1.0, 1.0
    rows, t = [], 0.0
    for step in (3, 4, 5):
        # the two-stage pipeline with a drained step: a0 [t, t+1] f0 [t+1, t+2]; a1 [t+1, t+2] f1 [t+2, t+3];
        # layer 1: a0 [t+2, t+3] f0 [t+3, t+4], a1 [t+3, t+4] f1 [t+4, t+5]
        times = {}
        for layer in range(L):
            for mb in range(M):
                enter = t + 2 * layer + mb + attn
                prev = (t if mb == 0 else t + 1.0) if layer == 0 else times[(layer - 1, mb)]
                done = enter + ffn
                times[(layer, mb)] = done
                rows.append([step, layer, mb, 2, prev, enter, enter, enter, enter, done, 100, 200])
        t = times[(L - 1, M - 1)]
    data = np.array([[int(round(v * 1e6)) if 4 <= i < 10 else v for i, v in enumerate(r)] for r in rows], np.int64)
    out = decode_steps(data, (0, 10**12), L, M)
    assert out["steps"].tolist() == [3, 4]
    assert out["attention_target_ms"] == pytest.approx(np.full((2, L, M), attn))
    assert out["step_ms"] == pytest.approx([5.0, 5.0])
    costs = StageCosts(plan_decode_ms=0.0, agreement_ms=0.0, ffn_fixed_ms=0.0, f2a_read_ms=0.0, a2f_latency_ms=0.0,
                       f2a_latency_ms=0.0, demand_emit_ms=0.0, a2f_post_ms=0.0, schedule_ms={"static": 0.0})
    sim = simulate_steps(out, costs, ffn, "static", M, mode="pingpong")
    assert sim["step_ms"] == pytest.approx(out["step_ms"])
    assert np.all(np.isnan(sim["exchange_ms"]))  # not modelled in ping-pong
    serial = simulate_steps(out, costs, ffn, "static", M, mode="serial")
    assert serial["step_ms"].mean() > sim["step_ms"].mean()
