"""Invariants 2 and 3 on the CPU path, with slow and inline copy engines."""

import time

import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.layer import FFNLayer
from afore.ffn.reference import dense_moe
from afore.migrator.copy_engine import SyncCopyEngine, ThreadCopyEngine
from afore.migrator.migrator import HostWeightsSource, Migrator
from afore.migrator.slot_pool import SlotPool
from afore.plan import Target, check_plan, primary_only_plan

H, I = 16, 8
SHAPE = ClusterShape(num_experts=4, num_workers=2, redundant_slots=1, top_k=1, m_tile=1)
# worker 0: primaries 0, 1 (slots 0, 1), redundant slot 2; worker 1: primaries 2, 3, slot 2.


@pytest.fixture
def weights():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 2 * I, H, generator=gen), torch.randn(4, H, I, generator=gen)


def worker0(weights, engine):
    pool = SlotPool(SHAPE, 0, H, I, dtype=torch.float32)
    pool.load_primaries(*weights)
    return pool, Migrator(SHAPE, 0, {0: pool}, engine, HostWeightsSource({0: weights}))


def plan_with_replica(expert, seq, copy, n_on_replica=4, n_total=8):
    """All n_total pairs are of ``expert`` (a primary of worker 1); n_on_replica run on worker 0 slot 2."""
    demand = np.zeros(4, np.int64)
    demand[expert] = n_total
    plan = primary_only_plan(SHAPE, demand, Target(0, 0, seq), seq)
    plan.primary_only = False
    plan.replicas[expert, 0] = True
    plan.slot[expert, 0] = 2
    plan.assignment[expert] = [n_on_replica, n_total - n_on_replica]
    plan.tiles[:] = plan.assignment
    plan.tile_load[:] = plan.tiles.sum(axis=0)
    plan.copies = np.array([[expert, 1, 0, 2]], np.int32) if copy else np.zeros((0, 4), np.int32)
    return plan


def run(layer, plan, weights, n=8):
    expert = int(np.argmax(plan.demand))
    ids = torch.full((n, 1), expert, dtype=torch.int32)
    hidden = torch.randn(n, H)
    w = torch.ones(n, 1)
    out = layer(hidden, ids, w, plan)
    # worker 0 executes the first a[e, 0] pairs (ordinals 0..a-1): rows 0..a-1
    a = int(plan.assignment[expert, 0])
    ref = dense_moe(hidden[:a], ids[:a], w[:a], *weights)
    return out[:a], ref


def close(out, ref):
    return float((out.double() - ref).norm() / ref.norm()) <= 1e-5


def test_plans_are_valid_contract_plans():
    check_plan(SHAPE, plan_with_replica(2, 1, copy=True))


def test_late_copy_is_waited_for_and_timed(weights):
    pool, mig = worker0(weights, ThreadCopyEngine(delay_s=0.15))
    layer = FFNLayer(pool, backend="torch")
    plan = plan_with_replica(2, 1, copy=True)
    assert mig.prepare(plan, expected_seq=1)
    mig.commit(plan)                      # the copy is still sleeping: compute must wait for it
    out, ref = run(layer, plan, weights)
    mig.release(plan)
    assert close(out, ref)
    time.sleep(0.05)
    (rec,) = mig.drain_records()
    assert rec.seq == 1 and rec.copies == 1 and rec.bytes == 3 * H * I * 4
    assert rec.exposed_ms > 50 and rec.raw_copy_ms >= rec.exposed_ms - 1 and rec.window_ms >= 0
    mig.close()


def test_copy_inside_the_window_exposes_nothing(weights):
    pool, mig = worker0(weights, ThreadCopyEngine(delay_s=0.01))
    plan = plan_with_replica(3, 1, copy=True)
    assert mig.prepare(plan)
    time.sleep(0.1)                       # target t runs meanwhile: the window covers the copy
    for batch in mig.prepared[plan.seq].batches:  # on a loaded machine the copy thread may lag the sleep
        assert batch.wait(30.0)
    mig.commit(plan)
    out, ref = run(FFNLayer(pool, backend="torch"), plan, weights)
    mig.release(plan)
    assert close(out, ref)
    (rec,) = mig.drain_records()
    assert rec.exposed_ms == 0.0 and rec.window_ms >= 90
    mig.close()


