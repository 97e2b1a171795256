"""`afore status`: the control plane's shared-memory segments, their readers and counters."""

from __future__ import annotations

import argparse
import json
import os
import urllib.request

from afore import _shm

SHM_DIR = "/dev/shm"


def list_segments(directory: str = SHM_DIR) -> list[dict]:
    """``_shm.inspect`` of every afore segment in ``directory`` (recognised by its magic)."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    magic = int(_shm.MAGIC).to_bytes(8, "little")
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                if f.read(8) != magic:
                    continue
            out.append(_shm.inspect(name))
        except (OSError, ValueError):
            continue
    return out


def remove_stale(segments: list[dict]) -> list[str]:
    """Unlink segments whose owner is gone (what a crashed run left); returns their names."""
    removed = []
    for seg in segments:
        if not seg["owner_alive"] or seg["state"] == "closed" or not seg["compatible"]:
            try:
                os.unlink(os.path.join(SHM_DIR, seg["name"]))
                removed.append(seg["name"])
            except FileNotFoundError:
                pass
    return removed


def format_segment(seg: dict) -> str:
    owner = f"pid {seg['owner_pid']} {'alive' if seg['owner_alive'] else 'DEAD (stale)'}"
    lines = [f"{seg['name']}: {seg['kind']} v{seg['version']} {seg['state']}, owner {owner}, {seg['size_bytes']} bytes"]
    if not seg.get("compatible"):
        lines.append("  incompatible format version: replaced at the next start")
        return "\n".join(lines)
    c = seg["counters"]
    if seg["kind"] == "mailbox":
        lines.append(f"  A={seg['num_producers']} E={seg['num_experts']} L={seg['num_layers']} "
                     f"microbatches={seg['num_microbatches']} capacity={seg['capacity']} "
                     f"consumer heartbeat {seg['consumer_heartbeat_age_s']:.3f} s ago")
        lines.append("  targets: " + ", ".join(f"{k}={v}" for k, v in c.items()))
        for p in seg["producers"]:
            lines.append(f"  worker {p['worker']}: pid {p['pid']} {'alive' if p['alive'] else '-'} queued={p['queued']} "
                         f"last_seq={p['last_seq']} accepted={p['accepted']} rejected={p['rejected_invalid']}"
                         f"+{p['rejected_duplicate']}dup dropped_full={p['dropped_full']}")
    elif seg["kind"] == "plan_ring":
        # "alive" is the ring's own verdict (live record, process running). The heartbeat is the
        # reader's last read: an idle reader's grows without bound and costs it nothing; only a
        # reader that holds the writer up for the eviction timeout is evicted.
        alive = sum(1 for r in seg["readers"] if r["alive"])
        lines.append(f"  readers {alive}/{seg['num_readers']} alive (registered, process running), "
                     f"{seg['num_slots']} slots x {seg['slot_capacity']} B")
        lines.append(f"  eviction: a reader whose process is gone, or that holds the writer up for "
                     f"{seg['liveness_timeout_s']:.3f} s without reading; writer {_writer(seg)}")
        lines.append("  " + ", ".join(f"{k}={v}" for k, v in c.items()))
        for r in seg["readers"]:
            lines.append(f"  reader {r['reader']}: {_reader_verdict(r)}, pid {r['pid']}, "
                         f"last read {r['heartbeat_age_s']:.3f} s ago, lag={r['lag']} copied={r['copied']} "
                         f"missed={r['missed']} stale={r['stale_skipped']} torn={r['torn']} rejected={r['rejected']} "
                         f"evicted={r['evicted']}")
    return "\n".join(lines)


def _reader_verdict(reader: dict) -> str:
    """'alive', or why not: evicted (rejoins at its next read), detached, or its process gone."""
    if reader["alive"]:
        return "alive"
    if reader["state"] == "live":
        return "DEAD (process gone; evicted when the writer next needs its slot)"
    return {"evicted": "evicted (rejoins at its next read)", "detached": "detached"}.get(reader["state"], reader["state"])


def _writer(seg: dict) -> str:
    pid = seg.get("writer_pid", 0)
    state = "alive" if seg.get("writer_alive") else "DEAD"
    return f"pid {pid} {state}, heartbeat {seg['writer_heartbeat_age_s']:.3f} s ago"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", help="segment names (default: every afore segment in /dev/shm)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--metrics", help="also fetch a scheduler's Prometheus endpoint, e.g. http://localhost:9400/metrics")
    parser.add_argument("--clean", action="store_true", help="unlink segments whose owner process is gone")


def run(args: argparse.Namespace) -> int:
    if args.names:
        segments = []
        for name in args.names:
            try:
                segments.append(_shm.inspect(name))
            except ValueError as exc:
                segments.append({"name": name, "error": str(exc)})
    else:
        segments = list_segments()
    removed = remove_stale([s for s in segments if "error" not in s]) if args.clean else []
    metrics = None
    if args.metrics:
        with urllib.request.urlopen(args.metrics, timeout=5) as resp:
            metrics = resp.read().decode()
    if args.json:
        print(json.dumps({"segments": segments, "removed": removed, "metrics": metrics}, indent=1))
        return 0
    if not segments:
        print(f"no afore segments in {SHM_DIR}")
    for seg in segments:
        print(f"{seg['name']}: {seg['error']}" if "error" in seg else format_segment(seg))
    for name in removed:
        print(f"removed stale segment {name}")
    if metrics is not None:
        print(metrics.rstrip())
    return 0 if all("error" not in s for s in segments) else 1
