"""Checkpoints of a remote GRPO stage (``orchestration.grpo_deployment``) kept where a new worker finds them: a
folder every GPU worker sees (``orchestration.remote_checkpoints``), else the pipeline's MLflow run artifacts
(``handoff/grpo-checkpoints/``, e.g. MinIO/S3). After each save the checkpoint is copied there and older ones are
pruned (the newest ``orchestration.keep_checkpoints`` stay, as in the trainer's own folder); a worker that starts
the stage again (``grpoflow run --resume``, a Prefect retry) restores the newest complete one and the trainer
continues from it.

A copy counts only once complete: a folder copy is renamed into place, an upload is followed by a marker; a worker
killed mid-copy leaves nothing a resume would take. Must not import: torch, Prefect.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback

from tasks.layout import HANDOFF

logger = logging.getLogger(__name__)

ARTIFACT_DIR = f"{HANDOFF}/grpo-checkpoints"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


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
    """Checkpoints in a shared folder: ``<root>/checkpoint-N``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)

    def put(self, checkpoint: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.root / f".{checkpoint.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(checkpoint, partial)
        shutil.rmtree(self.root / checkpoint.name, ignore_errors=True)
        partial.rename(self.root / checkpoint.name)  # atomic: a reader sees all of it or none

    def complete(self) -> list[str]:
        return newest_first([p.name for p in self.root.iterdir()]) if self.root.is_dir() else []

    def fetch(self, name: str, destination: Path) -> None:
        shutil.copytree(self.root / name, destination)

    def delete(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)


class MlflowStore:
    """Checkpoints as artifacts of the pipeline's parent MLflow run: ``handoff/grpo-checkpoints/checkpoint-N/``,
    each followed by the marker ``checkpoint-N.complete`` once all of its files are up."""

    def __init__(self, tracking_uri: str, parent_run_id: str) -> None:
        from tasks.tracking import client_for

        self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id
        self.client = client_for(tracking_uri)
        self.where = f"MLflow run {parent_run_id} artifacts {ARTIFACT_DIR}/"

    def put(self, checkpoint: Path) -> None:
        self.client.log_artifacts(self.parent_run_id, str(checkpoint), f"{ARTIFACT_DIR}/{checkpoint.name}")
        with tempfile.TemporaryDirectory() as scratch:
            marker = Path(scratch) / f"{checkpoint.name}.complete"
            marker.write_text("")
            self.client.log_artifact(self.parent_run_id, str(marker), ARTIFACT_DIR)

    def complete(self) -> list[str]:
        names = [Path(item.path).name for item in self.client.list_artifacts(self.parent_run_id, ARTIFACT_DIR)]
        return [name for name in newest_first(names) if f"{name}.complete" in names]

    def fetch(self, name: str, destination: Path) -> None:
        import mlflow.artifacts

        with tempfile.TemporaryDirectory(dir=destination.parent) as scratch:
            local = mlflow.artifacts.download_artifacts(
                run_id=self.parent_run_id,
                artifact_path=f"{ARTIFACT_DIR}/{name}",
                dst_path=scratch,
                tracking_uri=self.tracking_uri,
            )
            shutil.move(local, destination)

    def delete(self, name: str) -> None:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        run = self.client.get_run(self.parent_run_id)
        repository = get_artifact_repository(run.info.artifact_uri, tracking_uri=self.tracking_uri)
        repository.delete_artifacts(f"{ARTIFACT_DIR}/{name}.complete")  # first: a half-deleted one is not taken
        repository.delete_artifacts(f"{ARTIFACT_DIR}/{name}")


def store_for(where: dict[str, Any]) -> CheckpointStore:
    """The store ``where`` names (plain JSON, so it travels to a deployment and to training ranks): keys
    ``remote_checkpoints`` (a shared folder, or None for MLflow), ``tracking_uri``, ``parent_run_id``, ``run_id``.
    A shared folder holds ``<remote_checkpoints>/<run_id>/grpo/checkpoint-N``.

    >>> store_for({"remote_checkpoints": "/shared", "tracking_uri": "", "parent_run_id": "", "run_id": "r1"}).where
    '/shared/r1/grpo'
    """
    if where.get("remote_checkpoints"):
        return FolderStore(Path(where["remote_checkpoints"]) / where["run_id"] / "grpo")
    return MlflowStore(where["tracking_uri"], where["parent_run_id"])


def prune(store: CheckpointStore, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints; returns the names deleted."""
    old = store.complete()[keep:]
    for name in old:
        store.delete(name)
    return old


def restore_newest(store: CheckpointStore, checkpoints_dir: Path) -> str | None:
    """Copy the store's newest complete checkpoint into ``checkpoints_dir`` (where the trainer resumes from);
    returns its name, or None when the store has none."""
    names = store.complete()
    if not names:
        return None
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    destination = checkpoints_dir / names[0]
    if not destination.exists():
        store.fetch(names[0], destination)
    logger.info("restored %s from %s: GRPO continues from it", names[0], store.where)
    return names[0]


def clear(store: CheckpointStore) -> None:
    """Delete every checkpoint (the stage finished and its adapter was handed back)."""
    for name in store.complete():
        store.delete(name)


class CheckpointMirror(TrainerCallback):
    """After each checkpoint the trainer saves (rank 0): copy it to the store, then prune the store to the newest
    ``keep`` (``orchestration.keep_checkpoints``, the trainer's own limit too). Runs after the callbacks that add
    files to the checkpoint (the signal guards' pool)."""

    def __init__(self, store: CheckpointStore, keep: int) -> None:
        self.store, self.keep = store, keep

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not state.is_world_process_zero or not checkpoint.is_dir():
            return
        self.store.put(checkpoint)
        pruned = prune(self.store, self.keep)
        logger.info(
            "%s copied to %s%s", checkpoint.name, self.store.where, f" (pruned {', '.join(pruned)})" if pruned else ""
        )
