"""Per-target timestamp traces as CSV files (``AFORE_STAGE_TRACE=PATH``).

Every process of the data plane that records stages appends rows to ``PATH.<who>.csv``: the
attention workers (``afore.attention.stages``, ``<who>`` = the worker index) and the FFN workers
(``afore.ffn.stages``, ``<who>`` = ``ffn<rank>``). Times are ``time.perf_counter_ns()``, which is
CLOCK_MONOTONIC on Linux and so comparable across the processes of one node: a row of the
attention trace and the FFN workers' rows of the same ``seq`` line up on one time axis.
"""

from __future__ import annotations

import atexit
import os
import threading

TRACE_ENV = "AFORE_STAGE_TRACE"


class CsvTrace:
    """Rows of integers buffered ``flush_every`` at a time; a no-op when ``path`` is empty."""

    def __init__(self, path: str, columns: tuple[str, ...], flush_every: int = 256) -> None:
        self.path = path
        self.columns = columns
        self.flush_every = flush_every
        self._rows: list[tuple] = []
        self._lock = threading.Lock()
        if self.path and not os.path.exists(self.path):
            with open(self.path, "w") as fh:
                fh.write(",".join(columns) + "\n")
        if self.path:  # the rows still buffered at a normal exit (an FFN worker flushes in close())
            atexit.register(self.flush)

    @classmethod
    def from_env(cls, who: str, columns: tuple[str, ...], path: str | None = None) -> "CsvTrace":
        base = os.environ.get(TRACE_ENV, "") if path is None else path
        return cls(f"{base}.{who}.csv" if base else "", columns)

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def add(self, row: tuple) -> None:
        if not self.path:
            return
        with self._lock:
            self._rows.append(row)
            if len(self._rows) >= self.flush_every:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self.path or not self._rows:
            return
        with open(self.path, "a") as fh:
            fh.write("".join(",".join(str(int(v)) for v in r) + "\n" for r in self._rows))
        self._rows.clear()


def read_trace(path) -> list[dict[str, int]]:
    """The rows of one trace file as dicts of ints."""
    import csv

    with open(path) as fh:
        return [{k: int(v) for k, v in row.items()} for row in csv.DictReader(fh)]
