"""``eplb`` and ``eplb-async``: DeepSeek's Expert-Parallelism Load Balancer, periodic.

Source: DeepSeek, "Expert Parallelism Load Balancer (EPLB)", github.com/deepseek-ai/EPLB (2025),
written here from its description, and vLLM's EPLB integration (``distributed/eplb``), which
re-runs it every N steps over a sliding window of recorded expert load and rearranges
synchronously (copies on the critical path) or, in its asynchronous mode, in the background.

EPLB's two steps, in afore's primary + redundant layout (primaries are fixed, each worker has R
redundant slots, so EPLB chooses the F * R redundant replicas):
1. Replication: give the next replica to the expert with the largest load per replica, until
   the F * R redundant slots are used (an expert is replicated at most F - 1 times).
2. Balanced packing: place the redundant replicas, heaviest (load / replicas) first, on the
   worker with the least estimated load that still has a free slot and does not already hold
   the expert (primaries count with their per-replica load). With ``num_nodes`` > 1 packing is
   hierarchical: replicas are first packed onto nodes (groups of consecutive workers), then
   onto the workers of each node, EPLB's hierarchical policy for node-local traffic.

Between rebalances the placement is fixed and every expert's tiles are split evenly over its
replicas (a static routing weight, so at most one partial tile per expert). A new layout is
applied slot by slot; a slot the running target reads (protected) keeps its expert until a
later target, so copies never overwrite a slot in use. ``eplb`` puts the whole copy time
M(Delta) on the critical path; ``eplb-async`` overlaps it (exposed max(0, M(Delta) - W_t)).

Options: ``window`` (observations of history, 64), ``period`` (rebalance every N observations of
a layer, 32), ``num_nodes`` (1).
"""

from __future__ import annotations

import collections

import numpy as np

from afore.config import ClusterShape
from afore.plan import Plan, SlotTable, Target
from afore.scheduler.policies.base import (LayerState, Policy, assemble_plan, bound_placement, even_split, migration_ms,
                                           overlapped_ms, register)


def replicate(load: np.ndarray, num_redundant: int, max_replicas: int) -> np.ndarray:
    """int64[E] replica counts: EPLB's rule, each extra replica to the max load-per-replica expert.

    Args:
      load: float[E] expected load per expert.
      num_redundant: replicas to add on top of one per expert.
      max_replicas: cap per expert (F: at most one replica per worker).
    """
    load = np.asarray(load, np.float64)
    counts = np.ones(load.shape[0], np.int64)
    for _ in range(num_redundant):
        per = np.where(counts < max_replicas, load / counts, -1.0)
        e = int(np.argmax(per))
        if per[e] <= 0:
            break
        counts[e] += 1
    return counts


def pack(shape: ClusterShape, load: np.ndarray, counts: np.ndarray, workers: np.ndarray, worker_load: np.ndarray,
         free: np.ndarray, items: list[int], hosts: np.ndarray) -> list[tuple[int, int]]:
    """Balanced packing of replica ``items`` (expert ids, heaviest first) onto ``workers``.

    worker_load float[F], free int[F] (free slots) and hosts bool[E, F] are updated in place.
    Returns (expert, worker) pairs; an item with no eligible worker is dropped.
    """
    placed = []
    for e in items:
        eligible = [w for w in workers if free[w] > 0 and not hosts[e, w]]
        if not eligible:
            continue
        w = min(eligible, key=lambda w: (worker_load[w], w))
        placed.append((e, int(w)))
        worker_load[w] += load[e] / counts[e]
        free[w] -= 1
        hosts[e, w] = True
    return placed


