"""The OLMoE routing-analysis outputs (../shared/traces/olmoe, Apache-2.0) as token models.

What the data holds (see its README): per domain and for layers 0, 7 and 15, aggregate expert
counts and cross-layer co-routing counts n[a, b] = tokens routed to expert a in layer_a and to
b in layer_b (``all_topk``: the k slots zipped, slot i with slot i; ``top1_only``: the top
expert in both). It holds no per-token expert *set* within one layer.

``token_model`` turns the cross-layer counts into a ``TokenModel`` of layer_b: class a = the
token's expert in layer_a (weight: a's share of the pairs), expert_prob[a] = n[a, :] / n[a].sum().
That is measured structure (which layer-b experts tokens of one earlier expert go to); that the
k experts of a token are independent draws given its class is the model's assumption, which
understates co-activation when the real k experts are correlated beyond the class.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from afore.affinity.token_model import TokenModel
from afore.shared import trace_dir_candidates

MODELS = {"olmoe": (64, 8), "mistral": (8, 2)}   # name in the CSVs -> (experts, top_k)
LAYER_PAIRS = ((0, 7), (7, 15))
DOMAINS = ("arxiv", "book", "c4", "github", "wikipedia")


def find_olmoe_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The OLMoE data folder: ``explicit``, else the shared traces' ``olmoe``
    (afore.shared: $AFORE_TRACES, ../shared/traces, /work/shared/traces); None when absent."""
    candidates = ([Path(explicit)] if explicit else []) + trace_dir_candidates("olmoe")
    for path in candidates:
        if (path / "expert_counts_crosslayer.csv").is_file():
            return path
    return None


def read_crosslayer(folder: str | os.PathLike, model: str = "olmoe", count_kind: str = "all_topk") -> dict:
    """{(domain, layer_a, layer_b): float64[E, E]} co-routing counts of ``model``."""
    if model not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {model!r}")
    if count_kind not in ("all_topk", "top1_only"):
        raise ValueError(f"count_kind: expected 'all_topk' or 'top1_only', got {count_kind!r}")
    e = MODELS[model][0]
    out: dict = {}
    path = Path(folder) / "expert_counts_crosslayer.csv"
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if header != ["model", "count_kind", "domain", "layer_a", "layer_b", "expert_a", "expert_b", "count"]:
            raise ValueError(f"{path}: unexpected columns {header}")
        for m, kind, domain, la, lb, a, b, n in reader:
            if m != model or kind != count_kind:
                continue
            key = (domain, int(la), int(lb))
            if key not in out:
                out[key] = np.zeros((e, e))
            out[key][int(a), int(b)] += float(n)
    if not out:
        raise ValueError(f"{path}: no rows for model {model!r}, count_kind {count_kind!r}")
    return out


def token_model(counts: dict, layer_pair: tuple[int, int], domains: tuple[str, ...] | list[str],
                per_domain: bool = False) -> TokenModel:
    """The ``TokenModel`` of layer_b over ``domains``: their counts summed (classes = the
    layer_a expert), or with ``per_domain`` one class per (domain, layer_a expert), weighted
    by its tokens. A token belongs to one domain, so the per-domain mixture keeps structure
    that summing the counts blurs (its expert sets are more concentrated); both are fit to the
    same measured counts and give the same expert marginal."""
    keys = [(d, *layer_pair) for d in domains]
    missing = [k for k in keys if k not in counts]
    if missing:
        raise ValueError(f"domains: no co-routing counts for {missing}")
    n = np.concatenate([counts[k] for k in keys]) if per_domain else sum(counts[k] for k in keys)
    kind = "per-domain classes" if per_domain else "domains summed"
    return TokenModel(n.sum(axis=1), n, f"olmoe cross-layer {layer_pair[0]}->{layer_pair[1]} domains={','.join(domains)} ({kind})")
