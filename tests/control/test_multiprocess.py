"""The control plane with real processes (spawn): producers, readers, writer, kills."""

import hashlib
import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest

from afore.config import ClusterShape
from afore.migrator.plan_source import RingPlanSource
from afore.prefetch.mailbox import DemandMailbox
from afore.plan import Target, check_plan
from afore.scheduler.plan_ring import PlanRing, wait_for_segment
from afore.scheduler.service import SchedulerService, ServiceConfig, start_scheduler_process

pytestmark = pytest.mark.slow

SHAPE = ClusterShape(num_experts=32, num_workers=8, num_layers=2, redundant_slots=2, m_tile=4, top_k=4)
MICROBATCHES = 2
CTX = mp.get_context("spawn")


def demand_of(seq: int, worker: int) -> np.ndarray:
    return np.random.default_rng(seq * 64 + worker).integers(0, 40, SHAPE.num_experts).astype(np.int32)


def produce(name: str, worker: int, num_targets: int, jitter_s: float) -> None:
    mailbox = DemandMailbox.attach(name)
    rng = random.Random(worker)
    for seq in range(num_targets):
        assert mailbox.put(Target.from_seq(seq, SHAPE.num_layers, MICROBATCHES), worker, demand_of(seq, worker), timeout_s=5.0)
        if jitter_s:
            time.sleep(rng.random() * jitter_s)


def consume(name: str, reader: int, num_targets: int, timeout_s: float, queue) -> None:
    """Ask for every seq in order; report (hits, digest of the plans, misses)."""
    wait_for_segment(name, 10.0)
    source = RingPlanSource(name, reader, SHAPE)
    queue.put(("ready", reader))
    digest = hashlib.sha256()
    for seq in range(num_targets):
        target = Target.from_seq(seq, SHAPE.num_layers, MICROBATCHES)
        plan = source.get(target, seq, timeout_s)
        if plan is None:
            continue
        check_plan(SHAPE, plan)
        expected = sum(demand_of(seq, w).astype(np.int64) for w in range(4))
        assert np.array_equal(plan.demand, expected), f"reader {reader}: wrong demand for seq {seq}"
        digest.update(plan.assignment.tobytes() + plan.slot.tobytes())
    queue.put(("done", reader, source.hits, digest.hexdigest(), source.misses))
    source.close()


def test_four_producers_eight_readers_every_plan_in_order(seg_name):
    num_targets = 120
    cfg = ServiceConfig(shape=SHAPE, mailbox=seg_name("mb"), ring=seg_name("ring"), num_producers=4,
                        num_microbatches=MICROBATCHES, deadline_ms=5000.0, ring_slots=8, liveness_timeout_s=10.0,
                        # pid only: the service loop (and its heartbeat) starts after the readers; the
                        # producers run ahead of any FFN stage, so no target counts as already run
                        writer_timeout_s=0.0, run_lag=0)
    service = SchedulerService(cfg)
    queue = CTX.Queue()
    readers = [CTX.Process(target=consume, args=(cfg.ring, r, num_targets, 20.0, queue)) for r in range(8)]
    for p in readers:
        p.start()
    assert sorted(queue.get(timeout=60)[1] for _ in readers) == list(range(8))  # all attached before any plan
    service.start_thread()
    producers = [CTX.Process(target=produce, args=(cfg.mailbox, w, num_targets, 0.002)) for w in range(4)]
    for p in producers:
        p.start()
    results = [queue.get(timeout=120) for _ in readers]
    for p in producers + readers:
        p.join(30)
        assert p.exitcode == 0
    service.stop()
    assert service.published == num_targets and service.missed == 0
    assert all(hits == num_targets and misses == 0 for _, _, hits, _, misses in results)
    assert len({digest for _, _, _, digest, _ in results}) == 1  # every worker applies the same plans


def hammer_reader(name: str, reader: int, seconds: float, queue) -> None:
    """Read every plan with random pauses, some beyond the liveness timeout, so the writer
    evicts and laps this reader while it copies. A plan that decodes must be exactly the
    plan published for its seq."""
    from afore import _shm
    from afore.scheduler.plan_codec import decode_plan
    ring = PlanRing.attach(name, reader, SHAPE)
    rng = random.Random(reader)
    good = wrong = rejected = 0
    end = time.monotonic() + seconds
    seq = 0
    while time.monotonic() < end:
        status, entry_seq, payload, _ = ring.wait_raw(seq, 0.0)
        if status == _shm.FOUND:
            try:
                plan = decode_plan(payload, SHAPE)
            except ValueError:
                rejected += 1
            else:
                good += 1
                wrong += plan.seq != seq or plan.assignment.tobytes() != stress_plan(seq).assignment.tobytes()
            seq += 1
        elif status == _shm.MISSED:
            seq = entry_seq  # lapped or skipped: go on with what is there now
        if rng.random() < 0.02:
            time.sleep(rng.random() * 0.02)
    queue.put((reader, good, wrong, rejected))
    ring.close()


