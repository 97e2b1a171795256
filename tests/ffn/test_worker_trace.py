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


def _tiny_worker(plan_source=None, connector=None):
    model = str(build_tiny_checkpoint("qwen3_moe", seed=0))
    spec = read_model_spec(model)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=1, num_layers=len(spec.moe_layer_indices),
                         redundant_slots=1, top_k=spec.top_k)

    class Worker(FFNWorker):
        def _connect(self):
            return connector or _Loopback()

    worker = Worker(FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model=model, shape=shape, timeout_s=10.0),
                    plan_source=plan_source)
    return worker, shape, spec


def _target(shape, spec, seq, rng):
    ids, weights = random_routing(4, shape, rng)
    return Microbatch(Target.from_seq(seq, shape.num_layers, 1), seq, torch.randn(4, spec.hidden_size),
                      ids.to(torch.int32), weights.float(), [4])


def test_deferred_bookkeeping_waits_for_the_steps_last_layer(tmp_path, monkeypatch):
    """``run`` defers the after-reply work: targets of a step's first layers leave nothing in the
    trace or the stage histogram until its last layer's target (or idle time) flushes them all,
    in order; the counters go before every reply."""
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "st"))
    worker, shape, spec = _tiny_worker()
    rng = np.random.default_rng(1)
    layers = shape.num_layers
    assert layers >= 2
    try:
        worker.defer_bookkeeping = True
        for seq in range(layers - 1):
            worker.step(_target(shape, spec, seq, rng))
        assert len(worker._after) == layers - 1
        assert worker.metrics._targets._value.get() == layers - 1  # counted before each reply
        worker.trace.flush()
        assert not (tmp_path / "st.ffn0.csv").exists() or read_trace(tmp_path / "st.ffn0.csv") == []
        worker.step(_target(shape, spec, layers - 1, rng))  # the last MoE layer: flushed
        assert worker._after == []
        worker.trace.flush()
        assert [r["seq"] for r in read_trace(tmp_path / "st.ffn0.csv")] == list(range(layers))
    finally:
        worker.close()


class _Ahead(_Loopback):
    """A connector whose next target is already there (``peek``)."""

    def __init__(self) -> None:
        super().__init__()
        self.next = None

    def peek(self):
        return self.next


class _OneShotSource:
    """A plan source that hands each target's plan out once (as a ring does); seq 1's is invalid."""

    needs_demand = False

    def __init__(self) -> None:
        self.shape, self.calls = None, []  # the worker's shape, set once it exists

    def get(self, target, seq, timeout_s):
        from afore.plan import primary_only_plan

        self.calls.append(seq)
        if self.calls.count(seq) > 1 or seq != 1:
            return None
        return primary_only_plan(self.shape, np.zeros(self.shape.num_experts, np.int64), target, seq + 100)

    def close(self) -> None:
        pass


def test_a_rejected_read_ahead_plan_is_counted_once_and_not_asked_for_again():
    """A plan read ahead and rejected is counted ``rejected`` there; its target then runs without a
    plan and does not ask the source again (which would count it ``missed`` as well)."""
    connector, source = _Ahead(), _OneShotSource()
    worker, shape, spec = _tiny_worker(plan_source=source, connector=connector)
    source.shape = shape
    rng = np.random.default_rng(2)
    try:
        mb0, mb1 = _target(shape, spec, 0, rng), _target(shape, spec, 1, rng)
        connector.next = mb1
        worker.step(mb0)            # no plan for 0 (missed); 1's plan read ahead and rejected
        connector.next = None
        worker.step(mb1)
        plans = worker.metrics._plans
        assert plans["rejected"]._value.get() == 1
        assert plans["missed"]._value.get() == 1
        assert source.calls == [0, 1]  # target 1 was not asked for twice
        assert worker.metrics._primary_only._value.get() == 2
    finally:
        worker.close()
