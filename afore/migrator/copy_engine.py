"""Copy engines: move an expert's weights from its primary owner into a redundant slot.

One interface, three engines:

  ``CudaCopyEngine``    the production path. Copies run on a dedicated side stream of the
                        destination GPU; the source is the primary owner's slot pool, opened in
                        this process through a CUDA IPC handle (``afore.migrator.peers``), so the
                        copy is a one-sided pull over NVLink (cudaMemcpyPeerAsync under
                        ``Tensor.copy_``). Ordering is by CUDA events only: the side stream waits
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

import dataclasses
import queue
import threading
import time
from typing import Protocol

import torch


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
    def submit(self, jobs: list[CopyJob], after: list[object]) -> CopyBatch:
        """Enqueue ``jobs`` after every read fence in ``after``; returns the batch handle."""

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

    def submit(self, jobs: list[CopyJob], after: list[object]) -> _HostBatch:
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

    def submit(self, jobs: list[CopyJob], after: list[object]) -> _HostBatch:
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


class _DriverMemcpy:
    """``cuMemcpyAsync`` from the CUDA driver (libcuda, present wherever a GPU is).

    With unified addressing one call copies between any two device pointers, peers
    included, on the given stream, without the cross-stream barriers that ``Tensor.copy_``
    adds around every cross-device copy (two events per copy, which serialise a batch of
    small copies: measured ~12 us per copy on H200s, half the time of a 9 MB expert)."""

    def __init__(self) -> None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        self._fn = lib.cuMemcpyAsync
        self._fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, stream: torch.cuda.Stream) -> None:
        rc = self._fn(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyAsync failed with CUresult {rc}")


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_contiguous() and b.is_contiguous() and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr()


class CudaCopyEngine:
    """GPU engine: a side stream on the destination device, event-only synchronisation.

    Copies go through ``cuMemcpyAsync`` on the side stream (one transfer per expert when the
    slot's matrices are adjacent, as in ``SlotPool``); ``Tensor.copy_`` is the fallback when
    libcuda cannot be loaded (``use_driver=False`` forces it, for comparison)."""

    def __init__(self, device: torch.device | int | str, use_driver: bool = True, streams: int = 2) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device: expected a CUDA device, got {self.device}")
        if streams < 1:
            raise ValueError(f"streams: expected >= 1, got {streams}")
        self.stream = torch.cuda.Stream(device=self.device)
        # Extra side streams spread a batch over several copy engines, hiding the per-transfer
        # start-up cost (~10 us per P2P transfer on one stream, measured on H200s).
        self.lanes = [self.stream] + [torch.cuda.Stream(device=self.device) for _ in range(streams - 1)]
        self._src_streams: dict[int, torch.cuda.Stream] = {}
        self._memcpy = None
        if use_driver:
            try:
                self._memcpy = _DriverMemcpy()
            except (OSError, AttributeError):
                self._memcpy = None
        self._peers_enabled: set[int] = set()

    @property
    def uses_driver(self) -> bool:
        return self._memcpy is not None

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

    def submit(self, jobs: list[CopyJob], after: list[object]) -> _CudaBatch:
        batch = _CudaBatch()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.no_grad():
            if self._memcpy is not None:
                for job in jobs:
                    self._enable_peer(job.src_w13.device.index)
            for fence in after:
                self.stream.wait_event(fence)
            batch.start.record(self.stream)
            if self._memcpy is not None:
                lanes = self.lanes[: max(1, min(len(self.lanes), len(jobs)))]
                for lane in lanes[1:]:
                    lane.wait_event(batch.start)
                for i, job in enumerate(jobs):
                    self._driver_copy(job, lanes[i % len(lanes)])
                for lane in lanes[1:]:
                    joined = torch.cuda.Event()
                    joined.record(lane)
                    self.stream.wait_event(joined)
            else:
                for job in jobs:
                    self._torch_copy(job)
            batch.end.record(self.stream)
        return batch

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

    def _driver_copy(self, job: CopyJob, lane: torch.cuda.Stream) -> None:
        for dst, src in ((job.dst_w13, job.src_w13), (job.dst_w2, job.src_w2)):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"copy: expected matching shape and dtype, got {tuple(dst.shape)} {dst.dtype} <- {tuple(src.shape)} {src.dtype}")
            if not (dst.is_contiguous() and src.is_contiguous()):
                raise ValueError("copy: expected contiguous expert matrices")
        n13 = job.src_w13.numel() * job.src_w13.element_size()
        n2 = job.src_w2.numel() * job.src_w2.element_size()
        if _adjacent(job.src_w13, job.src_w2) and _adjacent(job.dst_w13, job.dst_w2):
            self._memcpy(job.dst_w13, job.src_w13, n13 + n2, lane)
        else:
            if n13:
                self._memcpy(job.dst_w13, job.src_w13, n13, lane)
            if n2:
                self._memcpy(job.dst_w2, job.src_w2, n2, lane)

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


def make_copy_engine(device: torch.device | str, delay_s: float = 0.0, threaded: bool = True) -> CopyEngine:
    """The engine for ``device``: CUDA side stream on GPUs, a copy thread (or inline) on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaCopyEngine(device)
    return ThreadCopyEngine(delay_s) if threaded else SyncCopyEngine(delay_s)
