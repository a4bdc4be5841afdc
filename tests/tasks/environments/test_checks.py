"""What validate checks about the tools before any training: their canaries (a wrong answer stops the run, with
the report kept), rows whose traces call tools the config lacks (quarantined with the reason), and lengths (a
prompt with the schemas, a trace, one tool round) against the keys that bound them, each error naming its row."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tasks.config import ToolSettings, load_config
from tasks.environments import Toolbox, ToolCanaryFailed, ToolLengthError, measure_tools, tool_canaries
from tasks.validate import run_validate

REPO = Path(__file__).resolve().parents[3]
ADD = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b - 1  # off by one: its canary must catch it
'''


def test_a_tool_that_answers_a_known_call_wrongly_stops_before_training(tmp_path: Path) -> None:
    (tmp_path / "off_by_one.py").write_text(textwrap.dedent(ADD))
    canary = {"arguments": {"a": 2, "b": 3}, "expect": "5"}
    use = [{"name": "python"}, {"name": "off_by_one:add", "path": str(tmp_path), "canaries": [canary]}]
    report_path = tmp_path / "tool_canaries.json"
    with pytest.raises(ToolCanaryFailed, match=r"tool add\{'a': 2, 'b': 3\}: expected '5' in its answer, got '4'"):
        tool_canaries(Toolbox(ToolSettings(use=use)), report_path)
    report = json.loads(report_path.read_text())
    assert [case["passed"] for case in report["cases"]] == [True, True, True, True, False]
    assert tool_canaries(Toolbox(ToolSettings(use=use[:1])))["unchecked"] == []


def test_validate_quarantines_traces_that_call_tools_the_config_lacks(tmp_path: Path) -> None:
    def trace(tool: str) -> list[dict]:
        call = {"type": "function", "function": {"name": tool, "arguments": {"code": "print(3 * 4)"}}}
        return [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": tool, "content": "12"},
            {"role": "assistant", "content": "\\boxed{12}"},
        ]

    rows = [{"id": f"r{i}", "prompt": f"What is 3 * 4 (case {i})?", "ground_truth": "12"} for i in range(10)]
    rows[0]["completion"], rows[1]["completion"] = trace("python"), trace("sql")
    rows[2]["completion"] = [{"role": "tool", "name": "python", "content": "12"}]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = {"data.source": str(source), "data.max_quarantine_share": 0.5, "output_dir": str(tmp_path / "out")}
    config = load_config(REPO / "configs" / "tiny-tools.yaml", overrides)
    result = run_validate(config, tmp_path / "validate")
    reasons = {
        record["row"]["id"]: record["reasons"]
        for record in map(json.loads, result.quarantine_path.read_text().splitlines())
    }
    assert reasons == {
        "r1": ["completion trace calls tool 'sql', not in tools.use (configured: python)"],
        "r2": ["completion message 0 is a tool answer with no call before it"],
    }
    assert result.rows_kept == 8 and result.tools["canaries"] == 4
    assert (tmp_path / "validate" / "tool_canaries.json").is_file()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"sft.max_length": 300},
            r"row \S+: its prompt with the tools' schemas and its tool trace is \d+ tokens, over ",
        ),
        ({"grpo.max_completion_length": 100}, r"one tool round .* over grpo\.max_completion_length \(100\)"),
    ],
)
def test_lengths_that_cannot_hold_a_tool_round_name_the_row_and_the_key(overrides: dict, expected: str) -> None:
    from tasks.environments import prepare_tokenizer
    from tasks.inputs import arithmetic_rows
    from tasks.models import load_tokenizer, resolve_model_source

    config = load_config(REPO / "configs" / "tiny-tools.yaml", overrides)
    tokenizer = load_tokenizer(resolve_model_source(config.model.source))
    prepare_tokenizer(tokenizer, config.tools.chat_template, config.model.source)
    rows = arithmetic_rows(config.data.arithmetic, config.seed)[:8]
    with pytest.raises(ToolLengthError, match=expected):
        measure_tools(config, tokenizer, Toolbox(config.tools), rows, uses_vllm=False)
    sizes = measure_tools(
        load_config(REPO / "configs" / "tiny-tools.yaml"), tokenizer, Toolbox(config.tools), rows, False
    )
    assert sizes.rounds_that_fit >= 1 and sizes.longest_prompt_tokens > 0
