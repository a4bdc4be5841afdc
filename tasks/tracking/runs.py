"""MLflow runs of a pipeline run: the parent run, one nested run per stage, closing them, finding earlier runs.

Everything goes through an explicit ``MlflowClient`` and run ids (no fluent "active run"), so stages work the
same in any thread or worker process.
Owns: the run lifecycle and its tags. Must not import: transformers, Prefect; torch only to read its thread count
when a pipeline run starts (the trainer callback lives
in ``tasks/training/trainer.py``, Prefect artifacts and events in ``reporting.py`` and ``events.py``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from reward_fns.judges.settings import redact_credentials
from tasks.errors import GrpoflowError, is_disk_full
from tasks.layout import OutputDirError, RunLayout
from tasks.tracking.client import client_for, tracking_error

logger = logging.getLogger(__name__)

RUN_ID_TAG = "grpoflow.run_id"
STAGE_TAG = "grpoflow.stage"
FINGERPRINT_TAG = "grpoflow.data_fingerprint"
SKIPPED_TAG = "grpoflow.skipped"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"


def run_page(ui_url: str, experiment_id: str, mlflow_run_id: str) -> str:
    """The MLflow UI page of a run, in the "Model training" view (MLflow 3 opens runs in its GenAI view
    otherwise, whatever the experiment's kind).

    >>> run_page("http://127.0.0.1:5000/", "1", "abc")
    'http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning'
    """
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{mlflow_run_id}?workflowType=machine_learning"


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class StageRun:
    tracking_uri: str
    run_id: str
    stage: str
    dir: Path

    @property
    def client(self) -> Any:
        return client_for(self.tracking_uri)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None and v == v]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        elif path.is_file():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, table: dict[str, list[Any]], name: str) -> None:
        """A table artifact the MLflow UI shows as a table (compare across steps in the Evaluation view)."""
        self.client.log_table(self.run_id, data=table, artifact_file=name)

    def log_dict(self, data: Any, name: str) -> None:
        self.client.log_dict(self.run_id, data, name)


@dataclass
class Tracker:
    """The pipeline run as MLflow sees it; small and picklable so Prefect can pass it between tasks."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    run_id: str
    run_dir: Path

    @property
    def client(self) -> Any:
        return client_for(self.tracking_uri)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir)

    def stage_run_ids(self) -> dict[str, str]:
        """``{"<stage>_run_id": mlflow run id}`` for the stages of this pipeline run so far (lineage tags)."""
        return {f"{run.data.tags[STAGE_TAG]}_run_id": run.info.run_id for run in self.stage_runs()}

    def stage_runs(self, stage: str | None = None) -> list[Any]:
        """The MLflow runs of this pipeline run's stages (of one stage when named), oldest first."""
        runs = self.client.search_runs(
            [self.experiment_id],
            f"tags.`mlflow.parentRunId` = '{self.parent_run_id}'",
            order_by=["attributes.start_time ASC"],
        )
        return [r for r in runs if STAGE_TAG in r.data.tags and stage in (None, r.data.tags[STAGE_TAG])]

    def run_url(self, mlflow_run_id: str) -> str | None:
        """The MLflow UI address of a run, when tracking goes through a server."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return None
        return run_page(self.tracking_uri, self.experiment_id, mlflow_run_id)

    def _list_datasets(self, stage_run_id: str) -> None:
        """The data the pipeline's run lists (its validated splits), listed on a stage's run too. Lineage is a
        record, not a gate: a failure is a warning and the stage goes on."""
        from tasks.tracking.lineage import copy_splits

        try:
            copy_splits(self.client, self.parent_run_id, stage_run_id)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not list the run's datasets on stage run %s: %s", stage_run_id, exc)

    @contextmanager
    def stage(self, name: str, on_success: Callable[[str, str], None] | None = None) -> Iterator[StageRun]:
        """A nested MLflow run for one stage; closed FINISHED or FAILED, with wall time and peak memory.
        ``on_success(name, mlflow_run_id)`` runs when the stage finished (the Prefect link to the run)."""
        stage_dir = self.layout.stage_dir(name)
        stage_dir.mkdir(parents=True, exist_ok=True)
        try:
            run = self.client.create_run(
                self.experiment_id,
                run_name=name,
                tags={"mlflow.parentRunId": self.parent_run_id, RUN_ID_TAG: self.run_id, STAGE_TAG: name},
            )
        except Exception as exc:
            raise tracking_error(self.tracking_uri, f"opening the MLflow run of stage {name}", exc) from exc
        stage = StageRun(self.tracking_uri, run.info.run_id, name, stage_dir)
        self._list_datasets(run.info.run_id)
        started = time.perf_counter()
        status = "FAILED"
        logger.info("stage %s started (MLflow run %s)", name, run.info.run_id)
        try:
            yield stage
            status = "FINISHED"
            if on_success is not None:
                on_success(name, stage.run_id)
        except Exception as exc:
            # Libraries report a full disk in their own words (torch's writer: "file write failed", no errno);
            # grpoflow's own errors (a gate's stop, a user error, a disk error already named) keep theirs.
            if (is_disk_full(exc) or _nearly_full(stage_dir)) and not isinstance(exc, GrpoflowError):
                raise OutputDirError(
                    errno.ENOSPC, f"disk full while stage {name} wrote (under {stage_dir} or the tracking store)"
                ) from exc
            raise
        finally:
            seconds = time.perf_counter() - started
            logger.info("stage %s %s after %.1f s", name, "finished" if status == "FINISHED" else "failed", seconds)
            try:
                stage.log_metrics({"stage_seconds": seconds, "peak_rss_mb": peak_rss_mb()})
                self.client.log_metric(self.parent_run_id, f"{name}_seconds", seconds)
                self.client.set_terminated(stage.run_id, status)
            except Exception as exc:  # never hide the stage's own error behind a tracking one
                logger.warning("could not close MLflow run of stage %s: %s", name, exc)


def _nearly_full(folder: Path, below_mb: float = 16) -> bool:
    try:
        return shutil.disk_usage(folder).free < below_mb * 2**20
    except OSError:
        return False


def experiment_for(config: Any, client: Any) -> str:
    """The id of the configured experiment, created on first use: a local store keeps its artifacts beside it
    (a tracking server chooses and serves its own location), and the experiment is marked as holding training
    runs (MLflow 3's UI opens it on its GenAI overview otherwise)."""
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    if experiment is None:
        local = not config.resolved_tracking_uri().startswith(("http://", "https://", "databricks"))
        artifacts = (config.output_dir.resolve() / "mlartifacts").as_uri() if local else None
        experiment_id = client.create_experiment(config.tracking.experiment_name, artifact_location=artifacts)
    else:
        experiment_id = experiment.experiment_id
    if experiment is None or EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, "custom_model_development")
    return experiment_id


