"""Free local TCP ports, for the benchmarks and tests that start servers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (another process may still take it before it is used)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """A port p with p .. p + n - 1 all free (for a base port plus its offsets)."""
    for _ in range(50):
        p = free_port(host)
        try:
            for k in range(1, n):
                with socket.socket() as sock:
                    sock.bind((host, p + k))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")
