"""Intra-node A2F/F2A transport: shared buffers in one POSIX shared-memory segment, sparse reads.

For attention and FFN workers on one node (``afore serve`` on one machine, ``--colocate``, one
GPU shared by several workers: the segment is page-locked for CUDA ends, GPU FFN workers route on
the host, ``FFNLayer.forward_host_routed``). No sockets, no collective: each
attention worker writes a target's tokens once into its own request slot; every FFN worker reads
the routing ids of all A senders (N*k int32, needed for the exact partition, eq. 11), then gathers
only the hidden rows of the tokens it computes; each FFN worker writes weighted partial sums for
just those tokens into its reply slot for the token's attention worker, which sums the F replies.
Bytes per target each way: the rows of the pairs' tokens (at most pairs x H x dtype), plus ids
and headers; there is no all-gather of the tokens and no all-reduce over the F workers.

Segment layout (``ShmLayout``; every offset 64-byte aligned)::

    pids       int64[A + F]                 process of each end (liveness of peers)
    req_ready  int32[A, D]                  futex word: message counter + 1 of the slot's content
    req_head   int64[A, D, 8]               [counter, seq, step, layer, microbatch, n, counter, 0]
    req_data   per (a, d): hidden [T, H] dtype | ids int32 [T, k] | weights fp32 [T, k]
    rep_ready  int32[F, A, D]               futex word, as req_ready
    rep_head   int64[F, A, D, 8]            [counter, seq, step, layer, microbatch, rows, counter, 0]
    rep_data   per (f, a, d): rows [T, H] dtype | token index int32 [T]
    votes      int32[F, 2]                  plan agreement among the FFN workers (``agree``)
    digests    int64[F, 2]                  each vote's plan digest (written before its vote word)

Flow control needs no acknowledgements: attention worker a writes message c into slot c % D only
after it received every reply to message c - D (``AttentionEnd.send`` waits for them), and an FFN
worker replies to a message only after it read it; replies are consumed in order in the same way.
The header's first and last counter words bracket a slot's content (written before and after
it), and the futex word is written last: a reader that finds them unequal, or a counter it did not
expect, raises instead of reading a torn or stale slot.

Waiting blocks in the kernel (futex on the ready words, ``FUTEX_WAIT`` with a timeout), never
spins: the processes of ``afore serve`` may share two cores. While waiting, an end wakes every
``poll_s`` to check that its peers' processes are alive, so a dead FFN worker fails the attention
worker's exchange at once instead of after the timeout.

Memory order: x86-64 keeps stores in program order and loads in program order (TSO), and every
store here is a plain aligned store made before the futex call that publishes it; the segment is
not portable to weaker memory models as written.

The per-target work runs in C++ (``afore._shm.DataPlane``, csrc/shm/dataplane.cpp: waits without
the GIL, header writes and checks, the copies, the reply sum, the agree barrier) over this same
layout; the Python code below it is the reference (``native=False``, tests hold the two equal bit
for bit) and the path for CUDA inputs of ``ShmAttentionEnd.send``, copied straight from the device
into the slot. Host buffers reach C++ as data pointers after the checks here (dtype, shape,
contiguity): a round trip of one token costs tens of microseconds, not hundreds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import time

import msgspec
import numpy as np
import torch

from afore.plan import Target
from afore.procs import pid_alive
from afore.transport.base import Microbatch, ReplyRows

#: the bindings this module calls (afore._shm.ABI): an extension built from older sources has other
#: signatures (e.g. votes without digests) and would fail mid-serving, so it is not used at all
SHM_ABI = 3
try:
    from afore import _shm as _shm_ext
    from afore._shm import DataPlane as _DataPlane, set_peer_gone as _set_peer_gone
except ImportError:  # an older build of the extension: the Python path serves alone
    _DataPlane = _set_peer_gone = None
else:
    if getattr(_shm_ext, "ABI", 0) != SHM_ABI:
        import warnings

        warnings.warn(f"afore._shm was built from other sources (ABI {getattr(_shm_ext, 'ABI', 0)}, this code "
                      f"expects {SHM_ABI}): its data plane is not used (the Python path serves, slower; no "
                      f"--exchange stream); rebuild it: pip install -e . (or make install)", RuntimeWarning, stacklevel=2)
        _DataPlane = _set_peer_gone = None

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}  # DataPlane's dtype argument
_VIEW_CACHE = 4096  # cached slot prefixes (a, d, n) per segment before the cache starts over
_ALIGN = 64
_HEAD = 8
# outcomes of an agreement round (``ShmFFNEnd.agree``; the native plane returns the same codes)
VETOED, AGREED, DIVERGED = 0, 1, 2  # someone voted no / all yes for one plan / all yes, different plans
_SYS_FUTEX = 202          # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``addr`` equals ``expected``, at most ``timeout_s`` (spurious
    wake-ups are fine: callers re-check). Releases the GIL (ctypes)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts), None, 0)


def _futex_wake(addr: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0)


def _word(counter: int) -> int:
    """The futex word that publishes message ``counter`` (31 bits, never 0: 0 = empty)."""
    return counter % 0x7FFFFFFE + 1


class ShmLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything both ends must agree on; sizes the segment.

    ``max_tokens`` T bounds the tokens of one target from one attention worker (vLLM's
    max_num_batched_tokens is the safe value); ``depth`` D the targets one attention worker may
    have in flight (>= 2: the FFN side reads target t+1's plan while t computes)."""

    num_attention: int
    num_ffn: int
    hidden: int
    top_k: int
    max_tokens: int
    dtype: str = "float32"
    depth: int = 4
    # replies carry a row per token-expert pair (k per token), summed by the attention side as
    # vLLM sums them (``afore serve --exact``, afore.ffn.exact); else a partial sum per token
    exact: bool = False

    def __post_init__(self) -> None:
        for name in ("num_attention", "num_ffn", "hidden", "top_k", "max_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.depth < 2:
            raise ValueError(f"depth: expected >= 2 (two targets in flight), got {self.depth}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def offsets(self) -> dict[str, int]:
        """Byte offset of each region, and ``size``: the segment's length."""
        a, f, d = self.num_attention, self.num_ffn, self.depth
        es = torch.empty(0, dtype=self.torch_dtype).element_size()
        sizes = [("pids", 8 * (a + f)), ("req_ready", 4 * a * d), ("req_head", 8 * _HEAD * a * d),
                 ("rep_ready", 4 * f * a * d), ("rep_head", 8 * _HEAD * f * a * d), ("votes", 4 * f * 2),
                 ("digests", 8 * f * 2), ("req_data", a * d * self.req_slot_bytes(es)), ("rep_data", f * a * d * self.rep_slot_bytes(es))]
        out, pos = {}, 0
        for name, n in sizes:
            out[name] = pos
            pos += -(-n // _ALIGN) * _ALIGN
        out["size"] = pos
        return out

    def req_slot_bytes(self, es: int) -> int:
        t = self.max_tokens
        return -(-(t * self.hidden * es + t * self.top_k * 8) // _ALIGN) * _ALIGN

    @property
    def reply_rows(self) -> int:
        """Rows of one reply slot: a row per token, or per token-expert pair when ``exact``."""
        return self.max_tokens * (self.top_k if self.exact else 1)

    def rep_slot_bytes(self, es: int) -> int:
        t = self.reply_rows
        return -(-(t * self.hidden * es + t * 4) // _ALIGN) * _ALIGN


class ShmSegment:
    """The mapped segment: ``create`` (the launcher, once) or ``attach`` (every end)."""

    def __init__(self, name: str, layout: ShmLayout, fd: int, owner: bool) -> None:
        self.name, self.layout, self.owner = name, layout, owner
        self.off = layout.offsets()
        self.mm = mmap.mmap(fd, self.off["size"])
        os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        buf = np.frombuffer(self.mm, dtype=np.uint8)
        a, f, d = layout.num_attention, layout.num_ffn, layout.depth

        def view(name, dtype, shape):
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            return buf[self.off[name]:self.off[name] + n].view(dtype).reshape(shape)

        self.pids = view("pids", np.int64, (a + f,))
        self.req_ready = view("req_ready", np.int32, (a, d))
        self.req_head = view("req_head", np.int64, (a, d, _HEAD))
        self.rep_ready = view("rep_ready", np.int32, (f, a, d))
        self.rep_head = view("rep_head", np.int64, (f, a, d, _HEAD))
        self.votes = view("votes", np.int32, (f, 2))
        self.digests = view("digests", np.int64, (f, 2))
        self._raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self._views: dict[tuple, tuple] = {}
        self.pinned = False  # page-locked for CUDA (``pin``)
        self.plane = None  # the C++ hot path over this mapping (None: the extension lacks it)
        if _DataPlane is not None:
            es = torch.empty(0, dtype=layout.torch_dtype).element_size()
            self.plane = _DataPlane(self.base, a, f, layout.hidden, layout.top_k, layout.max_tokens, d,
                                    _DTYPE_CODES[layout.dtype], layout.exact,
                                    {**self.off, "req_slot": layout.req_slot_bytes(es), "rep_slot": layout.rep_slot_bytes(es)})

    @classmethod
    def create(cls, name: str, layout: ShmLayout) -> "ShmSegment":
        """A new zeroed segment ``/dev/shm/<name>`` (a stale one of a crashed run is replaced)."""
        path = _path(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, layout.offsets()["size"])
        return cls(name, layout, fd, True)

    @classmethod
    def attach(cls, name: str, layout: ShmLayout, timeout_s: float = 30.0) -> "ShmSegment":
        """Map an existing segment, waiting up to ``timeout_s`` for it to appear with its full size."""
        path, size = _path(name), layout.offsets()["size"]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                if os.fstat(fd).st_size == size:
                    return cls(name, layout, fd, False)
                actual = os.fstat(fd).st_size
                os.close(fd)
                if actual:
                    raise ValueError(f"{name}: segment has {actual} bytes, this layout needs {size} "
                                     f"(the two ends disagree on the layout: {layout})")
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: data-plane segment not found in /dev/shm after {timeout_s:.0f} s")
            time.sleep(0.01)

    def addr(self, region: str, index: int, itemsize: int) -> int:
        return self.base + self.off[region] + index * itemsize

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        es = torch.empty(0, dtype=dtype).element_size()
        n = int(np.prod(shape)) * es
        return self._raw[offset:offset + n].view(dtype).view(shape)

    def req_views(self, a: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [T, H], ids int32 [T, k], weights fp32 [T, k]) of request slot (a, d) (made once)."""
        views = self._views.get(("req", a, d))
        if views is None:
            views = self._views[("req", a, d)] = self._req_views(a, d)
        return views

    def rep_views(self, f: int, a: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [T, H], token int32 [T]) of reply slot (f, a, d) (made once)."""
        views = self._views.get(("rep", f, a, d))
        if views is None:
            views = self._views[("rep", f, a, d)] = self._rep_views(f, a, d)
        return views

    def req_prefix(self, a: int, d: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``n`` rows of ``req_views(a, d)`` (cached: slicing a tensor costs microseconds)."""
        views = self._views.get(("req", a, d, n))
        if views is None:
            if len(self._views) > _VIEW_CACHE:
                self._views.clear()
            h, i, w = self.req_views(a, d)
            views = self._views[("req", a, d, n)] = (h[:n], i[:n], w[:n])
        return views

    def _req_views(self, a: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lay = self.layout
        es = torch.empty(0, dtype=lay.torch_dtype).element_size()
        t, h, k = lay.max_tokens, lay.hidden, lay.top_k
        base = self.off["req_data"] + (a * lay.depth + d) * lay.req_slot_bytes(es)
        hidden = self.tensor(base, lay.torch_dtype, (t, h))
        ids = self.tensor(base + t * h * es, torch.int32, (t, k))
        weights = self.tensor(base + t * h * es + t * k * 4, torch.float32, (t, k))
        return hidden, ids, weights

    def _rep_views(self, f: int, a: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout
        es = torch.empty(0, dtype=lay.torch_dtype).element_size()
        t, h = lay.reply_rows, lay.hidden
        base = self.off["rep_data"] + ((f * lay.num_attention + a) * lay.depth + d) * lay.rep_slot_bytes(es)
        return self.tensor(base, lay.torch_dtype, (t, h)), self.tensor(base + t * h * es, torch.int32, (t,))

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA (``cudaHostRegister``): copies between a GPU and the slots
        then run by DMA at full rate and may be non-blocking. False if the driver refused (copies
        still work, staged and synchronous)."""
        if not self.pinned:
            cudart = torch.cuda.cudart()
            self.pinned = int(cudart.cudaHostRegister(self.base, self.off["size"], 0)) == 0
        return self.pinned

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
        self.plane = None
        self._raw = None
        self._views.clear()
        for name in ("pids", "req_ready", "req_head", "rep_ready", "rep_head", "votes", "digests"):
            setattr(self, name, None)
        try:
            self.mm.close()
        except BufferError:  # a view outlives us (e.g. a Microbatch still referenced): the OS unmaps at exit
            pass
        if self.owner:
            unlink_segment(self.name)


def _path(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"name: expected a segment name without '/', got {name!r}")
    return f"/dev/shm/{name}"


def unlink_segment(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


class PeerGone(RuntimeError):
    """A peer process of the data plane exited."""


if _set_peer_gone is not None:
    _set_peer_gone(PeerGone)


def _host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous host tensor of ``dtype`` (itself when it already is one)."""
    if t.dtype is not dtype or not t.is_cpu:
        t = t.to(device="cpu", dtype=dtype)
    return t if t.is_contiguous() else t.contiguous()


def _wait_word(seg: ShmSegment, region: str, index: int, want: int, deadline: float, poll_s: float,
               peers: list[int], what: str) -> None:
    """Block until int32 word ``index`` of ``region`` equals ``want``; PeerGone if a peer process
    died, TimeoutError at ``deadline`` (monotonic; inf = never)."""
    arr = seg.req_ready.reshape(-1) if region == "req_ready" else seg.rep_ready.reshape(-1) if region == "rep_ready" else seg.votes.reshape(-1)
    addr = seg.addr(region, index, 4)
    while True:
        cur = int(arr[index])
        if cur == want:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: nothing after the timeout")
        _futex_wait(addr, cur, min(poll_s, left))
        if int(arr[index]) != want:
            for p in peers:
                pid = int(seg.pids[p])
                if pid and not pid_alive(pid):
                    raise PeerGone(f"{what}: the peer process {pid} exited")


@dataclasses.dataclass
class _Sent:
    target: Target
    seq: int
    num_tokens: int
    counter: int
    sent_ns: int


def _attach_end(end, name: str, layout: ShmLayout, device, timeout_s: float, native: bool, spin_s: float) -> None:
    """What both ends set up alike: the device, the attached segment, the C++ plane (``native``),
    the busy-poll before blocking (``spin_s``), the row size."""
    end.device = torch.device(device)
    end.seg = ShmSegment.attach(name, layout, timeout_s)
    if not spin_s >= 0:
        raise ValueError(f"spin_s: expected seconds >= 0, got {spin_s}")
    end._plane, end.spin_s = (end.seg.plane if native else None), float(spin_s)
    # a GPU end's copies to and from the slots: DMA from page-locked memory, non-blocking
    end._pinned = end.device.type == "cuda" and end.seg.pin()
    end._dtype = layout.torch_dtype
    end._row_bytes = layout.hidden * torch.empty(0, dtype=layout.torch_dtype).element_size()
    # recv hands the fp32 sums out as they are (no .to) when that is what this end wants
    end._sums_as_is = not layout.exact and layout.dtype == "float32" and end.device.type == "cpu"


class ShmAttentionEnd:
    """Attention worker ``rank``'s end. ``send`` returns a handle; ``recv(handle)`` the combined
    routed-expert output [n, H] (sum of the F sparse replies), in send order. ``native=False``:
    the Python reference path instead of the C++ one (same bytes, same results). ``spin_s``: the
    C++ waits busy-poll this long before they block (0: block at once, for workers that share
    cores; a spare core per worker buys the wake-up latency, ~10 us per hop).

    On a GPU end a target of at least ``device_combine_min_tokens`` tokens is summed on the device
    (``_combine_on_device``; the same bits as the host sum), smaller ones on the host (one copy of
    the sums; fewer launches)."""

    device_combine_min_tokens = 64

    def __init__(self, name: str, layout: ShmLayout, rank: int, device: torch.device | str = "cpu",
                 timeout_s: float = 60.0, poll_s: float = 0.1, native: bool = True, spin_s: float = 0.0) -> None:
        if not 0 <= rank < layout.num_attention:
            raise ValueError(f"rank: expected in [0, {layout.num_attention}), got {rank}")
        self.layout, self.rank, self.timeout_s, self.poll_s = layout, rank, timeout_s, poll_s
        _attach_end(self, name, layout, device, timeout_s, native, spin_s)
        self.seg.pids[rank] = os.getpid()
        self._counter = 0
        self._inflight: list[_Sent] = []
        self._slot_readers: dict[int, torch.cuda.Event] = {}  # reply slot -> the copies reading it (device combine)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._wait_for_ffn(timeout_s)

    def _wait_for_ffn(self, timeout_s: float) -> None:
        """Every FFN worker attached (it does so once its experts are loaded and it reads the plan
        ring): only then may targets flow, as with the torch transport's rendezvous."""
        deadline = time.monotonic() + timeout_s
        lay = self.layout
        while not all(self.seg.pids[lay.num_attention:]):
            if time.monotonic() > deadline:
                missing = [f for f in range(lay.num_ffn) if not self.seg.pids[lay.num_attention + f]]
                raise TimeoutError(f"FFN workers {missing} did not attach to {self.seg.name} within {timeout_s:.0f} s")
            time.sleep(0.01)

    def send(self, target: Target, seq: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor) -> _Sent:
        lay = self.layout
        shape = hidden.shape
        if len(shape) != 2 or shape[1] != lay.hidden:
            raise ValueError(f"hidden: expected shape [n, {lay.hidden}], got {tuple(hidden.shape)}")
        n = shape[0]
        if n > lay.max_tokens:
            raise ValueError(f"hidden: expected at most max_tokens={lay.max_tokens} tokens per target, got {n} "
                             f"(raise afore serve --max-num-batched-tokens)")
        routing = (n, lay.top_k)
        if topk_ids.shape != routing or topk_weights.shape != routing:
            raise ValueError(f"topk_ids, topk_weights: expected shape [{n}, {lay.top_k}], got "
                             f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
        if len(self._inflight) >= lay.depth:  # flow control: slot c % D is free once c - D was answered
            raise RuntimeError(f"send: at most depth={lay.depth} targets in flight; recv the oldest first")
        c = self._counter
        reading = self._slot_readers.pop(c % lay.depth, None)
        if reading is not None:  # the device still copying the replies of message c - D out of their slots
            reading.synchronize()
        if self._plane is not None and hidden.is_cpu:
            hidden = _host(hidden, self._dtype)
            topk_ids, topk_weights = _host(topk_ids, torch.int32), _host(topk_weights, torch.float32)
            self._plane.send_request(self.rank, c, seq, target.step, target.layer, target.microbatch, n,
                                     hidden.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr())
        else:  # the reference path; CUDA tensors are copied from the device straight into the slot
            d = c % lay.depth
            seg = self.seg
            head = seg.req_head[self.rank, d]
            head[0] = c
            if n:
                h, ids, w = seg.req_views(self.rank, d)
                # into page-locked slots: three non-blocking copies, then one wait for all of them
                blocking = not (self._pinned and hidden.is_cuda)
                h[:n].copy_(hidden, non_blocking=not blocking)
                ids[:n].copy_(topk_ids, non_blocking=not blocking)
                w[:n].copy_(topk_weights, non_blocking=not blocking)
                if not blocking:
                    torch.cuda.current_stream(hidden.device).synchronize()
            head[1:6] = (seq, target.step, target.layer, target.microbatch, n)
            head[6] = c
            seg.req_ready[self.rank, d] = _word(c)
            _futex_wake(seg.addr("req_ready", self.rank * lay.depth + d, 4))
        self._counter += 1
        self.bytes_sent += n * (self._row_bytes + lay.top_k * 8)
        sent = _Sent(target, seq, n, c, time.perf_counter_ns())
        self._inflight.append(sent)
        return sent

    def sent_ids(self, sent: _Sent) -> torch.Tensor:
        """The routing ids of an in-flight target as its request slot holds them: int32 [n, k] on
        the host (a view of the slot, valid until the target is received). For a target sent from
        a GPU this is the host copy the send already made: its demand is counted from it without
        another device-to-host transfer."""
        if sent not in self._inflight:
            raise ValueError(f"sent: target {sent.seq} is not in flight")
        return self.seg.req_views(self.rank, sent.counter % self.layout.depth)[1][:sent.num_tokens]

    def recv(self, sent: _Sent) -> torch.Tensor:
        if not self._inflight or self._inflight[0] is not sent:
            raise ValueError("sent: expected the oldest outstanding target (replies arrive in send order)")
        self._inflight.pop(0)
        lay, seg = self.layout, self.seg
        d = sent.counter % lay.depth
        k = lay.top_k if lay.exact else 1
        deadline = time.monotonic() + self.timeout_s
        if (self._plane is not None and self._pinned and not lay.exact
                and sent.num_tokens >= self.device_combine_min_tokens):
            return self._combine_on_device(sent, d, deadline)
        if self._plane is not None:
            # exact: every pair's row, summed below as vLLM sums them; else partial sums per token
            # page-locked on a GPU end: the copy to the device (``_finish``) is then non-blocking
            out = torch.empty(sent.num_tokens * k, lay.hidden, dtype=lay.torch_dtype if lay.exact else torch.float32,
                              pin_memory=self.device.type == "cuda")
            t = sent.target
            rows = self._plane.combine(self.rank, sent.counter, sent.seq, t.step, t.layer, t.microbatch, sent.num_tokens,
                                       out.data_ptr(), deadline, self.poll_s, self.spin_s)
            self.bytes_received += rows * (self._row_bytes + 4)
            return out if self._sums_as_is else self._finish(out, sent.num_tokens, k)
        out = torch.zeros(sent.num_tokens * k, lay.hidden, dtype=lay.torch_dtype if lay.exact else torch.float32)
        for f in range(lay.num_ffn):
            index = (f * lay.num_attention + self.rank) * lay.depth + d
            _wait_word(seg, "rep_ready", index, _word(sent.counter), deadline, self.poll_s, [lay.num_attention + f],
                       f"reply to seq {sent.seq} from FFN worker {f}")
            head = seg.rep_head[f, self.rank, d]
            if not (head[0] == head[6] == sent.counter) or tuple(head[1:5]) != (sent.seq, sent.target.step,
                                                                               sent.target.layer, sent.target.microbatch):
                raise ValueError(f"reply from FFN worker {f}: expected seq {sent.seq} {sent.target} (message {sent.counter}), "
                                 f"got header {head.tolist()} (torn or stale slot)")
            rows = int(head[5])
            if rows:
                data, token = seg.rep_views(f, self.rank, d)
                if lay.exact:
                    out[token[:rows].long()] = data[:rows]
                else:
                    out.index_add_(0, token[:rows].long(), data[:rows].float())
                self.bytes_received += rows * (lay.hidden * data.element_size() + 4)
        return self._finish(out, sent.num_tokens, k)

    def _combine_on_device(self, sent: _Sent, d: int, deadline: float) -> torch.Tensor:
        """``recv`` of a large target on a GPU end: each reply's rows go to the device as they are
        (bf16: half the bytes of the host path's fp32 sums) by a non-blocking copy from the pinned
        slot, and are added there in FFN-rank order, ``zeros().index_add_`` as the host path adds
        them: the same bits (a reply holds a token at most once, so no two adds of one call meet).
        The host sums F replies on one core instead (4 ms at 1024 tokens x 2048 on an H100 host,
        bench/results/ab_gpu_h100_s25_*). The slots are read by the copies after this returns:
        ``send`` waits for them before it publishes the message that reuses slot ``d``."""
        lay, seg, t = self.layout, self.seg, sent.target
        out = torch.zeros(sent.num_tokens, lay.hidden, dtype=torch.float32, device=self.device)
        for f in range(lay.num_ffn):
            rows = self._plane.wait_reply(self.rank, f, sent.counter, sent.seq, t.step, t.layer, t.microbatch, deadline,
                                          self.poll_s, self.spin_s)
            if not rows:
                continue
            data, token = seg.rep_views(f, self.rank, d)
            tok = token[:rows].numpy()  # checked on the host: an index out of range would be a device assert
            low, high = int(tok.min()), int(tok.max())
            if low < 0 or high >= sent.num_tokens:
                raise ValueError(f"reply from FFN worker {f} to seq {sent.seq}: token index {low if low < 0 else high} "
                                 f"out of range [0, {sent.num_tokens})")
            index = token[:rows].to(self.device, non_blocking=True)
            out.index_add_(0, index, data[:rows].to(self.device, non_blocking=True).float())
            self.bytes_received += rows * (self._row_bytes + 4)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._slot_readers[d] = event
        return out.to(lay.torch_dtype)

    def _finish(self, out: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The routed-expert output [n, H] on this end's device from the combined replies ``out``."""
        lay = self.layout
        pinned = self.device.type == "cuda"  # ``recv`` made ``out`` page-locked
        if lay.exact:
            from afore.ffn.exact import pair_sum

            return pair_sum(out.to(self.device, non_blocking=pinned).view(n, k, lay.hidden))
        return out.to(device=self.device, non_blocking=pinned).to(lay.torch_dtype)

    def exchange(self, target: Target, seq: int, hidden, topk_ids, topk_weights) -> torch.Tensor:
        return self.recv(self.send(target, seq, hidden, topk_ids, topk_weights))

    def close(self) -> None:
        self._plane = None  # it addresses the mapping that seg.close() unmaps
        self.seg.close()


class ShmFFNEnd:
    """FFN worker ``rank``'s end: ``recv`` the next target (routing of all A senders, hidden rows
    read lazily: ``Microbatch.gather_rows``), ``agree`` on its plan with the other FFN workers,
    ``send`` partial sums for the tokens this worker computed. ``native=False``: the Python
    reference path instead of the C++ one; ``spin_s`` as ``ShmAttentionEnd``'s."""

    def __init__(self, name: str, layout: ShmLayout, rank: int, device: torch.device | str = "cpu",
                 timeout_s: float = 60.0, poll_s: float = 0.2, native: bool = True, spin_s: float = 0.0) -> None:
        if not 0 <= rank < layout.num_ffn:
            raise ValueError(f"rank: expected in [0, {layout.num_ffn}), got {rank}")
        self.layout, self.ffn_rank, self.timeout_s, self.poll_s = layout, rank, timeout_s, poll_s
        _attach_end(self, name, layout, device, timeout_s, native, spin_s)
        self.seg.pids[layout.num_attention + rank] = os.getpid()
        self._counter = 0          # next message counter (the same for every attention worker)
        self._peeked: Microbatch | None = None
        self._votes = 0
        self._posted: tuple[int, bool, int] | None = None  # (round, flag, digest) of a vote() not yet tallied
        self.diverged = 0          # rounds where every worker voted yes for different plans (digests)
        self.last_diverged = False
        self.bytes_received = 0
        self.bytes_sent = 0
        self.store = None  # no TCPStore: GPU peers use CUDA IPC handles exchanged elsewhere

    @property
    def sends_device_rows(self) -> bool:
        """``send`` takes partials on the device and copies them into the reply slots itself (a GPU
        end of a page-locked segment, sums per token): the step need not bring them back first."""
        return bool(self._pinned) and not self.layout.exact

    @property
    def queued(self) -> int:
        """Targets published and not yet received (0..depth)."""
        return int(self._ready(self._counter, block=False)) + (self._peeked is not None)

    def _ready(self, c: int, block: bool, deadline: float = float("inf")) -> bool:
        if self._plane is not None:
            if block:
                self._plane.wait_requests(c, deadline, self.poll_s, self.spin_s)
                return True
            return self._plane.requests_ready(c)
        lay, seg = self.layout, self.seg
        d = c % lay.depth
        for a in range(lay.num_attention):
            if not block:
                if int(seg.req_ready[a, d]) != _word(c):
                    return False
                continue
            _wait_word(seg, "req_ready", a * lay.depth + d, _word(c), deadline, self.poll_s, [],
                       f"request {c} from attention worker {a}")
        return True

    def _read(self, c: int) -> Microbatch:
        if self._plane is not None:
            return self._read_native(c)
        lay, seg = self.layout, self.seg
        d = c % lay.depth
        key, splits, ids, weights, views = None, [], [], [], []
        for a in range(lay.num_attention):
            head = seg.req_head[a, d]
            if not head[0] == head[6] == c:
                raise ValueError(f"request from attention worker {a}: expected message {c}, got header {head.tolist()} "
                                 f"(torn or stale slot)")
            seq, step, layer, mb, n = (int(x) for x in head[1:6])
            if not 0 <= n <= lay.max_tokens:
                raise ValueError(f"request from attention worker {a}: num_tokens: expected in [0, {lay.max_tokens}], got {n}")
            if key is None:
                key = (seq, Target(step, layer, mb))
            elif key != (seq, Target(step, layer, mb)):
                raise ValueError(f"request from attention worker {a}: target: expected seq {key[0]} {key[1]} "
                                 f"(as attention worker 0), got seq {seq} {Target(step, layer, mb)}")
            h, i, w = seg.req_views(a, d)
            splits.append(n)
            views.append(h[:n])
            ids.append(i[:n])
            weights.append(w[:n])
        # ids and weights of every sender are read whole (every worker partitions the same gathered
        # routing, eq. 11); hidden rows stay in shared memory until gather_rows
        # the routing stays on the host on every device: GPU workers route there (FFNLayer.forward_host_routed)
        topk_ids = ids[0] if len(ids) == 1 else torch.cat(ids)
        topk_weights = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.bytes_received += sum(splits) * lay.top_k * 8
        return Microbatch(key[1], key[0], None, topk_ids, topk_weights, splits, time.perf_counter(), None,
                          source=_ShmRows(self, views), counter=c)

    def _read_native(self, c: int) -> Microbatch:
        """``_read`` with the headers checked in C++ and the slot views cached; ids and weights of
        several senders concatenated by one copy each."""
        lay, seg = self.layout, self.seg
        seq, step, layer, mb, splits = self._plane.read_request(c)
        d = c % lay.depth
        prefixes = [seg.req_prefix(a, d, n) for a, n in enumerate(splits)]
        if lay.num_attention == 1:
            host_ids, weights = prefixes[0][1], prefixes[0][2]
        else:
            total = sum(splits)
            host_ids = torch.empty(total, lay.top_k, dtype=torch.int32)
            weights = torch.empty(total, lay.top_k, dtype=torch.float32)
            self._plane.gather_routing(c, splits, host_ids.data_ptr(), weights.data_ptr())
        self.bytes_received += sum(splits) * lay.top_k * 8
        return Microbatch(Target(step, layer, mb), seq, None, host_ids, weights, splits, time.perf_counter(), None,
                          source=_ShmRows(self, [p[0] for p in prefixes], c, splits), counter=c)

    def recv(self, timeout_s: float | None = None) -> Microbatch | None:
        """The next target, or None after ``timeout_s`` (None: wait forever)."""
        if self._peeked is not None:
            mb, self._peeked = self._peeked, None
            self._counter += 1
            return mb
        deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s
        try:
            self._ready(self._counter, True, deadline)
        except TimeoutError:
            return None
        mb = self._read(self._counter)
        self._counter += 1
        return mb

    def peek(self) -> Microbatch | None:
        """The target after the current one if every sender already published it (no wait)."""
        if self._peeked is None and self._ready(self._counter, block=False):
            self._peeked = self._read(self._counter)
        return self._peeked

    def vote(self, flag: bool, digest: int = 0) -> None:
        """Post this worker's vote for the next ``agree`` early (the step does it before its
        compute): the others then find it there when they tally after theirs, without sleeping
        on it. ``agree(flag, digest)`` must follow with the same values; it stores them again."""
        lay, seg = self.layout, self.seg
        if lay.num_ffn == 1:
            return
        v = self._votes
        slot = v % 2
        # round v's word may replace this worker's round v - 2 vote: everyone has tallied that one,
        # since this worker's agree(v - 1) returned, which needs every worker's round v - 1 vote,
        # posted only after its own agree(v - 2) returned. The digest first, the word after it
        # (x86 keeps stores in order): a reader that sees the word sees its digest.
        seg.digests[self.ffn_rank, slot] = int(digest)
        seg.votes[self.ffn_rank, slot] = (((v % 0x3FFFFFFE) + 1) << 1) | int(bool(flag))
        _futex_wake(seg.addr("votes", self.ffn_rank * 2 + slot, 4))
        self._posted = (v, bool(flag), int(digest))

    def agree(self, flag: bool, digest: int = 0) -> bool:
        """True only if every FFN worker passes True for this target and the same ``digest`` (of
        the plan it would apply: ``afore.plan.plan_digest``): a barrier over the votes in shared
        memory, the same decision on every worker (DESIGN.md invariant 3, checked rather than
        assumed). ``last_diverged``: every worker voted yes but for different plans (counted in
        ``diverged``)."""
        lay, seg = self.layout, self.seg
        self.last_diverged = False
        if lay.num_ffn == 1:
            return flag
        v = self._votes
        self._votes += 1
        posted, self._posted = self._posted, None
        if posted is not None and posted != (v, bool(flag), int(digest)):
            raise ValueError(f"agree: voted {posted[1:]} on round {posted[0]} with vote(), now "
                             f"{(bool(flag), int(digest))} on round {v}")
        if self._plane is not None:
            outcome = self._plane.agree(self.ffn_rank, v, bool(flag), int(digest), float(self.timeout_s), self.poll_s,
                                        self.spin_s, str(self.timeout_s))
            return self._tallied(outcome)
        word = ((v % 0x3FFFFFFE) + 1) << 1
        slot = v % 2
        seg.digests[self.ffn_rank, slot] = int(digest)
        seg.votes[self.ffn_rank, slot] = word | int(bool(flag))
        _futex_wake(seg.addr("votes", self.ffn_rank * 2 + slot, 4))
        deadline = time.monotonic() + self.timeout_s
        result, same = bool(flag), True
        for g in range(lay.num_ffn):
            if g == self.ffn_rank:
                continue
            index = g * 2 + slot
            while True:
                # one read serves the test and the futex's expected value: a vote stored between two
                # reads would leave the wait sleeping on the new value until poll_s (a lost wake-up)
                cur = int(seg.votes[g, slot])
                if (cur >> 1) << 1 == word:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"agree: FFN worker {g} did not vote on target {v} within {self.timeout_s} s")
                _futex_wait(seg.addr("votes", index, 4), cur, self.poll_s)
                pid = int(seg.pids[lay.num_attention + g])
                if pid and not pid_alive(pid):
                    raise PeerGone(f"agree: FFN worker {g} (pid {pid}) exited")
            result = result and bool(cur & 1)
            same = same and int(seg.digests[g, slot]) == int(digest)
        return self._tallied(AGREED if result and same else DIVERGED if result else VETOED)

    def _tallied(self, outcome: int) -> bool:
        self.last_diverged = outcome == DIVERGED
        self.diverged += self.last_diverged
        return outcome == AGREED

    def send(self, mb: Microbatch, partial: ReplyRows) -> None:
        """Reply to every attention worker with this worker's partial sums of its tokens (an empty
        reply where it computed none of them): ``partial.rows [U, H]`` for gathered token indices
        ``partial.tokens int64 [U]`` (ascending). ``exact`` layouts: a row per pair, ``tokens``
        holding gathered pair indices t * k + j (``FFNLayer.forward_pairs``)."""
        lay, seg = self.layout, self.seg
        rows, tokens = partial.rows, partial.tokens
        shape = rows.shape
        if len(shape) != 2 or shape[1] != lay.hidden or tokens.shape != shape[:1]:
            raise ValueError(f"partial: expected rows [U, {lay.hidden}] for tokens [U], got rows "
                             f"{tuple(rows.shape)}, tokens {tuple(tokens.shape)}")
        if rows.is_cuda and self._pinned and not lay.exact and rows.dtype == self._dtype:
            self._send_in_place(mb, _host(tokens, torch.int64), rows)
            return
        if self._plane is not None:  # CUDA partials are staged through host memory, as below
            tokens, rows = _host(tokens, torch.int64), _host(rows, self._dtype)
            t = mb.target
            written = self._plane.send_replies(self.ffn_rank, mb.counter, mb.seq, t.step, t.layer, t.microbatch, mb.splits,
                                               tokens.data_ptr(), shape[0], rows.data_ptr())
            self.bytes_sent += written * (self._row_bytes + 4)
            return
        tokens = partial.tokens.to("cpu")
        rows = partial.rows.to(device="cpu", dtype=lay.torch_dtype)
        bounds, cut = self._reply_cut(mb, tokens)
        self._publish_replies(mb, tokens, bounds, cut, rows)

    def _reply_cut(self, mb: Microbatch, tokens: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(bounds, cut) of a reply's host ``tokens``: attention worker a's gathered indices
        start at bounds[a], its rows are [cut[a], cut[a + 1]); refuses indices that are not
        ascending in range."""
        lay = self.layout
        bounds = torch.tensor([0] + list(np.cumsum(mb.splits)), dtype=torch.int64) * (lay.top_k if lay.exact else 1)
        if tokens.numel() and (int(tokens[0]) < 0 or int(tokens[-1]) >= int(bounds[-1]) or bool((tokens[1:] < tokens[:-1]).any())):
            raise ValueError(f"partial.tokens: expected ascending gathered {'pair' if lay.exact else 'token'} indices in "
                             f"[0, {int(bounds[-1])}), got {tokens.tolist()}")
        return bounds, torch.searchsorted(tokens, bounds).tolist()

    def _publish_replies(self, mb: Microbatch, tokens: torch.Tensor, bounds: torch.Tensor, cut: list[int],
                         rows: torch.Tensor | None) -> None:
        """The Python path's reply to every attention worker: its rows (unless ``rows`` is None:
        already in the slots), token indices and header, then the ready word and the wake-up."""
        lay, seg = self.layout, self.seg
        d = mb.counter % lay.depth
        for a in range(lay.num_attention):
            lo, hi = cut[a], cut[a + 1]
            k = hi - lo
            head = seg.rep_head[self.ffn_rank, a, d]
            head[0] = mb.counter
            if k:
                data, token = seg.rep_views(self.ffn_rank, a, d)
                if rows is not None:
                    data[:k].copy_(rows[lo:hi])
                token[:k].copy_(tokens[lo:hi] - int(bounds[a]))
                self.bytes_sent += k * (self._row_bytes + 4)
            head[1:6] = (mb.seq, mb.target.step, mb.target.layer, mb.target.microbatch, k)
            head[6] = mb.counter
            seg.rep_ready[self.ffn_rank, a, d] = _word(mb.counter)
            _futex_wake(seg.addr("rep_ready", (self.ffn_rank * lay.num_attention + a) * lay.depth + d, 4))

    def _send_in_place(self, mb: Microbatch, tokens: torch.Tensor, rows: torch.Tensor) -> None:
        """``send`` of rows on the device (or of host rows, the same path): each attention worker's
        share copied straight into its reply slot (non-blocking from a GPU into the page-locked
        segment: no staging buffer, no host copy), the current stream waited for once (the
        step's input copies from the request slots are done then too), then the headers and token
        indices published (``DataPlane.send_replies`` without rows, or the Python path)."""
        lay = self.layout
        bounds, cut = self._reply_cut(mb, tokens)
        d = mb.counter % lay.depth
        for a in range(lay.num_attention):
            lo, hi = cut[a], cut[a + 1]
            if hi - lo > lay.reply_rows:
                raise ValueError(f"partial.tokens: {hi - lo} rows for attention worker {a}, a reply slot holds "
                                 f"{lay.reply_rows}")
            if hi > lo:
                self.seg.rep_views(self.ffn_rank, a, d)[0][:hi - lo].copy_(rows[lo:hi], non_blocking=rows.is_cuda)
        if rows.is_cuda:
            torch.cuda.current_stream(rows.device).synchronize()
        if self._plane is None:
            self._publish_replies(mb, tokens, bounds, cut, None)
            return
        t = mb.target
        written = self._plane.send_replies(self.ffn_rank, mb.counter, mb.seq, t.step, t.layer, t.microbatch,
                                           mb.splits, tokens.data_ptr(), tokens.shape[0], 0)
        self.bytes_sent += written * (self._row_bytes + 4)

    def close(self) -> None:
        self._peeked = None
        self._plane = None
        self.seg.close()


class _ShmRows:
    """Lazy hidden rows of one target: views into the A request slots (``counter`` and ``splits``:
    the message, for the C++ gather)."""

    def __init__(self, end: ShmFFNEnd, views: list[torch.Tensor], counter: int | None = None,
                 splits: list[int] | None = None) -> None:
        self.end, self.views, self.counter, self.splits = end, views, counter, splits
        # on the CPU one sender's slot is handed out as it is; a GPU worker copies only its rows over
        self.zero_copy = end.device.type == "cpu"
        # a GPU end of a page-locked segment copies whole slots to the device by DMA (``copy_to``)
        self.device_copies = bool(getattr(end, "_pinned", False))

    def copy_to(self, dst: torch.Tensor) -> None:
        """Every row of the target, in sender order, into ``dst`` [N, H] (the layout's dtype) by
        one copy per sender, non-blocking on the current stream when ``dst`` is on a GPU and the
        segment is page-locked (``device_copies``): the DMA engine reads the slots, no host core
        gathers. The slots stay valid until this worker replies, and ``ShmFFNEnd.send`` of device
        rows waits for the stream first, so the copies are done before a sender may reuse them."""
        lay = self.end.layout
        n = sum(v.shape[0] for v in self.views)
        if dst.shape != (n, lay.hidden) or dst.dtype != lay.torch_dtype:
            raise ValueError(f"dst: expected [{n}, {lay.hidden}] of {lay.torch_dtype}, got {tuple(dst.shape)} {dst.dtype}")
        lo = 0
        for v in self.views:
            dst[lo:lo + v.shape[0]].copy_(v, non_blocking=self.device_copies and dst.is_cuda)
            lo += v.shape[0]
        self.end.bytes_received += dst.numel() * dst.element_size()

    def gather(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden rows [U, H] of gathered token indices ``tokens`` (int64, ascending)."""
        plane = self.end._plane
        if plane is not None and self.counter is not None:
            t = _host(tokens, torch.int64)
            out = torch.empty(t.shape[0], self.end.layout.hidden, dtype=self.end.layout.torch_dtype)
            plane.gather_rows(self.counter, self.splits, t.data_ptr(), t.shape[0], out.data_ptr())
        elif len(self.views) == 1:
            out = self.views[0].index_select(0, tokens.to("cpu"))
        else:
            offsets = torch.tensor([0] + list(np.cumsum([v.shape[0] for v in self.views])), dtype=torch.int64)
            t = tokens.to("cpu")
            cut = torch.searchsorted(t, offsets).tolist()
            out = torch.cat([v.index_select(0, t[cut[a]:cut[a + 1]] - offsets[a]) for a, v in enumerate(self.views)])
        self.end.bytes_received += out.numel() * out.element_size()
        return out.to(self.end.device)

    def gather_into(self, tokens: torch.Tensor, out: torch.Tensor) -> None:
        """Write the hidden rows of gathered token indices ``tokens`` (int64 [U] on the host,
        ascending) into the contiguous host tensor ``out`` [U, H] of the layout's dtype (e.g. a
        pinned staging buffer)."""
        lay = self.end.layout
        if out.shape != (tokens.shape[0], lay.hidden) or out.dtype != lay.torch_dtype or not out.is_cpu \
                or not out.is_contiguous():
            raise ValueError(f"out: expected a contiguous host tensor [{tokens.shape[0]}, {lay.hidden}] of "
                             f"{lay.torch_dtype}, got {tuple(out.shape)} {out.dtype} on {out.device}")
        plane = self.end._plane
        if plane is not None and self.counter is not None:
            t = _host(tokens, torch.int64)
            plane.gather_rows(self.counter, self.splits, t.data_ptr(), t.shape[0], out.data_ptr())
        elif len(self.views) == 1:
            torch.index_select(self.views[0], 0, tokens, out=out)
        else:
            offsets = torch.tensor([0] + list(np.cumsum([v.shape[0] for v in self.views])), dtype=torch.int64)
            cut = torch.searchsorted(tokens, offsets).tolist()
            for a, v in enumerate(self.views):
                torch.index_select(v, 0, tokens[cut[a]:cut[a + 1]] - offsets[a], out=out[cut[a]:cut[a + 1]])
        self.end.bytes_received += out.numel() * out.element_size()

    def view_for(self, tokens: torch.Tensor) -> torch.Tensor:
        """One sender: its whole slot [N, H] as a view (no copy); the expert kernel reads only the
        rows of ``tokens``, which are what this counts as read."""
        view = self.views[0]
        self.end.bytes_received += int(tokens.numel()) * view.shape[1] * view.element_size()
        return view

    def dense(self) -> torch.Tensor:
        """Every row [N, H] (the reference path and tests)."""
        out = self.views[0] if len(self.views) == 1 else torch.cat(self.views)
        return out.to(self.end.device)
