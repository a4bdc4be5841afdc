"""Prefect events and artifacts are side channels: outside a flow, or with no Prefect API, they never fail a stage;
SIGTERM inside a pipeline run closes its open MLflow runs before Prefect's handler sees it."""

import logging
import os
import signal
from pathlib import Path

import pytest

from tasks.layout import RunLayout
from tasks.tracking import emit_pipeline_event, publish_markdown, publish_table, start_pipeline
from tasks.tracking.events import runs_closed_on_termination


def test_events_and_artifacts_outside_a_flow_do_not_raise(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        emit_pipeline_event("tested", "no-such-run", {"n": 1})
        publish_markdown("tested", "### a heading\ntext")
        publish_table("tested", [{"a": 1}])


def test_sigterm_marks_the_open_runs_killed_then_forwards(tiny_config, tmp_path: Path) -> None:
    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run"))
    forwarded = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: forwarded.append(signum))
    try:
        with runs_closed_on_termination(tracker):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert forwarded == [signal.SIGTERM]
    assert tracker.client.get_run(tracker.parent_run_id).info.status == "KILLED"
