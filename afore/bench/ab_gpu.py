"""`afore bench ab --engine gpu`: every policy on the real FFN pool, driven by the traces.

What runs (all of it afore's production code, nothing simulated on the measured side):

- ``afore serve --role ffn``: the launcher, the scheduler service (its TCP demand receiver, the
  demand mailbox, the plan ring), F FFN worker processes (migrator with paced copies, grouped
  GEMM, CUDA IPC peers on GPUs), holding a routed-experts checkpoint written here with random
  weights at a real expert shape (``--gpu-model``: GLM-4.5-Air or Qwen3-30B-A3B; ``tiny`` for
  CPU tests) and ``--layers`` MoE layers;
- this process plays the attention node without vLLM: for every target of a workload (the
  HarMoEny traces in ../shared/traces, else the synthetic ones; the same arrays ``afore bench
  ab`` replays) it builds top-k ids whose per-expert counts are exactly the trace's demand, sends
  the demand over TCP (``DemandClient``) and the tokens through the real data plane
  (``--transport shm``, the default: the node's shm segment, the driver attached as its
  attention end, ``afore.transport.shm.ShmAttentionEnd``, what a vLLM attention worker of
  ``afore serve`` on one node uses; ``--transport torch``: the split roles' connector,
  ``AttentionConnector``, NCCL between distinct GPUs, gloo otherwise), serial as today's
  runtime is: a layer's M microbatches are posted, then all M replies awaited; the attention
  compute is a stated constant (``--attention-ms``, a sleep) between layer calls;
- every policy runs on the same targets in the same FFN processes (switched through the FFN
  node's admin endpoint).

Measured per policy: step time (driver timestamps), FFN stage, exposed copy wait (the FFN
workers' event timestamps, afore_ffn_exposed_copy_wait_seconds, judged over the worker-targets
that had copies), copies and bytes, max/mean tile load (afore_ffn_tile_imbalance), plans used /
missed; and per target, from the stage traces that every process writes (``AFORE_STAGE_TRACE``:
the driver's rows in the attention plugin's columns, ``PATH.ffn<rank>.csv``,
``PATH.scheduler.csv``; joined by ``ab_runtime.stage_table``): A2F latency, queue, plan wait and
decode, compute span, vote, reply, the pool's reply send, F2A latency, demand -> plan.

Simulated beside it, every column ``pipeline_sim.simulate_runtime`` in serial mode (what the
driver and today's runtime do) with the driver's attention time as input, the grouped GEMM from
the migration report's fit at each policy's tile loads, copies paced to 50 GB/s as the FFN node
ran them: (a) the committed H200 reports' stage costs (a prior, unmeasured stages 0), (b) the
stage costs of this run's own traces (``ab_runtime.stages_from_traces``, the CPU engine's
calibration; written to ``<name>_stages.json``), (c) the same from static's window alone (eplb
and afore predicted from it), (f) with ``--stage-calibration`` an earlier run's file.

On one GPU the F workers are separate processes sharing it (``--colocate``; with ``--transport
torch`` gloo staged through the host), stated in the report.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

AB_TRANSPORTS = ("shm", "torch")
GPU_MODELS = {  # name -> (hidden, expert intermediate, experts, top_k)
    "GLM-4.5-Air": (4096, 1408, 128, 8),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
    "tiny": (64, 32, 16, 4),
}


def add_arguments(group) -> None:
    group.add_argument("--gpu-model", default="Qwen3-30B-A3B", choices=sorted(GPU_MODELS),
                       help="gpu engine: expert shape of the random routed-experts checkpoint")
    group.add_argument("--ffn-workers", type=int, default=2, help="gpu engine: FFN worker processes (F)")
    group.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="gpu engine: where the FFN workers run")
    group.add_argument("--checkpoint-dir", default=None, help="gpu engine: where to write the checkpoint (default ~/.cache/afore)")
    group.add_argument("--transport", default="shm", choices=AB_TRANSPORTS,
                       help="gpu engine: the data plane between the driver and the FFN pool: shm (the one-node runtime's, "
                            "afore.transport.shm: the driver attaches as the attention end of the FFN node's segment; "
                            "default) or torch (the split roles' torch.distributed connector: NCCL on distinct GPUs, gloo "
                            "staged through the host otherwise)")


# ------------------------------------------------------------------ checkpoint


def write_expert_checkpoint(path: str | Path, hidden: int, intermediate: int, experts: int, top_k: int, layers: int,
                            dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A Qwen3-MoE-layout checkpoint holding only routed experts (fused per layer, one shard each)
    with random weights (std 0.02): what the FFN workers read (``afore.models.checkpoint``).
    Reused when ``afore-experts.json`` says it was written with the same arguments."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    marker = path / "afore-experts.json"
    args = {"hidden": hidden, "intermediate": intermediate, "experts": experts, "top_k": top_k, "layers": layers,
            "dtype": dtype, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == args:
        return path
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden,
              "num_hidden_layers": layers, "num_experts": experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": intermediate, "vocab_size": 1024, "torch_dtype": dtype, "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(seed)
    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    weight_map = {}
    for layer in range(layers):
        shard = f"experts-{layer:05d}.safetensors"
        w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) * 0.02).to(tdtype)
        w2 = (torch.randn(experts, hidden, intermediate, generator=gen) * 0.02).to(tdtype)
        names = {f"model.layers.{layer}.mlp.experts.gate_up_proj": w13, f"model.layers.{layer}.mlp.experts.down_proj": w2}
        save_file(names, str(path / shard))
        weight_map.update({n: shard for n in names})
        del w13, w2, names
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    marker.write_text(json.dumps(args))
    return path


# ------------------------------------------------------------------ routing from a trace


def ids_for_demand(demand: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """int32[tokens, top_k] routing whose per-expert pair counts are exactly ``demand`` (int[E],
    sum = tokens * top_k, each count <= tokens), no expert twice in a token: the experts' pairs
    are laid out expert by expert and pair j goes to token j mod tokens."""
    demand = np.asarray(demand, np.int64)
    if demand.sum() != tokens * top_k:
        raise ValueError(f"demand: expected {tokens * top_k} pairs (tokens x top_k), got {int(demand.sum())}")
    if demand.max(initial=0) > tokens:
        raise ValueError(f"demand: an expert has {int(demand.max())} pairs, more than the {tokens} tokens")
    experts = np.repeat(np.arange(demand.size), demand)
    ids = np.empty((tokens, top_k), np.int32)
    ids[np.arange(experts.size) % tokens, np.arange(experts.size) // tokens] = experts
    return ids


# ------------------------------------------------------------------ the FFN node and the driver


def start_ffn_node(model: str, policy: str, num_ffn: int, device: str, ports: dict, token: str, log_path: Path,
                   copy_budget: int, redundant_slots: int, microbatches: int, dtype: str, trace: Path | None = None,
                   copy_rate_gbps: float | None = None, transport: str = "torch", max_tokens: int = 0) -> subprocess.Popen:
    """``afore serve --role ffn`` in its own process group; ``trace``: AFORE_STAGE_TRACE of its
    processes (PATH.ffn<rank>.csv, PATH.scheduler.csv). ``transport`` (AB_TRANSPORTS): shm makes
    the node's shm segment (``max_tokens`` tokens per target) for a driver on this node to attach
    to; torch the split roles' torch.distributed transport."""
    from afore.config import DEFAULT_COPY_RATE_GBPS

    rate = DEFAULT_COPY_RATE_GBPS if copy_rate_gbps is None else copy_rate_gbps
    cmd = [sys.executable, "-m", "afore.cli", "serve", "--role", "ffn", "--host", "0.0.0.0", "--model", model, "--dtype", dtype,
           "--attn-workers", "1", "--ffn-workers", str(num_ffn), "--device", device, "--policy", policy,
           "--microbatches", str(microbatches),
           "--store-port", str(ports["store"]), "--demand-port", str(ports["demand"]), "--admin-port", str(ports["admin"]),
           "--copy-budget", str(copy_budget), "--redundant-slots", str(redundant_slots), "--copy-rate-gbps", f"{rate:g}"]
    if transport == "shm":
        cmd += ["--transport", "shm", "--max-num-batched-tokens", str(max_tokens)]
        if device == "cuda" and _gpus() < num_ffn:
            cmd += ["--colocate"]
    elif device == "cpu" or _gpus() < num_ffn + 1:
        cmd += ["--colocate", "--transport", "torch-gloo"]
    log = open(log_path, "ab")
    log.write(f"\n$ {' '.join(cmd)}\n".encode())
    log.flush()
    env = {**os.environ, "AFORE_DEMAND_TOKEN": token}
    if trace is not None:
        env["AFORE_STAGE_TRACE"] = str(trace)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def attention_device(transport: str, device: str, num_ffn: int) -> str:
    """Where the driver (the attention end) keeps its tensors: the host on CPU; with shm a GPU of its
    own after the FFN workers' when there is one, else the first (shared); with torch NCCL needs a
    GPU of its own, else gloo staged through the host."""
    if device == "cpu":
        return "cpu"
    gpus = _gpus()
    if transport == "shm":
        return f"cuda:{num_ffn}" if gpus > num_ffn else "cuda:0"
    return f"cuda:{num_ffn}" if gpus >= num_ffn + 1 else "cpu"


