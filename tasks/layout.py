"""A pipeline run's paths and artifact names: the one owner of where things live.

Owns: the run folder (``<output_dir>/<run_id>``), each stage's folder, the config snapshot and summary files,
the folders of standalone commands, the MLflow hand-off artifact names, and the parameters of the remote GRPO
flow. The CLI, the flow, the stages and the remote GRPO flow all read them from here.
Must not import: torch, transformers, Prefect, MLflow (it is plain paths and names).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.errors import InfrastructureError

CONFIG_SNAPSHOT = "config.json"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"  # inside a training stage's folder
ADAPTER = "adapter"  # inside a training stage's folder: the adapter it hands on

# Where the pipeline and a GRPO worker on another machine exchange files: the parent MLflow run's artifacts.
HANDOFF = "handoff"
HANDOFF_TRAIN = "grpo_inputs/train"
TEST_FILE = "test.jsonl"  # validate writes the test source's rows there (data.test_source); evaluation scores them
HOLDOUT_FILE = "holdout.jsonl"  # validate writes it beside train.jsonl; GRPO's in-training evaluation reads it there
HANDOFF_SFT_ADAPTER = "grpo_inputs/sft_adapter"
HANDOFF_GRPO_ADAPTER = "grpo_output/adapter"


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write ``path`` whole or not at all: into a temporary sibling, flushed to disk, then renamed over it. A
    crash leaves the previous file or none, never a partial one (later stages and resumes read these files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with staging.open("wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def publish_dir(staging: Path, target: Path) -> Path:
    """Move a fully written folder into place, replacing an older one (an adapter saved again on resume)."""
    if target.exists():
        aside = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, aside)
        os.replace(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(staging, target)
    return target


class OutputDirError(InfrastructureError, OSError):
    """The output directory cannot hold a run: not writable, or (nearly) out of space."""


@dataclass(frozen=True)
class RunLayout:
    """Every path of one pipeline run.

    >>> layout = RunLayout.of(Path("outputs"), "demo-s0-20261201-101500")
    >>> layout.stage_dir("sft").as_posix(), layout.config_snapshot.name
    ('outputs/demo-s0-20261201-101500/sft', 'config.json')
    """

    run_dir: Path

    @classmethod
    def of(cls, output_dir: Path, run_id: str) -> RunLayout:
        return cls(Path(output_dir) / run_id)

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    @property
    def config_snapshot(self) -> Path:
        """The config the run started with; ``grpoflow run --resume`` reads it back."""
        return self.run_dir / CONFIG_SNAPSHOT

    @property
    def summary_path(self) -> Path:
        return self.run_dir / SUMMARY

    def stage_dir(self, stage: str) -> Path:
        """The folder a stage writes into (its MLflow run has the same name)."""
        return self.run_dir / stage

    def prepare(self, config: Any) -> None:
        """Create the run folder, prove it is writable and has room, and keep a snapshot of the config."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / ".write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise OutputDirError(
                exc.errno or errno.EACCES, f"output directory {self.run_dir} is not writable: {exc}"
            ) from exc
        free_mb = shutil.disk_usage(self.run_dir).free / 2**20
        if free_mb < config.orchestration.min_free_disk_mb:
            raise OutputDirError(
                errno.ENOSPC,
                f"only {free_mb:.0f} MB free under {self.run_dir}; need orchestration.min_free_disk_mb="
                f"{config.orchestration.min_free_disk_mb} (checkpoints and adapters are written there)",
            )
        if not self.config_snapshot.exists():
            self.config_snapshot.write_text(config.model_dump_json(indent=2))
        if not self.identity_path.exists():
            self.identity_path.write_text(uuid.uuid4().hex)

    @property
    def identity_path(self) -> Path:
        """A random id written once when the run folder is created: a resumed run keeps it, a deleted and
        recreated folder (or another machine's folder of the same name) gets a new one, so Prefect's cache never
        hands back a stage whose outputs are gone."""
        return self.run_dir / ".run-identity"

    def identity(self) -> str:
        """The folder's id (empty before ``prepare``)."""
        try:
            return self.identity_path.read_text().strip()
        except OSError:
            return ""


def command_dir(output_dir: Path, command: str) -> Path:
    """The folder of a standalone command (``grpoflow validate``, ``probe``, ``evaluate``) under ``output_dir``.

    >>> command_dir(Path("outputs"), "evaluate").as_posix()
    'outputs/evaluate-registered'
    """
    return Path(output_dir) / {"evaluate": "evaluate-registered"}.get(command, command)


@dataclass(frozen=True)
class RemoteGrpoRequest:
    """The parameters of the remote GRPO flow (``flows/remote.py``), named as its deployment takes them: the
    pipeline builds one, ``run_deployment`` sends ``parameters()``, the flow receives them as keyword arguments.

    >>> sorted(RemoteGrpoRequest({}, "r", "u", "1", "p").parameters())[:3]
    ['config', 'experiment_id', 'has_sft_adapter']
    """

    config: dict[str, Any]
    run_id: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    train_file: str = "train.jsonl"
    has_sft_adapter: bool = True
    keep_ids: list[str] | None = None

    def parameters(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def train_artifact(self) -> str:
        return f"{HANDOFF_TRAIN}/{self.train_file}"
