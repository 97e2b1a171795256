"""Ping-pong microbatches on the attention side: the attention of microbatch b+1 runs while the
FFN pool computes microbatch b.

A decode step of M >= 2 requests is cut into M microbatches on request boundaries by vLLM's
own ubatch machinery (``maybe_create_ubatch_slices``, per-microbatch attention metadata from
``split_attn_metadata``, one metadata builder per microbatch); the model then runs once per
microbatch, each in a thread of its own, and exactly one thread runs at a time (a baton). At
every MoE layer, :func:`afore.attention.moe_proxy.RemoteRoutedExperts.remote_forward` posts its
microbatch's tokens (one target) and passes the baton on (:func:`yield_`), so the next
microbatch computes its attention while the FFN pool computes the posted target; it takes the
reply when the baton comes back. The targets reach the FFN pool in their sequence order:
(layer l, microbatch 0), (l, 1), ..., (l + 1, 0), ...; the FFN side is unchanged.

This is vLLM's dual-batch-overlap schedule (``vllm.v1.worker.ubatching``) without its CUDA
streams and its data-parallel coupling: it runs on CPU (where vLLM turns DBO off) and on GPU in
eager mode, and every attention worker decides on its own (a step that is not split posts its M
targets from one call, as before, so the targets agree across workers either way).

A step is split only when it is safe and it helps: at least M requests, no request that reads
KV-cache blocks computed in the same step (vLLM's prefix-hit hazard: every request with more than
one query token and computed tokens before this step keeps the step whole), no cascade attention,
no multimodal inputs. A split step runs eagerly (no CUDA graph): a CUDA-graph replay of the whole
model cannot stop at the exchange.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

log = logging.getLogger("afore.attention")


class PingPongError(RuntimeError):
    """Another microbatch of the same step failed; this one stops at its next exchange."""


class Baton:
    """M microbatch threads, one running at a time, handed on in a ring at each :meth:`pass_on`.

    Thread ``m`` runs only between its wake-up and its next ``pass_on`` or its end; the order of
    wake-ups is 0, 1, ..., M-1, 0, ... over the threads still running. An exception in one thread
    wakes the others with :class:`PingPongError` at their next ``pass_on``.
    """

    def __init__(self, count: int):
        if count < 2:
            raise ValueError(f"count: expected >= 2 microbatches, got {count}")
        self.count = count
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False] * count
        self.error: BaseException | None = None

    def _next(self, m: int) -> int | None:
        for step in range(1, self.count + 1):
            k = (m + step) % self.count
            if not self._done[k]:
                return k
        return None

    def wait_turn(self, m: int) -> None:
        with self._cond:
            while self._turn != m:
                self._cond.wait()
            if self.error is not None:
                raise PingPongError("another microbatch of this step failed") from self.error

    def pass_on(self, m: int) -> None:
        """Hand the baton to the next running microbatch and wait until it comes back."""
        with self._cond:
            nxt = self._next(m)
            if nxt is not None and nxt != m:
                self._turn = nxt
                self._cond.notify_all()
            while self._turn != m:
                self._cond.wait()
            if self.error is not None:
                raise PingPongError("another microbatch of this step failed") from self.error

    def finish(self, m: int, error: BaseException | None = None) -> None:
        with self._cond:
            self._done[m] = True
            if error is not None and self.error is None:
                self.error = error
            nxt = self._next(m)
            if nxt is not None:
                self._turn = nxt
            self._cond.notify_all()


_local = threading.local()


def current() -> int | None:
    """The microbatch index of the calling thread inside a ping-pong step, else None."""
    return getattr(_local, "microbatch", None)


def woke_ns() -> int:
    """``time.perf_counter_ns()`` when the calling microbatch thread first got the baton this step
    (its compute before the first MoE layer starts there; 0 outside a ping-pong step)."""
    return getattr(_local, "woke_ns", 0)


def yield_() -> None:
    """Called by the exchange after posting its target: let the next microbatch run; back here,
    this microbatch's forward context is the current one again."""
    _local.baton.pass_on(_local.microbatch)
    _local.enter()


class _Worker(threading.Thread):
    """One persistent thread per microbatch index >= 1 (index 0 runs on the caller's thread)."""

    def __init__(self, index: int):
        super().__init__(name=f"afore-microbatch-{index}", daemon=True)
        self.index = index
        self._job: tuple | None = None
        self._ready = threading.Event()
        self._finished = threading.Event()
        self.result: Any = None

    def submit(self, fn: Callable[[], Any], baton: Baton, enter: Callable[[], None]) -> None:
        self._job = (fn, baton, enter)
        self._finished.clear()
        self._ready.set()

    def join_job(self) -> Any:
        self._finished.wait()
        return self.result

    def run(self) -> None:
        while True:
            self._ready.wait()
            self._ready.clear()
            fn, baton, enter = self._job
            self._job = None
            self.result = _run_one(self.index, fn, baton, enter)
            self._finished.set()