def layout_note(transport: str, device: str, num_ffn: int, attn_device: str) -> str:
    """The report's one line on where the processes ran and how tokens travelled."""
    gpus = _gpus() if device == "cuda" else 0
    where = ("sharing one device" if device == "cpu" or gpus < num_ffn else "on distinct GPUs")
    if transport == "shm":
        return (f"{num_ffn} FFN worker processes {where}, the driver's tensors on {attn_device}; shm transport "
                "(afore.transport.shm, the one-node runtime's: pinned host slots, sparse rows, C++ waits)")
    how = "NCCL" if attn_device.startswith("cuda") else "gloo staged through the host"
    return f"{num_ffn} FFN worker processes {where} ({how})"


def attach_shm_driver(admin: str, node: subprocess.Popen, device: str, timeout_s: float):
    """The driver's ShmAttentionEnd (rank 0) on the FFN node's segment, by the name and layout that
    the node's /afore/status gives once its workers are up (``afore serve --role ffn --transport shm``)."""
    import urllib.request

    from afore.bench.ab_runtime import wait_admin
    from afore.transport.shm import ShmAttentionEnd, ShmLayout

    deadline = time.monotonic() + timeout_s
    wait_admin(admin, timeout_s, node)
    with urllib.request.urlopen(f"{admin}/afore/status", timeout=10) as resp:
        plane = json.loads(resp.read()).get("data_plane") or {}
    if not plane.get("segment") or not plane.get("layout"):
        raise RuntimeError(f"{admin}/afore/status: expected data_plane.segment and .layout (shm), got {plane}")
    return ShmAttentionEnd(plane["segment"], ShmLayout(**plane["layout"]), 0, device,
                           timeout_s=max(60.0, deadline - time.monotonic()))


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch CUDA: no GPUs
        return 0


