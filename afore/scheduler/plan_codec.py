"""Binary encoding of one plan: what travels through the plan ring.

Layout (all little-endian):

  offset 0   u32  magic  b"AFPL"
  offset 4   u16  format version (FORMAT_VERSION)
  offset 6   u16  header length H (bytes, multiple of 4, msgpack + zero padding)
  offset 8   u32  crc32 of bytes [12, end): header and body together
  offset 12  H bytes: PlanHeader (msgspec msgpack), zero-padded
  offset 12+H  body, int32 arrays back to back:
               demand[E], assignment[E*F], tiles[E*F], slot[E*F], tile_load[F], copies[C*4]

The body decodes as numpy views of the buffer (no Python loops). ``replicas`` is not
sent: it is ``slot >= 0`` (check_plan holds that equality). Decoding validates magic,
version, lengths, checksum, the shape (E, F must match) and value ranges, and raises
ValueError on anything else: random or truncated bytes never crash and never hang.
"""

from __future__ import annotations

import functools
import struct
import zlib

import msgspec
import numpy as np

from afore.config import ClusterShape
from afore.plan import Plan, Target

MAGIC = b"AFPL"
FORMAT_VERSION = 1
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
    """The wire form of ``plan`` (see the module docstring)."""
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
    crc = zlib.crc32(body, zlib.crc32(head))
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head), crc) + head + body


def decode_header(data: bytes | memoryview) -> tuple[PlanHeader, int]:
    """Validate the prefix, checksum and header; return (header, body offset)."""
    view = memoryview(data)
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
    if zlib.crc32(view[start:]) != crc:
        raise ValueError("plan.checksum: crc32 mismatch (torn or corrupted plan)")
    raw = bytes(view[start:start + head_len]).rstrip(b"\0")
    try:
        header = _header_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"plan.header: malformed ({exc})") from None
    return header, start + head_len


def decode_plan(data: bytes | memoryview, shape: ClusterShape) -> Plan:
    """The Plan encoded in ``data`` for a pool of ``shape``.

    Arrays are int32 views of one writable copy of the body (``demand`` is an int64 copy,
    ``replicas`` is ``slot >= 0``), like the arrays of a plan a policy made: views of ``data``
    itself would be read-only (it is ``bytes`` from the ring), and torch.from_numpy of a read-only
    array, which the FFN side does with ``assignment``, warns and aliases it writable. The copy is
    the body's size (13 KB at E=128, F=8). Raises ValueError on a malformed, truncated, corrupted
    plan or one for another shape.
    """
    header, offset = decode_header(data)
    e, f, c = header.num_experts, header.num_workers, header.num_copies
    if (e, f) != (shape.num_experts, shape.num_workers):
        raise ValueError(f"plan.shape: expected (num_experts, num_workers) = ({shape.num_experts}, {shape.num_workers}), got ({e}, {f})")
    if c < 0 or c > e * f:
        raise ValueError(f"plan.num_copies: expected in [0, {e * f}], got {c}")
    if min(header.step, header.layer, header.microbatch, header.seq) < 0:
        raise ValueError("plan.target: expected non-negative step, layer, microbatch and seq")
    if header.layer >= shape.num_layers:
        raise ValueError(f"plan.layer: expected in [0, {shape.num_layers}), got {header.layer}")
    if len(data) - offset != body_length(e, f, c):
        raise ValueError(f"plan.body: expected {body_length(e, f, c)} bytes, got {len(data) - offset}")
    body = np.frombuffer(data, dtype=_I32, offset=offset).copy()
    ef = e * f
    demand, rest = body[:e], body[e:]
    assignment, tiles, slot = rest[:ef].reshape(e, f), rest[ef:2 * ef].reshape(e, f), rest[2 * ef:3 * ef].reshape(e, f)
    tile_load, copies = rest[3 * ef:3 * ef + f], rest[3 * ef + f:].reshape(c, 4)
    if body[:e + 2 * ef].min(initial=0) < 0:
        raise ValueError("plan: negative demand, assignment or tiles")
    _check_ranges(shape, demand, assignment, tiles, slot, tile_load, copies)
    return Plan(Target(header.step, header.layer, header.microbatch), header.seq, demand.astype(np.int64),
                slot >= 0, assignment, tiles, slot, copies, tile_load,
                gain_ms=header.gain_ms, exposed_ms=header.exposed_ms, primary_only=header.primary_only)


def _check_ranges(shape, demand, assignment, tiles, slot, tile_load, copies) -> None:
    """Vectorised sanity checks: a plan that passes its checksum but could index out of bounds."""
    k_max = _max_slots(shape.num_experts, shape.num_workers, shape.redundant_slots)
    if not np.array_equal(assignment.sum(axis=1, dtype=np.int64), demand):
        raise ValueError("plan.assignment: rows do not sum to demand")
    if slot.min(initial=-1) < -1 or slot.max(initial=-1) >= k_max:
        raise ValueError(f"plan.slot: expected values in [-1, {k_max})")
    if not np.array_equal(tile_load, tiles.sum(axis=0, dtype=np.int64)):
        raise ValueError("plan.tile_load: not the column sums of tiles")
    if len(copies):
        upper = np.array([shape.num_experts, shape.num_workers, shape.num_workers, k_max], np.int32)
        if copies.min() < 0 or np.any(copies >= upper):
            raise ValueError("plan.copies: expert, worker or slot out of range")


@functools.lru_cache(maxsize=64)
def _max_slots(num_experts: int, num_workers: int, redundant_slots: int) -> int:
    return -(-num_experts // num_workers) + redundant_slots


def _pad4(n: int) -> int:
    return (n + 3) // 4 * 4
