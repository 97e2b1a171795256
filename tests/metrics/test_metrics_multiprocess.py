"""One endpoint per pod: processes that record into one PROMETHEUS_MULTIPROC_DIR aggregate into
one exposition (what vLLM's /metrics and the FFN node's admin /metrics serve), which keeps the
naming rules and passes `promtool check metrics`."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from afore.metrics import multiprocess
from afore.metrics.conventions import check_exposition
from afore.metrics.figures import Snapshot

RECORD = r"""
import sys
import numpy as np
from afore.config import ClusterShape
from afore.ffn.metrics import FFNMetrics
from afore.metrics.attention import observe_exchange
from afore.migrator.migrator import MigrationRecord
from afore.plan import Target, primary_only_plan
from afore.scheduler.metrics import SchedulerMetrics

role, index = sys.argv[1], int(sys.argv[2])
shape = ClusterShape(num_experts=4, num_workers=2, num_layers=2, m_tile=4, top_k=1, redundant_slots=1)
if role == "ffn":
    m = FFNMetrics(index, shape)
    for seq in range(3):
        m.observe(MigrationRecord(seq, 1, 1000, 0.5, 0.0, 2.0))
        m.observe_target(primary_only_plan(shape, np.array([8, 0, 4, 4]), Target(seq, 0, 0), seq), 0.001, 1)
elif role == "scheduler":
    s = SchedulerMetrics(policy=sys.argv[3], shape=shape)
    plan = primary_only_plan(shape, np.array([8, 0, 4, 4]), Target(0, 1, 0), 1)
    s.plans.inc()
    s.observe_plan(plan)
    s.misses.labels("deadline").inc()
    s.publish_latency.observe(2e-5)
else:
    observe_exchange(index, 1e-3, 1024, 512)
"""


def record(directory: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-c", RECORD, *args], env={**os.environ, multiprocess.ENV: directory},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # the process is gone; its files stay


@pytest.fixture
def pod_dir():
    path = multiprocess.create_dir()
    yield path
    multiprocess.remove_dir(path)
    assert not os.path.exists(path)


def test_processes_of_a_pod_aggregate_into_one_exposition(pod_dir):
    for args in (("ffn", "0"), ("ffn", "1"), ("scheduler", "0", "static"), ("scheduler", "0", "afore"), ("attention", "0")):
        record(pod_dir, *args)
    text = multiprocess.aggregate(pod_dir).decode()
    snap = Snapshot.parse(text)
    assert snap.total("afore_ffn_targets_total") == 6
    assert snap.total("afore_ffn_copies_total", worker="1") == 3
    assert snap.total("afore_ffn_tile_imbalance_count", layer="0") == 6    # worker 0 only: 3 targets x 2 placements
    assert snap.total("afore_scheduler_plans_total", policy="static") == 1  # a replaced scheduler keeps its totals
    assert snap.total("afore_scheduler_plans_total") == 2
    assert snap.total("afore_attention_exchange_bytes_total", direction="a2f") == 1024
    assert check_exposition(text) == []
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool not found on PATH: install Debian's prometheus package (apt-get install prometheus)")
    out = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_a_dead_process_leaves_its_live_gauges(pod_dir):
    env = {**os.environ, multiprocess.ENV: pod_dir}
    code = "from afore.scheduler.metrics import SchedulerMetrics; import sys; SchedulerMetrics(policy='eplb'); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, text=True)
    try:
        text = ""
        for _ in range(200):
            text = multiprocess.aggregate(pod_dir).decode()
            if 'afore_scheduler_policy{policy="eplb"}' in text:
                break
            time.sleep(0.05)
        assert 'afore_scheduler_policy{policy="eplb"} 1.0' in text
    finally:
        proc.communicate("", timeout=60)
    multiprocess.mark_dead(proc.pid, pod_dir)
    assert "afore_scheduler_policy{" not in multiprocess.aggregate(pod_dir).decode()
