"""Tile configs of the Triton FFN step at decode loads on the GPU host (issue 12): a wider grid
than ``DECODE_CONFIGS``, each of the two expert kernels (gate_up + SiLU, down + weight) timed
alone as a CUDA graph on the same inputs (the bench's routing and plan, F = 8 share, bf16),
against the HBM floor of the active experts' weights at the measured copy rate.

    python3 bench/device/decode_sweep.py      # $OUT/decode_sweep.json (one line per row on stdout)

Stops starting new loads after $SWEEP_BUDGET_S seconds (default 300) so that it ends inside one
device call; what ran is written.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time

import numpy as np
import torch
import triton

from afore.bench.dataplane.ffn import MODELS, capture, device_rates, per_call_ms, plan_for, routing
from afore.config import ClusterShape
from afore.ffn import _triton_kernels as kernels
from afore.ffn.device_plan import DevicePlan, table_width
from afore.ffn.experts import DECODE_CONFIGS, StepBuffers, StepConfig
from afore.migrator.slot_pool import SlotPool

LOADS = (16, 64, 256, 512)  # pairs per worker (F = 8 share of tokens x top-8)


def candidates(block_m: int):
    seen = [c for c in DECODE_CONFIGS if c.block_m == block_m]
    for gn, dn, bk, (warps, stages) in itertools.product((16, 32, 64), (32, 64, 128), (64, 128, 256),
                                                         ((4, 3), (2, 4))):
        cfg = StepConfig(block_m, gn, dn, bk, warps, stages)
        if cfg not in seen:
            seen.append(cfg)
    return seen


def gate_up(x, w13, buf, top_k, cfg):
    h, inter = x.shape[1], w13.shape[1] // 2
    grid_m = buf.block_slot.numel()
    kernels._step_gate_up_kernel[(grid_m, triton.cdiv(inter, cfg.gate_up_n))](
        x, buf.sorted_pair, buf.block_slot, buf.block_rows, buf.used_blocks, w13, buf.act,
        h, inter, x.stride(0), w13.stride(0), w13.stride(1), buf.act.stride(0), grid_m,
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.gate_up_n, BLOCK_K=cfg.block_k, IEEE=False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def down(weights, w2, buf, cfg):
    h, inter = w2.shape[1], w2.shape[2]
    grid_m = buf.block_slot.numel()
    kernels._step_down_kernel[(grid_m, triton.cdiv(h, cfg.down_n))](
        buf.act, buf.sorted_pair, buf.block_slot, buf.block_rows, buf.used_blocks, weights, w2,
        buf.y, h, inter, buf.act.stride(0), w2.stride(0), w2.stride(1), buf.y.stride(0), grid_m,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_n, BLOCK_K=cfg.block_k, IEEE=False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    budget = float(os.environ.get("SWEEP_BUDGET_S", "300"))
    started = time.monotonic()
    device = torch.device("cuda")
    rates = device_rates(device)
    print(json.dumps({"rates": rates}), flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for name, (h, inter, e, k) in MODELS.items():
        f = 8
        shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=4, top_k=k, m_tile=16)
        pool = SlotPool(shape, 0, h, inter, dtype=torch.bfloat16, device=device)
        pool.storage.normal_(0.0, h ** -0.5)
        dp = DevicePlan(shape, 0, pool.num_slots, device)
        errs = torch.zeros(1, dtype=torch.int32, device=device)
        bytes_per_expert = 3 * h * inter * pool.storage.element_size()
        for load in LOADS:
            if time.monotonic() - started > budget:
                print(json.dumps({"stopped": f"budget {budget} s spent before {name} {load}"}), flush=True)
                break
            tokens = max(1, load * f // k)
            ids, weights = routing(tokens, e, k, rng)
            plan, _ = plan_for(shape, ids, seq=load)
            x = (torch.randn(tokens, h, device=device) * 0.5).to(torch.bfloat16)
            ids_d, w_d = ids.to(device), weights.to(device)
            table = dp.upload(dp.stage(plan), tokens * k).clone()
            for bm in (16, 32):
                buf = StepBuffers(tokens * k, pool.num_slots, h, inter, e, x.dtype, device, bm)
                kernels.launch_route(ids_d.view(-1), table, buf, errs, e, table_width(e), bm)
                torch.cuda.synchronize()
                used = int(buf.used_blocks.item())
                slots = buf.block_slot[:used].cpu().numpy()
                active = int(np.unique(slots).size)
                floor_ms = active * bytes_per_expert / (rates["copy_gbps"] * 1e6)
                ref = None
                for cfg in candidates(bm):
                    rec = {"model": name, "load": load, "tokens": tokens, "active": active, "blocks": used,
                           "floor_ms": floor_ms, "config": dataclasses.astuple(cfg)}
                    try:
                        both = lambda: (gate_up(x, pool.w13, buf, k, cfg), down(w_d.view(-1), pool.w2, buf, cfg))  # noqa: E731
                        both()
                        torch.cuda.synchronize()
                        rows_y = buf.y[:used * bm].float()
                        if ref is None:
                            ref = rows_y.clone()
                        rec["max_abs_diff_vs_first"] = float((rows_y - ref).abs().max())
                        g1 = capture(lambda: gate_up(x, pool.w13, buf, k, cfg), device)
                        g2 = capture(lambda: down(w_d.view(-1), pool.w2, buf, cfg), device)
                        g3 = capture(both, device)
                        rec["gate_up_ms"] = per_call_ms(g1.replay, device, 30)
                        rec["down_ms"] = per_call_ms(g2.replay, device, 30)
                        rec["gemm_ms"] = per_call_ms(g3.replay, device, 30)
                        rec["gemm_vs_floor"] = rec["gemm_ms"] / floor_ms
                    except Exception as exc:  # noqa: BLE001
                        rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    print(json.dumps(rec), flush=True)
                    rows.append(rec)
                del buf
        del pool
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "decode_sweep.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%FT%TZ", time.gmtime()),
                   "rates": rates, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
