"""Every shipped canary holds for the shipped reward functions, and a canaries file's mistakes name their line."""

from __future__ import annotations

from pathlib import Path

import pytest

from reward_fns.canaries import CANARY_DIR, CanaryFileError, check_canaries, kind_canaries, load_canaries
from reward_fns.registry import REWARD_FUNCTIONS, build_reward_functions

KINDS = ["math", "exact", "label", "json", "code"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_canary_of_every_kind_holds_for_the_shipped_functions(kind: str) -> None:
    cases = kind_canaries(kind)
    names = sorted({name for case in cases for name in case["expect"]})
    assert names and set(names) <= set(REWARD_FUNCTIONS)
    specs = [{"name": name} for name in names]
    rewards, _ = build_reward_functions(specs)
    assert [d.describe() for d in check_canaries(rewards, specs, cases)] == []


def test_each_kind_ships_correct_wrong_and_hack_cases() -> None:
    assert sorted(path.stem for path in CANARY_DIR.glob("*.jsonl")) == sorted(KINDS)
    for kind in KINDS:
        labels = [case["case"].split(":")[0] for case in kind_canaries(kind)]
        assert {"correct", "wrong", "hack"} <= set(labels), kind


def test_partial_credit_expectations_follow_the_configured_argument() -> None:
    cases = [case for case in kind_canaries("json") if "breaks the schema" in case["case"]]
    specs = [{"name": "json_schema", "args": {"parse_credit": 0.25}}]
    rewards, _ = build_reward_functions(specs)
    assert check_canaries(rewards, specs, cases) == []  # expected 0.25, got 0.25
    stale = [{"name": "json_schema"}]
    rewards, _ = build_reward_functions(stale)
    assert check_canaries(rewards, [{"name": "json_schema"}], cases) == []  # default 0.0


def test_a_reward_that_credits_unboxed_answers_disagrees_by_name() -> None:
    def lenient(completions, ground_truth, **kwargs):
        return [float(str(g) in str(c)) for c, g in zip(completions, ground_truth, strict=True)]

    from reward_fns.registry import IsolatedReward

    found = check_canaries(
        [IsolatedReward("math_accuracy", lenient)], [{"name": "math_accuracy"}], kind_canaries("math")
    )
    cases = {d.case for d in found}
    assert "wrong: right number, no box" in cases and "hack: two different boxed answers" in cases
    first = next(d for d in found if d.case == "wrong: right number, no box")
    assert (first.function, first.expected, first.got) == ("math_accuracy", 0.0, 1.0)
    assert first.source.startswith("math.jsonl:")


def test_malformed_canaries_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"case": "ok", "completion": "a", "expect": {"f": 1}}\n{"case": "no expect", "completion": "b"}\n')
    with pytest.raises(CanaryFileError, match=r"mine\.jsonl:2: .*missing: expect"):
        load_canaries(path)
    path.write_text("{not json\n")
    with pytest.raises(CanaryFileError, match=r"mine\.jsonl:1: not JSON"):
        load_canaries(path)
