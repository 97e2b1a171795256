"""One worker's share of a plan as a small device table that the FFN step reads.

The step (``afore.ffn.experts.routed_expert_step``) needs, per logical expert e, only this
worker's column of the plan: the ordinal interval [lo, hi) of eq. 11 (``afore.ffn.partition``)
and the physical slot sigma[e, w]. They are computed and validated on the host once, when the
plan arrives (``DevicePlan.stage``), and reach the device at the microbatch boundary as one
host-to-device copy from pinned memory (``DevicePlan.upload``), which also carries the pair
count n of the step. The device table keeps its address, so a captured CUDA graph replays
with whatever plan was uploaded last: a changed plan costs the same copy as an unchanged one.

Table layout, int32[3 * EP + 1] (``EP = table_width(E)``, the smallest power of two >= max(E, 16)):

    [0, EP)        lo[e]     first ordinal of e that this worker runs
    [EP, 2EP)      hi[e]     one past the last (int32 max for e's primary owner: the remainder)
    [2EP, 3EP)     slot[e]   physical slot of e on this worker, -1 where it runs none of e
    [3EP]          n         pairs in the step (tokens * top_k)

Entries e >= E are (0, 0, -1); ids outside [0, E) run nowhere (the step masks them).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import numpy as np
import torch

from afore.config import ClusterShape
from afore.plan import Plan
from afore.scheduler.plan_codec import DecodedPlan

INT32_MAX = np.iinfo(np.int32).max

try:
    from afore._ffn import worker_table as _native_table
except ImportError:  # an older build of the extension: the numpy table serves alone
    _native_table = None


def table_width(num_experts: int) -> int:
    """EP: the smallest power of two >= max(``num_experts``, 16) (Triton block sizes)."""
    return 1 << max(4, (int(num_experts) - 1).bit_length())


def worker_table(plan: Plan, shape: ClusterShape, worker: int, num_slots: int) -> np.ndarray:
    """This worker's plan table (int32[3*EP + 1], n = 0), or ValueError naming the bad field.

    plan.assignment: int[E, F] a[e, w]; plan.slot: int[E, F] sigma[e, w]. Every expert that
    this worker runs must be bound to a slot in [0, num_slots), and each primary of this worker
    to its fixed slot. On every plan of every worker: a few whole-array numpy calls, the
    per-shape constants cached (``_WorkerConstants``).
    """
    e, f = shape.num_experts, shape.num_workers
    c = _worker_constants(shape, worker)
    if _native_table is not None and type(plan) is DecodedPlan and plan._ef == (e, f) and plan.body_in_place():
        _, assignment, slot, _ = plan.addresses()  # read from the wire for this shape: the body where it lies
        return _native_worker_table(c, e, f, worker, num_slots, assignment, slot)
    a = np.asarray(plan.assignment)
    s = np.asarray(plan.slot)
    for name, arr in (("assignment", a), ("slot", s)):
        if arr.shape != (e, f):
            raise ValueError(f"plan.{name}: expected shape ({e}, {f}), got {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"plan.{name}: expected integers, got {arr.dtype}")
    if _native_table is not None and a.dtype == np.int32 and s.dtype == np.int32 and a.flags.c_contiguous \
            and s.flags.c_contiguous:
        return _native_worker_table(c, e, f, worker, num_slots, a.ctypes.data, s.ctypes.data)
    non_primary = a.astype(np.int64, order="C")  # a copy (C order: zeroed through a flat view)
    if e and non_primary.min() < 0:
        raise ValueError(f"plan.assignment: expected counts >= 0, got {int(a.min())}")
    non_primary.reshape(-1)[c.primary_flat] = 0
    hi_all = np.cumsum(non_primary, axis=1)
    total = hi_all[:, -1]
    if e and int(total.max()) >= INT32_MAX:
        raise ValueError(f"plan.assignment: expected fewer than {INT32_MAX} pairs per expert")
    hi = hi_all[:, worker]
    lo = np.where(c.mine_primary, total, hi - non_primary[:, worker])
    hi = np.where(c.mine_primary, INT32_MAX, hi)
    slot = s[:, worker].astype(np.int64)
    works = hi > lo
    # negative slots wrap to huge unsigned ones: one comparison covers both ends
    bad = works & (slot.view(np.uint64) >= num_slots)
    if bad.any():
        ex = int(np.nonzero(bad)[0][0])
        raise ValueError(f"plan.slot: expert {ex} runs on worker {worker} but is bound to slot {int(slot[ex])}, "
                         f"outside [0, {num_slots})")
    wrong = c.mine_primary & (slot != c.primary_slot)
    if wrong.any():
        ex = int(np.nonzero(wrong)[0][0])
        raise ValueError(f"plan.slot: primary {ex} of worker {worker} is bound to slot {int(slot[ex])}, "
                         f"not its fixed slot {int(c.primary_slot[ex])}")
    ep = c.width
    table = c.template.copy()
    table[:e] = np.where(works, lo, 0)
    table[ep: ep + e] = np.where(works, hi, 0)
    table[2 * ep: 2 * ep + e] = np.where(works, slot, -1)
    return table


def _native_worker_table(c: "_WorkerConstants", e: int, f: int, worker: int, num_slots: int, assignment: int,
                         slot: int) -> np.ndarray:
    """``worker_table``'s table, checks and messages in one C++ call (afore._ffn,
    csrc/ffn/plan_check.cpp), on int32 row-major [E, F] arrays at these addresses."""
    table = c.template.copy()
    reason = _native_table(e, f, worker, num_slots, c.width, assignment, slot, c.owner_ptr, c.primary_slot_ptr,
                           table.ctypes.data)
    if reason:
        raise ValueError(reason)
    return table


class _WorkerConstants(NamedTuple):
    owner: np.ndarray         # int64[E]: the primary owner of each expert
    primary_flat: np.ndarray  # int64[E]: flat index e * F + owner[e] of each primary in an [E, F] array
    mine_primary: np.ndarray  # bool[E]: e's primary is this worker
    primary_slot: np.ndarray  # int64[E]
    width: int                # EP
    template: np.ndarray      # int32[3*EP + 1]: the table of a worker that runs nothing
    owner_ptr: int            # owner's and primary_slot's addresses (``.ctypes.data`` costs ~1 us a read)
    primary_slot_ptr: int


@functools.lru_cache(maxsize=256)
def _worker_constants(shape: ClusterShape, worker: int) -> _WorkerConstants:
    owner = shape.primary_owner
    ep = table_width(shape.num_experts)
    template = np.zeros(3 * ep + 1, np.int32)
    template[2 * ep: 3 * ep] = -1
    owner_arr, primary_slot = np.ascontiguousarray(owner, np.int64), np.ascontiguousarray(shape.primary_slot, np.int64)
    out = _WorkerConstants(owner_arr, np.arange(shape.num_experts, dtype=np.int64) * shape.num_workers + owner,
                           owner == worker, primary_slot, ep, template, owner_arr.ctypes.data, primary_slot.ctypes.data)
    for arr in (out.owner, out.primary_flat, out.mine_primary, out.primary_slot, out.template):
        arr.flags.writeable = False
    return out


class DevicePlan:
    """The device plan table of one layer on one worker, and the plans staged for it.

    ``stage(plan)`` validates and converts a plan when it arrives (host only, cached by
    sequence number); ``upload(table, n)`` makes it current for the next step with one
    non-blocking copy from a pinned ring buffer (a ring entry is reused only once its copy has
    completed, checked with an event query; the ring is deep enough that this never waits)."""

    def __init__(self, shape: ClusterShape, worker: int, num_slots: int, device: torch.device | str,
                 ring: int = 64, keep: int = 64) -> None:
        shape.check_worker(worker)
        self.shape = shape
        self.worker = worker
        self.num_slots = int(num_slots)
        self.device = torch.device(device)
        self.width = table_width(shape.num_experts)
        self.n_offset = 3 * self.width
        self.table = torch.zeros(3 * self.width + 1, dtype=torch.int32, device=self.device)
        self._staged: collections.OrderedDict[int, tuple[Plan, np.ndarray]] = collections.OrderedDict()
        self._keep = keep
        self._primary: np.ndarray | None = None
        pinned = self.device.type == "cuda"
        self._ring = [torch.zeros(3 * self.width + 1, dtype=torch.int32, pin_memory=pinned) for _ in range(ring)]
        self._views = [host.numpy() for host in self._ring]  # host memory: writing it reads nothing back
        self._events = [torch.cuda.Event() if pinned else None for _ in range(ring)]
        self._used = [False] * ring
        self._next = 0
        self.uploads = 0

    def stage(self, plan: Plan) -> np.ndarray:
        """This worker's table of ``plan`` (validated; ValueError names the bad field)."""
        if plan.primary_only:
            if self._primary is None:
                self._primary = worker_table(plan, self.shape, self.worker, self.num_slots)
            return self._primary
        hit = self._staged.get(plan.seq)
        if hit is not None and hit[0] is plan:
            return hit[1]
        table = worker_table(plan, self.shape, self.worker, self.num_slots)
        self._staged[plan.seq] = (plan, table)
        while len(self._staged) > self._keep:
            self._staged.popitem(last=False)
        return table

    def upload(self, table: np.ndarray, num_pairs: int) -> torch.Tensor:
        """Make ``table`` (from ``stage``) with n = ``num_pairs`` the current device table, in
        stream order on the current stream; returns the device table."""
        if not 0 <= num_pairs < INT32_MAX:
            raise ValueError(f"num_pairs: expected in [0, {INT32_MAX}), got {num_pairs}")
        i = self._next
        self._next = (i + 1) % len(self._ring)
        event = self._events[i]
        if event is not None and self._used[i] and not event.query():
            event.synchronize()  # the GPU is a whole ring of steps behind: wait for the oldest copy
        host, view = self._ring[i], self._views[i]
        view[: self.n_offset] = table[: self.n_offset]
        view[self.n_offset] = num_pairs
        self.table.copy_(host, non_blocking=event is not None)
        if event is not None:
            event.record()
            self._used[i] = True
        self.uploads += 1
        return self.table
