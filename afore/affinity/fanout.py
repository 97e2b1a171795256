"""Fan-out under sparse dispatch: how many FFN workers each token touches, and the bytes it moves.

With sparse (M2N) dispatch a token's hidden row travels only to the workers that execute one of
its token-expert pairs, and one partial sum per such worker travels back. Which worker executes
a pair: its expert's primary under primary-only execution, else the plan's exact partition
(``afore.ffn.partition``, paper eq. 11: ordinal intervals per expert over its replicas).

Bytes per token (the data-path payload; headers and padding excluded):
    fan_out * hidden_size * activation_bytes          A2F: the hidden row to each touched worker
  + top_k * (4 + 4)                                   A2F: an int32 expert id and an fp32 weight per pair
  + fan_out * hidden_size * activation_bytes          F2A: one partial sum back per touched worker
"""

from __future__ import annotations

import numpy as np
import torch

from afore.ffn.partition import ordinal_intervals, pair_ordinals
from afore.plan import Plan

PAIR_METADATA_BYTES = 8   # int32 id + fp32 weight


def distinct_per_row(workers: np.ndarray) -> np.ndarray:
    """int64[N]: distinct values per row of int[N, k]."""
    w = np.sort(np.asarray(workers), axis=1)
    if w.shape[1] == 0:
        return np.zeros(w.shape[0], np.int64)
    return 1 + np.count_nonzero(np.diff(w, axis=1) != 0, axis=1)


def primary_workers(topk_ids: np.ndarray, primary_owner: np.ndarray) -> np.ndarray:
    """int64[N, k]: the primary owner of each pair's expert."""
    return np.asarray(primary_owner, np.int64)[np.asarray(topk_ids, np.int64)]


def plan_workers(topk_ids: np.ndarray, plan: Plan, primary_owner: np.ndarray) -> np.ndarray:
    """int64[N, k]: the worker that executes each pair under ``plan`` (the FFN workers' partition).

    The plan's demand must be the routing's (``bincount(topk_ids) == plan.demand``)."""
    ids = torch.as_tensor(np.asarray(topk_ids, np.int64))
    n, k = ids.shape
    e, f = plan.assignment.shape
    flat = ids.reshape(-1)
    if not np.array_equal(np.bincount(flat.numpy(), minlength=e), plan.demand):
        raise ValueError("topk_ids: the routing's counts differ from plan.demand")
    ordinals = pair_ordinals(flat, e)
    lo, hi = ordinal_intervals(torch.as_tensor(plan.assignment), torch.as_tensor(np.asarray(primary_owner, np.int64)))
    o = ordinals[:, None]
    mask = (o >= lo[flat]) & (o < hi[flat])          # [P, F], exactly one True per pair
    return mask.to(torch.int8).argmax(dim=1).reshape(n, k).numpy().astype(np.int64)


def home_workers(topk_ids: np.ndarray, primary_owner: np.ndarray, num_workers: int) -> np.ndarray:
    """int64[N]: each token's home worker, the primary owner of most of its experts (ties: the
    owner of its highest-ranked expert among the tied, i.e. the earliest in the row)."""
    ids = np.asarray(topk_ids, np.int64)
    owners = np.asarray(primary_owner, np.int64)[ids]                  # [N, k]
    votes = np.zeros((ids.shape[0], num_workers), np.int64)
    np.add.at(votes, (np.arange(ids.shape[0])[:, None], owners), 1)
    best = votes.max(axis=1, keepdims=True)
    tied = votes[np.arange(ids.shape[0])[:, None], owners] == best     # [N, k]: this slot's owner is a top vote
    return owners[np.arange(ids.shape[0]), np.argmax(tied, axis=1)]


def locality_workers(topk_ids: np.ndarray, plan: Plan, primary_owner: np.ndarray) -> np.ndarray:
    """int64[N, k]: an exact partition of the pairs that keeps ``plan``'s counts a[e, w] but gives
    each pair to its token's home worker when that worker holds a replica of the expert and has
    room, the rest in the eq. 11 order (routing order, replicas by worker index, primary last).

    Deterministic from (topk_ids, plan, layout), so every FFN worker could compute it alike; not
    what the FFN workers do today (``afore.ffn.partition`` is eq. 11): ``afore bench affinity``
    uses it to measure what a locality-aware partition would keep of co-clustered primaries.
    """
    ids = np.asarray(topk_ids, np.int64)
    n, k = ids.shape
    e, f = plan.assignment.shape
    flat = ids.reshape(-1)
    if not np.array_equal(np.bincount(flat, minlength=e), plan.demand):
        raise ValueError("topk_ids: the routing's counts differ from plan.demand")
    owner = np.asarray(primary_owner, np.int64)
    home = np.repeat(home_workers(ids, owner, f), k)
    left = plan.assignment.astype(np.int64).copy()
    out = np.full(flat.size, -1, np.int64)
    for x in np.unique(flat):
        pairs = np.flatnonzero(flat == x)                 # routing order
        pref = home[pairs]
        for w in np.flatnonzero(left[x] > 0):             # home pass: each replica worker takes its own tokens first
            mine = pairs[(pref == w) & (out[pairs] < 0)][: left[x, w]]
            out[mine] = w
            left[x, w] -= mine.size
        rest = pairs[out[pairs] < 0]
        order = [w for w in range(f) if w != owner[x]] + [int(owner[x])]
        start = 0
        for w in order:                                   # remainder in eq. 11 order
            take = rest[start:start + left[x, w]] if w != owner[x] else rest[start:]
            out[take] = w
            start += take.size
    return out.reshape(n, k)


def bytes_per_token(fan_out: np.ndarray | float, hidden_size: int, top_k: int, activation_bytes: int = 2) -> np.ndarray | float:
    """Data-path bytes per token (see the module docstring) for fan-out values."""
    return 2 * np.asarray(fan_out) * hidden_size * activation_bytes + top_k * PAIR_METADATA_BYTES
