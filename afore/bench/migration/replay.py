"""Part ``replay``: two FFN worker processes (one per GPU) replay a routing trace: plans from
Algorithm 1 (``afore.scheduler.algorithm``), copies by the migrator into reserved slots while
the previous target computes; per target raw copy time, exposed wait and lookahead window.
Worker 0 runs in the driver process, worker 1 in the peer process (``afore.bench.migration.peer``)."""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from afore.bench.migration.shapes import COST_MODEL_SHAPE, CPU_SHAPES, MODEL_SHAPES
from afore.bench.migration.timing import sync
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.ffn.layer import FFNLayer
from afore.migrator.copy_engine import make_copy_engine
from afore.migrator.migrator import Migrator, PoolSource
from afore.migrator.peers import export_tensors, open_tensors
from afore.migrator.slot_pool import SlotPool


def replay_trace(cfg: dict):
    from afore.traces.format import load_trace
    from afore.traces.synthetic import SyntheticSpec, generate

    if cfg.get("trace"):
        trace = load_trace(cfg["trace"])
        counts = trace.counts[: cfg["steps"], : cfg["layers"]]
        return counts, trace.top_k, trace.hidden_size, trace.moe_intermediate_size, f"{trace.model} ({trace.source})"
    h, inter, e, k = cfg["shape"]
    spec = SyntheticSpec(num_experts=e, top_k=k, num_layers=cfg["layers"], steps=cfg["steps"], microbatches=2,
                         tokens=cfg["tokens"], seed=cfg["seed"], hidden_size=h, moe_intermediate_size=inter)
    trace = generate(spec)
    return trace.counts, k, h, inter, f"{trace.model} ({trace.source})"


def replay_plans(counts: np.ndarray, shape: ClusterShape, cost: CostModel, params: SchedulerParams) -> list:
    """Algorithm 1 over a trace in FFN execution order, with per-layer state (table, U[t], A[t-1])."""
    from afore.scheduler.algorithm import schedule
    from afore.plan import SlotTable
    from afore.traces.format import iter_targets

    state = {l: (SlotTable.empty(shape), np.zeros((shape.num_workers, shape.redundant_slots), bool), None)
             for l in range(counts.shape[1])}
    plans = []
    for target, seq, demand in iter_targets(counts):
        table, protected, prev = state[target.layer]
        plan, table = schedule(shape, demand, table, protected, prev, params, cost, target, seq)
        state[target.layer] = (table, table.last_used == seq, plan.assignment)
        plans.append(plan)
    return plans


def replay_worker(worker: int, device: torch.device, cfg: dict, link) -> dict:
    """One FFN worker of the replay: own pools, peer pools by IPC, migrator + grouped GEMM."""
    counts, k, h, inter, source = replay_trace(cfg)
    steps, layers, microbatches, e = counts.shape
    shape = ClusterShape(num_experts=e, num_workers=2, num_layers=layers, redundant_slots=cfg["redundant_slots"],
                         m_tile=16, top_k=k)
    cost = CostModel(**cfg["cost"])
    plans = replay_plans(counts, shape, cost, SchedulerParams(theta=0, copy_budget=cfg["copy_budget"]))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(100 + worker)
    pools = {}
    for l in range(layers):
        pool = SlotPool(shape, worker, h, inter, dtype=dtype, device=device)
        pool.w13[: pool.num_primaries] = torch.randn(pool.num_primaries, 2 * inter, h, device=device, dtype=dtype, generator=gen) / h ** 0.5
        pool.w2[: pool.num_primaries] = torch.randn(pool.num_primaries, h, inter, device=device, dtype=dtype, generator=gen) / inter ** 0.5
        pools[l] = pool
    peer_blobs = link.swap_pools({l: export_tensors(p.w13, p.w2) for l, p in pools.items()})
    peer = {(l, 1 - worker): tuple(open_tensors(b)) for l, b in peer_blobs.items()}
    source_pools = {**{(l, worker): p for l, p in pools.items()}, **peer}
    migrator = Migrator(shape, worker, pools, make_copy_engine(device), PoolSource(shape, source_pools))
    ffn = {l: FFNLayer(p) for l, p in pools.items()}
    rng = np.random.default_rng(cfg["seed"] + 7)
    inputs = []
    for plan in plans:
        ids = rng.permutation(np.repeat(np.arange(e), plan.demand)).reshape(-1, k)
        n = ids.shape[0]
        inputs.append((torch.randn(n, h, device=device, dtype=dtype),
                       torch.as_tensor(ids, dtype=torch.int32, device=device),
                       torch.rand(n, k, device=device)))
    # warm-up: kernels compiled, allocator primed (no copies)
    from afore.plan import primary_only_plan
    for l in range(layers):
        warm = primary_only_plan(shape, plans[0].demand, plans[0].target, -1)
        ffn[l](*inputs[0], warm)
    sync(device)
    link.barrier()  # start together: both workers pull from each other
    migrator.prepare(plans[0])
    t0 = time.perf_counter()
    for i, plan in enumerate(tqdm(plans, desc=f"replay worker {worker}", file=sys.stdout, disable=worker != 0)):
        if i + 1 < len(plans):
            migrator.prepare(plans[i + 1], expected_seq=plan.seq + 1)
        migrator.commit(plan)
        ffn[plan.target.layer](*inputs[i], plan)
        migrator.release(plan)
    sync(device)
    wall = time.perf_counter() - t0
    records = migrator.drain_records()
    link.barrier()  # the peer may still pull from our pools until it is done
    copies_into_me = {p.seq: int(np.count_nonzero(p.copies[:, 2] == worker)) for p in plans}
    return {"worker": worker, "source": source, "targets": len(plans), "wall_s": wall, "rejected": migrator.rejected,
            "records": [dict(seq=r.seq, copies=r.copies, bytes=r.bytes, raw_copy_ms=r.raw_copy_ms, exposed_ms=r.exposed_ms,
                             window_ms=r.window_ms, planned_copies=copies_into_me[r.seq]) for r in records]}


