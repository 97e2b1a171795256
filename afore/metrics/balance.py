"""Balance of one target: max/mean tile load over the FFN workers.

The scheduler's objective is the smallest max_w T_w (tile load, DESIGN.md section 4); divided
by the mean it is the imbalance factor: 1.0 = every worker has the same number of tiles, F = one
worker has all of them. vLLM's EPLB reports the inverse (mean/max, "balancedness"). The same
factor under the primary-only placement (every pair on its expert's fixed primary, no copies)
is what the target would have cost without re-placement: the gap between the two is what
placement bought.
"""

from __future__ import annotations

import collections

import numpy as np

from afore.config import ClusterShape

IMBALANCE_BUCKETS = (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0)
PLACEMENTS = ("plan", "primary_only")  # label ``placement``: the plan's, or the primary-only one
BALANCE_WINDOW = 64                    # targets per layer in the *_tile_imbalance_window gauges


def tile_imbalance(tile_load: np.ndarray) -> float | None:
    """max/mean of ``tile_load`` (int[F], tiles per worker); None when no worker has a tile."""
    load = np.asarray(tile_load, dtype=np.float64)
    assert load.ndim == 1 and load.size > 0, f"tile_load: expected a non-empty vector, got shape {load.shape}"
    total = load.sum()
    if total <= 0:
        return None
    return float(load.max() * load.size / total)


def load_stats(tile_load: np.ndarray) -> tuple[float, float, int]:
    """(max, total, F) of ``tile_load`` (int[F], non-empty) in Python numbers: a metrics call per
    target needs all three, and F is small (one list beats three numpy reductions)."""
    values = tile_load.tolist() if isinstance(tile_load, np.ndarray) else list(tile_load)
    assert values, "tile_load: expected a non-empty vector"
    return float(max(values)), float(sum(values)), len(values)


def primary_only_tile_load(shape: ClusterShape, demand: np.ndarray) -> np.ndarray:
    """T_w of the primary-only placement: sum over the experts whose primary is w of
    ceil(demand[e] / m_tile). ``demand``: int[E] token-expert pairs per expert; returns int64[F]."""
    demand = np.asarray(demand, dtype=np.int64)
    assert demand.shape == (shape.num_experts,), f"demand: expected shape ({shape.num_experts},), got {demand.shape}"
    tiles = -(-demand // shape.m_tile)
    return np.bincount(shape.primary_owner, weights=tiles, minlength=shape.num_workers).astype(np.int64)


class ImbalanceWindow:
    """max/mean tile load over the last ``size`` targets of each key (e.g. a layer): the sum of
    the targets' max over the sum of their mean, so a target with more tiles weighs more."""

    def __init__(self, size: int = 64) -> None:
        assert size >= 1, f"size: expected >= 1, got {size}"
        self.size = size
        self._recent: dict[object, collections.deque] = {}
        self._sums: dict[object, list[float]] = {}

    def add(self, key: object, tile_load: np.ndarray) -> float:
        """Add one target's ``tile_load`` (int[F], not all zero) under ``key``; returns the window's factor."""
        return self.add_stats(key, *load_stats(np.asarray(tile_load)))

    def add_stats(self, key: object, load_max: float, load_total: float, size: int) -> float:
        """``add`` of a target given as ``load_stats`` (max, total > 0, F)."""
        # running sums of max and total (O(1) per target; exact for tile counts): mean = total / F
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = collections.deque(maxlen=self.size)
            self._sums[key] = [0.0, 0.0]
        sums = self._sums[key]
        if len(recent) == self.size:
            old_max, old_total = recent[0]
            sums[0] -= old_max
            sums[1] -= old_total
        recent.append((load_max, load_total))
        sums[0] += load_max
        sums[1] += load_total
        return sums[0] * size / sums[1]
