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
from afore.metrics.balance import primary_only_tile_load
from afore.migrator.pacing import copy_rate
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
    # copies into the busiest destination (they serialise there; destinations copy in parallel)
    dest_copies: np.ndarray | None = None         # int64[N]
    primary_max_tile_load: np.ndarray | None = None  # int64[N] max_w T_w of the primary-only plan (a missed plan)
    blocking: np.ndarray | None = None            # bool[N] the policy puts its copies on the critical path


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
    dest, primary, blocking = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
    h = hashlib.sha256()
    for target, seq, demand in iter_targets(view):
        plan = policy.plan(Observation(target, seq, demand))
        h.update(np.ascontiguousarray(plan.demand, np.int64).tobytes())
        max_load[seq] = plan.max_tile_load
        mean_load[seq] = float(plan.tile_load.mean())
        copies[seq] = plan.copies.shape[0]
        copy_ms[seq] = migration_ms(plan.copies, shape.num_workers, cost)
        exposed[seq] = plan.exposed_ms
        primary[seq] = int(primary_only_tile_load(shape, plan.demand).max())
        if copies[seq]:
            dest[seq] = int(np.bincount(np.asarray(plan.copies, np.int64)[:, 2], minlength=shape.num_workers).max())
            # overlapped policies claim max(0, M - W) < M (W > 0); blocking ones the whole M(Delta)
            blocking[seq] = plan.exposed_ms >= copy_ms[seq] * (1 - 1e-9)
        if progress is not None and (seq + 1) % 256 == 0:
            progress(256)
    if progress is not None and n % 256:
        progress(n % 256)
    return PolicyTrace(name, max_load, mean_load, copies, copy_ms, exposed, h.hexdigest(), dest, primary, blocking)


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


# ---------------------------------------------------------------------------- runtime stage model

