"""Calibration files: the measured cost model of one expert shape on one device.

Algorithm 1 plans with a ``CostModel`` (beta_tile_ms, bytes per expert, copy bandwidth and
latency, lookahead window W_t). Those are properties of the expert shape and of the device, so
they live in one file per (device, expert shape):

    ~/.cache/afore/calibration/<device>-<shape>.json     ($AFORE_CALIBRATION_DIR: another folder)

    device  a slug of the device name: ``nvidia-h200``, ``cpu``
    shape   ``h<hidden>-i<intermediate>-<dtype>-m<m_tile>``, e.g. ``h2048-i768-bfloat16-m16``

``afore calibrate`` writes one, from ``afore bench migration``'s report (``--from-report``,
e.g. the committed H200 measurements ``bench/results/migration.json``) or from a quick local
measurement (``--measure``: grouped-GEMM time per tile and copy bandwidth/latency on this
machine's device). ``afore serve`` and ``afore scheduler`` load it (``--calibration PATH``, else
looked up by shape and device) and log which file they use, or that they use the defaults.

The window W_t in a file is a starting value: the FFN workers measure their own lookahead window
and feed it back to the running scheduler (``afore.scheduler.window_feedback``).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import time
from pathlib import Path

import msgspec

from afore.config import CostModel

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
CALIBRATION_DIR_ENV = "AFORE_CALIBRATION_DIR"
FORMAT = "afore-calibration/1"


class ExpertShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One routed expert: w13 [2I, H] and w2 [H, I] of ``dtype``; tiles of ``m_tile`` rows."""

    hidden_size: int
    intermediate_size: int
    dtype: str = "bfloat16"
    m_tile: int = 16

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "m_tile"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert's weights (gate, up and down projections)."""
        return 3 * self.hidden_size * self.intermediate_size * DTYPE_BYTES[self.dtype]

    @property
    def slug(self) -> str:
        return f"h{self.hidden_size}-i{self.intermediate_size}-{self.dtype}-m{self.m_tile}"


class Calibration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The contents of one calibration file."""

    device: str                # device name as measured, e.g. "NVIDIA H200", "cpu"
    expert: ExpertShape
    cost: CostModel
    source: str                # "report:<path>" or "measured"
    command: str = ""          # what produced the measurement
    date_utc: str = ""
    window_source: str = ""    # where window_ms came from
    format: str = FORMAT


def device_slug(device: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    if not slug:
        raise ValueError(f"device: expected a device name, got {device!r}")
    return slug


def calibration_dir() -> Path:
    """``$AFORE_CALIBRATION_DIR``, else ``$XDG_CACHE_HOME/afore/calibration`` (``~/.cache/...``)."""
    if os.environ.get(CALIBRATION_DIR_ENV):
        return Path(os.environ[CALIBRATION_DIR_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "afore" / "calibration"


def calibration_path(device: str, expert: ExpertShape) -> Path:
    """Where the calibration of ``expert`` on ``device`` lives."""
    return calibration_dir() / f"{device_slug(device)}-{expert.slug}.json"


def write_calibration(calibration: Calibration, path: str | Path | None = None) -> Path:
    """Write ``calibration`` (default: its lookup path) and return the path."""
    path = Path(path) if path is not None else calibration_path(calibration.device, calibration.expert)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(calibration), indent=1) + b"\n")
    os.replace(tmp, path)  # readers never see half a file
    return path


def read_calibration(path: str | Path) -> Calibration:
    """Read a calibration file; ValueError naming the file and the field on anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration: expected an existing file, got {str(path)!r}")
    try:
        return msgspec.json.decode(path.read_bytes(), type=Calibration)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"calibration {str(path)!r}: {exc}") from None


def resolve_cost_model(path: str | Path | None, device: str | None = None, expert: ExpertShape | None = None,
                       who: str = "scheduler") -> tuple[CostModel, str]:
    """The cost model to plan with, and where it came from (logged).

    ``path``: an explicit calibration file (must exist and parse). Else the file of (``device``,
    ``expert``) if both are known and it exists. Else the ``CostModel`` defaults (H200 figures for
    Qwen3-30B-A3B), logged as a warning because plans then ignore the real copy and GEMM costs.
    """
    if path:
        cal = read_calibration(path)
        log.info("%s: cost model from calibration %s (%s, %s; %s)", who, path, cal.device, cal.expert.slug, cal.source)
        return cal.cost, str(path)
    if device is not None and expert is not None:
        found = calibration_path(device, expert)
        if found.is_file():
            cal = read_calibration(found)
            log.info("%s: cost model from calibration %s (%s)", who, found, cal.source)
            return cal.cost, str(found)
        log.warning("%s: no calibration for %s on %s (looked for %s; write one with `afore calibrate`): "
                    "planning with the CostModel defaults (H200, Qwen3-30B-A3B)", who, expert.slug, device, found)
    else:
        log.warning("%s: no --calibration and no expert shape/device to look one up: planning with the "
                    "CostModel defaults (H200, Qwen3-30B-A3B)", who)
    return CostModel(), "defaults"


