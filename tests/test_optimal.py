"""The MILP certifier against brute force on small instances, and the greedy against the MILP."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler import algorithm, core
from afore.scheduler.optimal import certify, check_tiles_feasible, lower_bounds, tile_counts
from afore.plan import SlotTable, Target


def brute_force(shape, demand, table, protected, budget):
    """Minimum max tile load by enumerating every redundant placement and every tile split."""
    E, F, R = shape.num_experts, shape.num_workers, shape.redundant_slots
    k = tile_counts(shape, demand)
    owner = shape.primary_owner
    per_worker = []
    for w in range(F):
        fixed = {int(table.expert[w, r]) for r in range(R) if protected[w, r] and table.expert[w, r] >= 0}
        cap = R - int(np.sum(protected[w] & (table.expert[w] < 0)))
        others = [e for e in range(E) if owner[e] != w and e not in fixed]
        options = []
        for n in range(0, cap - len(fixed) + 1):
            for extra in itertools.combinations(others, n):
                options.append(fixed | set(extra))
        per_worker.append(options)
    best = None
    for choice in itertools.product(*per_worker):
        new = sum(len(s - {int(x) for x in table.expert[w] if x >= 0}) for w, s in enumerate(choice))
        if new > budget:
            continue
        hosts = [[owner[e]] + [w for w in range(F) if e in choice[w]] for e in range(E)]
        splits = []
        for e in range(E):
            opts = []
            for parts in itertools.product(range(int(k[e]) + 1), repeat=len(hosts[e])):
                if sum(parts) == k[e]:
                    opts.append(parts)
            splits.append(opts)
        for combo in itertools.product(*splits):
            load = [0] * F
            for e, parts in enumerate(combo):
                for w, n in zip(hosts[e], parts):
                    load[w] += n
            value = max(load)
            if best is None or value < best:
                best = value
    return best


def _instance(seed):
    rng = np.random.default_rng(seed)
    E, F, R = int(rng.integers(2, 5)), int(rng.integers(2, 4)), 1
    shape = ClusterShape(num_experts=E, num_workers=F, redundant_slots=R, m_tile=4, top_k=1)
    demand = rng.integers(0, 13, E) * rng.integers(0, 2, E)
    table = SlotTable.empty(shape)
    protected = np.zeros((F, R), bool)
    owner = shape.primary_owner
    for w in range(F):
        if rng.random() < 0.5:
            candidates = [e for e in range(E) if owner[e] != w]
            table.expert[w, 0] = int(rng.choice(candidates))
            protected[w, 0] = rng.random() < 0.5
    return shape, demand, table, protected, int(rng.integers(0, 3))


@pytest.mark.parametrize("seed", range(25))
def test_milp_matches_brute_force(seed):
    shape, demand, table, protected, budget = _instance(seed)
    params = SchedulerParams(theta=0, copy_budget=budget)
    cert = certify(shape, demand, table, protected, params, time_limit_s=10)
    assert cert.status == "optimal"
    assert cert.optimum == brute_force(shape, demand, table, protected, budget)
    assert cert.lower_bound <= cert.optimum
    # the returned solution is feasible and achieves the optimum
    check_tiles_feasible(shape, tile_counts(shape, demand), table, protected, budget, cert.tiles)
    assert cert.tiles.sum(axis=0).max() == cert.optimum


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), theta=st.integers(0, 2))
def test_greedy_never_beats_the_optimum(seed, theta):
    shape, demand, table, protected, budget = _instance(seed)
    params = SchedulerParams(theta=theta, copy_budget=budget)
    plan, _ = algorithm.schedule(shape, demand, table, protected, None, params, CostModel(window_ms=1e3),
                                 Target(0, 0, 0), 1)
    cert = certify(shape, demand, table, protected, params, time_limit_s=10, incumbent=plan.tiles)
    assert cert.status == "optimal"
    assert plan.max_tile_load >= cert.optimum
    assert cert.optimum == brute_force(shape, demand, table, protected, budget)


def test_bound_short_circuit_and_larger_instance():
    shape = ClusterShape(num_experts=32, num_workers=4, redundant_slots=2, m_tile=16)
    rng = np.random.default_rng(3)
    demand = rng.integers(0, 400, 32)
    table = SlotTable.empty(shape)
    protected = np.zeros((4, 2), bool)
    params = SchedulerParams(theta=0, copy_budget=4)
    plan, _ = algorithm.schedule(shape, demand, table, protected, None, params, CostModel(window_ms=1e3), Target(0, 0, 0), 0)
    cert = certify(shape, demand, table, protected, params, incumbent=plan.tiles)
    lb = lower_bounds(shape, tile_counts(shape, demand), table, protected, 4)
    assert cert.optimum >= lb
    if plan.max_tile_load == lb:
        assert cert.method == "bound"
    assert cert.optimum <= plan.max_tile_load
    assert cert.gap(plan.max_tile_load) == pytest.approx((plan.max_tile_load - cert.optimum) / cert.optimum)


def test_one_hot_expert_bound():
    # one expert holds all demand: the optimum spreads it over 1 + B workers
    shape = ClusterShape(num_experts=8, num_workers=4, redundant_slots=1, m_tile=1, top_k=1)
    demand = np.zeros(8, np.int64)
    demand[0] = 12
    table, protected = SlotTable.empty(shape), np.zeros((4, 1), bool)
    for budget, expected in [(0, 12), (1, 6), (2, 4), (3, 3), (8, 3)]:
        cert = certify(shape, demand, table, protected, SchedulerParams(copy_budget=budget))
        assert cert.optimum == expected


def test_protected_binding_stays_and_blocks_slot():
    shape = ClusterShape(num_experts=4, num_workers=2, redundant_slots=1, m_tile=1, top_k=1)
    demand = np.array([10, 0, 0, 0])
    table = SlotTable.empty(shape)
    table.expert[1, 0] = 1  # expert 1 (idle) sits in worker 1's only slot
    free = certify(shape, demand, table, np.zeros((2, 1), bool), SchedulerParams(copy_budget=1))
    locked = certify(shape, demand, table, np.ones((2, 1), bool), SchedulerParams(copy_budget=1))
    assert free.optimum == 5 and locked.optimum == 10


def test_bad_inputs():
    shape = ClusterShape(num_experts=4, num_workers=2, redundant_slots=1, top_k=2)
    table = SlotTable.empty(shape)
    with pytest.raises(ValueError, match="demand"):
        certify(shape, [1, 2, 3], table, np.zeros((2, 1), bool), SchedulerParams())
    with pytest.raises(ValueError, match="protected"):
        certify(shape, [1, 2, 3, 4], table, np.zeros((3, 1), bool), SchedulerParams())
    with pytest.raises(ValueError, match="time_limit_s"):
        certify(shape, [1, 2, 3, 4], table, np.zeros((2, 1), bool), SchedulerParams(), time_limit_s=0)
    with pytest.raises(ValueError, match="incumbent"):
        certify(shape, [16, 0, 0, 0], table, np.zeros((2, 1), bool), SchedulerParams(), incumbent=np.zeros((4, 2), int))


def _holdout(kind, seed):
    """A hold-out target of ``afore bench scheduler`` (cold table or burst) with budget B = F."""
    from afore.bench.scheduler import holdout_instance

    args = list(holdout_instance(kind, seed, CostModel(window_ms=5.0)))
    args[5] = SchedulerParams(copy_budget=args[0].num_workers)
    return args


HOLDOUT_SEEDS = [s for s in range(40) if _holdout("cold", s)[0].num_workers <= 32]


@pytest.mark.parametrize("seed", HOLDOUT_SEEDS)
def test_greedy_reaches_the_optimum_on_cold_slot_tables(seed):
    # Cold tables, R = 1 or 2, M_tile 64-128, E up to 256: the regime where the paper's q (half the
    # gap) overshoots and leaves the last overloaded workers without a receiver with a free slot.
    args = _holdout("cold", seed)
    shape = args[0]
    assert shape.redundant_slots in (1, 2) and shape.m_tile >= 64
    plan, _ = core.schedule(*args)
    reference, _ = algorithm.schedule(*args)
    assert plan.max_tile_load == reference.max_tile_load
    cert = certify(shape, args[1], args[2], args[3], args[5], time_limit_s=20, incumbent=plan.tiles)
    assert cert.status == "optimal"
    assert plan.max_tile_load == cert.optimum


def test_greedy_is_within_one_tile_of_the_optimum_on_bursts_and_mostly_optimal():
    # Bursts on a warm pool (protected slots, previous assignment). Seed 1 (E=256, F=16, R=1, every
    # light worker's single slot holding a protected replica) was 30 vs 29 until stage 3b's push
    # path (a copy onto a worker at the level that passes its own tiles on through a replica).
    seeds = [s for s in range(40) if _holdout("burst", s)[0].num_workers <= 32]
    optimal = 0
    for seed in seeds:
        args = _holdout("burst", seed)
        plan, _ = core.schedule(*args)
        cert = certify(args[0], args[1], args[2], args[3], args[5], time_limit_s=20, incumbent=plan.tiles)
        assert cert.status == "optimal"
        assert cert.optimum <= plan.max_tile_load <= cert.optimum + 1
        optimal += plan.max_tile_load == cert.optimum
    assert optimal >= len(seeds) - 1


def test_afore_extensions_beat_the_paper_rule_where_slots_are_scarce():
    # E=128, F=8, R=1, cold table: the paper rule alone ends 3 tiles above the average bound;
    # chains and the search aimed at that bound reach it (the optimum).
    args = _holdout("cold", 36)
    paper = SchedulerParams(copy_budget=args[5].copy_budget, chains=False)
    greedy, _ = core.schedule(*args)
    alone, _ = core.schedule(*args[:5], paper, *args[6:])
    k = tile_counts(args[0], args[1])
    assert greedy.max_tile_load == algorithm.average_bound(k, args[0].num_workers) < alone.max_tile_load


@pytest.mark.parametrize("seed", range(30))
def test_budget_bound_never_exceeds_the_optimum(seed):
    # Small instances with budgets 0..3 (and existing, protected bindings): the bound that counts
    # the copies each overloaded worker needs is a lower bound of the brute-force optimum.
    from afore.scheduler.optimal import budget_bound

    shape, demand, table, protected, _ = _instance(seed)
    k = tile_counts(shape, demand)
    bound_on = np.zeros((shape.num_experts, shape.num_workers), bool)
    w, r = np.nonzero(table.expert >= 0)
    bound_on[table.expert[w, r], w] = True
    for budget in range(4):
        assert budget_bound(shape, k, bound_on.any(axis=1), budget) <= brute_force(shape, demand, table, protected, budget)


def test_budget_bound_certifies_one_copy_on_a_cold_table():
    # One copy on a cold table: only the most loaded worker can shed, so the second largest
    # primary load bounds the optimum; the average and per-expert bounds are far below it.
    shape = ClusterShape(num_experts=8, num_workers=4, redundant_slots=1, m_tile=1, top_k=1)
    demand = np.array([9, 1, 7, 1, 5, 1, 1, 1])  # primary loads 10, 8, 6, 2
    table, protected = SlotTable.empty(shape), np.zeros((4, 1), bool)
    params = SchedulerParams(copy_budget=1)
    plan, _ = core.schedule(shape, demand, table, protected, None, params, CostModel(window_ms=1e3), Target(0, 0, 0), 0)
    cert = certify(shape, demand, table, protected, params, incumbent=plan.tiles)
    assert algorithm.average_bound(tile_counts(shape, demand), 4) == 7
    assert (cert.method, cert.optimum, plan.max_tile_load) == ("bound", 8, 8)


def _small_budget_cases():
    cases = []
    for kind in ("cold", "burst"):
        for seed in range(16):
            f = _holdout(kind, seed)[0].num_workers
            if f <= 16:
                cases += [(kind, seed, b) for b in sorted({1, max(1, f // 4), f // 2, f - 1})]
    return cases


def test_greedy_with_budgets_below_f_against_the_milp():
    # B < F on cold tables and bursts, R = 1 or 2, budgets 1, F/4, F/2 and F - 1: the core equals
    # the reference, never beats the certified bound and never does worse than the paper's rule
    # alone; where the MILP closes the instance the greedy is mostly at the optimum. The known
    # misses are bursts where the receiver with room for a hot expert's copy is a worker that
    # must first push its own tiles to existing replicas (burst seed 1, B = 1: 41 vs 38).
    certified = optimal = paper_optimal = 0
    for kind, seed, budget in _small_budget_cases():
        args = _holdout(kind, seed)
        args[5] = SchedulerParams(copy_budget=budget)
        plan, _ = core.schedule(*args)
        reference, _ = algorithm.schedule(*args)
        assert np.array_equal(plan.tiles, reference.tiles) and np.array_equal(plan.copies, reference.copies)
        assert len(plan.copies) <= budget
        paper, _ = core.schedule(*args[:5], SchedulerParams(copy_budget=budget, chains=False), *args[6:])
        assert plan.max_tile_load <= paper.max_tile_load
        cert = certify(args[0], args[1], args[2], args[3], args[5], time_limit_s=2, incumbent=plan.tiles)
        assert cert.lower_bound <= plan.max_tile_load
        if cert.status == "optimal":
            certified += 1
            optimal += plan.max_tile_load == cert.optimum
            paper_optimal += paper.max_tile_load == cert.optimum
            assert plan.max_tile_load <= cert.optimum + 3
    # Which instances HiGHS closes within 2 s depends on the machine's load. Measured (seeds
    # 0-15, 2026-12-02): 32 of 33 and 33 of 38 certified instances optimal (the misses: burst
    # seed 1, B = 1, 4, 8, up to 3 tiles above); the paper's rule alone 22 of 33.
    assert certified >= 25 and optimal >= 0.8 * certified and optimal > paper_optimal
