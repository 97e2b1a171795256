"""The report of ``afore bench migration``: the cost model the scheduler reads, the targets the
measurements are judged by, the markdown tables and the figure."""

from __future__ import annotations

from afore.bench.migration.shapes import COST_MODEL_SHAPE
from afore.bench.migration.timing import fit_line
from afore.config import CostModel


def measured_cost_model(data: dict, shapes: dict) -> CostModel:
    name = COST_MODEL_SHAPE if COST_MODEL_SHAPE in shapes else next(iter(shapes))
    h, inter, _, _ = shapes[name]
    elem = 2 if data["dtype"] == "torch.bfloat16" else 4
    kw = {"bytes_per_expert": 3 * h * inter * elem}
    if "kernels" in data:
        kw["beta_tile_ms"] = max(data["kernels"]["beta_tile"][name]["beta_tile_ms"], 1e-6)
    if "copies" in data:
        rows = [r for r in data["copies"]["rows"] if r["model"] == name]
        slope, intercept = fit_line([r["experts"] for r in rows], [r["ms"] for r in rows])
        # per-copy latency = intercept share; bandwidth from the slope (ms per expert)
        kw["link_bandwidth_gbps"] = kw["bytes_per_expert"] / max(slope, 1e-9) / 1e6
        kw["copy_latency_ms"] = max(intercept, 0.0)
    if "replay" in data and data["replay"]["median_window_ms"]:
        kw["window_ms"] = data["replay"]["median_window_ms"]
    return CostModel(**kw)


def judge_targets(data: dict) -> dict:
    """The issue's H200 targets. The copy and overlap targets are about GPU-to-GPU pulls; with one
    GPU the copies are same-device (not the production path) and are reported, not judged."""
    out = {}
    c = data.get("copies")
    if c and not c.get("cross_device", True):
        out["copy and overlap targets"] = {"value": "not judged: one GPU, same-device copies (HBM to HBM), not a peer pull", "met": "-"}
    elif c:
        batched = [r for r in c["rows"] if r["experts"] >= 8]
        worst = min((r["share_of_large_copy"] for r in batched), default=None)
        if worst is not None:
            out["batched copies >= 85% of the large-copy rate (worst model, >= 8 experts)"] = {"value": f"{worst:.0%}", "met": worst >= 0.85}
    o = data.get("overlap")
    if o and (c is None or c.get("cross_device", True)):
        default = [r for r in o["rows"] if r.get("default", True)]
        worst = max(r["slowdown"] for r in default)
        rate = o.get("default_rate_gbps")
        label = "full-rate" if rate is None else f"default ({rate:g} GB/s paced)"
        out[f"compute slowed <= 3% by concurrent {label} copies (worst)"] = {"value": f"{worst:+.1%}", "met": worst <= 0.03}
        full = [r for r in o["rows"] if r.get("rate_gbps") is None]
        if rate is not None and full:
            out["(for reference) compute slowed by full-rate copies (worst)"] = {"value": f"{max(r['slowdown'] for r in full):+.1%}", "met": "-"}
    r = data.get("replay")
    if r and r["share_zero_exposed_when_fits"] is not None:
        s = r["share_zero_exposed_when_fits"]
        out["zero exposed wait on >= 99% of targets whose copy fits the window"] = {"value": f"{s:.1%}", "met": s >= 0.99}
    k = data.get("kernels")
    if k and k["grouped_vs_loop"]:
        worst = min(x["speedup"] for x in k["grouped_vs_loop"])
        out["grouped GEMM faster than the matmul loop at every load"] = {"value": f"min speedup {worst:.2f}x", "met": worst > 1.0}
    return out



def _ms_sum(metrics: dict, family: str) -> float:
    """Sum of histogram ``family`` in ms from a scraped sample dict: ``FAMILY_seconds_sum`` (current
    names) or ``FAMILY_ms_sum`` (results recorded before the metrics moved to base units)."""
    if f"{family}_seconds_sum" in metrics:
        return metrics[f"{family}_seconds_sum"] * 1e3
    return metrics.get(f"{family}_ms_sum", 0.0)


def _count(metrics: dict, family: str) -> float:
    return metrics.get(f"{family}_seconds_count", metrics.get(f"{family}_ms_count", 0.0))


