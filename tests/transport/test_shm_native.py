"""The shm transport's C++ hot path (afore._shm.DataPlane) against its Python reference path.

Both ends run in this process, one step after another (every wait is already satisfied), so the
two paths can be held to the same bytes: the same segment contents after every target, the same
Microbatch, the same gathered rows, the same attention output bit for bit, for every dtype and
both reply layouts; a C++ end talks to a Python end over one segment. Then the errors: torn
headers, out-of-range indices, bad partials, timeouts, dead peers, the agree barrier.
"""

import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from afore.plan import Target
from afore.transport.base import ReplyRows
from afore.transport.shm import PeerGone, ShmAttentionEnd, ShmFFNEnd, ShmLayout, ShmSegment, _futex_wake

H, K = 24, 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _name(tag: str) -> str:
    return f"afore-test-shm-native-{tag}-{os.getpid()}"


class _Pair:
    """A segment with every end of one layout in this process (``native`` per side)."""

    def __init__(self, tag: str, layout: ShmLayout, native_attention: bool, native_ffn: bool, **kw) -> None:
        self.layout = layout
        self.seg = ShmSegment.create(_name(tag), layout)
        a = layout.num_attention
        for f in range(layout.num_ffn):
            self.seg.pids[a + f] = os.getpid()
        self.atts = [ShmAttentionEnd(self.seg.name, layout, r, timeout_s=5, native=native_attention, **kw) for r in range(a)]
        self.ffns = [ShmFFNEnd(self.seg.name, layout, r, timeout_s=5, native=native_ffn, **kw) for r in range(layout.num_ffn)]

    def close(self) -> None:
        for e in self.atts + self.ffns:
            e.close()
        self.seg.close()

    def raw(self) -> np.ndarray:
        return np.frombuffer(self.seg.mm, dtype=np.uint8).copy()


