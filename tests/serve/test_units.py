"""Fast tests of the serving pieces without vLLM: config, shape checks, partition, A2F link."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from afore.attention.demand import count_demand
from afore.attention.role import AttentionRoleConfig, load_from_env
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler.plan import Target, check_plan
from afore.scheduler.policies import Observation, make_policy
from afore.serve.ffn_link import AttentionLink, FFNLink, PeerDied, PlanDecisions
from afore.serve.ffn_worker import ExpertShard, PoolView
from afore.serve.launcher import ServeOptions, check_shape
from afore.serve.model_info import read_model_info
from conftest import tiny


def _role(**kw) -> AttentionRoleConfig:
    base = dict(num_experts=8, top_k=2, attn_workers=1, ffn_endpoints=["ipc://a", "ipc://b"],
                attn_endpoints=["ipc://c"], moe_layers=[0, 1])
    base.update(kw)
    return AttentionRoleConfig(**base)


def test_role_config_round_trips_through_env(monkeypatch):
    cfg = _role(microbatches=3, mailbox="mb")
    for k, v in cfg.to_env().items():
        monkeypatch.setenv(k, v)
    assert load_from_env() == cfg


@pytest.mark.parametrize("kw, field", [
    (dict(top_k=9), "top_k"),
    (dict(attn_workers=2), "attn_endpoints"),
    (dict(ffn_endpoints=[]), "ffn_endpoints"),
    (dict(microbatches=0), "microbatches"),
    (dict(moe_layers=[]), "moe_layers"),
    (dict(ffn_pids=[1]), "ffn_pids"),
    (dict(transport="rdma"), "transport"),
    (dict(transport="torch"), "store_port"),
])
def test_role_config_rejects_bad_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        _role(**kw)


def test_malformed_env_config_names_the_variable(monkeypatch):
    monkeypatch.setenv("AFORE_CONFIG", json.dumps({"num_experts": "eight"}))
    with pytest.raises(ValueError, match="AFORE_CONFIG"):
        load_from_env()


def test_model_info_of_tiny_checkpoints():
    info = read_model_info(tiny("qwen3_moe"))
    assert info.model_type == "qwen3_moe" and info.num_experts >= 2 and 1 <= info.top_k <= info.num_experts
    assert list(info.moe_layers) == sorted(info.moe_layers) and info.moe_layers


def test_unknown_architecture_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="model_type"):
        read_model_info(str(tmp_path))
    with pytest.raises(ValueError, match="config.json"):
        read_model_info(str(tmp_path / "missing"))


def test_impossible_shapes_refused():
    info = read_model_info(tiny("qwen3_moe"))
    with pytest.raises(ValueError, match="ffn_workers"):
        check_shape(ServeOptions(ffn_workers=info.num_experts + 1, colocate=True), info, devices=64)
    with pytest.raises(ValueError, match="--colocate"):
        check_shape(ServeOptions(attn_workers=2, ffn_workers=2), info, devices=3)
    check_shape(ServeOptions(attn_workers=2, ffn_workers=2, colocate=True), info, devices=1)
    check_shape(ServeOptions(attn_workers=1, ffn_workers=3), info, devices=4)  # F > A
    with pytest.raises(ValueError, match="policy"):
        ServeOptions(policy="fastest")
    with pytest.raises(ValueError, match="transport"):
        ServeOptions(transport="rdma")


def test_serve_cli_fails_at_start_with_a_clear_message():
    model = tiny("qwen3_moe")
    info = read_model_info(model)
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


@pytest.mark.parametrize("policy_name", ["afore", "libra", "eplb", "harmoeny"])
def test_worker_partials_sum_to_the_monolithic_layer_under_every_plan(policy_name):
    model = tiny("qwen3_moe")
    info = read_model_info(model)
    shape = ClusterShape(num_experts=info.num_experts, num_workers=2, num_layers=len(info.moe_layers),
                         top_k=info.top_k, m_tile=1, redundant_slots=2)
    shards = [ExpertShard(model, "cpu", shape, w) for w in range(2)]
    view = PoolView(shape)
    policy = make_policy(policy_name, shape, SchedulerParams(copy_budget=4), CostModel(window_ms=1e3))
    torch.manual_seed(0)
    copies = 0
    for seq in range(12):
        layer = seq % shape.num_layers
        w13, w2 = shards[0].host[layer]
        n = 24
        hidden = torch.randn(n, info.hidden_size)
        # skewed routing: most tokens pick expert 0 (a primary of worker 0), so plans replicate it
        rest = torch.stack([torch.randperm(info.num_experts - 1)[: info.top_k - 1] + 1 for _ in range(n)])
        first = torch.where(torch.rand(n) < 0.8, 0, int(torch.randint(1, info.num_experts, ())))
        first = torch.where((rest == first[:, None]).any(1), 0, first)
        ids = torch.cat([first[:, None], rest], dim=1).to(torch.int32)
        weights = torch.rand(n, info.top_k)
        want = torch.zeros(n, info.hidden_size)
        for t in range(n):  # dense reference: sum_k w_k * expert_k(x)
            for j in range(info.top_k):
                e = int(ids[t, j])
                g, u = (w13[e] @ hidden[t]).chunk(2)
                want[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(g) * u))
        demand = count_demand(ids, info.num_experts).numpy()
        plan = policy.plan(Observation(Target(seq // shape.num_layers, layer, 0), seq, demand))
        check_plan(shape, plan)
        assert view.accept(plan) is None
        copies += len(plan.copies)
        got = sum(shards[w].forward(layer, hidden, ids, weights, plan) for w in range(2))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(s.rejected == 0 for s in shards)
    if policy_name == "afore":
        assert copies > 0, "the skewed demand should have produced replica copies"


def test_pool_view_refuses_a_plan_that_relies_on_a_copy_never_run():
    model = tiny("qwen3_moe")
    info = read_model_info(model)
    shape = ClusterShape(num_experts=info.num_experts, num_workers=2, num_layers=len(info.moe_layers),
                         top_k=info.top_k, m_tile=1, redundant_slots=2)
    policy = make_policy("afore", shape, SchedulerParams(copy_budget=4), CostModel(window_ms=1e3))
    demand = np.zeros(info.num_experts, np.int64)
    demand[0] = 64
    plans = [policy.plan(Observation(Target(s, 0, 0), s, demand)) for s in range(3)]
    first_with_copies = next(i for i, p in enumerate(plans) if len(p.copies))
    later = next((p for p in plans[first_with_copies + 1:] if (p.assignment[:, 1] > 0).any() and not len(p.copies)), None)
    assert later is not None, "a later plan should reuse the replica without copying it again"
    view = PoolView(shape)  # the plan with the copies was never run
    assert view.accept(later) is not None


def _ffn_echo(link: FFNLink, scale: float, stop: threading.Event, fail_seq: int = -1) -> None:
    while not stop.is_set():
        reqs = link.recv_target(timeout_ms=50)
        if reqs is None:
            continue
        if reqs[0].head.seq == fail_seq:
            link.send_error(reqs, "boom")
            continue
        link.send_outputs(reqs, [r.hidden * scale for r in reqs])


def test_link_gathers_all_attention_workers_and_sums_ffn_partials(tmp_path):
    ffn_ep = [f"ipc://{tmp_path}/f{w}" for w in range(3)]
    attn_ep = [f"ipc://{tmp_path}/a{a}" for a in range(2)]
    stop = threading.Event()
    ffn = [FFNLink(w, ffn_ep[w], attn_ep) for w in range(3)]
    threads = [threading.Thread(target=_ffn_echo, args=(ffn[w], float(w + 1), stop, 7)) for w in range(3)]
    for t in threads:
        t.start()
    attn = [AttentionLink(a, attn_ep[a], ffn_ep, timeout_s=10) for a in range(2)]
    try:
        xs = [torch.randn(5, 4), torch.randn(0, 4)]
        ids = [torch.zeros(5, 2, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32)]
        for seq in (1, 2):  # two targets in flight before any answer is read
            for a in range(2):
                attn[a].send(seq, 0, 0, seq, xs[a], ids[a], torch.ones_like(ids[a], dtype=torch.float32))
        for seq in (1, 2):
            out0 = attn[0].recv(seq, 5, 4, torch.float32)
            torch.testing.assert_close(out0, xs[0] * 6)  # 1 + 2 + 3
            assert attn[1].recv(seq, 0, 4, torch.float32).shape == (0, 4)
        for a in range(2):
            attn[a].send(7, 0, 0, 0, xs[0], ids[0], torch.ones(5, 2))
        with pytest.raises(RuntimeError, match="boom"):
            attn[0].recv(7, 5, 4, torch.float32)
    finally:
        stop.set()
        for t in threads:
            t.join()
        for link in ffn + attn:
            link.close()


def test_link_fails_fast_when_an_ffn_worker_is_dead(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    link = AttentionLink(0, f"ipc://{tmp_path}/a0", [f"ipc://{tmp_path}/f0"], ffn_pids=[dead.pid], timeout_s=30)
    try:
        link.send(0, 0, 0, 0, torch.zeros(1, 4), torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 2))
        t0 = time.monotonic()
        with pytest.raises(PeerDied):
            link.recv(0, 1, 4, torch.float32)
        assert time.monotonic() - t0 < 5
    finally:
        link.close()


def test_link_times_out_instead_of_hanging(tmp_path):
    link = AttentionLink(0, f"ipc://{tmp_path}/a0", [f"ipc://{tmp_path}/f0"], ffn_pids=[os.getpid()], timeout_s=0.5)
    try:
        link.send(0, 0, 0, 0, torch.zeros(1, 4), torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 2))
        with pytest.raises(TimeoutError):
            link.recv(0, 1, 4, torch.float32)
    finally:
        link.close()


def test_plan_decisions_reach_every_follower_in_any_order(tmp_path):
    eps = [f"ipc://{tmp_path}/c{w}" for w in range(3)]
    followers = [PlanDecisions(w, eps, leader_pid=os.getpid()) for w in (1, 2)]
    leader = PlanDecisions(0, eps)
    try:
        for seq, plan in ((3, b"p3"), (4, b""), (5, b"p5")):
            leader.announce(seq, plan)
        for f in followers:
            assert f.wait(4, 5.0) == b""
            assert f.wait(5, 5.0) == b"p5"
    finally:
        for d in followers + [leader]:
            d.close()


def test_plan_decision_wait_fails_fast_when_the_leader_died(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    follower = PlanDecisions(1, [f"ipc://{tmp_path}/c0", f"ipc://{tmp_path}/c1"], leader_pid=dead.pid)
    try:
        with pytest.raises(PeerDied):
            follower.wait(0, 30.0)
    finally:
        follower.close()
