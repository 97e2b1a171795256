"""Fast tests of the serving pieces without vLLM: config, shape checks, plans on the FFN workers."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import msgspec
import numpy as np
import pytest
import torch
from servers import needs_vllm, tiny

from afore.routing import count_demand
from afore.attention.role import AttentionRoleConfig, load_from_env
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.ffn.layer import FFNLayer
from afore.ffn.worker import FFNWorkerConfig
from afore.migrator.copy_engine import make_copy_engine
from afore.migrator.migrator import HostWeightsSource, Migrator
from afore.migrator.slot_pool import SlotPool
from afore.models.checkpoint import load_routed_experts, read_model_spec
from afore.plan import Target, check_plan
from afore.scheduler.policies import Observation, make_policy
from afore.serve.launcher import ServeOptions, check_shape, read_serving_spec, serving_dtype, uses_shm


def _role(**kw) -> AttentionRoleConfig:
    base = dict(num_experts=8, top_k=2, attn_workers=1, ffn_workers=2, moe_layers=[0, 1], store_port=29600, hidden=16)
    base.update(kw)
    return AttentionRoleConfig(**base)


def test_role_config_round_trips_through_env(monkeypatch):
    cfg = _role(microbatches=3, mailbox="mb")
    for k, v in cfg.to_env().items():
        monkeypatch.setenv(k, v)
    assert load_from_env() == cfg


@pytest.mark.parametrize("kw, field", [
    (dict(top_k=9), "top_k"),
    (dict(attn_workers=0), "attn_workers"),
    (dict(ffn_workers=0), "ffn_workers"),
    (dict(microbatches=0), "microbatches"),
    (dict(moe_layers=[]), "moe_layers"),
    (dict(store_port=0), "store_port"),
    (dict(hidden=0), "hidden"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(exchange_timeout_s=0), "exchange_timeout_s"),
])
def test_role_config_rejects_bad_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        _role(**kw)


def test_malformed_env_config_names_the_variable(monkeypatch):
    monkeypatch.setenv("AFORE_CONFIG", json.dumps({"num_experts": "eight"}))
    with pytest.raises(ValueError, match="AFORE_CONFIG"):
        load_from_env()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_serving_spec_of_tiny_checkpoints(arch):
    spec, config = read_serving_spec(tiny(arch))
    assert spec.architecture == arch and spec.num_experts >= 2 and 1 <= spec.top_k <= spec.num_experts
    assert list(spec.moe_layer_indices) == sorted(spec.moe_layer_indices) and spec.moe_layer_indices
    assert config["model_type"] == arch


def test_unknown_architecture_and_activation_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="model_type.*qwen3_moe"):
        read_serving_spec(str(tmp_path))
    with pytest.raises(ValueError, match="config.json"):
        read_serving_spec(str(tmp_path / "missing"))
    config = json.loads(open(f"{tiny('qwen3_moe')}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        read_serving_spec(str(tmp_path))


def test_serving_dtype_resolves_auto_for_the_device():
    assert serving_dtype("auto", {"torch_dtype": "bfloat16"}, "cpu") == "bfloat16"
    assert serving_dtype("auto", {}, "cpu") == "bfloat16"  # a float32 checkpoint: the CPU's preferred dtype
    assert serving_dtype("auto", {"torch_dtype": "float16"}, "cpu") == "float16"
    assert serving_dtype("float32", {"torch_dtype": "bfloat16"}, "cpu") == "float32"  # asked for: kept
    assert serving_dtype("half", {"dtype": "bfloat16"}, "cpu") == "float16"
    with pytest.raises(ValueError, match="dtype"):
        serving_dtype("int8", {}, "cpu")


@needs_vllm
@pytest.mark.parametrize("declared", ["float32", "bfloat16", "float16", None])
def test_serving_dtype_auto_is_what_vllm_resolves_on_this_device(declared):
    import torch
    from vllm.config.model import _resolve_auto_dtype

    config_dtype = getattr(torch, declared or "float32")
    want = _resolve_auto_dtype("qwen3_moe", config_dtype, is_pooling_model=False)
    config = {"torch_dtype": declared} if declared else {}
    assert serving_dtype("auto", config, "cpu") == str(want).removeprefix("torch.")


def test_impossible_shapes_refused():
    info, _ = read_serving_spec(tiny("qwen3_moe"))
    with pytest.raises(ValueError, match="ffn_workers"):
        check_shape(ServeOptions(ffn_workers=info.num_experts + 1, colocate=True), info, devices=64)
    with pytest.raises(ValueError, match="--colocate"):
        check_shape(ServeOptions(attn_workers=2, ffn_workers=2, device="cuda"), info, devices=3)
    check_shape(ServeOptions(attn_workers=2, ffn_workers=2, device="cuda", colocate=True), info, devices=1)
    check_shape(ServeOptions(attn_workers=1, ffn_workers=3), info, devices=4)  # F > A
    with pytest.raises(ValueError, match="policy"):
        ServeOptions(policy="fastest")


def test_serve_cli_fails_at_start_with_a_clear_message():
    model = tiny("qwen3_moe")
    info, _ = read_serving_spec(model)
    out = subprocess.run([sys.executable, "-m", "afore.cli", "serve", "--model", model, "--colocate",
                          "--ffn-workers", str(info.num_experts + 1)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "ffn_workers" in out.stderr and str(info.num_experts) in out.stderr


def test_serve_cli_refuses_an_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    out = subprocess.run([sys.executable, "-m", "afore.cli", "serve", "--model", str(tmp_path), "--colocate"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "model_type" in out.stderr and "qwen3_moe" in out.stderr


def test_count_demand_ignores_padding_ids():
    ids = torch.tensor([[0, 3], [3, -1], [7, 3]], dtype=torch.int32)
    assert count_demand(ids, 8).tolist() == [1, 0, 0, 3, 0, 0, 0, 1]


class Shard:
    """One FFN worker's expert side as ``afore.ffn.worker`` builds it: per MoE layer a SlotPool
    (primaries, then R redundant slots) and an FFNLayer, one Migrator copying from host weights."""

    def __init__(self, shape: ClusterShape, worker: int, host: dict, hidden: int, intermediate: int):
        self.worker = worker
        pools = {}
        for layer, (w13, w2) in host.items():
            pools[layer] = SlotPool(shape, worker, hidden, intermediate, torch.float32, torch.device("cpu"))
            pools[layer].load_primaries(w13, w2)
        self.migrator = Migrator(shape, worker, pools, make_copy_engine(torch.device("cpu")), HostWeightsSource(host))
        self.layers = {layer: FFNLayer(pool) for layer, pool in pools.items()}

    def forward(self, hidden, ids, weights, plan):
        self.migrator.commit(plan)
        out = self.layers[plan.target.layer].forward(hidden, ids, weights, plan, self.worker)
        self.migrator.release(plan)
        return out


def _tiny_shape(workers: int = 2):
    model = tiny("qwen3_moe")
    spec = read_model_spec(model)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=workers, num_layers=len(spec.moe_layer_indices),
                         top_k=spec.top_k, m_tile=1, redundant_slots=2)
    host = {}
    for layer, index in enumerate(spec.moe_layer_indices):
        w = load_routed_experts(model, index, torch.float32)
        host[layer] = (w.w13, w.w2)
    return spec, shape, host


@pytest.mark.parametrize("policy_name", ["afore", "libra", "eplb", "harmoeny"])
def test_worker_partials_sum_to_the_monolithic_layer_under_every_plan(policy_name):
    """Every policy's plans are valid on every FFN worker and the partials sum to the dense layer."""
    spec, shape, host = _tiny_shape()
    shards = [Shard(shape, w, host, spec.hidden_size, spec.moe_intermediate_size) for w in range(2)]
    policy = make_policy(policy_name, shape, SchedulerParams(copy_budget=4), CostModel(window_ms=1e3))
    torch.manual_seed(0)
    copies = 0
    for seq in range(12):
        layer = seq % shape.num_layers
        w13, w2 = host[layer]
        n = 24
        hidden = torch.randn(n, spec.hidden_size)
        # skewed routing: most tokens pick expert 0 (a primary of worker 0), so plans replicate it
        rest = torch.stack([torch.randperm(spec.num_experts - 1)[: spec.top_k - 1] + 1 for _ in range(n)])
        first = torch.where(torch.rand(n) < 0.8, 0, int(torch.randint(1, spec.num_experts, ())))
        first = torch.where((rest == first[:, None]).any(1), 0, first)
        ids = torch.cat([first[:, None], rest], dim=1).to(torch.int32)
        weights = torch.rand(n, spec.top_k)
        want = torch.zeros(n, spec.hidden_size)
        for t in range(n):  # dense reference: sum_k w_k * expert_k(x)
            for j in range(spec.top_k):
                e = int(ids[t, j])
                g, u = (w13[e] @ hidden[t]).chunk(2)
                want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(g) * u))
        demand = count_demand(ids, spec.num_experts).numpy()
        plan = policy.plan(Observation(Target(seq // shape.num_layers, layer, 0), seq, demand))
        check_plan(shape, plan)
        for s in shards:
            assert s.migrator.prepare(plan, expected_seq=seq, expected_target=plan.target), s.migrator.last_rejection
        copies += len(plan.copies)
        got = sum(s.forward(hidden, ids, weights, plan) for s in shards)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if policy_name == "afore":
        assert copies > 0, "the skewed demand should have produced replica copies"


def test_a_plan_relying_on_a_copy_never_run_is_refused():
    """A plan that arrived too late ran primary-only, so its copies never happened; a later plan
    that counts on them is refused by the worker lacking the replica (and then, through the
    agreement, by all: tests/transport/test_plan_agreement.py)."""
    spec, shape, host = _tiny_shape()
    policy = make_policy("afore", shape, SchedulerParams(copy_budget=4), CostModel(window_ms=1e3))
    demand = np.zeros(spec.num_experts, np.int64)
    demand[0] = 64
    plans = [policy.plan(Observation(Target(s, 0, 0), s, demand)) for s in range(3)]
    first_with_copies = next(i for i, p in enumerate(plans) if len(p.copies))
    later = next((p for p in plans[first_with_copies + 1:] if (p.assignment[:, 1] > 0).any() and not len(p.copies)), None)
    assert later is not None, "a later plan should reuse the replica without copying it again"
    shards = [Shard(shape, w, host, spec.hidden_size, spec.moe_intermediate_size) for w in range(2)]
    assert shards[0].migrator.prepare(later)  # worker 0 runs expert 0 from its primary slot
    assert not shards[1].migrator.prepare(later)  # the plan with the copies was never run
    assert "neither resident nor copied" in shards[1].migrator.last_rejection
    ok = Shard(shape, 1, host, spec.hidden_size, spec.moe_intermediate_size)
    for p in plans[: plans.index(later) + 1]:  # with the earlier plans applied, it is valid
        assert ok.migrator.prepare(p), ok.migrator.last_rejection
        ok.migrator.commit(p)
        ok.migrator.release(p)


def test_metrics_port_is_gone_with_a_pointer_to_the_endpoint():
    import argparse

    from afore.serve.cli import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args([])).port == 8000
    with pytest.raises(ValueError, match=r"metrics_port: --metrics-port is gone; .*/metrics of the API port"):
        options_from_args(parser.parse_args(["--metrics-port", "9400"]))
    with pytest.raises(msgspec.ValidationError, match="metrics_port"):
        msgspec.convert({"metrics_port": 9400}, ServeOptions)  # not a field any more


def test_shm_transport_serves_an_ffn_node_for_attention_ends_on_it_but_never_a_remote_attention_node():
    # the FFN half with the shm segment: attention ends of this node attach to it, so loopback is fine
    opts = ServeOptions(role="ffn", transport="shm", store_port=29600)
    assert uses_shm(opts) and opts.host == "127.0.0.1"
    with pytest.raises(ValueError, match="transport: shm needs the FFN workers on this node .* got --role attention"):
        ServeOptions(role="attention", ffn_host="h", store_port=29600, transport="shm")
    with pytest.raises(ValueError, match="loopback"):  # the torch transport's FFN node must be reachable
        ServeOptions(role="ffn", transport="torch-gloo", store_port=29600)
    # several FFN workers on one GPU: fine over shm (no NCCL communicator), refused over NCCL
    info, _ = read_serving_spec(tiny("qwen3_moe"))
    check_shape(ServeOptions(role="ffn", transport="shm", store_port=29600, ffn_workers=2, colocate=True, device="cuda"),
                info, devices=1)
    with pytest.raises(ValueError, match="NCCL cannot hold several workers on one GPU"):
        check_shape(ServeOptions(role="ffn", host="0.0.0.0", transport="torch-nccl", store_port=29600, ffn_workers=2,
                                 colocate=True, device="cuda"), info, devices=1)


def test_split_roles_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="ffn_host"):
        ServeOptions(role="attention", store_port=29600)
    with pytest.raises(ValueError, match="store_port"):
        ServeOptions(role="ffn", host="0.0.0.0", store_port=0)
    with pytest.raises(ValueError, match="role"):
        ServeOptions(role="both")
    with pytest.raises(ValueError, match="demand_port"):
        ServeOptions(role="ffn", host="0.0.0.0", store_port=29600, demand_port=70000)
    with pytest.raises(ValueError, match="loopback"):
        ServeOptions(role="ffn", store_port=29600)  # the default host, 127.0.0.1
    with pytest.raises(ValueError, match="distinct ports"):
        ServeOptions(role="ffn", host="0.0.0.0", store_port=29601, demand_port=29601)
    with pytest.raises(ValueError, match="distinct ports"):
        ServeOptions(role="attention", ffn_host="h", store_port=29600, port=8000, admin_port=8000)
    with pytest.raises(ValueError, match="copy_rate_gbps"):
        ServeOptions(copy_rate_gbps=float("nan"))
    info, _ = read_serving_spec(tiny("qwen3_moe"))
    # each role counts only the workers of its own node (GPUs: on CPU the workers share the cores)
    gpu = {"device": "cuda"}
    check_shape(ServeOptions(role="ffn", host="0.0.0.0", store_port=29600, attn_workers=4, ffn_workers=2, **gpu), info, devices=2)
    check_shape(ServeOptions(role="attention", ffn_host="h", store_port=29600, attn_workers=2, ffn_workers=8, **gpu), info, devices=2)
    with pytest.raises(ValueError, match="ffn_workers: 3 workers"):
        check_shape(ServeOptions(role="ffn", host="0.0.0.0", store_port=29600, attn_workers=1, ffn_workers=3, **gpu), info, devices=2)
    with pytest.raises(ValueError, match="attn_workers: 3 workers"):
        check_shape(ServeOptions(role="attention", ffn_host="h", store_port=29600, attn_workers=3, **gpu), info, devices=2)


def test_split_role_without_a_token_exits_2_naming_the_variable():
    env = {k: v for k, v in __import__("os").environ.items() if k != "AFORE_DEMAND_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "afore.cli", "serve", "--role", "ffn", "--host", "0.0.0.0", "--colocate"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "AFORE_DEMAND_TOKEN" in out.stderr
    out = subprocess.run([sys.executable, "-m", "afore.cli", "serve", "--role", "attention", "--colocate"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "ffn_host" in out.stderr
    out = subprocess.run([sys.executable, "-m", "afore.cli", "serve", "--role", "attention", "--ffn-host", "h", "--colocate"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "AFORE_DEMAND_TOKEN" in out.stderr


def test_role_config_takes_one_demand_path():
    base = dict(num_experts=8, top_k=2, attn_workers=1, ffn_workers=2, moe_layers=[1], store_port=29600, hidden=16)
    with pytest.raises(ValueError, match="one demand path"):
        AttentionRoleConfig(**base, mailbox="m", demand="h:1")
    with pytest.raises(ValueError, match="demand"):
        AttentionRoleConfig(**base, demand="no-port")
    AttentionRoleConfig(**base, demand="ffn-0.afore:29601", store_master=False)


def test_gpu_ffn_workers_see_every_gpu_and_take_one_each(monkeypatch, started):
    """CUDA IPC handles carry device indices: every FFN worker must see the same GPUs, so the
    launcher picks a worker's GPU with --device cuda:<i>, never by narrowing CUDA_VISIBLE_DEVICES."""
    import afore.serve.launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "device_count", lambda device: 4)
    for role, a, f, first in (("all", 2, 2, 2), ("ffn", 8, 4, 0)):
        started.clear()
        opts = ServeOptions(role=role, host="0.0.0.0" if role == "ffn" else "127.0.0.1", store_port=29600,
                            attn_workers=a, ffn_workers=f, device="cuda")
        launcher = launcher_mod.Launcher(opts)
        launcher.spec, launcher.model = read_serving_spec(tiny("qwen3_moe"))[0], "m"
        launcher.dtype, launcher.backend = "bfloat16", "nccl"
        launcher.start_ffn_workers()
        configs = [msgspec.json.decode(cmd[cmd.index("--config-json") + 1], type=FFNWorkerConfig) for cmd, _ in started]
        devices = [c.device for c in configs]
        assert devices == [f"cuda:{(first + w) % 4}" for w in range(f)], (role, devices)
        assert all(env is None or "CUDA_VISIBLE_DEVICES" not in env for _, env in started)
