"""Prefect artifacts (markdown and tables) so the Prefect UI shows what each stage did without opening logs."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def _key(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def publish_markdown(name: str, markdown: str) -> None:
    """A markdown artifact on the current flow run; a failure to publish never fails the stage."""
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(markdown=markdown, key=_key(name), description=name)
    except Exception as exc:
        logger.warning("could not publish Prefect artifact %s: %s", name, exc)


def publish_table(name: str, rows: list[dict[str, Any]]) -> None:
    from prefect.artifacts import create_table_artifact

    try:
        create_table_artifact(table=rows, key=_key(name), description=name)
    except Exception as exc:
        logger.warning("could not publish Prefect artifact %s: %s", name, exc)
