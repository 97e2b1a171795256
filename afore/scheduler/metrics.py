"""Prometheus metrics of the control plane (scheduler service, mailbox, plan ring, receiver).

Families (docs/metrics.md has each one's meaning and healthy value; label ``policy``: the
placement policy this scheduler process runs, one process per policy, so a policy switch starts
new series and the old ones keep their totals):

  afore_scheduler_policy{policy}                   gauge 1 while that policy plans (join it to
                                                   the FFN families, which do not know the policy)
  afore_scheduler_plans_total{policy}              plans published
  afore_scheduler_plan_misses_total{policy,reason} targets without a plan (deadline, policy_error, ...)
  afore_scheduler_demand_to_plan_seconds{policy}   demand complete -> plan published
  afore_scheduler_policy_seconds{policy}           time in the placement policy per target
  afore_scheduler_plan_read_seconds{policy}        plan published -> copied by every live FFN worker
  afore_scheduler_tile_imbalance{policy,layer,placement}         max/mean tile load of each plan
  afore_scheduler_tile_imbalance_window{policy,layer,placement}  the same over the layer's last plans
  afore_receiver_messages_total{outcome}           demand receiver messages (role ffn)
  afore_mailbox_targets_total{outcome}, afore_mailbox_pending_targets,
  afore_mailbox_reports_total{worker,outcome}      the demand mailbox (worker: attention worker)
  afore_ring_reader_entries_total{policy,worker,outcome}, afore_ring_reader_lag{worker},
  afore_ring_readers_live, afore_ring_reader_evictions_total, afore_ring_publish_timeouts_total
                                                   the plan ring (worker: FFN worker = reader)

The segments' counters live in shared memory (written by producers and readers, exact even for
processes that export nothing); ``sync_segments`` copies them into the families above, as
increments, at most every ``SYNC_INTERVAL_S`` (the service calls it once per loop iteration)
and at ``render``/``shutdown``. That keeps every family an ordinary prometheus_client metric,
which is what the pod's multiprocess aggregation (afore.metrics.multiprocess) can carry.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from afore import _shm
from afore.metrics import multiprocess
from afore.metrics.balance import BALANCE_WINDOW, IMBALANCE_BUCKETS, ImbalanceWindow, load_stats, primary_only_tile_load

# 1 us .. 100 ms: plan latencies live in microseconds, misses in milliseconds
LATENCY_BUCKETS_S = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1)
SYNC_INTERVAL_S = 0.5
READER_OUTCOMES = ("copied", "stale_skipped", "missed", "torn", "rejected", "evicted", "writer_dead")
# the mailbox's (afore.prefetch.mailbox.MissedTarget.reason) and the service's own
MISS_REASONS = ("incomplete", "deadline", "overflow", "policy_error", "publish_timeout")
REPORT_OUTCOMES = ("accepted", "rejected_invalid", "rejected_duplicate", "dropped_full")


class _Bound:
    """A labelled family with its leading labels fixed: ``.labels(rest...)``."""

    def __init__(self, family, *fixed: str) -> None:
        self._family, self._fixed = family, fixed

    def labels(self, *rest: str):
        return self._family.labels(*self._fixed, *rest)


class _SyncOnScrape:
    """First collector of the registry: a scrape of this process's registry copies the
    segments' counters first, so it reads them exact."""

    def __init__(self, metrics: "SchedulerMetrics") -> None:
        self._metrics = metrics

    def describe(self):
        return []

    def collect(self):
        self._metrics.sync_segments(0.0)
        return []


