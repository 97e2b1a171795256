"""Invariant 1: any plan, placement and slot state gives the monolithic MoE layer's output."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from afore.config import ClusterShape
from afore.ffn.layer import FFNLayer
from afore.ffn.partition import ordinal_intervals, pair_ordinals, worker_mask, worker_pairs
from afore.ffn.reference import dense_moe, random_plan, random_routing, random_slot_table
from afore.migrator.slot_pool import SlotPool
from afore.plan import Target, check_plan, primary_only_plan

H, I = 16, 8


def make_pools(shape, table, w13, w2):
    """Pools of every worker with the table's redundant bindings resident."""
    pools = []
    for w in range(shape.num_workers):
        pool = SlotPool(shape, w, H, I, dtype=w13.dtype)
        pool.load_primaries(w13, w2)
        for r, ex in enumerate(table.expert[w]):
            if ex >= 0:
                s = pool.num_primaries + r
                pool.w13[s] = w13[ex]
                pool.w2[s] = w2[ex]
                pool.resident[s] = ex
        pools.append(pool)
    return pools


def apply_copies(pools, plan, w13, w2):
    for ex, _, dst, s in plan.copies.tolist():
        pools[dst].w13[s] = w13[ex]
        pools[dst].w2[s] = w2[ex]
        pools[dst].resident[s] = ex


