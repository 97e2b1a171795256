"""Reading Hugging Face MoE checkpoints for the FFN side: the spec, and one layer's weights at a time.

An FFN worker holds only the routed experts of its layers, so nothing here loads a whole
model: ``load_routed_experts`` opens only the safetensors shards that hold that layer's
expert tensors (via ``model.safetensors.index.json`` when the checkpoint is sharded) and
reads only those tensors.

``layer`` is always the decoder layer index as in the checkpoint's tensor names
(``model.layers.{layer}...``); the i-th MoE layer is ``spec.moe_layer_indices[i]``.

Tensor names per architecture (H hidden, I expert intermediate, E experts):

  mixtral       model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight  gate [I, H]
                model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight  up   [I, H]
                model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight  down [H, I]
                model.layers.{l}.block_sparse_moe.gate.weight            router [E, H]
  qwen3_moe,    model.layers.{l}.mlp.experts.{e}.gate_proj.weight         gate [I, H]
  deepseek_v2,  model.layers.{l}.mlp.experts.{e}.up_proj.weight           up   [I, H]
  deepseek_v3,  model.layers.{l}.mlp.experts.{e}.down_proj.weight         down [H, I]
  glm4_moe      model.layers.{l}.mlp.gate.weight                          router [E, H]
                model.layers.{l}.mlp.gate.e_score_correction_bias         [E] (V3, GLM-4.5)
                model.layers.{l}.mlp.shared_experts.{gate,up,down}_proj.weight
                                                                          [I_s, H], [I_s, H], [H, I_s]

Any architecture may instead hold the fused layout that transformers 5 keeps in memory
(``model.layers.{l}.mlp.experts.gate_up_proj`` [E, 2I, H], ``...experts.down_proj`` [E, H, I]);
the reader falls back to it when the per-expert names are absent.

dtypes: float32, bfloat16 and float16 tensors are read as stored (or cast to ``dtype``);
block-quantised float8_e4m3fn weights with a ``weight_scale_inv`` tensor (the DeepSeek-V3
release format, 128x128 blocks) are dequantised to ``dtype`` (default bfloat16).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from afore.models.spec import ARCHITECTURES, ModelSpec

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
_FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """Routed experts of one MoE layer, laid out for the grouped GEMM.

    w13: [E, 2I, H]  gate rows (0..I-1) then up rows (I..2I-1); out = w2 @ (silu(gate x) * up x)
    w2:  [E, H, I]
    """

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])


@dataclasses.dataclass(frozen=True)
class SharedExpertWeights:
    """The fused always-on shared-expert MLP of one layer: w13 [2I_s, H] (gate, up), w2 [H, I_s]."""

    w13: torch.Tensor
    w2: torch.Tensor


@dataclasses.dataclass(frozen=True)
class RouterWeights:
    """The gate of one MoE layer: weight [E, H]; correction_bias [E] fp32 or None."""

    weight: torch.Tensor
    correction_bias: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class NameMap:
    """Tensor names of one MoE layer's block; ``{l}`` is the layer, ``{e}`` the expert."""

    block: str
    gate: str
    up: str
    down: str

    def expert(self, layer: int, expert: int) -> tuple[str, str, str]:
        prefix = self.block.format(l=layer)
        return tuple(f"{prefix}.experts.{expert}.{name}.weight" for name in (self.gate, self.up, self.down))  # type: ignore[return-value]

    def router(self, layer: int) -> tuple[str, str]:
        prefix = self.block.format(l=layer)
        return f"{prefix}.gate.weight", f"{prefix}.gate.e_score_correction_bias"

    def shared(self, layer: int) -> tuple[str, str, str]:
        prefix = self.block.format(l=layer)
        return tuple(f"{prefix}.shared_experts.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj"))  # type: ignore[return-value]


