"""The FFN workers' lookahead windows fed back to the scheduler (afore.scheduler.window_feedback)."""

import os
import time
import uuid

import numpy as np
import pytest

from afore.config import ClusterShape, CostModel
from afore.scheduler.service import SchedulerService, ServiceConfig
from afore.scheduler.window_feedback import EWMA_ALPHA, WindowFeedback, WindowReporter, segment_name


@pytest.fixture
def name():
    names = []

    def make(kind="win"):
        n = f"afore-test-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        names.append(n)
        return n

    yield make
    for n in names:
        for path in (f"/dev/shm/{n}", f"/dev/shm/{segment_name(n)}"):
            if os.path.exists(path):
                os.unlink(path)


def test_the_scheduler_sees_the_smallest_recent_worker_window(name):
    seg = name()
    feedback = WindowFeedback(seg, num_workers=3, period_s=0.0)
    assert feedback.window_ms() is None  # nobody reported yet
    workers = [WindowReporter(seg, w) for w in range(3)]
    workers[0].report(2.0)
    workers[1].report(1.0)
    assert feedback.window_ms() == 1.0
    workers[1].report(3.0)  # an EWMA: one long window moves it part of the way
    assert feedback.window_ms() == pytest.approx(min(2.0, EWMA_ALPHA * 3.0 + (1 - EWMA_ALPHA) * 1.0))
    for r in workers:
        r.close()
    feedback.close()
    assert not os.path.exists(f"/dev/shm/{seg}")


def test_stale_workers_are_ignored_and_bad_values_dropped(name):
    seg = name()
    feedback = WindowFeedback(seg, num_workers=2, stale_s=0.05, period_s=0.0)
    old, fresh = WindowReporter(seg, 0), WindowReporter(seg, 1)
    old.report(0.1)
    time.sleep(0.1)
    fresh.report(0.9)
    fresh.report(float("nan"))
    fresh.report(-1.0)
    assert feedback.window_ms() == pytest.approx(0.9)
    assert fresh.reported == 1
    feedback.close()


def test_a_reporter_without_a_scheduler_is_a_no_op_and_joins_a_new_one(name):
    seg = name()
    reporter = WindowReporter(seg, 0, retry_s=0.0)
    reporter.report(1.0)  # no segment yet
    assert reporter.reported == 0
    assert WindowReporter.for_ring("", 0).report(1.0) is None  # no plan ring: nothing to report to
    first = WindowFeedback(seg, 1, period_s=0.0)
    reporter.report(1.0)
    assert first.window_ms() == 1.0
    first.close()  # the scheduler restarts: a new segment under the same name
    second = WindowFeedback(seg, 1, period_s=0.0)
    reporter.report(4.0)  # notices the replaced segment, re-attaches on the next report
    reporter.report(4.0)
    assert second.window_ms() is not None and second.window_ms() > 1.0
    second.close()


def test_the_service_plans_with_the_measured_window(name):
    shape = ClusterShape(num_experts=16, num_workers=2, num_layers=2, redundant_slots=1, m_tile=4, top_k=2)
    ring = name("ring")
    cfg = ServiceConfig(shape=shape, mailbox=name("mb"), ring=ring, num_microbatches=1, cost=CostModel(window_ms=0.5))
    service = SchedulerService(cfg)
    try:
        service.window.period_s = 0.0
        service._follow_measured_window()
        assert service.policy.cost.window_ms == 0.5  # nothing measured: the calibration's value
        for w in range(2):
            WindowReporter.for_ring(ring, w).report(1.5 + w)
        service._follow_measured_window()
        assert service.policy.cost.window_ms == 1.5
        assert service.policy.cost.beta_tile_ms == CostModel().beta_tile_ms  # only the window moves
    finally:
        service.close()
    assert not os.path.exists(f"/dev/shm/{segment_name(ring)}")