def relative_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def random_case(shape, n, seed):
    """(rng, w13, w2, hidden, ids, weights, demand) of one random layer call with ``n`` tokens."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    e = shape.num_experts
    w13 = torch.randn(e, 2 * I, H, generator=gen) / 4
    w2 = torch.randn(e, H, I, generator=gen) / 4
    hidden = torch.randn(n, H, generator=gen)
    ids, weights = random_routing(n, shape, rng, skew=float(rng.uniform(0, 2)))
    return rng, w13, w2, hidden, ids, weights, np.bincount(ids.reshape(-1).numpy(), minlength=e)


def routed_case(shape, n, seed, fill, bad, stale):
    """(w13, w2, hidden, ids int32, weights, slot table, plan) of one host-routed case: ``bad`` ids
    set outside [0, E), a plan with up to 3 new copies over a table filled to ``fill``, made for
    permuted demand when ``stale``."""
    rng, w13, w2, hidden, ids, weights, demand = random_case(shape, n, seed)
    ids = ids.to(torch.int32)
    e = shape.num_experts
    if stale:
        demand = rng.permutation(demand)
    if n and bad:
        flat = ids.view(-1)
        flat[torch.from_numpy(rng.choice(flat.numel(), min(bad, flat.numel()), replace=False))] = \
            torch.tensor([-1, e, e + 5][:min(bad, flat.numel())], dtype=ids.dtype)
    table = random_slot_table(shape, rng, fill)
    plan, _ = random_plan(shape, demand, table, rng, Target(0, 0, 0), seq=1, new_copies=int(rng.integers(0, 4)))
    return w13, w2, hidden, ids, weights, table, plan


shapes = st.builds(
    lambda e, f, r, k, m: ClusterShape(num_experts=max(e, f), num_workers=f, redundant_slots=r,
                                       top_k=min(k, max(e, f)), m_tile=m),
    st.integers(2, 16), st.integers(1, 4), st.integers(0, 3), st.integers(1, 4), st.integers(1, 8))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, n=st.integers(0, 48), seed=st.integers(0, 2**31 - 1), fill=st.floats(0, 1))
def test_sum_over_workers_equals_dense_layer(shape, n, seed, fill):
    rng, w13, w2, hidden, ids, weights, demand = random_case(shape, n, seed)
    table = random_slot_table(shape, rng, fill)
    plan, _ = random_plan(shape, demand, table, rng, Target(0, 0, 0), seq=1, new_copies=int(rng.integers(0, 4)))
    check_plan(shape, plan, table)
    pools = make_pools(shape, table, w13, w2)
    apply_copies(pools, plan, w13, w2)
    partials = [FFNLayer(pool, backend="torch").forward(hidden, ids, weights, plan, w) for w, pool in enumerate(pools)]
    out = torch.stack(partials).sum(0) if partials else torch.zeros(n, H)
    ref = dense_moe(hidden, ids, weights, w13, w2)
    assert out.shape == (n, H)
    if n:
        assert relative_error(out, ref) <= 1e-5


@settings(max_examples=60, deadline=None)
@given(shape=shapes, n=st.integers(0, 48), seed=st.integers(0, 2**31 - 1), fill=st.floats(0, 1),
       bad=st.integers(0, 3), stale=st.booleans(), native=st.booleans())
def test_host_sparse_step_equals_the_torch_step(shape, n, seed, fill, bad, stale, native):
    """CPU workers run ``forward_sparse``: every worker's rows equal the torch backend's rows of
    the same tokens (bit for bit with the numpy bookkeeping and torch matmuls; to fp32 rounding,
    1e-6, in ``afore._ffn``, whose dot products add in another order), its tokens are exactly
    those with a pair on it, ids outside [0, E) run nowhere and are counted, also for a plan
    made for other demand (stale: the primary takes the remainder)."""
    import afore.ffn.experts as experts

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts, "NATIVE_MAX_MACS", experts.NATIVE_MAX_MACS if native else -1)
        check_host_sparse_step(shape, n, seed, fill, bad, stale, native)


def check_host_sparse_step(shape, n, seed, fill, bad, stale, native):
    rng, w13, w2, hidden, ids, weights, demand = random_case(shape, n, seed)
    e = shape.num_experts
    if stale:
        demand = rng.permutation(demand)
    if n and bad:  # padding rows some routers mark with -1, and ids past E
        flat = ids.view(-1)
        flat[torch.from_numpy(rng.choice(flat.numel(), min(bad, flat.numel()), replace=False))] = \
            torch.tensor([-1, e, e + 5][:min(bad, flat.numel())] * 3, dtype=ids.dtype)[:min(bad, flat.numel())]
    table = random_slot_table(shape, rng, fill)
    plan, _ = random_plan(shape, demand, table, rng, Target(0, 0, 0), seq=1, new_copies=int(rng.integers(0, 4)))
    pools = make_pools(shape, table, w13, w2)
    apply_copies(pools, plan, w13, w2)
    owner = torch.as_tensor(shape.primary_owner)
    covered = torch.zeros(n * shape.top_k, dtype=torch.int64)
    for w, pool in enumerate(pools):
        dense_layer, sparse_layer = FFNLayer(pool, backend="torch"), FFNLayer(pool, backend="torch")
        dense = dense_layer.forward(hidden, ids, weights, plan, w)
        tokens, rows = sparse_layer.forward_sparse(lambda t: hidden, ids, weights, plan)
        # eq. 11 with ids outside [0, E) in a bin of their own (the torch step's rule)
        flat = ids.reshape(-1).long()
        valid = (flat >= 0) & (flat < e)
        ordinals = pair_ordinals(torch.where(valid, flat, e), e + 1)
        lo, hi = ordinal_intervals(torch.as_tensor(plan.assignment), owner)
        ex = torch.where(valid, flat, 0)
        mask = valid & (ordinals >= lo[ex, w]) & (ordinals < hi[ex, w])
        assert torch.equal(mask, worker_mask(ids, torch.as_tensor(plan.assignment), owner, w))  # the GPU path's tokens
        covered += mask.long()
        want = torch.nonzero(mask.view(n, shape.top_k).any(1)).squeeze(1) if n else torch.zeros(0, dtype=torch.int64)
        assert torch.equal(tokens, want)
        if native:
            assert rows.shape == (tokens.numel(), H) and rows.dtype == dense.dtype
            if tokens.numel():
                assert relative_error(rows, dense[tokens]) <= 1e-6
        else:
            assert torch.equal(rows, dense[tokens])
        assert sparse_layer.input_errors() == dense_layer.input_errors()
    if n:  # every valid pair ran on exactly one worker
        assert torch.equal(covered, ((ids >= 0) & (ids < e)).view(-1).long())



@settings(max_examples=60, deadline=None)
@given(shape=shapes, n=st.integers(0, 48), seed=st.integers(0, 2**31 - 1), fill=st.floats(0, 1),
       bad=st.integers(0, 3), stale=st.booleans())
def test_host_routed_step_equals_the_dense_step(shape, n, seed, fill, bad, stale):
    """GPU workers fed by the shm transport route on the host (``forward_host_routed``): the step
    sees only the tokens with a pair on the worker, under a local table. Its tokens are exactly
    those, its rows equal the full step's rows of those tokens bit for bit (the same pairs in the
    same groups), ids outside [0, E) are counted once whether or not their token is kept, also for a
    plan made for other demand."""
    w13, w2, hidden, ids, weights, table, plan = routed_case(shape, n, seed, fill, bad, stale)
    e = shape.num_experts
    pools = make_pools(shape, table, w13, w2)
    apply_copies(pools, plan, w13, w2)
    owner = torch.as_tensor(shape.primary_owner)
    total = torch.zeros(n, H, dtype=torch.float64)
    for w, pool in enumerate(pools):
        dense_layer, routed_layer = FFNLayer(pool, backend="torch"), FFNLayer(pool, backend="torch")
        dense = dense_layer.forward(hidden, ids, weights, plan, w)
        gathered = []

        def gather(tokens, out):
            gathered.append(tokens.clone())
            out.copy_(hidden[tokens])

        tokens, rows = routed_layer.forward_host_routed(gather, ids, weights, plan)
        mask = worker_mask(ids, torch.as_tensor(plan.assignment), owner, w)
        want = torch.nonzero(mask.view(n, shape.top_k).any(1)).squeeze(1) if n else torch.zeros(0, dtype=torch.int64)
        assert torch.equal(tokens, want)
        assert all(torch.equal(g, want) for g in gathered)  # only this worker's rows are read
        assert torch.equal(rows, dense[tokens])
        assert routed_layer.input_errors() == dense_layer.input_errors()
        total[tokens] += rows.double()
    if n:
        ref = dense_moe(hidden, ids.masked_fill((ids < 0) | (ids >= e), 0), weights.masked_fill((ids < 0) | (ids >= e), 0),
                        w13, w2)
        # fp32 partial sums against the fp64 layer: at most 2.3e-7 over 300 random cases
        assert float((total - ref).norm() / ref.norm().clamp_min(1e-30)) <= 1e-6


@settings(max_examples=80, deadline=None)
@given(shape=shapes, n=st.integers(0, 48), seed=st.integers(0, 2**31 - 1), fill=st.floats(0, 1),
       bad=st.integers(0, 3), stale=st.booleans())
def test_native_route_local_equals_host_route(shape, n, seed, fill, bad, stale):
    """``afore._ffn.route_local`` (the host-fed GPU step's routing, written straight into the
    graph's host buffers) is ``host_route`` for every worker: the same kept tokens, the same local
    table (with the pair count U * k), the same dropped bad ids, and the kept tokens' ids and
    weights packed in token order."""
    from afore._ffn import route_local
    from afore.ffn.device_plan import DevicePlan
    from afore.ffn.layer import host_route

    _, _, _, ids, weights, _, plan = routed_case(shape, n, seed, fill, bad, stale)
    e, k = shape.num_experts, shape.top_k
    ids_np, weights_np = ids.numpy().copy(), weights.float().numpy().copy()
    for w in range(shape.num_workers):
        dp = DevicePlan(shape, w, int(shape.primary_counts[w]) + shape.redundant_slots, "cpu")
        wt = dp.stage(plan)
        want = host_route(ids_np, wt, e)
        tokens = np.full(max(n, 1), -7, np.int64)
        ids_out = np.full(max(n, 1) * k, -7, np.int32)
        weights_out = np.full(max(n, 1) * k, -7.0, np.float32)
        local = np.full(wt.size, -7, np.int32)
        u, dropped = route_local(ids_np.ctypes.data, weights_np.ctypes.data, n, k, wt.ctypes.data, e, dp.width,
                                 tokens.ctypes.data, ids_out.ctypes.data, weights_out.ctypes.data, local.ctypes.data)
        assert u == want.tokens.size and np.array_equal(tokens[:u], want.tokens)
        assert dropped == want.dropped_errors
        expect = want.local_table.copy()
        expect[-1] = u * k
        assert np.array_equal(local, expect)
        assert np.array_equal(ids_out[:u * k].reshape(u, k), ids_np[want.tokens])
        assert np.array_equal(weights_out[:u * k].reshape(u, k), weights_np[want.tokens])


def test_partition_is_exact_and_matches_assignment():
    rng = np.random.default_rng(3)
    shape = ClusterShape(num_experts=12, num_workers=4, redundant_slots=3, top_k=4, m_tile=4)
    ids, _ = random_routing(200, shape, rng, skew=1.5)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=12)
    table = random_slot_table(shape, rng, 1.0)
    plan, _ = random_plan(shape, demand, table, rng, Target(0, 0, 0), 1, new_copies=3)
    owner = torch.as_tensor(shape.primary_owner)
    a = torch.as_tensor(plan.assignment)
    chosen = [worker_pairs(ids, a, owner, w) for w in range(4)]
    all_pairs = torch.cat(chosen).sort().values
    assert torch.equal(all_pairs, torch.arange(ids.numel()))  # disjoint and covering
    flat = ids.reshape(-1).long()
    for w, pairs in enumerate(chosen):
        got = np.bincount(flat[pairs].numpy(), minlength=12)
        assert np.array_equal(got, plan.assignment[:, w])
        # every worker's share of e is one contiguous ordinal interval
        ords = pair_ordinals(flat, 12)[pairs]
        for ex in np.nonzero(got)[0]:
            o = ords[flat[pairs] == ex]
            assert int(o.max() - o.min()) + 1 == o.numel()


def test_ordinals_follow_flattened_routing_order():
    ids = torch.tensor([[2, 0], [0, 1], [2, 0]])
    assert pair_ordinals(ids.reshape(-1), 3).tolist() == [0, 0, 1, 0, 1, 2]


def test_non_primary_replicas_take_the_first_ordinals_in_worker_order():
    # expert 0 primary on worker 0, replicas on workers 1 and 2 with 3 and 2 pairs
    a = torch.tensor([[5, 3, 2]])
    lo, hi = ordinal_intervals(a, torch.tensor([0]))
    assert (lo.tolist(), hi[0, 1:].tolist()) == ([[5, 0, 3]], [3, 5])
    assert hi[0, 0] == torch.iinfo(torch.int64).max


def test_primary_only_plan_runs_everything_on_primaries():
    rng = np.random.default_rng(0)
    shape = ClusterShape(num_experts=8, num_workers=3, redundant_slots=2, top_k=2, m_tile=4)
    w13, w2 = torch.randn(8, 2 * I, H), torch.randn(8, H, I)
    hidden = torch.randn(30, H)
    ids, weights = random_routing(30, shape, rng)
    plan = primary_only_plan(shape, np.bincount(ids.reshape(-1).numpy(), minlength=8), Target(0, 0, 0), 0)
    pools = make_pools(shape, random_slot_table(shape, rng, 0.0), w13, w2)  # redundant slots hold NaN
    out = sum(FFNLayer(p, backend="torch")(hidden, ids, weights, plan) for p in pools)
    assert relative_error(out, dense_moe(hidden, ids, weights, w13, w2)) <= 1e-5


def test_reading_an_uncopied_slot_is_detected():
    """A plan whose copy never ran reads NaN, not plausible numbers (guards the guard)."""
    rng = np.random.default_rng(1)
    shape = ClusterShape(num_experts=4, num_workers=2, redundant_slots=1, top_k=2, m_tile=1)
    w13, w2 = torch.randn(4, 2 * I, H), torch.randn(4, H, I)
    ids = torch.tensor([[0, 1]] * 8, dtype=torch.int32)
    weights = torch.full((8, 2), 0.5)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=4)
    plan = primary_only_plan(shape, demand, Target(0, 0, 0), 0)
    plan.replicas[0, 1] = True
    plan.slot[0, 1] = 2
    plan.assignment[0] = [4, 4]
    pools = make_pools(shape, random_slot_table(shape, rng, 0.0), w13, w2)
    out = FFNLayer(pools[1], backend="torch")(torch.randn(8, H), ids, weights, plan)
    assert torch.isnan(out).any()


@pytest.mark.parametrize("field,kwargs", [
    ("hidden", dict(hidden=torch.zeros(3, H + 1))),
    ("topk_ids", dict(ids=torch.zeros(3, 3, dtype=torch.int32))),
    ("topk_weights", dict(weights=torch.zeros(2, 2))),
])
def test_bad_inputs_name_the_field(field, kwargs):
    shape = ClusterShape(num_experts=4, num_workers=1, redundant_slots=0, top_k=2)
    layer = FFNLayer(SlotPool(shape, 0, H, I, dtype=torch.float32))
    args = dict(hidden=torch.zeros(3, H), ids=torch.zeros(3, 2, dtype=torch.int32), weights=torch.zeros(3, 2))
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        layer.check_inputs(args["hidden"], args["ids"], args["weights"])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), f=st.integers(2, 4))
def test_scheduler_plans_over_a_sequence_of_targets(seed, f):
    """Plans from Algorithm 1 (evolving slot table, copies applied as the migrator would)."""
    from afore.config import CostModel, SchedulerParams
    from afore.scheduler.algorithm import schedule
    from afore.plan import SlotTable

    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    shape = ClusterShape(num_experts=12, num_workers=f, redundant_slots=2, top_k=3, m_tile=2)
    w13, w2 = torch.randn(12, 2 * I, H, generator=gen) / 4, torch.randn(12, H, I, generator=gen) / 4
    table = SlotTable.empty(shape)
    pools = make_pools(shape, table, w13, w2)
    protected = np.zeros((f, 2), bool)
    prev = None
    cost = CostModel(window_ms=10.0)  # copies are cheap against the window: the scheduler uses them
    for seq in range(6):
        n = int(rng.integers(4, 40))
        ids, weights = random_routing(n, shape, rng, skew=2.0)
        hidden = torch.randn(n, H, generator=gen)
        demand = np.bincount(ids.reshape(-1).numpy(), minlength=12)
        plan, table_after = schedule(shape, demand, table, protected, prev, SchedulerParams(copy_budget=3), cost,
                                     Target(seq, 0, 0), seq)
        check_plan(shape, plan, table)
        apply_copies(pools, plan, w13, w2)
        out = sum(FFNLayer(p, backend="torch")(hidden, ids, weights, plan) for p in pools)
        assert relative_error(out, dense_moe(hidden, ids, weights, w13, w2)) <= 1e-5
        table, protected, prev = table_after, table_after.last_used == seq, plan.assignment


@settings(max_examples=40, deadline=None)
@given(e=st.integers(1, 9), k=st.integers(1, 4), n=st.integers(1, 40), h=st.integers(1, 40), i=st.integers(1, 24),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_native_sparse_step_equals_the_torch_step_at_odd_sizes(e, k, n, h, i, dtype, seed):
    """``afore._ffn`` at sizes its AVX2 loops do not divide (tails of 1-15 elements), in fp32 and
    bfloat16, on weights laid out as the slot pool's (slots strided in one storage), against the
    numpy/torch step on the same inputs: the same tokens, rows within fp32 rounding (1e-6) or one
    bfloat16 rounding (2^-8: the two may round a product on either side of a bfloat16 step)."""
    import afore.ffn.experts as experts
    from afore.ffn.device_plan import table_width

    if experts._HostStep is None:
        pytest.fail("afore._ffn is not built: reinstall afore (pip install -e .)")
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    slots = e + 2
    storage = torch.randn(slots, 3 * h * i + 5, generator=gen).to(dtype) / 4
    w13 = storage[:, :2 * i * h].view(slots, 2 * i, h)
    w2 = storage[:, 2 * i * h:3 * i * h].view(slots, h, i)
    ids = torch.from_numpy(rng.integers(-1, e + 1, (n, k)).astype(np.int32))  # -1 and e: bad ids
    weights = torch.rand(n, k, generator=gen)
    hidden = torch.randn(n, h, generator=gen).to(dtype)
    ep = table_width(e)
    table = np.zeros(3 * ep + 1, np.int32)
    table[:e] = rng.integers(0, 3, e)                   # lo
    table[ep:ep + e] = table[:e] + rng.integers(0, 4, e)  # hi
    table[2 * ep:2 * ep + e] = rng.integers(0, slots, e)
    native = experts.host_sparse_step(lambda t: hidden, ids.numpy(), weights, table, w13, w2, e)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts, "NATIVE_MAX_MACS", -1)
        ref = experts.host_sparse_step(lambda t: hidden, ids.numpy(), weights, table, w13, w2, e)
        # the same step on magnitudes bounds every sum's terms (silu(|g|) >= |silu(g)|): the scale
        # of the rounding errors, also where the outputs cancel to almost nothing
        magnitude = experts.host_sparse_step(lambda t: hidden.abs(), ids.numpy(), weights, table, w13.abs(), w2.abs(), e)
    assert torch.equal(native[0], ref[0]) and native[2] == ref[2]
    assert native[1].dtype == dtype and native[1].shape == ref[1].shape
    if ref[0].numel() and ref[1].float().norm() > 0:
        scale = float(magnitude[1].double().norm())
        # fp32: a dot product of h (then i) terms rounds by at most that many units of 2^-24 of
        # its magnitude; bfloat16: one rounding of the output (2^-8)
        tol = (h + i) * 2.0 ** -24 if dtype == torch.float32 else 2 ** -8
        assert float((native[1].double() - ref[1].double()).norm()) <= tol * scale


@settings(max_examples=60, deadline=None)
@given(shape=shapes, n=st.integers(0, 24), seed=st.integers(0, 2**31 - 1), fill=st.floats(0, 1),
       stale=st.booleans(), senders=st.integers(1, 3))
def test_host_routed_pair_rows_equal_the_device_routed_ones(shape, n, seed, fill, stale, senders):
    """``--exact`` fed by the shm transport (``forward_pairs_host``: eq. 11 on the host ids, only the
    tokens with a pair gathered, one copy in and out) returns exactly ``forward_pairs``'s pairs and
    rows, bit for bit, with a plan's copies, for one to three senders (each sender's tokens one
    kernel call), also for a plan made for other demand; every pair is computed by exactly one
    worker."""
    w13, w2, hidden, ids, weights, table, plan = routed_case(shape, n, seed, fill, 0, stale)
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, n + 1, senders - 1)) if senders > 1 else np.zeros(0, np.int64)
    splits = np.diff(np.concatenate([[0], cuts, [n]])).astype(int).tolist()
    pools = make_pools(shape, table, w13, w2)
    apply_copies(pools, plan, w13, w2)
    owners = []
    for pool in pools:
        device_layer, host_layer = FFNLayer(pool, backend="torch"), FFNLayer(pool, backend="torch")
        pairs, rows = device_layer.forward_pairs(lambda tokens: hidden, ids, weights, plan, splits)
        gathered = []

        def gather(tokens, out):
            gathered.append(tokens.clone())
            out.copy_(hidden[tokens])

        host_pairs, host_rows = host_layer.forward_pairs_host(gather, ids, weights, plan, splits)
        assert torch.equal(host_pairs, pairs)
        assert host_rows.dtype == rows.dtype and torch.equal(host_rows, rows)
        if pairs.numel():  # only the tokens with a pair here were read
            assert torch.equal(gathered[0], torch.unique(pairs // shape.top_k))
        owners.append(pairs)
    every = torch.cat(owners) if owners else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(torch.sort(every).values, torch.arange(n * shape.top_k))
