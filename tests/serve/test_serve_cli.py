"""``afore serve``'s command line as a newcomer meets it: plain ``afore serve`` on a small CPU
machine, and a ``--help`` that documents every option with its default."""

from __future__ import annotations

import argparse
import re

import pytest
from servers import tiny

from afore.cli import build_parser
from afore.serve.cli import options_from_args
from afore.serve.launcher import check_shape, read_serving_spec


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_plain_serve_fits_two_cpu_cores():
    opts = options_from_args(build_parser().parse_args(["serve"]))
    assert (opts.device, opts.colocate, opts.attn_workers + opts.ffn_workers) == ("cpu", False, 3)
    info, _ = read_serving_spec(tiny("qwen3_moe"))
    for cores in (1, 2):  # on CPU the three workers share whatever cores there are
        check_shape(opts, info, devices=cores)


def test_more_workers_than_gpus_still_needs_colocate():
    info, _ = read_serving_spec(tiny("qwen3_moe"))
    opts = options_from_args(build_parser().parse_args(["serve", "--device", "cuda"]))
    with pytest.raises(ValueError, match="attn_workers \\+ ffn_workers: 3 workers need 3 GPUs, 2 available; pass --colocate"):
        check_shape(opts, info, devices=2)
    check_shape(opts, info, devices=3)


def test_help_documents_every_option_with_its_default():
    parser = _serve_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings[0]}: no help text"
        if action.default not in (None, "", False, []):
            assert "default" in action.help or "default" in parser.formatter_class("x")._get_help_string(action), \
                f"{action.option_strings[0]}: --help does not show its default"
    assert "(default: 8000)" in text and "(default: afore)" in text
    assert re.search(r"--admin-port.*?default 0 = --port \+ 1", text, re.S)


def test_ctrl_c_while_vllm_starts_stops_at_once():
    import time

    from afore.serve.launcher import Launcher, ServeOptions

    launcher = Launcher(ServeOptions(port=1, start_timeout_s=120.0))  # nothing answers on port 1
    launcher.request_stop()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped"):
        launcher.wait_healthy()
    assert time.monotonic() - t0 < 10
