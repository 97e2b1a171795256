"""``afore bench dataplane --part pipeline``: the data plane end to end, without vLLM.

One attention end in this process (the shm transport, on ``--device``) drives F real FFN worker
processes (``afore.ffn.worker``: the shm transport, primary-only plans, no scheduler) through
decode steps shaped as the serving proxy makes them: per step L MoE layers, each split into M
microbatch targets that are all posted before the first reply is awaited. Inputs are random
(uniform routing over the experts) on a random-weight checkpoint written here at the shapes
given (default on CUDA: Qwen3-30B-A3B's experts, hidden 2048, 128 experts of 768, top-8).

Measured, per token count T (tokens per layer call, split over the M targets):

- the layer round trip on the attention side (first send -> last sum on its device);
- the FFN workers' stage stamps (``AFORE_STAGE_TRACE``, ``afore.ffn.stages``): take-up delay,
  plan, compute (host), the GPU time of the compute (CUDA events), vote, publish; and each
  worker's busy fraction (taken up -> published, over the measured window);
- bytes each way per layer against the minimum (the pairs' rows x H x dtype, plus ids/weights).

This is what a decode step of ``afore serve`` costs in the data plane alone (no attention
compute, no scheduler), and where it goes; ``--part transport --serve`` measures the served ITL.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {  # hidden, experts, moe intermediate, top-k
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "small": (256, 32, 128, 4),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--part pipeline")
    g.add_argument("--pipe-shape", choices=sorted(SHAPES), default=None,
                   help="expert shapes (default: qwen3-30b-a3b on CUDA, small on the CPU)")
    g.add_argument("--pipe-layers", type=int, default=4, help="MoE layers per step")
    g.add_argument("--pipe-ffn", type=int, default=2, help="FFN worker processes")
    g.add_argument("--pipe-microbatches", type=int, default=2, help="targets per layer call")
    g.add_argument("--pipe-tokens", default="1,8,64", help="tokens per layer call, comma-separated")
    g.add_argument("--pipe-steps", type=int, default=100, help="measured decode steps per token count")
    g.add_argument("--pipe-warmup", type=int, default=10, help="decode steps before measuring")
    g.add_argument("--pipe-dtype", choices=("bfloat16", "float32"), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    g.add_argument("--pipe-schedule", choices=("serial", "pingpong"), default="serial",
                   help="serial: a layer's M targets posted, then all awaited; pingpong: the runtime's ping-pong order "
                        "(microbatch b's next layer waits only for its own reply; the step drains at its end)")
    g.add_argument("--pipe-attention-us", type=float, default=0.0,
                   help="emulated attention compute before each target's post (us; a host sleep on the CPU, a GPU "
                        "spin kernel on CUDA): with it above zero the FFN busy share measures the pipeline's bubble")


def write_checkpoint(path: Path, hidden: int, experts: int, inter: int, top_k: int, layers: int, dtype: torch.dtype,
                     seed: int) -> Path:
    """A qwen3_moe checkpoint holding only what FFN workers load: config.json and the fused
    routed experts of every layer (random, scaled so that activations stay O(1))."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        tensors[f"{prefix}.gate_up_proj"] = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
        tensors[f"{prefix}.down_proj"] = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": layers,
              "hidden_size": hidden, "num_experts": experts, "moe_intermediate_size": inter,
              "num_experts_per_tok": top_k, "vocab_size": 1024, "norm_topk_prob": True,
              "dtype": {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _routing(n: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.rand(n, experts, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
    w = torch.rand(n, top_k, generator=gen)
    return ids, w / w.sum(dim=1, keepdim=True)


def _pct(values, q) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def measure(args: argparse.Namespace, device: torch.device, log=print) -> dict:
    """Run the bench (ValueError naming a bad option before anything starts); the checkpoint
    written for it is removed at the end."""
    shape_name = args.pipe_shape or ("qwen3-30b-a3b" if device.type == "cuda" else "small")
    hidden, experts, inter, top_k = SHAPES[shape_name]
    dtype_name = args.pipe_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    tokens_list = [int(t) for t in str(args.pipe_tokens).split(",") if t.strip()]
    if not tokens_list or min(tokens_list) < 1:
        raise ValueError(f"--pipe-tokens: expected positive token counts, got {args.pipe_tokens!r}")
    layers, f, m = args.pipe_layers, args.pipe_ffn, args.pipe_microbatches
    for name, value in (("--pipe-layers", layers), ("--pipe-ffn", f), ("--pipe-microbatches", m),
                        ("--pipe-steps", args.pipe_steps)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")
    if getattr(args, "pipe_schedule", "serial") not in ("serial", "pingpong"):
        raise ValueError(f"--pipe-schedule: expected serial or pingpong, got {args.pipe_schedule!r}")
    if not float(getattr(args, "pipe_attention_us", 0.0)) >= 0:
        raise ValueError(f"--pipe-attention-us: expected >= 0, got {args.pipe_attention_us}")
    work = Path(tempfile.mkdtemp(prefix="afore-pipeline-"))
    t0 = time.monotonic()
    try:
        return _measure(args, device, log, work, t0, shape_name, dtype_name, dtype, tokens_list)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint: GBs at the GPU shapes


def _measure(args, device, log, work, t0, shape_name, dtype_name, dtype, tokens_list) -> dict:
    from afore.ffn.worker import FFNWorkerConfig, start_ffn_workers, stop_ffn_workers
    from afore.metrics.trace import TRACE_ENV
    from afore.plan import Target
    from afore.transport.shm import ShmAttentionEnd, ShmLayout, ShmSegment

    hidden, experts, inter, top_k = SHAPES[shape_name]
    layers, f, m = args.pipe_layers, args.pipe_ffn, args.pipe_microbatches
    model = write_checkpoint(work / "model", hidden, experts, inter, top_k, layers, dtype, args.seed)
    log(f"checkpoint: {shape_name} x {layers} layers, {dtype_name}, written in {time.monotonic() - t0:.1f} s")
    max_tokens = -(-max(tokens_list) // m)
    layout = ShmLayout(num_attention=1, num_ffn=f, hidden=hidden, top_k=top_k, max_tokens=max_tokens, dtype=dtype_name, depth=max(2, m))
    segment = f"afore-pipe-{os.getpid()}"
    seg = ShmSegment.create(segment, layout)
    port = _free_port()
    store = None
    if device.type == "cuda":  # the store afore serve hosts for the pools' CUDA IPC handles
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    trace = work / "stages"
    os.environ[TRACE_ENV] = str(trace)
    procs = start_ffn_workers([FFNWorkerConfig(rank=r, num_ffn=f, num_attention=1, model=str(model), port=port,
                                               device=device.type, dtype=dtype_name, shm_segment=segment,
                                               max_tokens=max_tokens, depth=layout.depth, timeout_s=600)
                               for r in range(f)])
    os.environ.pop(TRACE_ENV, None)
    results = []
    try:
        end = ShmAttentionEnd(segment, layout, 0, device, timeout_s=900)
        log(f"{f} FFN workers up after {time.monotonic() - t0:.1f} s")
        gen = torch.Generator().manual_seed(args.seed)
        step, seq = 0, 0
        schedule = getattr(args, "pipe_schedule", "serial")
        attention_us = float(getattr(args, "pipe_attention_us", 0.0))
        spin_cycles = 0
        if device.type == "cuda" and attention_us > 0:  # torch.cuda._sleep spins for cycles: calibrate once
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(1_000_000)
            b.record()
            b.synchronize()
            spin_cycles = int(1_000_000 * attention_us / 1e3 / max(a.elapsed_time(b), 1e-6))

        def attention() -> None:
            """The emulated attention of one microbatch before its post."""
            if attention_us <= 0:
                return
            if device.type == "cuda":
                torch.cuda._sleep(spin_cycles)
            else:
                time.sleep(attention_us / 1e6)
        for tokens in tokens_list:
            bounds = [tokens * b // m for b in range(m + 1)]
            inputs = []
            for _ in range(8):  # a few distinct inputs, cycled
                ids, w = _routing(tokens, experts, top_k, gen)
                inputs.append((torch.randn(tokens, hidden, generator=gen).to(device, dtype), ids.to(device), w.to(device)))
            out = torch.empty(tokens, hidden, dtype=dtype, device=device)
            layer_ns, step_ns, first_seq = [], [], None
            sent0, recv0 = end.bytes_sent, end.bytes_received
            for s in range(args.pipe_warmup + args.pipe_steps):
                measured = s >= args.pipe_warmup
                if measured and first_seq is None:
                    first_seq, sent0, recv0 = seq, end.bytes_sent, end.bytes_received
                step_start = time.perf_counter_ns()
                pending: list = [None] * m  # ping-pong: each microbatch's target in flight
                for layer in range(layers):
                    x, ids, w = inputs[(s * layers + layer) % len(inputs)]
                    start = time.perf_counter_ns()
                    handles = []
                    for b in range(m):
                        lo, hi = bounds[b], bounds[b + 1]
                        if schedule == "pingpong" and pending[b] is not None:  # its previous layer's reply
                            plo, phi, ph = pending[b]
                            out[plo:phi] = end.recv(ph)
                        attention()
                        handles.append((lo, hi, end.send(Target(step, layer, b), seq, x[lo:hi], ids[lo:hi], w[lo:hi])))
                        seq += 1
                        pending[b] = handles[-1]
                    if schedule == "serial":
                        for lo, hi, h in handles:
                            out[lo:hi] = end.recv(h)
                        pending = [None] * m
                    if device.type == "cuda":
                        torch.cuda.current_stream(device).synchronize()
                    if measured:
                        layer_ns.append(time.perf_counter_ns() - start)
                for b in range(m):  # ping-pong: the step drains (vLLM samples the whole batch)
                    if pending[b] is not None:
                        plo, phi, ph = pending[b]
                        out[plo:phi] = end.recv(ph)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                if measured:
                    step_ns.append(time.perf_counter_ns() - step_start)
                step += 1
            n_layers = args.pipe_steps * layers
            pairs = tokens * top_k
            es = torch.empty(0, dtype=dtype).element_size()
            results.append({
                "tokens": tokens, "targets_per_layer": m, "seq_range": [first_seq, seq],
                "layer_us": {"p50": _pct(layer_ns, 50) / 1e3, "p90": _pct(layer_ns, 90) / 1e3, "p99": _pct(layer_ns, 99) / 1e3,
                             "mean": float(np.mean(layer_ns)) / 1e3},
                "step_us": {"p50": _pct(step_ns, 50) / 1e3, "p99": _pct(step_ns, 99) / 1e3},
                "bytes_per_layer": {"a2f": (end.bytes_sent - sent0) / n_layers, "f2a": (end.bytes_received - recv0) / n_layers,
                                    "min_rows_each_way": pairs * hidden * es, "routing": pairs * 8},
            })
            r = results[-1]
            log(f"T={tokens:5d}: layer p50 {r['layer_us']['p50']:8.1f} us, p99 {r['layer_us']['p99']:8.1f} us; "
                f"step p50 {r['step_us']['p50'] / 1e3:7.2f} ms")
        end.close()
    finally:
        stop_ffn_workers(procs, timeout_s=30)
        seg.close()
        del store
    for r in results:
        r["ffn"] = ffn_stages(trace, f, *r["seq_range"])
    return {"shape": {"name": shape_name, "hidden": hidden, "experts": experts, "intermediate": inter, "top_k": top_k,
                      "layers": layers, "dtype": dtype_name},
            "ffn_workers": f, "microbatches": m, "steps": args.pipe_steps, "warmup": args.pipe_warmup,
            "schedule": schedule, "attention_us": attention_us,
            "device": str(device), "results": results}


FFN_STAGES = (  # name, from column, to column (the FFN trace, afore.ffn.stages)
    ("posted -> taken up", "arrived_ns", "start_ns"),
    ("plan read and checked", "start_ns", "plan_ns"),
    ("rows gathered (GPU workers)", "plan_ns", "rows_ns"),
    ("compute (host, to rows back)", "plan_ns", "computed_ns"),
    ("vote", "computed_ns", "agreed_ns"),
    ("metrics", "agreed_ns", "sent_ns"),
    ("reply publish", "sent_ns", "published_ns"),
)


def ffn_stages(trace: Path, num_ffn: int, lo_seq: int, hi_seq: int) -> dict:
    """Median us of every FFN stage over targets [lo_seq, hi_seq), the GPU time of the compute,
    and each worker's busy fraction (taken up -> published, over its first take-up to last publish;
    ``compute_busy``: its expert compute alone over the same span)."""
    from afore.metrics.trace import read_trace

    out = {"stages_us": {}, "busy": [], "compute_busy": []}
    samples = {name: [] for name, _, _ in FFN_STAGES}
    device = []
    for rank in range(num_ffn):
        path = trace.parent / f"{trace.name}.ffn{rank}.csv"
        if not path.exists():
            continue
        rows = [r for r in read_trace(path) if lo_seq <= r["seq"] < hi_seq]
        if not rows:
            continue
        for name, a, b in FFN_STAGES:
            samples[name].extend(r[b] - r[a] for r in rows if r[a] and r[b])
        device.extend(r["device_ns"] for r in rows if r["device_ns"])
        span = max(r["published_ns"] for r in rows) - min(r["start_ns"] for r in rows)
        out["busy"].append(sum(r["published_ns"] - r["start_ns"] for r in rows) / max(1, span))
        # the expert compute alone (no plan read, vote wait or publish) over the same span
        out["compute_busy"].append(sum(r["computed_ns"] - r["plan_ns"] for r in rows if r["computed_ns"]) / max(1, span))
    for name, values in samples.items():
        if values:
            out["stages_us"][name] = _pct(values, 50) / 1e3
    if device:
        out["stages_us"]["compute on the GPU (events)"] = _pct(device, 50) / 1e3
    return out


def markdown(r: dict, command: str) -> str:
    s = r["shape"]
    lines = [f"# Data plane end to end without vLLM (`--part pipeline`)", "",
             f"Command: `{command}`  ", f"Date: {r['date']}  ", f"Hardware: {r['hardware']}  ",
             f"All figures measured. Shapes: {s['name']} (hidden {s['hidden']}, {s['experts']} experts of {s['intermediate']}, "
             f"top-{s['top_k']}), {s['layers']} MoE layers, {s['dtype']}; A = 1 attention end (this process, {r['device']}), "
             f"F = {r['ffn_workers']} FFN worker processes, shm transport, primary-only plans, M = {r['microbatches']} targets "
             f"per layer call, {r['steps']} measured steps after {r['warmup']}; schedule {r.get('schedule', 'serial')}, "
             f"emulated attention {r.get('attention_us', 0.0):.0f} us per target before its post "
             f"({'a GPU spin kernel' if r['device'].startswith('cuda') else 'a host sleep: the attention runs elsewhere'}). "
             "In ping-pong the layer time is from its first post to its last (the replies are awaited by the next layer).", "",
             "| tokens | layer p50 us | layer p99 us | step p50 ms | A2F B/layer | F2A B/layer | min rows B | FFN busy | FFN compute busy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in r["results"]:
        b = x["bytes_per_layer"]
        busy = ", ".join(f"{v:.0%}" for v in x["ffn"]["busy"])
        cbusy = ", ".join(f"{v:.0%}" for v in x["ffn"].get("compute_busy", []))
        lines.append(f"| {x['tokens']} | {x['layer_us']['p50']:.0f} | {x['layer_us']['p99']:.0f} | {x['step_us']['p50'] / 1e3:.2f} | "
                     f"{b['a2f']:.0f} | {b['f2a']:.0f} | {b['min_rows_each_way']} | {busy} | {cbusy or '-'} |")
    lines += ["", "FFN stages per target (medians over workers and targets, us):", "",
              "| tokens | " + " | ".join(n for n, _, _ in FFN_STAGES) + " | compute on the GPU |",
              "|---|" + "---|" * (len(FFN_STAGES) + 1)]
    for x in r["results"]:
        st = x["ffn"]["stages_us"]
        cells = [f"{st[n]:.0f}" if n in st else "-" for n, _, _ in FFN_STAGES]
        gpu = st.get("compute on the GPU (events)")
        lines.append(f"| {x['tokens']} | " + " | ".join(cells) + f" | {'-' if gpu is None else f'{gpu:.0f}'} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu")
    r = measure(args, device, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    r["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    r["hardware"] = f"{gpu + ', ' if gpu else ''}{os.cpu_count()} CPU cores, {platform.machine()}, torch {torch.__version__}"
    command = "afore " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "afore" else " ".join(sys.argv)
    r["command"] = command
    out_dir = Path(args.out_dir or Path(__file__).resolve().parents[3] / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"dataplane_pipeline_{'h200' if 'H200' in gpu else device.type}"
    (out_dir / f"{name}.json").write_text(json.dumps(r, indent=1))
    (out_dir / f"{name}.md").write_text(markdown(r, command))
    print(markdown(r, command))
    return 0
