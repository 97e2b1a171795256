"""The attention side's remote demand path: DemandEmitter -> TCP -> DemandReceiver -> mailbox
(``afore serve --role attention`` on another node than the scheduler)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from afore.attention.demand import DemandEmitter
from afore.config import ClusterShape
from afore.prefetch.mailbox import DemandMailbox
from afore.prefetch.receiver import DemandReceiver

SHAPE = ClusterShape(num_experts=8, num_workers=2, num_layers=2, top_k=2)
IDS = torch.tensor([[0, 3], [3, 5]], dtype=torch.int32)
COUNTS = [1, 0, 0, 2, 0, 1, 0, 0]


def wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture
def box(seg_name):
    mb = DemandMailbox.create(seg_name("remote"), SHAPE, num_producers=1, num_microbatches=2)
    producer = DemandMailbox.attach(mb.name)
    yield mb, producer
    producer.close()
    mb.close()


def complete(mb, n):
    out = []
    for _ in range(n):
        got = mb.wait_complete(timeout_s=5.0)
        if got is None:
            break
        out.append(got)
    return out


def test_remote_emitter_delivers_targets_in_order_and_reconnects_after_a_restart(box):
    mb, producer = box
    receiver = DemandReceiver(producer, token="tok")
    port = receiver.start()
    emitter = DemandEmitter("", SHAPE.num_experts, 0, demand=f"127.0.0.1:{port}", demand_token="tok")
    order = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    for seq, (step, layer, mb_) in enumerate(order):
        emitter.emit(step, layer, mb_, seq, IDS)
    got = complete(mb, 4)
    assert [(g.target.step, g.target.layer, g.target.microbatch) for g in got] == order
    assert all(np.array_equal(g.demand, COUNTS) for g in got)
    # the scheduler restarts (a policy switch): reports sent while it is down are lost (the
    # first one into the just-closed connection without an error, TCP cannot tell yet), never
    # block the forward, and the emitter reconnects once the receiver is back
    receiver.stop()
    emitter.emit(1, 0, 0, 4, IDS)
    emitter.emit(1, 0, 1, 5, IDS)
    assert wait_for(lambda: emitter.errors >= 1)
    receiver = DemandReceiver(producer, token="tok", port=port)
    receiver.start()
    time.sleep(1.1)  # one retry per second at most
    emitter.emit(2, 0, 0, 8, IDS)
    emitter.emit(2, 0, 1, 9, IDS)
    got = complete(mb, 2)  # step 1 never arrives; the mailbox moves past it to step 2
    assert [(g.target.step, g.target.microbatch) for g in got][-2:] == [(2, 0), (2, 1)], got
    receiver.stop()


def test_remote_emitter_with_a_wrong_token_drops_its_reports(box):
    mb, producer = box
    receiver = DemandReceiver(producer, token="right")
    port = receiver.start()
    emitter = DemandEmitter("", SHAPE.num_experts, 0, demand=f"127.0.0.1:{port}", demand_token="wrong")
    emitter.emit(0, 0, 0, 0, IDS)
    assert wait_for(lambda: emitter.errors == 1)
    assert emitter.emitted == 0 and mb.wait_complete(timeout_s=0.2) is None
    receiver.stop()


def test_emitter_refuses_two_paths_or_a_missing_token():
    with pytest.raises(ValueError, match="one demand path"):
        DemandEmitter("box", SHAPE.num_experts, 0, demand="h:1", demand_token="t")
    with pytest.raises(ValueError, match="AFORE_DEMAND_TOKEN"):
        DemandEmitter("", SHAPE.num_experts, 0, demand="h:1")
