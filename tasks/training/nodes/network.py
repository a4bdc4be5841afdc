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
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

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


@dataclass(frozen=True)
class BridgedNamespaces:
    """Network namespaces on one bridge (``bridged_namespaces``): node K's namespace, its address, the host end of
    its link (take it down to cut the node off, its sockets left open), and the bridge's own address (where an
    MLflow server the nodes reach listens)."""

    namespaces: list[str]
    addresses: list[str]
    host_links: list[str]
    bridge_address: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def bridged_namespaces(count: int, tag: int) -> Iterator[BridgedNamespaces]:
    """``count`` network namespaces, each joined by a veth pair to one bridge on 10.77.<tag % 200 + 20>.0/24 (the
    bridge .1, node K .K+2), for ``orchestration.local_network_namespaces``: nodes on one machine that meet over a
    network as separate hosts would. Needs root and iproute2; everything is deleted on exit."""
    prefix = f"10.77.{tag % 200 + 20}"
    bridge, namespaces = f"gfbr{tag}", [f"gfn{tag}x{k}" for k in range(count)]
    host_links = [f"gfh{tag}x{k}" for k in range(count)]
    _ip("link", "add", bridge, "type", "bridge")
    try:
        _ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for node, (namespace, host_link) in enumerate(zip(namespaces, host_links, strict=True)):
            inner = f"gfv{tag}x{node}"
            _ip("netns", "add", namespace)
            _ip("link", "add", host_link, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", namespace)
            _ip("link", "set", host_link, "master", bridge)
            _ip("link", "set", host_link, "up")
            _ip("-n", namespace, "addr", "add", f"{prefix}.{node + 2}/24", "dev", inner)
            _ip("-n", namespace, "link", "set", inner, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield BridgedNamespaces(
            namespaces, [f"{prefix}.{node + 2}" for node in range(count)], host_links, f"{prefix}.1"
        )
    finally:
        for namespace in namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
