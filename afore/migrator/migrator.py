"""The migrator: apply plans to one FFN worker's slot pools (paper section 6.2).

Per target, in the FFN worker loop (``afore.ffn.worker``):

    prepare(plan t+1)   while target t is in flight: validate the plan (target, sequence,
                        bindings), submit this worker's copies in Delta[t+1] on the side stream
    commit(plan t+1)    when t+1 reaches the FFN stage: the compute waits only for the copies
                        it needs that are still running (no host wait on GPU)
    release(plan t+1)   after t+1's compute was issued: record the read fence of the slots
                        it used, so later copies into those slots wait for it

Invariant 2: a copy into slot s is submitted only after every prepared-but-unreleased
target that reads s has been released, and then waits on the read fence of the last
reader. Plans from a correct scheduler never need the deferral (it protects U[t]); a plan
that does is still executed correctly.
Invariant 3: a plan whose target or sequence is not the expected one, or whose bindings
name a replica that is neither resident nor copied, is rejected as a whole (``prepare``
returns False) and the worker runs the primary-only plan for that target.

Per target the migrator records (``MigrationRecord``) raw copy time, exposed wait and the
lookahead window, resolved without synchronising once the events have completed.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

import numpy as np
import torch

from afore.config import ClusterShape
from afore.migrator.copy_engine import CopyBatch, CopyEngine, CopyJob
from afore.migrator.slot_pool import SlotPool
from afore.plan import Plan
from afore.scheduler.plan_codec import DecodedPlan


class WeightSource(Protocol):
    def primary_weights(self, layer: int, expert: int, src_worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) of ``expert`` in its primary slot on ``src_worker``."""


