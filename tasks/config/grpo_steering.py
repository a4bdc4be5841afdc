"""GRPO's steering settings: hold-out accuracy while it trains (every ``eval_steps``), which checkpoint it hands on
(``select``: the last, or the best by that score), and an early stop when the score stops improving; with the rules
that refuse a combination that cannot work. The evaluation itself: ``tasks/training/holdout.py``.
Must not import: torch, transformers, TRL, Prefect, MLflow (loading a config is static)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.config.base import Strict

EvalMetric = Literal["pass_at_1", "greedy_accuracy", "reward"]


class GRPOSteeringSettings(Strict):
    """The part of ``grpo`` that watches the hold-out split while GRPO trains (docs/steering.md)."""

    eval_steps: int = Field(
        0,
        ge=0,
        description="Every N steps (and at the last), score a fixed slice of the hold-out split with the policy being "
        "trained, through the engine that generates (0: never).",
    )
    eval_prompts: int = Field(
        32,
        ge=1,
        description="The slice: the last N hold-out rows. With eval_steps set, the final evaluation leaves them out.",
    )
    eval_samples: int = Field(2, ge=1, description="Sampled completions per prompt (beside one greedy) per evaluation.")
    eval_metric: EvalMetric = Field(
        "pass_at_1",
        description="The score that picks the best checkpoint and drives eval_patience: sampled pass@1, greedy "
        "accuracy, or the mean weighted reward of the samples (moves where accuracy is still 0).",
    )
    select: Literal["last", "best"] = Field(
        "last",
        description="The adapter GRPO hands to evaluation and promotion: the last step's, or the checkpoint with the "
        "best in-training score (the earliest, unless a later one beats it beyond eval_margin; needs eval_steps; "
        "every evaluation step is then a checkpoint, also with checkpoint_steps 0).",
    )
    eval_patience: int = Field(
        0, ge=0, description="Stop when the score has not improved for this many evaluations in a row (0: never)."
    )
    eval_margin: float = Field(
        1.0,
        ge=0,
        description="How much better an evaluation must be to count as an improvement, for select: best and "
        "eval_patience: more than this many standard errors of its paired per-prompt difference from the earlier "
        "(the slice's noise: 32 prompts × 2 samples is ±0.03–0.07 on pass@1); 0: any higher score.",
    )


def steering_problems(settings: GRPOSteeringSettings) -> list[str]:
    """Why these settings cannot work as written; empty when they can. (``eval_steps`` above ``max_steps`` is no
    error: the last step is always evaluated, so a short run scores once.)

    >>> steering_problems(GRPOSteeringSettings(select="best"))
    ['select best picks among in-training evaluations: set eval_steps (e.g. 10)']
    >>> steering_problems(GRPOSteeringSettings(eval_steps=10, select="best"))
    []
    """
    problems = []
    if settings.select == "best" and not settings.eval_steps:
        problems.append("select best picks among in-training evaluations: set eval_steps (e.g. 10)")
    if settings.eval_patience and not settings.eval_steps:
        problems.append("eval_patience counts in-training evaluations: set eval_steps")
    return problems


def holdout_problems(settings: GRPOSteeringSettings, holdout_rows: int) -> list[str]:
    """Why these settings cannot work on a hold-out split of ``holdout_rows`` rows (known once validate has split
    the data, before any model is loaded); empty when they can. The in-training slice is left out of the final
    evaluation, so the split must hold more rows than the slice.

    >>> holdout_problems(GRPOSteeringSettings(eval_steps=5, eval_prompts=32), 20)[0][:60]
    'grpo.eval_prompts (32) takes every row of the hold-out split'
    >>> holdout_problems(GRPOSteeringSettings(eval_prompts=32), 20)  # no in-training evaluation: no slice
    []
    """
    if settings.eval_steps and holdout_rows <= settings.eval_prompts:
        return [
            f"grpo.eval_prompts ({settings.eval_prompts}) takes every row of the hold-out split ({holdout_rows}) "
            "for the in-training evaluation (grpo.eval_steps), leaving none for the final one: lower "
            "grpo.eval_prompts or raise data.holdout_fraction"
        ]
    return []
