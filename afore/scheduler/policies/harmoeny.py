"""``harmoeny``: reactive token redistribution with on-demand expert replicas.

Source: Doucet et al., "HarMoEny: Efficient Multi-GPU Inference of MoE Models", 2025
(github.com/sacs-epfl/HarMoEny). HarMoEny reacts to the routing observed at run time: after the
gate, its dynamic token redistribution moves tokens from overloaded GPUs to underloaded ones,
fetching the weights of the experts those tokens need onto the receiving GPU, so the load of
every GPU approaches the average.

Here, from the actual demand of the target: starting from the primaries, while the most loaded
worker h is above the average load ceil(sum k / F), its largest expert sends tiles to the least
loaded worker below the average, as many as both sides allow (down to the average on h, up to
it on c): onto an existing replica if c has one, else onto a new replica in a safe redundant
slot of c (empty first, else least recently used without work; never a protected slot), at
most B new replicas per target. Weights are fetched when the tokens arrive, so copies are on
the critical path: exposed_ms = M(Delta).
"""

from __future__ import annotations

import numpy as np

from afore.plan import Plan, SlotTable, Target
from afore.scheduler.policies.base import (LayerState, Policy, assemble_plan, bound_placement, free_slot, migration_ms,
                                           register)


@register("harmoeny")
class HarmoenyPolicy(Policy):
    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        shape = self.shape
        f = shape.num_workers
        owner = shape.primary_owner
        k = -(-demand // shape.m_tile)
        binding = state.table.expert.copy()
        has = bound_placement(shape, binding)
        tiles = np.zeros((shape.num_experts, f), np.int64)
        tiles[np.arange(shape.num_experts), owner] = k
        load = tiles.sum(axis=0)
        average = -(-int(k.sum()) // f)
        blocked = state.protected(shape).copy()
        copies = 0
        for _ in range(shape.num_experts * f):  # each round moves >= 1 tile or stops
            h = int(np.argmax(load))
            excess = int(load[h]) - average
            if excess <= 0:
                break
            moved = False
            for e in np.argsort(-tiles[:, h], kind="stable"):
                if tiles[e, h] == 0:
                    break
                receivers = [int(c) for c in np.argsort(load, kind="stable") if load[c] < average and c != h]
                # prefer a receiver that already holds e (no copy), else a new replica
                with_replica = [c for c in receivers if has[e, c]]
                c, slot = (with_replica[0], None) if with_replica else (None, None)
                if c is None and copies < self.params.copy_budget:
                    for cand in receivers:
                        r = free_slot(binding, state.table.last_used, blocked, tiles, cand)
                        if r is not None:
                            c, slot = cand, r
                            break
                if c is None:
                    continue
                q = min(int(tiles[e, h]), excess, average - int(load[c]))
                if slot is not None:
                    old = int(binding[c, slot])
                    if old >= 0:
                        has[old, c] = False
                    binding[c, slot] = e
                    has[e, c] = True
                    blocked[c, slot] = True
                    copies += 1
                tiles[e, h] -= q
                tiles[e, c] += q
                load[h] -= q
                load[c] += q
                moved = True
                break
            if not moved:
                break
        plan, table = assemble_plan(shape, target, seq, demand, tiles, state.table, binding, 0.0)
        plan.exposed_ms = migration_ms(plan.copies, f, self.cost)
        return plan, table