def report_markdown(data: dict) -> str:
    from afore.bench.report import markdown_table

    lines = [f"Device: {data['device']}; GPUs: {data['gpus']}; dtype {data['dtype']}.", ""]
    cm = data.get("cost_model")
    if cm:
        lines += ["## Cost model (read by `afore.scheduler.cost`)", "",
                  markdown_table(list(cm), [[round(v, 6) if isinstance(v, float) else v for v in cm.values()]]), ""]
    k = data.get("kernels")
    if k:
        lines += ["## Grouped GEMM correctness (bf16 vs fp32 torch)", "",
                  markdown_table(["model", "backend", "rel error", "NaN"], [[c["model"], c["backend"], f"{c['rel_error']:.2e}", c["nan"]] for c in k["check"]]), "",
                  "## Grouped GEMM vs per-expert matmul loop (decode loads)", "",
                  "Both eager (host launch overhead included, as the worker loop runs them); `graph ms` is the grouped GEMM "
                  "replayed as a CUDA graph (GPU time), `floor ms` the time to read the active slots' weights once at 4.8 TB/s.", "",
                  markdown_table(["model", "slots", "active", "pairs", "grouped ms", "graph ms", "floor ms", "loop ms", "speedup"],
                                 [[r["model"], r["slots"], r.get("active_slots"), r["pairs"], f"{r['grouped_ms']:.4f}", f"{r['grouped_graph_ms']:.4f}",
                                   "-" if r.get("weight_read_floor_ms") is None else f"{r['weight_read_floor_ms']:.4f}",
                                   f"{r['loop_ms']:.4f}", f"{r['speedup']:.2f}"] for r in k["grouped_vs_loop"]]), "",
                  "## beta_tile (grouped GEMM ms per 16-pair tile, slope of a linear fit)", "",
                  markdown_table(["model", "tiles", "ms", "beta_tile ms", "intercept ms"],
                                 [[m, v["tiles"], [round(t, 4) for t in v["ms"]], f"{v['beta_tile_ms']:.5f}", f"{v['intercept_ms']:.4f}"] for m, v in k["beta_tile"].items()]), ""]
    c = data.get("copies")
    if c:
        lines += [f"## Expert copies ({'IPC pull from the peer GPU' if c['cross_device'] else 'same device'}, {c.get('engine')}, full rate)", "",
                  f"Large copy ({c['large_copy_bytes'] / 2**30:.2f} GiB): {c['large_copy_ms']:.3f} ms = {c['large_copy_gbps']:.1f} GB/s "
                  f"({c['large_copy_gbps'] / c['nvlink_peak_gbps']:.0%} of the {c['nvlink_peak_gbps']:.0f} GB/s NVLink peak).", "",
                  markdown_table(["model", "experts", "MB/expert", "correct", "ms", "ms/expert", "GB/s", "of peak", "of large copy"],
                                 [[r["model"], r["experts"], f"{r['bytes_per_expert'] / 1e6:.1f}", r.get("correct"), f"{r['ms']:.4f}", f"{r['ms_per_expert']:.4f}",
                                   f"{r['gbps']:.1f}", f"{r['share_of_nvlink_peak']:.0%}", f"{r['share_of_large_copy']:.0%}"] for r in c["rows"]]), ""]
    cv = data.get("copies_variants")
    if cv:
        lines += ["Other copy engines (8 experts per batch; share of each variant's own large-copy rate):", "",
                  markdown_table(["engine", "large copy GB/s", *[m for m in data["copies"]["rows_models"]]],
                                 [[label, f"{v['large_copy_gbps']:.1f}", *[next((f"{r['gbps']:.1f} GB/s ({r['share_of_large_copy']:.0%})"
                                                                                for r in v["rows"] if r["model"] == m and r["experts"] == 8), "-")
                                                                           for m in data["copies"]["rows_models"]]] for label, v in cv.items()]), ""]
    o = data.get("overlap")
    if o:
        default = o.get("default_rate_gbps")
        lines += ["## Expert compute slowed by concurrent copies", "",
                  "20 grouped GEMMs as one CUDA graph, alone and while batches of 8 expert copies run on the side stream, "
                  "at full rate and paced to a cap (copies enqueued first; `outlast` = share of runs in which the copies were "
                  "still running when the compute ended; alone and with-copies runs alternate, medians of 15). "
                  f"The FFN worker's default is {'full rate' if default is None else f'{default:g} GB/s'} "
                  "(faster only when a plan's copies would otherwise not fit the lookahead window).", "",
                  markdown_table(["model", "pairs", "copy rate", "achieved GB/s", "correct", "alone ms", "with copies ms", "slowdown", "outlast"],
                                 [[r["model"], r["pairs"], ("full" if r.get("rate_gbps") is None else f"{r['rate_gbps']:g} GB/s")
                                   + (" (default)" if r.get("default") else ""), f"{r.get('achieved_gbps', 0):.1f}", r.get("copies_correct"),
                                   f"{r['alone_ms']:.3f}", f"{r['with_copies_ms']:.3f}", f"{r['slowdown']:+.1%}",
                                   f"{r['copies_outlast']:.0%}"] for r in o["rows"]]), ""]
    r = data.get("replay")
    if r:
        share = r["share_zero_exposed_when_fits"]
        lines += ["## Trace replay: exposed wait vs lookahead window (2 FFN workers)", "",
                  f"Trace: {r['source']}; {r['targets']} targets per worker; rejected plans: {r['rejected']}.", "",
                  f"Among the {r['targets_with_copies_fitting']} targets with copies that fit the window, zero exposed wait on "
                  f"{'n/a' if r['share_zero_exposed_when_fits_with_copies'] is None else format(r['share_zero_exposed_when_fits_with_copies'], '.1%')}.", "",
                  markdown_table(["targets with copies", "copy fits window", "zero exposed when fits", "median window ms",
                                  "median raw copy ms", "max exposed ms", "total exposed ms"],
                                 [[r["targets_with_copies"], r["targets_copy_fits_window"], "n/a" if share is None else f"{share:.1%}",
                                   f"{r['median_window_ms']:.3f}", "n/a" if r["median_raw_copy_ms_with_copies"] is None else f"{r['median_raw_copy_ms_with_copies']:.3f}",
                                   f"{r['max_exposed_ms']:.3f}", f"{r['total_exposed_ms']:.3f}"]]), ""]
    wk = data.get("worker")
    if wk:
        lines += ["## FFN workers end to end (attention connector here, worker processes, plans via a PlanRing)", "",
                  "The `afore serve --role ffn` round starts the FFN node as `afore serve` would on its own machine (the launcher, "
                  "the scheduler with its TCP demand receiver, the FFN workers) and drives it from here as the attention node does: "
                  "demand over TCP before each target, plans from the scheduler (policy afore), the transport store on the FFN node.", "",
                  markdown_table(["backend", "attention", "FFN workers", "targets", "max rel error vs dense fp64", "median round trip ms",
                                  "window ms (sum/count)", "exposed ms (sum)", "copies", "primary-only", "demand accepted over TCP", "exit codes"],
                                 [[r["backend"], r["attention_device"], ", ".join(r["ffn_devices"]), r["targets"], f"{r['max_rel_error']:.1e}",
                                   f"{r['median_round_trip_ms']:.2f}",
                                   f"{_ms_sum(r['worker0_metrics'], 'afore_ffn_lookahead_window'):.2f}/{_count(r['worker0_metrics'], 'afore_ffn_lookahead_window'):.0f}",
                                   f"{_ms_sum(r['worker0_metrics'], 'afore_ffn_exposed_copy_wait'):.3f}",
                                   f"{r['worker0_metrics'].get('afore_ffn_copies_total', 0):.0f}",
                                   f"{r['worker0_metrics'].get('afore_ffn_primary_only_targets_total', r['worker0_metrics'].get('afore_ffn_primary_only_total', 0)):.0f}",
                                   "-" if "scheduler_metrics" not in r else
                                   f"{sum(v for k, v in r['scheduler_metrics'].items() if 'accepted' in k):.0f}",
                                   r["exit_codes"]] for r in wk["rounds"]]), ""]
    t = data.get("targets")
    if t:
        lines += ["## Targets", "", markdown_table(["target", "value", "met"], [[n, v["value"], v["met"]] for n, v in t.items()]), ""]
    return "\n".join(lines)


