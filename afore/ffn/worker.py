"""The FFN worker: one process per GPU (or CPU worker), serving the routed experts of a model.

Loop, per target t (``FFNWorker.step``)::

    receive t                 gathered inputs of all A attention workers (the transport keeps
                              t+1 queued behind t: the lookahead)
    plan t                    the plan prepared while t-1 ran, else PlanSource.get(t) until the
                              deadline (or made here: ``policy``, the replicated planner); all F
                              workers agree to use it (else primary-only, a miss)
    read plan t+1, copies     if t+1 has arrived: validate its plan and submit its copies on the
                              side stream, overlapping t's compute
    commit, partition, compute, release
    combine, reply            all-reduce over the FFN workers, rows back to each attention worker

Layers: ``Target.layer`` is the ordinal of the MoE layer (0 = the model's first MoE layer,
``ModelSpec.moe_layer_indices[layer]`` is its decoder index). Shared experts are not run here:
they run on the attention worker beside the router, where the hidden states already are
(no extra transfer, overlapped with the A2F round trip), and they would break the tile
balance the scheduler computes for routed experts.

CPU workers copy replicas from the layer's routed weights in host memory (every worker maps
the checkpoint); GPU workers pull from the primary owner's pool over CUDA IPC (``peers``).

Python API (``afore serve`` starts F of these)::

    procs = start_ffn_workers([FFNWorkerConfig(...), ...])   # spawned processes
    stop_ffn_workers(procs)                                  # SIGTERM, join, kill if stuck
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time

import msgspec
import numpy as np
import torch

from afore.config import DEFAULT_COPY_RATE_GBPS, ClusterShape, CostModel, SchedulerParams
from afore.ffn import cpus as cpus_
from afore.ffn.layer import FFNLayer
from afore.ffn.metrics import FFNMetrics
from afore.ffn.stages import ffn_trace
from afore.routing import count_demand, count_host
from afore.migrator.copy_engine import make_copy_engine
from afore.migrator.migrator import HostWeightsSource, Migrator, PoolSource
from afore.migrator.slot_pool import SlotPool
from afore.plan import Plan, plan_digest, primary_only_plan
from afore.transport.base import Microbatch, ReplyRows
from afore.transport.connector import FFNConnector, TransportConfig

log = logging.getLogger("afore.ffn.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# afore serve's notice to its FFN workers that it is stopping, sent before it stops vLLM: the
# attention side's connections are about to close on purpose (SIGTERM follows once vLLM is down)
STOP_NOTICE = signal.SIGUSR1


class FFNWorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One FFN worker. ``host:port``: the transport's TCPStore (attention rank 0 hosts it)."""

    rank: int
    num_ffn: int
    num_attention: int
    model: str
    host: str = "127.0.0.1"
    port: int = 29600
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = ""                 # "" = gloo on CPU, nccl on CUDA
    redundant_slots: int = 2
    m_tile: int = 16
    plan_ring: str = ""               # PlanRing name; "" = no scheduler (primary-only plans)
    plan_timeout_ms: float = 5.0      # deadline for a target's plan at commit
    # the plan ring's writer starts after this worker (afore serve --planner attention: vLLM's
    # worker process plans and writes it): attach at the first target, not at start
    plan_ring_later: bool = False
    # the replicated planner (afore serve --planner workers): this worker plans every target itself
    # with this policy, params and cost, as every other worker does (ReplicatedPlanSource); "" = the
    # scheduler's plans from plan_ring (or none)
    policy: str = ""
    params: SchedulerParams = SchedulerParams()
    cost: CostModel = CostModel()
    policy_board: str = ""            # with policy: the board afore serve posts policy switches on ("" = fixed)
    metrics_port: int = 0             # 0 = no HTTP endpoint
    copy_delay_ms: float = 0.0        # artificial delay per copy (CPU tests)
    # The pool's shape as afore serve's launcher computed it once (m_tile, primary layout and all),
    # the one the scheduler plans for; None = derived here from the checkpoint, num_ffn,
    # redundant_slots and m_tile (a worker started on its own).
    shape: ClusterShape | None = None
    copy_rate_gbps: float = DEFAULT_COPY_RATE_GBPS  # GPU copy pull rate cap while experts compute; 0 = full rate
    timeout_s: float = 300.0          # transport timeout
    depth: int = 2                    # targets queued ahead at the transport (>= 2)
    shm_segment: str = ""             # the shm transport's segment (afore.transport.shm); "" = torch.distributed
    max_tokens: int = 0               # shm: tokens per target and attention worker the segment holds
    exact: bool = False               # shm: vLLM's MoE numerics, a reply row per pair (afore.ffn.exact)
    spin_us: float = 0.0              # busy-poll this long before blocking: targets, plans, votes (shm and the plan ring)
    cpus: list[int] = []              # CPU workers: the cores this worker is pinned to ([] = not pinned; afore.ffn.cpus)
    nice: int = 0                     # added to this worker's niceness at start (afore.ffn.cpus)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_ffn:
            raise ValueError(f"rank: expected in [0, {self.num_ffn}), got {self.rank}")
        if self.num_attention < 1:
            raise ValueError(f"num_attention: expected >= 1, got {self.num_attention}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.backend not in ("", "gloo", "nccl"):
            raise ValueError(f"backend: expected '', 'gloo' or 'nccl', got {self.backend!r}")
        for name in ("plan_timeout_ms", "copy_delay_ms", "copy_rate_gbps", "spin_us"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ValueError(f"{name}: expected a finite number >= 0, got {value}")
        if self.depth < 2:
            raise ValueError(f"depth: expected >= 2 (two microbatches in flight), got {self.depth}")
        if self.cpus and not self.device.startswith("cpu"):
            raise ValueError(f"cpus: pinning is for CPU workers, got device {self.device!r}")
        if any(c < 0 for c in self.cpus) or len(set(self.cpus)) != len(self.cpus):
            raise ValueError(f"cpus: expected distinct core ids >= 0, got {self.cpus}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice: expected in [0, 19], got {self.nice}")
        if self.shm_segment and self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected >= 1 with shm_segment, got {self.max_tokens}")
        if self.exact and not self.shm_segment:
            raise ValueError("exact: needs the shm transport (shm_segment), whose replies carry a row per pair")
        if self.policy_board and not self.policy:
            raise ValueError("policy_board: needs policy (the replicated planner), got none")
        if self.policy:
            from afore.scheduler.policies import POLICY_NAMES

            if self.policy not in POLICY_NAMES:
                raise ValueError(f"policy: expected one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
            if self.plan_ring:
                raise ValueError("policy, plan_ring: expected one planner (this worker's policy or the scheduler's ring), got both")
            if self.policy_board and "/" in self.policy_board:
                raise ValueError(f"policy_board: expected a segment name without '/', got {self.policy_board!r}")
            if not self.device.startswith("cpu") and not self.shm_segment:
                raise ValueError("policy: the replicated planner needs each target's ids on the host (a CPU worker or "
                                 "the shm transport); torch.distributed on a GPU delivers them on the device")


def check_shape_fits(shape: ClusterShape, spec, num_ffn: int) -> None:
    """A shape handed in by the launcher must describe this checkpoint and pool (ValueError
    naming the field): experts, MoE layers and top-k of ``spec``, ``num_ffn`` workers."""
    want = {"num_experts": spec.num_experts, "num_layers": len(spec.moe_layer_indices), "top_k": spec.top_k,
            "num_workers": num_ffn}
    for name, value in want.items():
        if getattr(shape, name) != value:
            raise ValueError(f"shape.{name}: expected {value} (the checkpoint and num_ffn), got {getattr(shape, name)}")


class FFNWorker:
    """State and loop of one FFN worker."""

    def __init__(self, cfg: FFNWorkerConfig, plan_source=None) -> None:
        from afore.models.checkpoint import load_routed_experts, read_model_spec

        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": the current device (torch.cuda.set_device needs an index)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        else:
            # first, before any thread of this worker exists: they inherit both (afore.ffn.cpus)
            cpus_.apply(cfg.cpus, cfg.nice)
            # CPU workers share the cores with each other and with vLLM: an intra-op pool per worker
            # only adds OpenMP threads that spin after each op and starve the other processes
            torch.set_num_threads(len(cfg.cpus) if cfg.cpus else
                                  cpus_.threads_per_worker(os.cpu_count() or 1, cfg.num_ffn, cfg.num_attention))
        dtype = DTYPES[cfg.dtype]
        spec = read_model_spec(cfg.model)
        self.spec = spec
        if spec.num_experts < cfg.num_ffn:
            raise ValueError(f"num_ffn: expected at most num_experts={spec.num_experts} FFN workers, got {cfg.num_ffn}")
        self.shape = cfg.shape or ClusterShape(num_experts=spec.num_experts, num_workers=cfg.num_ffn,
                                               num_layers=len(spec.moe_layer_indices), redundant_slots=cfg.redundant_slots,
                                               m_tile=cfg.m_tile, top_k=spec.top_k)
        check_shape_fits(self.shape, spec, cfg.num_ffn)
        self.transport = TransportConfig(cfg.host, cfg.port, cfg.num_attention, cfg.num_ffn, spec.hidden_size, spec.top_k,
                                         dtype, cfg.backend or ("nccl" if self.device.type == "cuda" else "gloo"),
                                         cfg.timeout_s, cfg.depth)
        self.pools: dict[int, SlotPool] = {}
        host_weights = {}
        for layer, decoder_index in enumerate(spec.moe_layer_indices):
            weights = load_routed_experts(cfg.model, decoder_index, dtype)
            pool = SlotPool(self.shape, cfg.rank, spec.hidden_size, spec.moe_intermediate_size, dtype, self.device)
            pool.load_primaries(weights.w13, weights.w2)
            self.pools[layer] = pool
            if self.device.type == "cpu":
                host_weights[layer] = (weights.w13, weights.w2)
        if plan_source is None and cfg.plan_ring:
            # Attach before the transport rendezvous: once the attention side is connected,
            # every worker reads the ring (a reader sees plans published after it attached).
            from afore.migrator.plan_source import RingPlanSource
            from afore.scheduler.plan_ring import wait_for_segment

            if not cfg.plan_ring_later:
                wait_for_segment(cfg.plan_ring, cfg.timeout_s)
            plan_source = RingPlanSource(cfg.plan_ring, cfg.rank, self.shape, spin_s=cfg.spin_us * 1e-6,
                                         wait_for_writer=cfg.plan_ring_later)
        if plan_source is None and cfg.policy:
            from afore.migrator.plan_source import ReplicatedPlanSource

            plan_source = ReplicatedPlanSource(cfg.policy, self.shape, cfg.params, cfg.cost)
        self.plan_source = plan_source
        # the replicated planner's policy switches (afore.scheduler.policy_board), read before each plan
        self.policy_reader = None
        if cfg.policy_board and plan_source is not None and plan_source.needs_demand:
            from afore.scheduler.policy_board import PolicyReader

            self.policy_reader = PolicyReader(cfg.policy_board)
            now = self.policy_reader.changed()  # the policy in force now: a switch posted before this worker started counts
            if now is not None and now[1] != cfg.policy:
                plan_source.switch(now[1], -1)
        # the measured lookahead windows, fed back to the scheduler (afore.scheduler.window_feedback)
        self.window_reporter = None
        if cfg.plan_ring:
            from afore.scheduler.window_feedback import WindowReporter

            self.window_reporter = WindowReporter.for_ring(cfg.plan_ring, cfg.rank)
        # this worker's slots, reported when a target ran without the scheduler's plan (slot_sync)
        self.slot_reporter = None
        if cfg.plan_ring:
            from afore.scheduler.slot_sync import SlotReporter

            self.slot_reporter = SlotReporter.for_ring(cfg.plan_ring, cfg.rank, self.shape.num_layers,
                                                       self.shape.redundant_slots)
        # CUDA graphs of every token bucket now, before the transport's receive thread starts
        # (its CUDA calls during a capture would invalidate it), not on the first steps
        self.layers = {layer: FFNLayer(pool) for layer, pool in self.pools.items()}
        for layer in self.layers.values():  # shm on a GPU: the host-fed graphs (forward_host_routed)
            layer.capture_graphs(host_fed=bool(cfg.shm_segment) and not cfg.exact)
            if cfg.shm_segment:  # every size a target can have: A senders of up to max_tokens each
                layer.tune_large_steps(cfg.max_tokens * cfg.num_attention)
        if cfg.exact and self.device.type == "cuda" and self.pools:
            self._warm_exact()
        self.connector = self._connect()
        if cfg.plan_ring_later and self.plan_source is not None:
            # the attention side is connected, so its planner made the ring: join it now, before
            # the first target (a reader sees only plans published after it attached)
            self.plan_source.attach()
        if self.device.type == "cuda":
            from afore.migrator.peers import open_peer_pools, publish_pools

            store = self.connector.store or self._peer_store()
            publish_pools(store, self.pools)
            source = PoolSource(self.shape, open_peer_pools(store, list(self.pools), cfg.num_ffn, cfg.rank, self.pools))
        else:
            source = HostWeightsSource(host_weights)
        self.migrator = Migrator(self.shape, cfg.rank, self.pools,
                                 make_copy_engine(self.device, delay_s=cfg.copy_delay_ms / 1e3,
                                                  max_gbps=cfg.copy_rate_gbps or None), source)
        self.metrics = FFNMetrics(cfg.rank, self.shape)
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port + cfg.rank)
        self._early: dict[int, Plan | None] = {}   # plans read while the previous target ran (None: rejected)
        self._early_routed: dict[int, np.ndarray] = {}  # their targets' routed counts (the replicated planner)
        self.trace = ffn_trace(cfg.rank)
        self._rows_ns = 0      # stamps inside the compute of the target being run (trace only)
        # the bookkeeping after a reply (histograms, balance figures, migration records, trace):
        # deferred by ``run`` to the end of a step (the last MoE layer's target: the attention side
        # then samples and schedules, the longest gap between targets), so that with the
        # attention's layers back to back (CUDA graphs, the stream exchange) it does not delay the
        # next layer's target; ``step`` called on its own does it at once
        self.defer_bookkeeping = False
        self._after: list[tuple] = []
        self._events = None
        self._routed: np.ndarray | None = None  # routed counts of the target being run
        self.stop_event = threading.Event()

    def _connect(self):
        """The FFN end of the A2F/F2A transport (afore.transport.base)."""
        cfg = self.cfg
        if not cfg.shm_segment:
            return FFNConnector(self.transport, cfg.rank, self.device)
        from afore.transport.shm import ShmFFNEnd, ShmLayout

        layout = ShmLayout(num_attention=cfg.num_attention, num_ffn=cfg.num_ffn, hidden=self.spec.hidden_size,
                           top_k=self.spec.top_k, max_tokens=cfg.max_tokens, dtype=cfg.dtype, depth=cfg.depth,
                           exact=cfg.exact)
        return ShmFFNEnd(cfg.shm_segment, layout, cfg.rank, self.device, timeout_s=cfg.timeout_s,
                         spin_s=cfg.spin_us * 1e-6)

    def _peer_store(self):
        """The TCPStore on host:port that ``afore serve`` hosts for the CUDA IPC handles of the pools
        (the shm transport has no store of its own)."""
        import datetime

        import torch.distributed as dist

        return dist.TCPStore(self.cfg.host, self.cfg.port, world_size=None, is_master=False,
                             timeout=datetime.timedelta(seconds=self.cfg.timeout_s), wait_for_workers=False)

    # ------------------------------------------------------------------ plans

    def _read_plan(self, mb: Microbatch, timeout_s: float, routed: np.ndarray | None) -> Plan | None:
        source = self.plan_source
        if source is None:
            return None
        if not source.needs_demand:
            return source.get(mb.target, mb.seq, timeout_s)
        if routed is None:
            raise ValueError("the replicated planner needs the target's ids on the host")
        plan = source.get(mb.target, mb.seq, timeout_s, routed)
        if plan is not None:
            self.metrics.plan_seconds.observe(source.plan_seconds)
        return plan

    def _candidate(self, mb: Microbatch) -> Plan | None:
        """This worker's view of ``mb``'s plan before the vote: the scheduler's plan if it came in
        time, passed its checks (prepared: its copies submitted; demand equal to the routed
        counts; committable), else None (counted why)."""
        # counted before the plan is waited for: it needs only the target, and the plan usually
        # comes after the target (the scheduler's turn-around), so this costs no wait
        routed = self._early_routed.pop(mb.seq, None)  # counted already when read ahead
        self._routed = routed = routed if routed is not None else self._routed_counts(mb)
        if self.policy_reader is not None:
            self._follow_policy(mb)
        if mb.seq in self._early:  # read ahead: its plan, or None when it was rejected then (counted there)
            plan = self._early.pop(mb.seq)
        else:
            plan = self._read_plan(mb, self.cfg.plan_timeout_ms / 1e3, routed)
            if plan is None:
                self.metrics.count_plan("missed")
            elif not self._accept(plan, mb):
                self.metrics.count_plan("rejected")
                log.warning("worker %d: plan %d rejected: %s", self.cfg.rank, mb.seq, self.migrator.last_rejection)
                plan = None
        made_here = self.plan_source is not None and self.plan_source.needs_demand  # from these very counts
        if plan is not None and routed is not None and not made_here and not np.array_equal(plan.demand, routed):
            # the plan was made for other demand (wrong or stale report): correct either way, but
            # its balance is not what it claims, so it is not used (and not counted as used)
            self.metrics.count_plan("mismatched")
            log.warning("worker %d: plan %d demand differs from the routed counts of its target", self.cfg.rank, mb.seq)
            self.migrator.forget(plan)
            plan = None
        if plan is not None:
            reason = self.migrator.commit_check(plan)
            if reason is not None:  # veto before agreeing, never fail alone after the others committed
                self.metrics.count_plan("rejected")
                log.warning("worker %d: plan %d cannot commit: %s", self.cfg.rank, mb.seq, reason)
                self.migrator.forget(plan)
                plan = None
        return plan

    def _settle(self, mb: Microbatch, candidate: Plan | None, agreed: bool) -> Plan:
        """The plan of ``mb`` once the vote is in (``step``): ``candidate`` if every worker had one, else
        the primary-only plan (a worker that had one forgets it and reports its slot tables)."""
        if agreed:
            return candidate
        if candidate is not None:
            self.migrator.forget(candidate)
        if self.plan_source is not None and self.plan_source.needs_demand:
            self._restart_planner(mb)
        if self.slot_reporter is not None and self.plan_source is not None:
            # the scheduler projected this plan's copies onto every worker: tell it what this one holds
            self.slot_reporter.report(mb.seq, {layer: rows.astype(np.int32) for layer, rows in self.migrator.projected.items()})
        return self._primary_only(mb)

    def _restart_planner(self, mb: Microbatch) -> None:
        """The replicated planner after a failed vote on ``mb``: some worker did not apply a plan
        every other worker applied, so the policy's projected slot tables may be wrong for it.
        Every worker sees the same vote, so every worker does this at the same target: drop the
        plans read ahead (made on the old state), empty the redundant slots (the migrator's
        projection; their contents are overwritten by later copies) and start the policy afresh
        from ``mb``, so that the next plans are made from the same empty state everywhere."""
        self._drop_planned()
        self.plan_source.reset(mb.seq)
        self.metrics.planner_resets.inc()
        log.warning("worker %d: the FFN workers did not agree on plan %d: replicated planner restarted from "
                    "empty redundant slots", self.cfg.rank, mb.seq)

    def _follow_policy(self, mb: Microbatch) -> None:
        """A policy switch posted on the board since the last target: plan from ``mb`` on with a
        fresh instance of the new policy, from empty redundant slots (as after a failed vote). The
        workers see the notice at about the same target; where they do not, their plans differ, the
        vote fails on the digests and every worker restarts at that target (policy_board)."""
        change = self.policy_reader.changed()
        if change is None:
            return
        epoch, policy = change
        self._drop_planned()
        self.plan_source.switch(policy, mb.seq - 1)
        self.metrics.policy_switches.inc()
        log.info("worker %d: planning with policy %s from target %d (switch %d)", self.cfg.rank, policy, mb.seq, epoch)

    def _drop_planned(self) -> None:
        """Forget the plans read ahead and empty the redundant slots (the migrator's projection)."""
        for plan in self._early.values():
            if plan is not None:
                self.migrator.forget(plan)
        self._early.clear()
        self._early_routed.clear()
        self.migrator.empty_redundant_slots()

    def _primary_only(self, mb: Microbatch) -> Plan:
        routed = self._routed
        demand = routed if routed is not None else count_demand(mb.topk_ids, self.shape.num_experts).cpu().numpy()
        return primary_only_plan(self.shape, demand, mb.target, mb.seq)

    def _routed_counts(self, mb: Microbatch) -> np.ndarray | None:
        """int64[E]: the valid token-expert pairs per expert of ``mb``, counted where its ids
        are on the host (CPU workers, the shm transport); None when they are only on a GPU
        (the torch transport on CUDA: counting would be a host sync on the step)."""
        if mb.topk_ids.device.type != "cpu":
            return None
        return count_host(mb.topk_ids.numpy(), self.shape.num_experts)

    def _warm_exact(self) -> None:
        """--exact on a GPU: compile vLLM's MoE kernel variants of every token count a target can
        bring (afore.ffn.exact.warm_pair_rows) now, not on the steps that first meet them. The
        layers share their shapes, so one layer's weights compile them for all."""
        from afore.ffn.exact import warm_pair_rows

        pool = next(iter(self.pools.values()))
        t0 = time.monotonic()
        log.info("worker %d: compiling vLLM's MoE kernels for 1-%d tokens per call (--exact)", self.cfg.rank,
                 self.cfg.max_tokens)
        calls = warm_pair_rows(pool.w13, pool.w2, self.shape.num_experts, self.spec.top_k, self.cfg.max_tokens,
                               pool.dtype)
        if calls:
            log.info("worker %d: vLLM's MoE kernels compiled for 1-%d tokens per call (%d calls, %.1f s)",
                     self.cfg.rank, self.cfg.max_tokens, calls, time.monotonic() - t0)

    def _accept(self, plan: Plan, mb: Microbatch) -> bool:
        """Validate ``plan`` for ``mb`` and submit its copies (Migrator.prepare), then stage it on
        the device for the FFN step (FFNLayer.stage_plan: host-side checks happen here, when the
        plan arrives, not on the step). False: rejected (``migrator.last_rejection`` says why)."""
        if not self.migrator.prepare(plan, expected_seq=mb.seq, expected_target=mb.target):
            return False
        try:
            self.layers[plan.target.layer].stage_plan(plan)
        except ValueError as exc:
            self.migrator.forget(plan)
            self.migrator.last_rejection = str(exc)
            return False
        return True

    def _read_ahead(self) -> None:
        """If the next target already arrived, read its plan now and submit its copies."""
        nxt = self.connector.peek()
        if nxt is None or nxt.seq in self._early or self.plan_source is None:
            return
        routed = None
        if self.plan_source.needs_demand:
            routed = self._early_routed[nxt.seq] = self._routed_counts(nxt)
        plan = self._read_plan(nxt, 0.0, routed)
        if plan is None:  # not there yet (the scheduler's): the target reads it again, with its timeout
            return
        if not self._accept(plan, nxt):
            # taken from its source and rejected: counted once, here; the target then runs without a
            # plan rather than asking the source again (which would count it missed as well)
            self.metrics.count_plan("rejected")
            log.warning("worker %d: plan %d rejected: %s", self.cfg.rank, nxt.seq, self.migrator.last_rejection)
            plan = None
        self._early[nxt.seq] = plan

    # ------------------------------------------------------------------ loop

    def step(self, mb: Microbatch) -> ReplyRows:
        """Run one target on this worker and reply; returns the reply (this worker's partial sums
        of the tokens it computed a pair of).

        The vote on the plan is posted before the compute (where the transport can, ``vote``) and
        tallied after it, so that waiting for the other workers overlaps this one's compute and
        their votes are usually there when it tallies: the compute runs with this worker's candidate (the
        scheduler's plan, or primary-only when it has none, in which case the vote cannot pass);
        in the rare case that another worker voted no, it runs again primary-only. Either way
        every worker replies with the plan they all agreed on (DESIGN.md invariant 3)."""
        t0 = time.perf_counter_ns()
        self.shape.check_layer(mb.target.layer)
        layer = self.layers[mb.target.layer]
        candidate = self._candidate(mb)
        # what the others must hold too: the same plan (its digest), or nothing to agree on
        digest = plan_digest(candidate) if candidate is not None and self.cfg.num_ffn > 1 else 0
        planned = time.perf_counter_ns()
        vote = getattr(self.connector, "vote", None)  # the shm transport posts votes early
        if vote is not None:  # posted now, tallied after the compute: found there, not waited for
            vote(candidate is not None, digest)
        self._read_ahead()
        plan = candidate if candidate is not None else self._primary_only(mb)
        reply = self._compute(layer, mb, plan)
        computed = time.perf_counter_ns()
        agreed = self.connector.agree(candidate is not None, digest)
        if getattr(self.connector, "last_diverged", False):
            # every worker had a plan, not the same one: none is used (a replicated planner that
            # diverged, or plans that differ): counted, and handled as any failed vote
            self.metrics.count_plan("diverged")
            log.error("worker %d: the FFN workers voted for different plans of target %d (digests differ)",
                      self.cfg.rank, mb.seq)
        agreed_plan = self._settle(mb, candidate, agreed)
        if agreed_plan is not plan:  # another worker had no valid plan: primary-only everywhere
            plan = agreed_plan
            reply = self._compute(layer, mb, plan)
        agreed = time.perf_counter_ns()
        # counted before the reply leaves: a client that has every reply sees every target counted;
        # the histograms, the balance figures and the migration records come after it
        self.metrics.count_target(plan)
        handed = time.perf_counter_ns()  # stamped before the reply is published: after it, the woken
        self.connector.send(mb, reply)   # attention side may run first and the stamp would come late
        published = time.perf_counter_ns()
        events, self._events = self._events, None
        self._after.append((mb.target, mb.seq, mb.num_tokens, mb.arrived, plan, reply.tokens.numel(), events,
                            self._rows_ns, self.connector.queued, (t0, planned, computed, agreed, handed, published)))
        if not self.defer_bookkeeping or mb.target.layer == self.shape.num_layers - 1 or len(self._after) >= 64:
            self.flush_bookkeeping()
        return reply

    def flush_bookkeeping(self) -> None:
        """The deferred after-reply work of the targets run so far (``defer_bookkeeping``)."""
        after, self._after = self._after, []
        for t, seq, tokens, arrived, plan, rows, events, rows_ns, queued, stamps in after:
            t0, planned, computed, agreed, handed, published = stamps
            self.metrics.observe_stage(plan, stage_s=(agreed - t0) / 1e9, queued=queued)
            if self.trace.enabled:
                # the reply's copy to the host (send) came after the compute on this stream: both events are done
                device_ns = int(events[0].elapsed_time(events[1]) * 1e6) if events is not None and events[1].query() else 0
                self.trace.add((seq, t.step, t.layer, t.microbatch, tokens, rows,
                                int(arrived * 1e9), t0, planned, computed, agreed, handed, int(not plan.primary_only),
                                rows_ns, device_ns, published))  # rows_ns 0: a path without the stamp
        self._observe_records()

    def _compute(self, layer: FFNLayer, mb: Microbatch, plan: Plan) -> ReplyRows:
        """This worker's share of ``mb`` under ``plan`` (its copies waited for, its slots fenced after)."""
        if not plan.primary_only:
            self.migrator.commit(plan)
        timed = self.trace.enabled and self.device.type == "cuda"
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        self._rows_ns = 0
        if self.cfg.exact and mb.hidden is None and mb.topk_ids.is_cpu and hasattr(mb.source, "gather_into"):
            # a row per pair of this worker, as vLLM computes it (afore.ffn.exact), routed on the host
            # ids (the shm transport): one copy in, one out, no other host sync
            reply = ReplyRows(*layer.forward_pairs_host(mb.source.gather_into, mb.topk_ids, mb.topk_weights, plan,
                                                        mb.splits))
        elif self.cfg.exact:  # a row per pair of this worker, as vLLM computes it (afore.ffn.exact)
            ids, weights = (t.to(self.device) for t in (mb.topk_ids, mb.topk_weights))
            reply = ReplyRows(*layer.forward_pairs(mb.rows_for, ids, weights, plan, mb.splits))
        elif mb.hidden is not None:  # the transport delivered every row (torch): reply densely
            partial = layer.forward(mb.hidden, mb.topk_ids, mb.topk_weights, plan, self.cfg.rank)
            reply = ReplyRows.dense(partial)
        elif layer.sparse_on_host:  # sparse on a CPU pool: the bookkeeping in numpy, one pass
            reply = ReplyRows(*layer.forward_sparse(mb.rows_for, mb.topk_ids, mb.topk_weights, plan))
        else:  # sparse on a GPU pool fed from host buffers (shm): routed on the host, one sync
            # a page-locked segment: the rows go to the device by DMA from the request slots and the
            # output straight into the reply slots (the send waits for the stream), no host copy of rows
            direct = (getattr(mb.source, "device_copies", False) and getattr(self.connector, "sends_device_rows", False)
                      and layer.pool.dtype == mb.source.end.layout.torch_dtype)
            gather, rows = mb.source.gather_into, (mb.source.copy_to if direct else None)
            if self.trace.enabled:  # stamp when this worker's rows are in pinned memory (or their copies enqueued)
                def gather(tokens, out, _gather=gather):
                    _gather(tokens, out)
                    self._rows_ns = time.perf_counter_ns()

                if rows is not None:
                    def rows(dst, _rows=rows):
                        _rows(dst)
                        self._rows_ns = time.perf_counter_ns()
            reply = ReplyRows(*layer.forward_host_routed(gather, mb.topk_ids, mb.topk_weights, plan, rows=rows,
                                                         device_out=direct))
        if timed:
            end.record()
            self._events = (start, end)
        if not plan.primary_only:
            self.migrator.release(plan)
        return reply

    def _observe_records(self) -> None:
        """The migration records of the targets committed so far into the metrics and the
        scheduler's measured window (after the reply: the plan of a later target reads them)."""
        for record in self.migrator.drain_records():
            self.metrics.observe(record)
            if self.window_reporter is not None:
                self.window_reporter.report(record.window_ms)

    def run(self, report_s: float = 10.0) -> None:
        """Serve targets until ``stop_event`` is set (SIGTERM in ``main``); logs the plan counters
        every ``report_s`` seconds while targets come in, and at the end."""
        next_report, reported = time.monotonic() + report_s, None
        self.defer_bookkeeping = True
        try:
            while not self.stop_event.is_set():
                mb = self.connector.recv(timeout_s=0.2)
                if mb is not None:
                    self.step(mb)
                elif self._after:  # idle: nothing deferred waits longer than one poll
                    self.flush_bookkeeping()
                if time.monotonic() > next_report:
                    line = self.metrics.summary()
                    if line != reported:
                        log.info("worker %d: %s", self.cfg.rank, line)
                    next_report, reported = time.monotonic() + report_s, line
        finally:
            self.flush_bookkeeping()
            self.defer_bookkeeping = False
            log.info("worker %d stopped: %s", self.cfg.rank, self.metrics.summary())

    def close(self) -> None:
        self.trace.flush()
        if self.window_reporter is not None:
            self.window_reporter.close()
        if self.slot_reporter is not None:
            self.slot_reporter.close()
        self.migrator.close()
        self.connector.close()
        if self.plan_source is not None:
            self.plan_source.close()
        if self.policy_reader is not None:
            self.policy_reader.close()


def serve_worker(cfg: FFNWorkerConfig) -> int:
    """Process body: build the worker, serve until SIGTERM/SIGINT, clean up. Returns the exit code.

    A peer that goes away (a transport error) ends the worker: an error (exit 1), unless a stop
    was under way (``STOP_NOTICE`` from ``afore serve``, or SIGTERM/SIGINT already received, as
    Ctrl-C on a worker run by hand with its peers), in which case vLLM's side closed its
    connections on purpose (exit 0)."""
    stopping = threading.Event()
    signal.signal(STOP_NOTICE, lambda signum, frame: stopping.set())  # before the long start (load, connect)
    worker = FFNWorker(cfg)

    def stop(signum, frame):
        worker.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        worker.run()
    except RuntimeError as exc:  # a peer went away (transport error): fail fast, no traceback spam
        if stopping.is_set() or worker.stop_event.is_set():
            log.info("FFN worker %d: the attention side closed its connections (stopping)", cfg.rank)
            return 0
        log.error("FFN worker %d stopping: %s", cfg.rank, str(exc).splitlines()[0])
        return 1
    finally:
        worker.close()
    return 0


def exit_process(code: int) -> None:
    """End a worker process now, after flushing logs and output.

    The transport's receive thread may sit in a receive that has no timeout (a worker waits
    for requests indefinitely) and cannot be interrupted; interpreter teardown would then
    wait on it, or on the communicators' destructors, and the process would have to be
    killed. Everything that outlives the process (shared-memory segments, the metrics port)
    is released by ``FFNWorker.close`` before this."""
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run_and_exit(cfg: FFNWorkerConfig) -> None:
    """Process body of a worker: serve, then ``exit_process`` on every path (an error is logged
    with its traceback and exits 1)."""
    try:
        code = serve_worker(cfg)
    except BaseException:  # noqa: BLE001 - anything: the process ends here either way
        log.exception("FFN worker %d failed", cfg.rank)
        code = 1
    exit_process(code)


def _process_main(cfg_bytes: bytes) -> None:
    run_and_exit(msgspec.json.decode(cfg_bytes, type=FFNWorkerConfig))


def start_ffn_workers(configs: list[FFNWorkerConfig]) -> list[mp.Process]:
    """Spawn one process per config (fresh interpreters: safe with CUDA)."""
    ctx = mp.get_context("spawn")
    procs = []
    for cfg in configs:
        proc = ctx.Process(target=_process_main, args=(msgspec.json.encode(cfg),), name=f"afore-ffn-{cfg.rank}", daemon=False)
        proc.start()
        procs.append(proc)
    return procs


def stop_ffn_workers(procs: list[mp.Process], timeout_s: float = 10.0) -> None:
    """SIGTERM every worker, wait up to ``timeout_s``, then kill what is left."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
