"""Trainer callbacks of the GRPO stage that watch the rewards: a guard that stops training when a reward function
cannot judge too many completions, and a sampler that hands a table of completions with their rewards to MLflow.
Must not import: Prefect, MLflow (the sink the stage hands in writes to MLflow).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from transformers import TrainerCallback

from reward_fns.registry import IsolatedReward
from tasks.errors import GateStop, InfrastructureError


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


class SamplerMismatch(InfrastructureError, RuntimeError):
    """vLLM's sampling log-probs disagree with the trainer's own beyond the configured bound."""


class SamplerAgreementGuard(TrainerCallback):
    """On the first ``steps`` logged steps, fails GRPO when vLLM's sampling log-probs and the trainer's differ by
    more than ``bound`` on average (TRL's ``sampling/sampling_logp_difference/mean``): a sync that did not reach
    vLLM, a dtype or kernel mismatch. Each checked step's numbers go to the log."""

    KEY = "sampling/sampling_logp_difference"

    def __init__(self, bound: float, steps: int = 3) -> None:
        self.bound, self.steps, self.seen = bound, steps, 0

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        import logging

        logs = logs or {}
        mean = logs.get(f"{self.KEY}/mean")
        if mean is None or self.seen >= self.steps:
            return
        self.seen += 1
        numbers = (
            f"mean {mean:.4f}, max {logs.get(f'{self.KEY}/max', float('nan')):.4f}; importance-sampling "
            f"ratio mean {logs.get('sampling/importance_sampling_ratio/mean', float('nan')):.3f}"
        )
        logging.getLogger(__name__).info("step %d: vLLM vs trainer log-probs: %s", state.global_step, numbers)
        if not mean <= self.bound:  # NaN fails too
            raise SamplerMismatch(
                f"vLLM's sampling log-probs differ from the trainer's at step {state.global_step}: {numbers} "
                f"(> grpo.generation.vllm_max_logp_difference {self.bound}); the samples do not come from the "
                "policy being trained: check the adapter sync and the precision, or raise the bound"
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
