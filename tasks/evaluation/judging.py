"""What a judge's verdicts are worth, measured on the pipeline's own samples: its biases (length, position,
agreement with a verifiable reward), reported by the probe stage.
Must not import: Prefect, MLflow, a stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from reward_fns.judges import JUDGES
from reward_fns.judges.checks import agreement, length_bias
from reward_fns.registry import build_reward_functions, reward_columns
from tasks.config import PipelineConfig
from tasks.evaluation.cache import verdict_cache


def judge_specs(config: PipelineConfig) -> list[Any]:
    """The configured rewards that are judges (``llm_judge``, ``reward_model``)."""
    return [spec for spec in config.rewards if spec.name in JUDGES]


def judge_bias(
    config: PipelineConfig,
    rows: Sequence[dict[str, Any]],
    completions: Sequence[Sequence[str]],
    scores: dict[str, Any],
    limit: int = 16,
) -> dict[str, dict[str, float]]:
    """Per judge: the length probe on the first completion of up to ``limit`` prompts (the same answer padded
    with words that add nothing: ``length_gain``, ``padded_higher_share``), the share of pairwise verdicts whose
    two orders disagreed (``position_split_share``: a verdict of 0.5), and agreement with the task's verifiable
    reward on every probed completion (``verifiable_correlation``, ``judged_on_correct``,
    ``judged_on_incorrect``; NaN where the data has no checkable answer)."""
    specs = judge_specs(config)
    if not specs:
        return {}
    rewards, _ = build_reward_functions(specs, verdict_cache(specs))
    chosen = list(range(min(limit, len(rows))))
    columns = reward_columns([rows[i] for i in chosen])
    prompts = [rows[i]["prompt"] for i in chosen]
    firsts = [completions[i][0] for i in chosen]
    correct = np.asarray(scores["correct"], dtype=float).ravel().tolist()
    report: dict[str, dict[str, float]] = {}
    for spec, reward in zip(specs, rewards, strict=True):
        judged = np.asarray(scores["per_function"][reward.__name__], dtype=float).ravel()
        values = [None if math.isnan(v) else float(v) for v in judged]
        figures = dict(length_bias(reward, prompts, firsts, **columns))
        if spec.name == "llm_judge" and spec.args.get("mode") == "pairwise":
            known = [v for v in values if v is not None]
            figures["position_split_share"] = sum(v == 0.5 for v in known) / len(known) if known else math.nan
        agree = agreement(values, correct) if "ground_truth" in rows[0] else {}
        figures.update({("verifiable_correlation" if k == "correlation" else k): v for k, v in agree.items()})
        report[reward.__name__] = figures
    return report


def win_rate(
    candidate: Sequence[Sequence[float | None]],
    reference: Sequence[Sequence[float | None]],
    resamples: int = 2000,
    seed: int = 0,
) -> dict[str, float]:
    """The judged win rate of ``candidate`` over ``reference`` on the same prompts: per prompt, the share of
    (candidate sample, reference sample) pairs whose verdict is higher (a tie counts half, a None verdict is left
    out), then its mean over prompts with a 95 % bootstrap interval over prompts (0.5: no better, no worse).

    >>> r = win_rate([[1.0, 1.0], [0.5, 0.5]], [[0.0, 0.0], [0.5, 0.5]]); r["mean"], r["n"]
    (0.75, 2)
    """
    from tasks.evaluation.scoring import bootstrap_interval

    if len(candidate) != len(reference):
        raise ValueError("a judged win rate needs the same prompts on both sides")
    shares = []
    for mine, theirs in zip(candidate, reference, strict=True):
        pairs = [(a, b) for a in mine for b in theirs if a is not None and b is not None]
        if pairs:
            shares.append(sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in pairs) / len(pairs))
    if not shares:
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    low, high = bootstrap_interval(shares, resamples, seed)
    return {"mean": float(np.mean(shares)), "low": low, "high": high, "n": len(shares)}


def verdict_lists(array: Any) -> list[list[float | None]]:
    """A prompts × samples array of verdicts (NaN: none) as lists, None where there was no verdict."""
    return [[None if math.isnan(v) else float(v) for v in row] for row in np.asarray(array, dtype=float)]
