"""afore.ffn.metrics.FFNMetrics: base units, plan outcomes, balance of executed targets."""

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from afore.config import ClusterShape
from afore.ffn.metrics import FFNMetrics
from afore.metrics.conventions import check_exposition
from afore.migrator.migrator import MigrationRecord
from afore.plan import Target, primary_only_plan

SHAPE = ClusterShape(num_experts=4, num_workers=2, num_layers=2, m_tile=4, top_k=1, redundant_slots=1)


def test_older_loop_interface_counts_used_plans_and_fallbacks():
    m = FFNMetrics(1)
    m.targets.inc()                 # ran on the scheduler's plan
    m.fallbacks.inc()               # the next one fell back ...
    m.targets.inc()                 # ... and is not a plan used
    m.plan_misses.inc()
    m.plans_rejected.inc()
    m.stage_ms.observe(4.0)         # the loop passes milliseconds
    m.queued.set(3)
    assert m.value("afore_ffn_targets_total") == 2
    assert m.value("afore_ffn_plans_total", outcome="used") == 1
    assert m.value("afore_ffn_primary_only_targets_total") == 1
    assert m.value("afore_ffn_plans_total", outcome="missed") == 1
    assert m.value("afore_ffn_plans_total", outcome="rejected") == 1
    assert m.value("afore_ffn_stage_seconds_sum") == pytest.approx(0.004)
    assert m.value("afore_ffn_queued_targets") == 3
    assert "plans run 1, primary-only 1 (no plan 1, rejected 1)" in m.summary()


def test_migration_record_in_seconds_and_per_target():
    m = FFNMetrics(0)
    m.observe(MigrationRecord(seq=3, copies=2, bytes=8192, raw_copy_ms=1.5, exposed_ms=0.25, window_ms=4.0))
    m.observe(MigrationRecord(seq=4, copies=0, bytes=0, raw_copy_ms=0.0, exposed_ms=0.0, window_ms=2.0))
    assert m.value("afore_ffn_copies_total") == 2 and m.value("afore_ffn_copy_bytes_total") == 8192
    assert m.value("afore_ffn_copy_seconds_sum") == pytest.approx(1.5e-3)
    assert m.value("afore_ffn_copy_seconds_count") == 1          # only targets that copied
    assert m.value("afore_ffn_exposed_copy_wait_seconds_sum") == pytest.approx(2.5e-4)
    assert m.value("afore_ffn_lookahead_window_seconds_sum") == pytest.approx(6e-3)
    assert m.value("afore_ffn_target_copies_count") == 2 and m.value("afore_ffn_target_copies_sum") == 2
    assert m.value("afore_ffn_target_copy_bytes_bucket", le="16384.0") == 2


def test_observe_target_records_balance_of_plan_and_primary_only_on_worker_0():
    demand = np.array([8, 8, 4, 0])            # tiles 2, 2, 1, 0: primaries [4, 1]
    fallback = primary_only_plan(SHAPE, demand, Target(0, 1, 0), 2)
    m = FFNMetrics(0, SHAPE)
    m.observe_target(fallback, stage_s=0.01, queued=1)
    assert m.value("afore_ffn_primary_only_targets_total") == 1 and m.value("afore_ffn_plans_total", outcome="used") == 0
    labels = {"layer": "1", "placement": "primary_only"}
    got = m.registry.get_sample_value("afore_ffn_tile_imbalance_sum", labels)
    assert got == pytest.approx(4 / 2.5)
    # a balanced plan of the same demand: expert 1 moved to worker 1 ([2, 3] -> 3 / 2.5)
    balanced = primary_only_plan(SHAPE, demand, Target(1, 1, 0), 6)
    balanced.primary_only = False
    balanced.tile_load = np.array([2, 3], np.int32)
    m.observe_target(balanced, stage_s=0.01, queued=0)
    assert m.value("afore_ffn_plans_total", outcome="used") == 1
    assert m.registry.get_sample_value("afore_ffn_tile_imbalance_window", {"layer": "1", "placement": "plan"}) \
        == pytest.approx((4 + 3) / (2.5 + 2.5))  # the fallback ran as it was planned: [4, 1], then [2, 3]
    assert m.registry.get_sample_value("afore_ffn_tile_imbalance_window", labels) == pytest.approx(1.6)
    # other workers leave the global figure to worker 0
    other = FFNMetrics(1, SHAPE)
    other.observe_target(balanced, stage_s=0.01, queued=0)
    assert other.registry.get_sample_value("afore_ffn_tile_imbalance_count", {"layer": "1", "placement": "plan"}) is None


def test_balance_needs_the_shape_and_outcomes_are_checked():
    m = FFNMetrics(0)
    with pytest.raises(ValueError, match="shape"):
        m.observe_balance(primary_only_plan(SHAPE, np.array([1, 0, 0, 0]), Target(0, 0, 0), 0))
    with pytest.raises(ValueError, match="outcome"):
        m.count_plan("lost")


def test_exposition_keeps_the_conventions():
    m = FFNMetrics(0, SHAPE)
    m.observe(MigrationRecord(1, 1, 4096, 0.1, 0.0, 1.0))
    m.observe_target(primary_only_plan(SHAPE, np.array([3, 1, 0, 4]), Target(0, 0, 0), 0), 0.001, 0)
    text = m.render()
    assert check_exposition(text) == []
    names = {f.name for f in text_string_to_metric_families(text)}
    assert not [n for n in names if n.endswith("_ms")]
