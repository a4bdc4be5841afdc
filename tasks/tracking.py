"""MLflow: the pipeline's parent run, one nested run per stage, trainer metrics, and registry access.

Everything goes through an explicit ``MlflowClient`` and run ids (no fluent "active run"), so stages work the
same in any thread or worker process.
"""

from __future__ import annotations

import functools
import json
import logging
import resource
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

RUN_ID_TAG = "grpoflow.run_id"
STAGE_TAG = "grpoflow.stage"
FINGERPRINT_TAG = "grpoflow.data_fingerprint"
CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "grpoflow.champion_history"


class RegistryError(RuntimeError):
    """The MLflow store or registry could not be reached or refused a change; nothing was half-moved."""


class OutputDirError(OSError):
    """The output directory cannot hold a run: not writable, or (nearly) out of space."""


def prepare_run_dir(config: Any, run_dir: Path) -> None:
    """Create the run folder, prove it is writable and has room, and keep a snapshot of the config there
    (``grpoflow run --resume`` reads it back)."""
    import errno
    import shutil

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise OutputDirError(exc.errno or errno.EACCES, f"output directory {run_dir} is not writable: {exc}") from exc
    free_mb = shutil.disk_usage(run_dir).free / 2**20
    if free_mb < config.orchestration.min_free_disk_mb:
        raise OutputDirError(
            errno.ENOSPC,
            f"only {free_mb:.0f} MB free under {run_dir}; need orchestration.min_free_disk_mb="
            f"{config.orchestration.min_free_disk_mb} (checkpoints and adapters are written there)",
        )
    snapshot = run_dir / "config.json"
    if not snapshot.exists():
        snapshot.write_text(config.model_dump_json(indent=2))


@functools.lru_cache(maxsize=16)
def client_for(tracking_uri: str) -> Any:
    """One MlflowClient per URI: trainer callbacks log on every step, so it is not rebuilt each time."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


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

    def trainer_callback(self) -> TrainerCallback:
        return MlflowTrainerCallback(self)


class MlflowTrainerCallback(TrainerCallback):
    """Logs every number a TRL trainer logs, at its global step, to the stage's MLflow run."""

    def __init__(self, stage: StageRun) -> None:
        self.stage = stage

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        numbers = {k.replace("/", "_") if k.startswith("train_") else k: v for k, v in (logs or {}).items()}
        self.stage.log_metrics(
            {k: float(v) for k, v in numbers.items() if isinstance(v, int | float)}, step=state.global_step
        )


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

    def stage_run_ids(self) -> dict[str, str]:
        """``{"<stage>_run_id": mlflow run id}`` for the stages of this pipeline run so far (lineage tags)."""
        runs = self.client.search_runs([self.experiment_id], f"tags.`mlflow.parentRunId` = '{self.parent_run_id}'")
        return {f"{run.data.tags[STAGE_TAG]}_run_id": run.info.run_id for run in runs if STAGE_TAG in run.data.tags}

    def run_url(self, mlflow_run_id: str) -> str | None:
        """The MLflow UI address of a run, when tracking goes through a server."""
        if not self.tracking_uri.startswith(("http://", "https://")):
            return None
        return f"{self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{mlflow_run_id}"

    def link_in_prefect(self, name: str, mlflow_run_id: str) -> None:
        """A Prefect link artifact to the stage's MLflow run, so the Prefect UI leads to the details."""
        url = self.run_url(mlflow_run_id)
        if url is None:
            return
        try:
            from prefect.artifacts import create_link_artifact

            create_link_artifact(link=url, link_text=f"MLflow run: {name}", key=f"mlflow-{name}".replace("_", "-"))
        except Exception as exc:
            logger.warning("could not publish the MLflow link of stage %s: %s", name, exc)

    @contextmanager
    def stage(self, name: str) -> Iterator[StageRun]:
        """A nested MLflow run for one stage; closed FINISHED or FAILED, with wall time and peak memory."""
        stage_dir = self.run_dir / name
        stage_dir.mkdir(parents=True, exist_ok=True)
        run = self.client.create_run(
            self.experiment_id,
            run_name=name,
            tags={"mlflow.parentRunId": self.parent_run_id, RUN_ID_TAG: self.run_id, STAGE_TAG: name},
        )
        stage = StageRun(self.tracking_uri, run.info.run_id, name, stage_dir)
        started = time.perf_counter()
        status = "FAILED"
        try:
            yield stage
            status = "FINISHED"
            self.link_in_prefect(name, stage.run_id)
        except OSError as exc:
            import errno

            if exc.errno == errno.ENOSPC:
                raise OutputDirError(errno.ENOSPC, f"disk full while stage {name} wrote under {stage_dir}") from exc
            raise
        finally:
            seconds = time.perf_counter() - started
            try:
                stage.log_metrics({"stage_seconds": seconds, "peak_rss_mb": peak_rss_mb()})
                self.client.log_metric(self.parent_run_id, f"{name}_seconds", seconds)
                self.client.set_terminated(stage.run_id, status)
            except Exception as exc:  # never hide the stage's own error behind a tracking one
                logger.warning("could not close MLflow run of stage %s: %s", name, exc)


