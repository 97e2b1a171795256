"""An FFN worker's stage trace (AFORE_STAGE_TRACE): one row per target, every stamp in the order the
step takes them, with the columns the per-stage breakdown reads (afore.bench.dataplane.transport)."""

import numpy as np
import torch

from afore.config import ClusterShape
from afore.ffn.reference import random_routing
from afore.ffn.stages import COLUMNS
from afore.ffn.worker import FFNWorker, FFNWorkerConfig
from afore.metrics.trace import TRACE_ENV, read_trace
from afore.models.checkpoint import read_model_spec
from afore.models.tiny import build_tiny_checkpoint
from afore.plan import Target
from afore.transport.base import Microbatch


class _Loopback:
    """The FFN end of a transport that hands nothing in and keeps the replies."""

    queued = 0
    store = None

    def __init__(self) -> None:
        self.replies = []

    def peek(self):
        return None

    def agree(self, flag: bool, digest: int = 0) -> bool:
        return flag

    def send(self, mb, reply) -> None:
        self.replies.append((mb.seq, reply))

    def close(self) -> None:
        pass


def test_every_target_leaves_one_ordered_row(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "st"))
    model = str(build_tiny_checkpoint("qwen3_moe", seed=0))
    spec = read_model_spec(model)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=1, num_layers=len(spec.moe_layer_indices),
                         redundant_slots=1, top_k=spec.top_k)

    class Worker(FFNWorker):
        def _connect(self):
            return _Loopback()

    worker = Worker(FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model=model, shape=shape, timeout_s=10.0))
    rng = np.random.default_rng(0)
    try:
        for seq in range(2 * shape.num_layers):
            ids, weights = random_routing(4, shape, rng)
            mb = Microbatch(Target.from_seq(seq, shape.num_layers, 1), seq, torch.randn(4, spec.hidden_size),
                            ids.to(torch.int32), weights.float(), [4])
            worker.step(mb)
        worker.trace.flush()
        replies = worker.connector.replies
    finally:
        worker.close()
    rows = read_trace(tmp_path / "st.ffn0.csv")
    assert [r["seq"] for r in rows] == [seq for seq, _ in replies] == list(range(2 * shape.num_layers))
    assert set(rows[0]) == set(COLUMNS)
    for r in rows:
        stamps = [r[c] for c in ("start_ns", "plan_ns", "computed_ns", "agreed_ns", "sent_ns", "published_ns")]
        assert stamps == sorted(stamps) and stamps[0] > 0, r
        assert r["rows_ns"] == 0  # stamped on the sparse device path only (the dense rows came with the target)
        assert r["device_ns"] == 0  # no CUDA events on a CPU worker
        assert r["tokens"] == 4 and r["used"] == 0  # no plan ring: primary-only
