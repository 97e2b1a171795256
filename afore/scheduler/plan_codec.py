"""Binary encoding of one plan: what travels through the plan ring.

Layout (all little-endian):

  offset 0   u32  magic  b"AFPL"
  offset 4   u16  format version (FORMAT_VERSION)
  offset 6   u16  header length H (bytes, multiple of 4, msgpack + zero padding)
  offset 8   u32  checksum of bytes [12, end), header and body together: the low 32 bits of
                   stripe64 (``plan_checksum``, C++; ``stripe64_reference`` is its
                   specification): an XXH3-style accumulator with independent multiplies,
                   0.3 us for a 13 KB plan on the 2-core dev CPU against XXH64's 1.2 us
                   (format version 2) and zlib crc32's 3.5 us (version 1)
  offset 12  H bytes: PlanHeader (msgspec msgpack), zero-padded
  offset 12+H  body, int32 arrays back to back:
               demand[E], assignment[E*F], tiles[E*F], slot[E*F], tile_load[F], copies[C*4]

The body decodes as numpy views of the buffer (no Python loops, and no copy of a buffer the
plan ring filled: ``PlanRing.read`` passes the writable array its C++ copy went into).
``replicas`` is not sent: it is ``slot >= 0`` (check_plan holds that equality). Decoding validates magic,
version, lengths, checksum, the shape (E, F must match) and value ranges, and raises
ValueError on anything else: random or truncated bytes never crash and never hang.
"""

from __future__ import annotations

import functools
import struct

import msgspec
import numpy as np

from afore._scheduler_core import decode_plan_entry, plan_checksum

try:
    from afore._scheduler_core import encode_plan_entry as _native_encode
except ImportError:  # an older build of the core: the Python encoder serves alone
    _native_encode = None
from afore.config import ClusterShape
from afore.plan import Plan, Target

MAGIC = b"AFPL"
FORMAT_VERSION = 3  # 3: stripe64 checksum (2: XXH64, 1: crc32)
_PREFIX = struct.Struct("<4sHHI")
_I32 = np.dtype("<i4")
_I32_MAX = np.iinfo(np.int32).max


class PlanHeader(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Everything about a plan except its arrays. ``array_like`` keeps it a short msgpack array."""

    step: int
    layer: int
    microbatch: int
    seq: int
    num_experts: int
    num_workers: int
    num_copies: int
    gain_ms: float
    exposed_ms: float
    primary_only: bool


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(PlanHeader)


def body_length(num_experts: int, num_workers: int, num_copies: int) -> int:
    """Bytes of the int32 body for E experts, F workers and C copies."""
    return 4 * (num_experts + 3 * num_experts * num_workers + num_workers + 4 * num_copies)


def max_encoded_length(shape: ClusterShape, max_copies: int | None = None) -> int:
    """Upper bound of ``len(encode_plan(plan))`` for plans of ``shape``.

    A plan copies at most one expert into each redundant slot, so C <= F * R unless
    ``max_copies`` says otherwise.
    """
    c = shape.num_workers * shape.redundant_slots if max_copies is None else max_copies
    header = len(_header_encoder.encode(PlanHeader(2**62, 2**31, 2**31, 2**62, 2**31, 2**31, 2**31, 0.0, 0.0, True)))
    return _PREFIX.size + _pad4(header) + body_length(shape.num_experts, shape.num_workers, c)


def encode_plan(plan: Plan) -> bytes:
    """The wire form of ``plan`` (see the module docstring): one C++ call (``encode_plan_entry``,
    the same bytes as ``encode_plan_reference``) on the scheduler's publish path."""
    if _native_encode is None:
        return encode_plan_reference(plan)
    t = plan.target
    demand = plan.demand if isinstance(plan.demand, np.ndarray) and plan.demand.dtype == np.int64 \
        else np.asarray(plan.demand, np.int64)
    return _native_encode(t.step, t.layer, t.microbatch, plan.seq, float(plan.gain_ms), float(plan.exposed_ms),
                          bool(plan.primary_only), np.ascontiguousarray(demand), *(
                              np.ascontiguousarray(a, dtype=_I32) for a in (plan.assignment, plan.tiles, plan.slot,
                                                                            plan.tile_load, plan.copies)),
                          FORMAT_VERSION)


def encode_plan_reference(plan: Plan) -> bytes:
    """``encode_plan`` in Python (msgspec for the header): the specification of the bytes."""
    e, f = plan.assignment.shape
    copies = np.asarray(plan.copies).reshape(-1, 4)
    if np.asarray(plan.demand).max(initial=0) > _I32_MAX:
        raise ValueError(f"demand: expected counts <= {_I32_MAX} (int32 on the wire)")
    header = PlanHeader(plan.target.step, plan.target.layer, plan.target.microbatch, plan.seq, e, f,
                        len(copies), float(plan.gain_ms), float(plan.exposed_ms), bool(plan.primary_only))
    head = _header_encoder.encode(header)
    head += b"\0" * (_pad4(len(head)) - len(head))
    body = b"".join(np.ascontiguousarray(a, dtype=_I32).tobytes() for a in (
        plan.demand, plan.assignment, plan.tiles, plan.slot, plan.tile_load, copies))
    data = bytearray(_PREFIX.size) + head + body
    _PREFIX.pack_into(data, 0, MAGIC, FORMAT_VERSION, len(head), checksum(data))
    return bytes(data)


def checksum(data: bytes | bytearray | memoryview | np.ndarray) -> int:
    """The checksum field of an encoded plan: of bytes [12, end)."""
    return plan_checksum(as_buffer(data), _PREFIX.size)


_M64 = (1 << 64) - 1
_S_P1, _S_P2, _S_Q, _S_AVALANCHE, _S_P32 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                                            0x165667919E3779F9, 0x9E3779B1)
_S_KEY = (0xBE4BA423396CFEB8, 0x1CAD21F72C81017C, 0xDB979083E96DD4DE, 0x1F67B3B7A4A44072,
          0x78E5C0CC4EE679CB, 0x2172FFCC7DD05A82, 0x8E2443F7744608B8, 0x4C263A81E69035E0)
