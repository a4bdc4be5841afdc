from pathlib import Path

import pytest

from tasks.config import PipelineConfig
from tasks.tracking import OutputDirError, parse_model_uri, prepare_run_dir


def test_unwritable_output_dir_is_a_clear_error(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OutputDirError, match="is not writable"):
        prepare_run_dir(tiny_config, blocker / "run")


def test_too_little_disk_is_refused_before_anything_runs(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    greedy = PipelineConfig.model_validate({**tiny_config.model_dump(), "orchestration": {"min_free_disk_mb": 10**12}})
    with pytest.raises(OutputDirError, match="MB free under"):
        prepare_run_dir(greedy, tmp_path / "run")


def test_config_snapshot_is_written_once(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    prepare_run_dir(tiny_config, tmp_path / "run")
    assert PipelineConfig.model_validate_json((tmp_path / "run" / "config.json").read_text()) == tiny_config


def test_model_uri_forms() -> None:
    assert parse_model_uri("models:/m@champion") == ("m", "champion", None)
    with pytest.raises(ValueError):
        parse_model_uri("runs:/abc/adapter")
