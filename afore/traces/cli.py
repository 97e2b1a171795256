"""`afore trace`: convert measured traces, generate synthetic ones, and print their statistics.

  afore trace convert [--src DIR] [--model switch128|qwen] --out-dir DIR
  afore trace synth --workload chat [--seed N --steps S --layers L ...] --out FILE.npz
  afore trace info FILE.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from afore.traces import format as trace_format
from afore.traces import harmoeny, synthetic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", required=True)
    conv = sub.add_parser("convert", help="convert the HarMoEny CSVs into afore .npz traces (one per dataset)")
    conv.add_argument("--src", default=None, help="HarMoEny data folder (default: ../shared/traces/harmoeny)")
    conv.add_argument("--model", choices=sorted(harmoeny.MODELS), default="switch128")
    conv.add_argument("--layers", default=None, help="comma-separated layer_idx values to keep (default: model's)")
    conv.add_argument("--out-dir", required=True)
    syn = sub.add_parser("synth", help="generate a seeded synthetic trace")
    syn.add_argument("--workload", default="chat", help=f"workload name (the standard set: {', '.join(synthetic.WORKLOADS)})")
    defaults = synthetic.SyntheticSpec()
    for name in ("seed", "steps", "num_layers", "microbatches", "tokens", "top_k", "num_experts"):
        syn.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name), dest=name)
    for name in ("skew_first", "skew_last", "drift", "drift_corr", "workload_weight"):
        syn.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name), dest=name)
    syn.add_argument("--out", required=True)
    info = sub.add_parser("info", help="print a trace's shape, metadata and skew statistics")
    info.add_argument("path")


def run(args: argparse.Namespace) -> int:
    try:
        if args.trace_command == "convert":
            return _convert(args)
        if args.trace_command == "synth":
            fields = {f: getattr(args, f) for f in ("workload", "seed", "steps", "num_layers", "microbatches", "tokens", "top_k",
                                                   "num_experts", "skew_first", "skew_last", "drift", "drift_corr", "workload_weight")}
            path = trace_format.save_trace(synthetic.generate(synthetic.SyntheticSpec(**fields)), args.out)
            print(f"wrote {path}")
            return 0
        _print_info(trace_format.load_trace(args.path))
        return 0
    except ValueError as exc:
        print(f"afore trace: {exc}", file=sys.stderr)
        return 2


def _convert(args: argparse.Namespace) -> int:
    folder = harmoeny.find_harmoeny_dir(args.src)
    if folder is None:
        print("afore trace convert: HarMoEny data not found (looked in --src, $AFORE_TRACES/harmoeny, ../shared/traces/harmoeny); nothing converted",
              file=sys.stderr)
        return 2
    layers = None
    if args.layers:
        try:
            layers = tuple(int(v) for v in args.layers.split(","))
        except ValueError:
            raise ValueError(f"layers: expected comma-separated integers, got {args.layers!r}") from None
    traces = harmoeny.read_harmoeny_csv(folder / harmoeny.MODELS[args.model][0], args.model, layers)
    for dataset, trace in traces.items():
        path = trace_format.save_trace(trace, Path(args.out_dir) / f"harmoeny-{args.model}-{dataset}.npz")
        print(f"wrote {path}: counts {trace.counts.shape}")
    return 0


def _print_info(trace: trace_format.Trace) -> None:
    stats = trace_format.skew_stats(trace.counts)
    print(f"model: {trace.model}\nworkload: {trace.workload}\nsource: {trace.source}")
    print(f"counts [step, layer, microbatch, expert]: {list(trace.counts.shape)}, top_k {trace.top_k}, "
          f"hidden {trace.hidden_size}, moe intermediate {trace.moe_intermediate_size}")
    print(f"pairs per microbatch: mean {trace.counts.sum(axis=-1).mean():.0f}")
    print("layer  max/mean  TV(consecutive steps)")
    for layer in range(trace.num_layers):
        print(f"{layer:5d}  {stats['max_mean'][layer]:8.2f}  {stats['tv_consecutive'][layer]:.4f}")
