"""`afore bench ab --engine cpu-runtime`: the simulator's stage model against the CPU runtime.

One ``afore serve`` (the built-in tiny Qwen3-MoE, float32, A = 1 attention worker, F = 2 FFN
workers, shm transport, M = 2 microbatches, everything on this machine's cores) serves a decode
load from vLLM's own serving client once per policy (static, eplb, afore; switched through the
admin endpoint, so every policy runs in the same processes). The runtime's own timestamps give
the measured side:

- per step and MoE layer, on the attention worker (``AFORE_STAGE_TRACE``,
  ``afore.attention.stages``): the attention compute before the layer call, demand emit, A2F post,
  the wait for the F2A replies, and the step time (exit of the last MoE layer to the next one);
- per target on the FFN workers (``PATH.ffn<rank>.csv``: read, taken up, plan, compute, vote,
  reply) and the scheduler (``PATH.scheduler.csv``: demand written -> plan published), joined
  with the attention rows on one CLOCK_MONOTONIC axis (``stage_table``);
- from ``/metrics``: the FFN stage histogram, plans used / missed, copies, exposed copy wait.

The simulated side (``pipeline_sim.simulate_runtime``) replays the same steps: the measured
attention compute of every step and layer goes in as input, everything after it (demand emit,
A2F, plan wait, plan decode, agreement, FFN stage, copies, F2A) comes from the stage calibration
file, which ``--write-calibration`` produced from a *different* run (the same traces of its own
serve run; the microbenchmarks of the shm exchange, plan decode, vote and host copy are kept in
the file as a cross-check, and only the host copy rate is used). Step times are compared per
policy, side by side, also against the same model fed with the validated run's own stage means
(which separates the model's structure from the drift of stage costs between runs).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from afore.bench.pipeline_sim import StageCosts, simulate_runtime, stage_costs_from_dict

POLICIES = ("static", "eplb", "afore")
CALIBRATION_KIND = "afore-stage-calibration"
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[2] / "bench" / "results" / "stages_cpu.json"
DECODE_TOKENS_MAX = 8  # tokens per microbatch of a decode step (concurrency 4, M = 2: 2)


# ------------------------------------------------------------------ calibration file


def load_stage_calibration(path: str | Path) -> tuple[StageCosts, dict]:
    """The StageCosts and the whole document of a stage calibration file (ValueError naming what is wrong)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration: expected a stage calibration file at {str(path)!r}, none found")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"calibration: expected JSON in {str(path)!r}, got: {exc}") from None
    if doc.get("kind") != CALIBRATION_KIND:
        raise ValueError(f"kind: expected {CALIBRATION_KIND!r} in {path.name}, got {doc.get('kind')!r}")
    for key in ("meta", "stages", "ffn_compute"):
        if key not in doc:
            raise ValueError(f"{key}: expected in {path.name}")
    return stage_costs_from_dict(doc["stages"]), doc


# ------------------------------------------------------------------ microbenchmarks (real code)


def _vote_worker(name: str, layout_bytes: bytes, rank: int, reps: int, queue) -> None:
    import msgspec
    import torch

    from afore.transport.shm import ShmFFNEnd, ShmLayout

    torch.set_num_threads(1)
    end = ShmFFNEnd(name, msgspec.json.decode(layout_bytes, type=ShmLayout), rank, timeout_s=60)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        end.agree(True)
        times.append(time.perf_counter_ns() - t0)
    queue.put((rank, times))
    end.close()


