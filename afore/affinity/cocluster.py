"""Co-clustered primaries: F expert sets that keep co-activated experts together (Sem-MoE's model
placement), with the expected load of each set balanced.

``co_cluster(coactivation, load, F)`` returns a primary layout int64[E] (the owner worker of each
expert) for ``ClusterShape.primaries``. Set sizes are the contiguous layout's (the first E % F
workers own one more), so every worker keeps K_w = P_w + R slots, the same memory as before.

Objective: maximise the in-set co-activation sum_{i<j, owner[i] = owner[j]} C[i, j] (C = tokens
that activate both i and j; the diagonal is ignored) subject to every set's expected load
sum_{e in set} load[e] <= (1 + load_slack) * sum(load) / F. This is Sem-MoE's objective with its
load-imbalance term as a hard cap instead of a weight theta. Sem-MoE solves its 0-1 program by
alternating optimisation; here: a greedy start (heaviest experts seed distinct sets, then the
expert-set pair with the largest affinity to the set's members is placed next, within the cap),
a repair of sets the greedy start left over the cap, then best-improvement pairwise swaps
between sets (which keep sizes) until no swap gains.
O(E^2 F) for the start, O(E^2) per swap. The cap applies to expected load only; afore's online
replicas absorb the per-microbatch deviations.
"""

from __future__ import annotations

import numpy as np

from afore.config import ClusterShape


def co_cluster(coactivation: np.ndarray, load: np.ndarray, num_workers: int, load_slack: float = 0.1,
               max_swaps: int | None = None) -> np.ndarray:
    """Primary layout int64[E] (owner worker per expert).

    coactivation: float[E, E] symmetric co-activation counts (tokens routing to both experts).
    load: float[E] expected token-expert pairs per expert (any unit; only ratios matter).
    num_workers: F sets. load_slack: a set's expected load may exceed the mean by this fraction
    (when the greedy start cannot meet the cap, the swaps never make the largest load worse).
    """
    c = np.array(coactivation, np.float64)
    l = np.asarray(load, np.float64)
    e = l.size
    if c.shape != (e, e):
        raise ValueError(f"coactivation: expected shape ({e}, {e}) to match load, got {c.shape}")
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(l))) or np.any(c < 0) or np.any(l < 0):
        raise ValueError("coactivation, load: expected finite non-negative values")
    if not 1 <= num_workers <= e:
        raise ValueError(f"num_workers: expected in [1, {e}] (num_experts), got {num_workers}")
    if not load_slack >= 0:
        raise ValueError(f"load_slack: expected >= 0, got {load_slack}")
    c = (c + c.T) / 2
    np.fill_diagonal(c, 0.0)
    f = num_workers
    size = ClusterShape(num_experts=e, num_workers=f, top_k=1).primary_counts
    cap = (1 + load_slack) * l.sum() / f

    owner = np.full(e, -1, np.int64)
    members = np.zeros(f, np.int64)
    set_load = np.zeros(f)
    affinity = np.zeros((e, f))          # affinity[x, s] = sum of C[x, members of s]
    order = np.argsort(-l, kind="stable")

    def place(x: int, s: int) -> None:
        owner[x] = s
        members[s] += 1
        set_load[s] += l[x]
        affinity[:, s] += c[:, x]

    for s, x in enumerate(order[:f]):
        place(int(x), s)
    for _ in range(e - f):
        free = owner < 0
        room = members < size
        fits = room[None, :] & (set_load[None, :] + l[:, None] <= cap) & free[:, None]
        if fits.any():
            score = np.where(fits, affinity, -np.inf)
            x, s = np.unravel_index(int(np.argmax(score)), score.shape)
        else:  # nothing fits under the cap: heaviest free expert onto the lightest open set
            x = int(order[free[order]][0])
            s = int(np.flatnonzero(room)[np.argmin(set_load[room])])
        place(int(x), int(s))

    swaps = max_swaps if max_swaps is not None else 20 * e
    tol = 1e-12 * max(float(c.sum()), 1.0)
    idx = np.arange(e)

    def swap_gains() -> tuple[np.ndarray, np.ndarray]:
        own = affinity[idx, owner]                      # [E] affinity to own set
        cross = affinity[:, owner]                      # [i, j]: affinity of i to j's set
        gain = (cross - own[:, None]) + (cross.T - own[None, :]) - 2 * c
        new_i = set_load[owner][:, None] - l[:, None] + l[None, :]   # i's set after swapping i<->j
        return gain, new_i

    def swap(i: int, j: int) -> None:
        a, b = int(owner[i]), int(owner[j])
        affinity[:, a] += c[:, j] - c[:, i]
        affinity[:, b] += c[:, i] - c[:, j]
        set_load[a] += l[j] - l[i]
        set_load[b] += l[i] - l[j]
        owner[i], owner[j] = b, a

    # Repair: while the heaviest set is over the cap, swap one of its experts for a lighter one
    # (the best affinity gain among swaps that keep the other set under the cap, else the swap
    # that lowers the larger of the two loads most).
    for _ in range(swaps):
        heavy = int(np.argmax(set_load))
        if set_load[heavy] <= cap * (1 + 1e-12):
            break
        gain, new_i = swap_gains()
        lowers = (owner[:, None] == heavy) & (owner[None, :] != heavy) & (l[:, None] > l[None, :])
        under = lowers & (new_i.T <= cap)
        if under.any():
            i, j = np.unravel_index(int(np.argmax(np.where(under, gain, -np.inf))), gain.shape)
        else:
            worst = np.maximum(new_i, new_i.T)
            worst = np.where(lowers & (worst < set_load[heavy]), worst, np.inf)
            if not np.isfinite(worst).any():
                break
            i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        swap(int(i), int(j))

    # Improve: best-improvement swaps that keep every set under the cap (or under the largest
    # load the repair could reach).
    limit = max(cap, float(set_load.max()))
    for _ in range(swaps):
        gain, new_i = swap_gains()
        ok = (owner[:, None] != owner[None, :]) & (new_i <= limit) & (new_i.T <= limit)
        gain = np.where(ok, gain, -np.inf)
        i, j = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not gain[i, j] > tol:
            break
        swap(int(i), int(j))
    return owner


def in_set_share(coactivation: np.ndarray, owner: np.ndarray) -> float:
    """Share of the off-diagonal co-activation that falls inside one set (0..1)."""
    c = np.array(coactivation, np.float64)
    np.fill_diagonal(c, 0.0)
    total = c.sum()
    if total <= 0:
        return 0.0
    same = np.asarray(owner)[:, None] == np.asarray(owner)[None, :]
    return float(c[same].sum() / total)


def set_load_ratio(load: np.ndarray, owner: np.ndarray, num_workers: int) -> float:
    """max / mean expected load over the F sets (1 = perfectly balanced)."""
    per_set = np.bincount(np.asarray(owner), weights=np.asarray(load, np.float64), minlength=num_workers)
    return float(per_set.max() / per_set.mean()) if per_set.mean() > 0 else 1.0