class PoolSource:
    """Source views straight from slot pools (in-process workers, or IPC-opened peer pools).

    pools: {(layer, worker): SlotPool or (w13 [K_w, 2I, H], w2 [K_w, H, I])}.
    """

    def __init__(self, shape: ClusterShape, pools: dict[tuple[int, int], object]) -> None:
        self.shape = shape
        self.pools = pools
        self._primary_slot = shape.primary_slot

    def primary_weights(self, layer: int, expert: int, src_worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.pools[(layer, src_worker)]
        w13, w2 = (pool.w13, pool.w2) if isinstance(pool, SlotPool) else pool
        s = int(self._primary_slot[expert])
        return w13[s], w2[s]


class HostWeightsSource:
    """Source views from the layer's full routed-expert weights in host memory (CPU workers:
    every worker maps the checkpoint, so a 'pull from the primary' reads the same bytes)."""

    def __init__(self, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.weights = weights

    def primary_weights(self, layer: int, expert: int, src_worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = self.weights[layer]
        return w13[expert], w2[expert]


@dataclasses.dataclass
class MigrationRecord:
    """Timings of one target on one worker (ms). window: copy submission -> commit."""

    seq: int
    copies: int
    bytes: int
    raw_copy_ms: float
    exposed_ms: float
    window_ms: float


@dataclasses.dataclass
class _Prepared:
    plan: Plan
    batches: list[CopyBatch]
    deferred: list[tuple[int, int, int]]  # (expert, src, slot) waiting for a reader's release
    submit_mark: object
    reads: list[tuple[int, int]]          # (redundant physical slot, expert) this plan reads on this worker
    copies: int
    bytes: int


try:
    from afore._ffn import migrator_check as _native_check
except ImportError:  # an older build of the extension: the numpy checks serve alone
    _native_check = None


def _int32_rows(*arrays: np.ndarray) -> bool:
    """Whether every array is C-contiguous int32 (the plan ring's decoded views): what the C++
    check reads through a pointer."""
    return all(a.dtype == np.int32 and a.flags.c_contiguous for a in arrays)


class Migrator:
    """Plans -> slot pool state for one FFN worker (all its layers)."""

    def __init__(self, shape: ClusterShape, worker: int, pools: dict[int, SlotPool],
                 engine: CopyEngine, source: WeightSource, deadline_share: float = 0.5) -> None:
        shape.check_worker(worker)
        for layer, pool in pools.items():
            shape.check_layer(layer)
            if pool.worker != worker:
                raise ValueError(f"pools[{layer}].worker: expected {worker}, got {pool.worker}")
        if not 0 < deadline_share <= 1:
            raise ValueError(f"deadline_share: expected in (0, 1], got {deadline_share}")
        self.shape = shape
        self.worker = worker
        self.pools = pools
        # Copies are asked to end within this share of the expected lookahead window (the
        # smaller of the last two measured windows); a pacing engine slows down no further.
        self.deadline_share = deadline_share
        self._recent_windows: collections.deque[float] = collections.deque(maxlen=2)
        self.engine = engine
        self.source = source
        self.num_primaries = int(shape.primary_counts[worker])
        self._owner = shape.primary_owner.tolist()
        self._owner_arr = np.ascontiguousarray(shape.primary_owner, np.int64)
        self._primary_slot = np.ascontiguousarray(shape.primary_slot, np.int64)
        self._primary_flat = np.arange(shape.num_experts, dtype=np.int64) * shape.num_workers + shape.primary_owner
        r = shape.redundant_slots
        # Content of each redundant slot once every submitted / prepared copy has run.
        self.projected = {layer: pool.resident[self.num_primaries:].copy() for layer, pool in pools.items()}
        self._static_pointers = (self._owner_arr.ctypes.data, self._primary_flat.ctypes.data, self._primary_slot.ctypes.data)
        self._pointers: dict[int, tuple[np.ndarray, int]] = {}
        self.pending: dict[int, list[CopyBatch | None]] = {layer: [None] * r for layer in pools}
        self.last_read: dict[int, list[object | None]] = {layer: [None] * r for layer in pools}
        self.readers: dict[int, list[set[int]]] = {layer: [set() for _ in range(r)] for layer in pools}
        self.prepared: dict[int, _Prepared] = {}
        self.last_committed_seq = -1
        self.rejected = 0
        self._unresolved: collections.deque = collections.deque()
        self.records: collections.deque[MigrationRecord] = collections.deque(maxlen=4096)

    # ------------------------------------------------------------------ validation

    def validate(self, plan: Plan, expected_seq: int | None = None, expected_target=None) -> str | None:
        """Why ``plan`` cannot be applied on this worker, or None if it can."""
        return self._check(plan, expected_seq, expected_target)[0]

    def _check(self, plan: Plan, expected_seq: int | None, expected_target) -> tuple[str | None, list[tuple[int, int]]]:
        """(``validate``'s reason, [(slot, expert)] of the redundant slots this plan reads on this
        worker, ascending by slot). Whole-array numpy calls, a handful per plan: it runs on every
        plan of every worker."""
        if expected_seq is not None and plan.seq != expected_seq:
            return f"seq: expected {expected_seq}, got {plan.seq}", []
        if expected_target is not None and plan.target != expected_target:
            return f"target: expected {expected_target}, got {plan.target}", []
        if plan.seq <= self.last_committed_seq or plan.seq in self.prepared:
            return f"seq: {plan.seq} is stale (last committed {self.last_committed_seq})", []
        if plan.target.layer not in self.pools:
            return f"target.layer: {plan.target.layer} is not served by worker {self.worker}", []
        e, f = self.shape.num_experts, self.shape.num_workers
        if type(plan) is DecodedPlan and _native_check is not None and plan.body_in_place():
            # read from the wire for this shape (decode_worker_plan checked it): the C++ checks read the
            # body where it lies, no array of it is made
            demand, assignment, slot, copies = plan.addresses()
            return self._native(plan, assignment, slot, demand, copies, plan.num_copies, True)
        # a decoded plan's replicas are its slot >= 0 by construction (computed only if asked for)
        names = ("assignment", "slot") if isinstance(plan, DecodedPlan) else ("assignment", "slot", "replicas")
        for name in names:
            if getattr(plan, name).shape != (e, f):
                return f"{name}: expected shape ({e}, {f}), got {getattr(plan, name).shape}", []
        if plan.copies.ndim != 2 or plan.copies.shape[1] != 4:
            return f"copies: expected shape (C, 4), got {plan.copies.shape}", []
        assignment, slot = plan.assignment, plan.slot
        if _native_check is not None and plan.demand.shape == (e,) and _int32_rows(assignment, slot, plan.copies) \
                and plan.demand.dtype == np.int64 and plan.demand.flags.c_contiguous:
            # the same checks and messages in one C++ call (afore._ffn, csrc/ffn/plan_check.cpp)
            return self._native(plan, assignment.ctypes.data, slot.ctypes.data, plan.demand.ctypes.data,
                                plan.copies.ctypes.data, len(plan.copies), False)
        if plan.demand.shape != (e,) or (assignment.sum(axis=1) != plan.demand).any():
            return "assignment: rows do not sum to demand", []
        works = assignment > 0
        if (works & (slot < 0)).any():
            return "assignment: work on a worker without a slot binding", []
        if (np.take(slot, self._primary_flat) != self._primary_slot).any():
            return "slot: a primary is not at its fixed slot", []
        projected = self.projected[plan.target.layer].copy()
        k_w = self.num_primaries + self.shape.redundant_slots
        owner = self._owner
        for ex, src, dst, s in plan.copies.tolist():
            if not (0 <= ex < e and 0 <= dst < f):
                return f"copies: row ({ex}, {src}, {dst}, {s}) out of range", []
            if src != owner[ex]:
                return f"copies: expert {ex} copied from {src}, not its primary {owner[ex]}", []
            if dst == self.worker:
                if not self.num_primaries <= s < k_w:
                    return f"copies: slot {s} is not a redundant slot of worker {dst}", []
                projected[s - self.num_primaries] = ex
        mine = slot[:, self.worker]
        foreign = works[:, self.worker] & (mine < self.num_primaries) & (self._owner_arr != self.worker)
        if foreign.any():  # a primary slot holds its own primary only: these pairs would run on its weights
            ex = int(np.flatnonzero(foreign)[0])
            return (f"slot: expert {ex} on worker {self.worker} bound to primary slot {int(mine[ex])} of another expert",
                    [])
        reads = []
        for ex in np.flatnonzero((mine >= self.num_primaries) & works[:, self.worker]).tolist():
            s = int(mine[ex])
            if s >= k_w:
                return f"slot: expert {ex} bound to slot {s} beyond K_w={k_w}", []
            if projected[s - self.num_primaries] != ex:
                return f"slot: expert {ex} on worker {self.worker} slot {s} is neither resident nor copied", []
            reads.append((s, ex))
        reads.sort()  # distinct slots: two experts in one slot cannot both match projected
        return None, reads

    def _native(self, plan: Plan, assignment: int, slot: int, demand: int, copies: int, num_copies: int,
                demand_int32: bool) -> tuple[str | None, list[tuple[int, int]]]:
        """``_check``'s checks after the seq and target in C++, on the plan's arrays at these
        addresses (int32 row-major; demand int64, or int32 where ``demand_int32``)."""
        e, f = self.shape.num_experts, self.shape.num_workers
        projected = self.projected[plan.target.layer]
        # the addresses of this worker's own arrays are read once (``.ctypes.data`` costs ~1 us
        # each); ``projected`` is changed in place, and re-read if it was replaced
        cached = self._pointers.get(plan.target.layer)
        if cached is None or cached[0] is not projected:
            cached = self._pointers[plan.target.layer] = (projected, projected.ctypes.data)
        owner, flat, primary = self._static_pointers
        reason, reads = _native_check(e, f, self.worker, self.num_primaries, self.num_primaries + self.shape.redundant_slots,
                                      assignment, slot, demand, copies, num_copies, owner, flat, primary, cached[1],
                                      projected.size, demand_int32)
        return (reason or None), (reads if not reason else [])

    # ------------------------------------------------------------------ the three steps

    def prepare(self, plan: Plan, expected_seq: int | None = None, expected_target=None) -> bool:
        """Validate ``plan`` and submit this worker's copies; False (and counted) if rejected."""
        if plan.seq in self.prepared:
            return True
        reason, reads = self._check(plan, expected_seq, expected_target)
        if reason is not None:
            self.rejected += 1
            self.last_rejection = reason
            return False
        layer = plan.target.layer
        pool = self.pools[layer]
        submit_mark = self.engine.mark()
        jobs: list[tuple[int, int, int]] = []
        deferred: list[tuple[int, int, int]] = []
        nbytes = 0
        if (plan.num_copies if type(plan) is DecodedPlan else len(plan.copies)):  # a decoded plan: no view made for none
            for ex, src, dst, s in plan.copies.tolist():
                if dst != self.worker:
                    continue
                r = s - self.num_primaries
                self.projected[layer][r] = ex
                nbytes += pool.bytes_per_expert
                (deferred if self._earlier_readers(layer, s, plan.seq) else jobs).append((ex, src, s))
        batches = [self._submit(layer, jobs)] if jobs else []
        for s, _ in reads:
            self.readers[layer][s - self.num_primaries].add(plan.seq)
        self.prepared[plan.seq] = _Prepared(plan, batches, deferred, submit_mark, reads,
                                            len(jobs) + len(deferred), nbytes)
        return True

    def commit_check(self, plan: Plan) -> str | None:
        """Why ``commit(plan)`` would fail now (None: it will not): run before the FFN workers
        agree on the plan, so that a worker that cannot commit vetoes it for everyone instead
        of failing alone after the others committed."""
        state = self.prepared.get(plan.seq)
        if state is None:
            return f"plan {plan.seq} was not prepared"
        if state.deferred:
            return f"plan {plan.seq}: copies still deferred behind an unreleased reader"
        resident = self.pools[plan.target.layer].resident
        for s, expected in state.reads:
            if resident[s] != expected:
                return f"slot {s} holds expert {resident[s]}, plan {plan.seq} expects {expected}"
        return None

    def commit(self, plan: Plan) -> None:
        """Make the compute of ``plan``'s target wait for its still-running copies."""
        if plan.seq not in self.prepared:
            if not self.prepare(plan):
                raise ValueError(f"plan: cannot commit seq {plan.seq}: {self.last_rejection}")
        state = self.prepared[plan.seq]
        if state.deferred:
            raise RuntimeError(f"plan {plan.seq}: copies still deferred behind an unreleased reader")
        layer = plan.target.layer
        pool = self.pools[layer]
        commit_mark = self.engine.mark()
        waited: list[CopyBatch] = []
        for s, expected in state.reads:
            r = s - self.num_primaries
            if pool.resident[s] != expected:
                raise RuntimeError(f"slot {s} holds expert {pool.resident[s]}, plan {plan.seq} expects {expected}")
            batch = self.pending[layer][r]
            if batch is not None and batch not in waited:
                self.engine.wait(batch)
                waited.append(batch)
        self.last_committed_seq = plan.seq
        self._unresolved.append((state, commit_mark, waited))

    def release(self, plan: Plan) -> None:
        """``plan``'s compute has been issued: fence its slots and run copies deferred behind it."""
        state = self.prepared.pop(plan.seq, None)
        if state is None:
            return
        layer = plan.target.layer
        fence = self.engine.read_fence()
        for s, _ in state.reads:
            r = s - self.num_primaries
            self.readers[layer][r].discard(plan.seq)
            self.last_read[layer][r] = fence
        for later in sorted(self.prepared):
            other = self.prepared[later]
            if other.plan.target.layer != layer or not other.deferred:
                continue
            ready = [c for c in other.deferred if not self._earlier_readers(layer, c[2], later)]
            if ready:
                other.deferred = [c for c in other.deferred if c not in ready]
                # its target may commit next: no pacing
                other.batches.append(self._submit(layer, ready, paced=False))
        self._resolve()

    def _earlier_readers(self, layer: int, slot: int, seq: int) -> bool:
        return any(reader < seq for reader in self.readers[layer][slot - self.num_primaries])

    def forget(self, plan: Plan) -> None:
        """Drop a prepared plan that will not run (its copies stay; its reads are released)."""
        if plan.seq in self.prepared:
            self.release(plan)

    def empty_redundant_slots(self) -> None:
        """Treat every redundant slot as empty from now on (the projection: a later plan copies
        into it before reading it; what is there is overwritten in copy-stream order, after the
        reads fenced so far). Only between targets: no plan may be prepared."""
        if self.prepared:
            raise RuntimeError(f"empty_redundant_slots: plans {sorted(self.prepared)} are still prepared")
        for projected in self.projected.values():
            projected[:] = -1

    def _submit(self, layer: int, copies: list[tuple[int, int, int]], paced: bool = True) -> CopyBatch:
        """``paced``: the batch's deadline comes from the measured windows; False: deadline 0 (full rate)."""
        pool = self.pools[layer]
        jobs, after = [], []
        for ex, src, s in copies:
            r = s - self.num_primaries
            src_w13, src_w2 = self.source.primary_weights(layer, ex, src)
            jobs.append(CopyJob(pool.w13[s], pool.w2[s], src_w13, src_w2))
            fence = self.last_read[layer][r]
            if fence is not None and fence not in after:
                after.append(fence)
        batch = self.engine.submit(jobs, after, deadline_ms=self.copy_deadline_ms() if paced else 0.0)
        for ex, _, s in copies:
            pool.resident[s] = ex
            self.pending[layer][s - self.num_primaries] = batch
        return batch

    # ------------------------------------------------------------------ timings

    def copy_deadline_ms(self) -> float | None:
        """How soon a batch submitted now should finish: ``deadline_share`` of the expected
        lookahead window; None (no pacing) until a window has been measured."""
        if not self._recent_windows:
            return None
        return self.deadline_share * min(self._recent_windows)

    def _resolve(self) -> None:
        while self._unresolved:
            state, commit_mark, waited = self._unresolved[0]
            window = self.engine.elapsed_ms(state.submit_mark, commit_mark)
            raws = [self.engine.elapsed_ms(b.start, b.end) for b in state.batches]
            ends = [self.engine.elapsed_ms(commit_mark, b.end) for b in waited]
            if window is None or any(x is None for x in raws) or any(x is None for x in ends):
                return
            self._unresolved.popleft()
            self._recent_windows.append(float(window))
            self.records.append(MigrationRecord(state.plan.seq, state.copies, state.bytes, float(sum(raws)),
                                                max([0.0, *ends]), float(window)))

    def drain_records(self) -> list[MigrationRecord]:
        """Records of targets whose timings are complete (oldest first), removed from the buffer."""
        self._resolve()
        out = list(self.records)
        self.records.clear()
        return out

    def close(self) -> None:
        self.engine.close()
