"""``afore bench dataplane --part pipeline`` on the CPU: real FFN worker processes driven through
decode steps; the report's bytes are what the shm transport moves, every FFN stage is traced."""

import argparse

import pytest

from afore.bench.dataplane.pipeline import SHAPES, markdown, measure

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("schedule,attention_us", [("serial", 0.0), ("pingpong", 200.0)])
def test_pipeline_bench_moves_each_token_once_and_traces_every_stage(tmp_path, schedule, attention_us):
    """Either schedule (ping-pong: each microbatch's next layer waits for its own reply only, with
    an emulated attention before each post) moves the same bytes and every target once."""
    args = argparse.Namespace(pipe_shape="small", pipe_layers=2, pipe_ffn=2, pipe_microbatches=2, pipe_tokens="1,6",
                              pipe_steps=4, pipe_warmup=1, pipe_dtype="float32", seed=3, pipe_schedule=schedule,
                              pipe_attention_us=attention_us)
    r = measure(args, __import__("torch").device("cpu"), log=lambda msg: None)
    hidden, _, _, top_k = SHAPES["small"]
    assert [x["tokens"] for x in r["results"]] == [1, 6]
    for x in r["results"]:
        n = x["tokens"]
        b = x["bytes_per_layer"]
        # A2F: every token's row once plus its ids and weights (one attention worker, no duplicates)
        assert b["a2f"] == n * (hidden * 4 + top_k * 8)
        # F2A: at most one partial row (and its index) per token from each of the 2 workers, at least one per token
        assert n * (hidden * 4 + 4) <= b["f2a"] <= 2 * n * (hidden * 4 + 4)
        lo, hi = x["seq_range"]
        assert hi - lo == args.pipe_steps * args.pipe_layers * args.pipe_microbatches
        stages = x["ffn"]["stages_us"]
        for name in ("posted -> taken up", "plan read and checked", "compute (host, to rows back)", "vote", "reply publish"):
            assert stages[name] >= 0
        assert len(x["ffn"]["busy"]) == 2 and all(0 < v <= 1 for v in x["ffn"]["busy"])
        assert all(0 < c <= v for c, v in zip(x["ffn"]["compute_busy"], x["ffn"]["busy"]))
        assert 0 < x["layer_us"]["p50"] <= x["layer_us"]["p99"]
    assert r["schedule"] == schedule
    if attention_us:  # every layer call holds at least its microbatches' emulated attention
        assert all(x["layer_us"]["p50"] >= args.pipe_microbatches * attention_us for x in r["results"])
    r.update(date="d", hardware="h")
    text = markdown(r, "afore bench dataplane --part pipeline")
    assert "| 6 |" in text and "FFN stages per target" in text and f"schedule {schedule}" in text


def test_pipeline_bench_rejects_bad_options():
    args = argparse.Namespace(pipe_shape="small", pipe_layers=2, pipe_ffn=0, pipe_microbatches=2, pipe_tokens="1",
                              pipe_steps=4, pipe_warmup=1, pipe_dtype="float32", seed=3)
    with pytest.raises(ValueError, match="--pipe-ffn"):
        measure(args, __import__("torch").device("cpu"), log=lambda msg: None)
    args.pipe_ffn, args.pipe_tokens = 2, "0,4"
    with pytest.raises(ValueError, match="--pipe-tokens"):
        measure(args, __import__("torch").device("cpu"), log=lambda msg: None)


def test_pipeline_bench_rejects_a_bad_schedule():
    args = argparse.Namespace(pipe_shape="small", pipe_layers=1, pipe_ffn=1, pipe_microbatches=2, pipe_tokens="1",
                              pipe_steps=1, pipe_warmup=0, pipe_dtype="float32", seed=3, pipe_schedule="zigzag",
                              pipe_attention_us=0.0)
    with pytest.raises(ValueError, match="--pipe-schedule"):
        measure(args, __import__("torch").device("cpu"), log=lambda msg: None)