def start_pipeline(config: Any, run_id: str, run_dir: Path) -> Tracker:
    """Create (or reuse) the experiment and open the pipeline's parent run, tagged with the run id."""
    client = client_for(config.resolved_tracking_uri())
    try:
        experiment = client.get_experiment_by_name(config.tracking.experiment_name)
        if experiment is None:
            # A local store keeps artifacts beside it; a tracking server chooses (and serves) its own location.
            local = not config.resolved_tracking_uri().startswith(("http://", "https://", "databricks"))
            artifacts = (config.output_dir.resolve() / "mlartifacts").as_uri() if local else None
            experiment_id = client.create_experiment(config.tracking.experiment_name, artifact_location=artifacts)
        else:
            experiment_id = experiment.experiment_id
        earlier = close_interrupted_runs(client, experiment_id, run_id)
        parent = client.create_run(
            experiment_id,
            run_name=run_id,
            tags={
                RUN_ID_TAG: run_id,
                "grpoflow.config_hash": config.config_hash(),
                "grpoflow.name": config.name,
                **({"grpoflow.resumed_from": ",".join(earlier)} if earlier else {}),
            },
        )
    except Exception as exc:
        raise RegistryError(f"MLflow at {config.resolved_tracking_uri()} is unavailable: {exc}") from exc
    tracker = Tracker(config.resolved_tracking_uri(), experiment_id, parent.info.run_id, run_id, run_dir)
    stage = StageRun(tracker.tracking_uri, parent.info.run_id, "pipeline", run_dir)
    stage.log_params(_flatten(config.model_dump(mode="json")))
    return tracker


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


def last_completed_run(tracker: Tracker, config_hash: str, data_fingerprint: str) -> str | None:
    """The pipeline run id of the latest FINISHED, trained run with this config hash and data fingerprint."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        f"tags.`grpoflow.config_hash` = '{config_hash}' and tags.`{FINGERPRINT_TAG}` = '{data_fingerprint}' "
        "and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"],
    )
    for run in runs:
        if run.info.run_id != tracker.parent_run_id and "grpoflow.skipped" not in run.data.tags:
            return run.data.tags.get(RUN_ID_TAG)
    return None


def emit_pipeline_event(event: str, run_id: str, payload: dict[str, Any]) -> None:
    """A Prefect event about a pipeline run (``grpoflow.run.<event>``) for automations to notify on; a failure
    to emit is logged, never raised."""
    try:
        from prefect.events import emit_event

        emit_event(
            event=f"grpoflow.run.{event}",
            resource={"prefect.resource.id": f"grpoflow.run.{run_id}", "prefect.resource.name": run_id},
            payload=payload,
        )
    except Exception as exc:
        logger.warning("could not emit Prefect event grpoflow.run.%s: %s", event, exc)


@contextmanager
def runs_closed_on_termination(tracker: Tracker) -> Iterator[None]:
    """While inside, SIGTERM (a cancel from the Prefect UI, a pre-empted worker) first marks every open MLflow
    run of this pipeline run KILLED, then hands the signal to the previous handler (Prefect's raises
    TerminationSignal). The runs are closed in the handler itself because that exception can land in a
    finalizer or weakref callback, where Python swallows it and no ``finally`` would run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def close_then_forward(signum: int, frame: Any) -> None:
        try:
            close_open_runs(tracker.client, tracker.experiment_id, tracker.run_id, "KILLED")
        except Exception as exc:  # the signal must still reach Prefect
            logger.warning("could not close the MLflow runs of %s on SIGTERM: %s", tracker.run_id, exc)
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, close_then_forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def finish_pipeline(tracker: Tracker, status: str, summary: dict[str, Any] | None = None) -> None:
    client = tracker.client
    if summary is not None:
        client.log_dict(tracker.parent_run_id, summary, "summary.json")
    client.set_terminated(tracker.parent_run_id, status)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, list) else value
    return flat


# ---- registry -------------------------------------------------------------------------------------------


