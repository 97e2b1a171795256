"""Part ``worker``: FFN worker processes end to end, driven from here as the attention side drives
them (``--model`` needed): gloo and NCCL rounds with plans via a PlanRing, and an ``afore serve
--role ffn`` round (launcher, scheduler with its TCP demand receiver, FFN workers)."""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from afore.config import ClusterShape
from afore.ports import free_port


def scrape(url: str) -> dict:
    """FFN worker 0's afore_ffn_* samples of a Prometheus endpoint, by sample name (no histogram buckets)."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("afore_ffn_") and 'worker="0"' in line and "_created" not in line and "_bucket" not in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def exchange_all(conn, targets: list, inputs: list, attn_device: str, desc: str, before_send=None) -> tuple[list, list]:
    """Send every target through ``conn`` with two in flight (the lookahead the FFN side needs);
    returns the outputs (on the host) and the round-trip times in ms. ``before_send(seq, target)``
    runs before each send."""
    dev = torch.device(attn_device)
    outs, times, pending = [None] * len(targets), [], []

    def receive_oldest() -> None:
        s0, t0, handle = pending.pop(0)
        outs[s0] = conn.recv(handle).cpu()
        times.append((time.perf_counter() - t0) * 1e3)

    for seq, target in enumerate(tqdm(targets, desc=desc, file=sys.stdout)):
        if before_send is not None:
            before_send(seq, target)
        hidden, ids, w = (t.to(dev) for t in inputs[seq])
        pending.append((seq, time.perf_counter(), conn.send(target, seq, hidden, ids, w)))
        if len(pending) == 2:
            receive_oldest()
    while pending:
        receive_oldest()
    return outs, times


def rel_errors(targets: list, inputs: list, outs: list, weights: list) -> list[float]:
    """Per target, the relative error of ``outs`` against the dense fp64 MoE layer."""
    from afore.ffn.reference import dense_moe

    errors = []
    for seq, target in enumerate(targets):
        hidden, ids, w = inputs[seq]
        ref = dense_moe(hidden, ids, w, weights[target.layer].w13, weights[target.layer].w2)
        errors.append(float((outs[seq].double() - ref).norm() / ref.norm()))
    return errors


def scrape_samples(url: str) -> dict:
    """Every sample of a Prometheus endpoint, by its full name (labels included)."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "_created" not in line}