def measure_agreement(num_ffn: int = 2, reps: int = 400) -> dict:
    """Per-call time of ``ShmFFNEnd.agree`` with ``num_ffn`` worker processes voting together (ms)."""
    import msgspec

    from afore.transport.shm import ShmLayout, ShmSegment

    layout = ShmLayout(num_attention=1, num_ffn=num_ffn, hidden=64, top_k=2, max_tokens=8, depth=2)
    name = f"afore-bench-vote-{os.getpid()}"
    seg = ShmSegment.create(name, layout)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_vote_worker, args=(name, msgspec.json.encode(layout), r, reps, queue)) for r in range(num_ffn)]
    try:
        for p in procs:
            p.start()
        results = [queue.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        seg.close()
    # per vote, the slowest worker's call (the stage waits for it); the first 10% are warm-up
    per = np.max(np.array([t for _, t in sorted(results)], np.float64), axis=0)[reps // 10:] / 1e6
    return {"median_ms": float(np.median(per)), "mean_ms": float(per.mean()), "p90_ms": float(np.percentile(per, 90)),
            "reps": int(per.size), "workers": num_ffn}


def measure_plan_decode(model: str, num_ffn: int, redundant_slots: int, m_tile: int, reps: int = 2000) -> dict:
    """Time of ``decode_worker_plan`` on an encoded plan of ``model``'s shape (what an FFN worker
    does with a plan it copied out of the ring), ms; ring copy excluded (``afore bench transport``)."""
    from afore.config import ClusterShape
    from afore.models.checkpoint import read_model_spec
    from afore.plan import Target, primary_only_plan
    from afore.scheduler.plan_codec import decode_worker_plan, encode_plan

    spec = read_model_spec(model)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=num_ffn, num_layers=len(spec.moe_layer_indices),
                         redundant_slots=redundant_slots, m_tile=m_tile, top_k=spec.top_k)
    rng = np.random.default_rng(0)
    plan = primary_only_plan(shape, rng.integers(0, 8, spec.num_experts), Target(0, 0, 0), 0)
    data = encode_plan(plan)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        decode_worker_plan(data, shape)
        times.append(time.perf_counter_ns() - t0)
    t = np.array(times[reps // 10:], np.float64) / 1e6
    return {"median_ms": float(np.median(t)), "mean_ms": float(t.mean()), "plan_bytes": len(data), "reps": int(t.size)}


def measure_exchange_rtt(hidden: int, top_k: int, num_ffn: int, reps: int = 200) -> dict:
    """shm round trip of one target with no expert compute (``afore bench dataplane``'s exchange), ms by tokens."""
    from afore.bench.dataplane.transport import measure_exchange

    rows = measure_exchange(hidden, top_k, num_ffn, reps, "shm")
    return {str(r["tokens"]): {"p50_ms": r["p50_us"] / 1e3, "p99_ms": r["p99_us"] / 1e3} for r in rows}


def measure_copy_rate(nbytes: int, reps: int = 200) -> dict:
    """Host memcpy rate of one expert's bytes (a CPU FFN worker's replica copy), GB/s."""
    import torch

    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        dst.copy_(src)
        times.append(time.perf_counter_ns() - t0)
    ms = float(np.median(times[reps // 10:])) / 1e6
    return {"bytes": nbytes, "median_ms": ms, "gbps": nbytes / (ms * 1e6)}


# ------------------------------------------------------------------ the serve run


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with labels: value} (no buckets, no _created)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "_bucket" in line or "_created" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def scrape_metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=20) as resp:
        return parse_metrics(resp.read().decode("utf-8", "replace"))


def metric_sum(samples: dict[str, float], family: str, **labels: str) -> float:
    """Sum of every sample of ``family`` (exact name before the labels) whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        name, _, rest = key.partition("{")
        if name != family:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def run_deltas(before: dict, after: dict, policy: str) -> dict:
    """The runtime's own counters over one policy's run (FFN worker 0 for per-worker figures)."""
    def d(family, **labels):
        return metric_sum(after, family, **labels) - metric_sum(before, family, **labels)

    stage_n = d("afore_ffn_stage_seconds_count", worker="0")
    targets = d("afore_ffn_targets_total", worker="0")
    exposed_n = d("afore_ffn_exposed_copy_wait_seconds_count", worker="0")
    sched_n = d("afore_scheduler_demand_to_plan_seconds_count", policy=policy)
    pol_n = d("afore_scheduler_policy_seconds_count", policy=policy)
    read_n = d("afore_scheduler_plan_read_seconds_count", policy=policy)
    return {
        "ffn_targets": targets,
        "ffn_stage_ms_mean": 1e3 * d("afore_ffn_stage_seconds_sum", worker="0") / stage_n if stage_n else None,
        "plans_used": d("afore_ffn_plans_total", worker="0", outcome="used"),
        "plans_missed": d("afore_ffn_plans_total", worker="0", outcome="missed"),
        "plans_rejected": d("afore_ffn_plans_total", worker="0", outcome="rejected"),
        "plans_mismatched": d("afore_ffn_plans_total", worker="0", outcome="mismatched"),
        "primary_only_targets": d("afore_ffn_primary_only_targets_total", worker="0"),
        "copies_all_workers": d("afore_ffn_copies_total"),
        "copy_bytes_all_workers": d("afore_ffn_copy_bytes_total"),
        "planned_targets_with_timings": exposed_n,
        "exposed_ms_mean": 1e3 * d("afore_ffn_exposed_copy_wait_seconds_sum", worker="0") / exposed_n if exposed_n else None,
        "demand_to_plan_ms_mean": 1e3 * d("afore_scheduler_demand_to_plan_seconds_sum", policy=policy) / sched_n if sched_n else None,
        "policy_ms_mean": 1e3 * d("afore_scheduler_policy_seconds_sum", policy=policy) / pol_n if pol_n else None,
        "plan_read_ms_mean": 1e3 * d("afore_scheduler_plan_read_seconds_sum", policy=policy) / read_n if read_n else None,
        "plans_published": d("afore_scheduler_plans_total", policy=policy),
    }


def wait_admin(admin_url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    """Poll the admin endpoint's /afore/status until it answers (it comes up after the API)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"afore serve exited with code {proc.returncode} before its admin endpoint answered")
        try:
            with urllib.request.urlopen(f"{admin_url}/afore/status", timeout=5) as resp:
                resp.read()
                return
        except urllib.error.HTTPError:
            return  # it answers (a 503 while a part is starting is an answer)
        except (urllib.error.URLError, OSError):
            time.sleep(1.0)
    raise RuntimeError(f"admin endpoint {admin_url} not answering after {timeout_s:.0f} s")


def serve_policies(model: str, policies: tuple[str, ...], requests: int, concurrency: int, output_len: int,
                   work_dir: Path, seed: int, mode: str = "serial") -> dict:
    """Start ``afore serve`` once, run the load once per policy; returns the windows, metrics and trace path.
    ``mode``: serial (``--no-pingpong``: a layer's two microbatches posted, then both awaited) or
    pingpong (the runtime's ping-pong microbatches, afore.attention.pingpong)."""
    if mode not in ("serial", "pingpong"):
        raise ValueError(f"mode: expected serial or pingpong, got {mode!r}")
    from afore.bench.serve import Prompt, run_load, set_policy, stop_server, wait_ready
    from afore.ports import free_port

    work_dir.mkdir(parents=True, exist_ok=True)
    trace = work_dir / "stages"
    for f in work_dir.glob("stages*"):
        f.unlink()
    port = free_port()
    admin = port + 1
    url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"
    command = [sys.executable, "-m", "afore.cli", "serve", "--model", model, "--dtype", "float32", "--max-model-len", "512",
               "--transport", "shm", "--microbatches", "2", "--colocate", "--policy", policies[0], "--port", str(port),
               "--admin-port", str(admin), *(["--no-pingpong"] if mode == "serial" else [])]
    log_path = work_dir / "serve.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "AFORE_STAGE_TRACE": str(trace)})
    rng = np.random.default_rng(seed)

    def prompts(n):  # random 64-token prompts (vLLM's random data set style)
        return [Prompt(" ".join(str(int(t)) for t in rng.integers(0, 1000, 64)), output_len) for _ in range(n)]

    runs = {}
    try:
        print(f"afore bench ab --engine cpu-runtime: starting {' '.join(command)}", file=sys.stderr)
        wait_ready(url, 900, proc)
        wait_admin(admin_url, 120, proc)
        for policy in policies:
            for attempt in range(3):  # a scheduler that failed to start (e.g. its extension rebuilt under it) gets retried
                try:
                    set_policy(admin_url, policy)
                    break
                except RuntimeError as exc:
                    if attempt == 2:
                        raise
                    print(f"afore bench ab --engine cpu-runtime: switching to {policy} failed ({exc}); retrying", file=sys.stderr)
                    time.sleep(5.0)
            asyncio.run(run_load(url, model, prompts(concurrency), concurrency, True, 0, f"{policy} warm-up"))
            before = scrape_metrics(url)
            t0 = time.perf_counter_ns()
            load = asyncio.run(run_load(url, model, prompts(requests), concurrency, True, 0, policy))
            t1 = time.perf_counter_ns()
            after = scrape_metrics(url)
            runs[policy] = {"window_ns": [t0, t1], "load": load, "runtime": run_deltas(before, after, policy),
                            "load_average_1min": os.getloadavg()[0]}
        # the stage trace is written in blocks of 256 rows: a last load pushes the final policy's rows out
        asyncio.run(run_load(url, model, prompts(2 * concurrency), concurrency, True, 0, "flush"))
    finally:
        stop_server(proc)
        log.close()
    out = {"command": command, "trace": str(trace), "log": str(log_path), "runs": runs,
           "settings": {"requests": requests, "concurrency": concurrency, "output_len": output_len, "seed": seed,
                        "mode": mode}}
    (work_dir / "run.json").write_text(json.dumps(out, indent=1))  # --reuse-run analyses it again without serving
    return out


# ------------------------------------------------------------------ the stage trace


def load_trace(trace: str | Path) -> np.ndarray:
    from afore.attention.stages import COLUMNS

    trace = Path(trace)
    # the attention workers' files are PATH.<worker index>.csv (the FFN workers' PATH.ffn<rank>.csv)
    files = sorted(f for f in trace.parent.glob(trace.name + ".*.csv") if f.name[len(trace.name) + 1:-4].isdigit())
    if not files:
        raise ValueError(f"trace: expected {trace}.<worker>.csv files (AFORE_STAGE_TRACE), none found")
    data = np.concatenate([np.loadtxt(f, delimiter=",", skiprows=1, ndmin=2, dtype=np.int64) for f in files])
    assert data.shape[1] == len(COLUMNS)
    return data


def decode_steps(data: np.ndarray, window_ns: tuple[int, int], num_layers: int, microbatches: int,
                 max_tokens: int = DECODE_TOKENS_MAX) -> dict:
    """The complete steps inside ``window_ns`` of at most ``max_tokens`` tokens per microbatch (decode
    steps by default) whose next step is also there (its first layer call's ``prev_exit`` ends this
    step), as arrays.

    Returns {"steps": int[S], "attention_ms": float[S, L] (compute before each MoE layer call;
    layer 0: since the previous step's last MoE layer ended), "step_ms": float[S],
    "exchange_ms": float[S, L] (layer call enter -> exit), "demand_emit_ms", "a2f_post_ms",
    "f2a_wait_ms": float[S, L, M], "tokens": int[S, L, M], "attention_target_ms": float[S, L, M]
    (each target's own compute before its call: a ping-pong microbatch's, on its thread)}."""
    from afore.attention.stages import COLUMNS

    col = {c: i for i, c in enumerate(COLUMNS)}
    lo, hi = window_ns
    rows = data[(data[:, col["enter_ns"]] >= lo) & (data[:, col["done_ns"]] <= hi)]
    by_step: dict[int, dict] = {}
    for r in rows:
        by_step.setdefault(int(r[col["step"]]), {})[(int(r[col["layer"]]), int(r[col["microbatch"]]))] = r
    full = {s: v for s, v in by_step.items() if len(v) == num_layers * microbatches}
    keep = [s for s in sorted(full) if s + 1 in full
            and all(0 < full[s][(l, b)][col["tokens"]] <= max_tokens for l in range(num_layers) for b in range(microbatches))]
    S, L, M = len(keep), num_layers, microbatches
    out = {"steps": np.array(keep, np.int64), "attention_ms": np.zeros((S, L)), "step_ms": np.zeros(S),
           "exchange_ms": np.zeros((S, L)), "demand_emit_ms": np.zeros((S, L, M)), "a2f_post_ms": np.zeros((S, L, M)),
           "f2a_wait_ms": np.zeros((S, L, M)), "tokens": np.zeros((S, L, M), np.int64),
           "attention_target_ms": np.zeros((S, L, M))}
    for i, s in enumerate(keep):
        cur, nxt = full[s], full[s + 1]
        out["step_ms"][i] = (nxt[(0, 0)][col["prev_exit_ns"]] - cur[(0, 0)][col["prev_exit_ns"]]) / 1e6
        for l in range(L):
            first = cur[(l, 0)]
            out["attention_ms"][i, l] = (first[col["enter_ns"]] - first[col["prev_exit_ns"]]) / 1e6
            end = nxt[(0, 0)][col["prev_exit_ns"]] if l == L - 1 else cur[(l + 1, 0)][col["prev_exit_ns"]]
            out["exchange_ms"][i, l] = (end - first[col["enter_ns"]]) / 1e6
            prev = first[col["enter_ns"]]
            for b in range(M):
                r = cur[(l, b)]
                demand, sent = r[col["demand_ns"]], r[col["sent_ns"]]
                if demand <= sent:  # the demand, then the post (host ids)
                    out["demand_emit_ms"][i, l, b], out["a2f_post_ms"][i, l, b] = (demand - prev) / 1e6, (sent - demand) / 1e6
                else:  # the post, then the demand from its host copy of the ids (GPU, shm)
                    out["a2f_post_ms"][i, l, b], out["demand_emit_ms"][i, l, b] = (sent - prev) / 1e6, (demand - sent) / 1e6
                out["f2a_wait_ms"][i, l, b] = (r[col["done_ns"]] - r[col["recv_start_ns"]]) / 1e6
                out["tokens"][i, l, b] = r[col["tokens"]]
                out["attention_target_ms"][i, l, b] = (r[col["enter_ns"]] - r[col["prev_exit_ns"]]) / 1e6
                prev = max(demand, sent)
    return out


def load_named(path: str | Path) -> dict[str, np.ndarray]:
    """A CSV trace with a header of column names as {column: int64[rows]} (empty arrays when no rows)."""
    path = Path(path)
    with open(path) as fh:
        names = fh.readline().strip().split(",")
    data = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2, dtype=np.int64)
    if data.size == 0:
        data = np.zeros((0, len(names)), np.int64)
    return {n: data[:, i] for i, n in enumerate(names)}


def stage_table(trace: str | Path, window_ns: tuple[int, int]) -> dict | None:
    """Per-target stage times (ms) of one policy's window from the runtime's own traces: the
    attention worker's, every FFN worker's (``PATH.ffn<rank>.csv``) and the scheduler's
    (``PATH.scheduler.csv``), joined by target; None when the FFN or scheduler traces are absent.

    A target's FFN stamps are the latest over the workers (the slowest one ends the stage).
    Returns float64 arrays (one entry per target, NaN where the stage does not apply):
    a2f_latency (attention posted -> the last FFN worker read it, microbatch 0 only: the workers
    were idle, so it is the wake-up and read, no queueing), queue (read -> taken up),
    plan (taken up -> plan read and checked: the wait for the plan and its decode), decode
    (the same, over the targets whose plan was published before they were taken up), vote
    (last worker's plan -> last worker's agreement), compute (agreed -> computed: read-ahead,
    commit, partition, experts), reply (computed -> sent), stage (taken up -> sent), f2a_latency
    (last reply -> the attention worker had the target, where it was waiting), send (the last
    worker's sent_ns -> the next target taken up, where the next target had already arrived: the
    time the pool stays in its reply send, the combine and the F2A write, which ``sent_ns``
    precedes), schedule (demand written -> plan published), used (share of workers that ran the
    scheduler's plan)."""
    from afore.attention.stages import COLUMNS

    trace = Path(trace)
    ffn_files = sorted(trace.parent.glob(trace.name + ".ffn*.csv"))
    sched_file = trace.parent / (trace.name + ".scheduler.csv")
    if not ffn_files or not sched_file.is_file():
        return None
    lo, hi = window_ns
    attn = load_trace(trace)
    col = {c: i for i, c in enumerate(COLUMNS)}
    attn = attn[(attn[:, col["enter_ns"]] >= lo) & (attn[:, col["done_ns"]] <= hi)]
    workers = [load_named(f) for f in ffn_files]
    # the worker's order of stages: vote then compute (older workers), or compute then vote
    header = open(ffn_files[0]).readline().strip().split(",")
    vote_after = header.index("computed_ns") < header.index("agreed_ns")
    sched = load_named(sched_file)
    keys = ("arrived_ns", "start_ns", "plan_ns", "agreed_ns", "computed_ns", "sent_ns")
    per_seq: dict[int, dict] = {}
    for w in workers:
        inside = (w["arrived_ns"] >= lo) & (w["arrived_ns"] <= hi)
        for i in np.flatnonzero(inside):
            seq = int(w["seq"][i])
            rec = per_seq.setdefault(seq, {"n": 0, "used": 0, "key": (int(w["step"][i]), int(w["layer"][i]), int(w["microbatch"][i]))})
            rec["n"] += 1
            rec["used"] += int(w["used"][i])
            for k in keys:
                rec[k] = max(rec.get(k, 0), int(w[k][i]))
    published = {int(q): (int(a), int(b)) for q, a, b in zip(sched["seq"], sched["written_ns"], sched["published_ns"])}
    by_key = {(int(r[col["step"]]), int(r[col["layer"]]), int(r[col["microbatch"]])): r for r in attn}
    rows = {k: [] for k in ("a2f_latency", "queue", "plan", "decode", "vote", "compute", "reply", "stage", "f2a_latency",
                            "send", "schedule", "used", "microbatch")}
    nan = float("nan")
    for seq, rec in sorted(per_seq.items()):
        if rec["n"] != len(workers):
            continue
        a = by_key.get(rec["key"])
        pub = published.get(seq)
        ms = lambda x: x / 1e6  # noqa: E731
        # arrived_ns is when the worker read the target: a transport latency only where it was idle,
        # waiting for it (microbatch 0: the previous layer's replies were all back before it was sent)
        idle = a is not None and rec["key"][2] == 0
        rows["a2f_latency"].append(ms(rec["arrived_ns"] - a[col["sent_ns"]]) if idle else nan)
        rows["microbatch"].append(rec["key"][2])
        rows["queue"].append(ms(rec["start_ns"] - rec["arrived_ns"]))
        rows["plan"].append(ms(rec["plan_ns"] - rec["start_ns"]))
        rows["decode"].append(ms(rec["plan_ns"] - rec["start_ns"]) if pub is not None and pub[1] <= rec["start_ns"] else nan)
        if vote_after:
            rows["compute"].append(ms(rec["computed_ns"] - rec["plan_ns"]))
            rows["vote"].append(ms(rec["agreed_ns"] - rec["computed_ns"]))
            rows["reply"].append(ms(rec["sent_ns"] - rec["agreed_ns"]))
        else:
            rows["vote"].append(ms(rec["agreed_ns"] - rec["plan_ns"]))
            rows["compute"].append(ms(rec["computed_ns"] - rec["agreed_ns"]))
            rows["reply"].append(ms(rec["sent_ns"] - rec["computed_ns"]))
        rows["stage"].append(ms(rec["sent_ns"] - rec["start_ns"]))
        waiting = a is not None and a[col["recv_start_ns"]] <= rec["sent_ns"]
        rows["f2a_latency"].append(ms(a[col["done_ns"]] - rec["sent_ns"]) if waiting else nan)
        nxt = per_seq.get(seq + 1)
        queued = nxt is not None and nxt["n"] == len(workers) and nxt["arrived_ns"] <= rec["sent_ns"]
        rows["send"].append(ms(nxt["start_ns"] - rec["sent_ns"]) if queued else nan)
        rows["schedule"].append(ms(pub[1] - pub[0]) if pub is not None else nan)
        rows["used"].append(rec["used"] / rec["n"])
    out = {k: np.array(v, np.float64) for k, v in rows.items()}
    out["vote_after_compute"] = vote_after
    return out


def _mean(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else None


def stage_means(table: dict | None) -> dict:
    """{stage: mean ms} (NaN entries left out), {} without a table."""
    if table is None:
        return {}
    return {k: _mean(v) for k, v in table.items() if k != "vote_after_compute"} | {"targets": int(table["stage"].size)}


# ------------------------------------------------------------------ simulation of the measured steps


def simulate_steps(steps: dict, costs: StageCosts, compute_ms: float, policy: str, microbatches: int,
                   copies_per_target: float = 0.0, bytes_per_expert: float = 0.0, mode: str = "serial") -> dict:
    """The stage model over the measured steps of one policy: the measured attention compute goes
    in; the step time, the exchange per layer call and the FFN-side figures come out (ms).

    Steps are simulated one at a time (a step starts with its measured attention compute, so a
    gap between two measured steps never carries over); copies: ``copies_per_target`` (the run's
    measured mean into the busiest worker) spread evenly over the targets. ``mode`` pingpong: every
    target's own measured compute goes in (``attention_target_ms``), the step drains at its end
    (``step_barrier``: vLLM samples the whole batch before the next step)."""
    attn = steps["attention_ms"]
    S, L = attn.shape
    M = microbatches
    n = L * M
    sim_step, sim_exchange, wait, miss, exposed, stage, queue = np.zeros(S), np.zeros((S, L)), [], [], [], [], []
    for i in range(S):
        idx = np.arange(n) + i * n
        copies = (np.floor((idx + 1) * copies_per_target) - np.floor(idx * copies_per_target)).astype(np.int64)
        if mode == "pingpong":
            tl = simulate_runtime("pingpong", steps["attention_target_ms"][i].reshape(-1), np.full(n, compute_ms), L, M,
                                  costs, costs.schedule_for(policy), copies=copies, bytes_per_expert=bytes_per_expert,
                                  step_barrier=True)
        else:
            tl = simulate_runtime("serial", attn[i:i + 1], np.full(n, compute_ms), L, M, costs, costs.schedule_for(policy),
                                  copies=copies, bytes_per_expert=bytes_per_expert)
        sim_step[i] = tl.step_ms[0]
        sim_exchange[i] = tl.exchange_ms
        wait.append(tl.plan_wait)
        miss.append(tl.missed)
        exposed.append(tl.exposed)
        stage.append(tl.ffn_end - tl.ffn_start)
        queue.append(tl.ffn_start - tl.posted - costs.a2f_latency_ms)
    cat = (lambda xs: np.concatenate(xs)) if S else (lambda xs: np.zeros(0))
    plan_wait, missed, exp = cat(wait), cat(miss), cat(exposed)
    return {"step_ms": sim_step, "exchange_ms": sim_exchange,
            "ffn_stage_ms_mean": float(cat(stage).mean()) if S else 0.0, "queue_ms_mean": float(cat(queue).mean()) if S else 0.0,
            "plan_wait_ms_mean": float(plan_wait.mean()) if plan_wait.size else 0.0,
            "missed_share": float(missed.mean()) if missed.size else 0.0,
            "exposed_ms_mean": float(exp.mean()) if exp.size else 0.0}


# ------------------------------------------------------------------ the command


def _hardware() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0]}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _model_info(model: str) -> dict:
    from afore.config import ClusterShape
    from afore.models.checkpoint import read_model_spec

    spec = read_model_spec(model)
    m_tile = ClusterShape(num_experts=spec.num_experts, num_workers=2, num_layers=len(spec.moe_layer_indices),
                          top_k=spec.top_k).m_tile
    return {"path": model, "experts": spec.num_experts, "top_k": spec.top_k, "hidden": spec.hidden_size,
            "moe_intermediate": spec.moe_intermediate_size, "moe_layers": len(spec.moe_layer_indices), "m_tile": m_tile,
            "bytes_per_expert": 3 * spec.hidden_size * spec.moe_intermediate_size * 4}


def _all_steps(serve: dict, layers: int, microbatches: int) -> dict[str, dict]:
    data = load_trace(serve["trace"])
    return {p: decode_steps(data, tuple(r["window_ns"]), layers, microbatches) for p, r in serve["runs"].items()}


def _calibration_doc(serve: dict, micro: dict, model: dict, command: str, compute: float, stages: dict,
                     sources: dict, calibration_run: dict) -> dict:
    """The stage-calibration document (CALIBRATION_KIND) around one run's stage costs; the
    sources every calibration shares are added to ``sources``."""
    sources = {**sources,
               "ffn_compute.beta_tile_ms": "0: at decode sizes of the tiny model every worker has one tile (not resolvable here)",
               "plan_timeout_ms": "FFNWorkerConfig.plan_timeout_ms (afore serve's setting, not a measurement)",
               "copy_latency_ms, copy_link_gbps": "microbenchmark: host copy of one expert's bytes (CPU workers copy synchronously)"}
    return {"kind": CALIBRATION_KIND, "meta": {"command": command, "date_utc": _now(), "hardware": _hardware()},
            "engine": "cpu-runtime", "model": model,
            "runtime": {"attn_workers": 1, "ffn_workers": 2, "microbatches": 2, "transport": "shm", "mode": "serial",
                        "serve_command": serve["command"], "load": serve["settings"]},
            "ffn_compute": {"intercept_ms": compute, "beta_tile_ms": 0.0, "m_tile": model["m_tile"]},
            "stages": stages, "sources": sources, "microbenchmarks": micro, "calibration_run": calibration_run}


def build_calibration(serve: dict, steps: dict[str, dict], micro: dict, model: dict, command: str,
                      tables: dict[str, dict | None] | None = None) -> dict:
    """The stage calibration document from a serve run (all policies): from the runtime's own
    per-target traces (attention, FFN workers, scheduler) when all of them are there, else from
    the attention trace, the /metrics histograms and the microbenchmarks."""
    if tables and all(t is not None for t in tables.values()):
        return _calibration_from_traces(serve, steps, micro, model, command, tables)
    from afore.ffn.worker import FFNWorkerConfig

    runs = serve["runs"]
    emit = float(np.median(np.concatenate([s["demand_emit_ms"].ravel() for s in steps.values()])))
    post = float(np.median(np.concatenate([s["a2f_post_ms"].ravel() for s in steps.values()])))
    tokens = int(np.median(np.concatenate([s["tokens"].ravel() for s in steps.values()])))
    sizes = sorted(int(k) for k in micro["exchange"])
    near = min(sizes, key=lambda k: abs(k - tokens))
    rtt = micro["exchange"][str(near)]["p50_ms"]
    one_way = max(0.0, rtt - post) / 2
    decode, vote = micro["plan_decode"]["median_ms"], micro["agreement"]["median_ms"]
    stage = runs["static"]["runtime"]["ffn_stage_ms_mean"]
    if stage is None:
        raise RuntimeError("the static run recorded no FFN stage (afore_ffn_stage_seconds): cannot calibrate")
    compute = max(0.0, stage - decode - vote)
    schedule = {p: r["runtime"]["demand_to_plan_ms_mean"] for p, r in runs.items() if r["runtime"]["demand_to_plan_ms_mean"] is not None}
    stages = {"demand_emit_ms": emit, "a2f_post_ms": post, "a2f_latency_ms": one_way, "f2a_latency_ms": one_way,
              "f2a_read_ms": 0.0, "plan_decode_ms": decode, "agreement_ms": vote, "ffn_fixed_ms": 0.0,
              "plan_timeout_ms": FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model="").plan_timeout_ms,
              "copy_latency_ms": micro["copy"]["median_ms"], "copy_link_gbps": micro["copy"]["gbps"], "copy_cap_gbps": 0.0,
              "deadline_share": 0.5, "copies_synchronous": True, "schedule_ms": schedule}
    sources = {
        "demand_emit_ms": "attention stage trace of the calibration run: median demand_ns - (enter_ns | previous sent_ns), decode targets",
        "a2f_post_ms": "attention stage trace of the calibration run: median sent_ns - demand_ns",
        "a2f_latency_ms, f2a_latency_ms": f"half of (shm exchange round trip p50 at {near} tokens, no compute: {rtt:.3f} ms, "
                                          "minus a2f_post_ms); f2a_read_ms folded into them",
        "plan_decode_ms": "microbenchmark: decode_worker_plan of an encoded plan of the model's shape (ring copy not included)",
        "agreement_ms": f"microbenchmark: ShmFFNEnd.agree, {micro['agreement']['workers']} worker processes, slowest per vote",
        "ffn_compute.intercept_ms": "FFN stage of the calibration run's static policy (afore_ffn_stage_seconds mean, worker 0) "
                                    "minus plan_decode_ms and agreement_ms",
        "schedule_ms": "afore_scheduler_demand_to_plan_seconds mean per policy, calibration run",
    }
    return _calibration_doc(serve, micro, model, command, compute, stages, sources,
                            calibration_run={p: r["runtime"] for p, r in runs.items()})


def stages_from_traces(tables: dict[str, dict], steps: dict[str, dict], trace: str, reference: str = "static",
                       split_send: bool = False) -> tuple[dict, dict, dict]:
    """The stage costs that the runtime's own per-target traces measure (both engines' calibration).

    tables: {policy: ``stage_table`` of its window}; steps: {policy: ``decode_steps`` of its
    window} (the attention side's demand emit and A2F post); trace: how the sources name the
    traces; reference: the policy whose ``compute`` span is the FFN compute (static: no copies,
    no plan effects); split_send: the pool stays in its reply send (a combine over the workers, a
    blocking F2A write; ``stage_table``'s ``send``), so that part of the F2A latency is moved into
    ``ffn_fixed_ms`` (the workers are busy during it) and only the rest stays in ``f2a_latency_ms``.

    Returns (stages: the StageCosts fields measured here, ms, plus ``schedule_ms`` {policy: ms},
    ``vote_after_compute`` and ``compute_ms``: the reference's mean compute span; sources:
    {field: how it was measured}; not_measured: {field: why} for each stage without a sample,
    which is 0 in ``stages`` and must be reported as not measured, never as a measured 0)."""
    not_measured: dict[str, str] = {}

    def pooled(stage: str, field: str) -> float:
        values = np.concatenate([t[stage] for t in tables.values()])
        values = values[np.isfinite(values)]
        if not values.size:
            not_measured[field] = f"no {stage} sample in {trace}"
            return 0.0
        # >= 0: a worker stamps sent_ns after publishing, so a waiting reader can finish before it
        return max(0.0, float(values.mean()))

    def attention(key: str) -> float:
        values = np.concatenate([s[key].ravel() for s in steps.values()]) if steps else np.zeros(0)
        if not values.size:
            not_measured[key] = f"no complete step in the attention side's trace ({trace})"
            return 0.0
        return float(values.mean())

    ref = tables[reference] if reference in tables else next(iter(tables.values()))
    compute = _mean(ref["compute"])
    if compute is None:
        not_measured["compute_ms"] = f"no compute sample of {reference} in {trace}"
    f2a, reply = pooled("f2a_latency", "f2a_latency_ms"), pooled("reply", "ffn_fixed_ms")
    send = pooled("send", "send_ms") if split_send else 0.0
    schedule = {p: float(np.nanmean(t["schedule"])) for p, t in tables.items() if np.isfinite(t["schedule"]).any()}
    for p in tables:
        if p not in schedule:
            not_measured[f"schedule_ms[{p}]"] = f"no published plan of {p} in {trace}"
    stages = {"demand_emit_ms": attention("demand_emit_ms"), "a2f_post_ms": attention("a2f_post_ms"),
              "a2f_latency_ms": pooled("a2f_latency", "a2f_latency_ms"), "f2a_latency_ms": max(0.0, f2a - send),
              "f2a_read_ms": 0.0, "plan_decode_ms": pooled("decode", "plan_decode_ms"),
              "agreement_ms": pooled("vote", "agreement_ms"), "ffn_fixed_ms": reply + send, "schedule_ms": schedule,
              "vote_after_compute": bool(ref["vote_after_compute"]), "compute_ms": compute or 0.0}
    f2a_source = (f"{trace}: mean attention done_ns - the last FFN worker's sent_ns, targets the attention worker "
                  "was waiting for (f2a_read_ms folded in)")
    sources = {
        "demand_emit_ms": f"{trace}, attention side: mean demand_ns - (enter_ns | previous sent_ns)",
        "a2f_post_ms": f"{trace}, attention side: mean sent_ns - demand_ns",
        "a2f_latency_ms": f"{trace}: mean of the last FFN worker's arrived_ns (read) - the attention side's sent_ns, "
                          "microbatch 0 targets (the workers idle, waiting for them)",
        "f2a_latency_ms": f2a_source + (", minus the pool's reply send (ffn_fixed_ms)" if split_send else ""),
        "plan_decode_ms": f"{trace}, FFN workers: mean plan_ns - start_ns over targets whose plan was published before "
                          "they were taken up",
        "agreement_ms": f"{trace}, FFN workers: mean of the last worker's vote (agreed_ns minus the stamp before it)",
        "ffn_fixed_ms": f"{trace}, FFN workers: mean sent_ns minus the stamp before it (reply write)"
                        + (" + the pool's reply send: mean next target taken up - sent_ns where it had arrived "
                           "(combine, F2A write)" if split_send else ""),
        "compute_ms": f"{trace}, FFN workers, {reference} policy: mean computed_ns minus the stamp before it "
                      "(read-ahead, commit, partition, expert compute)",
        "vote_after_compute": "the FFN trace's column order (computed_ns before agreed_ns: the workers compute, then vote)",
        "schedule_ms": f"{trace}, scheduler: mean published_ns - written_ns per policy",
    }
    return stages, sources, not_measured


def _calibration_from_traces(serve: dict, steps: dict[str, dict], micro: dict, model: dict, command: str,
                             tables: dict[str, dict]) -> dict:
    from afore.ffn.worker import FFNWorkerConfig

    trace = "the calibration run's per-target traces (AFORE_STAGE_TRACE)"
    stages, sources, missing = stages_from_traces(tables, steps, trace)
    if missing:
        raise RuntimeError(f"the calibration run's traces do not measure {sorted(missing)}: {missing}")
    compute = stages.pop("compute_ms")
    sources["ffn_compute.intercept_ms"] = sources.pop("compute_ms")
    stages.update({"plan_timeout_ms": FFNWorkerConfig(rank=0, num_ffn=1, num_attention=1, model="").plan_timeout_ms,
                   "copy_latency_ms": micro["copy"]["median_ms"], "copy_link_gbps": micro["copy"]["gbps"],
                   "copy_cap_gbps": 0.0, "deadline_share": 0.5, "copies_synchronous": True})
    return _calibration_doc(serve, micro, model, command, compute, stages, sources,
                            calibration_run={p: {"runtime": r["runtime"], "stage_means_ms": stage_means(tables[p])}
                                            for p, r in serve["runs"].items()})


def compare(serve: dict, steps: dict[str, dict], costs: StageCosts, cal_doc: dict, microbatches: int) -> dict:
    """Per policy: measured and simulated step time, exchange per layer call (serial mode only:
    a ping-pong layer call stays open while the other microbatch computes), FFN-side figures."""
    compute = float(cal_doc["ffn_compute"]["intercept_ms"])
    mode = serve["settings"].get("mode", "serial")
    out = {}
    for policy, st in steps.items():
        rt = serve["runs"][policy]["runtime"]
        if st["steps"].size == 0:
            raise RuntimeError(f"{policy}: no complete decode step in the stage trace of its run")
        targets = max(rt["ffn_targets"], 1.0)
        copies_per_target = rt["copies_all_workers"] / targets / 2  # two workers; the busiest gets about half or more
        sim = simulate_steps(st, costs, compute, policy, microbatches, copies_per_target,
                             float(cal_doc["model"]["bytes_per_expert"]), mode=mode)
        serial = mode == "serial"
        meas, simd = st["step_ms"], sim["step_ms"]
        out[policy] = {
            "steps": int(meas.size),
            "measured": {"step_ms_mean": float(meas.mean()), "step_ms_p50": float(np.median(meas)),
                         "step_ms_p95": float(np.percentile(meas, 95)),
                         "attention_ms_per_step": float(st["attention_ms"].sum(1).mean()),
                         "exchange_ms_per_layer": float(st["exchange_ms"].mean()),
                         "f2a_wait_ms_per_target": float(st["f2a_wait_ms"].mean()),
                         "ffn_stage_ms": rt["ffn_stage_ms_mean"], "demand_to_plan_ms": rt["demand_to_plan_ms_mean"],
                         "plans_used": rt["plans_used"], "plans_missed": rt["plans_missed"],
                         "primary_only_targets": rt["primary_only_targets"], "ffn_targets": rt["ffn_targets"],
                         "copies": rt["copies_all_workers"], "exposed_ms_mean": rt["exposed_ms_mean"],
                         "itl_ms_p50": serve["runs"][policy]["load"]["itl_ms"]["p50"],
                         "tokens_per_microbatch": float(st["tokens"].mean())},
            "simulated": {"step_ms_mean": float(simd.mean()), "step_ms_p50": float(np.median(simd)),
                          "step_ms_p95": float(np.percentile(simd, 95)),
                          "exchange_ms_per_layer": float(sim["exchange_ms"].mean()) if serial else None,
                          "ffn_stage_ms": sim["ffn_stage_ms_mean"], "queue_ms": sim["queue_ms_mean"],
                          "plan_wait_ms": sim["plan_wait_ms_mean"], "missed_share": sim["missed_share"],
                          "exposed_ms_mean": sim["exposed_ms_mean"]},
            "step_error": float(simd.mean() / meas.mean() - 1),
            "exchange_error": float(sim["exchange_ms"].mean() / st["exchange_ms"].mean() - 1) if serial else None,
            "step_ms_measured": meas.tolist(), "step_ms_simulated": simd.tolist(),
        }
    return out


def run_cpu_runtime(args) -> int:
    """``afore bench ab --engine cpu-runtime`` (see the module docstring)."""
    from afore.bench.report import command_line, write_report
    from afore.models.tiny import build_tiny_checkpoint

    policies = tuple(p.strip() for p in str(args.policies).split(",") if p.strip()) if args.policies else POLICIES
    if "static" not in policies:
        print("afore bench ab --engine cpu-runtime: policies must include static (the calibration reference)", file=sys.stderr)
        return 2
    cal_path = Path(args.stage_calibration) if args.stage_calibration else DEFAULT_CALIBRATION
    if not args.write_calibration:
        try:
            costs, cal_doc = load_stage_calibration(cal_path)
            for p in policies:
                costs.schedule_for(p)
        except ValueError as exc:
            print(f"afore bench ab: {exc}", file=sys.stderr)
            return 2
    model = str(build_tiny_checkpoint("qwen3_moe", seed=0))
    info = _model_info(model)
    out_dir = Path(args.out_dir) if args.out_dir else Path(__file__).resolve().parents[2] / "bench" / "results"
    started, load0 = _now(), os.getloadavg()[0]
    mode = getattr(args, "mode", "serial")
    if args.write_calibration and mode != "serial":
        print("afore bench ab --engine cpu-runtime: --write-calibration measures the serial runtime (--mode serial)",
              file=sys.stderr)
        return 2
    work_dir = out_dir / "tmp" / ("ab_cpu_calibration" if args.write_calibration
                                  else "ab_cpu_runtime" + ("" if mode == "serial" else "_pingpong"))
    if args.reuse_run and (work_dir / "run.json").is_file():
        serve = json.loads((work_dir / "run.json").read_text())
        print(f"afore bench ab --engine cpu-runtime: analysing the earlier run in {work_dir} again (--reuse-run)", file=sys.stderr)
    else:
        serve = serve_policies(model, policies, args.requests, args.concurrency, args.output_len, work_dir, args.seed,
                               mode=getattr(args, "mode", "serial"))
    steps = _all_steps(serve, info["moe_layers"], 2)
    tables = {p: stage_table(serve["trace"], tuple(r["window_ns"])) for p, r in serve["runs"].items()}
    if args.write_calibration:
        print("afore bench ab --engine cpu-runtime: microbenchmarks (exchange, plan decode, vote, copy)", file=sys.stderr)
        micro = {"exchange": measure_exchange_rtt(info["hidden"], info["top_k"], 2, reps=100),
                 "plan_decode": measure_plan_decode(model, 2, 2, info["m_tile"]),
                 "agreement": measure_agreement(2), "copy": measure_copy_rate(info["bytes_per_expert"])}
        doc = build_calibration(serve, steps, micro, info, command_line(), tables)
        path = Path(args.write_calibration)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps({"stages": doc["stages"], "ffn_compute": doc["ffn_compute"]}, indent=1))
        print(f"wrote {path}")
        return 0
    rows = compare(serve, steps, costs, cal_doc, 2)
    for p, table in tables.items():
        rows[p]["measured"]["stage_means_ms"] = stage_means(table)
    # the same model with this run's own stage means: separates the model's structure from the
    # drift of the stage costs between two runs on a shared machine
    own_doc = build_calibration(serve, steps, cal_doc["microbenchmarks"], info, command_line(), tables)
    own = compare(serve, steps, stage_costs_from_dict(own_doc["stages"]), own_doc, 2)
    for p in rows:
        rows[p]["simulated_own_stages"] = own[p]["simulated"]
        rows[p]["step_error_own_stages"] = own[p]["step_error"]
        rows[p]["exchange_error_own_stages"] = own[p]["exchange_error"]
        rows[p]["step_ms_simulated_own_stages"] = own[p]["step_ms_simulated"]
        # (c) each policy's window with its own stage means: the structure alone, no drift between windows
        one = {**serve, "runs": {p: serve["runs"][p]}}
        doc_p = build_calibration(one, {p: steps[p]}, cal_doc["microbenchmarks"], info, command_line(), {p: tables[p]})
        window = compare(one, {p: steps[p]}, stage_costs_from_dict(doc_p["stages"]), doc_p, 2)[p]
        rows[p]["simulated_window_stages"] = window["simulated"]
        rows[p]["step_error_window_stages"] = window["step_error"]
    data = {"engine": "cpu-runtime", "date_utc": started, "hardware": {**_hardware(), "load_average_1min_start": load0},
            "model": info, "serve": {k: serve[k] for k in ("command", "settings")},
            "calibration": {"path": str(cal_path), "date_utc": cal_doc["meta"]["date_utc"], "command": cal_doc["meta"]["command"],
                            "stages": cal_doc["stages"], "ffn_compute": cal_doc["ffn_compute"], "sources": cal_doc["sources"]},
            "measured": "step times, exchange, F2A wait and attention compute from the attention worker's stage trace "
                        "(AFORE_STAGE_TRACE); FFN stage, plans, copies, exposed wait, demand->plan from the runtime's /metrics",
            "simulated": (f"pipeline_sim.simulate_runtime, {serve['settings'].get('mode', 'serial')} mode, the measured "
                          "attention compute of each step (pingpong: of each target, on its microbatch's thread; the "
                          "step drains at its end) as input, every other stage from the calibration file"),
            "target_step_error": 0.10, "policies": rows,
            "own_stages": {"stages": own_doc["stages"], "ffn_compute": own_doc["ffn_compute"], "sources": own_doc["sources"]},
            "runs": {p: {"load": r["load"], "runtime": r["runtime"], "load_average_1min": r.get("load_average_1min")}
                     for p, r in serve["runs"].items()}}
    name = args.name or ("ab_cpu_runtime" if mode == "serial" else "ab_cpu_runtime_pingpong")
    paths = write_report(name, data, render_markdown(data), render_figure(data), out_dir=out_dir)
    print(render_markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _f(v, digits=3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render_markdown(data: dict) -> str:
    cal, m = data["calibration"], data["model"]
    s = data["serve"]["settings"]
    lines = ["# Stage model against the CPU runtime: simulated vs measured step time per policy", "",
             f"Hardware: {data['hardware']['cpus']} CPUs ({data['hardware']['machine']}), load average (1 min) "
             f"{data['hardware']['load_average_1min_start']:.1f} at the start, {data['hardware']['load_average_1min']:.1f} at the end "
             "(other jobs share these cores). Date: " + data["date_utc"] + ".", "",
             f"Runtime (measured): `{' '.join(data['serve']['command'][2:])}`: tiny Qwen3-MoE ({m['experts']} experts, top-{m['top_k']}, "
             f"H = {m['hidden']}, {m['moe_layers']} MoE layers, float32), A = 1, F = 2, shm transport, 2 microbatches, "
             + ("the serial data plane (the attention worker posts a layer's microbatches and waits for all replies)"
                if s.get("mode", "serial") == "serial" else
                "ping-pong microbatches (a decode step of >= 2 requests runs as two microbatches, microbatch b+1's attention "
                "while the FFN pool computes b; the exchange columns are not simulated there: a layer call stays open while "
                "the other microbatch computes)")
             + f"; load: vLLM's serving "
             f"client, {s['requests']} requests of 64 random tokens -> {s['output_len']} tokens at concurrency {s['concurrency']} "
             "per policy, switched through the admin endpoint in one server.", "",
             f"Calibration (simulated side): `{cal['path']}`, written {cal['date_utc']} by `{cal['command']}` from a separate run. "
             f"Stages (ms): demand emit {cal['stages']['demand_emit_ms']:.3f}, A2F post {cal['stages']['a2f_post_ms']:.3f}, "
             f"A2F latency {cal['stages']['a2f_latency_ms']:.3f}, F2A latency {cal['stages']['f2a_latency_ms']:.3f}, "
             f"plan decode {cal['stages']['plan_decode_ms']:.4f}, reply write {cal['stages']['ffn_fixed_ms']:.3f}, "
             f"agreement {cal['stages']['agreement_ms']:.3f}, FFN compute {cal['ffn_compute']['intercept_ms']:.3f}, "
             "demand -> plan " + ", ".join(f"{p} {v:.3f}" for p, v in cal["stages"]["schedule_ms"].items()) + ".", "",
             f"Measured: {data['measured']}. Simulated: {data['simulated']}. Target: simulated mean step time within "
             f"{100 * data['target_step_error']:.0f}% of the measured one.", "",
             "Two simulated columns: (a) with the committed calibration file (a prediction: its stage costs were measured in "
             "another run); (b) with this run's own stage means, from the same traces (not a prediction: it checks the model's "
             "structure, serial layers, FFN stages one after the other, plan waits, separately from how much the stage costs "
             "drift between two runs on a shared machine); (c) with the stage means of the policy's own window (the "
             "structure alone: stage costs also drift between the policies' consecutive windows).", "",
             "| policy | steps | load avg (1 min, end of run) | step ms mean (measured) | step ms mean (simulated a: committed "
             "calibration) | error a | step ms mean (simulated b: own stage means) | error b | error c (window's own stage "
             "means) | step p50 (measured) | step p50 "
             "(simulated a / b) | exchange ms / layer (measured) | exchange ms / layer (simulated a / b) | attention ms / step "
             "(measured, input) | F2A wait ms / target (measured) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, r in data["policies"].items():
        me, si, so = r["measured"], r["simulated"], r["simulated_own_stages"]
        lines.append(f"| {p} | {r['steps']} | {_f(data['runs'][p].get('load_average_1min'), 1)} | {me['step_ms_mean']:.2f} | "
                     f"{si['step_ms_mean']:.2f} | {100 * r['step_error']:+.1f}% | {so['step_ms_mean']:.2f} | "
                     f"{100 * r['step_error_own_stages']:+.1f}% | {100 * r['step_error_window_stages']:+.1f}% | "
                     f"{me['step_ms_p50']:.2f} | {si['step_ms_p50']:.2f} / "
                     f"{so['step_ms_p50']:.2f} | {me['exchange_ms_per_layer']:.2f} | {_f(si['exchange_ms_per_layer'], 2)} / "
                     f"{_f(so['exchange_ms_per_layer'], 2)} | {me['attention_ms_per_step']:.2f} | {me['f2a_wait_ms_per_target']:.2f} |")
    lines += ["", "FFN side per policy:", "",
              "| policy | FFN stage ms (measured) | FFN stage ms (simulated) | demand -> plan ms (measured) | plan wait ms "
              "(simulated) | plans used / missed (measured) | missed share (simulated) | copies (measured, all workers) | "
              "exposed ms over targets with copies (measured) | ITL p50 ms (measured, vLLM client) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p, r in data["policies"].items():
        me, si = r["measured"], r["simulated"]
        lines.append(f"| {p} | {_f(me['ffn_stage_ms'])} | {_f(si['ffn_stage_ms'])} | {_f(me['demand_to_plan_ms'])} | "
                     f"{_f(si['plan_wait_ms'])} | {me['plans_used']:.0f} / {me['plans_missed']:.0f} | {100 * si['missed_share']:.1f}% | "
                     f"{me['copies']:.0f} | {_f(me['exposed_ms_mean'])} | {_f(me['itl_ms_p50'], 2)} |")
    if any(r["measured"].get("stage_means_ms") for r in data["policies"].values()):
        lines += ["", "Per target, FFN side (mean ms; measured: the FFN workers' and the scheduler's own traces, the latest "
                  "worker per target; simulated: the stage model):", "",
                  "| policy | A2F latency (measured) | queue (measured / simulated) | plan wait + decode (measured / simulated) | "
                  "vote (measured) | compute (measured) | reply (measured) | FFN stage (measured / simulated) | F2A latency "
                  "(measured) | demand -> plan (measured) | targets on the scheduler's plan (measured) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        cs = cal["stages"]
        for p, r in data["policies"].items():
            t, si = r["measured"].get("stage_means_ms") or {}, r["simulated"]
            if not t:
                continue
            lines.append(f"| {p} | {_f(t['a2f_latency'])} | {_f(t['queue'])} / {_f(si['queue_ms'])} | {_f(t['plan'])} / "
                         f"{_f(si['plan_wait_ms'] + cs['plan_decode_ms'])} | {_f(t['vote'])} | {_f(t['compute'])} | {_f(t['reply'])} | "
                         f"{_f(t['stage'])} / {_f(si['ffn_stage_ms'])} | {_f(t['f2a_latency'])} | {_f(t['schedule'])} | "
                         f"{100 * t['used']:.1f}% |")
    worst = max(abs(r["step_error"]) for r in data["policies"].values())
    worst_own = max(abs(r["step_error_own_stages"]) for r in data["policies"].values())
    worst_win = max(abs(r["step_error_window_stages"]) for r in data["policies"].values())
    target = data["target_step_error"]
    lines += ["", f"Largest step-time error: (a) committed calibration {100 * worst:.1f}% "
              f"({'within' if worst <= target else 'outside'} the {100 * target:.0f}% target); (b) this run's own stage means "
              f"{100 * worst_own:.1f}% ({'within' if worst_own <= target else 'outside'} it); (c) each window's own "
              f"{100 * worst_win:.1f}% ({'within' if worst_win <= target else 'outside'} it).", "",
              "Reading: the attention compute of every measured step is an input (it is vLLM's, not afore's); what the model "
              "predicts is everything after it: "
              + ("the exchange of each MoE layer call (demand, A2F, the FFN stages of both microbatches one after the other, "
                 "F2A) and with it the step. The exchange columns isolate that part. "
                 if s.get("mode", "serial") == "serial" else
                 "each microbatch's demand, A2F, FFN stage and F2A while the other microbatch computes (its compute on its own "
                 "thread is the input, target by target), the pipeline drained at the end of each step, and with it the step. "
                 "The exchange per layer call is measured only (a call stays open while the other microbatch computes). ")
              + "Exposed "
              "wait (measured) is averaged over the targets with copies that the FFN worker timed (afore_ffn_exposed_copy_wait_seconds "
              "observes planned targets); on CPU workers copies are synchronous (24.6 KB per tiny expert), so it is the copy "
              "itself, not an overlap miss. Tile loads do not separate the policies at this size (one tile per worker): the "
              "policies differ here by their scheduling cost and plan misses only."]
    return "\n".join(lines)


def render_figure(data: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(names))
    for i, (key, label) in enumerate((("measured", "measured"), ("simulated", "simulated, committed calibration"))):
        axes[0].bar(x + 0.27 * (i - 1), [data["policies"][n][key]["step_ms_mean"] for n in names], 0.27, label=label)
    axes[0].bar(x + 0.27, [data["policies"][n]["simulated_own_stages"]["step_ms_mean"] for n in names], 0.27,
                label="simulated, own stage means")
    axes[0].set_xticks(x, names)
    axes[0].set_ylabel("mean step time (ms)")
    axes[0].set_title("step time per policy: measured (runtime timestamps) vs simulated (stage model)", fontsize=9)
    axes[0].legend()
    for n in names:
        r = data["policies"][n]
        axes[1].scatter(r["step_ms_measured"], r["step_ms_simulated"], s=6, label=n, alpha=0.6)
    lim = max(max(max(r["step_ms_measured"]), max(r["step_ms_simulated"])) for r in data["policies"].values())
    axes[1].plot([0, lim], [0, lim], "k:", linewidth=1)
    axes[1].set_xlabel("measured step (ms)")
    axes[1].set_ylabel("simulated step (ms)")
    axes[1].set_title("per step (the measured attention compute is the simulator's input)", fontsize=9)
    axes[1].legend()
    fig.suptitle(f"afore bench ab --engine cpu-runtime ({data['hardware']['cpus']} CPUs); calibration {Path(data['calibration']['path']).name} "
                 f"of {data['calibration']['date_utc']}", fontsize=10)
    fig.tight_layout()
    return fig
