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
  the demand over TCP (``DemandClient``) and the tokens through the real connector
  (``AttentionConnector``: NCCL between distinct GPUs, gloo otherwise), serial as today's
  runtime is: a layer's M microbatches are posted, then all M replies awaited; the attention
  compute is a stated constant (``--attention-ms``, a sleep) between layer calls;
- every policy runs on the same targets in the same FFN processes (switched through the FFN
  node's admin endpoint).

Measured per policy: step time (driver timestamps), FFN stage, exposed copy wait (the FFN
workers' event timestamps, afore_ffn_exposed_copy_wait_seconds, over the planned targets),
copies and bytes, max/mean tile load (afore_ffn_tile_imbalance), plans used / missed. Simulated
beside it: the same targets through ``pipeline_sim.simulate_runtime`` (serial) with the
committed calibration, so the simulator is validated against the pool.

On one GPU the F workers are separate processes sharing it (``--colocate``, gloo staged
through the host), stated in the report.
"""

from __future__ import annotations

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
                   copy_budget: int, redundant_slots: int, microbatches: int, dtype: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "afore.cli", "serve", "--role", "ffn", "--host", "0.0.0.0", "--model", model, "--dtype", dtype,
           "--attn-workers", "1", "--ffn-workers", str(num_ffn), "--device", device, "--policy", policy,
           "--microbatches", str(microbatches),
           "--store-port", str(ports["store"]), "--demand-port", str(ports["demand"]), "--admin-port", str(ports["admin"]),
           "--copy-budget", str(copy_budget), "--redundant-slots", str(redundant_slots)]
    if device == "cpu" or _gpus() < num_ffn + 1:
        cmd += ["--colocate", "--transport", "torch-gloo"]
    log = open(log_path, "ab")
    log.write(f"\n$ {' '.join(cmd)}\n".encode())
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "AFORE_DEMAND_TOKEN": token})


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
                 dtype, seed: int, step0: int = 0) -> dict:
    """Replay counts[S, L, M, E] serially through the FFN pool as steps ``step0``, ``step0 + 1``, ...
    (targets keep one increasing sequence over the policies of a run); per-target driver
    timestamps (ns)."""
    import torch

    from afore.plan import Target

    S, L, M, E = counts.shape
    tokens = int(counts[0, 0, 0].sum()) // top_k
    gen = torch.Generator().manual_seed(seed)
    hidden_rows = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(device=device, dtype=dtype)
    weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)
    n = S * L * M
    stamps = np.zeros((n, 4), np.int64)  # demand sent, tokens sent, receive start, done
    layer_end = np.zeros(S * L, np.int64)
    slept = np.zeros((S, L))  # the attention compute actually spent (ms): a sleep overshoots
    step_end = np.zeros(S, np.int64)
    seq = step0 * L * M
    for s in range(S):
        for layer in range(L):
            t0 = time.perf_counter_ns()
            time.sleep(attention_ms / 1e3)
            slept[s, layer] = (time.perf_counter_ns() - t0) / 1e6
            handles = []
            for b in range(M):
                t = Target(step0 + s, layer, b)
                ids = torch.from_numpy(ids_for_demand(counts[s, layer, b], tokens, top_k)).to(device)
                demand_client.put(t, 0, counts[s, layer, b])
                i = (s * L + layer) * M + b
                stamps[i, 0] = time.perf_counter_ns()
                handles.append((i, conn.send(t, seq, hidden_rows, ids, weights)))
                stamps[i, 1] = time.perf_counter_ns()
                seq += 1
            for i, h in handles:
                stamps[i, 2] = time.perf_counter_ns()
                conn.recv(h)
                stamps[i, 3] = time.perf_counter_ns()
            layer_end[s * L + layer] = time.perf_counter_ns()
        step_end[s] = time.perf_counter_ns()
    return {"stamps": stamps, "layer_end": layer_end, "step_end": step_end, "attention_ms": slept}


def run_gpu(args) -> int:
    """``afore bench ab --engine gpu`` (see the module docstring)."""
    import torch

    from afore.bench import ab
    from afore.bench.migration.worker import scrape_samples
    from afore.bench.report import write_report
    from afore.models.tiny import cache_dir
    from afore.ports import free_port
    from afore.prefetch.receiver import DemandClient
    from afore.transport.connector import AttentionConnector, TransportConfig, wait_for_ffn

    if args.device == "cuda" and not torch.cuda.is_available():
        print("afore bench ab --engine gpu: --device cuda but no GPU here (pass --device cpu for the CPU dry run)", file=sys.stderr)
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
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    folder = Path(args.checkpoint_dir) if args.checkpoint_dir else cache_dir() / f"experts-{args.gpu_model}-{layers}l-{dtype}"
    model = str(write_expert_checkpoint(folder, hidden, inter, experts, top_k, layers, dtype))
    counts = workload_counts(args, experts, top_k, layers, steps)
    out_dir = Path(args.out_dir) if args.out_dir else ab.RESULTS
    log_path = out_dir / "tmp" / "ab_gpu_ffn_node.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    ports = {"store": free_port(), "demand": free_port(), "admin": free_port()}
    token = os.urandom(8).hex()
    budget = args.copy_budget if args.copy_budget is not None else args.ffn_workers
    node = start_ffn_node(model, policies[0], args.ffn_workers, args.device, ports, token, log_path, budget, args.redundant_slots,
                          counts.shape[2], dtype)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    results, conn, client, attention_by_policy = {}, None, None, {}
    try:
        wait_for_ffn("127.0.0.1", ports["store"], args.ffn_workers, 900.0)
        colocated = args.device == "cpu" or _gpus() < args.ffn_workers + 1
        backend = "gloo" if colocated else "nccl"
        attn_device = "cpu" if colocated else f"cuda:{args.ffn_workers}"
        tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        cfg = TransportConfig("127.0.0.1", ports["store"], 1, args.ffn_workers, hidden, top_k, tdtype, backend,
                              timeout_s=300.0, store_on_rank0=False)
        conn = AttentionConnector(cfg, 0, attn_device)
        admin = f"http://127.0.0.1:{ports['admin']}"
        from afore.bench.serve import set_policy

        attention_ms = args.attention_ms if args.attention_ms is not None else default_attention_ms(args, counts)
        for index, policy in enumerate(policies):
            set_policy(admin, policy)  # restarts the scheduler: its demand receiver too, so connect anew
            client = DemandClient("127.0.0.1", ports["demand"], token)
            before = scrape_samples(f"{admin}/metrics")
            run = drive_policy(conn, client, counts, hidden, top_k, attention_ms, attn_device, tdtype, args.seed,
                               step0=index * counts.shape[0])
            after = scrape_samples(f"{admin}/metrics")
            client.close()
            client = None
            results[policy] = summarise_driven(run, before, after, policy, counts.shape, warmup, attention_ms)
            attention_by_policy[policy] = run["attention_ms"]
    finally:
        if client is not None:
            client.close()
        if conn is not None:
            conn.close()
        stop_ffn_node(node)
    simulated, sim_note = simulate_side(args, counts, policies, args.ffn_workers, budget, attention_by_policy, warmup)
    for policy, sim in simulated.items():
        results[policy]["simulated"] = sim
        me = results[policy]["measured"]["step_ms_mean"]
        results[policy]["step_error"] = sim["step_ms_mean"] / me - 1 if me else None
    data = {"engine": "gpu", "date_utc": started, "simulated_side": sim_note, "device": args.device, "gpus": _gpus(),
            "hardware": {"machine": platform.machine(), "cpus": os.cpu_count(),
                         "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
            "layout": f"{args.ffn_workers} FFN worker processes" + (" sharing one device (gloo staged through the host)"
                                                                    if args.device == "cpu" or _gpus() < args.ffn_workers + 1 else
                                                                    " on distinct GPUs (NCCL)"),
            "model": {"name": args.gpu_model, "hidden": hidden, "moe_intermediate": inter, "experts": experts, "top_k": top_k,
                      "layers": layers, "dtype": dtype, "checkpoint": model},
            "workload": {"shape": list(counts.shape), "tokens_per_microbatch": int(counts[0, 0, 0].sum()) // top_k},
            "attention_ms": attention_ms, "measured": "every figure under policies.*.measured (driver timestamps, "
            "the FFN node's /metrics)", "policies": results}
    name = args.name or "ab_gpu"
    paths = write_report(name, data, render_markdown(data), None, out_dir=out_dir)
    print(render_markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
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


def simulate_side(args, counts: np.ndarray, policies: list[str], num_ffn: int, budget: int, attention_ms: dict,
                  warmup: int) -> tuple[dict, str]:
    """The same targets through the stage model (serial, as the driver runs them, with the attention
    time the driver actually spent per layer call: ``attention_ms[policy]`` float[S, L]), calibrated
    by the migration report's entry for the expert shape; ({}, why) when it has none."""
    from afore.bench import ab
    from afore.bench.pipeline_sim import (calibration_from_report, run_policy, simulate_runtime, stage_costs_from_reports,
                                          summarise_runtime)
    from afore.config import DEFAULT_COPY_RATE_GBPS, ClusterShape, SchedulerParams
    from afore.scheduler.cost import default_report_path

    path = args.calibration or default_report_path()
    try:
        cal = calibration_from_report(path, args.gpu_model)
        S, L, M, E = counts.shape
        shape = ClusterShape(num_experts=E, num_workers=num_ffn, num_layers=L, redundant_slots=args.redundant_slots,
                             top_k=GPU_MODELS[args.gpu_model][3])
        costs = stage_costs_from_reports(cal, ab.RESULTS / "transport_h200.json", ab.RESULTS / "scheduler.json", num_ffn,
                                         policies, DEFAULT_COPY_RATE_GBPS)
    except ValueError as exc:
        return {}, f"not simulated: {exc}"
    params = SchedulerParams(copy_budget=budget)
    out = {}
    tokens = int(counts[0, 0, 0].sum()) // shape.top_k
    for policy in policies:
        trace = run_policy(policy, shape, params, cal.cost, counts, ab.POLICY_OPTIONS.get(policy))
        tl = simulate_runtime("serial", attention_ms[policy], cal.ffn_compute_ms(trace.max_tile_load), L, M, costs,
                              costs.schedule_for(policy), copies=trace.dest_copies, bytes_per_expert=cal.cost.bytes_per_expert,
                              blocking=trace.blocking, primary_compute_ms=cal.ffn_compute_ms(trace.primary_max_tile_load))
        out[policy] = summarise_runtime(trace, tl, M * tokens, warmup, L, M)
    return out, (f"simulated: pipeline_sim.simulate_runtime (serial) with {Path(path).name} "
                 f"({cal.source.get('report_date_utc')}) for {args.gpu_model}, stage costs {costs.sources}")


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
    step_end = run["step_end"]
    step_ms = np.diff(step_end) / 1e6  # step s+1 - step s (the first step's start is not stamped)
    keep = step_ms[max(0, warmup - 1):]

    def d(family, **labels):
        return metric_sum(after, family, **labels) - metric_sum(before, family, **labels)

    exposed_n = d("afore_ffn_exposed_copy_wait_seconds_count", worker="0")
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
        "max_mean_tile_load_mean": d("afore_ffn_tile_imbalance_sum", placement="plan") / imb_n if imb_n else None,
        "step_ms": step_ms.tolist()}}


