import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest

from afore.config import ClusterShape
from afore.migrator.plan_source import QueuePlanSource, RingPlanSource
from afore.prefetch.mailbox import DemandMailbox
from afore.prefetch.receiver import DemandClient
from afore.plan import Target, check_plan, primary_only_plan
from afore.scheduler.service import SchedulerService, ServiceConfig, start_scheduler_process
from afore.scheduler.service_cli import parse_shape

SHAPE = ClusterShape(num_experts=16, num_workers=2, num_layers=2, redundant_slots=1, m_tile=4, top_k=2)


def config(seg_name, **kw):
    base = dict(shape=SHAPE, mailbox=seg_name("mb"), ring=seg_name("ring"), num_producers=2, num_microbatches=1,
                deadline_ms=100.0, liveness_timeout_s=0.5)
    return ServiceConfig(**{**base, **kw})


def report(producer, target, w):
    producer.put(target, w, np.arange(16, dtype=np.int32) * (w + 1) + target.step)


def test_service_plans_every_complete_target_and_counts_misses(seg_name):
    cfg = config(seg_name, metrics_port=0)
    service = SchedulerService(cfg).start_thread()
    assert service.policy.name == "afore"
    while service.metrics_port is None:
        time.sleep(0.01)
    producer = DemandMailbox.attach(cfg.mailbox)
    source = RingPlanSource(cfg.ring, 0, SHAPE)
    try:
        for step in range(5):
            t = Target(step, 0, 0)
            for w in range(2):
                report(producer, t, w)
            plan = source.get(t, step * 2, timeout_s=5.0)
            assert plan is not None and plan.target == t
            check_plan(SHAPE, plan)
            np.testing.assert_array_equal(plan.demand, np.arange(16) * 3 + 2 * step)
        # worker 1 never reports (5, 0, 0): no plan by the deadline, the FFN side runs primary-only
        report(producer, Target(5, 0, 0), 0)
        assert source.get(Target(5, 0, 0), 10, timeout_s=0.5) is None
        assert source.misses == 1 and source.hits == 5
        deadline = time.monotonic() + 5
        while service.missed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5).read().decode()
        assert 'afore_scheduler_plans_total{policy="afore"} 5.0' in text
        assert 'afore_scheduler_plan_misses_total{policy="afore",reason="deadline"} 1.0' in text
        assert 'afore_scheduler_demand_to_plan_seconds_count{policy="afore"} 5.0' in text
        assert 'afore_mailbox_reports_total{outcome="accepted",worker="0"} 6.0' in text
        assert "afore_ring_readers_live 1.0" in text
        assert 'afore_scheduler_plan_read_seconds_count{policy="afore"}' in text
        assert 'afore_scheduler_tile_imbalance_count{layer="0",placement="plan",policy="afore"} 5.0' in text
    finally:
        source.close()
        producer.close()
        service.stop()
    assert not os.path.exists(f"/dev/shm/{cfg.mailbox}") and not os.path.exists(f"/dev/shm/{cfg.ring}")


def test_queue_plan_source():
    source = QueuePlanSource(capacity=4)
    plans = [primary_only_plan(SHAPE, np.arange(16), Target(s, 0, 0), s) for s in range(6)]
    source.put(plans[0])
    source.put(plans[2])
    assert source.get(Target(0, 0, 0), 0, 0.0) is plans[0]
    assert source.get(Target(1, 0, 0), 1, 1.0) is None  # seq 2 exists: 1 was skipped, no wait
    assert source.get(Target(9, 0, 0), 2, 0.0) is None  # wrong target
    with pytest.raises(ValueError, match="already published"):
        source.put(plans[2])
    t0 = time.monotonic()
    assert source.get(Target(3, 0, 0), 3, 0.05) is None
    assert time.monotonic() - t0 >= 0.04
    assert (source.hits, source.misses) == (1, 3)


def test_parse_shape():
    assert parse_shape("E=128,F=8,L=4,R=3") == ClusterShape(128, 8, num_layers=4, redundant_slots=3)
    with pytest.raises(ValueError, match="shape"):
        parse_shape("E=128")
    with pytest.raises(ValueError, match="shape.num_workers"):
        parse_shape("E=128,F=x")


def test_config_validation(seg_name):
    with pytest.raises(ValueError, match="token"):
        config(seg_name, listen="127.0.0.1:0")
    with pytest.raises(ValueError, match="num_producers"):
        config(seg_name, num_producers=0)


class Completed:
    def __init__(self, returncode, stdout):
        self.returncode, self.stdout = returncode, stdout


def afore(*args):
    """``afore status ...`` in-process (the console script loads every command, torch included)."""
    import argparse
    import contextlib
    import io

    from afore.scheduler import status_cli
    assert args[0] == "status"
    parser = argparse.ArgumentParser()
    status_cli.add_arguments(parser)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = status_cli.run(parser.parse_args(list(args[1:])))
    return Completed(code, buf.getvalue())


def test_afore_cli_dispatches_status_and_scheduler():
    from afore.cli import build_parser
    args = build_parser().parse_args(["status", "--json"])
    assert args._module == "afore.scheduler.status_cli" and args.json
    args = build_parser().parse_args(["scheduler", "--shape", "E=8,F=2", "--attn-workers", "3"])
    assert args._module == "afore.scheduler.service_cli" and args.attn_workers == 3