_MLP_NAMES = NameMap("model.layers.{l}.mlp", "gate_proj", "up_proj", "down_proj")
NAME_MAPS: dict[str, NameMap] = {
    "mixtral": NameMap("model.layers.{l}.block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": _MLP_NAMES,
    "deepseek_v2": _MLP_NAMES,
    "deepseek_v3": _MLP_NAMES,
    "glm4_moe": _MLP_NAMES,
}
_FUSED_BLOCK = "model.layers.{l}.mlp"


def read_model_spec(path: str | Path) -> ModelSpec:
    """Read a checkpoint directory's ``config.json`` into a ``ModelSpec``.

    Raises FileNotFoundError when there is no config.json, ValueError on an unknown
    ``model_type`` or a config that lacks a field the architecture needs.
    """
    config_path = _checkpoint_dir(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"config.json: expected valid JSON in {config_path}, got {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"config.json: expected a JSON object in {config_path}, got {type(config).__name__}")
    return spec_from_config(config, source=str(config_path))


def spec_from_config(config: dict[str, Any], source: str = "config") -> ModelSpec:
    """Build a ``ModelSpec`` from a parsed config.json (see ``read_model_spec``)."""
    arch = config.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"model_type: expected one of {list(ARCHITECTURES)} in {source}, got {arch!r} "
            f"(architectures={config.get('architectures')!r})"
        )
    get = _ConfigReader(config, source)
    num_layers = get.int("num_hidden_layers")
    common = dict(
        architecture=arch,
        num_layers=num_layers,
        hidden_size=get.int("hidden_size"),
        top_k=get.int("num_experts_per_tok"),
        vocab_size=get.int("vocab_size"),
        dtype=_config_dtype(config),
    )
    if arch == "mixtral":
        return ModelSpec(
            **common,
            num_experts=get.int("num_local_experts"),
            moe_intermediate_size=get.int("intermediate_size"),
            moe_layer_indices=tuple(range(num_layers)),
            scoring="softmax",
            norm_topk_prob=True,
        )
    if arch == "qwen3_moe":
        # transformers 5 writes the field under its attribute-map name num_local_experts.
        num_experts = get.int("num_experts" if "num_experts" in config else "num_local_experts")
        step = get.int("decoder_sparse_step", 1)
        dense = set(get.list("mlp_only_layers", []))
        return ModelSpec(
            **common,
            num_experts=num_experts,
            moe_intermediate_size=get.int("moe_intermediate_size"),
            moe_layer_indices=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
            scoring="softmax",
            norm_topk_prob=get.bool("norm_topk_prob", False),
        )
    # DeepSeek-V2/V3 and GLM-4.5 (the DeepSeek-V3 family).
    moe_size = get.int("moe_intermediate_size")
    first_dense = get.int("first_k_dense_replace", 0)
    freq = get.int("moe_layer_freq", 1) if arch != "glm4_moe" else 1
    shared = get.int("n_shared_experts", 0)
    if arch == "glm4_moe":
        topk_method, scoring = "noaux_tc", "sigmoid"
    else:
        topk_method = get.str("topk_method", "noaux_tc" if arch == "deepseek_v3" else "greedy")
        scoring = get.str("scoring_func", "sigmoid" if arch == "deepseek_v3" else "softmax")
    grouped = topk_method != "greedy"
    return ModelSpec(
        **common,
        num_experts=get.int("n_routed_experts"),
        moe_intermediate_size=moe_size,
        moe_layer_indices=tuple(i for i in range(first_dense, num_layers) if i % freq == 0),
        num_shared_experts=shared,
        shared_intermediate_size=moe_size * shared,
        scoring=scoring,  # type: ignore[arg-type]
        n_group=get.int("n_group", 1) if grouped else 1,
        topk_group=get.int("topk_group", 1) if grouped else 1,
        routed_scaling_factor=get.float("routed_scaling_factor", 1.0),
        norm_topk_prob=get.bool("norm_topk_prob", arch == "glm4_moe"),
        has_correction_bias=topk_method == "noaux_tc",
    )


class CheckpointReader:
    """One checkpoint directory: its spec and a map from tensor name to safetensors file.

    Cheap to construct (reads config.json and the shard index, or the shards' headers when
    there is no index); every ``load_*`` opens only the files that hold the tensors it needs.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = _checkpoint_dir(path)
        self.spec = read_model_spec(self.path)
        self.names = NAME_MAPS[self.spec.architecture]
        self.weight_map = _weight_map(self.path)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def load_routed_experts(self, layer: int, dtype: torch.dtype | str | None = None) -> ExpertWeights:
        """Routed experts of decoder layer ``layer`` as ``ExpertWeights`` (w13 [E, 2I, H], w2 [E, H, I])."""
        spec = self.spec
        spec.check_moe_layer(layer)
        target = _as_dtype(dtype)
        e_count, i_size, h_size = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
        if not self.has(self.names.expert(layer, 0)[0]) and self.has(f"{_FUSED_BLOCK.format(l=layer)}.experts.gate_up_proj"):
            prefix = f"{_FUSED_BLOCK.format(l=layer)}.experts"
            tensors = self._read([f"{prefix}.gate_up_proj", f"{prefix}.down_proj"], layer, target)
            w13, w2 = tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"]
            _check_shape(w13, (e_count, 2 * i_size, h_size), f"{prefix}.gate_up_proj")
            _check_shape(w2, (e_count, h_size, i_size), f"{prefix}.down_proj")
            return ExpertWeights(w13.contiguous(), w2.contiguous())
        names = [self.names.expert(layer, e) for e in range(e_count)]
        slot = {}
        for e, (gate, up, down) in enumerate(names):
            slot[gate], slot[up], slot[down] = ("w13", e, 0), ("w13", e, i_size), ("w2", e, 0)
        # Copy each tensor into place as it is read: peak memory is the layer plus one tensor.
        w13 = w2 = None
        for name, tensor in self._iter([n for triple in names for n in triple], layer, target):
            if w13 is None:
                w13 = torch.empty((e_count, 2 * i_size, h_size), dtype=tensor.dtype)
                w2 = torch.empty((e_count, h_size, i_size), dtype=tensor.dtype)
            which, e, row = slot[name]
            if which == "w13":
                w13[e, row:row + i_size] = _check_shape(tensor, (i_size, h_size), name)
            else:
                w2[e] = _check_shape(tensor, (h_size, i_size), name)
        return ExpertWeights(w13, w2)

    def load_shared_experts(self, layer: int, dtype: torch.dtype | str | None = None) -> SharedExpertWeights | None:
        """The shared-expert MLP of ``layer`` (w13 [2I_s, H], w2 [H, I_s]), None when the model has none."""
        spec = self.spec
        spec.check_moe_layer(layer)
        if spec.num_shared_experts == 0:
            return None
        gate, up, down = self.names.shared(layer)
        tensors = self._read([gate, up, down], layer, _as_dtype(dtype))
        i_size, h_size = spec.shared_intermediate_size, spec.hidden_size
        w13 = torch.cat([
            _check_shape(tensors[gate], (i_size, h_size), gate),
            _check_shape(tensors[up], (i_size, h_size), up),
        ])
        return SharedExpertWeights(w13, _check_shape(tensors[down], (h_size, i_size), down).contiguous())

    def load_router(self, layer: int, dtype: torch.dtype | str | None = None) -> RouterWeights:
        """Gate weight [E, H] of ``layer`` and its correction bias [E] (fp32, as vLLM keeps it) or None."""
        spec = self.spec
        spec.check_moe_layer(layer)
        weight_name, bias_name = self.names.router(layer)
        names = [weight_name] + ([bias_name] if spec.has_correction_bias else [])
        tensors = self._read(names, layer, _as_dtype(dtype))
        weight = _check_shape(tensors[weight_name], (spec.num_experts, spec.hidden_size), weight_name)
        bias = None
        if spec.has_correction_bias:
            bias = _check_shape(tensors[bias_name], (spec.num_experts,), bias_name).to(torch.float32)
        return RouterWeights(weight, bias)

    def _read(self, names: list[str], layer: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return dict(self._iter(names, layer, dtype))

    def _iter(self, names: list[str], layer: int, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for ``names``, each shard opened once, fp8 blocks dequantised.

        Every name is checked before anything is read, so a missing tensor costs no I/O.
        """
        missing = [n for n in names if n not in self.weight_map]
        if missing:
            raise ValueError(
                f"checkpoint {self.path}: tensor {missing[0]!r} not found "
                f"({len(missing)} of {len(names)} tensors of layer {layer} missing; "
                f"architecture {self.spec.architecture}, expected names like {names[0]!r})"
            )
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.weight_map[name], []).append(name)
        for file, file_names in by_file.items():
            with safe_open(self.path / file, framework="pt") as f:
                for name in file_names:
                    tensor = f.get_tensor(name)
                    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                        tensor = self._dequantize(name, tensor, f)
                    elif tensor.dtype not in _DTYPES.values():
                        raise ValueError(
                            f"{name}: expected a float32, bfloat16, float16 or block-fp8 tensor, got {tensor.dtype}"
                        )
                    yield name, (tensor if dtype is None else tensor.to(dtype))

    def _dequantize(self, name: str, tensor: torch.Tensor, handle: Any) -> torch.Tensor:
        scale_name = f"{name}_scale_inv"
        if scale_name not in self.weight_map:
            raise ValueError(f"{name}: expected a {scale_name!r} tensor for its {tensor.dtype} weights, found none")
        if self.weight_map[scale_name] == self.weight_map[name]:
            scale = handle.get_tensor(scale_name)
        else:
            with safe_open(self.path / self.weight_map[scale_name], framework="pt") as g:
                scale = g.get_tensor(scale_name)
        rows, cols = tensor.shape
        expected = (math.ceil(rows / _FP8_BLOCK), math.ceil(cols / _FP8_BLOCK))
        _check_shape(scale, expected, scale_name)
        full = scale.to(torch.float32).repeat_interleave(_FP8_BLOCK, 0)[:rows].repeat_interleave(_FP8_BLOCK, 1)[:, :cols]
        return (tensor.to(torch.float32) * full).to(torch.bfloat16)


