"""Remote-FFN MoE layer for the attention role.

vLLM's MoE runner keeps the gate, computes the routing once with the model's
own router and runs the shared experts; :class:`RemoteRoutedExperts` replaces
only the routed-expert part:

1. split the layer call's tokens into ``microbatches`` contiguous targets
   (every target exists on every attention worker, possibly empty, so the FFN
   side and the scheduler see the same target sequence from all A workers);
2. count the demand of each target and hand it to the demand path: before its
   tokens are posted where the ids are on the host (CPU); after, on a GPU through
   the shm transport, from the host copy of the ids that the post made;
3. post every target on the A2F path before waiting for any, so at least two
   targets are in flight at the FFN side;
4. gather the F2A partials and return their sum.

With ``microbatches`` >= 2 and ping-pong on (the default), vLLM's model runner splits a decode
step of at least M requests into M microbatches that run the model in turn
(:mod:`afore.attention.pingpong`); each layer call is then one target
(:meth:`RemoteRoutedExperts.pingpong_forward`): post it, let the next microbatch compute its
attention while the FFN pool computes this one, then take the reply.

Routed-expert weights are not created and checkpoint tensors for them are
dropped at load: they live on the FFN workers.

Targets: ``step`` counts forward passes of this engine (every data-parallel
rank runs the same passes, dummy ones included), ``layer`` is the MoE layer's
position, ``seq = (step * L + layer) * M + microbatch``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

import torch

from afore.attention import pingpong
from afore.attention import role as role_
from afore.attention import vllm_compat
from afore.attention.demand import DemandEmitter
from afore.attention.stages import StageClock
from afore.plan import Target

log = logging.getLogger("afore.attention")

_RoutedExperts, _FusedMoEMethodBase = vllm_compat.routed_experts_base()


class ForwardCounter:
    """Per-process forward-pass counter and the A2F link, shared by all MoE layers."""

    def __init__(self, cfg: role_.AttentionRoleConfig, worker: int):
        self.cfg = cfg
        self.step = -1
        self.worker = worker
        if not 0 <= self.worker < cfg.attn_workers:
            raise ValueError(f"data_parallel_rank: expected in [0, {cfg.attn_workers}) (attn_workers), got {self.worker}")
        self._link: TorchLink | None = None
        self._stream = None  # afore.attention.stream.StreamExchange with cfg.exchange "stream"
        self.clock = StageClock(self.worker)
        self.prev_exit_ns: dict[int, int] = {}  # ping-pong: per microbatch, when its last exchange ended
        if cfg.planner:  # this worker plans its own targets (afore serve --planner attention)
            from afore.attention.planner import InlinePlanner

            self.demand = InlinePlanner(cfg.planner, cfg.policy_board)
        else:
            self.demand = DemandEmitter(cfg.mailbox, cfg.num_experts, self.worker, cfg.demand,
                                        os.environ.get(role_.DEMAND_TOKEN_ENV, "") if cfg.demand else "")

    @property
    def link(self):
        if self._link is None:
            self._link = ShmLink(self.cfg, self.worker) if self.cfg.shm_segment else TorchLink(self.cfg, self.worker)
        return self._link

    @property
    def stream(self):
        """The exchange on the CUDA stream (afore.attention.stream), or None (the host exchange)."""
        if self._stream is None and self.cfg.exchange == "stream":
            from afore.attention.stream import StreamExchange

            self._stream = StreamExchange(self.link.end, len(self.cfg.moe_layers), self.cfg.mailbox, self.cfg.num_experts)
        return self._stream

    def seq(self, layer: int, microbatch: int) -> int:
        return Target(self.step, layer, microbatch).seq(len(self.cfg.moe_layers), self.cfg.microbatches)


class TorchLink:
    """The A2F/F2A path of one attention worker: ``afore.transport.connector.AttentionConnector``
    (torch.distributed; attention worker 0 hosts the store), ``send`` every microbatch, then
    ``recv`` them in order."""

    def __init__(self, cfg: role_.AttentionRoleConfig, worker: int):
        from afore.transport.connector import AttentionConnector, TransportConfig

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
        # same backend as the FFN workers: by default gloo on CPU, NCCL on CUDA (this process's
        # current GPU); gloo on CUDA stages through the host (workers sharing one GPU)
        cuda = cfg.device == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        tcfg = TransportConfig(host=cfg.store_host, port=cfg.store_port, num_attention=cfg.attn_workers,
                               num_ffn=cfg.ffn_workers, hidden=cfg.hidden, top_k=cfg.top_k, dtype=dtype,
                               backend=cfg.backend or ("nccl" if cuda else "gloo"), timeout_s=cfg.exchange_timeout_s,
                               store_on_rank0=cfg.store_master)
        self.conn = AttentionConnector(tcfg, worker, device)
        self.dtype = dtype
        self._pending: dict[int, object] = {}

    def send(self, seq, step, layer, microbatch, hidden, topk_ids, topk_weights) -> int:
        """Post one target to every FFN worker; returns the bytes sent (A2F, dense: F copies)."""
        target = Target(step, layer, microbatch)
        hidden = hidden.to(self.dtype)
        self._pending[seq] = self.conn.send(target, seq, hidden, topk_ids.to(torch.int32), topk_weights.to(torch.float32))
        n, k = topk_ids.shape
        return self.conn.cfg.num_ffn * n * (hidden.shape[1] * hidden.element_size() + k * 8)

    def recv(self, seq, num_tokens, hidden, dtype) -> tuple[torch.Tensor, int]:
        """The combined output of one target and the bytes received (F2A)."""
        out = self.conn.recv(self._pending.pop(seq))
        return out, out.numel() * out.element_size()

    def close(self) -> None:
        self.conn.close()


class ShmLink:
    """The A2F/F2A path through shared buffers on this node (``afore.transport.shm``): tokens
    written once, FFN workers read only the rows they compute and reply sparsely."""

    def __init__(self, cfg: role_.AttentionRoleConfig, worker: int):
        from afore.transport.shm import ShmAttentionEnd, ShmLayout

        layout = ShmLayout(num_attention=cfg.attn_workers, num_ffn=cfg.ffn_workers, hidden=cfg.hidden,
                           top_k=cfg.top_k, max_tokens=cfg.max_tokens, dtype=cfg.dtype, depth=cfg.depth,
                           exact=cfg.exact)
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        self.end = ShmAttentionEnd(cfg.shm_segment, layout, worker, device, timeout_s=cfg.exchange_timeout_s,
                                   spin_s=cfg.spin_us * 1e-6)
        self._pending: dict[int, object] = {}

    def send(self, seq, step, layer, microbatch, hidden, topk_ids, topk_weights) -> int:
        """Post one target; returns the bytes written (A2F)."""
        before = self.end.bytes_sent
        # the copies into the shared slot convert ids to int32 and weights to fp32
        self._pending[seq] = self.end.send(Target(step, layer, microbatch), seq, hidden, topk_ids, topk_weights)
        return self.end.bytes_sent - before

    def host_ids(self, seq) -> torch.Tensor:
        """The routing ids of in-flight target ``seq`` on the host (its request slot: int32 [n, k])."""
        return self.end.sent_ids(self._pending[seq])

    def recv(self, seq, num_tokens, hidden, dtype) -> tuple[torch.Tensor, int]:
        """The combined output of one target and the bytes read (F2A)."""
        before = self.end.bytes_received
        out = self.end.recv(self._pending.pop(seq))
        return out, self.end.bytes_received - before

    def close(self) -> None:
        self.end.close()


_state: ForwardCounter | None = None
_state_lock = threading.Lock()
_layers: dict[str, "RemoteRoutedExperts"] = {}


def _counter(worker: int) -> ForwardCounter:
    global _state
    with _state_lock:
        if _state is None:
            _state = ForwardCounter(role_.load_from_env(), worker)
        return _state


EXPERT_PARAMS = ("w13_weight", "w2_weight")


def _drop_expert_weight(param, loaded_weight, *args, return_success: bool = False, **kwargs):
    """Routed-expert checkpoint tensors are not kept on attention workers."""
    return True if return_success else None


class RemoteExpertsMethod(_FusedMoEMethodBase):
    """A modular 'quant method' with no weights: routing stays vLLM's, compute is remote."""

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs) -> None:
        # Empty placeholders: some models' load_weights (DeepSeek-V2/V3, GLM-4.5) look the
        # expert parameters up by name; their loader drops the checkpoint tensor.
        for name in EXPERT_PARAMS:
            param = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
            param.weight_loader = _drop_expert_weight
            layer.register_parameter(name, param)

    @property
    def supports_internal_mk(self) -> bool:
        # Tells the runner not to all-gather tokens across data-parallel ranks: each
        # attention worker sends its own tokens, the FFN side gathers all A of them.
        return True

    def get_fused_moe_quant_config(self, layer):
        return vllm_compat.unquantized_moe_config()

    def process_weights_after_loading(self, layer) -> None:
        return None

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        # Allocated here, inside the compiled graph: the op is a splitting op that runs eagerly
        # between CUDA-graph pieces, and the next piece reads its output at the address it was
        # captured with, so the buffer must come from the graph, not from the op.
        out = torch.empty_like(x)
        torch.ops.afore.remote_experts(x, topk_weights, topk_ids, out, layer.layer_name)
        return out


