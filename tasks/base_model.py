"""The base-model step of the flow: resolve ``model.source`` to a local folder (converting or building it once),
as a Prefect task. The logic is ``tasks.sources.resolve_model_source``.
Must not import: torch, transformers (the logic lives in ``tasks/sources.py``)."""

from __future__ import annotations

from pathlib import Path

from tasks.caching import prefect_task
from tasks.sources import resolve_model_source


@prefect_task("resolve-model", cache="never")
def resolve_model_task(source: str, revision: str | None = None) -> Path:
    """Prefect task: resolve the base model folder (converting or building it once)."""
    return resolve_model_source(source, revision)
