"""Every policy behind the one interface: valid plans, exact demand coverage, its own behaviour."""

from pathlib import Path

import numpy as np
import pytest

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler import algorithm, policies
from afore.plan import SlotTable, Target, check_plan
from afore.scheduler.policies import POLICY_NAMES, REGISTRY, Observation, make_policy
from afore.scheduler.policies.base import migration_ms, overlapped_ms, slots_with_work
from afore.scheduler.policies.eplb import apply_layout, rebalance, replicate
from afore.traces.synthetic import SyntheticSpec, generate

SHAPE = ClusterShape(num_experts=32, num_workers=4, num_layers=2, redundant_slots=2, m_tile=8, top_k=4)
PARAMS = SchedulerParams(theta=0, copy_budget=3)
COST = CostModel()


def _trace(steps=8, seed=0):
    return generate(SyntheticSpec(num_experts=32, num_layers=2, top_k=4, tokens=128, steps=steps,
                                  microbatches=2, seed=seed)).counts.astype(np.int64)


def _replay(policy, counts):
    """Yield (obs, plan, table_before, protected_before) for every target in execution order."""
    seq = 0
    for s in range(counts.shape[0]):
        for l in range(counts.shape[1]):
            for b in range(counts.shape[2]):
                state = policy.layer(l)
                before, protected = state.table.copy(), state.protected(policy.shape)
                obs = Observation(Target(s, l, b), seq, counts[s, l, b])
                yield obs, policy.plan(obs), before, protected
                seq += 1


def test_registry_has_every_policy_module_and_lists_baselines_first():
    folder = Path(policies.__file__).parent
    modules = {f"afore.scheduler.policies.{p.stem}" for p in folder.glob("*.py") if p.stem not in ("__init__", "base")}
    assert {cls.__module__ for cls in REGISTRY.values()} == modules
    assert POLICY_NAMES[0] == "static" and POLICY_NAMES.index("afore") > POLICY_NAMES.index("eplb")
    with pytest.raises(ValueError, match="policy"):
        make_policy("nope", SHAPE, PARAMS, COST)
    with pytest.raises(ValueError, match="options"):
        make_policy("static", SHAPE, PARAMS, COST, window=3)
    with pytest.raises(ValueError, match="impl"):
        make_policy("afore", SHAPE, PARAMS, COST, impl="fortran")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_plans_are_valid_and_cover_actual_demand(name):
    policy = make_policy(name, SHAPE, PARAMS, COST)
    copies_seen = 0
    for obs, plan, before, protected in _replay(policy, _trace()):
        check_plan(SHAPE, plan, before)
        assert np.array_equal(plan.assignment.sum(axis=1), obs.demand)
        assert plan.target == obs.target and plan.seq == obs.seq
        pcount = SHAPE.primary_counts
        for e, src, dst, slot in plan.copies.tolist():
            assert not protected[dst, slot - pcount[dst]], "copy overwrites a slot the running target reads"
        # protected bindings survive the plan
        for w, r in zip(*np.nonzero(protected)):
            assert plan.slot[before.expert[w, r], w] == pcount[w] + r
        if REGISTRY[name].BUDGETED:
            assert len(plan.copies) <= PARAMS.copy_budget
        assert plan.exposed_ms >= 0
        copies_seen += len(plan.copies)
    if name in ("static", "sem-moe"):   # sem-moe: static on the (here contiguous) primaries
        assert copies_seen == 0
    elif name not in ("eplb", "eplb-async"):
        assert copies_seen > 0  # skewed synthetic demand: every adaptive policy replicates something


def test_static_runs_everything_on_primaries():
    policy = make_policy("static", SHAPE, PARAMS, COST)
    for obs, plan, *_ in _replay(policy, _trace(steps=2)):
        owner = SHAPE.primary_owner
        assert np.array_equal(plan.assignment[np.arange(32), owner], obs.demand)
        assert len(plan.copies) == 0


