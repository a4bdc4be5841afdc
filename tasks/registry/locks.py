"""One promotion of a registered model at a time, across processes and workers, by a lock a killed holder cannot
keep: a kernel lock beside a local store (``tasks/tracking/locks.py``), or a lease kept on the registered model
of a tracking server, renewed by its holder while it lives and taken over once it has expired.
Must not import: torch, transformers, Prefect.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from tasks.tracking import LockTimeout, client_for, file_lock, local_store_path, lock_file_for

logger = logging.getLogger(__name__)

LEASE_TAG = "grpoflow.promotion_lease"


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
        with file_lock(lock_file_for(store, f"promote-{name}"), timeout_s, f"promotion of {name}"):
            yield
        return
    with registry_lease(client_for(tracking_uri), name, lease_s, timeout_s):
        yield
