"""Token identity with plain vLLM for the other MoE families (one ``afore serve`` each, A=1 F=2).

DeepSeek-V2 (softmax, grouped top-k, shared experts), DeepSeek-V3 (sigmoid, noaux_tc grouped
top-k with the router's correction bias, routed scaling, shared experts), GLM-4.5 (the V3
family) and Mixtral (softmax top-2, no shared experts).
"""

from __future__ import annotations

import os

import pytest

from servers import AforeServer, assert_same_generation, needs_vllm, reference, tiny

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3", "glm4_moe", "mixtral"])
def test_token_identical_to_plain_vllm(arch, log_dir):
    model = tiny(arch)
    want = reference(model, os.path.join(log_dir, f"plain-{arch}.log"))
    server = AforeServer(model, os.path.join(log_dir, f"afore-{arch}.log"), attn_workers=1, ffn_workers=2, policy="afore")
    try:
        assert_same_generation(server.greedy(), want)
        assert server.status()["processes"]["scheduler"]["alive"]
    finally:
        server.stop()
