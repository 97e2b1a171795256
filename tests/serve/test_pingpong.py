"""The ping-pong schedule of afore.attention.pingpong without vLLM: the baton's order, the
forward context restored at every wake-up, errors that stop every microbatch, and the cuts of a
step into microbatches."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from afore.attention import pingpong


def _layers(pp_log: list, m: int, num_layers: int, context: dict, work=None):
    """A microbatch's forward: at each 'MoE layer' post, yield, receive (as remote_forward does)."""
    def fn():
        for layer in range(num_layers):
            assert context["current"] == m, "ran under another microbatch's forward context"
            pp_log.append(("post", layer, pingpong.current()))
            pingpong.yield_()
            assert context["current"] == m, "woke under another microbatch's forward context"
            pp_log.append(("recv", layer, pingpong.current()))
            if work is not None:
                work(m, layer)
        return torch.full((m + 1, 2), float(m))
    return fn


@pytest.mark.parametrize("count", [2, 3])
def test_microbatches_interleave_across_layers_in_target_order(count):
    pp = pingpong.PingPong(count)
    log: list = []
    context = {"current": None}
    fns = [_layers(log, m, 3, context) for m in range(count)]
    enters = [lambda m=m: context.__setitem__("current", m) for m in range(count)]
    outs = pp.run(fns, enters)
    assert [o.shape[0] for o in outs] == list(range(1, count + 1))  # results in microbatch order
    posts = [(layer, m) for kind, layer, m in log if kind == "post"]
    # the FFN side's target order: (layer 0, mb 0), (0, 1), ..., (1, 0), ...
    assert posts == [(layer, m) for layer in range(3) for m in range(count)]
    # every microbatch receives layer l only after every microbatch posted layer l
    for i, (kind, layer, m) in enumerate(log):
        if kind == "recv":
            assert {mm for k, ll, mm in log[:i] if k == "post" and ll == layer} == set(range(count))
    # and runs again in the same process the next step (persistent threads)
    log.clear()
    pp.run([_layers(log, m, 1, context) for m in range(count)], enters)
    assert [(k, m) for k, _, m in log] == [("post", m) for m in range(count)] + [("recv", m) for m in range(count)]


def test_one_thread_at_a_time():
    pp = pingpong.PingPong(2)
    running = []
    lock = threading.Lock()
    overlap = []

    def work(m, layer):
        with lock:
            running.append(m)
            overlap.append(len(running))
        torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # releases the GIL
        with lock:
            running.remove(m)

    context = {"current": None}
    pp.run([_layers([], m, 4, context, work) for m in range(2)],
           [lambda m=m: context.__setitem__("current", m) for m in range(2)])
    assert overlap and max(overlap) == 1


def test_an_error_stops_every_microbatch_and_reaches_the_caller():
    pp = pingpong.PingPong(2)
    reached = []

    def bad():
        pingpong.yield_()
        raise RuntimeError("exchange failed")

    def good():
        for layer in range(3):
            pingpong.yield_()
            reached.append(layer)
        return 1

    with pytest.raises(RuntimeError, match="exchange failed"):
        pp.run([bad, good], [lambda: None, lambda: None])
    # microbatch 1 posted layer 0, then found the failure at its next wake-up: it never ran on
    assert reached == []
    # the threads are usable again
    assert pp.run([lambda: 1, lambda: 2], [lambda: None, lambda: None]) == [1, 2]


def test_baton_needs_two_microbatches():
    with pytest.raises(ValueError, match="count"):
        pingpong.Baton(1)
    assert pingpong.current() is None


@pytest.mark.parametrize("tokens,count,want", [
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([1, 1, 1, 1, 1, 1], 3, [0, 2, 4, 6]),
    ([5, 1, 1, 1, 1, 1], 2, [0, 1, 6]),      # the long request alone against five
    ([1, 1], 2, [0, 1, 2]),
    ([1, 1, 1], 3, [0, 1, 2, 3]),
])
def test_request_cuts_balance_tokens_on_request_boundaries(tokens, count, want):
    cuts = pingpong.request_cuts(np.array(tokens), count)
    assert cuts == want
    assert all(b > a for a, b in zip(cuts, cuts[1:]))  # no empty microbatch


def test_request_cuts_need_a_request_per_microbatch():
    with pytest.raises(ValueError, match="requests"):
        pingpong.request_cuts(np.array([4]), 2)


def test_split_only_safe_steps():
    # decodes and fresh prefills split; a request with computed tokens and several new ones (a
    # prefix-cache hit, a chunked prefill) may read blocks another request writes this step: whole
    assert pingpong.split_is_safe(np.array([1, 1, 1]), np.array([4, 9, 2]), 2)
    assert pingpong.split_is_safe(np.array([1, 7]), np.array([4, 0]), 2)
    assert not pingpong.split_is_safe(np.array([1, 7]), np.array([4, 3]), 2)
    assert not pingpong.split_is_safe(np.array([1]), np.array([4]), 2)
