import socket
import struct
import time

import msgspec
import numpy as np
import pytest

from afore.config import ClusterShape
from afore.prefetch.mailbox import DemandMailbox, DemandReport
from afore.prefetch.receiver import PROTOCOL_VERSION, DemandClient, DemandReceiver, Hello, frame
from afore.plan import Target

SHAPE = ClusterShape(num_experts=16, num_workers=2, num_layers=2, top_k=2)


@pytest.fixture
def served(seg_name):
    mb = DemandMailbox.create(seg_name("rx"), SHAPE, num_producers=2, num_microbatches=1)
    producer = DemandMailbox.attach(mb.name)
    receiver = DemandReceiver(producer, token="s3cret")
    port = receiver.start()
    yield mb, receiver, port
    receiver.stop()
    producer.close()
    mb.close()


def wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return False


def test_remote_reports_reach_the_mailbox(served):
    mb, receiver, port = served
    with DemandClient("127.0.0.1", port, "s3cret") as client:
        assert client.welcome.num_experts == 16
        for w in range(2):
            client.put(Target(0, 1, 0), w, np.full(16, w + 1, np.int32))
        got = mb.wait_complete(5.0)
    assert got.target == Target(0, 1, 0)
    np.testing.assert_array_equal(got.demand, np.full(16, 3))
    assert receiver.counts["accepted"] == 2


def test_bad_token_is_refused_and_counted(served):
    _, receiver, port = served
    with pytest.raises(ValueError, match="token"):
        DemandClient("127.0.0.1", port, "wrong")
    assert receiver.counts["bad_token"] == 1


def test_client_rejects_bad_input_locally(served):
    _, _, port = served
    with DemandClient("127.0.0.1", port, "s3cret") as client:
        with pytest.raises(ValueError, match="length 16"):
            client.put(Target(0, 0, 0), 0, np.zeros(3, np.int32))
        with pytest.raises(ValueError, match="non-negative"):
            client.put(Target(0, 0, 0), 0, -np.ones(16, np.int32))
        with pytest.raises(ValueError, match="worker"):
            client.put(Target(0, 0, 0), 5, np.zeros(16, np.int32))
        with pytest.raises(ValueError, match="layer"):
            client.put(Target(0, 2, 0), 0, np.zeros(16, np.int32))


def raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(frame(Hello("s3cret", PROTOCOL_VERSION)))
    (n,) = struct.unpack("<I", sock.recv(4))
    sock.recv(n)
    return sock


def test_malformed_and_rejected_messages_are_counted_and_lose_nothing_else(served):
    mb, receiver, port = served
    sock = raw_connection(port)
    garbage = b"\x93\xff\x00garbage"
    sock.sendall(struct.pack("<I", len(garbage)) + garbage)                          # not msgpack of a report
    sock.sendall(frame(DemandReport(0, 0, 0, 0, b"\x01\x00\x00")))                   # counts not int32
    sock.sendall(frame(DemandReport(0, 0, 0, 0, np.zeros(15, "<i4").tobytes())))    # wrong length
    sock.sendall(frame(DemandReport(0, 0, 0, 7, np.zeros(16, "<i4").tobytes())))    # unknown worker
    good = [DemandReport(0, 0, 0, w, np.full(16, 2, "<i4").tobytes()) for w in range(2)]
    sock.sendall(frame(good[0]) + frame(good[0]) + frame(good[1]))                  # a duplicate in between
    got = mb.wait_complete(5.0)
    assert got.target == Target(0, 0, 0)
    np.testing.assert_array_equal(got.demand, np.full(16, 4))
    assert wait_for(lambda: receiver.counts["accepted"] == 2)
    assert receiver.counts["malformed"] == 1 and receiver.counts["rejected"] == 4
    sock.close()


def test_oversize_frame_closes_that_connection_only(served):
    mb, receiver, port = served
    sock = raw_connection(port)
    sock.sendall(struct.pack("<I", 10**7) + b"x" * 100)
    assert wait_for(lambda: receiver.counts["oversize"] == 1)
    assert sock.recv(1) == b""  # closed by the receiver
    with DemandClient("127.0.0.1", port, "s3cret") as client:
        client.put(Target(1, 0, 0), 0, np.ones(16, np.int32))
        client.put(Target(1, 0, 0), 1, np.ones(16, np.int32))
        assert mb.wait_complete(5.0).target == Target(1, 0, 0)


def test_hello_must_be_first(served):
    _, receiver, port = served
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(frame(DemandReport(0, 0, 0, 0, np.zeros(16, "<i4").tobytes())))
    (n,) = struct.unpack("<I", sock.recv(4))
    welcome = msgspec.msgpack.decode(sock.recv(n))
    assert welcome[0] is False
    assert receiver.counts["malformed"] == 1
    sock.close()
