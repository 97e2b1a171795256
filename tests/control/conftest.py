import os
import uuid

import numpy as np
import pytest

from afore.config import ClusterShape
from afore.plan import Plan, Target, primary_only_plan


@pytest.fixture
def seg_name(request):
    """A fresh segment-name factory; every segment it named is gone after the test."""
    names = []

    def make(kind: str = "seg") -> str:
        name = f"afore-test-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        names.append(name)
        return name

    yield make
    for name in names:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass


@pytest.fixture
def make_plan():
    """``make_plan(shape, rng, target, seq)``: a valid plan with replicas and copies."""
    return random_plan


def random_plan(shape: ClusterShape, rng: np.random.Generator, target: Target, seq: int) -> Plan:
    """A valid plan with replicas and copies: primary-only, then part of some experts moved."""
    demand = rng.integers(0, 200, shape.num_experts)
    plan = primary_only_plan(shape, demand, target, seq)
    owner, pcount = shape.primary_owner, shape.primary_counts
    copies = []
    for w in range(shape.num_workers):
        for r in range(shape.redundant_slots):
            e = int(rng.integers(shape.num_experts))
            if owner[e] == w or plan.replicas[e, w]:
                continue
            move = int(plan.assignment[e, owner[e]] // shape.m_tile // 2) * shape.m_tile
            plan.replicas[e, w] = True
            plan.slot[e, w] = pcount[w] + r
            plan.assignment[e, w] += move
            plan.assignment[e, owner[e]] -= move
            copies.append((e, owner[e], w, pcount[w] + r))
    plan.tiles = (-(-plan.assignment // shape.m_tile)).astype(np.int32)
    plan.tile_load = plan.tiles.sum(axis=0).astype(np.int32)
    plan.copies = np.array(copies, np.int32).reshape(-1, 4)
    plan.primary_only = False
    plan.gain_ms = float(rng.random())
    return plan