def start_pipeline(config: Any, layout: RunLayout) -> Tracker:
    """Create (or reuse) the experiment and open the pipeline's parent run, tagged with the run id."""
    run_id = layout.run_id
    if config.tracking.http_retries is not None:
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(config.tracking.http_retries)
    if config.tracking.http_timeout_s is not None:
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(config.tracking.http_timeout_s))
    try:
        client = client_for(config.resolved_tracking_uri())
        experiment_id = experiment_for(config, client)
        earlier = close_interrupted_runs(client, experiment_id, run_id)
        if earlier:
            logger.warning("closed the MLflow runs an earlier attempt at %s left RUNNING (marked FAILED)", run_id)
        parent = client.create_run(
            experiment_id,
            run_name=run_id,
            tags={
                RUN_ID_TAG: run_id,
                "grpoflow.config_hash": config.config_hash(),
                "grpoflow.name": config.name,
                **reproducibility_tags(config.seed),
                **({"grpoflow.resumed_from": ",".join(earlier)} if earlier else {}),
            },
        )
    except Exception as exc:
        raise tracking_error(config.resolved_tracking_uri(), "starting the pipeline run", exc) from exc
    tracker = Tracker(config.resolved_tracking_uri(), experiment_id, parent.info.run_id, run_id, layout.run_dir)
    stage = StageRun(tracker.tracking_uri, parent.info.run_id, "pipeline", layout.run_dir)
    stage.log_params(_flatten(config.model_dump(mode="json")))
    return tracker


# What decides a run's numbers besides its config: same seed, thread count and versions give the same adapter.
REPRODUCED_BY = ("torch", "transformers", "trl", "peft", "accelerate", "numpy", "math-verify", "vllm", "grpoflow")


