"""Guards on GRPO's learning signal while it trains: which sampled groups carry signal, the pool of prompts
retired as solved (the online difficulty filter's state), and the early stop on dead signal, entropy collapse or a
reward plateau. Plain logic: the trainer hook that uses it lives in ``tasks/speedups/dynamic_sampling.py``.

Must not import: Prefect, MLflow, the stages.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

SIGNAL_STATE_FILE = "grpoflow_signal.json"  # beside each GRPO checkpoint: the pool and the stop's counters


def _groups(values: Sequence[float | None], group_size: int) -> list[list[float]]:
    if len(values) % group_size:
        raise ValueError(f"{len(values)} rewards do not split into groups of {group_size}")
    return [
        [v for v in values[start : start + group_size] if v is not None and not math.isnan(v)]
        for start in range(0, len(values), group_size)
    ]


def informative_groups(rewards: Sequence[float | None], group_size: int, tolerance: float = 1e-6) -> list[bool]:
    """For each group of ``group_size`` consecutive rewards: do they differ (so the group has an advantage to
    learn from)? Unjudged rewards (None, NaN) are left out; a group with fewer than two judged ones carries none.

    >>> informative_groups([1, 0, 1, 1, 0.5, 0.5, None, 1, 0.2, 0.7], 2)
    [True, False, False, False, True]
    """
    flags = []
    for group in _groups(rewards, group_size):
        flags.append(len(group) > 1 and max(group) - min(group) > tolerance)
    return flags


def solved_groups(correct: Sequence[float | None], group_size: int) -> list[bool]:
    """For each group: was every sample judged correct (1.0)?

    >>> solved_groups([1, 1, 1, 0, None, 1], 2)
    [True, False, False]
    """
    return [
        len(group) == group_size and all(v >= 1.0 - 1e-9 for v in group)
        for group in _groups([None if v is None else float(v) for v in correct], group_size)
    ]


def choose_groups(informative: Sequence[bool], slots: int) -> list[int]:
    """Which of the sampled groups fill the batch's ``slots``: informative ones first, in the order they were
    sampled, then (when too few were found) uninformative ones, which add no advantage but keep the batch whole.

    >>> choose_groups([False, True, False, True, True], 2)
    [1, 3]
    >>> choose_groups([False, True, False], 2)
    [1, 0]
    """
    ordered = [i for i, flag in enumerate(informative) if flag] + [i for i, flag in enumerate(informative) if not flag]
    return ordered[:slots]


def draws_needed(missing: int, informative_rate: float, budget: int) -> int:
    """How many extra prompts to sample to fill ``missing`` slots when about ``informative_rate`` of groups carry
    signal, within the oversampling ``budget``.

    >>> draws_needed(4, 0.5, 100), draws_needed(4, 0.0, 6), draws_needed(0, 0.5, 10)
    (8, 6, 0)
    """
    if missing <= 0 or budget <= 0:
        return 0
    rate = max(informative_rate, 0.1)
    return min(budget, math.ceil(missing / rate))


@dataclass
class RetirementPool:
    """Prompts solved in every group on ``retire_after`` visits in a row leave the training pool (0: never).

    >>> pool = RetirementPool(retire_after=2)
    >>> pool.record(["a", "b"], [True, False]), pool.record(["a", "b"], [True, True]), sorted(pool.retired)
    ([], ['a'], ['a'])
    """

    retire_after: int = 3
    streak: dict[str, int] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)

    def record(self, keys: Sequence[str], solved: Sequence[bool]) -> list[str]:
        """Count one visit per prompt; returns the prompts retired by it."""
        newly = []
        for key, done in zip(keys, solved, strict=True):
            self.streak[key] = self.streak.get(key, 0) + 1 if done else 0
            if self.retire_after and self.streak[key] >= self.retire_after and key not in self.retired:
                self.retired.add(key)
                newly.append(key)
        return newly

    def state(self) -> dict[str, Any]:
        return {"retire_after": self.retire_after, "streak": self.streak, "retired": sorted(self.retired)}

    @classmethod
    def from_state(cls, state: dict[str, Any], retire_after: int) -> RetirementPool:
        return cls(retire_after, dict(state.get("streak", {})), set(state.get("retired", [])))


@dataclass
class StopVerdict:
    """Why GRPO stopped early, with the numbers that decided it."""

    cause: str  # dead_signal | entropy_collapse | reward_plateau
    step: int
    message: str
    numbers: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class SignalStop(TrainerCallback):
    """Stops GRPO when its learning signal is gone, judged on each logged step (TRL's logged metrics):

    - dead signal: ``frac_reward_zero_std`` above ``dead_signal_share`` for ``dead_signal_steps`` steps in a row;
    - entropy collapse: ``entropy`` below ``entropy_floor`` for ``entropy_steps`` steps in a row;
    - reward plateau: the mean ``reward`` over the last ``plateau_window`` steps has not beaten its best by
      ``plateau_min_delta`` for ``plateau_steps`` steps.

    A setting of 0 steps turns its check off. The verdict is kept in ``self.verdict``; training stops after the
    step (the adapter trained so far is saved and evaluated as usual). History replayed on resume
    (``control`` None) rebuilds the counters without stopping anything.
    """

    replays_history = True  # tasks.training.trainer.replay_history hands it the metrics logged before a resume

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.dead_streak = 0
        self.entropy_streak = 0
        self.rewards: list[float] = []
        self.best_mean: float | None = None
        self.since_best = 0
        self.verdict: StopVerdict | None = None

    def _check(self, step: int, logs: dict[str, Any]) -> StopVerdict | None:
        s = self.settings
        zero_std, entropy, reward = logs.get("frac_reward_zero_std"), logs.get("entropy"), logs.get("reward")
        if zero_std is not None and s.dead_signal_steps:
            self.dead_streak = self.dead_streak + 1 if zero_std > s.dead_signal_share else 0
            if self.dead_streak >= s.dead_signal_steps:
                return StopVerdict(
                    "dead_signal",
                    step,
                    f"no learning signal: frac_reward_zero_std {zero_std:.2f} > {s.dead_signal_share:.2f} for "
                    f"{self.dead_streak} steps in a row (grpo.stop.dead_signal_steps {s.dead_signal_steps}); the "
                    "rewards agree within every group, so GRPO has nothing to learn from",
                    {"frac_reward_zero_std": float(zero_std), "steps": float(self.dead_streak)},
                )
        if entropy is not None and s.entropy_steps:
            self.entropy_streak = self.entropy_streak + 1 if entropy < s.entropy_floor else 0
            if self.entropy_streak >= s.entropy_steps:
                return StopVerdict(
                    "entropy_collapse",
                    step,
                    f"entropy collapsed: {entropy:.4f} < grpo.stop.entropy_floor {s.entropy_floor:g} for "
                    f"{self.entropy_streak} steps in a row; the policy samples the same tokens every time",
                    {"entropy": float(entropy), "steps": float(self.entropy_streak)},
                )
        if reward is not None and s.plateau_steps:
            self.rewards.append(float(reward))
            window = self.rewards[-s.plateau_window :]
            if len(window) == s.plateau_window:
                mean = sum(window) / len(window)
                if self.best_mean is None or mean > self.best_mean + s.plateau_min_delta:
                    self.best_mean, self.since_best = mean, 0
                else:
                    self.since_best += 1
                if self.since_best >= s.plateau_steps:
                    return StopVerdict(
                        "reward_plateau",
                        step,
                        f"reward plateau: the {s.plateau_window}-step mean reward {mean:.3f} has not beaten its best "
                        f"{self.best_mean:.3f} by {s.plateau_min_delta:g} for {self.since_best} steps "
                        f"(grpo.stop.plateau_steps {s.plateau_steps})",
                        {"reward_mean": mean, "best_reward_mean": self.best_mean, "steps": float(self.since_best)},
                    )
        return None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.verdict is not None or not logs:
            return
        verdict = self._check(int(state.global_step), logs)
        if verdict is None or control is None:  # replayed history rebuilds counters only
            return
        self.verdict = verdict
        logger.warning("GRPO stops early at step %d: %s", verdict.step, verdict.message)
        control.should_training_stop = True


class SignalStateSaver(TrainerCallback):
    """Writes the retired pool beside every checkpoint the trainer saves (rank 0's folder)."""

    def __init__(self, pool: RetirementPool) -> None:
        self.pool = pool

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            save_signal_state(checkpoint, self.pool)


def save_signal_state(checkpoint: Path, pool: RetirementPool | None) -> None:
    """Write the retired pool beside a checkpoint, so a resume continues it."""
    state = {"pool": pool.state() if pool else None}
    (checkpoint / SIGNAL_STATE_FILE).write_text(json.dumps(state, indent=1))


def load_signal_state(checkpoint: Path | None, retire_after: int) -> RetirementPool:
    """The retired pool saved beside ``checkpoint`` (an empty one when there is none)."""
    path = checkpoint / SIGNAL_STATE_FILE if checkpoint else None
    if path is None or not path.is_file():
        return RetirementPool(retire_after)
    state = json.loads(path.read_text()).get("pool") or {}
    return RetirementPool.from_state(state, retire_after)