def stress_plan(seq: int):
    from afore.plan import Target, primary_only_plan
    demand = np.random.default_rng(seq).integers(0, 1000, SHAPE.num_experts)
    return primary_only_plan(SHAPE, demand, Target(seq, 0, 0), seq)


def test_no_torn_reads_under_concurrent_writes(seg_name):
    from afore import _shm
    writer = PlanRing.create(seg_name("stress"), SHAPE, num_readers=3, num_slots=2, liveness_timeout_s=0.002)
    queue = CTX.Queue()
    readers = [CTX.Process(target=hammer_reader, args=(writer.name, r, 5.0, queue)) for r in range(3)]
    for p in readers:
        p.start()
    wait_until = time.monotonic() + 30
    while sum(r["state"] == "live" for r in _shm.inspect(writer.name)["readers"]) < 3 and time.monotonic() < wait_until:
        time.sleep(0.01)
    end = time.monotonic() + 3.0
    seq = 0
    while time.monotonic() < end:
        writer.publish(stress_plan(seq), timeout_s=1.0)
        seq += 1
    results = [queue.get(timeout=30) for _ in readers]
    for p in readers:
        p.join(10)
    info = _shm.inspect(writer.name)
    writer.close()
    assert sum(good for _, good, _, _ in results) > 100, results
    assert info["counters"]["evictions"] > 0  # the race was exercised
    assert all(wrong == 0 for _, _, wrong, _ in results), results


def follow(name: str, reader: int, num_plans: int, queue) -> None:
    """Read plans 0..num_plans-1 in order, reporting progress."""
    ring = PlanRing.attach(name, reader, SHAPE)
    queue.put(("ready", reader))
    got = 0
    for seq in range(num_plans):
        if ring.wait(seq, timeout_s=20.0) is not None:
            got += 1
        if seq == 10:
            queue.put(("progress", reader))
    queue.put(("done", reader, got))
    ring.close()


def test_reader_killed_mid_run_blocks_the_writer_at_most_the_liveness_timeout(seg_name):
    # pid_check off: the heartbeat alone must catch it (e.g. readers in another pid namespace)
    writer = PlanRing.create(seg_name("kill"), SHAPE, num_readers=3, num_slots=4, liveness_timeout_s=0.5,
                             pid_check=False)
    queue = CTX.Queue()
    procs = [CTX.Process(target=follow, args=(writer.name, r, 60, queue)) for r in range(3)]
    for p in procs:
        p.start()
    assert sorted(queue.get(timeout=60)[1] for _ in procs) == [0, 1, 2]
    stalls = []
    for seq in range(60):
        if seq == 20:
            os.kill(procs[2].pid, signal.SIGKILL)
        t0 = time.monotonic()
        writer.publish(stress_plan(seq), timeout_s=5.0)
        stalls.append(time.monotonic() - t0)
        time.sleep(0.002)
    done = {}
    while len(done) < 2:
        msg = queue.get(timeout=30)
        if msg[0] == "done":
            done[msg[1]] = msg[2]
    procs[2].join(5)
    for p in procs[:2]:
        p.join(10)
        assert p.exitcode == 0
    info = writer._handle and __import__("afore._shm", fromlist=["inspect"]).inspect(writer.name)
    writer.close()
    assert done == {0: 60, 1: 60}  # the live readers lost nothing
    assert info["counters"]["evictions"] == 1 and info["readers"][2]["state"] == "evicted"
    assert 0.3 < max(stalls) < 2.0  # one stall of about the liveness timeout, then full speed
    assert sorted(stalls)[-2] < 0.3


def test_scheduler_killed_readers_miss_then_recover_after_restart(seg_name):
    cfg = ServiceConfig(shape=SHAPE, mailbox=seg_name("mb"), ring=seg_name("ring"), num_producers=1,
                        num_microbatches=MICROBATCHES, deadline_ms=1000.0, liveness_timeout_s=1.0)
    proc = start_scheduler_process(cfg)
    source = RingPlanSource(cfg.ring, 0, SHAPE)
    producer = DemandMailbox.attach(cfg.mailbox)

    def report(seq):
        producer.put(Target.from_seq(seq, SHAPE.num_layers, MICROBATCHES), 0, demand_of(seq, 0), timeout_s=0.01)

    def get(seq, timeout):
        return source.get(Target.from_seq(seq, SHAPE.num_layers, MICROBATCHES), seq, timeout)

    try:
        for seq in range(3):
            report(seq)
            assert get(seq, 10.0) is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for seq in range(3, 6):  # demand goes nowhere; workers get no plan and count misses
            report(seq)
            assert get(seq, 0.2) is None
        assert source.misses == 3
        # a new scheduler replaces the stale segments; producer and reader re-attach
        proc = start_scheduler_process(cfg)
        deadline = time.monotonic() + 20
        seq, plan = 6, None
        while plan is None and time.monotonic() < deadline:
            report(seq)
            plan = get(seq, 0.5)
            seq += 1
        assert plan is not None and plan.seq == seq - 1
    finally:
        source.close()
        producer.close()
        proc.terminate()
        proc.wait(20)
    assert not os.path.exists(f"/dev/shm/{cfg.ring}")
