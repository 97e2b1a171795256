"""Expert compute: the SiLU-gated MLP of every routed pair, grouped over a worker's slots.

For pair p (token t_p, physical slot s_p, routing weight g_p):

    y_p = g_p * (silu(x[t_p] W_gate[s_p]^T) * (x[t_p] W_up[s_p]^T)) W_down[s_p]^T
    out[t] = sum of y_p over the pairs of token t

with ``w13[s] = [W_gate; W_up]`` of shape [2I, H] and ``w2[s] = W_down`` of shape [H, I]
(the slot pool's layout, ``afore.migrator.slot_pool``).

Backends:
  ``triton``  grouped GEMM on the GPU: pairs are sorted by slot and padded per slot to the
              M tile (``block_m`` pairs), one program per (tile, N block); gate/up and SiLU are
              fused in the first kernel, the routing weight in the second. No host sync.
  ``torch``   one matmul pair per non-empty slot (CPU, and the reference on the GPU).
  ``auto``    triton on CUDA tensors when Triton imports, else torch.
Accumulation is fp32 in both; the output has the input's dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from afore.routing import bin_counts

BACKENDS = ("auto", "triton", "torch")


def grouped_expert_mlp(x: torch.Tensor, pair_token: torch.Tensor, pair_slot: torch.Tensor,
                       pair_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       backend: str = "auto", block_m: int = 16) -> torch.Tensor:
    """Weighted sum of expert MLP outputs per token.

    x: [N, H]; pair_token, pair_slot: int64[P]; pair_weight: fp32[P];
    w13: [K, 2I, H]; w2: [K, H, I] (same dtype as x). Returns [N, H] in x.dtype.
    Pairs whose slot is outside [0, K) are skipped (another worker's pairs, kept in the
    list so that the partition needs no host sync).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    n, h = x.shape
    k_slots, two_i, h13 = w13.shape
    if h13 != h or w2.shape != (k_slots, h, two_i // 2):
        raise ValueError(f"w13/w2: expected [K, 2I, {h}] and [K, {h}, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and triton_available() else "torch"
    if backend == "triton":
        return _triton_grouped(x, pair_token, pair_slot, pair_weight, w13, w2, block_m)
    return _torch_grouped(x, pair_token, pair_slot, pair_weight, w13, w2)


def expert_mlp_loop(x: torch.Tensor, pair_token: torch.Tensor, pair_slot: torch.Tensor,
                    pair_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The torch backend under its benchmark name: one matmul pair per non-empty slot."""
    return _torch_grouped(x, pair_token, pair_slot, pair_weight, w13, w2)


def _torch_grouped(x, pair_token, pair_slot, pair_weight, w13, w2):
    n, h = x.shape
    inter = w2.shape[2]
    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    keep = (pair_slot >= 0) & (pair_slot < w13.shape[0])
    if not bool(keep.all()):
        pair_token, pair_slot, pair_weight = pair_token[keep], pair_slot[keep], pair_weight[keep]
    if pair_token.numel() == 0:
        return out.to(x.dtype)
    order = torch.sort(pair_slot, stable=True).indices
    slots_sorted = pair_slot[order]
    counts = torch.bincount(slots_sorted, minlength=w13.shape[0]).tolist()  # one host sync per call
    start = 0
    for slot, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start:start + count]
        start += count
        xs = x[pair_token[rows]]
        gate_up = xs @ w13[slot].t()
        act = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
        y = act.to(x.dtype) @ w2[slot].t()
        out.index_add_(0, pair_token[rows], y.float() * pair_weight[rows, None])
    return out.to(x.dtype)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def align_pairs_to_tiles(pair_slot: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort pairs by slot and pad every slot's run to a multiple of ``block_m``.

    Pairs with a slot outside [0, num_slots) are dropped. Sizes are the static upper bound
    P + K*(block_m - 1) so that no host sync is needed.
    Returns (sorted_pair int64[num_blocks*block_m], pad value P; block_slot int32[num_blocks], -1 = unused block).
    """
    p = pair_slot.numel()
    device = pair_slot.device
    slot = pair_slot.long()
    slot = torch.where((slot >= 0) & (slot < num_slots), slot, num_slots)  # bin K = dropped
    counts = bin_counts(slot, num_slots + 1)[:num_slots]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    run_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(slot, stable=True).indices
    slot_sorted = slot[order]
    kept = slot_sorted < num_slots
    slot_kept = slot_sorted.clamp(max=num_slots - 1)
    pos = padded_start[slot_kept] + torch.arange(p, device=device) - run_start[slot_kept]
    num_blocks = (p + num_slots * (block_m - 1) + block_m - 1) // block_m
    sorted_pair = torch.full((num_blocks * block_m + 1,), p, dtype=torch.int64, device=device)
    # dropped pairs are written to the spare last element, which no block reads
    sorted_pair[torch.where(kept, pos, num_blocks * block_m)] = order
    sorted_pair = sorted_pair[:-1]
    block_first_row = torch.arange(num_blocks, device=device) * block_m
    block_slot = torch.searchsorted(padded_end, block_first_row, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, torch.full_like(block_slot, -1)).to(torch.int32)
    return sorted_pair, block_slot


def _triton_grouped(x, pair_token, pair_slot, pair_weight, w13, w2, block_m):
    from afore.ffn import _triton_kernels as kernels

    n, h = x.shape
    k_slots, two_i, _ = w13.shape
    inter = two_i // 2
    p = pair_token.numel()
    out = torch.zeros(n, h, dtype=torch.float32, device=x.device)
    if p == 0:
        return out.to(x.dtype)
    sorted_pair, block_slot = align_pairs_to_tiles(pair_slot, k_slots, block_m)
    num_blocks = block_slot.numel()
    act = torch.empty(num_blocks * block_m, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(p, h, dtype=torch.float32, device=x.device)  # skipped pairs add zero
    kernels.gate_up_silu(x, pair_token, sorted_pair, block_slot, w13, act, p, block_m)
    kernels.down_weighted(act, sorted_pair, block_slot, pair_weight, w2, y, p, block_m)
    out.index_add_(0, pair_token, y)
    return out.to(x.dtype)
