"""``FFNLayer``: one MoE layer's routed experts on one FFN worker.

forward(hidden [N, H], topk_ids int32 [N, k], topk_weights fp32 [N, k], plan, worker)
  -> this worker's partial output [N, H]

Exact partition (eq. 11, ``afore.ffn.partition``) selects this worker's token-expert pairs,
the plan's slot bindings sigma map their logical experts to physical slots of the slot pool,
and the grouped GEMM (``afore.ffn.experts``) computes them with the routing weights applied.
The sum of the partial outputs over all F workers equals the monolithic MoE layer
(invariant 1).

The step reads nothing back to the host between its inputs and its output:

- the plan reaches the device as this worker's plan table (``afore.ffn.device_plan``),
  validated and converted on the host when the worker calls ``stage_plan(plan)`` (when the
  plan arrives; ``forward`` stages it itself if that was not done), and uploaded at the
  microbatch boundary by one copy from pinned memory;
- ``check_inputs`` checks shapes and dtypes only; ids outside [0, E) run nowhere and are
  counted on the device (``input_errors()`` reads the count, off the hot path);
- on CUDA, steps of up to ``graph_buckets[-1]`` tokens replay a CUDA graph per token bucket
  (``afore.ffn.graphs``); larger ones (prefill) launch the same kernels directly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from afore.ffn.device_plan import DevicePlan, table_width
from afore.ffn.experts import (LAYER_BACKENDS, PREFILL_CONFIGS, StepConfig, grouped_expert_mlp, host_pairs, host_sparse_step,
                               routed_expert_step, triton_available)
from afore.ffn.graphs import DEFAULT_BUCKETS, StepGraphs, tuned_config
from afore.ffn.partition import worker_mask
from afore.migrator.slot_pool import SlotPool
from afore.plan import Plan, Target, primary_only_plan


class FFNLayer:
    """Routed experts of one layer on one worker, computing that worker's share of a plan.

    backend: ``auto`` (triton on CUDA, torch on CPU), ``triton``, ``torch`` (torch ops, no host
    read) or ``loop`` (the per-expert matmul reference, which reads counts back to the host).
    graphs: replay CUDA graphs for bucketed token counts (CUDA + triton only); ``graph_buckets``:
    the token buckets; ``tune``: time the step's tile configs once per bucket at capture."""

    def __init__(self, pool: SlotPool, backend: str = "auto", block_m: int | None = None, graphs: bool = True,
                 graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS, tune: bool = True,
                 config: StepConfig | None = None) -> None:
        if backend not in LAYER_BACKENDS:
            raise ValueError(f"backend: expected one of {LAYER_BACKENDS}, got {backend!r}")
        self.pool = pool
        if backend == "auto":
            backend = "triton" if pool.device.type == "cuda" and triton_available() else "torch"
        self.backend = backend
        self.block_m = block_m or pool.shape.m_tile
        self.config = config
        self._owner = torch.as_tensor(pool.shape.primary_owner, dtype=torch.int64, device=pool.device)
        self.plan_table = DevicePlan(pool.shape, pool.worker, pool.num_slots, pool.device)
        self.errors = torch.zeros(1, dtype=torch.int32, device=pool.device)
        self.graphs = None
        self.host_feeding = True   # forward_host_routed replays host-fed graphs (StepGraphs.capture_fed)
        if graphs and backend == "triton" and pool.device.type == "cuda":
            self.graphs = StepGraphs(pool.w13, pool.w2, self.plan_table.table, self.errors, pool.shape.num_experts,
                                     pool.shape.top_k, graph_buckets, tune)

    def check_inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Shapes, dtypes and devices (metadata only: no value is read, so no host sync).
        Ids outside [0, E) are counted on the device instead (``input_errors``)."""
        h, k = self.pool.hidden, self.pool.shape.top_k
        if hidden.dim() != 2 or hidden.shape[1] != h:
            raise ValueError(f"hidden: expected shape [N, {h}], got {tuple(hidden.shape)}")
        n = hidden.shape[0]
        if tuple(topk_ids.shape) != (n, k):
            raise ValueError(f"topk_ids: expected shape [{n}, {k}], got {tuple(topk_ids.shape)}")
        if tuple(topk_weights.shape) != (n, k):
            raise ValueError(f"topk_weights: expected shape [{n}, {k}], got {tuple(topk_weights.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids: expected dtype int32, got {topk_ids.dtype}")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"topk_weights: expected a floating dtype, got {topk_weights.dtype}")
        device = self.pool.device
        for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t.device != device:
                raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")

    def stage_plan(self, plan: Plan) -> None:
        """Validate and convert ``plan`` for this worker now (host only; call when the plan
        arrives, so that ``forward`` finds it ready). ValueError names the bad field."""
        self.plan_table.stage(plan)

    def capture_graphs(self, buckets: tuple[int, ...] | None = None, host_fed: bool = False) -> None:
        """Capture (and tune) the step's graph for each token bucket now, e.g. at start-up, so
        that no step pays for it (synchronises; a no-op without graphs). ``host_fed``: the graphs
        of ``forward_host_routed`` (the step on a bucket's packed input buffer,
        ``StepGraphs.capture_fed``) instead of those of ``forward``; if they cannot be captured,
        host-fed steps take the launched path (logged once)."""
        if self.graphs is None:
            return
        shape = self.pool.shape
        table = self._primary_table()
        for bucket in buckets or self.graphs.buckets:
            if bucket not in (self.graphs.fed_graphs if host_fed else self.graphs.graphs):
                self.plan_table.upload(table, bucket * shape.top_k)
                if not host_fed:
                    self.graphs.capture(bucket)
                elif self.host_feeding:
                    self._capture_fed(bucket)

    def tune_large_steps(self, max_tokens: int) -> list[int]:
        """Time the launched (beyond the graph buckets) step's kernel configs now, for every
        power-of-two size up to ``max_tokens`` tokens, as ``capture_graphs`` does for the buckets:
        the first step of a new size would otherwise compile and time every candidate on the
        serving path (2.4-2.7 s of one target on an H100 when a re-placement first gave a worker
        512 of 1024 tokens, bench/results/ab_gpu_h100_s25_*). The configs are kept per process
        and weight shape, so the layers after the first find them. Returns the sizes tuned
        ([] without graphs or tuning, or when every size fits a bucket). Synchronises."""
        if self.config is not None or self.graphs is None or not self.graphs.tune or max_tokens <= self.graphs.max_tokens:
            return []
        shape = self.pool.shape
        table = self._primary_table()
        sizes = []
        size = 1 << self.graphs.max_tokens.bit_length()  # the smallest power of two above the largest bucket
        while True:
            self.plan_table.upload(table, min(size, max_tokens) * shape.top_k)
            self._large_step_config(size)
            sizes.append(size)
            if size >= max_tokens:
                return sizes
            size *= 2

    def _primary_table(self) -> np.ndarray:
        """The staged plan table of a primary-only plan: what start-up captures and tunes under."""
        shape = self.pool.shape
        return self.plan_table.stage(primary_only_plan(shape, np.zeros(shape.num_experts, np.int64), Target(0, 0, 0), 0))

    def _capture_fed(self, bucket: int) -> bool:
        try:
            self.graphs.capture_fed(bucket)
        except RuntimeError as exc:  # e.g. no pinned memory left: the launched path (a copy per input) instead
            import logging

            logging.getLogger(__name__).warning("host-fed FFN step graphs unavailable (%s): copies are launched "
                                                "one by one", str(exc).splitlines()[0])
            self.host_feeding = False
        return self.host_feeding

    def input_buffers(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where a transport can receive a ``tokens``-token microbatch of this layer so that
        ``forward`` skips its input copies: (hidden [T, H], ids int32 [T, k], weights fp32 [T, k])
        views of the graph bucket's static buffers (shared by the layers of this worker: valid
        until the next forward of any layer), or None without graphs or beyond the buckets."""
        if self.graphs is None or tokens > self.graphs.max_tokens or tokens < 1:
            return None
        if self.graphs.inputs.get(self._bucket(tokens)) is None:
            self.capture_graphs((self._bucket(tokens),))
        return self.graphs.input_buffers(tokens)

    def _bucket(self, tokens: int) -> int:
        from afore.ffn.graphs import bucket_for

        return bucket_for(tokens, self.graphs.buckets)

    def input_errors(self) -> int:
        """Pairs with an id outside [0, E) seen so far (reads the device counter: a host sync,
        so call it off the hot path, e.g. with the worker's periodic report)."""
        return int(self.errors.item())

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                plan: Plan, worker: int | None = None) -> torch.Tensor:
        worker = self.pool.worker if worker is None else worker
        if worker != self.pool.worker:
            raise ValueError(f"worker: expected {self.pool.worker} (this layer's pool), got {worker}")
        if self.backend == "loop":
            return self._loop_forward(hidden, topk_ids, topk_weights, plan, worker)
        self.check_inputs(hidden, topk_ids, topk_weights)
        table = self.plan_table.stage(plan)
        n, k = topk_ids.shape
        if n == 0:
            return torch.zeros(0, self.pool.hidden, dtype=self.pool.dtype, device=self.pool.device)
        hidden = hidden.to(self.pool.dtype)
        self.plan_table.upload(table, n * k)
        if self.graphs is not None and n <= self.graphs.max_tokens:
            return self.graphs.run(hidden, topk_ids, topk_weights)
        return routed_expert_step(hidden.contiguous(), topk_ids.contiguous(), topk_weights.float().contiguous(),
                                  self.plan_table.table, self.pool.w13, self.pool.w2, self.errors,
                                  self.pool.shape.num_experts, self.backend, self._large_step_config(n))

    def _large_step_config(self, n: int) -> StepConfig | None:
        """The kernel config of a step beyond the graph buckets (prefill): the fastest prefill
        config, timed once per power-of-two size (with graphs and tuning), else the default."""
        if self.config is not None or self.graphs is None or not self.graphs.tune:
            return self.config
        return tuned_config(1 << (n - 1).bit_length(), self.pool.shape.top_k, self.pool.w13, self.pool.w2,
                            self.pool.shape.num_experts, self.plan_table.table, self.errors, PREFILL_CONFIGS, reps=3)

    __call__ = forward

    @property
    def sparse_on_host(self) -> bool:
        """Whether ``forward_sparse`` runs here: a CPU pool on the torch backend."""
        return self.pool.device.type == "cpu" and self.backend == "torch"

    def forward_sparse(self, rows_for, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU pools: this worker's partial sums only for the tokens it computes a pair of, as
        (tokens int64 [U] ascending, rows [U, H]); ``rows_for(tokens)`` gives a hidden tensor
        whose rows ``tokens`` hold the inputs (``Microbatch.rows_for``). The same pairs and
        arithmetic as ``forward`` (``afore.ffn.experts.host_sparse_step``), without a torch op
        per bookkeeping step."""
        if not self.sparse_on_host:
            raise ValueError(f"forward_sparse: a CPU pool on the torch backend, got {self.pool.device} / {self.backend}")
        k = self.pool.shape.top_k
        if topk_ids.dim() != 2 or topk_ids.shape[1] != k or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_ids, topk_weights: expected shape [N, {k}], got {tuple(topk_ids.shape)}, "
                             f"{tuple(topk_weights.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.device.type != "cpu":
            raise ValueError(f"topk_ids: expected int32 on the host, got {topk_ids.dtype} on {topk_ids.device}")
        table = self.plan_table.stage(plan)
        tokens, rows, bad = host_sparse_step(rows_for, topk_ids.numpy(), topk_weights, table, self.pool.w13,
                                             self.pool.w2, self.pool.shape.num_experts)
        if bad:
            self.errors += bad
        if rows.shape[1] != self.pool.hidden:
            raise ValueError(f"hidden: expected rows of {self.pool.hidden}, got {rows.shape[1]}")
        return tokens, rows

    def forward_host_routed(self, gather, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            plan: Plan, rows=None, device_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool fed by a host transport (shm; on a GPU: one synchronisation per step). The eq. 11
        bookkeeping runs in numpy on the host ids (``host_route``); the step runs on the tokens
        this worker computes a pair of, sent to the device with their routing by one batch of
        non-blocking copies from pinned memory, under a *local* plan table that selects exactly
        this worker's pairs among those tokens (its CUDA graph up to the largest bucket).

        The rows reach the device one of two ways: ``rows(dst)`` (a CUDA pool only) copies every
        row of the target, [N, H] in the pool's dtype, into the device tensor ``dst`` on the
        current stream (the shm transport's copies straight from its page-locked slots: no host
        gather), and the kept ones are gathered on the device; else ``gather(tokens, out)`` writes
        the kept tokens' rows into the host tensor ``out`` (a pinned staging buffer). The output
        comes back into pinned memory, waited for once; ``device_out`` (a CUDA pool): it stays on
        the device, not waited for: the caller copies it out and waits for the current stream before
        this worker's next step (which reuses the pinned inputs and the output buffer), as the shm
        transport's ``send`` of device rows does.

        topk_ids: int32 [N, k] on the host; topk_weights: fp32 [N, k] on the host. Returns (tokens
        int64 [U] ascending on the host, rows [U, H] in the pool's dtype: on the host unless
        ``device_out``; a buffer reused by the next call). The sum over the F workers is the dense
        layer (invariant 1)."""
        k = self.pool.shape.top_k
        if topk_ids.dim() != 2 or topk_ids.shape[1] != k or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_ids, topk_weights: expected shape [N, {k}], got {tuple(topk_ids.shape)}, "
                             f"{tuple(topk_weights.shape)}")
        if topk_ids.dtype != torch.int32 or not topk_ids.is_cpu or not topk_weights.is_cpu:
            raise ValueError(f"topk_ids, topk_weights: expected int32 ids and weights on the host, got "
                             f"{topk_ids.dtype} on {topk_ids.device}, {topk_weights.device}")
        device = self.pool.device
        cuda = device.type == "cuda"
        if (rows is not None or device_out) and not cuda:
            raise ValueError(f"rows, device_out: device copies need a CUDA pool, this one is on {device}")
        table = self.plan_table.stage(plan)
        n = topk_ids.shape[0]
        if self.graphs is not None and self.host_feeding and n <= self.graphs.max_tokens:
            out = self._host_fed_step(gather, topk_ids, topk_weights, table, rows, device_out)
            if out is not None:
                return out
        route = host_route(topk_ids.numpy(), table, self.pool.shape.num_experts)
        if route.dropped_errors:  # ids outside [0, E) on tokens the step does not see (it counts the others)
            self.errors += route.dropped_errors
        u = route.tokens.size
        h = self.pool.hidden
        staging = self._staging(u)
        tokens = torch.from_numpy(route.tokens)
        if u == 0:
            return tokens, (staging.out[:0] if not device_out else torch.empty(0, h, dtype=self.pool.dtype, device=device))
        if rows is None:
            gather(tokens, staging.rows[:u])
        torch.index_select(topk_ids, 0, tokens, out=staging.ids[:u])
        torch.index_select(topk_weights.float(), 0, tokens, out=staging.weights[:u])
        if not cuda:
            x, ids, w = staging.rows[:u], staging.ids[:u], staging.weights[:u]
        else:
            bufs = self.input_buffers(u) if self.graphs is not None else None
            if bufs is None:
                bufs = tuple(torch.empty(t[:u].shape, dtype=t.dtype, device=device)
                             for t in (staging.rows, staging.ids, staging.weights))
            if rows is None:
                bufs[0].copy_(staging.rows[:u], non_blocking=True)
            else:  # every row of the target to the device, the kept ones gathered there
                full = staging.device_rows(n)
                rows(full)
                staging.index[:u].copy_(tokens)
                index = staging.index[:u].to(device, non_blocking=True)
                torch.index_select(full, 0, index, out=bufs[0])
            for dst, src in zip(bufs[1:], (staging.ids, staging.weights)):
                dst.copy_(src[:u], non_blocking=True)
            x, ids, w = bufs
        self.plan_table.upload(route.local_table, u * k)
        if self.graphs is not None and u <= self.graphs.max_tokens:
            out = self.graphs.run(x, ids, w)
        else:
            out = routed_expert_step(x, ids, w, self.plan_table.table, self.pool.w13, self.pool.w2, self.errors,
                                     self.pool.shape.num_experts, self.backend, self._large_step_config(u))
        if not cuda:
            return tokens, out
        if device_out:
            return tokens, out
        staging.out[:u].copy_(out, non_blocking=True)
        staging.event.record()
        staging.event.synchronize()
        return tokens, staging.out[:u].view(u, h)

    def _host_fed_step(self, gather, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: np.ndarray,
                       rows=None, device_out: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``forward_host_routed`` in four CUDA calls (``StepGraphs.run_fed``): eq. 11, the kept
        tokens' ids and weights and the local table written by ``route_local`` straight into the
        bucket's pinned mirror, the rows (``rows``: every row copied into the bucket's device row
        block, the kept tokens as the row index; else this worker's rows gathered into the mirror,
        the identity as the index), then one copy, the replay, the rows back (unless
        ``device_out``), one wait. None: the host-fed graphs are unavailable (the caller launches
        the copies one by one)."""
        if _route_local is None:
            return None
        g = self.graphs
        n, k = topk_ids.shape
        bucket = self._bucket(n)
        if bucket not in g.fed_graphs and not self._capture_fed(bucket):
            return None
        fed = g.fed(n)
        ids = np.ascontiguousarray(topk_ids.numpy())
        weights = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
        weights = np.ascontiguousarray(weights.numpy())
        tokens = torch.empty(n, dtype=torch.int64)
        u, dropped = _route_local(ids.ctypes.data, weights.ctypes.data, n, k, table.ctypes.data, self.pool.shape.num_experts,
                                  self.plan_table.width, tokens.data_ptr(), fed.host_ids.data_ptr(),
                                  fed.host_weights.data_ptr(), fed.host_table.data_ptr())
        if dropped:  # ids outside [0, E) on tokens the step does not see (it counts the others)
            self.errors += dropped
        tokens = tokens[:u]
        if u == 0:
            return tokens, (fed.out_host[:0] if not device_out else g.fed_out[bucket][:0])
        if rows is not None:
            rows(fed.dev_rows[:n])
            fed.host_index[:u].copy_(tokens)
        else:
            gather(tokens, fed.host_rows[:u])
            fed.host_index[:u].copy_(fed.identity[:u])
        return tokens, g.run_fed(u, bucket, rows_on_device=rows is not None, device_out=device_out)

    def _staging(self, tokens: int) -> "HostStaging":
        """This device's host staging buffers, holding at least ``tokens`` rows (shared by the layers)."""
        key = (self.pool.device, self.pool.dtype, self.pool.hidden, self.pool.shape.top_k)
        st = _STAGING.get(key)
        if st is None or st.rows.shape[0] < tokens:
            st = _STAGING[key] = HostStaging(max(tokens, 2 * st.rows.shape[0] if st else 64), self.pool.hidden,
                                             self.pool.shape.top_k, self.pool.dtype, self.pool.device)
        return st

    def forward_pairs(self, rows_for, topk_ids: torch.Tensor, topk_weights: torch.Tensor, plan: Plan,
                      splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's token-expert pairs of ``plan`` (eq. 11) computed with vLLM's numerics
        (``afore.ffn.exact``): (pair indices int64 [P] ascending, t * k + j over the gathered
        tokens; rows [P, H], each weight x expert(token) rounded as vLLM rounds it). ``splits``:
        tokens per attention worker; each sender's tokens run as one call, as its own vLLM would
        run them (the kernel configuration depends on the token count). ``rows_for(tokens)``
        gives a hidden tensor whose rows ``tokens`` hold the inputs (``Microbatch.rows_for``)."""
        from afore.ffn.exact import pair_rows

        self.check_inputs(torch.empty(topk_ids.shape[0], self.pool.hidden, device=topk_ids.device), topk_ids, topk_weights)
        device, k = self.pool.device, topk_ids.shape[1]
        n = topk_ids.shape[0]
        if sum(splits) != n:
            raise ValueError(f"splits: expected tokens per attention worker summing to {n}, got {splits}")
        flat_ids = topk_ids.reshape(-1).long()
        mine = worker_mask(topk_ids, torch.from_numpy(plan.assignment).to(device), self._owner, self.pool.worker)
        slot_of_expert = torch.from_numpy(plan.slot[:, self.pool.worker].astype(np.int64)).to(device)
        pair_slot = torch.where(mine, slot_of_expert[flat_ids.clamp(0, self.pool.shape.num_experts - 1)], -1)
        pairs = mine.nonzero().squeeze(1)
        if pairs.numel() == 0:
            return pairs, torch.zeros(0, self.pool.hidden, dtype=self.pool.dtype, device=device)
        hidden = rows_for(torch.unique(pairs // k)).to(self.pool.dtype)
        rows, lo = [], 0
        for m in splits:
            if m:
                rows.append(pair_rows(hidden[lo:lo + m], pair_slot[lo * k:(lo + m) * k].view(m, k),
                                      topk_weights[lo:lo + m], self.pool.w13, self.pool.w2,
                                      self.pool.shape.num_experts).view(m * k, -1))
            lo += m
        return pairs, torch.cat(rows).index_select(0, pairs)

    def forward_pairs_host(self, gather, topk_ids: torch.Tensor, topk_weights: torch.Tensor, plan: Plan,
                           splits: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_pairs`` for a pool fed by a host transport (shm): the same pairs, the same
        kernel calls on the same inputs, so the same bits, without its host syncs. Eq. 11 runs on
        the host ids under this worker's plan table (``host_pairs``: the step's rule); only the
        tokens with a pair here are gathered (``gather(tokens, out)``, as ``forward_host_routed``),
        placed at their rows of a page-locked [N, H] buffer (other rows unspecified: no pair reads
        them), and sent with the pairs' slots (-1: computed elsewhere) and weights by one batch of
        non-blocking copies; each sender's tokens then run as one call of vLLM's kernels
        (``afore.ffn.exact.pair_rows``), and this worker's rows come back into page-locked memory,
        waited for once.

        topk_ids: int32 [N, k] on the host; topk_weights: fp32 [N, k] on the host. Returns (pair
        indices int64 [P] ascending, rows [P, H] in the pool's dtype: on the host for a CUDA pool,
        a buffer reused by the next call)."""
        from afore.ffn.exact import pair_rows

        k, num_experts = self.pool.shape.top_k, self.pool.shape.num_experts
        if topk_ids.dim() != 2 or topk_ids.shape[1] != k or tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_ids, topk_weights: expected shape [N, {k}], got {tuple(topk_ids.shape)}, "
                             f"{tuple(topk_weights.shape)}")
        if topk_ids.dtype != torch.int32 or not topk_ids.is_cpu or not topk_weights.is_cpu:
            raise ValueError(f"topk_ids, topk_weights: expected int32 ids and weights on the host, got "
                             f"{topk_ids.dtype} on {topk_ids.device}, {topk_weights.device}")
        n = topk_ids.shape[0]
        if sum(splits) != n:
            raise ValueError(f"splits: expected tokens per attention worker summing to {n}, got {splits}")
        table = self.plan_table.stage(plan)
        valid, ex, _ordinals, mine = host_pairs(np.ascontiguousarray(topk_ids.numpy()), table, num_experts)
        pairs = np.flatnonzero(mine)
        device, dtype, h = self.pool.device, self.pool.dtype, self.pool.hidden
        if pairs.size == 0:
            return torch.from_numpy(pairs), torch.zeros(0, h, dtype=dtype)
        ep = table_width(num_experts)
        st = self._pair_staging(n)
        tokens = torch.from_numpy(np.unique(pairs // k))
        compact = st.out[:tokens.numel()]  # scratch: the gathered rows, placed below before out is written
        gather(tokens, compact)
        st.rows[:n].index_copy_(0, tokens, compact)
        slot = torch.from_numpy(np.where(mine, table[2 * ep + ex], -1).astype(np.int32))
        st.slot[:n * k].copy_(slot)
        st.weights[:n * k].copy_(topk_weights.reshape(-1).float())
        st.pairs[:pairs.size].copy_(torch.from_numpy(pairs))
        cuda = device.type == "cuda"
        hidden, slots, weights, index = (t.to(device, non_blocking=cuda) for t in
                                         (st.rows[:n], st.slot[:n * k], st.weights[:n * k], st.pairs[:pairs.size]))
        rows, lo = [], 0
        for m in splits:
            if m:
                rows.append(pair_rows(hidden[lo:lo + m], slots[lo * k:(lo + m) * k].view(m, k),
                                      weights[lo * k:(lo + m) * k].view(m, k), self.pool.w13, self.pool.w2,
                                      num_experts).view(m * k, -1))
            lo += m
        out = (rows[0] if len(rows) == 1 else torch.cat(rows)).index_select(0, index)
        if not cuda:
            return torch.from_numpy(pairs), out
        host = st.out[:pairs.size]
        host.copy_(out, non_blocking=True)
        st.event.record()
        st.event.synchronize()
        return torch.from_numpy(pairs), host

    def _pair_staging(self, tokens: int) -> "PairStaging":
        """This device's host buffers of ``forward_pairs_host``, for at least ``tokens`` tokens."""
        key = ("pairs", self.pool.device, self.pool.dtype, self.pool.hidden, self.pool.shape.top_k)
        st = _STAGING.get(key)
        if st is None or st.rows.shape[0] < tokens:
            st = _STAGING[key] = PairStaging(max(tokens, 2 * st.rows.shape[0] if st else 64), self.pool.hidden,
                                             self.pool.shape.top_k, self.pool.dtype, self.pool.device)
        return st

    def _loop_forward(self, hidden, topk_ids, topk_weights, plan, worker):
        """The reference: eq. 11 mask + per-slot matmuls (reads counts back to the host)."""
        device = self.pool.device
        assignment = torch.from_numpy(plan.assignment).to(device)
        slot_of_expert = torch.from_numpy(plan.slot[:, worker].astype(np.int64)).to(device)
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1).long()
        mine = worker_mask(topk_ids, assignment, self._owner, worker)
        pair_token = torch.arange(flat_ids.numel(), device=device) // k
        pair_slot = torch.where(mine, slot_of_expert[flat_ids], -1)
        return grouped_expert_mlp(hidden, pair_token, pair_slot, topk_weights.reshape(-1).float(), self.pool.w13,
                                  self.pool.w2, backend="torch", block_m=self.block_m)


class HostStaging:
    """Host buffers of a host-routed step (``FFNLayer.forward_host_routed``): gathered rows,
    their ids and weights, and the output rows; pinned on a CUDA pool (non-blocking copies), with
    the event that the step's last copy records."""

    def __init__(self, tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.rows = torch.empty(tokens, hidden, dtype=dtype, pin_memory=pin)
        self.ids = torch.empty(tokens, top_k, dtype=torch.int32, pin_memory=pin)
        self.weights = torch.empty(tokens, top_k, dtype=torch.float32, pin_memory=pin)
        self.out = torch.empty(tokens, hidden, dtype=dtype, pin_memory=pin)
        self.index = torch.empty(tokens, dtype=torch.int64, pin_memory=pin)
        self.event = torch.cuda.Event() if pin else None
        self.hidden, self.dtype, self.device = hidden, dtype, device
        self._device_rows: torch.Tensor | None = None

    def device_rows(self, tokens: int) -> torch.Tensor:
        """A device tensor [tokens, H] that a transport copies a whole target's rows into (grown on
        demand; reused by the next step)."""
        if self._device_rows is None or self._device_rows.shape[0] < tokens:
            self._device_rows = torch.empty(tokens, self.hidden, dtype=self.dtype, device=self.device)
        return self._device_rows[:tokens]


class PairStaging:
    """Host buffers of ``FFNLayer.forward_pairs_host``: the target's rows [T, H], the pairs' slots
    and weights [T * k], this worker's pair indices and its output rows [T * k, H] (also the
    gather's scratch); pinned on a CUDA pool, with the event of the step's last copy."""

    def __init__(self, tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.rows = torch.empty(tokens, hidden, dtype=dtype, pin_memory=pin)
        self.slot = torch.empty(tokens * top_k, dtype=torch.int32, pin_memory=pin)
        self.weights = torch.empty(tokens * top_k, dtype=torch.float32, pin_memory=pin)
        self.pairs = torch.empty(tokens * top_k, dtype=torch.int64, pin_memory=pin)
        self.out = torch.empty(tokens * top_k, hidden, dtype=dtype, pin_memory=pin)
        self.event = torch.cuda.Event() if pin else None


_STAGING: dict[tuple, "HostStaging | PairStaging"] = {}


class HostRoute(NamedTuple):
    """This worker's share of one target, computed on the host (``host_route``).

    tokens: int64 [U] ascending, the tokens with at least one pair on this worker; local_table:
    the plan table (``afore.ffn.device_plan`` layout, n = 0) under which the step, given only
    those tokens in that order, runs exactly this worker's pairs; dropped_errors: ids outside
    [0, E) on the other tokens (the step counts those of ``tokens`` itself)."""

    tokens: np.ndarray
    local_table: np.ndarray
    dropped_errors: int


try:
    from afore._ffn import route_local as _route_local
except ImportError:  # an older build of the extension: numpy routes, the copies are launched one by one
    _route_local = None


def host_route(topk_ids: np.ndarray, table: np.ndarray, num_experts: int) -> HostRoute:
    """Eq. 11 for one worker on the host: which tokens it computes a pair of, and the local table.

    topk_ids: int [N, k] (the gathered routing of the target); table: this worker's plan table
    (``DevicePlan.stage``). The pairs of expert e that this worker runs have global ordinals in
    one interval [lo_e, hi_e); keeping only the tokens in ``tokens`` keeps every one of those
    pairs and their order, so among the kept pairs they are again one interval, starting at the
    number of kept pairs of e below lo_e: that is the local table's lo, and hi = lo + their count.
    """
    n, k = topk_ids.shape
    ep = table_width(num_experts)
    valid, ex, ordinals, mine = host_pairs(topk_ids, table, num_experts)
    lo = table[ex]
    has = mine.reshape(n, k).any(axis=1)
    tokens = np.flatnonzero(has)
    kept = np.repeat(has, k)
    before = kept & valid & ~mine & (ordinals < lo)   # kept pairs of e ranked below this worker's interval
    local = table.copy()
    start = np.bincount(ex[before], minlength=num_experts)[:num_experts].astype(np.int64)
    count = np.bincount(ex[mine], minlength=num_experts)[:num_experts].astype(np.int64)
    works = table[2 * ep: 2 * ep + num_experts] >= 0
    local[:num_experts] = np.where(works, start, 0)
    local[ep: ep + num_experts] = np.where(works, start + count, 0)
    local[3 * ep] = 0
    dropped = int(np.count_nonzero(~valid & ~kept))
    return HostRoute(tokens, local, dropped)
