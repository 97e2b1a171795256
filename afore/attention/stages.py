"""Per-target timestamps of the attention side of the data plane, and its exported figures.

For every MoE layer call the proxy records, per microbatch target: when the layer call began
(the attention compute before it ended), when its demand was emitted, when its tokens were
posted (A2F), and when its combined output was back (F2A wait). ``observe_exchange`` feeds the
Prometheus families (afore.metrics.attention); with ``AFORE_STAGE_TRACE=PATH`` every record
is also appended to a CSV file (``afore bench dataplane`` reads it for the per-layer breakdown).

CSV columns (times: ``time.perf_counter_ns()`` of this process):
    step, layer, microbatch, tokens, prev_exit_ns, enter_ns, demand_ns, sent_ns, recv_start_ns,
    done_ns, a2f_bytes, f2a_bytes
"""

from __future__ import annotations

import os
import threading

TRACE_ENV = "AFORE_STAGE_TRACE"
COLUMNS = ("step", "layer", "microbatch", "tokens", "prev_exit_ns", "enter_ns", "demand_ns", "sent_ns",
           "recv_start_ns", "done_ns", "a2f_bytes", "f2a_bytes")


class StageClock:
    """Records of one attention worker; ``flush_every`` rows are buffered before a write."""

    def __init__(self, worker: int, path: str | None = None, flush_every: int = 256) -> None:
        self.worker = worker
        path = os.environ.get(TRACE_ENV, "") if path is None else path
        self.path = f"{path}.{worker}.csv" if path else ""
        self.flush_every = flush_every
        self.prev_exit_ns = 0
        self._rows: list[tuple] = []
        self._lock = threading.Lock()
        if self.path and not os.path.exists(self.path):
            with open(self.path, "w") as fh:
                fh.write(",".join(COLUMNS) + "\n")

    def record(self, row: tuple) -> None:
        from afore.metrics.attention import observe_exchange

        observe_exchange(worker=self.worker, wait_s=max(0, row[9] - row[8]) / 1e9, a2f_bytes=row[10], f2a_bytes=row[11])
        if self.path:
            with self._lock:
                self._rows.append(row)
                if len(self._rows) >= self.flush_every:
                    self.flush()

    def flush(self) -> None:
        if not self.path or not self._rows:
            return
        with open(self.path, "a") as fh:
            fh.write("".join(",".join(str(int(v)) for v in r) + "\n" for r in self._rows))
        self._rows.clear()