PIPELINE_MODES = ("serial", "pingpong")
STAGE_FIELDS = ("demand_emit_ms", "a2f_post_ms", "a2f_latency_ms", "f2a_latency_ms", "f2a_read_ms", "plan_decode_ms",
                "agreement_ms", "ffn_fixed_ms", "plan_timeout_ms", "copy_latency_ms", "copy_link_gbps",
                "copy_cap_gbps", "deadline_share")


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Measured costs of the runtime's stages around the expert compute (ms per target unless noted).

    Attention worker: ``demand_emit_ms`` (count a target's demand, put it into the mailbox),
    ``a2f_post_ms`` (write its tokens into the A2F path), ``f2a_read_ms`` (read and sum its
    replies). Between the processes: ``a2f_latency_ms`` (posted -> an FFN worker has it),
    ``f2a_latency_ms`` (reply written -> the attention worker has it). FFN worker:
    ``plan_decode_ms`` (read, decode, validate and stage one plan), ``agreement_ms`` (the FFN
    workers' vote on the plan), ``ffn_fixed_ms`` (the rest of the stage outside the grouped GEMM:
    partition, reply write, metrics), ``plan_timeout_ms`` (the wait for a plan at commit before
    the primary-only fallback). Scheduler: ``schedule_ms[policy]`` (demand complete -> plan
    published). Copies: ``copy_latency_ms`` per expert copy, ``copy_link_gbps`` (full rate),
    ``copy_cap_gbps`` (pacing cap while experts compute, 0 = none) and ``deadline_share`` (a batch
    should end within this share of the last measured windows), the rule of
    ``afore.migrator.pacing.copy_rate``; ``copies_synchronous``: the copy runs on the worker's own
    thread (CPU workers) instead of a side stream; ``vote_after_compute``: the workers compute on
    their own plan and vote afterwards (the reply waits for the vote) instead of voting before
    the compute. ``sources``: where each figure comes from.
    """

    demand_emit_ms: float = 0.0
    a2f_post_ms: float = 0.0
    a2f_latency_ms: float = 0.0
    f2a_latency_ms: float = 0.0
    f2a_read_ms: float = 0.0
    plan_decode_ms: float = 0.0
    agreement_ms: float = 0.0
    ffn_fixed_ms: float = 0.0
    plan_timeout_ms: float = 5.0
    copy_latency_ms: float = 0.0
    copy_link_gbps: float = 1e9
    copy_cap_gbps: float = 0.0
    deadline_share: float = 0.5
    copies_synchronous: bool = False
    vote_after_compute: bool = False
    schedule_ms: dict = dataclasses.field(default_factory=dict)
    sources: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in STAGE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
        if self.copy_link_gbps <= 0:
            raise ValueError(f"copy_link_gbps: expected > 0, got {self.copy_link_gbps}")
        if not 0 < self.deadline_share <= 1:
            raise ValueError(f"deadline_share: expected in (0, 1], got {self.deadline_share}")
        for policy, value in self.schedule_ms.items():
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ValueError(f"schedule_ms[{policy!r}]: expected a finite number >= 0, got {value!r}")

    def schedule_for(self, policy: str) -> float:
        """Demand complete -> plan published for ``policy`` (ms); ValueError when not calibrated."""
        if policy not in self.schedule_ms:
            raise ValueError(f"schedule_ms: expected a measured value for policy {policy!r}, got {sorted(self.schedule_ms)}")
        return float(self.schedule_ms[policy])

    def copy_ms(self, nbytes: float, experts: int, deadline_ms: float | None) -> float:
        """Duration of a batch of ``experts`` copies (``nbytes`` in all) into one worker, paced as the
        copy engine paces it (full rate without a deadline estimate or a cap)."""
        if experts <= 0:
            return 0.0
        rate = None
        if self.copy_cap_gbps > 0 and not self.copies_synchronous:
            rate = copy_rate(int(nbytes), self.copy_cap_gbps, deadline_ms, self.copy_link_gbps)
        gbps = self.copy_link_gbps if rate is None else rate
        return experts * self.copy_latency_ms + float(nbytes) / (gbps * 1e6)


def stage_costs_from_dict(data: dict) -> StageCosts:
    """StageCosts from a calibration file's ``stages`` object (unknown fields refused, naming them)."""
    known = {f.name for f in dataclasses.fields(StageCosts)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"stages: unknown fields {unknown}, expected among {sorted(known)}")
    return StageCosts(**data)


@dataclasses.dataclass(frozen=True)
class RuntimeTimeline:
    """What the stage model did, per target in FFN order (ms from the first step's start)."""

    demand: np.ndarray       # demand emitted (the scheduler's input is complete)
    posted: np.ndarray       # tokens posted on the A2F path
    ffn_start: np.ndarray    # the FFN workers took the target
    ffn_end: np.ndarray      # reply written
    plan_wait: np.ndarray    # the workers waited this long for the target's plan
    missed: np.ndarray       # bool: no plan by the deadline, run primary-only
    window: np.ndarray       # copy submission -> commit (NaN: no copies)
    copy_ms: np.ndarray      # duration of the copies into the busiest destination
    exposed: np.ndarray      # copy time left on the critical path at commit
    step_end: np.ndarray     # float64[S]
    step_ms: np.ndarray      # float64[S]
    call_enter: np.ndarray   # float64[S * L] serial mode: a layer call's attention ended (NaN in pingpong)
    call_exit: np.ndarray    # float64[S * L] serial mode: its last reply was read

    @property
    def exchange_ms(self) -> np.ndarray:
        """float64[S * L] serial mode: enter -> exit of each MoE layer call (the exchange with the FFN pool)."""
        return self.call_exit - self.call_enter

    @property
    def ffn_busy_share(self) -> float:
        span = float(self.step_end[-1])
        return float(np.sum(self.ffn_end - self.ffn_start)) / span if span > 0 else 0.0


def simulate_runtime(mode: str, attention_ms: np.ndarray, compute_ms: np.ndarray, num_layers: int, num_microbatches: int,
                     costs: StageCosts, schedule_ms: float, copies: np.ndarray | None = None,
                     bytes_per_expert: float = 0.0, blocking: np.ndarray | None = None,
                     primary_compute_ms: np.ndarray | None = None, step_barrier: bool = False) -> RuntimeTimeline:
    """Run the data plane's stage model over N = S * L * M targets.

    Args:
      mode: "serial" (today's runtime: the attention worker computes a layer for the whole batch,
        posts its M microbatches and waits for all M replies before the next layer) or "pingpong"
        (microbatch b+1's attention runs while the FFN pool computes b; a microbatch's next layer
        waits only for its own reply).
      attention_ms: serial: float[S, L] attention compute before each MoE layer call (layer 0 holds
        the step's work outside the MoE layers); pingpong: float[N] per target (or a scalar).
      compute_ms: float[N] grouped GEMM of the slowest FFN worker on the target's plan.
      num_layers, num_microbatches: L and M.
      costs: the stage costs; schedule_ms: this policy's demand -> plan published (ms).
      copies: int[N] copies into the busiest destination per target (None: no copies);
        bytes_per_expert: bytes of one expert copy; blocking: bool[N] copies on the critical path
        (HarMoEny-style and no-overlap policies), else overlapped with the previous target;
        primary_compute_ms: float[N] compute on the primary-only plan (a missed plan), default
        compute_ms.
      step_barrier: pingpong only: a step's first target waits for every reply of the previous
        step (the runtime: vLLM samples the whole batch before the next step starts, so the
        pipeline drains at every step), not only for its own microbatch's.

    The FFN workers run targets one at a time in order (all F together: they agree on each
    plan, the slowest one ends the stage). For target t a worker takes the plan read ahead while
    t-1 ran if t had arrived and its plan was published by then; else it waits for the plan up to
    ``plan_timeout_ms`` (then runs primary-only, a miss), decodes it, votes, reads ahead for t+1
    (decodes t+1's plan and submits its copies if both are there), commits t (waits for t's
    copies: the exposed wait), computes and replies. Copies on CPU workers run synchronously on
    the worker's thread where they are submitted. The exposed wait is computed from this
    timeline, never taken from the policy's own claim.
    """
    if mode not in PIPELINE_MODES:
        raise ValueError(f"mode: expected one of {PIPELINE_MODES}, got {mode!r}")
    L, M = int(num_layers), int(num_microbatches)
    if L < 1 or M < 1:
        raise ValueError(f"num_layers, num_microbatches: expected >= 1, got {num_layers}, {num_microbatches}")
    compute = np.asarray(compute_ms, np.float64)
    n = compute.size
    if compute.ndim != 1 or n == 0 or n % (L * M):
        raise ValueError(f"compute_ms: expected a non-empty vector of a length divisible by L * M = {L * M}, got {compute.shape}")
    steps = n // (L * M)
    attn = np.asarray(attention_ms, np.float64)
    if mode == "serial":
        attn = np.broadcast_to(attn, (steps, L)) if attn.ndim < 2 else attn
        if attn.shape != (steps, L):
            raise ValueError(f"attention_ms: expected shape ({steps}, {L}) [steps, layers] in serial mode, got {attn.shape}")
    else:
        attn = np.broadcast_to(attn, (n,)) if attn.ndim == 0 else attn
        if attn.shape != (n,):
            raise ValueError(f"attention_ms: expected a scalar or shape ({n},) in pingpong mode, got {attn.shape}")
    for name, arr in (("attention_ms", attn), ("compute_ms", compute)):
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"{name}: expected finite times >= 0 (ms)")
    ncopies = np.zeros(n, np.int64) if copies is None else np.asarray(copies, np.int64)
    block = np.zeros(n, bool) if blocking is None else np.asarray(blocking, bool)
    primary = compute if primary_compute_ms is None else np.asarray(primary_compute_ms, np.float64)
    for name, arr in (("copies", ncopies), ("blocking", block), ("primary_compute_ms", primary)):
        if arr.shape != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {arr.shape}")
    c = costs
    demand, posted, arrive, ready = (np.full(n, np.inf) for _ in range(4))
    f_start, f_end, reply = np.zeros(n), np.zeros(n), np.zeros(n)
    plan_wait, window, copy_dur, exposed = np.zeros(n), np.full(n, np.nan), np.zeros(n), np.zeros(n)
    missed = np.zeros(n, bool)
    early = np.zeros(n, bool)          # plan read ahead while t-1 ran
    copy_end = np.full(n, -np.inf)     # async copies of t end here
    submitted = np.full(n, np.nan)
    recent: list[float] = []           # the migrator's last measured windows (it keeps 2)
    state = {"free": 0.0, "next": 0}

    def submit(t: int, at: float) -> float:
        """Copies of t submitted at ``at``; returns the worker's clock after it."""
        if ncopies[t] == 0 or block[t]:
            return at
        deadline = c.deadline_share * min(recent) if recent else None
        copy_dur[t] = c.copy_ms(ncopies[t] * bytes_per_expert, int(ncopies[t]), deadline)
        submitted[t] = at
        if c.copies_synchronous:
            copy_end[t] = at + copy_dur[t]
            return copy_end[t]
        copy_end[t] = at + copy_dur[t]
        return at

    def run_ffn(t: int) -> None:
        h = max(arrive[t], state["free"])
        f_start[t] = h
        if not early[t]:
            if ready[t] <= h:
                h += c.plan_decode_ms
            elif ready[t] - h <= c.plan_timeout_ms:
                plan_wait[t] = ready[t] - h
                h = ready[t] + c.plan_decode_ms
            else:
                plan_wait[t] = c.plan_timeout_ms
                h += c.plan_timeout_ms
                missed[t] = True
        if not c.vote_after_compute:
            h += c.agreement_ms
        if not missed[t] and not early[t]:
            h = submit(t, h)
        nxt = t + 1
        if nxt < n and arrive[nxt] <= h and ready[nxt] <= h:
            h += c.plan_decode_ms
            early[nxt] = True
            h = submit(nxt, h)
        if not missed[t]:
            if block[t] and ncopies[t]:
                copy_dur[t] = c.copy_ms(ncopies[t] * bytes_per_expert, int(ncopies[t]), None)
                exposed[t] = copy_dur[t]
                window[t] = 0.0
            elif ncopies[t]:
                exposed[t] = max(0.0, copy_end[t] - h)
                window[t] = h - submitted[t]
                recent.append(window[t])
                del recent[:-2]
            h += exposed[t]
        h += primary[t] if missed[t] else compute[t]
        if c.vote_after_compute:
            h += c.agreement_ms
        h += c.ffn_fixed_ms
        f_end[t] = h
        reply[t] = h + c.f2a_latency_ms
        state["free"] = h

    def ffn_until(last: int) -> None:
        while state["next"] <= min(last, n - 1):
            run_ffn(state["next"])
            state["next"] += 1

    def post(t: int, clock: float) -> float:
        clock += c.demand_emit_ms
        demand[t] = clock
        ready[t] = clock + schedule_ms
        clock += c.a2f_post_ms
        posted[t] = clock
        arrive[t] = clock + c.a2f_latency_ms
        return clock

    clock = 0.0
    step_end = np.zeros(steps)
    call_enter, call_exit = np.full(steps * L, np.nan), np.full(steps * L, np.nan)
    if mode == "serial":
        for s in range(steps):
            for layer in range(L):
                first = (s * L + layer) * M
                clock += attn[s, layer]
                call_enter[s * L + layer] = clock
                for b in range(M):
                    clock = post(first + b, clock)
                ffn_until(first + M - 1)
                for b in range(M):
                    clock = max(clock, reply[first + b]) + c.f2a_read_ms
                call_exit[s * L + layer] = clock
            step_end[s] = clock
    else:
        a_clock = 0.0
        per_step = L * M
        for t in range(n):
            if step_barrier and t >= per_step and t % per_step == 0:
                ffn_until(t - 1)
                a_clock = max(a_clock, float(reply[t - M:t].max())) + c.f2a_read_ms
            elif t >= M:
                ffn_until(t - M)
                a_clock = max(a_clock, reply[t - M]) + c.f2a_read_ms
            a_clock = post(t, a_clock + attn[t])
        ffn_until(n - 1)
        # a step ends when its last microbatch's reply has been read
        for s in range(steps):
            step_end[s] = max(reply[s * per_step + per_step - M:(s + 1) * per_step]) + c.f2a_read_ms
        step_end = np.maximum.accumulate(step_end)
    step_ms = np.diff(step_end, prepend=0.0)
    return RuntimeTimeline(demand, posted, f_start, f_end, plan_wait, missed, window, copy_dur, exposed, step_end, step_ms,
                           call_enter, call_exit)


