"""Per-token routing drawn from a mixture of token classes.

The measured traces hold counts, not per-token expert sets, so fan-out per token (how many FFN
workers one token touches) needs a model of which experts a token activates *together*. A
``TokenModel`` is the simplest such model: a token belongs to class c with probability
``weight[c]`` and draws its top-k experts without replacement from ``expert_prob[c]`` (Gumbel
top-k). Co-activation then comes only from tokens of a class sharing a distribution; within a
class the k draws are independent. Classes come from data (``afore.affinity.olmoe``: the token's
expert in an earlier layer, measured) or from a synthetic affinity (``semmoe_synthetic``).

Shapes: C classes, E experts; weight float64[C] (sums to 1), expert_prob float64[C, E] (rows sum
to 1).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class TokenModel:
    weight: np.ndarray       # float64[C]
    expert_prob: np.ndarray  # float64[C, E]
    source: str              # where the classes and distributions come from

    def __post_init__(self) -> None:
        w = np.asarray(self.weight, np.float64)
        p = np.asarray(self.expert_prob, np.float64)
        if w.ndim != 1 or w.size < 1 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"weight: expected a non-negative vector with a positive sum, got shape {w.shape}")
        if p.ndim != 2 or p.shape[0] != w.size or not np.all(np.isfinite(p)) or np.any(p < 0):
            raise ValueError(f"expert_prob: expected non-negative float[{w.size}, E], got shape {p.shape}")
        rows = p.sum(axis=1)
        w = np.where(rows > 0, w, 0.0)   # a class with no routed pairs never draws
        if w.sum() <= 0:
            raise ValueError("expert_prob: every class with weight has an all-zero row")
        object.__setattr__(self, "weight", w / w.sum())
        object.__setattr__(self, "expert_prob", p / np.where(rows > 0, rows, 1.0)[:, None])

    @property
    def num_experts(self) -> int:
        return self.expert_prob.shape[1]

    @property
    def num_classes(self) -> int:
        return self.weight.size

    def expert_load(self) -> np.ndarray:
        """float64[E]: expected share of the first draw per expert (sum 1)."""
        return self.weight @ self.expert_prob

    def sample(self, num_tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
        """int64[N, k]: top-k distinct experts of ``num_tokens`` tokens (row order = draw order)."""
        return self.draw(num_tokens, top_k, rng)[0]

    def draw(self, num_tokens: int, top_k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64[N, k], classes int64[N]): each token's top-k distinct experts and its class.

        A class whose distribution has fewer than k non-zero experts fills the rest uniformly
        from its zero-probability experts (the draw stays k distinct experts).
        """
        e = self.num_experts
        if not 1 <= top_k <= e:
            raise ValueError(f"top_k: expected in [1, {e}], got {top_k}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens: expected >= 0, got {num_tokens}")
        classes = rng.choice(self.num_classes, size=num_tokens, p=self.weight)
        with np.errstate(divide="ignore"):
            logp = np.log(self.expert_prob[classes])
        logp = np.where(np.isfinite(logp), logp, -1e30)
        keys = logp + rng.gumbel(size=(num_tokens, e))
        top = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1)
        return np.take_along_axis(top, order, axis=1).astype(np.int64), classes.astype(np.int64)

    def structure(self) -> dict:
        """How much a token's class says about its experts: mean per-class entropy against the
        entropy of the expert marginal (nats; equal = no co-activation structure)."""
        def entropy(p: np.ndarray) -> np.ndarray:
            with np.errstate(divide="ignore", invalid="ignore"):
                return -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)
        return {"class_entropy_nats": float(self.weight @ entropy(self.expert_prob)),
                "marginal_entropy_nats": float(entropy(self.expert_load())),
                "uniform_entropy_nats": float(np.log(self.num_experts))}


def semmoe_synthetic(num_experts: int, top_k: int, num_topics: int = 32, topic_experts: int | None = None,
                     home_mass: float = 0.9, zipf: float = 0.6, seed: int = 0) -> TokenModel:
    """A synthetic token-expert affinity of the strength Sem-MoE reports (not measured data).

    Each of ``num_topics`` token classes has a home set of ``topic_experts`` experts (default
    2 top_k) holding ``home_mass`` of its routing probability (Sem-MoE, DeepSeek-V2-Lite on
    ShareGPT: median cumulative activation of a token's top-k experts 0.833-0.976 across
    layers), the rest spread over all experts. Home sets are drawn around a topic centre on a
    ring of experts with random relabelling, so topics overlap as related topics do; topic
    weights are Zipf(``zipf``) so that expert load is skewed.
    """
    rng = np.random.default_rng(seed)
    m = topic_experts or min(num_experts, 2 * top_k)
    if not 1 <= m <= num_experts:
        raise ValueError(f"topic_experts: expected in [1, {num_experts}], got {m}")
    if not 0 <= home_mass <= 1:
        raise ValueError(f"home_mass: expected in [0, 1], got {home_mass}")
    relabel = rng.permutation(num_experts)
    prob = np.full((num_topics, num_experts), (1 - home_mass) / num_experts)
    for c in range(num_topics):
        centre = rng.integers(num_experts)
        home = relabel[(centre + np.arange(m) - m // 2) % num_experts]
        prob[c, home] += home_mass * rng.dirichlet(np.full(m, 2.0))
    weight = 1.0 / np.arange(1, num_topics + 1) ** zipf
    return TokenModel(rng.permutation(weight), prob,
                      f"synthetic:semmoe topics={num_topics} topic_experts={m} home_mass={home_mass} zipf={zipf} seed={seed}")
