"""NCCL process groups for the connector (CUDA tensors, one GPU per process).

``ProcessGroupNCCL`` is built directly over afore's own store, so its communicators are
separate from vLLM's and from the default group. Point-to-point communicators are created
lazily by NCCL on the first send/recv between a pair; requests, replies and the FFN combine
use three groups, hence three communicators, so the FFN worker's receive thread and model
thread never share one.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def nccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
               device: torch.device) -> dist.ProcessGroup:
    """An NCCL group of ``size`` ranks over ``store``, bound to ``device``."""
    if not dist.is_nccl_available():
        raise ValueError("backend: expected a torch build with NCCL for backend='nccl' (use 'gloo' on CPU)")
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device for backend='nccl', got {device}")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = dist.ProcessGroupNCCL(store, rank, size, options)
    if hasattr(group, "bound_device_id"):
        group.bound_device_id = device
    return group
