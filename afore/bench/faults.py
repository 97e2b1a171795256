"""`afore bench faults`: serving while the scheduler dies, hangs or stays dead (issue 19, item 1).

Launches ``afore serve`` (or measures a running one, ``--url``) and sends the same load through
vLLM's own serving benchmark (``afore.bench.serve.run_load``: streamed, fixed concurrency, TTFT,
TPOT, ITL as vLLM computes them) in phases:

  static        --policy static (no plans are used: the baseline the target is judged against)
  afore         --policy afore, scheduler alive
  killed        afore; the scheduler is SIGKILLed when the load starts; the launcher restarts it
  hung          afore; the scheduler is SIGSTOPped for the whole phase (FFN workers see its
                heartbeat go stale), SIGCONTed after
  dead          afore; the scheduler is SIGKILLed again at every restart until the launcher
                leaves it down (its restart budget), so it is dead for the whole phase
  static-again  --policy static once more (the switch starts a scheduler again), so the
                baseline brackets the fault phases on a machine whose load drifts; the
                target is judged against the mean of the two static medians

While a phase runs, a thread polls the admin ``GET /health`` and ``/afore/status`` every 50 ms:
the report has the scheduler's outage (SIGKILL -> status ``running`` again, s) and what
``/health`` answered meanwhile (503 ``degraded`` while down is the truth; 200 is not).

Targets (judged in the report): median ITL of ``killed``, ``hung`` and ``dead`` within 10% of
``static``'s; the scheduler back within 5 s of its SIGKILL; ``/health`` never 200 while it is down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PHASES = ("static", "afore", "killed", "hung", "dead", "static-again")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="", help="a running afore serve (default: launch one on a free port)")
    parser.add_argument("--serve-args", default="--colocate --dtype float32 --enforce-eager --max-model-len 1024",
                        help="extra afore serve arguments when launching (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32, help="output tokens per request (EOS ignored)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--out-name", default="faults", help="report name under bench/results/")
    parser.add_argument("--out-dir", default=None, help="report directory (default bench/results/)")


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except json.JSONDecodeError:
            return exc.code, {}
    except (urllib.error.URLError, OSError):
        return 0, {}


class HealthWatch:
    """Polls /health and /afore/status every ``period_s`` on a thread: (t, health code, health
    status, scheduler state, scheduler pid) samples."""

    def __init__(self, admin: str, period_s: float = 0.05):
        self.admin, self.period_s = admin, period_s
        self.samples: list[tuple[float, int, str, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            code, health = _get(self.admin + "/health")
            _, status = _get(self.admin + "/afore/status")
            sched = (status.get("processes") or {}).get("scheduler") or {}
            state = (status.get("scheduler") or {}).get("state", "?")
            if sched and not sched.get("alive"):
                state = "dead"
            self.samples.append((t, code, health.get("status", "?"), state, int(sched.get("pid", 0))))
            self._stop.wait(self.period_s)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def scheduler_pid(admin: str) -> int:
    code, status = _get(admin + "/afore/status")
    proc = (status.get("processes") or {}).get("scheduler")
    if code != 200 or not proc or not proc.get("alive"):
        return 0
    return int(proc["pid"])


def wait_scheduler(admin: str, timeout_s: float = 30.0, other_than: int = 0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, status = _get(admin + "/afore/status")
        pid = scheduler_pid(admin)
        if pid and pid != other_than and (status.get("scheduler") or {}).get("state") == "running":
            return pid
        time.sleep(0.05)
    raise RuntimeError(f"scheduler not running after {timeout_s} s")


def outage(samples, killed_at: float) -> dict:
    """From the watch samples after a SIGKILL at ``killed_at``: seconds until the scheduler is
    running again (a new pid), and what /health answered while it was not."""
    after = [s for s in samples if s[0] >= killed_at]
    first_pid = next((s[4] for s in samples if s[0] < killed_at and s[4]), 0)
    back = next((s for s in after if s[3] == "running" and s[4] and s[4] != first_pid), None)
    down = [s for s in after if back is None or s[0] < back[0]]
    return {"back_after_s": None if back is None else back[0] - killed_at,
            "health_while_down": sorted({f"{s[1]} {s[2]}" for s in down}),
            "health_200_while_down": sum(1 for s in down if s[1] == 200 and s[3] != "running"),
            "samples_while_down": len(down)}


def run(args: argparse.Namespace) -> int:
    from afore.bench import serve as bench_serve
    from afore.bench.report import markdown_table, write_report
    from afore.ports import free_port_run

    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        print(f"afore bench faults: phases: expected a subset of {','.join(PHASES)}, got {','.join(unknown)}", file=sys.stderr)
        return 2
    process = None
    log_path = Path(tempfile.mkdtemp(prefix="afore-bench-faults-")) / "serve.log"
    if args.url:
        url = args.url.rstrip("/")
    else:
        port = free_port_run(2)
        url = f"http://127.0.0.1:{port}"
        process = bench_serve.launch_server(url, "static", args.serve_args.split(), log_path)
        print(f"afore bench faults: launched afore serve on {url} (log {log_path})", file=sys.stderr)
    admin = bench_serve.admin_url_for(url)
    results: dict[str, dict] = {}
    try:
        bench_serve.wait_ready(url, 900, process)
        model = bench_serve.served_model(url)
        tokenizer = bench_serve.resolve_tokenizer(None, model)
        prompts = bench_serve.load_prompts("gsm8k", args.num_prompts, 256, args.output_len)

        def load(desc: str) -> dict:
            return asyncio.run(bench_serve.run_load(url, model, prompts, args.concurrency, True, 2, desc, tokenizer))

        for phase in phases:
            bench_serve.set_policy(admin, "static" if phase.startswith("static") else "afore")
            pid = wait_scheduler(admin)
            with HealthWatch(admin) as watch:
                t0 = time.monotonic()
                extra: dict = {}
                if phase == "killed":
                    os.kill(pid, signal.SIGKILL)
                    extra["killed_at_s"] = time.monotonic() - t0
                    killed_at = time.monotonic()
                    run_result = load(phase)
                    time.sleep(0.5)
                    extra.update(outage(watch.samples, killed_at))
                elif phase == "hung":
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        run_result = load(phase)
                    finally:
                        os.kill(pid, signal.SIGCONT)
                elif phase == "dead":
                    kills = 0
                    while True:  # kill it at every restart until the launcher gives up on it
                        pid = scheduler_pid(admin)
                        if pid:
                            os.kill(pid, signal.SIGKILL)
                            kills += 1
                        code, status = _get(admin + "/afore/status")
                        if (status.get("scheduler") or {}).get("state") == "failed":
                            break
                        if kills > 20:
                            raise RuntimeError("the launcher kept restarting the scheduler after 20 kills")
                        time.sleep(0.05)
                    extra["kills"] = kills
                    run_result = load(phase)
                else:
                    run_result = load(phase)
            codes = sorted({f"{s[1]} {s[2]}" for s in watch.samples})
            results[phase] = {**run_result, **extra, "health_seen": codes}
            print(f"afore bench faults: {phase}: ITL p50 {run_result['itl_ms']['p50']:.2f} ms, "
                  f"{run_result['completed']}/{run_result['requests']} completed, /health {codes}", file=sys.stderr)
    finally:
        if process is not None:
            bench_serve.stop_server(process)

    statics = [results[p]["itl_ms"]["p50"] for p in ("static", "static-again") if p in results and results[p]["itl_ms"]["p50"]]
    base = sum(statics) / len(statics) if statics else None
    rows, verdicts = [], []
    for phase, r in results.items():
        itl = r["itl_ms"]["p50"]
        ratio = itl / base if base and itl else None
        rows.append([phase, f"{r['completed']}/{r['requests']}", r["itl_ms"]["p50"], r["itl_ms"]["p99"], r["tpot_ms"]["p50"],
                     r["ttft_ms"]["p50"], "-" if ratio is None else f"{ratio:.3f}", ", ".join(r["health_seen"])])
        if phase in ("killed", "hung", "dead") and ratio is not None:
            verdicts.append(f"- {phase}: median ITL {ratio:.3f} x static's (mean of the static phases' medians): "
                            f"{'met' if ratio <= 1.10 else 'NOT met'} (<= 1.10)")
    if "killed" in results:
        k = results["killed"]
        back = k.get("back_after_s")
        verdicts.append(f"- scheduler back after SIGKILL: {'never' if back is None else f'{back:.2f} s'}: "
                        f"{'met' if back is not None and back <= 5.0 else 'NOT met'} (<= 5 s)")
        verdicts.append(f"- /health while it was down: {', '.join(k['health_while_down']) or 'no sample'}; "
                        f"200 answers while down: {k['health_200_while_down']} "
                        f"({'met' if k['health_200_while_down'] == 0 else 'NOT met'})")
    markdown = ("# Serving through scheduler faults\n\n"
                f"afore serve ({args.serve_args}) on this host's CPU, the built-in tiny Qwen3-MoE unless --url; "
                f"load: vLLM's serving benchmark, {args.num_prompts} GSM8K prompts per phase, concurrency "
                f"{args.concurrency}, {args.output_len} output tokens (EOS ignored). Measured, not simulated. "
                "Phases: see `afore/bench/faults.py`.\n\n"
                + markdown_table(["phase", "completed", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms", "TTFT p50 ms",
                                  "ITL p50 / static (mean)", "/health seen"], rows)
                + "\n\n## Targets\n\n" + "\n".join(verdicts) + "\n")
    figure = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, ax = plt.subplots(figsize=(6, 3))
        names = list(results)
        ax.bar(names, [results[n]["itl_ms"]["p50"] for n in names], color="tab:blue")
        if base:
            ax.axhline(base * 1.10, color="tab:red", linestyle="--", label="static + 10%")
            ax.legend()
        ax.set_ylabel("median ITL (ms)")
        ax.set_title("ITL per phase (afore serve, CPU)")
    except ImportError:
        pass
    paths = write_report(args.out_name, {"serve_args": args.serve_args, "num_prompts": args.num_prompts,
                                         "concurrency": args.concurrency, "output_len": args.output_len,
                                         "phases": results}, markdown, figure, args.out_dir)
    print(f"afore bench faults: wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
