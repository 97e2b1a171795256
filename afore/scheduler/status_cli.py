"""`afore status`: the control plane's shared-memory segments, their readers and counters; with
``--watch`` a live terminal view of a pod's placement figures, with ``--plot DIR`` PNGs of them
(the figures: afore.metrics.figures, docs/metrics.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from afore import _shm

SHM_DIR = "/dev/shm"


def list_segments(directory: str = SHM_DIR) -> list[dict]:
    """``_shm.inspect`` of every afore segment in ``directory`` (recognised by its magic)."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    magic = int(_shm.MAGIC).to_bytes(8, "little")
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                if f.read(8) != magic:
                    continue
            out.append(_shm.inspect(name))
        except (OSError, ValueError):
            continue
    return out


def remove_stale(segments: list[dict]) -> list[str]:
    """Unlink segments whose owner is gone (what a crashed run left); returns their names."""
    removed = []
    for seg in segments:
        if not seg["owner_alive"] or seg["state"] == "closed" or not seg["compatible"]:
            try:
                os.unlink(os.path.join(SHM_DIR, seg["name"]))
                removed.append(seg["name"])
            except FileNotFoundError:
                pass
    return removed


def format_segment(seg: dict) -> str:
    owner = f"pid {seg['owner_pid']} {'alive' if seg['owner_alive'] else 'DEAD (stale)'}"
    lines = [f"{seg['name']}: {seg['kind']} v{seg['version']} {seg['state']}, owner {owner}, {seg['size_bytes']} bytes"]
    if not seg.get("compatible"):
        lines.append("  incompatible format version: replaced at the next start")
        return "\n".join(lines)
    c = seg["counters"]
    if seg["kind"] == "mailbox":
        lines.append(f"  A={seg['num_producers']} E={seg['num_experts']} L={seg['num_layers']} "
                     f"microbatches={seg['num_microbatches']} capacity={seg['capacity']} "
                     f"consumer heartbeat {seg['consumer_heartbeat_age_s']:.3f} s ago")
        lines.append("  targets: " + ", ".join(f"{k}={v}" for k, v in c.items()))
        for p in seg["producers"]:
            lines.append(f"  worker {p['worker']}: pid {p['pid']} {'alive' if p['alive'] else '-'} queued={p['queued']} "
                         f"last_seq={p['last_seq']} accepted={p['accepted']} rejected={p['rejected_invalid']}"
                         f"+{p['rejected_duplicate']}dup dropped_full={p['dropped_full']}")
    elif seg["kind"] == "plan_ring":
        # "alive" is the ring's own verdict (live record, process running). The heartbeat is the
        # reader's last read: an idle reader's grows without bound and costs it nothing; only a
        # reader that holds the writer up for the eviction timeout is evicted.
        alive = sum(1 for r in seg["readers"] if r["alive"])
        lines.append(f"  readers {alive}/{seg['num_readers']} alive (registered, process running), "
                     f"{seg['num_slots']} slots x {seg['slot_capacity']} B")
        lines.append(f"  eviction: a reader whose process is gone, or that holds the writer up for "
                     f"{seg['liveness_timeout_s']:.3f} s without reading; writer {_writer(seg)}")
        lines.append("  " + ", ".join(f"{k}={v}" for k, v in c.items()))
        for r in seg["readers"]:
            lines.append(f"  reader {r['reader']}: {_reader_verdict(r)}, pid {r['pid']}, "
                         f"last read {r['heartbeat_age_s']:.3f} s ago, lag={r['lag']} copied={r['copied']} "
                         f"missed={r['missed']} stale={r['stale_skipped']} torn={r['torn']} rejected={r['rejected']} "
                         f"evicted={r['evicted']}")
    return "\n".join(lines)


def _reader_verdict(reader: dict) -> str:
    """'alive', or why not: evicted (rejoins at its next read), detached, or its process gone."""
    if reader["alive"]:
        return "alive"
    if reader["state"] == "live":
        return "DEAD (process gone; evicted when the writer next needs its slot)"
    return {"evicted": "evicted (rejoins at its next read)", "detached": "detached"}.get(reader["state"], reader["state"])


