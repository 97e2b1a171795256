"""Copy pacing: the rate rule, the chunking and the gaps (``afore.migrator.pacing``)."""

import pytest
from hypothesis import given, strategies as st

from afore.migrator.pacing import copy_rate, gap_us, plan_paced, split_chunks

LINK = 390.0


def test_full_rate_when_pacing_is_off_or_pointless():
    assert copy_rate(10 << 20, None, None, LINK) is None       # no cap
    assert copy_rate(10 << 20, 0.0, None, LINK) is None        # cap 0 = full rate
    assert copy_rate(10 << 20, 500.0, None, LINK) is None      # cap above the link
    assert copy_rate(0, 100.0, 1.0, LINK) is None              # nothing to copy


def test_cap_applies_when_the_deadline_leaves_room():
    # 9.4 MB in a 1 ms deadline needs 9.4 GB/s: the 100 GB/s cap is the rate.
    assert copy_rate(9_437_184, 100.0, 1.0, LINK) == 100.0
    assert copy_rate(9_437_184, 100.0, None, LINK) == 100.0


def test_deadline_raises_the_rate_up_to_full_rate():
    # 200 MB in 1 ms needs 200 GB/s: faster than the cap, slower than the link.
    assert copy_rate(200_000_000, 100.0, 1.0, LINK) == pytest.approx(200.0)
    # 1 GB in 1 ms cannot be met even at full rate: no pacing at all.
    assert copy_rate(1_000_000_000, 100.0, 1.0, LINK) is None
    assert copy_rate(1 << 20, 100.0, 0.0, LINK) is None


@given(nbytes=st.integers(1, 1 << 32), cap=st.floats(1.0, 389.0), deadline=st.floats(0.01, 100.0))
def test_paced_copy_never_misses_a_deadline_that_full_rate_meets(nbytes, cap, deadline):
    rate = copy_rate(nbytes, cap, deadline, LINK)
    if rate is None:
        return
    assert cap <= rate < LINK
    if nbytes / (LINK * 1e6) <= deadline:          # full rate would meet the deadline
        assert nbytes / (rate * 1e6) <= deadline * (1 + 1e-9)


@given(chunk=st.integers(1, 1 << 24), rate=st.floats(1.0, 380.0))
def test_gap_makes_the_average_rate(chunk, rate):
    gap = gap_us(chunk, rate, LINK)
    transfer_us = chunk / (LINK * 1e3)
    assert gap >= 0
    assert chunk / ((transfer_us + gap) * 1e3) == pytest.approx(rate, rel=1e-9)


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="link_gbps"):
        copy_rate(1, 100.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="nbytes"):
        copy_rate(-1, 100.0, 1.0, LINK)
    with pytest.raises(ValueError, match="rates"):
        gap_us(1, 0.0, LINK)
    with pytest.raises(ValueError, match="chunk_bytes"):
        split_chunks([1], 0)
    with pytest.raises(ValueError, match=r"sizes\[1\]"):
        split_chunks([1, -2], 4)


@given(sizes=st.lists(st.integers(0, 5000), max_size=12), chunk=st.integers(1, 3000))
def test_chunks_cover_every_byte_once_in_order(sizes, chunk):
    chunks = split_chunks(sizes, chunk)
    pieces = [p for c in chunks for p in c]
    covered = {}
    for index, offset, length in pieces:
        assert length > 0
        assert covered.get(index, 0) == offset          # contiguous, in order
        covered[index] = offset + length
    assert covered == {i: s for i, s in enumerate(sizes) if s}
    totals = [sum(p[2] for p in c) for c in chunks]
    assert all(t == chunk for t in totals[:-1])
    assert not totals or 0 < totals[-1] <= chunk


@given(sizes=st.lists(st.integers(0, 200 << 20), min_size=1, max_size=16), rate=st.floats(5.0, 380.0),
       chunk=st.integers(1 << 20, 8 << 20), max_chunks=st.integers(1, 32), overhead=st.floats(0.0, 40.0))
def test_paced_plan_takes_about_the_bytes_over_the_rate(sizes, rate, chunk, max_chunks, overhead):
    plan = plan_paced(sizes, rate, LINK, chunk, max_chunks, overhead)
    total = sum(sizes)
    assert len(plan.chunks) <= max(max_chunks, 1)
    assert sum(p[2] for c in plan.chunks for p in c) == total
    if not total:
        return
    assert plan.gaps_us[-1] == 0.0 and all(g >= 0 for g in plan.gaps_us)
    # never faster than the link, never slower than the rate by more than the overheads the
    # plan cannot hide (a chunk whose transfer plus overhead already exceeds its share)
    last = sum(p[2] for p in plan.chunks[-1])
    assert plan.duration_us >= total / (LINK * 1e3) + len(plan.chunks) * overhead - 1e-6
    assert plan.duration_us <= (total - last) / (rate * 1e3) + last / (LINK * 1e3) + len(plan.chunks) * overhead + 1e-6
    if overhead <= min(sum(p[2] for p in c) / (rate * 1e3) - sum(p[2] for p in c) / (LINK * 1e3) for c in plan.chunks[:-1] or [[(0, 0, 0)]]):
        # the overhead fits inside every gap: the plan is the rate exactly, minus the last gap
        assert plan.duration_us == pytest.approx((total - last) / (rate * 1e3) + last / (LINK * 1e3) + overhead, rel=1e-9)


def test_paced_plan_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_chunks"):
        plan_paced([10], 50.0, LINK, 4, 0, 1.0)
    with pytest.raises(ValueError, match="overhead_us"):
        plan_paced([10], 50.0, LINK, 4, 4, float("nan"))
