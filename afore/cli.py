"""`afore` command line.

Each command lives with the part of the design map it belongs to; this file only
dispatches. A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("afore.serve.cli", "serve a MoE model: vLLM attention workers + afore FFN workers + scheduler"),
    "scheduler": ("afore.scheduler.service_cli", "run the scheduler service on the demand mailbox"),
    "ffn-worker": ("afore.ffn.worker_cli", "run one FFN worker"),
    "plan": ("afore.scheduler.plan_cli", "plan one target from a demand and a state (JSON/NPZ) and write the plan as JSON"),
    "trace": ("afore.traces.cli", "convert, generate and inspect routing traces"),
    "status": ("afore.scheduler.status_cli", "show the control plane's segments and metrics"),
    "calibrate": ("afore.scheduler.calibrate_cli", "write the cost-model calibration of an expert shape on a device (from a migration report or measured here)"),
    "profile": ("afore.affinity.cli", "profile expert affinity (co-activation per layer) and co-cluster primaries"),
    "route": ("afore.serve.router_proxy", "HTTP front of afore serve that routes requests to attention engines by token cost"),
}

BENCHMARKS: dict[str, tuple[str, str]] = {
    "scheduler": ("afore.bench.scheduler", "scheduler latency and plan quality against the MILP optimum"),
    "transport": ("afore.bench.transport", "demand mailbox and plan ring latency"),
    "migration": ("afore.bench.migration", "expert copy cost, overlap and grouped-GEMM time (GPU)"),
    "serve": ("afore.bench.serve", "throughput, TTFT and ITL per policy through the HTTP API"),
    "ab": ("afore.bench.ab", "A/B of every placement policy on one trace: simulated AFD pipeline calibrated by GPU measurements"),
    "affinity": ("afore.bench.affinity", "co-clustered primaries under afore (fan-out, bytes, tile load) and token-cost request routing (TTFT/TPOT)"),
    "dataplane": ("afore.bench.dataplane", "data-plane parts (--part ffn: the FFN step against its floors and vLLM's fused_moe)"),
    "faults": ("afore.bench.faults", "serving while the scheduler is killed, hung or dead: ITL against static, outage, /health"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    parser = sub.add_parser(name, help=help_, description=help_)
    parser.set_defaults(_module=module)
    try:
        importlib.import_module(module).add_arguments(parser)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        parser.set_defaults(_missing=module)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        _add(sub, name, module, help_)
    bench = sub.add_parser("bench", help="benchmarks (results under bench/results/)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True)
    for name, (module, help_) in BENCHMARKS.items():
        _add(bench_sub, name, module, help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"afore: {args._missing} is not available in this build", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except BrokenPipeError:  # output piped into a reader that closed early (`afore ... | head`)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
