from __future__ import annotations

from reward_fns.code import code_passes, code_tests, extract_code

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
RIGHT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a * b + 1 if a > 0 else 0"


def test_plain_and_chat_completions_score_the_same() -> None:
    plain = [f"```python\n{RIGHT}\n```", WRONG, "def add(a, b) return"]
    chat = [[{"role": "assistant", "content": text}] for text in plain]
    assert code_tests(completions=plain, tests=[TESTS] * 3) == [1.0, 0.3, 0.0]
    assert code_tests(completions=chat, tests=[TESTS] * 3) == [1.0, 0.3, 0.0]


def test_partial_credit_is_configurable_and_correctness_is_strict() -> None:
    assert code_tests(completions=[WRONG], tests=[TESTS], partial_credit=0.5) == [0.5]
    assert code_passes(completions=[RIGHT, WRONG], tests=[TESTS] * 2) == [1.0, 0.0]


def test_code_prefix_and_entry_point_from_the_row() -> None:
    prefix = 'def double(x: int) -> int:\n    """Twice x."""\n'
    tests = "def check(candidate):\n    assert candidate(3) == 6\n"
    completions = ["    return 2 * x\n", "```python\ndef double(x):\n    return x + x\n```", "    return x\n"]
    rewards = code_tests(
        completions=completions, tests=[tests] * 3, entry_point=["double"] * 3, code_prefix=[prefix] * 3
    )
    assert rewards == [1.0, 1.0, 0.3]


def test_unjudgeable_tests_give_none() -> None:
    assert code_tests(completions=[RIGHT], tests=["x = 1  # defines no test"]) == [None]


def test_last_fenced_block_is_the_program() -> None:
    text = f"First try:\n```python\ndef add(a, b):\n    return 0\n```\nFixed:\n```py\n{RIGHT}\n```"
    assert extract_code(text).strip() == RIGHT
    assert code_tests(completions=[text], tests=[TESTS]) == [1.0]


def test_huge_output_and_many_boxed_like_markers_do_not_break_scoring() -> None:
    flood = RIGHT + "\nprint('y' * 1_000_000)"
    assert code_tests(completions=[flood], tests=[TESTS]) == [1.0]