def device_name(device: str) -> str | None:
    """The name calibrations are filed under for a serving ``device`` ("cpu", "cuda", "cuda:1").

    CUDA: the GPU's name from ``nvidia-smi`` (no CUDA context in the calling process); None when
    it cannot be found (the lookup is skipped and logged).
    """
    if device == "cpu":
        return "cpu"
    index = device.split(":", 1)[1] if ":" in device else "0"
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def serving_cost_model(path: str, device: str, hidden_size: int, intermediate_size: int, dtype: str,
                       m_tile: int) -> CostModel:
    """``afore serve``'s cost model: ``path`` if given, else the calibration of the served expert
    shape on ``device``, else the defaults (logged either way)."""
    expert = ExpertShape(hidden_size, intermediate_size, dtype if dtype in DTYPE_BYTES else "bfloat16", m_tile)
    name = None if path else device_name(device)
    return resolve_cost_model(path or None, name, expert if name else None, who="afore serve")[0]


def from_migration_report(report_path: str | Path, expert: ExpertShape) -> Calibration:
    """The calibration of ``afore bench migration``'s report for ``expert``.

    The report's ``cost_model`` section gives every figure; its ``bytes_per_expert`` must be the
    expert's (3 H I x dtype bytes), else the report measured another shape (ValueError).
    """
    from afore.scheduler.cost import load_cost_model

    report_path = Path(report_path)
    cost = load_cost_model(report_path)
    report = json.loads(report_path.read_text())
    if not isinstance(report.get("cost_model"), dict):
        raise ValueError(f"cost_model: expected a cost_model section in {str(report_path)!r}")
    if cost.bytes_per_expert != expert.bytes_per_expert:
        raise ValueError(f"cost_model.bytes_per_expert: the report measured {cost.bytes_per_expert} bytes per expert, "
                         f"the expert shape {expert.slug} has {expert.bytes_per_expert}")
    device = report.get("device")
    if not isinstance(device, str) or not device:
        raise ValueError(f"device: expected the device name in {str(report_path)!r}")
    meta = report.get("meta", {}) if isinstance(report.get("meta"), dict) else {}
    return Calibration(device=device, expert=expert, cost=cost, source=f"report:{report_path.resolve()}",
                       command=str(meta.get("command", "")), date_utc=str(meta.get("date_utc", "")),
                       window_source="report (the FFN workers' measured window replaces it online)")


def measure_local(expert: ExpertShape, device: str = "cpu", repeats: int = 20,
                  window_ms: float | None = None) -> Calibration:
    """A quick measurement on this machine's ``device`` (``cpu`` or ``cuda``), about a second.

    beta_tile_ms: median time of one expert's FFN (gate/up, SiLU, down) on M_tile rows with
    torch's current thread count (a tile is the unit the grouped GEMM pays for). Copy: latency =
    median time of a 64-byte copy, bandwidth = one expert's bytes over the median time of copying
    them (less that latency), between preallocated buffers on the device. window_ms: ``window_ms``
    if given, else the default (no pipeline runs here; the FFN workers feed the real window back
    online). On a shared CPU the numbers are only as good as the machine is quiet.
    """
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(expert.dtype)
    if dtype is None:
        raise ValueError(f"dtype: --measure supports float32, bfloat16 and float16, got {expert.dtype!r}")
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    h, i, m = expert.hidden_size, expert.intermediate_size, expert.m_tile
    w13 = torch.randn(2 * i, h, dtype=dtype, device=dev) * 0.02
    w2 = torch.randn(h, i, dtype=dtype, device=dev) * 0.02
    x = torch.randn(m, h, dtype=dtype, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn) -> float:
        fn()
        sync()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - t0) * 1e3)
        return sorted(samples)[len(samples) // 2]

    def expert_ffn() -> None:
        gate_up = x @ w13.t()
        torch.nn.functional.silu(gate_up[:, :i]).mul_(gate_up[:, i:]) @ w2.t()

    beta = timed(expert_ffn)
    n = expert.bytes_per_expert
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    latency = timed(lambda: dst[:64].copy_(src[:64]))  # the fixed cost of one copy
    t_full = timed(lambda: dst.copy_(src))
    bandwidth = n / max(t_full - latency, 1e-6) / 1e6  # bytes/ms -> GB/s
    if not (math.isfinite(beta) and math.isfinite(bandwidth)):
        raise RuntimeError(f"calibration: measurement failed (beta {beta} ms, bandwidth {bandwidth} GB/s)")
    window = CostModel().window_ms if window_ms is None else float(window_ms)
    cost = CostModel(beta_tile_ms=beta, bytes_per_expert=n, link_bandwidth_gbps=bandwidth,
                     copy_latency_ms=latency, window_ms=window)
    return Calibration(device=name, expert=expert, cost=cost, source="measured",
                       command=f"measure_local(repeats={repeats}) on {device}",
                       date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                       window_source="given" if window_ms is not None else
                       "CostModel default (the FFN workers' measured window replaces it online)")
