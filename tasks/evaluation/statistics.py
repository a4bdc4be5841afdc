"""Forgetting statistics, as pass@1's: paired intervals of the general-QA drop (per question) and of the
perplexity change (per document), the mean per-token KL(base ‖ model) with its interval, the minimum detectable
drop of the sets in use, results by category, and the gate that reads them.

Owns: the numbers and the verdict. Must not import: torch, Prefect, MLflow (the watch and promotion read it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tasks.config import PromotionSettings
from tasks.evaluation.scoring import paired_difference

Z_95, Z_80 = 1.959964, 0.841621
ASSUMED_DISAGREEMENT = 0.10  # share of questions two models answer differently, for the detectable drop


def minimum_detectable_drop(n_questions: int, disagreement: float = ASSUMED_DISAGREEMENT) -> float:
    """The smallest QA-accuracy drop a paired test on ``n_questions`` detects at 95 % confidence (two-sided) and
    80 % power, when a share ``disagreement`` of the questions is answered differently by the two models (the
    paired difference's variance is then about ``disagreement / n``; identical models disagree on none).

    >>> round(minimum_detectable_drop(40), 3), round(minimum_detectable_drop(453), 3)
    (0.14, 0.042)
    """
    if n_questions <= 0:
        return math.nan
    return (Z_95 + Z_80) * math.sqrt(disagreement / n_questions)


def _ratio_interval(
    numerator: np.ndarray, denominator: np.ndarray, tokens: np.ndarray, resamples: int, seed: int
) -> tuple[float, float]:
    """95 % bootstrap interval over documents of ``exp((Σ num − Σ den) / Σ tokens) − 1``."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(tokens), size=(resamples, len(tokens)))
    change = (numerator[picks].sum(axis=1) - denominator[picks].sum(axis=1)) / np.maximum(tokens[picks].sum(axis=1), 1)
    low, high = np.percentile(np.expm1(change), [2.5, 97.5])
    return float(low), float(high)


def _mean_interval(values: np.ndarray, tokens: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """95 % bootstrap interval over documents of the token-weighted mean ``Σ values / Σ tokens``."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(tokens), size=(resamples, len(tokens)))
    means = values[picks].sum(axis=1) / np.maximum(tokens[picks].sum(axis=1), 1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def overlapping_questions(ids: list[str], questions: list[str], training_prompts: list[str]) -> set[str]:
    """Ids of general questions that appear in the training prompts (case and spacing folded): trained on,
    they would hide forgetting, so the statistics leave them out.

    >>> sorted(overlapping_questions(["a", "b"], ["What is 2+2?", "Name a colour."], ["Q: what is  2+2? A:"]))
    ['a']
    """

    def fold(text: str) -> str:
        return " ".join(text.lower().split())

    prompts = [fold(prompt) for prompt in training_prompts]
    return {i for i, question in zip(ids, questions, strict=True) if any(fold(question) in p for p in prompts)}


def forgetting_drop(
    base: Any, trained: Any, resamples: int = 2000, seed: int = 0, exclude: set[str] | None = None
) -> dict[str, Any]:
    """What ``trained`` lost against ``base`` (two ``GeneralAbility``): the QA-accuracy drop (points, base −
    trained, paired over questions), the relative perplexity rise (paired over documents), the mean per-token
    KL(base ‖ trained), each with a 95 % interval; the detectable drop; the drop by category.

    >>> from tasks.evaluation.forgetting import GeneralAbility
    >>> a = GeneralAbility(10.0, 0.5, 4, 20, [1, 1, 0, 0], None, ["x"] * 4, [20.0, 26.0], [10, 10])
    >>> b = GeneralAbility(10.0, 0.5, 4, 20, [1, 1, 0, 0], None, ["x"] * 4, [20.0, 26.0], [10, 10], [0.0, 0.0])
    >>> d = forgetting_drop(a, b); d["qa_accuracy_drop"], d["qa_drop_interval"], d["perplexity_interval"], d["kl"]
    (0.0, [0.0, 0.0], [0.0, 0.0], 0.0)
    """
    result: dict[str, Any] = {
        "qa_accuracy_drop": base.qa_accuracy - trained.qa_accuracy,
        "perplexity_increase": trained.perplexity / base.perplexity - 1.0,
        "n_questions": trained.qa_questions,
    }
    if base.qa_correct and trained.qa_correct and len(base.qa_correct) == len(trained.qa_correct):
        keep = [i for i, item in enumerate(trained.qa_ids or []) if item not in (exclude or set())]
        keep = keep if trained.qa_ids else list(range(len(trained.qa_correct)))
        before_all, after_all = np.asarray(base.qa_correct), np.asarray(trained.qa_correct)
        before, after = before_all[keep], after_all[keep]
        result["qa_accuracy_drop"] = float(before.mean() - after.mean()) if keep else math.nan
        result["n_questions"] = len(keep)
        result["qa_excluded_overlapping_training"] = len(trained.qa_correct) - len(keep)
        drop = paired_difference(before.tolist(), after.tolist(), resamples, seed)
        result["qa_drop_interval"] = [drop["low"], drop["high"]]
        result["qa_disagreement"] = float((before != after).mean())
        categories: dict[str, list[float]] = {}
        labels = np.asarray(trained.qa_categories or ["general"] * len(trained.qa_correct))[keep]
        for category, one_before, one_after in zip(labels, before, after, strict=True):
            categories.setdefault(str(category), []).append(float(one_before - one_after))
        result["qa_drop_by_category"] = {name: float(np.mean(v)) for name, v in sorted(categories.items())}
    result["qa_minimum_detectable_drop"] = minimum_detectable_drop(result["n_questions"])
    if base.doc_nll and trained.doc_nll and len(base.doc_nll) == len(trained.doc_nll):
        tokens = np.asarray(trained.doc_tokens, dtype=float)
        after, before = np.asarray(trained.doc_nll), np.asarray(base.doc_nll)
        result["perplexity_interval"] = list(_ratio_interval(after, before, tokens, resamples, seed))
        result["n_documents"] = len(tokens)
        if trained.doc_kl:
            kl = np.asarray(trained.doc_kl)
            result["kl"] = float(kl.sum() / max(tokens.sum(), 1))
            result["kl_interval"] = list(_mean_interval(kl, tokens, resamples, seed))
    return result


def _bound(drop: dict[str, Any], point: str, interval: str, test: str) -> float:
    if interval not in drop or test == "point":
        return drop[point]
    return drop[interval][0 if test == "lower" else 1]


def forgetting_problem(drop: dict[str, Any] | None, settings: PromotionSettings, against: str) -> str | None:
    """Why ``drop`` (``forgetting``'s result against ``against``) breaks the tolerances, or None. By default
    (``promotion.forgetting_test: lower``) a drop counts only when the lower end of its 95 % interval exceeds
    the tolerance — a drop shown beyond it; ``upper`` rejects unless the drop is shown within it; ``point`` reads
    the point estimate.

    >>> drop = {"qa_accuracy_drop": .08, "qa_drop_interval": [.06, .10], "perplexity_increase": 0.0}
    >>> forgetting_problem(drop, PromotionSettings(), "base")
    'forgetting against base: general QA accuracy fell 8.0 points (95% CI [6.0, 10.0]) — beyond the tolerance of 5.0'
    >>> forgetting_problem({**drop, "qa_drop_interval": [.03, .13]}, PromotionSettings(), "base") is None
    True
    """
    if not drop:
        return None
    test = settings.forgetting_test
    checks = (
        ("qa_accuracy_drop", "qa_drop_interval", settings.max_qa_accuracy_drop, "general QA accuracy fell", " points"),
        (
            "perplexity_increase",
            "perplexity_interval",
            settings.max_perplexity_increase,
            "general-text perplexity rose",
            " %",
        ),
    )
    scale = 100
    for point, interval, tolerance, what, unit in checks:
        if _bound(drop, point, interval, test) > tolerance:
            shown = ""
            if interval in drop:
                low, high = drop[interval]
                shown = f" (95% CI [{scale * low:.1f}, {scale * high:.1f}])"
            return (
                f"forgetting against {against}: {what} {scale * drop[point]:.1f}{unit}{shown} — beyond the "
                f"tolerance of {scale * tolerance:.1f}"
            )
    return None


def describe(drop: dict[str, Any]) -> str:
    """One line for summaries and cards.

    >>> describe({"qa_accuracy_drop": .01, "qa_drop_interval": [-.02, .04], "perplexity_increase": .009,
    ...           "perplexity_interval": [.004, .014], "kl": .0123, "kl_interval": [.011, .014],
    ...           "qa_minimum_detectable_drop": .042, "n_questions": 453})
    'general QA -1.0 points [-4.0, +2.0] (453 questions; detectable drop 4.2 points), perplexity +0.9% [+0.4, +1.4], \
KL 0.0123 [0.0110, 0.0140]'
    """
    parts = []
    qa = f"general QA {-100 * drop['qa_accuracy_drop']:+.1f} points"
    if "qa_drop_interval" in drop:
        low, high = drop["qa_drop_interval"]
        qa += f" [{-100 * high:+.1f}, {-100 * low:+.1f}]"
    mdd = drop.get("qa_minimum_detectable_drop")
    qa += f" ({drop.get('n_questions', '?')} questions; detectable drop {100 * mdd:.1f} points)" if mdd else ""
    parts.append(qa)
    ppl = f"perplexity {100 * drop['perplexity_increase']:+.1f}%"
    if "perplexity_interval" in drop:
        low, high = drop["perplexity_interval"]
        ppl += f" [{100 * low:+.1f}, {100 * high:+.1f}]"
    parts.append(ppl)
    if "kl" in drop:
        low, high = drop["kl_interval"]
        parts.append(f"KL {drop['kl']:.4f} [{low:.4f}, {high:.4f}]")
    return ", ".join(parts)


def forgetting_metrics(prefix: str, drop: dict[str, Any]) -> dict[str, float]:
    """A forgetting result as flat MLflow metrics: points, interval ends, the detectable drop, by category.

    >>> forgetting_metrics("forgetting", {"qa_accuracy_drop": 0.01, "qa_drop_interval": [-0.02, 0.04]})
    {'forgetting_qa_accuracy_drop': 0.01, 'forgetting_qa_drop_low': -0.02, 'forgetting_qa_drop_high': 0.04}
    """
    metrics: dict[str, float] = {}
    for key, value in drop.items():
        if isinstance(value, int | float):
            metrics[f"{prefix}_{key}"] = float(value)
        elif isinstance(value, list) and len(value) == 2:
            name = key.removesuffix("_interval")
            metrics[f"{prefix}_{name}_low"], metrics[f"{prefix}_{name}_high"] = map(float, value)
        elif isinstance(value, dict):
            metrics.update({f"{prefix}_{key}_{k}": float(v) for k, v in value.items()})
    return metrics
