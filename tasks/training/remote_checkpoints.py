"""Checkpoints of a stage that trains away from the pipeline (a remote GRPO deployment, several nodes) kept where a
new worker finds them: a folder every worker sees (``orchestration.remote_checkpoints``), else the pipeline's MLflow
run artifacts (``handoff/<stage>-checkpoints/``, e.g. MinIO/S3). After each save the checkpoint is copied there and
older ones are pruned (the newest ``orchestration.keep_checkpoints`` stay, as in the trainer's own folder); a worker
that starts the stage again (``grpoflow run --resume``, a Prefect retry) restores the newest complete one and the
trainer continues from it.

On several nodes every node copies its own part (each process writes its ``rng_state_N.pth`` into its node's
checkpoint; rank 0 alone the adapter and optimizer) into the same checkpoint, and the checkpoint is complete only
once every node's part is: a resume on any node then restores every process's random state.

A copy counts only once complete: a folder copy is renamed into place, an upload is followed by a marker; a worker
killed mid-copy leaves nothing a resume would take. Must not import: torch, Prefect.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback

from tasks.layout import HANDOFF

logger = logging.getLogger(__name__)

ARTIFACT_DIR = f"{HANDOFF}/grpo-checkpoints"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def artifact_dir(stage: str) -> str:
    """Where a stage's checkpoints go among the pipeline run's artifacts.

    >>> artifact_dir("sft")
    'handoff/sft-checkpoints'
    """
    return f"{HANDOFF}/{stage}-checkpoints"


def markers(name: str, nodes: int) -> list[str]:
    """The markers that make checkpoint ``name`` complete: one, or one per node.

    >>> markers("checkpoint-4", 1), markers("checkpoint-4", 2)
    (['checkpoint-4.complete'], ['checkpoint-4.node-0.complete', 'checkpoint-4.node-1.complete'])
    """
    if nodes == 1:
        return [f"{name}.complete"]
    return [f"{name}.node-{node}.complete" for node in range(nodes)]


def newest_first(names: list[str]) -> list[str]:
    """Checkpoint folder names, newest (highest step) first; other names are left out.

    >>> newest_first(["checkpoint-4", "checkpoint-12", "notes", "checkpoint-8"])
    ['checkpoint-12', 'checkpoint-8', 'checkpoint-4']
    """
    found = [name for name in names if _CHECKPOINT.match(name)]
    return sorted(found, key=lambda name: int(name.split("-")[1]), reverse=True)


class CheckpointStore(Protocol):
    where: str

    def put(self, checkpoint: Path) -> None: ...
    def complete(self) -> list[str]: ...
    def fetch(self, name: str, destination: Path) -> None: ...
    def delete(self, name: str) -> None: ...


class FolderStore:
    """Checkpoints in a shared folder: ``<root>/checkpoint-N``. One node renames its copy into place; several
    each merge their files into it and then write their marker ``checkpoint-N.node-K.complete``."""

    def __init__(self, root: Path, nodes: int = 1, node: int = 0) -> None:
        self.root, self.nodes, self.node = root, nodes, node
        self.where = str(root)

    def put(self, checkpoint: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.nodes > 1:
            shutil.copytree(checkpoint, self.root / checkpoint.name, dirs_exist_ok=True)
            (self.root / markers(checkpoint.name, self.nodes)[self.node]).write_text("")
            return
        partial = self.root / f".{checkpoint.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(checkpoint, partial)
        shutil.rmtree(self.root / checkpoint.name, ignore_errors=True)
        partial.rename(self.root / checkpoint.name)  # atomic: a reader sees all of it or none

    def complete(self) -> list[str]:
        if not self.root.is_dir():
            return []
        names = [p.name for p in self.root.iterdir()]
        if self.nodes == 1:
            return newest_first(names)
        return [name for name in newest_first(names) if set(markers(name, self.nodes)) <= set(names)]

    def fetch(self, name: str, destination: Path) -> None:
        shutil.copytree(self.root / name, destination)

    def delete(self, name: str) -> None:
        for marker in markers(name, self.nodes) if self.nodes > 1 else []:
            (self.root / marker).unlink(missing_ok=True)  # first: a half-deleted one is not taken
        shutil.rmtree(self.root / name, ignore_errors=True)


class MlflowStore:
    """Checkpoints as artifacts of the pipeline's parent MLflow run: ``handoff/<stage>-checkpoints/checkpoint-N/``,
    followed by the marker ``checkpoint-N.complete`` (``checkpoint-N.node-K.complete`` from each of several nodes)
    once all of its files are up."""

    def __init__(
        self, tracking_uri: str, parent_run_id: str, stage: str = "grpo", nodes: int = 1, node: int = 0
    ) -> None:
        from tasks.tracking import client_for

        self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id
        self.folder, self.nodes, self.node = artifact_dir(stage), nodes, node
        self.client = client_for(tracking_uri)
        self.where = f"MLflow run {parent_run_id} artifacts {self.folder}/"

    def put(self, checkpoint: Path) -> None:
        self.client.log_artifacts(self.parent_run_id, str(checkpoint), f"{self.folder}/{checkpoint.name}")
        with tempfile.TemporaryDirectory() as scratch:
            marker = Path(scratch) / markers(checkpoint.name, self.nodes)[self.node]
            marker.write_text("")
            self.client.log_artifact(self.parent_run_id, str(marker), self.folder)

    def complete(self) -> list[str]:
        names = {Path(item.path).name for item in self.client.list_artifacts(self.parent_run_id, self.folder)}
        return [name for name in newest_first(list(names)) if set(markers(name, self.nodes)) <= names]

    def fetch(self, name: str, destination: Path) -> None:
        import mlflow.artifacts

        with tempfile.TemporaryDirectory(dir=destination.parent) as scratch:
            local = mlflow.artifacts.download_artifacts(
                run_id=self.parent_run_id,
                artifact_path=f"{self.folder}/{name}",
                dst_path=scratch,
                tracking_uri=self.tracking_uri,
            )
            shutil.move(local, destination)

    def delete(self, name: str) -> None:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        run = self.client.get_run(self.parent_run_id)
        repository = get_artifact_repository(run.info.artifact_uri, tracking_uri=self.tracking_uri)
        for marker in markers(name, self.nodes):  # first: a half-deleted one is not taken
            repository.delete_artifacts(f"{self.folder}/{marker}")
        repository.delete_artifacts(f"{self.folder}/{name}")


def store_for(where: dict[str, Any]) -> CheckpointStore:
    """The store ``where`` names (plain JSON, so it travels to a deployment, to nodes and to training ranks): keys
    ``remote_checkpoints`` (a shared folder, or None for MLflow), ``tracking_uri``, ``parent_run_id``, ``run_id``;
    optional ``stage`` (default "grpo"), ``nodes`` and this ``node`` (default 1 and 0). A shared folder holds
    ``<remote_checkpoints>/<run_id>/<stage>/checkpoint-N``.

    >>> store_for({"remote_checkpoints": "/shared", "tracking_uri": "", "parent_run_id": "", "run_id": "r1"}).where
    '/shared/r1/grpo'
    """
    stage, nodes, node = where.get("stage", "grpo"), int(where.get("nodes", 1)), int(where.get("node", 0))
    if where.get("remote_checkpoints"):
        return FolderStore(Path(where["remote_checkpoints"]) / where["run_id"] / stage, nodes, node)
    return MlflowStore(where["tracking_uri"], where["parent_run_id"], stage, nodes, node)


def resume_source(client: Any, experiment_id: str, pipeline_run_id: str, where: dict[str, Any]) -> dict[str, Any]:
    """The store to resume from: ``where`` itself when it is a shared folder (keyed by the pipeline run id, the same
    for every attempt), else the MLflow store of the newest attempt at the same pipeline run (``grpoflow run
    --resume`` opens a new parent run each time) that holds a complete checkpoint; ``where`` when none does."""
    from tasks.tracking.runs import RUN_ID_TAG

    if where.get("remote_checkpoints"):
        return where
    attempts = client.search_runs(
        [experiment_id], f"tags.`{RUN_ID_TAG}` = '{pipeline_run_id}'", order_by=["attributes.start_time DESC"]
    )
    for attempt in attempts:
        if "mlflow.parentRunId" in attempt.data.tags:
            continue  # a stage's run, not an attempt's parent
        candidate = {**where, "parent_run_id": attempt.info.run_id}
        if store_for(candidate).complete():
            return candidate
    return where


def prune(store: CheckpointStore, keep: int, protect: str | None = None) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and never ``protect`` (the trainer's best checkpoint
    under ``grpo.select: best``, which its own rotation keeps too); returns the names deleted."""
    old = [name for name in store.complete()[keep:] if name != protect]
    for name in old:
        store.delete(name)
    return old


