"""References for the FFN side: the monolithic MoE layer and random valid plans.

``dense_moe`` is the layer that any plan must reproduce (invariant 1); ``random_plan``
draws plans that satisfy the plan contract (``afore.plan.check_plan``) with
arbitrary placements, splits and slot states, for property tests and benchmarks that do
not want to depend on one scheduler's choices.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from afore.config import ClusterShape
from afore.plan import Plan, SlotTable, Target


def dense_moe(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The monolithic routed-MoE output, computed expert by expert in ``dtype``.

    hidden [N, H]; topk_ids int [N, k]; topk_weights [N, k]; w13 [E, 2I, H]; w2 [E, H, I].
    Returns [N, H] in ``dtype``.
    """
    x = hidden.to(dtype)
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        rows, cols = torch.nonzero(topk_ids == e, as_tuple=True)
        gate_up = x[rows] @ w13[e].to(dtype).t()
        y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].to(dtype).t()
        out.index_add_(0, rows, y * topk_weights[rows, cols].to(dtype)[:, None])
    return out


def random_slot_table(shape: ClusterShape, rng: np.random.Generator, fill: float = 0.7) -> SlotTable:
    """A valid slot table: each redundant slot holds, with probability ``fill``, a random expert
    that is not primary on that worker and not bound twice there."""
    table = SlotTable.empty(shape)
    owner = shape.primary_owner
    for w in range(shape.num_workers):
        candidates = rng.permutation(np.nonzero(owner != w)[0])
        for r in range(min(shape.redundant_slots, len(candidates))):
            if rng.random() < fill:
                table.expert[w, r] = candidates[r]
    return table


def random_plan(shape: ClusterShape, demand: np.ndarray, table: SlotTable, rng: np.random.Generator,
                target: Target, seq: int, new_copies: int = 2) -> tuple[Plan, SlotTable]:
    """A random plan valid under ``check_plan(shape, plan, table)``.

    Binds up to ``new_copies`` random experts into random redundant slots (with copies), then
    splits every expert's demand over its replicas in whole tiles (at most one partial tile,
    left on the primary). Returns (plan, table after the plan).
    """
    demand = shape.check_demand(demand)
    e, f, m = shape.num_experts, shape.num_workers, shape.m_tile
    owner, pcount = shape.primary_owner, shape.primary_counts
    binding = table.expert.copy()
    copies = []
    if shape.redundant_slots and f > 1:
        for _ in range(new_copies):
            w = int(rng.integers(f))
            r = int(rng.integers(shape.redundant_slots))
            if any(c[2] == w and c[3] == pcount[w] + r for c in copies):
                continue
            choices = [x for x in np.nonzero(owner != w)[0] if x not in binding[w]]
            if not choices:
                continue
            ex = int(rng.choice(choices))
            binding[w, r] = ex
            copies.append((ex, int(owner[ex]), w, int(pcount[w]) + r))
    slot = np.full((e, f), -1, np.int32)
    slot[np.arange(e), owner] = shape.primary_slot
    for w, r in zip(*np.nonzero(binding >= 0)):
        slot[binding[w, r], w] = pcount[w] + r
    replicas = slot >= 0
    assignment = np.zeros((e, f), np.int64)
    for ex in range(e):
        full_tiles, rest = divmod(int(demand[ex]), m)
        holders = np.nonzero(replicas[ex])[0]
        split = rng.multinomial(full_tiles, rng.dirichlet(np.ones(len(holders)))) if full_tiles else np.zeros(len(holders), np.int64)
        assignment[ex, holders] = split * m
        assignment[ex, owner[ex]] += rest
    tiles = -(-assignment // m)
    plan = Plan(target, seq, demand.copy(), replicas, assignment.astype(np.int32), tiles.astype(np.int32), slot,
                np.array(copies, np.int32).reshape(-1, 4), tiles.sum(axis=0).astype(np.int32))
    return plan, SlotTable(binding.astype(np.int32), table.last_used.copy())


def random_routing(num_tokens: int, shape: ClusterShape, rng: np.random.Generator, skew: float = 1.0,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids int32 [N, k] distinct per row, topk_weights [N, k]) with Zipf-like skew."""
    e, k = shape.num_experts, shape.top_k
    popularity = 1.0 / np.arange(1, e + 1) ** skew
    popularity = rng.permutation(popularity / popularity.sum())
    ids = np.stack([rng.choice(e, size=k, replace=False, p=popularity) for _ in range(num_tokens)]) if num_tokens else np.zeros((0, k), np.int64)
    weights = rng.random((num_tokens, k))
    weights /= weights.sum(axis=1, keepdims=True)
    return torch.as_tensor(ids, dtype=torch.int32), torch.as_tensor(weights, dtype=dtype)