def _run_one(index: int, fn, baton: Baton, enter) -> Any:
    _local.microbatch, _local.baton, _local.enter = index, baton, enter
    error = None
    result = None
    try:
        with torch.inference_mode():
            baton.wait_turn(index)
            _local.woke_ns = time.perf_counter_ns()
            enter()
            result = fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller through the baton
        error = exc
    finally:
        _local.microbatch = _local.baton = _local.enter = None
        baton.finish(index, error)
    return result


class PingPong:
    """Runs the M microbatch forwards of one step under one baton."""

    def __init__(self, count: int):
        self.count = count
        self._workers = [None] + [_Worker(m) for m in range(1, count)]
        for w in self._workers[1:]:
            w.start()
        self.num_threads = torch.get_num_threads()

    def run(self, fns: list[Callable[[], Any]], enters: list[Callable[[], None]]) -> list[Any]:
        """``fns[m]()`` in microbatch m's thread, after ``enters[m]()`` (its forward context)
        and again after every wake-up; returns their results in order, or raises the first
        microbatch's error (the others stop at their next exchange)."""
        if len(fns) != self.count:
            raise ValueError(f"fns: expected {self.count} microbatches, got {len(fns)}")
        baton = Baton(self.count)
        num_threads = torch.get_num_threads()
        for m in range(1, self.count):
            self._workers[m].submit(_threaded(fns[m], num_threads), baton, enters[m])
        results = [_run_one(0, fns[0], baton, enters[0])]
        results += [self._workers[m].join_job() for m in range(1, self.count)]
        if baton.error is not None:
            raise baton.error
        return results


def _threaded(fn, num_threads):
    """``fn`` with the caller's intra-op thread count, CUDA device and stream (all per thread)."""
    stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def call():
        if torch.get_num_threads() != num_threads:  # intra-op threads are per thread under OpenMP
            torch.set_num_threads(num_threads)
        if stream is None:
            return fn()
        torch.cuda.set_device(stream.device)
        with torch.cuda.stream(stream):  # the microbatches queue on one stream, in baton order
            return fn()
    return call


def request_cuts(num_scheduled: np.ndarray, count: int) -> list[int]:
    """Request indices ``[0, r1, ..., len]`` that cut a step into ``count`` non-empty microbatches
    on request boundaries with their token counts as even as the requests allow."""
    n = len(num_scheduled)
    if n < count:
        raise ValueError(f"num_scheduled: expected >= {count} requests, got {n}")
    before = np.concatenate([[0], np.cumsum(num_scheduled)])  # before[r]: tokens of requests < r
    total = int(before[-1])
    cuts = [0]
    for m in range(1, count):
        lo, hi = cuts[-1] + 1, n - (count - m)  # every microbatch keeps at least one request
        r = lo + int(np.argmin(np.abs(before[lo:hi + 1] - total * m / count)))
        cuts.append(r)
    cuts.append(n)
    return cuts


def split_is_safe(num_scheduled: np.ndarray, computed: np.ndarray, count: int) -> bool:
    """At least ``count`` requests and no request that reads this step's KV writes (more than one
    query token on top of tokens computed before: a prefix-cache hit may share blocks with another
    request's prefill in the same step)."""
    n = len(num_scheduled)
    if n < count:
        return False
    return not bool(np.any((num_scheduled[:n] > 1) & (computed[:n] > 0)))


class _Install:
    """Patches of vLLM's model runner; one per process."""

    def __init__(self, count: int):
        self.count = count
        self.live = threading.local()
        self.pingpong: PingPong | None = None
        self.steps = 0          # split steps run in this process (stats())


_installed: _Install | None = None


def stats() -> dict[str, int]:
    return {"split_steps": _installed.steps if _installed else 0}


