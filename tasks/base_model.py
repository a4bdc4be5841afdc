"""The base-model step of the flow: resolve ``model.source`` to a local folder (converting or building it once),
as a Prefect task. The logic is ``tasks.models.sources.resolve_model_source``.
Must not import: torch, transformers (the logic lives in ``tasks/models/sources.py``)."""

from __future__ import annotations

from pathlib import Path

from tasks.models import resolve_model_source
from tasks.tracking import prefect_task


@prefect_task("resolve-model", cache="never")
def resolve_model_task(source: str, revision: str | None = None) -> Path:
    """Prefect task: resolve the base model folder (converting or building it once)."""
    return resolve_model_source(source, revision)
