"""The device plan table: this worker's eq. 11 intervals and slots, validated when staged."""

import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.device_plan import INT32_MAX, DevicePlan, table_width, worker_table
from afore.ffn.partition import ordinal_intervals
from afore.ffn.reference import random_plan, random_routing, random_slot_table
from afore.plan import Target, primary_only_plan

SHAPE = ClusterShape(num_experts=12, num_workers=3, redundant_slots=2, top_k=3, m_tile=4)


def _plan(seed, copies=2):
    rng = np.random.default_rng(seed)
    ids, _ = random_routing(50, SHAPE, rng, skew=1.5)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=12)
    plan, _ = random_plan(SHAPE, demand, random_slot_table(SHAPE, rng, 1.0), rng, Target(0, 0, 0), seed, new_copies=copies)
    return plan


@pytest.mark.parametrize("seed", range(5))
def test_table_holds_this_workers_intervals_and_slots(seed):
    plan = _plan(seed)
    lo, hi = ordinal_intervals(torch.as_tensor(plan.assignment), torch.as_tensor(SHAPE.primary_owner))
    ep = table_width(12)
    for w in range(3):
        t = worker_table(plan, SHAPE, w, int(SHAPE.primary_counts[w]) + 2)
        works = hi[:, w] > lo[:, w]
        assert np.array_equal(t[:12][works.numpy()], lo[works, w].numpy())
        want_hi = np.minimum(hi[works, w].numpy(), INT32_MAX)
        assert np.array_equal(t[ep:ep + 12][works.numpy()], want_hi)
        assert np.array_equal(t[2 * ep:2 * ep + 12], np.where(works.numpy(), plan.slot[:, w], -1))
        assert np.all(t[12:ep] == 0) and np.all(t[2 * ep + 12:3 * ep] == -1)  # the invalid-id bins run nowhere


def test_primary_only_table_sends_everything_to_the_primaries():
    plan = primary_only_plan(SHAPE, np.full(12, 5), Target(0, 0, 0), 0)
    ep = table_width(12)
    for w in range(3):
        t = worker_table(plan, SHAPE, w, int(SHAPE.primary_counts[w]) + 2)
        mine = SHAPE.primary_owner == w
        assert np.all(t[ep:ep + 12][mine] == INT32_MAX) and np.all(t[:12][mine] == 0)
        assert np.all(t[2 * ep:2 * ep + 12][~mine] == -1)


def test_bad_plans_are_rejected_naming_the_field():
    plan = _plan(1)
    k0 = int(SHAPE.primary_counts[0]) + 2
    bad = _plan(1)
    bad.assignment = bad.assignment[:, :2]
    with pytest.raises(ValueError, match="plan.assignment"):
        worker_table(bad, SHAPE, 0, k0)
    bad = _plan(1)
    bad.assignment[0, 0] = -1
    with pytest.raises(ValueError, match="plan.assignment"):
        worker_table(bad, SHAPE, 0, k0)
    bad = _plan(1)
    e = int(np.nonzero(SHAPE.primary_owner == 0)[0][0])
    bad.slot[e, 0] = k0  # a primary out of the pool
    with pytest.raises(ValueError, match="plan.slot"):
        worker_table(bad, SHAPE, 0, k0)
    bad = _plan(1)
    e = int(np.nonzero(SHAPE.primary_owner != 0)[0][0])
    bad.assignment[e, 0] += 1
    bad.slot[e, 0] = -1  # work without a slot
    with pytest.raises(ValueError, match="plan.slot"):
        worker_table(bad, SHAPE, 0, k0)
    assert worker_table(plan, SHAPE, 0, k0) is not None


def test_staging_is_cached_per_plan_and_upload_writes_the_pair_count():
    dp = DevicePlan(SHAPE, 1, int(SHAPE.primary_counts[1]) + 2, "cpu", ring=3)
    plan = _plan(2)
    t1 = dp.stage(plan)
    assert dp.stage(plan) is t1
    other = _plan(2, copies=0)  # same seq, another plan object: staged anew
    assert dp.stage(other) is not t1
    for n in range(7):  # more uploads than ring entries
        table = dp.upload(t1, n)
        assert int(table[dp.n_offset]) == n and np.array_equal(table[:dp.n_offset].numpy(), t1[:dp.n_offset])
    assert dp.uploads == 7
