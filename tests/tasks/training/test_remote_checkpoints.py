"""Checkpoint retention: one setting (``orchestration.keep_checkpoints``) for the trainer's own folder and the
mirror."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.config import PipelineConfig
from tasks.training import CheckpointMirror, common_trainer_args, store_for


def _checkpoint(out: Path, step: int) -> None:
    folder = out / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")


@pytest.mark.parametrize("keep", [1, 3])
def test_the_trainer_and_the_mirror_keep_the_same_number(keep: int, tmp_path: Path) -> None:
    config = PipelineConfig.model_validate({"orchestration": {"keep_checkpoints": keep}})
    assert common_trainer_args(config, tmp_path / "out", checkpoint_steps=1)["save_total_limit"] == keep

    where = {"remote_checkpoints": str(tmp_path / "mirror"), "tracking_uri": "", "parent_run_id": "", "run_id": "r"}
    store = store_for(where)
    mirror = CheckpointMirror(store, config.orchestration.keep_checkpoints)
    for step in range(1, 6):
        _checkpoint(tmp_path / "out", step)
        state = SimpleNamespace(global_step=step, is_world_process_zero=True, is_local_process_zero=True)
        mirror.on_save(SimpleNamespace(output_dir=str(tmp_path / "out")), state, None)
    assert store.complete() == [f"checkpoint-{step}" for step in range(5, 5 - keep, -1)]


def test_the_default_keeps_two() -> None:
    assert PipelineConfig().orchestration.keep_checkpoints == 2
