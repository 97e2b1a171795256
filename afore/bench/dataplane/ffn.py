"""``afore bench dataplane --part ffn``: one FFN worker's step against its floors, its own
grouped GEMM and vLLM's ``fused_moe`` on the same inputs.

Setting: one worker (worker 0 of F) of a layer with the expert shapes of each model, bf16,
K_w = E/F + R slots filled with random weights. Each load is a routing of T tokens
(Zipf-skewed, T*k/F pairs per worker on average) planned by Algorithm 1 (replicas, copies);
``pairs`` is what worker 0 runs. Measured in the same run, on the same GPU:

- the floors: HBM = bytes of the active slots' weights / the measured device copy rate
  (bytes read + written per second); tensor core = 2 * 3 * H * I * pairs / the measured bf16
  matmul rate (8192^3); the roofline floor is the larger;
- ``step``: ``FFNLayer.forward`` as the worker calls it (plan staged on arrival; per call the
  plan upload, input copies, graph replay, output copy), back to back, GPU time per call;
- ``host_fed``: ``FFNLayer.forward_host_routed``, the shm transport's GPU step (host routing,
  rows gathered from host memory into a pinned packed buffer, one copy in, one replay, one copy
  out, one wait): wall time per call, what the worker waits for;
- ``replay``: the captured graph alone; ``gemm``: the two expert kernels alone, as a graph,
  on the rows the step routed; ``eager``: the same kernels launched without a graph;
- ``vllm``: ``fused_experts`` on the same x, weights and this worker's pairs (ids mapped to
  local slots through an expert map), eager and as a CUDA graph, with vLLM's own config choice
  and, where vLLM ships one, its tuned H200 config for the full layer (E, I);
- plan changes: steps cycling through plans that bind the replicas to other slots, against
  the same plan every step; and the same with one expert copied per step (full rate) on the
  copy engine's side stream, submitted a step ahead and committed by an event, as the
  migrator does (a step shorter than the copy waits for it: that arm is copy-bound there);
- correctness: graph replay vs eager step (bit-exact), and both vs the step in fp32.

On a CPU it runs tiny shapes through the torch step (no graphs, floors or vLLM) so that the
driver itself is tested.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from afore.bench.report import markdown_table, write_report
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.ffn.experts import PREFILL_CONFIGS, routed_expert_step, triton_available
from afore.ffn.layer import FFNLayer
from afore.ffn.partition import worker_mask
from afore.migrator.slot_pool import SlotPool
from afore.plan import SlotTable, Target, primary_only_plan

#: name -> (hidden H, expert intermediate I, experts E, top_k)
MODELS = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "GLM-4.5-Air": (4096, 1408, 128, 8)}
CPU_MODELS = {"tiny": (64, 32, 16, 4)}
TARGETS = {"decode_vs_floor": 1.5, "decode_host_fed_vs_floor": 1.5, "decode_vs_gemm": 1.2, "prefill_vs_floor": 1.3,
           "changed_vs_unchanged": 1.05}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--part ffn")
    g.add_argument("--models", default=None, help=f"comma-separated subset of {', '.join(MODELS)}")
    g.add_argument("--decode-loads", default="8,16,32,64,128,256,512", help="pairs per worker (decode, graphs)")
    g.add_argument("--prefill-loads", default="2048,4096,8192,16384", help="pairs per worker (prefill, eager)")
    g.add_argument("--workers", type=int, default=8, help="F: the worker's share is 1/F of the layer")
    g.add_argument("--redundant-slots", type=int, default=4)
    g.add_argument("--reps", type=int, default=20, help="timed calls per measurement")
    g.add_argument("--plans", type=int, default=8, help="distinct plans in the changed-plan arms")
    g.add_argument("--vllm", choices=("auto", "off"), default="auto", help="compare with vLLM's fused_moe if importable")


# ---------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_ms(fn, device: torch.device, reps: int, warmup: int = 3) -> float:
    """Time per call of ``reps`` back-to-back calls (CUDA events around the loop on a GPU:
    the GPU's timeline, which includes host overhead when the host is the slower side)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def capture(fn, device: torch.device) -> "torch.cuda.CUDAGraph":
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)
    return graph


