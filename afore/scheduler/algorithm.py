"""Algorithm 1 of the AFORE paper (section 5.2) plus afore's ejection chains: the Python reference.

This module is the executable specification of the per-target scheduler. The production path
(``afore.scheduler.core``, C++ in ``csrc/scheduler/``) returns the same plan on every input;
``tests/scheduler/test_core_differential.py`` holds the two together.

One call plans one target t of one MoE layer:

  demand d[e]            int64[E]   token-expert pairs of the target routed to expert e
  table C[t]             SlotTable  projected redundant-slot bindings (copies in flight count)
  protected U[t]         bool[F, R] slots the running target reads: never rebound
  prev_assignment A[t-1] int32[E, F] the previous plan's assignment of this layer, or None

Work is counted in tiles of M_tile pairs: k_e = ceil(d_e / M_tile), N[e, w] tiles of e on w,
tile load T_w = sum_e N[e, w]. Placement P = fixed primaries + every redundant binding of C[t].

Phases (paper Algorithm 1; the parts marked [chains] go beyond the paper and run only with
``SchedulerParams.chains`` (default True); ``chains=False`` is the paper's algorithm exactly):

1. InitializeAssignment: k_e is split over the workers where e has a replica in P in proportion
   to A[t-1][e, w], by largest remainder in exact integer arithmetic (quota k_e * a_w / S:
   floors first, then one extra tile each to the largest remainders, ties to the lower worker
   index). With no previous assignment, or a previous row with no pairs on a current replica,
   or 0 < k_e <= theta, all tiles go to the primary.
2. Rebalancing within P: workers h in decreasing tile load (ties: lower index first), receivers c
   in increasing tile load (ties: lower index first). The first pair (h, c) with T_h - T_c > 1
   that admits a move of q_e = min(N[e, h], floor((T_h - T_c) / 2)) > theta tiles of an expert e
   with N[e, h] > 0 and a replica on c moves the expert with the largest q_e (ties: lower
   expert index). Repeat until no pair admits a move.
   [chains] Then, if an ejection chain within P exists (``find_chain`` without copy edges), apply
   it and go back to the pair moves; stop when neither exists. The pair rule stops with a max-load
   worker whose experts have no replica on any worker 2 or more tiles lighter; a chain shifts
   one tile along a path of workers (each takes one tile and gives one of another expert, so its
   load is kept) to such a lighter worker: the sorted load vector decreases lexicographically,
   so this terminates. Hops move single tiles, so chains need 1 > theta (no-op for theta >= 1).
3. Rebalancing beyond P: F0 = beta_tile * max_w T_w. While fewer than B copies are planned, the
   same scan looks for e with no replica on c and a safe redundant slot on c: the empty slot of
   lowest index, else the least recently used slot (smallest ``last_used``, ties: lower index)
   whose expert has no tiles on c; never a protected slot, never one rebound earlier in this
   search; a receiver with no safe slot is skipped. The slot is rebound to e (its old expert
   leaves P on c), the copy (e, primary(e), c, P_c + r) is appended to Delta, q tiles move, and
   the candidate's net gain g = F0 - beta_tile * max_w T_w - O_t(Delta) is evaluated, with
   O_t = max(0, M(Delta) - W_t) and M(Delta) = (max copies into one worker) * copy_ms. The search
   goes on through non-positive gains; the candidate with the largest gain > 0 is kept, else the
   within-placement result (no copies).
   [chains] When the scan finds no move (or B copies are planned), the step is instead an
   ejection chain that may bind one new replica on one hop (``find_chain`` with copy edges into
   workers with a safe slot, same slot rule, only while fewer than B copies are planned), or a
   chain within the current placement; each such step is a candidate evaluated by the same
   net-gain rule. The search ends when no step exists or when it would take the tile moves of
   this phase above ``max_beyond_hops`` = 4 F (R + 1) (a chain of n hops counts n; the paper's
   search makes at most F R moves, so the cap only bounds chains).
   [chains] Stage 3b: when the better of those plans ends above max(ceil(sum k / F),
   ``replica_bound``), ``search_level`` tries to bring every worker to one tile below it with a
   copy-efficient search (the most loaded worker first, existing replicas and paths through them
   before copies, best-fit receivers), from the state after stage 2; a plan that reaches its
   level with a larger net gain replaces the best, and the next level down is tried. With
   B < F the paper's half-gap moves spend the budget on early, small deficits and end with
   overloaded workers and no copy left; this is where the gap to the MILP optimum was. On cold
   tables with R = 1 and on bursts whose light workers' single slots hold protected replicas,
   the workers with room have no safe slot: a copy then lands on a worker at the level, which
   passes its own tiles on to one with room (``find_push_path``). Like the
   chains, it runs only for theta = 0 (the certifier's setting; theta >= 1 keeps the paper's
   search exactly).
4. Token fill: a[e, w] = N[e, w] * M_tile on every worker but one, which takes the remainder:
   the primary if it holds tiles of e, else the highest-index worker holding tiles of e. So each
   expert has at most one partial tile and ceil(a / M_tile) = N.

The returned SlotTable holds the selected candidate's bindings, with ``last_used[w, r] = seq`` for
every redundant slot that has work in the plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.plan import Plan, SlotTable, Target, check_planning_types
from afore.scheduler.optimal import budget_bound

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Validated inputs of one call, as plain arrays."""

    demand: np.ndarray            # int64[E]
    table_expert: np.ndarray      # int64[F, R]
    table_last_used: np.ndarray   # int64[F, R]
    protected: np.ndarray         # bool[F, R]
    prev_assignment: np.ndarray | None  # int64[E, F]


