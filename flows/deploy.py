"""Entry points for Prefect deployments, which pass plain parameters (a config path) rather than objects.
Must not hold stage logic: it loads the config and calls the pipeline flow."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.pipeline import new_run_id, pipeline
from tasks.config import load_config


@flow(name="grpoflow-scheduled")
def scheduled_pipeline(
    config_path: str = "configs/demo.yaml",
    seed: int | None = None,
    overrides: dict[str, Any] | None = None,
    skip_unchanged: bool = True,
) -> dict:
    """Load the config file (plus dotted-key ``overrides``) and run the pipeline as a subflow named by the
    pipeline run id. With ``skip_unchanged``, a run whose config and data match the last completed run stops
    after validation and says so."""
    values = dict(overrides or {})
    if seed is not None:
        values["seed"] = seed
    config = load_config(config_path, values)
    return pipeline(config, new_run_id(config), skip_unchanged=skip_unchanged)
