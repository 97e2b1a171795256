"""One dtype for both halves (issue 19, item 12): under the default ``--dtype auto``, afore serve
resolves the dtype once, as vLLM would on this device, and vLLM and every FFN worker run it."""

from __future__ import annotations

import json
import os
import re

import pytest

from afore.serve.launcher import serving_dtype
from servers import AforeServer, needs_vllm

pytestmark = [needs_vllm, pytest.mark.vllm]


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().decode().split("\0")


def _dtype_arg(argv: list[str]) -> str:
    """The dtype a process was started with: ``--dtype NAME``, or the ``dtype`` of its
    ``--config-json`` (an FFN worker's typed config)."""
    if "--dtype" in argv:
        return argv[argv.index("--dtype") + 1]
    return json.loads(argv[argv.index("--config-json") + 1])["dtype"]


def test_auto_gives_vllm_and_the_ffn_workers_the_same_resolved_dtype(qwen3_model, log_dir):
    log_path = os.path.join(log_dir, "afore-qwen3-auto-dtype.log")
    server = AforeServer(qwen3_model, log_path, extra=["--dtype", "auto"])  # the last --dtype wins: auto
    try:
        status = server.status()
        want = serving_dtype("auto", {}, "cpu")  # the built-in checkpoint declares float32
        assert status["dtype"] == want == "bfloat16"
        procs = status["processes"]
        ffn = [p["pid"] for name, p in procs.items() if name.startswith("ffn-")]
        assert len(ffn) == 2
        assert [_dtype_arg(_cmdline(pid)) for pid in ffn] == [want, want]  # what each FFN worker loads
        assert _dtype_arg(_cmdline(procs["vllm"]["pid"])) == want  # what vLLM is told: no "auto" left
        code, out = server.complete("def add(a, b):", max_tokens=4)
        assert code == 200, out
        engine = re.findall(r"dtype=torch\.(\w+)", server.tail(100000))  # vLLM's engine config line
        assert engine and set(engine) == {want}
    finally:
        server.stop()
