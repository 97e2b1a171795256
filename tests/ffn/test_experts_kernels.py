"""The Triton grouped GEMM computes the torch backend's function (interpreter on CPU)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from afore.ffn.experts import align_pairs_to_tiles, grouped_expert_mlp, triton_available


def test_align_pairs_pads_every_slot_to_whole_tiles():
    slots = torch.tensor([2, 0, 2, 2, 1, 0, 2])
    sorted_pair, block_slot = align_pairs_to_tiles(slots, num_slots=4, block_m=2)
    p = slots.numel()
    rows = sorted_pair.view(-1, 2)
    for b, s in enumerate(block_slot.tolist()):
        members = [x for x in rows[b].tolist() if x < p]
        if s < 0:
            assert members == []
        else:
            assert members and all(slots[x] == s for x in members)
    assert sorted(x for x in sorted_pair.tolist() if x < p) == list(range(p))
    assert [s for s in block_slot.tolist() if s >= 0] == [0, 1, 2, 2]


def test_torch_backend_handles_empty_and_weights():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    w13, w2 = torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    empty = torch.zeros(0, dtype=torch.int64)
    assert torch.equal(grouped_expert_mlp(x, empty, empty, torch.zeros(0), w13, w2, backend="torch"), torch.zeros(4, 8))
    tok, slot = torch.tensor([1, 1]), torch.tensor([0, 0])
    one = grouped_expert_mlp(x, tok[:1], slot[:1], torch.tensor([1.0]), w13, w2, backend="torch")
    two = grouped_expert_mlp(x, tok, slot, torch.tensor([0.25, 0.5]), w13, w2, backend="torch")
    # the one-pair and two-pair calls run the GEMMs at different M (other BLAS paths): fp32 rounding of
    # sums of 8 and 3 products, a few ulps of the row's magnitude (an absolute 1e-6 failed 0.8% of seeds)
    assert torch.allclose(two, 0.75 * one, rtol=1e-5, atol=1e-5 * one.abs().max().item())


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend"):
        grouped_expert_mlp(torch.zeros(1, 2), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                           torch.zeros(0), torch.zeros(1, 2, 2), torch.zeros(1, 2, 1), backend="cuda")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernel_matches_torch_in_interpreter():
    # The interpreter must be chosen before triton is imported: run in a fresh process.
    code = textwrap.dedent("""
        import torch
        from afore.ffn.experts import grouped_expert_mlp
        torch.manual_seed(0)
        for n, h, inter, k, p, bm in [(13, 96, 80, 5, 30, 16), (3, 64, 64, 3, 7, 16), (20, 40, 24, 4, 50, 32)]:
            x = torch.randn(n, h); w13 = torch.randn(k, 2 * inter, h) / 8; w2 = torch.randn(k, h, inter) / 8
            tok = torch.randint(0, n, (p,)); slot = torch.randint(-1, k + 1, (p,)); wt = torch.rand(p)
            ref = grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend="torch")
            out = grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend="triton", block_m=bm)
            err = float((out - ref).norm() / ref.norm())
            assert err < 1e-5, (n, h, inter, err)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_pairs_outside_the_slot_range_are_skipped():
    x = torch.randn(5, 8)
    w13, w2 = torch.randn(3, 6, 8), torch.randn(3, 8, 3)
    tok = torch.tensor([0, 1, 2, 3, 4])
    slot = torch.tensor([0, -1, 2, 3, 1])
    wt = torch.rand(5)
    out = grouped_expert_mlp(x, tok, slot, wt, w13, w2, backend="torch")
    keep = torch.tensor([0, 2, 4])
    ref = grouped_expert_mlp(x, tok[keep], slot[keep], wt[keep], w13, w2, backend="torch")
    assert torch.equal(out, ref) and torch.equal(out[1], torch.zeros(8)) and torch.equal(out[3], torch.zeros(8))
