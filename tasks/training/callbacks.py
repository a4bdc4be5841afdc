"""Trainer callbacks of the GRPO stage that watch the rewards: a guard that stops training when a reward function
cannot judge too many completions, and a sampler that hands a table of completions with their rewards to MLflow.
Must not import: Prefect, MLflow (the sink the stage hands in writes to MLflow).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import TrainerCallback

from reward_fns.registry import IsolatedReward
from tasks.errors import GateStop


class RewardNoneLimitExceeded(GateStop, RuntimeError):
    """Too many rewards were ``None`` (cannot judge): TRL would silently train on them as zeros."""


class NoneShareGuard(TrainerCallback):
    """Stops training when a reward function's ``None`` share passes the limit (after a warm-up of samples)."""

    def __init__(self, rewards: Sequence[IsolatedReward], limit: float, min_samples: int = 32) -> None:
        self.rewards, self.limit, self.min_samples = rewards, limit, min_samples

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for reward in self.rewards:
            stats = reward.stats
            if stats.scored >= self.min_samples and stats.none_share > self.limit:
                raise RewardNoneLimitExceeded(
                    f"reward {reward.__name__} could not judge {stats.none}/{stats.scored} completions "
                    f"({stats.none_share:.0%} > grpo.max_none_share {self.limit:.0%}); "
                    f"errors: {stats.errors}, last: {stats.last_error}"
                )


class CompletionSampleLogger(TrainerCallback):
    """Every ``every`` steps, hands ``sink`` a table of the step's completions with each function's reward, so
    reward hacking can be seen while it happens (the table goes to MLflow in the task wrapper)."""

    def __init__(
        self,
        rewards: Sequence[IsolatedReward],
        weights: Sequence[float],
        every: int,
        sink: Callable[[int, dict[str, list[Any]]], None],
        rows: int = 16,
    ) -> None:
        self.rewards, self.weights, self.every, self.sink, self.rows = rewards, weights, every, sink, rows

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.every or state.global_step % self.every or not self.rewards[0].last_batch:
            return
        first = self.rewards[0].last_batch
        count = min(self.rows, len(first["completions"]))
        table: dict[str, list[Any]] = {
            "step": [state.global_step] * count,
            "prompt": [str(p)[-300:] for p in first["prompts"][:count]],
            "completion": [str(c) for c in first["completions"][:count]],
        }
        total = [0.0] * count
        for reward, weight in zip(self.rewards, self.weights, strict=True):
            values = reward.last_batch.get("rewards", [None] * count)[:count]
            table[reward.__name__] = values
            total = [t + weight * (v or 0.0) for t, v in zip(total, values, strict=True)]
        table["weighted_reward"] = total
        self.sink(state.global_step, table)
