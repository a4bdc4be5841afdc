"""The champion history on a real MLflow store: it survives forced moves and moves made outside grpoflow, an
alias is held by one version, and the history never outgrows a tag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.registry import (
    CHALLENGER,
    CHAMPION,
    HISTORY_TAG,
    MOVE_TAG_PREFIX,
    RegistryError,
    alias_version_number,
    apply_promotion,
    champion_moves,
    client_for,
    move_champion,
    reconcile,
    rollback_champion,
    version_rows,
)


@pytest.fixture
def model(tmp_path: Path):
    """A registered model with four versions (a tiny artifact each), none champion yet."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = client_for(uri)
    experiment = client.create_experiment("champions", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    client.log_artifacts(run.info.run_id, str(tmp_path / "adapter"), "adapter")
    client.create_registered_model("m")
    for number in range(4):
        client.create_model_version(
            "m", f"runs:/{run.info.run_id}/adapter", run.info.run_id, tags={"metric.pass_at_1": f"0.{number}"}
        )
    return client, "m"


def champion(client, name) -> str | None:
    return alias_version_number(client, name, CHAMPION)


def test_rollback_after_a_forced_move_returns_to_the_champion_before(model) -> None:
    client, name = model
    for version in ("1", "2", "3"):
        move_champion(client, name, version, f"promoted {version}", by="pipeline run r")
    assert rollback_champion(client, name, to_version="2", reason="forced") == "2"
    assert rollback_champion(client, name, reason="undo the forced move") == "3"  # the champion before --to
    assert rollback_champion(client, name) == "2"
    assert rollback_champion(client, name) == "1"
    with pytest.raises(RegistryError, match="no earlier champion"):
        rollback_champion(client, name)
    kinds = [(m.version, m.kind) for m in champion_moves(client, name)]
    assert kinds == [
        ("1", "promote"),
        ("2", "promote"),
        ("3", "promote"),
        ("2", "set"),
        ("3", "undo"),
        ("2", "undo"),
        ("1", "undo"),
    ]
    moves = champion_moves(client, name)
    assert moves[3].why == "forced" and moves[0].by == "pipeline run r" and moves[3].at


def test_a_move_made_in_the_ui_is_reconciled_and_can_be_undone(model) -> None:
    client, name = model
    move_champion(client, name, "1", "first")
    move_champion(client, name, "2", "second")
    client.set_registered_model_alias(name, CHAMPION, "4")  # what the MLflow UI does: no grpoflow history
    moves, current = reconcile(client, name)
    assert current == "4" and (moves[-1].version, moves[-1].kind) == ("4", "external")
    assert rollback_champion(client, name) == "2"
    client.delete_registered_model_alias(name, CHAMPION)  # removed in the UI: a rollback brings back the last one
    assert rollback_champion(client, name) == "1"


def test_an_alias_is_held_by_one_version_only(model) -> None:
    client, name = model
    move_champion(client, name, "1", "first")
    apply_promotion(client, name, "2", False, "not better", "1")
    assert alias_version_number(client, name, CHALLENGER) == "2"
    rollback_champion(client, name, to_version="2", reason="try it")
    assert champion(client, name) == "2" and alias_version_number(client, name, CHALLENGER) is None
    apply_promotion(client, name, "3", False, "not better", "2")
    move_champion(client, name, "3", "promoted by hand")
    assert alias_version_number(client, name, CHALLENGER) is None
    aliases = {row["version"]: row["aliases"] for row in version_rows(client, name)}
    assert aliases == {"4": "-", "3": "champion", "2": "-", "1": "-"}


def test_a_long_history_never_outgrows_a_tag(model) -> None:
    client, name = model
    for index in range(60):
        move_champion(client, name, str(index % 4 + 1), "a long reason " * 200)  # 2,800 characters each
    tags = client.get_registered_model(name).tags
    moves = [key for key in tags if key.startswith(MOVE_TAG_PREFIX)]
    assert len(moves) == 60 and max(len(value) for value in tags.values()) <= 5000
    assert len(champion_moves(client, name)) == 60 and rollback_champion(client, name) == "3"


def test_a_history_recorded_before_moves_were_tags_still_rolls_back(model) -> None:
    client, name = model
    client.set_registered_model_alias(name, CHAMPION, "3")
    client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(["1", "3"]))
    assert rollback_champion(client, name, reason="legacy") == "1"


def test_versions_lists_aliases_and_headline_metrics(model) -> None:
    client, name = model
    move_champion(client, name, "2", "best")
    rows = version_rows(client, name)
    assert [row["version"] for row in rows] == ["4", "3", "2", "1"]
    assert rows[2]["aliases"] == "champion" and rows[2]["pass_at_1"] == "0.1"
