"""``afore bench migration``: expert copy cost, copy/compute overlap and grouped-GEMM time.

Parts (all on the GPU when one is present; ``--device cpu`` runs the same code at small
sizes with the CPU engines, as a smoke test of the pipeline):

  kernels  Triton grouped GEMM vs the torch backend (bf16 error), grouped GEMM vs a loop of
           per-expert ``torch.matmul`` at decode-size loads, and beta_tile: the slope of the
           grouped GEMM's time over the number of M tiles (the scheduler's cost model).
  copies   one-sided pulls of expert weights from a peer process's slot pool (CUDA IPC on
           the second GPU: NVLink P2P), single and batched, per model expert shape, against
           the 450 GB/s NVLink peak and the measured large-copy rate (1 GiB pull).
  overlap  slowdown of the grouped GEMM while copies run on the side stream.
  replay   two FFN worker processes (one per GPU) replay a routing trace: plans from
           Algorithm 1 (``afore.scheduler.algorithm``), copies by the migrator into reserved
           slots while the previous target computes; per target raw copy time, exposed wait
           and lookahead window.
With one GPU, copies/overlap use a second pool on the same GPU and the replay is skipped.

Writes ``<name>.json`` (with the top-level ``cost_model`` that ``afore.scheduler.cost``
reads), ``<name>.md`` and ``<name>.png`` under ``--out-dir`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.ffn.experts import grouped_expert_mlp, triton_available
from afore.ffn.layer import FFNLayer
from afore.migrator.copy_engine import CopyJob, make_copy_engine
from afore.migrator.migrator import Migrator, PoolSource
from afore.migrator.peers import export_tensors, open_tensors
from afore.migrator.slot_pool import SlotPool
from afore.ports import free_port, free_port_run

NVLINK_PEAK_GBPS = 450.0  # H200 NVLink 4, one direction

#: name -> (hidden H, expert intermediate I, experts E, top_k)
MODEL_SHAPES = {
    "GLM-4.5-Air": (4096, 1408, 128, 8),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6),
    "DeepSeek-V3": (7168, 2048, 256, 8),
}
COST_MODEL_SHAPE = "Qwen3-30B-A3B"  # the expert shape the committed cost model describes
CPU_SHAPES = {"tiny-a": (256, 128, 16, 4), "tiny-b": (128, 96, 8, 2)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out-dir", default=None, help="directory of the report (default bench/results/)")
    parser.add_argument("--name", default=None, help="report name (default migration, or migration_1gpu with one GPU)")
    parser.add_argument("--parts", default="kernels,copies,overlap,replay", help="comma-separated subset of the parts")
    parser.add_argument("--workers-per-model", type=int, default=8, help="F used to size a worker's slots (E/F + R)")
    parser.add_argument("--redundant-slots", type=int, default=4)
    parser.add_argument("--replay-steps", type=int, default=48)
    parser.add_argument("--replay-layers", type=int, default=4)
    parser.add_argument("--replay-tokens", type=int, default=256, help="tokens per microbatch in the replay")
    parser.add_argument("--trace", default=None, help="routing trace (.npz, afore trace format); default: synthetic Qwen3-30B-A3B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint for the 'worker' part (FFN worker processes end to end)")
    parser.add_argument("--worker-targets", type=int, default=48, help="targets sent through the FFN workers")
    parser.add_argument("--worker-backends", default="gloo,nccl,ffn-node",
                        help="rounds of the 'worker' part: gloo, nccl (GPUs only), ffn-node (afore serve --role ffn)")


# ---------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on the current stream on GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_time_ms(fn, device: torch.device, reps: int = 20) -> float:
    """Median GPU time of ``fn`` replayed as a CUDA graph (no host launch overhead); on CPU the
    same as ``time_ms``. ``fn`` must not synchronise with the host."""
    if device.type != "cuda":
        return time_ms(fn, device, reps)
    return time_ms(_capture(fn, device).replay, device, reps)


def _capture(fn, device: torch.device) -> "torch.cuda.CUDAGraph":
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)
    return graph


def _fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(slope), float(intercept)


# ---------------------------------------------------------------------------- kernels


def _decode_load(pairs: int, slots: int, rng: np.random.Generator, device, skew: float = 1.0):
    """A worker's decode-size load: ``pairs`` pairs over ``slots`` slots, Zipf-skewed."""
    p = 1.0 / np.arange(1, slots + 1) ** skew
    slot = rng.choice(slots, size=pairs, p=p / p.sum())
    n = max(1, pairs)
    tok = rng.integers(0, n, size=pairs)
    return (torch.as_tensor(tok, device=device), torch.as_tensor(slot, device=device),
            torch.as_tensor(rng.random(pairs), dtype=torch.float32, device=device), n)


