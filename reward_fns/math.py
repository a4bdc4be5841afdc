"""Math rewards on top of math-verify, with a fast path for plain numbers.

The final ``\\boxed{}`` is the answer. Gold answers are parsed once per distinct value (cached). When both the
gold and the boxed answer are plain decimal numbers they are compared exactly, which is what math-verify
concludes for them too, without its parse (``bench/bench_math_reward.py`` measures the difference).
Must not import: Prefect, MLflow, torch, ``tasks``.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any

from math_verify import LatexExtractionConfig, parse, verify

from reward_fns.text import Completion, completion_text, last_boxed

_PLAIN_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_TIMEOUT_SECONDS = 5


def plain_number(text: str) -> Decimal | None:
    """``text`` as a Decimal when it is a plain number (thousands commas and spaces allowed), else None.

    >>> plain_number("1,234"), plain_number(" -7.50 "), plain_number("\\\\frac{1}{2}")
    (Decimal('1234'), Decimal('-7.50'), None)
    """
    candidate = text.strip().replace(",", "").replace(" ", "")
    if not _PLAIN_NUMBER.match(candidate):
        return None
    try:
        return Decimal(candidate)
    except InvalidOperation:
        return None


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    return _TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def parse_gold(gold: str) -> tuple[Any, ...]:
    """math-verify's parse of a gold answer, cached: one parse per distinct gold. Empty when unparseable
    (math-verify then returns only the raw string, with no expression beside it).

    >>> bool(parse_gold("\\frac{1}{2}")), bool(parse_gold("\\frac{"))
    (True, False)
    """
    try:
        parsed = tuple(parse(f"${gold}$", parsing_timeout=_timeout()))
    except Exception:
        return ()
    return parsed if any(not isinstance(item, str) for item in parsed) else ()


def _parse_boxed(answer: str) -> list[Any]:
    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    try:
        return parse(f"\\boxed{{{answer}}}", extraction_config=config, parsing_timeout=_timeout())
    except Exception:
        return []


def math_verdict(completion: str, gold: str) -> float | None:
    """1.0 if the final boxed answer equals ``gold``, 0.0 if not (or no box), None if ``gold`` is unparseable.

    >>> math_verdict(r"so \\boxed{42}", "42"), math_verdict(r"\\boxed{41}", "42"), math_verdict("42", "42")
    (1.0, 0.0, 0.0)
    >>> math_verdict(r"\\boxed{\\frac{2}{4}}", "0.5")
    1.0
    """
    answer = last_boxed(completion)
    if answer is None:
        return None if plain_number(gold) is None and not parse_gold(gold) else 0.0
    return boxed_verdict(answer, gold)


@lru_cache(maxsize=65536)
def boxed_verdict(answer: str, gold: str) -> float | None:
    """The verdict for one boxed answer against one gold, cached: GRPO groups and datasets repeat them."""
    gold_number = plain_number(gold)
    if gold_number is None and not parse_gold(gold):
        return None
    answer_number = plain_number(answer)
    if gold_number is not None and answer_number is not None:
        return float(gold_number == answer_number)
    gold_parsed = parse_gold(gold) if gold_number is None else parse_gold(str(gold_number))
    if not gold_parsed:
        return None
    predicted = _parse_boxed(answer)
    if not any(not isinstance(item, str) for item in predicted):
        return 0.0
    try:
        return float(verify(list(gold_parsed), predicted, timeout_seconds=_timeout()))
    except Exception:
        return 0.0


def math_accuracy(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """Math accuracy: does the final ``\\boxed{}`` answer equal the (normalized) ground truth?

    >>> math_accuracy(completions=[r"\\boxed{7}", r"\\boxed{8}", "7"], ground_truth=["7", "7", "7"])
    [1.0, 0.0, 0.0]
    >>> math_accuracy(completions=[[{"role": "assistant", "content": r"\\boxed{1/2}"}]], ground_truth=["0.5"])
    [1.0]
    """
    return [math_verdict(completion_text(c), str(g)) for c, g in zip(completions, ground_truth, strict=True)]


def boxed_match(completions: list[Completion], ground_truth: list[str], **kwargs: Any) -> list[float | None]:
    """Exact string match of the final ``\\boxed{}`` content (whitespace-stripped) with the ground truth.

    >>> boxed_match(completions=[r"\\boxed{ 12 }", r"\\boxed{12.0}"], ground_truth=["12", "12"])
    [1.0, 0.0]
    """
    return [
        float(last_boxed(completion_text(c)) == str(g).strip()) for c, g in zip(completions, ground_truth, strict=True)
    ]
