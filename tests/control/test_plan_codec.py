import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from afore.config import ClusterShape
from afore.plan import Target, check_plan, primary_only_plan
from afore.scheduler.plan_codec import checksum, decode_plan, decode_worker_plan, encode_plan, max_encoded_length

DECODERS = pytest.mark.parametrize("decode", [decode_plan, decode_worker_plan], ids=["full", "worker"])

SHAPE = ClusterShape(num_experts=32, num_workers=4, num_layers=3, redundant_slots=2, m_tile=8, top_k=4)


@DECODERS
def test_roundtrip_preserves_every_field(make_plan, decode):
    rng = np.random.default_rng(0)
    for seq in range(20):
        plan = make_plan(SHAPE, rng, Target(seq // 6, seq % 3, seq % 2), seq)
        check_plan(SHAPE, plan)
        data = encode_plan(plan)
        assert len(data) <= max_encoded_length(SHAPE)
        got = decode(data, SHAPE)
        check_plan(SHAPE, got)
        assert (got.target, got.seq, got.primary_only, got.gain_ms) == (plan.target, plan.seq, False, plan.gain_ms)
        for name in ("demand", "replicas", "assignment", "tiles", "slot", "copies", "tile_load"):
            np.testing.assert_array_equal(getattr(got, name), getattr(plan, name), err_msg=name)
        assert got.demand.dtype == np.int64
        assert got.assignment.flags.writeable and got.slot.flags.writeable  # torch.from_numpy needs it


@DECODERS
def test_every_single_bit_flip_is_rejected(make_plan, decode):
    plan = make_plan(SHAPE, np.random.default_rng(1), Target(1, 2, 1), 11)
    data = bytearray(encode_plan(plan))
    for i in range(0, len(data), 7):
        for bit in (0, 5):
            data[i] ^= 1 << bit
            with pytest.raises(ValueError):
                decode(bytes(data), SHAPE)
            data[i] ^= 1 << bit


@DECODERS
def test_every_truncation_is_rejected(decode):
    data = encode_plan(primary_only_plan(SHAPE, np.arange(32), Target(0, 0, 0), 0))
    for n in range(len(data)):
        with pytest.raises(ValueError):
            decode(data[:n], SHAPE)
    with pytest.raises(ValueError):
        decode(data + b"\0\0\0\0", SHAPE)


def test_plan_for_another_shape_is_rejected():
    data = encode_plan(primary_only_plan(SHAPE, np.arange(32), Target(0, 0, 0), 0))
    with pytest.raises(ValueError, match="num_experts"):
        decode_plan(data, ClusterShape(num_experts=16, num_workers=4, num_layers=3, top_k=4))


def test_valid_checksum_but_inconsistent_body_is_rejected():
    plan = primary_only_plan(SHAPE, np.arange(32), Target(0, 0, 0), 0)
    data = bytearray(encode_plan(plan))
    head_len = int.from_bytes(data[6:8], "little")
    body = 12 + head_len
    data[body:body + 4] = (999).to_bytes(4, "little")  # demand[0] no longer the row sum
    data[8:12] = checksum(data).to_bytes(4, "little")
    with pytest.raises(ValueError, match="demand"):
        decode_plan(bytes(data), SHAPE)


@DECODERS
@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_never_crash(decode, data):
    with pytest.raises(ValueError):
        decode(data, SHAPE)


@DECODERS
@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=600), st.integers(0, 10**6))
def test_valid_prefix_with_random_tail_never_crashes(decode, tail, cut):
    data = encode_plan(primary_only_plan(SHAPE, np.arange(32), Target(0, 1, 0), 2))
    cut = cut % len(data)
    mutated = data[:cut] + tail
    if mutated == data:
        return
    with pytest.raises(ValueError):
        decode(mutated, SHAPE)


def _resealed(plan, offset_in_body: int, value: int) -> bytes:
    """The encoding of ``plan`` with int32 ``value`` at ``offset_in_body`` and a valid checksum."""
    data = bytearray(encode_plan(plan))
    start = 12 + int.from_bytes(data[6:8], "little") + 4 * offset_in_body
    data[start:start + 4] = int(value).to_bytes(4, "little", signed=True)
    data[8:12] = checksum(data).to_bytes(4, "little")
    return bytes(data)


