"""`afore bench migration --device cpu`: the pipeline of the GPU benchmark, at CPU sizes."""

import json

from afore.bench.migration import main


def test_cpu_run_writes_a_cost_model(tmp_path):
    rc = main(["--device", "cpu", "--out-dir", str(tmp_path), "--parts", "kernels,copies,replay", "--replay-layers", "1"])
    assert rc == 0
    data = json.loads((tmp_path / "migration.json").read_text())
    cm = data["cost_model"]
    assert set(cm) == {"beta_tile_ms", "bytes_per_expert", "link_bandwidth_gbps", "copy_latency_ms", "window_ms"}
    assert cm["bytes_per_expert"] == 3 * 256 * 128 * 4  # tiny-a, fp32
    assert cm["link_bandwidth_gbps"] > 0 and cm["window_ms"] > 0
    replay = data["replay"]
    assert replay["rejected"] == 0 and replay["targets"] > 0
    assert all(r["exposed_ms"] >= 0 and r["window_ms"] >= 0 for r in replay["records"])
    assert (tmp_path / "migration.md").read_text().count("## ") >= 3
    assert (tmp_path / "migration.png").stat().st_size > 0
