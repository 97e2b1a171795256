"""What ``afore serve`` needs to know about a checkpoint before starting anything.

Reads ``config.json`` of a Hugging Face checkpoint: the architecture (one of
the supported MoE families), E, top-k, which layers hold routed experts, and
the safetensors names of the routed-expert weights. Unknown architectures are
refused here, at start, with the list of supported ones.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

SUPPORTED = {
    # model_type: (experts field, routed-expert name pattern, (gate, up, down))
    "qwen3_moe": ("num_experts", "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("num_local_experts", "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight", ("w1", "w3", "w2")),
    "deepseek_v2": ("n_routed_experts", "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("n_routed_experts", "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("n_routed_experts", "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", ("gate_proj", "up_proj", "down_proj")),
}


@dataclasses.dataclass(frozen=True)
class MoEModelInfo:
    path: str
    model_type: str
    num_experts: int
    top_k: int
    hidden_size: int
    moe_layers: tuple[int, ...]       # model layer indices with routed experts, ascending
    hidden_act: str
    name_pattern: str
    proj_names: tuple[str, str, str]  # (gate, up, down) as named in the checkpoint
    dtype: str = "float32"            # the checkpoint's dtype (config torch_dtype / dtype)

    def expert_weight_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        return tuple(self.name_pattern.format(layer=layer, expert=expert, proj=p) for p in self.proj_names)  # type: ignore[return-value]


def read_model_info(path: str) -> MoEModelInfo:
    """Parse ``path/config.json``; ValueError naming the field on anything unsupported."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"model: expected a Hugging Face checkpoint directory with config.json, got {path!r}")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type: expected one of {sorted(SUPPORTED)} (MoE architectures afore serves), got {model_type!r}")
    experts_field, pattern, projs = SUPPORTED[model_type]
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    num_experts = int(cfg.get(experts_field) or cfg.get("num_local_experts") or 0)
    if num_experts < 1:
        raise ValueError(f"{experts_field}: expected >= 1 routed experts, got {cfg.get(experts_field)!r}")
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok: expected in [1, {num_experts}], got {cfg.get('num_experts_per_tok')!r}")
    n_layers = int(cfg["num_hidden_layers"])
    if model_type == "qwen3_moe":
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        layers = [i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0]
    elif model_type == "mixtral":
        layers = list(range(n_layers))
    else:
        first = int(cfg.get("first_k_dense_replace", 0) or 0)
        freq = int(cfg.get("moe_layer_freq", 1) or 1)
        layers = [i for i in range(n_layers) if i >= first and i % freq == 0]
    if not layers:
        raise ValueError(f"num_hidden_layers: the checkpoint at {path!r} has no MoE layer")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act: expected 'silu' (gated SiLU experts), got {act!r}")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return MoEModelInfo(path, model_type, num_experts, top_k, int(cfg["hidden_size"]), tuple(layers), act, pattern, projs, dtype)


def serving_dtype(requested: str, info: MoEModelInfo) -> str:
    """The dtype name the model is served in: vLLM's ``--dtype`` (``auto`` = the checkpoint's)."""
    aliases = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
    name = aliases.get(requested, requested)
    if name == "auto":
        name = aliases.get(info.dtype, info.dtype)
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected auto, float32, bfloat16 or float16, got {requested!r} (checkpoint: {info.dtype!r})")
    return name


def load_routed_experts(info: MoEModelInfo, layer: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]) of one model layer, gate rows before up rows."""
    from safetensors import safe_open

    index_path = os.path.join(info.path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as fh:
            weight_map: dict[str, str] = json.load(fh)["weight_map"]
    else:
        weight_map = {}
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        fname = weight_map.get(name, "model.safetensors")
        if fname not in handles:
            handles[fname] = safe_open(os.path.join(info.path, fname), framework="pt")
        try:
            return handles[fname].get_tensor(name)  # type: ignore[attr-defined]
        except Exception as exc:
            raise ValueError(f"checkpoint: tensor {name!r} missing in {info.path}") from exc

    w13, w2 = [], []
    for e in range(info.num_experts):
        g, u, d = info.expert_weight_names(layer, e)
        w13.append(torch.cat([get(g), get(u)], dim=0).to(dtype))
        w2.append(get(d).to(dtype))
    return torch.stack(w13), torch.stack(w2)
