"""Entry points for Prefect deployments, which pass plain parameters (a config path) rather than objects."""

from __future__ import annotations

from prefect import flow

from flows.pipeline import new_run_id, pipeline
from tasks.config import load_config


@flow(name="grpoflow-scheduled")
def scheduled_pipeline(config_path: str = "configs/demo.yaml", seed: int | None = None) -> dict:
    """Load the config file and run the pipeline as a subflow (its run named by the pipeline run id)."""
    config = load_config(config_path, {"seed": seed} if seed is not None else None)
    return pipeline(config, new_run_id(config))
