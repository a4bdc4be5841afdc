"""What the stage ships to nodes: the local folders a node cannot have (reward modules, reward-model folders); a
Hub id is left for each node to resolve."""

from __future__ import annotations

from pathlib import Path

from tasks.config import load_config
from tasks.training.nodes.shipping import ship_reward_models


def test_a_reward_model_given_as_a_local_folder_is_shipped_and_a_hub_id_is_not(tmp_path: Path) -> None:
    folder = tmp_path / "rm"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    rewards = [
        {"name": "math_accuracy"},
        {"name": "reward_model", "args": {"model": str(folder)}, "weight": 0.5},
        {"name": "reward_model", "args": {"model": "OpenAssistant/reward-model-deberta-v3-large"}, "weight": 0.5},
    ]
    config = load_config(overrides={"rewards": rewards})
    shipped: list[tuple[Path, str]] = []
    assert ship_reward_models(lambda local, name: shipped.append((local, name)), config) == [1]
    assert shipped == [(folder, "launch/inputs/reward-models/1")]
