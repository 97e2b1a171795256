"""``python -m afore.bench.hotpath``: every stage of the decode control path is timed, the plan is
used by every worker, and the routing shape options reach the checkpoint."""

from __future__ import annotations

import pytest

from afore.bench import hotpath


def test_hotpath_times_every_stage_with_the_plans_used():
    result = hotpath.run(targets=20, warmup=5, experts=16, top_k=4, hidden=32, intermediate=16)
    assert set(hotpath.STAGES) <= set(result)
    assert all(result[name] > 0 for name in hotpath.STAGES)
    # published before the workers read it: every worker used the scheduler's plan
    assert result["plans_used_share"] == 1.0
    assert not set(hotpath.GPU_STAGES) & set(result)  # the GPU parts only on CUDA
    assert "| ffn_candidate |" in hotpath.markdown(result)


def test_hotpath_on_cuda_needs_one_worker():
    with pytest.raises(ValueError, match="num_ffn: expected 1 with device cuda"):
        hotpath.run(targets=1, num_ffn=2, device="cuda")
