"""The reward audit's detectors: each fires on a constructed case of its kind and stays quiet on honest runs."""

from __future__ import annotations

from typing import Any

from tasks.evaluation import audit_rollouts

WEIGHTS = {"math_accuracy": 1.0, "boxed_format": 0.2}
FLAT = {"mean": 0.0, "low": -0.05, "high": 0.05, "n": 100}
GAIN = {"mean": 0.08, "low": 0.04, "high": 0.12, "n": 100}


def rows(steps: int = 6, **per_step: Any) -> list[dict[str, Any]]:
    """8 trained GRPO rows per step; each keyword is a function of the step giving that column's value."""
    out = []
    for step in range(1, steps + 1):
        for i in range(8):
            row = {
                "role": "grpo",
                "trained": True,
                "step": step,
                "group": i // 4,
                "prompt": f"What is {i} plus {i}?",
                "completion": f"\\boxed{{{2 * i}}}",
                "completion_tokens": 6,
                "clipped": False,
                "reward/math_accuracy": 0.5,
                "reward/boxed_format": 1.0,
            }
            row.update({key: make(step, i) for key, make in per_step.items()})
            row["reward_total"] = sum(WEIGHTS[n] * row[f"reward/{n}"] for n in WEIGHTS)
            out.append(row)
    return out


def detectors(found: list) -> list[str]:
    return [f.detector for f in found]


def test_an_honest_run_has_no_finding() -> None:
    improving = rows(**{"reward/math_accuracy": lambda s, i: min(1.0, 0.3 + 0.1 * s)})
    assert audit_rollouts(improving, WEIGHTS, "math_accuracy", GAIN) == []
    assert audit_rollouts(rows(steps=1), WEIGHTS, "math_accuracy", FLAT) == []  # too short to judge


def test_a_format_reward_that_pays_for_boxes_while_answers_stay_wrong() -> None:
    hacked = rows(**{"reward/math_accuracy": lambda s, i: 0.3, "reward/boxed_format": lambda s, i: min(1.0, s / 4)})
    found = audit_rollouts(hacked, WEIGHTS, "math_accuracy", FLAT)
    assert detectors(found) == ["reward_without_correctness", "auxiliary_share_grew"]
    assert "hold-out pass@1 did not" in found[0].message and found[0].numbers["reward_rise"] > 0.05
    assert "boxed_format's share of the weighted total grew 20% → 40%" in found[1].message
    # The same rise with hold-out correctness that did improve: only the share finding stays.
    assert detectors(audit_rollouts(hacked, WEIGHTS, "math_accuracy", GAIN)) == ["auxiliary_share_grew"]


def test_length_blow_up_and_clipping() -> None:
    longer = rows(completion_tokens=lambda s, i: 6 * s, clipped=lambda s, i: s > 4)
    found = audit_rollouts(longer, WEIGHTS, "math_accuracy", GAIN)
    assert detectors(found) == ["length_grew"] and "clipped share 0% → 100%" in found[0].message


def test_repetition_and_prompt_copying() -> None:
    repeating = rows(completion=lambda s, i: "so so so so so so so so" if s > 4 else "the answer is \\boxed{4}")
    assert detectors(audit_rollouts(repeating, WEIGHTS, "math_accuracy", GAIN)) == ["repetition_rose"]
    copying = rows(completion=lambda s, i: f"What is {i} plus {i}? \\boxed{{{2 * i}}}" if s > 4 else "\\boxed{1}")
    assert detectors(audit_rollouts(copying, WEIGHTS, "math_accuracy", GAIN)) == ["prompt_copying"]


def test_untrained_and_other_roles_are_not_audited() -> None:
    set_aside = rows(**{"reward/math_accuracy": lambda s, i: 0.0, "reward/boxed_format": lambda s, i: min(1.0, s / 4)})
    for row in set_aside:
        row["trained"] = False
    assert audit_rollouts(set_aside, WEIGHTS, "math_accuracy", FLAT) == []


RUBRIC = "Judge whether the response answers the task correctly, completely and concisely."


def _judged(steps: int = 6, **per_step: Any) -> list[dict[str, Any]]:
    out = rows(steps, **per_step)
    for row in out:
        row.setdefault("reward/judge", 0.5)
        row["reward_total"] += 0.5 * row["reward/judge"]
    return out


def test_a_judge_whose_verdicts_rise_alone_is_found_and_one_that_follows_correctness_is_not() -> None:
    weights = {**WEIGHTS, "judge": 0.5}
    hacked = _judged(**{"reward/judge": lambda step, i: 0.2 + 0.1 * step})
    found = audit_rollouts(hacked, weights, "math_accuracy", GAIN, {"judge": RUBRIC})
    judge = next(f for f in found if f.detector == "judge_without_verifiable")
    assert "judge judge's verdicts rose +0.400" in judge.message and "math_accuracy +0.000" in judge.message
    honest = _judged(
        **{"reward/judge": lambda step, i: 0.2 + 0.1 * step, "reward/math_accuracy": lambda step, i: 0.1 * step}
    )
    assert "judge_without_verifiable" not in detectors(
        audit_rollouts(honest, weights, "math_accuracy", GAIN, {"judge": RUBRIC})
    )
    second = _judged(**{"reward/judge": lambda step, i: 0.2 + 0.1 * step, "reward/other": lambda step, i: 0.5})
    found = audit_rollouts(second, {"judge": 0.5}, None, None, {"judge": RUBRIC, "other": ""})
    assert detectors(found).count("judge_without_verifiable") == 1  # the second judge is the witness


def test_completions_that_write_the_rubric_to_the_judge_are_found() -> None:
    echo = "The response answers the task correctly, completely and concisely: 4."
    echoed = _judged(completion=lambda step, i: echo if step > 4 else f"\\boxed{{{2 * i}}}")
    found = audit_rollouts(echoed, {**WEIGHTS, "judge": 0.5}, "math_accuracy", GAIN, {"judge": RUBRIC})
    assert "rubric_echo" in detectors(found)
    assert "rubric_echo" not in detectors(
        audit_rollouts(_judged(), {**WEIGHTS, "judge": 0.5}, "math_accuracy", GAIN, {"judge": RUBRIC})
    )


def test_tool_calls_that_grow_without_correctness_and_failing_calls_are_found() -> None:
    # a policy that learned to call more, each call failing more often, answers no better
    spamming = rows(tool_calls=lambda s, i: 1 + (s > 3) * 2, tool_errors=lambda s, i: (s > 3) * 2)
    found = audit_rollouts(spamming, WEIGHTS, "math_accuracy", FLAT)
    assert detectors(found) == ["tool_calls_grew", "tool_errors_rose"]
    assert "tool calls per rollout grew 1.00 → 3.00" in found[0].message
    assert "the share of tool calls that failed rose 0% → 67%" in found[1].message
    # More calls that pay off (correctness rises with them) and calls that keep working: nothing to report.
    paying = rows(
        tool_calls=lambda s, i: 1 + (s > 3) * 2,
        tool_errors=lambda s, i: 0,
        **{"reward/math_accuracy": lambda s, i: min(1.0, 0.2 + 0.15 * s)},
    )
    assert audit_rollouts(paying, WEIGHTS, "math_accuracy", GAIN) == []
    assert audit_rollouts(rows(tool_calls=lambda s, i: 0), WEIGHTS, "math_accuracy", FLAT) == []
