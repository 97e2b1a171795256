"""Copy engines: move an expert's weights from its primary owner into a redundant slot.

One interface, three engines:

  ``CudaCopyEngine``    the production path. Copies run on a dedicated side stream of the
                        destination GPU; the source is the primary owner's slot pool, opened in
                        this process through a CUDA IPC handle (``afore.migrator.peers``), so the
                        copy is a one-sided pull over NVLink (one ``cuMemcpyBatchAsync`` per
                        batch), paced while experts compute (``afore.migrator.pacing``).
                        Ordering is by CUDA events only: the side stream waits
                        for the model-stream events of the last readers of a slot before
                        overwriting it, and the model stream waits for a copy's completion event
                        only if the copy is still running. The host never waits.
  ``ThreadCopyEngine``  CPU: a background thread plays the side stream (in order, with an
                        optional artificial delay per copy), so overlap, late copies and
                        invariant 2 are exercised by CPU tests exactly as on the GPU.
  ``SyncCopyEngine``    CPU: copies inline at submission (optionally slowed down); the simplest
                        correct engine.

Timeline markers (``mark()``) are host clock readings on CPU and CUDA events on the model
stream on GPU; ``elapsed_ms(a, b)`` returns None until both points have happened, so the
migrator resolves its per-target timings lazily, without synchronising.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Protocol

import torch

from afore.config import DEFAULT_COPY_RATE_GBPS
from afore.migrator.pacing import copy_rate, plan_paced


@dataclasses.dataclass
class CopyJob:
    """One expert copy: source views (primary slot on the owner) into destination views."""

    dst_w13: torch.Tensor
    dst_w2: torch.Tensor
    src_w13: torch.Tensor
    src_w2: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.src_w13.numel() * self.src_w13.element_size() + self.src_w2.numel() * self.src_w2.element_size()


class CopyBatch(Protocol):
    start: object  # marker on the copy timeline when the batch began
    end: object    # marker on the copy timeline when the batch completed

    def done(self) -> bool: ...


class CopyEngine(Protocol):
    def submit(self, jobs: list[CopyJob], after: list[object], deadline_ms: float | None = None) -> CopyBatch:
        """Enqueue ``jobs`` after every read fence in ``after``; returns the batch handle.
        ``deadline_ms``: the copies should end this long after they start (a pacing engine
        slows down no further than that; others ignore it)."""

    def read_fence(self) -> object:
        """A fence that completes when the compute issued so far has finished reading."""

    def wait(self, batch: CopyBatch) -> None:
        """Make the compute that follows wait for ``batch`` (stream wait on GPU)."""

    def mark(self) -> object:
        """A marker at the current point of the compute timeline."""

    def elapsed_ms(self, a: object, b: object) -> float | None:
        """Milliseconds from marker a to marker b; None until both have been reached."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- CPU engines


class _HostBatch:
    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def finish(self) -> None:
        self.end = time.perf_counter()
        self._done.set()


class _HostFence:
    """A reached point of the host compute timeline (CPU compute is synchronous)."""

    def done(self) -> bool:
        return True


def _run_jobs(jobs: list[CopyJob], delay_s: float) -> None:
    with torch.no_grad():
        for job in jobs:
            if delay_s:
                time.sleep(delay_s)
            job.dst_w13.copy_(job.src_w13)
            job.dst_w2.copy_(job.src_w2)


class SyncCopyEngine:
    """CPU engine: each batch is copied inline at submission, ``delay_s`` extra per copy."""

    def __init__(self, delay_s: float = 0.0) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s: expected >= 0, got {delay_s}")
        self.delay_s = delay_s

    def submit(self, jobs: list[CopyJob], after: list[object], deadline_ms: float | None = None) -> _HostBatch:
        batch = _HostBatch()
        batch.start = time.perf_counter()
        _run_jobs(jobs, self.delay_s)
        batch.finish()
        return batch

    def read_fence(self) -> _HostFence:
        return _HostFence()

    def wait(self, batch: _HostBatch) -> None:
        batch.wait()

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (b - a) * 1e3

    def close(self) -> None:
        pass