def test_copy_into_a_slot_read_by_the_running_target_waits_for_its_release(weights):
    """Invariant 2 against a scheduler that ignores U[t]: t reads slot 2 (expert 2), t+1 copies
    expert 3 into slot 2. With inline copies, an eager copy would corrupt t."""
    pool, mig = worker0(weights, SyncCopyEngine())
    layer = FFNLayer(pool, backend="torch")
    p1, p2 = plan_with_replica(2, 1, copy=True), plan_with_replica(3, 2, copy=True)
    assert mig.prepare(p1)
    assert mig.prepare(p2)               # submitted while p1 is still pending: must defer
    assert pool.resident[2] == 2
    mig.commit(p1)
    out1, ref1 = run(layer, p1, weights)
    assert close(out1, ref1)
    mig.release(p1)                       # now the deferred copy runs
    assert pool.resident[2] == 3
    mig.commit(p2)
    out2, ref2 = run(layer, p2, weights)
    mig.release(p2)
    assert close(out2, ref2)


def test_resident_replica_needs_no_copy(weights):
    pool, mig = worker0(weights, SyncCopyEngine())
    p1 = plan_with_replica(2, 1, copy=True)
    for step in (mig.prepare, mig.commit, mig.release):
        step(p1)
    p2 = plan_with_replica(2, 2, copy=False)
    assert mig.prepare(p2, expected_seq=2)
    mig.commit(p2)
    out, ref = run(FFNLayer(pool, backend="torch"), p2, weights)
    assert close(out, ref)


@pytest.mark.parametrize("case", ["stale", "out_of_order", "wrong_target", "missing_copy", "bad_source", "bad_slot"])
def test_invalid_plans_are_rejected_whole(weights, case):
    """Invariant 3: rejected plans change nothing and are counted."""
    pool, mig = worker0(weights, SyncCopyEngine())
    first = plan_with_replica(2, 1, copy=True)
    for step in (mig.prepare, mig.commit, mig.release):
        step(first)
    before = (pool.resident.copy(), pool.w13.clone(), {k: v.copy() for k, v in mig.projected.items()})
    plan, kwargs = plan_with_replica(3, 2, copy=True), dict(expected_seq=2, expected_target=Target(0, 0, 2))
    if case == "stale":
        plan = plan_with_replica(3, 1, copy=True)
        kwargs = {}
    elif case == "out_of_order":
        plan = plan_with_replica(3, 3, copy=True)
    elif case == "wrong_target":
        plan.target = Target(0, 0, 7)
    elif case == "missing_copy":
        plan.copies = np.zeros((0, 4), np.int32)
    elif case == "bad_source":
        plan.copies[0, 1] = 0
    elif case == "bad_slot":
        plan.copies[0, 3] = 1
    assert not mig.prepare(plan, **kwargs)
    assert mig.rejected == 1 and mig.last_rejection
    assert np.array_equal(pool.resident, before[0]) and torch.equal(pool.w13.nan_to_num(), before[1].nan_to_num())
    assert all(np.array_equal(mig.projected[k], v) for k, v in before[2].items())
    if case in ("stale", "missing_copy", "bad_source", "bad_slot"):  # invalid whatever the expectation
        with pytest.raises(ValueError, match="plan"):
            mig.commit(plan)


def test_thread_engine_surfaces_copy_errors(weights):
    pool, mig = worker0(weights, ThreadCopyEngine())
    bad = {0: (torch.zeros(4, 2 * I, H + 1), weights[1])}  # wrong source shape
    mig.source = HostWeightsSource(bad)
    plan = plan_with_replica(2, 1, copy=True)
    assert mig.prepare(plan)
    with pytest.raises(RuntimeError, match="copy"):
        mig.commit(plan)
    mig.close()