def _report(path: str | Path, what: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: expected a report at {str(path)!r}, none found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: expected JSON in {str(path)!r}, got: {exc}") from None


def stage_costs_from_reports(calibration: Calibration, transport_path: str | Path, scheduler_path: str | Path,
                             ep: int, policies: Iterable[str], copy_cap_gbps: float, deadline_share: float = 0.5,
                             plan_timeout_ms: float = 5.0) -> StageCosts:
    """The stage costs of a GPU FFN pool at EP ``ep`` from the committed measurements.

    ``transport_path`` (``afore bench transport`` on the H200 host): plan published -> copied by
    every reader and the reader's decode (p50), demand written -> target complete (p50);
    ``scheduler_path`` (``afore bench scheduler``): the C++ core's median planning time at the
    nearest measured EP, for the policies that run Algorithm 1 (afore and its ablations; the
    other policies' planning time is not measured and counts as 0); copies: latency and link rate
    of the migration report's fit (``calibration``), paced to ``copy_cap_gbps`` (afore serve's
    ``--copy-rate-gbps``; 0 = full rate). Not measured on GPUs and 0 here (named in ``sources``):
    demand emit, A2F/F2A post and latency, the agreement vote, the FFN stage outside the grouped
    GEMM."""
    transport = _report(transport_path, "transport calibration")
    scheduler = _report(scheduler_path, "scheduler calibration")
    try:
        lat = transport["latency"]
        decode_ms = float(lat["reader_decode"]["p50_us"]) / 1e3
        ring_ms = float(lat["plan_published_to_all_readers_copied"]["p50_us"]) / 1e3
        mailbox_ms = float(lat["demand_written_to_target_complete"]["p50_us"]) / 1e3
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"latency: expected reader_decode, plan_published_to_all_readers_copied and "
                         f"demand_written_to_target_complete p50_us in {Path(transport_path).name}") from None
    rows = scheduler.get("per_ep") or []
    if not rows:
        raise ValueError(f"per_ep: expected scheduler latency rows in {Path(scheduler_path).name}")
    row = min(rows, key=lambda r: abs(int(r["ep"]) - ep))
    core_ms = float(row["core_us"]["median"]) / 1e3
    schedule = {p: mailbox_ms + ring_ms + (core_ms if p.startswith("afore") else 0.0) for p in policies}
    cost = calibration.cost
    tmeta, smeta = transport.get("meta", {}), scheduler.get("meta", {})
    sources = {
        "plan_decode_ms": f"reader_decode p50 of {Path(transport_path).name} ({tmeta.get('date_utc')}, `{tmeta.get('command')}`)",
        "schedule_ms": f"demand -> complete {mailbox_ms * 1e3:.2f} us + plan -> readers {ring_ms * 1e3:.2f} us "
                       f"({Path(transport_path).name}) + C++ core median {core_ms * 1e3:.2f} us at EP {row['ep']} for the afore "
                       f"family ({Path(scheduler_path).name}, {smeta.get('date_utc')}, on a {smeta.get('host', {}).get('cpus')}-CPU host); "
                       "other policies' planning time not measured (0)",
        "copies": f"latency {cost.copy_latency_ms:.4f} ms and link {cost.link_bandwidth_gbps:.0f} GB/s from the migration "
                  f"report's copy fit; pacing cap {copy_cap_gbps:g} GB/s (afore serve --copy-rate-gbps), deadline share "
                  f"{deadline_share} (Migrator.deadline_share)",
        "not_measured_on_gpu": "demand emit, A2F post, A2F/F2A latency, agreement vote, FFN stage outside the grouped GEMM: 0",
    }
    return StageCosts(plan_decode_ms=decode_ms, plan_timeout_ms=plan_timeout_ms, copy_latency_ms=cost.copy_latency_ms,
                      copy_link_gbps=cost.link_bandwidth_gbps, copy_cap_gbps=copy_cap_gbps, deadline_share=deadline_share,
                      schedule_ms=schedule, sources=sources)