def check_inputs(shape: ClusterShape, demand: object, table: SlotTable, protected: object,
                 prev_assignment: object, params: SchedulerParams, cost: CostModel,
                 target: Target, seq: int) -> Inputs:
    """Validate the inputs of ``schedule``; raise ValueError naming the field and expectation."""
    check_planning_types(shape, params, cost, target, seq, with_target=True)
    d = shape.check_demand(demand)
    if d.size and int(d.max()) > INT32_MAX:
        raise ValueError(f"demand: expected counts <= {INT32_MAX}, got {int(d.max())}")
    if int(d.sum()) > INT32_MAX:
        raise ValueError(f"demand: expected a total <= {INT32_MAX}, got {int(d.sum())}")
    if not isinstance(table, SlotTable):
        raise ValueError(f"slot_table: expected a SlotTable, got {type(table).__name__}")
    f, r = shape.num_workers, shape.redundant_slots
    expert = check_integer_matrix(table.expert, "slot_table.expert", (f, r))
    last_used = check_integer_matrix(table.last_used, "slot_table.last_used", (f, r))
    table.check(shape)
    if np.any(last_used < -1):
        raise ValueError(f"slot_table.last_used: expected values >= -1, got {int(last_used.min())}")
    prot = check_protected(protected, (f, r))
    prev = None
    if prev_assignment is not None:
        prev = check_integer_matrix(prev_assignment, "prev_assignment", (shape.num_experts, f))
        if np.any(prev < 0) or np.any(prev > INT32_MAX):
            bad = prev[(prev < 0) | (prev > INT32_MAX)][0]
            raise ValueError(f"prev_assignment: expected counts in [0, {INT32_MAX}], got {int(bad)}")
    return Inputs(d, expert, last_used, prot, prev)


def check_protected(protected: object, expected: tuple[int, int]) -> np.ndarray:
    """Validate U[t] and return it as a C-contiguous bool[F, R]."""
    arr = np.asarray(protected)
    if arr.shape != expected:
        raise ValueError(f"protected: expected shape {expected}, got {arr.shape}")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "iuf" or not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"protected: expected booleans (or 0/1), got dtype {arr.dtype}")
        arr = arr != 0
    return np.ascontiguousarray(arr)


