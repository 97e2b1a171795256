"""The policy in force, for FFN workers that plan themselves (``afore serve --planner workers``).

With the replicated planner there is no scheduler process to restart with another policy, so a
policy switch (``POST /afore/policy``) is a notice on this board: ``afore serve`` writes the new
policy's name with a new epoch, and every FFN worker reads the epoch before it plans a target
(a few hundred ns) and, when it moved, plans from then on with a fresh instance of the named
policy (``FFNWorker._follow_policy``). Workers see the notice at slightly different targets; a
target where they hold plans of different policies fails the vote (the plan digests differ), and
every worker restarts its planner at that target (``FFNWorker._restart_planner``), so once all of
them have seen the notice they plan from the same empty state again: a switch costs a few
primary-only targets, never a wrong one.

Channel: ``/dev/shm/<name>``, created (and unlinked) by ``afore serve``. One record, written only
by it (a seqlock: seq odd while writing):

    magic 8s | version u32 | pad u32 | int64 seq | int64 epoch | name 64 bytes (UTF-8, NUL-padded)
"""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np

from afore.scheduler.window_feedback import segment_path, unlink_segment

MAGIC, VERSION = b"AFPOLICY", 1
_HEADER = struct.Struct("<8sII")
NAME_BYTES = 64
SIZE = _HEADER.size + 16 + NAME_BYTES


class PolicyBoard:
    """The writer (``afore serve``): ``set(policy)`` posts a new epoch."""

    def __init__(self, name: str, policy: str) -> None:
        path = segment_path(name)
        self.name = name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)  # replaces a crashed run's
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, MAGIC, VERSION, 0)
        self._words = np.ndarray((2,), np.int64, self._map, _HEADER.size)
        self.epoch = 0
        self.set(policy)

    def set(self, policy: str) -> int:
        """Post ``policy`` (a name of ``afore.scheduler.policies``; checked by the caller) under a new
        epoch; returns the epoch."""
        raw = policy.encode()
        if not raw or len(raw) > NAME_BYTES:
            raise ValueError(f"policy: expected a name of 1 to {NAME_BYTES} bytes, got {policy!r}")
        self.epoch += 1
        w = self._words
        w[0] += 1  # odd: writing
        self._map[_HEADER.size + 16:SIZE] = raw.ljust(NAME_BYTES, b"\0")
        w[1] = self.epoch
        w[0] += 1  # even: done
        return self.epoch

    def close(self) -> None:
        if self._map is None:
            return
        self._words = None
        self._map.close()
        self._map = None
        unlink_segment(self.name)


class PolicyReader:
    """An FFN worker's side: ``changed()`` is the new (epoch, policy) once the epoch moved, else
    None; the first call reports the board's current policy."""

    def __init__(self, name: str) -> None:
        fd = os.open(segment_path(name), os.O_RDONLY)  # FileNotFoundError: no board (afore serve makes it first)
        try:
            size = os.fstat(fd).st_size
            if size < SIZE:
                raise ValueError(f"{name}: a policy board of {SIZE} bytes, got {size}")
            self._map = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, _ = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or version != VERSION:
            self._map.close()
            raise ValueError(f"{name}: not a policy board of version {VERSION}")
        self._words = np.ndarray((2,), np.int64, self._map, _HEADER.size)
        self.epoch = 0

    def changed(self) -> tuple[int, str] | None:
        w = self._words
        if int(w[1]) == self.epoch:  # the common case: one read
            return None
        for _ in range(100):
            seq = int(w[0])
            if seq % 2:
                continue
            epoch = int(w[1])
            raw = bytes(self._map[_HEADER.size + 16:SIZE])
            if int(w[0]) == seq:
                self.epoch = epoch
                return epoch, raw.rstrip(b"\0").decode()
        return None  # being written: next target

    def close(self) -> None:
        if self._map is not None:
            self._words = None
            self._map.close()
            self._map = None
