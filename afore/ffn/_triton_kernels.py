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


# ---------------------------------------------------------------------------- the FFN step
#
# One worker's FFN step (``afore.ffn.experts.routed_expert_step``) in four kernels that read
# everything they need from device memory, so that the step never reads a value back to the
# host and replays unchanged as a CUDA graph with a new plan:
#
#   route      ids [P] + plan table (per expert: ordinal interval [lo, hi) and slot of this
#              worker, and the pair count n) -> per pair its row in slot-sorted order or -1,
#              the rows' pair ids, and a block table (slot, valid rows) of BLOCK_M-row blocks
#   gate_up    act[row] = silu(x W_gate^T) * (x W_up^T) for the rows of each used block
#   down       y[row] = weight * act[row] W_down^T (fp32)
#   combine    out[t] = sum over j < k of y[pos[t*k + j]] in a fixed order (deterministic:
#              no atomics, so a replay equals the eager step to the bit)
#
# The plan table is int32[3*EP + 1]: lo[0:EP], hi[EP:2EP], slot[2EP:3EP], n at [3*EP];
# EP = next power of two above E, and entries e >= E are (0, 0, -1): the bin of invalid ids.
# Blocks follow expert order; the rows of expert e on this worker are the pairs whose
# ordinal o (count of earlier pairs of e) lies in [lo, hi), at row pstart[e] + o - lo.


@triton.jit
def _expert_histogram(e, keep, EP: tl.constexpr):
    """Counts per expert of the ids ``e`` where ``keep`` (others are counted in bin 0, then removed)."""
    eo = tl.arange(0, EP)
    dropped = tl.sum((~keep).to(tl.int32), 0)
    return tl.histogram(tl.where(keep, e, 0), EP) - tl.where(eo == 0, dropped, 0)


@triton.jit
def _route_hist_kernel(ids_ptr, table_ptr, hist_ptr, E,
                       EP: tl.constexpr, CHUNK: tl.constexpr):
    """hist[c, e]: valid pairs of expert e in chunk c."""
    pid = tl.program_id(0)
    n = tl.load(table_ptr + 3 * EP)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    m = offs < n
    e = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
    tl.store(hist_ptr + pid * EP + tl.arange(0, EP), _expert_histogram(e, m & (e >= 0) & (e < E), EP))


