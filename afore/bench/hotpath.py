"""`python -m afore.bench.hotpath`: the per-target CPU cost of afore's decode control path.

One process, no vLLM, no transport: the pieces that serving runs per decode target are driven in
the order a target meets them, each timed alone (``time.perf_counter_ns``, median over targets):

- ``demand_emit``: ``DemandEmitter.emit`` (count the ids, put into the shared-memory mailbox);
- ``sched_step``: one ``SchedulerService.step`` (take the complete target from the mailbox,
  policy, encode, publish on the plan ring, metrics), and its parts ``sched_policy``
  (``policy.plan``) and ``sched_publish`` (``PlanRing.publish``: encode + ring copy), and
  ``sched_to_published``: from the step's start to its publish returned (what a worker waits for);
- ``ffn_candidate``: ``FFNWorker._candidate`` per worker (ring read + decode, migrator.prepare,
  stage_plan, routed counts, commit_check) with the plan already published, so no waiting;
- ``ffn_compute``: ``FFNWorker._compute`` (the expert compute: on the host pool, for scale; on
  a GPU (``--device cuda``) the shm transport's host-routed step, and its parts ``ffn_route``
  (``host_route``: eq. 11 on the host ids), ``ffn_gather`` (this worker's rows into pinned
  memory) and ``ffn_device`` (from the gathered rows to the reply rows back in pinned memory:
  the copies, the graph replay and the one synchronisation), with ``ffn_replay_gpu`` the
  replay's GPU time alone (CUDA events; host-fed steps: with their copies in and out));
- ``ffn_metrics``: ``FFNMetrics.observe_target`` and the migration records (worker 0, which also
  records balance; serving runs them after the reply, off the critical path);
- ``ffn_settle``: ``FFNWorker._settle`` after a passed vote.

The FFN workers are real ``FFNWorker`` objects on the tiny checkpoint (E=8, k=2, H=64, 3 MoE
layers by default) with a null connector; the scheduler is a real ``SchedulerService`` with the
``afore`` policy (C++ core). Prints a markdown table; ``--json PATH`` writes the medians too.
Costs, not latencies: nothing here waits on another process.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import numpy as np
import torch

STAGES = ("demand_emit", "sched_step", "sched_to_published", "sched_policy", "sched_publish", "ffn_candidate", "ffn_compute",
          "ffn_metrics", "ffn_settle")
GPU_STAGES = ("ffn_route", "ffn_gather", "ffn_device", "ffn_replay_gpu")


class _NullConnector:
    """The FFN end of a transport that carries nothing (the harness hands targets in itself)."""

    queued = 0
    store = None

    def peek(self):
        return None

    def agree(self, flag: bool, digest: int = 0) -> bool:
        return flag

    def send(self, mb, reply) -> None:
        pass

    def close(self) -> None:
        pass


class _HostRows:
    """The rows of a target as the shm transport hands them to a CPU worker: a zero-copy view of
    the sender's buffer (``Microbatch.rows_for``), so ``_compute`` takes the sparse host path."""

    zero_copy = True

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden

    def view_for(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hidden

    def gather_into(self, tokens: torch.Tensor, out: torch.Tensor) -> None:
        torch.index_select(self.hidden, 0, tokens, out=out)


def _timed(stats: dict, name: str, fn, *args):
    t0 = time.perf_counter_ns()
    out = fn(*args)
    stats.setdefault(name, []).append(time.perf_counter_ns() - t0)
    return out


def run(targets: int = 600, tokens: int = 8, num_ffn: int = 2, skew: float = 1.5, warmup: int = 60,
        seed: int = 0, experts: int = 0, top_k: int = 0, hidden: int = 0, intermediate: int = 0,
        device: str = "cpu") -> dict[str, float]:
    """Median us per target of every stage in ``STAGES`` over ``targets`` decode targets.
    ``experts``, ``top_k``, ``hidden``, ``intermediate``: the tiny checkpoint's shape (0 = its
    default; 128, 8, 2048, 768 for Qwen3-30B-A3B's experts). ``device``:
    where the FFN workers' pools are ("cuda": bf16, the shm transport's host-routed step)."""
    from afore.attention.demand import DemandEmitter
    from afore.config import ClusterShape
    from afore.ffn.reference import random_routing
    from afore.ffn.worker import FFNWorker, FFNWorkerConfig
    from afore.models.checkpoint import read_model_spec
    from afore.models.tiny import build_tiny_checkpoint
    from afore.plan import Target
    from afore.scheduler.service import SchedulerService, ServiceConfig
    from afore.transport.base import Microbatch

    overrides = {name: value for name, value in (("num_experts", experts), ("num_experts_per_tok", top_k),
                                                 ("hidden_size", hidden), ("moe_intermediate_size", intermediate))
                 if value}
    model = str(build_tiny_checkpoint("qwen3_moe", seed=0, **overrides))
    spec = read_model_spec(model)
    shape = ClusterShape(num_experts=spec.num_experts, num_workers=num_ffn, num_layers=len(spec.moe_layer_indices),
                         redundant_slots=2, top_k=spec.top_k)
    tag = uuid.uuid4().hex[:8]
    cfg = ServiceConfig(shape=shape, mailbox=f"afore-hp-mb-{tag}", ring=f"afore-hp-ring-{tag}", num_producers=1,
                        num_microbatches=1, run_lag=0, deadline_ms=5000.0)
    service = SchedulerService(cfg)

    class Worker(FFNWorker):
        def _connect(self):
            return _NullConnector()

    cuda = device == "cuda"
    if cuda and num_ffn != 1:  # GPU workers open their peers' pools by CUDA IPC, which one process cannot
        raise ValueError(f"num_ffn: expected 1 with device cuda (CUDA IPC between workers of one process), got {num_ffn}")
    store = None
    port = 29600
    if cuda:  # the workers publish their pools' CUDA IPC handles in a TCPStore (afore serve hosts it)
        import datetime
        import socket

        import torch.distributed as dist

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
    dtype = "bfloat16" if cuda else "float32"
    workers = [Worker(FFNWorkerConfig(rank=r, num_ffn=num_ffn, num_attention=1, model=model, plan_ring=cfg.ring,
                                      shape=shape, timeout_s=10.0, device=device, dtype=dtype, port=port))
               for r in range(num_ffn)]
    emitter = DemandEmitter(cfg.mailbox, shape.num_experts, 0)
    rng = np.random.default_rng(seed)
    stats: dict[str, list[int]] = {}
    if cuda:
        _time_gpu_parts(stats)
    policy_plan, ring_publish = service.policy.plan, service.ring.publish

    def timed_plan(obs):
        return _timed(stats, "sched_policy", policy_plan, obs)

    published = [0]

    def timed_publish(plan, timeout_s=5.0):
        out = _timed(stats, "sched_publish", ring_publish, plan, timeout_s)
        published[0] = time.perf_counter_ns()
        return out

    service.policy.plan, service.ring.publish = timed_plan, timed_publish
    used = 0
    try:
        for seq in range(targets + warmup):
            if seq == warmup:
                stats.clear()
            target = Target.from_seq(seq, shape.num_layers, 1)
            ids, weights = random_routing(tokens, shape, rng, skew=skew)
            hidden = torch.randn(tokens, spec.hidden_size, dtype=torch.bfloat16 if cuda else torch.float32)
            _timed(stats, "demand_emit", emitter.emit, target.step, target.layer, target.microbatch, seq, ids)
            step_start = time.perf_counter_ns()
            assert _timed(stats, "sched_step", service.step, 1.0) == 1
            stats.setdefault("sched_to_published", []).append(published[0] - step_start)
            mb = Microbatch(target, seq, None, ids.to(torch.int32), weights.float(), [tokens],
                            source=_HostRows(hidden))
            for worker in workers:
                layer = worker.layers[target.layer]
                candidate = _timed(stats, "ffn_candidate", worker._candidate, mb)
                plan = candidate if candidate is not None else worker._primary_only(mb)
                used += candidate is not None
                _timed(stats, "ffn_compute", worker._compute, layer, mb, plan)
                if cuda:
                    _gpu_rest(stats)
                plan = _timed(stats, "ffn_settle", worker._settle, mb, candidate, candidate is not None)
                def metrics(plan=plan, worker=worker):  # after the reply in FFNWorker.step
                    worker.metrics.observe_target(plan, 1e-3, 0)
                    worker._observe_records()
                if worker.cfg.rank == 0:
                    _timed(stats, "ffn_metrics", metrics)
                else:
                    metrics()
    finally:
        for worker in workers:
            worker.close()
        service.close()
        if store is not None:
            del store
    out = {name: float(np.median(stats[name])) / 1e3 for name in STAGES + (GPU_STAGES if cuda else ())}
    out["plans_used_share"] = used / (len(workers) * (targets + warmup))
    return out


def _time_gpu_parts(stats: dict) -> None:
    """Time the parts of the host-routed GPU step (``ffn_route``, ``ffn_gather``, ``ffn_device``,
    ``ffn_replay_gpu``) by wrapping ``host_route``, the gather and the graph replay."""
    from afore.ffn import graphs, layer

    route = layer.host_route

    def timed_route(*args):
        return _timed(stats, "ffn_route", route, *args)

    layer.host_route = timed_route
    if layer._route_local is not None:  # the host-fed step's routing (FFNLayer._host_fed_step)
        native = layer._route_local

        def timed_native(*args):
            return _timed(stats, "ffn_route", native, *args)

        layer._route_local = timed_native
    gather = _HostRows.gather_into

    def timed_gather(self, tokens, out):
        _timed(stats, "ffn_gather", gather, self, tokens, out)
        stats["_gather_end"] = time.perf_counter_ns()

    _HostRows.gather_into = timed_gather
    def with_events(run):
        def timed(self, *args):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run(self, *args)
            end.record()
            stats["_replay_events"] = (start, end)
            return out

        return timed

    # the launched path's replay; the host-fed one: the copy in, the replay, the copy back, the wait
    graphs.StepGraphs.run = with_events(graphs.StepGraphs.run)
    graphs.StepGraphs.run_fed = with_events(graphs.StepGraphs.run_fed)


def _gpu_rest(stats: dict) -> None:
    """After a GPU ``_compute``: its device part (gathered rows -> reply rows in pinned memory)."""
    end = time.perf_counter_ns() - stats.pop("_gather_end", 0)
    # _compute's release after the step is in ffn_device too (a few us)
    stats.setdefault("ffn_device", []).append(end)
    events = stats.pop("_replay_events", None)
    if events is not None:
        events[1].synchronize()
        stats.setdefault("ffn_replay_gpu", []).append(int(events[0].elapsed_time(events[1]) * 1e6))


def markdown(result: dict[str, float]) -> str:
    lines = ["| stage | us per target (median) |", "|---|---|"]
    lines += [f"| {name} | {result[name]:.1f} |" for name in STAGES + GPU_STAGES if name in result]
    lines.append(f"| (plans used) | {result['plans_used_share']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m afore.bench.hotpath", description=__doc__.splitlines()[0])
    p.add_argument("--targets", type=int, default=600)
    p.add_argument("--tokens", type=int, default=8, help="tokens per decode target")
    p.add_argument("--ffn-workers", type=int, default=2)
    p.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0 = the tiny checkpoint's)")
    p.add_argument("--top-k", type=int, default=0, help="experts per token (0 = the tiny checkpoint's)")
    p.add_argument("--hidden", type=int, default=0, help="hidden size (0 = the tiny checkpoint's)")
    p.add_argument("--intermediate", type=int, default=0, help="expert width (0 = the tiny checkpoint's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the FFN workers' pools are")
    p.add_argument("--json", default="", help="write the medians here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.targets, args.tokens, args.ffn_workers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                 intermediate=args.intermediate, device=args.device)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": " ".join(["python -m afore.bench.hotpath", *(argv or sys.argv[1:])]), **result}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
