"""MLflow runs under faults: a full disk at each point a run writes maps to the one documented error and the
stage's run is closed FAILED (real stores, real trainers; the failure is injected where the disk would fill)."""

import errno
from pathlib import Path

import pytest

from tasks.config import PipelineConfig
from tasks.layout import OutputDirError, RunLayout
from tasks.tracking import STAGE_TAG, start_pipeline


def _stage_status(tracker, stage: str) -> str:
    return next(r.info.status for r in tracker.stage_runs(stage) if r.data.tags[STAGE_TAG] == stage)


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_writing_the_quarantine(tiny_config: PipelineConfig, tmp_path: Path, monkeypatch) -> None:
    import tasks.validate

    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run"))
    monkeypatch.setattr(tasks.validate, "write_jsonl", _disk_full)
    with pytest.raises(OutputDirError, match="disk full while stage validate"), tracker.stage("validate") as stage:
        tasks.validate.run_validate(tiny_config, stage.dir)
    assert _stage_status(tracker, "validate") == "FAILED"


def test_disk_full_in_the_tracking_store(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    from mlflow.exceptions import MlflowException

    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run"))
    with pytest.raises(OutputDirError, match="disk full"), tracker.stage("evaluate"):
        try:
            raise OSError(errno.ENOSPC, "sqlite3.OperationalError")
        except OSError as cause:  # how SQLAlchemy wraps SQLite's error, and MLflow wraps that
            raise MlflowException("(sqlite3.OperationalError) database or disk is full") from cause
    assert _stage_status(tracker, "evaluate") == "FAILED"


def test_disk_full_saving_a_checkpoint(tiny_config: PipelineConfig, tiny_split, tiny_model_dir, tmp_path, monkeypatch):
    import torch

    from tasks.sft import run_sft

    config = PipelineConfig.model_validate(
        {**tiny_config.model_dump(), "sft": {**tiny_config.sft.model_dump(), "max_steps": 2, "checkpoint_steps": 1}}
    )
    tracker = start_pipeline(config, RunLayout(tmp_path / "run"))
    monkeypatch.setattr(torch, "save", _disk_full)  # the trainer saves the optimizer state with it
    with pytest.raises(OutputDirError, match="disk full while stage sft"), tracker.stage("sft") as stage:
        run_sft(config, tiny_split.train_path, tiny_model_dir, stage.dir)
    assert _stage_status(tracker, "sft") == "FAILED"


def test_a_nearly_full_disk_does_not_rename_grpoflow_errors(tiny_config, tmp_path: Path, monkeypatch) -> None:
    """With little space left a foreign error is taken for a full disk, but a gate's stop is still a gate's stop."""
    import tasks.tracking.runs
    from tasks.probe import NoLearningSignal

    tracker = start_pipeline(tiny_config, RunLayout(tmp_path / "run"))
    monkeypatch.setattr(tasks.tracking.runs, "_nearly_full", lambda folder: True)
    with pytest.raises(NoLearningSignal), tracker.stage("probe_sft"):
        raise NoLearningSignal("all rewards 0")
    with pytest.raises(OutputDirError, match="disk full"), tracker.stage("sft"):
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
