"""Fan-out under sparse dispatch: how many FFN workers each token touches, and the bytes it moves.

With sparse (M2N) dispatch a token's hidden row travels only to the workers that execute one of
its token-expert pairs, and one partial sum per such worker travels back. Which worker executes
a pair: its expert's primary under primary-only execution, else the plan's exact partition
(``afore.ffn.partition``: paper eq. 11, ordinal intervals per expert over its replicas, or its
token-aware ranking, same intervals and counts, a replicated expert's pairs sent where their
token already goes).

Bytes per token (the data-path payload; headers and padding excluded):
    fan_out * hidden_size * activation_bytes          A2F: the hidden row to each touched worker
  + top_k * (4 + 4)                                   A2F: an int32 expert id and an fp32 weight per pair
  + fan_out * hidden_size * activation_bytes          F2A: one partial sum back per touched worker
"""

from __future__ import annotations

import numpy as np
import torch

from afore.ffn.partition import pair_workers
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


def plan_workers(topk_ids: np.ndarray, plan: Plan, primary_owner: np.ndarray, token_aware: bool = False) -> np.ndarray:
    """int64[N, k]: the worker that executes each pair under ``plan`` (the FFN workers' partition:
    eq. 11, or with ``token_aware`` the token-aware ranking of ``afore.ffn.partition``, which
    keeps the plan's counts a[e, w] and prefers for a replicated expert a worker its token touches).

    The plan's demand must be the routing's (``bincount(topk_ids) == plan.demand``)."""
    ids = torch.from_numpy(np.array(topk_ids, np.int64))
    e = plan.assignment.shape[0]
    if not np.array_equal(np.bincount(ids.reshape(-1).numpy(), minlength=e), plan.demand):
        raise ValueError("topk_ids: the routing's counts differ from plan.demand")
    owner = torch.from_numpy(np.array(primary_owner, np.int64))      # copies: plans and shapes hold read-only arrays
    return pair_workers(ids, torch.from_numpy(np.array(plan.assignment, np.int64)), owner, token_aware).numpy().astype(np.int64)


def bytes_per_token(fan_out: np.ndarray | float, hidden_size: int, top_k: int, activation_bytes: int = 2) -> np.ndarray | float:
    """Data-path bytes per token (see the module docstring) for fan-out values."""
    return 2 * np.asarray(fan_out) * hidden_size * activation_bytes + top_k * PAIR_METADATA_BYTES


def fanout_lower_bound(weight: np.ndarray, expert_prob: np.ndarray, top_k: int, set_sizes: np.ndarray) -> float:
    """A lower bound on the mean fan-out of tokens drawn from a class mixture (``TokenModel``:
    class c with probability weight[c], top-k distinct experts by Plackett-Luce draws from
    expert_prob[c]) under *any* primary layout with these set sizes, balanced or not.

    Why it is a bound: (1) drawing k distinct experts is drawing i.i.d. until k distinct came
    up, so a token touches at least the workers of its first k i.i.d. draws; (2) for those,
    E[workers | c] = sum_s 1 - (1 - p_c(S_s))^k, a sum of a concave function of the sets'
    masses, which (Schur-concavity) is smallest when the sets hold c's experts in descending
    probability, largest set first; (3) one layout for all classes does no better than each
    class's own best. weight: float[C]; expert_prob: float[C, E]; set_sizes: int[F].
    """
    w = np.asarray(weight, np.float64)
    p = np.asarray(expert_prob, np.float64)
    sizes = np.sort(np.asarray(set_sizes, np.int64))[::-1]
    if p.ndim != 2 or w.shape != (p.shape[0],) or sizes.sum() != p.shape[1] or np.any(sizes < 0):
        raise ValueError(f"expert_prob, weight, set_sizes: expected float[C, E], float[C] and sizes summing to E, "
                         f"got {p.shape}, {w.shape}, sum {int(sizes.sum())}")
    p = p / np.maximum(p.sum(axis=1, keepdims=True), 1e-300)
    ordered = -np.sort(-p, axis=1)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    mass = np.stack([ordered[:, a:b].sum(axis=1) for a, b in zip(bounds[:-1], bounds[1:])], axis=1)   # [C, F]
    per_class = (1 - (1 - np.clip(mass, 0, 1)) ** top_k).sum(axis=1)
    return float(w @ per_class / w.sum())
