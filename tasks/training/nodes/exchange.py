"""What travels between the stage and its nodes, all of it artifacts of the stage's MLflow run (the nodes share no
filesystem): the launch request and its inputs going out, each node's log, exit and its ranks' errors, and rank 0's
result and adapter coming back. Checkpoints go through ``tasks.training.remote_checkpoints``.

Owns: the artifact names under ``launch/`` and the base model's digest. Must not import: Prefect, torch.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tasks.tracking import client_for

ROOT = "launch"
REQUEST = f"{ROOT}/request.json"
INPUTS = f"{ROOT}/inputs"  # train.jsonl, sft-adapter/, base-model/ (when shipped)
RESULT = f"{ROOT}/result"  # result.json, adapter/, rollouts/ (from the node that held rank 0)


def node_folder(node: int) -> str:
    """A node's own reports: ``log.txt``, ``exit.json``, ``errors/rank-N.error.json``.

    >>> node_folder(1)
    'launch/nodes/node-1'
    """
    return f"{ROOT}/nodes/node-{node}"


def model_digest(folder: Path) -> str:
    """A content digest of a model folder: every file's relative path and bytes (hidden files left out), so two
    nodes that build or find "the same" base model can check they hold the same bytes.

    >>> import tempfile; folder = Path(tempfile.mkdtemp()); _ = (folder / "config.json").write_text("{}")
    >>> model_digest(folder) == model_digest(folder), len(model_digest(folder))
    (True, 16)
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


class StageArtifacts:
    """The launch artifacts of one stage run (``tracking_uri``, ``run_id``): put, list and fetch by name."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.client = client_for(tracking_uri)

    def put(self, local: Path, name: str) -> None:
        """Upload a file or a folder's contents as ``name`` (a file keeps its own name under ``name``'s folder)."""
        if local.is_dir():
            self.client.log_artifacts(self.run_id, str(local), name)
        else:
            parent, leaf = name.rsplit("/", 1)
            if leaf == local.name:
                self.client.log_artifact(self.run_id, str(local), parent)
            else:
                with tempfile.TemporaryDirectory() as scratch:
                    renamed = Path(scratch) / leaf
                    shutil.copyfile(local, renamed)
                    self.client.log_artifact(self.run_id, str(renamed), parent)

    def put_json(self, data: Any, name: str) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch) / name.rsplit("/", 1)[-1]
            local.write_text(json.dumps(data))
            self.put(local, name)

    def names(self, folder: str) -> list[str]:
        """The artifact names directly under ``folder`` (full paths), or none when it does not exist."""
        return [item.path for item in self.client.list_artifacts(self.run_id, folder)]

    def fetch(self, name: str, destination: Path) -> Path:
        """Download ``name`` (a file or a folder) into ``destination``; returns the local path."""
        import mlflow.artifacts

        destination.mkdir(parents=True, exist_ok=True)
        local = mlflow.artifacts.download_artifacts(
            run_id=self.run_id, artifact_path=name, dst_path=str(destination), tracking_uri=self.tracking_uri
        )
        return Path(local)

    def fetch_json(self, name: str) -> Any:
        with tempfile.TemporaryDirectory() as scratch:
            return json.loads(self.fetch(name, Path(scratch)).read_text())
