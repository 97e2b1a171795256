"""A plan as the FFN worker gets it (decoded from the ring's bytes) runs through the FFN layer
without torch's 'The given NumPy array is not writable' warning, and gives the dense output."""

import warnings

import numpy as np
import torch

from afore.config import ClusterShape
from afore.ffn.layer import FFNLayer
from afore.ffn.reference import dense_moe, random_routing
from afore.migrator.slot_pool import SlotPool
from afore.plan import Target, primary_only_plan
from afore.scheduler.plan_codec import decode_plan, encode_plan

H, I = 16, 8


def test_decoded_plan_is_writable_and_runs_without_warnings():
    shape = ClusterShape(num_experts=8, num_workers=2, redundant_slots=1, top_k=2, m_tile=4)
    rng = np.random.default_rng(5)
    gen = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(8, 2 * I, H, generator=gen) / 4, torch.randn(8, H, I, generator=gen) / 4
    hidden = torch.randn(10, H, generator=gen)
    ids, weights = random_routing(10, shape, rng, skew=1.0)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=8)
    plan = decode_plan(encode_plan(primary_only_plan(shape, demand, Target(0, 0, 0), 1)), shape)
    assert plan.assignment.flags.writeable and plan.slot.flags.writeable and plan.copies.flags.writeable
    pools = []
    for w in range(2):
        pool = SlotPool(shape, w, H, I, dtype=torch.float32)
        pool.load_primaries(w13, w2)
        pools.append(pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sum(FFNLayer(pool, backend="torch").forward(hidden, ids, weights, plan, w) for w, pool in enumerate(pools))
    ref = dense_moe(hidden, ids, weights, w13, w2)
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-5
