"""Does GRPO train the policy that sampled? The per-step tally of |sampler − trainer| log-probability differences
(filled by the trainer: ``tasks.speedups.sampler_agreement``) and the guard that stops the run when a step's mean
passes the bound (``grpo.generation.max_logp_difference``): a copy or adapter sync that stopped landing, a dtype
or kernel mismatch. Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from tasks.errors import InfrastructureError

logger = logging.getLogger(__name__)

METRIC = "sampler/logp_difference"


class SamplerMismatch(InfrastructureError, RuntimeError):
    """The sampler's log-probabilities disagree with the trainer's own beyond the configured bound."""


@dataclass
class StepAgreement:
    """One optimizer step's differences: their sum, count and max."""

    total: float = 0.0
    tokens: int = 0
    largest: float = 0.0

    @property
    def mean(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0


@dataclass
class SamplerAgreement:
    """The tally: each step's differences as the trainer records them, the steps not yet logged, the whole run's
    mean and max (for the stage's summary), and why there are none when the sampler gives no log-probabilities.

    >>> tally = SamplerAgreement()
    >>> tally.add(0.2, 4, 0.1, step=1); tally.add(0.2, 4, 0.3, step=1)
    >>> tally.steps[1].mean, tally.steps[1].largest, tally.window()
    (0.05, 0.3, {'sampler/logp_difference/mean': 0.05, 'sampler/logp_difference/max': 0.3})
    """

    steps: dict[int, StepAgreement] = field(default_factory=dict)
    logged_through: int = 0
    reason_unavailable: str | None = None

    def add(self, total: float, tokens: int, largest: float, step: int) -> None:
        """Differences measured while training ``step`` (1-based: the step whose optimizer update comes next)."""
        entry = self.steps.setdefault(step, StepAgreement())
        entry.total, entry.tokens = entry.total + total, entry.tokens + tokens
        entry.largest = max(entry.largest, largest)

    def unavailable(self, reason: str) -> None:
        if self.reason_unavailable is None:
            logger.info("sampler agreement not measured: %s", reason)
        self.reason_unavailable = reason

    def window(self) -> dict[str, float]:
        """The metrics over the steps since the last call (what one log line covers): token-weighted mean, max."""
        new = [entry for step, entry in self.steps.items() if step > self.logged_through]
        self.logged_through = max(self.steps, default=self.logged_through)
        return _metrics(new)

    def summary(self) -> dict[str, float]:
        """The whole run's: ``{mean, max, steps}`` over every measured step (empty when none was)."""
        if not self.steps:
            return {}
        means = [entry.mean for entry in self.steps.values()]
        return {
            "mean": sum(means) / len(means),
            "max_step_mean": max(means),
            "max": max(entry.largest for entry in self.steps.values()),
            "steps": len(self.steps),
        }


def _metrics(entries: list[StepAgreement]) -> dict[str, float]:
    tokens = sum(entry.tokens for entry in entries)
    if not tokens:
        return {}
    return {
        f"{METRIC}/mean": sum(entry.total for entry in entries) / tokens,
        f"{METRIC}/max": max(entry.largest for entry in entries),
    }


class SamplerAgreementGuard(TrainerCallback):
    """At each optimizer step's end, fails GRPO when that step's mean |log-probability difference| between the
    sampler and the trainer passes ``bound`` (NaN too), naming the step, the numbers and what to look at."""

    def __init__(self, tally: SamplerAgreement, bound: float, engine: str) -> None:
        self.tally, self.bound, self.engine = tally, bound, engine

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        entry = self.tally.steps.get(state.global_step)
        if entry is None or not entry.tokens:
            return
        if not entry.mean <= self.bound:
            raise SamplerMismatch(
                f"step {state.global_step}: the {self.engine} sampler's log-probs differ from the trainer's by "
                f"{entry.mean:.4f} on average (max {entry.largest:.4f}) > grpo.generation.max_logp_difference "
                f"{self.bound}: the samples do not come from the policy being trained; look at the adapter sync "
                "or copy, and the precision (docs/engines.md)"
            )
