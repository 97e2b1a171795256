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

from afore.config import ClusterShape, SchedulerParams
from afore.ffn.reference import dense_moe, random_routing
from afore.plan import Target
from afore.transport.connector import AttentionConnector, TransportConfig

pytestmark = pytest.mark.slow
TARGETS = 10


def _worker(cfg_bytes: bytes, fault: tuple[str, int] | None) -> None:
    import msgspec

    from afore.ffn.worker import FFNWorker, FFNWorkerConfig
    from afore.migrator.plan_source import ReplicatedPlanSource
    from afore.plan import primary_only_plan

    cfg = msgspec.json.decode(cfg_bytes, type=FFNWorkerConfig)

    class Faulty(ReplicatedPlanSource):
        """Loses the plan of one target ("drop"), or makes another valid plan for it ("diverge":
        the primary-only one, as a planner whose state diverged would)."""

        def _get(self, target, seq, timeout_s, demand):
            plan = super()._get(target, seq, timeout_s, demand)
            if fault is None or seq != fault[1]:
                return plan
            return None if fault[0] == "drop" else primary_only_plan(self.shape, demand, target, seq)

    source = None
    if fault is not None:
        source = Faulty(cfg.policy, cfg.shape, cfg.params, cfg.cost)
    worker = FFNWorker(cfg, plan_source=source)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop_event.set())
    try:
        worker.run()
    finally:
        worker.close()


def _serve(fault_on_worker1: tuple[str, int] | None = None, switch: tuple[int, str] | None = None):
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
    board = None
    if switch is not None:  # afore serve's policy board: switched after switch[0] targets
        import os

        from afore.scheduler.policy_board import PolicyBoard

        board = PolicyBoard(f"afore-test-planner-board-{os.getpid()}", "afore")
        if switch[0] < 0:  # posted before the workers start: they plan with it from their first target
            board.set(switch[1])
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(2):
        cfg = FFNWorkerConfig(rank=r, num_ffn=2, num_attention=1, model=path, port=port, m_tile=2, shape=shape,
                              policy="afore", cost=cost, metrics_port=metrics_port if r == 0 else 0, timeout_s=60,
                              policy_board=board.name if board is not None else "")
        proc = ctx.Process(target=_worker, args=(msgspec.json.encode(cfg), fault_on_worker1 if r == 1 else None))
        proc.start()
        procs.append(proc)
    conn = None
    try:
        conn = AttentionConnector(TransportConfig("127.0.0.1", port, 1, 2, spec.hidden_size, spec.top_k, timeout_s=60), 0)
        targets = [Target.from_seq(seq, shape.num_layers, 1) for seq in range(TARGETS)]
        outs = []
        for seq in range(TARGETS):
            if switch is not None and seq == switch[0]:
                board.set(switch[1])
            outs.append(conn.exchange(targets[seq], seq, *inputs[seq]))
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        stop_ffn_workers(procs)
        if conn is not None:
            conn.close()
        if board is not None:
            board.close()
    assert [p.exitcode for p in procs] == [0, 0]
    err = 0.0
    for seq in range(TARGETS):
        w = weights[targets[seq].layer]
        ref = dense_moe(*inputs[seq], w.w13, w.w2)
        err = max(err, float((outs[seq].double() - ref).norm() / ref.norm()))
    return err, text, (shape, cost, inputs)


def test_replicated_planners_agree_on_every_target():
    from test_ffn_end_to_end import metric

    err, text, _ = _serve()
    assert err <= 1e-6
    assert metric(text, "afore_ffn_plans_total", 'outcome="used"') == TARGETS   # every target ran on a plan ...
    assert metric(text, "afore_ffn_primary_only_targets_total") == 0           # ... the other worker's too
    assert metric(text, "afore_ffn_copies_total") > 0                          # skewed: replicas were copied
    assert metric(text, "afore_ffn_plan_seconds_count") == TARGETS
    assert metric(text, "afore_ffn_planner_resets_total") == 0


def test_a_failed_vote_restarts_both_planners_at_the_same_target():
    from test_ffn_end_to_end import metric

    err, text, _ = _serve(("drop", 3))
    assert err <= 1e-6  # a divergent planner after the restart would mis-partition later targets
    assert metric(text, "afore_ffn_primary_only_targets_total") == 1  # only the dropped target
    assert metric(text, "afore_ffn_plans_total", 'outcome="used"') == TARGETS - 1
    assert metric(text, "afore_ffn_planner_resets_total") == 1


def test_workers_holding_different_plans_agree_on_none():
    """Worker 1 makes another valid plan for one target than worker 0 (primary-only where the
    afore policy splits experts): both vote yes, the vote's plan digests differ, so neither plan is
    used (counted as diverged), both restart their planners, and every output stays exact. Without
    the digests each would partition the target's pairs under its own plan: pairs lost or doubled."""
    from afore.migrator.plan_source import ReplicatedPlanSource
    from afore.plan import plan_digest, primary_only_plan
    from afore.routing import count_host
    from test_ffn_end_to_end import metric

    at = 4
    err, text, (shape, cost, inputs) = _serve(("diverge", at))
    # worker 0's plan of that target, made here the same way: it is not the primary-only one
    source = ReplicatedPlanSource("afore", shape, SchedulerParams(), cost)
    for seq in range(at + 1):
        target = Target.from_seq(seq, shape.num_layers, 1)
        demand = count_host(inputs[seq][1].numpy(), shape.num_experts)
        plan = source.get(target, seq, 0.0, demand)
    assert plan_digest(plan) != plan_digest(primary_only_plan(shape, demand, target, at))
    assert not np.array_equal(plan.assignment, primary_only_plan(shape, demand, target, at).assignment)
    assert err <= 1e-6
    assert metric(text, "afore_ffn_plans_total", 'outcome="diverged"') == 1
    assert metric(text, "afore_ffn_primary_only_targets_total") == 1
    assert metric(text, "afore_ffn_planner_resets_total") == 1
    assert metric(text, "afore_ffn_plans_total", 'outcome="used"') == TARGETS - 1


@pytest.mark.parametrize("at", [-1, 0, 5])
def test_a_policy_switch_on_the_board_is_followed_by_every_worker(at):
    """``POST /afore/policy`` under ``--planner workers`` posts on the policy board: both workers
    read it before the next target and plan from there with the new policy (static: no replicas;
    switched before the first target, no copy is made at all, where the afore policy copies on
    these inputs: test_replicated_planners_agree_on_every_target); every target stays on an agreed
    plan and exact."""
    from test_ffn_end_to_end import metric

    err, text, _ = _serve(switch=(at, "static"))
    assert err <= 1e-6
    assert metric(text, "afore_ffn_policy_switches_total") == (0 if at < 0 else 1)  # at start: not a switch they follow
    assert metric(text, "afore_ffn_plans_total", 'outcome="used"') == TARGETS
    assert metric(text, "afore_ffn_primary_only_targets_total") == 0
    assert metric(text, "afore_ffn_plans_total", 'outcome="diverged"') == 0
    if at <= 0:  # the afore policy copies on these inputs; static never does
        assert metric(text, "afore_ffn_copies_total") == 0
