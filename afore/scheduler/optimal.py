"""Exact certifier: the minimum max tile load under Algorithm 1's placement, slot and copy constraints.

A mixed-integer program solved by HiGHS (``highspy``), used by ``afore bench scheduler`` (the
paper's Table 2: greedy plan vs certified optimum) and by tests on small instances.

Given demand d (k_e = ceil(d_e / M_tile) tiles), the projected slot table C and the protected
slots U, with integer tiles N[e, w] >= 0 and binary redundant-replica choices y[e, w]:

  minimise   T
  subject to sum_w N[e, w] = k_e                      every expert's tiles run somewhere
             sum_e N[e, w] <= T                       tile load of worker w
             N[e, w] <= min(k_e, UB) * y[e, w]        work only on a replica (w != primary of e)
             sum_e y[e, w] <= R - |empty protected slots of w|
             y[e, w] = 1 for a protected binding      protected slots keep their expert
             sum of y[e, w] not bound in C <= B       at most B new replicas (copies)

Primaries are fixed (N[e, primary] is free, no y). Migration cost is not in the objective: the
benchmark compares plans whose copies fit in the lookahead window. The compactness threshold
theta is a heuristic restriction of the greedy, not a constraint of the problem, so the optimum
here is the best any planner can reach. Before solving, two lower bounds short-circuit the MILP
when a supplied incumbent (the greedy's tiles) already meets them: the average load
ceil(sum_e k_e / F) and max_e ceil(k_e / r_max(e)), where r_max(e) counts the workers that can
hold e (primary, existing bindings, and at most B new ones); and, within B, the copies each
overloaded worker needs (``budget_bound``), the receivers' room (``receiver_bound``) and, where a
worker can take at most one new replica, the rooms each overloaded worker's copies reach
(``tree_bound``, ``closure_bound`` for R = 1). Where the incumbent is still above them and R = 1,
``forest_bound`` (a small MILP over the slot forest's groups of workers, not over tiles) tests the
values below the incumbent. Then, before the full MILP, the same MILP restricted to new replicas of
the overloaded workers' largest experts (``_hot_replica_plan``) looks for a plan below the
incumbent: where one exists it is found in well under a second, and it often meets the bound.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from afore.config import ClusterShape, SchedulerParams
from afore.plan import SlotTable


@dataclasses.dataclass(frozen=True)
class Certificate:
    """The certified optimum of max tile load for one target.

    optimum:     the proven minimum (tiles), None if the time limit hit first
    lower_bound: best proven lower bound (tiles)
    upper_bound: best feasible value found (tiles): the incumbent's or the solver's
    status:      "optimal" or "time-limit"
    method:      "bound" (incumbent met a lower bound: a combinatorial one, or the forest bound,
                 whose relaxation is a small MILP over groups of workers) or "milp" (HiGHS proved
                 the optimum of the certifier's MILP, or found a plan at the lower bound)
    solve_s:     wall time of the certification (s)
    tiles:       int64[E, F] tiles of an optimal (or best found) solution, None for method "bound"
                 without an incumbent
    """

    optimum: int | None
    lower_bound: int
    upper_bound: int
    status: str
    method: str
    solve_s: float
    tiles: np.ndarray | None = None

    @property
    def value(self) -> int:
        """The certified value: the optimum if proven, else the best lower bound."""
        return self.optimum if self.optimum is not None else self.lower_bound

    def gap(self, max_tile_load: int) -> float:
        """Relative gap (max_tile_load - optimum) / optimum; 0 when both are 0."""
        ref = self.value
        if ref == 0:
            return 0.0 if max_tile_load == 0 else float("inf")
        return (max_tile_load - ref) / ref


def tile_counts(shape: ClusterShape, demand: np.ndarray) -> np.ndarray:
    """int64[E]: k_e = ceil(d_e / M_tile)."""
    return -(-shape.check_demand(demand) // shape.m_tile)


def check_protected(shape: ClusterShape, protected: object) -> np.ndarray:
    """Validate U[t] as bool[F, R]."""
    arr = np.asarray(protected)
    f, r = shape.num_workers, shape.redundant_slots
    if arr.shape != (f, r):
        raise ValueError(f"protected: expected shape ({f}, {r}), got {arr.shape}")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "iu" or not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"protected: expected booleans, got dtype {arr.dtype}")
        arr = arr.astype(bool)
    return arr


def lower_bounds(shape: ClusterShape, k: np.ndarray, table: SlotTable, protected: np.ndarray, copy_budget: int) -> int:
    """Combinatorial lower bound on the optimum: max(average load, max_e ceil(k_e / r_max(e)))."""
    f = shape.num_workers
    bound = int(-(-int(k.sum()) // f))
    owner = shape.primary_owner
    bound_on = np.zeros((shape.num_experts, f), bool)
    w_idx, r_idx = np.nonzero(table.expert >= 0)
    bound_on[table.expert[w_idx, r_idx], w_idx] = True
    rebindable = (~protected).sum(axis=1) > 0  # workers with a slot that can take a new replica
    for e in np.nonzero(k > 0)[0]:
        existing = int(bound_on[e].sum())
        candidates = rebindable.copy()
        candidates[owner[e]] = False
        candidates &= ~bound_on[e]
        r_max = 1 + existing + min(copy_budget, int(candidates.sum()))
        bound = max(bound, int(-(-int(k[e]) // r_max)))
    has_other = bound_on.any(axis=1)
    bound = max(bound, budget_bound(shape, k, has_other, copy_budget),
                receiver_bound(shape, k, has_other, rebindable, copy_budget))
    if np.all((~protected).sum(axis=1) <= 1):  # at most one new replica per worker (R = 1, ...)
        bound = max(bound, tree_bound(shape, k, has_other, rebindable, copy_budget))
    if shape.redundant_slots == 1:
        bound = max(bound, closure_bound(shape, k, table, protected, copy_budget))
    return bound


def budget_bound(shape: ClusterShape, k: np.ndarray, has_other: np.ndarray, copy_budget: int) -> int:
    """The smallest T (tiles) for which the copies needed to bring every worker to T fit the budget.

    A worker's load is at least the tiles of its primaries that stay on it. Tiles of a primary
    with a replica elsewhere in C[t] (``has_other``: bool[E]) may leave without a copy; any other
    primary that sheds tiles needs at least one new replica. So worker w at T needs at least
    m_w(T) copies, the fewest of its copy-needing primaries (largest first) whose tiles cover
    P_w - free_w - T, and sum_w m_w(T) <= B. Strong where B < F (cold tables: each overloaded
    worker costs a copy), where the average bound is far below the optimum. Algorithm 1 stops its
    stage 3b there too (the C++ core computes the same value).
    """
    f, owner = shape.num_workers, shape.primary_owner
    needy = []
    for w in range(f):
        mine = owner == w
        free = int(k[mine & has_other].sum())
        sizes = np.sort(k[mine & ~has_other])[::-1]
        needy.append((int(k[mine].sum()) - free, np.cumsum(sizes)))

    def copies_needed(t: int) -> int:
        total = 0
        for rest, covered in needy:
            if rest > t:
                total += int(np.searchsorted(covered, rest - t)) + 1
        return total

    lo, hi = 0, max((rest for rest, _ in needy), default=0)
    while lo < hi:  # copies_needed falls as T grows; hi always fits (no copy)
        mid = (lo + hi) // 2
        if copies_needed(mid) <= copy_budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def receiver_bound(shape: ClusterShape, k: np.ndarray, has_other: np.ndarray, rebindable: np.ndarray,
                   copy_budget: int) -> int:
    """The smallest T (tiles) for which the receivers that B copies can reach have room for the
    tiles that must leave their primaries through new replicas.

    needy_w: the tiles of w's primaries with no replica elsewhere in C[t] (``has_other``:
    bool[E]). Worker w keeps x_w <= min(T, needy_w) of them, the rest leaves on new replicas; a
    worker v that takes tiles on a new replica ends at least at x_v plus what it takes, so
    sum_w (needy_w - T)^+ <= sum over the receivers v of (T - needy_v) (a receiver that sheds too
    passes its own tiles on and gains nothing). Every receiver holds at least one of the at most
    B new replicas and needs a slot that can take one (``rebindable``: bool[F]), so at most B of
    them count, the roomiest. Strong on cold tables with B < F, where each copy can carry only
    the room of one light worker (the budget bound counts the copies each overloaded worker
    needs, not where they can go).
    """
    f, owner = shape.num_workers, shape.primary_owner
    needy = np.bincount(owner, weights=np.where(has_other, 0, k), minlength=f).astype(np.int64)
    can_take = needy[np.asarray(rebindable, bool)]
    receivers = min(int(copy_budget), can_take.size)

    def fits(t: int) -> bool:
        excess = int(np.maximum(needy - t, 0).sum())
        if excess == 0:
            return True
        room = np.sort(np.maximum(t - can_take, 0))[::-1]
        return int(room[:receivers].sum()) >= excess

    lo, hi = 0, int(needy.max(initial=0))
    while lo < hi:  # fits(T) is monotone in T; hi fits (nothing must leave)
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def tree_bound(shape: ClusterShape, k: np.ndarray, has_other: np.ndarray, rebindable: np.ndarray,
               copy_budget: int) -> int:
    """The smallest T (tiles) for which the copies that bring every worker to T can fit the budget,
    counting the rooms each overloaded worker's tiles must reach, where every worker can take at
    most one new replica (each has at most one slot that is not protected: R = 1, or all but one
    slot protected). Valid only then; ``lower_bounds`` calls it only then.

    needy_w: tiles of w's primaries with no replica elsewhere in C[t] (``has_other``: bool[E]);
    they stay on w or go to new replicas. Draw an edge w -> v for every new replica on v of an
    expert of w with needy tiles: each worker has at most one incoming edge, so the workers
    reachable from w, desc(w), receive needy tiles from w only, and theirs stay among them (or
    return to w on a cycle). So w's excess x_w = needy_w - T fits in their room:
    x_w <= sum over desc(w) of (T - needy_u). Every worker of desc(w) has an incoming edge, i.e.
    a copy, and desc sets are nested or disjoint. Hence, with O the workers above T and r(x) the
    fewest rooms (T - needy_u of the workers not in O with a slot that can take a replica,
    largest first) that sum to x, the copies are at least max(sum_O r(x_w), r(sum_O x_w)): a
    group of nested overloaded workers G under one root takes |G| - 1 + r(X_G) copies, and
    r(a + b) >= r(a) + r(b) - 1, so splitting every group into single workers never raises the
    count. Also at least sum_O m_w: w's own copies, each carrying at most min(k_e, T) tiles and
    an expert no more than k_e. Strong on cold R = 1 tables with B < F, where an overloaded
    worker's copies reach only light receivers, whose room is T minus their own tiles, unless
    they pass their own tiles on, which costs a copy each.
    """
    f, owner = shape.num_workers, shape.primary_owner
    needy_k = np.where(has_other, 0, k)
    needy = np.bincount(owner, weights=needy_k, minlength=f).astype(np.int64)
    rebindable = np.asarray(rebindable, bool)
    sizes = [np.sort(needy_k[owner == w])[::-1] for w in range(f)]

    def fits(t: int) -> bool:
        over = np.flatnonzero(needy > t)
        if over.size == 0:
            return True
        pool = ~np.zeros(f, bool)
        pool[over] = False
        rooms = np.sort(np.maximum(t - needy[pool & rebindable], 0))[::-1]
        covered = np.cumsum(rooms)

        def rooms_for(x: int) -> int | None:
            i = int(np.searchsorted(covered, x))
            return None if i >= covered.size else i + 1

        copies_r = copies_m = 0
        for w in over:
            x = int(needy[w]) - t
            r = rooms_for(x)
            if r is None:
                return False
            copies_r += r
            # chunks: each copy of e carries at most min(k_e, t) tiles, e's copies at most k_e
            chunks = np.concatenate([np.minimum(np.full(-(-int(s) // t) if t > 0 else 0, t),
                                                int(s) - t * np.arange(-(-int(s) // t) if t > 0 else 0))
                                     for s in sizes[w] if s > 0]) if t > 0 else np.zeros(0, np.int64)
            carried = np.cumsum(np.sort(chunks)[::-1])
            m = int(np.searchsorted(carried, x))
            if m >= carried.size:
                return False
            copies_m += m + 1
        total = rooms_for(int((needy[over] - t).sum()))
        if total is None:
            return False
        return max(copies_r, copies_m, total) <= copy_budget

    lo, hi = 0, int(needy.max(initial=0))
    while lo < hi:  # fits(T) is monotone in T; hi fits (nothing must leave)
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def closure_bound(shape: ClusterShape, k: np.ndarray, table: SlotTable, protected: np.ndarray,
                  copy_budget: int) -> int:
    """The smallest T (tiles) for which B copies can give the workers above T enough room, with
    R = 1 (one slot per worker) and C[t]'s bindings counted as free replicas. Valid only for R = 1;
    ``lower_bounds`` calls it only then.

    With one slot, every worker holds at most one replica: draw an edge primary(e) -> v for the
    binding of v's slot in the plan (kept from C[t], free, or new, a copy). Each worker has at most
    one incoming edge, so the set Q of the workers reachable from O (those whose primaries hold
    more than T tiles, P_w > T) with O itself holds every tile of Q's primaries; hence
    sum_O (P_w - T) <= sum over Q - O of (T - P_u). A worker of Q - O is reached either along
    C[t]'s bindings only (D0(O): the workers reachable from O in C[t]) or after a last new edge
    into some h, and then it is in {h} with D0(h). So the excess of O beyond the room of D0(O)
    needs copies whose heads h bring at most val(h) = sum over {h} with D0(h), less D0(O), of
    (T - P_u)^+ each: the fewest largest such values (one per worker with a slot that is not protected)
    must fit in B. Strong on bursts with R = 1, where the hot experts' existing replicas hold the
    light workers' only slots (protected), so each copy reaches one light worker's room only.
    """
    f, owner = shape.num_workers, shape.primary_owner
    primary = np.bincount(owner, weights=k, minlength=f).astype(np.int64)
    edges = np.zeros((f, f), bool)  # edges[u, v]: C[t] binds one of u's primaries on v
    slot_expert = np.asarray(table.expert)[:, 0]
    bound_v = np.flatnonzero(slot_expert >= 0)
    edges[owner[slot_expert[bound_v]], bound_v] = True
    reach = edges.copy()  # reach[u, v]: v reachable from u along >= 1 edge
    for _ in range(f):
        grown = reach | ((reach.astype(np.int64) @ edges.astype(np.int64)) > 0)
        if np.array_equal(grown, reach):
            break
        reach = grown
    heads = (~np.asarray(protected, bool)).any(axis=1)

    def fits(t: int) -> bool:
        over = primary > t
        excess = int((primary[over] - t).sum())
        if excess == 0:
            return True
        room = np.maximum(t - primary, 0)
        counted = reach[over].any(axis=0)  # D0(O)
        free = int(room[counted].sum())
        need = excess - free
        if need <= 0:
            return True
        room[counted] = 0  # a copy's head brings only the room beyond D0(O)
        val = np.sort((room + reach.astype(np.int64) @ room)[heads])[::-1]
        covered = np.cumsum(val)
        i = int(np.searchsorted(covered, need))
        return i < covered.size and i + 1 <= copy_budget

    lo, hi = 0, int(primary.max(initial=0))
    while lo < hi:  # fits(T) is monotone in T; hi fits (no worker above it)
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def forest_copies(shape: ClusterShape, k: np.ndarray, table: SlotTable, protected: np.ndarray, t: int,
                  time_limit_s: float = 5.0, threads: int = 1) -> int | None:
    """A lower bound on the new replicas (copies) of any plan with max tile load <= ``t`` (tiles),
    with R = 1 (one redundant slot per worker); None where no plan reaches ``t`` with any number
    of copies. Valid only for R = 1 (it raises otherwise); ``forest_bound`` calls it only then.

    The slot forest of a plan: an edge primary(e) -> v for the binding of v's slot (kept from
    C[t]: free; new: a copy; a protected slot keeps its binding, used or not). With one slot, each
    worker has at most one incoming edge, and every tile of e runs on primary(e) or on a child
    that holds e. So for S_w, w with all its descendants, the tiles of S_w's primaries run in S_w:
    room(S_w) = sum over u in S_w of (t - P_u) >= 0, P_u the tiles of u's primaries. A worker's
    ancestors form one path, so the sets S_w of the workers above t (O) are nested or disjoint:
    the maximal ones are disjoint groups, each with a top in O, that hold all of O. Every member of
    a group but its top has its parent in the group, and its edge is free only if its C[t]
    binding's primary is in the group. A protected member's edge is that binding, and a protected
    binding's worker follows its primary into the group; a protected empty slot takes no edge. So
    the plan makes at least sum over the groups of (members - 1 - free edges) copies, and this
    returns the minimum of that over all groupings with room >= 0 each: a MILP over s[u, j] (u in
    the group of top j) and f[u, j] (u's edge free), solved by HiGHS; at the time limit its dual
    bound (rounded up), still a lower bound. The tree and closure bounds relax it (groups that
    share rooms, or one pooled group). Strong on cold tables and bursts with B < F: each group
    wastes part of its receivers' rooms, and two groups merge only at the cost of a copy (one
    worker hosts the other's expert).
    """
    import highspy

    f, owner = shape.num_workers, shape.primary_owner
    if shape.redundant_slots != 1:
        raise ValueError(f"forest_copies: expected R = 1, got R = {shape.redundant_slots}")
    room = t - np.bincount(owner, weights=k, minlength=f).astype(np.int64)
    tops = np.flatnonzero(room < 0)
    if tops.size == 0:
        return 0
    slot_expert = np.asarray(table.expert)[:, 0]
    parent = np.where(slot_expert >= 0, owner[np.maximum(slot_expert, 0)], -1)  # primary of C[t]'s binding
    locked = np.asarray(protected, bool)[:, 0]
    g = tops.size
    bound = np.flatnonzero(parent >= 0)
    f_col = {int(u): f * g + i * g for i, u in enumerate(bound)}  # f[u, j] = f_col[u] + j
    num_col = f * g + bound.size * g  # s[u, j] = u * g + j first

    def s(u: int, j: int) -> int:
        return u * g + j

    lower, upper = np.zeros(num_col), np.ones(num_col)
    cost = np.concatenate([np.ones(f * g), -np.ones(bound.size * g)])
    inf = highspy.kHighsInf
    rows: list[tuple[list[tuple[int, float]], float, float]] = []
    for j, top in enumerate(int(x) for x in tops):
        cost[s(top, j)] = 0.0  # group j is used iff its top is in it; the top takes no edge
        if top in f_col:
            upper[f_col[top] + j] = 0.0
        rows.append(([(s(u, j), float(room[u])) for u in range(f) if room[u] != 0], 0.0, inf))
        for u in range(f):
            if u != top:
                if locked[u] and parent[u] < 0:
                    upper[s(u, j)] = 0.0
                    continue
                rows.append(([(s(u, j), 1.0), (s(top, j), -1.0)], -inf, 0.0))
            if u in f_col:
                fc, p = f_col[u] + j, int(parent[u])
                rows.append(([(fc, 1.0), (s(u, j), -1.0)], -inf, 0.0))
                rows.append(([(fc, 1.0), (s(p, j), -1.0)], -inf, 0.0))
                if locked[u]:
                    rows.append(([(s(p, j), 1.0), (s(u, j), -1.0)], -inf, 0.0))
                    if u != top:
                        rows.append(([(s(u, j), 1.0), (fc, -1.0)], -inf, 0.0))
    for u in range(f):  # each worker above t in exactly one group, any other in at most one
        rows.append(([(s(u, j), 1.0) for j in range(g)], 1.0 if room[u] < 0 else 0.0, 1.0))
    h = _solve_integer_program(num_col, rows, lower, upper, cost, time_limit_s, threads)
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    info = h.getInfo()
    value = info.objective_function_value if status == highspy.HighsModelStatus.kOptimal else info.mip_dual_bound
    return max(0, int(np.ceil(value - 1e-6))) if np.isfinite(value) else 0


def forest_bound(shape: ClusterShape, k: np.ndarray, table: SlotTable, protected: np.ndarray, copy_budget: int,
                 lo: int, hi: int, time_limit_s: float = 5.0, threads: int = 1) -> int:
    """The smallest T (tiles) in [lo, hi) whose ``forest_copies`` fit the budget B, else hi: a
    lower bound on the optimum wherever lo is one (the optimum T* fits, so the first T from lo
    that fits is at most T*; none below hi means T* >= hi). R = 1 only. ``time_limit_s`` is shared
    by the values tested (each one MILP; in ``certify`` hi is the incumbent, lo the other bounds,
    mostly one value apart); a value left untested when it runs out is taken to fit.
    """
    deadline = time.perf_counter() + time_limit_s
    for t in range(lo, hi):
        left = deadline - time.perf_counter()
        if left <= 0:
            return t
        need = forest_copies(shape, k, table, protected, t, left, threads)
        if need is not None and need <= copy_budget:
            return t
    return max(lo, hi)


def check_tiles_feasible(shape: ClusterShape, k: np.ndarray, table: SlotTable, protected: np.ndarray,
                         copy_budget: int, tiles: np.ndarray) -> None:
    """Raise ValueError if ``tiles`` int[E, F] breaks a constraint of the certifier's problem."""
    e_, f = shape.num_experts, shape.num_workers
    n = np.asarray(tiles)
    if n.shape != (e_, f):
        raise ValueError(f"incumbent: expected shape ({e_}, {f}), got {n.shape}")
    if np.any(n < 0) or not np.array_equal(n.sum(axis=1), k):
        raise ValueError("incumbent: tiles must be >= 0 and sum to ceil(demand / m_tile) per expert")
    owner = shape.primary_owner
    new = 0
    for w in range(f):
        bound = {int(x) for x in table.expert[w] if x >= 0}
        kept = {int(table.expert[w, r]) for r in range(shape.redundant_slots) if protected[w, r] and table.expert[w, r] >= 0}
        empty_protected = int(np.sum(protected[w] & (table.expert[w] < 0)))
        used = {int(e) for e in np.nonzero(n[:, w] > 0)[0] if owner[e] != w} | kept
        if len(used) + empty_protected > shape.redundant_slots:
            raise ValueError(f"incumbent: worker {w} needs {len(used)} redundant replicas, has {shape.redundant_slots - empty_protected} slots")
        new += len(used - bound)
    if new > copy_budget:
        raise ValueError(f"incumbent: {new} new replicas, copy budget is {copy_budget}")


def certify(shape: ClusterShape, demand: np.ndarray, table: SlotTable, protected: np.ndarray,
            params: SchedulerParams, time_limit_s: float = 10.0, incumbent: np.ndarray | None = None,
            threads: int = 1) -> Certificate:
    """Certify the minimum max tile load for one target.

    Args:
      shape, params: cluster shape and scheduler knobs (uses params.copy_budget = B).
      demand: int64[E] token-expert pairs per expert.
      table: the projected slot table C[t] before planning (not mutated).
      protected: bool[F, R] U[t].
      time_limit_s: time limit of the whole certification (s): at most a quarter for the forest
        bound (R = 1), at most a quarter of the rest (and 5 s) for the restricted search below the
        incumbent, the rest for the MILP; on expiry status is "time-limit".
      incumbent: optional int[E, F] tiles of a feasible plan (e.g. ``plan.tiles``); checked,
        used for the bound short-circuit and as the value the MILP must beat.
    """
    start = time.perf_counter()
    k = tile_counts(shape, demand)
    table.check(shape)
    protected = check_protected(shape, protected)
    if not (np.isfinite(time_limit_s) and time_limit_s > 0):
        raise ValueError(f"time_limit_s: expected a finite value > 0, got {time_limit_s!r}")
    B = params.copy_budget
    lb = lower_bounds(shape, k, table, protected, B)
    owner = shape.primary_owner
    primary_load = np.bincount(owner, weights=k, minlength=shape.num_workers).astype(np.int64)
    ub, ub_tiles = int(primary_load.max()), None
    if incumbent is not None:
        incumbent = np.asarray(incumbent, np.int64)
        check_tiles_feasible(shape, k, table, protected, B, incumbent)
        inc_value = int(incumbent.sum(axis=0).max())
        if inc_value <= ub:
            ub, ub_tiles = inc_value, incumbent
    if ub > lb and shape.redundant_slots == 1:
        lb = forest_bound(shape, k, table, protected, B, lb, ub, time_limit_s / 4, threads)
    if ub <= lb:
        if ub_tiles is None:
            ub_tiles = _primary_tiles(shape, k)
        return Certificate(ub, ub, ub, "optimal", "bound", time.perf_counter() - start, ub_tiles)
    # Search below the incumbent only: T <= ub - 1 also tightens every big-M to min(k_e, ub - 1).
    # An infeasible model then proves the incumbent optimal.
    left = time_limit_s - (time.perf_counter() - start)
    found = _hot_replica_plan(shape, k, table, protected, B, lb, ub, min(left / 4, 5.0), threads)
    if found is not None:
        ub, ub_tiles = int(found.sum(axis=0).max()), found
        if ub <= lb:
            return Certificate(ub, ub, ub, "optimal", "milp", time.perf_counter() - start, ub_tiles)
    left = max(time_limit_s - (time.perf_counter() - start), 1e-3)
    return _solve_milp(shape, k, table, protected, B, lb, ub, ub_tiles, left, threads, start)


def fewest_copies(shape: ClusterShape, demand: np.ndarray, table: SlotTable, protected: np.ndarray,
                  max_tile_load: int, time_limit_s: float = 10.0, threads: int = 1) -> int | None:
    """The fewest new replicas (copies) of any plan with max tile load <= ``max_tile_load``
    (tiles), under the certifier's placement and slot constraints and no copy budget, by the
    MILP; None where no plan reaches that load. For small instances (tests): RuntimeError if
    HiGHS stops at the time limit. ``forest_copies`` is a lower bound on it (R = 1).
    """
    import highspy

    k = tile_counts(shape, demand)
    table.check(shape)
    protected = check_protected(shape, protected)
    budget = shape.num_workers * shape.redundant_slots
    num_col, rows, lower, upper, _, _, new_cols = _certifier_model(shape, k, table, protected, budget, 0,
                                                                   int(max_tile_load))
    cost = np.zeros(num_col)
    cost[new_cols] = 1.0
    h = _solve_integer_program(num_col, rows, lower, upper, cost, time_limit_s, threads)
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    if status != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"fewest_copies: HiGHS stopped with status {h.modelStatusToString(status)}")
    return int(round(h.getInfo().objective_function_value))