def load_routed_experts(path: str | Path, layer: int, dtype: torch.dtype | str | None = None) -> ExpertWeights:
    """Routed experts of decoder layer ``layer``: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].

    ``dtype`` None keeps the stored dtype (fp8 is dequantised to bfloat16).
    """
    return CheckpointReader(path).load_routed_experts(layer, dtype)


def load_shared_experts(path: str | Path, layer: int, dtype: torch.dtype | str | None = None) -> SharedExpertWeights | None:
    """Shared-expert MLP of ``layer`` (w13 [2I_s, H], w2 [H, I_s]) or None when the model has none."""
    return CheckpointReader(path).load_shared_experts(layer, dtype)


def load_router(path: str | Path, layer: int, dtype: torch.dtype | str | None = None) -> RouterWeights:
    """Gate weight [E, H] and correction bias [E] (fp32) or None of ``layer``."""
    return CheckpointReader(path).load_router(layer, dtype)


class _ConfigReader:
    """Typed access to config.json fields with errors that name the field and the file."""

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config, self.source = config, source

    _MISSING = object()

    def _get(self, key: str, default: Any, kind: str) -> Any:
        value = self.config.get(key, default)
        if value is self._MISSING:
            raise ValueError(f"{key}: expected {kind} in {self.source} for {self.config.get('model_type')}, field missing")
        return value

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self._get(key, default, "an integer")
        if value is None and default is not self._MISSING:
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer in {self.source}, got {value!r}")
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default, "a number")
        if value is None and default is not self._MISSING:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected a number in {self.source}, got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default, "true or false")
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false in {self.source}, got {value!r}")
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        value = self._get(key, default, "a string")
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string in {self.source}, got {value!r}")
        return value

    def list(self, key: str, default: Any = _MISSING) -> list:
        value = self._get(key, default, "a list")
        if value is None:
            value = []
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected a list in {self.source}, got {value!r}")
        return value


def _checkpoint_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint path: expected a directory with config.json and *.safetensors, got {str(p)!r} (not a directory)")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint path: expected a config.json in {str(p)!r}, found none")
    return p


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file (relative to ``path``)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"model.safetensors.index.json: expected a JSON object with 'weight_map' in {path}, got {exc!r}") from None
        for file in set(weight_map.values()):
            if not (path / file).is_file():
                raise FileNotFoundError(f"checkpoint {path}: shard {file!r} named by model.safetensors.index.json is missing")
        return dict(weight_map)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint path: expected *.safetensors files in {str(path)!r}, found none")
    weight_map = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weight_map[name] = file.name
    return weight_map


def _config_dtype(config: dict[str, Any]) -> str:
    value = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if value not in _DTYPES:
        raise ValueError(f"dtype: expected one of {list(_DTYPES)} in config.json, got {value!r}")
    return value


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype: expected None, torch.float32/bfloat16/float16 or one of {list(_DTYPES)}, got {dtype!r}")


def _check_shape(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} from config.json, got {tuple(tensor.shape)}")
    return tensor
