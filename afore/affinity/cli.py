"""`afore profile affinity`: per-layer co-activation profiles, a co-clustered primary layout, a plot.

  afore profile affinity --source olmoe [--olmoe-dir DIR --model olmoe --domains a,b --tokens N] --out P.npz
  afore profile affinity --source trace --trace T.npz --attn-workers A --out P.npz     (counts: live demand kind)
  afore profile affinity --source synthetic --experts E --top-k K --out P.npz
  afore profile affinity ... --workers F --layout-out L.json   (co-clustered primaries for afore serve)
      [--objective fanout|pairwise]   fanout (default where the profile has per-token expert sets):
      minimise FFN workers per token (cocluster.fanout_cluster); pairwise: Sem-MoE's in-set
      co-activation (cocluster.co_cluster; the only choice for --source trace, counts only)

The PNG beside the profile shows, for the first profiled layer, the co-activation matrix with the
experts ordered by their co-clustered set (when --workers is given) and the class-expert affinity.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from afore.affinity import cocluster, olmoe
from afore.config import ClusterShape
from afore.affinity.profile import AffinityProfile, DemandProfiler, profile_from_tokens, save_profile
from afore.affinity.token_model import semmoe_synthetic

SEARCH_TOKENS = 20_000   # tokens per layer the fan-out co-clustering searches on (its cost is linear in them)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="profile_command", required=True)
    aff = sub.add_parser("affinity", help="token-expert and expert-expert co-activation per layer (.npz + .png), optional co-clustered layout")
    aff.add_argument("--source", choices=("olmoe", "trace", "synthetic"), required=True,
                     help="olmoe: ../shared/traces/olmoe cross-layer routing (token model); trace: an afore trace's counts "
                          "(as the attention workers' demand: microbatch co-activation); synthetic: Sem-MoE-strength affinity")
    aff.add_argument("--olmoe-dir", default=None, help="OLMoE data folder (default: $AFORE_TRACES/olmoe or ../shared/traces/olmoe)")
    aff.add_argument("--model", default="olmoe", choices=sorted(olmoe.MODELS), help="model in the OLMoE CSVs (default olmoe)")
    aff.add_argument("--domains", default=",".join(olmoe.DOMAINS), help="comma-separated OLMoE domains to profile (default: all five)")
    aff.add_argument("--tokens", type=int, default=100_000, help="tokens sampled per layer from the token model (default 100000)")
    aff.add_argument("--trace", default=None, help="afore trace (.npz) for --source trace")
    aff.add_argument("--attn-workers", type=int, default=1, help="--source trace: microbatch b counts as attention worker b %% A (default 1)")
    aff.add_argument("--experts", type=int, default=64, help="--source synthetic: experts per layer (default 64)")
    aff.add_argument("--top-k", type=int, default=8, help="--source synthetic: experts per token (default 8)")
    aff.add_argument("--seed", type=int, default=0)
    aff.add_argument("--out", required=True, help="profile file (.npz); the plot is written beside it (.png)")
    aff.add_argument("--workers", type=int, default=0, help="also co-cluster the experts into this many FFN workers (0 = no layout)")
    aff.add_argument("--load-slack", type=float, default=0.1, help="co-clustering: a set's expected load may exceed the mean by this fraction (default 0.1)")
    aff.add_argument("--objective", choices=("fanout", "pairwise"), default=None,
                     help="co-clustering objective: fanout (FFN workers per token, needs per-token expert sets: "
                          "--source olmoe/synthetic; the default there) or pairwise (in-set co-activation; default for --source trace)")
    aff.add_argument("--layout-out", default=None, help="with --workers: write the layout as JSON (for afore serve --primaries-file)")


def run(args: argparse.Namespace) -> int:
    try:
        profile, tokens = build_profile(args)
        objective = args.objective or ("fanout" if tokens is not None else "pairwise")
        if objective == "fanout" and tokens is None:
            raise ValueError("--objective fanout: needs per-token expert sets (--source olmoe or synthetic); "
                             "a trace's counts give only microbatch co-activation (use --objective pairwise)")
        path = save_profile(profile, args.out)
        print(f"wrote {path}: {profile.num_layers} layer(s), {profile.num_experts} experts, top-{profile.top_k}, "
              f"{profile.coactivation_kind}-level co-activation, classes = {profile.class_kind}")
        owner = None
        if args.workers:
            co, load = profile.pooled()
            contiguous = ClusterShape(num_experts=profile.num_experts, num_workers=args.workers, top_k=1).primary_owner
            if objective == "fanout":   # all profiled layers' tokens together (one layout for every layer)
                ids = np.concatenate(tokens)
                owner = cocluster.fanout_cluster(ids, profile.num_experts, args.workers, load=load,
                                                 load_slack=args.load_slack, seed=args.seed)
                print(f"fan-out co-clustered primaries for F={args.workers}: {cocluster.mean_fanout(ids, owner):.2f} FFN workers "
                      f"per token on the profiled tokens (contiguous {cocluster.mean_fanout(ids, contiguous):.2f})")
            else:
                owner = cocluster.co_cluster(co, load, args.workers, args.load_slack)
            print(f"co-clustered primaries for F={args.workers} ({objective}): in-set co-activation {cocluster.in_set_share(co, owner):.3f} "
                  f"(contiguous {cocluster.in_set_share(co, contiguous):.3f}); expected set load max/mean "
                  f"{cocluster.set_load_ratio(load, owner, args.workers):.3f} (contiguous {cocluster.set_load_ratio(load, contiguous, args.workers):.3f})")
            if args.layout_out:
                layout = {"primaries": owner.tolist(), "num_workers": args.workers, "num_experts": profile.num_experts,
                          "profile": str(path), "load_slack": args.load_slack, "objective": objective}
                Path(args.layout_out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.layout_out).write_text(json.dumps(layout) + "\n")
                print(f"wrote {args.layout_out}")
        figure = render_profile(profile, owner)
        png = path.with_suffix(".png")
        figure.savefig(png, dpi=110, bbox_inches="tight")
        print(f"wrote {png}")
        return 0
    except ValueError as exc:
        print(f"afore profile affinity: {exc}", file=sys.stderr)
        return 2


def build_profile(args: argparse.Namespace) -> tuple[AffinityProfile, list[np.ndarray] | None]:
    """(profile, each profiled layer's per-token expert ids int[N, k], or None for counts-only sources)."""
    rng = np.random.default_rng(args.seed)
    if args.tokens < 1:
        raise ValueError(f"--tokens: expected >= 1, got {args.tokens}")
    if args.source == "olmoe":
        folder = olmoe.find_olmoe_dir(args.olmoe_dir)
        if folder is None:
            raise ValueError("--olmoe-dir: OLMoE data not found (looked in --olmoe-dir, $AFORE_TRACES/olmoe, ../shared/traces/olmoe)")
        domains = [d for d in args.domains.split(",") if d]
        counts = olmoe.read_crosslayer(folder, args.model)
        e, k = olmoe.MODELS[args.model]
        per_layer, layers = [], []
        for pair in olmoe.LAYER_PAIRS:   # a token is of one domain: per-domain classes, reported as the source-layer expert
            ids, classes = olmoe.token_model(counts, pair, domains, per_domain=True).draw(args.tokens, k, rng)
            per_layer.append((ids, classes % e))
            layers.append(pair[1])
        profile = profile_from_tokens(per_layer, e, e, layers, model=args.model, class_kind="source_layer_expert",
                                   source=f"olmoe cross-layer co-routing {folder} (token model, {args.tokens} tokens/layer, seed {args.seed})",
                                   workload=",".join(domains), top_k=k, hidden_size=2048 if args.model == "olmoe" else 4096,
                                   moe_intermediate_size=1024 if args.model == "olmoe" else 14336)
        return profile, [ids[:SEARCH_TOKENS] for ids, _ in per_layer]
    if args.source == "synthetic":
        model = semmoe_synthetic(args.experts, args.top_k, seed=args.seed)
        ids, classes = model.draw(args.tokens, args.top_k, rng)
        profile = profile_from_tokens([(ids, classes)], args.experts, model.num_classes, [0],
                                      model="synthetic", class_kind="token_type", source=model.source, workload="synthetic",
                                      top_k=args.top_k)
        return profile, [ids[:SEARCH_TOKENS]]
    if not args.trace:
        raise ValueError("--trace: required with --source trace")
    from afore.traces.format import load_trace

    trace = load_trace(args.trace)
    if args.attn_workers < 1:
        raise ValueError(f"--attn-workers: expected >= 1, got {args.attn_workers}")
    profiler = DemandProfiler(trace.num_experts, trace.num_layers, args.attn_workers, trace.top_k)
    profiler.add_counts(trace.counts)
    return profiler.profile(model=trace.model, source=f"demand of {args.trace} ({trace.source})", workload=trace.workload,
                            hidden_size=trace.hidden_size, moe_intermediate_size=trace.moe_intermediate_size), None


def render_profile(profile: AffinityProfile, owner: np.ndarray | None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    co = profile.coactivation[0].copy()
    order = np.argsort(owner, kind="stable") if owner is not None else np.arange(profile.num_experts)
    tokens = max(int(profile.tokens[0]), 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    shown = co[np.ix_(order, order)] / tokens
    np.fill_diagonal(shown, np.nan)
    im = axes[0].imshow(shown, cmap="viridis")
    axes[0].set_title(f"layer {int(profile.layers[0])}: co-activation (share of tokens)\n"
                      + ("experts ordered by co-clustered set" if owner is not None else "experts in id order"))
    if owner is not None:
        bounds = np.flatnonzero(np.diff(np.sort(owner))) + 0.5
        for b in bounds:
            axes[0].axhline(b, color="w", lw=0.5)
            axes[0].axvline(b, color="w", lw=0.5)
    fig.colorbar(im, ax=axes[0], fraction=0.046)
    ce = profile.class_expert[0]
    ce = ce / np.maximum(ce.sum(axis=1, keepdims=True), 1e-300)
    im2 = axes[1].imshow(ce[:, order], aspect="auto", cmap="magma")
    axes[1].set_title(f"token-expert affinity: P(expert | {profile.class_kind})")
    axes[1].set_xlabel("expert")
    axes[1].set_ylabel(profile.class_kind)
    fig.colorbar(im2, ax=axes[1], fraction=0.046)
    fig.suptitle(f"{profile.model}: {profile.source}", fontsize=8)
    return fig
