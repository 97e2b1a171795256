"""The scheduler service: demand mailbox -> placement policy -> plan ring.

A loop in the nano-vllm style: wait for the next complete target, plan it with the configured
policy, publish the plan once, record metrics. A target whose demand is incomplete by its
deadline gets no plan (the FFN workers run it primary-only) and is counted as a miss.

The service owns both segments: it creates them at start (replacing stale ones of a crashed
run) and unlinks them at stop, including on SIGINT/SIGTERM. Started by ``afore serve`` through
``start_scheduler_process`` (or in-process with ``SchedulerService(...).start_thread()``), or
alone with ``afore scheduler``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec

from afore import _shm
from afore.config import DEMAND_TOKEN_ENV, ClusterShape, CostModel, SchedulerParams
from afore.prefetch.mailbox import DemandMailbox
from afore.prefetch.receiver import DemandReceiver
from afore.metrics.trace import CsvTrace
from afore.scheduler.metrics import SchedulerMetrics
from afore.plan import Target
from afore.scheduler.policies import Observation, make_policy
from afore.scheduler.plan_ring import PlanRing, PublishTimeout
from afore.scheduler.slot_sync import SlotSync
from afore.scheduler.slot_sync import segment_name as slot_segment_name
from afore.scheduler.window_feedback import WindowFeedback, segment_name

SCHEDULER_TRACE_COLUMNS = ("seq", "written_ns", "complete_ns", "got_ns", "plan_start_ns", "planned_ns", "published_ns")

log = logging.getLogger(__name__)


class ServiceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything the scheduler service needs; validated at construction.

    Names are /dev/shm segment names. ``deadline_ms``: a target still incomplete this long after
    its first demand report gets no plan. ``listen``: "host:port" of the demand receiver for
    remote attention workers ("" = none; needs ``token``, or $AFORE_DEMAND_TOKEN when it is empty,
    which keeps the secret off the command line). ``metrics_port``: Prometheus HTTP
    port (-1 = off, 0 = any free port), bound to ``metrics_host`` (``afore serve --host``).
    ``run_lag``: a complete target is not planned once a worker has reported the target this
    many seqs later (-1 = num_microbatches: the next layer of the same microbatch, so the FFN
    stage ran already; 0 = plan everything, for producers that are not a pipeline).
    ``writer_timeout_s``: the FFN workers call the scheduler dead (and run primary-only at once)
    when its pid is gone or it has not beaten its heartbeat for this long (0 = pid only). ``spin_us``: busy-poll the mailbox this long before
    sleeping (lower latency, costs a core).
    """

    shape: ClusterShape
    policy: str = "afore"
    mailbox: str = "afore-mailbox"
    ring: str = "afore-plans"
    num_producers: int = 1
    num_microbatches: int = 2
    mailbox_capacity: int = 256
    run_lag: int = -1
    ring_slots: int = 16
    deadline_ms: float = 50.0
    liveness_timeout_s: float = 1.0
    writer_timeout_s: float = 1.0
    pid_check: bool = True
    spin_us: float = 0.0
    listen: str = ""
    token: str = ""
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"
    params: SchedulerParams = SchedulerParams()
    cost: CostModel = CostModel()

    def __post_init__(self) -> None:
        if not 1 <= self.num_producers <= 64:
            raise ValueError(f"num_producers: expected in [1, 64], got {self.num_producers}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches: expected >= 1, got {self.num_microbatches}")
        if not self.deadline_ms >= 0:
            raise ValueError(f"deadline_ms: expected >= 0, got {self.deadline_ms}")
        if self.run_lag < -1:
            raise ValueError(f"run_lag: expected >= 0, or -1 (num_microbatches), got {self.run_lag}")
        if not self.writer_timeout_s >= 0:
            raise ValueError(f"writer_timeout_s: expected >= 0 (0 = pid only), got {self.writer_timeout_s}")
        if not self.spin_us >= 0:
            raise ValueError(f"spin_us: expected >= 0, got {self.spin_us}")
        if self.listen and not (self.token or os.environ.get(DEMAND_TOKEN_ENV)):
            raise ValueError(f"token: expected a shared token when listen is set (or ${DEMAND_TOKEN_ENV})")
        if self.listen and ":" not in self.listen:
            raise ValueError(f"listen: expected host:port, got {self.listen!r}")
        if self.mailbox == self.ring:
            raise ValueError("ring: expected a segment name different from mailbox")
        if self.listen and not self.mailbox:
            raise ValueError("listen: the demand receiver feeds the mailbox; expected a mailbox name")


