"""Hand-off of files between the pipeline and a stage on another worker, through the MLflow artifact store.

Owns: uploading to and downloading from the parent run's ``handoff/`` artifacts (e.g. MinIO/S3; never a shared
local path). The artifact names come from ``tasks/layout.py``. Must not import: torch, transformers, Prefect.
"""

from __future__ import annotations

from pathlib import Path

from tasks.layout import HANDOFF
from tasks.tracking.runs import Tracker


def handoff_upload(tracker: Tracker, local: Path, name: str) -> None:
    """Put a file or folder where a stage on another worker can fetch it: ``handoff/<name>``."""
    if local.is_dir():
        tracker.client.log_artifacts(tracker.parent_run_id, str(local), f"{HANDOFF}/{name}")
    else:
        tracker.client.log_artifact(tracker.parent_run_id, str(local), f"{HANDOFF}/{name}")


def handoff_download(tracking_uri: str, parent_run_id: str, name: str, destination: Path) -> Path:
    """Fetch what ``handoff_upload`` stored under ``name`` into ``destination``; returns the local path."""
    import mlflow.artifacts

    destination.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(
        run_id=parent_run_id, artifact_path=f"{HANDOFF}/{name}", dst_path=str(destination), tracking_uri=tracking_uri
    )
    return Path(local)
