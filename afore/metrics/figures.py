"""The operator's figures from two scrapes of a pod's /metrics (``afore status --watch/--plot``).

``Snapshot.parse(text)`` keeps afore's samples of one scrape; ``figures(before, after)`` turns
two of them into rates and means over the interval between them (counters and histograms are
cumulative, so a figure is the difference divided by the elapsed seconds or by the count
difference) plus the gauges of ``after``. Keys of the result (None where the interval has no
data): ``policy``, ``imbalance`` {layer: {"plan": x, "primary_only": y}}, ``copies_per_s``,
``copy_bytes_per_s``, ``copy_s`` / ``exposed_s`` / ``window_s`` (mean per planned target),
``plans_per_s`` {outcome: rate}, ``primary_only_per_s``, ``misses_per_s``, ``demand_to_plan_s``
(mean), ``f2a_wait_s`` (mean).
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class Snapshot:
    """afore's samples of one scrape: (sample name, sorted label items) -> value, taken at ``t`` (s)."""

    t: float
    values: dict[tuple[str, tuple], float]

    @classmethod
    def parse(cls, text: str, t: float | None = None) -> "Snapshot":
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        for fam in text_string_to_metric_families(text):
            if fam.name.startswith("afore_"):
                for s in fam.samples:
                    values[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(time.monotonic() if t is None else t, values)

    def total(self, name: str, **labels: str) -> float:
        """Sum of sample ``name`` over the label sets that include ``labels``."""
        return sum(v for (n, lab), v in self.values.items() if n == name and labels.items() <= dict(lab).items())

    def series(self, name: str) -> list[tuple[dict, float]]:
        return [(dict(lab), v) for (n, lab), v in self.values.items() if n == name]


def _rate(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float | None:
    dt = after.t - before.t
    if dt <= 0:
        return None
    return max(0.0, after.total(name, **labels) - before.total(name, **labels)) / dt


def _mean(before: Snapshot, after: Snapshot, family: str, **labels: str) -> float | None:
    """Mean observation of histogram ``family`` over the interval (None without observations)."""
    count = after.total(family + "_count", **labels) - before.total(family + "_count", **labels)
    if count <= 0:
        return None
    return (after.total(family + "_sum", **labels) - before.total(family + "_sum", **labels)) / count


def imbalance(snap: Snapshot) -> dict[int, dict[str, float]]:
    """Per layer, the last-window max/mean tile load of ``plan`` and ``primary_only``: the FFN
    pool's executed figure where it is exported, else the scheduler's planned one."""
    out: dict[int, dict[str, float]] = {}
    for name in ("afore_scheduler_tile_imbalance_window", "afore_ffn_tile_imbalance_window"):
        for labels, value in snap.series(name):
            out.setdefault(int(labels["layer"]), {})[labels["placement"]] = value
    return dict(sorted(out.items()))


def figures(before: Snapshot, after: Snapshot) -> dict:
    policies = [lab["policy"] for lab, v in after.series("afore_scheduler_policy") if v >= 1]
    return {
        "policy": ",".join(sorted(policies)) or None,
        "imbalance": imbalance(after),
        "copies_per_s": _rate(before, after, "afore_ffn_copies_total"),
        "copy_bytes_per_s": _rate(before, after, "afore_ffn_copy_bytes_total"),
        "copy_s": _mean(before, after, "afore_ffn_copy_seconds"),
        "exposed_s": _mean(before, after, "afore_ffn_exposed_copy_wait_seconds"),
        "window_s": _mean(before, after, "afore_ffn_lookahead_window_seconds"),
        "plans_per_s": {o: _rate(before, after, "afore_ffn_plans_total", outcome=o) for o in ("used", "missed", "rejected")},
        "primary_only_per_s": _rate(before, after, "afore_ffn_primary_only_targets_total"),
        "misses_per_s": _rate(before, after, "afore_scheduler_plan_misses_total"),
        "demand_to_plan_s": _mean(before, after, "afore_scheduler_demand_to_plan_seconds"),
        "f2a_wait_s": _mean(before, after, "afore_attention_f2a_wait_seconds"),
    }
