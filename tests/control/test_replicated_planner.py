"""The replicated planner (``afore serve --planner workers``): every FFN worker plans each target
itself, and the design rests on every replica making the same plan from the same inputs."""

from __future__ import annotations

import numpy as np
import pytest

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.migrator.plan_source import ReplicatedPlanSource
from afore.plan import Target
from afore.scheduler.policies import POLICY_NAMES

SHAPE = ClusterShape(num_experts=16, num_workers=4, num_layers=2, redundant_slots=2, m_tile=2, top_k=4)
PARAMS = SchedulerParams(copy_budget=4)
COST = CostModel(beta_tile_ms=0.01, bytes_per_expert=1 << 20, window_ms=0.5)
LAYERS, MICROBATCHES = SHAPE.num_layers, 1


def _targets(n: int, seed: int = 3):
    """(target, seq, int64[E] demand) in FFN order, skewed and changing over the steps."""
    rng = np.random.default_rng(seed)
    out = []
    for seq in range(n):
        target = Target.from_seq(seq, LAYERS, MICROBATCHES)
        hot = rng.permutation(SHAPE.num_experts)
        demand = np.zeros(SHAPE.num_experts, np.int64)
        demand[hot[:3]] = rng.integers(8, 40, 3)
        demand[hot[3:10]] = rng.integers(0, 4, 7)
        out.append((target, seq, demand))
    return out


def _same(a, b) -> bool:
    names = ("assignment", "slot", "copies", "demand")
    return a.seq == b.seq and a.target == b.target and all(np.array_equal(getattr(a, n), getattr(b, n)) for n in names)


def _source(policy: str = "afore") -> ReplicatedPlanSource:
    return ReplicatedPlanSource(policy, SHAPE, PARAMS, COST)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_replicas_make_the_same_plan_for_every_target(policy):
    """Two replicas (two FFN workers) fed the same targets in the same order make byte-identical
    plans with every policy: the determinism that lets the workers plan without exchanging plans
    (each replica is a fresh policy object, as in another process)."""
    a, b = _source(policy), _source(policy)
    plans_a = [a.get(target, seq, 0.0, demand) for target, seq, demand in _targets(24)]
    plans_b = [b.get(target, seq, 0.0, demand) for target, seq, demand in _targets(24)]
    assert all(p is not None for p in plans_a + plans_b)
    assert all(_same(x, y) for x, y in zip(plans_a, plans_b))
    assert all(int(p.assignment.sum()) == int(d.sum()) for p, (_, _, d) in zip(plans_a, _targets(24)))
    if policy == "afore":  # skewed demand: the afore policy copies, so the check covers copies and slots
        assert sum(len(p.copies) for p in plans_a) > 0


def test_after_a_reset_every_replica_plans_as_a_fresh_one():
    """A failed vote restarts every replica at the same target, whatever each did before it (one
    had planned a target ahead, another had skipped one): afterwards they all plan as a planner
    started afresh at that point."""
    targets = _targets(16)
    ahead, skipped, fresh = _source(), _source(), _source()
    for target, seq, demand in targets[:7]:      # planned 0..6 (6 read ahead of the vote on 5)
        ahead.get(target, seq, 0.0, demand)
    for target, seq, demand in targets[:5]:      # planned 0..4, never got 5
        skipped.get(target, seq, 0.0, demand)
    ahead.reset(5)
    skipped.reset(5)
    assert ahead.resets == skipped.resets == 1
    for target, seq, demand in targets[6:]:
        p_ahead, p_skipped = ahead.get(target, seq, 0.0, demand), skipped.get(target, seq, 0.0, demand)
        p_fresh = fresh.get(target, seq, 0.0, demand)
        assert p_ahead is not None and _same(p_ahead, p_skipped) and _same(p_ahead, p_fresh)


def test_no_second_plan_for_a_target_and_demand_is_required():
    source = _source()
    (t0, s0, d0), (t1, s1, d1) = _targets(2)
    assert source.get(t0, s0, 0.0, d0) is not None
    assert source.get(t0, s0, 0.0, d0) is None  # asked again: a miss, never a second (different) plan
    assert source.misses == 1 and source.hits == 1
    with pytest.raises(ValueError, match="demand: expected the target's routed counts"):
        source.get(t1, s1, 0.0)
    with pytest.raises(ValueError, match=r"demand: expected int64\[16\]"):
        source.get(t1, s1, 0.0, np.zeros(SHAPE.num_experts + 1, np.int64))
    assert source.get(t1, s1, 0.0, d1) is not None  # the bad calls cost nothing


def test_a_policy_error_is_a_miss_on_every_replica(monkeypatch):
    """A policy that raises gives no plan (the workers run the target primary-only) and planning
    goes on with the next target."""
    source = _source()
    (t0, s0, d0), (t1, s1, d1) = _targets(2)

    def boom(obs):
        raise RuntimeError("injected")

    monkeypatch.setattr(source.policy, "plan", boom)
    assert source.get(t0, s0, 0.0, d0) is None and source.errors == 1
    monkeypatch.undo()
    assert source.get(t1, s1, 0.0, d1) is not None


def test_plan_digest_tells_apart_what_a_worker_applies():
    """Equal plans (another replica's, a decoded copy) digest the same; a change in the seq, the
    assignment, a slot binding or the copies changes the digest; "no plan" (0) is never a digest."""
    import dataclasses

    from afore.plan import plan_digest

    target, seq, demand = _targets(1)[0]
    plan = _source().get(target, seq, 0.0, demand)
    twin = _source().get(target, seq, 0.0, demand)
    assert plan_digest(plan) == plan_digest(twin) != 0
    assignment = plan.assignment.copy()
    e = int(np.flatnonzero(assignment.sum(axis=1))[0])
    w = int(np.flatnonzero(assignment[e])[0])
    assignment[e, w] -= 1
    assignment[e, (w + 1) % SHAPE.num_workers] += 1
    slot = plan.slot.copy()
    slot[e, (w + 1) % SHAPE.num_workers] = SHAPE.num_experts // SHAPE.num_workers  # a redundant slot
    copies = np.vstack([plan.copies, np.array([[e, 0, 1, 4]], plan.copies.dtype)]) if len(plan.copies) \
        else np.array([[e, 0, 1, 4]], np.int32)
    for changed in (dataclasses.replace(plan, seq=seq + 1), dataclasses.replace(plan, assignment=assignment),
                    dataclasses.replace(plan, slot=slot), dataclasses.replace(plan, copies=copies)):
        assert plan_digest(changed) != plan_digest(plan)
    # the same values in a strided view digest as the contiguous array
    wide = np.zeros((SHAPE.num_experts, 2 * SHAPE.num_workers), plan.assignment.dtype)
    wide[:, ::2] = plan.assignment
    assert plan_digest(dataclasses.replace(plan, assignment=wide[:, ::2])) == plan_digest(plan)
