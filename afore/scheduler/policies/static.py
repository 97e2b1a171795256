"""``static``: fixed placement, never moves.

Source: the Static baseline of the AFORE paper (section 7.1): experts are spread evenly over the
FFN workers at start-up (afore's contiguous primary blocks) and the placement never changes;
every token-expert pair runs on its expert's primary and no copy is ever made. (Bindings already
in the slot table, e.g. handed in by ``afore plan``, stay bound but get no work.)
"""

from __future__ import annotations

import numpy as np

from afore.plan import Plan, SlotTable, Target
from afore.scheduler.policies.base import LayerState, Policy, assemble_plan, register


@register("static")
class StaticPolicy(Policy):
    BUDGETED = False

    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        shape = self.shape
        tiles = np.zeros((shape.num_experts, shape.num_workers), np.int64)
        tiles[np.arange(shape.num_experts), shape.primary_owner] = -(-demand // shape.m_tile)
        return assemble_plan(shape, target, seq, demand, tiles, state.table, state.table.expert.copy(), 0.0)
