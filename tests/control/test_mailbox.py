import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from afore import _shm
from afore.config import ClusterShape
from afore.prefetch.mailbox import DemandMailbox, DemandReport
from afore.plan import Target

SHAPE = ClusterShape(num_experts=16, num_workers=4, num_layers=3, top_k=4)


def counts(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50, SHAPE.num_experts).astype(np.int32)


@pytest.fixture
def mailbox(seg_name):
    mb = DemandMailbox.create(seg_name("mb"), SHAPE, num_producers=3, num_microbatches=2, capacity=8, deadline_s=0.2)
    producer = DemandMailbox.attach(mb.name)
    yield mb, producer
    producer.close()
    mb.close()


def test_seq_is_the_ffn_execution_order():
    targets = [Target(s, l, m) for s in range(3) for l in range(4) for m in range(2)]
    seqs = [t.seq(4, 2) for t in targets]
    assert seqs == list(range(len(targets)))
    assert [Target.from_seq(s, 4, 2) for s in seqs] == targets


def test_complete_target_is_the_sum_in_seq_order(mailbox):
    mb, producer = mailbox
    targets = [Target(0, 0, 0), Target(0, 0, 1), Target(0, 1, 0), Target(1, 2, 1)]
    # workers report in different interleavings; the consumer sees seq order
    for w in (2, 0, 1):
        for i, t in enumerate(targets):
            assert producer.put(t, w, counts(10 * i + w))
    for i, t in enumerate(targets):
        got = mb.wait_complete(1.0)
        assert got.target == t and got.seq == t.seq(3, 2)
        np.testing.assert_array_equal(got.demand, sum(counts(10 * i + w).astype(np.int64) for w in range(3)))
        written_ns, complete_ns = mb.last_stamps
        assert 0 < written_ns <= complete_ns
    assert mb.wait_complete(0.01) is None
    assert mb.stats()["counters"]["completed"] == 4


@pytest.mark.parametrize("bad, match", [
    (dict(counts=np.zeros(15, np.int32)), "length 16"),
    (dict(counts=-np.ones(16, np.int32)), "non-negative"),
    (dict(worker=3), "worker"),
    (dict(worker=-1), "worker"),
    (dict(target=Target(0, 3, 0)), "layer"),
    (dict(target=Target(0, 0, 2)), "microbatch"),
    (dict(counts=np.full(16, 0.5)), "integer"),
])
def test_bad_input_is_rejected_counted_and_loses_nothing_else(mailbox, bad, match):
    mb, producer = mailbox
    good = dict(target=Target(0, 1, 0), worker=0, counts=counts(1))
    for w in (1, 2):
        producer.put(Target(0, 1, 0), w, counts(w))
    with pytest.raises(ValueError, match=match):
        producer.put(**{**good, **bad})
    assert producer.put(**good)
    got = mb.wait_complete(1.0)
    assert got.target == Target(0, 1, 0)
    np.testing.assert_array_equal(got.demand, counts(1) + counts(1) + counts(2))
    info = mb.stats()
    if "worker" in bad:
        assert info["counters"]["rejected_unknown_worker"] == 1
    elif "integer" not in match:
        assert info["producers"][0]["rejected_invalid"] == 1


def test_duplicate_and_out_of_order_reports_are_rejected(mailbox):
    mb, producer = mailbox
    assert producer.put(Target(0, 1, 1), 0, counts(0))
    for t in (Target(0, 1, 1), Target(0, 0, 1)):
        with pytest.raises(ValueError, match="duplicate or out-of-order"):
            producer.put(t, 0, counts(0))
    assert mb.stats()["producers"][0]["rejected_duplicate"] == 2


def test_wire_message_path_is_the_same(mailbox):
    mb, producer = mailbox
    for w in range(3):
        assert producer.put_report(DemandReport.make(Target(2, 0, 1), w, counts(w)))
    got = mb.wait_complete(1.0)
    assert got.target == Target(2, 0, 1)
    np.testing.assert_array_equal(got.demand, sum(counts(w).astype(np.int64) for w in range(3)))


