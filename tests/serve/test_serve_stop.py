"""A clean stop of ``afore serve`` prints nothing alarming and leaves nothing behind (issue 19).

Two stops of the tiny Qwen3-MoE server (the built-in checkpoint of ``make serve``), each after
a request went through the A2F/F2A path:

- the default transport (shm on one CPU node) stopped by Ctrl-C: SIGINT to ``afore serve``'s
  process group, as a terminal sends it to ``make serve`` (the children have sessions of their
  own, so it reaches the launcher alone);
- ``--transport torch-gloo`` stopped by SIGTERM to ``afore serve`` alone, as an orchestrator
  does: vLLM goes first, so the FFN workers' gloo pairs see their peer close.

What the processes print from the stop on has no resource-tracker "leaked" report, no
traceback, no nanobind "reference counting" report and no error line (the FFN workers' closed
gloo connection included); ``afore serve`` exits 0; and every shared-memory object that any
process of the tree had mapped (afore's segments, vLLM's queues and semaphores) is gone.
"""

from __future__ import annotations

import os
import signal

import pytest

from servers import PROMPTS, AforeServer, descendants, needs_vllm

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]

ALARMS = ("leaked", "Traceback", "reference counting", "Connection closed by peer", " ERROR ")


def _shm_mapped(pids: list[int]) -> set[str]:
    """The /dev/shm paths mapped by any of ``pids`` now (segments and POSIX semaphores)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                out |= {line.split(None, 5)[5].strip().removesuffix(" (deleted)") for line in fh if " /dev/shm/" in line}
        except OSError:
            continue
    return out


@pytest.mark.parametrize(("transport", "stop"), [("auto", "ctrl-c"), ("torch-gloo", "sigterm")])
def test_a_clean_stop_prints_nothing_alarming(qwen3_model, log_dir, transport, stop):
    server = AforeServer(qwen3_model, os.path.join(log_dir, f"afore-stop-{transport}.log"),
                         extra=["--transport", transport])
    try:
        code, out = server.complete(PROMPTS[0], max_tokens=4)
        assert code == 200, out
        mapped = _shm_mapped([server.proc.pid, *descendants(server.proc.pid)])
        assert mapped, "no process of the tree maps shared memory (the check below would be empty)"
        server.log.flush()
        start = os.path.getsize(server.log_path)
        if stop == "ctrl-c":
            os.killpg(server.proc.pid, signal.SIGINT)
        else:
            server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(120)
    finally:
        server.stop()
    with open(server.log_path, errors="replace") as fh:
        fh.seek(start)
        output = fh.read()
    assert "worker 0 stopped" in output, output  # the FFN workers' last lines are in what was read
    alarming = [line for line in output.splitlines() if any(a in line for a in ALARMS)]
    assert not alarming, "\n".join(alarming)
    assert server.proc.returncode == 0, output[-3000:]
    assert not [p for p in mapped if os.path.exists(p)], "shared memory left behind"
