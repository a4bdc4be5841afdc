"""The champion watch flow (``grpoflow watch``, deployment ``grpoflow-watch/daily``): re-evaluate ``@champion``,
roll back when an earlier champion is now better (``watch.action: rollback``), and say so in MLflow, the
Prefect UI and a Prefect event. Must not hold logic: ``tasks/watch.py`` decides and moves."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect import flow

from tasks.config import PipelineConfig, load_config
from tasks.tracking import emit_champion_event, publish_markdown
from tasks.watch import WatchReport, record_watch_run, run_watch

logger = logging.getLogger(__name__)


@flow(name="grpoflow-watch", flow_run_name="watch", validate_parameters=False)
def watch_flow(
    config: PipelineConfig | None = None,
    name: str | None = None,
    config_path: str = "configs/demo.yaml",
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Judge ``name@champion`` (default: the config's registered model) and act on the decision. A deployment
    passes ``config_path`` (plus dotted-key ``overrides``); the command passes the loaded ``config``."""
    config = config or load_config(config_path, dict(overrides or {}))
    name = name or config.tracking.registered_model_name
    work = config.output_dir / "watch" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        report: WatchReport = run_watch(config, name, Path(scratch))
    mlflow_run = record_watch_run(config, report, work)
    publish_markdown(f"watch-{name}", report.markdown())
    decision = report.decision
    if decision and decision.event:
        payload = {
            "versions": report.versions,
            "reason": decision.reason,
            "moved_to": decision.move_to,
            "mlflow_run_id": mlflow_run,
        }
        emit_champion_event(decision.event, name, payload)
    return {**report.to_json(), "mlflow_run_id": mlflow_run}