def bench_kernels(shapes: dict, args, device: torch.device, dtype: torch.dtype, rng) -> dict:
    out = {"check": [], "grouped_vs_loop": [], "beta_tile": {}}
    backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    loads = [8, 32, 128, 512, 2048] if device.type == "cuda" else [8, 32]
    for name, (h, inter, e, k) in tqdm(shapes.items(), desc="kernels", file=sys.stdout):
        slots = e // args.workers_per_model + args.redundant_slots
        w13 = torch.randn(slots, 2 * inter, h, device=device, dtype=dtype) / h ** 0.5
        w2 = torch.randn(slots, h, inter, device=device, dtype=dtype) / inter ** 0.5
        # correctness against the fp32 torch path on fresh inputs, output poisoned first
        tok, slot, wt, n = _decode_load(96, slots, rng, device)
        x = torch.randn(n, h, device=device, dtype=dtype)
        ref = grouped_expert_mlp(x.float(), tok, slot, wt, w13.float(), w2.float(), backend="torch")
        got = grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend=backend)
        err = float((got.float() - ref).norm() / ref.norm())
        out["check"].append({"model": name, "backend": backend, "rel_error": err, "nan": bool(torch.isnan(got).any())})
        for pairs in loads:
            tok, slot, wt, n = _decode_load(pairs, slots, rng, device)
            x = torch.randn(n, h, device=device, dtype=dtype)
            fn = lambda: grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend=backend)  # noqa: E731
            t_grouped = time_ms(fn, device)
            t_graph = graph_time_ms(fn, device)
            t_loop = time_ms(lambda: grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend="torch"), device)
            active = int(torch.unique(slot).numel())
            floor_ms = active * 3 * h * inter * w13.element_size() / (4.8e12) * 1e3 if device.type == "cuda" else None
            out["grouped_vs_loop"].append({"model": name, "slots": slots, "active_slots": active, "pairs": pairs,
                                           "grouped_ms": t_grouped, "grouped_graph_ms": t_graph, "loop_ms": t_loop,
                                           "speedup": t_loop / t_grouped, "weight_read_floor_ms": floor_ms})
        # beta_tile: full tiles of m_tile pairs spread round-robin over the slots
        m = 16
        tiles_list = [slots, 2 * slots, 4 * slots, 8 * slots, 16 * slots] if device.type == "cuda" else [slots, 2 * slots]
        times = []
        for tiles in tiles_list:
            slot = torch.arange(tiles, device=device).repeat_interleave(m) % slots
            tok = torch.arange(tiles * m, device=device)
            wt = torch.rand(tiles * m, device=device)
            x = torch.randn(tiles * m, h, device=device, dtype=dtype)
            times.append(graph_time_ms(lambda: grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend=backend, block_m=m), device))
        slope, intercept = _fit_line(tiles_list, times)
        out["beta_tile"][name] = {"tiles": tiles_list, "ms": times, "beta_tile_ms": slope, "intercept_ms": intercept}
        del w13, w2
    return out


# ---------------------------------------------------------------------------- peer process


