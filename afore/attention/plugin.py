"""vLLM general plugin (entry point ``vllm.general_plugins`` -> ``register``).

vLLM calls ``register()`` in every process it starts, before it builds its config. It does
nothing unless ``AFORE_ROLE=attention``; in that role it swaps vLLM's routed experts for the
remote-FFN proxy (:mod:`afore.attention.moe_proxy`) and makes the proxy's exchange op a
splitting op of vLLM's piecewise CUDA graphs.
"""

from __future__ import annotations

import logging

from afore.attention import role as role_

log = logging.getLogger("afore.attention")


def register() -> None:
    if role_.role() != "attention":
        return
    from afore.attention import moe_proxy, vllm_compat

    vllm_compat.check_version()
    role_.load_from_env()  # fail at start, in every process, on a malformed configuration
    vllm_compat.register_routed_experts(moe_proxy.RemoteRoutedExperts)
    # piecewise CUDA graphs: cut the graph at the exchange, as at attention
    vllm_compat.split_graph_at(moe_proxy.REMOTE_EXPERTS_OP)
    vllm_compat.trace_moe_forward(moe_proxy.RemoteRoutedExperts)
    vllm_compat.cpu_routing_fallback()
    log.info("afore: attention role, routed experts run on the FFN pool")
