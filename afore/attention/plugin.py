"""vLLM general plugin (entry point ``vllm.general_plugins`` -> ``register``).

vLLM calls ``register()`` in every process it starts, before it builds its config. With
``AFORE_STAGE_TRACE`` set it times vLLM's step phases (any role). It does nothing else unless
``AFORE_ROLE=attention``; in that role it swaps vLLM's routed experts for the
remote-FFN proxy (:mod:`afore.attention.moe_proxy`); with the host exchange it makes the
proxy's exchange op a splitting op of vLLM's piecewise CUDA graphs, with the stream exchange
(:mod:`afore.attention.stream`) it leaves vLLM's graphs as they are and checks the exchange's
outcome after every step's outputs.
"""

from __future__ import annotations

import logging

from afore.attention import role as role_

log = logging.getLogger("afore.attention")


def register() -> None:
    _trace_runner()
    if role_.role() != "attention":
        return
    from afore.attention import moe_proxy, vllm_compat

    vllm_compat.check_version()
    cfg = role_.load_from_env()  # fail at start, in every process, on a malformed configuration
    vllm_compat.register_routed_experts(moe_proxy.RemoteRoutedExperts)
    if cfg.exchange == "host":
        # piecewise CUDA graphs: cut the graph at the exchange, as at attention
        vllm_compat.split_graph_at(moe_proxy.REMOTE_EXPERTS_OP)
        vllm_compat.trace_moe_forward(moe_proxy.RemoteRoutedExperts)
    else:  # capturable (afore.attention.stream): vLLM's own MoE op and compile partition, as plain vLLM
        vllm_compat.check_after_step(moe_proxy.check_exchange)
    vllm_compat.cpu_routing_fallback()
    log.info("afore: attention role, routed experts run on the FFN pool")


def _trace_runner() -> None:
    """With ``AFORE_STAGE_TRACE`` set, time vLLM's step phases (afore.attention.stages.RunnerClock),
    in plain vLLM too: the same run then says what vLLM's own step costs beside the exchanges."""
    import os

    from afore.metrics.trace import TRACE_ENV

    if not os.environ.get(TRACE_ENV):
        return
    from afore.attention import vllm_compat
    from afore.attention.stages import RunnerClock

    try:
        vllm_compat.time_runner_phases(RunnerClock().record)
    except ImportError as exc:  # a vLLM without the v1 model runner: nothing to time
        log.warning("afore: %s set but vLLM's model runner cannot be timed: %s", TRACE_ENV, exc)
