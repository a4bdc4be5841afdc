"""The stages' Prefect task wrapper and cache keys: a finished stage of a pipeline run is not recomputed when that
run is resumed. The key is the stage, the pipeline run id, the run folder (its path and the random id written when
it was created), the config hash, the data source's stamp and the upstream outputs; a different run, output folder,
config or data file never hits, and neither does a run whose folder was deleted and made again.
Must not import: torch, transformers, MLflow (Prefect calls the key function); Prefect only inside ``prefect_task``."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from tasks.layout import RunLayout

StageFunction = TypeVar("StageFunction", bound=Callable[..., Any])


def data_stamp(source: str) -> str:
    """Size and modification time of a data file or folder source (empty for built-in and Hub sources)."""
    path = Path(source).expanduser()
    if not path.exists():
        return ""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def _plain(value: Any) -> Any:
    return sorted(value) if isinstance(value, set | frozenset) else str(value)


def stage_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Prefect ``cache_key_fn`` for the stage tasks (their first two parameters are config and tracker)."""
    config, tracker = parameters["config"], parameters["tracker"]
    upstream = {k: v for k, v in parameters.items() if k not in ("config", "tracker")}
    run_dir = Path(tracker.run_dir).resolve()
    folder = [str(run_dir), RunLayout(run_dir).identity()]
    parts = [context.task.name, tracker.run_id, folder, config.config_hash(), data_stamp(config.data.source), upstream]
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=_plain).encode()).hexdigest()
    return f"grpoflow-{context.task.name}-{digest[:32]}"


def prefect_task(
    name: str, cache: Literal["stage", "never"] | None = None, **options: Any
) -> Callable[[StageFunction], StageFunction]:
    """The Prefect task decorator of a stage wrapper. ``cache="stage"``: keyed by ``stage_cache_key`` with the
    result persisted, so a resumed run skips the stages it finished; ``"never"``: Prefect's ``NO_CACHE``; ``None``:
    Prefect's default. ``options`` go to ``prefect.task`` as they are.

    Where Prefect is not installed, the wrapper is left a plain function: the stage functions below the wrappers
    then import and run without it (``bench/gpu_check.py`` on a GPU machine that has no Prefect), and a flow, which
    imports Prefect itself, cannot start there anyway.

    >>> prefect_task("sft", cache="stage")(lambda config: config).name
    'sft'
    """
    if importlib.util.find_spec("prefect") is None:  # absent, not broken: a broken install still fails loudly
        return lambda function: function
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    caching: dict[str, Any] = {
        "stage": {"cache_key_fn": stage_cache_key, "persist_result": True},
        "never": {"cache_policy": NO_CACHE},
        None: {},
    }[cache]
    return task(name=name, **caching, **options)
