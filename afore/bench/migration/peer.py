"""The peer process of ``afore bench migration``: holds the source pools that copies and overlap
pull from (on the second GPU, or the CPU), and runs replay worker 1 on request."""

from __future__ import annotations

import torch

from afore.bench.migration.replay import PeerLink, replay_worker
from afore.bench.migration.shapes import source_pools
from afore.bench.migration.timing import sync
from afore.migrator.peers import export_tensors


def peer_entry(device_str, shapes, experts, big_bytes, conn) -> None:
    """Spawned peer: waits for the replay config inside each 'replay' request."""
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pools = source_pools(shapes, experts, device, dtype, seed=1)
    big = torch.empty(big_bytes, dtype=torch.uint8, device=device).fill_(7)
    conn.send({"pools": {n: export_tensors(*ts) for n, ts in pools.items()}, "big": export_tensors(big)})
    while True:
        msg = conn.recv()
        if msg == "exit":
            break
        if isinstance(msg, tuple) and msg[0] == "replay":
            try:
                conn.send(("ok", replay_worker(1, device, msg[1], PeerLink(conn))))
            except Exception:
                import traceback
                conn.send(("error", traceback.format_exc()))
    sync(device)