def restore_newest(store: CheckpointStore, checkpoints_dir: Path) -> str | None:
    """Copy the store's newest complete checkpoint into ``checkpoints_dir`` (where the trainer resumes from);
    returns its name, or None when the store has none. The store is the authority: local checkpoints newer than the
    one chosen (a node's own that never became complete everywhere) are discarded, and the chosen one replaces any
    local copy of the same name, so every node resumes from exactly the same checkpoint."""
    names = store.complete()
    if not names:
        return None
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    chosen = int(names[0].split("-")[1])
    for local in newest_first([p.name for p in checkpoints_dir.iterdir() if p.is_dir()]):
        if int(local.split("-")[1]) > chosen:
            logger.warning("%s: newer than the newest complete checkpoint (%s); discarded", local, names[0])
            shutil.rmtree(checkpoints_dir / local)
    destination = checkpoints_dir / names[0]
    shutil.rmtree(destination, ignore_errors=True)
    store.fetch(names[0], destination)
    best = best_checkpoint_name(destination)
    if best and best != names[0] and best in names:  # grpo.select best hands on its adapter at the end
        shutil.rmtree(checkpoints_dir / best, ignore_errors=True)
        store.fetch(best, checkpoints_dir / best)
    logger.info("restored %s from %s: GRPO continues from it", names[0], store.where)
    return names[0]


