"""Where the torch transport listens (afore.transport.network): the store on the address given
and no other, the data plane on the interface that owns it."""

import datetime
import socket

import psutil
import pytest
import torch.distributed as dist

from afore.transport.connector import host_store
from afore.transport.network import data_plane_env, interface_of, listen_fd, route_source


def _reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def _other_local_addresses() -> list[str]:
    """Addresses of this machine other than 127.0.0.1: 127.0.0.2 (Linux's loopback interface
    holds all of 127.0.0.0/8) and every non-loopback IPv4 address of an interface."""
    out = ["127.0.0.2"]
    for addrs in psutil.net_if_addrs().values():
        out += [a.address for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
    return out


def test_the_store_listens_on_the_address_given_only():
    store = host_store("127.0.0.1", 0, timeout_s=10)
    assert _reachable("127.0.0.1", store.port)
    others = _other_local_addresses()
    assert [a for a in others if _reachable(a, store.port)] == [], others
    client = dist.TCPStore("127.0.0.1", store.port, world_size=None, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_wildcard_store_listens_everywhere():
    store = host_store("0.0.0.0", 0, timeout_s=10)
    assert _reachable("127.0.0.1", store.port) and _reachable("127.0.0.2", store.port)


def test_an_address_in_use_or_not_of_this_machine_is_refused():
    store = host_store("127.0.0.1", 0, timeout_s=10)
    with pytest.raises(OSError):
        listen_fd("127.0.0.1", store.port)
    with pytest.raises(OSError):
        listen_fd("203.0.113.9", 0)  # TEST-NET-3: no interface of any machine holds it


def test_the_data_plane_is_pinned_to_the_interface_that_owns_the_address():
    loopback = interface_of("127.0.0.1")
    assert loopback is not None and interface_of("127.0.0.2") == loopback and interface_of("localhost") == loopback
    assert data_plane_env("127.0.0.1") == {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                assert interface_of(a.address) == name
    assert interface_of("203.0.113.9") is None and data_plane_env("203.0.113.9") == {}
    assert data_plane_env("0.0.0.0") == {} and data_plane_env("::") == {}
    assert route_source("127.0.0.1", 9) == "127.0.0.1"
    with pytest.raises(ValueError, match="ffn_host: .*'no-such-host.invalid'"):  # a bad --ffn-host says so
        route_source("no-such-host.invalid", 9)
