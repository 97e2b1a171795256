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
import torch.nn.functional as F

from afore.config import ClusterShape
from afore.ffn.partition import worker_pairs
from afore.scheduler.plan import Plan, Target, primary_only_plan
from afore.serve.ffn_link import FFNLink, Request
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
    plan_ring: str = ""          # PlanRing segment name ("" = primary-only plans)
    plan_timeout_ms: float = 2.0


def exact_share(topk_ids: torch.Tensor, assignment: np.ndarray, primary_owner: np.ndarray, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat pair positions and experts this worker executes (eq. 11, ``afore.ffn.partition``).

    topk_ids: int32[N, k] gathered routing; assignment: int[E, F] a[e, w]; primary_owner: int64[E].
    Returns (positions int64[P], experts int64[P]) in routing order.
    """
    pos = worker_pairs(topk_ids, torch.as_tensor(assignment), torch.as_tensor(primary_owner, dtype=torch.int64), worker)
    return pos, topk_ids.reshape(-1).to(torch.int64)[pos]


class ExpertShard:
    """Routed-expert weights of all MoE layers held by this worker (gated SiLU MLPs)."""

    def __init__(self, model: str, device: str, primary_owner: np.ndarray):
        self.info = read_model_info(model)
        self.primary_owner = primary_owner
        self.device = torch.device(device)
        self.w13: list[torch.Tensor] = []
        self.w2: list[torch.Tensor] = []
        for layer in self.info.moe_layers:
            w13, w2 = load_routed_experts(self.info, layer)
            self.w13.append(w13.to(self.device))
            self.w2.append(w2.to(self.device))

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                plan: Plan, worker: int) -> torch.Tensor:
        """Partial output [N, H] (fp32) of this worker's pairs under ``plan``."""
        n, h = hidden.shape
        out = torch.zeros(n, h, dtype=torch.float32, device=self.device)
        if n == 0:
            return out
        k = topk_ids.shape[1]
        pos, experts = exact_share(topk_ids, plan.assignment, self.primary_owner, worker)
        if pos.numel() == 0:
            return out
        tokens = pos // k
        weights = topk_weights.reshape(-1)[pos].to(torch.float32)
        x = hidden.to(self.device, torch.float32)
        w13, w2 = self.w13[layer], self.w2[layer]
        bounds = torch.cumsum(torch.bincount(experts, minlength=w13.shape[0]), 0).tolist()
        order = torch.argsort(experts, stable=True)
        start = 0
        for e, end in enumerate(bounds):
            if end == start:
                continue
            sel = order[start:end]
            start = end
            rows = tokens[sel]
            gate_up = x[rows] @ w13[e].to(torch.float32).t()
            g, u = gate_up.chunk(2, dim=-1)
            y = (F.silu(g) * u) @ w2[e].to(torch.float32).t()
            out.index_add_(0, rows, y * weights[sel, None])
        return out


class FFNWorker:
    def __init__(self, cfg: FFNWorkerConfig):
        self.cfg = cfg
        info = read_model_info(cfg.model)
        self.shape = ClusterShape(num_experts=info.num_experts, num_workers=len(cfg.ffn_endpoints),
                                  num_layers=len(info.moe_layers), redundant_slots=cfg.redundant_slots,
                                  m_tile=cfg.m_tile, top_k=info.top_k)
        self.shard = ExpertShard(cfg.model, cfg.device, self.shape.primary_owner)
        self.link = FFNLink(cfg.worker, cfg.ffn_endpoints[cfg.worker], cfg.attn_endpoints)
        self.plans = None
        if cfg.plan_ring:
            from afore.migrator.plan_source import RingPlanSource

            self.plans = RingPlanSource(cfg.plan_ring, cfg.worker, self.shape)
        self.targets = 0
        self.plan_misses = 0
        self.stopping = False

    def plan_for(self, target: Target, seq: int, demand: np.ndarray) -> Plan:
        plan = None
        if self.plans is not None:
            plan = self.plans.get(target, seq, self.cfg.plan_timeout_ms / 1e3)
            if plan is not None and not np.array_equal(plan.demand, demand):
                plan = None  # a plan for other demand cannot partition these pairs exactly
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
        out = self.shard.forward(head.layer, hidden, ids, weights, plan, self.cfg.worker)
        sizes = [r.head.num_tokens for r in requests]
        self.link.send_outputs(requests, list(torch.split(out.cpu(), sizes)))
        self.targets += 1

    def run(self) -> None:
        while not self.stopping:
            requests = self.link.recv_target(timeout_ms=100)
            if requests is None:
                continue
            try:
                self.step(requests)
            except Exception as exc:  # answer the attention workers rather than let them time out
                log.exception("target seq %d failed", requests[0].head.seq)
                self.link.send_error(requests, f"{type(exc).__name__}: {exc}")
        self.link.close()


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
