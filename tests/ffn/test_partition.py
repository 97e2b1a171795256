"""The token-aware partition (afore.ffn.partition.token_aware_ordinals): same intervals and
counts as eq. 11, pairs of replicated experts sent where their token already goes, same sum."""

import numpy as np
import torch
from hypothesis import given, settings, strategies as st

from afore.config import ClusterShape
from afore.ffn.experts import grouped_expert_mlp
from afore.ffn.partition import pair_workers, token_aware_ordinals, worker_mask, worker_pairs
from afore.ffn.reference import dense_moe, random_plan, random_routing, random_slot_table
from afore.migrator.slot_pool import SlotPool
from afore.plan import Target, primary_only_plan

H, I = 16, 8

shapes = st.builds(
    lambda e, f, r, k, m: ClusterShape(num_experts=max(e, f), num_workers=f, redundant_slots=r,
                                       top_k=min(k, max(e, f)), m_tile=m),
    st.integers(2, 16), st.integers(1, 5), st.integers(0, 3), st.integers(1, 4), st.integers(1, 6))


def counts_per_worker(ids: torch.Tensor, workers: torch.Tensor, e: int, f: int) -> np.ndarray:
    got = np.zeros((e, f), np.int64)
    np.add.at(got, (ids.reshape(-1).long().numpy(), workers.reshape(-1).numpy()), 1)
    return got


@settings(max_examples=80, deadline=None)
@given(shape=shapes, n=st.integers(0, 60), seed=st.integers(0, 2**31 - 1), fill=st.floats(0, 1))
def test_token_aware_partition_keeps_every_count_of_the_plan(shape, n, seed, fill):
    rng = np.random.default_rng(seed)
    e, f = shape.num_experts, shape.num_workers
    ids, _ = random_routing(n, shape, rng, skew=float(rng.uniform(0, 2)))
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=e)
    plan, _ = random_plan(shape, demand, random_slot_table(shape, rng, fill), rng, Target(0, 0, 0), 1,
                          new_copies=int(rng.integers(0, 4)))
    a, owner = torch.as_tensor(plan.assignment), torch.as_tensor(shape.primary_owner)
    chosen = [worker_pairs(ids, a, owner, w, token_aware=True) for w in range(f)]
    assert torch.equal(torch.cat(chosen).sort().values, torch.arange(ids.numel()))   # disjoint and covering
    assert np.array_equal(counts_per_worker(ids, pair_workers(ids, a, owner, token_aware=True), e, f), plan.assignment)
    ranks = token_aware_ordinals(ids, a, owner)
    flat = ids.reshape(-1).long()
    for x in np.unique(flat.numpy()):   # per expert a permutation of 0..n_e-1
        assert sorted(ranks[flat == int(x)].tolist()) == list(range(int(demand[x])))


def test_token_aware_partition_is_exact_when_the_routing_differs_from_the_plan():
    """A plan planned for other counts (or a stale demand): every pair still runs once, no
    non-primary worker runs more than its a[e, w], the primary takes the remainder."""
    rng = np.random.default_rng(5)
    shape = ClusterShape(num_experts=10, num_workers=3, redundant_slots=2, top_k=3, m_tile=2)
    ids, _ = random_routing(50, shape, rng)
    other, _ = random_routing(47, shape, rng)
    plan, _ = random_plan(shape, np.bincount(other.reshape(-1).numpy(), minlength=10), random_slot_table(shape, rng, 1.0),
                          rng, Target(0, 0, 0), 1, new_copies=3)
    a, owner = torch.as_tensor(plan.assignment), torch.as_tensor(shape.primary_owner)
    masks = torch.stack([worker_mask(ids, a, owner, w, token_aware=True) for w in range(3)])
    assert torch.equal(masks.sum(0), torch.ones(ids.numel(), dtype=torch.int64))
    got = counts_per_worker(ids, masks.to(torch.int8).argmax(0), 10, 3)
    non_primary = np.arange(3)[None, :] != shape.primary_owner[:, None]
    assert np.all(got[non_primary] <= plan.assignment[non_primary])


