"""Request-level simulator of A data-parallel attention engines in front of one FFN pool (AFD).

Used by ``afore bench affinity`` to measure what request routing (``afore.serve.router``) does to
TTFT and TPOT. Pure Python/numpy; no processes.

Model (times in ms):
- Requests arrive at given times with a prompt length and a decode length (tokens); the router
  picks an engine at arrival. Each engine schedules like vLLM's chunked prefill: per step, one
  token for each running request past its prefill, then prefill chunks of running, then waiting
  requests (FIFO) up to ``max_batched_tokens`` tokens and ``max_seqs`` sequences.
- Engines step together: every MoE layer meets at the FFN pool, so one step lasts
      step_ms = num_layers * max(max_a attn_ms(tokens_a), ffn_ms(sum_a tokens_a)) + transfer_ms
  (two microbatches ping-pong, the slower stage sets the pace; an engine with fewer tokens
  waits), attn_ms(n) = attn_ms_per_token * n, ffn_ms = the calibrated grouped GEMM of an evenly
  balanced FFN pool (afore keeps the tile load near the mean) for n * top_k pairs.
- With node pairs (``engine_node`` and ``expert_node``), a pair whose expert's primary lives on
  another node's FFN pool crosses the inter-node link: transfer_ms adds remote bytes /
  inter-node bandwidth per layer (hidden row out and partial sum back, activation_bytes each).
- A request's first token comes at the end of the step that finishes its prefill (TTFT = that
  time - arrival); each later step emits one token; TPOT = (finish - first token) / (decode - 1).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from afore.serve.router import RequestRouter


@dataclasses.dataclass(frozen=True)
class SimRequest:
    arrival_ms: float
    prompt_tokens: int
    decode_tokens: int          # tokens actually generated (>= 1)
    max_tokens: int | None      # what the client asked for (the router's estimate uses it)
    expert_mass: np.ndarray | None = None   # float[E] the request's expert shares (for routing and locality)


@dataclasses.dataclass(frozen=True)
class StepModel:
    num_layers: int
    attn_ms_per_token: float     # per layer, per engine (ms/token)
    ffn_ms: object               # callable: total tokens of the step -> FFN stage ms per layer
    max_batched_tokens: int = 2048
    max_seqs: int = 256
    top_k: int = 8
    hidden_size: int = 2048
    activation_bytes: int = 2
    inter_node_gbps: float = 50.0


@dataclasses.dataclass
class _State:
    req: SimRequest
    engine: int
    prefilled: int = 0
    decoded: int = 0
    first_ms: float = float("nan")
    end_ms: float = float("nan")


def simulate_requests(requests: list[SimRequest], router: RequestRouter, model: StepModel,
                      engine_node: np.ndarray | None = None, expert_node: np.ndarray | None = None,
                      max_steps: int = 2_000_000) -> dict:
    """Run ``requests`` (sorted by arrival) through the engines; return per-request metrics.

    Returns {"ttft_ms": float64[N], "tpot_ms": float64[N] (NaN for single-token requests),
    "engine": int64[N], "engine_tokens": int64[A] (tokens processed per engine),
    "remote_pair_share": float, "steps": int, "makespan_ms": float}.
    """
    a_count = router.num_engines
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms)
    states: list[_State | None] = [None] * len(requests)
    waiting: list[list[int]] = [[] for _ in range(a_count)]
    running: list[list[int]] = [[] for _ in range(a_count)]
    engine_tokens = np.zeros(a_count, np.int64)
    remote_pairs = total_pairs = 0.0
    now, nxt, done, steps = 0.0, 0, 0, 0
    local = None
    if engine_node is not None and expert_node is not None:
        local = np.asarray(engine_node)[:, None] == np.asarray(expert_node)[None, :]   # bool[A, E]
    while done < len(requests):
        while nxt < len(order) and requests[order[nxt]].arrival_ms <= now:
            i = order[nxt]
            r = requests[i]
            a = router.route(str(i), r.prompt_tokens, r.max_tokens, r.expert_mass)
            states[i] = _State(r, a)
            waiting[a].append(i)
            nxt += 1
        if not any(waiting) and not any(running):
            now = requests[order[nxt]].arrival_ms
            continue
        scheduled: list[list[tuple[int, int]]] = []   # per engine: (request, tokens)
        for a in range(a_count):
            budget, plan = model.max_batched_tokens, []
            for i in running[a]:
                s = states[i]
                if s.prefilled >= s.req.prompt_tokens and budget > 0:
                    plan.append((i, 1))
                    budget -= 1
            for i in running[a]:
                s = states[i]
                left = s.req.prompt_tokens - s.prefilled
                if left > 0 and budget > 0:
                    take = min(left, budget)
                    plan.append((i, take))
                    budget -= take
            while waiting[a] and budget > 0 and len(running[a]) < model.max_seqs:
                i = waiting[a].pop(0)
                running[a].append(i)
                s = states[i]
                take = min(max(s.req.prompt_tokens, 1) - s.prefilled, budget)
                plan.append((i, take))
                budget -= take
            scheduled.append(plan)
        tokens = np.array([sum(t for _, t in plan) for plan in scheduled], np.int64)
        per_layer = max(float(tokens.max()) * model.attn_ms_per_token, float(model.ffn_ms(int(tokens.sum()))))
        transfer = 0.0
        if local is not None:
            remote = 0.0
            for a, plan in enumerate(scheduled):
                for i, t in plan:
                    mass = states[i].req.expert_mass
                    if mass is not None and mass.sum() > 0:
                        remote += t * model.top_k * (1.0 - float(local[a] @ mass) / float(mass.sum()))
            remote_pairs += remote
            total_pairs += float(tokens.sum()) * model.top_k
            # each remote pair: its hidden row out and a partial sum back over the inter-node link
            transfer = model.num_layers * remote * 2 * model.hidden_size * model.activation_bytes / (model.inter_node_gbps * 1e6)
        now += model.num_layers * per_layer + transfer
        steps += 1
        engine_tokens += tokens
        for a, plan in enumerate(scheduled):
            for i, t in plan:
                s = states[i]
                router.progress(str(i), t)
                if s.prefilled < max(s.req.prompt_tokens, 1):
                    s.prefilled += t
                    if s.prefilled >= max(s.req.prompt_tokens, 1):
                        s.first_ms, s.decoded = now, 1
                else:
                    s.decoded += 1
                if s.decoded >= s.req.decode_tokens and s.prefilled >= max(s.req.prompt_tokens, 1):
                    s.end_ms = now
                    running[a].remove(i)
                    router.finish(str(i))
                    done += 1
        if steps >= max_steps:
            raise RuntimeError(f"max_steps: {max_steps} steps without finishing {len(requests) - done} requests")
    ttft = np.array([s.first_ms - s.req.arrival_ms for s in states])
    tpot = np.array([(s.end_ms - s.first_ms) / (s.req.decode_tokens - 1) if s.req.decode_tokens > 1 else np.nan for s in states])
    return {"ttft_ms": ttft, "tpot_ms": tpot, "engine": np.array([s.engine for s in states], np.int64),
            "engine_tokens": engine_tokens, "remote_pair_share": remote_pairs / total_pairs if total_pairs else 0.0,
            "steps": steps, "makespan_ms": now}
