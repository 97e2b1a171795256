"""PlanSource: how an FFN worker gets the plan of a target.

``get(target, seq, timeout_s, demand) -> Plan | None``, for increasing ``seq``: a source hands each plan
to each worker once (the ring acknowledges it), so a worker keeps the plan it got. ``None`` means no valid plan in time (the
scheduler is late, dead, the plan was missed, stale or corrupted): the caller runs the target
on ``primary_only_plan`` and counts a miss (DESIGN.md invariant 5). ``misses`` counts them here
too, so a worker can report it.

- ``QueuePlanSource``: in-process (scheduler and FFN worker in one process; tests).
- ``RingPlanSource``: the shared-memory PlanRing of the scheduler service.
- ``ReplicatedPlanSource``: the worker plans each target itself (``afore serve --planner
  workers``): every FFN worker runs the same deterministic policy on the same inputs (the
  target's routed counts, which every worker has: it holds every attention worker's ids of the
  target) in the same target order, so every worker makes the same plan with no scheduler hop.
"""

from __future__ import annotations

import abc
import logging
import threading
import time

import numpy as np

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.plan import Plan, Target
from afore.scheduler.plan_ring import PlanRing

log = logging.getLogger("afore.migrator.plan_source")


class PlanSource(abc.ABC):
    """The FFN worker's view of the plans."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0

    #: True: the plan is made from the ``demand`` handed to ``get`` (the worker's routed counts)
    needs_demand = False

    @abc.abstractmethod
    def _get(self, target: Target, seq: int, timeout_s: float, demand: np.ndarray | None) -> Plan | None: ...

    def get(self, target: Target, seq: int, timeout_s: float, demand: np.ndarray | None = None) -> Plan | None:
        """The plan of ``target`` (sequence number ``seq``), or None after ``timeout_s``.
        ``demand``: int64[E], the target's routed counts (``needs_demand`` sources plan from it)."""
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s: expected >= 0, got {timeout_s}")
        plan = self._get(target, seq, timeout_s, demand)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
        return plan

    def close(self) -> None:
        pass


class QueuePlanSource(PlanSource):
    """In-process plans: the scheduler calls ``put(plan)``, workers ``get``; plans older than the
    newest asked-for seq are dropped, at most ``capacity`` are kept."""

    def __init__(self, capacity: int = 64):
        super().__init__()
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        self._plans: dict[int, Plan] = {}
        self._capacity = capacity
        self._cond = threading.Condition()
        self._closed = False

    def put(self, plan: Plan) -> None:
        with self._cond:
            if plan.seq in self._plans:
                raise ValueError(f"plan.seq: {plan.seq} was already published")
            self._plans[plan.seq] = plan
            while len(self._plans) > self._capacity:
                del self._plans[min(self._plans)]
            self._cond.notify_all()

    def _get(self, target: Target, seq: int, timeout_s: float, demand: np.ndarray | None) -> Plan | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                plan = self._plans.get(seq)
                if plan is not None:
                    return plan if plan.target == target else None
                # a later plan means this seq was skipped by the scheduler: no need to wait
                if self._closed or any(s > seq for s in self._plans):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class RingPlanSource(PlanSource):
    """Plans from the scheduler service's PlanRing, as reader ``reader_id`` (the worker's rank).

    ``spin_s``: busy-poll this long before sleeping while waiting (lowest latency, costs a core).
    A dead scheduler (pid gone, or heartbeat older than the ring's writer timeout) makes every
    ``get`` return None at once instead of after ``timeout_s``; when the scheduler restarts (its
    segment is replaced), the source re-attaches on a later miss (checked at most every
    ``REATTACH_EVERY_S``).
    """

    REATTACH_EVERY_S = 0.005

    def __init__(self, name: str, reader_id: int, shape: ClusterShape, spin_s: float = 0.0, wait_for_writer: bool = False):
        """``wait_for_writer``: the ring may not exist yet (its writer starts after this worker:
        ``afore serve --planner attention``, where vLLM's worker process writes it); until it
        does, every ``get`` misses at once and the source tries to attach again."""
        super().__init__()
        self.name, self.reader_id, self.shape, self.spin_s = name, reader_id, shape, spin_s
        self.writer_dead_misses = 0  # targets that got no plan because the scheduler was dead
        self._next_reattach = 0.0
        self._rejected_before = 0
        try:
            self.ring: PlanRing | None = PlanRing.attach(name, reader_id, shape)
        except ValueError:
            if not wait_for_writer:
                raise
            self.ring = None

    @property
    def rejected(self) -> int:
        return self._rejected_before if self.ring is None else self.ring.rejected

    def _get(self, target: Target, seq: int, timeout_s: float, demand: np.ndarray | None) -> Plan | None:
        if self.ring is None:
            self._reattach()
            if self.ring is None:
                return None
        plan = self.ring.wait(seq, timeout_s, target, self.spin_s)  # returns at once if the writer is dead
        if plan is None:
            self.writer_dead_misses += self.ring.writer_dead
            now = time.monotonic()
            if now >= self._next_reattach:
                self._next_reattach = now + self.REATTACH_EVERY_S
                if self.ring.replaced():
                    self._reattach()
        return plan

    def attach(self) -> bool:
        """Join the ring now if this source has none yet (``wait_for_writer``); True once attached."""
        if self.ring is None:
            self._reattach()
        return self.ring is not None

    def _reattach(self) -> None:
        try:
            ring = PlanRing.attach(self.name, self.reader_id, self.shape)
        except ValueError:
            return  # no scheduler yet: keep missing, try again next time
        rejected = self.rejected
        if self.ring is not None:
            self.ring.close()
        self.ring = ring
        self.ring.rejected = rejected

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


