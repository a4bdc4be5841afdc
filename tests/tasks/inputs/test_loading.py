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