def test_balancing_policies_beat_static():
    counts = _trace(steps=10, seed=3)
    ratio = {}
    for name in POLICY_NAMES:
        options = {"window": 8, "period": 4} if name.startswith("eplb") else {}
        policy = make_policy(name, SHAPE, PARAMS, COST, **options)
        loads = [p.max_tile_load / p.tile_load.mean() for obs, p, *_ in _replay(policy, counts) if obs.target.step >= 4]
        ratio[name] = np.mean(loads)
    for name in POLICY_NAMES:
        if name not in ("static", "sem-moe"):   # sem-moe never moves work off the primaries
            assert ratio[name] < ratio["static"], name
    assert ratio["afore"] <= ratio["lina"] and ratio["afore"] <= ratio["eplb"]


def test_afore_matches_core_and_reference_and_ablation_overlap():
    counts = _trace(steps=4)
    afore = make_policy("afore", SHAPE, PARAMS, COST)
    ref = make_policy("afore", SHAPE, PARAMS, COST, impl="reference")
    no_overlap = make_policy("afore-no-overlap", SHAPE, PARAMS, COST)
    for (o1, p1, t1, u1), (o2, p2, *_), (o3, p3, *_) in zip(_replay(afore, counts), _replay(ref, counts), _replay(no_overlap, counts)):
        assert np.array_equal(p1.assignment, p2.assignment) and np.array_equal(p1.copies, p2.copies)
        assert np.array_equal(p1.assignment, p3.assignment) and np.array_equal(p1.copies, p3.copies)
        assert p3.exposed_ms == pytest.approx(migration_ms(p3.copies, SHAPE.num_workers, COST))
        assert p1.exposed_ms == pytest.approx(overlapped_ms(p1.copies, SHAPE.num_workers, COST))



def test_protected_slots_are_the_slots_with_work_in_the_last_plan():
    policy = make_policy("afore", SHAPE, PARAMS, COST)
    demand = np.zeros(32, np.int64)
    demand[0] = 400  # expert 0 (primary on worker 0) is hot: replicas get work
    plan = policy.plan(Observation(Target(0, 0, 0), 0, demand))
    state = policy.layer(0)
    busy = slots_with_work(SHAPE, state.table, plan)
    assert busy.sum() == len(plan.copies) > 0
    assert np.array_equal(state.protected(SHAPE), busy)
    assert not policy.layer(1).protected(SHAPE).any()  # per-layer state


def test_afore_no_prefetch_plans_from_the_previous_step():
    counts = _trace(steps=3)
    policy = make_policy("afore-no-prefetch", SHAPE, PARAMS, COST)
    plans = {obs.target: (obs, plan, before, prot) for obs, plan, before, prot in _replay(policy, counts)}
    for target, (obs, plan, before, prot) in plans.items():
        if target.step == 0:
            assert len(plan.copies) == 0  # nothing observed yet at this (layer, microbatch)
    # step 1 placement comes from step 0's demand at the same layer and microbatch
    obs, plan, before, prot = plans[Target(1, 1, 1)]
    prev_plan = plans[Target(0, 1, 1)][1]
    guess, _ = algorithm.schedule(SHAPE, counts[0, 1, 1], before, prot, policy_prev(plans, Target(1, 1, 1)), PARAMS, COST, obs.target, obs.seq)
    assert np.array_equal(plan.copies, guess.copies)
    assert np.array_equal(plan.assignment.sum(axis=1), counts[1, 1, 1])


def policy_prev(plans, target):
    """A[t-1] of the layer: the plan of the previous target of the same layer in execution order."""
    order = sorted(plans, key=lambda t: plans[t][0].seq)
    prev = [t for t in order if t.layer == target.layer and plans[t][0].seq < plans[target][0].seq]
    return plans[prev[-1]][1].assignment if prev else None


