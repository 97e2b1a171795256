"""The Triton FFN step computes the torch step's function (Triton interpreter on CPU):
random plans with replicas and copies, a padded bucket (n < T*k pairs), bad ids, and the
two-launch route of large steps."""

import os
import subprocess
import sys
import textwrap

import pytest

from afore.ffn.experts import triton_available

CODE = textwrap.dedent("""
    import numpy as np, torch
    from afore.config import ClusterShape
    from afore.ffn.device_plan import DevicePlan
    from afore.ffn.experts import StepConfig, routed_expert_step
    from afore.ffn.reference import random_plan, random_routing, random_slot_table
    from afore.plan import Target

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    shape = ClusterShape(num_experts=12, num_workers=3, redundant_slots=2, top_k=3, m_tile=4)
    H, I = 32, 16
    cfg = StepConfig(16, 16, 16, 16)
    def case(n, pad=0, bad=False, workers=range(3)):
        ids, w = random_routing(n, shape, rng, skew=1.0)
        if bad and n:
            ids[0, 0], ids[n - 1, 2] = -3, 12
        demand = np.bincount(ids.reshape(-1).clamp(0, 11).numpy(), minlength=12)
        plan, _ = random_plan(shape, demand, random_slot_table(shape, rng, 1.0), rng, Target(0, 0, 0), 1,
                              new_copies=2)
        for wk in workers:
            k = int(shape.primary_counts[wk]) + 2
            x = torch.randn(n + pad, H); w13 = torch.randn(k, 2 * I, H) / 4; w2 = torch.randn(k, H, I) / 4
            idp = torch.cat([ids, torch.zeros(pad, 3, dtype=ids.dtype)])
            wp = torch.cat([w, torch.rand(pad, 3)])
            dp = DevicePlan(shape, wk, k, "cpu")
            table = dp.upload(dp.stage(plan), n * 3)
            e1, e2 = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            ref = routed_expert_step(x[:n], ids, w, table, w13, w2, e1, 12, "torch")
            out = torch.full((n + pad, H), 7.0)
            routed_expert_step(x, idp, wp, table, w13, w2, e2, 12, "triton", cfg, out=out)
            if n:
                err = float((out[:n] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                assert err < 1e-5, (n, pad, wk, err)
            assert torch.all(out[n:] == 7.0), "rows past n must stay untouched"
            assert int(e1) == int(e2) == (2 if bad and n else 0), (int(e1), int(e2))
    for n in (0, 1, 7, 40):
        case(n)
    case(10, pad=6)
    case(9, bad=True)
    case(2800, workers=[1])   # 8400 pairs > 8192: histogram launch, then route
    print("ok")
""")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_step_matches_torch_step_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]
