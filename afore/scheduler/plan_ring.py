"""PlanRing: the scheduler publishes each plan once; every FFN worker copies it.

Shared memory under /dev/shm (C++ atomics, ``afore._shm``): one writer, F readers, N slots.
An entry is reused only after every live reader acknowledged it; a reader whose process is
gone, or that did not call ``read`` for ``liveness_timeout_s`` while holding the writer up, is
evicted and cannot block the writer longer than that (DESIGN.md invariant 4). An evicted
reader rejoins at the newest entry on its next read (the plans in between are misses).

The writer can die as well (invariant 5): a reader that finds nothing new checks the writer's
pid and, when the ring was created with ``writer_timeout_s``, the writer's heartbeat
(``heartbeat()``, called by an idle scheduler); ``read``/``wait`` then return None at once and
``writer_dead`` is True, so a dead scheduler costs no plan timeout per target.

Entries are ``plan_codec`` bytes: version, target, seq, checksum and the int32 body. A reader
rejects (returns None and counts) stale, out-of-order, torn or corrupted plans and plans whose
target does not match the one asked for (invariant 3).
"""

from __future__ import annotations

import logging
import time

from afore import _shm
from afore.config import ClusterShape
from afore.plan import Plan, Target
from afore.scheduler.plan_codec import decode_worker_plan, encode_plan, max_encoded_length

log = logging.getLogger(__name__)


class PublishTimeout(RuntimeError):
    """Live readers still held the slot after the publish timeout."""


