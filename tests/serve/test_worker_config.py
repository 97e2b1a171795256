"""One source of truth for the FFN workers' configuration: the launcher computes the pool's
ClusterShape once and hands each worker its whole FFNWorkerConfig as msgspec JSON."""

from __future__ import annotations

import argparse

import msgspec
import pytest
from servers import tiny

from afore.ffn import worker_cli
from afore.ffn.worker import FFNWorkerConfig, check_shape_fits
from afore.serve.launcher import Launcher, ServeOptions, read_serving_spec


def _launcher(**opts) -> Launcher:
    launcher = Launcher(ServeOptions(**opts))
    launcher.model = tiny("qwen3_moe")
    launcher.spec, launcher.config = read_serving_spec(launcher.model)
    launcher.backend, launcher.dtype, launcher.store_port = "gloo", "float32", 29999
    return launcher


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_worker_config_round_trips_as_json_with_the_schedulers_shape():
    launcher = _launcher(ffn_workers=2, redundant_slots=3)
    shape = launcher.shape()
    assert launcher.shape() is shape  # computed once
    cfg = launcher.ffn_worker_config(1, "127.0.0.1", 2)
    assert cfg.shape == shape and (cfg.rank, cfg.num_ffn, cfg.redundant_slots, cfg.m_tile) == (1, 2, 3, shape.m_tile)
    assert cfg.plan_ring == launcher.ring_name and cfg.port == 29999
    decoded = worker_cli.config_from_args(_parse(["--config-json", msgspec.json.encode(cfg).decode()]))
    assert decoded == cfg
    check_shape_fits(decoded.shape, launcher.spec, cfg.num_ffn)


def test_a_shape_for_another_model_or_pool_is_refused_naming_the_field():
    launcher = _launcher(ffn_workers=2)
    spec = launcher.spec
    wrong = msgspec.structs.replace(launcher.shape(), num_workers=1)
    with pytest.raises(ValueError, match="shape.num_workers"):
        check_shape_fits(wrong, spec, 2)
    wrong = msgspec.structs.replace(launcher.shape(), top_k=spec.top_k + 1)
    with pytest.raises(ValueError, match="shape.top_k"):
        check_shape_fits(wrong, spec, 2)


def test_worker_cli_errors_name_the_field():
    with pytest.raises(ValueError, match="config_json"):
        worker_cli.config_from_args(_parse(["--config-json", '{"rank": 0}']))
    with pytest.raises(ValueError, match="--num-ffn, --num-attention, --model"):
        worker_cli.config_from_args(_parse(["--rank", "0"]))
    cfg = worker_cli.config_from_args(_parse(["--rank", "0", "--num-ffn", "2", "--num-attention", "1", "--model", "m"]))
    assert isinstance(cfg, FFNWorkerConfig) and cfg.shape is None  # standalone: the worker derives its shape


def test_cpu_workers_get_their_own_cores_and_niceness_from_the_launcher():
    """--ffn-cpus auto (the default) on cpu: worker r pinned to its block of the launcher's cores,
    round robin, at --ffn-nice; none: not pinned; cuda: neither field set."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    launcher = _launcher(ffn_workers=2)
    got = [launcher.ffn_worker_config(r, "127.0.0.1", r) for r in range(2)]
    threads = max(1, len(cores) // 3)
    assert [c.cpus for c in got] == [sorted({cores[(r * threads + j) % len(cores)] for j in range(threads)}) for r in range(2)]
    assert [c.nice for c in got] == [5, 5]
    if len(cores) >= 2:
        assert set(got[0].cpus).isdisjoint(got[1].cpus)  # two workers never share a core when there are two
    cfg = _launcher(ffn_workers=2, ffn_cpus="none", ffn_nice=0).ffn_worker_config(1, "127.0.0.1", 1)
    assert (cfg.cpus, cfg.nice) == ([], 0)
    cfg = _launcher(ffn_workers=3, ffn_cpus=str(cores[0])).ffn_worker_config(2, "127.0.0.1", 2)
    assert cfg.cpus == [cores[0]]  # a one-core list: every worker on it
    decoded = worker_cli.config_from_args(_parse(["--config-json", msgspec.json.encode(got[1]).decode()]))
    assert decoded == got[1]


def test_ffn_cpu_options_are_checked_naming_the_field():
    import os

    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=r"ffn_cpus: cores \[%d\]" % outside):
        ServeOptions(ffn_cpus=f"0,{outside}")
    with pytest.raises(ValueError, match="ffn_cpus: expected 'auto', 'none' or core ids"):
        ServeOptions(ffn_cpus="fast")
    with pytest.raises(ValueError, match="ffn_cpus: a core list pins CPU FFN workers"):
        ServeOptions(device="cuda", ffn_cpus="0")
    with pytest.raises(ValueError, match=r"ffn_nice: expected in \[0, 19\]"):
        ServeOptions(ffn_nice=-1)
    with pytest.raises(ValueError, match="cpus: pinning is for CPU workers"):
        FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model="m", device="cuda:0", cpus=[0])
    with pytest.raises(ValueError, match="cpus: expected distinct core ids"):
        FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model="m", cpus=[0, 0])
    with pytest.raises(ValueError, match=r"nice: expected in \[0, 19\]"):
        FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model="m", nice=20)
