"""Evaluation on the tiny model: every model and k in the table, reproducible numbers, forgetting detected."""

import torch

from tasks.evaluate import ModelSpec, evaluation_table, run_evaluate, score_model
from tasks.forgetting import forgetting, general_ability
from tasks.models import load_base_model, load_tokenizer


def test_table_holds_every_model_and_k(tiny_config, tiny_split, tiny_model_dir, tmp_path) -> None:
    models = [ModelSpec("base", tiny_model_dir), ModelSpec("grpo", tiny_model_dir)]
    result = run_evaluate(tiny_config, tiny_split.holdout_path, models, tmp_path)
    table = evaluation_table(result)
    assert [row["model"] for row in table] == ["base", "grpo"]
    for row in table:
        assert all(f"pass@{k}" in row for k in tiny_config.evaluation.k)
        assert row["prompts"] == min(tiny_config.evaluation.num_prompts, tiny_split.rows_holdout)
        assert row["samples"] == tiny_config.evaluation.n_samples
    assert "grpo-vs-base" in result.comparisons and result.comparisons["grpo-vs-base"]["n"] == table[0]["prompts"]
    assert result.curve_path.stat().st_size > 0 and result.table_path.is_file()
    # The same model on both sides: no forgetting at all.
    assert result.forgetting == {"qa_accuracy_drop": 0.0, "perplexity_increase": 0.0}


def test_same_seed_same_numbers(tiny_config, tiny_split, tiny_model_dir) -> None:
    from tasks.evaluate import holdout_rows

    rows = holdout_rows(tiny_config, tiny_split.holdout_path)
    first = score_model(tiny_config, ModelSpec("base", tiny_model_dir), rows)
    second = score_model(tiny_config, ModelSpec("base", tiny_model_dir), rows)
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
    assert before.corpus_tokens > 1000 and before.qa_questions == 40
    assert forgetting(before, after)["perplexity_increase"] > 0.5
    assert forgetting(before, general_ability(healthy, tokenizer)) == {
        "qa_accuracy_drop": 0.0,
        "perplexity_increase": 0.0,
    }
