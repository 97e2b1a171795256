"""afore.serve.vllm_server: vLLM's API server, without the reports plain vLLM prints at a stop."""

from __future__ import annotations

import os
import subprocess
import sys

from servers import needs_vllm


@needs_vllm
def test_it_is_vllms_server_and_exits_with_its_code():
    ok = subprocess.run([sys.executable, "-m", "afore.serve.vllm_server", "--help"], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0 and "--max-model-len" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "afore.serve.vllm_server", "--no-such-option"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--no-such-option" in bad.stderr


LEAK = """
import os, sys
from multiprocessing import shared_memory
if sys.argv[1] == "quiet":
    from afore.serve.vllm_server import quiet_leak_report
    quiet_leak_report()
segment = shared_memory.SharedMemory(create=True, size=64)  # starts the tracker, registers the segment
print(segment.name, flush=True)
os._exit(0)  # never unregistered, as a SIGKILLed vLLM engine
"""


def test_the_trackers_leak_report_is_dropped_and_its_cleanup_kept():
    for mode, reported in (("plain", True), ("quiet", False)):
        out = subprocess.run([sys.executable, "-c", LEAK, mode], capture_output=True, text=True, timeout=120)
        name = out.stdout.split()[0]
        assert ("leaked shared_memory" in out.stderr) is reported, (mode, out.stderr)
        assert not os.path.exists(f"/dev/shm/{name}")  # removed by the tracker either way


@needs_vllm
def test_vllms_output_handler_traceback_is_dropped_only_once_a_stop_was_asked_for():
    import logging

    from afore.attention.vllm_compat import quiet_shutdown_race
    from vllm.v1.engine import async_llm
    from vllm.v1.engine.exceptions import EngineDeadError

    quiet_shutdown_race()
    quiet_shutdown_race()  # once only
    logger = logging.getLogger(async_llm.__name__)

    def record(message: str, error: Exception) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.ERROR, __file__, 1, message, (), (type(error), error, None))

    dead = record("AsyncLLM output_handler failed.", EngineDeadError())
    assert logger.filter(dead)  # the engine died on its own: logged
    async_llm.AsyncLLM.shutdown(object.__new__(async_llm.AsyncLLM))  # the API server's stop
    assert not logger.filter(dead)
    assert logger.filter(record("AsyncLLM output_handler failed.", ValueError("a bug")))
    assert sum(f.__qualname__.startswith("quiet_shutdown_race") for f in logger.filters) == 1
