"""The base-model step of the flow: resolve ``model.source`` to a local folder (converting or building it once),
as a Prefect task. The logic is ``tasks.sources.resolve_model_source``.
Must not import: torch, transformers (the logic lives in ``tasks/sources.py``)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.sources import resolve_model_source


@task(name="resolve-model", cache_policy=NO_CACHE)
def resolve_model_task(source: str, revision: str | None = None) -> Path:
    """Prefect task: resolve the base model folder (converting or building it once)."""
    return resolve_model_source(source, revision)
