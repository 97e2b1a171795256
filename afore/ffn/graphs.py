"""CUDA graphs of the FFN step, one per (layer, bucketed token count), as vLLM does for decode.

A step of T tokens runs the graph of the smallest bucket B >= T: the inputs are copied into
the bucket's static buffers (rows T..B-1 keep stale values that no kernel reads: the route
kernel takes the pair count n = T*k from the device plan table), the current plan is uploaded
into the layer's device table (``afore.ffn.device_plan``), and the graph is replayed. Nothing
in the captured region depends on the plan's values, so a new plan (new slot map, copies just
committed) replays the same graph at the same cost. The migrator's replica copies stay
outside the graph: they run on the copy engine's side stream, and ``Migrator.commit`` makes the
compute stream wait on their events before the replay is enqueued (stream order covers the
graph like any kernel).

Static buffers depend only on the shapes, so every layer of a worker shares them
(``StaticInputs``, one set per bucket); each layer captures its own graphs because they bind
its slot pool and its device table.

Host-fed steps (the shm transport's GPU workers, ``FFNLayer.forward_host_routed``): the
inputs arrive in host memory. Each bucket has one packed input buffer on the device, [local plan
table | ids | weights | row index | rows], mirrored in pinned host memory (``FedBucket``); its
graph (``StepGraphs.capture_fed``) gathers the step's rows on the device (``rows[index]``, the
kept tokens) and runs the step on them with the table, ids and weights of the buffer. A host-fed
step is the host writing the mirror (``afore._ffn.route_local``: eq. 11, the kept tokens' ids and
weights and the local table), the rows reaching the buffer's row block, one replay and the output
rows: four CUDA calls, where copying each input and uploading the table one by one took ten. The
rows reach it one of two ways: the transport's copies straight from its page-locked slots into the
device row block (``rows_on_device``: every row of the target, index = the kept tokens; no host
gather, the DMA engine moves them), or the host gathering the kept rows into the mirror (index =
0..U-1), copied with the mirror's prefix. The output stays on the device when the transport copies
it into its own slots (``device_out``); else it comes back into pinned memory, waited for once.
"""

from __future__ import annotations

import dataclasses

import torch

from afore.ffn.experts import DECODE_CONFIGS, StepBuffers, StepConfig, default_step_config, routed_expert_step

#: Token buckets captured by default (vLLM's decode capture sizes are similar).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket_for(tokens: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``tokens``, or None if it exceeds every bucket."""
    for b in buckets:
        if tokens <= b:
            return b
    return None


@dataclasses.dataclass
class StaticInputs:
    """The fixed-address tensors one bucket's graphs read and write.

    hidden [B, H] (dtype); ids int32[B, k]; weights fp32[B, k]; out [B, H]; buffers: the
    step's scratch for B*k pairs."""

    hidden: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    buffers: StepBuffers
    config: StepConfig


#: byte alignment of each block of a packed host-fed input buffer (Triton's vectorised loads)
_FED_ALIGN = 256


