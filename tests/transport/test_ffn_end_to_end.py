"""A attention connectors (this process) + F FFN worker processes over gloo, end to end.

Plans come from a real PlanRing (random valid plans, one target left without a plan); the
combined output of every attention worker must equal the monolithic MoE layer (invariant 1),
the planless target runs primary-only and is counted (invariant 5), SIGTERM exits cleanly.
"""

import os
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.reference import dense_moe, random_plan, random_routing
from afore.ffn.worker import FFNWorkerConfig, start_ffn_workers, stop_ffn_workers
from afore.plan import SlotTable, Target
from afore.transport.connector import AttentionConnector, TransportConfig
from afore.transport.shm import ShmAttentionEnd, ShmLayout, ShmSegment

pytestmark = pytest.mark.slow
M_TILE = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model():
    from afore.models.checkpoint import load_routed_experts, read_model_spec
    from afore.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3_moe", seed=0)
    spec = read_model_spec(path)
    weights = [load_routed_experts(path, i, torch.float32) for i in spec.moe_layer_indices]
    return str(path), spec, weights


def metric(text: str, name: str, label: str = "") -> float:
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} not in metrics")


def exact_reference(hidden, ids, weights, w13, w2, device):
    """What plain vLLM's MoE layer gives for these tokens: on CUDA its own fused_experts; on the CPU
    the reference of afore.ffn.exact with every pair on one pool (slot = expert)."""
    from afore.ffn.exact import _reference_pair_rows, pair_sum

    if device == "cuda":
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        return fused_experts(hidden.cuda(), w13.cuda(), w2.cuda(), weights.cuda(), ids.cuda()).cpu()
    return pair_sum(_reference_pair_rows(hidden, ids.to(torch.int64), weights, w13, w2))


