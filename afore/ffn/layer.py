"""``FFNLayer``: one MoE layer's routed experts on one FFN worker.

forward(hidden [N, H], topk_ids int32 [N, k], topk_weights fp32 [N, k], plan, worker)
  -> this worker's partial output [N, H]

Exact partition (eq. 11, ``afore.ffn.partition``) selects this worker's token-expert pairs,
the plan's slot bindings sigma map their logical experts to physical slots of the slot pool,
and the grouped GEMM (``afore.ffn.experts``) computes them with the routing weights applied.
The sum of the partial outputs over all F workers equals the monolithic MoE layer
(invariant 1).
"""

from __future__ import annotations

import numpy as np
import torch

from afore.ffn.experts import grouped_expert_mlp
from afore.ffn.partition import worker_mask
from afore.migrator.slot_pool import SlotPool
from afore.plan import Plan


class FFNLayer:
    """Routed experts of one layer on one worker, computing that worker's share of a plan."""

    def __init__(self, pool: SlotPool, backend: str = "auto", block_m: int | None = None) -> None:
        self.pool = pool
        self.backend = backend
        self.block_m = block_m or pool.shape.m_tile
        self._owner = torch.as_tensor(pool.shape.primary_owner, dtype=torch.int64, device=pool.device)

    def check_inputs(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        h, k, e = self.pool.hidden, self.pool.shape.top_k, self.pool.shape.num_experts
        if hidden.dim() != 2 or hidden.shape[1] != h:
            raise ValueError(f"hidden: expected shape [N, {h}], got {tuple(hidden.shape)}")
        n = hidden.shape[0]
        if tuple(topk_ids.shape) != (n, k):
            raise ValueError(f"topk_ids: expected shape [{n}, {k}], got {tuple(topk_ids.shape)}")
        if tuple(topk_weights.shape) != (n, k):
            raise ValueError(f"topk_weights: expected shape [{n}, {k}], got {tuple(topk_weights.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids: expected dtype int32, got {topk_ids.dtype}")
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= e):
            raise ValueError(f"topk_ids: expected values in [0, {e}), got [{int(topk_ids.min())}, {int(topk_ids.max())}]")

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                plan: Plan, worker: int | None = None) -> torch.Tensor:
        worker = self.pool.worker if worker is None else worker
        if worker != self.pool.worker:
            raise ValueError(f"worker: expected {self.pool.worker} (this layer's pool), got {worker}")
        device = self.pool.device
        # Small host arrays: non_blocking keeps the host ahead of the GPU (no stream sync).
        assignment = torch.from_numpy(plan.assignment).to(device, non_blocking=True)
        slot_of_expert = torch.from_numpy(plan.slot[:, worker].astype(np.int64)).to(device, non_blocking=True)
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1).long()
        mine = worker_mask(topk_ids, assignment, self._owner, worker)
        # Every pair stays in the list (no host sync); other workers' pairs get slot -1 and
        # are skipped by the grouped GEMM.
        pair_token = torch.arange(flat_ids.numel(), device=device) // k
        pair_slot = torch.where(mine, slot_of_expert[flat_ids], -1)
        pair_weight = topk_weights.reshape(-1).float()
        return grouped_expert_mlp(hidden, pair_token, pair_slot, pair_weight, self.pool.w13, self.pool.w2,
                                  backend=self.backend, block_m=self.block_m)

    __call__ = forward
