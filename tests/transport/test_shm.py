"""The shm transport (afore.transport.shm): exchange semantics, sparsity, agreement, faults.

FFN ends run in spawned processes (the real layout); each computes a fixed function of the rows
it owns, so every attention output can be checked exactly.
"""

import multiprocessing as mp
import os
import time

import pytest
import torch

from afore.plan import Target
from afore.transport.base import ReplyRows
from afore.transport.shm import PeerGone, ShmAttentionEnd, ShmFFNEnd, ShmLayout, ShmSegment

pytestmark = pytest.mark.slow
H, K = 16, 2


def _name(tag: str) -> str:
    return f"afore-test-shm-{tag}-{os.getpid()}"


def _ffn_loop(name: str, layout: ShmLayout, rank: int, targets: int, votes: list[bool] | None, out_q,
              early: bool = False) -> None:
    """FFN worker ``rank`` owns the gathered tokens t with t % F == rank and replies 2^rank * row
    for them; with ``votes``, agrees on each target first and reports the agreed values; with
    ``early``, odd ranks post their vote with ``vote`` before they tally it (as FFNWorker.step)."""
    torch.set_num_threads(1)
    end = ShmFFNEnd(name, layout, rank, timeout_s=120)
    agreed = []
    for i in range(targets):
        mb = end.recv(120.0)
        assert mb is not None
        if votes is not None:
            flag = votes[i] if rank == 0 else True
            if early and rank % 2:
                end.vote(flag)
                time.sleep(0.002 * (i % 3))  # the compute between posting and tallying
            agreed.append(end.agree(flag))
        n = mb.num_tokens
        tokens = torch.arange(n)[torch.arange(n) % layout.num_ffn == rank]
        hidden = mb.rows_for(tokens)
        end.send(mb, ReplyRows(tokens, hidden.index_select(0, tokens) * 2.0 ** rank))
    out_q.put((rank, agreed, end.bytes_received, end.bytes_sent))
    end.close()


def _start(name, layout, targets, votes=None, early=False):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ffn_loop, args=(name, layout, f, targets, votes, q, early))
             for f in range(layout.num_ffn)]
    for p in procs:
        p.start()
    return procs, q


def _expected(x: torch.Tensor, offset: int, num_ffn: int) -> torch.Tensor:
    g = torch.arange(x.shape[0]) + offset
    return x * (2.0 ** (g % num_ffn)).unsqueeze(1)


