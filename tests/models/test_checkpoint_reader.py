import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import afore.models.checkpoint as checkpoint
from afore.models.checkpoint import CheckpointReader, load_router, load_routed_experts, load_shared_experts, read_model_spec
from afore.models.spec import ARCHITECTURES, ModelSpec


def _moe_block(model, layer):
    return model.model.layers[layer].mlp


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reader_returns_the_tensors_transformers_holds(arch, tiny_dir, hf_models):
    path, model = tiny_dir[arch], hf_models[arch]
    spec = read_model_spec(path)
    assert spec.moe_layer_indices  # every tiny model has MoE layers
    for layer in spec.moe_layer_indices:
        block = _moe_block(model, layer)
        experts = load_routed_experts(path, layer)
        assert experts.w13.dtype == torch.float32
        assert torch.equal(experts.w13, block.experts.gate_up_proj.detach())
        assert torch.equal(experts.w2, block.experts.down_proj.detach())
        router = load_router(path, layer)
        assert torch.equal(router.weight, block.gate.weight.detach())
        if spec.has_correction_bias:
            assert torch.equal(router.correction_bias, block.gate.e_score_correction_bias)
            assert router.correction_bias.abs().sum() > 0  # the builder randomises it
        else:
            assert router.correction_bias is None
        shared = load_shared_experts(path, layer)
        if spec.num_shared_experts:
            mlp = block.shared_experts
            assert torch.equal(shared.w13, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach())
            assert torch.equal(shared.w2, mlp.down_proj.weight.detach())
        else:
            assert shared is None


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gate_rows_then_up_rows_match_the_per_expert_tensors_on_disk(arch, tiny_dir):
    path = tiny_dir[arch]
    spec = read_model_spec(path)
    layer = spec.moe_layer_indices[-1]
    names = checkpoint.NAME_MAPS[arch]
    experts = load_routed_experts(path, layer)
    i = spec.moe_intermediate_size
    with safe_open(path / "model.safetensors", "pt") as f:
        for e in range(spec.num_experts):
            gate, up, down = names.expert(layer, e)
            assert torch.equal(experts.w13[e, :i], f.get_tensor(gate))
            assert torch.equal(experts.w13[e, i:], f.get_tensor(up))
            assert torch.equal(experts.w2[e], f.get_tensor(down))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_spec_matches_config_json(arch, tiny_dir, hf_models):
    path = tiny_dir[arch]
    config = json.loads((path / "config.json").read_text())
    spec = read_model_spec(path)
    assert spec.architecture == arch == config["model_type"]
    assert spec.hidden_size == config["hidden_size"]
    assert spec.num_layers == config["num_hidden_layers"]
    assert spec.top_k == config["num_experts_per_tok"]
    assert spec.vocab_size == config["vocab_size"]
    assert spec.dtype == "float32"
    # MoE layers are exactly the decoder layers whose MLP holds experts in transformers.
    model = hf_models[arch]
    moe_layers = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert spec.moe_layer_indices == moe_layers
    block = _moe_block(model, moe_layers[0])
    assert spec.num_experts == block.experts.gate_up_proj.shape[0]
    assert spec.moe_intermediate_size == block.experts.down_proj.shape[2]
    if arch == "mixtral":
        assert spec.num_experts == config["num_local_experts"]
        assert spec.moe_intermediate_size == config["intermediate_size"]
        assert (spec.scoring, spec.norm_topk_prob, spec.num_shared_experts) == ("softmax", True, 0)
    elif arch == "qwen3_moe":
        assert spec.norm_topk_prob == config["norm_topk_prob"]
        assert (spec.scoring, spec.num_shared_experts, spec.has_correction_bias) == ("softmax", 0, False)
    else:
        assert spec.num_experts == config["n_routed_experts"]
        assert spec.moe_intermediate_size == config["moe_intermediate_size"]
        assert spec.num_shared_experts == config["n_shared_experts"]
        assert spec.shared_intermediate_size == config["n_shared_experts"] * config["moe_intermediate_size"]
        assert spec.routed_scaling_factor == config["routed_scaling_factor"]
        assert spec.norm_topk_prob == config["norm_topk_prob"]
        assert spec.moe_layer_indices[0] == config["first_k_dense_replace"]
        expected = {
            "deepseek_v2": ("softmax", False, 1, 1),
            "deepseek_v3": ("sigmoid", True, config["n_group"], config["topk_group"]),
            "glm4_moe": ("sigmoid", True, config["n_group"], config["topk_group"]),
        }[arch]
        assert (spec.scoring, spec.has_correction_bias, spec.n_group, spec.topk_group) == expected


