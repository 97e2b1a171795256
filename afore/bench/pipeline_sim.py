"""Trace-driven simulator of the AFD pipeline, calibrated by GPU measurements.

The A/B benchmark (``afore bench ab``) runs every placement policy on the same demand sequence and
turns each policy's plans into serving time with this model. Pure functions and small classes;
no processes, shared memory or GPUs.

Model (times in ms, loads in tiles of M_tile token-expert pairs):

- Workload: demand counts int64[S, L, M, E]: S serving steps, L MoE layers, M microbatches in
  flight, E experts; a *target* t = (step s, layer l, microbatch b) in FFN execution order
  (s, then l, then b), t = (s * L + l) * M + b. Each microbatch carries ``tokens`` decode tokens
  (one per sequence), so one step emits M * tokens output tokens.
- FFN stage of target t (all F FFN workers run it together; it ends with the slowest one):
      ffn_ms[t] = intercept_ms + beta_tile_ms * max_w T_w[t] + exposed_ms[t]
  T_w from the policy's plan (``Plan.tile_load``), intercept and beta_tile from the grouped-GEMM
  fit of ``afore bench migration`` for the model's expert shape, and exposed_ms[t] = the copy
  time the policy puts on the critical path as it reports it (``Plan.exposed_ms``): for overlapped
  policies max(0, M(Delta) - W) (copies into one destination serialise, different destinations
  run in parallel; W the lookahead window), for policies whose copies block the target the full
  M(Delta). The simulator does not second-guess a policy's own account.
- Attention stage of target t: attention_ms (a constant per (layer, microbatch), see
  ``balanced_attention_ms`` for the calibrated default); the attention pool runs targets in the
  same order, one at a time (its A data-parallel workers process one microbatch together).
- Dependencies (standard two-stage pipeline with M microbatches in flight; X = transfer_ms, the
  A2F and F2A latency, 0 by default: transfers overlapped with compute):
      attn_start[t] = max(attn_end[t-1], ffn_end[t-M] + X)    (microbatch b's previous layer back)
      attn_end[t]   = attn_start[t] + attention_ms[t]
      ffn_start[t]  = max(attn_end[t] + X, ffn_end[t-1])      (FFN pool busy with target t-1)
      ffn_end[t]    = ffn_start[t] + ffn_ms[t]
  When FFN is the bottleneck, FFN imbalance and exposed copies show up one for one in the step
  time. slack[t] = ffn_start[t] - attn_end[t] is the time between t's demand being known (the
  gate runs at the end of attention) and its FFN stage: the lookahead the simulated pipeline itself
  offers, reported beside the measured window W the policies plan with.
- Step s ends when its last target's FFN stage ends: step_ms[s] = step_end[s] - step_end[s-1]
  (step_end[-1] = 0: step 0 includes the pipeline fill). Every sequence gets one token per step,
  so step_ms is the inter-token latency (ITL) and throughput = M * tokens / step_ms (tokens/s
  after * 1000).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.scheduler.policies import Observation, make_policy
from afore.scheduler.policies.base import migration_ms
from afore.traces.format import iter_targets

# ---------------------------------------------------------------------------- calibration


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured figures for one model's expert shape (``afore bench migration`` on GPUs).

    intercept_ms / beta_tile_ms: grouped-GEMM time = intercept_ms + beta_tile_ms * tiles (ms, ms/tile)
    of one FFN worker; cost: the CostModel the policies plan with (beta_tile, copy latency and
    bandwidth for this expert size, window W); source: where each figure comes from.
    """

    model: str
    intercept_ms: float
    beta_tile_ms: float
    cost: CostModel
    source: dict

    def __post_init__(self) -> None:
        for name in ("intercept_ms", "beta_tile_ms"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: expected a finite value >= 0, got {value!r}")

    def ffn_compute_ms(self, max_tile_load: np.ndarray | float) -> np.ndarray | float:
        """Grouped-GEMM time of the FFN stage (ms) for the slowest worker's tile load."""
        return self.intercept_ms + self.beta_tile_ms * np.asarray(max_tile_load, np.float64)


def calibration_from_report(path: str | Path, model: str, window_ms: float | None = None) -> Calibration:
    """Calibrate the simulator for ``model`` from a ``migration.json`` report.

    Reads ``kernels.beta_tile[model]`` (grouped-GEMM slope and intercept), the ``copies.rows`` of
    that model (linear fit ms = latency + experts * bytes / bandwidth, the same fit as the report's
    own ``cost_model``) and the lookahead window (``replay.median_window_ms``, else
    ``cost_model.window_ms``) unless ``window_ms`` is given.

    Raises ValueError naming the missing or malformed field.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration: expected a migration report at {str(path)!r}, none found")
    try:
        report = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"calibration: expected JSON in {str(path)!r}, got: {exc}") from None
    beta = report.get("kernels", {}).get("beta_tile", {})
    if model not in beta:
        raise ValueError(f"kernels.beta_tile: expected an entry for model {model!r} in {path.name}, got {sorted(beta)}")
    fit = beta[model]
    rows = [r for r in report.get("copies", {}).get("rows", []) if r.get("model") == model]
    if len(rows) < 2:
        raise ValueError(f"copies.rows: expected at least 2 rows for model {model!r} in {path.name}, got {len(rows)}")
    bytes_per_expert = int(rows[0]["bytes_per_expert"])
    slope, intercept = np.polyfit([float(r["experts"]) for r in rows], [float(r["ms"]) for r in rows], 1)
    if slope <= 0:
        raise ValueError(f"copies.rows: expected copy time growing with the number of experts for {model!r}, got slope {slope}")
    if window_ms is None:
        window_ms = (report.get("replay") or {}).get("median_window_ms") or (report.get("cost_model") or {}).get("window_ms")
        window_source = "replay.median_window_ms (measured lookahead window, 2 FFN workers)"
        if window_ms is None:
            raise ValueError(f"window_ms: expected replay.median_window_ms or cost_model.window_ms in {path.name}")
    else:
        window_source = "given (--window-ms)"
    cost = CostModel(beta_tile_ms=float(fit["beta_tile_ms"]), bytes_per_expert=bytes_per_expert,
                     link_bandwidth_gbps=bytes_per_expert / float(slope) / 1e6,
                     copy_latency_ms=max(float(intercept), 0.0), window_ms=float(window_ms))
    meta = report.get("meta", {})
    source = {"report": str(path), "report_command": meta.get("command"), "report_date_utc": meta.get("date_utc"),
              "device": report.get("device"), "model": model,
              "grouped_gemm_fit": {"tiles": fit.get("tiles"), "ms": fit.get("ms")},
              "copy_rows": [{"experts": r["experts"], "ms": r["ms"]} for r in rows], "window": window_source}
    return Calibration(model=model, intercept_ms=float(fit["intercept_ms"]), beta_tile_ms=float(fit["beta_tile_ms"]),
                       cost=cost, source=source)


def balanced_attention_ms(calibration: Calibration, shape: ClusterShape, tokens: int) -> float:
    """Attention stage time (ms per layer and microbatch) of a pool sized to the FFN pool.

    AFD deployments choose the attention/FFN ratio so that neither stage idles under even load;
    this default makes the attention stage as long as the FFN stage of a perfectly balanced
    microbatch (tokens * top_k pairs spread evenly, full tiles): every ms of FFN imbalance or
    exposed copy then costs throughput, as in the paper's setting.
    """
    pairs = tokens * shape.top_k
    tiles = -(-pairs // (shape.num_workers * shape.m_tile))
    return float(calibration.ffn_compute_ms(tiles))


# ---------------------------------------------------------------------------- pipeline


@dataclasses.dataclass(frozen=True)
class PipelineTimeline:
    """Start/end times (ms) of every stage, in FFN execution order, and the per-step times."""

    attn_start: np.ndarray  # float64[N]
    attn_end: np.ndarray    # float64[N]
    ffn_start: np.ndarray   # float64[N]
    ffn_end: np.ndarray     # float64[N]
    step_end: np.ndarray    # float64[S]
    step_ms: np.ndarray     # float64[S]

    @property
    def slack_ms(self) -> np.ndarray:
        """float64[N]: time from the end of each target's attention stage to the start of its FFN stage."""
        return self.ffn_start - self.attn_end

    @property
    def ffn_busy_share(self) -> float:
        """Share of the makespan in which the FFN pool computes (1.0 = FFN is the bottleneck)."""
        span = float(self.ffn_end[-1])
        return float(np.sum(self.ffn_end - self.ffn_start)) / span if span > 0 else 0.0


def simulate_pipeline(attention_ms: float | np.ndarray, ffn_ms: np.ndarray, num_layers: int,
                      num_microbatches: int, transfer_ms: float = 0.0) -> PipelineTimeline:
    """Run the two-stage pipeline of the module docstring.

    Args:
      attention_ms: scalar or float[N]: attention stage time of each target (ms).
      ffn_ms: float[N]: FFN stage time of each target (ms), N = S * L * M in FFN order.
      num_layers: L MoE layers per step.
      num_microbatches: M microbatches in flight.
      transfer_ms: A2F (and F2A) latency between the stages (ms).
    Returns: the timeline; ``step_ms`` float[S].
    """
    if isinstance(num_layers, bool) or int(num_layers) != num_layers or num_layers < 1:
        raise ValueError(f"num_layers: expected an integer >= 1, got {num_layers!r}")
    if isinstance(num_microbatches, bool) or int(num_microbatches) != num_microbatches or num_microbatches < 1:
        raise ValueError(f"num_microbatches: expected an integer >= 1, got {num_microbatches!r}")
    ffn = np.asarray(ffn_ms, np.float64)
    if ffn.ndim != 1 or ffn.size == 0:
        raise ValueError(f"ffn_ms: expected a non-empty vector, got shape {ffn.shape}")
    per_step = num_layers * num_microbatches
    if ffn.size % per_step:
        raise ValueError(f"ffn_ms: expected a length divisible by num_layers * num_microbatches = {per_step}, got {ffn.size}")
    attn = np.asarray(attention_ms, np.float64)
    if attn.ndim == 0:
        attn = np.full(ffn.shape, float(attn))
    if attn.shape != ffn.shape:
        raise ValueError(f"attention_ms: expected a scalar or a vector of length {ffn.size}, got shape {np.shape(attention_ms)}")
    for name, arr in (("ffn_ms", ffn), ("attention_ms", attn)):
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"{name}: expected finite times >= 0 (ms)")
    if isinstance(transfer_ms, bool) or not isinstance(transfer_ms, (int, float, np.floating)) \
            or not np.isfinite(transfer_ms) or transfer_ms < 0:
        raise ValueError(f"transfer_ms: expected a finite value >= 0 (ms), got {transfer_ms!r}")
    n, m, x = ffn.size, int(num_microbatches), float(transfer_ms)
    a_start, a_end, f_start, f_end = (np.zeros(n) for _ in range(4))
    prev_a_end = prev_f_end = 0.0
    attn_l, ffn_l = attn.tolist(), ffn.tolist()
    for t in range(n):
        ready = f_end[t - m] + x if t >= m else 0.0
        start = prev_a_end if prev_a_end > ready else ready
        prev_a_end = start + attn_l[t]
        a_start[t], a_end[t] = start, prev_a_end
        arrived = prev_a_end + x
        start = arrived if arrived > prev_f_end else prev_f_end
        prev_f_end = start + ffn_l[t]
        f_start[t], f_end[t] = start, prev_f_end
    step_end = f_end[per_step - 1::per_step].copy()
    step_ms = np.diff(step_end, prepend=0.0)
    return PipelineTimeline(a_start, a_end, f_start, f_end, step_end, step_ms)


