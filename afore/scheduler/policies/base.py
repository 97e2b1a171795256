"""The placement-policy interface: observations in, plans out, one small registry.

Shaped after vLLM's ``distributed/eplb`` (policy = small interface + registry, state apart from
execution). Every policy (static, EPLB, HarMoEny, Lina, Libra, AFORE and its ablations) runs
behind ``Policy.plan(Observation) -> Plan`` in the same runtime and the same benchmarks.

A policy keeps per-layer state (``LayerState``): the projected slot table C of that layer,
the last plan of that layer (its assignment is A[t-1]; its redundant slots with work are the
protected slots U[t] of the next target of the layer) and whatever history the policy needs.
Every plan a policy returns passes ``check_plan`` against the table it started from, and its
assignment covers the target's actual demand exactly, whatever the placement was planned from.
``Plan.exposed_ms`` is the copy time the policy puts on the critical path.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Callable, ClassVar

import numpy as np

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler import algorithm
from afore.plan import Plan, SlotTable, Target, check_plan, check_planning_types


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a policy sees for one target: its identity, order and demand (int[E] pairs per expert)."""

    target: Target
    seq: int
    demand: np.ndarray


@dataclasses.dataclass
class LayerState:
    """Per-layer state every policy keeps."""

    table: SlotTable
    last_plan: Plan | None = None
    # State handed in from outside (``Policy.set_state``, ``afore plan``) before the first plan:
    initial_protected: np.ndarray | None = None   # bool[F, R]
    initial_assignment: np.ndarray | None = None  # int32[E, F]

    def protected(self, shape: ClusterShape) -> np.ndarray:
        """bool[F, R] U[t]: redundant slots that have work in the last plan of this layer."""
        if self.last_plan is None and self.initial_protected is not None:
            return self.initial_protected.copy()
        return slots_with_work(shape, self.table, self.last_plan)

    @property
    def prev_assignment(self) -> np.ndarray | None:
        if self.last_plan is None:
            return self.initial_assignment
        return self.last_plan.assignment


def slots_with_work(shape: ClusterShape, table: SlotTable, plan: Plan | None) -> np.ndarray:
    """bool[F, R]: slot (w, r) holds an expert that has pairs on w in ``plan``."""
    if plan is None:
        return np.zeros((shape.num_workers, shape.redundant_slots), bool)
    expert, assignment, slot = table.expert, plan.assignment, plan.slot
    if _core_slots_with_work is not None and all(isinstance(a, np.ndarray) and a.dtype == np.int32 and a.flags.c_contiguous
                                                 for a in (expert, assignment, slot)):
        # the same in one C++ pass (the scheduler's critical path: every plan of every layer)
        return _core_slots_with_work(expert, assignment, slot, _primary_counts(shape))
    column, slot_ids = _redundant_slot_ids(shape)
    expert = table.expert
    flat = np.maximum(expert, 0) * shape.num_workers + column  # [e, w] of each slot's expert (unbound: masked)
    return (expert >= 0) & (np.take(plan.assignment, flat) > 0) & (np.take(plan.slot, flat) == slot_ids)


try:
    from afore._scheduler_core import slots_with_work as _core_slots_with_work
except ImportError:  # an older build of the core: the numpy expression serves alone
    _core_slots_with_work = None


@functools.lru_cache(maxsize=64)
def _primary_counts(shape: ClusterShape) -> np.ndarray:
    counts = np.ascontiguousarray(shape.primary_counts, dtype=np.int64)
    counts.flags.writeable = False
    return counts


@functools.lru_cache(maxsize=64)
def _redundant_slot_ids(shape: ClusterShape) -> tuple[np.ndarray, np.ndarray]:
    """(int64[F, 1] worker of each row, int64[F, R] physical slot P_w + r of each redundant slot)."""
    f, r = shape.num_workers, shape.redundant_slots
    column = np.arange(f, dtype=np.int64)[:, None]
    slot_ids = shape.primary_counts[:, None] + np.arange(r, dtype=np.int64)[None, :]
    column.flags.writeable = slot_ids.flags.writeable = False
    return column, slot_ids