def stop_ffn_node(node: subprocess.Popen, timeout_s: float = 60.0) -> None:
    if node.poll() is None:
        os.killpg(node.pid, signal.SIGTERM)
    try:
        node.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def drive_policy(conn, demand_client, counts: np.ndarray, hidden: int, top_k: int, attention_ms: float, device: str,
                 dtype, seed: int, step0: int = 0, stage_trace=None) -> dict:
    """Replay counts[S, L, M, E] serially through the FFN pool as steps ``step0``, ``step0 + 1``, ...
    (targets keep one increasing sequence over the policies of a run); per-target driver
    timestamps (ns). Every target's inputs are built before the first step, so the timed loop
    holds only what an attention worker does at a layer call (emit the demand, post the tokens,
    wait for the replies). ``stage_trace`` (afore.metrics.trace.CsvTrace): each target's row of
    the attention side's stage trace, the columns the vLLM plugin writes (afore.attention.stages)."""
    import torch

    from afore.plan import Target

    S, L, M, E = counts.shape
    tokens = int(counts[0, 0, 0].sum()) // top_k
    gen = torch.Generator().manual_seed(seed)
    hidden_rows = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(device=device, dtype=dtype)
    weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)
    ids = [[[torch.from_numpy(ids_for_demand(counts[s, l, b], tokens, top_k)).to(device) for b in range(M)]
            for l in range(L)] for s in range(S)]
    row_bytes = tokens * hidden * hidden_rows.element_size()
    n = S * L * M
    stamps = np.zeros((n, 4), np.int64)  # demand sent, tokens sent, receive start, done
    layer_end = np.zeros(S * L, np.int64)
    spent = np.zeros((S, L))  # the attention side's time before each layer call (ms): the sleep and the loop
    step_end = np.zeros(S, np.int64)
    seq = step0 * L * M
    prev_exit = time.perf_counter_ns()
    step_start = prev_exit
    for s in range(S):
        for layer in range(L):
            time.sleep(attention_ms / 1e3)
            enter = time.perf_counter_ns()
            spent[s, layer] = (enter - prev_exit) / 1e6
            handles = []
            for b in range(M):
                t = Target(step0 + s, layer, b)
                demand_client.put(t, 0, counts[s, layer, b])
                i = (s * L + layer) * M + b
                stamps[i, 0] = time.perf_counter_ns()
                handles.append((i, conn.send(t, seq, hidden_rows, ids[s][layer][b], weights)))
                stamps[i, 1] = time.perf_counter_ns()
                seq += 1
            for i, h in handles:
                stamps[i, 2] = time.perf_counter_ns()
                conn.recv(h)
                stamps[i, 3] = time.perf_counter_ns()
            exit_ = time.perf_counter_ns()
            if stage_trace is not None:
                for b, (i, _) in enumerate(handles):
                    stage_trace.add((step0 + s, layer, b, tokens, prev_exit, enter, *stamps[i], row_bytes, row_bytes,
                                     (step0 + s) * L * M + layer * M + b))
            layer_end[s * L + layer] = prev_exit = exit_
        step_end[s] = prev_exit
    return {"stamps": stamps, "layer_end": layer_end, "step_start": step_start, "step_end": step_end, "attention_ms": spent}


