"""The attention worker plans its own targets (``afore serve --planner attention``).

With one attention worker the whole demand of a target is in that worker's hands the moment its
router has run: there is nothing to aggregate, so the scheduler process's hop (the demand into
the mailbox, a wake-up of the scheduler, its plan, the FFN worker's wait on the plan ring) only
adds latency to a path that is serial without ping-pong. Here the attention worker runs the
same scheduler service in-process (``SchedulerService`` without a mailbox: ``plan_now``), on the
routed counts of the target, and publishes the plan on the same plan ring *before* it posts the
target's tokens, so an FFN worker that wakes for the tokens finds the plan already there. The
FFN side is unchanged (``RingPlanSource``, the vote, the slot reports after a failed vote, the
measured-window feedback): the in-process service reads them as the scheduler process does.

Policy switches come through the policy board that ``afore serve`` writes
(``afore.scheduler.policy_board``), read before each plan; the switch starts the new policy
from empty redundant slots, as a restarted scheduler does (the FFN workers' slot reports then
re-sync its projection).

The metrics and the trace of each plan are recorded after the target's tokens are posted
(``after_post``), while the FFN workers compute, not before.

Measured on the 2-core CPU (the scheduler process against this, ``afore bench dataplane --part
transport --serve``): see bench/results/dataplane_transport_cpu_s18.md.
"""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import torch

from afore.plan import Target
from afore.routing import count_demand, count_host

log = logging.getLogger("afore.attention.planner")


class InlinePlanner:
    """The demand path of an attention worker that plans itself: ``emit`` plans and publishes.

    ``service_json``: the msgspec JSON of the ``afore.scheduler.service.ServiceConfig`` that the
    scheduler process would get (its ``mailbox`` empty); ``board``: the policy board's segment
    name ("" = none: the policy stays)."""

    def __init__(self, service_json: str, board: str = "") -> None:
        from afore.scheduler.service import SchedulerService, ServiceConfig

        config = msgspec.json.decode(service_json, type=ServiceConfig)
        if config.mailbox:
            raise ValueError(f"planner: the inline service takes no mailbox, got {config.mailbox!r}")
        self.config = config
        self.num_experts = config.shape.num_experts
        self.service = SchedulerService(config)
        self.policy = config.policy
        self.switches = 0
        self.emitted = 0
        self.errors = 0
        self._reader = None
        if board:
            from afore.scheduler.policy_board import PolicyReader

            self._reader = PolicyReader(board)
            self._follow_board()  # the board's current policy (a switch posted before this start)

    @property
    def enabled(self) -> bool:
        return True

    def emit(self, step: int, layer: int, microbatch: int, seq: int, topk_ids: torch.Tensor) -> None:
        """Plan target (step, layer, microbatch) = ``seq`` from its routed ids and publish the plan."""
        if self._reader is not None:
            self._follow_board()
        if topk_ids.device.type == "cpu":
            counts = count_host(topk_ids.numpy(), self.num_experts)
        else:  # ids only on a GPU (no shm host copy): one device-to-host copy of E counts
            counts = count_demand(topk_ids, self.num_experts).cpu().numpy().astype(np.int64)
        if self.service.plan_now(Target(step, layer, microbatch), seq, counts, bookkeeping=False):
            self.emitted += 1
        else:
            self.errors += 1

    def after_post(self) -> None:
        """The plans' metrics and the segments' bookkeeping, once the tokens are on their way."""
        try:
            self.service.bookkeeping()
        except Exception:  # noqa: BLE001 - metrics never fail a forward
            log.exception("planner bookkeeping failed")

    def _follow_board(self) -> None:
        change = self._reader.changed()
        if change is None:
            return
        epoch, policy = change
        if policy == self.policy:
            return  # the policy in force (the board's first read: the one this service started with)
        from afore.scheduler.metrics import SchedulerMetrics
        from afore.scheduler.service import make_service_policy

        c, service = self.config, self.service
        service.bookkeeping()  # the old policy's plans under its own label
        service.policy = make_service_policy(policy, c.shape, c.params, service.policy.cost)
        # the families carry the policy label, as a restarted scheduler's do; the segments'
        # counters go on from what the old families exported (no double count)
        old = service.metrics
        old.policy_gauge.set(0)
        service.metrics = SchedulerMetrics(None, c.ring, policy=policy, shape=c.shape)
        service.metrics._seen = old._seen
        self.policy = policy
        self.switches += 1
        log.info("afore: planning with policy %s (switch %d)", policy, epoch)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.service.close()
