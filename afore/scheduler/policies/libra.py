"""``libra``: predict the next layer's activations, prefetch replicas, redistribute by actual demand.

Source: Yang et al., "Libra: Effective yet Efficient Load Balancing for Large-scale MoE
Inference", ICLR 2026. Libra predicts the expert activations of layer l from the routing of
layer l-1 (expert choices of consecutive layers are strongly correlated), prefetches replicas of
the predicted hot experts while layer l-1 computes, and then balances the actual tokens of
layer l over the replicas that are in place.

Here the cross-layer predictor is learned online: for each layer l >= 1 a transition matrix
Tr[l][i, j] (EMA with ``alpha``, 0.2) of the co-activation of expert i at layer l-1 and expert j
at layer l, row-normalised, maps the normalised demand of layer l-1 in the same step and
microbatch to a predicted demand of layer l. Layer 0, or a layer without statistics yet, falls
back to the EMA of the same layer's previous demands. Placement comes from the prediction
(``replicate_predicted``, at most B new replicas per target); the assignment balances the actual
demand over that placement (Algorithm 1's initialisation and within-placement rebalancing, no
further copies). Copies are prefetched one layer ahead: exposed max(0, M(Delta) - W_t).
Option ``impl``: "core" or "reference" for the balancing step.
"""

from __future__ import annotations

import numpy as np

from afore.plan import Plan, SlotTable, Target
from afore.scheduler.policies.base import (LayerState, Policy, assign_over_placement, overlapped_ms, register,
                                           replicate_predicted, scheduler_fn)


@register("libra")
class LibraPolicy(Policy):
    OPTIONS = {"alpha": 0.2, "impl": "core"}

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        alpha = self.options["alpha"]
        if not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) <= 1.0:
            raise ValueError(f"alpha: expected a number in (0, 1], got {alpha!r}")
        self.schedule = scheduler_fn(self.options["impl"])
        self.transition: dict[int, np.ndarray] = {}        # layer l -> float[E, E] stats of (l-1 -> l)
        self.same_layer: dict[int, np.ndarray] = {}        # layer -> EMA of its demand
        self.recent: dict[tuple[int, int], tuple[int, np.ndarray]] = {}  # (layer, microbatch) -> (step, demand)

    def reset(self) -> None:
        super().reset()
        self.transition.clear()
        self.same_layer.clear()
        self.recent.clear()

    def predict(self, target: Target) -> np.ndarray | None:
        """float[E] predicted demand of ``target`` from what has been observed so far."""
        upstream = self.recent.get((target.layer - 1, target.microbatch))
        stats = self.transition.get(target.layer)
        if upstream is not None and upstream[0] == target.step and stats is not None:
            rows = stats.sum(axis=1, keepdims=True)
            probs = np.divide(stats, rows, out=np.zeros_like(stats), where=rows > 0)
            d = upstream[1]
            if d.sum() > 0:
                return (d / d.sum()) @ probs * d.sum()
        return self.same_layer.get(target.layer)

    def _learn(self, target: Target, demand: np.ndarray) -> None:
        alpha = float(self.options["alpha"])
        d = demand.astype(np.float64)
        ema = self.same_layer.get(target.layer)
        self.same_layer[target.layer] = d if ema is None else alpha * d + (1 - alpha) * ema
        upstream = self.recent.get((target.layer - 1, target.microbatch))
        if upstream is not None and upstream[0] == target.step and d.sum() > 0 and upstream[1].sum() > 0:
            co = np.outer(upstream[1] / upstream[1].sum(), d / d.sum())
            stats = self.transition.get(target.layer)
            self.transition[target.layer] = co if stats is None else alpha * co + (1 - alpha) * stats
        self.recent[(target.layer, target.microbatch)] = (target.step, d)

    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        shape = self.shape
        predicted = self.predict(target)
        table = state.table
        if predicted is not None:
            binding = replicate_predicted(shape, predicted / shape.m_tile, state.table, state.protected(shape),
                                          self.params.copy_budget)
            table = SlotTable(binding, state.table.last_used.copy())
        self._learn(target, demand)
        plan, table = assign_over_placement(self.schedule, shape, demand, table, state.prev_assignment,
                                            self.params, self.cost, target, seq)
        plan.copies = _copies(shape, state.table, table)
        plan.exposed_ms = overlapped_ms(plan.copies, shape.num_workers, self.cost)
        plan.gain_ms = 0.0
        return plan, table


def _copies(shape, before: SlotTable, after: SlotTable) -> np.ndarray:
    """int32[C, 4] (expert, primary, worker, physical slot) for every binding ``before`` lacks."""
    owner, pcount = shape.primary_owner, shape.primary_counts
    rows = [(int(after.expert[w, r]), int(owner[after.expert[w, r]]), int(w), int(pcount[w] + r))
            for w, r in zip(*np.nonzero((after.expert >= 0) & (after.expert != before.expert)))]
    return np.array(rows, np.int32).reshape(-1, 4)
