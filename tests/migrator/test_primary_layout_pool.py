"""FFN workers under an explicit primary layout: each worker's pool holds exactly the experts the
layout gives it, and the partitioned layer output equals the monolithic MoE layer (invariant 1)."""

import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.layer import FFNLayer
from afore.ffn.reference import dense_moe, random_plan, random_routing, random_slot_table
from afore.migrator.slot_pool import SlotPool
from afore.plan import Target, check_plan

from tests.ffn.test_ffn_layer import H, I, apply_copies, make_pools, relative_error


def test_pool_loads_the_layouts_primaries():
    shape = ClusterShape(num_experts=6, num_workers=2, redundant_slots=1, top_k=2, primaries=(1, 0, 1, 1, 0, 0))
    w13 = torch.arange(6, dtype=torch.float32)[:, None, None].expand(6, 2 * I, H).contiguous()
    w2 = torch.arange(6, dtype=torch.float32)[:, None, None].expand(6, H, I).contiguous()
    pool = SlotPool(shape, 1, H, I, dtype=torch.float32)
    pool.load_primaries(w13, w2)
    assert pool.primary_experts() == [0, 2, 3]
    assert pool.resident[:3].tolist() == [0, 2, 3]
    assert pool.w13[:3, 0, 0].tolist() == [0.0, 2.0, 3.0]
    assert [pool.primary_slot_of(e) for e in (0, 2, 3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="expert: expected a primary of worker 1"):
        pool.primary_slot_of(1)
    pool.load_primaries(w13[[0, 2, 3]], w2[[0, 2, 3]])   # this worker's rows only, slot order
    assert pool.w2[:3, 0, 0].tolist() == [0.0, 2.0, 3.0]


@pytest.mark.parametrize("seed", range(8))
def test_layer_output_under_a_random_layout_equals_dense(seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    e, f = int(rng.integers(4, 17)), int(rng.integers(2, 5))
    owner = rng.integers(0, f, e)
    owner[rng.permutation(e)[:f]] = np.arange(f)
    shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=2, top_k=min(4, e), m_tile=2,
                         primaries=tuple(int(w) for w in owner))
    w13 = torch.randn(e, 2 * I, H, generator=gen) / 4
    w2 = torch.randn(e, H, I, generator=gen) / 4
    hidden = torch.randn(40, H, generator=gen)
    ids, weights = random_routing(40, shape, rng, skew=1.0)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=e)
    table = random_slot_table(shape, rng, 0.6)
    plan, _ = random_plan(shape, demand, table, rng, Target(0, 0, 0), seq=1, new_copies=2)
    check_plan(shape, plan, table)
    pools = make_pools(shape, table, w13, w2)
    for w, pool in enumerate(pools):
        assert pool.primary_experts() == np.flatnonzero(owner == w).tolist()
    apply_copies(pools, plan, w13, w2)
    out = torch.stack([FFNLayer(p, backend="torch").forward(hidden, ids, weights, plan, w) for w, p in enumerate(pools)]).sum(0)
    assert relative_error(out, dense_moe(hidden, ids, weights, w13, w2)) <= 1e-5
