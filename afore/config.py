"""One typed configuration for afore, validated at the edge.

Everything that crosses a process or network boundary is a msgspec Struct;
inside a process the code works on plain numpy arrays derived from these.

Shapes and units used everywhere:
  E  experts per MoE layer            F  FFN workers (expert-parallel degree)
  R  redundant slots per worker/layer M_tile  grouped-GEMM M tile (token-expert pairs)
"""

from __future__ import annotations

import functools

import msgspec
import numpy as np

#: Environment variable holding the demand receiver's shared token (``afore serve --role ffn``
#: and ``--role attention``; the scheduler reads it when its config carries no token).
DEMAND_TOKEN_ENV = "AFORE_DEMAND_TOKEN"
#: Copy rate cap while experts compute (GB/s): measured on H200s to keep the decode-size
#: grouped GEMM within 3% of its time alone (``afore bench migration``, overlap part).
DEFAULT_COPY_RATE_GBPS = 50.0


class ClusterShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The FFN pool's shape for one model.

    Primaries: expert e has one fixed primary worker. Experts are dealt in
    contiguous blocks; when E is not divisible by F the first E % F workers own
    one more primary than the rest (uneven primaries are supported everywhere).
    Physical slots on worker w: primaries first (0 .. P_w-1), then the R
    redundant slots (P_w .. P_w+R-1).
    """

    num_experts: int
    num_workers: int
    num_layers: int = 1
    redundant_slots: int = 2
    m_tile: int = 16
    top_k: int = 8

    def __post_init__(self) -> None:
        _require(self.num_experts >= 1, "num_experts", ">= 1", self.num_experts)
        _require(self.num_workers >= 1, "num_workers", ">= 1", self.num_workers)
        _require(self.num_layers >= 1, "num_layers", ">= 1", self.num_layers)
        _require(self.redundant_slots >= 0, "redundant_slots", ">= 0", self.redundant_slots)
        _require(self.m_tile >= 1, "m_tile", ">= 1", self.m_tile)
        _require(1 <= self.top_k <= self.num_experts, "top_k", f"in [1, {self.num_experts}]", self.top_k)

    @property
    def primary_counts(self) -> np.ndarray:
        """int64[F]: primaries owned by each worker."""
        return _primary_counts(self.num_experts, self.num_workers)

    @property
    def primary_owner(self) -> np.ndarray:
        """int64[E]: the fixed primary worker of each expert."""
        return np.repeat(np.arange(self.num_workers), self.primary_counts)

    @property
    def primary_slot(self) -> np.ndarray:
        """int64[E]: the physical slot of each expert on its primary worker."""
        starts = np.concatenate([[0], np.cumsum(self.primary_counts)[:-1]])
        return np.arange(self.num_experts) - starts[self.primary_owner]

    @property
    def slots_per_worker(self) -> np.ndarray:
        """int64[F]: K_w = P_w + R physical expert slots per layer."""
        return self.primary_counts + self.redundant_slots

    def check_demand(self, demand: object, field: str = "demand") -> np.ndarray:
        """Validate one demand vector and return it as int64[E].

        Raises ValueError naming the field and the expectation on wrong length,
        non-integer, NaN or negative counts.
        """
        arr = np.asarray(demand)
        if arr.ndim != 1 or arr.shape[0] != self.num_experts:
            raise ValueError(f"{field}: expected a vector of length {self.num_experts} (num_experts), got shape {arr.shape}")
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"{field}: expected finite integer counts, got NaN or inf")
            if not np.all(arr == np.round(arr)):
                raise ValueError(f"{field}: expected integer counts, got non-integer values")
        elif arr.dtype.kind not in "iu":
            raise ValueError(f"{field}: expected integer counts, got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        if np.any(arr < 0):
            raise ValueError(f"{field}: expected non-negative counts, got min {int(arr.min())}")
        return arr

    def check_layer(self, layer: int) -> None:
        _require(0 <= layer < self.num_layers, "layer", f"in [0, {self.num_layers})", layer)

    def check_worker(self, worker: int) -> None:
        _require(0 <= worker < self.num_workers, "worker", f"in [0, {self.num_workers})", worker)


class CostModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Cost estimates for Algorithm 1 (paper eq. 7-8).

    Defaults are H200 measurements (``afore bench migration``); see
    ``afore.scheduler.cost`` for how they are loaded from a committed report.

    M(Delta) = max over destination workers w of n_w * (copy_latency_ms + bytes_per_expert / bandwidth):
    copies into one GPU serialise on its link, copies into different GPUs run in parallel.
    """

    beta_tile_ms: float = 0.004          # grouped-GEMM time per tile (ms/tile)
    bytes_per_expert: int = 3 * 4096 * 1536 * 2   # Qwen3-30B-A3B bf16 expert
    link_bandwidth_gbps: float = 300.0   # GB/s achieved per destination
    copy_latency_ms: float = 0.01        # fixed cost per copy (ms)
    window_ms: float = 0.5               # lookahead window W_t (ms)

    def __post_init__(self) -> None:
        for name in ("beta_tile_ms", "link_bandwidth_gbps", "copy_latency_ms", "window_ms"):
            value = getattr(self, name)
            _require(np.isfinite(value) and value >= 0, name, "a finite value >= 0", value)
        _require(self.link_bandwidth_gbps > 0, "link_bandwidth_gbps", "> 0", self.link_bandwidth_gbps)
        _require(self.bytes_per_expert >= 0, "bytes_per_expert", ">= 0", self.bytes_per_expert)

    @property
    def copy_ms(self) -> float:
        """Time of one expert copy into one destination (ms)."""
        return self.copy_latency_ms + self.bytes_per_expert / (self.link_bandwidth_gbps * 1e9) * 1e3


class SchedulerParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Knobs of Algorithm 1: compactness threshold theta (tiles) and global copy budget B.

    ``chains`` enables afore's improvement phase beyond the paper (single-tile ejection chains
    within the placement, see ``afore.scheduler.algorithm``); False gives the paper's Algorithm 1
    exactly (the ablation).
    """

    theta: int = 0
    copy_budget: int = 8
    chains: bool = True

    def __post_init__(self) -> None:
        _require(self.theta >= 0, "theta", ">= 0", self.theta)
        _require(self.copy_budget >= 0, "copy_budget", ">= 0", self.copy_budget)
        _require(isinstance(self.chains, bool), "chains", "a bool", self.chains)


def _require(ok: bool, field: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"{field}: expected {expected}, got {got!r}")


@functools.lru_cache(maxsize=256)
def _primary_counts_cached(num_experts: int, num_workers: int) -> tuple[int, ...]:
    base, extra = divmod(num_experts, num_workers)
    return tuple(base + (1 if w < extra else 0) for w in range(num_workers))


def _primary_counts(num_experts: int, num_workers: int) -> np.ndarray:
    return np.array(_primary_counts_cached(num_experts, num_workers), dtype=np.int64)
