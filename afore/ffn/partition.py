"""Exact partition of a target's token-expert pairs across FFN workers (paper eq. 11).

Every FFN worker sees the same gathered routing result ``topk_ids [N, k]`` and the same
plan. Flattening the ids row-major gives one global order of the N*k token-expert pairs;
the *ordinal* of a pair is the number of earlier pairs with the same expert. For expert e
with replicas on the non-primary workers w_1 < w_2 < ... (increasing worker index):

    o_0 = 0,  o_j = o_{j-1} + a[e, w_j]
    worker w_j executes ordinals [o_{j-1}, o_j); the primary owner executes [o_last, inf)

so the intervals are disjoint and cover every pair exactly once, whatever the routing
(the primary takes the remainder, which equals a[e, primary] when the plan's demand
matches the routing). This is the same order in which the scheduler fills tiles.

Everything here is vectorised torch (stable sort + cumsum); there is no Python loop over
tokens or experts, and it runs unchanged on CPU and GPU.
"""

from __future__ import annotations

import torch

from afore.routing import bin_counts


def pair_ordinals(flat_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Ordinal of each pair among the pairs of its expert, in flattened routing order.

    flat_ids: int[P] expert id of each pair (P = N*k, row-major over [N, k]).
    Returns int64[P]: for pair p, the count of pairs q < p with flat_ids[q] == flat_ids[p].
    """
    ids = flat_ids.long()
    order = torch.sort(ids, stable=True).indices
    counts = bin_counts(ids, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_sorted = torch.arange(ids.numel(), device=ids.device) - starts[ids[order]]
    ordinals = torch.empty_like(rank_in_sorted)
    ordinals[order] = rank_in_sorted
    return ordinals


def ordinal_intervals(assignment: torch.Tensor, primary_owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (expert, worker) ordinal interval [lo, hi) of eq. 11.

    assignment: int[E, F] a[e, w]; primary_owner: int64[E].
    Returns (lo, hi), int64[E, F]; empty intervals (lo == hi) where a worker has no work.
    The primary's hi is int64 max: it takes every remaining pair.
    """
    a = assignment.long()
    e, f = a.shape
    rows = torch.arange(e, device=a.device)
    non_primary = a.clone()
    non_primary[rows, primary_owner] = 0
    hi = torch.cumsum(non_primary, dim=1)
    lo = hi - non_primary
    remainder_start = hi[:, -1]
    lo[rows, primary_owner] = remainder_start
    hi[rows, primary_owner] = torch.iinfo(torch.int64).max
    return lo, hi


def worker_mask(topk_ids: torch.Tensor, assignment: torch.Tensor, primary_owner: torch.Tensor,
                worker: int) -> torch.Tensor:
    """bool[N*k]: which of the flattened pairs ``worker`` executes (no host sync).

    topk_ids: int[N, k]; assignment: int[E, F]; primary_owner: int64[E] (same device).
    """
    num_experts = assignment.shape[0]
    flat = topk_ids.reshape(-1).long()
    ordinals = pair_ordinals(flat, num_experts)
    lo, hi = ordinal_intervals(assignment, primary_owner)
    return (ordinals >= lo[flat, worker]) & (ordinals < hi[flat, worker])


def worker_pairs(topk_ids: torch.Tensor, assignment: torch.Tensor, primary_owner: torch.Tensor,
                 worker: int) -> torch.Tensor:
    """Indices (into the flattened [N*k] pairs) that ``worker`` executes, in routing order.

    Returns int64[P_w] (syncs with the host for the count; the hot path uses ``worker_mask``).
    """
    return torch.nonzero(worker_mask(topk_ids, assignment, primary_owner, worker)).squeeze(1)
