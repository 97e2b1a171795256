"""The afore routing-trace format: one ``.npz`` file per (model, workload).

Arrays stored in the file:
  counts                 int32[S, L, B, E]  token-expert pairs routed to expert e in
                         serving step s, MoE layer l, microbatch b (a row sums to
                         tokens x top_k for a model that routes top_k experts per token)
  model                  str   model name (e.g. "google/switch-base-128")
  source                 str   where the counts come from (measured trace + file, or
                         "synthetic:<workload> seed=<n>")
  workload               str   workload / dataset name ("wikitext", "chat", ...)
  top_k                  int   experts per token of the routing that produced counts
  hidden_size            int   model hidden size H
  moe_intermediate_size  int   routed expert intermediate size I

Steps are consecutive in time; layers are the model's MoE layers in order; microbatches
are the FFN execution order within a step. ``load_trace`` validates everything and raises
ValueError naming the field and the expected value.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from pathlib import Path

import numpy as np

_META_STR = ("model", "source", "workload")
_META_INT = ("top_k", "hidden_size", "moe_intermediate_size")


@dataclasses.dataclass(frozen=True)
class Trace:
    """Expert routing counts of one model under one workload."""

    counts: np.ndarray  # int32[S, L, B, E]
    model: str
    source: str
    workload: str
    top_k: int
    hidden_size: int
    moe_intermediate_size: int

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts)
        if counts.ndim != 4:
            raise ValueError(f"counts: expected 4 dimensions [step, layer, microbatch, expert], got shape {counts.shape}")
        if min(counts.shape) < 1:
            raise ValueError(f"counts: expected every dimension >= 1, got shape {counts.shape}")
        if counts.dtype.kind not in "iu":
            raise ValueError(f"counts: expected an integer dtype, got {counts.dtype}")
        if counts.size and (counts.min() < 0 or counts.max() > np.iinfo(np.int32).max):
            raise ValueError("counts: expected values in [0, 2**31), got out-of-range counts")
        object.__setattr__(self, "counts", counts.astype(np.int32, copy=False))
        for name in _META_STR:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: expected a string, got {getattr(self, name)!r}")
        for name in _META_INT:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k: expected <= num_experts ({self.num_experts}), got {self.top_k}")

    @property
    def num_steps(self) -> int:
        return self.counts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts.shape[1]

    @property
    def num_microbatches(self) -> int:
        return self.counts.shape[2]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[3]


def save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict[str, object]) -> Path:
    """Write ``arrays`` and scalar ``meta`` fields as one compressed ``.npz`` (suffix added if
    missing; parent folders created). The layout every afore ``.npz`` file uses."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays, **{name: np.array(value) for name, value in meta.items()})
    return path


def read_npz(path: str | os.PathLike, field: str) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path`` (no pickles), or ValueError naming ``field`` when
    it is not a readable .npz file (absent, empty, not a zip archive, a pickled array)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{field}: expected an existing .npz file, got {str(path)!r}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:   # empty or not a zip archive: EOF/BadZip
        raise ValueError(f"{field}: {str(path)!r} is not a readable .npz file ({exc or type(exc).__name__})") from None


def load_npz(path: str | os.PathLike, kind: str, arrays: tuple[str, ...], meta_str: tuple[str, ...],
             meta_int: tuple[str, ...], hint: str = "") -> dict[str, object]:
    """The fields of an afore ``.npz`` file: ``arrays`` as arrays, ``meta_str`` as str and
    ``meta_int`` as int. Raises ValueError naming ``kind`` (no readable file) or the field
    (missing, or not an integer scalar); ``hint`` is appended to the message of a missing field."""
    fields = read_npz(path, kind)
    for name in arrays + meta_str + meta_int:
        if name not in fields:
            raise ValueError(f"{name}: missing from {kind} {str(path)!r}{hint}")
    out: dict[str, object] = {name: fields[name] for name in arrays}
    for name in meta_str:
        out[name] = str(fields[name][()])
    for name in meta_int:
        value = fields[name]
        if value.shape != () or value.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected an integer scalar, got {value!r}")
        out[name] = int(value[()])
    return out


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    """Write ``trace`` as a compressed ``.npz`` (suffix added if missing)."""
    return save_npz(path, {"counts": trace.counts}, {name: getattr(trace, name) for name in _META_STR + _META_INT})


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace written by ``save_trace`` (or any tool following the format)."""
    fields = load_npz(path, "trace", ("counts",), _META_STR, _META_INT,
                      hint=f" (expected fields counts, {', '.join(_META_STR + _META_INT)})")
    return Trace(**fields)  # type: ignore[arg-type]


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    """TV distance 0.5 * sum |p/|p| - q/|q|| between two count (or probability) vectors."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return 0.0 if p.sum() == q.sum() else 1.0
    return float(0.5 * np.abs(p / p.sum() - q / q.sum()).sum())


def skew_stats(counts: np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer skew of a trace's counts[S, L, B, E].

    Returns float64[L] arrays: ``max_mean`` (mean over batches of max/mean expert load),
    ``tv_consecutive`` (mean TV distance between consecutive steps' layer totals).
    """
    counts = np.asarray(counts, np.float64)
    per_batch = counts.transpose(0, 2, 1, 3).reshape(-1, counts.shape[1], counts.shape[3])  # [S*B, L, E]
    mean = per_batch.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        max_mean = np.where(mean > 0, per_batch.max(axis=-1) / np.where(mean > 0, mean, 1), 0.0).mean(axis=0)
    steps = counts.sum(axis=2)  # [S, L, E]
    tv = np.zeros(counts.shape[1])
    if steps.shape[0] > 1:
        for layer in range(counts.shape[1]):
            tv[layer] = np.mean([total_variation(steps[s, layer], steps[s + 1, layer]) for s in range(steps.shape[0] - 1)])
    return {"max_mean": max_mean, "tv_consecutive": tv}


def iter_targets(counts: np.ndarray):
    """(Target, seq, demand int64[E]) in FFN execution order (steps, then layers, then
    microbatches) over counts[S, L, M, E]."""
    from afore.plan import Target

    s_, l_, m_, _ = counts.shape
    seq = 0
    for s in range(s_):
        for l in range(l_):
            for b in range(m_):
                yield Target(s, l, b), seq, counts[s, l, b]
                seq += 1
