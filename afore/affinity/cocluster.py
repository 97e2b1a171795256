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


def mean_fanout(topk_ids: np.ndarray, owner: np.ndarray) -> float:
    """Mean distinct owners per token: the fan-out of ``topk_ids`` int[N, k] under primaries only."""
    w = np.sort(np.asarray(owner, np.int64)[np.asarray(topk_ids, np.int64)], axis=1)
    return float(np.mean(1 + np.count_nonzero(np.diff(w, axis=1), axis=1))) if w.size else 0.0


def fanout_cluster(topk_ids: np.ndarray, num_experts: int, num_workers: int, load: np.ndarray | None = None,
                   load_slack: float = 0.1, restarts: int = 4, seed: int = 0, start: np.ndarray | None = None) -> np.ndarray:
    """Primary layout int64[E] that minimises the mean number of distinct owners per token.

    The objective is fan-out itself, on per-token expert sets (recorded routing or a token
    model's samples), not pairwise co-activation: a token whose 8 experts split 4 + 4 over two
    sets costs 2 workers, 8 singletons cost 8, while the pairwise score rates 4 + 4 (12 in-set
    pairs) below 7 + 1 (21) although both cost 2. It is hypergraph partitioning with the
    connectivity metric (tokens = hyperedges, experts = vertices) into F blocks of the
    contiguous layout's sizes, under the same expected-load cap as ``co_cluster``.

    topk_ids: int[N, k] each token's experts. load: float[E] expected pairs per expert
    (default: the pairs in ``topk_ids``). Search: steepest-descent swaps with the exact change
    of the sum of fan-outs, from the better of the contiguous and the ``co_cluster`` layout
    (or ``start``), then ``restarts`` descents from random layouts and from perturbations of
    the best (``seed``); the best layout wins. A layout over the cap is repaired first (swaps
    that lower its heaviest set, as in ``co_cluster``); after that no swap takes a set's load
    over the cap (or over the largest load the repair could reach). Swaps keep set sizes.
    """
    ids = np.asarray(topk_ids, np.int64)
    e, f = int(num_experts), int(num_workers)
    if ids.ndim != 2 or ids.shape[0] < 1:
        raise ValueError(f"topk_ids: expected int[N, k] with N >= 1, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= e:
        raise ValueError(f"topk_ids: expected expert ids in [0, {e}), got {int(ids.min())}..{int(ids.max())}")
    if not 1 <= f <= e:
        raise ValueError(f"num_workers: expected in [1, {e}] (num_experts), got {f}")
    if not load_slack >= 0:
        raise ValueError(f"load_slack: expected >= 0, got {load_slack}")
    if restarts < 0:
        raise ValueError(f"restarts: expected >= 0, got {restarts}")
    x = np.zeros((ids.shape[0], e), np.float32)
    np.put_along_axis(x, ids, 1.0, axis=1)
    l = x.sum(axis=0).astype(np.float64) if load is None else np.asarray(load, np.float64)
    if l.shape != (e,) or not np.all(np.isfinite(l)) or np.any(l < 0):
        raise ValueError(f"load: expected finite non-negative float[{e}]")
    contiguous = ClusterShape(num_experts=e, num_workers=f, top_k=1).primary_owner
    cap = (1 + load_slack) * l.sum() / f
    if start is not None:
        starts = [np.asarray(start, np.int64)]
        if starts[0].shape != (e,) or sorted(np.bincount(starts[0], minlength=f)) != sorted(np.bincount(contiguous, minlength=f)):
            raise ValueError("start: expected a layout int[E] with the contiguous layout's set sizes")
    else:
        co = x.T.astype(np.float64) @ x
        starts = [contiguous, co_cluster(co, l, f, load_slack)]
    rng = np.random.default_rng(seed)
    best_owner, best_cost = None, np.inf
    for owner in starts:
        owner, cost = _descend(x, owner, l, f, cap)
        if cost < best_cost:
            best_owner, best_cost = owner, cost
    for r in range(restarts):
        if r % 2 == 0:
            candidate = rng.permutation(contiguous)
        else:   # perturb the best: a few random swaps
            candidate = best_owner.copy()
            for _ in range(max(2, e // 10)):
                i, j = rng.choice(e, 2, replace=False)
                candidate[i], candidate[j] = candidate[j], candidate[i]
        owner, cost = _descend(x, candidate, l, f, cap)
        if cost < best_cost:
            best_owner, best_cost = owner, cost
    return best_owner


def _descend(x: np.ndarray, owner: np.ndarray, load: np.ndarray, f: int, cap: float) -> tuple[np.ndarray, float]:
    """Steepest-descent swaps on the sum of fan-outs; (layout, sum of fan-outs).

    x: float32[N, E] token-expert incidence. With m[t, s] = experts of token t in set s,
    swapping i (set a) with j (set b) changes the sum of fan-outs by
        G0[i, b] - G1[i, a] + H[i, j]  +  G0[j, a] - G1[j, b] + H[j, i]
    G0[i, s] = tokens with i and no expert in s, G1[i, s] = tokens with i and exactly one
    expert in s, H[i, j] = tokens with i and j where i is the only one of its set (tokens
    with both i and j keep their counts). The three matrices are updated on the tokens that
    hold i or j only.
    """
    owner = np.array(owner, np.int64)
    e = x.shape[1]
    set_load = np.bincount(owner, weights=load, minlength=f)
    cap = cap * (1 + 1e-12)
    m = x @ np.eye(f, dtype=np.float32)[owner]                     # [N, F] experts per set
    idx = np.arange(e)

    def parts(rows: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        xr, mr = x[rows], m[rows]
        z1 = (mr == 1).astype(np.float32)
        return xr.T @ (mr == 0).astype(np.float32), xr.T @ z1, (xr * z1[:, owner]).T @ xr

    g0, g1, h = parts(slice(None))
    limit = None
    for _ in range(8 * e * f):
        own = g1[idx, owner]
        gain = g0[:, owner] - own[:, None] + h                       # g0[:, owner][i, j] = G0[i, owner(j)]
        gain = gain + gain.T
        new_i = set_load[owner][:, None] - load[:, None] + load[None, :]
        heavy = int(np.argmax(set_load))
        if limit is None and set_load[heavy] > cap:
            # repair first (as co_cluster): swap an expert of the heaviest set for a lighter one,
            # the best fan-out change among swaps that leave the other set under the cap, else
            # the swap that lowers the larger of the two loads most
            lowers = (owner[:, None] == heavy) & (owner[None, :] != heavy) & (load[:, None] > load[None, :])
            under = lowers & (new_i.T <= cap)
            if under.any():
                i, j = np.unravel_index(int(np.argmin(np.where(under, gain, np.inf))), gain.shape)
            else:
                worst = np.maximum(new_i, new_i.T)
                worst = np.where(lowers & (worst < set_load[heavy]), worst, np.inf)
                if not np.isfinite(worst).any():
                    limit = float(set_load.max()) * (1 + 1e-12)
                    continue
                i, j = np.unravel_index(int(np.argmin(worst)), worst.shape)
        else:
            if limit is None:
                limit = max(cap, float(set_load.max()) * (1 + 1e-12))
            ok = (owner[:, None] != owner[None, :]) & (new_i <= limit) & (new_i.T <= limit)
            gain = np.where(ok, gain, np.inf)
            i, j = np.unravel_index(int(np.argmin(gain)), gain.shape)
            if not gain[i, j] < -0.5:                               # counts: an improving swap gains >= 1
                break
        rows = np.flatnonzero((x[:, i] > 0) | (x[:, j] > 0))
        d0, d1, dh = parts(rows)
        a, b = int(owner[i]), int(owner[j])
        owner[i], owner[j] = b, a
        set_load[a] += load[j] - load[i]
        set_load[b] += load[i] - load[j]
        m[rows, a] += x[rows, j] - x[rows, i]
        m[rows, b] += x[rows, i] - x[rows, j]
        n0, n1, nh = parts(rows)
        g0 += n0 - d0
        g1 += n1 - d1
        h += nh - dh
    return owner, float((m > 0).sum())
