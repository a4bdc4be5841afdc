"""The conversations SFT learns tool calls from: a row's own trace as it is, a built-in arithmetic row's trace
written by running its program in the sandbox (the tool's real answer), any other row's answer as one turn."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.config import load_config
from tasks.environments import Toolbox, tool_sft_examples

REPO = Path(__file__).resolve().parents[3]


def test_each_row_gets_its_own_trace_a_program_written_one_or_its_answer() -> None:
    config = load_config(REPO / "configs" / "tiny-tools.yaml")
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(2 ** 10)"}}}
    own = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "python", "content": "1024"},
        {"role": "assistant", "content": "\\boxed{1024}"},
    ]
    rows = [
        {"id": "a", "prompt": "What is 2 to the 10th?", "ground_truth": "1024", "completion": own},
        {"id": "b", "prompt": "What is 123 * 456? Put the final answer in \\boxed{}.", "ground_truth": "56088"},
        {"id": "c", "prompt": "Name a prime.", "ground_truth": "7"},
    ]
    toolbox = Toolbox(config.tools)
    examples = tool_sft_examples(rows, toolbox, config)
    assert [json.loads(e["tools"]) for e in examples] == [toolbox.schemas] * 3
    assert [m["role"] for m in examples[0]["completion"]] == ["assistant", "tool", "assistant"]
    # arguments as JSON text: a dataset would otherwise merge every tool's argument keys into one struct
    assert examples[0]["completion"][0]["tool_calls"][0]["function"]["arguments"] == '{"code": "print(2 ** 10)"}'
    written = examples[1]["completion"]
    assert written[0]["tool_calls"][0]["function"]["arguments"] == '{"code": "print(123 * 456)"}'
    assert written[1] == {"role": "tool", "name": "python", "content": "56088"}  # run, not assumed
    assert written[2] == {"role": "assistant", "content": "\\boxed{56088}"}
    assert examples[2]["completion"] == [{"role": "assistant", "content": "\\boxed{7}"}]
    assert examples[1]["prompt"][-1] == {"role": "user", "content": rows[1]["prompt"]}


def test_a_trace_whose_call_failed_is_left_out_and_the_row_teaches_its_answer(caplog) -> None:
    """A program-written trace reads what the tool answered: an error there, followed by the right answer, would
    teach the model that the tool's errors do not matter."""
    config = load_config(REPO / "configs" / "tiny-tools.yaml")
    rows = [
        {"id": "broken", "prompt": "What is 12 * * 3?", "ground_truth": "36"},  # print(12 * * 3): a SyntaxError
        {"id": "fine", "prompt": "What is 12 * 3?", "ground_truth": "36"},
    ]
    examples = tool_sft_examples(rows, Toolbox(config.tools), config)
    assert examples[0]["completion"] == [{"role": "assistant", "content": "\\boxed{36}"}]
    assert examples[1]["completion"][1] == {"role": "tool", "name": "python", "content": "36"}
    assert "1 tool trace(s) left out of SFT" in caplog.text and "row broken" in caplog.text