def report_figure(data: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    k = data.get("kernels")
    if k:
        for model in {r["model"] for r in k["grouped_vs_loop"]}:
            rows = [r for r in k["grouped_vs_loop"] if r["model"] == model]
            axes[0].plot([r["pairs"] for r in rows], [r["speedup"] for r in rows], marker="o", label=model)
        axes[0].axhline(1.0, color="grey", lw=0.8)
        axes[0].set(xscale="log", xlabel="pairs per worker", ylabel="loop time / grouped time", title="grouped GEMM speedup")
        axes[0].legend(fontsize=7)
    c = data.get("copies")
    if c:
        for model in {r["model"] for r in c["rows"]}:
            rows = [r for r in c["rows"] if r["model"] == model]
            axes[1].plot([r["experts"] for r in rows], [r["gbps"] for r in rows], marker="o", label=model)
        axes[1].axhline(c["large_copy_gbps"], color="k", ls="--", lw=0.8, label="large copy")
        axes[1].axhline(c["nvlink_peak_gbps"], color="r", ls=":", lw=0.8, label="NVLink peak")
        axes[1].set(xscale="log", xlabel="experts per batch", ylabel="GB/s", title="expert copy bandwidth")
        axes[1].legend(fontsize=7)
    o = data.get("overlap")
    if o and o["rows"]:
        link = (data.get("copies") or {}).get("large_copy_gbps") or 400.0
        for key in sorted({(x["model"], x["pairs"]) for x in o["rows"]}):
            rows = sorted((x for x in o["rows"] if (x["model"], x["pairs"]) == key),
                          key=lambda x: x["rate_gbps"] or link)
            axes[3].plot([x["rate_gbps"] or link for x in rows], [100 * x["slowdown"] for x in rows], marker="o",
                         label=f"{key[0]} {key[1]} pairs")
        axes[3].axhline(3.0, color="r", ls=":", lw=0.8, label="3% target")
        axes[3].set(xlabel="copy rate GB/s (rightmost: full rate)", ylabel="compute slowdown %", title="compute slowed by copies")
        axes[3].legend(fontsize=6)
    r = data.get("replay")
    if r and r["records"]:
        recs = r["records"]
        axes[2].scatter([x["window_ms"] for x in recs], [x["raw_copy_ms"] for x in recs], s=6, label="raw copy")
        axes[2].scatter([x["window_ms"] for x in recs], [x["exposed_ms"] for x in recs], s=6, label="exposed wait")
        hi = max(x["window_ms"] for x in recs)
        axes[2].plot([0, hi], [0, hi], color="grey", lw=0.8)
        axes[2].set(xlabel="lookahead window (ms)", ylabel="ms", title="replay: copy vs window")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig
