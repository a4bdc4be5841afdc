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
                "eval_margin": 0.0,  # the plain maximum: this model's moves are within 8 prompts' noise
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
    # Each evaluation's per-prompt scores (the noise selection reads) are kept, and their mean is the logged score.
    per_prompt = {int(k): v for k, v in json.loads((stage / "holdout-scores.json").read_text()).items()}
    assert sorted(per_prompt) == [step for step, _ in scores]
    assert all(len(v) == 8 and abs(sum(v) / 8 - dict(scores)[k]) < 1e-9 for k, v in per_prompt.items())
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


def _checkpoints(root, steps):  # noqa: ANN001, ANN202
    for step in steps:
        folder = root / "checkpoints" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (folder / name).write_text(f"{name} of step {step}")
    (root / "adapter").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "adapter" / name).write_text(f"{name} of step {steps[-1]}")


def test_a_later_step_is_selected_only_when_it_is_better_beyond_the_slices_noise(tiny_config, tmp_path) -> None:
    """The demo's own case: the evaluations rise 0.25 → 0.31 → 0.44 on 16 prompts, step 20 within step 10's paired
    noise, step 30 beyond it. The plain maximum would hand on 30 for any rise; with grpo.eval_margin 1 step 20 does
    not replace 10, step 30 does; with a margin of 3 neither does. Patience counts the within-noise rise as none."""
    from types import SimpleNamespace

    from tasks.training import HoldoutPatience, select_adapter

    ten = [0.0] * 12 + [1.0] * 4
    twenty = [1.0, 1.0] + [0.0] * 11 + [1.0] * 3  # two up, one down: +0.0625, one standard error 0.11
    thirty = [0.0] * 9 + [1.0] * 7  # three more: +0.19 over step 10, standard error 0.10
    per_prompt = {10: ten, 20: twenty, 30: thirty}
    history = [{"step": s, "eval_holdout_reward": sum(v) / 16} for s, v in per_prompt.items()]

    def selected(margin: float, root) -> int:  # noqa: ANN001
        _checkpoints(root, [10, 20, 30])
        settings = tiny_config.grpo.model_copy(
            update={"select": "best", "eval_metric": "reward", "eval_margin": margin}
        )
        config = SimpleNamespace(grpo=settings)
        selection = select_adapter(config, history, 30, root / "checkpoints", root / "adapter", per_prompt)
        assert (root / "adapter" / "adapter_model.safetensors").read_text().endswith(f"step {selection.step}")
        assert "grpo.eval_margin" in selection.reason
        return selection.step

    assert selected(1.0, tmp_path / "one") == 30
    assert selected(3.0, tmp_path / "three") == 10
    only_ten_and_twenty = {10: ten, 20: twenty}
    history = history[:2]
    assert selected(1.0, tmp_path / "within") == 10  # +0.0625 is not beyond one standard error (0.11)
    assert selected(0.0, tmp_path / "plain") == 20  # the plain maximum reads the noise

    patience = HoldoutPatience("reward", 1, margin=1.0, per_prompt=only_ten_and_twenty)
    control = SimpleNamespace(should_training_stop=False)
    for step in (10, 20):
        logs = {"eval_holdout_reward": sum(only_ten_and_twenty[step]) / 16}
        patience.on_log(None, SimpleNamespace(global_step=step), control, logs)
    assert control.should_training_stop and patience.verdict.numbers["best"] == 0.25
