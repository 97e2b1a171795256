"""A2F / F2A exchange over ZeroMQ: the serving path's minimal connector.

One target's tokens go from attention worker ``a`` to every FFN worker as
``[ExchangeHeader, hidden, topk_ids, topk_weights]`` (raw little-endian frames);
each FFN worker answers with ``[ExchangeHeader, partial]``, its share of the
combined expert output for exactly those tokens. The attention worker sums the
F partials in worker order, so the result does not depend on arrival order.

Sockets: each FFN worker binds one PULL socket for requests, each attention
worker binds one PULL socket for replies; both sides connect PUSH sockets to
the other side's addresses. Any number of FFN workers per attention worker
works (F > A included); the FFN side gathers a target once all A attention
workers sent it.
"""

from __future__ import annotations

import os
import time

import msgspec
import numpy as np
import torch
import zmq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExchangeHeader(msgspec.Struct, frozen=True, array_like=True):
    """One target's frame header; ``kind`` is "req", "out" or "err"."""

    kind: str
    seq: int
    step: int
    layer: int
    microbatch: int
    attn_worker: int
    ffn_worker: int
    num_tokens: int
    hidden: int
    top_k: int
    dtype: str
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ExchangeHeader)


class PeerDied(RuntimeError):
    """An FFN worker the exchange waits for is no longer alive."""


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"hidden.dtype: expected one of {sorted(DTYPES)}, got {dtype}")


def _tensor(frame: zmq.Frame | bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    buf = bytearray(frame.buffer if isinstance(frame, zmq.Frame) else frame)
    if not buf:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> memoryview | bytes:
    if t.numel() == 0:
        return b""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return memoryview(t.view(torch.int16).numpy()).cast("B")
    return memoryview(t.numpy()).cast("B")


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0); its /proc state tells.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().split(b")")[-1].split()[0] != b"Z"
    except OSError:
        return False


class AttentionLink:
    """Attention worker side: send a target's tokens to all FFN workers, gather the partials."""

    def __init__(self, worker: int, own_endpoint: str, ffn_endpoints: list[str], ffn_pids: list[int] | None = None,
                 timeout_s: float = 60.0):
        self.worker = worker
        self.ffn_pids = list(ffn_pids or [])
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.bind(own_endpoint)
        self._send = []
        for ep in ffn_endpoints:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(ep)
            self._send.append(s)
        self._pending: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def ffn_workers(self) -> int:
        return len(self._send)

    def send(self, seq: int, step: int, layer: int, microbatch: int, hidden: torch.Tensor,
             topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Post one target to every FFN worker (non-blocking: queued by ZeroMQ)."""
        n, h = hidden.shape
        k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
        frames = [_bytes(hidden), _bytes(topk_ids.to(torch.int32)), _bytes(topk_weights.to(torch.float32))]
        for w, sock in enumerate(self._send):
            head = ExchangeHeader("req", seq, step, layer, microbatch, self.worker, w, n, h, k, _dtype_name(hidden.dtype))
            sock.send_multipart([_encoder.encode(head), *frames], copy=False)

    def recv(self, seq: int, num_tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Wait for the F partials of ``seq`` and return their sum in worker order.

        Raises PeerDied as soon as an FFN worker that has not answered is dead, and
        TimeoutError after ``timeout_s``; never waits forever.
        """
        deadline = time.monotonic() + self.timeout_s
        next_check = 0.0
        while any((seq, w) not in self._pending for w in range(self.ffn_workers)):
            now = time.monotonic()
            if now >= next_check:
                for w in range(self.ffn_workers):
                    if (seq, w) not in self._pending and w < len(self.ffn_pids) and not _alive(self.ffn_pids[w]):
                        raise PeerDied(f"FFN worker {w} (pid {self.ffn_pids[w]}) died; target seq {seq} cannot complete")
                next_check = now + 0.2
            if now >= deadline:
                missing = [w for w in range(self.ffn_workers) if (seq, w) not in self._pending]
                raise TimeoutError(f"FFN workers {missing} did not answer target seq {seq} within {self.timeout_s} s")
            if self._recv.poll(timeout=100):
                frames = self._recv.recv_multipart(copy=False)
                head = _decoder.decode(frames[0].buffer)
                if head.kind == "err":
                    raise RuntimeError(f"FFN worker {head.ffn_worker} failed target seq {head.seq}: {head.error}")
                self._pending[(head.seq, head.ffn_worker)] = _tensor(frames[1], DTYPES[head.dtype], (head.num_tokens, head.hidden))
        parts = [self._pending.pop((seq, w)) for w in range(self.ffn_workers)]
        out = parts[0].clone() if parts else torch.zeros(num_tokens, hidden, dtype=dtype)
        for p in parts[1:]:
            out += p
        return out

    def close(self) -> None:
        for s in self._send:
            s.close(0)
        self._recv.close(0)


class Request(msgspec.Struct):
    head: ExchangeHeader
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class FFNLink:
    """FFN worker side: gather one target from all A attention workers, answer each its rows."""

    def __init__(self, worker: int, own_endpoint: str, attn_endpoints: list[str]):
        self.worker = worker
        self._ctx = zmq.Context.instance()
        self._recv = self._ctx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.LINGER, 0)
        self._recv.setsockopt(zmq.RCVHWM, 0)
        self._recv.bind(own_endpoint)
        self._send = []
        for ep in attn_endpoints:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(ep)
            self._send.append(s)
        self._partial: dict[int, dict[int, Request]] = {}

    @property
    def attn_workers(self) -> int:
        return len(self._send)

    def recv_target(self, timeout_ms: int = 100) -> list[Request] | None:
        """The next target all A attention workers sent, in attention-worker order; None on timeout."""
        while True:
            if not self._recv.poll(timeout=timeout_ms):
                return None
            frames = self._recv.recv_multipart(copy=False)
            head = _decoder.decode(frames[0].buffer)
            if head.kind != "req" or not 0 <= head.attn_worker < self.attn_workers:
                continue
            dt = DTYPES[head.dtype]
            req = Request(head, _tensor(frames[1], dt, (head.num_tokens, head.hidden)),
                          _tensor(frames[2], torch.int32, (head.num_tokens, head.top_k)),
                          _tensor(frames[3], torch.float32, (head.num_tokens, head.top_k)))
            got = self._partial.setdefault(head.seq, {})
            got[head.attn_worker] = req
            if len(got) == self.attn_workers:
                del self._partial[head.seq]
                return [got[a] for a in range(self.attn_workers)]

    def send_outputs(self, requests: list[Request], outputs: list[torch.Tensor]) -> None:
        for req, out in zip(requests, outputs):
            h = req.head
            head = ExchangeHeader("out", h.seq, h.step, h.layer, h.microbatch, h.attn_worker, self.worker,
                                  h.num_tokens, h.hidden, h.top_k, h.dtype)
            self._send[h.attn_worker].send_multipart([_encoder.encode(head), _bytes(out.to(DTYPES[h.dtype]))], copy=False)

    def send_error(self, requests: list[Request], error: str) -> None:
        for req in requests:
            h = req.head
            head = ExchangeHeader("err", h.seq, h.step, h.layer, h.microbatch, h.attn_worker, self.worker,
                                  h.num_tokens, h.hidden, h.top_k, h.dtype, error[:2000])
            self._send[h.attn_worker].send_multipart([_encoder.encode(head), b""])

    def close(self) -> None:
        for s in self._send:
            s.close(0)
        self._recv.close(0)


