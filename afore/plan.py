"""The plan contract: what the scheduler produces and every FFN worker applies.

A *target* is one (step, layer, microbatch); targets are totally ordered by
their sequence number ``seq`` (the FFN execution order).

Arrays (E experts, F workers, R redundant slots per worker):
  SlotTable.expert     int32[F, R]  logical expert bound to redundant slot r of worker w, -1 = empty
  SlotTable.last_used  int64[F, R]  seq of the last target that gave the slot work, -1 = never
  Plan.replicas        bool[E, F]   x[e, w]: e has a replica (primary or redundant) on w
  Plan.assignment      int32[E, F]  a[e, w]: token-expert pairs of e executed on w (sum_w = demand[e])
  Plan.tiles           int32[E, F]  n[e, w] = ceil(a[e, w] / M_tile)
  Plan.slot            int32[E, F]  sigma[e, w]: physical slot of e on w, -1 where no replica
  Plan.copies          int32[C, 4]  rows (expert, src_worker, dst_worker, dst_physical_slot)
  Plan.tile_load       int32[F]     T_w = sum_e n[e, w]
Physical slot numbering on worker w: primaries 0..P_w-1, redundant slot r is P_w + r.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from afore.config import ClusterShape, CostModel, SchedulerParams


@dataclasses.dataclass(frozen=True, order=True)
class Target:
    """One unit of demand, planning and commit."""

    step: int
    layer: int
    microbatch: int

    def seq(self, num_layers: int, num_microbatches: int) -> int:
        """The sequence number in FFN execution order (steps, then layers, then microbatches)."""
        return (self.step * num_layers + self.layer) * num_microbatches + self.microbatch

    @classmethod
    def from_seq(cls, seq: int, num_layers: int, num_microbatches: int) -> "Target":
        """Inverse of ``seq``."""
        step_layer, microbatch = divmod(seq, num_microbatches)
        step, layer = divmod(step_layer, num_layers)
        return cls(step, layer, microbatch)


def check_planning_types(shape: object, params: object, cost: object,
                         target: object = None, seq: object = None, *, with_target: bool = False) -> None:
    """Raise ValueError naming the first argument of a planning call that has the wrong type."""
    expected = [("shape", shape, ClusterShape), ("params", params, SchedulerParams), ("cost", cost, CostModel)]
    if with_target:
        expected.append(("target", target, Target))
    for name, value, cls in expected:
        if not isinstance(value, cls):
            raise ValueError(f"{name}: expected a {cls.__name__}, got {type(value).__name__}")
    if with_target and (isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer))
                        or not 0 <= seq < 2**63):
        raise ValueError(f"seq: expected an integer in [0, 2**63), got {seq!r}")


@dataclasses.dataclass
class SlotTable:
    """Projected redundant-slot bindings of one layer (persist across targets)."""

    expert: np.ndarray     # int32[F, R]
    last_used: np.ndarray  # int64[F, R]

    @classmethod
    def empty(cls, shape: ClusterShape) -> "SlotTable":
        f, r = shape.num_workers, shape.redundant_slots
        return cls(np.full((f, r), -1, np.int32), np.full((f, r), -1, np.int64))

    def copy(self) -> "SlotTable":
        return SlotTable(self.expert.copy(), self.last_used.copy())

    def check(self, shape: ClusterShape) -> None:
        f, r = shape.num_workers, shape.redundant_slots
        for name in ("expert", "last_used"):
            arr = getattr(self, name)
            if arr.shape != (f, r):
                raise ValueError(f"slot_table.{name}: expected shape ({f}, {r}), got {arr.shape}")
        bad = (self.expert < -1) | (self.expert >= shape.num_experts)
        if np.any(bad):
            raise ValueError(f"slot_table.expert: expected values in [-1, {shape.num_experts}), got {int(self.expert[bad][0])}")
        owner = shape.primary_owner
        for w, r_ in zip(*np.nonzero(self.expert >= 0)):
            e = int(self.expert[w, r_])
            if owner[e] == w:
                raise ValueError(f"slot_table.expert: expert {e} bound to a redundant slot on its own primary worker {w}")
            if np.count_nonzero(self.expert[w] == e) > 1:
                raise ValueError(f"slot_table.expert: expert {e} bound twice on worker {w}")


@dataclasses.dataclass
class Plan:
    """P[t] = (placement, assignment, slot bindings, copies) for one target."""

    target: Target
    seq: int
    demand: np.ndarray      # int64[E]
    replicas: np.ndarray    # bool[E, F]
    assignment: np.ndarray  # int32[E, F]
    tiles: np.ndarray       # int32[E, F]
    slot: np.ndarray        # int32[E, F]
    copies: np.ndarray      # int32[C, 4]
    tile_load: np.ndarray   # int32[F]
    gain_ms: float = 0.0    # net gain G of the selected candidate (0 when no copy)
    exposed_ms: float = 0.0  # O_t(Delta) of the selected copy list
    primary_only: bool = False  # True for the fallback plan (invariant 5)

    @property
    def max_tile_load(self) -> int:
        return int(self.tile_load.max()) if self.tile_load.size else 0

    def to_json(self) -> dict:
        """A self-contained JSON view (``afore plan``), checkable without afore."""
        e, f = self.assignment.shape
        return {
            "target": dataclasses.asdict(self.target),
            "seq": self.seq,
            "demand": self.demand.tolist(),
            "replica_sets": [np.nonzero(self.replicas[i])[0].tolist() for i in range(e)],
            "assignment": self.assignment.tolist(),
            "tiles": self.tiles.tolist(),
            "slot": self.slot.tolist(),
            "copies": [dict(zip(("expert", "src", "dst", "dst_slot"), map(int, row))) for row in self.copies],
            "tile_load": self.tile_load.tolist(),
            "max_tile_load": self.max_tile_load,
            "gain_ms": self.gain_ms,
            "exposed_ms": self.exposed_ms,
            "primary_only": self.primary_only,
            "num_workers": f,
        }


def primary_only_plan(shape: ClusterShape, demand: np.ndarray, target: Target, seq: int) -> Plan:
    """The always-valid fallback: every pair runs on its expert's primary, no copies."""
    demand = shape.check_demand(demand)
    e, f = shape.num_experts, shape.num_workers
    owner = shape.primary_owner
    rows = np.arange(e)
    replicas = np.zeros((e, f), bool)
    replicas[rows, owner] = True
    assignment = np.zeros((e, f), np.int32)
    assignment[rows, owner] = demand
    tiles = -(-assignment // shape.m_tile)
    slot = np.full((e, f), -1, np.int32)
    slot[rows, owner] = shape.primary_slot
    return Plan(target, seq, demand, replicas, assignment, tiles.astype(np.int32), slot,
                np.zeros((0, 4), np.int32), tiles.sum(axis=0).astype(np.int32), primary_only=True)


def check_plan(shape: ClusterShape, plan: Plan, table_before: SlotTable | None = None) -> None:
    """Raise ValueError if ``plan`` breaks a contract of the plan format.

    Checks: assignment sums to demand, work only where a replica is, at most one
    partial tile per expert, tiles and tile loads consistent, slots within
    K_w and distinct per worker, primaries at their fixed slot, every copy's
    source is the primary and destination a redundant slot bound to that expert,
    and (with ``table_before``) that every new redundant binding has a copy.
    """
    e, f, m = shape.num_experts, shape.num_workers, shape.m_tile
    a = plan.assignment.astype(np.int64)
    if a.shape != (e, f):
        raise ValueError(f"assignment: expected shape ({e}, {f}), got {a.shape}")
    if np.any(a < 0):
        raise ValueError("assignment: negative count")
    if not np.array_equal(a.sum(axis=1), plan.demand):
        raise ValueError("assignment: rows do not sum to demand")
    if np.any((a > 0) & ~plan.replicas):
        raise ValueError("assignment: work on a worker without a replica")
    if not np.array_equal(plan.tiles, -(-a // m)):
        raise ValueError("tiles: not ceil(assignment / m_tile)")
    partial = np.count_nonzero((a % m) != 0, axis=1)
    if np.any(partial > 1):
        raise ValueError(f"assignment: expert {int(np.argmax(partial > 1))} has more than one partial tile")
    if not np.array_equal(plan.tile_load, plan.tiles.sum(axis=0)):
        raise ValueError("tile_load: not the column sums of tiles")
    owner, pslot, pcount = shape.primary_owner, shape.primary_slot, shape.primary_counts
    rows = np.arange(e)
    if not np.all(plan.replicas[rows, owner]) or not np.array_equal(plan.slot[rows, owner], pslot):
        raise ValueError("replicas: a primary is missing or not at its fixed slot")
    if np.any((plan.slot >= 0) != plan.replicas):
        raise ValueError("slot: bindings do not match the replica sets")
    for w in range(f):
        used = plan.slot[:, w][plan.slot[:, w] >= 0]
        if np.any(used >= pcount[w] + shape.redundant_slots):
            raise ValueError(f"slot: worker {w} slot beyond K_w")
        if len(np.unique(used)) != len(used):
            raise ValueError(f"slot: worker {w} has two experts in one slot")
    for ex, src, dst, s in plan.copies.tolist():
        if src != owner[ex]:
            raise ValueError(f"copies: expert {ex} copied from {src}, not its primary {owner[ex]}")
        if plan.slot[ex, dst] != s or s < pcount[dst]:
            raise ValueError(f"copies: expert {ex} into worker {dst} slot {s} does not match the bindings")
    if table_before is not None:
        copied = {(int(c[0]), int(c[2])) for c in plan.copies}
        for ex, w in zip(*np.nonzero(plan.replicas)):
            if w == owner[ex]:
                continue
            r = int(plan.slot[ex, w] - pcount[w])
            if table_before.expert[w, r] != ex and (int(ex), int(w)) not in copied:
                raise ValueError(f"copies: new replica of expert {ex} on worker {w} has no copy")


def plan_digest(plan: "Plan") -> int:
    """A 32-bit digest of what an FFN worker applies of ``plan``: its seq, target, assignment,
    slot bindings and copies (crc32 over their bytes). Workers vote it with their yes
    (``agree(flag, digest)``): equal digests mean the same partition and slots on every worker,
    so invariant 3 is checked, not assumed (e.g. under ``--planner workers``, where each worker
    makes its plan itself). Never 0, the digest of "no plan". 32 bits: two different plans agree
    falsely with a chance of about 2**-32, and only where the workers diverged at all (a fault);
    adding adler32 for 63 bits doubled the cost (12 against 5.5 us at E=128, F=8 on the 2-core CI machine, whose zlib
    computes crc32 without hardware help). A plan read from the plan ring (``DecodedPlan``, its arrays still the
    entry's body) digests as its entry's checksum, computed by the decode already: every worker reads the same
    entry, so equal plans digest equally; a worker whose plan came another way digests differently, a veto."""
    import struct
    import zlib

    digest = getattr(plan, "digest", None)  # a plan read from the wire (DecodedPlan): its entry's checksum
    if digest is not None:
        return digest
    t = plan.target
    crc = zlib.crc32(struct.pack("<4q", plan.seq, t.step, t.layer, t.microbatch))
    for arr in (plan.assignment, plan.slot, plan.copies):
        # the raw buffer: equal plans in another dtype or layout digest differently, a veto, never a
        # false agreement
        crc = zlib.crc32(arr.data if arr.flags.c_contiguous else np.ascontiguousarray(arr).data, crc)
    return crc or 1