def alias_version(client: Any, name: str, alias: str) -> Any | None:
    """The model version behind ``name@alias``, or None when the model or alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if "RESOURCE_DOES_NOT_EXIST" in str(exc.error_code) or "not found" in str(exc).lower():
            return None
        raise RegistryError(f"registry lookup of {name}@{alias} failed: {exc}") from exc


def register_adapter(client: Any, name: str, run_id: str, artifact_path: str, tags: dict[str, Any]) -> str:
    """Register ``runs:/<run_id>/<artifact_path>`` as a new version of ``name``; returns the version.

    Idempotent per pipeline run: when a version tagged with the same ``pipeline_run_id`` exists (a resumed
    run that crashed after registering), that version is returned instead of a second one."""
    from mlflow.exceptions import MlflowException

    try:
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description="LoRA adapters trained by grpoflow")
        pipeline_run = tags.get("pipeline_run_id")
        if pipeline_run:
            for existing in client.search_model_versions(f"name = '{name}'"):
                if existing.tags.get("pipeline_run_id") == str(pipeline_run):
                    return str(existing.version)
        version = client.create_model_version(
            name,
            source=f"runs:/{run_id}/{artifact_path}",
            run_id=run_id,
            tags={k: str(v) for k, v in tags.items()},
        )
    except MlflowException as exc:
        raise RegistryError(f"could not register a version of {name}: {exc}") from exc
    return str(version.version)


def champion_history(client: Any, name: str) -> list[str]:
    model = client.get_registered_model(name)
    return json.loads(model.tags.get(HISTORY_TAG, "[]"))


def move_champion(client: Any, name: str, version: str, reason: str) -> None:
    """Point ``name@champion`` at ``version`` and append it to the history kept on the registered model."""
    history = champion_history(client, name)
    client.set_registered_model_alias(name, CHAMPION, version)
    history.append(version)
    client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    client.set_model_version_tag(name, version, "grpoflow.promoted_at", time.strftime("%Y-%m-%dT%H:%M:%S"))
    client.set_model_version_tag(name, version, "grpoflow.promotion_reason", reason)


def rollback_champion(client: Any, name: str, to_version: str | None = None, reason: str = "rollback") -> str:
    """Move ``champion`` back to the previous champion (or to ``to_version``); returns the version now champion."""
    history = champion_history(client, name)
    current = alias_version(client, name, CHAMPION)
    if to_version is None:
        earlier = [v for v in history if current is None or v != str(current.version)]
        if not earlier:
            raise RegistryError(f"{name} has no earlier champion to roll back to (history: {history})")
        to_version = earlier[-1]
    client.get_model_version(name, to_version)  # raises when it does not exist
    client.set_registered_model_alias(name, CHAMPION, to_version)
    if history and current is not None and history[-1] == str(current.version):
        history.pop()
    if not history or history[-1] != to_version:
        history.append(to_version)
    client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    client.set_model_version_tag(name, to_version, "grpoflow.rolled_back_to_at", stamp)
    client.set_model_version_tag(name, to_version, "grpoflow.rollback_reason", reason)
    if current is not None:
        client.set_model_version_tag(name, str(current.version), "grpoflow.rolled_back_from_at", stamp)
    return to_version


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME@alias`` or ``models:/NAME/VERSION`` → (name, alias, version).

    >>> parse_model_uri("models:/demo@champion"), parse_model_uri("models:/demo/3")
    (('demo', 'champion', None), ('demo', None, '3'))
    """
    if not uri.startswith("models:/"):
        raise ValueError(f"expected models:/NAME@ALIAS or models:/NAME/VERSION, got {uri!r}")
    body = uri[len("models:/") :]
    if "@" in body:
        name, alias = body.split("@", 1)
        return name, alias, None
    name, _, version = body.partition("/")
    return name, None, version or None


def fetch_adapter(tracking_uri: str, uri: str, destination: Path) -> tuple[str, Path, Any]:
    """Download a registered adapter; returns (base model source from the version's tag, adapter dir, version)."""
    import mlflow.artifacts

    client = client_for(tracking_uri)
    name, alias, version = parse_model_uri(uri)
    model_version = alias_version(client, name, alias) if alias else client.get_model_version(name, version)
    if model_version is None:
        raise RegistryError(f"{uri} does not exist")
    base = model_version.tags.get("base_model")
    if not base:
        raise RegistryError(f"{name} version {model_version.version} has no base_model tag")
    destination.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=model_version.source, dst_path=str(destination), tracking_uri=tracking_uri
    )
    return base, Path(local), model_version


HANDOFF = "handoff"


def handoff_upload(tracker: Tracker, local: Path, name: str) -> None:
    """Put a file or folder where a stage on another worker can fetch it: the parent run's
    ``handoff/<name>`` artifacts (the MLflow artifact store, e.g. MinIO/S3; never a shared local path)."""
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