def summarise_runtime(trace: PolicyTrace, tl: RuntimeTimeline, tokens_per_step: int, warmup_steps: int,
                      num_layers: int, num_microbatches: int) -> dict:
    """Per-policy figures of a ``simulate_runtime`` timeline over the steps after ``warmup_steps``.

    Exposed wait is the timeline's (copies end after the commit), judged over the targets that
    ran on a plan with copies (``zero_exposed_share``); ``claimed_exposed_ms_per_target`` is the policy's own
    account, for contrast."""
    steps = tl.step_ms.size
    if not 0 <= warmup_steps < steps:
        raise ValueError(f"warmup_steps: expected in [0, {steps}), got {warmup_steps}")
    step_ms = tl.step_ms[warmup_steps:]
    first = warmup_steps * num_layers * num_microbatches
    mean = trace.mean_tile_load[first:]
    ratio = np.where(mean > 0, trace.max_tile_load[first:] / np.where(mean > 0, mean, 1.0), 1.0)
    copies = trace.copies[first:]
    with_copies = (copies > 0) & ~tl.missed[first:]  # a missed plan's copies never ran
    exposed = tl.exposed[first:]
    window = tl.window[first:]
    total_ms = float(step_ms.sum())
    ffn = (tl.ffn_end - tl.ffn_start)[first:]
    return {
        "steps": int(step_ms.size), "targets": int(exposed.size), "targets_with_copies": int(with_copies.sum()),
        "step_ms_mean": float(step_ms.mean()), "step_ms_p50": _pct(step_ms, 50), "step_ms_p95": _pct(step_ms, 95),
        "step_ms_max": float(step_ms.max()),
        "throughput_tok_s": tokens_per_step * step_ms.size / total_ms * 1e3 if total_ms > 0 else float("nan"),
        "max_mean_tile_load": float(ratio.mean()), "max_mean_tile_load_p99": _pct(ratio, 99),
        "copies_per_target": float(copies.mean()),
        "copy_ms_per_target_with_copies": float(tl.copy_ms[first:][with_copies].mean()) if with_copies.any() else 0.0,
        "exposed_ms_per_target": float(exposed.mean()),
        "exposed_ms_per_target_with_copies": float(exposed[with_copies].mean()) if with_copies.any() else 0.0,
        "zero_exposed_share": float(np.mean(exposed[with_copies] <= 0.0)) if with_copies.any() else None,
        "claimed_exposed_ms_per_target": float(trace.exposed_ms[first:].mean()),
        "window_ms_p50": float(np.nanmedian(window[with_copies])) if with_copies.any() and np.isfinite(window[with_copies]).any() else 0.0,
        "plan_wait_ms_per_target": float(tl.plan_wait[first:].mean()), "missed_share": float(tl.missed[first:].mean()),
        "ffn_stage_ms_mean": float(ffn.mean()), "ffn_busy_share": tl.ffn_busy_share,
    }
