"""The monolithic MoE layer, computed directly from checkpoint weights: the reference that
every distributed plan must reproduce (DESIGN.md invariant 1).

Routing follows ``ModelSpec`` (see ``afore.models.spec`` for the formula, which is what
vLLM's ``FusedMoE`` computes for these models); tests hold it equal to the transformers
MoE block of each architecture.
"""

from __future__ import annotations

import torch

from afore.models.checkpoint import ExpertWeights, RouterWeights, SharedExpertWeights
from afore.models.spec import ModelSpec


def route(spec: ModelSpec, router: RouterWeights, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and their weights for each token.

    hidden: [N, H] -> (topk_ids int32 [N, k], topk_weights fp32 [N, k]). Logits and scores in fp32.
    """
    if hidden.ndim != 2 or hidden.shape[1] != spec.hidden_size:
        raise ValueError(f"hidden: expected shape [N, {spec.hidden_size}], got {tuple(hidden.shape)}")
    logits = hidden.to(torch.float32) @ router.weight.to(torch.float32).T
    scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if router.correction_bias is None else scores + router.correction_bias.to(torch.float32)
    if spec.n_group > 1:
        grouped = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
        if router.correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(spec.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.repeat_interleave(spec.num_experts // spec.n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * spec.routed_scaling_factor


def expert_forward(experts: ExpertWeights, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the routed experts' SiLU-gated MLPs: [N, H] -> [N, H] (in hidden's dtype).

    topk_ids [N, k] (any int dtype), topk_weights [N, k]. Loops over experts, not tokens.
    """
    n, k = topk_ids.shape
    inter = experts.w2.shape[2]
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    token = torch.arange(n).repeat_interleave(k)
    flat_weights = topk_weights.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        rows = flat_ids == e
        x = hidden[token[rows]]
        h = x @ experts.w13[e].T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ experts.w2[e].T
        out.index_add_(0, token[rows], y * flat_weights[rows, None].to(y.dtype))
    return out


def shared_forward(shared: SharedExpertWeights, hidden: torch.Tensor) -> torch.Tensor:
    """The shared-expert MLP: [N, H] -> [N, H]."""
    inter = shared.w2.shape[1]
    h = hidden @ shared.w13.T
    return (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ shared.w2.T


def moe_forward(
    spec: ModelSpec,
    router: RouterWeights,
    experts: ExpertWeights,
    hidden: torch.Tensor,
    shared: SharedExpertWeights | None = None,
) -> torch.Tensor:
    """The whole MoE layer on one device: route, routed experts, plus shared experts. [N, H] -> [N, H]."""
    ids, weights = route(spec, router, hidden)
    out = expert_forward(experts, hidden, ids, weights)
    if shared is not None:
        out = out + shared_forward(shared, hidden)
    return out