class RemoteRoutedExperts(_RoutedExperts):
    """vLLM ``RoutedExperts`` whose experts run on the FFN pool (registered out of tree)."""

    def __init__(self, layer_name: str, *args, **kwargs):
        super().__init__(layer_name, *args, **kwargs)
        if self.apply_router_weight_on_input:
            raise ValueError(f"{layer_name}: apply_router_weight_on_input models are not supported by the remote FFN path")
        cfg = role_.load_from_env()
        if vllm_compat.tensor_parallel_size() != 1:
            raise ValueError(f"{layer_name}: tensor_parallel_size: expected 1 on attention workers (scale out with --attn-workers), "
                             f"got {vllm_compat.tensor_parallel_size()}")
        index = vllm_compat.layer_index(layer_name)
        if index not in cfg.moe_layers:
            raise ValueError(f"{layer_name}: layer {index} is not in moe_layers {cfg.moe_layers} of AFORE_CONFIG")
        if self.global_num_experts != cfg.num_experts:
            raise ValueError(f"{layer_name}: num_experts: AFORE_CONFIG says {cfg.num_experts}, the model {self.global_num_experts}")
        self.moe_position = cfg.moe_layers.index(index)
        self.attn_worker = vllm_compat.data_parallel_rank()  # the vLLM config is only current at build time
        _layers[layer_name] = self
        if self.moe_position == 0:
            if cfg.pingpong and cfg.microbatches >= 2:
                pingpong.install(cfg.microbatches)  # vLLM's runner splits safe decode steps (afore.attention.pingpong)
            _counter(self.attn_worker).link  # connect to the FFN pool while the model is built, not at the first request
            _counter(self.attn_worker).stream  # its page-locked buffers too: never allocated inside a graph capture

    def _get_quant_method(self, prefix, quant_config, moe_config):
        if quant_config is not None:
            raise ValueError(f"{prefix}: quantized checkpoints are not supported on the remote FFN path yet")
        return RemoteExpertsMethod(moe_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
        for _name, _tensor in weights:  # routed experts live on the FFN workers
            pass
        return iter(EXPERT_PARAMS)

    def remote_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       out: torch.Tensor) -> None:
        """Exchange with the FFN pool; writes the combined routed output [n, H] into ``out``."""
        state = _counter(self.attn_worker)
        if state.stream is not None:  # enqueued on the CUDA stream, capturable (afore.attention.stream)
            return state.stream.forward(self.moe_position, x, topk_weights, topk_ids, out)
        cfg = state.cfg
        m = pingpong.current()
        if m is not None:
            return self.pingpong_forward(m, x, topk_weights, topk_ids, out)
        if self.moe_position == 0:
            state.step += 1
        clock = state.clock
        enter = time.perf_counter_ns()
        n = x.shape[0]
        bounds = [n * m // cfg.microbatches for m in range(cfg.microbatches + 1)]
        link = state.link
        after_post = x.is_cuda and hasattr(link, "host_ids")
        stamps = [self._post(state, link, m, x[lo:hi], topk_ids[lo:hi], topk_weights[lo:hi], after_post)
                  for m, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
        state.demand.after_post()  # the inline planner's metrics, while the FFN pool computes
        for m in range(cfg.microbatches):
            lo, hi = bounds[m], bounds[m + 1]
            start = time.perf_counter_ns()
            seq = state.seq(self.moe_position, m)
            part, f2a = link.recv(seq, hi - lo, x.shape[1], x.dtype)
            out[lo:hi] = part.to(device=x.device, dtype=x.dtype)
            done = time.perf_counter_ns()
            demand, sent, a2f = stamps[m]
            clock.record((state.step, self.moe_position, m, hi - lo, clock.prev_exit_ns, enter, demand, sent, start, done,
                          a2f, f2a, seq))
        clock.prev_exit_ns = time.perf_counter_ns()

    def _post(self, state: ForwardCounter, link, m: int, x, ids, weights, after_post: bool) -> tuple[int, int, int]:
        """Post microbatch ``m`` of this layer and hand its demand to the demand path; returns the
        (demand, sent) stamps and the A2F bytes. GPU ids through the shm transport: post the
        tokens first, then count the demand from the host copy of the ids that the post made
        (numpy, no device op and no second transfer); host ids (CPU): the demand first, so that
        the scheduler starts before the tokens move."""
        seq = state.seq(self.moe_position, m)
        if after_post:
            a2f = link.send(seq, state.step, self.moe_position, m, x, ids, weights)
            sent = time.perf_counter_ns()
            state.demand.emit(state.step, self.moe_position, m, seq, link.host_ids(seq))
            demand = time.perf_counter_ns()
        else:
            state.demand.emit(state.step, self.moe_position, m, seq, ids)
            demand = time.perf_counter_ns()
            a2f = link.send(seq, state.step, self.moe_position, m, x, ids, weights)
            sent = time.perf_counter_ns()
        return demand, sent, a2f

    def pingpong_forward(self, m: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         out: torch.Tensor) -> None:
        """Microbatch ``m`` of a ping-pong step (afore.attention.pingpong): this call's tokens are
        that one target; post it, let the next microbatch run its attention while the FFN pool
        computes this one, take the reply when the baton comes back."""
        state = _counter(self.attn_worker)
        if self.moe_position == 0 and m == 0:  # microbatch 0 reaches the first MoE layer first
            state.step += 1
        clock = state.clock
        enter = time.perf_counter_ns()
        link = state.link
        demand, sent, a2f = self._post(state, link, m, x, topk_ids, topk_weights, x.is_cuda and hasattr(link, "host_ids"))
        state.demand.after_post()
        pingpong.yield_()
        start = time.perf_counter_ns()
        seq = state.seq(self.moe_position, m)
        part, f2a = link.recv(seq, x.shape[0], x.shape[1], x.dtype)
        out.copy_(part.to(device=x.device, dtype=x.dtype))
        done = time.perf_counter_ns()
        # the compute before this call on this microbatch's thread: since its previous call ended
        # (it holds the baton from its reply to its next post); before the first MoE layer,
        # microbatch 0 since the previous step's last exchange (the step's work outside the
        # forward is there, as in a serial step), the others since they first got the baton
        if self.moe_position > 0:
            prev = state.prev_exit_ns.get(m, clock.prev_exit_ns)
        else:
            prev = clock.prev_exit_ns if m == 0 else pingpong.woke_ns()
        clock.record((state.step, self.moe_position, m, x.shape[0], prev, enter, demand, sent, start, done, a2f, f2a, seq))
        state.prev_exit_ns[m] = clock.prev_exit_ns = time.perf_counter_ns()


def check_exchange() -> None:
    """Raise the stream exchange's failure, if any, then record the step's per-layer stamps (vLLM's
    runner calls it after every step's outputs: ``vllm_compat.check_after_step``); a no-op for the
    host exchange."""
    if _state is not None and _state._stream is not None:
        _state._stream.check()
        _state._stream.drain(_state.clock)  # the step's per-layer stamps: metrics and the stage trace


REMOTE_EXPERTS_OP = "afore::remote_experts"


@torch.library.custom_op(REMOTE_EXPERTS_OP, mutates_args=("out",))
def remote_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                   layer_name: str) -> None:
    """Opaque to torch.compile (the exchange is I/O with the FFN pool). The host exchange makes it a
    splitting op of vLLM's piecewise CUDA graphs (``vllm_compat.split_graph_at``): it runs eagerly,
    every step; the stream exchange only enqueues work on the CUDA stream, so graphs capture it.
    ``x`` [n, H], ``topk_weights`` fp32 [n, k], ``topk_ids`` [n, k]; writes ``out`` [n, H]."""
    _layers[layer_name].remote_forward(x, topk_weights, topk_ids, out)


@remote_experts.register_fake
def _(x, topk_weights, topk_ids, out, layer_name):
    return None
