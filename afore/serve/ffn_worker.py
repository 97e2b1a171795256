"""FFN worker process of ``afore serve``: gather a target, run this worker's share, answer.

Loop (one process per FFN worker): read the next target that all A attention
workers sent, get its plan (from the plan source when a scheduler runs, else the
always-valid primary-only plan, counted as a miss), take this worker's exact
share of the token-expert pairs (paper eq. 11: every worker numbers the
occurrences of expert e in the same gathered routing order and takes its
disjoint ordinal interval), compute, and send each attention worker the partial
output for its rows. The sum over workers equals the monolithic MoE layer.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

import msgspec
import numpy as np
import torch

from afore.config import ClusterShape
from afore.ffn.layer import FFNLayer
from afore.migrator.copy_engine import make_copy_engine
from afore.migrator.migrator import HostWeightsSource, Migrator
from afore.migrator.slot_pool import SlotPool
from afore.scheduler.plan import Plan, Target, primary_only_plan
from afore.scheduler.plan_codec import decode_plan, encode_plan
from afore.serve.ffn_link import DTYPES, FFNLink, PlanDecisions, Request
from afore.serve.model_info import load_routed_experts, read_model_info

log = logging.getLogger("afore.ffn_worker")


class FFNWorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    worker: int
    ffn_endpoints: list[str]
    attn_endpoints: list[str]
    redundant_slots: int = 2
    m_tile: int = 16
    device: str = "cpu"
    dtype: str = "float32"       # expert weights' dtype (the served model's dtype)
    plan_ring: str = ""          # PlanRing segment name ("" = primary-only plans)
    plan_timeout_ms: float = 2.0
    control_endpoints: list[str] = []  # plan-decision sockets of workers 1..F-1 (entry 0 unused)
    leader_pid: int = 0
    decision_timeout_s: float = 60.0


class ExpertShard:
    """This worker's routed experts for every MoE layer, driven by the FFN side's own parts.

    Per layer a ``SlotPool`` (primaries, then R redundant slots), one ``Migrator`` that
    applies the plans' copies (sources: the checkpoint's expert weights in host memory,
    ``HostWeightsSource``) and one ``FFNLayer`` that computes this worker's exact share.
    """

    def __init__(self, model: str, device: str, shape: ClusterShape, worker: int, dtype: torch.dtype = torch.float32):
        self.info = read_model_info(model)
        self.shape = shape
        self.worker = worker
        self.device = torch.device(device)
        self.host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pools: dict[int, SlotPool] = {}
        for pos, layer in enumerate(self.info.moe_layers):
            w13, w2 = load_routed_experts(self.info, layer, dtype)
            self.host[pos] = (w13, w2)
            pool = SlotPool(shape, worker, hidden=w13.shape[2], intermediate=w13.shape[1] // 2, dtype=dtype, device=self.device)
            pool.load_primaries(w13, w2)
            pools[pos] = pool
        self.pools = pools
        self.migrator = Migrator(shape, worker, pools, make_copy_engine(self.device), HostWeightsSource(self.host))
        self.layers = {pos: FFNLayer(pool) for pos, pool in pools.items()}
        self.rejected = 0

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                plan: Plan) -> torch.Tensor:
        """Partial output [N, H] (hidden's dtype) of this worker's pairs under ``plan``.

        A plan the migrator rejects (stale, out of order, a replica neither resident nor
        copied) is replaced by the primary-only plan of the same target, never half-applied.
        """
        if not self.migrator.prepare(plan):
            self.rejected += 1
            log.warning("plan seq %d rejected: %s", plan.seq, getattr(self.migrator, "last_rejection", "?"))
            plan = primary_only_plan(self.shape, plan.demand, plan.target, plan.seq)
            if not self.migrator.prepare(plan):
                raise RuntimeError(f"primary-only plan seq {plan.seq} rejected: {self.migrator.last_rejection}")
        self.migrator.commit(plan)
        pool = self.pools[layer]
        x = hidden.to(self.device, pool.dtype)
        out = self.layers[layer].forward(x, topk_ids.to(self.device), topk_weights.to(self.device), plan, self.worker)
        self.migrator.release(plan)
        return out.to(hidden.dtype)


class PoolView:
    """Worker 0's view of every worker's redundant slots, to accept a plan only if it is valid
    on all workers (the per-worker ``Migrator`` checks only its own slots, and a plan rejected
    by one worker but run by another would break the exact partition).

    ``resident[layer]``: int32[F, R], the expert each redundant slot holds once every applied
    plan's copies ran (-1 = empty). Applied plans are exactly the ones worker 0 announced.
    """

    def __init__(self, shape: ClusterShape):
        self.shape = shape
        self.primaries = shape.primary_counts
        self.resident = {layer: np.full((shape.num_workers, shape.redundant_slots), -1, np.int32)
                         for layer in range(shape.num_layers)}

    def accept(self, plan: Plan) -> str | None:
        """Why ``plan`` cannot run on every worker, or None (and its copies are recorded)."""
        shape, layer = self.shape, plan.target.layer
        e, f = shape.num_experts, shape.num_workers
        if plan.assignment.shape != (e, f) or plan.slot.shape != (e, f) or plan.copies.ndim != 2:
            return "plan arrays have the wrong shape"
        owner = shape.primary_owner
        projected = self.resident[layer].copy()
        for ex, src, dst, slot in plan.copies.tolist():
            r = slot - int(self.primaries[dst]) if 0 <= dst < f else -1
            if not (0 <= ex < e and 0 <= r < shape.redundant_slots) or src != owner[ex]:
                return f"copy ({ex}, {src}, {dst}, {slot}) is not a primary-to-redundant-slot copy"
            projected[dst, r] = ex
        for ex, w in zip(*np.nonzero(plan.assignment > 0)):
            if w == owner[ex]:
                continue
            r = int(plan.slot[ex, w]) - int(self.primaries[w])
            if not 0 <= r < shape.redundant_slots or projected[w, r] != ex:
                return f"expert {ex} has work on worker {w} in slot {plan.slot[ex, w]}, which will not hold it"
        self.resident[layer] = projected
        return None


class FFNWorker:
    def __init__(self, cfg: FFNWorkerConfig):
        self.cfg = cfg
        info = read_model_info(cfg.model)
        self.shape = ClusterShape(num_experts=info.num_experts, num_workers=len(cfg.ffn_endpoints),
                                  num_layers=len(info.moe_layers), redundant_slots=cfg.redundant_slots,
                                  m_tile=cfg.m_tile, top_k=info.top_k)
        self.shard = ExpertShard(cfg.model, cfg.device, self.shape, cfg.worker, DTYPES[cfg.dtype])
        self.link = FFNLink(cfg.worker, cfg.ffn_endpoints[cfg.worker], cfg.attn_endpoints)
        self.plans = None
        if cfg.plan_ring and cfg.worker == 0:  # the leader alone reads plans (PlanDecisions)
            from afore.migrator.plan_source import RingPlanSource

            self.plans = RingPlanSource(cfg.plan_ring, cfg.worker, self.shape)
        self.decisions = None
        if self.shape.num_workers > 1 and cfg.control_endpoints:
            if len(cfg.control_endpoints) != self.shape.num_workers:
                raise ValueError(f"control_endpoints: expected {self.shape.num_workers} entries, got {len(cfg.control_endpoints)}")
            self.decisions = PlanDecisions(cfg.worker, cfg.control_endpoints, cfg.leader_pid)
        self.view = PoolView(self.shape)
        self.plans_refused = 0
        self.targets = 0
        self.plan_misses = 0
        self.stopping = False

    def plan_for(self, target: Target, seq: int, demand: np.ndarray) -> Plan:
        plan = None
        if self.decisions is not None and not self.decisions.leader:
            data = self.decisions.wait(seq, self.cfg.decision_timeout_s)
            if data:
                plan = decode_plan(data, self.shape)
                if plan.seq != seq or plan.target != target or not np.array_equal(plan.demand, demand):
                    raise RuntimeError(f"target seq {seq}: FFN worker 0 announced a plan for seq {plan.seq} {plan.target}")
        elif self.plans is not None:
            plan = self.plans.get(target, seq, self.cfg.plan_timeout_ms / 1e3)
            if plan is not None and not np.array_equal(plan.demand, demand):
                plan = None  # a plan for other demand cannot partition these pairs exactly
            if plan is not None:
                reason = self.view.accept(plan)
                if reason is not None:
                    # e.g. it relies on a copy of a plan that arrived too late and was not run
                    self.plans_refused += 1
                    log.debug("plan seq %d refused: %s", seq, reason)
                    plan = None
        if self.decisions is not None and self.decisions.leader:
            self.decisions.announce(seq, encode_plan(plan) if plan is not None else b"")
        if plan is None:
            self.plan_misses += 1
            plan = primary_only_plan(self.shape, demand, target, seq)
        return plan

    def step(self, requests: list[Request]) -> None:
        head = requests[0].head
        hidden = torch.cat([r.hidden for r in requests])
        ids = torch.cat([r.topk_ids for r in requests])
        weights = torch.cat([r.topk_weights for r in requests])
        flat = ids.reshape(-1).to(torch.int64)
        flat = flat[(flat >= 0) & (flat < self.shape.num_experts)]
        demand = torch.bincount(flat, minlength=self.shape.num_experts).numpy()
        target = Target(head.step, head.layer, head.microbatch)
        plan = self.plan_for(target, head.seq, demand)
        out = self.shard.forward(head.layer, hidden, ids, weights, plan)
        sizes = [r.head.num_tokens for r in requests]
        self.link.send_outputs(requests, list(torch.split(out.cpu(), sizes)))
        self.targets += 1

    def stats(self) -> str:
        return (f"targets {self.targets}, plans run {self.targets - self.plan_misses}, primary-only {self.plan_misses}, "
                f"refused {self.plans_refused}, migrator rejected {self.shard.rejected}")

    def run(self) -> None:
        reported, next_report = -1, time.monotonic() + 10.0
        while not self.stopping:
            if time.monotonic() > next_report and self.targets != reported:
                log.info("worker %d: %s", self.cfg.worker, self.stats())
                reported, next_report = self.targets, time.monotonic() + 10.0
            requests = self.link.recv_target(timeout_ms=100)
            if requests is None:
                continue
            try:
                self.step(requests)
            except Exception as exc:  # answer the attention workers rather than let them time out
                log.exception("target seq %d failed", requests[0].head.seq)
                self.link.send_error(requests, f"{type(exc).__name__}: {exc}")
        log.info("worker %d stopped: %s", self.cfg.worker, self.stats())
        self.link.close()
        if self.decisions is not None:
            self.decisions.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="afore serve's FFN worker (started by the launcher)")
    parser.add_argument("--config", required=True, help="FFNWorkerConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s afore-ffn %(message)s")
    cfg = msgspec.json.decode(args.config, type=FFNWorkerConfig)
    torch.set_num_threads(1)
    worker = FFNWorker(cfg)

    def stop(signum, frame):
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"afore-ffn worker {cfg.worker} ready", flush=True)
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