def _config(**fields):
    base = dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=64, num_experts_per_tok=2,
                vocab_size=100, num_experts=8, moe_intermediate_size=32)
    base.update(fields)
    return base


def test_spec_follows_layer_layout_fields():
    spec = checkpoint.spec_from_config(_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert spec.moe_layer_indices == (1,)
    spec = checkpoint.spec_from_config(dict(
        model_type="deepseek_v2", num_hidden_layers=6, hidden_size=64, num_experts_per_tok=6, vocab_size=100,
        n_routed_experts=64, moe_intermediate_size=16, first_k_dense_replace=1, moe_layer_freq=2,
        n_shared_experts=2, topk_method="group_limited_greedy", n_group=8, topk_group=3, torch_dtype="bfloat16",
    ))
    assert spec.moe_layer_indices == (2, 4)
    assert (spec.n_group, spec.topk_group, spec.shared_intermediate_size, spec.dtype) == (8, 3, 32, "bfloat16")
    # A released DeepSeek-V3 config without scoring_func/topk_method still means sigmoid + bias.
    v3 = checkpoint.spec_from_config(dict(
        model_type="deepseek_v3", num_hidden_layers=4, hidden_size=64, num_experts_per_tok=8, vocab_size=100,
        n_routed_experts=256, moe_intermediate_size=16, first_k_dense_replace=3, n_group=8, topk_group=4,
    ))
    assert (v3.scoring, v3.has_correction_bias, v3.moe_layer_indices) == ("sigmoid", True, (3,))


def test_spec_round_trips_through_msgspec():
    import msgspec

    spec = checkpoint.spec_from_config(_config())
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=ModelSpec) == spec


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(model_type="llama"), "model_type"),
        (dict(model_type=None), "model_type"),
        (dict(num_experts=None), "num_experts"),
        (dict(num_experts_per_tok=9), "top_k"),
        (dict(hidden_size="64"), "hidden_size"),
        (dict(norm_topk_prob="yes"), "norm_topk_prob"),
        (dict(mlp_only_layers=[0, 1, 2, 3]), "moe_layer_indices"),
        (dict(dtype="int8"), "dtype"),
    ],
)
def test_bad_configs_are_rejected_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        checkpoint.spec_from_config(_config(**fields))


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        read_model_spec(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_model_spec(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        read_model_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="model_type.*gpt2"):
        read_model_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_routed_experts(tmp_path, 0)


def test_missing_tensor_names_the_tensor(tiny_dir, tmp_path):
    src = tiny_dir["mixtral"]
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    with safe_open(dst / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.block_sparse_moe.experts.5.w3.weight"}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight"):
        load_routed_experts(dst, 1)
    assert load_routed_experts(dst, 0).w13.shape[0] == 8  # other layers still load


def test_wrong_shape_and_non_moe_layer_and_bad_dtype(tiny_dir, tmp_path):
    path = tiny_dir["deepseek_v3"]
    with pytest.raises(ValueError, match="layer: expected a MoE layer"):
        load_routed_experts(path, 0)  # first_k_dense_replace=1: layer 0 is dense
    with pytest.raises(ValueError, match="layer"):
        load_router(path, 99)
    with pytest.raises(ValueError, match="dtype"):
        load_routed_experts(path, 1, dtype=torch.int8)
    dst = tmp_path / "bad_shape"
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    config["moe_intermediate_size"] = 48
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"expected shape \(48, 64\)"):
        load_routed_experts(dst, 1)


