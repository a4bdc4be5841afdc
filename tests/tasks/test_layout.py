from pathlib import Path

import pytest

from tasks.config import PipelineConfig
from tasks.layout import OutputDirError, RunLayout


def test_unwritable_output_dir_is_a_clear_error(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OutputDirError, match="is not writable"):
        RunLayout(blocker / "run").prepare(tiny_config)


def test_too_little_disk_is_refused_before_anything_runs(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    greedy = PipelineConfig.model_validate({**tiny_config.model_dump(), "orchestration": {"min_free_disk_mb": 10**12}})
    with pytest.raises(OutputDirError, match="MB free under"):
        RunLayout(tmp_path / "run").prepare(greedy)


def test_config_snapshot_is_written_once(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    RunLayout(tmp_path / "run").prepare(tiny_config)
    assert PipelineConfig.model_validate_json((tmp_path / "run" / "config.json").read_text()) == tiny_config
