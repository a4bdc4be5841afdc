"""Tool traces a program writes, for SFT to teach the tool-call format: the assistant calls the python tool with
code that computes the answer, reads the tool's real answer (the call runs in the sandbox, through the rollout's
environment, so the trace holds exactly what the tool returns), then gives the final answer.

For the built-in arithmetic task the code is the question's expression (``print(123 * 456)``). Rows of other data
bring their own traces (a ``completion`` that is a list of messages) or are learned without a tool call.
Must not import: ``tasks.training``, ``tasks.tracking``, ``tasks.registry``, ``tasks.evaluation``, Prefect, MLflow.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tasks.config import PYTHON_TOOL
from tasks.environments.toolbox import Toolbox
from tasks.inputs import answer_completion, prompt_messages

logger = logging.getLogger(__name__)
_ARITHMETIC = re.compile(r"What is ([0-9+\-* ]+)\?")


def arithmetic_code(question: str) -> str | None:
    """The program that answers a built-in arithmetic question, or None for another question.

    >>> arithmetic_code("What is 123 * 456? Put the final answer in \\\\boxed{}."), arithmetic_code("Hi")
    ('print(123 * 456)', None)
    """
    found = _ARITHMETIC.match(question.strip())
    return f"print({found.group(1).strip()})" if found else None


def last_user_text(prompt: Any) -> str:
    """The last user message of a prompt (a plain string is its own text).

    >>> last_user_text([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}])
    'q'
    """
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def tool_call_message(name: str, arguments: dict[str, Any], content: str = "") -> dict[str, Any]:
    """An assistant turn that calls one tool, in the form chat templates render.

    >>> tool_call_message("python", {"code": "print(1)"})["tool_calls"][0]["function"]["name"]
    'python'
    """
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


def python_trace(toolbox: Toolbox, code: str, final_answer: str) -> list[dict[str, Any]] | None:
    """The completion of one trace: the call, the tool's real answer (run now, in a fresh rollout), the answer;
    None when the call failed (an error, a timeout, a sandbox down): a trace that reads an error and still gives
    the right answer would teach the model to ignore what its tool says."""
    environment = toolbox.factory()
    environment.reset()
    try:
        answer = environment.python(code)
    except Exception:  # noqa: BLE001 - the sandbox or a limit: no trace
        return None
    if environment.tool_calls[-1].failed:
        return None
    return [
        tool_call_message(PYTHON_TOOL, {"code": code}),
        {"role": "tool", "name": PYTHON_TOOL, "content": answer},
        {"role": "assistant", "content": final_answer},
    ]


def arithmetic_traces(
    toolbox: Toolbox, prompts: Sequence[Any], final_answers: Sequence[str], workers: int = 4
) -> list[list[dict[str, Any]] | None]:
    """A python trace for each built-in arithmetic prompt (None where the prompt is not one, its call failed, or
    no python tool is configured); the calls run a few at a time in the sandbox."""
    if PYTHON_TOOL not in toolbox.names:
        return [None] * len(prompts)
    codes = [arithmetic_code(last_user_text(prompt)) for prompt in prompts]

    def trace(index: int) -> list[dict[str, Any]] | None:
        code = codes[index]
        return None if code is None else python_trace(toolbox, code, final_answers[index])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(trace, range(len(prompts))))


def tool_sft_examples(rows: Sequence[dict[str, Any]], toolbox: Any, config: Any) -> list[dict[str, Any]]:
    """Conversational pairs for a pipeline with tools (TRL renders them with the tools' schemas, ``tools``): the
    completion is the row's own trace (a ``completion`` that is a list of messages), else a trace the program
    writes (built-in arithmetic: a python call and the tool's real answer, ``tasks.environments.traces``; none where
    that call failed, logged), else the answer as one assistant turn."""
    finals = [
        row["completion"]
        if isinstance(row.get("completion"), str)
        else answer_completion(config.data.kind, row["ground_truth"])
        for row in rows
    ]
    prompts = [prompt_messages(row["prompt"], config.data.system_prompt) for row in rows]
    missing = [i for i, row in enumerate(rows) if not isinstance(row.get("completion"), list)]
    written = dict(
        zip(
            missing,
            arithmetic_traces(toolbox, [prompts[i] for i in missing], [finals[i] for i in missing]),
            strict=True,
        )
    )
    failed = [i for i in missing if written[i] is None and arithmetic_code(last_user_text(prompts[i]))]
    if failed and PYTHON_TOOL in toolbox.names:
        logger.warning(
            "%d tool trace(s) left out of SFT, their python call failed (row %s first): those rows teach the answer "
            "alone",
            len(failed),
            rows[failed[0]].get("id", failed[0]),
        )
    schemas = json.dumps(toolbox.schemas)
    examples = []
    for i, row in enumerate(rows):
        own = row.get("completion") if isinstance(row.get("completion"), list) else None
        completion = own or written.get(i) or [{"role": "assistant", "content": finals[i]}]
        examples.append(
            {"prompt": prompts[i], "completion": [dataset_message(m) for m in completion], "tools": schemas}
        )
    return examples


def dataset_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a dataset row can hold it: tool-call arguments as JSON text (a dataset merges the keys of every
    tool's arguments into one struct, giving each call the others' as nulls; the template writes text as it is).

    >>> dataset_message({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
    ...     "name": "python", "arguments": {"code": "1"}}}]})["tool_calls"][0]["function"]["arguments"]
    '{"code": "1"}'
    """
    calls = [
        {"type": "function", "function": {**call["function"], "arguments": _as_text(call["function"].get("arguments"))}}
        for call in message.get("tool_calls") or []
    ]
    return {**message, "tool_calls": calls} if calls else dict(message)


def _as_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