def best_checkpoint_name(checkpoint: Path) -> str | None:
    """The best checkpoint a checkpoint's trainer state names (``grpo.select: best``), if any."""
    import json

    path = checkpoint / "trainer_state.json"
    if not path.is_file():
        return None
    best = json.loads(path.read_text()).get("best_model_checkpoint")
    return Path(best).name if best else None


def clear(store: CheckpointStore) -> None:
    """Delete every checkpoint (the stage finished and its adapter was handed back)."""
    for name in store.complete():
        store.delete(name)


class CheckpointMirror(TrainerCallback):
    """After each checkpoint the trainer saves: copy it to the store, then prune the store to the newest ``keep``
    (``orchestration.keep_checkpoints``, the trainer's own limit too). Runs after the callbacks that add files to
    the checkpoint (the signal guards' pool). Each node's first process copies its node's part; with several
    processes it first waits (``wait_s`` at most) for ``random_states``, the files the node's processes write, and a
    checkpoint still missing one is not copied (no marker says it is complete)."""

    def __init__(
        self, store: CheckpointStore, keep: int, random_states: list[str] | None = None, wait_s: float = 60
    ) -> None:
        self.store, self.keep = store, keep
        self.random_states, self.wait_s = random_states or [], wait_s

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not state.is_local_process_zero or not checkpoint.is_dir():
            return
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and not all((checkpoint / f).is_file() for f in self.random_states):
            time.sleep(0.05)
        missing = [f for f in self.random_states if not (checkpoint / f).is_file()]
        if missing:  # a resume from it would lose those processes' random state: it is not this node's whole part
            logger.error(
                "%s: %s not written after %.0f s; not copied, so a resume takes the newest complete one before it",
                checkpoint,
                ", ".join(missing),
                self.wait_s,
            )
            return
        self.store.put(checkpoint)
        best = Path(state.best_model_checkpoint).name if getattr(state, "best_model_checkpoint", None) else None
        pruned = prune(self.store, self.keep, best) if state.is_world_process_zero else []
        logger.info(
            "%s copied to %s%s", checkpoint.name, self.store.where, f" (pruned {', '.join(pruned)})" if pruned else ""
        )