def _certifier_model(shape, k, table, protected, B, lb, cap, new_allowed=None):
    """The certifier's MILP with T in [lb, cap]: (num_col, rows, lower, upper, cost, n_col,
    new_cols), rows as (entries, lo, hi), n_col[(e, w)] the column of N[e, w] (column 0 is T) and
    new_cols the columns y[e, w] of the pairs not bound in C[t] (a copy each). ``new_allowed``:
    optional bool[E, F], the pairs that may take a new replica (all where None)."""
    import highspy

    E, F, R = shape.num_experts, shape.num_workers, shape.redundant_slots
    owner = shape.primary_owner
    bound_on = np.zeros((E, F), bool)
    w_idx, r_idx = np.nonzero(table.expert >= 0)
    bound_on[table.expert[w_idx, r_idx], w_idx] = True
    fixed_on = np.zeros((E, F), bool)
    w_idx, r_idx = np.nonzero((table.expert >= 0) & protected)
    fixed_on[table.expert[w_idx, r_idx], w_idx] = True
    capacity = R - (protected & (table.expert < 0)).sum(axis=1)

    # columns: 0 = T; N[e, w] for experts with k_e > 0 and every w; y[e, w] for the non-primary pairs of
    # those experts and for protected bindings (fixed to 1, they hold their slot even when idle)
    active = np.nonzero(k > 0)[0]
    n_col = {}
    y_col = {}
    col = 1
    for e in active:
        for w in range(F):
            n_col[(e, w)] = col
            col += 1
    for e in range(E):
        for w in range(F):
            if w == owner[e]:
                continue
            if k[e] > 0 or fixed_on[e, w]:
                y_col[(e, w)] = col
                col += 1
    num_col = col
    lower = np.zeros(num_col)
    upper = np.zeros(num_col)
    lower[0], upper[0] = lb, cap
    for (e, w), c in n_col.items():
        upper[c] = min(int(k[e]), cap)
    for (e, w), c in y_col.items():
        upper[c] = 1
        lower[c] = 1 if fixed_on[e, w] else 0
        if new_allowed is not None and not bound_on[e, w] and not new_allowed[e, w]:
            upper[c] = 0
    cost = np.zeros(num_col)
    cost[0] = 1.0

    inf = highspy.kHighsInf
    rows: list[tuple[list[tuple[int, float]], float, float]] = []
    for e in active:
        rows.append(([(n_col[(e, w)], 1.0) for w in range(F)], float(k[e]), float(k[e])))
    for w in range(F):
        rows.append(([(n_col[(e, w)], 1.0) for e in active] + [(0, -1.0)], -inf, 0.0))
    for (e, w), c in y_col.items():
        if (e, w) in n_col:
            rows.append(([(n_col[(e, w)], 1.0), (c, -float(min(int(k[e]), cap)))], -inf, 0.0))
    for w in range(F):
        cols = [(c, 1.0) for (e, w2), c in y_col.items() if w2 == w]
        if cols:
            rows.append((cols, -inf, float(max(capacity[w], 0))))
    new_cols = [c for (e, w), c in y_col.items() if not bound_on[e, w]]
    if new_cols:
        rows.append(([(c, 1.0) for c in new_cols], -inf, float(B)))
    return num_col, rows, lower, upper, cost, n_col, new_cols