def test_sharded_checkpoint_reads_only_the_layers_shards(tiny_dir, hf_models, tmp_path, monkeypatch):
    arch = "qwen3_moe"
    dst = tmp_path / "sharded"
    hf_models[arch].save_pretrained(dst, max_shard_size="40KB")
    shutil.copy(tiny_dir[arch] / "config.json", dst / "config.json")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 4
    expected = load_routed_experts(tiny_dir[arch], 2)
    opened = []
    real_open = checkpoint.safe_open

    def recording_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "safe_open", recording_open)
    reader = CheckpointReader(dst)
    assert opened == []  # the index is enough to map names to shards
    experts = reader.load_routed_experts(2)
    assert torch.equal(experts.w13, expected.w13) and torch.equal(experts.w2, expected.w2)
    layer_shards = {index["weight_map"][n] for e in range(8) for n in checkpoint.NAME_MAPS[arch].expert(2, e)}
    assert {p.rsplit("/", 1)[-1] for p in opened} == layer_shards
    assert len(layer_shards) < len(shards)


def test_unindexed_multi_file_checkpoint(tiny_dir, tmp_path):
    src = tiny_dir["glm4_moe"]
    dst = tmp_path / "split"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(src / "model.safetensors", "pt") as f:
        keys = sorted(f.keys())
        halves = [keys[::2], keys[1::2]]
        for i, half in enumerate(halves):
            save_file({k: f.get_tensor(k) for k in half}, dst / f"part-{i}.safetensors")
    for layer in (1, 2):
        a, b = load_routed_experts(src, layer), load_routed_experts(dst, layer)
        assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
        assert torch.equal(load_router(src, layer).correction_bias, load_router(dst, layer).correction_bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_keep_their_dtype(dtype, tiny_dir, tmp_path):
    src = tiny_dir["qwen3_moe"]
    dst = tmp_path / str(dtype)
    shutil.copytree(src, dst)
    with safe_open(src / "model.safetensors", "pt") as f:
        save_file({k: f.get_tensor(k).to(dtype) for k in f.keys()}, dst / "model.safetensors")
    experts = load_routed_experts(dst, 1)
    assert experts.w13.dtype == dtype
    assert torch.equal(experts.w13, load_routed_experts(src, 1).w13.to(dtype))
    assert load_routed_experts(dst, 1, dtype="float32").w2.dtype == torch.float32
    assert load_routed_experts(src, 1, dtype=torch.bfloat16).w2.dtype == torch.bfloat16


def test_fused_transformers5_layout_is_read(tiny_dir, tmp_path):
    src = tiny_dir["mixtral"]
    dst = tmp_path / "fused"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    expected = {layer: load_routed_experts(src, layer) for layer in range(3)}
    tensors = {}
    for layer, w in expected.items():
        tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = w.w13
        tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = w.w2
    save_file(tensors, dst / "model.safetensors")
    for layer, w in expected.items():
        got = load_routed_experts(dst, layer)
        assert torch.equal(got.w13, w.w13) and torch.equal(got.w2, w.w2)


def test_block_fp8_weights_are_dequantised(tiny_dir, tmp_path):
    src = tiny_dir["deepseek_v3"]
    dst = tmp_path / "fp8"
    shutil.copytree(src, dst)
    spec = read_model_spec(src)
    names = checkpoint.NAME_MAPS["deepseek_v3"]
    generator = torch.Generator().manual_seed(3)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    expected = []
    for e in range(spec.num_experts):
        for name in names.expert(1, e):
            fp8 = tensors[name].to(torch.float8_e4m3fn)
            scale = torch.rand((1, 1), generator=generator) + 0.5  # one 128x128 block covers [32, 64]
            tensors[name] = fp8
            tensors[f"{name}_scale_inv"] = scale
            expected.append((fp8.to(torch.float32) * scale).to(torch.bfloat16))
    save_file(tensors, dst / "model.safetensors")
    experts = load_routed_experts(dst, 1)
    assert experts.w13.dtype == torch.bfloat16
    i = spec.moe_intermediate_size
    assert torch.equal(experts.w13[3, :i], expected[3 * 3])
    assert torch.equal(experts.w13[3, i:], expected[3 * 3 + 1])
    assert torch.equal(experts.w2[3], expected[3 * 3 + 2])
    del tensors[f"{names.expert(1, 0)[0]}_scale_inv"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match="scale_inv"):
        load_routed_experts(dst, 1)
