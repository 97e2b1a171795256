"""The per-pod metrics directory (prometheus_client's multiprocess mode).

prometheus_client picks its value storage when it is first imported: with
``PROMETHEUS_MULTIPROC_DIR`` set in the environment, every Counter, Gauge and Histogram of the
process writes into memory-mapped files in that directory (one per process and kind), and a
``MultiProcessCollector`` over the directory sums them at scrape time (gauges by their
``multiprocess_mode``). ``afore serve`` creates one directory per run and puts it into the
environment of every child (scheduler, FFN workers, vLLM), so vLLM's own ``/metrics``
(``vllm.v1.metrics.prometheus.get_prometheus_registry``: a MultiProcessCollector when the
variable is set) carries afore's families too. Counters of a process that exited stay in the
sum (totals never go back); ``live*`` gauges of a process vanish once it is marked dead.
"""

from __future__ import annotations

import os
import shutil
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"


def create_dir(parent: str | None = None) -> str:
    """A new empty directory for one run's metrics files (``parent``: default ``$TMPDIR``)."""
    return tempfile.mkdtemp(prefix="afore-metrics-", dir=parent)


def remove_dir(path: str) -> None:
    """Remove a run's directory and its files (idempotent)."""
    shutil.rmtree(path, ignore_errors=True)


def active_dir() -> str | None:
    """This process's metrics directory, or None when it records into its own registries only."""
    path = os.environ.get(ENV)
    return path if path and os.path.isdir(path) else None


def aggregate(path: str) -> bytes:
    """The Prometheus text exposition of every process's metrics in ``path``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    return generate_latest(registry)


def mark_dead(pid: int, path: str | None = None) -> None:
    """Drop the ``live*`` gauges of process ``pid`` (it exited or was killed); counters and
    histograms keep its contribution. No-op without a directory."""
    path = path or active_dir()
    if not path:
        return
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, path)