def _writer(seg: dict) -> str:
    pid = seg.get("writer_pid", 0)
    state = "alive" if seg.get("writer_alive") else "DEAD"
    return f"pid {pid} {state}, heartbeat {seg['writer_heartbeat_age_s']:.3f} s ago"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", help="segment names (default: every afore segment in /dev/shm)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--metrics", help="a pod's Prometheus endpoint: the API port's /metrics (role ffn: the admin "
                                          f"port's); printed raw, or the source of --watch/--plot (default there: {DEFAULT_METRICS})")
    parser.add_argument("--clean", action="store_true", help="unlink segments whose owner process is gone")
    parser.add_argument("--watch", action="store_true", help="live view of balance, migration and plans (refreshes in place)")
    parser.add_argument("--plot", metavar="DIR", help="sample --metrics for --duration seconds, then write balance.png, "
                                                      "migration.png and figures.json into DIR")
    parser.add_argument("--interval", type=float, default=2.0, help="--watch/--plot: seconds between scrapes")
    parser.add_argument("--duration", type=float, default=None,
                        help="--watch/--plot: stop after this many seconds (default: --plot 120, --watch until Ctrl-C)")


DEFAULT_METRICS = "http://127.0.0.1:8000/metrics"


def fetch_snapshot(url: str):
    """One scrape of ``url`` as an afore.metrics.figures.Snapshot (RuntimeError naming the URL)."""
    from afore.metrics.figures import Snapshot

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return Snapshot.parse(resp.read().decode())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RuntimeError(f"metrics: cannot read {url}: {exc}") from exc


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


def figures_view(fig: dict, url: str, error: str = ""):
    """The rich renderable of one refresh: per-layer imbalance, then migration and plan figures."""
    from rich.console import Group
    from rich.table import Table

    layers = Table(title=f"afore status  {url}  policy {fig.get('policy') or '-'}", title_justify="left")
    for col in ("layer", "max/mean plan", "max/mean primary-only", "bought"):
        layers.add_column(col, justify="right")
    for layer, v in fig["imbalance"].items():
        plan, base = v.get("plan"), v.get("primary_only")
        layers.add_row(str(layer), _fmt(plan, digits=3), _fmt(base, digits=3),
                       _fmt(base / plan if plan and base else None, digits=3, unit="x"))
    rates = Table(show_header=False)
    rates.add_column("figure")
    rates.add_column("value", justify="right")
    plans = fig["plans_per_s"]
    for name, value in (
            ("copies / s", _fmt(fig["copies_per_s"], digits=1)),
            ("copied MB / s", _fmt(fig["copy_bytes_per_s"], 1e-6, 2)),
            ("raw copy time per target", _fmt(fig["copy_s"], 1e3, 3, " ms")),
            ("exposed copy wait per target", _fmt(fig["exposed_s"], 1e3, 3, " ms")),
            ("lookahead window", _fmt(fig["window_s"], 1e3, 3, " ms")),
            ("plans used / missed / rejected per s",
             " / ".join(_fmt(plans[o], digits=1) for o in ("used", "missed", "rejected"))),
            ("primary-only targets / s", _fmt(fig["primary_only_per_s"], digits=1)),
            ("scheduler misses / s", _fmt(fig["misses_per_s"], digits=1)),
            ("demand -> plan", _fmt(fig["demand_to_plan_s"], 1e6, 1, " us")),
            ("attention F2A wait", _fmt(fig["f2a_wait_s"], 1e3, 3, " ms"))):
        rates.add_row(name, value)
    parts = [layers, rates]
    if error:
        parts.append(f"[red]{error}[/red]")
    return Group(*parts)


def collect_figures(url: str, interval_s: float, duration_s: float | None, watch: bool) -> list[dict]:
    """Scrape ``url`` every ``interval_s`` until ``duration_s`` (None: until Ctrl-C); returns the
    figures of each interval, with ``t`` (seconds since the first scrape). ``watch``: show them
    live; else a progress bar."""
    prev = fetch_snapshot(url)
    start, history = prev.t, []
    end = None if duration_s is None else start + duration_s
    live = bar = None
    if watch:
        from rich.live import Live

        from afore.metrics.figures import figures

        live = Live(figures_view(figures(prev, prev), url), auto_refresh=False, transient=False)
        live.start()
    elif duration_s:
        from tqdm import tqdm

        bar = tqdm(total=round(duration_s), desc="afore status --plot", unit="s", file=sys.stderr)
    try:
        from afore.metrics.figures import figures

        while end is None or time.monotonic() < end:
            time.sleep(interval_s if end is None else max(0.0, min(interval_s, end - time.monotonic())))
            try:
                cur = fetch_snapshot(url)
            except RuntimeError as exc:  # a restart or a slow scrape: say so and keep going
                if live is not None:
                    live.update(figures_view(history[-1] if history else figures(prev, prev), url, str(exc)), refresh=True)
                continue
            fig = {"t": cur.t - start, **figures(prev, cur)}
            history.append(fig)
            prev = cur
            if live is not None:
                live.update(figures_view(fig, url), refresh=True)
            if bar is not None:
                bar.n = min(bar.total, round(fig["t"]))
                bar.refresh()
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
        if bar is not None:
            bar.close()
    return history