def test_cli_scheduler_status_and_sigterm_cleanup(seg_name):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = config(seg_name, listen=f"127.0.0.1:{port}", token="t0k")
    proc = start_scheduler_process(cfg, stderr=subprocess.PIPE, text=True)
    try:
        source = RingPlanSource(cfg.ring, 1, SHAPE)
        producer = DemandMailbox.attach(cfg.mailbox)
        report(producer, Target(0, 1, 0), 0)  # worker 0 on the FFN node: shared memory
        deadline = time.monotonic() + 10
        while True:  # worker 1 on another node: TCP through the service's receiver
            try:
                client = DemandClient("127.0.0.1", port, "t0k")
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        client.put(Target(0, 1, 0), 1, np.arange(16, dtype=np.int32) * 2)
        plan = source.get(Target(0, 1, 0), 1, timeout_s=10.0)
        assert plan is not None
        np.testing.assert_array_equal(plan.demand, np.arange(16) * 3)
        client.close()
        out = afore("status", cfg.mailbox, cfg.ring)
        assert out.returncode == 0
        assert f"{cfg.ring}: plan_ring v2 ready, owner pid {proc.pid} alive" in out.stdout
        assert "readers 1/2 alive" in out.stdout and "completed=1" in out.stdout
        listed = json.loads(afore("status", "--json").stdout)
        assert {cfg.mailbox, cfg.ring} <= {s["name"] for s in listed["segments"]}
        source.close()
        producer.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "segments unlinked" in err
    assert not os.path.exists(f"/dev/shm/{cfg.mailbox}") and not os.path.exists(f"/dev/shm/{cfg.ring}")


def test_status_clean_removes_stale_segments(seg_name):
    name = seg_name("stale")
    pid = os.fork()
    if pid == 0:
        mb = DemandMailbox.create(name, SHAPE, 1)  # noqa: F841
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    out = afore("status", name)
    assert "DEAD (stale)" in out.stdout
    out = afore("status", "--clean", name)
    assert f"removed stale segment {name}" in out.stdout
    assert not os.path.exists(f"/dev/shm/{name}")
    assert afore("status", name).returncode == 1


class _FailingOnOddSteps:
    name = "failing"

    def __init__(self):
        from afore.config import CostModel, SchedulerParams
        from afore.scheduler.policies import make_policy
        self.inner = make_policy("afore", SHAPE, SchedulerParams(), CostModel())

    def plan(self, obs):
        if obs.target.step % 2:
            raise FloatingPointError("policy bug")
        return self.inner.plan(obs)


def test_a_policy_error_costs_one_target_not_the_service(seg_name):
    cfg = config(seg_name)
    service = SchedulerService(cfg, policy=_FailingOnOddSteps()).start_thread()
    producer = DemandMailbox.attach(cfg.mailbox)
    source = RingPlanSource(cfg.ring, 0, SHAPE)
    try:
        got = []
        for step in range(4):
            for w in range(2):
                report(producer, Target(step, 0, 0), w)
            got.append(source.get(Target(step, 0, 0), step * 2, timeout_s=2.0 if step % 2 == 0 else 0.3))
        assert [p is not None for p in got] == [True, False, True, False]
        assert 'afore_scheduler_plan_misses_total{policy="afore",reason="policy_error"} 2.0' in service.metrics.render()
    finally:
        source.close()
        producer.close()
        service.stop()


def test_a_worker_that_skipped_a_plan_resyncs_the_projected_slot_table(seg_name):
    """Worker 1 never applied the copies of a plan (its agreement failed): it reports its slots,
    the scheduler replaces its projected row, and every later plan is valid against what the
    worker really holds (check_plan from the reported table), so it can be used again."""
    from afore.plan import SlotTable
    from afore.scheduler.slot_sync import SlotReporter, segment_name

    shape = ClusterShape(num_experts=16, num_workers=2, num_layers=1, redundant_slots=2, m_tile=1, top_k=2)
    cfg = config(seg_name, shape=shape, num_producers=1)
    service = SchedulerService(cfg)
    producer = DemandMailbox.attach(cfg.mailbox)
    reporter = SlotReporter(segment_name(cfg.ring), 1, 1, 2)
    hot = np.zeros(16, dtype=np.int32)
    hot[:2] = 40  # both hot experts are primaries of worker 0: the plan replicates them onto worker 1

    def plan_once(step, demand):
        producer.put(Target(step, 0, 0), 0, demand)
        assert service.step(timeout_s=2.0) == 1
        return service.policy.layer(0).table.copy()

    try:
        projected = plan_once(0, hot)
        assert (projected.expert[1] >= 0).any(), "the skewed demand should have made copies onto worker 1"
        actual = SlotTable.empty(shape)  # worker 1 holds nothing: it never made those copies
        reporter.report(0, {0: actual.expert[1].copy()})
        demand = hot.copy()
        demand[2:4] = 30
        before = service.policy.layer(0).table.copy()
        plan_once(1, demand)
        assert service.resyncs == 1
        plan = service.policy.layer(0).last_plan
        # valid against the worker's real table: no replica read that worker 1 does not hold or copy in
        real = SlotTable(before.expert.copy(), before.last_used.copy())
        real.expert[1] = actual.expert[1]
        check_plan(shape, plan, table_before=real)
        plan_once(2, demand)  # no new report: no new re-sync
        assert service.resyncs == 1
    finally:
        reporter.close()
        producer.close()
        service.close()
