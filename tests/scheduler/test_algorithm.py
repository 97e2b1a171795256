"""Algorithm 1 (afore.scheduler.algorithm): worked examples, properties and bad input.

The worked examples are small instances solved by hand from the paper's rules (section 5.2);
the property tests hold the invariants of every plan; bad-input tests run against both the
reference and the C++ core.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler import algorithm, core
from afore.plan import SlotTable, Target, check_plan, primary_only_plan

T0 = Target(step=0, layer=0, microbatch=0)
FREE_COPIES = CostModel(beta_tile_ms=0.01, copy_latency_ms=0.001, bytes_per_expert=0, window_ms=1.0)


def table_of(shape: ClusterShape, bindings: dict[tuple[int, int], int] | None = None,
             last_used: dict[tuple[int, int], int] | None = None) -> SlotTable:
    table = SlotTable.empty(shape)
    for (w, r), e in (bindings or {}).items():
        table.expert[w, r] = e
    for (w, r), s in (last_used or {}).items():
        table.last_used[w, r] = s
    return table


def plan_with(shape, demand, table=None, protected=None, prev=None, theta=0, budget=8,
              cost=FREE_COPIES, seq=0, chains=True):
    table = table if table is not None else SlotTable.empty(shape)
    if protected is None:
        protected = np.zeros((shape.num_workers, shape.redundant_slots), bool)
    plan, new = algorithm.schedule(shape, np.asarray(demand, np.int64), table, protected, prev,
                                   SchedulerParams(theta=theta, copy_budget=budget, chains=chains),
                                   cost, T0, seq)
    check_plan(shape, plan, table)
    return plan, new


# Four experts on two workers: e0, e1 on w0 and e2, e3 on w1 (physical slots 0, 1; redundant 2..).
SHAPE_2x4 = ClusterShape(num_experts=4, num_workers=2, redundant_slots=1, m_tile=1, top_k=1)


def test_within_placement_moves_half_the_gap_onto_an_existing_replica():
    table = table_of(SHAPE_2x4, {(1, 0): 0})
    plan, new = plan_with(SHAPE_2x4, [6, 0, 0, 0], table, budget=0)
    assert plan.assignment[0].tolist() == [3, 3]
    assert plan.tile_load.tolist() == [3, 3]
    assert plan.copies.shape == (0, 4)
    assert plan.slot[0].tolist() == [0, 2]  # primary slot 0 on w0, redundant slot 0 of w1 = 2
    assert new.last_used[1, 0] == 0  # the slot got work in this plan (seq 0)


def test_theta_blocks_moves_of_at_most_theta_tiles():
    table = table_of(SHAPE_2x4, {(1, 0): 0})
    plan, _ = plan_with(SHAPE_2x4, [6, 0, 0, 0], table, theta=3)
    assert plan.assignment[0].tolist() == [6, 0]
    plan, _ = plan_with(SHAPE_2x4, [8, 0, 0, 0], table, theta=3)
    assert plan.assignment[0].tolist() == [4, 4]


def test_beyond_placement_copies_into_an_empty_slot_when_the_gain_is_positive():
    plan, new = plan_with(SHAPE_2x4, [6, 0, 0, 0])
    assert plan.copies.tolist() == [[0, 0, 1, 2]]  # expert 0 from its primary w0 into w1 slot 2
    assert plan.assignment[0].tolist() == [3, 3]
    assert new.expert.tolist() == [[-1], [0]]
    # F0 = 0.01 * 6, one copy of 0.001 ms inside a 1 ms window: gain = 0.01 * (6 - 3).
    assert plan.gain_ms == pytest.approx(0.03)
    assert plan.exposed_ms == 0.0


def test_beyond_placement_keeps_the_placement_when_the_exposed_copy_outweighs_the_gain():
    slow = CostModel(beta_tile_ms=0.01, copy_latency_ms=1.0, bytes_per_expert=0, window_ms=0.0)
    table = SlotTable.empty(SHAPE_2x4)
    plan, new = plan_with(SHAPE_2x4, [6, 0, 0, 0], table, cost=slow)
    assert plan.copies.shape == (0, 4)
    assert plan.assignment[0].tolist() == [6, 0]
    assert plan.gain_ms == 0.0 and plan.exposed_ms == 0.0
    assert np.array_equal(new.expert, table.expert)


def test_gain_counts_the_exposed_part_of_the_copy_list():
    # Two copies into w1 serialise: M = 2 * 0.02 ms against W = 0.03 ms, so O = 0.01 ms.
    shape = ClusterShape(num_experts=6, num_workers=2, redundant_slots=2, m_tile=1, top_k=1)
    cost = CostModel(beta_tile_ms=0.01, copy_latency_ms=0.02, bytes_per_expert=0, window_ms=0.03)
    plan, _ = plan_with(shape, [4, 4, 4, 0, 0, 0], cost=cost)
    # Loads [12, 0]. Move 1: q = min(4, 6) ties for e0..e2 -> e0 to w1, loads [8, 4],
    # gain 0.01 * (12 - 8) = 0.04. Move 2: q = min(4, 2) -> e1 to w1, loads [6, 6],
    # gain 0.01 * (12 - 6) - 0.01 = 0.05 > 0.04: the second candidate is kept.
    assert plan.copies.tolist() == [[0, 0, 1, 3], [1, 0, 1, 4]]  # w1 owns 3 primaries
    assert plan.tile_load.tolist() == [6, 6]
    assert plan.assignment[:2].tolist() == [[0, 4], [2, 2]]
    assert plan.exposed_ms == pytest.approx(0.01)
    assert plan.gain_ms == pytest.approx(0.05)


def test_search_goes_through_non_positive_gains_and_restores_the_best_candidate():
    # Two equal bottlenecks: the first copy leaves max load unchanged (gain <= 0), the second
    # lowers it. With a budget of one copy nothing is kept.
    shape = ClusterShape(num_experts=4, num_workers=4, redundant_slots=1, m_tile=1, top_k=1)
    plan, new = plan_with(shape, [8, 8, 0, 0], budget=1)
    assert plan.copies.shape == (0, 4) and plan.tile_load.tolist() == [8, 8, 0, 0]
    assert np.all(new.expert == -1)
    plan, _ = plan_with(shape, [8, 8, 0, 0], budget=2)
    assert plan.copies.tolist() == [[0, 0, 2, 1], [1, 1, 3, 1]]
    assert plan.tile_load.tolist() == [4, 4, 4, 4]


def test_slot_choice_empty_first_then_least_recently_used_idle_slot():
    shape = ClusterShape(num_experts=4, num_workers=2, redundant_slots=3, m_tile=1, top_k=1)
    # w1: slot 0 holds idle e1, slots 1 and 2 are empty: the lowest empty slot (physical 3) wins.
    table = table_of(shape, {(1, 0): 1}, {(1, 0): -1})
    plan, _ = plan_with(shape, [6, 0, 0, 0], table, budget=1)
    assert plan.copies.tolist() == [[0, 0, 1, 3]]
    # No empty slot: the least recently used idle slot goes; protected slots never do.
    shape = ClusterShape(num_experts=6, num_workers=2, redundant_slots=2, m_tile=1, top_k=1)
    table = table_of(shape, {(1, 0): 1, (1, 1): 2}, {(1, 0): 7, (1, 1): 3})
    plan, new = plan_with(shape, [6, 0, 0, 0, 0, 0], table, budget=1)
    assert plan.copies.tolist() == [[0, 0, 1, 4]]  # w1 owns 3 primaries: slot 1 is physical 4
    assert new.expert[1].tolist() == [1, 0]
    assert not plan.replicas[2, 1]  # the rebound expert left the placement on w1
    protected = np.array([[False, False], [False, True]])
    plan, new = plan_with(shape, [6, 0, 0, 0, 0, 0], table, protected, budget=1)
    assert plan.copies.tolist() == [[0, 0, 1, 3]]
    plan, new = plan_with(shape, [6, 0, 0, 0, 0, 0], table, np.ones((2, 2), bool), budget=4)
    assert plan.copies.shape == (0, 4) and np.array_equal(new.expert, table.expert)


def test_a_slot_whose_expert_has_work_is_not_rebound():
    shape = ClusterShape(num_experts=6, num_workers=2, redundant_slots=1, m_tile=1, top_k=1)
    table = table_of(shape, {(1, 0): 1})
    prev = np.zeros((6, 2), np.int32)
    prev[1] = [1, 1]  # e1 works on both replicas
    plan, new = plan_with(shape, [6, 4, 0, 0, 0, 0], table, prev=prev)
    # Init: e0 [6, 0], e1 [2, 2]; within: e1 moves min(2, 3) tiles to w1 -> loads [6, 4].
    # e0 would gain from a copy to w1, but w1's only slot holds e1, which has work there.
    assert plan.assignment[:2].tolist() == [[6, 0], [0, 4]]
    assert new.expert[1, 0] == 1
    assert plan.copies.shape == (0, 4)


def test_initialize_assignment_largest_remainder_and_ties():
    owner = np.array([0, 1, 2])
    has = np.ones((3, 3), bool)
    k = np.array([4, 4, 5])
    prev = np.array([[1, 1, 1], [0, 1, 2], [0, 0, 0]])
    tiles = algorithm.initialize_assignment(k, has, owner, prev, theta=0)
    assert tiles[0].tolist() == [2, 1, 1]  # equal remainders: the lower worker index first
    assert tiles[1].tolist() == [0, 1, 3]  # quotas 4/3, 8/3: the larger remainder gets the extra tile
    assert tiles[2].tolist() == [0, 0, 5]  # no previous work: all on the primary (w2)
    # Previous work on a worker without a current replica does not count.
    has[0, 1] = False
    tiles = algorithm.initialize_assignment(k, has, owner, prev, theta=0)
    assert tiles[0].tolist() == [2, 0, 2]
    # 0 < k_e <= theta: everything on the primary.
    tiles = algorithm.initialize_assignment(k, has, owner, prev, theta=4)
    assert tiles[:, :].tolist() == [[4, 0, 0], [0, 4, 0], [0, 0, 5]]


def test_token_fill_leaves_one_partial_tile_on_the_primary_or_the_last_worker():
    shape = ClusterShape(num_experts=3, num_workers=3, redundant_slots=1, m_tile=4, top_k=1)
    owner = shape.primary_owner
    demand = np.array([10, 9, 0])
    k = -(-demand // 4)
    tiles = np.array([[2, 1, 0], [0, 1, 2], [0, 0, 0]])
    a = algorithm.fill_tokens(demand, k, tiles, owner, 4)
    assert a[0].tolist() == [6, 4, 0]   # the primary (w0) holds tiles: it takes the partial tile
    assert a[1].tolist() == [0, 1, 8]   # e1's primary is w1 and holds tiles
    tiles = np.array([[0, 1, 2], [0, 0, 0], [0, 0, 0]])
    a = algorithm.fill_tokens(demand, k, tiles, owner, 4)
    assert a[0].tolist() == [0, 4, 6]   # no tiles on the primary: the last worker with tiles


def test_plans_carry_state_to_the_next_target():
    table = table_of(SHAPE_2x4)
    plan, table1 = plan_with(SHAPE_2x4, [6, 0, 0, 0], table, seq=3)
    assert table1.last_used[1, 0] == 3
    # The replica persists: the next target reuses it without a copy.
    plan2, table2 = plan_with(SHAPE_2x4, [8, 0, 0, 0], table1, prev=plan.assignment, seq=4)
    assert plan2.copies.shape == (0, 4)
    assert plan2.assignment[0].tolist() == [4, 4]
    assert table2.last_used[1, 0] == 4
    # A target without demand for e0 leaves the binding but not its last use.
    plan3, table3 = plan_with(SHAPE_2x4, [0, 0, 3, 0], table2, prev=plan2.assignment, seq=5)
    assert table3.expert[1, 0] == 0 and table3.last_used[1, 0] == 4
    assert plan3.replicas[0, 1] and plan3.assignment[0].sum() == 0


@pytest.mark.parametrize("shape", [
    ClusterShape(num_experts=8, num_workers=1, redundant_slots=2, m_tile=16, top_k=2),   # F = 1
    ClusterShape(num_experts=3, num_workers=5, redundant_slots=1, m_tile=1, top_k=1),    # E < F
    ClusterShape(num_experts=16, num_workers=4, redundant_slots=0, m_tile=8, top_k=2),   # R = 0
])
@pytest.mark.parametrize("kind", ["zeros", "one-hot", "skewed"])
def test_edge_shapes_and_demands(shape, kind):
    rng = np.random.default_rng(0)
    demand = {"zeros": np.zeros(shape.num_experts, np.int64),
              "one-hot": np.eye(shape.num_experts, dtype=np.int64)[0] * 1000,
              "skewed": rng.zipf(1.5, shape.num_experts).clip(max=5000)}[kind]
    plan, new = plan_with(shape, demand)
    base = primary_only_plan(shape, demand, T0, 0)
    assert plan.max_tile_load <= base.max_tile_load
    if shape.redundant_slots == 0 or shape.num_workers == 1 or kind == "zeros":
        assert plan.copies.shape == (0, 4)
        assert np.array_equal(plan.assignment, base.assignment)
    if shape.num_workers == 5 and kind == "one-hot":
        assert plan.max_tile_load < base.max_tile_load  # E < F: the idle workers take replicas


def test_all_slots_full_and_protected_and_zero_budget():
    shape = ClusterShape(num_experts=8, num_workers=4, redundant_slots=1, m_tile=1, top_k=2)
    table = table_of(shape, {(0, 0): 2, (1, 0): 4, (2, 0): 6, (3, 0): 0})
    demand = [40, 0, 0, 0, 0, 0, 0, 1]
    plan, new = plan_with(shape, demand, table, np.ones((4, 1), bool))
    assert plan.copies.shape == (0, 4) and np.array_equal(new.expert, table.expert)
    # The existing replica on w3 still helps: half the gap (39 // 2) moves there.
    assert plan.assignment[0].tolist() == [21, 0, 0, 19]
    plan, new = plan_with(shape, demand, table, budget=0)
    assert plan.copies.shape == (0, 4) and np.array_equal(new.expert, table.expert)
    plan, _ = plan_with(shape, demand, table)
    assert len(plan.copies) >= 1 and plan.max_tile_load < 20


# ---- properties -----------------------------------------------------------------------------

@st.composite
def instances(draw, max_experts=40, max_workers=10):
    e = draw(st.integers(1, max_experts))
    f = draw(st.integers(1, max_workers))
    r = draw(st.integers(0, 3))
    m = draw(st.sampled_from([1, 4, 16]))
    shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=r, m_tile=m, top_k=1)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["uniform", "zipf", "one-hot", "zeros"]))
    demand = random_demand(rng, e, kind)
    table = random_table(rng, shape)
    protected = rng.random((f, r)) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    prev = None
    if draw(st.booleans()):
        prev = (rng.integers(0, 50, (e, f)) * (rng.random((e, f)) < 0.4)).astype(np.int32)
    params = SchedulerParams(theta=draw(st.sampled_from([0, 0, 1, 3, 1000])),
                             copy_budget=draw(st.integers(0, 6)), chains=draw(st.booleans()))
    cost = CostModel(beta_tile_ms=draw(st.sampled_from([0.0, 0.004, 0.05])),
                     copy_latency_ms=draw(st.sampled_from([0.001, 0.05])), bytes_per_expert=0,
                     window_ms=draw(st.sampled_from([0.0, 0.1, 1.0])))
    return shape, demand, table, protected, prev, params, cost


def random_demand(rng, e, kind):
    pairs = int(rng.integers(0, 64 * e))
    if kind == "zeros":
        return np.zeros(e, np.int64)
    if kind == "one-hot":
        return np.eye(e, dtype=np.int64)[rng.integers(e)] * pairs
    p = np.ones(e) if kind == "uniform" else 1.0 / np.arange(1, e + 1) ** 1.2
    return rng.multinomial(pairs, rng.permutation(p / p.sum())).astype(np.int64)


def random_table(rng, shape):
    table = SlotTable.empty(shape)
    owner = shape.primary_owner
    for w in range(shape.num_workers):
        candidates = np.flatnonzero(owner != w)
        rng.shuffle(candidates)
        for r in range(min(shape.redundant_slots, len(candidates))):
            if rng.random() < 0.7:
                table.expert[w, r] = candidates[r]
                table.last_used[w, r] = rng.integers(-1, 20)
    return table


@settings(max_examples=120, deadline=None)
@given(instances())
def test_plan_invariants(instance):
    shape, demand, table, protected, prev, params, cost = instance
    before = (demand.copy(), table.copy(), protected.copy(), None if prev is None else prev.copy())
    plan, new = algorithm.schedule(shape, demand, table, protected, prev, params, cost, T0, 7)
    check_plan(shape, plan, table)
    # Pure: inputs untouched, and the same inputs give the same plan.
    assert np.array_equal(demand, before[0]) and np.array_equal(protected, before[2])
    assert np.array_equal(table.expert, before[1].expert)
    assert np.array_equal(table.last_used, before[1].last_used)
    assert prev is None or np.array_equal(prev, before[3])
    again, _ = algorithm.schedule(shape, demand, table, protected, prev, params, cost, T0, 7)
    assert np.array_equal(again.assignment, plan.assignment) and np.array_equal(again.copies, plan.copies)
    # Copies: within budget, only into unprotected slots whose binding changed, one per slot.
    assert len(plan.copies) <= params.copy_budget
    pcount = shape.primary_counts
    changed = {(int(w), int(r)) for w, r in zip(*np.nonzero(new.expert != table.expert))}
    copied = {(int(dst), int(s - pcount[dst])) for _, _, dst, s in plan.copies}
    assert changed == copied and len(copied) == len(plan.copies)
    assert not any(protected[w, r] for w, r in copied)
    for ex, _, dst, s in plan.copies:
        assert new.expert[dst, s - pcount[dst]] == ex
    # The returned table: bindings of the plan, last_used = seq exactly where a slot has work.
    for w in range(shape.num_workers):
        for r in range(shape.redundant_slots):
            ex = new.expert[w, r]
            worked = ex >= 0 and plan.assignment[ex, w] > 0
            assert new.last_used[w, r] == (7 if worked else table.last_used[w, r])
            if ex >= 0:
                assert plan.slot[ex, w] == pcount[w] + r
    assert plan.gain_ms >= 0.0 and (plan.gain_ms > 0) == (len(plan.copies) > 0)
    # Never worse than the primary-only plan when there is no previous assignment to follow.
    if prev is None:
        assert plan.max_tile_load <= primary_only_plan(shape, demand, T0, 7).max_tile_load


@settings(max_examples=60, deadline=None)
@given(instances())
def test_rebalancing_never_raises_the_initial_max_tile_load(instance):
    shape, demand, table, protected, prev, params, cost = instance
    plan, _ = algorithm.schedule(shape, demand, table, protected, prev, params, cost, T0, 0)
    k = -(-demand // shape.m_tile)
    has = algorithm.placement(shape.primary_owner, table.expert.astype(np.int64), shape.num_experts)
    init = algorithm.initialize_assignment(k, has, shape.primary_owner,
                                           None if prev is None else prev.astype(np.int64), params.theta)
    assert plan.max_tile_load <= init.sum(axis=0).max(initial=0)
    # Without copies the plan is the within phase's fixed point: no eligible move is left.
    if len(plan.copies) == 0:
        tiles, load = plan.tiles.astype(np.int64), plan.tile_load.astype(np.int64)
        assert algorithm.find_within_move(tiles, load, plan.replicas, params.theta) is None
        if params.chains:
            assert algorithm.find_chain(tiles, load, plan.replicas, params.theta) is None


# ---- bad input: both implementations --------------------------------------------------------

SHAPE = ClusterShape(num_experts=8, num_workers=4, redundant_slots=2, m_tile=4, top_k=2)


def good_args():
    return dict(shape=SHAPE, demand=np.arange(8, dtype=np.int64), table=SlotTable.empty(SHAPE),
                protected=np.zeros((4, 2), bool), prev_assignment=None, params=SchedulerParams(),
                cost=CostModel(), target=T0, seq=0)


def bad_table(expert=None, last_used=None):
    t = SlotTable.empty(SHAPE)
    if expert is not None:
        t.expert = expert
    if last_used is not None:
        t.last_used = last_used
    return t


def with_binding(w, r, e):
    t = SlotTable.empty(SHAPE)
    t.expert[w, r] = e
    return t


def twice_on_worker():
    t = SlotTable.empty(SHAPE)
    t.expert[1, :] = 0
    return t


BAD_INPUTS = [
    ("demand", dict(demand=np.arange(7)), "demand: expected a vector of length 8"),
    ("demand", dict(demand=np.array([1, 2, -1, 0, 0, 0, 0, 0])), "demand: expected non-negative"),
    ("demand", dict(demand=np.array([1.5] + [0.0] * 7)), "demand: expected integer counts"),
    ("demand", dict(demand=np.array([np.nan] + [0.0] * 7)), "demand: expected finite"),
    ("demand", dict(demand=np.array(["a"] * 8)), "demand: expected integer counts"),
    ("demand", dict(demand=np.array([2**31] + [0] * 7)), "demand: expected counts <= 2147483647"),
    ("demand", dict(demand=np.array([2**30] * 8)), "demand: expected a total <= 2147483647"),
    ("table", dict(table=bad_table(expert=np.full((4, 3), -1, np.int32))), "slot_table.expert: expected shape"),
    ("table", dict(table=bad_table(last_used=np.full((3, 2), -1))), "slot_table.last_used: expected shape"),
    ("table", dict(table=bad_table(last_used=np.full((4, 2), -2))), "slot_table.last_used: expected values >= -1"),
    ("table", dict(table=with_binding(0, 0, 8)), r"slot_table.expert: expected values in \[-1, 8\)"),
    ("table", dict(table=with_binding(0, 0, 1)), "slot_table.expert: expert 1 bound to a redundant slot on its own primary"),
    ("table", dict(table=twice_on_worker()), "slot_table.expert: expert 0 bound twice on worker 1"),
    ("table", dict(table="nope"), "slot_table: expected a SlotTable"),
    ("protected", dict(protected=np.zeros((4, 3), bool)), r"protected: expected shape \(4, 2\)"),
    ("protected", dict(protected=np.full((4, 2), 2)), "protected: expected booleans"),
    ("prev", dict(prev_assignment=np.zeros((8, 3), np.int32)), r"prev_assignment: expected shape \(8, 4\)"),
    ("prev", dict(prev_assignment=-np.ones((8, 4), np.int32)), r"prev_assignment: expected counts in \[0"),
    ("prev", dict(prev_assignment=np.full((8, 4), 0.5)), "prev_assignment: expected integer values"),
    ("seq", dict(seq=-1), r"seq: expected an integer in \[0, 2\*\*63\)"),
    ("seq", dict(seq=1.0), "seq: expected an integer"),
    ("shape", dict(shape=(8, 4)), "shape: expected a ClusterShape"),
    ("params", dict(params={}), "params: expected a SchedulerParams"),
    ("cost", dict(cost=None), "cost: expected a CostModel"),
    ("target", dict(target=(0, 0, 0)), "target: expected a Target"),
]


@pytest.mark.parametrize("impl", [algorithm.schedule, core.schedule], ids=["python", "cpp"])
@pytest.mark.parametrize("field,override,message", BAD_INPUTS, ids=[b[2][:40] for b in BAD_INPUTS])
def test_bad_input_raises_value_error_naming_the_field(impl, field, override, message):
    args = good_args()
    args.update(override)
    snapshot = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    with pytest.raises(ValueError, match=message):
        impl(**args)
    for k, v in snapshot.items():  # nothing else disturbed
        if isinstance(v, np.ndarray):
            assert np.array_equal(args[k], v, equal_nan=v.dtype.kind == "f")
    plan, _ = impl(**good_args())  # the implementation keeps working after the error
    check_plan(SHAPE, plan)


def test_following_the_previous_assignment_can_end_above_primary_only():
    # Algorithm 1 adapts A[t-1]; without copies the paper's within phase can stop at a staircase
    # of loads [3, 2, 1] (every gap between replicas is 1) although primary-only gives [2, 2, 2].
    # "Never worse than primary-only" therefore holds for prev_assignment=None (property above)
    # and, with a previous assignment, only relative to the initial assignment.
    shape = ClusterShape(num_experts=3, num_workers=3, redundant_slots=1, m_tile=1, top_k=1)
    table = table_of(shape, {(0, 0): 1, (1, 0): 2})
    prev = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], np.int32)
    plan, _ = plan_with(shape, [2, 2, 2], table, prev=prev, budget=0, chains=False)
    assert plan.tile_load.tolist() == [3, 2, 1]
    plan, _ = plan_with(shape, [2, 2, 2], table, prev=prev, budget=1, chains=False)
    assert plan.tile_load.tolist() == [2, 2, 2]  # one copy breaks the staircase


# ---- ejection chains (beyond the paper) -----------------------------------------------------

def test_a_chain_within_the_placement_breaks_the_staircase_without_a_copy():
    # Same instance: replicas e0 {w0}, e1 {w1, w0}, e2 {w2, w1}; initial tiles e0 w0:2,
    # e1 w0:1 w1:1, e2 w1:1 w2:1, loads [3, 2, 1]. No pair move (w0's experts are not on w2).
    # Search from w0 (T_max 3): w0 -> w1 (e1 on w0, replica on w1), w1 load 2 > 3 - 2;
    # w1 -> w2 (e2), w2 load 1 <= 1. Hops: one tile of e1 w0 -> w1, one tile of e2 w1 -> w2.
    shape = ClusterShape(num_experts=3, num_workers=3, redundant_slots=1, m_tile=1, top_k=1)
    table = table_of(shape, {(0, 0): 1, (1, 0): 2})
    prev = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], np.int32)
    plan, new = plan_with(shape, [2, 2, 2], table, prev=prev, budget=0)
    assert plan.tile_load.tolist() == [2, 2, 2]
    assert plan.tiles.tolist() == [[2, 0, 0], [0, 2, 0], [0, 0, 2]]
    assert plan.copies.shape == (0, 4) and plan.gain_ms == 0.0
    assert np.array_equal(new.expert, table.expert)
    # The search itself, on the initial state: the hops (expert, from, to, slot -1 = no copy).
    tiles = np.array([[2, 0, 0], [1, 1, 0], [0, 1, 1]], np.int64)
    has = algorithm.placement(shape.primary_owner, table.expert.astype(np.int64), 3)
    assert algorithm.find_chain(tiles, tiles.sum(axis=0), has, 0) == [(1, 0, 1, -1), (2, 1, 2, -1)]
    assert algorithm.find_chain(tiles, tiles.sum(axis=0), has, 1) is None  # 1-tile hops need theta < 1
    # theta >= 1: the phase is a no-op, the paper's staircase stays.
    plan, _ = plan_with(shape, [2, 2, 2], table, prev=prev, budget=0, theta=1)
    assert plan.tile_load.tolist() == [3, 2, 1]


def test_a_chain_beyond_the_placement_copies_onto_a_worker_that_passes_a_tile_on():
    # e0 on w0, e1 on w1 and (protected) on w2's redundant slot, e2 on w2. Demand 4, 3, 2 tiles:
    # loads [4, 3, 2], no pair move (w0's only expert e0 is on no other worker), no chain within.
    # Beyond: w2 is the only worker 2 lighter than w0 and has no safe slot; w1 (empty slot) is
    # only 1 lighter, so the paper's scan finds nothing. The chain: copy e0 into w1's slot 0
    # (physical slot 1) and move one tile w0 -> w1, then one tile of e1 w1 -> w2: [3, 3, 3].
    shape = ClusterShape(num_experts=3, num_workers=3, redundant_slots=1, m_tile=1, top_k=1)
    table = table_of(shape, {(2, 0): 1})
    protected = np.array([[False], [False], [True]])
    plan, new = plan_with(shape, [4, 3, 2], table, protected=protected, chains=False)
    assert plan.tile_load.tolist() == [4, 3, 2] and plan.copies.shape == (0, 4)
    plan, new = plan_with(shape, [4, 3, 2], table, protected=protected)
    assert plan.copies.tolist() == [[0, 0, 1, 1]]
    assert plan.tiles.tolist() == [[3, 1, 0], [0, 2, 1], [0, 0, 2]]
    assert plan.tile_load.tolist() == [3, 3, 3]
    assert plan.gain_ms == pytest.approx(FREE_COPIES.beta_tile_ms)  # one tile, copy hidden
    assert new.expert.tolist() == [[-1], [0], [1]]
    # Without a positive net gain (copy exposed) the placement stays.
    exposed = CostModel(beta_tile_ms=0.01, copy_latency_ms=0.5, bytes_per_expert=0, window_ms=0.0)
    plan, _ = plan_with(shape, [4, 3, 2], table, protected=protected, cost=exposed)
    assert plan.tile_load.tolist() == [4, 3, 2] and plan.copies.shape == (0, 4)
    # With the copy budget spent there is no chain with a copy either.
    plan, _ = plan_with(shape, [4, 3, 2], table, protected=protected, budget=0)
    assert plan.tile_load.tolist() == [4, 3, 2]


@settings(max_examples=80, deadline=None)
@given(instances())
def test_chains_are_a_no_op_for_theta_at_least_one(instance):
    shape, demand, table, protected, prev, params, cost = instance
    theta = max(params.theta, 1)
    plans = [algorithm.schedule(shape, demand, table, protected, prev,
                                SchedulerParams(theta=theta, copy_budget=params.copy_budget, chains=c),
                                cost, T0, 1)[0] for c in (True, False)]
    for name in ("assignment", "tiles", "copies", "slot"):
        assert np.array_equal(getattr(plans[0], name), getattr(plans[1], name))


@settings(max_examples=80, deadline=None)
@given(instances())
def test_within_the_placement_chains_never_end_above_the_paper_rule(instance):
    # B = 0: after the paper's fixed point, chains and pair moves only lower the sorted
    # (decreasing) load vector lexicographically.
    shape, demand, table, protected, prev, params, cost = instance
    paper, chained = (algorithm.schedule(shape, demand, table, protected, prev,
                                         SchedulerParams(theta=0, copy_budget=0, chains=c), cost, T0, 1)[0]
                      for c in (False, True))
    assert sorted(chained.tile_load, reverse=True) <= sorted(paper.tile_load, reverse=True)
    assert chained.max_tile_load <= paper.max_tile_load


@settings(max_examples=80, deadline=None)
@given(instances(), st.booleans())
def test_a_chain_lowers_one_max_load_and_keeps_the_intermediate_loads(instance, with_copies):
    shape, demand, table, protected, prev, params, cost = instance
    plan, _ = algorithm.schedule(shape, demand, table, protected, prev,
                                 SchedulerParams(theta=0, copy_budget=0, chains=False), cost, T0, 1)
    tiles, load = plan.tiles.astype(np.int64), plan.tile_load.astype(np.int64)
    has = plan.replicas.copy()
    binding = table.expert.astype(np.int64)
    slots = None
    if with_copies:
        slots = [algorithm.safe_slot(w, tiles, binding, table.last_used, protected)
                 for w in range(shape.num_workers)]
    chain = algorithm.find_chain(tiles, load, has, 0, slots)
    if chain is None:
        return
    workers = [chain[0][1]] + [v for _, _, v, _ in chain]
    assert len(set(workers)) == len(workers)  # a simple path
    assert load[workers[0]] == load.max() and load[workers[-1]] <= load.max() - 2
    assert sum(r >= 0 for *_, r in chain) <= (1 if with_copies else 0)
    after = load.copy()
    for e, u, v, r in chain:
        assert tiles[e, u] > 0
        assert (has[e, v] if r < 0 else not has[e, v] and slots[v] == r)
        after[u] -= 1
        after[v] += 1
    assert after[workers[0]] == load[workers[0]] - 1 and after[workers[-1]] == load[workers[-1]] + 1
    assert np.array_equal(np.delete(after, [workers[0], workers[-1]]), np.delete(load, [workers[0], workers[-1]]))
    assert sorted(after, reverse=True) < sorted(load, reverse=True)
