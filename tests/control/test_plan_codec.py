import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from afore.config import ClusterShape
from afore.plan import Target, check_plan, primary_only_plan
from afore.scheduler.plan_codec import decode_plan, encode_plan, max_encoded_length

SHAPE = ClusterShape(num_experts=32, num_workers=4, num_layers=3, redundant_slots=2, m_tile=8, top_k=4)


def test_roundtrip_preserves_every_field(make_plan):
    rng = np.random.default_rng(0)
    for seq in range(20):
        plan = make_plan(SHAPE, rng, Target(seq // 6, seq % 3, seq % 2), seq)
        check_plan(SHAPE, plan)
        data = encode_plan(plan)
        assert len(data) <= max_encoded_length(SHAPE)
        got = decode_plan(data, SHAPE)
        check_plan(SHAPE, got)
        assert (got.target, got.seq, got.primary_only, got.gain_ms) == (plan.target, plan.seq, False, plan.gain_ms)
        for name in ("demand", "replicas", "assignment", "tiles", "slot", "copies", "tile_load"):
            np.testing.assert_array_equal(getattr(got, name), getattr(plan, name), err_msg=name)
        assert got.demand.dtype == np.int64


def test_every_single_bit_flip_is_rejected(make_plan):
    plan = make_plan(SHAPE, np.random.default_rng(1), Target(1, 2, 1), 11)
    data = bytearray(encode_plan(plan))
    for i in range(0, len(data), 7):
        for bit in (0, 5):
            data[i] ^= 1 << bit
            with pytest.raises(ValueError):
                decode_plan(bytes(data), SHAPE)
            data[i] ^= 1 << bit


def test_every_truncation_is_rejected():
    data = encode_plan(primary_only_plan(SHAPE, np.arange(32), Target(0, 0, 0), 0))
    for n in range(len(data)):
        with pytest.raises(ValueError):
            decode_plan(data[:n], SHAPE)
    with pytest.raises(ValueError):
        decode_plan(data + b"\0\0\0\0", SHAPE)


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
    data[8:12] = zlib.crc32(bytes(data[12:])).to_bytes(4, "little")
    with pytest.raises(ValueError, match="demand"):
        decode_plan(bytes(data), SHAPE)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_never_crash(data):
    with pytest.raises(ValueError):
        decode_plan(data, SHAPE)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=600), st.integers(0, 10**6))
def test_valid_prefix_with_random_tail_never_crashes(tail, cut):
    data = encode_plan(primary_only_plan(SHAPE, np.arange(32), Target(0, 1, 0), 2))
    cut = cut % len(data)
    mutated = data[:cut] + tail
    if mutated == data:
        return
    with pytest.raises(ValueError):
        decode_plan(mutated, SHAPE)
