"""Hold-out accuracy while GRPO trains, the best checkpoint handed on, the early stop on a stalled score: real GRPO
stages on the tiny model, whose hold-out reward rises at a high learning rate and falls back when a planted
degradation resets the adapter after step K."""

from __future__ import annotations

import json

import torch
from transformers import TrainerCallback

from tasks.config import PipelineConfig
from tasks.grpo import run_grpo
from tasks.training import read_ledger

K = 4  # the planted degradation: from step K + 1 on, the adapter is reset to where it started


class ResetAdapterAfter(TrainerCallback):
    """After step ``k``, every step ends with the LoRA B matrices at zero: the policy is the base model again, so
    the hold-out score falls back to the base model's."""

    def __init__(self, k: int) -> None:
        self.k = k

    def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201, D102
        if state.global_step > self.k:
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "lora_B" in name:
                        parameter.zero_()


def _config(tiny_config: PipelineConfig, **grpo) -> PipelineConfig:  # noqa: ANN003
    """The tiny config with a reward whose hold-out mean moves on a random model (accuracy is 0 at every step)."""
    return PipelineConfig.model_validate(
        {
            **tiny_config.model_dump(),
            "model": {**tiny_config.model.model_dump(), "precision": "fp32"},
            "rewards": [{"name": "length_closeness", "args": {"target_chars": 4}}],
            "grpo": {
                **tiny_config.grpo.model_dump(),
                "learning_rate": 1e-2,
                "eval_prompts": 8,
                "eval_metric": "reward",
                **grpo,
            },
        }
    )


def _scores(result) -> list[tuple[int, float]]:  # noqa: ANN001
    return [(int(e["step"]), e["eval_holdout_reward"]) for e in result.history if "eval_holdout_reward" in e]


def test_best_hands_on_a_checkpoint_before_the_degradation_and_patience_stops(
    tiny_config, tiny_split, tiny_model_dir, tmp_path
) -> None:
    config = _config(
        tiny_config,
        max_steps=10,
        eval_steps=1,
        select="best",
        checkpoint_steps=0,  # with select best, every evaluation step is a checkpoint all the same
        eval_patience=2,
        log_completions_every=0,
    )
    stage = tmp_path / "grpo"
    result = run_grpo(config, tiny_split.train_path, tiny_model_dir, None, stage, callbacks=[ResetAdapterAfter(K)])
    scores = _scores(result)
    assert [step for step, _ in scores] == list(range(1, K + 3))  # every step evaluated, stopped 2 after the fall
    assert max(score for _, score in scores[:K]) > scores[K][1] == scores[K + 1][1]  # it moved, then fell back
    assert result.stop["cause"] == "holdout_plateau" and result.steps == K + 2

    selection = result.selection
    assert selection["select"] == "best" and selection["step"] <= K and selection["last_step"] == K + 2
    best = max(scores, key=lambda item: item[1])
    assert selection["step"] == next(step for step, score in scores if score == best[1])  # ties: the earlier
    assert json.loads((stage / "selection.json").read_text()) == selection
    # The adapter handed on is the best checkpoint's, byte for byte; the rotation (keep 2) kept that checkpoint.
    checkpoint = stage / "checkpoints" / f"checkpoint-{selection['step']}"
    handed_on = (stage / "adapter" / "adapter_model.safetensors").read_bytes()
    assert handed_on == (checkpoint / "adapter_model.safetensors").read_bytes()
    assert handed_on != (stage / "checkpoints" / f"checkpoint-{K + 2}" / "adapter_model.safetensors").read_bytes()

    # The samples are in the ledger as role eval (sampled) and eval_greedy, at their steps; GRPO's rows are apart.
    ledger = read_ledger(stage / "rollouts")
    evals = [row for row in ledger if row["role"] == "eval"]
    assert sorted({row["step"] for row in evals}) == list(range(1, K + 3))
    assert len(evals) == (K + 2) * config.grpo.eval_prompts * config.grpo.eval_samples
    assert {row["step"] for row in ledger if row["role"] == "eval_greedy"} == {row["step"] for row in evals}
    assert {row["role"] for row in ledger} == {"grpo", "eval", "eval_greedy"}

    # Resumed with more steps: the evaluations before the resume count (the history and the best are kept).
    longer = config.model_copy(update={"grpo": config.grpo.model_copy(update={"max_steps": 12, "eval_patience": 3})})
    resumed = run_grpo(longer, tiny_split.train_path, tiny_model_dir, None, stage, callbacks=[ResetAdapterAfter(K)])
    assert [step for step, _ in _scores(resumed)][: K + 2] == list(range(1, K + 3))
    assert resumed.selection["step"] == selection["step"] and resumed.steps == K + 3  # one more stalled evaluation
    assert (stage / "adapter" / "adapter_model.safetensors").read_bytes() == handed_on


def test_the_adapter_is_the_same_with_the_evaluation_on_and_off(tiny_config, tiny_split, tiny_model_dir, tmp_path):
    """The evaluation samples from its own seeded generator: the training random stream is untouched."""
    adapters = []
    for eval_steps in (0, 1):
        config = _config(tiny_config, max_steps=3, eval_steps=eval_steps)
        result = run_grpo(config, tiny_split.train_path, tiny_model_dir, None, tmp_path / f"grpo-{eval_steps}")
        assert len(_scores(result)) == 3 * eval_steps
        assert result.selection["select"] == "last" and result.selection["step"] == 3
        adapters.append((result.adapter_dir / "adapter_model.safetensors").read_bytes())
    assert adapters[0] == adapters[1]