@pytest.mark.parametrize("transport,device,exact", [("torch", "cpu", False), ("shm", "cpu", False), ("shm", "cpu", True),
                                                    # several FFN workers on one GPU: only the shm transport
                                                    # (NCCL refuses two ranks on one device); copies by CUDA IPC
                                                    pytest.param("shm", "cuda", False, marks=pytest.mark.gpu),
                                                    pytest.param("shm", "cuda", True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("num_attention,num_ffn", [(1, 2), (2, 3)])
def test_attention_to_ffn_round_trip_matches_dense_layer(model, num_attention, num_ffn, transport, device, exact):
    """The sum over the FFN workers equals the dense layer (fp64 reference, 1e-5); with ``exact``
    (a row per pair back, summed as vLLM sums them) it equals plain vLLM's layer bit for bit."""
    from afore.scheduler.plan_ring import PlanRing

    if exact and device == "cuda":  # the workers and the reference run vLLM's CUDA MoE kernels
        pytest.importorskip("vllm", reason="--exact on a GPU runs vLLM's CUDA MoE kernels: stage vLLM (bench/device)")
    path, spec, weights = model
    layers = len(spec.moe_layer_indices)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=num_ffn, num_layers=layers, redundant_slots=2,
                         m_tile=M_TILE, top_k=spec.top_k)
    rng = np.random.default_rng(num_attention * 10 + num_ffn)
    steps, microbatches = 2, 2
    targets = [Target(s, l, b) for s in range(steps) for l in range(layers) for b in range(microbatches)]
    skipped = 5  # this target gets no plan: every worker must fall back to primary-only
    wrong = 3    # this target's plan is made for other demand: not used, counted as mismatched
    inputs, plans, tables = [], {}, {l: SlotTable.empty(shape) for l in range(layers)}
    for seq, target in enumerate(targets):
        per_attn = []
        for a in range(num_attention):
            n = int(rng.integers(0, 24)) if a else int(rng.integers(8, 24))
            ids, w = random_routing(n, shape, rng, skew=1.2)
            per_attn.append((torch.randn(n, spec.hidden_size), ids, w))
        inputs.append(per_attn)
        demand = np.bincount(torch.cat([p[1] for p in per_attn]).reshape(-1).numpy(), minlength=spec.num_experts)
        if seq == wrong:
            demand = demand.copy()
            demand[int(np.argmax(demand))] += 1  # a stale or wrong report
        if seq != skipped:
            plan, tables[target.layer] = random_plan(shape, demand, tables[target.layer], rng, target, seq, new_copies=2)
            plans[seq] = plan

    ring_name = f"afore-test-ring-{os.getpid()}-{num_ffn}"
    ring = PlanRing.create(ring_name, shape, num_readers=num_ffn, liveness_timeout_s=30.0)
    port, metrics_port = free_port(), free_port()
    cfg = TransportConfig("127.0.0.1", port, num_attention, num_ffn, spec.hidden_size, spec.top_k, timeout_s=60)
    segment = f"afore-test-dp-{os.getpid()}-{num_ffn}" if transport == "shm" else ""
    layout = ShmLayout(num_attention=num_attention, num_ffn=num_ffn, hidden=spec.hidden_size, top_k=spec.top_k,
                       max_tokens=32, depth=2, exact=exact)
    seg = ShmSegment.create(segment, layout) if segment else None
    store = None
    if device == "cuda":  # the store afore serve hosts for the pools' CUDA IPC handles
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    workers = start_ffn_workers([
        FFNWorkerConfig(rank=r, num_ffn=num_ffn, num_attention=num_attention, model=path, port=port, m_tile=M_TILE,
                        device=device,
                        plan_ring=ring_name, plan_timeout_ms=200.0, metrics_port=metrics_port if r == 0 else 0,
                        copy_delay_ms=2.0, timeout_s=60, shm_segment=segment, max_tokens=32, exact=exact)
        for r in range(num_ffn)])
    outputs = [[None] * len(targets) for _ in range(num_attention)]
    errors, conns = [], []
    # GPU workers capture (and tune) a CUDA graph per token bucket before they attach
    start_s = 600 if device == "cuda" else 60
    ready, go = threading.Semaphore(0), threading.Event()

    def attention(a):
        try:
            conn = ShmAttentionEnd(segment, layout, a, device, timeout_s=start_s) if segment else AttentionConnector(cfg, a)
            conns.append(conn)
            ready.release()  # the FFN workers attached to the ring before the rendezvous
            if not go.wait(start_s + 60):
                raise TimeoutError("the test did not start the targets")
            # two targets in flight: send t+1 before receiving t
            pending = []
            for seq, target in enumerate(targets):
                pending.append((seq, conn.send(target, seq, *(t.to(device) for t in inputs[seq][a]))))
                if len(pending) == 2:
                    s, h = pending.pop(0)
                    outputs[a][s] = conn.recv(h)
            for s, h in pending:
                outputs[a][s] = conn.recv(h)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=attention, args=(a,), daemon=True) for a in range(num_attention)]
    try:
        for t in threads:
            t.start()
        # every attention end connected; a worker that exits first fails the test now, with its code
        deadline, connected = time.monotonic() + start_s + 60, 0
        while connected < num_attention:
            if ready.acquire(timeout=0.5):
                connected += 1
                continue
            dead = {p.name: p.exitcode for p in workers if p.exitcode is not None}
            assert not dead and not errors, f"before the rendezvous: workers exited {dead}, errors {errors}"
            assert time.monotonic() < deadline, "the attention ends did not connect in time"
        for seq in sorted(plans):
            ring.publish(plans[seq])
        go.set()
        for t in threads:
            t.join(timeout=start_s + 120)
        assert not errors, errors
        assert all(not t.is_alive() for t in threads)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        stop_ffn_workers(workers)  # SIGTERM while the attention side is still connected
        for conn in conns:
            conn.close()
        ring.close()
        if seg is not None:
            seg.close()
        del store
    assert [p.exitcode for p in workers] == [0] * num_ffn
    for seq, target in enumerate(targets):
        w = weights[target.layer]
        for a in range(num_attention):
            hidden, ids, tw = inputs[seq][a]
            out = outputs[a][seq].cpu()
            assert out.shape == hidden.shape
            if hidden.shape[0] and exact:
                assert torch.equal(out, exact_reference(hidden, ids, tw, w.w13, w.w2, device)), (seq, a)
            elif hidden.shape[0]:
                ref = dense_moe(hidden, ids, tw, w.w13, w.w2)
                assert float((out.double() - ref).norm() / ref.norm()) <= 1e-5, (seq, a)
    assert metric(text, "afore_ffn_targets_total") == len(targets)
    assert metric(text, "afore_ffn_primary_only_targets_total") == 2
    assert metric(text, "afore_ffn_plans_total", 'outcome="missed"') == 1
    assert metric(text, "afore_ffn_plans_total", 'outcome="mismatched"') == 1
    assert metric(text, "afore_ffn_plans_total", 'outcome="used"') == len(targets) - 2
    assert metric(text, "afore_ffn_lookahead_window_seconds_count") >= 1


def test_attention_side_rejects_wrong_shapes():
    cfg = TransportConfig("127.0.0.1", 1, 1, 1, 8, 2)
    from afore.transport.connector import check_inputs

    ok = (torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 2))
    assert check_inputs(cfg, *ok) == 3
    for bad, field in [((torch.zeros(3, 7),) + ok[1:], "hidden"),
                       ((ok[0].double(),) + ok[1:], "hidden"),
                       ((ok[0], torch.zeros(3, 2, dtype=torch.int64), ok[2]), "topk_ids"),
                       ((ok[0], ok[1], torch.zeros(2, 2)), "topk_weights")]:
        with pytest.raises(ValueError, match=field):
            check_inputs(cfg, *bad)
