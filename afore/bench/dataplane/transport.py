"""``afore bench dataplane --part transport``: the A2F/F2A transports on this machine.

Three measurements, all of the real code:

1. **exchange**: round trip of one target (attention send -> F FFN ends receive, read their
   rows, reply -> attention sums), shm against torch.distributed gloo (today's dense path: every
   FFN worker receives every token, the partials are all-reduced), for the same payloads; the
   FFN ends are separate processes that own tokens t % F and return their rows (no expert
   compute, so the figure is the transport alone). Bytes each way are counted by the transports.
2. **bytes**: per layer at 256 and 2048 tokens x top-8, E = 128, F = 8, routing from the
   synthetic skewed generator, eq. 11 partition of the primary-only plan: hidden rows the shm
   transport moves each way against the minimum (pairs x H x dtype) and against dense dispatch.
3. **serve** (``--serve``): decode ITL of ``afore serve`` with the shm transport, with
   ``--transport torch-gloo`` (the previous data plane) and plain vLLM on the same checkpoint,
   measured with vLLM's own serving client (``vllm.benchmarks.serve``), one server at a time,
   plus where a decode target's time goes in the shm run, from the stage traces of every process
   (AFORE_STAGE_TRACE: attention worker, scheduler, FFN workers, joined by seq).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from afore.plan import Target
from afore.transport.base import ReplyRows

EXCHANGE_TOKENS = (1, 4, 16, 64, 256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--part transport")
    g.add_argument("--exchange-hidden", type=int, default=2048, help="hidden size of the exchange payloads (Qwen3-30B-A3B: 2048)")
    g.add_argument("--exchange-reps", type=int, default=200, help="round trips per payload and transport")
    g.add_argument("--serve", action="store_true", help="also measure decode ITL through afore serve and plain vLLM")
    g.add_argument("--serve-requests", type=int, default=24)
    g.add_argument("--serve-concurrency", type=int, default=4)
    g.add_argument("--serve-rounds", type=int, default=2, help="benchmark rounds per server")
    g.add_argument("--serve-interleave", action="store_true",
                   help="start every server first, then run round r of each in turn (servers side by side: "
                        "on a shared machine each round of every server sees the same conditions)")
    g.add_argument("--serve-only", default="", metavar="NAMES",
                   help=f"comma-separated servers to run (default all: {', '.join(SERVERS)}); plain vllm always runs")


# ------------------------------------------------------------------ 1. exchange


def _ffn_echo(kind: str, name_or_port, num_ffn: int, rank: int, hidden: int, top_k: int, max_tokens: int, n_targets: int):
    torch.set_num_threads(1)
    if kind == "shm":
        from afore.transport.shm import ShmFFNEnd, ShmLayout

        end = ShmFFNEnd(name_or_port, ShmLayout(num_attention=1, num_ffn=num_ffn, hidden=hidden, top_k=top_k,
                                                max_tokens=max_tokens, depth=2), rank, timeout_s=300)
    else:
        from afore.transport.connector import FFNConnector, TransportConfig

        end = FFNConnector(TransportConfig("127.0.0.1", name_or_port, 1, num_ffn, hidden, top_k, timeout_s=300), rank)
    for _ in range(n_targets):
        mb = end.recv(300.0)
        n = mb.num_tokens
        mine = torch.arange(n)[torch.arange(n) % num_ffn == rank]
        rows = mb.rows_for(mine).index_select(0, mine)
        end.send(mb, ReplyRows(mine, rows))
    time.sleep(0.5)
    end.close()
    os._exit(0)


def measure_exchange(hidden: int, top_k: int, num_ffn: int, reps: int, kind: str) -> list[dict]:
    """Round-trip times (us) per payload size for one transport."""
    from afore.ports import free_port

    torch.set_num_threads(1)  # the attention end shares the cores with the FFN ends (no spinning OpenMP pool)
    ctx = mp.get_context("spawn")
    max_tokens = max(EXCHANGE_TOKENS)
    n_targets = len(EXCHANGE_TOKENS) * (reps + 10)
    seg = None
    if kind == "shm":
        from afore.transport.shm import ShmAttentionEnd, ShmLayout, ShmSegment

        name = f"afore-bench-dp-{os.getpid()}"
        layout = ShmLayout(num_attention=1, num_ffn=num_ffn, hidden=hidden, top_k=top_k, max_tokens=max_tokens, depth=2)
        seg = ShmSegment.create(name, layout)
        arg = name
    else:
        from afore.transport.connector import AttentionConnector, TransportConfig

        arg = free_port()
    procs = [ctx.Process(target=_ffn_echo, args=(kind, arg, num_ffn, f, hidden, top_k, max_tokens, n_targets))
             for f in range(num_ffn)]
    for p in procs:
        p.start()
    try:
        if kind == "shm":
            end = ShmAttentionEnd(arg, layout, 0, timeout_s=300)
        else:
            end = AttentionConnector(TransportConfig("127.0.0.1", arg, 1, num_ffn, hidden, top_k, timeout_s=300), 0)
        rows, seq = [], 0
        for n in EXCHANGE_TOKENS:
            x = torch.randn(n, hidden)
            ids = torch.zeros(n, top_k, dtype=torch.int32)
            w = torch.ones(n, top_k)
            times = []
            for i in range(reps + 10):
                t0 = time.perf_counter()
                out = end.exchange(Target(seq, 0, 0), seq, x, ids, w)
                if i >= 10:
                    times.append((time.perf_counter() - t0) * 1e6)
                seq += 1
            assert torch.equal(out, x), "exchange returned wrong rows"
            payload = n * (hidden * 4 + top_k * 8)
            a2f = payload if kind == "shm" else payload * num_ffn  # shm: written once; gloo: sent to every worker
            rows.append({"transport": "shm" if kind == "shm" else "gloo", "tokens": n, "hidden": hidden,
                         "p50_us": statistics.median(times), "p99_us": float(np.percentile(times, 99)),
                         "a2f_bytes_sent": a2f, "f2a_bytes": n * hidden * 4 + (n * 4 if kind == "shm" else 0)})
            print(f"  {rows[-1]['transport']:4s} {n:5d} tokens: p50 {rows[-1]['p50_us']:8.1f} us, "
                  f"p99 {rows[-1]['p99_us']:8.1f} us", file=sys.stderr)
        end.close()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if seg is not None:
            seg.close()
    return rows


# ------------------------------------------------------------------ 2. bytes


def measure_bytes(hidden: int = 2048, top_k: int = 8, num_experts: int = 128, num_ffn: int = 8,
                  dtype_bytes: int = 2, seed: int = 0) -> list[dict]:
    """Hidden-row bytes per layer each way under the shm transport's sparse dispatch, from the
    real eq. 11 partition of the primary-only plan (``afore.ffn.partition.worker_mask``)."""
    from afore.config import ClusterShape
    from afore.ffn.partition import worker_mask
    from afore.ffn.reference import random_routing
    from afore.plan import primary_only_plan

    shape = ClusterShape(num_experts=num_experts, num_workers=num_ffn, num_layers=1, redundant_slots=2, top_k=top_k)
    owner = torch.as_tensor(shape.primary_owner, dtype=torch.int64)
    rng = np.random.default_rng(seed)
    rows = []
    for n in (256, 2048):
        for skew in (0.0, 1.2):
            ids, _w = random_routing(n, shape, rng, skew=skew)
            demand = np.bincount(ids.reshape(-1).numpy(), minlength=num_experts)
            plan = primary_only_plan(shape, demand, Target(0, 0, 0), 0)
            assignment = torch.from_numpy(plan.assignment.copy())
            touched = sum(int(worker_mask(ids, assignment, owner, f).view(n, top_k).any(1).sum()) for f in range(num_ffn))
            pairs = n * top_k
            row = hidden * dtype_bytes
            rows.append({"tokens": n, "top_k": top_k, "skew": skew, "pairs": pairs,
                         "min_bytes": pairs * row,                       # every pair's row, each way
                         "shm_a2f_bytes": touched * row, "shm_f2a_bytes": touched * row,
                         "dense_a2f_bytes": num_ffn * n * row,           # every token to every worker
                         "dense_f2a_bytes": 2 * (num_ffn - 1) * n * row + n * row,  # ring all-reduce over F + reply
                         "shm_over_min": touched / pairs})
    return rows


# ------------------------------------------------------------------ 3. serve


class _Served:
    """One server of ``--serve``: started, benchmarked round by round, stopped."""

    def __init__(self, name: str, command: list[str], url: str, log_dir: Path, env: dict | None = None) -> None:
        from afore.bench.serve import wait_ready

        self.name, self.command, self.url = name, command, url
        self.log = open(log_dir / f"{name}.log", "ab")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        try:
            print(f"afore bench dataplane: starting {name}: {' '.join(command)}", file=sys.stderr)
            wait_ready(url, 900, self.proc)
        except BaseException:
            self.stop()
            raise
        self.rng = np.random.default_rng(0)  # the same prompts on every server, round by round
        self.results: list[dict] = []
        self.before = _figures(url)

    def round(self, model: str, requests: int, concurrency: int) -> None:
        from afore.bench.serve import Prompt, run_load

        # random 64-token prompts (vLLM's random data set style), 32 output tokens each
        prompts = [Prompt(" ".join(str(int(t)) for t in self.rng.integers(0, 1000, 64)), 32) for _ in range(requests)]
        r = len(self.results)
        self.results.append(asyncio.run(run_load(self.url, model, prompts, concurrency, True, 2, f"{self.name} round {r}")))

    def result(self) -> dict:
        return {"command": self.command, "rounds": self.results, "figures": _figure_means(self.before, _figures(self.url))}

    def stop(self) -> None:
        from afore.bench.serve import stop_server

        stop_server(self.proc)
        self.log.close()


def _serve_one(name: str, command: list[str], url: str, model: str, requests: int, concurrency: int, rounds: int,
               log_dir: Path, env: dict | None = None) -> dict:
    server = _Served(name, command, url, log_dir, env)
    try:
        for _ in range(rounds):
            server.round(model, requests, concurrency)
        return server.result()
    finally:
        server.stop()


def _serve_interleaved(specs: list[tuple[str, list[str], str, dict | None]], model: str, requests: int,
                       concurrency: int, rounds: int, log_dir: Path) -> dict:
    """Every server up at once, then round r of each in turn (``--serve-interleave``): on a shared
    machine whose speed drifts, each round of every server sees about the same conditions."""
    servers: list[_Served] = []
    try:
        for name, command, url, env in specs:
            servers.append(_Served(name, command, url, log_dir, env))
        for _ in range(rounds):
            for server in servers:
                server.round(model, requests, concurrency)
        return {server.name: server.result() for server in servers}
    finally:
        for server in servers:
            server.stop()


#: histogram families whose mean over the benchmark rounds the report shows (afore servers only)
FIGURES = (("afore_ffn_lookahead_window_seconds", "lookahead window (copy submitted -> commit)"),
           ("afore_attention_overlap_seconds", "attention work between a target's post and its wait"),
           ("afore_attention_f2a_wait_seconds", "attention worker's wait for F2A"))


def _figures(url: str) -> dict[str, float]:
    """The _sum and _count of each FIGURES family on ``url``'s /metrics ({} for plain vLLM or an
    unreachable server)."""
    from afore.bench.ab_runtime import metric_sum, scrape_metrics

    try:
        samples = scrape_metrics(url)
    except OSError:
        return {}
    return {f"{name}_{part}": metric_sum(samples, f"{name}_{part}") for name, _ in FIGURES for part in ("sum", "count")}


def _figure_means(before: dict, after: dict) -> dict[str, float | None]:
    """Mean (ms) of each FIGURES family over the rounds, from two scrapes (None: no sample)."""
    out = {}
    for name, _ in FIGURES:
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        s = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        out[name] = 1e3 * s / n if n > 0 else None
    return out


#: the servers of ``--serve``, in the order they run and appear in the report
SERVERS = ("afore-shm", "afore-shm-attention", "afore-shm-attention-unpinned", "afore-shm-attention-nonice", "afore-shm-stream", "afore-shm-workers", "afore-shm-m2", "afore-shm-m2-serial", "afore-torch-gloo", "vllm")


def serve_selection(only: str) -> tuple[str, ...]:
    """The servers ``--serve-only`` names (all when empty), plain vLLM always included, in
    ``SERVERS`` order; ValueError naming an unknown one."""
    if not only:
        return SERVERS
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(names - set(SERVERS))
    if unknown:
        raise ValueError(f"serve_only: expected names among {', '.join(SERVERS)}, got {', '.join(unknown)}")
    return tuple(n for n in SERVERS if n in names or n == "vllm")


def measure_serve(args, log_dir: Path) -> dict:
    from afore.models.tiny import build_tiny_checkpoint
    from afore.ports import free_port

    selected = serve_selection(getattr(args, "serve_only", ""))
    model = str(build_tiny_checkpoint("qwen3_moe", seed=0))
    log_dir.mkdir(parents=True, exist_ok=True)
    trace, plain_trace, pp_trace = log_dir / "stages", log_dir / "plain", log_dir / "pingpong"
    workers_trace, attention_trace = log_dir / "workers", log_dir / "attnplan"
    for f in [*log_dir.glob("stages*"), *log_dir.glob("plain.*"), *log_dir.glob("pingpong.*"), *log_dir.glob("workers.*"),
              *log_dir.glob("attnplan.*")]:
        f.unlink()
    out = {}
    common = ["--model", model, "--dtype", "float32", "--max-model-len", "512"]
    servers = [
        # afore serve's CPU default: shm, one target per MoE call; every process traces its stages
        ("afore-shm", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--verbose", *common],
         {"AFORE_STAGE_TRACE": str(trace)}),
        # the same with the attention worker planning its targets in-process (--planner attention: no
        # mailbox, no scheduler process; the plan is on the ring before the tokens are posted)
        ("afore-shm-attention", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--planner", "attention",
                                 "--verbose", *common], {"AFORE_STAGE_TRACE": str(attention_trace)}),
        # the same with the FFN workers where the kernel puts them, at vLLM's priority (before
        # afore.ffn.cpus), and pinned but at vLLM's priority
        ("afore-shm-attention-unpinned", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--planner",
                                          "attention", "--ffn-cpus", "none", "--ffn-nice", "0", "--verbose", *common], None),
        ("afore-shm-attention-nonice", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--planner",
                                        "attention", "--ffn-nice", "0", "--verbose", *common], None),
        # the same with the exchange as the CUDA host node's C++ (afore.attention.stream): no Python per layer
        ("afore-shm-stream", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--exchange", "stream",
                              "--verbose", *common], None),
        # the same with every FFN worker planning itself (--planner workers: no demand, scheduler or plan hop)
        ("afore-shm-workers", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--planner", "workers",
                               "--verbose", *common], {"AFORE_STAGE_TRACE": str(workers_trace)}),
        # two ping-pong microbatches (afore.attention.pingpong): microbatch b+1's attention while the
        # FFN pool computes b; and the same two targets per layer without the overlap (--no-pingpong)
        ("afore-shm-m2", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--microbatches", "2",
                          "--verbose", *common], {"AFORE_STAGE_TRACE": str(pp_trace)}),
        ("afore-shm-m2-serial", [sys.executable, "-m", "afore.cli", "serve", "--transport", "shm", "--microbatches", "2",
                                 "--no-pingpong", "--verbose", *common], None),
        # the data plane before issue 10: dense torch.distributed over gloo, two microbatches
        ("afore-torch-gloo", [sys.executable, "-m", "afore.cli", "serve", "--transport", "torch-gloo", "--microbatches", "2",
                              "--verbose", *common], None),
        # the same 1 GiB KV cache that afore serve gives vLLM on CPU (VLLM_CPU_KVCACHE_SPACE)
        ("vllm", [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common, "--seed", "0"],
         {"VLLM_CPU_KVCACHE_SPACE": "1", "AFORE_STAGE_TRACE": str(plain_trace)}),  # vLLM's step phases (the plugin)
    ]
    specs = []
    for name, cmd, env in servers:
        if name not in selected:
            continue
        port = free_port()
        specs.append((name, [*cmd, "--port", str(port)], f"http://127.0.0.1:{port}", env))
    if getattr(args, "serve_interleave", False):
        out.update(_serve_interleaved(specs, model, args.serve_requests, args.serve_concurrency, args.serve_rounds,
                                      log_dir))
    else:
        for name, cmd, url, env in specs:
            out[name] = _serve_one(name, cmd, url, model, args.serve_requests, args.serve_concurrency,
                                   args.serve_rounds, log_dir, env)
    out["interleaved"] = bool(getattr(args, "serve_interleave", False))
    from afore.models.checkpoint import read_model_spec

    layers = len(read_model_spec(model).moe_layer_indices)
    out["breakdown"] = stage_breakdown(trace, num_layers=layers, microbatches=1)
    out["breakdown_pingpong"] = stage_breakdown(pp_trace, num_layers=layers, microbatches=2)
    out["breakdown_workers"] = stage_breakdown(workers_trace, num_layers=layers, microbatches=1)
    out["breakdown_attention"] = stage_breakdown(attention_trace, num_layers=layers, microbatches=1)
    out["runner"] = {"afore-shm": runner_breakdown(trace), "afore-shm-attention": runner_breakdown(attention_trace),
                     "afore-shm-workers": runner_breakdown(workers_trace),
                     "afore-shm-m2": runner_breakdown(pp_trace), "vllm": runner_breakdown(plain_trace)}
    return out


#: the critical path of one decode target, in order, from the three traces joined by seq:
#: (name, start column, end column) with the table each column comes from ("a" attention worker 0,
#: "s" scheduler, "f" every FFN worker)
STAGES = (
    ("attention compute before the layer", ("a", "prev_exit_ns"), ("a", "enter_ns")),
    ("demand emit (count + mailbox put)", ("a", "enter_ns"), ("a", "demand_ns")),
    ("A2F post (rows into shm, wake)", ("a", "demand_ns"), ("a", "sent_ns")),
    ("scheduler: report -> taken up", ("s", "written_ns"), ("s", "got_ns")),
    ("scheduler: plan (policy)", ("s", "plan_start_ns"), ("s", "planned_ns")),
    ("scheduler: encode + publish", ("s", "planned_ns"), ("s", "published_ns")),
    ("FFN: A2F posted -> worker takes it up", ("a", "sent_ns"), ("f", "start_ns")),
    ("FFN: taken up -> plan read and checked", ("f", "start_ns"), ("f", "plan_ns")),
    ("FFN: expert compute", ("f", "plan_ns"), ("f", "computed_ns")),
    ("FFN: compute, until its rows are gathered (GPU workers: into pinned memory)", ("f", "plan_ns"), ("f", "rows_ns")),
    ("FFN: compute, GPU time (CUDA events)", ("f", "device_ns"), ("f", "device_ns")),
    ("FFN: vote (every worker, after the compute)", ("f", "computed_ns"), ("f", "agreed_ns")),
    ("FFN: metrics of the target", ("f", "agreed_ns"), ("f", "sent_ns")),
    ("FFN: reply send (device-to-host copy, publish)", ("f", "sent_ns"), ("f", "published_ns")),
    ("F2A: last reply (rows into shm, wake) -> attention has the sum", ("f", "sent_ns"), ("a", "done_ns")),
    ("attention: wait for F2A (total)", ("a", "recv_start_ns"), ("a", "done_ns")),
)


_DEMAND, _POST = STAGES[1][0], STAGES[2][0]


def stage_breakdown(trace: Path, num_layers: int = 3, microbatches: int = 1, max_tokens: int = 8) -> dict:
    """Median and mean (us) of every stage in ``STAGES`` over the decode targets (at most
    ``max_tokens`` tokens) of one run traced with AFORE_STAGE_TRACE=``trace``: the attention
    worker 0 trace, the scheduler's and every FFN worker's (afore.metrics.trace), joined by seq.
    FFN stages are taken per worker; the last reply (the worker that finished last) ends F2A.
    Where a target's demand was emitted after its post (GPU ids through shm), the two stages are
    taken in that order (post: from the call's entry; demand: from the post)."""
    from afore.metrics.trace import read_trace

    att_file = trace.parent / f"{trace.name}.0.csv"
    if not att_file.exists():
        return {}
    att = [r for r in read_trace(att_file) if 0 < r["tokens"] <= max_tokens and r["prev_exit_ns"]]
    sched_file = trace.parent / f"{trace.name}.scheduler.csv"
    sched = {r["seq"]: r for r in read_trace(sched_file)} if sched_file.exists() else {}
    ffn = [{r["seq"]: r for r in read_trace(f)} for f in sorted(trace.parent.glob(f"{trace.name}.ffn*.csv"))]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for a in att:
        # the attention trace's own seq (older traces: from the target, which needs the right L and M)
        seq = a["seq"] if "seq" in a else (a["step"] * num_layers + a["layer"]) * microbatches + a["microbatch"]
        rows = {"a": [a], "s": [sched[seq]] if seq in sched else [], "f": [w[seq] for w in ffn if seq in w]}
        for name, (t0, c0), (t1, c1) in STAGES:
            if a["demand_ns"] > a["sent_ns"] and name in (_DEMAND, _POST):  # GPU: posted first, demand after
                samples[name].append(a["demand_ns"] - a["sent_ns"] if name == _DEMAND else a["sent_ns"] - a["enter_ns"])
                continue
            if name.startswith("F2A"):  # from the last reply handed over
                if rows["f"]:
                    samples[name].append(a["done_ns"] - max(r["sent_ns"] for r in rows["f"]))
                continue
            if c0 == c1 == "device_ns":  # a duration, not a stamp (0: not a CUDA worker)
                samples[name].extend(r["device_ns"] for r in rows["f"] if r.get("device_ns"))
                continue
            if t0 == "f" or t1 == "f":
                for r in rows["f"]:
                    if t0 == "f" and not r.get(c0) or t1 == "f" and not r.get(c1):
                        continue  # a column older traces lack (or a stage this worker's path has none of)
                    start = r[c0] if t0 == "f" else rows[t0][0][c0]
                    samples[name].append((r[c1] if t1 == "f" else rows[t1][0][c1]) - start)
            elif rows[t0] and rows[t1]:
                samples[name].append(rows[t1][0][c1] - rows[t0][0][c0])
    out = {"targets": len(att), "ffn_workers": len(ffn), "stages": {}}
    for name, values in samples.items():
        if values:
            v = np.asarray(values, dtype=np.float64) / 1e3
            out["stages"][name] = {"median_us": float(np.median(v)), "mean_us": float(v.mean()), "n": int(v.size)}
    return out


def _union(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by sorted ``(start, end)`` intervals (ping-pong microbatches' layer
    calls overlap one another: a call stays open while the other microbatch computes)."""
    total, cur0, cur1 = 0, None, None
    for a, b in intervals:
        if cur1 is None or a > cur1:
            if cur1 is not None:
                total += cur1 - cur0
            cur0, cur1 = a, b
        else:
            cur1 = max(cur1, b)
    return total + (cur1 - cur0 if cur1 is not None else 0)


def runner_breakdown(trace: Path, max_tokens: int = 8) -> dict:
    """vLLM's own decode step in the process that runs the model, from the runner trace
    (``PATH.runner<pid>.csv``, afore.attention.stages.RunnerClock) and, for an afore server, the
    attention worker's stage trace (``PATH.0.csv``): medians (ms) over the steps whose MoE layer
    calls all hold at most ``max_tokens`` tokens (decode; plain vLLM: the forwards that contain
    no layer call, i.e. all of them, filtered by nothing). Per step: ``step`` (this execute_model
    start to the next), ``forward`` (_model_forward), ``exchanges`` (the MoE layer calls inside
    that forward, enter to exit, summed), ``forward_without_exchanges`` (their difference, per
    step), ``prepare_inputs``, ``sample_tokens``, and ``other`` (step minus forward, inputs and
    sampling: the engine core's scheduling and its two RPCs). {} when there is no runner trace."""
    from afore.metrics.trace import read_trace

    runner = None
    for f in sorted(trace.parent.glob(f"{trace.name}.runner*.csv")):
        rows = read_trace(f)
        if any(r["phase"] == 0 for r in rows):
            runner = rows
            break
    if runner is None:
        return {}
    by_phase = {p: sorted(((r["start_ns"], r["end_ns"]) for r in runner if r["phase"] == p)) for p in range(4)}
    att_file = trace.parent / f"{trace.name}.0.csv"
    calls = sorted((r["enter_ns"], r["done_ns"], r["tokens"]) for r in read_trace(att_file)) if att_file.exists() else []
    enters = np.array([c[0] for c in calls], np.int64)

    def inside(lo: int, hi: int, phase: int) -> int:
        """The duration of the first ``phase`` call starting in [lo, hi) (0: none)."""
        for a, b in by_phase[phase]:
            if lo <= a < hi:
                return b - a
        return 0

    samples: dict[str, list[float]] = {k: [] for k in ("step", "forward", "exchanges", "forward_without_exchanges",
                                                        "prepare_inputs", "sample_tokens", "other")}
    execs = by_phase[0]
    for (s0, s1), (n0, _) in zip(execs, execs[1:]):
        fwd = [(a, b) for a, b in by_phase[2] if s0 <= a < s1]
        if not fwd:
            continue
        # a ping-pong step times one forward per microbatch (threads): the step's forward spans them
        f0, f1 = min(a for a, _ in fwd), max(b for _, b in fwd)
        lo, hi = np.searchsorted(enters, f0), np.searchsorted(enters, f1)
        mine = calls[lo:hi]
        if calls and (not mine or any(not 0 < t <= max_tokens for _, _, t in mine)):
            continue  # a prefill (or mixed) step, or an afore forward without its layer calls
        exchanges = _union(sorted((e, d) for e, d, _ in mine))
        prep, sample = inside(s0, s1, 1), inside(s1, n0, 3)
        for key, v in (("step", n0 - s0), ("forward", f1 - f0), ("exchanges", exchanges),
                       ("forward_without_exchanges", f1 - f0 - exchanges), ("prepare_inputs", prep),
                       ("sample_tokens", sample), ("other", n0 - s0 - (f1 - f0) - prep - sample)):
            samples[key].append(v / 1e6)
    if not samples["step"]:
        return {}
    return {"steps": len(samples["step"]), "median_ms": {k: float(np.median(v)) for k, v in samples.items()}}


# ------------------------------------------------------------------ report


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir or "bench/results")
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or "dataplane_transport_cpu"
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()[0]
    print("afore bench dataplane --part transport: exchange round trips (shm, gloo)", file=sys.stderr)
    exchange = []
    for kind in ("shm", "gloo"):
        exchange += measure_exchange(args.exchange_hidden, 8, 2, args.exchange_reps, kind)
    print("afore bench dataplane --part transport: bytes per layer", file=sys.stderr)
    bytes_rows = measure_bytes()
    serve = measure_serve(args, out_dir / "tmp") if args.serve else None
    result = {"command": "afore " + " ".join(sys.argv[1:]), "date": started,
              "hardware": {"machine": platform.machine(), "cpus": os.cpu_count(), "processor": platform.processor(),
                           "load_average_1min": [load_start, os.getloadavg()[0]]},
              "measured": ["exchange", "serve"], "computed_from_partition": ["bytes"],
              "exchange": exchange, "bytes": bytes_rows, "serve": serve}
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out_dir / f"{name}.md").write_text(markdown(result))
    plot(result, out_dir / f"{name}.png")
    print(f"wrote {out_dir / name}.json/.md/.png", file=sys.stderr)
    return 0


def markdown(r: dict) -> str:
    lines = [f"# Data plane: transports on {r['hardware']['cpus']} CPUs ({r['hardware']['machine']})", "",
             f"Command: `{r['command']}`  ", f"Date: {r['date']}  ",
             f"Load average (1 min) at start and end: {r['hardware']['load_average_1min'][0]:.1f}, "
             f"{r['hardware']['load_average_1min'][1]:.1f} (the benchmark's own processes count; above ~2, other jobs "
             f"shared the {r['hardware']['cpus']} cores)  ",
             "Measured on this machine: the exchange round trips" + (" and serving" if r.get("serve") else "")
             + "; bytes are counted from the real eq. 11 partition (no timing). Totals over all FFN workers.", "",
             "## Exchange round trip (A=1, F=2 processes, no expert compute)", "",
             "| transport | tokens | hidden | p50 us | p99 us | A2F bytes sent | F2A bytes |", "|---|---|---|---|---|---|---|"]
    for e in r["exchange"]:
        lines.append(f"| {e['transport']} | {e['tokens']} | {e['hidden']} | {e['p50_us']:.1f} | {e['p99_us']:.1f} | "
                     f"{e['a2f_bytes_sent']:,} | {e['f2a_bytes']:,} |")
    lines += ["", "## Hidden-row bytes per layer, each way (E=128, F=8, top-8, bf16, H=2048, primary-only plan)", "",
              "| tokens | skew | minimum (pairs x H x 2) | shm A2F | shm F2A | shm / minimum | dense A2F | dense F2A |",
              "|---|---|---|---|---|---|---|---|"]
    for b in r["bytes"]:
        lines.append(f"| {b['tokens']} | {b['skew']} | {b['min_bytes']:,} | {b['shm_a2f_bytes']:,} | {b['shm_f2a_bytes']:,} | "
                     f"{b['shm_over_min']:.3f} | {b['dense_a2f_bytes']:,} | {b['dense_f2a_bytes']:,} |")
    lines += ["", "shm moves a token's row once to each worker that computes one of its pairs (so at most the "
              "minimum; less when a worker computes several of a token's experts); dense (the torch transport) moves "
              "every token to every worker and all-reduces [N, H] over F (ring: 2(F-1) x N x H x 2 bytes) before "
              "replying. The exchange round trips were timed with other processes on the same 2 cores (load "
              "average above): they compare the two transports under the same load, they are not the quiet "
              "machine's floor.", ""]
    s = r.get("serve")
    if s:
        lines += ["## Decode through the HTTP API (tiny Qwen3-MoE, float32, A=1, F=2; vLLM's serving client: "
                  "random 64-token prompts, 32 output tokens, 24 requests, concurrency 4)", "",
                  "| server | round | median ITL ms | p99 ITL ms | median TPOT ms | output tok/s |", "|---|---|---|---|---|---|"]
        order = ("interleaved: every server up at once, round r of each in turn (--serve-interleave)"
                 if s.get("interleaved") else "one server after another, each started alone")
        lines[-2:-2] = [f"Rounds: {order}.", ""]
        for name in SERVERS:
            for i, rr in enumerate(s.get(name, {}).get("rounds", [])):
                lines.append(f"| {name} | {i} | {rr['itl_ms']['p50']:.2f} | {rr['itl_ms']['p99']:.2f} | "
                             f"{rr['tpot_ms']['p50']:.2f} | {rr['output_throughput']:.0f} |")
        names = [n for n in SERVERS if n != "vllm" and n in s and s[n].get("figures")]
        if names:
            lines += ["", "afore's own figures over the rounds (means of its Prometheus histograms, ms; measured):", "",
                      "| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            for fam, label in FIGURES:
                cells = [s[n]["figures"].get(fam) for n in names]
                lines.append(f"| {label} (`{fam}`) | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
        lines += ["", "Median ITL against plain vLLM (median of the rounds; targets: median <= 2x, p99 <= 3x):", "",
                  "| server | median ITL / plain | p99 ITL / plain |", "|---|---|---|"]
        lines += [f"| {name} | **{ratio:.2f}x** | {ratio99:.2f}x |" for name, ratio, ratio99 in itl_ratios(s)]
        lines += ["", "afore-shm: one microbatch, the scheduler process plans; afore-shm-attention the same with "
                  "`--planner attention` (the attention worker plans in-process); -unpinned the same with "
                  "`--ffn-cpus none --ffn-nice 0` (FFN workers placed by the kernel at vLLM's priority), -nonice "
                  "with `--ffn-nice 0` (pinned, vLLM's priority); afore-shm-workers "
                  "the same with `--planner workers`; -m2 two ping-pong microbatches, -m2-serial the same without "
                  "the overlap (--no-pingpong); afore-torch-gloo the data plane before issue 10 (dense, 2 "
                  "microbatches).", ""]
        b = s.get("breakdown") or {}
        if b.get("stages"):
            lines += [f"### Where a decode target's time goes (afore-shm run, {b['targets']} decode targets of attention "
                      f"worker 0, {b['ffn_workers']} FFN workers; AFORE_STAGE_TRACE of every process, one clock)", "",
                      *_stage_rows(b["stages"])]
            lines += ["", "FFN stages are per worker (both workers' samples); the scheduler's run beside the A2F post "
                      "and the FFN workers' wake-up. A mean far above its median is preemption: more runnable "
                      "processes than cores.", ""]
        bw = s.get("breakdown_workers") or {}
        if bw.get("stages"):
            lines += [f"### The same with `--planner workers` (afore-shm-workers run, {bw['targets']} decode targets)", "",
                      *_stage_rows(bw["stages"])]
            lines += ["", "No demand is emitted and no scheduler runs: 'FFN: taken up -> plan read and checked' is "
                      "this worker's own planning (the policy) and the plan's checks.", ""]
        ba = s.get("breakdown_attention") or {}
        if ba.get("stages"):
            lines += [f"### The same with `--planner attention` (afore-shm-attention run, {ba['targets']} decode targets)", "",
                      *_stage_rows(ba["stages"])]
            lines += ["", "No mailbox and no scheduler process: 'demand emit' is the attention worker's own planning "
                      "(routed counts, the policy, the publish on the plan ring), before the A2F post; the "
                      "scheduler rows are that in-process service's.", ""]
        bp = s.get("breakdown_pingpong") or {}
        if bp.get("stages"):
            lines += [f"### The same with two ping-pong microbatches (afore-shm-m2 run, {bp['targets']} decode targets)", "",
                      *_stage_rows(bp["stages"])]
            lines += ["", "With ping-pong, 'FFN: A2F posted -> worker takes it up' includes the wait behind the other "
                      "microbatch's target (the FFN side is busy), and the attention worker's wait for F2A is what "
                      "the other microbatch's attention did not hide.", ""]
        lines += runner_markdown(s.get("runner") or {})
    return "\n".join(lines)


def itl_ratios(serve: dict) -> list[tuple[str, float, float]]:
    """(server, median ITL / plain vLLM's, p99 ITL / plain vLLM's) of every afore server that ran,
    each the median over its rounds."""
    def med(name: str, key: str) -> float:
        return statistics.median(rr["itl_ms"][key] for rr in serve[name]["rounds"])

    v, v99 = med("vllm", "p50"), med("vllm", "p99")
    return [(n, med(n, "p50") / v, med(n, "p99") / v99) for n in SERVERS
            if n != "vllm" and serve.get(n, {}).get("rounds")]


def _stage_rows(stages: dict) -> list[str]:
    """A ``stage_breakdown`` stage table in markdown (header included)."""
    return ["| stage | median us | mean us | samples |", "|---|---|---|---|",
            *(f"| {name} | {st['median_us']:.0f} | {st['mean_us']:.0f} | {st['n']} |" for name, st in stages.items())]


RUNNER_ROWS = (("step", "decode step (execute_model to the next)"), ("forward", "model forward"),
               ("exchanges", "of which MoE layer calls (exchanges with the FFN pool)"),
               ("forward_without_exchanges", "of which the rest of the forward"),
               ("prepare_inputs", "prepare inputs"), ("sample_tokens", "sample tokens"),
               ("other", "other (engine core: scheduling, its two RPCs to the worker)"))


def runner_markdown(runner: dict) -> list[str]:
    """The table of ``runner_breakdown`` per server ([] when no server has one)."""
    names = [n for n, b in runner.items() if b]
    if not names:
        return []
    lines = ["### vLLM's step in the process that runs the model (medians over decode steps, ms; AFORE_STAGE_TRACE, "
             "afore's plugin times vLLM's model-runner phases, in plain vLLM too)", "",
             "| phase | " + " | ".join(f"{n} ({runner[n]['steps']} steps)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for key, label in RUNNER_ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{runner[n]['median_ms'][key]:.3f}" for n in names) + " |")
    lines += ["", "Each figure is a median over steps on its own (the rows do not add up exactly); 'rest of the "
              "forward' is taken per step (forward minus its layer calls). Plain vLLM computes its experts inside "
              "its forward. With ping-pong microbatches the layer calls are the time any microbatch had one open "
              "(a call stays open while the other microbatch computes its attention), so 'rest of the forward' "
              "is the attention that no open call covered.", ""]
    return lines


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for kind in ("shm", "gloo"):
        rows = [e for e in r["exchange"] if e["transport"] == kind]
        ax[0].plot([e["tokens"] for e in rows], [e["p50_us"] for e in rows], "o-", label=f"{kind} p50")
        ax[0].plot([e["tokens"] for e in rows], [e["p99_us"] for e in rows], "x--", label=f"{kind} p99")
    ax[0].set_xscale("log")
    ax[0].set_yscale("log")
    ax[0].set_xlabel("tokens per target")
    ax[0].set_ylabel("round trip (us)")
    ax[0].set_title("exchange, A=1 F=2 (measured)")
    ax[0].legend()
    labels = [f"{b['tokens']}/skew {b['skew']}" for b in r["bytes"]]
    xs = np.arange(len(labels))
    for i, (key, lab) in enumerate((("min_bytes", "minimum"), ("shm_a2f_bytes", "shm"), ("dense_a2f_bytes", "dense"))):
        ax[1].bar(xs + i * 0.27, [b[key] / 1e6 for b in r["bytes"]], 0.27, label=lab)
    ax[1].set_xticks(xs + 0.27, labels)
    ax[1].set_ylabel("A2F MB per layer")
    ax[1].set_title("bytes per layer, F=8 (counted)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