def _solve_integer_program(num_col, rows, lower, upper, cost, time_limit_s, threads):
    """Minimise cost @ x over integer x in [lower, upper] with rows (entries, lo, hi) by HiGHS
    (exact: no relative or absolute gap); the solved ``highspy.Highs``."""
    import highspy

    entries = [(r, c, v) for r, (cols_vals, _, _) in enumerate(rows) for c, v in cols_vals]
    ent = np.array(entries, dtype=np.float64).reshape(-1, 3)
    ent = ent[np.lexsort((ent[:, 0], ent[:, 1]))]
    starts = np.searchsorted(ent[:, 1].astype(np.int64), np.arange(num_col + 1))
    lp = highspy.HighsLp()
    lp.num_col_ = num_col
    lp.num_row_ = len(rows)
    lp.col_cost_ = np.asarray(cost, np.float64)
    lp.col_lower_ = np.asarray(lower, np.float64)
    lp.col_upper_ = np.asarray(upper, np.float64)
    lp.row_lower_ = np.array([lo for _, lo, _ in rows], np.float64)
    lp.row_upper_ = np.array([hi for _, _, hi in rows], np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts.astype(np.int32)
    lp.a_matrix_.index_ = ent[:, 0].astype(np.int32)
    lp.a_matrix_.value_ = ent[:, 2]
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_col
    h = highspy.Highs()
    h.silent()
    h.setOptionValue("time_limit", float(max(time_limit_s, 1e-3)))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.0)
    h.passModel(lp)
    h.run()
    return h


