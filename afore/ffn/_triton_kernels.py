"""Triton kernels of the grouped expert GEMM (see ``afore.ffn.experts``).

Rows are token-expert pairs sorted by slot and padded per slot to ``BLOCK_M`` (one M tile
= one scheduler tile); every program computes one [BLOCK_M, BLOCK_N] tile of one slot, so
the work of a worker is sum over slots of ceil(pairs / BLOCK_M) tiles, which is what the
scheduler's tile load counts. Imported only when Triton is available (GPU, or CPU with
TRITON_INTERPRET=1 for correctness checks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_silu_kernel(x_ptr, token_ptr, sorted_pair_ptr, block_slot_ptr, w13_ptr, act_ptr,
                         num_pairs, H, I,
                         stride_xm, stride_ws, stride_wn, stride_am,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    valid = pair < num_pairs
    token = tl.load(token_ptr + pair, mask=valid, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
    w_base = w13_ptr + slot.to(tl.int64) * stride_ws
    g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = w_base + (offs_n[None, :] + I) * stride_wn + offs_k[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = offs_k < H - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc_g += tl.dot(a, g, input_precision="ieee")
            acc_u += tl.dot(a, u, input_precision="ieee")
        else:
            acc_g += tl.dot(a, g)
            acc_u += tl.dot(a, u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = act_ptr + rows[:, None] * stride_am + offs_n[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_weighted_kernel(act_ptr, sorted_pair_ptr, block_slot_ptr, weight_ptr, w2_ptr, y_ptr,
                          num_pairs, H, I,
                          stride_am, stride_ws, stride_wn, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + rows)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w2_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        mask_k = offs_k < I - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(weight_ptr + pair, mask=valid, other=0.0)
    acc = acc * weight[:, None]
    y_ptrs = y_ptr + pair[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc, mask=valid[:, None] & mask_n[None, :])


def _blocks(dim: int) -> tuple[int, int]:
    block_n = 64 if dim <= 1024 else 128
    return block_n, 64


def gate_up_silu(x: torch.Tensor, pair_token: torch.Tensor, sorted_pair: torch.Tensor,
                 block_slot: torch.Tensor, w13: torch.Tensor, act: torch.Tensor,
                 num_pairs: int, block_m: int) -> None:
    """act[row] = silu(x[token] W_gate^T) * (x[token] W_up^T) for every padded row of a slot tile."""
    h = x.shape[1]
    inter = w13.shape[1] // 2
    assert x.stride(1) == 1 and w13.stride(2) == 1 and act.stride(1) == 1
    block_n, block_k = _blocks(inter)
    grid = (block_slot.numel(), triton.cdiv(inter, block_n))
    _gate_up_silu_kernel[grid](x, pair_token, sorted_pair, block_slot, w13, act,
                               num_pairs, h, inter,
                               x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3)


def down_weighted(act: torch.Tensor, sorted_pair: torch.Tensor, block_slot: torch.Tensor,
                  pair_weight: torch.Tensor, w2: torch.Tensor, y: torch.Tensor,
                  num_pairs: int, block_m: int) -> None:
    """y[pair] = weight[pair] * act[row] W_down^T (fp32) for every valid row of a slot tile."""
    h, inter = w2.shape[1], w2.shape[2]
    assert act.stride(1) == 1 and w2.stride(2) == 1 and y.stride(1) == 1
    block_n, block_k = _blocks(h)
    grid = (block_slot.numel(), triton.cdiv(h, block_n))
    _down_weighted_kernel[grid](act, sorted_pair, block_slot, pair_weight, w2, y,
                                num_pairs, h, inter,
                                act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                IEEE=act.dtype == torch.float32, num_warps=4, num_stages=3)
