"""The FFN step on a GPU: CUDA-graph replay equals the eager step (bit for bit in fp32, and in
bf16 too, since both run the same deterministic kernels), plans change between replays without
a recapture (replica copies on the copy engine's side stream, committed by events), and the
step runs under ``torch.cuda.set_sync_debug_mode("error")``. Needs CUDA and Triton."""

import numpy as np
import pytest
import torch

from afore.config import ClusterShape, CostModel, SchedulerParams
from afore.ffn.experts import triton_available
from afore.ffn.layer import FFNLayer
from afore.ffn.reference import dense_moe, random_plan, random_routing, random_slot_table
from afore.migrator.slot_pool import SlotPool
from afore.plan import SlotTable, Target

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs a CUDA GPU")]

H, I = 256, 128
SHAPE = ClusterShape(num_experts=16, num_workers=4, redundant_slots=2, top_k=4, m_tile=16)


def _pools(dtype, table, w13, w2, plan=None):
    pools = []
    for w in range(SHAPE.num_workers):
        pool = SlotPool(SHAPE, w, H, I, dtype=dtype, device="cuda")
        pool.load_primaries(w13, w2)
        for r, ex in enumerate(table.expert[w]):
            if ex >= 0:
                pool.w13[pool.num_primaries + r] = w13[ex]
                pool.w2[pool.num_primaries + r] = w2[ex]
        if plan is not None:
            for ex, _, dst, s in plan.copies.tolist():
                if dst == w:
                    pool.w13[s], pool.w2[s] = w13[ex], w2[ex]
        pools.append(pool)
    return pools


