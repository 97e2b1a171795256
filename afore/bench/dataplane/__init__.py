"""``afore bench dataplane --part PART``: benchmarks of the data plane, one module per part.

Parts: ``ffn`` (the FFN worker's step: partition, grouped GEMM, combine; ``afore.bench.dataplane.ffn``),
``transport`` (the A2F/F2A transports and decode through ``afore serve``; ``afore.bench.dataplane.transport``),
``pipeline`` (decode steps through real FFN worker processes without vLLM, per-stage; ``afore.bench.dataplane.pipeline``).
Each part adds its own options and writes its own report under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PARTS: dict[str, str] = {
    "ffn": "afore.bench.dataplane.ffn",
    "transport": "afore.bench.dataplane.transport",
    "pipeline": "afore.bench.dataplane.pipeline",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", choices=sorted(PARTS), required=True, help="which part of the data plane")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out-dir", default=None, help="directory of the report (default bench/results/)")
    parser.add_argument("--name", default=None, help="report name (default dataplane_<part>, _cpu on a CPU)")
    parser.add_argument("--seed", type=int, default=0)
    for module in PARTS.values():
        importlib.import_module(module).add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(PARTS[args.part]).run(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="afore bench dataplane", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