def worker_round(args, backend: str, attn_device: str, ffn_devices: list[str], rng) -> dict:
    """A=1 attention connector here, F FFN worker processes, random valid plans via a PlanRing."""
    from afore.ffn.reference import random_plan, random_routing
    from afore.ffn.worker import FFNWorkerConfig, start_ffn_workers, stop_ffn_workers
    from afore.models.checkpoint import load_routed_experts, read_model_spec
    from afore.plan import SlotTable, Target
    from afore.transport.connector import AttentionConnector, TransportConfig

    try:
        from afore.scheduler.plan_ring import PlanRing
    except ImportError:  # afore._shm not built: no scheduler, primary-only plans
        PlanRing = None
    spec = read_model_spec(args.model)
    layers = len(spec.moe_layer_indices)
    weights = [load_routed_experts(args.model, i, torch.float32) for i in spec.moe_layer_indices]
    num_ffn = len(ffn_devices)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=num_ffn, num_layers=layers, redundant_slots=2,
                         m_tile=4, top_k=spec.top_k)
    targets = [Target(s, l, b) for s in range(max(1, args.worker_targets // (2 * layers))) for l in range(layers) for b in range(2)]
    inputs, plans, tables = [], {}, {l: SlotTable.empty(shape) for l in range(layers)}
    for seq, target in enumerate(targets):
        ids, w = random_routing(64, shape, rng, skew=1.2)
        inputs.append((torch.randn(64, spec.hidden_size), ids, w))
        demand = np.bincount(ids.reshape(-1).numpy(), minlength=spec.num_experts)
        plans[seq], tables[target.layer] = random_plan(shape, demand, tables[target.layer], rng, target, seq, new_copies=2)
    ring_name = f"afore-bench-ring-{os.getpid()}-{backend}"
    ring = PlanRing.create(ring_name, shape, num_readers=num_ffn, num_slots=max(16, len(targets) + 1), liveness_timeout_s=60) if PlanRing else None
    port, metrics_port = free_port(), free_port()
    timeout = 60.0
    cfg = TransportConfig("127.0.0.1", port, 1, num_ffn, spec.hidden_size, spec.top_k, torch.float32, backend, timeout_s=timeout)
    procs = start_ffn_workers([FFNWorkerConfig(rank=r, num_ffn=num_ffn, num_attention=1, model=args.model, port=port, device=d,
                                               backend=backend, m_tile=4, plan_ring=ring_name if ring else "",
                                               plan_timeout_ms=50.0, metrics_port=metrics_port if r == 0 else 0, timeout_s=timeout)
                               for r, d in enumerate(ffn_devices)])
    conn = None
    try:
        conn = AttentionConnector(cfg, 0, attn_device)
        if ring:
            for seq in sorted(plans):
                ring.publish(plans[seq])
        outs, times = exchange_all(conn, targets, inputs, attn_device, f"worker {backend}")
        errors = rel_errors(targets, inputs, outs, weights)
        metrics = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stop_ffn_workers(procs)
        if conn is not None:
            conn.close()
        if ring is not None:
            ring.close()
    return {"backend": backend, "attention_device": attn_device, "ffn_devices": ffn_devices, "targets": len(targets),
            "plans_from_ring": ring is not None, "max_rel_error": max(errors), "median_round_trip_ms": statistics.median(times),
            "exit_codes": [p.exitcode for p in procs], "worker0_metrics": metrics}


def ffn_node_round(args, attn_device: str, device: str, num_ffn: int, rng) -> dict:
    """``afore serve --role ffn`` (launcher, scheduler with its TCP demand receiver, FFN workers)
    driven from here as the attention node would drive it, minus vLLM: the transport store is the
    FFN node's, demand goes over TCP before each target, and the plans come from the scheduler."""
    import signal
    import subprocess

    from afore.ffn.reference import random_routing
    from afore.models.checkpoint import load_routed_experts, read_model_spec
    from afore.prefetch.receiver import DemandClient
    from afore.plan import Target
    from afore.transport.connector import AttentionConnector, TransportConfig, wait_for_ffn

    spec = read_model_spec(args.model)
    layers = len(spec.moe_layer_indices)
    weights = [load_routed_experts(args.model, i, torch.float32) for i in spec.moe_layer_indices]
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=num_ffn, num_layers=layers, top_k=spec.top_k)
    store_port, demand_port, admin_port = free_port(), free_port(), free_port()
    token = os.urandom(8).hex()
    cmd = [sys.executable, "-m", "afore.cli", "serve", "--role", "ffn", "--host", "0.0.0.0", "--model", args.model,
           "--attn-workers", "1", "--ffn-workers", str(num_ffn), "--device", device, "--dtype", "float32",
           "--policy", "afore", "--store-port", str(store_port), "--demand-port", str(demand_port),
           "--admin-port", str(admin_port)]
    if device == "cpu":
        cmd.append("--colocate")
    node = subprocess.Popen(cmd, env={**os.environ, "AFORE_DEMAND_TOKEN": token})
    conn = demand = None
    try:
        wait_for_ffn("127.0.0.1", store_port, num_ffn, 300.0)
        cfg = TransportConfig("127.0.0.1", store_port, 1, num_ffn, spec.hidden_size, spec.top_k, torch.float32,
                              "nccl" if attn_device.startswith("cuda") else "gloo", timeout_s=60.0, store_on_rank0=False)
        conn = AttentionConnector(cfg, 0, attn_device)
        demand = DemandClient("127.0.0.1", demand_port, token)
        targets = [Target(s, l, b) for s in range(max(1, args.worker_targets // (2 * layers))) for l in range(layers) for b in range(2)]
        inputs = []
        for _ in targets:
            ids, w = random_routing(64, shape, rng, skew=1.2)
            inputs.append((torch.randn(64, spec.hidden_size), ids, w))

        def send_demand(seq: int, target) -> None:  # the attention node's demand path, ahead of the data
            ids = inputs[seq][1]
            demand.put(target, 0, np.bincount(ids.reshape(-1).numpy(), minlength=spec.num_experts))

        outs, times = exchange_all(conn, targets, inputs, attn_device, "worker ffn-node", send_demand)
        errors = rel_errors(targets, inputs, outs, weights)
        node_metrics = f"http://127.0.0.1:{admin_port}/metrics"  # the FFN node's one endpoint: every process of it
        scheduler, worker0 = scrape_samples(node_metrics), scrape(node_metrics)
    finally:
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
        if demand is not None:
            demand.close()
        if conn is not None:
            conn.close()
    return {"backend": f"{cfg.backend} (afore serve --role ffn)", "attention_device": attn_device,
            "ffn_devices": [f"{device} x{num_ffn}"], "targets": len(targets), "plans_from_ring": True,
            "max_rel_error": max(errors), "median_round_trip_ms": statistics.median(times), "exit_codes": [node.returncode],
            "worker0_metrics": worker0, "scheduler_metrics": {k: v for k, v in scheduler.items() if "receiver" in k or "plans_total" in k}}


def bench_worker(args, device: torch.device, gpus: int, rng, on_round=None) -> dict | None:
    """Rounds: gloo (attention on the host, F workers on the GPUs: IPC copies, Triton kernels),
    then NCCL (needs distinct GPUs per rank: attention on GPU 1, one FFN worker on GPU 0).
    ``on_round(result)`` is called after each round (the report is written as it goes)."""
    if not args.model:
        print("bench migration: part 'worker' skipped (no --model)")
        return None
    result: dict = {"rounds": []}
    if device.type == "cuda":
        plan = [("gloo", "cpu", [f"cuda:{i}" for i in range(min(gpus, 2))])]
        if gpus >= 2:
            plan.append(("nccl", "cuda:1", ["cuda:0"]))
            plan.append(("ffn-node", "cuda:1", ["cuda"]))  # afore serve --role ffn, its FFN worker on GPU 0
    else:
        plan = [("gloo", "cpu", ["cpu", "cpu"]), ("ffn-node", "cpu", ["cpu", "cpu"])]
    wanted = {b.strip() for b in args.worker_backends.split(",")}
    for backend, attn, ffn in plan:
        if backend not in wanted:
            continue
        if backend == "ffn-node":
            result["rounds"].append(ffn_node_round(args, attn, ffn[0], len(ffn), rng))
        else:
            result["rounds"].append(worker_round(args, backend, attn, ffn, rng))
        if on_round is not None:
            on_round(result)
    return result
