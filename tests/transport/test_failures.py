"""The connector on the serving path: an idle server stays up past the timeout, a silent FFN
worker makes the attention side time out instead of hanging, a dead one fails it at once."""

import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

from afore.plan import Target
from afore.transport.connector import AttentionConnector, FFNConnector, TransportConfig, host_store, wait_for_ffn

HIDDEN, TOP_K, TIMEOUT_S = 8, 2, 2.0
FFN_START_TIMEOUT_S = 120.0  # a spawned interpreter importing torch on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(port: int, timeout_s: float = TIMEOUT_S) -> TransportConfig:
    # the store is hosted by the test (as ``afore serve --role ffn`` does), so neither side's
    # start-up speed decides whether the other finds it
    return TransportConfig("127.0.0.1", port, 1, 1, HIDDEN, TOP_K, timeout_s=timeout_s, store_on_rank0=False)


def _ffn(port: int, mode: str) -> None:
    """An FFN end that doubles its input ("echo") or receives and never answers ("silent").
    Its own waits are long: the timeouts under test are the attention side's."""
    conn = FFNConnector(_cfg(port, FFN_START_TIMEOUT_S), 0)
    while True:
        mb = conn.recv(timeout_s=0.2)
        if mb is None:
            continue
        if mode == "silent":
            time.sleep(3600)
        conn.send(mb, mb.hidden * 2)


@pytest.fixture
def ffn_process():
    procs = []

    def start(mode: str) -> tuple[mp.Process, AttentionConnector]:
        port = _free_port()
        stores.append(host_store("127.0.0.1", port, FFN_START_TIMEOUT_S))
        proc = mp.get_context("spawn").Process(target=_ffn, args=(port, mode), daemon=True)
        proc.start()
        procs.append(proc)
        wait_for_ffn("127.0.0.1", port, 1, FFN_START_TIMEOUT_S)  # the FFN end is up and joining
        return proc, AttentionConnector(_cfg(port), 0)

    stores: list = []
    yield start
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _inputs(n: int = 4):
    return torch.randn(n, HIDDEN), torch.zeros(n, TOP_K, dtype=torch.int32), torch.ones(n, TOP_K)


def test_an_idle_server_outlives_the_timeout(ffn_process):
    _, conn = ffn_process("echo")
    x, ids, w = _inputs()
    torch.testing.assert_close(conn.exchange(Target(0, 0, 0), 0, x, ids, w), 2 * x)
    time.sleep(2 * TIMEOUT_S)  # no request for longer than the timeout: the FFN side keeps waiting
    torch.testing.assert_close(conn.exchange(Target(1, 0, 0), 1, x, ids, w), 2 * x)
    conn.close()


def test_a_silent_ffn_worker_times_out_instead_of_hanging(ffn_process):
    _, conn = ffn_process("silent")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        conn.exchange(Target(0, 0, 0), 0, *_inputs())
    assert time.monotonic() - t0 < TIMEOUT_S + 5
    conn.close()


def test_a_dead_ffn_worker_fails_the_exchange_at_once(ffn_process):
    proc, conn = ffn_process("echo")
    x, ids, w = _inputs()
    torch.testing.assert_close(conn.exchange(Target(0, 0, 0), 0, x, ids, w), 2 * x)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        conn.exchange(Target(1, 0, 0), 1, x, ids, w)
    assert time.monotonic() - t0 < TIMEOUT_S, "a closed peer must be reported before the timeout"
    conn.close()