def render_markdown(data: dict) -> str:
    m = data["model"]
    lines = [f"# A/B on the FFN pool ({data['device']}): every policy, measured", "",
             f"{data['layout']}; {m['name']} expert shape (H = {m['hidden']}, I = {m['moe_intermediate']}, E = {m['experts']}, "
             f"top-{m['top_k']}), {m['layers']} MoE layers, {m['dtype']}, random weights; workload {data['workload']['shape']} "
             f"[steps, layers, microbatches, experts], {data['workload']['tokens_per_microbatch']} tokens per microbatch; "
             f"attention compute: a stated constant {data['attention_ms']:.4f} ms per layer call (a sleep in the driver; "
             "--attention-ms, default M x the balanced FFN stage of the migration report). "
             f"Date {data['date_utc']}. All figures below are measured.", "",
             "| policy | steps | step ms mean | p50 | p95 | F2A wait ms | FFN stage ms | plans used / missed | copies | "
             "exposed ms (planned targets) | max/mean tile load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for p, r in data["policies"].items():
        me = r["measured"]
        lines.append(f"| {p} | {me['steps']} | {f(me['step_ms_mean'])} | {f(me['step_ms_p50'])} | {f(me['step_ms_p95'])} | "
                     f"{f(me['f2a_wait_ms_mean'])} | {f(me['ffn_stage_ms_mean'])} | {me['plans_used']:.0f} / {me['plans_missed']:.0f} | "
                     f"{me['copies']:.0f} | {f(me['exposed_ms_mean_planned'])} | {f(me['max_mean_tile_load_mean'])} |")
    lines += ["", f"Simulated side: {data['simulated_side']}", ""]
    if any("simulated" in r for r in data["policies"].values()):
        lines += ["| policy | step ms mean (measured) | step ms mean (simulated) | error | exposed ms over targets with copies "
                  "(simulated) | max/mean tile load (simulated) |", "|---|---|---|---|---|---|"]
        for p, r in data["policies"].items():
            if "simulated" in r:
                si = r["simulated"]
                err = "-" if r["step_error"] is None else f"{100 * r['step_error']:+.1f}%"
                lines.append(f"| {p} | {f(r['measured']['step_ms_mean'])} | {f(si['step_ms_mean'])} | {err} | "
                             f"{f(si['exposed_ms_per_target_with_copies'])} | {f(si['max_mean_tile_load'])} |")
    return "\n".join(lines)
