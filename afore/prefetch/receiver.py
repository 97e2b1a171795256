"""Demand receiver: attention workers on other nodes -> the FFN node's DemandMailbox.

Shared memory never spans nodes, so a remote attention worker sends its DemandReport over TCP
to this receiver, which runs on the FFN node (in the scheduler service) and writes it into the
mailbox. Attention workers on the FFN node write the mailbox directly; both paths carry the
same ``DemandReport`` struct.

Protocol (asyncio TCP, TCP_NODELAY): every frame is a u32 little-endian length followed by a
msgspec msgpack message. The client's first frame is ``Hello(token, version)``; the server
answers ``Welcome`` (ok, or the error) and closes on a bad token. Then the client streams
``DemandReport`` frames with no reply (demand is fire-and-forget; the FFN side survives a lost
report, invariant 5). Frames longer than ``max_frame`` bytes close the connection (the stream
cannot be trusted any more); malformed messages and reports the mailbox rejects are counted
and dropped, and the connection stays up: nothing else is lost.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import socket
import struct
import threading

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
    Counters in ``counts``: accepted, dropped_full, rejected, malformed, oversize, bad_token.
    """

    def __init__(self, mailbox: DemandMailbox, token: str, host: str = "127.0.0.1", port: int = 0,
                 max_frame: int | None = None, on_outcome=None):
        if not token:
            raise ValueError("token: expected a non-empty shared token")
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
        peer = writer.get_extra_info("peername")
        try:
            body = await asyncio.wait_for(self._read_frame(reader), timeout=10.0)
            try:
                hello = _hello_decoder.decode(body) if body is not None else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                hello = None
            if hello is None or hello.version != PROTOCOL_VERSION:
                self._count("malformed")
                writer.write(frame(self._welcome(False, f"expected Hello(token, version={PROTOCOL_VERSION})")))
                return
            if not hmac.compare_digest(hello.token.encode(), self._token):
                self._count("bad_token")
                writer.write(frame(self._welcome(False, "token: not accepted")))
                return
            writer.write(frame(self._welcome(True)))
            await writer.drain()
            while True:
                body = await self._read_frame(reader)
                if body is None:
                    log.warning("demand receiver: oversize frame from %s, closing", peer)
                    return
                self._deliver(body)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        except asyncio.CancelledError:  # stop(): end quietly, the loop is closing
            pass
        finally:
            writer.close()

    def _deliver(self, body: bytes) -> None:
        try:
            report = _report_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._count("malformed")
            return
        try:
            ok = self.mailbox.put_report(report)
        except ValueError as exc:
            self._count("rejected")
            log.warning("demand receiver: rejected report: %s", exc)
            return
        self._count("accepted" if ok else "dropped_full")

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
    sent) and sends one frame; it does not wait for the scheduler.
    """

    def __init__(self, host: str, port: int, token: str, timeout_s: float = 5.0):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(frame(Hello(token, PROTOCOL_VERSION)))
        head = _recv_exactly(self.sock, _LEN.size)
        (length,) = _LEN.unpack(head)
        if length > 4096:
            raise ConnectionError(f"demand receiver: oversize welcome ({length} bytes)")
        welcome = _welcome_decoder.decode(_recv_exactly(self.sock, length))
        if not welcome.ok:
            self.sock.close()
            raise ValueError(f"demand receiver refused the connection: {welcome.error}")
        self.welcome = welcome
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
