"""Keeping a server up: start its command, check its health endpoint, and start it again when it exits or stops
answering (``grpoflow serve`` under the Prefect deployment ``grpoflow-serve/champion``; compose's ``restart`` does
the same for the ``serve`` service).
Must not import: torch, transformers, Prefect, MLflow.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import InfrastructureError

logger = logging.getLogger(__name__)


class RestartLimit(InfrastructureError):
    """The server kept failing: more restarts within the window than allowed."""


@dataclass(frozen=True)
class Supervision:
    """How a server is watched: its health URL, how often, how many failed checks in a row restart it, how long a
    fresh start may take to answer, how many restarts an hour are tolerated, and how long one check waits."""

    health_url: str
    check_every_s: float = 10.0
    unhealthy_after: int = 3
    start_grace_s: float = 600.0
    max_restarts_per_hour: int = 5
    health_timeout_s: float = 5.0


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether ``url`` answers 200 (a server without a version to serve answers 503: not healthy).

    >>> healthy("http://127.0.0.1:9/health", timeout=0.2)
    False
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def supervise(
    command: list[str],
    watch: Supervision,
    log_path: Path,
    stop: threading.Event,
    on_restart: Callable[[int, str], None] | None = None,
) -> int:
    """Run ``command`` until ``stop`` is set, restarting it when it exits or fails ``unhealthy_after`` health checks
    in a row (after ``start_grace_s`` to come up); returns the number of restarts. Past ``max_restarts_per_hour``
    it gives up with RestartLimit (the deployment's retries, or a person, take over)."""
    restarts: list[float] = []
    log_path.parent.mkdir(parents=True, exist_ok=True)
    while not stop.is_set():
        with log_path.open("ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started, failures, up, why = time.monotonic(), 0, False, ""
        try:
            while not stop.wait(watch.check_every_s if up else min(watch.check_every_s, 1.0)):
                if process.poll() is not None:
                    why = f"it exited with code {process.returncode}"
                    break
                if healthy(watch.health_url, watch.health_timeout_s):
                    up, failures = True, 0
                    continue
                if not up and time.monotonic() - started < watch.start_grace_s:
                    continue
                failures += 1
                if failures >= watch.unhealthy_after:
                    why = f"{failures} health checks in a row failed" if up else "it never answered"
                    break
        finally:
            _stop(process)
        if stop.is_set():
            break
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < 3600] + [now]
        logger.warning("serve supervisor: the server is restarted (%s); its log: %s", why, log_path)
        if on_restart is not None:
            on_restart(len(restarts), why)
        if len(restarts) > watch.max_restarts_per_hour:
            raise RestartLimit(f"the server failed {len(restarts)} times within an hour (last: {why}); see {log_path}")
    return len(restarts)
