import pytest

from reward_fns.math import boxed_match, math_accuracy, math_verdict


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


CASES = [
    ("The sum is \\boxed{42}.", "42", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("42", "42", 0.0),  # no box: not an answer
    ("first \\boxed{41} then final \\boxed{42}", "42", 0.0),  # two different answers: hedging, not solving
    ("\\boxed{42}, so again: \\boxed{42.0}", "42", 1.0),  # the same answer twice
    ("\\boxed{" + "4" * 5000 + "}", "42", 0.0),  # answer-stuffing
    ("\\boxed{42" + " + 0" * 1250 + "}", "42", 0.0),  # equal, but 5,000 characters: stuffing, never parsed
    ("first \\boxed{42} then final \\boxed{41}", "42", 0.0),
    ("<think>maybe \\boxed{42}</think> answer \\boxed{40}", "42", 0.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("\\boxed{42.0}", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),
    ("\\boxed{42", "42", 0.0),  # unclosed
    ("\\boxed{}", "42", 0.0),
    ("x" * 100_000 + "\\boxed{42}", "42", 1.0),  # huge output
]


@pytest.mark.parametrize(("completion", "gold", "expected"), CASES)
def test_math_accuracy_plain_and_chat(completion: str, gold: str, expected: float) -> None:
    assert math_accuracy(completions=[completion], ground_truth=[gold]) == [expected]
    assert math_accuracy(completions=[chat(completion)], ground_truth=[gold]) == [expected]


def test_unparseable_gold_is_none_not_zero() -> None:
    assert math_accuracy(completions=["\\boxed{1}"], ground_truth=["\\frac{"]) == [None]


def test_prose_gold_cannot_be_judged() -> None:
    # math-verify reads words as a product of letters: any anagram in a box would "verify"
    completions = ["\\boxed{see the figure}", "\\boxed{figure the see}"]
    assert math_accuracy(completions=completions, ground_truth=["see the figure"] * 2) == [None, None]


def test_fast_path_agrees_with_math_verify() -> None:
    # The plain-number fast path must give the verdict math-verify gives.
    from math_verify import parse, verify

    for answer, gold in [("12", "12"), ("12.50", "12.5"), ("-3", "-3"), ("7", "8"), ("0.1", "0.10")]:
        slow = float(verify(parse(f"${gold}$"), parse(f"$\\boxed{{{answer}}}$")))
        assert math_verdict(f"\\boxed{{{answer}}}", gold) == slow, (answer, gold)


def test_works_off_the_main_thread() -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(math_accuracy, completions=["\\boxed{\\frac{2}{4}}"], ground_truth=["0.5"]).result()
    assert result == [1.0]


def test_boxed_match_is_exact() -> None:
    assert boxed_match(completions=["\\boxed{12}", "\\boxed{12.0}", chat("\\boxed{12}")], ground_truth=["12"] * 3) == [
        1.0,
        0.0,
        1.0,
    ]
