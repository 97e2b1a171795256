"""Prometheus metrics of one FFN worker (text exposition format).

Counters: targets, plan misses (no plan by the deadline), plans rejected by validation,
fallbacks (targets run on the primary-only plan, including those where another worker had
no plan: all workers must apply the same plan), copies and copied bytes. Histograms (ms):
lookahead window (copy submission -> commit of the same target), exposed copy wait, raw
copy time, and the FFN stage time per target. Gauge: targets queued at the transport.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from afore.migrator.migrator import MigrationRecord

_MS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 100.0, float("inf"))


class FFNMetrics:
    """All metrics of one worker, in their own registry (label ``worker``)."""

    def __init__(self, worker: int) -> None:
        self.registry = CollectorRegistry()
        lab = {"labelnames": ("worker",), "registry": self.registry}
        w = str(worker)
        self.worker = w
        self.targets = Counter("afore_ffn_targets", "targets executed", **lab).labels(w)
        self.plan_misses = Counter("afore_ffn_plan_misses", "targets with no valid plan by the deadline", **lab).labels(w)
        self.plans_rejected = Counter("afore_ffn_plans_rejected", "plans rejected by validation (stale, out of order, inconsistent)", **lab).labels(w)
        self.fallbacks = Counter("afore_ffn_primary_only", "targets run on the primary-only plan", **lab).labels(w)
        self.copies = Counter("afore_ffn_copies", "expert copies into this worker", **lab).labels(w)
        self.copy_bytes = Counter("afore_ffn_copy_bytes", "bytes copied into this worker", **lab).labels(w)
        self.window_ms = Histogram("afore_ffn_lookahead_window_ms", "copy submission to commit of the same target (ms)", buckets=_MS_BUCKETS, **lab).labels(w)
        self.exposed_ms = Histogram("afore_ffn_exposed_copy_wait_ms", "copy time on the critical path (ms)", buckets=_MS_BUCKETS, **lab).labels(w)
        self.raw_copy_ms = Histogram("afore_ffn_raw_copy_ms", "copy time of a target's copies (ms)", buckets=_MS_BUCKETS, **lab).labels(w)
        self.stage_ms = Histogram("afore_ffn_stage_ms", "receive-to-reply time of a target on this worker (ms)", buckets=_MS_BUCKETS, **lab).labels(w)
        self.queued = Gauge("afore_ffn_queued_targets", "targets received and waiting (lookahead depth)", **lab).labels(w)

    def observe(self, record: MigrationRecord) -> None:
        self.window_ms.observe(record.window_ms)
        self.exposed_ms.observe(record.exposed_ms)
        if record.copies:
            self.raw_copy_ms.observe(record.raw_copy_ms)
            self.copies.inc(record.copies)
            self.copy_bytes.inc(record.bytes)

    def summary(self) -> str:
        """One log line: targets, plans run, primary-only (misses, rejected), copies."""
        def value(name: str) -> int:
            return int(self.registry.get_sample_value(name, {"worker": self.worker}) or 0)

        targets, fallbacks = value("afore_ffn_targets_total"), value("afore_ffn_primary_only_total")
        return (f"targets {targets}, plans run {targets - fallbacks}, primary-only {fallbacks} "
                f"(no plan {value('afore_ffn_plan_misses_total')}, rejected {value('afore_ffn_plans_rejected_total')}), "
                f"copies {value('afore_ffn_copies_total')}")

    def render(self) -> str:
        """The Prometheus text exposition of this worker's metrics."""
        return generate_latest(self.registry).decode()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Expose ``/metrics`` over HTTP on ``port`` (a background thread)."""
        start_http_server(port, addr=addr, registry=self.registry)
