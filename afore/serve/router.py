"""Request routing across the attention engines (vLLM data-parallel ranks) by token cost.

vLLM's default data-parallel balancing picks the engine with the fewest requests (``waiting +
running``, vLLM 0.32 ``DPLBAsyncMPClient.get_core_engine_for_request``; ties rotate). With MoE
and attention-FFN disaggregation every engine's microbatch meets the others' at the FFN pool
each layer, so the step lasts as long as the engine with the most *tokens*: a 2,000-token prompt
and a 200-token prompt are one request each to a count balancer and 10x apart in cost (seed 001).

``RequestRouter`` keeps, per engine, the outstanding token cost of the requests it routed:

    cost(request) = prompt_tokens + expected_decode_tokens    (tokens)
    expected decode = min(max_tokens, decode_estimate) when max_tokens is given, else decode_estimate

and sends a request to the engine minimising

    outstanding[a] + cost - locality_weight * cost * local_share[a]

where local_share[a] (0..1) is the share of the request's predicted expert mass whose primaries
live on the FFN node paired with engine a's attention node (two-node role split with several
node pairs; ``engine_local`` bool[A, E]). With locality_weight 0 this is pure token-cost
balancing. Outstanding cost drops as the request progresses (``progress``) and is released when
it ends (``finish``). Policies: ``token-cost`` (above), ``vllm-count`` (vLLM's default),
``round-robin``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ROUTING_POLICIES = ("token-cost", "vllm-count", "round-robin")


@dataclasses.dataclass
class RoutedRequest:
    engine: int
    prompt_tokens: int
    expected_decode: int
    done_tokens: int = 0      # prompt + decode tokens already processed

    @property
    def remaining(self) -> int:
        return max(self.prompt_tokens + self.expected_decode - self.done_tokens, 0)


class RequestRouter:
    """Chooses the attention engine of each request; keeps per-engine outstanding load."""

    def __init__(self, num_engines: int, policy: str = "token-cost", decode_estimate: int = 128,
                 locality_weight: float = 0.0, engine_local: np.ndarray | None = None) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines: expected >= 1, got {num_engines}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")
        if decode_estimate < 0:
            raise ValueError(f"decode_estimate: expected >= 0 tokens, got {decode_estimate}")
        if not locality_weight >= 0:
            raise ValueError(f"locality_weight: expected >= 0, got {locality_weight}")
        if engine_local is not None:
            engine_local = np.asarray(engine_local, bool)
            if engine_local.ndim != 2 or engine_local.shape[0] != num_engines:
                raise ValueError(f"engine_local: expected bool[{num_engines}, E], got shape {engine_local.shape}")
        self.num_engines, self.policy = num_engines, policy
        self.decode_estimate, self.locality_weight, self.engine_local = decode_estimate, locality_weight, engine_local
        self.requests: dict[str, RoutedRequest] = {}
        self.outstanding_tokens = np.zeros(num_engines, np.int64)   # sum of remaining cost
        self.outstanding_requests = np.zeros(num_engines, np.int64)
        self.routed_tokens = np.zeros(num_engines, np.int64)        # total cost ever routed
        self.routed_requests = np.zeros(num_engines, np.int64)
        self._next = 0

    def expected_decode(self, max_tokens: int | None) -> int:
        return self.decode_estimate if max_tokens is None else min(int(max_tokens), self.decode_estimate)

    def route(self, request_id: str, prompt_tokens: int, max_tokens: int | None = None,
              expert_mass: np.ndarray | None = None) -> int:
        """The engine for a new request. expert_mass: float[E] predicted expert shares (any scale),
        used only with locality_weight > 0 and engine_local. Raises ValueError on a reused id or
        negative counts."""
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already routed")
        if prompt_tokens < 0 or (max_tokens is not None and max_tokens < 0):
            raise ValueError(f"prompt_tokens, max_tokens: expected >= 0, got {prompt_tokens}, {max_tokens}")
        decode = self.expected_decode(max_tokens)
        cost = int(prompt_tokens) + decode
        a = self._choose(cost, expert_mass)
        self.requests[request_id] = RoutedRequest(a, int(prompt_tokens), decode)
        self.outstanding_tokens[a] += cost
        self.outstanding_requests[a] += 1
        self.routed_tokens[a] += cost
        self.routed_requests[a] += 1
        return a

    def _choose(self, cost: int, expert_mass: np.ndarray | None) -> int:
        n = self.num_engines
        if self.policy == "round-robin":
            a = self._next % n
            self._next += 1
            return a
        start = self._next % n   # rotating scan start: ties do not favour engine 0
        self._next += 1
        order = (start + np.arange(n)) % n
        if self.policy == "vllm-count":
            score = self.outstanding_requests.astype(np.float64)
        else:
            score = (self.outstanding_tokens + cost).astype(np.float64)
            if self.locality_weight > 0 and self.engine_local is not None and expert_mass is not None:
                score -= self.locality_weight * cost * self.local_share(expert_mass)
        return int(order[np.argmin(score[order])])

    def local_share(self, expert_mass: np.ndarray) -> np.ndarray:
        """float64[A]: share of ``expert_mass`` (float[E]) local to each engine's FFN node."""
        if self.engine_local is None:
            return np.zeros(self.num_engines)
        mass = np.asarray(expert_mass, np.float64)
        if mass.shape != (self.engine_local.shape[1],) or np.any(mass < 0):
            raise ValueError(f"expert_mass: expected non-negative float[{self.engine_local.shape[1]}], got shape {mass.shape}")
        total = mass.sum()
        return self.engine_local @ mass / total if total > 0 else np.zeros(self.num_engines)

    def progress(self, request_id: str, tokens: int) -> None:
        """``tokens`` more tokens of the request were processed (prefill chunk or decode)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not routed")
        before = req.remaining
        req.done_tokens += int(tokens)
        self.outstanding_tokens[req.engine] -= before - req.remaining

    def finish(self, request_id: str) -> int:
        """The request ended (any reason): release its load. Returns its engine."""
        req = self.requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"request_id: {request_id!r} is not routed")
        self.outstanding_tokens[req.engine] -= req.remaining
        self.outstanding_requests[req.engine] -= 1
        return req.engine

    def snapshot(self) -> dict:
        return {"policy": self.policy, "outstanding_tokens": self.outstanding_tokens.tolist(),
                "outstanding_requests": self.outstanding_requests.tolist(),
                "routed_tokens": self.routed_tokens.tolist(), "routed_requests": self.routed_requests.tolist()}
