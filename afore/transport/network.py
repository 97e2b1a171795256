"""Which address the torch transport listens on: its TCPStore server, and the gloo/NCCL data plane.

Neither has authentication (anyone who reaches the store can read and write its keys, anyone
who reaches a gloo pair can inject tensors): keep them on a trusted network (docs/deploy.md).
What afore does is hold them to the address the deployment names instead of every interface:

- The store. torch's ``TCPStore`` server (2.13, libuv backend) binds the wildcard address
  whatever ``host_name`` says; ``host_name`` only tells clients where to connect. Its
  constructor takes ``master_listen_fd``, a socket already bound: ``listen_fd`` binds one to
  the given address, and the store then accepts connections there only.
- The data plane. gloo and NCCL choose their own interface: gloo binds the address its
  hostname resolves to, NCCL its first usable interface, unless ``GLOO_SOCKET_IFNAME`` /
  ``NCCL_SOCKET_IFNAME`` name one. ``data_plane_env`` names the interface that owns the given
  address, for every process of the node (afore's groups and vLLM's alike).

A wildcard address (``0.0.0.0``, ``::``, empty) keeps torch's behaviour: every interface for the
store, gloo's and NCCL's own choice for the data plane.
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARDS = ("", "0.0.0.0", "::")
IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def listen_fd(host: str, port: int) -> int | None:
    """A TCP socket listening on ``host:port``, as the file descriptor that
    ``TCPStore(..., is_master=True, master_listen_fd=fd)`` accepts on (both of torch's server
    backends; the legacy one waits forever on a socket not yet listening); the store owns it from
    then on. ``port`` 0 binds a free port (the store's ``.port`` reports it). None for a wildcard
    ``host``: torch binds every interface itself. OSError if the address cannot be bound (in use,
    not this machine's)."""
    if is_wildcard(host):
        return None
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def route_source(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (the kernel's choice; nothing is
    sent): where a node's data plane must listen for peers that live at ``host``. ValueError
    naming ``host`` when it does not resolve."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"ffn_host: expected an address or a name that resolves, got {host!r} ({exc.strerror})") from None
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        return sock.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (an IP or a name that resolves
    to one), None if no interface of this machine does. A loopback address belongs to the
    interface that holds 127.0.0.1 / ::1 (Linux routes all of 127.0.0.0/8 there)."""
    import psutil

    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(address, None)[0][4][0].split("%")[0])
    except (OSError, ValueError):
        return None
    if ip.is_loopback:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6) and ipaddress.ip_address(a.address.split("%")[0]) == ip:
                return name
    return None


def data_plane_env(address: str) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` naming the interface that owns
    ``address``; {} for a wildcard address or one that no interface holds (gloo and NCCL choose)."""
    name = None if is_wildcard(address) else interface_of(address)
    return {key: name for key in IFNAME_ENV} if name else {}
