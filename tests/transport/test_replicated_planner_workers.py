"""Two FFN worker processes that plan every target themselves (``--planner workers``): the same
plans on both (outputs exact, every target planned, copies made), and after a failed vote both
restart the planner at the same target and go on planning.

Worker 1's planner loses one target's plan (``DROP``) while worker 0's makes it: the vote fails,
both run ``DROP`` primary-only, empty their redundant slots and restart the policy, and the
targets after it run on plans again; a worker that restarted alone, or not at the same target,
would partition later targets under another plan and the outputs would be wrong.
"""

import signal
import urllib.request

import multiprocessing as mp
import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.reference import dense_moe, random_routing
from afore.plan import Target
from afore.transport.connector import AttentionConnector, TransportConfig

pytestmark = pytest.mark.slow
TARGETS = 10


def _worker(cfg_bytes: bytes, drop: int) -> None:
    import msgspec

    from afore.ffn.worker import FFNWorker, FFNWorkerConfig
    from afore.migrator.plan_source import ReplicatedPlanSource

    cfg = msgspec.json.decode(cfg_bytes, type=FFNWorkerConfig)

    class Dropping(ReplicatedPlanSource):
        def _get(self, target, seq, timeout_s, demand):
            plan = super()._get(target, seq, timeout_s, demand)
            return None if seq == drop else plan

    source = None
    if drop >= 0:
        source = Dropping(cfg.policy, cfg.shape, cfg.params, cfg.cost)
    worker = FFNWorker(cfg, plan_source=source)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop_event.set())
    try:
        worker.run()
    finally:
        worker.close()


def _serve(drop_on_worker1: int):
    """Run TARGETS skewed targets over the model's MoE layers through two replicated-planner workers; returns
    (max relative error against the dense layer, worker 0's /metrics text)."""
    import msgspec

    from afore.ffn.worker import FFNWorkerConfig, stop_ffn_workers
    from afore.models.checkpoint import load_routed_experts, read_model_spec
    from afore.models.tiny import build_tiny_checkpoint
    from afore.scheduler.calibration import serving_cost_model
    from test_ffn_end_to_end import free_port

    path = str(build_tiny_checkpoint("qwen3_moe", seed=0))
    spec = read_model_spec(path)
    weights = [load_routed_experts(path, spec.moe_layer_indices[layer], torch.float32) for layer in range(len(spec.moe_layer_indices))]
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=2, num_layers=len(spec.moe_layer_indices),
                         redundant_slots=2, m_tile=2, top_k=spec.top_k)
    cost = serving_cost_model("", "cpu", spec.hidden_size, spec.moe_intermediate_size, "float32", shape.m_tile)
    rng = np.random.default_rng(11)
    inputs = []
    for seq in range(TARGETS):
        ids, tw = random_routing(24, shape, rng, skew=1.6)
        inputs.append((torch.randn(24, spec.hidden_size), ids, tw))
    port, metrics_port = free_port(), free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(2):
        cfg = FFNWorkerConfig(rank=r, num_ffn=2, num_attention=1, model=path, port=port, m_tile=2, shape=shape,
                              policy="afore", cost=cost, metrics_port=metrics_port if r == 0 else 0, timeout_s=60)
        proc = ctx.Process(target=_worker, args=(msgspec.json.encode(cfg), drop_on_worker1 if r == 1 else -1))
        proc.start()
        procs.append(proc)
    conn = None
    try:
        conn = AttentionConnector(TransportConfig("127.0.0.1", port, 1, 2, spec.hidden_size, spec.top_k, timeout_s=60), 0)
        targets = [Target.from_seq(seq, shape.num_layers, 1) for seq in range(TARGETS)]
        outs = [conn.exchange(targets[seq], seq, *inputs[seq]) for seq in range(TARGETS)]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        stop_ffn_workers(procs)
        if conn is not None:
            conn.close()
    assert [p.exitcode for p in procs] == [0, 0]
    err = 0.0
    for seq in range(TARGETS):
        w = weights[targets[seq].layer]
        ref = dense_moe(*inputs[seq], w.w13, w.w2)
        err = max(err, float((outs[seq].double() - ref).norm() / ref.norm()))
    return err, text


def test_replicated_planners_agree_on_every_target():
    from test_ffn_end_to_end import metric

    err, text = _serve(-1)
    assert err <= 1e-5
    assert metric(text, "afore_ffn_plans_total", 'outcome="used"') == TARGETS   # every target ran on a plan ...
    assert metric(text, "afore_ffn_primary_only_targets_total") == 0           # ... the other worker's too
    assert metric(text, "afore_ffn_copies_total") > 0                          # skewed: replicas were copied
    assert metric(text, "afore_ffn_plan_seconds_count") == TARGETS
    assert metric(text, "afore_ffn_planner_resets_total") == 0


def test_a_failed_vote_restarts_both_planners_at_the_same_target():
    from test_ffn_end_to_end import metric

    drop = 3
    err, text = _serve(drop)
    assert err <= 1e-5  # a divergent planner after the restart would mis-partition later targets
    assert metric(text, "afore_ffn_primary_only_targets_total") == 1  # only the dropped target
    assert metric(text, "afore_ffn_plans_total", 'outcome="used"') == TARGETS - 1
    assert metric(text, "afore_ffn_planner_resets_total") == 1