class PlanDecisions:
    """Makes every FFN worker apply the same plan to the same target (invariant 3).

    Whether a target's plan arrived in time is a local observation; if each worker decided
    alone, one could run the scheduler's plan and another the primary-only plan, and the
    exact partition would count some pairs twice and others never. So FFN worker 0 (the
    leader) alone reads the plan ring and decides per target; it pushes the decision with
    the encoded plan (or nothing = primary-only) to the other workers, which apply it.
    """

    def __init__(self, worker: int, control_endpoints: list[str], leader_pid: int = 0):
        self.worker = worker
        self.leader_pid = leader_pid
        self._ctx = zmq.Context.instance()
        self._socks: list[zmq.Socket] = []
        self._recv: zmq.Socket | None = None
        self._decided: dict[int, bytes] = {}
        if worker == 0:
            for ep in control_endpoints[1:]:
                s = self._ctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 0)
                s.connect(ep)
                self._socks.append(s)
        else:
            self._recv = self._ctx.socket(zmq.PULL)
            self._recv.setsockopt(zmq.LINGER, 0)
            self._recv.bind(control_endpoints[worker])

    @property
    def leader(self) -> bool:
        return self.worker == 0

    def announce(self, seq: int, plan: bytes) -> None:
        """Tell the followers which plan target ``seq`` runs: encoded plan, or b"" = primary-only."""
        msg = _encoder.encode((seq, plan))
        for s in self._socks:
            s.send(msg)

    def wait(self, seq: int, timeout_s: float) -> bytes:
        """The leader's decision for ``seq`` (as announced); PeerDied / TimeoutError, never a hang."""
        assert self._recv is not None
        deadline = time.monotonic() + timeout_s
        while seq not in self._decided:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no plan decision for target seq {seq} from FFN worker 0 within {timeout_s} s")
            if self._recv.poll(timeout=100):
                got_seq, plan = msgspec.msgpack.decode(self._recv.recv())
                self._decided[int(got_seq)] = bytes(plan)
            elif not _alive(self.leader_pid):
                raise PeerDied(f"FFN worker 0 (pid {self.leader_pid}) died; target seq {seq} has no plan decision")
        for old in [s for s in self._decided if s < seq]:
            del self._decided[old]
        return self._decided.pop(seq)

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        if self._recv is not None:
            self._recv.close(0)
