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
    # the receiver counts a report once its put returned; the scheduler, woken by the put's
    # doorbell, may have the target before the receiver's thread counted the second report
    deadline = time.monotonic() + 5.0
    while receiver.counts["accepted"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
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


@pytest.fixture
def limited(seg_name):
    """A receiver with short limits: 2 connections waiting for Hello, 0.5 s each, idle after 0.5 s."""
    mb = DemandMailbox.create(seg_name("rx"), SHAPE, num_producers=2, num_microbatches=1)
    producer = DemandMailbox.attach(mb.name)
    receiver = DemandReceiver(producer, token="s3cret", hello_timeout_s=0.5, idle_timeout_s=0.5, max_unauthenticated=2)
    port = receiver.start()
    yield mb, receiver, port
    receiver.stop()
    producer.close()
    mb.close()


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_silent_unauthenticated_connections_are_bounded_in_number_and_time(limited):
    mb, receiver, port = limited
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    assert wait_for(lambda: receiver._unauthenticated == 2)
    third = socket.create_connection(("127.0.0.1", port))
    assert closed_by_peer(third)  # over the limit: closed at once, not queued
    assert receiver.counts["refused"] == 1
    assert all(closed_by_peer(s) for s in silent)  # each held its slot at most hello_timeout_s
    assert wait_for(lambda: receiver.counts["hello_timeout"] == 2)
    with DemandClient("127.0.0.1", port, "s3cret") as client:  # the slots are free again
        for w in range(2):
            client.put(Target(0, 0, 0), w, np.ones(16, np.int32))
        assert mb.wait_complete(5.0).target == Target(0, 0, 0)
    for s in silent + [third]:
        s.close()


def test_an_idle_authenticated_connection_is_closed(limited):
    _, receiver, port = limited
    client = DemandClient("127.0.0.1", port, "s3cret")
    assert closed_by_peer(client.sock)
    assert receiver.counts["idle"] == 1
    client.close()


def test_a_bound_connection_reports_for_its_worker_only_and_a_newer_one_replaces_it(served):
    mb, receiver, port = served
    first = DemandClient("127.0.0.1", port, "s3cret", worker=0)
    with pytest.raises(ValueError, match="reports for worker 0"):
        first.put(Target(0, 0, 0), 1, np.ones(16, np.int32))  # refused locally, nothing sent
    first.sock.sendall(frame(DemandReport(0, 0, 0, 1, np.ones(16, "<i4").tobytes())))  # a client that lies
    assert wait_for(lambda: receiver.counts["wrong_worker"] == 1)
    second = DemandClient("127.0.0.1", port, "s3cret", worker=0)  # worker 0 reconnected
    assert closed_by_peer(first.sock) and receiver.counts["replaced"] == 1
    with DemandClient("127.0.0.1", port, "s3cret", worker=1) as other:
        second.put(Target(0, 0, 0), 0, np.ones(16, np.int32))
        other.put(Target(0, 0, 0), 1, np.ones(16, np.int32))
        got = mb.wait_complete(5.0)
        assert got.target == Target(0, 0, 0) and got.demand.sum() == 32
    with pytest.raises(ValueError, match="worker: expected in"):
        DemandClient("127.0.0.1", port, "s3cret", worker=2)
    first.close()
    second.close()


def test_a_full_mailbox_drops_without_blocking_the_receiver(seg_name):
    mb = DemandMailbox.create(seg_name("rx"), SHAPE, num_producers=2, num_microbatches=1, capacity=2)
    producer = DemandMailbox.attach(mb.name)
    receiver = DemandReceiver(producer, token="s3cret")
    port = receiver.start()
    try:
        with DemandClient("127.0.0.1", port, "s3cret", worker=0) as client:
            for step in range(50):  # nobody consumes: two fit, the rest are dropped
                client.put(Target(step, 0, 0), 0, np.ones(16, np.int32))
            assert wait_for(lambda: receiver.counts["accepted"] + receiver.counts["dropped_full"] == 50)
        assert receiver.counts["accepted"] == 2 and receiver.counts["dropped_full"] == 48
    finally:
        receiver.stop()
        producer.close()
        mb.close()