def test_eplb_rebalances_periodically_and_async_overlaps():
    hot = np.full(32, 8, np.int64)
    hot[0] = 600
    sync = make_policy("eplb", SHAPE, PARAMS, COST, window=4, period=4)
    asyn = make_policy("eplb-async", SHAPE, PARAMS, COST, window=4, period=4)
    copies = []
    for i in range(9):
        p = sync.plan(Observation(Target(i, 0, 0), i, hot))
        q = asyn.plan(Observation(Target(i, 0, 0), i, hot))
        copies.append(len(p.copies))
        assert np.array_equal(p.copies, q.copies)
        assert p.exposed_ms == pytest.approx(migration_ms(p.copies, 4, COST))
        assert q.exposed_ms == pytest.approx(overlapped_ms(q.copies, 4, COST))
        # even split: an expert's tiles differ by at most one across its replicas
        for e in range(32):
            t = p.tiles[e][p.replicas[e]]
            assert t.max() - t.min() <= 1
    assert copies[:4] == [0, 0, 0, 0] and copies[4] > 0  # first rebalance after `period` observations
    assert sync.layer(0).last_plan.replicas[0].sum() > 1  # the hot expert is replicated


def test_eplb_algorithm_pieces():
    load = np.array([100.0, 10, 10, 10, 50, 10, 10, 10])
    counts = replicate(load, 4, 4)
    assert counts.sum() == 12 and counts[0] == 4 and counts[4] == 2  # 100 -> 50, 50 (tie: e0) -> 33 vs 50 -> 33 vs 25
    shape = ClusterShape(num_experts=8, num_workers=4, redundant_slots=1, top_k=2)
    desired = rebalance(shape, load)
    owner = shape.primary_owner
    for w, experts in enumerate(desired):
        assert len(experts) <= 1 and all(owner[e] != w for e in experts)
    assert sum(0 in d for d in desired) == 3 and desired[0] == {4}
    hier = rebalance(shape, load, num_nodes=2)
    assert sum(len(d) for d in hier) == 4 and all(len(d) <= 1 for d in hier)
    protected = np.array([[True], [False], [False], [False]])
    binding = np.array([[5], [-1], [-1], [-1]], np.int32)
    out = apply_layout(binding, [{0}, {0}, {4}, {0}], protected)
    assert out[0, 0] == 5 and out[1, 0] == 0 and out[2, 0] == 4 and out[3, 0] == 0


def test_harmoeny_replicates_the_hot_expert_on_the_critical_path():
    demand = np.full(32, 8, np.int64)
    demand[1] = 800
    policy = make_policy("harmoeny", SHAPE, PARAMS, COST)
    plan = policy.plan(Observation(Target(0, 0, 0), 0, demand))
    assert len(plan.copies) > 0 and set(plan.copies[:, 0]) == {1}
    static = make_policy("static", SHAPE, PARAMS, COST).plan(Observation(Target(0, 0, 0), 0, demand))
    assert plan.max_tile_load < static.max_tile_load
    assert plan.exposed_ms == pytest.approx(migration_ms(plan.copies, 4, COST))


def test_lina_replicates_what_was_hot_before():
    demand = np.full(32, 8, np.int64)
    demand[1] = 800
    policy = make_policy("lina", SHAPE, PARAMS, COST)
    first = policy.plan(Observation(Target(0, 0, 0), 0, demand))
    assert len(first.copies) == 0  # no history yet
    second = policy.plan(Observation(Target(1, 0, 0), 1, demand))
    assert len(second.copies) > 0 and 1 in set(second.copies[:, 0])
    assert second.max_tile_load < first.max_tile_load


