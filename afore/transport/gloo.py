"""Gloo process groups for the connector (CPU tensors): ``ProcessGroupGloo`` built directly
over afore's own store, independent of the default group and of vLLM's groups."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group of ``size`` ranks over ``store`` (already prefixed per group)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)
