"""Sharing slot pools between FFN worker processes, for one-sided pulls by the copy engine.

On GPUs every worker exports its pools' ``w13``/``w2`` as CUDA IPC handles
(``torch.multiprocessing.reductions.reduce_tensor``: ``cudaIpcGetMemHandle`` plus the storage
offset) and opens its peers' handles once at start, so a copy reads the primary owner's
memory directly over NVLink; no process on the source side takes part in a copy. All
workers must see the same set of GPUs (do not narrow ``CUDA_VISIBLE_DEVICES`` per worker)
for device indices to agree. On CPU the same functions share ``share_memory_()`` tensors by
file descriptor. The handles travel through a ``torch.distributed.Store`` (the transport's
TCPStore) under ``afore/pool/<layer>/<worker>``.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from afore.migrator.slot_pool import SlotPool


def export_tensors(*tensors: torch.Tensor) -> bytes:
    """Picklable handles of ``tensors`` (the exporting process must keep them alive)."""
    handles = []
    for t in tensors:
        if not t.is_cuda and not t.is_shared():
            t.share_memory_()
        handles.append(reduce_tensor(t))
    return pickle.dumps(handles)


def open_tensors(blob: bytes) -> list[torch.Tensor]:
    """Tensors that alias the exporter's memory (CUDA IPC on GPU, shared memory on CPU)."""
    return [rebuild(*args) for rebuild, args in pickle.loads(blob)]


def publish_pools(store: dist.Store, pools: dict[int, SlotPool]) -> None:
    """Put this worker's pools under ``afore/pool/<layer>/<worker>``."""
    for layer, pool in pools.items():
        store.set(f"afore/pool/{layer}/{pool.worker}", export_tensors(pool.w13, pool.w2))


def open_peer_pools(store: dist.Store, layers: list[int], num_workers: int, me: int,
                    own: dict[int, SlotPool]) -> dict[tuple[int, int], object]:
    """{(layer, worker): (w13, w2)} for every worker: peers opened from the store (blocking
    until they published), this worker's own pools as they are."""
    pools: dict[tuple[int, int], object] = {}
    for layer in layers:
        for w in range(num_workers):
            if w == me:
                pools[(layer, w)] = own[layer]
            else:
                w13, w2 = open_tensors(store.get(f"afore/pool/{layer}/{w}"))
                pools[(layer, w)] = (w13, w2)
    return pools
