"""The pipeline flow: validate → probe → sft → probe (gate) → grpo → evaluate → promote. It only composes."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from prefect import flow
from prefect.exceptions import TerminationSignal

from tasks.config import PipelineConfig
from tasks.evaluate import ModelSpec, champion_spec, evaluate_task
from tasks.grpo import grpo_task, remote_grpo_task
from tasks.models import resolve_model_task
from tasks.probe import NoLearningSignal, pass_rate_filter, probe_task
from tasks.promote import promote_task
from tasks.reporting import publish_markdown
from tasks.sft import sft_task
from tasks.tracking import (
    FINGERPRINT_TAG,
    emit_pipeline_event,
    finish_pipeline,
    last_completed_run,
    prepare_run_dir,
    runs_closed_on_termination,
    start_pipeline,
)
from tasks.validate import validate_task


def new_run_id(config: PipelineConfig) -> str:
    """A run id that sorts by time and names the config and seed: ``demo-s0-20261129-140501``."""
    return f"{config.name}-s{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=5
        ).stdout.strip()
    except Exception:
        return "unknown"


@flow(name="grpoflow-pipeline", flow_run_name="{run_id}", validate_parameters=False)
def pipeline(config: PipelineConfig, run_id: str, skip_unchanged: bool = False) -> dict[str, Any]:
    """Run every stage in order and return the run summary (also logged to MLflow as summary.json).

    ``skip_unchanged`` (scheduled runs): stop after validation when the config and the validated data are those
    of the last completed run. A run stopped by the probe or rejected by promotion emits a Prefect event."""
    run_dir = config.output_dir / run_id
    prepare_run_dir(config, run_dir)
    tracker = start_pipeline(config, run_id, run_dir)
    # Retried stages resume: trainers from their last checkpoint, finished stages from Prefect's cache.
    validate, probe, sft_stage, grpo_stage, evaluate = (
        task.with_options(
            retries=config.orchestration.task_retries, retry_delay_seconds=config.orchestration.retry_delay_seconds
        )
        for task in (validate_task, probe_task, sft_task, grpo_task, evaluate_task)
    )
    summary: dict[str, Any] = {"run_id": run_id, "run_dir": str(run_dir), "probes": {}}
    status = "FAILED"
    with runs_closed_on_termination(tracker):  # a cancel from the UI leaves no MLflow run open
        try:
            data = validate(config, tracker)
            summary["data"] = data.to_json()
            tracker.client.set_tag(tracker.parent_run_id, FINGERPRINT_TAG, data.fingerprint)
            previous = last_completed_run(tracker, config.config_hash(), data.fingerprint) if skip_unchanged else None
            if previous:
                summary["skipped"] = f"config and data unchanged since run {previous}: nothing to train"
                tracker.client.set_tag(tracker.parent_run_id, "grpoflow.skipped", summary["skipped"])
                publish_markdown("pipeline-skipped", f"### skipped\n{summary['skipped']}\n")
                emit_pipeline_event("skipped-unchanged", run_id, {"previous_run": previous})
                status = "FINISHED"
                return summary
            base_dir = resolve_model_task(config.model.source, config.model.revision)
            probes: dict[str, Any] = {}
            if config.probe.enabled:
                probes["base"] = probe(
                    config, tracker, data.train_path, base_dir, None, "base", gate=not config.sft.enabled
                )
                summary["probes"]["base"] = probes["base"].to_json()
            sft = sft_stage(config, tracker, data.train_path, base_dir) if config.sft.enabled else None
            if sft is not None and config.probe.enabled:
                probes["sft"] = probe(config, tracker, data.train_path, base_dir, sft.adapter_dir, "sft", gate=True)
                summary["probes"]["sft"] = probes["sft"].to_json()
            keep_ids = None
            if config.probe.pass_rate_band and probes:
                keep_ids = pass_rate_filter(probes.get("sft") or probes["base"], config.probe.pass_rate_band)
            sft_adapter = sft.adapter_dir if sft else None
            if config.orchestration.grpo_deployment:  # on another worker: inputs and adapter go through MLflow
                grpo = remote_grpo_task(config, tracker, data.train_path, sft_adapter, keep_ids)
            else:
                grpo = grpo_stage(config, tracker, data.train_path, base_dir, sft_adapter, keep_ids)
            champion_version, champion = champion_spec(config, run_dir / "champion")
            models = [ModelSpec("base", base_dir)]
            models += [ModelSpec("sft", base_dir, sft_adapter)] if sft_adapter else []
            models += [champion] if champion else []
            models += [ModelSpec("grpo", base_dir, grpo.adapter_dir)]
            evaluation = evaluate(config, tracker, data.holdout_path, models)
            summary["evaluation"] = evaluation.to_json()
            lineage = {
                "pipeline_run_id": run_id,
                "mlflow_parent_run_id": tracker.parent_run_id,
                "base_model": config.model.source,
                "config_hash": config.config_hash(),
                "data_fingerprint": data.fingerprint,
                "git_commit": git_commit(),
            }
            promotion = promote_task(
                config, tracker, evaluation, grpo.adapter_dir, sft_adapter, champion_version, lineage
            )
            summary["promotion"] = promotion.to_json()
            if not promotion.promoted:
                emit_pipeline_event("promotion-rejected", run_id, promotion.to_json())
            status = "FINISHED"
        except NoLearningSignal as exc:
            summary["stopped"] = str(exc)
            emit_pipeline_event("stopped-by-probe", run_id, {"message": str(exc)})
            raise
        except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C, or a cancel from the Prefect UI (SIGTERM)
            status = "KILLED"
            raise
        finally:
            summary["stage_seconds"] = stage_seconds(tracker)
            finish_pipeline(tracker, status, summary)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "summary.json").write_text(_dump(summary))
    return summary


def stage_seconds(tracker: Any) -> dict[str, float]:
    """Wall seconds per stage, as logged on the parent MLflow run."""
    run = tracker.client.get_run(tracker.parent_run_id)
    return {k.removesuffix("_seconds"): v for k, v in run.data.metrics.items() if k.endswith("_seconds")}


def _dump(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
