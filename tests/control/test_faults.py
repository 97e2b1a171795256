"""Faults of the control plane (issue 19): a dead scheduler, racing readers, a segment being
created, a backlog of complete targets, a scheduler that never gets ready."""

import multiprocessing as mp
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from afore import _shm
from afore.config import ClusterShape
from afore.migrator.plan_source import RingPlanSource
from afore.plan import Target, primary_only_plan
from afore.prefetch.mailbox import DemandMailbox
from afore.scheduler import service as service_module
from afore.scheduler.plan_ring import PlanRing, wait_for_segment
from afore.scheduler.service import ServiceConfig, start_scheduler_process

SHAPE = ClusterShape(num_experts=16, num_workers=3, num_layers=2, redundant_slots=2, m_tile=4, top_k=2)
CTX = mp.get_context("spawn")


def plan_for(seq: int):
    return primary_only_plan(SHAPE, np.arange(16) + seq, Target.from_seq(seq, 2, 2), seq)


def _writer_then_wait(name: str, ready) -> None:
    ring = PlanRing.create(name, SHAPE, num_slots=4)
    ring.publish(plan_for(0))
    ready.set()
    time.sleep(600)  # killed by the test


def test_readers_see_a_killed_writer_at_once_and_reattach_to_its_successor(seg_name):
    name = seg_name("ring")
    ready = CTX.Event()
    writer = CTX.Process(target=_writer_then_wait, args=(name, ready), daemon=True)
    writer.start()
    assert ready.wait(60)
    source = RingPlanSource(name, 0, SHAPE)
    try:
        assert source.get(plan_for(1).target, 1, timeout_s=0.05) is None and not source.ring.writer_dead  # alive: not yet
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(10)  # reaped: the pid is gone
        t0 = time.monotonic()
        for seq in range(1, 21):
            assert source.get(plan_for(seq).target, seq, timeout_s=5.0) is None
        assert time.monotonic() - t0 < 2.0  # 20 targets, none waited out its 5 s timeout
        assert source.ring.writer_dead and source.writer_dead_misses == 20
        assert _shm.inspect(name)["readers"][0]["writer_dead"] >= 20
        assert _shm.inspect(name)["writer_alive"] is False

        successor = PlanRing.create(name, SHAPE, num_slots=4)  # the restarted scheduler replaces the stale ring
        try:
            time.sleep(RingPlanSource.REATTACH_EVERY_S)
            assert source.get(plan_for(21).target, 21, timeout_s=0.0) is None  # this miss re-attaches
            successor.publish(plan_for(22))
            got = source.get(plan_for(22).target, 22, timeout_s=5.0)
            assert got is not None and got.seq == 22 and not source.ring.writer_dead
        finally:
            successor.close()
    finally:
        source.close()
        if writer.is_alive():
            writer.kill()


def test_a_silent_writer_is_dead_after_its_heartbeat_timeout(seg_name):
    writer = PlanRing.create(seg_name("ring"), SHAPE, num_slots=4, writer_timeout_s=0.2)
    reader = PlanRing.attach(writer.name, 0, SHAPE)
    try:
        t0 = time.monotonic()
        assert reader.wait(0, timeout_s=10.0) is None
        waited = time.monotonic() - t0
        assert reader.writer_dead and 0.1 < waited < 5.0  # gave up on the heartbeat, not the 10 s timeout
        writer.heartbeat()
        assert reader.read(0) is None and not reader.writer_dead  # alive again: just not yet
        writer.publish(plan_for(0))
        assert reader.read(0).seq == 0
    finally:
        reader.close()
        writer.close()


def test_without_a_writer_timeout_an_idle_live_writer_is_never_dead(seg_name):
    writer = PlanRing.create(seg_name("ring"), SHAPE, num_slots=4)
    reader = PlanRing.attach(writer.name, 0, SHAPE)
    try:
        assert reader.wait(0, timeout_s=0.3) is None and not reader.writer_dead
    finally:
        reader.close()
        writer.close()


def _attach_as_zero(name: str, barrier, results) -> None:
    barrier.wait(30)
    try:
        ring = PlanRing.attach(name, 0, SHAPE)
    except ValueError as exc:
        results.put(("refused", str(exc)))
        barrier.wait(30)
        return
    results.put(("attached", os.getpid()))
    barrier.wait(30)  # hold the record until everyone tried
    ring.close()


def test_concurrent_attach_as_one_reader_id_has_exactly_one_winner(seg_name):
    writer = PlanRing.create(seg_name("ring"), SHAPE, num_slots=4)
    barrier, results = CTX.Barrier(4), CTX.Queue()
    procs = [CTX.Process(target=_attach_as_zero, args=(writer.name, barrier, results)) for _ in range(4)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert sorted(kind for kind, _ in got) == ["attached", "refused", "refused", "refused"]
        assert all("reader_id: 0" in msg for kind, msg in got if kind == "refused")
    finally:
        writer.close()


def _create_and_report(name: str, results) -> None:
    ring = PlanRing.create(name, SHAPE, num_slots=4)
    results.put(os.stat(f"/dev/shm/{name}").st_ino)
    ring.close()


def test_a_segment_being_created_is_not_replaced_until_it_ages_out(seg_name):
    name = seg_name("ring")
    path = f"/dev/shm/{name}"
    with open(path, "wb"):
        pass  # what another process's create looks like between shm_open and ftruncate
    inode = os.stat(path).st_ino
    results = CTX.Queue()
    creator = CTX.Process(target=_create_and_report, args=(name, results))
    creator.start()
    try:
        time.sleep(1.0)  # the spawned creator is running by now (it imports in ~0.5 s) and waiting
        assert results.empty() and os.stat(path).st_ino == inode  # still the other creator's file
        # older than the grace period (2 s): a crashed creation, replaced
        assert results.get(timeout=30) != inode
        creator.join(10)
        assert creator.exitcode == 0
    finally:
        if creator.is_alive():
            creator.kill()


def test_complete_targets_beyond_max_ready_and_targets_that_already_ran_are_dropped_and_counted(seg_name):
    shape = ClusterShape(num_experts=8, num_workers=2, num_layers=4, top_k=2)
    mb = DemandMailbox.create(seg_name("mb"), shape, num_producers=1, num_microbatches=2, capacity=64,
                              max_ready=4, run_lag=2)
    producer = DemandMailbox.attach(mb.name)
    try:
        for seq in range(6):  # six complete targets, nobody consuming: the queue keeps the last four
            assert producer.put(Target.from_seq(seq, 4, 2), 0, np.ones(8, np.int32))
        got = mb.wait_complete(0.5)
        # seq 2, 3 queued but a report of seq 5 >= 2 + run_lag says their FFN stage already ran
        assert got.seq == 4
        counters = mb.stats()["counters"]
        assert counters["ready_overflow"] == 2 and counters["ran_before_plan"] == 2
        assert mb.wait_complete(0.05).seq == 5 and mb.wait_complete(0.05) is None
    finally:
        producer.close()
        mb.close()


def test_a_scheduler_that_never_gets_ready_is_reaped(seg_name, monkeypatch):
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kw):
        proc = real_popen(*args, **kw)
        started.append(proc)
        return proc

    monkeypatch.setattr(service_module.subprocess, "Popen", recording_popen)
    cfg = ServiceConfig(shape=SHAPE, mailbox=seg_name("mb"), ring=seg_name("ring"))
    with pytest.raises(TimeoutError, match="not ready"):
        start_scheduler_process(cfg, ready_timeout_s=0.01)
    assert len(started) == 1 and started[0].returncode is not None  # waited for: no zombie
    assert not wait_for_segment(cfg.ring, 0.0)
