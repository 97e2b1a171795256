"""An explicit primary layout (ClusterShape.primaries) is used by every planner and check.

The C++ core returns the reference's plan under random (non-contiguous, uneven) layouts, over
a sequence of targets whose tables and assignments feed the next call; plans keep each expert
on its layout owner at the slot the layout gives; a layout that names an unknown worker or has
the wrong length is rejected with an error naming ``primaries``.
"""

from __future__ import annotations

import numpy as np
import pytest

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.plan import SlotTable, Target, check_plan, primary_only_plan
from afore.scheduler import algorithm, core
from afore.scheduler.policies import make_policy, Observation

from tests.scheduler.test_core_differential import assert_same


def random_layout(rng, e, f):
    """A random owner per expert; every worker gets at least one primary when E >= F."""
    owner = rng.integers(0, f, e)
    if e >= f:
        owner[rng.permutation(e)[:f]] = np.arange(f)
    return owner


def test_contiguous_default_matches_explicit_contiguous():
    shape = ClusterShape(num_experts=10, num_workers=4, top_k=2)
    explicit = shape.with_primaries(shape.primary_owner)
    assert explicit.contiguous_primaries and shape.contiguous_primaries
    for name in ("primary_owner", "primary_slot", "primary_counts", "slots_per_worker"):
        assert np.array_equal(getattr(shape, name), getattr(explicit, name)), name


def test_layout_derived_arrays():
    shape = ClusterShape(num_experts=6, num_workers=3, top_k=2, primaries=(2, 0, 2, 1, 0, 2))
    assert not shape.contiguous_primaries
    assert shape.primary_owner.tolist() == [2, 0, 2, 1, 0, 2]
    assert shape.primary_counts.tolist() == [2, 1, 3]
    assert shape.primary_slot.tolist() == [0, 0, 1, 0, 1, 2]   # ascending id within an owner
    assert shape.primary_experts(2).tolist() == [0, 2, 5]


@pytest.mark.parametrize("primaries, message", [
    ((0, 1, 2), "length 4"),
    ((0, 1, 2, 0), r"in \[0, 2\)"),
    ((0, -1, 1, 0), r"in \[0, 2\)"),
])
def test_bad_layout_rejected(primaries, message):
    with pytest.raises(ValueError, match=rf"primaries: .*{message}"):
        ClusterShape(num_experts=4, num_workers=2, top_k=2, primaries=primaries)


def test_core_rejects_bad_layout():
    from afore import _scheduler_core

    with pytest.raises(ValueError, match="primaries"):
        _scheduler_core.Scheduler(4, 2, 1, 16, [0, 1, 5, 0])


@pytest.mark.parametrize("seed", range(12))
def test_core_equals_reference_under_random_layouts(seed):
    rng = np.random.default_rng(seed)
    e = int(rng.integers(4, 130))
    f = int(rng.choice([2, 3, 8, 16, 32]))
    r = int(rng.integers(0, 4))
    shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=r, m_tile=int(rng.choice([1, 8, 16])),
                         top_k=1, primaries=tuple(int(w) for w in random_layout(rng, e, f)))
    params = SchedulerParams(theta=int(rng.integers(0, 2)), copy_budget=int(rng.integers(0, 9)),
                             chains=bool(rng.integers(0, 2)))
    cost = CostModel(window_ms=float(rng.choice([0.0, 0.5])))
    table = SlotTable.empty(shape)
    protected = np.zeros((f, r), bool)
    prev = None
    for t in range(15):
        p = 1.0 / np.arange(1, e + 1) ** rng.uniform(0.8, 1.6)
        demand = rng.multinomial(int(rng.integers(0, 6000)), rng.permutation(p / p.sum())).astype(np.int64)
        args = (shape, demand, table, protected, prev, params, cost, Target(t, 0, 0), t)
        reference = algorithm.schedule(*args)
        production = core.schedule(*args)
        assert_same(reference, production)
        plan, new_table = production
        check_plan(shape, plan, table)
        rows = np.arange(e)
        assert plan.replicas[rows, shape.primary_owner].all()
        assert np.array_equal(plan.slot[rows, shape.primary_owner], shape.primary_slot)
        for ex, src, _dst, _slot in plan.copies.tolist():
            assert src == shape.primary_owner[ex]
        protected = (new_table.expert >= 0) & (rng.random((f, r)) < 0.3)
        table, prev = new_table, plan.assignment


def test_check_plan_rejects_a_plan_of_another_layout():
    contiguous = ClusterShape(num_experts=8, num_workers=2, redundant_slots=1, top_k=2)
    layout = contiguous.with_primaries([1, 0, 1, 0, 1, 0, 1, 0])
    demand = np.arange(8, dtype=np.int64) * 5
    plan = primary_only_plan(contiguous, demand, Target(0, 0, 0), 0)
    check_plan(contiguous, plan)
    with pytest.raises(ValueError, match="primary"):
        check_plan(layout, plan)


@pytest.mark.parametrize("name", ["static", "eplb", "harmoeny", "lina", "libra", "afore"])
def test_every_policy_keeps_the_layout(name):
    rng = np.random.default_rng(3)
    shape = ClusterShape(num_experts=32, num_workers=4, redundant_slots=2, m_tile=4, top_k=4,
                         primaries=tuple(int(w) for w in rng.permutation(np.arange(32) % 4)))
    policy = make_policy(name, shape, SchedulerParams(), CostModel())
    for t in range(12):
        demand = rng.multinomial(512, rng.dirichlet(np.full(32, 0.3))).astype(np.int64)
        plan = policy.plan(Observation(Target(t, 0, 0), t, demand))
        check_plan(shape, plan)   # primaries at the layout's owner and slot, copies from them


def test_sem_moe_runs_every_pair_on_the_co_clustered_primary():
    rng = np.random.default_rng(4)
    shape = ClusterShape(num_experts=16, num_workers=4, redundant_slots=2, m_tile=2, top_k=2,
                         primaries=tuple(int(w) for w in rng.permutation(np.arange(16) % 4)))
    policy = make_policy("sem-moe", shape, SchedulerParams(), CostModel())
    for t in range(4):
        demand = rng.integers(0, 50, 16)
        plan = policy.plan(Observation(Target(t, 0, 0), t, demand))
        check_plan(shape, plan)
        assert np.array_equal(plan.assignment[np.arange(16), shape.primary_owner], demand)
        assert len(plan.copies) == 0