def test_libra_learns_cross_layer_transitions():
    policy = make_policy("libra", SHAPE, PARAMS, COST)
    rng = np.random.default_rng(0)
    seq = 0
    for step in range(12):
        # the hot expert of layer 1 is determined by the hot expert of layer 0 (h -> 31 - h)
        h = step % 4  # every pattern is seen before the checked step
        d0 = np.full(32, 4, np.int64)
        d0[h] = 600
        d1 = np.full(32, 4, np.int64)
        d1[31 - h] = 600
        policy.plan(Observation(Target(step, 0, 0), seq, d0))
        seq += 1
        if step == 11:
            predicted = policy.predict(Target(step, 1, 0))
            assert int(np.argmax(predicted)) == 31 - h
            plan = policy.plan(Observation(Target(step, 1, 0), seq, d1))
            assert 31 - h in set(plan.copies[:, 0].tolist()) or plan.replicas[31 - h].sum() > 1
            assert np.array_equal(plan.assignment.sum(axis=1), d1)
        else:
            policy.plan(Observation(Target(step, 1, 0), seq, d1))
        seq += 1


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_bad_observations(name):
    policy = make_policy(name, SHAPE, PARAMS, COST)
    with pytest.raises(ValueError, match="demand"):
        policy.plan(Observation(Target(0, 0, 0), 0, np.ones(31, np.int64)))
    with pytest.raises(ValueError, match="demand"):
        policy.plan(Observation(Target(0, 0, 0), 0, -np.ones(32, np.int64)))
    with pytest.raises(ValueError, match="layer"):
        policy.plan(Observation(Target(0, 2, 0), 0, np.ones(32, np.int64)))
    with pytest.raises(ValueError, match="seq"):
        policy.plan(Observation(Target(0, 0, 0), -1, np.ones(32, np.int64)))
    assert not policy.layers or all(s.last_plan is None for s in policy.layers.values())  # nothing disturbed


def test_set_state_seeds_the_first_plan():
    policy = make_policy("afore", SHAPE, PARAMS, COST)
    table = SlotTable.empty(SHAPE)
    table.expert[1, 0] = 0
    protected = np.zeros((4, 2), bool)
    protected[1, 0] = True
    policy.set_state(0, table, protected, None)
    demand = np.zeros(32, np.int64)
    demand[0] = 300
    plan = policy.plan(Observation(Target(0, 0, 0), 0, demand))
    assert plan.assignment[0, 1] > 0  # the seeded replica is used without a copy
    assert all(c[2] != 1 or c[3] != SHAPE.primary_counts[1] for c in plan.copies.tolist())
    with pytest.raises(ValueError, match="protected"):
        policy.set_state(0, table, np.zeros((3, 2), bool))


def test_slots_with_work_in_cpp_is_the_numpy_expression(monkeypatch):
    """The C++ slots_with_work (the scheduler's critical path) against the numpy expression on
    random tables and plans: unbound slots, experts bound elsewhere, work on other workers."""
    from afore.scheduler.policies import base

    assert base._core_slots_with_work is not None  # the build has it
    busy = 0
    for seed in range(200):
        busy += _compare_slots_with_work(seed, monkeypatch)
    assert busy > 50  # the inputs do bind slots with work


def _compare_slots_with_work(seed, monkeypatch) -> int:
    from afore.scheduler.policies import base

    rng = np.random.default_rng(seed)
    e, f, r = int(rng.integers(2, 40)), int(rng.integers(1, 9)), int(rng.integers(1, 4))
    shape = ClusterShape(num_experts=e, num_workers=f, num_layers=1, redundant_slots=r, top_k=1)
    expert = rng.integers(-1, e, size=(f, r)).astype(np.int32)
    assignment = (rng.integers(0, 3, size=(e, f)) * (rng.random((e, f)) < 0.5)).astype(np.int32)
    slot_ids = shape.primary_counts[None, :] + rng.integers(-1, r + 1, size=(e, f))
    slot = np.where(rng.random((e, f)) < 0.2, -1, slot_ids).astype(np.int32)
    plan = type("P", (), {"assignment": assignment, "slot": slot})()
    table = SlotTable(expert, np.zeros((f, r), np.int64))
    got = slots_with_work(shape, table, plan)
    with monkeypatch.context() as m:
        m.setattr(base, "_core_slots_with_work", None)
        want = slots_with_work(shape, table, plan)
    assert got.dtype == want.dtype == np.bool_ and np.array_equal(got, want), seed
    return int(want.sum())
