"""Algorithm 1 against the MILP beyond the steady state: cold slot tables, R = 1, bursts, budgets
1..F, large F (the hold-out of ``afore bench scheduler``), and the certifier's receiver bound
against brute force.

The instances below were above the certified optimum before stage 3b's push path
(``algorithm.find_push_path``) or were left unproven by the certifier before its receiver bound
(``optimal.receiver_bound``); each now plans to the optimum and is certified by a bound, so no
MILP runs and the file takes a few seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from afore.bench.scheduler import holdout_instance
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.plan import SlotTable, check_plan
from afore.scheduler import algorithm, core
from afore.scheduler.optimal import budget_bound, certify, receiver_bound, tile_counts

from tests.test_optimal import _instance, brute_force


def _holdout(kind: str, seed: int, budget: int | None = None) -> list:
    """A hold-out target of the bench (its own budget unless one is given), fixed cost model."""
    args = list(holdout_instance(kind, seed, CostModel(window_ms=5.0)))
    if budget is not None:
        args[5] = SchedulerParams(copy_budget=budget)
    return args


def _plan_and_certify(args: list):
    plan, _ = core.schedule(*args)
    reference, _ = algorithm.schedule(*args)
    for name in ("tiles", "assignment", "copies", "slot", "replicas"):
        assert np.array_equal(getattr(plan, name), getattr(reference, name)), name
    check_plan(args[0], plan, args[2])
    assert len(plan.copies) <= args[5].copy_budget
    cert = certify(args[0], args[1], args[2], args[3], args[5], time_limit_s=20, incumbent=plan.tiles)
    return plan, cert


# Bursts on a warm pool with R = 1 (E = 256): the workers below the level that the hot experts'
# excess needs have their single slot bound to a protected replica, and those with a free slot
# are at the level. A copy onto one of the latter that passes as many tiles of its own on through
# an existing replica reaches the optimum; without it the plan ends one tile above (29 vs 30 at
# F = 16, 10 vs 11 at F = 32, 8 vs 9 at F = 64).
@pytest.mark.parametrize("seed, budget", [(1, 8), (1, 16), (40, 16), (40, 32), (42, 8), (42, 64)])
def test_bursts_reach_the_optimum_through_a_copy_that_passes_tiles_on(seed, budget):
    args = _holdout("burst", seed, budget)
    assert args[0].redundant_slots == 1 and args[3].any()
    plan, cert = _plan_and_certify(args)
    assert cert.status == "optimal"
    assert plan.max_tile_load == cert.optimum


def test_budgets_one_to_f_on_a_burst_never_beat_the_bound_and_match_the_core():
    # Every budget 1..F (F = 16, R = 1, E = 256) on the burst the push path closes: core ==
    # reference, never below the certifier's bound, and at the bound (so certified optimal) from
    # the budget the optimum needs on; the plan's max load never rises with the budget.
    args = _holdout("burst", 1)
    f = args[0].num_workers
    loads = []
    for budget in range(1, f + 1):
        args[5] = SchedulerParams(copy_budget=budget)
        plan, _ = core.schedule(*args)
        reference, _ = algorithm.schedule(*args)
        assert np.array_equal(plan.tiles, reference.tiles) and np.array_equal(plan.copies, reference.copies)
        k = tile_counts(args[0], args[1])
        cert = certify(args[0], args[1], args[2], args[3], args[5], time_limit_s=0.5, incumbent=plan.tiles)
        assert cert.lower_bound <= plan.max_tile_load
        loads.append(plan.max_tile_load)
        if budget >= 8:
            assert (cert.method, plan.max_tile_load) == ("bound", algorithm.average_bound(k, f))
    assert loads == sorted(loads, reverse=True)


# Cold tables, R = 1 or 2, B < F, F = 64 and 128: each copy can carry only the room of one light
# worker, so the plans sit well above the average bound (3 or 4 tiles); the receiver bound proves
# them optimal, where the MILP ran past 20 s before.
@pytest.mark.parametrize("seed", [10, 31, 42])
def test_cold_tables_at_large_f_with_few_copies_are_certified_by_the_receiver_bound(seed):
    args = _holdout("cold", seed)
    shape, params = args[0], args[5]
    assert shape.num_workers >= 64 and params.copy_budget < shape.num_workers
    plan, cert = _plan_and_certify(args)
    k = tile_counts(shape, args[1])
    assert (cert.method, cert.optimum) == ("bound", plan.max_tile_load)
    assert plan.max_tile_load > algorithm.average_bound(k, shape.num_workers)


@pytest.mark.parametrize("seed", range(30))
def test_receiver_bound_never_exceeds_the_optimum(seed):
    # Small instances with budgets 0..3 and existing, protected bindings, against brute force.
    shape, demand, table, protected, _ = _instance(seed)
    k = tile_counts(shape, demand)
    bound_on = np.zeros((shape.num_experts, shape.num_workers), bool)
    w, r = np.nonzero(table.expert >= 0)
    bound_on[table.expert[w, r], w] = True
    rebindable = (~protected).any(axis=1)
    for budget in range(4):
        bound = receiver_bound(shape, k, bound_on.any(axis=1), rebindable, budget)
        assert bound <= brute_force(shape, demand, table, protected, budget)


def test_receiver_bound_counts_the_room_of_the_receivers_not_only_the_copies():
    # Cold, R = 1, one copy, one expert per worker (tiles 10, 2, 2, 2): one copy lets worker 0
    # shed as much as it likes (the budget bound is 2, the others' load), but the one receiver
    # ends at its own 2 tiles plus what it takes: 10 - T <= T - 2, so T >= 6, the optimum.
    shape = ClusterShape(num_experts=4, num_workers=4, redundant_slots=1, m_tile=1, top_k=1)
    k = np.array([10, 2, 2, 2])
    has_other, rebindable = np.zeros(4, bool), np.ones(4, bool)
    assert budget_bound(shape, k, has_other, 1) == 2
    assert receiver_bound(shape, k, has_other, rebindable, 1) == 6
    assert brute_force(shape, k, SlotTable.empty(shape), np.zeros((4, 1), bool), 1) == 6
