"""Demand emission on the attention worker (paper step 1, Prefetch).

The per-target demand vector d[t, a] (int64[E]: token-expert pairs per expert)
is counted on the device (no host sync). Where it goes:

- the demand mailbox (shared memory) when the attention worker runs on the FFN node: on CPU at
  once; on a GPU the count is copied into pinned host memory with ``non_blocking=True`` and a
  CUDA event is recorded; a background thread waits for the event and puts the vector, so the
  forward pass never syncs on it;
- the FFN node's demand receiver over TCP (``afore.prefetch.receiver``) when it runs on another
  node: always from the background thread, which connects (and reconnects, at most once a
  second, e.g. after a policy switch restarted the scheduler) without ever blocking the forward.

Demand is advisory: a report that cannot be delivered is counted and dropped, and the FFN side
runs primary-only plans for that target.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import torch

from afore.routing import count_demand, count_host
from afore.plan import Target

log = logging.getLogger("afore.attention")


class _RemoteMailbox:
    """A DemandClient that connects on first use and again after a failure (at most once per
    ``retry_s``); ``put`` raises ConnectionError while it has no connection."""

    def __init__(self, address: str, token: str, retry_s: float = 1.0, connect_timeout_s: float = 2.0) -> None:
        from afore.attention.role import split_address

        self.host, self.port = split_address(address, "demand")
        self.token = token
        self.retry_s = retry_s
        self.connect_timeout_s = connect_timeout_s
        self._client = None
        self._next_try = 0.0

    def put(self, target: Target, worker: int, counts: np.ndarray) -> None:
        from afore.prefetch.receiver import DemandClient

        if self._client is None:
            if time.monotonic() < self._next_try:
                raise ConnectionError(f"demand receiver {self.host}:{self.port}: not connected (retrying)")
            try:
                self._client = DemandClient(self.host, self.port, self.token, timeout_s=self.connect_timeout_s,
                                            worker=worker)  # one attention worker per connection: bound
            except (OSError, ConnectionError, ValueError):
                # counted from the end of the attempt: a connect that hangs until its timeout
                # must not be retried at once
                self._next_try = time.monotonic() + self.retry_s
                raise
        try:
            self._client.put(target, worker, counts)
        except (OSError, ConnectionError):
            self.close()
            self._next_try = time.monotonic() + self.retry_s
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class DemandEmitter:
    """Puts d[t, a] for every target of this attention worker into the mailbox, or sends it to
    the FFN node's demand receiver (``demand`` = "host:port", token ``demand_token``)."""

    #: reports waiting for the background thread at most; beyond it new ones are dropped
    #: (counted in ``errors``): late demand is useless to the scheduler anyway
    MAX_QUEUED = 1024

    def __init__(self, mailbox_name: str, num_experts: int, worker: int, demand: str = "", demand_token: str = ""):
        self.num_experts = num_experts
        self.worker = worker
        self.emitted = 0
        self.errors = 0
        self._mailbox = None
        self._remote = False
        self._queue: queue.Queue | None = None
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # (pinned counts, event) of delivered reports
        if mailbox_name and demand:
            raise ValueError("mailbox_name, demand: expected one demand path, got both")
        if mailbox_name:
            from afore.prefetch.mailbox import DemandMailbox

            self._mailbox = DemandMailbox.attach(mailbox_name)
        elif demand:
            if not demand_token:
                raise ValueError("demand_token: expected the demand receiver's shared token (AFORE_DEMAND_TOKEN)")
            self._mailbox = _RemoteMailbox(demand, demand_token)
            self._remote = True

    @property
    def enabled(self) -> bool:
        return self._mailbox is not None

    def after_post(self) -> None:
        """Called once a layer call's targets are posted (the inline planner records its metrics
        there: afore.attention.planner); nothing to do here."""

    def emit(self, step: int, layer: int, microbatch: int, seq: int, topk_ids: torch.Tensor) -> None:
        if self._mailbox is None:
            return
        target = Target(step, layer, microbatch)
        if topk_ids.device.type == "cpu":  # int32 counts in numpy: what the mailbox stores, no torch op
            counts = count_host(topk_ids.numpy(), self.num_experts, np.int32)
            if self._remote:  # the network never runs on the forward path
                self._enqueue((target, seq, counts, None))
            else:
                self._put(target, seq, counts)
            return
        counts = count_demand(topk_ids, self.num_experts)
        host, event = self._staging(counts)
        host.copy_(counts, non_blocking=True)
        event.record()
        self._enqueue((target, seq, host, event))

    def _staging(self, counts: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event"]:
        """A pinned host buffer and an event for one report, reused once the background thread
        delivered the report it last carried (a pinned allocation per report cost the forward
        pass a cudaHostAlloc: ~0.3 ms per MoE layer measured on the H200)."""
        try:
            host, event = self._free.get_nowait()
            if host.shape == counts.shape and host.dtype == counts.dtype:
                return host, event
        except queue.Empty:
            pass
        return torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True), torch.cuda.Event()

    def _put(self, target: Target, seq: int, counts: np.ndarray) -> None:
        try:
            self._mailbox.put(target, self.worker, counts)
            self.emitted += 1
        except Exception as exc:  # the demand path is advisory: serving goes on with primary-only plans
            self.errors += 1
            if self.errors <= 3 or self.errors % 1000 == 0:
                log.warning("afore: demand for %s not delivered (%d so far): %s", target, self.errors, exc)

    def _enqueue(self, item: tuple) -> None:
        try:
            self._background().put_nowait(item)
        except queue.Full:
            self.errors += 1
            if self.errors <= 3 or self.errors % 1000 == 0:
                log.warning("afore: demand for %s dropped: %d reports already wait for delivery", item[0], self.MAX_QUEUED)

    def _background(self) -> queue.Queue:
        if self._queue is None:
            self._queue = queue.Queue(maxsize=self.MAX_QUEUED)
            threading.Thread(target=self._drain, name="afore-demand", daemon=True).start()
        return self._queue

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            target, seq, host, event = self._queue.get()
            if event is not None:
                event.synchronize()
            self._put(target, seq, host.numpy() if isinstance(host, torch.Tensor) else host)
            if event is not None:  # delivered (the mailbox and the client copy it): reusable
                self._free.put((host, event))
