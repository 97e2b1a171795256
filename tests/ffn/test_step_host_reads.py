"""The FFN step reads nothing back to the host (issue 12, part 2), checked on CPU by counting
every Python-level host read of a tensor while ``FFNLayer.forward`` runs a staged plan."""

import contextlib

import numpy as np
import pytest
import torch

from afore.config import ClusterShape
from afore.ffn.layer import FFNLayer
from afore.ffn.reference import dense_moe, random_plan, random_routing, random_slot_table
from afore.migrator.slot_pool import SlotPool
from afore.plan import Target

H, I = 16, 8
HOST_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def counting_host_reads():
    """Patch every tensor method that hands a value to the host; yield the list of calls."""
    calls: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name):
        original = saved[name]

        def counted(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)
        return counted

    sync = torch.cuda.synchronize
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, wrap(name))
        torch.cuda.synchronize = lambda *a, **k: calls.append("synchronize")
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize = sync


def _setup(seed=0, n=40):
    rng = np.random.default_rng(seed)
    shape = ClusterShape(num_experts=12, num_workers=3, redundant_slots=2, top_k=3, m_tile=4)
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(12, 2 * I, H, generator=gen) / 4, torch.randn(12, H, I, generator=gen) / 4
    ids, weights = random_routing(n, shape, rng, skew=1.5)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=12)
    table = random_slot_table(shape, rng, 1.0)
    plan, _ = random_plan(shape, demand, table, rng, Target(0, 0, 0), 1, new_copies=2)
    pools = []
    for w in range(3):
        pool = SlotPool(shape, w, H, I, dtype=torch.float32)
        pool.load_primaries(w13, w2)
        for r, ex in enumerate(table.expert[w]):
            if ex >= 0:
                pool.w13[pool.num_primaries + r] = w13[ex]
                pool.w2[pool.num_primaries + r] = w2[ex]
        for ex, _, dst, s in plan.copies.tolist():
            if dst == w:
                pool.w13[s], pool.w2[s] = w13[ex], w2[ex]
        pools.append(pool)
    return shape, pools, plan, torch.randn(n, H, generator=gen), ids, weights, w13, w2


def test_step_makes_no_host_read():
    shape, pools, plan, x, ids, weights, w13, w2 = _setup()
    layers = [FFNLayer(p, backend="torch") for p in pools]
    for layer in layers:
        layer.stage_plan(plan)  # when the plan arrives: host work allowed here
    with counting_host_reads() as calls:
        partials = [layer.forward(x, ids, weights, plan, w) for w, layer in enumerate(layers)]
    assert calls == []
    ref = dense_moe(x, ids, weights, w13, w2)
    assert float((sum(partials).double() - ref).norm() / ref.norm()) <= 1e-5


def test_the_counter_sees_the_reference_loops_host_reads():
    """The check can fail: the per-expert loop reads counts back, and is caught."""
    shape, pools, plan, x, ids, weights, _, _ = _setup()
    layer = FFNLayer(pools[0], backend="loop")
    with counting_host_reads() as calls:
        layer.forward(x, ids, weights, plan, 0)
    assert calls


def test_bad_ids_run_nowhere_and_are_counted_on_the_device():
    shape, pools, plan, x, ids, weights, w13, w2 = _setup(seed=3)
    layers = [FFNLayer(p, backend="torch") for p in pools]
    bad = ids.clone()
    bad[0, 0], bad[5, 1] = -1, 12
    with counting_host_reads() as calls:
        partials = [layer.forward(x, bad, weights, plan, w) for w, layer in enumerate(layers)]
    assert calls == []
    keep = torch.ones_like(weights)
    keep[0, 0] = keep[5, 1] = 0
    ref = dense_moe(x, bad.clamp(0, 11), weights * keep, w13, w2)  # the bad pairs contribute nothing
    assert float((sum(partials).double() - ref).norm() / ref.norm()) <= 1e-5
    assert [layer.input_errors() for layer in layers] == [2, 2, 2]


@pytest.mark.parametrize("field,kwargs", [
    ("hidden", dict(hidden=torch.zeros(3, H, dtype=torch.float64).to("meta"))),
    ("topk_weights", dict(weights=torch.zeros(3, 3, dtype=torch.int32))),
])
def test_inputs_on_the_wrong_device_or_dtype_name_the_field(field, kwargs):
    shape, pools, plan, *_ = _setup()
    layer = FFNLayer(pools[0], backend="torch")
    args = dict(hidden=torch.zeros(3, H), ids=torch.zeros(3, 3, dtype=torch.int32), weights=torch.zeros(3, 3))
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        layer.check_inputs(args["hidden"], args["ids"], args["weights"])