def _source_pools(shapes: dict, experts: int, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    pools = {}
    for name, (h, inter, _, _) in shapes.items():
        buf = torch.randn(experts, 3 * inter * h, device=device, dtype=dtype, generator=gen)  # slot-pool layout
        pools[name] = (buf[:, : 2 * inter * h].view(experts, 2 * inter, h), buf[:, 2 * inter * h:].view(experts, h, inter))
    return pools


# ---------------------------------------------------------------------------- copies, overlap


def bench_copies(shapes: dict, src_pools: dict, big_src: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, cross: bool, use_driver: bool = True, streams: int = 2, batch_api: bool = True) -> dict:
    """Full-rate copies (no pacing): the engine's batch call, or the variant asked for."""
    from afore.migrator.copy_engine import CudaCopyEngine

    engine = (CudaCopyEngine(device, use_driver=use_driver, streams=streams, batch_api=batch_api, max_gbps=None)
              if device.type == "cuda" else make_copy_engine(device))
    stream = getattr(engine, "stream", None)

    def timed_batch(jobs: list[CopyJob], reps: int) -> float:
        times = []
        for _ in range(reps):
            t0 = engine.mark() if stream is None else None
            batch = engine.submit(jobs, [])
            engine.wait(batch)
            _sync(device)
            if stream is None:
                times.append((batch.end - batch.start) * 1e3)
            else:
                times.append(batch.start.elapsed_time(batch.end))
            del t0
        return statistics.median(times)

    big_dst = torch.empty_like(big_src, device=device)
    # The large-copy reference: the better of one transfer and 8 chunks spread over the lanes.
    chunk = big_src.numel() // 8
    variants = {"one transfer": [CopyJob(big_dst, big_dst[:0], big_src, big_src[:0])],
                "8 chunks": [CopyJob(big_dst[i * chunk:(i + 1) * chunk], big_dst[:0], big_src[i * chunk:(i + 1) * chunk], big_src[:0])
                             for i in range(8)]}
    big = {}
    for label, jobs in variants.items():
        timed_batch(jobs, 2)
        big[label] = timed_batch(jobs, 5)
    big_ms = min(big.values())
    large_rate = big_src.numel() / (big_ms * 1e-3) / 1e9
    rows = []
    batch_sizes = [1, 2, 4, 8, 16] if device.type == "cuda" else [1, 2, 4]
    for name, (src13, src2) in tqdm(src_pools.items(), desc="copies", file=sys.stdout):
        h, inter = src2.shape[1], src2.shape[2]
        n_max = min(max(batch_sizes), src13.shape[0])
        dst = torch.empty(n_max, 3 * inter * h, device=device, dtype=dtype)  # slot-pool layout
        dst13 = dst[:, : 2 * inter * h].view(n_max, 2 * inter, h)
        dst2 = dst[:, 2 * inter * h:].view(n_max, h, inter)
        per_expert = 3 * h * inter * dst.element_size()
        for n in batch_sizes:
            if n > n_max:
                continue
            jobs = [CopyJob(dst13[i], dst2[i], src13[i], src2[i]) for i in range(n)]
            dst.zero_()
            timed_batch(jobs, 2)
            correct = all(torch.equal(dst13[i], src13[i].to(device)) and torch.equal(dst2[i], src2[i].to(device)) for i in range(n))
            ms = timed_batch(jobs, 10)
            gbps = n * per_expert / (ms * 1e-3) / 1e9
            rows.append({"model": name, "experts": n, "bytes_per_expert": per_expert, "ms": ms, "ms_per_expert": ms / n, "correct": correct,
                         "gbps": gbps, "share_of_nvlink_peak": gbps / NVLINK_PEAK_GBPS, "share_of_large_copy": gbps / large_rate})
        del dst, dst13, dst2
    del big_dst
    return {"rows_models": list(src_pools), "cross_device": cross, "engine": engine.describe() if hasattr(engine, "describe") else type(engine).__name__,
            "streams": streams, "large_copy_ms_by_variant": big, "large_copy_bytes": big_src.numel(), "large_copy_ms": big_ms,
            "large_copy_gbps": large_rate, "nvlink_peak_gbps": NVLINK_PEAK_GBPS, "rows": rows}


#: Copy rate caps the overlap part compares (GB/s; None = full rate).
OVERLAP_RATES = (None, 200.0, 100.0, 50.0)


def bench_overlap(shapes: dict, src_pools: dict, args, device: torch.device, dtype: torch.dtype, rng) -> dict:
    """GPU time of the grouped GEMM alone vs while expert copies run on the side stream, at
    full rate and paced to each cap in ``OVERLAP_RATES`` (the default engine paces to
    ``DEFAULT_COPY_RATE_GBPS``).

    The compute (20 grouped GEMMs) is one CUDA graph, so the host adds nothing to its time;
    copies are enqueued before it and outlast it (checked: ``copies_outlast``). Runs alone
    and with copies alternate, so clock drift affects both alike."""
    from afore.config import DEFAULT_COPY_RATE_GBPS
    from afore.migrator.copy_engine import CudaCopyEngine

    rows = []
    backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    if device.type == "cuda":
        engines = {rate: CudaCopyEngine(device, max_gbps=rate) for rate in OVERLAP_RATES}
    else:
        engines = {None: make_copy_engine(device)}
    for name, (h, inter, e, k) in tqdm(shapes.items(), desc="overlap", file=sys.stdout):
        src13, src2 = src_pools[name]
        slots = e // args.workers_per_model + args.redundant_slots
        pool = torch.randn(slots, 3 * inter * h, device=device, dtype=dtype) / h ** 0.5
        w13 = pool[:, : 2 * inter * h].view(slots, 2 * inter, h)
        w2 = pool[:, 2 * inter * h:].view(slots, h, inter)
        n_copy = min(8, src13.shape[0])
        dst = torch.empty(n_copy, 3 * inter * h, device=device, dtype=dtype)
        jobs = [CopyJob(dst[i, : 2 * inter * h].view(2 * inter, h), dst[i, 2 * inter * h:].view(h, inter), src13[i], src2[i])
                for i in range(n_copy)]
        batch_bytes = sum(j.nbytes for j in jobs)
        for pairs in ([128, 1024] if device.type == "cuda" else [32]):
            tok, slot, wt, n = _decode_load(pairs, slots, rng, device)
            x = torch.randn(n, h, device=device, dtype=dtype)
            iters = 20

            def compute():
                for _ in range(iters):
                    grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend=backend)

            replay = _capture(compute, device).replay if device.type == "cuda" else compute
            alone_guess = time_ms(replay, device, reps=3, warmup=2)
            for rate, engine in engines.items():
                dst.zero_()
                _sync(device)
                one = engine.submit(jobs, [])
                engine.wait(one)
                _sync(device)
                span = engine.elapsed_ms(one.start, one.end)  # one batch at this rate, alone
                correct = all(torch.equal(j.dst_w13, j.src_w13.to(device)) and torch.equal(j.dst_w2, j.src_w2.to(device)) for j in jobs)
                # enough batches to outlast twice the compute at this rate
                batches = max(1, int(2 * alone_guess / max(span, 1e-3)) + 1)
                alone_t, with_t, outlast = [], [], []
                for _ in range(15):
                    alone_t.append(time_ms(replay, device, reps=1, warmup=0))
                    _sync(device)
                    last = None
                    for _ in range(batches):
                        last = engine.submit(jobs, [])
                    t0 = engine.mark()
                    replay()
                    t1 = engine.mark()
                    _sync(device)
                    engine.wait(last)
                    with_t.append(engine.elapsed_ms(t0, t1))
                    outlast.append(engine.elapsed_ms(t1, last.end) > 0)
                alone, with_copies = statistics.median(alone_t), statistics.median(with_t)
                rows.append({"model": name, "pairs": pairs, "iters": iters, "rate_gbps": rate,
                             "achieved_gbps": batch_bytes / max(span, 1e-9) / 1e6, "copies_correct": correct,
                             "default": rate == (DEFAULT_COPY_RATE_GBPS if device.type == "cuda" else None),
                             "alone_ms": alone, "with_copies_ms": with_copies, "slowdown": with_copies / alone - 1.0,
                             "copy_batches": batches, "experts_per_batch": n_copy,
                             "copies_outlast": sum(outlast) / len(outlast)})
        del pool, dst
    first = next(iter(engines.values()))
    return {"rows": rows, "engines": {str(r): (e.describe() if hasattr(e, "describe") else type(e).__name__) for r, e in engines.items()},
            "default_rate_gbps": DEFAULT_COPY_RATE_GBPS if device.type == "cuda" else None,
            "driver_memcpy": getattr(first, "uses_driver", False)}


