"""Nodes on networks of their own, for ``make test-nodes``: each node in a network namespace with a veth pair whose
host end is on a bridge that also carries an MLflow server, so the nodes meet (and reach MLflow) over a network
as separate hosts would, with nothing passing only because it is loopback. This host's name resolves to
127.0.0.1 in every namespace, as in many containers."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import running_mlflow_server

SUBNET = "10.77.{}.0/24"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def separate_networks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two network namespaces on a bridge (node K at 10.77.X.(K+2), the bridge and MLflow at 10.77.X.1); yields
    the namespaces, each node's address, each node's host-side link (take it down to cut a node off, its sockets
    left open) and the MLflow server. Everything is deleted after the module."""
    tag = os.getpid() % 10000
    octet = tag % 200 + 20
    bridge, namespaces = f"gfbr{tag}", [f"gfn{tag}x{k}" for k in range(2)]
    host_links = [f"gfh{tag}x{k}" for k in range(2)]
    prefix = SUBNET.format(octet).rsplit(".", 1)[0]
    try:
        _ip("link", "add", bridge, "type", "bridge")
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.fail(f"cannot make network namespaces here (needs root and iproute2): {exc}")
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
        root: Path = tmp_path_factory.mktemp("mlflow-bridge")
        with running_mlflow_server(root, f"{prefix}.1", 5000 + tag % 1000) as server:
            yield {
                "namespaces": namespaces,
                "addresses": [f"{prefix}.{node + 2}" for node in range(2)],
                "host_links": host_links,
                "mlflow": server,
            }
    finally:
        for namespace in namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
