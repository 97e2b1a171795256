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

Token-aware variant (``token_aware_ordinals``): the same intervals and so the same per-replica
counts a[e, w], but the pairs of an expert that runs on several workers are *ranked* so that a
pair lands, where the counts allow, in the interval of a worker that its token touches anyway
(through an expert that runs on one worker only). That keeps a token's pairs together under
sparse dispatch (fewer FFN workers per token) without changing any worker's load, any slot
read or the layer's sum. Every worker computes the same ranks from the same gathered routing.

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


def token_aware_ordinals(topk_ids: torch.Tensor, assignment: torch.Tensor, primary_owner: torch.Tensor) -> torch.Tensor:
    """Ranks of the pairs within their expert, to use with ``ordinal_intervals`` in place of
    ``pair_ordinals``: the same intervals, so worker w still runs min(a[e, w], what is left)
    pairs of e, but each pair of a multi-worker expert goes to its token's preferred worker
    when that worker's count allows.

    topk_ids: int[N, k]; assignment: int[E, F] a[e, w]; primary_owner: int64[E] (same device).
    Returns int64[P] (P = N*k, row-major): per expert a permutation of 0..n_e-1 when the
    routing's counts n_e match sum_w a[e, w]; in any case distinct within an expert, so the
    intervals stay disjoint and covering (the primary takes the remainder, as in eq. 11).

    A worker *runs* e if a[e, w] > 0 (the primary also when e has no planned work). A pair of
    an expert run by one worker is fixed there; it makes its token *touch* that worker. For a
    pair of an expert run by several workers the preferred worker is, among those that run e,
    the one where its token has the most fixed pairs, then the most pairs that could go there,
    then the lowest index. Pass 1: the first a[e, w] pairs (routing order) preferring w get
    ranks at the start of w's interval. Pass 2: the remaining pairs of e fill the rest of the
    intervals in routing order, in eq. 11 order (non-primary workers by index, primary last).
    No host sync: fixed-shape sorts, scatters and cumsums only.
    """
    ids = topk_ids.long()
    n, k = ids.shape
    a = assignment.long()
    e, f = a.shape
    owner = primary_owner.long()
    flat = ids.reshape(-1)
    rows = torch.arange(e, device=a.device)
    runs = a > 0
    runs[rows, owner] |= a.sum(dim=1) == 0
    fixed = runs.sum(dim=1) == 1                                     # [E]
    pair_runs = runs[flat]                                           # [P, F]
    pair_fixed = fixed[flat][:, None]
    touched = (pair_runs & pair_fixed).view(n, k, f).sum(dim=1)      # [N, F] fixed pairs per worker
    could = (pair_runs & ~pair_fixed).view(n, k, f).sum(dim=1)       # [N, F] flexible pairs that could go there
    token_score = touched * (k + 1) + could
    score = torch.where(pair_runs, token_score.repeat_interleave(k, dim=0), -1)
    preferred = score.argmax(dim=1)                                  # first maximum: lowest worker index

    lo, _ = ordinal_intervals(a, owner)
    key = flat * f + preferred
    rank = pair_ordinals(key, e * f)                                 # rank among the pairs of (e, preferred)
    first = rank < a.reshape(-1)[key]
    first_ordinal = lo.reshape(-1)[key] + rank

    used = torch.minimum(bin_counts(key, e * f).view(e, f), a)       # [E, F] interval heads taken in pass 1
    free = a - used
    free[rows, owner] = torch.iinfo(torch.int64).max // 4            # the primary takes any remainder
    order = torch.argsort(torch.arange(f, device=a.device)[None, :] + f * (torch.arange(f, device=a.device)[None, :] == owner[:, None]), dim=1)
    free_in_order = free.gather(1, order)                            # [E, F] eq. 11 order
    ends = torch.cumsum(free_in_order, dim=1)
    rest = pair_ordinals(torch.where(first, e, flat), e + 1)         # rank among e's pass-2 pairs
    segment = (rest[:, None] >= ends[flat]).sum(dim=1).clamp(max=f - 1)
    before = ends[flat, segment] - free_in_order[flat, segment]
    w = order[flat, segment]
    rest_ordinal = lo[flat, w] + used[flat, w] + (rest - before)
    return torch.where(first, first_ordinal, rest_ordinal)


def worker_mask(topk_ids: torch.Tensor, assignment: torch.Tensor, primary_owner: torch.Tensor,
                worker: int, token_aware: bool = False) -> torch.Tensor:
    """bool[N*k]: which of the flattened pairs ``worker`` executes (no host sync).

    topk_ids: int[N, k]; assignment: int[E, F]; primary_owner: int64[E] (same device).
    token_aware: rank the pairs with ``token_aware_ordinals`` instead of routing order (every
    worker of the pool must use the same choice for one target).
    Ids outside [0, E) run nowhere and, in routing order, rank in a bin of their own: the rule of
    the expert step (``afore.ffn.experts``), so the mask names exactly the pairs the step runs.
    """
    num_experts = assignment.shape[0]
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    if token_aware:
        ordinals = token_aware_ordinals(topk_ids.clamp(0, num_experts - 1), assignment, primary_owner)
    else:
        ordinals = pair_ordinals(torch.where(valid, flat, num_experts), num_experts + 1)
    lo, hi = ordinal_intervals(assignment, primary_owner)
    ex = torch.where(valid, flat, 0)
    return valid & (ordinals >= lo[ex, worker]) & (ordinals < hi[ex, worker])


def pair_workers(topk_ids: torch.Tensor, assignment: torch.Tensor, primary_owner: torch.Tensor,
                 token_aware: bool = False) -> torch.Tensor:
    """int64[N, k]: the worker that executes each pair (the masks of all F workers at once)."""
    n, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    ordinals = (token_aware_ordinals(topk_ids, assignment, primary_owner) if token_aware
                else pair_ordinals(flat, assignment.shape[0]))
    lo, hi = ordinal_intervals(assignment, primary_owner)
    o = ordinals[:, None]
    mask = (o >= lo[flat]) & (o < hi[flat])                          # [P, F], exactly one True per pair
    return mask.to(torch.int8).argmax(dim=1).view(n, k)


def worker_pairs(topk_ids: torch.Tensor, assignment: torch.Tensor, primary_owner: torch.Tensor,
                 worker: int, token_aware: bool = False) -> torch.Tensor:
    """Indices (into the flattened [N*k] pairs) that ``worker`` executes, in routing order.

    Returns int64[P_w] (syncs with the host for the count; the hot path uses ``worker_mask``).
    """
    return torch.nonzero(worker_mask(topk_ids, assignment, primary_owner, worker, token_aware)).squeeze(1)