def reproducibility_tags(seed: int) -> dict[str, str]:
    """The seed, torch's intra-op thread count and the versions of the libraries that decide a run's numbers, as
    tags of the parent run (a library that is not installed is left out).

    >>> tags = reproducibility_tags(7); tags["grpoflow.seed"], "grpoflow.version.torch" in tags
    ('7', True)
    """
    import torch  # the flow's process trains or generates with it anyway; its thread count is the one in force

    tags = {"grpoflow.seed": str(seed), "grpoflow.torch_threads": str(torch.get_num_threads())}
    for package in REPRODUCED_BY:
        try:
            tags[f"grpoflow.version.{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return tags


def close_open_runs(
    client: Any, experiment_id: str, run_id: str, status: str, tags: dict[str, str] | None = None
) -> list[Any]:
    """Every MLflow run of pipeline run ``run_id``; the RUNNING ones are tagged with ``tags`` and closed with
    ``status``."""
    runs = client.search_runs([experiment_id], f"tags.`{RUN_ID_TAG}` = '{run_id}'")
    for run in runs:
        if run.info.status == "RUNNING":
            for key, value in (tags or {}).items():
                client.set_tag(run.info.run_id, key, value)
            client.set_terminated(run.info.run_id, status)
    return runs


def close_interrupted_runs(client: Any, experiment_id: str, run_id: str) -> list[str]:
    """Mark the RUNNING MLflow runs of an earlier, killed attempt at this pipeline run FAILED (no orphans);
    returns the ids of its parent runs, which the new parent run links to."""
    runs = close_open_runs(client, experiment_id, run_id, "FAILED", {"grpoflow.interrupted": "true"})
    return [run.info.run_id for run in runs if "mlflow.parentRunId" not in run.data.tags]


def record_validated_data(tracker: Tracker, data: Any, source: str) -> None:
    """Tag the parent run with the validated data's fingerprint (also when validation came from Prefect's cache),
    so a later scheduled run can tell that nothing changed (``last_completed_run``), and list its train and hold-out
    splits as MLflow datasets (``lineage.py``; every later stage's run lists them too)."""
    from tasks.tracking.lineage import log_splits, validated_splits

    tracker.client.set_tag(tracker.parent_run_id, FINGERPRINT_TAG, data.fingerprint)
    log_splits(tracker.client, tracker.parent_run_id, validated_splits(data, source))


def finished_parent_run(config: Any, run_id: str) -> str | None:
    """The MLflow parent run of pipeline run ``run_id`` when it has finished (nothing is left to resume)."""
    client = client_for(config.resolved_tracking_uri())
    experiment = client.get_experiment_by_name(config.tracking.experiment_name)
    if experiment is None:
        return None
    runs = client.search_runs(
        [experiment.experiment_id], f"tags.`{RUN_ID_TAG}` = '{run_id}' and attributes.status = 'FINISHED'"
    )
    return next((r.info.run_id for r in runs if "mlflow.parentRunId" not in r.data.tags), None)


def last_completed_run(tracker: Tracker, config_hash: str, data_fingerprint: str) -> str | None:
    """The pipeline run id of the latest FINISHED, trained run with this config hash and data fingerprint."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        f"tags.`grpoflow.config_hash` = '{config_hash}' and tags.`{FINGERPRINT_TAG}` = '{data_fingerprint}' "
        "and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    for run in runs:
        if run.info.run_id != tracker.parent_run_id and SKIPPED_TAG not in run.data.tags:
            return run.data.tags.get(RUN_ID_TAG)
    return None


def stage_seconds(tracker: Tracker) -> dict[str, float]:
    """Wall seconds per stage, as logged on the parent MLflow run."""
    run = tracker.client.get_run(tracker.parent_run_id)
    return {k.removesuffix("_seconds"): v for k, v in run.data.metrics.items() if k.endswith("_seconds")}


def finish_pipeline(tracker: Tracker, status: str, summary: dict[str, Any] | None = None) -> None:
    client = tracker.client
    if summary is not None:
        client.log_dict(tracker.parent_run_id, summary, "summary.json")
    client.set_terminated(tracker.parent_run_id, status)


def close_pipeline(tracker: Tracker, status: str, summary: dict[str, Any]) -> bool:
    """Record the stage times and the summary, and close the parent run, on the way out of a run; never raises,
    so the run's own error is the one reported. When tracking is unreachable, says that the runs left RUNNING
    are closed by the next command that opens this pipeline run (``grpoflow run --resume``)."""
    try:
        summary["stage_seconds"] = stage_seconds(tracker)
        finish_pipeline(tracker, status, summary)
        return True
    except Exception as exc:
        logger.warning(
            "could not close the MLflow runs of %s at %s (%s: %s); they are closed when the run is resumed "
            "(grpoflow run --resume %s)",
            tracker.run_id,
            tracker.tracking_uri,
            type(exc).__name__,
            str(exc)[:200],
            tracker.run_id,
        )
        return False


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            value = json.dumps(value) if isinstance(value, list) else value
            flat[name] = redact_credentials(value) if isinstance(value, str) else value  # no password in a URL
    return flat