class RecordingEngine(SyncCopyEngine):
    """Inline copies; remembers the deadline each batch was submitted with."""

    def __init__(self):
        super().__init__()
        self.deadlines = []

    def submit(self, jobs, after, deadline_ms=None):
        self.deadlines.append(deadline_ms)
        return super().submit(jobs, after, deadline_ms)


def test_copies_are_asked_to_end_within_a_share_of_the_measured_window(weights):
    engine = RecordingEngine()
    pool = SlotPool(SHAPE, 0, H, I, dtype=torch.float32)
    pool.load_primaries(*weights)
    mig = Migrator(SHAPE, 0, {0: pool}, engine, HostWeightsSource({0: weights}), deadline_share=0.5)
    windows = []
    for seq, (expert, sleep_s) in enumerate([(2, 0.06), (3, 0.03), (2, 0.09), (3, 0.0)], start=1):
        plan = plan_with_replica(expert, seq, copy=True)
        assert mig.prepare(plan, expected_seq=seq)
        time.sleep(sleep_s)                  # the previous target computes: the window
        mig.commit(plan)
        mig.release(plan)
        windows += [r.window_ms for r in mig.drain_records()]
    # no window measured yet for the first batch: full rate; then half the smaller of the last two
    assert engine.deadlines[0] is None
    assert engine.deadlines[1] == pytest.approx(0.5 * windows[0])
    assert engine.deadlines[2] == pytest.approx(0.5 * min(windows[0], windows[1]))
    assert engine.deadlines[3] == pytest.approx(0.5 * min(windows[1], windows[2]))
    assert windows[0] >= 55 and windows[1] < windows[0]
    with pytest.raises(ValueError, match="deadline_share"):
        Migrator(SHAPE, 0, {0: pool}, engine, HostWeightsSource({0: weights}), deadline_share=0.0)


def test_a_copy_deferred_behind_a_reader_runs_unpaced_when_released(weights):
    """Its target may commit right after the release: no time to pace it."""
    engine = RecordingEngine()
    pool = SlotPool(SHAPE, 0, H, I, dtype=torch.float32)
    pool.load_primaries(*weights)
    mig = Migrator(SHAPE, 0, {0: pool}, engine, HostWeightsSource({0: weights}))
    mig._recent_windows.append(40.0)      # a measured window: prepared batches get a deadline
    p1, p2 = plan_with_replica(2, 1, copy=True), plan_with_replica(3, 2, copy=True)
    assert mig.prepare(p1) and mig.prepare(p2)   # p2's copy is deferred behind p1's read
    assert engine.deadlines == [20.0]
    mig.commit(p1)
    mig.release(p1)
    assert engine.deadlines == [20.0, 0.0] and pool.resident[2] == 3


@pytest.mark.parametrize("case", ["valid", "missing_copy", "bad_source", "bad_slot", "demand"])
def test_a_plan_read_from_the_wire_is_checked_in_place_as_its_arrays_are(weights, case):
    """A decoded plan is checked on its body where it lies (no arrays made); the same verdicts and
    reads as the Plan it encodes, and an array set on it since the decode is what is checked."""
    from afore.scheduler.plan_codec import decode_worker_plan, encode_plan

    _, reference = worker0(weights, SyncCopyEngine())
    _, mig = worker0(weights, SyncCopyEngine())
    plan = plan_with_replica(3, 2, copy=True)
    decoded = decode_worker_plan(encode_plan(plan), SHAPE)
    if case == "missing_copy":
        plan.copies = decoded.copies = np.zeros((0, 4), np.int32)
    elif case == "bad_source":
        plan.copies = decoded.copies = np.array([[3, 0, 0, 2]], np.int32)
    elif case == "bad_slot":
        plan.slot = decoded.slot = np.where(plan.slot == 2, 1, plan.slot).astype(np.int32)
    elif case == "demand":
        plan.demand = decoded.demand = plan.demand + 1
    assert decoded.body_in_place() == (case == "valid")
    want = reference._check(plan, 2, Target(0, 0, 2))
    assert mig._check(decoded, 2, Target(0, 0, 2)) == want
    assert (want[0] is None) == (case == "valid") and (want[1] == [(2, 3)] if case == "valid" else want[1] == [])
