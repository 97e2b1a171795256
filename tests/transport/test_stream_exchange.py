"""The stream exchange (afore.attention.stream, afore._shm.StreamExchange) against the host path.

On CPU tensors the host node runs at once on the calling thread: the same C++ that a CUDA host node
runs. FFN ends answer on threads of this process. The stream exchange numbers targets as the host
path does (step from MoE layer position 0, seq = step * L + layer, one message counter), writes the
same messages and returns the same outputs bit for bit, with partial sums and with pair rows
(``--exact``); its demand lands in the scheduler's mailbox; a failure on a node is kept, the node
and every later one output zeros at once, and the next call raises it with its target.
"""

import os
import threading
import time

import numpy as np
import pytest
import torch

from afore.attention.stream import ExchangeFailed, StreamExchange
from afore.config import ClusterShape
from afore.plan import Target
from afore.prefetch.mailbox import DemandMailbox
from afore.routing import count_host
from afore.transport.base import ReplyRows
from afore.transport.shm import ShmAttentionEnd, ShmFFNEnd, ShmLayout, ShmSegment

H, K, E, L = 24, 2, 8, 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _name(tag: str) -> str:
    return f"afore-test-stream-{tag}-{os.getpid()}"


def _reply(mb, rank: int, layout: ShmLayout) -> ReplyRows:
    """FFN worker ``rank`` owns gathered tokens (pairs when exact) t with t % F == rank."""
    n, f = mb.num_tokens, layout.num_ffn
    if layout.exact:
        pairs = torch.arange(n * layout.top_k)
        pairs = pairs[pairs % f == rank]
        hidden = mb.rows_for(torch.unique(pairs // layout.top_k))
        return ReplyRows(pairs, hidden.index_select(0, pairs // layout.top_k) * (1.5 + rank))
    tokens = torch.arange(n)
    tokens = tokens[tokens % f == rank]
    return ReplyRows(tokens, mb.rows_for(tokens).index_select(0, tokens) * (1.5 + rank))


class _Pool:
    """A segment, its F FFN ends answering on threads (``targets`` of them each), and the A
    attention ends, all in this process."""

    def __init__(self, tag: str, layout: ShmLayout, targets: int, **kw) -> None:
        self.layout = layout
        self.seg = ShmSegment.create(_name(tag), layout)
        for f in range(layout.num_ffn):
            self.seg.pids[layout.num_attention + f] = os.getpid()
        self.atts = [ShmAttentionEnd(self.seg.name, layout, r, timeout_s=5, **kw) for r in range(layout.num_attention)]
        self.ffns = [ShmFFNEnd(self.seg.name, layout, r, timeout_s=5) for r in range(layout.num_ffn)]
        self.seen: list[list] = [[] for _ in self.ffns]
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._serve, args=(r, targets), daemon=True) for r in range(layout.num_ffn)]
        for t in self.threads:
            t.start()

    def _serve(self, rank: int, targets: int) -> None:
        try:
            for _ in range(targets):
                mb = self.ffns[rank].recv(5.0)
                assert mb is not None
                self.seen[rank].append((mb.target, mb.seq, list(mb.splits), mb.topk_ids.clone(), mb.topk_weights.clone()))
                self.ffns[rank].send(mb, _reply(mb, rank, self.layout))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def join(self) -> None:
        for t in self.threads:
            t.join(10)
        assert not self.errors, self.errors

    def raw(self) -> np.ndarray:
        return np.frombuffer(self.seg.mm, dtype=np.uint8).copy()

    def close(self) -> None:
        for e in self.atts + self.ffns:
            e.close()
        self.seg.close()


def _inputs(steps: int, num_attention: int, dtype: torch.dtype, seed: int):
    """Per (step, layer, attention worker): hidden [n, H], ids [n, K] (int64 on odd steps), fp32 weights."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for s in range(steps):
        for layer in range(L):
            for a in range(num_attention):
                n = int(torch.randint(0, 7, (1,), generator=gen))
                ids = torch.randint(0, E, (n, K), generator=gen, dtype=torch.int64 if s % 2 else torch.int32)
                out[(s, layer, a)] = ((torch.randn(n, H, generator=gen) * 3).to(dtype), ids, torch.rand(n, K, generator=gen))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _run_attention(fn, num_attention: int) -> list:
    """``fn(a)`` for every attention worker on its own thread (the FFN side waits for all A)."""
    results, errors = [None] * num_attention, []

    def body(a):
        try:
            results[a] = fn(a)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(a,)) for a in range(num_attention)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("num_attention,num_ffn", [(1, 1), (1, 2), (2, 3)])
def test_stream_exchange_writes_and_returns_what_the_host_path_does(dtype, exact, num_attention, num_ffn):
    steps = 3
    layout = ShmLayout(num_attention=num_attention, num_ffn=num_ffn, hidden=H, top_k=K, max_tokens=8, depth=2,
                       dtype=dtype, exact=exact)
    data = _inputs(steps, num_attention, DTYPES[dtype], seed=3)
    tag = f"{dtype}{int(exact)}{num_attention}{num_ffn}"
    host, stream = _Pool(tag + "h", layout, steps * L), _Pool(tag + "s", layout, steps * L)
    try:
        def host_path(a):
            att, outs = host.atts[a], []
            for s in range(steps):
                for layer in range(L):
                    x, ids, w = data[(s, layer, a)]
                    outs.append(att.recv(att.send(Target(s, layer, 0), s * L + layer, x, ids, w)))
            return outs

        def stream_path(a):
            ex, outs = StreamExchange(stream.atts[a], L), []
            for s in range(steps):
                for layer in range(L):
                    x, ids, w = data[(s, layer, a)]
                    out = torch.full_like(x, float("nan"))
                    ex.forward(layer, x, w, ids, out)
                    outs.append(out)
            assert ex.stats()["calls"] == steps * L and ex.stats()["step"] == steps - 1
            assert ex.stats()["counter"] == steps * L
            rows = []
            assert ex.drain(type("Clock", (), {"record": lambda self, row: rows.append(row)})()) == steps * L
            return outs, rows

        want = _run_attention(host_path, num_attention)
        got = _run_attention(stream_path, num_attention)
        host.join()
        stream.join()
        for a in range(num_attention):
            got[a], rows = got[a]
            # the stage clock's rows, in the host path's columns: every call in order, its stamps in
            # order, each call's previous exit the last call's end, the host path's byte counts
            assert [r[12] for r in rows] == list(range(steps * L))
            assert [(r[0], r[1], r[2]) for r in rows] == [(s, layer, 0) for s in range(steps) for layer in range(L)]
            assert rows[0][4] == 0 and all(rows[i + 1][4] == rows[i][9] for i in range(len(rows) - 1))
            assert all(r[5] <= r[7] <= r[6] == r[8] <= r[9] for r in rows)
            assert sum(r[10] for r in rows) == host.atts[a].bytes_sent
            assert sum(r[11] for r in rows) == host.atts[a].bytes_received
            for g, w in zip(got[a], want[a]):
                assert g.dtype == w.dtype and g.shape == w.shape
                assert torch.equal(_bits(g), _bits(w))
        for f in range(num_ffn):  # the same targets, seqs, splits and routing reached every FFN worker
            for (tg, sg, spg, ig, wg), (tw, sw, spw, iw, ww) in zip(stream.seen[f], host.seen[f]):
                assert (tg, sg, spg) == (tw, sw, spw)
                assert torch.equal(ig, iw) and torch.equal(wg, ww)
        assert [t for t, *_ in stream.seen[0]] == [Target(s, layer, 0) for s in range(steps) for layer in range(L)]
        assert np.array_equal(stream.raw(), host.raw()), "the two paths left different bytes in the segment"
    finally:
        host.close()
        stream.close()


def test_stream_exchange_puts_each_targets_demand_into_the_mailbox():
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=8, depth=2)
    shape = ClusterShape(num_experts=E, num_workers=2, num_layers=L, redundant_slots=1, top_k=K, m_tile=4)
    data = _inputs(2, 1, torch.float32, seed=5)
    pool = _Pool("demand", layout, 2 * L)
    try:
        with DemandMailbox.create(_name("mb"), shape, num_producers=1, num_microbatches=1) as mailbox:
            ex = StreamExchange(pool.atts[0], L, mailbox.name, E)
            for s in range(2):
                for layer in range(L):
                    x, ids, w = data[(s, layer, 0)]
                    ex.forward(layer, x, w, ids, torch.empty_like(x))
            pool.join()
            got = [mailbox.wait_complete(1.0) for _ in range(2 * L)]
            assert ex.stats()["demand_emitted"] == 2 * L and ex.stats()["demand_lost"] == 0
            for s in range(2):
                for layer in range(L):
                    d = got[s * L + layer]
                    assert d.target == Target(s, layer, 0) and d.seq == s * L + layer
                    assert d.demand.tolist() == count_host(data[(s, layer, 0)][1].numpy(), E).tolist()
    finally:
        pool.close()


def test_a_failed_node_is_kept_later_nodes_output_zeros_and_the_next_call_raises_it():
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    seg = ShmSegment.create(_name("dead"), layout)
    try:
        seg.pids[1] = os.getpid()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        seg.pids[2] = pid  # FFN worker 1 is gone
        att = ShmAttentionEnd(seg.name, layout, 0, timeout_s=5, poll_s=0.02)
        ffn0 = ShmFFNEnd(seg.name, layout, 0, timeout_s=5)
        ex = StreamExchange(att, L)
        x, ids, w = torch.ones(2, H), torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K)

        def answer():
            mb = ffn0.recv(5.0)
            ffn0.send(mb, ReplyRows(torch.arange(2), torch.ones(2, H)))

        t = threading.Thread(target=answer)
        t.start()
        out = torch.full((2, H), float("nan"))
        t0 = time.monotonic()
        ex.native.run(0, 2)  # what the host node runs: it must not raise
        assert time.monotonic() - t0 < 3.0  # the dead peer ends the wait, not the 5 s timeout
        t.join(5)
        err = ex.native.error()
        assert err is not None and f"the peer process {pid} exited" in err and "Target(step=0, layer=0, microbatch=0)" in err
        assert torch.equal(ex.out[:2], torch.zeros(2, H))
        ex.out.fill_(7.0)
        t0 = time.monotonic()
        ex.native.run(1, 2)  # a later node: zeros at once, nothing posted
        assert time.monotonic() - t0 < 0.5
        assert torch.equal(ex.out[:2], torch.zeros(2, H))
        assert ex.stats()["calls"] == 0 and ex.stats()["counter"] == 2
        with pytest.raises(ExchangeFailed, match="peer process"):
            ex.forward(2, x, w, ids, out)
        assert torch.isnan(out).all()  # raised before anything was written
        with pytest.raises(ExchangeFailed):
            ex.check()
        att.close()
        ffn0.close()
    finally:
        seg.close()


def test_bad_calls_are_refused_before_anything_is_enqueued():
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    pool = _Pool("bad", layout, 1)
    try:
        ex = StreamExchange(pool.atts[0], L)
        x, ids, w = torch.ones(5, H), torch.zeros(5, K, dtype=torch.int32), torch.ones(5, K)
        with pytest.raises(ValueError, match="at most max_tokens=4"):
            ex.forward(0, x, w, ids, torch.empty_like(x))
        with pytest.raises(ValueError, match=r"expected shape \[n, 24\]"):
            ex.forward(0, torch.ones(2, H + 1), w[:2], ids[:2], torch.empty(2, H + 1))
        with pytest.raises(ValueError, match=r"topk_ids, topk_weights: expected shape \[2, 2\]"):
            ex.forward(0, x[:2], w[:2, :1], ids[:2], torch.empty(2, H))
        with pytest.raises(ValueError, match=r"layer: expected in \[0, 3\)"):
            ex.native.call(3, 1)
        assert ex.stats()["counter"] == 0  # nothing was posted
        out = torch.empty(2, H)
        ex.forward(0, x[:2], w[:2], ids[:2], out)  # the pool still answers: nothing was lost
        pool.join()
        assert torch.equal(out, x[:2] * 1.5)
    finally:
        pool.close()


def test_a_first_call_that_is_not_layer_zero_fails_the_exchange():
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    pool = _Pool("first", layout, 0)
    try:
        ex = StreamExchange(pool.atts[0], L)
        ex.native.run(1, 1)
        assert "the first call was not MoE layer position 0" in ex.native.error()
    finally:
        pool.join()
        pool.close()


# ---------------------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/device/ffn_e2e_cuda.sh)")


def _host_reference(layout: ShmLayout, steps: int, data) -> list[torch.Tensor]:
    """What the host path returns for ``data`` (one attention worker), on CPU."""
    pool = _Pool("ref", layout, steps * L)
    try:
        att, outs = pool.atts[0], []
        for s in range(steps):
            for layer in range(L):
                x, ids, w = data[(s, layer, 0)]
                outs.append(att.recv(att.send(Target(s, layer, 0), s * L + layer, x, ids, w)))
        pool.join()
        return outs
    finally:
        pool.close()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("exact", [False, True])
def test_cuda_host_nodes_eager_and_captured_in_a_graph_return_the_host_paths_bits(dtype, exact):
    """Enqueued on a CUDA stream (eager), then one step of L layer calls captured in a CUDA graph
    and replayed with new inputs: every output equals the host path's on the same inputs, the
    targets reach the FFN side numbered as the host path numbers them, and the calling thread
    never waits for the FFN side while it enqueues."""
    dev = torch.device("cuda")
    tdtype = DTYPES[dtype]
    n, steps_eager, replays = 5, 2, 3
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=8, depth=2, dtype=dtype, exact=exact)
    gen = torch.Generator().manual_seed(11)
    steps = steps_eager + 1 + replays  # eager steps, the warm-up step before capture, the replays
    data = {(s, layer, 0): ((torch.randn(n, H, generator=gen) * 3).to(tdtype), torch.randint(0, E, (n, K), generator=gen),
                            torch.rand(n, K, generator=gen)) for s in range(steps) for layer in range(L)}
    want = _host_reference(layout, steps, data)
    pool = _Pool("cuda", layout, steps * L, device=dev)
    try:
        ex = StreamExchange(pool.atts[0], L)
        got = []
        for s in range(steps_eager):  # eager: enqueue a whole step, then wait once
            outs = []
            t0 = time.monotonic()
            for layer in range(L):
                x, ids, w = (t.to(dev) for t in data[(s, layer, 0)])
                out = torch.empty(n, H, dtype=tdtype, device=dev)
                ex.forward(layer, x, w, ids, out)
                outs.append(out)
            enqueue_s = time.monotonic() - t0
            torch.cuda.synchronize()
            got += [o.cpu() for o in outs]
        assert enqueue_s < 5.0
        # static inputs and one captured step
        xs = [torch.empty(n, H, dtype=tdtype, device=dev) for _ in range(L)]
        idss = [torch.empty(n, K, dtype=torch.int64, device=dev) for _ in range(L)]
        ws = [torch.empty(n, K, dtype=torch.float32, device=dev) for _ in range(L)]
        outs = [torch.empty(n, H, dtype=tdtype, device=dev) for _ in range(L)]

        def load(s):
            for layer in range(L):
                x, ids, w = data[(s, layer, 0)]
                xs[layer].copy_(x)
                idss[layer].copy_(ids)
                ws[layer].copy_(w)

        def step():
            for layer in range(L):
                ex.forward(layer, xs[layer], ws[layer], idss[layer], outs[layer])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up step (real exchanges), as torch.cuda.graph wants
            load(steps_eager)
            step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        got += [o.cpu() for o in outs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()  # recorded, not run: no target reaches the FFN side
        assert ex.stats()["counter"] == (steps_eager + 1) * L
        for r in range(replays):
            load(steps_eager + 1 + r)
            graph.replay()
            torch.cuda.synchronize()
            got += [o.cpu() for o in outs]
        pool.join()
        ex.check()
        assert ex.stats()["counter"] == steps * L and ex.stats()["step"] == steps - 1
        assert [t for t, *_ in pool.seen[0]] == [Target(s, layer, 0) for s in range(steps) for layer in range(L)]
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(_bits(g), _bits(w))
    finally:
        pool.close()


def test_a_call_on_the_calling_thread_raises_its_own_failure():
    """On a CPU tensor the node runs inside ``forward``: its failure is raised by that call."""
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    seg = ShmSegment.create(_name("own"), layout)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        seg.pids[1] = pid  # the only FFN worker is gone
        att = ShmAttentionEnd(seg.name, layout, 0, timeout_s=5, poll_s=0.02)
        ex = StreamExchange(att, L)
        with pytest.raises(ExchangeFailed, match=f"the peer process {pid} exited"):
            ex.forward(0, torch.ones(1, H), torch.ones(1, K), torch.zeros(1, K, dtype=torch.int32), torch.empty(1, H))
        att.close()
    finally:
        seg.close()