def run_gpu(args) -> int:
    """``afore bench ab --engine gpu`` (see the module docstring)."""
    import torch

    from afore.attention.stages import COLUMNS
    from afore.bench import ab
    from afore.bench.migration.worker import scrape_samples
    from afore.bench.report import write_report
    from afore.config import DEFAULT_COPY_RATE_GBPS
    from afore.metrics.trace import CsvTrace
    from afore.models.tiny import cache_dir
    from afore.ports import free_port
    from afore.prefetch.receiver import DemandClient
    from afore.transport.connector import AttentionConnector, TransportConfig, wait_for_ffn

    if args.device == "cuda" and not torch.cuda.is_available():
        print("afore bench ab --engine gpu: --device cuda but no GPU here (pass --device cpu for the CPU dry run)", file=sys.stderr)
        return 2
    if args.mode != "serial":
        print(f"afore bench ab --engine gpu: --mode {args.mode}: the driver runs the runtime's serial data plane "
              "(a layer's microbatches posted, then all replies awaited); only --mode serial models it", file=sys.stderr)
        return 2
    hidden, inter, experts, top_k = GPU_MODELS[args.gpu_model]
    policies = [p.strip() for p in (args.policies or "static,eplb,afore").split(",") if p.strip()]
    if "static" not in policies:
        policies.insert(0, "static")
    layers = args.layers if args.layers != ab.MOE_LAYERS else 4
    steps, warmup = args.steps, args.warmup
    if not 0 <= warmup < steps:
        print(f"afore bench ab: warmup: expected in [0, steps={steps}), got {warmup}", file=sys.stderr)
        return 2
    stage_file = None
    if args.stage_calibration:
        try:
            stage_file = load_gpu_stage_calibration(args.stage_calibration, args.gpu_model)
        except ValueError as exc:
            print(f"afore bench ab: {exc}", file=sys.stderr)
            return 2
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    folder = Path(args.checkpoint_dir) if args.checkpoint_dir else cache_dir() / f"experts-{args.gpu_model}-{layers}l-{dtype}"
    model = str(write_expert_checkpoint(folder, hidden, inter, experts, top_k, layers, dtype))
    counts = workload_counts(args, experts, top_k, layers, steps)
    out_dir = Path(args.out_dir) if args.out_dir else ab.RESULTS
    name = args.name or "ab_gpu"
    work = out_dir / "tmp" / name
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "ffn_node.log"
    trace = work / "stages"
    for f in work.glob("stages.*.csv"):  # a trace is appended to: start from none
        f.unlink()
    ports = {"store": free_port(), "demand": free_port(), "admin": free_port()}
    token = os.urandom(8).hex()
    budget = args.copy_budget if args.copy_budget is not None else args.ffn_workers
    tokens_per_target = int(counts[0, 0, 0].sum()) // top_k
    node = start_ffn_node(model, policies[0], args.ffn_workers, args.device, ports, token, log_path, budget, args.redundant_slots,
                          counts.shape[2], dtype, trace=trace, copy_rate_gbps=DEFAULT_COPY_RATE_GBPS,
                          transport=args.transport, max_tokens=tokens_per_target)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    results, conn, client, attention_by_policy, windows = {}, None, None, {}, {}
    attention_trace = CsvTrace(f"{trace}.0.csv", COLUMNS)
    try:
        admin = f"http://127.0.0.1:{ports['admin']}"
        tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        attn_device = attention_device(args.transport, args.device, args.ffn_workers)
        if args.transport == "shm":
            conn = attach_shm_driver(admin, node, attn_device, 900.0)
        else:
            wait_for_ffn("127.0.0.1", ports["store"], args.ffn_workers, 900.0)
            backend = "nccl" if attn_device.startswith("cuda") else "gloo"
            cfg = TransportConfig("127.0.0.1", ports["store"], 1, args.ffn_workers, hidden, top_k, tdtype, backend,
                                  timeout_s=300.0, store_on_rank0=False)
            conn = AttentionConnector(cfg, 0, attn_device)
        from afore.bench.serve import set_policy

        attention_ms = args.attention_ms if args.attention_ms is not None else default_attention_ms(args, counts)
        for index, policy in enumerate(policies):
            set_policy(admin, policy)  # restarts the scheduler: its demand receiver too, so connect anew
            client = DemandClient("127.0.0.1", ports["demand"], token)
            before = scrape_samples(f"{admin}/metrics")
            run = drive_policy(conn, client, counts, hidden, top_k, attention_ms, attn_device, tdtype, args.seed,
                               step0=index * counts.shape[0], stage_trace=attention_trace)
            after = scrape_samples(f"{admin}/metrics")
            client.close()
            client = None
            results[policy] = summarise_driven(run, before, after, policy, counts.shape, warmup, attention_ms)
            attention_by_policy[policy] = run["attention_ms"]
            # the steps after the warm-up: what the calibration and the comparison are about
            windows[policy] = (int(run["step_end"][warmup - 1]) if warmup else int(run["step_start"]), int(run["step_end"][-1]))
    finally:
        attention_trace.flush()
        if client is not None:
            client.close()
        if conn is not None:
            conn.close()
        stop_ffn_node(node)  # the FFN workers and the scheduler flush their traces as they stop
    cal, traces, report_costs, reports_note = simulation_inputs(args, counts, policies, budget)
    calib = trace_calibration(trace, windows, counts.shape, policies, traces, cal, args.device, DEFAULT_COPY_RATE_GBPS,
                              warmup, report_costs)
    variants = {"simulated": (report_costs, 0.0), "simulated_traces": (calib.get("costs"), calib.get("compute_offset_ms")),
                "simulated_static_traces": (calib.get("static_costs"), calib.get("static_compute_offset_ms"))}
    if stage_file is not None:
        variants["simulated_file"] = (stage_file["costs"], stage_file["compute_offset_ms"])
    tokens = int(counts[0, 0, 0].sum()) // top_k
    for key, (costs, offset) in variants.items():
        if costs is None or cal is None:
            continue
        for policy in policies:
            sim = simulate_policy_serial(traces[policy], cal, costs, offset, attention_by_policy[policy], counts.shape, policy,
                                         warmup, tokens)
            results[policy][key] = sim
            me = results[policy]["measured"]["step_ms_mean"]
            results[policy]["step_error" + key[len("simulated"):]] = sim["step_ms_mean"] / me - 1 if me else None
    for policy in policies:
        results[policy]["measured"]["stage_means_ms"] = calib.get("stage_means", {}).get(policy, {})
    calib_file = None
    if calib.get("costs") is not None:
        calib_file = out_dir / f"{name}_stages.json"
        calib_file.write_text(json.dumps(stage_calibration_doc(calib, args, started, data_model(args, model, dtype)),
                                         indent=1, default=float) + "\n")
    layout = layout_note(args.transport, args.device, args.ffn_workers, attn_device)
    data = {"engine": "gpu", "date_utc": started, "transport": args.transport, "simulated_side": reports_note, "device": args.device, "gpus": _gpus(),
            "hardware": {"machine": platform.machine(), "cpus": os.cpu_count(),
                         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
            "layout": layout, "pipeline_mode": "serial",
            "model": {"name": args.gpu_model, "hidden": hidden, "moe_intermediate": inter, "experts": experts, "top_k": top_k,
                      "layers": layers, "dtype": dtype, "checkpoint": model},
            "workload": {"shape": list(counts.shape), "tokens_per_microbatch": int(counts[0, 0, 0].sum()) // top_k},
            "copy_rate_gbps": DEFAULT_COPY_RATE_GBPS, "attention_ms": attention_ms,
            "measured": "every figure under policies.*.measured (driver timestamps, the FFN node's /metrics, the stage "
                        "traces of the driver, the FFN workers and the scheduler)",
            "calibration": {"traces": {k: v for k, v in calib.items() if k not in ("costs", "static_costs", "calibration",
                                                                                   "stage_means")}
                            | {"file": str(calib_file) if calib_file else None, "date_utc": started,
                               "stages": _stage_fields(calib.get("costs")),
                               "static_stages": _stage_fields(calib.get("static_costs"))},
                            "reports": {"note": reports_note, "stages": _stage_fields(report_costs)},
                            "file": None if stage_file is None else {k: stage_file[k] for k in ("path", "date_utc", "sources")}
                            | {"stages": _stage_fields(stage_file["costs"])}},
            "target_step_error": 0.10, "policies": results}
    paths = write_report(name, data, render_markdown(data), None, out_dir=out_dir)
    print(render_markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths.values()) + (f", {calib_file}" if calib_file else ""))
    return 0


def default_attention_ms(args, counts: np.ndarray) -> float:
    """The attention compute per layer call when ``--attention-ms`` is not given: an attention pool
    sized to the FFN pool (M x the balanced FFN stage of one microbatch, ``balanced_attention_ms``,
    from the migration report's entry for the shape); 0 when the report has no entry for it."""
    from afore.bench.pipeline_sim import balanced_attention_ms, calibration_from_report
    from afore.config import ClusterShape
    from afore.scheduler.cost import default_report_path

    S, L, M, E = counts.shape
    top_k = GPU_MODELS[args.gpu_model][3]
    try:
        cal = calibration_from_report(args.calibration or default_report_path(), args.gpu_model)
    except ValueError:
        return 0.0
    shape = ClusterShape(num_experts=E, num_workers=args.ffn_workers, num_layers=L, top_k=top_k)
    return M * balanced_attention_ms(cal, shape, int(counts[0, 0, 0].sum()) // top_k)



def simulation_inputs(args, counts: np.ndarray, policies: list[str], budget: int):
    """What every simulated column shares: the migration report's calibration for the expert shape
    (grouped-GEMM fit, copy fit, window), each policy's plans on the replayed targets
    (``run_policy``: the same policies the scheduler ran), and the stage costs of the committed
    H200 reports (``stage_costs_from_reports``: a prior that leaves unmeasured stages at 0).
    Returns (calibration | None, {policy: PolicyTrace}, StageCosts | None, note)."""
    from afore.bench import ab
    from afore.bench.pipeline_sim import calibration_from_report, run_policy, stage_costs_from_reports
    from afore.config import DEFAULT_COPY_RATE_GBPS, ClusterShape, SchedulerParams
    from afore.scheduler.cost import default_report_path

    path = args.calibration or default_report_path()
    try:
        cal = calibration_from_report(path, args.gpu_model)
    except ValueError as exc:
        return None, {}, None, f"not simulated: {exc}"
    S, L, M, E = counts.shape
    shape = ClusterShape(num_experts=E, num_workers=args.ffn_workers, num_layers=L, redundant_slots=args.redundant_slots,
                         top_k=GPU_MODELS[args.gpu_model][3])
    params = SchedulerParams(copy_budget=budget)
    traces = {p: run_policy(p, shape, params, cal.cost, counts, ab.POLICY_OPTIONS.get(p)) for p in policies}
    note = (f"grouped GEMM and copies: {Path(path).name} ({cal.source.get('report_date_utc')}) for {args.gpu_model}; "
            "every column pipeline_sim.simulate_runtime, serial mode (the driver's and today's runtime's data plane), "
            "the attention time the driver spent per layer call as input")
    try:
        costs = stage_costs_from_reports(cal, ab.RESULTS / "transport_h200.json", ab.RESULTS / "scheduler.json", args.ffn_workers,
                                         policies, DEFAULT_COPY_RATE_GBPS)
    except ValueError as exc:
        return cal, traces, None, note + f"; committed stage reports: not simulated ({exc})"
    if args.device == "cpu":
        costs = dataclasses.replace(costs, copies_synchronous=True)
    return cal, traces, costs, note + f"; committed stage reports: {costs.sources}"


def _gemm_ms(cal, trace, first: int) -> float:
    """Mean modelled grouped GEMM (ms) of ``trace``'s targets from ``first`` on."""
    return float(np.mean(cal.ffn_compute_ms(trace.max_tile_load[first:])))


def trace_calibration(trace: Path, windows: dict, shape: tuple, policies: list[str], traces: dict, cal, device: str,
                      copy_rate_gbps: float, warmup: int, report_costs) -> dict:
    """The stage costs measured by this run's own traces (``ab_runtime.stages_from_traces``, the CPU
    engine's calibration): transport latency each way, plan decode, agreement, the FFN stage
    outside the grouped GEMM, the pool's reply send, scheduling per policy; pooled over every
    policy's window (``costs``) and from the static window alone (``static_costs``: eplb and afore
    then predicted from static's stages, with their own scheduling time).

    The FFN compute of a target is the migration report's grouped-GEMM fit at its plan's tile
    load plus ``compute_offset_ms``: the static window's measured compute span minus the fit's
    mean over the same targets (negative when the kernels end after the span, on GPUs, where
    the host does not wait for them before the reply: their tail is then in the F2A latency).
    Copies: the migration report's copy fit, paced to ``copy_rate_gbps`` as the FFN node ran;
    CPU workers copy synchronously. A stage without a sample is listed in ``not_measured`` with
    why, and the committed reports' figure (or 0) is used in its place, named as such."""
    from afore.bench.ab_runtime import decode_steps, load_trace, stage_means, stage_table, stages_from_traces
    from afore.bench.pipeline_sim import stage_costs_from_dict
    from afore.ffn.worker import FFNWorkerConfig

    S, L, M, E = shape
    if cal is None:
        return {"not_measured": {"all": "no migration report for the expert shape: no grouped-GEMM fit to calibrate against"}}
    try:
        attn = load_trace(trace)
    except ValueError as exc:
        return {"not_measured": {"all": str(exc)}}
    tables = {p: stage_table(trace, w) for p, w in windows.items()}
    empty = [p for p, t in tables.items() if t is None or t["stage"].size == 0]
    if empty:
        return {"not_measured": {"all": f"no FFN worker or scheduler trace rows for {empty} under {trace}"}}
    tokens = int(attn[:, 3].max())
    steps = {p: decode_steps(attn, w, L, M, max_tokens=max(tokens, 1)) for p, w in windows.items()}
    out = {"path": str(trace), "windows_ns": windows, "stage_means": {p: stage_means(t) for p, t in tables.items()},
           "calibration": cal}
    name = f"this run's per-target traces ({trace.name}.*.csv: driver, FFN workers, scheduler)"
    first = warmup * L * M
    for key, subset in (("", policies), ("static_", ["static"])):
        stages, sources, missing = stages_from_traces({p: tables[p] for p in subset}, {p: steps[p] for p in subset}, name,
                                                      split_send=True)
        span = stages.pop("compute_ms")
        sources["compute_offset_ms"] = sources.pop("compute_ms") + " minus the migration report's grouped-GEMM fit at " \
                                       "the static plans' tile loads (mean over the same targets)"
        offset = span - _gemm_ms(cal, traces["static"], first) if "compute_ms" not in missing else 0.0
        schedule = dict(stages.pop("schedule_ms"))
        for p in policies:  # the static-only column: the other policies' scheduling from their own windows
            if p not in schedule and np.isfinite(tables[p]["schedule"]).any():
                schedule[p] = float(np.nanmean(tables[p]["schedule"]))
                missing.pop(f"schedule_ms[{p}]", None)
            if p not in schedule:
                schedule[p] = report_costs.schedule_for(p) if report_costs is not None else 0.0
                missing[f"schedule_ms[{p}]"] = f"no published plan of {p} in the traces: " + (
                    "the committed reports' figure" if report_costs is not None else "0") + " used"
        if "plan_decode_ms" in missing and report_costs is not None:
            stages["plan_decode_ms"] = report_costs.plan_decode_ms
            missing["plan_decode_ms"] += f": the committed reports' {report_costs.plan_decode_ms:.4f} ms used"
        copy = {"plan_timeout_ms": FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model="").plan_timeout_ms,
                "copy_latency_ms": cal.cost.copy_latency_ms, "copy_link_gbps": cal.cost.link_bandwidth_gbps,
                "copy_cap_gbps": copy_rate_gbps, "deadline_share": 0.5, "copies_synchronous": device == "cpu"}
        sources.update({"plan_timeout_ms": "FFNWorkerConfig.plan_timeout_ms (the FFN node's setting, not a measurement)",
                        "copies": f"the migration report's copy fit, paced to {copy_rate_gbps:g} GB/s (the FFN node's "
                                  "--copy-rate-gbps), deadline share 0.5 (Migrator.deadline_share)"
                                  + ("; CPU workers copy synchronously" if device == "cpu" else ""),
                        "not_measured": dict(missing) or "none: every stage has samples in the traces"})
        costs = stage_costs_from_dict({**stages, **copy, "schedule_ms": schedule, "sources": sources})
        out[f"{key}costs"], out[f"{key}compute_offset_ms"] = costs, offset
        out[f"{key}not_measured"], out[f"{key}compute_span_ms"] = missing, span
    return out


def simulate_policy_serial(trace, cal, costs, compute_offset_ms: float, attention_ms: np.ndarray, shape: tuple, policy: str,
                           warmup: int, tokens: int) -> dict:
    """One policy's plans through ``simulate_runtime`` in serial mode: the driver's attention time
    per layer call (float[S, L], measured) in, FFN compute = the grouped-GEMM fit at each plan's
    tile load + ``compute_offset_ms`` (>= 0), every other stage from ``costs``."""
    from afore.bench.pipeline_sim import simulate_runtime, summarise_runtime

    S, L, M, E = shape
    compute = np.maximum(0.0, cal.ffn_compute_ms(trace.max_tile_load) + compute_offset_ms)
    primary = np.maximum(0.0, cal.ffn_compute_ms(trace.primary_max_tile_load) + compute_offset_ms)
    tl = simulate_runtime("serial", attention_ms, compute, L, M, costs, costs.schedule_for(policy), copies=trace.dest_copies,
                          bytes_per_expert=cal.cost.bytes_per_expert, blocking=trace.blocking, primary_compute_ms=primary)
    out = summarise_runtime(trace, tl, M * tokens, warmup, L, M)
    out["exchange_ms_per_layer"] = float(np.mean(tl.exchange_ms[warmup * L:]))
    out["compute_ms_mean"] = float(np.mean(compute[warmup * L * M:]))
    return out


def _stage_fields(costs) -> dict | None:
    from afore.bench.pipeline_sim import STAGE_FIELDS

    if costs is None:
        return None
    return {k: getattr(costs, k) for k in STAGE_FIELDS} | {"schedule_ms": dict(costs.schedule_ms),
                                                           "copies_synchronous": costs.copies_synchronous,
                                                           "vote_after_compute": costs.vote_after_compute}


def data_model(args, model: str, dtype: str) -> dict:
    hidden, inter, experts, top_k = GPU_MODELS[args.gpu_model]
    return {"name": args.gpu_model, "path": model, "hidden": hidden, "moe_intermediate": inter, "experts": experts,
            "top_k": top_k, "dtype": dtype, "bytes_per_expert": 3 * hidden * inter * (2 if dtype == "bfloat16" else 4)}


def stage_calibration_doc(calib: dict, args, started: str, model: dict) -> dict:
    """This run's trace calibration as a stage calibration file (ab_runtime.CALIBRATION_KIND), for
    ``--stage-calibration`` of a later GPU run (a prediction: stages measured in another run)."""
    from afore.bench.ab_runtime import CALIBRATION_KIND
    from afore.bench.report import command_line

    costs = calib["costs"]
    return {"kind": CALIBRATION_KIND, "engine": "gpu",
            "meta": {"command": command_line(), "date_utc": started, "device": args.device,
                     "hardware": {"machine": platform.machine(), "cpus": os.cpu_count()}},
            "model": model, "runtime": {"attn_workers": 1, "ffn_workers": args.ffn_workers, "mode": "serial",
                                        "microbatches": args.microbatches, "tokens": args.tokens},
            "stages": _stage_fields(costs),
            "ffn_compute": {"model": "migration report grouped-GEMM fit + offset_ms", "offset_ms": calib["compute_offset_ms"],
                            "span_ms": calib["compute_span_ms"]},
            "not_measured": calib["not_measured"], "sources": costs.sources}


def load_gpu_stage_calibration(path: str | Path, model: str) -> dict:
    """A stage calibration file written by an earlier GPU run (``<name>_stages.json``) for ``model``."""
    from afore.bench.ab_runtime import load_stage_calibration

    costs, doc = load_stage_calibration(path)
    if doc.get("engine") != "gpu":
        raise ValueError(f"stage calibration: expected one written by --engine gpu in {Path(path).name}, got engine "
                         f"{doc.get('engine')!r}")
    if doc.get("model", {}).get("name") != model:
        raise ValueError(f"stage calibration: expected model {model!r} in {Path(path).name}, got {doc.get('model', {}).get('name')!r}")
    return {"path": str(path), "date_utc": doc["meta"]["date_utc"], "costs": costs, "sources": doc.get("sources", {}),
            "compute_offset_ms": float(doc["ffn_compute"]["offset_ms"])}


def workload_counts(args, experts: int, top_k: int, layers: int, steps: int) -> np.ndarray:
    """counts[S, L, M, E] of the replayed workload: the first HarMoEny trace (resampled as ``afore
    bench ab`` does) when its expert count matches, else the synthetic chat workload."""
    from afore.traces.harmoeny import load_harmoeny
    from afore.traces.synthetic import SyntheticSpec, generate, resample_trace

    rng = np.random.default_rng([args.seed, 1, 0])
    real = load_harmoeny("switch128", args.traces) if not args.no_real and experts == 128 else None
    if real:
        name = sorted(real)[0]
        counts = resample_trace(real[name].counts, name, steps, args.microbatches, args.tokens, top_k, rng)
        return counts[:, :layers]
    spec = SyntheticSpec(workload="chat", num_experts=experts, num_layers=layers, top_k=top_k, tokens=args.tokens,
                         steps=steps, microbatches=args.microbatches, seed=args.seed)
    return generate(spec).counts.astype(np.int64)


def summarise_driven(run: dict, before: dict, after: dict, policy: str, shape: tuple, warmup: int, attention_ms: float) -> dict:
    from afore.bench.ab_runtime import metric_sum

    S, L, M, _ = shape
    step_ms = np.diff(np.concatenate([[run["step_start"]], run["step_end"]])) / 1e6
    keep = step_ms[warmup:]

    def d(family, **labels):
        return metric_sum(after, family, **labels) - metric_sum(before, family, **labels)

    exposed_n = d("afore_ffn_exposed_copy_wait_seconds_count", worker="0")
    # targets with copies, per worker (a copy batch's raw time is observed only where there are copies);
    # every exposed wait of a worker is a wait for copies into it, so its sum over them is its exposed time
    with_copies = d("afore_ffn_copy_seconds_count")
    stage_n = d("afore_ffn_stage_seconds_count", worker="0")
    imb_n = d("afore_ffn_tile_imbalance_count", placement="plan")
    st = run["stamps"]
    return {"measured": {
        "steps": int(keep.size), "step_ms_mean": float(keep.mean()) if keep.size else None,
        "step_ms_p50": float(np.median(keep)) if keep.size else None,
        "step_ms_p95": float(np.percentile(keep, 95)) if keep.size else None,
        "f2a_wait_ms_mean": float(np.mean(st[:, 3] - st[:, 2]) / 1e6),
        "ffn_stage_ms_mean": 1e3 * d("afore_ffn_stage_seconds_sum", worker="0") / stage_n if stage_n else None,
        "ffn_targets": d("afore_ffn_targets_total", worker="0"),
        "plans_used": d("afore_ffn_plans_total", worker="0", outcome="used"),
        "plans_missed": d("afore_ffn_plans_total", worker="0", outcome="missed"),
        "plans_rejected_or_mismatched": d("afore_ffn_plans_total", worker="0", outcome="rejected")
        + d("afore_ffn_plans_total", worker="0", outcome="mismatched"),
        "primary_only_targets": d("afore_ffn_primary_only_targets_total", worker="0"),
        "copies": d("afore_ffn_copies_total"), "copy_bytes": d("afore_ffn_copy_bytes_total"),
        "exposed_ms_mean_planned": 1e3 * d("afore_ffn_exposed_copy_wait_seconds_sum", worker="0") / exposed_n if exposed_n else None,
        "worker_targets_with_copies": with_copies,
        "exposed_ms_mean_with_copies": 1e3 * d("afore_ffn_exposed_copy_wait_seconds_sum") / with_copies if with_copies else None,
        "max_mean_tile_load_mean": d("afore_ffn_tile_imbalance_sum", placement="plan") / imb_n if imb_n else None,
        "step_ms": step_ms.tolist()}}


_VARIANTS = (("simulated", "a: committed H200 reports (a prior: unmeasured stages 0)"),
             ("simulated_file", "f: the given --stage-calibration file (a prediction from another run)"),
             ("simulated_traces", "b: this run's traces, all policies (not a prediction: checks the model's structure)"),
             ("simulated_static_traces", "c: this run's traces, static's window only (eplb, afore predicted from it)"))


def render_markdown(data: dict) -> str:
    m = data["model"]
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"  # noqa: E731
    lines = [f"# A/B on the FFN pool ({data['device']}): every policy, measured, and the stage model against it", "",
             f"{data['layout']}; {m['name']} expert shape (H = {m['hidden']}, I = {m['moe_intermediate']}, E = {m['experts']}, "
             f"top-{m['top_k']}), {m['layers']} MoE layers, {m['dtype']}, random weights; workload {data['workload']['shape']} "
             f"[steps, layers, microbatches, experts], {data['workload']['tokens_per_microbatch']} tokens per microbatch; "
             f"copies paced to {data.get('copy_rate_gbps', 0):g} GB/s; data plane {data.get('pipeline_mode', 'serial')} "
             "(the driver, as today's runtime, posts a layer's microbatches, then waits for all replies: no overlap of "
             f"attention and FFN); attention compute: a stated constant {data['attention_ms']:.4f} ms per layer call (a sleep "
             "in the driver; --attention-ms, default M x the balanced FFN stage of the migration report). "
             f"Date {data['date_utc']}.", "",
             "## Measured", "",
             "Driver timestamps, the FFN node's /metrics, the stage traces of the driver, the FFN workers and the scheduler.", "",
             "| policy | steps | step ms mean | p50 | p95 | F2A wait ms | FFN stage ms | plans used / missed | copies | "
             "exposed ms over targets with copies | exposed ms (planned targets, worker 0) | max/mean tile load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, r in data["policies"].items():
        me = r["measured"]
        lines.append(f"| {p} | {me['steps']} | {f(me['step_ms_mean'])} | {f(me['step_ms_p50'])} | {f(me['step_ms_p95'])} | "
                     f"{f(me['f2a_wait_ms_mean'])} | {f(me['ffn_stage_ms_mean'])} | {me['plans_used']:.0f} / {me['plans_missed']:.0f} | "
                     f"{me['copies']:.0f} | {f(me.get('exposed_ms_mean_with_copies'))} ({me.get('worker_targets_with_copies', 0):.0f} "
                     f"worker-targets) | {f(me['exposed_ms_mean_planned'])} | {f(me['max_mean_tile_load_mean'])} |")
    if any(r["measured"].get("stage_means_ms") for r in data["policies"].values()):
        lines += ["", "Per target, from the traces (mean ms over the steps after the warm-up; the latest FFN worker per target):",
                  "", "| policy | A2F latency | queue | plan wait + decode | decode (plan there) | compute span | vote | reply | "
                  "reply send (pool busy) | FFN stage | F2A latency | demand -> plan |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, r in data["policies"].items():
            t = r["measured"].get("stage_means_ms") or {}
            if t:
                lines.append(f"| {p} | {f(t['a2f_latency'])} | {f(t['queue'])} | {f(t['plan'])} | {f(t['decode'])} | "
                             f"{f(t['compute'])} | {f(t['vote'])} | {f(t['reply'])} | {f(t.get('send'))} | {f(t['stage'])} | "
                             f"{f(t['f2a_latency'])} | {f(t['schedule'])} |")
    cal = data.get("calibration", {})
    tr = cal.get("traces", {})
    lines += ["", "## Simulated", "", f"{data['simulated_side']}.", ""]
    if tr.get("stages"):
        st = tr["stages"]
        lines += [f"Calibration b (this run's traces, `{tr.get('file')}`, {tr.get('date_utc')}): demand emit "
                  f"{st['demand_emit_ms']:.3f}, A2F post {st['a2f_post_ms']:.3f}, A2F latency {st['a2f_latency_ms']:.3f}, "
                  f"F2A latency {st['f2a_latency_ms']:.3f} (after the pool's reply send), plan decode {st['plan_decode_ms']:.4f}, "
                  f"agreement {st['agreement_ms']:.3f}, FFN stage outside the GEMM: reply + send {st['ffn_fixed_ms']:.3f} and "
                  f"compute span - GEMM fit {tr['compute_offset_ms']:+.3f} (span {tr['compute_span_ms']:.3f}), demand -> plan "
                  + ", ".join(f"{p} {v:.3f}" for p, v in st["schedule_ms"].items()) + " ms; copies at "
                  f"{st['copy_cap_gbps']:g} GB/s, plan timeout {st['plan_timeout_ms']:g} ms (settings).", ""]
        nm = tr.get("not_measured") or {}
        lines += ["Not measured by the traces: " + ("; ".join(f"{k} ({v})" for k, v in nm.items()) if nm else "none") + ".", ""]
    elif tr.get("not_measured"):
        lines += [f"Trace calibration: not done ({tr['not_measured']}).", ""]
    if cal.get("file"):
        lines += [f"Calibration f: `{cal['file']['path']}` ({cal['file']['date_utc']}).", ""]
    shown = [(k, label) for k, label in _VARIANTS if any(k in r for r in data["policies"].values())]
    if shown:
        lines += ["| policy | step ms mean (measured) | " + " | ".join(f"step ms mean ({label}) | error {label[0]}" for k, label in shown)
                  + " | exposed ms over targets with copies (simulated b) | max/mean tile load (simulated) |",
                  "|---|---|" + "---|---|" * len(shown) + "---|---|"]
        for p, r in data["policies"].items():
            cells = []
            for k, _ in shown:
                si = r.get(k)
                cells += [f(si["step_ms_mean"]) if si else "-", pct(r.get("step_error" + k[len("simulated"):]))]
            b = r.get("simulated_traces") or r.get("simulated") or {}
            lines.append(f"| {p} | {f(r['measured']['step_ms_mean'])} | " + " | ".join(cells)
                         + f" | {f(b.get('exposed_ms_per_target_with_copies'))} | {f(b.get('max_mean_tile_load'))} |")
        target = data.get("target_step_error", 0.10)
        lines.append("")
        for k, label in shown:
            errs = [abs(r["step_error" + k[len("simulated"):]]) for r in data["policies"].values()
                    if r.get("step_error" + k[len("simulated"):]) is not None]
            if errs:
                lines.append(f"- largest step-time error, {label}: {100 * max(errs):.1f}% "
                             f"({'within' if max(errs) <= target else 'outside'} the {100 * target:.0f}% target)")
    return "\n".join(lines)