class SchedulerMetrics:
    """The scheduler service's metrics in one registry (``render()`` or ``serve(port)``)."""

    def __init__(self, mailbox: str | None = None, ring: str | None = None, policy: str = "", shape=None):
        """``mailbox``/``ring``: segment names to export; ``policy``: the label of this process's
        families; ``shape``: the ClusterShape (needed by ``observe_plan`` for the primary-only
        comparison)."""
        self.registry = r = CollectorRegistry()
        self.mailbox, self.ring, self.policy, self.shape = mailbox, ring, policy, shape
        self._seen: dict[tuple, float] = {}
        self._lock = threading.Lock()
        self._last_sync = 0.0
        r.register(_SyncOnScrape(self))
        p = (policy,)

        def counter(name, doc, *labels):
            return Counter(name, doc, labels, registry=r)

        def histogram(name, doc, buckets, *labels):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.policy_gauge = Gauge("afore_scheduler_policy", "1 for the placement policy this scheduler runs",
                                  ("policy",), registry=r, multiprocess_mode="livemax").labels(*p)
        self.policy_gauge.set(1)
        self.plans = counter("afore_scheduler_plans", "plans published", "policy").labels(*p)
        self.resyncs = counter("afore_scheduler_slot_resyncs", "projected slot tables replaced by an FFN worker's "
                               "reported ones (after a target ran without the scheduler's plan)", "policy").labels(*p)
        self.misses = _Bound(counter("afore_scheduler_plan_misses", "targets without a plan, by reason",
                                     "policy", "reason"), *p)
        for reason in MISS_REASONS:  # exported from 0, so a rate exists before the first miss
            self.misses.labels(reason)
        self.publish_latency = histogram("afore_scheduler_demand_to_plan_seconds", "demand complete -> plan published",
                                         LATENCY_BUCKETS_S, "policy").labels(*p)
        self.copy_latency = histogram("afore_scheduler_plan_read_seconds",
                                      "plan published -> copied by every live FFN worker", LATENCY_BUCKETS_S,
                                      "policy").labels(*p)
        self.policy_latency = histogram("afore_scheduler_policy_seconds", "time in the placement policy per target",
                                        LATENCY_BUCKETS_S, "policy").labels(*p)
        self._imbalance = _Bound(histogram("afore_scheduler_tile_imbalance", "max/mean tile load over the FFN workers "
                                           "of each published plan (1 = balanced)", IMBALANCE_BUCKETS,
                                           "policy", "layer", "placement"), *p)
        self._imbalance_window = _Bound(Gauge("afore_scheduler_tile_imbalance_window", "max/mean tile load over the "
                                              f"layer's last {BALANCE_WINDOW} published plans",
                                              ("policy", "layer", "placement"), registry=r,
                                              multiprocess_mode="livemostrecent"), *p)
        self._window = ImbalanceWindow(BALANCE_WINDOW)
        self._balance_children: dict[tuple[str, str], tuple] = {}
        self.receiver_messages = counter("afore_receiver_messages", "demand receiver messages by outcome", "outcome")
        # segment counters, exported as increments of what sync_segments last saw
        self._mailbox_targets = counter("afore_mailbox_targets", "targets by outcome at the scheduler's mailbox", "outcome")
        self._mailbox_pending = Gauge("afore_mailbox_pending_targets", "targets with partial demand", registry=r,
                                      multiprocess_mode="livesum")
        self._mailbox_reports = counter("afore_mailbox_reports", "demand reports by attention worker and outcome",
                                        "worker", "outcome")
        self._ring_entries = counter("afore_ring_reader_entries", "plan ring entries by FFN worker (reader) and outcome",
                                     "policy", "worker", "outcome")
        self._ring_lag = Gauge("afore_ring_reader_lag", "plans published but not yet acknowledged by the FFN worker",
                               ("worker",), registry=r, multiprocess_mode="livemax")
        self._ring_live = Gauge("afore_ring_readers_live", "FFN workers attached to the plan ring and alive",
                                registry=r, multiprocess_mode="livemax")
        self._ring_evictions = counter("afore_ring_reader_evictions", "readers evicted (dead or silent beyond the "
                                                                      "liveness timeout)")
        self._ring_timeouts = counter("afore_ring_publish_timeouts", "publishes that gave up waiting for readers")
        self._server = None

    # ---- recording
    def observe_plan(self, plan) -> None:
        """Imbalance of a published ``plan`` (afore.plan.Plan) and of the primary-only placement
        of its demand, at its layer (needs ``shape``)."""
        if self.shape is None:
            raise ValueError("shape: SchedulerMetrics needs the ClusterShape to record balance")
        layer = plan.target.layer
        for placement, load in (("plan", plan.tile_load), ("primary_only", primary_only_tile_load(self.shape, plan.demand))):
            load_max, total, size = load_stats(np.asarray(load))
            if total <= 0:  # no tile anywhere: no factor (tile_imbalance's None)
                continue
            key = (str(layer), placement)
            children = self._balance_children.get(key)
            if children is None:  # .labels() costs a lock and a dict walk: once per (layer, placement)
                children = self._balance_children[key] = (self._imbalance.labels(*key), self._imbalance_window.labels(*key))
            children[0].observe(load_max * size / total)
            children[1].set(self._window.add_stats(key, load_max, total, size))

    def sync_segments(self, max_age_s: float = SYNC_INTERVAL_S) -> None:
        """Copy the segments' counters into the families, if the last copy is older than ``max_age_s``."""
        now = time.monotonic()
        if now - self._last_sync < max_age_s:
            return
        with self._lock:
            self._last_sync = now
            for name, export in ((self.mailbox, self._export_mailbox), (self.ring, self._export_ring)):
                if not name:
                    continue
                try:
                    info = _shm.inspect(name)
                except ValueError:  # not there (yet, or any more)
                    continue
                if info.get("compatible"):
                    export(info)

    def _add(self, child, key: tuple, value: float) -> None:
        """Increment ``child`` by what ``value`` (a segment's running total) gained since the last sync."""
        last = self._seen.get(key, 0.0)
        if value > last:
            child.inc(value - last)
        self._seen[key] = max(value, last)

    def _export_mailbox(self, info: dict) -> None:
        c = info["counters"]
        for key, value in c.items():
            if key not in ("pending", "rejected_unknown_worker"):
                self._add(self._mailbox_targets.labels(key), ("mailbox", key), value)
        self._mailbox_pending.set(c["pending"])
        for prod in info["producers"]:
            w = str(prod["worker"])
            for key in REPORT_OUTCOMES:
                self._add(self._mailbox_reports.labels(w, key), ("report", w, key), prod[key])
        self._add(self._mailbox_reports.labels("unknown", "rejected_invalid"), ("report", "unknown"),
                  c["rejected_unknown_worker"])

    def _export_ring(self, info: dict) -> None:
        c = info["counters"]
        self._add(self._ring_evictions, ("evictions",), c["evictions"])
        self._add(self._ring_timeouts, ("publish_timeouts",), c["publish_timeouts"])
        self._ring_live.set(sum(1 for rd in info["readers"] if rd["alive"]))
        for rd in info["readers"]:
            w = str(rd["reader"])
            self._ring_lag.labels(w).set(rd["lag"])
            for key in READER_OUTCOMES:
                self._add(self._ring_entries.labels(self.policy, w, key), ("reader", w, key), rd[key])

    # ---- endpoints
    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve this process's /metrics on ``addr:port`` (0 = any free port); returns the port.
        For the scheduler run alone (``afore scheduler --metrics-port``); ``afore serve`` uses the
        pod's endpoint."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_port

    def shutdown(self) -> None:
        """Last copy of the segments' counters, stop the HTTP server, and drop this process's
        live gauges from the pod's aggregation (a restarted scheduler starts its own)."""
        self.sync_segments(0.0)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        multiprocess.mark_dead(os.getpid())

    def render(self) -> str:
        """The Prometheus text exposition of every metric of this process."""
        return generate_latest(self.registry).decode()