def _solution_tiles(shape, h, n_col) -> np.ndarray | None:
    """int64[E, F] tiles of the solver's solution, or None without a feasible one."""
    if h.getInfo().primal_solution_status != 2:  # kSolutionStatusFeasible
        return None
    values = np.asarray(h.getSolution().col_value)
    tiles = np.zeros((shape.num_experts, shape.num_workers), np.int64)
    for (e, w), c in n_col.items():
        tiles[e, w] = int(round(values[c]))
    return tiles


def _hot_replica_plan(shape, k, table, protected, B, lb, ub, time_limit_s, threads) -> np.ndarray | None:
    """A plan below the incumbent ub from the certifier's MILP restricted to new replicas of one
    expert per overloaded worker, its largest (ties: lower index), for every worker with primary
    tiles above lb, onto the workers whose primaries are below ub - 1; int64[E, F] tiles or None.

    A primal heuristic, not a bound: hot experts spread over many light workers, each copy filled
    to its receiver's room, is the shape of the plans one tile below the greedy on the hold-out
    bursts (scheduler_holdout_s11: E = 128 F = 64 R = 2 B = 28, E = 256 F = 64 R = 1 B = 25,
    E = 256 F = 128 R = 1 B = 43), which the full MILP did not find in 20 s and this finds in
    under 1.5 s. Its infeasibility proves nothing; the full MILP follows.
    """
    owner = shape.primary_owner
    primary = np.bincount(owner, weights=k, minlength=shape.num_workers).astype(np.int64)
    allowed = np.zeros((shape.num_experts, shape.num_workers), bool)
    light = primary < ub - 1
    for w in np.flatnonzero(primary > lb):
        mine = np.flatnonzero(owner == w)
        hot = int(mine[np.argmax(k[mine])])
        if k[hot] > 0:
            allowed[hot, light] = True
    allowed[np.arange(shape.num_experts), owner] = False
    if not allowed.any():
        return None
    num_col, rows, lower, upper, cost, n_col, _ = _certifier_model(shape, k, table, protected, B, lb, ub - 1, allowed)
    h = _solve_integer_program(num_col, rows, lower, upper, cost, time_limit_s, threads)
    tiles = _solution_tiles(shape, h, n_col)
    if tiles is None or int(tiles.sum(axis=0).max()) >= ub:
        return None
    try:  # rounded solver values: claim nothing from a solution that breaks a constraint
        check_tiles_feasible(shape, k, table, protected, B, tiles)
    except ValueError:
        return None
    return tiles