def write_plots(history: list[dict], directory: str) -> list[str]:
    """balance.png (max/mean tile load per layer: plan solid, primary-only dashed), migration.png
    (copies/s; raw and exposed copy time; plans used/missed/rejected per s) and figures.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    t = [f["t"] for f in history]
    paths = []
    fig, ax = plt.subplots(figsize=(9, 4.5))
    layers = sorted({layer for f in history for layer in f["imbalance"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, layer in enumerate(layers):
        c = colors[i % len(colors)]
        for placement, style in (("plan", "-"), ("primary_only", "--")):
            ys = [f["imbalance"].get(layer, {}).get(placement) for f in history]
            ax.plot(t, [float("nan") if y is None else y for y in ys], style, color=c,
                    label=f"layer {layer} {'plan' if placement == 'plan' else 'primary-only'}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("max/mean tile load (1 = balanced)")
    ax.set_title("balance per layer: plans (solid) vs primary-only (dashed)")
    if layers:
        ax.legend(fontsize=7, ncol=2)
    paths.append(os.path.join(directory, "balance.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    def ys(key, scale=1.0, sub=None):
        vals = [(f[key][sub] if sub else f[key]) for f in history]
        return [float("nan") if v is None else v * scale for v in vals]

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, ys("copies_per_s"), label="copies / s")
    axes[0].set_ylabel("copies / s")
    axes[1].plot(t, ys("copy_s", 1e3), label="raw copy time per target")
    axes[1].plot(t, ys("exposed_s", 1e3), label="exposed wait per target")
    axes[1].plot(t, ys("window_s", 1e3), ":", label="lookahead window")
    axes[1].set_ylabel("ms")
    for outcome in ("used", "missed", "rejected"):
        axes[2].plot(t, ys("plans_per_s", sub=outcome), label=f"plans {outcome}")
    axes[2].plot(t, ys("primary_only_per_s"), "--", label="primary-only targets")
    axes[2].set_ylabel("per s")
    axes[2].set_xlabel("seconds")
    for a in axes:
        a.legend(fontsize=7)
    axes[0].set_title("migration and plans")
    paths.append(os.path.join(directory, "migration.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    paths.append(os.path.join(directory, "figures.json"))
    with open(paths[-1], "w") as fh:
        json.dump(history, fh, indent=1, default=str)
    return paths


def run_figures(args: argparse.Namespace) -> int:
    url = args.metrics or DEFAULT_METRICS
    if not args.interval > 0:
        print(f"afore status: interval: expected > 0 seconds, got {args.interval}", file=sys.stderr)
        return 2
    duration = args.duration if args.duration is not None else (None if args.watch else 120.0)
    if duration is not None and not duration > 0:
        print(f"afore status: duration: expected > 0 seconds, got {duration}", file=sys.stderr)
        return 2
    try:
        history = collect_figures(url, args.interval, duration, args.watch)
    except RuntimeError as exc:
        print(f"afore status: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        if not history:
            print("afore status: plot: no complete interval was sampled", file=sys.stderr)
            return 1
        for path in write_plots(history, args.plot):
            print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.watch or args.plot:
        return run_figures(args)
    if args.names:
        segments = []
        for name in args.names:
            try:
                segments.append(_shm.inspect(name))
            except ValueError as exc:
                segments.append({"name": name, "error": str(exc)})
    else:
        segments = list_segments()
    removed = remove_stale([s for s in segments if "error" not in s]) if args.clean else []
    metrics = None
    if args.metrics:
        with urllib.request.urlopen(args.metrics, timeout=5) as resp:
            metrics = resp.read().decode()
    if args.json:
        print(json.dumps({"segments": segments, "removed": removed, "metrics": metrics}, indent=1))
        return 0
    if not segments:
        print(f"no afore segments in {SHM_DIR}")
    for seg in segments:
        print(f"{seg['name']}: {seg['error']}" if "error" in seg else format_segment(seg))
    for name in removed:
        print(f"removed stale segment {name}")
    if metrics is not None:
        print(metrics.rstrip())
    return 0 if all("error" not in s for s in segments) else 1