class ThreadCopyEngine(SyncCopyEngine):
    """CPU engine with a background 'side stream': batches run in submission order on one
    thread, ``delay_s`` extra per copy, so compute overlaps copies and must wait for late ones."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(delay_s)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="afore-copy", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            jobs, batch = item
            batch.start = time.perf_counter()
            try:
                _run_jobs(jobs, self.delay_s)
            except BaseException as exc:  # surfaced to the model thread at wait()
                self._error = exc
            batch.finish()

    def submit(self, jobs: list[CopyJob], after: list[object], deadline_ms: float | None = None) -> _HostBatch:
        # Read fences on CPU are reached by construction (release() runs after the compute).
        batch = _HostBatch()
        self._queue.put((jobs, batch))
        return batch

    def wait(self, batch: _HostBatch) -> None:
        batch.wait()  # blocking wait on an Event, not a spin
        if self._error is not None:
            raise RuntimeError("expert copy failed on the copy thread") from self._error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)


# ---------------------------------------------------------------------------- GPU engine


class _CudaBatch:
    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def done(self) -> bool:
        return self.end.query()


class _Driver:
    """The CUDA driver entry points the engine calls (libcuda, present wherever a GPU is).

    ``cuMemcpyAsync`` copies between any two device pointers (peers included, with unified
    addressing) on a stream, without the cross-stream barriers that ``Tensor.copy_`` adds
    around every cross-device copy (two events per copy: ~12 us per copy on H200s).
    ``cuMemcpyBatchAsync`` (driver >= 12.8) submits a whole batch in one call; on H200s it
    removes the ~10 us start-up each separate P2P transfer pays (a batch of 8 Qwen3-30B-A3B
    experts: 75% of the large-copy rate with one call per expert, 93% with one batch call)."""

    _LOCATION_DEVICE = 1      # CU_MEM_LOCATION_TYPE_DEVICE
    _ORDER_STREAM = 1         # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    def __init__(self) -> None:
        import ctypes

        self._ct = ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        self._memcpy = lib.cuMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        version = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(version))
        self.version = version.value

        class Location(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        class Attributes(ctypes.Structure):
            _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Location),
                        ("dstLocHint", Location), ("flags", ctypes.c_uint)]

        self._location, self._attributes = Location, Attributes
        self._batch = None
        if self.version >= 12080 and hasattr(lib, "cuGetProcAddress_v2"):
            fn, status = ctypes.c_void_p(), ctypes.c_int(0)
            get = lib.cuGetProcAddress_v2
            get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                            ctypes.POINTER(ctypes.c_int)]
            get.restype = ctypes.c_int
            # Ask for the ABI of the installed driver: CUDA 13 dropped the failIdx argument.
            if get(b"cuMemcpyBatchAsync", ctypes.byref(fn), self.version, 0, ctypes.byref(status)) == 0 and fn.value:
                p = ctypes.c_void_p
                args = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t] + ([] if self.version >= 13000 else [p]) + [p]
                self._batch = ctypes.CFUNCTYPE(ctypes.c_int, *args)(fn.value)

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def copy(self, dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        rc = self._memcpy(dst, src, nbytes, stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyAsync failed with CUresult {rc}")

    def prepare_batch(self, transfers: list["_Transfer"], dst_device: int):
        """A callable that enqueues all ``transfers`` on a stream with one ``cuMemcpyBatchAsync``
        (stream-ordered sources); the argument arrays are built here, ahead of the call."""
        ct = self._ct
        transfers = sorted(transfers, key=lambda t: t.src_device)  # one attribute run per source GPU
        n = len(transfers)
        dsts = (ct.c_uint64 * n)(*[t.dst for t in transfers])
        srcs = (ct.c_uint64 * n)(*[t.src for t in transfers])
        sizes = (ct.c_size_t * n)(*[t.nbytes for t in transfers])
        runs = [i for i in range(n) if i == 0 or transfers[i].src_device != transfers[i - 1].src_device]
        attrs = (self._attributes * len(runs))(*[
            self._attributes(self._ORDER_STREAM, self._location(self._LOCATION_DEVICE, transfers[i].src_device),
                             self._location(self._LOCATION_DEVICE, dst_device), 0) for i in runs])
        index = (ct.c_size_t * len(runs))(*runs)
        extra = () if self.version >= 13000 else (ct.byref(ct.c_size_t(0)),)  # failIdx before CUDA 13

        def launch(stream: torch.cuda.Stream) -> None:
            rc = self._batch(dsts, srcs, sizes, n, attrs, index, len(runs), *extra, ct.c_void_p(stream.cuda_stream))
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {rc}")
        return launch


@dataclasses.dataclass(frozen=True)
class _Transfer:
    dst: int
    src: int
    nbytes: int
    src_device: int


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_contiguous() and b.is_contiguous() and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()


def _transfers(job: CopyJob) -> list[_Transfer]:
    """The device-pointer transfers of one job: one when the slot's matrices are adjacent."""
    for dst, src in ((job.dst_w13, job.src_w13), (job.dst_w2, job.src_w2)):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy: expected matching shape and dtype, got {tuple(dst.shape)} {dst.dtype} <- {tuple(src.shape)} {src.dtype}")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("copy: expected contiguous expert matrices")
    index = job.src_w13.device.index
    n13 = job.src_w13.numel() * job.src_w13.element_size()
    n2 = job.src_w2.numel() * job.src_w2.element_size()
    if _adjacent(job.src_w13, job.src_w2) and _adjacent(job.dst_w13, job.dst_w2):
        return [_Transfer(job.dst_w13.data_ptr(), job.src_w13.data_ptr(), n13 + n2, index)]
    return [_Transfer(d.data_ptr(), s.data_ptr(), n, index)
            for d, s, n in ((job.dst_w13, job.src_w13, n13), (job.dst_w2, job.src_w2, n2)) if n]