# ---------------------------------------------------------------------------- policies


@dataclasses.dataclass(frozen=True)
class PolicyTrace:
    """What one policy did on one workload, per target in FFN order (N targets)."""

    policy: str
    max_tile_load: np.ndarray   # int64[N]   max_w T_w
    mean_tile_load: np.ndarray  # float64[N] mean_w T_w
    copies: np.ndarray          # int64[N]   new replicas copied for the target
    copy_ms: np.ndarray         # float64[N] M(Delta): raw copy time of the plan's copies
    exposed_ms: np.ndarray      # float64[N] Plan.exposed_ms
    demand_digest: str          # sha256 of the demand every plan covered, in order


def demand_digest(counts: Iterable[np.ndarray]) -> str:
    """sha256 over demand vectors (as int64), in order: proves two runs saw the same demand."""
    h = hashlib.sha256()
    for d in counts:
        h.update(np.ascontiguousarray(d, np.int64).tobytes())
    return h.hexdigest()



def run_policy(name: str, shape: ClusterShape, params: SchedulerParams, cost: CostModel, counts: np.ndarray,
               options: dict | None = None, progress: Callable[[int], None] | None = None) -> PolicyTrace:
    """Replay counts[S, L, M, E] through a fresh policy ``name`` and record its plans' figures.

    The demand array is handed to the policy read-only, so every policy of a run sees the very
    same demand; ``progress(n)`` is called every 256 targets (and at the end) with the count done.
    """
    counts = np.asarray(counts)
    if counts.ndim != 4 or counts.shape[1] != shape.num_layers or counts.shape[3] != shape.num_experts:
        raise ValueError(f"counts: expected shape [steps, {shape.num_layers} (num_layers), microbatches, "
                         f"{shape.num_experts} (num_experts)], got {counts.shape}")
    view = counts.view()
    view.flags.writeable = False
    policy = make_policy(name, shape, params, cost, check_plans=False, **(options or {}))
    n = counts.shape[0] * counts.shape[1] * counts.shape[2]
    max_load, mean_load = np.zeros(n, np.int64), np.zeros(n)
    copies, copy_ms, exposed = np.zeros(n, np.int64), np.zeros(n), np.zeros(n)
    h = hashlib.sha256()
    for target, seq, demand in iter_targets(view):
        plan = policy.plan(Observation(target, seq, demand))
        h.update(np.ascontiguousarray(plan.demand, np.int64).tobytes())
        max_load[seq] = plan.max_tile_load
        mean_load[seq] = float(plan.tile_load.mean())
        copies[seq] = plan.copies.shape[0]
        copy_ms[seq] = migration_ms(plan.copies, shape.num_workers, cost)
        exposed[seq] = plan.exposed_ms
        if progress is not None and (seq + 1) % 256 == 0:
            progress(256)
    if progress is not None and n % 256:
        progress(n % 256)
    return PolicyTrace(name, max_load, mean_load, copies, copy_ms, exposed, h.hexdigest())