# ---------------------------------------------------------------------------- replay


def _replay_trace(cfg: dict):
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


def _replay_worker(worker: int, device: torch.device, cfg: dict, link) -> dict:
    """One FFN worker of the replay: own pools, peer pools by IPC, migrator + grouped GEMM."""
    counts, k, h, inter, source = _replay_trace(cfg)
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
    _sync(device)
    link.barrier()  # start together: both workers pull from each other
    migrator.prepare(plans[0])
    t0 = time.perf_counter()
    for i, plan in enumerate(tqdm(plans, desc=f"replay worker {worker}", file=sys.stdout, disable=worker != 0)):
        if i + 1 < len(plans):
            migrator.prepare(plans[i + 1], expected_seq=plan.seq + 1)
        migrator.commit(plan)
        ffn[plan.target.layer](*inputs[i], plan)
        migrator.release(plan)
    _sync(device)
    wall = time.perf_counter() - t0
    records = migrator.drain_records()
    link.barrier()  # the peer may still pull from our pools until it is done
    copies_into_me = {p.seq: int(np.count_nonzero(p.copies[:, 2] == worker)) for p in plans}
    return {"worker": worker, "source": source, "targets": len(plans), "wall_s": wall, "rejected": migrator.rejected,
            "records": [dict(seq=r.seq, copies=r.copies, bytes=r.bytes, raw_copy_ms=r.raw_copy_ms, exposed_ms=r.exposed_ms,
                             window_ms=r.window_ms, planned_copies=copies_into_me[r.seq]) for r in records]}


class _DriverLink:
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


class _PeerLink:
    """Worker 1's end of ``_DriverLink``."""

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
    local = _replay_worker(0, device, cfg, _DriverLink(peer_conn))
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


# ---------------------------------------------------------------------------- FFN workers end to end


def _scrape(port: int) -> dict:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("afore_ffn_") and "{" in line and "_created" not in line and "_bucket" not in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _exchange_all(conn, targets: list, inputs: list, attn_device: str, desc: str, before_send=None) -> tuple[list, list]:
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


def _rel_errors(targets: list, inputs: list, outs: list, weights: list) -> list[float]:
    """Per target, the relative error of ``outs`` against the dense fp64 MoE layer."""
    from afore.ffn.reference import dense_moe

    errors = []
    for seq, target in enumerate(targets):
        hidden, ids, w = inputs[seq]
        ref = dense_moe(hidden, ids, w, weights[target.layer].w13, weights[target.layer].w2)
        errors.append(float((outs[seq].double() - ref).norm() / ref.norm()))
    return errors


