"""Format rewards: does the completion use the answer format the task expects?
Must not import: Prefect, MLflow, torch, ``tasks``."""

from __future__ import annotations

import re
from typing import Any

from reward_fns.text import MAX_ANSWER_CHARS, Completion, completion_text, last_boxed

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# A block's content holds none of the four tags: a lazy ``.*?`` would stretch over a second block or a nested one.
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"
_THINK_ANSWER = re.compile(rf"^\s*<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>\s*$", re.DOTALL)


def boxed_format(completions: list[Completion], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion holds exactly one non-empty ``\\boxed{}`` of at most ``MAX_ANSWER_CHARS``
    characters, else 0.0.

    >>> boxed_format(completions=[r"\\boxed{3}", "3", r"\\boxed{1} \\boxed{2}", r"\\boxed{}"])
    [1.0, 0.0, 0.0, 0.0]
    """
    rewards: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        answer = last_boxed(text)
        rewards.append(float(text.count("\\boxed{") == 1 and bool(answer) and len(answer) <= MAX_ANSWER_CHARS))
    return rewards


def think_answer_format(completions: list[Completion], **kwargs: Any) -> list[float | None]:
    """1.0 for exactly one ``<think>…</think>`` block followed by exactly one ``<answer>…</answer>`` block, with
    only white space before, between and after them, and none of the four tags inside either block; else 0.0.

    >>> think_answer_format(completions=["<think>a</think><answer>b</answer>", "<answer>b</answer>"])
    [1.0, 0.0]
    >>> think_answer_format(completions=[
    ...     "\\n<think>\\na\\n</think>\\n<answer>\\nb\\n</answer>\\n",  # white space around and between: fine
    ...     "<think>a<think>b</think></think><answer>c</answer>",  # nested
    ...     "<think>a</think> so <think>b</think><answer>c</answer>",  # two think blocks, text between
    ...     "<think>a</think><answer>b</answer><answer>c</answer>",  # two answers
    ... ])
    [1.0, 0.0, 0.0, 0.0]
    """
    return [float(bool(_THINK_ANSWER.match(completion_text(c)))) for c in completions]


def tag_count(completions: list[Completion], **kwargs: Any) -> list[float | None]:
    """Partial credit, 0.25 per tag of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` present exactly once.

    >>> tag_count(completions=["<think>x</think>", "<think>x</think><answer>y</answer>", "<think><think>"])
    [0.5, 1.0, 0.0]
    """
    return [0.25 * sum(1 for tag in _TAGS if completion_text(c).count(tag) == 1) for c in completions]
