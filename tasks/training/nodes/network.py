"""Where a node talks to the others: the interface gloo and NCCL bind to, and the address torch's rendezvous knows
the node by, both the ones that route to node 0 (the rendezvous host). Without them gloo advertises whatever the
hostname resolves to, often a loopback address in containers and Debian installs, and the other nodes' connects
are refused.

Must not import: torch, MLflow, Prefect (the agent decides this before it starts anything).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def local_address_towards(host: str, port: int = 9) -> str:
    """This machine's own address on the route to ``host`` (no packet is sent: a UDP socket is only connected).

    >>> local_address_towards("127.0.0.1")
    '127.0.0.1'
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return probe.getsockname()[0]


def interface_with_address(address: str) -> str | None:
    """The name of the interface that carries IPv4 ``address``, or None.

    >>> interface_with_address("127.0.0.1")
    'lo'
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(handle.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                if socket.inet_ntoa(packed[20:24]) == address:
                    return name
    if ipaddress.ip_address(address).is_loopback:
        return "lo"  # all of 127/8 is lo's, though lo carries only 127.0.0.1
    return None


def communication_environment(
    rendezvous_host: str, interface: str | None = None, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for this node: ``interface`` (``orchestration.
    network_interface``), else the one that routes to ``rendezvous_host``; a value already in ``environ`` (the
    user's own) wins. Empty where the route cannot be found (gloo then picks as it always did).

    >>> communication_environment("127.0.0.1", environ={})
    {'GLOO_SOCKET_IFNAME': 'lo', 'NCCL_SOCKET_IFNAME': 'lo'}
    >>> communication_environment("127.0.0.1", "eth1", environ={"NCCL_SOCKET_IFNAME": "ib0"})
    {'GLOO_SOCKET_IFNAME': 'eth1'}
    """
    environ = {} if environ is None else environ
    if interface is None:
        try:
            interface = interface_with_address(local_address_towards(rendezvous_host))
        except OSError:
            interface = None
    if interface is None:
        return {}
    return {name: interface for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in environ}
