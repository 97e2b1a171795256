"""Fuzzing the demand receiver's frames (hypothesis): whatever bytes a client sends, as its
Hello or after it, the receiver counts and drops them, keeps serving other clients, and never
lets a malformed frame reach the mailbox."""

from __future__ import annotations

import socket
import struct
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from afore.config import ClusterShape
from afore.plan import Target
from afore.prefetch.mailbox import DemandMailbox, DemandReport
from afore.prefetch.receiver import PROTOCOL_VERSION, DemandClient, DemandReceiver, Hello, frame

SHAPE = ClusterShape(num_experts=8, num_workers=2, num_layers=2, top_k=2)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def served():
    import os
    import uuid

    name = f"afore-test-rxfuzz-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mb = DemandMailbox.create(name, SHAPE, num_producers=2, num_microbatches=1, capacity=4096, deadline_s=0)
    producer = DemandMailbox.attach(name)
    receiver = DemandReceiver(producer, token="s3cret", hello_timeout_s=1.0, max_unauthenticated=64,
                              max_connections=128)
    port = receiver.start()
    yield mb, receiver, port
    receiver.stop()
    producer.close()
    mb.close()


def _settled(receiver: DemandReceiver, timeout: float = 5.0) -> None:
    """Wait until every connection this test opened has been closed by the receiver."""
    end = time.monotonic() + timeout
    while receiver._connections and time.monotonic() < end:
        time.sleep(0.005)


def _send_and_close(port: int, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(5)
            while sock.recv(4096):
                pass
        except (ConnectionResetError, BrokenPipeError, socket.timeout):
            pass


def _still_serves(mb: DemandMailbox, port: int, step: int) -> None:
    with DemandClient("127.0.0.1", port, "s3cret") as client:
        for w in range(2):
            client.put(Target(step, 0, 0), w, np.full(8, w + 1, np.int32))
    got = mb.wait_complete(5.0)
    while got is not None and got.target != Target(step, 0, 0):  # targets a fuzz case completed by luck
        got = mb.wait_complete(5.0)
    assert got is not None and got.demand.tolist() == [3] * 8


frames = st.lists(st.one_of(
    st.binary(max_size=200).map(lambda b: struct.pack("<I", len(b)) + b),              # well-framed garbage
    st.builds(lambda n, b: struct.pack("<I", n) + b, st.integers(0, 2**32 - 1), st.binary(max_size=64)),  # lying lengths
    st.binary(max_size=64),                                                              # no framing at all
    st.builds(lambda s, l, m, w, c: frame(DemandReport(s, l, m, w, c)),                  # reports with wild fields
              st.integers(-2**40, 2**41), st.integers(-3, 5), st.integers(-2, 3), st.integers(-3, 5), st.binary(max_size=64)),
), max_size=6)


@FUZZ
@given(first=st.binary(max_size=300), rest=frames)
def test_garbage_instead_of_a_hello_is_refused(served, first, rest):
    mb, receiver, port = served
    accepted = receiver.counts["accepted"]
    _send_and_close(port, first + b"".join(rest))
    _settled(receiver)
    assert receiver.counts["accepted"] == accepted  # nothing gets in without the token
    assert receiver._thread.is_alive()


@FUZZ
@given(rest=frames)
def test_garbage_after_a_valid_hello_is_counted_and_dropped(served, rest):
    mb, receiver, port = served
    before = sum(receiver.counts.values())
    _send_and_close(port, frame(Hello("s3cret", PROTOCOL_VERSION)) + b"".join(rest))
    _settled(receiver)
    assert receiver._thread.is_alive() and receiver._unauthenticated == 0
    assert sum(receiver.counts.values()) >= before  # every frame that was read got an outcome


def test_the_receiver_still_serves_after_the_fuzzing(served):
    mb, receiver, port = served
    _still_serves(mb, port, step=2**30)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_decoding_any_body_never_raises(body):
    for decoder in (msgspec.msgpack.Decoder(Hello), msgspec.msgpack.Decoder(DemandReport)):
        try:
            decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