def _weights(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(16, 2 * I, H, generator=gen) / H ** 0.5).to("cuda", dtype)
    w2 = (torch.randn(16, H, I, generator=gen) / I ** 0.5).to("cuda", dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_graph_replay_equals_eager_for_random_plans(dtype, seed):
    rng = np.random.default_rng(seed)
    w13, w2 = _weights(seed, dtype)
    for n in (1, 5, 13, 64, 100):
        ids, weights = random_routing(n, SHAPE, rng, skew=1.5)
        demand = np.bincount(ids.reshape(-1).numpy(), minlength=16)
        table = random_slot_table(SHAPE, rng, 1.0)
        plan, _ = random_plan(SHAPE, demand, table, rng, Target(0, 0, 0), 1, new_copies=2)
        pools = _pools(dtype, table, w13, w2, plan)
        x = torch.randn(n, H, device="cuda").to(dtype)
        ids, weights = ids.cuda(), weights.cuda()
        graphed = [FFNLayer(p, graphs=True, tune=False) for p in pools]
        eager = [FFNLayer(p, graphs=False) for p in pools]
        out_g = [layer(x, ids, weights, plan) for layer in graphed]
        out_e = [layer(x, ids, weights, plan) for layer in eager]
        for a, b in zip(out_g, out_e):
            assert torch.equal(a, b), (n, float((a.float() - b.float()).abs().max()))
        assert all(layer.graphs.replays == 1 for layer in graphed)
        ref = dense_moe(x.double().cpu(), ids.cpu(), weights.cpu(), w13.double().cpu(), w2.double().cpu())
        total = sum(o.double().cpu() for o in out_g)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((total - ref).norm() / ref.norm()) <= tol


def test_changed_plans_replay_the_same_graph_with_copies_on_the_side_stream():
    from afore.migrator.copy_engine import CudaCopyEngine
    from afore.migrator.migrator import Migrator, PoolSource
    from afore.scheduler.algorithm import schedule

    rng = np.random.default_rng(7)
    w13, w2 = _weights(7, torch.float32)
    table = SlotTable.empty(SHAPE)
    pools = _pools(torch.float32, table, w13, w2)
    source = PoolSource(SHAPE, {(0, w): p for w, p in enumerate(pools)})
    migrators = [Migrator(SHAPE, w, {0: p}, CudaCopyEngine(torch.device("cuda", torch.cuda.current_device()), max_gbps=None), source) for w, p in enumerate(pools)]
    layers = [FFNLayer(p, tune=False) for p in pools]
    protected = np.zeros((SHAPE.num_workers, SHAPE.redundant_slots), bool)
    prev, copies = None, 0
    for seq in range(12):
        n = int(rng.integers(20, 60))
        ids, weights = random_routing(n, SHAPE, rng, skew=2.0)
        demand = np.bincount(ids.reshape(-1).numpy(), minlength=16)
        plan, table_after = schedule(SHAPE, demand, table, protected, prev, SchedulerParams(copy_budget=3),
                                     CostModel(window_ms=10.0), Target(seq, 0, 0), seq)
        copies += len(plan.copies)
        x = torch.randn(n, H, device="cuda")
        ids, weights = ids.cuda(), weights.cuda()
        outs = []
        for m, layer in zip(migrators, layers):
            assert m.prepare(plan, expected_seq=seq)
            layer.stage_plan(plan)
            m.commit(plan)
            outs.append(layer(x, ids, weights, plan))
            m.release(plan)
        ref = dense_moe(x.double().cpu(), ids.cpu(), weights.cpu(), w13.double().cpu(), w2.double().cpu())
        assert float((sum(o.double().cpu() for o in outs) - ref).norm() / ref.norm()) <= 1e-5
        table, protected, prev = table_after, table_after.last_used == seq, plan.assignment
    assert copies > 0
    assert all(len(layer.graphs.graphs) <= 2 for layer in layers)  # buckets 32 and 64 only: no recapture per plan
    for m in migrators:
        m.close()


def test_step_makes_no_host_sync():
    rng = np.random.default_rng(3)
    w13, w2 = _weights(3, torch.bfloat16)
    ids, weights = random_routing(48, SHAPE, rng)
    demand = np.bincount(ids.reshape(-1).numpy(), minlength=16)
    table = random_slot_table(SHAPE, rng, 1.0)
    plans = [random_plan(SHAPE, demand, table, rng, Target(0, 0, 0), s, new_copies=0)[0] for s in range(3)]
    pools = _pools(torch.bfloat16, table, w13, w2)
    layer = FFNLayer(pools[1], tune=False)
    big = FFNLayer(pools[1], graphs=False)
    x, ids, weights = torch.randn(48, H, device="cuda").bfloat16(), ids.cuda(), weights.cuda()
    for plan in plans:
        layer.stage_plan(plan)
        big.stage_plan(plan)
    layer.capture_graphs((64,))     # start-up: captures the bucket of 48 tokens (synchronises once)
    big(x, ids, weights, plans[0])  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for plan in plans:
            layer(x, ids, weights, plan)
            big(x, ids, weights, plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert list(layer.graphs.graphs) == [64] and layer.graphs.replays == 3
    assert layer.input_errors() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_routed_step_sums_to_the_dense_layer(dtype):
    """The shm transport's GPU path (``forward_host_routed``: routed on the host, only the
    worker's tokens on the device under a local table, one sync): every worker's tokens are
    those it has a pair of, its rows equal the device step's rows of them (the same kernels:
    fp32 within 1e-6 of their magnitude, bf16 within its rounding), and the sum over workers is
    the dense layer."""
    rng = np.random.default_rng(7)
    w13, w2 = _weights(7, dtype)
    for n in (1, 5, 13, 64, 100, 700):
        ids, weights = random_routing(n, SHAPE, rng, skew=1.5)
        ids = ids.to(torch.int32)
        demand = np.bincount(ids.reshape(-1).numpy(), minlength=16)
        table = random_slot_table(SHAPE, rng, 1.0)
        plan, _ = random_plan(SHAPE, demand, table, rng, Target(0, 0, 0), 1, new_copies=2)
        pools = _pools(dtype, table, w13, w2, plan)
        x = torch.randn(n, H).to(dtype)
        total = torch.zeros(n, H, dtype=torch.float64)
        for w, pool in enumerate(pools):
            layer = FFNLayer(pool, tune=False)
            full = layer.forward(x.cuda(), ids.cuda(), weights.cuda(), plan, w).cpu()
            tokens, rows = layer.forward_host_routed(lambda t, out: out.copy_(x[t]), ids, weights, plan)
            assert rows.device.type == "cpu" and rows.dtype == dtype
            rows = rows.clone()  # the pinned output buffer is reused by the next step
            # the shm transport's direct path: every row copied to the device, gathered there, the
            # output left on the device: the same kernels on the same values, so the same bits
            x_dev = x.cuda()
            tokens_d, rows_d = layer.forward_host_routed(None, ids, weights, plan, rows=lambda dst: dst.copy_(x_dev),
                                                         device_out=True)
            assert rows_d.device.type == "cuda" and torch.equal(tokens_d, tokens)
            assert torch.equal(rows_d.cpu().view(torch.uint8) if dtype == torch.bfloat16 else rows_d.cpu(),
                               rows.view(torch.uint8) if dtype == torch.bfloat16 else rows), n
            if tokens.numel() == 0:  # this worker has no pair of the target
                assert rows.shape == (0, H) and not full.any()
                continue
            scale = full.abs().max().item() + 1e-30
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            assert (rows.float() - full[tokens].float()).abs().max().item() <= tol * scale
            others = torch.ones(n, dtype=torch.bool)
            others[tokens] = False
            assert not full[others].any()  # no pair of this worker on a token left out
            total[tokens] += rows.double()
        ref = dense_moe(x.double(), ids, weights, w13.double().cpu(), w2.double().cpu())
        err = float((total - ref).norm() / ref.norm())
        assert err <= (1e-5 if dtype == torch.float32 else 2e-2), (n, err)


def test_start_up_tunes_every_launched_step_size_so_no_target_times_kernels():
    """``tune_large_steps`` (called by the FFN worker at start-up up to the tokens a target can
    hold) times the launched step's configs for each power of two above the graph buckets; a
    later host-routed step of any such size then finds its config and times nothing."""
    from afore.ffn import graphs as graphs_mod

    rng = np.random.default_rng(3)
    w13, w2 = _weights(3, torch.bfloat16)
    table = random_slot_table(SHAPE, rng, 1.0)
    pool = _pools(torch.bfloat16, table, w13, w2)[0]
    layer = FFNLayer(pool, graph_buckets=(8, 16), tune=True)
    layer.capture_graphs()               # start-up, as the worker does: the buckets' graphs
    layer.capture_graphs(host_fed=True)
    before = dict(graphs_mod._CONFIGS)
    assert layer.tune_large_steps(16) == []  # every size fits a bucket
    assert layer.tune_large_steps(100) == [32, 64, 128]
    tuned = dict(graphs_mod._CONFIGS)
    assert len(set(tuned) - set(before)) == 3
    for n in (17, 40, 100):
        ids, weights = random_routing(n, SHAPE, rng, skew=1.5)
        demand = np.bincount(ids.reshape(-1).numpy(), minlength=16)
        plan, _ = random_plan(SHAPE, demand, table, rng, Target(0, 0, 0), 1, new_copies=0)
        x = torch.randn(n, H).to(torch.bfloat16)
        tokens, rows = layer.forward_host_routed(lambda t, out: out.copy_(x[t]), ids.to(torch.int32), weights, plan)
        assert rows.shape == (tokens.numel(), H)
    assert graphs_mod._CONFIGS == tuned  # nothing was timed on the serving path
