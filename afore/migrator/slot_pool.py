"""Per-layer, per-worker expert weight slots, laid out for the grouped GEMM.

Worker w holds K_w = P_w + R physical slots of one MoE layer (``ClusterShape``): its fixed
primaries in slots 0..P_w-1 (the experts the shape's primary layout gives w, ascending id:
``ClusterShape.primary_experts(w)``; a contiguous block by default), then R redundant slots
that copies fill. All slots live in two contiguous tensors, so the
grouped GEMM indexes them by physical slot directly:

    w13  [K_w, 2I, H]   gate and up projections stacked (gate rows first)
    w2   [K_w, H, I]    down projection
    (both views of one [K_w, 3*I*H] buffer, so a slot's matrices are adjacent in memory)

``resident[s]`` is the logical expert whose weights slot s holds once every submitted copy
has completed (-1 = empty); the migrator updates it when it submits a copy and keeps the
copy's completion event beside it (``afore.migrator.migrator``).
"""

from __future__ import annotations

import numpy as np
import torch

from afore.config import ClusterShape


class SlotPool:
    """Expert slots of one layer on one FFN worker."""

    def __init__(self, shape: ClusterShape, worker: int, hidden: int, intermediate: int,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> None:
        shape.check_worker(worker)
        if hidden < 1:
            raise ValueError(f"hidden: expected >= 1, got {hidden}")
        if intermediate < 1:
            raise ValueError(f"intermediate: expected >= 1, got {intermediate}")
        self.shape = shape
        self.worker = worker
        self.hidden = hidden
        self.intermediate = intermediate
        self.num_primaries = int(shape.primary_counts[worker])
        self.num_slots = self.num_primaries + shape.redundant_slots
        self.primaries = shape.primary_experts(worker)  # int64[P_w], slot order
        self._slot_of = {int(e): s for s, e in enumerate(self.primaries)}
        # One buffer, one row per slot: a slot's three matrices are adjacent, so an expert copy
        # is a single contiguous transfer; w13 / w2 are strided views of it.
        per_slot = 3 * intermediate * hidden
        self.storage = torch.empty(self.num_slots, per_slot, dtype=dtype, device=device)
        self.w13 = self.storage[:, : 2 * intermediate * hidden].view(self.num_slots, 2 * intermediate, hidden)
        self.w2 = self.storage[:, 2 * intermediate * hidden:].view(self.num_slots, hidden, intermediate)
        if dtype.is_floating_point:
            # Empty redundant slots hold NaN, so a read before its copy is loud, not plausible.
            self.w13[self.num_primaries:].fill_(float("nan"))
            self.w2[self.num_primaries:].fill_(float("nan"))
        self.resident = np.full(self.num_slots, -1, np.int32)
        self.resident[: self.num_primaries] = self.primaries

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert's three matrices in this pool's dtype."""
        return 3 * self.hidden * self.intermediate * self.w13.element_size()

    def primary_experts(self) -> list[int]:
        """Logical ids of this worker's primaries, in slot order."""
        return [int(e) for e in self.primaries]

    def load_primaries(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Fill the primary slots.

        w13: [E, 2I, H] or [P_w, 2I, H] (all experts of the layer, or this worker's primaries
        in slot order, ``primary_experts()``); w2 likewise [E or P_w, H, I]. Copied (and cast)
        into the pool; from [E] the rows of this worker's primaries under the shape's layout.
        """
        num_experts = self.shape.num_experts
        for name, arr, tail in (("w13", w13, (2 * self.intermediate, self.hidden)),
                                ("w2", w2, (self.hidden, self.intermediate))):
            if arr.dim() != 3 or tuple(arr.shape[1:]) != tail or arr.shape[0] not in (num_experts, self.num_primaries):
                raise ValueError(f"{name}: expected shape [{num_experts} or {self.num_primaries}, {tail[0]}, {tail[1]}], got {tuple(arr.shape)}")
        rows = torch.as_tensor(self.primaries, dtype=torch.long)
        with torch.no_grad():
            self.w13[: self.num_primaries].copy_(w13[rows] if w13.shape[0] == num_experts else w13)
            self.w2[: self.num_primaries].copy_(w2[rows] if w2.shape[0] == num_experts else w2)

    def primary_slot_of(self, expert: int) -> int:
        """Physical slot of ``expert`` if this worker is its primary owner."""
        slot = self._slot_of.get(int(expert))
        if slot is None:
            raise ValueError(f"expert: expected a primary of worker {self.worker} (one of {self.primary_experts()}), got {expert}")
        return slot

    def check_redundant_slot(self, slot: int) -> None:
        if not self.num_primaries <= slot < self.num_slots:
            raise ValueError(f"dst_slot: expected a redundant slot of worker {self.worker} in [{self.num_primaries}, {self.num_slots}), got {slot}")
