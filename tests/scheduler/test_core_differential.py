"""The C++ core (afore.scheduler.core) returns the reference's plan on every input.

Differential property tests: random shapes (E 1..160, F 1..40, R 0..4, M_tile in {1, 8, 16,
64}), skews (uniform, Zipf, one-hot, zeros), theta, B, random slot tables, last uses,
protected slots and previous assignments; the edge cases explicitly; and a 50-target sequence
in which each plan's table and assignment feed the next call.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler import algorithm, core
from afore.plan import Plan, SlotTable, Target, check_plan

PLAN_ARRAYS = ("demand", "replicas", "assignment", "tiles", "slot", "copies", "tile_load")


def assert_same(reference: tuple[Plan, SlotTable], production: tuple[Plan, SlotTable]) -> None:
    (p, t), (q, u) = reference, production
    for name in PLAN_ARRAYS:
        a, b = getattr(p, name), getattr(q, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b), (name, a, b)
    assert p.gain_ms == pytest.approx(q.gain_ms, abs=1e-9)
    assert p.exposed_ms == pytest.approx(q.exposed_ms, abs=1e-9)
    assert (p.target, p.seq, p.primary_only) == (q.target, q.seq, q.primary_only)
    for name in ("expert", "last_used"):
        a, b = getattr(t, name), getattr(u, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), (name, a, b)


def both(*args):
    reference = algorithm.schedule(*args)
    production = core.schedule(*args)
    assert_same(reference, production)
    check_plan(args[0], production[0], args[2])
    return production


def random_demand(rng, e, kind, pairs):
    if kind == "zeros":
        return np.zeros(e, np.int64)
    if kind == "one-hot":
        return np.eye(e, dtype=np.int64)[rng.integers(e)] * pairs
    p = np.ones(e) if kind == "uniform" else 1.0 / np.arange(1, e + 1) ** rng.uniform(0.8, 1.6)
    return rng.multinomial(pairs, rng.permutation(p / p.sum())).astype(np.int64)


def random_table(rng, shape, fill):
    table = SlotTable.empty(shape)
    owner = shape.primary_owner
    for w in range(shape.num_workers):
        candidates = np.flatnonzero(owner != w)
        rng.shuffle(candidates)
        for r in range(min(shape.redundant_slots, len(candidates))):
            if rng.random() < fill:
                table.expert[w, r] = candidates[r]
        table.last_used[w] = rng.integers(-1, 40, shape.redundant_slots)
    return table


@st.composite
def instances(draw):
    # Hypothesis favours the first choice of each sampled_from: the common case comes first.
    e = draw(st.integers(1, 160))
    f = draw(st.sampled_from([8, 3, 16, 40, 2, 27, 5, 12, 1]) | st.integers(2, 40))
    r = draw(st.sampled_from([2, 1, 4, 3, 2, 0]))
    m = draw(st.sampled_from([16, 1, 8, 64]))
    shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=r, m_tile=m, top_k=1)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["zipf", "uniform", "zipf", "one-hot", "zeros"]))
    demand = random_demand(rng, e, kind, int(rng.integers(0, 8 * 4096)))
    table = random_table(rng, shape, draw(st.sampled_from([0.5, 0.0, 1.0])))
    protected = rng.random((f, r)) < draw(st.sampled_from([0.3, 0.0, 1.0]))
    prev = None
    if draw(st.booleans()):
        prev = (rng.integers(0, 200, (e, f)) * (rng.random((e, f)) < 0.3)).astype(np.int32)
    params = SchedulerParams(theta=draw(st.sampled_from([0, 1, 0, 2, 5, 10**6])),
                             copy_budget=draw(st.sampled_from([8, 1, 2, 4, 16, 8, 0, 10**9])),
                             chains=draw(st.sampled_from([True, False])))
    cost = CostModel(beta_tile_ms=draw(st.sampled_from([0.004, 0.03, 0.004, 0.03, 0.0])),
                     copy_latency_ms=draw(st.sampled_from([0.01, 0.2, 0.0])),
                     bytes_per_expert=draw(st.sampled_from([0, 3 * 4096 * 1536 * 2])),
                     window_ms=draw(st.sampled_from([0.05, 0.5, 5.0, 0.0])))
    seq = draw(st.integers(0, 2**40))
    return shape, demand, table, protected, prev, params, cost, Target(seq, 0, 0), seq


@settings(max_examples=250, deadline=None)
@given(instances())
def test_core_equals_reference_on_random_inputs(instance):
    both(*instance)


@st.composite
def holdout_instances(draw):
    """Beyond the steady state: cold or burst slot tables, R = 1 or 2, budgets 1..F, E up to 256,
    F up to 128, M_tile 64-128 (the inputs of ``afore bench scheduler``'s hold-out)."""
    e = draw(st.sampled_from([128, 256, 96, 200]))
    f = draw(st.sampled_from([16, 64, 128, 8, 32, 12]))
    r = draw(st.sampled_from([1, 2]))
    m = draw(st.sampled_from([64, 128, 96]))
    shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=r, m_tile=m, top_k=8)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    budget = draw(st.sampled_from([f, 1, f // 2 + 1]) | st.integers(1, f))
    params = SchedulerParams(theta=draw(st.sampled_from([0, 0, 1])), copy_budget=budget,
                             chains=draw(st.sampled_from([True, True, False])))
    cost = CostModel(window_ms=draw(st.sampled_from([5.0, 0.05, 0.5])))
    popularity = rng.permutation(1.0 / np.arange(1, e + 1) ** rng.uniform(0.8, 1.4))
    pairs = 8 * int(rng.integers(256, 4096))
    table, protected, prev = SlotTable.empty(shape), np.zeros((f, r), bool), None
    if draw(st.booleans()):  # burst on a warm pool: the state of one plan, then hot experts
        warm = rng.multinomial(pairs, popularity / popularity.sum())
        table, protected, prev = next_state(core.schedule(shape, warm, table, protected, None, params, cost,
                                                          Target(0, 0, 0), 0))
        hot = rng.choice(e, int(rng.integers(1, 6)), replace=False)
        popularity[hot] *= rng.uniform(5, 40, hot.size)
    demand = rng.multinomial(pairs, popularity / popularity.sum()).astype(np.int64)
    return shape, demand, table, protected, prev, params, cost, Target(0, 0, 1), 1


@settings(max_examples=60, deadline=None)
@given(holdout_instances())
def test_core_equals_reference_beyond_the_steady_state(instance):
    plan, _ = both(*instance)
    shape, demand = instance[0], instance[1]
    k = -(-demand // shape.m_tile)
    assert plan.max_tile_load >= algorithm.average_bound(k, shape.num_workers)


def edge_cases():
    rng = np.random.default_rng(3)
    params, cost, t = SchedulerParams(), CostModel(window_ms=0.05), Target(0, 0, 0)

    def case(shape, demand, table=None, protected=None, prev=None, p=params):
        table = table if table is not None else SlotTable.empty(shape)
        protected = protected if protected is not None else np.zeros(
            (shape.num_workers, shape.redundant_slots), bool)
        return (shape, np.asarray(demand, np.int64), table, protected, prev, p, cost, t, 0)

    s = ClusterShape(num_experts=128, num_workers=16, redundant_slots=2, m_tile=16, top_k=8)
    zipf = random_demand(rng, 128, "zipf", 8 * 2048)
    full = random_table(rng, s, 1.0)
    return {
        "zero demand": case(s, np.zeros(128)),
        "one expert holds all": case(s, np.eye(128, dtype=np.int64)[5] * 8 * 4096),
        "E < F": case(ClusterShape(num_experts=5, num_workers=12, redundant_slots=2, m_tile=8,
                                   top_k=2), [900, 3, 0, 40, 7]),
        "F = 1": case(ClusterShape(num_experts=64, num_workers=1, redundant_slots=3, m_tile=16,
                                   top_k=4), random_demand(rng, 64, "zipf", 9000)),
        "R = 0": case(ClusterShape(num_experts=128, num_workers=8, redundant_slots=0, m_tile=16,
                                   top_k=8), zipf),
        "all slots full": case(s, zipf, full),
        "all slots protected": case(s, zipf, full, np.ones((16, 2), bool)),
        "B = 0": case(s, zipf, p=SchedulerParams(copy_budget=0)),
        "theta large": case(s, zipf, full, p=SchedulerParams(theta=10**12)),
        "uneven primaries": case(ClusterShape(num_experts=130, num_workers=16, redundant_slots=2,
                                              m_tile=1, top_k=8),
                                 random_demand(rng, 130, "zipf", 5000)),
    }


@pytest.mark.parametrize("name", list(edge_cases()))
def test_core_equals_reference_on_edge_cases(name):
    instance = edge_cases()[name]
    plan, table = both(*instance)
    shape = instance[0]
    if name in ("zero demand", "F = 1", "R = 0", "all slots protected", "B = 0", "theta large"):
        assert plan.copies.shape == (0, 4)
    if name == "theta large":
        assert np.array_equal(plan.assignment.sum(axis=1), plan.demand)
        assert np.all(plan.assignment[np.arange(shape.num_experts), shape.primary_owner] == plan.demand)
    if name == "one expert holds all":
        assert 1 <= len(plan.copies) <= SchedulerParams().copy_budget
        assert set(plan.copies[:, 0].tolist()) == {5}
        assert plan.max_tile_load < 8 * 4096 // 16


@pytest.mark.parametrize("workers,redundant,m_tile,theta", [(8, 2, 16, 1), (32, 2, 16, 1), (5, 3, 1, 1),
                                                             (8, 2, 16, 0), (32, 4, 16, 0), (5, 3, 1, 0)])
def test_core_and_reference_stay_identical_over_a_sequence_of_targets(workers, redundant, m_tile, theta):
    shape = ClusterShape(num_experts=128, num_workers=workers, redundant_slots=redundant,
                         m_tile=m_tile, top_k=8)
    rng = np.random.default_rng(workers)
    params, cost = SchedulerParams(theta=theta, copy_budget=4), CostModel(window_ms=0.05)
    popularity = 1.0 / np.arange(1, 129) ** 1.1
    ref_state = core_state = (SlotTable.empty(shape), np.zeros((workers, redundant), bool), None)
    copies = 0
    for seq in range(50):
        if seq % 10 == 0:  # workload shift: a new hot set
            popularity = rng.permutation(popularity)
        demand = rng.multinomial(8 * int(rng.integers(256, 4096)), popularity / popularity.sum())
        target = Target(step=seq // 2, layer=0, microbatch=seq % 2)
        ref = algorithm.schedule(shape, demand, *ref_state[:2], ref_state[2], params, cost, target, seq)
        out = core.schedule(shape, demand, *core_state[:2], core_state[2], params, cost, target, seq)
        assert_same(ref, out)
        check_plan(shape, out[0], core_state[0])
        copies += len(out[0].copies)
        ref_state, core_state = next_state(ref), next_state(out)
    assert copies > 0  # the sequence exercised the beyond phase


def next_state(result):
    """Projected table, protected slots (slots with work in this plan) and A[t-1] for the next call."""
    plan, table = result
    w, r = np.nonzero(table.expert >= 0)
    protected = np.zeros(table.expert.shape, bool)
    protected[w, r] = plan.assignment[table.expert[w, r], w] > 0
    return table, protected, plan.assignment


def test_core_accepts_other_integer_dtypes_and_lists_like_the_reference():
    shape = ClusterShape(num_experts=12, num_workers=4, redundant_slots=2, m_tile=4, top_k=2)
    table = SlotTable(np.array([[3, -1], [0, 11], [-1, -1], [1, 2]], np.int64),
                      np.array([[0, -1], [1, 2], [-1, -1], [3, 3]], np.int32))
    demand = [50, 3, 0, 9, 0, 0, 70, 1, 1, 0, 0, 2]
    prev = np.ones((12, 4), np.int64)
    protected = np.array([[0, 1], [0, 0], [1, 0], [0, 0]])
    both(shape, demand, table, protected, prev, SchedulerParams(theta=1), CostModel(), Target(0, 0, 0), 9)
    both(shape, np.array(demand, np.float64), table, protected.astype(bool), prev.astype(np.int32),
         SchedulerParams(), CostModel(), Target(0, 0, 0), np.int64(9))


def test_core_schedule_bench_times_the_same_plan():
    shape = ClusterShape(num_experts=128, num_workers=8, redundant_slots=2, m_tile=16, top_k=8)
    rng = np.random.default_rng(0)
    args = (shape, random_demand(rng, 128, "zipf", 8 * 1024), SlotTable.empty(shape),
            np.zeros((8, 2), bool), None, SchedulerParams(), CostModel(), Target(0, 0, 0), 0)
    scheduler = core.scheduler_for(shape)
    ns = scheduler.schedule_bench(*core.core_arguments(*args), 5)
    assert isinstance(ns, int) and ns > 0
    both(*args)  # the scratch is clean after repeated runs
    with pytest.raises(ValueError, match="repeats: expected >= 1"):
        scheduler.schedule_bench(*core.core_arguments(*args), 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_core_equals_reference_at_large_scale(seed):
    # Many workers and experts: the core's shortcuts (stuck donors, cached safe slots) matter most.
    rng = np.random.default_rng(seed)
    shape = ClusterShape(num_experts=256, num_workers=128, redundant_slots=4, m_tile=16, top_k=8)
    table = random_table(rng, shape, 0.8)
    protected = rng.random((128, 4)) < 0.2
    prev = None if seed == 0 else (rng.integers(0, 100, (256, 128)) * (rng.random((256, 128)) < 0.05)).astype(np.int32)
    demand = random_demand(rng, 256, "zipf", 8 * 4096)
    plan, _ = both(shape, demand, table, protected, prev, SchedulerParams(copy_budget=128),
                   CostModel(window_ms=1.0), Target(0, 0, 0), 0)
    assert len(plan.copies) > 0
    assert core.scheduler_for(shape).last_within_moves > 0


def test_core_plans_stay_exact_while_another_thread_benchmarks_the_same_scheduler():
    # schedule_bench releases the GIL; the scheduler's scratch is shared by all calls on it.
    import threading

    shape = ClusterShape(num_experts=128, num_workers=16, redundant_slots=2, m_tile=16, top_k=8)
    rng = np.random.default_rng(0)
    args = (shape, random_demand(rng, 128, "zipf", 8192), SlotTable.empty(shape),
            np.zeros((16, 2), bool), None, SchedulerParams(), CostModel(), Target(0, 0, 0), 0)
    expected, _ = algorithm.schedule(*args)
    other = core.core_arguments(shape, random_demand(rng, 128, "zipf", 8192), *args[2:])
    done = threading.Event()

    def bench():
        while not done.is_set():
            core.scheduler_for(shape).schedule_bench(*other, 50)

    thread = threading.Thread(target=bench)
    thread.start()
    try:
        for _ in range(400):
            plan, _ = core.schedule(*args)
            assert np.array_equal(plan.assignment, expected.assignment)
            assert np.array_equal(plan.copies, expected.copies)
    finally:
        done.set()
        thread.join()
