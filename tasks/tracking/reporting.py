"""What the Prefect UI shows of a stage: markdown and table artifacts, and a link to the stage's MLflow run.

Owns: Prefect artifacts. Must not import: torch, transformers. A failure to publish never fails a stage.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tasks.tracking.runs import StageRun, Tracker

logger = logging.getLogger(__name__)


def _key(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def progress_text(markdown: str) -> str:
    """The words of a stage's markdown summary on one line, for the run log (headings and tables dropped).

    >>> progress_text("### promote\\nv3 became **champion**: gain +2.0%\\n\\n| a | b |\\n|---|---|\\n")
    'v3 became champion: gain +2.0%'
    """
    lines = [line.strip() for line in markdown.splitlines()]
    kept = [line for line in lines if line and not line.startswith(("#", "|"))]
    return " ".join(kept).replace("**", "").replace("`", "")


def publish_markdown(name: str, markdown: str) -> None:
    """A markdown artifact on the current flow run; its words also go to the run log (the Prefect UI's logs)."""
    from prefect.artifacts import create_markdown_artifact

    logger.info("%s: %s", name, progress_text(markdown))

    try:
        create_markdown_artifact(markdown=markdown, key=_key(name), description=name)
    except Exception as exc:
        logger.warning("could not publish Prefect artifact %s: %s", name, exc)


def publish_table(name: str, rows: list[dict[str, Any]]) -> None:
    """A table artifact on the current flow run; each row also goes to the run log as ``key=value`` pairs."""
    from prefect.artifacts import create_table_artifact

    for row in rows[:20]:
        logger.info("%s: %s", name, ", ".join(f"{key}={value}" for key, value in row.items()))

    try:
        create_table_artifact(table=rows, key=_key(name), description=name)
    except Exception as exc:
        logger.warning("could not publish Prefect artifact %s: %s", name, exc)


def link_mlflow_run(tracker: Tracker, name: str, mlflow_run_id: str) -> None:
    """A Prefect link artifact to the stage's MLflow run, so the Prefect UI leads to the details (only when
    tracking goes through a server that has a UI)."""
    url = tracker.run_url(mlflow_run_id)
    if url is None:
        return
    try:
        from prefect.artifacts import create_link_artifact

        create_link_artifact(link=url, link_text=f"MLflow run: {name}", key=f"mlflow-{name}".replace("_", "-"))
    except Exception as exc:
        logger.warning("could not publish the MLflow link of stage %s: %s", name, exc)


@contextmanager
def tracked_stage(tracker: Tracker, name: str) -> Iterator[StageRun]:
    """The stage's MLflow run (``Tracker.stage``), linked from the Prefect UI once it finished."""
    with tracker.stage(name, on_success=lambda stage, run_id: link_mlflow_run(tracker, stage, run_id)) as stage:
        yield stage
