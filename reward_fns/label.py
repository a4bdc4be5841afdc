"""Exact-answer and label rewards.
Must not import: Prefect, MLflow, torch, ``tasks``."""

from __future__ import annotations

import unicodedata
from typing import Any

from reward_fns.text import Completion, completion_text, last_boxed


def normalize_exact(text: str) -> str:
    """Unicode NFKC with whitespace runs collapsed and ends stripped.

    >>> normalize_exact("  Ｐａｒｉｓ\\n city ")
    'Paris city'
    """
    return " ".join(unicodedata.normalize("NFKC", text).split())


def _answer(text: str) -> str:
    boxed = last_boxed(text)
    return boxed if boxed is not None else text


def exact_match(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answer (final ``\\boxed{}`` if any, else the whole text) equals the ground truth after NFKC.

    >>> exact_match(completions=["Paris", r"It is \\boxed{Paris}", "paris"], ground_truth=["Paris"] * 3)
    [1.0, 1.0, 0.0]
    """
    return [
        float(normalize_exact(_answer(completion_text(c))) == normalize_exact(str(g)))
        for c, g in zip(completions, ground_truth, strict=True)
    ]


def label_match(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answered label equals the ground-truth label, case and whitespace folded.

    >>> label_match(completions=["POSITIVE", r"\\boxed{ negative }", "neutral"], ground_truth=["positive"] * 3)
    [1.0, 0.0, 0.0]
    """
    return [
        float(normalize_exact(_answer(completion_text(c))).casefold() == normalize_exact(str(g)).casefold())
        for c, g in zip(completions, ground_truth, strict=True)
    ]
