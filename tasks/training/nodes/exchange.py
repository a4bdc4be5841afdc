"""What travels between the stage and its nodes, all of it artifacts of the stage's MLflow run (the nodes share no
filesystem): the launch request and its inputs going out, each node's log, exit and its ranks' errors, and rank 0's
result and adapter coming back. Checkpoints go through ``tasks.training.remote_checkpoints``.

MLflow has no per-run permissions, so whoever can write the experiment could change what a node fetches. The stage
therefore seals what it ships in a manifest (the sha256 of the request and of every input file) and hands the
manifest's own digest to each agent out of band, on the command line its launcher writes; the agent checks every
file it fetches against it before it reads, imports or runs anything (``Manifest``).

Owns: the artifact names under ``launch/``, the manifest and the base model's digest. Must not import: Prefect,
torch.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tasks.errors import InfrastructureError, UserError
from tasks.tracking import client_for

ROOT = "launch"
REQUEST = f"{ROOT}/request.json"
MANIFEST = f"{ROOT}/manifest.json"  # every shipped file's and the request's sha256; its own digest goes out of band
INPUTS = f"{ROOT}/inputs"  # train.jsonl, sft-adapter/, base-model/ (when shipped)
RESULT = f"{ROOT}/result"  # result.json, adapter/, rollouts/ (from the node that held rank 0)
HEARTBEAT_S = 5.0  # how often a node agent says it is there (a tag on the stage run)


def heartbeat_tag(node: int) -> str:
    """The stage run's tag that holds node ``node``'s last beat (seconds since the epoch).

    >>> heartbeat_tag(1)
    'grpoflow.node.1.beat'
    """
    return f"grpoflow.node.{node}.beat"


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


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in blocks.

    >>> import tempfile; path = Path(tempfile.mkdtemp()) / "f"; _ = path.write_bytes(b"abc")
    >>> sha256_file(path)[:12]
    'ba7816bf8f01'
    """
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digests(local: Path, name: str) -> dict[str, str]:
    """The sha256 of every file ``StageArtifacts.put(local, name)`` uploads, by artifact name.

    >>> import tempfile; folder = Path(tempfile.mkdtemp()); _ = (folder / "a.txt").write_text("x")
    >>> list(file_digests(folder, "launch/inputs/x")), list(file_digests(folder / "a.txt", "launch/inputs/b.txt"))
    (['launch/inputs/x/a.txt'], ['launch/inputs/b.txt'])
    """
    if local.is_dir():
        return {f"{name}/{p.relative_to(local).as_posix()}": sha256_file(p) for p in local.rglob("*") if p.is_file()}
    return {name: sha256_file(local)}


class ShippedInputChanged(RuntimeError):
    """A file a node fetched is not what the stage shipped (or the manifest is not the one the stage sealed)."""


# Raised by the agent, defined here: an agent run as ``python -m …agent`` is ``__main__``, and the stage rebuilds a
# node's error by its module and name (``tasks.training.launch.reported_error``).
class NodeInputError(UserError, RuntimeError):
    """A node cannot get what the stage needs (a base model with other bytes, a source it cannot resolve)."""


class NodeInputTampered(InfrastructureError, RuntimeError):
    """A file in the stage's MLflow run is not what the stage shipped: the node stops before it reads, imports or
    runs anything."""


class Manifest:
    """What the stage shipped: ``{"request": sha256, "files": {artifact name: sha256}}``; ``digest()`` is what the
    stage hands each agent out of band.

    >>> manifest = Manifest({"request": "0" * 64, "files": {"launch/inputs/train.jsonl": "1" * 64}})
    >>> Manifest.from_bytes(manifest.to_bytes(), manifest.digest()).files == manifest.files
    True
    >>> Manifest.from_bytes(manifest.to_bytes(), "f" * 64)
    Traceback (most recent call last):
    tasks.training.nodes.exchange.ShippedInputChanged: launch/manifest.json is not the manifest the stage sealed ...
    """

    def __init__(self, data: dict[str, Any]) -> None:
        self.request: str = data["request"]
        self.files: dict[str, str] = dict(data["files"])

    def to_bytes(self) -> bytes:
        return json.dumps({"request": self.request, "files": self.files}, sort_keys=True).encode()

    def digest(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes, expected_digest: str) -> Manifest:
        """The manifest a node fetched, once its bytes hash to the digest the stage gave the agent."""
        found = hashlib.sha256(data).hexdigest()
        if found != expected_digest:
            raise ShippedInputChanged(
                f"{MANIFEST} is not the manifest the stage sealed (its digest {found[:16]}…, the agent was given "
                f"{expected_digest[:16]}…): someone changed the stage's MLflow run"
            )
        return cls(json.loads(data))

    def check_request(self, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != self.request:
            raise ShippedInputChanged(f"{REQUEST} differs from the request the stage sealed in its manifest")

    def check(self, local: Path, name: str) -> Path:
        """``local`` (fetched as ``name``: a file or a folder) holds exactly the files the stage shipped as
        ``name``, byte for byte; ShippedInputChanged naming the first that differs, is missing or was added."""
        wanted = {k: v for k, v in self.files.items() if k == name or k.startswith(f"{name}/")}
        if not wanted:
            raise ShippedInputChanged(f"{name} is not in the stage's manifest: the stage did not ship it")
        found = file_digests(local, name)
        for artifact in sorted(set(wanted) | set(found)):
            if artifact not in found:
                raise ShippedInputChanged(f"{artifact} was shipped by the stage but is missing from its MLflow run")
            if artifact not in wanted:
                raise ShippedInputChanged(f"{artifact} was not shipped by the stage: someone added it to its run")
            if found[artifact] != wanted[artifact]:
                raise ShippedInputChanged(
                    f"{artifact} differs from what the stage shipped (sha256 {found[artifact][:16]}…, shipped "
                    f"{wanted[artifact][:16]}…): someone changed the stage's MLflow run"
                )
        return local


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

    def put_bytes(self, data: bytes, name: str) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch) / name.rsplit("/", 1)[-1]
            local.write_bytes(data)
            self.put(local, name)

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

    def fetch_bytes(self, name: str) -> bytes:
        with tempfile.TemporaryDirectory() as scratch:
            return self.fetch(name, Path(scratch)).read_bytes()

    def fetch_json(self, name: str) -> Any:
        with tempfile.TemporaryDirectory() as scratch:
            return json.loads(self.fetch(name, Path(scratch)).read_text())
