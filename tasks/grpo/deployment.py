"""GRPO as its own Prefect deployment (``orchestration.grpo_deployment``): the hand-over through the MLflow artifact
store, the deployment's flow run, and the result read back from its stage run. Must not import: another stage's
module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.config import PipelineConfig
from tasks.grpo.stage import grpo_task
from tasks.layout import HANDOFF_GRPO_ADAPTER, HANDOFF_SFT_ADAPTER, HANDOFF_TRAIN, HOLDOUT_FILE, RemoteGrpoRequest
from tasks.tracking import Tracker, handoff_download, handoff_upload, prefect_task
from tasks.training import Selection, TrainResult


@prefect_task("grpo-deployment")
def remote_grpo_task(
    config: PipelineConfig,
    tracker: Tracker,
    train_path: Path,
    base_model_dir: Path,
    sft_adapter_dir: Path | None,
    keep_ids: set[str] | None = None,
) -> TrainResult:
    """GRPO as its own Prefect deployment (``orchestration.grpo_deployment``, e.g. on a GPU work pool): the
    training file and the SFT adapter go up to the MLflow artifact store, the deployment trains in its own
    MLflow stage run under this pipeline's parent run, and the adapter comes back the same way. The worker
    resolves the base model itself (``base_model_dir`` is this machine's path)."""
    from prefect.deployments import run_deployment

    handoff_upload(tracker, train_path, HANDOFF_TRAIN)
    if config.grpo.eval_steps and train_path.with_name(HOLDOUT_FILE).is_file():  # the in-training evaluation's
        handoff_upload(tracker, train_path.with_name(HOLDOUT_FILE), HANDOFF_TRAIN)
    if sft_adapter_dir is not None:
        handoff_upload(tracker, sft_adapter_dir, HANDOFF_SFT_ADAPTER)
    request = RemoteGrpoRequest(
        config=config.model_dump(mode="json"),
        run_id=tracker.run_id,
        tracking_uri=tracker.tracking_uri,
        experiment_id=tracker.experiment_id,
        parent_run_id=tracker.parent_run_id,
        train_file=train_path.name,
        has_sft_adapter=sft_adapter_dir is not None,
        keep_ids=sorted(keep_ids) if keep_ids is not None else None,
    )
    name = config.orchestration.grpo_deployment
    flow_run = run_deployment(
        name,
        parameters=request.parameters(),
        flow_run_name=f"{tracker.run_id}-grpo",
        timeout=config.orchestration.grpo_deployment_timeout_s,
    )
    state = flow_run.state
    if state is None or not state.is_completed():
        detail = f"{state.name}: {state.message}" if state else "no state (timed out waiting)"
        raise RuntimeError(f"GRPO deployment {name!r} (flow run {flow_run.id}) did not complete: {detail}")
    adapter_dir = handoff_download(
        tracker.tracking_uri, tracker.parent_run_id, HANDOFF_GRPO_ADAPTER, tracker.layout.stage_dir("grpo")
    )
    runs = tracker.stage_runs("grpo")
    metrics = runs[-1].data.metrics if runs else {}
    tags = runs[-1].data.tags if runs else {}
    stop = None
    if "grpo.stopped" in tags:  # the deployment reported its early stop in its stage run
        stop = {
            "cause": tags["grpo.stopped"],
            "step": int(metrics.get("stopped_at_step", 0)),
            "message": tags.get("grpo.stop_verdict", ""),
            "numbers": {},
        }
    steps, seconds = int(metrics.get("train_steps", 0)), float(metrics.get("train_seconds", 0.0))
    selection = None
    if "grpo.select" in tags:  # the deployment reported which step's adapter it handed back
        step = int(metrics.get("selected_step", steps))
        selection = Selection(tags["grpo.select"], step, steps, reason=tags.get("grpo.selection", "")).to_json()
    return TrainResult(adapter_dir, steps, seconds, stop=stop, selection=selection)


def grpo_task_for(config: PipelineConfig) -> Any:
    """The GRPO task this config runs: on this worker, or as the deployment ``orchestration.grpo_deployment``
    (both take the same arguments)."""
    return remote_grpo_task if config.orchestration.grpo_deployment else grpo_task
