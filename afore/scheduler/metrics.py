"""Prometheus metrics of the control plane (scheduler service, mailbox, plan ring, receiver).

Latencies are histograms recorded by the service; the segments' own counters (written by
producers and readers in shared memory) are read at scrape time by ``SegmentCollector``, so
they are exact even for processes that export nothing themselves.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from afore import _shm

# 1 us .. 100 ms: plan latencies live in microseconds, misses in milliseconds
LATENCY_BUCKETS_S = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1)


class SegmentCollector:
    """Exports the counters of the named mailbox and plan ring segments."""

    def __init__(self, mailbox: str | None, ring: str | None):
        self.mailbox, self.ring = mailbox, ring

    def describe(self):
        return []

    def collect(self):
        if self.mailbox:
            try:
                yield from _mailbox_metrics(_shm.inspect(self.mailbox))
            except ValueError:
                pass
        if self.ring:
            try:
                yield from _ring_metrics(_shm.inspect(self.ring))
            except ValueError:
                pass


def _mailbox_metrics(info: dict):
    if not info.get("compatible"):
        return
    targets = CounterMetricFamily("afore_mailbox_targets", "targets by outcome at the scheduler's mailbox", labels=["outcome"])
    for key, value in info["counters"].items():
        if key not in ("pending", "rejected_unknown_worker"):
            targets.add_metric([key], value)
    yield targets
    yield GaugeMetricFamily("afore_mailbox_pending_targets", "targets with partial demand", value=info["counters"]["pending"])
    reports = CounterMetricFamily("afore_mailbox_reports", "demand reports by worker and outcome", labels=["worker", "outcome"])
    for p in info["producers"]:
        for key in ("accepted", "rejected_invalid", "rejected_duplicate", "dropped_full"):
            reports.add_metric([str(p["worker"]), key], p[key])
    reports.add_metric(["unknown", "rejected_invalid"], info["counters"]["rejected_unknown_worker"])
    yield reports


def _ring_metrics(info: dict):
    if not info.get("compatible"):
        return
    c = info["counters"]
    yield CounterMetricFamily("afore_ring_published", "plans published into the ring", value=c["published"])
    yield CounterMetricFamily("afore_ring_evictions", "readers evicted (dead or silent beyond the liveness timeout)", value=c["evictions"])
    yield CounterMetricFamily("afore_ring_publish_timeouts", "publishes that gave up waiting for readers", value=c["publish_timeouts"])
    yield GaugeMetricFamily("afore_ring_readers_live", "FFN workers attached and alive",
                            value=sum(1 for r in info["readers"] if r["alive"]))
    lag = GaugeMetricFamily("afore_ring_reader_lag", "entries published but not yet acknowledged", labels=["reader"])
    outcomes = CounterMetricFamily("afore_ring_reader_entries", "entries by reader and outcome", labels=["reader", "outcome"])
    for r in info["readers"]:
        lag.add_metric([str(r["reader"])], r["lag"])
        for key in ("copied", "stale_skipped", "missed", "torn", "rejected", "evicted"):
            outcomes.add_metric([str(r["reader"]), key], r[key])
    yield lag
    yield outcomes


class SchedulerMetrics:
    """The scheduler service's metrics in one registry (``render()`` or ``serve(port)``)."""

    def __init__(self, mailbox: str | None = None, ring: str | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.plans = Counter("afore_scheduler_plans", "plans published", registry=r)
        self.misses = Counter("afore_scheduler_misses", "targets without a plan", ["reason"], registry=r)
        self.publish_latency = Histogram("afore_scheduler_publish_latency_seconds",
                                         "demand complete -> plan published", buckets=LATENCY_BUCKETS_S, registry=r)
        self.copy_latency = Histogram("afore_scheduler_copy_latency_seconds",
                                      "plan published -> copied by all live readers", buckets=LATENCY_BUCKETS_S, registry=r)
        self.policy_latency = Histogram("afore_scheduler_policy_latency_seconds",
                                        "time in the placement policy per target", buckets=LATENCY_BUCKETS_S, registry=r)
        self.receiver_messages = Counter("afore_receiver_messages", "demand receiver messages by outcome", ["outcome"], registry=r)
        if mailbox or ring:
            r.register(SegmentCollector(mailbox, ring))
        self._server = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics over HTTP on ``port`` (0 = any free port); returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_port

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()
