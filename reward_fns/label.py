"""Exact-answer and label rewards.
Must not import: Prefect, MLflow, torch, ``tasks``."""

from __future__ import annotations

import unicodedata
from typing import Any

from reward_fns.text import Completion, boxed_contents, completion_text


def normalize_exact(text: str) -> str:
    """Unicode NFKC with whitespace runs collapsed and ends stripped.

    >>> normalize_exact("  Ｐａｒｉｓ\\n city ")
    'Paris city'
    """
    return " ".join(unicodedata.normalize("NFKC", text).split())


def _answer(text: str) -> str | None:
    """The boxed answer if there is one, else the whole text; None for boxes with different answers (hedging).

    >>> _answer(r"It is \\boxed{Paris}"), _answer("Paris"), _answer(r"\\boxed{Lyon} or \\boxed{Paris}")
    ('Paris', 'Paris', None)
    """
    boxes = {normalize_exact(box) for box in boxed_contents(text)}
    if len(boxes) > 1:
        return None
    return boxes.pop() if boxes else text


def exact_match(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answer (final ``\\boxed{}`` if any, else the whole text) equals the ground truth after NFKC.

    >>> exact_match(completions=["Paris", r"It is \\boxed{Paris}", "paris"], ground_truth=["Paris"] * 3)
    [1.0, 1.0, 0.0]
    """
    answers = [_answer(completion_text(c)) for c in completions]
    return [
        float(a is not None and normalize_exact(a) == normalize_exact(str(g)))
        for a, g in zip(answers, ground_truth, strict=True)
    ]


def label_match(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answered label equals the ground-truth label, case and whitespace folded.

    >>> label_match(completions=["POSITIVE", r"\\boxed{ negative }", "neutral"], ground_truth=["positive"] * 3)
    [1.0, 0.0, 0.0]
    """
    answers = [_answer(completion_text(c)) for c in completions]
    return [
        float(a is not None and normalize_exact(a).casefold() == normalize_exact(str(g)).casefold())
        for a, g in zip(answers, ground_truth, strict=True)
    ]