def _solve_milp(shape, k, table, protected, B, lb, ub, ub_tiles, time_limit_s, threads, start) -> Certificate:
    import highspy

    num_col, rows, lower, upper, cost, n_col, _ = _certifier_model(shape, k, table, protected, B, lb, ub - 1)
    h = _solve_integer_program(num_col, rows, lower, upper, cost, time_limit_s, threads)
    status = h.getModelStatus()
    info = h.getInfo()
    elapsed = time.perf_counter() - start
    if status == highspy.HighsModelStatus.kInfeasible:
        # nothing below the incumbent exists: ub is optimal
        tiles = ub_tiles if ub_tiles is not None else _primary_tiles(shape, k)
        return Certificate(ub, ub, ub, "optimal", "milp", elapsed, tiles)
    best, tiles = ub, (ub_tiles if ub_tiles is not None else _primary_tiles(shape, k))
    found = _solution_tiles(shape, h, n_col)
    if found is not None:
        best, tiles = int(found.sum(axis=0).max()), found
    if status == highspy.HighsModelStatus.kOptimal:
        return Certificate(best, best, best, "optimal", "milp", elapsed, tiles)
    dual = info.mip_dual_bound
    proven_lb = max(lb, int(np.ceil(dual - 1e-6))) if np.isfinite(dual) else lb
    if proven_lb >= best:
        return Certificate(best, best, best, "optimal", "milp", elapsed, tiles)
    return Certificate(None, proven_lb, best, "time-limit", "milp", elapsed, tiles)


def _primary_tiles(shape: ClusterShape, k: np.ndarray) -> np.ndarray:
    tiles = np.zeros((shape.num_experts, shape.num_workers), np.int64)
    tiles[np.arange(shape.num_experts), shape.primary_owner] = k
    return tiles
