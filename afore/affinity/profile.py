"""Affinity profiles: per-layer token-expert and expert-expert co-activation, as ``.npz``.

The file follows the trace format's conventions (``afore.traces.format``: one compressed npz,
the same metadata fields, ``load_profile`` validates every field and names it). Arrays
(L profiled MoE layers, E experts, C token classes):

  coactivation   float64[L, E, E]  tokens that activated both i and j in layer l (diagonal:
                                   tokens that activated e); symmetric
  load           float64[L, E]     token-expert pairs per expert
  class_expert   float64[L, C, E]  token-expert affinity: pairs routed to e by tokens of class c
  tokens         int64[L]          tokens profiled per layer
  layers         int64[L]          MoE-layer ordinal (or the model's layer index) of each row
  class_kind     str   what a class is: "source_layer_expert" (the token's expert in an earlier
                       layer), "attention_worker" (the engine a token came from), "token_type"
  coactivation_kind str "token" (per-token expert sets) or "microbatch" (counts only: experts
                       active in the same microbatch, weighted by their counts; weaker)
  model, source, workload  str;  top_k, hidden_size, moe_intermediate_size  int (0 = unknown
                       for the last two)

Builders: ``profile_from_tokens`` (per-token top-k ids, e.g. a ``TokenModel``'s samples or
recorded routing) and ``DemandProfiler`` (live: the demand vectors attention workers emit, per
layer and worker, which carry counts only).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from afore.traces.format import load_npz, save_npz

_META_STR = ("model", "source", "workload", "class_kind", "coactivation_kind")
_META_INT = ("top_k", "hidden_size", "moe_intermediate_size")
CLASS_KINDS = ("source_layer_expert", "attention_worker", "token_type")
COACTIVATION_KINDS = ("token", "microbatch")


@dataclasses.dataclass(frozen=True)
class AffinityProfile:
    coactivation: np.ndarray   # float64[L, E, E]
    load: np.ndarray           # float64[L, E]
    class_expert: np.ndarray   # float64[L, C, E]
    tokens: np.ndarray         # int64[L]
    layers: np.ndarray         # int64[L]
    model: str
    source: str
    workload: str
    class_kind: str
    coactivation_kind: str
    top_k: int
    hidden_size: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        co = np.asarray(self.coactivation, np.float64)
        if co.ndim != 3 or co.shape[1] != co.shape[2] or min(co.shape) < 1:
            raise ValueError(f"coactivation: expected float[L, E, E] with L, E >= 1, got shape {co.shape}")
        l_, e = co.shape[0], co.shape[1]
        arrays = {"coactivation": co,
                  "load": np.asarray(self.load, np.float64),
                  "class_expert": np.asarray(self.class_expert, np.float64),
                  "tokens": np.asarray(self.tokens),
                  "layers": np.asarray(self.layers)}
        expected = {"load": (l_, e), "tokens": (l_,), "layers": (l_,)}
        for name, want in expected.items():
            if arrays[name].shape != want:
                raise ValueError(f"{name}: expected shape {want}, got {arrays[name].shape}")
        ce = arrays["class_expert"]
        if ce.ndim != 3 or ce.shape[0] != l_ or ce.shape[2] != e or ce.shape[1] < 1:
            raise ValueError(f"class_expert: expected float[{l_}, C, {e}] with C >= 1, got shape {ce.shape}")
        for name in ("coactivation", "load", "class_expert"):
            arr = arrays[name]
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"{name}: expected finite non-negative values")
        if not np.allclose(co, co.transpose(0, 2, 1)):
            raise ValueError("coactivation: expected a symmetric matrix per layer")
        for name in ("tokens", "layers"):
            arr = arrays[name]
            if arr.dtype.kind not in "iu" or np.any(arr < 0):
                raise ValueError(f"{name}: expected non-negative integers, got {arr.dtype} {arr.tolist()}")
            arrays[name] = arr.astype(np.int64)
        for name, arr in arrays.items():
            object.__setattr__(self, name, arr)
        for name in ("model", "source", "workload", "class_kind", "coactivation_kind"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: expected a string, got {getattr(self, name)!r}")
        if self.class_kind not in CLASS_KINDS:
            raise ValueError(f"class_kind: expected one of {CLASS_KINDS}, got {self.class_kind!r}")
        if self.coactivation_kind not in COACTIVATION_KINDS:
            raise ValueError(f"coactivation_kind: expected one of {COACTIVATION_KINDS}, got {self.coactivation_kind!r}")
        for name in _META_INT:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < (1 if name == "top_k" else 0):
                raise ValueError(f"{name}: expected an integer >= {1 if name == 'top_k' else 0}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.top_k > e:
            raise ValueError(f"top_k: expected <= num_experts ({e}), got {self.top_k}")

    @property
    def num_layers(self) -> int:
        return self.coactivation.shape[0]

    @property
    def num_experts(self) -> int:
        return self.coactivation.shape[1]

    def pooled(self) -> tuple[np.ndarray, np.ndarray]:
        """(coactivation float64[E, E], load float64[E]) over all layers, each layer normalised to
        one token-expert pair in total, so that every layer weighs the same in one layout."""
        scale = 1.0 / np.maximum(self.load.sum(axis=1), 1e-300)
        return (self.coactivation * scale[:, None, None]).sum(axis=0), (self.load * scale[:, None]).sum(axis=0)


_ARRAYS = ("coactivation", "load", "class_expert", "tokens", "layers")


def save_profile(profile: AffinityProfile, path: str | os.PathLike) -> Path:
    """Write ``profile`` as a compressed ``.npz`` (suffix added if missing)."""
    return save_npz(path, {name: getattr(profile, name) for name in _ARRAYS},
                    {name: getattr(profile, name) for name in _META_STR + _META_INT})


def load_profile(path: str | os.PathLike) -> AffinityProfile:
    """Read and validate a profile written by ``save_profile``."""
    return AffinityProfile(**load_npz(path, "profile", _ARRAYS, _META_STR, _META_INT))  # type: ignore[arg-type]


def layer_statistics(topk_ids: np.ndarray, classes: np.ndarray, num_experts: int,
                     num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coactivation float64[E, E], load float64[E], class_expert float64[C, E]) of one layer.

    topk_ids: int[N, k] per-token experts; classes: int[N] class of each token.
    """
    ids = np.asarray(topk_ids, np.int64)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids: expected int[N, k], got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got {int(ids.min())}..{int(ids.max())}")
    cls = np.asarray(classes, np.int64)
    if cls.shape != (ids.shape[0],) or (cls.size and (cls.min() < 0 or cls.max() >= num_classes)):
        raise ValueError(f"classes: expected int[{ids.shape[0]}] in [0, {num_classes})")
    onehot = np.zeros((ids.shape[0], num_experts))
    np.put_along_axis(onehot, ids, 1.0, axis=1)
    coactivation = onehot.T @ onehot
    class_expert = np.zeros((num_classes, num_experts))
    np.add.at(class_expert, cls, onehot)
    return coactivation, onehot.sum(axis=0), class_expert


