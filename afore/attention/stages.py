"""Per-target timestamps of the attention side of the data plane, and its exported figures.

For every MoE layer call the proxy records, per microbatch target: when the layer call began
(the attention compute before it ended), when its demand was emitted, when its tokens were
posted (A2F), and when its combined output was back (F2A wait). ``observe_exchange`` feeds the
Prometheus families (afore.metrics.attention); with ``AFORE_STAGE_TRACE=PATH`` every record
is also appended to a CSV file (``afore bench dataplane`` reads it for the per-layer breakdown).

CSV columns (times: ``time.perf_counter_ns()`` of this process):
    step, layer, microbatch, tokens, prev_exit_ns, enter_ns, demand_ns, sent_ns, recv_start_ns,
    done_ns, a2f_bytes, f2a_bytes, seq (the target's sequence number, as the FFN and scheduler
    traces have it: the join key)
"""

from __future__ import annotations

from afore.metrics.trace import TRACE_ENV, CsvTrace

__all__ = ["COLUMNS", "RUNNER_COLUMNS", "TRACE_ENV", "StageClock", "RunnerClock"]

COLUMNS = ("step", "layer", "microbatch", "tokens", "prev_exit_ns", "enter_ns", "demand_ns", "sent_ns",
           "recv_start_ns", "done_ns", "a2f_bytes", "f2a_bytes", "seq")


#: ``PATH.runner<pid>.csv``: one row per call of a vLLM model-runner phase
#: (``vllm_compat.RUNNER_PHASES[phase]``) in that process
RUNNER_COLUMNS = ("phase", "start_ns", "end_ns")


class RunnerClock:
    """The phases of vLLM's own step (inputs, forward, sampling) in the process that runs the
    model, so that a step's time splits into vLLM's part and the MoE exchanges inside its
    forward. Installed by the plugin in every vLLM process when ``AFORE_STAGE_TRACE`` is set,
    afore's attention role or not (plain vLLM with afore installed is traced the same way)."""

    def __init__(self, path: str | None = None, flush_every: int = 256) -> None:
        import os

        self.trace = CsvTrace.from_env(f"runner{os.getpid()}", RUNNER_COLUMNS, path)
        self.trace.flush_every = flush_every

    def record(self, phase: int, start_ns: int, end_ns: int) -> None:
        self.trace.add((phase, start_ns, end_ns))


class StageClock:
    """Records of one attention worker (``afore.metrics.trace.CsvTrace``, ``PATH.<worker>.csv``)."""

    def __init__(self, worker: int, path: str | None = None, flush_every: int = 256) -> None:
        self.worker = worker
        self.trace = CsvTrace.from_env(str(worker), COLUMNS, path)
        self.trace.flush_every = flush_every
        self.path = self.trace.path
        self.prev_exit_ns = 0

    def record(self, row: tuple) -> None:
        from afore.metrics.attention import observe_exchange

        observe_exchange(worker=self.worker, wait_s=max(0, row[9] - row[8]) / 1e9, a2f_bytes=row[10], f2a_bytes=row[11],
                         overlap_s=max(0, row[8] - row[7]) / 1e9)
        self.trace.add(row)

    def flush(self) -> None:
        self.trace.flush()
