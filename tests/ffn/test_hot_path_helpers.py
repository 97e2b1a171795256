"""The per-target helpers of the decode hot path give what their slower forms gave: host
counting of routed ids, the worker's plan table and reads, balance statistics, and the
demand emitter's int32 report."""

import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.device_plan import worker_table
from afore.ffn.reference import random_plan, random_routing, random_slot_table
from afore.metrics.balance import ImbalanceWindow, load_stats, tile_imbalance
from afore.plan import Target
from afore.routing import count_demand, count_host
from afore.scheduler.plan_codec import decode_worker_plan, encode_plan


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.uint8])
def test_count_host_counts_only_ids_in_range(dtype):
    rng = np.random.default_rng(1)
    ids = rng.integers(-3 if np.dtype(dtype).kind == "i" else 0, 12, (50, 3)).astype(dtype)
    flat = ids.reshape(-1).astype(np.int64)
    want = np.bincount(flat[(flat >= 0) & (flat < 9)], minlength=9)
    got = count_host(ids, 9)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert count_host(ids, 9, np.int32).dtype == np.int32
    assert count_demand(torch.from_numpy(ids.astype(np.int64)), 9).tolist() == want.tolist()


def test_count_host_rejects_non_integer_ids():
    with pytest.raises(ValueError, match="integer ids"):
        count_host(np.zeros(4, np.float32), 8)


def _worker_table_reference(plan, shape, worker, num_slots):
    """worker_table as first written (the specification of the table)."""
    a = np.asarray(plan.assignment).astype(np.int64)
    s = np.asarray(plan.slot)
    owner = shape.primary_owner
    rows = np.arange(shape.num_experts)
    non_primary = a.copy()
    non_primary[rows, owner] = 0
    hi_all = np.cumsum(non_primary, axis=1)
    lo = (hi_all - non_primary)[:, worker]
    hi = hi_all[:, worker].copy()
    mine = owner == worker
    lo[mine] = hi_all[mine, -1]
    hi[mine] = np.iinfo(np.int32).max
    slot = s[:, worker].astype(np.int64)
    works = hi > lo
    ep = 1 << max(4, (shape.num_experts - 1).bit_length())
    table = np.zeros(3 * ep + 1, np.int32)
    table[2 * ep: 3 * ep] = -1
    table[:shape.num_experts] = np.where(works, lo, 0)
    table[ep: ep + shape.num_experts] = np.where(works, hi, 0)
    table[2 * ep: 2 * ep + shape.num_experts] = np.where(works, slot, -1)
    return table


@pytest.mark.parametrize("seed", range(6))
def test_worker_table_matches_its_specification_on_decoded_and_fortran_plans(seed):
    rng = np.random.default_rng(seed)
    shape = ClusterShape(num_experts=13, num_workers=3, redundant_slots=2, top_k=3, m_tile=4,
                         primaries=tuple(int(w) for w in rng.permutation(np.arange(13) % 3)))
    ids, _ = random_routing(40, shape, rng, skew=1.5)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=13)
    plan, _ = random_plan(shape, demand, random_slot_table(shape, rng, 1.0), rng, Target(0, 0, 0), 1, new_copies=2)
    decoded = decode_worker_plan(encode_plan(plan), shape)
    for w in range(3):
        k = int(shape.primary_counts[w]) + 2
        want = _worker_table_reference(plan, shape, w, k)
        assert np.array_equal(worker_table(plan, shape, w, k), want)
        assert np.array_equal(worker_table(decoded, shape, w, k), want)
        plan.assignment = np.asfortranarray(plan.assignment)  # a column-major assignment: same table
        assert np.array_equal(worker_table(plan, shape, w, k), want)


def test_worker_table_rejects_a_negative_slot_for_work():
    shape = ClusterShape(num_experts=4, num_workers=2, redundant_slots=1, top_k=2, m_tile=2)
    from afore.plan import primary_only_plan

    plan = primary_only_plan(shape, np.array([2, 0, 0, 3]), Target(0, 0, 0), 0)
    plan.assignment[0] = [1, 1]  # expert 0 (primary on 0) also on worker 1, which has no slot for it
    with pytest.raises(ValueError, match="plan.slot: expert 0 runs on worker 1"):
        worker_table(plan, shape, 1, 3)


def test_load_stats_and_window_agree_with_the_numpy_forms():
    window, other = ImbalanceWindow(3), ImbalanceWindow(3)
    for load in ([3, 1, 0], [2, 2, 2], [0, 5, 1], [7, 0, 0]):
        arr = np.array(load, np.int32)
        mx, total, size = load_stats(arr)
        assert mx * size / total == tile_imbalance(arr)
        assert window.add("k", arr) == other.add_stats("k", mx, total, size)
