import numpy as np
import pytest

from afore.traces import cli as trace_cli
from afore.traces.format import load_trace, skew_stats
from afore.traces.harmoeny import find_harmoeny_dir, read_harmoeny_csv

DATA = find_harmoeny_dir()


def _csv(tmp_path, rows, experts=3):
    path = tmp_path / "expert_freq_switch128_datasets.csv"
    header = ",dataset,iteration,layer_idx," + ",".join(str(i) for i in range(experts))
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


def test_parse_small_csv(tmp_path):
    rows = [f"{i},wiki,{it},{l},{it},{l},{7}" for i, (it, l) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)])]
    traces = read_harmoeny_csv(_csv(tmp_path, rows), "switch128", layers=(0, 1))
    t = traces["wiki"]
    assert t.counts.shape == (2, 2, 1, 3)
    assert t.counts[1, 0, 0].tolist() == [1, 0, 7] and t.counts[0, 1, 0].tolist() == [0, 1, 7]
    assert t.top_k == 1 and "switch" in t.model


def test_parse_errors(tmp_path):
    with pytest.raises(ValueError, match="csv"):
        read_harmoeny_csv(_csv(tmp_path, ["0,wiki,0,0,1,2"]), "switch128", layers=(0,))
    with pytest.raises(ValueError, match="csv"):
        read_harmoeny_csv(_csv(tmp_path, ["0,wiki,0,0,1,2,3"]), "switch128", layers=(0, 1))
    with pytest.raises(ValueError, match="model"):
        read_harmoeny_csv(_csv(tmp_path, []), "nope")


@pytest.mark.skipif(DATA is None, reason="../shared/traces/harmoeny not present")
def test_convert_real_traces(tmp_path, capsys):
    import argparse
    parser = argparse.ArgumentParser()
    trace_cli.add_arguments(parser)
    assert trace_cli.run(parser.parse_args(["convert", "--out-dir", str(tmp_path)])) == 0
    t = load_trace(tmp_path / "harmoeny-switch128-wikitext.npz")
    assert t.counts.shape == (30, 6, 1, 128)
    assert np.all(t.counts.sum(axis=-1) == 524288)  # 8 GPUs x 64 seqs x 1024 tokens, top-1
    # the README's statistics for wikitext layer 0: max/mean 27.92, consecutive TV 0.0411
    stats = skew_stats(t.counts)
    assert stats["max_mean"][0] == pytest.approx(27.92, abs=0.01)
    assert stats["tv_consecutive"][0] == pytest.approx(0.0411, abs=1e-3)
    assert trace_cli.run(parser.parse_args(["info", str(tmp_path / "harmoeny-switch128-wikitext.npz")])) == 0
    assert "max/mean" in capsys.readouterr().out


def test_missing_folder_is_reported(tmp_path, capsys):
    import argparse
    assert find_harmoeny_dir(tmp_path / "absent") is None
    parser = argparse.ArgumentParser()
    trace_cli.add_arguments(parser)
    assert trace_cli.run(parser.parse_args(["convert", "--src", str(tmp_path), "--out-dir", str(tmp_path / "o")])) == 2
    assert "not found" in capsys.readouterr().err
