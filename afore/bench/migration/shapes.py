"""The expert shapes ``afore bench migration`` measures, synthetic decode loads over a worker's slots,
and the source pools that copies are pulled from."""

from __future__ import annotations

import numpy as np
import torch

NVLINK_PEAK_GBPS = 450.0  # H200 NVLink 4, one direction

#: name -> (hidden H, expert intermediate I, experts E, top_k)
MODEL_SHAPES = {
    "GLM-4.5-Air": (4096, 1408, 128, 8),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "DeepSeek-V2-Lite": (2048, 1408, 64, 6),
    "DeepSeek-V3": (7168, 2048, 256, 8),
}
COST_MODEL_SHAPE = "Qwen3-30B-A3B"  # the expert shape the committed cost model describes
CPU_SHAPES = {"tiny-a": (256, 128, 16, 4), "tiny-b": (128, 96, 8, 2)}


def decode_load(pairs: int, slots: int, rng: np.random.Generator, device, skew: float = 1.0):
    """A worker's decode-size load: ``pairs`` pairs over ``slots`` slots, Zipf-skewed."""
    p = 1.0 / np.arange(1, slots + 1) ** skew
    slot = rng.choice(slots, size=pairs, p=p / p.sum())
    n = max(1, pairs)
    tok = rng.integers(0, n, size=pairs)
    return (torch.as_tensor(tok, device=device), torch.as_tensor(slot, device=device),
            torch.as_tensor(rng.random(pairs), dtype=torch.float32, device=device), n)



def source_pools(shapes: dict, experts: int, device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    pools = {}
    for name, (h, inter, _, _) in shapes.items():
        buf = torch.randn(experts, 3 * inter * h, device=device, dtype=dtype, generator=gen)  # slot-pool layout
        pools[name] = (buf[:, : 2 * inter * h].view(experts, 2 * inter, h), buf[:, 2 * inter * h:].view(experts, h, inter))
    return pools
