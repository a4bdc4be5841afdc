"""The pipeline flow: validate → probe → sft → probe (gate) → grpo → evaluate → promote. It only composes: each
decision lives in the task or small function that owns it.
Must not hold stage logic or decisions: those belong to the tasks it calls."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow
from prefect.exceptions import TerminationSignal

from flows.services import local_store_server
from tasks.base_model import resolve_model_task
from tasks.config import PipelineConfig
from tasks.errors import GateStop, UserError
from tasks.evaluate import champion_task, evaluate_task, lineup
from tasks.grpo import grpo_task_for
from tasks.layout import RunLayout, write_atomically
from tasks.models.hardware import machine_facts
from tasks.preflight import preflight
from tasks.probe import NoLearningSignal, probe_task, prompts_to_keep
from tasks.promote import git_commit, promote_task
from tasks.sft import sft_task
from tasks.tracking import (
    announce_skipped,
    close_pipeline,
    last_completed_run,
    local_store_path,
    record_validated_data,
    runs_closed_on_termination,
    start_pipeline,
)
from tasks.training.nodes import store_served_to_nodes
from tasks.validate import validate_task

logger = logging.getLogger(__name__)


def new_run_id(config: PipelineConfig) -> str:
    """A run id that sorts by time and names the config and seed: ``demo-s0-20261129-140501``."""
    return f"{config.name}-s{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: a transient failure is retried; a user error (bad input) or a gate's stop would
    only fail the same way again."""
    error = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(error, UserError | GateStop)


def with_retries(config: PipelineConfig, *stage_tasks: Any) -> list[Any]:
    """The stage tasks with the configured retries for transient failures: a retried stage resumes, trainers from
    their last checkpoint, finished stages from Prefect's cache."""
    settings = config.orchestration
    options = {"retries": settings.task_retries, "retry_delay_seconds": settings.retry_delay_seconds}
    return [stage_task.with_options(**options, retry_condition_fn=worth_retrying) for stage_task in stage_tasks]


@flow(name="grpoflow-pipeline", flow_run_name="{run_id}", validate_parameters=False)
def pipeline(config: PipelineConfig, run_id: str, skip_unchanged: bool = False) -> dict[str, Any]:
    """Run every stage in order and return the run summary (also logged to MLflow as summary.json).

    ``skip_unchanged`` (scheduled runs): stop after validation when the config and the validated data are those
    of the last completed run. A run stopped by the probe or rejected by promotion emits a Prefect event."""
    preflight(config, tracking=True)  # on a deployment's worker too: missing inputs fail before any stage starts
    layout = RunLayout.of(config.output_dir, run_id)
    layout.prepare(config)  # the config as given: a resume serves the store again, on a port of its own
    with tracked_through_server(config, layout) as tracked:
        return run_stages(tracked, layout, skip_unchanged, store=config.resolved_tracking_uri())


@contextmanager
def tracked_through_server(config: PipelineConfig, layout: RunLayout) -> Iterator[PipelineConfig]:
    """``config``, or, where local nodes need an MLflow server and the store is a local SQLite file, ``config``
    tracking through a server over that file that lives as long as the run (the nodes reach it; the flow writes
    through it too, so the file has one writer)."""
    if not store_served_to_nodes(config, config.resolved_tracking_uri()):
        yield config
        return
    database = local_store_path(config.resolved_tracking_uri())
    log = layout.run_dir / "mlflow-server.log"
    with local_store_server(database, config.output_dir / "mlartifacts", log) as url:
        logger.info("MLflow server %s over %s for the nodes (log %s)", url, database, log)
        yield config.model_copy(update={"tracking": config.tracking.model_copy(update={"tracking_uri": url})})


def run_stages(config: PipelineConfig, layout: RunLayout, skip_unchanged: bool, store: str) -> dict[str, Any]:
    """The pipeline's stages in order (``pipeline``'s body); ``store``: the tracking store the summary names."""
    run_id = layout.run_id
    tracker = start_pipeline(config, layout)
    validate, probe, sft_stage, grpo_stage, champion, evaluate = with_retries(
        config, validate_task, probe_task, sft_task, grpo_task_for(config), champion_task, evaluate_task
    )
    summary: dict[str, Any] = {"run_id": run_id, "run_dir": str(layout.run_dir), "probes": {}}
    started = time.monotonic()  # what the run's figures were measured on, and how long it took (README's tables)
    summary["run"] = {
        "config_hash": config.config_hash(),
        "commit": git_commit(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_facts(config.model.precision),
    }
    summary["mlflow"] = {
        "tracking_uri": store,
        "experiment_id": tracker.experiment_id,
        "parent_run_id": tracker.parent_run_id,
    }
    status = "FAILED"
    with runs_closed_on_termination(tracker):  # a cancel from the UI leaves no MLflow run open
        try:
            data = validate(config, tracker)
            summary["data"] = data.to_json()
            record_validated_data(tracker, data, config.data.source)
            previous = last_completed_run(tracker, config.config_hash(), data.fingerprint) if skip_unchanged else None
            if previous:
                summary["skipped"] = announce_skipped(tracker, previous)
                status = "FINISHED"
                return summary
            base_dir = resolve_model_task(config.model.source, config.model.revision)
            probes = summary["probes"]
            if config.probe.enabled:
                probes["base"] = probe(
                    config, tracker, data.train_path, base_dir, None, "base", gate=not config.sft.enabled
                )
            sft = sft_stage(config, tracker, data.train_path, base_dir) if config.sft.enabled else None
            sft_adapter = sft.adapter_dir if sft else None
            if sft_adapter and config.probe.enabled:
                probes["sft"] = probe(config, tracker, data.train_path, base_dir, sft_adapter, "sft", gate=True)
            keep_ids = prompts_to_keep(config, probes)
            grpo = grpo_stage(config, tracker, data.train_path, base_dir, sft_adapter, keep_ids)
            # a stopped GRPO is still evaluated; "selected": which step's adapter went on, and why
            summary["grpo"] = {"steps": grpo.steps, "stopped": grpo.stop, "selected": getattr(grpo, "selection", None)}
            reference = champion(config, tracker)
            models = lineup(base_dir, grpo.adapter_dir, sft_adapter, reference)
            evaluation = evaluate(config, tracker, data.holdout_path, models)
            summary["evaluation"] = evaluation.to_json()
            promotion = promote_task(config, tracker, evaluation, grpo.adapter_dir, sft_adapter, data, probes)
            summary["promotion"] = promotion.to_json()
            status = "FINISHED"
        except NoLearningSignal as exc:
            summary["stopped"] = str(exc)
            raise
        except (KeyboardInterrupt, TerminationSignal):  # Ctrl-C, or a cancel from the Prefect UI (SIGTERM)
            status = "KILLED"
            raise
        finally:
            summary["probes"] = {label: result.to_json() for label, result in summary["probes"].items()}
            summary["run"]["wall_seconds"] = round(time.monotonic() - started, 1)
            close_pipeline(tracker, status, summary)  # never hides the stage's own error
            write_atomically(layout.summary_path, json.dumps(summary, indent=2, default=str))
    return summary