def _special(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows with the values conversions get wrong: signed zeros, infinities, NaN, subnormals."""
    x = (torch.randn(n, H, generator=gen) * 3).to(dtype)
    if n:
        flat = x.view(-1)
        tiny = torch.finfo(dtype).tiny
        specials = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan"), tiny / 4, -tiny / 8, 65504.0 if dtype == torch.float16 else 1e30])
        m = min(flat.numel(), specials.numel())
        flat[:m] = specials[:m].to(dtype)
    return x


def _reply(mb, rank: int, layout: ShmLayout) -> ReplyRows:
    """FFN worker ``rank`` owns gathered tokens (pairs when exact) t with t % F == rank and
    replies a fixed function of their rows."""
    n, f = mb.num_tokens, layout.num_ffn
    if layout.exact:
        pairs = torch.arange(n * layout.top_k)
        pairs = pairs[pairs % f == rank]
        hidden = mb.rows_for(torch.unique(pairs // layout.top_k))
        rows = hidden.index_select(0, pairs // layout.top_k) * (1.5 + rank)
        return ReplyRows(pairs, rows)
    tokens = torch.arange(n)
    tokens = tokens[tokens % f == rank]
    return ReplyRows(tokens, mb.rows_for(tokens).index_select(0, tokens) * (1.5 + rank))


def _target(pair: _Pair, t: int, xs, ids, ws, collect: dict) -> list[torch.Tensor]:
    sent = [att.send(Target(t, t % 3, t % 2), t, xs[a], ids[a], ws[a]) for a, att in enumerate(pair.atts)]
    for r, ffn in enumerate(pair.ffns):
        mb = ffn.recv(5.0)
        assert mb is not None
        tokens = torch.arange(mb.num_tokens)[::2].contiguous()
        collect.setdefault("mb", []).append((mb.target, mb.seq, list(mb.splits), mb.topk_ids.clone(), mb.topk_weights.clone(),
                                             mb.dense_hidden().clone(), mb.source.gather(tokens).clone()))
        ffn.send(mb, _reply(mb, r, pair.layout))
    return [att.recv(s) for att, s in zip(pair.atts, sent)]


def _inputs(sizes, gen: torch.Generator):
    """bfloat16 rows (with the special values), int32 ids and fp32 weights per sender."""
    return ([_special(n, torch.bfloat16, gen) for n in sizes],
            [torch.randint(0, 8, (n, K), generator=gen, dtype=torch.int32) for n in sizes],
            [torch.rand(n, K, generator=gen) for n in sizes])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("num_attention,num_ffn", [(1, 1), (1, 2), (2, 3)])
def test_cpp_and_python_paths_write_and_return_the_same_bits(dtype, exact, num_attention, num_ffn):
    layout = ShmLayout(num_attention=num_attention, num_ffn=num_ffn, hidden=H, top_k=K, max_tokens=9, depth=2,
                       dtype=dtype, exact=exact)
    tag = f"{dtype}{int(exact)}{num_attention}{num_ffn}"
    native, ref = _Pair(tag + "c", layout, True, True), _Pair(tag + "p", layout, False, False)
    gen = torch.Generator().manual_seed(7)
    try:
        for t in range(7):
            sizes = [int(torch.randint(0, 10, (1,), generator=gen)) for _ in range(num_attention)]
            # ids as int64 and a transposed (non-contiguous) hidden: both paths convert them the same way
            xs = [_special(n, DTYPES[dtype], gen) for n in sizes]
            if t % 2:
                xs = [x.t().contiguous().t() for x in xs]
            ids = [torch.randint(0, 8, (n, K), generator=gen, dtype=torch.int64 if t % 2 else torch.int32) for n in sizes]
            ws = [torch.rand(n, K, generator=gen, dtype=torch.float64 if t % 3 == 0 else torch.float32) for n in sizes]
            got, want = {}, {}
            out = _target(native, t, xs, ids, ws, got)
            ref_out = _target(ref, t, xs, ids, ws, want)
            for o, r in zip(out, ref_out):
                assert o.dtype == r.dtype and o.shape == r.shape
                assert torch.equal(_bits(o), _bits(r))
            for g, w in zip(got["mb"], want["mb"]):
                assert g[:3] == w[:3]
                for a, b in zip(g[3:], w[3:]):
                    assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
            assert np.array_equal(native.raw(), ref.raw()), "the two paths left different bytes in the segment"
        for a, b in zip(native.atts + native.ffns, ref.atts + ref.ffns):
            assert (a.bytes_sent, a.bytes_received) == (b.bytes_sent, b.bytes_received)
    finally:
        native.close()
        ref.close()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("num_attention,num_ffn", [(1, 2), (3, 2)])
def test_replies_written_in_place_leave_the_bytes_of_a_staged_send(native, num_attention, num_ffn):
    """``ShmFFNEnd._send_in_place`` (a GPU worker's send of device rows: each attention worker's
    share copied straight into its reply slot, then only token indices and headers written) and
    ``copy_to`` (every row of the target into one tensor, one copy per sender) run here on host
    tensors: the segment holds the same bytes as after ``send``, the attention side the same
    output bits, and ``copy_to`` gives the target's rows in sender order; bad partials are
    refused before anything is published."""
    layout = ShmLayout(num_attention=num_attention, num_ffn=num_ffn, hidden=H, top_k=K, max_tokens=9, depth=2,
                       dtype="bfloat16")
    tag = f"inplace{int(native)}{num_attention}{num_ffn}"
    staged, direct = _Pair(tag + "s", layout, native, native), _Pair(tag + "d", layout, native, native)
    gen = torch.Generator().manual_seed(11)
    try:
        for t in range(5):
            xs, ids, ws = _inputs([int(torch.randint(0, 10, (1,), generator=gen)) for _ in range(num_attention)], gen)
            outs = []
            for pair, in_place in ((staged, False), (direct, True)):
                sent = [att.send(Target(t, 0, t % 2), t, xs[a], ids[a], ws[a]) for a, att in enumerate(pair.atts)]
                for r, ffn in enumerate(pair.ffns):
                    mb = ffn.recv(5.0)
                    rows = torch.empty(mb.num_tokens, H, dtype=torch.bfloat16)
                    mb.source.copy_to(rows)
                    assert torch.equal(_bits(rows), _bits(torch.cat(xs))) and not mb.source.device_copies
                    reply = _reply(mb, r, layout)
                    if in_place:
                        ffn._send_in_place(mb, reply.tokens, reply.rows)
                    else:
                        ffn.send(mb, reply)
                outs.append([att.recv(s) for att, s in zip(pair.atts, sent)])
            for o, r in zip(*outs):
                assert torch.equal(_bits(o), _bits(r))
            assert np.array_equal(staged.raw(), direct.raw()), "in-place replies left other bytes in the segment"
        for a, b in zip(staged.ffns, direct.ffns):
            assert a.bytes_sent == b.bytes_sent
        ffn = direct.ffns[0]
        for att in direct.atts:
            att.send(Target(9, 0, 0), 9, torch.ones(2, H), torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K))
        mb = ffn.recv(5.0)
        before = direct.raw()
        for tokens, match in ((torch.tensor([1, 0]), "ascending"), (torch.tensor([0, 2 * num_attention]), "ascending"),
                              (torch.tensor([-1]), "ascending")):
            with pytest.raises(ValueError, match=match):
                ffn._send_in_place(mb, tokens, torch.ones(tokens.numel(), H, dtype=torch.bfloat16))
        assert np.array_equal(before, direct.raw()), "a refused partial wrote to the segment"
        with pytest.raises(ValueError, match=rf"dst: expected \[{2 * num_attention}, {H}\]"):
            mb.source.copy_to(torch.empty(3, H, dtype=torch.bfloat16))
    finally:
        staged.close()
        direct.close()


@pytest.mark.parametrize("native_attention", [True, False])
def test_a_cpp_end_talks_to_a_python_end(native_attention):
    layout = ShmLayout(num_attention=2, num_ffn=2, hidden=H, top_k=K, max_tokens=6, depth=3, dtype="bfloat16")
    pair = _Pair(f"mixed{int(native_attention)}", layout, native_attention, not native_attention)
    gen = torch.Generator().manual_seed(1)
    try:
        for t in range(5):
            sizes = [int(torch.randint(0, 7, (1,), generator=gen)) for _ in range(2)]
            xs = [torch.randn(n, H, generator=gen).bfloat16() for n in sizes]
            out = _target(pair, t, xs, [torch.zeros(n, K, dtype=torch.int32) for n in sizes], [torch.ones(n, K) for n in sizes], {})
            for a, x in enumerate(xs):
                g = torch.arange(x.shape[0]) + sum(sizes[:a])
                want = (x.float() * (1.5 + (g % 2)).unsqueeze(1).bfloat16().float()).bfloat16()
                assert torch.equal(out[a], want)
    finally:
        pair.close()


def test_torn_or_stale_headers_are_rejected_by_the_cpp_path():
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair("torn", layout, True, True)
    att, ffn, seg = pair.atts[0], pair.ffns[0], pair.seg
    try:
        x = torch.ones(2, H)
        sent = att.send(Target(0, 0, 0), 0, x, torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K))
        seg.req_head[0, 0, 6] = 7
        with pytest.raises(ValueError, match=r"request from attention worker 0: expected message 0, got header \[0, 0, 0, 0, 0, 2, 7, 0\] \(torn or stale slot\)"):
            ffn.recv(1.0)
        seg.req_head[0, 0, 6] = 0
        mb = ffn.recv(1.0)
        ffn.send(mb, ReplyRows(torch.arange(2), x))
        seg.rep_head[0, 0, 0, 2] = 5  # the reply claims another target
        with pytest.raises(ValueError, match=r"reply from FFN worker 0: expected seq 0 Target\(step=0, layer=0, microbatch=0\) "
                                             r"\(message 0\), got header .* \(torn or stale slot\)"):
            att.recv(sent)
    finally:
        pair.close()


def test_out_of_range_indices_and_bad_partials_are_refused():
    layout = ShmLayout(num_attention=2, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair("range", layout, True, True)
    seg, ffn = pair.seg, pair.ffns[0]
    try:
        sent = [att.send(Target(0, 0, 0), 0, torch.ones(2, H), torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K))
                for att in pair.atts]
        mb = ffn.recv(1.0)
        with pytest.raises(ValueError, match=r"tokens: expected ascending gathered token indices in \[0, 4\), got 4"):
            mb.source.gather(torch.tensor([0, 4]))
        with pytest.raises(ValueError, match="tokens: expected ascending"):
            mb.source.gather(torch.tensor([2, 1]))
        with pytest.raises(ValueError, match=r"partial: expected rows \[U, 24\] for tokens \[U\]"):
            ffn.send(mb, ReplyRows(torch.arange(3), torch.ones(2, H)))
        with pytest.raises(ValueError, match=r"partial.tokens: expected ascending gathered token indices in \[0, 4\)"):
            ffn.send(mb, ReplyRows(torch.tensor([0, 5]), torch.ones(2, H)))
        with pytest.raises(ValueError, match="partial.tokens: expected ascending"):
            ffn.send(mb, ReplyRows(torch.tensor([3, 1]), torch.ones(2, H)))
        ffn.send(mb, ReplyRows(torch.tensor([1, 3]), torch.ones(2, H)))  # one row for each attention worker
        seg.rep_views(0, 1, 0)[1][0] = 9  # a corrupt token index in worker 1's reply
        assert torch.equal(pair.atts[0].recv(sent[0]), torch.tensor([[0.0], [1.0]]).expand(2, H))
        with pytest.raises(ValueError, match=r"reply from FFN worker 0 to seq 0: token index 9 out of range \[0, 2\)"):
            pair.atts[1].recv(sent[1])
    finally:
        pair.close()


def test_waits_time_out_with_what_they_waited_for():
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair("timeout", layout, True, True, poll_s=0.01)
    att, ffn = pair.atts[0], pair.ffns[0]
    try:
        assert ffn.recv(0.05) is None and ffn.queued == 0 and ffn.peek() is None
        att.timeout_s = 0.1
        sent = att.send(Target(0, 0, 0), 3, torch.ones(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
        assert ffn.queued == 1
        with pytest.raises(TimeoutError, match="reply to seq 3 from FFN worker 0: nothing after the timeout"):
            att.recv(sent)
    finally:
        pair.close()


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_dead_peer_ends_the_cpp_waits():
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair("dead", layout, True, True, poll_s=0.02)
    try:
        pair.seg.pids[2] = _dead_pid()  # FFN worker 1 is gone
        att = pair.atts[0]
        sent = att.send(Target(0, 0, 0), 0, torch.ones(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
        mb = pair.ffns[0].recv(1.0)
        pair.ffns[0].send(mb, ReplyRows(torch.arange(1), torch.ones(1, H)))
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match=f"reply to seq 0 from FFN worker 1: the peer process {int(pair.seg.pids[2])} exited"):
            att.recv(sent)
        with pytest.raises(PeerGone, match=r"agree: FFN worker 1 \(pid \d+\) exited"):
            pair.ffns[0].agree(True)
        assert time.monotonic() - t0 < 4.0  # not the 5 s timeouts
    finally:
        pair.close()


def test_agree_is_the_and_of_every_vote_and_times_out_naming_the_silent_worker():
    layout = ShmLayout(num_attention=1, num_ffn=3, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair("agree", layout, True, True)
    try:
        rounds = [(True, True, True), (True, False, True), (False, False, False), (True, True, True), (True, True, False)]
        results = {}

        def worker(r):
            results[r] = [pair.ffns[r].agree(v[r]) for v in rounds]

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {r: [all(v) for v in rounds] for r in range(3)}
        pair.ffns[0].timeout_s = 0.2
        with pytest.raises(TimeoutError, match="agree: FFN worker 1 did not vote on target 5 within 0.2 s"):
            pair.ffns[0].agree(True)
    finally:
        pair.close()


@pytest.mark.parametrize("native", [True, False])
def test_agree_needs_every_yes_for_the_same_plan_digest(native):
    """A round agrees only if every worker voted yes with the same digest; all yes with different
    digests is a divergence (False, counted on every worker); a no vetoes whatever the digests.
    Early votes (``vote``) carry their digest too. The native plane and the Python path agree."""
    layout = ShmLayout(num_attention=1, num_ffn=3, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair(f"digest-{native}", layout, native, native)
    rounds = [((True, True, True), (5, 5, 5), True), ((True, True, True), (5, 6, 5), False),
              ((True, False, True), (5, 6, 5), False), ((True, True, True), (9, 9, 9), True),
              ((True, True, True), (1, 1, 2 ** 40), False)]
    try:
        results, diverged = {}, {}

        def worker(r):
            out = []
            for i, (flags, digests, _) in enumerate(rounds):
                if r == 1 and i % 2:
                    pair.ffns[r].vote(flags[r], digests[r])
                out.append(pair.ffns[r].agree(flags[r], digests[r]))
            results[r] = out
            diverged[r] = pair.ffns[r].diverged

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == {r: [want for *_, want in rounds] for r in range(3)}
        assert diverged == {0: 2, 1: 2, 2: 2}  # rounds 1 and 4; round 2 was a veto
    finally:
        pair.close()


def test_agree_never_sleeps_out_its_poll_interval_on_a_vote_that_races_its_read():
    # the other worker's vote lands at random moments around the reader's check; with one read
    # serving the test and the futex's expected value no landing sleeps out poll_s = 30 s
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair("agree-race", layout, True, True, poll_s=30.0)
    seg, end = pair.seg, pair.ffns[0]
    rounds, rng = 300, random.Random(3)
    try:
        def other():
            for v in range(rounds):
                word = ((v % 0x3FFFFFFE) + 1) << 1
                while int(seg.votes[0, v % 2]) != word | 1:  # worker 0 voted on v: it reads ours now
                    pass
                spin_until = time.perf_counter() + rng.random() * 50e-6
                while time.perf_counter() < spin_until:
                    pass
                seg.votes[1, v % 2] = word | 1
                _futex_wake(seg.addr("votes", 2 + v % 2, 4))

        t = threading.Thread(target=other)
        t0 = time.monotonic()
        t.start()
        assert all(end.agree(True) for _ in range(rounds))
        t.join(30)
        assert time.monotonic() - t0 < 25.0, "an agree slept out its poll interval: a wake-up was lost"
    finally:
        pair.close()


def test_spinning_ends_give_the_same_results_and_refuse_a_negative_spin():
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    with pytest.raises(ValueError, match="spin_s"):
        _Pair("spin-bad", layout, True, True, spin_s=-1.0)
    ShmSegment.create(_name("spin-bad"), layout).close()  # the refused pair's segment
    pair = _Pair("spin", layout, True, True, spin_s=200e-6)
    try:
        votes = {}

        def ffn(r):  # the FFN ends wait (spinning first) for targets that the main thread sends
            for t in range(20):
                mb = pair.ffns[r].recv(5.0)
                votes.setdefault(r, []).append(pair.ffns[r].agree(t % 3 != 0))
                pair.ffns[r].send(mb, _reply(mb, r, layout))

        threads = [threading.Thread(target=ffn, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in range(20):
            x = torch.randn(3, H)
            out = pair.atts[0].exchange(Target(t, 0, 0), t, x, torch.zeros(3, K, dtype=torch.int32), torch.ones(3, K))
            assert torch.equal(out, x * (1.5 + torch.arange(3) % 2).unsqueeze(1))
        for t in threads:
            t.join(30)
        assert votes == {r: [t % 3 != 0 for t in range(20)] for r in range(2)}
    finally:
        pair.close()


def test_a_signal_handler_runs_during_a_cpp_wait():
    # Ctrl-C or SIGTERM while an end waits: the handler runs at once (its exception ends the
    # wait), not after poll_s or the timeout, as with the Python path's ctypes wait
    import signal

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop()

    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    pair = _Pair("signal", layout, True, True, poll_s=30.0)
    old = signal.signal(signal.SIGALRM, handler)
    try:
        pair.atts[0].timeout_s = 60.0
        sent = pair.atts[0].send(Target(0, 0, 0), 0, torch.ones(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
        t0 = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Stop):
            pair.atts[0].recv(sent)
        assert time.monotonic() - t0 < 10.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        pair.close()


def test_an_extension_built_from_other_sources_is_not_used():
    """A stale afore._shm (another ABI: e.g. votes without plan digests) would fail mid-serving: the
    transport warns at import, naming the rebuild, and serves on the Python path instead."""
    import subprocess
    import sys

    code = ("import warnings, afore._shm as ext; ext.ABI = ext.ABI - 1\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import afore.transport.shm as shm\n"
            "print(shm._DataPlane is None, any('rebuild it: pip install -e .' in str(x.message) for x in w))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
    from afore.transport import shm

    assert shm._DataPlane is not None  # this build matches: the native plane serves


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gpu_end_sums_large_targets_on_the_device_to_the_host_sums_bits(dtype):
    """A CUDA attention end adds the replies of a target of >= device_combine_min_tokens tokens on
    the device (index_add_ in FFN-rank order): the same bits as the host sum of the C++ path, for
    targets on either side of the threshold, back to back in the depth's slots (each send waits
    for the copies still reading the reply slot it reuses); a reply naming a token outside the
    target is refused before any device work."""
    layout = ShmLayout(num_attention=1, num_ffn=3, hidden=H, top_k=K, max_tokens=96, depth=2, dtype=dtype)
    pairs = {}
    for tag, threshold in (("dev", 1), ("host", 10 ** 9)):
        seg = ShmSegment.create(_name(f"gpu{tag}{dtype}"), layout)
        for f in range(layout.num_ffn):
            seg.pids[1 + f] = os.getpid()
        att = ShmAttentionEnd(seg.name, layout, 0, device="cuda", timeout_s=5)
        att.device_combine_min_tokens = threshold
        pairs[tag] = (seg, att, [ShmFFNEnd(seg.name, layout, r, timeout_s=5) for r in range(layout.num_ffn)])
    gen = torch.Generator().manual_seed(3)
    try:
        for t, n in enumerate((96, 1, 70, 64, 0, 95)):
            x = (torch.randn(n, H, generator=gen) * 3).to(DTYPES[dtype])
            if n:
                x[0, 0] = -0.0
            ids = torch.randint(0, 8, (n, K), generator=gen, dtype=torch.int32)
            w = torch.rand(n, K, generator=gen)
            outs = {}
            for tag, (seg, att, ffns) in pairs.items():
                sent = att.send(Target(t, 0, 0), t, x.cuda(), ids.cuda(), w.cuda())
                for r, ffn in enumerate(ffns):
                    mb = ffn.recv(5.0)
                    ffn.send(mb, _reply(mb, r, layout))
                outs[tag] = att.recv(sent)
            dev, host = outs["dev"], outs["host"]
            assert dev.device.type == host.device.type == "cuda" and dev.dtype == host.dtype == DTYPES[dtype]
            assert torch.equal(_bits(dev.cpu()), _bits(host.cpu())), n
        seg, att, ffns = pairs["dev"]
        sent = att.send(Target(9, 0, 0), 9, torch.ones(4, H, device="cuda"), torch.zeros(4, K, dtype=torch.int32, device="cuda"),
                        torch.ones(4, K, device="cuda"))
        for r, ffn in enumerate(ffns):  # worker 0 replies token 2, the others nothing
            mb = ffn.recv(5.0)
            tokens = torch.tensor([2]) if r == 0 else torch.zeros(0, dtype=torch.int64)
            ffn.send(mb, ReplyRows(tokens, torch.ones(tokens.numel(), H)))
        seg.rep_views(0, 0, sent.counter % layout.depth)[1][0] = 7  # FFN worker 0's reply now names token 7 of a 4-token target
        with pytest.raises(ValueError, match=r"token index 7 out of range \[0, 4\)"):
            att.recv(sent)
    finally:
        for seg, att, ffns in pairs.values():
            for e in [att, *ffns]:
                e.close()
            seg.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_worker_copies_rows_by_dma_and_replies_from_the_device_with_the_host_paths_bytes():
    """A CUDA FFN end of a page-locked segment: ``copy_to`` a device tensor gives the target's
    rows, and ``send`` of device partials (copied into the reply slots from the device, headers
    after one wait) leaves the bytes that a CPU end's ``send`` of the same partials leaves."""
    layout = ShmLayout(num_attention=2, num_ffn=2, hidden=H, top_k=K, max_tokens=40, depth=2, dtype="bfloat16")
    pairs = {}
    for tag, device in (("gpu", "cuda"), ("cpu", "cpu")):
        seg = ShmSegment.create(_name(f"dma{tag}"), layout)
        for f in range(layout.num_ffn):
            seg.pids[2 + f] = os.getpid()
        atts = [ShmAttentionEnd(seg.name, layout, r, timeout_s=5) for r in range(2)]
        ffns = [ShmFFNEnd(seg.name, layout, r, device=device, timeout_s=5) for r in range(2)]
        pairs[tag] = (seg, atts, ffns)
    assert pairs["gpu"][2][0].sends_device_rows and not pairs["cpu"][2][0].sends_device_rows
    gen = torch.Generator().manual_seed(5)
    try:
        for t, sizes in enumerate(((40, 3), (0, 17), (25, 40))):
            xs, ids, ws = _inputs(sizes, gen)
            outs = {}
            for tag, (seg, atts, ffns) in pairs.items():
                sent = [att.send(Target(t, 0, 0), t, xs[a], ids[a], ws[a]) for a, att in enumerate(atts)]
                for r, ffn in enumerate(ffns):
                    mb = ffn.recv(5.0)
                    tokens = torch.arange(mb.num_tokens)
                    tokens = tokens[tokens % layout.num_ffn == r]  # _reply's rule, on the host rows
                    reply = ReplyRows(tokens, torch.cat(xs).index_select(0, tokens) * (1.5 + r))
                    if tag == "gpu":
                        dev = torch.empty(mb.num_tokens, H, dtype=torch.bfloat16, device="cuda")
                        assert mb.source.device_copies
                        mb.source.copy_to(dev)
                        assert torch.equal(_bits(dev.cpu()), _bits(torch.cat(xs)))
                        reply = ReplyRows(reply.tokens, reply.rows.cuda())
                    ffn.send(mb, reply)
                outs[tag] = [att.recv(s) for att, s in zip(atts, sent)]
            for g, c in zip(outs["gpu"], outs["cpu"]):
                assert torch.equal(_bits(g), _bits(c))
            raw = [np.frombuffer(p[0].mm, dtype=np.uint8) for p in pairs.values()]
            assert np.array_equal(raw[0], raw[1])
    finally:
        for seg, atts, ffns in pairs.values():
            for e in atts + ffns:
                e.close()
            seg.close()