def install(count: int) -> None:
    """Split safe decode steps into ``count`` ping-pong microbatches in this process's vLLM
    model runner (0.26 and 0.32 share the methods patched here). Idempotent."""
    global _installed
    if _installed is not None:
        return
    from vllm import forward_context as fc
    from vllm.v1.worker import gpu_model_runner as gmr
    from vllm.v1.worker import utils as wutils

    state = _installed = _Install(count)
    runner = gmr.GPUModelRunner

    create = wutils.AttentionGroup.create_metadata_builders

    def create_metadata_builders(self, *args, num_metadata_builders: int = 1, **kwargs):
        # one attention-metadata builder per microbatch (builders keep per-batch buffers)
        out = create(self, *args, num_metadata_builders=max(num_metadata_builders, count), **kwargs)
        # vLLM's _build_attention_metadata (0.26 and 0.32) caches a build by (KV-cache spec, builder
        # type), not by microbatch, and reuses it through update_block_table: microbatch 1 would
        # get microbatch 0's query_start_loc and seq_lens with its own block table (FlashAttention
        # on the H200 raised "batch_size must be equal to batch_size_k" at a 3 + 4 split; at equal
        # sizes the reused build carries the other microbatch's seq_lens). The builders of
        # microbatches >= 1 build their own.
        for builder in self.metadata_builders[1:]:
            builder.supports_update_block_table = False
        return out

    wutils.AttentionGroup.create_metadata_builders = create_metadata_builders

    execute = runner.execute_model

    def execute_model(self, *args, **kwargs):
        state.live.on = True
        try:
            return execute(self, *args, **kwargs)
        finally:
            state.live.on = False

    execute_model.__wrapped__ = execute
    runner.execute_model = execute_model

    determine = runner._determine_batch_execution_and_padding

    def determine_batch(self, *args, **kwargs):
        split = False
        if getattr(state.live, "on", False) and not kwargs.get("use_cascade_attn", False) \
                and kwargs.get("allow_microbatching", True) and not kwargs.get("num_encoder_reqs", 0):
            num_reqs = kwargs["num_reqs"]
            split = split_is_safe(kwargs["num_scheduled_tokens_np"],
                                  self.input_batch.num_computed_tokens_cpu[:num_reqs], count)
        if split:
            kwargs["force_eager"] = True
        mode, desc, should, across, stats_ = determine(self, *args, **kwargs)
        state.live.split = split
        return mode, desc, should or split, across, stats_

    runner._determine_batch_execution_and_padding = determine_batch

    make_slices = gmr.maybe_create_ubatch_slices
    from vllm.v1.worker import ubatch_utils

    def maybe_create_ubatch_slices(should_ubatch, num_scheduled_tokens, num_tokens_padded, num_reqs_padded,
                                   num_ubatches, *args, **kwargs):
        if not (should_ubatch and getattr(state.live, "split", False)):
            return make_slices(should_ubatch, num_scheduled_tokens, num_tokens_padded, num_reqs_padded, num_ubatches,
                               *args, **kwargs)
        bounds = request_cuts(num_scheduled_tokens, count)
        cu = np.concatenate([[0], np.cumsum(num_scheduled_tokens)])
        slices = [ubatch_utils.UBatchSlice(slice(a, b), slice(int(cu[a]), int(cu[b])))
                  for a, b in zip(bounds[:-1], bounds[1:])]
        return slices, ubatch_utils._pad_out_ubatch_slices(slices, num_tokens_padded, num_reqs_padded)

    gmr.maybe_create_ubatch_slices = maybe_create_ubatch_slices

    forward = runner._model_forward

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        ctx = fc.get_forward_context()
        slices = ctx.ubatch_slices
        if slices is None or not getattr(state.live, "split", False):
            return forward(self, input_ids=input_ids, positions=positions, intermediate_tensors=intermediate_tensors,
                           inputs_embeds=inputs_embeds, **model_kwargs)
        if model_kwargs or intermediate_tensors is not None:
            raise RuntimeError("afore ping-pong: a step with model kwargs or intermediate tensors was split")
        if state.pingpong is None:
            state.pingpong = PingPong(count)
        contexts = _ubatch_contexts(self, ctx, slices, fc)
        fns, enters = [], []
        for m, s in enumerate(slices):
            t = s.token_slice
            kw = dict(input_ids=None if input_ids is None else input_ids[t],
                      positions=positions[:, t] if positions.ndim == 2 else positions[t],
                      intermediate_tensors=None,
                      inputs_embeds=None if inputs_embeds is None else inputs_embeds[t])
            fns.append(lambda kw=kw: forward(self, **kw))
            enters.append(lambda c=contexts[m]: setattr(fc, "_forward_context", c))
        saved = fc._forward_context
        try:
            outs = state.pingpong.run(fns, enters)
        finally:
            fc._forward_context = saved
        state.steps += 1
        from afore.metrics.attention import count_pingpong_step

        count_pingpong_step(self.vllm_config.parallel_config.data_parallel_rank)
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))
        return torch.cat(outs, dim=0)

    _model_forward.__wrapped__ = forward
    runner._model_forward = _model_forward
    log.info("afore: ping-pong on, %d microbatches per decode step of >= %d requests", count, count)


def _ubatch_contexts(runner, ctx, slices, fc) -> list:
    """One forward context per microbatch: its attention metadata and slot mapping, no CUDA
    graph (as vLLM's UBatchWrapper builds them)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import DPMetadata

    parallel = runner.vllm_config.parallel_config
    out = []
    slot_mapping = ctx.slot_mapping if isinstance(ctx.slot_mapping, list) and ctx.slot_mapping else None
    for m, s in enumerate(slices):
        dp = None
        if ctx.dp_metadata is not None:
            across = torch.tensor([s.num_tokens] * parallel.data_parallel_size, device="cpu", dtype=torch.int32)
            dp = DPMetadata.make(parallel, s.num_tokens, across)
        is_padding = getattr(ctx, "is_padding", None)
        out.append(fc.create_forward_context(
            ctx.attn_metadata[m], runner.vllm_config, dp_metadata=dp, batch_descriptor=ctx.batch_descriptor,
            cudagraph_runtime_mode=CUDAGraphMode.NONE,
            slot_mapping=slot_mapping[m] if slot_mapping else None,
            is_padding=is_padding[s.token_slice] if is_padding is not None else None))
    return out
