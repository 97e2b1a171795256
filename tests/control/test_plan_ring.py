import os
import signal
import time

import numpy as np
import pytest

from afore import _shm
from afore.config import ClusterShape
from afore.plan import Target, primary_only_plan
from afore.scheduler.plan_codec import encode_plan
from afore.scheduler.plan_ring import PlanRing, PublishTimeout

SHAPE = ClusterShape(num_experts=16, num_workers=3, num_layers=2, redundant_slots=2, m_tile=4, top_k=2)


def plan_for(seq: int):
    return primary_only_plan(SHAPE, np.arange(16) + seq, Target(seq // 4, (seq // 2) % 2, seq % 2), seq)


@pytest.fixture
def ring(seg_name):
    writer = PlanRing.create(seg_name("ring"), SHAPE, num_slots=4, liveness_timeout_s=0.2)
    readers = [PlanRing.attach(writer.name, r, SHAPE) for r in range(3)]
    yield writer, readers
    for r in readers:
        r.close()
    writer.close()


def test_every_reader_gets_every_plan_in_order(ring):
    writer, readers = ring
    for seq in range(10):
        writer.publish(plan_for(seq))
        for r in readers:
            got = r.read(seq, plan_for(seq).target)
            assert got.seq == seq and got.target == plan_for(seq).target
            np.testing.assert_array_equal(got.assignment, plan_for(seq).assignment)
    lat = writer.collect_latencies()
    assert [x[0] for x in lat] == list(range(10))
    assert all(copied >= pub and n == 3 and live == 3 for _, pub, copied, n, live in lat)


def test_not_yet_missed_and_stale(ring):
    writer, readers = ring
    r = readers[0]
    assert r.read(0) is None  # not yet published
    writer.publish(plan_for(0))
    writer.publish(plan_for(3))  # 1 and 2 missed by the scheduler
    assert r.read(1) is None and r.read(2) is None
    assert r.read(3).seq == 3  # entry 0 (seq 0 < 3) skipped as stale, then found
    info = _shm.inspect(writer.name)["readers"][0]
    assert (info["copied"], info["stale_skipped"], info["missed"]) == (1, 1, 2)


def test_plans_are_published_once_in_order(ring):
    writer, _ = ring
    writer.publish(plan_for(5))
    with pytest.raises(ValueError, match="published once"):
        writer.publish(plan_for(5))
    with pytest.raises(ValueError, match="published once"):
        writer.publish(plan_for(4))


def test_slot_reused_only_after_every_live_reader_acked(ring):
    writer, readers = ring  # 4 slots
    for seq in range(4):
        writer.publish(plan_for(seq))
    for r in readers[:2]:
        for seq in range(4):
            assert r.read(seq) is not None
    with pytest.raises(PublishTimeout):  # reader 2 still holds entry 0
        writer.publish(plan_for(4), timeout_s=0.05)
    assert readers[2].read(0).seq == 0  # its ack frees slot 0
    writer.publish(plan_for(4), timeout_s=0.05)
    with pytest.raises(PublishTimeout):
        writer.publish(plan_for(5), timeout_s=0.05)


def test_silent_reader_is_evicted_after_the_liveness_timeout_and_rejoins(ring):
    writer, readers = ring  # liveness 0.2 s
    for seq in range(4):
        writer.publish(plan_for(seq))
        for r in readers[:2]:
            r.read(seq)
    t0 = time.monotonic()
    writer.publish(plan_for(4), timeout_s=2.0)  # reader 2 silent: evicted
    waited = time.monotonic() - t0
    assert 0.1 < waited < 1.0
    info = _shm.inspect(writer.name)
    assert info["counters"]["evictions"] == 1 and info["readers"][2]["state"] == "evicted"
    # it comes back: rejoins at the newest entry; what it skipped are misses, not torn plans
    assert readers[2].read(1) is None
    writer.publish(plan_for(5))
    assert readers[2].read(5).seq == 5
    assert _shm.inspect(writer.name)["readers"][2]["evicted"] == 1


def test_dead_reader_is_evicted_without_waiting(seg_name):
    writer = PlanRing.create(seg_name("dead"), SHAPE, num_readers=1, num_slots=2, liveness_timeout_s=30.0)
    pid = os.fork()
    if pid == 0:
        r = PlanRing.attach(writer.name, 0, SHAPE)  # noqa: F841
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    t0 = time.monotonic()
    for seq in range(5):
        writer.publish(plan_for(seq), timeout_s=5.0)
    assert time.monotonic() - t0 < 1.0
    assert _shm.inspect(writer.name)["counters"]["evictions"] == 1
    writer.close()


def test_corrupted_and_mismatched_entries_are_rejected(ring):
    writer, readers = ring
    r = readers[0]
    data = bytearray(encode_plan(plan_for(0)))
    data[-1] ^= 0xFF
    writer.publish_bytes(bytes(data), Target(0, 0, 0), 0)
    assert r.read(0) is None and r.rejected == 1
    writer.publish(plan_for(1))
    assert r.read(1, target=Target(9, 0, 1)) is None and r.rejected == 2  # not the target asked for
    writer.publish_bytes(encode_plan(plan_for(2)), Target(0, 1, 0), 3)  # entry says seq 3, payload 2
    assert r.read(3) is None and r.rejected == 3
    assert _shm.inspect(writer.name)["readers"][0]["rejected"] == 3


def test_reader_id_held_by_a_live_process_is_refused(ring):
    writer, readers = ring
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(1) as pool:
        err = pool.apply(_attach_other, (writer.name, 1))
    assert "held by live pid" in err


def _attach_other(name, reader_id):
    try:
        PlanRing.attach(name, reader_id, SHAPE)
    except ValueError as exc:
        return str(exc)
    return ""


def test_closed_ring_reads_none_and_unlinks(seg_name):
    writer = PlanRing.create(seg_name("closed"), SHAPE)
    reader = PlanRing.attach(writer.name, 0, SHAPE)
    writer.close()
    assert not os.path.exists(f"/dev/shm/{writer.name}")
    t0 = time.monotonic()
    assert reader.wait(0, timeout_s=5.0) is None  # CLOSED returns at once
    assert time.monotonic() - t0 < 1.0
    assert reader.replaced()
    reader.close()


def test_oversize_payload_is_rejected(ring):
    writer, _ = ring
    with pytest.raises(ValueError, match="slot capacity"):
        writer.publish_bytes(b"\0" * 10**6, Target(0, 0, 0), 0)
