"""The attention worker's in-process planner (``afore serve --planner attention``): the scheduler
service without a mailbox (``SchedulerService.plan_now``), read by FFN workers whose ring reader
attached before the ring existed (``RingPlanSource(wait_for_writer=True)``)."""

from __future__ import annotations

import uuid

import msgspec
import numpy as np
import pytest
import torch

from afore.attention.planner import InlinePlanner
from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.migrator.plan_source import RingPlanSource
from afore.plan import Target
from afore.scheduler.policies import Observation
from afore.scheduler.policy_board import PolicyBoard
from afore.scheduler.service import SchedulerService, ServiceConfig, make_service_policy

SHAPE = ClusterShape(num_experts=16, num_workers=2, num_layers=2, redundant_slots=2, m_tile=2, top_k=4)
PARAMS = SchedulerParams(copy_budget=4)
COST = CostModel(beta_tile_ms=0.01, bytes_per_expert=1 << 20, window_ms=0.5)


def _ids(n: int, seed: int = 5):
    """Skewed routed ids [tokens, k] per target, changing over the targets."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        hot = rng.permutation(SHAPE.num_experts)
        p = np.full(SHAPE.num_experts, 0.2 / (SHAPE.num_experts - 3))
        p[hot[:3]] = 0.8 / 3
        out.append(torch.from_numpy(np.stack([rng.choice(SHAPE.num_experts, SHAPE.top_k, replace=False, p=p)
                                              for _ in range(24)])))
    return out


def _config(ring: str, policy: str = "afore") -> ServiceConfig:
    return ServiceConfig(shape=SHAPE, policy=policy, mailbox="", ring=ring, num_microbatches=1, params=PARAMS, cost=COST)


def _same(a, b) -> bool:
    names = ("assignment", "slot", "copies", "demand")
    return a.seq == b.seq and a.target == b.target and all(np.array_equal(getattr(a, n), getattr(b, n)) for n in names)


def test_plans_published_before_the_reader_asks_are_the_policys_plans():
    """Readers made before the ring exists miss at once, attach once it exists, and from then on
    get every plan the in-process planner published: the same plans the policy makes on the same
    counts (a reference instance fed the same sequence), copies among them."""
    ring = f"afore-test-{uuid.uuid4().hex[:8]}-plans"
    readers = [RingPlanSource(ring, w, SHAPE, wait_for_writer=True) for w in range(SHAPE.num_workers)]
    with pytest.raises(ValueError):
        RingPlanSource(ring, 0, SHAPE)  # without wait_for_writer an absent ring is an error, as before
    target0 = Target.from_seq(0, SHAPE.num_layers, 1)
    assert all(r.get(target0, 0, 0.05) is None for r in readers) and all(r.misses == 1 for r in readers)
    planner = InlinePlanner(msgspec.json.encode(_config(ring)).decode())
    reference = make_service_policy("afore", SHAPE, PARAMS, COST)
    try:
        # what an FFN worker does once the attention side is connected (its planner made the ring)
        assert all(r.attach() for r in readers)
        copies = 0
        for seq, ids in enumerate(_ids(60), start=1):
            target = Target.from_seq(seq, SHAPE.num_layers, 1)
            planner.emit(target.step, target.layer, target.microbatch, seq, ids)
            planner.after_post()
            demand = np.bincount(ids.numpy().ravel(), minlength=SHAPE.num_experts).astype(np.int64)
            want = reference.plan(Observation(target, seq, demand))
            for r in readers:
                got = r.get(target, seq, 0.0)  # no wait: the plan is there before the tokens
                assert got is not None and _same(got, want), seq
            copies += len(want.copies)
        assert copies > 0 and planner.emitted == 60 and planner.errors == 0
        assert planner.service.published == 60
    finally:
        planner.close()
        for r in readers:
            r.close()


def test_a_policy_switch_on_the_board_plans_with_the_new_policy_from_empty_slots():
    ring = f"afore-test-{uuid.uuid4().hex[:8]}-plans"
    board = PolicyBoard(f"afore-test-{uuid.uuid4().hex[:8]}-policy", "afore")
    planner = InlinePlanner(msgspec.json.encode(_config(ring)).decode(), board.name)
    reader = RingPlanSource(ring, 0, SHAPE)
    try:
        ids = _ids(20)
        for seq in range(10):
            t = Target.from_seq(seq, SHAPE.num_layers, 1)
            planner.emit(t.step, t.layer, t.microbatch, seq, ids[seq])
        assert planner.policy == "afore" and planner.switches == 0  # the board's first read is the start policy
        board.set("static")
        fresh = make_service_policy("static", SHAPE, PARAMS, COST)
        for seq in range(10, 20):
            t = Target.from_seq(seq, SHAPE.num_layers, 1)
            planner.emit(t.step, t.layer, t.microbatch, seq, ids[seq])
            demand = np.bincount(ids[seq].numpy().ravel(), minlength=SHAPE.num_experts).astype(np.int64)
            want = fresh.plan(Observation(t, seq, demand))
            got = reader.get(t, seq, 0.0)
            assert got is not None and _same(got, want) and len(got.copies) == 0
        assert planner.policy == "static" and planner.switches == 1
        planner.after_post()
        assert planner.service.metrics.policy == "static"
    finally:
        planner.close()
        reader.close()
        board.close()


def test_the_inline_service_refuses_a_mailbox_and_step():
    ring = f"afore-test-{uuid.uuid4().hex[:8]}-plans"
    with pytest.raises(ValueError, match="planner: the inline service takes no mailbox"):
        InlinePlanner(msgspec.json.encode(ServiceConfig(shape=SHAPE, mailbox="m", ring=ring)).decode())
    with pytest.raises(ValueError, match="listen: the demand receiver feeds the mailbox"):
        ServiceConfig(shape=SHAPE, mailbox="", ring=ring, listen="127.0.0.1:1", token="t")
    service = SchedulerService(_config(ring))
    try:
        with pytest.raises(RuntimeError, match="step: this service has no mailbox"):
            service.step()
    finally:
        service.close()