def profile_from_tokens(per_layer: list[tuple[np.ndarray, np.ndarray]], num_experts: int, num_classes: int,
                        layers: list[int], **meta: object) -> AffinityProfile:
    """A token-level profile from per-layer (topk_ids int[N, k], classes int[N])."""
    if len(per_layer) != len(layers) or not per_layer:
        raise ValueError(f"layers: expected one layer index per profiled layer ({len(per_layer)}), got {layers}")
    stats = [layer_statistics(ids, cls, num_experts, num_classes) for ids, cls in per_layer]
    return AffinityProfile(coactivation=np.stack([s[0] for s in stats]), load=np.stack([s[1] for s in stats]),
                           class_expert=np.stack([s[2] for s in stats]),
                           tokens=np.array([len(ids) for ids, _ in per_layer], np.int64),
                           layers=np.array(layers, np.int64), coactivation_kind="token", **meta)  # type: ignore[arg-type]


class DemandProfiler:
    """Live profile from the demand the attention workers emit: d[t, a] = int[E] pairs per expert
    of target t from attention worker a (``DemandMailbox`` reports, ``afore trace`` counts).

    Demand carries counts, not per-token expert sets, so the co-activation it yields is the
    microbatch kind: sum over reports of d_i * d_j / pairs (experts busy in the same microbatch,
    weighted by their counts). The token-expert part is per attention worker (class = the
    engine a token came from), which is what request routing needs.
    """

    def __init__(self, num_experts: int, num_layers: int, num_workers: int, top_k: int) -> None:
        for name, value in (("num_experts", num_experts), ("num_layers", num_layers), ("num_workers", num_workers), ("top_k", top_k)):
            if value < 1:
                raise ValueError(f"{name}: expected >= 1, got {value}")
        self.num_experts, self.num_layers, self.num_workers, self.top_k = num_experts, num_layers, num_workers, top_k
        self.coactivation = np.zeros((num_layers, num_experts, num_experts))
        self.class_expert = np.zeros((num_layers, num_workers, num_experts))
        self.reports = 0

    def add(self, layer: int, worker: int, demand: object) -> None:
        """Count one report. Raises ValueError naming the field on a bad layer, worker or vector."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected in [0, {self.num_layers}), got {layer}")
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker: expected in [0, {self.num_workers}), got {worker}")
        d = np.asarray(demand)
        if d.shape != (self.num_experts,) or d.dtype.kind not in "iu" or (d.size and d.min() < 0):
            raise ValueError(f"demand: expected non-negative int[{self.num_experts}], got {d.dtype} shape {d.shape}")
        d = d.astype(np.float64)
        total = d.sum()
        if total > 0:   # independent tokens of k experts: E[tokens with i and j] ~ k d_i d_j / pairs
            pair = np.outer(d, d) / total * self.top_k
            np.fill_diagonal(pair, d)
            self.coactivation[layer] += pair
        self.class_expert[layer, worker] += d
        self.reports += 1

    def add_counts(self, counts: np.ndarray) -> None:
        """Count a trace's counts[S, L, B, E], microbatch b as attention worker b % num_workers."""
        counts = np.asarray(counts)
        if counts.ndim != 4 or counts.shape[1] != self.num_layers or counts.shape[3] != self.num_experts:
            raise ValueError(f"counts: expected [S, {self.num_layers}, B, {self.num_experts}], got shape {counts.shape}")
        for s in range(counts.shape[0]):
            for layer in range(counts.shape[1]):
                for b in range(counts.shape[2]):
                    self.add(layer, b % self.num_workers, counts[s, layer, b])

    def profile(self, **meta: object) -> AffinityProfile:
        load = self.class_expert.sum(axis=1)
        return AffinityProfile(coactivation=self.coactivation.copy(), load=load, class_expert=self.class_expert.copy(),
                               tokens=np.round(load.sum(axis=1) / self.top_k).astype(np.int64),
                               layers=np.arange(self.num_layers), class_kind="attention_worker",
                               coactivation_kind="microbatch", top_k=self.top_k, **meta)  # type: ignore[arg-type]