@pytest.mark.parametrize("where,value,message", [
    ("demand", -1, "negative"), ("assignment", -5, "negative"), ("tiles", -1, "negative"),
    ("slot", -2, "plan.slot"), ("slot", 8 + 2, "plan.slot"), ("slot", 2**31 - 1, "plan.slot"),
    ("copy_expert", 32, "plan.copies"), ("copy_worker", 4, "plan.copies"), ("copy_slot", -1, "plan.copies"),
])
def test_worker_decode_rejects_every_value_that_indexes_out_of_range(make_plan, where, value, message):
    # A plan that passes its checksum (a buggy writer) must still not index out of bounds.
    plan = make_plan(SHAPE, np.random.default_rng(4), Target(0, 1, 0), 3)
    assert len(plan.copies) > 0
    e, f = SHAPE.num_experts, SHAPE.num_workers
    copies = e + 3 * e * f + f
    offset = {"demand": 0, "assignment": e, "tiles": e + e * f, "slot": e + 2 * e * f, "copy_expert": copies,
              "copy_worker": copies + 2, "copy_slot": copies + 3}[where]
    data = _resealed(plan, offset, value)
    for decode in (decode_worker_plan, decode_plan):
        with pytest.raises(ValueError, match=message):
            decode(data, SHAPE)


def test_worker_decode_leaves_consistency_to_the_migrator_and_full_decode_checks_it():
    # demand[0] no longer the row sum: the worker's decode passes it on (the migrator rejects it
    # against its own state), the full decode rejects it.
    plan = primary_only_plan(SHAPE, np.arange(32), Target(0, 0, 0), 0)
    data = _resealed(plan, 0, 999)
    assert decode_worker_plan(data, SHAPE).demand[0] == 999
    with pytest.raises(ValueError, match="demand"):
        decode_plan(data, SHAPE)


def test_worker_decode_computes_replicas_on_first_use(make_plan):
    plan = make_plan(SHAPE, np.random.default_rng(5), Target(0, 2, 1), 8)
    got = decode_worker_plan(encode_plan(plan), SHAPE)
    assert got._replicas is None
    np.testing.assert_array_equal(got.replicas, plan.replicas)
    assert got.replicas is got.replicas
    got.replicas = np.zeros_like(plan.replicas)  # still a Plan: fields can be set
    assert not got.replicas.any()


def test_worker_decode_views_a_writable_ring_buffer_without_copying(make_plan):
    # What PlanRing.read passes: the uint8 array the ring's copy went into. The plan's arrays
    # are writable views of it, and a torn byte anywhere is still rejected.
    plan = make_plan(SHAPE, np.random.default_rng(4), Target(3, 2, 1), 9)
    buffer = np.frombuffer(encode_plan(plan), np.uint8).copy()
    decoded = decode_worker_plan(buffer, SHAPE)
    assert np.shares_memory(decoded.assignment, buffer) and np.shares_memory(decoded.slot, buffer)
    assert decoded.assignment.flags.writeable
    assert np.array_equal(decoded.assignment, plan.assignment) and np.array_equal(decoded.copies, plan.copies)
    from_bytes = decode_worker_plan(bytes(buffer), SHAPE)
    assert not np.shares_memory(from_bytes.assignment, buffer) and from_bytes.assignment.flags.writeable
    buffer[-1] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        decode_worker_plan(buffer, SHAPE)


def test_worker_decode_makes_each_array_on_first_read_at_the_addresses_it_gives(make_plan):
    # the decode makes no array of the body; each is a view (demand an int64 copy) made when first
    # read, then the same object; addresses() are where the body's arrays lie
    plan = make_plan(SHAPE, np.random.default_rng(6), Target(1, 2, 0), 11)
    buffer = np.frombuffer(encode_plan(plan), np.uint8).copy()
    got = decode_worker_plan(buffer, SHAPE)
    assert not {"demand", "assignment", "tiles", "slot", "copies", "tile_load"} & set(vars(got))
    assert got.num_copies == len(plan.copies) and got.body_in_place()
    for name in ("demand", "assignment", "tiles", "slot", "copies", "tile_load"):
        np.testing.assert_array_equal(getattr(got, name), getattr(plan, name))
        assert getattr(got, name) is getattr(got, name)
    assert got.demand.dtype == np.int64 and got.assignment.dtype == np.int32
    addresses = got.addresses()
    for name, address in zip(("assignment", "slot", "copies"), addresses[1:]):
        assert getattr(got, name).__array_interface__["data"][0] == address
    assert np.frombuffer(buffer, np.int32, count=SHAPE.num_experts, offset=addresses[0] - buffer.ctypes.data).tolist() \
        == plan.demand.tolist()
    assert got.body_in_place()  # read, not replaced


