"""Helpers shared by reward functions: completion text and boxed-answer extraction.
Must not import: Prefect, MLflow, torch, ``tasks``."""

from __future__ import annotations

from typing import Any

Completion = str | list[dict[str, Any]]
# A boxed answer longer than this is answer-stuffing, not an answer (nor worth a parse that can take seconds).
MAX_ANSWER_CHARS = 1000


def completion_text(completion: Completion) -> str:
    """The text of one completion, plain or chat (a list of messages; the last message's content counts).

    >>> completion_text("The answer is 4")
    'The answer is 4'
    >>> completion_text([{"role": "assistant", "content": "\\\\boxed{4}"}])
    '\\\\boxed{4}'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return ""


def boxed_contents(text: str) -> list[str]:
    """Every ``\\boxed{...}`` content in order, with nested braces balanced; unclosed ones are skipped.

    >>> boxed_contents(r"so \\boxed{\\frac{1}{2}} or \\boxed{3}")
    ['\\\\frac{1}{2}', '3']
    >>> boxed_contents(r"\\boxed{12")
    []
    """
    found: list[str] = []
    start = 0
    marker = "\\boxed{"
    while (index := text.find(marker, start)) != -1:
        depth, cursor = 1, index + len(marker)
        while cursor < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[cursor], 0)
            cursor += 1
        if depth == 0:
            found.append(text[index + len(marker) : cursor - 1])
        start = index + len(marker)
    return found


def last_boxed(text: str) -> str | None:
    """The final ``\\boxed{}`` content, the one that counts as the answer.

    >>> last_boxed(r"first \\boxed{1}, final \\boxed{2}")
    '2'
    >>> last_boxed("no box") is None
    True
    """
    contents = boxed_contents(text)
    return contents[-1].strip() if contents else None
