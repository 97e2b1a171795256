"""``afore serve`` split over two nodes: ``--role ffn`` and ``--role attention``.

The two roles run here as two process trees on one machine, and nothing but the network joins
them: the attention node is not given the FFN node's shared-memory mailbox, so its demand
reaches the scheduler only through the FFN node's demand receiver (TCP, shared token), and the
transport store is hosted by the FFN node. Tests, in order, on one pair of servers: greedy
output token-identical to plain vLLM; demand delivered over TCP and turned into plans that the
FFN workers used; the policy switched on the FFN node (the attention node reconnects its demand
path, output unchanged) and refused on the attention node; stopping the attention node stops
the FFN node (its workers' peer is gone) and leaves no shared-memory segment.
"""

from __future__ import annotations

import os
import time

import pytest

from servers import AttentionNode, FfnNode, alive, assert_same_generation, http, needs_vllm

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]

F = 2


@pytest.fixture(scope="module")
def nodes(qwen3_model, log_dir):
    ffn = FfnNode(qwen3_model, os.path.join(log_dir, "split-ffn.log"), ffn_workers=F, policy="afore")
    try:
        attention = AttentionNode(ffn, qwen3_model, os.path.join(log_dir, "split-attention.log"))
    except BaseException:
        ffn.stop()
        raise
    yield ffn, attention
    attention.stop()
    ffn.stop()


def _sample(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_split_roles_generate_what_plain_vllm_generates(nodes, qwen3_reference):
    _, attention = nodes
    assert_same_generation(attention.greedy(), qwen3_reference)


def test_demand_travels_over_tcp_and_becomes_plans_the_workers_use(nodes):
    ffn, attention = nodes
    attention.greedy(max_tokens=4)
    node = ffn.metrics()  # one endpoint: the scheduler's and every FFN worker's families
    accepted = _sample(node, 'afore_receiver_messages_total{outcome="accepted"}')
    assert accepted > 0, "no demand report reached the FFN node's receiver"
    assert _sample(node, "afore_scheduler_plans_total") > 0
    for w in range(F):
        targets = _sample(node, f'afore_ffn_targets_total{{worker="{w}"}}')
        primary_only = _sample(node, f'afore_ffn_primary_only_targets_total{{worker="{w}"}}')
        assert targets > 0 and primary_only < targets, f"worker {w}: {primary_only} of {targets} targets primary-only"


def test_policy_lives_on_the_ffn_node(nodes, qwen3_reference):
    ffn, attention = nodes
    code, out = http("POST", attention.admin + "/afore/policy", {"policy": "eplb"})
    assert code == 400 and "FFN node" in out["error"]
    before = _sample(ffn.metrics(), 'afore_receiver_messages_total{outcome="accepted"}')
    code, out = http("POST", ffn.admin + "/afore/policy", {"policy": "eplb"}, timeout=120)
    assert code == 200 and out["policy"] == "eplb", out
    # the scheduler (and its receiver) restarted: the attention node reconnects within a second
    time.sleep(1.5)
    assert_same_generation(attention.greedy(), qwen3_reference)
    # counters of the stopped scheduler stay in the sum: the new one's accepts are the increase
    after = _sample(ffn.metrics(), 'afore_receiver_messages_total{outcome="accepted"}')
    assert after > before, f"no demand accepted by the restarted scheduler (before the switch: {before}, after: {after})"


def test_stopping_the_attention_node_stops_the_ffn_node_cleanly(nodes):
    ffn, attention = nodes
    status = http("GET", ffn.admin + "/afore/status")[1]
    assert attention.stop() == 0
    deadline = time.monotonic() + 60
    while ffn.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ffn.proc.returncode == 1, f"FFN node still running or exited with {ffn.proc.returncode}:\n{ffn.tail()}"
    tag = f"afore-{ffn.proc.pid}-"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(tag)]
    children = [p["pid"] for p in status["processes"].values()]
    assert len(children) == F + 1  # the scheduler and the FFN workers
    assert not [pid for pid in children if alive(pid)], f"children left behind: {children}"