@pytest.mark.parametrize("name", ["demand", "assignment", "slot", "copies"])
def test_worker_decode_notices_an_array_set_since(make_plan, name):
    plan = make_plan(SHAPE, np.random.default_rng(7), Target(1, 2, 0), 12)
    got = decode_worker_plan(encode_plan(plan), SHAPE)
    setattr(got, name, getattr(plan, name).copy())  # equal values, another array
    assert got.body_in_place() == (name == "demand")  # a demand copy is compared by value
    got.demand = got.demand + 1
    assert not got.body_in_place()


def test_digest_of_a_decoded_plan_is_its_checksum_until_an_array_is_replaced(make_plan):
    from afore.plan import plan_digest

    rng = np.random.default_rng(8)
    plan = make_plan(SHAPE, rng, Target(1, 2, 0), 13)
    data = encode_plan(plan)
    a, b = decode_worker_plan(data, SHAPE), decode_worker_plan(bytearray(data), SHAPE)
    assert plan_digest(a) == plan_digest(b) == a.digest == (checksum(data) or 1)
    other = decode_worker_plan(encode_plan(make_plan(SHAPE, rng, Target(1, 2, 0), 13)), SHAPE)
    assert plan_digest(other) != plan_digest(a)
    a.slot = a.slot.copy()  # no longer the entry's body: the digest of what the worker applies
    assert plan_digest(a) == plan_digest(plan) != b.digest


@pytest.mark.parametrize("path", [0, 1])
def test_checksum_is_stripe64_of_everything_after_the_prefix(path):
    """The C++ checksum equals the Python specification (``stripe64_reference``) on the scalar
    and the AVX2 path, at lengths around the stripe (64 B) and scramble block (1 KB) edges."""
    from afore._scheduler_core import _set_checksum_path
    from afore.scheduler.plan_codec import stripe64_reference

    rng = np.random.default_rng(path)
    try:
        assert _set_checksum_path(path) == (path == 1 and _set_checksum_path(-1))  # AVX2 only where the CPU has it
        _set_checksum_path(path)
        for n in (0, 1, 7, 8, 63, 64, 65, 127, 1023, 1024, 1025, 2047, 2048, 3000, 13112):
            data = rng.integers(0, 256, 12 + n, dtype=np.uint8).tobytes()
            assert checksum(data) == stripe64_reference(data[12:]) & 0xFFFFFFFF, n
        assert checksum(bytes(12)) == stripe64_reference(b"") & 0xFFFFFFFF
    finally:
        _set_checksum_path(-1)


def test_checksum_sees_every_bit_reordered_stripes_and_trailing_zeros():
    rng = np.random.default_rng(11)
    data = bytearray(rng.integers(0, 256, 12 + 4096, dtype=np.uint8).tobytes())
    base = checksum(bytes(data))
    for i in range(12, len(data)):  # every byte, one bit each (a torn or flipped byte anywhere)
        bit = 1 << (i % 8)
        data[i] ^= bit
        assert checksum(bytes(data)) != base, i
        data[i] ^= bit
    swapped = data[:12] + data[76:140] + data[12:76] + data[140:]  # two stripes exchanged
    assert checksum(bytes(swapped)) != base
    assert checksum(bytes(data) + b"\0") != base  # the zero-padded last stripe: the length counts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), step=st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**62]),
       seq=st.sampled_from([0, 5, 200, 70000, 2**40]), gain=st.floats(-1e6, 1e6), primary=st.booleans())
def test_native_encoder_writes_the_reference_bytes(make_plan, seed, step, seq, gain, primary):
    """``encode_plan`` (one C++ call) writes exactly the bytes of ``encode_plan_reference``
    (msgspec's header: every msgpack integer width, float64, both booleans; the body; the
    checksum), and a demand count beyond int32 is refused by both."""
    from afore.scheduler.plan_codec import encode_plan_reference

    rng = np.random.default_rng(seed)
    plan = make_plan(SHAPE, rng, Target(step, seed % 3, seed % 2), seq)
    plan.gain_ms, plan.exposed_ms, plan.primary_only = gain, abs(gain) / 3, primary
    assert encode_plan(plan) == encode_plan_reference(plan)
    plan.demand = plan.demand.copy()
    plan.demand[0] = 2**31
    for encode in (encode_plan, encode_plan_reference):
        with pytest.raises(ValueError, match="demand: expected counts <= 2147483647"):
            encode(plan)
