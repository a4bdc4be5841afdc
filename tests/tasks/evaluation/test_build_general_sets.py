"""The forgetting check's general sets are rebuilt byte for byte by their builder (they are committed output)."""

from pathlib import Path

import pytest

import tasks.evaluation.build_general_sets as builder
from tasks.evaluation import DEFAULT_CORPUS, DEFAULT_QUESTIONS


def test_the_shipped_general_sets_are_what_the_builder_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for earlier in DEFAULT_QUESTIONS.parent.glob("*_v1.*"):  # the builder reads the sets' first versions
        (tmp_path / earlier.name).write_bytes(earlier.read_bytes())
    monkeypatch.setattr(builder, "HERE", tmp_path)
    builder.main()
    assert (tmp_path / "general_qa.jsonl").read_bytes() == DEFAULT_QUESTIONS.read_bytes()
    assert (tmp_path / "general_text.txt").read_bytes() == DEFAULT_CORPUS.read_bytes()
    assert DEFAULT_QUESTIONS.parent.name == "general_sets"
