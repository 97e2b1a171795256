"""Demand receiver: attention workers on other nodes -> the FFN node's DemandMailbox.

Shared memory never spans nodes, so a remote attention worker sends its DemandReport over TCP
to this receiver, which runs on the FFN node (in the scheduler service) and writes it into the
mailbox. Attention workers on the FFN node write the mailbox directly; both paths carry the
same ``DemandReport`` struct.

Protocol (asyncio TCP, TCP_NODELAY): every frame is a u32 little-endian length followed by a
msgspec msgpack message. The client's first frame is ``Hello(token, version, worker)``; the
server answers ``Welcome`` (ok, or the error) and closes on a bad token. Then the client streams
``DemandReport`` frames with no reply (demand is fire-and-forget; the FFN side survives a lost
report, invariant 5). Frames longer than ``max_frame`` bytes close the connection (the stream
cannot be trusted any more); malformed messages and reports the mailbox rejects are counted
and dropped, and the connection stays up: nothing else is lost.

Hostile or broken clients cannot starve the others:

- at most ``max_unauthenticated`` connections may be waiting for their Hello, each at most
  ``hello_timeout_s``; beyond that a new connection is closed at once (``refused``);
- at most ``max_connections`` connections in all (``refused`` beyond);
- an authenticated connection silent for ``idle_timeout_s`` is closed (``idle``);
- ``Hello.worker`` >= 0 binds the connection to that attention worker: its reports for another
  worker are dropped (``wrong_worker``), and a newer connection for the same worker replaces the
  older one (``replaced``: a client that reconnected). ``worker = -1`` is an unbound client that
  reports for several workers (a benchmark driving a whole attention node);
- the event loop never blocks: a report meets a full mailbox ring with a non-blocking put and
  is dropped (``dropped_full``), and rejected reports are logged at most once a second.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import socket
import struct
import threading
import time

import msgspec
import numpy as np

from afore.prefetch.mailbox import DemandMailbox, DemandReport
from afore.plan import Target

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_LEN = struct.Struct("<I")


class Hello(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    token: str
    version: int
    worker: int = -1  # the attention worker this connection reports for (-1: several)


class Welcome(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ok: bool
    error: str = ""
    num_experts: int = 0
    num_layers: int = 0
    num_microbatches: int = 0
    num_workers: int = 0


_encoder = msgspec.msgpack.Encoder()
_hello_decoder = msgspec.msgpack.Decoder(Hello)
_welcome_decoder = msgspec.msgpack.Decoder(Welcome)
_report_decoder = msgspec.msgpack.Decoder(DemandReport)


def frame(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LEN.pack(len(body)) + body


class DemandReceiver:
    """Serve demand reports into ``mailbox`` (a producer handle: ``DemandMailbox.attach``).

    Args:
      mailbox: where reports go.
      token: shared secret every client must present (non-empty).
      host, port: listen address (port 0 = any free port; see ``port`` after ``start``).
      max_frame: largest accepted frame in bytes (default: a report of num_experts plus slack).
      on_outcome: optional callback(outcome) per message (metrics).
      hello_timeout_s, idle_timeout_s, max_unauthenticated, max_connections: the limits above
      (default max_connections: 2 per attention worker, at least 8).
    Counters in ``counts``: accepted, dropped_full, rejected, malformed, oversize, bad_token,
    refused, hello_timeout, idle, wrong_worker, replaced.
    """

    def __init__(self, mailbox: DemandMailbox, token: str, host: str = "127.0.0.1", port: int = 0,
                 max_frame: int | None = None, on_outcome=None, hello_timeout_s: float = 5.0,
                 idle_timeout_s: float = 300.0, max_unauthenticated: int = 8, max_connections: int | None = None):
        if not token:
            raise ValueError("token: expected a non-empty shared token")
        for field, value in (("hello_timeout_s", hello_timeout_s), ("idle_timeout_s", idle_timeout_s)):
            if not 0 < value <= 1e6:
                raise ValueError(f"{field}: expected seconds in (0, 1e6], got {value}")
        if max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated: expected >= 1, got {max_unauthenticated}")
        self.hello_timeout_s, self.idle_timeout_s = hello_timeout_s, idle_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self.max_connections = max_connections if max_connections is not None else max(8, 2 * mailbox.num_producers)
        if self.max_connections < 1:
            raise ValueError(f"max_connections: expected >= 1, got {self.max_connections}")
        self._unauthenticated = 0
        self._connections = 0
        self._by_worker: dict[int, asyncio.StreamWriter] = {}
        self._last_log = 0.0
        self.mailbox = mailbox
        self._token = token.encode()
        self.host, self.port = host, port
        self.max_frame = max_frame if max_frame is not None else 64 + 4 * mailbox.num_experts + 64
        self.counts: collections.Counter[str] = collections.Counter()
        self._on_outcome = on_outcome
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    def _welcome(self, ok: bool, error: str = "") -> Welcome:
        m = self.mailbox
        return Welcome(ok, error, m.num_experts, m.num_layers, m.num_microbatches, m.num_producers)

    async def _read_frame(self, reader: asyncio.StreamReader) -> bytes | None:
        head = await reader.readexactly(_LEN.size)
        (length,) = _LEN.unpack(head)
        if length > self.max_frame:
            self._count("oversize")
            return None
        return await reader.readexactly(length)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._unauthenticated >= self.max_unauthenticated or self._connections >= self.max_connections:
            self._count("refused")
            writer.close()
            return
        peer = writer.get_extra_info("peername")
        self._connections += 1
        self._unauthenticated += 1
        waiting_hello, worker = True, -1
        try:
            try:
                body = await asyncio.wait_for(self._read_frame(reader), timeout=self.hello_timeout_s)
            except asyncio.TimeoutError:
                self._count("hello_timeout")
                return
            try:
                hello = _hello_decoder.decode(body) if body is not None else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                hello = None
            if hello is None or hello.version != PROTOCOL_VERSION:
                self._count("malformed")
                writer.write(frame(self._welcome(False, f"expected Hello(token, version={PROTOCOL_VERSION}, worker)")))
                return
            if not hmac.compare_digest(hello.token.encode(), self._token):
                self._count("bad_token")
                writer.write(frame(self._welcome(False, "token: not accepted")))
                return
            if not -1 <= hello.worker < self.mailbox.num_producers:
                self._count("malformed")
                writer.write(frame(self._welcome(False, f"worker: expected in [0, {self.mailbox.num_producers}) "
                                                        f"or -1 (several), got {hello.worker}")))
                return
            waiting_hello = False
            self._unauthenticated -= 1
            worker = hello.worker
            if worker >= 0:
                older = self._by_worker.get(worker)
                if older is not None:
                    self._count("replaced")
                    older.close()
                self._by_worker[worker] = writer
            writer.write(frame(self._welcome(True)))
            await writer.drain()
            while True:
                try:
                    body = await asyncio.wait_for(self._read_frame(reader), timeout=self.idle_timeout_s)
                except asyncio.TimeoutError:
                    self._count("idle")
                    return
                if body is None:
                    log.warning("demand receiver: oversize frame from %s, closing", peer)
                    return
                self._deliver(body, worker)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:  # stop(): end quietly, the loop is closing
            pass
        finally:
            self._connections -= 1
            if waiting_hello:
                self._unauthenticated -= 1
            if worker >= 0 and self._by_worker.get(worker) is writer:
                del self._by_worker[worker]
            writer.close()

    def _deliver(self, body: bytes, worker: int = -1) -> None:
        try:
            report = _report_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._count("malformed")
            return
        if worker >= 0 and report.worker != worker:
            self._count("wrong_worker")
            self._log_rejected(f"report for worker {report.worker} on the connection of worker {worker}")
            return
        try:
            ok = self.mailbox.put_report(report, timeout_s=0.0)  # never block the event loop
        except ValueError as exc:
            self._count("rejected")
            self._log_rejected(str(exc))
            return
        self._count("accepted" if ok else "dropped_full")

    def _log_rejected(self, why: str) -> None:
        """At most one warning a second: a flood of bad reports must not become a flood of logs."""
        now = time.monotonic()
        if now - self._last_log >= 1.0:
            self._last_log = now
            log.warning("demand receiver: rejected report: %s (counts so far: %s)", why, dict(self.counts))

    # ---- lifecycle: the receiver runs its own event loop in a thread of the calling process
    def start(self) -> int:
        """Start listening in a background thread; returns the bound port."""
        self._thread = threading.Thread(target=self._run, name="demand-receiver", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, self.host, self.port))
            self.port = self._server.sockets[0].getsockname()[1]
        except OSError as exc:
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            # end the open connections' handlers before the loop closes under them
            handlers = asyncio.all_tasks(loop)
            for task in handlers:
                task.cancel()
            if handlers:
                loop.run_until_complete(asyncio.wait(handlers))
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


class DemandClient:
    """An attention worker's connection to a remote DemandReceiver.

    ``put`` validates locally (same rules as the mailbox: ValueError on bad input, nothing
    sent) and sends one frame; it does not wait for the scheduler. ``worker`` >= 0 binds the
    connection to that attention worker (the receiver drops its reports for any other).
    """

    def __init__(self, host: str, port: int, token: str, timeout_s: float = 5.0, worker: int = -1):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(frame(Hello(token, PROTOCOL_VERSION, worker)))
        head = _recv_exactly(self.sock, _LEN.size)
        (length,) = _LEN.unpack(head)
        if length > 4096:
            raise ConnectionError(f"demand receiver: oversize welcome ({length} bytes)")
        welcome = _welcome_decoder.decode(_recv_exactly(self.sock, length))
        if not welcome.ok:
            self.sock.close()
            raise ValueError(f"demand receiver refused the connection: {welcome.error}")
        self.welcome = welcome
        self.worker = worker
        self._last_seq: dict[int, int] = {}

    def put(self, target: Target, worker: int, counts) -> None:
        w = self.welcome
        arr = np.asarray(counts)
        if arr.ndim != 1 or arr.shape[0] != w.num_experts:
            raise ValueError(f"counts: expected a vector of length {w.num_experts} (num_experts), got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"counts: expected integer counts, got dtype {arr.dtype}")
        if arr.size and arr.min() < 0:
            raise ValueError(f"counts: expected non-negative counts, got min {int(arr.min())}")
        if not 0 <= worker < w.num_workers:
            raise ValueError(f"worker: expected in [0, {w.num_workers}), got {worker}")
        if self.worker >= 0 and worker != self.worker:
            raise ValueError(f"worker: this connection reports for worker {self.worker}, got {worker}")
        if not 0 <= target.layer < w.num_layers:
            raise ValueError(f"layer: expected in [0, {w.num_layers}), got {target.layer}")
        if not 0 <= target.microbatch < w.num_microbatches:
            raise ValueError(f"microbatch: expected in [0, {w.num_microbatches}), got {target.microbatch}")
        if target.step < 0:
            raise ValueError(f"step: expected >= 0, got {target.step}")
        seq = target.seq(w.num_layers, w.num_microbatches)
        if seq <= self._last_seq.get(worker, -1):
            raise ValueError(f"target: duplicate or out-of-order report from worker {worker} (seq {seq})")
        self.sock.sendall(frame(DemandReport.make(target, worker, arr)))
        self._last_seq[worker] = seq

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("demand receiver closed the connection")
        buf += chunk
    return bytes(buf)
