import sys
from pathlib import Path

import pytest

from tasks.config import ConfigError, PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[3]


def test_typo_fails_at_load_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("grpo:\n  num_generation: 4\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "grpo.num_generation" in str(error.value)
    assert str(path) in str(error.value)


def test_mistyped_value_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("sft:\n  max_steps: many\n")
    with pytest.raises(ConfigError, match=r"sft\.max_steps"):
        load_config(path)


def test_unknown_reward_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(overrides={"rewards": [{"name": "math_acuracy"}]})
    assert "rewards.0.name" in str(error.value)
    assert "math_accuracy" in str(error.value)  # the list of known names


def test_import_path_reward_is_imported_when_the_config_loads(tmp_path: Path) -> None:
    """The config model checks the form statically; loading a config imports the reward, from PYTHONPATH or the
    config file's folder, so a typo fails before any data or model is touched."""
    assert PipelineConfig.model_validate({"rewards": [{"name": "my_pkg.rewards:score"}]}).rewards[0].weight == 1.0
    with pytest.raises(ConfigError, match=r"rewards\.0\.name: reward function 'my_pkg.rewards:score' cannot be"):
        load_config(overrides={"rewards": [{"name": "my_pkg.rewards:score", "weight": 0.5}]})
    reward_module = "def score(completions, **kwargs):\n    return [1.0] * len(completions)"
    (tmp_path / "config_dir_rewards.py").write_text(reward_module)
    sys.modules.pop("config_dir_rewards", None)
    config_file = tmp_path / "mine.yaml"
    config_file.write_text("rewards:\n  - name: config_dir_rewards:score\n    weight: 0.5\n")
    assert load_config(config_file).rewards[0].weight == 0.5  # found beside the config
    config_file.write_text("rewards:\n  - name: config_dir_rewards:scroe\n")
    with pytest.raises(ConfigError, match="has no attribute 'scroe'"):
        load_config(config_file)


def test_batch_must_hold_whole_groups() -> None:
    with pytest.raises(ConfigError, match="multiple of grpo.num_generations"):
        load_config(overrides={"grpo.batch_size": 10, "grpo.num_generations": 4})


def test_n_samples_must_cover_largest_k() -> None:
    with pytest.raises(ConfigError, match="largest k"):
        load_config(overrides={"evaluation.n_samples": 2, "evaluation.k": [1, 4]})


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(tmp_path / "nowhere.yaml")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_statically(path: Path) -> None:
    # Loading touches no network or model: Hub model ids validate here even though they cannot run offline.
    assert isinstance(load_config(path), PipelineConfig)


def test_config_hash_ignores_output_dir_but_not_seed() -> None:
    a = load_config(overrides={"output_dir": "/tmp/a"})
    b = load_config(overrides={"output_dir": "/tmp/b"})
    c = load_config(overrides={"seed": 3})
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_default_tracking_store_is_sqlite_under_output_dir(tmp_path: Path) -> None:
    config = load_config(overrides={"output_dir": str(tmp_path)})
    assert config.resolved_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"


def test_every_kind_has_a_correctness_reward() -> None:
    from reward_fns.registry import CORRECTNESS_REWARD, REWARD_FUNCTIONS

    config = load_config(overrides={"data.kind": "code", "rewards": [{"name": "code_tests"}]})
    assert CORRECTNESS_REWARD[config.data.kind] == "code_passes"
    assert all(name in REWARD_FUNCTIONS for name in CORRECTNESS_REWARD.values())


def test_config_hash_of_an_unchanged_config_is_what_it_was_before_the_package_move() -> None:
    """Part of Prefect's cache key: ``--resume`` of a run started before the move still finds its stages."""
    assert load_config(REPO / "configs" / "tiny.yaml").config_hash() == "3c89c1bf1078fa28"


def test_keys_added_later_change_the_hash_only_when_set() -> None:
    base = load_config(REPO / "configs" / "tiny.yaml")
    blocked = load_config(REPO / "configs" / "tiny.yaml", {"promotion.block_on_audit": True})
    bound = load_config(REPO / "configs" / "tiny.yaml", {"grpo.generation.vllm_max_logp_difference": 0.2})
    assert len({base.config_hash(), blocked.config_hash(), bound.config_hash()}) == 3


def test_an_overlay_extends_a_config_and_a_broken_chain_is_one_error(tmp_path) -> None:  # noqa: ANN001
    """``extends:`` merges a file's sections into another's (paths relative to the file that wrote them); a missing
    or circular parent is one error naming the file."""
    import pytest

    from tasks.config import ConfigError, load_config

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "base.yaml").write_text(
        "name: base\ndata: {source: rows.jsonl}\ngrpo: {max_steps: 7, beta: 0.1}\n"
    )
    (tmp_path / "overlay.yaml").write_text("extends: recipe/base.yaml\ngrpo: {max_steps: 9}\n")
    config = load_config(tmp_path / "overlay.yaml")
    assert (config.name, config.grpo.max_steps, config.grpo.beta) == ("base", 9, 0.1)
    assert str(config.data.source) == str(tmp_path / "recipe" / "rows.jsonl")
    (tmp_path / "missing.yaml").write_text("extends: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"missing.yaml: extends nowhere.yaml: no such config file"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends a.yaml, which extends"):
        load_config(tmp_path / "a.yaml")


def test_nodes_on_a_vllm_server_need_a_hand_over_folder_both_reach() -> None:
    """Each node writes its synced adapter where the server must read it: /dev/shm is the node's own, so the pair is
    refused at load with one line naming both keys and the one that makes it work."""
    import pytest

    from tasks.config import ConfigError, load_config

    server = {
        "orchestration.nodes": 2,
        "grpo.generation.backend": "vllm",
        "grpo.generation.vllm_mode": "server",
        "grpo.generation.vllm_server_base_url": "http://10.0.0.5:8000",
    }
    with pytest.raises(ConfigError, match=r"orchestration.nodes 2 with grpo.generation.vllm_mode server needs "):
        load_config(overrides=server)
    config = load_config(overrides={**server, "grpo.generation.vllm_adapter_dir": "/shared/adapters"})
    assert str(config.grpo.generation.vllm_adapter_dir) == "/shared/adapters"
