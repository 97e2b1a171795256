"""The FFN workers' own slot tables, fed back to the scheduler when they drift from its projection.

The scheduler plans on a *projected* slot table: it assumes every plan it publishes runs with
all its copies. When the FFN workers do not apply a plan (agreement failed: one worker had no
plan in time, or refused it), the workers that prepared it keep its copies and the others never
make them, so the projection matches no worker and later plans that count on those replicas are
refused again and again. Here each worker reports its committed-and-pending redundant slots
(``Migrator.projected``: what it will hold once its submitted copies land) together with an
*epoch* it increments whenever a target ran without the scheduler's plan; the scheduler, seeing
a worker's epoch move, replaces that worker's row of every layer's slot table with the
reported one (``SchedulerService``), so its next plans build on what the workers hold.

Channel: ``/dev/shm/<plan ring>-slots``, created (and unlinked) by the scheduler service. One
record per FFN worker, written only by that worker (a seqlock: seq odd while writing):

    int64 seq | int64 epoch | int64 through_seq | int64 pad | int32 expert[L, R] (padded to 64 B)

``through_seq``: the last target the report covers. Plans the scheduler published after it and
that the worker had not prepared yet are not in the report: the scheduler may project a copy
twice or miss one until the pipeline (a few targets) has drained, after which the tables agree.
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from afore.scheduler.window_feedback import segment_path, unlink_segment

_HEADER = struct.Struct("<8sIIII")  # magic, version, workers, layers, slots
MAGIC, VERSION = b"AFSLOTS1", 1
HEADER_BYTES = 64
_FIELDS = 4  # int64 words before the table


def segment_name(ring: str) -> str:
    """The slot-sync segment of the plan ring ``ring``."""
    return f"{ring}-slots"


def _record_bytes(layers: int, slots: int) -> int:
    return -(-(8 * _FIELDS + 4 * layers * slots) // 64) * 64


class _Segment:
    def __init__(self, fd: int, size: int) -> None:
        self.map = mmap.mmap(fd, size)
        os.close(fd)

    def records(self, workers: int, layers: int, slots: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per worker: (int64[4] fields view, int32[L, R] table view)."""
        rb = _record_bytes(layers, slots)
        buf = np.frombuffer(self.map, dtype=np.uint8)
        out = []
        for w in range(workers):
            base = HEADER_BYTES + w * rb
            fields = buf[base:base + 8 * _FIELDS].view(np.int64)
            table = buf[base + 8 * _FIELDS:base + 8 * _FIELDS + 4 * layers * slots].view(np.int32).reshape(layers, slots)
            out.append((fields, table))
        return out


class SlotSync:
    """The scheduler's side: owns the segment; ``changed()`` yields reports whose epoch moved."""

    def __init__(self, name: str, workers: int, layers: int, slots: int) -> None:
        if min(workers, layers) < 1 or slots < 0:
            raise ValueError(f"shape: expected workers, layers >= 1 and slots >= 0, got {workers}, {layers}, {slots}")
        self.name, self.shape = name, (workers, layers, slots)
        path = segment_path(name)
        try:
            os.unlink(path)  # a crashed run's segment
        except FileNotFoundError:
            pass
        size = HEADER_BYTES + workers * _record_bytes(layers, slots)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        self._seg = _Segment(fd, size)
        self._seg.map[:_HEADER.size] = _HEADER.pack(MAGIC, VERSION, workers, layers, slots)
        self._records = self._seg.records(workers, layers, slots)
        self._seen = [0] * workers

    def changed(self) -> list[tuple[int, int, np.ndarray]]:
        """[(worker, through_seq, int32[L, R] table)] of the workers whose epoch moved since the
        last call (a consistent copy of each record; a record being written is left for later)."""
        out = []
        for w, (fields, table) in enumerate(self._records):
            seq = int(fields[0])
            if seq % 2 or int(fields[1]) == self._seen[w]:
                continue
            epoch, through, copy = int(fields[1]), int(fields[2]), table.copy()
            if int(fields[0]) != seq:  # written meanwhile: next time
                continue
            self._seen[w] = epoch
            out.append((w, through, copy))
        return out

    def close(self) -> None:
        if self._seg is None:
            return
        self._records = []
        self._seg.map.close()
        self._seg = None
        unlink_segment(self.name)


class SlotReporter:
    """An FFN worker's side: ``report(through_seq, tables)`` after a target ran without the
    scheduler's plan. No-op while the segment does not exist (no scheduler with slot sync)."""

    def __init__(self, name: str, worker: int, layers: int, slots: int) -> None:
        self.name, self.worker, self.layers, self.slots = name, worker, layers, slots
        self._fields = self._table = None
        self._seg = None
        self.epoch = 0

    @classmethod
    def for_ring(cls, ring: str, worker: int, layers: int, slots: int) -> "SlotReporter":
        return cls(segment_name(ring), worker, layers, slots)

    def _attach(self) -> bool:
        try:
            fd = os.open(segment_path(self.name), os.O_RDWR)
        except FileNotFoundError:
            return False
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            os.close(fd)
            return False
        seg = _Segment(fd, size)
        magic, version, workers, layers, slots = _HEADER.unpack(seg.map[:_HEADER.size])
        if magic != MAGIC or version != VERSION or (layers, slots) != (self.layers, self.slots) or self.worker >= workers:
            seg.map.close()
            raise ValueError(f"{self.name}: slot-sync segment for {workers} workers x {layers} layers x {slots} slots, "
                             f"this worker has {self.layers} layers x {self.slots} slots (worker {self.worker})")
        self._seg = seg
        self._fields, self._table = seg.records(workers, layers, slots)[self.worker]
        return True

    def report(self, through_seq: int, tables: dict[int, np.ndarray]) -> None:
        """``tables[layer]``: int32[R] expert of each redundant slot (-1 empty)."""
        if self._seg is None and not self._attach():
            return
        self.epoch += 1
        f = self._fields
        f[0] += 1  # odd: writing
        for layer, row in tables.items():
            self._table[layer] = row
        f[1], f[2] = self.epoch, through_seq
        f[0] += 1  # even: done

    def close(self) -> None:
        self._fields = self._table = None
        if self._seg is not None:
            self._seg.map.close()
            self._seg = None
