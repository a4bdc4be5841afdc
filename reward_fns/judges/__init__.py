"""Judged rewards: an LLM judge over an OpenAI-compatible endpoint, a sequence-classification reward model, and
the verdict cache they share. Each is a reward like the others (built by ``reward_fns.registry`` from a config's
``rewards`` entry); the cache is handed in as a plain object by whoever builds the rewards.
Must not import: ``tasks``, ``flows``, Prefect, MLflow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from reward_fns.judges.cache import CacheStats, VerdictCache, verdict_key
from reward_fns.judges.llm import JudgeStats, LLMJudge, parse_choice, parse_score
from reward_fns.judges.reward_model import RewardModel, model_digest
from reward_fns.judges.settings import (
    JUDGE_KEY_VARIABLES,
    LLMJudgeSettings,
    RewardModelSettings,
    redact_credentials,
)

__all__ = [
    "JUDGES",
    "JUDGE_KEY_VARIABLES",
    "CacheStats",
    "JudgeStats",
    "LLMJudge",
    "LLMJudgeSettings",
    "RewardModel",
    "RewardModelSettings",
    "VerdictCache",
    "build_judge",
    "check_judge_args",
    "model_digest",
    "parse_choice",
    "parse_score",
    "redact_credentials",
    "verdict_key",
]

# Built-in reward names that are judges: name → (settings model, the reward it builds).
JUDGES: dict[str, tuple[type, Callable[..., Any]]] = {
    "llm_judge": (LLMJudgeSettings, LLMJudge),
    "reward_model": (RewardModelSettings, RewardModel),
}


def check_judge_args(name: str, args: Mapping[str, Any]) -> Any:
    """The judge's settings from a reward's ``args``; ValueError naming every wrong or missing key.

    >>> check_judge_args("llm_judge", {"url": "http://127.0.0.1:8001/v1", "model": "judge"}).max_score
    10
    >>> check_judge_args("llm_judge", {"url": "http://x/v1", "modle": "judge"})
    Traceback (most recent call last):
    ValueError: llm_judge args: model: Field required; modle: Extra inputs are not permitted
    """
    from pydantic import ValidationError

    settings_type, _ = JUDGES[name]
    try:
        return settings_type.model_validate(dict(args))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'args'}: {error['msg'].removeprefix('Value error, ')}"
            for error in exc.errors()
        )
        raise ValueError(f"{name} args: {problems}") from None


def build_judge(name: str, args: Mapping[str, Any], cache: VerdictCache | None = None) -> Any:
    """The judge reward for a built-in judge name, its settings checked."""
    _, judge_type = JUDGES[name]
    return judge_type(check_judge_args(name, args), cache)
