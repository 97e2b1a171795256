"""Part ``copies``: one-sided pulls of expert weights from a peer process's slot pool (CUDA IPC on
the second GPU: NVLink P2P), single and batched, per model expert shape, against the NVLink peak
and the measured large-copy rate (1 GiB pull)."""

from __future__ import annotations

import statistics
import sys

import torch
from tqdm import tqdm

from afore.bench.migration.shapes import NVLINK_PEAK_GBPS
from afore.bench.migration.timing import sync
from afore.migrator.copy_engine import CopyJob, make_copy_engine


def bench_copies(shapes: dict, src_pools: dict, big_src: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, cross: bool, use_driver: bool = True, streams: int = 2, batch_api: bool = True) -> dict:
    """Full-rate copies (no pacing): the engine's batch call, or the variant asked for."""
    from afore.migrator.copy_engine import CudaCopyEngine

    engine = (CudaCopyEngine(device, use_driver=use_driver, streams=streams, batch_api=batch_api, max_gbps=None)
              if device.type == "cuda" else make_copy_engine(device))
    stream = getattr(engine, "stream", None)

    def timed_batch(jobs: list[CopyJob], reps: int) -> float:
        times = []
        for _ in range(reps):
            t0 = engine.mark() if stream is None else None
            batch = engine.submit(jobs, [])
            engine.wait(batch)
            sync(device)
            if stream is None:
                times.append((batch.end - batch.start) * 1e3)
            else:
                times.append(batch.start.elapsed_time(batch.end))
            del t0
        return statistics.median(times)

    big_dst = torch.empty_like(big_src, device=device)
    # The large-copy reference: the better of one transfer and 8 chunks spread over the lanes.
    chunk = big_src.numel() // 8
    variants = {"one transfer": [CopyJob(big_dst, big_dst[:0], big_src, big_src[:0])],
                "8 chunks": [CopyJob(big_dst[i * chunk:(i + 1) * chunk], big_dst[:0], big_src[i * chunk:(i + 1) * chunk], big_src[:0])
                             for i in range(8)]}
    big = {}
    for label, jobs in variants.items():
        timed_batch(jobs, 2)
        big[label] = timed_batch(jobs, 5)
    big_ms = min(big.values())
    large_rate = big_src.numel() / (big_ms * 1e-3) / 1e9
    rows = []
    batch_sizes = [1, 2, 4, 8, 16] if device.type == "cuda" else [1, 2, 4]
    for name, (src13, src2) in tqdm(src_pools.items(), desc="copies", file=sys.stdout):
        h, inter = src2.shape[1], src2.shape[2]
        n_max = min(max(batch_sizes), src13.shape[0])
        dst = torch.empty(n_max, 3 * inter * h, device=device, dtype=dtype)  # slot-pool layout
        dst13 = dst[:, : 2 * inter * h].view(n_max, 2 * inter, h)
        dst2 = dst[:, 2 * inter * h:].view(n_max, h, inter)
        per_expert = 3 * h * inter * dst.element_size()
        for n in batch_sizes:
            if n > n_max:
                continue
            jobs = [CopyJob(dst13[i], dst2[i], src13[i], src2[i]) for i in range(n)]
            dst.zero_()
            timed_batch(jobs, 2)
            correct = all(torch.equal(dst13[i], src13[i].to(device)) and torch.equal(dst2[i], src2[i].to(device)) for i in range(n))
            ms = timed_batch(jobs, 10)
            gbps = n * per_expert / (ms * 1e-3) / 1e9
            rows.append({"model": name, "experts": n, "bytes_per_expert": per_expert, "ms": ms, "ms_per_expert": ms / n, "correct": correct,
                         "gbps": gbps, "share_of_nvlink_peak": gbps / NVLINK_PEAK_GBPS, "share_of_large_copy": gbps / large_rate})
        del dst, dst13, dst2
    del big_dst
    return {"rows_models": list(src_pools), "cross_device": cross, "engine": engine.describe() if hasattr(engine, "describe") else type(engine).__name__,
            "streams": streams, "large_copy_ms_by_variant": big, "large_copy_bytes": big_src.numel(), "large_copy_ms": big_ms,
            "large_copy_gbps": large_rate, "nvlink_peak_gbps": NVLINK_PEAK_GBPS, "rows": rows}
