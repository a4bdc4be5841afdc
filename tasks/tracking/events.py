"""Prefect events about a pipeline run, and closing its MLflow runs when the run is cancelled (SIGTERM).

Owns: ``grpoflow.run.*`` and ``grpoflow.champion.*`` events, and the SIGTERM handler.
Must not import: torch, transformers.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.tracking.runs import SKIPPED_TAG, Tracker, close_open_runs

logger = logging.getLogger(__name__)


def _emit(event: str, resource_id: str, name: str, payload: dict[str, Any]) -> None:
    """A Prefect event for automations to notify on; a failure to emit is logged, never raised."""
    try:
        from prefect.events import emit_event

        emit_event(
            event=event, resource={"prefect.resource.id": resource_id, "prefect.resource.name": name}, payload=payload
        )
    except Exception as exc:
        logger.warning("could not emit Prefect event %s: %s", event, exc)


def emit_pipeline_event(event: str, run_id: str, payload: dict[str, Any]) -> None:
    """A Prefect event about a pipeline run: ``grpoflow.run.<event>``."""
    _emit(f"grpoflow.run.{event}", f"grpoflow.run.{run_id}", run_id, payload)


def emit_champion_event(event: str, model_name: str, payload: dict[str, Any]) -> None:
    """A Prefect event about a registered model's champion: ``grpoflow.champion.<event>`` (``regressed``,
    ``rolled-back``)."""
    _emit(f"grpoflow.champion.{event}", f"grpoflow.model.{model_name}", model_name, payload)


def announce_skipped(tracker: Tracker, previous_run: str) -> str:
    """Record on the parent run, in the Prefect UI and as an event that this run has nothing to train; returns
    the message."""
    from tasks.tracking.reporting import publish_markdown

    message = f"config and data unchanged since run {previous_run}: nothing to train"
    tracker.client.set_tag(tracker.parent_run_id, SKIPPED_TAG, message)
    publish_markdown("pipeline-skipped", f"### skipped\n{message}\n")
    emit_pipeline_event("skipped-unchanged", tracker.run_id, {"previous_run": previous_run})
    return message


@contextmanager
def runs_closed_on_termination(tracker: Tracker) -> Iterator[None]:
    """While inside, SIGTERM (a cancel from the Prefect UI, a pre-empted worker) first marks every open MLflow
    run of this pipeline run KILLED, then hands the signal to the previous handler (Prefect's raises
    TerminationSignal). The runs are closed in the handler itself because that exception can land in a
    finalizer or weakref callback, where Python swallows it and no ``finally`` would run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def close_then_forward(signum: int, frame: Any) -> None:
        try:
            close_open_runs(tracker.client, tracker.experiment_id, tracker.run_id, "KILLED")
        except Exception as exc:  # the signal must still reach Prefect
            logger.warning("could not close the MLflow runs of %s on SIGTERM: %s", tracker.run_id, exc)
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, close_then_forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
