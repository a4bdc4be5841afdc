"""The temporary Prefect server started while a run imports its stack, instead of after.

A ``grpoflow run`` with no Prefect API (no ``PREFECT_API_URL``, no ``grpoflow up``) gets a temporary server from
Prefect on its first API call: ``SubprocessASGIServer`` (``prefect.server.api.server``, not a public API) starts
uvicorn in a child process and waits about 5 s for it to answer. That wait came after the stack's imports, with
one core idle. ``start_early`` starts the same server in a thread as soon as the inputs are checked; the run
``join``s the thread before its flow starts, so Prefect's own first call finds the server it would have started
(the class keeps one instance per port) already up. Any failure here leaves Prefect's own path to start it.

Must not import (at module import): Prefect.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class EarlyServer:
    """A thread starting Prefect's temporary server; ``join`` waits for it (it never raises)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        # Not a daemon: a run that stops before its flow (a user error) still waits for the start to finish, so
        # Prefect's exit handler, registered with the server's process, stops it; none is left running.
        self._thread = threading.Thread(target=self._start, name="grpoflow-early-prefect-server", daemon=False)
        self._thread.start()

    def _start(self) -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().start()
        except BaseException as exc:  # Prefect's own first API call starts it then, and reports what fails
            self.error = exc

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            logger.debug("the early Prefect server did not start (%s); Prefect starts its own", self.error)


def start_early() -> EarlyServer | None:
    """Start Prefect's temporary server in the background when a run will need one (no API configured and
    ephemeral mode allowed), else None."""
    try:
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE
    except ImportError:
        return None
    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return None
    return EarlyServer()