def make_service_policy(name: str, shape: ClusterShape, params: SchedulerParams, cost: CostModel):
    """The registry's policy ``name`` (``afore.scheduler.policies``), without the reference
    ``check_plan`` pass of the Python policies on every plan: serving, the FFN workers validate
    each plan they apply (Migrator.prepare, the plan table's checks), the afore policy's C++ core
    does not pay it either (a fair A/B), and it was 150-200 us of the 190-300 us that static and
    eplb took per target, on the critical path (H200 serve run 3); tests keep it on."""
    return make_policy(name, shape, params, cost, check_plans=False)


class SchedulerService:
    """Owns the mailbox and the plan ring; ``run`` loops until ``stop``."""

    def __init__(self, config: ServiceConfig, policy=None):
        self.config = config
        c = config
        self.policy = policy if policy is not None else make_service_policy(c.policy, c.shape, c.params, c.cost)
        # mailbox "": no mailbox, the service is inline (``plan_now``: the caller holds the
        # demand, afore.attention.planner); else ``step``/``run`` take targets from it
        self.mailbox = (DemandMailbox.create(c.mailbox, c.shape, c.num_producers, c.num_microbatches,
                                             c.mailbox_capacity, c.deadline_ms / 1e3, max_ready=c.mailbox_capacity,
                                             run_lag=c.num_microbatches if c.run_lag < 0 else c.run_lag)
                        if c.mailbox else None)
        try:
            self.ring = PlanRing.create(c.ring, c.shape, c.shape.num_workers, c.ring_slots, c.liveness_timeout_s, c.pid_check,
                                        writer_timeout_s=c.writer_timeout_s)
        except BaseException:
            if self.mailbox is not None:
                self.mailbox.close()
            raise
        self.metrics = SchedulerMetrics(c.mailbox, c.ring, policy=c.policy, shape=c.shape)
        # The FFN workers' measured lookahead windows (window_feedback): planned with online.
        try:
            self.window = WindowFeedback(segment_name(c.ring), c.shape.num_workers)
        except BaseException:
            self.ring.close()
            if self.mailbox is not None:
                self.mailbox.close()
            raise
        # The FFN workers' slot tables when they drift from the projection (slot_sync).
        try:
            self.slots = SlotSync(slot_segment_name(c.ring), c.shape.num_workers, c.shape.num_layers,
                                  c.shape.redundant_slots)
        except BaseException:
            self.window.close()
            self.ring.close()
            if self.mailbox is not None:
                self.mailbox.close()
            raise
        self.resyncs = 0
        self.metrics_port: int | None = None
        self.receiver: DemandReceiver | None = None
        self._receiver_mailbox: DemandMailbox | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0
        self._observed: list = []  # published plans whose metrics _bookkeeping records
        # AFORE_STAGE_TRACE=PATH: PATH.scheduler.csv, one row per published plan (CLOCK_MONOTONIC ns)
        self.trace = CsvTrace.from_env("scheduler", SCHEDULER_TRACE_COLUMNS)
        self.missed = 0
        self._closed = False
        self._endpoints_started = False

    # ---- lifecycle
    def start_endpoints(self) -> None:
        """Start the metrics HTTP server and the demand receiver, as configured (once)."""
        if self._endpoints_started:
            return
        self._endpoints_started = True
        c = self.config
        if c.metrics_port >= 0:
            self.metrics_port = self.metrics.serve(c.metrics_port, c.metrics_host)
        if c.listen:
            host, port = c.listen.rsplit(":", 1)
            self._receiver_mailbox = DemandMailbox.attach(c.mailbox)
            self.receiver = DemandReceiver(self._receiver_mailbox, c.token or os.environ.get(DEMAND_TOKEN_ENV, ""), host, int(port),
                                           on_outcome=lambda o: self.metrics.receiver_messages.labels(o).inc())
            self.receiver.start()

    def run(self, max_targets: int | None = None) -> None:
        """Serve until ``stop()`` (or SIGINT/SIGTERM when run in the main thread); then close."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stop.set())
        try:
            self.start_endpoints()
            done = 0
            while not self._stop.is_set() and (max_targets is None or done < max_targets):
                done += self.step()
        finally:
            self.close()

    def start_thread(self) -> "SchedulerService":
        """Run the loop in a daemon thread of this process (``stop()`` ends it and closes)."""
        self._thread = threading.Thread(target=self.run, name="afore-scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        """Stop the endpoints and unlink both segments (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.trace.flush()
        if self.receiver is not None:
            self.receiver.stop()
        if self._receiver_mailbox is not None:
            self._receiver_mailbox.close()
        self.metrics.shutdown()
        self.window.close()
        self.slots.close()
        self.ring.close()
        if self.mailbox is not None:
            self.mailbox.close()

    # ---- one iteration
    def step(self, timeout_s: float = 0.05) -> int:
        """Plan and publish at most one target; returns the number of plans published (0 or 1).

        Between the complete demand and the published plan runs only what the plan depends on
        (the measured window, the workers' slot tables, the policy, the publish); the metrics and
        the segments' bookkeeping come after the publish, off the plan's latency."""
        if self.mailbox is None:
            raise RuntimeError("step: this service has no mailbox (inline: plan_now)")
        self.ring.heartbeat()  # idle or not, the FFN workers see the scheduler alive
        got = self.mailbox.wait_complete(timeout_s, self.config.spin_us * 1e-6)
        if got is None:
            self._bookkeeping()
            return 0
        got_ns = time.perf_counter_ns()
        written_ns, complete_ns = self.mailbox.last_stamps
        published = self._plan_and_publish(got.target, got.seq, got.demand, got_ns, written_ns, complete_ns)
        self._bookkeeping()
        return published

    def plan_now(self, target: Target, seq: int, demand, bookkeeping: bool = True) -> int:
        """Plan ``target`` (sequence number ``seq``) from ``demand`` (int64[E], its complete
        routed counts) and publish the plan on the ring; returns 1, or 0 when no plan was
        published (the policy failed, the publish timed out: counted, the workers run it
        primary-only). The inline service's entry (no mailbox: the caller is the only demand
        source, afore.attention.planner). ``bookkeeping`` False: the caller runs
        ``bookkeeping()`` later, off the plan's latency."""
        now = time.perf_counter_ns()
        published = self._plan_and_publish(target, seq, demand, now, _shm.monotonic_ns(), _shm.monotonic_ns())
        if bookkeeping:
            self._bookkeeping()
        return published

    def bookkeeping(self) -> None:
        """What no plan waits for (metrics of the segments, copy latencies); ``plan_now(bookkeeping=False)``."""
        self._bookkeeping()

    def _plan_and_publish(self, target: Target, seq: int, demand, got_ns: int, written_ns: int, complete_ns: int) -> int:
        got = Observation(target, seq, demand)
        self._follow_measured_window()
        self._resync_slot_tables()
        t0 = time.perf_counter()
        try:
            plan = self.policy.plan(got)
            if plan.seq != got.seq or plan.target != got.target:
                raise RuntimeError(f"plan for seq {plan.seq} {plan.target}, asked for seq {got.seq} {got.target}")
        except Exception:
            # One bad target must not stop planning: its workers run it primary-only (invariant 5).
            log.exception("policy %s failed on seq %d %s", self.config.policy, got.seq, got.target)
            self.metrics.misses.labels("policy_error").inc()
            self.missed += 1
            return 0
        planned_ns = time.perf_counter_ns()
        try:
            self.ring.publish(plan, timeout_s=self.config.liveness_timeout_s * 2 + 1.0)
        except PublishTimeout as exc:
            log.warning("%s", exc)
            self.metrics.misses.labels("publish_timeout").inc()
            self.missed += 1
            return 0
        published_ns = _shm.monotonic_ns()
        # observed in _bookkeeping, after the publish (off the plan's latency)
        self._observed.append((plan, planned_ns / 1e9 - t0, (published_ns - complete_ns) * 1e-9,
                               (got.seq, written_ns, complete_ns, got_ns, int(t0 * 1e9), planned_ns, published_ns)))
        self.published += 1
        return 1

    def _bookkeeping(self) -> None:
        """What no plan waits for: the segments' counters, dropped targets, plan read latencies."""
        observed, self._observed = self._observed, []
        for plan, policy_s, publish_s, row in observed:
            self.metrics.policy_latency.observe(policy_s)
            self.metrics.publish_latency.observe(publish_s)
            self.trace.add(row)
            self.metrics.plans.inc()
            self.metrics.observe_plan(plan)
        self.metrics.sync_segments()
        if self.mailbox is not None:
            self._count_misses()
        self._record_copy_latency()

    def _resync_slot_tables(self) -> None:
        """A worker ran a target without the scheduler's plan (its epoch moved): its reported
        redundant slots replace its row of every layer's projected table, so later plans build
        on what it holds (otherwise plans are refused again and again after one failed agreement)."""
        for worker, through, tables in self.slots.changed():
            for layer in range(self.config.shape.num_layers):
                table = self.policy.layer(layer).table
                moved = table.expert[worker] != tables[layer]
                if moved.any():
                    table.expert[worker] = tables[layer]
                    table.last_used[worker, moved] = -1  # no history for slots learnt of this way
            self.resyncs += 1
            self.metrics.resyncs.inc()
            log.info("slot tables of FFN worker %d re-synced (its report through seq %d)", worker, through)

    def _follow_measured_window(self) -> None:
        """Plan with the FFN workers' measured window W_t once they report one (it moves by more
        than 1%: a new CostModel; logged when it moves by more than 20%)."""
        window = self.window.window_ms()
        cost = getattr(self.policy, "cost", None)
        if window is None or not isinstance(cost, CostModel) or abs(window - cost.window_ms) <= 0.01 * cost.window_ms:
            return
        if abs(window - cost.window_ms) > 0.2 * cost.window_ms:
            log.info("lookahead window measured by the FFN workers: %.3f ms (was %.3f ms)", window, cost.window_ms)
        self.policy.cost = msgspec.structs.replace(cost, window_ms=window)

    def _count_misses(self) -> None:
        for missed in self.mailbox.take_missed():
            self.metrics.misses.labels(missed.reason).inc()
            self.missed += 1

    def _record_copy_latency(self) -> None:
        for _seq, published_ns, copied_ns, readers_copied, readers_live in self.ring.collect_latencies():
            if readers_copied and readers_copied >= readers_live:
                self.metrics.copy_latency.observe((copied_ns - published_ns) * 1e-9)


def scheduler_command(config: ServiceConfig) -> list[str]:
    """The ``afore scheduler`` command line equivalent to ``config`` (its light entry point)."""
    return [sys.executable, "-m", "afore.scheduler.service_cli", "--config-json", msgspec.json.encode(config).decode()]


def start_scheduler_process(config: ServiceConfig, ready_timeout_s: float = 30.0, **popen) -> subprocess.Popen:
    """Start ``afore scheduler`` as a child process and wait until both segments are ready.

    Stop it with ``proc.terminate()`` (SIGTERM): it unlinks its segments before exiting.
    """
    proc = subprocess.Popen(scheduler_command(config), **popen)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"afore scheduler exited with {proc.returncode} before it was ready")
        if all(_ready(name, proc.pid) for name in (config.mailbox, config.ring)):
            return proc
        time.sleep(0.02)
    proc.terminate()
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    raise TimeoutError(f"afore scheduler: segments not ready after {ready_timeout_s} s")


def _ready(name: str, pid: int) -> bool:
    try:
        info = _shm.inspect(name)
    except ValueError:
        return False
    return info["state"] == "ready" and info["owner_pid"] == pid


def target_of(seq: int, config: ServiceConfig) -> Target:
    """The target of sequence number ``seq`` under ``config``."""
    return Target.from_seq(seq, config.shape.num_layers, config.num_microbatches)


__all__ = ["ServiceConfig", "SchedulerService", "start_scheduler_process", "scheduler_command", "make_service_policy",
           "target_of"]
