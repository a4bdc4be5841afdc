"""Nodes on networks of their own, for ``make test-nodes``: each node in a network namespace with a veth pair whose
host end is on a bridge that also carries an MLflow server, so the nodes meet (and reach MLflow) over a network
as separate hosts would, with nothing passing only because it is loopback. This host's name resolves to
127.0.0.1 in every namespace, as in many containers."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.training.nodes.network import bridged_namespaces
from tests.conftest import running_mlflow_server


@pytest.fixture(scope="module")
def separate_networks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two network namespaces on a bridge (node K at 10.77.X.(K+2), the bridge and MLflow at 10.77.X.1); yields
    the namespaces, each node's address, each node's host-side link (take it down to cut a node off, its sockets
    left open) and the MLflow server. Everything is deleted after the module."""
    tag = os.getpid() % 10000
    with contextlib.ExitStack() as stack:
        try:
            built = stack.enter_context(bridged_namespaces(2, tag))
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            pytest.fail(f"cannot make network namespaces here (needs root and iproute2): {exc}")
        root: Path = tmp_path_factory.mktemp("mlflow-bridge")
        server = stack.enter_context(running_mlflow_server(root, built.bridge_address, 5000 + tag % 1000))
        yield {
            "namespaces": built.namespaces,
            "addresses": built.addresses,
            "host_links": built.host_links,
            "mlflow": server,
        }
