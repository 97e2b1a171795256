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