def _scrape_samples(port: int) -> dict:
    """Every sample of a Prometheus endpoint, by its full name (labels included)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "_created" not in line}


def _worker_round(args, backend: str, attn_device: str, ffn_devices: list[str], rng) -> dict:
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
        outs, times = _exchange_all(conn, targets, inputs, attn_device, f"worker {backend}")
        errors = _rel_errors(targets, inputs, outs, weights)
        metrics = _scrape(metrics_port)
    finally:
        stop_ffn_workers(procs)
        if conn is not None:
            conn.close()
        if ring is not None:
            ring.close()
    return {"backend": backend, "attention_device": attn_device, "ffn_devices": ffn_devices, "targets": len(targets),
            "plans_from_ring": ring is not None, "max_rel_error": max(errors), "median_round_trip_ms": statistics.median(times),
            "exit_codes": [p.exitcode for p in procs], "worker0_metrics": metrics}


def _ffn_node_round(args, attn_device: str, device: str, num_ffn: int, rng) -> dict:
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
    metrics_port = free_port_run(1 + num_ffn)
    token = os.urandom(8).hex()
    cmd = [sys.executable, "-m", "afore.cli", "serve", "--role", "ffn", "--host", "0.0.0.0", "--model", args.model,
           "--attn-workers", "1", "--ffn-workers", str(num_ffn), "--device", device, "--dtype", "float32",
           "--policy", "afore", "--store-port", str(store_port), "--demand-port", str(demand_port),
           "--admin-port", str(admin_port), "--metrics-port", str(metrics_port)]
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

        outs, times = _exchange_all(conn, targets, inputs, attn_device, "worker ffn-node", send_demand)
        errors = _rel_errors(targets, inputs, outs, weights)
        scheduler, worker0 = _scrape_samples(metrics_port), _scrape(metrics_port + 1)
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
            "worker0_metrics": worker0, "scheduler_metrics": {k: v for k, v in scheduler.items() if "receiver" in k or "published" in k}}


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
            result["rounds"].append(_ffn_node_round(args, attn, ffn[0], len(ffn), rng))
        else:
            result["rounds"].append(_worker_round(args, backend, attn, ffn, rng))
        if on_round is not None:
            on_round(result)
    return result


# ---------------------------------------------------------------------------- report


def _markdown(data: dict) -> str:
    from afore.bench.report import markdown_table

    lines = [f"Device: {data['device']}; GPUs: {data['gpus']}; dtype {data['dtype']}.", ""]
    cm = data.get("cost_model")
    if cm:
        lines += ["## Cost model (read by `afore.scheduler.cost`)", "",
                  markdown_table(list(cm), [[round(v, 6) if isinstance(v, float) else v for v in cm.values()]]), ""]
    k = data.get("kernels")
    if k:
        lines += ["## Grouped GEMM correctness (bf16 vs fp32 torch)", "",
                  markdown_table(["model", "backend", "rel error", "NaN"], [[c["model"], c["backend"], f"{c['rel_error']:.2e}", c["nan"]] for c in k["check"]]), "",
                  "## Grouped GEMM vs per-expert matmul loop (decode loads)", "",
                  "Both eager (host launch overhead included, as the worker loop runs them); `graph ms` is the grouped GEMM "
                  "replayed as a CUDA graph (GPU time), `floor ms` the time to read the active slots' weights once at 4.8 TB/s.", "",
                  markdown_table(["model", "slots", "active", "pairs", "grouped ms", "graph ms", "floor ms", "loop ms", "speedup"],
                                 [[r["model"], r["slots"], r.get("active_slots"), r["pairs"], f"{r['grouped_ms']:.4f}", f"{r['grouped_graph_ms']:.4f}",
                                   "-" if r.get("weight_read_floor_ms") is None else f"{r['weight_read_floor_ms']:.4f}",
                                   f"{r['loop_ms']:.4f}", f"{r['speedup']:.2f}"] for r in k["grouped_vs_loop"]]), "",
                  "## beta_tile (grouped GEMM ms per 16-pair tile, slope of a linear fit)", "",
                  markdown_table(["model", "tiles", "ms", "beta_tile ms", "intercept ms"],
                                 [[m, v["tiles"], [round(t, 4) for t in v["ms"]], f"{v['beta_tile_ms']:.5f}", f"{v['intercept_ms']:.4f}"] for m, v in k["beta_tile"].items()]), ""]
    c = data.get("copies")
    if c:
        lines += [f"## Expert copies ({'IPC pull from the peer GPU' if c['cross_device'] else 'same device'}, {c.get('engine')}, full rate)", "",
                  f"Large copy ({c['large_copy_bytes'] / 2**30:.2f} GiB): {c['large_copy_ms']:.3f} ms = {c['large_copy_gbps']:.1f} GB/s "
                  f"({c['large_copy_gbps'] / c['nvlink_peak_gbps']:.0%} of the {c['nvlink_peak_gbps']:.0f} GB/s NVLink peak).", "",
                  markdown_table(["model", "experts", "MB/expert", "correct", "ms", "ms/expert", "GB/s", "of peak", "of large copy"],
                                 [[r["model"], r["experts"], f"{r['bytes_per_expert'] / 1e6:.1f}", r.get("correct"), f"{r['ms']:.4f}", f"{r['ms_per_expert']:.4f}",
                                   f"{r['gbps']:.1f}", f"{r['share_of_nvlink_peak']:.0%}", f"{r['share_of_large_copy']:.0%}"] for r in c["rows"]]), ""]
    cv = data.get("copies_variants")
    if cv:
        lines += ["Other copy engines (8 experts per batch; share of each variant's own large-copy rate):", "",
                  markdown_table(["engine", "large copy GB/s", *[m for m in data["copies"]["rows_models"]]],
                                 [[label, f"{v['large_copy_gbps']:.1f}", *[next((f"{r['gbps']:.1f} GB/s ({r['share_of_large_copy']:.0%})"
                                                                                for r in v["rows"] if r["model"] == m and r["experts"] == 8), "-")
                                                                           for m in data["copies"]["rows_models"]]] for label, v in cv.items()]), ""]
    o = data.get("overlap")
    if o:
        default = o.get("default_rate_gbps")
        lines += ["## Expert compute slowed by concurrent copies", "",
                  "20 grouped GEMMs as one CUDA graph, alone and while batches of 8 expert copies run on the side stream, "
                  "at full rate and paced to a cap (copies enqueued first; `outlast` = share of runs in which the copies were "
                  "still running when the compute ended; alone and with-copies runs alternate, medians of 15). "
                  f"The FFN worker's default is {'full rate' if default is None else f'{default:g} GB/s'} "
                  "(faster only when a plan's copies would otherwise not fit the lookahead window).", "",
                  markdown_table(["model", "pairs", "copy rate", "achieved GB/s", "correct", "alone ms", "with copies ms", "slowdown", "outlast"],
                                 [[r["model"], r["pairs"], ("full" if r.get("rate_gbps") is None else f"{r['rate_gbps']:g} GB/s")
                                   + (" (default)" if r.get("default") else ""), f"{r.get('achieved_gbps', 0):.1f}", r.get("copies_correct"),
                                   f"{r['alone_ms']:.3f}", f"{r['with_copies_ms']:.3f}", f"{r['slowdown']:+.1%}",
                                   f"{r['copies_outlast']:.0%}"] for r in o["rows"]]), ""]
    r = data.get("replay")
    if r:
        share = r["share_zero_exposed_when_fits"]
        lines += ["## Trace replay: exposed wait vs lookahead window (2 FFN workers)", "",
                  f"Trace: {r['source']}; {r['targets']} targets per worker; rejected plans: {r['rejected']}.", "",
                  f"Among the {r['targets_with_copies_fitting']} targets with copies that fit the window, zero exposed wait on "
                  f"{'n/a' if r['share_zero_exposed_when_fits_with_copies'] is None else format(r['share_zero_exposed_when_fits_with_copies'], '.1%')}.", "",
                  markdown_table(["targets with copies", "copy fits window", "zero exposed when fits", "median window ms",
                                  "median raw copy ms", "max exposed ms", "total exposed ms"],
                                 [[r["targets_with_copies"], r["targets_copy_fits_window"], "n/a" if share is None else f"{share:.1%}",
                                   f"{r['median_window_ms']:.3f}", "n/a" if r["median_raw_copy_ms_with_copies"] is None else f"{r['median_raw_copy_ms_with_copies']:.3f}",
                                   f"{r['max_exposed_ms']:.3f}", f"{r['total_exposed_ms']:.3f}"]]), ""]
    wk = data.get("worker")
    if wk:
        lines += ["## FFN workers end to end (attention connector here, worker processes, plans via a PlanRing)", "",
                  "The `afore serve --role ffn` round starts the FFN node as `afore serve` would on its own machine (the launcher, "
                  "the scheduler with its TCP demand receiver, the FFN workers) and drives it from here as the attention node does: "
                  "demand over TCP before each target, plans from the scheduler (policy afore), the transport store on the FFN node.", "",
                  markdown_table(["backend", "attention", "FFN workers", "targets", "max rel error vs dense fp64", "median round trip ms",
                                  "window ms (sum/count)", "exposed ms (sum)", "copies", "primary-only", "demand accepted over TCP", "exit codes"],
                                 [[r["backend"], r["attention_device"], ", ".join(r["ffn_devices"]), r["targets"], f"{r['max_rel_error']:.1e}",
                                   f"{r['median_round_trip_ms']:.2f}",
                                   f"{r['worker0_metrics'].get('afore_ffn_lookahead_window_ms_sum', 0):.2f}/{r['worker0_metrics'].get('afore_ffn_lookahead_window_ms_count', 0):.0f}",
                                   f"{r['worker0_metrics'].get('afore_ffn_exposed_copy_wait_ms_sum', 0):.3f}",
                                   f"{r['worker0_metrics'].get('afore_ffn_copies_total', 0):.0f}",
                                   f"{r['worker0_metrics'].get('afore_ffn_primary_only_total', 0):.0f}",
                                   "-" if "scheduler_metrics" not in r else
                                   f"{sum(v for k, v in r['scheduler_metrics'].items() if 'accepted' in k):.0f}",
                                   r["exit_codes"]] for r in wk["rounds"]]), ""]
    t = data.get("targets")
    if t:
        lines += ["## Targets", "", markdown_table(["target", "value", "met"], [[n, v["value"], v["met"]] for n, v in t.items()]), ""]
    return "\n".join(lines)


def _figure(data: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    k = data.get("kernels")
    if k:
        for model in {r["model"] for r in k["grouped_vs_loop"]}:
            rows = [r for r in k["grouped_vs_loop"] if r["model"] == model]
            axes[0].plot([r["pairs"] for r in rows], [r["speedup"] for r in rows], marker="o", label=model)
        axes[0].axhline(1.0, color="grey", lw=0.8)
        axes[0].set(xscale="log", xlabel="pairs per worker", ylabel="loop time / grouped time", title="grouped GEMM speedup")
        axes[0].legend(fontsize=7)
    c = data.get("copies")
    if c:
        for model in {r["model"] for r in c["rows"]}:
            rows = [r for r in c["rows"] if r["model"] == model]
            axes[1].plot([r["experts"] for r in rows], [r["gbps"] for r in rows], marker="o", label=model)
        axes[1].axhline(c["large_copy_gbps"], color="k", ls="--", lw=0.8, label="large copy")
        axes[1].axhline(c["nvlink_peak_gbps"], color="r", ls=":", lw=0.8, label="NVLink peak")
        axes[1].set(xscale="log", xlabel="experts per batch", ylabel="GB/s", title="expert copy bandwidth")
        axes[1].legend(fontsize=7)
    o = data.get("overlap")
    if o and o["rows"]:
        link = (data.get("copies") or {}).get("large_copy_gbps") or 400.0
        for key in sorted({(x["model"], x["pairs"]) for x in o["rows"]}):
            rows = sorted((x for x in o["rows"] if (x["model"], x["pairs"]) == key),
                          key=lambda x: x["rate_gbps"] or link)
            axes[3].plot([x["rate_gbps"] or link for x in rows], [100 * x["slowdown"] for x in rows], marker="o",
                         label=f"{key[0]} {key[1]} pairs")
        axes[3].axhline(3.0, color="r", ls=":", lw=0.8, label="3% target")
        axes[3].set(xlabel="copy rate GB/s (rightmost: full rate)", ylabel="compute slowdown %", title="compute slowed by copies")
        axes[3].legend(fontsize=6)
    r = data.get("replay")
    if r and r["records"]:
        recs = r["records"]
        axes[2].scatter([x["window_ms"] for x in recs], [x["raw_copy_ms"] for x in recs], s=6, label="raw copy")
        axes[2].scatter([x["window_ms"] for x in recs], [x["exposed_ms"] for x in recs], s=6, label="exposed wait")
        hi = max(x["window_ms"] for x in recs)
        axes[2].plot([0, hi], [0, hi], color="grey", lw=0.8)
        axes[2].set(xlabel="lookahead window (ms)", ylabel="ms", title="replay: copy vs window")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


def run(args: argparse.Namespace) -> int:
    from afore.bench.report import write_report

    if args.device == "cuda" and not torch.cuda.is_available():
        print("afore bench migration: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"kernels", "copies", "overlap", "replay", "worker"}
    if unknown:
        raise ValueError(f"--parts: expected a subset of kernels,copies,overlap,replay,worker, got {sorted(unknown)}")
    if args.redundant_slots < 1:
        raise ValueError(f"--redundant-slots: expected >= 1, got {args.redundant_slots}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = MODEL_SHAPES if device.type == "cuda" else CPU_SHAPES
    name = args.name or ("migration_1gpu" if gpus == 1 else "migration")
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    data: dict = {"device": torch.cuda.get_device_name(device) if gpus else "cpu", "gpus": gpus, "dtype": str(dtype)}
    if "kernels" in parts:
        data["kernels"] = bench_kernels(shapes, args, device, dtype, rng)

    cross = gpus >= 2 or device.type == "cpu"
    peer_device = "cuda:1" if gpus >= 2 else str(device)
    big_bytes = (1 << 30) if device.type == "cuda" else (1 << 24)
    ctx = torch.multiprocessing.get_context("spawn")
    peer_conn, child_conn = ctx.Pipe()
    peer = None
    need_peer = bool(parts & {"copies", "overlap", "replay"})
    if need_peer:
        if cross:
            from afore.bench import migration as this  # picklable by module name, also under -m
            peer = ctx.Process(target=this._peer_entry, args=(peer_device, shapes, 16, big_bytes, child_conn), daemon=True)
            peer.start()
            handles = peer_conn.recv()
            src_pools = {n: tuple(open_tensors(b)) for n, b in handles["pools"].items()}
            (big_src,) = open_tensors(handles["big"])
        else:
            src_pools = _source_pools(shapes, 16, device, dtype, seed=1)
            big_src = torch.empty(big_bytes, dtype=torch.uint8, device=device).fill_(7)
    try:
        if "copies" in parts:
            data["copies"] = bench_copies(shapes, src_pools, big_src, device, dtype, cross)
            if device.type == "cuda":
                data["copies_variants"] = {
                    "cuMemcpyAsync, 1 stream": bench_copies(shapes, src_pools, big_src, device, dtype, cross, streams=1, batch_api=False),
                    "cuMemcpyAsync, 2 streams": bench_copies(shapes, src_pools, big_src, device, dtype, cross, streams=2, batch_api=False),
                    "cuMemcpyAsync, 4 streams": bench_copies(shapes, src_pools, big_src, device, dtype, cross, streams=4, batch_api=False),
                    "Tensor.copy_": bench_copies(shapes, src_pools, big_src, device, dtype, cross, use_driver=False, streams=1)}
        if "overlap" in parts:
            data["overlap"] = bench_overlap(shapes, src_pools, args, device, dtype, rng)
        cost = _cost_model(data, shapes)
        if "replay" in parts and cross:
            data["replay"] = bench_replay(args, device, peer_conn, cost, cost.copy_ms)
            cost = _cost_model(data, shapes)
        if "worker" in parts:
            def write_partial(wk: dict) -> None:
                data["worker"] = wk
                write_report(name, data, _markdown(data), None, out_dir=args.out_dir)

            wk = bench_worker(args, device, gpus, rng, write_partial)
            if wk:
                data["worker"] = wk
        if parts & {"kernels", "copies", "replay"}:  # a worker-only run measures no cost figures
            data["cost_model"] = {f: getattr(cost, f) for f in CostModel.__struct_fields__}
            data["cost_model_shape"] = COST_MODEL_SHAPE if device.type == "cuda" else "tiny-a"
        data["targets"] = _targets(data)
    finally:
        if peer is not None:
            if peer.is_alive():
                peer_conn.send("exit")
            peer.join(timeout=30)
            if peer.is_alive():
                peer.terminate()
    paths = write_report(name, data, _markdown(data), _figure(data), out_dir=args.out_dir)
    print(_markdown(data))
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


def _peer_entry(device_str, shapes, experts, big_bytes, conn) -> None:
    """Spawned peer: waits for the replay config inside each 'replay' request."""
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pools = _source_pools(shapes, experts, device, dtype, seed=1)
    big = torch.empty(big_bytes, dtype=torch.uint8, device=device).fill_(7)
    conn.send({"pools": {n: export_tensors(*ts) for n, ts in pools.items()}, "big": export_tensors(big)})
    while True:
        msg = conn.recv()
        if msg == "exit":
            break
        if isinstance(msg, tuple) and msg[0] == "replay":
            try:
                conn.send(("ok", _replay_worker(1, device, msg[1], _PeerLink(conn))))
            except Exception:
                import traceback
                conn.send(("error", traceback.format_exc()))
    _sync(device)


def _cost_model(data: dict, shapes: dict) -> CostModel:
    name = COST_MODEL_SHAPE if COST_MODEL_SHAPE in shapes else next(iter(shapes))
    h, inter, _, _ = shapes[name]
    elem = 2 if data["dtype"] == "torch.bfloat16" else 4
    kw = {"bytes_per_expert": 3 * h * inter * elem}
    if "kernels" in data:
        kw["beta_tile_ms"] = max(data["kernels"]["beta_tile"][name]["beta_tile_ms"], 1e-6)
    if "copies" in data:
        rows = [r for r in data["copies"]["rows"] if r["model"] == name]
        slope, intercept = _fit_line([r["experts"] for r in rows], [r["ms"] for r in rows])
        # per-copy latency = intercept share; bandwidth from the slope (ms per expert)
        kw["link_bandwidth_gbps"] = kw["bytes_per_expert"] / max(slope, 1e-9) / 1e6
        kw["copy_latency_ms"] = max(intercept, 0.0)
    if "replay" in data and data["replay"]["median_window_ms"]:
        kw["window_ms"] = data["replay"]["median_window_ms"]
    return CostModel(**kw)


def _targets(data: dict) -> dict:
    """The issue's H200 targets. The copy and overlap targets are about GPU-to-GPU pulls; with one
    GPU the copies are same-device (not the production path) and are reported, not judged."""
    out = {}
    c = data.get("copies")
    if c and not c.get("cross_device", True):
        out["copy and overlap targets"] = {"value": "not judged: one GPU, same-device copies (HBM to HBM), not a peer pull", "met": "-"}
    elif c:
        batched = [r for r in c["rows"] if r["experts"] >= 8]
        worst = min((r["share_of_large_copy"] for r in batched), default=None)
        if worst is not None:
            out["batched copies >= 85% of the large-copy rate (worst model, >= 8 experts)"] = {"value": f"{worst:.0%}", "met": worst >= 0.85}
    o = data.get("overlap")
    if o and (c is None or c.get("cross_device", True)):
        default = [r for r in o["rows"] if r.get("default", True)]
        worst = max(r["slowdown"] for r in default)
        rate = o.get("default_rate_gbps")
        label = "full-rate" if rate is None else f"default ({rate:g} GB/s paced)"
        out[f"compute slowed <= 3% by concurrent {label} copies (worst)"] = {"value": f"{worst:+.1%}", "met": worst <= 0.03}
        full = [r for r in o["rows"] if r.get("rate_gbps") is None]
        if rate is not None and full:
            out["(for reference) compute slowed by full-rate copies (worst)"] = {"value": f"{max(r['slowdown'] for r in full):+.1%}", "met": "-"}
    r = data.get("replay")
    if r and r["share_zero_exposed_when_fits"] is not None:
        s = r["share_zero_exposed_when_fits"]
        out["zero exposed wait on >= 99% of targets whose copy fits the window"] = {"value": f"{s:.1%}", "met": s >= 0.99}
    k = data.get("kernels")
    if k and k["grouped_vs_loop"]:
        worst = min(x["speedup"] for x in k["grouped_vs_loop"])
        out["grouped GEMM faster than the matmul loop at every load"] = {"value": f"min speedup {worst:.2f}x", "met": worst > 1.0}
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m afore.bench.migration`` = ``afore bench migration`` without the other commands' imports
    (the GPU hosts lack the serving dependencies)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="afore bench migration", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    sys.argv = ["afore", "bench", "migration", *argv]  # recorded in the report as the equivalent command
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
