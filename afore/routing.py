"""Counting token-expert pairs of a routing result, on its device, without a host sync.

Used by both halves of the data path: the attention side counts each target's demand
(``count_demand``) and the FFN side counts pairs per expert or slot (``bin_counts``).
"""

from __future__ import annotations

import numpy as np
import torch


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bin_counts(ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64[num_bins]: occurrences of each id in [0, num_bins). Unlike ``torch.bincount``
    on CUDA this never synchronises with the host (bincount reads the maximum first)."""
    ids = ids.long()
    return torch.zeros(num_bins, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def count_demand(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64[E] on the ids' device: how many token-expert pairs each expert got.

    Ids outside [0, E) (padding rows some routers mark with -1) are not counted.
    """
    if topk_ids.device.type == "cpu":  # host ids: numpy's bincount, a few us instead of five torch ops
        return torch.from_numpy(count_host(topk_ids.numpy(), num_experts))
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    return bin_counts(torch.where(valid, flat, num_experts), num_experts + 1)[:num_experts]


def count_host(topk_ids: np.ndarray, num_experts: int, dtype: type = np.int64) -> np.ndarray:
    """``dtype``[E] (int64 by default): ``count_demand`` of host ids (any integer array, any
    shape), in three numpy calls: every id outside [0, E) lands in one extra bin, cut off."""
    flat = np.asarray(topk_ids).reshape(-1)
    if flat.dtype.kind == "i":  # negative ids wrap to huge unsigned ones: the extra bin too
        flat = flat.view(_UNSIGNED[flat.dtype.itemsize])
    elif flat.dtype.kind != "u":
        raise ValueError(f"topk_ids: expected integer ids, got dtype {flat.dtype}")
    counts = np.bincount(np.minimum(flat, num_experts), minlength=num_experts + 1)[:num_experts]
    return counts if counts.dtype == dtype else counts.astype(dtype)