_S_INIT = (0x00000000C2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
           0x85EBCA77C2B2AE63, 0x0000000085EBCA77, 0x27D4EB2F165667C5, 0x000000009E3779B1)


def stripe64_reference(data: bytes) -> int:
    """The plan checksum's hash in Python (the specification of the C++ ``stripe64``; slow).

    Eight 64-bit lanes; every 64-byte stripe s (the last one zero-padded) adds to lane j
    lo32(d_j ^ k) * hi32(d_j ^ k) + d_(j^1), with d_j its j-th little-endian word and
    k = KEY[j] + s * Q; after every 16 full stripes each lane becomes (a ^ a >> 47 ^ KEY[j]) * P32;
    the result is the avalanche of n * P1 + the sum over i < 4 of fold(a_2i ^ KEY[7 - 2i],
    a_(2i+1) ^ (KEY[6 - 2i] + P2)), fold = the xor of the 128-bit product's halves. All mod 2**64."""
    n = len(data)
    acc = list(_S_INIT)
    full, rest = divmod(n, 64)
    stripes = [bytes(data[64 * s:64 * s + 64]) for s in range(full)]
    if rest:
        stripes.append(bytes(data[64 * full:]) + bytes(64 - rest))
    for s, chunk in enumerate(stripes):
        d = struct.unpack("<8Q", chunk)
        step = s * _S_Q & _M64
        for j in range(8):
            dk = d[j] ^ ((_S_KEY[j] + step) & _M64)
            acc[j] = (acc[j] + (dk & 0xFFFFFFFF) * (dk >> 32) + d[j ^ 1]) & _M64
        if s < full and s % 16 == 15:
            acc = [((a ^ (a >> 47) ^ _S_KEY[j]) * _S_P32) & _M64 for j, a in enumerate(acc)]
    h = n * _S_P1 & _M64
    for i in range(4):
        m = (acc[2 * i] ^ _S_KEY[7 - 2 * i]) * (acc[2 * i + 1] ^ ((_S_KEY[6 - 2 * i] + _S_P2) & _M64))
        h = (h + ((m & _M64) ^ (m >> 64))) & _M64
    h ^= h >> 37
    h = h * _S_AVALANCHE & _M64
    return h ^ (h >> 32)


