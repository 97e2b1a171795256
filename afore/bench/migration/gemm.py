"""Part ``kernels``: Triton grouped GEMM vs the torch backend (bf16 error), grouped GEMM vs a loop
of per-expert ``torch.matmul`` at decode-size loads, and beta_tile: the slope of the grouped
GEMM's time over the number of M tiles (the scheduler's cost model)."""

from __future__ import annotations

import functools
import sys

import torch
from tqdm import tqdm

from afore.bench.migration.shapes import decode_load
from afore.bench.migration.timing import fit_line, graph_time_ms, time_ms
from afore.ffn.experts import grouped_expert_mlp, triton_available


def bench_kernels(shapes: dict, args, device: torch.device, dtype: torch.dtype, rng) -> dict:
    out = {"check": [], "grouped_vs_loop": [], "beta_tile": {}}
    backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    loads = [8, 32, 128, 512, 2048] if device.type == "cuda" else [8, 32]
    for name, (h, inter, e, k) in tqdm(shapes.items(), desc="kernels", file=sys.stdout):
        slots = e // args.workers_per_model + args.redundant_slots
        w13 = torch.randn(slots, 2 * inter, h, device=device, dtype=dtype) / h ** 0.5
        w2 = torch.randn(slots, h, inter, device=device, dtype=dtype) / inter ** 0.5
        # correctness against the fp32 torch path on fresh inputs, output poisoned first
        tok, slot, wt, n = decode_load(96, slots, rng, device)
        x = torch.randn(n, h, device=device, dtype=dtype)
        ref = grouped_expert_mlp(x.float(), tok, slot, wt, w13.float(), w2.float(), backend="torch")
        got = grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend=backend)
        err = float((got.float() - ref).norm() / ref.norm())
        out["check"].append({"model": name, "backend": backend, "rel_error": err, "nan": bool(torch.isnan(got).any())})
        for pairs in loads:
            tok, slot, wt, n = decode_load(pairs, slots, rng, device)
            x = torch.randn(n, h, device=device, dtype=dtype)
            # partial binds this iteration's tensors now (a lambda would read w13/w2 from the
            # enclosing scope, which the `del` below unbinds)
            fn = functools.partial(grouped_expert_mlp, x, tok, slot, wt, w13, w2, backend=backend)
            t_grouped = time_ms(fn, device)
            t_graph = graph_time_ms(fn, device)
            t_loop = time_ms(functools.partial(grouped_expert_mlp, x, tok, slot, wt, w13, w2, backend="torch"), device)
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
            times.append(graph_time_ms(functools.partial(grouped_expert_mlp, x, tok, slot, wt, w13, w2, backend=backend,
                                                         block_m=m), device))
        slope, intercept = fit_line(tiles_list, times)
        out["beta_tile"][name] = {"tiles": tiles_list, "ms": times, "beta_tile_ms": slope, "intercept_ms": intercept}
        del w13, w2  # free this model's weights before the next one's
    return out
