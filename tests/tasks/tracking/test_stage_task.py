"""The stage cache key: a resumed run hits; another output folder, a recreated run folder or another config
never does (a hit there would hand back paths to files that are gone)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from tasks.config import PipelineConfig
from tasks.layout import RunLayout
from tasks.tracking import Tracker, stage_cache_key


def _key(config: PipelineConfig, run_dir: Path, **upstream: object) -> str:
    tracker = Tracker("sqlite:///unused.db", "0", "parent-1", run_dir.name, run_dir)
    context = SimpleNamespace(task=SimpleNamespace(name="validate"))
    return stage_cache_key(context, {"config": config, "tracker": tracker, **upstream})


def _prepared(config: PipelineConfig, output_dir: Path, run_id: str = "tiny-1") -> Path:
    layout = RunLayout.of(output_dir, run_id)
    layout.prepare(config)
    return layout.run_dir


def test_the_same_run_folder_gives_the_same_key_on_resume(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    run_dir = _prepared(tiny_config, tmp_path / "a")
    first = _key(tiny_config, run_dir)
    RunLayout(run_dir).prepare(tiny_config)  # a resume prepares the folder again
    assert _key(tiny_config, run_dir) == first
    assert first.startswith("grpoflow-validate-")


def test_another_output_folder_with_the_same_run_id_misses(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    assert _key(tiny_config, _prepared(tiny_config, tmp_path / "a")) != _key(
        tiny_config, _prepared(tiny_config, tmp_path / "b")
    )


def test_a_deleted_and_recreated_run_folder_misses(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    run_dir = _prepared(tiny_config, tmp_path / "a")
    before = _key(tiny_config, run_dir)
    shutil.rmtree(run_dir)
    assert _prepared(tiny_config, tmp_path / "a") == run_dir
    assert _key(tiny_config, run_dir) != before


def test_config_and_upstream_outputs_are_part_of_the_key(tiny_config: PipelineConfig, tmp_path: Path) -> None:
    run_dir = _prepared(tiny_config, tmp_path / "a")
    other = tiny_config.model_copy(update={"seed": tiny_config.seed + 1})
    assert _key(tiny_config, run_dir) != _key(other, run_dir)
    assert _key(tiny_config, run_dir, train_path="x.jsonl") != _key(tiny_config, run_dir, train_path="y.jsonl")
