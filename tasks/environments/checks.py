"""What validate (and ``grpoflow check``) checks about a pipeline's tools before any training: the tools build (a tool
TRL cannot describe is one error naming it), their canaries answer as expected, the rows' traces call only
configured tools, and the prompts with the tools' schemas, the traces and one tool round fit the lengths the config
gives them (TRL drops a turn that overflows ``max_completion_length`` silently, so its size is measured here).
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, ``tasks.models``,
Prefect, MLflow (the stage hands in the tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.environments.canaries import canary_report, check_tool_canaries
from tasks.environments.toolbox import Toolbox
from tasks.errors import GateStop, UserError
from tasks.inputs import prompt_messages, trace_tools


class ToolCanaryFailed(GateStop, RuntimeError):
    """A tool answered a known call otherwise than its canary expects."""


class ToolLengthError(UserError, ValueError):
    """A prompt with the tools' schemas, a trace or a tool round does not fit the configured lengths."""


def tool_canaries(toolbox: Toolbox, report_path: Path | None = None) -> dict[str, Any]:
    """Every tool's canaries run, their report (written to ``report_path`` first); ToolCanaryFailed names the first
    that failed.

    A failing canary means the tool would feed the model wrong answers (or the sandbox lets the network in), so
    training stops before it starts."""
    results = check_tool_canaries(toolbox)
    report = canary_report(results, toolbox)
    if report_path is not None:
        report_path.write_text(json.dumps(report, indent=2, default=str))
    failed = [result for result in results if not result.passed]
    if failed:
        more = f" ({len(failed) - 1} more in {report_path or 'the report'})" if len(failed) > 1 else ""
        raise ToolCanaryFailed(
            f"tool canary failed: {failed[0].describe()}{more}\n"
            "the tool answers a known call wrongly: fix it (or its canaries in tools.use[].canaries) before training"
        )
    return report


def unknown_tool_reason(completion: Any, names: Sequence[str]) -> str | None:
    """Why a row's trace cannot be learned with these tools (a call to one not configured), or None.

    >>> unknown_tool_reason([{"role": "assistant", "tool_calls": [{"function": {"name": "sql"}}]}], ["python"])
    "completion trace calls tool 'sql', not in tools.use (configured: python)"
    >>> unknown_tool_reason("42", [])
    """
    called = sorted(trace_tools(completion) - set(names))
    if not called:
        return None
    if not names:
        return f"completion is a tool trace (calls {called[0]!r}), but tools.use configures no tools"
    return f"completion trace calls tool {called[0]!r}, not in tools.use (configured: {', '.join(names)})"


@dataclass
class ToolSizes:
    """Token counts of what the tools add, measured with the model's tokenizer and template."""

    longest_prompt_tokens: int
    longest_prompt_row: str
    round_tokens: int  # one tool round of a trace: the call, the tool's answer, the final answer
    answer_cap_tokens: int  # about how many tokens a tool answer at tools.max_output_bytes takes
    rounds_that_fit: int
    longest_trace_tokens: int  # SFT: a prompt with its trace, the longest
    longest_trace_row: str

    def summary(self) -> str:
        return (
            f"prompts with tool schemas up to {self.longest_prompt_tokens} tokens; one tool round "
            f"{self.round_tokens} tokens, room for {self.rounds_that_fit} in grpo.max_completion_length (a full "
            f"tool answer is up to ~{self.answer_cap_tokens})"
        )


def token_count(tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]], prompt: bool) -> int:
    """Tokens of ``messages`` rendered with the tools' schemas (``prompt``: with the assistant's generation prompt)."""
    ids = tokenizer.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=prompt, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def measure_tools(
    config: Any,
    tokenizer: Any,
    toolbox: Toolbox,
    rows: Sequence[dict[str, Any]],
    uses_vllm: bool,
) -> ToolSizes:
    """Measure prompts, traces and one tool round against ``sft.max_length``, ``grpo.max_completion_length`` and
    (on vLLM) ``grpo.generation.vllm_max_model_len``; ToolLengthError names the row and the key to raise."""
    from tasks.environments.traces import tool_sft_examples

    grpo, schemas = config.grpo, toolbox.schemas
    prompts = [
        token_count(tokenizer, prompt_messages(row["prompt"], config.data.system_prompt), schemas, True) for row in rows
    ]
    longest = max(range(len(rows)), key=prompts.__getitem__)
    longest_id, longest_tokens = str(rows[longest]["id"]), prompts[longest]
    if uses_vllm and longest_tokens + grpo.max_completion_length > grpo.generation.vllm_max_model_len:
        raise ToolLengthError(
            f"row {longest_id}: its prompt with the tools' schemas is {longest_tokens} tokens; with "
            f"grpo.max_completion_length ({grpo.max_completion_length}) that is over "
            f"grpo.generation.vllm_max_model_len ({grpo.generation.vllm_max_model_len}): raise it"
        )
    # Traces: the rows' own, and the program-written one of the longest prompt (one sandbox call per trace written).
    sampled = [i for i, row in enumerate(rows) if isinstance(row.get("completion"), list)][:64]
    sampled = sorted({longest, *sampled})
    examples = tool_sft_examples([rows[i] for i in sampled], toolbox, config)
    traces = []
    for index, example in zip(sampled, examples, strict=True):
        full = token_count(tokenizer, example["prompt"] + example["completion"], schemas, False)
        traces.append((full, full - prompts[index], str(rows[index]["id"])))
    trace_tokens, _, trace_row = max(traces)
    if config.sft.enabled and trace_tokens > config.sft.max_length:
        raise ToolLengthError(
            f"row {trace_row}: its prompt with the tools' schemas and its tool trace is {trace_tokens} tokens, over "
            f"sft.max_length ({config.sft.max_length}); SFT would cut the answer off: raise sft.max_length"
        )
    round_tokens = max(completion for _, completion, _ in traces)
    if round_tokens > grpo.max_completion_length:
        raise ToolLengthError(
            f"row {trace_row}: one tool round (call, tool answer, final answer) is {round_tokens} tokens, over "
            f"grpo.max_completion_length ({grpo.max_completion_length}), which counts the tool's answers too; TRL "
            f"drops a turn that overflows, silently: raise it to at least {round_tokens}"
        )
    flood = ("1234567890 abcdefghij\n" * (config.tools.max_output_bytes // 22 + 1))[: config.tools.max_output_bytes]
    cap = len(tokenizer(flood, add_special_tokens=False)["input_ids"])
    return ToolSizes(
        longest_prompt_tokens=longest_tokens,
        longest_prompt_row=longest_id,
        round_tokens=round_tokens,
        answer_cap_tokens=cap,
        rounds_that_fit=grpo.max_completion_length // max(round_tokens, 1),
        longest_trace_tokens=trace_tokens,
        longest_trace_row=trace_row,
    )
