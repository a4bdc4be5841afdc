"""The math reward's fast path for plain numbers concludes only what math-verify concludes.

Generated numbers in many spellings (signs, thousands separators, decimals and trailing zeros, fractions,
percents, ``\\$``, units, LaTeX spacing, and digit runs that are lists or decimal commas rather than numbers) are
scored by grpoflow and by math-verify used as TRL's ``accuracy_reward`` uses it. They must agree, except where
README documents grpoflow's own rule: thousands grouped by spaces or thin spaces (math-verify adds the groups:
``1 234`` → 235), which grpoflow reads as one number.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from math_verify import LatexExtractionConfig, parse, verify

from reward_fns.math import boxed_verdict, math_accuracy, parse_gold, plain_number
from tasks.inputs.rows import RowProblem, normalize_math

BOXED = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
SPACE_GROUPS = (" ", "\\,", "\\ ", "~")  # grpoflow's documented rule: these group thousands


def reference(answer: str, gold: str) -> float:
    """math-verify's verdict: the gold parsed whole, the answer as a ``\\boxed{}`` completion."""
    return float(verify(parse(f"${gold}$"), parse(f"\\boxed{{{answer}}}", extraction_config=BOXED)))


def grouped(digits: str, separator: str) -> str:
    """``1234567`` → ``1,234,567`` with ``separator`` between groups of three."""
    head = len(digits) % 3 or 3
    return separator.join([digits[:head], *(digits[i : i + 3] for i in range(head, len(digits), 3))])


@st.composite
def spelled(draw: st.DrawFn, value: Decimal) -> tuple[str, bool]:
    """One spelling of ``value`` and whether grpoflow's documented rule (space-grouped thousands) applies."""
    sign = "-" if value < 0 else draw(st.sampled_from(["", ""]))
    magnitude = abs(value)
    whole, _, fraction = format(magnitude, "f").partition(".")
    fraction = fraction + "0" * draw(st.integers(0, 2)) if fraction else ("" if draw(st.booleans()) else "")
    tail = f".{fraction}" if fraction else ""
    kind = draw(st.sampled_from(["plain", "commas", "latex-comma", "spaces", "split", "fraction", "dollar", "unit"]))
    if kind == "split" and len(whole) > 1:  # digits cut once: a list, a decimal comma, or (by luck) a thousands group
        cut = draw(st.integers(1, len(whole) - 1))
        separator = draw(st.sampled_from([",", ", ", " "]))
        thousands = len(whole) - cut == 3 and whole[0] != "0"
        return f"{sign}{whole[:cut]}{separator}{whole[cut:]}{tail}", separator == " " and thousands
    if kind == "commas" and len(whole) > 3:
        return f"{sign}{grouped(whole, ',')}{tail}", False
    if kind == "latex-comma" and len(whole) > 3:
        return f"{sign}{grouped(whole, '{,}')}{tail}", False
    if kind == "spaces" and len(whole) > 3:
        return f"{sign}{grouped(whole, draw(st.sampled_from(SPACE_GROUPS)))}{tail}", True
    if kind == "fraction" and not fraction and magnitude != 0:
        denominator = draw(st.sampled_from([2, 3, 4]))
        return f"{sign}\\frac{{{int(magnitude) * denominator}}}{{{denominator}}}", False
    if kind == "dollar":
        return f"{sign}\\${whole}{tail}", False
    if kind == "unit":
        return f"{sign}{whole}{tail}\\text{{ {draw(st.sampled_from(['cm', 'apples', 'km']))}}}", False
    return f"{sign}{whole}{tail}", False


values = st.one_of(
    st.integers(-(10**9), 10**9).map(Decimal),
    st.decimals(min_value=-100000, max_value=100000, places=2, allow_nan=False, allow_infinity=False),
)


