"""Forgetting with intervals, on real models: an adapter that changes nothing is not rejected and its intervals
hold 0; a damaged one is rejected with the interval in the reason (perplexity and KL on the tiny model, general
QA on SmolLM2, whose answers mean something)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.config import PromotionSettings
from tasks.evaluation import (
    DEFAULT_QUESTIONS,
    fingerprint,
    forgetting_drop,
    forgetting_problem,
    general_ability,
    load_questions,
    minimum_detectable_drop,
    overlapping_questions,
)
from tasks.models import load_policy, load_tokenizer


def _ability(base_dir: Path, adapter: Path | None, precision: str = "fp32"):
    base_key = fingerprint(base_dir)
    model = load_policy(base_dir, adapter)
    return general_ability(
        model,
        load_tokenizer(base_dir),
        batch_size=64,
        precision=precision,
        model_key=base_key if adapter is None else None,
        base_key=None if adapter is None else base_key,
    )


def _contains_zero(interval: list[float]) -> bool:
    return interval[0] <= 1e-9 and interval[1] >= -1e-9


def test_the_shipped_sets_are_big_enough_and_labelled() -> None:
    items = load_questions(DEFAULT_QUESTIONS)
    assert len(items) >= 400 and minimum_detectable_drop(len(items)) <= 0.05  # ≤ 5 points at 10 % disagreement
    assert all(item["answers"][0] in item["choices"] and item["category"] and item["source"] for item in items)
    assert len({item["question"] for item in items}) == len(items)  # no question asked twice with two answers


def test_an_unchanged_adapter_is_not_rejected_and_its_intervals_hold_zero(tiny_model_dir, lora_adapter, tmp_path):
    base = _ability(tiny_model_dir, None)
    same = _ability(tiny_model_dir, lora_adapter(tmp_path / "zero", 0.0))
    drop = forgetting_drop(base, same)
    assert _contains_zero(drop["qa_drop_interval"]) and _contains_zero(drop["perplexity_interval"])
    assert drop["kl"] < 1e-6 and drop["kl_interval"][0] <= 1e-6  # KL is never negative: its interval starts at 0
    assert forgetting_problem(drop, PromotionSettings(), "the base model") is None
    assert drop["n_questions"] == len(load_questions(DEFAULT_QUESTIONS)) and drop["n_documents"] >= 100


def test_a_damaged_adapter_is_rejected_with_the_interval_in_the_reason(tiny_model_dir, lora_adapter, tmp_path):
    base = _ability(tiny_model_dir, None)
    damaged = _ability(tiny_model_dir, lora_adapter(tmp_path / "damaged", 1.0))
    drop = forgetting_drop(base, damaged)
    assert drop["perplexity_interval"][0] > 0.5 and drop["kl_interval"][0] > 0.1  # both move on the tiny model
    reason = forgetting_problem(drop, PromotionSettings(), "the base model")
    assert reason.startswith("forgetting against the base model: general-text perplexity rose")
    low, high = (100 * value for value in drop["perplexity_interval"])
    assert f"(95% CI [{low:.1f}, {high:.1f}])" in reason and "beyond the tolerance of 10.0" in reason


def test_the_gate_reads_the_configured_end_of_the_interval() -> None:
    drop = {"qa_accuracy_drop": 0.06, "qa_drop_interval": [0.02, 0.10], "perplexity_increase": 0.0}
    assert forgetting_problem(drop, PromotionSettings(), "base") is None  # not shown beyond 5 points
    assert forgetting_problem(drop, PromotionSettings(forgetting_test="point"), "base")
    assert forgetting_problem(drop, PromotionSettings(forgetting_test="upper"), "base")
    assert (
        forgetting_problem(
            {**drop, "qa_drop_interval": [-0.02, 0.04]}, PromotionSettings(forgetting_test="upper"), "base"
        )
        is None
    )


def test_general_questions_found_in_the_training_data_are_left_out(tiny_model_dir, lora_adapter, tmp_path) -> None:
    items = load_questions(DEFAULT_QUESTIONS)
    trained_on = overlapping_questions(
        [i["id"] for i in items],
        [i["question"] for i in items],
        [f"Please answer: {items[0]['question']}", "What is 2 + 2?"],
    )
    assert trained_on == {items[0]["id"]}
    base = _ability(tiny_model_dir, None)
    drop = forgetting_drop(base, base, exclude=trained_on)
    assert drop["n_questions"] == len(items) - 1 and drop["qa_excluded_overlapping_training"] == 1


def test_base_results_are_cached_by_model_and_set_fingerprint(tiny_model_dir) -> None:
    first = _ability(tiny_model_dir, None)
    again = _ability(tiny_model_dir, None)
    assert json.dumps(first.to_json()) == json.dumps(again.to_json())
    assert first.qa_correct == again.qa_correct and first.doc_nll == again.doc_nll


@pytest.mark.pretrained
@pytest.mark.xdist_group("smollm2")
@pytest.mark.parametrize("noise", [1.0])
def test_smollm2_loses_general_qa_beyond_the_tolerance_when_damaged(tmp_path, noise) -> None:
    """General QA means something only on a real model: SmolLM2 answers about half the questions; LoRA noise on
    its attention and MLP outputs costs it about 20 points, and the gate says so with the interval."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tasks.models import load_base_model, resolve_model_source

    base_dir = resolve_model_source("smollm2-135m-instruct")
    torch.manual_seed(1)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = get_peft_model(load_base_model(base_dir), lora)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, noise)
    model.save_pretrained(tmp_path / "damaged")
    base = _ability(base_dir, None, "auto")
    damaged = _ability(base_dir, tmp_path / "damaged", "auto")
    drop = forgetting_drop(base, damaged)
    assert base.qa_accuracy > 0.4 and drop["qa_drop_interval"][0] > 0.05
    reason = forgetting_problem(drop, PromotionSettings(), "the base model")
    assert reason.startswith("forgetting against the base model: general QA accuracy fell")
    assert "(95% CI [" in reason and "beyond the tolerance of 5.0" in reason


def test_choice_scores_are_each_choice_scored_after_its_context_alone(tiny_model_dir) -> None:
    """Shared prefill, only the longer choices going on (their context's cache rows copied): each score is what
    one unpadded forward pass over context + choice gives, for choices of one to several tokens."""
    import torch

    from tasks.evaluation.forgetting import choice_logprobs

    tokenizer = load_tokenizer(tiny_model_dir)
    model = load_policy(tiny_model_dir, None).eval()
    questions = [
        ("Question: 2+2?\nAnswer:", ["4", "22", "five"]),
        ("Q: sky?\nA:", ["blue", "x"]),
        ("Question: pick\nAnswer:", ["a", "b", "c"]),
        ("Q:\nA:", ["long answer", "no"]),
    ]
    contexts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in questions]
    choices = [[tokenizer(f" {c}", add_special_tokens=False)["input_ids"] for c in options] for _, options in questions]
    with torch.inference_mode():
        scores = choice_logprobs(model, contexts, choices, tokenizer.pad_token_id, batch_size=6)
        for context, options, got in zip(contexts, choices, scores, strict=True):
            for option, score in zip(options, got, strict=True):
                logprobs = torch.log_softmax(model(input_ids=torch.tensor([context + option])).logits[0].float(), -1)
                expected = sum(float(logprobs[len(context) - 1 + k, token]) for k, token in enumerate(option))
                assert score == pytest.approx(expected, abs=1e-4)
