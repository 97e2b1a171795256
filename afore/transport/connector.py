"""A2F / F2A connector over ``torch.distributed``, in afore's own process groups.

Topology: A attention workers (ranks 0..A-1) and F FFN workers (ranks A..A+F-1) meet at one
TCPStore; every process builds its process groups directly from it
(``ProcessGroupGloo`` / ``ProcessGroupNCCL`` objects over a ``PrefixStore``), so nothing here
touches the default group or vLLM's groups. A and F are independent (F > A works).

Groups: ``a2f`` (all A+F ranks; request payloads), ``f2a`` (all A+F ranks; reply payloads) and
``ffn`` (the F FFN workers; the combine) use the configured backend; ``a2f_ctl`` / ``f2a_ctl``
carry the headers over gloo on the host. Separate request and reply groups let the FFN side
receive target t+1 on its receive thread while the model thread replies to target t; headers on
the host mean a GPU receive is posted only once its sender committed to the message, so no NCCL
receive kernel sits pending on the GPU (which could block other communicators' kernels).

Attention side (the vLLM plugin's whole API; one object per attention worker)::

    conn = AttentionConnector(TransportConfig(...), attn_rank)
    out = conn.exchange(target, seq, hidden, topk_ids, topk_weights)     # [n, H] combined output
    # or, two microbatches in flight:
    h0 = conn.send(t0, s0, ...); h1 = conn.send(t1, s1, ...); out0 = conn.recv(h0); out1 = conn.recv(h1)
    conn.close()

``hidden`` [n, H] in the configured dtype, ``topk_ids`` int32 [n, k], ``topk_weights`` fp32
[n, k]; n may differ per attention worker and may be 0. Replies arrive in send order.

FFN side: ``FFNConnector.recv()`` returns the next target's ``Microbatch``, gathered from all A
attention workers in attention-rank order (a background thread keeps up to ``depth`` targets
queued: the lookahead); ``FFNConnector.send(mb, partial)`` sums the F workers' partial outputs
(all-reduce over ``ffn``) and sends attention worker a its rows from FFN worker a % F.

Wire format per message: an int64 header [magic, seq, step, layer, microbatch, n, H, k, dtype]
on the control group, then, when n > 0, hidden, ids and weights on the data group (replies:
the output). Every pair exchanges one token on each group at connect (``_handshake``), so NCCL
creates its pair communicators before any traffic. A header that does
not match the configuration (hidden size, top_k, dtype, or a target that differs between the
attention workers) raises ``ValueError`` naming the field.

Failures: every operation but one waits at most ``timeout_s`` (gloo/NCCL group timeout) and a
peer that exits makes the pending operation raise at once (gloo: "Connection closed by peer"),
so the attention side fails a forward instead of hanging. The one exception is the FFN side's
wait for the next request header, which is the idle state of a server and never times out.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue
import threading
import time
import torch
import torch.distributed as dist

from afore.plan import Target
from afore.transport.base import Microbatch, ReplyRows
from afore.transport.network import listen_fd

MAGIC = 0xAF0E
HEADER_LEN = 9
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """Everything both sides must agree on. ``backend``: gloo (CPU tensors) or nccl (CUDA)."""

    host: str
    port: int
    num_attention: int
    num_ffn: int
    hidden: int
    top_k: int
    dtype: torch.dtype = torch.float32
    backend: str = "gloo"
    timeout_s: float = 300.0
    depth: int = 2          # targets the FFN side may hold ahead (>= 2: the lookahead window)
    max_tokens: int = 1 << 20
    store_on_rank0: bool = True  # attention rank 0 hosts the TCPStore; False: it runs elsewhere
                                 # (``afore serve --role ffn`` hosts it), every rank is a client

    def __post_init__(self) -> None:
        for name in ("num_attention", "num_ffn", "hidden", "top_k", "depth", "max_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: expected 'gloo' or 'nccl', got {self.backend!r}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype: expected one of {list(DTYPE_CODES)}, got {self.dtype}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: expected in [1, 65535], got {self.port}")

    @property
    def world_size(self) -> int:
        return self.num_attention + self.num_ffn


@dataclasses.dataclass
class _Pending:
    """Handle of one sent target, for ``AttentionConnector.recv``."""

    target: Target
    seq: int
    num_tokens: int
    works: list


def _store(cfg: TransportConfig, rank: int) -> dist.TCPStore:
    if cfg.store_on_rank0 and rank == 0:
        return host_store(cfg.host, cfg.port, cfg.timeout_s)
    return dist.TCPStore(cfg.host, cfg.port, world_size=None, is_master=False,
                         timeout=datetime.timedelta(seconds=cfg.timeout_s), wait_for_workers=False)


def host_store(host: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """The transport's TCPStore server, listening on ``host:port`` only (every interface for a
    wildcard host: ``afore.transport.network``); keep the returned object alive as long as the
    ranks may connect. It has no authentication: a trusted network only (docs/deploy.md)."""
    return dist.TCPStore(host, port, world_size=None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listen_fd(host, port))


def ffn_ready_key(ffn_rank: int) -> str:
    """Store key an FFN worker sets once its experts are loaded, just before it joins the groups."""
    return f"afore/transport/ffn-ready/{ffn_rank}"


def wait_for_ffn(host: str, port: int, num_ffn: int, timeout_s: float) -> None:
    """Block until all ``num_ffn`` FFN workers behind the store at host:port have loaded their
    experts (``afore serve --role attention`` waits so before it starts vLLM); TimeoutError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    store = None
    while store is None:
        try:
            store = dist.TCPStore(host, port, world_size=None, is_master=False, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=max(1.0, min(10.0, deadline - time.monotonic()))))
        except (RuntimeError, OSError) as exc:  # the FFN node is not listening yet
            if time.monotonic() >= deadline:
                raise TimeoutError(f"transport store {host}:{port} unreachable after {timeout_s:.0f} s: {exc}") from exc
            time.sleep(1.0)
    keys = [ffn_ready_key(w) for w in range(num_ffn)]
    while not store.check(keys):
        if time.monotonic() >= deadline:
            ready = sum(store.check([k]) for k in keys)
            raise TimeoutError(f"{ready} of {num_ffn} FFN workers ready at {host}:{port} after {timeout_s:.0f} s")
        time.sleep(0.5)