class DriverLink:
    """Worker 0 (this process) <-> worker 1 (the peer process) over the pipe."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def swap_pools(self, mine: dict) -> dict:
        kind, theirs = self.conn.recv()
        if kind != "pools":
            raise RuntimeError(f"replay worker 1 failed before sharing its pools: {theirs}")
        self.conn.send(("pools", mine))
        return theirs

    def barrier(self) -> None:
        msg = self.conn.recv()
        if msg != "ready":
            raise RuntimeError(f"replay worker 1 failed: {msg}")
        self.conn.send("go")


class PeerLink:
    """Worker 1's end of ``DriverLink``."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def swap_pools(self, mine: dict) -> dict:
        self.conn.send(("pools", mine))
        return self.conn.recv()[1]

    def barrier(self) -> None:
        self.conn.send("ready")
        if self.conn.recv() != "go":
            raise RuntimeError("replay driver did not release the barrier")


def bench_replay(args, device: torch.device, peer_conn, cost: CostModel, copy_ms: float) -> dict:
    shape = MODEL_SHAPES[COST_MODEL_SHAPE] if device.type == "cuda" else CPU_SHAPES["tiny-a"]
    cfg = {"trace": args.trace, "steps": args.replay_steps if device.type == "cuda" else 4, "layers": args.replay_layers,
           "tokens": args.replay_tokens if device.type == "cuda" else 32, "seed": args.seed, "shape": shape,
           "redundant_slots": args.redundant_slots, "copy_budget": 4,
           "cost": {f: getattr(cost, f) for f in CostModel.__struct_fields__}}
    peer_conn.send(("replay", cfg))
    local = replay_worker(0, device, cfg, DriverLink(peer_conn))
    status, remote = peer_conn.recv()
    if status != "ok":
        raise RuntimeError(f"replay worker 1 failed: {remote}")
    workers = [local, remote]
    recs = [r for w in workers for r in w["records"]]
    fits = [r for r in recs if r["planned_copies"] * copy_ms <= r["window_ms"]]
    with_copies = [r for r in recs if r["copies"]]
    zero = [r for r in fits if r["exposed_ms"] < 1e-3]
    fits_copying = [r for r in fits if r["copies"]]
    zero_copying = [r for r in fits_copying if r["exposed_ms"] < 1e-3]
    return {"source": workers[0]["source"], "shape": dict(zip(("hidden", "intermediate", "experts", "top_k"), shape)),
            "targets": workers[0]["targets"], "per_worker_wall_s": [w["wall_s"] for w in workers],
            "rejected": sum(w["rejected"] for w in workers),
            "targets_with_copies": len(with_copies), "targets_copy_fits_window": len(fits),
            "share_zero_exposed_when_fits": len(zero) / len(fits) if fits else None,
            "targets_with_copies_fitting": len(fits_copying),
            "share_zero_exposed_when_fits_with_copies": len(zero_copying) / len(fits_copying) if fits_copying else None,
            "median_window_ms": statistics.median(r["window_ms"] for r in recs) if recs else None,
            "median_raw_copy_ms_with_copies": statistics.median(r["raw_copy_ms"] for r in with_copies) if with_copies else None,
            "max_exposed_ms": max((r["exposed_ms"] for r in recs), default=0.0),
            "total_exposed_ms": sum(r["exposed_ms"] for r in recs),
            "copy_ms_used_for_planned": copy_ms, "records": recs}
