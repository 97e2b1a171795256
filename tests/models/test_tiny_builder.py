import hashlib
import json

import pytest

from afore.models import tiny
from afore.models.checkpoint import read_model_spec
from afore.models.spec import ARCHITECTURES


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir, tmp_path):
    again = tiny.build_tiny_checkpoint("deepseek_v3", tmp_path / "again", seed=0)
    assert _digest(again) == _digest(tiny_dir["deepseek_v3"])
    other = tiny.build_tiny_checkpoint("deepseek_v3", tmp_path / "other", seed=1)
    a, b = _digest(other), _digest(again)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]  # the tokenizer does not depend on the seed


def test_cached_build_is_reused_and_foreign_directories_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("AFORE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny.build_tiny_checkpoint("mixtral", seed=0)
    assert path == tiny.default_model_path("mixtral", seed=0)
    assert path.parent == tmp_path / "cache" / "models" and path.name.startswith("mixtral-")
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("a cached build must not be rebuilt")

    monkeypatch.setattr(tiny, "_write_checkpoint", fail)
    assert tiny.build_tiny_checkpoint("mixtral", seed=0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert tiny.default_model_path("mixtral", seed=1) != path
    assert tiny.default_model_path("mixtral", seed=0, num_hidden_layers=2) != path
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="path"):
        tiny.build_tiny_checkpoint("mixtral", foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_rebuilding_a_directory_with_another_tiny_build_replaces_it(tmp_path):
    path = tmp_path / "m"
    tiny.build_tiny_checkpoint("qwen3_moe", path, seed=0)
    tiny.build_tiny_checkpoint("qwen3_moe", path, seed=0, num_hidden_layers=2)
    assert read_model_spec(path).num_layers == 2
    assert tiny.is_built(path, "qwen3_moe", 0, num_hidden_layers=2)
    assert not tiny.is_built(path, "qwen3_moe", 0)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.") and p.is_dir()] == []


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda p: tiny.build_tiny_checkpoint("llama", p), "arch"),
        (lambda p: tiny.build_tiny_checkpoint("qwen3_moe", p, seed=-1), "seed"),
        (lambda p: tiny.build_tiny_checkpoint("qwen3_moe", p, n_routed_experts=4), "overrides"),
    ],
)
def test_bad_arguments(call, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        call(tmp_path / "x")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokenizer_and_config_load_in_transformers(arch, tiny_dir):
    from transformers import AutoConfig, AutoTokenizer

    path = tiny_dir[arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    text = "Natalia sold 48 clips in April. How many clips?"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2  # trained merges, not bytes
    assert len(tokenizer) == config.vocab_size == read_model_spec(path).vocab_size
    assert tokenizer.eos_token_id == config.eos_token_id
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    marker = json.loads((path / tiny.MARKER).read_text())
    assert marker["arch"] == arch and marker["key"] == tiny.build_key(arch, 0)
    spec = read_model_spec(path)
    assert spec.num_experts >= 8 and 2 <= spec.top_k <= 4 and spec.hidden_size == 64
