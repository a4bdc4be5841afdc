"""Evaluation on the tiny model: every model and k in the table, reproducible numbers, forgetting detected."""

import itertools

import pytest
import torch

from tasks.evaluate import ModelSpec, compare_roles, run_evaluate, score_model
from tasks.evaluation import evaluation_table, forgetting_drop, general_ability
from tasks.models import load_base_model, load_tokenizer


def test_table_holds_every_model_and_k(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    models = {"base": ModelSpec("base", tiny_model_dir), "candidate": ModelSpec("grpo", tiny_model_dir)}
    result = run_evaluate(tiny_config, tiny_split.holdout_path, models, tmp_path)
    table = evaluation_table(result)
    assert [row["model"] for row in table] == ["base", "grpo"]
    for row in table:
        assert all(f"pass@{k}" in row for k in tiny_config.evaluation.k)
        assert row["prompts"] == min(tiny_config.evaluation.num_prompts, tiny_split.rows_holdout)
        assert row["samples"] == tiny_config.evaluation.n_samples
    assert "grpo-vs-base" in result.comparisons and result.comparisons["grpo-vs-base"]["n"] == table[0]["prompts"]
    assert result.curve_path.stat().st_size > 0 and result.table_path.is_file()
    # The same model on both sides: no forgetting at all, and intervals of exactly zero.
    drop = result.forgetting
    assert drop["qa_accuracy_drop"] == drop["perplexity_increase"] == 0.0
    assert drop["qa_drop_interval"] == drop["perplexity_interval"] == [0.0, 0.0]


def test_same_seed_same_numbers(tiny_config, tiny_split, tiny_model_dir) -> None:
    from tasks.evaluate import holdout_rows

    config = tiny_config.model_copy(update={"evaluation": tiny_config.evaluation.model_copy(update={"cache": False})})
    rows = holdout_rows(config, tiny_split.holdout_path)
    first = score_model(config, ModelSpec("base", tiny_model_dir), rows)
    second = score_model(config, ModelSpec("base", tiny_model_dir), rows)  # sampled again, not read back
    assert first.pass_at_k == second.pass_at_k
    assert first.per_prompt_pass1 == second.per_prompt_pass1
    assert first.general == second.general


def test_forgetting_probe_sees_a_damaged_model(tiny_model_dir) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    healthy = load_base_model(tiny_model_dir)
    damaged = load_base_model(tiny_model_dir)
    with torch.no_grad():
        for name, parameter in damaged.named_parameters():
            if "embed" in name:
                parameter.mul_(25.0)  # sharpen the random logits: text it saw before becomes much less likely
    before = general_ability(healthy, tokenizer)
    after = general_ability(damaged, tokenizer)
    assert before.corpus_tokens > 1000 and before.qa_questions >= 400
    assert forgetting_drop(before, after)["perplexity_increase"] > 0.5
    same = forgetting_drop(before, general_ability(healthy, tokenizer))
    assert same["qa_accuracy_drop"] == same["perplexity_increase"] == 0.0


def test_roles_not_positions_decide_what_promotion_compares(tiny_config, make_scores, tmp_path) -> None:
    """Scores handed over in every order give the same promotion case and decision; the champion, when there
    is one, is the reference; swapping two roles changes the decision (roles are read, not positions)."""
    from tasks.promote import PromotionCase, decide_promotion

    champion = make_scores("champion", [0.5, 0.25] * 20)
    champion.registered_version = "3"
    by_role = {
        "base": make_scores("base", [0.0, 0.25] * 20),
        "sft": make_scores("sft", [0.25, 0.5] * 20),
        "reference": champion,
        "candidate": make_scores("grpo", [1.0, 0.75] * 20),
    }
    outcomes = set()
    for order in itertools.permutations(by_role):
        result = compare_roles(tiny_config, {role: by_role[role] for role in order}, tmp_path / "-".join(order))
        assert list(result.scores) == ["base", "sft", "champion", "grpo"]  # tables keep the role order
        case = PromotionCase.from_evaluation(result)
        assert (case.candidate.name, case.reference.name, case.champion_version) == ("grpo", "champion", "3")
        outcomes.add((decide_promotion(case, tiny_config.promotion), case.difference["mean"]))
    assert len(outcomes) == 1 and next(iter(outcomes))[0][0] is True

    without_champion = compare_roles(tiny_config, {k: v for k, v in by_role.items() if k != "reference"}, tmp_path)
    case = PromotionCase.from_evaluation(without_champion)
    assert case.reference.name == "base" and case.champion_version is None

    swapped_roles = {**by_role, "candidate": by_role["base"], "base": by_role["candidate"]}
    swapped = compare_roles(tiny_config, swapped_roles, tmp_path)
    assert decide_promotion(PromotionCase.from_evaluation(swapped), tiny_config.promotion)[0] is False


def test_models_by_role_in_any_order_score_the_same(tiny_config, tiny_split, tiny_model_dir, tiny_adapter, tmp_path):
    """The real stage: the same models handed over in two orders give identical results by role."""
    models = {
        "candidate": ModelSpec("grpo", tiny_model_dir, tiny_adapter),
        "base": ModelSpec("base", tiny_model_dir),
    }
    forward = run_evaluate(tiny_config, tiny_split.holdout_path, models, tmp_path / "a")
    backward = run_evaluate(tiny_config, tiny_split.holdout_path, dict(reversed(models.items())), tmp_path / "b")
    assert forward.roles == backward.roles == {"base": "base", "candidate": "grpo"}
    assert forward.of("candidate").per_prompt_pass1 == backward.of("candidate").per_prompt_pass1
    assert forward.comparison("base") == backward.comparison("base")
    with pytest.raises(ValueError, match="by role"):
        run_evaluate(tiny_config, tiny_split.holdout_path, {"grpo": models["candidate"]}, tmp_path / "c")
