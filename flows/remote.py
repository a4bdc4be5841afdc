"""The GRPO stage as its own flow, for a deployment on another work pool (a GPU worker): it shares no local
path with the pipeline; inputs and the adapter travel through the MLflow artifact store, and checkpoints go to
``tasks.training.remote_checkpoints``'s store, so a new worker continues a killed one's training. Its parameters are
``tasks.layout.RemoteGrpoRequest``'s fields (the names the deployment in ``infra/prefect.yaml`` takes).
Must not hold stage logic: it fetches inputs, calls the GRPO task, hands the adapter back."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow

from tasks.base_model import resolve_model_task
from tasks.config import PipelineConfig
from tasks.grpo import grpo_task
from tasks.layout import (
    CHECKPOINTS,
    HANDOFF_GRPO_ADAPTER,
    HANDOFF_SFT_ADAPTER,
    HANDOFF_TRAIN,
    HOLDOUT_FILE,
    RemoteGrpoRequest,
)
from tasks.tracking import Tracker, client_for, handoff_download, handoff_upload
from tasks.training import clear, restore_newest, resume_source, store_for


@flow(name="grpoflow-grpo", flow_run_name="{run_id}-grpo", validate_parameters=False)
def grpo_remote_flow(
    config: dict[str, Any],
    run_id: str,
    tracking_uri: str,
    experiment_id: str,
    parent_run_id: str,
    train_file: str = "train.jsonl",
    has_sft_adapter: bool = True,
    keep_ids: list[str] | None = None,
) -> dict[str, Any]:
    """Fetch the training file and SFT adapter, run the GRPO stage under the pipeline's MLflow parent run, and
    hand the adapter back. Called by the pipeline through ``run_deployment``."""
    request = RemoteGrpoRequest(
        config, run_id, tracking_uri, experiment_id, parent_run_id, train_file, has_sft_adapter, keep_ids
    )
    settings = PipelineConfig.model_validate(request.config)
    workdir = Path(tempfile.mkdtemp(prefix=f"grpoflow-{run_id}-grpo-"))
    try:
        inputs = workdir / "inputs"
        train_path = handoff_download(tracking_uri, parent_run_id, request.train_artifact, inputs)
        if settings.grpo.eval_steps:  # the hold-out file, beside the train file (the in-training evaluation's)
            holdout = handoff_download(tracking_uri, parent_run_id, f"{HANDOFF_TRAIN}/{HOLDOUT_FILE}", inputs)
            if holdout != train_path.with_name(HOLDOUT_FILE):
                holdout.replace(train_path.with_name(HOLDOUT_FILE))
        sft_adapter = (
            handoff_download(tracking_uri, parent_run_id, HANDOFF_SFT_ADAPTER, inputs) if has_sft_adapter else None
        )
        base_dir = resolve_model_task(settings.model.source, settings.model.revision)
        tracker = Tracker(tracking_uri, experiment_id, parent_run_id, run_id, workdir / run_id)
        # Checkpoints outlive this worker: a new one (a resume, a retry) continues from the newest.
        where = {
            "remote_checkpoints": settings.orchestration.remote_checkpoints,
            "tracking_uri": tracking_uri,
            "parent_run_id": parent_run_id,
            "run_id": run_id,
        }
        # After `grpoflow run --resume` (a new parent run) the checkpoints lie in the killed attempt's run.
        source = resume_source(client_for(tracking_uri), experiment_id, run_id, where)
        restore_newest(store_for(source), tracker.layout.stage_dir("grpo") / CHECKPOINTS)
        store = store_for(where)
        keep = set(keep_ids) if keep_ids else None
        result = grpo_task(settings, tracker, train_path, base_dir, sft_adapter, keep, checkpoint_store=where)
        handoff_upload(tracker, result.adapter_dir, HANDOFF_GRPO_ADAPTER)
        clear(store)  # the adapter is handed back: its checkpoints are done with
        if source != where:
            clear(store_for(source))  # and so are the killed attempt's
        return {"steps": result.steps, "seconds": result.seconds, "worker_dir": str(workdir)}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