def device_rates(device: torch.device) -> dict:
    """Copy rate (bytes read + written per second) and bf16 matmul rate, measured now."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = statistics.median(per_call_ms(lambda: dst.copy_(src), device, 10) for _ in range(3))
    del src, dst
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = per_call_ms(lambda: a @ b, device, 10)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_gbps": 2 * (1 << 30) / copy_ms / 1e6, "matmul_tflops": 2 * n ** 3 / mm_ms / 1e9,
            "copy_bytes": 1 << 30, "matmul_n": n}


# ---------------------------------------------------------------------------- inputs


def routing(tokens: int, e: int, k: int, rng: np.random.Generator, skew: float = 1.0):
    """(ids int32 [T, k] distinct per row, weights fp32 [T, k]): Zipf-skewed, Gumbel top-k."""
    popularity = rng.permutation(1.0 / np.arange(1, e + 1) ** skew)
    keys = np.log(popularity)[None, :] + rng.gumbel(size=(tokens, e))
    ids = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    weights = rng.random((tokens, k))
    weights /= weights.sum(axis=1, keepdims=True)
    return torch.as_tensor(ids, dtype=torch.int32), torch.as_tensor(weights, dtype=torch.float32)


def plan_for(shape: ClusterShape, ids: torch.Tensor, seq: int):
    """Algorithm 1's plan for this routing from an empty slot table (replicas and copies);
    the primary-only plan if the scheduler is unavailable."""
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=shape.num_experts)
    try:
        from afore.scheduler.algorithm import schedule

        protected = np.zeros((shape.num_workers, shape.redundant_slots), bool)
        plan, _ = schedule(shape, demand, SlotTable.empty(shape), protected, None,
                           SchedulerParams(copy_budget=shape.redundant_slots), CostModel(window_ms=10.0),
                           Target(seq, 0, 0), seq)
        return plan, "algorithm 1"
    except Exception as exc:  # noqa: BLE001 - keep measuring with the always-valid plan
        print(f"scheduler unavailable ({exc}); primary-only plans", file=sys.stderr)
        return primary_only_plan(shape, demand, Target(seq, 0, 0), seq), "primary-only"


def rebound_plans(plan, shape: ClusterShape, count: int, rng: np.random.Generator) -> list:
    """``count`` plans with ``plan``'s assignment whose replicas on worker 0 sit in permuted
    redundant slots (a new slot map each), each listing the copies into its new bindings."""
    p0, r = int(shape.primary_counts[0]), shape.redundant_slots
    owner = shape.primary_owner
    out = []
    for j in range(count):
        slot = plan.slot.copy()
        perm = rng.permutation(r) if j else np.arange(r)
        red = np.nonzero(slot[:, 0] >= p0)[0]
        slot[red, 0] = p0 + perm[slot[red, 0] - p0]
        copies = np.array([[e, owner[e], 0, slot[e, 0]] for e in red], np.int32).reshape(-1, 4)
        out.append(dataclasses.replace(plan, slot=slot, copies=copies, seq=plan.seq * 1000 + j + 1))
    return out


def _vllm():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts, override_config
        from vllm.model_executor.layers.fused_moe.fused_moe import get_moe_configs
        import vllm
    except Exception as exc:  # noqa: BLE001
        return None, f"not importable: {type(exc).__name__}: {exc}"
    return (fused_experts, override_config, get_moe_configs), f"vLLM {vllm.__version__}"


# ---------------------------------------------------------------------------- one model


def bench_model(name: str, dims: tuple, args, device: torch.device, rates: dict | None, vllm, rng) -> dict:
    h, inter, e, k = dims
    f = args.workers
    shape = ClusterShape(num_experts=e, num_workers=f, redundant_slots=args.redundant_slots, top_k=k, m_tile=16)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    pool = SlotPool(shape, 0, h, inter, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    pool.storage.normal_(0.0, 1.0 / h ** 0.5, generator=gen)
    decode = [int(x) for x in args.decode_loads.split(",") if x]
    prefill = [int(x) for x in args.prefill_loads.split(",") if x]
    buckets = tuple(sorted({max(1, load * f // k) for load in decode}))
    graphed = FFNLayer(pool, graph_buckets=buckets) if gpu else FFNLayer(pool, backend="torch")
    eager = FFNLayer(pool, graphs=False) if gpu else None
    host_fed = None
    if gpu:  # the shm transport's worker step: host routing, one packed copy in, one replay, one copy out
        host_fed = FFNLayer(pool, graph_buckets=buckets)
        host_fed.capture_graphs(host_fed=True)
    bytes_per_expert = 3 * h * inter * pool.storage.element_size()
    rows, prefill_rows, sweep = [], [], []
    from afore.migrator.copy_engine import make_copy_engine

    # full rate: one expert copied per step must fit inside a decode step (the paced default
    # stretches a copy over the attention window, which this loop does not have)
    engine = make_copy_engine(device, threaded=False, max_gbps=None)
    owner = torch.as_tensor(shape.primary_owner, device=device)
    for load in tqdm(decode + prefill, desc=name, file=sys.stdout):
        is_prefill = load in prefill and load not in decode
        tokens = max(1, load * f // k)
        ids, weights = routing(tokens, e, k, rng)
        plan, planner = plan_for(shape, ids, seq=load)
        x = (torch.randn(tokens, h, generator=gen, device=device) * 0.5).to(dtype)
        ids_d, w_d = ids.to(device), weights.to(device)
        mine = worker_mask(ids_d, torch.as_tensor(plan.assignment, device=device), owner, 0)
        flat = ids_d.reshape(-1).long()
        pairs = int(mine.sum())
        active = int(torch.unique(flat[mine]).numel())
        row = {"model": name, "load": load, "tokens": tokens, "pairs": pairs, "gathered_pairs": tokens * k,
               "active_slots": active, "weight_bytes": active * bytes_per_expert, "planner": planner,
               "replicas_on_worker": int(np.count_nonzero(plan.slot[:, 0] >= pool.num_primaries))}
        if rates:
            row["hbm_floor_ms"] = active * bytes_per_expert / (rates["copy_gbps"] * 1e6)
            row["tc_floor_ms"] = 6 * h * inter * pairs / (rates["matmul_tflops"] * 1e9)
            row["floor_ms"] = max(row["hbm_floor_ms"], row["tc_floor_ms"])
        graphed.stage_plan(plan)
        reps = args.reps if not is_prefill else max(3, args.reps // 6)
        step = lambda: graphed(x, ids_d, w_d, plan)  # noqa: E731
        out = step()
        row["step_ms"] = per_call_ms(step, device, reps)
        if gpu:
            eager.stage_plan(plan)
            out_e = eager(x, ids_d, w_d, plan)
            row["eager_ms"] = per_call_ms(lambda: eager(x, ids_d, w_d, plan), device, reps)
            row["graph_equals_eager"] = bool(torch.equal(out, out_e)) if not is_prefill else None
            errs = torch.zeros(1, dtype=torch.int32, device=device)
            table = graphed.plan_table.upload(graphed.plan_table.stage(plan), tokens * k)
            # fp32 copies of the pool as it is now (the copy arms of earlier loads rewrote slots)
            ref = routed_expert_step(x.float(), ids_d, w_d, table, pool.w13.float(), pool.w2.float(), errs, e, "triton")
            row["rel_error_vs_fp32"] = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
            if not is_prefill:
                bucket = min(b for b in buckets if b >= tokens)
                row["replay_ms"] = per_call_ms(graphed.graphs.graphs[bucket].replay, device, reps)
                st = graphed.graphs.inputs[bucket]
                row["config"] = dataclasses.asdict(st.config)
                from afore.ffn import _triton_kernels as kernels

                gemm = capture(lambda: kernels.launch_experts(st.hidden, st.weights.view(-1), pool.w13, pool.w2,
                                                              st.buffers, k, st.config), device)
                row["gemm_ms"] = per_call_ms(gemm.replay, device, reps)
                ep = graphed.plan_table.width
                route = capture(lambda: kernels.launch_route(st.ids.view(-1), table, st.buffers, errs, e, ep,
                                                             st.config.block_m), device)
                row["route_ms"] = per_call_ms(route.replay, device, reps)
                combine = capture(lambda: kernels.launch_combine(st.buffers, table, st.out, ep, k), device)
                row["combine_ms"] = per_call_ms(combine.replay, device, reps)
                hb, ib, wb = graphed.input_buffers(tokens)  # received in place: no input copies
                hb.copy_(x)
                ib.copy_(ids_d)
                wb.copy_(w_d)
                row["step_zero_copy_ms"] = per_call_ms(lambda: graphed(hb, ib, wb, plan), device, reps)
                row.update(_host_fed_arm(host_fed, plan, x, ids, weights, out, reps))
                row.update(_plan_change_arms(graphed, pool, plan, shape, x, ids_d, w_d, engine, args, device, rng))
            else:
                from afore.ffn import _triton_kernels as kernels
                from afore.ffn.experts import StepBuffers

                cfg0 = PREFILL_CONFIGS[0]
                buf = StepBuffers(tokens * k, pool.num_slots, h, inter, e, dtype, device, cfg0.block_m)
                ep = graphed.plan_table.width
                row["route_ms"] = per_call_ms(lambda: kernels.launch_route(ids_d.view(-1), table, buf, errs, e, ep,
                                                                           cfg0.block_m), device, reps)
                row["gemm_ms"] = per_call_ms(lambda: kernels.launch_experts(x, w_d.view(-1), pool.w13, pool.w2, buf, k,
                                                                            cfg0), device, reps)
                out_buf = torch.empty_like(x)
                row["combine_ms"] = per_call_ms(lambda: kernels.launch_combine(buf, table, out_buf, ep, k), device, reps)
                del buf
                for cfg in PREFILL_CONFIGS:
                    fn = lambda: routed_expert_step(x, ids_d, w_d, table, pool.w13, pool.w2, errs, e, "triton", cfg)  # noqa: E731
                    try:
                        sweep.append({"model": name, "load": load, "config": dataclasses.asdict(cfg),
                                      "ms": per_call_ms(fn, device, reps)})
                    except Exception as exc:  # noqa: BLE001
                        sweep.append({"model": name, "load": load, "config": dataclasses.asdict(cfg), "error": str(exc)[:200]})
                try:
                    torch_layer = FFNLayer(pool, backend="torch")
                    torch_layer.stage_plan(plan)
                    row["torch_grouped_mm_ms"] = per_call_ms(lambda: torch_layer(x, ids_d, w_d, plan), device, reps)
                except Exception as exc:  # noqa: BLE001
                    row["torch_grouped_mm_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if vllm is not None:
                row.update(_vllm_arms(vllm, pool, plan, shape, x, ids_d, w_d, mine, ref, tokens, is_prefill, reps, device))
        (prefill_rows if is_prefill else rows).append(row)
    engine.close()
    return {"decode": rows, "prefill": prefill_rows, "prefill_config_sweep": sweep,
            "shape": {"hidden": h, "intermediate": inter, "experts": e, "top_k": k, "workers": f,
                      "slots": pool.num_slots, "bytes_per_expert": bytes_per_expert, "dtype": str(dtype)}}


def _host_fed_arm(layer: FFNLayer, plan, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  step_out: torch.Tensor, reps: int) -> dict:
    """``FFNLayer.forward_host_routed`` as a GPU worker of the shm transport calls it: ids and
    weights on the host, its tokens' rows gathered from host memory into the packed pinned buffer,
    one copy in, the replay, one copy out, one wait. Wall time per call (the worker waits for it),
    and its rows against the device step's output for the same tokens."""
    x_host = x.cpu()
    ids_h, w_h = ids.to(torch.int32).cpu().contiguous(), weights.float().cpu().contiguous()

    def gather(tokens: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(x_host, 0, tokens, out=out)

    layer.stage_plan(plan)
    call = lambda: layer.forward_host_routed(gather, ids_h, w_h, plan)  # noqa: E731
    tokens, rows = call()
    want = step_out[tokens.to(step_out.device)].float().cpu()
    err = float((rows.float() - want).norm() / want.norm().clamp_min(1e-30)) if tokens.numel() else 0.0
    for _ in range(3):
        call()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    return {"host_fed_ms": (time.perf_counter() - t0) * 1e3 / reps, "host_fed_rel_error_vs_step": err,
            "host_fed_graphed": bool(layer.host_feeding)}


def _plan_change_arms(layer, pool, plan, shape, x, ids, weights, engine, args, device, rng) -> dict:
    """Same plan every step vs a new slot map every step, without and with one expert copy a step."""
    from afore.migrator.copy_engine import CopyJob

    plans = rebound_plans(plan, shape, args.plans, rng)
    for p in plans:
        layer.stage_plan(p)
    reps = args.reps
    same = per_call_ms(lambda: layer(x, ids, weights, plans[0]), device, reps)
    state = {"i": 0}

    def changed():
        state["i"] += 1
        layer(x, ids, weights, plans[state["i"] % len(plans)])

    changed_ms = per_call_ms(changed, device, reps)
    out = {"same_plan_ms": same, "changed_plan_ms": changed_ms}
    def job(p):  # one expert into the first replica's new slot (the copy a plan change brings)
        if not len(p.copies):
            return []
        ex, _, _, s = (int(v) for v in p.copies[0])
        primaries = pool.primary_experts()
        src = primaries.index(ex) if ex in primaries else 0  # same bytes moved either way
        return [CopyJob(pool.w13[s], pool.w2[s], pool.w13[src], pool.w2[src])]

    jobs = [job(p) for p in plans]
    if any(jobs):
        pending = {"batch": engine.submit(jobs[0], [])}

        def changed_with_copy():
            state["i"] += 1
            i = state["i"] % len(plans)
            engine.wait(pending["batch"])  # commit: a stream wait on the copy's event, never a host wait
            layer(x, ids, weights, plans[i])
            # the next plan's copy overlaps this step; it waits for this step's reads
            pending["batch"] = engine.submit(jobs[(i + 1) % len(plans)], [engine.read_fence()])

        out["changed_plan_with_copy_ms"] = per_call_ms(changed_with_copy, device, reps)
        out["copy_engine"] = engine.describe() if hasattr(engine, "describe") else type(engine).__name__
    return out


def _vllm_arms(vllm, pool, plan, shape, x, ids, weights, mine, ref, tokens, is_prefill, reps, device) -> dict:
    fused_experts, override_config, get_moe_configs = vllm
    k_slots = pool.num_slots
    slot_of = torch.as_tensor(plan.slot[:, 0].astype(np.int64), device=device)
    local = torch.where(mine.view_as(ids), slot_of[ids.long()], k_slots).to(torch.int32)
    expert_map = torch.cat([torch.arange(k_slots, device=device), torch.full((1,), -1, device=device)]).to(torch.int32)
    w13, w2 = pool.w13, pool.w2
    out = {}

    def run(config=None):
        if config is None:
            return fused_experts(x, w13, w2, weights, local, global_num_experts=k_slots + 1, expert_map=expert_map)
        with override_config(config):
            return fused_experts(x, w13, w2, weights, local, global_num_experts=k_slots + 1, expert_map=expert_map)

    arms = [("vllm", None)]
    try:
        tuned = get_moe_configs(shape.num_experts, pool.intermediate, None)
    except Exception:  # noqa: BLE001
        tuned = None
    if tuned:
        arms.append(("vllm_tuned", tuned[min(tuned, key=lambda m: abs(m - tokens))]))
    for key, config in arms:
        try:
            got = run(config)
            out[f"{key}_rel_error_vs_fp32"] = float((got.float() - ref).norm() / ref.norm().clamp_min(1e-30))
            out[f"{key}_eager_ms"] = per_call_ms(lambda: run(config), device, reps)
            if not is_prefill:
                graph = capture(lambda: run(config), device)
                out[f"{key}_graph_ms"] = per_call_ms(graph.replay, device, reps)
            if config is not None:
                out[f"{key}_config"] = config
        except Exception as exc:  # noqa: BLE001 - record and go on
            out[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


# ---------------------------------------------------------------------------- report


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def judge(data: dict) -> dict:
    """Worst ratios over the loads, against the issue's targets."""
    decode = [r for m in data["models"].values() for r in m["decode"]]
    prefill = [r for m in data["models"].values() for r in m["prefill"]]

    def worst(rows, a, b):
        vals = [_ratio(r.get(a), r.get(b)) for r in rows]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    out = {"decode_vs_floor": worst(decode, "step_ms", "floor_ms"),
           "decode_host_fed_vs_floor": worst(decode, "host_fed_ms", "floor_ms"),
           "decode_vs_gemm": worst(decode, "step_ms", "gemm_ms"),
           "prefill_vs_floor": worst(prefill, "step_ms", "floor_ms"),
           "changed_vs_unchanged": worst(decode, "changed_plan_ms", "same_plan_ms"),
           "changed_with_copy_vs_unchanged": worst(decode, "changed_plan_with_copy_ms", "same_plan_ms")}
    return {key: {"worst": v, "target": TARGETS.get(key), "met": None if v is None or key not in TARGETS else v <= TARGETS[key]}
            for key, v in out.items()}


def _markdown(data: dict) -> str:
    env = data["env"]
    lines = [f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}; {env['vllm']}.", ""]
    if env.get("rates"):
        r = env["rates"]
        lines += [f"Measured in this run: device copy {r['copy_gbps']:.0f} GB/s (bytes read + written, 1 GiB), "
                  f"bf16 matmul {r['matmul_tflops']:.0f} TFLOP/s ({r['matmul_n']}^3). All times are measured "
                  "(CUDA events); floors are computed from these two rates.", ""]
    lines += ["## Targets (worst over loads and models)", "",
              markdown_table(["ratio", "worst", "target", "met"],
                             [[k, v["worst"], v["target"], v["met"]] for k, v in data["targets"].items()]), ""]
    for name, m in data["models"].items():
        s = m["shape"]
        lines += [f"## {name} (H={s['hidden']}, I={s['intermediate']}, E={s['experts']}, top-{s['top_k']}, "
                  f"F={s['workers']}, {s['slots']} slots, {s['dtype']})", "",
                  "Decode (CUDA graphs). `step`: FFNLayer.forward as the worker calls it; `host-fed`: "
                  "FFNLayer.forward_host_routed as a GPU worker of the shm transport calls it (host ids and rows, one "
                  "packed copy in, the replay, one copy out, one wait; wall time per call); `replay`: the graph alone; "
                  "`gemm`: the two expert kernels alone (graph); `eager`: same kernels without graphs; vLLM: "
                  "fused_experts on the same pairs (graph / eager).", ""]
        headers = ["pairs", "active", "floor ms", "step ms", "step/floor", "host-fed ms", "host-fed/floor",
                   "step in-place ms", "replay ms", "route ms",
                   "gemm ms", "combine ms", "step/gemm",
                   "eager ms", "vllm graph ms", "vllm tuned graph ms", "vllm eager ms", "same plan ms",
                   "changed ms", "changed+copy ms", "graph==eager", "rel err"]
        rows = [[r["pairs"], r["active_slots"], r.get("floor_ms"), r.get("step_ms"), _ratio(r.get("step_ms"), r.get("floor_ms")),
                 r.get("host_fed_ms"), _ratio(r.get("host_fed_ms"), r.get("floor_ms")), r.get("step_zero_copy_ms"), r.get("replay_ms"), r.get("route_ms"), r.get("gemm_ms"), r.get("combine_ms"),
                 _ratio(r.get("step_ms"), r.get("gemm_ms")), r.get("eager_ms"),
                 r.get("vllm_graph_ms"), r.get("vllm_tuned_graph_ms"), r.get("vllm_eager_ms"), r.get("same_plan_ms"),
                 r.get("changed_plan_ms"), r.get("changed_plan_with_copy_ms"), r.get("graph_equals_eager"),
                 r.get("rel_error_vs_fp32")] for r in m["decode"]]
        lines += [markdown_table(headers, rows), ""]
        if m["prefill"]:
            lines += ["Prefill (eager launches). Floor = max(HBM, tensor core).", "",
                      markdown_table(["pairs", "tc floor ms", "hbm floor ms", "step ms", "step/floor", "route ms", "gemm ms",
                                      "combine ms", "torch _grouped_mm ms", "vllm ms", "vllm tuned ms", "rel err"],
                                     [[r["pairs"], r.get("tc_floor_ms"), r.get("hbm_floor_ms"), r.get("step_ms"),
                                       _ratio(r.get("step_ms"), r.get("floor_ms")), r.get("route_ms"), r.get("gemm_ms"),
                                       r.get("combine_ms"), r.get("torch_grouped_mm_ms"),
                                       r.get("vllm_eager_ms"), r.get("vllm_tuned_eager_ms"), r.get("rel_error_vs_fp32")]
                                      for r in m["prefill"]]), ""]
        errors = sorted({v for r in m["decode"] + m["prefill"] for key, v in r.items() if key.endswith("_error")})
        if errors:
            lines += ["vLLM errors: " + "; ".join(errors), ""]
    for model, err in data.get("errors", {}).items():
        lines += [f"**{model} failed**: {err}", ""]
    return "\n".join(lines)


def _figure(data: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(data["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        rows = sorted(data["models"][name]["decode"] + data["models"][name]["prefill"], key=lambda r: r["pairs"])
        pairs = [r["pairs"] for r in rows]
        for key, label in (("floor_ms", "floor"), ("step_ms", "afore step"), ("gemm_ms", "grouped GEMM alone"),
                           ("vllm_graph_ms", "vLLM fused_moe (graph)"), ("vllm_eager_ms", "vLLM fused_moe (eager)")):
            pts = [(p, r[key]) for p, r in zip(pairs, rows) if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("pairs on the worker")
        ax.set_ylabel("ms per step")
        ax.set_title(name)
        ax.legend(fontsize=8)
    return fig


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and device.type != "cuda":
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    gpu = device.type == "cuda"
    if gpu:
        device = torch.device("cuda", torch.cuda.current_device())  # the copy engine needs the index
    if gpu and not triton_available():
        print("triton is not importable: the GPU step needs it", file=sys.stderr)
        return 2
    models = MODELS if gpu else CPU_MODELS
    if args.models:
        wanted = args.models.split(",")
        unknown = [m for m in wanted if m not in models]
        if unknown:
            print(f"--models: unknown {unknown}; expected some of {sorted(models)}", file=sys.stderr)
            return 2
        models = {m: models[m] for m in wanted}
    if not gpu:
        args.decode_loads = ",".join(x for x in args.decode_loads.split(",") if x and int(x) <= 32) or "8"
        args.prefill_loads = "256"
    rng = np.random.default_rng(args.seed)
    vllm, vllm_note = (None, "vLLM off") if args.vllm == "off" or not gpu else _vllm()
    import triton

    env = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "torch": torch.__version__,
           "triton": triton.__version__ if triton_available() else None, "vllm": vllm_note,
           "rates": device_rates(device) if gpu else None}
    print(f"env: {env}")
    data = {"env": env, "models": {}, "errors": {}}
    name = args.name or ("dataplane_ffn" if gpu else "dataplane_ffn_cpu")
    for model, dims in models.items():
        try:
            data["models"][model] = bench_model(model, dims, args, device, env["rates"], vllm, rng)
        except Exception as exc:  # noqa: BLE001 - report what ran, name what failed
            import traceback

            traceback.print_exc()
            data["errors"][model] = f"{type(exc).__name__}: {exc}"
        if gpu:
            torch.cuda.empty_cache()
        data["targets"] = judge(data)
        paths = write_report(name, data, _markdown(data), _figure(data), args.out_dir)  # after every model
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    for key, v in data["targets"].items():
        print(f"{key}: worst {v['worst']} (target {v['target']}, met {v['met']})")
    return 0
