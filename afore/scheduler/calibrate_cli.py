"""`afore calibrate`: write the cost-model calibration of one expert shape on one device.

    afore calibrate --from-report bench/results/migration.json --hidden 2048 --intermediate 768
    afore calibrate --measure --hidden 2048 --intermediate 768 --dtype bfloat16 --device cpu

The file lands where ``afore serve`` and ``afore scheduler`` look for it
(``~/.cache/afore/calibration/<device>-<shape>.json``, see ``afore.scheduler.calibration``), or
at ``--out``. ``--show PATH`` prints a calibration file.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from afore.scheduler.calibration import (DTYPE_BYTES, ExpertShape, from_migration_report, measure_local,
                                         read_calibration, write_calibration)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-report", metavar="PATH", help="an `afore bench migration` report (migration.json)")
    src.add_argument("--measure", action="store_true", help="measure GEMM time per tile and copy cost here (~1 s)")
    src.add_argument("--show", metavar="PATH", help="print a calibration file and exit")
    parser.add_argument("--hidden", type=int, help="hidden size H of the model")
    parser.add_argument("--intermediate", type=int, help="intermediate size I of one routed expert")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="expert weight dtype")
    parser.add_argument("--m-tile", type=int, default=16, help="grouped-GEMM M tile (rows per tile)")
    parser.add_argument("--device", default="cpu", help="--measure: torch device (cpu, cuda, cuda:1)")
    parser.add_argument("--repeats", type=int, default=20, help="--measure: timed calls per figure (median)")
    parser.add_argument("--window-ms", type=float, default=None,
                        help="--measure: lookahead window to start from (default: CostModel's; the FFN workers feed the real one back)")
    parser.add_argument("--out", default=None, help="write here instead of the lookup path")


def run(args: argparse.Namespace) -> int:
    try:
        if args.show:
            print(msgspec.json.format(msgspec.json.encode(read_calibration(args.show)), indent=1).decode())
            return 0
        if args.hidden is None or args.intermediate is None:
            raise ValueError("hidden, intermediate: expected --hidden and --intermediate (the expert shape)")
        if args.repeats < 1:
            raise ValueError(f"repeats: expected >= 1, got {args.repeats}")
        expert = ExpertShape(args.hidden, args.intermediate, args.dtype, args.m_tile)
        if args.from_report:
            calibration = from_migration_report(args.from_report, expert)
        else:
            print(f"afore calibrate: measuring {expert.slug} on {args.device} ...", file=sys.stderr)
            calibration = measure_local(expert, args.device, args.repeats, args.window_ms)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"afore calibrate: {exc}", file=sys.stderr)
        return 2
    path = write_calibration(calibration, args.out)
    c = calibration.cost
    print(f"{calibration.device}, {expert.slug} ({calibration.source}): beta_tile {c.beta_tile_ms:.4g} ms, "
          f"copy {c.copy_ms:.4g} ms per expert ({c.link_bandwidth_gbps:.4g} GB/s, latency {c.copy_latency_ms:.4g} ms), "
          f"window {c.window_ms:.4g} ms")
    print(f"wrote {path}" + ("" if args.out else " (where afore serve and afore scheduler look for this device and shape)"))
    return 0
