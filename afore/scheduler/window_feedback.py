"""The FFN workers' measured lookahead windows, fed back to the running scheduler.

The window W_t (copy submission -> commit of the same target, measured by each worker's
migrator) decides how much of a copy list is exposed, O_t = max(0, M(Delta) - W_t). The
scheduler starts from the calibration's window and follows the measured one online.

Channel: a tiny shared-memory segment ``/dev/shm/<plan ring>-window`` created (and unlinked) by
the scheduler service next to its plan ring. One 64-byte record per FFN worker, written only by
that worker (a seqlock: seq odd while writing, even when done), read by the scheduler:

    int64 seq | int64 count | float64 ewma_ms | int64 updated_ns (CLOCK_MONOTONIC) | padding

Workers report every resolved window (``WindowReporter.report``, a few hundred ns); the
scheduler reads all records at most every ``period_s`` and plans with the smallest recent
worker EWMA (copies into each worker must fit in that worker's window, so the tightest one
bounds the exposure). Any value is safe: the window only moves the gain of a copy, never the
validity of a plan. Records not updated for ``stale_s`` (a dead or idle worker) are ignored.

FFN worker hook (two lines; ``afore/ffn/worker.py``):

    self.window_reporter = WindowReporter.for_ring(cfg.plan_ring, cfg.rank)   # once, at start
    self.window_reporter.report(record.window_ms)        # for each MigrationRecord drained
"""

from __future__ import annotations

import mmap
import os
import struct
import time

import numpy as np

RECORD_BYTES = 64
_MAGIC = struct.Struct("<8sII")  # magic, version, number of records
MAGIC, VERSION = b"AFWINDOW", 1
HEADER_BYTES = 64
EWMA_ALPHA = 0.2  # weight of the newest window: a few targets follow a shift, one outlier does not


def segment_name(ring: str) -> str:
    """The feedback segment of the plan ring ``ring``."""
    return f"{ring}-window"


def segment_path(name: str) -> str:
    """/dev/shm/<name>; ValueError for a name that is not a plain segment name."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"name: expected a segment name without '/', got {name!r}")
    return f"/dev/shm/{name}"


def unlink_segment(name: str) -> None:
    """Remove /dev/shm/<name> if it is there (an owner's close; a killed owner's leftovers)."""
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass


def _monotonic_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class WindowFeedback:
    """The scheduler's side: owns the segment; ``window_ms()`` is the value to plan with."""

    def __init__(self, name: str, num_workers: int, stale_s: float = 5.0, period_s: float = 0.1):
        if num_workers < 1:
            raise ValueError(f"num_workers: expected >= 1, got {num_workers}")
        self.name, self.num_workers, self.stale_s, self.period_s = name, num_workers, stale_s, period_s
        path = segment_path(name)
        size = HEADER_BYTES + RECORD_BYTES * num_workers
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)  # replaces a crashed run's
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._records = np.ndarray((num_workers, RECORD_BYTES // 8), np.int64, self._map, HEADER_BYTES)
        self._records[:] = 0
        _MAGIC.pack_into(self._map, 0, MAGIC, VERSION, num_workers)
        self._last_read = 0.0
        self._value: float | None = None

    def window_ms(self) -> float | None:
        """The smallest EWMA among workers that reported within ``stale_s``; None if none did.

        Reads the segment at most every ``period_s`` (cached in between).
        """
        now = time.monotonic()
        if now - self._last_read < self.period_s:
            return self._value
        self._last_read = now
        fresh_after = _monotonic_ns() - int(self.stale_s * 1e9)
        values = []
        for w in range(self.num_workers):
            got = self._read(w)
            if got is not None and got[1] >= fresh_after:
                values.append(got[0])
        self._value = min(values) if values else None
        return self._value

    def _read(self, worker: int) -> tuple[float, int] | None:
        rec = self._records[worker]
        for _ in range(4):
            seq = int(rec[0])
            if seq % 2:
                continue  # a write in progress: try again
            count, ewma_bits, updated = int(rec[1]), int(rec[2]), int(rec[3])
            if int(rec[0]) == seq:
                if count == 0:
                    return None
                return float(np.int64(ewma_bits).view(np.float64)), updated
        return None

    def close(self) -> None:
        if self._map is None:
            return
        self._records = None
        self._map.close()
        self._map = None
        unlink_segment(self.name)


class WindowReporter:
    """An FFN worker's side: writes its own record; a no-op while there is no segment."""

    def __init__(self, name: str, worker: int, retry_s: float = 1.0):
        if worker < 0:
            raise ValueError(f"worker: expected >= 0, got {worker}")
        self.name, self.worker, self.retry_s = name, worker, retry_s
        self._record: np.ndarray | None = None
        self._map: mmap.mmap | None = None
        self._next_try = 0.0
        self._ewma: float | None = None
        self._inode = -1
        self.reported = 0

    @classmethod
    def for_ring(cls, ring: str, worker: int) -> "WindowReporter":
        """The reporter of plan ring ``ring`` (``""``: no scheduler, reports go nowhere)."""
        return cls(segment_name(ring) if ring else "", worker)

    def report(self, window_ms: float) -> None:
        """Record one measured lookahead window (ms) of this worker."""
        if not self.name or not (window_ms >= 0 and window_ms < float("inf")):
            return
        if self._record is not None and time.monotonic() >= self._next_try:
            self._next_try = time.monotonic() + self.retry_s
            if not self._same_segment():  # the scheduler restarted: its new segment, next time
                self.close()
        if self._record is None and not self._attach():
            return
        self._ewma = window_ms if self._ewma is None else EWMA_ALPHA * window_ms + (1 - EWMA_ALPHA) * self._ewma
        rec = self._record
        rec[0] += 1  # odd: writing
        rec[1] += 1
        rec[2] = np.float64(self._ewma).view(np.int64)
        rec[3] = _monotonic_ns()
        rec[0] += 1  # even: done
        self.reported += 1

    def _attach(self) -> bool:
        now = time.monotonic()
        if now < self._next_try:
            return False
        self._next_try = now + self.retry_s
        try:
            fd = os.open(segment_path(self.name), os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                return False
            m = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, workers = _MAGIC.unpack_from(m, 0)
        if magic != MAGIC or version != VERSION or self.worker >= workers or size < HEADER_BYTES + RECORD_BYTES * workers:
            m.close()
            return False
        self._map, self._inode = m, os.stat(segment_path(self.name)).st_ino
        self._record = np.ndarray((RECORD_BYTES // 8,), np.int64, m, HEADER_BYTES + RECORD_BYTES * self.worker)
        return True

    def _same_segment(self) -> bool:
        try:
            return os.stat(segment_path(self.name)).st_ino == self._inode
        except FileNotFoundError:
            return False

    def close(self) -> None:
        self._record = None
        if self._map is not None:
            self._map.close()
            self._map = None
