"""afore bench dataplane --part transport: its byte counts and its report (the timings are not asserted)."""

import json

import pytest

from afore.bench.dataplane import main
from afore.bench.dataplane.transport import measure_bytes


def test_sparse_dispatch_moves_at_most_the_pairs_rows_and_at_least_each_token_once():
    for row in measure_bytes(hidden=64, top_k=8, num_experts=32, num_ffn=8):
        per_row = 64 * 2
        assert row["shm_a2f_bytes"] <= row["min_bytes"]              # never more than pairs x H
        assert row["shm_a2f_bytes"] >= row["tokens"] * per_row       # every token reaches some worker
        assert row["dense_a2f_bytes"] == 8 * row["tokens"] * per_row  # dense: every token to every worker
        assert row["shm_f2a_bytes"] == row["shm_a2f_bytes"]           # one partial row back per row read


@pytest.mark.slow
def test_report_is_written_with_both_transports(tmp_path):
    assert main(["--part", "transport", "--exchange-reps", "3", "--exchange-hidden", "32", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "dataplane_transport_cpu.json").read_text())
    assert {e["transport"] for e in result["exchange"]} == {"shm", "gloo"}
    shm = {e["tokens"]: e for e in result["exchange"] if e["transport"] == "shm"}
    gloo = {e["tokens"]: e for e in result["exchange"] if e["transport"] == "gloo"}
    assert all(shm[n]["a2f_bytes_sent"] * 2 == gloo[n]["a2f_bytes_sent"] for n in shm)  # F=2: dense sends twice
    assert (tmp_path / "dataplane_transport_cpu.md").read_text().startswith("# Data plane")
    assert (tmp_path / "dataplane_transport_cpu.png").stat().st_size > 0


def test_stage_breakdown_joins_the_three_traces_by_seq(tmp_path):
    """Synthetic traces of one attention worker, the scheduler and two FFN workers: every stage
    is the difference of the right stamps of the same target, F2A starts at the last reply."""
    from afore.attention.stages import COLUMNS as ATT
    from afore.bench.dataplane.transport import stage_breakdown
    from afore.ffn.stages import COLUMNS as FFN
    from afore.metrics.trace import CsvTrace
    from afore.scheduler.service import SCHEDULER_TRACE_COLUMNS as SCHED

    base = str(tmp_path / "st")
    att, sch = CsvTrace(base + ".0.csv", ATT), CsvTrace(base + ".scheduler.csv", SCHED)
    ffn = [CsvTrace(f"{base}.ffn{r}.csv", FFN) for r in range(2)]
    layers = 3
    for step in range(2):
        for layer in range(layers):
            seq = step * layers + layer
            t = 1_000_000 * (seq + 1)
            # prev_exit, enter (+100 us attention), demand (+10), sent (+20), recv_start (+21), done
            att.add((step, layer, 0, 4, t, t + 100_000, t + 110_000, t + 130_000, t + 131_000, t + 900_000, 0, 0, seq))
            sch.add((seq, t + 105_000, t + 105_000, t + 125_000, t + 126_000, t + 176_000, t + 186_000))
            for r, late in enumerate((0, 40_000)):  # worker 1 wakes 40 us later
                start = t + 150_000 + late
                # plan read +60 us, compute +200 (rows on the device after 15, 120 us of GPU time on worker 0,
                # a CPU worker 1 has none), vote +10, reply +30, its send returned +25
                ffn[r].add((seq, step, layer, 0, 4, 2, start, start, start + 60_000, start + 260_000, start + 270_000,
                            start + 300_000, 1, start + 75_000, 120_000 if r == 0 else 0, start + 325_000))
    att.add((5, 0, 0, 64, 1, 2, 3, 4, 5, 6, 0, 0, 99))  # a prefill target: not a decode one
    for trace in (att, sch, *ffn):
        trace.flush()
    b = stage_breakdown(tmp_path / "st", num_layers=layers, microbatches=1)
    st = {k: v["median_us"] for k, v in b["stages"].items()}
    assert b["targets"] == 6 and b["ffn_workers"] == 2
    assert st["attention compute before the layer"] == 100
    assert st["demand emit (count + mailbox put)"] == 10 and st["A2F post (rows into shm, wake)"] == 20
    assert st["scheduler: report -> taken up"] == 20 and st["scheduler: plan (policy)"] == 50
    assert st["scheduler: encode + publish"] == 10
    assert b["stages"]["FFN: A2F posted -> worker takes it up"]["mean_us"] == 40  # (20 + 60) / 2
    assert st["FFN: vote (every worker, after the compute)"] == 10 and st["FFN: expert compute"] == 200
    assert st["F2A: last reply (rows into shm, wake) -> attention has the sum"] == 900 - 150 - 40 - 300
    assert st["attention: wait for F2A (total)"] == 769
    assert st["FFN: compute, until its rows are gathered (GPU workers: into pinned memory)"] == 15
    assert b["stages"]["FFN: compute, GPU time (CUDA events)"] == {"median_us": 120, "mean_us": 120, "n": 6}  # worker 0 only
    assert st["FFN: reply send (device-to-host copy, publish)"] == 25
    # the join is by the seq each trace recorded, not one recomputed from (step, layer, microbatch):
    # a wrong layer or microbatch count (a CUDA run's default differs) joins the same rows
    assert stage_breakdown(tmp_path / "st", num_layers=4, microbatches=2) == b


