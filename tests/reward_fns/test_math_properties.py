"""The math reward's fast path for plain numbers concludes only what math-verify concludes.

Generated numbers in many spellings (signs, thousands separators, decimals and trailing zeros, fractions,
percents, ``\\$``, units, LaTeX spacing, and digit runs that are lists or decimal commas rather than numbers) are
scored by grpoflow and by math-verify used as TRL's ``accuracy_reward`` uses it. They must agree, except where
README documents grpoflow's own rules, and there grpoflow must agree with math-verify on the number the rule reads:
thousands grouped by spaces or thin spaces (math-verify adds the groups: ``1 234`` → 235) are one number, and one
comma after four digits or more is a decimal comma (``1000,99``, as math-verify's own tests read it; its LaTeX
parser makes a set of it).
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
def spelled(draw: st.DrawFn, value: Decimal) -> tuple[str, str | None]:
    """One spelling of ``value`` and, where one of grpoflow's documented rules applies (space-grouped thousands, a
    decimal comma after four digits), the plain number that rule reads it as."""
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
        if separator == " " and thousands:
            return f"{sign}{whole[:cut]} {whole[cut:]}{tail}", f"{sign}{whole}{tail}"
        if separator == "," and cut >= 4 and not tail:
            return f"{sign}{whole[:cut]},{whole[cut:]}", f"{sign}{whole[:cut]}.{whole[cut:]}"
        return f"{sign}{whole[:cut]}{separator}{whole[cut:]}{tail}", None
    if kind == "commas" and len(whole) > 3:
        return f"{sign}{grouped(whole, ',')}{tail}", None
    if kind == "latex-comma" and len(whole) > 3:
        return f"{sign}{grouped(whole, '{,}')}{tail}", None
    if kind == "spaces" and len(whole) > 3:
        return f"{sign}{grouped(whole, draw(st.sampled_from(SPACE_GROUPS)))}{tail}", f"{sign}{whole}{tail}"
    if kind == "fraction" and not fraction and magnitude != 0:
        denominator = draw(st.sampled_from([2, 3, 4]))
        return f"{sign}\\frac{{{int(magnitude) * denominator}}}{{{denominator}}}", None
    if kind == "dollar":
        return f"{sign}\\${whole}{tail}", None
    if kind == "unit":
        return f"{sign}{whole}{tail}\\text{{ {draw(st.sampled_from(['cm', 'apples', 'km']))}}}", None
    return f"{sign}{whole}{tail}", None


values = st.one_of(
    st.integers(-(10**9), 10**9).map(Decimal),
    st.decimals(min_value=-100000, max_value=100000, places=2, allow_nan=False, allow_infinity=False),
)


@st.composite
def answer_and_gold(draw: st.DrawFn) -> tuple[str, str, str | None, str | None]:
    gold_value = draw(values)
    answer_value = draw(st.one_of(st.just(gold_value), values, st.just(gold_value + 1), st.just(-gold_value)))
    answer, answer_reading = draw(spelled(answer_value))
    gold, gold_reading = draw(spelled(gold_value).filter(lambda s: not s[0].startswith(("\\$", "-\\$"))))
    return answer, gold, answer_reading, gold_reading


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(answer_and_gold())
@example(("1,234", "1234", None, None))
@example(("1 234", "1234", "1234", None))
@example(("1000,99", "1000.99", "1000.99", None))
@example(("-1000.99", "-1000,99", None, "-1000.99"))
@example(("12345,6", "123456", "12345.6", None))
def test_number_spellings_agree_with_math_verify(case: tuple[str, str, str | None, str | None]) -> None:
    """Where a documented rule reads a spelling, math-verify judges the plain number the rule reads instead."""
    answer, gold, answer_reading, gold_reading = case
    ours = boxed_verdict(answer, gold)
    assert ours == reference(answer_reading or answer, gold_reading or gold), (answer, gold)


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


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.sampled_from(["", "-", "+"]),
    st.integers(1000, 10**12),
    st.text(alphabet="0123456789", min_size=1, max_size=6),
)
def test_one_comma_after_four_digits_is_a_decimal_comma(sign: str, whole: int, fraction: str) -> None:
    """No thousands group starts with four digits: ``1000,99`` can only be 1000.99 (math-verify's own test reads
    it so), against a gold spelled either way; the gold is normalized to the point."""
    comma, point = f"{sign}{whole},{fraction}", f"{sign}{whole}.{fraction}"
    assert plain_number(comma) == Decimal(point)
    assert boxed_verdict(comma, point) == boxed_verdict(point, comma) == reference(point, point) == 1.0
    assert boxed_verdict(comma, f"{sign}{whole}{fraction}") == 0.0  # not a thousands group: not digits run together
    assert normalize_math(comma) == normalize_math(point)


UPRIGHT_GOLDS = [  # (gold with upright constants or operators, an equal answer, an answer that differs)
    (r"1 - \frac{1}{\mathrm{e}}", r"1-\frac{1}{e}", r"1 + \frac{1}{\mathrm{e}}"),  # math-verify reads only "1"
    (r"\frac{\mathrm{e}}{2}", r"\frac{e}{2}", r"\frac{\mathrm{e}}{3}"),
    (r"\mathrm{e}^{2}", "e^2", r"\mathrm{e}^{3}"),  # math-verify: a symbol named e, not Euler's number
    (r"2\mathrm{e}", "2e", "2"),  # math-verify: 2 (the e dropped as a unit)
    (r"\sqrt{\mathrm{e}}", r"e^{1/2}", r"\sqrt{2}"),
    (r"3 + 2\mathrm{i}", "3+2i", r"3 - 2\mathrm{i}"),
    (r"\frac{\mathrm{i}}{2}", r"\frac{i}{2}", r"\frac{1}{2}"),
    (r"\mathrm{e}^{\mathrm{i}\pi/4}", r"e^{i\pi/4}", r"e^{i\pi/2}"),
    (r"\frac{\mathrm{\pi}}{\mathrm{e}}", r"\frac{\pi}{e}", r"\frac{\pi}{2}"),
    (r"\operatorname{ln} 2", r"\ln 2", r"\ln 3"),
    (r"\mathrm{sin}\,x", r"\sin x", r"\cos x"),
    (r"\rm e", "e", "2.71"),
]


@pytest.mark.parametrize(("gold", "equal", "different"), UPRIGHT_GOLDS)
def test_upright_constants_and_operators_are_read_whole(gold: str, equal: str, different: str) -> None:
    """A valid gold is kept (not quarantined as read in part) and judged on all of it, in either spelling."""
    assert normalize_math(gold) == gold and parse_gold(gold)
    assert boxed_verdict(equal, gold) == boxed_verdict(gold, gold) == 1.0
    assert boxed_verdict(gold, equal) == 1.0  # an upright answer against a plain gold
    assert boxed_verdict(different, gold) == 0.0


@pytest.mark.parametrize("gold", [r"5\,\mathrm{cm}", r"3\mathrm{d}", r"7\mathrm{~kg}"])
def test_upright_units_stay_units(gold: str) -> None:
    """Only constants, a ``d`` before a variable and operator names change: a unit, or a ``d`` that is a day, is
    dropped by math-verify as before."""
    assert boxed_verdict(gold.split("\\")[0], gold) == 1.0