def as_buffer(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """uint8[n] over ``data`` without a copy (read-only for bytes)."""
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1:
        return data
    return np.frombuffer(data, np.uint8)


def decode_header(data: bytes | memoryview | np.ndarray) -> tuple[PlanHeader, int]:
    """Validate the prefix, checksum and header; return (header, body offset)."""
    view = as_buffer(data)
    if len(view) < _PREFIX.size:
        raise ValueError(f"plan: expected at least {_PREFIX.size} bytes, got {len(view)}")
    magic, version, head_len, crc = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ValueError(f"plan.magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise ValueError(f"plan.version: expected {FORMAT_VERSION}, got {version}")
    start = _PREFIX.size
    if head_len % 4 or start + head_len > len(view):
        raise ValueError(f"plan.header_length: expected a multiple of 4 within {len(view) - start} bytes, got {head_len}")
    if plan_checksum(view, start) != crc:
        raise ValueError("plan.checksum: mismatch (torn or corrupted plan)")
    try:
        header = _header_decoder.decode(view[start:start + head_len].tobytes().rstrip(b"\0"))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"plan.header: malformed ({exc})") from None
    return header, start + head_len


class _BodyField:
    """A field of a ``DecodedPlan`` made on first read (a view of the plan's body, or for ``demand``
    its int64 copy), then a plain attribute of the plan (a non-data descriptor: the instance's own
    value, once set, is found first)."""

    def __init__(self, make) -> None:
        self.make = make

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, plan, owner=None):
        if plan is None:
            return self
        value = plan.__dict__[self.name] = plan._made[self.name] = self.make(plan)
        return value


class DecodedPlan(Plan):
    """A Plan read from the wire, its arrays made when they are first read: int32 views of the
    entry's body (writable, zero-copy: the buffer the ring's copy went into), ``demand`` an int64
    copy, ``replicas`` (``slot >= 0``) computed. The decode checked everything these views index
    (``decode_worker_plan``), so a reader that needs only some of them pays only for those, and
    one that hands the body to C++ needs none: ``addresses`` gives where each array starts, and
    ``digest`` is the entry's checksum.
    """

    _replicas: np.ndarray | None = None

    # body: demand [E], then assignment, tiles, slot [E, F] each, tile_load [F], copies [C, 4]
    _body = _BodyField(lambda p: p._data[p._offset:].view(_I32))
    _per_pair = _BodyField(lambda p: p._body[p._ef[0]:p._ef[0] * (1 + 3 * p._ef[1])].reshape(3, *p._ef))
    demand = _BodyField(lambda p: p._body[:p._ef[0]].astype(np.int64))
    assignment = _BodyField(lambda p: p._per_pair[0])
    tiles = _BodyField(lambda p: p._per_pair[1])
    slot = _BodyField(lambda p: p._per_pair[2])
    tile_load = _BodyField(lambda p: p._body[p._ef[0] * (1 + 3 * p._ef[1]):][:p._ef[1]])
    copies = _BodyField(lambda p: p._body[p._ef[0] * (1 + 3 * p._ef[1]) + p._ef[1]:].reshape(p.num_copies, 4))

    @property
    def replicas(self) -> np.ndarray:  # type: ignore[override]
        if self._replicas is None:
            self._replicas = self.slot >= 0
        return self._replicas

    @replicas.setter
    def replicas(self, value: np.ndarray | None) -> None:
        self._replicas = value

    def addresses(self) -> tuple[int, int, int, int]:
        """Where the body's int32 arrays start in memory: (demand [E], assignment [E, F], slot
        [E, F], copies [C, 4]), row-major; valid while this plan lives (it holds the buffer)."""
        e, f = self._ef
        base = self._address + self._offset
        return base, base + 4 * e, base + 4 * (e + 2 * e * f), base + 4 * (e + 3 * e * f + f)

    def body_in_place(self) -> bool:
        """Whether the arrays are still the body's: none of assignment, slot, copies was set to another
        array since the decode (reading them keeps them the body's views), and the demand, a copy
        (or what was set in its place), holds the body's values."""
        d = self.__dict__
        made = d.get("_made")
        if made is None:  # built by the dataclass constructor (dataclasses.replace), not decoded: no body
            return False
        if any(name in d and d[name] is not made.get(name) for name in ("assignment", "slot", "copies")):
            return False
        return "demand" not in d or np.array_equal(d["demand"], self._body[:self._ef[0]])

    @property
    def digest(self) -> int | None:
        """The entry's checksum (never 0; equal for the same entry read by any worker), or None once
        the arrays are no longer the body's (``body_in_place``)."""
        return (self._checksum or 1) if self.body_in_place() else None


