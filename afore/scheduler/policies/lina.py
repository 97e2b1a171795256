"""``lina``: replicate experts predicted hot from recent selections.

Source: Li et al., "Accelerating Distributed MoE Training and Inference with Lina", USENIX ATC
2023. Lina's inference scheduler estimates expert popularity from the recent selections of the
same layer (popularity is stable over nearby batches) and, ahead of the batch, replicates the
experts predicted hot onto the least loaded devices; tokens of a replicated expert are shared
evenly among its replicas.

Here the prediction is an exponential moving average (``alpha``, 0.5) of the previous demands
of the same layer; placement comes from the prediction (``replicate_predicted``, at most B new
replicas per target), the assignment covers the actual demand, split evenly over each expert's
replicas. Copies are issued ahead of the batch, so they overlap the in-flight microbatches:
exposed max(0, M(Delta) - W_t).
"""

from __future__ import annotations

import numpy as np

from afore.plan import Plan, SlotTable, Target
from afore.scheduler.policies.base import (LayerState, Policy, assemble_plan, bound_placement, even_split, overlapped_ms,
                                           register, replicate_predicted)


@register("lina")
class LinaPolicy(Policy):
    OPTIONS = {"alpha": 0.5}

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        alpha = self.options["alpha"]
        if not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) <= 1.0:
            raise ValueError(f"alpha: expected a number in (0, 1], got {alpha!r}")
        self.ema: dict[int, np.ndarray] = {}

    def reset(self) -> None:
        super().reset()
        self.ema.clear()

    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        shape = self.shape
        predicted = self.ema.get(target.layer)
        binding = state.table.expert.copy()
        if predicted is not None:
            binding = replicate_predicted(shape, predicted / shape.m_tile, state.table, state.protected(shape),
                                          self.params.copy_budget)
        alpha = float(self.options["alpha"])
        self.ema[target.layer] = demand.astype(np.float64) if predicted is None else alpha * demand + (1 - alpha) * predicted
        tiles = even_split(-(-demand // shape.m_tile), bound_placement(shape, binding), shape.primary_owner)
        plan, table = assemble_plan(shape, target, seq, demand, tiles, state.table, binding, 0.0)
        plan.exposed_ms = overlapped_ms(plan.copies, shape.num_workers, self.cost)
        return plan, table
