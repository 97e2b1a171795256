"""Tile configs of the Triton FFN step at prefill loads on the GPU host (issue 12): every
candidate of a wider grid than ``PREFILL_CONFIGS``, timed on the same inputs (the bench's
routing and plan, F = 8 share, bf16), with the gemm alone and the bf16 tensor-core floor.

    python3 bench/device/prefill_sweep.py      # $OUT/prefill_sweep.json
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time

import numpy as np
import torch

from afore.bench.dataplane.ffn import MODELS, device_rates, per_call_ms, plan_for, routing
from afore.config import ClusterShape
from afore.ffn import _triton_kernels as kernels
from afore.ffn.device_plan import DevicePlan, table_width
from afore.ffn.experts import PREFILL_CONFIGS, StepBuffers, StepConfig, routed_expert_step
from afore.migrator.slot_pool import SlotPool


def candidates():
    seen = list(PREFILL_CONFIGS)
    for bm, gn, dn, bk, warps, stages in itertools.product((64, 128), (64, 128), (128, 256), (64,), (4, 8), (3, 4)):
        cfg = StepConfig(bm, gn, dn, bk, warps, stages)
        if cfg not in seen:
            seen.append(cfg)
    return seen


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out_dir, exist_ok=True)
    device = torch.device("cuda")
    rates = device_rates(device)
    rng = np.random.default_rng(0)
    rows = []
    for name, (h, inter, e, k) in MODELS.items():
        f = 8
        shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=4, top_k=k, m_tile=16)
        pool = SlotPool(shape, 0, h, inter, dtype=torch.bfloat16, device=device)
        pool.storage.normal_(0.0, h ** -0.5)
        dp = DevicePlan(shape, 0, pool.num_slots, device)
        errs = torch.zeros(1, dtype=torch.int32, device=device)
        for load in (4096, 16384):
            tokens = load * f // k
            ids, weights = routing(tokens, e, k, rng)
            plan, _ = plan_for(shape, ids, seq=load)
            x = (torch.randn(tokens, h, device=device) * 0.5).to(torch.bfloat16)
            ids_d, w_d = ids.to(device), weights.to(device)
            table = dp.upload(dp.stage(plan), tokens * k).clone()
            ref = None
            for cfg in candidates():
                rec = {"model": name, "load": load, "config": dataclasses.astuple(cfg)}
                try:
                    fn = lambda: routed_expert_step(x, ids_d, w_d, table, pool.w13, pool.w2, errs, e, "triton", cfg)  # noqa: E731
                    out = fn()
                    if ref is None:
                        ref = out.float()
                    rec["max_abs_diff_vs_first"] = float((out.float() - ref).abs().max())
                    rec["step_ms"] = per_call_ms(fn, device, 10)
                    buf = StepBuffers(tokens * k, pool.num_slots, h, inter, e, x.dtype, device, cfg.block_m)
                    kernels.launch_route(ids_d.view(-1), table, buf, errs, e, table_width(e), cfg.block_m)
                    rec["gemm_ms"] = per_call_ms(lambda: kernels.launch_experts(x, w_d.view(-1), pool.w13, pool.w2, buf, k, cfg),
                                                 device, 10)
                    mine = int(np.asarray(plan.assignment)[:, 0].sum())
                    rec["pairs_here"] = mine
                    rec["tc_floor_ms"] = 6 * h * inter * mine / (rates["matmul_tflops"] * 1e9)
                except Exception as exc:  # noqa: BLE001
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(json.dumps(rec), flush=True)
                rows.append(rec)
        del pool
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "prefill_sweep.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%FT%TZ", time.gmtime()),
                   "rates": rates, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