def migration_ms(copies: np.ndarray | list, num_workers: int, cost: CostModel) -> float:
    """M(Delta) in ms: copies into one worker serialise, different workers copy in parallel."""
    rows = np.asarray(copies, np.int64).reshape(-1, 4)
    if rows.shape[0] == 0:
        return 0.0
    return float(np.bincount(rows[:, 2], minlength=num_workers).max()) * cost.copy_ms


def overlapped_ms(copies: np.ndarray | list, num_workers: int, cost: CostModel) -> float:
    """O_t(Delta) = max(0, M(Delta) - W_t): what the lookahead window does not hide."""
    return max(0.0, migration_ms(copies, num_workers, cost) - cost.window_ms)


class Policy(abc.ABC):
    """A placement policy. Subclasses implement ``_plan`` and declare their ``OPTIONS`` defaults."""

    name: ClassVar[str] = ""
    OPTIONS: ClassVar[dict[str, object]] = {}
    # Python policies run every plan through check_plan unless told otherwise (option
    # ``check_plans``); the C++ core is held to the reference by differential tests instead, and
    # check_plan costs more than planning at large EP (about 1.3 ms at F = 128).
    CHECK_BY_DEFAULT: ClassVar[bool] = True
    # At most params.copy_budget copies per target (B). EPLB re-lays whole layers at its period
    # and static never copies, so they declare False; ``afore plan`` writes it into the plan's
    # inputs ("budgeted"), where plan_verify reads it.
    BUDGETED: ClassVar[bool] = True

    def __init__(self, shape: ClusterShape, params: SchedulerParams, cost: CostModel, **options: object) -> None:
        check_planning_types(shape, params, cost)
        unknown = sorted(set(options) - set(self.OPTIONS) - {"check_plans"})
        if unknown:
            raise ValueError(f"options: {self.name} accepts {sorted(self.OPTIONS) or 'no options'}, got {unknown}")
        self.shape, self.params, self.cost = shape, params, cost
        self.check_plans = bool(options.pop("check_plans", self.CHECK_BY_DEFAULT))
        self.options = {**self.OPTIONS, **options}
        self.layers: dict[int, LayerState] = {}

    def layer(self, layer: int) -> LayerState:
        """The state of one MoE layer (created empty on first use)."""
        self.shape.check_layer(layer)
        if layer not in self.layers:
            self.layers[layer] = LayerState(SlotTable.empty(self.shape))
        return self.layers[layer]

    def plan(self, obs: Observation) -> Plan:
        """Plan one target and advance the layer's state."""
        if not isinstance(obs.target, Target):
            raise ValueError(f"target: expected a Target, got {type(obs.target).__name__}")
        seq = obs.seq
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)) or seq < 0:
            raise ValueError(f"seq: expected an integer >= 0, got {seq!r}")
        demand = self.shape.check_demand(obs.demand)
        state = self.layer(obs.target.layer)
        before = state.table
        plan, table = self._plan(obs.target, int(seq), demand, state)
        if self.check_plans:
            check_plan(self.shape, plan, before)
        state.table, state.last_plan = table, plan
        return plan

    def reset(self) -> None:
        """Forget all per-layer state (fresh slot tables, no history)."""
        self.layers.clear()

    def set_state(self, layer: int, table: SlotTable, protected: np.ndarray | None = None,
                  prev_assignment: np.ndarray | None = None) -> None:
        """Start ``layer`` from a given slot table, protected slots U and previous assignment A[t-1]
        (e.g. a state read by ``afore plan``); they apply until the layer's first plan."""
        f, r = self.shape.num_workers, self.shape.redundant_slots
        table.check(self.shape)
        if protected is not None:
            protected = np.asarray(protected)
            if protected.shape != (f, r) or protected.dtype != np.bool_:
                raise ValueError(f"protected: expected bool[{f}, {r}], got {protected.dtype}{list(protected.shape)}")
        if prev_assignment is not None:
            prev_assignment = np.asarray(prev_assignment)
            if prev_assignment.shape != (self.shape.num_experts, f) or prev_assignment.dtype.kind not in "iu" or np.any(prev_assignment < 0):
                raise ValueError(f"prev_assignment: expected non-negative int[{self.shape.num_experts}, {f}], got {prev_assignment.dtype}{list(prev_assignment.shape)}")
            prev_assignment = prev_assignment.astype(np.int32)
        self.shape.check_layer(layer)
        self.layers[layer] = LayerState(table.copy(), None, protected, prev_assignment)

    @abc.abstractmethod
    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        """Return (plan, projected slot table after it) for one validated target."""


