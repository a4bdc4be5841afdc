"""The flow's base-model step: the Prefect task resolves ``model.source`` to the folder the stages load."""

from pathlib import Path

from tasks.base_model import resolve_model_task


def test_the_base_model_step_resolves_the_configured_source(tiny_model_dir: Path) -> None:
    folder = resolve_model_task.fn("tiny-random")  # the task's plain function, as the flow runs it
    assert folder == tiny_model_dir and (folder / "config.json").is_file()
    assert resolve_model_task.name == "resolve-model"  # part of Prefect's cache key: it must not change