@pytest.mark.parametrize("num_attention,num_ffn", [(1, 2), (2, 3)])
def test_every_reply_sums_the_rows_their_workers_own(num_attention, num_ffn):
    layout = ShmLayout(num_attention=num_attention, num_ffn=num_ffn, hidden=H, top_k=K, max_tokens=12, depth=2)
    name = _name(f"sum{num_attention}{num_ffn}")
    seg = ShmSegment.create(name, layout)
    targets = 20
    procs, q = _start(name, layout, targets)
    try:
        ends = [ShmAttentionEnd(name, layout, a, timeout_s=120) for a in range(num_attention)]
        gen = torch.Generator().manual_seed(0)
        sizes = [[int(torch.randint(0, 13, (1,), generator=gen)) for _ in range(num_attention)] for _ in range(targets)]
        xs = [[torch.randn(n, H, generator=gen) for n in row] for row in sizes]
        pending = []
        for t in range(targets):  # two targets in flight per attention worker (depth 2)
            sent = [ends[a].send(Target(t // 2, 0, t % 2), t, xs[t][a], torch.zeros(sizes[t][a], K, dtype=torch.int64),
                                 torch.ones(sizes[t][a], K)) for a in range(num_attention)]
            pending.append((t, sent))
            if len(pending) == 2 or t == targets - 1:
                while pending:
                    s, sent = pending.pop(0)
                    for a in range(num_attention):
                        out = ends[a].recv(sent[a])
                        offset = sum(sizes[s][:a])
                        torch.testing.assert_close(out, _expected(xs[s][a], offset, num_ffn), rtol=0, atol=0)
        stats = sorted(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(10)
        assert [p.exitcode for p in procs] == [0] * num_ffn
        total_rows = sum(sum(r) for r in sizes)
        row_bytes = H * 4
        # sparse: each FFN worker read only the rows it owns (plus every sender's ids and weights)
        # and replied only those; together they read every row once, not F times
        read_rows = sum(s[2] - total_rows * K * 8 for s in stats) / row_bytes
        assert read_rows == total_rows
        assert sum(s[3] for s in stats) == total_rows * (row_bytes + 4)
        for e in ends:
            e.close()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        seg.close()


@pytest.mark.parametrize("early", [False, True])
def test_agreement_is_unanimous_on_every_worker(early):
    """Also when some workers post their votes early (``vote``) and tally them later, while
    the others vote and tally at once: rounds never mix (the two vote slots alternate)."""
    layout = ShmLayout(num_attention=1, num_ffn=3, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name(f"agree-{int(early)}")
    seg = ShmSegment.create(name, layout)
    votes = [True, False, True, True, False, False, True, True]
    procs, q = _start(name, layout, len(votes), votes, early)
    try:
        end = ShmAttentionEnd(name, layout, 0, timeout_s=120)
        for t in range(len(votes)):
            end.exchange(Target(t, 0, 0), t, torch.ones(2, H), torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K))
        results = sorted(q.get(timeout=120) for _ in procs)
        # worker 0's False vetoes the target on every worker, the same decision everywhere
        assert [r[1] for r in results] == [votes] * 3
        end.close()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        seg.close()


class _VoteLandsAfterTheRead:
    """``seg.votes`` whose first read of worker ``other``'s slot returns the empty word and then
    stores that worker's vote (True): the vote lands just after the reader looked."""

    def __init__(self, real, other: int, word: int) -> None:
        self.real, self.other, self.word, self.fired = real, other, word, False

    def __getitem__(self, key):
        value = self.real[key]
        if key == (self.other, 0) and not self.fired:
            self.fired = True
            self.real[key] = self.word
        return value

    def __setitem__(self, key, value) -> None:
        self.real[key] = value


def test_agree_sees_a_vote_that_lands_between_its_reads():
    # a vote stored right after the reader's check must end its futex wait at once (the value it
    # waits on already changed), not after poll_s: that lost wake-up cost 200 ms per target
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name("agree-race")
    seg = ShmSegment.create(name, layout)
    try:
        end = ShmFFNEnd(name, layout, 0, timeout_s=120, poll_s=30.0, native=False)  # the Python path's reads
        end.seg.votes = _VoteLandsAfterTheRead(end.seg.votes, other=1, word=(1 << 1) | 1)
        t0 = time.monotonic()
        assert end.agree(True) is True
        assert end.seg.votes.fired
        assert time.monotonic() - t0 < 10.0, "agree slept out its poll interval: the vote's wake-up was lost"
        end.close()
    finally:
        seg.close()


@pytest.mark.parametrize("reaped", [True, False])
def test_dead_ffn_worker_fails_the_exchange_at_once(reaped):
    """Also while the dead worker is a zombie (its parent has not reaped it yet: kill(0) still
    succeeds), as when afore serve is busy stopping vLLM."""
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name(f"dead{int(reaped)}")
    seg = ShmSegment.create(name, layout)
    procs, q = _start(name, layout, targets=1)  # each answers one target, then exits
    try:
        end = ShmAttentionEnd(name, layout, 0, timeout_s=60, poll_s=0.05)
        end.exchange(Target(0, 0, 0), 0, torch.ones(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
        for _ in procs:
            q.get(timeout=120)
        for p in procs:
            if reaped:
                p.join(10)
            else:  # wait for the exit without reaping
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    with open(f"/proc/{p.pid}/stat", "rb") as fh:
                        if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                            break
                    time.sleep(0.01)
        sent = end.send(Target(1, 0, 0), 1, torch.ones(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
        t0 = time.monotonic()
        with pytest.raises(PeerGone, match="exited"):
            end.recv(sent)
        assert time.monotonic() - t0 < 2.0  # not the 60 s timeout
        end.close()
    finally:
        for p in procs:
            p.join(10)
        seg.close()


def test_a_torn_or_stale_slot_is_rejected_not_read():
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name("torn")
    seg = ShmSegment.create(name, layout)
    try:
        seg.pids[1] = os.getpid()  # this process plays the FFN side too
        att = ShmAttentionEnd(name, layout, 0, timeout_s=5)
        ffn = ShmFFNEnd(name, layout, 0, timeout_s=5)
        att.send(Target(0, 0, 0), 0, torch.ones(2, H), torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K))
        seg.req_head[0, 0, 6] = 7  # the closing counter disagrees with the opening one: torn
        with pytest.raises(ValueError, match="torn or stale"):
            ffn.recv(1.0)
        ffn.close()
        att.close()
    finally:
        seg.close()


def test_bad_input_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="depth"):
        ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=1)
    with pytest.raises(ValueError, match="dtype"):
        ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, dtype="int8")
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name("bad")
    seg = ShmSegment.create(name, layout)
    try:
        seg.pids[1] = os.getpid()
        att = ShmAttentionEnd(name, layout, 0, timeout_s=5)
        with pytest.raises(ValueError, match="max_tokens"):
            att.send(Target(0, 0, 0), 0, torch.ones(5, H), torch.zeros(5, K, dtype=torch.int32), torch.ones(5, K))
        with pytest.raises(ValueError, match="hidden"):
            att.send(Target(0, 0, 0), 0, torch.ones(2, H + 1), torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K))
        for t in range(2):
            att.send(Target(t, 0, 0), t, torch.ones(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
        with pytest.raises(RuntimeError, match="in flight"):  # depth 2: a third would overwrite slot 0
            att.send(Target(2, 0, 0), 2, torch.ones(1, H), torch.zeros(1, K, dtype=torch.int32), torch.ones(1, K))
        other = ShmLayout(num_attention=1, num_ffn=1, hidden=H * 2, top_k=K, max_tokens=4, depth=2)
        with pytest.raises(ValueError, match="disagree on the layout"):
            ShmAttentionEnd(name, other, 0, timeout_s=1)
        att.close()
    finally:
        seg.close()


def test_attention_end_waits_for_every_ffn_worker_to_attach():
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name("attach")
    seg = ShmSegment.create(name, layout)
    try:
        with pytest.raises(TimeoutError, match=r"FFN workers \[0, 1\]"):
            ShmAttentionEnd(name, layout, 0, timeout_s=0.2)
    finally:
        seg.close()


def test_a_tally_with_another_flag_than_the_posted_vote_is_refused():
    layout = ShmLayout(num_attention=1, num_ffn=2, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name("vote-mismatch")
    seg = ShmSegment.create(name, layout)
    try:
        end = ShmFFNEnd(name, layout, 0, timeout_s=5)
        end.vote(True)
        with pytest.raises(ValueError, match=r"voted \(True, 0\) on round 0 with vote\(\), now \(False, 0\)"):
            end.agree(False)
        end.vote(True, 7)  # round 1: the same flag with another digest is refused too
        with pytest.raises(ValueError, match=r"voted \(True, 7\) on round 1 with vote\(\), now \(True, 8\)"):
            end.agree(True, 8)
        end.close()
    finally:
        seg.close()


def test_sent_ids_are_the_slots_host_copy_of_an_in_flight_target():
    """The attention end hands out the ids of an in-flight target as its request slot holds them
    (int32, host): what a GPU worker counts its demand from. Not once the target was received."""
    layout = ShmLayout(num_attention=1, num_ffn=1, hidden=H, top_k=K, max_tokens=4, depth=2)
    name = _name("ids")
    seg = ShmSegment.create(name, layout)
    try:
        seg.pids[1] = os.getpid()
        att = ShmAttentionEnd(name, layout, 0, timeout_s=5)
        ffn = ShmFFNEnd(name, layout, 0, timeout_s=5)
        sent = []
        for t, n in enumerate((3, 2)):  # two targets in the two slots, different sizes
            ids = torch.randint(0, 8, (n, K), dtype=torch.int64)  # int64 in: the slot holds int32
            sent.append((att.send(Target(t, 0, 0), t, torch.randn(n, H), ids, torch.rand(n, K)), ids))
        for s, ids in sent:
            got = att.sent_ids(s)
            assert got.dtype == torch.int32 and got.device.type == "cpu" and torch.equal(got.long(), ids)
        for _ in sent:  # the FFN side replies to both (no rows of its own), the attention end takes them
            mb = ffn.recv(1.0)
            ffn.send(mb, ReplyRows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, H)))
        att.recv(sent[0][0])
        with pytest.raises(ValueError, match="not in flight"):
            att.sent_ids(sent[0][0])
        assert torch.equal(att.sent_ids(sent[1][0]).long(), sent[1][1])
        att.recv(sent[1][0])
        ffn.close()
        att.close()
    finally:
        seg.close()
