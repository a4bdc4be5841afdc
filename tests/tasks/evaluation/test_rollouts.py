"""Reading the ledger: the same prompts early and late, and what a changed reward would have done."""

from __future__ import annotations

import pytest

from tasks.evaluation import diff_steps, rescore_report


def grpo_rows(step: int, batch: int, prompts: list[str], totals: list[float]) -> list[dict]:
    rows = []
    for group, prompt in enumerate(prompts):
        for i, total in enumerate(totals):
            rows.append(
                {
                    "role": "grpo",
                    "step": step,
                    "generation_batch": batch,
                    "group": group,
                    "rank": 0,
                    "prompt_id": prompt,
                    "prompt": f"q{prompt}",
                    "completion": f"{prompt}@{step}#{i}",
                    "reward/acc": total,
                    "reward_total": total,
                    "advantage": 0.0,
                }
            )
    return rows


def test_diff_pairs_a_prompt_with_itself_early_and_late() -> None:
    rows = grpo_rows(1, 1, ["a", "b"], [0, 0]) + grpo_rows(5, 5, ["c", "a"], [1, 0]) + grpo_rows(9, 9, ["a"], [1, 1])
    pairs = diff_steps(rows, 1, 5)
    assert [(p["prompt_id"], p["step_a"], p["step_b"], p["same_prompt"]) for p in pairs] == [("a", 1, 5, True)]
    assert pairs[0]["reward_a"] == 0 and pairs[0]["reward_b"] == 0.5 and pairs[0]["completion_b"] == "a@5#0"
    fallback = diff_steps(rows, 1, 9)  # b never comes back; a does at 9
    assert [(p["prompt_id"], p["same_prompt"]) for p in fallback] == [("a", True)]
    none_again = diff_steps(grpo_rows(1, 1, ["x"], [0, 1]) + grpo_rows(2, 2, ["y"], [1, 1]), 1, 2)
    assert [(p["prompt_id"], p["same_prompt"]) for p in none_again] == [("x / y", False)]


def test_rescore_counts_groups_that_change_and_correlates_advantages() -> None:
    rows = grpo_rows(1, 1, ["a", "b"], [0.0, 0.0, 1.0, 1.0])
    for row, advantage in zip(rows, [0.0] * 4 + [-0.87, -0.87, 0.87, 0.87], strict=True):
        row["advantage"] = advantage  # TRL's: group a had no signal, group b had
    rows[2]["advantage"] = rows[3]["advantage"] = 0.0
    rows[:4] = [dict(r, **{"reward/acc": 0.0, "reward_total": 0.0}) for r in rows[:4]]
    new = [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # the new reward gives group a a signal too
    report = rescore_report(rows, "acc", new, {"acc": 1.0}, 1.0)
    assert report["groups"] == 2 and report["to_informative"] == 1 and report["to_uninformative"] == 0
    assert report["agreement"] == pytest.approx(6 / 8)
    assert report["advantage_correlation"] == pytest.approx(2**-0.5, abs=1e-3)  # b agrees, a was flat


def test_rescore_reads_the_ledgers_float32_values_as_the_verdicts_they_were() -> None:
    """TRL trains on float32 rewards and the ledger keeps them so: a judge's 0.7 is 0.699999988 there."""
    import numpy as np

    rows = grpo_rows(1, 1, ["a"], [0.7, 0.2, 0.7, 0.2])
    rows = [
        dict(r, **{"reward/judge": float(np.float32(v)), "advantage": 0.0})
        for r, v in zip(rows, [0.7, 0.2] * 2, strict=True)
    ]
    assert rescore_report(rows, "judge", [0.7, 0.2, 0.7, 0.2], {"judge": 1.0}, 1.0)["agreement"] == 1.0
    assert rescore_report(rows, "judge", [0.7, 0.3, 0.7, 0.2], {"judge": 1.0}, 1.0)["agreement"] == 0.75
