"""Part ``overlap``: slowdown of the grouped GEMM while expert copies run on the side stream, at
full rate and paced."""

from __future__ import annotations

import statistics
import sys

import torch
from tqdm import tqdm

from afore.bench.migration.shapes import decode_load
from afore.bench.migration.timing import capture, sync, time_ms
from afore.ffn.experts import grouped_expert_mlp, triton_available
from afore.migrator.copy_engine import CopyJob, make_copy_engine

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
            tok, slot, wt, n = decode_load(pairs, slots, rng, device)
            x = torch.randn(n, h, device=device, dtype=dtype)
            iters = 20

            def compute():
                for _ in range(iters):
                    grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend=backend)

            replay = capture(compute, device).replay if device.type == "cuda" else compute
            alone_guess = time_ms(replay, device, reps=3, warmup=2)
            for rate, engine in engines.items():
                dst.zero_()
                sync(device)
                one = engine.submit(jobs, [])
                engine.wait(one)
                sync(device)
                span = engine.elapsed_ms(one.start, one.end)  # one batch at this rate, alone
                correct = all(torch.equal(j.dst_w13, j.src_w13.to(device)) and torch.equal(j.dst_w2, j.src_w2.to(device)) for j in jobs)
                # enough batches to outlast twice the compute at this rate
                batches = max(1, int(2 * alone_guess / max(span, 1e-3)) + 1)
                alone_t, with_t, outlast = [], [], []
                for _ in range(15):
                    alone_t.append(time_ms(replay, device, reps=1, warmup=0))
                    sync(device)
                    last = None
                    for _ in range(batches):
                        last = engine.submit(jobs, [])
                    t0 = engine.mark()
                    replay()
                    t1 = engine.mark()
                    sync(device)
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