def test_incomplete_target_is_skipped_when_a_later_one_completes(mailbox):
    mb, producer = mailbox
    producer.put(Target(0, 0, 0), 0, counts(0))
    producer.put(Target(0, 0, 0), 1, counts(1))  # worker 2 never reports (0, 0, 0)
    for w in range(3):
        producer.put(Target(0, 0, 1), w, counts(w))
    got = mb.wait_complete(1.0)
    assert got.target == Target(0, 0, 1)
    missed = mb.take_missed()
    assert [(m.target, m.reported_workers, m.reason) for m in missed] == [(Target(0, 0, 0), 2, "incomplete")]
    assert mb.stats()["counters"]["incomplete_skipped"] == 1


def test_incomplete_target_expires_at_its_deadline(mailbox):
    mb, producer = mailbox
    producer.put(Target(0, 2, 0), 0, counts(0))
    assert mb.wait_complete(0.5) is None  # deadline 0.2 s
    assert [(m.target, m.reason) for m in mb.take_missed()] == [(Target(0, 2, 0), "deadline")]
    # the other workers' late reports for that target are dropped, not planned
    producer.put(Target(0, 2, 0), 1, counts(1))
    producer.put(Target(0, 2, 0), 2, counts(2))
    assert mb.wait_complete(0.05) is None
    assert mb.stats()["counters"]["late"] == 2


def test_full_ring_blocks_then_drops_and_counts(mailbox):
    mb, producer = mailbox  # capacity 8, nobody consumes
    for step in range(8):
        assert producer.put(Target(step, 0, 0), 0, counts(step), timeout_s=0.0)
    assert not producer.put(Target(8, 0, 0), 0, counts(8), timeout_s=0.02)
    assert mb.stats()["producers"][0]["dropped_full"] == 1
    mb.wait_complete(0.01)  # the consumer drains: room again
    assert producer.put(Target(8, 0, 0), 0, counts(8), timeout_s=0.0)


def test_one_process_per_worker_ring(mailbox):
    mb, producer = mailbox
    producer.put(Target(0, 0, 0), 0, counts(0))
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        err = pool.apply(_put_from_other_process, (mb.name, 0))
    assert "owned by live pid" in err


def _put_from_other_process(name, worker):
    producer = DemandMailbox.attach(name)
    try:
        producer.put(Target(0, 0, 1), worker, np.zeros(16, np.int32))
    except ValueError as exc:
        return str(exc)
    return ""


def test_stale_segment_of_a_dead_owner_is_replaced(seg_name):
    name = seg_name("stale")
    pid = os.fork()
    if pid == 0:  # a scheduler that crashes without cleaning up
        mb = DemandMailbox.create(name, SHAPE, 2)  # noqa: F841 (held: its destructor would unlink)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    assert _shm.inspect(name)["owner_alive"] is False
    mb = DemandMailbox.create(name, SHAPE, 2)
    info = _shm.inspect(name)
    assert info["owner_pid"] == os.getpid() and info["state"] == "ready"
    mb.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_live_owner_segment_is_never_replaced(seg_name):
    mb = DemandMailbox.create(seg_name("live"), SHAPE, 2)
    try:
        pid = os.getpid()
        with pytest.raises(ValueError, match=f"live owner pid {pid}"):
            DemandMailbox.create(mb.name, SHAPE, 2)
    finally:
        mb.close()


def test_producer_reattaches_after_the_scheduler_restarts(seg_name):
    name = seg_name("restart")
    first = DemandMailbox.create(name, SHAPE, 1, capacity=2)
    producer = DemandMailbox.attach(name)
    producer.put(Target(0, 0, 0), 0, counts(0))
    first.close()
    second = DemandMailbox.create(name, SHAPE, 1, capacity=2)
    assert producer.put(Target(0, 0, 1), 0, counts(1), timeout_s=0.01)
    got = second.wait_complete(1.0)
    assert got.target == Target(0, 0, 1)
    second.close()


def test_full_ring_of_a_silent_scheduler_drops_without_waiting(seg_name):
    mb = DemandMailbox.create(seg_name("silent"), SHAPE, 1, capacity=2)
    producer = DemandMailbox.attach(mb.name)
    for step in range(2):
        assert producer.put(Target(step, 0, 0), 0, counts(step))
    time.sleep(1.1)  # the scheduler stops polling
    t0 = time.monotonic()
    assert not producer.put(Target(2, 0, 0), 0, counts(2), timeout_s=5.0)
    assert time.monotonic() - t0 < 0.5
    assert mb.stats()["producers"][0]["dropped_full"] == 1
    mb.close()