class PlanRing:
    """Writer: ``PlanRing.create(name, shape, num_readers)``; reader: ``PlanRing.attach(name, reader_id, shape)``."""

    def __init__(self, handle, shape: ClusterShape, writer: bool, name: str):
        self._handle = handle
        self.shape = shape
        self.writer = writer
        self.name = name
        self.rejected = 0
        self.last_copied_ns = 0
        self.writer_dead = False  # reader: the last read found the writer gone (no plan is coming)

    @classmethod
    def create(cls, name: str, shape: ClusterShape, num_readers: int | None = None, num_slots: int = 16,
               liveness_timeout_s: float = 1.0, pid_check: bool = True, max_copies: int | None = None,
               writer_timeout_s: float = 0.0) -> "PlanRing":
        """Create (or replace a stale) ring for plans of ``shape``; readers default to F workers.

        ``pid_check``: treat a reader (and, on the readers' side, the writer) whose pid is gone as
        dead (needs a shared pid namespace). ``writer_timeout_s``: readers also call the writer
        dead once its heartbeat is older than this (s; 0 = pid only); the writer then calls
        ``heartbeat()`` at least that often while it has nothing to publish.
        """
        readers = shape.num_workers if num_readers is None else num_readers
        if not liveness_timeout_s >= 0.001:
            raise ValueError(f"liveness_timeout_s: expected >= 0.001, got {liveness_timeout_s}")
        if not 0 <= writer_timeout_s <= 1e6:
            raise ValueError(f"writer_timeout_s: expected seconds in [0, 1e6] (0 = pid only), got {writer_timeout_s}")
        handle = _shm.RingWriter(name, readers, num_slots, max_encoded_length(shape, max_copies),
                                 int(liveness_timeout_s * 1e9), pid_check, int(writer_timeout_s * 1e9))
        return cls(handle, shape, True, name)

    @classmethod
    def attach(cls, name: str, reader_id: int, shape: ClusterShape) -> "PlanRing":
        """Join as reader ``reader_id`` (an FFN worker rank); starts at the newest entry."""
        if reader_id < 0:
            raise ValueError(f"reader_id: expected >= 0, got {reader_id}")
        return cls(_shm.RingReader(name, reader_id), shape, False, name)

    # ---- writer
    def publish(self, plan: Plan, timeout_s: float = 5.0) -> int:
        """Publish ``plan`` once (seqs strictly increase). Returns the entry index.

        Blocks while a live reader holds the slot, at most the liveness timeout for a dead one;
        raises PublishTimeout after ``timeout_s``.
        """
        return self.publish_bytes(encode_plan(plan), plan.target, plan.seq, timeout_s)

    def publish_bytes(self, data: bytes, target: Target, seq: int, timeout_s: float = 5.0) -> int:
        index = self._handle.publish(seq, target.step, target.layer, target.microbatch, data, timeout_s)
        if index < 0:
            raise PublishTimeout(f"plan ring {self.name}: live readers held the slot for seq {seq} beyond {timeout_s} s")
        return index

    def collect_latencies(self) -> list[tuple[int, int, int, int, int]]:
        """(seq, published_ns, all_copied_ns, readers_copied, readers_live) of entries acked by all live readers."""
        return self._handle.collect()

    def live_readers(self) -> int:
        return self._handle.live_readers()

    def heartbeat(self) -> None:
        """Writer: tell the readers it is alive while it has nothing to publish."""
        self._handle.heartbeat()

    # ---- reader
    def read(self, seq: int, target: Target | None = None) -> Plan | None:
        """The plan for ``seq`` if it is in the ring now, else None (not yet, missed or rejected)."""
        return self._decode(self._handle.read(seq, True), seq, target)

    def wait(self, seq: int, timeout_s: float, target: Target | None = None, spin_s: float = 0.0) -> Plan | None:
        """Like ``read`` but waits up to ``timeout_s`` for the plan to be published."""
        return self._decode(self._handle.wait_read(seq, timeout_s, spin_s, True), seq, target)

    def wait_raw(self, seq: int, timeout_s: float, spin_s: float = 0.0,
                 as_array: bool = False) -> tuple[int, int, bytes | None, int]:
        """(status, entry seq, payload, copied_ns) without decoding (benchmarks, stress tests).

        ``as_array``: the payload as the writable uint8 array the ring copied into (what ``read``
        decodes, without a second copy), else ``bytes``.

        status is ``_shm.FOUND``, ``NOT_YET``, ``MISSED`` (entry seq: the later plan that is
        there instead), ``CLOSED`` or ``WRITER_DEAD``.
        """
        status, entry_seq, _, _, _, payload, copied_ns = self._handle.wait_read(seq, timeout_s, spin_s, as_array)
        self.writer_dead = status == _shm.WRITER_DEAD
        return status, entry_seq, payload, copied_ns

    def replaced(self) -> bool:
        """True when the segment was closed or replaced (the scheduler restarted)."""
        return self._handle.replaced()

    def _decode(self, got, seq: int, target: Target | None) -> Plan | None:
        status, entry_seq, step, layer, microbatch, payload, copied_ns = got
        self.writer_dead = status == _shm.WRITER_DEAD
        if status != _shm.FOUND:
            return None
        self.last_copied_ns = copied_ns
        try:
            plan = decode_worker_plan(payload, self.shape)
            if plan.seq != seq or (step, layer, microbatch) != (plan.target.step, plan.target.layer, plan.target.microbatch):
                raise ValueError(f"plan: entry (seq {entry_seq}) does not match its payload (seq {plan.seq}, {plan.target})")
            if target is not None and plan.target != target:
                raise ValueError(f"plan.target: expected {target}, got {plan.target}")
        except ValueError as exc:
            self.rejected += 1
            self._handle.note_rejected()
            log.warning("plan ring %s: rejected plan for seq %d: %s", self.name, seq, exc)
            return None
        return plan

    def close(self) -> None:
        """Writer: mark closed and unlink. Reader: detach (the writer stops waiting for it)."""
        if self._handle is None:
            return
        if self.writer:
            self._handle.close()
        else:
            self._handle.detach()
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wait_for_segment(name: str, timeout_s: float) -> bool:
    """Wait until segment ``name`` exists and is ready (a reader starting before the scheduler)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if _shm.inspect(name)["state"] == "ready":
                return True
        except ValueError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