@triton.jit
def _route_kernel(ids_ptr, table_ptr, hist_ptr, pair_pos_ptr, sorted_pair_ptr,
                  block_slot_ptr, block_rows_ptr, used_blocks_ptr, errors_ptr, E, num_chunks,
                  EP: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                  HIST_FROM_TABLE: tl.constexpr, HIST_ROWS: tl.constexpr,
                  SCAN: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    n = tl.load(table_ptr + 3 * EP)
    eo = tl.arange(0, EP)
    lo = tl.load(table_ptr + eo)
    hi = tl.load(table_ptr + EP + eo)
    slot = tl.load(table_ptr + 2 * EP + eo)
    chunk_start = pid * CHUNK
    total = tl.zeros((EP,), dtype=tl.int32)
    before = tl.zeros((EP,), dtype=tl.int32)
    if HIST_FROM_TABLE:
        for c0 in range(0, num_chunks, HIST_ROWS):
            rows = c0 + tl.arange(0, HIST_ROWS)
            h = tl.load(hist_ptr + rows[:, None] * EP + eo[None, :], mask=rows[:, None] < num_chunks, other=0)
            total += tl.sum(h, 0)
            before += tl.sum(tl.where(rows[:, None] < pid, h, 0), 0)
    else:
        # every program counts all n pairs itself: one launch, no inter-program exchange
        for s0 in range(0, n, SCAN):
            offs = s0 + tl.arange(0, SCAN)
            m = offs < n
            e = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
            keep = m & (e >= 0) & (e < E)
            total += _expert_histogram(e, keep, EP)
            before += _expert_histogram(e, keep & (offs < chunk_start), EP)
    my_count = tl.minimum(tl.maximum(total - lo, 0), hi - lo)
    padded = (my_count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pend = tl.cumsum(padded, 0)
    pstart = pend - padded
    used = tl.sum(padded, 0) // BLOCK_M
    if pid == 0:
        tl.store(used_blocks_ptr, used)
    for b0 in range(pid * BLOCK_T, used, programs * BLOCK_T):  # the block table, spread over the programs
        b = b0 + tl.arange(0, BLOCK_T)
        row = b * BLOCK_M
        eb = tl.sum((pend[None, :] <= row[:, None]).to(tl.int32), 1)
        hot = eb[:, None] == eo[None, :]
        s_b = tl.sum(tl.where(hot, slot[None, :], 0), 1)
        start_b = tl.sum(tl.where(hot, pstart[None, :], 0), 1)
        cnt_b = tl.sum(tl.where(hot, my_count[None, :], 0), 1)
        mb = b < used
        tl.store(block_slot_ptr + b, s_b, mask=mb)
        tl.store(block_rows_ptr + b, tl.minimum(cnt_b - (row - start_b), BLOCK_M), mask=mb)
    running = before
    bad = 0
    for s in range(0, CHUNK, SUB):
        offs = chunk_start + s + tl.arange(0, SUB)
        m = offs < n
        e = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
        valid = (e >= 0) & (e < E)
        bad += tl.sum((m & ~valid).to(tl.int32), 0)
        keep = m & valid
        hot = ((e[:, None] == eo[None, :]) & keep[:, None]).to(tl.int32)
        incl = tl.cumsum(hot, 0)
        ordinal = tl.sum(hot * (incl - 1 + running[None, :]), 1)
        running += tl.sum(hot, 0)
        lo_e = tl.sum(hot * lo[None, :], 1)
        hi_e = tl.sum(hot * hi[None, :], 1)
        ps_e = tl.sum(hot * pstart[None, :], 1)
        mine = keep & (ordinal >= lo_e) & (ordinal < hi_e)
        pos = tl.where(mine, ps_e + ordinal - lo_e, -1)
        tl.store(pair_pos_ptr + offs, pos, mask=m)
        tl.store(sorted_pair_ptr + pos, offs, mask=mine)
    if bad > 0:
        tl.atomic_add(errors_ptr, bad)


@triton.jit
def _step_gate_up_kernel(x_ptr, sorted_pair_ptr, block_slot_ptr, block_rows_ptr, used_blocks_ptr, w13_ptr, act_ptr,
                         H, I, stride_xm, stride_ws, stride_wn, stride_am, grid_m,
                         TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    used = tl.load(used_blocks_ptr)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_M)
    for b in range(pid_m, used, grid_m):
        slot = tl.load(block_slot_ptr + b)
        valid = r < tl.load(block_rows_ptr + b)
        pair = tl.load(sorted_pair_ptr + b * BLOCK_M + r, mask=valid, other=0)
        token = (pair // TOPK).to(tl.int64)
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
        rows = (b * BLOCK_M + r).to(tl.int64)
        tl.store(act_ptr + rows[:, None] * stride_am + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _step_down_kernel(act_ptr, sorted_pair_ptr, block_slot_ptr, block_rows_ptr, used_blocks_ptr, weight_ptr, w2_ptr,
                      y_ptr, H, I, stride_am, stride_ws, stride_wn, stride_ym, grid_m,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    used = tl.load(used_blocks_ptr)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_M)
    for b in range(pid_m, used, grid_m):
        slot = tl.load(block_slot_ptr + b)
        valid = r < tl.load(block_rows_ptr + b)
        rows = (b * BLOCK_M + r).to(tl.int64)
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
        pair = tl.load(sorted_pair_ptr + b * BLOCK_M + r, mask=valid, other=0)
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], acc, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(y_ptr, pair_pos_ptr, table_ptr, out_ptr, H, stride_ym, stride_om,
                    N_OFFSET: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    n_tok = tl.load(table_ptr + N_OFFSET) // TOPK
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mt = t < n_tok
    h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = h < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pos = tl.load(pair_pos_ptr + t * TOPK + j, mask=mt, other=-1).to(tl.int64)
        acc += tl.load(y_ptr + pos[:, None] * stride_ym + h[None, :], mask=(pos >= 0)[:, None] & mh[None, :], other=0.0)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_om + h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & mh[None, :])


#: Pairs up to which one route launch counts every pair itself (decode); above, a histogram
#: launch per chunk comes first (prefill).
SINGLE_LAUNCH_PAIRS = 8192


def route_chunk(capacity: int) -> int:
    """Pairs per route program for a step of at most ``capacity`` pairs."""
    return 32 if capacity <= SINGLE_LAUNCH_PAIRS else 512


def launch_route(ids: torch.Tensor, table: torch.Tensor, buffers, errors: torch.Tensor, num_experts: int,
                 ep: int, block_m: int) -> None:
    """Fill ``buffers`` (pair_pos, sorted_pair, block_slot, block_rows, used_blocks) from ``ids``
    (int32/int64 [capacity], the first n valid) and ``table`` (int32[3*ep + 1]); ``errors``
    (int32[1]) counts the ids outside [0, E) among the n."""
    capacity = ids.numel()
    chunk = route_chunk(capacity)
    num_chunks = max(1, triton.cdiv(capacity, chunk))
    from_table = capacity > SINGLE_LAUNCH_PAIRS
    if from_table:
        _route_hist_kernel[(num_chunks,)](ids, table, buffers.hist, num_experts, EP=ep, CHUNK=chunk, num_warps=4)
    _route_kernel[(num_chunks,)](ids, table, buffers.hist, buffers.pair_pos, buffers.sorted_pair,
                                 buffers.block_slot, buffers.block_rows, buffers.used_blocks, errors,
                                 num_experts, num_chunks, EP=ep, BLOCK_M=block_m, CHUNK=chunk, SUB=32,
                                 HIST_FROM_TABLE=from_table, HIST_ROWS=16,
                                 SCAN=min(1024, max(16, triton.next_power_of_2(capacity))), BLOCK_T=32,
                                 num_warps=4 if ep <= 128 else 8)


def launch_experts(x: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, buffers,
                   top_k: int, cfg) -> None:
    """act and y of ``buffers`` for the blocks that the route launch filled (``cfg``: a StepConfig)."""
    h = x.shape[1]
    inter = w13.shape[1] // 2
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    grid_m = buffers.block_slot.numel()
    ieee = x.dtype == torch.float32
    stages = min(cfg.num_stages, 2) if ieee else cfg.num_stages  # fp32 tiles: twice the shared memory
    _step_gate_up_kernel[(grid_m, triton.cdiv(inter, cfg.gate_up_n))](
        x, buffers.sorted_pair, buffers.block_slot, buffers.block_rows, buffers.used_blocks, w13, buffers.act,
        h, inter, x.stride(0), w13.stride(0), w13.stride(1), buffers.act.stride(0), grid_m,
        TOPK=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.gate_up_n, BLOCK_K=cfg.block_k, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=stages)
    _step_down_kernel[(grid_m, triton.cdiv(h, cfg.down_n))](
        buffers.act, buffers.sorted_pair, buffers.block_slot, buffers.block_rows, buffers.used_blocks, weights, w2,
        buffers.y, h, inter, buffers.act.stride(0), w2.stride(0), w2.stride(1), buffers.y.stride(0), grid_m,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_n, BLOCK_K=cfg.block_k, IEEE=ieee,
        num_warps=cfg.num_warps, num_stages=stages)


def launch_combine(buffers, table: torch.Tensor, out: torch.Tensor, ep: int, top_k: int) -> None:
    """out[t] = sum of the rows of token t's pairs (rows t < n / k of ``out``)."""
    n_tok, h = out.shape
    block_t, block_h = 16, 128
    _combine_kernel[(max(1, triton.cdiv(n_tok, block_t)), triton.cdiv(h, block_h))](
        buffers.y, buffers.pair_pos, table, out, h, buffers.y.stride(0), out.stride(0),
        N_OFFSET=3 * ep, TOPK=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)