def test_a_replicated_expert_goes_to_the_worker_its_token_touches():
    # experts 0, 1 primary on worker 0, experts 2, 3 on worker 1; expert 0 also replicated on 1
    owner = torch.tensor([0, 0, 1, 1])
    ids = torch.tensor([[0, 2], [0, 1], [0, 3], [0, 1]])     # tokens 0 and 2 touch worker 1 anyway
    a = torch.tensor([[2, 2], [2, 0], [0, 1], [0, 1]])        # a[e, w]: expert 0 split 2 + 2
    eq11 = pair_workers(ids, a, owner)[:, 0].tolist()
    aware = pair_workers(ids, a, owner, token_aware=True)[:, 0].tolist()
    assert eq11 == [1, 1, 0, 0]                                # routing order: the first two ordinals to the replica
    assert aware == [1, 0, 1, 0]                               # each token's expert 0 where its other expert runs
    def fanout(w: torch.Tensor) -> int:   # k = 2: distinct workers per row, summed
        return int((w.max(1).values != w.min(1).values).sum()) + len(w)
    assert fanout(pair_workers(ids, a, owner, token_aware=True)) < fanout(pair_workers(ids, a, owner))


def test_primary_only_plan_is_the_same_partition():
    rng = np.random.default_rng(2)
    shape = ClusterShape(num_experts=12, num_workers=4, redundant_slots=1, top_k=3, m_tile=4)
    ids, _ = random_routing(40, shape, rng)
    plan = primary_only_plan(shape, np.bincount(ids.reshape(-1).numpy(), minlength=12), Target(0, 0, 0), 0)
    a, owner = torch.as_tensor(plan.assignment), torch.as_tensor(shape.primary_owner)
    assert torch.equal(pair_workers(ids, a, owner, token_aware=True), owner[ids.long()])


@settings(max_examples=40, deadline=None)
@given(shape=shapes, n=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_sum_over_workers_with_the_token_aware_partition_equals_dense_layer(shape, n, seed):
    """Invariant 1 under the token-aware partition: each worker computes its masked pairs on
    its slots (the FFN layer's reference path), the partials sum to the monolithic layer."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    e, k = shape.num_experts, shape.top_k
    w13 = torch.randn(e, 2 * I, H, generator=gen) / 4
    w2 = torch.randn(e, H, I, generator=gen) / 4
    hidden = torch.randn(n, H, generator=gen)
    ids, weights = random_routing(n, shape, rng, skew=float(rng.uniform(0, 2)))
    table = random_slot_table(shape, rng, 0.0)
    plan, table = random_plan(shape, np.bincount(ids.reshape(-1).numpy(), minlength=e), table, rng, Target(0, 0, 0), 1,
                              new_copies=int(rng.integers(0, 4)))
    a, owner = torch.as_tensor(plan.assignment), torch.as_tensor(shape.primary_owner)
    flat = ids.reshape(-1).long()
    out = torch.zeros(n, H)
    for w in range(shape.num_workers):
        pool = SlotPool(shape, w, H, I, dtype=w13.dtype)
        pool.load_primaries(w13, w2)
        for r, ex in enumerate(table.expert[w]):   # the slots the plan binds (its copies done)
            if ex >= 0:
                pool.w13[pool.num_primaries + r], pool.w2[pool.num_primaries + r] = w13[ex], w2[ex]
        slot = torch.from_numpy(plan.slot[:, w].astype(np.int64))
        mine = worker_mask(ids, a, owner, w, token_aware=True)
        assert torch.all(slot[flat[mine]] >= 0)    # only experts with a slot on w
        pair_slot = torch.where(mine, slot[flat], -1)
        out += grouped_expert_mlp(hidden, torch.arange(flat.numel()) // k, pair_slot, weights.reshape(-1).float(),
                                  pool.w13, pool.w2, backend="torch")
    ref = dense_moe(hidden, ids, weights, w13, w2)
    assert float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)) <= 1e-5
