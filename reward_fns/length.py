"""Length rewards: shape how long completions are.
Must not import: Prefect, MLflow, torch, ``tasks``."""

from __future__ import annotations

from typing import Any

from reward_fns.text import Completion, completion_text


def length_closeness(completions: list[Completion], target_chars: int = 20, **kwargs: Any) -> list[float | None]:
    """The tutorial's ``reward_len``: minus the distance from ``target_chars`` characters (0 is best).

    >>> length_closeness(completions=["a" * 20, "a" * 25, "a" * 10])
    [0.0, -5.0, -10.0]
    """
    return [float(-abs(target_chars - len(completion_text(c)))) for c in completions]


def repetition_penalty(completions: list[Completion], ngram: int = 3, **kwargs: Any) -> list[float | None]:
    """Minus the share of repeated word n-grams (0 for no repetition, towards -1 for a loop).

    >>> repetition_penalty(completions=["one two three four", "a b c a b c a b c"])
    [0.0, -0.5714285714285714]
    """
    rewards: list[float | None] = []
    for completion in completions:
        words = completion_text(completion).split()
        grams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
        rewards.append(len(set(grams)) / len(grams) - 1.0 if grams else 0.0)
    return rewards
