"""Invariant 3 across processes: if one FFN worker has no plan for a target, no worker uses it.

Worker 1's plan source never delivers one target's plan while worker 0's does; without the
agreement the two would partition the pairs under different plans (pairs lost or doubled).
"""

import pickle
import signal
import urllib.request

import multiprocessing as mp
import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.reference import dense_moe, random_plan, random_routing
from afore.plan import SlotTable, Target
from afore.transport.connector import AttentionConnector, TransportConfig

pytestmark = pytest.mark.slow
DROP = 3


def _worker(cfg_bytes: bytes, plans_bytes: bytes) -> None:
    import msgspec

    from afore.ffn.worker import FFNWorker, FFNWorkerConfig
    from afore.migrator.plan_source import QueuePlanSource

    cfg = msgspec.json.decode(cfg_bytes, type=FFNWorkerConfig)
    source = QueuePlanSource(capacity=256)
    for plan in pickle.loads(plans_bytes):
        if not (cfg.rank == 1 and plan.seq == DROP):
            source.put(plan)
    worker = FFNWorker(cfg, plan_source=source)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop_event.set())
    try:
        worker.run()
    finally:
        worker.close()


def test_a_plan_missing_on_one_worker_is_used_by_none(tmp_path):
    import msgspec

    from afore.ffn.worker import FFNWorkerConfig, stop_ffn_workers
    from afore.models.checkpoint import load_routed_experts, read_model_spec
    from afore.models.tiny import build_tiny_checkpoint
    from test_ffn_end_to_end import free_port, metric

    path = str(build_tiny_checkpoint("qwen3_moe", seed=0))
    spec = read_model_spec(path)
    w = load_routed_experts(path, spec.moe_layer_indices[0], torch.float32)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=2, num_layers=len(spec.moe_layer_indices),
                         redundant_slots=2, m_tile=2, top_k=spec.top_k)
    rng = np.random.default_rng(7)
    table = SlotTable.empty(shape)
    inputs, plans = [], []
    for seq in range(6):
        ids, tw = random_routing(20, shape, rng, skew=1.5)
        inputs.append((torch.randn(20, spec.hidden_size), ids, tw))
        demand = np.bincount(ids.reshape(-1).numpy(), minlength=spec.num_experts)
        plan, table = random_plan(shape, demand, table, rng, Target(seq, 0, 0), seq, new_copies=1)
        plans.append(plan)
    port, metrics_port = free_port(), free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(2):
        cfg = FFNWorkerConfig(rank=r, num_ffn=2, num_attention=1, model=path, port=port, m_tile=2, plan_timeout_ms=100.0,
                              metrics_port=metrics_port if r == 0 else 0, timeout_s=60)
        proc = ctx.Process(target=_worker, args=(msgspec.json.encode(cfg), pickle.dumps(plans)))
        proc.start()
        procs.append(proc)
    conn = None
    try:
        conn = AttentionConnector(TransportConfig("127.0.0.1", port, 1, 2, spec.hidden_size, spec.top_k, timeout_s=60), 0)
        outs = [conn.exchange(Target(seq, 0, 0), seq, *inputs[seq]) for seq in range(6)]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        stop_ffn_workers(procs)
        if conn is not None:
            conn.close()
    for seq in range(6):
        ref = dense_moe(*inputs[seq], w.w13, w.w2)
        assert float((outs[seq].double() - ref).norm() / ref.norm()) <= 1e-5, seq
    assert metric(text, "afore_ffn_plans_total", 'outcome="missed"') == 0       # worker 0 had every plan ...
    assert metric(text, "afore_ffn_primary_only_targets_total") == 1      # ... and still ran DROP primary-only
    assert [p.exitcode for p in procs] == [0, 0]
