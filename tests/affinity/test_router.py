"""Token-cost request routing (afore.serve.router) and the request simulator (afore.bench.request_sim)."""

from __future__ import annotations

import numpy as np
import pytest

from afore.bench.request_sim import SimRequest, StepModel, simulate_requests
from afore.serve.router import RequestRouter


def test_token_cost_balances_tokens_where_count_balances_requests():
    # seed 001's example: one 2,000-token prompt, then short ones
    lengths = [2000, 200, 200, 200, 200]
    count, cost = RequestRouter(2, "vllm-count", decode_estimate=0), RequestRouter(2, "token-cost", decode_estimate=0)
    for i, n in enumerate(lengths):
        count.route(str(i), n)
        cost.route(str(i), n)
    assert cost.outstanding_tokens.tolist() == [2000, 800]
    assert sorted(count.outstanding_requests.tolist()) == [2, 3]
    assert max(count.outstanding_tokens) >= 2200       # the count balancer put a short prompt behind the long one


def test_progress_and_finish_release_load():
    r = RequestRouter(2, "token-cost", decode_estimate=10)
    a = r.route("x", 100, max_tokens=4)                # cost 100 + min(4, 10)
    assert r.outstanding_tokens[a] == 104
    r.progress("x", 100)
    assert r.outstanding_tokens[a] == 4
    r.progress("x", 10)                                # more than expected: never negative
    assert r.outstanding_tokens[a] == 0
    assert r.finish("x") == a and r.outstanding_requests.sum() == 0
    with pytest.raises(ValueError, match="request_id"):
        r.finish("x")
    r.route("y", 1)
    with pytest.raises(ValueError, match="already routed"):
        r.route("y", 1)


def test_locality_prefers_the_engine_with_the_requests_experts():
    local = np.array([[True, True, False, False], [False, False, True, True]])
    r = RequestRouter(2, "token-cost", decode_estimate=0, locality_weight=1.0, engine_local=local)
    assert r.route("a", 100, expert_mass=np.array([0, 0, 1.0, 1.0])) == 1
    # engine 1 is now 100 tokens ahead; a request fully local to engine 1 still goes there when the
    # locality bonus (weight x cost x share gap) outweighs the load gap
    assert r.route("b", 150, expert_mass=np.array([0, 0, 1.0, 0])) == 1
    assert r.route("c", 50, expert_mass=np.array([0, 0, 1.0, 0])) == 0


@pytest.mark.parametrize("kwargs, field", [({"num_engines": 0}, "num_engines"), ({"num_engines": 2, "policy": "x"}, "policy"),
                                           ({"num_engines": 2, "engine_local": np.ones((3, 4), bool)}, "engine_local")])
def test_router_rejects_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RequestRouter(**kwargs)


def test_simulator_accounts_every_token_and_token_cost_cuts_the_tail():
    rng = np.random.default_rng(0)
    n = 200
    prompt = np.where(rng.random(n) < 0.1, 1500, 60)
    decode = rng.integers(20, 60, n)
    arrivals = np.cumsum(rng.exponential(2.0, n))   # queues form: routing matters
    reqs = [SimRequest(float(arrivals[i]), int(prompt[i]), int(decode[i]), 64) for i in range(n)]
    model = StepModel(num_layers=4, attn_ms_per_token=0.002, ffn_ms=lambda t: 0.05 + 0.0005 * t, max_batched_tokens=512)
    results = {}
    for policy in ("round-robin", "vllm-count", "token-cost"):
        res = simulate_requests(reqs, RequestRouter(4, policy, decode_estimate=40), model)
        assert res["engine_tokens"].sum() == prompt.sum() + decode.sum() - n   # the first token comes with the prefill
        assert np.all(res["ttft_ms"] > 0) and np.all(np.isfinite(res["tpot_ms"]))
        results[policy] = res
    p99 = {k: np.percentile(v["ttft_ms"], 99) for k, v in results.items()}
    assert p99["token-cost"] < p99["vllm-count"]
