"""DemandEmitter on the FFN node: the counts of a target's host ids land in the mailbox as the
scheduler's complete demand (padding ids not counted, int32 or int64 ids alike), and the
in-process hot-path harness runs every target on the scheduler's plan."""

import numpy as np
import pytest
import torch

from afore.attention.demand import DemandEmitter
from afore.config import ClusterShape
from afore.prefetch.mailbox import DemandMailbox

SHAPE = ClusterShape(num_experts=8, num_workers=2, num_layers=2, redundant_slots=1, top_k=2, m_tile=4)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_emitted_counts_are_the_complete_demand(seg_name, dtype):
    with DemandMailbox.create(seg_name("mb"), SHAPE, num_producers=1, num_microbatches=1) as mailbox:
        emitter = DemandEmitter(mailbox.name, SHAPE.num_experts, 0)
        ids = torch.tensor([[0, 3], [7, -1], [3, 3]], dtype=dtype)
        emitter.emit(0, 0, 0, 0, ids)
        emitter.emit(0, 1, 0, 1, ids[:1])
        got = [mailbox.wait_complete(1.0) for _ in range(2)]
        assert emitter.emitted == 2 and emitter.errors == 0
        assert got[0].demand.tolist() == [1, 0, 0, 3, 0, 0, 0, 1]
        assert got[1].seq == 1 and got[1].demand.tolist() == [1, 0, 0, 1, 0, 0, 0, 0]


@pytest.mark.slow
def test_hot_path_harness_uses_every_plan():
    from afore.bench.hotpath import STAGES, run

    result = run(targets=12, warmup=3)
    assert result["plans_used_share"] == 1.0
    assert all(result[name] > 0 for name in STAGES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run by bench/device/gpu_tests.sh)")
def test_device_ids_deliver_every_report_through_reused_pinned_buffers(seg_name):
    """On a GPU the counts go to pinned memory without a sync and a background thread delivers
    them; its buffers are reused once delivered: 200 reports, each with its own counts, arrive
    intact in order, through far fewer pinned buffers than reports."""
    with DemandMailbox.create(seg_name("mbg"), SHAPE, num_producers=1, num_microbatches=1) as mailbox:
        emitter = DemandEmitter(mailbox.name, SHAPE.num_experts, 0)
        rng = np.random.default_rng(0)
        want = []
        for seq in range(200):
            ids = torch.from_numpy(rng.integers(-1, SHAPE.num_experts, (5, 2)).astype(np.int32)).cuda()
            want.append(np.bincount(ids.cpu().numpy().reshape(-1)[ids.cpu().numpy().reshape(-1) >= 0],
                                    minlength=SHAPE.num_experts).tolist())
            emitter.emit(seq // 2, seq % 2, 0, seq, ids)
            got = mailbox.wait_complete(5.0)
            assert got is not None and got.seq == seq and got.demand.tolist() == want[seq]
        assert emitter.emitted == 200 and emitter.errors == 0
        assert emitter._free.qsize() <= 3  # one buffer in turn, not one per report
