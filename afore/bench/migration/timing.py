"""Timing helpers of ``afore bench migration``: medians of wall or CUDA-event time, CUDA graph
capture and replay, a least-squares line."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on the current stream on GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_time_ms(fn, device: torch.device, reps: int = 20) -> float:
    """Median GPU time of ``fn`` replayed as a CUDA graph (no host launch overhead); on CPU the
    same as ``time_ms``. ``fn`` must not synchronise with the host."""
    if device.type != "cuda":
        return time_ms(fn, device, reps)
    return time_ms(capture(fn, device).replay, device, reps)


def capture(fn, device: torch.device) -> "torch.cuda.CUDAGraph":
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)
    return graph


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(slope), float(intercept)
