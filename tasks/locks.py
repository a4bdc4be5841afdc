"""Locks a killed holder cannot keep: promotion (one per registered model at a time) and the first use of a new
SQLite tracking store (MLflow migrates the schema then; two processes doing it at once fail).

A local store (SQLite file or folder) gets a kernel lock on a file beside it: it is released when its holder
exits, however it exits. A tracking server gets a lease kept on the registered model, renewed by its holder
while it lives and taken over once it has expired.
Must not import: torch, transformers, Prefect.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tasks.errors import InfrastructureError

logger = logging.getLogger(__name__)

LEASE_TAG = "grpoflow.promotion_lease"


class LockTimeout(InfrastructureError, TimeoutError):
    """A lock was not granted in time; the message names the holder."""


def local_store_path(tracking_uri: str) -> Path | None:
    """The file or folder of a tracking store on this machine, or None for a server.

    >>> local_store_path("sqlite:////tmp/x/mlflow.db").as_posix(), local_store_path("http://127.0.0.1:5000")
    ('/tmp/x/mlflow.db', None)
    """
    parsed = urlparse(tracking_uri)
    if parsed.scheme == "sqlite":  # sqlite:///relative.db or sqlite:////absolute.db
        return Path(tracking_uri.removeprefix("sqlite:///"))
    if parsed.scheme in ("", "file"):
        return Path(parsed.path or tracking_uri)
    return None


def _lock_file(store: Path, name: str) -> Path:
    folder = store.parent / ".grpoflow-locks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / ("".join(c if c.isalnum() or c in "-_." else "_" for c in name) + ".lock")


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float, what: str) -> Iterator[None]:
    """An exclusive kernel lock on ``path``, waited for up to ``timeout_s`` seconds. The holder's pid and host are
    written into the file so a waiting process can say who holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        deadline = time.monotonic() + timeout_s
        said = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    holder = handle.read().strip()
                    raise LockTimeout(f"{what}: still held after {timeout_s:.0f} s by {holder}") from None
                if not said:
                    handle.seek(0)
                    logger.info("%s: waiting for %s", what, handle.read().strip() or "another process")
                    said = True
                time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def registry_lease(client: Any, name: str, lease_s: float, timeout_s: float) -> Iterator[None]:
    """A lease on registered model ``name`` for a tracking server: taken when absent or expired, confirmed by
    re-reading after a pause (the registry has no compare-and-set), renewed every third of ``lease_s`` while
    held, released on exit. A killed holder stops renewing and its lease expires after ``lease_s``."""
    from mlflow.exceptions import MlflowException

    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def current() -> dict[str, Any] | None:
        try:
            raw = client.get_registered_model(name).tags.get(LEASE_TAG)
        except MlflowException:
            return None  # no registered model yet: nothing holds it
        return json.loads(raw) if raw else None

    def write() -> None:
        try:
            client.get_registered_model(name)
        except MlflowException:
            with contextlib.suppress(MlflowException):  # another process may create it at the same moment
                client.create_registered_model(name, description="LoRA adapters trained by grpoflow")
        lease = {"holder": holder, "expires": time.time() + lease_s}
        client.set_registered_model_tag(name, LEASE_TAG, json.dumps(lease))

    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        lease = current()
        if lease is None or lease["holder"] == holder or lease["expires"] < time.time():
            write()
            time.sleep(min(1.0, lease_s / 10))  # let a rival's write land, then see who won
            lease = current()
            if lease is not None and lease["holder"] == holder:
                break
        if time.monotonic() >= deadline:
            raise LockTimeout(f"promotion lease on {name}: still held after {timeout_s:.0f} s by {lease}")
        if not said:
            logger.info("promotion of %s: waiting for the lease held by %s", name, lease and lease["holder"])
            said = True
        time.sleep(0.5)

    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 3):
            with contextlib.suppress(Exception):  # a missed renewal only shortens the lease
                write()

    renewer = threading.Thread(target=renew, name=f"lease-{name}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        with contextlib.suppress(Exception):
            if (current() or {}).get("holder") == holder:
                client.delete_registered_model_tag(name, LEASE_TAG)


@contextlib.contextmanager
def promotion_lock(tracking_uri: str, name: str, lease_s: float = 30.0, timeout_s: float = 1800.0) -> Iterator[None]:
    """One promotion of registered model ``name`` at a time, across processes and workers; a killed holder
    releases it (at once for a local store, after ``lease_s`` for a tracking server)."""
    store = local_store_path(tracking_uri)
    if store is not None:
        with file_lock(_lock_file(store, f"promote-{name}"), timeout_s, f"promotion of {name}"):
            yield
        return
    from tasks.runs import client_for

    with registry_lease(client_for(tracking_uri), name, lease_s, timeout_s):
        yield


@contextlib.contextmanager
def store_initialisation(tracking_uri: str, timeout_s: float = 300.0) -> Iterator[None]:
    """Serialise the first use of a local tracking store: MLflow creates and migrates its schema then."""
    store = local_store_path(tracking_uri)
    if store is None:
        yield
        return
    with file_lock(_lock_file(store, f"init-{store.name}"), timeout_s, f"tracking store {store}"):
        yield
