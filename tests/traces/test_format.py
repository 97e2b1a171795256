import numpy as np
import pytest

from afore.traces.format import Trace, load_trace, save_trace, skew_stats, total_variation


def _trace(**kw):
    args = dict(counts=np.arange(2 * 3 * 2 * 5, dtype=np.int32).reshape(2, 3, 2, 5), model="m", source="s",
                workload="w", top_k=2, hidden_size=64, moe_intermediate_size=32)
    args.update(kw)
    return Trace(**args)


def test_round_trip(tmp_path):
    trace = _trace()
    path = save_trace(trace, tmp_path / "t")
    assert path.suffix == ".npz"
    back = load_trace(path)
    assert np.array_equal(back.counts, trace.counts) and back.counts.dtype == np.int32
    assert (back.model, back.source, back.workload, back.top_k, back.hidden_size, back.moe_intermediate_size) == \
        ("m", "s", "w", 2, 64, 32)
    assert (back.num_steps, back.num_layers, back.num_microbatches, back.num_experts) == (2, 3, 2, 5)


@pytest.mark.parametrize("kw, field", [
    (dict(counts=np.zeros((2, 3, 5), np.int32)), "counts"),
    (dict(counts=-np.ones((1, 1, 1, 5), np.int32)), "counts"),
    (dict(counts=np.ones((1, 1, 1, 5), np.float32)), "counts"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=6), "top_k"),
    (dict(hidden_size=1.5), "hidden_size"),
    (dict(model=3), "model"),
])
def test_bad_fields_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _trace(**kw)


def test_load_rejects_missing_field(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, counts=np.zeros((1, 1, 1, 4), np.int32), model="m")
    with pytest.raises(ValueError, match="source"):
        load_trace(path)
    with pytest.raises(ValueError, match="trace"):
        load_trace(tmp_path / "absent.npz")


@pytest.mark.parametrize("content", [b"", b"not a zip archive"])
def test_load_rejects_an_unreadable_file_naming_it(tmp_path, content):
    path = tmp_path / "broken.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="trace: .*broken.npz.* is not a readable .npz"):
        load_trace(path)


def test_stats():
    assert total_variation(np.array([1, 0]), np.array([0, 1])) == pytest.approx(1.0)
    assert total_variation(np.array([2, 2]), np.array([1, 1])) == pytest.approx(0.0)
    counts = np.zeros((2, 1, 1, 4), np.int32)
    counts[0, 0, 0] = [4, 0, 0, 0]
    counts[1, 0, 0] = [2, 2, 0, 0]
    stats = skew_stats(counts)
    assert stats["max_mean"][0] == pytest.approx((4 / 1 + 2 / 1) / 2)
    assert stats["tv_consecutive"][0] == pytest.approx(0.5)
