"""Scoring completions with the configured rewards, and the statistics probe, evaluation and promotion share:
the unbiased pass@k estimator and bootstrap intervals (plain and paired).
Must not import: Prefect, MLflow, torch, the stages."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from reward_fns.registry import CORRECTNESS_REWARD, build_reward_functions, resolve_reward, reward_columns
from tasks.config import PipelineConfig
from tasks.evaluation.cache import verdict_cache


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) in its numerically stable product form.

    >>> pass_at_k(10, 0, 1), pass_at_k(10, 10, 5), round(pass_at_k(10, 3, 2), 4), pass_at_k(4, 3, 2)
    (0.0, 1.0, 0.5333, 1.0)
    """
    if k > n:
        raise ValueError(f"k={k} exceeds n={n} samples")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def bootstrap_interval(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the mean, resampling items (prompts).

    >>> bootstrap_interval([1.0] * 10)
    (1.0, 1.0)
    """
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return (float(low), float(high))


def paired_difference(
    candidate: Sequence[float], reference: Sequence[float], resamples: int = 2000, seed: int = 0
) -> dict[str, float]:
    """Mean of per-prompt ``candidate - reference`` with a paired bootstrap 95 % interval over prompts.

    >>> d = paired_difference([1, 1, 0, 1], [0, 1, 0, 0]); d["mean"], d["n"]
    (0.5, 4)
    """
    if len(candidate) != len(reference):
        raise ValueError("a paired comparison needs the same prompts on both sides")
    differences = np.asarray(candidate, dtype=float) - np.asarray(reference, dtype=float)
    low, high = bootstrap_interval(differences, resamples, seed)
    return {"mean": float(differences.mean()), "low": low, "high": high, "n": int(differences.size)}


def correctness_function(config: PipelineConfig) -> Any:
    """The reward that decides "correct" (pass@k, accuracy, promotion) for the task kind."""
    return resolve_reward(CORRECTNESS_REWARD[config.data.kind])


def in_chunks(function: Any, completions: list[Any], columns: dict[str, list[Any]], size: int) -> list[Any]:
    """Call a reward on ``size`` completions at a time, the batch a GRPO step gives it: its time budget
    (``rewards[].timeout_s``) is set for that, and a few slow items must not turn a whole evaluation into None.

    >>> in_chunks(lambda completions, n: [len(completions)] * len(completions), ["a"] * 5, {"n": [0] * 5}, 2)
    [2, 2, 2, 2, 1]
    """
    values: list[Any] = []
    for start in range(0, len(completions), max(1, size)):
        window = slice(start, start + max(1, size))
        values += function(completions=completions[window], **{k: v[window] for k, v in columns.items()})
    return values


def score_groups(
    config: PipelineConfig, rows: Sequence[dict[str, Any]], completions: Sequence[Sequence[str]]
) -> dict[str, Any]:
    """Per-function rewards, the weighted total (None counts as 0, as TRL's ``nansum`` does) and correctness,
    each as a ``prompts × samples`` array."""
    group_size = len(completions[0]) if completions else 0
    flat = [text for group in completions for text in group]
    columns = reward_columns(rows, group_size)
    columns["prompts"] = [row.get("prompt", "") for row in rows for _ in range(group_size)]  # as TRL hands them
    functions, weights = build_reward_functions(config.rewards, verdict_cache(config.rewards))
    per_function: dict[str, np.ndarray] = {}
    total = np.zeros(len(flat))
    none_counts: dict[str, int] = {}
    for function, weight in zip(functions, weights, strict=True):
        values = in_chunks(function, flat, columns, config.grpo.batch_size)
        none_counts[function.__name__] = sum(v is None for v in values)
        array = np.array([np.nan if v is None else v for v in values], dtype=float)
        per_function[function.__name__] = array.reshape(len(rows), group_size)
        total += weight * np.nan_to_num(array, nan=0.0)
    correct = correctness_function(config)(completions=flat, **columns)
    correct_array = np.array([0.0 if v is None else v for v in correct], dtype=float)
    return {
        "per_function": per_function,
        "total": total.reshape(len(rows), group_size),
        "correct": correct_array.reshape(len(rows), group_size),
        "none_counts": none_counts,
    }


def tool_use_figures(completions: list[list[Any]]) -> dict[str, float]:
    """How the sampled rollouts used their tools: calls per rollout, the share of rollouts with a call, the share of
    calls that failed, and answers dropped (over the completion budget).

    >>> class Rollout(list):  # a conversation with its calls' records (tasks.models.Conversation)
    ...     calls = [{"failed": True}]
    >>> tool_use_figures([[Rollout(), "no tools"]])["calls_per_rollout"]
    0.5
    """
    rollouts = [c for group in completions for c in group]
    calls = [getattr(c, "calls", []) for c in rollouts]
    made = [call for each in calls for call in each]
    answered = [sum(1 for m in c if isinstance(m, dict) and m.get("role") == "tool") for c in rollouts]
    return {
        "calls_per_rollout": len(made) / max(len(rollouts), 1),
        "rollouts_with_calls": sum(bool(each) for each in calls) / max(len(rollouts), 1),
        "error_share": sum(bool(call.get("failed")) for call in made) / len(made) if made else 0.0,
        "turns_dropped": float(sum(max(len(each) - seen, 0) for each, seen in zip(calls, answered, strict=True))),
    }