def ffn_stage_ms(trace: PolicyTrace, calibration: Calibration) -> np.ndarray:
    """float64[N]: FFN stage time of every target = grouped GEMM of the slowest worker + exposed copies."""
    return calibration.ffn_compute_ms(trace.max_tile_load) + trace.exposed_ms


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarise(trace: PolicyTrace, timeline: PipelineTimeline, ffn_ms: np.ndarray, tokens_per_step: int,
              warmup_steps: int, num_layers: int, num_microbatches: int) -> dict:
    """Per-policy figures over the steps after ``warmup_steps`` (and their targets).

    step_ms (= ITL) mean/p50/p95, throughput_tok_s = tokens_per_step * measured steps / their total
    time, max/mean tile load mean and p99, copies and exposed ms per target, share of targets with
    zero exposed wait, mean FFN stage ms and the FFN pool's busy share, the simulated slack
    (mean, p50) and the share of targets with copies whose raw copy time exceeds their slack.
    """
    steps = timeline.step_ms.size
    if not 0 <= warmup_steps < steps:
        raise ValueError(f"warmup_steps: expected in [0, {steps}), got {warmup_steps}")
    step_ms = timeline.step_ms[warmup_steps:]
    first = warmup_steps * num_layers * num_microbatches
    mean = trace.mean_tile_load[first:]
    ratio = np.where(mean > 0, trace.max_tile_load[first:] / np.where(mean > 0, mean, 1.0), 1.0)
    exposed = trace.exposed_ms[first:]
    slack = timeline.slack_ms[first:]
    with_copies = trace.copies[first:] > 0
    total_ms = float(step_ms.sum())
    return {
        "steps": int(step_ms.size), "targets": int(exposed.size),
        "step_ms_mean": float(step_ms.mean()), "step_ms_p50": _pct(step_ms, 50), "step_ms_p95": _pct(step_ms, 95),
        "step_ms_max": float(step_ms.max()),
        "throughput_tok_s": tokens_per_step * step_ms.size / total_ms * 1e3 if total_ms > 0 else float("nan"),
        "max_mean_tile_load": float(ratio.mean()), "max_mean_tile_load_p99": _pct(ratio, 99),
        "copies_per_target": float(trace.copies[first:].mean()),
        "copy_ms_per_target": float(trace.copy_ms[first:].mean()),
        "exposed_ms_per_target": float(exposed.mean()),
        "zero_exposed_share": float(np.mean(exposed <= 0.0)),
        "ffn_stage_ms_mean": float(ffn_ms[first:].mean()),
        "ffn_busy_share": timeline.ffn_busy_share,
        "slack_ms_mean": float(slack.mean()), "slack_ms_p50": _pct(slack, 50),
        "copy_beyond_slack_share": float(np.mean(trace.copy_ms[first:][with_copies] > slack[with_copies])) if with_copies.any() else 0.0,
    }
