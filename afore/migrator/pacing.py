"""Copy pacing: how fast a batch of expert copies may pull over NVLink while experts compute.

Why: a copy writes the destination GPU's HBM at the link rate (~390 GB/s on H200s), and the
decode-size grouped GEMM is HBM-bound, so back-to-back full-rate copies slow it by up to 11.0%
(measured, ``bench/results/migration.md``); paced to 50 GB/s, by at most 2.1%. Spreading the
bytes over the lookahead window costs nothing as long as they still arrive in time.

The rule (``copy_rate``): copy at ``cap_gbps``, unless the batch would then not finish within
``deadline_ms`` (a share of the expected lookahead window); then at the rate that just meets
the deadline, and at full rate if even that is above the link. So pacing never turns a copy
that fits the window at full rate into an exposed wait, as long as the window estimate holds.

A paced batch is cut into at most ``max_chunks`` chunks of at least ``chunk_bytes``
(``plan_paced``; the cap bounds the host work of one batch: a driver call and a sleep-kernel
launch per chunk); after every chunk but the last the side stream idles (a GPU sleep kernel,
never a host wait), so the average rate is the chosen one. ``duration_us`` is the plan's
expected length, which the engine uses to know how far its side stream is booked ahead.
"""

from __future__ import annotations

import dataclasses
import math


def copy_rate(nbytes: int, cap_gbps: float | None, deadline_ms: float | None, link_gbps: float) -> float | None:
    """GB/s to pace a batch of ``nbytes`` at, or None for full rate (no pacing)."""
    if nbytes < 0:
        raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
    if link_gbps <= 0:
        raise ValueError(f"link_gbps: expected > 0, got {link_gbps}")
    if cap_gbps is None or cap_gbps <= 0 or cap_gbps >= link_gbps or nbytes == 0:
        return None
    rate = float(cap_gbps)
    if deadline_ms is not None:
        if deadline_ms <= 0:
            return None
        rate = max(rate, nbytes / (deadline_ms * 1e6))  # bytes/ms * 1e-6 = GB/s
    return None if rate >= link_gbps else rate


def gap_us(chunk: int, rate_gbps: float, link_gbps: float) -> float:
    """Idle time after a ``chunk``-byte transfer so that the average rate is ``rate_gbps``."""
    if rate_gbps <= 0 or link_gbps <= 0:
        raise ValueError(f"rates: expected > 0, got rate {rate_gbps}, link {link_gbps}")
    return max(0.0, chunk / (rate_gbps * 1e3) - chunk / (link_gbps * 1e3))


def split_chunks(sizes: list[int], chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Cut transfers of ``sizes`` bytes (in order) into consecutive chunks of ``chunk_bytes``.

    Returns chunks; each is a list of pieces ``(transfer index, offset, length)``; a chunk
    may end one transfer and start the next, so every chunk but the last has exactly
    ``chunk_bytes`` bytes and the pieces cover every byte once, in order."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = chunk_bytes
    for index, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"sizes[{index}]: expected >= 0, got {size}")
        offset = 0
        while offset < size:
            take = min(room, size - offset)
            current.append((index, offset, take))
            offset += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current:
        chunks.append(current)
    return chunks


@dataclasses.dataclass(frozen=True)
class PacedPlan:
    """Chunks (pieces as in ``split_chunks``), the idle time after each (0 after the last), and
    the expected duration: transfers at link rate, ``overhead_us`` per chunk, the gaps."""

    chunks: list[list[tuple[int, int, int]]]
    gaps_us: list[float]
    duration_us: float


def plan_paced(sizes: list[int], rate_gbps: float, link_gbps: float, chunk_bytes: int,
               max_chunks: int, overhead_us: float) -> PacedPlan:
    """How to send transfers of ``sizes`` bytes at ``rate_gbps`` on average."""
    if max_chunks < 1:
        raise ValueError(f"max_chunks: expected >= 1, got {max_chunks}")
    if not overhead_us >= 0:
        raise ValueError(f"overhead_us: expected >= 0, got {overhead_us}")
    total = sum(sizes)
    chunk = max(chunk_bytes, math.ceil(total / max_chunks)) if total else chunk_bytes
    chunks = split_chunks(sizes, chunk)
    gaps, duration = [], 0.0
    for i, pieces in enumerate(chunks):
        size = sum(p[2] for p in pieces)
        gap = max(0.0, gap_us(size, rate_gbps, link_gbps) - overhead_us) if i < len(chunks) - 1 else 0.0
        gaps.append(gap)
        duration += size / (link_gbps * 1e3) + overhead_us + gap
    return PacedPlan(chunks, gaps, duration)