# The FFN side waits for the next request on the control group for as long as the server is idle:
# that wait must not time out (gloo applies a group's timeout to every receive), while a dead peer
# still ends it at once (gloo reports the closed connection).
IDLE_TIMEOUT = datetime.timedelta(days=365)


def _group(cfg: TransportConfig, store: dist.Store, name: str, rank: int, size: int, device: torch.device,
           backend: str | None = None, timeout: datetime.timedelta | None = None):
    prefixed = dist.PrefixStore(f"afore/transport/{name}", store)
    timeout = timeout or datetime.timedelta(seconds=cfg.timeout_s)
    if (backend or cfg.backend) == "gloo":
        from afore.transport.gloo import gloo_group

        return gloo_group(prefixed, rank, size, timeout)
    from afore.transport.nccl import nccl_group

    return nccl_group(prefixed, rank, size, timeout, device)


def _header(seq: int, target: Target, n: int, cfg: TransportConfig) -> torch.Tensor:
    return torch.tensor([MAGIC, seq, target.step, target.layer, target.microbatch, n, cfg.hidden, cfg.top_k,
                         DTYPE_CODES[cfg.dtype]], dtype=torch.int64)


def check_header(header: torch.Tensor, cfg: TransportConfig, source: str) -> tuple[int, Target, int]:
    """(seq, target, n) of a received header; ValueError naming the field on any mismatch."""
    h = header.tolist()
    if len(h) != HEADER_LEN or h[0] != MAGIC:
        raise ValueError(f"{source}: header.magic: expected {MAGIC:#x}, got {h[0] if h else None!r} (not an afore transport message)")
    _, seq, step, layer, mb, n, hidden, k, code = h
    if hidden != cfg.hidden:
        raise ValueError(f"{source}: hidden: expected size {cfg.hidden}, got {hidden}")
    if k != cfg.top_k:
        raise ValueError(f"{source}: top_k: expected {cfg.top_k}, got {k}")
    if code != DTYPE_CODES[cfg.dtype]:
        raise ValueError(f"{source}: dtype: expected {cfg.dtype}, got {CODE_DTYPES.get(code, code)}")
    if not 0 <= n <= cfg.max_tokens:
        raise ValueError(f"{source}: num_tokens: expected in [0, {cfg.max_tokens}], got {n}")
    if seq < 0 or min(step, layer, mb) < 0:
        raise ValueError(f"{source}: target: expected non-negative seq/step/layer/microbatch, got {h[1:5]}")
    return seq, Target(step, layer, mb), n