def check_integer_matrix(value: object, field: str, expected: tuple[int, int]) -> np.ndarray:
    """Validate an integer matrix of the expected shape (NaN, non-integer) and return it as int64."""
    arr = np.asarray(value)
    if arr.shape != expected:
        raise ValueError(f"{field}: expected shape {expected}, got {arr.shape}")
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{field}: expected integer values, got non-integer or NaN")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"{field}: expected integer values, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def schedule(shape: ClusterShape, demand: object, table: SlotTable, protected: object,
             prev_assignment: object, params: SchedulerParams, cost: CostModel,
             target: Target, seq: int) -> tuple[Plan, SlotTable]:
    """Plan one target with Algorithm 1. Pure: the inputs are not mutated.

    Args:
      shape: the FFN pool (E experts, F workers, R redundant slots, M_tile).
      demand: int[E] token-expert pairs per expert of this target.
      table: projected slot table C[t] of this layer (expert int32[F, R], last_used int64[F, R]).
      protected: bool[F, R] U[t], slots with work in the running target.
      prev_assignment: int32[E, F] A[t-1] of this layer, or None.
      params: theta (tiles) and copy budget B.
      cost: beta_tile_ms, copy_ms (via M(Delta)) and window_ms W_t.
      target, seq: the target and its sequence number (seq >= 0).
    Returns:
      (plan, table): the plan P[t] and the projected slot table after it.
    """
    inp = check_inputs(shape, demand, table, protected, prev_assignment, params, cost, target, seq)
    e_count, f, m = shape.num_experts, shape.num_workers, shape.m_tile
    owner = shape.primary_owner
    pcount = shape.primary_counts
    theta, beta = params.theta, cost.beta_tile_ms

    k = -(-inp.demand // m)
    binding = inp.table_expert.copy()
    has = placement(owner, binding, e_count)
    tiles = initialize_assignment(k, has, owner, inp.prev_assignment, theta)
    load = tiles.sum(axis=0)

    # Stage 2: rebalancing within the placement, then (beyond the paper) ejection chains.
    rebalance_within(tiles, load, has, theta, params.chains)

    # Stage 3: rebalancing beyond the placement; [chains] when that ends above the average
    # bound L, a second search aimed at L, and the better of the two (the first on ties).
    f0 = beta * int(load.max())
    search = (shape, inp, params, cost, f0, tiles, load, has, binding)
    level = average_bound(k, f)
    best_gain, best_exposed, best = search_beyond(*search, level=None, floor=level)
    if params.chains and theta == 0 and int(best[1].max()) > level:
        gain, exposed, other = search_beyond(*search, level=level, floor=level)
        if gain > best_gain:
            best_gain, best_exposed, best = gain, exposed, other
    # [chains] (theta = 0, like the chains: theta >= 1 keeps the paper's search exactly) Stage 3b:
    # copy-efficient searches to ever lower levels, while one reaches its level.
    if params.chains and theta == 0:
        budget = min(params.copy_budget, f * shape.redundant_slots)
        floor = max(level, replica_bound(k, has, budget))
        target_level = int(best[1].max()) - 1
        if target_level >= floor:  # no plan is below the certifier's budget bound either
            floor = max(floor, budget_bound(shape, k, has.sum(axis=1) > 1, budget))
        while target_level >= floor:
            found = search_level(*search, level=target_level)
            if found is None or found[0] <= best_gain:
                break
            best_gain, best_exposed, best = found
            target_level -= 1
    tiles, load, has, binding, copies = best

    assignment = fill_tokens(inp.demand, k, tiles, owner, m)
    slot = np.full((e_count, f), -1, np.int32)
    slot[np.arange(e_count), owner] = shape.primary_slot
    new_last_used = inp.table_last_used.copy()
    for w, r in zip(*np.nonzero(binding >= 0)):
        ex = int(binding[w, r])
        slot[ex, w] = pcount[w] + r
        if tiles[ex, w] > 0:
            new_last_used[w, r] = seq
    plan = Plan(
        target=target, seq=int(seq), demand=inp.demand.copy(), replicas=slot >= 0,
        assignment=assignment.astype(np.int32), tiles=tiles.astype(np.int32), slot=slot,
        copies=np.array(copies, np.int32).reshape(-1, 4), tile_load=load.astype(np.int32),
        gain_ms=float(best_gain), exposed_ms=float(best_exposed))
    return plan, SlotTable(binding.astype(np.int32), new_last_used)


def average_bound(k: np.ndarray, num_workers: int) -> int:
    """ceil(sum_e k_e / F): no plan has a lower max tile load (the certifier's first bound)."""
    return -(-int(k.sum()) // num_workers)


def search_beyond(shape: ClusterShape, inp: Inputs, params: SchedulerParams, cost: CostModel, f0: float,
                  tiles: np.ndarray, load: np.ndarray, has: np.ndarray, binding: np.ndarray,
                  level: int | None, floor: int) -> tuple[float, float, tuple]:
    """Stage 3 from the state after stage 2 (not mutated): (gain, exposed, best candidate).

    The candidate is (tiles, load, has, binding, copies) with the largest net gain > 0, else the
    stage-2 state without copies. ``level`` None is the paper's search (plus chains). A search
    aimed at ``level`` L (tiles) [chains] fills the receiver of a move onto a new replica at most
    to L: q = min(q, max(theta + 1, L - T_c)). The paper's q (half the gap) lets early copies of a
    hot expert overshoot the level the pool ends at, so that where slots are scarce (cold tables,
    R = 1, bursts) the last overloaded workers find no receiver with a free slot.

    The search stops once the max tile load reaches ``floor`` (the average bound): no later
    candidate can gain more (its max load is no lower, its exposed cost no smaller), so this only
    saves time; the paper's search would go on until no move is left.
    """
    f = shape.num_workers
    theta, budget = params.theta, params.copy_budget
    beta, copy_ms, window = cost.beta_tile_ms, cost.copy_ms, cost.window_ms
    tiles, load, has, binding = tiles.copy(), load.copy(), has.copy(), binding.copy()
    best = (tiles.copy(), load.copy(), has.copy(), binding.copy(), [])
    best_gain, best_exposed = 0.0, 0.0
    reserved = np.zeros_like(inp.protected)
    copies: list[tuple[int, int, int, int]] = []
    copies_into = np.zeros(f, np.int64)
    hops_made, max_hops = 0, max_beyond_hops(f, shape.redundant_slots)
    while params.chains or len(copies) < budget:
        can_copy = len(copies) < budget
        blocked = inp.protected | reserved
        move = None
        if can_copy:
            move = find_beyond_move(tiles, load, has, binding, inp.table_last_used, blocked, theta)
        if move is not None:
            if level is not None:
                e, h, c, r, q = move
                move = (e, h, c, r, min(q, max(theta + 1, level - int(load[c]))))
            hops = [move]
        elif params.chains:
            slots = None
            if can_copy:
                slots = [safe_slot(w, tiles, binding, inp.table_last_used, blocked) for w in range(f)]
            hops = find_chain(tiles, load, has, theta, slots)
            if hops is None:
                break
            hops = [(e, u, v, r, 1) for e, u, v, r in hops]
        else:
            break
        if hops_made + len(hops) > max_hops:
            break
        hops_made += len(hops)
        apply_hops(hops, shape, tiles, load, has, binding, reserved, copies, copies_into)
        exposed = exposed_cost(int(copies_into.max()), copy_ms, window)
        gain = f0 - beta * int(load.max()) - exposed
        if gain > best_gain:
            best = (tiles.copy(), load.copy(), has.copy(), binding.copy(), list(copies))
            best_gain, best_exposed = gain, exposed
        if int(load.max()) <= floor:
            break
    return best_gain, best_exposed, best


def apply_hops(hops: list[tuple[int, int, int, int, int]], shape: ClusterShape, tiles: np.ndarray,
               load: np.ndarray, has: np.ndarray, binding: np.ndarray, reserved: np.ndarray,
               copies: list[tuple[int, int, int, int]], copies_into: np.ndarray) -> None:
    """Apply the hops (e, u, c, r, q) of one step of stage 3 or 3b in order: q tiles of e move
    from u to c; a hop with r >= 0 first rebinds c's slot r to e (its old expert leaves the
    placement on c), reserves it and appends the copy (e, primary(e), c, P_c + r)."""
    for e, u, c, r, q in hops:
        if r >= 0:
            old = int(binding[c, r])
            if old >= 0:
                has[old, c] = False
            binding[c, r] = e
            has[e, c] = True
            reserved[c, r] = True
            copies.append((e, int(shape.primary_owner[e]), c, int(shape.primary_counts[c]) + r))
            copies_into[c] += 1
        _move_tiles(tiles, load, e, u, c, q)


def replica_bound(k: np.ndarray, has: np.ndarray, budget: int) -> int:
    """max_e ceil(k_e / min(F, replicas_e + B)): a lower bound on the max tile load (tiles) of any
    plan with at most ``budget`` new replicas (each expert's tiles spread over at most that many
    workers); the certifier's own bound is at least this (it also counts the slots left)."""
    f = has.shape[1]
    busy = np.flatnonzero(k)
    if busy.size == 0:
        return 0
    most = np.minimum(has[busy].sum(axis=1) + min(budget, f), f)
    return int((-(-k[busy] // most)).max())


def search_level(shape: ClusterShape, inp: Inputs, params: SchedulerParams, cost: CostModel, f0: float,
                 tiles: np.ndarray, load: np.ndarray, has: np.ndarray, binding: np.ndarray,
                 level: int) -> tuple[float, float, tuple] | None:
    """[chains] Stage 3b: bring every worker to at most ``level`` tiles with few copies, from the
    state after stage 2 (not mutated); (gain, exposed, candidate) as ``search_beyond``, or None
    when the level is not reached within the copy budget.

    The paper's search spends a copy on half the gap between the most and the least loaded
    workers; with B < F (or R = 1) that spends the budget on moves that a later, larger deficit
    needed, and ends with overloaded workers and no copy left. Here each step relieves the most
    loaded worker h (ties: lower index) of up to its excess x = T_h - level, with the first of:
    a move of q = min(N[e, h], x, level - T_c) > theta tiles of an expert e on h onto an existing
    replica on a worker c (``find_level_move``); a path through existing replicas to a worker
    below the level (``find_level_path``); and, while fewer than B copies are planned, the same
    two with one new replica in a safe slot (``safe_slot``, same rules as stage 3), ending the
    path or, where no worker below the level has a safe slot, on a worker at the level that
    passes as many tiles of its own on through existing replicas (``find_push_path``). So copies
    are spent only where the placement cannot absorb the excess. Among the direct moves of a step
    the order is (q desc, T_c desc, c asc, N[e, h] desc, e asc): the largest relief, then the
    fullest receiver that gives it (best fit, keeping room for later deficits). Every step lowers
    the total excess, so this terminates; it gives up (None) when a step finds nothing or the
    hops exceed ``max_beyond_hops``.
    """
    f = shape.num_workers
    theta, budget = params.theta, min(params.copy_budget, f * shape.redundant_slots)
    tiles, load, has, binding = tiles.copy(), load.copy(), has.copy(), binding.copy()
    reserved = np.zeros_like(inp.protected)
    copies: list[tuple[int, int, int, int]] = []
    copies_into = np.zeros(f, np.int64)
    hops_left = max_beyond_hops(f, shape.redundant_slots)
    while (excess := int(load.max()) - level) > 0:
        h = int(np.argmax(load))
        slots = None
        if len(copies) < budget:
            blocked = inp.protected | reserved
            slots = [safe_slot(w, tiles, binding, inp.table_last_used, blocked) for w in range(f)]
        hops = None
        for allowed in (None, slots) if slots is not None else (None,):  # copies only when needed
            move = find_level_move(tiles, load, has, theta, h, excess, level, allowed)
            hops = None if move is None else [(move[0], h, move[1], move[2], move[3])]
            if hops is None:
                hops = find_level_path(tiles, load, has, theta, h, excess, level, allowed)
            if hops is not None:
                break
        if hops is None or len(hops) > hops_left:
            return None
        hops_left -= len(hops)
        apply_hops(hops, shape, tiles, load, has, binding, reserved, copies, copies_into)
    exposed = exposed_cost(int(copies_into.max()), cost.copy_ms, cost.window_ms)
    gain = f0 - cost.beta_tile_ms * int(load.max()) - exposed
    return gain, exposed, (tiles, load, has, binding, copies)


def find_level_move(tiles: np.ndarray, load: np.ndarray, has: np.ndarray, theta: int, h: int, excess: int,
                    level: int, slots: list[int | None] | None) -> tuple[int, int, int, int] | None:
    """FindLevelMove: (e, c, r, q) out of worker h for ``search_level``, or None: with ``slots``
    None a move onto an existing replica (r = -1), else onto a new replica in c's slot r =
    slots[c]. Each receiver c (T_c + theta < level, a safe slot for a copy) is offered h's expert
    with the most tiles (ties: lower index) that has (a move) or has not (a copy) a replica on c;
    q = min(N[e, h], excess, level - T_c). The receiver is chosen by (q desc, T_c desc, c asc);
    for a copy by (q desc, min(pooled_e, level - T_c) desc, T_c desc, c asc), with pooled_e the
    excess of e over all its holders, sum_w min(N[e, w], max(T_w - level, 0))."""
    movable = np.flatnonzero(tiles[:, h] > theta)
    if movable.size == 0:
        return None
    n = tiles[movable, h]
    by_tiles = movable[np.lexsort((movable, -n))]  # N[e, h] desc, e asc
    copy = slots is not None
    over = np.maximum(load - level, 0)
    best, best_key = None, None
    for c in range(load.size):
        slack = level - int(load[c])
        if c == h or slack <= theta or (copy and slots[c] is None):
            continue
        usable = by_tiles[has[by_tiles, c] != copy]
        if usable.size == 0:
            continue
        e = int(usable[0])
        q = min(int(tiles[e, h]), excess, slack)
        if q <= theta:
            continue
        if copy:
            # The room of c the new replica can use: every holder of e above the level may later
            # pass its excess of e on to it (not only h), so among equal q the receiver that can
            # take most of e's pooled excess wins; a copy is spent where it absorbs the most.
            pooled = int(np.minimum(tiles[e], over)[has[e]].sum())
            key = (-q, -min(pooled, slack), -int(load[c]), c)
        else:
            key = (-q, -int(load[c]), c)
        if best_key is None or key < best_key:
            best, best_key = (e, c, slots[c] if copy else -1, q), key
    return best


def find_level_path(tiles: np.ndarray, load: np.ndarray, has: np.ndarray, theta: int, h: int, excess: int,
                    level: int, slots: list[int | None] | None) -> list[tuple[int, int, int, int, int]] | None:
    """FindLevelPath: when h has no direct move, a path of hops (e, u, v, r, q) from h to a worker
    below ``level`` that moves q tiles along it (each inner worker takes q and gives q of another
    expert, so its load is kept), or None. r is -1 for a hop onto an existing replica, else the
    slot of v bound to e (a copy, at most one per path). This is how a copy reaches a receiver
    whose room is behind another worker: h -> (existing replica) u -> (new replica) c, or, as a
    last resort (``find_push_path``), h -> u -> (new replica) c -> (existing replica) v.

    Breadth-first search over placement edges u -> v (some e with N[e, u] > theta has a replica
    on v), each worker visited once, levels expanded in increasing worker index, a worker's parent
    the first worker of the previous level with an edge to it. It stops at the first level with a
    worker c with level - T_c > theta, the first by (T_c, c). Else, with ``slots``, the first
    visited worker u (BFS order) with a copy edge to a worker c (safe slot, level - T_c > theta,
    an e with N[e, u] > theta and no replica on c) ends the path with that copy, c by
    (q desc, T_c desc, c asc); else the path of ``find_push_path``. Each hop moves its expert
    with the most tiles on u (ties: lower index); q = min(excess, level - T_c, the hops' N[e, u]),
    and must exceed theta.
    """
    f = load.size
    parent = np.full(f, -1, np.int64)
    seen = np.zeros(f, bool)
    seen[h] = True
    order, frontier, end = [h], [h], None
    while frontier and end is None:
        found = []
        for u in frontier:
            new = np.flatnonzero(has[tiles[:, u] > theta].any(axis=0) & ~seen)
            parent[new], seen[new] = u, True
            found += new.tolist()
        frontier = sorted(found)
        order += frontier
        light = [v for v in frontier if level - int(load[v]) > theta]
        if light:
            end = min(light, key=lambda v: (int(load[v]), v))
    copy_hop = None
    if end is None:
        if slots is None:
            return None
        for u in order[1:]:  # h's own copies were the direct moves
            movable = np.flatnonzero(tiles[:, u] > theta)
            by_tiles = movable[np.lexsort((movable, -tiles[movable, u]))]
            best_key = None
            for c in range(f):
                slack = level - int(load[c])
                if seen[c] or slots[c] is None or slack <= theta:
                    continue
                usable = by_tiles[~has[by_tiles, c]]
                if usable.size == 0:
                    continue
                key = (-min(int(tiles[usable[0], u]), slack), -int(load[c]), c)
                if best_key is None or key < best_key:
                    best_key, copy_hop = key, (int(usable[0]), u, c, slots[c])
            if copy_hop is not None:
                break
        if copy_hop is None:
            return find_push_path(tiles, load, has, theta, excess, level, slots, order, seen, parent)
        end = copy_hop[1]
    hops = placement_hops(tiles, has, theta, parent, end)
    if copy_hop is not None:
        hops.append(copy_hop)
    return with_amount(tiles, load, theta, excess, level, hops)


def find_push_path(tiles: np.ndarray, load: np.ndarray, has: np.ndarray, theta: int, excess: int, level: int,
                   slots: list[int | None], order: list[int], seen: np.ndarray,
                   parent: np.ndarray) -> list[tuple[int, int, int, int, int]] | None:
    """FindPushPath: the last resort of ``find_level_path``, a copy onto a worker c that is not
    below ``level`` and passes q tiles of its own on through existing replicas to one that is:
    h -> (existing replicas) u -> (new replica) c -> (existing replicas) v. Where the workers with
    room have no safe slot (R = 1, or a burst whose light workers' slots are protected) and those
    with a slot have no room, this is the only way h's excess leaves it.

    ``order``, ``seen``, ``parent``: the placement search from h of ``find_level_path`` (no worker
    of it is below the level; ``parent`` is extended here). The copy targets are the workers c
    not seen with a safe slot and a copy edge from a worker of ``order`` (an e with N[e, u] >
    theta and no replica on c), c's copy parent u the first such worker in that order (h first).
    From the copy targets (increasing index), a breadth-first search over placement edges and
    workers not visited yet, levels expanded in increasing index, stops at the first level with a
    worker v with level - T_v > theta, the first by (T_v, v). Hops as in ``find_level_path``;
    the copy moves the expert with the most tiles on u and no replica on c (ties: lower index).
    """
    f = load.size
    visited = seen.copy()
    copy_parent = {}
    for c in range(f):
        if visited[c] or slots[c] is None:
            continue
        for u in order:
            if np.any((tiles[:, u] > theta) & ~has[:, c]):
                copy_parent[c] = u
                break
    frontier, end = sorted(copy_parent), None
    visited[frontier] = True
    while frontier:
        light = [v for v in frontier if level - int(load[v]) > theta]
        if light:
            end = min(light, key=lambda v: (int(load[v]), v))
            break
        found = []
        for u in frontier:
            new = np.flatnonzero(has[tiles[:, u] > theta].any(axis=0) & ~visited)
            parent[new], visited[new] = u, True
            found += new.tolist()
        frontier = sorted(found)
    if end is None:
        return None
    after = placement_hops(tiles, has, theta, parent, end)  # parent[c] is -1: it stops at c
    c = after[0][1] if after else end
    u = copy_parent[c]
    movable = np.flatnonzero((tiles[:, u] > theta) & ~has[:, c])
    e = int(movable[np.lexsort((movable, -tiles[movable, u]))][0])
    hops = placement_hops(tiles, has, theta, parent, u) + [(e, u, c, slots[c])] + after
    return with_amount(tiles, load, theta, excess, level, hops)


def placement_hops(tiles: np.ndarray, has: np.ndarray, theta: int, parent: np.ndarray,
                   v: int) -> list[tuple[int, int, int, int]]:
    """The hops (e, u, v, -1) of the placement path to v in ``parent`` (-1 at its root), root
    first; each moves its expert with the most tiles on u and a replica on v (ties: lower index)."""
    hops = []
    while parent[v] >= 0:
        u = int(parent[v])
        movable = np.flatnonzero((tiles[:, u] > theta) & has[:, v])
        e = int(movable[np.lexsort((movable, -tiles[movable, u]))][0])
        hops.append((e, u, v, -1))
        v = u
    return hops[::-1]


def with_amount(tiles: np.ndarray, load: np.ndarray, theta: int, excess: int, level: int,
                hops: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int, int]] | None:
    """The hops (e, u, v, r) of a level path with its amount q = min(excess, level - T_end, the
    hops' N[e, u]) appended, or None when q <= theta."""
    q = min([excess, level - int(load[hops[-1][2]])] + [int(tiles[e, u]) for e, u, _, _ in hops])
    if q <= theta:
        return None
    return [(e, u, v, r, q) for e, u, v, r in hops]


def max_beyond_hops(num_workers: int, redundant_slots: int) -> int:
    """Cap on the tile moves of the beyond phase: 4 F (R + 1), above the at most F R copies of
    the paper's search, so it only bounds chains (and the C++ core's preallocated undo log)."""
    return 4 * num_workers * (redundant_slots + 1)


def placement(owner: np.ndarray, binding: np.ndarray, num_experts: int) -> np.ndarray:
    """bool[E, F] x[e, w]: the fixed primaries plus every redundant binding."""
    f = binding.shape[0]
    has = np.zeros((num_experts, f), bool)
    has[np.arange(num_experts), owner] = True
    w, r = np.nonzero(binding >= 0)
    has[binding[w, r], w] = True
    return has


def initialize_assignment(k: np.ndarray, has: np.ndarray, owner: np.ndarray,
                          prev: np.ndarray | None, theta: int) -> np.ndarray:
    """int64[E, F] N: k_e tiles per expert spread like A[t-1] over e's current replicas."""
    e_count, f = has.shape
    tiles = np.zeros((e_count, f), np.int64)
    for e in np.flatnonzero(k):
        ke = int(k[e])
        weights = {}
        if prev is not None and ke > theta:
            weights = {int(w): int(prev[e, w]) for w in np.flatnonzero(has[e]) if prev[e, w] > 0}
        total = sum(weights.values())
        if total == 0:
            tiles[e, owner[e]] = ke
            continue
        floors = {w: ke * p // total for w, p in weights.items()}
        leftover = ke - sum(floors.values())
        by_remainder = sorted(weights, key=lambda w: (-(ke * weights[w] % total), w))
        for w in by_remainder[:leftover]:
            floors[w] += 1
        for w, n in floors.items():
            tiles[e, w] = n
    return tiles


def scan_orders(load: np.ndarray) -> tuple[list[int], list[int]]:
    """Donors in decreasing load and receivers in increasing load, ties to the lower index."""
    workers = range(len(load))
    return (sorted(workers, key=lambda w: (-int(load[w]), w)),
            sorted(workers, key=lambda w: (int(load[w]), w)))


def find_within_move(tiles: np.ndarray, load: np.ndarray, has: np.ndarray,
                     theta: int) -> tuple[int, int, int, int] | None:
    """FindWithinMove: (e, h, c, q) onto an existing replica, or None."""
    donors, receivers = scan_orders(load)
    for h in donors:
        # q_e > theta needs N[e, h] > theta and floor((T_h - T_c) / 2) > theta.
        movable = np.flatnonzero(tiles[:, h] > theta)
        if movable.size == 0:
            continue
        reachable = has[movable].any(axis=0)
        for c in receivers:
            half = (int(load[h]) - int(load[c])) // 2
            if half <= theta:  # later receivers are no lighter
                break
            if not reachable[c]:
                continue
            experts = movable[has[movable, c]]
            q = np.minimum(tiles[experts, h], half)
            i = int(np.argmax(q))  # first maximum: the lowest expert index
            return int(experts[i]), h, c, int(q[i])
    return None


def rebalance_within(tiles: np.ndarray, load: np.ndarray, has: np.ndarray, theta: int,
                     chains: bool) -> None:
    """Stage 2: pair moves until none is left; with ``chains``, then one ejection chain and again."""
    while True:
        while (move := find_within_move(tiles, load, has, theta)) is not None:
            e, h, c, q = move
            _move_tiles(tiles, load, e, h, c, q)
        chain = find_chain(tiles, load, has, theta) if chains else None
        if chain is None:
            return
        for e, u, v, _ in chain:
            _move_tiles(tiles, load, e, u, v, 1)


def find_chain(tiles: np.ndarray, load: np.ndarray, has: np.ndarray, theta: int,
               slots: list[int | None] | None = None) -> list[tuple[int, int, int, int]] | None:
    """FindChain (beyond the paper): an ejection chain of single-tile hops, or None.

    Hops (e, u, v, r): one tile of expert e moves from u to v; r is -1 for a hop onto an existing
    replica, else the redundant slot of v bound to e (a copy). The chain starts at a worker with
    the max load T_max, ends at a worker c with T_c <= T_max - 2 and passes through workers that
    each take one tile and give one, so it lowers one max load by one tile, raises c to at most
    T_max - 1 and keeps every other load: the sorted load vector decreases lexicographically.

    Breadth-first search over workers, each visited once. Level 0: every worker at T_max, in
    increasing index. A level is expanded in increasing worker index, first over placement edges
    u -> v (some expert e with N[e, u] > theta has a replica on v), then, with ``slots`` (the safe
    slot of each worker, None where it has none), over copy edges u -> v (some e with
    N[e, u] > theta has no replica on v and v has a safe slot) from workers whose path holds no
    copy yet, so a chain makes at most one copy. A worker's parent is the first worker of the
    previous level, in that order, with an edge to it. The search stops at the first level that
    holds a worker c with T_c <= T_max - 2; c is the first of them by (load, copy on its path,
    index). Each hop moves the lowest-index expert of its edge. Hops move one tile, so a chain
    needs 1 > theta.
    """
    f = load.size
    if theta >= 1 or f < 2:
        return None
    t_max = int(load.max())
    if int(load.min()) > t_max - 2:
        return None
    parent = np.full(f, -1, np.int64)
    copied = np.zeros(f, bool)   # the path to the worker holds a copy
    via_copy = np.zeros(f, bool)  # the hop into the worker is the copy
    level = np.flatnonzero(load == t_max)
    seen = np.zeros(f, bool)
    seen[level] = True
    while level.size:
        found = []
        for u in level:
            new = np.flatnonzero(has[tiles[:, u] > theta].any(axis=0) & ~seen)
            parent[new], copied[new], seen[new] = u, copied[u], True
            found += new.tolist()
        if slots is not None:
            for u in level:
                if copied[u]:
                    continue
                movable = tiles[:, u] > theta
                for v in range(f):
                    if not seen[v] and slots[v] is not None and np.any(movable & ~has[:, v]):
                        parent[v], copied[v], via_copy[v], seen[v] = u, True, True, True
                        found.append(v)
        light = [v for v in found if load[v] <= t_max - 2]
        if light:
            c = min(light, key=lambda v: (int(load[v]), bool(copied[v]), v))
            hops = []
            while parent[c] >= 0:
                u = int(parent[c])
                movable = tiles[:, u] > theta
                if via_copy[c]:
                    hops.append((int(np.flatnonzero(movable & ~has[:, c])[0]), u, c, int(slots[c])))
                else:
                    hops.append((int(np.flatnonzero(movable & has[:, c])[0]), u, c, -1))
                c = u
            return hops[::-1]
        level = np.array(sorted(found), np.int64)
    return None


def safe_slot(c: int, tiles: np.ndarray, binding: np.ndarray, last_used: np.ndarray,
              blocked: np.ndarray) -> int | None:
    """The redundant slot of worker c a new replica may take, or None.

    Empty slots first (lowest index), else the least recently used slot whose expert has no
    tiles on c (ties: lowest index); never a blocked (protected or reserved) slot.
    """
    free = [r for r in range(binding.shape[1]) if binding[c, r] < 0 and not blocked[c, r]]
    if free:
        return free[0]
    idle = [r for r in range(binding.shape[1])
            if binding[c, r] >= 0 and not blocked[c, r] and tiles[binding[c, r], c] == 0]
    if not idle:
        return None
    return min(idle, key=lambda r: (int(last_used[c, r]), r))


def find_beyond_move(tiles: np.ndarray, load: np.ndarray, has: np.ndarray, binding: np.ndarray,
                     last_used: np.ndarray, blocked: np.ndarray,
                     theta: int) -> tuple[int, int, int, int, int] | None:
    """FindBeyondMove: (e, h, c, r, q) onto a new replica in slot r of c, or None."""
    donors, receivers = scan_orders(load)
    slots = {c: safe_slot(c, tiles, binding, last_used, blocked) for c in range(len(load))}
    for h in donors:
        movable = np.flatnonzero(tiles[:, h] > theta)
        if movable.size == 0:
            continue
        for c in receivers:
            half = (int(load[h]) - int(load[c])) // 2
            if half <= theta:
                break
            if slots[c] is None:
                continue
            experts = movable[~has[movable, c]]
            if experts.size == 0:
                continue
            q = np.minimum(tiles[experts, h], half)
            i = int(np.argmax(q))
            return int(experts[i]), h, c, slots[c], int(q[i])
    return None


def exposed_cost(max_copies_into_one_worker: int, copy_ms: float, window_ms: float) -> float:
    """O_t(Delta) = max(0, M(Delta) - W_t) in ms; copies into one worker serialise."""
    return max(0.0, float(max_copies_into_one_worker) * copy_ms - window_ms)


def fill_tokens(demand: np.ndarray, k: np.ndarray, tiles: np.ndarray, owner: np.ndarray,
                m_tile: int) -> np.ndarray:
    """int64[E, F] a: full tiles everywhere but one worker per expert, which takes the rest."""
    e_count, f = tiles.shape
    assignment = tiles * m_tile
    rows = np.arange(e_count)
    on_primary = tiles[rows, owner] > 0
    last = f - 1 - np.argmax(tiles[:, ::-1] > 0, axis=1)
    partial = np.where(on_primary, owner, last)
    busy = k > 0
    rows, partial = rows[busy], partial[busy]
    assignment[rows, partial] = demand[rows] - (k[rows] - tiles[rows, partial]) * m_tile
    return assignment


def _move_tiles(tiles: np.ndarray, load: np.ndarray, e: int, h: int, c: int, q: int) -> None:
    tiles[e, h] -= q
    tiles[e, c] += q
    load[h] -= q
    load[c] += q
