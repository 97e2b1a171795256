"""The command line of ``afore bench migration``: options, the part sequence, the peer process."""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from afore.bench.migration.copies import bench_copies
from afore.bench.migration.gemm import bench_kernels
from afore.bench.migration.overlap import bench_overlap
from afore.bench.migration.replay import bench_replay
from afore.bench.migration.report import judge_targets, measured_cost_model, report_figure, report_markdown
from afore.bench.migration.shapes import COST_MODEL_SHAPE, CPU_SHAPES, MODEL_SHAPES, source_pools
from afore.bench.migration.worker import bench_worker
from afore.config import CostModel
from afore.migrator.peers import open_tensors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out-dir", default=None, help="directory of the report (default bench/results/)")
    parser.add_argument("--name", default=None, help="report name (default migration, or migration_1gpu with one GPU)")
    parser.add_argument("--parts", default="kernels,copies,overlap,replay", help="comma-separated subset of the parts")
    parser.add_argument("--workers-per-model", type=int, default=8, help="F used to size a worker's slots (E/F + R)")
    parser.add_argument("--redundant-slots", type=int, default=4)
    parser.add_argument("--replay-steps", type=int, default=48)
    parser.add_argument("--replay-layers", type=int, default=4)
    parser.add_argument("--replay-tokens", type=int, default=256, help="tokens per microbatch in the replay")
    parser.add_argument("--trace", default=None, help="routing trace (.npz, afore trace format); default: synthetic Qwen3-30B-A3B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="checkpoint for the 'worker' part (FFN worker processes end to end)")
    parser.add_argument("--worker-targets", type=int, default=48, help="targets sent through the FFN workers")
    parser.add_argument("--worker-backends", default="gloo,nccl,ffn-node",
                        help="rounds of the 'worker' part: gloo, nccl (GPUs only), ffn-node (afore serve --role ffn)")



def run(args: argparse.Namespace) -> int:
    from afore.bench.report import write_report

    if args.device == "cuda" and not torch.cuda.is_available():
        print("afore bench migration: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    device = torch.device("cuda:0" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"kernels", "copies", "overlap", "replay", "worker"}
    if unknown:
        raise ValueError(f"--parts: expected a subset of kernels,copies,overlap,replay,worker, got {sorted(unknown)}")
    if args.redundant_slots < 1:
        raise ValueError(f"--redundant-slots: expected >= 1, got {args.redundant_slots}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = MODEL_SHAPES if device.type == "cuda" else CPU_SHAPES
    name = args.name or ("migration_1gpu" if gpus == 1 else "migration")
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    data: dict = {"device": torch.cuda.get_device_name(device) if gpus else "cpu", "gpus": gpus, "dtype": str(dtype)}
    if "kernels" in parts:
        data["kernels"] = bench_kernels(shapes, args, device, dtype, rng)

    cross = gpus >= 2 or device.type == "cpu"
    peer_device = "cuda:1" if gpus >= 2 else str(device)
    big_bytes = (1 << 30) if device.type == "cuda" else (1 << 24)
    ctx = torch.multiprocessing.get_context("spawn")
    peer_conn, child_conn = ctx.Pipe()
    peer = None
    need_peer = bool(parts & {"copies", "overlap", "replay"})
    if need_peer:
        if cross:
            from afore.bench.migration.peer import peer_entry  # spawned: picklable by module name

            peer = ctx.Process(target=peer_entry, args=(peer_device, shapes, 16, big_bytes, child_conn), daemon=True)
            peer.start()
            handles = peer_conn.recv()
            src_pools = {n: tuple(open_tensors(b)) for n, b in handles["pools"].items()}
            (big_src,) = open_tensors(handles["big"])
        else:
            src_pools = source_pools(shapes, 16, device, dtype, seed=1)
            big_src = torch.empty(big_bytes, dtype=torch.uint8, device=device).fill_(7)
    try:
        if "copies" in parts:
            data["copies"] = bench_copies(shapes, src_pools, big_src, device, dtype, cross)
            if device.type == "cuda":
                data["copies_variants"] = {
                    "cuMemcpyAsync, 1 stream": bench_copies(shapes, src_pools, big_src, device, dtype, cross, streams=1, batch_api=False),
                    "cuMemcpyAsync, 2 streams": bench_copies(shapes, src_pools, big_src, device, dtype, cross, streams=2, batch_api=False),
                    "cuMemcpyAsync, 4 streams": bench_copies(shapes, src_pools, big_src, device, dtype, cross, streams=4, batch_api=False),
                    "Tensor.copy_": bench_copies(shapes, src_pools, big_src, device, dtype, cross, use_driver=False, streams=1)}
        if "overlap" in parts:
            data["overlap"] = bench_overlap(shapes, src_pools, args, device, dtype, rng)
        cost = measured_cost_model(data, shapes)
        if "replay" in parts and cross:
            data["replay"] = bench_replay(args, device, peer_conn, cost, cost.copy_ms)
            cost = measured_cost_model(data, shapes)
        if "worker" in parts:
            def write_partial(wk: dict) -> None:
                data["worker"] = wk
                write_report(name, data, report_markdown(data), None, out_dir=args.out_dir)

            wk = bench_worker(args, device, gpus, rng, write_partial)
            if wk:
                data["worker"] = wk
        if parts & {"kernels", "copies", "replay"}:  # a worker-only run measures no cost figures
            data["cost_model"] = {f: getattr(cost, f) for f in CostModel.__struct_fields__}
            data["cost_model_shape"] = COST_MODEL_SHAPE if device.type == "cuda" else "tiny-a"
        data["targets"] = judge_targets(data)
    finally:
        if peer is not None:
            if peer.is_alive():
                peer_conn.send("exit")
            peer.join(timeout=30)
            if peer.is_alive():
                peer.terminate()
    paths = write_report(name, data, report_markdown(data), report_figure(data), out_dir=args.out_dir)
    print(report_markdown(data))
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0



def main(argv: list[str] | None = None) -> int:
    """``python -m afore.bench.migration`` = ``afore bench migration`` without the other commands' imports
    (the GPU hosts lack the serving dependencies)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="afore bench migration", description="expert copy cost, copy/compute overlap and grouped-GEMM time")
    add_arguments(parser)
    args = parser.parse_args(argv)
    sys.argv = ["afore", "bench", "migration", *argv]  # recorded in the report as the equivalent command
    return run(args)