REGISTRY: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator adding a policy to the registry under ``name``."""
    def deco(cls: type[Policy]) -> type[Policy]:
        if name in REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        REGISTRY[name] = cls
        return cls
    return deco


def make_policy(name: str, shape: ClusterShape, params: SchedulerParams, cost: CostModel, **options: object) -> Policy:
    """A fresh policy by registry name; ValueError listing the names for an unknown one."""
    if name not in REGISTRY:
        raise ValueError(f"policy: expected one of {sorted(REGISTRY)}, got {name!r}")
    return REGISTRY[name](shape, params, cost, **options)


# ---- building blocks shared by the baseline policies -------------------------------------------

def scheduler_fn(impl: object) -> Callable:
    """Algorithm 1 implementation: "core" (C++, production) or "reference" (Python)."""
    if impl == "core":
        from afore.scheduler import core
        return core.schedule
    if impl == "reference":
        return algorithm.schedule
    raise ValueError(f"impl: expected 'core' or 'reference', got {impl!r}")


def assign_over_placement(schedule: Callable, shape: ClusterShape, demand: np.ndarray, table: SlotTable,
                          prev_assignment: np.ndarray | None, params: SchedulerParams, cost: CostModel,
                          target: Target, seq: int) -> tuple[Plan, SlotTable]:
    """Balance ``demand`` over a fixed placement (primaries + ``table``): Algorithm 1's assignment
    initialisation and within-placement rebalancing, no copies (copy budget 0)."""
    no_copies = SchedulerParams(theta=params.theta, copy_budget=0, chains=params.chains)
    protected = np.zeros((shape.num_workers, shape.redundant_slots), bool)
    return schedule(shape, demand, table, protected, prev_assignment, no_copies, cost, target, seq)


def even_split(k: np.ndarray, has: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """int64[E, F]: k_e tiles split as evenly as possible over e's replicas (extras: primary
    first, then lower worker index), as a static per-replica routing weight would."""
    e_count, f = has.shape
    tiles = np.zeros((e_count, f), np.int64)
    for e in np.flatnonzero(k):
        workers = np.flatnonzero(has[e])
        order = [int(owner[e])] + [int(w) for w in workers if w != owner[e]]
        base, extra = divmod(int(k[e]), len(order))
        for i, w in enumerate(order):
            tiles[e, w] = base + (1 if i < extra else 0)
    return tiles


def bound_placement(shape: ClusterShape, binding: np.ndarray) -> np.ndarray:
    """bool[E, F] x[e, w] for the primaries plus the redundant bindings ``binding`` int[F, R]."""
    return algorithm.placement(shape.primary_owner, binding, shape.num_experts)


def free_slot(binding: np.ndarray, last_used: np.ndarray, blocked: np.ndarray, tiles: np.ndarray, w: int) -> int | None:
    """A redundant slot of worker w a new replica may take: empty first (lowest index), else the
    least recently used slot whose expert has no tiles on w; never a blocked slot."""
    return algorithm.safe_slot(w, tiles, binding, last_used, blocked)


def assemble_plan(shape: ClusterShape, target: Target, seq: int, demand: np.ndarray, tiles: np.ndarray,
                  table_before: SlotTable, binding: np.ndarray, exposed_ms: float, gain_ms: float = 0.0) -> tuple[Plan, SlotTable]:
    """Plan and projected table from tiles N[e, w] over the placement primaries + ``binding``.

    Copies are the bindings of ``binding`` that ``table_before`` lacks (source: the primary);
    tokens fill the tiles with at most one partial tile per expert; ``last_used`` becomes seq
    for every redundant slot with work.
    """
    e_count, f = shape.num_experts, shape.num_workers
    owner, pcount = shape.primary_owner, shape.primary_counts
    k = -(-demand // shape.m_tile)
    assignment = algorithm.fill_tokens(demand, k, tiles, owner, shape.m_tile)
    slot = np.full((e_count, f), -1, np.int32)
    slot[np.arange(e_count), owner] = shape.primary_slot
    last_used = table_before.last_used.copy()
    copies = []
    for w, r in zip(*np.nonzero(binding >= 0)):
        e = int(binding[w, r])
        slot[e, w] = pcount[w] + r
        if tiles[e, w] > 0:
            last_used[w, r] = seq
        if table_before.expert[w, r] != e:
            copies.append((e, int(owner[e]), int(w), int(pcount[w] + r)))
    plan = Plan(target=target, seq=seq, demand=demand.copy(), replicas=slot >= 0,
                assignment=assignment.astype(np.int32), tiles=tiles.astype(np.int32), slot=slot,
                copies=np.array(copies, np.int32).reshape(-1, 4), tile_load=tiles.sum(axis=0).astype(np.int32),
                gain_ms=float(gain_ms), exposed_ms=float(exposed_ms))
    return plan, SlotTable(binding.astype(np.int32), last_used)


def replicate_predicted(shape: ClusterShape, predicted_tiles: np.ndarray, table: SlotTable, protected: np.ndarray,
                        budget: int) -> np.ndarray:
    """New bindings int32[F, R]: replicas of experts predicted hot, for predictive policies.

    Estimated load spreads each expert's predicted tiles evenly over its replicas. Up to
    ``budget`` times: take the expert with the largest share on the most loaded worker and add a
    replica on the least loaded worker that lacks it and has a safe slot (unprotected, not
    reserved in this call; empty first, else the one whose expert has the least predicted work
    there, then least recently used); keep the replica only if the estimated maximum load drops.
    """
    kp = np.asarray(predicted_tiles, np.float64)
    binding = table.expert.copy()
    reserved = np.zeros_like(protected)
    has = bound_placement(shape, binding)

    def loads(has_: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        share = np.where(has_, (kp / has_.sum(axis=1))[:, None], 0.0)
        return share, share.sum(axis=0)

    share, load = loads(has)
    for _ in range(budget):
        h = int(np.argmax(load))
        candidates = np.flatnonzero(share[:, h] > 0)
        if candidates.size == 0:
            break
        e = int(candidates[np.argmax(share[candidates, h])])
        best = None
        for c in np.argsort(load, kind="stable"):
            if has[e, c]:
                continue
            r = _evictable_slot(binding, table.last_used, protected | reserved, share, int(c))
            if r is not None:
                best = (int(c), r)
                break
        if best is None:
            break
        c, r = best
        trial = has.copy()
        old = int(binding[c, r])
        if old >= 0:
            trial[old, c] = False
        trial[e, c] = True
        new_share, new_load = loads(trial)
        if new_load.max() >= load.max() - 1e-9:
            break
        binding[c, r] = e
        reserved[c, r] = True
        has, share, load = trial, new_share, new_load
    return binding


def _evictable_slot(binding: np.ndarray, last_used: np.ndarray, blocked: np.ndarray, share: np.ndarray, w: int) -> int | None:
    """Slot of worker w for a predicted replica: empty first, else least predicted work, then LRU."""
    slots = [r for r in range(binding.shape[1]) if not blocked[w, r]]
    if not slots:
        return None
    return min(slots, key=lambda r: (binding[w, r] >= 0, 0.0 if binding[w, r] < 0 else share[binding[w, r], w],
                                     int(last_used[w, r]), r))
