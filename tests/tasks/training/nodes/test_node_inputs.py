"""What the stage ships to nodes: the local folders a node cannot have (reward modules, reward-model folders); a
Hub id is left for each node to resolve, or shipped from this machine's Hub cache with ship_hub_model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.training.nodes.exchange import NodeInputError
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


def test_with_ship_hub_model_a_hub_reward_model_goes_from_this_machines_cache_or_the_key_is_named(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--rm" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--org--rm" / "refs").mkdir()
    (cache / "models--org--rm" / "refs" / "main").write_text("a" * 40)
    rewards = [
        {"name": "math_accuracy"},
        {"name": "reward_model", "args": {"model": "org/rm"}, "weight": 0.5},
    ]
    config = load_config(overrides={"rewards": rewards, "orchestration": {"ship_hub_model": True}})
    shipped: list[tuple[Path, str]] = []
    assert ship_reward_models(lambda local, name: shipped.append((local, name)), config, cache) == [1]
    assert shipped == [(snapshot, "launch/inputs/reward-models/1")]

    missing = load_config(
        overrides={
            "rewards": [{"name": "reward_model", "args": {"model": "org/absent"}}],
            "orchestration": {"ship_hub_model": True},
        }
    )
    with pytest.raises(NodeInputError, match=r"rewards\[0\]\.args\.model: org/absent is not in this machine's Hub"):
        ship_reward_models(lambda local, name: None, missing, cache)
