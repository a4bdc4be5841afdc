"""GSM8K's own answer extraction, as published results score it (lm-evaluation-harness's gsm8k task): ``strict``
reads the number after ``####``, ``flexible`` the last number in the text; both compare it with the ground truth as
strings after dropping commas, dollar signs and a final period. Named evaluation metrics beside grpoflow's rewards
(``evaluation.extractions``), so a figure can be read against published ones. Must not import: torch, the stages.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORED = (re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def normalized(text: str) -> str:
    """The harness's ``regexes_to_ignore``, then case and surrounding space.

    >>> normalized("$1,234."), normalized("so #### 72")
    ('1234', '72')
    """
    for pattern in _IGNORED:
        text = pattern.sub("", text)
    return text.strip().lower()


def strict_answer(completion: str) -> str | None:
    """The number after the first ``#### `` (GSM8K's answer line); None without one.

    >>> strict_answer("6 * 12 = 72\\n#### 72"), strict_answer("the answer is \\\\boxed{72}")
    ('72', None)
    """
    found = _STRICT.search(completion)
    return found.group(1) if found else None


def flexible_answer(completion: str) -> str | None:
    """The last number in the text (with its sign, commas and dollar sign, as the harness takes it); None without.

    >>> flexible_answer("3 boxes of $1,200 make \\\\boxed{3600}."), flexible_answer("no digits")
    ('3600', None)
    """
    found = [a or b for a, b in _FLEXIBLE.findall(completion)]
    return found[-1] if found else None


EXTRACTIONS: dict[str, Callable[[str], str | None]] = {"gsm8k_strict": strict_answer, "gsm8k_flexible": flexible_answer}


def extracted_correct(name: str, completion: str, ground_truth: str) -> bool:
    """Whether ``completion``'s answer by extraction ``name`` equals ``ground_truth`` (both normalized).

    >>> extracted_correct("gsm8k_strict", "#### 1,000", "1000")
    True
    >>> extracted_correct("gsm8k_flexible", "\\\\boxed{7}", "72")
    False
    """
    answer = EXTRACTIONS[name](completion)
    return answer is not None and normalized(answer) == normalized(str(ground_truth))


def extraction_scores(
    names: Sequence[str], greedy: Sequence[Sequence[str]], sampled: Sequence[Sequence[str]], truths: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Per extraction: greedy accuracy and sampled pass@1 (the mean over prompts of each prompt's share).

    >>> greedy, sampled = [["#### 2"], ["#### 5"]], [["#### 2", "2"], ["#### 4", "#### 4"]]
    >>> extraction_scores(["gsm8k_strict"], greedy, sampled, ["2", "4"])
    {'gsm8k_strict': {'greedy': 0.5, 'pass_at_1': 0.75}}
    """
    scores = {}
    for name in names:
        greedy_hits = [extracted_correct(name, group[0], truth) for group, truth in zip(greedy, truths, strict=True)]
        shares = [
            sum(extracted_correct(name, text, truth) for text in group) / max(len(group), 1)
            for group, truth in zip(sampled, truths, strict=True)
        ]
        scores[name] = {
            "greedy": sum(greedy_hits) / max(len(greedy_hits), 1),
            "pass_at_1": sum(shares) / max(len(shares), 1),
        }
    return scores