@st.composite
def answer_and_gold(draw: st.DrawFn) -> tuple[str, str, Decimal, Decimal, bool]:
    gold_value = draw(values)
    answer_value = draw(st.one_of(st.just(gold_value), values, st.just(gold_value + 1), st.just(-gold_value)))
    answer, rule = draw(spelled(answer_value))
    gold, gold_rule = draw(spelled(gold_value).filter(lambda s: not s[0].startswith(("\\$", "-\\$"))))
    return answer, gold, answer_value, gold_value, rule or gold_rule


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(answer_and_gold())
@example(("1,234", "1234", Decimal(1234), Decimal(1234), False))
@example(("1 234", "1234", Decimal(1234), Decimal(1234), True))
def test_number_spellings_agree_with_math_verify(case: tuple[str, str, Decimal, Decimal, bool]) -> None:
    answer, gold, answer_value, gold_value, documented_rule = case
    ours = boxed_verdict(answer, gold)
    if documented_rule:
        assert ours == float(answer_value == gold_value), (answer, gold)
    else:
        assert ours == reference(answer, gold), (answer, gold)


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("4, 5", "45"),
        ("4,5", "45"),
        ("7 8", "78"),
        ("1,22", "122"),
        ("0,111", "111"),
        ("12,34,567", "1234567"),
        ("1,234 567", "1234567"),
    ],
)
def test_digit_runs_that_are_no_thousands_groups_are_not_one_number(answer: str, gold: str) -> None:
    assert plain_number(answer) is None
    assert math_accuracy(completions=[f"\\boxed{{{answer}}}"], ground_truth=[gold]) == [reference(answer, gold)]
    assert reference(answer, gold) == 0.0


def test_grpoflows_rule_for_space_grouped_thousands() -> None:
    for spelling in ("12 345", "12\\,345", "12\\ 345", "12~345"):
        assert plain_number(spelling) == 12345
        assert math_accuracy(completions=[f"\\boxed{{{spelling}}}"], ground_truth=["12345"]) == [1.0]
    assert reference("12 345", "12345") == 0.0  # math-verify reads 12 + 345


@pytest.mark.parametrize(
    ("gold", "normalized"),
    [("12,345", "12345"), ("1,234,567.5", "1234567.5"), ("-1,234", "-1234"), ("12 345", "12345"), ("4, 5", "4, 5")],
)
def test_gold_thousands_are_read_as_one_number(gold: str, normalized: str) -> None:
    assert normalize_math(gold) == normalized


@pytest.mark.parametrize("gold", ["2,5", "0,111", "1,22", "12,34,567", "-0,5"])
def test_a_gold_whose_comma_is_no_thousands_separator_is_quarantined_with_the_reason(gold: str) -> None:
    with pytest.raises(RowProblem, match="ambiguous: a decimal comma or a list"):
        normalize_math(gold)


@pytest.mark.parametrize(
    ("gold", "fragment"), [("4 + \\mathbb{R}", "4"), ("10^{3", "10"), ("3 \\cdot", "3"), ("x^2 \\foo{y}", None)]
)
def test_a_gold_math_verify_reads_only_in_part_is_never_scored(gold: str, fragment: str | None) -> None:
    assert not parse_gold(gold)
    assert math_accuracy(completions=[f"\\boxed{{{fragment or 7}}}"], ground_truth=[gold]) == [None]
    with pytest.raises(RowProblem, match="read only in part" if fragment else "not parseable"):
        normalize_math(gold)


@pytest.mark.parametrize("answer", ["10^{3", "4 + \\mathbb{R}", "3 \\cdot", "\\frac{1}{"])
def test_a_boxed_answer_that_does_not_parse_scores_0_not_its_first_characters(answer: str) -> None:
    first_number = {"10^{3": "10", "4 + \\mathbb{R}": "4", "3 \\cdot": "3", "\\frac{1}{": "1"}[answer]
    assert math_accuracy(completions=[f"\\boxed{{{answer}}}"], ground_truth=[first_number]) == [0.0]
