"""Seeded synthetic routing traces calibrated to measured MoE routing skew.

Calibration source: the measured traces under ``../shared/traces/`` (HarMoEny switch-base-128
and Qwen1.5-MoE per-batch counts, OLMoE per-domain counts; statistics in
``harmoeny/computed_stats_per_layer.csv``): expert popularity is heavy-tailed and more skewed
in deeper layers (max/mean expert load per batch 8-27 on real text at top-1), consecutive
batches drift by a total-variation (TV) distance of 0.02-0.08, and switching domain shifts the
distribution by TV 0.3-0.7.

Model. Per layer l, expert log-popularity z = s_l * (sqrt(1 - w) g_shared + sqrt(w) g_workload)
with standard-normal g (lognormal popularity, heavy-tailed) and s_l growing linearly with depth
(``skew_first`` -> ``skew_last``). A workload owns its own g_workload (weight w =
``workload_weight``): two workloads differ by TV 0.3-0.7. Over steps z drifts as a
mean-reverting AR(1) process (``drift`` = stationary std of the deviation, ``drift_corr`` = its
step-to-step correlation), which gives consecutive-step TV 0.02-0.08 for large batches. Each
microbatch then draws ``tokens`` tokens, each choosing ``top_k`` distinct experts with
probability proportional to popularity (Gumbel top-k, i.e. Plackett-Luce sampling), so small
decode microbatches carry the sampling noise a real router shows.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from afore.traces.format import Trace

#: Workload names of the synthetic set (named after the paper's four serving workloads).
WORKLOADS = ("chat", "docs", "code", "math")


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """Shape and statistics of one synthetic trace (defaults: Qwen3-30B-A3B-like, decode)."""

    workload: str = "chat"
    num_experts: int = 128
    num_layers: int = 12
    top_k: int = 8
    tokens: int = 512            # tokens per microbatch
    steps: int = 64
    microbatches: int = 2
    skew_first: float = 0.9      # lognormal sigma of popularity at layer 0
    skew_last: float = 1.5       # ... at the last layer
    workload_weight: float = 0.45  # share of log-popularity variance owned by the workload
    drift: float = 0.30          # stationary std of the log-popularity deviation over steps
    drift_corr: float = 0.95     # step-to-step correlation of that deviation
    seed: int = 0
    model: str = "synthetic (Qwen3-30B-A3B shape)"
    hidden_size: int = 2048
    moe_intermediate_size: int = 768

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_layers", "top_k", "tokens", "steps", "microbatches", "hidden_size", "moe_intermediate_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: expected <= num_experts ({self.num_experts}), got {self.top_k}")
        for name in ("skew_first", "skew_last", "drift"):
            if not (np.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}: expected a finite value >= 0, got {getattr(self, name)!r}")
        for name in ("workload_weight", "drift_corr"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: expected a value in [0, 1], got {getattr(self, name)!r}")
        if not self.workload:
            raise ValueError("workload: expected a non-empty name")


def _stream(seed: int, *names: object) -> np.random.Generator:
    """An independent, reproducible random stream for (seed, names)."""
    key = [zlib.crc32(str(n).encode()) for n in names]
    return np.random.default_rng([seed, *key])


def base_log_popularity(spec: SyntheticSpec) -> np.ndarray:
    """float64[L, E]: the workload's stationary log-popularity per layer."""
    L, E = spec.num_layers, spec.num_experts
    shared = _stream(spec.seed, "shared").standard_normal((L, E))
    own = _stream(spec.seed, "workload", spec.workload).standard_normal((L, E))
    scale = np.linspace(spec.skew_first, spec.skew_last, L)[:, None] if L > 1 else np.array([[spec.skew_first]])
    return scale * (np.sqrt(1.0 - spec.workload_weight) * shared + np.sqrt(spec.workload_weight) * own)


def popularity(spec: SyntheticSpec) -> np.ndarray:
    """float64[S, L, E]: routing probabilities per step and layer (rows sum to 1)."""
    base = base_log_popularity(spec)
    rng = _stream(spec.seed, "drift", spec.workload)
    dev = rng.standard_normal(base.shape) * spec.drift
    innovation = np.sqrt(1.0 - spec.drift_corr ** 2) * spec.drift
    out = np.empty((spec.steps,) + base.shape)
    for s in range(spec.steps):
        if s:
            dev = spec.drift_corr * dev + innovation * rng.standard_normal(base.shape)
        z = base + dev
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        out[s] = p / p.sum(axis=-1, keepdims=True)
    return out


def sample_topk_counts(prob: np.ndarray, tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """int64[E]: pairs per expert when ``tokens`` tokens each pick ``top_k`` distinct experts.

    Plackett-Luce sampling without replacement via Gumbel top-k (exact for top_k = 1).
    """
    prob = np.asarray(prob, np.float64)
    E = prob.shape[0]
    if top_k == 1:
        return rng.multinomial(tokens, prob / prob.sum()).astype(np.int64)
    counts = np.zeros(E, np.int64)
    logp = np.log(np.maximum(prob, 1e-300))
    chunk = max(1, (1 << 20) // E)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        keys = logp + rng.gumbel(size=(n, E))
        chosen = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
        counts += np.bincount(chosen.ravel(), minlength=E)
    return counts


def generate(spec: SyntheticSpec) -> Trace:
    """A synthetic trace: counts[steps, layers, microbatches, experts] sampled from ``popularity``."""
    probs = popularity(spec)
    rng = _stream(spec.seed, "tokens", spec.workload)
    counts = np.empty((spec.steps, spec.num_layers, spec.microbatches, spec.num_experts), np.int32)
    for s in range(spec.steps):
        for l in range(spec.num_layers):
            for b in range(spec.microbatches):
                counts[s, l, b] = sample_topk_counts(probs[s, l], spec.tokens, spec.top_k, rng)
    return Trace(counts=counts, model=spec.model, source=f"synthetic:{spec.workload} seed={spec.seed}",
                 workload=spec.workload, top_k=spec.top_k, hidden_size=spec.hidden_size,
                 moe_intermediate_size=spec.moe_intermediate_size)


def resample_trace(counts: np.ndarray, name: str, steps: int, microbatches: int, tokens: int, top_k: int,
                   rng: np.random.Generator) -> np.ndarray:
    """Top-k demand int64[steps, layers, microbatches, E] drawn from a real trace's popularity.

    ``counts``: the trace's counts[iteration, layer, microbatch, E] (microbatch 0 is used, as
    popularity per iteration and layer); each target samples ``tokens`` tokens x ``top_k``
    distinct experts. Experts never chosen in the trace keep a tiny probability.
    """
    pop = counts[:, :, 0, :].astype(np.float64)  # [iterations, layers, E]
    if pop.shape[0] < steps:
        raise ValueError(f"steps: the {name} trace has {pop.shape[0]} iterations, asked for {steps}")
    out = np.zeros((steps, pop.shape[1], microbatches, pop.shape[2]), np.int64)
    for s in range(steps):
        for layer in range(pop.shape[1]):
            p = pop[s, layer] + 1e-3
            for b in range(microbatches):
                out[s, layer, b] = sample_topk_counts(p / p.sum(), tokens, top_k, rng)
    return out
