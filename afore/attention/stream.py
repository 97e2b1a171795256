"""The exchange on the CUDA stream (``afore serve --exchange stream``): capturable, no Python per layer.

With ``--exchange host`` (the path of :mod:`afore.attention.moe_proxy`) every MoE layer call runs
on the Python host: post the tokens, wait for the replies, copy the sum to the device. It must
run eagerly, so it is a splitting op of vLLM's piecewise CUDA graphs: each layer costs the host
its Python, the graph pieces around it, and the GPU a sync; and afore's compiled graph differs
from plain vLLM's at every cut (the neighbours of the MoE op fuse differently), so under CUDA
graphs its bf16 output could not match plain vLLM's bit for bit.

Here a layer call only *enqueues*, on the current CUDA stream:

1. the copies of its tokens (rows, int32 ids, fp32 weights) into page-locked staging buffers;
2. a host node (``cuLaunchHostFunc``) that runs ``afore._shm.StreamExchange`` on the CUDA driver's
   thread when the stream reaches it: it numbers the target (step, layer, seq and message counter,
   as ``ForwardCounter`` does), posts it into the shm segment (the same message the host path
   writes) and waits for the F replies, combined into the staging output (fp32 partial sums in
   FFN-rank order, or every pair's row for ``--exact``) as the host path combines them;
3. the copy of the combined output back (and vLLM's ``moe_sum`` of the pair rows for ``--exact``).

All three are legal inside CUDA-graph capture, so the op needs no graph split: vLLM keeps its own
opaque ``moe_forward`` op and its own compile partition (plain vLLM's), and a decode step can be
one full CUDA graph. One set of staging buffers serves every layer: the stream orders layer l's
copy back before layer l + 1's copies in.

Needs the shm transport and one microbatch per layer call. The target's demand (its ids' counts
per expert) goes into the scheduler's mailbox from the node too, after the post, as the host
path on a GPU emits it (none under ``--planner workers``). A failure on the node (a dead FFN worker, a
timeout, a torn slot) cannot raise on the driver's thread: it is kept, the node's output and every
later node's are zeros, and the next layer call on the Python side raises it (``check``), which
fails vLLM's engine as a failed exchange does on the host path.

On a CPU tensor (tests) the node runs at once, on the calling thread: the same C++ code.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from afore.transport.shm import ShmAttentionEnd


class ExchangeFailed(RuntimeError):
    """An exchange that ran on a CUDA host node failed (the node's error, with its target)."""


@functools.cache
def _launch_host_func():
    """``cuLaunchHostFunc`` of the CUDA driver (the runtime's ``cudaLaunchHostFunc`` is the same
    call; the driver library is the one every CUDA process has loaded)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class StreamExchange:
    """Attention worker ``end.rank``'s exchange of ``layers`` MoE layer positions as host nodes.

    ``forward(layer, x, topk_weights, topk_ids, out)`` enqueues one layer call's exchange; it
    returns before anything ran on a CUDA device."""

    def __init__(self, end: ShmAttentionEnd, layers: int, mailbox: str = "", num_experts: int = 0) -> None:
        from afore._shm import StreamExchange as _Native

        if end._plane is None:
            raise RuntimeError("the stream exchange needs the native shm data plane (afore._shm.DataPlane): rebuild afore")
        lay = end.layout
        self.layout, self.device = lay, end.device
        pin = end.device.type == "cuda"
        t, h, k = lay.max_tokens, lay.hidden, lay.top_k
        # device="cpu" named: vLLM builds the model under a CUDA default device
        self.rows = torch.empty(t, h, dtype=lay.torch_dtype, device="cpu", pin_memory=pin)
        self.ids = torch.empty(t, k, dtype=torch.int32, device="cpu", pin_memory=pin)
        self.weights = torch.empty(t, k, dtype=torch.float32, device="cpu", pin_memory=pin)
        self.pairs = k if lay.exact else 1  # output rows per token
        self.out = torch.empty(t * self.pairs, h, dtype=lay.torch_dtype if lay.exact else torch.float32, device="cpu",
                               pin_memory=pin)
        self.native = _Native(end._plane, end.rank, layers, self.rows.data_ptr(), self.ids.data_ptr(),
                              self.weights.data_ptr(), self.out.data_ptr(), h * self.out.element_size(),
                              end.timeout_s, end.poll_s, end.spin_s, mailbox, num_experts, k)
        self._node = _Native.host_node_address()
        self._calls: dict[tuple[int, int], int] = {}
        self._end = end  # the segment's mapping must outlive every node

    def forward(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                out: torch.Tensor) -> None:
        self.check()
        lay = self.layout
        n = x.shape[0]
        if x.dim() != 2 or x.shape[1] != lay.hidden:
            raise ValueError(f"hidden: expected shape [n, {lay.hidden}], got {tuple(x.shape)}")
        if n > lay.max_tokens:
            raise ValueError(f"hidden: expected at most max_tokens={lay.max_tokens} tokens per target, got {n} "
                             f"(raise afore serve --max-num-batched-tokens)")
        if tuple(topk_ids.shape) != (n, lay.top_k) or tuple(topk_weights.shape) != (n, lay.top_k):
            raise ValueError(f"topk_ids, topk_weights: expected shape [{n}, {lay.top_k}], got "
                             f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
        cuda = x.is_cuda
        if n:
            self.rows[:n].copy_(x, non_blocking=cuda)
            self.ids[:n].copy_(topk_ids, non_blocking=cuda)
            self.weights[:n].copy_(topk_weights, non_blocking=cuda)
        if cuda:
            call = self._calls.get((layer, n))
            if call is None:
                call = self._calls[(layer, n)] = self.native.call(layer, n)
            stream = torch.cuda.current_stream(x.device).cuda_stream
            rc = _launch_host_func()(stream, self._node, call)
            if rc != 0:
                raise RuntimeError(f"cuLaunchHostFunc: CUDA driver error {rc}")
        else:  # on the calling thread: a failure is raised at once, not by the next call
            self.native.run(layer, n)
            self.check()
        if not n:
            return
        combined = self.out[:n * self.pairs].to(x.device, non_blocking=cuda)
        if lay.exact:
            from afore.ffn.exact import pair_sum

            out.copy_(pair_sum(combined.view(n, self.pairs, lay.hidden)))
        else:
            out.copy_(combined)  # fp32 partial sums -> the model's dtype, as the host path rounds them

    def check(self) -> None:
        """Raise ``ExchangeFailed`` if a node failed (every node after it output zeros)."""
        err = self.native.error()
        if err is not None:
            raise ExchangeFailed(f"afore: the exchange with the FFN pool failed on the CUDA stream: {err}")

    def drain(self, clock) -> int:
        """Hand the nodes' stamps since the last drain to ``clock`` (afore.attention.stages.StageClock:
        the afore_attention_* families and, with AFORE_STAGE_TRACE, the per-target CSV rows, in the
        host path's columns; stamps on the clock of time.perf_counter_ns); returns how many."""
        lay = self.layout
        row_bytes = lay.hidden * torch.empty(0, dtype=lay.torch_dtype).element_size()
        records = self.native.take_records()
        for step, layer, n, prev_done, enter, demand, sent, done, rows, seq in records:
            clock.record((step, layer, 0, n, prev_done, enter, demand, sent, demand, done,
                          n * (row_bytes + lay.top_k * 8), rows * (row_bytes + 4), seq))
        return len(records)

    def stats(self) -> dict[str, int]:
        """Nodes completed, the next step and message counter, rows received, time posting and
        waiting (ns, summed over nodes), demand reports put and lost."""
        names = ("calls", "step", "counter", "rows", "post_ns", "wait_ns", "demand_emitted", "demand_lost")
        return dict(zip(names, self.native.stats()))
