"""vLLM's OpenAI API server as ``afore serve`` runs it (``python -m afore.serve.vllm_server ARGS``).

The same server as ``python -m vllm.entrypoints.openai.api_server ARGS``, with two changes to how
it stops, so that a clean shutdown prints nothing alarming:

- ``--shutdown-timeout 10`` unless ARGS set one (and the installed vLLM has the option): on
  SIGTERM vLLM then drains and stops its engine process instead of force-killing it at once,
  so the engine unlinks its own shared memory and semaphores and Python's resource_tracker has
  nothing to clean up (and nothing to warn about: "leaked shared_memory objects");
- after the server returned, the process ends with ``os._exit`` once its output is flushed:
  everything the server owns is closed by then, and interpreter finalization would only report
  the nanobind objects that triton (imported by vLLM) keeps in module caches ("nanobind: leaked
  N instances ... reference counting issue"), which are not a leak of this process's lifetime.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

SHUTDOWN_TIMEOUT_S = 10


def with_shutdown_timeout(argv: list[str], supported: bool) -> list[str]:
    """``argv`` plus ``--shutdown-timeout`` when vLLM supports it and ``argv`` has none."""
    if not supported or any(a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in argv):
        return list(argv)
    return [*argv, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]


def _vllm_has_shutdown_timeout() -> bool:
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        return any(f.name == "shutdown_timeout" for f in dataclasses.fields(EngineArgs))
    except Exception:  # noqa: BLE001  (another vLLM layout: leave its defaults alone)
        return False


def main() -> None:
    sys.argv = [sys.argv[0], *with_shutdown_timeout(sys.argv[1:], _vllm_has_shutdown_timeout())]
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
