"""Demand emission on the attention worker (paper step 1, Prefetch).

The per-target demand vector d[t, a] (int64[E]: token-expert pairs per expert)
is counted on the device with ``torch.bincount``. On CPU it is put into the
demand mailbox at once. On a GPU the count is copied into pinned host memory
with ``non_blocking=True`` and a CUDA event is recorded; a background thread
waits for the event and puts the vector, so the forward pass never syncs on it.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import torch

from afore.ffn.partition import bin_counts
from afore.scheduler.plan import Target

log = logging.getLogger("afore.attention")


def count_demand(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64[E] on the ids' device: how many token-expert pairs each expert got.

    Ids outside [0, E) (padding rows some routers mark with -1) are not counted.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    # bin_counts, not torch.bincount: bincount reads the maximum on the host (a CUDA sync)
    return bin_counts(torch.where(valid, flat, num_experts), num_experts + 1)[:num_experts]


class DemandEmitter:
    """Puts d[t, a] for every target of this attention worker into the mailbox."""

    def __init__(self, mailbox_name: str, num_experts: int, worker: int):
        self.num_experts = num_experts
        self.worker = worker
        self.emitted = 0
        self.errors = 0
        self._mailbox = None
        self._queue: queue.Queue | None = None
        if mailbox_name:
            from afore.prefetch.mailbox import DemandMailbox

            self._mailbox = DemandMailbox.attach(mailbox_name)

    @property
    def enabled(self) -> bool:
        return self._mailbox is not None

    def emit(self, step: int, layer: int, microbatch: int, seq: int, topk_ids: torch.Tensor) -> None:
        if self._mailbox is None:
            return
        counts = count_demand(topk_ids, self.num_experts)
        target = Target(step, layer, microbatch)
        if counts.device.type == "cuda":
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._background().put((target, seq, host, event))
        else:
            self._put(target, seq, counts.numpy())

    def _put(self, target: Target, seq: int, counts: np.ndarray) -> None:
        try:
            self._mailbox.put(target, self.worker, counts)
            self.emitted += 1
        except Exception as exc:  # the demand path is advisory: serving goes on with primary-only plans
            self.errors += 1
            if self.errors <= 3:
                log.warning("afore: demand for %s not delivered: %s", target, exc)

    def _background(self) -> queue.Queue:
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._drain, name="afore-demand", daemon=True).start()
        return self._queue

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            target, seq, host, event = self._queue.get()
            event.synchronize()
            self._put(target, seq, host.numpy())