def decode_plan(data: bytes | memoryview, shape: ClusterShape) -> Plan:
    """The Plan encoded in ``data`` for a pool of ``shape``, fully validated.

    On top of ``decode_worker_plan``'s checks: assignment rows sum to demand and tile_load is the
    column sums of tiles. For tools and tests; FFN workers use ``decode_worker_plan``.
    Raises ValueError on a malformed, truncated, corrupted plan or one for another shape.
    """
    plan = decode_worker_plan(data, shape)
    if not np.array_equal(plan.assignment.sum(axis=1, dtype=np.int64), plan.demand):
        raise ValueError("plan.assignment: rows do not sum to demand")
    if not np.array_equal(plan.tile_load, plan.tiles.sum(axis=0, dtype=np.int64)):
        raise ValueError("plan.tile_load: not the column sums of tiles")
    return plan


def decode_worker_plan(data: bytes | memoryview, shape: ClusterShape) -> Plan:
    """The Plan encoded in ``data``, with the checks an FFN worker needs before it uses it.

    The reader's critical path (every worker, every target). Checked: magic, version, lengths,
    the checksum (a torn or corrupted entry is rejected), the shape (E, F must match), the target, and
    every value that indexes something: counts >= 0, slots in [-1, K_max), copies' experts,
    workers and slots in range. Not checked here: that the plan is consistent (rows sum to
    demand, tile loads), which the migrator checks against its own state before it applies a
    plan (``Migrator.validate``), and ``decode_plan`` for everyone else.

    Arrays are writable int32 views, each made when first read (``DecodedPlan``; ``demand`` is an
    int64 copy, ``replicas`` computed): of ``data`` itself when it is a writable uint8 array (what
    ``PlanRing.read`` passes: the buffer the ring's copy went into, so decoding copies nothing),
    else of one copy of it (``bytes`` are read-only, and torch.from_numpy of a read-only array,
    which the FFN side does with ``assignment``, warns and aliases it writable).
    """
    if not (type(data) is np.ndarray and data.dtype == np.uint8 and data.ndim == 1 and data.flags.writeable):
        data = np.frombuffer(data, np.uint8).copy()
    e, f = shape.num_experts, shape.num_workers
    # One C++ call, in place: prefix, checksum, header, shape, target, lengths and value ranges
    # (decode_header's checks and messages, and the body's ranges).
    step, layer, microbatch, seq, c, gain_ms, exposed_ms, primary_only, offset, checksum, address = decode_plan_entry(
        data, e, f, shape.num_layers, _max_slots(e, f, shape.redundant_slots), FORMAT_VERSION)
    # The objects without their constructors (the reader's critical path: the dataclasses'
    # __init__ cost about 1.3 us); the fields are those of Target and Plan, the arrays made on
    # first read (DecodedPlan).
    target = _new(Target)
    fields = target.__dict__  # Target is frozen: its fields set as object.__setattr__ would
    fields["step"] = step
    fields["layer"] = layer
    fields["microbatch"] = microbatch
    plan = _new(DecodedPlan)
    plan.__dict__ = {"target": target, "seq": seq, "gain_ms": gain_ms, "exposed_ms": exposed_ms,
                     "primary_only": primary_only, "num_copies": c, "_data": data, "_offset": offset, "_ef": (e, f),
                     "_checksum": checksum, "_address": address, "_made": {}}
    return plan


_new = object.__new__


@functools.lru_cache(maxsize=64)
def _max_slots(num_experts: int, num_workers: int, redundant_slots: int) -> int:
    return -(-num_experts // num_workers) + redundant_slots


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4
