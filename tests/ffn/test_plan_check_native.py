"""afore._ffn's plan checks (csrc/ffn/plan_check.cpp) against their numpy reference.

An FFN worker checks every plan it reads twice: ``Migrator._check`` (consistent with its slot
tables) and ``device_plan.worker_table`` (its eq. 11 table). Plans read from the ring are int32
views and take the C++ path; the numpy code is the reference. Here both run on the same plans,
valid and broken in every way each check names, and must return the same verdict, the same
message and the same reads or table."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import afore.ffn.device_plan as device_plan
import afore.migrator.migrator as migrator_mod
from afore.config import ClusterShape
from afore.ffn.reference import random_plan, random_routing, random_slot_table
from afore.migrator.copy_engine import SyncCopyEngine
from afore.migrator.migrator import HostWeightsSource, Migrator
from afore.migrator.slot_pool import SlotPool
from afore.plan import Target

H, I = 8, 4
BREAKS = ("none", "row_sum", "work_without_slot", "primary_slot", "copy_range", "copy_source", "copy_slot",
          "unresident_read", "slot_beyond", "negative", "table_slot")


def _int32(plan):
    """``plan`` as the ring's reader hands it over: int32 C-contiguous arrays, int64 demand."""
    plan.assignment = np.ascontiguousarray(plan.assignment, np.int32)
    plan.slot = np.ascontiguousarray(plan.slot, np.int32)
    plan.copies = np.ascontiguousarray(plan.copies, np.int32).reshape(-1, 4)
    plan.demand = np.ascontiguousarray(plan.demand, np.int64)
    return plan


def _break(plan, how, shape, rng):
    e, f = shape.num_experts, shape.num_workers
    owner = shape.primary_owner
    x = int(rng.integers(0, e))
    w = int(rng.integers(0, f))
    if how == "row_sum":
        plan.assignment[x, w] += 1
    elif how == "work_without_slot":
        others = [v for v in range(f) if v != owner[x]]
        if others:
            v = int(rng.choice(others))
            plan.assignment[x, v] += 1
            plan.assignment[x, owner[x]] -= 1
            plan.slot[x, v] = -1
    elif how == "primary_slot":
        plan.slot[x, owner[x]] += 1
    elif how == "copy_range" and len(plan.copies):
        plan.copies[0, 2] = f
    elif how == "copy_source" and len(plan.copies):
        plan.copies[0, 1] = (plan.copies[0, 1] + 1) % f if f > 1 else -1
    elif how == "copy_slot" and len(plan.copies):
        plan.copies[0, 3] = 0
    elif how == "unresident_read":
        plan.copies = plan.copies[:0]
    elif how == "slot_beyond":
        others = [v for v in range(f) if v != owner[x]]
        if others:
            v = int(rng.choice(others))
            plan.slot[x, v] = int(shape.primary_counts[v]) + shape.redundant_slots + 1
            plan.assignment[x, v] += 1
            plan.assignment[x, owner[x]] -= 1
    elif how == "negative":
        plan.assignment[x, w] = -1
    elif how == "table_slot":
        plan.slot[x, w] = -5
    return plan


@settings(max_examples=150, deadline=None)
@given(e=st.integers(2, 24), f=st.integers(1, 5), r=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       how=st.sampled_from(BREAKS))
def test_native_checks_equal_the_numpy_ones(e, f, r, seed, how):
    if migrator_mod._native_check is None or device_plan._native_table is None:
        pytest.fail("afore._ffn is not built: reinstall afore (pip install -e .)")
    e = max(e, f)
    shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=r, top_k=2, m_tile=2)
    rng = np.random.default_rng(seed)
    table = random_slot_table(shape, rng, float(rng.uniform(0, 1)))
    ids, _ = random_routing(int(rng.integers(1, 40)), shape, rng, skew=1.0)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=e)
    plan, _ = random_plan(shape, demand, table, rng, Target(0, 0, 0), seq=1, new_copies=int(rng.integers(0, 4)))
    plan = _int32(_break(plan, how, shape, rng))
    for w in range(f):
        pool = SlotPool(shape, w, H, I, dtype=torch.float32)
        for j, ex in enumerate(table.expert[w]):
            pool.resident[pool.num_primaries + j] = ex
        weights = {0: (torch.zeros(e, 2 * I, H), torch.zeros(e, H, I))}
        mig = Migrator(shape, w, {0: pool}, SyncCopyEngine(), HostWeightsSource(weights))
        native = mig._check(plan, 1, Target(0, 0, 0))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(migrator_mod, "_native_check", None)
            ref = mig._check(plan, 1, Target(0, 0, 0))
        assert native[0] == ref[0]
        assert [tuple(map(int, t)) for t in native[1]] == [tuple(map(int, t)) for t in ref[1]]
        slots = pool.num_slots
        got = want = None
        try:
            got = device_plan.worker_table(plan, shape, w, slots)
        except ValueError as exc:
            got = str(exc)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(device_plan, "_native_table", None)
            try:
                want = device_plan.worker_table(plan, shape, w, slots)
            except ValueError as exc:
                want = str(exc)
        if isinstance(want, str):
            assert got == want
        else:
            assert isinstance(got, np.ndarray) and got.dtype == np.int32 and np.array_equal(got, want)
