"""Cost estimates for Algorithm 1 from measurement.

``afore bench migration`` (H200s) writes ``bench/results/migration.json``; its ``cost_model``
section carries the figures the scheduler needs:

    "cost_model": {"beta_tile_ms": 0.0041,       # grouped-GEMM time per tile (ms/tile)
                   "bytes_per_expert": 37748736,  # bytes of one routed expert
                   "link_bandwidth_gbps": 310.2,  # GB/s achieved into one destination GPU
                   "copy_latency_ms": 0.012,      # fixed cost per copy (ms)
                   "window_ms": 0.48}             # lookahead window W_t (ms)

``load_cost_model`` reads it into a ``CostModel``; a key that is absent keeps its default, other
keys in the section (provenance, units) are ignored. With no report (no path given and no
committed file, or a report without a ``cost_model`` section) the defaults of ``CostModel``
apply: H200 figures for Qwen3-30B-A3B.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from afore.config import CostModel

COST_KEYS = ("beta_tile_ms", "bytes_per_expert", "link_bandwidth_gbps", "copy_latency_ms", "window_ms")


def default_report_path() -> Path:
    """``bench/results/migration.json`` of the source tree this package runs from."""
    return Path(__file__).resolve().parents[2] / "bench" / "results" / "migration.json"


def load_cost_model(path: str | Path | None = None) -> CostModel:
    """The cost model from a migration report, else the defaults.

    Args:
      path: a ``migration.json`` report; None reads the committed report if there is one.
    Raises:
      ValueError: an explicit path that does not exist, a file that is not a JSON object, or a
        ``cost_model`` value of the wrong type or range (naming ``cost_model.<key>``).
    """
    if path is None:
        path = default_report_path()
        if not path.is_file():
            return CostModel()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"cost model report: expected an existing file, got {str(path)!r}")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cost model report: expected JSON in {str(path)!r}, got: {exc}") from None
    if not isinstance(report, dict):
        raise ValueError(f"cost model report: expected a JSON object in {str(path)!r}, got {type(report).__name__}")
    section = report.get("cost_model")
    if section is None:
        return CostModel()
    if not isinstance(section, dict):
        raise ValueError(f"cost_model: expected an object with keys {', '.join(COST_KEYS)}, got {type(section).__name__}")
    values = {}
    for key in COST_KEYS:
        if key not in section:
            continue
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"cost_model.{key}: expected a finite number, got {value!r}")
        if key == "bytes_per_expert":
            if value != int(value):
                raise ValueError(f"cost_model.{key}: expected an integer, got {value!r}")
            value = int(value)
        else:
            value = float(value)
        values[key] = value
    try:
        return CostModel(**values)
    except ValueError as exc:  # range checks of CostModel, e.g. "link_bandwidth_gbps: expected > 0"
        raise ValueError(f"cost_model.{exc}") from None
