import json
from pathlib import Path

import pandas as pd
import pytest

from tasks.config import DataSettings
from tasks.inputs import DataSourceError, load_rows, render_prompt

ROWS = [
    {"id": "a", "prompt": "What is 1 + 1?", "ground_truth": "2"},
    {"id": "b", "prompt": "What is 2 + 3?", "ground_truth": "5"},
]


def _settings(source: Path | str) -> DataSettings:
    return DataSettings(source=str(source))


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert load_rows(_settings(path), 0) == ROWS


def test_csv_keeps_answers_as_text(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    pd.DataFrame(ROWS).to_csv(path, index=False)
    assert load_rows(_settings(path), 0) == ROWS


def test_parquet(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    pd.DataFrame(ROWS).to_parquet(path)
    assert load_rows(_settings(path), 0) == ROWS


def test_saved_datasets_folder(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert load_rows(_settings(tmp_path / "saved"), 0) == ROWS


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match=str(tmp_path / "absent.jsonl")):
        load_rows(_settings(tmp_path / "absent.jsonl"), 0)


def test_hub_dataset_offline_is_a_clear_error() -> None:
    with pytest.raises(DataSourceError, match="cannot load Hub dataset 'openai/gsm8k'"):
        load_rows(_settings("hub:openai/gsm8k"), 0)


def test_builtin_task_is_seeded() -> None:
    settings = DataSettings()
    assert load_rows(settings, 1) == load_rows(settings, 1) != load_rows(settings, 2)


def test_render_prompt_uses_the_chat_template(tiny_model_dir: Path) -> None:
    from tasks.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    rendered = render_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert rendered == "<|user|>hi</s>\n<|assistant|>"
    assert render_prompt(tokenizer, "hi") == rendered  # a plain string becomes a user message


def test_columns_are_renamed_to_grpoflows(tmp_path) -> None:
    import json

    from tasks.config import DataSettings
    from tasks.inputs import load_rows

    path = tmp_path / "gsm8k-like.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "so #### 2"}) + "\n")
    rows = load_rows(DataSettings(source=str(path), columns={"prompt": "question", "ground_truth": "answer"}), 0)
    assert rows == [{"prompt": "1+1?", "ground_truth": "so #### 2"}]


def test_a_worked_solution_column_becomes_the_sft_completion_through_validate(tmp_path, tiny_model_dir) -> None:  # noqa: ANN001
    """GSM8K's answer column is both the ground truth (its '#### N') and, with data.worked_solution, SFT's target:
    the reasoning without the calculator annotations, ending in the answer the rewards read; a row whose solution
    is empty falls back to the answer alone; a worked_solution column the source lacks is one error naming it."""
    import pytest

    from tasks.config import load_config
    from tasks.inputs import DataSourceError, read_jsonl
    from tasks.models import load_tokenizer
    from tasks.sft import sft_examples
    from tasks.validate import run_validate

    rows = [
        {"question": f"Q{i}: how many?", "answer": f"{i} * 2 = <<{i}*2={2 * i}>>{2 * i} apples.\n#### {2 * i}"}
        for i in range(1, 21)
    ]
    rows[0]["answer"] = "#### 2"  # no reasoning: the answer alone
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = {"source": str(path), "columns": {"prompt": "question", "ground_truth": "answer"}}
    config = load_config(overrides={"data": {**data, "worked_solution": "answer"}, "output_dir": str(tmp_path)})
    split = run_validate(config, tmp_path / "validate")
    kept = read_jsonl(split.train_path) + read_jsonl(split.holdout_path)
    assert {row["ground_truth"] for row in kept} == {str(2 * i) for i in range(1, 21)}
    completions = {
        row["ground_truth"]: e["completion"]
        for row, e in zip(kept, sft_examples(kept, load_tokenizer(tiny_model_dir), config), strict=True)
    }
    assert completions["6"] == "3 * 2 = 6 apples.\n\\boxed{6}"
    assert completions["2"] == "\\boxed{2}"
    assert not any("<<" in c or "####" in c for c in completions.values())

    missing = load_config(overrides={"data": {**data, "worked_solution": "solution"}})
    with pytest.raises(DataSourceError, match="has no column 'solution'"):
        run_validate(missing, tmp_path / "missing")
