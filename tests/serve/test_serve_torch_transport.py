"""``afore serve --transport torch``: the torch.distributed connector (gloo on CPU) with the FFN
side's own workers (``afore ffn-worker``), token-identical to plain vLLM, failing fast when an
FFN worker dies."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import needs_vllm
from servers import PROMPTS, AforeServer, assert_same_generation

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(qwen3_model, log_dir):
    s = AforeServer(qwen3_model, os.path.join(log_dir, "afore-qwen3-torch.log"), attn_workers=1, ffn_workers=2,
                    policy="afore", extra=["--transport", "torch"])
    yield s
    s.stop()


@pytest.mark.parametrize("policy", ["afore", "static"])
def test_token_identical_to_plain_vllm(server, qwen3_reference, policy):
    code, status = server.set_policy(policy)
    assert code == 200, status
    assert_same_generation(server.greedy(), qwen3_reference)


def test_ffn_worker_killed_fails_fast_and_unhealthy(server):
    os.kill(server.status()["processes"]["ffn-0"]["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    code, out = server.complete(PROMPTS[0], max_tokens=8, timeout=120)
    assert code >= 500, out
    assert time.monotonic() - t0 < 60
    deadline = time.monotonic() + 30
    while server.health() == 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.health() != 200


def test_two_attention_workers_token_identical(qwen3_model, qwen3_reference, log_dir):
    s = AforeServer(qwen3_model, os.path.join(log_dir, "afore-qwen3-torch-a2.log"), attn_workers=2, ffn_workers=2,
                    policy="afore", extra=["--transport", "torch"])
    try:
        assert_same_generation(s.greedy(), qwen3_reference)
    finally:
        s.stop()
