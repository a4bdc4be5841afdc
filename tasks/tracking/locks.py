"""Locks a killed holder cannot keep, on a local tracking store: a kernel lock on a file beside the store (SQLite
file or folder), released when its holder exits, however it exits. The first use of a new SQLite store is
serialised with one (MLflow migrates the schema then; two processes doing it at once fail); promotion uses them
too (``tasks/registry/locks.py``, which adds a lease for tracking servers).
Must not import: torch, transformers, Prefect, MLflow.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from tasks.errors import InfrastructureError

logger = logging.getLogger(__name__)


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


def lock_file_for(store: Path, name: str) -> Path:
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
def store_initialisation(tracking_uri: str, timeout_s: float = 300.0) -> Iterator[None]:
    """Serialise the first use of a local tracking store: MLflow creates and migrates its schema then."""
    store = local_store_path(tracking_uri)
    if store is None:
        yield
        return
    with file_lock(lock_file_for(store, f"init-{store.name}"), timeout_s, f"tracking store {store}"):
        yield
