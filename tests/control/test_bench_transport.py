import argparse
import json

import numpy as np
import pytest

from afore.bench import transport


def test_measure_reports_both_paths(tmp_path):
    parser = argparse.ArgumentParser()
    transport.add_arguments(parser)
    args = parser.parse_args(["--producers", "2", "--readers", "2", "--experts", "16", "--iters", "40",
                              "--warmup", "5", "--gap-us", "10", "--name", "transport_test", "--out-dir", str(tmp_path)])
    assert transport.run(args) == 0
    data = json.loads((tmp_path / "transport_test.json").read_text())
    for path in ("demand_written_to_target_complete", "plan_published_to_all_readers_copied"):
        lat = data["latency"][path]
        assert lat["n"] == 40 and 0 < lat["p50_us"] <= lat["p99_us"] <= lat["max_us"]
    assert data["setup"]["producers"] == 2 and data["setup"]["readers"] == 2
    assert (tmp_path / "transport_test.md").read_text().count("|") > 10
    assert (tmp_path / "transport_test.png").stat().st_size > 0


def test_sample_plan_is_a_valid_full_plan():
    from afore.config import ClusterShape
    from afore.plan import check_plan
    shape = ClusterShape(num_experts=128, num_workers=8, redundant_slots=2, m_tile=16)
    plan = transport.sample_plan(shape, 3, np.random.default_rng(0))
    check_plan(shape, plan)
    assert len(plan.copies) > 8


def test_serve_selection_and_itl_ratios():
    """``--serve-only``: the named servers plus plain vLLM, in run order; an unknown name is
    refused naming it. The report's ratios are each afore server's median over rounds against
    plain vLLM's."""
    from afore.bench.dataplane.transport import SERVERS, itl_ratios, serve_selection

    assert serve_selection("") == SERVERS
    assert serve_selection("afore-shm-workers, afore-shm") == ("afore-shm", "afore-shm-workers", "vllm")
    with pytest.raises(ValueError, match="serve_only: expected names among .*, got afore-fast"):
        serve_selection("afore-shm,afore-fast")

    def rounds(*p50_p99):
        return {"rounds": [{"itl_ms": {"p50": a, "p99": b}} for a, b in p50_p99]}

    serve = {"vllm": rounds((2.0, 10.0), (1.0, 6.0), (3.0, 8.0)), "afore-shm": rounds((6.0, 16.0), (4.0, 20.0)),
             "afore-shm-workers": rounds((3.0, 12.0))}
    assert itl_ratios(serve) == [("afore-shm", 2.5, 2.25), ("afore-shm-workers", 1.5, 1.5)]


def test_interleaved_rounds_alternate_servers_and_stop_all(monkeypatch, tmp_path):
    """``--serve-interleave``: every server is started before any round, round r runs on each
    server in turn, and every started server is stopped, also when a round fails."""
    from afore.bench.dataplane import transport as tr

    events = []

    class Fake:
        def __init__(self, name, command, url, log_dir, env=None):
            if name == "broken-start":
                raise RuntimeError("did not start")
            self.name, self.n = name, 0
            events.append(("start", name))

        def round(self, model, requests, concurrency):
            if self.name == "fails" and self.n == 1:
                raise RuntimeError("round failed")
            events.append(("round", self.name, self.n))
            self.n += 1

        def result(self):
            return {"rounds": self.n}

        def stop(self):
            events.append(("stop", self.name))

    monkeypatch.setattr(tr, "_Served", Fake)
    specs = [("a", [], "u", None), ("b", [], "u", None)]
    out = tr._serve_interleaved(specs, "m", 4, 2, 2, tmp_path)
    assert out == {"a": {"rounds": 2}, "b": {"rounds": 2}}
    assert events == [("start", "a"), ("start", "b"), ("round", "a", 0), ("round", "b", 0), ("round", "a", 1),
                      ("round", "b", 1), ("stop", "a"), ("stop", "b")]
    events.clear()
    with pytest.raises(RuntimeError, match="round failed"):
        tr._serve_interleaved([("a", [], "u", None), ("fails", [], "u", None)], "m", 4, 2, 2, tmp_path)
    assert ("stop", "a") in events and ("stop", "fails") in events
    events.clear()
    with pytest.raises(RuntimeError, match="did not start"):
        tr._serve_interleaved([("a", [], "u", None), ("broken-start", [], "u", None)], "m", 4, 2, 2, tmp_path)
    assert events == [("start", "a"), ("stop", "a")]
