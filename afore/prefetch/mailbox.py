"""DemandMailbox: attention workers' demand vectors -> the scheduler, in shared memory.

One segment under /dev/shm, created and unlinked by the scheduler (the consumer); each
attention worker id writes its own lock-free single-producer ring (C++ atomics, ``afore._shm``).

Ordering and completeness: a worker reports targets in strictly increasing ``seq``
(``Target.seq``: the FFN execution order). The consumer hands out a target once all A workers
reported it, with the sum of their vectors, in seq order. A target that cannot complete any
more (a later target completed first, or its deadline passed) is dropped and counted as a miss;
the FFN side then runs it on the primary-only assignment (DESIGN.md invariant 5).

Full policy: ``put`` blocks up to ``timeout_s`` while the worker's ring is full, then drops the
report, counts it (``dropped_full``) and returns False; if the scheduler has not polled for a
second it drops at once. The ring only fills when the scheduler is stalled or gone; serving
goes on without plans. Complete targets wait for the scheduler in a queue of at most
``max_ready`` (oldest dropped beyond it: ``ready_overflow``); with ``run_lag`` (the service
uses num_microbatches), a complete target whose FFN stage has already run, because a worker
already reported seq + run_lag (the next layer of the same microbatch), is dropped instead of
planned (``ran_before_plan``). If the scheduler was restarted (the segment
was replaced), the producer re-attaches to the new segment and retries once.

Bad input (wrong length, negative counts, unknown worker/layer/microbatch, a duplicate or
out-of-order report of one worker) raises ValueError and is counted; nothing else is lost.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import msgspec
import numpy as np

from afore import _shm
from afore.config import ClusterShape
from afore.plan import Target


class DemandReport(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One worker's demand for one target: the message of both paths (shared memory, network).

    ``counts`` is int32[E] little-endian bytes (token-expert pairs per expert).
    """

    step: int
    layer: int
    microbatch: int
    worker: int
    counts: bytes

    @classmethod
    def make(cls, target: Target, worker: int, counts: np.ndarray) -> "DemandReport":
        return cls(target.step, target.layer, target.microbatch, worker,
                   np.ascontiguousarray(counts, dtype="<i4").tobytes())

    def counts_array(self) -> np.ndarray:
        if len(self.counts) % 4:
            raise ValueError(f"counts: expected a multiple of 4 bytes (int32), got {len(self.counts)}")
        return np.frombuffer(self.counts, dtype="<i4")


class CompleteDemand(NamedTuple):
    """A target whose demand all A workers reported. ``demand`` is int64[E]."""

    target: Target
    seq: int
    demand: np.ndarray


@dataclasses.dataclass(frozen=True)
class MissedTarget:
    """A target that got no complete demand: ``reason`` is "incomplete", "deadline" or "overflow"."""

    target: Target
    seq: int
    reported_workers: int
    reason: str


