"""A judge's biases measured on samples: length (padding that adds nothing), position (pairwise orders that
disagree), agreement with the verifiable reward; through a judge on loopback that has each bias or not."""

from __future__ import annotations

import math

import numpy as np

from tasks.config import PipelineConfig
from tasks.evaluation import judge_bias

ROWS = [{"id": str(n), "prompt": f"What is {n} + {n}?", "ground_truth": str(2 * n)} for n in range(1, 5)]
COMPLETIONS = [[f"\\boxed{{{2 * n}}}", "\\boxed{0}"] for n in range(1, 5)]
CORRECT = np.array([[1.0, 0.0]] * 4)


def _config(tiny_config: PipelineConfig, judge_server, **args) -> PipelineConfig:
    spec = {"name": "llm_judge", "args": {"url": judge_server.url, "model": "judge", **args}}
    return PipelineConfig.model_validate({**tiny_config.model_dump(), "rewards": [spec]})


def test_a_judge_that_reads_the_answer_has_no_length_bias_and_agrees_with_the_verifiable_reward(
    tiny_config, judge_server
) -> None:
    judged = np.array([[1.0, 0.2]] * 4)
    report = judge_bias(
        _config(tiny_config, judge_server, model_digest="rule"),
        ROWS,
        COMPLETIONS,
        {"correct": CORRECT, "per_function": {"llm_judge": judged}},
    )
    figures = report["llm_judge"]
    assert figures["length_gain"] == 0.0 and figures["padded_higher_share"] == 0.0 and figures["length_pairs"] == 4
    assert figures["verifiable_correlation"] > 0.99 and figures["judged_on_correct"] == 1.0
    assert "position_split_share" not in figures  # pointwise


def test_a_judge_that_pays_for_length_and_a_pairwise_one_that_prefers_a_position_are_measured(
    tiny_config, judge_server
) -> None:
    def by_length(payload) -> str:
        text = payload["messages"][-1]["content"]
        response = text.split("Response:\n", 1)[1].split("\n\nGive the response", 1)[0]
        return str(min(10, len(response) // 20))

    judge_server.answer = by_length
    scores = {"correct": CORRECT, "per_function": {"llm_judge": np.array([[0.0, 0.0]] * 4)}}
    figures = judge_bias(_config(tiny_config, judge_server, model_digest="length"), ROWS, COMPLETIONS, scores)[
        "llm_judge"
    ]
    assert figures["padded_higher_share"] == 1.0 and figures["length_gain"] > 0.3
    judge_server.answer = lambda payload: "A" if "Response A:" in payload["messages"][-1]["content"] else "5"
    rows = [dict(row, reference_completion="x") for row in ROWS]
    pairwise = {"correct": CORRECT, "per_function": {"llm_judge": np.array([[0.5, 0.5]] * 3 + [[1.0, 0.0]])}}
    figures = judge_bias(
        _config(tiny_config, judge_server, mode="pairwise", model_digest="first"), rows, COMPLETIONS, pairwise
    )["llm_judge"]
    assert figures["position_split_share"] == 0.75 and not math.isnan(figures["verifiable_correlation"])


def test_the_length_probe_pads_a_tool_rollouts_last_answer(tiny_config, judge_server) -> None:
    """With tools a completion is a conversation: the probe pads its last assistant message (it crashed on
    ``list + str`` before), and a judge that pays for length is still caught."""

    def by_length(payload) -> str:
        text = payload["messages"][-1]["content"]
        return str(min(10, len(text.split("Response:\n", 1)[1].split("\n\nGive the response", 1)[0]) // 20))

    judge_server.answer = by_length
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(2 + 2)"}}}
    conversations = [
        [
            [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "python", "content": str(2 * n)},
                {"role": "assistant", "content": f"\\boxed{{{2 * n}}}"},
            ]
        ]
        for n in range(1, 5)
    ]
    scores = {"correct": CORRECT[:, :1], "per_function": {"llm_judge": np.array([[0.0]] * 4)}}
    config = _config(tiny_config, judge_server, model_digest="length-tools")
    figures = judge_bias(config, ROWS, conversations, scores)["llm_judge"]
    assert figures["length_pairs"] == 4 and figures["padded_higher_share"] == 1.0


def test_the_judged_win_rate_counts_ties_half_and_leaves_unjudged_samples_out() -> None:
    from tasks.evaluation import win_rate

    rate = win_rate([[1.0, None], [0.2, 0.2], [None, None]], [[0.5, 0.5], [0.2, 0.9], [1.0, 1.0]], resamples=200)
    assert rate["n"] == 2 and rate["mean"] == (1.0 + 0.25) / 2  # prompt 2: a tie (0.5) and a loss; prompt 3 unjudged
    assert rate["low"] <= rate["mean"] <= rate["high"]


def test_the_gate_reads_the_judged_win_rate_when_the_config_says_so(tiny_config) -> None:
    import pytest

    from tasks.config import PromotionSettings
    from tasks.evaluate import ModelScores
    from tasks.promote import PromotionCase, decide_promotion

    a = ModelScores("grpo", 4, 4, 0.5, {1: 0.5}, (0.3, 0.7), [], [])
    b = ModelScores("sft", 4, 4, 0.5, {1: 0.5}, (0.3, 0.7), [], [])
    flat = {"mean": 0.0, "low": -0.1, "high": 0.1, "n": 4}  # no pass@1 gain: the pass@1 gate says no
    wins = {"judge": {"against": "sft", "mean": 0.8, "low": 0.62, "high": 0.95, "n": 4}}
    judged = PromotionSettings(metric="judged_win_rate")
    assert decide_promotion(PromotionCase(a, b, flat, judged=wins), judged)[0]
    assert not decide_promotion(PromotionCase(a, b, flat, judged=wins), PromotionSettings())[0]
    promoted, reason = decide_promotion(
        PromotionCase(a, b, flat, judged=wins), PromotionSettings(metric="judged_win_rate", margin=0.2)
    )
    assert not promoted and reason.startswith("judged win rate (judge) over sft is 0.800 with 95% CI [0.620, 0.950]")
    with pytest.raises(ValueError, match="judged_win_rate needs a judge among the rewards"):
        PipelineConfig.model_validate({**tiny_config.model_dump(), "promotion": {"metric": "judged_win_rate"}})