def check_inputs(cfg: TransportConfig, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
    """Validate one attention worker's tensors; returns n."""
    if hidden.dim() != 2 or hidden.shape[1] != cfg.hidden:
        raise ValueError(f"hidden: expected shape [n, {cfg.hidden}], got {tuple(hidden.shape)}")
    if hidden.dtype != cfg.dtype:
        raise ValueError(f"hidden: expected dtype {cfg.dtype}, got {hidden.dtype}")
    n = hidden.shape[0]
    if tuple(topk_ids.shape) != (n, cfg.top_k) or topk_ids.dtype != torch.int32:
        raise ValueError(f"topk_ids: expected int32 [{n}, {cfg.top_k}], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != (n, cfg.top_k) or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights: expected float32 [{n}, {cfg.top_k}], got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    if n > cfg.max_tokens:
        raise ValueError(f"hidden: expected at most {cfg.max_tokens} tokens, got {n}")
    return n


class AttentionConnector:
    """Attention worker ``attn_rank``'s end: send a target's tokens, receive their combined output."""

    def __init__(self, cfg: TransportConfig, attn_rank: int, device: torch.device | str = "cpu") -> None:
        if not 0 <= attn_rank < cfg.num_attention:
            raise ValueError(f"attn_rank: expected in [0, {cfg.num_attention}), got {attn_rank}")
        self.cfg = cfg
        self.rank = attn_rank
        self.device = torch.device(device)
        # gloo moves CPU tensors (staged from/to the caller's device); NCCL moves CUDA tensors
        self.wire = torch.device("cpu") if cfg.backend == "gloo" else self.device
        self.store = _store(cfg, attn_rank)
        self.a2f = _group(cfg, self.store, "a2f", attn_rank, cfg.world_size, self.device)
        self.f2a = _group(cfg, self.store, "f2a", attn_rank, cfg.world_size, self.device)
        self.a2f_ctl = _group(cfg, self.store, "a2f_ctl", attn_rank, cfg.world_size, self.device, "gloo")
        self.f2a_ctl = _group(cfg, self.store, "f2a_ctl", attn_rank, cfg.world_size, self.device, "gloo")
        self.replier = cfg.num_attention + attn_rank % cfg.num_ffn
        self._pending: list[_Pending] = []
        self._handshake()

    def _handshake(self) -> None:
        """One tiny message on every pair this worker uses, before any real traffic: NCCL creates
        a pair's communicator on its first send/recv, and creating one while another receive is
        pending on the GPU can deadlock; it also proves the peers are reachable."""
        for group, dev in ((self.a2f_ctl, "cpu"), (self.a2f, self.wire)):
            token = torch.zeros(1, dtype=torch.int64, device=dev)
            works = [group.send([token], self.cfg.num_attention + f, 0) for f in range(self.cfg.num_ffn)]
            for w in works:
                w.wait()
        for group, dev in ((self.f2a_ctl, "cpu"), (self.f2a, self.wire)):
            reply = torch.empty(1, dtype=torch.int64, device=dev)
            group.recv([reply], self.replier, 0).wait()

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.wire).contiguous()

    def send(self, target: Target, seq: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor) -> _Pending:
        """Post one target's tokens to every FFN worker (non-blocking); returns the handle for ``recv``."""
        n = check_inputs(self.cfg, hidden, topk_ids, topk_weights)
        header = _header(seq, target, n, self.cfg)  # control plane: CPU, gloo
        parts = [self._dev(hidden), self._dev(topk_ids), self._dev(topk_weights)] if n else []
        works = []
        for f in range(self.cfg.num_ffn):
            works.append(self.a2f_ctl.send([header], self.cfg.num_attention + f, 0))
            for t in parts:
                works.append(self.a2f.send([t], self.cfg.num_attention + f, 0))
        parts.append(header)
        pending = _Pending(target, seq, n, works + [parts])  # keep the buffers alive until sent
        self._pending.append(pending)
        return pending

    def recv(self, pending: _Pending) -> torch.Tensor:
        """The combined output [n, H] of ``pending`` (replies come in send order)."""
        if not self._pending or self._pending[0] is not pending:
            raise ValueError("pending: expected the oldest outstanding exchange (replies arrive in send order)")
        self._pending.pop(0)
        for w in pending.works[:-1]:
            w.wait()
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.f2a_ctl.recv([header], self.replier, 0).wait()
        seq, target, n = check_header(header, self.cfg, f"reply from FFN rank {self.replier}")
        if (seq, target, n) != (pending.seq, pending.target, pending.num_tokens):
            raise ValueError(f"reply: expected seq {pending.seq} {pending.target} with {pending.num_tokens} rows, got seq {seq} {target} with {n}")
        out = torch.empty(n, self.cfg.hidden, dtype=self.cfg.dtype, device=self.wire)
        if n:
            self.f2a.recv([out], self.replier, 0).wait()
        return out.to(self.device)

    def exchange(self, target: Target, seq: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        """send + recv: the combined routed-expert output [n, H] for these tokens."""
        return self.recv(self.send(target, seq, hidden, topk_ids, topk_weights))

    def close(self) -> None:
        for group in (self.a2f, self.f2a, self.a2f_ctl, self.f2a_ctl):
            _shutdown(group)


class FFNConnector:
    """FFN worker ``ffn_rank``'s end: gathered targets in, combined output back."""

    def __init__(self, cfg: TransportConfig, ffn_rank: int, device: torch.device | str = "cpu") -> None:
        if not 0 <= ffn_rank < cfg.num_ffn:
            raise ValueError(f"ffn_rank: expected in [0, {cfg.num_ffn}), got {ffn_rank}")
        self.cfg = cfg
        self.ffn_rank = ffn_rank
        self.rank = cfg.num_attention + ffn_rank
        self.device = torch.device(device)
        self.diverged = 0          # rounds where every worker voted yes for different plans (digests)
        self.last_diverged = False
        self.wire = torch.device("cpu") if cfg.backend == "gloo" else self.device
        self.store = _store(cfg, self.rank)
        self.store.set(ffn_ready_key(ffn_rank), "1")  # loaded and joining: the attention side may start
        self.a2f = _group(cfg, self.store, "a2f", self.rank, cfg.world_size, self.device)
        self.f2a = _group(cfg, self.store, "f2a", self.rank, cfg.world_size, self.device)
        self.ffn = _group(cfg, self.store, "ffn", ffn_rank, cfg.num_ffn, self.device)
        # requests' headers: waited for while idle, so no timeout (IDLE_TIMEOUT); everything else
        # (payloads, the combine, replies) uses cfg.timeout_s
        self.a2f_ctl = _group(cfg, self.store, "a2f_ctl", self.rank, cfg.world_size, self.device, "gloo", IDLE_TIMEOUT)
        self.f2a_ctl = _group(cfg, self.store, "f2a_ctl", self.rank, cfg.world_size, self.device, "gloo")
        self.my_attention = [a for a in range(cfg.num_attention) if a % cfg.num_ffn == ffn_rank]
        self._handshake()
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name=f"afore-a2f-recv-{ffn_rank}", daemon=True)
        self._thread.start()

    def _handshake(self) -> None:
        """The FFN end of ``AttentionConnector._handshake``, plus the FFN group's communicator."""
        for group, dev in ((self.a2f_ctl, "cpu"), (self.a2f, self.wire)):
            for a in range(self.cfg.num_attention):
                token = torch.empty(1, dtype=torch.int64, device=dev)
                group.recv([token], a, 0).wait()
        for group, dev in ((self.f2a_ctl, "cpu"), (self.f2a, self.wire)):
            token = torch.zeros(1, dtype=torch.int64, device=dev)
            works = [group.send([token], a, 0) for a in self.my_attention]
            for w in works:
                w.wait()
        if self.cfg.num_ffn > 1:
            self.ffn.allreduce([torch.zeros(1, dtype=torch.float32, device=self.wire)]).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -------------------------------------------------------------- receive thread

    def _receive_loop(self) -> None:
        # On a GPU the receive thread works on its own stream: a pending receive must never block
        # the model thread's stream (the legacy default stream would serialise them: deadlock).
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._recv_stream = torch.cuda.Stream(self.device)
            torch.cuda.set_stream(self._recv_stream)
        while not self._stop.is_set():
            try:
                item = self._receive_one()
            except BaseException as exc:  # handed to the model thread at recv()
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def _receive_one(self) -> Microbatch:
        cfg = self.cfg
        parts, key = [], None
        for a in range(cfg.num_attention):
            # The header travels on the CPU control group: a data receive is posted only once its
            # sender has committed to sending, so no GPU receive sits pending (NCCL would block
            # other communicators' kernels behind it).
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            self.a2f_ctl.recv([header], a, 0).wait()
            seq, target, n = check_header(header, cfg, f"request from attention rank {a}")
            if key is None:
                key = (seq, target)
            elif (seq, target) != key:
                raise ValueError(f"request from attention rank {a}: target: expected seq {key[0]} {key[1]} (as attention rank 0), got seq {seq} {target}")
            hidden = torch.empty(n, cfg.hidden, dtype=cfg.dtype, device=self.wire)
            ids = torch.empty(n, cfg.top_k, dtype=torch.int32, device=self.wire)
            weights = torch.empty(n, cfg.top_k, dtype=torch.float32, device=self.wire)
            if n:
                for t in (hidden, ids, weights):
                    self.a2f.recv([t], a, 0).wait()
            parts.append((hidden, ids, weights))
        cat = [torch.cat([p[i] for p in parts]).to(self.device) for i in range(3)]
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return Microbatch(key[1], key[0], *cat, [p[0].shape[0] for p in parts], time.perf_counter(), ready)

    # -------------------------------------------------------------- model thread

    def recv(self, timeout_s: float | None = None) -> Microbatch | None:
        """The next target's gathered inputs; None on timeout. Re-raises a receive error."""
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        if item.ready is not None:  # the model stream waits for the receive stream, not the host
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(item.ready)
            for t in (item.hidden, item.topk_ids, item.topk_weights):
                t.record_stream(stream)
        return item

    def peek(self) -> Microbatch | None:
        """The target queued after the current one, if it already arrived (for reading its plan early)."""
        with self._queue.mutex:
            for item in list(self._queue.queue):
                if isinstance(item, Microbatch):
                    return item
        return None

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def agree(self, flag: bool, digest: int = 0) -> bool:
        """True only if every FFN worker passes True and the same ``digest`` (of the plan it would
        apply, ``afore.plan.plan_digest``): one all-reduce MIN over the FFN group of (flag, digest,
        -digest). All workers must apply the same plan to a target, so one worker without it, or
        with another plan, means none use it. ``last_diverged``: all voted yes, for different plans."""
        self.last_diverged = False
        if self.cfg.num_ffn == 1:
            return flag
        t = torch.tensor([1 if flag else 0, int(digest), -int(digest)], dtype=torch.int64, device=self.wire)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.ffn.allreduce([t], opts).wait()
        all_yes, lo, neg_hi = (int(x) for x in t.tolist())
        same = lo == -neg_hi
        self.last_diverged = bool(all_yes) and not same
        self.diverged += self.last_diverged
        return bool(all_yes) and same

    def send(self, mb: Microbatch, partial: torch.Tensor) -> None:
        """Combine the F partial outputs of ``mb`` and reply to the attention workers this worker serves."""
        cfg = self.cfg
        n = sum(mb.splits)
        if isinstance(partial, ReplyRows):  # sparse rows: scattered back to [N, H] for the all-reduce
            dense = torch.zeros(n, cfg.hidden, dtype=partial.rows.dtype, device=partial.rows.device)
            dense[partial.tokens] = partial.rows
            partial = dense
        if tuple(partial.shape) != (n, cfg.hidden):
            raise ValueError(f"partial: expected shape [{n}, {cfg.hidden}], got {tuple(partial.shape)}")
        combined = partial.to(device=self.wire, dtype=cfg.dtype).contiguous()
        if cfg.num_ffn > 1 and n:
            self.ffn.allreduce([combined]).wait()
        starts = [0]
        for s in mb.splits:
            starts.append(starts[-1] + s)
        works = []
        keep = []
        for a in self.my_attention:
            rows = combined[starts[a]:starts[a + 1]].contiguous()
            header = _header(mb.seq, mb.target, rows.shape[0], cfg)
            keep += [header, rows]
            works.append(self.f2a_ctl.send([header], a, 0))
            if rows.shape[0]:
                works.append(self.f2a.send([rows], a, 0))
        for w in works:
            w.wait()

    def close(self) -> None:
        self._stop.set()
        for group in (self.a2f, self.f2a, self.ffn, self.a2f_ctl, self.f2a_ctl):
            _shutdown(group)


def _shutdown(group) -> None:
    # NCCL: abort, which cancels what is still pending (a shutdown waits for it, and the peer
    # may be gone); gloo: shutdown. The first call that works ends it.
    nccl = hasattr(dist, "ProcessGroupNCCL") and isinstance(group, dist.ProcessGroupNCCL)
    for name in (("abort", "shutdown") if nccl else ("shutdown", "abort")):
        fn = getattr(group, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception:
            continue
