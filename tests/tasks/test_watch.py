"""The champion watch on a real MLflow store with real evaluation on the tiny model. v1 is an untrained adapter
(the base model's behaviour); v2 is made weaker for real — random LoRA weights on the output layer, so its
general-text perplexity rises about fourfold, far past the forgetting tolerance — and forced to champion with a
manual rollback --to 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import PipelineConfig
from tasks.layout import RunLayout
from tasks.registry import (
    CHAMPION,
    alias_version_number,
    champion_moves,
    client_for,
    move_champion,
    pin_champion,
    register_adapter,
    rollback_champion,
)
from tasks.tracking import start_pipeline
from tasks.watch import LAST_WATCH_TAG, WatchRefused, run_watch


@pytest.fixture
def forced_weaker(tiny_config: PipelineConfig, lora_adapter, tmp_path: Path):
    """v1 champion (untrained), v2 damaged and forced to champion by hand; returns (config, client, name)."""
    config = tiny_config.model_copy(update={"watch": tiny_config.watch.model_copy(update={"cooldown_h": 0.0})})
    name = config.tracking.registered_model_name
    client = client_for(config.resolved_tracking_uri())
    tracker = start_pipeline(config, RunLayout(tmp_path / "outputs" / "run-1"))  # logs the training params
    with tracker.stage("promote") as stage:
        for number, noise in (("1", 0.0), ("2", 1.0)):
            stage.log_artifact(lora_adapter(tmp_path / f"adapter-{number}", noise), f"adapter-{number}")
            tags = {"base_model": "tiny-random", "pipeline_run_id": f"run-{number}"}
            version = register_adapter(client, name, stage.run_id, f"adapter-{number}", tags)
            assert version == number
    move_champion(client, name, "1", "the better one", by="pipeline run run-1")
    rollback_champion(client, name, to_version="2", reason="forced by hand")
    return config, client, name


def _with(config: PipelineConfig, **watch) -> PipelineConfig:
    return config.model_copy(update={"watch": config.watch.model_copy(update=watch)})


def test_watch_rolls_a_forced_weaker_champion_back_with_the_reason(forced_weaker, tmp_path) -> None:
    config, client, name = forced_weaker
    report = run_watch(_with(config, action="rollback"), name, tmp_path / "w")
    assert report.moved and alias_version_number(client, name, CHAMPION) == "1"
    reason = report.decision.reason
    assert report.decision.event == "rolled-back" and "v2 forgets — forgetting against the base model" in reason
    assert "general-text perplexity rose" in reason and "(95% CI [" in reason
    last = champion_moves(client, name)[-1]
    assert (last.version, last.kind, last.by) == ("1", "watch", "grpoflow watch") and "forgets" in last.why
    assert "forgets" in client.get_model_version(name, "2").tags["grpoflow.watch_regressed"]
    assert [row["role"] for row in report.table] == ["champion", "previous", "base"]
    # The restored champion is healthy: the next watch on the same data changes nothing.
    again = run_watch(_with(config, action="rollback"), name, tmp_path / "w2")
    assert again.decision.status == "healthy" and not again.moved


def test_watch_alerts_without_moving_and_a_pinned_champion_stays(forced_weaker, tmp_path) -> None:
    config, client, name = forced_weaker
    report = run_watch(_with(config, action="alert"), name, tmp_path / "w")
    assert not report.moved and alias_version_number(client, name, CHAMPION) == "2"
    assert report.decision.event == "regressed" and report.decision.would_move_to == "1"
    assert "watch.action is alert" in report.decision.reason
    again = run_watch(_with(config, action="alert"), name, tmp_path / "w2")  # nothing changed since
    assert again.skipped and "unchanged since the watch" in again.skipped
    pin_champion(client, name, "2", "known trade-off")
    pinned = run_watch(_with(config, action="rollback"), name, tmp_path / "w3")
    assert not pinned.moved and "v2 is pinned" in pinned.decision.reason
    assert alias_version_number(client, name, CHAMPION) == "2"


def test_watch_respects_the_cooldown_after_a_move(forced_weaker, tmp_path) -> None:
    config, client, name = forced_weaker
    report = run_watch(_with(config, action="rollback", cooldown_h=6.0), name, tmp_path / "w")
    assert not report.moved and "within the 6 h cooldown" in report.decision.reason
    assert alias_version_number(client, name, CHAMPION) == "2"


def test_a_watch_that_changed_under_it_never_moves(forced_weaker, tmp_path, make_scores) -> None:
    """The scores seam: the decision sees v1 better on pass@1; the champion moves elsewhere while it evaluates."""
    config, client, name = forced_weaker

    def score(config, holdout_path, specs):
        client.set_registered_model_alias(name, CHAMPION, "1")  # someone moves champion meanwhile
        per_prompt = {"champion": [0.0] * 30, "previous": [1.0] * 30, "base": [0.0] * 30}
        return {role: make_scores(spec.name, per_prompt[role]) for role, spec in specs.items()}

    report = run_watch(_with(config, action="rollback"), name, tmp_path / "w", score=score)
    assert "(the champion before) is now better" in report.decision.reason
    assert not report.moved and "champion changed to v1 while the watch evaluated" in report.decision.reason


def test_a_watch_config_for_another_task_is_refused(forced_weaker, tmp_path) -> None:
    config, client, name = forced_weaker
    other = config.model_copy(update={"data": config.data.model_copy(update={"holdout_fraction": 0.5})})
    with pytest.raises(WatchRefused, match=r"data.holdout_fraction: the champion's run had 0.2, this config 0.5"):
        run_watch(other, name, tmp_path / "w")
    assert LAST_WATCH_TAG not in client.get_registered_model(name).tags


def test_grpoflow_watch_command_prints_the_table_and_moves_back(forced_weaker, tmp_path) -> None:
    """The command runs the watch flow (its MLflow run, Prefect artifact and event) and says what it did."""
    from click.testing import CliRunner

    from flows.cli import main

    config, client, name = forced_weaker
    config_file = tmp_path / "watch.yaml"
    config_file.write_text(Path("configs/tiny.yaml").read_text() + f"\noutput_dir: {config.output_dir}\n")

    class Command:
        name = "grpoflow"

        def main(self, args, prog_name=None, **extra):
            main(list(args))

    args = [
        "watch",
        name,
        "--config",
        str(config_file),
        "--set",
        "watch.action=rollback",
        "--set",
        "watch.cooldown_h=0",
    ]
    result = CliRunner().invoke(Command(), args)  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    assert "regressed" in result.output and "champion moved back to v1" in result.output
    assert alias_version_number(client, name, CHAMPION) == "1"
    runs = client.search_runs(
        [client.get_experiment_by_name("grpoflow").experiment_id], "tags.`grpoflow.stage` = 'watch'"
    )
    assert [run.data.tags["grpoflow.watch.status"] for run in runs] == ["regressed"]
    assert runs[0].data.tags["grpoflow.watch.moved_to"] == "1"
