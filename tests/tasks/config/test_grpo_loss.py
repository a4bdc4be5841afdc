"""GRPO's loss and stability settings: each reaches TRL's ``GRPOConfig`` unchanged, each refused combination is one
clear error at config load, and a GSPO and a clip-higher run train on the tiny model."""

from __future__ import annotations

import pytest

from tasks.config import ConfigError, GRPOLossSettings, load_config
from tasks.config.grpo_loss import CISPO_EPSILON_HIGH

# (the setting, a value away from its default, the other settings that value needs)
CHANGED = [
    ("beta", 0.04, {}),
    ("scale_rewards", "batch", {}),
    ("multi_objective_aggregation", "normalize_then_sum", {}),
    ("epsilon", 0.1, {}),
    ("epsilon_high", 0.28, {}),
    ("delta", 1.5, {}),
    ("importance_sampling_level", "sequence", {"grpo.loss_type": "grpo"}),
    ("num_iterations", 2, {}),
    ("mask_truncated_completions", True, {}),
    ("off_policy_mask_threshold", 0.5, {}),
    ("top_entropy_quantile", 0.2, {}),
    ("entropy_coef", 0.01, {}),
    ("use_adaptive_entropy", True, {}),
    ("entropy_target", 1.5, {}),
    ("entropy_coef_min", 0.001, {}),
    ("entropy_coef_max", 0.5, {}),
    ("entropy_coef_delta", 0.01, {}),
    ("sapo_temperature_pos", 0.9, {"grpo.loss_type": "sapo"}),
    ("sapo_temperature_neg", 1.2, {"grpo.loss_type": "sapo"}),
    ("vespo_k_pos", 1.5, {"grpo.loss_type": "vespo", "grpo.vllm_importance_sampling_mode": "token_truncate"}),
    ("vespo_lambda_pos", 2.5, {"grpo.loss_type": "vespo", "grpo.vllm_importance_sampling_mode": "token_mask"}),
    ("vespo_k_neg", 2.5, {"grpo.loss_type": "vespo", "grpo.vllm_importance_sampling_correction": False}),
    ("vespo_lambda_neg", 1.5, {"grpo.loss_type": "vespo", "grpo.vllm_importance_sampling_mode": "token_mask"}),
    ("vllm_importance_sampling_correction", False, {}),
    ("vllm_importance_sampling_mode", "token_truncate", {}),
    ("vllm_importance_sampling_clip_min", 0.5, {}),
    ("vllm_importance_sampling_clip_max", 2.0, {}),
    *[("loss_type", loss, {}) for loss in ("grpo", "dr_grpo", "bnpo", "cispo", "sapo")],
    ("loss_type", "luspo", {"grpo.importance_sampling_level": "sequence"}),
    ("loss_type", "vespo", {"grpo.vllm_importance_sampling_mode": "token_mask"}),
]


def test_every_setting_is_covered_below() -> None:
    assert {name for name, _, _ in CHANGED} == set(GRPOLossSettings.model_fields)


@pytest.mark.parametrize(("name", "value", "needs"), CHANGED, ids=[f"{n}={v}" for n, v, _ in CHANGED])
def test_each_setting_reaches_grpo_config(name, value, needs, tmp_path) -> None:
    """The stage's own ``GRPOConfig`` (vLLM in colocate mode: the importance-sampling settings are read there)."""
    from tasks.training import grpo_training_args

    config = load_config(
        overrides={
            "output_dir": str(tmp_path),
            "grpo.batch_size": 8,
            "grpo.num_generations": 4,
            "grpo.generation.backend": "vllm",
            f"grpo.{name}": value,
            **needs,
        }
    )
    args = grpo_training_args(config, tmp_path, "vllm", [1.0, 0.2])
    assert getattr(args, name) == value
    assert getattr(args, name) != getattr(load_config().grpo, name)  # a change, not the default passing by


def test_cispo_caps_its_weights_at_five_unless_told() -> None:
    assert load_config(overrides={"grpo.loss_type": "cispo"}).grpo.epsilon_high == CISPO_EPSILON_HIGH
    assert load_config(overrides={"grpo.loss_type": "cispo", "grpo.epsilon_high": 3.0}).grpo.epsilon_high == 3.0
    assert load_config(overrides={"grpo.loss_type": "dapo"}).grpo.epsilon_high is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"grpo.loss_type": "luspo"}, "luspo is sequence-level: it needs importance_sampling_level: sequence"),
        ({"grpo.importance_sampling_level": "sequence"}, "GSPO is loss_type: grpo with importance_sampling_level"),
        (
            {"grpo.loss_type": "cispo", "grpo.importance_sampling_level": "sequence"},
            "with loss_type cispo weights each completion by its length",
        ),
        (
            {"grpo.loss_type": "vespo", "grpo.importance_sampling_level": "sequence"},
            "vespo computes its own sequence-level weights",
        ),
        ({"grpo.loss_type": "vespo"}, "vespo with vLLM needs a token-level vllm_importance_sampling_mode"),
        ({"grpo.loss_type": "cispo", "grpo.epsilon_high": 0.28}, "0.28 would cap every weight below 1"),
        ({"grpo.delta": 1.1}, r"delta \(1.1\) must exceed 1 \+ epsilon_high \(1.2\)"),
        ({"grpo.sapo_temperature_neg": 2.0}, "sapo_temperature_neg applies to loss_type sapo only, not dapo"),
        ({"grpo.loss_type": "cispo", "grpo.delta": 2.0}, "delta applies to loss_type"),
        (
            {"grpo.generation.backend": "transformers", "grpo.vllm_importance_sampling_clip_max": 2.0},
            "vllm_importance_sampling_clip_max: the vLLM correction applies only when vLLM generates",
        ),
        (
            {"grpo.vllm_importance_sampling_clip_min": 3.0},
            r"vllm_importance_sampling_clip_min \(3\) must be below vllm_importance_sampling_clip_max \(3\)",
        ),
        (
            {"grpo.vllm_importance_sampling_mode": "token_truncate", "grpo.vllm_importance_sampling_clip_max": None},
            "token_truncate needs vllm_importance_sampling_clip_min or _clip_max",
        ),
        (
            {"grpo.use_adaptive_entropy": True, "grpo.entropy_coef_min": 0.5, "grpo.entropy_coef_max": 0.1},
            r"entropy_coef_min \(0.5\) exceeds entropy_coef_max \(0.1\)",
        ),
    ],
)
def test_a_refused_combination_is_one_clear_error(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        load_config(overrides=overrides)
    assert str(error.value).count("\n") == 1  # the source line and the one reason


def test_the_vllm_correction_left_at_its_defaults_is_no_error_without_vllm() -> None:
    config = load_config(overrides={"grpo.generation.backend": "transformers", "grpo.loss_type": "vespo"})
    assert config.grpo.vllm_importance_sampling_correction  # TRL's default, ignored without vLLM: not refused
    again = load_config(overrides={"grpo": config.grpo.model_dump()})  # a dumped config loads again (nodes do)
    assert again.grpo == config.grpo


def test_new_settings_at_their_defaults_keep_the_config_hash() -> None:
    plain = load_config()
    assert load_config(overrides={"grpo.epsilon": 0.2, "grpo.num_iterations": 1}).config_hash() == plain.config_hash()
    assert load_config(overrides={"grpo.epsilon_high": 0.28}).config_hash() != plain.config_hash()
