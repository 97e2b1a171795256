"""The naming rules afore's Prometheus families keep (https://prometheus.io/docs/practices/naming/).

``check_exposition(text)`` parses a text exposition with prometheus_client's parser and returns
one line per broken rule for the families whose name starts with ``afore_`` (vLLM's and the
others' are not judged here):

- prefix ``afore_``, snake case;
- base units: no abbreviated unit (``_ms``, ``_us``, ``_kb``, ...); a name with a unit word ends
  in it (``_seconds``, ``_bytes``), before ``_total`` for counters;
- counters' samples end in ``_total``; gauges' and histograms' names do not;
- label names from ``LABELS`` only, and bounded values: ``layer`` and ``worker`` small integers
  (``worker`` may also be ``unknown``), ``policy`` a registered placement policy, the other
  labels from a closed set (checked against ``MAX_VALUES`` distinct values per label).
"""

from __future__ import annotations

import re

LABELS = {"layer", "worker", "policy", "outcome", "reason", "placement", "direction"}
MAX_VALUES = 256  # distinct values of one label in one family: anything above is unbounded
ABBREVIATED = re.compile(r"_(ms|us|ns|msec|usec|sec|secs|kb|mb|gb|kib|mib|gib|pct|percent)(_|$)")
UNIT_WORDS = ("seconds", "bytes")
NAME = re.compile(r"^afore_[a-z][a-z0-9_]*$")


def check_exposition(text: str, prefix: str = "afore_") -> list[str]:
    """Problems of the ``prefix`` families in ``text`` (empty: all rules kept)."""
    from prometheus_client.parser import text_string_to_metric_families

    from afore.scheduler.policies import POLICY_NAMES

    problems = []
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(prefix) or fam.name.endswith("_created"):
            continue  # X_created: prometheus_client's creation time of counter/histogram X, not a family
        name, kind = fam.name, fam.type
        where = f"{name} ({kind})"
        if not NAME.match(name):
            problems.append(f"{where}: not snake case with the afore_ prefix")
        if ABBREVIATED.search(name):
            problems.append(f"{where}: abbreviated unit in the name (use _seconds, _bytes)")
        for unit in UNIT_WORDS:
            if f"_{unit}_" in name + "_" and not name.endswith(f"_{unit}"):
                problems.append(f"{where}: the unit {unit} is not the name's last word")
        if kind == "counter":
            bad = [s.name for s in fam.samples if not s.name.endswith("_total")]
            if bad:
                problems.append(f"{where}: counter samples without _total: {sorted(set(bad))}")
        elif kind in ("gauge", "histogram") and name.endswith("_total"):
            problems.append(f"{where}: only counters end in _total")
        elif kind not in ("gauge", "histogram"):
            problems.append(f"{where}: type {kind}, expected counter, gauge or histogram")
        values: dict[str, set[str]] = {}
        for s in fam.samples:
            for label, value in s.labels.items():
                if label == "le" and kind == "histogram":
                    continue
                values.setdefault(label, set()).add(value)
        for label, seen in sorted(values.items()):
            if label not in LABELS:
                problems.append(f"{where}: label {label!r} outside {sorted(LABELS)}")
            if len(seen) > MAX_VALUES:
                problems.append(f"{where}: label {label!r} has {len(seen)} values (unbounded)")
            if label in ("layer", "worker"):
                bad = sorted(v for v in seen if not (v.isdigit() and int(v) < 4096) and not (label == "worker" and v == "unknown"))
                if bad:
                    problems.append(f"{where}: label {label!r} expects small integers, got {bad[:5]}")
            if label == "policy":
                bad = sorted(seen - set(POLICY_NAMES))
                if bad:
                    problems.append(f"{where}: label 'policy' expects a placement policy, got {bad}")
    return problems


def family_names(text: str, prefix: str = "afore_") -> set[str]:
    """The ``prefix`` family names of an exposition (counters without ``_total``, as parsed)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name for f in text_string_to_metric_families(text) if f.name.startswith(prefix)}