def _align(n: int) -> int:
    return -(-n // _FED_ALIGN) * _FED_ALIGN


class FedBucket:
    """The packed input buffer of a ``bucket``-token host-fed step, on the device (``device``) and
    in pinned host memory (``host``): int32 table [table_len] | int32 ids [B, k] | fp32 weights
    [B, k] | int64 row index [B] | rows [B, H] (dtype), each block ``_FED_ALIGN``-aligned;
    ``dev_*``/``host_*`` are the views of each. The graph runs the step on ``dev_gathered`` [B, H]
    = ``dev_rows[dev_index]`` (device only; index entries past a step's U keep earlier values, all
    below B). ``out_host`` [B, H] (pinned) receives the output rows; ``event`` is what the host
    waits on. ``prefix(rows)``: the bytes that hold a step's inputs with ``rows`` rows in the
    mirror (0: the rows reach the device another way, ``FFNLayer.forward_host_routed``)."""

    def __init__(self, bucket: int, top_k: int, hidden: int, table_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        elt = torch.empty(0, dtype=dtype).element_size()
        self.bucket, self.hidden, self.elt = bucket, hidden, elt
        self.o_ids = _align(4 * table_len)
        self.o_weights = self.o_ids + _align(4 * bucket * top_k)
        self.o_index = self.o_weights + _align(4 * bucket * top_k)
        self.o_rows = self.o_index + _align(8 * bucket)
        total = self.o_rows + _align(elt * bucket * hidden)
        self.device = torch.zeros(total, dtype=torch.uint8, device=device)
        self.host = torch.zeros(total, dtype=torch.uint8, pin_memory=True)

        def views(buf):
            return (buf[:4 * table_len].view(torch.int32),
                    buf[self.o_ids:self.o_ids + 4 * bucket * top_k].view(torch.int32).view(bucket, top_k),
                    buf[self.o_weights:self.o_weights + 4 * bucket * top_k].view(torch.float32).view(bucket, top_k),
                    buf[self.o_index:self.o_index + 8 * bucket].view(torch.int64),
                    buf[self.o_rows:self.o_rows + elt * bucket * hidden].view(dtype).view(bucket, hidden))

        self.dev_table, self.dev_ids, self.dev_weights, self.dev_index, self.dev_rows = views(self.device)
        self.host_table, self.host_ids, self.host_weights, self.host_index, self.host_rows = views(self.host)
        self.dev_gathered = torch.zeros(bucket, hidden, dtype=dtype, device=device)
        self.identity = torch.arange(bucket, dtype=torch.int64)  # the row index of host-gathered rows
        self.out_host = torch.zeros(bucket, hidden, dtype=dtype, pin_memory=True)
        self.event = torch.cuda.Event()

    def prefix(self, rows: int) -> int:
        return self.o_rows + self.elt * rows * self.hidden


_SHARED: dict[tuple, StaticInputs] = {}
_FED: dict[tuple, FedBucket] = {}
_CONFIGS: dict[tuple, StepConfig] = {}
_POOLS: dict[torch.device, object] = {}


def static_inputs(bucket: int, top_k: int, hidden: int, intermediate: int, num_slots: int, num_experts: int,
                  dtype: torch.dtype, device: torch.device, config: StepConfig) -> StaticInputs:
    """The shared static tensors of one bucket (allocated on first use)."""
    key = (device, dtype, bucket, top_k, hidden, intermediate, num_slots, num_experts, config)
    if key not in _SHARED:
        _SHARED[key] = StaticInputs(
            torch.zeros(bucket, hidden, dtype=dtype, device=device),
            torch.zeros(bucket, top_k, dtype=torch.int32, device=device),
            torch.zeros(bucket, top_k, dtype=torch.float32, device=device),
            torch.zeros(bucket, hidden, dtype=dtype, device=device),
            StepBuffers(bucket * top_k, num_slots, hidden, intermediate, num_experts, dtype, device, config.block_m),
            config)
    return _SHARED[key]


def fed_bucket(bucket: int, top_k: int, hidden: int, table_len: int, dtype: torch.dtype,
               device: torch.device) -> FedBucket:
    """The worker's packed input buffer of ``bucket``-token host-fed steps (shared by its layers)."""
    key = (device, dtype, bucket, top_k, hidden, table_len)
    if key not in _FED:
        _FED[key] = FedBucket(bucket, top_k, hidden, table_len, dtype, device)
    return _FED[key]


def tuned_config(bucket: int, top_k: int, w13: torch.Tensor, w2: torch.Tensor, num_experts: int, table: torch.Tensor,
                 errors: torch.Tensor, candidates: tuple[StepConfig, ...] = DECODE_CONFIGS, reps: int = 10) -> StepConfig:
    """The fastest candidate for a ``bucket``-token step on these weights' shapes (timed once
    per shape and bucket, with the device table as it is: call with a plan uploaded).
    Synchronises: for capture time only."""
    device = w13.device
    key = (device, w13.dtype, bucket, top_k, tuple(w13.shape), tuple(w2.shape), num_experts)
    if key in _CONFIGS:
        return _CONFIGS[key]
    gen = torch.Generator(device="cpu").manual_seed(bucket)
    x = torch.randn(bucket, w13.shape[2], generator=gen).to(device, w13.dtype)
    ids = torch.randint(0, num_experts, (bucket, top_k), generator=gen, dtype=torch.int32).to(device)
    weights = torch.rand(bucket, top_k, generator=gen).to(device)
    scratch_errors = torch.zeros_like(errors)
    best, best_ms = None, float("inf")
    for cfg in candidates:
        buffers = StepBuffers(bucket * top_k, w13.shape[0], w13.shape[2], w2.shape[2], num_experts, w13.dtype, device,
                              cfg.block_m)

        def step():
            routed_expert_step(x, ids, weights, table, w13, w2, scratch_errors, num_experts, "triton", cfg, buffers)

        try:
            for _ in range(3):
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                step()
            end.record()
            end.synchronize()
        except Exception:  # noqa: BLE001 - a config that does not compile or fit is skipped
            continue
        ms = start.elapsed_time(end) / reps
        if ms < best_ms:
            best, best_ms = cfg, ms
    _CONFIGS[key] = best or default_step_config(bucket * top_k / max(1, w13.shape[0]))
    return _CONFIGS[key]


class StepGraphs:
    """The captured steps of one layer: ``run`` replays the bucket's graph for T tokens.

    w13 [K, 2I, H], w2 [K, H, I]: the layer's slot pool; table: its device plan table;
    errors: int32[1], its input-error counter. A bucket is captured on first use
    (``capture`` ahead of serving avoids that pause)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, table: torch.Tensor, errors: torch.Tensor,
                 num_experts: int, top_k: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS, tune: bool = True) -> None:
        if not w13.is_cuda:
            raise ValueError(f"w13: CUDA graphs need CUDA tensors, got {w13.device}")
        if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] < 1:
            raise ValueError(f"buckets: expected increasing positive token counts, got {buckets}")
        self.w13, self.w2, self.table, self.errors = w13, w2, table, errors
        self.num_experts = num_experts
        self.top_k = top_k
        self.buckets = tuple(buckets)
        self.tune = tune
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[int, StaticInputs] = {}
        self.fed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.fed_out: dict[int, torch.Tensor] = {}
        self.replays = 0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _bucket_inputs(self, bucket: int) -> tuple[StepConfig, StaticInputs]:
        device = self.w13.device
        cfg = (tuned_config(bucket, self.top_k, self.w13, self.w2, self.num_experts, self.table, self.errors)
               if self.tune else default_step_config(bucket * self.top_k / max(1, self.w13.shape[0])))
        return cfg, static_inputs(bucket, self.top_k, self.w13.shape[2], self.w2.shape[2], self.w13.shape[0],
                                  self.num_experts, self.w13.dtype, device, cfg)

    def capture(self, bucket: int) -> None:
        """Capture the step for ``bucket`` tokens (tunes the config first if asked); synchronises."""
        cfg, st = self._bucket_inputs(bucket)

        def step():
            routed_expert_step(st.hidden, st.ids, st.weights, self.table, self.w13, self.w2, self.errors,
                               self.num_experts, "triton", cfg, st.buffers, st.out)

        self.graphs[bucket] = self._capture(step)
        self.inputs[bucket] = st

    def fed(self, tokens: int) -> FedBucket:
        """The packed input buffer of ``tokens``' bucket (not captured here)."""
        bucket = bucket_for(tokens, self.buckets)
        if bucket is None:
            raise ValueError(f"tokens: {tokens} exceed the largest captured bucket {self.max_tokens}")
        return fed_bucket(bucket, self.top_k, self.w13.shape[2], self.table.numel(), self.w13.dtype, self.w13.device)

    def capture_fed(self, bucket: int) -> None:
        """Capture the host-fed step for ``bucket`` tokens: the rows gathered on the device by the
        row index, then the step on the views of the bucket's packed device buffer (``FedBucket``:
        its table, ids, weights); synchronises. The warm-up run before the capture computes no
        pair (its table's pair count is 0)."""
        cfg, st = self._bucket_inputs(bucket)
        fed = self.fed(bucket)
        fed.dev_table.copy_(self.table)
        fed.dev_table[-1] = 0

        def step():
            torch.index_select(fed.dev_rows, 0, fed.dev_index, out=fed.dev_gathered)
            routed_expert_step(fed.dev_gathered, fed.dev_ids, fed.dev_weights, fed.dev_table, self.w13, self.w2,
                               self.errors, self.num_experts, "triton", cfg, st.buffers, st.out)

        self.fed_graphs[bucket] = self._capture(step)
        self.fed_out[bucket] = st.out

    def run_fed(self, tokens: int, bucket: int, rows_on_device: bool = False,
                device_out: bool = False) -> torch.Tensor:
        """The host-fed step of ``tokens`` tokens, whose inputs and local table (n = tokens * k)
        the host wrote into ``fed(bucket)``'s mirror (``bucket`` >= tokens: the bucket of the
        target's token count, known before the worker's own is), the row index included: one
        copy of the mirror's prefix (with its ``tokens`` rows, or none when ``rows_on_device``:
        the caller copied the rows into ``fed.dev_rows`` on this stream), the replay, the output
        rows copied back, one wait. Returns them ([tokens, H], pinned host memory, overwritten by
        the next host-fed step of the bucket), or with ``device_out`` the bucket's device output
        rows, not waited for (overwritten by its next replay)."""
        if bucket not in self.buckets or not 0 < tokens <= bucket:
            raise ValueError(f"tokens, bucket: expected 0 < tokens <= bucket, a bucket of {self.buckets}, "
                             f"got {tokens}, {bucket}")
        if bucket not in self.fed_graphs:
            self.capture_fed(bucket)
        fed = self.fed(bucket)
        size = fed.prefix(0 if rows_on_device else tokens)
        fed.device[:size].copy_(fed.host[:size], non_blocking=True)
        self.fed_graphs[bucket].replay()
        self.replays += 1
        if device_out:
            return self.fed_out[bucket][:tokens]
        out = fed.out_host[:tokens]
        out.copy_(self.fed_out[bucket][:tokens], non_blocking=True)
        fed.event.record()
        fed.event.synchronize()
        return out

    def _capture(self, step) -> torch.cuda.CUDAGraph:
        device = self.w13.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()  # compiles the kernels outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        if device not in _POOLS:
            _POOLS[device] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's transport thread keeps receiving (and copying) while a bucket
        # is captured on first use; in the default global mode any of its CUDA calls would
        # invalidate the capture ("operation failed due to a previous error during capture")
        with torch.cuda.graph(graph, pool=_POOLS[device], capture_error_mode="thread_local"):
            step()
        torch.cuda.synchronize(device)
        return graph

    def input_buffers(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (hidden [T, H], ids int32 [T, k], weights fp32 [T, k]) of the static buffers of
        ``tokens``' bucket (captured now if needed): a transport that receives into them saves
        the step its input copies."""
        bucket = bucket_for(tokens, self.buckets)
        if bucket is None:
            raise ValueError(f"tokens: {tokens} exceed the largest captured bucket {self.max_tokens}")
        if bucket not in self.graphs:
            self.capture(bucket)
        st = self.inputs[bucket]
        return st.hidden[:tokens], st.ids[:tokens], st.weights[:tokens]

    def run(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Copy the inputs into the bucket's buffers and replay (the device table must hold this
        step's plan and n = T*k already). Returns a new [T, H] tensor (the bucket's output
        buffer is overwritten by the next replay)."""
        t = hidden.shape[0]
        bucket = bucket_for(t, self.buckets)
        if bucket is None:
            raise ValueError(f"hidden: {t} tokens exceed the largest captured bucket {self.max_tokens}")
        if bucket not in self.graphs:
            self.capture(bucket)
        st = self.inputs[bucket]
        # inputs received straight into the bucket's buffers (``input_buffers``) need no copy
        for dst, src in ((st.hidden, hidden), (st.ids, topk_ids), (st.weights, topk_weights)):
            if src.data_ptr() != dst.data_ptr() or src.dtype != dst.dtype:
                dst[:t].copy_(src)
        self.graphs[bucket].replay()
        self.replays += 1
        return st.out[:t].clone()
