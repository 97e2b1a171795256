"""``static``: fixed placement, never moves.

Source: the Static baseline of the AFORE paper (section 7.1): experts are spread evenly over the
FFN workers at start-up (afore's contiguous primary blocks) and the placement never changes;
every token-expert pair runs on its expert's primary. No redundant slot is ever used.
"""

from __future__ import annotations

import numpy as np

from afore.scheduler.plan import Plan, SlotTable, Target, primary_only_plan
from afore.scheduler.policies.base import LayerState, Policy, register


@register("static")
class StaticPolicy(Policy):
    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        plan = primary_only_plan(self.shape, demand, target, seq)
        plan.primary_only = False  # a policy decision, not the deadline fallback
        return plan, state.table.copy()
