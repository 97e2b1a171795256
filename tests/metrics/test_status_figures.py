"""`afore status --watch/--plot`: figures from two scrapes, the live view, and the PNGs."""

import os
import threading

import numpy as np
import pytest
from prometheus_client import start_http_server

from afore.config import ClusterShape
from afore.ffn.metrics import FFNMetrics
from afore.metrics.figures import Snapshot, figures
from afore.migrator.migrator import MigrationRecord
from afore.plan import Target, primary_only_plan
from afore.scheduler import status_cli
from afore.scheduler.metrics import SchedulerMetrics

SHAPE = ClusterShape(num_experts=4, num_workers=2, num_layers=2, m_tile=4, top_k=1, redundant_slots=1)


def plan(step: int, layer: int, tile_load):
    """A scheduler plan of demand [8, 0, 4, 4] (primary-only tile load [2, 2]) with ``tile_load``."""
    p = primary_only_plan(SHAPE, np.array([8, 0, 4, 4]), Target(step, layer, 0), step * 2 + layer)
    p.primary_only = False
    p.tile_load = np.array(tile_load, np.int32)
    return p


def test_figures_are_rates_and_means_over_the_interval():
    ffn, sched = FFNMetrics(0, SHAPE), SchedulerMetrics(policy="afore", shape=SHAPE)
    before = Snapshot.parse(ffn.render() + sched.render(), t=10.0)
    for seq in range(4):
        ffn.observe(MigrationRecord(seq, 2, 1000, 1.0, 0.5, 4.0))
        ffn.observe_target(plan(seq, 0, [3, 2]), 0.001, 0)
    sched.observe_plan(plan(0, 1, [3, 1]))
    sched.publish_latency.observe(3e-5)
    after = Snapshot.parse(ffn.render() + sched.render(), t=12.0)
    f = figures(before, after)
    assert f["policy"] == "afore"
    assert f["copies_per_s"] == pytest.approx(8 / 2.0)
    assert f["copy_bytes_per_s"] == pytest.approx(4000 / 2.0)
    assert f["copy_s"] == pytest.approx(1e-3) and f["exposed_s"] == pytest.approx(5e-4)
    assert f["window_s"] == pytest.approx(4e-3)
    assert f["plans_per_s"]["used"] == pytest.approx(2.0) and f["plans_per_s"]["missed"] == 0
    assert f["demand_to_plan_s"] == pytest.approx(3e-5)
    assert f["f2a_wait_s"] is None                               # nothing recorded it
    # demand [8, 0, 4, 4] -> tiles [2, 0, 1, 1] -> primary-only [2, 2] = 1.0
    assert f["imbalance"][0] == {"plan": pytest.approx(1.2), "primary_only": pytest.approx(1.0)}
    assert f["imbalance"][1]["plan"] == pytest.approx(1.5)       # the scheduler's planned figure
    same = figures(after, after)
    assert same["copies_per_s"] is None and same["copy_s"] is None


@pytest.fixture
def endpoint():
    ffn = FFNMetrics(0, SHAPE)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=ffn.registry)
    stop = threading.Event()

    def serve_traffic():
        seq = 0
        while not stop.wait(0.05):
            ffn.observe(MigrationRecord(seq, 1, 4096, 0.2, 0.0, 1.0))
            ffn.observe_target(plan(seq, seq % 2, [2, 1 + seq % 2]), 0.001, 1)
            seq += 1

    thread = threading.Thread(target=serve_traffic, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    stop.set()
    thread.join()
    server.shutdown()


def test_watch_and_plot_write_balance_and_migration(endpoint, tmp_path, capsys):
    args = status_cli_args(["--watch", "--plot", str(tmp_path / "plots"), "--metrics", endpoint,
                            "--interval", "0.25", "--duration", "2"])
    assert status_cli.run(args) == 0
    out = capsys.readouterr().out
    assert "max/mean plan" in out and "copies / s" in out        # the live view was drawn
    for name in ("balance.png", "migration.png", "figures.json"):
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 0
    with open(tmp_path / "plots" / "balance.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    import json

    history = json.loads((tmp_path / "plots" / "figures.json").read_text())
    assert len(history) >= 2 and any((h["copies_per_s"] or 0) > 0 for h in history)
    assert {"0", "1"} <= set(history[-1]["imbalance"])


def test_unreachable_endpoint_and_bad_arguments_are_clear_errors(capsys):
    assert status_cli.run(status_cli_args(["--watch", "--metrics", "http://127.0.0.1:1/metrics", "--duration", "1"])) == 1
    assert "metrics: cannot read http://127.0.0.1:1/metrics" in capsys.readouterr().err
    assert status_cli.run(status_cli_args(["--plot", "x", "--interval", "0"])) == 2
    assert "interval: expected > 0" in capsys.readouterr().err


def status_cli_args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    status_cli.add_arguments(parser)
    return parser.parse_args(argv)