def rebalance(shape: ClusterShape, load: np.ndarray, num_nodes: int = 1) -> list[set[int]]:
    """EPLB for one layer: the desired set of redundant experts on each worker.

    Args:
      load: float[E] expert load averaged over the history window.
      num_nodes: nodes for hierarchical packing (must divide F); 1 = global packing.
    Returns: F sets of expert ids, each of size <= R.
    """
    e_count, f, r = shape.num_experts, shape.num_workers, shape.redundant_slots
    owner = shape.primary_owner
    counts = replicate(load, f * r, f)
    items = sorted((e for e in range(e_count) for _ in range(counts[e] - 1)),
                   key=lambda e: (-load[e] / counts[e], e))
    worker_load = np.bincount(owner, weights=load / counts, minlength=f).astype(np.float64)
    free = np.full(f, r, np.int64)
    hosts = np.zeros((e_count, f), bool)
    hosts[np.arange(e_count), owner] = True
    if num_nodes <= 1:
        placed = pack(shape, load, counts, np.arange(f), worker_load, free, items, hosts)
    else:
        per_node = f // num_nodes
        node_of = np.arange(f) // per_node
        node_load = np.bincount(node_of, weights=worker_load, minlength=num_nodes)
        node_free = np.full(num_nodes, per_node * r, np.int64)
        node_items: list[list[int]] = [[] for _ in range(num_nodes)]
        node_hosts = np.zeros((e_count, num_nodes), np.int64)
        np.add.at(node_hosts, (np.arange(e_count), node_of[owner]), 1)
        for e in items:  # step 1: replicas to nodes (a node can hold e at most once per worker)
            eligible = [n for n in range(num_nodes) if node_free[n] > 0 and node_hosts[e, n] < per_node]
            if not eligible:
                continue
            n = min(eligible, key=lambda n: (node_load[n], n))
            node_items[n].append(e)
            node_load[n] += load[e] / counts[e]
            node_free[n] -= 1
            node_hosts[e, n] += 1
        placed = []
        for n in range(num_nodes):  # step 2: within each node
            placed += pack(shape, load, counts, np.flatnonzero(node_of == n), worker_load, free, node_items[n], hosts)
    desired: list[set[int]] = [set() for _ in range(f)]
    for e, w in placed:
        desired[w].add(e)
    return desired


class _EplbState:
    def __init__(self, window: int) -> None:
        self.history: collections.deque[np.ndarray] = collections.deque(maxlen=window)
        self.observed = 0
        self.desired: list[set[int]] | None = None


@register("eplb")
class EplbPolicy(Policy):
    OPTIONS = {"window": 64, "period": 32, "num_nodes": 1}
    BUDGETED = False
    overlapped = False

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        for name in ("window", "period", "num_nodes"):
            value = self.options[name]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if self.shape.num_workers % self.options["num_nodes"]:
            raise ValueError(f"num_nodes: expected a divisor of num_workers ({self.shape.num_workers}), got {self.options['num_nodes']}")
        self.eplb: dict[int, _EplbState] = {}

    def reset(self) -> None:
        super().reset()
        self.eplb.clear()

    def _plan(self, target: Target, seq: int, demand: np.ndarray, state: LayerState) -> tuple[Plan, SlotTable]:
        shape = self.shape
        st = self.eplb.setdefault(target.layer, _EplbState(int(self.options["window"])))
        if st.history and st.observed % int(self.options["period"]) == 0:
            st.desired = rebalance(shape, np.mean(st.history, axis=0), int(self.options["num_nodes"]))
        st.history.append(demand.astype(np.float64))
        st.observed += 1
        binding = state.table.expert.copy()
        if st.desired is not None:
            binding = apply_layout(binding, st.desired, state.protected(shape))
        has = bound_placement(shape, binding)
        tiles = even_split(-(-demand // shape.m_tile), has, shape.primary_owner)
        plan, table = assemble_plan(shape, target, seq, demand, tiles, state.table, binding, 0.0)
        plan.exposed_ms = (overlapped_ms if self.overlapped else migration_ms)(plan.copies, shape.num_workers, self.cost)
        return plan, table


@register("eplb-async")
class EplbAsyncPolicy(EplbPolicy):
    overlapped = True


def apply_layout(binding: np.ndarray, desired: list[set[int]], protected: np.ndarray) -> np.ndarray:
    """Move ``binding`` int[F, R] towards the desired expert sets without touching protected slots.

    Slots already holding a desired expert keep it; other unprotected slots take the missing
    desired experts (lowest slot first) or are left as they are when nothing is missing.
    """
    out = binding.copy()
    for w, want in enumerate(desired):
        missing = sorted(want - {int(x) for x in out[w] if x >= 0})
        for r in range(out.shape[1]):
            if not missing:
                break
            if protected[w, r] or (out[w, r] >= 0 and int(out[w, r]) in want):
                continue
            out[w, r] = missing.pop(0)
    return out