def test_runner_breakdown_splits_a_step_into_vllm_and_the_exchanges(tmp_path):
    """Synthetic runner and attention traces: each decode step's forward holds three layer calls;
    the breakdown takes the forward minus its calls per step, skips a prefill step (a call over
    max_tokens), and reads plain vLLM's runner trace (no attention trace) as all steps."""
    from afore.attention.stages import COLUMNS as ATT, RUNNER_COLUMNS
    from afore.bench.dataplane.transport import runner_breakdown, runner_markdown
    from afore.metrics.trace import CsvTrace

    base = str(tmp_path / "st")
    CsvTrace(base + ".runner7.csv", RUNNER_COLUMNS).flush()  # another process's empty file: ignored
    run, att = CsvTrace(base + ".runner9.csv", RUNNER_COLUMNS), CsvTrace(base + ".0.csv", ATT)
    us = 1_000
    for step in range(5):
        t = step * 10_000 * us
        tokens = 64 if step == 2 else 4
        run.add((0, t, t + 7_000 * us))                       # execute_model
        run.add((1, t + 100 * us, t + 600 * us))              # prepare inputs 0.5 ms
        run.add((2, t + 700 * us, t + 6_700 * us))            # forward 6 ms
        for layer in range(3):                                # three calls of 1.2 ms each
            e = t + (1_000 + layer * 1_500) * us
            att.add((step, layer, 0, tokens, 0, e, e, e, e, e + 1_200 * us, 0, 0, step * 3 + layer))
        run.add((3, t + 7_400 * us, t + 7_700 * us))          # sample tokens 0.3 ms
    run.flush(), att.flush()
    b = runner_breakdown(tmp_path / "st")
    # steps 0, 1, 3 (step 2 is a prefill, step 4 has no next step to end it)
    assert b["steps"] == 3
    m = b["median_ms"]
    assert m["step"] == pytest.approx(10.0) and m["forward"] == pytest.approx(6.0)
    assert m["exchanges"] == pytest.approx(3.6) and m["forward_without_exchanges"] == pytest.approx(2.4)
    assert m["prepare_inputs"] == pytest.approx(0.5) and m["sample_tokens"] == pytest.approx(0.3)
    assert m["other"] == pytest.approx(10.0 - 6.0 - 0.5 - 0.3)
    (tmp_path / "st.0.csv").unlink()  # as plain vLLM: no layer calls, every step counts
    plain = runner_breakdown(tmp_path / "st")
    assert plain["steps"] == 4 and plain["median_ms"]["exchanges"] == 0
    assert runner_breakdown(tmp_path / "none") == {}
    table = "\n".join(runner_markdown({"afore-shm": b, "vllm": plain, "x": {}}))
    assert "| model forward | 6.000 | 6.000 |" in table and "afore-shm (3 steps)" in table


def test_stage_breakdown_takes_a_post_before_its_demand_in_that_order(tmp_path):
    """GPU attention workers post a target first and emit its demand from the host ids after:
    the two stages are then post = entry -> sent, demand = sent -> demand, never negative."""
    from afore.attention.stages import COLUMNS as ATT
    from afore.bench.dataplane.transport import stage_breakdown
    from afore.metrics.trace import CsvTrace

    att = CsvTrace(str(tmp_path / "st") + ".0.csv", ATT)
    for seq in range(3):
        t = 1_000_000 * (seq + 1)
        # enter +100 us, sent +140 (post 40 us), demand +150 (10 us after the post)
        att.add((seq, 0, 0, 4, t, t + 100_000, t + 150_000, t + 140_000, t + 141_000, t + 600_000, 0, 0, seq))
    att.flush()
    st = {k: v["median_us"] for k, v in stage_breakdown(tmp_path / "st", num_layers=1)["stages"].items()}
    assert st["A2F post (rows into shm, wake)"] == 40 and st["demand emit (count + mailbox put)"] == 10


def test_figures_are_means_over_the_rounds_from_two_scrapes():
    from afore.bench.dataplane.transport import _figure_means, _figures

    before = {"afore_ffn_lookahead_window_seconds_sum": 0.010, "afore_ffn_lookahead_window_seconds_count": 10,
              "afore_attention_overlap_seconds_sum": 0.0, "afore_attention_overlap_seconds_count": 0}
    after = {"afore_ffn_lookahead_window_seconds_sum": 0.016, "afore_ffn_lookahead_window_seconds_count": 13,
             "afore_attention_overlap_seconds_sum": 0.0, "afore_attention_overlap_seconds_count": 0}
    means = _figure_means(before, after)
    assert means["afore_ffn_lookahead_window_seconds"] == pytest.approx(2.0)  # 6 ms over 3 windows
    assert means["afore_attention_overlap_seconds"] is None  # no sample in the rounds
    assert means["afore_attention_f2a_wait_seconds"] is None
    assert _figures("http://127.0.0.1:9") == {}  # nothing listens: plain vLLM's rows stay empty