#: Fixed cost of one paced chunk beyond its transfer at link rate (us): the transfer's start-up
#: and the stream's switch between the copy and the sleep kernel; ~16 us measured on H200s.
#: The engine corrects it from its own completed batches.
CHUNK_OVERHEAD_US = 16.0
#: Full-rate P2P pull on H200s (NVLink 4, one direction), measured by ``afore bench migration``.
DEFAULT_LINK_GBPS = 390.0


class CudaCopyEngine:
    """GPU engine: a side stream on the destination device, event-only synchronisation.

    Full rate: one ``cuMemcpyBatchAsync`` per batch (one transfer per expert: a slot's
    matrices are adjacent in ``SlotPool``); without it (driver < 12.8) one ``cuMemcpyAsync``
    per expert spread over ``streams`` side streams; ``Tensor.copy_`` when libcuda cannot be
    loaded (``use_driver=False`` forces it, for comparison).

    Paced (``max_gbps``, see ``afore.migrator.pacing``): the batch is cut into ``chunk_bytes``
    chunks with a GPU sleep after each, so the average pull rate is ``max_gbps`` unless the
    caller's ``deadline_ms`` needs more. ``max_gbps=None`` always copies at full rate."""

    def __init__(self, device: torch.device | int | str, use_driver: bool = True, streams: int = 2,
                 batch_api: bool = True, max_gbps: float | None = None, link_gbps: float = DEFAULT_LINK_GBPS,
                 chunk_bytes: int = 4 << 20, max_chunks: int = 16) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {self.device}")
        if streams < 1:
            raise ValueError(f"streams: expected >= 1, got {streams}")
        if max_gbps is not None and max_gbps < 0:
            raise ValueError(f"max_gbps: expected >= 0 or None, got {max_gbps}")
        if link_gbps <= 0:
            raise ValueError(f"link_gbps: expected > 0, got {link_gbps}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks: expected >= 1, got {max_chunks}")
        self.stream = torch.cuda.Stream(device=self.device)
        # Extra side streams spread a batch over several copy engines when there is no batch
        # call, hiding part of the per-transfer start-up cost.
        self.lanes = [self.stream] + [torch.cuda.Stream(device=self.device) for _ in range(streams - 1)]
        self._src_streams: dict[int, torch.cuda.Stream] = {}
        self._driver: _Driver | None = None
        if use_driver:
            try:
                self._driver = _Driver()
            except (OSError, AttributeError):
                self._driver = None
        self.batch_api = bool(batch_api and self._driver is not None and self._driver.has_batch)
        self.max_gbps = max_gbps or None
        self.link_gbps = float(link_gbps)
        self.chunk_bytes = int(chunk_bytes)
        self.max_chunks = int(max_chunks)
        self._busy_until = 0.0  # host clock: when the side stream's paced work is expected to end
        self._peers_enabled: set[int] = set()
        self._ns_per_cycle: float | None = None
        self.chunk_overhead_us = CHUNK_OVERHEAD_US
        self._paced_batches: collections.deque = collections.deque(maxlen=64)  # (batch, chunks, planned us, overhead us)
        if self.max_gbps is not None and self._driver is not None and hasattr(torch.cuda, "_sleep"):
            self._ns_per_cycle = self._calibrate_sleep()

    @property
    def uses_driver(self) -> bool:
        return self._driver is not None

    @property
    def paces(self) -> bool:
        return self._ns_per_cycle is not None

    def describe(self) -> str:
        if self._driver is None:
            how = "Tensor.copy_"
        elif self.batch_api:
            how = "cuMemcpyBatchAsync"
        else:
            how = f"cuMemcpyAsync on {len(self.lanes)} streams"
        return how + (f", paced to {self.max_gbps:g} GB/s" if self.paces else "")

    def _calibrate_sleep(self) -> float:
        """ns per cycle of the GPU sleep kernel (its argument is in SM clock cycles)."""
        cycles = 1_000_000
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(1000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(self.stream)
            torch.cuda._sleep(cycles)
            b.record(self.stream)
        b.synchronize()  # once, at start-up
        return a.elapsed_time(b) * 1e6 / cycles

    def _src_stream(self, index: int) -> torch.cuda.Stream:
        if index not in self._src_streams:
            self._src_streams[index] = torch.cuda.Stream(device=index)
        return self._src_streams[index]

    def _enable_peer(self, index: int) -> None:
        # One tiny torch copy from the peer makes torch enable peer access (cudaDeviceEnablePeerAccess)
        # for this context, so driver copies from it go over NVLink directly.
        if index in self._peers_enabled or index == self.device.index:
            return
        with torch.cuda.stream(self._src_stream(index)):
            torch.empty(1, device=self.device).copy_(torch.zeros(1, device=torch.device("cuda", index)))
        torch.cuda.synchronize(self.device)
        self._peers_enabled.add(index)

    def submit(self, jobs: list[CopyJob], after: list[object], deadline_ms: float | None = None) -> _CudaBatch:
        """Enqueue ``jobs`` on the side stream after the fences in ``after``; with pacing on,
        finish within ``deadline_ms`` of starting if given (see ``afore.migrator.pacing``)."""
        transfers = [t for job in jobs for t in _transfers(job)] if self._driver is not None else []
        nbytes = sum(job.nbytes for job in jobs)
        rate = None
        if self.paces and transfers:
            # the deadline counts from now, but this batch starts after what the side stream
            # still has booked; keep one chunk's overhead in hand
            now = time.monotonic()
            budget = None
            if deadline_ms is not None:
                budget = deadline_ms - max(0.0, self._busy_until - now) * 1e3 - self.chunk_overhead_us * 1e-3
            rate = copy_rate(nbytes, self.max_gbps, budget, self.link_gbps)  # None (full rate) once budget <= 0
        batch = _CudaBatch()
        launch = None
        if transfers and rate is None and self.batch_api:
            launch = self._driver.prepare_batch(transfers, self.device.index)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            for t in transfers:
                self._enable_peer(t.src_device)
            for fence in after:
                self.stream.wait_event(fence)
            batch.start.record(self.stream)
            if self._driver is None:
                for job in jobs:
                    self._torch_copy(job)
            elif transfers:
                planned_us = nbytes / (self.link_gbps * 1e3)
                if rate is not None:
                    self._learn_overhead()
                    estimate = self.chunk_overhead_us
                    chunks, planned_us = self._paced(transfers, rate)
                    self._paced_batches.append((batch, chunks, planned_us, estimate))
                elif launch is not None:
                    launch(self.stream)
                else:
                    self._lanes_copy(transfers)
                self._book(planned_us)
            batch.end.record(self.stream)
        return batch

    def _book(self, duration_us: float) -> None:
        if self.paces:
            self._busy_until = max(time.monotonic(), self._busy_until) + duration_us * 1e-6

    def _paced(self, transfers: list[_Transfer], rate: float) -> tuple[int, float]:
        """The batch as ``plan_paced`` cuts it: a driver call per piece, a GPU sleep after every
        chunk but the last; returns (chunks, planned time in us)."""
        plan = plan_paced([t.nbytes for t in transfers], rate, self.link_gbps, self.chunk_bytes,
                          self.max_chunks, self.chunk_overhead_us)
        for pieces, gap in zip(plan.chunks, plan.gaps_us):
            for index, offset, length in pieces:
                t = transfers[index]
                self._driver.copy(t.dst + offset, t.src + offset, length, self.stream)
            if gap > 0:
                torch.cuda._sleep(max(1, int(gap * 1e3 / self._ns_per_cycle)))
        return len(plan.chunks), plan.duration_us

    def _learn_overhead(self) -> None:
        """Update the per-chunk overhead from paced batches that have completed (no waiting)."""
        while self._paced_batches and self._paced_batches[0][0].end.query():
            batch, chunks, planned, estimate = self._paced_batches.popleft()
            # planned holds ``estimate`` per chunk: the difference is the estimate's error
            measured = batch.start.elapsed_time(batch.end) * 1e3
            per_chunk = min(max(estimate + (measured - planned) / chunks, 0.0), 1000.0)
            self.chunk_overhead_us = 0.5 * self.chunk_overhead_us + 0.5 * per_chunk

    def _lanes_copy(self, transfers: list[_Transfer]) -> None:
        lanes = self.lanes[: max(1, min(len(self.lanes), len(transfers)))]
        start = torch.cuda.Event()
        start.record(self.stream)
        for lane in lanes[1:]:
            lane.wait_event(start)
        for i, t in enumerate(transfers):
            self._driver.copy(t.dst, t.src, t.nbytes, lanes[i % len(lanes)])
        for lane in lanes[1:]:
            joined = torch.cuda.Event()
            joined.record(lane)
            self.stream.wait_event(joined)

    def _torch_copy(self, job: CopyJob) -> None:
        src_index = job.src_w13.device.index
        if src_index == self.device.index:
            job.dst_w13.copy_(job.src_w13, non_blocking=True)
            job.dst_w2.copy_(job.src_w2, non_blocking=True)
        else:
            # A cross-device copy_ runs on the *source* device's current stream of this
            # process and then fences the destination's current stream: make both side
            # streams so the model streams are never involved.
            with torch.cuda.stream(self._src_stream(src_index)):
                job.dst_w13.copy_(job.src_w13, non_blocking=True)
                job.dst_w2.copy_(job.src_w2, non_blocking=True)

    def read_fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, batch: _CudaBatch) -> None:
        if not batch.end.query():
            torch.cuda.current_stream(self.device).wait_event(batch.end)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_ms(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float | None:
        if not (a.query() and b.query()):
            return None
        return a.elapsed_time(b)

    def close(self) -> None:
        for lane in self.lanes:
            lane.synchronize()


def make_copy_engine(device: torch.device | str, delay_s: float = 0.0, threaded: bool = True,
                     max_gbps: float | None = DEFAULT_COPY_RATE_GBPS) -> CopyEngine:
    """The engine for ``device``: CUDA side stream on GPUs (paced to ``max_gbps`` while it
    computes; None or 0 = full rate), a copy thread (or inline) on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaCopyEngine(device, max_gbps=max_gbps)
    return ThreadCopyEngine(delay_s) if threaded else SyncCopyEngine(delay_s)
