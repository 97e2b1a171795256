"""Prometheus metrics of one FFN worker (docs/metrics.md has each family and its healthy value).

Families (label ``worker``: this worker's rank; ``layer``: MoE layer ordinal; base units):

  afore_ffn_targets_total                    targets executed
  afore_ffn_plans_total{outcome}             used (target ran on the scheduler's plan), missed
                                             (no valid plan by the deadline), rejected (stale, out
                                             of order or inconsistent plan), mismatched, diverged
                                             (the workers held different plans: digests differ)
  afore_ffn_primary_only_targets_total       targets run on the primary-only plan (a miss here or
                                             on another worker: all workers apply the same plan)
  afore_ffn_copies_total, _copy_bytes_total  expert copies into this worker and their bytes
  afore_ffn_target_copies, _target_copy_bytes   histograms: copies and bytes per planned target
  afore_ffn_copy_seconds                     raw copy time of a target's copies (side stream)
  afore_ffn_exposed_copy_wait_seconds        copy time left on the critical path at commit
  afore_ffn_lookahead_window_seconds         copy submission -> commit of the same target
  afore_ffn_stage_seconds                    receive -> reply of one target on this worker
  afore_ffn_plan_seconds                     the replicated planner's policy time per target
                                             (``--planner workers``: this worker made the plan)
  afore_ffn_planner_resets_total             replicated planner: restarts from empty slots after
                                             a failed vote (every worker at the same target)
  afore_ffn_policy_switches_total            replicated planner: policy switches followed
  afore_ffn_queued_targets                   gauge: targets received and waiting
  afore_ffn_tile_imbalance{layer,placement}  histogram: max/mean tile load of each executed
                                             target, placement = plan | primary_only
  afore_ffn_tile_imbalance_window{layer,placement}  gauge: the same over the layer's last
                                             ``BALANCE_WINDOW`` targets (sum of max / sum of mean)

The imbalance families are global to a target (every worker runs the same plan), so only
worker 0 records them (no per-worker copies of one figure). Under ``afore serve`` the values
land in the pod's multiprocess directory (afore.metrics.multiprocess) and are served with
vLLM's ``/metrics``; ``render``/``serve`` give this worker's own registry (tests, a worker run
alone).

The worker loop reports through ``observe_target`` (one call per executed target),
``count_plan`` (misses, rejections) and ``observe`` (one call per MigrationRecord). The
attributes ``targets``, ``plan_misses``, ``plans_rejected``, ``fallbacks``, ``queued`` and
``stage_ms`` are the older per-counter interface of the loop, kept until the loop moves to the
calls above; they feed the same families.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from afore.config import ClusterShape
from afore.metrics.balance import BALANCE_WINDOW, IMBALANCE_BUCKETS, ImbalanceWindow, load_stats, primary_only_tile_load
from afore.migrator.migrator import MigrationRecord

# 1 us .. 10 s: a CPU test's stage is ~ms, an H200's copy ~100 us, a stuck transport seconds
SECONDS_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                   0.1, 0.25, 1.0, 10.0)
COPIES_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
BYTES_BUCKETS = (0,) + tuple(4096 * 4**k for k in range(11))  # 4 KiB .. 4 GiB
# mismatched: plan demand != routed counts; diverged: every worker had a plan, not the same one (digests)
PLAN_OUTCOMES = ("used", "missed", "rejected", "mismatched", "diverged")


class _StageMs:
    """``stage_ms.observe(ms)`` of the older loop interface -> afore_ffn_stage_seconds."""

    def __init__(self, seconds: Histogram) -> None:
        self._seconds = seconds

    def observe(self, ms: float) -> None:
        self._seconds.observe(ms / 1e3)


class _TargetCounter:
    """``targets.inc()`` of the older loop interface: counts the target, and a plan used unless
    ``fallbacks.inc()`` was called for it (the loop calls that first)."""

    def __init__(self, metrics: "FFNMetrics") -> None:
        self._m = metrics

    def inc(self, amount: int = 1) -> None:
        m = self._m
        m._targets.inc(amount)
        if m._fallback_pending:
            m._fallback_pending = False
        else:
            m._plans["used"].inc(amount)


class _FallbackCounter:
    def __init__(self, metrics: "FFNMetrics") -> None:
        self._m = metrics

    def inc(self, amount: int = 1) -> None:
        self._m._primary_only.inc(amount)
        self._m._fallback_pending = True


class FFNMetrics:
    """All metrics of one worker, in their own registry (label ``worker``)."""

    def __init__(self, worker: int, shape: ClusterShape | None = None) -> None:
        """``shape``: the pool's ClusterShape; the imbalance families need it (primary owners,
        M_tile) and are recorded on worker 0 only."""
        self.registry = r = CollectorRegistry()
        w = self.worker = str(worker)
        self.shape = shape
        self.records_balance = worker == 0 and shape is not None

        def counter(name, doc, *labels):
            return Counter(name, doc, ("worker", *labels), registry=r)

        def histogram(name, doc, buckets, *labels):
            return Histogram(name, doc, ("worker", *labels), buckets=buckets, registry=r)

        self._targets = counter("afore_ffn_targets", "targets executed").labels(w)
        plans = counter("afore_ffn_plans", "scheduler plans by outcome: used, missed (none by the deadline), "
                                           "rejected (stale, out of order, inconsistent)", "outcome")
        self._plans = {o: plans.labels(w, o) for o in PLAN_OUTCOMES}
        self._primary_only = counter("afore_ffn_primary_only_targets", "targets run on the primary-only plan").labels(w)
        self.copies = counter("afore_ffn_copies", "expert copies into this worker").labels(w)
        self.copy_bytes = counter("afore_ffn_copy_bytes", "bytes copied into this worker").labels(w)
        self.target_copies = histogram("afore_ffn_target_copies", "expert copies per planned target", COPIES_BUCKETS).labels(w)
        self.target_copy_bytes = histogram("afore_ffn_target_copy_bytes", "bytes copied per planned target",
                                           BYTES_BUCKETS).labels(w)
        self.copy_seconds = histogram("afore_ffn_copy_seconds", "raw copy time of a target's copies (side stream)",
                                      SECONDS_BUCKETS).labels(w)
        self.exposed_seconds = histogram("afore_ffn_exposed_copy_wait_seconds",
                                         "copy time on the critical path at commit", SECONDS_BUCKETS).labels(w)
        self.window_seconds = histogram("afore_ffn_lookahead_window_seconds",
                                        "copy submission to commit of the same target", SECONDS_BUCKETS).labels(w)
        self.stage_seconds = histogram("afore_ffn_stage_seconds", "receive-to-reply time of a target on this worker",
                                       SECONDS_BUCKETS).labels(w)
        self.plan_seconds = histogram("afore_ffn_plan_seconds", "replicated planner: policy time of a target's "
                                      "plan on this worker", SECONDS_BUCKETS).labels(w)
        self.planner_resets = counter("afore_ffn_planner_resets", "replicated planner: restarts from empty "
                                      "redundant slots after a failed vote").labels(w)
        self.policy_switches = counter("afore_ffn_policy_switches", "replicated planner: policy switches "
                                       "followed (afore serve's policy board)").labels(w)
        self.queued = Gauge("afore_ffn_queued_targets", "targets received and waiting (lookahead depth)", ("worker",),
                            registry=r, multiprocess_mode="livesum").labels(w)
        self._imbalance = Histogram("afore_ffn_tile_imbalance", "max/mean tile load over the FFN workers of each "
                                    "executed target (1 = balanced)", ("layer", "placement"),
                                    buckets=IMBALANCE_BUCKETS, registry=r)
        self._imbalance_window = Gauge("afore_ffn_tile_imbalance_window", "max/mean tile load over the layer's last "
                                       f"{BALANCE_WINDOW} executed targets", ("layer", "placement"), registry=r,
                                       multiprocess_mode="livemostrecent")
        self._window = ImbalanceWindow(BALANCE_WINDOW)
        self._balance_children: dict[tuple[int, str], tuple] = {}
        # the older loop interface (see the module docstring)
        self._fallback_pending = False
        self.targets = _TargetCounter(self)
        self.fallbacks = _FallbackCounter(self)
        self.plan_misses = self._plans["missed"]
        self.plans_rejected = self._plans["rejected"]
        self.stage_ms = _StageMs(self.stage_seconds)

    # ---- the loop's calls
    def observe_target(self, plan, stage_s: float, queued: int) -> None:
        """One executed target: ``plan`` (afore.plan.Plan, the scheduler's or the primary-only
        fallback) ran on this worker in ``stage_s`` seconds (receive -> reply ready); ``queued``
        targets wait behind it at the transport."""
        self.count_target(plan)
        self.observe_stage(plan, stage_s, queued)

    def count_target(self, plan) -> None:
        """The counters of one executed target (the loop calls this before the reply leaves, so
        a client that has every reply sees every target counted)."""
        self._targets.inc()
        (self._primary_only if plan.primary_only else self._plans["used"]).inc()

    def observe_stage(self, plan, stage_s: float, queued: int) -> None:
        """The histograms and gauges of one executed target (the loop calls this after the reply
        left: nothing waits for them)."""
        self.stage_seconds.observe(stage_s)
        self.queued.set(queued)
        if self.records_balance:
            self.observe_balance(plan)

    def count_plan(self, outcome: str) -> None:
        """A plan ``missed`` (none by the deadline) or ``rejected`` by validation."""
        if outcome not in PLAN_OUTCOMES[1:]:
            raise ValueError(f"outcome: expected one of {', '.join(PLAN_OUTCOMES[1:])}, got {outcome!r}")
        self._plans[outcome].inc()

    def observe(self, record: MigrationRecord) -> None:
        """One planned target's migration timings (afore.migrator.migrator.MigrationRecord, ms)."""
        self.window_seconds.observe(record.window_ms / 1e3)
        self.exposed_seconds.observe(record.exposed_ms / 1e3)
        self.target_copies.observe(record.copies)
        self.target_copy_bytes.observe(record.bytes)
        if record.copies:
            self.copy_seconds.observe(record.raw_copy_ms / 1e3)
            self.copies.inc(record.copies)
            self.copy_bytes.inc(record.bytes)

    def observe_balance(self, plan) -> None:
        """Imbalance of ``plan`` and of the primary-only placement of the same demand, at its layer."""
        if self.shape is None:
            raise ValueError("shape: FFNMetrics needs the ClusterShape to record balance (FFNMetrics(worker, shape))")
        layer = plan.target.layer
        for placement, load in (("plan", plan.tile_load), ("primary_only", primary_only_tile_load(self.shape, plan.demand))):
            load_max, total, size = load_stats(np.asarray(load))
            if total <= 0:  # no tile anywhere: no factor (tile_imbalance's None)
                continue
            key = (layer, placement)
            children = self._balance_children.get(key)
            if children is None:  # .labels() costs a lock and a dict walk: once per (layer, placement)
                children = self._balance_children[key] = (self._imbalance.labels(str(layer), placement),
                                                          self._imbalance_window.labels(str(layer), placement))
            children[0].observe(load_max * size / total)
            children[1].set(self._window.add_stats(key, load_max, total, size))

    # ---- views
    def value(self, name: str, **labels: str) -> float:
        """This worker's value of sample ``name`` (0 when absent)."""
        return self.registry.get_sample_value(name, {"worker": self.worker, **labels}) or 0.0

    def summary(self) -> str:
        """One log line: targets, plans run, primary-only (misses, rejected), copies."""
        targets, fallbacks = self.value("afore_ffn_targets_total"), self.value("afore_ffn_primary_only_targets_total")
        return (f"targets {targets:.0f}, plans run {targets - fallbacks:.0f}, primary-only {fallbacks:.0f} "
                f"(no plan {self.value('afore_ffn_plans_total', outcome='missed'):.0f}, "
                f"rejected {self.value('afore_ffn_plans_total', outcome='rejected'):.0f}), "
                f"copies {self.value('afore_ffn_copies_total'):.0f}")

    def render(self) -> str:
        """The Prometheus text exposition of this worker's metrics."""
        return generate_latest(self.registry).decode()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose this worker's ``/metrics`` on ``addr:port`` (a background thread): for a worker
        run alone (``afore ffn-worker --metrics-port``); ``afore serve`` uses the pod's endpoint."""
        start_http_server(port, addr=addr, registry=self.registry)

