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

    Primaries: expert e has one fixed primary worker, the same in every layer.
    ``primaries`` is that layout as data, int[E] (``primaries[e]`` = the owner of e,
    e.g. co-clustered by ``afore.affinity``); empty (the default) means contiguous
    blocks: when E is not divisible by F the first E % F workers own one more
    primary than the rest (uneven primaries are supported everywhere). Physical
    slots on worker w: primaries first (0 .. P_w-1, its experts in ascending id
    order), then the R redundant slots (P_w .. P_w+R-1).
    """

    num_experts: int
    num_workers: int
    num_layers: int = 1
    redundant_slots: int = 2
    m_tile: int = 16
    top_k: int = 8
    primaries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # upper bounds far above any model (DeepSeek-V3: E=256) keep a malformed shape from
        # allocating its [E, F] / [L, F, R] arrays until the machine runs out of memory
        _require(1 <= self.num_experts <= 1 << 16, "num_experts", f"in [1, {1 << 16}]", self.num_experts)
        _require(1 <= self.num_workers <= 1 << 12, "num_workers", f"in [1, {1 << 12}]", self.num_workers)
        _require(1 <= self.num_layers <= 1 << 12, "num_layers", f"in [1, {1 << 12}]", self.num_layers)
        _require(0 <= self.redundant_slots <= 1 << 10, "redundant_slots", f"in [0, {1 << 10}]", self.redundant_slots)
        _require(1 <= self.m_tile <= 1 << 16, "m_tile", f"in [1, {1 << 16}]", self.m_tile)
        _require(1 <= self.top_k <= self.num_experts, "top_k", f"in [1, {self.num_experts}]", self.top_k)
        if self.primaries:
            check_primary_layout(self.primaries, self.num_experts, self.num_workers)

    @property
    def contiguous_primaries(self) -> bool:
        """True when the primaries are the default contiguous blocks."""
        return not self.primaries or self.primaries == _contiguous_owner(self.num_experts, self.num_workers)

    @property
    def primary_counts(self) -> np.ndarray:
        """int64[F]: primaries owned by each worker."""
        if not self.primaries:
            return _primary_counts(self.num_experts, self.num_workers)
        return np.array(_layout(self.primaries, self.num_workers)[0], dtype=np.int64)

    @property
    def primary_owner(self) -> np.ndarray:
        """int64[E]: the fixed primary worker of each expert (computed once per shape; a copy)."""
        return _primary_arrays(self)[0].copy()

    @property
    def primary_slot(self) -> np.ndarray:
        """int64[E]: the physical slot of each expert on its primary worker (a copy)."""
        return _primary_arrays(self)[1].copy()

    def primary_experts(self, worker: int) -> np.ndarray:
        """int64[P_w]: the primaries of ``worker`` in slot order (ascending expert id)."""
        self.check_worker(worker)
        return np.flatnonzero(self.primary_owner == worker).astype(np.int64)

    def with_primaries(self, primaries: object) -> "ClusterShape":
        """This shape with the primary layout ``primaries`` (int[E]; empty = contiguous)."""
        layout = tuple(int(w) for w in np.asarray(primaries).reshape(-1)) if len(primaries) else ()
        return msgspec.structs.replace(self, primaries=layout)

    @property
    def slots_per_worker(self) -> np.ndarray:
        """int64[F]: K_w = P_w + R physical expert slots per layer."""
        return self.primary_counts + self.redundant_slots

    def check_demand(self, demand: object, field: str = "demand") -> np.ndarray:
        """Validate one demand vector and return it as int64[E].

        Raises ValueError naming the field and the expectation on wrong length,
        non-integer, NaN or negative counts.
        """
        if isinstance(demand, np.ndarray) and demand.dtype == np.int64 and demand.shape == (self.num_experts,):
            # the mailbox's and the FFN side's demand: only the sign to check (hot path: 2 numpy calls)
            if demand.size and demand.min() < 0:
                raise ValueError(f"{field}: expected non-negative counts, got min {int(demand.min())}")
            return demand.copy()
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


def check_primary_layout(primaries: object, num_experts: int, num_workers: int,
                         field: str = "primaries") -> np.ndarray:
    """Validate a primary layout (int[E], the owner worker of each expert) and return it as int64[E].

    Raises ValueError naming ``field`` on a wrong length, a non-integer or an unknown worker.
    """
    arr = np.asarray(primaries)
    if arr.ndim != 1 or arr.shape[0] != num_experts:
        raise ValueError(f"{field}: expected one owner worker per expert, a vector of length {num_experts} (num_experts), got shape {arr.shape}")
    if arr.dtype.kind not in "iu" or arr.dtype == np.bool_:
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{field}: expected integer worker ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < 0) | (arr >= num_workers)
    if np.any(bad):
        e = int(np.argmax(bad))
        raise ValueError(f"{field}: expected worker ids in [0, {num_workers}) (num_workers), got {int(arr[e])} for expert {e}")
    return arr


def _require(ok: bool, field: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"{field}: expected {expected}, got {got!r}")


@functools.lru_cache(maxsize=256)
def _primary_counts_cached(num_experts: int, num_workers: int) -> tuple[int, ...]:
    base, extra = divmod(num_experts, num_workers)
    return tuple(base + (1 if w < extra else 0) for w in range(num_workers))


def _primary_counts(num_experts: int, num_workers: int) -> np.ndarray:
    return np.array(_primary_counts_cached(num_experts, num_workers), dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _contiguous_owner(num_experts: int, num_workers: int) -> tuple[int, ...]:
    return tuple(w for w, n in enumerate(_primary_counts_cached(num_experts, num_workers)) for _ in range(n))


@functools.lru_cache(maxsize=64)
@functools.lru_cache(maxsize=256)
def _primary_arrays(shape: "ClusterShape") -> tuple[np.ndarray, np.ndarray]:
    """(primary_owner, primary_slot) of ``shape``: read on every target by the FFN side, so
    computed once per shape (frozen, hashable); read-only, the properties hand out copies."""
    if not shape.primaries:
        owner = np.repeat(np.arange(shape.num_workers), shape.primary_counts)
        starts = np.concatenate([[0], np.cumsum(shape.primary_counts)[:-1]])
        slot = np.arange(shape.num_experts) - starts[owner]
    else:
        owner = np.array(shape.primaries, dtype=np.int64)
        slot = np.array(_layout(shape.primaries, shape.num_workers)[1], dtype=np.int64)
    owner, slot = owner.astype(np.int64), slot.astype(np.int64)
    owner.flags.writeable = False
    slot.flags.writeable = False
    return owner, slot


def _layout(primaries: tuple[int, ...], num_workers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(primaries per worker, slot of each expert on its owner) of an explicit layout."""
    counts = [0] * num_workers
    slot = []
    for w in primaries:
        slot.append(counts[w])
        counts[w] += 1
    return tuple(counts), tuple(slot)
