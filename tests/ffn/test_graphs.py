"""Token buckets of the FFN step's CUDA graphs (the capture itself is tested on the GPU host,
tests/ffn/test_step_gpu.py)."""

import pytest
import torch

from afore.ffn.graphs import DEFAULT_BUCKETS, StepGraphs, bucket_for


def test_a_step_runs_in_the_smallest_bucket_that_holds_it():
    assert [bucket_for(t, DEFAULT_BUCKETS) for t in (1, 2, 3, 9, 512)] == [1, 2, 4, 16, 512]
    assert bucket_for(513, DEFAULT_BUCKETS) is None


def test_graphs_need_cuda_tensors():
    w13, w2 = torch.zeros(2, 8, 4), torch.zeros(2, 4, 4)
    with pytest.raises(ValueError, match="CUDA"):
        StepGraphs(w13, w2, torch.zeros(49, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16, 2)
