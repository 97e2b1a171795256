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
