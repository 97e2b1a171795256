"""Convert HarMoEny's measured expert-frequency CSVs into afore traces.

Source: the HarMoEny artefact (Doucet et al., "HarMoEny: Efficient Multi-GPU Inference of
MoE Models", 2025; github.com/sacs-epfl/HarMoEny), copied unchanged under
``../shared/traces/harmoeny/`` (see its README: licence and caveats). Each CSV row is one
forward pass (``iteration``) of one MoE layer (``layer_idx``) under one ``dataset``, with one
column per expert holding the tokens routed to it. Routing is top-1 (argmax of the real gate).

The converter writes one trace per dataset: counts[iteration, layer, 1, expert]. For
switch-base-128 only the encoder layers 0-5 are kept by default: the decoder layers see one
start token per sequence and are degenerate (the README says to ignore them).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from afore.traces.format import Trace
from afore.shared import trace_dir_candidates

# file name -> (model id, hidden size, moe intermediate size, default layers)
MODELS: dict[str, tuple[str, str, int, int, tuple[int, ...] | None]] = {
    "switch128": ("expert_freq_switch128_datasets.csv", "google/switch-base-128", 768, 3072, tuple(range(6))),
    "qwen": ("expert_freq_qwen_policy_datasets.csv", "Qwen/Qwen1.5-MoE-A2.7B-Chat (top-1 of the real gate)", 2048, 1408, None),
}


def find_harmoeny_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The HarMoEny data folder: ``explicit`` (or None if it holds no CSVs), else
    $AFORE_TRACES/harmoeny or ../shared/traces/harmoeny; None when absent."""
    if explicit is not None:  # an explicit folder is authoritative: no silent fallback
        path = Path(explicit)
        return path if path.is_dir() and any(path.glob("expert_freq_*.csv")) else None
    for path in trace_dir_candidates("harmoeny"):
        if path.is_dir() and any(path.glob("expert_freq_*.csv")):
            return path
    return None


def read_harmoeny_csv(path: str | os.PathLike, model: str, layers: tuple[int, ...] | None = None) -> dict[str, Trace]:
    """Parse one HarMoEny CSV into {dataset: Trace}.

    Args:
      path: the CSV (columns ``<row>,dataset,iteration,layer_idx,0..E-1``).
      model: key of ``MODELS`` (``switch128`` or ``qwen``).
      layers: layer_idx values to keep, in order (default: the model's default set, or all).
    """
    if model not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {model!r}")
    _, model_id, hidden, inter, default_layers = MODELS[model]
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"csv: expected an existing file, got {str(path)!r}")
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or header[1:4] != ["dataset", "iteration", "layer_idx"]:
            raise ValueError(f"csv: expected header ',dataset,iteration,layer_idx,0,1,...' in {path.name}, got {header[:4] if header else None}")
        experts = header[4:]
        if experts != [str(i) for i in range(len(experts))]:
            raise ValueError(f"csv: expected expert columns 0..E-1 in {path.name}")
        rows: dict[str, dict[tuple[int, int], np.ndarray]] = {}
        for lineno, row in enumerate(reader, start=2):
            if len(row) != len(header):
                raise ValueError(f"csv: line {lineno} of {path.name} has {len(row)} fields, expected {len(header)}")
            try:
                it, layer = int(row[2]), int(row[3])
                counts = np.array([int(float(v)) for v in row[4:]], np.int64)
            except ValueError:
                raise ValueError(f"csv: line {lineno} of {path.name}: expected integer iteration, layer and counts") from None
            rows.setdefault(row[1], {})[(it, layer)] = counts
    traces: dict[str, Trace] = {}
    for dataset, table in sorted(rows.items()):
        iters = sorted({it for it, _ in table})
        keep = layers if layers is not None else (default_layers or tuple(sorted({l for _, l in table})))
        missing = [(it, l) for it in iters for l in keep if (it, l) not in table]
        if missing:
            raise ValueError(f"csv: dataset {dataset!r} lacks (iteration, layer) {missing[0]} in {path.name}")
        counts = np.stack([np.stack([table[(it, l)] for l in keep]) for it in iters])[:, :, None, :]
        traces[dataset] = Trace(counts=counts.astype(np.int32), model=model_id,
                                source=f"harmoeny:{path.name} (github.com/sacs-epfl/HarMoEny@563b5a6) layers={list(keep)}",
                                workload=dataset, top_k=1, hidden_size=hidden, moe_intermediate_size=inter)
    return traces


def load_harmoeny(model: str = "switch128", directory: str | os.PathLike | None = None,
                  layers: tuple[int, ...] | None = None) -> dict[str, Trace] | None:
    """All datasets of one HarMoEny model, or None when the data folder is absent."""
    if model not in MODELS:
        raise ValueError(f"model: expected one of {sorted(MODELS)}, got {model!r}")
    folder = find_harmoeny_dir(directory)
    if folder is None:
        return None
    return read_harmoeny_csv(folder / MODELS[model][0], model, layers)
