"""Algorithm 1 (with afore's ejection chains, ``SchedulerParams.chains``) through the C++ core
(``afore._scheduler_core``): the production path.

``schedule`` has the signature and the result of ``afore.scheduler.algorithm.schedule`` (all
arrays equal, ``gain_ms``/``exposed_ms`` equal) and validates the same inputs with the same
ValueErrors. Python work per call is kept to type and shape checks and wrapping the arrays the
core returns; values are validated in C++. One ``Scheduler`` (preallocated scratch) is kept per
cluster shape; calls are serialised by the GIL, which the core holds.

``scheduler_for(shape)`` exposes the core object, e.g. to time the core alone with
``scheduler_for(shape).schedule_bench(*core_arguments(...), repeats)`` (median ns per call).

Cost of the Python path over the core alone (measured with ``taskset -c 1``, timeit, 2026-11-30):
about 11 us per call at E=128, F=8 (18.6 us vs 7.4 us) and 15 us at F=128, of which about 6 us
is creating the eight result arrays in the binding, 2 us ``core_arguments`` and 1.3 us the Plan
and SlotTable objects; the rest is the call itself. Eight fresh numpy arrays per plan are
about the numpy floor (``np.empty`` alone: 0.5 us each).
"""

from __future__ import annotations

import functools

import numpy as np

from afore import _scheduler_core
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler import algorithm
from afore.plan import Plan, SlotTable, Target, check_planning_types

# Tile counts are below 2**31, so any theta >= 2**31 keeps every expert on its primary.
THETA_CAP = 2**31


@functools.lru_cache(maxsize=64)
def scheduler_for(shape: ClusterShape) -> _scheduler_core.Scheduler:
    """The C++ planner (with its scratch) for one cluster shape (its primary layout included)."""
    return _scheduler_core.Scheduler(shape.num_experts, shape.num_workers,
                                     shape.redundant_slots, shape.m_tile, list(shape.primaries))


def core_arguments(shape: ClusterShape, demand: object, table: SlotTable, protected: object,
                   prev_assignment: object, params: SchedulerParams, cost: CostModel,
                   target: Target, seq: int) -> tuple:
    """Check types and shapes and return the positional arguments of ``Scheduler.schedule``."""
    check_planning_types(shape, params, cost, target, seq, with_target=True)
    if not isinstance(table, SlotTable):
        raise ValueError(f"slot_table: expected a SlotTable, got {type(table).__name__}")
    e, f, r = shape.num_experts, shape.num_workers, shape.redundant_slots

    if isinstance(demand, np.ndarray) and demand.dtype == np.int64 and demand.shape == (e,):
        demand = np.ascontiguousarray(demand)
    else:  # the reference's checks: length, NaN, non-integer, negative
        demand = shape.check_demand(demand)
    expert = _matrix(table.expert, "slot_table.expert", (f, r), np.int32)
    last_used = _matrix(table.last_used, "slot_table.last_used", (f, r), np.int64)
    if isinstance(protected, np.ndarray) and protected.dtype == np.bool_ and protected.shape == (f, r):
        protected = np.ascontiguousarray(protected)
    else:
        protected = algorithm.check_protected(protected, (f, r))
    prev = None
    if prev_assignment is not None:
        prev = _matrix(prev_assignment, "prev_assignment", (e, f), np.int32)
    return (demand, expert, last_used, protected, prev, min(params.theta, THETA_CAP),
            min(params.copy_budget, f * r), cost.beta_tile_ms, cost.copy_ms, cost.window_ms,
            int(seq), bool(params.chains))


def schedule(shape: ClusterShape, demand: object, table: SlotTable, protected: object,
             prev_assignment: object, params: SchedulerParams, cost: CostModel,
             target: Target, seq: int) -> tuple[Plan, SlotTable]:
    """Plan one target with Algorithm 1 (C++). Same contract as ``algorithm.schedule``."""
    args = core_arguments(shape, demand, table, protected, prev_assignment, params, cost,
                          target, seq)
    return _core_plan(shape, args, target, seq)


def _core_plan(shape: ClusterShape, args: tuple, target: Target, seq: int) -> tuple[Plan, SlotTable]:
    """Run the core on ``Scheduler.schedule``'s positional ``args`` and wrap its arrays."""
    (replicas, assignment, tiles, slot, copies, tile_load, new_expert, new_last_used,
     gain_ms, exposed_ms) = scheduler_for(shape).schedule(*args)
    plan = Plan(target=target, seq=int(seq), demand=args[0].copy(), replicas=replicas,
                assignment=assignment, tiles=tiles, slot=slot, copies=copies,
                tile_load=tile_load, gain_ms=gain_ms, exposed_ms=exposed_ms)
    return plan, SlotTable(new_expert, new_last_used)


def schedule_validated(shape: ClusterShape, demand: np.ndarray, table: SlotTable, protected: np.ndarray,
                       prev_assignment: np.ndarray | None, params: SchedulerParams, cost: CostModel,
                       target: Target, seq: int) -> tuple[Plan, SlotTable]:
    """``schedule`` for a policy's own state (``AforePolicy``): demand int64[E] already checked
    (``Policy.plan``), the slot table, protected slots and previous assignment of its layer state
    (int32/int64/bool arrays of the shape, as the core returned them), params and cost checked at
    the policy's construction. Skips ``core_arguments``' type and shape checks (about 6 us per
    plan on the scheduler's critical path); the core still validates every value, and nanobind
    every dtype and contiguity."""
    args = (demand, table.expert, table.last_used, protected, prev_assignment, min(params.theta, THETA_CAP),
            min(params.copy_budget, shape.num_workers * shape.redundant_slots), cost.beta_tile_ms, cost.copy_ms,
            cost.window_ms, int(seq), bool(params.chains))
    return _core_plan(shape, args, target, seq)


def _matrix(value: object, field: str, expected: tuple[int, int], dtype: type) -> np.ndarray:
    """A C-contiguous integer matrix of the core's dtype; values are checked in C++."""
    if isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == expected:
        return np.ascontiguousarray(value)
    arr = algorithm.check_integer_matrix(value, field, expected)
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    if arr.size and (arr.min() < lo or arr.max() > hi):
        bad = arr[(arr < lo) | (arr > hi)][0]
        raise ValueError(f"{field}: expected values that fit {np.dtype(dtype).name}, got {int(bad)}")
    return arr.astype(dtype)
