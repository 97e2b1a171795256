"""afore.metrics.balance: max/mean tile load of a plan and of its primary-only placement."""

import numpy as np
import pytest

from afore.config import ClusterShape
from afore.metrics.balance import ImbalanceWindow, primary_only_tile_load, tile_imbalance


def test_imbalance_is_max_over_mean():
    assert tile_imbalance(np.array([2, 2, 2, 2])) == 1.0
    assert tile_imbalance(np.array([4, 0, 0, 0])) == 4.0          # one worker has every tile: F
    assert tile_imbalance(np.array([3, 1])) == pytest.approx(1.5)
    assert tile_imbalance(np.zeros(3, np.int32)) is None         # no work: no figure


def test_primary_only_tile_load_counts_tiles_on_each_primary():
    shape = ClusterShape(num_experts=4, num_workers=2, m_tile=4, top_k=1, redundant_slots=0)
    # contiguous primaries: experts 0, 1 on worker 0, 2, 3 on worker 1; tiles ceil(d / 4)
    np.testing.assert_array_equal(primary_only_tile_load(shape, np.array([5, 4, 0, 1])), [3, 1])
    custom = shape.with_primaries([1, 0, 1, 0])
    np.testing.assert_array_equal(primary_only_tile_load(custom, np.array([5, 4, 0, 1])), [2, 2])


def test_window_weighs_targets_by_their_tiles():
    win = ImbalanceWindow(size=2)
    assert win.add("l0", np.array([2, 0])) == pytest.approx(2.0)
    # (2 + 6) / (1 + 6): the bigger, balanced target dominates
    assert win.add("l0", np.array([6, 6])) == pytest.approx(8 / 7)
    assert win.add("l0", np.array([6, 6])) == pytest.approx(1.0)  # the first one left the window
    assert win.add("l1", np.array([3, 1])) == pytest.approx(1.5)  # keys are separate
