"""--exact on the GPU: ``warm_pair_rows`` compiles, at start-up, every variant of vLLM's Triton
MoE kernel that ``pair_rows`` launches for 1..max_tokens tokens per call, so serving compiles
none (run by bench/device/gpu_tests.sh; needs vLLM's CUDA kernels)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _compiled(kernel) -> int:
    """Compiled variants of a Triton JIT function, over all devices."""
    caches = getattr(kernel, "device_caches", None)
    assert caches is not None, "this Triton keeps no device_caches: count its compiles another way"
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_compile_after_warm_up(dtype):
    from afore.ffn import exact

    if not exact.uses_vllm_kernels(torch.device("cuda")):
        pytest.fail("vLLM's fused-MoE kernels are not importable on this GPU host")
    fm = exact._vllm_moe()[1]
    # Qwen3-30B-A3B's expert shapes (E=128, I=768, H=2048, top-8), 20 slots on this worker
    experts, inter, hidden, k, slots, max_tokens = 128, 768, 2048, 8, 20, 256
    gen = torch.Generator(device="cuda").manual_seed(1)
    w13 = torch.randn(slots, 2 * inter, hidden, device="cuda", dtype=dtype, generator=gen) * 0.02
    w2 = torch.randn(slots, hidden, inter, device="cuda", dtype=dtype, generator=gen) * 0.02
    calls = exact.warm_pair_rows(w13, w2, experts, k, max_tokens, dtype)
    assert calls > 0
    warmed = _compiled(fm.fused_moe_kernel)
    assert warmed > 0
    for m in [*range(1, 70), 97, 128, 200, 255, 256]:
        x = torch.randn(m, hidden, device="cuda", dtype=dtype, generator=gen)
        pair_slot = torch.randint(-1, slots, (m, k), dtype=torch.int32, device="cuda", generator=gen)
        rows = exact.pair_rows(x, pair_slot, torch.rand(m, k, device="cuda", generator=gen), w13, w2, experts)
        assert rows.shape == (m, k, hidden)
        assert bool((rows[pair_slot < 0] == 0).all())  # pairs computed elsewhere stay zero
    torch.cuda.synchronize()
    assert _compiled(fm.fused_moe_kernel) == warmed, "serving-sized calls compiled new kernel variants"