class ReplicatedPlanSource(PlanSource):
    """Plans made here, by the policy ``policy`` (a name of ``afore.scheduler.policies``), from
    each target's routed counts: the replicated planner of ``afore serve --planner workers``.

    Every FFN worker holds one of these with the same policy, shape, params and cost, and asks it
    for every target in the same (sequence) order with the same demand: the policies are
    deterministic functions of that sequence, so every worker gets the same plan and no plan
    travels (no demand emission on the attention side, no scheduler process, no plan ring, no
    decoding). What the scheduler service follows online and a replica cannot, because the
    workers would see different values, stays fixed: the cost model (the calibration's window,
    not each worker's measured one). When the workers did not all apply a plan (a veto: the
    vote failed), their slot tables may no longer be the ones the policy projected; ``reset``
    starts the policy afresh on every worker at the same target (every worker sees the vote's
    outcome), and the worker empties its redundant slots to match (``FFNWorker._settle``).

    Plans must be asked for in increasing ``seq`` (a worker reads ahead at most one target):
    asking again for a seq already planned returns None (counted as a miss), never a second plan.
    """

    needs_demand = True

    def __init__(self, policy: str, shape: ClusterShape, params: SchedulerParams, cost: CostModel) -> None:
        super().__init__()
        from afore.scheduler.service import make_service_policy

        self.policy_name = policy
        self.policy = make_service_policy(policy, shape, params, cost)
        self.shape = shape
        self.last_seq = -1
        self.resets = 0
        self.switches = 0
        self.errors = 0
        self.plan_seconds = 0.0  # the last plan's policy time

    def _get(self, target: Target, seq: int, timeout_s: float, demand: np.ndarray | None) -> Plan | None:
        from afore.scheduler.policies import Observation

        if demand is None:
            raise ValueError("demand: expected the target's routed counts (int64[E]); the replicated planner plans from them")
        if demand.shape != (self.shape.num_experts,) or demand.dtype != np.int64:
            raise ValueError(f"demand: expected int64[{self.shape.num_experts}], got {demand.dtype}{list(demand.shape)}")
        if seq <= self.last_seq:
            return None
        self.last_seq = seq
        t0 = time.perf_counter()
        try:
            plan = self.policy.plan(Observation(target, seq, demand))
        except Exception:  # noqa: BLE001 - deterministic: every worker fails here, and all run primary-only
            self.errors += 1
            log.exception("policy %s failed on seq %d %s", self.policy_name, seq, target)
            return None
        self.plan_seconds = time.perf_counter() - t0
        return plan

    def switch(self, policy: str, through_seq: int) -> None:
        """Plan the targets after ``through_seq`` with a fresh ``policy`` (a policy switch, read
        from the policy board: ``afore.scheduler.policy_board``)."""
        from afore.scheduler.service import make_service_policy

        self.policy = make_service_policy(policy, self.shape, self.policy.params, self.policy.cost)
        self.policy_name = policy
        self.last_seq = through_seq
        self.switches += 1

    def reset(self, through_seq: int) -> None:
        """Forget every layer's state (empty slot tables, no history) after the target
        ``through_seq``: what every worker does at the same target after a failed vote. Plans
        made for later targets (read ahead) are void: they are asked for and made again."""
        self.policy.reset()
        self.last_seq = through_seq
        self.resets += 1