class DemandMailbox:
    """Consumer (scheduler) side: ``DemandMailbox.create``; producer side: ``DemandMailbox.attach``.

    Args of ``create``:
      name: segment name under /dev/shm (replaces a stale segment of a crashed run).
      shape: the pool's ClusterShape (num_experts, num_layers).
      num_producers: A, attention workers (<= 64).
      num_microbatches: microbatches per layer and step (defines ``Target.seq``).
      capacity: entries per worker ring (a report is one entry).
      deadline_s: a target still incomplete this long after its first report is dropped (0 = never).
      max_pending: incomplete targets kept at most; beyond it the oldest is dropped.
      max_ready: complete targets queued for the scheduler at most; beyond it the oldest is dropped.
      run_lag: drop a complete target once any worker reported seq + run_lag (0 = never).
    """

    def __init__(self, handle, shape: ClusterShape | None, num_microbatches: int, owner: bool, name: str):
        self._handle = handle
        self._owner = owner
        self.name = name
        self.shape = shape
        self.num_microbatches = num_microbatches
        self.last_stamps: tuple[int, int] = (0, 0)

    @classmethod
    def create(cls, name: str, shape: ClusterShape, num_producers: int, num_microbatches: int = 2,
               capacity: int = 256, deadline_s: float = 0.05, max_pending: int = 4096, max_ready: int = 64,
               run_lag: int = 0) -> "DemandMailbox":
        if not 1 <= num_producers <= 64:
            raise ValueError(f"num_producers: expected in [1, 64], got {num_producers}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches: expected >= 1, got {num_microbatches}")
        if not deadline_s >= 0:
            raise ValueError(f"deadline_s: expected >= 0, got {deadline_s}")
        if max_ready < 1:
            raise ValueError(f"max_ready: expected >= 1, got {max_ready}")
        if run_lag < 0:
            raise ValueError(f"run_lag: expected >= 0 (0 = never drop), got {run_lag}")
        handle = _shm.MailboxConsumer(name, num_producers, shape.num_experts, shape.num_layers, num_microbatches,
                                      capacity, int(deadline_s * 1e9), max_pending, max_ready, run_lag)
        return cls(handle, shape, num_microbatches, True, name)

    @classmethod
    def attach(cls, name: str) -> "DemandMailbox":
        handle = _shm.MailboxProducer(name)
        return cls(handle, None, handle.num_microbatches, False, name)

    # ---- producer side
    @property
    def num_producers(self) -> int:
        return int(self._info("num_producers"))

    @property
    def num_experts(self) -> int:
        return int(self._info("num_experts"))

    @property
    def num_layers(self) -> int:
        return int(self._info("num_layers"))

    def _info(self, key: str):
        return _shm.inspect(self.name)[key] if self._owner else getattr(self._handle, key)

    def put(self, target: Target, worker: int, counts, timeout_s: float = 0.01) -> bool:
        """Report worker ``worker``'s demand int32[E] for ``target``.

        Returns True when accepted, False when dropped because the ring stayed full for
        ``timeout_s``. Raises ValueError on bad input (counted in the segment).
        """
        if self._owner:
            raise ValueError("put: this handle is the consumer; producers use DemandMailbox.attach(name)")
        arr = _as_counts(counts)
        ok = self._handle.put(target.step, target.layer, target.microbatch, worker, arr, timeout_s)
        if not ok and self._handle.replaced():
            self._handle = _shm.MailboxProducer(self.name)  # the scheduler restarted: new segment
            ok = self._handle.put(target.step, target.layer, target.microbatch, worker, arr, timeout_s)
        return ok

    def put_report(self, report: DemandReport, timeout_s: float = 0.01) -> bool:
        """``put`` from the wire message (the demand receiver's path)."""
        return self.put(Target(report.step, report.layer, report.microbatch), report.worker,
                        report.counts_array(), timeout_s)

    # ---- consumer side
    def wait_complete(self, timeout_s: float, spin_s: float = 0.0) -> CompleteDemand | None:
        """The next complete target in seq order, or None after ``timeout_s``.

        ``spin_s``: busy-poll this long before sleeping (lowest latency; costs a core).
        ``last_stamps`` then holds (latest demand-written ns, target-complete ns), CLOCK_MONOTONIC.
        """
        if not self._owner:
            raise ValueError("wait_complete: this handle is a producer; the scheduler uses DemandMailbox.create")
        got = self._handle.wait_complete(timeout_s, spin_s)
        if got is None:
            return None
        seq, step, layer, microbatch, demand, written_ns, complete_ns = got
        self.last_stamps = (written_ns, complete_ns)
        return CompleteDemand(Target(step, layer, microbatch), seq, demand)

    def take_missed(self) -> list[MissedTarget]:
        """Targets dropped since the last call (incomplete, past deadline, or overflow)."""
        return [MissedTarget(Target(step, layer, mb), seq, reported, reason)
                for seq, step, layer, mb, reported, reason in self._handle.take_missed()]

    def stats(self) -> dict:
        """The segment's counters (see ``afore status``)."""
        return _shm.inspect(self.name)

    def close(self) -> None:
        """Consumer: mark closed and unlink the segment. Producer: drop the mapping."""
        if self._owner:
            self._handle.close()
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self.close()


def _as_counts(counts) -> np.ndarray:
    if isinstance(counts, np.ndarray) and counts.dtype == np.int32 and counts.ndim == 1 and counts.flags.c_contiguous:
        return counts  # what the emitter hands in: nothing to convert (length and signs: checked in C++)
    arr = counts if isinstance(counts, np.ndarray) else np.asarray(counts)
    if arr.dtype != np.int32:
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise ValueError("counts: expected finite integer counts")
        elif arr.dtype.kind not in "iu":
            raise ValueError(f"counts: expected integer counts, got dtype {arr.dtype}")
        if arr.size and (arr.max() > np.iinfo(np.int32).max or arr.min() < np.iinfo(np.int32).min):
            raise ValueError("counts: expected values that fit int32")
        arr = arr.astype(np.int32)
    if arr.ndim != 1:
        raise ValueError(f"counts: expected a 1-d vector, got shape {arr.shape}")
    return np.ascontiguousarray(arr)
