"""What the FFN side needs to know about a MoE model, independent of its checkpoint layout.

A ``ModelSpec`` is read once from a checkpoint's ``config.json``
(``afore.models.checkpoint.read_model_spec``) and travels to every process
that plans or computes experts (a msgspec Struct, so it crosses process
boundaries as bytes).

Routing, as the model's own MoE layer computes it (vLLM's ``FusedMoE`` with the
same settings), for router logits ``l = x @ gate.T`` (fp32):

  scores  = softmax(l) (``scoring == "softmax"``) or sigmoid(l) (``"sigmoid"``)
  choice  = scores + e_score_correction_bias        (only when ``has_correction_bias``)
  groups  : the E experts form ``n_group`` equal groups; a group's score is its best
            expert (or the sum of its best two with a correction bias); only the
            ``topk_group`` best groups stay eligible            (when ``n_group > 1``)
  top-k   : the ``top_k`` experts with the best ``choice`` among the eligible ones
  weights = scores of those experts (never the bias), renormalised to sum 1 when
            ``norm_topk_prob``, then multiplied by ``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

ARCHITECTURES: tuple[str, ...] = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe")
"""``model_type`` values afore reads (config.json)."""

Scoring = Literal["softmax", "sigmoid"]


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Shapes and routing of one MoE checkpoint.

    architecture            config.json ``model_type`` (one of ``ARCHITECTURES``)
    num_experts             E routed experts per MoE layer
    top_k                   experts per token
    hidden_size             H (model width)
    moe_intermediate_size   I of one routed expert (w13 is [2I, H], w2 is [H, I])
    num_layers              decoder layers (MTP / next-n layers not counted)
    moe_layer_indices       decoder layers whose MLP is a MoE layer (ascending)
    num_shared_experts      always-on shared experts per MoE layer (0 = none)
    shared_intermediate_size I of the fused shared-expert MLP (num_shared * I_shared), 0 if none
    scoring                 softmax or sigmoid over router logits
    n_group, topk_group     grouped top-k (1, 1 = plain top-k)
    routed_scaling_factor   multiplier on the routed experts' weights
    norm_topk_prob          renormalise the top-k weights to sum 1
    has_correction_bias     router has ``e_score_correction_bias`` (selection only)
    vocab_size              tokenizer/embedding size
    dtype                   checkpoint dtype from config.json (``float32``, ``bfloat16``, ``float16``)
    """

    architecture: str
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    moe_layer_indices: tuple[int, ...]
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    scoring: Scoring = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    has_correction_bias: bool = False
    vocab_size: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _require(self.architecture in ARCHITECTURES, "architecture", f"one of {ARCHITECTURES}", self.architecture)
        _require(self.num_experts >= 1, "num_experts", ">= 1", self.num_experts)
        _require(1 <= self.top_k <= self.num_experts, "top_k", f"in [1, {self.num_experts}] (num_experts)", self.top_k)
        _require(self.hidden_size >= 1, "hidden_size", ">= 1", self.hidden_size)
        _require(self.moe_intermediate_size >= 1, "moe_intermediate_size", ">= 1", self.moe_intermediate_size)
        _require(self.num_layers >= 1, "num_layers", ">= 1", self.num_layers)
        layers = self.moe_layer_indices
        _require(len(layers) >= 1, "moe_layer_indices", "at least one MoE layer", layers)
        _require(
            all(0 <= i < self.num_layers for i in layers) and list(layers) == sorted(set(layers)),
            "moe_layer_indices", f"ascending distinct layers in [0, {self.num_layers})", layers,
        )
        _require(self.num_shared_experts >= 0, "num_shared_experts", ">= 0", self.num_shared_experts)
        _require(
            (self.num_shared_experts == 0) == (self.shared_intermediate_size == 0),
            "shared_intermediate_size", "0 exactly when num_shared_experts is 0", self.shared_intermediate_size,
        )
        _require(self.scoring in ("softmax", "sigmoid"), "scoring", "softmax or sigmoid", self.scoring)
        _require(
            self.n_group >= 1 and self.num_experts % self.n_group == 0,
            "n_group", f">= 1 and dividing num_experts={self.num_experts}", self.n_group,
        )
        _require(1 <= self.topk_group <= self.n_group, "topk_group", f"in [1, {self.n_group}] (n_group)", self.topk_group)
        _require(self.routed_scaling_factor > 0, "routed_scaling_factor", "> 0", self.routed_scaling_factor)
        _require(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "float32, bfloat16 or float16", self.dtype)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_indices)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's weights (w13 + w2) in the checkpoint dtype."""
        itemsize = 4 if self.dtype == "float32" else 2
        return 3 * self.hidden_size * self.moe_intermediate_size * itemsize

    def check_moe_layer(self, layer: int) -> None:
        """Raise ValueError unless ``layer`` (a decoder layer index) is a MoE layer."""
        if layer not in self.moe_layer_indices:
            raise ValueError(
                f"layer: expected a MoE layer of this {self.architecture} model "
                f"(one of {list(self.moe_layer_indices)}), got {layer!r}"
            )


def _require(ok: bool, field: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"{field}: expected {expected}, got {got!r}")
