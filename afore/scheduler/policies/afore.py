"""``afore``, ``afore-no-prefetch`` and ``afore-no-overlap``: Algorithm 1 and its two ablations.

Source: the AFORE paper, section 5.2 (Algorithm 1) and section 7.4 (ablations).

- ``afore`` plans each target from its own demand (prefetched from the attention side) with
  ``core.schedule``: protected slots are the redundant slots with work in the last plan of the
  same layer, the previous assignment is that plan's; copies overlap the in-flight microbatches,
  so only O_t = max(0, M(Delta) - W_t) is exposed.
- ``afore-no-prefetch`` does not see the target's demand: it plans the placement from the
  previous step's demand at the same layer and microbatch position, then assigns the actual
  demand over that placement (Algorithm 1 with no further copies).
- ``afore-no-overlap`` makes the same plans as ``afore`` but puts the copies on the critical
  path: exposed_ms = M(Delta).

Option ``impl``: "core" (C++, default) or "reference" (the Python specification).
"""

from __future__ import annotations

import numpy as np

from afore.plan import Plan, SlotTable, Target
from afore.scheduler.policies.base import (LayerState, Policy, assign_over_placement, migration_ms, register,
                                           scheduler_fn)


@register("afore")
class AforePolicy(Policy):
    OPTIONS = {"impl": "core"}
    CHECK_BY_DEFAULT = False

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self.schedule = scheduler_fn(self.options["impl"])
        self._validated = None
        if self.options["impl"] == "core":
            from afore.scheduler.core import schedule_validated

            self._validated = schedule_validated

    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        protected, prev = state.protected(self.shape), state.prev_assignment
        if self._validated is not None and _own_state(state, protected, prev):
            # the layer's state as the core made it: no need to check its types again
            return self._validated(self.shape, demand, state.table, protected, prev, self.params, self.cost, target, seq)
        return self.schedule(self.shape, demand, state.table, protected, prev, self.params, self.cost, target, seq)


def _own_state(state: LayerState, protected: np.ndarray, prev: np.ndarray | None) -> bool:
    """The layer state's arrays have the core's dtypes and are contiguous (always, unless a state
    was handed in from outside: ``Policy.set_state``, the slot resync)."""
    t = state.table
    return (t.expert.dtype == np.int32 and t.last_used.dtype == np.int64 and protected.dtype == np.bool_
            and t.expert.flags.c_contiguous and t.last_used.flags.c_contiguous and protected.flags.c_contiguous
            and (prev is None or (prev.dtype == np.int32 and prev.flags.c_contiguous)))


@register("afore-no-overlap")
class AforeNoOverlapPolicy(AforePolicy):
    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        plan, table = super()._plan(target, seq, demand, state)
        plan.exposed_ms = migration_ms(plan.copies, self.shape.num_workers, self.cost)
        return plan, table


@register("afore-no-prefetch")
class AforeNoPrefetchPolicy(AforePolicy):
    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self.previous_demand: dict[tuple[int, int], np.ndarray] = {}  # (layer, microbatch) -> demand

    def reset(self) -> None:
        super().reset()
        self.previous_demand.clear()

    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        key = (target.layer, target.microbatch)
        stale = self.previous_demand.get(key)
        self.previous_demand[key] = demand.copy()
        prev = state.prev_assignment
        if stale is None:
            return assign_over_placement(self.schedule, self.shape, demand, state.table, prev, self.params, self.cost, target, seq)
        guess, table = self.schedule(self.shape, stale, state.table, state.protected(self.shape), prev,
                                     self.params, self.cost, target, seq)
        # last_used must reflect actual work, not the guess: start from the table's own timestamps
        table = SlotTable(table.expert, state.table.last_used.copy())
        plan, table = assign_over_placement(self.schedule, self.shape, demand, table, prev, self.params, self.cost, target, seq)
        plan.copies, plan.exposed_ms, plan.gain_ms = guess.copies, guess.exposed_ms, guess.gain_ms
        return plan, table
