"""Prefect cache keys for stages: a finished stage of a pipeline run is not recomputed when that run is
resumed. The key is the stage, the pipeline run id, the run folder (its path and the random id written when it was
created), the config hash, the data source's stamp and the upstream outputs; a different run, output folder, config
or data file never hits, and neither does a run whose folder was deleted and made again.
Must not import: torch, transformers, MLflow (Prefect calls the key function)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tasks.layout import RunLayout


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
